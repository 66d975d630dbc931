//! The C ABI: PyTorch's `CUDAPluggableAllocator` and our own calls.
//!
//! With the feature `cuda` the `cachealloc` shared library
//! (`libcachealloc.so`, the package's `cdylib`) exports these functions:
//! `cachealloc_alloc` and `cachealloc_free` (PyTorch's
//! `CUDAPluggableAllocator` functions), PyTorch's hooks (`cachealloc_init`,
//! `cachealloc_reset`, `cachealloc_set_memory_fraction`,
//! `cachealloc_record_stream`), and our calls: statistics, fragmentation,
//! snapshot and configuration as JSON strings, `cachealloc_empty_cache`,
//! `cachealloc_reset_peak_stats`, trace recording, the last error and the
//! error count, `cachealloc_string_free`, `cachealloc_set_oom_handler`.
//! Their C declarations are in `include/cachealloc.h`, generated from this
//! file and `capi_torch.rs` by cbindgen (`cbindgen.toml`); a test fails when
//! the committed header is stale, and another checks the Python package's
//! ctypes table against it (`src/abi_tests.rs`). Strings are returned
//! malloc'd by the library: free them with `cachealloc_string_free` (never
//! with `free()`). NULL or -1 means failure; `cachealloc_last_error()` says why.
//!
//! Rules, the same for every function:
//!
//! - Nothing panics across the ABI: every body runs under
//!   [`std::panic::catch_unwind`]; a panic becomes an error.
//! - Errors are return values (NULL, -1) plus a message in the calling
//!   thread's last error (`cachealloc_last_error`); the process-wide count
//!   is `cachealloc_error_count`. Functions returning `void` report only there.
//! - `cachealloc_alloc`: size 0 returns NULL with no error (PyTorch gives
//!   empty tensors a null pointer); a negative size, an unknown device or
//!   out-of-memory returns NULL with the last error set (the out-of-memory
//!   text explains the memory state). **PyTorch does not check the pointer
//!   it gets** (`CUDAPluggableAllocator::malloc` stores and returns it), so a
//!   NULL for a non-empty tensor becomes an illegal-address error on the GPU
//!   later. Install an out-of-memory handler to get an exception instead: with
//!   `cachealloc_set_oom_handler` set, a failed allocation of more than 0
//!   bytes calls the handler with the message before returning; a handler that
//!   throws a C++ exception (the Python loader passes PyTorch's
//!   `c10::detail::torchCheckFail`, which raises `RuntimeError` in Python)
//!   unwinds through `cachealloc_alloc`, which is declared `extern "C-unwind"`
//!   for that. A handler that returns gets NULL returned as without one.
//! - `cachealloc_free`: a NULL pointer with size 0 is a no-op (the free of
//!   a size-0 allocation); NULL with a size, a pointer this library did not
//!   hand out, a pointer inside a block, a double free or an unknown device
//!   are ignored with the last error set, and never corrupt the allocator's
//!   records or memory it did not hand out. What cannot be caught: the
//!   allocator tracks blocks by address, as every allocator that frees by
//!   pointer does, so a stale free of an address that was handed out again
//!   in the meantime frees the new owner's block (it is a live block at
//!   that address). Only a free of an address that is not live now is
//!   detected as a double free. The
//!   size must be the one requested at allocation (PyTorch passes it): a
//!   different size is a caller bug, reported with the last error set, and
//!   the block is still freed (the pointer alone identifies it).
//! - `cachealloc_init` receives the number of devices (that is what PyTorch
//!   passes when CUDA initialises), not a device: it remembers the count
//!   (0 to 64; another count is an error) and checks `CACHEALLOC_CONF`. An
//!   invalid configuration sets the last error (nothing is written to
//!   stderr, which may be closed); every allocation then fails with it.
//!   Allocators are created per device on first use, so no context is made
//!   on devices the program never touches.
//! - `cachealloc_record_stream` finds the allocator owning the pointer among
//!   the devices used so far.
//! - A stream handed to `cachealloc_alloc` or `cachealloc_record_stream` is
//!   registered as a live stream (`cuda::driver::register_stream`; PyTorch
//!   keeps its streams alive): only registered streams and the special
//!   handles ever reach the driver, since CUDA does not promise to detect a
//!   handle that is not a live stream.
//! - `cachealloc_empty_cache` and `cachealloc_reset` wait for pending stream
//!   events, then release every entirely free segment.
//!
//! The logic is generic over a [`Registry`](crate::capi::Registry) of per-device allocators so that
//! it is tested on [`SimulatedDevice`](cachealloc_core::SimulatedDevice)s on
//! machines without a GPU; the `extern "C"` functions exist with `cuda` only.

use crate::trace_file::Recording;
use cachealloc_core::{
    AllocError, BlockState, CachingAllocator, Device, DevicePtr, MemoryCap, PoolKind, StreamId,
};
use parking_lot::Mutex;
use serde_json::{json, Map, Value};
use std::cell::RefCell;
use std::ffi::{c_char, CString};
use std::fmt;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicI32, AtomicU64, AtomicUsize, Ordering};

/// Device ordinals the C ABI accepts (0..MAX_DEVICES).
pub const MAX_DEVICES: i32 = 64;

/// The signature of an out-of-memory handler: PyTorch's
/// `c10::detail::torchCheckFail(const char* func, const char* file, uint32_t line, const char* msg)`.
/// It may unwind (throw a C++ exception) through `cachealloc_alloc`.
pub type OomHandler = unsafe extern "C-unwind" fn(*const c_char, *const c_char, u32, *const c_char);

/// Where the C ABI gets the allocator of a device.
pub trait Registry: Sync {
    /// The device type of the allocators.
    type Dev: Device;
    /// The allocator of `device` (0 ≤ device < [`MAX_DEVICES`]), created on first use.
    fn get(&self, device: i32) -> Result<&CachingAllocator<Self::Dev>, String>;
    /// The allocator of `device` if it exists: the lookup behind every
    /// allocation and free once the device is in use, so it should cost no
    /// more than a load. The ABI asks only for devices it has used; the
    /// default goes through [`Registry::get`], which may create one.
    #[inline]
    fn existing(&self, device: i32) -> Option<&CachingAllocator<Self::Dev>> {
        self.get(device).ok()
    }
    /// Checks the configuration the allocators will be created with.
    fn check_config(&self) -> Result<(), String> {
        Ok(())
    }
    /// A name for the device of an allocator.
    fn device_name(&self, _alloc: &CachingAllocator<Self::Dev>) -> String {
        String::new()
    }
}

