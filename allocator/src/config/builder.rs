//! The public interface of a [`Config`]: its read accessors, [`ConfigBuilder`]
//! with typed setters for the stable keys, and [`Config::set`] /
//! [`Config::get`] for every key of the table by name.
//!
//! Note [Config's fields are the crate's]: `Config` is `#[non_exhaustive]`
//! and its fields are `pub(crate)`, so that the allocator reads them
//! directly while users outside the crate build a configuration only
//! through a preset, [`Config::parse`], the builder or [`Config::set`], each
//! of which checks the values with the one key table ([`KEYS`]): the same
//! bounds and the same error messages whichever way a value comes in. A
//! stable key has a typed setter and a read accessor; an experimental key is
//! reachable by its name only (`set("expandable_shadows", "False")`), so it
//! may change or go without breaking a caller's build.

use super::*;

/// The typed accessors on [`Config`] and setters on [`ConfigBuilder`] of
/// the stable keys that are one field of a plain type: the field, its type,
/// the key of [`KEYS`] that checks it, and how the type becomes a [`Value`].
macro_rules! typed_keys {
    ($($field:ident: $ty:ty = $key:literal, $to_value:expr, $doc:literal;)+) => {
        impl Config {
            $(
                #[doc = concat!($doc, " (key `", $key, "`).")]
                #[inline]
                pub fn $field(&self) -> $ty {
                    self.$field
                }
            )+
        }

        impl ConfigBuilder {
            $(
                #[doc = concat!("Sets: ", $doc, " (key `", $key, "`; checked by [`ConfigBuilder::build`]).")]
                pub fn $field(self, value: $ty) -> Self {
                    let to_value: fn($ty) -> Value = $to_value;
                    self.put($key, to_value(value))
                }
            )+
        }

        /// The keys with a typed setter on [`ConfigBuilder`] (tests check
        /// that they are the table's stable keys).
        #[cfg(test)]
        pub(crate) const TYPED_KEYS: &[&str] = &[
            $($key,)+
            "roundup_power2_divisions",
            "garbage_collection_threshold",
            "memory_cap",
            "per_process_memory_fraction",
        ];
    };
}

typed_keys! {
    caching: bool = "caching", Value::Bool,
        "Whether freed blocks are cached at all (`false`: every block's segment is freed at once)";
    small_segment: u64 = "small_segment_mb", Value::U64,
        "Size in bytes of small-pool segments";
    large_threshold: u64 = "large_threshold_mb", Value::U64,
        "Large requests below this many bytes share 20 MiB segments; from it on each gets a segment of its own size";
    segment_round: u64 = "segment_round_mb", Value::U64,
        "Own-size large segments are rounded up to a multiple of this many bytes";
    large_split_remainder: u64 = "large_split_remainder_mb", Value::U64,
        "A large block is split only when more than this many bytes would remain";
    huge_size: u64 = "huge_size_mb", Value::U64,
        "Plain segments: requests of at least this many bytes go to the huge pool (`u64::MAX`: no huge pool)";
    max_split_size: u64 = "max_split_size_mb", Value::U64,
        "PyTorch's `max_split_size` in bytes: blocks this large are not split, and smaller requests do not take them (`u64::MAX`: unlimited)";
    max_non_split_rounding: u64 = "max_non_split_rounding_mb", Value::U64,
        "PyTorch's `max_non_split_rounding_size` in bytes: a request of at least `max_split_size` takes a cached block only if the block is less than this much larger";
    expandable_segments: bool = "expandable_segments", Value::Bool,
        "Page-backed growable segments (the CUDA virtual memory API; plain segments, with a notice, where the device lacks it)";
    expandable_page: u64 = "expandable_page_mb", Value::U64,
        "Expandable segments: page size in bytes of the large pools";
    borrow_holes: bool = "borrow_holes", Value::Bool,
        "Plain segments: before a new segment is created, a free block inside another stream's partly used segment is taken";
    oom_other_kinds: bool = "oom_other_kinds", Value::Bool,
        "Plain segments: before an allocation fails, a free block in the requesting stream's segments of another kind is taken";
    thread_cache: u32 = "thread_cache", |n| Value::U64(u64::from(n)),
        "Freed blocks each thread keeps for its own repeated sizes (0: off)";
    slab_max: u64 = "slab_max_kb", Value::U64,
        "Small requests up to this many bytes take a chunk of their size class from a slab (0: off)";
}

