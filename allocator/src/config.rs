//! Allocator policy and its `key:value,…` configuration string.
//!
//! The syntax is `PYTORCH_CUDA_ALLOC_CONF`'s; its keys are accepted where
//! they apply, plus our own policy keys. A string may start with the name of
//! a preset (`pytorch`, `default`, `no-caching`), which the keys then modify:
//! `pytorch,max_split_size_mb:64`.
//!
//! One static table, [`KEYS`], describes every key (its kind, its bounds,
//! whether it is stable, a line of documentation). Parsing, printing
//! ([`Config::to_conf_string`]), the error messages and the key table of
//! `docs/POLICY.md` ([`keys_markdown`]) are all driven by it, so they cannot
//! disagree. Every number a key accepts is bounded there, so that no accepted
//! value can overflow a size computation or divide by zero.

use crate::rounding::{Power2Divisions, POWER2_INTERVALS, SLAB_MAX};
use std::fmt;

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
#[derive(Clone, PartialEq, Debug)]
pub struct Config {
    /// Name of the preset this config started from (for reports).
    pub name: String,
    /// Cache freed blocks at all; `false` frees every block's segment at once.
    pub caching: bool,
    /// Size of small-pool segments.
    pub small_segment: u64,
    /// Large requests at or above this get a segment of their own size (rounded);
    /// below it, a segment of [`MEDIUM_SEGMENT`].
    pub large_threshold: u64,
    /// Granule that own-size large segments are rounded up to.
    pub segment_round: u64,
    /// Plain segments: requests at or above this size go to the huge pool,
    /// whose blocks only huge requests may take (`u64::MAX`: no huge pool).
    pub huge_size: u64,
    /// Large blocks are split only when the remainder is larger than this.
    pub large_split_remainder: u64,
    /// PyTorch's `max_split_size`: blocks this large are never split, and
    /// smaller requests never take them. `u64::MAX` means unlimited.
    pub max_split_size: u64,
    /// PyTorch's `max_non_split_rounding_size`: a request of at least
    /// `max_split_size` takes a cached block only if the block is less than
    /// this much larger ([`OVERSIZE_SLACK`] by default).
    pub max_non_split_rounding: u64,
    /// `roundup_power2_divisions` per interval.
    pub roundup_power2_divisions: Power2Divisions,
    /// Fraction of the cap above which unused cached segments are garbage-collected.
    pub garbage_collection_threshold: Option<f64>,
    /// Limit on reserved memory.
    pub memory_cap: Option<MemoryCap>,
    /// On a device out-of-memory, release cached segments (those that make
    /// room, then every entirely free one) and retry before failing (plain
    /// segments). Off for a CUDA graph's private pool: a
    /// captured graph still uses the pool's free blocks, so only the pool's
    /// owner may give them back.
    pub oom_flush: bool,
    /// Expandable segments: [`IDLE_SLACK`]; the key `expandable_slack` sets
    /// it, and `idle_slack_hard` to twice it.
    pub idle_slack: f64,
    /// Expandable segments: [`IDLE_SLACK_HARD`] (set with `idle_slack`
    /// through `expandable_slack`; a field of its own so that tests can vary it).
    pub idle_slack_hard: f64,
    /// Expandable segments: idle pages move to where they are needed once
    /// reserved memory passes `1 + idle_slack` times the peak allocated
    /// bytes (off: pages stay where they were mapped until `empty_cache`,
    /// as PyTorch's expandable segments).
    pub expandable_recycle: bool,
    /// Expandable segments: [`RECYCLE_BATCH`] (a field, with no key, so that
    /// tests can vary it).
    pub recycle_batch: f64,
    /// Expandable segments: while reserved memory grows back after an
    /// `empty_cache` that gave pages back, map pages of up to four times
    /// `expandable_page` (a field with no key; off in the `pytorch` preset,
    /// whose pages are PyTorch's).
    pub expandable_regrow_pages: bool,
    /// Expandable segments: page size of the large pools (a multiple of the
    /// device granularity; the small pool always uses the granularity).
    pub expandable_page: u64,
    /// Expandable segments: large-pool pages are at most the peak allocated
    /// bytes divided by this (halving `expandable_page` down to the device's
    /// granularity), so a small workload's pages stay small next to its
    /// blocks (0: always `expandable_page`).
    pub expandable_page_divisor: u64,
    /// Expandable segments: page size at the edges of a block, where a big
    /// page would lie only partly under it.
    pub expandable_edges: EdgePages,
    /// Expandable segments: a page moved away keeps its old mapping (a
    /// *shadow*, no unmap call) until that address needs another page; a
    /// block carved over a shadow whose page is idle takes the page back
    /// with no driver call.
    pub expandable_shadows: bool,
    /// Expandable segments: before an allocation fails, each page larger
    /// than the device's granularity that lies partly under live blocks
    /// gives back its free part: the live granules are copied to new
    /// granule-sized pages mapped at the same addresses, and the page goes
    /// back to the device (no tensor moves; the device is synchronized).
    pub expandable_reback: bool,
    /// Expandable segments: before an allocation fails (after
    /// `expandable_reback`), granules partly under live blocks whose live
    /// bytes lie at disjoint offsets share one page, mapped at each of their
    /// addresses, and the others go back (no tensor moves; the device is
    /// synchronized).
    pub expandable_share: bool,
    /// Expandable segments: past the hard limit, idle pages another stream
    /// freed and may still use are taken at once, the requesting stream made
    /// to wait for that stream's work on the device, not the host.
    pub expandable_cross_stream: bool,
    /// Expandable segments: a stream whose fit would need pages mapped takes
    /// another stream's free block over mapped pages instead (no page moves);
    /// its free then waits for the requesting stream's work, as after
    /// `record_stream`. With `expandable_cross_stream`, a block that stream
    /// may still use is taken too, the requesting stream waiting for that
    /// stream's work on the device.
    pub expandable_borrow: bool,
    /// Plain segments: before a new segment is created, take a free block
    /// inside another stream's partly used segment (the requesting stream
    /// waits on the device for that stream's queued work unless it is
    /// done; the block's free waits for the requesting stream's work, as
    /// after `record_stream`).
    pub borrow_holes: bool,
    /// Plain segments: the last rung before an allocation fails (after the
    /// flush): a free block in the requesting stream's segments of another
    /// kind (a small request in a large or huge segment, a large one in a
    /// huge segment).
    pub oom_other_kinds: bool,
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
        let (name, value) = (name.trim(), value.trim());
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

/// Whether a key is part of the stable interface.
#[derive(Copy, Clone, PartialEq, Eq, Debug)]
pub enum Stability {
    /// Supported; kept across releases.
    Stable,
    /// A policy under study; may change or go.
    Experimental,
    /// PyTorch's key, accepted so that `PYTORCH_CUDA_ALLOC_CONF` strings
    /// parse, with no effect here.
    Ignored,
}

/// How a key's value is written and what it may be. Every number is bounded.
#[derive(Copy, Clone, Debug)]
pub enum KeyKind {
    /// `True` or `False` (also `true`/`false`/`1`/`0`).
    Bool,
    /// A whole number in `[min, max]`; with `pow2`, 0, 1 or a power of two.
    Count {
        /// Least value.
        min: u64,
        /// Greatest value.
        max: u64,
        /// Only 0, 1 and powers of two.
        pow2: bool,
    },
    /// A whole number of `unit` bytes in `[min, max]` units; `unlimited`
    /// (stored as `u64::MAX`) where allowed.
    Bytes {
        /// Bytes per unit (1 MiB, 1 KiB).
        unit: u64,
        /// The unit's name in messages.
        unit_name: &'static str,
        /// Least value, in units.
        min: u64,
        /// Greatest value, in units.
        max: u64,
        /// Whether `unlimited` is accepted.
        unlimited: bool,
    },
    /// A byte size with an optional unit (`16GiB`, `512MB`, `1048576`), in `[min, max]` bytes.
    Size {
        /// Least value in bytes.
        min: u64,
        /// Greatest value in bytes.
        max: u64,
    },
    /// A number above `min` (or equal, with `min_included`) and at most
    /// `max` (or below, without `max_included`).
    Number {
        /// Lower bound.
        min: f64,
        /// Whether `min` itself is accepted.
        min_included: bool,
        /// Upper bound.
        max: f64,
        /// Whether `max` itself is accepted.
        max_included: bool,
    },
    /// One of these words.
    Choice(&'static [&'static str]),
    /// `N` (every interval) or `[size_mb:N,…,>:N]`, each N 0, 1 or a power of two ≤ 65536.
    Divisions,
}

