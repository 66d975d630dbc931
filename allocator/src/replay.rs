//! Trace replay: drive a [`CachingAllocator`] on a [`SimulatedDevice`]
//! through a trace and measure what it does to memory.
//!
//! A replay makes two passes over the trace: the first measures everything
//! and finds the event at which reserved memory peaked, the second stops
//! there and takes the fragmentation report, so the report describes the
//! peak exactly without taking a report at every new high.

use crate::allocator::CachingAllocator;
use crate::config::Config;
use crate::device::{DevicePtr, StreamId};
use crate::error::AllocError;
use crate::fasthash::FastMap;
use crate::report::FragmentationReport;
use crate::simulated::SimulatedDevice;
use crate::stats::MemoryStats;
use crate::trace::{TraceError, TraceEvent};
use std::time::Instant;

/// One point of the memory timeline.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct TimelinePoint {
    /// Index of the event after which the values were taken.
    pub event: u64,
    /// Allocated bytes.
    pub allocated: u64,
    /// Reserved bytes.
    pub reserved: u64,
    /// Requested bytes.
    pub requested: u64,
}

/// Options of a replay.
pub struct ReplayOptions<'a> {
    /// Capacity of the simulated device (`None`: 1 PiB, in effect unlimited).
    pub capacity: Option<u64>,
    /// About how many timeline points to keep.
    pub timeline_points: usize,
    /// Whether to make the second pass for the fragmentation report at the peak.
    pub report_at_peak: bool,
    /// Called now and then with the number of events replayed so far.
    pub progress: Option<&'a mut dyn FnMut(u64)>,
}

impl Default for ReplayOptions<'_> {
    fn default() -> Self {
        ReplayOptions {
            capacity: None,
            timeline_points: 2000,
            report_at_peak: true,
            progress: None,
        }
    }
}

/// What a replay measured.
#[derive(Clone, Debug, Default)]
pub struct ReplayResult {
    /// Events replayed (alloc, free and empty_cache lines).
    pub events: u64,
    /// Peak allocated bytes (rounded block sizes).
    pub peak_allocated: u64,
    /// Peak reserved bytes.
    pub peak_reserved: u64,
    /// Peak requested bytes.
    pub peak_requested: u64,
    /// Index of the event after which reserved memory first reached its peak.
    pub peak_reserved_event: u64,
    /// Final statistics.
    pub stats: MemoryStats,
    /// Events at which an allocation needed the full flush-and-retry.
    pub retry_events: Vec<u64>,
    /// Events at which an allocation failed with out-of-memory.
    pub oom_events: Vec<u64>,
    /// Fragmentation at the peak of reserved memory (if asked for).
    pub fragmentation_at_peak: Option<FragmentationReport>,
    /// Allocated / reserved / requested bytes over the trace.
    pub timeline: Vec<TimelinePoint>,
    /// Wall-clock seconds of the first (measuring) pass.
    pub seconds: f64,
}

impl ReplayResult {
    /// Peak reserved over peak allocated (1.0 when nothing was allocated).
    pub fn reserved_over_allocated(&self) -> f64 {
        if self.peak_allocated == 0 {
            1.0
        } else {
            self.peak_reserved as f64 / self.peak_allocated as f64
        }
    }

    /// Whether every allocation succeeded.
    pub fn completed(&self) -> bool {
        self.oom_events.is_empty()
    }

    /// Device calls: segment allocations and frees, and virtual-memory calls.
    pub fn device_calls(&self) -> u64 {
        self.stats.device_calls()
    }
}

/// Why a replay stopped.
#[derive(Debug)]
pub enum ReplayError {
    /// The trace could not be read.
    Trace(TraceError),
    /// The allocator failed for a reason other than out-of-memory.
    Alloc {
        /// Event index.
        event: u64,
        /// The error.
        error: AllocError,
    },
}

impl std::fmt::Display for ReplayError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReplayError::Trace(e) => e.fmt(f),
            ReplayError::Alloc { event, error } => write!(f, "event {event}: {error}"),
        }
    }
}

