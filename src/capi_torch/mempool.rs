//! `torch.cuda.MemPool`'s options behind the C++ allocator: a pool whose
//! segments come from the user's allocator (`MemPool(allocator=...)`), a
//! pool that never splits its blocks (`no_split=True`), the fallback of a
//! pool's cached blocks to an allocation that ran out of memory
//! (`use_on_oom=True`), and the memory fraction shared by a device's
//! allocator and its pools (Note [Shared cap] in `cachealloc_core::supply`).
//!
//! The C++ side hands a pool's segment source over as two C functions and
//! a context pointer ([`CacheallocSegmentAlloc`], [`CacheallocSegmentFree`]):
//! its functions call the `CUDAAllocator` given to `MemPool`, catch every
//! C++ exception and report failure by their return value, so that nothing
//! unwinds through Rust. [`FnSource`] is the core's `SegmentSource` over
//! them.

use super::pool_config;
use cachealloc_core::{
    AllocError, CachingAllocator, CapGroup, Config, Device, DeviceError, DevicePtr, SegmentSource,
    StreamId,
};
use std::ffi::{c_int, c_void};

/// A segment source's allocation function: a segment of `size` bytes on
/// `device` for `stream` (a `cudaStream_t`), or NULL when it has none (out
/// of memory, or any failure). `ctx` is the context given with it. It must
/// not unwind (a C++ implementation catches every exception).
pub type CacheallocSegmentAlloc = Option<
    unsafe extern "C" fn(
        ctx: *mut c_void,
        size: usize,
        device: c_int,
        stream: *mut c_void,
    ) -> *mut c_void,
>;

/// A segment source's free function: gives back `ptr`, a segment of `size`
/// bytes its allocation function returned for `device` and `stream`; 0 on
/// success, anything else on failure (the segment is then kept). It must
/// not unwind.
pub type CacheallocSegmentFree = Option<
    unsafe extern "C" fn(
        ctx: *mut c_void,
        ptr: *mut c_void,
        size: usize,
        device: c_int,
        stream: *mut c_void,
    ) -> c_int,
>;

/// The core's [`SegmentSource`] over a pair of C functions and their
/// context: what `cachealloc_torch_pool_new_sourced` gives a pool.
pub struct FnSource {
    alloc: unsafe extern "C" fn(*mut c_void, usize, c_int, *mut c_void) -> *mut c_void,
    free: unsafe extern "C" fn(*mut c_void, *mut c_void, usize, c_int, *mut c_void) -> c_int,
    ctx: *mut c_void,
    device: c_int,
}

// SAFETY: `FnSource::new`'s contract: the functions may be called with
// `ctx` from any thread, one call at a time per pool (the pool's lock is
// held around each), until the pool is dropped.
unsafe impl Send for FnSource {}
// SAFETY: as for `Send`; `&FnSource` only reads the pointers.
unsafe impl Sync for FnSource {}

impl FnSource {
    /// The source of `device`'s segments through `alloc` and `free` with
    /// `ctx`; `None` when either function is NULL.
    ///
    /// # Safety
    /// `alloc` and `free` follow [`CacheallocSegmentAlloc`] and
    /// [`CacheallocSegmentFree`]; they may be called with `ctx` from any
    /// thread until the source is dropped.
    pub unsafe fn new(
        alloc: CacheallocSegmentAlloc,
        free: CacheallocSegmentFree,
        ctx: *mut c_void,
        device: c_int,
    ) -> Option<FnSource> {
        Some(FnSource {
            alloc: alloc?,
            free: free?,
            ctx,
            device,
        })
    }
}

/// A stream id as the `cudaStream_t` it came from.
fn stream_ptr(stream: StreamId) -> *mut c_void {
    stream.0 as usize as *mut c_void
}

impl SegmentSource for FnSource {
    fn allocate(&self, bytes: u64, stream: StreamId) -> Result<DevicePtr, DeviceError> {
        let size = usize::try_from(bytes).map_err(|_| DeviceError::OutOfMemory)?;
        // SAFETY: the contract of `FnSource::new`.
        let p = unsafe { (self.alloc)(self.ctx, size, self.device, stream_ptr(stream)) };
        if p.is_null() {
            Err(DeviceError::OutOfMemory)
        } else {
            Ok(DevicePtr(p as usize as u64))
        }
    }

    fn free(&self, ptr: DevicePtr, bytes: u64, stream: StreamId) -> Result<(), DeviceError> {
        let size = usize::try_from(bytes).map_err(|_| DeviceError::InvalidAddress(ptr))?;
        let p = ptr.0 as usize as *mut c_void;
        // SAFETY: the contract of `FnSource::new`; `ptr` came from `alloc`.
        match unsafe { (self.free)(self.ctx, p, size, self.device, stream_ptr(stream)) } {
            0 => Ok(()),
            code => Err(DeviceError::Driver {
                name: format!("the MemPool allocator's free function failed ({code})"),
                call: "segment source free",
            }),
        }
    }
}

