//! Paged plain segments (`Config::paged_margin`): near the device's limit,
//! an entirely free large segment that a smaller request is about to split
//! is made again, at the same size, backed by pages of the device's
//! granularity (CUDA virtual memory API) instead of one allocation. Its
//! layout and fits stay a plain segment's; only what backs it differs.
//! Before an allocation fails, the pages lying wholly inside its free blocks
//! go back to the device, so that free memory stranded between live blocks
//! serves the request, and a block handed out later over such pages gets
//! them mapped again.
//!
//! Why at the split: a segment holding one block leaves no hole; the holes
//! that strand memory near the limit appear when a free segment is cut for a
//! smaller request, so that is the one moment paging can pay. A segment a
//! request takes whole stays plain, and far from the limit nothing is paged:
//! a program that fits with room to spare makes the driver calls of plain
//! segments only.

use super::*;

/// When new segments are paged, and the pages' size.
pub(crate) struct Paging {
    /// The device's page granularity.
    pub granule: u64,
    /// Share of the limit below it within which new segments are paged.
    margin: f64,
    /// Pages a paged segment is cut into at least (`Config::paged_pages`).
    pages: u64,
    /// Pages unmapped whose release the device refused: (handle, bytes,
    /// pool kind). Still held, so still counted reserved, and released
    /// again before pages go back next (flush, `empty_cache`, a segment's release).
    orphans: Vec<(u64, u64, PoolKind)>,
}

impl Paging {
    /// Granules per page of a paged segment of `bytes`: the largest power of
    /// two that leaves at least `pages` pages (`Config::paged_pages`), at
    /// least one.
    fn page_granules(&self, bytes: u64) -> u32 {
        let per = (bytes / self.granule / self.pages.max(1)).max(1);
        (1u64 << per.ilog2()).min(1 << 30) as u32
    }

