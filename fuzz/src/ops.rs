//! The `ops` target: arbitrary operation sequences on a simulated device.
//!
//! The op type, the byte decoder and every property check are the shared
//! model checker's (`cachealloc_model`, the one the proptest model
//! tests use); this module only picks the preset. Every configuration,
//! expandable segments included, runs under [`model::run_with`]: every
//! property after every op, then the final free-everything / `empty_cache`
//! / nothing-left check, by the strict contract.

use cachealloc_core::Config;
use cachealloc_model::{self as model, Op, Options, Setup};

/// The presets the `ops` target chooses from, by its first byte.
pub fn presets() -> Vec<Config> {
    Config::PRESETS
        .iter()
        .map(|n| Config::preset(n).expect("a named preset"))
        .collect()
}

/// How the model judges: by the strict contract, with the core's
/// `check_invariants` too unless `MODEL_SKIP_INTERNAL` is set.
pub fn options() -> Options {
    Options::default()
}

/// The whole body of the `ops` target: byte 0 picks how the preset is
/// chosen, the rest is decoded by [`model::decode`].
///
/// Byte 0 below 128: the model's own choice of configuration (what
/// `model::run_bytes` does: one of `model::configs()`, i.e. pytorch,
/// default, no-caching, expandable and variants).
/// 128 and above: one of the named presets ([`presets`]).
pub fn run(data: &[u8]) -> Result<(), String> {
    run_under(data, None)
}

/// [`run`], or with `only` every input under that configuration whatever
/// its first byte (a long run aimed at one preset: the stable driver's
/// `STABLE_FUZZ_PRESET`).
pub fn run_under(data: &[u8], only: Option<&Config>) -> Result<(), String> {
    let Some((&choice, rest)) = data.split_first() else {
        return Ok(());
    };
    let (mut setup, ops) = model::decode(rest);
    if let Some(c) = only {
        setup.config = c.clone();
    } else if choice >= 128 {
        let presets = presets();
        setup.config = presets[usize::from(choice) % presets.len()].clone();
    }
    run_setup(&setup, &ops)
}

/// Runs `ops` from `setup` under the model (with [`options`]).
pub fn run_setup(setup: &Setup, ops: &[Op]) -> Result<(), String> {
    model::run_with(setup, ops, options())
        .map(|_| ())
        .map_err(|e| format!("config {}: {e}", setup.config.name()))
}
