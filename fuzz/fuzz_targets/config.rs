//! Arbitrary strings as configurations: an error or a configuration that
//! round-trips and drives an allocator. See `cachealloc_fuzz::config`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| cachealloc_fuzz::config::check(data));
