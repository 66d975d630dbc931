//! Statistics with PyTorch's `memory_stats()` names and meanings.
//!
//! Each [`Stat`] has `current`, `peak`, `allocated` (sum of increases) and
//! `freed` (sum of decreases); each [`StatArray`] holds one per pool group
//! (`all`, `small_pool`, `large_pool`). [`MemoryStats::entries`] flattens them
//! to PyTorch's dotted keys, e.g. `allocated_bytes.all.current`.

use crate::block::PoolKind;

/// One counter with its history.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct Stat {
    /// Value now.
    pub current: u64,
    /// Highest value since the last peak reset.
    pub peak: u64,
    /// Sum of all increases.
    pub allocated: u64,
    /// Sum of all decreases.
    pub freed: u64,
}

impl Stat {
    #[inline]
    pub(crate) fn increase(&mut self, n: u64) {
        self.current += n;
        self.allocated += n;
        if self.current > self.peak {
            self.peak = self.current;
        }
    }

    #[inline]
    pub(crate) fn decrease(&mut self, n: u64) {
        debug_assert!(self.current >= n, "stat went below zero");
        self.current -= n;
        self.freed += n;
    }

    fn reset_peak(&mut self) {
        self.peak = self.current;
    }
}

/// A stat for `all`, `small_pool` and `large_pool`.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct StatArray(pub [Stat; 3]);

/// The pool-group names, in [`StatArray`] order.
pub const STAT_GROUPS: [&str; 3] = ["all", "small_pool", "large_pool"];

impl StatArray {
    /// The `all` entry.
    pub fn all(&self) -> &Stat {
        &self.0[0]
    }

    /// The entry of one pool.
    pub fn pool(&self, kind: PoolKind) -> &Stat {
        &self.0[kind.stat_group()]
    }

    #[inline]
    pub(crate) fn increase(&mut self, kind: PoolKind, n: u64) {
        self.0[0].increase(n);
        self.0[kind.stat_group()].increase(n);
    }

    #[inline]
    pub(crate) fn decrease(&mut self, kind: PoolKind, n: u64) {
        self.0[0].decrease(n);
        self.0[kind.stat_group()].decrease(n);
    }

    /// Adds `d` (up or down) to `all` and the pool's group, without a branch
    /// on its sign: for changes whose sign the data decides (merges).
    #[inline]
    pub(crate) fn add(&mut self, kind: PoolKind, d: i64) {
        let (up, down) = (d.max(0) as u64, d.min(0).unsigned_abs());
        for g in [0, kind.stat_group()] {
            let s = &mut self.0[g];
            debug_assert!(s.current + up >= down, "stat went below zero");
            s.current = s.current.wrapping_add(d as u64);
            s.allocated += up;
            s.freed += down;
            s.peak = s.peak.max(s.current);
        }
    }

    /// Moves `n` from one pool group to another; `all` does not change.
    pub(crate) fn move_group(&mut self, from: PoolKind, to: PoolKind, n: u64) {
        if from.stat_group() != to.stat_group() {
            self.0[from.stat_group()].decrease(n);
            self.0[to.stat_group()].increase(n);
        }
    }

    fn reset_peak(&mut self) {
        self.0.iter_mut().for_each(Stat::reset_peak);
    }
}

