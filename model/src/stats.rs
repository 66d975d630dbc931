//! Statistics recomputed from snapshots and checked against the allocator's.

use cachealloc_core::{BlockState, MemoryStats, PoolKind, Snapshot};

/// Whether no block of the segment is in use (merged, that is one free block).
pub(crate) fn is_free_segment(s: &cachealloc_core::SegmentSnapshot) -> bool {
    s.blocks.iter().all(|b| b.state == BlockState::Free)
}

/// Number of entirely free (releasable) segments in a snapshot.
pub fn free_segments(snap: &Snapshot) -> usize {
    snap.segments.iter().filter(|s| is_free_segment(s)).count()
}

/// The statistics group of a pool: `small_pool` (1) or `large_pool` (2; the
/// huge pool counts with the large one).
pub(crate) fn group(kind: PoolKind) -> usize {
    match kind {
        PoolKind::Small => 1,
        _ => 2,
    }
}

/// Checks that every statistic's `current` equals what the snapshot
/// recomputes, per pool group, and that each stat is self-consistent
/// (plain segments; see [`check_expandable_stats_against_snapshot`]).
/// `unmapped`: bytes of pages of paged segments the device still holds
/// unmapped (a release it refused), counted reserved under some pool.
pub fn check_stats_against_snapshot(
    stats: &MemoryStats,
    snap: &Snapshot,
    max_split_size: u64,
    unmapped: u64,
) -> Result<(), String> {
    check_stats(stats, snap, max_split_size, false, unmapped)
}

/// [`check_stats_against_snapshot`] for expandable segments, where reserved
/// bytes are physical pages: the mapped bytes of the segments (their
/// `mapped_size`), per pool, plus `pooled` bytes of unmapped pages kept for
/// reuse (whose pool the snapshot does not show: each pool's reserved bytes
/// are at least its mapped bytes, and the total is exactly mapped plus
/// pooled). Free space of an expandable segment is not inactive-split
/// memory, and no segment counts as oversize.
pub fn check_expandable_stats_against_snapshot(
    stats: &MemoryStats,
    snap: &Snapshot,
    max_split_size: u64,
    pooled: u64,
) -> Result<(), String> {
    check_stats(stats, snap, max_split_size, true, pooled)
}

pub(crate) fn check_stats(
    stats: &MemoryStats,
    snap: &Snapshot,
    max_split_size: u64,
    expandable: bool,
    pooled: u64,
) -> Result<(), String> {
    // Indices into `stats.arrays()`.
    const ALLOCATION: usize = 0;
    const SEGMENT: usize = 1;
    const ACTIVE: usize = 2;
    const INACTIVE_SPLIT: usize = 3;
    const ALLOCATED_BYTES: usize = 4;
    const RESERVED_BYTES: usize = 5;
    const ACTIVE_BYTES: usize = 6;
    const INACTIVE_SPLIT_BYTES: usize = 7;
    const REQUESTED_BYTES: usize = 8;
    let mut expect = [[0u64; 3]; 9];
    let mut add = |array: usize, kind: PoolKind, n: u64| {
        expect[array][0] += n;
        expect[array][group(kind)] += n;
    };
    let mut oversize_allocs = 0;
    let mut oversize_segs = 0;
    for s in &snap.segments {
        let k = s.pool;
        add(SEGMENT, k, 1);
        if expandable {
            if s.mapped_size > s.total_size {
                return Err(format!(
                    "snapshot: segment {} maps {} of its {} bytes",
                    s.address, s.mapped_size, s.total_size
                ));
            }
            add(RESERVED_BYTES, k, s.mapped_size);
        } else {
            // (A paged segment may have given free pages back.)
            if s.mapped_size > s.total_size {
                return Err(format!(
                    "snapshot: plain segment {} says {} of its {} bytes are mapped",
                    s.address, s.mapped_size, s.total_size
                ));
            }
            add(RESERVED_BYTES, k, s.mapped_size);
            if s.total_size >= max_split_size {
                oversize_segs += 1;
            }
        }
        let split = s.blocks.len() > 1 && !expandable;
        let mut allocated = 0;
        let mut at = s.address.0;
        for b in &s.blocks {
            if b.address.0 != at {
                return Err(format!(
                    "snapshot: block at {} does not follow the previous one (expected {at:#x})",
                    b.address
                ));
            }
            at += b.size;
            match b.state {
                BlockState::Allocated => {
                    add(ALLOCATION, k, 1);
                    add(ALLOCATED_BYTES, k, b.size);
                    add(ACTIVE, k, 1);
                    add(ACTIVE_BYTES, k, b.size);
                    add(REQUESTED_BYTES, k, b.requested_size);
                    allocated += b.size;
                    if b.size >= max_split_size {
                        oversize_allocs += 1;
                    }
                }
                BlockState::AwaitingEvents => {
                    add(ACTIVE, k, 1);
                    add(ACTIVE_BYTES, k, b.size);
                    add(REQUESTED_BYTES, k, b.requested_size);
                }
                BlockState::Free | BlockState::Parked | BlockState::Aliased => {
                    if split {
                        add(INACTIVE_SPLIT, k, 1);
                        add(INACTIVE_SPLIT_BYTES, k, b.size);
                    }
                }
            }
        }
        if at != s.address.0 + s.total_size {
            return Err(format!(
                "snapshot: blocks of segment {} cover {} of {} bytes",
                s.address,
                at - s.address.0,
                s.total_size
            ));
        }
        if allocated != s.allocated_size {
            return Err(format!(
                "snapshot: segment {} says {} allocated, its blocks {allocated}",
                s.address, s.allocated_size
            ));
        }
    }
    for (i, (name, got)) in stats.arrays().iter().enumerate() {
        let groups = got.stats();
        for (g, group) in cachealloc_core::STAT_GROUPS.iter().enumerate() {
            let s = groups[g];
            let (c, w) = (s.current, expect[i][g]);
            // Pooled (unmapped) pages count under some pool: each group
            // holds at least its mapped bytes, all of them mapped plus pooled.
            let wrong = match i {
                RESERVED_BYTES if g == 0 => c != w + pooled,
                RESERVED_BYTES => c < w || c > w + pooled,
                _ => c != w,
            };
            if wrong {
                return Err(format!(
                    "stat {name}.{group}.current is {c} but the snapshot recomputes {w} (and {pooled} bytes of unmapped pages)"
                ));
            }
            if s.peak < s.current || s.allocated.wrapping_sub(s.freed) != s.current {
                return Err(format!("stat {name}.{group} is inconsistent: {s:?}"));
            }
        }
    }
    if stats.oversize_allocations.current != oversize_allocs {
        return Err(format!(
            "oversize_allocations.current is {} but the snapshot has {oversize_allocs}",
            stats.oversize_allocations.current
        ));
    }
    if stats.oversize_segments.current != oversize_segs {
        return Err(format!(
            "oversize_segments.current is {} but the snapshot has {oversize_segs}",
            stats.oversize_segments.current
        ));
    }
    Ok(())
}

pub(crate) fn overlaps(a: u64, alen: u64, b: u64, blen: u64) -> bool {
    a < b.saturating_add(blen) && b < a.saturating_add(alen)
}
