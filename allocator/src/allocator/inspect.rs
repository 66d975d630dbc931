//! What the allocator reports about itself: fragmentation and snapshots.

use super::*;

impl<E> State<E> {
    /// Free bytes in free blocks and the largest free block, over all pools.
    /// Free bytes and the largest free block. In expandable segments only
    /// mapped bytes count: unmapped address space is not memory.
    pub(super) fn fragmentation_totals(&self) -> (u64, u64) {
        let mut free = 0;
        let mut largest = 0;
        for (i, bins) in self.bins.iter().enumerate() {
            let Some(bins) = bins else { continue };
            match self.vmm.ranges.get(i).is_some_and(|r| !r.is_empty()) {
                true => {
                    for (size, addr, id) in bins.iter() {
                        let s = self.segments.get(self.blocks.get(id.0).segment.0);
                        let mapped = self.mapped_bytes_in(s, addr, addr + size);
                        free += mapped;
                        largest = largest.max(mapped);
                    }
                }
                false => {
                    free += bins.bytes();
                    largest = largest.max(bins.largest().map_or(0, |e| e.0));
                }
            }
        }
        // Free chunks and uncarved tails of slabs are outside the bins.
        for s in self.slab_segments() {
            let mut cur = Some(s.head);
            while let Some(id) = cur {
                let b = self.blocks.get(id.0);
                if b.state == BlockState::Free {
                    free += b.size;
                    largest = largest.max(b.size);
                }
                cur = b.next;
            }
        }
        (free, largest)
    }

    /// The slab segments, full ones included.
    pub(super) fn slab_segments(&self) -> impl Iterator<Item = &Segment> + '_ {
        self.segment_by_addr
            .values()
            .map(|&seg| self.segments.get(seg.0))
            .filter(|s| s.is_slab())
    }

    pub(super) fn fragmentation(&self) -> FragmentationReport {
        let (free, largest) = self.fragmentation_totals();
        let mut segments = Vec::with_capacity(self.segments.len());
        let mut releasable = 0;
        for &seg in self.segment_by_addr.values() {
            let s = self.segments.get(seg.0);
            let (mut used, mut largest_free, mut blocks) = (0, 0, 0);
            let mut cur = Some(s.head);
            while let Some(id) = cur {
                let b = self.blocks.get(id.0);
                if b.state == BlockState::Free {
                    largest_free =
                        largest_free.max(self.mapped_bytes_in(s, b.addr, b.addr + b.size));
                    if s.is_expandable() {
                        releasable += self.idle_bytes_in(s, b.addr, b.addr + b.size);
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
                size: self.mapped_bytes_in(s, s.addr, s.addr + s.size),
                used,
                largest_free,
                blocks,
                pool: s.pool.kind(),
            });
        }
        releasable += self.pooled_bytes();
        FragmentationReport {
            allocated: self.stats.allocated_bytes.all().current,
            reserved: self.reserved(),
            free,
            inactive_split: self.stats.inactive_split_bytes.all().current,
            releasable,
            largest_free_block: largest,
            segments,
        }
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
                mapped_size: self.mapped_bytes_in(s, s.addr, s.addr + s.size),
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
