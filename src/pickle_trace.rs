//! PyTorch memory snapshots as traces.
//!
//! `torch.cuda.memory._dump_snapshot("x.pickle")` (after
//! `torch.cuda.memory._record_memory_history()`) writes a Python pickle of
//! the allocator's segments and, per device, its trace of `alloc`,
//! `free_requested`, `free_completed`, `segment_alloc`, ... entries. PyTorch's
//! own allocator and cachealloc's C++ interface write the same shape. The
//! trace reader ([`crate::trace_file::open`]) recognises a pickle by its first
//! bytes and replays it: each `alloc` becomes an allocation, each
//! `free_requested` of a traced address its free (the pairing
//! `traces/*.trace.gz` were made with). Frees of allocations made before the
//! recording started are left out.
//!
//! The pickle is read as a stream and only what the conversion uses is kept:
//! dict entries under the few keys it reads, and strings among the few values
//! it compares. Containers that go into anything else (stack-trace `frames`,
//! `segments`, ...: most of a snapshot's bytes) are read past without being
//! built, so memory follows the number of trace entries, not the file's size.

use std::cell::RefCell;
use std::collections::HashMap;
use std::fmt::Write as _;
use std::io::{self, BufRead, BufReader, Read};
use std::rc::Rc;

/// Whether `head` starts like a binary pickle (protocol 2 to 5).
pub fn is_pickle(head: &[u8]) -> bool {
    head.len() >= 2 && head[0] == 0x80 && (2..=5).contains(&head[1])
}

/// The most containers the unpickler's stack may hold. Each container on
/// the stack is one still being filled or one waiting to go into the one
/// below it, so this bounds how deep a pickle nests. A snapshot nests 6
/// levels, and Python writes a container's items in batches of 1000, so its
/// stack holds at most about 6,000.
const MAX_NESTING: usize = 10_000;

/// The strings the conversion reads: dict keys and `action` values. Any
/// other string is a [`V::Scalar`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Name {
    DeviceTraces,
    Action,
    Addr,
    Size,
    Stream,
    Alloc,
    FreeRequested,
}

const NAMES: [(&str, Name); 7] = [
    ("device_traces", Name::DeviceTraces),
    ("action", Name::Action),
    ("addr", Name::Addr),
    ("size", Name::Size),
    ("stream", Name::Stream),
    ("alloc", Name::Alloc),
    ("free_requested", Name::FreeRequested),
];

/// The longest string in [`NAMES`].
const LONGEST_NAME: usize = 14;

/// A value of the pickle subset that memory snapshots use. Lists and dicts
/// are shared (`Rc`): a pickle refers to an object again by its memo index,
/// and fills a list or dict after memoizing it.
#[derive(Clone)]
enum V {
    None,
    /// A bool, float, byte string or a string not in [`NAMES`]: read past,
    /// its value unused.
    Scalar,
    Int(i64),
    Name(Name),
    List(Rc<RefCell<Vec<V>>>),
    Tuple(Rc<Vec<V>>),
    /// The entries whose key is in [`NAMES`]; the others are dropped.
    Dict(Rc<RefCell<Vec<(Name, V)>>>),
    /// A container that is not kept (one that goes into a dict under a key
    /// other than `device_traces`, or into another skipped container): what
    /// goes into it is dropped.
    Skipped,
}

impl V {
    fn is_container(&self) -> bool {
        matches!(self, V::List(_) | V::Tuple(_) | V::Dict(_) | V::Skipped)
    }

    /// Moves this value's children into `out` when nothing else shares
    /// them, leaving it empty.
    fn take_children(&mut self, out: &mut Vec<V>) {
        match self {
            V::List(l) => {
                if let Some(l) = Rc::get_mut(l) {
                    out.append(l.get_mut());
                }
            }
            V::Tuple(t) => {
                if let Some(t) = Rc::get_mut(t) {
                    out.append(t);
                }
            }
            V::Dict(d) => {
                if let Some(d) = Rc::get_mut(d) {
                    out.extend(d.get_mut().drain(..).map(|(_, v)| v));
                }
            }
            _ => {}
        }
    }
}

