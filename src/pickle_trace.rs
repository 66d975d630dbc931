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

use serde_pickle::{DeOptions, HashableValue, Value};
use std::collections::HashMap;
use std::fmt::Write as _;
use std::io::Read;

/// Whether `head` starts like a binary pickle (protocol 2 to 5).
pub fn is_pickle(head: &[u8]) -> bool {
    head.len() >= 2 && head[0] == 0x80 && (2..=5).contains(&head[1])
}

fn get<'a>(d: &'a Value, key: &str) -> Option<&'a Value> {
    match d {
        Value::Dict(m) => m.get(&HashableValue::String(key.to_string())),
        _ => None,
    }
}

fn int(v: Option<&Value>) -> Option<u64> {
    match v? {
        Value::I64(i) => u64::try_from(*i).ok(),
        Value::None => Some(0),
        _ => None,
    }
}

fn text(v: Option<&Value>) -> Option<&str> {
    match v? {
        Value::String(s) => Some(s),
        _ => None,
    }
}

/// Converts a snapshot pickle into plain trace text (one event a line).
///
/// `device`: whose trace to take (default: the first device with entries).
/// Returns the text and the number of events, or why the input is not a
/// usable snapshot.
pub fn snapshot_to_text(r: impl Read, device: Option<usize>) -> Result<(String, u64), String> {
    let v = serde_pickle::value_from_reader(r, DeOptions::new().replace_unresolved_globals())
        .map_err(|e| format!("not a readable pickle: {e}"))?;
    let Some(Value::List(traces)) = get(&v, "device_traces") else {
        return Err(
            "a pickle, but not a PyTorch memory snapshot (no `device_traces`; \
                    record with torch.cuda.memory._record_memory_history() before \
                    torch.cuda.memory._dump_snapshot())"
                .to_string(),
        );
    };
    let empty = Vec::new();
    fn entries(t: &Value) -> Option<&Vec<Value>> {
        match t {
            Value::List(l) => Some(l),
            _ => None,
        }
    }
    let trace = match device {
        Some(d) => traces
            .get(d)
            .and_then(entries)
            .ok_or_else(|| format!("the snapshot has no trace for device {d}"))?,
        None => traces
            .iter()
            .filter_map(entries)
            .find(|l| !l.is_empty())
            .unwrap_or(&empty),
    };
    let mut out = String::new();
    let mut live: HashMap<u64, u64> = HashMap::new();
    let mut next_id = 0u64;
    let mut n = 0u64;
    for (i, e) in trace.iter().enumerate() {
        let bad = |what: &str| format!("trace entry {i}: {what}");
        match text(get(e, "action")) {
            Some("alloc") => {
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
            Some("free_requested") => {
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
    use serde_pickle::SerOptions;
    use std::collections::BTreeMap;

    fn entry(action: &str, addr: i64, size: i64, stream: i64) -> Value {
        let mut m = BTreeMap::new();
        let s = |x: &str| HashableValue::String(x.to_string());
        m.insert(s("action"), Value::String(action.to_string()));
        m.insert(s("addr"), Value::I64(addr));
        m.insert(s("size"), Value::I64(size));
        m.insert(s("stream"), Value::I64(stream));
        m.insert(s("frames"), Value::List(vec![]));
        Value::Dict(m)
    }

    fn snapshot(traces: Vec<Vec<Value>>) -> Vec<u8> {
        let mut m = BTreeMap::new();
        m.insert(
            HashableValue::String("segments".into()),
            Value::List(vec![]),
        );
        m.insert(
            HashableValue::String("device_traces".into()),
            Value::List(traces.into_iter().map(Value::List).collect()),
        );
        serde_pickle::value_to_vec(&Value::Dict(m), SerOptions::new()).unwrap()
    }

    #[test]
    fn pairs_allocs_with_free_requested_by_address() {
        let bytes = snapshot(vec![
            vec![],
            vec![
                entry("free_requested", 0x10, 8, 0), // allocated before recording: left out
                entry("alloc", 0x100, 512, 7),
                entry("alloc", 0x200, 1000, 7),
                entry("segment_alloc", 0x100, 2 << 20, 7),
                entry("free_requested", 0x100, 512, 7),
                entry("free_completed", 0x100, 512, 7),
                entry("alloc", 0x100, 256, 0), // address reused: a new id
                entry("free_requested", 0x200, 1000, 7),
            ],
        ]);
        assert!(is_pickle(&bytes));
        let (text, n) = snapshot_to_text(&bytes[..], None).unwrap();
        assert_eq!(text, "a 0 512 7\na 1 1000 7\nf 0\na 2 256 0\nf 1\n");
        assert_eq!(n, 5);
        // The events parse as a trace.
        let events: Vec<_> = cachealloc_core::TraceReader::new(text.as_bytes())
            .collect::<Result<_, _>>()
            .unwrap();
        assert_eq!(events.len(), 5);
        assert!(snapshot_to_text(&bytes[..], Some(0)).unwrap().0.is_empty());
        assert!(snapshot_to_text(&bytes[..], Some(5)).is_err());
    }

    #[test]
    fn rejects_other_pickles_and_garbage() {
        let other = serde_pickle::value_to_vec(&Value::I64(3), SerOptions::new()).unwrap();
        assert!(snapshot_to_text(&other[..], None)
            .unwrap_err()
            .contains("not a PyTorch memory snapshot"));
        let garbage = [0x80u8, 4, 0xff, 0xff];
        assert!(snapshot_to_text(&garbage[..], None)
            .unwrap_err()
            .contains("not a readable pickle"));
        assert!(!is_pickle(b"a 0 512 0\n"));
        assert!(!is_pickle(&[0x1f, 0x8b]));
    }
}
