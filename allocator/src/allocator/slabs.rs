//! Slabs: small-pool segments cut into chunks of one size class
//! (`slab_max_kb`, docs/POLICY.md "Slabs").
//!
//! A request of at most `slab_max` bytes (rounded) takes a chunk of its class
//! (`rounding::slab_class`: exact up to 4 KiB, then 8 classes per power of
//! two) from a slab of its pool: the most recently freed chunk of the newest
//! slab with room, else the next chunk carved from the front of that slab's
//! uncarved tail. There is no best-fit search, no split and no merge, which
//! is what a small request costs in the bins. Chunks are blocks of their
//! segment like any other (the snapshot, the live map, the statistics and
//! the invariant check see them), but a free chunk sits in its slab's free
//! list instead of the bins.
//!
//! A slab whose last chunk comes back moves to its pool's list of empty
//! slabs, which any class takes (re-cut) before a new segment is made; like
//! any entirely free segment, an empty slab is released by `empty_cache`,
//! by the release-before-grow rule (idle since its last chunk came back) and
//! by the out-of-memory ladder.

use super::Core;
use crate::bins::Entry;
use crate::block::{
    Block, BlockId, BlockState, Listed, PoolId, PoolKind, SegmentId, SegmentKind, SlabSeg,
};
use crate::rounding::SLAB_CLASSES;

/// The slabs of one pool.
#[derive(Debug)]
pub(super) struct SlabLists {
    /// Per class: slabs with a free chunk or room in their tail; the last
    /// serves first.
    partial: Vec<Vec<SegmentId>>,
    /// Slabs with no chunk in use, with the class each was last cut for.
    empty: Vec<(SegmentId, usize)>,
}

/// The slab feature's data: the size limit of requests that take a chunk
/// and each pool's lists of slabs.
pub(super) struct SlabPools {
    /// Small requests up to this size go to slabs (0: off; see `slabs`).
    slab_max: u64,
    /// Per pool: its slabs, indexed by [`PoolId::index`]; created on first use.
    slab_lists: Vec<Option<Box<SlabLists>>>,
}

impl SlabPools {
    /// No slabs yet; requests up to `slab_max` bytes go to slabs (0: off).
    pub(super) fn new(slab_max: u64) -> Self {
        SlabPools {
            slab_max,
            slab_lists: Vec::new(),
        }
    }

    /// Whether a request of `rounded` bytes takes a slab's chunk.
    #[inline]
    pub(super) fn serves(&self, rounded: u64) -> bool {
        rounded <= self.slab_max
    }

    /// Room for the lists of `pools` pools (a new stream's pools were added).
    pub(super) fn add_pools(&mut self, pools: usize) {
        self.slab_lists.resize_with(pools, || None);
    }
}

impl Default for SlabLists {
    fn default() -> Self {
        SlabLists {
            partial: vec![Vec::new(); SLAB_CLASSES],
            empty: Vec::new(),
        }
    }
}

/// Removes `seg` from `list` (short lists: a scan).
fn unlist(list: &mut Vec<SegmentId>, seg: SegmentId) {
    let i = list
        .iter()
        .rposition(|&s| s == seg)
        .expect("a listed slab is in its list");
    list.swap_remove(i);
}

impl SlabPools {
    /// The chunk for a request the growth ladder served with block `id`:
    /// `id` itself if the ladder's flush freed a chunk of the class, else a
    /// chunk of the new segment `id` heads (one free block outside the bins),
    /// made a slab of `class`.
    pub(super) fn chunk_from_grown<E>(
        &mut self,
        core: &mut Core<E>,
        id: BlockId,
        class: usize,
        chunk: u64,
    ) -> BlockId {
        let b = core.blocks.get(id.0);
        if b.slab {
            return id;
        }
        let (seg, pool) = (b.segment, b.pool);
        self.make_slab(core, seg, class, chunk);
        self.take_chunk(core, pool, class, chunk)
            .expect("a new slab has room for a chunk")
    }

