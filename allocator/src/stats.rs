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
///
/// Kept in the form that is cheapest to update on every malloc and free:
/// per pool group only the current value, the sum of increases and the peak
/// (`freed` is what was added and is no longer there); for `all` only the
/// current value and the peak (the peak of a sum is not the sum of the
/// peaks), its totals being the groups' sums. A decrease writes two words,
/// not four. [`StatArray::stats`] gives PyTorch's four numbers for each of
/// the three entries.
#[derive(Copy, Clone, Default)]
pub struct StatArray {
    /// `small_pool` and `large_pool`.
    groups: [Group; 2],
    /// `all`'s current value (the groups' sum, kept so that its peak is
    /// updated without reading back both groups).
    all_current: u64,
    /// The highest value `all` reached since the last peak reset.
    all_peak: u64,
    /// Bytes moved between groups ([`StatArray::move_group`]): counted in the
    /// groups' totals but not in `all`'s.
    moved: u64,
}

/// One pool group of a [`StatArray`].
#[derive(Copy, Clone, Default, PartialEq, Eq, Debug)]
struct Group {
    current: u64,
    /// Sum of all increases (so `freed` is `allocated - current`).
    allocated: u64,
    peak: u64,
}

impl Group {
    #[inline(always)]
    fn up(&mut self, n: u64) {
        self.current += n;
        self.allocated += n;
        self.peak = self.peak.max(self.current);
    }

    #[inline(always)]
    fn down(&mut self, n: u64) {
        debug_assert!(self.current >= n, "stat went below zero");
        self.current -= n;
    }

    fn stat(&self) -> Stat {
        Stat {
            current: self.current,
            peak: self.peak,
            allocated: self.allocated,
            freed: self.allocated - self.current,
        }
    }
}

/// The pool-group names, in [`StatArray::stats`] order.
pub const STAT_GROUPS: [&str; 3] = ["all", "small_pool", "large_pool"];

impl StatArray {
    /// `all`, `small_pool` and `large_pool`, in [`STAT_GROUPS`] order.
    pub fn stats(&self) -> [Stat; 3] {
        let [small, large] = self.groups.map(|g| g.stat());
        let allocated = small.allocated + large.allocated - self.moved;
        let current = self.all_current;
        debug_assert_eq!(current, small.current + large.current);
        let all = Stat {
            current,
            peak: self.all_peak,
            allocated,
            freed: allocated - current,
        };
        [all, small, large]
    }

    /// The `all` entry.
    pub fn all(&self) -> Stat {
        self.stats()[0]
    }

    /// The entry of one pool.
    pub fn pool(&self, kind: PoolKind) -> Stat {
        self.groups[kind.stat_group() - 1].stat()
    }

    #[inline]
    pub(crate) fn increase(&mut self, kind: PoolKind, n: u64) {
        self.groups[kind.stat_group() - 1].up(n);
        self.all_current += n;
        self.all_peak = self.all_peak.max(self.all_current);
    }

    #[inline]
    pub(crate) fn decrease(&mut self, kind: PoolKind, n: u64) {
        self.groups[kind.stat_group() - 1].down(n);
        self.all_current -= n;
    }

    /// Adds `d` (up or down) to the pool's group, without a branch on its
    /// sign: for changes whose sign the data decides (merges).
    #[inline]
    pub(crate) fn add(&mut self, kind: PoolKind, d: i64) {
        let g = &mut self.groups[kind.stat_group() - 1];
        debug_assert!(
            g.current.checked_add_signed(d).is_some(),
            "stat went below zero"
        );
        g.current = g.current.wrapping_add(d as u64);
        g.allocated += d.max(0) as u64;
        g.peak = g.peak.max(g.current);
        self.all_current = self.all_current.wrapping_add(d as u64);
        self.all_peak = self.all_peak.max(self.all_current);
    }

    /// Counts `n` more both allocated and freed (moves that came and went
    /// while a thread cache kept them out of the statistics).
    pub(crate) fn churn(&mut self, kind: PoolKind, n: u64) {
        self.groups[kind.stat_group() - 1].allocated += n;
    }

    /// Moves `n` from one pool group to another; `all` does not change.
    pub(crate) fn move_group(&mut self, from: PoolKind, to: PoolKind, n: u64) {
        if from.stat_group() != to.stat_group() {
            self.groups[from.stat_group() - 1].down(n);
            self.groups[to.stat_group() - 1].up(n);
            self.moved += n;
        }
    }

