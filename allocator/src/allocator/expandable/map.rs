//! Mapping the pages under a block being carved (`Expandable::map_range`):
//! the pages planned for its unmapped granules (big pages, or granules at
//! its edges, or granules only under pressure), then each planned page
//! mapped: a shadow taken back with no call, or a gathered page.

use super::gather::Need;
use super::ranges::smaller_page;
use super::{Expandable, Place, Tail};
use crate::allocator::Core;
use crate::bins::Entry;
use crate::block::SegmentId;
use crate::config::EdgePages;
use crate::device::{Device, DevicePtr};
use crate::error::AllocError;

/// Whether every granule under `[start, end)` of `seg` is mapped.
#[inline]
fn range_mapped<E>(core: &Core<E>, seg: SegmentId, start: u64, end: u64) -> bool {
    let g = core.granule();
    let s = core.segment(seg);
    let first = ((start - s.addr) / g) as u32;
    let last = (end - s.addr).div_ceil(g) as u32;
    s.pages().expect("expandable").is_mapped(first, last)
}

/// Whether the pages under `rounded` bytes carved at the start of free
/// block `e` are all mapped already (no page would move to serve it).
#[inline]
pub(super) fn carve_mapped<E>(core: &Core<E>, e: Entry, rounded: u64) -> bool {
    range_mapped(
        core,
        core.blocks.get(e.id.0).segment,
        e.addr,
        e.addr + rounded,
    )
}

/// How a mapping chooses its page sizes (see `map_range`).
#[derive(Copy, Clone, PartialEq, Eq, Debug)]
enum Style {
    /// Big pages, whole ones at the edges too.
    BigEdges,
    /// Big pages wholly under the block, granules at the edges.
    SmallEdges,
    /// Granules only.
    Granules,
}

/// A page to map, planned ([`Expandable::plan`]).
#[derive(Copy, Clone, Debug)]
struct Planned {
    /// Its first granule.
    at: u32,
    /// Granules.
    len: u32,
}

impl<E> Expandable<E> {
    /// Maps every unmapped granule under `rounded` bytes carved at the
    /// start of free block `fit` (out of the bins; its `freed_at` still when
    /// it became free). The rest of the block stays free after the split
    /// (its [`Tail`]): pages wholly in it count as idle too.
    ///
    /// Page sizes (`Config::expandable_edges`, docs/POLICY.md): big pages
    /// (`Segment::page_size`) where a whole aligned big page is unmapped and
    /// under the block; at the edges, where a big page would lie only partly
    /// under the block, a whole big page (`Big`, and `Pressure` while there
    /// is room) or granularity-sized pages (`Small`). Under pressure
    /// (reserved memory within `idle_slack_hard` of the cap or of the
    /// device's capacity) `Pressure` maps granularity-sized pages only, and
    /// first unmaps the big page under the block's end if it reaches into the
    /// free rest and no queued work can touch it; where only this mapping
    /// would bring reserved memory there, granules at the edges only.
    pub(in crate::allocator) fn map_range<D: Device<Event = E>>(
        &mut self,
        core: &mut Core<E>,
        dev: &D,
        fit: Entry,
        rounded: u64,
    ) -> Result<(), AllocError> {
        let g = core.granule();
        let b = core.blocks.get(fit.id.0);
        let (seg, start, end) = (b.segment, fit.addr, fit.addr + rounded);
        let tail = Tail {
            seg,
            start: end,
            end: fit.addr + fit.size,
            since: b.freed_at,
        };
        if self.regrow_to.is_some_and(|to| core.reserved() >= to) {
            self.regrow_to = None; // grown back: `expandable_page` from here on
        }
        // The hit path: a cached block over mapped pages needs nothing,
        // unless memory is so tight that its end page may be trimmed.
        if range_mapped(core, seg, start, end) && !self.under_pressure(core, 0) {
            return Ok(());
        }
        let mut style = match core.config.expandable_edges {
            EdgePages::Small => Style::SmallEdges,
            EdgePages::Big => Style::BigEdges,
            EdgePages::Pressure => {
                let plan = self.plan(core, seg, start, end, Style::BigEdges);
                let bytes: u64 = plan.iter().map(|p| u64::from(p.len) * g).sum();
                if self.under_pressure(core, 0) {
                    Style::Granules
                } else if self.under_pressure(core, bytes) {
                    // Only this mapping would reach the limit (a large
                    // block): big pages wholly under it waste nothing, so
                    // only its edges take granules. All granules here made
                    // pages of both sizes churn under a cap (gpt2_finetune at
                    // 1.05 × its peak: 45,689 pages created, 101,898 maps;
                    // now 2,479 and 14,716).
                    Style::SmallEdges
                } else {
                    Style::BigEdges
                }
            }
        };
        if style == Style::Granules {
            self.trim_end_page(core, dev, start, tail)?;
        }
        loop {
            let plan = self.plan(core, seg, start, end, style);
            if plan.is_empty() {
                return Ok(());
            }
            match self.map_plan(core, dev, seg, &plan, tail) {
                // Larger pages after `empty_cache` are a saving, not a need:
                // the device refused one, so pages as before.
                Err(AllocError::OutOfMemory(_)) if self.regrow_to.is_some() => {
                    self.regrow_to = None;
                }
                // The device or the cap is full after all: only the granules needed.
                Err(AllocError::OutOfMemory(_))
                    if style != Style::Granules
                        && core.config.expandable_edges == EdgePages::Pressure =>
                {
                    style = Style::Granules;
                    self.trim_end_page(core, dev, start, tail)?;
                }
                r => return r,
            }
        }
    }

