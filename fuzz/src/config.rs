//! The `config` target: arbitrary strings into the configuration parser.
//!
//! - [`Config::parse`] returns an error or a configuration, never panics;
//!   an error's message names the offending key, value, item or preset;
//! - a parsed configuration's `to_conf_string()` parses back to an equal
//!   configuration, and writes the same string again;
//! - `parse_size` answers any string with a size or a message quoting it;
//! - [`Config::set`] of one key on a preset agrees with the parser on
//!   `preset,key:value` (the same configuration or the same error), and
//!   [`Config::get`] prints a value that `set` reads back to it;
//! - an allocator built with any configuration the parser accepts serves a
//!   fixed sequence of requests (small, large, huge, absurd; two streams,
//!   a cross-stream use, `empty_cache`) on a 1 GiB simulated device (larger
//!   where the configuration's segments need it) under the shared model
//!   checker: every property after every op, and nothing held after
//!   everything is freed.

use crate::ops::run_setup;
use cachealloc_core::keys::{KeyKind, KEYS};
use cachealloc_core::{parse_size, Config, ConfigError};
use cachealloc_model::{Op, Setup};

const MIB: u64 = 1 << 20;

/// The requests every accepted configuration must serve.
pub fn fixed_ops() -> Vec<Op> {
    let m = |size, stream| Op::Malloc { size, stream };
    vec![
        m(1, 0),
        m(512, 1),
        m(MIB, 0),
        m(MIB + 1, 0),
        m(3 * MIB, 1),
        m(12 * MIB, 0),
        m(25 * MIB, 0),
        m(300 * MIB, 1),
        Op::RecordStream { slot: 0, stream: 1 },
        Op::Free { slot: 0 },
        m(700, 0),
        Op::Free { slot: 2 },
        Op::Free { slot: 0 },
        Op::EmptyCache,
        m(0, 0),
        m(u64::MAX, 0),
        m(2048 * MIB, 0),
        m(64 * MIB, 1),
        Op::CompleteEvent { index: 0 },
        Op::Free { slot: 3 },
        Op::Free { slot: 1 },
        m(20 * MIB, 0),
        Op::EmptyCache,
    ]
}

/// The whole body of the `config` target: `data` as a configuration
/// string, then (when it is long enough) as a key of the table with a value
/// spread over the full `u64` and `f64` ranges and over the key's own range
/// ([`numeric_conf`]).
pub fn check(data: &[u8]) {
    check_counted(data);
}

/// [`check`], returning the number of allocator operations run (the fixed
/// sequence's ops, once per configuration the parser accepted).
pub fn check_counted(data: &[u8]) -> u64 {
    let mut ops = check_text(data);
    if let Some((preset, key, value)) = numeric_parts(data) {
        check_set(preset, key, &value);
        ops += check_text(format!("{preset},{key}:{value}").as_bytes());
    }
    ops
}

/// [`Config::set`] agrees with [`Config::parse`] on one key of a preset,
/// and what [`Config::get`] prints sets the same value again.
fn check_set(preset: &str, key: &str, value: &str) {
    let parsed = Config::parse(&format!("{preset},{key}:{value}"));
    let mut config = Config::preset(preset).expect("a preset of the list");
    let set = config.set(key, value).map(|()| config);
    assert_eq!(
        set, parsed,
        "set({key:?}, {value:?}) on {preset} and the parser disagree"
    );
    if let Ok(config) = set {
        if let Some(printed) = config.get(key).expect("a key of the table") {
            let mut again = config.clone();
            again.set(key, &printed).unwrap_or_else(|e| {
                panic!("{key}: get printed {printed:?}, which set refuses: {e}")
            });
            assert_eq!(again, config, "{key}: {printed:?} sets another value");
        }
    }
}

/// The bounds of a numeric key, in the units its text is written in.
#[derive(Copy, Clone, Debug, PartialEq)]
pub enum Bounds {
    /// Whole numbers (counts, sizes in a unit, byte sizes).
    Int {
        /// Least accepted value.
        min: u64,
        /// Greatest accepted value.
        max: u64,
        /// Whether the text may carry a unit (`16GiB`): a byte size.
        size: bool,
    },
    /// Real numbers.
    Float {
        /// Lower bound.
        min: f64,
        /// Upper bound.
        max: f64,
    },
}

