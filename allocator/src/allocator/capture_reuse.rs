//! Reuse during a CUDA graph capture: a block freed while a stream it was
//! used on is being captured waits for the capture to end
//! (`Core::defer_guard`), unless the caller, who can read the graph being
//! captured, knows the block's last uses are behind everything the
//! allocating stream does next, and hands it back early.
//!
//! Note [Reclaim during a capture]: PyTorch's allocator with
//! `graph_capture_record_stream_reuse:True` records, when such a block is
//! freed, the current terminal nodes of the capture on the block's stream
//! and on every stream it was used on (its free markers); before an
//! allocation on the block's stream during the capture, a block whose
//! markers are all ancestors of (or are) that stream's current terminal
//! nodes goes back to its pool at once, without events: every node the
//! stream adds from then on runs after the block's last uses, on every
//! replay. The graph walk needs the CUDA runtime and lives in the C++
//! allocator (`python/cachealloc_torch/csrc/pools.cpp`); this is the
//! core's side: the deferred block at an address goes back to its pool,
//! its stream uses forgotten. A block that is not deferred (its free was
//! not held behind a capture, or was already guarded) is left alone.

use super::*;

impl<D: Device> CachingAllocator<D> {
    /// Hands back the block at `ptr` that a free held behind a CUDA graph
    /// capture (Note [Reclaim during a capture]): it joins its pool's free
    /// blocks now, with no guarding event. Returns whether such a block was
    /// there.
    pub fn reclaim_deferred(&self, ptr: DevicePtr) -> bool {
        self.state.lock().reclaim_deferred(&self.device, ptr)
    }
}

impl<E> State<E> {
    #[cold]
    fn reclaim_deferred<D: Device<Event = E>>(&mut self, dev: &D, ptr: DevicePtr) -> bool {
        let core = &mut self.core;
        let Some(i) = core
            .deferred
            .iter()
            .position(|&id| core.blocks.get(id.0).addr == ptr.0)
        else {
            return false;
        };
        let id = core.deferred.remove(i);
        core.blocks.get_mut(id.0).stream_uses.take();
        core.pending_blocks -= 1;
        self.recycle_block(dev, id);
        true
    }
}
