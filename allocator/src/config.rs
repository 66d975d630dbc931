//! Allocator policy and its `key:value,…` configuration string.
//!
//! The syntax is `PYTORCH_CUDA_ALLOC_CONF`'s; its keys are accepted where
//! they apply, plus our own policy keys. A string may start with the name of
//! a preset (`pytorch`, `default`, `no-caching`), which the keys then modify:
//! `pytorch,max_split_size_mb:64`.
//!
//! One static table, [`KEYS`], describes every key (its kind, its bounds,
//! whether it is stable, a line of documentation). Parsing, printing
//! ([`Config::to_conf_string`]), [`Config::set`] / [`Config::get`], the
//! checks of [`ConfigBuilder`], the error messages and the key table of
//! `docs/POLICY.md` ([`keys_markdown`]) are all driven by it, so they cannot
//! disagree. Every number a key accepts is bounded there, so that no accepted
//! value can overflow a size computation or divide by zero.

use crate::rounding::{Power2Divisions, POWER2_INTERVALS, SLAB_MAX};
use std::fmt;

mod builder;
pub mod keys;
pub use builder::ConfigBuilder;
pub use keys::*;

const MIB: u64 = 1 << 20;

/// Requests up to this size (rounded) go to the small pool (PyTorch's `kSmallSize`).
pub const SMALL_SIZE: u64 = MIB;
/// `expandable_page_divisor` of `default` and `expandable`: pages are at
/// most 1/128 of the peak allocated bytes. Larger divisors leave the
/// corpus's worst case where it is and only add map calls (docs/POLICY.md).
const DEFAULT_PAGE_DIVISOR: u64 = 128;
/// Segment size for large requests below `large_threshold` (PyTorch's `kLargeBuffer`).
pub const MEDIUM_SEGMENT: u64 = 20 * MIB;
/// A request ≥ `max_split_size` takes a cached block only if it is less than
/// this much larger: the default of `max_non_split_rounding_mb` (PyTorch's
/// `kLargeBuffer` slack).
pub const OVERSIZE_SLACK: u64 = 20 * MIB;
/// Expandable segments: idle pages stay mapped while reserved memory is at
/// most `1 + IDLE_SLACK` times the peak allocated bytes (tuned on the traces).
pub const IDLE_SLACK: f64 = 0.01;
/// Expandable segments: past `1 + IDLE_SLACK_HARD` times the peak, the
/// allocator waits for the device to recycle idle pages rather than grow.
pub const IDLE_SLACK_HARD: f64 = 0.02;
/// Expandable segments: a recycling round unmaps the pages needed now plus
/// this fraction of the peak allocated bytes.
pub const RECYCLE_BATCH: f64 = 0.05;
/// The largest size any size key accepts: 1 PiB, the largest request
/// ([`crate::MAX_REQUEST`]); sums and roundings of such sizes stay far from `u64::MAX`.
pub const MAX_SIZE: u64 = 1 << 50;

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

    /// Whether this cap is one a configuration string could set: a byte cap
    /// in `[1 MiB, 1 PiB]`, a fraction in `(0, 1]` (callers of
    /// `set_memory_cap` check this, so an unusable cap is refused there too).
    pub fn is_valid(self) -> bool {
        match self {
            MemoryCap::Bytes(b) => (MIN_MEMORY_CAP..=MAX_SIZE).contains(&b),
            MemoryCap::Fraction(f) => f > 0.0 && f <= 1.0,
        }
    }
}

/// The smallest byte cap accepted: below one small segment nothing could be allocated.
pub const MIN_MEMORY_CAP: u64 = 2 * MIB;

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
    /// within `idle_slack_hard`, at most 0.1, of the cap or of the device's capacity)
    /// granularity-sized pages only, so that no memory is lost to the
    /// partly used big pages at blocks' edges; where only the mapping at
    /// hand would reach that point, granules at its edges only.
    Pressure,
}

