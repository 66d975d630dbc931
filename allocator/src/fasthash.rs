//! A small multiplicative hasher for maps keyed by addresses and stream ids.
//!
//! Keys are integers chosen by the allocator or the driver, not by an
//! adversary, so SipHash's DoS resistance buys nothing on the hot path.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// Fx-style hasher: one multiply per word.
#[derive(Default, Clone, Copy)]
pub struct FastHasher(u64);

const SEED: u64 = 0x51_7c_c1_b7_27_22_0a_95;

impl Hasher for FastHasher {
    #[inline]
    fn finish(&self) -> u64 {
        self.0
    }
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }
    #[inline]
    fn write_u64(&mut self, n: u64) {
        // Addresses are 512-aligned: fold the high bits down so the low bits that
        // hashbrown uses for buckets still vary.
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(SEED);
        self.0 ^= self.0 >> 29;
    }
    #[inline]
    fn write_u32(&mut self, n: u32) {
        self.write_u64(u64::from(n));
    }
    #[inline]
    fn write_usize(&mut self, n: usize) {
        self.write_u64(n as u64);
    }
}

/// A `HashMap` with [`FastHasher`].
pub type FastMap<K, V> = HashMap<K, V, BuildHasherDefault<FastHasher>>;
