//! Sharing one physical page between granules whose live bytes lie at
//! different offsets (`Config::expandable_share`), the rung after
//! [`Expandable::reback`] before an expandable allocation fails.
//!
//! A granule partly under live blocks keeps a whole page reserved, and no
//! page size below the device's granularity can give its free part back.
//! But a page may be mapped at several addresses: where the live bytes of
//! two granules (of any ranges) lie at disjoint offsets, those of one are
//! copied into the other's page at the same offsets, that page is mapped at
//! both addresses and the first page goes back to the device. No tensor
//! moves. In each granule, the bytes the page holds for another granule
//! become [`BlockState::Aliased`] blocks, never handed out; the granule
//! first mapped (the *home*) keeps the offsets no member uses. A member
//! whose bytes in use are all freed leaves at the next flush (after the
//! device is synchronized): its mapping is unmapped and its aliased bytes
//! are free again; the last member keeps the page as its own.

use super::{Expandable, Place};
use crate::allocator::Core;
use crate::block::{BlockId, BlockState, PoolKind, SegmentId};
use crate::device::{Device, DeviceError, DevicePtr};
use crate::error::AllocError;
use crate::pages::gaps_in;
use std::collections::BTreeMap;

/// Byte spans within a granule, as offsets from its start.
type Spans = Vec<(u64, u64)>;

/// A granule that may share its page: its segment, granule, one-granule
/// page, and the spans of its blocks in use.
struct Candidate {
    seg: SegmentId,
    at: u32,
    handle: u64,
    live: Spans,
}

/// A mapping of a shared page at a member other than the one that counts
/// it (`Expandable::alias_mappings`): it holds no memory of its own.
#[derive(Copy, Clone, Debug)]
pub(in crate::allocator) struct AliasMapping {
    pub(in crate::allocator) addr: u64,
    pub(in crate::allocator) bytes: u64,
}

impl Candidate {
    fn bytes(&self) -> u64 {
        self.live.iter().map(|&(lo, hi)| hi - lo).sum()
    }
}

/// A page to share planned: its pool kind, its home (the granule that
/// counts it), the page, the home's offsets still free for joiners, and the
/// joiners (indices of candidates).
struct Plan {
    kind: PoolKind,
    home: Place,
    page: u64,
    free: Spans,
    joiners: Vec<usize>,
}

/// Whether every span of `live` lies inside one span of `free`.
fn within(live: &[(u64, u64)], free: &[(u64, u64)]) -> bool {
    live.iter()
        .all(|&(lo, hi)| free.iter().any(|&(a, b)| a <= lo && hi <= b))
}

/// The spans of `free` less the bytes of `taken`.
fn subtract(free: &[(u64, u64)], taken: &[(u64, u64)]) -> Spans {
    let mut out: Spans = free.to_vec();
    for &(lo, hi) in taken {
        out = out
            .into_iter()
            .flat_map(|(a, b)| [(a, lo.min(b)), (hi.max(a), b)])
            .filter(|&(a, b)| a < b)
            .collect();
    }
    out
}

/// The spans of `0..g` outside `live`.
fn complement(live: &[(u64, u64)], g: u64) -> Spans {
    let mut sorted = live.to_vec();
    sorted.sort_unstable();
    gaps_in(0, g, sorted)
}

/// Whether a block in this state holds bytes someone uses.
fn in_use(state: BlockState) -> bool {
    matches!(
        state,
        BlockState::Allocated | BlockState::AwaitingEvents | BlockState::Parked
    )
}