impl std::error::Error for ReplayError {}

impl From<TraceError> for ReplayError {
    fn from(e: TraceError) -> Self {
        ReplayError::Trace(e)
    }
}

/// Replays a trace. `open` yields a fresh event stream each time it is
/// called (twice when `report_at_peak` is set).
pub fn replay<F, I>(
    mut open: F,
    config: &Config,
    mut opts: ReplayOptions<'_>,
) -> Result<ReplayResult, ReplayError>
where
    F: FnMut() -> Result<I, TraceError>,
    I: Iterator<Item = Result<TraceEvent, TraceError>>,
{
    let start = Instant::now();
    let mut result = ReplayResult::default();
    let mut stride = 1u64;
    let keep = opts.timeline_points.max(2);
    let mut run = Run::new(config, opts.capacity);
    let mut peak_reserved = 0;
    for event in open()? {
        let event = event?;
        let index = result.events;
        result.events += 1;
        match run.apply(&event, index)? {
            Outcome::Ok => {}
            Outcome::Retried => result.retry_events.push(index),
            Outcome::Oom => result.oom_events.push(index),
            Outcome::RetriedThenOom => {
                result.retry_events.push(index);
                result.oom_events.push(index);
            }
        }
        let usage = run.alloc.usage();
        if usage.reserved > peak_reserved {
            peak_reserved = usage.reserved;
            result.peak_reserved_event = index;
        }
        if index % stride == 0 {
            result.timeline.push(TimelinePoint {
                event: index,
                allocated: usage.allocated,
                reserved: usage.reserved,
                requested: usage.requested,
            });
            if result.timeline.len() >= 2 * keep {
                let mut i = 0;
                result.timeline.retain(|_| {
                    i += 1;
                    i % 2 == 1
                });
                stride *= 2;
            }
        }
        if index % 65536 == 0 {
            if let Some(p) = opts.progress.as_mut() {
                p(result.events);
            }
        }
    }
    if let Some(p) = opts.progress.as_mut() {
        p(result.events);
    }
    result.seconds = start.elapsed().as_secs_f64();
    result.stats = run.alloc.stats();
    result.peak_allocated = result.stats.allocated_bytes.all().peak;
    result.peak_reserved = result.stats.reserved_bytes.all().peak;
    result.peak_requested = result.stats.requested_bytes.all().peak;
    let usage = run.alloc.usage();
    result.timeline.push(TimelinePoint {
        event: result.events.saturating_sub(1),
        allocated: usage.allocated,
        reserved: usage.reserved,
        requested: usage.requested,
    });
    if opts.report_at_peak && result.events > 0 {
        let mut again = Run::new(config, opts.capacity);
        for (i, event) in open()?.enumerate() {
            again.apply(&event?, i as u64)?;
            if i as u64 == result.peak_reserved_event {
                break;
            }
        }
        result.fragmentation_at_peak = Some(again.alloc.fragmentation());
    }
    Ok(result)
}

enum Outcome {
    Ok,
    Retried,
    Oom,
    RetriedThenOom,
}

/// One replay pass: the allocator and the trace ids of live allocations.
struct Run {
    alloc: CachingAllocator<SimulatedDevice>,
    live: FastMap<u64, Option<DevicePtr>>,
}

impl Run {
    fn new(config: &Config, capacity: Option<u64>) -> Self {
        let device = match capacity {
            Some(c) => SimulatedDevice::new(c),
            None => SimulatedDevice::unlimited(),
        }
        .with_auto_complete(true);
        Run {
            alloc: CachingAllocator::new(device, config.clone()),
            live: FastMap::default(),
        }
    }

