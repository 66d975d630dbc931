//! The mapped pages of an expandable segment.
//!
//! Page index → physical page handle, plus the runs of consecutive mapped
//! pages, so that the hit path's question "are all pages under this block
//! mapped?" is one ordered lookup however large the block.

use std::collections::BTreeMap;
use std::ops::Range;

/// Mapped pages of one expandable segment.
#[derive(Clone, Debug, Default)]
pub(crate) struct PageMap {
    handles: BTreeMap<u32, u64>,
    /// Runs of mapped pages: first page → one past the last.
    runs: BTreeMap<u32, u32>,
}

impl PageMap {
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.handles.len()
    }

    pub fn is_empty(&self) -> bool {
        self.handles.is_empty()
    }

    /// Records page `p` as mapped to `handle`.
    pub fn insert(&mut self, p: u32, handle: u64) {
        let old = self.handles.insert(p, handle);
        debug_assert!(old.is_none(), "page {p} mapped twice");
        let mut start = p;
        let mut end = p + 1;
        if let Some((&s, &e)) = self.runs.range(..p).next_back() {
            if e == p {
                start = s;
            }
        }
        if let Some(e) = self.runs.remove(&(p + 1)) {
            end = e;
        }
        self.runs.insert(start, end);
    }

    /// Forgets page `p`; returns its handle if it was mapped.
    pub fn remove(&mut self, p: u32) -> Option<u64> {
        let handle = self.handles.remove(&p)?;
        let (&s, &e) = self
            .runs
            .range(..=p)
            .next_back()
            .expect("a mapped page lies in a run");
        self.runs.remove(&s);
        if s < p {
            self.runs.insert(s, p);
        }
        if p + 1 < e {
            self.runs.insert(p + 1, e);
        }
        Some(handle)
    }

    /// The pages in `first..=last` that are not mapped, in order.
    pub fn missing(&self, first: u32, last: u32) -> Vec<u32> {
        let mut out = Vec::new();
        let mut at = first;
        if let Some((_, &e)) = self.runs.range(..=first).next_back() {
            at = at.max(e);
        }
        for (&s, &e) in self.runs.range(first..=last) {
            out.extend(at..s);
            at = at.max(e);
        }
        if at <= last {
            out.extend(at..=last);
        }
        out
    }

    /// Mapped pages with their handles in a range of page indices.
    pub fn range(&self, pages: Range<u32>) -> impl Iterator<Item = (&u32, &u64)> {
        self.handles.range(pages)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// `missing` and the runs agree with a plain set of pages under random maps and unmaps.
        #[test]
        fn runs_match_a_plain_set(ops in proptest::collection::vec((any::<bool>(), 0u32..64), 0..200),
                                  first in 0u32..64, len in 0u32..64) {
            let mut m = PageMap::default();
            let mut set = std::collections::BTreeSet::new();
            for (map, p) in ops {
                if map && !set.contains(&p) {
                    m.insert(p, u64::from(p) + 100);
                    set.insert(p);
                } else if !map {
                    prop_assert_eq!(m.remove(p), set.take(&p).map(|p| u64::from(p) + 100));
                }
            }
            let last = (first + len).min(70);
            let expected: Vec<u32> = (first..=last).filter(|p| !set.contains(p)).collect();
            prop_assert_eq!(m.missing(first, last), expected);
            prop_assert_eq!(m.len(), set.len());
            let covered: u32 = m.runs.iter().map(|(s, e)| e - s).sum();
            prop_assert_eq!(covered as usize, set.len());
            for ((_, e), (s2, _)) in m.runs.iter().zip(m.runs.iter().skip(1)) {
                prop_assert!(e < s2, "runs are separate and not adjacent");
            }
        }
    }
}
