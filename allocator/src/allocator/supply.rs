//! The allocator's side of `crate::supply`: where its plain segments come
//! from (the device, or a [`SegmentSource`]), the cap it may share with
//! other allocators (a [`CapGroup`]: Note [Shared cap]), and the two
//! behaviours a private pool may ask for: blocks never split (PyTorch's
//! `MemPool(no_split=True)`) and an allocation served only from cached
//! blocks (the memory of a `MemPool(use_on_oom=True)` served to another
//! allocation that ran out).

use super::*;
use crate::supply::{CapGroup, CapMember, SegmentSource};

/// Where an allocator's segments come from and on what terms: the growth
/// ladder asks [`Core::segment_alloc`] for a segment and the release rules
/// give it back through [`Core::segment_free`]; the cap checks read
/// [`Core::cap_now`].
#[derive(Default)]
pub(crate) struct Supply {
    /// The segments' source; `None`: the device.
    source: Option<Box<dyn SegmentSource>>,
    /// This allocator's place in a group sharing its cap.
    member: Option<CapMember>,
    /// Blocks are handed out whole, never split (`no_split`).
    pub(super) no_split: bool,
}

impl<E> Core<E> {
    /// A new plain segment of `bytes` for `stream`, from the source or the device.
    pub(super) fn segment_alloc<D: Device<Event = E>>(
        &self,
        dev: &D,
        bytes: u64,
        stream: StreamId,
    ) -> Result<DevicePtr, DeviceError> {
        match &self.supply.source {
            None => dev.allocate(bytes),
            Some(s) => s.allocate(bytes, stream),
        }
    }

    /// Gives a plain segment back to where [`Core::segment_alloc`] got it.
    pub(super) fn segment_free<D: Device<Event = E>>(
        &self,
        dev: &D,
        ptr: DevicePtr,
        bytes: u64,
        stream: StreamId,
    ) -> Result<(), DeviceError> {
        match &self.supply.source {
            None => dev.free(ptr, bytes),
            Some(s) => s.free(ptr, bytes, stream),
        }
    }

    /// The cap on this allocator's reserved bytes now: its own, and the room
    /// its group's cap leaves it (Note [Shared cap]), whichever is lower.
    pub(super) fn cap_now(&self) -> Option<u64> {
        let shared = self.supply.member.as_ref().and_then(CapMember::room);
        match (self.cap, shared) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Tells the group, if any, what this allocator reserves now (after
    /// every operation that may change it).
    #[inline]
    pub(super) fn publish_reserved(&mut self) {
        let reserved = self.reserved();
        if let Some(m) = self.supply.member.as_mut() {
            m.publish(reserved);
        }
    }

    /// Tells the group, if any, that this allocator's own cap changed.
    pub(super) fn publish_cap(&self) {
        if let Some(m) = &self.supply.member {
            m.cap_changed(self.cap);
        }
    }

    /// The pool kind a request of `rounded` bytes goes to.
    #[inline(always)]
    pub(super) fn request_kind(&self, rounded: u64) -> PoolKind {
        if rounded <= SMALL_SIZE {
            PoolKind::Small
        } else if rounded >= self.config.huge_size && self.granularity.is_none() {
            // (A plain-segment rule: expandable segments have no huge pool.)
            PoolKind::Huge
        } else {
            PoolKind::Large
        }
    }
}

impl<E> State<E> {
    /// [`CachingAllocator::malloc_cached`] under the lock.
    fn malloc_cached<D: Device<Event = E>>(
        &mut self,
        dev: &D,
        size: u64,
        rounded: u64,
        stream: StreamId,
    ) -> Result<Option<DevicePtr>, AllocError> {
        let c = &self.core;
        if !c.config.caching || c.granularity.is_some() || self.slabs.serves(rounded) {
            return Ok(None);
        }
        if self.core.pending_blocks > 0 {
            self.process_events(dev)?;
        }
        if self.caches.cached_blocks() > 0 {
            self.flush_thread_caches();
        }
        let pool = PoolId::new(self.stream_slot(stream), self.core.request_kind(rounded));
        let Some(id) = self.core.get_free_block(pool, rounded) else {
            return Ok(None);
        };
        self.core.clock += 1;
        Ok(Some(self.core.alloc_found_block(id, rounded, size)))
    }
}

impl<D: Device> CachingAllocator<D> {
    /// An allocator over `device` whose plain segments come from `source`
    /// and go back to it (PyTorch's `MemPool(allocator=...)`); the device
    /// still records and waits for events and reports memory. Such an
    /// allocator uses plain segments whatever `config` says (a source hands
    /// out segments, not pages), as PyTorch's pools with an allocator do.
    pub fn with_segment_source(
        device: D,
        mut config: Config,
        source: Box<dyn SegmentSource>,
    ) -> Self {
        config.expandable_segments = false;
        let a = Self::new(device, config);
        a.state.lock().core.supply.source = Some(source);
        a
    }

    /// Whether this allocator's segments come from a [`SegmentSource`].
    pub fn has_segment_source(&self) -> bool {
        self.state.lock().core.supply.source.is_some()
    }

    /// Hands blocks out whole from now on, never splitting a free block for
    /// a smaller request (PyTorch's `MemPool(no_split=True)`): every
    /// allocation takes a cached block or a segment of its own. Blocks split
    /// already stay as they are. Plain segments only: an allocator of
    /// expandable segments (never a private pool's) keeps carving its
    /// ranges, whose free blocks span unmapped pages.
    pub fn set_no_split(&self, no_split: bool) {
        self.state.lock().core.supply.no_split = no_split;
    }

    /// Whether blocks are handed out whole ([`CachingAllocator::set_no_split`]).
    pub fn no_split(&self) -> bool {
        self.state.lock().core.supply.no_split
    }

    /// Makes this allocator count its cap against the bytes of every member
    /// of `group` (Note [Shared cap]); a `leader`'s own cap is the group's.
    /// Joining a group it is in already changes nothing; joining another
    /// leaves the first.
    pub fn join_cap_group(&self, group: &CapGroup, leader: bool) {
        let st = &mut *self.state.lock();
        if st
            .core
            .supply
            .member
            .as_ref()
            .is_some_and(|m| m.group().same(group))
        {
            return;
        }
        st.core.supply.member = Some(CapMember::join(group, leader, st.core.cap));
        st.core.publish_reserved();
    }

    /// The cap on reserved bytes in force now: the own cap, or the room a
    /// shared cap leaves, whichever is lower (`None`: no cap).
    pub fn effective_cap(&self) -> Option<u64> {
        self.state.lock().core.cap_now()
    }

    /// Allocates `size` bytes for `stream` from the blocks cached already,
    /// without growing, releasing or flushing anything: `None` when no
    /// cached block fits. What a `MemPool(use_on_oom=True)` serves to an
    /// allocation that ran out of memory elsewhere (PyTorch looks only at
    /// such a pool's free blocks). Plain segments only: `None` with
    /// expandable segments, slabs or caching off. The block is freed like
    /// any other.
    pub fn malloc_cached(
        &self,
        size: u64,
        stream: StreamId,
    ) -> Result<Option<DevicePtr>, AllocError> {
        if size == 0 {
            return Err(AllocError::ZeroSize);
        }
        let rounded = match &self.divisions {
            None => crate::rounding::round_size_plain(size),
            Some(d) => round_size(size, d),
        }
        .ok_or(AllocError::SizeTooLarge(size))?;
        let st = &mut *self.state.lock();
        let r = st.malloc_cached(&self.device, size, rounded, stream);
        st.core.publish_reserved();
        r
    }
}
