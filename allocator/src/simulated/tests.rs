//! Tests of the simulated device.

use super::*;

#[test]
fn events_complete_once_the_host_is_the_lag_ahead() {
    let d = SimulatedDevice::new(1 << 30).with_event_lag(Some(2));
    let (s0, s1) = (StreamId(0), StreamId(1));
    let a = d.record_event(s0).unwrap();
    d.tick();
    let b = d.record_event(s0).unwrap();
    let c = d.record_event(s0).unwrap();
    let other = d.record_event(s1).unwrap();
    assert!(!d.event_completed(&a).unwrap(), "not at once");
    d.tick();
    assert!(d.event_completed(&a).unwrap(), "two operations later");
    assert!(!d.event_completed(&b).unwrap());
    d.wait_event(&c).unwrap();
    assert!(d.event_completed(&c).unwrap());
    assert!(
        d.event_completed(&b).unwrap(),
        "earlier work on the stream is done too"
    );
    assert!(
        !d.event_completed(&other).unwrap(),
        "other streams' work is not"
    );
    d.tick();
    assert!(d.event_completed(&other).unwrap());
    let e = d.record_event(s1).unwrap();
    d.synchronize().unwrap();
    assert!(d.event_completed(&e).unwrap());
    assert!(d.pending_events().is_empty());
}

#[test]
fn addresses_descend_and_capacity_holds() {
    let d = SimulatedDevice::new(10 << 20);
    let a = d.allocate(4 << 20).unwrap();
    let b = d.allocate(4 << 20).unwrap();
    assert!(b < a, "each new segment lies below the last");
    assert_eq!(d.allocate(4 << 20), Err(DeviceError::OutOfMemory));
    assert_eq!(d.counters().failed_allocs, 1);
    d.free(a, 4 << 20).unwrap();
    assert_eq!(d.free(a, 4 << 20), Err(DeviceError::InvalidAddress(a)));
    assert_eq!(
        d.mem_info().unwrap(),
        MemInfo {
            free: 6 << 20,
            total: 10 << 20
        }
    );
    assert_eq!(d.outstanding(), 1);
}

#[test]
fn released_address_space_is_reused_once_the_top_is_used_up() {
    let d = SimulatedDevice::unlimited();
    let tib = 1u64 << 40;
    let mut segs = Vec::new();
    while let Ok(p) = d.allocate(tib) {
        segs.push(p);
    }
    assert!(segs.len() > 100, "{} segments of 1 TiB", segs.len());
    d.free(segs[10], tib).unwrap();
    d.free(segs[11], tib).unwrap();
    // Two neighbouring holes merge: a 2 TiB segment fits where they were.
    let p = d.allocate(2 * tib).unwrap();
    assert_eq!(p, segs[11]);
    assert_eq!(d.allocate(tib), Err(DeviceError::OutOfMemory));
}

#[test]
fn injected_failures() {
    let d = SimulatedDevice::unlimited();
    d.fail_next_allocations(2);
    assert!(d.allocate(512).is_err());
    assert!(d.allocate(512).is_err());
    assert!(d.allocate(512).is_ok());
    d.fail_allocations_above(Some(1024));
    assert!(d.allocate(2048).is_err());
    assert!(d.allocate(1024).is_ok());
}

#[test]
fn seeded_faults_repeat_and_stop() {
    let run = |seed| {
        let d = SimulatedDevice::unlimited();
        d.inject_faults(Some(FaultPlan {
            seed,
            one_in: 4,
            calls: calls::ALLOCATE | calls::SYNCHRONIZE,
        }));
        let r: Vec<bool> = (0..64)
            .map(|_| d.allocate(512).is_ok() && d.synchronize().is_ok())
            .collect();
        d.stop_faults();
        assert!(d.allocate(512).is_ok() && d.synchronize().is_ok());
        (r, d.counters().injected_faults)
    };
    let (a, n) = run(7);
    assert_eq!(run(7).0, a, "the same seed fails the same calls");
    assert!(n > 5 && a.iter().any(|&ok| ok), "{n} faults");
    let d = SimulatedDevice::unlimited();
    d.fail_calls(calls::RECORD_EVENT, 1);
    assert!(d.record_event(StreamId(1)).is_err());
    assert!(d.record_event(StreamId(1)).is_ok());
    assert_eq!(
        d.counters().events_recorded,
        1,
        "a failed call changes nothing"
    );
}

