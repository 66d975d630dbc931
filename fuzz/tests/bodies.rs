//! Runs the fuzz target bodies on stable, without libFuzzer: every seed of
//! the corpus (`fuzz/corpus/<target>/seed-*`), every saved regression input
//! (`fuzz/regressions/<target>/*`), and a few hundred pseudo-random inputs.
//! `cd fuzz && cargo test --release`.

use std::path::Path;

fn inputs(target: &str) -> Vec<(String, Vec<u8>)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut out = Vec::new();
    for dir in [
        root.join("corpus").join(target),
        root.join("regressions").join(target),
    ] {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for e in entries {
            let p = e.unwrap().path();
            let name = p.file_name().unwrap().to_string_lossy().to_string();
            if dir.ends_with(target)
                && dir.parent().unwrap().ends_with("corpus")
                && !name.starts_with("seed-")
            {
                continue; // a fuzzer's own corpus file, not ours
            }
            out.push((p.display().to_string(), std::fs::read(&p).unwrap()));
        }
    }
    out.sort();
    out
}

fn random(n: usize, len: usize, seed: u64) -> Vec<Vec<u8>> {
    let mut s = seed;
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    (0..n)
        .map(|_| {
            let l = next() as usize % len;
            (0..l).map(|_| next() as u8).collect()
        })
        .collect()
}

#[test]
fn ops_seeds_and_random() {
    let seeds = inputs("ops");
    assert!(!seeds.is_empty(), "no ops seeds");
    for (name, data) in seeds {
        cachealloc_fuzz::ops::run(&data).unwrap_or_else(|e| panic!("{name}: {e}"));
    }
    for data in random(300, 1500, 0x9e37_79b9_7f4a_7c15) {
        cachealloc_fuzz::ops::run(&data).unwrap_or_else(|e| panic!("{data:?}: {e}"));
    }
}

#[test]
fn trace_seeds_and_random() {
    let seeds = inputs("trace");
    assert!(!seeds.is_empty(), "no trace seeds");
    for (_, data) in seeds {
        cachealloc_fuzz::trace::check(&data);
    }
    for data in random(300, 400, 7) {
        cachealloc_fuzz::trace::check(&data);
    }
}

#[test]
fn config_seeds_and_random() {
    let seeds = inputs("config");
    assert!(!seeds.is_empty(), "no config seeds");
    for (_, data) in seeds {
        cachealloc_fuzz::config::check(&data);
    }
    for data in random(300, 80, 11) {
        cachealloc_fuzz::config::check(&data);
    }
}

/// Every key of the table with values across the whole `u64` and `f64`
/// ranges, under every preset: each is refused with a message naming the
/// key, or accepted and then serves the fixed requests. (An expandable page
/// of 2^44 - 1 MiB was once accepted and wrapped to 0, dividing by zero.)
#[test]
fn config_every_key_full_range() {
    let values = [
        "0".to_string(),
        "1".into(),
        "2".into(),
        "17592186044415".into(),
        (u64::MAX / (1 << 20)).to_string(),
        (u64::MAX - 1).to_string(),
        u64::MAX.to_string(),
        "18446744073709551616".into(),
        "-1".into(),
        "0.0".into(),
        "1e308".into(),
        "NaN".into(),
        "inf".into(),
        "-0".into(),
        "5e-324".into(),
        "1.0000000000000002".into(),
    ];
    for preset in ["default", "expandable", "pytorch"] {
        for key in cachealloc_core::keys::KEYS {
            for v in &values {
                let conf = format!("{preset},{}:{v}", key.name);
                cachealloc_fuzz::config::check(conf.as_bytes());
            }
        }
    }
    cachealloc_fuzz::config::check(b"expandable,expandable_page_mb:17592186044415");
}