/// A parsed value, before it is stored in a [`Config`].
#[derive(Clone, PartialEq, Debug)]
pub enum Value {
    /// Of [`KeyKind::Bool`].
    Bool(bool),
    /// Of [`KeyKind::Count`], [`KeyKind::Bytes`] (in bytes) and [`KeyKind::Size`].
    U64(u64),
    /// Of [`KeyKind::Number`].
    F64(f64),
    /// Of [`KeyKind::Choice`].
    Word(&'static str),
    /// Of [`KeyKind::Divisions`].
    Divisions(Power2Divisions),
}

impl KeyKind {
    /// Reads `text` as a value of this kind, within its bounds; the error says why not.
    pub fn parse(&self, text: &str) -> Result<Value, String> {
        match *self {
            KeyKind::Bool => parse_bool(text)
                .map(Value::Bool)
                .ok_or_else(|| "expected True or False".into()),
            KeyKind::Count { min, max, pow2 } => {
                let n: u64 = text
                    .parse()
                    .map_err(|_| format!("expected a whole number from {min} to {max}"))?;
                if !(min..=max).contains(&n) {
                    return Err(format!("must be from {min} to {max}"));
                }
                if pow2 && n > 1 && !n.is_power_of_two() {
                    return Err("must be 0, 1 or a power of two".into());
                }
                Ok(Value::U64(n))
            }
            KeyKind::Bytes {
                unit,
                unit_name,
                min,
                max,
                unlimited,
            } => {
                if unlimited && text == "unlimited" {
                    return Ok(Value::U64(u64::MAX));
                }
                let or_unlimited = if unlimited { " or unlimited" } else { "" };
                let n: u64 = text.parse().map_err(|_| {
                    format!(
                        "expected a whole number of {unit_name} from {min} to {max}{or_unlimited}"
                    )
                })?;
                if !(min..=max).contains(&n) {
                    return Err(format!(
                        "must be from {min} to {max} {unit_name}{or_unlimited}"
                    ));
                }
                Ok(Value::U64(n * unit))
            }
            KeyKind::Size { min, max } => {
                let b = parse_size(text)?;
                if !(min..=max).contains(&b) {
                    return Err(format!(
                        "must be from {} to {}",
                        crate::human_bytes(min),
                        crate::human_bytes(max)
                    ));
                }
                Ok(Value::U64(b))
            }
            KeyKind::Number { .. } => {
                let f: f64 = text.parse().map_err(|_| "expected a number".to_string())?;
                if !self.number_in_range(f) {
                    return Err(format!("must be in {}", self.range_text()));
                }
                Ok(Value::F64(f))
            }
            KeyKind::Choice(words) => words
                .iter()
                .find(|&&w| w == text)
                .map(|&w| Value::Word(w))
                .ok_or_else(|| format!("expected {}", words.join(", "))),
            KeyKind::Divisions => parse_divisions(text).map(Value::Divisions),
        }
    }