/// The words of a choice key and the values they stand for, in one table
/// that parsing, printing and the key table's word list all read.
macro_rules! choice_words {
    ($ty:ident, $words:ident: $($word:literal => $variant:ident),+ $(,)?) => {
        impl $ty {
            /// The configuration words, in the order the docs list them.
            pub const $words: &'static [&'static str] = &[$($word),+];

            /// The configuration word of this value.
            pub fn word(self) -> &'static str {
                match self {
                    $($ty::$variant => $word,)+
                }
            }

            /// The value of a word of [`Self::WORDS`], if it is one.
            pub fn from_word(word: &str) -> Option<Self> {
                match word {
                    $($word => Some($ty::$variant),)+
                    _ => None,
                }
            }
        }
    };
}

choice_words!(EdgePages, WORDS:
    "pressure" => Pressure,
    "small" => Small,
    "big" => Big,
);

/// How the allocator carves segments and blocks. See `docs/POLICY.md`.
///
/// A configuration comes from a preset ([`Config::default`],
/// [`Config::preset`] by name), a configuration string ([`Config::parse`]),
/// or [`Config::builder`] / [`Config::into_builder`]; [`Config::set`] and
/// [`Config::get`] change and read any key of [`crate::keys::KEYS`] by
/// name. Each way checks values with that table, so every `Config` holds
/// values a configuration string could set (the feature `testing` aside;
/// Note [Config's fields are the crate's]).
#[derive(Clone, PartialEq, Debug)]
#[non_exhaustive]
pub struct Config {
    /// Name of the preset this config started from (for reports).
    pub(crate) name: String,
    /// Cache freed blocks at all; `false` frees every block's segment at once.
    pub(crate) caching: bool,
    /// Size of small-pool segments.
    pub(crate) small_segment: u64,
    /// Large requests at or above this get a segment of their own size (rounded);
    /// below it, a segment of [`MEDIUM_SEGMENT`].
    pub(crate) large_threshold: u64,
    /// Granule that own-size large segments are rounded up to.
    pub(crate) segment_round: u64,
    /// Plain segments: requests at or above this size go to the huge pool,
    /// whose blocks only huge requests may take (`u64::MAX`: no huge pool).
    pub(crate) huge_size: u64,
    /// Large blocks are split only when the remainder is larger than this.
    pub(crate) large_split_remainder: u64,
    /// PyTorch's `max_split_size`: blocks this large are never split, and
    /// smaller requests never take them. `u64::MAX` means unlimited.
    pub(crate) max_split_size: u64,
    /// PyTorch's `max_non_split_rounding_size`: a request of at least
    /// `max_split_size` takes a cached block only if the block is less than
    /// this much larger ([`OVERSIZE_SLACK`] by default).
    pub(crate) max_non_split_rounding: u64,
    /// `roundup_power2_divisions` per interval.
    pub(crate) roundup_power2_divisions: Power2Divisions,
    /// Fraction of the cap above which unused cached segments are garbage-collected.
    pub(crate) garbage_collection_threshold: Option<f64>,
    /// Limit on reserved memory.
    pub(crate) memory_cap: Option<MemoryCap>,
    /// On a device out-of-memory, release cached segments (those that make
    /// room, then every entirely free one) and retry before failing (plain
    /// segments). Off for a CUDA graph's private pool: a
    /// captured graph still uses the pool's free blocks, so only the pool's
    /// owner may give them back.
    pub(crate) oom_flush: bool,
    /// Expandable segments: [`IDLE_SLACK`]; the key `expandable_slack` sets
    /// it, and `idle_slack_hard` to twice it.
    pub(crate) idle_slack: f64,
    /// Expandable segments: [`IDLE_SLACK_HARD`] (set with `idle_slack`
    /// through `expandable_slack`; a field of its own so that tests can vary it).
    pub(crate) idle_slack_hard: f64,
    /// Expandable segments: idle pages move to where they are needed once
    /// reserved memory passes `1 + idle_slack` times the peak allocated
    /// bytes (off: pages stay where they were mapped until `empty_cache`,
    /// as PyTorch's expandable segments).
    pub(crate) expandable_recycle: bool,
    /// Expandable segments: [`RECYCLE_BATCH`] (a field, with no key, so that
    /// tests can vary it).
    pub(crate) recycle_batch: f64,
    /// Expandable segments: while reserved memory grows back after an
    /// `empty_cache` that gave pages back, map pages of up to four times
    /// `expandable_page` (a field with no key; off in the `pytorch` preset,
    /// whose pages are PyTorch's).
    pub(crate) expandable_regrow_pages: bool,
    /// Expandable segments: page size of the large pools (a multiple of the
    /// device granularity; the small pool always uses the granularity).
    pub(crate) expandable_page: u64,
    /// Expandable segments: large-pool pages are at most the peak allocated
    /// bytes divided by this (halving `expandable_page` down to the device's
    /// granularity), so a small workload's pages stay small next to its
    /// blocks (0: always `expandable_page`).
    pub(crate) expandable_page_divisor: u64,
    /// Expandable segments: page size at the edges of a block, where a big
    /// page would lie only partly under it.
    pub(crate) expandable_edges: EdgePages,
    /// Expandable segments: a page moved away keeps its old mapping (a
    /// *shadow*, no unmap call) until that address needs another page; a
    /// block carved over a shadow whose page is idle takes the page back
    /// with no driver call.
    pub(crate) expandable_shadows: bool,
    /// Expandable segments: before an allocation fails, each page larger
    /// than the device's granularity that lies partly under live blocks
    /// gives back its free part: the live granules are copied to new
    /// granule-sized pages mapped at the same addresses, and the page goes
    /// back to the device (no tensor moves; the device is synchronized).
    pub(crate) expandable_reback: bool,
    /// Expandable segments: before an allocation fails (after
    /// `expandable_reback`), granules partly under live blocks whose live
    /// bytes lie at disjoint offsets share one page, mapped at each of their
    /// addresses, and the others go back (no tensor moves; the device is
    /// synchronized).
    pub(crate) expandable_share: bool,
    /// Expandable segments: past the hard limit, idle pages another stream
    /// freed and may still use are taken at once, the requesting stream made
    /// to wait for that stream's work on the device, not the host.
    pub(crate) expandable_cross_stream: bool,
    /// Expandable segments: a stream whose fit would need pages mapped takes
    /// another stream's free block over mapped pages instead (no page moves);
    /// its free then waits for the requesting stream's work, as after
    /// `record_stream`. With `expandable_cross_stream`, a block that stream
    /// may still use is taken too, the requesting stream waiting for that
    /// stream's work on the device.
    pub(crate) expandable_borrow: bool,
    /// Plain segments: before a new segment is created, take a free block
    /// inside another stream's partly used segment (the requesting stream
    /// waits on the device for that stream's queued work unless it is
    /// done; the block's free waits for the requesting stream's work, as
    /// after `record_stream`).
    pub(crate) borrow_holes: bool,
    /// Plain segments: the last rung before an allocation fails (after the
    /// flush): a free block in the requesting stream's segments of another
    /// kind (a small request in a large or huge segment, a large one in a
    /// huge segment).
    pub(crate) oom_other_kinds: bool,
    /// Page-backed growable segments (CUDA virtual memory API).
    pub(crate) expandable_segments: bool,
    /// Freed blocks each thread keeps for its own next request of the same
    /// rounded size and stream, served without the allocator's lock (0: off;
    /// ignored with expandable segments or without caching). See `docs/POLICY.md`.
    pub(crate) thread_cache: u32,
    /// Small requests up to this many bytes (rounded) take a chunk of their
    /// size class from a small-pool segment that holds only that class (a
    /// slab): no best-fit search, no split, no merge (0: off; at most
    /// [`SLAB_MAX`]; ignored with expandable segments or without caching).
    /// See `docs/POLICY.md`, "Slabs".
    pub(crate) slab_max: u64,
}

