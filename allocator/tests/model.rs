//! Property (model) tests: random sequences of allocator operations on a
//! simulated device, every property checked after every step by
//! `cachealloc_model::Model` (see that module for the list).
//!
//! `PROPTEST_CASES=N` overrides the number of cases per configuration;
//! `MODEL_SKIP_INTERNAL=1` leaves out `check_invariants`, so that only the
//! model's own checks judge (used to show they catch a broken allocator).

use cachealloc_core::{Config, MemoryCap, MAX_REQUEST};
use cachealloc_model::{self as model, log_size, Op, Setup, CAPACITIES};
use proptest::prelude::*;
use proptest::test_runner::{Config as PropConfig, TestRunner};
use std::collections::BTreeMap;

const MIB: u64 = 1 << 20;

/// Requests: log-uniform from 1 B to 300 MiB, plus 0 and absurd sizes.
fn size() -> impl Strategy<Value = u64> {
    prop_oneof![
        40 => (0u32..29, any::<u64>()).prop_map(|(e, m)| log_size(e, m).min(300 * MIB)),
        1 => Just(0u64),
        1 => prop_oneof![
            Just(MAX_REQUEST),
            Just(MAX_REQUEST + 1),
            Just(u64::MAX),
            Just(1u64 << 40),
            (1u64 << 30)..(1u64 << 35),
        ],
    ]
}

fn cap() -> impl Strategy<Value = Option<MemoryCap>> {
    prop_oneof![
        1 => Just(None),
        2 => (20u32..35, any::<u64>()).prop_map(|(e, m)| Some(MemoryCap::Bytes(log_size(e, m)))),
        1 => (1u32..=100).prop_map(|p| Some(MemoryCap::Fraction(f64::from(p) / 100.0))),
    ]
}

/// Requests of a few hundred KiB to a few MiB, many of them partly filling
/// 2 MiB granules: where expandable segments share pages before out of memory.
fn granule_size() -> impl Strategy<Value = u64> {
    (18u32..22, any::<u64>()).prop_map(|(e, m)| log_size(e, m))
}

/// Ops; `faults` weighs the injected device failures (2 by default).
fn op(faults: u32) -> BoxedStrategy<Op> {
    op_sized(faults, size().boxed())
}

/// [`op`] with requests drawn from `size`.
fn op_sized(faults: u32, size: BoxedStrategy<u64>) -> BoxedStrategy<Op> {
    let slot = any::<usize>();
    prop_oneof![
        30 => (size, 0usize..3).prop_map(|(size, stream)| Op::Malloc { size, stream }),
        22 => slot.prop_map(|slot| Op::Free { slot }),
        8 => (any::<usize>(), 0usize..3).prop_map(|(slot, stream)| Op::RecordStream { slot, stream }),
        6 => any::<usize>().prop_map(|index| Op::CompleteEvent { index }),
        2 => Just(Op::CompleteAllEvents),
        2 => Just(Op::ProcessEvents),
        2 => Just(Op::EmptyCache),
        3 => cap().prop_map(Op::SetCap),
        faults => (0u64..4).prop_map(Op::FailNext),
        faults => prop_oneof![
            Just(None),
            (9u32..31, any::<u64>()).prop_map(|(e, m)| Some(log_size(e, m))),
        ]
        .prop_map(Op::FailAbove),
        2 => any::<usize>().prop_map(|slot| Op::DoubleFree { slot }),
        1 => any::<usize>().prop_map(|slot| Op::RecordStreamStale { slot }),
        2 => any::<u64>().prop_map(|seed| Op::ForeignFree { seed }),
        2 => (any::<usize>(), any::<u64>()).prop_map(|(slot, offset)| Op::InteriorFree { slot, offset }),
        1 => Just(Op::ResetPeak),
    ]
    .boxed()
}

fn cases(default: u32) -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Runs the model over random sequences with `config`; panics with the
/// shrunk failing sequence and the violated property.
fn run_config(name: &str, config: Config, n_cases: u32) -> BTreeMap<&'static str, u64> {
    run_config_with(name, config, n_cases, 2)
}

/// [`run_config`] with `faults` as the weight of injected device failures.
fn run_config_with(
    name: &str,
    config: Config,
    n_cases: u32,
    faults: u32,
) -> BTreeMap<&'static str, u64> {
    run_config_ops(name, config, n_cases, op(faults))
}

