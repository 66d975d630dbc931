//! Placing a block in an expandable pool: the best fit, or a near fit whose
//! pages are mapped or which needs no wait for an old mapping
//! (`Expandable::near_fit`), or another stream's free block over mapped
//! pages (`Expandable::borrow_fit`).

use super::map::carve_mapped;
use super::Expandable;
use crate::allocator::Core;
use crate::bins::{Bins, Entry};
use crate::block::{PoolId, POOLS_PER_STREAM};
use crate::device::Device;
use crate::error::AllocError;

/// Next best fits tried when the best fit lies over an old mapping that queued
/// work may still use, or over unmapped granules (see
/// [`Expandable::near_fit`]).
const AROUND: usize = 4;

/// How much larger than the best fit a near fit over mapped pages may be.
const MAPPED_FIT_FACTOR: u64 = 4;

/// Other streams' pools [`Expandable::borrow_fit`] looks at per request at
/// most (in turn): a program with thousands of streams pays no scan of them all.
const BORROW_POOLS: usize = 8;

/// The next [`AROUND`] best fits after `fit` for `rounded` bytes, up to
/// `factor` times `fit`'s size: where a near fit is looked for.
#[inline]
fn near_fits(
    bins: &Bins,
    fit: Entry,
    rounded: u64,
    factor: u64,
) -> impl Iterator<Item = Entry> + '_ {
    bins.iter_from(rounded)
        .filter(move |&e| e != fit)
        .take(AROUND)
        .take_while(move |e| e.size <= fit.size.saturating_mul(factor))
}

impl<E> Expandable<E> {
    /// The free block to carve `rounded` bytes from: the best fit `fit`,
    /// unless its pages are not all mapped where the block would lie; then
    /// the first of the next [`AROUND`] best fits, up to [`MAPPED_FIT_FACTOR`]
    /// times `fit`'s size, whose pages are, so that no page moves (corpus
    /// replay: 17% fewer map calls and 14% fewer marker waits, reserved /
    /// allocated unchanged in geometric mean). Failing that, `fit` itself,
    /// unless mapping its pages would first need an old mapping there
    /// unmapped that queued work may still use (its page was reused early
    /// elsewhere), which is a host wait for the stream; then the first of
    /// the next [`AROUND`] best fits, up to twice `fit`'s size, that needs
    /// no such wait. Replayed with a device 500 operations behind the host
    /// (`--gpu-lag 500`) the latter halves gpt2_finetune's waited-out device work.
    /// Also says whether the block's pages are all mapped already.
    #[inline]
    pub(in crate::allocator) fn near_fit<D: Device<Event = E>>(
        &mut self,
        core: &Core<E>,
        dev: &D,
        bins: &Bins,
        fit: Entry,
        rounded: u64,
    ) -> Result<(Entry, bool), AllocError> {
        if carve_mapped(core, fit, rounded) {
            return Ok((fit, true));
        }
        if let Some(mapped) = Self::next_mapped_fit(core, bins, fit, rounded) {
            return Ok((mapped, true));
        }
        if self.stale.is_empty() || !self.old_mapping_busy(core, dev, fit, rounded)? {
            return Ok((fit, false));
        }
        let near = near_fits(bins, fit, rounded, 2);
        let alt = self.first_without_wait(core, dev, near, rounded)?;
        Ok((alt.unwrap_or(fit), false))
    }

    /// [`Expandable::near_fit`]'s search for a near fit over mapped pages.
    #[cold]
    fn next_mapped_fit(core: &Core<E>, bins: &Bins, fit: Entry, rounded: u64) -> Option<Entry> {
        near_fits(bins, fit, rounded, MAPPED_FIT_FACTOR).find(|&e| carve_mapped(core, e, rounded))
    }

    /// Another stream's free block of `pool`'s kind to carve `rounded` bytes
    /// from with no page moved (`Config::expandable_borrow`): over mapped
    /// pages, among each other pool's first [`AROUND`] fits up to
    /// [`MAPPED_FIT_FACTOR`] times `rounded`. The smallest one freed before
    /// its stream's last completed marker (no queued work there can touch
    /// it); failing that, with `expandable_cross_stream`, the smallest one
    /// its stream may still use, once the requesting stream is made to wait
    /// for that stream's work on the device.
    #[cold]
    pub(in crate::allocator) fn borrow_fit<D: Device<Event = E>>(
        &mut self,
        core: &mut Core<E>,
        dev: &D,
        pool: PoolId,
        rounded: u64,
    ) -> Result<Option<Entry>, AllocError> {
        let mut best: Option<Entry> = None;
        let mut busy: Option<(Entry, usize)> = None;
        let waits = core.config.expandable_cross_stream;
        let bound = rounded.saturating_mul(MAPPED_FIT_FACTOR);
        let streams = core.bins.len() / POOLS_PER_STREAM as usize;
        let looks = (streams - 1).min(BORROW_POOLS);
        let first = self.borrow_from % streams;
        self.borrow_from = first + looks;
        for slot in (first..first + looks + 1).map(|s| s % streams) {
            if slot == pool.stream_slot() {
                continue;
            }
            let other = PoolId::new(slot as u32, pool.kind());
            let bins = &core.bins[other.index()];
            // (Blocks above `bound` end the look: the walk stops before them.)
            for e in bins.iter_between(rounded, bound).take(AROUND) {
                if best.is_some_and(|b| b.size <= e.size) {
                    break;
                }
                let since = core.blocks.get(e.id.0).freed_at;
                if carve_mapped(core, e, rounded) {
                    if self.quiescent(dev, slot, since)? {
                        best = Some(e);
                        break;
                    }
                    if waits
                        && busy.map_or(true, |(b, _)| e.size < b.size)
                        && !dev.stream_capturing(core.stream_list[slot])
                    {
                        busy = Some((e, slot));
                    }
                }
            }
        }
        if best.is_none() {
            if let Some((e, slot)) = busy {
                self.stream_wait(core, dev, slot, pool.stream_slot())?;
                best = Some(e);
            }
        }
        Ok(best)
    }