    fn reset_peak(&mut self) {
        for g in &mut self.groups {
            g.peak = g.current;
        }
        self.all_peak = self.all_current;
    }
}

/// Equal when PyTorch's numbers are (however they were reached).
impl PartialEq for StatArray {
    fn eq(&self, other: &Self) -> bool {
        self.stats() == other.stats()
    }
}

impl Eq for StatArray {}

impl std::fmt::Debug for StatArray {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let [all, small, large] = self.stats();
        f.debug_struct("StatArray")
            .field("all", &all)
            .field("small_pool", &small)
            .field("large_pool", &large)
            .finish()
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
    /// Blocks carved for a stream from another stream's free block: over
    /// mapped pages with expandable segments (no page moved), in a partly
    /// used segment with `borrow_holes`; their free guarded by an event on
    /// the requesting stream.
    pub num_blocks_borrowed: u64,
    /// Always 0: kept so that the statistics' layout, which the C++
    /// allocator reads by position, does not move (no rule pauses now).
    pub num_releases_paused: u64,
    /// Expandable segments: idle pages reused early by a block of their own stream
    /// before the stream was past them (mapped again at once, their old
    /// mapping dropped later) instead of waiting for a marker.
    pub num_pages_reused_early: u64,
    /// Waits of a stream for another stream's work queued on the device
    /// instead of the host (`expandable_cross_stream`, `borrow_holes`).
    pub num_stream_waits: u64,
    /// Expandable segments: pages mapped back where a shadow of them was
    /// kept (`expandable_shadows`), with no driver call.
    pub num_pages_revived: u64,
    /// Requests the device had no room for, served at the last rung before
    /// out of memory by a free block in segments of another kind (a large
    /// request in a huge segment's free tail).
    pub num_other_kind_fits: u64,
    /// Always 0: kept so that the statistics' layout, which the C++
    /// allocator reads by position, does not move (no segment is paged now).
    pub num_segments_paged: u64,
    /// Blocking waits for one event (a stream's marker, or an event guarding
    /// a block another stream used), outside `empty_cache` and out-of-memory
    /// handling, where the wait is for every stream (`num_sync_all_streams`).
    pub num_event_waits: u64,
    /// Expandable segments: marker events recorded on a stream as its blocks
    /// were freed (what makes a page's move safe without a wait).
    pub num_events_recorded: u64,
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
    /// Expandable pages partly under live blocks whose free part went back
    /// before an allocation failed (`expandable_reback`): their live granules
    /// copied to new pages mapped at the same addresses.
    pub num_pages_rebacked: u64,
    /// Expandable: granules whose page went back because another granule's
    /// page, holding their live bytes at other offsets, was mapped there
    /// (`expandable_share`).
    pub num_pages_shared: u64,
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

