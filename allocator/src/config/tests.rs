//! Tests of configuration parsing, printing and the key table.

use super::*;

#[test]
fn choice_words_round_trip() {
    for &word in EdgePages::WORDS {
        let v = EdgePages::from_word(word).expect("a listed word");
        assert_eq!(v.word(), word);
    }
    assert_eq!(EdgePages::from_word("huge"), None);
}

#[test]
fn presets_and_keys() {
    let c = Config::parse("pytorch,max_split_size_mb:64,garbage_collection_threshold:0.6").unwrap();
    assert_eq!(c.name, "pytorch");
    assert_eq!(c.max_split_size, 64 * MIB);
    assert_eq!(c.garbage_collection_threshold, Some(0.6));
    assert_eq!(Config::parse("").unwrap(), Config::default());
    assert!(!Config::parse("no-caching").unwrap().caching);
    let c = Config::parse("per_process_memory_fraction:0.5").unwrap();
    assert_eq!(c.memory_cap, Some(MemoryCap::Fraction(0.5)));
    let c = Config::parse("memory_cap:16GiB").unwrap();
    assert_eq!(c.memory_cap, Some(MemoryCap::Bytes(16 << 30)));
}

#[test]
fn errors_name_the_key() {
    let e = Config::parse("max_split_size_mb:abc").unwrap_err();
    assert!(e.to_string().contains("max_split_size_mb"), "{e}");
    let e = Config::parse("bogus_key:1").unwrap_err();
    assert_eq!(e, ConfigError::UnknownKey("bogus_key".into()));
    assert!(matches!(
        Config::parse("nonsense"),
        Err(ConfigError::UnknownPreset(_))
    ));
    assert!(matches!(
        Config::parse("default,nonsense"),
        Err(ConfigError::Syntax(_))
    ));
    assert!(Config::parse("max_split_size_mb:10").is_err());
    assert!(Config::parse("garbage_collection_threshold:1.5").is_err());
    assert!(Config::parse("expandable_segments:maybe").is_err());
    assert!(Config::parse("roundup_power2_divisions:3").is_err());
    assert!(Config::parse("max_split_size_mb:99999999999999999").is_err());
    assert!(Config::parse("small_segment_mb:0").is_err());
}

#[test]
fn divisions() {
    let c = Config::parse("roundup_power2_divisions:4").unwrap();
    assert_eq!(c.roundup_power2_divisions, [4; POWER2_INTERVALS]);
    let c = Config::parse("roundup_power2_divisions:[1:1,2:2,4:4,>:8]").unwrap();
    assert_eq!(&c.roundup_power2_divisions[..4], &[1, 2, 4, 8]);
    assert_eq!(c.roundup_power2_divisions[15], 8);
}

#[test]
fn conf_string_round_trips() {
    for c in [
        Config::default(),
        Config::pytorch(),
        Config::no_caching(),
        Config::parse(
            "pytorch,max_split_size_mb:64,roundup_power2_divisions:[1:1,2:2,>:4],memory_cap:1GiB",
        )
        .unwrap(),
        Config::segments(),
        Config::parse("default,huge_size_mb:unlimited,borrow_holes:True").unwrap(),
        Config::parse("segments,garbage_collection_threshold:0.5,per_process_memory_fraction:0.5")
            .unwrap(),
    ] {
        assert_eq!(Config::parse(&c.to_conf_string()).unwrap(), c);
    }
}

/// Every value a key accepts is bounded: the largest accepted values
/// of every number key parse, one more is refused, and nothing wraps.
#[test]
fn numbers_are_bounded() {
    // An expandable page this large once wrapped to 0 when rounded to
    // the granularity (a division by zero at the first large request).
    assert!(Config::parse("expandable,expandable_page_mb:17592186044415").is_err());
    assert!(Config::parse("expandable,expandable_page_mb:1024").is_ok());
    for key in KEYS {
        let (top, over) = match key.kind {
            KeyKind::Count { max, .. } => (max, max + 1),
            KeyKind::Bytes { max, .. } => (max, max + 1),
            _ => continue,
        };
        let conf = format!("slab_max_kb:0,{}:{top}", key.name);
        if key.name != "slab_max_kb" {
            assert!(Config::parse(&conf).is_ok(), "{conf}");
        }
        let conf = format!("{}:{over}", key.name);
        assert!(Config::parse(&conf).is_err(), "{conf} accepted");
        let conf = format!("{}:{}", key.name, u64::MAX);
        assert!(Config::parse(&conf).is_err(), "{conf} accepted");
    }
}