    fn number_in_range(&self, f: f64) -> bool {
        match *self {
            KeyKind::Number {
                min,
                min_included,
                max,
                max_included,
            } => (f > min || (min_included && f == min)) && (f < max || (max_included && f == max)),
            _ => false,
        }
    }

    /// Writes `v` the way [`KeyKind::parse`] reads it.
    pub fn format(&self, v: &Value) -> String {
        match (self, v) {
            (KeyKind::Bytes { .. }, Value::U64(u64::MAX)) => "unlimited".into(),
            (KeyKind::Bytes { unit, .. }, Value::U64(b)) => (b / unit).to_string(),
            (_, Value::U64(n)) => n.to_string(),
            (_, Value::Bool(b)) => py_bool(*b).into(),
            (_, Value::F64(f)) => f.to_string(),
            (_, Value::Word(w)) => (*w).into(),
            (_, Value::Divisions(d)) => {
                let list: Vec<String> = d
                    .iter()
                    .enumerate()
                    .map(|(i, d)| format!("{}:{d}", 1u64 << i))
                    .collect();
                format!("[{}]", list.join(","))
            }
        }
    }

    /// The values this kind accepts, for the docs.
    pub fn range_text(&self) -> String {
        match *self {
            KeyKind::Bool => "True, False".into(),
            KeyKind::Count { min, max, pow2 } if pow2 => {
                format!("0, 1 or a power of two up to {max} (from {min})")
            }
            KeyKind::Count { min, max, .. } => format!("{min} to {max}"),
            KeyKind::Bytes {
                unit_name,
                min,
                max,
                unlimited,
                ..
            } => format!(
                "{min} to {max} {unit_name}{}",
                if unlimited { ", unlimited" } else { "" }
            ),
            KeyKind::Size { min, max } => format!(
                "{} to {} (`16GiB`, `512MB`, bytes)",
                crate::human_bytes(min),
                crate::human_bytes(max)
            ),
            KeyKind::Number {
                min,
                min_included,
                max,
                max_included,
            } => format!(
                "{}{min}, {max}{}",
                if min_included { "[" } else { "(" },
                if max_included { "]" } else { ")" }
            ),
            KeyKind::Choice(words) => words.join(", "),
            KeyKind::Divisions => "`4` or `[256:1,512:2,>:4]` (MiB interval starts; 0, 1 or powers of two up to 65536)".into(),
        }
    }
}

/// One configuration key (modelled on mimalloc's options table).
pub struct Key {
    /// The key's name.
    pub name: &'static str,
    /// Other names for the same key.
    pub aliases: &'static [&'static str],
    /// Its value's kind and bounds.
    pub kind: KeyKind,
    /// Whether it is stable.
    pub stability: Stability,
    /// One line for the docs.
    pub doc: &'static str,
    /// Keys setting the same field (`memory_cap`, `per_process_memory_fraction`)
    /// share a group: two of them in one string is a duplicate.
    group: Option<&'static str>,
    /// The value to print (`None`: leave the key out).
    get: fn(&Config) -> Option<Value>,
    /// Stores a value [`KeyKind::parse`] accepted.
    set: fn(&mut Config, Value),
}

impl Key {
    /// The key's group: its name, or the name of the field several keys set.
    pub fn group(&self) -> &'static str {
        self.group.unwrap_or(self.name)
    }
}

impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Key")
            .field("name", &self.name)
            .field("kind", &self.kind)
            .finish()
    }
}