    /// A chunk of `class` from the pool's slabs (a slab with room, else an
    /// empty slab re-cut for the class, else an entirely free segment of the
    /// pool's bins made a slab), still marked free; None if there is none.
    pub(super) fn take_chunk<E>(
        &mut self,
        core: &mut Core<E>,
        pool: PoolId,
        class: usize,
        chunk: u64,
    ) -> Option<BlockId> {
        let lists = self.slab_lists[pool.index()].get_or_insert_with(Box::default);
        let seg = match lists.partial[class].last() {
            Some(&seg) => seg,
            // An empty slab of this class needs no re-cut: it goes first.
            None => match lists
                .empty
                .iter()
                .rposition(|&(_, c)| c == class)
                .or_else(|| lists.empty.len().checked_sub(1))
                .map(|i| lists.empty.swap_remove(i).0)
            {
                Some(seg) => {
                    lists.partial[class].push(seg);
                    self.recut(core, seg, class, chunk);
                    seg
                }
                None => {
                    let seg = self.take_free_segment(core, pool)?;
                    self.make_slab(core, seg, class, chunk);
                    seg
                }
            },
        };
        Some(self.pop_chunk(core, seg))
    }

    /// An entirely free segment of the pool's bins, taken out of them (so
    /// that a new slab costs no device call while one is cached).
    fn take_free_segment<E>(&mut self, core: &mut Core<E>, pool: PoolId) -> Option<SegmentId> {
        let seg_size = core.config.small_segment;
        let bins = &mut core.bins[pool.index()];
        let found = bins.find(seg_size)?;
        let Entry { size, id, .. } = found.entry;
        let b = core.blocks.get(id.0);
        if size != seg_size || b.is_split() {
            return None;
        }
        let seg = b.segment;
        bins.take(found);
        Some(seg)
    }

    /// Before the pool's bins grow: an empty slab of the pool becomes a
    /// plain free segment in the bins again (no device call). Returns
    /// whether there was one.
    pub(super) fn unslab_empty<E>(&mut self, core: &mut Core<E>, pool: PoolId) -> bool {
        let Some(seg) = self
            .slab_lists
            .get_mut(pool.index())
            .and_then(Option::as_mut)
            .and_then(|l| l.empty.pop())
            .map(|(seg, _)| seg)
        else {
            return false;
        };
        let s = core.segments.get_mut(seg.0);
        let (head, addr, size) = (s.head, s.addr, s.size);
        s.kind = SegmentKind::Plain;
        self.join_blocks(core, head, addr, size);
        let h = core.blocks.get_mut(head.0);
        h.slab = false;
        h.freed_at = core.clock;
        core.free_candidates[pool.kind() as usize].insert((core.clock, addr, seg.0));
        core.bins_mut(pool).insert(size, addr, head);
        true
    }

    /// Makes the blocks of an entirely free slab one free block again, the
    /// head's record covering the segment's `size` bytes from `addr`. Its
    /// free blocks counted as inactive split; one block alone does not.
    fn join_blocks<E>(&mut self, core: &mut Core<E>, head: BlockId, addr: u64, size: u64) {
        let mut blocks = 1;
        let mut cur = core.blocks.get(head.0).next;
        while let Some(id) = cur {
            cur = core.blocks.get(id.0).next;
            core.blocks.discard(id.0);
            blocks += 1;
        }
        let h = core.blocks.get_mut(head.0);
        h.addr = addr;
        h.size = size;
        h.next = None;
        if blocks > 1 {
            core.stats.inactive_split.decrease(PoolKind::Small, blocks);
            core.stats
                .inactive_split_bytes
                .decrease(PoolKind::Small, size);
        }
    }

    /// Takes a chunk of slab `seg` (listed as having room): the most recently
    /// freed one, else one carved from the tail.
    fn pop_chunk<E>(&mut self, core: &mut Core<E>, seg: SegmentId) -> BlockId {
        let s = core.segments.get_mut(seg.0);
        let pool = s.pool;
        let slab = s.slab_mut().expect("a listed segment is a slab");
        let chunk = slab.chunk;
        let id = match slab.free.pop() {
            Some(id) => {
                // A free chunk shares its segment: it counted as inactive split.
                core.stats.inactive_split.decrease(PoolKind::Small, 1);
                core.stats
                    .inactive_split_bytes
                    .decrease(PoolKind::Small, chunk);
                id
            }
            None => self.carve(core, seg, chunk),
        };
        let s = core.segments.get_mut(seg.0);
        let slab = s.slab_mut().expect("a slab");
        slab.live += 1;
        let full = slab.free.is_empty()
            && slab
                .tail
                .map_or(true, |t| core.blocks.get(t.0).size < slab.chunk);
        if full {
            slab.listed = Listed::Nowhere;
            let lists = self.slab_lists[pool.index()]
                .as_mut()
                .expect("a slab's pool has lists");
            unlist(&mut lists.partial[slab.class], seg);
        }
        id
    }