/// Everything `torch.cuda.memory_stats()` reports, with the same meanings.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MemoryStats {
    /// Allocations handed out and not yet freed by the caller.
    pub allocation: StatArray,
    /// Device segments held.
    pub segment: StatArray,
    /// Blocks allocated or freed but still awaiting other streams' events.
    pub active: StatArray,
    /// Free blocks inside split segments (they cannot be released).
    pub inactive_split: StatArray,
    /// Bytes of [`MemoryStats::allocation`] (rounded block sizes).
    pub allocated_bytes: StatArray,
    /// Bytes of [`MemoryStats::segment`].
    pub reserved_bytes: StatArray,
    /// Bytes of [`MemoryStats::active`].
    pub active_bytes: StatArray,
    /// Bytes of [`MemoryStats::inactive_split`].
    pub inactive_split_bytes: StatArray,
    /// Bytes the callers asked for (unrounded) of active blocks.
    pub requested_bytes: StatArray,
    /// Times the full flush-and-retry ran.
    pub num_alloc_retries: u64,
    /// Requests that failed with out-of-memory.
    pub num_ooms: u64,
    /// Times all pending events were waited for (device-wide synchronization).
    pub num_sync_all_streams: u64,
    /// Expandable segments: markers waited for instead of synchronizing the
    /// whole device (work queued after a marker keeps running).
    pub num_marker_waits: u64,
    /// Segment allocations from the device.
    pub num_device_alloc: u64,
    /// Segment frees to the device.
    pub num_device_free: u64,
    /// The `max_split_size` in force (`u64::MAX` when unlimited; `entries` reports -1 then, as PyTorch does).
    pub max_split_size: u64,
    /// Virtual ranges reserved for expandable segments.
    pub num_vmm_reserve: u64,
    /// Physical pages created.
    pub num_page_create: u64,
    /// Physical pages released.
    pub num_page_release: u64,
    /// Page maps.
    pub num_map: u64,
    /// Page unmaps.
    pub num_unmap: u64,
    /// Allocations of at least `max_split_size`.
    pub oversize_allocations: Stat,
    /// Segments of at least `max_split_size`.
    pub oversize_segments: Stat,
}

impl MemoryStats {
    /// Every call that changed device memory: segment allocations and frees,
    /// range reservations, page creates, releases, maps and unmaps.
    pub fn device_calls(&self) -> u64 {
        self.num_device_alloc
            + self.num_device_free
            + self.num_vmm_reserve
            + self.num_page_create
            + self.num_page_release
            + self.num_map
            + self.num_unmap
    }

    /// Resets every peak to its current value (`torch.cuda.reset_peak_memory_stats`).
    pub fn reset_peak(&mut self) {
        for a in self.arrays_mut() {
            a.reset_peak();
        }
        self.oversize_allocations.reset_peak();
        self.oversize_segments.reset_peak();
    }

    fn arrays_mut(&mut self) -> [&mut StatArray; 9] {
        [
            &mut self.allocation,
            &mut self.segment,
            &mut self.active,
            &mut self.inactive_split,
            &mut self.allocated_bytes,
            &mut self.reserved_bytes,
            &mut self.active_bytes,
            &mut self.inactive_split_bytes,
            &mut self.requested_bytes,
        ]
    }

