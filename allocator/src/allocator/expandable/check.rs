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
            let s = core.segments.get(seg.0);
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
            let s = core.segments.get(st.seg.0);
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
                let pages = core.segments.get(seg.0).pages();
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
                let mut cur = Some(core.segments.get(seg.0).head);
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
