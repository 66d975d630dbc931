//! PyTorch's own allocator configuration, honoured: the string of
//! `PYTORCH_ALLOC_CONF` (or its older name `PYTORCH_CUDA_ALLOC_CONF`) and of
//! `torch.cuda.memory._set_allocator_settings`, read with PyTorch 2.11's
//! rules (`c10/core/AllocatorConfig.cpp`, `c10/cuda/CUDAAllocatorConfig.cpp`:
//! the same keys, the same checks, the same error messages) and mapped onto
//! cachealloc's configuration keys.
//!
//! | PyTorch's key | cachealloc |
//! |---|---|
//! | `max_split_size_mb` | `max_split_size_mb` (above 1 PiB: unlimited, as PyTorch clamps) |
//! | `max_non_split_rounding_mb` | `max_non_split_rounding_mb` |
//! | `garbage_collection_threshold` | `garbage_collection_threshold` |
//! | `roundup_power2_divisions` (`N` or `[256:1,512:2,>:8]`) | `roundup_power2_divisions`, PyTorch's list semantics |
//! | `expandable_segments` | `expandable_segments` |
//! | `per_process_memory_fraction` | `per_process_memory_fraction` (0 is refused: it leaves nothing to allocate) |
//! | `backend` | `native`: nothing to do; `cudaMallocAsync`: the Python package does not install cachealloc |
//! | `release_lock_on_cudamalloc`, `pinned_*`, `graph_capture_record_stream_reuse`, `large_segment_size_mb` | accepted, no effect on the core (the pinned keys are PyTorch's host allocator's; the C++ allocator reads `graph_capture_record_stream_reuse` from PyTorch's own configuration: Note [Reclaim during a capture]) |
//!
//! Keys PyTorch 2.11 does not know are left to PyTorch (a newer PyTorch may
//! know them; PyTorch refuses the ones it does not).
//!
//! Note [PyTorch's keys and CACHEALLOC_CONF]: at start-up a key of
//! `CACHEALLOC_CONF` wins over PyTorch's key that maps onto it (the key
//! itself, or one of its group: `memory_cap` and `per_process_memory_fraction`
//! both set the cap); a preset named in `CACHEALLOC_CONF` does not count as
//! setting its keys, so `CACHEALLOC_CONF=pytorch` with
//! `PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:64` gets the split limit.
//!
//! Note [Run-time settings]: `torch.cuda.memory._set_allocator_settings(s)`
//! reaches a running allocator through [`RuntimeChanges`]. What only steers
//! later decisions changes at once: `garbage_collection_threshold`,
//! `max_non_split_rounding_mb`, `per_process_memory_fraction` (a new cap, as
//! `torch.cuda.set_per_process_memory_fraction`). What the allocator's
//! records were built on stays as it started, and a value other than the
//! one in force is reported back as a notice: `max_split_size_mb` (blocks are
//! counted oversize when allocated and uncounted when freed, by this limit),
//! `roundup_power2_divisions` (read without the lock by the thread caches),
//! `expandable_segments` (the kind of segment is chosen when the allocator
//! starts). Only the keys the string names change; PyTorch resets its own
//! `max_split_size_mb`, `roundup_power2_divisions` and
//! `garbage_collection_threshold` to their defaults when a string leaves
//! them out, cachealloc does not.

use crate::config::{Config, MemoryCap, MAX_SIZE};
use crate::rounding::{Power2Divisions, POWER2_INTERVALS};
use std::fmt;

const MIB: u64 = 1 << 20;
/// PyTorch's `kLargeBuffer` in MiB: the least `max_split_size_mb` and
/// `max_non_split_rounding_mb`.
const MIN_SPLIT_MB: u64 = 20;
/// The most register threads PyTorch's pinned allocator accepts.
const MAX_REGISTER_THREADS: u64 = 128;

/// The allocator PyTorch's `backend` key asks for.
#[derive(Copy, Clone, PartialEq, Eq, Debug)]
pub enum Backend {
    /// PyTorch's caching allocator, in whose place cachealloc works.
    Native,
    /// CUDA's `cudaMallocAsync`: another allocator, so cachealloc stays out.
    CudaMallocAsync,
}

