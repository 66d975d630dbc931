//! Bodies of cachealloc's fuzz targets (`fuzz_targets/*.rs` call them), kept
//! in a library so that regression tests and a plain `cargo test` in `fuzz/`
//! can run any input through exactly what the fuzzer runs.
//!
//! Each body panics when a property is violated; libFuzzer reports the
//! panic as a crash and saves the input. See `docs/FUZZING.md`.

pub mod config;
pub mod ops;
pub mod trace;