/// A private pool's allocator on `device` with the device's `config`
/// ([`pool_config`]), its segments from `source` when given; it and the
/// device's allocator `main` join `group`, `main` leading (its cap, the
/// memory fraction, is the group's: Note [Shared cap]).
pub fn new_pool<D: Device>(
    device: D,
    config: Config,
    main: &CachingAllocator<D>,
    group: &CapGroup,
    source: Option<Box<dyn SegmentSource>>,
) -> CachingAllocator<D> {
    let config = pool_config(config);
    let pool = match source {
        None => CachingAllocator::new(device, config),
        Some(s) => CachingAllocator::with_segment_source(device, config, s),
    };
    main.join_cap_group(group, true);
    pool.join_cap_group(group, false);
    pool
}

/// What [`alloc_cached`] gave: an address, none cached (no error), or an error.
#[derive(Debug, PartialEq, Eq)]
pub enum Cached {
    /// The address.
    Ok(u64),
    /// No cached block fits.
    None,
    /// Misuse or a device failure.
    Error(String),
}

/// `size` bytes for `stream` from `a`'s cached blocks only
/// ([`CachingAllocator::malloc_cached`]).
pub fn alloc_cached<D: Device>(a: &CachingAllocator<D>, size: u64, stream: u64) -> Cached {
    match a.malloc_cached(size, StreamId(stream)) {
        Ok(Some(p)) => Cached::Ok(p.0),
        Ok(None) | Err(AllocError::SizeTooLarge(_)) => Cached::None,
        Err(e) => Cached::Error(e.to_string()),
    }
}

#[cfg(feature = "cuda")]
pub use exports::*;

#[cfg(feature = "cuda")]
mod exports {
    //! The exported functions over [`crate::cuda`]'s allocators.

    use super::*;
    use crate::capi_torch::exports::{guard, handle, Alloc, POOLS};
    use crate::capi_torch::set_error;
    use crate::cuda::{CudaDevice, CudaError};
    use std::sync::OnceLock;

    /// The cap group of each device: its allocator and its private pools.
    static GROUPS: [OnceLock<CapGroup>; crate::capi::MAX_DEVICES as usize] =
        [const { OnceLock::new() }; crate::capi::MAX_DEVICES as usize];

    /// A new private pool allocator on `device` (see `cachealloc_torch_pool_new`),
    /// its segments from `source` when given; registered as a live pool; NULL
    /// with the last error set when it cannot be made.
    pub(crate) fn pool_on(device: c_int, source: Option<Box<dyn SegmentSource>>) -> *mut c_void {
        let made = (|| {
            let config = crate::cuda::config_from_env()?;
            let main = crate::cuda::allocator(device)?;
            let group = usize::try_from(device)
                .ok()
                .and_then(|d| GROUPS.get(d))
                .ok_or(CudaError::NoSuchDevice {
                    ordinal: device,
                    count: crate::capi::MAX_DEVICES,
                })?
                .get_or_init(CapGroup::new);
            let pool = new_pool(CudaDevice::new(device)?, config, main, group, source);
            Ok::<_, CudaError>(pool)
        })();
        match made {
            Ok(a) => {
                let p = Box::into_raw(Box::new(a));
                POOLS.lock().push(p as usize);
                p as *mut c_void
            }
            Err(e) => {
                set_error(&format!("cachealloc: private pool on device {device}: {e}"));
                std::ptr::null_mut()
            }
        }
    }

    /// A new private pool allocator on `device` whose plain segments come
    /// from `alloc` and go back through `free`, called with `ctx` (PyTorch's
    /// `MemPool(allocator=...)`), or NULL (last error set; also when `alloc`
    /// or `free` is NULL). Otherwise as `cachealloc_torch_pool_new`; drop it
    /// with `cachealloc_torch_pool_drop`, which gives every cached segment
    /// back through `free`.
    ///
    /// # Safety
    /// `alloc` and `free` follow the contracts of their types and may be
    /// called with `ctx` from any thread (one call at a time) until the pool
    /// is dropped; they must not call into this pool.
    #[no_mangle]
    pub unsafe extern "C" fn cachealloc_torch_pool_new_sourced(
        device: c_int,
        alloc: CacheallocSegmentAlloc,
        free: CacheallocSegmentFree,
        ctx: *mut c_void,
    ) -> *mut c_void {
        guard(std::ptr::null_mut(), || {
            // SAFETY: forwarded contract.
            let Some(source) = (unsafe { FnSource::new(alloc, free, ctx, device) }) else {
                set_error("cachealloc: pool_new_sourced without an allocation or free function");
                return std::ptr::null_mut();
            };
            pool_on(device, Some(Box::new(source)))
        })
    }

