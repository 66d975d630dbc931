//! Trace files on disk: plain text or gzip, streamed.
//!
//! [`open`] reads a trace file in the plain format of docs/TRACE_FORMAT.md, plain or
//! gzip-compressed (recognised by its magic bytes `1f 8b`, not by its name),
//! or a PyTorch memory snapshot pickle (`80 0N`, see [`crate::pickle_trace`]),
//! one event at a time; the file is never loaded whole. Every error names the
//! file, and errors in its content also name the line:
//!
//! ```text
//! traces/x.trace.gz: line 12: unknown operation `q` (expected a, f or e)
//! ```
//!
//! [`create`] writes a trace (gzip when the name ends in `.gz`), [`Recording`]
//! records a live allocator into a file, and [`replay_file`] replays a file
//! with the core's [`replay`], reading and
//! parsing on a thread of its own while the allocator works.

use cachealloc_core::replay::{replay, ReplayError, ReplayOptions, ReplayResult};
use cachealloc_core::{
    AllocError, CachingAllocator, Config, Device, TraceError, TraceEvent, TraceReader, TraceWriter,
};
use flate2::bufread::MultiGzDecoder;
use flate2::write::GzEncoder;
use flate2::Compression;
use parking_lot::Mutex;
use std::cell::RefCell;
use std::fmt;
use std::fs::File;
use std::io::{self, BufRead, BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender};
use std::sync::Arc;

/// Events per batch handed from the reading thread to the consumer.
const BATCH: usize = 4096;
/// Batches in flight between the threads.
const BATCHES_IN_FLIGHT: usize = 4;

/// Read buffer of the compressed or plain file.
const FILE_BUFFER: usize = 256 << 10;
/// Buffer of decompressed text the parser reads lines from.
const TEXT_BUFFER: usize = 256 << 10;

/// What went wrong with a trace file; its `Display` starts with the path.
#[derive(Debug)]
pub struct FileError {
    /// The file.
    pub path: PathBuf,
    /// What went wrong.
    pub kind: FileErrorKind,
}

/// The cause of a [`FileError`].
#[derive(Debug)]
pub enum FileErrorKind {
    /// The file could not be opened or created.
    Open(io::Error),
    /// The path is a directory.
    IsDirectory,
    /// The content is not a valid trace, or reading it failed (with the line).
    Trace {
        /// The error of the trace reader.
        error: TraceError,
        /// Whether the file is gzip-compressed.
        gzip: bool,
    },
    /// Writing failed.
    Write(io::Error),
    /// The replayed allocator failed other than by running out of memory.
    Alloc {
        /// Index of the event (0-based).
        event: u64,
        /// The error.
        error: AllocError,
    },
}

impl FileError {
    fn new(path: &Path, kind: FileErrorKind) -> Self {
        FileError {
            path: path.to_path_buf(),
            kind,
        }
    }

    /// The line of the trace the error is on, if it is about the content.
    pub fn line(&self) -> Option<u64> {
        match &self.kind {
            FileErrorKind::Trace { error, .. } => Some(error.line()),
            _ => None,
        }
    }

    /// The trace reader's error, if it is about the content.
    pub fn trace_error(&self) -> Option<&TraceError> {
        match &self.kind {
            FileErrorKind::Trace { error, .. } => Some(error),
            _ => None,
        }
    }
}

