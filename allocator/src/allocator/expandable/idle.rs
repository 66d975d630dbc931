//! Idle pages, mapped pages lying wholly inside free blocks (the blocks of
//! the idle index, and the tail of the block being carved): taken into the
//! pool of unmapped pages longest idle first, and `empty_cache`, which
//! unmaps every one and releases the pool and the ranges left empty.

use super::stale::Stale;
use super::{Expandable, Place, Tail};
use crate::allocator::Core;
use crate::block::{BlockState, Segment, SegmentId};
use crate::device::{Device, DevicePtr};
use crate::error::AllocError;

/// Whether a mapped page lies wholly inside `[start, end)` of `seg` (a free
/// block there holds idle memory).
pub(in crate::allocator) fn holds_whole_page(seg: &Segment, g: u64, start: u64, end: u64) -> bool {
    let Some(pages) = seg.pages() else {
        return false;
    };
    let lo = (start - seg.addr).div_ceil(g) as u32;
    let hi = ((end - seg.addr) / g) as u32;
    hi > lo && pages.within(lo, hi).next().is_some()
}

/// A page taken out of its page map for `empty_cache`, to be unmapped
/// with the pages beside it ([`Expandable::unmap_runs`]).
struct Unmapping {
    addr: u64,
    size: u64,
    seg: SegmentId,
    at: u32,
    len: u32,
    handle: u64,
}

/// An idle page: when it became idle, where it is, and its free block in
/// the idle index (`None` for the tail of the block being carved).
#[derive(Copy, Clone, Debug)]
struct IdlePage {
    since: u64,
    seg: SegmentId,
    /// Its first granule.
    at: u32,
    block: Option<u32>,
}

impl<E> Expandable<E> {
    /// Appends the mappings wholly inside `[start, end)` of `seg` (idle pages
    /// if that is free) to `out`, as [`IdlePage`]s; returns their bytes.
    fn collect_idle(
        &self,
        core: &Core<E>,
        Tail {
            seg,
            start,
            end,
            since,
        }: Tail,
        block: Option<u32>,
        sizes: &[u64],
        out: &mut Vec<IdlePage>,
    ) -> u64 {
        let g = core.granule();
        let s = core.segment(seg);
        let lo = (start - s.addr).div_ceil(g) as u32;
        let hi = ((end - s.addr) / g) as u32;
        if hi <= lo {
            return 0;
        }
        let pages = s.pages().expect("expandable");
        let mut bytes = 0;
        for (at, _, n) in pages.within(lo, hi) {
            let size = u64::from(n) * g;
            if sizes.is_empty() || sizes.contains(&size) {
                out.push(IdlePage {
                    since,
                    seg,
                    at,
                    block,
                });
                bytes += size;
            }
        }
        bytes
    }

    /// The entry of the idle index after `cursor` (the first with `None`).
    fn next_idle(&self, core: &Core<E>, cursor: Option<(u64, u32)>) -> Option<(u64, u32)> {
        use std::ops::Bound::{Excluded, Unbounded};
        let from = cursor.map_or(Unbounded, Excluded);
        core.idle_index.range((from, Unbounded)).next().copied()
    }

    /// The free block `id` of the idle index as a [`Tail`]-like range.
    fn idle_block(&self, core: &Core<E>, since: u64, id: u32) -> Tail {
        let b = core.blocks.get(id);
        Tail {
            seg: b.segment,
            start: b.addr,
            end: b.addr + b.size,
            since,
        }
    }

    /// The longest idle page's (idle since, stream slot) among pages that
    /// queued work may still touch, if any.
    pub(super) fn oldest_busy_idle<D: Device<Event = E>>(
        &mut self,
        core: &Core<E>,
        dev: &D,
        tail: Tail,
    ) -> Result<Option<(u64, usize)>, AllocError> {
        let g = core.granule();
        let Tail {
            seg,
            start,
            end,
            since,
        } = tail;
        let mut best: Option<(u64, usize)> = None;
        let s = core.segment(seg);
        if holds_whole_page(s, g, start, end) {
            let slot = s.pool.stream_slot();
            if !self.quiescent(dev, slot, since)? {
                best = Some((since, slot));
            }
        }
        // The index is in idle order: the first busy entry is the oldest.
        let mut cursor = None;
        while let Some((since, id)) = self.next_idle(core, cursor) {
            cursor = Some((since, id));
            if best.is_some_and(|b| b.0 <= since) {
                break;
            }
            let seg = self.idle_block(core, since, id).seg;
            let slot = core.slot_of(seg);
            if !self.quiescent(dev, slot, since)? {
                best = Some((since, slot));
                break;
            }
        }
        Ok(best)
    }

