//! Loading a shipped `.trace.gz` for the policy examples (the CLI has its
//! own reader; these examples depend on the core crate alone).

use cachealloc_core::{TraceEvent, TraceReader};
use std::io::BufReader;
use std::process::{Command, Stdio};

/// Every event of a gzip-compressed trace, through `zcat`. Panics, naming
/// the file, if it cannot be read or parsed.
pub fn load(path: &str) -> Vec<TraceEvent> {
    let mut child = Command::new("zcat")
        .arg(path)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run zcat: {e}"));
    let out = child.stdout.take().expect("piped stdout");
    let events = TraceReader::new(BufReader::new(out))
        .collect::<Result<Vec<_>, _>>()
        .unwrap_or_else(|e| panic!("{path}: {e}"));
    let status = child.wait().expect("zcat exits");
    assert!(status.success(), "{path}: zcat failed ({status})");
    events
}