impl Config {
    /// A builder that starts from the `default` preset; see
    /// [`Config::into_builder`] to start from another.
    ///
    /// ```
    /// use cachealloc_core::{Config, MemoryCap};
    /// let config = Config::builder()
    ///     .max_split_size(64 << 20)
    ///     .memory_cap(Some(MemoryCap::Fraction(0.5)))
    ///     .set("expandable_shadows", "False") // an experimental key, by name
    ///     .build()?;
    /// assert_eq!(config.max_split_size(), 64 << 20);
    /// assert_eq!(config.get("expandable_shadows")?.as_deref(), Some("False"));
    /// assert_eq!(
    ///     config.to_conf_string().split(',').find(|i| i.starts_with("max_split")),
    ///     Some("max_split_size_mb:64")
    /// );
    /// # Ok::<(), cachealloc_core::ConfigError>(())
    /// ```
    pub fn builder() -> ConfigBuilder {
        Config::default().into_builder()
    }

    /// A builder that starts from this configuration (a preset, or a parsed string).
    pub fn into_builder(self) -> ConfigBuilder {
        ConfigBuilder {
            config: self,
            error: None,
        }
    }

    /// Sets one key of [`KEYS`] (or an alias) to a value written as in a
    /// configuration string: `set("max_split_size_mb", "64")`. The whole
    /// configuration is checked afterwards, with the errors of
    /// [`Config::parse`]; on an error nothing changes. Keys that bound each
    /// other (`slab_max_kb` and `small_segment_mb`) are set together with
    /// [`ConfigBuilder::set`], which checks them at `build`.
    pub fn set(&mut self, key: &str, value: &str) -> Result<(), ConfigError> {
        let mut next = self.clone();
        next.apply_pair(key, value)?;
        next.validate()?;
        *self = next;
        Ok(())
    }

    /// The value of a key of [`KEYS`] (or an alias) as a configuration
    /// string writes it (`Some("64")` for `max_split_size_mb`), `None` where
    /// it is unset (`memory_cap` without a cap, PyTorch's keys that have no
    /// effect here). [`Config::set`] reads the text back to the same value.
    pub fn get(&self, key: &str) -> Result<Option<String>, ConfigError> {
        let entry = find_key(key).ok_or_else(|| ConfigError::UnknownKey(key.to_string()))?;
        Ok((entry.get)(self).map(|v| entry.kind.format(&v)))
    }

    /// The name of the preset this configuration started from (for reports).
    #[inline]
    pub fn name(&self) -> &str {
        &self.name
    }

    /// PyTorch's `roundup_power2_divisions`: the divisions of each
    /// power-of-two interval that requests are rounded up to (key
    /// `roundup_power2_divisions`).
    #[inline]
    pub fn roundup_power2_divisions(&self) -> &Power2Divisions {
        &self.roundup_power2_divisions
    }

    /// PyTorch's `garbage_collection_threshold`: with a cap, old unsplit
    /// cached blocks are freed above this fraction of it (`None`: off).
    #[inline]
    pub fn garbage_collection_threshold(&self) -> Option<f64> {
        self.garbage_collection_threshold
    }

    /// The limit on reserved memory (keys `memory_cap` and
    /// `per_process_memory_fraction`; `None`: no cap).
    #[inline]
    pub fn memory_cap(&self) -> Option<MemoryCap> {
        self.memory_cap
    }
}

