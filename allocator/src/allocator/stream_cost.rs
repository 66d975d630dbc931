//! Tests of what a stream costs the allocator on the host: records bounded
//! by what the stream holds. Many streams of a few blocks each must cost
//! records for those blocks, not a table of every size class per pool
//! (3,072 class records, 96 KiB, which made a trace over a million streams
//! abort), nor markers for streams that never freed a block, nor ranges for
//! pools that never took a request. The tests count records, never time.

use super::*;
use crate::block::POOLS_PER_STREAM;
use crate::simulated::SimulatedDevice;

/// The sizes streams ask for, as `scripts/stream-trace.py` cycles through
/// them (small pool, large pool, above `large_threshold`).
const SIZES: [u64; 8] = [
    4096,
    100_000,
    786_432,
    1_500_000,
    3 << 20,
    12 << 20,
    512,
    40_000,
];

/// Streams `1..=streams` each allocate `blocks` blocks, freed once `live`
/// later streams have allocated theirs (the generator's trace).
fn many_streams(a: &CachingAllocator<SimulatedDevice>, streams: u64, blocks: u64, live: usize) {
    let mut held: VecDeque<Vec<DevicePtr>> = VecDeque::new();
    for s in 1..=streams {
        let ptrs = (0..blocks)
            .map(|b| {
                let size = SIZES[((s * 3 + b * 5) % 8) as usize] + 512 * (s % 7);
                a.malloc(size, StreamId(s)).unwrap()
            })
            .collect();
        held.push_back(ptrs);
        if held.len() > live {
            for p in held.pop_front().unwrap() {
                a.free(p).unwrap();
            }
        }
    }
    for p in held.into_iter().flatten() {
        a.free(p).unwrap();
    }
}

/// The per-stream records, summed over the streams.
#[derive(Debug)]
struct Cost {
    streams: usize,
    /// Free blocks in the bins.
    free_blocks: usize,
    /// Class records the bins hold (32 bytes each).
    class_records: usize,
    /// Host bytes of the bins, their inline records included.
    bins_bytes: usize,
    /// Pools whose bins are in the table form.
    tables: usize,
    /// Expandable ranges reserved.
    ranges: usize,
    /// Stream slots with expandable markers.
    marks: usize,
    /// Old mappings of moved pages (expandable).
    old_mappings: usize,
}

fn cost(a: &CachingAllocator<SimulatedDevice>) -> Cost {
    let st = a.state.lock();
    let bins = &st.core.bins;
    let (ranges, marks, old_mappings) = st.vmm.per_stream_records();
    Cost {
        streams: st.core.stream_list.len(),
        free_blocks: bins.iter().map(Bins::len).sum(),
        class_records: bins.iter().map(Bins::class_records).sum(),
        bins_bytes: bins.iter().map(Bins::host_bytes).sum(),
        tables: bins.iter().filter(|b| !b.is_compact()).count(),
        ranges,
        marks,
        old_mappings,
    }
}

fn allocator(config: Config) -> CachingAllocator<SimulatedDevice> {
    CachingAllocator::new(SimulatedDevice::unlimited(), config)
}

/// Under every preset, 3,000 streams of three blocks each cost the bins a
/// class record per class a pool has held blocks in (at most eight a pool),
/// 400 bytes per stream at most in all (three inline records of 64 bytes,
/// the rest class records of 32); no pool's bins become a table. (A table
/// per pool was 3,072 records.)
#[test]
fn streams_of_few_blocks_cost_a_class_record_per_class_held() {
    for name in Config::PRESETS {
        let a = allocator(Config::preset(name).unwrap());
        many_streams(&a, 3000, 3, 4);
        a.check_invariants().unwrap();
        let c = cost(&a);
        assert_eq!(c.streams, 3000, "{name}: {c:?}");
        assert_eq!(c.tables, 0, "{name}: {c:?}");
        assert!(c.class_records <= 8 * c.streams, "{name}: {c:?}");
        assert!(c.bins_bytes <= 400 * c.streams, "{name}: {c:?}");
        if *name == "no-caching" {
            assert_eq!((c.free_blocks, c.class_records), (0, 0), "{c:?}");
        }
    }
}

/// Once `empty_cache` gives every segment back, no pool's bins hold a
/// class record: a pool that holds nothing costs its inline record only.
#[test]
fn pools_emptied_by_empty_cache_hold_no_class_record() {
    for name in ["segments", "pytorch", "default", "expandable"] {
        let a = allocator(Config::preset(name).unwrap());
        many_streams(&a, 500, 3, 4);
        assert!(cost(&a).class_records > 0, "{name}: the bins held blocks");
        a.empty_cache().unwrap();
        let c = cost(&a);
        assert_eq!((c.free_blocks, c.class_records), (0, 0), "{name}: {c:?}");
        assert_eq!(
            c.bins_bytes,
            c.streams * POOLS_PER_STREAM as usize * std::mem::size_of::<Bins>(),
            "{name}: {c:?}"
        );
    }
}