    /// If the big page under the end of the block `[start, tail.start)`
    /// reaches past it into the free `tail`, and no queued work can touch
    /// it, unmaps it into the pool, so that only the granules under the
    /// block get mapped again.
    fn trim_end_page<D: Device<Event = E>>(
        &mut self,
        core: &mut Core<E>,
        dev: &D,
        start: u64,
        tail: Tail,
    ) -> Result<(), AllocError> {
        let g = core.granule();
        let Tail {
            seg,
            start: end,
            end: block_end,
            since,
        } = tail;
        let s = core.segment(seg);
        let base = s.addr;
        let last = (end - base).div_ceil(g) as u32;
        let pages = s.pages().expect("expandable");
        let Some((at, h, n)) = pages.covering(last - 1) else {
            return Ok(());
        };
        let (lo, hi) = (base + u64::from(at) * g, base + u64::from(at + n) * g);
        if n == 1 || hi <= base + u64::from(last) * g || lo < start || hi > block_end {
            return Ok(());
        }
        // Quiescent: freed before a marker of its stream that completed.
        if !self.quiescent(dev, s.pool.stream_slot(), since)? {
            return Ok(());
        }
        let s = core.segments.get_mut(seg.0);
        let pages = s.pages_mut().expect("expandable");
        pages.remove(at);
        if let Err(e) = dev.vmm_unmap(DevicePtr(lo), hi - lo) {
            pages.insert(at, n, h);
            return Err(e.into());
        }
        self.mapped_at.remove(&h);
        self.pool_page(h, s.pool.kind(), hi - lo);
        core.stats.num_unmap += 1;
        Ok(())
    }

    /// The pages to map under `[start, end)` of `seg`: big pages where a whole aligned big page is unmapped and
    /// under the block, granules elsewhere; with `Style::BigEdges`, an
    /// unmapped big page only partly under the block is mapped whole; with
    /// `Style::Granules`, granules only.
    fn plan(
        &self,
        core: &Core<E>,
        seg: SegmentId,
        start: u64,
        end: u64,
        style: Style,
    ) -> Vec<Planned> {
        let g = core.granule();
        let s = core.segment(seg);
        let pages = s.pages().expect("expandable");
        let big = match style {
            Style::Granules => 1,
            Style::BigEdges | Style::SmallEdges => self.big_granules(core, s, end - start),
        };
        // Growing back after `empty_cache`: the gaps beside big pages take
        // the largest page that fits too (Note [Pages after empty_cache]).
        let regrowing = big > 1 && self.regrowing(core, end - start);
        let limit = (s.size / g) as u32;
        let first = ((start - s.addr) / g) as u32;
        let last = (end - s.addr).div_ceil(g) as u32;
        let mut plan = Vec::new();
        for (mut a, mut b) in pages.gaps(first, last) {
            if style == Style::BigEdges && big > 1 {
                let a0 = a / big * big;
                if pages.is_unmapped(a0, a) {
                    a = a0;
                }
                let b0 = (b.div_ceil(big) * big).min(limit);
                if pages.is_unmapped(b, b0) {
                    b = b0;
                }
            }
            let mut at = a;
            while at < b {
                let mut n = if big > 1 && at % big == 0 && at + big <= b {
                    big
                } else {
                    1
                };
                if n == 1 && regrowing {
                    // The largest halving of the big page that fits here.
                    let mut m = smaller_page(big);
                    while m > 1 && (at % m != 0 || at + m > b) {
                        m = smaller_page(m);
                    }
                    n = m;
                }
                plan.push(Planned { at, len: n });
                at += n;
            }
        }
        plan
    }

