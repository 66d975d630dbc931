//! Quick fidelity check: replay a gz trace file (decompressed via zcat) with a named config.
use cachealloc_core::replay::{replay, ReplayOptions};
use cachealloc_core::{Config, TraceReader};
use std::io::BufReader;
use std::process::{Command, Stdio};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let config = Config::parse(&args[2]).unwrap();
    let r = replay(
        || {
            let child = Command::new("zcat").arg(&args[1]).stdout(Stdio::piped()).spawn().unwrap();
            Ok(TraceReader::new(BufReader::new(child.stdout.unwrap())))
        },
        &config,
        ReplayOptions { capacity: args.get(3).map(|c| c.parse().unwrap()), ..Default::default() },
    )
    .unwrap();
    println!(
        "{} {}: events {} peak_alloc {} peak_reserved {} ratio {:.3} segments_peak {} dev_alloc {} dev_free {} retries {} ooms {} inactive_split_peak {} {:.3}s",
        args[1], config.name, r.events, r.peak_allocated, r.peak_reserved, r.reserved_over_allocated(),
        r.stats.segment.all().peak, r.stats.num_device_alloc, r.stats.num_device_free, r.stats.num_alloc_retries, r.stats.num_ooms,
        r.stats.inactive_split_bytes.all().peak, r.seconds
    );
}
