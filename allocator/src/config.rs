//! Allocator policy and its `key:value,…` configuration string.
//!
//! The syntax is `PYTORCH_CUDA_ALLOC_CONF`'s; its keys are accepted where
//! they apply, plus our own policy keys. A string may start with the name of
//! a preset (`pytorch`, `default`, `no-caching`), which the keys then modify:
//! `pytorch,max_split_size_mb:64`.

use crate::rounding::{Power2Divisions, POWER2_INTERVALS, SLAB_MAX};
use std::fmt;

const MIB: u64 = 1 << 20;

/// A limit on reserved memory.
#[derive(Copy, Clone, PartialEq, Debug)]
pub enum MemoryCap {
    /// At most this many bytes reserved.
    Bytes(u64),
    /// At most this fraction (0, 1] of the device's total memory.
    Fraction(f64),
}

impl MemoryCap {
    /// The cap in bytes on a device of `total` bytes.
    pub fn bytes(self, total: u64) -> u64 {
        match self {
            MemoryCap::Bytes(b) => b,
            MemoryCap::Fraction(f) => (f * total as f64) as u64,
        }
    }
}

/// Which entirely free segments to release first when room is needed.
#[derive(Copy, Clone, PartialEq, Eq, Debug)]
pub enum ReleaseOrder {
    /// The smallest single segment that makes enough room, else the largest first.
    SmallestFit,
    /// The largest first.
    Largest,
    /// The longest idle first.
    Oldest,
    /// All of them.
    All,
}

/// Expandable segments: which page size backs the partly covered big pages
/// at a block's edges (see `docs/POLICY.md`, "Mixed page sizes").
#[derive(Copy, Clone, PartialEq, Eq, Debug)]
pub enum EdgePages {
    /// Always granularity-sized pages at the edges: only the granules under
    /// the block are mapped (big pages only where wholly under it).
    Small,
    /// Always a whole big page (one page size per range, as before mixed pages).
    Big,
    /// Whole big pages while there is room; under pressure (reserved memory
    /// within `idle_slack_hard` of the cap or of the device's capacity)
    /// granularity-sized pages only, so that no memory is lost to the
    /// partly used big pages at blocks' edges.
    Pressure,
}