impl fmt::Display for FileError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let path = self.path.display();
        match &self.kind {
            FileErrorKind::Open(e) if e.kind() == io::ErrorKind::NotFound => {
                write!(f, "{path}: no such file")
            }
            FileErrorKind::Open(e) if e.kind() == io::ErrorKind::PermissionDenied => {
                write!(f, "{path}: permission denied")
            }
            FileErrorKind::Open(e) => write!(f, "{path}: cannot open: {e}"),
            FileErrorKind::IsDirectory => write!(f, "{path}: is a directory, not a trace file"),
            FileErrorKind::Trace {
                error: TraceError::Io { line, source },
                gzip: true,
            } => match source.kind() {
                io::ErrorKind::UnexpectedEof => write!(
                    f,
                    "{path}: line {line}: truncated gzip file (the compressed data ends early; \
                     was the file cut off while it was written or copied?)"
                ),
                _ => write!(f, "{path}: line {line}: corrupt gzip data: {source}"),
            },
            FileErrorKind::Trace {
                error: TraceError::Io { line, source },
                gzip: false,
            } if source.kind() == io::ErrorKind::InvalidData => {
                write!(f, "{path}: line {line}: not a text trace ({source})")
            }
            FileErrorKind::Trace { error, .. } => write!(f, "{path}: {error}"),
            FileErrorKind::Write(e) => write!(f, "{path}: write error: {e}"),
            FileErrorKind::Alloc { event, error } => {
                write!(f, "{path}: event {event}: the allocator failed: {error}")
            }
        }
    }
}

impl std::error::Error for FileError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match &self.kind {
            FileErrorKind::Open(e) | FileErrorKind::Write(e) => Some(e),
            FileErrorKind::Trace { error, .. } => Some(error),
            FileErrorKind::Alloc { error, .. } => Some(error),
            FileErrorKind::IsDirectory => None,
        }
    }
}

/// A file that counts the bytes read from it (for progress reports).
pub struct CountingFile {
    file: File,
    read: Arc<AtomicU64>,
}

impl Read for CountingFile {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.file.read(buf)?;
        self.read.fetch_add(n as u64, Ordering::Relaxed);
        Ok(n)
    }
}

/// The decoded text of a trace file: plain or gunzipped.
pub enum Input {
    /// A plain text file.
    Plain(BufReader<CountingFile>),
    /// A gzip file (one or more members).
    Gzip(Box<BufReader<MultiGzDecoder<BufReader<CountingFile>>>>),
    /// Text converted in memory (a PyTorch memory snapshot pickle, see [`crate::pickle_trace`]).
    Text(io::Cursor<Vec<u8>>),
}

impl Read for Input {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Input::Plain(r) => r.read(buf),
            Input::Gzip(r) => r.read(buf),
            Input::Text(r) => r.read(buf),
        }
    }
}

impl BufRead for Input {
    fn fill_buf(&mut self) -> io::Result<&[u8]> {
        match self {
            Input::Plain(r) => r.fill_buf(),
            Input::Gzip(r) => r.fill_buf(),
            Input::Text(r) => r.fill_buf(),
        }
    }
    fn consume(&mut self, amt: usize) {
        match self {
            Input::Plain(r) => r.consume(amt),
            Input::Gzip(r) => r.consume(amt),
            Input::Text(r) => r.consume(amt),
        }
    }
}

/// Streams the events of a trace file; errors name the file and line.
pub struct TraceFileReader {
    path: PathBuf,
    gzip: bool,
    file_bytes: u64,
    bytes_read: Arc<AtomicU64>,
    reader: TraceReader<Input>,
}

impl TraceFileReader {
    /// The file being read.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether the file is gzip-compressed.
    pub fn is_gzip(&self) -> bool {
        self.gzip
    }

    /// The number of the last line read.
    pub fn line(&self) -> u64 {
        self.reader.line()
    }

    /// The size of the file in bytes (compressed, for a gzip file).
    pub fn file_bytes(&self) -> u64 {
        self.file_bytes
    }

    /// A counter of the bytes read from the file so far (compressed, for a
    /// gzip file); it keeps counting after [`into_events`](Self::into_events).
    pub fn bytes_read(&self) -> Arc<AtomicU64> {
        Arc::clone(&self.bytes_read)
    }

    /// The next event, `Ok(None)` at the end.
    pub fn next_event(&mut self) -> Result<Option<TraceEvent>, FileError> {
        self.reader.next_event().map_err(|error| self.error(error))
    }

    /// The reader of the core, whose errors carry the line but not the path
    /// (what [`replay`] takes).
    pub fn into_events(self) -> TraceReader<Input> {
        self.reader
    }

