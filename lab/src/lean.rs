//! A lean re-implementation of the `pytorch` policy's hot path, with the
//! same decisions as the core, to time how fast the core's algorithm could
//! go (the `lean_core` binary times it on the random-op plan next to the
//! real allocator).
//!
//! What the lean path keeps: best fit by (size, address) over a two-level
//! bitmap of size classes (64 per power of two), split and merge with
//! address-ordered neighbours, an address → block map, the allocation
//! statistics (current, peak and cumulative counts and bytes, per pool kind
//! and in all), and a mutex around it all. What it leaves out: streams other
//! than one, events, thread caches, expandable segments, the out-of-memory
//! ladder (the device here is unlimited) and every policy knob but PyTorch's.
//! Its records differ from the core's: a block is 32 bytes and is linked
//! into its size class's list (intrusive lists, kept sorted), so filing a
//! block in the bins moves no entry and allocates nothing. A crowded class
//! makes that sorted insert linear, which the core's vector-then-tree
//! classes bound; this is a measurement, not a replacement.
//!
//! With a slab limit ([`Lean::with_slabs`]) it measures a policy change
//! instead: requests of at most the limit (after rounding; at most 1 MiB)
//! skip best fit, split and merge, and are served from 2 MiB slabs of one
//! size class each (`rounding::slab_class`: exact 512-byte multiples up to
//! 4 KiB, then 8 classes per power of two, so a chunk wastes at most 1/8 of
//! its size). What that policy costs in fragmentation on the shipped traces
//! is [`crate::slab_study`]'s question.

use cachealloc_core::{
    round_size_plain, CachingAllocator, Config, Device, DevicePtr, SimulatedDevice, StreamId,
};
use parking_lot::Mutex;

use cachealloc_core::{slab_class, SLAB_CLASSES, SLAB_MAX};

/// Bytes of one slab (the small pool's segment size).
pub const SLAB_BYTES: u64 = 2 << 20;

const NIL: u32 = u32::MAX;
/// Sizes are kept in granules of this many bytes (the rounding unit).
pub const GRANULE: u64 = 512;
const SL_BITS: u32 = 6;
const SL_COUNT: usize = 1 << SL_BITS;
const FL_COUNT: usize = 48;
use crate::MIB;

/// A block: 32 bytes, sizes in 512-byte granules.
#[derive(Clone, Copy)]
struct Block {
    addr: u64,
    granules: u32,
    /// Address-ordered neighbours in the segment.
    prev: u32,
    next: u32,
    /// Neighbours in the size class's free list (while free).
    fprev: u32,
    fnext: u32,
    /// Bit 0: free; bit 1: large pool.
    flags: u32,
}

const FREE: u32 = 1;
const LARGE: u32 = 2;
/// A chunk of a slab (`slab:KIB` mode): never split, never merged.
const SLAB: u32 = 4;

/// Free chunks of each slab class (their block records), and the unused
/// tail of the class's newest slab.
struct Slabs {
    free: Vec<Vec<u32>>,
    bump: Vec<(u64, u64)>,
}

impl Block {
    fn size(&self) -> u64 {
        u64::from(self.granules) * GRANULE
    }
    fn key(&self) -> (u32, u64) {
        (self.granules, self.addr)
    }
}

fn class_of(granules: u32) -> (usize, usize) {
    let units = u64::from(granules.max(1));
    let fl = 63 - units.leading_zeros();
    let sl = ((units << SL_BITS) >> fl) as usize;
    ((fl as usize).min(FL_COUNT - 1), sl & (SL_COUNT - 1))
}

/// Free lists of one pool.
struct Bins {
    fl: u64,
    sl: [u64; FL_COUNT],
    heads: Vec<u32>,
}

impl Bins {
    fn new() -> Self {
        Bins {
            fl: 0,
            sl: [0; FL_COUNT],
            heads: vec![NIL; FL_COUNT * SL_COUNT],
        }
    }
}

/// Statistic: current, peak, allocated and freed, as the core keeps them.
#[derive(Default, Clone, Copy)]
struct Stat {
    current: u64,
    peak: u64,
    allocated: u64,
    freed: u64,
}