/// A PyTorch configuration string, read: each setting it names (the last
/// one of a key wins, as in PyTorch).
#[derive(Clone, PartialEq, Debug, Default)]
pub struct PytorchConf {
    /// `max_split_size_mb`, in bytes (`u64::MAX`: unlimited).
    pub max_split_size: Option<u64>,
    /// `max_non_split_rounding_mb`, in bytes.
    pub max_non_split_rounding: Option<u64>,
    /// `garbage_collection_threshold`.
    pub garbage_collection_threshold: Option<f64>,
    /// `roundup_power2_divisions`, per interval.
    pub roundup_power2_divisions: Option<Power2Divisions>,
    /// `expandable_segments`.
    pub expandable_segments: Option<bool>,
    /// `per_process_memory_fraction`.
    pub per_process_memory_fraction: Option<f64>,
    /// `backend`.
    pub backend: Option<Backend>,
    /// Keys accepted with no effect here, in order.
    pub no_effect: Vec<String>,
    /// Keys PyTorch 2.11 does not know, left to PyTorch, in order.
    pub unknown: Vec<String>,
}

/// Why a PyTorch configuration string was refused: PyTorch's message.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct PytorchConfError(pub String);

impl fmt::Display for PytorchConfError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for PytorchConfError {}

fn err<T>(msg: impl Into<String>) -> Result<T, PytorchConfError> {
    Err(PytorchConfError(msg.into()))
}

/// PyTorch's `ConfigTokenizer`: `,` `:` `[` `]` are tokens of their own,
/// blanks are dropped, anything else runs into a word.
fn tokenize(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut word = String::new();
    for c in text.chars() {
        if matches!(c, ',' | ':' | '[' | ']') {
            if !word.is_empty() {
                out.push(std::mem::take(&mut word));
            }
            out.push(c.to_string());
        } else if !c.is_whitespace() {
            word.push(c);
        }
    }
    if !word.is_empty() {
        out.push(word);
    }
    out
}

/// The tokens with a cursor, and PyTorch's ways of reading them.
struct Tokens {
    t: Vec<String>,
}

impl Tokens {
    fn get(&self, i: usize) -> Result<&str, PytorchConfError> {
        match self.t.get(i) {
            Some(s) => Ok(s),
            None => err("Index out of bounds in ConfigTokenizer"),
        }
    }

    /// The `:` after the key at `i`; the index of the value after it.
    fn value_of(&self, i: usize) -> Result<usize, PytorchConfError> {
        let key = self.get(i)?;
        if self.get(i + 1)? != ":" {
            return err(format!(
                "Expected ':' after '{key}' in the allocator config"
            ));
        }
        self.get(i + 2)?;
        Ok(i + 2)
    }

    /// PyTorch's `toBool`: exactly `True` or `False`.
    fn bool_at(&self, i: usize) -> Result<bool, PytorchConfError> {
        match self.get(i)? {
            "True" => Ok(true),
            "False" => Ok(false),
            t => err(format!(
                "Expected 'True' or 'False' at index {i} in ConfigTokenizer but got '{t}'"
            )),
        }
    }

    /// PyTorch's `toSizeT` (`std::stoull`): a whole number, leading digits read.
    fn size_at(&self, i: usize) -> Result<u64, PytorchConfError> {
        let t = self.get(i)?;
        let digits: String = t.chars().take_while(char::is_ascii_digit).collect();
        if digits.is_empty() {
            return err(format!("stoull: '{t}' is not a whole number"));
        }
        digits
            .parse()
            .or_else(|_| err(format!("stoull: '{t}' is out of range")))
    }

    /// PyTorch's `toDouble` (`std::stod`).
    fn double_at(&self, i: usize) -> Result<f64, PytorchConfError> {
        let t = self.get(i)?;
        // The longest prefix that is a number, as stod reads it.
        (1..=t.len())
            .rev()
            .filter(|&n| t.is_char_boundary(n))
            .find_map(|n| t[..n].parse::<f64>().ok())
            .map_or_else(|| err(format!("stod: '{t}' is not a number")), Ok)
    }

    /// PyTorch's `skipKey`: the index of the key's value, or of the `]` closing a list.
    fn skip_key(&self, i: usize) -> Result<usize, PytorchConfError> {
        let mut i = self.value_of(i)?;
        if self.get(i)? != "[" {
            return Ok(i);
        }
        loop {
            i += 1;
            match self.t.get(i).map(String::as_str) {
                Some("]") => return Ok(i),
                Some(_) => {}
                None => {
                    return err(
                        "Expected closing bracket ']' in ConfigTokenizer but reached end of config",
                    )
                }
            }
        }
    }
}