    /// The events, read, decompressed and parsed on a thread of their own
    /// and handed over in batches, so that reading overlaps with the work on
    /// the events (what [`replay_file`] uses). Errors carry the line, not
    /// the path. Dropping the iterator early stops the thread.
    pub fn into_threaded_events(self) -> ThreadedEvents {
        let (tx, rx) = mpsc::sync_channel(BATCHES_IN_FLIGHT);
        let (recycle_tx, recycle_rx) = mpsc::channel();
        let mut reader = self.reader;
        std::thread::Builder::new()
            .name("trace-reader".into())
            .spawn(move || read_batches(&mut reader, &tx, &recycle_rx))
            .map(|_| ThreadedEvents {
                rx,
                recycle: recycle_tx,
                batch: Vec::new(),
                pos: 0,
                error: None,
                done: false,
            })
            .unwrap_or_else(|_| {
                // No thread to be had: an iterator that reports it.
                ThreadedEvents {
                    rx: mpsc::sync_channel(0).1,
                    recycle: mpsc::channel().0,
                    batch: Vec::new(),
                    pos: 0,
                    error: Some(TraceError::Io {
                        line: 0,
                        source: io::Error::other("cannot start a reader thread"),
                    }),
                    done: false,
                }
            })
    }

    fn error(&self, error: TraceError) -> FileError {
        FileError::new(
            &self.path,
            FileErrorKind::Trace {
                error,
                gzip: self.gzip,
            },
        )
    }
}

impl Iterator for TraceFileReader {
    type Item = Result<TraceEvent, FileError>;
    fn next(&mut self) -> Option<Self::Item> {
        self.next_event().transpose()
    }
}

enum Batch {
    Events(Vec<TraceEvent>),
    Error(TraceError),
}

fn read_batches(
    reader: &mut TraceReader<Input>,
    tx: &SyncSender<Batch>,
    recycle: &Receiver<Vec<TraceEvent>>,
) {
    loop {
        let mut batch = recycle
            .try_recv()
            .unwrap_or_else(|_| Vec::with_capacity(BATCH));
        batch.clear();
        let mut error = None;
        while batch.len() < BATCH {
            match reader.next_event() {
                Ok(Some(e)) => batch.push(e),
                Ok(None) => break,
                Err(e) => {
                    error = Some(e);
                    break;
                }
            }
        }
        let last = error.is_some() || batch.len() < BATCH;
        if !batch.is_empty() && tx.send(Batch::Events(batch)).is_err() {
            return; // the consumer is gone
        }
        if let Some(e) = error {
            let _ = tx.send(Batch::Error(e));
        }
        if last {
            return;
        }
    }
}

/// The events of a trace file, read on a thread of their own (see
/// [`TraceFileReader::into_threaded_events`]).
pub struct ThreadedEvents {
    rx: Receiver<Batch>,
    recycle: mpsc::Sender<Vec<TraceEvent>>,
    batch: Vec<TraceEvent>,
    pos: usize,
    error: Option<TraceError>,
    done: bool,
}

impl Iterator for ThreadedEvents {
    type Item = Result<TraceEvent, TraceError>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            if let Some(&e) = self.batch.get(self.pos) {
                self.pos += 1;
                return Some(Ok(e));
            }
            if let Some(e) = self.error.take() {
                self.done = true;
                return Some(Err(e));
            }
            if self.done {
                return None;
            }
            match self.rx.recv() {
                Ok(Batch::Events(v)) => {
                    // Hand the used buffer back for reuse.
                    let used = std::mem::replace(&mut self.batch, v);
                    self.pos = 0;
                    if used.capacity() > 0 {
                        let _ = self.recycle.send(used);
                    }
                }
                Ok(Batch::Error(e)) => self.error = Some(e),
                Err(_) => self.done = true,
            }
        }
    }
}

