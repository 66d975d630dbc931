//! Blocks freed during a CUDA graph capture handed back early
//! (Note [Reclaim during a capture]).

use super::*;

/// A block used on a captured stream and freed during the capture waits;
/// handed back, it is the next block of its size on its stream, with no
/// event recorded, and its statistics are those of a free block.
#[test]
fn a_reclaimed_block_is_reused_at_once_without_events() {
    let (dev, a) = new(Config::pytorch());
    let p = a.malloc(4096, S0).unwrap();
    let _other = a.malloc(4096, S0).unwrap();
    a.record_stream(p, S1).unwrap();
    dev.set_capturing(S0, true);
    dev.set_capturing(S1, true);
    let recorded = dev.counters().events_recorded;
    a.free(p).unwrap();
    assert_eq!(a.stats().active.all().current, 2, "held behind the capture");
    assert_ne!(a.malloc(4096, S0).unwrap(), p, "not reused while held");
    ok(&a);
    assert!(a.reclaim_deferred(p));
    ok(&a);
    assert_eq!(
        a.stats().active.all().current,
        2,
        "the held block is free again"
    );
    assert_eq!(a.malloc(4096, S0).unwrap(), p, "the best fit again");
    assert_eq!(
        dev.counters().events_recorded,
        recorded,
        "no event recorded"
    );
    assert_eq!(dev.counters().events_in_capture, 0);
    ok(&a);
    // Once the capture ends there is nothing left to guard.
    dev.set_capturing(S0, false);
    dev.set_capturing(S1, false);
    a.malloc(512, S0).unwrap();
    assert_eq!(dev.counters().events_recorded, recorded);
    ok(&a);
}

/// Only a block held behind a capture is handed back: a live block, a
/// block awaiting recorded events, an unknown address and a block already
/// handed back are left alone.
#[test]
fn only_held_blocks_are_reclaimed() {
    let (dev, a) = new(Config::pytorch());
    let live = a.malloc(4096, S0).unwrap();
    assert!(!a.reclaim_deferred(live), "allocated");
    let guarded = a.malloc(8192, S0).unwrap();
    a.record_stream(guarded, S1).unwrap();
    a.free(guarded).unwrap();
    assert!(!a.reclaim_deferred(guarded), "awaits a recorded event");
    assert_ne!(a.malloc(8192, S0).unwrap(), guarded);
    assert!(!a.reclaim_deferred(DevicePtr(0xdead_0000)), "unknown");
    let held = a.malloc(4096, S0).unwrap();
    a.record_stream(held, S1).unwrap();
    dev.set_capturing(S1, true);
    a.free(held).unwrap();
    assert!(a.reclaim_deferred(held));
    assert!(!a.reclaim_deferred(held), "already handed back");
    ok(&a);
    dev.set_capturing(S1, false);
    dev.complete_all_events();
    assert_eq!(a.malloc(8192, S0).unwrap(), guarded, "its event completed");
    ok(&a);
}
