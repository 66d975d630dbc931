//! What an allocator draws on besides its device: a [`SegmentSource`] that
//! hands out its segments, and a [`CapGroup`] whose memory cap it shares
//! with other allocators.
//!
//! By default a [`CachingAllocator`](crate::CachingAllocator) asks its
//! [`Device`](crate::Device) for plain segments and counts its memory cap
//! against what it reserves itself. PyTorch's private pools need two more
//! things, and each is one narrow interface here:
//!
//! - `torch.cuda.MemPool(allocator=...)`: the pool's segments come from the
//!   user's allocation and free functions. An allocator built with
//!   [`CachingAllocator::with_segment_source`](crate::CachingAllocator::with_segment_source)
//!   asks its source, not its device, for every segment and gives every
//!   segment back to it; events, memory information and synchronisation
//!   still go to the device. The source's segments are cached, split and
//!   merged like the device's.
//! - PyTorch's memory fraction counts every segment of the device, a private
//!   pool's included: Note [Shared cap].
//!
//! Note [Shared cap]: the allocators of a [`CapGroup`] (a device's
//! allocator and its private pools) share one cap. Each member publishes
//! what it reserves into the group's total after every operation that may
//! change it (under its own lock, so no member ever takes another's lock);
//! a member's cap check counts the bytes the others published, so its room
//! is the group's cap less what the others hold. The group's cap is the
//! leader's own cap (the device's allocator: `set_memory_cap` on it sets the
//! group's), so a memory fraction set on the device applies to the pools
//! without each being told. Two members growing at the same moment each see
//! the other's bytes as of its last operation, so together they may pass
//! the cap by what those two operations add; one thread at a time never
//! does.

use crate::device::{DeviceError, DevicePtr, StreamId};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Where an allocator's plain segments come from instead of its device
/// (PyTorch's `MemPool(allocator=...)`): a pair of calls, allocate and free.
///
/// The allocator calls them while holding its lock, as it calls
/// [`Device::allocate`](crate::Device::allocate); an implementation must not
/// call back into the same allocator.
pub trait SegmentSource: Send + Sync {
    /// A segment of `bytes` (a multiple of 512) for use on `stream`;
    /// [`DeviceError::OutOfMemory`] when the source has no memory for it (the
    /// allocator then climbs its growth ladder as after a device refusal).
    fn allocate(&self, bytes: u64, stream: StreamId) -> Result<DevicePtr, DeviceError>;
    /// Gives back a segment that [`SegmentSource::allocate`] returned, with
    /// the size and stream it was asked for.
    fn free(&self, ptr: DevicePtr, bytes: u64, stream: StreamId) -> Result<(), DeviceError>;
}

/// Allocators that share one memory cap: Note [Shared cap]. Cloning gives
/// another handle on the same group.
#[derive(Clone, Debug, Default)]
pub struct CapGroup(Arc<Shared>);

#[derive(Debug)]
struct Shared {
    /// Bytes the members reserve, as each last published.
    reserved: AtomicU64,
    /// The leader's cap in bytes; `u64::MAX`: none.
    cap: AtomicU64,
}

impl Default for Shared {
    fn default() -> Self {
        Shared {
            reserved: AtomicU64::new(0),
            cap: AtomicU64::new(u64::MAX),
        }
    }
}

impl CapGroup {
    /// A group with no member and no cap.
    pub fn new() -> Self {
        Self::default()
    }

    /// Bytes the members reserve, as each last published.
    pub fn reserved(&self) -> u64 {
        self.0.reserved.load(Ordering::Acquire)
    }

    /// The group's cap (its leader's), if any.
    pub fn cap(&self) -> Option<u64> {
        Some(self.0.cap.load(Ordering::Acquire)).filter(|&c| c != u64::MAX)
    }

    /// Whether `other` is a handle on this same group.
    pub fn same(&self, other: &CapGroup) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }

    fn set_cap(&self, cap: Option<u64>) {
        self.0.cap.store(cap.unwrap_or(u64::MAX), Ordering::Release);
    }
}

/// One allocator's place in a [`CapGroup`]: what it last published, and
/// whether its cap is the group's.
#[derive(Debug)]
pub(crate) struct CapMember {
    group: CapGroup,
    published: u64,
    leader: bool,
}

impl CapMember {
    /// Joins `group`; a leader's `cap` becomes the group's.
    pub(crate) fn join(group: &CapGroup, leader: bool, cap: Option<u64>) -> Self {
        if leader {
            group.set_cap(cap);
        }
        CapMember {
            group: group.clone(),
            published: 0,
            leader,
        }
    }

    /// The group this member belongs to.
    pub(crate) fn group(&self) -> &CapGroup {
        &self.group
    }

    /// Publishes that the member now reserves `reserved` bytes.
    #[inline]
    pub(crate) fn publish(&mut self, reserved: u64) {
        if reserved != self.published {
            self.publish_change(reserved);
        }
    }

    #[cold]
    fn publish_change(&mut self, reserved: u64) {
        let total = &self.group.0.reserved;
        if reserved > self.published {
            total.fetch_add(reserved - self.published, Ordering::AcqRel);
        } else {
            total.fetch_sub(self.published - reserved, Ordering::AcqRel);
        }
        self.published = reserved;
    }

    /// The member's own cap changed: a leader's is the group's.
    pub(crate) fn cap_changed(&self, cap: Option<u64>) {
        if self.leader {
            self.group.set_cap(cap);
        }
    }

    /// What the group's cap leaves for this member: the cap less what the
    /// other members hold (`None`: the group has no cap).
    pub(crate) fn room(&self) -> Option<u64> {
        let cap = self.group.cap()?;
        let others = self.group.reserved().saturating_sub(self.published);
        Some(cap.saturating_sub(others))
    }
}

impl Drop for CapMember {
    fn drop(&mut self) {
        // (What it holds leaves the group with it; a leader's cap stays.)
        self.publish(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The room a member sees is the leader's cap less what the others
    /// published, whatever it holds itself; leaving takes its bytes along.
    #[test]
    fn a_member_sees_the_cap_less_what_the_others_hold() {
        let g = CapGroup::new();
        let mut leader = CapMember::join(&g, true, Some(100));
        let mut pool = CapMember::join(&g, false, None);
        assert_eq!(g.cap(), Some(100));
        leader.publish(30);
        pool.publish(50);
        assert_eq!(g.reserved(), 80);
        assert_eq!(leader.room(), Some(50));
        assert_eq!(pool.room(), Some(70));
        pool.publish(20);
        assert_eq!(leader.room(), Some(80));
        // A member's own cap does not set the group's unless it leads.
        pool.cap_changed(Some(1));
        assert_eq!(g.cap(), Some(100));
        leader.cap_changed(None);
        assert_eq!(pool.room(), None);
        leader.cap_changed(Some(40));
        assert_eq!(pool.room(), Some(10));
        drop(pool);
        assert_eq!(g.reserved(), 30);
        assert_eq!(leader.room(), Some(40));
    }
}