/// Why a C ABI call failed.
#[derive(Debug)]
pub enum AbiError {
    /// A negative allocation size (a `size_t` above `SSIZE_MAX` on the C side).
    NegativeSize(isize),
    /// A device ordinal outside 0..[`MAX_DEVICES`], or one whose allocator cannot be created.
    Device {
        /// The ordinal given.
        device: i32,
        /// Why it is unusable.
        reason: String,
    },
    /// Free or record_stream of a NULL pointer (with a nonzero size for free).
    NullPointer(&'static str),
    /// A pointer no allocator of this library handed out (on any device used so far).
    ForeignPointer(u64),
    /// The allocator refused (out of memory, double free, interior pointer, driver error).
    Alloc {
        /// The device.
        device: i32,
        /// The allocator's error.
        error: AllocError,
    },
    /// A memory fraction outside (0, 1].
    BadFraction(f64),
    /// A device count given to `init` outside 0..=[`MAX_DEVICES`].
    BadDeviceCount(i32),
    /// `CACHEALLOC_CONF` cannot be used.
    Config(String),
    /// `free` was given a size other than the one requested at allocation
    /// (the block was freed all the same).
    SizeMismatch {
        /// The pointer freed.
        ptr: u64,
        /// The size given to `free`.
        given: isize,
        /// The size requested at allocation.
        requested: u64,
    },

    /// A trace recording could not start or finish.
    Trace(String),
    /// A panic inside the library (a bug), caught at the ABI.
    Panic(String),
}

impl fmt::Display for AbiError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AbiError::NegativeSize(s) => write!(f, "cachealloc: negative allocation size {s}"),
            AbiError::Device { device, reason } => {
                write!(f, "cachealloc: device {device} unusable: {reason}")
            }
            AbiError::NullPointer(call) => write!(f, "cachealloc: {call} of a NULL pointer"),
            AbiError::ForeignPointer(p) => write!(
                f,
                "cachealloc: pointer {p:#x} was not allocated by cachealloc on any device in use"
            ),
            AbiError::Alloc { device, error } => write!(f, "cachealloc (device {device}): {error}"),
            AbiError::BadFraction(x) => {
                write!(f, "cachealloc: memory fraction {x} is not in (0, 1]")
            }
            AbiError::BadDeviceCount(n) => {
                write!(
                    f,
                    "cachealloc: device count {n} is not in 0..={MAX_DEVICES}"
                )
            }
            AbiError::Config(reason) => {
                write!(f, "cachealloc: {reason}; every allocation will fail")
            }
            AbiError::SizeMismatch {
                ptr,
                given,
                requested,
            } => write!(
                f,
                "cachealloc: free of {ptr:#x} with size {given}, but {requested} bytes were \
                 requested (freed all the same)"
            ),

            AbiError::Trace(e) => write!(f, "cachealloc: trace recording: {e}"),
            AbiError::Panic(e) => write!(f, "cachealloc: internal error (panic): {e}"),
        }
    }
}

impl std::error::Error for AbiError {}

thread_local! {
    static LAST_ERROR: RefCell<Option<String>> = const { RefCell::new(None) };
}

/// Process-wide error bookkeeping.
static ERROR_COUNT: AtomicU64 = AtomicU64::new(0);
static LAST_ERROR_ANY: Mutex<Option<String>> = Mutex::new(None);

/// Records `e` as the calling thread's last error (and the process's), returns its text.
fn record_error(e: &AbiError) -> String {
    let msg = e.to_string();
    record_message(&msg);
    msg
}

/// Records `msg` as the calling thread's last error and the process's, and
/// counts it: the one error channel of both C ABIs (this one and
/// `capi_torch`'s).
pub(crate) fn record_message(msg: &str) {
    // `try_with`: a free during thread teardown must not panic on a destroyed thread-local.
    let _ = LAST_ERROR.try_with(|l| *l.borrow_mut() = Some(msg.to_string()));
    *LAST_ERROR_ANY.lock() = Some(msg.to_string());
    ERROR_COUNT.fetch_add(1, Ordering::Relaxed);
}

/// The calling thread's last error.
pub fn last_error() -> Option<String> {
    LAST_ERROR.try_with(|l| l.borrow().clone()).ok().flatten()
}

/// Clears the calling thread's last error.
pub fn clear_error() {
    let _ = LAST_ERROR.try_with(|l| *l.borrow_mut() = None);
}

/// Errors recorded so far, all threads.
pub fn error_count() -> u64 {
    ERROR_COUNT.load(Ordering::Relaxed)
}

/// The text of a caught panic's payload.
pub(crate) fn panic_text(p: Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "unknown panic payload".to_string()
    }
}

/// Runs `f` with panics caught; an error (or a panic) is recorded and
/// `Err(message)` returned.
fn guarded<T>(f: impl FnOnce() -> Result<T, AbiError>) -> Result<T, String> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(record_error(&e)),
        Err(p) => Err(record_error(&AbiError::Panic(panic_text(p)))),
    }
}

/// The state behind the C ABI: a registry of allocators plus what the ABI
/// itself keeps (devices in use, trace recordings, the out-of-memory handler).
pub struct Abi<R: Registry> {
    registry: R,
    /// Bit d set: the allocator of device d exists (handed out at least once).
    in_use: AtomicU64,
    /// The device count PyTorch passed to the init hook (-1 before).
    device_count: AtomicI32,
    /// The out-of-memory handler as an address (0: none).
    oom_handler: AtomicUsize,
    recordings: Mutex<Vec<(i32, String, Recording)>>,
}

impl<R: Registry> Abi<R> {
    /// An ABI state over `registry`.
    pub const fn new(registry: R) -> Self {
        Abi {
            registry,
            in_use: AtomicU64::new(0),
            device_count: AtomicI32::new(-1),
            oom_handler: AtomicUsize::new(0),
            recordings: Mutex::new(Vec::new()),
        }
    }

    /// The allocator of `device`, created if needed; checks the ordinal first.
    #[inline]
    fn get(&self, device: i32) -> Result<&CachingAllocator<R::Dev>, AbiError> {
        // A device in use: one load here and one in the registry.
        match self.existing(device) {
            Some(a) => Ok(a),
            None => self.get_slow(device),
        }
    }

    /// [`Abi::get`] for a device not yet in use, or a bad ordinal.
    #[cold]
    #[inline(never)]
    fn get_slow(&self, device: i32) -> Result<&CachingAllocator<R::Dev>, AbiError> {
        if !(0..MAX_DEVICES).contains(&device) {
            return Err(AbiError::Device {
                device,
                reason: format!("ordinal outside 0..{MAX_DEVICES}"),
            });
        }
        let bit = 1u64 << device;
        let a = self
            .registry
            .get(device)
            .map_err(|reason| AbiError::Device { device, reason })?;
        if self.in_use.load(Ordering::Relaxed) & bit == 0 {
            self.in_use.fetch_or(bit, Ordering::Relaxed);
        }
        Ok(a)
    }