/// How the allocator carves segments and blocks. See `docs/POLICY.md`.
#[derive(Clone, PartialEq, Debug)]
pub struct Config {
    /// Name of the preset this config started from (for reports).
    pub name: String,
    /// Cache freed blocks at all; `false` frees every block's segment at once.
    pub caching: bool,
    /// Requests up to this size go to the small pool.
    pub small_size: u64,
    /// Size of small-pool segments.
    pub small_segment: u64,
    /// Segment size for large requests below `large_threshold`.
    pub medium_segment: u64,
    /// Large requests at or above this get a segment of their own size (rounded).
    pub large_threshold: u64,
    /// Granule that own-size large segments are rounded up to.
    pub segment_round: u64,
    /// Requests at or above this size go to the huge pool, whose blocks only
    /// huge requests may take (`u64::MAX`: no huge pool).
    pub huge_size: u64,
    /// Segments of the huge pool are rounded up to the next of this many equal
    /// steps between powers of two (0: to `segment_round` only), so that
    /// huge requests of varying size fit each other's segments.
    pub huge_segment_divisions: u32,
    /// Large blocks are split only when the remainder is larger than this.
    pub large_split_remainder: u64,
    /// PyTorch's `max_split_size`: blocks this large are never split, and
    /// smaller requests never take them. `u64::MAX` means unlimited.
    pub max_split_size: u64,
    /// A request ≥ `max_split_size` takes a cached block only if it is less
    /// than this much larger.
    pub oversize_slack: u64,
    /// `roundup_power2_divisions` per interval.
    pub roundup_power2_divisions: Power2Divisions,
    /// Fraction of the cap above which unused cached segments are garbage-collected.
    pub garbage_collection_threshold: Option<f64>,
    /// Limit on reserved memory.
    pub memory_cap: Option<MemoryCap>,
    /// Before a new segment would lift reserved memory above its previous
    /// peak, release entirely free cached segments first.
    pub release_before_grow: bool,
    /// A large request does not take an entirely free segment more than this
    /// many times its size (0: no limit); it gets a segment of its own, so
    /// big segments are not carved up by smaller, longer-lived blocks.
    pub oversize_ratio: u64,
    /// Before growing, release only segments idle for at least this many
    /// allocator operations (mallocs and frees).
    pub release_min_idle: u64,
    /// Before growing, release only segments that stayed free while the
    /// program allocated at least this fraction of its peak allocated bytes
    /// (0: any free segment): an idle age that means the same on every
    /// workload, about a step's worth of allocations at 1.
    pub release_idle_frac: f64,
    /// The idle age applies only while reserved memory stays within
    /// `1 + release_idle_slack` times the peak allocated bytes: past that,
    /// any free segment is released before growing, so the idle age costs at
    /// most this much memory.
    pub release_idle_slack: f64,
    /// Before growing, release only free segments of the pool kind (small,
    /// large, huge) of the segment being created, so that pools do not trade
    /// memory back and forth every step (the out-of-memory ladder still
    /// releases any free segment).
    pub release_same_kind: bool,
    /// Which free segments go first when room is needed.
    pub release_order: ReleaseOrder,
    /// Expandable segments: idle pages stay mapped while reserved memory is
    /// at most `1 + idle_slack` times the peak allocated bytes.
    pub idle_slack: f64,
    /// Expandable segments: past `1 + idle_slack` times the peak allocated
    /// bytes, idle pages that no queued work can touch move without any wait;
    /// past `1 + idle_slack_hard`, the allocator waits for the device to
    /// recycle the rest (a device-wide synchronize) rather than grow.
    pub idle_slack_hard: f64,
    /// Expandable segments: a recycling round unmaps the pages needed now plus
    /// this fraction of the peak allocated bytes (longest idle first), so
    /// that the next mappings need no new round (each round waits for the device).
    pub recycle_batch: f64,
    /// Expandable segments: page size of the large pools (a multiple of the
    /// device granularity; the small pool always uses the granularity).
    pub expandable_page: u64,
    /// Expandable segments: page size at the edges of a block, where a big
    /// page would lie only partly under it.
    pub expandable_edges: EdgePages,
    /// Page-backed growable segments (CUDA virtual memory API).
    pub expandable_segments: bool,
    /// Freed blocks each thread keeps for its own next request of the same
    /// rounded size and stream, served without the allocator's lock (0: off;
    /// ignored with expandable segments or without caching). See `docs/POLICY.md`.
    pub thread_cache: u32,
    /// Small requests up to this many bytes (rounded) take a chunk of their
    /// size class from a small-pool segment that holds only that class (a
    /// slab): no best-fit search, no split, no merge (0: off; at most
    /// [`SLAB_MAX`]; ignored with expandable segments or without caching).
    /// See `docs/POLICY.md`, "Slabs".
    pub slab_max: u64,
}

impl Config {
    /// PyTorch's default `CUDACachingAllocator` policy, exactly.
    pub fn pytorch() -> Self {
        Config {
            name: "pytorch".into(),
            caching: true,
            small_size: MIB,
            small_segment: 2 * MIB,
            medium_segment: 20 * MIB,
            large_threshold: 10 * MIB,
            segment_round: 2 * MIB,
            large_split_remainder: MIB,
            huge_size: u64::MAX,
            huge_segment_divisions: 0,
            thread_cache: 0,
            slab_max: 0,
            max_split_size: u64::MAX,
            oversize_slack: 20 * MIB,
            roundup_power2_divisions: [0; POWER2_INTERVALS],
            garbage_collection_threshold: None,
            memory_cap: None,
            release_before_grow: false,
            release_order: ReleaseOrder::SmallestFit,
            oversize_ratio: 0,
            release_min_idle: 0,
            release_idle_frac: 0.0,
            release_idle_slack: 0.0,
            release_same_kind: false,
            idle_slack: 0.01,
            idle_slack_hard: 0.02,
            recycle_batch: 0.05,
            expandable_page: 8 * MIB,
            expandable_edges: EdgePages::Pressure,
            expandable_segments: false,
        }
    }