impl Stat {
    fn up(&mut self, n: u64) {
        self.current += n;
        self.allocated += n;
        self.peak = self.peak.max(self.current);
    }
    fn down(&mut self, n: u64) {
        self.current -= n;
        self.freed += n;
    }
    /// A change whose sign the data decides (merges), without a branch on it.
    fn add(&mut self, d: i64) {
        self.current = self.current.wrapping_add(d as u64);
        self.allocated += d.max(0) as u64;
        self.freed += (-d).max(0) as u64;
        self.peak = self.peak.max(self.current);
    }
}

/// The statistics the core updates on every malloc and free: allocation
/// count and bytes, active count and bytes, requested bytes, inactive
/// split count and bytes; each for all pools and per kind.
#[derive(Default)]
struct Stats {
    s: [[Stat; 7]; 3],
}

impl Stats {
    fn up(&mut self, kind: usize, i: usize, n: u64) {
        self.s[0][i].up(n);
        self.s[kind][i].up(n);
    }
    fn down(&mut self, kind: usize, i: usize, n: u64) {
        self.s[0][i].down(n);
        self.s[kind][i].down(n);
    }
    fn add(&mut self, kind: usize, i: usize, d: i64) {
        self.s[0][i].add(d);
        self.s[kind][i].add(d);
    }
}

const ALLOC: usize = 0;
const ALLOC_BYTES: usize = 1;
const ACTIVE: usize = 2;
const ACTIVE_BYTES: usize = 3;
const REQUESTED: usize = 4;
const SPLIT: usize = 5;
const SPLIT_BYTES: usize = 6;

/// Allocated blocks by address: open addressing, linear probing, removal
/// by tombstone (as the core's map: a backward shift mispredicts).
struct AddrMap {
    keys: Vec<u64>,
    vals: Vec<u32>,
    len: usize,
    gone: usize,
    shift: u32,
}

const EMPTY: u64 = u64::MAX;
const GONE: u64 = u64::MAX - 1;

impl AddrMap {
    fn new() -> Self {
        Self::with(64)
    }
    fn with(n: usize) -> Self {
        AddrMap {
            keys: vec![EMPTY; n],
            vals: vec![NIL; n],
            len: 0,
            gone: 0,
            shift: 64 - n.trailing_zeros(),
        }
    }
    fn home(&self, k: u64) -> usize {
        ((k >> 9).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> self.shift) as usize
    }
    /// Maps `k`, which is not in the map.
    fn insert(&mut self, k: u64, v: u32) {
        if (self.len + self.gone + 1) * 2 > self.keys.len() {
            let n = self.keys.len();
            let n = if (self.len + 1) * 4 > n { n * 2 } else { n };
            let old = std::mem::replace(self, Self::with(n));
            for (k, v) in old.keys.iter().zip(&old.vals) {
                if *k < GONE {
                    self.insert(*k, *v);
                }
            }
        }
        let mask = self.keys.len() - 1;
        let mut i = self.home(k);
        while self.keys[i] < GONE {
            i = (i + 1) & mask;
        }
        self.gone -= usize::from(self.keys[i] == GONE);
        self.keys[i] = k;
        self.vals[i] = v;
        self.len += 1;
    }
    /// The value of `k`, which is in the map.
    #[cfg(test)]
    fn get(&self, k: u64) -> u32 {
        let mask = self.keys.len() - 1;
        let mut i = self.home(k);
        while self.keys[i] != k {
            i = (i + 1) & mask;
        }
        self.vals[i]
    }

    fn remove(&mut self, k: u64) -> Option<u32> {
        let mask = self.keys.len() - 1;
        let mut i = self.home(k);
        loop {
            if self.keys[i] == k {
                let next_empty = self.keys[(i + 1) & mask] == EMPTY;
                self.keys[i] = if next_empty { EMPTY } else { GONE };
                self.gone += usize::from(!next_empty);
                self.len -= 1;
                return Some(self.vals[i]);
            }
            if self.keys[i] == EMPTY {
                return None;
            }
            i = (i + 1) & mask;
        }
    }
}

