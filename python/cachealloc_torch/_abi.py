"""The C ABI's constants for Python: generated from include/cachealloc.h
(itself generated from src/capi.rs and src/capi_torch.rs) by src/abi_tests.rs;
do not edit. `CACHEALLOC_UPDATE_ABI=1 cargo test --lib abi_` rewrites it.

STATS_* and STAT_*: Note [The statistics vector]; SEGMENT_* and BLOCK_*:
Note [The snapshot words] (src/capi_torch.rs). STAT_NAMES[i] is the
torch.cuda.memory_stats() key of slot i of the statistics vector.
"""

MAX_DEVICES = 64
STAT_CURRENT = 0
STAT_PEAK = 1
STAT_ALLOCATED = 2
STAT_FREED = 3
STAT_FIELDS = 4
STAT_AGGREGATE = 0
STAT_SMALL_POOL = 1
STAT_LARGE_POOL = 2
STAT_GROUPS = 3
STAT_ARRAY_LEN = 12
STATS_ALLOCATION = 0
STATS_SEGMENT = 12
STATS_ACTIVE = 24
STATS_INACTIVE_SPLIT = 36
STATS_ALLOCATED_BYTES = 48
STATS_RESERVED_BYTES = 60
STATS_ACTIVE_BYTES = 72
STATS_INACTIVE_SPLIT_BYTES = 84
STATS_REQUESTED_BYTES = 96
STAT_ARRAYS = 9
STATS_OVERSIZE_ALLOCATIONS = 108
STATS_OVERSIZE_SEGMENTS = 112
STATS_NUM_ALLOC_RETRIES = 116
STATS_NUM_OOMS = 117
STATS_NUM_SYNC_ALL_STREAMS = 118
STATS_NUM_DEVICE_ALLOC = 119
STATS_NUM_DEVICE_FREE = 120
STATS_MAX_SPLIT_SIZE = 121
STATS_LEN = 122
SEGMENT_ADDRESS = 0
SEGMENT_TOTAL_SIZE = 1
SEGMENT_ALLOCATED_SIZE = 2
SEGMENT_REQUESTED_SIZE = 3
SEGMENT_STREAM = 4
SEGMENT_IS_LARGE = 5
SEGMENT_BLOCKS = 6
SEGMENT_MAPPED_SIZE = 7
SEGMENT_WORDS = 8
BLOCK_ADDRESS = 0
BLOCK_SIZE = 1
BLOCK_REQUESTED_SIZE = 2
BLOCK_STATE = 3
BLOCK_WORDS = 4
BLOCK_STATE_INACTIVE = 0
BLOCK_STATE_ALLOCATED = 1
BLOCK_STATE_PENDING_FREE = 2
IPC_STATS_OPEN = 0
IPC_STATS_USERS = 1
IPC_STATS_OPENED = 2
IPC_STATS_CLOSED = 3
IPC_STATS_PINNED_BLOCKS = 4
IPC_STATS_PINNED_BYTES = 5
IPC_STATS_EXPORTED_PAGES = 6
IPC_STATS_PAGES_SHAREABLE = 7
IPC_STATS_LEN = 8