    /// Takes idle pages no queued work can touch (every idle page with
    /// `all`, after the device was synchronized), longest idle first, up to
    /// `max_bytes`, into the pool (they stay reserved); returns how many bytes.
    /// Each is unmapped, or with `expandable_shadows` (and not `all`) keeps
    /// its mapping there as a shadow ([`Stale`]). With `early`, the idle
    /// pages of that stream slot are taken too while its queued work may
    /// still touch them: each keeps its old mapping until the stream is past it.
    /// With `sizes`, only pages of those sizes (all sizes if empty).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn take_idle_pages<D: Device<Event = E>>(
        &mut self,
        core: &mut Core<E>,
        dev: &D,
        extra: Option<Tail>,
        max_bytes: u64,
        all: bool,
        early: Option<usize>,
        sizes: &[u64],
    ) -> Result<u64, AllocError> {
        let g = core.granule();
        let mut idle = Vec::new();
        if let Some(tail) = extra {
            let slot = core.slot_of(tail.seg);
            if all || early == Some(slot) || self.quiescent(dev, slot, tail.since)? {
                self.collect_idle(core, tail, None, sizes, &mut idle);
            }
        }
        // Streams found busy in this call (their markers polled once).
        let mut busy: Vec<usize> = Vec::new();
        let mut found = 0;
        let mut cursor = None;
        while found < max_bytes {
            let Some((since, id)) = self.next_idle(core, cursor) else {
                break;
            };
            cursor = Some((since, id));
            let range = self.idle_block(core, since, id);
            let slot = core.slot_of(range.seg);
            if !all
                && early != Some(slot)
                && (busy.contains(&slot) || !self.quiescent(dev, slot, since)?)
            {
                if !busy.contains(&slot) {
                    busy.push(slot);
                }
                continue;
            }
            found += self.collect_idle(core, range, Some(id), sizes, &mut idle);
        }
        idle.sort_unstable_by_key(|p| (p.since, std::cmp::Reverse((p.seg, p.at))));
        let mut bytes = 0;
        let mut emptied: Vec<(u64, u32)> = Vec::new();
        let mut failed = None;
        let mut batch: Vec<Unmapping> = Vec::new();
        for IdlePage {
            since,
            seg,
            at,
            block,
        } in idle
        {
            if bytes >= max_bytes {
                break;
            }
            let slot = core.slot_of(seg);
            let reused = if !all && early == Some(slot) {
                match self.quiescent(dev, slot, since) {
                    Ok(quiet) => !quiet,
                    Err(e) => {
                        // The pages taken so far stay taken: index them below first.
                        failed = Some(e);
                        break;
                    }
                }
            } else {
                false
            };
            let s = core.segments.get_mut(seg.0);
            let seg_addr = s.addr;
            let pages = s.pages_mut().expect("expandable");
            let (h, n) = pages.remove(at).expect("page was mapped");
            // A page with its fill of shadows leaves none (Note [Shadows per page]).
            let shadow = !all && core.config.expandable_shadows && self.stale.has_room(h);
            let size = u64::from(n) * g;
            self.mapped_at.remove(&h);
            if reused || shadow {
                let st = Stale {
                    seg,
                    at,
                    len: n,
                    handle: h,
                    slot,
                    since,
                };
                self.stale.insert(Place { seg, at }, st);
                core.stats.num_pages_reused_early += u64::from(reused);
            } else if all {
                // Unmapped below, with the pages beside it in one call.
                batch.push(Unmapping {
                    addr: seg_addr + u64::from(at) * g,
                    size,
                    seg,
                    at,
                    len: n,
                    handle: h,
                });
            } else if let Err(e) = dev.vmm_unmap(DevicePtr(seg_addr + u64::from(at) * g), size) {
                pages.insert(at, n, h);
                if core.config.expandable_shadows {
                    self.mapped_at.insert(h, Place { seg, at });
                }
                // The pages unmapped so far stay unmapped: index them below first.
                failed = Some(e.into());
                break;
            } else {
                core.stats.num_unmap += 1;
            }
            let kind = s.pool.kind();
            self.pool_page(h, kind, size);
            bytes += size;
            if let Some(id) = block {
                if emptied.last() != Some(&(since, id)) {
                    emptied.push((since, id));
                }
            }
        }
        if let Err(e) = self.unmap_runs(core, dev, batch, &mut bytes) {
            failed = failed.or(Some(e));
        }
        // Blocks left with no whole page leave the index.
        for (since, id) in emptied {
            let t = self.idle_block(core, since, id);
            if !holds_whole_page(core.segment(t.seg), g, t.start, t.end) {
                core.idle_index.remove(&(since, id));
            }
        }
        match failed {
            Some(e) => Err(e),
            None => Ok(bytes),
        }
    }

    /// Unmaps the pages of `batch` (already out of their page maps and in
    /// the pool), each run of pages side by side in one segment with one
    /// call: `cuMemUnmap` takes a range of whole mappings, and one call per
    /// run instead of per page is most of what `empty_cache` costs after a
    /// large run. A run the device refuses is tried page by page; a page it
    /// still refuses goes back to its page map, out of the pool, and its
    /// bytes out of `bytes`.
    #[cold]
    fn unmap_runs<D: Device<Event = E>>(
        &mut self,
        core: &mut Core<E>,
        dev: &D,
        mut batch: Vec<Unmapping>,
        bytes: &mut u64,
    ) -> Result<(), AllocError> {
        batch.sort_unstable_by_key(|u| u.addr);
        let mut result = Ok(());
        let mut i = 0;
        while i < batch.len() {
            let mut j = i + 1;
            while j < batch.len()
                && batch[j].seg == batch[i].seg
                && batch[j].addr == batch[j - 1].addr + batch[j - 1].size
            {
                j += 1;
            }
            let run = &batch[i..j];
            let len = run.iter().map(|u| u.size).sum();
            if dev.vmm_unmap(DevicePtr(run[0].addr), len).is_ok() {
                core.stats.num_unmap += 1;
            } else {
                for u in run {
                    match dev.vmm_unmap(DevicePtr(u.addr), u.size) {
                        Ok(()) => core.stats.num_unmap += 1,
                        Err(e) => {
                            // Still mapped: back where it was, not pooled.
                            core.page_map_mut(u.seg).insert(u.at, u.len, u.handle);
                            if core.config.expandable_shadows {
                                self.mapped_at.insert(
                                    u.handle,
                                    Place {
                                        seg: u.seg,
                                        at: u.at,
                                    },
                                );
                            }
                            self.page_pool.retain(|p| p.handle != u.handle);
                            *bytes -= u.size;
                            if result.is_ok() {
                                result = Err(e.into());
                            }
                        }
                    }
                }
            }
            i = j;
        }
        result
    }

    /// `empty_cache` for expandable segments: once the device is idle, unmap
    /// every idle page and release the whole pool; free the ranges left with
    /// no block and no page.
    pub(in crate::allocator) fn release_expandable<D: Device<Event = E>>(
        &mut self,
        core: &mut Core<E>,
        dev: &D,
    ) -> Result<(), AllocError> {
        self.device_full_at = None;
        let reserved_before = core.reserved();
        self.settle(core, dev)?;
        self.leave_shared(core, dev)?;
        self.take_idle_pages(core, dev, None, u64::MAX, true, None, &[])?;
        if !self.page_pool.is_empty() {
            let peak = core.stats.reserved_bytes.all().peak;
            self.regrow_to = Some(reserved_before.max(peak));
        }
        // (The old mappings went in `settle`: none is left to unmap.)
        self.release_pooled(core, dev, u64::MAX)?;
        for i in 0..self.ranges.len() {
            let mut kept = Vec::with_capacity(self.ranges[i].len());
            for seg in std::mem::take(&mut self.ranges[i]) {
                let s = core.segment(seg);
                let head = core.blocks.get(s.head.0);
                if head.state != BlockState::Free
                    || head.next.is_some()
                    || !s.pages().is_some_and(|p| p.is_empty())
                {
                    kept.push(seg);
                    continue;
                }
                let (addr, size, pool, head_id, since) =
                    (s.addr, s.size, s.pool, s.head, head.freed_at);
                if let Err(e) = dev.vmm_free_range(DevicePtr(addr), size) {
                    kept.push(seg);
                    self.ranges[i] = kept;
                    return Err(e.into());
                }
                core.unfile_released(pool, size, addr, head_id);
                core.idle_index.remove(&(since, head_id.0));
                core.blocks.discard(head_id.0);
                core.segments.remove(seg.0);
                core.segment_by_addr.remove(&addr);
                core.stats.segment.decrease(pool.kind(), 1);
            }
            self.ranges[i] = kept;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::allocator::expandable::testing::*;

    /// Pages of free blocks go to the pool longest idle first, up to the
    /// bytes asked for; a block left with no whole page leaves the idle
    /// index; pages side by side are unmapped with one call.
    #[test]
    fn idle_pages_go_to_the_pool_longest_idle_first() {
        let (dev, a) = alloc(fixed_pages(PAGE, false));
        let [x, y] = holes(&a, &[2 * PAGE, 2 * PAGE])[..] else {
            unreachable!()
        }; // y idle after x
        with_state(&a, |vmm, core, _| {
            let seg = first_range(vmm, large(0));
            assert_eq!(core.idle_index.len(), 2);
            let before = dev.counters();
            let got = vmm.take_idle_pages(core, &dev, None, PAGE, true, None, &[]);
            assert_eq!(got.unwrap(), PAGE);
            assert_eq!(vmm.pooled_bytes(), PAGE);
            let s = core.segment(seg);
            assert!(
                holds_whole_page(s, PAGE, x.0, x.0 + 2 * PAGE),
                "x keeps one"
            );
            let gy = ((y.0 - s.addr) / PAGE) as u32;
            assert_eq!(
                s.pages().unwrap().mapped_granules(gy, gy + 2),
                2,
                "y's stay"
            );
            assert_eq!(core.idle_index.len(), 2);
            // The rest: x's last page and y's two pages, in two calls.
            let got = vmm.take_idle_pages(core, &dev, None, u64::MAX, true, None, &[]);
            assert_eq!(got.unwrap(), 3 * PAGE);
            let after = dev.counters();
            assert_eq!(after.vmm_pages_unmapped - before.vmm_pages_unmapped, 4);
            assert_eq!(after.vmm_unmaps - before.vmm_unmaps, 3);
            assert!(core.idle_index.is_empty());
            assert_eq!(core.reserved(), 6 * PAGE, "pooled pages stay reserved");
        });
    }

    /// Without `all`, a page whose stream may still use it stays mapped
    /// until a marker recorded after its free completed.
    #[test]
    fn only_quiescent_pages_are_taken() {
        let (dev, a) = alloc(fixed_pages(PAGE, false));
        holes(&a, &[2 * PAGE]); // the free records a marker, pending
        with_state(&a, |vmm, core, _| {
            let take = |vmm: &mut Expandable<Event>, core: &mut Core<Event>| {
                vmm.take_idle_pages(core, &dev, None, u64::MAX, false, None, &[])
                    .unwrap()
            };
            assert_eq!(take(vmm, core), 0);
            dev.complete_all_events();
            assert_eq!(take(vmm, core), 2 * PAGE);
        });
    }

    /// `empty_cache`: every idle page unmapped and released, ranges left
    /// with no block and no page given back, the rest kept.
    #[test]
    fn release_expandable_gives_back_what_is_free() {
        let (dev, a) = alloc(fixed_pages(PAGE, false));
        let x = a.malloc(3 * PAGE, S0).unwrap();
        let y = a.malloc(PAGE, S1).unwrap();
        a.free(x).unwrap();
        with_state(&a, |vmm, core, _| {
            vmm.release_expandable(core, &dev).unwrap();
            assert!(!vmm.has_ranges(large(0).index()), "x's range went");
            assert!(vmm.has_ranges(large(1).index()), "y's range stays");
            assert_eq!(core.reserved(), PAGE);
            assert_eq!(vmm.pooled_bytes(), 0);
            let c = dev.counters();
            assert_eq!((c.vmm_creates - c.vmm_releases, c.vmm_reserves), (1, 2));
        });
        a.free(y).unwrap();
    }
}
