//! GPU test of paged plain segments (`paged_margin`, CUDA virtual memory
//! API): free segments split again by smaller requests are made paged, and
//! under a memory cap the pages inside free holes of partly used
//! segments go back to the device before an allocation fails, so a request
//! that unpaged segments cannot serve under the cap succeeds; the live
//! blocks' data survive, a block handed out over given-back pages gets them
//! mapped again, and `empty_cache` leaves nothing reserved. When the best
//! fit lies over pages given back that the capped device cannot map again,
//! a larger free block of a plain segment, mapped, serves instead. A
//! segment made paged keeps its address (the driver takes the freed
//! range as a hint; a hint in use gets a range elsewhere).
//!
//! Skips (with a printed reason) when there is no CUDA driver or device, or
//! the device has no VMM API.

use cachealloc::core::{CachingAllocator, Config, MemoryCap};
use cachealloc::cuda::driver::Stream;

mod common;
use common::{
    blocks_mismatches, fill, filled_blocks, mismatches, serial, vmm_device as gpu_device, MIB,
};

/// PyTorch's segment sizes under a cap, every large segment paged or none.
fn capped(cap: u64, margin: f64) -> Config {
    Config {
        memory_cap: Some(MemoryCap::Bytes(cap)),
        paged_margin: margin,
        ..Config::pytorch()
    }
}

#[test]
fn free_pages_of_partly_used_segments_serve_a_request_under_a_cap() {
    let _serial = serial();
    let Some(dev) = gpu_device() else { return };
    println!("device: {}", dev.name());
    dev.bind_thread().unwrap();
    let s = Stream::new(&dev).unwrap();
    let cap = 256 * MIB;
    for margin in [0.0, 1.0] {
        let dev = cachealloc::cuda::CudaDevice::new(0).unwrap();
        let alloc = CachingAllocator::new(dev, capped(cap, margin));
        // Ten 20 MiB segments, each taken whole and freed: the 4 MiB blocks
        // below split them again, which with paging on makes them paged.
        let whole: Vec<_> = (0..10)
            .map(|_| alloc.malloc(20 * MIB, s.id()).unwrap())
            .collect();
        for &p in &whole {
            alloc.free(p).unwrap();
        }
        // 50 blocks of 4 MiB in those ten segments, every other one freed:
        // 100 MiB in 4 MiB holes between live blocks.
        let blocks = filled_blocks(&alloc, 50, 4 * MIB, s.id(), 0xC0DE_0000);
        let paged = alloc.stats().num_segments_paged;
        assert_eq!(paged, if margin == 0.0 { 0 } else { 10 });
        // The driver takes the address hint: each segment made paged keeps
        // the range of its plain allocation, so the layout does not change.
        let now: Vec<u64> = alloc
            .snapshot()
            .segments
            .iter()
            .map(|g| g.address.0)
            .collect();
        let kept = whole.iter().filter(|p| now.contains(&p.0)).count();
        println!("margin {margin}: {kept} of 10 segments at their first address");
        assert_eq!(kept, 10);
        for p in blocks.iter().skip(1).step_by(2) {
            alloc.free(*p).unwrap();
        }
        // 128 MiB more would be 328 MiB > cap.
        let big = alloc.malloc(128 * MIB, s.id());
        if margin == 0.0 {
            assert!(
                big.is_err(),
                "one allocation per segment: nothing to give back"
            );
        } else {
            let big = big.expect("served by the holes' pages");
            fill(big, 128 * MIB, s.id(), 0xB16B_16B1);
            let bad = mismatches(big, 128 * MIB, s.id(), 0xB16B_16B1)
                + blocks_mismatches(&blocks, 2, 4 * MIB, s.id(), 0xC0DE_0000);
            let st = alloc.stats();
            println!(
                "cap {} MiB: 128 MiB served; {paged} segments made paged, {} pages created, \
                 {} released, {} device syncs; reserved {} MiB; {bad} bad words",
                cap / MIB,
                st.num_page_create,
                st.num_page_release,
                st.num_sync_all_streams,
                alloc.usage().reserved / MIB
            );
            assert_eq!(bad, 0, "live data changed when free pages went back");
            assert!(alloc.usage().reserved <= cap);
            alloc.free(big).unwrap();
            // Blocks over given-back pages: mapped again when handed out, and writable.
            let again = filled_blocks(&alloc, 25, 4 * MIB, s.id(), 0xA0A0_0000);
            let bad = blocks_mismatches(&again, 1, 4 * MIB, s.id(), 0xA0A0_0000);
            assert_eq!(
                bad, 0,
                "blocks over pages mapped again hold what was written"
            );
            for p in again {
                alloc.free(p).unwrap();
            }
        }
        for p in blocks.iter().step_by(2) {
            alloc.free(*p).unwrap();
        }
        alloc.empty_cache().unwrap();
        assert_eq!(alloc.usage().reserved, 0);
        alloc.check_invariants().unwrap();
    }
}

