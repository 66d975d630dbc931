//! The plain trace format: one event per line, streamed in both directions.
//!
//! ```text
//! a <id> <bytes> <stream>   allocate <bytes>; <id> names it until it is freed
//! f <id>                    free the allocation <id>
//! e                         empty_cache()
//! ```
//!
//! `#` starts a comment. The reader checks ids as it goes (an id reused
//! while live, a free of an unknown id) and names the line of any error.

use crate::fasthash::FastMap;
use std::fmt;
use std::io::{self, BufRead, Read, Write};

/// One trace event.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum TraceEvent {
    /// Allocate `bytes` on `stream`, called `id` until freed.
    Alloc {
        /// Name of the allocation.
        id: u64,
        /// Requested bytes.
        bytes: u64,
        /// Stream id (0 = default stream).
        stream: u64,
    },
    /// Free allocation `id`.
    Free {
        /// Name of the allocation.
        id: u64,
    },
    /// `empty_cache()`.
    EmptyCache,
}

impl fmt::Display for TraceEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            TraceEvent::Alloc { id, bytes, stream } => write!(f, "a {id} {bytes} {stream}"),
            TraceEvent::Free { id } => write!(f, "f {id}"),
            TraceEvent::EmptyCache => write!(f, "e"),
        }
    }
}

/// What is wrong with a trace, and on which line (1-based).
#[derive(Debug)]
pub enum TraceError {
    /// Reading failed (including a truncated or corrupt gzip stream).
    Io {
        /// Line being read.
        line: u64,
        /// The cause.
        source: io::Error,
    },
    /// A line that is not a valid event.
    Syntax {
        /// Line number.
        line: u64,
        /// What is wrong.
        message: String,
    },
    /// `a` with an id that is still live.
    IdReused {
        /// Line number.
        line: u64,
        /// The id.
        id: u64,
    },
    /// `f` of an id that was allocated and already freed.
    DoubleFree {
        /// Line number.
        line: u64,
        /// The id.
        id: u64,
        /// The line of the first free.
        freed_on: u64,
    },
    /// `f` of an id that is not live.
    UnknownId {
        /// Line number.
        line: u64,
        /// The id.
        id: u64,
    },
}

impl TraceError {
    /// The line the error is on.
    pub fn line(&self) -> u64 {
        match self {
            TraceError::Io { line, .. }
            | TraceError::Syntax { line, .. }
            | TraceError::IdReused { line, .. }
            | TraceError::DoubleFree { line, .. }
            | TraceError::UnknownId { line, .. } => *line,
        }
    }
}

impl fmt::Display for TraceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TraceError::Io { line, source } => write!(f, "line {line}: read error: {source}"),
            TraceError::Syntax { line, message } => write!(f, "line {line}: {message}"),
            TraceError::IdReused { line, id } => {
                write!(f, "line {line}: allocation id {id} reused while still live")
            }
            TraceError::DoubleFree { line, id, freed_on } => write!(
                f,
                "line {line}: double free of allocation id {id} (freed on line {freed_on})"
            ),
            TraceError::UnknownId { line, id } => {
                write!(f, "line {line}: free of unknown allocation id {id}")
            }
        }
    }
}

impl std::error::Error for TraceError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            TraceError::Io { source, .. } => Some(source),
            _ => None,
        }
    }
}

/// The longest line a trace may have (an event line is under 70 bytes; the
/// rest is room for comments). A longer one is an error as soon as this
/// much has been read, so a corrupt file cannot make the reader hold a
/// line of unbounded size.
pub const MAX_LINE_BYTES: usize = 4096;

/// Streams events out of any buffered reader, validating ids as it goes.
pub struct TraceReader<R> {
    input: R,
    line: u64,
    buf: Vec<u8>,
    live: FastMap<u64, ()>,
    /// The last [`FREED_KEPT`] frees as (id, line), a ring searched only when
    /// a free names an id that is not live: to tell a double free from a
    /// free of an id never allocated, at the cost of one store per free.
    freed: Vec<(u64, u64)>,
    /// Next slot of `freed` to overwrite once it is full.
    freed_next: usize,
}

/// Frees remembered to recognise a double free (older ones are reported as
/// frees of an unknown id).
pub const FREED_KEPT: usize = 1 << 16;

impl<R: BufRead> TraceReader<R> {
    /// A reader over `input`.
    pub fn new(input: R) -> Self {
        TraceReader {
            input,
            line: 0,
            buf: Vec::with_capacity(64),
            live: FastMap::default(),
            freed: Vec::new(),
            freed_next: 0,
        }
    }

    /// The number of the last line read.
    pub fn line(&self) -> u64 {
        self.line
    }

    /// Ids allocated and not yet freed so far.
    pub fn live(&self) -> usize {
        self.live.len()
    }