/// The config target's numeric values reach every numeric key's whole
/// range: both edges accepted, one past each edge rejected, and accepted
/// values of every bit length from the least to the greatest (for real
/// numbers: within 1% of each bound).
#[test]
fn config_numeric_values_cover_every_key_range() {
    use cachealloc_core::keys::KEYS;
    use cachealloc_fuzz::config::{bounds, numeric_conf, Bounds};
    let inputs = random(20_000, 11, 7);
    let mut checked = 0;
    for (k, key) in KEYS.iter().enumerate() {
        let Some(b) = bounds(&key.kind) else {
            continue;
        };
        let (mut accepted, mut rejected_int, mut rejected_f) = (vec![], vec![], vec![]);
        for (i, d) in inputs.iter().enumerate() {
            let mut d = d.clone();
            d.resize(11, 0);
            // Every key, every way of writing the value.
            d[0] = (i % 8 * 16) as u8;
            d[1] = k as u8;
            let text = numeric_conf(&d).unwrap();
            let value = text.split_once(':').unwrap().1;
            // (`default`'s small segments take the largest slabs, so only
            // the key's own bounds can refuse a value.)
            let ok = cachealloc_core::Config::default()
                .set(key.name, value)
                .is_ok();
            match (b, value.parse::<u64>(), value.parse::<f64>()) {
                (Bounds::Int { .. }, Ok(v), _) if ok => accepted.push(v as f64),
                (Bounds::Int { .. }, Ok(v), _) => rejected_int.push(v),
                (Bounds::Float { .. }, _, Ok(f)) if ok => accepted.push(f),
                (Bounds::Float { .. }, _, Ok(f)) => rejected_f.push(f),
                _ => {}
            }
        }
        let name = key.name;
        match b {
            Bounds::Int { min, max, .. } => {
                let has = |v: u64| accepted.contains(&(v as f64));
                assert!(has(min) && has(max), "{name}: {min} or {max} never tried");
                assert!(
                    min == 0 || rejected_int.contains(&(min - 1)),
                    "{name}: below {min}"
                );
                assert!(
                    max == u64::MAX || rejected_int.contains(&(max + 1)),
                    "{name}: above {max}"
                );
                let bits = |v: u64| 64 - v.leading_zeros();
                for l in bits(min)..=bits(max) {
                    assert!(
                        accepted.iter().any(|&v| bits(v as u64) == l),
                        "{name}: no accepted value of {l} bits (range {min} to {max})"
                    );
                }
            }
            Bounds::Float { min, max } => {
                let span = max - min;
                let lo = accepted.iter().copied().fold(f64::INFINITY, f64::min);
                let hi = accepted.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                assert!(
                    lo <= min + span / 100.0 && hi >= max - span / 100.0,
                    "{name}: {lo} to {hi}"
                );
                assert!(
                    rejected_f.iter().any(|&f| f < min) && rejected_f.iter().any(|&f| f > max),
                    "{name}"
                );
            }
        }
        checked += 1;
    }
    assert!(checked >= 10, "only {checked} numeric keys");
}

/// Many streams of a few blocks each (docs/TESTING.md, "Many streams"):
/// a trace over 10,000 streams goes through the trace body under every
/// preset on its 1 GiB device, and replays to its end with no error. (A
/// table of 3,072 size classes per pool once made such traces abort for
/// want of host memory.) The text is the one `scripts/stream-trace.py`
/// writes, whose first 40 streams are `corpus/trace/seed-replay-many-streams`.
#[test]
fn trace_many_streams_under_every_preset() {
    use cachealloc_core::replay::{replay, ReplayOptions};
    use cachealloc_core::{Config, TraceEvent};
    let text = cachealloc_fuzz::trace::many_streams(10_000, 3, 4);
    let events = cachealloc_fuzz::trace::read_core(&text).events;
    assert_eq!(events.len(), 60_000);
    let streams: std::collections::HashSet<u64> = events
        .iter()
        .filter_map(|e| match e {
            TraceEvent::Alloc { stream, .. } => Some(*stream),
            _ => None,
        })
        .collect();
    assert_eq!(streams.len(), 10_000);
    for (i, name) in Config::PRESETS.iter().enumerate() {
        // Mode 3: replayed, under preset i, on time (no lag bit).
        let mut data = vec![3 | (i as u8) << 2];
        data.extend_from_slice(&text);
        assert_eq!(
            cachealloc_fuzz::trace::check_counted(&data),
            60_000,
            "{name}"
        );
        let opts = ReplayOptions {
            capacity: Some(1 << 30),
            ..ReplayOptions::default()
        };
        let config = Config::preset(name).unwrap();
        let r = replay(|| Ok(events.iter().cloned().map(Ok)), &config, opts)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(r.events, 60_000, "{name}");
        assert!(
            r.oom_events.is_empty(),
            "{name}: {} out of memory",
            r.oom_events.len()
        );
    }
    // The committed seed is this trace's start, under the default preset.
    let seed = std::fs::read(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus/trace/seed-replay-many-streams"),
    )
    .unwrap();
    assert_eq!(seed[0], 3);
    assert_eq!(
        &seed[1..],
        &cachealloc_fuzz::trace::many_streams(40, 3, 4)[..]
    );
}