/// A [`Config`] under construction: typed setters for the stable keys,
/// [`ConfigBuilder::set`] for any key by name; [`ConfigBuilder::build`]
/// returns the first value the key table refuses, as [`Config::parse`]
/// would report it, or the configuration. A later setter of the same key
/// wins.
#[derive(Clone, Debug)]
#[must_use = "a builder does nothing until `build` is called"]
pub struct ConfigBuilder {
    config: Config,
    /// The first value refused, reported by `build`.
    error: Option<ConfigError>,
}

impl ConfigBuilder {
    /// Stores `v` through the table entry `name` if its bounds accept it.
    fn put(mut self, name: &'static str, v: Value) -> Self {
        if self.error.is_none() {
            let key = find_key(name).expect("the typed setters name keys of the table");
            match key.kind.check(&v) {
                Ok(()) => (key.set)(&mut self.config, v),
                Err(why) => {
                    self.error = Some(ConfigError::BadValue {
                        key: name.to_string(),
                        value: key.kind.error_text(&v),
                        why,
                    })
                }
            }
        }
        self
    }

    /// Sets any key of [`KEYS`] (or an alias) by name, the value written as
    /// in a configuration string: the way to the experimental keys.
    pub fn set(mut self, key: &str, value: &str) -> Self {
        if self.error.is_none() {
            if let Err(e) = self.config.apply_pair(key, value) {
                self.error = Some(e);
            }
        }
        self
    }

    /// Sets PyTorch's `roundup_power2_divisions`: each interval's divisions,
    /// 0, 1 or a power of two up to 65536 (key `roundup_power2_divisions`).
    pub fn roundup_power2_divisions(self, divisions: Power2Divisions) -> Self {
        self.put("roundup_power2_divisions", Value::Divisions(divisions))
    }

    /// Sets PyTorch's `garbage_collection_threshold`, a fraction in (0, 1)
    /// (`None`: off).
    pub fn garbage_collection_threshold(mut self, threshold: Option<f64>) -> Self {
        match threshold {
            Some(t) => self.put("garbage_collection_threshold", Value::F64(t)),
            None => {
                self.config.garbage_collection_threshold = None;
                self
            }
        }
    }

    /// Sets the limit on reserved memory: bytes (key `memory_cap`) or a
    /// fraction of the device's memory (key `per_process_memory_fraction`);
    /// `None`: no cap.
    pub fn memory_cap(mut self, cap: Option<MemoryCap>) -> Self {
        match cap {
            Some(MemoryCap::Bytes(b)) => self.put("memory_cap", Value::U64(b)),
            Some(MemoryCap::Fraction(f)) => self.put("per_process_memory_fraction", Value::F64(f)),
            None => {
                self.config.memory_cap = None;
                self
            }
        }
    }

    /// The configuration, or the first value refused (by a key's bounds, or
    /// by a limit between keys), with the error [`Config::parse`] gives.
    pub fn build(self) -> Result<Config, ConfigError> {
        if let Some(e) = self.error {
            return Err(e);
        }
        self.config.validate()?;
        Ok(self.config)
    }
}

/// Feature `testing`: settings no key reaches, for the tests of the
/// allocator and of its model. Not part of the stable interface: they may
/// change with the fields they set.
#[cfg(feature = "testing")]
impl Config {
    /// Whether pages grow back larger after an `empty_cache` that gave
    /// pages back (a field with no key; off in the `pytorch` preset).
    pub fn testing_regrow_pages(&self) -> bool {
        self.expandable_regrow_pages
    }

    /// Sets [`Config::testing_regrow_pages`].
    pub fn testing_set_regrow_pages(&mut self, on: bool) {
        self.expandable_regrow_pages = on;
    }

    /// Sets the granule of own-size large segments to any byte count, past
    /// the bounds of `segment_round_mb`, unchecked: for the model's checks
    /// of its arithmetic on configurations no string can make.
    pub fn testing_set_segment_round_unchecked(&mut self, bytes: u64) {
        self.segment_round = bytes;
    }
}