struct State {
    blocks: Vec<Block>,
    vacant: Vec<u32>,
    bins: [Bins; 2],
    live: AddrMap,
    requested: Vec<u64>,
    stats: Stats,
    slabs: Slabs,
}

/// The lean allocator over a device.
pub struct Lean<D: Device> {
    /// The device it allocates segments from.
    pub dev: D,
    state: Mutex<State>,
    /// Requests up to this many bytes go to slabs (0: none, as the core).
    slab_limit: u64,
}

impl State {
    fn new_block(&mut self, b: Block) -> u32 {
        match self.vacant.pop() {
            Some(i) => {
                self.blocks[i as usize] = b;
                i
            }
            None => {
                self.blocks.push(b);
                self.requested.push(0);
                (self.blocks.len() - 1) as u32
            }
        }
    }

    /// Files free block `i` in its pool's class list, sorted by (size, address).
    fn file(&mut self, i: u32) {
        let b = self.blocks[i as usize];
        let pool = (b.flags & LARGE != 0) as usize;
        let (fl, sl) = class_of(b.granules);
        let c = fl * SL_COUNT + sl;
        let bins = &mut self.bins[pool];
        let mut prev = NIL;
        let mut cur = bins.heads[c];
        while cur != NIL && self.blocks[cur as usize].key() < b.key() {
            prev = cur;
            cur = self.blocks[cur as usize].fnext;
        }
        let nb = &mut self.blocks[i as usize];
        nb.fprev = prev;
        nb.fnext = cur;
        if cur != NIL {
            self.blocks[cur as usize].fprev = i;
        }
        if prev == NIL {
            bins.heads[c] = i;
        } else {
            self.blocks[prev as usize].fnext = i;
        }
        bins.sl[fl] |= 1 << sl;
        bins.fl |= 1 << fl;
    }

    /// Takes free block `i` out of its class list.
    fn unfile(&mut self, i: u32) {
        let b = self.blocks[i as usize];
        let pool = (b.flags & LARGE != 0) as usize;
        if b.fnext != NIL {
            self.blocks[b.fnext as usize].fprev = b.fprev;
        }
        if b.fprev != NIL {
            self.blocks[b.fprev as usize].fnext = b.fnext;
        } else {
            let (fl, sl) = class_of(b.granules);
            let bins = &mut self.bins[pool];
            bins.heads[fl * SL_COUNT + sl] = b.fnext;
            if b.fnext == NIL {
                bins.sl[fl] &= !(1 << sl);
                if bins.sl[fl] == 0 {
                    bins.fl &= !(1 << fl);
                }
            }
        }
    }

    /// The best fit of at least `g` granules in `pool`.
    fn find(&self, pool: usize, g: u32) -> Option<u32> {
        let bins = &self.bins[pool];
        let (fl, sl) = class_of(g);
        if bins.sl[fl] & (1 << sl) != 0 {
            let mut cur = bins.heads[fl * SL_COUNT + sl];
            while cur != NIL {
                let b = &self.blocks[cur as usize];
                if b.granules >= g {
                    return Some(cur);
                }
                cur = b.fnext;
            }
        }
        let above = bins.sl[fl] & u64::MAX.checked_shl(sl as u32 + 1).unwrap_or(0);
        let (fl, sl) = if above != 0 {
            (fl, above.trailing_zeros() as usize)
        } else {
            let above = bins.fl & u64::MAX.checked_shl(fl as u32 + 1).unwrap_or(0);
            if above == 0 {
                return None;
            }
            let fl = above.trailing_zeros() as usize;
            (fl, bins.sl[fl].trailing_zeros() as usize)
        };
        Some(bins.heads[fl * SL_COUNT + sl])
    }
}

impl<D: Device> Lean<D> {
    /// The lean path without slabs: the core's `pytorch` decisions.
    pub fn new(dev: D) -> Self {
        Self::with_slabs(dev, 0)
    }

