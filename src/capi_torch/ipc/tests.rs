//! CUDA IPC on the simulated device: the handles' bytes (Note [IPC
//! handles]) as PyTorch 2.11 lays them out, every malformed handle refused
//! by name, what a share gives for each kind of block, and the receiver's
//! count of users per open handle.

use super::*;
use cachealloc_core::{Config, SimulatedDevice, StreamId};
use std::cell::RefCell;

const MIB: u64 = 1 << 20;
const S0: StreamId = StreamId(0);

#[test]
fn a_plain_segments_handle_is_pytorchs() {
    let ipc = [7u8; 64];
    let h = plain_handle(&ipc);
    assert_eq!(h.len(), 65);
    assert_eq!(h[0], b'c');
    assert_eq!(parse(&h).unwrap(), Shared::Plain(ipc));
}

#[test]
fn pages_of_one_size_take_pytorchs_share_header() {
    let h = pages_handle(4242, &[(8 * MIB, 17), (8 * MIB, 18), (8 * MIB, 17)]);
    // 'e', then pid_t, 4 bytes of padding, size_t page size, size_t count,
    // then one int per page: PyTorch's ShareHeader and descriptors.
    assert_eq!(h.len(), 1 + 24 + 3 * 4);
    assert_eq!(h[0], b'e');
    assert_eq!(i32::from_ne_bytes(h[1..5].try_into().unwrap()), 4242);
    assert_eq!(&h[5..9], &[0; 4]);
    assert_eq!(u64::from_ne_bytes(h[9..17].try_into().unwrap()), 8 * MIB);
    assert_eq!(u64::from_ne_bytes(h[17..25].try_into().unwrap()), 3);
    assert_eq!(i32::from_ne_bytes(h[29..33].try_into().unwrap()), 18);
    assert_eq!(
        parse(&h).unwrap(),
        Shared::Pages {
            pid: 4242,
            pages: vec![
                (8 * MIB, Shareable::Fd(17)),
                (8 * MIB, Shareable::Fd(18)),
                (8 * MIB, Shareable::Fd(17))
            ]
        }
    );
}

#[test]
fn pytorchs_pages_with_fabric_handles_are_told_apart_by_length() {
    let mut h = pages_handle(9, &[(20 * MIB, 3), (20 * MIB, 4)]);
    h.truncate(25);
    h.extend_from_slice(&[1u8; 64]);
    h.extend_from_slice(&[2u8; 64]);
    assert_eq!(
        parse(&h).unwrap(),
        Shared::Pages {
            pid: 9,
            pages: vec![
                (20 * MIB, Shareable::Fabric([1; 64])),
                (20 * MIB, Shareable::Fabric([2; 64]))
            ]
        }
    );
}

#[test]
fn pages_of_several_sizes_take_cacheallocs_versioned_handle() {
    let pages = [(2 * MIB, 5), (8 * MIB, 6), (2 * MIB, 7)];
    let h = pages_handle(77, &pages);
    assert_eq!(h.len(), 24 + 16 * 3);
    assert_eq!(&h[..4], b"CCAL");
    assert_eq!(u16::from_le_bytes([h[4], h[5]]), OWN_VERSION);
    assert_eq!(
        parse(&h).unwrap(),
        Shared::Pages {
            pid: 77,
            pages: pages
                .iter()
                .map(|&(b, fd)| (b, Shareable::Fd(fd)))
                .collect()
        }
    );
    // Another version is refused by name.
    let mut v2 = h.clone();
    v2[4] = 2;
    let e = parse(&v2).unwrap_err();
    assert!(e.contains("version 2") && e.contains("version 1"), "{e}");
}