    /// Cuts a chunk from the front of slab `seg`'s tail (which has room).
    fn carve<E>(&mut self, core: &mut Core<E>, seg: SegmentId, chunk: u64) -> BlockId {
        let s = core.segments.get(seg.0);
        let pool = s.pool;
        let tail = s
            .slab()
            .and_then(|slab| slab.tail)
            .expect("a slab with room and no free chunk has a tail");
        let t = core.blocks.get(tail.0);
        let (addr, size, prev, split) = (t.addr, t.size, t.prev, t.prev.is_some());
        debug_assert!(size >= chunk && t.next.is_none());
        let kind = PoolKind::Small;
        if size == chunk {
            // The tail is the last chunk.
            core.segments
                .get_mut(seg.0)
                .slab_mut()
                .expect("a slab")
                .tail = None;
            if split {
                core.stats.inactive_split.decrease(kind, 1);
                core.stats.inactive_split_bytes.decrease(kind, chunk);
            }
            return tail;
        }
        let id = BlockId(core.blocks.insert(Block {
            prev,
            next: Some(tail),
            slab: true,
            ..Block::free(addr, chunk, seg, pool, core.clock)
        }));
        match prev {
            Some(p) => core.blocks.get_mut(p.0).next = Some(id),
            None => core.segments.get_mut(seg.0).head = id,
        }
        let t = core.blocks.get_mut(tail.0);
        t.prev = Some(id);
        t.addr += chunk;
        t.size -= chunk;
        if split {
            core.stats.inactive_split_bytes.decrease(kind, chunk);
        } else {
            // The segment was one free block; its tail now shares it.
            core.stats.inactive_split.increase(kind, 1);
            core.stats.inactive_split_bytes.increase(kind, size - chunk);
        }
        id
    }

    /// Makes the new segment `seg` (one free block, outside the bins) a slab
    /// of `class`, listed as having room.
    fn make_slab<E>(&mut self, core: &mut Core<E>, seg: SegmentId, class: usize, chunk: u64) {
        let s = core.segments.get_mut(seg.0);
        let (head, pool) = (s.head, s.pool);
        s.kind = SegmentKind::Slab(SlabSeg {
            class,
            chunk,
            live: 0,
            free: Vec::new(),
            tail: Some(head),
            listed: Listed::Partial,
            idle_since: core.clock,
        });
        core.blocks.get_mut(head.0).slab = true;
        self.slab_lists[pool.index()]
            .get_or_insert_with(Box::default)
            .partial[class]
            .push(seg);
    }

    /// Re-cuts the empty slab `seg` (already moved to `class`'s list) for
    /// `class`: its blocks become one uncarved tail again, unless it already
    /// holds that class.
    fn recut<E>(&mut self, core: &mut Core<E>, seg: SegmentId, class: usize, chunk: u64) {
        let s = core.segments.get_mut(seg.0);
        let (head, addr, size) = (s.head, s.addr, s.size);
        let slab = s.slab_mut().expect("an empty slab");
        debug_assert_eq!(slab.live, 0);
        slab.listed = Listed::Partial;
        if slab.class == class {
            return;
        }
        slab.class = class;
        slab.chunk = chunk;
        slab.free.clear();
        slab.tail = Some(head);
        self.join_blocks(core, head, addr, size);
    }

    /// Returns chunk `id` (already marked free) to its slab.
    pub(super) fn slab_free<E>(&mut self, core: &mut Core<E>, id: BlockId) {
        let b = core.blocks.get_mut(id.0);
        b.freed_at = core.clock;
        let seg = b.segment;
        let s = core.segments.get_mut(seg.0);
        let (pool, seg_addr) = (s.pool, s.addr);
        let slab = s.slab_mut().expect("a chunk's segment is a slab");
        slab.free.push(id);
        slab.live -= 1;
        // A chunk always shares its segment (a slab holds at least two).
        core.stats.inactive_split.increase(PoolKind::Small, 1);
        core.stats
            .inactive_split_bytes
            .increase(PoolKind::Small, slab.chunk);
        let lists = self.slab_lists[pool.index()]
            .as_mut()
            .expect("a slab's pool has lists");
        if slab.live == 0 {
            core.free_candidates[pool.kind() as usize].insert((core.clock, seg_addr, seg.0));
            if slab.listed == Listed::Partial {
                unlist(&mut lists.partial[slab.class], seg);
            }
            slab.listed = Listed::Empty;
            slab.idle_since = core.clock;
            lists.empty.push((seg, slab.class));
        } else if slab.listed == Listed::Nowhere {
            slab.listed = Listed::Partial;
            lists.partial[slab.class].push(seg);
        }
    }

