//! The C function behind the C++ allocator's reuse of blocks freed during a
//! CUDA graph capture (`graph_capture_record_stream_reuse:True`; Note
//! [Reclaim during a capture] in `allocator/src/allocator/capture_reuse.rs`).

#[cfg(feature = "cuda")]
pub use exports::*;

#[cfg(feature = "cuda")]
mod exports {
    use super::super::exports::{guard, handle};
    use cachealloc_core::DevicePtr;
    use std::ffi::{c_int, c_void};

    /// Hands back the block at `ptr` that a free held behind a CUDA graph
    /// capture: it joins its pool's free blocks at once, with no guarding
    /// event (the caller has checked in the graph being captured that its
    /// last uses come before anything the block's stream does next).
    /// Returns 1 when such a block was there, 0 when not (nothing changes),
    /// -1 on a NULL handle or a panic (the last error says which).
    ///
    /// # Safety
    /// `h` is NULL or a live handle (`cachealloc_torch_device`, or
    /// `cachealloc_torch_pool_new` not yet dropped).
    #[no_mangle]
    pub unsafe extern "C" fn cachealloc_torch_reclaim(h: *const c_void, ptr: *mut c_void) -> c_int {
        guard(-1, || {
            // SAFETY: forwarded contract.
            let Some(a) = (unsafe { handle(h) }) else {
                return -1;
            };
            c_int::from(a.reclaim_deferred(DevicePtr(ptr as usize as u64)))
        })
    }
}