    /// Makes the allocator `h` hand its blocks out whole, never split
    /// (`no_split` non-zero; PyTorch's `MemPool(no_split=True)`), or split
    /// them again (0): 0, or -1.
    ///
    /// # Safety
    /// `h` is NULL or a live handle (`cachealloc_torch_device`, or a pool
    /// handle not yet dropped).
    #[no_mangle]
    pub unsafe extern "C" fn cachealloc_torch_pool_set_no_split(
        h: *const c_void,
        no_split: c_int,
    ) -> c_int {
        guard(-1, || {
            // SAFETY: forwarded contract.
            let Some(a): Option<&Alloc> = (unsafe { handle(h) }) else {
                return -1;
            };
            a.set_no_split(no_split != 0);
            0
        })
    }

    /// `size` bytes for `stream` from the blocks `h` has cached, without
    /// asking for a segment or releasing one (a `MemPool(use_on_oom=True)`
    /// lending its memory to an allocation that ran out). NULL with `*kind`
    /// 1 when no cached block fits, or 2 on misuse (last error set); `*kind`
    /// 0 with the address. The block is freed with `cachealloc_torch_free`
    /// on `h`.
    ///
    /// # Safety
    /// `h` is NULL or a live handle; `kind` is NULL or points at a writable int.
    #[no_mangle]
    pub unsafe extern "C" fn cachealloc_torch_alloc_cached(
        h: *const c_void,
        size: usize,
        stream: *mut c_void,
        kind: *mut c_int,
    ) -> *mut c_void {
        let (ptr, code) = guard((0, 2), || {
            // SAFETY: forwarded contract.
            let Some(a): Option<&Alloc> = (unsafe { handle(h) }) else {
                return (0, 2);
            };
            if size == 0 {
                return (0, 1);
            }
            let stream = crate::cuda::driver::ffi_stream(stream).0;
            match alloc_cached(a, size as u64, stream) {
                Cached::Ok(p) => (p, 0),
                Cached::None => (0, 1),
                Cached::Error(m) => {
                    set_error(&m);
                    (0, 2)
                }
            }
        });
        if !kind.is_null() {
            // SAFETY: non-null and writable per the contract.
            unsafe { *kind = code };
        }
        ptr as usize as *mut c_void
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cachealloc_core::{MemoryCap, SimulatedDevice};
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Mutex;

    const MIB: u64 = 1 << 20;

    /// What the C functions below saw: (ptr, size, device, stream) per call.
    #[derive(Default)]
    struct Seen {
        allocs: Mutex<Vec<(u64, usize, c_int, u64)>>,
        frees: Mutex<Vec<(u64, usize, c_int, u64)>>,
        next: AtomicUsize,
        refuse_above: AtomicUsize,
    }

    /// A C allocation function over `Seen`: fake addresses 1 GiB apart.
    unsafe extern "C" fn c_alloc(
        ctx: *mut c_void,
        size: usize,
        device: c_int,
        stream: *mut c_void,
    ) -> *mut c_void {
        // SAFETY: the tests pass a `&Seen` that outlives the pool.
        let seen = unsafe { &*(ctx as *const Seen) };
        if size > seen.refuse_above.load(Ordering::Relaxed) {
            return std::ptr::null_mut();
        }
        let p = (seen.next.fetch_add(1, Ordering::Relaxed) + 1) << 30;
        seen.allocs
            .lock()
            .unwrap()
            .push((p as u64, size, device, stream as usize as u64));
        p as *mut c_void
    }

    unsafe extern "C" fn c_free(
        ctx: *mut c_void,
        ptr: *mut c_void,
        size: usize,
        device: c_int,
        stream: *mut c_void,
    ) -> c_int {
        // SAFETY: as in `c_alloc`.
        let seen = unsafe { &*(ctx as *const Seen) };
        seen.frees.lock().unwrap().push((
            ptr as usize as u64,
            size,
            device,
            stream as usize as u64,
        ));
        0
    }

    unsafe extern "C" fn c_free_fails(
        _: *mut c_void,
        _: *mut c_void,
        _: usize,
        _: c_int,
        _: *mut c_void,
    ) -> c_int {
        -1
    }

    fn fn_source(seen: &Seen, free: CacheallocSegmentFree) -> Box<dyn SegmentSource> {
        // SAFETY: the functions follow the contracts; `seen` outlives the
        // pools of every test.
        let s =
            unsafe { FnSource::new(Some(c_alloc), free, seen as *const Seen as *mut c_void, 3) };
        Box::new(s.expect("both functions given"))
    }

    #[test]
    fn a_source_needs_both_functions() {
        // SAFETY: nothing is called.
        unsafe {
            assert!(FnSource::new(None, Some(c_free), std::ptr::null_mut(), 0).is_none());
            assert!(FnSource::new(Some(c_alloc), None, std::ptr::null_mut(), 0).is_none());
        }
    }

    /// The C functions get every segment with the pool's device and the
    /// request's stream, and get each back with the same size and stream.
    #[test]
    fn a_pool_with_c_functions_gets_and_returns_its_segments_through_them() {
        let seen = Seen {
            refuse_above: AtomicUsize::new(usize::MAX),
            ..Seen::default()
        };
        let dev = SimulatedDevice::new(1 << 30);
        let main = CachingAllocator::new(dev.clone(), Config::default());
        let group = CapGroup::new();
        let pool = new_pool(
            dev.clone(),
            Config::default(),
            &main,
            &group,
            Some(fn_source(&seen, Some(c_free))),
        );
        assert!(pool.has_segment_source() && !pool.is_expandable());
        let a = pool.malloc(MIB, StreamId(0x77)).unwrap();
        let b = pool.malloc(3 * MIB, StreamId(0x77)).unwrap();
        assert_eq!(
            *seen.allocs.lock().unwrap(),
            [(1 << 30, 2 << 20, 3, 0x77), (2 << 30, 20 << 20, 3, 0x77)]
        );
        assert_eq!((a.0, b.0), (1 << 30, 2 << 30));
        assert_eq!(dev.counters().allocs, 0);
        assert_eq!(group.reserved(), 22 * MIB);
        pool.free(a).unwrap();
        pool.free(b).unwrap();
        pool.empty_cache().unwrap();
        let mut frees = seen.frees.lock().unwrap().clone();
        frees.sort();
        assert_eq!(frees, *seen.allocs.lock().unwrap());
        assert_eq!(group.reserved(), 0);
    }

    #[test]
    fn a_null_from_the_allocation_function_is_out_of_memory_and_a_failed_free_keeps_the_segment() {
        let seen = Seen {
            refuse_above: AtomicUsize::new(4 << 20),
            ..Seen::default()
        };
        let dev = SimulatedDevice::new(1 << 30);
        let main = CachingAllocator::new(dev.clone(), Config::default());
        let group = CapGroup::new();
        let pool = new_pool(
            dev,
            Config::default(),
            &main,
            &group,
            Some(fn_source(&seen, Some(c_free_fails))),
        );
        let p = pool.malloc(MIB, StreamId(0)).unwrap();
        assert!(matches!(
            alloc_outcome(&pool, 30 * MIB),
            super::super::AllocOutcome::OutOfMemory(_)
        ));
        pool.free(p).unwrap();
        assert!(pool.empty_cache().is_err());
        assert_eq!(pool.stats().reserved_bytes.all().current, 2 * MIB);
    }

    fn alloc_outcome<D: Device>(a: &CachingAllocator<D>, size: u64) -> super::super::AllocOutcome {
        super::super::alloc(a, size, 0)
    }

    /// A pool of the device counts against the device's memory fraction,
    /// set on the device's allocator before or after the pool is made, and
    /// serves its cached blocks only.
    #[test]
    fn pools_share_the_devices_fraction_and_lend_only_cached_blocks() {
        let dev = SimulatedDevice::new(1 << 30);
        let main = CachingAllocator::new(dev.clone(), Config::default());
        main.set_memory_cap(Some(MemoryCap::Bytes(100 * MIB)))
            .unwrap();
        let group = CapGroup::new();
        let pool = new_pool(dev.clone(), Config::default(), &main, &group, None);
        let p = pool.malloc(60 * MIB, StreamId(0)).unwrap();
        assert_eq!(main.effective_cap(), Some(40 * MIB));
        assert!(main.malloc(50 * MIB, StreamId(0)).is_err());
        main.set_memory_cap(Some(MemoryCap::Bytes(70 * MIB)))
            .unwrap();
        assert!(pool.malloc(20 * MIB, StreamId(0)).is_err());
        pool.free(p).unwrap();
        assert_eq!(alloc_cached(&pool, 80 * MIB, 0), Cached::None);
        assert_eq!(
            alloc_cached(&pool, 50 * MIB, 1),
            Cached::None,
            "another stream"
        );
        let Cached::Ok(q) = alloc_cached(&pool, 50 * MIB, 0) else {
            panic!("the cached block")
        };
        assert_eq!(q, p.0);
        assert_eq!(alloc_cached(&pool, u64::MAX, 0), Cached::None);
        assert!(matches!(alloc_cached(&pool, 0, 0), Cached::Error(_)));
        pool.free(DevicePtr(q)).unwrap();
    }
}
