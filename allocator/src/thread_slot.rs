//! Per-thread caches in front of the allocator's lock.
//!
//! A thread that frees a block of a size it recently asked for *parks* the
//! block in its own [`Slot`] instead of returning it to the bins; its next
//! request of the same rounded size on the same stream takes the block back
//! without touching the allocator's mutex, and frees it there again. The slot
//! has its own mutex, which only its thread takes on the hot path (other
//! threads take it to flush, to read statistics, or to free a block the slot
//! handed out), so threads allocating in parallel do not contend.
//!
//! Parked blocks stay recorded as blocks of their segment (state
//! [`BlockState::Parked`](crate::BlockState::Parked)); the allocator flushes
//! every slot back into the bins before it grows, in the out-of-memory
//! ladder and on `empty_cache`, so a thread cache never costs a device
//! allocation. What a slot does without the allocator's lock is tallied in
//! [`Pending`] and folded into the statistics whenever they are read.

use crate::device::StreamId;
use crate::ids::{BlockId, PoolKind, SlotId};
use parking_lot::Mutex;
use std::cell::RefCell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// A block held by a thread cache: parked, or handed out from it.
#[derive(Copy, Clone, Debug)]
pub(crate) struct Entry {
    pub addr: u64,
    /// The rounded request size the block serves.
    pub key: u64,
    pub stream: StreamId,
    pub size: u64,
    pub kind: PoolKind,
    pub block: BlockId,
    /// Whether the block shares its segment (counts as inactive split while parked).
    pub split: bool,
    /// At least `max_split_size` (counts in `oversize_allocations` while handed out).
    pub oversize: bool,
    /// The caller's requested bytes while handed out.
    pub requested: u64,
}

/// Changes to one statistic made without the allocator's lock: the sums up
/// and down, and the highest point the running total reached (so that the
/// peak folds in exactly for this thread's own sequence).
#[derive(Copy, Clone, Default, Debug)]
pub(crate) struct Track {
    pub up: u64,
    pub down: u64,
    pub net: i64,
    pub max: i64,
}

impl Track {
    #[inline]
    fn up(&mut self, d: u64) {
        self.up += d;
        self.net += d as i64;
        if self.net > self.max {
            self.max = self.net;
        }
    }

    #[inline]
    fn down(&mut self, d: u64) {
        self.down += d;
        self.net -= d as i64;
    }
}

/// Indices of [`Pending`]'s tracks. A slot's moves change the allocation
/// and active counts alike (and their bytes alike), so one track serves both.
pub(crate) const COUNT: usize = 0;
pub(crate) const BYTES: usize = 1;
pub(crate) const REQUESTED: usize = 2;
pub(crate) const SPLIT: usize = 3;
pub(crate) const SPLIT_BYTES: usize = 4;
pub(crate) const OVERSIZE: usize = 5;
/// Tracks per pool kind.
pub(crate) const TRACKED: usize = 6;

/// What a slot did since the allocator last looked, per pool kind.
#[derive(Copy, Clone, Default, Debug)]
pub(crate) struct Pending {
    pub kinds: [[Track; TRACKED]; 3],
    /// Mallocs and frees served (they advance the allocator's idle clock).
    pub ops: u64,
    pub any: bool,
}

impl Pending {
    /// The slot handed out `e` (`out`) or took it back.
    #[inline]
    fn record(&mut self, e: &Entry, out: bool) {
        let t = &mut self.kinds[kind_index(e.kind)];
        if out {
            t[COUNT].up(1);
            t[BYTES].up(e.size);
            t[REQUESTED].up(e.requested);
            if e.split {
                t[SPLIT].down(1);
                t[SPLIT_BYTES].down(e.size);
            }
            if e.oversize {
                t[OVERSIZE].up(1);
            }
        } else {
            t[COUNT].down(1);
            t[BYTES].down(e.size);
            t[REQUESTED].down(e.requested);
            if e.split {
                t[SPLIT].up(1);
                t[SPLIT_BYTES].up(e.size);
            }
            if e.oversize {
                t[OVERSIZE].down(1);
            }
        }
        self.ops += 1;
        self.any = true;
    }
}

