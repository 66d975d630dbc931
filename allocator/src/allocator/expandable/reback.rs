//! Giving back the free part of pages partly under live blocks
//! (`Config::expandable_reback`), the last rung before an expandable
//! allocation fails.
//!
//! A page larger than the device's granularity can only be unmapped whole,
//! so one that a live block reaches into keeps its free part reserved. Under
//! the virtual memory API the address of a block is not tied to the memory
//! behind it: the granules under live blocks are copied to new
//! granularity-sized pages, mapped first at a scratch range, and then mapped
//! at the same addresses in place of the big page, which goes back to the
//! device. No tensor moves (its address stays), and nothing happens in a run
//! that fits.

use super::{Expandable, Place};
use crate::allocator::Core;
use crate::block::{BlockState, PoolKind, SegmentId};
use crate::device::{Device, DeviceError, DevicePtr};
use crate::error::AllocError;

/// A page to give back: its segment, first granule, handle, length in
/// granules, and the granules under live blocks (in order).
struct Reback {
    seg: SegmentId,
    at: u32,
    handle: u64,
    len: u32,
    live: Vec<u32>,
}

impl<E> Expandable<E> {
    /// The last rungs before an expandable allocation fails, each as its key
    /// says and not while a stream is captured into a CUDA graph: the free
    /// part of pages partly under live blocks given back ([`Self::reback`]),
    /// then pages shared by granules whose live bytes do not meet
    /// ([`Self::share`]). Each makes room for the other (a swap needs room
    /// for its new pages first; the pages it frees become granules that may
    /// share): in turn while either gives something back. Returns the bytes
    /// given back.
    #[cold]
    pub(in crate::allocator) fn last_rungs<D: Device<Event = E>>(
        &mut self,
        core: &mut Core<E>,
        dev: &D,
    ) -> Result<u64, AllocError> {
        let mut freed = 0;
        loop {
            let mut round = 0;
            if core.config.expandable_reback && !core.any_stream_capturing(dev) {
                round += self.reback(core, dev)?;
            }
            if core.config.expandable_share && !core.any_stream_capturing(dev) {
                round += self.share(core, dev)?;
            }
            freed += round;
            if round == 0 || !core.config.expandable_reback {
                return Ok(freed);
            }
        }
    }

    /// Gives back the free part of every page larger than a granule that
    /// lies partly under live blocks, after synchronizing the device (no
    /// queued work may touch a page while it is swapped; the caller checks
    /// that no stream is captured). Stops at the first page the device has
    /// no room to copy. Returns the bytes given back.
    #[cold]
    fn reback<D: Device<Event = E>>(
        &mut self,
        core: &mut Core<E>,
        dev: &D,
    ) -> Result<u64, AllocError> {
        let mut plans = self.reback_plans(core);
        if plans.is_empty() {
            return Ok(0);
        }
        // Old mappings would keep pages alive and are mapped nowhere useful;
        // pooled pages are of the big size: room for granules first.
        self.settle(core, dev)?;
        self.release_pooled(core, dev, u64::MAX)?;
        let g = core.granule();
        // Fewest granules to copy first: each swap needs room for its new
        // pages before the old page goes, and leaves more room for the next.
        plans.sort_by_key(|p| p.live.len());
        let mut freed = 0;
        for plan in plans {
            if !self.reback_page(core, dev, &plan)? {
                break;
            }
            freed += u64::from(plan.len - plan.live.len() as u32) * g;
        }
        Ok(freed)
    }

    /// Gives `handle` (`bytes` counted under `kind`) back to the device;
    /// one the device refuses stays pooled, still counted. Returns the
    /// bytes given back.
    pub(super) fn release_or_pool<D: Device<Event = E>>(
        &mut self,
        core: &mut Core<E>,
        dev: &D,
        handle: u64,
        kind: PoolKind,
        bytes: u64,
    ) -> u64 {
        match dev.vmm_release_page(handle) {
            Ok(()) => {
                core.stats.num_page_release += 1;
                core.stats.reserved_bytes.decrease(kind, bytes);
                bytes
            }
            Err(_) => {
                self.pool_page(handle, kind, bytes);
                0
            }
        }
    }

    /// The pages larger than a granule with granules both under live blocks
    /// (any block not free) and not, in every range.
    fn reback_plans(&self, core: &Core<E>) -> Vec<Reback> {
        let g = core.granule();
        let mut plans = Vec::new();
        for &seg in self.ranges.iter().flatten() {
            let s = core.segment(seg);
            let Some(pages) = s.pages() else { continue };
            // Granule spans of the blocks in use, in address order.
            let mut used: Vec<(u32, u32)> = Vec::new();
            let mut cur = Some(s.head);
            while let Some(id) = cur {
                let b = core.blocks.get(id.0);
                if b.state != BlockState::Free {
                    let first = ((b.addr - s.addr) / g) as u32;
                    let last = (b.addr + b.size - s.addr).div_ceil(g) as u32;
                    match used.last_mut() {
                        Some((_, e)) if *e >= first => *e = (*e).max(last),
                        _ => used.push((first, last)),
                    }
                }
                cur = b.next;
            }
            for (at, handle, len) in pages.within(0, (s.size / g) as u32) {
                // A page under a shared block stays (Note [Shared blocks are pinned]).
                if len < 2 || core.pinned_in(seg, at, at + len) {
                    continue;
                }
                let live: Vec<u32> = used
                    .iter()
                    .flat_map(|&(a, b)| a.max(at)..b.min(at + len))
                    .collect();
                if !live.is_empty() && live.len() < len as usize {
                    plans.push(Reback {
                        seg,
                        at,
                        handle,
                        len,
                        live,
                    });
                }
            }
        }
        plans
    }

