//! Paged plain segments (`paged_margin`) under random programs on small
//! simulated devices: after every step the allocator's invariants hold
//! (page maps included), every live allocation lies on mapped pages or in a
//! plain segment, the reserved bytes are what the device lends, and a
//! request is refused only once nothing cached is left to give back. At the end
//! everything freed and `empty_cache` leave the device empty.

use cachealloc_core::{AllocError, CachingAllocator, Config, DevicePtr, SimulatedDevice, StreamId};
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
        ]),
        capacity_mib in prop::sample::select(vec![48u64, 96, 256]),
        ops in prop::collection::vec(op(), 1..160),
    ) {
        run(conf, capacity_mib * MIB, &ops)?;
    }
}