/// [`run_config`] with sequences of `ops`.
fn run_config_ops(
    name: &str,
    config: Config,
    n_cases: u32,
    ops: BoxedStrategy<Op>,
) -> BTreeMap<&'static str, u64> {
    let mut runner = TestRunner::new(PropConfig {
        cases: cases(n_cases),
        max_shrink_iters: 4096,
        failure_persistence: None,
        ..PropConfig::default()
    });
    let strategy = (
        proptest::sample::select(CAPACITIES.to_vec()),
        2usize..=3,
        proptest::collection::vec(ops, 1..200),
    );
    let ooms = std::cell::Cell::new(0);
    let mallocs = std::cell::Cell::new(0);
    let coverage = std::cell::RefCell::new(BTreeMap::new());
    let result = runner.run(&strategy, |(capacity, streams, ops)| {
        let setup = Setup {
            config: config.clone(),
            capacity,
            streams,
        };
        match model::run(&setup, &ops) {
            Ok(m) => {
                ooms.set(ooms.get() + m.ooms);
                mallocs.set(mallocs.get() + m.mallocs);
                for (k, v) in m.coverage {
                    *coverage.borrow_mut().entry(k).or_insert(0u64) += v;
                }
                Ok(())
            }
            Err(e) => Err(TestCaseError::fail(format!(
                "capacity {capacity}, {streams} streams: {e}"
            ))),
        }
    });
    if let Err(e) = result {
        panic!("config {name}: {e}");
    }
    // The sequences must reach the interesting paths, not only the easy ones.
    let (mallocs, ooms) = (mallocs.get(), ooms.get());
    assert!(
        mallocs > 0 && ooms > 0,
        "{name}: {mallocs} mallocs, {ooms} OOMs"
    );
    eprintln!(
        "{name}: {mallocs} successful mallocs, {ooms} OOMs checked; {coverage:?}",
        coverage = coverage.borrow()
    );
    coverage.into_inner()
}

fn config(name: &str) -> Config {
    model::configs()
        .into_iter()
        .find(|(n, _)| *n == name)
        .expect("known config")
        .1
}

#[test]
fn model_pytorch() {
    run_config("pytorch", config("pytorch"), 256);
}

#[test]
fn model_default() {
    run_config("default", config("default"), 256);
}

#[test]
fn model_segments() {
    run_config("segments", config("segments"), 256);
}

/// Also the ladder's last rung: requests the device has no room for
/// served from free blocks in segments of another kind.
#[test]
fn model_segments_borrow_holes() {
    let seen = run_config(
        "segments-borrow-holes",
        config("segments-borrow-holes"),
        256,
    );
    assert!(
        seen.contains_key("malloc served from a segment of another kind"),
        "{seen:?}"
    );
}

#[test]
fn model_pytorch_expandable() {
    run_config("pytorch-expandable", config("pytorch-expandable"), 128);
}

#[test]
fn model_graph_pool() {
    run_config("graph-pool", config("graph-pool"), 128);
}

#[test]
fn model_no_caching() {
    run_config("no-caching", config("no-caching"), 128);
}

#[test]
fn model_pytorch_max_split_64() {
    run_config("pytorch-max-split-64", config("pytorch-max-split-64"), 128);
}

#[test]
fn model_pytorch_garbage_collection() {
    run_config("pytorch-gc", config("pytorch-gc"), 128);
}

#[test]
fn model_pytorch_roundup_power2() {
    run_config("pytorch-roundup", config("pytorch-roundup"), 128);
}

#[test]
fn model_segments_huge_pool_64() {
    run_config("segments-huge-64", config("segments-huge-64"), 96);
}

#[test]
fn model_segments_slabs_1024() {
    run_config("segments-slabs-1024", config("segments-slabs-1024"), 256);
}

/// Slabs up to 64 KiB next to plain small blocks, whose holes other
/// streams borrow: a slab is never made of a borrowed hole.
#[test]
fn model_segments_slabs_64() {
    run_config("segments-slabs-64", config("segments-slabs-64"), 192);
}

#[test]
fn model_pytorch_slabs_16() {
    run_config("pytorch-slabs-16", config("pytorch-slabs-16"), 128);
}

