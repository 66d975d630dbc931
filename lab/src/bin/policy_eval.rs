//! Policy evaluation on perturbed traces, to choose defaults that generalise.
//!
//! ```text
//! cargo run -p lab --release --bin policy_eval -- 'CONF[;CONF...]' TRACE.gz...
//! ```
//! Each trace is replayed as recorded and with
//! 4 jittered variants (every allocation's size scaled by a factor in
//! [0.85, 1.15] drawn from a hash of its id and the seed), and the table gives
//! peak reserved / peak allocated, min-capacity / peak allocated and driver
//! calls for each, plus their mean over the jittered variants.
//! `POLICY_EVAL_VARIANTS=N` replays N jittered variants instead of 4.
use cachealloc_core::replay::{replay, ReplayOptions, ReplayResult};
use cachealloc_core::{Config, TraceEvent};

use lab::load_trace as load;

fn mix(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51afd7ed558ccd);
    x ^= x >> 33;
    x = x.wrapping_mul(0xc4ceb9fe1a85ec53);
    x ^ (x >> 33)
}

fn jitter(events: &[TraceEvent], seed: u64) -> Vec<TraceEvent> {
    events
        .iter()
        .map(|e| match *e {
            TraceEvent::Alloc { id, bytes, stream } if seed > 0 => {
                let u = (mix(id ^ seed.wrapping_mul(0x9e3779b97f4a7c15)) >> 11) as f64
                    / (1u64 << 53) as f64;
                TraceEvent::Alloc {
                    id,
                    bytes: ((bytes as f64) * (0.85 + 0.3 * u)).max(1.0) as u64,
                    stream,
                }
            }
            other => other,
        })
        .collect()
}

fn run(events: &[TraceEvent], config: &Config, capacity: Option<u64>) -> ReplayResult {
    let opts = ReplayOptions {
        capacity,
        report_at_peak: false,
        ..Default::default()
    };
    replay(|| Ok(events.iter().copied().map(Ok)), config, opts).unwrap()
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 3 {
        eprintln!("usage: policy_eval 'CONF[;CONF...]' TRACE.gz...  (env: POLICY_EVAL_VARIANTS=N)");
        std::process::exit(2);
    }
    let configs: Vec<&str> = args[1].split(';').collect();
    let variants: u64 = std::env::var("POLICY_EVAL_VARIANTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&n| n > 0)
        .unwrap_or(4);
    for path in &args[2..] {
        let base = load(path);
        for conf in &configs {
            let config = Config::parse(conf).unwrap();
            let mut sums = (0.0, 0.0, 0.0);
            let mut line = format!("{:<24} {:<60}", path.rsplit('/').next().unwrap(), conf);
            for seed in 0..=variants {
                let events = jitter(&base, seed);
                let r = run(&events, &config, None);
                let py = run(&events, &Config::pytorch(), None);
                let (mut lo, mut hi) = (r.peak_allocated, r.peak_reserved);
                while hi - lo > (2 << 20).max(hi / 1000) {
                    let mid = lo + (hi - lo) / 2;
                    if run(&events, &config, Some(mid)).completed() {
                        hi = mid;
                    } else {
                        lo = mid;
                    }
                }
                let ratio = r.reserved_over_allocated();
                let minc = hi as f64 / r.peak_allocated as f64;
                let calls = r.device_calls() as f64 / py.device_calls() as f64;
                line += &format!(" | {ratio:.3} {minc:.3} {calls:.2}x");
                if config.expandable_segments() {
                    let st = &r.stats;
                    line += &format!(
                        " (map {} unmap {} create {} sync {})",
                        st.num_map, st.num_unmap, st.num_page_create, st.num_sync_all_streams
                    );
                }
                if seed > 0 {
                    let n = variants as f64;
                    sums.0 += ratio / n;
                    sums.1 += minc / n;
                    sums.2 += calls / n;
                }
            }
            println!(
                "{line} || mean jittered {:.3} {:.3} {:.2}x",
                sums.0, sums.1, sums.2
            );
        }
    }
}
