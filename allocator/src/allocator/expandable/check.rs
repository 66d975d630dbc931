//! The consistency check of expandable segments (`check_invariants`): the
//! page maps, the page pool, the idle index, the old mappings and the page
//! locations.

use super::idle::holds_whole_page;
use super::ranges::smaller_page;
use super::stale::Stale;
use super::{Expandable, Place, PooledPage};
use crate::allocator::Core;
use crate::block::BlockState;

impl<E> Expandable<E> {
    /// Checks every expandable segment's page map (mappings of the
    /// granularity or of the segment's page size, inside the range, runs in
    /// step) and that no physical page is mapped twice or both mapped and pooled.
    pub(in crate::allocator) fn check_pages(&self, core: &Core<E>) -> Result<(), String> {
        let Some(g) = core.granularity else {
            return Ok(());
        };
        let mut handles = std::collections::HashSet::new();
        for &PooledPage {
            handle: h, size, ..
        } in &self.page_pool
        {
            if size == 0 || size % g != 0 || !handles.insert(h) {
                return Err(format!(
                    "pooled page {h} of {size} bytes is bad or listed twice"
                ));
            }
        }
        for &seg in self.ranges.iter().flatten() {
            let s = core.segment(seg);
            let pages = s.pages().ok_or("a range without a page map")?;
            let max = (s.page_size() / g) as u32;
            let sizes: Vec<u32> =
                std::iter::successors(Some(max), |&n| (n > 1).then(|| smaller_page(n))).collect();
            pages
                .check((s.size / g) as u32, &sizes)
                .map_err(|e| format!("range at {:#x}: {e}", s.addr))?;
            for (at, h, _) in pages.within(0, (s.size / g) as u32) {
                // (A shared page counts once, at home: `check_shared`.)
                if !pages.is_alias(at) && !handles.insert(h) {
                    return Err(format!(
                        "page {h} mapped at granule {at} of {:#x} is also mapped or pooled elsewhere",
                        s.addr
                    ));
                }
            }
            // The idle index holds exactly the free blocks with a whole page.
            let mut cur = Some(s.head);
            while let Some(id) = cur {
                let b = core.blocks.get(id.0);
                let idle =
                    b.state == BlockState::Free && holds_whole_page(s, g, b.addr, b.addr + b.size);
                if idle != core.idle_index.contains(&(b.freed_at, id.0)) {
                    return Err(format!(
                        "block at {:#x} (free: {}) is {}in the idle index",
                        b.addr,
                        b.state == BlockState::Free,
                        if idle { "not " } else { "" }
                    ));
                }
                cur = b.next;
            }
        }
        // Old mappings: of a page still held, where nothing else is mapped.
        self.stale.check()?;
        let mut prev: Option<&Stale> = None;
        for st in self.stale.values() {
            let s = core.segment(st.seg);
            let pages = s.pages().ok_or("an old mapping outside a range")?;
            if !handles.contains(&st.handle)
                || pages.mapped_granules(st.at, st.at + st.len) != 0
                || prev.is_some_and(|p| p.seg == st.seg && p.at + p.len > st.at)
            {
                return Err(format!(
                    "old mapping of page {} at granule {} of {:#x} is of a page not held, over a mapping, or over another",
                    st.handle, st.at, s.addr
                ));
            }
            prev = Some(st);
        }
        if core.config.expandable_shadows {
            let mapped = handles.len() - self.page_pool.len();
            let agree = self.mapped_at.iter().all(|(&h, &Place { seg, at })| {
                let pages = core.segment(seg).pages();
                pages.and_then(|p| p.covering(at)).map(|(a, hh, _)| (a, hh)) == Some((at, h))
            });
            if self.mapped_at.len() != mapped || !agree {
                return Err(format!(
                    "page locations list {} pages, {mapped} are mapped (agree: {agree})",
                    self.mapped_at.len()
                ));
            }
        }
        self.check_shared(core)?;
        let blocks: usize = self
            .ranges
            .iter()
            .flatten()
            .map(|seg| {
                let mut n = 0;
                let mut cur = Some(core.segment(*seg).head);
                while let Some(id) = cur {
                    let b = core.blocks.get(id.0);
                    n += usize::from(core.idle_index.contains(&(b.freed_at, id.0)));
                    cur = b.next;
                }
                n
            })
            .sum();
        if blocks != core.idle_index.len() {
            return Err(format!(
                "the idle index lists {} entries, {blocks} of them blocks",
                core.idle_index.len()
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use crate::allocator::expandable::testing::*;
    use crate::allocator::expandable::PooledPage;
    use crate::block::PoolKind;

    /// The check passes on a consistent state and names each kind of
    /// damage: a page pooled twice, a free block with a whole page missing
    /// from the idle index, an old mapping under a mapping.
    #[test]
    fn check_pages_finds_what_is_out_of_step() {
        let (_dev, a) = alloc(fixed_pages(PAGE, true));
        holes(&a, &[2 * PAGE]);
        with_state(&a, |vmm, core, _| {
            vmm.check_pages(core).unwrap();
            let entry = *core.idle_index.iter().next().expect("x is idle");
            core.idle_index.remove(&entry);
            let e = vmm.check_pages(core).unwrap_err();
            assert!(e.contains("not in the idle index"), "{e}");
            core.idle_index.insert(entry);
            let page = PooledPage {
                handle: 99,
                kind: PoolKind::Large,
                size: PAGE,
            };
            vmm.page_pool.extend([page, page]);
            let e = vmm.check_pages(core).unwrap_err();
            assert!(e.contains("listed twice"), "{e}");
            vmm.page_pool.clear();
            vmm.check_pages(core).unwrap();
            // A shadow at x, where x's page is still mapped.
            let seg = first_range(vmm, large(0));
            let (at, h, _) = core
                .segments
                .get(seg.0)
                .pages()
                .unwrap()
                .covering(0)
                .unwrap();
            let st = crate::allocator::expandable::stale::Stale {
                seg,
                at,
                len: 1,
                handle: h,
                slot: 0,
                since: 0,
            };
            vmm.stale
                .insert(crate::allocator::expandable::Place { seg, at }, st);
            let e = vmm.check_pages(core).unwrap_err();
            assert!(e.contains("over a mapping"), "{e}");
        });
    }
}