#[test]
fn malformed_handles_are_refused_by_name() {
    let good_e = pages_handle(1, &[(2 * MIB, 3)]);
    let good_c = pages_handle(1, &[(2 * MIB, 3), (8 * MIB, 4)]);
    let mut cases: Vec<(Vec<u8>, &str)> = vec![
        (vec![], "empty"),
        (vec![b'x'; 65], "unknown kind"),
        (vec![b'c'; 64], "65 bytes"),
        (vec![b'c'; 66], "65 bytes"),
        (good_e[..20].to_vec(), "shorter than its header"),
        (good_e[..good_e.len() - 1].to_vec(), "names 1 pages"),
        (good_c[..good_c.len() - 1].to_vec(), "names 2 pages"),
        (good_c[..10].to_vec(), "without cachealloc's header"),
    ];
    let mut zero_pages = good_e.clone();
    zero_pages[17..25].copy_from_slice(&0u64.to_ne_bytes());
    cases.push((zero_pages, "0 pages"));
    let mut zero_size = good_e.clone();
    zero_size[9..17].copy_from_slice(&0u64.to_ne_bytes());
    cases.push((zero_size, "of 0 bytes"));
    let mut huge = good_e.clone();
    huge[17..25].copy_from_slice(&u64::MAX.to_ne_bytes());
    cases.push((huge, "pages"));
    let mut negative = good_e.clone();
    negative[25..29].copy_from_slice(&(-1i32).to_ne_bytes());
    cases.push((negative, "descriptor -1"));
    let mut total = good_c.clone();
    total[16..24].copy_from_slice(&(3 * MIB).to_le_bytes());
    cases.push((total, "header says"));
    let mut kind = good_c.clone();
    kind[6] = 9;
    cases.push((kind, "kind 9"));
    for (h, want) in cases {
        let e = parse(&h).unwrap_err();
        assert!(e.contains(want), "{h:?}: `{e}` lacks `{want}`");
    }
}

/// A page → descriptor exporter that numbers pages as it meets them and
/// counts its calls.
struct FakeFds {
    fds: RefCell<Vec<u64>>,
    calls: RefCell<u32>,
}

impl FakeFds {
    fn new() -> Self {
        FakeFds {
            fds: RefCell::new(Vec::new()),
            calls: RefCell::new(0),
        }
    }
    fn fd(&self, page: u64) -> Result<i32, String> {
        *self.calls.borrow_mut() += 1;
        let mut fds = self.fds.borrow_mut();
        let i = fds.iter().position(|&p| p == page).unwrap_or_else(|| {
            fds.push(page);
            fds.len() - 1
        });
        Ok(100 + i as i32)
    }
}

fn plain_ipc(base: DevicePtr) -> Result<[u8; 64], String> {
    let mut h = [0u8; 64];
    h[..8].copy_from_slice(&base.0.to_le_bytes());
    Ok(h)
}

#[test]
fn a_plain_block_is_shared_as_its_segment_at_its_offset() {
    let dev = SimulatedDevice::new(1 << 30);
    let a = CachingAllocator::new(dev.clone(), Config::segments());
    let x = a.malloc(3 * MIB, S0).unwrap();
    let y = a.malloc(4 * MIB, S0).unwrap();
    let fds = FakeFds::new();
    let (h, off) = share(&a, y.0, 1, plain_ipc, |p| fds.fd(p)).unwrap();
    let Shared::Plain(ipc) = parse(&h).unwrap() else {
        panic!("{h:?}")
    };
    let base = u64::from_le_bytes(ipc[..8].try_into().unwrap());
    assert!(dev.segments().iter().any(|s| s.0 .0 == base));
    assert_eq!(base + off, y.0);
    assert_eq!(*fds.calls.borrow(), 0, "no page exported");
    // Two blocks of one segment: one handle, two offsets.
    let (hx, offx) = share(&a, x.0, 1, plain_ipc, |p| fds.fd(p)).unwrap();
    assert_eq!(hx, h);
    assert_eq!(base + offx, x.0);
    a.free(x).unwrap();
    a.free(y).unwrap();
}

#[test]
fn an_expandable_block_is_shared_as_its_pages() {
    let dev = SimulatedDevice::new(1 << 30);
    let a = CachingAllocator::new(
        dev.clone(),
        Config::parse("expandable,expandable_page_divisor:0,expandable_edges:big").unwrap(),
    );
    let x = a.malloc(12 * MIB, S0).unwrap();
    let y = a.malloc(2 * MIB, S0).unwrap();
    let fds = FakeFds::new();
    let (hx, offx) = share(&a, x.0, 55, plain_ipc, |p| fds.fd(p)).unwrap();
    let Shared::Pages { pid, pages } = parse(&hx).unwrap() else {
        panic!("{hx:?}")
    };
    assert_eq!((pid, offx, hx[0]), (55, 0, b'e'));
    assert_eq!(
        pages,
        vec![(8 * MIB, Shareable::Fd(100)), (8 * MIB, Shareable::Fd(101))]
    );
    // y lies on x's second page: the same descriptor, its own offset.
    let (hy, offy) = share(&a, y.0, 55, plain_ipc, |p| fds.fd(p)).unwrap();
    let Shared::Pages { pages, .. } = parse(&hy).unwrap() else {
        panic!()
    };
    assert_eq!(pages, vec![(8 * MIB, Shareable::Fd(101))]);
    assert_eq!(offy, 4 * MIB);
    assert_eq!(a.pinned_blocks(), (2, 14 * MIB));
    a.free(x).unwrap();
    a.free(y).unwrap();
    assert_eq!(a.pinned_blocks(), (0, 0));
}