    /// The next event, `Ok(None)` at the end.
    pub fn next_event(&mut self) -> Result<Option<TraceEvent>, TraceError> {
        loop {
            self.buf.clear();
            self.line += 1;
            let n = (&mut self.input)
                .take(MAX_LINE_BYTES as u64 + 1)
                .read_until(b'\n', &mut self.buf)
                .map_err(|source| TraceError::Io {
                    line: self.line,
                    source,
                })?;
            if n == 0 {
                self.line -= 1;
                return Ok(None);
            }
            if self.buf.len() > MAX_LINE_BYTES
                && !(self.buf.len() == MAX_LINE_BYTES + 1 && self.buf.ends_with(b"\n"))
            {
                return Err(TraceError::Syntax {
                    line: self.line,
                    message: format!("line longer than {MAX_LINE_BYTES} bytes"),
                });
            }
            let text = match self.buf.iter().position(|&b| b == b'#') {
                Some(i) => &self.buf[..i],
                None => &self.buf[..],
            };
            let mut parts = text
                .split(u8::is_ascii_whitespace)
                .filter(|t| !t.is_empty());
            let Some(op) = parts.next() else { continue };
            let line = self.line;
            let mut num = |what: &str| -> Result<u64, TraceError> {
                let field = parts.next().ok_or_else(|| TraceError::Syntax {
                    line,
                    message: format!("`{}` is missing its {what}", shown(op)),
                })?;
                parse_u64(field).ok_or_else(|| TraceError::Syntax {
                    line,
                    message: format!("{what} `{}` is not a non-negative integer", shown(field)),
                })
            };
            let event = match op {
                b"a" => {
                    let id = num("id")?;
                    let bytes = num("size")?;
                    if bytes > crate::MAX_REQUEST {
                        return Err(TraceError::Syntax {
                            line,
                            message: format!(
                                "size {bytes} is above 1 PiB, the largest request cachealloc \
                                 serves (a request up to 1 PiB is replayed, and fails as out of \
                                 memory where the simulated device has no room)"
                            ),
                        });
                    }
                    let stream = num("stream")?;
                    TraceEvent::Alloc { id, bytes, stream }
                }
                b"f" => TraceEvent::Free { id: num("id")? },
                b"e" => TraceEvent::EmptyCache,
                other => {
                    return Err(TraceError::Syntax {
                        line,
                        message: format!(
                            "unknown operation `{}` (expected a, f or e)",
                            shown(other)
                        ),
                    });
                }
            };
            if let Some(extra) = parts.next() {
                return Err(TraceError::Syntax {
                    line,
                    message: format!("unexpected extra field `{}`", shown(extra)),
                });
            }
            match event {
                TraceEvent::Alloc { id, .. } => {
                    if self.live.insert(id, ()).is_some() {
                        return Err(TraceError::IdReused { line, id });
                    }
                }
                TraceEvent::Free { id } => {
                    if self.live.remove(&id).is_none() {
                        return Err(self.bad_free(line, id));
                    }
                    if self.freed.len() < FREED_KEPT {
                        self.freed.push((id, line));
                    } else {
                        self.freed[self.freed_next] = (id, line);
                        self.freed_next = (self.freed_next + 1) % FREED_KEPT;
                    }
                }
                TraceEvent::EmptyCache => {}
            }
            return Ok(Some(event));
        }
    }
}

impl<R> TraceReader<R> {
    /// The error for a free of `id`, which is not live: a double free if a
    /// recent free (after its last allocation) named it, else an unknown id.
    #[cold]
    fn bad_free(&self, line: u64, id: u64) -> TraceError {
        // The most recent free of `id` (an id freed, reallocated and freed
        // again appears twice; the later free is the one that counts).
        let (older, newer) = self.freed.split_at(self.freed_next);
        match newer.iter().chain(older).rev().find(|&&(i, _)| i == id) {
            Some(&(_, freed_on)) => TraceError::DoubleFree { line, id, freed_on },
            None => TraceError::UnknownId { line, id },
        }
    }
}

/// A non-negative decimal integer, without sign or separators; `None` on overflow.
fn parse_u64(digits: &[u8]) -> Option<u64> {
    if digits.is_empty() {
        return None;
    }
    digits.iter().try_fold(0u64, |n, &d| {
        if d.is_ascii_digit() {
            n.checked_mul(10)?.checked_add(u64::from(d - b'0'))
        } else {
            None
        }
    })
}

/// A token for an error message: at most 20 characters, unprintable ones escaped.
fn shown(token: &[u8]) -> String {
    String::from_utf8_lossy(token)
        .chars()
        .take(20)
        .flat_map(char::escape_debug)
        .collect()
}

impl<R: BufRead> Iterator for TraceReader<R> {
    type Item = Result<TraceEvent, TraceError>;
    fn next(&mut self) -> Option<Self::Item> {
        self.next_event().transpose()
    }
}

/// Writes events in the plain format.
pub struct TraceWriter<W: Write> {
    out: W,
}

/// The header line every written trace starts with.
pub const TRACE_HEADER: &str = "# plain allocation trace v1: 'a <id> <bytes> <stream>' allocates, 'f <id>' frees, 'e' empties the cache";