/// The keys PyTorch 2.11 reads that have no effect here.
const NO_EFFECT: &[&str] = &[
    "release_lock_on_cudamalloc",
    "release_lock_on_hipmalloc",
    "pinned_use_cuda_host_register",
    "pinned_use_hip_host_register",
    "pinned_use_background_threads",
    "pinned_num_register_threads",
    "pinned_reserve_segment_size_mb",
    "graph_capture_record_stream_reuse",
    "large_segment_size_mb",
];

impl PytorchConf {
    /// Reads `text` as PyTorch 2.11 does; an invalid value is refused with
    /// PyTorch's message.
    pub fn parse(text: &str) -> Result<Self, PytorchConfError> {
        let tokens = Tokens { t: tokenize(text) };
        let mut c = PytorchConf::default();
        let mut i = 0;
        while i < tokens.t.len() {
            let key = tokens.get(i)?.to_string();
            i = match key.as_str() {
                "max_split_size_mb" | "max_non_split_rounding_mb" => {
                    let v = tokens.value_of(i)?;
                    let mb = tokens.size_at(v)?;
                    if mb < MIN_SPLIT_MB {
                        return err(format!(
                            "CachingAllocator option {key} too small, must be >= {MIN_SPLIT_MB}"
                        ));
                    }
                    // PyTorch clamps to what fits in size_t; past 1 PiB
                    // nothing is that large, so the limit is off.
                    let bytes = if mb > MAX_SIZE / MIB {
                        u64::MAX
                    } else {
                        mb * MIB
                    };
                    if key == "max_split_size_mb" {
                        c.max_split_size = Some(bytes);
                    } else {
                        c.max_non_split_rounding = Some(bytes.min(MAX_SIZE));
                    }
                    v
                }
                "garbage_collection_threshold" => {
                    let v = tokens.value_of(i)?;
                    let t = tokens.double_at(v)?;
                    if !(t > 0.0 && t < 1.0) {
                        return err("garbage_collect_threshold is invalid, set it in (0.0, 1.0)");
                    }
                    c.garbage_collection_threshold = Some(t);
                    v
                }
                "roundup_power2_divisions" => {
                    let (v, d) = parse_divisions(&tokens, i)?;
                    c.roundup_power2_divisions = Some(d);
                    v
                }
                "expandable_segments" => {
                    let v = tokens.value_of(i)?;
                    c.expandable_segments = Some(tokens.bool_at(v)?);
                    v
                }
                "per_process_memory_fraction" => {
                    let v = tokens.value_of(i)?;
                    let f = tokens.double_at(v)?;
                    if !(0.0..=1.0).contains(&f) {
                        return err("per_process_memory_fraction is invalid, set it in [0.0, 1.0]");
                    }
                    if f == 0.0 {
                        return err(
                            "per_process_memory_fraction:0 leaves no memory to allocate; \
                             cachealloc needs a fraction in (0.0, 1.0]",
                        );
                    }
                    c.per_process_memory_fraction = Some(f);
                    v
                }
                "backend" => {
                    let v = tokens.value_of(i)?;
                    c.backend =
                        Some(match tokens.get(v)? {
                            "native" => Backend::Native,
                            "cudaMallocAsync" => Backend::CudaMallocAsync,
                            _ => return err(
                                "Unknown allocator backend, options are native and cudaMallocAsync",
                            ),
                        });
                    v
                }
                "pinned_num_register_threads" => {
                    let v = tokens.value_of(i)?;
                    let n = tokens.size_at(v)?;
                    if !n.is_power_of_two() {
                        return err(format!(
                            "Number of register threads has to be power of 2, got {n}"
                        ));
                    }
                    if n > MAX_REGISTER_THREADS {
                        return err(format!(
                            "Number of register threads should be less than or equal to \
                             {MAX_REGISTER_THREADS}, got {n}"
                        ));
                    }
                    c.no_effect.push(key);
                    v
                }
                "pinned_reserve_segment_size_mb" | "large_segment_size_mb" => {
                    let v = tokens.value_of(i)?;
                    tokens.size_at(v)?;
                    c.no_effect.push(key);
                    v
                }
                k if NO_EFFECT.contains(&k) => {
                    let v = tokens.value_of(i)?;
                    tokens.bool_at(v)?;
                    c.no_effect.push(key);
                    v
                }
                _ => {
                    let v = tokens.skip_key(i)?;
                    c.unknown.push(key);
                    v
                }
            };
            // The `,` before the next key.
            if i + 1 < tokens.t.len() {
                if tokens.get(i + 1)? != "," {
                    return err(format!(
                        "Expected ',' after the value of '{}' in the allocator config, got '{}'",
                        tokens.get(i)?,
                        tokens.get(i + 1)?
                    ));
                }
                i += 1;
            }
            i += 1;
        }
        Ok(c)
    }