    /// Our policy with a huge pool for requests ≥ 256 MiB (segments rounded to
    /// 1/16 of a power of two, never taken by a request under half their
    /// size): less stranded memory on workloads with very large, varying
    /// tensors, at the price of more driver calls. See `docs/POLICY.md`.
    pub fn lowmem() -> Self {
        Config {
            name: "lowmem".into(),
            huge_size: 256 * MIB,
            huge_segment_divisions: 16,
            oversize_ratio: 2,
            release_same_kind: false,
            release_min_idle: 0,
            slab_max: 0,
            ..Self::default()
        }
    }

    /// Our policy on expandable segments (CUDA virtual memory API): one
    /// virtual range per stream and pool, 2 MiB pages mapped under live
    /// blocks, idle pages moved to where they are needed instead of growing.
    pub fn expandable() -> Self {
        Config {
            name: "expandable".into(),
            expandable_segments: true,
            huge_size: u64::MAX,
            release_same_kind: false,
            release_min_idle: 0,
            ..Self::default()
        }
    }

    /// No caching: every allocation is its own device segment, freed at once.
    pub fn no_caching() -> Self {
        Config {
            name: "no-caching".into(),
            caching: false,
            ..Self::pytorch()
        }
    }

    /// The named presets, for help texts.
    pub const PRESETS: &'static [&'static str] =
        &["default", "pytorch", "expandable", "lowmem", "no-caching"];

    /// A preset by name.
    pub fn preset(name: &str) -> Option<Self> {
        match name {
            "default" => Some(Self::default()),
            "pytorch" => Some(Self::pytorch()),
            "lowmem" => Some(Self::lowmem()),
            "expandable" => Some(Self::expandable()),
            "no-caching" | "no_caching" | "none" => Some(Self::no_caching()),
            _ => None,
        }
    }

    /// Parses a configuration string (see the module docs); an empty string is the default.
    pub fn parse(conf: &str) -> Result<Self, ConfigError> {
        let mut items = conf
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .peekable();
        let mut config = match items.peek() {
            Some(first) if !first.contains(':') => {
                let c = Self::preset(first)
                    .ok_or_else(|| ConfigError::UnknownPreset(first.to_string()))?;
                items.next();
                c
            }
            _ => Self::default(),
        };
        let rest: Vec<&str> = items.collect();
        // A `[…]` list value contains commas: glue its pieces back together.
        let mut i = 0;
        while i < rest.len() {
            let mut item = rest[i].to_string();
            if item.contains('[') {
                while !item.contains(']') && i + 1 < rest.len() {
                    i += 1;
                    item.push(',');
                    item.push_str(rest[i]);
                }
            }
            config.apply(&item)?;
            i += 1;
        }
        config.validate()?;
        Ok(config)
    }

    fn apply(&mut self, item: &str) -> Result<(), ConfigError> {
        let (key, value) = item
            .split_once(':')
            .ok_or_else(|| ConfigError::Syntax(item.to_string()))?;
        let (key, value) = (key.trim(), value.trim());
        let bad = |why: &str| ConfigError::BadValue {
            key: key.to_string(),
            value: value.to_string(),
            why: why.to_string(),
        };
        let mib = |v: &str| -> Result<u64, ConfigError> {
            let n: u64 = v
                .parse()
                .map_err(|_| bad("expected a whole number of MiB"))?;
            n.checked_mul(MIB).ok_or_else(|| bad("too large"))
        };
        match key {
            "max_split_size_mb" if value == "unlimited" => self.max_split_size = u64::MAX,
            "huge_size_mb" if value == "unlimited" => self.huge_size = u64::MAX,
            "max_split_size_mb" => {
                let m = mib(value)?;
                if m < 20 * MIB {
                    return Err(bad("must be at least 20 MiB (PyTorch's minimum)"));
                }
                self.max_split_size = m;
            }
            "roundup_power2_divisions" => {
                self.roundup_power2_divisions = parse_divisions(value).map_err(|w| bad(&w))?
            }
            "garbage_collection_threshold" => {
                let t: f64 = value.parse().map_err(|_| bad("expected a number"))?;
                if !(t > 0.0 && t < 1.0) {
                    return Err(bad("must be strictly between 0 and 1"));
                }
                self.garbage_collection_threshold = Some(t);
            }
            "expandable_segments" => {
                self.expandable_segments =
                    parse_bool(value).ok_or_else(|| bad("expected True or False"))?
            }
            "backend" => {
                if value != "native" {
                    return Err(bad(
                        "cachealloc is itself the allocator; only `native` applies",
                    ));
                }
            }
            "release_lock_on_cudamalloc"
            | "pinned_use_cuda_host_register"
            | "pinned_use_background_threads" => {
                parse_bool(value).ok_or_else(|| bad("expected True or False"))?;
            }
            "per_process_memory_fraction" | "memory_fraction" => {
                let f: f64 = value.parse().map_err(|_| bad("expected a number"))?;
                if !(f > 0.0 && f <= 1.0) {
                    return Err(bad("must be in (0, 1]"));
                }
                self.memory_cap = Some(MemoryCap::Fraction(f));
            }
            "memory_cap" => {
                let b = parse_size(value).map_err(|w| bad(&w))?;
                self.memory_cap = Some(MemoryCap::Bytes(b));
            }
            "caching" => {
                self.caching = parse_bool(value).ok_or_else(|| bad("expected True or False"))?
            }
            "release_before_grow" => {
                self.release_before_grow =
                    parse_bool(value).ok_or_else(|| bad("expected True or False"))?
            }
            "small_segment_mb" => self.small_segment = mib(value)?,
            "medium_segment_mb" => self.medium_segment = mib(value)?,
            "large_threshold_mb" => self.large_threshold = mib(value)?,
            "segment_round_mb" => self.segment_round = mib(value)?,
            "large_split_remainder_mb" => self.large_split_remainder = mib(value)?,
            "huge_size_mb" => self.huge_size = mib(value)?,
            "idle_slack" => {
                let f: f64 = value.parse().map_err(|_| bad("expected a number"))?;
                if !(0.0..=10.0).contains(&f) {
                    return Err(bad("must be between 0 and 10"));
                }
                self.idle_slack = f;
            }
            "expandable_page_mb" => {
                let m = mib(value)?;
                if m == 0 {
                    return Err(bad("must be positive"));
                }
                self.expandable_page = m;
            }
            "expandable_edges" => {
                self.expandable_edges = match value {
                    "small" => EdgePages::Small,
                    "big" => EdgePages::Big,
                    "pressure" => EdgePages::Pressure,
                    _ => return Err(bad("expected small, big or pressure")),
                }
            }
            "idle_slack_hard" => {
                let f: f64 = value.parse().map_err(|_| bad("expected a number"))?;
                if !(0.0..=10.0).contains(&f) {
                    return Err(bad("must be between 0 and 10"));
                }
                self.idle_slack_hard = f;
            }
            "recycle_batch" => {
                let f: f64 = value.parse().map_err(|_| bad("expected a number"))?;
                if !(0.0..=1000.0).contains(&f) {
                    return Err(bad("must be between 0 and 1000"));
                }
                self.recycle_batch = f;
            }
            "release_min_idle" => {
                self.release_min_idle = value.parse().map_err(|_| bad("expected a whole number"))?
            }
            "release_idle_frac" => {
                self.release_idle_frac = value
                    .parse()
                    .ok()
                    .filter(|f: &f64| f.is_finite() && *f >= 0.0)
                    .ok_or_else(|| bad("expected a fraction, 0 or more"))?
            }
            "release_idle_slack" => {
                self.release_idle_slack = value
                    .parse()
                    .ok()
                    .filter(|f: &f64| f.is_finite() && *f >= 0.0)
                    .ok_or_else(|| bad("expected a fraction, 0 or more"))?
            }
            "release_same_kind" => {
                self.release_same_kind =
                    parse_bool(value).ok_or_else(|| bad("expected True or False"))?
            }
            "oversize_ratio" => {
                self.oversize_ratio = value.parse().map_err(|_| bad("expected a whole number"))?
            }
            "release_order" => {
                self.release_order = match value {
                    "smallest_fit" => ReleaseOrder::SmallestFit,
                    "largest" => ReleaseOrder::Largest,
                    "oldest" => ReleaseOrder::Oldest,
                    "all" => ReleaseOrder::All,
                    _ => return Err(bad("expected oldest, smallest_fit, largest or all")),
                }
            }
            "thread_cache" => {
                let n: u32 = value.parse().map_err(|_| bad("expected a whole number"))?;
                if n > MAX_THREAD_CACHE {
                    return Err(bad("at most 1024 blocks per thread"));
                }
                self.thread_cache = n;
            }
            "slab_max_kb" => {
                let kib: u64 = value
                    .parse()
                    .map_err(|_| bad("expected a whole number of KiB"))?;
                if kib > SLAB_MAX / 1024 {
                    return Err(bad("at most 1024 KiB (a slab holds at least two chunks)"));
                }
                self.slab_max = kib * 1024;
            }
            "huge_segment_divisions" => {
                let d: u32 = value.parse().map_err(|_| bad("expected a whole number"))?;
                if d > 1 << 16 || (d > 1 && !d.is_power_of_two()) {
                    return Err(bad("must be 0 or a power of two"));
                }
                self.huge_segment_divisions = d;
            }
            _ => return Err(ConfigError::UnknownKey(key.to_string())),
        }
        Ok(())
    }

    fn validate(&self) -> Result<(), ConfigError> {
        let bad = |key: &str, value: u64, why: &str| {
            Err(ConfigError::BadValue {
                key: key.into(),
                value: value.to_string(),
                why: why.into(),
            })
        };
        if self.small_segment < self.small_size || self.small_segment % 512 != 0 {
            return bad(
                "small_segment_mb",
                self.small_segment / MIB,
                "must hold a small request (≥ 1 MiB)",
            );
        }
        if self.segment_round == 0 {
            return bad("segment_round_mb", 0, "must be positive");
        }
        let slab_limit = self.small_size.min(self.small_segment / 2);
        if self.slab_max > slab_limit {
            return bad(
                "slab_max_kb",
                self.slab_max / 1024,
                &format!(
                    "slabs are small-pool segments holding at least two chunks: at most {} KiB \
                     with small_segment_mb:{} (set slab_max_kb lower, or 0 for no slabs)",
                    slab_limit / 1024,
                    self.small_segment / MIB
                ),
            );
        }
        if self.medium_segment < self.large_threshold {
            return bad(
                "medium_segment_mb",
                self.medium_segment / MIB,
                "must be at least large_threshold_mb",
            );
        }
        Ok(())
    }

    /// The configuration as a `key:value,…` string that [`Config::parse`]
    /// reads back to an equal configuration (every key is written).
    pub fn to_conf_string(&self) -> String {
        let mib_or_unlimited = |v: u64| {
            if v == u64::MAX {
                "unlimited".to_string()
            } else {
                (v / MIB).to_string()
            }
        };
        let release_order = match self.release_order {
            ReleaseOrder::SmallestFit => "smallest_fit",
            ReleaseOrder::Largest => "largest",
            ReleaseOrder::Oldest => "oldest",
            ReleaseOrder::All => "all",
        };
        let mut s = format!(
            "{},caching:{},small_segment_mb:{},medium_segment_mb:{},large_threshold_mb:{},segment_round_mb:{},\
             large_split_remainder_mb:{},max_split_size_mb:{},huge_size_mb:{},huge_segment_divisions:{},\
             oversize_ratio:{},release_before_grow:{},release_order:{},release_min_idle:{},release_same_kind:{},idle_slack:{},idle_slack_hard:{},recycle_batch:{},expandable_page_mb:{},\
             expandable_edges:{},expandable_segments:{}",
            self.name,
            py_bool(self.caching),
            self.small_segment / MIB,
            self.medium_segment / MIB,
            self.large_threshold / MIB,
            self.segment_round / MIB,
            self.large_split_remainder / MIB,
            mib_or_unlimited(self.max_split_size),
            mib_or_unlimited(self.huge_size),
            self.huge_segment_divisions,
            self.oversize_ratio,
            py_bool(self.release_before_grow),
            release_order,
            self.release_min_idle,
            py_bool(self.release_same_kind),
            self.idle_slack,
            self.idle_slack_hard,
            self.recycle_batch,
            self.expandable_page / MIB,
            match self.expandable_edges {
                EdgePages::Small => "small",
                EdgePages::Big => "big",
                EdgePages::Pressure => "pressure",
            },
            py_bool(self.expandable_segments),
        );
        let list: Vec<String> = self
            .roundup_power2_divisions
            .iter()
            .enumerate()
            .map(|(i, d)| format!("{}:{d}", 1u64 << i))
            .collect();
        s += &format!(",roundup_power2_divisions:[{}]", list.join(","));
        s += &format!(",release_idle_frac:{}", self.release_idle_frac);
        s += &format!(",release_idle_slack:{}", self.release_idle_slack);
        s += &format!(",thread_cache:{}", self.thread_cache);
        s += &format!(",slab_max_kb:{}", self.slab_max / 1024);
        if let Some(t) = self.garbage_collection_threshold {
            s += &format!(",garbage_collection_threshold:{t}");
        }
        match self.memory_cap {
            Some(MemoryCap::Bytes(b)) => s += &format!(",memory_cap:{b}"),
            Some(MemoryCap::Fraction(f)) => s += &format!(",per_process_memory_fraction:{f}"),
            None => {}
        }
        s
    }
}