impl Drop for V {
    /// Drops nested values from an explicit list rather than by recursion,
    /// so that no nesting (a pickle can chain containers through the memo)
    /// runs out of stack.
    fn drop(&mut self) {
        let mut pending = Vec::new();
        self.take_children(&mut pending);
        while let Some(mut v) = pending.pop() {
            v.take_children(&mut pending);
        }
    }
}

/// Why a pickle could not be read.
enum Fail {
    Io(io::Error),
    Truncated(u64),
    TooDeep,
    Bad(String),
}

impl From<&str> for Fail {
    fn from(s: &str) -> Self {
        Fail::Bad(s.to_string())
    }
}

impl From<String> for Fail {
    fn from(s: String) -> Self {
        Fail::Bad(s)
    }
}

impl std::fmt::Display for Fail {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Fail::Io(e) => write!(f, "cannot read: {e}"),
            Fail::Truncated(pos) => write!(f, "not a readable pickle: truncated at byte {pos}"),
            Fail::TooDeep => write!(f, "pickle nested deeper than {MAX_NESTING} levels"),
            Fail::Bad(why) => write!(f, "not a readable pickle: {why}"),
        }
    }
}

/// The pickle's bytes, read as they are needed.
struct Input<R> {
    r: R,
    pos: u64,
}

impl<R: BufRead> Input<R> {
    /// Fills `buf` from the input.
    fn read(&mut self, buf: &mut [u8]) -> Result<(), Fail> {
        let at = self.pos;
        self.r.read_exact(buf).map_err(|e| match e.kind() {
            io::ErrorKind::UnexpectedEof => Fail::Truncated(at),
            _ => Fail::Io(e),
        })?;
        self.pos += buf.len() as u64;
        Ok(())
    }

    fn byte(&mut self) -> Result<u8, Fail> {
        let mut b = [0u8];
        self.read(&mut b)?;
        Ok(b[0])
    }

    /// A little-endian unsigned integer of `n` (at most 8) bytes.
    fn le(&mut self, n: usize) -> Result<u64, Fail> {
        let mut b = [0u8; 8];
        self.read(&mut b[..n])?;
        Ok(u64::from_le_bytes(b))
    }

    /// Reads past `n` bytes.
    fn skip(&mut self, n: u64) -> Result<(), Fail> {
        let at = self.pos;
        let got = io::copy(&mut (&mut self.r).take(n), &mut io::sink()).map_err(Fail::Io)?;
        self.pos += got;
        if got < n {
            return Err(Fail::Truncated(at));
        }
        Ok(())
    }

    /// A UTF-8 string of `n` bytes: a [`V::Name`] if it is one of
    /// [`NAMES`], else read past as a [`V::Scalar`].
    fn text(&mut self, n: u64) -> Result<V, Fail> {
        if n > LONGEST_NAME as u64 {
            self.skip(n)?;
            return Ok(V::Scalar);
        }
        let mut b = [0u8; LONGEST_NAME];
        let b = &mut b[..n as usize];
        self.read(b)?;
        let s = std::str::from_utf8(b).map_err(|_| "string is not UTF-8")?;
        Ok(NAMES
            .iter()
            .find(|(name, _)| *name == s)
            .map_or(V::Scalar, |&(_, name)| V::Name(name)))
    }
}

/// The unpickler's stack, counting the containers on it.
#[derive(Default)]
struct Stack {
    items: Vec<V>,
    containers: usize,
}

impl Stack {
    fn push(&mut self, v: V) -> Result<(), Fail> {
        if v.is_container() {
            if self.containers == MAX_NESTING {
                return Err(Fail::TooDeep);
            }
            self.containers += 1;
        }
        self.items.push(v);
        Ok(())
    }

    fn pop(&mut self) -> Result<V, Fail> {
        let v = self.items.pop().ok_or("stack underflow")?;
        self.containers -= usize::from(v.is_container());
        Ok(v)
    }

    /// The items from index `at` on.
    fn split_off(&mut self, at: usize) -> Vec<V> {
        let items = self.items.split_off(at);
        self.containers -= items.iter().filter(|v| v.is_container()).count();
        items
    }