impl Config {
    /// PyTorch's default `CUDACachingAllocator` policy, exactly.
    pub fn pytorch() -> Self {
        Config {
            name: "pytorch".into(),
            caching: true,
            small_segment: 2 * MIB,
            large_threshold: 10 * MIB,
            segment_round: 2 * MIB,
            large_split_remainder: MIB,
            huge_size: u64::MAX,
            thread_cache: 0,
            slab_max: 0,
            max_split_size: u64::MAX,
            max_non_split_rounding: OVERSIZE_SLACK,
            roundup_power2_divisions: [0; POWER2_INTERVALS],
            garbage_collection_threshold: None,
            memory_cap: None,
            oom_flush: true,
            idle_slack: IDLE_SLACK,
            idle_slack_hard: IDLE_SLACK_HARD,
            recycle_batch: RECYCLE_BATCH,
            expandable_recycle: false,
            // PyTorch's expandable segments map 20 MiB pages in the large
            // pools (`kLargeBuffer`), each whole wherever a block reaches
            // into it.
            expandable_page: 20 * MIB,
            expandable_regrow_pages: false,
            expandable_page_divisor: 0,
            expandable_edges: EdgePages::Big,
            expandable_shadows: false,
            expandable_reback: false,
            expandable_share: false,
            expandable_cross_stream: false,
            expandable_borrow: false,
            borrow_holes: false,
            oom_other_kinds: false,
            expandable_segments: false,
        }
    }

