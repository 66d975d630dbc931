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

/// Allocated, reserved and requested bytes over a replay, as `(event, bytes)`
/// points: for every bucket of consecutive events, the lowest and the highest
/// value with the events they occurred at, so a plot shows every spike.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Timeline {
    /// Bytes allocated to callers.
    pub allocated: Vec<(u64, u64)>,
    /// Bytes held from the device.
    pub reserved: Vec<(u64, u64)>,
    /// Bytes callers asked for.
    pub requested: Vec<(u64, u64)>,
}

/// The lowest and highest (event, value) of one series within a bucket.
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

    fn merge(&mut self, other: &Extremes) {
        self.add(other.min.0, other.min.1);
        self.add(other.max.0, other.max.1);
    }

    /// The one or two points, in the order they happened.
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

/// Buckets of aligned runs of events; when there are too many, neighbours
/// merge and the bucket length doubles, so memory stays bounded on a
/// stream of unknown length.
struct TimelineBuilder {
    buckets: Vec<[Extremes; 3]>,
    len: u64,
    keep: usize,
}

impl TimelineBuilder {
    fn new(keep: usize) -> Self {
        TimelineBuilder {
            buckets: Vec::with_capacity(2 * keep),
            len: 1,
            keep,
        }
    }

    fn add(&mut self, event: u64, values: [u64; 3]) {
        if (event / self.len) as usize >= self.buckets.len() {
            if self.buckets.len() >= 2 * self.keep {
                let merged = self
                    .buckets
                    .chunks(2)
                    .map(|pair| {
                        let mut m = pair[0];
                        if let Some(b) = pair.get(1) {
                            m.iter_mut().zip(b).for_each(|(x, y)| x.merge(y));
                        }
                        m
                    })
                    .collect();
                self.buckets = merged;
                self.len *= 2;
            }
            if (event / self.len) as usize >= self.buckets.len() {
                self.buckets.push(values.map(|v| Extremes::new(event, v)));
                return;
            }
        }
        let last = self.buckets.last_mut().expect("a bucket exists");
        last.iter_mut()
            .zip(values)
            .for_each(|(e, v)| e.add(event, v));
    }

    fn finish(self) -> Timeline {
        let mut t = Timeline::default();
        for [a, r, q] in &self.buckets {
            a.push_to(&mut t.allocated);
            r.push_to(&mut t.reserved);
            q.push_to(&mut t.requested);
        }
        t
    }
}

/// Options of a replay.
pub struct ReplayOptions<'a> {
    /// Capacity of the simulated device (`None`: 1 PiB, in effect unlimited).
    pub capacity: Option<u64>,
    /// How far the simulated device runs behind the host, in trace events
    /// (`None`: every event completes at once). The allocator's markers and
    /// the events guarding blocks then complete only that many allocations
    /// and frees after they were recorded, so the waits for them show.
    pub gpu_lag: Option<u64>,
    /// About how many buckets of events the timeline keeps (each gives the
    /// lowest and highest value of each series).
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
            gpu_lag: None,
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
    /// With [`ReplayOptions::gpu_lag`]: the device work, in trace events, that
    /// the allocator's blocking waits waited out (0 without a lag).
    pub gpu_stalled_events: u64,
    /// Index of the event after which reserved memory first reached its peak.
    pub peak_reserved_event: u64,
    /// Index of the event after which allocated memory first reached its peak.
    pub peak_allocated_event: u64,
    /// Final statistics.
    pub stats: MemoryStats,
    /// Events at which an allocation needed the full flush-and-retry.
    pub retry_events: Vec<u64>,
    /// Events at which an allocation failed with out-of-memory.
    pub oom_events: Vec<u64>,
    /// Fragmentation at the peak of reserved memory (if asked for).
    pub fragmentation_at_peak: Option<FragmentationReport>,
    /// Allocated / reserved / requested bytes over the trace, spikes kept.
    pub timeline: Timeline,
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
    let mut timeline = TimelineBuilder::new(opts.timeline_points.max(1));
    let mut run = Run::new(config, opts.capacity, opts.gpu_lag);
    let (mut peak_reserved, mut peak_allocated) = (0, 0);
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
        if usage.allocated > peak_allocated {
            peak_allocated = usage.allocated;
            result.peak_allocated_event = index;
        }
        timeline.add(index, [usage.allocated, usage.reserved, usage.requested]);
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
    result.gpu_stalled_events = run.behind.as_ref().map_or(0, |d| d.counters().stalled_ops);
    result.peak_allocated = result.stats.allocated_bytes.all().peak;
    result.peak_reserved = result.stats.reserved_bytes.all().peak;
    result.peak_requested = result.stats.requested_bytes.all().peak;
    result.timeline = timeline.finish();
    // The first pass's allocator goes before the second is built: a trace
    // over many streams holds as many records in each.
    drop(run);
    if opts.report_at_peak && result.events > 0 {
        let mut again = Run::new(config, opts.capacity, opts.gpu_lag);
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
    /// The device, when it runs behind the host (ticked once per event).
    behind: Option<SimulatedDevice>,
    live: FastMap<u64, Option<DevicePtr>>,
}

