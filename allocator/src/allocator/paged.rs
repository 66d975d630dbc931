//! Paged plain segments (`Config::paged_margin`): near the device's limit a
//! large segment is backed by pages of the device's granularity (CUDA
//! virtual memory API) instead of one allocation. Its layout and fits are a
//! plain segment's; only what backs it differs. Before an allocation fails,
//! the pages lying wholly inside its free blocks go back to the device, so
//! that free memory stranded between live blocks serves the request, and a
//! block handed out later over such pages gets them mapped again.
//!
//! Far from the limit nothing is paged: a program that fits with room to
//! spare makes the driver calls of plain segments only.

use super::*;

/// Pages a paged segment is cut into at least (16 to 31 once it spans 16
/// granules): pages are a power of two granules, so that making a segment
/// costs a few dozen driver calls however large it is. Fewer, larger pages
/// give back less (8 per segment: a geometric mean minimum capacity of 1.054
/// against 1.049 over the corpus and a jittered copy, docs/POLICY.md).
const PAGES_PER_SEGMENT: u64 = 16;

/// Granules per page of a paged segment of `granules` granules: the largest
/// power of two with at least [`PAGES_PER_SEGMENT`] pages, at least one.
fn page_granules(granules: u64) -> u32 {
    let per = (granules / PAGES_PER_SEGMENT).max(1);
    (1u64 << per.ilog2()).min(1 << 30) as u32
}

/// When new segments are paged, and the pages' size.
pub(crate) struct Paging {
    /// The device's page granularity.
    pub granule: u64,
    /// Share of the limit below it within which new segments are paged.
    margin: f64,
    /// The device's memory.
    total: u64,
    /// Reserved bytes when the device was last found full, if lower than
    /// its memory (other processes hold the rest).
    full_at: Option<u64>,
}

impl Paging {
    /// Paging on `device` with `config`, if the key is on and the device has
    /// the virtual memory API.
    pub(super) fn new(config: &Config, granule: Option<u64>, total: u64) -> Option<Self> {
        let granule = granule.filter(|g| g.is_power_of_two() && *g >= 512)?;
        (config.caching && !config.expandable_segments && config.paged_margin > 0.0).then_some(
            Paging {
                granule,
                margin: config.paged_margin,
                total,
                full_at: None,
            },
        )
    }
}

impl<E> Core<E> {
    /// The page granularity of `seg`'s pages (expandable or paged segments).
    #[inline]
    pub(super) fn granule_of(&self, seg: &Segment) -> u64 {
        match seg.kind {
            SegmentKind::Paged { .. } => self.page_granule(),
            _ => self.granularity.unwrap_or(0),
        }
    }

    /// The granularity of paged segments' pages (0 with paging off).
    fn page_granule(&self) -> u64 {
        self.paging.as_ref().map_or(0, |p| p.granule)
    }

    /// Whether a new segment of `size` bytes for a pool of `kind` is paged:
    /// a large or huge one, a multiple of the granularity, that brings
    /// reserved memory within the margin of the cap, of the device's memory
    /// or of the level at which the device was last found full.
    pub(super) fn pages_new_segment(&self, kind: PoolKind, size: u64) -> bool {
        let Some(p) = &self.paging else {
            return false;
        };
        if kind == PoolKind::Small || size < 2 * p.granule || size % p.granule != 0 {
            return false;
        }
        let limit = self
            .cap
            .unwrap_or(u64::MAX)
            .min(p.total)
            .min(p.full_at.unwrap_or(u64::MAX));
        self.reserved().saturating_add(size) > (limit as f64 * (1.0 - p.margin)) as u64
    }

    /// Reserves `size` bytes of address space and maps a page under each of
    /// its granules. `None` when the device is full (nothing is kept then).
    #[cold]
    pub(super) fn create_paged<D: Device<Event = E>>(
        &mut self,
        dev: &D,
        size: u64,
    ) -> Result<Option<(DevicePtr, PageMap, u32)>, AllocError> {
        let g = self.page_granule();
        let page = page_granules(size / g);
        let ptr = match dev.vmm_reserve(size) {
            Ok(p) => p,
            Err(DeviceError::OutOfMemory) => return Ok(None),
            Err(e) => return Err(e.into()),
        };
        self.stats.num_vmm_reserve += 1;
        let mut pages = PageMap::default();
        let mapped = self.map_granules(dev, ptr.0, &mut pages, page, (0, (size / g) as u32));
        if let Ok(true) = mapped {
            return Ok(Some((ptr, pages, page)));
        }
        if let Ok(false) = mapped {
            self.note_device_full(u64::from(pages.mapped_granules(0, u32::MAX)) * g);
        }
        // Nothing of a segment that could not be made stays behind.
        self.unmap_granules(dev, ptr.0, None, &mut pages, (0, (size / g) as u32))?;
        dev.vmm_free_range(ptr, size)?;
        mapped.map(|_| None)
    }

