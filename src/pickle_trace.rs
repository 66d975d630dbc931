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

use std::cell::RefCell;
use std::collections::HashMap;
use std::fmt::Write as _;
use std::io::Read;
use std::rc::Rc;

/// Whether `head` starts like a binary pickle (protocol 2 to 5).
pub fn is_pickle(head: &[u8]) -> bool {
    head.len() >= 2 && head[0] == 0x80 && (2..=5).contains(&head[1])
}

/// A value of the pickle subset that memory snapshots use. Lists and dicts
/// are shared (`Rc`): a pickle refers to an object again by its memo index,
/// and fills a list or dict after memoizing it.
#[derive(Clone, Debug)]
enum V {
    None,
    /// A bool, float or byte string: read past, their values unused.
    Scalar,
    Int(i64),
    Str(Rc<str>),
    List(Rc<RefCell<Vec<V>>>),
    Tuple(Rc<Vec<V>>),
    Dict(Rc<RefCell<Vec<(V, V)>>>),
}

/// Reads the pickle in `data` (Python's protocols 2 to 5, plain containers
/// and scalars only: no classes, which a snapshot never holds).
fn unpickle(data: &[u8]) -> Result<V, String> {
    let mut pos = 0usize;
    let take = |pos: &mut usize, n: usize| -> Result<&[u8], String> {
        let end = pos.checked_add(n).filter(|&e| e <= data.len());
        let end = end.ok_or_else(|| format!("truncated at byte {pos}"))?;
        let s = &data[*pos..end];
        *pos = end;
        Ok(s)
    };
    let le = |b: &[u8]| b.iter().rev().fold(0u64, |a, &x| (a << 8) | u64::from(x));
    let mut stack: Vec<V> = Vec::new();
    let mut marks: Vec<usize> = Vec::new();
    let mut memo: HashMap<u64, V> = HashMap::new();
    let pop = |stack: &mut Vec<V>| stack.pop().ok_or_else(|| "stack underflow".to_string());
    let since_mark = |stack: &mut Vec<V>, marks: &mut Vec<usize>| -> Result<Vec<V>, String> {
        let m = marks.pop().ok_or("no MARK")?;
        if m > stack.len() {
            return Err("MARK above the stack".to_string());
        }
        Ok(stack.split_off(m))
    };
    let text = |b: &[u8]| -> Result<V, String> {
        std::str::from_utf8(b)
            .map(|s| V::Str(Rc::from(s)))
            .map_err(|_| "string is not UTF-8".to_string())
    };
    loop {
        let op = take(&mut pos, 1)?[0];
        match op {
            0x80 => {
                take(&mut pos, 1)?;
            }
            0x95 => {
                take(&mut pos, 8)?;
            }
            b'.' => return pop(&mut stack),
            b'(' => marks.push(stack.len()),
            b'}' => stack.push(V::Dict(Rc::default())),
            b']' => stack.push(V::List(Rc::default())),
            b')' => stack.push(V::Tuple(Rc::new(Vec::new()))),
            b'N' => stack.push(V::None),
            0x88 | 0x89 => stack.push(V::Scalar),
            b'K' => stack.push(V::Int(i64::from(take(&mut pos, 1)?[0]))),
            b'M' => stack.push(V::Int(le(take(&mut pos, 2)?) as i64)),
            b'J' => stack.push(V::Int(i64::from(le(take(&mut pos, 4)?) as u32 as i32))),
            0x8a | 0x8b => {
                let n = if op == 0x8a {
                    usize::from(take(&mut pos, 1)?[0])
                } else {
                    le(take(&mut pos, 4)?) as usize
                };
                let b = take(&mut pos, n)?;
                if n > 8 {
                    return Err(format!("integer of {n} bytes"));
                }
                let neg = b.last().is_some_and(|&x| x & 0x80 != 0);
                let mut v = le(b);
                if neg && n < 8 {
                    v |= u64::MAX << (8 * n);
                }
                stack.push(V::Int(v as i64));
            }
            b'G' => {
                take(&mut pos, 8)?;
                stack.push(V::Scalar);
            }
            0x8c | b'X' | 0x8d => {
                let n = match op {
                    0x8c => usize::from(take(&mut pos, 1)?[0]),
                    b'X' => le(take(&mut pos, 4)?) as usize,
                    _ => le(take(&mut pos, 8)?) as usize,
                };
                let v = text(take(&mut pos, n)?)?;
                stack.push(v);
            }
            b'C' | b'B' | 0x8e => {
                let n = match op {
                    b'C' => usize::from(take(&mut pos, 1)?[0]),
                    b'B' => le(take(&mut pos, 4)?) as usize,
                    _ => le(take(&mut pos, 8)?) as usize,
                };
                take(&mut pos, n)?;
                stack.push(V::Scalar);
            }
            0x94 => {
                let top = stack.last().ok_or("MEMOIZE of nothing")?.clone();
                memo.insert(memo.len() as u64, top);
            }
            b'q' | b'r' => {
                let i = if op == b'q' {
                    u64::from(take(&mut pos, 1)?[0])
                } else {
                    le(take(&mut pos, 4)?)
                };
                let top = stack.last().ok_or("PUT of nothing")?.clone();
                memo.insert(i, top);
            }
            b'h' | b'j' => {
                let i = if op == b'h' {
                    u64::from(take(&mut pos, 1)?[0])
                } else {
                    le(take(&mut pos, 4)?)
                };
                stack.push(memo.get(&i).ok_or("GET of an unknown memo")?.clone());
            }
            b't' => {
                let items = since_mark(&mut stack, &mut marks)?;
                stack.push(V::Tuple(Rc::new(items)));
            }
            0x85..=0x87 => {
                let n = usize::from(op - 0x84);
                if stack.len() < n {
                    return Err("stack underflow".to_string());
                }
                let items = stack.split_off(stack.len() - n);
                stack.push(V::Tuple(Rc::new(items)));
            }
            b'a' => {
                let v = pop(&mut stack)?;
                match stack.last() {
                    Some(V::List(l)) => l.borrow_mut().push(v),
                    _ => return Err("APPEND to a non-list".to_string()),
                }
            }
            b'e' => {
                let items = since_mark(&mut stack, &mut marks)?;
                match stack.last() {
                    Some(V::List(l)) => l.borrow_mut().extend(items),
                    _ => return Err("APPENDS to a non-list".to_string()),
                }
            }
            b's' => {
                let v = pop(&mut stack)?;
                let k = pop(&mut stack)?;
                match stack.last() {
                    Some(V::Dict(d)) => d.borrow_mut().push((k, v)),
                    _ => return Err("SETITEM on a non-dict".to_string()),
                }
            }
            b'u' => {
                let items = since_mark(&mut stack, &mut marks)?;
                if items.len() % 2 != 0 {
                    return Err("SETITEMS with an odd count".to_string());
                }
                match stack.last() {
                    Some(V::Dict(d)) => {
                        let mut d = d.borrow_mut();
                        let mut it = items.into_iter();
                        while let (Some(k), Some(v)) = (it.next(), it.next()) {
                            d.push((k, v));
                        }
                    }
                    _ => return Err("SETITEMS on a non-dict".to_string()),
                }
            }
            _ => {
                return Err(format!(
                    "unsupported pickle opcode {op:#04x} at byte {} (a snapshot holds only \
                     plain containers and scalars)",
                    pos - 1
                ))
            }
        }
    }
}