    /// The lean path with slabs for requests of at most `slab_limit` bytes
    /// (after rounding; at most 1 MiB).
    pub fn with_slabs(dev: D, slab_limit: u64) -> Self {
        assert!(slab_limit <= SLAB_MAX, "slabs serve at most 1 MiB");
        Lean {
            dev,
            slab_limit,
            state: Mutex::new(State {
                blocks: Vec::new(),
                vacant: Vec::new(),
                bins: [Bins::new(), Bins::new()],
                live: AddrMap::new(),
                requested: Vec::new(),
                stats: Stats::default(),
                slabs: Slabs {
                    free: vec![Vec::new(); SLAB_CLASSES],
                    bump: vec![(0, 0); SLAB_CLASSES],
                },
            }),
        }
    }

    /// Allocates `size` bytes (panics on a size above the core's limit).
    pub fn malloc(&self, size: u64) -> DevicePtr {
        let rounded = round_size_plain(size).expect("size");
        let g = (rounded / GRANULE) as u32;
        let large = rounded > MIB;
        let pool = usize::from(large);
        let kind = 1 + pool;
        let st = &mut *self.state.lock();
        if rounded <= self.slab_limit {
            return self.slab_malloc(st, size, rounded);
        }
        let i = match st.find(pool, g) {
            Some(i) => {
                st.unfile(i);
                i
            }
            None => {
                let seg = if !large {
                    2 * MIB
                } else if rounded < 10 * MIB {
                    20 * MIB
                } else {
                    rounded.div_ceil(2 * MIB) * 2 * MIB
                };
                let p = self.dev.allocate(seg).expect("unlimited device");
                st.new_block(Block {
                    addr: p.0,
                    granules: (seg / GRANULE) as u32,
                    prev: NIL,
                    next: NIL,
                    fprev: NIL,
                    fnext: NIL,
                    flags: if large { LARGE } else { 0 },
                })
            }
        };
        let b = st.blocks[i as usize];
        let was_split = b.prev != NIL || b.next != NIL;
        let remaining = b.size() - rounded;
        let split = if large {
            remaining > MIB
        } else {
            remaining >= GRANULE
        };
        let final_size = if split {
            let rest = st.new_block(Block {
                addr: b.addr + rounded,
                granules: b.granules - g,
                prev: i,
                next: b.next,
                fprev: NIL,
                fnext: NIL,
                flags: b.flags | FREE,
            });
            if b.next != NIL {
                st.blocks[b.next as usize].prev = rest;
            }
            let nb = &mut st.blocks[i as usize];
            nb.next = rest;
            nb.granules = g;
            nb.flags &= !FREE;
            st.file(rest);
            if was_split {
                st.stats.down(kind, SPLIT_BYTES, rounded);
            } else {
                st.stats.up(kind, SPLIT_BYTES, remaining);
                st.stats.up(kind, SPLIT, 1);
            }
            rounded
        } else {
            st.blocks[i as usize].flags &= !FREE;
            if was_split {
                st.stats.down(kind, SPLIT_BYTES, b.size());
                st.stats.down(kind, SPLIT, 1);
            }
            b.size()
        };
        st.requested[i as usize] = size;
        st.live.insert(b.addr, i);
        let s = &mut st.stats;
        s.up(kind, ALLOC, 1);
        s.up(kind, ALLOC_BYTES, final_size);
        s.up(kind, ACTIVE, 1);
        s.up(kind, ACTIVE_BYTES, final_size);
        s.up(kind, REQUESTED, size);
        DevicePtr(b.addr)
    }

