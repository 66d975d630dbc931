//! Stream markers and quiescence: marker events recorded on a stream as its
//! blocks are freed tell when no queued work can touch a page of them any
//! longer; and the waits for them (or for a stream, on the device) when a
//! page must move sooner.

use super::Expandable;
use crate::allocator::Core;
use crate::block::PoolId;
use crate::device::{Device, DeviceError};
use crate::error::AllocError;
use std::collections::VecDeque;

/// Operations (mallocs and frees, all streams) between two marker events
/// recorded on one stream as blocks are freed there.
pub(in crate::allocator) const MARKER_INTERVAL: u64 = 128;

/// Marker events outstanding per stream at most: enough to cover a few
/// thousand operations of queued work, so that moving a page waits for the
/// work up to its block's free and no further.
pub(in crate::allocator) const MAX_MARKERS: usize = 64;

/// A marker event recorded on a stream: once it completed, the stream's
/// work up to its operation count is done.
struct Marker<E> {
    /// Blocks of the stream freed before this operation count are
    /// quiescent once the event completed.
    before: u64,
    event: E,
}

/// Expandable segments, per stream: marker events recorded on the stream
/// as blocks are freed there, oldest first. Once one completed, pages of
/// blocks freed on the stream before it can be unmapped.
pub(super) struct Marks<E> {
    queue: VecDeque<Marker<E>>,
    /// Blocks of this stream freed before this operation count are quiescent.
    quiescent_before: u64,
    /// Operation count of the last marker recorded.
    last: u64,
}

impl<E> Marks<E> {
    /// Retires the oldest marker if it has completed; whether it had.
    fn retire_front_if_done<D: Device<Event = E>>(&mut self, dev: &D) -> Result<bool, DeviceError> {
        match self.queue.front() {
            Some(m) if dev.event_completed(&m.event)? => {}
            _ => return Ok(false),
        }
        let m = self.queue.pop_front().expect("front exists");
        dev.release_event(m.event);
        self.quiescent_before = self.quiescent_before.max(m.before);
        Ok(true)
    }

    /// Queues event `e`, recorded on the stream at operation count `clock`.
    fn push(&mut self, clock: u64, e: E) {
        self.queue.push_back(Marker {
            before: clock + 1,
            event: e,
        });
        self.last = clock;
    }
}

impl<E> Default for Marks<E> {
    fn default() -> Self {
        Marks {
            queue: VecDeque::new(),
            quiescent_before: 0,
            last: 0,
        }
    }
}

impl<E> Expandable<E> {
    /// The markers of stream slot `slot`, made on its first use: a stream
    /// costs the feature nothing until a block of it is freed (a pool's
    /// ranges likewise wait for its first request, `reserve_range`).
    #[inline]
    fn marks_mut(&mut self, slot: usize) -> &mut Marks<E> {
        if slot >= self.marks.len() {
            // As if made with the stream and dropped at each synchronize since.
            let before = self.synced_before;
            self.marks.resize_with(slot + 1, || Marks {
                quiescent_before: before,
                ..Marks::default()
            });
        }
        &mut self.marks[slot]
    }

    /// Records a marker on the stream of `pool` as a block of it is freed:
    /// one per `MARKER_INTERVAL` operations, at most `MAX_MARKERS` outstanding
    /// (the oldest retired first if complete).
    pub(in crate::allocator) fn mark_free<D: Device<Event = E>>(
        &mut self,
        core: &mut Core<E>,
        dev: &D,
        pool: PoolId,
    ) {
        let slot = pool.stream_slot();
        let clock = core.clock;
        let m = self.marks_mut(slot);
        if !m.queue.is_empty() && clock < m.last + MARKER_INTERVAL {
            return;
        }
        if m.queue.len() >= MAX_MARKERS && !m.retire_front_if_done(dev).unwrap_or(false) {
            // Asked again only an interval later: a query is a driver call,
            // and a stream far behind would make every free pay one.
            m.last = clock;
            return;
        }
        // (Not behind a CUDA graph capture: the marker would join the graph.)
        let stream = core.stream_list[slot];
        if dev.stream_capturing(stream) {
            return;
        }
        if let Ok(e) = dev.record_event(stream) {
            m.push(clock, e);
            core.stats.num_events_recorded += 1;
        }
    }