impl<E> Expandable<E> {
    /// Shares pages between granules partly under live blocks whose live
    /// bytes lie at disjoint offsets (first fit, fullest granules first),
    /// after synchronizing the device (the caller, [`Self::last_rungs`],
    /// checks that no stream is captured into a CUDA graph). Returns the
    /// bytes given back.
    #[cold]
    pub(super) fn share<D: Device<Event = E>>(
        &mut self,
        core: &mut Core<E>,
        dev: &D,
    ) -> Result<u64, AllocError> {
        // Leaving unmaps, and copies read live blocks: the device must be
        // idle first (one synchronize, only where there is something to do).
        let mut settled = false;
        let mut freed = 0;
        if !self.shared.is_empty() {
            self.settle(core, dev)?;
            settled = true;
            freed += self.leave_shared(core, dev)?;
        }
        let mut cands = self.share_candidates(core);
        cands.sort_by_key(|c| std::cmp::Reverse(c.bytes()));
        // First fit, fullest granules first, into the pages already shared
        // and then into new ones: a granule joins a page whose home has its
        // live spans free. Granules of one pool kind per page: the page's
        // bytes are counted under the kind of whichever member holds it.
        let mut plans: Vec<Plan> = self
            .shared
            .iter()
            .map(|(&handle, members)| {
                let home = members[0];
                Plan {
                    kind: core.segment(home.seg).pool.kind(),
                    home,
                    page: handle,
                    free: core.free_spans(home.seg, home.at),
                    joiners: Vec::new(),
                }
            })
            .collect();
        plans.sort_by_key(|p| p.home);
        for (i, c) in cands.iter().enumerate() {
            let kind = core.segment(c.seg).pool.kind();
            match plans
                .iter_mut()
                .find(|p| p.kind == kind && within(&c.live, &p.free))
            {
                Some(p) => {
                    p.free = subtract(&p.free, &c.live);
                    p.joiners.push(i);
                }
                None => plans.push(Plan {
                    kind,
                    home: Place {
                        seg: c.seg,
                        at: c.at,
                    },
                    page: c.handle,
                    free: complement(&c.live, core.granule()),
                    joiners: Vec::new(),
                }),
            }
        }
        if plans.iter().all(|p| p.joiners.is_empty()) {
            return Ok(freed);
        }
        if !settled {
            self.settle(core, dev)?;
        }
        for p in plans.iter().filter(|p| !p.joiners.is_empty()) {
            let joiners: Vec<&Candidate> = p.joiners.iter().map(|&i| &cands[i]).collect();
            freed += self.share_page(core, dev, p.home, p.page, &joiners)?;
        }
        Ok(freed)
    }

    /// The granules mapped by a one-granule page of their own (not shared),
    /// partly under blocks in use, with the spans of those blocks.
    fn share_candidates(&self, core: &Core<E>) -> Vec<Candidate> {
        let g = core.granule();
        let mut out = Vec::new();
        for &seg in self.ranges.iter().flatten() {
            let s = core.segment(seg);
            let Some(pages) = s.pages() else { continue };
            // Only a block's first and last granules can be partly under it.
            let mut spans: BTreeMap<u32, Spans> = BTreeMap::new();
            let mut cur = Some(s.head);
            while let Some(id) = cur {
                let b = core.blocks.get(id.0);
                cur = b.next;
                if !in_use(b.state) && b.state != BlockState::Aliased {
                    continue;
                }
                let (lo, hi) = (b.addr - s.addr, b.addr + b.size - s.addr);
                let (first, last) = ((lo / g) as u32, ((hi - 1) / g) as u32);
                for x in [first, last]
                    .into_iter()
                    .take(if first == last { 1 } else { 2 })
                {
                    let g0 = u64::from(x) * g;
                    let span = (lo.max(g0) - g0, hi.min(g0 + g) - g0);
                    // An aliased block marks its granule as shared already:
                    // a full span rules it out.
                    let span = if b.state == BlockState::Aliased {
                        (0, g)
                    } else {
                        span
                    };
                    spans.entry(x).or_default().push(span);
                }
            }
            for (x, live) in spans {
                let bytes: u64 = live.iter().map(|&(lo, hi)| hi - lo).sum();
                // A granule under a shared block keeps its page (Note
                // [Shared blocks are pinned]).
                if bytes >= g || pages.is_alias(x) || core.pinned_in(seg, x, x + 1) {
                    continue;
                }
                match pages.covering(x) {
                    Some((at, handle, 1)) if at == x && !self.shared.contains_key(&handle) => out
                        .push(Candidate {
                            seg,
                            at: x,
                            handle,
                            live,
                        }),
                    _ => {}
                }
            }
        }
        out
    }

