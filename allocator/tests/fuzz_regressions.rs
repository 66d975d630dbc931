//! Regression tests for what the fuzzers found (`fuzz/`, docs/FUZZING.md),
//! each shrunk to a few calls on the public API. A test of a bug not fixed
//! yet is `#[ignore = "bug: …"]`: un-ignore it with the fix. (All three
//! below are fixed.)
//!
//! (Two more bugs the fuzzers hit were found first by the model tests and
//! have their strict tests there: `strict_too_large_malloc_changes_nothing`
//! and `strict_no_caching_empty_cache_reports_all_it_released` in
//! `model.rs`.)

use cachealloc_core::{AllocError, CachingAllocator, Config, SimulatedDevice, StreamId};

const MIB: u64 = 1 << 20;
const S0: StreamId = StreamId(0);
const S1: StreamId = StreamId(1);

/// Found by the `ops` target (expandable preset, 2 GiB device; shrunk from
/// 1000 ops to these). Fixed in f7943d0.
///
/// Root cause (`allocator/src/allocator/malloc.rs`, `malloc_expandable`):
/// the block picked for a request is taken out of the bins and marked
/// allocated while its pages are gathered. Gathering may run a recycling
/// round (`recycle`: synchronize, `process_events`), which frees blocks
/// whose events completed; such a block next to the picked one cannot merge
/// with it then. When mapping then fails (here an injected device failure;
/// equally a full device or the cap), the picked block is put back into the
/// bins as it was, without merging with that now-free neighbour: two free
/// neighbours stay unmerged, which `check_invariants` rejects, and a page
/// straddling them is never idle (never unmapped) while they stay apart.
#[test]
fn expandable_failed_mapping_merges_neighbours_freed_meanwhile() {
    let dev = SimulatedDevice::new(2048 * MIB);
    let alloc = CachingAllocator::new(dev.clone(), Config::expandable());
    // Two 1 MiB blocks fill the first 2 MiB page of stream 0's small range.
    let a = alloc.malloc(MIB, S0).unwrap();
    let b = alloc.malloc(MIB, S0).unwrap();
    // b is used by stream 1 too: freed, it awaits an event.
    alloc.record_stream(b, S1).unwrap();
    alloc.free(b).unwrap();
    alloc.check_invariants().unwrap();
    // The next request needs a new page: growing past the peak runs a
    // recycling round (which completes b's event and frees b, next to the
    // picked block), then creating the page fails.
    dev.fail_next_allocations(1);
    let c = match alloc.malloc(512, S0) {
        Ok(c) => Some(c),
        Err(AllocError::OutOfMemory(_)) => None,
        Err(e) => panic!("malloc(512): {e}"),
    };
    alloc.check_invariants().unwrap();
    // And nothing leaks.
    alloc.free(a).unwrap();
    if let Some(c) = c {
        alloc.free(c).unwrap();
    }
    alloc.empty_cache().unwrap();
    alloc.check_invariants().unwrap();
    assert_eq!(alloc.usage().reserved, 0);
    assert_eq!(dev.outstanding(), 0);
}

/// Found by the `ops` target (expandable preset, 64 MiB device, injected
/// failures; shrunk from 1000 ops to 21, then rebuilt by hand without
/// injected failures) after the fix above. Fixed in 0374cf2.
///
/// Root cause: the same window as above, on the path where mapping
/// succeeds. While the picked block (here the free 2 MiB block whose page
/// `empty_cache` unmapped) is out of the bins and marked allocated, the
/// recycling round of `gather_pages` (the device is full) frees the block
/// after it, whose event completed; that block cannot merge with the picked
/// one. Mapping then succeeds with the page the round unmapped, and the
/// picked block is split: its free remainder goes into the bins without
/// merging with that neighbour. Two free neighbours stay unmerged.
#[test]
fn expandable_split_remainder_merges_neighbour_freed_meanwhile() {
    let dev = SimulatedDevice::new(6 * MIB);
    // 2 MiB pages in every pool (the preset's large-pool pages are 8 MiB).
    let config = Config::expandable()
        .into_builder()
        .expandable_page(2 * MIB)
        .build()
        .unwrap();
    let alloc = CachingAllocator::new(dev.clone(), config);
    // Three 2 MiB blocks tile the first 6 MiB of stream 0's large range.
    let a = alloc.malloc(2 * MIB, S0).unwrap();
    let x = alloc.malloc(2 * MIB, S0).unwrap();
    let b = alloc.malloc(2 * MIB, S0).unwrap();
    // x goes free and its page back to the device.
    alloc.free(x).unwrap();
    alloc.empty_cache().unwrap();
    // A small-pool page fills the device again.
    let small = alloc.malloc(MIB, S0).unwrap();
    assert_eq!(dev.used(), dev.capacity());
    // b, next to x, is used by stream 1: freed, it awaits an event.
    alloc.record_stream(b, S1).unwrap();
    alloc.free(b).unwrap();
    alloc.check_invariants().unwrap();
    // The request takes x (best fit) and needs its page: the device is full,
    // so a recycling round runs, which frees b (next to x) and unmaps b's
    // page; x is mapped with it and split.
    let c = alloc.malloc(MIB + 512, S0).unwrap();
    alloc.check_invariants().unwrap();
    for p in [a, small, c] {
        alloc.free(p).unwrap();
    }
    alloc.empty_cache().unwrap();
    alloc.check_invariants().unwrap();
    assert_eq!(alloc.usage().reserved, 0);
    assert_eq!(dev.outstanding(), 0);
}

