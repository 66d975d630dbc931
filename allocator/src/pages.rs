//! The mapped pages of an expandable segment.
//!
//! A segment may hold pages of several sizes (big pages where a whole
//! aligned big page lies under a block, granularity-sized ones at a block's
//! edges), so the map is kept in units of the device granularity: first
//! granule of a mapping → (physical handle, granules it spans). A mapping is
//! always unmapped whole (the driver cannot unmap part of a handle).
//!
//! Besides the mappings the map keeps the runs of consecutive mapped
//! granules, so that the hit path's question "is everything under this block
//! mapped?" is one ordered lookup however large the block and however many
//! pages back it.
//!
//! Both maps are [`SortedMap`]s: a range of a program with many streams
//! holds a page or two, and costs their entries, not a tree node each.

use crate::sorted_map::SortedMap;

/// The intervals of `at..end` outside `spans` (ordered by their starts;
/// they may overlap), in order.
#[inline]
pub(crate) fn gaps_in<T: Ord + Copy>(
    mut at: T,
    end: T,
    spans: impl IntoIterator<Item = (T, T)>,
) -> Vec<(T, T)> {
    let mut out = Vec::new();
    for (s, e) in spans {
        if at < s {
            out.push((at, s));
        }
        at = at.max(e);
    }
    if at < end {
        out.push((at, end));
    }
    out
}

/// Mapped pages of one expandable segment, in granules.
#[derive(Clone, Debug, Default)]
pub(crate) struct PageMap {
    /// First granule of each mapping → (handle, length in granules).
    handles: SortedMap<u32, (u64, u32)>,
    /// Runs of mapped granules: first granule → one past the last.
    runs: SortedMap<u32, u32>,
    /// Granules mapped to a page another range holds and counts (a page
    /// shared by granules whose live bytes lie at different offsets; see
    /// `allocator::expandable::share`): mapped, but not this range's memory.
    aliases: std::collections::BTreeSet<u32>,
}