impl Run {
    fn new(config: &Config, capacity: Option<u64>, gpu_lag: Option<u64>) -> Self {
        let device = match capacity {
            Some(c) => SimulatedDevice::new(c),
            None => SimulatedDevice::unlimited(),
        }
        .with_auto_complete(true)
        .with_event_lag(gpu_lag);
        Run {
            behind: gpu_lag.map(|_| device.clone()),
            alloc: CachingAllocator::new(device, config.clone()),
            live: FastMap::default(),
        }
    }

    fn apply(&mut self, event: &TraceEvent, index: u64) -> Result<Outcome, ReplayError> {
        if let Some(dev) = &self.behind {
            dev.tick();
        }
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
    use std::collections::VecDeque;

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

    /// A trace over `streams` streams: each allocates three blocks of mixed
    /// sizes per round (small and large pools) and keeps the last four.
    fn many_streams(streams: u64, rounds: u64) -> String {
        let sizes = [4096, 65536, 1 << 20, 3 << 20, 12 << 20, 40 << 20];
        let mut text = String::new();
        let mut live: Vec<VecDeque<u64>> = vec![VecDeque::new(); streams as usize];
        let mut id = 0;
        for r in 0..rounds {
            for s in 0..streams {
                for k in 0..3 {
                    let bytes = sizes[((s * 7 + r * 3 + k) % 6) as usize];
                    text += &format!("a {id} {bytes} {}\n", s + 1);
                    live[s as usize].push_back(id);
                    id += 1;
                }
                while live[s as usize].len() > 4 {
                    text += &format!("f {}\n", live[s as usize].pop_front().unwrap());
                }
            }
        }
        text
    }

    /// Work counters of one replay pass over `text`, which must complete
    /// with no out-of-memory and no device-wide synchronize.
    fn work_counters(config: &Config, text: &str) -> [(&'static str, u64); 6] {
        let mut run = Run::new(config, None, None);
        let mut events = 0;
        for (i, event) in TraceReader::new(text.as_bytes()).enumerate() {
            let outcome = run.apply(&event.unwrap(), i as u64).unwrap();
            assert!(
                !matches!(outcome, Outcome::Oom | Outcome::RetriedThenOom),
                "{}: out of memory at event {i}",
                config.name
            );
            events += 1;
        }
        let stats = run.alloc.stats();
        assert_eq!(stats.num_sync_all_streams, 0, "{}", config.name);
        let dev = run.alloc.device().counters();
        [
            ("events", events),
            ("device calls", stats.device_calls()),
            ("events recorded", dev.events_recorded),
            ("event queries", dev.event_queries),
            ("event waits", dev.event_waits),
            ("stream waits", dev.stream_waits),
        ]
    }

    /// Thousands of streams replay without running out of address space
    /// (expandable ranges were 256 GiB each) and without a device-wide
    /// synchronize, under every preset, and ten times the streams (ten
    /// times the events) cost at most about ten times the device calls,
    /// event records, event queries and waits, not a hundred.
    ///
    /// The counts are deterministic, so the result does not depend on the
    /// machine's load. They do not see the allocator's own CPU work, such
    /// as the scans of every pool's bins (800 streams took 21 s) or of
    /// every segment before growing (5,000 streams took 5 s with
    /// `default`): a regression of that kind shows in replay times
    /// (`ReplayResult::seconds`), not here.
    #[test]
    fn many_streams_replay_with_work_proportional_to_events() {
        let configs = [
            Config::expandable(),
            Config::parse("pytorch,expandable_segments:True").unwrap(),
            Config::pytorch(),
            Config::default(),
            Config::no_caching(),
        ];
        let (small, large) = (many_streams(300, 3), many_streams(3000, 3));
        for config in &configs {
            let s = work_counters(config, &small);
            let l = work_counters(config, &large);
            assert_eq!(l[0].1, 10 * s[0].1, "ten times the events");
            for ((name, s), (_, l)) in s.iter().zip(&l).skip(1) {
                assert!(
                    *l <= 20 * s + 100,
                    "{}: {name}: {s} with 300 streams, {l} with 3000",
                    config.name
                );
            }
        }
    }

    #[test]
    fn timeline_keeps_spikes_and_both_ends() {
        let mut text = String::new();
        for i in 0..10_000 {
            text += &format!("a {i} {} 0\nf {i}\n", 512 * (1 + i % 50));
            if i == 3333 {
                text += "a 99999 1073741824 0\nf 99999\n";
            }
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
        let t = &r.timeline;
        for series in [&t.allocated, &t.reserved, &t.requested] {
            assert!(
                series.len() <= 400 && series.len() >= 100,
                "{}",
                series.len()
            );
            assert!(series.windows(2).all(|w| w[0].0 < w[1].0), "in event order");
            // The first and last buckets are at the ends (their extremes need not be the end events).
            assert!(series[0].0 < r.events / 50);
            assert!(series.last().unwrap().0 > r.events - r.events / 50);
        }
        let max = |s: &[(u64, u64)]| s.iter().map(|p| p.1).max().unwrap();
        assert_eq!(
            max(&t.allocated),
            r.peak_allocated,
            "the one-event spike is kept"
        );
        assert_eq!(max(&t.reserved), r.peak_reserved);
        assert_eq!(r.peak_allocated_event, 2 * 3333 + 2);
        assert_eq!(r.peak_allocated, 1 << 30);
    }
}
