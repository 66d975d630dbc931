//! The ids of the allocator's records: blocks, segments, pools and thread
//! caches. Each is an index into its arena or list, a type of its own so
//! that an id of one kind is never taken for another, or for an address.

/// Index of a block record in the allocator's block arena.
#[derive(Copy, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Debug)]
pub struct BlockId(pub(crate) u32);

/// Index of a segment record in the allocator's segment arena.
#[derive(Copy, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Debug)]
pub struct SegmentId(pub(crate) u32);

/// Index of a pool: one small and one large pool per stream.
#[derive(Copy, Clone, PartialEq, Eq, Hash, Debug)]
pub struct PoolId(pub(crate) u32);

impl PoolId {
    pub(crate) fn new(stream_slot: u32, kind: PoolKind) -> Self {
        PoolId(stream_slot * POOLS_PER_STREAM + kind as u32)
    }
    pub(crate) fn kind(self) -> PoolKind {
        match self.0 % POOLS_PER_STREAM {
            0 => PoolKind::Small,
            1 => PoolKind::Large,
            _ => PoolKind::Huge,
        }
    }
    pub(crate) fn stream_slot(self) -> usize {
        (self.0 / POOLS_PER_STREAM) as usize
    }
    pub(crate) fn index(self) -> usize {
        self.0 as usize
    }
}

/// Pools per stream: small, large and huge.
pub(crate) const POOLS_PER_STREAM: u32 = 3;

/// Which pool a block belongs to.
#[derive(Copy, Clone, PartialEq, Eq, Hash, Debug)]
pub enum PoolKind {
    /// Requests up to the small-size limit (1 MiB), carved from small segments.
    Small = 0,
    /// Everything else (below the huge threshold, if one is set).
    Large = 1,
    /// Requests at or above `Config::huge_size`: their segments serve only
    /// huge requests, so no small long-lived block strands their space.
    /// Counted with the large pool in the statistics.
    Huge = 2,
}

impl PoolKind {
    /// Index of the statistics group (`small_pool` = 1, `large_pool` = 2).
    pub(crate) fn stat_group(self) -> usize {
        match self {
            PoolKind::Small => 1,
            PoolKind::Large | PoolKind::Huge => 2,
        }
    }
}

/// Index of a thread cache in its allocator.
#[derive(Copy, Clone, PartialEq, Eq, Debug)]
pub(crate) struct SlotId(pub u32);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pool_ids() {
        assert_eq!(PoolId::new(3, PoolKind::Large).kind(), PoolKind::Large);
        assert_eq!(PoolId::new(3, PoolKind::Small).kind(), PoolKind::Small);
        assert_eq!(PoolId::new(3, PoolKind::Huge).kind(), PoolKind::Huge);
        assert_eq!(PoolId::new(3, PoolKind::Large).index(), 10);
        assert_eq!(PoolId::new(3, PoolKind::Huge).stream_slot(), 3);
    }
}