    fn apply(&mut self, event: &TraceEvent, index: u64) -> Result<Outcome, ReplayError> {
        let fail = |error| ReplayError::Alloc {
            event: index,
            error,
        };
        match *event {
            TraceEvent::Alloc { id, bytes, stream } => {
                if bytes == 0 {
                    self.live.insert(id, None);
                    return Ok(Outcome::Ok);
                }
                let retries = self.alloc_retries();
                match self.alloc.malloc(bytes, StreamId(stream)) {
                    Ok(p) => {
                        self.live.insert(id, Some(p));
                        Ok(if self.alloc_retries() > retries {
                            Outcome::Retried
                        } else {
                            Outcome::Ok
                        })
                    }
                    Err(AllocError::OutOfMemory(_)) => {
                        self.live.insert(id, None);
                        Ok(if self.alloc_retries() > retries {
                            Outcome::RetriedThenOom
                        } else {
                            Outcome::Oom
                        })
                    }
                    Err(error) => Err(fail(error)),
                }
            }
            TraceEvent::Free { id } => {
                if let Some(Some(p)) = self.live.remove(&id) {
                    self.alloc.free(p).map_err(fail)?;
                }
                Ok(Outcome::Ok)
            }
            TraceEvent::EmptyCache => {
                self.alloc.empty_cache().map_err(fail)?;
                Ok(Outcome::Ok)
            }
        }
    }

    fn alloc_retries(&self) -> u64 {
        self.alloc.usage().num_alloc_retries
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::TraceReader;

    fn run(text: &str, config: &Config, capacity: Option<u64>) -> ReplayResult {
        let opts = ReplayOptions {
            capacity,
            ..Default::default()
        };
        replay(|| Ok(TraceReader::new(text.as_bytes())), config, opts).unwrap()
    }

    #[test]
    fn replay_equals_a_direct_run() {
        let text = "a 0 3000000 0\na 1 1000 0\nf 0\na 2 50000000 0\nf 1\ne\na 3 700 0\nf 2\nf 3\n";
        let r = run(text, &Config::pytorch(), None);
        let dev = SimulatedDevice::unlimited();
        let a = CachingAllocator::new(dev, Config::pytorch());
        let p0 = a.malloc(3_000_000, StreamId(0)).unwrap();
        let p1 = a.malloc(1000, StreamId(0)).unwrap();
        a.free(p0).unwrap();
        let p2 = a.malloc(50_000_000, StreamId(0)).unwrap();
        a.free(p1).unwrap();
        a.empty_cache().unwrap();
        let p3 = a.malloc(700, StreamId(0)).unwrap();
        a.free(p2).unwrap();
        a.free(p3).unwrap();
        assert_eq!(r.stats, a.stats());
        assert_eq!(r.events, 9);
        assert_eq!(r.peak_reserved, a.stats().reserved_bytes.all().peak);
        assert_eq!(r.peak_reserved_event, 3);
        let report = r.fragmentation_at_peak.clone().unwrap();
        assert_eq!(report.reserved, r.peak_reserved);
        assert!(r.completed());
    }

    #[test]
    fn ooms_are_counted_and_replay_goes_on() {
        let text = "a 0 60000000 0\na 1 60000000 0\nf 0\na 2 1000 0\nf 2\n";
        let r = run(text, &Config::pytorch(), Some(100 << 20));
        assert_eq!(r.oom_events, vec![1]);
        assert_eq!(r.retry_events, vec![1]);
        assert_eq!(r.stats.num_ooms, 1);
        assert!(!r.completed());
        assert_eq!(r.events, 5);
    }

    #[test]
    fn timeline_is_thinned_but_keeps_the_ends() {
        let mut text = String::new();
        for i in 0..10_000 {
            text += &format!("a {i} {} 0\nf {i}\n", 512 * (1 + i % 50));
        }
        let opts = ReplayOptions {
            timeline_points: 100,
            ..Default::default()
        };
        let r = replay(
            || Ok(TraceReader::new(text.as_bytes())),
            &Config::default(),
            opts,
        )
        .unwrap();
        assert!(
            r.timeline.len() <= 201 && r.timeline.len() >= 100,
            "{}",
            r.timeline.len()
        );
        assert_eq!(r.timeline[0].event, 0);
        assert_eq!(r.timeline.last().unwrap().event, 19_999);
    }
}
