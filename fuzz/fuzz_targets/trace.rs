//! Arbitrary bytes as a trace (plain, gzip, truncated gzip, replayed): an
//! error, never a panic. See `cachealloc_fuzz::trace`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| cachealloc_fuzz::trace::check(data));
