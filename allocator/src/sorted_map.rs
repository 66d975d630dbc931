//! `SortedMap<K, V>`: an ordered map that costs what it holds.
//!
//! Most maps of the allocator's per-range records hold a handful of entries
//! (the pages of one expandable range in a program of many streams), and
//! the smallest `BTreeMap` with an entry allocates a whole node of eleven
//! (some 280 bytes for a page map entry). This map keeps its entries in a
//! sorted vector while they number at most [`SMALL`] (binary search, short
//! moves; a map of one entry holds one), and moves them to a
//! `BTreeMap` past that, where it stays (a large map that shrinks and grows
//! again pays no moves back and forth). It is emptied back to nothing when
//! its last entry goes. Its answers are those of a `BTreeMap`.

use std::collections::{btree_map, BTreeMap};
use std::ops::{Bound, RangeBounds};

/// Entries kept in the sorted vector at most.
const SMALL: usize = 32;

/// An ordered map of `Copy` keys and values; see the module docs.
#[derive(Clone, Debug)]
pub(crate) enum SortedMap<K, V> {
    Small(Vec<(K, V)>),
    Tree(BTreeMap<K, V>),
}

impl<K, V> Default for SortedMap<K, V> {
    fn default() -> Self {
        SortedMap::Small(Vec::new())
    }
}

/// Entries of a [`SortedMap`] in a key range, in order.
pub(crate) enum Range<'a, K, V> {
    Small(std::slice::Iter<'a, (K, V)>),
    Tree(btree_map::Range<'a, K, V>),
}

impl<'a, K, V> Iterator for Range<'a, K, V> {
    type Item = (&'a K, &'a V);

    #[inline]
    fn next(&mut self) -> Option<Self::Item> {
        match self {
            Range::Small(it) => it.next().map(|(k, v)| (k, v)),
            Range::Tree(it) => it.next(),
        }
    }
}

impl<K, V> DoubleEndedIterator for Range<'_, K, V> {
    #[inline]
    fn next_back(&mut self) -> Option<Self::Item> {
        match self {
            Range::Small(it) => it.next_back().map(|(k, v)| (k, v)),
            Range::Tree(it) => it.next_back(),
        }
    }
}

impl<K: Ord + Copy, V: Copy> SortedMap<K, V> {
    pub fn len(&self) -> usize {
        match self {
            SortedMap::Small(v) => v.len(),
            SortedMap::Tree(t) => t.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    #[inline]
    pub fn get(&self, k: &K) -> Option<&V> {
        match self {
            SortedMap::Small(v) => v.binary_search_by(|e| e.0.cmp(k)).ok().map(|i| &v[i].1),
            SortedMap::Tree(t) => t.get(k),
        }
    }

    /// Inserts `k → val`; returns the value it replaced.
    #[inline]
    pub fn insert(&mut self, k: K, val: V) -> Option<V> {
        match self {
            SortedMap::Small(v) => match v.binary_search_by(|e| e.0.cmp(&k)) {
                Ok(i) => Some(std::mem::replace(&mut v[i].1, val)),
                Err(i) => {
                    if v.len() == SMALL {
                        self.make_tree();
                        return self.insert(k, val);
                    }
                    if v.capacity() == 0 {
                        // A map of one entry holds one entry.
                        v.reserve_exact(1);
                    }
                    v.insert(i, (k, val));
                    None
                }
            },
            SortedMap::Tree(t) => t.insert(k, val),
        }
    }

    /// The vector is full: its entries move to a tree.
    #[cold]
    #[inline(never)]
    fn make_tree(&mut self) {
        if let SortedMap::Small(v) = self {
            *self = SortedMap::Tree(v.drain(..).collect());
        }
    }

    /// Removes `k`; returns its value.
    #[inline]
    pub fn remove(&mut self, k: &K) -> Option<V> {
        let out = match self {
            SortedMap::Small(v) => {
                let i = v.binary_search_by(|e| e.0.cmp(k)).ok()?;
                Some(v.remove(i).1)
            }
            SortedMap::Tree(t) => t.remove(k),
        };
        if out.is_some() && self.is_empty() {
            // An emptied map holds no memory.
            *self = SortedMap::default();
        }
        out
    }

    /// The entries with keys in `range`, in key order.
    #[inline]
    pub fn range<R: RangeBounds<K>>(&self, range: R) -> Range<'_, K, V> {
        match self {
            SortedMap::Small(v) => {
                let lo = match range.start_bound() {
                    Bound::Included(s) => v.partition_point(|e| e.0 < *s),
                    Bound::Excluded(s) => v.partition_point(|e| e.0 <= *s),
                    Bound::Unbounded => 0,
                };
                let hi = match range.end_bound() {
                    Bound::Included(e) => v.partition_point(|x| x.0 <= *e),
                    Bound::Excluded(e) => v.partition_point(|x| x.0 < *e),
                    Bound::Unbounded => v.len(),
                };
                Range::Small(v[lo..hi.max(lo)].iter())
            }
            SortedMap::Tree(t) => Range::Tree(t.range(range)),
        }
    }

    /// Every entry, in key order.
    pub fn iter(&self) -> Range<'_, K, V> {
        self.range(..)
    }

