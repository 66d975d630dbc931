//! The `trace` target: arbitrary bytes as a trace — an error, never a panic.
//!
//! Byte 0 is the mode, the rest the trace text. Always: the core's
//! [`TraceReader`] reads the text to its end or first error; an error names a
//! line that exists; a trace that reads cleanly writes back (with
//! [`TraceWriter`]) to text that reads back to the same events. Then, by the
//! low two bits of the mode, the text goes through `cachealloc::trace_file`
//! (which only opens paths, so it is written to a scratch file first):
//!
//! - 0: the bytes as they are (plain, or corrupt gzip when they start with
//!   the gzip magic, or a PyTorch memory snapshot pickle when they start
//!   with `80 02`–`80 05`); a plain file reads exactly as the core reader
//!   read it, and a pickle that is no snapshot fails to open, naming the file;
//! - 1: gzip-compressed; reads exactly as the core reader read the text;
//! - 2: gzip-compressed and cut short; must be an error, never a short trace;
//! - 3: the bytes as they are, and a trace that read cleanly is replayed on
//!   a 1 GiB simulated device under a preset chosen by the mode's bits 2–7
//!   (and, with bit 6 set, running 1 + 16 × bits 4–5 events behind the
//!   host): an error (huge sizes, ...) or a result, never a panic.
//!
//! Every error a file gives must start with the file's path.

use cachealloc::trace_file::{self, FileError};
use cachealloc_core::replay::{replay, ReplayOptions};
use cachealloc_core::{Config, TraceError, TraceEvent, TraceReader, TraceWriter};
use flate2::write::GzEncoder;
use flate2::Compression;
use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};

/// What a reader made of a trace: its events up to the first error, and the
/// error's line and kind (`None` if it read cleanly).
#[derive(Debug, PartialEq)]
pub struct Outcome {
    /// Events read before the error (or all of them).
    pub events: Vec<TraceEvent>,
    /// The error's line and a kind tag (`io`, `syntax`, `reused`, `unknown`,
    /// `double-free`; `pickle`, line 0, for a snapshot pickle refused at the open).
    pub error: Option<(u64, &'static str)>,
}

fn kind(e: &TraceError) -> &'static str {
    match e {
        TraceError::Io { .. } => "io",
        TraceError::Syntax { .. } => "syntax",
        TraceError::IdReused { .. } => "reused",
        TraceError::UnknownId { .. } => "unknown",
        TraceError::DoubleFree { .. } => "double-free",
    }
}

/// Reads `text` with the core's reader, checking what holds for any error.
pub fn read_core(text: &[u8]) -> Outcome {
    let mut reader = TraceReader::new(text);
    let mut events = Vec::new();
    let lines = text.split(|&b| b == b'\n').count() as u64;
    loop {
        match reader.next_event() {
            Ok(Some(e)) => events.push(e),
            Ok(None) => {
                return Outcome {
                    events,
                    error: None,
                }
            }
            Err(e) => {
                let line = e.line();
                assert!(
                    line >= 1 && line <= lines,
                    "error on line {line} of a text of {lines} lines: {e}"
                );
                let msg = e.to_string();
                assert!(
                    msg.starts_with(&format!("line {line}: ")),
                    "the message does not name the line: {msg}"
                );
                return Outcome {
                    events,
                    error: Some((line, kind(&e))),
                };
            }
        }
    }
}

/// A scratch file of its own for one check (test threads run checks side by
/// side), removed when the check ends, however it ends.
struct Scratch(PathBuf);