    /// A chunk of `rounded`'s slab class: a free one, the next of the
    /// class's newest slab, or the first of a new slab.
    fn slab_malloc(&self, st: &mut State, size: u64, rounded: u64) -> DevicePtr {
        let (c, chunk) = slab_class(rounded);
        let i = match st.slabs.free[c].pop() {
            Some(i) => i,
            None => {
                let (mut next, mut end) = st.slabs.bump[c];
                if next + chunk > end {
                    next = self.dev.allocate(SLAB_BYTES).expect("unlimited device").0;
                    end = next + SLAB_BYTES;
                }
                st.slabs.bump[c] = (next + chunk, end);
                st.new_block(Block {
                    addr: next,
                    granules: (chunk / GRANULE) as u32,
                    prev: NIL,
                    next: NIL,
                    fprev: NIL,
                    fnext: NIL,
                    flags: SLAB,
                })
            }
        };
        let addr = st.blocks[i as usize].addr;
        st.requested[i as usize] = size;
        st.live.insert(addr, i);
        let s = &mut st.stats;
        s.up(1, ALLOC, 1);
        s.up(1, ALLOC_BYTES, chunk);
        s.up(1, ACTIVE, 1);
        s.up(1, ACTIVE_BYTES, chunk);
        s.up(1, REQUESTED, size);
        DevicePtr(addr)
    }

    /// Frees `p`, which this allocator returned and which is live.
    pub fn free(&self, p: DevicePtr) {
        let st = &mut *self.state.lock();
        let i = st.live.remove(p.0).expect("allocated here");
        let b = st.blocks[i as usize];
        if b.flags & SLAB != 0 {
            let (chunk, requested) = (b.size(), st.requested[i as usize]);
            let s = &mut st.stats;
            s.down(1, ALLOC, 1);
            s.down(1, ALLOC_BYTES, chunk);
            s.down(1, ACTIVE, 1);
            s.down(1, ACTIVE_BYTES, chunk);
            s.down(1, REQUESTED, requested);
            st.slabs.free[slab_class(chunk).0].push(i);
            return;
        }
        let kind = 1 + usize::from(b.flags & LARGE != 0);
        let size = b.size();
        let requested = st.requested[i as usize];
        let s = &mut st.stats;
        s.down(kind, ALLOC, 1);
        s.down(kind, ALLOC_BYTES, size);
        s.down(kind, ACTIVE, 1);
        s.down(kind, ACTIVE_BYTES, size);
        s.down(kind, REQUESTED, requested);
        let (mut addr, mut granules, mut prev, mut next) = (b.addr, b.granules, b.prev, b.next);
        let mut net_blocks = 0i64;
        let mut net_bytes = 0i64;
        if prev != NIL && st.blocks[prev as usize].flags & FREE != 0 {
            let pb = st.blocks[prev as usize];
            st.unfile(prev);
            st.vacant.push(prev);
            addr = pb.addr;
            granules += pb.granules;
            net_blocks -= 1;
            net_bytes -= pb.size() as i64;
            prev = pb.prev;
            if prev != NIL {
                st.blocks[prev as usize].next = i;
            }
        }
        if next != NIL && st.blocks[next as usize].flags & FREE != 0 {
            let nb = st.blocks[next as usize];
            st.unfile(next);
            st.vacant.push(next);
            granules += nb.granules;
            net_blocks -= 1;
            net_bytes -= nb.size() as i64;
            next = nb.next;
            if next != NIL {
                st.blocks[next as usize].prev = i;
            }
        }
        let nb = &mut st.blocks[i as usize];
        nb.addr = addr;
        nb.granules = granules;
        nb.prev = prev;
        nb.next = next;
        nb.flags |= FREE;
        st.file(i);
        let split = prev != NIL || next != NIL;
        net_blocks += i64::from(split);
        net_bytes += if split {
            i64::from(granules) * GRANULE as i64
        } else {
            0
        };
        st.stats.add(kind, SPLIT, net_blocks);
        st.stats.add(kind, SPLIT_BYTES, net_bytes);
    }
}

