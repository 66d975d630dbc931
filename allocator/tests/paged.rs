//! Paged plain segments (`paged_margin`) under random programs on small
//! simulated devices: after every step the allocator's invariants hold
//! (page maps included), every live allocation lies on mapped pages or in a
//! plain segment, the reserved bytes are what the device lends, and a
//! request is refused only once nothing cached is left to give back. At the end
//! everything freed and `empty_cache` leave the device empty.

use cachealloc_core::{
    AllocError, CachingAllocator, Config, DevicePtr, MemoryCap, SimulatedDevice, StreamId,
};
use proptest::prelude::*;

const MIB: u64 = 1 << 20;

#[derive(Clone, Debug)]
enum Op {
    Malloc { bytes: u64, stream: u64 },
    Free { slot: usize },
    EmptyCache,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        // 512 B to 48 MiB, log-uniform: small, medium and own-size segments.
        6 => (9u32..=25, 0u64..2, any::<u64>()).prop_map(|(log, stream, r)| Op::Malloc {
            bytes: (1u64 << log) + r % (1u64 << log),
            stream,
        }),
        4 => any::<usize>().prop_map(|slot| Op::Free { slot }),
        1 => Just(Op::EmptyCache),
    ]
}

fn run(conf: &str, capacity: u64, ops: &[Op]) -> Result<(), TestCaseError> {
    let dev = SimulatedDevice::new(capacity).with_auto_complete(true);
    let a = CachingAllocator::new(dev.clone(), Config::parse(conf).unwrap());
    let mut live: Vec<(DevicePtr, u64)> = Vec::new();
    for op in ops {
        match *op {
            Op::Malloc { bytes, stream } => match a.malloc(bytes, StreamId(stream)) {
                Ok(p) => live.push((p, bytes)),
                Err(AllocError::OutOfMemory(r)) => {
                    // Refused only after everything cached went back: no
                    // entirely free segment and no free page is left.
                    let left = a.fragmentation().releasable;
                    prop_assert_eq!(
                        left,
                        0,
                        "refused {} with {} releasable bytes: {}",
                        bytes,
                        left,
                        r
                    );
                }
                Err(e) => return Err(TestCaseError::fail(format!("malloc({bytes}): {e}"))),
            },
            Op::Free { slot } => {
                if !live.is_empty() {
                    let (p, _) = live.swap_remove(slot % live.len());
                    a.free(p).unwrap();
                }
            }
            Op::EmptyCache => {
                a.empty_cache().unwrap();
            }
        }
        a.check_invariants().map_err(TestCaseError::fail)?;
        prop_assert_eq!(a.usage().reserved, dev.used());
        for &(p, bytes) in &live {
            prop_assert!(
                dev.contains(p, bytes) || dev.mapped_bytes_in(p, bytes) == bytes,
                "live {p}+{bytes} is neither in a plain segment nor on mapped pages"
            );
        }
    }
    for (p, _) in live {
        a.free(p).unwrap();
    }
    a.empty_cache().unwrap();
    prop_assert_eq!((dev.used(), dev.outstanding()), (0, 0));
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn paged_segments_keep_their_promises(
        conf in prop::sample::select(vec![
            "pytorch,paged_margin:1",
            "default,paged_margin:1",
            "default,paged_margin:0.5",
            "default,vmm_segments:true",
            "default,vmm_segments:true,paged_margin:1",
        ]),
        capacity_mib in prop::sample::select(vec![48u64, 96, 256]),
        ops in prop::collection::vec(op(), 1..160),
    ) {
        run(conf, capacity_mib * MIB, &ops)?;
    }
}

/// `vmm_segments`: a segment of one VMM page and a request that outgrows the
/// peak (release before grow gives the free segment back) on a device that
/// runs `lag` operations behind the host.
/// (All of the peak allocated bytes may wait: `vmm_waiting_share:1`.)
fn released_while_busy(cap: Option<u64>) -> (SimulatedDevice, CachingAllocator<SimulatedDevice>) {
    released_while_busy_with("default,vmm_segments:true,vmm_waiting_share:1", cap)
}

