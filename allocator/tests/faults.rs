//! Fault injection: every device call can fail, on a seeded schedule, and
//! the allocator must stay whole.
//!
//! For every preset (expandable included) and several seeds, random
//! sequences of mallocs, frees, cross-stream uses, event completions,
//! `empty_cache` and cap changes run on a simulated device that fails one
//! call in N of every kind (segment alloc/free, event record/query/wait,
//! synchronize, memory info, and the virtual memory calls). After every
//! operation:
//! - `check_invariants` holds (every block, bin, segment and event in place);
//! - reserved bytes equal the device's used bytes (segments, or the physical
//!   pages of expandable segments, mapped or pooled: nothing counted twice or
//!   lost), and every statistic equals what a snapshot recomputes (with
//!   expandable segments, reserved bytes from the mapped bytes plus the
//!   device's unmapped pages);
//! - a failed free of a live allocation is a device error, never a double
//!   free or an unknown pointer: the block stays allocated and the free can
//!   be retried.
//!
//! Once the faults stop, freeing everything, completing every event and
//! `empty_cache` bring reserved memory, and the device's memory, back to 0.
//!
//! `FAULT_CASES=N` sets the number of sequences per preset (default 24).

use cachealloc_core::sample::XorShift64;
use cachealloc_core::sim_calls as calls;
use cachealloc_core::{
    AllocError, CachingAllocator, Config, DevicePtr, FaultPlan, MemoryCap, SimulatedDevice,
    StreamId,
};
use cachealloc_model::{check_expandable_stats_against_snapshot, check_stats_against_snapshot};

const MIB: u64 = 1 << 20;
const STREAMS: [StreamId; 3] = [StreamId(0), StreamId(7), StreamId(9)];

/// Log-uniform from 1 B to about 2^(max_exp+1) B.
fn size(rng: &mut XorShift64, max_exp: u64) -> u64 {
    let e = rng.below(max_exp);
    (1u64 << e) + rng.below(1u64 << e)
}

type Alloc = CachingAllocator<SimulatedDevice>;

fn check(a: &Alloc, dev: &SimulatedDevice, step: usize, what: &str) -> Result<(), String> {
    let at = |e: String| format!("step {step} ({what}): {e}");
    a.check_invariants().map_err(at)?;
    let snap = a.snapshot();
    let max_split = a.config().max_split_size();
    if a.is_expandable() {
        // Pages reused early, pooled with only their old mapping left, are pooled too.
        let early: u64 = a.stale_mappings().iter().filter(|m| m.2).map(|m| m.1).sum();
        let pooled = dev.unmapped_page_bytes() + early;
        check_expandable_stats_against_snapshot(&a.stats(), &snap, max_split, pooled)
            .map_err(at)?;
    } else {
        // Pages of paged segments whose release failed are held unmapped.
        let unmapped = dev.unmapped_page_bytes();
        check_stats_against_snapshot(&a.stats(), &snap, max_split, unmapped).map_err(at)?;
    }
    // Every byte the device holds for the allocator is counted once:
    // segments, or physical pages (mapped or pooled) of expandable segments.
    let reserved = a.stats().reserved_bytes.all().current;
    if reserved != dev.used() {
        return Err(at(format!(
            "reserved {reserved} B but the device holds {} B",
            dev.used()
        )));
    }
    Ok(())
}