/// Opens a trace file, plain or gzip (by its first bytes), for streaming.
pub fn open(path: impl AsRef<Path>) -> Result<TraceFileReader, FileError> {
    let path = path.as_ref();
    let fail = |kind| FileError::new(path, kind);
    let file = File::open(path).map_err(|e| fail(FileErrorKind::Open(e)))?;
    let meta = file.metadata().map_err(|e| fail(FileErrorKind::Open(e)))?;
    if meta.is_dir() {
        return Err(fail(FileErrorKind::IsDirectory));
    }
    let bytes_read = Arc::new(AtomicU64::new(0));
    let counting = CountingFile {
        file,
        read: Arc::clone(&bytes_read),
    };
    let mut raw = BufReader::with_capacity(FILE_BUFFER, counting);
    let (gzip, pickle) = loop {
        match raw.fill_buf() {
            // Short reads are possible in principle; the magic needs two bytes.
            Ok(head) => {
                break (
                    head.starts_with(&[0x1f, 0x8b]),
                    crate::pickle_trace::is_pickle(head),
                )
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) if e.raw_os_error() == Some(21) => return Err(fail(FileErrorKind::IsDirectory)),
            Err(e) => return Err(fail(FileErrorKind::Open(e))),
        }
    };
    let input = if pickle {
        // A PyTorch memory snapshot: read as a stream, its trace converted to
        // text in memory.
        let (text, _) = crate::pickle_trace::snapshot_to_text(raw, None).map_err(|e| {
            fail(FileErrorKind::Open(io::Error::new(
                io::ErrorKind::InvalidData,
                e,
            )))
        })?;
        bytes_read.store(meta.len(), Ordering::Relaxed);
        Input::Text(io::Cursor::new(text.into_bytes()))
    } else if gzip {
        Input::Gzip(Box::new(BufReader::with_capacity(
            TEXT_BUFFER,
            MultiGzDecoder::new(raw),
        )))
    } else {
        Input::Plain(raw)
    };
    Ok(TraceFileReader {
        path: path.to_path_buf(),
        gzip,
        file_bytes: meta.len(),
        bytes_read,
        reader: TraceReader::new(input),
    })
}

/// Reads a whole trace file into memory (for tests and small traces).
pub fn read_all(path: impl AsRef<Path>) -> Result<Vec<TraceEvent>, FileError> {
    open(path)?.collect()
}

/// Where a written trace goes: plain or gzip.
pub enum Output {
    /// Plain text.
    Plain(BufWriter<File>),
    /// Gzip-compressed text.
    Gzip(Box<GzEncoder<BufWriter<File>>>),
}

impl Write for Output {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Output::Plain(w) => w.write(buf),
            Output::Gzip(w) => w.write(buf),
        }
    }
    fn write_all(&mut self, buf: &[u8]) -> io::Result<()> {
        match self {
            Output::Plain(w) => w.write_all(buf),
            Output::Gzip(w) => w.write_all(buf),
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        match self {
            Output::Plain(w) => w.flush(),
            Output::Gzip(w) => w.flush(),
        }
    }
}

/// Writes a trace file; call [`finish`](Self::finish) to complete it.
pub struct TraceFileWriter {
    path: PathBuf,
    writer: TraceWriter<Output>,
    events: u64,
}

/// Creates (or truncates) a trace file; gzip-compressed when the name ends in `.gz`.
pub fn create(path: impl AsRef<Path>) -> Result<TraceFileWriter, FileError> {
    let path = path.as_ref();
    let file = File::create(path).map_err(|e| FileError::new(path, FileErrorKind::Open(e)))?;
    let buffered = BufWriter::with_capacity(FILE_BUFFER, file);
    let gzip = path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gz"));
    let out = if gzip {
        Output::Gzip(Box::new(GzEncoder::new(buffered, Compression::default())))
    } else {
        Output::Plain(buffered)
    };
    let writer =
        TraceWriter::new(out).map_err(|e| FileError::new(path, FileErrorKind::Write(e)))?;
    Ok(TraceFileWriter {
        path: path.to_path_buf(),
        writer,
        events: 0,
    })
}

impl TraceFileWriter {
    /// The file being written.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Events written so far.
    pub fn events(&self) -> u64 {
        self.events
    }