    /// Maps pages of `page` granules (aligned to `page`) over the unmapped
    /// granules of `first..last` (whole pages) of the segment at `base`.
    /// `Ok(false)`: the device is full (the pages mapped so far stay mapped).
    fn map_granules<D: Device<Event = E>>(
        &mut self,
        dev: &D,
        base: u64,
        pages: &mut PageMap,
        page: u32,
        (first, last): (u32, u32),
    ) -> Result<bool, AllocError> {
        let g = self.page_granule();
        for (lo, hi) in pages.gaps(first, last) {
            let mut at = lo;
            while at < hi {
                // Gaps are whole pages, except the segment's short last page.
                let n = (at / page * page + page).min(hi) - at;
                let bytes = u64::from(n) * g;
                let full = match dev.vmm_create_page(bytes) {
                    Ok(h) => {
                        self.stats.num_page_create += 1;
                        match dev.vmm_map(DevicePtr(base + u64::from(at) * g), h, bytes) {
                            Ok(()) => {
                                self.stats.num_map += 1;
                                pages.insert(at, n, h);
                                at += n;
                                continue;
                            }
                            Err(e) => {
                                dev.vmm_release_page(h)?;
                                self.stats.num_page_release += 1;
                                if e != DeviceError::OutOfMemory {
                                    return Err(e.into());
                                }
                                true
                            }
                        }
                    }
                    Err(DeviceError::OutOfMemory) => true,
                    Err(e) => return Err(e.into()),
                };
                if full {
                    return Ok(false);
                }
            }
        }
        Ok(true)
    }

    /// Unmaps and releases every page wholly inside granules `first..last`
    /// of the segment at `base`, each no longer counted reserved in `kind`'s
    /// pool if it was (`Some`); returns the bytes released. The caller
    /// guarantees that no queued work uses them.
    fn unmap_granules<D: Device<Event = E>>(
        &mut self,
        dev: &D,
        base: u64,
        counted: Option<PoolKind>,
        pages: &mut PageMap,
        (first, last): (u32, u32),
    ) -> Result<u64, AllocError> {
        let g = self.page_granule();
        let inside: Vec<(u32, u64, u32)> = pages.within(first, last).collect();
        let mut bytes = 0;
        for (at, h, n) in inside {
            let len = u64::from(n) * g;
            dev.vmm_unmap(DevicePtr(base + u64::from(at) * g), len)?;
            self.stats.num_unmap += 1;
            pages.remove(at);
            // Unmapped, it is no longer memory of the segment's, released or not.
            if let Some(kind) = counted {
                self.stats.reserved_bytes.decrease(kind, len);
            }
            bytes += len;
            dev.vmm_release_page(h)?;
            self.stats.num_page_release += 1;
        }
        Ok(bytes)
    }

    /// Maps what is unmapped under `[start, end)` of the paged segment
    /// `seg`, counting it reserved. `Ok(false)`: the cap or the device has
    /// no room (nothing is kept mapped then).
    fn commit<D: Device<Event = E>>(
        &mut self,
        dev: &D,
        seg: SegmentId,
        start: u64,
        end: u64,
    ) -> Result<bool, AllocError> {
        let g = self.page_granule();
        let s = self.segments.get(seg.0);
        let (base, kind) = (s.addr, s.pool.kind());
        let SegmentKind::Paged { pages, page } = &s.kind else {
            return Ok(true);
        };
        let page = *page;
        // The whole pages under the range, the segment's short last one included.
        let first = ((start - base) / g) as u32 / page * page;
        let last =
            (((end - base).div_ceil(g) as u32).div_ceil(page) * page).min((s.size / g) as u32);
        let missing = u64::from(last - first - pages.mapped_granules(first, last)) * g;
        if missing == 0 {
            return Ok(true);
        }
        if self
            .cap
            .is_some_and(|cap| self.reserved().saturating_add(missing) > cap)
        {
            return Ok(false);
        }
        let mut pages = self.take_pages(seg);
        let gaps = pages.gaps(first, last);
        let before = pages.mapped_granules(first, last);
        let mut done = self.map_granules(dev, base, &mut pages, page, (first, last));
        if let Ok(false) = done {
            // A request refused leaves nothing mapped for it (no work used
            // these pages yet): what it could not use goes back at once.
            for &gap in &gaps {
                if let Err(e) = self.unmap_granules(dev, base, None, &mut pages, gap) {
                    done = Err(e);
                    break;
                }
            }
        }
        let mapped = u64::from(pages.mapped_granules(first, last) - before) * g;
        self.put_pages(seg, pages);
        self.stats.reserved_bytes.increase(kind, mapped);
        self.high_water = self.high_water.max(self.reserved());
        if let Ok(false) = done {
            self.note_device_full(0);
        }
        done
    }

    /// Remembers that the device was found full with `more` bytes beyond
    /// those reserved: later segments near that level are paged.
    #[cold]
    pub(super) fn note_device_full(&mut self, more: u64) {
        let level = self.reserved() + more;
        if let Some(p) = self.paging.as_mut() {
            p.full_at = Some(p.full_at.map_or(level, |f| f.min(level)));
        }
    }