    /// Plain segments (`cuMemAlloc`), never given back in steady state.
    ///
    /// Note [Plain segments never wait in steady state]: `cuMemFree` waits
    /// for the whole device, so a policy that gives segments back to save
    /// memory costs step time. This one gives them back only on
    /// `empty_cache()`, in the out-of-memory flush, under a memory cap or
    /// fraction, and past `garbage_collection_threshold` (PyTorch's
    /// meaning). Its placement is PyTorch's, so that it never holds more
    /// than PyTorch's allocator; before out of memory it also takes free
    /// blocks in segments of another kind (`oom_other_kinds`). The placement
    /// rules that once went with it (a huge pool, medium segments scaled to
    /// the workload, thread caches) held more than PyTorch's policy on some
    /// traces without their release rules, so they are opt-in keys.
    ///
    /// Note [How default chooses]: `default` is this policy with
    /// `expandable_segments:True`. Where the device lacks the virtual
    /// memory API (probed when the allocator starts), the allocator falls
    /// back to these plain segments and says so once in its notices; so
    /// `default,expandable_segments:False` and `segments` are the same policy.
    pub fn segments() -> Self {
        Config {
            name: "segments".into(),
            // Free space stranded in segments of another kind, before out
            // of memory only.
            oom_other_kinds: true,
            // Expandable segments (with `expandable_segments:True`): pages of
            // at most 8 MiB and 1/128 of the peak allocated bytes, big at
            // blocks' edges while there is room; idle pages move where they
            // are needed and keep their old mappings as shadows; a stream
            // short of pages borrows another's free block over mapped pages;
            // before out of memory, partly used pages give back their free
            // part and then share pages.
            expandable_page: 8 * MIB,
            expandable_regrow_pages: true,
            expandable_page_divisor: DEFAULT_PAGE_DIVISOR,
            expandable_edges: EdgePages::Pressure,
            recycle_batch: 0.0,
            expandable_recycle: true,
            expandable_shadows: true,
            expandable_cross_stream: true,
            expandable_borrow: true,
            expandable_reback: true,
            expandable_share: true,
            ..Self::pytorch()
        }
    }

