//! What an `ops` corpus covers: how many ops of each kind it decodes to, per
//! configuration, and the shared model's situation counters (cache hits,
//! OOMs by cause, guarded frees, each misuse, ...), summed over the corpus.
//! `cargo run --release --example ops_coverage -- fuzz/corpus/ops`

use cachealloc_fuzz::ops::{options, presets};
use cachealloc_model::{self as model, Op};
use std::collections::BTreeMap;

fn kind(op: &Op) -> &'static str {
    match op {
        Op::Malloc { size: 0, .. } => "malloc(0)",
        Op::Malloc { size, .. } if *size > cachealloc_core::MAX_REQUEST => "malloc(> MAX_REQUEST)",
        Op::Malloc { .. } => "malloc",
        Op::Free { .. } => "free",
        Op::DoubleFree { .. } => "double free",
        Op::ForeignFree { .. } => "foreign free",
        Op::InteriorFree { .. } => "interior free",
        Op::RecordStream { .. } => "record_stream",
        Op::RecordStreamStale { .. } => "record_stream of a freed pointer",
        Op::CompleteEvent { .. } => "complete an event",
        Op::CompleteAllEvents => "complete all events",
        Op::ProcessEvents => "process_events",
        Op::EmptyCache => "empty_cache",
        Op::SetCap(_) => "set_memory_cap",
        Op::FailNext(_) => "fail next allocations",
        Op::FailAbove(_) => "fail allocations above",
        Op::ResetPeak => "reset_peak_stats",
    }
}

fn main() {
    let dir = std::env::args().nth(1).expect("a corpus directory");
    let mut ops: BTreeMap<&str, u64> = BTreeMap::new();
    let mut configs: BTreeMap<String, u64> = BTreeMap::new();
    let mut situations: BTreeMap<&str, u64> = BTreeMap::new();
    let (mut inputs, mut total) = (0, 0);
    for entry in std::fs::read_dir(&dir).expect("the corpus") {
        let data = std::fs::read(entry.unwrap().path()).unwrap();
        let Some((&choice, rest)) = data.split_first() else {
            continue;
        };
        let (mut setup, decoded) = model::decode(rest);
        if choice >= 128 {
            let p = presets();
            setup.config = p[usize::from(choice) % p.len()].clone();
        }
        inputs += 1;
        total += decoded.len();
        *configs.entry(setup.config.name().to_string()).or_default() += 1;
        for op in &decoded {
            *ops.entry(kind(op)).or_default() += 1;
        }
        if let Ok(m) = model::run_with(&setup, &decoded, options()) {
            for (k, v) in m.coverage {
                *situations.entry(k).or_default() += v;
            }
        }
    }
    println!("{inputs} inputs, {total} ops");
    println!("\nconfigurations (inputs): {configs:?}");
    println!("\nops:");
    for (k, v) in &ops {
        println!("  {k:<34} {v:>8}");
    }
    println!("\nmodel situations:");
    for (k, v) in &situations {
        println!("  {k:<40} {v:>8}");
    }
}
