//! The `config` target: arbitrary strings into the configuration parser.
//!
//! - [`Config::parse`] returns an error or a configuration, never panics;
//!   an error's message names the offending key, value, item or preset;
//! - a parsed configuration's `to_conf_string()` parses back to an equal
//!   configuration, and writes the same string again;
//! - `parse_size` answers any string with a size or a message quoting it;
//! - an allocator built with any configuration the parser accepts serves a
//!   fixed sequence of requests (small, large, huge, absurd; two streams,
//!   a cross-stream use, `empty_cache`) on a 1 GiB simulated device (larger
//!   where the configuration's segments need it) with every invariant intact, and holds nothing after everything is freed. The
//!   sequence runs under the shared model checker when it covers the
//!   configuration (see [`crate::ops::model_covers`]).

use crate::ops::run_setup;
use cachealloc_core::config::KEYS;
use cachealloc_core::testing::{Op, Setup};
use cachealloc_core::{parse_size, Config, ConfigError};

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
/// spread over the full `u64` and `f64` ranges.
pub fn check(data: &[u8]) {
    check_text(data);
    if let Some(text) = numeric_conf(data) {
        check_text(text.as_bytes());
    }
}

/// `preset,key:value` from raw bytes: byte 0 picks the preset, byte 1 the
/// key of [`KEYS`], bytes 2..10 the value, written as a whole number, as
/// a float of the same bits, or as a number of bytes with a unit.
pub fn numeric_conf(data: &[u8]) -> Option<String> {
    let raw: [u8; 8] = data.get(2..10)?.try_into().ok()?;
    let n = u64::from_le_bytes(raw);
    let preset = Config::PRESETS[usize::from(data[0]) % Config::PRESETS.len()];
    let key = KEYS[usize::from(data[1]) % KEYS.len()].name;
    let value = match data[0] / 16 % 4 {
        0 => n.to_string(),
        1 => f64::from_bits(n).to_string(),
        2 => (n >> (data[1] % 64)).to_string(),
        _ => format!("{}GiB", f64::from_bits(n)),
    };
    Some(format!("{preset},{key}:{value}"))
}

fn check_text(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let text = text.as_ref();

    if let Err(msg) = parse_size(text) {
        assert!(
            msg.contains(&format!("`{text}`")),
            "parse_size error does not quote its input: {msg}"
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
                    return;
                }
                ConfigError::Syntax(item) => item,
                ConfigError::BadValue { key, .. } => key,
                ConfigError::Duplicate { key, .. } => key,
            };
            assert!(
                msg.contains(&format!("`{named}`")),
                "{e:?}: the message does not name `{named}`: {msg}"
            );
            return;
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
        .small_segment
        .max(cachealloc_core::config::MEDIUM_SEGMENT)
        .max(config.segment_round);
    if config.expandable_segments {
        largest = largest.max(config.expandable_page);
    }
    let setup = Setup {
        config,
        capacity: (1u64 << 30).max(4 * largest),
        streams: 2,
    };
    if let Err(e) = run_setup(&setup, &fixed_ops()) {
        panic!("config {text:?} ({conf}): {e}");
    }
}