impl PageMap {
    /// Number of mappings (physical pages mapped).
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.handles.len()
    }

    pub fn is_empty(&self) -> bool {
        self.handles.is_empty()
    }

    /// Records `handle` as mapped over granules `at..at + len`, which must all be unmapped.
    pub fn insert(&mut self, at: u32, len: u32, handle: u64) {
        debug_assert!(len > 0);
        debug_assert!(
            self.is_unmapped(at, at + len),
            "granules {at}+{len} mapped twice"
        );
        self.handles.insert(at, (handle, len));
        let mut start = at;
        let mut end = at + len;
        if let Some((&s, &e)) = self.runs.range(..at).next_back() {
            if e == at {
                start = s;
            }
        }
        if let Some(e) = self.runs.remove(&end) {
            end = e;
        }
        self.runs.insert(start, end);
    }

    /// Marks the one-granule mapping at `at` as another range's page (or,
    /// with `false`, as this range's own again).
    pub fn set_alias(&mut self, at: u32, alias: bool) {
        debug_assert_eq!(self.handles.get(&at).map(|m| m.1), Some(1));
        if alias {
            self.aliases.insert(at);
        } else {
            self.aliases.remove(&at);
        }
    }

    /// Whether granule `at` is mapped to a page another range counts.
    pub fn is_alias(&self, at: u32) -> bool {
        self.aliases.contains(&at)
    }

    /// The aliased granules, in order.
    pub fn aliased(&self) -> impl Iterator<Item = u32> + '_ {
        self.aliases.iter().copied()
    }

    /// Aliased granules in `first..last`.
    pub fn aliases_in(&self, first: u32, last: u32) -> u32 {
        self.aliases.range(first..last.max(first)).count() as u32
    }

    /// Forgets the mapping that starts at granule `at`; returns its handle and length.
    pub fn remove(&mut self, at: u32) -> Option<(u64, u32)> {
        let (handle, len) = self.handles.remove(&at)?;
        self.aliases.remove(&at);
        let end = at + len;
        let (&s, &e) = self
            .runs
            .range(..=at)
            .next_back()
            .expect("a mapping lies in a run");
        debug_assert!(e >= end, "a mapping lies in one run");
        self.runs.remove(&s);
        if s < at {
            self.runs.insert(s, at);
        }
        if end < e {
            self.runs.insert(end, e);
        }
        Some((handle, len))
    }

    /// The unmapped intervals of granules within `first..last`, in order.
    pub fn gaps(&self, first: u32, last: u32) -> Vec<(u32, u32)> {
        let mut at = first;
        if let Some((_, &e)) = self.runs.range(..=first).next_back() {
            at = at.max(e);
        }
        let runs = self.runs.range(first..last).map(|(&s, &e)| (s, e));
        gaps_in(at, last, runs)
    }

    /// Whether every granule of `first..last` is mapped: runs are kept
    /// merged, so one run must span it.
    #[inline]
    pub fn is_mapped(&self, first: u32, last: u32) -> bool {
        first >= last
            || self
                .runs
                .range(..=first)
                .next_back()
                .is_some_and(|(_, &e)| e >= last)
    }

    /// Whether no granule of `first..last` is mapped.
    pub fn is_unmapped(&self, first: u32, last: u32) -> bool {
        if first >= last {
            return true;
        }
        if self
            .runs
            .range(..=first)
            .next_back()
            .is_some_and(|(_, &e)| e > first)
        {
            return false;
        }
        self.runs.range(first..last).next().is_none()
    }

    /// Number of mapped granules in `first..last`.
    pub fn mapped_granules(&self, first: u32, last: u32) -> u32 {
        self.runs_overlapping(first, last)
            .map(|(s, e)| e.min(last) - s.max(first))
            .sum()
    }

    /// The runs of mapped granules that overlap `first..last` (unclipped).
    pub fn runs_overlapping(&self, first: u32, last: u32) -> impl Iterator<Item = (u32, u32)> + '_ {
        let before = self
            .runs
            .range(..first)
            .next_back()
            .filter(|(_, &e)| e > first);
        before
            .into_iter()
            .chain(self.runs.range(first..last.max(first)))
            .map(|(&s, &e)| (s, e))
    }

    /// The mapping covering granule `x`, as (first granule, handle, length).
    pub fn covering(&self, x: u32) -> Option<(u32, u64, u32)> {
        self.handles
            .range(..=x)
            .next_back()
            .filter(|(&at, &(_, len))| at + len > x)
            .map(|(&at, &(h, len))| (at, h, len))
    }

    /// Mappings lying wholly inside `first..last`, as (first granule, handle, length).
    pub fn within(&self, first: u32, last: u32) -> impl Iterator<Item = (u32, u64, u32)> + '_ {
        self.handles
            .range(first..last.max(first))
            .filter(move |(&at, &(_, len))| at + len <= last)
            .map(|(&at, &(h, len))| (at, h, len))
    }

    /// Checks that the runs are exactly the union of the mappings, that
    /// mappings do not overlap, that runs are separate, and that every
    /// mapping lies inside `0..limit` and has a length in `sizes`.
    pub fn check(&self, limit: u32, sizes: &[u32]) -> Result<(), String> {
        let mut expect: Vec<(u32, u32)> = Vec::new();
        for (&at, &(_, len)) in self.handles.iter() {
            if !sizes.contains(&len) {
                return Err(format!("mapping at granule {at} spans {len} granules"));
            }
            if at + len > limit {
                return Err(format!("mapping at granule {at}+{len} past the range end"));
            }
            match expect.last_mut() {
                Some((_, e)) if *e > at => {
                    return Err(format!("mappings overlap at granule {at}"));
                }
                Some((_, e)) if *e == at => *e = at + len,
                _ => expect.push((at, at + len)),
            }
        }
        if let Some(&x) = self
            .aliases
            .iter()
            .find(|&&x| self.handles.get(&x).map(|m| m.1) != Some(1))
        {
            return Err(format!("aliased granule {x} is not a one-granule mapping"));
        }
        let runs: Vec<(u32, u32)> = self.runs.iter().map(|(&s, &e)| (s, e)).collect();
        if runs != expect {
            return Err(format!(
                "runs {runs:?} differ from the mappings' union {expect:?}"
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    proptest! {
        /// Runs, gaps, `is_mapped`, `is_unmapped`, `within` and the counts agree with a
        /// plain per-granule model under random maps (of 1 or 4 granules)
        /// and unmaps of whole mappings.
        #[test]
        fn mixed_mappings_match_a_plain_model(
            ops in proptest::collection::vec((any::<bool>(), any::<bool>(), 0u32..64), 0..200),
            first in 0u32..70, len in 0u32..70,
        ) {
            let mut m = PageMap::default();
            // granule → first granule of the mapping covering it
            let mut owner: BTreeMap<u32, u32> = BTreeMap::new();
            let mut maps: BTreeMap<u32, u32> = BTreeMap::new();
            for (map, big, g) in ops {
                let size = if big { 4 } else { 1 };
                let at = if big { g / 4 * 4 } else { g };
                if map {
                    if (at..at + size).all(|x| !owner.contains_key(&x)) {
                        prop_assert!(m.is_unmapped(at, at + size));
                        m.insert(at, size, u64::from(at) + 100);
                        for x in at..at + size {
                            owner.insert(x, at);
                        }
                        maps.insert(at, size);
                    } else {
                        prop_assert!(!m.is_unmapped(at, at + size));
                    }
                } else if let Some(&o) = owner.get(&g) {
                    let size = maps.remove(&o).unwrap();
                    prop_assert_eq!(m.remove(o), Some((u64::from(o) + 100, size)));
                    for x in o..o + size {
                        owner.remove(&x);
                    }
                } else {
                    prop_assert_eq!(m.remove(g), None);
                }
            }
            prop_assert!(m.check(64, &[1, 4]).is_ok(), "{:?}", m.check(64, &[1, 4]));
            let last = (first + len).min(70);
            let unmapped: Vec<u32> = (first..last).filter(|x| !owner.contains_key(x)).collect();
            let from_gaps: Vec<u32> = m.gaps(first, last).into_iter().flat_map(|(a, b)| a..b).collect();
            prop_assert_eq!(&from_gaps, &unmapped);
            for (a, b) in m.gaps(first, last) {
                prop_assert!(a < b);
            }
            prop_assert_eq!(m.is_unmapped(first, last), unmapped.len() as u32 == last.saturating_sub(first));
            prop_assert_eq!(m.is_mapped(first, last), unmapped.is_empty());
            prop_assert_eq!(m.mapped_granules(first, last), last.saturating_sub(first) - unmapped.len() as u32);
            let within: Vec<(u32, u32)> = m.within(first, last).map(|(a, _, l)| (a, l)).collect();
            let expected: Vec<(u32, u32)> = maps
                .iter()
                .filter(|(&a, &l)| a >= first && a + l <= last)
                .map(|(&a, &l)| (a, l))
                .collect();
            prop_assert_eq!(within, expected);
            prop_assert_eq!(m.len(), maps.len());
            for ((_, e), (s2, _)) in m.runs.iter().zip(m.runs.iter().skip(1)) {
                prop_assert!(e < s2, "runs are separate and not adjacent");
            }
        }
    }

    #[test]
    fn check_catches_overlap_and_bad_sizes() {
        let mut m = PageMap::default();
        m.insert(0, 4, 1);
        m.insert(4, 1, 2);
        assert!(m.check(8, &[1, 4]).is_ok());
        assert!(m.check(4, &[1, 4]).is_err(), "past the end");
        assert!(m.check(8, &[4]).is_err(), "size not allowed");
        m.handles.insert(2, (3, 1));
        assert!(m.check(8, &[1, 4]).is_err(), "overlap");
    }
}
