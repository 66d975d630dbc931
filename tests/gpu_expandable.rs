//! GPU tests of expandable segments (CUDA virtual memory API) that have no
//! plain-segment counterpart:
//! - idle pages move: under a memory cap, memory freed in holes between live
//!   blocks is unmapped and mapped again where a new block needs it, so a
//!   request that plain segments cannot serve under the cap succeeds, with
//!   data written before and after intact and no new physical pages beyond
//!   the cap;
//! - a long shifting-size sequence under a tight cap: pages recycled round
//!   after round, every live block's contents checked after each round;
//! - a big page partly under a live block gives its free part back before an
//!   allocation fails (`expandable_reback`): the live granule is copied to a
//!   new page mapped at the same address, and the block keeps its contents;
//! - granules whose live bytes lie at disjoint offsets share one page before
//!   an allocation fails (`expandable_share`): one page mapped at two
//!   addresses, every block keeps its contents, a block written in the
//!   freed room corrupts neither, and a member whose block goes leaves;
//! - CUDA IPC (`cuIpcGetMemHandle`) works on plain segments and is refused on
//!   expandable ones (the documented caveat).
//!
//! The pattern, cross-stream, threads and `empty_cache` tests run in
//! expandable mode in their own files. Skips (with a printed reason) when
//! there is no CUDA driver or device, or the device has no VMM API.

use cachealloc::core::{AllocError, CachingAllocator, Config, DevicePtr, MemoryCap, StreamId};
use cachealloc::cuda::driver::{self, Stream};
use cachealloc::cuda::CudaDevice;

mod common;
use common::{
    blocks_mismatches, fill, filled_blocks, mismatches, serial, vmm_device as gpu_device,
    XorShift64, MIB,
};

/// `config` under a cap, with 2 MiB pages in every pool (the arithmetic of
/// these tests counts 2 MiB pages; the preset's large-pool pages are 8 MiB).
fn capped(config: Config, cap: u64) -> Config {
    config
        .into_builder()
        .memory_cap(Some(MemoryCap::Bytes(cap)))
        .expandable_page(2 * MIB)
        .build()
        .unwrap()
}

#[test]
fn idle_pages_move_under_a_cap() {
    let _serial = serial();
    let Some(dev) = gpu_device() else { return };
    println!("device: {}", dev.name());
    dev.bind_thread().unwrap();
    let s = Stream::new(&dev).unwrap();
    let g = dev.vmm_support().unwrap();
    let cap = 256 * MIB;
    let alloc = CachingAllocator::new(dev, capped(Config::expandable(), cap));
    assert!(alloc.is_expandable(), "{:?}", alloc.notices());

    // 50 blocks of 4 MiB (200 MiB mapped), every other one freed: 100 MiB of
    // idle pages in 4 MiB holes between live blocks.
    let blocks = filled_blocks(&alloc, 50, 4 * MIB, s.id(), 0xC0DE_0000);
    for p in blocks.iter().skip(1).step_by(2) {
        alloc.free(*p).unwrap();
    }
    let before = alloc.stats();
    // 128 MiB more would be 328 MiB > cap: the holes' pages must move.
    let big = alloc
        .malloc(128 * MIB, s.id())
        .expect("served by moving idle pages");
    fill(big, 128 * MIB, s.id(), 0xB16B_16B1);
    let after = alloc.stats();
    let reserved = alloc.usage().reserved;
    let bad = mismatches(big, 128 * MIB, s.id(), 0xB16B_16B1)
        + blocks_mismatches(&blocks, 2, 4 * MIB, s.id(), 0xC0DE_0000);
    println!(
        "cap {} MiB: 128 MiB served with {} maps, {} pages unmapped from holes and {} reused early \
         (re-mapped at once, old mapping dropped later), {} pages created ({} before), \
         {} device syncs; reserved {} MiB; {bad} bad words",
        cap / MIB,
        after.num_map - before.num_map,
        after.num_unmap - before.num_unmap,
        after.num_pages_reused_early - before.num_pages_reused_early,
        after.num_page_create,
        before.num_page_create,
        after.num_sync_all_streams,
        reserved / MIB,
    );
    assert_eq!(bad, 0, "live data changed when pages moved");
    assert!(
        after.num_map - before.num_map > after.num_page_create - before.num_page_create,
        "idle pages moved: more pages mapped than created"
    );
    assert!(
        after.num_page_create <= cap / g,
        "no physical page beyond the cap"
    );
    assert_eq!(after.num_page_release, 0, "pages reused, not re-created");
    assert!(reserved <= cap);
    alloc.free(big).unwrap();
    for p in blocks.iter().step_by(2) {
        alloc.free(*p).unwrap();
    }
    alloc.empty_cache().unwrap();
    assert_eq!(alloc.usage().reserved, 0);
    alloc.check_invariants().unwrap();
    let dev = CudaDevice::new(0).unwrap();

    // The same sequence on PyTorch's plain segments: every 20 MiB segment
    // keeps live blocks, nothing can be released, and the cap is hit.
    // (`default` sizes medium segments to the workload: there 4 MiB blocks
    // get segments of their own, which go back when freed.)
    let plain = CachingAllocator::new(dev, capped(Config::pytorch(), cap));
    let blocks: Vec<DevicePtr> = (0..50)
        .map(|_| plain.malloc(4 * MIB, s.id()).unwrap())
        .collect();
    for p in blocks.iter().skip(1).step_by(2) {
        plain.free(*p).unwrap();
    }
    let r = plain.malloc(128 * MIB, s.id());
    println!(
        "plain segments, same sequence: {}",
        match &r {
            Ok(_) => "served".to_string(),
            Err(e) => format!("{}", e).lines().next().unwrap_or("").to_string(),
        }
    );
    assert!(matches!(r, Err(AllocError::OutOfMemory(_))));
    for p in blocks.iter().step_by(2) {
        plain.free(*p).unwrap();
    }
    plain.empty_cache().unwrap();
}