STAT_NAMES = (
    "allocation.all.current",
    "allocation.all.peak",
    "allocation.all.allocated",
    "allocation.all.freed",
    "allocation.small_pool.current",
    "allocation.small_pool.peak",
    "allocation.small_pool.allocated",
    "allocation.small_pool.freed",
    "allocation.large_pool.current",
    "allocation.large_pool.peak",
    "allocation.large_pool.allocated",
    "allocation.large_pool.freed",
    "segment.all.current",
    "segment.all.peak",
    "segment.all.allocated",
    "segment.all.freed",
    "segment.small_pool.current",
    "segment.small_pool.peak",
    "segment.small_pool.allocated",
    "segment.small_pool.freed",
    "segment.large_pool.current",
    "segment.large_pool.peak",
    "segment.large_pool.allocated",
    "segment.large_pool.freed",
    "active.all.current",
    "active.all.peak",
    "active.all.allocated",
    "active.all.freed",
    "active.small_pool.current",
    "active.small_pool.peak",
    "active.small_pool.allocated",
    "active.small_pool.freed",
    "active.large_pool.current",
    "active.large_pool.peak",
    "active.large_pool.allocated",
    "active.large_pool.freed",
    "inactive_split.all.current",
    "inactive_split.all.peak",
    "inactive_split.all.allocated",
    "inactive_split.all.freed",
    "inactive_split.small_pool.current",
    "inactive_split.small_pool.peak",
    "inactive_split.small_pool.allocated",
    "inactive_split.small_pool.freed",
    "inactive_split.large_pool.current",
    "inactive_split.large_pool.peak",
    "inactive_split.large_pool.allocated",
    "inactive_split.large_pool.freed",
    "allocated_bytes.all.current",
    "allocated_bytes.all.peak",
    "allocated_bytes.all.allocated",
    "allocated_bytes.all.freed",
    "allocated_bytes.small_pool.current",
    "allocated_bytes.small_pool.peak",
    "allocated_bytes.small_pool.allocated",
    "allocated_bytes.small_pool.freed",
    "allocated_bytes.large_pool.current",
    "allocated_bytes.large_pool.peak",
    "allocated_bytes.large_pool.allocated",
    "allocated_bytes.large_pool.freed",
    "reserved_bytes.all.current",
    "reserved_bytes.all.peak",
    "reserved_bytes.all.allocated",
    "reserved_bytes.all.freed",
    "reserved_bytes.small_pool.current",
    "reserved_bytes.small_pool.peak",
    "reserved_bytes.small_pool.allocated",
    "reserved_bytes.small_pool.freed",
    "reserved_bytes.large_pool.current",
    "reserved_bytes.large_pool.peak",
    "reserved_bytes.large_pool.allocated",
    "reserved_bytes.large_pool.freed",
    "active_bytes.all.current",
    "active_bytes.all.peak",
    "active_bytes.all.allocated",
    "active_bytes.all.freed",
    "active_bytes.small_pool.current",
    "active_bytes.small_pool.peak",
    "active_bytes.small_pool.allocated",
    "active_bytes.small_pool.freed",
    "active_bytes.large_pool.current",
    "active_bytes.large_pool.peak",
    "active_bytes.large_pool.allocated",
    "active_bytes.large_pool.freed",
    "inactive_split_bytes.all.current",
    "inactive_split_bytes.all.peak",
    "inactive_split_bytes.all.allocated",
    "inactive_split_bytes.all.freed",
    "inactive_split_bytes.small_pool.current",
    "inactive_split_bytes.small_pool.peak",
    "inactive_split_bytes.small_pool.allocated",
    "inactive_split_bytes.small_pool.freed",
    "inactive_split_bytes.large_pool.current",
    "inactive_split_bytes.large_pool.peak",
    "inactive_split_bytes.large_pool.allocated",
    "inactive_split_bytes.large_pool.freed",
    "requested_bytes.all.current",
    "requested_bytes.all.peak",
    "requested_bytes.all.allocated",
    "requested_bytes.all.freed",
    "requested_bytes.small_pool.current",
    "requested_bytes.small_pool.peak",
    "requested_bytes.small_pool.allocated",
    "requested_bytes.small_pool.freed",
    "requested_bytes.large_pool.current",
    "requested_bytes.large_pool.peak",
    "requested_bytes.large_pool.allocated",
    "requested_bytes.large_pool.freed",
    "oversize_allocations.current",
    "oversize_allocations.peak",
    "oversize_allocations.allocated",
    "oversize_allocations.freed",
    "oversize_segments.current",
    "oversize_segments.peak",
    "oversize_segments.allocated",
    "oversize_segments.freed",
    "num_alloc_retries",
    "num_ooms",
    "num_sync_all_streams",
    "num_device_alloc",
    "num_device_free",
    "max_split_size",
)