#[test]
fn a_mapped_free_block_serves_when_the_best_fit_cannot_be_mapped_again() {
    let _serial = serial();
    let Some(dev) = gpu_device() else { return };
    dev.bind_thread().unwrap();
    let s = Stream::new(&dev).unwrap();
    let dev = cachealloc::cuda::CudaDevice::new(0).unwrap();
    let alloc = CachingAllocator::new(dev, capped(62 * MIB, 1.0));
    // A plain 20 MiB segment with an 18 MiB free tail, and a 30 MiB segment
    // made paged by a 20 MiB request; a 22 MiB tensor brings reserved memory
    // to the cap once the paged segment's free 10 MiB went back.
    let p = alloc.malloc(2 * MIB, s.id()).unwrap();
    let x = alloc.malloc(30 * MIB, s.id()).unwrap();
    alloc.free(x).unwrap();
    let z = alloc.malloc(20 * MIB, s.id()).unwrap();
    assert_eq!(alloc.stats().num_segments_paged, 1);
    fill(z, 20 * MIB, s.id(), 0x2020_2020);
    let big = alloc.malloc(22 * MIB, s.id()).unwrap();
    assert_eq!(alloc.usage().reserved, 62 * MIB);
    // 8 MiB: the best fit is the paged segment's free 10 MiB, whose pages
    // the cap leaves no room to map; the plain segment's tail serves.
    let w = alloc
        .malloc(8 * MIB, s.id())
        .expect("the mapped tail serves");
    assert_eq!(w.0, p.0 + 2 * MIB, "carved from the plain segment's tail");
    fill(w, 8 * MIB, s.id(), 0x0808_0808);
    fill(big, 22 * MIB, s.id(), 0x2222_2222);
    let bad = mismatches(z, 20 * MIB, s.id(), 0x2020_2020)
        + mismatches(w, 8 * MIB, s.id(), 0x0808_0808)
        + mismatches(big, 22 * MIB, s.id(), 0x2222_2222);
    assert_eq!(bad, 0, "every block holds what was written to it");
    assert_eq!(alloc.stats().num_ooms, 0);
    for q in [p, z, big, w] {
        alloc.free(q).unwrap();
    }
    alloc.empty_cache().unwrap();
    assert_eq!(alloc.usage().reserved, 0);
    alloc.check_invariants().unwrap();
}

#[test]
fn an_address_hint_in_use_reserves_elsewhere() {
    use cachealloc::core::Device;
    let _serial = serial();
    let Some(dev) = gpu_device() else { return };
    dev.bind_thread().unwrap();
    // The hint names a live plain allocation: the range comes from elsewhere
    // (the driver's own choice, or a second call without the hint).
    let live = dev.allocate(32 * MIB).unwrap();
    let r = dev.vmm_reserve_at(32 * MIB, live).unwrap();
    assert!(r.0 + 32 * MIB <= live.0 || r.0 >= live.0 + 32 * MIB);
    dev.vmm_free_range(r, 32 * MIB).unwrap();
    // Freed, the same range is taken as asked.
    dev.free(live, 32 * MIB).unwrap();
    let again = dev.vmm_reserve_at(32 * MIB, live).unwrap();
    println!(
        "hint {:#x}: in use -> {:#x}; free -> {:#x}",
        live.0, r.0, again.0
    );
    assert_eq!(again, live);
    dev.vmm_free_range(again, 32 * MIB).unwrap();
}