#[test]
fn shifting_sizes_under_a_tight_cap() {
    shifting_sizes_under_a_tight_cap_with(false);
}

/// The same with shadows: pages that moved away go back to their old
/// addresses with no driver call, and the data stays intact.
#[test]
fn shifting_sizes_under_a_tight_cap_shadows() {
    shifting_sizes_under_a_tight_cap_with(true);
}

fn shifting_sizes_under_a_tight_cap_with(shadows: bool) {
    let _serial = serial();
    let Some(dev) = gpu_device() else { return };
    dev.bind_thread().unwrap();
    let s = Stream::new(&dev).unwrap();
    let g = dev.vmm_support().unwrap();
    // Rounds of: free about half the live blocks at random, then allocate
    // blocks of this round's size (not page multiples) until 96 MiB are live.
    // Plain segments under this cap fail within the first rounds (the
    // replay of the same sequence on the simulated device: round 1); here
    // idle pages are recycled round after round.
    let cap = 128 * MIB;
    let config = Config::expandable()
        .into_builder()
        .set("expandable_shadows", &shadows.to_string())
        .build()
        .unwrap();
    let alloc = CachingAllocator::new(dev, capped(config, cap));
    assert!(alloc.is_expandable(), "{:?}", alloc.notices());
    let mut live: Vec<(DevicePtr, u64, u32)> = Vec::new();
    let mut rng = XorShift64::new(0x1234_5678);
    let mut next = move || rng.next();
    let (mut pattern, mut bad, mut max_reserved) = (1u32, 0usize, 0u64);
    const ROUNDS: usize = 30;
    for r in 0..ROUNDS {
        let size = [3, 5, 7, 11, 13][r % 5] * MIB + 4096;
        let mut i = 0;
        while i < live.len() {
            if next() % 2 == 0 {
                alloc.free(live.swap_remove(i).0).unwrap();
            } else {
                i += 1;
            }
        }
        while live.iter().map(|l| l.1).sum::<u64>() < 96 * MIB {
            let p = alloc
                .malloc(size, s.id())
                .unwrap_or_else(|e| panic!("round {r}: {e}"));
            pattern = pattern.wrapping_mul(2_654_435_761).wrapping_add(7) | 1;
            fill(p, size, s.id(), pattern);
            live.push((p, size, pattern));
            max_reserved = max_reserved.max(alloc.usage().reserved);
        }
        for &(p, size, v) in &live {
            bad += mismatches(p, size, s.id(), v);
        }
    }
    let st = alloc.stats();
    println!(
        "shadows {shadows}: {ROUNDS} rounds under a {} MiB cap: max reserved {} MiB, \
         {} pages created, {} released, {} maps, {} unmaps, {} taken back with no call, \
         {} device syncs; {bad} bad words",
        cap / MIB,
        max_reserved / MIB,
        st.num_page_create,
        st.num_page_release,
        st.num_map,
        st.num_unmap,
        st.num_pages_revived,
        st.num_sync_all_streams,
    );
    assert_eq!(bad, 0, "live data changed when pages moved");
    assert!(max_reserved <= cap);
    if shadows {
        assert!(st.num_pages_revived > 0, "pages went back to their shadows");
    } else {
        assert!(st.num_unmap > 0, "idle pages were recycled");
    }
    assert!(
        st.num_page_create <= cap / g,
        "pages are moved, not created and released"
    );
    for (p, _, _) in live {
        alloc.free(p).unwrap();
    }
    alloc.empty_cache().unwrap();
    assert_eq!(alloc.usage().reserved, 0);
    alloc.check_invariants().unwrap();
}