/// The bounds of key `kind`, if it is numeric (division lists count as
/// their single-number form, 0 to 65536).
pub fn bounds(kind: &KeyKind) -> Option<Bounds> {
    match *kind {
        KeyKind::Count { min, max, .. } | KeyKind::Bytes { min, max, .. } => Some(Bounds::Int {
            min,
            max,
            size: false,
        }),
        KeyKind::Size { min, max } => Some(Bounds::Int {
            min,
            max,
            size: true,
        }),
        KeyKind::Divisions => Some(Bounds::Int {
            min: 0,
            max: 65536,
            size: false,
        }),
        KeyKind::Number { min, max, .. } => Some(Bounds::Float { min, max }),
        KeyKind::Bool | KeyKind::Choice(_) => None,
    }
}

/// A value of `bounds` picked by `mode` (0 to 3) from `n`: 0, an edge of
/// the range or just outside it; 1, anywhere inside, at any magnitude;
/// 2, inside, written with a unit where the key takes one, else a power of
/// two (what some counts accept only); 3, outside.
pub fn value_in(bounds: Bounds, mode: u8, n: u64) -> String {
    // A number of any magnitude: n's low 6 bits pick the shift.
    let spread = n >> (n & 63);
    match bounds {
        Bounds::Int { min, max, size } => {
            let inside = |v: u64| match (max - min).checked_add(1) {
                Some(span) => min + v % span,
                None => v,
            };
            let v = match mode {
                0 => [
                    min,
                    max,
                    min.saturating_sub(1),
                    max.saturating_add(1),
                    0,
                    u64::MAX,
                    min.saturating_add(1).min(max),
                    max.saturating_sub(1).max(min),
                ][(n % 8) as usize],
                1 => inside(spread),
                2 if !size => {
                    let v = inside(spread);
                    if v < 2 {
                        v
                    } else if 1 << v.ilog2() >= min {
                        1 << v.ilog2()
                    } else {
                        v
                    }
                }
                2 => inside(spread),
                _ if n & 1 == 0 && min > 0 => min - 1 - spread % min,
                _ => max
                    .saturating_add(1)
                    .saturating_add(spread % (u64::MAX - max).max(1)),
            };
            if mode == 2 && size {
                for (unit, name) in [
                    (1 << 40, "TiB"),
                    (1 << 30, "GiB"),
                    (1 << 20, "MiB"),
                    (1 << 10, "KiB"),
                ] {
                    if v % unit == 0 && v > 0 && n & 64 == 0 {
                        return format!("{}{name}", v / unit);
                    }
                }
            }
            v.to_string()
        }
        Bounds::Float { min, max } => {
            let unit = (n >> 11) as f64 / (1u64 << 53) as f64;
            let span = max - min;
            let f = match mode {
                0 => [
                    min,
                    max,
                    min - span * 1e-9,
                    max + span * 1e-9,
                    0.0,
                    f64::MAX,
                    -0.0,
                    f64::MIN_POSITIVE,
                ][(n % 8) as usize],
                1 | 2 => min + unit * span,
                _ if n & 1 == 0 => min - unit * span.max(1.0) - f64::EPSILON,
                _ => max + unit * span.max(1.0) * 1e6 + span * 1e-9,
            };
            f.to_string()
        }
    }
}

/// `preset,key:value` from raw bytes: byte 0 picks the preset and how the
/// value is written, byte 1 the key of [`KEYS`], bytes 2..10 the value:
/// a whole number, a float of the same bits, a number shifted right by
/// byte 10 (or byte 1 when there is none), a number of gibibytes, or a
/// value chosen in the key's own range ([`value_in`]: its edges, anywhere
/// inside it at any magnitude, inside with a unit, outside), so that every
/// numeric key is tried across its whole range whatever its bounds.
pub fn numeric_conf(data: &[u8]) -> Option<String> {
    numeric_parts(data).map(|(preset, key, value)| format!("{preset},{key}:{value}"))
}