fn u(v: Value) -> u64 {
    match v {
        Value::U64(n) => n,
        _ => unreachable!("the kind parses to a whole number"),
    }
}
fn w(v: Value) -> &'static str {
    match v {
        Value::Word(x) => x,
        _ => unreachable!("the kind parses to a word"),
    }
}
fn b(v: Value) -> bool {
    matches!(v, Value::Bool(true))
}
fn f(v: Value) -> f64 {
    match v {
        Value::F64(x) => x,
        _ => unreachable!("the kind parses to a number"),
    }
}

const fn mib(min: u64, max: u64, unlimited: bool) -> KeyKind {
    KeyKind::Bytes {
        unit: MIB,
        unit_name: "MiB",
        min,
        max,
        unlimited,
    }
}
/// A non-negative multiple of a quantity (such as the peak allocated bytes), up to 100.
const SHARE: KeyKind = KeyKind::Number {
    min: 0.0,
    min_included: true,
    max: 100.0,
    max_included: true,
};
const BOOL: KeyKind = KeyKind::Bool;
/// A divisor of the peak (0: the rule is off).
const DIVISOR: KeyKind = KeyKind::Count {
    min: 0,
    max: 65536,
    pow2: false,
};
/// `MAX_SIZE` in MiB.
const MAX_MIB: u64 = MAX_SIZE / MIB;

