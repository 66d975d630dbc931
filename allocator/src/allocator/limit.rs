//! What the allocator knows of the memory it may reserve: the cap, the
//! device's memory, and the level at which the device was last found full
//! (other processes hold the rest). The rules that act near the limit (paged
//! segments) measure from it.

use super::Core;

/// The device's memory, and the reserved bytes at which it was last found full.
pub(crate) struct Limit {
    /// The device's memory (`u64::MAX` when the device does not say).
    total: u64,
    /// Reserved bytes when the device was last found full, if lower than
    /// its memory.
    full_at: Option<u64>,
}

impl Limit {
    pub(super) fn new(total: u64) -> Self {
        Limit {
            total,
            full_at: None,
        }
    }

    /// The most that can be reserved: the cap, the device's memory or the
    /// level at which the device was last found full, whichever is lowest.
    #[inline]
    pub(super) fn bytes(&self, cap: Option<u64>) -> u64 {
        cap.unwrap_or(u64::MAX)
            .min(self.total)
            .min(self.full_at.unwrap_or(u64::MAX))
    }

    /// `share` of [`Limit::bytes`].
    #[inline]
    pub(super) fn level(&self, cap: Option<u64>, share: f64) -> u64 {
        (self.bytes(cap) as f64 * share) as u64
    }

    /// The device refused memory with `level` bytes reserved (or about to be).
    pub(super) fn note_full(&mut self, level: u64) {
        self.full_at = Some(self.full_at.map_or(level, |f| f.min(level)));
    }
}

impl<E> Core<E> {
    /// Remembers that the device was found full with `more` bytes beyond
    /// those reserved: the rules that act near the limit measure from there.
    #[cold]
    pub(super) fn note_device_full(&mut self, more: u64) {
        let level = self.reserved() + more;
        self.limit.note_full(level);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lowest_of_cap_memory_and_full_level() {
        let mut l = Limit::new(1000);
        assert_eq!(l.bytes(None), 1000);
        assert_eq!(l.bytes(Some(600)), 600);
        l.note_full(800);
        l.note_full(900); // a higher level does not raise it again
        assert_eq!(l.bytes(None), 800);
        assert_eq!(l.bytes(Some(600)), 600);
        assert_eq!(l.level(None, 0.5), 400);
        assert_eq!(Limit::new(u64::MAX).bytes(None), u64::MAX);
    }
}
