//! The address → block map of allocated blocks: an open-addressing hash
//! table specialised for 512-byte-aligned device addresses.
//!
//! Every `malloc` inserts one entry and every `free` removes one, so this map
//! sits on the hot path twice per pair. A general `HashMap` spends most of
//! its time on machinery this key type does not need; here a slot is 16
//! bytes (address and block index), the hash is one multiply (Fibonacci
//! hashing of the address's granule number) and probing is linear. Removal
//! leaves a tombstone (or an empty slot where the next slot is empty, since
//! no probe run goes on past it), so it costs one probe and no
//! data-dependent loop (a backward shift mispredicted about once per free);
//! the table is rebuilt when live entries and tombstones together fill half
//! of it.

use crate::block::BlockId;

/// A slot's address when the slot is empty. Allocations are 512-aligned, so
/// no live allocation has this address or [`GONE`]; a lookup of either is
/// answered before probing.
const EMPTY: u64 = u64::MAX;

/// A slot's address when its entry was removed (a tombstone): probes go on
/// past it.
const GONE: u64 = u64::MAX - 1;

/// Smallest table (slots).
const MIN_SLOTS: usize = 64;

#[derive(Copy, Clone, Debug)]
struct Slot {
    addr: u64,
    id: BlockId,
}

const VACANT: Slot = Slot {
    addr: EMPTY,
    id: BlockId(u32::MAX),
};

/// Allocated blocks by address, with O(1) insert, lookup and removal.
#[derive(Debug)]
pub(crate) struct AddrMap {
    slots: Box<[Slot]>,
    /// `slots.len() - 1` (the length is a power of two).
    mask: usize,
    /// `64 - log2(slots.len())`: the hash keeps the product's top bits.
    shift: u32,
    len: usize,
    /// Tombstones in the table.
    gone: usize,
}

impl Default for AddrMap {
    fn default() -> Self {
        Self::with_slots(MIN_SLOTS)
    }
}

impl AddrMap {
    fn with_slots(n: usize) -> Self {
        debug_assert!(n.is_power_of_two());
        AddrMap {
            slots: vec![VACANT; n].into_boxed_slice(),
            mask: n - 1,
            shift: 64 - n.trailing_zeros(),
            len: 0,
            gone: 0,
        }
    }

    /// The home slot of `addr`.
    #[inline]
    fn home(&self, addr: u64) -> usize {
        // Fibonacci hashing of the granule number: neighbouring blocks land
        // far apart, and the top bits of the product carry all of the key.
        ((addr >> 9).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> self.shift) as usize
    }

    /// Number of entries.
    pub fn len(&self) -> usize {
        self.len
    }

    /// The block at `addr`, if it is in the map.
    #[inline]
    pub fn get(&self, addr: u64) -> Option<BlockId> {
        if addr >= GONE {
            return None;
        }
        let mut i = self.home(addr);
        loop {
            let s = self.slots[i];
            if s.addr == addr {
                return Some(s.id);
            }
            if s.addr == EMPTY {
                return None;
            }
            i = (i + 1) & self.mask;
        }
    }

    /// Whether `addr` is in the map.
    pub fn contains(&self, addr: u64) -> bool {
        self.get(addr).is_some()
    }

    /// Maps `addr`, which is not in the map, to `id`.
    ///
    /// The allocator maps an address only while its block is handed out, so
    /// an address is never inserted twice; that lets the probe stop at the
    /// first free slot, tombstone or empty. `addr` must not be `u64::MAX`
    /// or `u64::MAX - 1` (no allocation starts there).
    #[inline]
    pub fn insert(&mut self, addr: u64, id: BlockId) {
        debug_assert!(addr < GONE, "{addr:#x} is not an allocation address");
        debug_assert!(self.get(addr).is_none(), "{addr:#x} inserted twice");
        if (self.len + self.gone + 1) * 2 > self.slots.len() {
            self.rebuild();
        }
        let mut i = self.home(addr);
        while self.slots[i].addr < GONE {
            i = (i + 1) & self.mask;
        }
        let s = &mut self.slots[i];
        self.gone -= usize::from(s.addr == GONE);
        *s = Slot { addr, id };
        self.len += 1;
    }

    /// Removes `addr`; returns its block, or `None` if it was not mapped.
    #[inline]
    pub fn remove(&mut self, addr: u64) -> Option<BlockId> {
        if addr >= GONE {
            return None;
        }
        let mut i = self.home(addr);
        loop {
            let s = &mut self.slots[i];
            if s.addr == addr {
                let id = s.id;
                // No probe run continues past an empty successor: the slot
                // can become empty instead of a tombstone (chosen without a
                // branch).
                let next_empty = self.slots[(i + 1) & self.mask].addr == EMPTY;
                self.slots[i].addr = if next_empty { EMPTY } else { GONE };
                self.gone += usize::from(!next_empty);
                self.len -= 1;
                return Some(id);
            }
            if s.addr == EMPTY {
                return None;
            }
            i = (i + 1) & self.mask;
        }
    }

