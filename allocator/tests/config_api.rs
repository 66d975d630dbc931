//! The public interface of `Config` from outside the crate: presets, the
//! builder, `set` / `get` by key name, and the key table that checks them
//! all (Note [Config's fields are the crate's] in `config/builder.rs`).

use cachealloc_core::keys::{KeyKind, Stability, KEYS};
use cachealloc_core::{Config, ConfigError, MemoryCap, POWER2_INTERVALS};

const MIB: u64 = 1 << 20;

/// The error the parser gives for `conf`.
fn parse_error(conf: &str) -> ConfigError {
    Config::parse(conf).expect_err(conf)
}

#[test]
fn presets_by_constructor_by_name_and_by_string_agree() {
    let constructors = [
        ("default", Config::default()),
        ("segments", Config::segments()),
        ("pytorch", Config::pytorch()),
        ("expandable", Config::expandable()),
        ("no-caching", Config::no_caching()),
    ];
    let names: Vec<&str> = constructors.iter().map(|(n, _)| *n).collect();
    assert_eq!(names, Config::PRESETS);
    for (name, config) in constructors {
        assert_eq!(config.name(), name);
        assert_eq!(Config::preset(name).as_ref(), Some(&config), "{name}");
        assert_eq!(Config::parse(name).as_ref(), Ok(&config), "{name}");
        assert_eq!(config.clone().into_builder().build(), Ok(config.clone()));
        let text = config.to_conf_string();
        assert_eq!(Config::parse(&text), Ok(config), "{text}");
    }
    assert_eq!(Config::builder().build(), Ok(Config::default()));
    assert_eq!(Config::preset("bogus"), None);
    assert_eq!(
        Config::parse("bogus").unwrap_err().to_string(),
        "unknown configuration `bogus` (presets: default, segments, pytorch, expandable, \
         no-caching; or key:value,…)"
    );
    // What a preset is, read through the accessors.
    let (pytorch, default) = (Config::pytorch(), Config::default());
    assert!(!pytorch.expandable_segments() && default.expandable_segments());
    assert!(!pytorch.oom_other_kinds() && default.oom_other_kinds());
    assert_eq!(pytorch.max_split_size(), u64::MAX);
    assert_eq!(pytorch.memory_cap(), None);
    assert!(!Config::no_caching().caching());
}

#[test]
fn typed_setters_read_back_through_the_accessors() {
    let divisions = [4; POWER2_INTERVALS];
    let c = Config::pytorch()
        .into_builder()
        .caching(true)
        .small_segment(4 * MIB)
        .large_threshold(10 * MIB)
        .segment_round(4 * MIB)
        .large_split_remainder(2 * MIB)
        .huge_size(512 * MIB)
        .max_split_size(64 * MIB)
        .max_non_split_rounding(40 * MIB)
        .roundup_power2_divisions(divisions)
        .garbage_collection_threshold(Some(0.75))
        .memory_cap(Some(MemoryCap::Bytes(8 << 30)))
        .expandable_segments(true)
        .expandable_page(16 * MIB)
        .borrow_holes(true)
        .oom_other_kinds(true)
        .thread_cache(8)
        .slab_max(64 << 10)
        .build()
        .unwrap();
    assert_eq!(c.name(), "pytorch");
    assert!(c.caching());
    assert_eq!(c.small_segment(), 4 * MIB);
    assert_eq!(c.large_threshold(), 10 * MIB);
    assert_eq!(c.segment_round(), 4 * MIB);
    assert_eq!(c.large_split_remainder(), 2 * MIB);
    assert_eq!(c.huge_size(), 512 * MIB);
    assert_eq!(c.max_split_size(), 64 * MIB);
    assert_eq!(c.max_non_split_rounding(), 40 * MIB);
    assert_eq!(c.roundup_power2_divisions(), &divisions);
    assert_eq!(c.garbage_collection_threshold(), Some(0.75));
    assert_eq!(c.memory_cap(), Some(MemoryCap::Bytes(8 << 30)));
    assert!(c.expandable_segments());
    assert_eq!(c.expandable_page(), 16 * MIB);
    assert!(c.borrow_holes());
    assert!(c.oom_other_kinds());
    assert_eq!(c.thread_cache(), 8);
    assert_eq!(c.slab_max(), 64 << 10);
    // The same configuration as the string that sets the same keys.
    let text = "pytorch,caching:True,small_segment_mb:4,large_threshold_mb:10,\
                segment_round_mb:4,large_split_remainder_mb:2,huge_size_mb:512,\
                max_split_size_mb:64,max_non_split_rounding_mb:40,\
                roundup_power2_divisions:4,garbage_collection_threshold:0.75,\
                memory_cap:8GiB,expandable_segments:True,expandable_page_mb:16,\
                borrow_holes:True,oom_other_kinds:True,thread_cache:8,slab_max_kb:64";
    assert_eq!(Config::parse(text), Ok(c.clone()));
    assert_eq!(Config::parse(&c.to_conf_string()), Ok(c));
}