    /// The stat arrays with their PyTorch names.
    pub fn arrays(&self) -> [(&'static str, &StatArray); 9] {
        [
            ("allocation", &self.allocation),
            ("segment", &self.segment),
            ("active", &self.active),
            ("inactive_split", &self.inactive_split),
            ("allocated_bytes", &self.allocated_bytes),
            ("reserved_bytes", &self.reserved_bytes),
            ("active_bytes", &self.active_bytes),
            ("inactive_split_bytes", &self.inactive_split_bytes),
            ("requested_bytes", &self.requested_bytes),
        ]
    }

    /// Flat `(key, value)` pairs exactly as `torch.cuda.memory_stats()` names
    /// them (`max_split_size` is -1 when unlimited, as in PyTorch), plus our
    /// counters of virtual-memory calls (`num_map`, `num_unmap`, …).
    pub fn entries(&self) -> Vec<(String, i64)> {
        let mut out = Vec::with_capacity(120);
        let v = |x: u64| i64::try_from(x).unwrap_or(i64::MAX);
        for (name, arr) in self.arrays() {
            for (group, s) in STAT_GROUPS.iter().zip(arr.0.iter()) {
                out.push((format!("{name}.{group}.current"), v(s.current)));
                out.push((format!("{name}.{group}.peak"), v(s.peak)));
                out.push((format!("{name}.{group}.allocated"), v(s.allocated)));
                out.push((format!("{name}.{group}.freed"), v(s.freed)));
            }
        }
        for (name, s) in [
            ("oversize_allocations", &self.oversize_allocations),
            ("oversize_segments", &self.oversize_segments),
        ] {
            out.push((format!("{name}.current"), v(s.current)));
            out.push((format!("{name}.peak"), v(s.peak)));
            out.push((format!("{name}.allocated"), v(s.allocated)));
            out.push((format!("{name}.freed"), v(s.freed)));
        }
        out.push(("num_alloc_retries".into(), v(self.num_alloc_retries)));
        out.push(("num_ooms".into(), v(self.num_ooms)));
        out.push(("num_sync_all_streams".into(), v(self.num_sync_all_streams)));
        out.push(("num_marker_waits".into(), v(self.num_marker_waits)));
        out.push(("num_device_alloc".into(), v(self.num_device_alloc)));
        out.push(("num_device_free".into(), v(self.num_device_free)));
        out.push(("num_vmm_reserve".into(), v(self.num_vmm_reserve)));
        out.push(("num_page_create".into(), v(self.num_page_create)));
        out.push(("num_page_release".into(), v(self.num_page_release)));
        out.push(("num_map".into(), v(self.num_map)));
        out.push(("num_unmap".into(), v(self.num_unmap)));
        out.push((
            "max_split_size".into(),
            if self.max_split_size == u64::MAX {
                -1
            } else {
                v(self.max_split_size)
            },
        ));
        out.sort();
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A signed change lands exactly as the matching increase or decrease.
    #[test]
    fn signed_add_matches_increase_and_decrease() {
        let mut a = StatArray::default();
        let mut b = StatArray::default();
        for (kind, d) in [
            (PoolKind::Large, 7i64),
            (PoolKind::Small, 3),
            (PoolKind::Large, -5),
            (PoolKind::Huge, 4),
            (PoolKind::Small, 0),
            (PoolKind::Small, -3),
        ] {
            a.add(kind, d);
            if d >= 0 {
                b.increase(kind, d as u64);
            } else {
                b.decrease(kind, d.unsigned_abs());
            }
            assert_eq!(a, b, "after {d} on {kind:?}");
        }
        assert_eq!(a.all().peak, 10);
        assert_eq!(a.pool(PoolKind::Large).freed, 5);
    }

    #[test]
    fn stat_tracks_peak_and_totals() {
        let mut s = Stat::default();
        s.increase(10);
        s.increase(5);
        s.decrease(12);
        assert_eq!(
            s,
            Stat {
                current: 3,
                peak: 15,
                allocated: 15,
                freed: 12
            }
        );
        s.reset_peak();
        assert_eq!(s.peak, 3);
    }

    #[test]
    fn arrays_update_all_and_pool() {
        let mut a = StatArray::default();
        a.increase(PoolKind::Small, 4);
        a.increase(PoolKind::Large, 6);
        assert_eq!(a.all().current, 10);
        assert_eq!(a.pool(PoolKind::Small).current, 4);
        assert_eq!(a.pool(PoolKind::Large).current, 6);
    }

    #[test]
    fn entry_names_match_pytorch() {
        let stats = MemoryStats {
            max_split_size: u64::MAX,
            ..Default::default()
        };
        let e = stats.entries();
        let keys: Vec<&str> = e.iter().map(|(k, _)| k.as_str()).collect();
        for k in [
            "allocated_bytes.all.current",
            "reserved_bytes.large_pool.peak",
            "inactive_split_bytes.small_pool.freed",
            "requested_bytes.all.allocated",
            "num_alloc_retries",
            "num_ooms",
            "num_device_alloc",
            "oversize_segments.peak",
        ] {
            assert!(keys.contains(&k), "missing {k}");
        }
        assert!(e.contains(&("max_split_size".to_string(), -1)));
        assert_eq!(e.len(), 9 * 3 * 4 + 2 * 4 + 12);
    }
}
