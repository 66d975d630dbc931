//! The configuration key table ([`KEYS`]): every key's kind, bounds,
//! stability and documentation, and what is generated from it (lookup, the
//! docs table). A program may list the keys (for a help text, or to check
//! a configuration string before it starts); [`Config::set`] and
//! [`Config::get`] read and write any of them by name.

use super::*;

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
pub(crate) enum Value {
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
    pub(crate) fn parse(&self, text: &str) -> Result<Value, String> {
        let v = self.read(text)?;
        self.check(&v)?;
        Ok(v)
    }

    /// Reads `text` as a value of this kind, not yet checked against the
    /// bounds (except where the value would not fit: a count of units past
    /// `u64::MAX` bytes).
    fn read(&self, text: &str) -> Result<Value, String> {
        match *self {
            KeyKind::Bool => parse_bool(text)
                .map(Value::Bool)
                .ok_or_else(|| "expected True or False".into()),
            KeyKind::Count { min, max, .. } => text
                .parse()
                .map(Value::U64)
                .map_err(|_| format!("expected a whole number from {min} to {max}")),
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
                let n: u64 = text.parse().map_err(|_| {
                    format!(
                        "expected a whole number of {unit_name} from {min} to {max}{}",
                        or_unlimited(unlimited)
                    )
                })?;
                n.checked_mul(unit)
                    .filter(|&b| b != u64::MAX)
                    .map(Value::U64)
                    .ok_or_else(|| self.bytes_range_error())
            }
            KeyKind::Size { .. } => parse_size(text).map(Value::U64),
            KeyKind::Number { .. } => text
                .parse()
                .map(Value::F64)
                .map_err(|_| "expected a number".to_string()),
            KeyKind::Choice(words) => words
                .iter()
                .find(|&&w| w == text)
                .map(|&w| Value::Word(w))
                .ok_or_else(|| format!("expected {}", words.join(", "))),
            KeyKind::Divisions => parse_divisions(text).map(Value::Divisions),
        }
    }

    /// Checks a value of this kind against its bounds, with the messages of
    /// [`KeyKind::parse`]: the one check behind the parser, [`Config::set`]
    /// and the typed setters of [`ConfigBuilder`].
    pub(crate) fn check(&self, v: &Value) -> Result<(), String> {
        match (*self, v) {
            (KeyKind::Bool, Value::Bool(_)) => Ok(()),
            (KeyKind::Count { min, max, pow2 }, &Value::U64(n)) => {
                if !(min..=max).contains(&n) {
                    return Err(format!("must be from {min} to {max}"));
                }
                if pow2 && n > 1 && !n.is_power_of_two() {
                    return Err("must be 0, 1 or a power of two".into());
                }
                Ok(())
            }
            (
                KeyKind::Bytes {
                    unit,
                    unit_name,
                    min,
                    max,
                    unlimited,
                },
                &Value::U64(b),
            ) => {
                if b == u64::MAX && unlimited {
                    return Ok(());
                }
                if b % unit != 0 {
                    return Err(format!(
                        "expected a whole number of {unit_name} from {min} to {max}{}",
                        or_unlimited(unlimited)
                    ));
                }
                if !(min..=max).contains(&(b / unit)) {
                    return Err(self.bytes_range_error());
                }
                Ok(())
            }
            (KeyKind::Size { min, max }, &Value::U64(b)) => {
                if !(min..=max).contains(&b) {
                    return Err(format!(
                        "must be from {} to {}",
                        crate::human_bytes(min),
                        crate::human_bytes(max)
                    ));
                }
                Ok(())
            }
            (KeyKind::Number { .. }, &Value::F64(f)) => {
                if !self.number_in_range(f) {
                    return Err(format!("must be in {}", self.range_text()));
                }
                Ok(())
            }
            (KeyKind::Choice(words), Value::Word(w)) if words.contains(w) => Ok(()),
            (KeyKind::Choice(words), _) => Err(format!("expected {}", words.join(", "))),
            (KeyKind::Divisions, Value::Divisions(d)) => d
                .iter()
                .try_for_each(|&d| check_division(u64::from(d)).map(drop)),
            _ => Err(format!("expected {}", self.range_text())),
        }
    }

    /// The error of a count of units out of [`KeyKind::Bytes`]'s bounds.
    fn bytes_range_error(&self) -> String {
        match *self {
            KeyKind::Bytes {
                unit_name,
                min,
                max,
                unlimited,
                ..
            } => format!(
                "must be from {min} to {max} {unit_name}{}",
                or_unlimited(unlimited)
            ),
            _ => unreachable!("only byte keys count units"),
        }
    }

    /// `v` as the text of an error message: [`KeyKind::format`], except
    /// that a byte value that is not a whole number of units shows its
    /// fraction rather than being rounded down.
    pub(crate) fn error_text(&self, v: &Value) -> String {
        match (*self, v) {
            (KeyKind::Bytes { unit, .. }, &Value::U64(b)) if b != u64::MAX && b % unit != 0 => {
                (b as f64 / unit as f64).to_string()
            }
            _ => self.format(v),
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
    pub(crate) fn format(&self, v: &Value) -> String {
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
    pub(super) group: Option<&'static str>,
    /// The value to print (`None`: leave the key out).
    pub(super) get: fn(&Config) -> Option<Value>,
    /// Stores a value [`KeyKind::parse`] accepted.
    pub(super) set: fn(&mut Config, Value),
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

fn or_unlimited(unlimited: bool) -> &'static str {
    if unlimited {
        " or unlimited"
    } else {
        ""
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

/// Every configuration key. Parsing, [`Config::to_conf_string`],
/// [`Config::set`] and [`Config::get`], the typed setters of
/// [`ConfigBuilder`], the error messages and the key table of
/// `docs/POLICY.md` all read this table.
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

/// The table entry of `name` (or of a key it is an alias of).
pub(crate) fn find_key(name: &str) -> Option<&'static Key> {
    KEYS.iter()
        .find(|k| k.name == name || k.aliases.contains(&name))
}

/// The key table of `docs/POLICY.md`, generated from [`KEYS`]: each key,
/// what it accepts, its value in `default` and in the presets that differ.
#[cfg(test)]
pub(crate) fn keys_markdown() -> String {
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
#[cfg(test)]
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