    /// The allocator of `device` if it was used before (never creates one).
    #[inline]
    fn existing(&self, device: i32) -> Option<&CachingAllocator<R::Dev>> {
        if !(0..MAX_DEVICES).contains(&device) {
            return None;
        }
        if self.in_use.load(Ordering::Relaxed) & (1u64 << device) == 0 {
            return None;
        }
        self.registry.existing(device)
    }

    /// Devices whose allocators exist, lowest first.
    pub fn devices_in_use(&self) -> Vec<i32> {
        let bits = self.in_use.load(Ordering::Relaxed);
        (0..MAX_DEVICES)
            .filter(|d| bits & (1u64 << d) != 0)
            .collect()
    }

    /// `alloc`: the address (0 for size 0).
    pub fn alloc(&self, size: isize, device: i32, stream: u64) -> Result<u64, AbiError> {
        if size == 0 {
            return Ok(0);
        }
        let bytes = u64::try_from(size).map_err(|_| AbiError::NegativeSize(size))?;
        let a = self.get(device)?;
        a.malloc(bytes, StreamId(stream))
            .map(|p| p.0)
            .map_err(|error| AbiError::Alloc { device, error })
    }

    /// [`Abi::alloc`] under `catch_unwind`; on failure of a request of more
    /// than 0 bytes the out-of-memory handler (if any) is called with the
    /// message, outside the unwind guard, so that it may throw through us.
    pub fn alloc_or_raise(&self, size: isize, device: i32, stream: u64) -> u64 {
        match guarded(|| self.alloc(size, device, stream)) {
            Ok(p) => p,
            Err(msg) => {
                let h = self.oom_handler.load(Ordering::Acquire);
                if h != 0 {
                    // SAFETY: `h` was stored by `set_oom_handler` from a value
                    // of type `OomHandler` (a non-null function pointer), so
                    // transmuting it back gives the same function pointer.
                    let handler = unsafe { std::mem::transmute::<usize, OomHandler>(h) };
                    let text = CString::new(msg.replace('\0', " ")).unwrap_or_default();
                    // SAFETY: the handler has the C signature documented at
                    // `OomHandler`; every string argument is NUL-terminated and
                    // outlives the call. It may unwind (a C++ exception): this
                    // function and its callers are "C-unwind", and no Rust
                    // unwind guard is between the handler and the caller.
                    unsafe {
                        handler(
                            c"cachealloc_alloc".as_ptr(),
                            c"src/capi.rs".as_ptr(),
                            line!(),
                            text.as_ptr(),
                        )
                    };
                }
                0
            }
        }
    }

    /// Installs (or, with `None`, removes) the out-of-memory handler.
    pub fn set_oom_handler(&self, handler: Option<OomHandler>) {
        self.oom_handler
            .store(handler.map_or(0, |h| h as usize), Ordering::Release);
    }

    /// `free`: see the module documentation for what is ignored.
    pub fn free(&self, ptr: u64, size: isize, device: i32) -> Result<(), AbiError> {
        if ptr == 0 {
            return if size == 0 {
                Ok(())
            } else {
                Err(AbiError::NullPointer("free"))
            };
        }
        if !(0..MAX_DEVICES).contains(&device) {
            return Err(AbiError::Device {
                device,
                reason: format!("ordinal outside 0..{MAX_DEVICES}"),
            });
        }
        let a = self.existing(device).ok_or(AbiError::ForeignPointer(ptr))?;
        let requested = a.free_sized(DevicePtr(ptr)).map_err(|error| match error {
            AllocError::UnknownPointer(_) => AbiError::ForeignPointer(ptr),
            error => AbiError::Alloc { device, error },
        })?;
        if u64::try_from(size).ok() != Some(requested) {
            return Err(AbiError::SizeMismatch {
                ptr,
                given: size,
                requested,
            });
        }
        Ok(())
    }

    /// `record_stream`: marks `ptr` as used by `stream` in whichever allocator owns it.
    pub fn record_stream(&self, ptr: u64, stream: u64) -> Result<(), AbiError> {
        if ptr == 0 {
            return Err(AbiError::NullPointer("record_stream"));
        }
        for d in self.devices_in_use() {
            let Some(a) = self.existing(d) else { continue };
            match a.record_stream(DevicePtr(ptr), StreamId(stream)) {
                Ok(()) => return Ok(()),
                Err(AllocError::UnknownPointer(_)) => continue,
                Err(error) => return Err(AbiError::Alloc { device: d, error }),
            }
        }
        Err(AbiError::ForeignPointer(ptr))
    }

    /// The init hook: remembers the device count and checks the configuration.
    pub fn init(&self, device_count: i32) -> Result<(), AbiError> {
        if !(0..=MAX_DEVICES).contains(&device_count) {
            return Err(AbiError::BadDeviceCount(device_count));
        }
        self.device_count.store(device_count, Ordering::Relaxed);
        self.registry.check_config().map_err(AbiError::Config)
    }

    /// The device count given to [`Abi::init`] (-1 before).
    pub fn device_count(&self) -> i32 {
        self.device_count.load(Ordering::Relaxed)
    }

    /// `empty_cache` on one device: bytes released.
    pub fn empty_cache(&self, device: i32) -> Result<u64, AbiError> {
        let a = self.get(device)?;
        a.empty_cache()
            .map(|r| r.bytes)
            .map_err(|error| AbiError::Alloc { device, error })
    }