    /// The items above the last MARK (which `marks` loses).
    fn since_mark(&mut self, marks: &mut Vec<usize>) -> Result<Vec<V>, Fail> {
        let m = marks.pop().ok_or("no MARK")?;
        if m > self.items.len() {
            return Err("MARK above the stack".into());
        }
        Ok(self.split_off(m))
    }

    /// Whether a container pushed now would be skipped: it goes into a
    /// skipped container, or into a dict under a key other than
    /// `device_traces`. Python's pickler writes a list's or dict's items
    /// after it, either one at a time (APPEND, SETITEM: the container, or
    /// the dict and key, right below) or in batches after a MARK (APPENDS,
    /// SETITEMS: the container right below the MARK, keys and values
    /// alternating above it).
    fn skips_next(&self, marks: &[usize]) -> bool {
        let st = &self.items;
        let n = st.len();
        let Some(top) = st.last() else {
            return false;
        };
        let unused_key = |k: &V| !matches!(k, V::Name(Name::DeviceTraces));
        if matches!(top, V::Skipped) {
            return true;
        }
        if let Some(&m) = marks.last().filter(|&&m| (1..=n).contains(&m)) {
            match &st[m - 1] {
                V::Skipped => return true,
                V::Dict(_) if (n - m) % 2 == 1 => return unused_key(top),
                _ => {}
            }
        }
        n >= 2 && matches!(st[n - 2], V::Dict(_)) && !top.is_container() && unused_key(top)
    }

    /// Pushes a new container, or [`V::Skipped`] where it would not be kept.
    fn push_container(&mut self, marks: &[usize], make: impl FnOnce() -> V) -> Result<(), Fail> {
        let v = if self.skips_next(marks) {
            V::Skipped
        } else {
            make()
        };
        self.push(v)
    }
}

/// The memo: objects by index, in order as MEMOIZE writes them, and any
/// PUT out of order aside.
#[derive(Default)]
struct Memo {
    dense: Vec<V>,
    sparse: HashMap<u64, V>,
}

impl Memo {
    fn put(&mut self, i: u64, v: V) {
        let len = self.dense.len() as u64;
        if i < len {
            self.dense[i as usize] = v;
        } else if i == len {
            self.dense.push(v);
        } else {
            self.sparse.insert(i, v);
        }
    }

    fn len(&self) -> u64 {
        (self.dense.len() + self.sparse.len()) as u64
    }

    fn get(&self, i: u64) -> Option<&V> {
        usize::try_from(i)
            .ok()
            .and_then(|i| self.dense.get(i))
            .or_else(|| self.sparse.get(&i))
    }
}

/// Adds `items` to the container `target`: a list's items, or a dict's
/// keys and values alternating. Skipped containers drop them.
fn add(target: Option<&V>, items: Vec<V>, dict: bool) -> Result<(), Fail> {
    match (target, dict) {
        (Some(V::Skipped), _) => Ok(()),
        (Some(V::List(l)), false) => {
            l.borrow_mut().extend(items);
            Ok(())
        }
        (Some(V::Dict(d)), true) => {
            if items.len() % 2 != 0 {
                return Err("SETITEMS with an odd count".into());
            }
            let mut d = d.borrow_mut();
            let mut it = items.into_iter();
            while let (Some(k), Some(v)) = (it.next(), it.next()) {
                if let V::Name(k) = k {
                    d.push((k, v));
                }
            }
            Ok(())
        }
        (_, false) => Err("APPEND to a non-list".into()),
        (_, true) => Err("SETITEM on a non-dict".into()),
    }
}

