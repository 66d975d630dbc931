//! A detailed timeline for `--plot`: per bucket of events, the lowest and
//! highest allocated / reserved / requested bytes (with their events), so
//! that a plot shows every spike, and the exact event of peak allocated.
//!
//! The core's `ReplayResult::timeline` samples one event in N, which loses
//! short spikes (the peak of allocated memory among them). Until the core
//! keeps per-bucket extremes, this pass replays the trace once more through
//! the public allocator API, applying events exactly as the core's replay
//! does (a test checks the statistics agree).

use cachealloc::core::{
    AllocError, CachingAllocator, Config, DevicePtr, MemoryStats, SimulatedDevice, StreamId,
    TraceEvent,
};
use cachealloc::trace_file::{self, FileError, FileErrorKind};
use std::collections::HashMap;
use std::path::Path;

/// The lowest and highest value of a series within a bucket, with their events.
#[derive(Copy, Clone, Debug)]
struct Extremes {
    min: (u64, u64),
    max: (u64, u64),
}

impl Extremes {
    fn new(event: u64, value: u64) -> Self {
        Extremes {
            min: (event, value),
            max: (event, value),
        }
    }

    fn add(&mut self, event: u64, value: u64) {
        if value < self.min.1 {
            self.min = (event, value);
        }
        if value > self.max.1 {
            self.max = (event, value);
        }
    }

    /// The two points in the order they happened.
    fn push_to(&self, out: &mut Vec<(u64, u64)>) {
        let (a, b) = if self.min.0 <= self.max.0 {
            (self.min, self.max)
        } else {
            (self.max, self.min)
        };
        out.push(a);
        if b.0 != a.0 {
            out.push(b);
        }
    }
}

/// Series of (event, bytes) points, spikes kept.
#[derive(Debug, Default)]
pub struct Timeline {
    /// Allocated bytes.
    pub allocated: Vec<(u64, u64)>,
    /// Reserved bytes.
    pub reserved: Vec<(u64, u64)>,
    /// Requested bytes.
    pub requested: Vec<(u64, u64)>,
    /// Event after which allocated memory first reached its peak.
    pub peak_allocated_event: u64,
    /// Events replayed.
    pub events: u64,
    /// Final statistics (for the consistency check).
    pub stats: MemoryStats,
}

/// Replays `path` and records about `buckets` buckets of extremes.
pub fn detailed(
    path: &Path,
    config: &Config,
    capacity: Option<u64>,
    expected_events: u64,
    buckets: u64,
) -> Result<Timeline, FileError> {
    let per_bucket = expected_events.div_ceil(buckets.max(1)).max(1);
    let device = match capacity {
        Some(c) => SimulatedDevice::new(c),
        None => SimulatedDevice::unlimited(),
    }
    .with_auto_complete(true);
    let alloc = CachingAllocator::new(device, config.clone());
    let mut live: HashMap<u64, Option<DevicePtr>> = HashMap::new();
    let mut t = Timeline::default();
    let mut current: Option<[Extremes; 3]> = None;
    let mut peak_allocated = 0;
    let fail = |event: u64, error: AllocError| FileError {
        path: path.to_path_buf(),
        kind: FileErrorKind::Alloc { event, error },
    };
    for event in trace_file::open(path)? {
        let index = t.events;
        t.events += 1;
        match event? {
            TraceEvent::Alloc { id, bytes, stream } => {
                let p = if bytes == 0 {
                    None
                } else {
                    match alloc.malloc(bytes, StreamId(stream)) {
                        Ok(p) => Some(p),
                        Err(AllocError::OutOfMemory(_)) => None,
                        Err(e) => return Err(fail(index, e)),
                    }
                };
                live.insert(id, p);
            }
            TraceEvent::Free { id } => {
                if let Some(Some(p)) = live.remove(&id) {
                    alloc.free(p).map_err(|e| fail(index, e))?;
                }
            }
            TraceEvent::EmptyCache => {
                alloc.empty_cache().map_err(|e| fail(index, e))?;
            }
        }
        let u = alloc.usage();
        if u.allocated > peak_allocated {
            peak_allocated = u.allocated;
            t.peak_allocated_event = index;
        }
        let values = [u.allocated, u.reserved, u.requested];
        match current.as_mut() {
            Some(ex) => ex.iter_mut().zip(values).for_each(|(e, v)| e.add(index, v)),
            None => current = Some(values.map(|v| Extremes::new(index, v))),
        }
        if (index + 1) % per_bucket == 0 {
            t.flush(current.take());
        }
    }
    t.flush(current.take());
    t.stats = alloc.stats();
    Ok(t)
}

impl Timeline {
    fn flush(&mut self, bucket: Option<[Extremes; 3]>) {
        if let Some([a, r, q]) = bucket {
            a.push_to(&mut self.allocated);
            r.push_to(&mut self.reserved);
            q.push_to(&mut self.requested);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cachealloc::core::replay::ReplayOptions;
    use cachealloc::trace_file::{replay_file, write_all};

    #[test]
    fn keeps_spikes_and_agrees_with_the_core() {
        let dir = std::env::temp_dir().join(format!("cachealloc-timeline-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("spiky.trace");
        let mut events = Vec::new();
        for i in 0..5000u64 {
            events.push(TraceEvent::Alloc {
                id: i,
                bytes: 1 << 20,
                stream: 0,
            });
            if i == 3333 {
                events.push(TraceEvent::Alloc {
                    id: 1_000_000,
                    bytes: 1 << 30,
                    stream: 0,
                });
                events.push(TraceEvent::Free { id: 1_000_000 });
            }
            events.push(TraceEvent::Free { id: i });
        }
        write_all(&path, &events).unwrap();
        let config = Config::pytorch();
        let core = replay_file(
            &path,
            &config,
            ReplayOptions {
                capacity: Some(4 << 30),
                ..Default::default()
            },
        )
        .unwrap();
        let t = detailed(&path, &config, Some(4 << 30), core.events, 100).unwrap();
        assert_eq!(t.stats, core.stats);
        assert_eq!(t.events, core.events);
        let max = t.allocated.iter().map(|p| p.1).max().unwrap();
        assert_eq!(max, core.peak_allocated, "the one-event spike is kept");
        assert_eq!(t.peak_allocated_event, 2 * 3333 + 1);
        assert!(t.allocated.len() <= 200 && t.allocated.len() >= 100);
        assert!(t.allocated.windows(2).all(|w| w[0].0 < w[1].0));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