#[test]
fn ipc_handles_work_on_plain_segments_only() {
    let _serial = serial();
    let Some(dev) = gpu_device() else { return };
    dev.bind_thread().unwrap();
    let plain = CachingAllocator::new(CudaDevice::new(0).unwrap(), Config::segments());
    let vmm = CachingAllocator::new(dev, Config::expandable());
    let p = plain.malloc(4 * MIB, StreamId(0)).unwrap();
    let v = vmm.malloc(4 * MIB, StreamId(0)).unwrap();
    let on_plain = driver::ipc_mem_handle(p);
    let on_vmm = driver::ipc_mem_handle(v);
    println!(
        "cuIpcGetMemHandle: plain segment {}, expandable segment {}",
        on_plain
            .as_ref()
            .map_or_else(|e| e.to_string(), |_| "ok".into()),
        on_vmm
            .as_ref()
            .map_or_else(|e| e.to_string(), |_| "ok".into()),
    );
    assert!(on_plain.is_ok());
    assert!(on_vmm.is_err(), "the documented caveat no longer holds");
    plain.free(p).unwrap();
    vmm.free(v).unwrap();
    plain.empty_cache().unwrap();
    vmm.empty_cache().unwrap();
}

#[test]
fn a_pinned_big_page_gives_its_free_part_back_and_the_block_keeps_its_data() {
    let _serial = serial();
    let Some(dev) = gpu_device() else { return };
    dev.bind_thread().unwrap();
    let s = Stream::new(&dev).unwrap();
    for reback in [false, true] {
        let config = Config::parse(&format!(
            "expandable,expandable_page_divisor:0,expandable_reback:{reback}"
        ))
        .unwrap();
        let config = config
            .into_builder()
            .memory_cap(Some(MemoryCap::Bytes(64 * MIB)))
            .build()
            .unwrap();
        let alloc = CachingAllocator::new(CudaDevice::new(0).unwrap(), config);
        // A 6 MiB and a 2 MiB block under one 8 MiB page; the 6 MiB one freed.
        let x = alloc.malloc(6 * MIB, s.id()).unwrap();
        let pin = alloc.malloc(2 * MIB, s.id()).unwrap();
        assert_eq!(pin.0, x.0 + 6 * MIB);
        fill(pin, 2 * MIB, s.id(), 0x5EED_0002);
        alloc.free(x).unwrap();
        let big = alloc.malloc(54 * MIB, s.id()).unwrap();
        fill(big, 54 * MIB, s.id(), 0x5EED_0054);
        // 6.5 MiB with 2 MiB left under the cap.
        let q = alloc.malloc(6 * MIB + MIB / 2, s.id());
        if !reback {
            assert!(matches!(q, Err(AllocError::OutOfMemory(_))), "{q:?}");
            for p in [pin, big] {
                alloc.free(p).unwrap();
            }
            continue;
        }
        let q = q.expect("served once the pinned page gave its free part back");
        fill(q, 6 * MIB + MIB / 2, s.id(), 0x5EED_0065);
        let st = alloc.stats();
        println!(
            "pinned page swapped: {} page(s), reserved {} MiB of a 64 MiB cap",
            st.num_pages_rebacked,
            alloc.usage().reserved / MIB
        );
        assert_eq!(st.num_pages_rebacked, 1);
        let bad = mismatches(pin, 2 * MIB, s.id(), 0x5EED_0002)
            + mismatches(big, 54 * MIB, s.id(), 0x5EED_0054)
            + mismatches(q, 6 * MIB + MIB / 2, s.id(), 0x5EED_0065);
        assert_eq!(bad, 0, "the pinned block kept its data at its address");
        assert!(alloc.stats().reserved_bytes.all().peak <= 64 * MIB);
        for p in [pin, big, q] {
            alloc.free(p).unwrap();
        }
        alloc.empty_cache().unwrap();
        assert_eq!(alloc.usage().reserved, 0);
        alloc.check_invariants().unwrap();
    }
}

