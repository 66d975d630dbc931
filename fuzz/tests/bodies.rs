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
    for preset in ["default", "expandable", "lowmem"] {
        for key in cachealloc_core::config::KEYS {
            for v in &values {
                let conf = format!("{preset},{}:{v}", key.name);
                cachealloc_fuzz::config::check(conf.as_bytes());
            }
        }
    }
    cachealloc_fuzz::config::check(b"expandable,expandable_page_mb:17592186044415");
}