/// [`numeric_conf`]'s preset, key and value.
fn numeric_parts(data: &[u8]) -> Option<(&'static str, &'static str, String)> {
    let raw: [u8; 8] = data.get(2..10)?.try_into().ok()?;
    let n = u64::from_le_bytes(raw);
    let preset = Config::PRESETS[usize::from(data[0]) % Config::PRESETS.len()];
    let key = &KEYS[usize::from(data[1]) % KEYS.len()];
    let shift = data.get(10).copied().unwrap_or(data[1]) % 64;
    let mode = data[0] / 16 % 8;
    let value = match (mode, bounds(&key.kind)) {
        (0, _) => n.to_string(),
        (1, _) => f64::from_bits(n).to_string(),
        (2, _) => (n >> shift).to_string(),
        (3, _) => format!("{}GiB", f64::from_bits(n)),
        (m, Some(b)) => value_in(b, m - 4, n),
        (_, None) => (n >> shift).to_string(),
    };
    Some((preset, key.name, value))
}

/// Checks one configuration string; returns the allocator operations run.
fn check_text(data: &[u8]) -> u64 {
    let text = String::from_utf8_lossy(data);
    let text = text.as_ref();

    if let Err(msg) = parse_size(text) {
        assert!(
            msg.contains(&format!("`{text}`")),
            "parse_size error does not quote its input: {msg}"
        );
    }

    // PyTorch's own configuration string: never a panic, and what it
    // accepts maps onto a configuration that prints and reads back.
    if let Ok(torch) = cachealloc_core::pytorch_conf::PytorchConf::parse(text) {
        let mapped = torch.apply(Config::default(), &[]);
        let conf = mapped.to_conf_string();
        assert_eq!(
            Config::parse(&conf).as_ref(),
            Ok(&mapped),
            "PyTorch's {text:?} maps to {conf:?}, which reads back differently"
        );
    }

    let config = match Config::parse(text) {
        Ok(c) => c,
        Err(e) => {
            let msg = e.to_string();
            let named = match &e {
                ConfigError::UnknownKey(k) => k,
                ConfigError::UnknownPreset(p) => p,
                ConfigError::Syntax(item) if item.is_empty() => {
                    assert!(msg.contains("empty"), "{msg}");
                    return 0;
                }
                ConfigError::Syntax(item) => item,
                ConfigError::BadValue { key, .. } => key,
                ConfigError::Duplicate { key, .. } => key,
            };
            assert!(
                msg.contains(&format!("`{named}`")),
                "{e:?}: the message does not name `{named}`: {msg}"
            );
            return 0;
        }
    };
    let conf = config.to_conf_string();
    let back = Config::parse(&conf)
        .unwrap_or_else(|e| panic!("{text:?} parsed, but its conf string {conf:?} does not: {e}"));
    assert_eq!(back, config, "{text:?} → {conf:?} parses back differently");
    assert_eq!(back.to_conf_string(), conf, "to_conf_string is not stable");

    // The model's final check serves one small request on the emptied
    // allocator, so every segment (and expandable page) size must fit the
    // device: a device of 1 GiB, or four of the largest fixed segment or
    // page where that is larger (the simulated address space holds about
    // 127 TiB). A configuration whose
    // segments fit no device only ever answers out-of-memory, a path the
    // `ops` target covers.
    // (A large request's segment is at least `segment_round`.) The key
    // table bounds every segment and page size to 1 GiB, so no accepted
    // configuration is skipped.
    let mut largest = config
        .small_segment()
        .max(cachealloc_core::MEDIUM_SEGMENT)
        .max(config.segment_round());
    if config.expandable_segments() {
        largest = largest.max(config.expandable_page());
    }
    let setup = Setup {
        config,
        capacity: (1u64 << 30).max(4 * largest),
        streams: 2,
    };
    let ops = fixed_ops();
    if let Err(e) = run_setup(&setup, &ops) {
        panic!("config {text:?} ({conf}): {e}");
    }
    ops.len() as u64
}