    /// Writes one event.
    pub fn write(&mut self, event: &TraceEvent) -> Result<(), FileError> {
        self.events += 1;
        self.writer
            .write(event)
            .map_err(|e| FileError::new(&self.path, FileErrorKind::Write(e)))
    }

    /// Completes the file (the gzip trailer included), flushes it and syncs nothing else.
    pub fn finish(self) -> Result<(), FileError> {
        let path = self.path;
        let fail = |e| FileError::new(&path, FileErrorKind::Write(e));
        match self.writer.finish().map_err(fail)? {
            Output::Plain(mut w) => w.flush().map_err(fail),
            Output::Gzip(g) => g.finish().map_err(fail)?.flush().map_err(fail),
        }
    }
}

/// Writes a whole trace to a file.
pub fn write_all<'a>(
    path: impl AsRef<Path>,
    events: impl IntoIterator<Item = &'a TraceEvent>,
) -> Result<(), FileError> {
    let mut w = create(path)?;
    for e in events {
        w.write(e)?;
    }
    w.finish()
}

/// Records a live allocator's requests into a trace file, from
/// [`start`](Self::start) until [`finish`](Self::finish).
///
/// The allocator's trace sink cannot fail, so the first write error is kept
/// and returned by `finish`; events after it are dropped.
pub struct Recording {
    shared: Arc<Mutex<RecordingState>>,
}

struct RecordingState {
    writer: Option<TraceFileWriter>,
    error: Option<FileError>,
}

impl Recording {
    /// Creates the file and starts recording `alloc` into it (allocations
    /// already live are written first, so that their frees are valid).
    pub fn start<D: Device>(
        alloc: &CachingAllocator<D>,
        path: impl AsRef<Path>,
    ) -> Result<Self, FileError> {
        let writer = create(path)?;
        let shared = Arc::new(Mutex::new(RecordingState {
            writer: Some(writer),
            error: None,
        }));
        let sink_state = Arc::clone(&shared);
        alloc.start_recording(Box::new(move |event: &TraceEvent| {
            let mut st = sink_state.lock();
            if st.error.is_some() {
                return;
            }
            if let Some(w) = st.writer.as_mut() {
                if let Err(e) = w.write(event) {
                    st.error = Some(e);
                }
            }
        }));
        Ok(Recording { shared })
    }

    /// Stops recording `alloc` and completes the file; returns the number of events written.
    pub fn finish<D: Device>(self, alloc: &CachingAllocator<D>) -> Result<u64, FileError> {
        alloc.stop_recording();
        let mut st = self.shared.lock();
        if let Some(e) = st.error.take() {
            return Err(e);
        }
        match st.writer.take() {
            Some(w) => {
                let n = w.events();
                w.finish()?;
                Ok(n)
            }
            None => Ok(0),
        }
    }
}

/// Where a replay of a file stands (see [`replay_file_with_progress`]).
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct FileProgress {
    /// Events replayed so far.
    pub events: u64,
    /// Bytes of the file read so far (compressed, for a gzip file).
    pub bytes_read: u64,
    /// Size of the file.
    pub file_bytes: u64,
}

impl FileProgress {
    /// The fraction of the file read, in [0, 1].
    pub fn fraction(&self) -> f64 {
        if self.file_bytes == 0 {
            1.0
        } else {
            (self.bytes_read as f64 / self.file_bytes as f64).min(1.0)
        }
    }
}

/// Replays a trace file (read twice when `options.report_at_peak` is set).
/// Errors name the file, and the line where the content is at fault.
pub fn replay_file(
    path: impl AsRef<Path>,
    config: &Config,
    options: ReplayOptions<'_>,
) -> Result<ReplayResult, FileError> {
    replay_file_with_progress(path, config, options, &mut |_| {})
}