/// Blocks each thread keeps in `default` (enough for a few tensors of a
/// step's repeating shapes; each is flushed back before the allocator grows).
pub const DEFAULT_THREAD_CACHE: u32 = 8;
/// Requests that `default` serves from slabs: none, since a slab per size
/// class and stream strands memory (`slab_max_kb:1024` for the speed; see
/// `docs/POLICY.md`, "Slabs", for what it costs and buys).
pub const DEFAULT_SLAB_MAX: u64 = 0;
/// Upper bound of `thread_cache`.
pub const MAX_THREAD_CACHE: u32 = 1024;

impl Default for Config {
    /// cachealloc's own policy (tuned on trace replays; see `docs/POLICY.md`).
    fn default() -> Self {
        Config {
            name: "default".into(),
            release_before_grow: true,
            release_order: ReleaseOrder::Largest,
            thread_cache: DEFAULT_THREAD_CACHE,
            huge_size: 256 * MIB,
            release_same_kind: false,
            release_min_idle: 0,
            release_idle_frac: 0.25,
            release_idle_slack: 0.1,
            slab_max: DEFAULT_SLAB_MAX,
            ..Self::pytorch()
        }
    }
}

fn py_bool(b: bool) -> &'static str {
    if b {
        "True"
    } else {
        "False"
    }
}

