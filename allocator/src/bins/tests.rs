//! Tests of the size-class bins.

use super::*;
use proptest::prelude::*;

/// An entry as the bins list it.
fn entry(size: u64, addr: u64, id: BlockId) -> Entry {
    Entry { size, addr, id }
}

#[test]
fn iter_from_lists_the_fits_in_best_fit_order() {
    let mut b = Bins::default();
    let sizes = [512u64, 4096, 1 << 20, 3 << 20, 3 << 20, 64 << 20];
    for (i, &size) in sizes.iter().enumerate() {
        b.insert(
            size,
            0x1000_0000 - (i as u64) * 0x10_0000,
            BlockId(i as u32),
        );
    }
    for want in [1u64, 4096, 4097, 3 << 20, (3 << 20) + 512, 65 << 20] {
        let got: Vec<Entry> = b.iter_from(want).collect();
        let all: Vec<Entry> = b.iter().filter(|e| e.size >= want).collect();
        assert_eq!(got, all, "from {want}");
        assert_eq!(got.first().copied(), b.best_fit(want));
    }
}

#[test]
fn contains_finds_exactly_the_filed_entries() {
    let mut b = Bins::default();
    // One class with many entries (a tree) and one with a single entry.
    for i in 0..200u32 {
        b.insert(4096, 0x10_0000 + u64::from(i) * 4096, BlockId(i));
    }
    b.insert(1 << 30, 0x4000_0000, BlockId(999));
    assert!(b.contains(4096, 0x10_0000, BlockId(0)));
    assert!(b.contains(4096, 0x10_0000 + 150 * 4096, BlockId(150)));
    assert!(b.contains(1 << 30, 0x4000_0000, BlockId(999)));
    assert!(!b.contains(4096, 0x10_0000, BlockId(1)), "another id");
    assert!(!b.contains(8192, 0x10_0000, BlockId(0)), "another size");
    assert!(b.remove(4096, 0x10_0000 + 150 * 4096, BlockId(150)));
    assert!(!b.contains(4096, 0x10_0000 + 150 * 4096, BlockId(150)));
    assert!(b.remove(1 << 30, 0x4000_0000, BlockId(999)));
    assert!(!b.contains(1 << 30, 0x4000_0000, BlockId(999)));
}

#[test]
fn classes_are_monotonic() {
    let mut last = (0, 0);
    for units in 1..100_000u64 {
        let c = class_of(units * 512);
        assert!(c >= last, "class of {units} granules went down");
        last = c;
    }
}

#[test]
fn best_fit_prefers_smallest_then_lowest_address() {
    let mut b = Bins::default();
    b.insert(4096, 300, BlockId(1));
    b.insert(2048, 200, BlockId(2));
    b.insert(2048, 100, BlockId(3));
    b.insert(1 << 30, 50, BlockId(4));
    assert_eq!(b.best_fit(1536), Some(entry(2048, 100, BlockId(3))));
    assert_eq!(b.best_fit(2560), Some(entry(4096, 300, BlockId(1))));
    assert_eq!(b.best_fit(8192), Some(entry(1 << 30, 50, BlockId(4))));
    assert_eq!(b.best_fit((1 << 30) + 512), None);
    assert_eq!(b.largest(), Some(entry(1 << 30, 50, BlockId(4))));
    assert!(b.remove(2048, 100, BlockId(3)));
    assert!(!b.remove(2048, 100, BlockId(3)));
    assert_eq!(b.best_fit(512), Some(entry(2048, 200, BlockId(2))));
    assert_eq!(b.len(), 3);
    assert_eq!(b.bytes(), 4096 + 2048 + (1 << 30));
}