/// Page-backed segments: the device's virtual ranges are the segments,
/// reserved memory is its physical pages (mapped, or pooled for reuse),
/// every allocation and every block awaiting events lies on mapped pages,
/// and `empty_cache` leaves no idle page mapped and none pooled.
#[test]
fn model_expandable() {
    run_config("expandable", config("expandable"), 256);
}

/// Requests that partly fill granules, so that pages are shared before out
/// of memory again and again: no two live blocks reach the same byte of a
/// page, members leave at `empty_cache`, nothing leaks.
#[test]
fn model_expandable_shared_pages() {
    let seen = run_config_ops(
        "expandable (shared pages)",
        config("expandable"),
        1024,
        op_sized(2, granule_size().boxed()),
    );
    assert!(
        seen.get("malloc shared pages between granules")
            .copied()
            .unwrap_or(0)
            >= 10,
        "{seen:?}"
    );
}

/// Without shadows: a page moved away is unmapped where it was at once.
#[test]
fn model_expandable_no_shadows() {
    run_config(
        "expandable-no-shadows",
        config("expandable-no-shadows"),
        192,
    );
}

#[test]
fn model_expandable_no_shadows_faults() {
    run_config_with(
        "expandable-no-shadows (faults)",
        config("expandable-no-shadows"),
        96,
        10,
    );
}

/// Other streams' busy pages waited for on the host (the preset waits on the device).
#[test]
fn model_expandable_host_waits() {
    run_config(
        "expandable-host-waits",
        config("expandable-host-waits"),
        192,
    );
}

#[test]
fn model_expandable_big_edges() {
    run_config("expandable-big-edges", config("expandable-big-edges"), 128);
}

#[test]
fn model_expandable_scaled_pages() {
    run_config(
        "expandable-scaled-pages",
        config("expandable-scaled-pages"),
        128,
    );
}

#[test]
fn model_expandable_small_pages() {
    run_config(
        "expandable-small-pages",
        config("expandable-small-pages"),
        64,
    );
}

/// Expandable segments with injected device failures (failing page
/// creations) five times as often.
#[test]
fn model_expandable_faults() {
    run_config_with("expandable (faults)", config("expandable"), 192, 10);
}

/// The fuzzers' entry point: arbitrary bytes decode to a valid sequence.
#[test]
fn model_from_bytes() {
    let mut runner = TestRunner::new(PropConfig {
        cases: cases(128),
        failure_persistence: None,
        ..PropConfig::default()
    });
    runner
        .run(&proptest::collection::vec(any::<u8>(), 0..1200), |data| {
            let (setup, ops) = model::decode(&data);
            model::run(&setup, &ops)
                .map(|_| ())
                .map_err(|e| TestCaseError::fail(format!("config {}: {e}", setup.config.name())))
        })
        .unwrap();
}

fn setup(config: Config, capacity: u64) -> Setup {
    Setup {
        config,
        capacity,
        streams: 2,
    }
}

/// A block used by another stream is not handed out until its event completes.
#[test]
fn guarded_block_waits_for_its_event() {
    let ops = [
        Op::Malloc {
            size: 4096,
            stream: 0,
        },
        Op::RecordStream { slot: 0, stream: 1 },
        Op::Free { slot: 0 },
        Op::Malloc {
            size: 4096,
            stream: 0,
        },
        Op::CompleteEvent { index: 0 },
        Op::Malloc {
            size: 4096,
            stream: 0,
        },
        Op::Malloc {
            size: 4096,
            stream: 0,
        },
    ];
    let m = model::run(&setup(Config::pytorch(), 1 << 30), &ops).unwrap();
    assert_eq!(m.ooms, 0);
}

/// OOM only after the flush: cached free segments go back before the error.
#[test]
fn oom_after_flush_with_pending_events() {
    let ops = [
        Op::Malloc {
            size: 30 * MIB,
            stream: 0,
        },
        Op::RecordStream { slot: 0, stream: 1 },
        Op::Free { slot: 0 },
        Op::Malloc {
            size: 20 * MIB,
            stream: 1,
        },
        // Fits only once the flush has waited for the event and released
        // the 30 MiB segment.
        Op::Malloc {
            size: 40 * MIB,
            stream: 0,
        },
        Op::Malloc {
            size: 60 * MIB,
            stream: 0,
        },
    ];
    let m = model::run(&setup(Config::pytorch(), 64 * MIB), &ops).unwrap();
    assert_eq!(m.ooms, 1);
}

