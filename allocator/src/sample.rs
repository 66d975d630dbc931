//! Deterministic random sequences for the tests, the benchmarks and the lab
//! tools (feature `testing`): one xorshift64 generator and the random-op plan
//! that the host and GPU latency benchmarks and the lab's studies replay.

/// xorshift64 (Marsaglia): deterministic, cheap, no dependency. Good enough
/// for test sequences and benchmark plans; not for anything statistical.
#[derive(Clone, Debug)]
pub struct XorShift64(u64);

impl XorShift64 {
    /// A generator starting from `seed` as its state (a zero seed, which
    /// xorshift never leaves, is replaced by a fixed non-zero state).
    pub fn new(seed: u64) -> Self {
        XorShift64(if seed == 0 {
            0x2545_F491_4F6C_DD1D
        } else {
            seed
        })
    }

    /// The next 64 random bits.
    #[inline]
    #[allow(clippy::should_implement_trait)]
    pub fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }

    /// A number in `0..n` (`n > 0`; modulo bias is fine for tests).
    #[inline]
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    /// A float in `[0, 1)` from the top 53 bits.
    #[inline]
    pub fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// A size log-uniform in `[lo, hi]` (`0 < lo <= hi`).
    pub fn log_uniform(&mut self, lo: u64, hi: u64) -> u64 {
        let (a, b) = ((lo as f64).ln(), (hi as f64).ln());
        ((a + self.unit() * (b - a)).exp() as u64).clamp(lo, hi)
    }
}

/// The random-op plan of the latency benchmarks: `ops` steps of
/// (slot, size), a slot out of `slots` and a size log-uniform between 512
/// bytes and `max_bytes`. A step frees the slot's allocation if it holds
/// one, else allocates `size` into it. The GPU benchmark's seeds are 1 for
/// 256 slots and 2 for 4096; the same seed gives the same plan everywhere.
pub fn random_plan(slots: usize, max_bytes: u64, ops: usize, seed: u64) -> Vec<(usize, u64)> {
    let mut rng = XorShift64::new(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    (0..ops)
        .map(|_| {
            let size = rng.log_uniform(512, max_bytes);
            (rng.below(slots as u64) as usize, size)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn xorshift_is_the_published_sequence() {
        // Marsaglia's xorshift64 (13, 7, 17) from state 1.
        let mut r = XorShift64::new(1);
        assert_eq!(r.next(), 1_082_269_761);
        assert_eq!(r.next(), 1_152_992_998_833_853_505);
        assert_eq!(
            XorShift64::new(0).next(),
            XorShift64::new(0x2545_F491_4F6C_DD1D).next()
        );
    }

    #[test]
    fn plan_stays_in_range_and_is_reproducible() {
        let plan = random_plan(256, 8 << 20, 10_000, 1);
        assert_eq!(plan, random_plan(256, 8 << 20, 10_000, 1));
        assert_ne!(plan, random_plan(256, 8 << 20, 10_000, 2));
        assert!(plan
            .iter()
            .all(|&(s, b)| s < 256 && (512..=8 << 20).contains(&b)));
        let small = plan.iter().filter(|&&(_, b)| b < 64 << 10).count();
        // Log-uniform over 2^9..2^23: about 7/14 of the sizes are below 64 KiB.
        assert!(
            (4000..6000).contains(&small),
            "{small} of 10000 below 64 KiB"
        );
    }
}