    /// Makes sure the free block `id` (out of the bins), about to serve a
    /// request of `rounded` bytes, is mapped where it will be allocated. If
    /// there is no room it goes back to the bins and the answer is `false`.
    #[inline]
    pub(super) fn mapped_for<D: Device<Event = E>>(
        &mut self,
        dev: &D,
        id: BlockId,
        rounded: u64,
    ) -> Result<bool, AllocError> {
        if self.paging.is_none() {
            return Ok(true);
        }
        self.map_block(dev, id, rounded)
    }

    #[cold]
    fn map_block<D: Device<Event = E>>(
        &mut self,
        dev: &D,
        id: BlockId,
        rounded: u64,
    ) -> Result<bool, AllocError> {
        let b = self.blocks.get(id.0);
        let (addr, size, seg, pool) = (b.addr, b.size, b.segment, b.pool);
        if !self.segments.get(seg.0).is_paged() {
            return Ok(true);
        }
        let end = addr + self.handed_out_size(pool.kind(), rounded, size);
        let done = self.commit(dev, seg, addr, end)?;
        if !done {
            self.bins_mut(pool).insert(size, addr, id);
        }
        Ok(done)
    }

    /// Takes `seg`'s page map out, to change it while calling the device
    /// through `self` ([`Core::put_pages`] puts it back).
    fn take_pages(&mut self, seg: SegmentId) -> PageMap {
        let s = self.segments.get_mut(seg.0);
        s.pages_mut().map(std::mem::take).unwrap_or_default()
    }

    fn put_pages(&mut self, seg: SegmentId, pages: PageMap) {
        if let Some(p) = self.segments.get_mut(seg.0).pages_mut() {
            *p = pages;
        }
    }

    /// Whether every byte of block `id` is backed by memory (always, outside
    /// paged segments).
    pub(super) fn block_mapped(&self, id: BlockId) -> bool {
        let b = self.blocks.get(id.0);
        let s = self.segments.get(b.segment.0);
        !s.is_paged() || self.mapped_bytes_in(s, b.addr, b.addr + b.size) == b.size
    }

    /// Gives back the pages lying wholly inside free blocks of paged
    /// segments, once the device is idle (a device-wide synchronize: this
    /// runs only before an allocation fails and in `empty_cache`). Returns
    /// the bytes released.
    #[cold]
    pub(super) fn release_free_pages<D: Device<Event = E>>(
        &mut self,
        dev: &D,
    ) -> Result<u64, AllocError> {
        let Some(g) = self.paging.as_ref().map(|p| p.granule) else {
            return Ok(0);
        };
        let paged: Vec<SegmentId> = self
            .segment_by_addr
            .values()
            .copied()
            .filter(|s| self.segments.get(s.0).is_paged())
            .collect();
        let mut synced = false;
        let mut total = 0;
        for seg in paged {
            let s = self.segments.get(seg.0);
            let (base, kind) = (s.addr, s.pool.kind());
            let mut holes = Vec::new();
            let mut cur = Some(s.head);
            while let Some(id) = cur {
                let b = self.blocks.get(id.0);
                if b.state == BlockState::Free {
                    let first = (b.addr - base).div_ceil(g) as u32;
                    let last = ((b.addr + b.size - base) / g) as u32;
                    if first < last
                        && s.pages()
                            .is_some_and(|p| p.mapped_granules(first, last) > 0)
                    {
                        holes.push((first, last));
                    }
                }
                cur = b.next;
            }
            if holes.is_empty() {
                continue;
            }
            if !synced {
                dev.synchronize()?;
                self.stats.num_sync_all_streams += 1;
                synced = true;
            }
            let mut pages = self.take_pages(seg);
            let mut released = Ok(0);
            for hole in holes {
                released = self.unmap_granules(dev, base, Some(kind), &mut pages, hole);
                match &released {
                    Ok(bytes) => total += bytes,
                    Err(_) => break,
                }
            }
            self.put_pages(seg, pages);
            released?;
        }
        Ok(total)
    }

    /// Frees the entirely free paged segment `seg`: its pages (no longer
    /// counted reserved), then its address space. Returns the bytes of the
    /// pages. The device is synchronized first, as `cuMemFree` does for a
    /// plain segment: work queued before the blocks' frees may still use
    /// them, and unmapping (unlike `cuMemFree`) does not wait for it.
    #[cold]
    pub(super) fn free_paged<D: Device<Event = E>>(
        &mut self,
        dev: &D,
        seg: SegmentId,
    ) -> Result<u64, AllocError> {
        let g = self.page_granule();
        dev.synchronize()?;
        self.stats.num_sync_all_streams += 1;
        let s = self.segments.get(seg.0);
        let (base, size, kind) = (s.addr, s.size, s.pool.kind());
        let mut pages = self.take_pages(seg);
        let released =
            self.unmap_granules(dev, base, Some(kind), &mut pages, (0, (size / g) as u32));
        self.put_pages(seg, pages);
        let bytes = released?;
        dev.vmm_free_range(DevicePtr(base), size)?;
        Ok(bytes)
    }
}