fn parse_bool(v: &str) -> Option<bool> {
    match v {
        "True" | "true" | "1" => Some(true),
        "False" | "false" | "0" => Some(false),
        _ => None,
    }
}

/// Parses a byte size: plain bytes, or a number with `KB`/`MB`/`GB`/`TB`
/// (powers of 1000) or `KiB`/`MiB`/`GiB`/`TiB` (powers of 1024); fractions allowed.
pub fn parse_size(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    if num.is_empty() {
        return Err(format!(
            "`{text}` is not a size (expected e.g. 16GiB, 512MB or 1048576)"
        ));
    }
    let mult: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kb" => 1e3,
        "m" | "mb" => 1e6,
        "g" | "gb" => 1e9,
        "t" | "tb" => 1e12,
        "kib" => 1024.0,
        "mib" => 1024.0 * 1024.0,
        "gib" => 1024.0 * 1024.0 * 1024.0,
        "tib" => 1024.0 * 1024.0 * 1024.0 * 1024.0,
        _ => {
            return Err(format!(
                "`{text}`: unknown unit `{}` (use B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)",
                unit.trim()
            ))
        }
    };
    if unit.is_empty() || unit.eq_ignore_ascii_case("b") {
        if let Ok(n) = num.parse::<u64>() {
            return Ok(n);
        }
    }
    let n: f64 = num
        .parse()
        .map_err(|_| format!("`{text}` is not a size (bad number `{num}`)"))?;
    let bytes = n * mult;
    if !bytes.is_finite() || bytes >= 1.8e19 {
        return Err(format!("`{text}` is too large"));
    }
    Ok(bytes.round() as u64)
}