/// Every configuration key. Parsing, [`Config::to_conf_string`], the error
/// messages and [`keys_markdown`] all read this table.
pub static KEYS: &[Key] = &[
    Key {
        name: "max_split_size_mb",
        aliases: &[],
        kind: mib(20, MAX_MIB, true),
        stability: Stability::Stable,
        doc: "PyTorch's: blocks this large are not split; smaller requests don't take them",
        group: None,
        get: |c| Some(Value::U64(c.max_split_size)),
        set: |c, v| c.max_split_size = u(v),
    },
    Key {
        name: "max_non_split_rounding_mb",
        aliases: &[],
        kind: mib(20, MAX_MIB, false),
        stability: Stability::Stable,
        doc: "PyTorch's: a request of at least max_split_size takes a cached block only if the block is less than this much larger",
        group: None,
        get: |c| Some(Value::U64(c.max_non_split_rounding)),
        set: |c, v| c.max_non_split_rounding = u(v),
    },
    Key {
        name: "roundup_power2_divisions",
        aliases: &[],
        kind: KeyKind::Divisions,
        stability: Stability::Stable,
        doc: "PyTorch's: round requests up to 1/N of their power-of-two interval",
        group: None,
        get: |c| Some(Value::Divisions(c.roundup_power2_divisions)),
        set: |c, v| {
            if let Value::Divisions(d) = v {
                c.roundup_power2_divisions = d
            }
        },
    },
    Key {
        name: "garbage_collection_threshold",
        aliases: &[],
        kind: KeyKind::Number {
            min: 0.0,
            min_included: false,
            max: 1.0,
            max_included: false,
        },
        stability: Stability::Stable,
        doc: "PyTorch's: with a cap, free old unsplit cached blocks above this fraction of it (unset: off)",
        group: None,
        get: |c| c.garbage_collection_threshold.map(Value::F64),
        set: |c, v| c.garbage_collection_threshold = Some(f(v)),
    },
    Key {
        name: "expandable_segments",
        aliases: &[],
        kind: BOOL,
        stability: Stability::Stable,
        doc: "page-backed segments (falls back with a notice without the virtual memory API)",
        group: None,
        get: |c| Some(Value::Bool(c.expandable_segments)),
        set: |c, v| c.expandable_segments = b(v),
    },
    Key {
        name: "per_process_memory_fraction",
        aliases: &["memory_fraction"],
        kind: KeyKind::Number {
            min: 0.0,
            min_included: false,
            max: 1.0,
            max_included: true,
        },
        stability: Stability::Stable,
        doc: "cap on reserved memory as a fraction of the device's memory (unset: no cap)",
        group: Some("memory_cap"),
        get: |c| match c.memory_cap {
            Some(MemoryCap::Fraction(f)) => Some(Value::F64(f)),
            _ => None,
        },
        set: |c, v| c.memory_cap = Some(MemoryCap::Fraction(f(v))),
    },
    Key {
        name: "memory_cap",
        aliases: &[],
        kind: KeyKind::Size {
            min: MIN_MEMORY_CAP,
            max: MAX_SIZE,
        },
        stability: Stability::Stable,
        doc: "cap on reserved memory in bytes (unset: no cap)",
        group: Some("memory_cap"),
        get: |c| match c.memory_cap {
            Some(MemoryCap::Bytes(b)) => Some(Value::U64(b)),
            _ => None,
        },
        set: |c, v| c.memory_cap = Some(MemoryCap::Bytes(u(v))),
    },
    Key {
        name: "caching",
        aliases: &[],
        kind: BOOL,
        stability: Stability::Stable,
        doc: "False frees every block's segment at once",
        group: None,
        get: |c| Some(Value::Bool(c.caching)),
        set: |c, v| c.caching = b(v),
    },
    Key {
        name: "small_segment_mb",
        aliases: &[],
        kind: mib(1, 1024, false),
        stability: Stability::Stable,
        doc: "size of small-pool segments (requests up to 1 MiB)",
        group: None,
        get: |c| Some(Value::U64(c.small_segment)),
        set: |c, v| c.small_segment = u(v),
    },
    Key {
        name: "large_threshold_mb",
        aliases: &[],
        kind: mib(1, MEDIUM_SEGMENT / MIB, false),
        stability: Stability::Stable,
        doc: "large requests below this share 20 MiB segments; from it on, each gets a segment of its own size",
        group: None,
        get: |c| Some(Value::U64(c.large_threshold)),
        set: |c, v| c.large_threshold = u(v),
    },
    Key {
        name: "segment_round_mb",
        aliases: &[],
        kind: mib(1, 1024, false),
        stability: Stability::Stable,
        doc: "own-size large segments are rounded up to a multiple of this",
        group: None,
        get: |c| Some(Value::U64(c.segment_round)),
        set: |c, v| c.segment_round = u(v),
    },
    Key {
        name: "large_split_remainder_mb",
        aliases: &[],
        kind: mib(0, 1024, false),
        stability: Stability::Stable,
        doc: "a large block is split only when more than this would remain",
        group: None,
        get: |c| Some(Value::U64(c.large_split_remainder)),
        set: |c, v| c.large_split_remainder = u(v),
    },
    Key {
        name: "huge_size_mb",
        aliases: &[],
        kind: mib(1, MAX_MIB, true),
        stability: Stability::Stable,
        doc: "plain segments: requests this large go to the huge pool, whose blocks only huge requests take",
        group: None,
        get: |c| Some(Value::U64(c.huge_size)),
        set: |c, v| c.huge_size = u(v),
    },
    Key {
        name: "oom_flush",
        aliases: &[],
        kind: BOOL,
        stability: Stability::Experimental,
        doc: "plain segments: on out of memory, release cached segments and retry (off: only empty_cache gives segments back; what CUDA graph pools need)",
        group: None,
        get: |c| Some(Value::Bool(c.oom_flush)),
        set: |c, v| c.oom_flush = b(v),
    },
    Key {
        name: "expandable_page_mb",
        aliases: &[],
        kind: mib(1, 1024, false),
        stability: Stability::Stable,
        doc: "expandable segments: page size of the large pools (rounded up to the device's granularity)",
        group: None,
        get: |c| Some(Value::U64(c.expandable_page)),
        set: |c, v| c.expandable_page = u(v),
    },
    Key {
        name: "expandable_page_divisor",
        aliases: &[],
        kind: DIVISOR,
        stability: Stability::Experimental,
        doc: "expandable segments: large-pool pages are at most the peak allocated bytes divided by this (`expandable_page` halved down to the device's granularity; 0: always `expandable_page`)",
        group: None,
        get: |c| Some(Value::U64(c.expandable_page_divisor)),
        set: |c, v| c.expandable_page_divisor = u(v),
    },
    Key {
        name: "expandable_slack",
        aliases: &[],
        kind: SHARE,
        stability: Stability::Experimental,
        doc: "expandable segments: idle pages stay mapped while reserved memory is within 1 + this times the peak allocated bytes, and the device is waited for rather than grown past twice that; more slack, fewer map calls (docs/POLICY.md has the curve)",
        group: None,
        get: |c| Some(Value::F64(c.idle_slack)),
        set: |c, v| {
            c.idle_slack = f(v);
            c.idle_slack_hard = 2.0 * c.idle_slack;
        },
    },
    Key {
        name: "expandable_edges",
        aliases: &[],
        kind: KeyKind::Choice(EdgePages::WORDS),
        stability: Stability::Experimental,
        doc: "expandable page sizes at block edges: big pages while there is room (`pressure`), granules always (`small`), big pages always (`big`)",
        group: None,
        get: |c| Some(Value::Word(c.expandable_edges.word())),
        set: |c, v| c.expandable_edges = EdgePages::from_word(w(v)).expect("a word of the table"),
    },
    Key {
        name: "expandable_shadows",
        aliases: &[],
        kind: BOOL,
        stability: Stability::Experimental,
        doc: "expandable segments: a page moved elsewhere keeps its old mapping until that address needs another page, and goes back there with no driver call when a block there needs it while it is idle",
        group: None,
        get: |c| Some(Value::Bool(c.expandable_shadows)),
        set: |c, v| c.expandable_shadows = b(v),
    },
    Key {
        name: "expandable_reback",
        aliases: &[],
        kind: BOOL,
        stability: Stability::Experimental,
        doc: "expandable segments: before an allocation fails, pages larger than the device's granularity that lie partly under live blocks give back their free part (the live granules are copied to new pages mapped at the same addresses, after a device synchronize; not during a CUDA graph capture)",
        group: None,
        get: |c| Some(Value::Bool(c.expandable_reback)),
        set: |c, v| c.expandable_reback = b(v),
    },
    Key {
        name: "expandable_share",
        aliases: &[],
        kind: BOOL,
        stability: Stability::Experimental,
        doc: "expandable segments: before an allocation fails (after expandable_reback), granules partly under live blocks whose live bytes lie at disjoint offsets share one page, mapped at each of their addresses, and the other pages go back (the live bytes are copied into the shared page after a device synchronize; not during a CUDA graph capture)",
        group: None,
        get: |c| Some(Value::Bool(c.expandable_share)),
        set: |c, v| c.expandable_share = b(v),
    },
    Key {
        name: "expandable_borrow",
        aliases: &[],
        kind: BOOL,
        stability: Stability::Experimental,
        doc: "expandable segments: a stream whose best fit would need pages mapped takes another stream's free block over mapped pages instead, its free guarded by an event on the requesting stream (with expandable_cross_stream, also one that stream may still use, waited for on the device)",
        group: None,
        get: |c| Some(Value::Bool(c.expandable_borrow)),
        set: |c, v| c.expandable_borrow = b(v),
    },
    Key {
        name: "borrow_holes",
        aliases: &[],
        kind: BOOL,
        stability: Stability::Stable,
        doc: "plain segments: before creating a segment, take a free block inside another stream's partly used segment (the requesting stream waits on the device for that stream's queued work unless it is done; the block's free is guarded by an event on the requesting stream)",
        group: None,
        get: |c| Some(Value::Bool(c.borrow_holes)),
        set: |c, v| c.borrow_holes = b(v),
    },
    Key {
        name: "oom_other_kinds",
        aliases: &[],
        kind: BOOL,
        stability: Stability::Stable,
        doc: "plain segments: before an allocation fails (after the flush), the request takes a free block in its stream's segments of another kind: a small request in a large or huge segment, a large one in a huge segment",
        group: None,
        get: |c| Some(Value::Bool(c.oom_other_kinds)),
        set: |c, v| c.oom_other_kinds = b(v),
    },
    Key {
        name: "expandable_cross_stream",
        aliases: &[],
        kind: BOOL,
        stability: Stability::Experimental,
        doc: "expandable segments: past the hard limit, idle pages of another stream are taken at once and the requesting stream waits for that stream's work on the device (off: the host waits for a marker)",
        group: None,
        get: |c| Some(Value::Bool(c.expandable_cross_stream)),
        set: |c, v| c.expandable_cross_stream = b(v),
    },
    Key {
        name: "thread_cache",
        aliases: &[],
        kind: KeyKind::Count {
            min: 0,
            max: MAX_THREAD_CACHE as u64,
            pow2: false,
        },
        stability: Stability::Stable,
        doc: "blocks each thread parks for its own repeated sizes (0: off; ignored with expandable segments or without caching)",
        group: None,
        get: |c| Some(Value::U64(u64::from(c.thread_cache))),
        set: |c, v| c.thread_cache = u(v) as u32,
    },
    Key {
        name: "slab_max_kb",
        aliases: &[],
        kind: KeyKind::Bytes {
            unit: 1024,
            unit_name: "KiB",
            min: 0,
            max: SLAB_MAX / 1024,
            unlimited: false,
        },
        stability: Stability::Stable,
        doc: "small requests up to this take a chunk of their size class from a slab (0: off; at most half a small segment; ignored with expandable segments or without caching)",
        group: None,
        get: |c| Some(Value::U64(c.slab_max)),
        set: |c, v| c.slab_max = u(v),
    },
    Key {
        name: "backend",
        aliases: &[],
        kind: KeyKind::Choice(&["native"]),
        stability: Stability::Ignored,
        doc: "PyTorch's; cachealloc is itself the allocator, so only `native` applies",
        group: None,
        get: |_| None,
        set: |_, _| {},
    },
    Key {
        name: "release_lock_on_cudamalloc",
        aliases: &[],
        kind: BOOL,
        stability: Stability::Ignored,
        doc: "PyTorch's; accepted, no effect",
        group: None,
        get: |_| None,
        set: |_, _| {},
    },
    Key {
        name: "pinned_use_cuda_host_register",
        aliases: &[],
        kind: BOOL,
        stability: Stability::Ignored,
        doc: "PyTorch's (host memory); accepted, no effect",
        group: None,
        get: |_| None,
        set: |_, _| {},
    },
    Key {
        name: "pinned_use_background_threads",
        aliases: &[],
        kind: BOOL,
        stability: Stability::Ignored,
        doc: "PyTorch's (host memory); accepted, no effect",
        group: None,
        get: |_| None,
        set: |_, _| {},
    },
];

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