    /// [`Expandable::near_fit`]'s slow path: the first of the `near` fits
    /// whose pages can be mapped with no wait for an old mapping.
    #[cold]
    fn first_without_wait<D: Device<Event = E>>(
        &mut self,
        core: &Core<E>,
        dev: &D,
        near: impl Iterator<Item = Entry>,
        rounded: u64,
    ) -> Result<Option<Entry>, AllocError> {
        for alt in near {
            if !self.old_mapping_busy(core, dev, alt, rounded)? {
                return Ok(Some(alt));
            }
        }
        Ok(None)
    }

    /// Whether carving `rounded` bytes at the start of free block `fit` would
    /// map over an old mapping that queued work may still use (a wait).
    fn old_mapping_busy<D: Device<Event = E>>(
        &mut self,
        core: &Core<E>,
        dev: &D,
        fit: Entry,
        rounded: u64,
    ) -> Result<bool, AllocError> {
        if self.stale.is_empty() {
            return Ok(false);
        }
        let g = core.granule();
        let b = core.blocks.get(fit.id.0);
        let s = core.segment(b.segment);
        // Whole big pages may be mapped at the block's edges: look that far.
        let big = self.big_granules(core, s, rounded);
        let first = ((fit.addr - s.addr) / g) as u32 / big * big;
        let last = ((fit.addr + rounded - s.addr).div_ceil(g) as u32).div_ceil(big) * big;
        let hits: Vec<(usize, u64)> = self
            .stale_in(core, b.segment, first, last)
            .map(|st| (st.slot, st.since))
            .collect();
        for (slot, since) in hits {
            if !self.quiescent(dev, slot, since)? {
                return Ok(true);
            }
        }
        Ok(false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::allocator::expandable::testing::*;
    use crate::config::Config;

    /// A best fit over unmapped pages gives way to a near fit over mapped
    /// ones (up to `MAPPED_FIT_FACTOR` times its size); where there is
    /// none, the best fit stays, its pages to be mapped.
    #[test]
    fn a_near_fit_over_mapped_pages_wins() {
        let (dev, a) = alloc(fixed_pages(PAGE, false));
        let [x, y] = holes(&a, &[2 * PAGE, 3 * PAGE])[..] else {
            unreachable!()
        };
        with_state(&a, |vmm, core, _| {
            // x's pages go to the pool: x is the best fit for 4 MiB, unmapped.
            vmm.take_idle_pages(core, &dev, None, 2 * PAGE, true, None, &[])
                .unwrap();
            let core: &Core<Event> = core;
            let bins = &core.bins[large(0).index()];
            let fit = bins.best_fit(2 * PAGE).unwrap();
            assert_eq!(fit.addr, x.0);
            let (near, mapped) = vmm.near_fit(core, &dev, bins, fit, 2 * PAGE).unwrap();
            assert_eq!((near.addr, mapped), (y.0, true));
            // 8 MiB: only the range's unmapped rest fits.
            let fit = bins.best_fit(4 * PAGE).unwrap();
            let (near, mapped) = vmm.near_fit(core, &dev, bins, fit, 4 * PAGE).unwrap();
            assert_eq!((near, mapped), (fit, false));
        });
    }

    /// Another stream's free block over mapped pages serves a request
    /// whose own fit would need pages, once no queued work there can touch
    /// it (or, with `expandable_cross_stream`, after the requesting stream
    /// is made to wait for that stream on the device).
    #[test]
    fn another_streams_quiescent_block_is_borrowed() {
        for cross in [false, true] {
            let (dev, a) = alloc(Config {
                expandable_cross_stream: cross,
                ..fixed_pages(PAGE, false)
            });
            a.malloc(PAGE, S0).unwrap();
            let y = a.malloc(2 * PAGE, S1).unwrap();
            a.malloc(PAGE, S1).unwrap();
            a.free(y).unwrap(); // its marker is pending
            with_state(&a, |vmm, core, _| {
                let waits = dev.counters().stream_waits;
                let got = vmm.borrow_fit(core, &dev, large(0), 2 * PAGE).unwrap();
                assert_eq!(got.map(|e| e.addr), cross.then_some(y.0), "busy");
                assert_eq!(dev.counters().stream_waits - waits, u64::from(cross));
                dev.complete_all_events();
                let got = vmm.borrow_fit(core, &dev, large(0), 2 * PAGE).unwrap();
                assert_eq!(got.map(|e| e.addr), Some(y.0), "quiescent");
                // Not past `MAPPED_FIT_FACTOR` times the request.
                assert_eq!(
                    vmm.borrow_fit(core, &dev, large(0), PAGE / 4).unwrap(),
                    None
                );
            });
        }
    }
}