/// Runs `plan` on the lean path and on the real core (`pytorch`
/// configuration) side by side; panics at the first allocation that lands
/// elsewhere, or if device calls or statistics differ. Returns a summary.
pub fn check(plan: &[(usize, u64)], slots: usize) -> String {
    let lean = Lean::new(SimulatedDevice::unlimited());
    let core = CachingAllocator::new(SimulatedDevice::unlimited(), Config::pytorch());
    let mut a: Vec<Option<DevicePtr>> = vec![None; slots];
    let mut b: Vec<Option<DevicePtr>> = vec![None; slots];
    for (n, &(slot, size)) in plan.iter().enumerate() {
        match (a[slot].take(), b[slot].take()) {
            (Some(p), Some(q)) => {
                lean.free(p);
                core.free(q).expect("free");
            }
            (None, None) => {
                let p = lean.malloc(size);
                let q = core.malloc(size, StreamId(0)).expect("malloc");
                assert_eq!(p, q, "op {n}: malloc({size}) differs");
                a[slot] = Some(p);
                b[slot] = Some(q);
            }
            _ => unreachable!("the slots move together"),
        }
    }
    let (x, y) = (lean.dev.counters(), core.device().counters());
    assert_eq!(
        (x.allocs, x.frees),
        (y.allocs, y.frees),
        "device calls differ"
    );
    let st = lean.state.lock();
    let ours = &st.stats.s[0];
    let theirs = core.stats();
    assert_eq!(
        ours[ALLOC_BYTES].current,
        theirs.allocated_bytes.all().current
    );
    assert_eq!(ours[ALLOC_BYTES].peak, theirs.allocated_bytes.all().peak);
    assert_eq!(
        ours[SPLIT_BYTES].current,
        theirs.inactive_split_bytes.all().current
    );
    assert_eq!(ours[REQUESTED].peak, theirs.requested_bytes.all().peak);
    format!(
        "same decisions: {} ops, {} segments, allocated peak {} bytes, inactive split {} bytes",
        plan.len(),
        x.allocs,
        ours[ALLOC_BYTES].peak,
        ours[SPLIT_BYTES].current
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::random_plan;

    /// The lean path's timings mean something only while it decides as the core does.
    #[test]
    fn lean_path_makes_the_core_s_decisions() {
        for (seed, slots, max_mib) in [(1, 256, 8), (2, 4096, 64), (3, 64, 2)] {
            check(&random_plan(slots, max_mib * MIB, 100_000, seed), slots);
        }
    }

    /// The `slab:KIB` mode's timings mean something only while it is an
    /// allocator: no two live allocations overlap, every chunk holds its
    /// request, and the allocated bytes are the live chunks' sum.
    #[test]
    fn slab_mode_hands_out_disjoint_chunks_that_fit() {
        use std::collections::BTreeMap;
        for (seed, slots, max_mib, limit) in [(1, 256, 8, MIB), (2, 4096, 64, 64 << 10)] {
            let lean = Lean::with_slabs(SimulatedDevice::unlimited(), limit);
            let mut live: Vec<Option<(DevicePtr, u64)>> = vec![None; slots];
            let mut spans: BTreeMap<u64, u64> = BTreeMap::new();
            let mut chunks = 0u64;
            for &(slot, size) in &random_plan(slots, max_mib * MIB, 50_000, seed) {
                match live[slot].take() {
                    Some((p, len)) => {
                        lean.free(p);
                        spans.remove(&p.0);
                        chunks -= len;
                    }
                    None => {
                        let p = lean.malloc(size);
                        let rounded = round_size_plain(size).expect("size");
                        let len = if rounded <= limit {
                            let chunk = slab_class(rounded).1;
                            assert!(chunk >= rounded && chunk - rounded <= chunk / 8);
                            chunks += chunk;
                            chunk
                        } else {
                            0
                        };
                        let end = p.0 + rounded;
                        if let Some((&a, &e)) = spans.range(..end).next_back() {
                            assert!(e <= p.0, "[{:#x}, {end:#x}) overlaps [{a:#x}, {e:#x})", p.0);
                        }
                        spans.insert(p.0, end);
                        live[slot] = Some((p, len));
                    }
                }
            }
            let st = lean.state.lock();
            let slab_bytes: u64 = live.iter().flatten().map(|&(_, len)| len).sum();
            assert_eq!(slab_bytes, chunks);
            let core_bytes: u64 = live
                .iter()
                .flatten()
                .filter(|&&(_, len)| len == 0)
                .map(|&(p, _)| st.blocks[st.live.get(p.0) as usize].size())
                .sum();
            assert_eq!(st.stats.s[0][ALLOC_BYTES].current, slab_bytes + core_bytes);
        }
    }
}
