//! The allocator's side of the per-thread caches (`crate::thread_slot`).
//!
//! Under the allocator's lock a freed block whose size its thread recently
//! missed is *parked* in the thread's slot (counted as freed, kept out of the
//! bins). The slot then hands it out and takes it back on its own; those
//! moves are tallied in the slot and folded into the statistics by
//! [`ThreadCaches::sync_slot`], which also brings the blocks' states up to date.
//! Lock order: the allocator's state, then a slot.

use super::Core;
use crate::block::{BlockId, BlockState, PoolKind};
use crate::device::{DevicePtr, StreamId};
use crate::error::AllocError;
use crate::ids::SlotId;
use crate::rounding::round_size;
use crate::thread_slot::{
    key_hash, kind_index, Entry, Slot, SlotInner, Track, BYTES, COUNT, KINDS, OVERSIZE, REQUESTED,
    SPLIT, SPLIT_BYTES,
};
use std::sync::Arc;

/// A thread cache's recently missed request sizes: a block freed with one of
/// these sizes is parked for the thread instead of going back to the bins,
/// as long as parking pays (see `ThreadCaches::should_park`).
#[derive(Clone, Copy)]
pub(super) struct Wanted {
    keys: [u64; 8],
    next: usize,
    /// Parks still allowed before the slot must show hits (each hit earns
    /// [`CREDIT_PER_HIT`]).
    credit: u32,
    /// The slot's hit count when last looked at.
    hits_seen: u64,
    /// Parks refused for lack of credit (every [`PROBE_EVERY`]th goes ahead).
    refused: u32,
}

impl Default for Wanted {
    fn default() -> Self {
        Wanted {
            keys: [0; 8],
            next: 0,
            credit: INITIAL_CREDIT,
            hits_seen: 0,
            refused: 0,
        }
    }
}

/// How to fold one tracked statistic: raise it by `.0` (the highest point
/// the thread's own sequence reached), lower it by `.1` (to where it ended),
/// then add `.2` to both totals, so that current, peak, allocated and freed
/// all come out as if each move had been applied in order.
fn fold(t: &Track) -> Option<(u64, u64, u64)> {
    if t.up == 0 && t.down == 0 {
        return None;
    }
    let max = t.max as u64;
    Some((max, (t.max - t.net) as u64, t.up - max))
}

/// Parks a new slot may make before its hits must pay for them.
pub(super) const INITIAL_CREDIT: u32 = 8;
/// Parks earned by each block handed out from a slot.
const CREDIT_PER_HIT: u32 = 4;
/// Credit is capped, so that a thread whose sizes stop repeating stops
/// parking after at most this many wasted parks.
const MAX_CREDIT: u32 = 64;
/// Without credit, one candidate in this many is parked anyway (a probe: its
/// hit would restore the credit).
pub(super) const PROBE_EVERY: u32 = 8;

/// Operations under the allocator's lock per review of the thread caches.
pub(super) const REVIEW_WINDOW: u64 = 4096;
/// The caches pay while their hits are at least 1/`PAYING_SHARE` of the
/// operations that still took the lock: a hit saves about a core malloc and
/// free, while the caches cost every operation a lookup and a check.
const PAYING_SHARE: u64 = 4;
/// Longest run, in windows, of an allocator without its caches before it
/// tries them again even though its shadow saw no repeats.
pub(super) const OFF_WINDOWS: u32 = 64;
/// Recently freed sizes the shadow remembers while the caches are off.
const SHADOW: usize = 8;

/// Whether the thread caches pay for themselves. With sizes that do not
/// repeat (a random mix) a thread cache rarely hits, and the lookups on
/// every malloc and free cost more than its hits save; the allocator then
/// turns its caches off (a plain load of one flag per call). While they are
/// off, a *shadow* under the lock remembers the last few freed sizes and
/// counts the mallocs that repeat one of them, i.e. that a cache would have
/// served; when those pay, the caches go back on at the end of the window.
#[derive(Clone, Copy, Debug)]
pub(super) struct ThreadCacheReview {
    /// Operations that took the allocator's lock so far.
    locked_ops: u64,
    /// The slots' summed hit counts at the start of the window.
    hits_base: u64,
    /// Whether the caches are on (they start on).
    pub paying: bool,
    /// Windows left before caches that were turned off are tried anyway.
    off_windows: u32,
    /// While off: the last freed block sizes, and the mallocs
    /// in this window that asked for one of them.
    shadow: [u64; SHADOW],
    shadow_next: usize,
    shadow_hits: u64,
}

