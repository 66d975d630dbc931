//! The slab policy that `lean_core`'s `slab:KIB` mode times and
//! `slab_eval` replays: a request (rounded to 512 bytes) gets a chunk of its
//! class's size (the core's `rounding::slab_class`) from a 2 MiB slab that
//! holds only that class.

pub use cachealloc_core::rounding::{slab_class, SLAB_CLASSES, SLAB_MAX};

/// Bytes of one slab (the small pool's segment size).
pub const SLAB_BYTES: u64 = 2 << 20;