#[test]
fn a_crowded_class_spills_to_a_tree_and_back() {
    let mut b = Bins::default();
    let n = 3 * SPILL as u32;
    for i in (0..n).rev() {
        b.insert(4096, u64::from(i) * 8192, BlockId(i));
    }
    assert_eq!(b.len(), n as usize);
    assert_eq!(b.best_fit(4096), Some(entry(4096, 0, BlockId(0))));
    for i in 0..n - 10 {
        assert!(b.remove(4096, u64::from(i) * 8192, BlockId(i)));
        assert_eq!(b.best_fit(4096).map(|e| e.id), Some(BlockId(i + 1)));
    }
    assert!(!b.remove(4096, 0, BlockId(0)));
    assert_eq!(b.iter().count(), 10);
    assert_eq!(
        b.largest(),
        Some(entry(4096, u64::from(n - 1) * 8192, BlockId(n - 1)))
    );
}

/// A pool holding a few blocks keeps a class record per class that holds
/// one, never a table (a table of every class was 3,072 records, 96 KiB).
#[test]
fn a_pool_of_few_blocks_holds_a_record_per_class() {
    let mut b = Bins::default();
    assert_eq!(b.class_records(), 0, "empty bins hold no class record");
    for (i, size) in [4096u64, 1 << 20, 3 << 20].into_iter().enumerate() {
        b.insert(size, 0x1000_0000 * (i as u64 + 1), BlockId(i as u32));
    }
    // Two more in classes already held.
    b.insert(4096, 0x7000_0000, BlockId(7));
    b.insert(1 << 20, 0x8000_0000, BlockId(8));
    assert!(b.is_compact());
    assert!(b.class_records() <= 4, "{} records", b.class_records());
    assert!(b.host_bytes() <= 256, "{} bytes", b.host_bytes());
    // A class that empties holds no block (its record stays for the next).
    assert!(b.remove(3 << 20, 0x3000_0000, BlockId(2)));
    assert_eq!(b.largest(), Some(entry(1 << 20, 0x8000_0000, BlockId(8))));
    assert_eq!(b.best_fit(2 << 20), None);
    assert_eq!(b.iter_from(4097).count(), 2);
}

/// With every slot taken, a new class takes the slot of an emptied one
/// (the records move over by one) and the bins stay compact; with every
/// slot's class holding blocks, they become the table.
#[test]
fn a_new_class_takes_an_emptied_slot() {
    let mut b = Bins::default();
    // Eight classes: 64, 66, ..., 78 granules.
    let size = |k: u64| (64 + 2 * k) * 512;
    for k in 0..FEW as u64 {
        b.insert(size(k), k << 24, BlockId(k as u32));
    }
    assert!(b.remove(size(2), 2 << 24, BlockId(2)));
    assert!(b.remove(size(6), 6 << 24, BlockId(6)));
    // Between the emptied ones, below both, above both.
    for (k, units) in [(10u64, 73u64), (11, 63), (12, 99)] {
        if k == 12 {
            assert!(b.remove(size(7), 7 << 24, BlockId(7)));
        }
        b.insert(units * 512, k << 24, BlockId(k as u32));
        assert!(b.is_compact(), "{units} granules");
    }
    let sizes: Vec<u64> = b.iter().map(|e| e.size / 512).collect();
    assert_eq!(sizes, [63, 64, 66, 70, 72, 73, 74, 99]);
    assert_eq!(b.best_fit(67 * 512).map(|e| e.size / 512), Some(70));
    assert_eq!(b.best_fit(74 * 512).map(|e| e.size / 512), Some(74));
    assert_eq!(b.largest().map(|e| e.size / 512), Some(99));
    assert_eq!(b.iter_from(73 * 512).count(), 3);
    assert_eq!(b.class_records(), FEW);
    // Every slot's class holds a block: a ninth class makes the table.
    b.insert(200 * 512, 13 << 24, BlockId(13));
    assert!(!b.is_compact());
    let sizes: Vec<u64> = b.iter().map(|e| e.size / 512).collect();
    assert_eq!(sizes, [63, 64, 66, 70, 72, 73, 74, 99, 200]);
}

