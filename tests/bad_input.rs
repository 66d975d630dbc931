//! Bad input to the `cachealloc` command line: every case exits non-zero
//! (1 for a bad file, 2 for a bad argument) with one message that names
//! what was wrong — the file and line, the field, the key and value, the
//! size string — and never a panic.
//!
//! `tests/cli.rs` already covers: a missing file (all commands), a directory,
//! an unknown operation, a free of an unknown id, a truncated gzip file, an
//! unknown preset, a size with an unknown unit, capacity 0, and a plot into
//! a missing directory. This file covers the rest.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn run(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_cachealloc"))
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("the binary runs")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Exit status `code`, no panic, and stderr containing every needle.
#[track_caller]
fn assert_fails(o: &Output, code: i32, needles: &[&str]) {
    let err = stderr(o);
    assert_eq!(
        o.status.code(),
        Some(code),
        "stdout:\n{}\nstderr:\n{err}",
        String::from_utf8_lossy(&o.stdout)
    );
    assert!(!err.contains("panicked"), "{err}");
    for needle in needles {
        assert!(err.contains(needle), "no `{needle}` in:\n{err}");
    }
}

/// A temporary directory removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Self {
        let dir =
            std::env::temp_dir().join(format!("cachealloc-bad-input-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }
    fn file(&self, name: &str, bytes: &[u8]) -> PathBuf {
        let p = self.0.join(name);
        std::fs::write(&p, bytes).unwrap();
        p
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    enc.write_all(bytes).unwrap();
    enc.finish().unwrap()
}

// ---------------------------------------------------------------- traces

/// Malformed trace lines: exit 1, `error: FILE: line N: what`, nothing on stdout.
#[test]
fn malformed_lines_name_the_file_the_line_and_the_field() {
    let dir = TempDir::new("lines");
    let cases: &[(&str, &[u8], &str)] = &[
        (
            "missing field",
            b"a 0 100\n",
            "line 1: `a` is missing its stream",
        ),
        (
            "missing id",
            b"a 0 1 0\nf\n",
            "line 2: `f` is missing its id",
        ),
        (
            "negative size",
            b"a 0 -5 0\n",
            "line 1: size `-5` is not a non-negative integer",
        ),
        (
            "size above 2^64",
            b"a 0 18446744073709551616 0\n",
            "line 1: size `18446744073709551616` is not a non-negative integer",
        ),
        (
            "non-numeric id",
            b"# comment\n\na x 5 0\n",
            "line 3: id `x` is not a non-negative integer",
        ),
        (
            "non-numeric stream",
            b"a 0 5 default\n",
            "line 1: stream `default` is not a non-negative integer",
        ),
        (
            "extra field",
            b"a 0 5 0 9\n",
            "line 1: unexpected extra field `9`",
        ),
        (
            "extra field on e",
            b"e 1\n",
            "line 1: unexpected extra field `1`",
        ),
        (
            "id reused",
            b"a 0 5 0\na 0 6 0\n",
            "line 2: allocation id 0 reused while still live",
        ),
        (
            "double free",
            b"a 0 5 0\nf 0\nf 0\n",
            "line 3: double free of allocation id 0 (freed on line 2)",
        ),
        (
            "binary",
            b"\x00\x01\x02\x89PNG\r\n",
            "line 1: unknown operation",
        ),
        ("invalid UTF-8", b"a 0 5 0\n\xff\xfe\n", "line 2: "),
    ];
    for (i, (what, text, needle)) in cases.iter().enumerate() {
        let p = dir.file(&format!("case{i}.trace"), text);
        let o = run(&["replay", s(&p)]);
        assert_fails(&o, 1, &[&format!("error: {}: {needle}", s(&p))]);
        assert!(o.stdout.is_empty(), "{what}: output on stdout");
        assert_eq!(stderr(&o).lines().count(), 1, "{what}: one message");
    }
}

/// The same errors inside a gzip file: the line is that of the text.
#[test]
fn malformed_gzip_content_names_the_line() {
    let dir = TempDir::new("gzlines");
    let p = dir.file("bad.trace.gz", &gzip(b"a 0 5 0\nf 0\nz 1\n"));
    let o = run(&["replay", s(&p)]);
    assert_fails(
        &o,
        1,
        &[&format!("error: {}: line 3: unknown operation `z`", s(&p))],
    );
}

/// Gzip files that are not gzip: corrupt data, the magic alone.
#[test]
fn corrupt_gzip_is_an_error_naming_the_file() {
    let dir = TempDir::new("gz");
    let good = gzip(&b"a 0 1000 0\nf 0\n".repeat(200));
    let mut flipped = good.clone();
    for b in &mut flipped[20..40] {
        *b ^= 0x55;
    }
    let corrupt = dir.file("corrupt.trace.gz", &flipped);
    let o = run(&["replay", s(&corrupt)]);
    assert_fails(&o, 1, &[&format!("error: {}: line ", s(&corrupt)), "gzip"]);

    let magic = dir.file("magic.trace.gz", &[0x1f, 0x8b]);
    let o = run(&["replay", s(&magic)]);
    assert_fails(
        &o,
        1,
        &[&format!("error: {}: line 1: truncated gzip", s(&magic))],
    );

    // compare and min-capacity report a bad file the same way.
    for cmd in ["compare", "min-capacity"] {
        let o = run(&[cmd, s(&corrupt), "--json"]);
        assert_fails(&o, 1, &[&format!("error: {}: line ", s(&corrupt))]);
    }
}

/// A request no device can hold is an error naming the size, in every command.
#[test]
fn an_allocation_above_one_pib_is_an_error_naming_the_size() {
    let dir = TempDir::new("huge");
    let p = dir.file("huge.trace", b"a 0 18446744073709551615 0\nf 0\n");
    for cmd in ["replay", "compare", "min-capacity"] {
        let o = run(&[cmd, s(&p)]);
        assert_fails(
            &o,
            1,
            &[s(&p), "line 1: size 18446744073709551615 is above 1 PiB"],
        );
    }
}

/// A pickle of 200,000 nested lists (400 KB).
fn deep_pickle() -> Vec<u8> {
    let n = 200_000;
    let mut b = vec![0x80, 4];
    b.resize(2 + n, b']');
    b.resize(2 + 2 * n - 1, b'a');
    b.push(b'.');
    b
}

/// A deeply nested pickle: one line naming the file and the nesting, exit
/// 1, in every command that reads a trace.
#[test]
fn a_deeply_nested_pickle_is_a_one_line_error() {
    let dir = TempDir::new("deep");
    let p = dir.file("deep.pickle", &deep_pickle());
    for cmd in ["replay", "compare", "min-capacity"] {
        let o = run(&[cmd, s(&p)]);
        assert_fails(
            &o,
            1,
            &[&format!(
                "error: {}: cannot open: pickle nested deeper than 10000 levels",
                s(&p)
            )],
        );
        assert_eq!(stderr(&o).lines().count(), 1, "{}", stderr(&o));
    }
}

/// An empty trace, or one of comments only, is a valid trace of no events.
#[test]
fn an_empty_trace_is_zero_events_not_an_error() {
    let dir = TempDir::new("empty");
    for (name, text) in [
        ("empty.trace", &b""[..]),
        ("comments.trace", b"# nothing\n\n"),
    ] {
        let p = dir.file(name, text);
        let o = run(&["replay", s(&p), "--json"]);
        assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        assert_eq!(v["events"], 0);
    }
}

/// An unreadable file (skipped when running as root, who reads anything).
#[test]
fn an_unreadable_file_is_an_error_naming_it() {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let dir = TempDir::new("perm");
        let p = dir.file("secret.trace", b"a 0 5 0\n");
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o000)).unwrap();
        if std::fs::read(&p).is_ok() {
            eprintln!("skipped: running as a user who can read a mode-000 file (root)");
            return;
        }
        let o = run(&["replay", s(&p)]);
        assert_fails(&o, 1, &[&format!("error: {}: permission denied", s(&p))]);
    }
}