/// Reads the pickle in `r` (Python's protocols 2 to 5, plain containers
/// and scalars only: no classes, which a snapshot never holds).
fn unpickle(r: impl BufRead) -> Result<V, Fail> {
    let mut input = Input { r, pos: 0 };
    let mut stack = Stack::default();
    let mut marks: Vec<usize> = Vec::new();
    let mut memo = Memo::default();
    loop {
        let op = input.byte()?;
        match op {
            0x80 => {
                input.byte()?;
            }
            0x95 => {
                input.le(8)?;
            }
            b'.' => return stack.pop(),
            b'(' => marks.push(stack.items.len()),
            b'}' => stack.push_container(&marks, || V::Dict(Rc::default()))?,
            b']' => stack.push_container(&marks, || V::List(Rc::default()))?,
            b')' => stack.push_container(&marks, || V::Tuple(Rc::default()))?,
            b'N' => stack.push(V::None)?,
            0x88 | 0x89 => stack.push(V::Scalar)?,
            b'K' => stack.push(V::Int(i64::from(input.byte()?)))?,
            b'M' => stack.push(V::Int(input.le(2)? as i64))?,
            b'J' => stack.push(V::Int(i64::from(input.le(4)? as u32 as i32)))?,
            0x8a | 0x8b => {
                let n = if op == 0x8a {
                    u64::from(input.byte()?)
                } else {
                    input.le(4)?
                };
                if n > 8 {
                    return Err(format!("integer of {n} bytes").into());
                }
                let n = n as usize;
                let mut v = input.le(n)?;
                let neg = n > 0 && v >> (8 * n - 1) & 1 == 1;
                if neg && n < 8 {
                    v |= u64::MAX << (8 * n);
                }
                stack.push(V::Int(v as i64))?;
            }
            b'G' => {
                input.le(8)?;
                stack.push(V::Scalar)?;
            }
            0x8c | b'X' | 0x8d => {
                let n = match op {
                    0x8c => u64::from(input.byte()?),
                    b'X' => input.le(4)?,
                    _ => input.le(8)?,
                };
                let v = input.text(n)?;
                stack.push(v)?;
            }
            b'C' | b'B' | 0x8e => {
                let n = match op {
                    b'C' => u64::from(input.byte()?),
                    b'B' => input.le(4)?,
                    _ => input.le(8)?,
                };
                input.skip(n)?;
                stack.push(V::Scalar)?;
            }
            0x94 => {
                let top = stack.items.last().ok_or("MEMOIZE of nothing")?.clone();
                memo.put(memo.len(), top);
            }
            b'q' | b'r' => {
                let i = if op == b'q' {
                    u64::from(input.byte()?)
                } else {
                    input.le(4)?
                };
                let top = stack.items.last().ok_or("PUT of nothing")?.clone();
                memo.put(i, top);
            }
            b'h' | b'j' => {
                let i = if op == b'h' {
                    u64::from(input.byte()?)
                } else {
                    input.le(4)?
                };
                let v = memo.get(i).ok_or("GET of an unknown memo")?.clone();
                stack.push(v)?;
            }
            b't' => {
                let items = stack.since_mark(&mut marks)?;
                stack.push_container(&marks, || V::Tuple(Rc::new(items)))?;
            }
            0x85..=0x87 => {
                let n = usize::from(op - 0x84);
                let Some(at) = stack.items.len().checked_sub(n) else {
                    return Err("stack underflow".into());
                };
                let items = stack.split_off(at);
                stack.push_container(&marks, || V::Tuple(Rc::new(items)))?;
            }
            b'a' => {
                let v = stack.pop()?;
                add(stack.items.last(), vec![v], false)?;
            }
            b'e' => {
                let items = stack.since_mark(&mut marks)?;
                add(stack.items.last(), items, false)?;
            }
            b's' => {
                let v = stack.pop()?;
                let k = stack.pop()?;
                add(stack.items.last(), vec![k, v], true)?;
            }
            b'u' => {
                let items = stack.since_mark(&mut marks)?;
                add(stack.items.last(), items, true)?;
            }
            _ => {
                return Err(format!(
                    "unsupported pickle opcode {op:#04x} at byte {} (a snapshot holds only \
                     plain containers and scalars)",
                    input.pos - 1
                )
                .into())
            }
        }
    }
}

fn get(d: &V, key: Name) -> Option<V> {
    match d {
        V::Dict(m) => m
            .borrow()
            .iter()
            .find(|(k, _)| *k == key)
            .map(|(_, v)| v.clone()),
        _ => None,
    }
}

fn int(v: Option<V>) -> Option<u64> {
    match v? {
        V::Int(i) => u64::try_from(i).ok(),
        V::None => Some(0),
        _ => None,
    }
}

fn list(v: &V) -> Option<Vec<V>> {
    match v {
        V::List(l) => Some(l.borrow().clone()),
        V::Tuple(t) => Some(t.to_vec()),
        _ => None,
    }
}