    /// Whether a block of stream slot `slot` that became free at `since` is
    /// quiescent (no queued work can touch it), retiring completed markers.
    pub(super) fn quiescent<D: Device<Event = E>>(
        &mut self,
        dev: &D,
        slot: usize,
        since: u64,
    ) -> Result<bool, AllocError> {
        // A stream without markers yet: quiescent up to the last synchronize
        // (as its markers, made now, would say), and no marker is made for
        // a look.
        let Some(m) = self.marks.get_mut(slot) else {
            return Ok(since < self.synced_before);
        };
        while since >= m.quiescent_before {
            if !m.retire_front_if_done(dev)? {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Blocks until a block of stream slot `slot` freed at `since` is
    /// quiescent: waits for the stream's markers, oldest first, and if none
    /// recorded after `since` is left, for an event recorded now.
    pub(super) fn wait_quiescent<D: Device<Event = E>>(
        &mut self,
        core: &mut Core<E>,
        dev: &D,
        slot: usize,
        since: u64,
    ) -> Result<(), AllocError> {
        let clock = core.clock;
        let stream = core.stream_list[slot];
        let m = self.marks_mut(slot);
        while since >= m.quiescent_before {
            let marker = match m.queue.pop_front() {
                Some(front) => front,
                None => Marker {
                    before: clock + 1,
                    event: dev.record_event(stream)?,
                },
            };
            let waited = dev.wait_event(&marker.event);
            dev.release_event(marker.event);
            waited?;
            m.quiescent_before = m.quiescent_before.max(marker.before);
            core.stats.num_event_waits += 1;
            core.stats.num_marker_waits += 1;
        }
        Ok(())
    }

    /// Waits for the oldest event guarding a block freed while other streams
    /// used it, and returns the block to the bins if that was its last;
    /// returns whether there was one. (Expandable allocators have no slabs
    /// and always cache: a freed block goes straight to the bins.)
    pub(super) fn wait_one_pending<D: Device<Event = E>>(
        core: &mut Core<E>,
        dev: &D,
    ) -> Result<bool, AllocError> {
        let Some(i) = core.pending.iter().position(|(_, q)| !q.is_empty()) else {
            return Ok(false);
        };
        let (ev, id) = core.pending[i].1.pop_front().expect("not empty");
        if let Err(e) = dev.wait_event(&ev) {
            core.pending[i].1.push_front((ev, id));
            return Err(e.into());
        }
        dev.release_event(ev);
        core.stats.num_event_waits += 1;
        core.pending.retain(|(_, q)| !q.is_empty());
        if core.event_done(id) {
            let (kind, slab) = core.release_block(id);
            debug_assert!(!slab && core.config.caching);
            core.merge_counted(id, kind);
        }
        Ok(true)
    }

    /// Makes stream slot `waiter` wait on the device for the work stream slot
    /// `slot` queued so far, through an event recorded now that joins the
    /// slot's markers.
    #[cold]
    pub(super) fn stream_wait<D: Device<Event = E>>(
        &mut self,
        core: &mut Core<E>,
        dev: &D,
        slot: usize,
        waiter: usize,
    ) -> Result<(), AllocError> {
        let (from, to) = (core.stream_list[slot], core.stream_list[waiter]);
        if let Some(e) = core.wait_for_stream(dev, from, to, false)? {
            self.marks_mut(slot).push(core.clock, e);
        }
        Ok(())
    }

    /// After a device synchronize every marker has completed.
    fn drop_markers<D: Device<Event = E>>(&mut self, core: &Core<E>, dev: &D) {
        let clock = core.clock;
        self.synced_before = clock + 1;
        for m in &mut self.marks {
            for marker in m.queue.drain(..) {
                dev.release_event(marker.event);
            }
            m.quiescent_before = clock + 1;
        }
    }

    /// Waits for the device, forgets the markers (every stream is past
    /// them) and unmaps every old mapping: what `empty_cache` and the swap
    /// of pinned pages start from.
    pub(super) fn settle<D: Device<Event = E>>(
        &mut self,
        core: &mut Core<E>,
        dev: &D,
    ) -> Result<(), AllocError> {
        dev.synchronize()?;
        self.drop_markers(core, dev);
        let places = self.stale.places();
        self.unmap_stale_keys(core, dev, places)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::allocator::expandable::testing::*;

    /// A free records a marker on its stream, one per `MARKER_INTERVAL`
    /// operations; a block freed before a marker is quiescent once the
    /// marker completed, or once waited for.
    #[test]
    fn markers_tell_when_freed_blocks_are_quiescent() {
        let (dev, a) = alloc(fixed_pages(PAGE, false));
        a.malloc(PAGE, S0).unwrap();
        with_state(&a, |vmm, core, _| {
            let pool = large(0);
            let recorded = || dev.counters().events_recorded;
            let before = recorded();
            let freed = core.clock;
            vmm.mark_free(core, &dev, pool);
            assert_eq!(recorded() - before, 1);
            assert!(!vmm.quiescent(&dev, 0, freed).unwrap());
            core.clock += MARKER_INTERVAL - 1;
            vmm.mark_free(core, &dev, pool);
            assert_eq!(recorded() - before, 1, "within the interval");
            dev.complete_all_events();
            assert!(vmm.quiescent(&dev, 0, freed).unwrap());
            assert!(
                !vmm.quiescent(&dev, 0, core.clock).unwrap(),
                "freed after it"
            );
            core.clock += 1;
            vmm.mark_free(core, &dev, pool);
            assert_eq!(recorded() - before, 2);
            let freed = core.clock;
            let waits = core.stats.num_marker_waits;
            vmm.wait_quiescent(core, &dev, 0, freed).unwrap();
            assert_eq!(core.stats.num_marker_waits - waits, 1);
            assert!(vmm.quiescent(&dev, 0, freed).unwrap());
        });
    }

    /// After a synchronize every block freed before it is quiescent, on
    /// streams with markers and on those without any yet.
    #[test]
    fn a_synchronize_makes_every_stream_quiescent() {
        let (dev, a) = alloc(fixed_pages(PAGE, false));
        a.malloc(PAGE, S0).unwrap();
        with_state(&a, |vmm, core, _| {
            vmm.mark_free(core, &dev, large(0));
            let freed = core.clock;
            assert!(!vmm.quiescent(&dev, 0, freed).unwrap());
            assert!(!vmm.quiescent(&dev, 7, freed).unwrap(), "no markers yet");
            vmm.settle(core, &dev).unwrap();
            assert!(vmm.quiescent(&dev, 0, freed).unwrap());
            assert!(vmm.quiescent(&dev, 7, freed).unwrap());
            assert!(vmm.marks_mut(9).queue.is_empty());
            assert!(vmm.quiescent(&dev, 9, freed).unwrap(), "made after it");
        });
    }
}