fn released_while_busy_with(
    conf: &str,
    cap: Option<u64>,
) -> (SimulatedDevice, CachingAllocator<SimulatedDevice>) {
    let dev = SimulatedDevice::new(1 << 30).with_event_lag(Some(4));
    let a = CachingAllocator::new(dev.clone(), Config::parse(conf).unwrap());
    let s = StreamId(0);
    let p = a.malloc(100 * MIB, s).unwrap();
    assert_eq!(
        dev.counters().allocs,
        0,
        "made of a VMM page, not cuMemAlloc"
    );
    assert_eq!(dev.used(), 100 * MIB);
    a.free(p).unwrap();
    a.set_memory_cap(cap.map(MemoryCap::Bytes)).unwrap();
    a.malloc(300 * MIB, s).unwrap();
    a.check_invariants().unwrap();
    (dev, a)
}

/// Given back, the segment goes to the device only once the work queued
/// on its stream before is done, with no device-wide synchronize; until
/// then it still counts reserved, and the next growth that finds that work
/// done gives it back.
#[test]
fn a_vmm_segment_goes_back_once_its_streams_work_is_done() {
    let (dev, a) = released_while_busy(None);
    assert_eq!(a.releasing().len(), 1, "it waits for its stream's work");
    assert_eq!(a.snapshot().segments.len(), 1, "no longer a segment");
    assert_eq!((a.usage().reserved, dev.used()), (400 * MIB, 400 * MIB));
    assert_eq!(a.stats().num_sync_all_streams, 0);
    for _ in 0..4 {
        dev.tick();
    }
    a.malloc(20 * MIB, StreamId(0)).unwrap();
    assert!(a.releasing().is_empty());
    assert_eq!((a.usage().reserved, dev.used()), (320 * MIB, 320 * MIB));
    assert_eq!(a.stats().num_sync_all_streams, 0);
    assert_eq!(dev.counters().frees, 0, "no cuMemFree");
    a.check_invariants().unwrap();
}

/// Under a cap that the waiting segment's room is needed for, the request
/// waits for that segment's stream (the flush) instead of failing.
#[test]
fn a_request_that_needs_a_waiting_segments_room_waits_for_it() {
    let (dev, a) = released_while_busy(Some(350 * MIB));
    assert!(a.releasing().is_empty());
    assert_eq!((a.usage().reserved, dev.used()), (300 * MIB, 300 * MIB));
    assert_eq!(a.stats().num_alloc_retries, 1);
    assert_eq!(a.stats().num_ooms, 0);
    a.check_invariants().unwrap();
}

/// `empty_cache` leaves nothing waiting.
#[test]
fn empty_cache_gives_back_the_waiting_segments() {
    let (dev, a) = released_while_busy(None);
    assert_eq!(a.releasing().len(), 1);
    a.empty_cache().unwrap();
    assert!(a.releasing().is_empty());
    assert_eq!(dev.used(), 300 * MIB);
    a.check_invariants().unwrap();
}

/// Past `vmm_waiting_share` of the peak allocated bytes, the oldest segment
/// given back is waited for at once (its stream's event, not the device).
#[test]
fn past_the_waiting_share_the_oldest_release_is_waited_for() {
    let (dev, a) =
        released_while_busy_with("default,vmm_segments:true,vmm_waiting_share:0.5", None);
    assert!(
        a.releasing().is_empty(),
        "100 MiB may not wait for a 100 MiB peak's half"
    );
    assert_eq!((a.usage().reserved, dev.used()), (300 * MIB, 300 * MIB));
    let st = a.stats();
    assert_eq!((st.num_event_waits, st.num_sync_all_streams), (1, 0));
    a.check_invariants().unwrap();
}
