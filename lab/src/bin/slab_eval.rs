//! What would slabs for small requests cost in fragmentation? Replays
//! traces under the slab model of [`lab::slab_study`].
//!
//! ```text
//! cargo run -p lab --release --bin slab_eval -- LIMIT_KIB TRACE.gz...
//! ```
//! Prints, over the bins-only `default`'s peak allocated bytes: peak
//! reserved, min-capacity (the smallest device that replays the trace, to
//! 0.1%), device calls over `pytorch`'s, and the share of operations the
//! slabs took. `FOREIGN_OPS=0` leaves the slab operations off the core's
//! operation clock.

use cachealloc_core::Config;
use cachealloc_core::SLAB_MAX;
use lab::slab_study::{bins_default, replay, Study};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 3 {
        eprintln!("usage: slab_eval LIMIT_KIB TRACE.gz...  (env: FOREIGN_OPS=0)");
        std::process::exit(2);
    }
    let limit: u64 = match args[1].parse::<u64>() {
        Ok(kib) if kib * 1024 <= SLAB_MAX => kib * 1024,
        _ => {
            eprintln!(
                "LIMIT_KIB must be a number of KiB up to 1024, got {:?}",
                args[1]
            );
            std::process::exit(2);
        }
    };
    let base = Study {
        limit: 0,
        config: bins_default(),
        tick: true,
    };
    let study = Study {
        limit,
        config: bins_default(),
        tick: std::env::var("FOREIGN_OPS").map_or(true, |v| v != "0"),
    };
    for path in &args[2..] {
        let events = lab::load_trace(path);
        let b = base.replay(&events, None).expect("unlimited");
        let pytorch = replay(&events, 0, &Config::pytorch(), None, true).expect("unlimited");
        let run = study.replay(&events, None).expect("unlimited");
        let hi = run.peak_reserved.max(b.peak_reserved) * 3 / 2;
        let cap_base = base.min_capacity(&events, b.peak_allocated / 2, hi);
        let cap = study.min_capacity(&events, b.peak_allocated / 2, hi);
        let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
        let pa = b.peak_allocated as f64;
        println!(
            "{:<24} slabs <= {:>4} KiB{}: {:>4.1}% of ops in slabs | reserved / allocated {:.3} (default {:.3}) | min-capacity {:.3} (default {:.3}) | calls {:.2}x PyTorch's (default {:.2}x) | slabs at most {:.3} GiB",
            path.rsplit('/').next().unwrap_or(path),
            limit / 1024,
            if study.tick { "" } else { ", slab ops off the clock" },
            100.0 * run.slab_share,
            run.peak_reserved as f64 / pa,
            b.peak_reserved as f64 / pa,
            cap as f64 / pa,
            cap_base as f64 / pa,
            run.calls as f64 / pytorch.calls as f64,
            b.calls as f64 / pytorch.calls as f64,
            gib(run.peak_slabs),
        );
    }
}
