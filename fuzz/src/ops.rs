//! The `ops` target: arbitrary operation sequences on a simulated device.
//!
//! The op type, the byte decoder and every property check are the shared
//! model checker's (`cachealloc_core::testing`, the one the proptest model
//! tests use); this module only picks the preset and dispatches:
//!
//! - configurations the model checker covers (those of `testing::configs()`,
//!   and any without expandable segments) run under [`testing::run_with`]:
//!   every property after every op, then the final free-everything /
//!   `empty_cache` / nothing-left check, by the strict contract. The
//!   expandable preset is among them;
//! - other configurations with expandable segments run the same ops under
//!   [`run_unmodelled`]: the core's own `check_invariants()` after each op,
//!   misuse must be an error, no two live allocations may overlap, and the
//!   same final leak check.

use cachealloc_core::testing::{self, Op, Options, Setup};
use cachealloc_core::{
    round_size, AllocError, CachingAllocator, Config, DevicePtr, SimulatedDevice, StreamId,
    MAX_REQUEST,
};
use std::collections::BTreeMap;

/// The presets the `ops` target chooses from, by its first byte.
pub fn presets() -> Vec<Config> {
    Config::PRESETS
        .iter()
        .map(|n| Config::preset(n).expect("a named preset"))
        .collect()
}

/// Whether the shared model checker can check `config` (see the module docs).
pub fn model_covers(config: &Config) -> bool {
    testing::configs().iter().any(|(_, c)| c == config) || !config.expandable_segments
}

/// How the model judges: by the strict contract, with the core's
/// `check_invariants` too unless `MODEL_SKIP_INTERNAL` is set.
pub fn options() -> Options {
    Options::default()
}

/// The whole body of the `ops` target: byte 0 picks how the preset is
/// chosen, the rest is decoded by [`testing::decode`].
///
/// Byte 0 below 128: the model's own choice of configuration (what
/// `testing::run_bytes` does: one of `testing::configs()`, i.e. pytorch,
/// default, no-caching, lowmem and variants).
/// 128 and above: one of the named presets ([`presets`]), under the model
/// when it covers it, else [`run_unmodelled`].
pub fn run(data: &[u8]) -> Result<(), String> {
    let Some((&choice, rest)) = data.split_first() else {
        return Ok(());
    };
    let (mut setup, ops) = testing::decode(rest);
    if choice >= 128 {
        let presets = presets();
        setup.config = presets[usize::from(choice) % presets.len()].clone();
    }
    run_setup(&setup, &ops)
}

/// Runs `ops` from `setup` under the model (with [`options`]) if it covers
/// the configuration, else under [`run_unmodelled`].
pub fn run_setup(setup: &Setup, ops: &[Op]) -> Result<(), String> {
    let name = &setup.config.name;
    if model_covers(&setup.config) {
        testing::run_with(setup, ops, options())
            .map(|_| ())
            .map_err(|e| format!("config {name} (model): {e}"))
    } else {
        run_unmodelled(setup, ops).map_err(|e| format!("config {name} (unmodelled): {e}"))
    }
}

struct Live {
    size: u64,
    span: u64,
}

