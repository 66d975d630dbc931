//! CUDA IPC of expandable segments on a real GPU, within one process: a
//! block is shared as the file descriptors of its pages
//! (`capi_torch::ipc::share`), the handle read back, the descriptors taken
//! again through `pidfd_getfd` of this very process, the pages imported and
//! mapped at a second address (`cuda::ipc::map_imported`): both addresses
//! see each other's writes, for blocks over pages of one size (PyTorch's
//! `e` handle) and of several (cachealloc's own `C`). The two-process test
//! is `python/test_gpu_ipc.py`. Skips without a GPU, without the virtual
//! memory API, or where pages are not shareable (the reason printed).

mod common;

use cachealloc::capi_torch::ipc::{parse, share, Shared};
use cachealloc::core::{CachingAllocator, Config, StreamId};
use cachealloc::cuda::driver;
use cachealloc::cuda::ipc::{map_imported, unmap_imported};
use common::{fill, mismatches, serial, vmm_device, MIB};

const S: StreamId = StreamId(0);

#[test]
fn a_shared_block_is_seen_at_both_addresses() {
    let _g = serial();
    let Some(dev) = vmm_device() else { return };
    dev.bind_thread().unwrap();
    if let Err(why) = dev.pages_shareable() {
        println!(
            "skipping: pages are not shareable on {} ({why})",
            dev.name()
        );
        return;
    }
    let g = dev.vmm_support().unwrap();
    // Granule pages at the edges, 8 MiB pages between: a 21 MiB block after
    // a 3 MiB one lies over both sizes; a 4 MiB one over granules only.
    let a = CachingAllocator::new(
        dev,
        Config::parse("expandable,expandable_page_divisor:0,expandable_edges:small").unwrap(),
    );
    let pid = std::process::id() as i32;
    let mut kinds = Vec::new();
    let blocks: Vec<_> = [3 * MIB, 21 * MIB, 4 * MIB]
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            let p = a.malloc(n, S).unwrap();
            fill(p, n, S, 0x1000 + i as u32);
            (p, n)
        })
        .collect();
    driver::stream_synchronize(S).unwrap();
    for (i, &(p, n)) in blocks.iter().enumerate() {
        let (handle, offset) = share(
            &a,
            p.0,
            pid,
            |_| Err("no plain segment here".into()),
            |page| a.device().export_page_fd(page),
        )
        .unwrap();
        kinds.push(handle[0] as char);
        let Shared::Pages { pid: got, pages } = parse(&handle).unwrap() else {
            panic!("pages expected: {handle:?}")
        };
        assert_eq!(got, pid);
        let range = map_imported(a.device().ordinal(), pid, &pages, g).unwrap();
        let there = cachealloc::core::DevicePtr(range.base.0 + offset);
        assert_eq!(
            mismatches(there, n, S, 0x1000 + i as u32),
            0,
            "block {i} read there"
        );
        fill(there, n, S, 0x2000 + i as u32);
        driver::stream_synchronize(S).unwrap();
        assert_eq!(
            mismatches(p, n, S, 0x2000 + i as u32),
            0,
            "block {i} written there"
        );
        // SAFETY: the stream is synchronized; nothing else uses the range.
        unsafe { unmap_imported(range) }.unwrap();
    }
    assert!(kinds.contains(&'e') && kinds.contains(&'C'), "{kinds:?}");
    assert_eq!(a.pinned_blocks().0, 3);
    assert!(a.device().exported_pages() > 0);
    for (p, _) in blocks {
        a.free(p).unwrap();
    }
    assert_eq!(a.pinned_blocks(), (0, 0));
    a.empty_cache().unwrap();
    assert_eq!(
        a.device().exported_pages(),
        0,
        "released pages close their descriptors"
    );
}