/// Past `FEW` classes the bins become the table, with a row for each
/// power of two that holds blocks only, not one for every class.
#[test]
fn the_table_holds_rows_only_where_blocks_are() {
    let mut b = Bins::default();
    let mut n = 0u32;
    // Classes of 64 to 127 granules share one row; 512 granules another.
    for units in (64..64 + FEW as u64).chain([512]) {
        b.insert(units * 512, u64::from(n) << 24, BlockId(n));
        n += 1;
    }
    assert!(!b.is_compact(), "{n} classes stayed compact");
    assert_eq!(b.class_records(), 2 * SL_COUNT);
    assert!(
        b.host_bytes() < 8 << 10,
        "{} bytes for {n} blocks",
        b.host_bytes()
    );
    // The move kept every block in order.
    let sizes: Vec<u64> = b.iter().map(|e| e.size).collect();
    let mut sorted = sizes.clone();
    sorted.sort_unstable();
    assert_eq!(sizes, sorted);
    assert_eq!(sizes.len(), n as usize);
    assert_eq!(b.best_fit(1), Some(entry(64 * 512, 0, BlockId(0))));
    assert_eq!(b.largest().map(|e| e.size), Some(512 * 512));
}

proptest! {
    /// The bins pick exactly what a linear scan for the best fit picks.
    #[test]
    fn matches_exact_best_fit(
        blocks in proptest::collection::vec((1u64..200_000, 0u64..1_000_000), 0..200),
        queries in proptest::collection::vec(1u64..250_000, 1..50),
    ) {
        let mut b = Bins::default();
        let mut all: Vec<Entry> = Vec::new();
        for (i, (units, addr)) in blocks.into_iter().enumerate() {
            let e = entry(units * 512, addr * 512 + i as u64, BlockId(i as u32));
            b.insert(e.size, e.addr, e.id);
            all.push(e);
        }
        for q in queries {
            let size = q * 512;
            let expected = all.iter().filter(|e| e.size >= size).min().copied();
            prop_assert_eq!(b.best_fit(size), expected);
            // The next fits in order too (the near fits walk them).
            let mut fits: Vec<Entry> = all.iter().filter(|e| e.size >= size).copied().collect();
            fits.sort_unstable();
            prop_assert_eq!(b.iter_from(size).collect::<Vec<_>>(), fits);
        }
        prop_assert_eq!(b.largest(), all.iter().max().copied());
    }

    /// Inserts, removes and takes on crowded classes (a few sizes, so
    /// classes cross the scan and spill thresholds both ways; the last
    /// three share one class, so a class's first entry changes hands
    /// by size as well as by address) agree with an ordered set.
    /// (Checked: a tree that drops its inserts fails this test.)
    #[test]
    fn crowded_classes_match_an_ordered_set(
        ops in proptest::collection::vec((0u8..5, 0u64..7, 0u64..400, 0usize..11), 0..1500),
    ) {
        let mut b = Bins::default();
        let mut model = std::collections::BTreeSet::new();
        for (i, (op, size_pick, addr, q)) in ops.into_iter().enumerate() {
            let size = [512u64, 1024, 1536, 2560, 1024 * 512, 1025 * 512, 1032 * 512][size_pick as usize];
            match op {
                // Inserts are three ops in five, so that classes fill
                // past the spill threshold, not only the scan threshold.
                0..=2 => {
                    let e = entry(size, addr * 4096 + size_pick, BlockId(i as u32));
                    if !model.iter().any(|m: &Entry| m.addr == e.addr) {
                        b.insert(e.size, e.addr, e.id);
                        model.insert(e);
                    }
                }
                3 => {
                    // Remove the entry nearest below a random point, if any.
                    let victim = model.iter().find(|m| m.addr >= addr * 4096).copied();
                    if let Some(v) = victim {
                        prop_assert!(b.remove(v.size, v.addr, v.id));
                        model.remove(&v);
                    }
                    prop_assert!(!b.remove(size, u64::MAX, BlockId(0)));
                }
                _ => {
                    let want = [1u64, 2, 3, 4, 5, 1024, 1025, 1026, 1030, 1032, 1033][q] * 512;
                    let expected = model.iter().filter(|e| e.size >= want).min().copied();
                    let found = b.find(want);
                    prop_assert_eq!(found.map(|f| f.entry), expected);
                    if let Some(f) = found {
                        b.take(f);
                        model.remove(&f.entry);
                    }
                }
            }
            prop_assert_eq!(b.len(), model.len());
            prop_assert_eq!(b.bytes(), model.iter().map(|e| e.size).sum::<u64>());
        }
        let listed: Vec<Entry> = b.iter().collect();
        let expected: Vec<Entry> = model.iter().copied().collect();
        prop_assert_eq!(listed, expected);
    }

    /// Both forms (Note [Bins sized by use]) answer every find, take,
    /// removal and walk as an ordered set does, on sizes spread over
    /// about `FEW` classes, so that bins cross from the compact form to
    /// the table mid-sequence; the bins that start as a table must agree.
    /// (Checked: a compact form whose `find` skips to the next slot
    /// without trying its own class fails this test.)
    #[test]
    fn both_forms_agree_with_an_ordered_set(
        ops in proptest::collection::vec((0u8..5, 0u64..24, 0u64..200, 0u64..26), 0..600),
    ) {
        let mut few = Bins::default();
        let mut table = Bins::table();
        let mut model = std::collections::BTreeSet::new();
        // 24 sizes in 24 classes over four rows: the compact form
        // fills past `FEW` classes partway through most sequences.
        let size = |k: u64| (64 + (k / 2) * 7) * 512 * (1 + (k % 2) * 8);
        for (i, (op, k, addr, q)) in ops.into_iter().enumerate() {
            match op {
                0..=2 => {
                    let e = entry(size(k), addr * (1 << 24) + k, BlockId(i as u32));
                    if !model.iter().any(|m: &Entry| m.addr == e.addr) {
                        few.insert(e.size, e.addr, e.id);
                        table.insert(e.size, e.addr, e.id);
                        model.insert(e);
                    }
                }
                3 => {
                    let victim = model.iter().find(|m| m.addr >= addr * (1 << 24)).copied();
                    if let Some(v) = victim {
                        prop_assert!(few.remove(v.size, v.addr, v.id));
                        prop_assert!(table.remove(v.size, v.addr, v.id));
                        model.remove(&v);
                    }
                    prop_assert!(!few.remove(size(k), 1, BlockId(0)));
                    prop_assert!(!table.remove(size(k), 1, BlockId(0)));
                }
                _ => {
                    let want = size(q.min(23)) + (q / 24) * 512;
                    let expected = model.iter().filter(|e| e.size >= want).min().copied();
                    let fits: Vec<Entry> = model.iter().filter(|e| e.size >= want).copied().collect();
                    prop_assert_eq!(few.iter_from(want).collect::<Vec<_>>(), fits.clone());
                    prop_assert_eq!(table.iter_from(want).collect::<Vec<_>>(), fits.clone());
                    let hi = want * (1 + q % 5);
                    let within: Vec<Entry> = fits.into_iter().filter(|e| e.size <= hi).collect();
                    prop_assert_eq!(few.iter_between(want, hi).collect::<Vec<_>>(), within.clone());
                    prop_assert_eq!(table.iter_between(want, hi).collect::<Vec<_>>(), within);
                    let (f, t) = (few.find(want), table.find(want));
                    prop_assert_eq!(f.map(|f| f.entry), expected);
                    prop_assert_eq!(t.map(|t| t.entry), expected);
                    if let (Some(f), Some(t)) = (f, t) {
                        few.take(f);
                        table.take(t);
                        model.remove(&f.entry);
                    }
                }
            }
            for b in [&few, &table] {
                prop_assert_eq!(b.len(), model.len());
                prop_assert_eq!(b.bytes(), model.iter().map(|e| e.size).sum::<u64>());
                prop_assert_eq!(b.largest(), model.iter().max().copied());
                let listed: Vec<Entry> = b.iter().collect();
                prop_assert_eq!(listed, model.iter().copied().collect::<Vec<_>>());
            }
            for e in &model {
                prop_assert!(few.contains(e.size, e.addr, e.id));
                prop_assert!(table.contains(e.size, e.addr, e.id));
            }
        }
    }
}