/// Runs `ops` (interpreted as the model interprets them) where the model has
/// no rules for the configuration: the core's `check_invariants()` after each
/// op, misuse must be an error, live allocations must not overlap, and at the
/// end, after freeing everything, `empty_cache` must leave nothing reserved
/// and nothing on the device.
pub fn run_unmodelled(setup: &Setup, ops: &[Op]) -> Result<(), String> {
    let dev = SimulatedDevice::new(setup.capacity);
    let alloc = CachingAllocator::new(dev.clone(), setup.config.clone());
    let streams = &testing::STREAMS[..setup.streams.clamp(1, testing::STREAMS.len())];
    let divisions = setup.config.roundup_power2_divisions;
    // Live allocations by address, and their order (slots index this).
    let mut live: BTreeMap<u64, Live> = BTreeMap::new();
    let mut order: Vec<u64> = Vec::new();
    let mut freed: Vec<u64> = Vec::new();
    let misuse = |what: &str, r: Result<(), AllocError>| match r {
        Err(
            AllocError::DoubleFree(_)
            | AllocError::UnknownPointer(_)
            | AllocError::InteriorPointer { .. },
        ) => Ok(()),
        other => Err(format!(
            "{what} returned {other:?}, expected a misuse error"
        )),
    };
    for (i, op) in ops.iter().enumerate() {
        let step = |e: String| format!("step {i} {op:?}: {e}\nops: {ops:?}");
        match *op {
            Op::Malloc { size, stream } => {
                let s = streams[stream % streams.len()];
                match alloc.malloc(size, s) {
                    Ok(p) => {
                        if size == 0 || size > MAX_REQUEST {
                            return Err(step(format!("malloc({size}) succeeded with {p}")));
                        }
                        let span = round_size(size, &divisions).unwrap_or(size);
                        let before = live.range(..p.0).next_back();
                        let after = live.range(p.0..).next();
                        if before.is_some_and(|(&a, l)| a + l.span > p.0)
                            || after.is_some_and(|(&a, _)| a < p.0 + span)
                        {
                            return Err(step(format!(
                                "malloc({size}) returned {p}+{span}, overlapping a live allocation ({before:?}, {after:?})",
                                before = before.map(|(a, l)| (a, l.span)),
                                after = after.map(|(a, l)| (a, l.span)),
                            )));
                        }
                        live.insert(p.0, Live { size, span });
                        order.push(p.0);
                    }
                    Err(AllocError::ZeroSize) if size == 0 => {}
                    Err(AllocError::SizeTooLarge(_)) if size > MAX_REQUEST => {}
                    Err(AllocError::OutOfMemory(_)) if size > 0 && size <= MAX_REQUEST => {}
                    Err(e) => return Err(step(format!("malloc({size}) returned Err({e:?})"))),
                }
            }
            Op::Free { slot } => {
                if !order.is_empty() {
                    let a = order.remove(slot % order.len());
                    live.remove(&a);
                    alloc
                        .free(DevicePtr(a))
                        .map_err(|e| step(format!("free({a:#x}) of a live allocation: {e}")))?;
                    freed.push(a);
                    if freed.len() > 64 {
                        freed.remove(0);
                    }
                }
            }
            Op::DoubleFree { slot } | Op::RecordStreamStale { slot } => {
                if freed.is_empty() {
                    continue;
                }
                let a = freed[slot % freed.len()];
                if live.contains_key(&a) {
                    continue;
                }
                let r = if matches!(op, Op::DoubleFree { .. }) {
                    alloc.free(DevicePtr(a))
                } else {
                    alloc.record_stream(DevicePtr(a), streams[0])
                };
                misuse(&format!("{op:?} at {a:#x}"), r).map_err(step)?;
            }
            Op::ForeignFree { seed } => {
                let snap = alloc.snapshot();
                let ptr = if seed & 1 == 1 || snap.segments.is_empty() {
                    seed
                } else {
                    let s = &snap.segments[(seed >> 1) as usize % snap.segments.len()];
                    let off = (seed >> 17) % (s.total_size + 4096);
                    s.address.0 + if seed & 2 == 0 { off & !511 } else { off }
                };
                if live.contains_key(&ptr) {
                    continue;
                }
                misuse(&format!("free({ptr:#x})"), alloc.free(DevicePtr(ptr))).map_err(step)?;
            }
            Op::InteriorFree { slot, offset } => {
                if order.is_empty() {
                    continue;
                }
                let a = order[slot % order.len()];
                let off = (offset % live[&a].span).max(1);
                misuse(
                    &format!("free({:#x}) inside {a:#x}", a + off),
                    alloc.free(DevicePtr(a + off)),
                )
                .map_err(step)?;
            }
            Op::RecordStream { slot, stream } => {
                if order.is_empty() {
                    continue;
                }
                let a = order[slot % order.len()];
                alloc
                    .record_stream(DevicePtr(a), streams[stream % streams.len()])
                    .map_err(|e| step(format!("record_stream({a:#x}) of a live block: {e}")))?;
            }
            Op::CompleteEvent { index } => {
                let p = dev.pending_events();
                if !p.is_empty() {
                    dev.complete_event(p[index % p.len()]);
                }
            }
            Op::CompleteAllEvents => dev.complete_all_events(),
            Op::ProcessEvents => alloc
                .process_events()
                .map_err(|e| step(format!("process_events: {e}")))?,
            Op::EmptyCache => {
                alloc
                    .empty_cache()
                    .map_err(|e| step(format!("empty_cache: {e}")))?;
            }
            Op::SetCap(cap) => alloc
                .set_memory_cap(cap)
                .map_err(|e| step(format!("set_memory_cap: {e}")))?,
            Op::FailNext(n) => dev.fail_next_allocations(n),
            Op::FailAbove(limit) => dev.fail_allocations_above(limit),
            Op::ResetPeak => alloc.reset_peak_stats(),
        }
        alloc
            .check_invariants()
            .map_err(|e| step(format!("check_invariants: {e}")))?;
    }
    // Leak check: free everything, empty the cache, nothing may be left.
    for a in order {
        let l = &live[&a];
        alloc
            .free(DevicePtr(a))
            .map_err(|e| format!("final free({a:#x}) of {} bytes: {e}", l.size))?;
    }
    alloc
        .check_invariants()
        .map_err(|e| format!("check_invariants after freeing everything: {e}"))?;
    alloc
        .empty_cache()
        .map_err(|e| format!("final empty_cache: {e}"))?;
    alloc
        .check_invariants()
        .map_err(|e| format!("check_invariants after the final empty_cache: {e}"))?;
    let st = alloc.stats();
    for (name, a) in st.arrays() {
        if a.stats().iter().any(|s| s.current != 0) {
            return Err(format!(
                "after freeing everything and empty_cache, {name} is {a:?}"
            ));
        }
    }
    if dev.outstanding() != 0 || dev.used() != 0 {
        return Err(format!(
            "after freeing everything and empty_cache, the device still holds {} segments/pages ({} bytes)",
            dev.outstanding(),
            dev.used()
        ));
    }
    // The allocator still serves once the cap and the failures are lifted.
    alloc.set_memory_cap(None).map_err(|e| e.to_string())?;
    dev.fail_next_allocations(0);
    dev.fail_allocations_above(None);
    if setup.capacity >= 64 << 20 {
        let p = alloc
            .malloc(4096, StreamId(0))
            .map_err(|e| format!("malloc(4096) on an emptied allocator: {e}"))?;
        alloc.free(p).map_err(|e| e.to_string())?;
        alloc.empty_cache().map_err(|e| e.to_string())?;
        if dev.outstanding() != 0 {
            return Err("a segment outlived the last empty_cache".into());
        }
    }
    Ok(())
}
