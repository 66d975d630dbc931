//! `record_stream` with PyTorch's guarantee under every preset: a block
//! used on another stream is not handed out again until that use has
//! completed (the allocator queries the guarding event), and the allocator
//! inserts no device wait to reuse it sooner.

use cachealloc_core::{CachingAllocator, Config, SimulatedDevice, StreamId};

const SIZES: [u64; 5] = [16, 4096, 3 << 20, 50 << 20, 300 << 20];

#[test]
fn a_block_used_on_another_stream_waits_for_that_use() {
    for conf in [
        "default",
        "segments",
        "pytorch",
        "default,expandable_segments:False",
    ] {
        for size in SIZES {
            let dev = SimulatedDevice::new(1 << 36).with_auto_complete(false);
            let a = CachingAllocator::new(dev.clone(), Config::parse(conf).unwrap());
            let (own, other) = (StreamId(1), StreamId(0));
            let p = a.malloc(size, own).unwrap();
            a.record_stream(p, other).unwrap();
            a.free(p).unwrap();
            let waits = dev.counters().stream_waits;
            let q = a.malloc(size, own).unwrap();
            assert_ne!(
                p, q,
                "{conf}, {size} B: reused while the other stream may use it"
            );
            assert_eq!(
                dev.counters().stream_waits,
                waits,
                "{conf}, {size} B: a device wait was inserted"
            );
            // Once the other stream's use is done, the block comes back.
            dev.complete_all_events();
            a.free(q).unwrap();
            let r = a.malloc(size, own).unwrap();
            assert!(
                r == p || r == q,
                "{conf}, {size} B: {r:?} is neither {p:?} nor {q:?}"
            );
            a.free(r).unwrap();
            a.check_invariants().unwrap();
        }
    }
}

#[test]
fn the_owning_stream_alone_needs_no_event() {
    for conf in ["default", "segments"] {
        let dev = SimulatedDevice::new(1 << 36).with_auto_complete(false);
        let a = CachingAllocator::new(dev.clone(), Config::parse(conf).unwrap());
        let p = a.malloc(4096, StreamId(1)).unwrap();
        a.record_stream(p, StreamId(1)).unwrap();
        a.free(p).unwrap();
        assert_eq!(a.malloc(4096, StreamId(1)).unwrap(), p, "{conf}");
    }
}

/// A block its user freed is no allocation while it awaits its events: a
/// pointer into it is unknown (not an interior pointer), its start a double
/// free, under every preset, and neither changes anything.
#[test]
fn a_freed_block_awaiting_events_is_not_live() {
    use cachealloc_core::AllocError;
    for conf in ["default", "segments", "pytorch"] {
        let dev = SimulatedDevice::new(1 << 36).with_auto_complete(false);
        let a = CachingAllocator::new(dev.clone(), Config::parse(conf).unwrap());
        let p = a.malloc(4096, StreamId(1)).unwrap();
        a.record_stream(p, StreamId(0)).unwrap();
        a.free(p).unwrap();
        let inside = cachealloc_core::DevicePtr(p.0 + 512);
        assert!(
            matches!(a.free(inside), Err(AllocError::UnknownPointer(q)) if q == inside),
            "{conf}: {:?}",
            a.free(inside)
        );
        assert!(
            matches!(a.free(p), Err(AllocError::DoubleFree(q)) if q == p),
            "{conf}: {:?}",
            a.free(p)
        );
        // A live block's interior is still reported as one.
        let live = a.malloc(4096, StreamId(1)).unwrap();
        let into = cachealloc_core::DevicePtr(live.0 + 512);
        assert!(
            matches!(a.free(into), Err(AllocError::InteriorPointer { block, .. }) if block == live),
            "{conf}"
        );
        dev.complete_all_events();
        a.free(live).unwrap();
    }
}
