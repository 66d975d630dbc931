//! Errors the allocator returns: caller misuse and out-of-memory.

use crate::device::{DeviceError, DevicePtr};
use std::fmt;

/// Why an allocator call failed. Misuse never corrupts the allocator's state.
#[derive(Clone, Debug, PartialEq)]
pub enum AllocError {
    /// `malloc(0)`: a zero-byte request has no block. (The C ABI answers it
    /// with a null pointer, which PyTorch treats as an empty tensor's storage.)
    ZeroSize,
    /// A request larger than [`crate::MAX_REQUEST`] (1 PiB), or one whose rounding overflows.
    SizeTooLarge(u64),
    /// Freed or used a pointer this allocator never handed out.
    UnknownPointer(DevicePtr),
    /// Freed a pointer that points inside a block, not at its start.
    InteriorPointer {
        /// The pointer given.
        ptr: DevicePtr,
        /// The start of the block that contains it.
        block: DevicePtr,
    },
    /// Freed a block that is already free (double free).
    DoubleFree(DevicePtr),
    /// The device could not give the memory, even after flushing the cache.
    OutOfMemory(Box<OomReport>),
    /// A device call failed for a reason other than lack of memory.
    Device(DeviceError),
    /// A layout to restore ([`crate::CachingAllocator::restore_layout`])
    /// does not fit the allocator's state; nothing was changed.
    BadLayout(String),
}

impl fmt::Display for AllocError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AllocError::ZeroSize => {
                write!(f, "zero-byte allocation requested (size 0 has no block)")
            }
            AllocError::SizeTooLarge(n) => write!(
                f,
                "requested {n} bytes: larger than any device (limit 1 PiB)"
            ),
            AllocError::UnknownPointer(p) => {
                write!(f, "pointer {p} was not allocated by this allocator")
            }
            AllocError::InteriorPointer { ptr, block } => {
                write!(
                    f,
                    "pointer {ptr} points inside the block at {block}, not at its start"
                )
            }
            AllocError::DoubleFree(p) => write!(f, "pointer {p} was already freed (double free)"),
            AllocError::OutOfMemory(r) => r.fmt(f),
            AllocError::Device(e) => write!(f, "device error: {e}"),
            AllocError::BadLayout(why) => write!(f, "cannot restore the layout: {why}"),
        }
    }
}

impl std::error::Error for AllocError {}

impl From<DeviceError> for AllocError {
    fn from(e: DeviceError) -> Self {
        AllocError::Device(e)
    }
}

/// The memory state at an out-of-memory failure: everything needed to see why.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct OomReport {
    /// Bytes the caller asked for.
    pub requested: u64,
    /// The segment size the allocator tried to get from the device.
    pub segment_size: u64,
    /// Device free memory (driver's view).
    pub device_free: u64,
    /// Device total memory.
    pub device_total: u64,
    /// The cap on reserved memory, if any.
    pub cap: Option<u64>,
    /// Bytes allocated to callers.
    pub allocated: u64,
    /// Bytes held from the device.
    pub reserved: u64,
    /// The largest free cached block (in the requesting stream's pool or any).
    pub largest_free_block: u64,
    /// `(free − largest_free) / free` over the cached free blocks.
    pub external_fragmentation: f64,
    /// Whether the allocator maps expandable segments (the advice differs).
    pub expandable: bool,
    /// Expandable segments: whether the large pools map pages larger than
    /// the device's granularity at this point and their free parts were not
    /// given back before the failure (`expandable_reback` off): smaller
    /// pages are the advice.
    pub big_pages: bool,
}

impl OomReport {
    /// Whether the bytes missing under the limit (the cap, or what the
    /// device could still give) are fewer than the cached bytes no block
    /// uses: the request failed because those bytes are scattered.
    pub fn fragmented(&self) -> bool {
        let unallocated = self.reserved.saturating_sub(self.allocated);
        let limit = self
            .cap
            .unwrap_or(u64::MAX)
            .min(self.reserved.saturating_add(self.device_free));
        let short = self
            .reserved
            .saturating_add(self.segment_size)
            .saturating_sub(limit);
        unallocated > self.requested || (short > 0 && short <= unallocated)
    }
}

fn gib(b: u64) -> String {
    crate::report::human_bytes(b)
}

impl fmt::Display for OomReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let unallocated = self.reserved.saturating_sub(self.allocated);
        write!(
            f,
            "out of memory: tried to allocate {} (a {} segment). Device has {} total, {} free",
            gib(self.requested),
            gib(self.segment_size),
            gib(self.device_total),
            gib(self.device_free),
        )?;
        if let Some(cap) = self.cap {
            write!(f, "; this allocator is capped at {}", gib(cap))?;
        }
        write!(
            f,
            ". Allocated {}, reserved {} ({} reserved but unallocated; largest free block {}, fragmentation {:.1}%).",
            gib(self.allocated),
            gib(self.reserved),
            gib(unallocated),
            gib(self.largest_free_block),
            self.external_fragmentation * 100.0,
        )?;
        if self.fragmented() && self.expandable && self.big_pages {
            write!(
                f,
                " The cache holds enough free bytes, but in pages partly under other blocks: set `expandable_page_mb:2` in CACHEALLOC_CONF to map pages of the device's granularity everywhere (more map calls)."
            )
        } else if self.fragmented() && self.expandable {
            write!(
                f,
                " The cache holds enough free bytes, but in pages of the device's granularity partly under other blocks: free tensors no longer needed, or reduce the batch size."
            )
        } else if self.fragmented() {
            write!(
                f,
                " The cache holds enough free bytes but no block large enough: set `expandable_segments:True` or a lower `max_split_size_mb` in CACHEALLOC_CONF to reduce fragmentation."
            )
        } else if self.cap.is_some_and(|c| c < self.device_total) {
            write!(f, " Raise the memory cap, or reduce the batch size.")
        } else {
            write!(
                f,
                " Reduce the batch size or model size, or free other users of the device."
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    /// The advice follows the cause: scattered free bytes name the setting
    /// that addresses them in the mode at hand; bytes truly missing name the
    /// cap or the device.
    #[test]
    fn the_advice_follows_the_cause() {
        // 50 MiB wanted, 20 free on the device: 30 missing, 35 unused in the cache.
        let scattered = OomReport {
            requested: 50 * MIB,
            segment_size: 50 * MIB,
            device_free: 20 * MIB,
            device_total: 100 * MIB,
            allocated: 45 * MIB,
            reserved: 80 * MIB,
            ..OomReport::default()
        };
        assert!(scattered.fragmented());
        assert!(scattered.to_string().contains("expandable_segments:True"));
        let expandable = OomReport {
            expandable: true,
            big_pages: true,
            ..scattered.clone()
        };
        let msg = expandable.to_string();
        assert!(msg.contains("expandable_page_mb:2"), "{msg}");
        assert!(!msg.contains("expandable_segments:True"), "{msg}");
        // Pages already of the device's granularity: no setting to suggest.
        let granules = OomReport {
            big_pages: false,
            ..expandable
        };
        let msg = granules.to_string();
        assert!(!msg.contains("expandable_page_mb"), "{msg}");
        assert!(msg.contains("reduce the batch size"), "{msg}");
        let missing = OomReport {
            device_free: 0,
            ..scattered
        };
        assert!(!missing.fragmented());
        assert!(missing.to_string().contains("Reduce the batch size"));
    }
}