fn get(d: &V, key: &str) -> Option<V> {
    match d {
        V::Dict(m) => m
            .borrow()
            .iter()
            .find(|(k, _)| matches!(k, V::Str(s) if &**s == key))
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
pub fn snapshot_to_text(mut r: impl Read, device: Option<usize>) -> Result<(String, u64), String> {
    let mut data = Vec::new();
    r.read_to_end(&mut data)
        .map_err(|e| format!("cannot read: {e}"))?;
    let v = unpickle(&data).map_err(|e| format!("not a readable pickle: {e}"))?;
    let Some(traces) = get(&v, "device_traces").as_ref().and_then(list) else {
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
        let action = get(e, "action");
        let action = match &action {
            Some(V::Str(s)) => &**s,
            _ => "",
        };
        match action {
            "alloc" => {
                let addr = int(get(e, "addr")).ok_or_else(|| bad("alloc without addr"))?;
                let size = int(get(e, "size")).ok_or_else(|| bad("alloc without size"))?;
                let stream = int(get(e, "stream")).unwrap_or(0);
                if let Some(old) = live.insert(addr, next_id) {
                    // The trace lost this address's free: close it first.
                    let _ = writeln!(out, "f {old}");
                    n += 1;
                }
                let _ = writeln!(out, "a {next_id} {size} {stream}");
                next_id += 1;
                n += 1;
            }
            "free_requested" => {
                let addr = int(get(e, "addr")).ok_or_else(|| bad("free without addr"))?;
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
        match unpickle(&b).unwrap() {
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
            other => panic!("{other:?}"),
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
}