/// `4` (every interval) or `[256:1,512:2,1024:4,>:8]` (interval starts in MiB).
fn parse_divisions(v: &str) -> Result<Power2Divisions, String> {
    let check = |d: u64| -> Result<u32, String> {
        if d == 0 || d == 1 || (d.is_power_of_two() && d <= 1 << 16) {
            Ok(d as u32)
        } else {
            Err(format!("{d} divisions: must be a power of two"))
        }
    };
    if let Some(list) = v.strip_prefix('[').and_then(|r| r.strip_suffix(']')) {
        let mut out = [0u32; POWER2_INTERVALS];
        let mut last_set: Option<usize> = None;
        for item in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let (k, d) = item
                .split_once(':')
                .ok_or_else(|| format!("`{item}` is not `size_mb:divisions`"))?;
            let d = check(
                d.trim()
                    .parse()
                    .map_err(|_| format!("`{d}` is not a number"))?,
            )?;
            if k.trim() == ">" {
                let from = last_set.map_or(0, |i| i + 1);
                out[from..].iter_mut().for_each(|x| *x = d);
                continue;
            }
            let mb: u64 = k
                .trim()
                .parse()
                .map_err(|_| format!("`{k}` is not a size in MiB"))?;
            if !mb.is_power_of_two() {
                return Err(format!("{mb} MiB: interval starts must be powers of two"));
            }
            let idx = (63 - mb.leading_zeros() as usize).min(POWER2_INTERVALS - 1);
            // PyTorch: a key sets its interval and every interval below not yet set.
            let from = last_set.map_or(0, |i| i + 1);
            for x in out.iter_mut().take(idx + 1).skip(from) {
                *x = d;
            }
            last_set = Some(idx);
        }
        Ok(out)
    } else {
        let d = check(
            v.parse()
                .map_err(|_| format!("`{v}` is not a number or a [size_mb:divisions,…] list"))?,
        )?;
        Ok([d; POWER2_INTERVALS])
    }
}