#[test]
fn builder_later_setters_win_and_optional_keys_clear() {
    let c = Config::builder()
        .max_split_size(64 * MIB)
        .max_split_size(u64::MAX)
        .memory_cap(Some(MemoryCap::Fraction(0.5)))
        .memory_cap(Some(MemoryCap::Bytes(1 << 30)))
        .garbage_collection_threshold(Some(0.5))
        .build()
        .unwrap();
    assert_eq!(c.max_split_size(), u64::MAX);
    assert_eq!(c.memory_cap(), Some(MemoryCap::Bytes(1 << 30)));
    assert_eq!(
        c.get("max_split_size_mb").unwrap().as_deref(),
        Some("unlimited")
    );
    assert_eq!(c.get("per_process_memory_fraction").unwrap(), None);
    let cleared = c
        .into_builder()
        .memory_cap(None)
        .garbage_collection_threshold(None)
        .build()
        .unwrap();
    assert_eq!(cleared.memory_cap(), None);
    assert_eq!(cleared.garbage_collection_threshold(), None);
    assert_eq!(cleared.get("memory_cap").unwrap(), None);
}

#[test]
fn builder_refuses_what_the_parser_refuses_with_the_same_error() {
    let cases: Vec<(Result<Config, ConfigError>, String)> = vec![
        (
            Config::builder().max_split_size(10 * MIB).build(),
            "max_split_size_mb:10".into(),
        ),
        (
            // Not a whole number of MiB: written as the fraction it is.
            Config::builder().max_split_size(41 * MIB / 2).build(),
            "max_split_size_mb:20.5".into(),
        ),
        (
            Config::builder().small_segment(0).build(),
            "small_segment_mb:0".into(),
        ),
        (
            Config::builder().thread_cache(5000).build(),
            "thread_cache:5000".into(),
        ),
        (
            Config::builder()
                .garbage_collection_threshold(Some(1.0))
                .build(),
            "garbage_collection_threshold:1".into(),
        ),
        (
            Config::builder()
                .garbage_collection_threshold(Some(f64::NAN))
                .build(),
            "garbage_collection_threshold:NaN".into(),
        ),
        (
            Config::builder()
                .memory_cap(Some(MemoryCap::Fraction(0.0)))
                .build(),
            "per_process_memory_fraction:0".into(),
        ),
        (
            Config::builder()
                .memory_cap(Some(MemoryCap::Bytes(MIB)))
                .build(),
            "memory_cap:1048576".into(),
        ),
        (
            Config::builder()
                .roundup_power2_divisions([3; POWER2_INTERVALS])
                .build(),
            format!(
                "roundup_power2_divisions:[{}]",
                (0..POWER2_INTERVALS)
                    .map(|i| format!("{}:3", 1u64 << i))
                    .collect::<Vec<_>>()
                    .join(",")
            ),
        ),
        (
            // A limit between keys, checked at `build`.
            Config::builder().small_segment(MIB).slab_max(MIB).build(),
            "small_segment_mb:1,slab_max_kb:1024".into(),
        ),
        (
            // The first value refused is the one reported.
            Config::builder()
                .thread_cache(5000)
                .max_split_size(MIB)
                .build(),
            "thread_cache:5000".into(),
        ),
        (
            Config::builder().set("expandable_shadows", "maybe").build(),
            "expandable_shadows:maybe".into(),
        ),
        (
            Config::builder().set("bogus", "1").build(),
            "bogus:1".into(),
        ),
    ];
    for (built, conf) in cases {
        assert_eq!(built, Err(parse_error(&conf)), "{conf}");
    }
    assert_eq!(
        Config::builder()
            .max_split_size(10 * MIB)
            .build()
            .unwrap_err()
            .to_string(),
        "bad value `10` for `max_split_size_mb`: must be from 20 to 1073741824 MiB or unlimited"
    );
    assert_eq!(
        Config::builder()
            .max_split_size(41 * MIB / 2)
            .build()
            .unwrap_err()
            .to_string(),
        "bad value `20.5` for `max_split_size_mb`: expected a whole number of MiB from 20 to \
         1073741824 or unlimited"
    );
}

