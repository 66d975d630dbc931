//! One size class of the bins: its free blocks in (size, address) order,
//! the first in the class record itself, the rest in a sorted vector or,
//! past [`SPILL`] entries, an ordered tree.

use super::Entry;
use crate::block::BlockId;
use std::collections::BTreeSet;

/// An entry's place in its class: (size, address) as one number, so that
/// comparing two costs one wide compare instead of a chain of branches.
/// (Addresses are unique, so the block id never decides the order.)
#[inline(always)]
fn key(e: &Entry) -> u128 {
    (u128::from(e.size) << 64) | u128::from(e.addr)
}

/// Entries up to which a class is scanned rather than binary searched.
const SCAN: usize = 16;

/// Entries above which a class moves from a sorted vector to a tree.
pub(super) const SPILL: usize = 32;

/// A class's blocks after its first, ordered by (size, address): a sorted
/// vector while short, an ordered tree past [`SPILL`] entries.
#[derive(Debug)]
enum More {
    Few(Vec<Entry>),
    Many(BTreeSet<Entry>),
}

impl Default for More {
    fn default() -> Self {
        More::Few(Vec::new())
    }
}

impl More {
    #[inline]
    fn insert(&mut self, e: Entry) -> bool {
        match self {
            More::Few(v) => {
                if v.len() <= SCAN {
                    // Classes are usually short: insertion sort from the end
                    // (sizes inside a class are close, so a new block often
                    // sorts last), moving entries up as the scan passes them.
                    v.push(e);
                    let mut i = v.len() - 1;
                    let k = key(&e);
                    while i > 0 && key(&v[i - 1]) > k {
                        v[i] = v[i - 1];
                        i -= 1;
                    }
                    v[i] = e;
                    // The bins never hold a block twice (checked in tests).
                    debug_assert!(i == 0 || v[i - 1] != e, "block inserted twice");
                } else {
                    match v.binary_search(&e) {
                        Ok(_) => return false,
                        Err(i) => v.insert(i, e),
                    }
                }
                if v.len() > SPILL {
                    self.spill();
                }
                true
            }
            More::Many(t) => t.insert(e),
        }
    }

    /// A sorted vector grew too long: it becomes a tree.
    #[cold]
    #[inline(never)]
    fn spill(&mut self) {
        if let More::Few(v) = self {
            *self = More::Many(v.drain(..).collect());
        }
    }

    /// A tree shrank: it becomes a sorted vector again.
    #[cold]
    #[inline(never)]
    fn unspill(&mut self) {
        if let More::Many(t) = self {
            if t.len() < SPILL / 2 {
                *self = More::Few(std::mem::take(t).into_iter().collect());
            }
        }
    }

    #[inline]
    fn remove(&mut self, e: &Entry) -> bool {
        match self {
            More::Few(v) => match if v.len() <= SCAN {
                v.iter().rposition(|x| x.addr == e.addr && x == e)
            } else {
                v.binary_search(e).ok()
            } {
                Some(i) => {
                    remove_at(v, i);
                    true
                }
                None => false,
            },
            More::Many(t) => {
                let removed = t.remove(e);
                self.unspill();
                removed
            }
        }
    }

    /// Removes and returns the smallest entry (there is one).
    #[inline]
    fn pop_first(&mut self) -> Entry {
        match self {
            More::Few(v) => {
                let e = v[0];
                remove_at(v, 0);
                e
            }
            More::Many(t) => {
                let e = t
                    .pop_first()
                    .expect("a class's further entries are not empty");
                self.unspill();
                e
            }
        }
    }

    /// The first entry of at least `size` bytes, with its index (0 in a tree).
    #[inline]
    fn first_at_least(&self, size: u64) -> Option<(usize, Entry)> {
        match self {
            More::Few(v) => {
                let i = if v.len() <= SCAN {
                    v.iter().position(|e| e.size >= size).unwrap_or(v.len())
                } else {
                    v.partition_point(|e| e.size < size)
                };
                v.get(i).map(|e| (i, *e))
            }
            More::Many(t) => {
                let from = Entry {
                    size,
                    addr: 0,
                    id: BlockId(0),
                };
                t.range(from..).next().map(|e| (0, *e))
            }
        }
    }

    fn last(&self) -> Option<Entry> {
        match self {
            More::Few(v) => v.last().copied(),
            More::Many(t) => t.last().copied(),
        }
    }