    /// `default` under its older name: expandable segments, asked for by
    /// name (falls back to plain segments, with a notice, where the device
    /// lacks the virtual memory API).
    pub fn expandable() -> Self {
        Config {
            name: "expandable".into(),
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
        &["default", "segments", "pytorch", "expandable", "no-caching"];

    /// A preset by name.
    pub fn preset(name: &str) -> Option<Self> {
        match name {
            "default" => Some(Self::default()),
            "segments" => Some(Self::segments()),
            "pytorch" => Some(Self::pytorch()),
            "expandable" => Some(Self::expandable()),
            "no-caching" | "no_caching" | "none" => Some(Self::no_caching()),
            _ => None,
        }
    }

    /// Parses a configuration string (see the module docs). A string of
    /// only blanks is the default; an empty item (`a:1,,b:2`, a trailing
    /// comma) and a key given twice are errors, not silently skipped or
    /// overridden.
    pub fn parse(conf: &str) -> Result<Self, ConfigError> {
        Self::parse_keys(conf).map(|(config, _)| config)
    }

    /// [`Config::parse`], also returning the key group of every key the
    /// string sets (its name, or the group's name when several keys set one
    /// field, as `memory_cap` and `per_process_memory_fraction` do): what
    /// [`crate::pytorch_conf`] leaves alone.
    pub fn parse_keys(conf: &str) -> Result<(Self, Vec<&'static str>), ConfigError> {
        if conf.trim().is_empty() {
            return Ok((Self::default(), Vec::new()));
        }
        let items: Vec<&str> = conf.split(',').map(str::trim).collect();
        let mut config = Self::default();
        let mut i = 0;
        if !items[0].contains(':') && !items[0].is_empty() {
            config = Self::preset(items[0])
                .ok_or_else(|| ConfigError::UnknownPreset(items[0].to_string()))?;
            i = 1;
        }
        let mut seen: Vec<&'static Key> = Vec::new();
        while i < items.len() {
            let mut item = items[i].to_string();
            if item.is_empty() {
                return Err(ConfigError::Syntax(String::new()));
            }
            // A `[…]` list value contains commas: glue its pieces back together.
            if item.contains('[') {
                while !item.contains(']') && i + 1 < items.len() {
                    i += 1;
                    item.push(',');
                    item.push_str(items[i]);
                }
            }
            let key = config.apply(&item)?;
            if let Some(earlier) = seen.iter().find(|k| k.group() == key.group()) {
                return Err(ConfigError::Duplicate {
                    key: key.name.to_string(),
                    earlier: earlier.name.to_string(),
                });
            }
            seen.push(key);
            i += 1;
        }
        config.validate()?;
        Ok((config, seen.iter().map(|k| k.group()).collect()))
    }

    /// Applies one `key:value` item; returns the key's table entry.
    fn apply(&mut self, item: &str) -> Result<&'static Key, ConfigError> {
        let (name, value) = item
            .split_once(':')
            .ok_or_else(|| ConfigError::Syntax(item.to_string()))?;
        self.apply_pair(name.trim(), value.trim())
    }

    /// Applies one key's value, written as in a configuration string;
    /// returns the key's table entry. The keys' limits between each other
    /// are left to [`Config::validate`].
    fn apply_pair(&mut self, name: &str, value: &str) -> Result<&'static Key, ConfigError> {
        let key = find_key(name).ok_or_else(|| ConfigError::UnknownKey(name.to_string()))?;
        let v = key.kind.parse(value).map_err(|why| ConfigError::BadValue {
            key: name.to_string(),
            value: value.to_string(),
            why,
        })?;
        (key.set)(self, v);
        Ok(key)
    }

    /// Checks what the table's per-key bounds cannot: limits between keys.
    fn validate(&self) -> Result<(), ConfigError> {
        let slab_limit = SMALL_SIZE.min(self.small_segment / 2);
        if self.slab_max > slab_limit {
            return Err(ConfigError::BadValue {
                key: "slab_max_kb".into(),
                value: (self.slab_max / 1024).to_string(),
                why: format!(
                    "slabs are small-pool segments holding at least two chunks: at most {} KiB \
                     with small_segment_mb:{} (set slab_max_kb lower, or 0 for no slabs)",
                    slab_limit / 1024,
                    self.small_segment / MIB
                ),
            });
        }
        Ok(())
    }