#[test]
fn set_and_get_by_key_name() {
    let mut c = Config::pytorch();
    c.set("max_split_size_mb", "64").unwrap();
    assert_eq!(c.max_split_size(), 64 * MIB);
    assert_eq!(c.get("max_split_size_mb").unwrap().as_deref(), Some("64"));
    // An experimental key: by name only.
    c.set("expandable_edges", "small").unwrap();
    assert_eq!(c.get("expandable_edges").unwrap().as_deref(), Some("small"));
    // An alias sets its key; the two keys of the memory cap share a field.
    c.set("memory_fraction", "0.25").unwrap();
    assert_eq!(c.memory_cap(), Some(MemoryCap::Fraction(0.25)));
    assert_eq!(
        c.get("per_process_memory_fraction").unwrap().as_deref(),
        Some("0.25")
    );
    assert_eq!(c.get("memory_cap").unwrap(), None);
    c.set("memory_cap", "2GiB").unwrap();
    assert_eq!(c.memory_cap(), Some(MemoryCap::Bytes(2 << 30)));
    assert_eq!(c.get("memory_cap").unwrap().as_deref(), Some("2147483648"));
    // PyTorch's keys without effect here are accepted and print nothing.
    c.set("backend", "native").unwrap();
    assert_eq!(c.get("backend").unwrap(), None);
    // `set` is `parse` of the same key on the same configuration.
    let parsed = Config::parse(
        "pytorch,max_split_size_mb:64,expandable_edges:small,memory_cap:2GiB,backend:native",
    )
    .unwrap();
    assert_eq!(c, parsed);
}

#[test]
fn set_refuses_with_the_parsers_error_and_changes_nothing() {
    let before = Config::default();
    let mut c = before.clone();
    let e = c.set("bogus", "1").unwrap_err();
    assert_eq!(e, ConfigError::UnknownKey("bogus".into()));
    assert!(
        e.to_string()
            .starts_with("unknown configuration key `bogus` (known: max_split_size_mb, "),
        "{e}"
    );
    let e = c.set("thread_cache", "lots").unwrap_err();
    assert_eq!(e, parse_error("thread_cache:lots"));
    assert_eq!(
        e.to_string(),
        "bad value `lots` for `thread_cache`: expected a whole number from 0 to 1024"
    );
    let e = c.set("expandable_slack", "-1").unwrap_err();
    assert_eq!(e, parse_error("expandable_slack:-1"));
    assert_eq!(
        e.to_string(),
        "bad value `-1` for `expandable_slack`: must be in [0, 100]"
    );
    // A value within its key's bounds that breaks a limit between keys.
    let e = c
        .set("small_segment_mb", "1")
        .and(c.set("slab_max_kb", "1024"));
    assert_eq!(e, Err(parse_error("small_segment_mb:1,slab_max_kb:1024")));
    assert_eq!(c.small_segment(), MIB, "the first set took");
    assert_eq!(c.slab_max(), 0, "the refused one did not");
    c.set("small_segment_mb", "2").unwrap();
    assert_eq!(c, before, "nothing else changed");
    let e = c.get("bogus").unwrap_err();
    assert_eq!(e, ConfigError::UnknownKey("bogus".into()));
}