    /// Forgets the records of the empty slab `seg`, which is being released:
    /// its blocks and its place in the empty list.
    pub(super) fn drop_slab<E>(&mut self, core: &mut Core<E>, seg: SegmentId) {
        let s = core.segments.get_mut(seg.0);
        let (pool, head, addr, size) = (s.pool, s.head, s.addr, s.size);
        let SegmentKind::Slab(slab) = std::mem::replace(&mut s.kind, SegmentKind::Plain) else {
            unreachable!("drop_slab of a segment that is no slab")
        };
        debug_assert!(slab.live == 0 && slab.listed == Listed::Empty);
        let lists = self.slab_lists[pool.index()]
            .as_mut()
            .expect("a slab's pool has lists");
        let i = lists
            .empty
            .iter()
            .position(|&(s, _)| s == seg)
            .expect("an empty slab is in its pool's empty list");
        lists.empty.swap_remove(i);
        self.join_blocks(core, head, addr, size);
        core.blocks.discard(head.0);
    }

    /// Checks slab `seg`'s bookkeeping against its blocks: every block but
    /// the tail is a chunk of the class's size, the free list holds exactly
    /// the free chunks, `live` counts the others, and the slab is listed
    /// where its state says.
    pub(super) fn check_slab<E>(&self, core: &Core<E>, seg: SegmentId) -> Result<(), String> {
        let s = core.segments.get(seg.0);
        let slab = s.slab().expect("a slab");
        let (mut live, mut free) = (0u32, Vec::new());
        let mut cur = Some(s.head);
        let mut last = s.head;
        while let Some(id) = cur {
            let b = core.blocks.get(id.0);
            if !b.slab {
                return Err(format!("block at {:#x} of a slab is not marked", b.addr));
            }
            if Some(id) != slab.tail {
                if b.size != slab.chunk {
                    return Err(format!(
                        "chunk at {:#x} has {} bytes in a slab of {}-byte chunks",
                        b.addr, b.size, slab.chunk
                    ));
                }
                if b.state == BlockState::Free {
                    free.push(id);
                } else {
                    live += 1;
                }
            } else if b.state != BlockState::Free {
                return Err(format!("slab tail at {:#x} is in use", b.addr));
            }
            last = id;
            cur = b.next;
        }
        if slab.tail.is_some_and(|t| t != last) {
            return Err(format!(
                "slab at {:#x}: its tail is not its last block",
                s.addr
            ));
        }
        let mut listed_free = slab.free.clone();
        listed_free.sort_unstable();
        free.sort_unstable();
        if listed_free != free || live != slab.live {
            return Err(format!(
                "slab at {:#x}: {} chunks free and {live} in use, but it lists {} free and counts {} in use",
                s.addr,
                free.len(),
                slab.free.len(),
                slab.live
            ));
        }
        let room = !slab.free.is_empty()
            || slab
                .tail
                .is_some_and(|t| core.blocks.get(t.0).size >= slab.chunk);
        let expect = if live == 0 {
            Listed::Empty
        } else if room {
            Listed::Partial
        } else {
            Listed::Nowhere
        };
        let lists = self.slab_lists.get(s.pool.index()).and_then(Option::as_ref);
        let count = |list: Option<&Vec<SegmentId>>| {
            list.map_or(0, |l| l.iter().filter(|&&x| x == seg).count())
        };
        let (in_partial, in_empty) = (
            count(lists.map(|l| &l.partial[slab.class])),
            lists.map_or(0, |l| {
                l.empty
                    .iter()
                    .filter(|&&(x, c)| x == seg && c == slab.class)
                    .count()
            }),
        );
        let ok = match slab.listed {
            Listed::Nowhere => in_partial == 0 && in_empty == 0,
            Listed::Partial => in_partial == 1 && in_empty == 0,
            Listed::Empty => in_partial == 0 && in_empty == 1,
        };
        if slab.listed != expect || !ok {
            return Err(format!(
                "slab at {:#x} is listed {:?} ({in_partial} times with its class, {in_empty} as empty) but should be {expect:?}",
                s.addr, slab.listed
            ));
        }
        Ok(())
    }

    /// Entries in the pools' slab lists (each slab is checked against its
    /// entries by [`SlabPools::check_slab`]).
    pub(super) fn listed_slabs(&self) -> usize {
        self.slab_lists
            .iter()
            .flatten()
            .map(|l| l.empty.len() + l.partial.iter().map(Vec::len).sum::<usize>())
            .sum()
    }
}
