//! Setups and ops from raw bytes, for fuzzers.

use crate::*;
use cachealloc_core::{MemoryCap, MAX_REQUEST};

/// Reads bytes as a setup and ops (for fuzzers); never fails, any input is a test.
pub struct Bytes<'a> {
    data: &'a [u8],
}

impl Bytes<'_> {
    fn u8(&mut self) -> u8 {
        match self.data.split_first() {
            Some((&b, rest)) => {
                self.data = rest;
                b
            }
            None => 0,
        }
    }
    fn u64(&mut self, n: usize) -> u64 {
        (0..n).fold(0, |acc, i| acc | (u64::from(self.u8()) << (8 * i)))
    }
}

/// Capacities [`decode`] chooses from.
pub const CAPACITIES: [u64; 4] = [64 * MIB, 512 * MIB, 2048 * MIB, 16384 * MIB];

/// Decodes fuzzer bytes into a setup and a sequence of ops.
pub fn decode(data: &[u8]) -> (Setup, Vec<Op>) {
    let mut b = Bytes { data };
    let configs = configs();
    let config = configs[b.u8() as usize % configs.len()].1.clone();
    let capacity = CAPACITIES[b.u8() as usize % CAPACITIES.len()];
    let streams = 2 + b.u8() as usize % 2;
    let mut ops = Vec::new();
    while !b.data.is_empty() && ops.len() < 1000 {
        let op = match b.u8() % 20 {
            0..=6 => {
                let e = u32::from(b.u8()) % 48;
                let m = b.u64(4);
                let size = match e {
                    29..=44 => log_size(e - 29, m),
                    45 => 0,
                    46 => [MAX_REQUEST, MAX_REQUEST + 1, u64::MAX, 1 << 40][m as usize % 4],
                    47 => capacity + m % capacity,
                    _ => log_size(e, m).min(300 * MIB),
                };
                Op::Malloc {
                    size,
                    stream: b.u8() as usize,
                }
            }
            7..=10 => Op::Free {
                slot: b.u8() as usize,
            },
            11 => Op::DoubleFree {
                slot: b.u8() as usize,
            },
            12 => match b.u8() % 3 {
                0 => Op::ForeignFree { seed: b.u64(8) },
                1 => Op::InteriorFree {
                    slot: b.u8() as usize,
                    offset: b.u64(4),
                },
                _ => Op::RecordStreamStale {
                    slot: b.u8() as usize,
                },
            },
            13 | 14 => Op::RecordStream {
                slot: b.u8() as usize,
                stream: b.u8() as usize,
            },
            15 => Op::CompleteEvent {
                index: b.u8() as usize,
            },
            16 => match b.u8() % 4 {
                0 => Op::CompleteAllEvents,
                1 => Op::ProcessEvents,
                2 => Op::EmptyCache,
                _ => Op::ResetPeak,
            },
            17 => Op::SetCap(match b.u8() % 3 {
                0 => None,
                1 => Some(MemoryCap::Bytes(b.u64(2) * (capacity >> 15))),
                _ => Some(MemoryCap::Fraction(f64::from(b.u8().max(1)) / 255.0)),
            }),
            18 => Op::FailNext(b.u64(1) % 4),
            _ => Op::FailAbove(match b.u8() {
                0..=63 => None,
                e => Some(log_size(u32::from(e) % 31 + 9, b.u64(2))),
            }),
        };
        ops.push(op);
    }
    (
        Setup {
            config,
            capacity,
            streams,
        },
        ops,
    )
}

/// Decodes `data` with [`decode`] and runs it with [`run`]: a fuzz target's whole body.
pub fn run_bytes(data: &[u8]) -> Result<(), String> {
    let (setup, ops) = decode(data);
    run(&setup, &ops)
        .map(|_| ())
        .map_err(|e| format!("config {}: {e}", setup.config.name()))
}