    /// The current value of every stat array, as (all, small pool, large
    /// pool), in [`MemoryStats::arrays`] order: what the invariant check and
    /// the model compare.
    pub fn currents(&self) -> [(&'static str, [u64; 3]); 9] {
        self.arrays()
            .map(|(n, a)| (n, a.stats().map(|s| s.current)))
    }

    /// Flat `(key, value)` pairs exactly as `torch.cuda.memory_stats()` names
    /// them (`max_split_size` is -1 when unlimited, as in PyTorch), plus our
    /// counters of virtual-memory calls (`num_map`, `num_unmap`, …).
    pub fn entries(&self) -> Vec<(String, i64)> {
        let mut out = Vec::with_capacity(120);
        let v = |x: u64| i64::try_from(x).unwrap_or(i64::MAX);
        for (name, arr) in self.arrays() {
            for (group, s) in STAT_GROUPS.iter().zip(arr.stats().iter()) {
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
        out.push(("num_blocks_borrowed".into(), v(self.num_blocks_borrowed)));
        out.push(("num_releases_paused".into(), v(self.num_releases_paused)));
        out.push((
            "num_pages_reused_early".into(),
            v(self.num_pages_reused_early),
        ));
        out.push(("num_pages_revived".into(), v(self.num_pages_revived)));
        out.push(("num_stream_waits".into(), v(self.num_stream_waits)));
        out.push(("num_other_kind_fits".into(), v(self.num_other_kind_fits)));
        out.push(("num_segments_paged".into(), v(self.num_segments_paged)));
        out.push(("num_event_waits".into(), v(self.num_event_waits)));
        out.push(("num_events_recorded".into(), v(self.num_events_recorded)));
        out.push(("num_device_alloc".into(), v(self.num_device_alloc)));
        out.push(("num_device_free".into(), v(self.num_device_free)));
        out.push(("num_vmm_reserve".into(), v(self.num_vmm_reserve)));
        out.push(("num_page_create".into(), v(self.num_page_create)));
        out.push(("num_page_release".into(), v(self.num_page_release)));
        out.push(("num_map".into(), v(self.num_map)));
        out.push(("num_unmap".into(), v(self.num_unmap)));
        out.push(("num_pages_rebacked".into(), v(self.num_pages_rebacked)));
        out.push(("num_pages_shared".into(), v(self.num_pages_shared)));
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
    use proptest::prelude::*;

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

    /// The plain form: PyTorch's four numbers per entry, each updated as
    /// the operations say (what `StatArray` stored before it was compacted).
    #[derive(Default)]
    struct Plain([Stat; 3]);

    impl Plain {
        fn up(&mut self, kind: PoolKind, n: u64) {
            for g in [0, kind.stat_group()] {
                self.0[g].increase(n);
            }
        }
        fn down(&mut self, kind: PoolKind, n: u64) {
            for g in [0, kind.stat_group()] {
                self.0[g].decrease(n);
            }
        }
    }

    #[derive(Debug, Clone)]
    enum StatOp {
        Increase(PoolKind, u64),
        Decrease(PoolKind, u64),
        Add(PoolKind, i64),
        Churn(PoolKind, u64),
        Move(PoolKind, PoolKind, u64),
        ResetPeak,
    }

    fn kind() -> impl Strategy<Value = PoolKind> {
        prop_oneof![
            Just(PoolKind::Small),
            Just(PoolKind::Large),
            Just(PoolKind::Huge)
        ]
    }

    fn stat_op() -> impl Strategy<Value = StatOp> {
        prop_oneof![
            (kind(), 0u64..1000).prop_map(|(k, n)| StatOp::Increase(k, n)),
            (kind(), 0u64..1000).prop_map(|(k, n)| StatOp::Decrease(k, n)),
            (kind(), -1000i64..1000).prop_map(|(k, d)| StatOp::Add(k, d)),
            (kind(), 0u64..100).prop_map(|(k, n)| StatOp::Churn(k, n)),
            (kind(), kind(), 0u64..1000).prop_map(|(a, b, n)| StatOp::Move(a, b, n)),
            Just(StatOp::ResetPeak),
        ]
    }

    proptest! {
        /// The compact form gives exactly the plain form's numbers after any
        /// sequence (decreases larger than the pool's current value are skipped).
        #[test]
        fn compact_stats_match_the_plain_form(ops in proptest::collection::vec(stat_op(), 0..200)) {
            let (mut a, mut p) = (StatArray::default(), Plain::default());
            for op in ops {
                let cur = |p: &Plain, k: PoolKind| p.0[k.stat_group()].current;
                match op {
                    StatOp::Increase(k, n) => { a.increase(k, n); p.up(k, n); }
                    StatOp::Decrease(k, n) if n <= cur(&p, k) => { a.decrease(k, n); p.down(k, n); }
                    StatOp::Add(k, d) if d >= 0 || d.unsigned_abs() <= cur(&p, k) => {
                        a.add(k, d);
                        if d >= 0 { p.up(k, d as u64) } else { p.down(k, d.unsigned_abs()) }
                    }
                    StatOp::Churn(k, n) => {
                        a.churn(k, n);
                        for g in [0, k.stat_group()] {
                            p.0[g].allocated += n;
                            p.0[g].freed += n;
                        }
                    }
                    StatOp::Move(f, t, n) if n <= cur(&p, f) => {
                        a.move_group(f, t, n);
                        if f.stat_group() != t.stat_group() {
                            p.0[f.stat_group()].decrease(n);
                            p.0[t.stat_group()].increase(n);
                        }
                    }
                    StatOp::ResetPeak => { a.reset_peak(); p.0.iter_mut().for_each(Stat::reset_peak); }
                    _ => continue,
                }
                prop_assert_eq!(a.stats(), p.0);
            }
        }
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
            "num_segments_paged",
            "oversize_segments.peak",
        ] {
            assert!(keys.contains(&k), "missing {k}");
        }
        assert!(e.contains(&("max_split_size".to_string(), -1)));
        assert_eq!(e.len(), 9 * 3 * 4 + 2 * 4 + 23);
    }
}