    /// The configuration as a `key:value,…` string that [`Config::parse`]
    /// reads back to an equal configuration: the preset's name, then every
    /// key of [`KEYS`] that has a value (unset optional keys are left out).
    pub fn to_conf_string(&self) -> String {
        let mut s = self.name.clone();
        for key in KEYS {
            if let Some(v) = (key.get)(self) {
                s.push(',');
                s.push_str(key.name);
                s.push(':');
                s.push_str(&key.kind.format(&v));
            }
        }
        s
    }
}

/// `config` (read from `CACHEALLOC_CONF`, whose text is `own`) with
/// PyTorch's own configuration string `pytorch` (`PYTORCH_ALLOC_CONF` /
/// `PYTORCH_CUDA_ALLOC_CONF`) applied where `CACHEALLOC_CONF` does not set
/// the same key: see [`crate::pytorch_conf`]. A user who turned PyTorch's
/// expandable segments off (`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False`)
/// gets the `segments` policy from `default`. An invalid PyTorch setting is
/// refused with PyTorch's message.
pub fn with_pytorch_conf(
    config: Config,
    own: Option<&str>,
    pytorch: Option<&str>,
) -> Result<Config, crate::pytorch_conf::PytorchConfError> {
    let Some(pytorch) = pytorch else {
        return Ok(config);
    };
    let torch = crate::pytorch_conf::PytorchConf::parse(pytorch)?;
    // (`own` was parsed already, so it parses again.)
    let groups = own
        .and_then(|o| Config::parse_keys(o).ok())
        .map(|(_, g)| g)
        .unwrap_or_default();
    Ok(torch.apply(config, &groups))
}

/// Upper bound of `thread_cache`.
pub const MAX_THREAD_CACHE: u32 = 1024;

impl Default for Config {
    /// cachealloc's default: expandable segments where the device has the
    /// virtual memory API, and the [`Config::segments`] policy where it does
    /// not (see "Note [How default chooses]" in [`Config::segments`]).
    fn default() -> Self {
        Config {
            name: "default".into(),
            expandable_segments: true,
            ..Self::segments()
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

/// One interval's divisions: 0, 1 or a power of two up to 65536.
fn check_division(d: u64) -> Result<u32, String> {
    if d == 0 || d == 1 || (d.is_power_of_two() && d <= 1 << 16) {
        Ok(d as u32)
    } else {
        Err(format!("{d} divisions: must be a power of two"))
    }
}

/// `4` (every interval) or `[256:1,512:2,1024:4,>:8]` (interval starts in MiB).
fn parse_divisions(v: &str) -> Result<Power2Divisions, String> {
    let check = check_division;
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
    /// An item without `:` (empty: an empty item, as in `a:1,,b:2`).
    Syntax(String),
    /// A key given twice (or two keys that set the same thing).
    Duplicate {
        /// The key given last.
        key: String,
        /// The key (or group of keys) given before.
        earlier: String,
    },
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
            ConfigError::UnknownKey(k) => {
                let known: Vec<&str> = KEYS.iter().map(|k| k.name).collect();
                write!(
                    f,
                    "unknown configuration key `{k}` (known: {})",
                    known.join(", ")
                )
            }
            ConfigError::UnknownPreset(p) => {
                write!(
                    f,
                    "unknown configuration `{p}` (presets: {}; or key:value,…)",
                    Config::PRESETS.join(", ")
                )
            }
            ConfigError::Syntax(item) if item.is_empty() => {
                write!(
                    f,
                    "empty configuration item (two commas in a row, or a comma at an end)"
                )
            }
            ConfigError::Syntax(item) => {
                write!(f, "configuration item `{item}` is not `key:value`")
            }
            ConfigError::Duplicate { key, earlier } if key == earlier => {
                write!(f, "configuration key `{key}` is given twice")
            }
            ConfigError::Duplicate { key, earlier } => {
                write!(
                    f,
                    "configuration keys `{earlier}` and `{key}` set the same thing; give one"
                )
            }
            ConfigError::BadValue { key, value, why } => {
                write!(f, "bad value `{value}` for `{key}`: {why}")
            }
        }
    }
}

impl std::error::Error for ConfigError {}

#[cfg(test)]
mod tests;