    /// Maps `page`, the page of granule `home`, at the
    /// joiners' addresses (their live bytes copied into it first) and gives
    /// their pages back; a joiner the device refuses keeps its page.
    /// Returns the bytes given back.
    fn share_page<D: Device<Event = E>>(
        &mut self,
        core: &mut Core<E>,
        dev: &D,
        home: Place,
        page: u64,
        joiners: &[&Candidate],
    ) -> Result<u64, AllocError> {
        let g = core.granule();
        let addr = |core: &Core<E>, seg: SegmentId, at: u32| core.granule_addr(seg, at);
        let home_at = addr(core, home.seg, home.at);
        let mut freed = 0;
        for &c in joiners {
            let at = addr(core, c.seg, c.at);
            // The joiner's live bytes go to the same offsets of the home
            // page, free there; then its address is mapped to that page.
            let copied = c.live.iter().try_for_each(|&(lo, hi)| {
                dev.copy(DevicePtr(home_at + lo), DevicePtr(at + lo), hi - lo)
            });
            match copied
                .and_then(|()| dev.synchronize())
                .and_then(|()| dev.vmm_unmap(DevicePtr(at), g))
            {
                Ok(()) => {}
                Err(DeviceError::OutOfMemory) => continue,
                Err(e) => return Err(e.into()),
            }
            if let Err(e) = dev.vmm_map(DevicePtr(at), page, g) {
                // Its own page, untouched, goes back where it was.
                dev.vmm_map(DevicePtr(at), c.handle, g)?;
                match e {
                    DeviceError::OutOfMemory => continue,
                    e => return Err(e.into()),
                }
            }
            core.stats.num_unmap += 1;
            core.stats.num_map += 1;
            let kind = core.segment(c.seg).pool.kind();
            let pages = core.page_map_mut(c.seg);
            pages.remove(c.at);
            pages.insert(c.at, 1, page);
            pages.set_alias(c.at, true);
            if core.config.expandable_shadows {
                self.mapped_at.remove(&c.handle);
            }
            freed += self.release_or_pool(core, dev, c.handle, kind, g);
            // The bytes the page holds for others are aliased: in the home,
            // the joiner's live spans; in the joiner, all but its own.
            for &(lo, hi) in &c.live {
                core.alias_free_bytes(home.seg, home_at + lo, home_at + hi);
            }
            for (lo, hi) in complement(&c.live, g) {
                core.alias_free_bytes(c.seg, at + lo, at + hi);
            }
            core.stats.num_pages_shared += 1;
            self.shared
                .entry(page)
                .or_insert_with(|| vec![home])
                .push(Place {
                    seg: c.seg,
                    at: c.at,
                });
        }
        Ok(freed)
    }