    /// Paging on `device` with `config`, if the key is on and the device has
    /// the virtual memory API. Not where the cache gives nothing back on its
    /// own (`oom_flush` off, as CUDA graph pools): making a segment again
    /// frees one, and its pages would go back only in `empty_cache`.
    pub(super) fn new(config: &Config, granule: Option<u64>) -> Option<Self> {
        let granule = granule.filter(|g| g.is_power_of_two() && *g >= 512)?;
        let on = config.caching
            && config.oom_flush
            && !config.expandable_segments
            && config.paged_margin > 0.0;
        on.then_some(Paging {
            granule,
            margin: config.paged_margin,
            pages: config.paged_pages,
            orphans: Vec::new(),
        })
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

    /// Whether the entirely free plain segment of `size` bytes in a pool of
    /// `kind`, about to serve a request of `rounded` bytes, is made again
    /// paged: a large or huge one, a multiple of the granularity, whose rest
    /// after the request holds at least two of its pages (so that at least
    /// one whole page lies inside that free block), while reserved memory is
    /// within the margin of the limit but not above the cap (a cap lowered
    /// below what is reserved lets no segment be made, not even again).
    fn repages(&self, kind: PoolKind, size: u64, rounded: u64) -> bool {
        let Some(p) = &self.paging else {
            return false;
        };
        if kind == PoolKind::Small || size % p.granule != 0 {
            return false;
        }
        let page = u64::from(p.page_granules(size)) * p.granule;
        let rest = size - self.handed_out_size(kind, rounded, size);
        let reserved = self.reserved();
        rest >= 2 * page
            && reserved > self.limit.level(self.cap, 1.0 - p.margin)
            && self.cap.map_or(true, |cap| reserved <= cap)
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
                                if let Err(r) = dev.vmm_release_page(h) {
                                    self.orphan(h, bytes, PoolKind::Large, false);
                                    return Err(r.into());
                                }
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
    /// of the segment at `base`, in a pool of `kind`, each no longer counted
    /// reserved if it was (`counted`); returns the bytes released. A page
    /// whose release the device refuses is kept as an orphan, counted
    /// reserved. The caller guarantees that no queued work uses them.
    fn unmap_granules<D: Device<Event = E>>(
        &mut self,
        dev: &D,
        base: u64,
        kind: PoolKind,
        counted: bool,
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
            if let Err(e) = dev.vmm_release_page(h) {
                self.orphan(h, len, kind, counted);
                return Err(e.into());
            }
            self.stats.num_page_release += 1;
            // Released, it is no longer memory of the segment's.
            if counted {
                self.stats.reserved_bytes.decrease(kind, len);
            }
            bytes += len;
        }
        Ok(bytes)
    }

    /// Keeps page `h` of `len` bytes, unmapped, whose release the device
    /// refused: counted reserved in `kind` (from now, unless it already was,
    /// `counted`) until released again.
    #[cold]
    fn orphan(&mut self, h: u64, len: u64, kind: PoolKind, counted: bool) {
        if !counted {
            self.stats.reserved_bytes.increase(kind, len);
        }
        if let Some(p) = self.paging.as_mut() {
            p.orphans.push((h, len, kind));
        }
    }

    /// Releases the orphaned pages (see [`Paging::orphans`]); returns their bytes.
    #[cold]
    fn release_orphans<D: Device<Event = E>>(&mut self, dev: &D) -> Result<u64, AllocError> {
        let mut bytes = 0;
        while let Some(&(h, len, kind)) = self.paging.as_ref().and_then(|p| p.orphans.last()) {
            dev.vmm_release_page(h)?;
            if let Some(p) = self.paging.as_mut() {
                p.orphans.pop(); // only once released: a failure keeps it
            }
            self.stats.num_page_release += 1;
            self.stats.reserved_bytes.decrease(kind, len);
            bytes += len;
        }
        Ok(bytes)
    }

    /// Pages unmapped but not yet released, by pool kind and bytes (counted reserved).
    pub(super) fn orphaned_pages(&self) -> impl Iterator<Item = (PoolKind, u64)> + '_ {
        self.paging
            .iter()
            .flat_map(|p| p.orphans.iter().map(|&(_, len, kind)| (kind, len)))
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
                if let Err(e) = self.unmap_granules(dev, base, kind, false, &mut pages, gap) {
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

    /// Makes sure the free block `id` (out of the bins), about to serve a
    /// request of `rounded` bytes, is mapped where it will be allocated
    /// (first making its segment paged, if it is a whole plain one the
    /// request splits near the limit). If there is no room it goes back to
    /// the bins and the answer is `false`.
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
        // The common hit, a part of a plain segment, needs nothing.
        let b = self.blocks.get(id.0);
        if b.is_split() && !self.segments.get(b.segment.0).is_paged() {
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
        let (size, seg, pool) = (b.size, b.segment, b.pool);
        let s = self.segments.get(seg.0);
        if !s.is_paged() {
            let whole_plain = matches!(s.kind, SegmentKind::Plain) && !b.is_split();
            if !whole_plain || !self.repages(pool.kind(), size, rounded) {
                return Ok(true);
            }
            if !self.repage(dev, id)? {
                return Ok(false);
            }
            if !self.segments.get(seg.0).is_paged() {
                return Ok(true); // plain again
            }
        }
        let addr = self.blocks.get(id.0).addr;
        let end = addr + self.handed_out_size(pool.kind(), rounded, size);
        let done = self.commit(dev, seg, addr, end);
        if !matches!(done, Ok(true)) {
            // (Pages mapped before a device error stay mapped and counted.)
            self.bins_mut(pool).insert(size, addr, id);
            self.note_maybe_free(seg);
        }
        done
    }

    /// Makes the plain segment whose one free block is `id` (out of the
    /// bins) again as a paged segment of the same size, at a new address.
    /// The plain allocation goes back first (`cuMemFree` waits for the
    /// device, so no queued work still uses it), and pages take its room;
    /// pages the device refuses (another process took the room) are left
    /// unmapped, to be mapped when a block needs them, as in any paged
    /// segment. If no address range can be had, a plain allocation is asked
    /// for again; refused too, the segment is gone and the answer is `false`
    /// (the request goes on to grow). On a device error the block goes back
    /// to the bins, in its segment as it then is.
    #[cold]
    fn repage<D: Device<Event = E>>(&mut self, dev: &D, id: BlockId) -> Result<bool, AllocError> {
        let b = self.blocks.get(id.0);
        let (old, size, seg, pool, since) = (b.addr, b.size, b.segment, b.pool, b.freed_at);
        let kind = pool.kind();
        if let Err(e) = dev.free(DevicePtr(old), size) {
            // Nothing changed: the block goes back where it was.
            self.bins_mut(pool).insert(size, old, id);
            return Err(e.into());
        }
        self.stats.num_device_free += 1;
        self.free_candidates[kind as usize].remove(&(since, old, seg.0));
        self.segment_by_addr.remove(&old);
        let made = match dev.vmm_reserve_at(size, DevicePtr(old)) {
            Ok(ptr) => {
                self.stats.num_vmm_reserve += 1;
                Ok((ptr, true))
            }
            Err(DeviceError::OutOfMemory) => dev.allocate(size).map(|ptr| (ptr, false)),
            Err(e) => Err(e),
        };
        let (ptr, paged) = match made {
            Ok(made) => made,
            Err(e) => {
                // The segment's memory is gone: so are its records.
                self.blocks.discard(id.0);
                self.forget_segment(seg, size);
                if e == DeviceError::OutOfMemory {
                    self.note_device_full(0);
                    return Ok(false);
                }
                return Err(e.into());
            }
        };
        self.segment_by_addr.insert(ptr.0, seg);
        self.segments.get_mut(seg.0).addr = ptr.0;
        self.blocks.get_mut(id.0).addr = ptr.0;
        if !paged {
            self.stats.num_device_alloc += 1;
            return Ok(true);
        }
        let p = self
            .paging
            .as_ref()
            .expect("a segment is paged only with paging on");
        let (g, page) = (p.granule, p.page_granules(size));
        let mut pages = PageMap::default();
        let mapped = self.map_granules(dev, ptr.0, &mut pages, page, (0, (size / g) as u32));
        // Counted reserved: the pages it got, no longer the plain allocation.
        let held = u64::from(pages.mapped_granules(0, u32::MAX)) * g;
        self.stats.reserved_bytes.decrease(kind, size - held);
        self.segments.get_mut(seg.0).kind = SegmentKind::Paged { pages, page };
        self.stats.num_segments_paged += 1;
        match mapped {
            Ok(true) => Ok(true),
            Ok(false) => {
                self.note_device_full(0);
                Ok(true)
            }
            Err(e) => {
                self.bins_mut(pool).insert(size, ptr.0, id);
                self.note_maybe_free(seg);
                Err(e)
            }
        }
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
        let mut total = self.release_orphans(dev)?;
        let paged: Vec<SegmentId> = self
            .segment_by_addr
            .values()
            .copied()
            .filter(|s| self.segments.get(s.0).is_paged())
            .collect();
        let mut synced = false;
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
                released = self.unmap_granules(dev, base, kind, true, &mut pages, hole);
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
        self.release_orphans(dev)?;
        dev.synchronize()?;
        self.stats.num_sync_all_streams += 1;
        let s = self.segments.get(seg.0);
        let (base, size, kind) = (s.addr, s.size, s.pool.kind());
        let mut pages = self.take_pages(seg);
        let released =
            self.unmap_granules(dev, base, kind, true, &mut pages, (0, (size / g) as u32));
        self.put_pages(seg, pages);
        let bytes = released?;
        dev.vmm_free_range(DevicePtr(base), size)?;
        Ok(bytes)
    }
}
