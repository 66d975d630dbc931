//! Fragmentation report and snapshot: what the cache holds, block by block.

use crate::block::{BlockState, PoolKind};
use crate::device::{DevicePtr, StreamId};
use std::fmt;

/// How fragmented the cache is right now.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct FragmentationReport {
    /// Bytes allocated to callers.
    pub allocated: u64,
    /// Bytes held from the device.
    pub reserved: u64,
    /// Bytes in free cached blocks (reserved − active).
    pub free: u64,
    /// Free bytes inside split segments (cannot be released).
    pub inactive_split: u64,
    /// Free bytes in entirely free segments (`empty_cache` would release them).
    pub releasable: u64,
    /// The largest free block.
    pub largest_free_block: u64,
    /// Per segment: address, size, allocated bytes, largest free block.
    pub segments: Vec<SegmentUse>,
}

/// How one segment is used.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SegmentUse {
    /// Segment start.
    pub addr: DevicePtr,
    /// Segment size (for an expandable segment: its mapped bytes).
    pub size: u64,
    /// Bytes of allocated (or awaiting-event) blocks.
    pub used: u64,
    /// Largest free block in it.
    pub largest_free: u64,
    /// Number of blocks.
    pub blocks: usize,
    /// Pool.
    pub pool: PoolKind,
}

impl FragmentationReport {
    /// `reserved − allocated`.
    pub fn reserved_unallocated(&self) -> u64 {
        self.reserved.saturating_sub(self.allocated)
    }

    /// `(free − largest_free) / free`: how much of the free memory is not in the largest block.
    pub fn external_fragmentation(&self) -> f64 {
        if self.free == 0 {
            0.0
        } else {
            (self.free - self.largest_free_block) as f64 / self.free as f64
        }
    }

    /// `1 − allocated / reserved`.
    pub fn unused_fraction(&self) -> f64 {
        if self.reserved == 0 {
            0.0
        } else {
            1.0 - self.allocated as f64 / self.reserved as f64
        }
    }
}

impl fmt::Display for FragmentationReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "fragmentation report")?;
        writeln!(
            f,
            "  allocated                  {:>12}",
            human_bytes(self.allocated)
        )?;
        writeln!(
            f,
            "  reserved                   {:>12}",
            human_bytes(self.reserved)
        )?;
        writeln!(
            f,
            "  reserved - allocated       {:>12}",
            human_bytes(self.reserved_unallocated())
        )?;
        writeln!(
            f,
            "  inactive split bytes       {:>12}",
            human_bytes(self.inactive_split)
        )?;
        writeln!(
            f,
            "  releasable (empty_cache)   {:>12}",
            human_bytes(self.releasable)
        )?;
        writeln!(
            f,
            "  largest free block         {:>12}",
            human_bytes(self.largest_free_block)
        )?;
        writeln!(
            f,
            "  external fragmentation     {:>11.1}%  (free - largest free) / free",
            self.external_fragmentation() * 100.0
        )?;
        writeln!(
            f,
            "  unused fraction            {:>11.1}%  1 - allocated / reserved",
            self.unused_fraction() * 100.0
        )?;
        writeln!(
            f,
            "  segments                   {:>12}",
            self.segments.len()
        )?;
        let shown = 8.min(self.segments.len());
        if shown > 0 {
            writeln!(
                f,
                "  segments, least used first ({shown} of {}):",
                self.segments.len()
            )?;
            let mut by_use: Vec<&SegmentUse> = self.segments.iter().collect();
            by_use.sort_by(|a, b| {
                (a.used as f64 / a.size as f64).total_cmp(&(b.used as f64 / b.size as f64))
            });
            for s in by_use.iter().take(shown) {
                writeln!(
                    f,
                    "    {:>16}  {:>10}  used {:>5.1}%  largest free {:>10}  {} blocks  {:?}",
                    s.addr.to_string(),
                    human_bytes(s.size),
                    s.used as f64 * 100.0 / s.size as f64,
                    human_bytes(s.largest_free),
                    s.blocks,
                    s.pool
                )?;
            }
        }
        Ok(())
    }
}

/// Every segment and block, like `torch.cuda.memory._snapshot()["segments"]`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Snapshot {
    /// Segments, lowest address first.
    pub segments: Vec<SegmentSnapshot>,
}

/// One segment in a [`Snapshot`].
#[derive(Clone, Debug, PartialEq)]
pub struct SegmentSnapshot {
    /// Start address.
    pub address: DevicePtr,
    /// Size in bytes (for an expandable segment: its virtual range).
    pub total_size: u64,
    /// Bytes backed by physical memory (`total_size` for a plain segment).
    pub mapped_size: u64,
    /// Bytes of allocated blocks.
    pub allocated_size: u64,
    /// Bytes requested by callers of allocated blocks.
    pub requested_size: u64,
    /// Owning stream.
    pub stream: StreamId,
    /// Pool.
    pub pool: PoolKind,
    /// Blocks in address order.
    pub blocks: Vec<BlockSnapshot>,
}

/// One block in a [`SegmentSnapshot`].
#[derive(Clone, Debug, PartialEq)]
pub struct BlockSnapshot {
    /// Start address.
    pub address: DevicePtr,
    /// Size in bytes.
    pub size: u64,
    /// Requested bytes (0 when free).
    pub requested_size: u64,
    /// State.
    pub state: BlockState,
    /// Streams other than the owner that used it.
    pub stream_uses: Vec<StreamId>,
}

/// `1.50 GiB`-style rendering of a byte count.
pub fn human_bytes(b: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut v = b as f64;
    let mut i = 0;
    while v >= 1024.0 && i + 1 < UNITS.len() {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{b} B")
    } else {
        format!("{v:.2} {}", UNITS[i])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ratios() {
        let r = FragmentationReport {
            allocated: 60,
            reserved: 100,
            free: 40,
            largest_free_block: 10,
            ..Default::default()
        };
        assert_eq!(r.reserved_unallocated(), 40);
        assert!((r.external_fragmentation() - 0.75).abs() < 1e-12);
        assert!((r.unused_fraction() - 0.4).abs() < 1e-12);
        assert_eq!(FragmentationReport::default().external_fragmentation(), 0.0);
    }

    #[test]
    fn human() {
        assert_eq!(human_bytes(512), "512 B");
        assert_eq!(human_bytes(3 << 29), "1.50 GiB");
    }
}