/// [`replay_file`], calling `on_progress` now and then during the first
/// (measuring) pass with the events replayed and the bytes of the file read
/// (`options.progress` is called too).
pub fn replay_file_with_progress(
    path: impl AsRef<Path>,
    config: &Config,
    options: ReplayOptions<'_>,
    on_progress: &mut dyn FnMut(FileProgress),
) -> Result<ReplayResult, FileError> {
    let path = path.as_ref();
    // Open once up front for a clear error; the closure's own failures are
    // kept aside, since `replay` only carries a `TraceError`.
    let first = open(path)?;
    let gzip = first.is_gzip();
    let file_bytes = first.file_bytes();
    let counter: RefCell<Arc<AtomicU64>> = RefCell::new(first.bytes_read());
    let first = RefCell::new(Some(first));
    let open_error: RefCell<Option<FileError>> = RefCell::new(None);
    let ReplayOptions {
        capacity,
        gpu_lag,
        timeline_points,
        report_at_peak,
        progress: mut inner,
    } = options;
    let mut progress = |events: u64| {
        if let Some(p) = inner.as_mut() {
            p(events);
        }
        let bytes_read = counter.borrow().load(Ordering::Relaxed);
        on_progress(FileProgress {
            events,
            bytes_read,
            file_bytes,
        });
    };
    let options = ReplayOptions {
        capacity,
        gpu_lag,
        timeline_points,
        report_at_peak,
        progress: Some(&mut progress),
    };
    let result = replay(
        || {
            let reader = match first.borrow_mut().take() {
                Some(r) => r,
                None => open(path).map_err(|e| {
                    let io = io::Error::other(e.to_string());
                    *open_error.borrow_mut() = Some(e);
                    TraceError::Io {
                        line: 0,
                        source: io,
                    }
                })?,
            };
            *counter.borrow_mut() = reader.bytes_read();
            Ok(reader.into_threaded_events())
        },
        config,
        options,
    );
    result.map_err(|e| {
        if let Some(open_error) = open_error.borrow_mut().take() {
            return open_error;
        }
        match e {
            ReplayError::Trace(error) => FileError::new(path, FileErrorKind::Trace { error, gzip }),
            ReplayError::Alloc { event, error } => {
                FileError::new(path, FileErrorKind::Alloc { event, error })
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use cachealloc_core::{SimulatedDevice, StreamId};

    struct TempDir(PathBuf);

    impl TempDir {
        fn new(tag: &str) -> Self {
            let dir = std::env::temp_dir().join(format!(
                "cachealloc-trace-file-{tag}-{}",
                std::process::id()
            ));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
            TempDir(dir)
        }
        fn path(&self, name: &str) -> PathBuf {
            self.0.join(name)
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn sample_events(n: u64) -> Vec<TraceEvent> {
        let mut events = Vec::new();
        for i in 0..n {
            events.push(TraceEvent::Alloc {
                id: i,
                bytes: 512 + i * 977 % 5_000_000,
                stream: i % 3,
            });
            if i % 3 == 2 {
                events.push(TraceEvent::Free { id: i - 1 });
            }
            if i % 1000 == 999 {
                events.push(TraceEvent::EmptyCache);
            }
        }
        events
    }

    #[test]
    fn round_trip_plain_and_gzip() {
        let dir = TempDir::new("round-trip");
        let events = sample_events(5000);
        for name in ["t.trace", "t.trace.gz", "t.TRACE.GZ"] {
            let p = dir.path(name);
            write_all(&p, &events).unwrap();
            let gz = name.to_ascii_lowercase().ends_with(".gz");
            let bytes = std::fs::read(&p).unwrap();
            assert_eq!(bytes.starts_with(&[0x1f, 0x8b]), gz, "{name}");
            let reader = open(&p).unwrap();
            assert_eq!(reader.is_gzip(), gz);
            assert_eq!(read_all(&p).unwrap(), events, "{name}");
        }
    }

    #[test]
    fn gzip_is_detected_by_content_not_name() {
        let dir = TempDir::new("magic");
        let events = sample_events(10);
        let gz = dir.path("a.trace.gz");
        write_all(&gz, &events).unwrap();
        let disguised = dir.path("plain-looking.txt");
        std::fs::copy(&gz, &disguised).unwrap();
        assert_eq!(read_all(&disguised).unwrap(), events);
        let plain = dir.path("b.trace");
        write_all(&plain, &events).unwrap();
        let misnamed = dir.path("misnamed.trace.gz");
        std::fs::copy(&plain, &misnamed).unwrap();
        assert_eq!(read_all(&misnamed).unwrap(), events);
    }

    #[test]
    fn concatenated_gzip_members_are_read() {
        let dir = TempDir::new("multi");
        let a = dir.path("a.gz");
        let b = dir.path("b.gz");
        write_all(
            &a,
            &[TraceEvent::Alloc {
                id: 1,
                bytes: 10,
                stream: 0,
            }],
        )
        .unwrap();
        write_all(&b, &[TraceEvent::Free { id: 1 }]).unwrap();
        let mut both = std::fs::read(&a).unwrap();
        both.extend(std::fs::read(&b).unwrap());
        let c = dir.path("c.gz");
        std::fs::write(&c, both).unwrap();
        assert_eq!(read_all(&c).unwrap().len(), 2);
    }

    #[test]
    fn missing_file_and_directory() {
        let dir = TempDir::new("missing");
        let missing = dir.path("nope.trace.gz");
        let e = open(&missing).err().unwrap();
        assert!(matches!(e.kind, FileErrorKind::Open(_)));
        let msg = e.to_string();
        assert!(msg.starts_with(&missing.display().to_string()), "{msg}");
        assert!(msg.contains("no such file"), "{msg}");
        let e = open(&dir.0).err().unwrap();
        assert!(matches!(e.kind, FileErrorKind::IsDirectory), "{e:?}");
        assert!(e.to_string().contains("is a directory"), "{e}");
    }

    #[test]
    fn content_errors_name_file_and_line() {
        let dir = TempDir::new("content");
        let cases = [
            ("a 1 512 0\n# comment\nq 3\n", 3, "unknown operation `q`"),
            ("a 1 512 0\nf 2\n", 2, "unknown allocation id 2"),
            ("a 1 512 0\na 1 512 0\n", 2, "reused"),
            ("a 1 x 0\n", 1, "size `x`"),
        ];
        for (i, (text, line, needle)) in cases.into_iter().enumerate() {
            for gz in [false, true] {
                let p = dir.path(&format!("bad{i}.trace{}", if gz { ".gz" } else { "" }));
                if gz {
                    let mut e = GzEncoder::new(Vec::new(), Compression::fast());
                    e.write_all(text.as_bytes()).unwrap();
                    std::fs::write(&p, e.finish().unwrap()).unwrap();
                } else {
                    std::fs::write(&p, text).unwrap();
                }
                let e = read_all(&p).unwrap_err();
                assert_eq!(e.line(), Some(line));
                let msg = e.to_string();
                let want = format!("{}: line {line}: ", p.display());
                assert!(msg.starts_with(&want), "{msg}");
                assert!(msg.contains(needle), "{msg}");
            }
        }
    }

    #[test]
    fn truncated_gzip_is_an_error_not_a_short_trace() {
        let dir = TempDir::new("truncated");
        let events = sample_events(20_000);
        let full = dir.path("full.trace.gz");
        write_all(&full, &events).unwrap();
        let bytes = std::fs::read(&full).unwrap();
        // Cut in the middle, just before the trailer, and inside the trailer.
        for cut in [
            bytes.len() / 2,
            bytes.len() - 9,
            bytes.len() - 4,
            bytes.len() - 1,
            5,
        ] {
            let p = dir.path(&format!("cut{cut}.trace.gz"));
            std::fs::write(&p, &bytes[..cut]).unwrap();
            let e = read_all(&p).expect_err("a truncated gzip must not read as a short trace");
            let msg = e.to_string();
            assert!(msg.contains("truncated gzip"), "cut {cut}: {msg}");
            assert!(msg.starts_with(&p.display().to_string()), "{msg}");
        }
    }

    #[test]
    fn corrupt_gzip_is_an_error() {
        let dir = TempDir::new("corrupt");
        let events = sample_events(2000);
        let full = dir.path("full.trace.gz");
        write_all(&full, &events).unwrap();
        let mut bytes = std::fs::read(&full).unwrap();
        let n = bytes.len();
        bytes[n - 6] ^= 0xff; // the CRC
        let p = dir.path("crc.trace.gz");
        std::fs::write(&p, &bytes).unwrap();
        let e = read_all(&p).unwrap_err();
        assert!(e.to_string().contains("gzip"), "{e}");
    }

    #[test]
    fn binary_garbage_is_an_error() {
        let dir = TempDir::new("binary");
        let p = dir.path("x.bin");
        std::fs::write(&p, [0u8, 159, 146, 150, 10]).unwrap();
        let e = read_all(&p).unwrap_err();
        assert!(e.to_string().starts_with(&p.display().to_string()), "{e}");
    }

    #[test]
    fn replay_file_matches_in_memory_replay() {
        let dir = TempDir::new("replay");
        let events = sample_events(3000);
        let p = dir.path("r.trace.gz");
        write_all(&p, &events).unwrap();
        let text: String = events.iter().map(|e| format!("{e}\n")).collect();
        let config = Config::pytorch();
        let from_file = replay_file(&p, &config, ReplayOptions::default()).unwrap();
        let in_memory = replay(
            || Ok(TraceReader::new(text.as_bytes())),
            &config,
            ReplayOptions::default(),
        )
        .unwrap();
        assert_eq!(from_file.stats, in_memory.stats);
        assert_eq!(from_file.events, events.len() as u64);
        assert_eq!(from_file.peak_reserved_event, in_memory.peak_reserved_event);
        assert_eq!(
            from_file.fragmentation_at_peak,
            in_memory.fragmentation_at_peak
        );
    }

    #[test]
    fn replay_file_errors_name_the_file() {
        let dir = TempDir::new("replay-err");
        let p = dir.path("bad.trace");
        std::fs::write(&p, "a 1 512 0\nf 1\nf 1\n").unwrap();
        let e = replay_file(&p, &Config::default(), ReplayOptions::default()).unwrap_err();
        assert_eq!(
            e.to_string(),
            format!(
                "{}: line 3: double free of allocation id 1 (freed on line 2)",
                p.display()
            )
        );
        let e = replay_file(
            dir.path("missing"),
            &Config::default(),
            ReplayOptions::default(),
        )
        .unwrap_err();
        assert!(e.to_string().ends_with("missing: no such file"), "{e}");
    }

    #[test]
    fn recording_a_live_allocator_replays_to_the_same_stats() {
        let dir = TempDir::new("record");
        let p = dir.path("rec.trace.gz");
        let alloc = CachingAllocator::new(SimulatedDevice::unlimited(), Config::pytorch());
        let before = alloc.malloc(3 << 20, StreamId(0)).unwrap();
        let rec = Recording::start(&alloc, &p).unwrap();
        let mut live = Vec::new();
        for i in 0..200u64 {
            live.push(alloc.malloc(1000 + i * 40_000, StreamId(i % 2)).unwrap());
            if i % 4 == 3 {
                alloc.free(live.remove(0)).unwrap();
            }
        }
        alloc.free(before).unwrap();
        alloc.empty_cache().unwrap();
        for p in live {
            alloc.free(p).unwrap();
        }
        let n = rec.finish(&alloc).unwrap();
        let events = read_all(&p).unwrap();
        assert_eq!(events.len() as u64, n);
        assert_eq!(
            events[0],
            TraceEvent::Alloc {
                id: 0,
                bytes: 3 << 20,
                stream: 0
            }
        );
        assert!(events.contains(&TraceEvent::EmptyCache));
        let r = replay_file(&p, &Config::pytorch(), ReplayOptions::default()).unwrap();
        assert_eq!(r.stats.allocation.all().allocated, 201);
        assert_eq!(r.stats.allocated_bytes.all().current, 0);
    }
}
