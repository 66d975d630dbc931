//! What would slabs for small requests cost in fragmentation? A model of
//! the slab policy next to the core, replayed on traces (the `slab_eval`
//! binary; [`crate::lean`] times the same policy).
//!
//! Requests of at most the limit (after rounding to 512 bytes; at most
//! 1 MiB) get a chunk of their size class (`rounding::slab_class`) from a
//! 2 MiB slab that holds only that class; everything else goes to the core
//! under `default` without its own slabs (`default,slab_max_kb:0`: this study
//! came first, and the core's slabs followed from it). Slabs and core share
//! one simulated device. An emptied slab waits in a pool that any class
//! reuses; `empty_cache` and a full device return that pool to the device (a
//! full device also flushes the core, as its own ladder would).
//!
//! The slab operations count on the core's operation clock, as they would
//! inside the allocator.

use cachealloc_core::round_size_plain;
use cachealloc_core::TraceEvent;
use cachealloc_core::{CachingAllocator, Config, Device, DevicePtr, SimulatedDevice, StreamId};
use std::collections::HashMap;

use cachealloc_core::{slab_class, SLAB_CLASSES};

use crate::lean::SLAB_BYTES;

/// Plain segments with every request in the bins: the policy before slabs,
/// which this study measured them against.
pub const BINS_DEFAULT: &str = "segments,slab_max_kb:0";

/// [`BINS_DEFAULT`] parsed.
pub fn bins_default() -> Config {
    Config::parse(BINS_DEFAULT).expect("valid config")
}

/// The slabs: which class each holds, its live chunks and free offsets.
pub struct Slabs {
    /// Per slab: class (or usize::MAX when empty), live chunks, bump offset, address.
    slabs: Vec<(usize, u64, u64, u64)>,
    /// Per class: slabs with a free chunk; per slab: its free chunk offsets.
    partial: Vec<Vec<usize>>,
    free_chunks: Vec<Vec<u64>>,
    /// Empty slabs still held from the device, and records of released ones.
    empty: Vec<usize>,
    released: Vec<usize>,
    held: u64,
}

impl Default for Slabs {
    fn default() -> Self {
        Self::new()
    }
}

impl Slabs {
    /// No slabs yet.
    pub fn new() -> Self {
        Slabs {
            slabs: Vec::new(),
            partial: vec![Vec::new(); SLAB_CLASSES],
            free_chunks: Vec::new(),
            empty: Vec::new(),
            released: Vec::new(),
            held: 0,
        }
    }

    /// A chunk of class `c`: (slab, offset), or None when the device is full.
    pub fn alloc(&mut self, dev: &SimulatedDevice, c: usize, chunk: u64) -> Option<(usize, u64)> {
        let s = match self.partial[c].last() {
            Some(&s) => s,
            None => {
                let s = match self.empty.pop() {
                    Some(s) => s,
                    None => {
                        let addr = dev.allocate(SLAB_BYTES).ok()?.0;
                        self.held += 1;
                        match self.released.pop() {
                            Some(s) => {
                                self.slabs[s].3 = addr;
                                s
                            }
                            None => {
                                self.slabs.push((usize::MAX, 0, 0, addr));
                                self.free_chunks.push(Vec::new());
                                self.slabs.len() - 1
                            }
                        }
                    }
                };
                let addr = self.slabs[s].3;
                self.slabs[s] = (c, 0, 0, addr);
                self.free_chunks[s].clear();
                self.partial[c].push(s);
                s
            }
        };
        let off = match self.free_chunks[s].pop() {
            Some(o) => o,
            None => {
                let o = self.slabs[s].2;
                self.slabs[s].2 += chunk;
                o
            }
        };
        self.slabs[s].1 += 1;
        if self.free_chunks[s].is_empty() && self.slabs[s].2 + chunk > SLAB_BYTES {
            self.partial[c].pop();
        }
        Some((s, off))
    }

    /// Returns the chunk at `off` of slab `s`.
    pub fn free(&mut self, s: usize, off: u64, chunk: u64) {
        let c = self.slabs[s].0;
        let was_full = self.free_chunks[s].is_empty() && self.slabs[s].2 + chunk > SLAB_BYTES;
        self.slabs[s].1 -= 1;
        self.free_chunks[s].push(off);
        if self.slabs[s].1 == 0 {
            if !was_full {
                let p = &mut self.partial[c];
                let i = p
                    .iter()
                    .position(|&x| x == s)
                    .expect("a partial slab is listed");
                p.swap_remove(i);
            }
            self.slabs[s].0 = usize::MAX;
            self.empty.push(s);
        } else if was_full {
            self.partial[c].push(s);
        }
    }