// ---------------------------------------------------------------- sizes

/// Bad `--capacity` strings: usage error (2) quoting the string and saying why.
#[test]
fn bad_sizes_are_usage_errors_quoting_the_string() {
    let cases = [
        ("", "is not a size"),
        ("-5", "must be a positive size"),
        ("GiB", "is not a size"),
        ("1.5.5GB", "bad number `1.5.5`"),
        ("1e30", "unknown unit `e30`"),
        ("16 gigs", "unknown unit `gigs`"),
        ("99999999999TiB", "is too large"),
        ("0.4", "more than 0 bytes"),
    ];
    for (size, why) in cases {
        let arg = format!("--capacity={size}");
        let o = run(&["replay", "tests/data/small.trace", &arg]);
        assert_fails(&o, 2, &["--capacity", why]);
        if why != "more than 0 bytes" {
            assert!(stderr(&o).contains(&format!("`{size}`")), "{}", stderr(&o));
        }
    }
    let o = run(&["compare", "tests/data/small.trace", "--capacity", "lots"]);
    assert_fails(&o, 2, &["--capacity", "`lots`"]);
}

// ---------------------------------------------------------------- configs

/// Bad `--config` strings: usage error (2) naming the key, the value and why.
#[test]
fn bad_configs_name_the_key_and_value() {
    let cases: &[(&str, &[&str])] = &[
        ("bogus_key:1", &["unknown configuration key `bogus_key`"]),
        (
            "max_split_size_mb:abc",
            &["bad value `abc` for `max_split_size_mb`", "whole number"],
        ),
        (
            "max_split_size_mb:10",
            &["bad value `10` for `max_split_size_mb`", "from 20 to"],
        ),
        (
            "max_split_size_mb:99999999999999999",
            &["`max_split_size_mb`", "from 20 to"],
        ),
        ("pytorch,nonsense", &["item `nonsense` is not `key:value`"]),
        ("pytorch,pytorch", &["item `pytorch` is not `key:value`"]),
        (
            "garbage_collection_threshold:1.5",
            &["`garbage_collection_threshold`", "(0, 1)"],
        ),
        (
            "per_process_memory_fraction:0",
            &["`per_process_memory_fraction`", "(0, 1]"],
        ),
        (
            "expandable_segments:maybe",
            &["`maybe` for `expandable_segments`", "True or False"],
        ),
        (
            "roundup_power2_divisions:3",
            &["`roundup_power2_divisions`", "power of two"],
        ),
        (
            "roundup_power2_divisions:[3:1]",
            &["`roundup_power2_divisions`", "powers of two"],
        ),
        (
            "memory_cap:12 parsecs",
            &["`memory_cap`", "unknown unit `parsecs`"],
        ),
        ("small_segment_mb:0", &["`small_segment_mb`"]),
        ("backend:cudaMallocAsync", &["`backend`", "native"]),
        (
            "expandable_edges:newest",
            &["`newest` for `expandable_edges`"],
        ),
    ];
    for (conf, needles) in cases {
        let o = run(&["replay", "tests/data/small.trace", "--config", conf]);
        let mut all = vec!["--config"];
        all.extend_from_slice(needles);
        assert_fails(&o, 2, &all);
    }
    // compare and min-capacity parse their configs the same way.
    for cmd in ["compare", "min-capacity"] {
        let o = run(&[
            cmd,
            "tests/data/small.trace",
            "-c",
            "pytorch",
            "-c",
            "bogus_key:1",
        ]);
        assert_fails(&o, 2, &["unknown configuration key `bogus_key`"]);
    }
}