/// Misuse of every kind is an error that changes nothing.
#[test]
fn misuse_changes_nothing() {
    let ops = [
        Op::Malloc { size: 0, stream: 0 },
        Op::Malloc {
            size: u64::MAX,
            stream: 0,
        },
        Op::Malloc {
            size: 3 * MIB,
            stream: 0,
        },
        Op::Malloc {
            size: 1000,
            stream: 1,
        },
        Op::InteriorFree {
            slot: 0,
            offset: 700,
        },
        Op::Free { slot: 1 },
        Op::DoubleFree { slot: 0 },
        Op::RecordStreamStale { slot: 0 },
        Op::ForeignFree { seed: 12345 },
        Op::ForeignFree { seed: 2 << 17 },
    ];
    model::run(&setup(Config::default(), 1 << 30), &ops).unwrap();
}

/// A lowered cap below live use: reserved stays above it, but grows no further.
#[test]
fn cap_lowered_below_use() {
    let ops = [
        Op::Malloc {
            size: 40 * MIB,
            stream: 0,
        },
        Op::Malloc {
            size: 40 * MIB,
            stream: 0,
        },
        Op::Free { slot: 0 },
        Op::SetCap(Some(MemoryCap::Bytes(10 * MIB))),
        Op::Malloc {
            size: 8 * MIB,
            stream: 0,
        },
        Op::Malloc {
            size: 512,
            stream: 0,
        },
        Op::SetCap(Some(MemoryCap::Fraction(0.5))),
        Op::Malloc {
            size: 512,
            stream: 0,
        },
    ];
    let m = model::run(&setup(Config::pytorch(), 1 << 30), &ops).unwrap();
    assert_eq!(m.ooms, 2);
}

/// Regression (fixed in f7943d0; once tolerated by a model flag): a
/// too-large request is misuse, yet `malloc` polled events first and
/// recycled the block whose event completed, so the failing call changed
/// the stats.
#[test]
fn strict_too_large_malloc_changes_nothing() {
    let ops = [
        Op::Malloc {
            size: 4096,
            stream: 0,
        },
        Op::RecordStream { slot: 0, stream: 1 },
        Op::Free { slot: 0 },
        Op::CompleteEvent { index: 0 },
        Op::Malloc {
            size: MAX_REQUEST + 1,
            stream: 0,
        },
    ];
    model::run(&setup(Config::pytorch(), 1 << 30), &ops).unwrap();
}

/// Regression (fixed in f7943d0; once tolerated by a model flag):
/// without caching, the segment freed when `empty_cache` waited for its
/// event was not counted in the `Released` it returned.
#[test]
fn strict_no_caching_empty_cache_reports_all_it_released() {
    let ops = [
        Op::Malloc {
            size: 4096,
            stream: 0,
        },
        Op::RecordStream { slot: 0, stream: 1 },
        Op::Free { slot: 0 },
        Op::EmptyCache,
    ];
    model::run(&setup(Config::no_caching(), 1 << 30), &ops).unwrap();
}

/// Found by `model_expandable`: with expandable segments, once the cap was
/// lowered below use and the blocks above it were freed, a request that
/// needs a new page failed with out-of-memory although idle pages far above
/// the cap could go back: the recycling round under the cap took only as
/// many idle pages as the request needed, so reserved memory never came
/// back under the cap. Plain segments release every free segment before an
/// out-of-memory; expandable ones now recycle down to the cap.
#[test]
fn expandable_request_above_a_lowered_cap_releases_idle_pages() {
    let m = |size, stream| Op::Malloc { size, stream };
    let ops = [
        m(1, 1),
        m(1, 1),
        m(1, 2),
        m(1, 0),
        Op::Free { slot: 2 },
        // 96 MiB + 1 on stream 1: 13 pages of 8 MiB.
        m(96 * MIB + 1, 1),
        Op::SetCap(Some(MemoryCap::Bytes(52 * MIB))),
        m(1, 0),
        m(1, 0),
        // Frees the 96 MiB block: its pages are idle, reserved stays above the cap.
        Op::Free { slot: 3 },
        m(1, 2),
        // Needs one new 2 MiB page: fits once idle pages go back.
        m(MIB + 1, 0),
    ];
    let setup = Setup {
        config: Config::expandable(),
        capacity: 512 * MIB,
        streams: 3,
    };
    model::run(&setup, &ops).unwrap();
}