/// The per-thread caches' data on the allocator's side: the slots, their
/// recent misses, how many blocks they hold and whether they pay.
pub(super) struct ThreadCaches {
    /// Thread caches by [`SlotId`] (`None`: index free for reuse).
    slots: Vec<Option<Arc<Slot>>>,
    /// Per thread cache: its recent misses.
    wanted: Vec<Wanted>,
    /// Blocks held by thread caches (parked or handed out from one).
    cached_blocks: usize,
    /// Whether the thread caches pay for themselves (see `ThreadCaches::review`).
    review: ThreadCacheReview,
    /// Blocks parked per thread cache (0: thread caches off).
    thread_cache: usize,
}

impl ThreadCaches {
    /// No slots yet; `thread_cache` blocks parked per slot (0: off).
    pub(super) fn new(thread_cache: usize) -> Self {
        ThreadCaches {
            slots: Vec::new(),
            wanted: Vec::new(),
            cached_blocks: 0,
            review: ThreadCacheReview::default(),
            thread_cache,
        }
    }
}

impl Default for ThreadCacheReview {
    fn default() -> Self {
        ThreadCacheReview {
            locked_ops: 0,
            hits_base: 0,
            paying: true,
            off_windows: 0,
            shadow: [u64::MAX; SHADOW],
            shadow_next: 0,
            shadow_hits: 0,
        }
    }
}

impl ThreadCaches {
    /// Counts one locked operation and, at the end of each window, decides
    /// whether the thread caches stay on. Returns the new setting when it
    /// changes (the caller flushes the caches when they go off).
    #[inline]
    pub(super) fn review(&mut self) -> Option<bool> {
        if self.thread_cache == 0 {
            return None;
        }
        let r = &mut self.review;
        r.locked_ops += 1;
        if r.locked_ops % REVIEW_WINDOW != 0 {
            return None;
        }
        self.end_review_window()
    }

    /// The decision at the end of a review window.
    #[cold]
    fn end_review_window(&mut self) -> Option<bool> {
        let hits: u64 = self.slots.iter().flatten().map(|s| s.hits()).sum();
        let r = &mut self.review;
        let new_hits = hits.saturating_sub(r.hits_base);
        r.hits_base = hits;
        let shadow_hits = std::mem::take(&mut r.shadow_hits);
        if r.paying {
            if new_hits * PAYING_SHARE >= REVIEW_WINDOW {
                return None;
            }
            r.paying = false;
            r.off_windows = OFF_WINDOWS;
            r.shadow = [u64::MAX; SHADOW];
            Some(false)
        } else {
            r.off_windows -= 1;
            // With the caches on, a hit also spares the lock for its free:
            // `h` hits among `n` calls leave `n - 2h` locked, so the test
            // above, h * PAYING_SHARE >= n - 2h, reads as follows here.
            let would_pay = shadow_hits * (PAYING_SHARE + 2) >= REVIEW_WINDOW;
            if !would_pay && r.off_windows > 0 {
                return None;
            }
            r.paying = true;
            Some(true)
        }
    }

    /// Thread cache slots so far (a slot's index is its [`SlotId`]).
    pub(super) fn slot_count(&self) -> usize {
        self.slots.len()
    }

    /// Blocks held by thread caches (parked or handed out from one).
    #[inline]
    pub(super) fn cached_blocks(&self) -> usize {
        self.cached_blocks
    }

    /// Whether the caches pay for themselves (the last review's verdict).
    pub(super) fn paying(&self) -> bool {
        self.review.paying
    }

    /// Remembers that thread cache `slot` missed a request of `rounded`
    /// bytes on `stream` (a block freed with that size may be parked for it).
    #[inline]
    pub(super) fn note_miss(&mut self, slot: SlotId, rounded: u64, stream: StreamId) {
        let w = &mut self.wanted[slot.0 as usize];
        w.keys[w.next] = key_hash(rounded, stream);
        w.next = (w.next + 1) % w.keys.len();
    }

