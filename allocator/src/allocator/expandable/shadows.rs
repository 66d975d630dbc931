//! The old mappings of moved pages at work: a shadow taken back where its
//! page is wanted again (`Expandable::take_back`), old mappings unmapped
//! once their stream is past them or before another page is mapped there,
//! and the list of those left (`Expandable::stale_mappings`). Their records
//! are [`StaleMap`]'s (`stale.rs`).

use super::idle::holds_whole_page;
use super::stale::Stale;
use super::{Expandable, Place, Tail};
use crate::allocator::Core;
use crate::block::{BlockId, SegmentId};
use crate::device::{Device, DevicePtr};
use crate::error::AllocError;

/// A mapping that holds no memory of its own: the old mapping of a page
/// reused early or moved ([`Expandable::stale_mappings`]).
#[derive(Copy, Clone, Debug)]
pub(in crate::allocator) struct OldMapping {
    pub(in crate::allocator) addr: u64,
    pub(in crate::allocator) bytes: u64,
    /// Whether the page is pooled rather than mapped under a block (for a
    /// page with several old mappings, told on its first only).
    pub(in crate::allocator) pooled: bool,
}

impl<E> Expandable<E> {
    /// Unmaps the old mappings of pages reused early whose stream is past
    /// them (with `expandable_shadows` they stay, as shadows, but for those
    /// of pages past their fill: Note [Shadows per page]).
    pub(super) fn retire_stale<D: Device<Event = E>>(
        &mut self,
        core: &mut Core<E>,
        dev: &D,
    ) -> Result<(), AllocError> {
        if core.config.expandable_shadows {
            for k in self.stale.over_limit() {
                let st = self.stale.at(&k);
                if self.quiescent(dev, st.slot, st.since)? {
                    self.unmap_stale(core, dev, k)?;
                }
            }
            return Ok(());
        }
        for k in self.stale.places() {
            let st = self.stale.at(&k);
            if self.quiescent(dev, st.slot, st.since)? {
                self.unmap_stale(core, dev, k)?;
            }
        }
        Ok(())
    }

    /// Unmaps the old mapping at `key` (its stream is past it) and forgets it.
    fn unmap_stale<D: Device<Event = E>>(
        &mut self,
        core: &mut Core<E>,
        dev: &D,
        key: Place,
    ) -> Result<(), AllocError> {
        let g = core.granule();
        let st = self.stale.at(&key);
        let addr = core.granule_addr(st.seg, st.at);
        dev.vmm_unmap(DevicePtr(addr), u64::from(st.len) * g)?;
        self.stale.remove(&key);
        core.stats.num_unmap += 1;
        Ok(())
    }

    /// Before granules `first..last` of `seg` are mapped: the old mappings
    /// there go, after their stream's marker if it is not past them yet.
    pub(super) fn clear_stale_in<D: Device<Event = E>>(
        &mut self,
        core: &mut Core<E>,
        dev: &D,
        seg: SegmentId,
        first: u32,
        last: u32,
    ) -> Result<(), AllocError> {
        if self.stale.is_empty() {
            return Ok(());
        }
        let keys: Vec<Place> = self
            .stale_in(core, seg, first, last)
            .map(|st| Place {
                seg: st.seg,
                at: st.at,
            })
            .collect();
        self.unmap_stale_keys(core, dev, keys)
    }