/// A choice key's error lists every value it accepts (the message comes
/// from the key table, as the parser's values do).
#[test]
fn choice_error_lists_every_accepted_value() {
    let o = run(&[
        "replay",
        "tests/data/small.trace",
        "--config",
        "expandable_edges:newest",
    ]);
    assert_fails(&o, 2, &["`newest` for `expandable_edges`"]);
    let err = stderr(&o);
    let words: Vec<&str> = err
        .split(|c: char| !(c.is_alphanumeric() || c == '_'))
        .collect();
    for value in ["pressure", "small", "big"] {
        assert!(words.contains(&value), "`{value}` not listed: {err}");
    }
}

/// `--jobs 0` is a usage error naming the option.
#[test]
fn zero_jobs_is_a_usage_error() {
    for cmd in ["compare", "min-capacity"] {
        let o = run(&[cmd, "tests/data/small.trace", "--jobs", "0"]);
        assert_fails(&o, 2, &["--jobs"]);
    }
}

// ---------------------------------------------------------------- the docs table

/// The bad-input table of `docs/TESTING.md`: each case is run here, and
/// the table must equal what the runs print (`CACHEALLOC_UPDATE_DOCS=1`
/// rewrites it), so that it cannot drift from the program.
#[test]
fn bad_input_table_in_testing_md_matches() {
    let dir = TempDir::new("table");
    let mut long = b"a 1 512 0 #".to_vec();
    long.resize(1 << 20, b'x');
    for (name, text) in [
        ("op.trace", &b"x 1\n"[..]),
        ("double.trace", b"a 1 512 0\nf 1\nf 1\n"),
        ("huge.trace", b"a 1 1125899906842625 0\n"),
        ("pib.trace", b"a 1 1125899906842624 0\nf 1\n"),
        ("long.trace", &long),
        ("ok.trace", b"a 1 512 0\nf 1\n"),
    ] {
        dir.file(name, text);
    }
    dir.file("deep.pickle", &deep_pickle());
    let cases: &[&[&str]] = &[
        &["replay", "missing.trace"],
        &["replay", "op.trace"],
        &["replay", "double.trace"],
        &["replay", "huge.trace"],
        &["replay", "pib.trace", "--json"],
        &["replay", "long.trace"],
        &["replay", "deep.pickle"],
        &["replay", "ok.trace", "--capacity", "-5"],
        &["replay", "ok.trace", "--capacity", "0"],
        &["replay", "ok.trace", "-c", ""],
        &["replay", "ok.trace", "-c", ",,,,"],
        &["replay", "ok.trace", "-c", "caching:True,caching:False"],
        &["replay", "ok.trace", "-c", "memory_cap:0"],
        &["replay", "ok.trace", "-c", "per_process_memory_fraction:0"],
        &[
            "replay",
            "ok.trace",
            "-c",
            "expandable,expandable_page_mb:17592186044415",
        ],
        &["replay", "ok.trace", "-c", "large_threshold_mb:99999"],
        &["replay", "ok.trace", "-c", "bogus:1"],
        &["compare", "ok.trace", "--jobs", "0"],
    ];
    let mut table = String::from(
        "| command | exit | message (first line, cut at 220 characters) |\n|---|---|---|\n",
    );
    for args in cases {
        let o = Command::new(env!("CARGO_BIN_EXE_cachealloc"))
            .args(*args)
            .current_dir(&dir.0)
            .env_remove("CACHEALLOC_CONF")
            .output()
            .unwrap();
        let err = stderr(&o);
        assert!(!err.contains("panicked"), "{err}");
        let mut first = err.lines().next().unwrap_or("").to_string();
        if o.status.success() {
            first = "(none; the request fails as out of memory and is counted)".into();
        }
        if first.chars().count() > 220 {
            first = first.chars().take(220).collect::<String>() + "…";
        }
        let shown: Vec<String> = args
            .iter()
            .map(|a| {
                if a.is_empty() {
                    "\"\"".to_string()
                } else {
                    a.to_string()
                }
            })
            .collect();
        table += &format!(
            "| `cachealloc {}` | {} | {} |\n",
            shown.join(" "),
            o.status.code().unwrap_or(-1),
            first.replace('|', "\\|").replace('`', "'")
        );
    }
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/docs/TESTING.md");
    let doc = std::fs::read_to_string(path).unwrap();
    let (begin, end) = ("<!-- bad-input:begin -->\n", "<!-- bad-input:end -->");
    let a = doc
        .find(begin)
        .expect("TESTING.md has a bad-input:begin marker")
        + begin.len();
    let b = doc
        .find(end)
        .expect("TESTING.md has a bad-input:end marker");
    if std::env::var_os("CACHEALLOC_UPDATE_DOCS").is_some() {
        std::fs::write(path, format!("{}{table}{}", &doc[..a], &doc[b..])).unwrap();
        return;
    }
    assert_eq!(
        &doc[a..b],
        table,
        "docs/TESTING.md's bad-input table is stale: run with CACHEALLOC_UPDATE_DOCS=1"
    );
}
