//! `cachealloc replay`: one trace, one configuration, a full report.

use super::format::{grouped, human, rate, record, size, trace_name};
use super::progress::Progress;
use super::{plot, CliError, ReplayArgs};
use cachealloc::core::replay::{ReplayOptions, ReplayResult};
use cachealloc::trace_file::replay_file_with_progress;
use serde_json::{json, Value};
use std::fmt::Write as _;
use std::io::{self, Write};

/// Buckets of events in a plot (each gives its lowest and highest point).
const PLOT_BUCKETS: usize = 1500;

pub fn run(args: ReplayArgs) -> Result<(), CliError> {
    let name = trace_name(&args.trace);
    let mut progress = Progress::new(&format!("replay {}", short_name(&args.trace)));
    let options = ReplayOptions {
        capacity: args.capacity,
        gpu_lag: args.gpu_lag,
        timeline_points: if args.plot.is_some() { PLOT_BUCKETS } else { 2 },
        report_at_peak: true,
        progress: None,
    };
    let result = replay_file_with_progress(&args.trace, &args.config.config, options, &mut |p| {
        progress.set(p.fraction(), &format!("{} events", grouped(p.events)));
    })?;
    progress.finish();

    if let Some(path) = &args.plot {
        let title = format!("{name} — config {}", args.config.label);
        plot::write(path, &title, &result, args.capacity).map_err(|e| {
            CliError::Message(format!("{}: cannot write the plot: {e}", path.display()))
        })?;
    }

    let mut out = io::stdout().lock();
    if args.json {
        let mut m = record(&args.trace, &args.config, args.capacity, &result);
        m.insert("gpu_lag".into(), json!(args.gpu_lag));
        m.insert(
            "gpu_stalled_events".into(),
            json!(result.gpu_stalled_events),
        );
        m.insert(
            "peak_reserved_event".into(),
            json!(result.peak_reserved_event),
        );
        m.insert("retry_events".into(), json!(result.retry_events.len()));
        m.insert("oom_events".into(), json!(result.oom_events.len()));
        m.insert("first_oom_event".into(), json!(result.oom_events.first()));
        if let Some(f) = &result.fragmentation_at_peak {
            m.insert("segments_at_peak".into(), json!(f.segments.len()));
            m.insert(
                "fragmentation_at_peak".into(),
                json!({
                    "allocated_bytes": f.allocated,
                    "reserved_bytes": f.reserved,
                    "free_bytes": f.free,
                    "reserved_minus_allocated_bytes": f.reserved_unallocated(),
                    "inactive_split_bytes": f.inactive_split,
                    "releasable_bytes": f.releasable,
                    "largest_free_block_bytes": f.largest_free_block,
                    "external_fragmentation": f.external_fragmentation(),
                    "unused_fraction": f.unused_fraction(),
                    "segments": f.segments.len(),
                }),
            );
        }
        if let Some(p) = &args.plot {
            m.insert("plot".into(), json!(p.display().to_string()));
        }
        writeln!(out, "{}", Value::Object(m))?;
    } else {
        out.write_all(
            summary(
                &name,
                &args.config.label,
                args.capacity,
                args.gpu_lag,
                &result,
            )
            .as_bytes(),
        )?;
        if let Some(p) = &args.plot {
            writeln!(out, "\nplot written to {}", p.display())?;
        }
    }
    out.flush()?;
    Ok(())
}

fn short_name(path: &std::path::Path) -> String {
    path.file_name().map_or_else(
        || path.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    )
}

/// The readable report of one replay.
fn summary(
    trace: &str,
    config: &str,
    capacity: Option<u64>,
    gpu_lag: Option<u64>,
    r: &ReplayResult,
) -> String {
    let s = &r.stats;
    let mut o = String::new();
    let bytes = |b: u64| format!("{:>10}  {:>18} B", size(b), grouped(b));
    let _ = writeln!(o, "trace                 {trace}");
    let _ = writeln!(o, "config                {config}");
    let _ = writeln!(
        o,
        "device capacity       {}",
        capacity.map_or("unlimited".to_string(), |c| format!(
            "{} ({} B)",
            human(c),
            grouped(c)
        ))
    );
    if let Some(lag) = gpu_lag {
        let _ = writeln!(o, "gpu lag               {lag} trace events");
    }
    let _ = writeln!(o, "events                {}", grouped(r.events));
    let _ = writeln!(o, "peak allocated        {}", bytes(r.peak_allocated));
    let _ = writeln!(o, "peak reserved         {}", bytes(r.peak_reserved));
    let _ = writeln!(o, "peak requested        {}", bytes(r.peak_requested));
    let _ = writeln!(
        o,
        "reserved / allocated  {:.3}",
        r.reserved_over_allocated()
    );
    let _ = writeln!(
        o,
        "device allocs / frees {} / {}  ({} driver calls)",
        grouped(s.num_device_alloc),
        grouped(s.num_device_free),
        grouped(r.device_calls())
    );
    if s.num_map > 0 {
        let _ = writeln!(
            o,
            "page maps / unmaps    {} / {}  ({} taken back with no call)",
            grouped(s.num_map),
            grouped(s.num_unmap),
            grouped(s.num_pages_revived)
        );
    }
    let _ = writeln!(
        o,
        "waits                 {} for stream markers, {} for events in all, {} device syncs",
        grouped(s.num_marker_waits),
        grouped(s.num_event_waits),
        grouped(s.num_sync_all_streams)
    );
    if gpu_lag.is_some() {
        let _ = writeln!(
            o,
            "host stalled         {} trace events of device work waited out",
            grouped(r.gpu_stalled_events)
        );
    }
    let _ = writeln!(
        o,
        "alloc retries         {}{}",
        grouped(s.num_alloc_retries),
        first_events(&r.retry_events)
    );
    let _ = writeln!(
        o,
        "OOMs                  {}{}",
        grouped(s.num_ooms),
        first_events(&r.oom_events)
    );
    if let Some(f) = &r.fragmentation_at_peak {
        let _ = writeln!(
            o,
            "segments at peak      {}",
            grouped(f.segments.len() as u64)
        );
    }
    let _ = writeln!(
        o,
        "time                  {:.3} s  ({})",
        r.seconds,
        rate(r.events, r.seconds)
    );
    if let Some(f) = &r.fragmentation_at_peak {
        let _ = writeln!(o);
        let _ = writeln!(
            o,
            "at the peak of reserved memory (after event {}):",
            grouped(r.peak_reserved_event)
        );
        let _ = write!(o, "{f}");
    }
    o
}

/// `  (at events 12, 40, 77, …)` for a list of event indices.
fn first_events(events: &[u64]) -> String {
    if events.is_empty() {
        return String::new();
    }
    let shown: Vec<String> = events.iter().take(5).map(|&e| grouped(e)).collect();
    let more = if events.len() > 5 { ", …" } else { "" };
    let noun = if events.len() == 1 { "event" } else { "events" };
    format!("  (at {noun} {}{more})", shown.join(", "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn event_lists() {
        assert_eq!(first_events(&[]), "");
        assert_eq!(first_events(&[7]), "  (at event 7)");
        assert_eq!(
            first_events(&[1, 2, 3, 4, 5, 6000]),
            "  (at events 1, 2, 3, 4, 5, …)"
        );
    }
}
