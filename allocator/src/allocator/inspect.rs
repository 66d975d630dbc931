//! What the allocator reports about itself: fragmentation and snapshots.

use super::*;
use crate::bins::Entry;

impl<E> State<E> {
    /// Free bytes in free blocks and the largest free block, over all pools.
    /// Free bytes and the largest free block. In expandable segments only
    /// mapped bytes count: unmapped address space is not memory.
    pub(super) fn fragmentation_totals(&self) -> (u64, u64) {
        let mut free = 0;
        let mut largest = 0;
        for (i, bins) in self.core.bins.iter().enumerate() {
            match self.vmm.has_ranges(i) {
                true => {
                    for Entry { size, addr, id } in bins.iter() {
                        let s = self.core.segments.get(self.core.blocks.get(id.0).segment.0);
                        let mapped = self.core.mapped_bytes_in(s, addr, addr + size);
                        free += mapped;
                        largest = largest.max(mapped);
                    }
                }
                false => {
                    free += bins.bytes();
                    largest = largest.max(bins.largest().map_or(0, |e| e.size));
                }
            }
        }
        // Free chunks and uncarved tails of slabs are outside the bins.
        for s in self.core.slab_segments() {
            let mut cur = Some(s.head);
            while let Some(id) = cur {
                let b = self.core.blocks.get(id.0);
                if b.state == BlockState::Free {
                    free += b.size;
                    largest = largest.max(b.size);
                }
                cur = b.next;
            }
        }
        (free, largest)
    }

    pub(super) fn fragmentation(&self) -> FragmentationReport {
        let (free, largest) = self.fragmentation_totals();
        let mut segments = Vec::with_capacity(self.core.segments.len());
        let mut releasable = 0;
        for &seg in self.core.segment_by_addr.values() {
            let s = self.core.segments.get(seg.0);
            let (mut used, mut largest_free, mut blocks) = (0, 0, 0);
            let mut cur = Some(s.head);
            while let Some(id) = cur {
                let b = self.core.blocks.get(id.0);
                if b.state == BlockState::Free {
                    largest_free =
                        largest_free.max(self.core.mapped_bytes_in(s, b.addr, b.addr + b.size));
                    if s.is_expandable() {
                        releasable += self.core.idle_bytes_in(s, b.addr, b.addr + b.size);
                    }
                } else {
                    used += b.size;
                }
                blocks += 1;
                cur = b.next;
            }
            if used == 0 && (blocks == 1 || s.is_slab()) && !s.is_expandable() {
                releasable += s.size;
            }
            segments.push(SegmentUse {
                addr: DevicePtr(s.addr),
                size: self.core.mapped_bytes_in(s, s.addr, s.addr + s.size),
                used,
                largest_free,
                blocks,
                pool: s.pool.kind(),
            });
        }
        releasable += self.vmm.pooled_bytes();
        FragmentationReport {
            allocated: self.core.stats.allocated_bytes.all().current,
            reserved: self.core.reserved(),
            free,
            inactive_split: self.core.stats.inactive_split_bytes.all().current,
            releasable,
            largest_free_block: largest,
            segments,
        }
    }
}

impl<E> Core<E> {
    /// Bytes of mapped pages lying entirely inside `[start, end)` (idle if that is a free block).
    pub(super) fn idle_bytes_in(&self, seg: &Segment, start: u64, end: u64) -> u64 {
        let Some(pages) = seg.pages() else {
            return 0;
        };
        let g = self.granularity.unwrap_or(0);
        let lo = (start - seg.addr).div_ceil(g) as u32;
        let hi = ((end - seg.addr) / g) as u32;
        if hi <= lo {
            return 0;
        }
        pages
            .within(lo, hi)
            .map(|(_, _, n)| u64::from(n))
            .sum::<u64>()
            * g
    }

    /// Bytes of `[start, end)` backed by memory (all of it in a plain segment).
    pub(super) fn mapped_bytes_in(&self, seg: &Segment, start: u64, end: u64) -> u64 {
        let Some(pages) = seg.pages() else {
            return end - start;
        };
        let g = self.granularity.unwrap_or(0);
        let first = ((start - seg.addr) / g) as u32;
        let last = (end - seg.addr).div_ceil(g) as u32;
        pages
            .runs_overlapping(first, last)
            .map(|(s, e)| {
                let lo = (seg.addr + u64::from(s) * g).max(start);
                let hi = (seg.addr + u64::from(e) * g).min(end);
                hi - lo
            })
            .sum()
    }

    /// The bytes of physical pages segment `seg` counts as its reserved
    /// memory: what it maps, less granules mapped to a page another range
    /// counts (a shared page is counted once, where it was first mapped).
    pub(super) fn counted_bytes_in(&self, seg: &Segment) -> u64 {
        let mapped = self.mapped_bytes_in(seg, seg.addr, seg.addr + seg.size);
        match seg.pages() {
            Some(pages) => {
                let g = self.granularity.unwrap_or(0);
                mapped - u64::from(pages.aliases_in(0, (seg.size / g) as u32)) * g
            }
            None => mapped,
        }
    }

    /// The slab segments, full ones included.
    pub(super) fn slab_segments(&self) -> impl Iterator<Item = &Segment> + '_ {
        self.segment_by_addr
            .values()
            .map(|&seg| self.segments.get(seg.0))
            .filter(|s| s.is_slab())
    }

    pub(super) fn snapshot(&self) -> Snapshot {
        let mut segments = Vec::with_capacity(self.segments.len());
        for &seg in self.segment_by_addr.values() {
            let s = self.segments.get(seg.0);
            let mut blocks = Vec::new();
            let (mut allocated, mut requested) = (0, 0);
            let mut cur = Some(s.head);
            while let Some(id) = cur {
                let b = self.blocks.get(id.0);
                if b.state == BlockState::Allocated {
                    allocated += b.size;
                    requested += b.requested;
                }
                blocks.push(BlockSnapshot {
                    address: DevicePtr(b.addr),
                    size: b.size,
                    requested_size: b.requested,
                    state: b.state,
                    stream_uses: b.stream_uses.to_vec(),
                });
                cur = b.next;
            }
            segments.push(SegmentSnapshot {
                address: DevicePtr(s.addr),
                total_size: s.size,
                mapped_size: self.counted_bytes_in(s),
                allocated_size: allocated,
                requested_size: requested,
                stream: s.stream,
                pool: s.pool.kind(),
                blocks,
            });
        }
        Snapshot { segments }
    }
}
