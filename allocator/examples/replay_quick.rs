//! Policy experiments without the CLI: `replay_quick TRACE.gz CONF [mincap]`.
//! Prints peaks, ratio, driver calls; with `mincap`, bisects the smallest capacity that completes.
use cachealloc_core::replay::{replay, ReplayOptions, ReplayResult};
use cachealloc_core::{Config, TraceEvent, TraceReader};
use std::io::BufReader;
use std::process::{Command, Stdio};

fn load(path: &str) -> Vec<TraceEvent> {
    let child = Command::new("zcat")
        .arg(path)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    TraceReader::new(BufReader::new(child.stdout.unwrap()))
        .map(Result::unwrap)
        .collect()
}

fn run(
    events: &[TraceEvent],
    config: &Config,
    capacity: Option<u64>,
    report: bool,
) -> ReplayResult {
    let opts = ReplayOptions {
        capacity,
        report_at_peak: report,
        ..Default::default()
    };
    replay(|| Ok(events.iter().copied().map(Ok)), config, opts).unwrap()
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let config = Config::parse(&args[2]).unwrap();
    let events = load(&args[1]);
    let r = run(&events, &config, None, true);
    let f = r.fragmentation_at_peak.clone().unwrap();
    print!(
        "{:<28} {:<40} ratio {:.3} alloc {:>6.2}G resv {:>6.2}G calls {:>4} ({}+{}) segs {} inact@peak {:.2}G releasable@peak {:.2}G",
        args[1].rsplit('/').next().unwrap(),
        args[2],
        r.reserved_over_allocated(),
        r.peak_allocated as f64 / 1e9,
        r.peak_reserved as f64 / 1e9,
        r.device_calls(),
        r.stats.num_device_alloc,
        r.stats.num_device_free,
        r.stats.segment.all().peak,
        f.inactive_split as f64 / 1e9,
        f.releasable as f64 / 1e9,
    );
    if args.get(3).map(String::as_str) == Some("segs") {
        println!();
        let mut segs = f.segments.clone();
        segs.sort_by_key(|s| s.size);
        let mut buckets: std::collections::BTreeMap<u64, (u64, u64, u64, u64)> = Default::default();
        for s in &segs {
            let b = buckets.entry(s.size.next_power_of_two()).or_default();
            b.0 += 1;
            b.1 += s.size;
            b.2 += s.size - s.used;
            b.3 += (s.blocks > 1) as u64;
        }
        for (k, (n, total, free, split)) in buckets {
            println!(
                "  segs <= {:>8.1} MiB: {:>4} segs ({:>3} split) total {:>7.3} GB free {:>7.3} GB",
                k as f64 / 1048576.0,
                n,
                split,
                total as f64 / 1e9,
                free as f64 / 1e9
            );
        }
        println!("  peak requested {:.3} GB", r.peak_requested as f64 / 1e9);
    }
    if args.get(3).map(String::as_str) == Some("mincap") {
        let (mut lo, mut hi) = (r.peak_allocated, r.peak_reserved);
        while hi - lo > (2 << 20).max(hi / 1000) {
            let mid = lo + (hi - lo) / 2;
            if run(&events, &config, Some(mid), false).completed() {
                hi = mid;
            } else {
                lo = mid;
            }
        }
        let at = run(&events, &config, Some(hi), false);
        print!(
            " | mincap {:.2}G = {:.3}x (retries {}, calls {})",
            hi as f64 / 1e9,
            hi as f64 / r.peak_allocated as f64,
            at.stats.num_alloc_retries,
            at.device_calls()
        );
    }
    println!();
}