    /// While the caches are off: would a cache have served this malloc of
    /// `rounded` bytes? (Sizes only: the shadow is an estimate, kept cheap.)
    #[inline]
    pub(super) fn shadow_malloc(&mut self, rounded: u64) {
        if self.thread_cache == 0 || self.review.paying {
            return;
        }
        let r = &mut self.review;
        if let Some(i) = r.shadow.iter().position(|&k| k == rounded) {
            r.shadow[i] = u64::MAX;
            r.shadow_hits += 1;
        }
    }

    /// While the caches are off: remembers a freed block's size.
    #[inline]
    pub(super) fn shadow_free(&mut self, size: u64) {
        if self.thread_cache == 0 || self.review.paying {
            return;
        }
        let r = &mut self.review;
        r.shadow[r.shadow_next] = size;
        r.shadow_next = (r.shadow_next + 1) % SHADOW;
    }

    /// A new slot for a thread, or `None` when thread caches are off.
    pub(super) fn register_slot(&mut self) -> Option<Arc<Slot>> {
        if self.thread_cache == 0 {
            return None;
        }
        let index = match self.slots.iter().position(Option::is_none) {
            Some(i) => i,
            None => {
                self.slots.push(None);
                self.wanted.push(Wanted::default());
                self.slots.len() - 1
            }
        };
        let slot = Arc::new(Slot::new(SlotId(index as u32), self.thread_cache));
        self.slots[index] = Some(slot.clone());
        self.wanted[index] = Wanted::default();
        Some(slot)
    }

    fn slot(&self, id: SlotId) -> Arc<Slot> {
        self.slots[id.0 as usize]
            .clone()
            .expect("a block's thread cache stays registered while it holds blocks")
    }

    /// Whether the freed, allocated block `id` should be parked for thread
    /// cache `slot`: its size is one the thread recently missed, and parking
    /// still pays. A park that is never taken back costs an eviction and a
    /// merge later, so each park spends one credit and each block the slot
    /// hands out earns [`CREDIT_PER_HIT`]; without credit a thread (whose
    /// sizes do not repeat, as in a random mix) considers only one free in
    /// [`PROBE_EVERY`], so that a hit can restore it.
    pub(super) fn should_park<E>(&mut self, core: &Core<E>, slot: SlotId, id: BlockId) -> bool {
        if self.thread_cache == 0 || core.recorder.is_some() {
            return false;
        }
        // (Expandable allocators have no thread caches: `thread_cache` is 0 there.)
        let b = core.blocks.get(id.0);
        if !b.stream_uses.is_empty() {
            return false;
        }
        let i = slot.0 as usize;
        let (Some(holder), Some(w)) = (
            self.slots.get(i).and_then(Option::as_ref),
            self.wanted.get_mut(i),
        ) else {
            return false;
        };
        let hits = holder.hits();
        let new_hits = hits.saturating_sub(w.hits_seen);
        w.hits_seen = hits;
        let earned = new_hits.min(u64::from(MAX_CREDIT)) as u32 * CREDIT_PER_HIT;
        w.credit = (w.credit + earned).min(MAX_CREDIT);
        if w.credit == 0 {
            w.refused = w.refused.wrapping_add(1);
            if w.refused % PROBE_EVERY != 0 {
                return false;
            }
        }
        let Some(key) = round_size(b.requested.max(1), &core.config.roundup_power2_divisions)
        else {
            return false;
        };
        let h = key_hash(key, core.stream_list[b.pool.stream_slot()]);
        let wanted = if b.pool.kind() == crate::block::PoolKind::Small {
            w.keys.contains(&h)
        } else {
            // A large block only for an immediate repeat: the thread's last request was its size.
            w.keys[(w.next + w.keys.len() - 1) % w.keys.len()] == h
        };
        if wanted {
            w.credit = w.credit.saturating_sub(1);
        }
        wanted
    }