    /// Swaps one page for granule pages under its live granules: new pages
    /// mapped at a scratch range, the live granules copied there, the page
    /// unmapped, the new pages mapped in its place, the page released. A
    /// failure before the new pages are all in place leaves the page mapped
    /// where it was, holding what it held; `false` where the device had no
    /// room for the new pages.
    fn reback_page<D: Device<Event = E>>(
        &mut self,
        core: &mut Core<E>,
        dev: &D,
        p: &Reback,
    ) -> Result<bool, AllocError> {
        let g = core.granule();
        let s = core.segment(p.seg);
        let (base, kind) = (s.addr, s.pool.kind());
        let k = p.live.len();
        // The new pages are held beside the old one for a moment: within the cap.
        let cap = self.limits(core).cap;
        if core.reserved() + k as u64 * g > cap {
            return Ok(false);
        }
        let scratch = match dev.vmm_reserve(k as u64 * g) {
            Ok(ptr) => ptr,
            Err(DeviceError::OutOfMemory) => return Ok(false),
            Err(e) => return Err(e.into()),
        };
        core.stats.num_vmm_reserve += 1;
        let at_scratch = |i: usize| DevicePtr(scratch.0 + i as u64 * g);
        let in_place = |x: u32| DevicePtr(base + u64::from(x) * g);
        let old = in_place(p.at);
        let old_bytes = u64::from(p.len) * g;
        // Pages created, and how many of them are mapped at the scratch range.
        let mut new: Vec<u64> = Vec::with_capacity(k);
        let mut scratched = 0;
        let mut placed = 0;
        let mut unmapped = false;
        let mut step = || -> Result<(), DeviceError> {
            for (i, &x) in p.live.iter().enumerate() {
                new.push(dev.vmm_create_page(g)?);
                dev.vmm_map(at_scratch(i), new[i], g)?;
                scratched += 1;
                dev.copy(at_scratch(i), in_place(x), g)?;
            }
            dev.vmm_unmap(old, old_bytes)?;
            unmapped = true;
            for (&x, &page) in p.live.iter().zip(&new) {
                dev.vmm_map(in_place(x), page, g)?;
                placed += 1;
            }
            Ok(())
        };
        let swapped = step();
        let unwind = |dev: &D, new: &[u64], scratched: usize, placed: usize, unmapped: bool| {
            // Best effort: what fails to unwind stays mapped or held.
            for (&x, _) in p.live.iter().zip(new).take(placed) {
                let _ = dev.vmm_unmap(in_place(x), g);
            }
            if unmapped {
                let _ = dev.vmm_map(old, p.handle, old_bytes);
            }
            for i in 0..scratched {
                let _ = dev.vmm_unmap(at_scratch(i), g);
            }
            for &page in new {
                let _ = dev.vmm_release_page(page);
            }
            let _ = dev.vmm_free_range(scratch, k as u64 * g);
        };
        if let Err(e) = swapped {
            unwind(dev, &new, scratched, placed, unmapped);
            return match e {
                DeviceError::OutOfMemory => Ok(false),
                e => Err(e.into()),
            };
        }
        core.stats.num_page_create += k as u64;
        core.stats.num_map += 2 * k as u64;
        core.stats.num_unmap += 1;
        let pages = core.page_map_mut(p.seg);
        pages.remove(p.at);
        for (&x, &page) in p.live.iter().zip(&new) {
            pages.insert(x, 1, page);
        }
        if core.config.expandable_shadows {
            self.mapped_at.remove(&p.handle);
            for (&x, &page) in p.live.iter().zip(&new) {
                self.mapped_at.insert(page, Place { seg: p.seg, at: x });
            }
        }
        // The new pages are counted as the old one's live part; the old
        // page leaves the count once released (pooled, still counted, if
        // the device refuses).
        core.stats.reserved_bytes.increase(kind, k as u64 * g);
        self.release_or_pool(core, dev, p.handle, kind, old_bytes);
        core.stats.num_pages_rebacked += 1;
        // (The idle index stands: no free block held the old page, partly
        // under live blocks, or holds a new one, all under live blocks.)
        // Every scratch mapping is tried; the first failure is reported.
        let mut done = Ok(());
        for i in 0..k {
            let unmapped = dev.vmm_unmap(at_scratch(i), g);
            done = done.and(unmapped);
        }
        let freed_range = dev.vmm_free_range(scratch, k as u64 * g);
        done.and(freed_range)?;
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use crate::allocator::expandable::testing::*;
    use crate::config::Config;

    /// The last rungs give back the free part of a big page partly under a
    /// live block, and nothing while a stream is captured into a CUDA graph.
    #[test]
    fn the_last_rungs_wait_for_no_capture() {
        let config = Config {
            expandable_share: false,
            ..fixed_pages(8 * MIB, true)
        };
        let (dev, a) = alloc(config);
        a.malloc(PAGE, S0).unwrap(); // one 8 MiB page, a granule of it live
        with_state(&a, |vmm, core, _| {
            dev.set_capturing(S0, true);
            assert_eq!(vmm.last_rungs(core, &dev).unwrap(), 0);
            dev.set_capturing(S0, false);
            assert_eq!(vmm.last_rungs(core, &dev).unwrap(), 6 * MIB);
            assert_eq!(core.reserved(), PAGE);
            assert_eq!(core.stats.num_pages_rebacked, 1);
        });
    }
}