/// One key sets both recycling limits of expandable segments, and the
/// configuration prints it back.
#[test]
fn expandable_slack_sets_both_limits() {
    let c = Config::parse("expandable,expandable_slack:0.05").unwrap();
    assert_eq!((c.idle_slack, c.idle_slack_hard), (0.05, 0.1));
    let text = c.to_conf_string();
    assert!(text.contains("expandable_slack:0.05"), "{text}");
    assert!(Config::parse("expandable_slack:-0.1").is_err());
}

/// Settings that leave nothing usable are refused, not silently taken.
#[test]
fn unusable_settings_are_refused() {
    for bad in [
        "memory_cap:0",
        "memory_cap:1MiB",
        "memory_cap:2PiB",
        "per_process_memory_fraction:0",
        "per_process_memory_fraction:0.0",
        "per_process_memory_fraction:NaN",
        "per_process_memory_fraction:inf",
        "garbage_collection_threshold:NaN",
        "large_threshold_mb:0",
        "large_threshold_mb:21",
        "segment_round_mb:0",
        "small_segment_mb:99999999",
        "huge_size_mb:0",
        ",,,,",
        "pytorch,",
        "a:1,,b:2",
        "caching:True,caching:False",
        "memory_cap:1GiB,per_process_memory_fraction:0.5",
        "memory_fraction:0.5,per_process_memory_fraction:0.5",
        "release_order:oldest",
        "paged_margin:0.5",
        "medium_segment_mb:20",
        "idle_slack:0.5",
    ] {
        assert!(Config::parse(bad).is_err(), "`{bad}` accepted");
    }
    assert_eq!(
        Config::parse("caching:True,caching:False")
            .unwrap_err()
            .to_string(),
        "configuration key `caching` is given twice"
    );
    assert!(Config::parse(",,,,")
        .unwrap_err()
        .to_string()
        .contains("empty"));
    assert_eq!(Config::parse("  ").unwrap(), Config::default());
}

/// The unknown-key message lists the table's keys, so it cannot go stale.
#[test]
fn unknown_key_lists_the_table() {
    let e = Config::parse("bogus:1").unwrap_err().to_string();
    for key in KEYS {
        assert!(e.contains(key.name), "{e} lacks {}", key.name);
    }
}

/// The presets print every key with a value and read back equal.
#[test]
fn presets_round_trip_through_the_table() {
    for p in Config::PRESETS {
        let c = Config::preset(p).unwrap();
        let s = c.to_conf_string();
        assert!(s.starts_with(p));
        assert_eq!(Config::parse(&s).unwrap(), c, "{s}");
    }
}

/// `default` is `segments` with expandable segments, and `expandable`
/// is `default` by another name; no preset gives segments back on its
/// own (see the notes on [`Config::segments`]).
#[test]
fn default_is_segments_with_expandable_segments() {
    let d = Config::default();
    assert!(d.expandable_segments);
    let plain = Config::parse("default,expandable_segments:False").unwrap();
    assert_eq!(
        Config {
            name: "segments".into(),
            ..plain
        },
        Config::segments()
    );
    assert!(!Config::segments().expandable_segments);
    assert_eq!(
        Config {
            name: "default".into(),
            ..Config::expandable()
        },
        d
    );
    assert!(
        !Config::segments().borrow_holes,
        "cross-stream waits are opt-in"
    );
}

