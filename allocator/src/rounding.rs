//! Request rounding: 512-byte granules, optionally power-of-two divisions.
//!
//! Mirrors PyTorch's `round_size` so that a replayed trace lands in the same
//! block sizes PyTorch would have used.

/// Smallest block the allocator hands out, and the granule of every size.
pub const MIN_BLOCK: u64 = 512;
/// Largest request accepted (1 PiB): far above any device, far below overflow.
pub const MAX_REQUEST: u64 = 1 << 50;
/// Number of power-of-two intervals that `roundup_power2_divisions` configures
/// (1 MiB, 2 MiB, …, 32 GiB and above), as in PyTorch.
pub const POWER2_INTERVALS: usize = 16;

/// Divisions per power-of-two interval; 0 or 1 means plain 512-byte rounding.
pub type Power2Divisions = [u32; POWER2_INTERVALS];

/// The interval index of `size` for `roundup_power2_divisions` (≤ 1 MiB → 0,
/// each doubling one more, capped at the last).
pub fn power2_interval(size: u64) -> usize {
    let log = 63 - size.max(1).leading_zeros() as usize;
    log.saturating_sub(20).min(POWER2_INTERVALS - 1)
}

/// Rounds a request up to the size of the block that will serve it.
///
/// Returns `None` when `size` exceeds [`MAX_REQUEST`]. Sizes below 512 become 512.
///
/// Both roundings (512-byte granules, and `d` divisions of the power of two
/// below `size` when `size > 512·d`) are "up to a multiple of a power-of-two
/// step": the step is chosen without a branch, which on a random mix of sizes
/// mispredicted every other call.
#[inline]
pub fn round_size(size: u64, divisions: &Power2Divisions) -> Option<u64> {
    if size > MAX_REQUEST {
        return None;
    }
    let d = u64::from(divisions[power2_interval(size)]);
    let floor = 1u64 << (63 - size.max(1).leading_zeros());
    // With `size > 512·d` this step is at least 512 (see `round_power2_division`).
    let div_step = floor >> (63 - d.max(1).leading_zeros());
    let step = if d > 1 && size > MIN_BLOCK * d {
        div_step
    } else {
        MIN_BLOCK
    };
    Some(((size + step - 1) & !(step - 1)).max(MIN_BLOCK))
}

/// [`round_size`] when no interval has divisions (all 0 or 1): 512-byte
/// granules only, without looking the interval up (a third of a cached
/// pair's rounding cost went there).
#[inline]
pub fn round_size_plain(size: u64) -> Option<u64> {
    (size <= MAX_REQUEST).then(|| ((size + MIN_BLOCK - 1) & !(MIN_BLOCK - 1)).max(MIN_BLOCK))
}

/// Whether `divisions` asks for plain 512-byte rounding everywhere.
pub fn is_plain(divisions: &Power2Divisions) -> bool {
    divisions.iter().all(|&d| d <= 1)
}

/// Largest chunk a slab serves (`slab_max_kb` is at most this).
pub const SLAB_MAX: u64 = 1 << 20;

/// Slab size classes up to [`SLAB_MAX`]: 8 exact ones up to 4 KiB, then 8
/// in each power of two from 4 KiB (excluded) to 1 MiB (included).
pub const SLAB_CLASSES: usize = 8 + 8 * 8;

/// The slab class of a rounded size (a multiple of 512 of at most
/// [`SLAB_MAX`]) and its chunk size: exact multiples of 512 bytes up to
/// 4 KiB, then 8 classes per power of two, so that a chunk is at most 1/8
/// larger than the request it serves.
#[inline]
pub fn slab_class(rounded: u64) -> (usize, u64) {
    let g = (rounded / MIN_BLOCK).max(1);
    if g <= 8 {
        return ((g - 1) as usize, g * MIN_BLOCK);
    }
    let fl = 63 - u64::from((g - 1).leading_zeros());
    let step = 1u64 << (fl - 3);
    let up = g.div_ceil(step) * step;
    let class = 7 + (fl as usize - 3) * 8 + ((up >> (fl - 3)) as usize - 8);
    (class, up * MIN_BLOCK)
}

