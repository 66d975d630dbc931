//! What the profiling examples share: the random-op plan of the GPU bench's
//! "random ops" case.

/// `ops` steps of (slot, size): a slot out of `slots`, and a size
/// log-uniform between 512 bytes and `max_mib` MiB (xorshift64 from `seed`).
/// A step frees the slot's allocation if it holds one, else allocates `size`
/// into it. The GPU bench's seeds: 1 for 256 slots, 2 for 4096.
pub fn random_plan(slots: usize, max_mib: u64, ops: usize, seed: u64) -> Vec<(usize, u64)> {
    let mut x: u64 = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let (lo, hi) = (512f64.ln(), ((max_mib << 20) as f64).ln());
    (0..ops)
        .map(|_| {
            let mut next = || {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x
            };
            let u = (next() >> 11) as f64 / (1u64 << 53) as f64;
            let size = (lo + u * (hi - lo)).exp() as u64;
            ((next() % slots as u64) as usize, size)
        })
        .collect()
}