#[test]
fn granules_whose_live_bytes_do_not_meet_share_a_page_and_keep_their_data() {
    let _serial = serial();
    let Some(dev) = gpu_device() else { return };
    dev.bind_thread().unwrap();
    let s = Stream::new(&dev).unwrap();
    let half = MIB / 2;
    for share in [false, true] {
        let config = Config::parse(&format!(
            "expandable,expandable_page_divisor:0,expandable_share:{share}"
        ))
        .unwrap();
        let alloc = CachingAllocator::new(CudaDevice::new(0).unwrap(), capped(config, 10 * MIB));
        // Four 2.5 MiB blocks tile 10 MiB; B and D go. Granule 1 keeps A's
        // last 0.5 MiB (offsets 0..0.5 MiB), granule 2 C's first 1 MiB
        // (1..2 MiB): one page can hold both.
        let blocks: Vec<DevicePtr> = (0..4)
            .map(|_| alloc.malloc(5 * half, s.id()).unwrap())
            .collect();
        let (x, c) = (blocks[0], blocks[2]);
        fill(x, 5 * half, s.id(), 0x5EED_000A);
        fill(c, 5 * half, s.id(), 0x5EED_000C);
        alloc.free(blocks[1]).unwrap();
        alloc.free(blocks[3]).unwrap();
        // 4 MiB at the range's end needs one more page; the cap is reached.
        let e = alloc.malloc(4 * MIB, s.id());
        if !share {
            assert!(matches!(e, Err(AllocError::OutOfMemory(_))), "{e:?}");
            for p in [x, c] {
                alloc.free(p).unwrap();
            }
            alloc.empty_cache().unwrap();
            continue;
        }
        let e = e.expect("served once two granules share a page");
        fill(e, 4 * MIB, s.id(), 0x5EED_000E);
        let st = alloc.stats();
        println!(
            "shared: {} page(s) went back, {} mapped at two addresses, reserved {} MiB of a 10 MiB cap",
            st.num_pages_shared,
            alloc.shared_mappings().len(),
            alloc.usage().reserved / MIB
        );
        assert_eq!(st.num_pages_shared, 1);
        assert_eq!(alloc.shared_mappings().len(), 1);
        let bad = mismatches(x, 5 * half, s.id(), 0x5EED_000A)
            + mismatches(c, 5 * half, s.id(), 0x5EED_000C)
            + mismatches(e, 4 * MIB, s.id(), 0x5EED_000E);
        assert_eq!(bad, 0, "every block kept its data through the shared page");
        alloc.check_invariants().unwrap();
        // A goes: its granule leaves the page at empty_cache; C keeps it, and
        // a block carved beside C is written without touching C.
        alloc.free(x).unwrap();
        alloc.empty_cache().unwrap();
        assert!(alloc.shared_mappings().is_empty());
        let beside = alloc.malloc(MIB + half, s.id()).unwrap();
        fill(beside, MIB + half, s.id(), 0x5EED_000B);
        let bad = mismatches(c, 5 * half, s.id(), 0x5EED_000C)
            + mismatches(e, 4 * MIB, s.id(), 0x5EED_000E)
            + mismatches(beside, MIB + half, s.id(), 0x5EED_000B);
        assert_eq!(bad, 0, "the page's last member kept its data");
        assert!(alloc.stats().reserved_bytes.all().peak <= 10 * MIB);
        for p in [c, e, beside] {
            alloc.free(p).unwrap();
        }
        alloc.empty_cache().unwrap();
        assert_eq!(alloc.usage().reserved, 0);
        alloc.check_invariants().unwrap();
    }
}

/// `default` is expandable segments on a device with the virtual memory API
/// (probed with a trial map when the allocator starts), with no notice.
#[test]
fn default_maps_pages_on_a_device_with_the_virtual_memory_api() {
    let _serial = serial();
    let Some(dev) = gpu_device() else { return };
    dev.bind_thread().unwrap();
    let a = CachingAllocator::new(dev, Config::default());
    assert!(a.is_expandable(), "{:?}", a.notices());
    assert!(a.notices().is_empty(), "{:?}", a.notices());
    let p = a.malloc(30 * MIB, StreamId(0)).unwrap();
    let st = a.stats();
    assert!(st.num_map > 0 && st.num_device_alloc == 0, "{st:?}");
    a.free(p).unwrap();
    a.empty_cache().unwrap();
}