/// The table entry of `name` (or of a key it is an alias of).
pub fn find_key(name: &str) -> Option<&'static Key> {
    KEYS.iter()
        .find(|k| k.name == name || k.aliases.contains(&name))
}

/// The key table of `docs/POLICY.md`, generated from [`KEYS`]: each key,
/// what it accepts, its value in `default` and in the presets that differ.
pub fn keys_markdown() -> String {
    let presets: Vec<Config> = Config::PRESETS
        .iter()
        .filter_map(|p| Config::preset(p))
        .collect();
    let mut s = String::from(
        "| key | accepts | default | other presets | status | meaning |\n|---|---|---|---|---|---|\n",
    );
    for key in KEYS {
        let show =
            |c: &Config| (key.get)(c).map_or_else(|| "unset".to_string(), |v| key.kind.format(&v));
        let default = show(&presets[0]);
        let mut others: Vec<(String, Vec<&str>)> = Vec::new();
        for c in &presets[1..] {
            let v = show(c);
            if v == default {
                continue;
            }
            match others.iter_mut().find(|(x, _)| *x == v) {
                Some((_, names)) => names.push(&c.name),
                None => others.push((v, vec![&c.name])),
            }
        }
        let others: Vec<String> = others
            .into_iter()
            .map(|(v, names)| format!("{}: {}", names.join(", "), short(&v)))
            .collect();
        let name = std::iter::once(key.name)
            .chain(key.aliases.iter().copied())
            .map(|n| format!("`{n}`"))
            .collect::<Vec<_>>()
            .join(", ");
        let default = if key.stability == Stability::Ignored {
            "—".to_string()
        } else {
            short(&default)
        };
        let status = match key.stability {
            Stability::Stable => "stable",
            Stability::Experimental => "experimental",
            Stability::Ignored => "ignored",
        };
        s += &format!(
            "| {name} | {} | {default} | {} | {status} | {} |\n",
            key.kind.range_text(),
            if others.is_empty() {
                "—".to_string()
            } else {
                others.join("; ")
            },
            key.doc
        );
    }
    s
}