    /// Gathers the physical pages for `plan` and maps them.
    fn map_plan<D: Device<Event = E>>(
        &mut self,
        core: &mut Core<E>,
        dev: &D,
        seg: SegmentId,
        plan: &[Planned],
        tail: Tail,
    ) -> Result<(), AllocError> {
        let g = core.granule();
        let s = core.segment(seg);
        let (base, kind) = (s.addr, s.pool.kind());
        let mut need: Vec<Need> = Vec::with_capacity(2);
        for p in plan {
            let size = u64::from(p.len) * g;
            match need.iter_mut().find(|n| n.size == size) {
                Some(n) => n.count += 1,
                None => need.push(Need { size, count: 1 }),
            }
        }
        // Pages whose shadows lie exactly where pages are planned: wanted back.
        let want: Vec<u64> = match core.config.expandable_shadows {
            true => plan
                .iter()
                .filter_map(|p| self.shadow_at(seg, p.at, p.len))
                .collect(),
            false => Vec::new(),
        };
        let mut gathered = Vec::with_capacity(plan.len());
        if let Err(e) = self.gather_pages(core, dev, &need, &want, tail, &mut gathered) {
            self.return_pages(core, dev, gathered)?;
            return Err(e);
        }
        for &Planned { at, len: n } in plan {
            let size = u64::from(n) * g;
            let back = self.shadow_at(seg, at, n);
            let j = gathered
                .iter()
                .rposition(|p| Some(p.handle) == back)
                .or_else(|| gathered.iter().rposition(|p| p.size == size))
                .expect("one page per planned page");
            let page = gathered.swap_remove(j);
            if Some(page.handle) == back {
                // Still mapped there: the shadow becomes the mapping, no call.
                self.stale.remove(&Place { seg, at });
                core.stats.num_pages_revived += 1;
            } else {
                // An old mapping there (the tail of this very block may have
                // given its page up) goes first.
                if let Err(e) = self.clear_stale_in(core, dev, seg, at, at + n) {
                    gathered.push(page);
                    self.return_pages(core, dev, gathered)?;
                    return Err(e);
                }
                let addr = DevicePtr(base + u64::from(at) * g);
                if let Err(e) = dev.vmm_map(addr, page.handle, size) {
                    gathered.push(page);
                    self.return_pages(core, dev, gathered)?;
                    return Err(e.into());
                }
                core.stats.num_map += 1;
            }
            core.page_map_mut(seg).insert(at, n, page.handle);
            if core.config.expandable_shadows {
                self.mapped_at.insert(page.handle, Place { seg, at });
            }
            match page.counted_as {
                None => core.stats.reserved_bytes.increase(kind, size),
                Some(old) => core.stats.reserved_bytes.move_group(old, kind, size),
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::allocator::expandable::testing::*;

    /// A range of the large pool with 8 MiB pages whose first page is
    /// mapped under a 2 MiB block; runs `f` on it with the range.
    fn one_big_page(f: impl FnOnce(&mut Expandable<Event>, &mut Core<Event>, &Dev, SegmentId)) {
        let (_dev, a) = alloc(fixed_pages(8 * MIB, true));
        a.malloc(PAGE, S0).unwrap();
        with_state(&a, |vmm, core, dev| {
            let seg = first_range(vmm, large(0));
            f(vmm, core, dev, seg)
        });
    }

    type Dev = crate::simulated::SimulatedDevice;

    /// `(first granule, granules)` of each page planned under granules
    /// `first..last` of `seg`.
    fn planned<E>(
        vmm: &Expandable<E>,
        core: &Core<E>,
        seg: SegmentId,
        (first, last): (u64, u64),
        style: Style,
    ) -> Vec<(u32, u32)> {
        let base = core.segment(seg).addr;
        vmm.plan(core, seg, base + first * PAGE, base + last * PAGE, style)
            .iter()
            .map(|p| (p.at, p.len))
            .collect()
    }

    /// Big pages where a whole aligned one lies under the block; at its
    /// edges whole big pages (`BigEdges`) or granules (`SmallEdges`);
    /// granules only with `Granules`; nothing where pages are mapped.
    #[test]
    fn plans_follow_the_style() {
        one_big_page(|vmm, core, _, seg| {
            let plan = |range, style| planned(vmm, core, seg, range, style);
            assert_eq!(
                plan((7, 17), Style::BigEdges),
                [(4, 4), (8, 4), (12, 4), (16, 4)]
            );
            assert_eq!(
                plan((7, 17), Style::SmallEdges),
                [(7, 1), (8, 4), (12, 4), (16, 1)]
            );
            assert_eq!(plan((7, 17), Style::Granules).len(), 10);
            assert!(plan((7, 17), Style::Granules).iter().all(|&(_, n)| n == 1));
            // Granules 0..4 are mapped already: only granule 4 is planned,
            // within the big page 4..8 at the edge.
            assert_eq!(plan((1, 5), Style::BigEdges), [(4, 4)]);
            assert_eq!(plan((1, 5), Style::SmallEdges), [(4, 1)]);
            assert!(plan((0, 4), Style::BigEdges).is_empty());
        });
    }

    /// A block over mapped pages maps nothing (the hit path); one over
    /// unmapped granules maps the planned pages, each counted once.
    #[test]
    fn map_range_maps_what_is_unmapped_under_the_block() {
        one_big_page(|vmm, core, dev, seg| {
            let base = core.segment(seg).addr;
            let rest = free_block(core, seg, base + PAGE);
            assert!(carve_mapped(core, rest, 3 * PAGE));
            assert!(!carve_mapped(core, rest, 4 * PAGE));
            let before = dev.counters();
            vmm.map_range(core, dev, rest, 3 * PAGE).unwrap();
            assert_eq!(dev.counters().vmm_maps, before.vmm_maps, "hit path");
            // 2 to 22 MiB: granules 4..11, two big pages.
            vmm.map_range(core, dev, rest, 10 * PAGE).unwrap();
            let after = dev.counters();
            assert_eq!(after.vmm_maps - before.vmm_maps, 2);
            assert_eq!(after.vmm_creates - before.vmm_creates, 2);
            assert_eq!(core.reserved(), 24 * MIB);
            assert!(carve_mapped(core, rest, 10 * PAGE));
            let pages = core.segment(seg).pages().unwrap();
            assert_eq!(
                pages.covering(9),
                Some((8, pages.covering(8).unwrap().1, 4))
            );
        });
    }

    /// Under pressure (a cap within reach) a block takes granules only, and
    /// the big page under its end that reaches into its free tail, idle and
    /// quiescent, is unmapped first.
    #[test]
    fn under_pressure_the_end_page_is_trimmed_to_granules() {
        let (dev, a) = alloc(fixed_pages(8 * MIB, true));
        let x = a.malloc(PAGE, S0).unwrap();
        a.free(x).unwrap(); // one free block over one 8 MiB page
        with_state(&a, |vmm, core, _| {
            let seg = first_range(vmm, large(0));
            let block = free_block(core, seg, x.0);
            core.cap = Some(8 * MIB);
            assert!(vmm.under_pressure(core, 0));
            vmm.settle(core, &dev).unwrap(); // the block is quiescent
            let before = dev.counters();
            // One granule: the 8 MiB page under it reaches past it.
            vmm.map_range(core, &dev, block, PAGE).unwrap();
            let after = dev.counters();
            assert_eq!(after.vmm_unmaps - before.vmm_unmaps, 1);
            // The big page made room for the granule under the cap.
            assert_eq!(after.vmm_releases - before.vmm_releases, 1);
            assert_eq!(core.reserved(), PAGE);
            let pages = core.segment(seg).pages().unwrap();
            assert_eq!(pages.covering(0).map(|p| p.2), Some(1), "a granule page");
            assert_eq!(pages.covering(1), None, "the rest given up");
        });
    }
}