/// A value of `kind` other than `current` (when it has another), written as
/// [`Config::get`] prints it.
fn another_value(kind: &KeyKind, current: Option<&str>) -> Vec<String> {
    let candidates: Vec<String> = match *kind {
        KeyKind::Bool => vec!["True".into(), "False".into()],
        KeyKind::Count { min, max, .. } => vec![min.to_string(), max.to_string()],
        KeyKind::Bytes {
            min,
            max,
            unlimited,
            ..
        } => {
            let mut v = vec![min.to_string(), max.to_string()];
            if unlimited {
                v.push("unlimited".into());
            }
            v
        }
        KeyKind::Size { min, max } => vec![min.to_string(), max.to_string()],
        KeyKind::Number {
            min,
            min_included,
            max,
            max_included,
        } => {
            let mut v = vec![((min + max) / 2.0).to_string()];
            if min_included {
                v.push(min.to_string());
            }
            if max_included {
                v.push(max.to_string());
            }
            v
        }
        KeyKind::Choice(words) => words.iter().map(|w| w.to_string()).collect(),
        KeyKind::Divisions => [0, 1, 4]
            .iter()
            .map(|d| {
                let list: Vec<String> = (0..POWER2_INTERVALS)
                    .map(|i| format!("{}:{d}", 1u64 << i))
                    .collect();
                format!("[{}]", list.join(","))
            })
            .collect(),
    };
    candidates
        .into_iter()
        .filter(|v| Some(v.as_str()) != current)
        .collect()
}

/// Every key of the table, on every preset: `get` prints a value that
/// `set` reads back unchanged, and every other value tried is set and
/// printed back identically (the keys PyTorch has and we ignore are
/// accepted and print nothing).
#[test]
fn every_key_of_the_table_is_set_and_printed_back_identically() {
    let mut set_values = 0;
    for preset in Config::PRESETS {
        let base = Config::preset(preset).unwrap();
        for key in KEYS {
            let current = base.get(key.name).unwrap();
            if key.stability == Stability::Ignored {
                assert_eq!(current, None, "{}", key.name);
            }
            if let Some(v) = &current {
                let mut c = base.clone();
                c.set(key.name, v).unwrap();
                assert_eq!(
                    c, base,
                    "{preset}: {}:{v} changed the configuration",
                    key.name
                );
            }
            for v in another_value(&key.kind, current.as_deref()) {
                let mut c = base.clone();
                c.set(key.name, &v)
                    .unwrap_or_else(|e| panic!("{preset}: {}:{v}: {e}", key.name));
                let printed = c.get(key.name).unwrap();
                if key.stability == Stability::Ignored {
                    assert_eq!(printed, None, "{}", key.name);
                    assert_eq!(c, base, "{}: an ignored key changed something", key.name);
                } else {
                    assert_eq!(
                        printed.as_deref(),
                        Some(v.as_str()),
                        "{preset}: {}",
                        key.name
                    );
                    assert_ne!(c, base, "{preset}: {}:{v} changed nothing", key.name);
                }
                // The builder's `set`, and the parser, agree with `set`.
                let built = base.clone().into_builder().set(key.name, &v).build();
                assert_eq!(built.as_ref(), Ok(&c), "{}", key.name);
                let parsed = Config::parse(&format!("{preset},{}:{v}", key.name));
                assert_eq!(parsed.as_ref(), Ok(&c), "{}", key.name);
                set_values += 1;
            }
        }
    }
    // Each key is tried with at least one other value on every preset.
    assert!(
        set_values >= Config::PRESETS.len() * KEYS.len(),
        "{set_values}"
    );
}