/// Converts a snapshot pickle into plain trace text (one event a line).
///
/// `device`: whose trace to take (default: the first device with entries).
/// Returns the text and the number of events, or why the input is not a
/// usable snapshot.
pub fn snapshot_to_text(r: impl Read, device: Option<usize>) -> Result<(String, u64), String> {
    let v = unpickle(BufReader::new(r)).map_err(|e| e.to_string())?;
    let Some(traces) = get(&v, Name::DeviceTraces).as_ref().and_then(list) else {
        return Err(
            "a pickle, but not a PyTorch memory snapshot (no `device_traces`; \
                    record with torch.cuda.memory._record_memory_history() before \
                    torch.cuda.memory._dump_snapshot())"
                .to_string(),
        );
    };
    let trace = match device {
        Some(d) => traces
            .get(d)
            .and_then(list)
            .ok_or_else(|| format!("the snapshot has no trace for device {d}"))?,
        None => traces
            .iter()
            .filter_map(list)
            .find(|l| !l.is_empty())
            .unwrap_or_default(),
    };
    let mut out = String::new();
    let mut live: HashMap<u64, u64> = HashMap::new();
    let mut next_id = 0u64;
    let mut n = 0u64;
    for (i, e) in trace.iter().enumerate() {
        let bad = |what: &str| format!("trace entry {i}: {what}");
        let action = match get(e, Name::Action) {
            Some(V::Name(a)) => Some(a),
            _ => None,
        };
        match action {
            Some(Name::Alloc) => {
                let addr = int(get(e, Name::Addr)).ok_or_else(|| bad("alloc without addr"))?;
                let size = int(get(e, Name::Size)).ok_or_else(|| bad("alloc without size"))?;
                let stream = int(get(e, Name::Stream)).unwrap_or(0);
                if let Some(old) = live.insert(addr, next_id) {
                    // The trace lost this address's free: close it first.
                    let _ = writeln!(out, "f {old}");
                    n += 1;
                }
                let _ = writeln!(out, "a {next_id} {size} {stream}");
                next_id += 1;
                n += 1;
            }
            Some(Name::FreeRequested) => {
                let addr = int(get(e, Name::Addr)).ok_or_else(|| bad("free without addr"))?;
                if let Some(id) = live.remove(&addr) {
                    let _ = writeln!(out, "f {id}");
                    n += 1;
                }
            }
            _ => {}
        }
    }
    Ok((out, n))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pickle writer for the tests: what Python's protocol 4 emits for
    /// dicts, lists, strings and ints (memoizing every container, as Python does).
    enum P {
        Int(i64),
        Str(&'static str),
        List(Vec<P>),
        Dict(Vec<(&'static str, P)>),
        /// A reference to the memo entry `n` (an object written before).
        Get(u8),
        /// A string, memoized (as Python does with every string).
        StrMemo(&'static str),
    }

    fn write(p: &P, out: &mut Vec<u8>) {
        match p {
            P::Int(i) if (0..256).contains(i) => out.extend([b'K', *i as u8]),
            P::Int(i) if i32::try_from(*i).is_ok() => {
                out.push(b'J');
                out.extend((*i as i32).to_le_bytes());
            }
            P::Int(i) => {
                out.extend([0x8a, 8]);
                out.extend(i.to_le_bytes());
            }
            P::Str(s) => {
                out.extend([0x8c, s.len() as u8]);
                out.extend(s.as_bytes());
            }
            P::List(items) => {
                out.extend([b']', 0x94, b'(']);
                for x in items {
                    write(x, out);
                }
                out.push(b'e');
            }
            P::Dict(items) => {
                out.extend([b'}', 0x94, b'(']);
                for (k, v) in items {
                    write(&P::Str(k), out);
                    write(v, out);
                }
                out.push(b'u');
            }
            P::Get(n) => out.extend([b'h', *n]),
            P::StrMemo(s) => {
                write(&P::Str(s), out);
                out.push(0x94);
            }
        }
    }

    fn pickle(p: &P) -> Vec<u8> {
        let mut out = vec![0x80, 4];
        write(p, &mut out);
        out.push(b'.');
        out
    }

    fn entry(action: &'static str, addr: i64, size: i64, frames: P) -> P {
        P::Dict(vec![
            ("action", P::Str(action)),
            ("addr", P::Int(addr)),
            ("size", P::Int(size)),
            ("stream", P::Int(0)),
            ("frames", frames),
        ])
    }

    #[test]
    fn pairs_allocs_with_free_requested_by_address() {
        // Memo: 0 the outer dict, 1 `segments`, 2 `device_traces`, 3 device
        // 0's list, 4 device 1's list, 5 the first entry, 6 its frames list.
        let frames = P::List(vec![P::Dict(vec![("filename", P::Str("x.py"))])]);
        let snap = P::Dict(vec![
            ("segments", P::List(vec![])),
            (
                "device_traces",
                P::List(vec![
                    P::List(vec![]),
                    P::List(vec![
                        entry("alloc", 0x7f00_0000_0100, 512, frames),
                        // allocated before recording: left out
                        entry("free_requested", 0x10, 8, P::Get(6)),
                        entry("alloc", 0x7f00_0000_0200, 3 << 30, P::Get(6)),
                        entry("segment_alloc", 0x7f00_0000_0100, 2 << 20, P::Get(6)),
                        entry("free_requested", 0x7f00_0000_0100, 512, P::Get(6)),
                        entry("free_completed", 0x7f00_0000_0100, 512, P::Get(6)),
                        entry("alloc", 0x7f00_0000_0100, 256, P::Get(6)),
                        entry("free_requested", 0x7f00_0000_0200, 3 << 30, P::Get(6)),
                    ]),
                ]),
            ),
        ]);
        let bytes = pickle(&snap);
        assert!(is_pickle(&bytes));
        let (text, n) = snapshot_to_text(&bytes[..], None).unwrap();
        assert_eq!(text, "a 0 512 0\na 1 3221225472 0\nf 0\na 2 256 0\nf 1\n");
        assert_eq!(n, 5);
        let events: Vec<_> = cachealloc_core::TraceReader::new(text.as_bytes())
            .collect::<Result<_, _>>()
            .unwrap();
        assert_eq!(events.len(), 5);
        assert!(snapshot_to_text(&bytes[..], Some(0)).unwrap().0.is_empty());
        assert!(snapshot_to_text(&bytes[..], Some(5)).is_err());
    }

    #[test]
    fn negative_and_long_integers() {
        let mut b = vec![0x80, 4, b'(', 0x8a, 1, 0xff, 0x8a, 2, 0x00, 0x01, b'J'];
        b.extend((-5i32).to_le_bytes());
        b.extend([b't', b'.']);
        match &unpickle(&b[..]).ok().unwrap() {
            V::Tuple(t) => {
                let got: Vec<i64> = t
                    .iter()
                    .map(|v| match v {
                        V::Int(i) => *i,
                        _ => panic!("not an int"),
                    })
                    .collect();
                assert_eq!(got, vec![-1, 256, -5]);
            }
            _ => panic!("not a tuple"),
        }
    }

    #[test]
    fn rejects_other_pickles_and_garbage() {
        let other = pickle(&P::Int(3));
        assert!(snapshot_to_text(&other[..], None)
            .unwrap_err()
            .contains("not a PyTorch memory snapshot"));
        for garbage in [
            &[0x80u8, 4, 0xff][..],
            &[0x80, 4, b'}', b'h', 9, b'.'],
            &[0x80, 4, b'e'],
        ] {
            assert!(snapshot_to_text(garbage, None)
                .unwrap_err()
                .contains("not a readable pickle"));
        }
        // A class (GLOBAL) is refused by name, not guessed.
        let class = [0x80, 2, b'c', b'o', b's', b'\n', b'x', b'\n', b'.'];
        assert!(snapshot_to_text(&class[..], None)
            .unwrap_err()
            .contains("unsupported pickle opcode"));
        assert!(!is_pickle(b"a 0 512 0\n"));
        assert!(!is_pickle(&[0x1f, 0x8b]));
    }

    #[test]
    fn strings_inside_frames_stay_readable_through_the_memo() {
        // Memo: 0 the outer dict, 1 `device_traces`, 2 device 0's list, 3
        // the first entry, 4 its frames, 5 the frame, 6 the string
        // `free_requested` (a function name there), 7 the second entry,
        // whose action refers to 6.
        let frames = P::List(vec![P::Dict(vec![("name", P::StrMemo("free_requested"))])]);
        let free = P::Dict(vec![
            ("action", P::Get(6)),
            ("addr", P::Int(0x100)),
            ("frames", P::Get(4)),
        ]);
        let snap = P::Dict(vec![(
            "device_traces",
            P::List(vec![P::List(vec![
                entry("alloc", 0x100, 512, frames),
                free,
            ])]),
        )]);
        let (text, n) = snapshot_to_text(&pickle(&snap)[..], None).unwrap();
        assert_eq!((text.as_str(), n), ("a 0 512 0\nf 0\n", 2));
    }

    /// Runs `f` in a thread with the default stack of spawned threads (2 MiB,
    /// where `scoreboard -j` parses).
    fn in_thread<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
        std::thread::spawn(f).join().unwrap()
    }

    /// `depth` nested lists: `[[[...]]]`.
    fn nested_lists(depth: usize) -> Vec<u8> {
        let mut b = vec![0x80, 4];
        b.resize(2 + depth, b']');
        b.resize(2 + 2 * depth - 1, b'a');
        b.push(b'.');
        b
    }

    #[test]
    fn a_pickle_nested_too_deep_is_an_error_not_a_crash() {
        let err = in_thread(|| snapshot_to_text(&nested_lists(200_000)[..], None)).unwrap_err();
        assert_eq!(err, "pickle nested deeper than 10000 levels");
        let err = in_thread(|| snapshot_to_text(&nested_lists(MAX_NESTING + 1)[..], None));
        assert_eq!(err.unwrap_err(), "pickle nested deeper than 10000 levels");
        // At the limit: read, and dropped, in the thread's stack.
        let err = in_thread(|| snapshot_to_text(&nested_lists(MAX_NESTING)[..], None));
        assert!(err.unwrap_err().contains("not a PyTorch memory snapshot"));
    }

    #[test]
    fn a_deep_chain_made_through_the_memo_drops_without_recursion() {
        // A list, memoized at 0, under an empty dict; then, 300,000 times:
        // a new list goes into the one memo 0 holds and replaces it there,
        // and the old one goes into the dict under a key it does not keep.
        // The stack never holds more than five values, yet the first list
        // ends up 300,000 levels deep, its only owner the stack.
        let mut b = vec![0x80, 2, b']', b'q', 0, b'}'];
        for _ in 0..300_000 {
            b.extend([b'(', b'K', 1, b'h', 0, b']', b'q', 0, b'a', b'u']);
        }
        b.push(b'.');
        let err = in_thread(move || snapshot_to_text(&b[..], None)).unwrap_err();
        assert!(err.contains("not a PyTorch memory snapshot"), "{err}");
    }

    #[test]
    fn unneeded_containers_are_not_built() {
        // `frames`' list and dicts, and the `segments` list, are skipped; the
        // entries keep only the keys the conversion reads.
        let frames = P::List(vec![P::Dict(vec![("filename", P::Str("x.py"))])]);
        let snap = P::Dict(vec![
            ("segments", P::List(vec![P::Dict(vec![])])),
            (
                "device_traces",
                P::List(vec![P::List(vec![entry("alloc", 0x100, 512, frames)])]),
            ),
        ]);
        let v = unpickle(&pickle(&snap)[..]).ok().unwrap();
        let traces = list(&get(&v, Name::DeviceTraces).unwrap()).unwrap();
        let entries = list(&traces[0]).unwrap();
        match &entries[0] {
            V::Dict(d) => {
                let keys: Vec<Name> = d.borrow().iter().map(|(k, _)| *k).collect();
                assert_eq!(keys, [Name::Action, Name::Addr, Name::Size, Name::Stream]);
            }
            _ => panic!("not a dict"),
        }
        match &v {
            V::Dict(d) => assert_eq!(d.borrow().len(), 1),
            _ => panic!("not a dict"),
        }
    }
}