/// A stream named only by `record_stream` gets no slot, no pools, no bins.
#[test]
fn a_stream_that_only_uses_a_block_costs_no_slot() {
    let a = allocator(Config::default());
    let p = a.malloc(1 << 20, StreamId(0)).unwrap();
    for s in 1..=1000 {
        a.record_stream(p, StreamId(s)).unwrap();
    }
    a.free(p).unwrap();
    let c = cost(&a);
    assert_eq!(c.streams, 1, "{c:?}");
    assert_eq!(a.state.lock().core.bins.len(), POOLS_PER_STREAM as usize);
}

/// Expandable segments: a pool gets a range on its first request, a
/// stream markers on its first free. Streams that only allocate have no
/// markers; each stream of one pool has one range, not one per pool.
#[test]
fn expandable_ranges_and_markers_come_with_use() {
    let a = allocator(Config::expandable());
    let live: Vec<DevicePtr> = (1..=2000)
        .map(|s| a.malloc(4096, StreamId(s)).unwrap())
        .collect();
    let c = cost(&a);
    assert_eq!((c.streams, c.ranges, c.marks), (2000, 2000, 0), "{c:?}");
    // The first half free theirs: the markers reach to the last of them.
    for &p in &live[..1000] {
        a.free(p).unwrap();
    }
    let c = cost(&a);
    assert_eq!((c.ranges, c.marks), (2000, 1000), "{c:?}");
    for &p in &live[1000..] {
        a.free(p).unwrap();
    }
    a.check_invariants().unwrap();
}

/// Under `default`, pages move from stream to stream (few pages, thousands
/// of ranges); each keeps at most 32 old mappings (Note [Shadows per page]
/// in `expandable/stale.rs`), where without the limit every range a page
/// left kept one (13,738 here).
#[test]
fn moved_pages_keep_a_bounded_number_of_old_mappings() {
    // Events complete as they are queried, as in a replay: old mappings of
    // pages reused early become unmappable.
    let dev = SimulatedDevice::unlimited().with_auto_complete(true);
    let a = CachingAllocator::new(dev, Config::default());
    many_streams(&a, 3000, 3, 4);
    a.check_invariants().unwrap();
    let c = cost(&a);
    let s = a.stats();
    let pages = (s.num_page_create - s.num_page_release) as usize;
    assert!(c.streams == 3000 && pages < 100, "{pages} pages, {c:?}");
    assert!(c.old_mappings <= 32 * pages, "{pages} pages, {c:?}");
    assert!(s.num_map > 3000, "pages moved from stream to stream: {s:?}");
}

/// A busy pool's table holds a row of 64 classes per power of two its
/// blocks' sizes span, not every class: one stream, random sizes from 512
/// bytes to 8 MiB (15 powers of two) in 256 slots.
#[test]
fn a_busy_pool_holds_rows_for_the_sizes_it_holds() {
    let a = allocator(Config::segments());
    let mut rng = crate::sample::XorShift64::new(7);
    let mut slots: Vec<Option<DevicePtr>> = vec![None; 256];
    for _ in 0..20_000 {
        let r = rng.next();
        let slot = &mut slots[(r >> 32) as usize % 256];
        match slot.take() {
            Some(p) => a.free(p).unwrap(),
            None => {
                let e = 9 + r % 14;
                *slot = Some(
                    a.malloc((1 << e) + (r >> 8) % (1 << e), StreamId(0))
                        .unwrap(),
                );
            }
        }
    }
    let c = cost(&a);
    assert!(c.tables >= 1, "{c:?}");
    assert!(c.class_records <= 2 * 24 * 64, "{c:?}");
    a.check_invariants().unwrap();
}

/// The first ranges of a million streams' pools (two each) fit in the
/// simulated device's 127 TiB of address space; the first 4,096 ranges are
/// as large as before (the largest for 64, then 2 GiB).
#[test]
fn first_ranges_of_two_million_pools_fit_the_address_space() {
    let (total, page) = (1u64 << 50, 8 << 20);
    let size = |ranges: u64| expandable::next_range_size(total, page, ranges, 0, 4096);
    assert_eq!(size(0), 256 << 30);
    assert_eq!(size(63), 256 << 30);
    assert_eq!(size(64), 2 << 30);
    assert_eq!(size(4095), 2 << 30);
    assert_eq!(size(4096), 1 << 30);
    let all: u64 = (0..2_000_000).map(size).sum();
    assert!(all < 127 << 40, "{} TiB", all >> 40);
    // A request larger than the smallest first range still gets twice its size.
    assert_eq!(
        expandable::next_range_size(total, page, 1 << 30, 0, 100 << 20),
        200 << 20
    );
}