    /// Host bytes of the entries' storage (not counting the map's own record).
    #[cfg(test)]
    pub fn heap_bytes(&self) -> usize {
        match self {
            SortedMap::Small(v) => v.capacity() * std::mem::size_of::<(K, V)>(),
            SortedMap::Tree(t) => t.len() * std::mem::size_of::<(K, V)>(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Inserts, removes, lookups and ranges agree with a `BTreeMap`
        /// across the move from the vector to the tree (keys from a small
        /// set, so maps fill past `SMALL` and empty again).
        /// (Checked: a range whose excluded start bound counts the key fails this test.)
        #[test]
        fn agrees_with_a_btreemap(
            ops in proptest::collection::vec((0u8..3, 0u32..80, any::<u16>()), 0..400),
            lo in 0u32..90, hi in 0u32..90,
        ) {
            let mut m: SortedMap<u32, u16> = SortedMap::default();
            let mut model: BTreeMap<u32, u16> = BTreeMap::new();
            for (op, k, v) in ops {
                match op {
                    0 | 1 => prop_assert_eq!(m.insert(k, v), model.insert(k, v)),
                    _ => prop_assert_eq!(m.remove(&k), model.remove(&k)),
                }
                prop_assert_eq!(m.len(), model.len());
                prop_assert_eq!(m.get(&k), model.get(&k));
            }
            let (lo, hi) = (lo.min(hi), lo.max(hi));
            let got: Vec<_> = m.range(lo..hi).collect();
            let want: Vec<_> = model.range(lo..hi).collect();
            prop_assert_eq!(got, want);
            let got: Vec<_> = m.range(..=lo).rev().collect();
            let want: Vec<_> = model.range(..=lo).rev().collect();
            prop_assert_eq!(got, want);
            let got: Vec<_> = m.range((Bound::Excluded(lo), Bound::Included(hi))).collect();
            let want: Vec<_> = model.range((Bound::Excluded(lo), Bound::Included(hi))).collect();
            prop_assert_eq!(got, want);
            prop_assert_eq!(m.iter().collect::<Vec<_>>(), model.iter().collect::<Vec<_>>());
        }
    }

    /// A map of one entry holds one entry's bytes; emptied, nothing.
    #[test]
    fn a_small_map_holds_its_entries_only() {
        let mut m: SortedMap<u32, (u64, u32)> = SortedMap::default();
        assert_eq!(m.heap_bytes(), 0);
        m.insert(7, (1, 1));
        assert_eq!(m.heap_bytes(), std::mem::size_of::<(u32, (u64, u32))>());
        m.insert(3, (2, 1));
        assert!(m.heap_bytes() <= 4 * std::mem::size_of::<(u32, (u64, u32))>());
        assert_eq!(m.remove(&7), Some((1, 1)));
        assert_eq!(m.remove(&3), Some((2, 1)));
        assert_eq!(m.heap_bytes(), 0, "an emptied map keeps no storage");
        for k in 0..100 {
            m.insert(k, (u64::from(k), 1));
        }
        assert!(matches!(m, SortedMap::Tree(_)));
        assert_eq!(m.range(10..20).count(), 10);
    }
}