    /// Members of shared pages with no block in use in their granule leave:
    /// their mapping is unmapped and their aliased bytes freed; a page's
    /// last member keeps it as its own (its aliased bytes freed), and a
    /// page no member uses goes back to the device. The device must be
    /// synchronized (no queued work may read a mapping that goes). Returns
    /// the bytes of the pages given back.
    pub(in crate::allocator) fn leave_shared<D: Device<Event = E>>(
        &mut self,
        core: &mut Core<E>,
        dev: &D,
    ) -> Result<u64, AllocError> {
        let g = core.granule();
        let mut released = 0;
        let handles: Vec<u64> = self.shared.keys().copied().collect();
        for h in handles {
            let members = self.shared[&h].clone();
            let kind = core.segment(members[0].seg).pool.kind();
            for member in members {
                let Place { seg, at } = member;
                if core.granule_in_use(seg, at) {
                    continue;
                }
                // A failure leaves the member mapped and listed, as it was.
                self.unmap_member(core, dev, seg, at)?;
                let list = self.shared.get_mut(&h).expect("listed");
                let was_home = list[0] == member;
                list.retain(|&m| m != member);
                if let (true, Some(&next)) = (was_home, list.first()) {
                    // The next member counts the page (members are of one pool kind).
                    core.page_map_mut(next.seg).set_alias(next.at, false);
                    if core.config.expandable_shadows {
                        self.mapped_at.insert(h, next);
                    }
                }
            }
            match self.shared[&h].as_slice() {
                [] => {
                    self.shared.remove(&h);
                    if core.config.expandable_shadows {
                        self.mapped_at.remove(&h);
                    }
                    released += self.release_or_pool(core, dev, h, kind, g);
                }
                &[Place { seg, at }] => {
                    // The last member keeps the page as its own.
                    self.shared.remove(&h);
                    core.free_aliased(seg, at);
                }
                _ => {}
            }
        }
        Ok(released)
    }

    /// Unmaps a leaving member's granule and frees its aliased bytes.
    fn unmap_member<D: Device<Event = E>>(
        &mut self,
        core: &mut Core<E>,
        dev: &D,
        seg: SegmentId,
        at: u32,
    ) -> Result<(), AllocError> {
        let g = core.granule();
        let base = core.segment(seg).addr;
        dev.vmm_unmap(DevicePtr(base + u64::from(at) * g), g)?;
        core.stats.num_unmap += 1;
        core.page_map_mut(seg).remove(at);
        core.free_aliased(seg, at);
        Ok(())
    }

    /// Checks the shared pages: every member maps its page, the home
    /// counts it and the others mark it as an alias, every aliased granule
    /// is a member, and aliased blocks lie in members only.
    pub(in crate::allocator) fn check_shared(&self, core: &Core<E>) -> Result<(), String> {
        let g = match core.granularity {
            Some(g) => g,
            None => return Ok(()),
        };
        let mut members = std::collections::HashSet::new();
        for (&h, list) in &self.shared {
            if list.len() < 2 {
                return Err(format!("shared page {h} has {} members", list.len()));
            }
            for (k, &member) in list.iter().enumerate() {
                let Place { seg, at } = member;
                let pages = core
                    .segments
                    .get(seg.0)
                    .pages()
                    .ok_or("shared outside a range")?;
                if pages.covering(at) != Some((at, h, 1)) || pages.is_alias(at) != (k > 0) {
                    return Err(format!("shared page {h}: member {k} at granule {at} maps another page or is marked wrongly"));
                }
                members.insert(member);
            }
        }
        for &seg in self.ranges.iter().flatten() {
            let s = core.segment(seg);
            let Some(pages) = s.pages() else { continue };
            // (The aliased granules, not every granule of the range: a
            // range spans the device's memory and this runs after every
            // operation under the model.)
            for x in pages.aliased() {
                if !members.contains(&Place { seg, at: x }) {
                    return Err(format!(
                        "aliased granule {x} of {:#x} is no shared page's member",
                        s.addr
                    ));
                }
            }
            let mut cur = Some(s.head);
            while let Some(id) = cur {
                let b = core.blocks.get(id.0);
                if b.state == BlockState::Aliased {
                    let (first, last) = ((b.addr - s.addr) / g, (b.addr + b.size - 1 - s.addr) / g);
                    let place = Place {
                        seg,
                        at: first as u32,
                    };
                    if first != last || !members.contains(&place) {
                        return Err(format!(
                            "aliased block at {:#x} outside a shared granule",
                            b.addr
                        ));
                    }
                }
                cur = b.next;
            }
        }
        Ok(())
    }