/// A value for the docs table: a long divisions list of zeros reads `0`.
fn short(v: &str) -> String {
    if v.starts_with('[')
        && v.split(',')
            .all(|p| p.trim_end_matches(']').ends_with(":0"))
    {
        "0".into()
    } else {
        v.into()
    }
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
mod tests {
    use super::*;

    #[test]
    fn choice_words_round_trip() {
        for &word in EdgePages::WORDS {
            let v = EdgePages::from_word(word).expect("a listed word");
            assert_eq!(v.word(), word);
        }
        assert_eq!(EdgePages::from_word("huge"), None);
    }

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
            Config::segments(),
            Config::parse("default,huge_size_mb:unlimited,borrow_holes:True").unwrap(),
            Config::parse("segments,garbage_collection_threshold:0.5,per_process_memory_fraction:0.5")
                .unwrap(),
        ] {
            assert_eq!(Config::parse(&c.to_conf_string()).unwrap(), c);
        }
    }

    /// Every value a key accepts is bounded: the largest accepted values
    /// of every number key parse, one more is refused, and nothing wraps.
    #[test]
    fn numbers_are_bounded() {
        // An expandable page this large once wrapped to 0 when rounded to
        // the granularity (a division by zero at the first large request).
        assert!(Config::parse("expandable,expandable_page_mb:17592186044415").is_err());
        assert!(Config::parse("expandable,expandable_page_mb:1024").is_ok());
        for key in KEYS {
            let (top, over) = match key.kind {
                KeyKind::Count { max, .. } => (max, max + 1),
                KeyKind::Bytes { max, .. } => (max, max + 1),
                _ => continue,
            };
            let conf = format!("slab_max_kb:0,{}:{top}", key.name);
            if key.name != "slab_max_kb" {
                assert!(Config::parse(&conf).is_ok(), "{conf}");
            }
            let conf = format!("{}:{over}", key.name);
            assert!(Config::parse(&conf).is_err(), "{conf} accepted");
            let conf = format!("{}:{}", key.name, u64::MAX);
            assert!(Config::parse(&conf).is_err(), "{conf} accepted");
        }
    }

    /// One key sets both recycling limits of expandable segments, and the
    /// configuration prints it back.
    #[test]
    fn expandable_slack_sets_both_limits() {
        let c = Config::parse("expandable,expandable_slack:0.05").unwrap();
        assert_eq!((c.idle_slack, c.idle_slack_hard), (0.05, 0.1));
        let text = c.to_conf_string();
        assert!(text.contains("expandable_slack:0.05"), "{text}");
        assert!(Config::parse("expandable_slack:-0.1").is_err());
    }

    /// Settings that leave nothing usable are refused, not silently taken.
    #[test]
    fn unusable_settings_are_refused() {
        for bad in [
            "memory_cap:0",
            "memory_cap:1MiB",
            "memory_cap:2PiB",
            "per_process_memory_fraction:0",
            "per_process_memory_fraction:0.0",
            "per_process_memory_fraction:NaN",
            "per_process_memory_fraction:inf",
            "garbage_collection_threshold:NaN",
            "large_threshold_mb:0",
            "large_threshold_mb:21",
            "segment_round_mb:0",
            "small_segment_mb:99999999",
            "huge_size_mb:0",
            ",,,,",
            "pytorch,",
            "a:1,,b:2",
            "caching:True,caching:False",
            "memory_cap:1GiB,per_process_memory_fraction:0.5",
            "memory_fraction:0.5,per_process_memory_fraction:0.5",
            "release_order:oldest",
            "paged_margin:0.5",
            "medium_segment_mb:20",
            "idle_slack:0.5",
        ] {
            assert!(Config::parse(bad).is_err(), "`{bad}` accepted");
        }
        assert_eq!(
            Config::parse("caching:True,caching:False")
                .unwrap_err()
                .to_string(),
            "configuration key `caching` is given twice"
        );
        assert!(Config::parse(",,,,")
            .unwrap_err()
            .to_string()
            .contains("empty"));
        assert_eq!(Config::parse("  ").unwrap(), Config::default());
    }

    /// The unknown-key message lists the table's keys, so it cannot go stale.
    #[test]
    fn unknown_key_lists_the_table() {
        let e = Config::parse("bogus:1").unwrap_err().to_string();
        for key in KEYS {
            assert!(e.contains(key.name), "{e} lacks {}", key.name);
        }
    }

    /// The presets print every key with a value and read back equal.
    #[test]
    fn presets_round_trip_through_the_table() {
        for p in Config::PRESETS {
            let c = Config::preset(p).unwrap();
            let s = c.to_conf_string();
            assert!(s.starts_with(p));
            assert_eq!(Config::parse(&s).unwrap(), c, "{s}");
        }
    }

    /// `default` is `segments` with expandable segments, and `expandable`
    /// is `default` by another name; no preset gives segments back on its
    /// own (see the notes on [`Config::segments`]).
    #[test]
    fn default_is_segments_with_expandable_segments() {
        let d = Config::default();
        assert!(d.expandable_segments);
        let plain = Config::parse("default,expandable_segments:False").unwrap();
        assert_eq!(
            Config {
                name: "segments".into(),
                ..plain
            },
            Config::segments()
        );
        assert!(!Config::segments().expandable_segments);
        assert_eq!(
            Config {
                name: "default".into(),
                ..Config::expandable()
            },
            d
        );
        assert!(
            !Config::segments().borrow_holes,
            "cross-stream waits are opt-in"
        );
    }

    /// The printed configuration stays small: the key table is the public
    /// surface of the policy.
    #[test]
    fn printed_configuration_has_at_most_24_keys() {
        for p in Config::PRESETS {
            let c = Config::preset(p).unwrap();
            let printed: Vec<&str> = KEYS
                .iter()
                .filter(|k| (k.get)(&c).is_some())
                .map(|k| k.name)
                .collect();
            let text = c.to_conf_string();
            assert!(printed.iter().all(|k| text.contains(&format!("{k}:"))));
            assert!(printed.len() <= 24, "{p}: {} keys: {text}", printed.len());
        }
        assert!(KEYS.len() <= 32, "{} keys in the table", KEYS.len());
    }

    /// `docs/POLICY.md`'s key table is the one [`keys_markdown`] generates
    /// (`CACHEALLOC_UPDATE_DOCS=1` rewrites it).
    #[test]
    fn docs_key_table_matches() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/POLICY.md");
        let doc = std::fs::read_to_string(path).unwrap();
        let (begin, end) = ("<!-- keys:begin -->\n", "<!-- keys:end -->");
        let a = doc.find(begin).expect("POLICY.md has a keys:begin marker") + begin.len();
        let b = doc.find(end).expect("POLICY.md has a keys:end marker");
        let table = keys_markdown();
        if std::env::var_os("CACHEALLOC_UPDATE_DOCS").is_some() {
            std::fs::write(path, format!("{}{table}{}", &doc[..a], &doc[b..])).unwrap();
            return;
        }
        assert_eq!(
            &doc[a..b],
            table,
            "docs/POLICY.md's key table is stale: run with CACHEALLOC_UPDATE_DOCS=1"
        );
    }

    #[test]
    fn pytorchs_expandable_segments_apply_unless_cachealloc_conf_sets_them() {
        let off = Some("expandable_segments:False");
        let c = with_pytorch_conf(Config::default(), None, off).unwrap();
        assert!(!c.expandable_segments);
        assert_eq!(
            Config {
                name: "segments".into(),
                ..c
            },
            Config::segments()
        );
        let own = "default,expandable_segments:True";
        let c = with_pytorch_conf(Config::parse(own).unwrap(), Some(own), off).unwrap();
        assert!(c.expandable_segments, "CACHEALLOC_CONF wins");
        let c = with_pytorch_conf(
            Config::segments(),
            Some("segments"),
            Some("max_split_size_mb:64, expandable_segments:True"),
        )
        .unwrap();
        assert!(c.expandable_segments);
        assert_eq!(c.max_split_size, 64 << 20);
        assert_eq!(
            with_pytorch_conf(Config::default(), None, None).unwrap(),
            Config::default()
        );
        assert_eq!(
            with_pytorch_conf(Config::default(), None, Some("backend:native")).unwrap(),
            Config::default()
        );
        let e = with_pytorch_conf(Config::default(), None, Some("expandable_segments:maybe"))
            .unwrap_err();
        assert!(e.to_string().contains("Expected 'True' or 'False'"), "{e}");
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