    /// `config` (read from `CACHEALLOC_CONF`, which set the key groups
    /// `own`: [`Config::parse_keys`]) with these settings applied where
    /// `CACHEALLOC_CONF` does not set them: Note [PyTorch's keys and
    /// CACHEALLOC_CONF].
    pub fn apply(&self, mut config: Config, own: &[&str]) -> Config {
        let free = |group: &str| !own.contains(&group);
        if let Some(v) = self.max_split_size.filter(|_| free("max_split_size_mb")) {
            config.max_split_size = v;
        }
        if let Some(v) = self
            .max_non_split_rounding
            .filter(|_| free("max_non_split_rounding_mb"))
        {
            config.max_non_split_rounding = v;
        }
        if let Some(v) = self
            .garbage_collection_threshold
            .filter(|_| free("garbage_collection_threshold"))
        {
            config.garbage_collection_threshold = Some(v);
        }
        if let Some(v) = self
            .roundup_power2_divisions
            .filter(|_| free("roundup_power2_divisions"))
        {
            config.roundup_power2_divisions = v;
        }
        if let Some(v) = self
            .expandable_segments
            .filter(|_| free("expandable_segments"))
        {
            config.expandable_segments = v;
        }
        if let Some(f) = self
            .per_process_memory_fraction
            .filter(|_| free("memory_cap"))
        {
            config.memory_cap = Some(MemoryCap::Fraction(f));
        }
        config
    }