    /// All entries, in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = (u64, BlockId)> + '_ {
        self.slots
            .iter()
            .filter(|s| s.addr < GONE)
            .map(|s| (s.addr, s.id))
    }

    /// Rebuilds the table without tombstones, twice as large if the live
    /// entries alone fill a quarter of it.
    #[cold]
    #[inline(never)]
    fn rebuild(&mut self) {
        let n = self.slots.len();
        let n = if (self.len + 1) * 4 > n { n * 2 } else { n };
        let mut fresh = Self::with_slots(n);
        for s in self.slots.iter().filter(|s| s.addr < GONE) {
            fresh.insert(s.addr, s.id);
        }
        *self = fresh;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    #[test]
    fn insert_get_remove() {
        let mut m = AddrMap::default();
        m.insert(0x1000, BlockId(1));
        m.insert(0x1200, BlockId(2));
        assert_eq!(m.remove(0x1000), Some(BlockId(1)));
        m.insert(0x1000, BlockId(3));
        assert_eq!(m.len(), 2);
        assert_eq!(m.get(0x1000), Some(BlockId(3)));
        assert_eq!(m.get(0x1400), None);
        assert_eq!(m.get(u64::MAX), None);
        assert_eq!(m.remove(u64::MAX), None);
        assert_eq!(m.get(u64::MAX - 1), None);
        assert_eq!(m.remove(u64::MAX - 1), None);
        assert_eq!(m.remove(0x1000), Some(BlockId(3)));
        assert_eq!(m.remove(0x1000), None);
        assert!(m.contains(0x1200));
        assert_eq!(m.len(), 1);
    }

    #[test]
    fn grows_and_keeps_every_entry() {
        let mut m = AddrMap::default();
        for i in 0..10_000u64 {
            m.insert(i << 9, BlockId(i as u32));
        }
        assert_eq!(m.len(), 10_000);
        assert!(m.slots.len() >= 20_000);
        for i in 0..10_000u64 {
            assert_eq!(m.get(i << 9), Some(BlockId(i as u32)));
        }
        assert_eq!(m.iter().count(), 10_000);
    }

    /// Inserting and removing forever (the allocator's steady state) keeps
    /// the table small: tombstones are cleared by rebuilding, not by growing.
    #[test]
    fn churn_does_not_grow_the_table() {
        let mut m = AddrMap::default();
        for i in 0..100_000u64 {
            m.insert(i << 9, BlockId(i as u32));
            if i >= 10 {
                assert_eq!(m.remove((i - 10) << 9), Some(BlockId(i as u32 - 10)));
            }
        }
        assert_eq!(m.len(), 10);
        assert_eq!(m.slots.len(), MIN_SLOTS);
        for i in 100_000 - 10..100_000u64 {
            assert_eq!(m.get(i << 9), Some(BlockId(i as u32)));
        }
    }

    /// Keys that all share one home slot make one long probe run; removing
    /// from its middle must keep the rest reachable.
    #[test]
    fn removal_inside_a_collision_run() {
        let mut m = AddrMap::default();
        let home = m.home(0x200);
        let same: Vec<u64> = (1..1_000_000u64)
            .map(|g| g << 9)
            .filter(|&a| m.home(a) == home)
            .take(8)
            .collect();
        assert_eq!(same.len(), 8);
        for (i, &a) in same.iter().enumerate() {
            m.insert(a, BlockId(i as u32));
        }
        assert_eq!(m.remove(same[2]), Some(BlockId(2)));
        for (i, &a) in same.iter().enumerate() {
            let want = (i != 2).then_some(BlockId(i as u32));
            assert_eq!(m.get(a), want, "key {i}");
        }
    }

    proptest! {
        /// Any sequence of inserts and removes agrees with a `HashMap`,
        /// on keys dense enough to collide and wrap around the table.
        #[test]
        fn matches_a_hash_map(ops in proptest::collection::vec((any::<bool>(), 0u64..300, any::<u32>()), 0..2000)) {
            let mut m = AddrMap::default();
            let mut model = HashMap::new();
            for (ins, g, v) in ops {
                let addr = g << 9;
                if ins {
                    // The allocator never maps a mapped address again.
                    if let std::collections::hash_map::Entry::Vacant(e) = model.entry(addr) {
                        m.insert(addr, BlockId(v));
                        e.insert(BlockId(v));
                    }
                } else {
                    prop_assert_eq!(m.remove(addr), model.remove(&addr));
                }
                prop_assert_eq!(m.len(), model.len());
            }
            for g in 0..300u64 {
                prop_assert_eq!(m.get(g << 9), model.get(&(g << 9)).copied());
            }
            let mut listed: Vec<_> = m.iter().collect();
            listed.sort_unstable();
            let mut expected: Vec<_> = model.into_iter().collect();
            expected.sort_unstable();
            prop_assert_eq!(listed, expected);
        }
    }
}