/// Index of a pool kind in [`Pending`]'s arrays.
pub(crate) fn kind_index(kind: PoolKind) -> usize {
    match kind {
        PoolKind::Small => 0,
        PoolKind::Large => 1,
        PoolKind::Huge => 2,
    }
}

/// The pool kinds in [`kind_index`] order.
pub(crate) const KINDS: [PoolKind; 3] = [PoolKind::Small, PoolKind::Large, PoolKind::Huge];

/// A 64-bit filter: which of 64 hash buckets hold at least one entry.
#[derive(Clone, Debug)]
pub(crate) struct Filter {
    counts: [u32; 64],
    bits: u64,
}

impl Default for Filter {
    fn default() -> Self {
        Filter {
            counts: [0; 64],
            bits: 0,
        }
    }
}

impl Filter {
    fn bucket(x: u64) -> usize {
        (x.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 58) as usize
    }
    fn add(&mut self, x: u64) {
        let b = Self::bucket(x);
        self.counts[b] += 1;
        self.bits |= 1 << b;
    }
    fn remove(&mut self, x: u64) {
        let b = Self::bucket(x);
        self.counts[b] -= 1;
        if self.counts[b] == 0 {
            self.bits &= !(1 << b);
        }
    }
    fn may_hold(bits: u64, x: u64) -> bool {
        bits & (1 << Self::bucket(x)) != 0
    }
}

/// The filter and `wanted` key of a rounded size on a stream.
pub(crate) fn key_hash(key: u64, stream: StreamId) -> u64 {
    key ^ stream.0.rotate_left(32)
}

/// What a slot holds; guarded by the slot's mutex.
#[derive(Default, Debug)]
pub(crate) struct SlotInner {
    /// Parked blocks, oldest first.
    pub cached: Vec<Entry>,
    /// Blocks handed out from the slot (a short list: see [`MAX_LIVE`]).
    pub live: Vec<Entry>,
    pub pending: Pending,
    cached_filter: Filter,
    live_filter: Filter,
}

/// One thread's cache for one allocator.
#[derive(Debug)]
pub(crate) struct Slot {
    pub id: SlotId,
    /// Most blocks parked at once.
    pub capacity: usize,
    pub inner: Mutex<SlotInner>,
    /// Mirrors of the filters, read without the lock to skip it on a sure miss.
    cached_bits: AtomicU64,
    live_bits: AtomicU64,
    /// Parked blocks of the large and huge pools.
    large_parked: AtomicU64,
    /// Blocks handed out from the cache so far (whether parking pays).
    hits: AtomicU64,
}

/// Most blocks a slot has handed out at once: past this many it serves no
/// more (each is looked up by a scan, newest first).
pub(crate) const MAX_LIVE: usize = 64;

/// Removes the handed-out entry at `addr`, if any.
#[inline]
fn take_live(live: &mut Vec<Entry>, addr: u64) -> Option<Entry> {
    let i = live.iter().rposition(|e| e.addr == addr)?;
    Some(live.swap_remove(i))
}

/// What a slot did with a free.
pub(crate) enum FastFree {
    /// Parked without the allocator's lock; the size the caller had requested.
    Done(u64),
    /// The allocator must look (not handed out here, or no room to park).
    Slow,
}

impl Slot {
    pub fn new(id: SlotId, capacity: usize) -> Self {
        Slot {
            id,
            capacity,
            inner: Mutex::new(SlotInner::default()),
            cached_bits: AtomicU64::new(0),
            live_bits: AtomicU64::new(0),
            large_parked: AtomicU64::new(0),
            hits: AtomicU64::new(0),
        }
    }

    /// Mirrors the filters (and, if a large block came or went, the count of
    /// parked large blocks) for lock-free reads.
    #[inline]
    fn publish(&self, g: &SlotInner, large_moved: bool) {
        self.cached_bits
            .store(g.cached_filter.bits, Ordering::Relaxed);
        self.live_bits.store(g.live_filter.bits, Ordering::Relaxed);
        if large_moved {
            let large = g
                .cached
                .iter()
                .filter(|e| e.kind != PoolKind::Small)
                .count();
            self.large_parked.store(large as u64, Ordering::Relaxed);
        }
    }