    /// What a run-time settings string changes in an allocator running with
    /// `config` (expandable segments in use or not): Note [Run-time settings].
    pub fn runtime_changes(&self, config: &Config, expandable: bool) -> RuntimeChanges {
        let mut fixed = Vec::new();
        if let Some(v) = self.max_split_size.filter(|&v| v != config.max_split_size) {
            let now = if config.max_split_size == u64::MAX {
                "unlimited".to_string()
            } else {
                format!("{} MiB", config.max_split_size / MIB)
            };
            let asked = if v == u64::MAX {
                "unlimited".to_string()
            } else {
                format!("{} MiB", v / MIB)
            };
            fixed.push(format!("max_split_size_mb stays {now} (asked: {asked})"));
        }
        if let Some(d) = self
            .roundup_power2_divisions
            .filter(|d| *d != config.roundup_power2_divisions)
        {
            fixed.push(format!(
                "roundup_power2_divisions stays {:?} (asked: {d:?})",
                config.roundup_power2_divisions
            ));
        }
        if let Some(e) = self.expandable_segments.filter(|&e| e != expandable) {
            fixed.push(format!(
                "expandable_segments stays {} (asked: {})",
                py_bool(expandable),
                py_bool(e)
            ));
        }
        RuntimeChanges {
            garbage_collection_threshold: self.garbage_collection_threshold,
            max_non_split_rounding: self.max_non_split_rounding,
            per_process_memory_fraction: self.per_process_memory_fraction,
            fixed,
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

/// What a run-time settings string changes: Note [Run-time settings].
#[derive(Clone, PartialEq, Debug, Default)]
pub struct RuntimeChanges {
    /// A new `garbage_collection_threshold`.
    pub garbage_collection_threshold: Option<f64>,
    /// A new `max_non_split_rounding`, in bytes.
    pub max_non_split_rounding: Option<u64>,
    /// A new memory cap, as a fraction of the device.
    pub per_process_memory_fraction: Option<f64>,
    /// Settings asked for that stay as the allocator started, each a line.
    pub fixed: Vec<String>,
}

impl RuntimeChanges {
    /// The notice for the user when some settings cannot change now (empty when all did).
    pub fn notice(&self) -> String {
        if self.fixed.is_empty() {
            return String::new();
        }
        format!(
            "cachealloc: these allocator settings are fixed when the allocator starts \
             (set them in PYTORCH_ALLOC_CONF or CACHEALLOC_CONF before CUDA is first used): {}",
            self.fixed.join("; ")
        )
    }
}

/// PyTorch's `parseRoundUpPower2Divisions`: `N` (a power of two, every
/// interval), or `[size_mb:N,…,>:N]` where the first entry also sets every
/// interval below its own, each later one its own interval only, and `>`
/// every interval after the last one named. cachealloc's bound (at most
/// 65536 divisions) applies too.
fn parse_divisions(
    tokens: &Tokens,
    key: usize,
) -> Result<(usize, Power2Divisions), PytorchConfError> {
    let bounded = |d: u64| -> Result<u32, PytorchConfError> {
        if d > 1 << 16 {
            return err(format!(
                "roundup_power2_divisions: {d} divisions; cachealloc takes at most 65536"
            ));
        }
        Ok(d as u32)
    };
    let mut out = [0u32; POWER2_INTERVALS];
    let mut i = tokens.value_of(key)?;
    if tokens.get(i)? != "[" {
        let d = tokens.size_at(i)?;
        if !d.is_power_of_two() {
            return err("For roundups, the divisions has to be power of 2 ");
        }
        out.fill(bounded(d)?);
        return Ok((i, out));
    }
    let mut first = true;
    let mut last = 0usize;
    loop {
        i += 1;
        let boundary = tokens.get(i)?.to_string();
        if boundary == "]" {
            return Ok((i, out));
        }
        if tokens.get(i + 1)? != ":" {
            return err(format!(
                "Expected ':' after '{boundary}' in roundup_power2_divisions"
            ));
        }
        i += 2;
        let d = tokens.size_at(i)?;
        if d != 0 && !d.is_power_of_two() {
            return err(
                "For roundups, the divisions has to be power of 2 or 0 to disable roundup ",
            );
        }
        let d = bounded(d)?;
        if boundary == ">" {
            out.iter_mut().skip(last + 1).for_each(|x| *x = d);
        } else {
            let mb = tokens.size_at(i - 2)?;
            if !mb.is_power_of_two() {
                return err("For roundups, the intervals have to be power of 2 ");
            }
            let index = (mb.ilog2() as usize).min(POWER2_INTERVALS - 1);
            if first {
                out[..index].fill(d);
                first = false;
            }
            out[index] = d;
            last = index;
        }
        match tokens.get(i + 1)? {
            "]" => {}
            "," => i += 1,
            t => {
                return err(format!(
                    "Expected ',' or ']' in roundup_power2_divisions, got '{t}'"
                ))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> PytorchConf {
        PytorchConf::parse(s).unwrap_or_else(|e| panic!("`{s}`: {e}"))
    }

    fn refused(s: &str) -> String {
        match PytorchConf::parse(s) {
            Ok(c) => panic!("`{s}` accepted: {c:?}"),
            Err(e) => e.0,
        }
    }

    #[test]
    fn every_key_with_a_meaning_maps_to_cachealloc() {
        let c = parse(
            "max_split_size_mb:64, max_non_split_rounding_mb:40,garbage_collection_threshold:0.6,\
             roundup_power2_divisions:4,expandable_segments:False,per_process_memory_fraction:0.5,\
             backend:native",
        );
        assert_eq!(c.max_split_size, Some(64 * MIB));
        assert_eq!(c.max_non_split_rounding, Some(40 * MIB));
        assert_eq!(c.garbage_collection_threshold, Some(0.6));
        assert_eq!(c.roundup_power2_divisions, Some([4; POWER2_INTERVALS]));
        assert_eq!(c.expandable_segments, Some(false));
        assert_eq!(c.per_process_memory_fraction, Some(0.5));
        assert_eq!(c.backend, Some(Backend::Native));
        let config = c.apply(Config::default(), &[]);
        assert_eq!(config.max_split_size, 64 * MIB);
        assert_eq!(config.max_non_split_rounding, 40 * MIB);
        assert_eq!(config.garbage_collection_threshold, Some(0.6));
        assert_eq!(config.roundup_power2_divisions, [4; POWER2_INTERVALS]);
        assert!(!config.expandable_segments);
        assert_eq!(config.memory_cap, Some(MemoryCap::Fraction(0.5)));
        // What PyTorch maps onto cachealloc's keys reads back through them.
        let text = config.to_conf_string();
        assert!(text.contains("max_split_size_mb:64"), "{text}");
        assert!(text.contains("max_non_split_rounding_mb:40"), "{text}");
        assert_eq!(Config::parse(&text).unwrap(), config);
    }

    #[test]
    fn keys_of_no_effect_here_are_accepted_and_named() {
        let c = parse(
            "release_lock_on_cudamalloc:True,pinned_use_cuda_host_register:True,\
             pinned_num_register_threads:8,pinned_use_background_threads:False,\
             pinned_reserve_segment_size_mb:64,graph_capture_record_stream_reuse:True,\
             large_segment_size_mb:40",
        );
        assert_eq!(c.no_effect.len(), 7, "{:?}", c.no_effect);
        assert_eq!(c.apply(Config::default(), &[]), Config::default());
        assert_eq!(parse("").apply(Config::segments(), &[]), Config::segments());
    }

    #[test]
    fn keys_pytorch_does_not_know_are_left_to_it() {
        let c = parse("some_future_key:[1,2,3],expandable_segments:True,other:x");
        assert_eq!(c.unknown, ["some_future_key", "other"]);
        assert_eq!(c.expandable_segments, Some(true));
    }

    #[test]
    fn the_last_setting_of_a_key_wins() {
        assert_eq!(
            parse("expandable_segments:True,expandable_segments:False").expandable_segments,
            Some(false)
        );
    }

    #[test]
    fn invalid_values_are_refused_in_pytorchs_words() {
        for (text, message) in [
            (
                "max_split_size_mb:10",
                "CachingAllocator option max_split_size_mb too small, must be >= 20",
            ),
            (
                "max_non_split_rounding_mb:19",
                "CachingAllocator option max_non_split_rounding_mb too small, must be >= 20",
            ),
            (
                "garbage_collection_threshold:1.0",
                "garbage_collect_threshold is invalid, set it in (0.0, 1.0)",
            ),
            (
                "garbage_collection_threshold:0",
                "garbage_collect_threshold is invalid, set it in (0.0, 1.0)",
            ),
            (
                "per_process_memory_fraction:1.5",
                "per_process_memory_fraction is invalid, set it in [0.0, 1.0]",
            ),
            (
                "per_process_memory_fraction:-0.1",
                "per_process_memory_fraction is invalid, set it in [0.0, 1.0]",
            ),
            (
                "expandable_segments:true",
                "Expected 'True' or 'False' at index 2 in ConfigTokenizer but got 'true'",
            ),
            (
                "backend:cuda",
                "Unknown allocator backend, options are native and cudaMallocAsync",
            ),
            (
                "roundup_power2_divisions:3",
                "For roundups, the divisions has to be power of 2 ",
            ),
            (
                "roundup_power2_divisions:0",
                "For roundups, the divisions has to be power of 2 ",
            ),
            (
                "roundup_power2_divisions:[256:3]",
                "For roundups, the divisions has to be power of 2 or 0 to disable roundup ",
            ),
            (
                "roundup_power2_divisions:[300:2]",
                "For roundups, the intervals have to be power of 2 ",
            ),
            (
                "pinned_num_register_threads:3",
                "Number of register threads has to be power of 2, got 3",
            ),
            (
                "pinned_num_register_threads:256",
                "Number of register threads should be less than or equal to 128, got 256",
            ),
        ] {
            assert_eq!(refused(text), message, "{text}");
        }
        assert!(refused("per_process_memory_fraction:0").contains("no memory"));
        assert!(refused("max_split_size_mb:abc").contains("stoull"));
        assert!(refused("garbage_collection_threshold:x").contains("stod"));
        assert!(refused("max_split_size_mb").contains("Index out of bounds"));
        assert!(refused("expandable_segments:True max_split_size_mb:64").contains("True"));
        assert!(refused("roundup_power2_divisions:[256:1").contains("Index out of bounds"));
        assert!(refused("roundup_power2_divisions:131072").contains("65536"));
    }

    /// PyTorch's list: the first entry also sets the intervals below it,
    /// later entries only their own, `>` those after the last one named
    /// (1 MiB is interval 0, 256 MiB interval 8).
    #[test]
    fn divisions_lists_follow_pytorch() {
        let d = parse("roundup_power2_divisions:[256:1,512:2,>:8]")
            .roundup_power2_divisions
            .unwrap();
        let mut want = [1u32; POWER2_INTERVALS];
        want[9] = 2;
        want[10..].fill(8);
        assert_eq!(d, want);
        // Gaps between named intervals stay 0, as in PyTorch.
        let d = parse("roundup_power2_divisions:[1:1,4:4]")
            .roundup_power2_divisions
            .unwrap();
        assert_eq!(&d[..4], &[1, 0, 4, 0]);
        // Past 32 GiB every boundary is the last interval.
        let d = parse("roundup_power2_divisions:[65536:16]")
            .roundup_power2_divisions
            .unwrap();
        assert_eq!(d, [16; POWER2_INTERVALS]);
        // Blanks anywhere, as PyTorch drops them.
        assert_eq!(
            parse(" roundup_power2_divisions : [ 256 : 1 , > : 8 ] ").roundup_power2_divisions,
            parse("roundup_power2_divisions:[256:1,>:8]").roundup_power2_divisions
        );
    }

    #[test]
    fn huge_split_limits_are_unlimited() {
        let c = parse("max_split_size_mb:99999999999999");
        assert_eq!(c.max_split_size, Some(u64::MAX));
        assert_eq!(
            c.apply(Config::default(), &[]).max_split_size,
            u64::MAX,
            "as PyTorch's clamp: no block is that large"
        );
    }

    /// Note [PyTorch's keys and CACHEALLOC_CONF].
    #[test]
    fn cachealloc_conf_wins_for_its_own_keys() {
        let torch = parse(
            "max_split_size_mb:64,per_process_memory_fraction:0.5,expandable_segments:False,\
             garbage_collection_threshold:0.7",
        );
        let own = "default,max_split_size_mb:128,memory_cap:8GiB";
        let (config, groups) = Config::parse_keys(own).unwrap();
        assert_eq!(groups, ["max_split_size_mb", "memory_cap"]);
        let c = torch.apply(config, &groups);
        assert_eq!(c.max_split_size, 128 * MIB, "CACHEALLOC_CONF's");
        assert_eq!(
            c.memory_cap,
            Some(MemoryCap::Bytes(8 << 30)),
            "memory_cap and the fraction are one group"
        );
        assert!(
            !c.expandable_segments,
            "PyTorch's: CACHEALLOC_CONF names only a preset"
        );
        assert_eq!(c.garbage_collection_threshold, Some(0.7));
        // The alias of the fraction key is in the same group too.
        let (config, groups) = Config::parse_keys("memory_fraction:0.25").unwrap();
        assert_eq!(
            torch.apply(config, &groups).memory_cap,
            Some(MemoryCap::Fraction(0.25))
        );
    }

    /// Note [Run-time settings].
    #[test]
    fn run_time_settings_change_what_is_safe_and_name_the_rest() {
        let config = Config::parse("segments,max_split_size_mb:64").unwrap();
        let same = parse("max_split_size_mb:64,expandable_segments:False");
        let r = same.runtime_changes(&config, false);
        assert!(r.fixed.is_empty() && r.notice().is_empty(), "{r:?}");
        let r = parse(
            "garbage_collection_threshold:0.5,max_non_split_rounding_mb:64,\
             per_process_memory_fraction:0.75",
        )
        .runtime_changes(&config, false);
        assert_eq!(
            r,
            RuntimeChanges {
                garbage_collection_threshold: Some(0.5),
                max_non_split_rounding: Some(64 * MIB),
                per_process_memory_fraction: Some(0.75),
                fixed: Vec::new(),
            }
        );
        let r = parse("max_split_size_mb:128,expandable_segments:True,roundup_power2_divisions:4")
            .runtime_changes(&config, false);
        assert_eq!(r.fixed.len(), 3, "{r:?}");
        let n = r.notice();
        assert!(
            n.contains("max_split_size_mb stays 64 MiB (asked: 128 MiB)"),
            "{n}"
        );
        assert!(
            n.contains("expandable_segments stays False (asked: True)"),
            "{n}"
        );
        assert!(n.contains("roundup_power2_divisions"), "{n}");
    }
}