#[test]
fn a_block_over_pages_of_two_sizes_is_shared_in_cacheallocs_handle() {
    let dev = SimulatedDevice::new(1 << 30);
    let a = CachingAllocator::new(
        dev.clone(),
        Config::parse("expandable,expandable_page_divisor:0,expandable_edges:small").unwrap(),
    );
    let x = a.malloc(3 * MIB, S0).unwrap();
    let y = a.malloc(21 * MIB, S0).unwrap();
    let fds = FakeFds::new();
    let (h, off) = share(&a, y.0, 3, plain_ipc, |p| fds.fd(p)).unwrap();
    assert_eq!(h[0], b'C');
    let Shared::Pages { pages, .. } = parse(&h).unwrap() else {
        panic!()
    };
    let total: u64 = pages.iter().map(|p| p.0).sum();
    assert!(
        off < pages[0].0 && off + 21 * MIB <= total,
        "{off} {pages:?}"
    );
    a.free(x).unwrap();
    a.free(y).unwrap();
}

#[test]
fn sharing_errors_tell_a_lookup_miss_from_misuse() {
    let dev = SimulatedDevice::new(1 << 30);
    let a = CachingAllocator::new(dev.clone(), Config::default());
    let x = a.malloc(4 * MIB, S0).unwrap();
    let fds = FakeFds::new();
    let miss = share(&a, 0xdead_0000, 1, plain_ipc, |p| fds.fd(p)).unwrap_err();
    assert!(matches!(miss, ShareError::NotMine(_)), "{miss:?}");
    let inside = share(&a, x.0 + 512, 1, plain_ipc, |p| fds.fd(p)).unwrap_err();
    assert!(
        matches!(&inside, ShareError::Failed(m) if m.contains("inside")),
        "{inside:?}"
    );
    // Pages that cannot be exported: an error naming why.
    let refused = share(&a, x.0, 1, plain_ipc, |_| Err("not shareable here".into())).unwrap_err();
    assert!(matches!(&refused, ShareError::Failed(m) if m.contains("not shareable here")));
    a.free(x).unwrap();
    let freed = share(&a, x.0, 1, plain_ipc, |p| fds.fd(p)).unwrap_err();
    assert!(
        matches!(&freed, ShareError::Failed(m) if m.contains("freed")),
        "{freed:?}"
    );
    assert_eq!(a.pinned_blocks(), (0, 0));
    a.check_invariants().unwrap();
}

/// An opener that hands out addresses in turn and logs what it maps and unmaps.
#[derive(Default)]
struct FakeOpener {
    next: RefCell<u64>,
    log: RefCell<Vec<String>>,
    fail: RefCell<bool>,
    same_address: RefCell<bool>,
}

impl Opener for FakeOpener {
    type Mapping = u64;
    fn open(&self, device: i32, shared: &Shared) -> Result<(u64, u64), String> {
        if *self.fail.borrow() {
            return Err("the driver refused".into());
        }
        let mut next = self.next.borrow_mut();
        if !*self.same_address.borrow() {
            *next += 1;
        }
        let addr = 0x7000_0000_0000 + *next * (1 << 30);
        let what = match shared {
            Shared::Plain(_) => "plain".to_string(),
            Shared::Pages { pages, .. } => format!("{} pages", pages.len()),
        };
        self.log
            .borrow_mut()
            .push(format!("open {device} {addr:#x} {what}"));
        Ok((addr, addr))
    }
    fn close(&self, device: i32, mapping: u64) -> Result<(), String> {
        self.log
            .borrow_mut()
            .push(format!("close {device} {mapping:#x}"));
        Ok(())
    }
}

#[test]
fn a_handle_is_mapped_once_and_unmapped_by_its_last_user() {
    let o = FakeOpener::default();
    let mut imports = Imports::default();
    let h = plain_handle(&[1; 64]);
    let p = imports.open(&o, 0, &h).unwrap();
    assert_eq!(imports.open(&o, 0, &h).unwrap(), p, "cached");
    assert_eq!(o.log.borrow().len(), 1, "mapped once");
    assert_eq!(
        imports.stats(Some(0)),
        ImportStats {
            open: 1,
            users: 2,
            opened: 1,
            closed: 0
        }
    );
    imports.close(&o, 0, p).unwrap();
    assert_eq!(o.log.borrow().len(), 1, "a user is left");
    imports.close(&o, 0, p).unwrap();
    assert_eq!(o.log.borrow().last().unwrap(), &format!("close 0 {p:#x}"));
    assert_eq!(imports.stats(None).open, 0);
    // Closing again, or an address nothing is open at, is an error.
    assert!(imports
        .close(&o, 0, p)
        .unwrap_err()
        .contains("no CUDA IPC handle"));
    // Opened again after the last close: a new mapping.
    let q = imports.open(&o, 0, &h).unwrap();
    assert_ne!(q, p);
    assert_eq!(imports.stats(None).opened, 2);
    imports.close(&o, 0, q).unwrap();
}

