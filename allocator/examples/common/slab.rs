//! The size classes of the slab policy that `lean_core`'s `slab:KIB` mode
//! times and `slab_eval` replays: a request (rounded to 512 bytes) gets a
//! chunk of its class's size from a 2 MiB slab that holds only that class.

/// Bytes of one slab.
pub const SLAB_BYTES: u64 = 2 << 20;

/// Largest chunk: a slab holds at least two.
pub const SLAB_MAX: u64 = 1 << 20;

/// Classes up to [`SLAB_MAX`]: 8 exact ones up to 4 KiB, then 8 in each
/// power of two from 4 KiB (excluded) to 1 MiB (included).
pub const SLAB_CLASSES: usize = 8 + 8 * 8;

/// The class of a rounded size (a multiple of 512 of at most
/// [`SLAB_MAX`]) and its chunk size: exact multiples of 512 bytes up to
/// 4 KiB, then 8 classes per power of two, so a chunk is at most 1/8
/// larger than the largest request of its class.
pub fn slab_class(rounded: u64) -> (usize, u64) {
    let g = rounded / 512;
    if g <= 8 {
        return ((g.max(1) - 1) as usize, g.max(1) * 512);
    }
    let fl = 63 - u64::from((g - 1).leading_zeros());
    let step = 1u64 << (fl - 3);
    let up = g.div_ceil(step) * step;
    let class = 7 + (fl as usize - 3) * 8 + ((up >> (fl - 3)) as usize - 8);
    (class, up * 512)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_fit_waste_at_most_an_eighth_and_grow_with_size() {
        let mut last: Option<(usize, u64)> = None;
        for g in 1..=SLAB_MAX / 512 {
            let rounded = g * 512;
            let (class, chunk) = slab_class(rounded);
            assert!(chunk >= rounded, "{rounded}: chunk {chunk}");
            assert!((chunk - rounded) * 8 <= chunk, "{rounded}: chunk {chunk}");
            assert!(class < SLAB_CLASSES, "{rounded}: class {class}");
            // A chunk is its class's largest request.
            assert_eq!(slab_class(chunk), (class, chunk));
            // Classes follow sizes: the same class has the same chunk, the
            // next class a larger one.
            if let Some((c, k)) = last {
                assert!(
                    class == c && chunk == k || class == c + 1 && chunk > k,
                    "{rounded}"
                );
            }
            last = Some((class, chunk));
        }
        assert_eq!(last, Some((SLAB_CLASSES - 1, SLAB_MAX)));
    }
}