#[test]
fn events_complete_under_control() {
    let d = SimulatedDevice::unlimited();
    let e = d.record_event(StreamId(1)).unwrap();
    assert!(!d.event_completed(&e).unwrap());
    assert!(d.complete_event(e.id()));
    assert!(d.event_completed(&e).unwrap());
    let e2 = d.record_event(StreamId(2)).unwrap();
    d.wait_event(&e2).unwrap();
    assert!(d.event_completed(&e2).unwrap());
}

#[test]
fn vmm_reserve_at_takes_a_free_hint_and_otherwise_reserves_elsewhere() {
    let d = SimulatedDevice::new(1 << 30);
    let a = d.allocate(32 << 20).unwrap();
    let b = d.allocate(32 << 20).unwrap();
    d.free(a, 32 << 20).unwrap();
    // The freed plain allocation's range: taken as asked.
    assert_eq!(d.vmm_reserve_at(32 << 20, a).unwrap(), a);
    // Taken now, as is the live allocation's: elsewhere, not overlapping.
    for hint in [a, b] {
        let r = d.vmm_reserve_at(32 << 20, hint).unwrap();
        assert!(r.0 + (32 << 20) <= a.0.min(b.0) || r.0 >= a.0.max(b.0) + (32 << 20));
        d.vmm_free_range(r, 32 << 20).unwrap();
    }
    // Misaligned or too large for the hole: elsewhere too.
    assert_ne!(
        d.vmm_reserve_at(2 << 20, DevicePtr(b.0 + 4096)).unwrap().0,
        b.0 + 4096
    );
    d.vmm_free_range(a, 32 << 20).unwrap();
    assert_ne!(d.vmm_reserve_at(64 << 20, a).unwrap(), a);
}

#[test]
fn vmm_pages_count_against_capacity() {
    let d = SimulatedDevice::new(6 << 20);
    let r = d.vmm_reserve(64 << 20).unwrap();
    let p1 = d.vmm_create_page(2 << 20).unwrap();
    let p2 = d.vmm_create_page(4 << 20).unwrap();
    assert_eq!(d.vmm_create_page(2 << 20), Err(DeviceError::OutOfMemory));
    assert!(
        d.vmm_create_page(1 << 20).is_err(),
        "not a multiple of the granularity"
    );
    d.vmm_map(r, p1, 2 << 20).unwrap();
    assert!(d.vmm_map(r, p2, 4 << 20).is_err(), "overlapping mapping");
    assert!(
        d.vmm_map(DevicePtr(r.0 + (2 << 20)), p2, 2 << 20).is_err(),
        "wrong size"
    );
    d.vmm_map(DevicePtr(r.0 + (2 << 20)), p2, 4 << 20).unwrap();
    assert!(
        d.vmm_release_page(p1).is_err(),
        "mapped pages cannot be released"
    );
    assert!(d.vmm_free_range(r, 64 << 20).is_err());
    assert!(
        d.vmm_unmap(r, 4 << 20).is_err(),
        "size must match the mapping"
    );
    d.vmm_unmap(r, 2 << 20).unwrap();
    assert!(
        d.vmm_unmap(DevicePtr(r.0 + (2 << 20)), 2 << 20).is_err(),
        "no partial unmap of a larger page"
    );
    assert!(
        d.vmm_unmap(DevicePtr(r.0 + (4 << 20)), 2 << 20).is_err(),
        "no unmap from the middle of a page"
    );
    assert_eq!(d.mappings(), vec![(DevicePtr(r.0 + (2 << 20)), 4 << 20)]);
    assert_eq!(d.ranges(), vec![(r, 64 << 20)]);
    assert_eq!(d.outstanding(), 3, "one range and two pages");
    assert_eq!(d.unmapped_page_bytes(), 2 << 20);
    assert_eq!(d.mapped_bytes_in(r, 64 << 20), 4 << 20);
    assert_eq!(d.mapped_bytes_in(r, 3 << 20), 1 << 20);
    assert_eq!(
        d.mapped_bytes_in(DevicePtr(r.0 + (3 << 20)), 2 << 20),
        2 << 20
    );
    assert_eq!(
        d.mapped_bytes_in(DevicePtr(r.0 + (5 << 20)), 4 << 20),
        1 << 20
    );
    d.vmm_unmap(DevicePtr(r.0 + (2 << 20)), 4 << 20).unwrap();
    d.vmm_release_page(p1).unwrap();
    d.vmm_release_page(p2).unwrap();
    d.vmm_free_range(r, 64 << 20).unwrap();
    assert_eq!(d.used(), 0);
    assert_eq!(d.outstanding(), 0);
}