/// Found by the `config` target (`expandable,expandable_page_mb:40000000`,
/// in the CI smoke), then reduced by hand to plain `expandable`. Fixed in
/// 8ee330a.
///
/// Root cause (`allocator/src/allocator/expandable/ranges.rs`, `reserve_range`):
/// each (stream, pool) reserves a virtual range as large as the device
/// (at most 1 TiB). When `vmm_reserve` fails for lack of address space —
/// the simulated device's address space holds 127 ranges of 1 TiB; a real
/// one runs out too with enough streams — the `DeviceError::OutOfMemory`
/// goes back to the caller as `AllocError::Device`: no flush-and-retry (no
/// release of empty ranges), no out-of-memory report, and the message says
/// only "device error: device out of memory". In the CLI, a trace with
/// allocations on 127 streams cannot be replayed with `-c expandable` on
/// the default (unlimited) device: "event 126: the allocator failed:
/// device error: device out of memory".
#[test]
fn expandable_range_reservation_failure_is_not_a_bare_device_error() {
    let dev = SimulatedDevice::unlimited();
    let alloc = CachingAllocator::new(dev.clone(), Config::expandable());
    let mut live = Vec::new();
    for s in 0..200 {
        match alloc.malloc(4096, StreamId(s)) {
            Ok(p) => live.push(p),
            Err(AllocError::OutOfMemory(_)) => {}
            Err(e) => panic!("malloc(4096) on stream {s}: {e:?} ({e})"),
        }
    }
    alloc.check_invariants().unwrap();
    for p in live {
        alloc.free(p).unwrap();
    }
    alloc.empty_cache().unwrap();
    assert_eq!(dev.outstanding(), 0);
}

/// Found by the `config` target (`segment_round_mb:16661974306881`, in the
/// CI smoke with the dictionary): a bug of the shared model checker, not of
/// the allocator.
///
/// Root cause (`model/src/lib.rs`, `Model::malloc`, the OOM
/// branch): to bound the segment size an OOM report may name, the model
/// computes `2 * own` where `own` is the request rounded up to
/// `segment_round`; with a segment granule above 2^63 bytes (accepted by the
/// parser: 16661974306881 MiB ≈ 1.7e19 B) that overflows, a panic in
/// builds with overflow checks (tests, fuzzing) and a wrong bound without.
/// The allocator itself is fine (its `div_ceil * segment_round` cannot
/// overflow for requests up to `MAX_REQUEST`). Fix: `saturating_mul`.
/// The key table now bounds `segment_round_mb` to 1024, so the parser
/// refuses the value; the model is still checked on such a configuration,
/// built with the `testing` feature's unchecked setter.
#[test]
fn model_oom_bound_does_not_overflow_for_a_huge_segment_round() {
    use cachealloc_model::{self as model, Op, Setup};
    assert!(Config::parse("segment_round_mb:16661974306881").is_err());
    let mut config = Config::default();
    config.testing_set_segment_round_unchecked(16661974306881 * MIB);
    let setup = Setup {
        config,
        capacity: 1 << 30,
        streams: 2,
    };
    let ops = [Op::Malloc {
        size: 25 * MIB,
        stream: 0,
    }];
    model::run(&setup, &ops).unwrap();
}