impl Scratch {
    fn new() -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        Scratch(
            std::env::temp_dir().join(format!("cachealloc-fuzz-trace-{}-{n}", std::process::id())),
        )
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Reads the file at `path` with `trace_file`, checking that errors name the file.
pub fn read_file(path: &std::path::Path) -> Outcome {
    let mut events = Vec::new();
    let check = |e: &FileError| {
        let msg = e.to_string();
        assert!(
            msg.starts_with(&format!("{}: ", path.display())),
            "the message does not name the file: {msg}"
        );
    };
    let mut reader = match trace_file::open(path) {
        Ok(r) => r,
        Err(e) => {
            check(&e);
            let head = std::fs::read(path).expect("the scratch file");
            assert!(
                cachealloc::pickle_trace::is_pickle(&head),
                "a readable scratch file failed to open: {e}"
            );
            // A pickle that is no memory snapshot: refused at the open.
            return Outcome {
                events: Vec::new(),
                error: Some((0, "pickle")),
            };
        }
    };
    loop {
        match reader.next_event() {
            Ok(Some(e)) => events.push(e),
            Ok(None) => {
                return Outcome {
                    events,
                    error: None,
                }
            }
            Err(e) => {
                check(&e);
                let te = e
                    .trace_error()
                    .expect("a content error carries the reader's error");
                return Outcome {
                    events,
                    error: Some((te.line(), kind(te))),
                };
            }
        }
    }
}

/// The sizes [`many_streams`] cycles through: small-pool, large-pool and
/// above-`large_threshold` requests.
const STREAM_SIZES: [u64; 8] = [
    4096,
    100_000,
    786_432,
    1_500_000,
    3 << 20,
    12 << 20,
    512,
    40_000,
];

/// A trace over many streams, each holding a few blocks: the text
/// `scripts/stream-trace.py STREAMS --blocks BLOCKS --live LIVE` writes.
/// Stream s (ids 1..=`streams`) allocates `blocks` blocks, freed once the
/// next `live` streams have allocated theirs.
pub fn many_streams(streams: u64, blocks: u64, live: usize) -> Vec<u8> {
    let mut out =
        format!("# {streams} streams, {blocks} blocks each, {live} streams live at once\n");
    let mut held: std::collections::VecDeque<Vec<u64>> = Default::default();
    let (mut free_ids, mut next_id) = (Vec::new(), 0u64);
    let free = |ids: Vec<u64>, out: &mut String, free_ids: &mut Vec<u64>| {
        for i in ids {
            out.push_str(&format!("f {i}\n"));
            free_ids.push(i);
        }
    };
    for s in 1..=streams {
        let mut ids = Vec::new();
        for b in 0..blocks {
            let i = free_ids.pop().unwrap_or_else(|| {
                next_id += 1;
                next_id - 1
            });
            let size = STREAM_SIZES[((s * 3 + b * 5) % 8) as usize] + 512 * (s % 7);
            out.push_str(&format!("a {i} {size} {s}\n"));
            ids.push(i);
        }
        held.push_back(ids);
        if held.len() > live {
            let ids = held.pop_front().expect("more than `live` held");
            free(ids, &mut out, &mut free_ids);
        }
    }
    for ids in held {
        free(ids, &mut out, &mut free_ids);
    }
    out.into_bytes()
}

fn gzip(text: &[u8]) -> Vec<u8> {
    let mut enc = GzEncoder::new(Vec::new(), Compression::fast());
    enc.write_all(text).expect("in-memory write");
    enc.finish().expect("in-memory gzip")
}

/// The whole body of the `trace` target.
pub fn check(data: &[u8]) {
    check_counted(data);
}

/// [`check`], returning the number of trace events replayed on an
/// allocator (0 unless the input asks for a replay and reads cleanly).
pub fn check_counted(data: &[u8]) -> u64 {
    let Some((&mode, text)) = data.split_first() else {
        return 0;
    };
    let core = read_core(text);

    // A clean trace writes back to text that reads back the same.
    if core.error.is_none() {
        let mut w = TraceWriter::new(Vec::new()).expect("in-memory writer");
        for e in &core.events {
            w.write(e).expect("in-memory write");
        }
        let out = w.finish().expect("in-memory writer");
        let again = read_core(&out);
        assert_eq!(
            again,
            core,
            "written back as {:?}",
            String::from_utf8_lossy(&out)
        );
    }

    let scratch = Scratch::new();
    let path = &scratch.0;
    let file = match mode & 3 {
        1 | 2 => gzip(text),
        _ => text.to_vec(),
    };
    let file = if mode & 3 == 2 && file.len() > 2 {
        // Cut somewhere in [2, len): the magic stays, the data ends early.
        let cut = 2 + usize::from(mode >> 2) * (file.len() - 2) / 64;
        file[..cut.min(file.len() - 1)].to_vec()
    } else {
        file
    };
    std::fs::write(path, &file).expect("scratch file");
    let got = read_file(path);
    match mode & 3 {
        0 | 3
            if !file.starts_with(&[0x1f, 0x8b]) && !cachealloc::pickle_trace::is_pickle(&file) =>
        {
            assert_eq!(
                got, core,
                "a plain file reads as the core reader reads its text"
            )
        }
        1 => assert_eq!(
            got, core,
            "a gzip file reads as the core reader reads its text"
        ),
        2 => assert!(
            got.error.is_some(),
            "a gzip file cut at {} of {} bytes read as a complete trace of {} events",
            file.len(),
            gzip(text).len(),
            got.events.len()
        ),
        _ => {}
    }

    if mode & 3 == 3 && core.error.is_none() {
        let presets = Config::PRESETS;
        let name = presets[usize::from(mode >> 2) % presets.len()];
        let config = Config::preset(name).expect("a named preset");
        let opts = ReplayOptions {
            capacity: Some(1 << 30),
            // Some replays on a device that runs behind the host.
            gpu_lag: (mode & 0x40 != 0).then(|| 1 + u64::from(mode >> 4 & 3) * 16),
            timeline_points: 16,
            report_at_peak: true,
            progress: None,
        };
        let events = &core.events;
        let _ = replay(|| Ok(events.iter().cloned().map(Ok)), &config, opts);
        return events.len() as u64;
    }
    0
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each check writes a file of its own and leaves nothing behind.
    #[test]
    fn scratch_files_are_distinct_and_removed() {
        let (a, b) = (Scratch::new(), Scratch::new());
        assert_ne!(a.0, b.0);
        std::fs::write(&a.0, b"a 1 512 0\n").unwrap();
        let path = a.0.clone();
        drop(a);
        assert!(!path.exists(), "{} left behind", path.display());
    }
}
