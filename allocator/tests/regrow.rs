//! Pages after `empty_cache` (Note [Pages after empty_cache] in the
//! expandable segments module): while reserved memory grows back towards its
//! level before an `empty_cache` that gave pages back, the default maps
//! larger pages, so a program that empties its cache every step makes fewer
//! driver calls; a program that never empties its cache maps exactly what it
//! did without the rule.

use cachealloc_core::{CachingAllocator, Config, SimulatedDevice, StreamId};

const MIB: u64 = 1 << 20;
const S0: StreamId = StreamId(0);

/// One "step": blocks of these sizes allocated, then all freed.
const STEP: [u64; 8] = [
    150 * MIB,
    90 * MIB,
    200 * MIB,
    64 * MIB,
    170 * MIB,
    120 * MIB,
    210 * MIB,
    96 * MIB,
];

fn step(a: &CachingAllocator<SimulatedDevice>) {
    let ps: Vec<_> = STEP.iter().map(|&n| a.malloc(n, S0).unwrap()).collect();
    for p in ps {
        a.free(p).unwrap();
    }
}

fn regrow(on: bool) -> Config {
    let mut config = Config::default();
    config.testing_set_regrow_pages(on);
    config
}

#[test]
fn a_step_after_empty_cache_creates_fewer_larger_pages() {
    let dev = SimulatedDevice::new(1 << 40);
    let a = CachingAllocator::new(dev.clone(), regrow(true));
    let model = a.malloc(300 * MIB, S0).unwrap(); // lives through the steps
    step(&a);
    a.empty_cache().unwrap();
    let first = dev.counters().vmm_creates;
    step(&a);
    let peak1 = a.stats().reserved_bytes.all().peak;
    a.empty_cache().unwrap();
    let second = dev.counters().vmm_creates - first;
    a.check_invariants().unwrap();
    // Without the rule, every step after the first creates what the first did.
    let dev_off = SimulatedDevice::new(1 << 40);
    let b = CachingAllocator::new(dev_off.clone(), regrow(false));
    let model_off = b.malloc(300 * MIB, S0).unwrap();
    step(&b);
    b.empty_cache().unwrap();
    let first_off = dev_off.counters().vmm_creates;
    step(&b);
    b.empty_cache().unwrap();
    let second_off = dev_off.counters().vmm_creates - first_off;
    assert!(
        second * 2 < second_off,
        "pages created growing back: {second} with the rule, {second_off} without"
    );
    // The larger pages hold no more at the peak than the step needs plus the
    // slack recycling keeps.
    let needed: u64 = STEP.iter().sum::<u64>() + 300 * MIB;
    assert!(peak1 as f64 <= needed as f64 * 1.05, "{peak1} for {needed}");
    // And the memory goes back: only the live block's pages stay.
    assert!(a.stats().reserved_bytes.all().current < 340 * MIB);
    a.free(model).unwrap();
    b.free(model_off).unwrap();
    a.empty_cache().unwrap();
    assert!(dev.mappings().is_empty());
}

#[test]
fn without_empty_cache_nothing_changes() {
    let run = |on: bool| {
        let dev = SimulatedDevice::new(1 << 40);
        let a = CachingAllocator::new(dev.clone(), regrow(on));
        for _ in 0..4 {
            step(&a);
        }
        a.check_invariants().unwrap();
        let c = dev.counters();
        (
            c.vmm_creates,
            c.vmm_maps,
            c.vmm_unmaps,
            a.stats().reserved_bytes.all().peak,
        )
    };
    assert_eq!(run(true), run(false));
}

#[test]
fn the_pytorch_preset_keeps_its_page_size() {
    assert!(!Config::pytorch().testing_regrow_pages());
    assert!(Config::default().testing_regrow_pages());
    assert!(Config::segments().testing_regrow_pages());
}
