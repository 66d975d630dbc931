//! `cachealloc compare`: traces × configurations, one table.

use super::format::{grouped, record, size, trace_name, Align, Table};
use super::{
    configs_or, jobs, report_error, threads, trace_config_jobs, CliError, CompareArgs, ConfigArg,
};
use cachealloc::core::replay::{ReplayOptions, ReplayResult};
use cachealloc::trace_file::{replay_file_with_progress, FileError};
use serde_json::{json, Value};
use std::collections::HashSet;
use std::io::{self, Write};
use std::path::PathBuf;

const DEFAULT_CONFIGS: &[&str] = &["pytorch", "default", "segments", "no-caching"];

pub fn run(args: CompareArgs) -> Result<(), CliError> {
    let configs = configs_or(args.configs, DEFAULT_CONFIGS);
    let (jobs, trace_width, config_width) = trace_config_jobs(&args.traces, &configs);
    let capacity = args.capacity;
    let table = Table::new(&[
        ("trace", trace_width, Align::Left),
        ("config", config_width, Align::Left),
        ("peak allocated", 10, Align::Right),
        ("peak reserved", 10, Align::Right),
        ("reserved/alloc", 6, Align::Right),
        ("driver calls", 8, Align::Right),
        ("retries", 5, Align::Right),
        ("OOMs", 5, Align::Right),
        ("seconds", 7, Align::Right),
    ]);

    let mut out = io::stdout().lock();
    if !args.json {
        writeln!(out, "{}", table.header())?;
        out.flush()?;
    }
    let mut failed: HashSet<PathBuf> = HashSet::new();
    let work = |&(trace, config): &(&PathBuf, &ConfigArg),
                slot: &jobs::Slot|
     -> Result<ReplayResult, FileError> {
        let options = ReplayOptions {
            capacity,
            gpu_lag: args.gpu_lag,
            timeline_points: 2,
            report_at_peak: false,
            progress: None,
        };
        replay_file_with_progress(trace, &config.config, options, &mut |p| {
            slot.set(p.fraction())
        })
    };
    jobs::run(
        &jobs,
        threads(args.jobs, jobs.len()),
        "compare",
        work,
        |i, result| {
            let (trace, config) = jobs[i];
            match result {
                Ok(r) => {
                    if args.json {
                        writeln!(
                            out,
                            "{}",
                            Value::Object({
                                let mut m = record(trace, config, capacity, &r);
                                m.insert("gpu_lag".into(), json!(args.gpu_lag));
                                m.insert("gpu_stalled_events".into(), json!(r.gpu_stalled_events));
                                m
                            })
                        )?;
                    } else {
                        let cells = [
                            trace_name(trace),
                            config.label.clone(),
                            size(r.peak_allocated),
                            size(r.peak_reserved),
                            format!("{:.3}", r.reserved_over_allocated()),
                            grouped(r.device_calls()),
                            grouped(r.stats.num_alloc_retries),
                            grouped(r.stats.num_ooms),
                            format!("{:.3}", r.seconds),
                        ];
                        writeln!(out, "{}", table.row(&cells))?;
                    }
                    out.flush()?;
                }
                Err(e) => {
                    // One message per trace, however many configurations fail on it.
                    if failed.insert(trace.clone()) {
                        report_error(&e.to_string());
                    }
                }
            }
            Ok(())
        },
    )?;
    if !args.json {
        let limit = capacity.map_or("no capacity limit".to_string(), |c| {
            format!("simulated device capacity {}", size(c))
        });
        writeln!(
            out,
            "({limit}; GiB = 2^30 bytes; driver calls = device allocations + frees, and VMM calls for expandable segments)"
        )?;
    }
    out.flush()?;
    if failed.is_empty() {
        Ok(())
    } else {
        Err(CliError::Reported)
    }
}
