//! The checks after every step and at the end of a run.

use super::*;
use cachealloc_core::{BlockState, DevicePtr, PoolKind, StreamId, MIN_BLOCK};
use std::collections::{BTreeMap, BTreeSet};

impl Model {
    /// Every property that must hold between steps.
    pub(super) fn check(&mut self, before: &Before) -> Result<(), String> {
        if self.internal_checks {
            self.alloc
                .check_invariants()
                .map_err(|e| format!("check_invariants: {e}"))?;
        }
        let snap = self.alloc.snapshot();
        let stats = self.alloc.stats();
        let counters = self.dev.counters();

        // The snapshot's segments are exactly the device's segments (its
        // reserved virtual ranges, with expandable segments).
        let (dev_segs, other) = if self.expandable {
            (self.dev.ranges(), self.dev.segments())
        } else {
            (self.dev.segments(), self.dev.ranges())
        };
        let snap_segs: Vec<(DevicePtr, u64)> = snap
            .segments
            .iter()
            .map(|s| (s.address, s.total_size))
            .collect();
        if dev_segs != snap_segs {
            return Err(format!(
                "the allocator's segments {snap_segs:?} are not the device's {dev_segs:?}"
            ));
        }
        if !other.is_empty() {
            return Err(format!(
                "the device holds {other:?}, of the kind (plain segments or virtual ranges) this allocator does not use"
            ));
        }
        if self.expandable {
            self.check_pages(&snap)?;
            let pooled = self.pooled_bytes();
            check_expandable_stats_against_snapshot(
                &stats,
                &snap,
                self.config.max_split_size(),
                pooled,
            )?;
        } else {
            if !self.dev.mappings().is_empty() || self.dev.unmapped_page_bytes() != 0 {
                return Err("plain segments, yet the device holds physical pages".into());
            }
            let unmapped = self.dev.unmapped_page_bytes();
            check_stats_against_snapshot(&stats, &snap, self.config.max_split_size(), unmapped)?;
        }
        let reserved = stats.reserved_bytes.all().current;
        if reserved != self.dev.used() {
            return Err(format!(
                "reserved_bytes is {reserved} but the device holds {}",
                self.dev.used()
            ));
        }
        if stats.num_device_alloc != counters.allocs || stats.num_device_free != counters.frees {
            return Err(format!(
                "num_device_alloc/free {}/{} but the device counted {}/{}",
                stats.num_device_alloc, stats.num_device_free, counters.allocs, counters.frees
            ));
        }
        let usage = self.alloc.usage();
        if usage.reserved != reserved
            || usage.allocated != stats.allocated_bytes.all().current
            || usage.requested != stats.requested_bytes.all().current
            || usage.num_alloc_retries != stats.num_alloc_retries
        {
            return Err(format!("usage() {usage:?} disagrees with the stats"));
        }

        // Peaks: at least every value seen since the last reset, never below current.
        for (i, (name, a)) in stats.arrays().iter().enumerate() {
            for (g, s) in a.stats().into_iter().enumerate() {
                self.seen_peak[i][g] = self.seen_peak[i][g].max(s.current);
                if s.peak < self.seen_peak[i][g] {
                    return Err(format!(
                        "peak of {name}[{g}] is {} but {} was reached since the last reset",
                        s.peak, self.seen_peak[i][g]
                    ));
                }
            }
        }

        // The cap: a step that took a new segment ends at or under it.
        if let Some(cap) = self.cap {
            if counters.allocs > before.counters.allocs && reserved > cap {
                return Err(format!(
                    "reserved {reserved} passed the cap {cap} with a new segment"
                ));
            }
        }

        // Blocks by address, with their segment.
        let mut blocks: BTreeMap<
            u64,
            (
                &cachealloc_core::SegmentSnapshot,
                &cachealloc_core::BlockSnapshot,
            ),
        > = BTreeMap::new();
        for s in &snap.segments {
            if !self.config.caching() && (s.blocks.len() != 1 || is_free_segment(s)) {
                return Err(format!(
                    "no-caching: segment {} holds {} blocks (free: {})",
                    s.address,
                    s.blocks.len(),
                    is_free_segment(s)
                ));
            }
            for b in &s.blocks {
                blocks.insert(b.address.0, (s, b));
            }
        }

        // Live allocations: as the model knows them, in the snapshot, inside device segments.
        let n_alloc = blocks
            .values()
            .filter(|(_, b)| b.state == BlockState::Allocated)
            .count();
        if n_alloc != self.live.len() {
            return Err(format!(
                "the snapshot holds {n_alloc} allocated blocks, the caller {} allocations",
                self.live.len()
            ));
        }
        for l in &mut self.live {
            let Some(&(s, b)) = blocks.get(&l.addr) else {
                return Err(format!(
                    "live allocation {:#x} is not a block in the snapshot",
                    l.addr
                ));
            };
            if b.state != BlockState::Allocated || b.requested_size != l.size || b.size < l.rounded
            {
                return Err(format!(
                    "live allocation {:#x} ({} bytes, rounded {}) shows as {:?}",
                    l.addr, l.size, l.rounded, b
                ));
            }
            if l.block != 0 && l.block != b.size {
                return Err(format!(
                    "live allocation {:#x} changed size from {} to {}",
                    l.addr, l.block, b.size
                ));
            }
            l.block = b.size;
            if s.stream != self.streams[l.stream] {
                return Err(format!(
                    "allocation {:#x} for stream {:?} lies in a segment of stream {:?}",
                    l.addr, self.streams[l.stream], s.stream
                ));
            }
            let kind = if l.rounded <= cachealloc_core::SMALL_SIZE {
                PoolKind::Small
            } else if l.rounded >= self.config.huge_size() && !self.expandable {
                PoolKind::Huge
            } else {
                PoolKind::Large
            };
            // (The last rung puts a request in a segment of another kind,
            // never a small segment.)
            if s.pool != kind && !(l.other_kind && s.pool != PoolKind::Small) {
                return Err(format!(
                    "allocation {:#x} of {} bytes is in the {:?} pool",
                    l.addr, l.rounded, s.pool
                ));
            }
            let uses: BTreeSet<StreamId> = b.stream_uses.iter().copied().collect();
            if uses != l.uses {
                return Err(format!(
                    "allocation {:#x} shows stream uses {:?}, recorded {:?}",
                    l.addr, uses, l.uses
                ));
            }
            let inside = if self.expandable {
                self.dev.mapped_bytes_in(DevicePtr(l.addr), b.size) == b.size
                    && l.addr >= s.address.0
                    && l.addr + b.size <= s.address.0 + s.total_size
            } else {
                self.dev.contains(DevicePtr(l.addr), b.size)
            };
            if l.addr % MIN_BLOCK != 0 || !inside {
                return Err(format!(
                    "allocation {:#x}+{} is not 512-aligned inside one live device segment{}",
                    l.addr,
                    b.size,
                    if self.expandable {
                        format!(
                            " (its range, {} of its bytes mapped)",
                            self.dev.mapped_bytes_in(DevicePtr(l.addr), b.size)
                        )
                    } else {
                        String::new()
                    }
                ));
            }
        }
        let mut spans: Vec<(u64, u64)> = self.live.iter().map(|l| (l.addr, l.span())).collect();
        spans.sort_unstable();
        for w in spans.windows(2) {
            if w[0].0 + w[0].1 > w[1].0 {
                return Err(format!(
                    "live allocations {:#x}+{} and {:#x}+{} overlap",
                    w[0].0, w[0].1, w[1].0, w[1].1
                ));
            }
        }

        // Guarded blocks: still awaiting events, untouched, until their events complete.
        // (Guards whose events completed stay listed a while, to see reuse.)
        if self.guards.len() > 64 {
            let dev = &self.dev;
            let mut excess = self.guards.len() - 64;
            self.guards.retain(|g| {
                let keep = excess == 0 || g.events.iter().any(|&e| dev.is_pending(e));
                excess -= usize::from(!keep);
                keep
            });
        }
        for g in &self.guards {
            if !g.events.iter().any(|&e| self.dev.is_pending(e)) {
                continue;
            }
            match blocks.get(&g.addr) {
                Some((_, b)) if b.state == BlockState::AwaitingEvents && b.size == g.size => {}
                other => {
                    return Err(format!(
                        "block {:#x}+{} is guarded by pending events {:?} but shows as {:?}",
                        g.addr,
                        g.size,
                        g.events,
                        other.map(|(_, b)| b)
                    ))
                }
            }
        }
        self.last_snapshot = snap;
        Ok(())
    }

