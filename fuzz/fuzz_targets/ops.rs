//! Arbitrary alloc/free/record_stream/event/empty_cache/cap/failure sequences
//! against every invariant of the shared model checker. See `cachealloc_fuzz::ops`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Err(e) = cachealloc_fuzz::ops::run(data) {
        panic!("{e}");
    }
});