/// Rounds `size` up to the next of `d` equal steps between the powers of two
/// around it (the reference the branch-free rounding is tested against).
#[cfg(test)]
pub(crate) fn round_power2_division(size: u64, d: u64) -> u64 {
    if size.is_power_of_two() {
        return size;
    }
    let floor = 1u64 << (63 - size.leading_zeros());
    let step = floor >> (63 - d.leading_zeros());
    if step == 0 {
        return floor << 1;
    }
    let down = size & !(step - 1);
    if down == size {
        size
    } else {
        down + step
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn slab_classes_fit_waste_at_most_an_eighth_and_follow_sizes() {
        let mut last: Option<(usize, u64)> = None;
        for g in 1..=SLAB_MAX / MIN_BLOCK {
            let rounded = g * MIN_BLOCK;
            let (class, chunk) = slab_class(rounded);
            assert!(chunk >= rounded, "{rounded}: chunk {chunk}");
            assert!((chunk - rounded) * 8 <= chunk, "{rounded}: chunk {chunk}");
            assert!(class < SLAB_CLASSES, "{rounded}: class {class}");
            // A chunk is its class's largest request.
            assert_eq!(slab_class(chunk), (class, chunk));
            // The same class has the same chunk, the next class a larger one.
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

    use super::*;

    const NONE: Power2Divisions = [0; POWER2_INTERVALS];

    #[test]
    fn plain_rounding() {
        assert_eq!(round_size(0, &NONE), Some(512));
        assert_eq!(round_size(1, &NONE), Some(512));
        assert_eq!(round_size(512, &NONE), Some(512));
        assert_eq!(round_size(513, &NONE), Some(1024));
        assert_eq!(round_size(1200, &NONE), Some(1536));
        assert_eq!(round_size(MAX_REQUEST, &NONE), Some(MAX_REQUEST));
        assert_eq!(round_size(MAX_REQUEST + 1, &NONE), None);
        assert_eq!(round_size(u64::MAX, &NONE), None);
    }

    #[test]
    fn power2_divisions_match_pytorch_examples() {
        let four = [4; POWER2_INTERVALS];
        // PyTorch's docs say 1200 B → 1280 B with 4 divisions, but its code (and
        // the rule `s > 512·d`) keeps sizes ≤ 2048 on plain 512-byte rounding,
        // so every block stays a multiple of 512.
        assert_eq!(round_size(1200, &four), Some(1536));
        assert_eq!(round_size(2500, &four), Some(2560));
        assert_eq!(round_size(3000, &four), Some(3072));
        assert_eq!(round_size(1 << 20, &four), Some(1 << 20));
        assert_eq!(round_size((1 << 20) + 1, &four), Some(1_310_720));
        let two = [2; POWER2_INTERVALS];
        assert_eq!(round_size(5 << 20, &two), Some(6 << 20));
    }

    /// The rounding as first written, branch by branch, as a reference.
    fn reference(size: u64, divisions: &Power2Divisions) -> Option<u64> {
        if size > MAX_REQUEST {
            return None;
        }
        if size < MIN_BLOCK {
            return Some(MIN_BLOCK);
        }
        let d = u64::from(divisions[power2_interval(size)]);
        if d > 1 && size > MIN_BLOCK * d {
            return Some(round_power2_division(size, d));
        }
        Some(size.div_ceil(MIN_BLOCK) * MIN_BLOCK)
    }

    proptest::proptest! {
        #[test]
        fn branch_free_rounding_matches_the_reference(
            size in proptest::prop_oneof![0u64..1 << 24, 0u64..MAX_REQUEST + 2, proptest::num::u64::ANY],
            shift in 0u32..=16,
            interval in 0usize..POWER2_INTERVALS,
        ) {
            // One interval with 2^shift divisions (1 = plain), the others a fixed mix.
            let mut divs: Power2Divisions = [0, 4, 1, 8, 2, 16, 0, 4, 1, 8, 2, 16, 0, 4, 1, 8];
            divs[interval] = 1 << shift;
            let got = round_size(size, &divs);
            proptest::prop_assert_eq!(got, reference(size, &divs));
            if let Some(r) = got {
                proptest::prop_assert!(r >= size && r % MIN_BLOCK == 0);
            }
        }

        #[test]
        fn plain_rounding_matches_round_size_without_divisions(
            size in proptest::prop_oneof![0u64..1 << 24, 0u64..MAX_REQUEST + 2, proptest::num::u64::ANY],
            ones in proptest::collection::vec(0u32..=1, POWER2_INTERVALS),
        ) {
            let divs: Power2Divisions = ones.try_into().expect("16 intervals");
            proptest::prop_assert!(is_plain(&divs));
            proptest::prop_assert_eq!(round_size_plain(size), round_size(size, &divs));
        }
    }

    #[test]
    fn plain_means_no_interval_above_one() {
        assert!(is_plain(&NONE));
        let mut d = NONE;
        d[3] = 2;
        assert!(!is_plain(&d));
    }

    #[test]
    fn intervals() {
        assert_eq!(power2_interval(512), 0);
        assert_eq!(power2_interval(1 << 20), 0);
        assert_eq!(power2_interval(2 << 20), 1);
        assert_eq!(power2_interval(1 << 40), POWER2_INTERVALS - 1);
    }
}