/// The printed configuration stays small: the key table is the public
/// surface of the policy.
#[test]
fn printed_configuration_has_at_most_24_keys() {
    for p in Config::PRESETS {
        let c = Config::preset(p).unwrap();
        let printed: Vec<&str> = KEYS
            .iter()
            .filter(|k| (k.get)(&c).is_some())
            .map(|k| k.name)
            .collect();
        let text = c.to_conf_string();
        assert!(printed.iter().all(|k| text.contains(&format!("{k}:"))));
        assert!(printed.len() <= 24, "{p}: {} keys: {text}", printed.len());
    }
    assert!(KEYS.len() <= 32, "{} keys in the table", KEYS.len());
}

/// `docs/POLICY.md`'s key table is the one [`keys_markdown`] generates
/// (`CACHEALLOC_UPDATE_DOCS=1` rewrites it).
#[test]
fn docs_key_table_matches() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/POLICY.md");
    let doc = std::fs::read_to_string(path).unwrap();
    let (begin, end) = ("<!-- keys:begin -->\n", "<!-- keys:end -->");
    let a = doc.find(begin).expect("POLICY.md has a keys:begin marker") + begin.len();
    let b = doc.find(end).expect("POLICY.md has a keys:end marker");
    let table = keys_markdown();
    if std::env::var_os("CACHEALLOC_UPDATE_DOCS").is_some() {
        std::fs::write(path, format!("{}{table}{}", &doc[..a], &doc[b..])).unwrap();
        return;
    }
    assert_eq!(
        &doc[a..b],
        table,
        "docs/POLICY.md's key table is stale: run with CACHEALLOC_UPDATE_DOCS=1"
    );
}

#[test]
fn pytorchs_expandable_segments_apply_unless_cachealloc_conf_sets_them() {
    let off = Some("expandable_segments:False");
    let c = with_pytorch_conf(Config::default(), None, off).unwrap();
    assert!(!c.expandable_segments);
    assert_eq!(
        Config {
            name: "segments".into(),
            ..c
        },
        Config::segments()
    );
    let own = "default,expandable_segments:True";
    let c = with_pytorch_conf(Config::parse(own).unwrap(), Some(own), off).unwrap();
    assert!(c.expandable_segments, "CACHEALLOC_CONF wins");
    let c = with_pytorch_conf(
        Config::segments(),
        Some("segments"),
        Some("max_split_size_mb:64, expandable_segments:True"),
    )
    .unwrap();
    assert!(c.expandable_segments);
    assert_eq!(c.max_split_size, 64 << 20);
    assert_eq!(
        with_pytorch_conf(Config::default(), None, None).unwrap(),
        Config::default()
    );
    assert_eq!(
        with_pytorch_conf(Config::default(), None, Some("backend:native")).unwrap(),
        Config::default()
    );
    let e =
        with_pytorch_conf(Config::default(), None, Some("expandable_segments:maybe")).unwrap_err();
    assert!(e.to_string().contains("Expected 'True' or 'False'"), "{e}");
}

#[test]
fn sizes() {
    assert_eq!(parse_size("16GiB"), Ok(16 << 30));
    assert_eq!(parse_size("512MB"), Ok(512_000_000));
    assert_eq!(parse_size("1048576"), Ok(1 << 20));
    assert_eq!(parse_size("1.5 GiB"), Ok(3 << 29));
    assert!(parse_size("").is_err());
    assert!(parse_size("12 parsecs").is_err());
    assert!(parse_size("GiB").is_err());
    assert!(parse_size("1e30").is_err());
    assert!(parse_size("99999999999TiB").is_err());
}

/// Every stable key has a typed setter on the builder, and only stable keys
/// do (Note [Config's fields are the crate's]).
#[test]
fn typed_setters_are_the_stable_keys() {
    let mut stable: Vec<&str> = KEYS
        .iter()
        .filter(|k| k.stability == Stability::Stable)
        .map(|k| k.name)
        .collect();
    let mut typed = builder::TYPED_KEYS.to_vec();
    stable.sort_unstable();
    typed.sort_unstable();
    assert_eq!(typed, stable);
}