    /// Parks the allocated block `id` (still in the live map) in thread cache
    /// `slot`: counted as freed, kept out of the bins. If the slot is full,
    /// evicts its oldest parked block and returns it (for the caller to
    /// return to the bins).
    #[must_use]
    pub(super) fn park<E>(
        &mut self,
        core: &mut Core<E>,
        slot: SlotId,
        id: BlockId,
    ) -> Option<BlockId> {
        let b = core.blocks.get(id.0);
        let (addr, size, pool, requested, split) =
            (b.addr, b.size, b.pool, b.requested, b.is_split());
        let key = round_size(requested.max(1), &core.config.roundup_power2_divisions)
            .expect("checked by should_park");
        let kind = pool.kind();
        let oversize = size >= core.config.max_split_size;
        // Counted as freed by its caller, as a free would.
        core.count_allocated(kind, size, false);
        core.count_active(kind, size, requested, false);
        if split {
            core.stats.inactive_split.increase(kind, 1);
            core.stats.inactive_split_bytes.increase(kind, size);
        }
        let clock = core.clock;
        let b = core.blocks.get_mut(id.0);
        b.state = BlockState::Parked;
        b.requested = 0;
        b.freed_at = clock;
        b.holder = Some(slot);
        self.cached_blocks += 1;
        let entry = Entry {
            addr,
            key,
            stream: core.stream_list[pool.stream_slot()],
            size,
            kind,
            block: id,
            split,
            oversize,
            requested: 0,
        };
        let holder = self.slot(slot);
        let mut g = holder.inner.lock();
        let mut evicted = None;
        if g.cached.len() >= holder.capacity {
            self.sync_slot(core, &mut g);
            evicted = holder.evict_oldest_locked(&mut g).map(|old| old.block);
        }
        holder.park_locked(&mut g, entry);
        evicted
    }

    /// Takes the block at `addr`, handed out by thread cache `holder`, back
    /// into the allocator's own keeping (still allocated). A parked block
    /// there means the caller already freed it.
    pub(super) fn take_back<E>(
        &mut self,
        core: &mut Core<E>,
        holder: SlotId,
        addr: u64,
    ) -> Result<(), AllocError> {
        let slot = self.slot(holder);
        let mut g = slot.inner.lock();
        self.sync_slot(core, &mut g);
        let Some(e) = slot.take_live_locked(&mut g, addr) else {
            return Err(AllocError::DoubleFree(DevicePtr(addr)));
        };
        core.blocks.get_mut(e.block.0).holder = None;
        self.cached_blocks -= 1;
        Ok(())
    }

    /// Folds what the slot did on its own into the statistics and the block states.
    pub(super) fn sync_slot<E>(&mut self, core: &mut Core<E>, g: &mut SlotInner) {
        if g.pending.any {
            let p = std::mem::take(&mut g.pending);
            core.clock += p.ops;
            let s = &mut core.stats;
            for kind in KINDS {
                let tracks = &p.kinds[kind_index(kind)];
                let arrays = [
                    (&mut s.allocation, COUNT),
                    (&mut s.allocated_bytes, BYTES),
                    (&mut s.active, COUNT),
                    (&mut s.active_bytes, BYTES),
                    (&mut s.requested_bytes, REQUESTED),
                    (&mut s.inactive_split, SPLIT),
                    (&mut s.inactive_split_bytes, SPLIT_BYTES),
                ];
                for (a, t) in arrays {
                    if let Some((up, down, extra)) = fold(&tracks[t]) {
                        a.increase(kind, up);
                        a.decrease(kind, down);
                        a.churn(kind, extra);
                    }
                }
                if let Some((up, down, extra)) = fold(&tracks[OVERSIZE]) {
                    let o = &mut s.oversize_allocations;
                    o.increase(up);
                    o.decrease(down);
                    o.allocated += extra;
                    o.freed += extra;
                }
            }
        }
        for e in &g.live {
            let b = core.blocks.get_mut(e.block.0);
            b.state = BlockState::Allocated;
            b.requested = e.requested;
        }
        for e in &g.cached {
            let b = core.blocks.get_mut(e.block.0);
            b.state = BlockState::Parked;
            b.requested = 0;
        }
    }