/// A configuration string that could not be used.
#[derive(Clone, PartialEq, Debug)]
pub enum ConfigError {
    /// A key we do not know.
    UnknownKey(String),
    /// A first item that is neither `key:value` nor a preset name.
    UnknownPreset(String),
    /// An item without `:`.
    Syntax(String),
    /// A known key with a value it cannot take.
    BadValue {
        /// The key.
        key: String,
        /// The value given.
        value: String,
        /// What is wrong with it.
        why: String,
    },
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConfigError::UnknownKey(k) => write!(
                f,
                "unknown configuration key `{k}` (known: max_split_size_mb, roundup_power2_divisions, garbage_collection_threshold, expandable_segments, per_process_memory_fraction, memory_cap, caching, release_before_grow, small_segment_mb, medium_segment_mb, large_threshold_mb, segment_round_mb, large_split_remainder_mb, huge_size_mb, huge_segment_divisions, release_order, oversize_ratio, release_min_idle, release_idle_frac, release_idle_slack, release_same_kind, idle_slack, idle_slack_hard, recycle_batch, expandable_page_mb, expandable_edges, thread_cache, slab_max_kb)"
            ),
            ConfigError::UnknownPreset(p) => {
                write!(f, "unknown configuration `{p}` (presets: {}; or key:value,…)", Config::PRESETS.join(", "))
            }
            ConfigError::Syntax(item) => write!(f, "configuration item `{item}` is not `key:value`"),
            ConfigError::BadValue { key, value, why } => write!(f, "bad value `{value}` for `{key}`: {why}"),
        }
    }
}