impl<W: Write> TraceWriter<W> {
    /// A writer that first writes the header line.
    pub fn new(mut out: W) -> io::Result<Self> {
        writeln!(out, "{TRACE_HEADER}")?;
        Ok(TraceWriter { out })
    }

    /// Writes one event.
    pub fn write(&mut self, event: &TraceEvent) -> io::Result<()> {
        writeln!(self.out, "{event}")
    }

    /// Flushes and returns the inner writer.
    pub fn finish(mut self) -> io::Result<W> {
        self.out.flush()?;
        Ok(self.out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read_all(text: &str) -> Result<Vec<TraceEvent>, TraceError> {
        TraceReader::new(text.as_bytes()).collect()
    }

    #[test]
    fn round_trip() {
        let events = vec![
            TraceEvent::Alloc {
                id: 0,
                bytes: 100,
                stream: 0,
            },
            TraceEvent::Alloc {
                id: 7,
                bytes: 1 << 40,
                stream: 3,
            },
            TraceEvent::Free { id: 0 },
            TraceEvent::EmptyCache,
            TraceEvent::Free { id: 7 },
        ];
        let mut w = TraceWriter::new(Vec::new()).unwrap();
        for e in &events {
            w.write(e).unwrap();
        }
        let bytes = w.finish().unwrap();
        assert_eq!(
            read_all(std::str::from_utf8(&bytes).unwrap()).unwrap(),
            events
        );
    }

    #[test]
    fn long_lines_double_frees_and_huge_sizes_are_named() {
        let read_all = |text: &[u8]| -> Result<usize, TraceError> {
            let mut r = TraceReader::new(text);
            let mut n = 0;
            while r.next_event()?.is_some() {
                n += 1;
            }
            Ok(n)
        };
        // A line of exactly the limit (newline included) is fine; one more byte is not.
        let mut ok = b"a 1 512 0 #".to_vec();
        ok.resize(MAX_LINE_BYTES - 1, b'x');
        ok.push(b'\n');
        assert_eq!(read_all(&ok).unwrap(), 1);
        let mut long = b"a 1 512 0 #".to_vec();
        long.resize(MAX_LINE_BYTES * 100, b'x');
        let e = read_all(&long).unwrap_err().to_string();
        assert!(e.contains("line 1: line longer than 4096 bytes"), "{e}");
        let e = read_all(b"a 1 512 0\nf 1\nf 1\n").unwrap_err().to_string();
        assert_eq!(
            e,
            "line 3: double free of allocation id 1 (freed on line 2)"
        );
        assert_eq!(read_all(b"a 1 512 0\nf 1\na 1 512 0\nf 1\n").unwrap(), 4);
        let e = read_all(b"f 7\n").unwrap_err().to_string();
        assert!(e.contains("unknown allocation id 7"), "{e}");
        let e = read_all(b"a 1 1125899906842625 0\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("above 1 PiB"), "{e}");
        assert_eq!(read_all(b"a 1 1125899906842624 0\n").unwrap(), 1);
    }

    #[test]
    fn comments_and_blank_lines() {
        let t = "# header\n\n  a 1 512 0   # trailing\nf 1\n";
        assert_eq!(read_all(t).unwrap().len(), 2);
    }

    #[test]
    fn errors_name_the_line() {
        let cases: [(&str, u64, &str); 7] = [
            ("a 1 512 0\nx 1\n", 2, "unknown operation `x`"),
            ("a 1 512\n", 1, "missing its stream"),
            ("a 1 -5 0\n", 1, "size `-5`"),
            ("a 1 512 0\na 1 512 0\n", 2, "reused"),
            ("# c\nf 3\n", 2, "unknown allocation id 3"),
            ("a 1 512 0 9\n", 1, "extra field"),
            ("e\nf\n", 2, "missing its id"),
        ];
        for (text, line, needle) in cases {
            let e = read_all(text).unwrap_err();
            assert_eq!(e.line(), line, "{text:?}: {e}");
            assert!(e.to_string().contains(needle), "{text:?}: {e}");
        }
    }

    #[test]
    fn odd_bytes_are_errors_with_readable_messages() {
        let e = read_all("\u{1}x 1\n").unwrap_err();
        assert!(e.to_string().contains("`\\u{1}x`"), "{e}");
        let e = TraceReader::new(&b"a 1 \xff 0\n"[..])
            .next_event()
            .unwrap_err();
        assert!(e.to_string().contains("size `\u{fffd}`"), "{e}");
        let e = read_all("a 1 99999999999999999999 0\n").unwrap_err();
        assert!(e.to_string().contains("not a non-negative integer"), "{e}");
        let e = read_all("a 1 +5 0\n").unwrap_err();
        assert!(e.to_string().contains("`+5`"), "{e}");
    }

    #[test]
    fn id_may_be_reused_after_free() {
        assert_eq!(read_all("a 1 512 0\nf 1\na 1 1024 0\n").unwrap().len(), 3);
    }
}