    /// Whether blocks of the large pools are parked here (a hint; the
    /// allocator checks under the slot's lock).
    pub fn holds_large(&self) -> bool {
        self.large_parked.load(Ordering::Relaxed) > 0
    }

    /// Removes the parked entries of the large and huge pools.
    pub fn take_large_locked(&self, g: &mut SlotInner) -> Vec<Entry> {
        let (large, small): (Vec<Entry>, Vec<Entry>) =
            g.cached.drain(..).partition(|e| e.kind != PoolKind::Small);
        g.cached = small;
        for e in &large {
            g.cached_filter.remove(key_hash(e.key, e.stream));
        }
        self.publish(g, true);
        large
    }

    /// Blocks handed out from the cache so far.
    pub fn hits(&self) -> u64 {
        self.hits.load(Ordering::Relaxed)
    }

    /// Hands out a parked block of rounded size `key` on `stream`, if any.
    pub fn try_alloc(&self, key: u64, stream: StreamId, requested: u64) -> Option<u64> {
        let h = key_hash(key, stream);
        if !Filter::may_hold(self.cached_bits.load(Ordering::Relaxed), h) {
            return None;
        }
        let mut g = self.inner.lock();
        if g.live.len() >= MAX_LIVE {
            return None;
        }
        let pos = g
            .cached
            .iter()
            .rposition(|e| e.key == key && e.stream == stream)?;
        let mut e = if pos + 1 == g.cached.len() {
            g.cached.pop().expect("found at the end")
        } else {
            g.cached.remove(pos)
        };
        e.requested = requested;
        g.cached_filter.remove(h);
        g.live_filter.add(e.addr);
        g.pending.record(&e, true);
        g.live.push(e);
        self.publish(&g, e.kind != PoolKind::Small);
        // Only this thread hands out from its slot, and under the slot's lock.
        self.hits
            .store(self.hits.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
        Some(e.addr)
    }

    /// Parks `addr` again if the slot handed it out and has room.
    pub fn try_free(&self, addr: u64) -> FastFree {
        if !Filter::may_hold(self.live_bits.load(Ordering::Relaxed), addr) {
            return FastFree::Slow;
        }
        let mut g = self.inner.lock();
        if g.cached.len() >= self.capacity {
            return FastFree::Slow;
        }
        let Some(e) = take_live(&mut g.live, addr) else {
            return FastFree::Slow;
        };
        g.live_filter.remove(addr);
        g.pending.record(&e, false);
        let requested = e.requested;
        self.park_locked(&mut g, e);
        FastFree::Done(requested)
    }

    /// Adds a parked entry (the caller checked the capacity).
    pub fn park_locked(&self, g: &mut SlotInner, mut e: Entry) {
        e.requested = 0;
        g.cached_filter.add(key_hash(e.key, e.stream));
        g.cached.push(e);
        self.publish(g, e.kind != PoolKind::Small);
    }

    /// Removes and returns the oldest parked entry.
    pub fn evict_oldest_locked(&self, g: &mut SlotInner) -> Option<Entry> {
        if g.cached.is_empty() {
            return None;
        }
        let e = g.cached.remove(0);
        g.cached_filter.remove(key_hash(e.key, e.stream));
        self.publish(g, e.kind != PoolKind::Small);
        Some(e)
    }

    /// Removes every parked entry.
    pub fn take_parked_locked(&self, g: &mut SlotInner) -> Vec<Entry> {
        for e in &g.cached {
            g.cached_filter.remove(key_hash(e.key, e.stream));
        }
        let all = std::mem::take(&mut g.cached);
        self.publish(g, true);
        all
    }

    /// Removes a handed-out entry (the allocator takes the block back).
    pub fn take_live_locked(&self, g: &mut SlotInner, addr: u64) -> Option<Entry> {
        let e = take_live(&mut g.live, addr)?;
        g.live_filter.remove(addr);
        self.publish(g, false);
        Some(e)
    }
}

thread_local! {
    /// This thread's slots, one per allocator (by allocator id).
    static SLOTS: RefCell<Vec<(u64, Arc<Slot>)>> = const { RefCell::new(Vec::new()) };
}

/// Runs `f` with this thread's slot for allocator `alloc_id`, registering one
/// through `register` on first use. `f` gets `None` where thread-local storage
/// is unavailable (thread teardown, or a nested registration).
#[inline(always)]
pub(crate) fn with_slot<R>(
    alloc_id: u64,
    register: impl FnOnce() -> Option<Arc<Slot>>,
    f: impl FnOnce(Option<&Slot>) -> R,
) -> R {
    let mut f = Some(f);
    let r = SLOTS.try_with(|cell| {
        let f = f.take().expect("called once");
        if let Ok(v) = cell.try_borrow() {
            if let Some((_, s)) = v.iter().find(|(id, _)| *id == alloc_id) {
                return f(Some(s));
            }
        }
        let Some(slot) = register() else {
            return f(None);
        };
        if let Ok(mut v) = cell.try_borrow_mut() {
            // Forget slots of allocators that are gone (the slot's last other owner).
            v.retain(|(_, s)| Arc::strong_count(s) > 1);
            v.push((alloc_id, slot.clone()));
        }
        f(Some(&slot))
    });
    match r {
        Ok(r) => r,
        Err(_) => (f.take().expect("not called"))(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(addr: u64, key: u64) -> Entry {
        Entry {
            addr,
            key,
            stream: StreamId(0),
            size: key,
            kind: PoolKind::Small,
            block: BlockId(0),
            split: true,
            oversize: false,
            requested: 0,
        }
    }

    #[test]
    fn filter_counts_duplicates() {
        let mut f = Filter::default();
        f.add(7);
        f.add(7);
        f.remove(7);
        assert!(Filter::may_hold(f.bits, 7));
        f.remove(7);
        assert!(!Filter::may_hold(f.bits, 7));
    }

    #[test]
    fn slot_hands_out_exact_key_and_stream_only() {
        let s = Slot::new(SlotId(0), 2);
        {
            let mut g = s.inner.lock();
            s.park_locked(&mut g, entry(0x1000, 512));
        }
        assert_eq!(s.try_alloc(1024, StreamId(0), 1000), None);
        assert_eq!(s.try_alloc(512, StreamId(1), 500), None);
        assert_eq!(s.try_alloc(512, StreamId(0), 500), Some(0x1000));
        assert_eq!(s.try_alloc(512, StreamId(0), 500), None, "handed out once");
        let g = s.inner.lock();
        assert_eq!(
            g.live.iter().find(|e| e.addr == 0x1000).unwrap().requested,
            500
        );
        assert_eq!(g.pending.kinds[0][COUNT].up, 1);
        assert_eq!(
            g.pending.kinds[0][SPLIT_BYTES].down, 512,
            "inactive split bytes go down"
        );
    }

    #[test]
    fn slot_parks_only_what_it_handed_out_and_respects_capacity() {
        let s = Slot::new(SlotId(0), 1);
        assert!(matches!(s.try_free(0x1000), FastFree::Slow), "unknown");
        {
            let mut g = s.inner.lock();
            s.park_locked(&mut g, entry(0x1000, 512));
            s.park_locked(&mut g, entry(0x2000, 512));
        }
        let a = s.try_alloc(512, StreamId(0), 512).unwrap();
        assert!(matches!(s.try_free(a), FastFree::Slow), "slot full");
        let mut g = s.inner.lock();
        assert_eq!(s.evict_oldest_locked(&mut g).map(|e| e.addr), Some(0x1000));
        drop(g);
        assert!(matches!(s.try_free(a), FastFree::Done(_)));
        assert!(
            matches!(s.try_free(a), FastFree::Slow),
            "no longer handed out"
        );
    }
}