#[test]
fn handles_are_kept_apart_by_device_and_by_bytes() {
    let o = FakeOpener::default();
    let mut imports = Imports::default();
    let a = plain_handle(&[1; 64]);
    let b = pages_handle(5, &[(2 * MIB, 9)]);
    let pa0 = imports.open(&o, 0, &a).unwrap();
    let pa1 = imports.open(&o, 1, &a).unwrap();
    let pb0 = imports.open(&o, 0, &b).unwrap();
    assert!(pa0 != pa1 && pa0 != pb0);
    assert_eq!(imports.stats(Some(0)).open, 2);
    assert_eq!(imports.stats(Some(1)).open, 1);
    // The address of one device's handle is not closable on another.
    assert!(imports.close(&o, 1, pa0).is_err());
    for (d, p) in [(0, pa0), (1, pa1), (0, pb0)] {
        imports.close(&o, d, p).unwrap();
    }
    assert_eq!(
        imports.stats(None),
        ImportStats {
            open: 0,
            users: 0,
            opened: 3,
            closed: 3
        }
    );
}

#[test]
fn a_handle_that_cannot_be_opened_leaves_nothing_behind() {
    let o = FakeOpener::default();
    let mut imports = Imports::default();
    // Malformed: refused before the driver is asked.
    assert!(imports.open(&o, 0, b"nonsense").is_err());
    assert!(o.log.borrow().is_empty());
    // Refused by the driver: not cached, the next try asks again.
    *o.fail.borrow_mut() = true;
    let h = plain_handle(&[3; 64]);
    assert!(imports.open(&o, 0, &h).unwrap_err().contains("refused"));
    assert_eq!(imports.stats(None), ImportStats::default());
    *o.fail.borrow_mut() = false;
    let p = imports.open(&o, 0, &h).unwrap();
    imports.close(&o, 0, p).unwrap();
    // Two handles mapped at one address: the second is refused and undone,
    // the first keeps its users.
    *o.same_address.borrow_mut() = true;
    let x = imports.open(&o, 0, &plain_handle(&[4; 64])).unwrap();
    let e = imports.open(&o, 0, &plain_handle(&[5; 64])).unwrap_err();
    assert!(e.contains("two CUDA IPC handles"), "{e}");
    assert_eq!(imports.stats(Some(0)).open, 1);
    imports.close(&o, 0, x).unwrap();
    assert_eq!(imports.stats(None).open, 0);
}

#[test]
fn what_a_producer_shares_a_consumer_opens() {
    // Both ends on simulated devices: the consumer's opener sees the pages
    // (and descriptors) the producer's exporter gave.
    let dev = SimulatedDevice::new(1 << 30);
    let a = CachingAllocator::new(dev.clone(), Config::default());
    let blocks: Vec<DevicePtr> = [MIB / 2, 3 * MIB, 9 * MIB]
        .iter()
        .map(|&n| a.malloc(n, S0).unwrap())
        .collect();
    let fds = FakeFds::new();
    let o = FakeOpener::default();
    let mut imports = Imports::default();
    let mut opened = Vec::new();
    for &b in &blocks {
        let (h, off) = share(&a, b.0, 8, plain_ipc, |p| fds.fd(p)).unwrap();
        let base = imports.open(&o, 0, &h).unwrap();
        opened.push(base + off);
    }
    assert_eq!(a.pinned_blocks().0, 3);
    let distinct: std::collections::HashSet<_> = opened.iter().collect();
    assert_eq!(distinct.len(), 3);
    for (i, p) in opened.iter().enumerate() {
        let base = *p - {
            let (_, off) = share(&a, blocks[i].0, 8, plain_ipc, |p| fds.fd(p)).unwrap();
            off
        };
        imports.close(&o, 0, base).unwrap();
    }
    for b in blocks {
        a.free(b).unwrap();
    }
    assert_eq!(a.pinned_blocks(), (0, 0));
    a.check_invariants().unwrap();
}