    /// Returns the empty slabs to the device; false if there were none.
    pub fn release_empty(&mut self, dev: &SimulatedDevice) -> bool {
        let any = !self.empty.is_empty();
        for s in self.empty.drain(..) {
            dev.free(DevicePtr(self.slabs[s].3), SLAB_BYTES)
                .expect("slab was allocated");
            self.held -= 1;
            self.released.push(s);
        }
        any
    }
}

/// Peak reserved and peak allocated bytes (the core's allocated bytes plus
/// the live slab chunks), peak bytes in slabs, the share of operations
/// the slabs served and the device calls; None if the device ran out of
/// memory.
pub struct Run {
    /// Peak reserved bytes, the slabs' included.
    pub peak_reserved: u64,
    /// Peak allocated bytes: the core's plus the live slab chunks.
    pub peak_allocated: u64,
    /// Peak bytes held in slabs.
    pub peak_slabs: u64,
    /// The share of operations the slabs served.
    pub slab_share: f64,
    /// Device allocations and frees, the slabs' included.
    pub calls: u64,
}

/// Replays `events` with slabs up to `limit` bytes and the core under
/// `config` on a device of `capacity` (unlimited if None); `tick` counts the
/// slab operations on the core's idle clock. None if the device ran out.
pub fn replay(
    events: &[TraceEvent],
    limit: u64,
    config: &Config,
    capacity: Option<u64>,
    tick: bool,
) -> Option<Run> {
    let dev = capacity.map_or_else(SimulatedDevice::unlimited, SimulatedDevice::new);
    let core = CachingAllocator::new(dev, config.clone());
    let mut slabs = Slabs::new();
    enum Live {
        Core(DevicePtr),
        Slab(usize, u64, u64),
    }
    let mut live: HashMap<u64, Live> = HashMap::new();
    let (mut chunks, mut slab_ops, mut ops) = (0u64, 0u64, 0u64);
    let mut run = Run {
        peak_reserved: 0,
        peak_allocated: 0,
        peak_slabs: 0,
        slab_share: 0.0,
        calls: 0,
    };
    for e in events {
        match *e {
            TraceEvent::Alloc { id, bytes, stream } => {
                ops += 1;
                let r = round_size_plain(bytes).expect("a trace's sizes are below MAX_REQUEST");
                if r <= limit {
                    let (c, chunk) = slab_class(r);
                    // The ladder: a new slab, else release empty slabs, else flush the core.
                    let got = slabs.alloc(core.device(), c, chunk).or_else(|| {
                        slabs.release_empty(core.device());
                        slabs.alloc(core.device(), c, chunk).or_else(|| {
                            core.empty_cache().expect("simulated device");
                            slabs.alloc(core.device(), c, chunk)
                        })
                    });
                    let (s, off) = got?;
                    chunks += chunk;
                    slab_ops += 1;
                    if tick {
                        core.count_foreign_ops(1);
                    }
                    live.insert(id, Live::Slab(s, off, chunk));
                } else {
                    let p = match core.malloc(bytes, StreamId(stream)) {
                        Ok(p) => p,
                        Err(_) if slabs.release_empty(core.device()) => {
                            core.malloc(bytes, StreamId(stream)).ok()?
                        }
                        Err(_) => return None,
                    };
                    live.insert(id, Live::Core(p));
                }
            }
            TraceEvent::Free { id } => {
                ops += 1;
                match live.remove(&id).expect("the trace frees what it allocated") {
                    Live::Core(p) => core.free(p).expect("live pointer"),
                    Live::Slab(s, off, chunk) => {
                        slabs.free(s, off, chunk);
                        chunks -= chunk;
                        slab_ops += 1;
                        if tick {
                            core.count_foreign_ops(1);
                        }
                        if tick {
                            core.count_foreign_ops(1);
                        }
                    }
                }
            }
            TraceEvent::EmptyCache => {
                core.empty_cache().expect("simulated device");
                slabs.release_empty(core.device());
            }
        }
        let u = core.usage();
        run.peak_reserved = run.peak_reserved.max(u.reserved + slabs.held * SLAB_BYTES);
        run.peak_allocated = run.peak_allocated.max(u.allocated + chunks);
        run.peak_slabs = run.peak_slabs.max(slabs.held * SLAB_BYTES);
    }
    run.slab_share = slab_ops as f64 / ops.max(1) as f64;
    let c = core.device().counters();
    run.calls = c.allocs + c.frees;
    Some(run)
}

/// One slab policy to replay: the limit, the core's configuration, and
/// whether slab operations count on the core's idle clock.
pub struct Study {
    /// Requests of at most this many bytes (after rounding) go to slabs.
    pub limit: u64,
    /// The core's configuration.
    pub config: Config,
    /// Whether slab operations count on the core's idle clock.
    pub tick: bool,
}