    /// The mappings of shared pages at their members other than the home:
    /// mapped, but counted where the page is at home.
    pub(in crate::allocator) fn alias_mappings(&self, core: &Core<E>) -> Vec<AliasMapping> {
        let Some(g) = core.granularity else {
            return Vec::new();
        };
        self.shared
            .values()
            .flat_map(|list| list[1..].iter())
            .map(|&Place { seg, at }| AliasMapping {
                addr: core.granule_addr(seg, at),
                bytes: g,
            })
            .collect()
    }
}

impl<E> Core<E> {
    /// Whether a block in use lies (partly) in granule `at` of `seg`.
    fn granule_in_use(&self, seg: SegmentId, at: u32) -> bool {
        let g = self.granule();
        let s = self.segment(seg);
        let (lo, hi) = (s.addr + u64::from(at) * g, s.addr + u64::from(at + 1) * g);
        self.blocks_between(seg, lo, hi)
            .iter()
            .any(|&id| in_use(self.blocks.get(id.0).state))
    }

    /// The spans of granule `at` of `seg` that free blocks cover, as offsets.
    fn free_spans(&self, seg: SegmentId, at: u32) -> Spans {
        let g = self.granule();
        let lo = self.granule_addr(seg, at);
        self.blocks_between(seg, lo, lo + g)
            .into_iter()
            .map(|id| self.blocks.get(id.0))
            .filter(|b| b.state == BlockState::Free)
            .map(|b| (b.addr.max(lo) - lo, (b.addr + b.size).min(lo + g) - lo))
            .collect()
    }

    /// The blocks of `seg` that overlap `lo..hi`, in address order.
    fn blocks_between(&self, seg: SegmentId, lo: u64, hi: u64) -> Vec<BlockId> {
        let mut out = Vec::new();
        let mut cur = Some(self.segment(seg).head);
        while let Some(id) = cur {
            let b = self.blocks.get(id.0);
            if b.addr >= hi {
                break;
            }
            if b.addr + b.size > lo {
                out.push(id);
            }
            cur = b.next;
        }
        out
    }

    /// Makes bytes `lo..hi` of `seg`, which lie in one free block, an
    /// aliased block; the free block's parts before and after stay free.
    fn alias_free_bytes(&mut self, seg: SegmentId, lo: u64, hi: u64) {
        let id = *self
            .blocks_between(seg, lo, lo + 1)
            .first()
            .expect("a segment tiles its range");
        let b = self.blocks.get(id.0);
        let (addr, size, pool, since) = (b.addr, b.size, b.pool, b.freed_at);
        debug_assert!(b.state == BlockState::Free && hi <= addr + size);
        self.bins_mut(pool).remove(size, addr, id);
        self.idle_index.remove(&(since, id.0));
        let mid = if addr < lo { self.cut(id, lo) } else { id };
        let after = (hi < addr + size).then(|| self.cut(mid, hi));
        self.blocks.get_mut(mid.0).state = BlockState::Aliased;
        if mid != id {
            self.merge_into_bins(id);
        }
        if let Some(after) = after {
            self.merge_into_bins(after);
        }
    }

    /// Frees the aliased blocks of granule `at` of `seg` (merged with free neighbours, filed).
    fn free_aliased(&mut self, seg: SegmentId, at: u32) {
        let g = self.granule();
        let s = self.segment(seg);
        let (lo, hi) = (s.addr + u64::from(at) * g, s.addr + u64::from(at + 1) * g);
        let aliased: Vec<BlockId> = self
            .blocks_between(seg, lo, hi)
            .into_iter()
            .filter(|id| self.blocks.get(id.0).state == BlockState::Aliased)
            .collect();
        // (Freeing one merges only free neighbours: the others stay.)
        for id in aliased {
            let clock = self.clock;
            let b = self.blocks.get_mut(id.0);
            b.state = BlockState::Free;
            b.freed_at = clock;
            self.merge_into_bins(id);
        }
    }
}