    fn iter(&self) -> Box<dyn DoubleEndedIterator<Item = &Entry> + '_> {
        match self {
            More::Few(v) => Box::new(v.iter()),
            More::Many(t) => Box::new(t.iter()),
        }
    }
}

/// The blocks of one size class, ordered by (size, address). The first
/// (smallest) is kept in the class record itself: most classes hold no
/// block or one, and then an insert, a lookup or a removal touches only
/// this 32-byte record, never a second heap line (cachegrind: D1 misses on
/// the random mix with 256 slots fell from 4.8 to 3.3 per op). The rest are
/// in `more`, which is kept once allocated so that a class that fills and
/// empties again does not go back to the system allocator.
#[derive(Debug)]
pub(super) struct Class {
    size: u64,
    addr: u64,
    id: BlockId,
    /// Number of entries, the first included.
    len: u32,
    more: Option<Box<More>>,
}

// The record the doc above promises: half a cache line. The table's rows
// align it to 32 bytes ([`Row`]), so two classes share a line and none
// straddles two; the compact form's few records need no more than the
// system allocator's alignment (an over-aligned vector costs an aligned
// allocation and a copy at each growth).
const _: () = assert!(std::mem::size_of::<Class>() == 32);

impl Default for Class {
    fn default() -> Self {
        Class {
            size: 0,
            addr: 0,
            id: BlockId(u32::MAX),
            len: 0,
            more: None,
        }
    }
}

impl Class {
    #[inline(always)]
    pub(super) fn first_entry(&self) -> Entry {
        Entry {
            size: self.size,
            addr: self.addr,
            id: self.id,
        }
    }

    #[inline(always)]
    fn set_first(&mut self, e: Entry) {
        Entry {
            size: self.size,
            addr: self.addr,
            id: self.id,
        } = e;
    }

    /// The rest of the class, allocated on the first insert that needs it.
    #[inline(always)]
    fn more_for_insert(&mut self) -> &mut More {
        self.more.get_or_insert_with(Box::default)
    }

    /// Files `e`: inline for an empty class (the common case: classes are
    /// narrow), a call otherwise.
    #[inline(always)]
    pub(super) fn insert(&mut self, e: Entry) -> bool {
        if self.len == 0 {
            self.set_first(e);
            self.len = 1;
            return true;
        }
        self.insert_more(e)
    }

    #[inline(never)]
    fn insert_more(&mut self, e: Entry) -> bool {
        let first = self.first_entry();
        let inserted = if key(&e) < key(&first) {
            self.set_first(e);
            self.more_for_insert().insert(first)
        } else {
            e != first && self.more_for_insert().insert(e)
        };
        self.len += u32::from(inserted);
        inserted
    }

    /// Removes `e` if filed: inline for a class of one entry, a call otherwise.
    #[inline(always)]
    pub(super) fn remove(&mut self, e: &Entry) -> bool {
        if self.len == 1 {
            let first = e.addr == self.addr && *e == self.first_entry();
            self.len -= u32::from(first);
            return first;
        }
        self.remove_more(e)
    }

    #[inline(never)]
    fn remove_more(&mut self, e: &Entry) -> bool {
        if self.len == 0 {
            return false;
        }
        if e.addr == self.addr && *e == self.first_entry() {
            self.pop_first();
            return true;
        }
        let removed = match self.more.as_deref_mut() {
            Some(m) if self.len > 1 => m.remove(e),
            _ => false,
        };
        self.len -= u32::from(removed);
        removed
    }

    /// Removes the first entry (there is one).
    #[inline]
    fn pop_first(&mut self) {
        if let (true, Some(m)) = (self.len > 1, self.more.as_deref_mut()) {
            let next = m.pop_first();
            self.set_first(next);
        }
        self.len -= 1;
    }

    #[inline]
    pub(super) fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether `e` is in the class (a search of the class only).
    pub(super) fn contains(&self, e: &Entry) -> bool {
        if self.len == 0 {
            return false;
        }
        *e == self.first_entry()
            || match self.more.as_deref() {
                Some(More::Few(v)) if self.len > 1 => v.contains(e),
                Some(More::Many(t)) if self.len > 1 => t.contains(e),
                _ => false,
            }
    }