impl Study {
    /// [`replay`] under this policy.
    pub fn replay(&self, events: &[TraceEvent], capacity: Option<u64>) -> Option<Run> {
        replay(events, self.limit, &self.config, capacity, self.tick)
    }

    /// The smallest capacity in (lo, hi], to 0.1% (or 2 MiB), at which the
    /// trace completes.
    pub fn min_capacity(&self, events: &[TraceEvent], lo: u64, hi: u64) -> u64 {
        let (mut lo, mut hi) = (lo, hi);
        while hi - lo > (2 << 20).max(hi / 1000) {
            let mid = lo + (hi - lo) / 2;
            if self.replay(events, Some(mid)).is_some() {
                hi = mid;
            } else {
                lo = mid;
            }
        }
        hi
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{random_plan, XorShift64, MIB};

    /// A trace of the random-op plan: slot `s`'s allocations are named
    /// `s`, `s + slots`, `s + 2 * slots`, ...
    fn plan_trace(slots: usize, max_mib: u64, ops: usize, seed: u64) -> Vec<TraceEvent> {
        let mut live: Vec<Option<u64>> = vec![None; slots];
        let mut next = 0u64;
        let mut events = Vec::new();
        for (slot, size) in random_plan(slots, max_mib * MIB, ops, seed) {
            match live[slot].take() {
                Some(id) => events.push(TraceEvent::Free { id }),
                None => {
                    live[slot] = Some(next);
                    events.push(TraceEvent::Alloc {
                        id: next,
                        bytes: size,
                        stream: 0,
                    });
                    next += 1;
                }
            }
            if next % 5000 == 4999 {
                events.push(TraceEvent::EmptyCache);
            }
        }
        events
    }

    /// Without slabs the study is the core's own replay, so its slab figures
    /// are measured against the real bins-only `default`.
    #[test]
    fn without_slabs_the_study_replays_the_core() {
        use cachealloc_core::replay::{replay as core_replay, ReplayOptions};
        let events = plan_trace(128, 16, 40_000, 7);
        let ours = replay(&events, 0, &bins_default(), None, true).expect("unlimited");
        let opts = ReplayOptions {
            report_at_peak: false,
            ..Default::default()
        };
        let theirs = core_replay(|| Ok(events.iter().copied().map(Ok)), &bins_default(), opts)
            .expect("replays");
        assert_eq!(ours.peak_reserved, theirs.peak_reserved);
        assert_eq!(ours.peak_allocated, theirs.peak_allocated);
        assert_eq!(ours.slab_share, 0.0);
        // And a device too small for the trace fails it rather than passing.
        assert!(replay(
            &events,
            0,
            &bins_default(),
            Some(ours.peak_allocated / 2),
            true
        )
        .is_none());
    }

    /// The slab model is an allocator: live chunks never overlap, each lies
    /// inside its slab, and every slab comes back once all is freed.
    #[test]
    fn slabs_hand_out_disjoint_chunks_and_give_every_slab_back() {
        use std::collections::HashSet;
        let dev = SimulatedDevice::unlimited();
        let mut slabs = Slabs::new();
        let mut live: Vec<(usize, u64, u64)> = Vec::new();
        let mut taken: HashSet<(usize, u64)> = HashSet::new();
        let mut rng = XorShift64::new(0x2545_f491_4f6c_dd1d);
        for step in 0..60_000 {
            let x = rng.next();
            if live.len() > 300 || (x % 3 == 0 && !live.is_empty()) {
                let (s, off, chunk) = live.swap_remove((x >> 8) as usize % live.len());
                assert!(taken.remove(&(s, off)));
                slabs.free(s, off, chunk);
            } else {
                let rounded = (((x >> 20) % 2048 + 1) * 512) >> ((x >> 40) % 8);
                let (c, chunk) = slab_class(round_size_plain(rounded).expect("small"));
                let (s, off) = slabs.alloc(&dev, c, chunk).expect("unlimited");
                assert!(
                    off + chunk <= SLAB_BYTES,
                    "step {step}: chunk past its slab"
                );
                assert!(
                    taken.insert((s, off)),
                    "step {step}: chunk handed out twice"
                );
                assert_eq!(slabs.slabs[s].0, c, "step {step}: slab of another class");
                live.push((s, off, chunk));
            }
        }
        for (s, off, chunk) in live.drain(..) {
            slabs.free(s, off, chunk);
        }
        assert!(slabs.partial.iter().all(Vec::is_empty));
        let held = slabs.held;
        assert!(slabs.release_empty(&dev));
        assert_eq!(slabs.held, 0);
        let c = dev.counters();
        assert_eq!((c.allocs, c.frees), (held, held));
    }
}