    /// The reset hook: `empty_cache` on every device in use. Bytes released;
    /// the first error is returned after all devices were tried.
    pub fn reset(&self) -> Result<u64, AbiError> {
        let mut total = 0;
        let mut first_err = None;
        for d in self.devices_in_use() {
            match self.empty_cache(d) {
                Ok(b) => total += b,
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        first_err.map_or(Ok(total), Err)
    }

    /// The memory-fraction hook: caps reserved memory at `fraction` of the device's total.
    pub fn set_memory_fraction(&self, fraction: f64, device: i32) -> Result<(), AbiError> {
        if !MemoryCap::Fraction(fraction).is_valid() {
            return Err(AbiError::BadFraction(fraction));
        }
        let a = self.get(device)?;
        a.set_memory_cap(Some(MemoryCap::Fraction(fraction)))
            .map_err(|error| AbiError::Alloc { device, error })
    }

    /// Resets every peak statistic of `device`.
    pub fn reset_peak_stats(&self, device: i32) -> Result<(), AbiError> {
        self.get(device)?.reset_peak_stats();
        Ok(())
    }

    /// `memory_stats()` of `device` as a JSON object with PyTorch's key names.
    pub fn stats_json(&self, device: i32) -> Result<String, AbiError> {
        let a = self.get(device)?;
        let map: Map<String, Value> = a
            .stats()
            .entries()
            .into_iter()
            .map(|(k, v)| (k, Value::from(v)))
            .collect();
        Ok(Value::Object(map).to_string())
    }

    /// The fragmentation report of `device` as text.
    pub fn fragmentation_text(&self, device: i32) -> Result<String, AbiError> {
        Ok(self.get(device)?.fragmentation().to_string())
    }

    /// The fragmentation figures of `device` as JSON.
    pub fn fragmentation_json(&self, device: i32) -> Result<String, AbiError> {
        let r = self.get(device)?.fragmentation();
        Ok(json!({
            "allocated": r.allocated,
            "reserved": r.reserved,
            "reserved_unallocated": r.reserved_unallocated(),
            "free": r.free,
            "inactive_split": r.inactive_split,
            "releasable": r.releasable,
            "largest_free_block": r.largest_free_block,
            "external_fragmentation": r.external_fragmentation(),
            "unused_fraction": r.unused_fraction(),
            "segments": r.segments.len(),
        })
        .to_string())
    }

    /// Every segment and block of `device`, shaped like
    /// `torch.cuda.memory._snapshot()["segments"]`.
    pub fn snapshot_json(&self, device: i32) -> Result<String, AbiError> {
        let snap = self.get(device)?.snapshot();
        let segments: Vec<Value> = snap
            .segments
            .iter()
            .map(|s| {
                let blocks: Vec<Value> = s
                    .blocks
                    .iter()
                    .map(|b| {
                        json!({
                            "address": b.address.0,
                            "size": b.size,
                            "requested_size": b.requested_size,
                            "state": match b.state {
                                BlockState::Free | BlockState::Parked | BlockState::Aliased => "inactive",
                                BlockState::Allocated => "active_allocated",
                                BlockState::AwaitingEvents => "active_pending_free",
                            },
                            "stream_uses": b.stream_uses.iter().map(|u| u.0).collect::<Vec<_>>(),
                        })
                    })
                    .collect();
                json!({
                    "device": device,
                    "address": s.address.0,
                    "total_size": s.total_size,
                    "mapped_size": s.mapped_size,
                    "allocated_size": s.allocated_size,
                    "requested_size": s.requested_size,
                    "stream": s.stream.0,
                    "segment_type": match s.pool {
                        PoolKind::Small => "small",
                        PoolKind::Large => "large",
                        PoolKind::Huge => "huge",
                    },
                    "blocks": blocks,
                })
            })
            .collect();
        Ok(json!({ "segments": segments }).to_string())
    }

    /// What is in force on `device`: configuration, notices, cap, device name, ABI errors.
    pub fn info_json(&self, device: i32) -> Result<String, AbiError> {
        let a = self.get(device)?;
        let recording = self
            .recordings
            .lock()
            .iter()
            .find(|(d, _, _)| *d == device)
            .map(|(_, p, _)| p.clone());
        Ok(json!({
            "device": device,
            "device_name": self.registry.device_name(a),
            "config": a.config().to_conf_string(),
            "expandable": a.is_expandable(),
            "notices": a.notices(),
            "memory_cap": a.memory_cap(),
            "device_count": self.device_count(),
            "devices_in_use": self.devices_in_use(),
            "recording": recording,
            "error_count": error_count(),
            "last_error_any_thread": LAST_ERROR_ANY.lock().clone(),
        })
        .to_string())
    }

    /// Starts recording `device`'s requests into the trace file `path`
    /// (plain, or gzip when it ends in `.gz`).
    pub fn record_trace_start(&self, device: i32, path: &str) -> Result<(), AbiError> {
        let a = self.get(device)?;
        let mut recs = self.recordings.lock();
        if let Some((_, p, _)) = recs.iter().find(|(d, _, _)| *d == device) {
            return Err(AbiError::Trace(format!(
                "device {device} is already recording to {p}; stop it first"
            )));
        }
        let rec = Recording::start(a, path).map_err(|e| AbiError::Trace(e.to_string()))?;
        recs.push((device, path.to_string(), rec));
        Ok(())
    }

    /// Stops the recording of `device`; returns the number of events written.
    pub fn record_trace_stop(&self, device: i32) -> Result<u64, AbiError> {
        let a = self.get(device)?;
        let rec = {
            let mut recs = self.recordings.lock();
            let i = recs
                .iter()
                .position(|(d, _, _)| *d == device)
                .ok_or_else(|| AbiError::Trace(format!("device {device} is not recording")))?;
            recs.swap_remove(i)
        };
        rec.2.finish(a).map_err(|e| AbiError::Trace(e.to_string()))
    }
}

/// A heap string for the C side (NUL bytes inside replaced), freed by `cachealloc_string_free`.
fn into_c_string(s: String) -> *mut c_char {
    let s = if s.contains('\0') {
        s.replace('\0', " ")
    } else {
        s
    };
    CString::new(s).map_or(std::ptr::null_mut(), CString::into_raw)
}

/// A `Result<String>` from [`guarded`] as a C string (NULL on error).
fn c_string_result(r: Result<String, String>) -> *mut c_char {
    r.map_or(std::ptr::null_mut(), into_c_string)
}

#[cfg(feature = "cuda")]
pub use exports::*;

#[cfg(feature = "cuda")]
mod exports {
    //! The exported functions over the CUDA registry ([`crate::cuda::allocator`]).

    use super::*;
    use crate::cuda::CudaDevice;
    use std::ffi::{c_int, c_void, CStr};

    /// The CUDA allocators of the process ([`crate::cuda::allocator`]).
    pub struct CudaRegistry;

    impl Registry for CudaRegistry {
        type Dev = CudaDevice;

        fn get(&self, device: i32) -> Result<&CachingAllocator<CudaDevice>, String> {
            crate::cuda::allocator(device).map_err(|e| e.to_string())
        }

        #[inline]
        fn existing(&self, device: i32) -> Option<&CachingAllocator<CudaDevice>> {
            crate::cuda::existing_allocator(device)
        }

        fn check_config(&self) -> Result<(), String> {
            crate::cuda::config_from_env()
                .map(|_| ())
                .map_err(|e| e.to_string())
        }

        fn device_name(&self, alloc: &CachingAllocator<CudaDevice>) -> String {
            alloc.device().name().to_string()
        }
    }

    static ABI: Abi<CudaRegistry> = Abi::new(CudaRegistry);

    /// The stream PyTorch passed, registered as one the driver may be handed.
    fn stream_id(stream: *mut c_void) -> u64 {
        crate::cuda::driver::ffi_stream(stream).0
    }

    /// Allocates `size` bytes on `device` for use on `stream` (PyTorch's `alloc_fn`).
    /// NULL for size 0 (no error) and on failure (see the module documentation).
    #[no_mangle]
    pub extern "C-unwind" fn cachealloc_alloc(
        size: isize,
        device: c_int,
        stream: *mut c_void,
    ) -> *mut c_void {
        ABI.alloc_or_raise(size, device, stream_id(stream)) as usize as *mut c_void
    }

    /// Returns `ptr` to the cache (PyTorch's `free_fn`). Misuse is ignored with the last error set.
    #[no_mangle]
    pub extern "C" fn cachealloc_free(
        ptr: *mut c_void,
        size: isize,
        device: c_int,
        _stream: *mut c_void,
    ) {
        let _ = guarded(|| ABI.free(ptr as usize as u64, size, device));
    }

    /// PyTorch's init hook: called with the number of devices when CUDA initialises.
    #[no_mangle]
    pub extern "C" fn cachealloc_init(device_count: c_int) {
        // The error is the last error; stderr may be closed, so nothing is printed.
        let _ = guarded(|| ABI.init(device_count));
    }

    /// PyTorch's reset hook (`torch.cuda.empty_cache()`): empties the cache of every device in use.
    #[no_mangle]
    pub extern "C" fn cachealloc_reset() {
        let _ = guarded(|| ABI.reset());
    }

    /// PyTorch's memory-fraction hook (`torch.cuda.set_per_process_memory_fraction`).
    #[no_mangle]
    pub extern "C" fn cachealloc_set_memory_fraction(fraction: f64, device: c_int) {
        let _ = guarded(|| ABI.set_memory_fraction(fraction, device));
    }

    /// PyTorch's record-stream hook (`tensor.record_stream(s)`).
    #[no_mangle]
    pub extern "C" fn cachealloc_record_stream(ptr: *mut c_void, stream: *mut c_void) {
        let _ = guarded(|| ABI.record_stream(ptr as usize as u64, stream_id(stream)));
    }

    /// Empties the cache of `device`; bytes released, or -1.
    #[no_mangle]
    pub extern "C" fn cachealloc_empty_cache(device: c_int) -> i64 {
        guarded(|| ABI.empty_cache(device)).map_or(-1, |b| i64::try_from(b).unwrap_or(i64::MAX))
    }

    /// Resets the peak statistics of `device`; 0, or -1.
    #[no_mangle]
    pub extern "C" fn cachealloc_reset_peak_stats(device: c_int) -> c_int {
        guarded(|| ABI.reset_peak_stats(device)).map_or(-1, |()| 0)
    }

    /// `memory_stats()` of `device` as JSON (PyTorch's key names); free with `cachealloc_string_free`.
    #[no_mangle]
    pub extern "C" fn cachealloc_stats_json(device: c_int) -> *mut c_char {
        c_string_result(guarded(|| ABI.stats_json(device)))
    }

    /// The fragmentation report of `device` as text; free with `cachealloc_string_free`.
    #[no_mangle]
    pub extern "C" fn cachealloc_fragmentation(device: c_int) -> *mut c_char {
        c_string_result(guarded(|| ABI.fragmentation_text(device)))
    }

    /// The fragmentation figures of `device` as JSON; free with `cachealloc_string_free`.
    #[no_mangle]
    pub extern "C" fn cachealloc_fragmentation_json(device: c_int) -> *mut c_char {
        c_string_result(guarded(|| ABI.fragmentation_json(device)))
    }

    /// Every segment and block of `device` as JSON; free with `cachealloc_string_free`.
    #[no_mangle]
    pub extern "C" fn cachealloc_snapshot_json(device: c_int) -> *mut c_char {
        c_string_result(guarded(|| ABI.snapshot_json(device)))
    }

    /// Configuration, notices, cap and device name of `device` as JSON; free with `cachealloc_string_free`.
    #[no_mangle]
    pub extern "C" fn cachealloc_info_json(device: c_int) -> *mut c_char {
        c_string_result(guarded(|| ABI.info_json(device)))
    }

    /// Starts recording `device` into the trace file at `path` (UTF-8); 0, or -1.
    ///
    /// # Safety
    /// `path` is NULL or a NUL-terminated string.
    #[no_mangle]
    pub unsafe extern "C" fn cachealloc_record_trace_start(
        device: c_int,
        path: *const c_char,
    ) -> c_int {
        guarded(|| {
            if path.is_null() {
                return Err(AbiError::NullPointer("record_trace_start path"));
            }
            // SAFETY: non-null and NUL-terminated per this function's contract.
            let p = unsafe { CStr::from_ptr(path) };
            let p = p
                .to_str()
                .map_err(|_| AbiError::Trace("path is not UTF-8".to_string()))?;
            ABI.record_trace_start(device, p)
        })
        .map_or(-1, |()| 0)
    }

    /// Stops recording `device`; events written, or -1.
    #[no_mangle]
    pub extern "C" fn cachealloc_record_trace_stop(device: c_int) -> i64 {
        guarded(|| ABI.record_trace_stop(device))
            .map_or(-1, |n| i64::try_from(n).unwrap_or(i64::MAX))
    }

    /// The calling thread's last error (a copy; free with `cachealloc_string_free`), or NULL.
    #[no_mangle]
    pub extern "C" fn cachealloc_last_error() -> *mut c_char {
        catch_unwind(|| last_error().map_or(std::ptr::null_mut(), into_c_string))
            .unwrap_or(std::ptr::null_mut())
    }

    /// Clears the calling thread's last error.
    #[no_mangle]
    pub extern "C" fn cachealloc_clear_error() {
        let _ = catch_unwind(clear_error);
    }

    /// Errors recorded so far by all threads.
    #[no_mangle]
    pub extern "C" fn cachealloc_error_count() -> u64 {
        error_count()
    }

    /// Frees a string returned by this library. NULL is ignored.
    ///
    /// # Safety
    /// `s` is NULL or a string returned by a `cachealloc_*` function, freed once.
    #[no_mangle]
    pub unsafe extern "C" fn cachealloc_string_free(s: *mut c_char) {
        if !s.is_null() {
            // SAFETY: per the contract, `s` came from `CString::into_raw` in
            // `into_c_string` and is freed exactly once.
            drop(unsafe { CString::from_raw(s) });
        }
    }

    /// Installs the out-of-memory handler (NULL removes it); see the module
    /// documentation. (The type is [`OomHandler`], spelled out for the header.)
    #[no_mangle]
    pub extern "C" fn cachealloc_set_oom_handler(
        handler: Option<
            unsafe extern "C-unwind" fn(*const c_char, *const c_char, u32, *const c_char),
        >,
    ) {
        ABI.set_oom_handler(handler);
    }

    #[cfg(test)]
    mod tests {
        use super::*;
        use std::process::{Command, Stdio};

        /// Regression: with a bad `CACHEALLOC_CONF` and stderr a closed pipe,
        /// `cachealloc_init` printed with `eprintln!`, which panicked inside an
        /// `extern "C"` function, and the host process aborted (exit 134). Now
        /// the error is only the last error. (Needs no GPU: `init` only
        /// checks the configuration.)
        #[test]
        fn init_with_a_bad_conf_and_a_closed_stderr_does_not_abort() {
            const NAME: &str =
                "capi::exports::tests::init_with_a_bad_conf_and_a_closed_stderr_does_not_abort";
            if std::env::var_os("CACHEALLOC_TEST_INIT_CHILD").is_some() {
                cachealloc_init(1);
                let e = last_error().unwrap_or_default();
                // 42, not 0: a filter that matched no test would also exit 0.
                std::process::exit(if e.contains("bogus_key") { 42 } else { 3 });
            }
            // A pipe whose read end is closed before the child starts: any
            // write to its stderr fails with EPIPE.
            let (reader, writer) = std::io::pipe().unwrap();
            drop(reader);
            let status = Command::new(std::env::current_exe().unwrap())
                .args(["--exact", NAME, "--test-threads=1", "--nocapture"])
                .env("CACHEALLOC_TEST_INIT_CHILD", "1")
                .env("CACHEALLOC_CONF", "bogus_key:1")
                .stdout(Stdio::null())
                .stderr(Stdio::from(writer))
                .status()
                .unwrap();
            assert_eq!(status.code(), Some(42), "{status}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cachealloc_core::{Config, DeviceError, MemInfo, SimulatedDevice};
    use std::sync::OnceLock;

    const GIB: u64 = 1 << 30;

    /// A simulated device whose addresses start at `offset`, so that two
    /// devices never hand out the same address (as with CUDA's unified addressing).
    struct OffsetDevice {
        inner: SimulatedDevice,
        offset: u64,
    }

    impl Device for OffsetDevice {
        type Event = <SimulatedDevice as Device>::Event;
        fn allocate(&self, bytes: u64) -> Result<DevicePtr, DeviceError> {
            self.inner
                .allocate(bytes)
                .map(|p| DevicePtr(p.0 + self.offset))
        }
        fn free(&self, ptr: DevicePtr, bytes: u64) -> Result<(), DeviceError> {
            self.inner.free(DevicePtr(ptr.0 - self.offset), bytes)
        }
        fn mem_info(&self) -> Result<MemInfo, DeviceError> {
            self.inner.mem_info()
        }
        fn record_event(&self, stream: StreamId) -> Result<Self::Event, DeviceError> {
            self.inner.record_event(stream)
        }
        fn event_completed(&self, event: &Self::Event) -> Result<bool, DeviceError> {
            self.inner.event_completed(event)
        }
        fn wait_event(&self, event: &Self::Event) -> Result<(), DeviceError> {
            self.inner.wait_event(event)
        }
        fn release_event(&self, event: Self::Event) {
            self.inner.release_event(event)
        }
        fn synchronize(&self) -> Result<(), DeviceError> {
            self.inner.synchronize()
        }
    }

    /// Two simulated devices of 1 GiB (addresses 1 TiB apart); device 2 and above "do not exist".
    struct SimRegistry {
        devices: [OnceLock<CachingAllocator<OffsetDevice>>; 2],
        /// Calls of `get` (the slow lookup, which may create an allocator).
        gets: AtomicUsize,
    }

    impl SimRegistry {
        fn new() -> Self {
            SimRegistry {
                devices: [OnceLock::new(), OnceLock::new()],
                gets: AtomicUsize::new(0),
            }
        }

        fn slot(&self, device: i32) -> Option<&OnceLock<CachingAllocator<OffsetDevice>>> {
            usize::try_from(device)
                .ok()
                .and_then(|d| self.devices.get(d))
        }
    }

    impl Registry for SimRegistry {
        type Dev = OffsetDevice;
        fn get(&self, device: i32) -> Result<&CachingAllocator<OffsetDevice>, String> {
            self.gets.fetch_add(1, Ordering::Relaxed);
            let slot = self
                .slot(device)
                .ok_or_else(|| format!("no device {device} (2 simulated)"))?;
            Ok(slot.get_or_init(|| {
                let dev = OffsetDevice {
                    inner: SimulatedDevice::new(GIB),
                    offset: (device as u64) << 40,
                };
                CachingAllocator::new(dev, Config::default())
            }))
        }
        fn existing(&self, device: i32) -> Option<&CachingAllocator<OffsetDevice>> {
            self.slot(device).and_then(OnceLock::get)
        }
        fn device_name(&self, _: &CachingAllocator<OffsetDevice>) -> String {
            "simulated".into()
        }
    }

    fn abi() -> Abi<SimRegistry> {
        Abi::new(SimRegistry::new())
    }

    /// Once a device is in use, allocations and frees find its allocator
    /// through `Registry::existing` alone: the slow lookup (which for CUDA
    /// may create an allocator, and once called the driver on every call)
    /// is not on their path.
    #[test]
    fn calls_after_the_first_skip_the_slow_lookup() {
        let abi = abi();
        let p = abi.alloc(4096, 1, 0).unwrap();
        let gets = abi.registry.gets.load(Ordering::Relaxed);
        assert!(gets >= 1, "the first allocation creates the allocator");
        for size in [512, 1 << 20, 3 << 20] {
            let q = abi.alloc(size, 1, 0).unwrap();
            abi.free(q, size, 1).unwrap();
        }
        abi.free(p, 4096, 1).unwrap();
        assert_eq!(abi.registry.gets.load(Ordering::Relaxed), gets);
        // A device never used: still an error, not a lookup that creates.
        assert!(matches!(
            abi.free(p, 4096, 0),
            Err(AbiError::ForeignPointer(_))
        ));
        assert!(abi.alloc(512, 7, 0).is_err());
    }

    #[test]
    fn size_zero_is_null_without_error() {
        let abi = abi();
        clear_error();
        assert_eq!(abi.alloc(0, 0, 0).unwrap(), 0);
        assert_eq!(abi.alloc_or_raise(0, 0, 0), 0);
        assert_eq!(last_error(), None);
        // Size 0 does not even create the allocator.
        assert!(abi.devices_in_use().is_empty());
        // Its free (NULL, 0) is a no-op.
        abi.free(0, 0, 0).unwrap();
    }

    #[test]
    fn negative_size_is_an_error() {
        let abi = abi();
        assert!(matches!(
            abi.alloc(-5, 0, 0),
            Err(AbiError::NegativeSize(-5))
        ));
        clear_error();
        assert_eq!(abi.alloc_or_raise(-1, 0, 0), 0);
        assert!(last_error()
            .unwrap()
            .contains("negative allocation size -1"));
    }

    #[test]
    fn unknown_device_is_an_error() {
        let abi = abi();
        for d in [-1, 2, MAX_DEVICES, i32::MAX, i32::MIN] {
            assert!(
                matches!(abi.alloc(512, d, 0), Err(AbiError::Device { device, .. }) if device == d),
                "device {d}"
            );
            assert!(matches!(abi.empty_cache(d), Err(AbiError::Device { .. })));
            assert!(matches!(abi.stats_json(d), Err(AbiError::Device { .. })));
            assert!(abi.free(0x1000, 512, d).is_err());
        }
        clear_error();
        assert_eq!(abi.alloc_or_raise(512, 7, 0), 0);
        assert!(last_error().unwrap().contains("device 7 unusable"));
    }

    #[test]
    fn alloc_free_round_trip_per_device_and_stream() {
        let abi = abi();
        let p = abi.alloc(1000, 0, 0).unwrap();
        let q = abi.alloc(1000, 1, 7).unwrap();
        assert_ne!(p, 0);
        assert_ne!(q, 0);
        assert_eq!(abi.devices_in_use(), vec![0, 1]);
        // Freed on the wrong device: that allocator does not know it.
        assert!(matches!(abi.free(p, 1000, 1), Err(AbiError::ForeignPointer(x)) if x == p));
        abi.free(p, 1000, 0).unwrap();
        abi.free(q, 1000, 1).unwrap();
        // Reused from the cache.
        assert_eq!(abi.alloc(1000, 0, 0).unwrap(), p);
    }

    #[test]
    fn bad_frees_are_errors_not_ub() {
        let abi = abi();
        let p = abi.alloc(4096, 0, 0).unwrap();
        // NULL with a size.
        assert!(matches!(abi.free(0, 16, 0), Err(AbiError::NullPointer(_))));
        // Foreign pointer.
        assert!(matches!(
            abi.free(0xdead_0000, 16, 0),
            Err(AbiError::ForeignPointer(_))
        ));
        // Interior pointer.
        assert!(matches!(
            abi.free(p + 512, 16, 0),
            Err(AbiError::Alloc {
                error: AllocError::InteriorPointer { .. },
                ..
            })
        ));
        abi.free(p, 4096, 0).unwrap();
        // Double free.
        assert!(matches!(
            abi.free(p, 4096, 0),
            Err(AbiError::Alloc {
                error: AllocError::DoubleFree(_),
                ..
            })
        ));
        // A device never used: foreign, and no allocator is created for it.
        assert!(matches!(
            abi.free(p, 4096, 1),
            Err(AbiError::ForeignPointer(_))
        ));
        assert_eq!(abi.devices_in_use(), vec![0]);
        // The allocator still works.
        let q = abi.alloc(4096, 0, 0).unwrap();
        abi.free(q, 4096, 0).unwrap();
    }

    #[test]
    fn guarded_records_errors_and_panics() {
        clear_error();
        let before = error_count();
        let r: Result<(), String> = guarded(|| Err(AbiError::NullPointer("free")));
        assert_eq!(r.unwrap_err(), "cachealloc: free of a NULL pointer");
        assert_eq!(last_error().unwrap(), "cachealloc: free of a NULL pointer");
        let r: Result<(), String> = guarded(|| panic!("boom"));
        assert!(r.unwrap_err().contains("boom"));
        assert!(last_error().unwrap().contains("panic"));
        assert!(error_count() >= before + 2);
        clear_error();
        assert_eq!(last_error(), None);
    }

    #[test]
    fn record_stream_finds_the_owning_device() {
        let abi = abi();
        let p = abi.alloc(1 << 20, 0, 1).unwrap();
        let q = abi.alloc(1 << 20, 1, 1).unwrap();
        abi.record_stream(q, 2).unwrap();
        abi.record_stream(p, 3).unwrap();
        assert!(matches!(
            abi.record_stream(0, 2),
            Err(AbiError::NullPointer(_))
        ));
        assert!(matches!(
            abi.record_stream(0x1234_5000, 2),
            Err(AbiError::ForeignPointer(_))
        ));
        let snap: Value = serde_json::from_str(&abi.snapshot_json(1).unwrap()).unwrap();
        let blocks = snap["segments"][0]["blocks"].as_array().unwrap();
        assert!(blocks
            .iter()
            .any(|b| b["address"] == q && b["stream_uses"] == json!([2])));
        abi.free(p, 1 << 20, 0).unwrap();
        abi.free(q, 1 << 20, 1).unwrap();
    }

    #[test]
    fn init_checks_the_device_count() {
        let abi = abi();
        for bad in [-5, -1, MAX_DEVICES + 1, i32::MAX] {
            let e = abi.init(bad).unwrap_err();
            assert!(matches!(e, AbiError::BadDeviceCount(n) if n == bad));
            assert!(
                e.to_string().contains(&format!("device count {bad}")),
                "{e}"
            );
        }
        assert_eq!(abi.device_count(), -1, "a refused count is not remembered");
        abi.init(2).unwrap();
        assert_eq!(abi.device_count(), 2);
        let e = AbiError::Config("bad value".into()).to_string();
        assert!(!e.contains("device -1"), "{e}");
    }

    /// A size other than the requested one is reported; the block is freed
    /// all the same (a second free is an error). Through the bins, a slab,
    /// and a thread cache's fast path.
    #[test]
    fn free_reports_a_size_mismatch() {
        let abi = abi();
        for size in [1000, 3 << 20, 100 << 20] {
            for _ in 0..3 {
                // (Later rounds may be served by the thread cache's fast path.)
                let p = abi.alloc(size as isize, 0, 0).unwrap();
                let e = abi.free(p, size as isize + 512, 0).unwrap_err();
                assert!(
                    matches!(e, AbiError::SizeMismatch { requested, .. } if requested == size),
                    "{e}"
                );
                assert!(e.to_string().contains("freed all the same"), "{e}");
                assert!(abi.free(p, size as isize, 0).is_err(), "it was freed");
                let q = abi.alloc(size as isize, 0, 0).unwrap();
                abi.free(q, size as isize, 0).unwrap();
            }
        }
    }

    #[test]
    fn memory_fraction_caps_and_validates() {
        let abi = abi();
        for bad in [-0.1, 0.0, -0.0, 1.5, f64::NAN, f64::INFINITY] {
            assert!(matches!(
                abi.set_memory_fraction(bad, 0),
                Err(AbiError::BadFraction(_))
            ));
        }
        assert!(abi.set_memory_fraction(0.5, 9).is_err());
        abi.set_memory_fraction(0.25, 0).unwrap();
        // 1 GiB device, capped at 256 MiB: 300 MiB fails with the explaining message.
        let e = abi.alloc(300 << 20, 0, 0).unwrap_err();
        assert!(e.to_string().contains("out of memory"), "{e}");
        assert!(abi.alloc(200 << 20, 0, 0).is_ok());
        let stats: Value = serde_json::from_str(&abi.stats_json(0).unwrap()).unwrap();
        assert_eq!(stats["num_ooms"], 1);
    }

    #[test]
    fn stats_fragmentation_snapshot_info_empty_cache_reset() {
        let abi = abi();
        let ps: Vec<u64> = (1..=8).map(|i| abi.alloc(i << 20, 0, 0).unwrap()).collect();
        let small = abi.alloc(1000, 1, 0).unwrap();
        let stats: Value = serde_json::from_str(&abi.stats_json(0).unwrap()).unwrap();
        assert_eq!(stats["allocation.all.current"], 8);
        assert_eq!(stats["max_split_size"], -1);
        assert!(stats["reserved_bytes.all.peak"].as_i64().unwrap() >= 36 << 20);
        let frag: Value = serde_json::from_str(&abi.fragmentation_json(0).unwrap()).unwrap();
        assert!(frag["reserved"].as_u64().unwrap() >= frag["allocated"].as_u64().unwrap());
        assert!(abi
            .fragmentation_text(0)
            .unwrap()
            .contains("fragmentation report"));
        let snap: Value = serde_json::from_str(&abi.snapshot_json(0).unwrap()).unwrap();
        assert!(!snap["segments"].as_array().unwrap().is_empty());
        let info: Value = serde_json::from_str(&abi.info_json(0).unwrap()).unwrap();
        assert_eq!(info["device_name"], "simulated");
        assert!(info["config"].as_str().unwrap().starts_with("default"));
        assert_eq!(info["expandable"], false);
        for (i, p) in ps.iter().enumerate() {
            abi.free(*p, ((i + 1) << 20) as isize, 0).unwrap();
        }
        assert!(abi.empty_cache(0).unwrap() >= 36 << 20);
        abi.free(small, 1000, 1).unwrap();
        // reset = empty_cache on every device in use: device 1's small segment goes.
        assert_eq!(abi.reset().unwrap(), 2 << 20);
        let stats: Value = serde_json::from_str(&abi.stats_json(1).unwrap()).unwrap();
        assert_eq!(stats["reserved_bytes.all.current"], 0);
        abi.reset_peak_stats(1).unwrap();
        let stats: Value = serde_json::from_str(&abi.stats_json(1).unwrap()).unwrap();
        assert_eq!(stats["reserved_bytes.all.peak"], 0);
    }

    #[test]
    fn trace_recording_start_stop() {
        let abi = abi();
        let dir = std::env::temp_dir().join(format!("cachealloc-capi-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.trace");
        let path = path.to_str().unwrap();
        let live = abi.alloc(4096, 0, 0).unwrap();
        abi.record_trace_start(0, path).unwrap();
        assert!(matches!(
            abi.record_trace_start(0, path),
            Err(AbiError::Trace(_))
        ));
        let p = abi.alloc(1000, 0, 0).unwrap();
        abi.free(p, 1000, 0).unwrap();
        abi.free(live, 4096, 0).unwrap();
        assert_eq!(abi.record_trace_stop(0).unwrap(), 4);
        assert!(matches!(abi.record_trace_stop(0), Err(AbiError::Trace(_))));
        let events = crate::trace_file::read_all(path).unwrap();
        assert_eq!(events.len(), 4);
        assert!(matches!(
            abi.record_trace_start(0, "/nonexistent-dir/x/y.trace"),
            Err(AbiError::Trace(_))
        ));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn init_remembers_the_device_count() {
        let abi = abi();
        assert_eq!(abi.device_count(), -1);
        abi.init(2).unwrap();
        assert_eq!(abi.device_count(), 2);
        assert!(abi.devices_in_use().is_empty(), "init creates no allocator");
    }

    #[test]
    fn c_strings_replace_nul_bytes() {
        let p = into_c_string("a\0b".to_string());
        assert!(!p.is_null());
        // SAFETY: `p` came from `into_c_string` just above and is freed once.
        let s = unsafe { CString::from_raw(p) };
        assert_eq!(s.to_str().unwrap(), "a b");
        assert!(c_string_result(Err("x".into())).is_null());
    }

    static HANDLED: Mutex<Option<(String, String, u32, String)>> = Mutex::new(None);

    unsafe extern "C-unwind" fn record_handler(
        func: *const c_char,
        file: *const c_char,
        line: u32,
        msg: *const c_char,
    ) {
        let s = |p: *const c_char| {
            // SAFETY: the ABI passes NUL-terminated strings alive for the call.
            unsafe { std::ffi::CStr::from_ptr(p) }
                .to_string_lossy()
                .into_owned()
        };
        *HANDLED.lock() = Some((s(func), s(file), line, s(msg)));
    }

    unsafe extern "C-unwind" fn throwing_handler(
        _: *const c_char,
        _: *const c_char,
        _: u32,
        msg: *const c_char,
    ) {
        // SAFETY: as above.
        let m = unsafe { std::ffi::CStr::from_ptr(msg) }
            .to_string_lossy()
            .into_owned();
        // Stands for a C++ `throw`: unwinds through `alloc_or_raise`.
        std::panic::resume_unwind(Box::new(m));
    }

    #[test]
    fn oom_handler_gets_the_message_and_may_unwind() {
        let abi = abi();
        abi.set_memory_fraction(0.1, 0).unwrap();
        abi.set_oom_handler(Some(record_handler));
        // Success and size 0 do not call it.
        let p = abi.alloc_or_raise(1 << 20, 0, 0);
        assert_ne!(p, 0);
        assert_eq!(abi.alloc_or_raise(0, 0, 0), 0);
        assert!(HANDLED.lock().is_none());
        // A handler that returns: NULL as without one.
        assert_eq!(abi.alloc_or_raise(512 << 20, 0, 0), 0);
        let (func, file, line, msg) = HANDLED.lock().take().unwrap();
        assert_eq!(func, "cachealloc_alloc");
        assert_eq!(file, "src/capi.rs");
        assert!(line > 0);
        assert!(msg.contains("out of memory"), "{msg}");
        assert!(msg.contains("capped"), "{msg}");
        // A handler that unwinds: the unwind reaches the caller.
        abi.set_oom_handler(Some(throwing_handler));
        let r = catch_unwind(AssertUnwindSafe(|| abi.alloc_or_raise(512 << 20, 0, 0)));
        let payload = r.unwrap_err();
        assert!(payload
            .downcast_ref::<String>()
            .unwrap()
            .contains("out of memory"));
        // The allocator is intact afterwards.
        abi.set_oom_handler(None);
        abi.free(p, 1 << 20, 0).unwrap();
        let q = abi.alloc_or_raise(1 << 20, 0, 0);
        assert_eq!(q, p);
    }
}