/// One random sequence under faults; the error names the step and what broke.
fn run(config: &Config, seed: u64, steps: usize, one_in: u32) -> Result<u64, String> {
    let dev = SimulatedDevice::new(1 << 30);
    let a = CachingAllocator::new(dev.clone(), config.clone());
    let mut rng = XorShift64::new(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
    dev.inject_faults(Some(FaultPlan {
        seed,
        one_in,
        calls: calls::ALL,
    }));
    let mut live: Vec<DevicePtr> = Vec::new();
    for step in 0..steps {
        let what;
        match rng.below(20) {
            0..=7 => {
                let size = if rng.below(4) == 0 {
                    size(&mut rng, 28)
                } else {
                    size(&mut rng, 21)
                };
                let stream = STREAMS[rng.below(3) as usize];
                what = format!("malloc {size} on {stream:?}");
                match a.malloc(size, stream) {
                    Ok(p) => live.push(p),
                    Err(AllocError::OutOfMemory(_) | AllocError::Device(_)) => {}
                    Err(e) => return Err(format!("step {step} ({what}): {e}")),
                }
            }
            8..=13 if !live.is_empty() => {
                let i = rng.below(live.len() as u64) as usize;
                what = format!("free {}", live[i]);
                match a.free(live[i]) {
                    Ok(()) => {
                        live.swap_remove(i);
                    }
                    // The block stays allocated; it is freed again later.
                    Err(AllocError::Device(_)) => {}
                    Err(e) => return Err(format!("step {step} ({what}): {e}")),
                }
            }
            14 | 15 if !live.is_empty() => {
                let i = rng.below(live.len() as u64) as usize;
                let stream = STREAMS[rng.below(3) as usize];
                what = format!("record_stream {} {stream:?}", live[i]);
                a.record_stream(live[i], stream)
                    .map_err(|e| format!("step {step} ({what}): {e}"))?;
            }
            16 => {
                what = "complete events".into();
                match rng.below(3) {
                    0 => dev.complete_all_events(),
                    _ => {
                        if let Some(&id) = dev.pending_events().first() {
                            dev.complete_event(id);
                        }
                    }
                }
            }
            17 => {
                what = "process_events".into();
                let _ = a.process_events();
            }
            18 => {
                what = "empty_cache".into();
                let _ = a.empty_cache();
            }
            _ => {
                let cap = match rng.below(3) {
                    0 => None,
                    1 => Some(MemoryCap::Bytes((64 + rng.below(512)) * MIB)),
                    _ => Some(MemoryCap::Fraction(0.25 + rng.below(4) as f64 / 4.0)),
                };
                what = format!("set_memory_cap {cap:?}");
                let _ = a.set_memory_cap(cap);
            }
        }
        check(&a, &dev, step, &what)?;
    }
    let faults = dev.counters().injected_faults;
    // The faults stop: everything can be given back.
    dev.stop_faults();
    for p in live.drain(..) {
        a.free(p)
            .map_err(|e| format!("free {p} after the faults stopped: {e}"))?;
    }
    dev.complete_all_events();
    a.empty_cache()
        .map_err(|e| format!("empty_cache after the faults stopped: {e}"))?;
    check(&a, &dev, steps, "final empty_cache")?;
    let reserved = a.stats().reserved_bytes.all().current;
    if reserved != 0 || dev.used() != 0 || dev.outstanding() != 0 {
        return Err(format!(
            "after freeing everything and empty_cache: reserved {reserved} B, device used {} B, {} device allocations outstanding",
            dev.used(),
            dev.outstanding()
        ));
    }
    Ok(faults)
}

fn cases() -> u64 {
    std::env::var("FAULT_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(24)
}

fn run_preset(name: &str) {
    let config = Config::parse(name).unwrap();
    let mut faults = 0;
    for seed in 1..=cases() {
        for one_in in [3, 8, 40] {
            match run(&config, seed * 1000 + u64::from(one_in), 300, one_in) {
                Ok(n) => faults += n,
                Err(e) => panic!("{name}, seed {seed}, one call in {one_in} fails: {e}"),
            }
        }
    }
    assert!(faults > 100, "{name}: only {faults} faults injected");
}

#[test]
fn faults_pytorch() {
    run_preset("pytorch");
}

#[test]
fn faults_default() {
    run_preset("default");
}

#[test]
fn faults_expandable() {
    run_preset("expandable");
}

/// Regression: with one call in 8 failing, sequence 333 (of
/// `FAULT_CASES=400`) reaches step 298, a 237 MiB malloc on stream 0 whose
/// recycling round took idle pages from free blocks and then failed to query
/// a stream's marker event: it returned before taking those blocks out of
/// the idle index, where a free block holding no whole page was left. Now
/// the pages taken so far are indexed first, as after a failed unmap. (The
/// default 24 sequences do not reach it.)
#[test]
fn faults_expandable_sequence_333() {
    let config = Config::parse("expandable").unwrap();
    if let Err(e) = run(&config, 333 * 1000 + 8, 300, 8) {
        panic!("{e}");
    }
}

#[test]
fn faults_no_caching() {
    run_preset("no-caching");
}

#[test]
fn faults_pytorch_gc_and_slabs() {
    run_preset("pytorch,garbage_collection_threshold:0.6,per_process_memory_fraction:0.8");
    run_preset("pytorch,slab_max_kb:16,roundup_power2_divisions:4");
}

/// Regression: a free whose event could not be recorded on one stream and
/// whose fallback synchronize failed returned with the block half freed
/// (events queued for it, its count of pending events unset, gone from the
/// live map); a retried free said double free, and `empty_cache` left the
/// segment reserved for ever. Now the failed free changes nothing and can
/// be retried.
#[test]
fn failed_guarded_free_changes_nothing() {
    for (streams, recorded_first) in [(1, 0), (2, 1), (3, 1), (3, 2)] {
        let dev = SimulatedDevice::new(1 << 30);
        let a = CachingAllocator::new(dev.clone(), Config::pytorch());
        let p = a.malloc(4096, StreamId(0)).unwrap();
        for s in 1..=streams {
            a.record_stream(p, StreamId(s)).unwrap();
        }
        let before = a.stats();
        dev.fail_calls_after(calls::RECORD_EVENT, recorded_first, 1);
        dev.fail_calls(calls::SYNCHRONIZE, 1);
        assert!(matches!(a.free(p), Err(AllocError::Device(_))));
        a.check_invariants().unwrap();
        assert_eq!(a.stats(), before, "the failed free changed the stats");
        a.free(p).expect("the retried free succeeds");
        dev.complete_all_events();
        a.empty_cache().unwrap();
        a.check_invariants().unwrap();
        assert_eq!(a.stats().reserved_bytes.all().current, 0);
        assert_eq!(dev.used(), 0);
    }
}

/// Regression: an event query that failed after `process_events` had
/// taken completed events dropped those blocks: they stayed awaiting
/// events for ever and their segment could not be released.
#[test]
fn failed_event_query_recycles_what_completed() {
    let dev = SimulatedDevice::new(1 << 30);
    let a = CachingAllocator::new(dev.clone(), Config::pytorch());
    let p = a.malloc(4096, StreamId(0)).unwrap();
    let q = a.malloc(4096, StreamId(0)).unwrap();
    a.record_stream(p, StreamId(1)).unwrap();
    a.record_stream(q, StreamId(2)).unwrap();
    a.free(p).unwrap();
    a.free(q).unwrap();
    dev.complete_all_events();
    dev.fail_calls_after(calls::EVENT_QUERY, 1, 1);
    assert!(a.process_events().is_err());
    a.check_invariants().unwrap();
    a.process_events().unwrap();
    a.empty_cache().unwrap();
    a.check_invariants().unwrap();
    assert_eq!(dev.used(), 0);
}

/// `empty_cache` (and the out-of-memory flush, which shares its path)
/// gives back a block another stream used only after waiting for that
/// stream's work: the events guarding it are waited for on the device, not
/// merely polled. (A wait replaced by a poll would release the segment
/// while the other stream's work is still queued.)
#[test]
fn empty_cache_waits_for_the_events_guarding_a_block() {
    for conf in ["segments", "default", "pytorch"] {
        let dev = SimulatedDevice::new(1 << 30);
        let a = CachingAllocator::new(dev.clone(), Config::parse(conf).unwrap());
        let p = a.malloc(30 << 20, StreamId(0)).unwrap();
        a.record_stream(p, StreamId(7)).unwrap();
        a.free(p).unwrap();
        assert!(
            !dev.pending_events().is_empty(),
            "{conf}: the free is guarded"
        );
        a.empty_cache().unwrap();
        assert!(
            dev.pending_events().is_empty(),
            "{conf}: memory given back while the other stream's work was queued"
        );
        assert_eq!(dev.outstanding(), 0, "{conf}");
        a.check_invariants().unwrap();
    }
}