impl std::error::Error for ConfigError {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_and_keys() {
        let c =
            Config::parse("pytorch,max_split_size_mb:64,garbage_collection_threshold:0.6").unwrap();
        assert_eq!(c.name, "pytorch");
        assert_eq!(c.max_split_size, 64 * MIB);
        assert_eq!(c.garbage_collection_threshold, Some(0.6));
        assert_eq!(Config::parse("").unwrap(), Config::default());
        assert!(!Config::parse("no-caching").unwrap().caching);
        let c = Config::parse("per_process_memory_fraction:0.5").unwrap();
        assert_eq!(c.memory_cap, Some(MemoryCap::Fraction(0.5)));
        let c = Config::parse("memory_cap:16GiB").unwrap();
        assert_eq!(c.memory_cap, Some(MemoryCap::Bytes(16 << 30)));
    }

    #[test]
    fn errors_name_the_key() {
        let e = Config::parse("max_split_size_mb:abc").unwrap_err();
        assert!(e.to_string().contains("max_split_size_mb"), "{e}");
        let e = Config::parse("bogus_key:1").unwrap_err();
        assert_eq!(e, ConfigError::UnknownKey("bogus_key".into()));
        assert!(matches!(
            Config::parse("nonsense"),
            Err(ConfigError::UnknownPreset(_))
        ));
        assert!(matches!(
            Config::parse("default,nonsense"),
            Err(ConfigError::Syntax(_))
        ));
        assert!(Config::parse("max_split_size_mb:10").is_err());
        assert!(Config::parse("garbage_collection_threshold:1.5").is_err());
        assert!(Config::parse("expandable_segments:maybe").is_err());
        assert!(Config::parse("roundup_power2_divisions:3").is_err());
        assert!(Config::parse("max_split_size_mb:99999999999999999").is_err());
        assert!(Config::parse("small_segment_mb:0").is_err());
    }

    #[test]
    fn divisions() {
        let c = Config::parse("roundup_power2_divisions:4").unwrap();
        assert_eq!(c.roundup_power2_divisions, [4; POWER2_INTERVALS]);
        let c = Config::parse("roundup_power2_divisions:[1:1,2:2,4:4,>:8]").unwrap();
        assert_eq!(&c.roundup_power2_divisions[..4], &[1, 2, 4, 8]);
        assert_eq!(c.roundup_power2_divisions[15], 8);
    }

    #[test]
    fn conf_string_round_trips() {
        for c in [
            Config::default(),
            Config::pytorch(),
            Config::no_caching(),
            Config::parse("pytorch,max_split_size_mb:64,roundup_power2_divisions:[1:1,2:2,>:4],memory_cap:1GiB").unwrap(),
            Config::lowmem(),
            Config::parse("lowmem,huge_size_mb:unlimited,release_order:smallest_fit").unwrap(),
            Config::parse("default,release_order:all,garbage_collection_threshold:0.5,per_process_memory_fraction:0.5")
                .unwrap(),
        ] {
            assert_eq!(Config::parse(&c.to_conf_string()).unwrap(), c);
        }
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("16GiB"), Ok(16 << 30));
        assert_eq!(parse_size("512MB"), Ok(512_000_000));
        assert_eq!(parse_size("1048576"), Ok(1 << 20));
        assert_eq!(parse_size("1.5 GiB"), Ok(3 << 29));
        assert!(parse_size("").is_err());
        assert!(parse_size("12 parsecs").is_err());
        assert!(parse_size("GiB").is_err());
        assert!(parse_size("1e30").is_err());
        assert!(parse_size("99999999999TiB").is_err());
    }
}