    /// The old mappings of `seg` that overlap granules `first..last`.
    pub(super) fn stale_in(
        &self,
        core: &Core<E>,
        seg: SegmentId,
        first: u32,
        last: u32,
    ) -> impl Iterator<Item = &Stale> + '_ {
        // A mapping is at most a big page long: one starting that far back may reach in.
        let g = core.granule();
        let back = (core.segment(seg).page_size() / g) as u32;
        let from = Place {
            seg,
            at: first.saturating_sub(back.saturating_sub(1)),
        };
        self.stale
            .range(from..Place { seg, at: last })
            .map(|(_, st)| st)
            .filter(move |st| st.at + st.len > first)
    }

    /// Unmaps the old mappings at `keys`, each after its stream's marker.
    pub(super) fn unmap_stale_keys<D: Device<Event = E>>(
        &mut self,
        core: &mut Core<E>,
        dev: &D,
        keys: Vec<Place>,
    ) -> Result<(), AllocError> {
        for k in keys {
            let st = self.stale.at(&k);
            self.wait_quiescent(core, dev, st.slot, st.since)?;
            self.unmap_stale(core, dev, k)?;
        }
        Ok(())
    }

    /// The page whose shadow covers exactly granules `at..at + n` of `seg`.
    pub(super) fn shadow_at(&self, seg: SegmentId, at: u32, n: u32) -> Option<u64> {
        self.stale
            .get(&Place { seg, at })
            .filter(|st| st.len == n)
            .map(|st| st.handle)
    }

    /// Puts page `handle` in the pool if it lies idle in a free block and no
    /// queued work can touch it (or it is the requesting stream's, with
    /// early reuse), its mapping there left as a shadow: no driver call. The
    /// block being carved is out of the bins meanwhile, so its pages stay.
    pub(super) fn take_back<D: Device<Event = E>>(
        &mut self,
        core: &mut Core<E>,
        dev: &D,
        handle: u64,
        tail: Tail,
    ) -> Result<(), AllocError> {
        let Some(&Place { seg, at }) = self.mapped_at.get(&handle) else {
            return Ok(()); // pooled already
        };
        let g = core.granule();
        let s = core.segment(seg);
        let Some((_, _, n)) = s.pages().expect("expandable").covering(at) else {
            return Ok(());
        };
        let (lo, hi) = (s.addr + u64::from(at) * g, s.addr + u64::from(at + n) * g);
        // Idle: wholly inside a free block of the idle index (free, in the
        // bins, holding a whole page), which holds far fewer blocks than the
        // range's list.
        let found = core.idle_index.iter().find(|&&(_, raw)| {
            let b = core.blocks.get(raw);
            b.segment == seg && b.addr <= lo && hi <= b.addr + b.size
        });
        let Some(&(since, raw)) = found else {
            return Ok(()); // under a live block, shared with one, or awaiting events
        };
        let id = BlockId(raw);
        let slot = s.pool.stream_slot();
        let requester = core.slot_of(tail.seg);
        let quiet = self.quiescent(dev, slot, since)?;
        let early = slot == requester;
        if !(quiet || early) {
            return Ok(());
        }
        let s = core.segments.get_mut(seg.0);
        let kind = s.pool.kind();
        s.pages_mut().expect("expandable").remove(at);
        self.mapped_at.remove(&handle);
        let st = Stale {
            seg,
            at,
            len: n,
            handle,
            slot,
            since,
        };
        self.stale.insert(Place { seg, at }, st);
        core.stats.num_pages_reused_early += u64::from(!quiet);
        self.pool_page(handle, kind, u64::from(n) * g);
        let b = core.blocks.get(id.0);
        if !holds_whole_page(core.segment(seg), g, b.addr, b.addr + b.size) {
            core.idle_index.remove(&(since, id.0));
        }
        Ok(())
    }

    /// The old mappings of pages reused early, not yet unmapped.
    pub(in crate::allocator) fn stale_mappings(&self, core: &Core<E>) -> Vec<OldMapping> {
        let Some(g) = core.granularity else {
            return Vec::new();
        };
        // A page reused early twice has two old mappings: it counts as pooled once.
        let stale: Vec<&Stale> = self.stale.values().collect();
        stale
            .iter()
            .enumerate()
            .map(|(i, st)| {
                let addr = core.granule_addr(st.seg, st.at);
                let pooled = self.page_pool.iter().any(|p| p.handle == st.handle)
                    && !stale[..i].iter().any(|o| o.handle == st.handle);
                OldMapping {
                    addr,
                    bytes: u64::from(st.len) * g,
                    pooled,
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use crate::allocator::expandable::testing::*;
    use crate::device::DevicePtr;
    use crate::simulated::SimulatedDevice;

    /// An allocator with shadows in which x's two pages moved under y (x
    /// free, in front of a live block): returns it with x and y.
    fn moved() -> (SimulatedDevice, Alloc, DevicePtr, DevicePtr) {
        let dev = SimulatedDevice::new(1 << 40);
        let (a, x, y, _) = crate::allocator::tests::moved_with_shadows(&dev, false);
        (dev, a, x, y)
    }

    /// A moved page keeps its old mapping as a shadow, listed and found
    /// where it lies; mapping another page there unmaps it first.
    #[test]
    fn shadows_stay_until_their_place_is_needed() {
        let (dev, a, x, y) = moved();
        with_state(&a, |vmm, core, _| {
            let seg = first_range(vmm, large(0));
            let gx = ((x.0 - core.segment(seg).addr) / PAGE) as u32;
            let old = vmm.stale_mappings(core);
            let at: Vec<(u64, u64, bool)> =
                old.iter().map(|m| (m.addr, m.bytes, m.pooled)).collect();
            assert_eq!(at, [(x.0, PAGE, false), (x.0 + PAGE, PAGE, false)]);
            let h = vmm.shadow_at(seg, gx, 1).expect("a shadow at x");
            let now = vmm.mapped_at[&h];
            assert!(core.granule_addr(now.seg, now.at) >= y.0, "mapped under y");
            vmm.retire_stale(core, &dev).unwrap();
            assert_eq!(vmm.stale_mappings(core).len(), 2, "shadows stay");
            let before = dev.counters();
            vmm.clear_stale_in(core, &dev, seg, gx, gx + 2).unwrap();
            assert_eq!(dev.counters().vmm_unmaps - before.vmm_unmaps, 2);
            assert!(vmm.stale_mappings(core).is_empty());
        });
    }

    /// A page wanted back at its shadow leaves its idle place with no
    /// driver call: pooled, its mapping there a shadow in turn.
    #[test]
    fn an_idle_page_is_taken_back_with_no_call() {
        let (dev, a, x, y) = moved();
        a.free(y).unwrap();
        dev.complete_all_events();
        with_state(&a, |vmm, core, _| {
            let seg = first_range(vmm, large(0));
            let gx = ((x.0 - core.segment(seg).addr) / PAGE) as u32;
            let h = vmm.shadow_at(seg, gx, 1).unwrap();
            let tail = whole(core, free_block(core, seg, x.0));
            let before = dev.counters();
            vmm.take_back(core, &dev, h, tail).unwrap();
            assert_eq!(dev.counters().vmm_unmaps, before.vmm_unmaps);
            assert!(vmm.page_pool.iter().any(|p| p.handle == h));
            assert!(!vmm.mapped_at.contains_key(&h));
            let pooled: Vec<u64> = vmm
                .stale_mappings(core)
                .iter()
                .filter(|m| m.pooled)
                .map(|m| m.addr)
                .collect();
            assert_eq!(pooled, [x.0], "told once, on its first old mapping");
            assert_eq!(vmm.stale_mappings(core).len(), 3);
        });
    }
}