    /// Takes a parked block (its slot synced) out of the thread caches,
    /// free but not yet filed: returns its pool kind, whether it is a slab
    /// chunk, and since when it is idle (its caller's free, or a free
    /// neighbour's), for the caller to file it.
    pub(super) fn unpark<E>(&mut self, core: &mut Core<E>, id: BlockId) -> (PoolKind, bool, u64) {
        let b = core.blocks.get_mut(id.0);
        debug_assert_eq!(b.state, BlockState::Parked);
        let (addr, size, kind, split, slab) = (b.addr, b.size, b.pool.kind(), b.is_split(), b.slab);
        // Idle since the caller (or a free neighbour's caller) freed it, not since the flush.
        let mut parked_at = b.freed_at;
        for n in [b.prev, b.next].into_iter().flatten() {
            let nb = core.blocks.get(n.0);
            if nb.state == BlockState::Free {
                parked_at = parked_at.max(nb.freed_at);
            }
        }
        let b = core.blocks.get_mut(id.0);
        b.state = BlockState::Free;
        b.holder = None;
        self.cached_blocks -= 1;
        core.live.remove(addr);
        if split {
            core.stats.inactive_split.decrease(kind, 1);
            core.stats.inactive_split_bytes.decrease(kind, size);
        }
        (kind, slab, parked_at)
    }

    /// Takes the parked large blocks out of slot `own`, for the caller to
    /// return to the bins before a large request of that thread is placed
    /// (a parked block serves only a repeat of its own size before any
    /// other large request).
    pub(super) fn take_own_large<E>(&mut self, core: &mut Core<E>, own: SlotId) -> Vec<BlockId> {
        let holds = self.slots[own.0 as usize]
            .as_ref()
            .is_some_and(|s| s.holds_large());
        if !holds {
            return Vec::new();
        }
        let slot = self.slot(own);
        let mut g = slot.inner.lock();
        self.sync_slot(core, &mut g);
        slot.take_large_locked(&mut g)
            .into_iter()
            .map(|e| e.block)
            .collect()
    }

    /// Brings every slot's tallies and block states up to date.
    pub(super) fn sync_thread_caches<E>(&mut self, core: &mut Core<E>) {
        if self.cached_blocks == 0 {
            return;
        }
        for slot in self.slots.clone().into_iter().flatten() {
            let mut g = slot.inner.lock();
            self.sync_slot(core, &mut g);
        }
    }

    /// Takes every parked block out of slot `i` (for the caller to return
    /// to the bins), and forgets the slot if its thread ended with nothing
    /// in it.
    pub(super) fn take_parked<E>(&mut self, core: &mut Core<E>, i: usize) -> Vec<BlockId> {
        let Some(slot) = self.slots[i].clone() else {
            return Vec::new();
        };
        let mut g = slot.inner.lock();
        self.sync_slot(core, &mut g);
        let parked = slot
            .take_parked_locked(&mut g)
            .into_iter()
            .map(|e| e.block)
            .collect();
        let idle = g.live.is_empty();
        drop(g);
        // Two owners left (the list and the clone above): the thread is gone.
        if idle && Arc::strong_count(&slot) == 2 {
            self.slots[i] = None;
        }
        parked
    }

    /// Every slot's entries name blocks it holds, in the matching state.
    /// (Each slot is synced under its lock first: its thread may have moved
    /// blocks since the allocator last looked.)
    pub(super) fn check_slots<E>(&mut self, core: &mut Core<E>) -> Result<(), String> {
        let mut n = 0;
        for slot in self.slots.clone().into_iter().flatten() {
            let mut g = slot.inner.lock();
            self.sync_slot(core, &mut g);
            let entries = g.cached.iter().map(|e| (e, BlockState::Parked));
            for (e, want) in entries.chain(g.live.iter().map(|e| (e, BlockState::Allocated))) {
                n += 1;
                let b = core.blocks.get(e.block.0);
                if b.addr != e.addr
                    || b.size != e.size
                    || b.holder != Some(slot.id)
                    || b.state != want
                {
                    return Err(format!(
                        "thread cache {:?} holds {e:?} but the block is {:?} at {:#x}+{} held by {:?}",
                        slot.id, b.state, b.addr, b.size, b.holder
                    ));
                }
            }
            if g.cached.len() > slot.capacity {
                return Err(format!(
                    "thread cache {:?} parks {} blocks",
                    slot.id,
                    g.cached.len()
                ));
            }
        }
        if n != self.cached_blocks {
            return Err(format!(
                "thread caches list {n} blocks but {} are held",
                self.cached_blocks
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