    /// Frees everything, empties the cache and checks that nothing is left;
    /// then lifts the cap and failures and checks the allocator still serves.
    pub fn finish(&mut self) -> Result<(), String> {
        while let Some(l) = self.live.pop() {
            self.alloc
                .free(DevicePtr(l.addr))
                .map_err(|e| format!("final free({:#x}): {e}", l.addr))?;
        }
        if self.internal_checks {
            self.alloc
                .check_invariants()
                .map_err(|e| format!("check_invariants after freeing everything: {e}"))?;
        }
        self.alloc
            .empty_cache()
            .map_err(|e| format!("final empty_cache: {e}"))?;
        if self.internal_checks {
            self.alloc
                .check_invariants()
                .map_err(|e| format!("check_invariants after the final empty_cache: {e}"))?;
        }
        let st = self.alloc.stats();
        for (name, a) in st.arrays() {
            if a.stats().iter().any(|s| s.current != 0) {
                return Err(format!(
                    "after freeing everything and empty_cache, {name} is {a:?}"
                ));
            }
        }
        if self.dev.outstanding() != 0 || self.dev.used() != 0 {
            return Err(format!(
                "after freeing everything and empty_cache, the device still holds {} segments, pages or ranges ({} bytes)",
                self.dev.outstanding(),
                self.dev.used()
            ));
        }
        let c = self.dev.counters();
        if c.vmm_creates != c.vmm_releases
            || c.vmm_maps != c.vmm_pages_unmapped
            || c.allocs != c.frees
        {
            return Err(format!(
                "after freeing everything and empty_cache, the device counts {}/{} segments allocated/freed, {}/{} pages created/released, {}/{} mapped/unmapped",
                c.allocs, c.frees, c.vmm_creates, c.vmm_releases, c.vmm_maps, c.vmm_pages_unmapped
            ));
        }
        if !self.dev.pending_events().is_empty() {
            return Err("events left pending after the final empty_cache".into());
        }
        self.alloc.set_memory_cap(None).map_err(|e| e.to_string())?;
        self.dev.fail_next_allocations(0);
        self.dev.fail_allocations_above(None);
        if self.dev.capacity() >= 2 * MIB {
            let p = self
                .alloc
                .malloc(4096, self.streams[0])
                .map_err(|e| format!("malloc(4096) on an empty allocator: {e}"))?;
            self.alloc.free(p).map_err(|e| e.to_string())?;
            self.alloc.empty_cache().map_err(|e| e.to_string())?;
            if self.dev.outstanding() != 0 {
                return Err("a segment outlived the last empty_cache".into());
            }
        }
        Ok(())
    }
}
