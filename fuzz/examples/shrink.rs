//! Shrinks an `ops` crash to a short op sequence and prints it as Rust, for
//! a regression test: `cargo run --release --example shrink -- CRASH_FILE [NEEDLE]`.
//!
//! It decodes the input as the `ops` target does and runs it the same way,
//! then removes chunks of ops, then single
//! ops, then halves sizes and slots, keeping each change while the run still
//! fails with an error containing NEEDLE (default: the first failure's text
//! after its step number, up to the first address or number).

use cachealloc_fuzz::ops::{presets, run_setup};
use cachealloc_model::{self as model, Op, Setup};

fn decode(data: &[u8]) -> (Setup, Vec<Op>) {
    let (&choice, rest) = data.split_first().expect("a non-empty input");
    let (mut setup, ops) = model::decode(rest);
    if choice >= 128 {
        let p = presets();
        setup.config = p[usize::from(choice) % p.len()].clone();
    }
    (setup, ops)
}

/// The error's kind: what follows `: ` after the op, cut before the first digit.
fn kind(e: &str) -> String {
    let first = e.lines().next().unwrap_or("");
    let after = first.split("}: ").last().unwrap_or(first);
    let after = after.split(")): ").last().unwrap_or(after);
    after
        .split(|c: char| c.is_ascii_digit())
        .next()
        .unwrap_or("")
        .to_string()
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let data = std::fs::read(&args[1]).expect("the crash file");
    let (setup, mut ops) = decode(&data);
    let first = run_setup(&setup, &ops).expect_err("the input does not fail");
    let needle = args.get(2).cloned().unwrap_or_else(|| kind(&first));
    eprintln!(
        "config {}, capacity {}, streams {}; needle {needle:?}",
        setup.config.to_conf_string(),
        setup.capacity,
        setup.streams
    );
    let fails = |ops: &[Op]| run_setup(&setup, ops).is_err_and(|e| e.contains(&needle));
    // Cut everything after the failing step.
    let mut chunk = ops.len() / 2;
    while chunk >= 1 {
        let mut i = 0;
        while i < ops.len() {
            let mut t = ops.clone();
            t.drain(i..(i + chunk).min(t.len()));
            if fails(&t) {
                ops = t;
            } else {
                i += chunk;
            }
        }
        chunk /= 2;
    }
    // Simplify values.
    let mut changed = true;
    while changed {
        changed = false;
        for i in 0..ops.len() {
            let simpler: Vec<Op> = match ops[i].clone() {
                // Each candidate is strictly simpler, so this ends.
                Op::Malloc { size, stream } => vec![
                    Op::Malloc {
                        size,
                        stream: stream % setup.streams,
                    },
                    Op::Malloc {
                        size: size / 2,
                        stream,
                    },
                    Op::Malloc {
                        size: size & !0xfffff,
                        stream,
                    },
                    Op::Malloc {
                        size: size & !511,
                        stream,
                    },
                ],
                Op::Free { slot } => vec![Op::Free { slot: slot / 2 }],
                Op::RecordStream { slot, stream } => vec![
                    Op::RecordStream {
                        slot: slot / 2,
                        stream,
                    },
                    Op::RecordStream {
                        slot,
                        stream: stream % setup.streams,
                    },
                ],
                Op::CompleteEvent { index } => vec![Op::CompleteEvent { index: index / 2 }],
                Op::DoubleFree { slot } => vec![Op::DoubleFree { slot: slot / 2 }],
                _ => vec![],
            };
            for s in simpler {
                if s != ops[i] {
                    let mut t = ops.clone();
                    t[i] = s;
                    if fails(&t) {
                        ops = t;
                        changed = true;
                        break;
                    }
                }
            }
        }
    }
    let err = run_setup(&setup, &ops).unwrap_err();
    println!(
        "// config {}, capacity {}, streams {}",
        setup.config.to_conf_string(),
        setup.capacity,
        setup.streams
    );
    println!("// {}", err.lines().next().unwrap_or(""));
    println!("let ops = [");
    for op in &ops {
        println!("    Op::{op:?},");
    }
    println!("];");
}