    /// The first entry of at least `size` bytes, with its index (0: the
    /// first entry; `i + 1`: index `i` of a short `more`; 1 in a tree).
    #[inline]
    pub(super) fn first_at_least(&self, size: u64) -> Option<(usize, Entry)> {
        if self.len == 0 {
            return None;
        }
        if self.size >= size {
            return Some((0, self.first_entry()));
        }
        match &self.more {
            Some(m) if self.len > 1 => m.first_at_least(size).map(|(i, e)| (i + 1, e)),
            _ => None,
        }
    }

    #[inline]
    pub(super) fn first(&self) -> Option<Entry> {
        (self.len > 0).then(|| self.first_entry())
    }

    /// Removes `e`, found at `index` by [`Class::first_at_least`] with the
    /// class unchanged since: inline for a class of one entry.
    #[inline(always)]
    pub(super) fn take(&mut self, index: usize, e: &Entry) {
        if self.len == 1 {
            debug_assert!(index == 0 && *e == self.first_entry());
            self.len = 0;
            return;
        }
        self.take_more(index, e);
    }

    #[inline(never)]
    fn take_more(&mut self, index: usize, e: &Entry) {
        if index == 0 && self.len > 0 && *e == self.first_entry() {
            self.pop_first();
            return;
        }
        if let Some(More::Few(v)) = self.more.as_deref_mut() {
            if index > 0 && v.get(index - 1) == Some(e) {
                remove_at(v, index - 1);
                self.len -= 1;
                return;
            }
        }
        let removed = self.remove(e);
        debug_assert!(removed, "a found entry is in its class");
    }

    pub(super) fn last(&self) -> Option<Entry> {
        match &self.more {
            Some(m) if self.len > 1 => m.last(),
            _ => self.first(),
        }
    }

    /// The entries in order.
    pub(super) fn iter(&self) -> impl DoubleEndedIterator<Item = Entry> + '_ {
        let more = match &self.more {
            Some(m) if self.len > 1 => Some(m.iter().copied()),
            _ => None,
        };
        self.first().into_iter().chain(more.into_iter().flatten())
    }
}

/// Removes `v[i]`, keeping the order: short vectors shift by hand, which
/// is cheaper than a call to `memmove` for a few entries.
#[inline]
fn remove_at(v: &mut Vec<Entry>, i: usize) {
    if v.len() - i > SCAN {
        v.remove(i);
        return;
    }
    for j in i + 1..v.len() {
        v[j - 1] = v[j];
    }
    v.pop();
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(size: u64, addr: u64) -> Entry {
        Entry {
            size,
            addr,
            id: BlockId(addr as u32),
        }
    }

    fn is_tree(c: &Class) -> bool {
        matches!(c.more.as_deref(), Some(More::Many(_)))
    }

    /// A class filed in descending order (each new entry the first) keeps
    /// (size, address) order through the scanned vector, the searched one
    /// and the tree, and back; a found entry is taken at its index.
    #[test]
    fn a_class_keeps_its_order_through_every_form() {
        let mut c = Class::default();
        let n = 2 * SPILL as u64;
        for a in (0..n).rev() {
            assert!(c.insert(entry(4096 + (a % 3) * 512, a)));
        }
        assert!(is_tree(&c), "{n} entries spill to a tree");
        let mut all: Vec<Entry> = (0..n).map(|a| entry(4096 + (a % 3) * 512, a)).collect();
        all.sort_unstable();
        assert_eq!(c.iter().collect::<Vec<_>>(), all);
        assert_eq!(c.first(), Some(all[0]));
        assert_eq!(c.last(), all.last().copied());
        // The first of at least 4608 bytes, then taken where it was found.
        let (i, e) = c.first_at_least(4608).unwrap();
        assert_eq!(e, *all.iter().find(|e| e.size >= 4608).unwrap());
        c.take(i, &e);
        assert!(!c.contains(&e));
        all.retain(|x| *x != e);
        // Emptied down past the spill threshold's half: a vector again.
        while all.len() > SCAN {
            let e = all.pop().unwrap();
            assert!(c.remove(&e));
            assert!(!c.remove(&e), "removed twice");
        }
        assert!(!is_tree(&c), "{} entries left in a tree", all.len());
        assert_eq!(c.iter().collect::<Vec<_>>(), all);
        for e in all.drain(..) {
            assert_eq!(c.first(), Some(e));
            c.take(0, &e);
        }
        assert!(c.is_empty() && c.first().is_none());
    }
}
