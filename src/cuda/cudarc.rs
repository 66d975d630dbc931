//! Buffers from the caching allocator for code built on [`cudarc`] (feature `cudarc`).
//!
//! [`CachedSlice<T>`] implements cudarc's [`DeviceSlice`], [`DevicePtr`] and
//! [`DevicePtrMut`], and pushes as a kernel argument, so it goes wherever a
//! `CudaSlice<T>` goes: [`LaunchArgs::arg`](cudarc::driver::LaunchArgs),
//! `CudaStream::memcpy_htod`/`memcpy_dtoh`/`memcpy_dtod`/`memset_zeros`, and
//! cuBLAS calls (`CudaBlas::gemm`). [`CachedStream`] allocates them with the
//! names cudarc's `CudaStream` uses (`alloc_zeros`, `clone_htod`, …), so that
//! porting is a change of receiver.
//!
//! Both crates work on the device's primary context, so pointers from either
//! are valid for the other; a `cudarc::driver::CudaStream` is the
//! allocation stream.
//!
//! ```no_run
//! use cachealloc::cuda::cudarc::CachedStream;
//! use cudarc::driver::CudaContext;
//!
//! let ctx = CudaContext::new(0)?;
//! let stream = ctx.default_stream();
//! let cache = CachedStream::new(&stream)?;
//! let x = cache.clone_htod(&[1.0f32, 2.0, 3.0])?;
//! let mut y = cache.alloc_zeros::<f32>(3)?;
//! stream.memcpy_dtod(&x, &mut y)?; // cudarc's own copy, on cachealloc memory
//! assert_eq!(y.to_vec()?, [1.0, 2.0, 3.0]);
//! drop(x); // back to the cache, reusable at once on `stream`
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # Streams
//!
//! A buffer belongs to the stream it was allocated on. Its use on another
//! stream through [`DevicePtr::device_ptr`] / [`DevicePtrMut::device_ptr_mut`]
//! (which cudarc's copies and cuBLAS call) is ordered for the caller:
//!
//! - the other stream first waits for the work queued on the buffer's stream
//!   so far, and for the last write on a third stream;
//! - the use is recorded (an event, when the guard returned with the pointer
//!   is dropped), and the buffer's own stream waits for it before it next
//!   writes (after a foreign read) or uses (after a foreign write) the buffer;
//! - the allocator is told ([`CachingAllocator::record_stream`]), so the
//!   memory is reused only after that stream's work queued by the free completed.
//!   The free records an event on that stream, so a stream used this way must
//!   outlive the buffer (cudarc lends it by reference, so the buffer cannot
//!   keep it alive).
//!
//! The event part follows cudarc's own rule: it is on while the context
//! manages stream synchronisation (`CudaContext::is_managing_stream_synchronization`,
//! on by default once a second stream exists). Like a `CudaSlice`, a buffer
//! keeps one read event: after reads on two other streams, a write on the
//! buffer's stream waits for the later one only.
//!
//! A kernel argument cannot see the launch's stream (cudarc's `LaunchArgs`
//! keeps it private), so `.arg(&buf)` is ordered only on the buffer's own
//! stream. To launch on another stream, pass the pointer instead:
//! `let (p, _guard) = buf.device_ptr(&other); builder.arg(&p)`, and keep the
//! guard until after `launch`.
//!
//! # Element types
//!
//! Host copies, zero fills and fills need `T: bytemuck::Pod` (any bit pattern
//! is a valid `T`, so reading device bytes back is sound); with the feature
//! `half`, `half::f16` and `half::bf16` are `Pod` and cudarc `DeviceRepr`.

use super::buffer::fill_pod;
use super::device::CudaDevice;
use super::driver::{self, check};
use super::CudaError;
use ::cudarc::driver::sys::CUdeviceptr;
use ::cudarc::driver::{
    CudaEvent, CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, DriverError, LaunchArgs,
    PushKernelArg, SyncOnDrop,
};
use bytemuck::{Pod, Zeroable};
use cachealloc_core::{AllocError, CachingAllocator, DeviceError, DevicePtr as RawPtr, StreamId};
use std::fmt;
use std::marker::PhantomData;
use std::mem::size_of;
use std::ops::{Bound, RangeBounds};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

/// A cudarc driver error as this crate's error (the CUresult's name and the call).
fn driver_error(e: DriverError, call: &'static str) -> CudaError {
    CudaError::Device(
        check(e.0 as i32, call)
            .err()
            .unwrap_or_else(|| DeviceError::Driver {
                name: format!("{e:?}"),
                call,
            }),
    )
}

/// The allocator's stream id of a cudarc stream (its `CUstream` handle),
/// registered as a live stream the first time it is seen.
#[inline]
fn stream_id(stream: &CudaStream) -> StreamId {
    let id = StreamId(stream.cu_stream() as usize as u64);
    if !driver::is_registered_stream(id) {
        register(id);
    }
    id
}

#[cold]
fn register(id: StreamId) {
    // SAFETY: `id` is the handle of a cudarc stream borrowed by the caller,
    // so it is live now. A buffer's own stream is kept alive by the `Arc`
    // its `CachedStream` / `CachedSlice` holds. A foreign stream given to
    // `device_ptr` is only borrowed: the allocator records an event on it
    // when the buffer is freed, so such a stream must outlive the buffers it
    // used (the module documentation says so; cudarc gives no `Arc` here to
    // keep it alive).
    unsafe { driver::register_stream(id) };
}

/// The caching allocator of a cudarc stream's device, with that stream as
/// the allocation stream: cudarc's allocation calls, served from the cache.
#[derive(Clone)]
pub struct CachedStream {
    alloc: &'static CachingAllocator<CudaDevice>,
    stream: Arc<CudaStream>,
}

impl fmt::Debug for CachedStream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CachedStream")
            .field("device", &self.alloc.device().ordinal())
            .field("stream", &stream_id(&self.stream))
            .finish()
    }
}

impl CachedStream {
    /// The process-wide allocator of the stream's device
    /// ([`super::allocator`], configured from `CACHEALLOC_CONF`) on `stream`.
    ///
    /// The stream must belong to the device's primary context (what
    /// `CudaContext::new` gives); other contexts are refused.
    pub fn new(stream: &Arc<CudaStream>) -> Result<CachedStream, CudaError> {
        let ordinal = i32::try_from(stream.context().ordinal()).unwrap_or(i32::MAX);
        CachedStream::with_allocator(super::allocator(ordinal)?, stream)
    }

    /// `alloc` on `stream`; the stream must be of `alloc`'s device's primary context.
    pub fn with_allocator(
        alloc: &'static CachingAllocator<CudaDevice>,
        stream: &Arc<CudaStream>,
    ) -> Result<CachedStream, CudaError> {
        if stream.context().cu_ctx() as usize != alloc.device().context_handle() {
            return Err(CudaError::Device(DeviceError::Unsupported(
                "a stream of another context than the allocator's device's primary context",
            )));
        }
        Ok(CachedStream {
            alloc,
            stream: stream.clone(),
        })
    }

    /// The allocation stream.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The allocator.
    pub fn allocator(&self) -> &'static CachingAllocator<CudaDevice> {
        self.alloc
    }

    /// `len` values whose contents are whatever the memory held.
    ///
    /// # Safety
    /// The contents must be written before they are read (as with cudarc's
    /// `CudaStream::alloc`): the old bytes need not be valid `T` values.
    pub unsafe fn alloc<T>(&self, len: usize) -> Result<CachedSlice<T>, CudaError> {
        let bytes = len
            .checked_mul(size_of::<T>())
            .ok_or(AllocError::SizeTooLarge(u64::MAX))?;
        let ptr = if bytes == 0 {
            0
        } else {
            self.alloc.malloc(bytes as u64, stream_id(&self.stream))?.0
        };
        Ok(CachedSlice {
            alloc: self.alloc,
            ptr,
            len,
            stream: self.stream.clone(),
            sync: Tracking::default(),
            _values: PhantomData,
        })
    }

    /// `len` zeroed values (the fill is queued on the stream).
    pub fn alloc_zeros<T: Zeroable + Pod>(&self, len: usize) -> Result<CachedSlice<T>, CudaError> {
        // SAFETY: the zero fill is queued on the buffer's stream before any
        // use the caller can queue; zero bytes are a valid T (Zeroable).
        let mut buf = unsafe { self.alloc::<T>(len)? };
        buf.fill(T::zeroed())?;
        Ok(buf)
    }

    /// A buffer holding a copy of `src` (waits for the copy).
    pub fn clone_htod<T: Pod>(&self, src: &[T]) -> Result<CachedSlice<T>, CudaError> {
        // SAFETY: every value is written by the copy before anything reads it.
        let mut buf = unsafe { self.alloc::<T>(src.len())? };
        buf.copy_from_host(src)?;
        Ok(buf)
    }

    /// The values of `src` on the host (waits for the copy).
    pub fn clone_dtoh<T: Pod>(&self, src: &CachedSlice<T>) -> Result<Vec<T>, CudaError> {
        src.to_vec()
    }
}

/// Which other streams touched a buffer, and the events that order them.
/// Events are created on first foreign use only: a buffer used on its own
/// stream alone costs no driver call beyond the allocation.
#[derive(Default)]
struct Tracking {
    /// Recorded on the buffer's stream before a foreign use (covers its work so far).
    own: OnceLock<CudaEvent>,
    /// The last foreign read.
    read: OnceLock<CudaEvent>,
    /// The last foreign write.
    write: OnceLock<CudaEvent>,
    /// A foreign read the buffer's stream has not waited for.
    foreign_read: AtomicBool,
    /// A foreign write the buffer's stream has not waited for.
    foreign_write: AtomicBool,
    /// The allocator could not record a foreign stream: synchronise before freeing.
    sync_on_free: AtomicBool,
}

/// `len` values of `T` in device memory from the caching allocator, for
/// cudarc: the counterpart of `CudaSlice<T>`. Dropping it returns the memory
/// to the cache; the module documentation says how streams are ordered.
pub struct CachedSlice<T> {
    alloc: &'static CachingAllocator<CudaDevice>,
    ptr: CUdeviceptr,
    len: usize,
    stream: Arc<CudaStream>,
    sync: Tracking,
    _values: PhantomData<*const T>,
}

// SAFETY: like cudarc's CudaSlice: the buffer is a device address, a stream
// handle and events, all usable from any thread; the flags are atomics.
unsafe impl<T> Send for CachedSlice<T> {}
// SAFETY: as above; `&self` methods only read the address or make driver
// calls on the buffer's own handles.
unsafe impl<T> Sync for CachedSlice<T> {}

impl<T> fmt::Debug for CachedSlice<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CachedSlice")
            .field("ptr", &RawPtr(self.ptr))
            .field("len", &self.len)
            .field("elem_size", &size_of::<T>())
            .field("stream", &stream_id(&self.stream))
            .finish()
    }
}

impl<T> CachedSlice<T> {
    /// Number of values.
    #[inline]
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer holds no values.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Size in bytes.
    #[inline]
    pub fn num_bytes(&self) -> usize {
        self.len * size_of::<T>()
    }

    /// The device address (`CUdeviceptr`; 0 for an empty buffer). Using it
    /// bypasses the stream ordering of [`DevicePtr::device_ptr`].
    #[inline]
    pub fn as_raw(&self) -> CUdeviceptr {
        self.ptr
    }

    /// The allocator the buffer came from.
    pub fn allocator(&self) -> &'static CachingAllocator<CudaDevice> {
        self.alloc
    }

    /// A read-only view of `range` (cudarc's `CudaSlice::slice`).
    ///
    /// # Panics
    /// If the range is out of bounds, like slicing a Rust slice;
    /// [`CachedSlice::try_slice`] returns `None` instead.
    pub fn slice(&self, range: impl RangeBounds<usize>) -> CachedView<'_, T> {
        self.try_slice(range).expect("range out of bounds")
    }

    /// A read-only view of `range`, or `None` when it is out of bounds.
    pub fn try_slice(&self, range: impl RangeBounds<usize>) -> Option<CachedView<'_, T>> {
        let (start, end) = bounds(range, self.len)?;
        Some(CachedView {
            ptr: self.ptr + (start * size_of::<T>()) as u64,
            len: end - start,
            parent: self,
        })
    }

    /// A writable view of `range` (cudarc's `CudaSlice::slice_mut`).
    ///
    /// # Panics
    /// If the range is out of bounds; [`CachedSlice::try_slice_mut`] returns
    /// `None` instead.
    pub fn slice_mut(&mut self, range: impl RangeBounds<usize>) -> CachedViewMut<'_, T> {
        self.try_slice_mut(range).expect("range out of bounds")
    }

    /// A writable view of `range`, or `None` when it is out of bounds.
    pub fn try_slice_mut(
        &mut self,
        range: impl RangeBounds<usize>,
    ) -> Option<CachedViewMut<'_, T>> {
        let (start, end) = bounds(range, self.len)?;
        Some(CachedViewMut {
            ptr: self.ptr + (start * size_of::<T>()) as u64,
            len: end - start,
            parent: self,
        })
    }

    /// The whole buffer as a read-only view.
    pub fn as_view(&self) -> CachedView<'_, T> {
        self.slice(..)
    }

    /// The whole buffer as a writable view.
    pub fn as_view_mut(&mut self) -> CachedViewMut<'_, T> {
        self.slice_mut(..)
    }

    #[inline]
    fn is_own(&self, stream: &CudaStream) -> bool {
        stream.cu_stream() == self.stream.cu_stream()
    }

    /// Whether cudarc's event tracking is on for this buffer's context.
    #[inline]
    fn tracking(&self) -> bool {
        self.stream.context().is_managing_stream_synchronization()
    }

    /// A read on `stream`: orders it after the writes it must see, and
    /// returns the guard that records it.
    #[inline]
    fn read_on<'a>(&'a self, stream: &'a CudaStream) -> SyncOnDrop<'a> {
        if self.is_own(stream) {
            if self.tracking() && self.sync.foreign_write.load(Ordering::Acquire) {
                self.own_waits_for_write();
            }
            return SyncOnDrop::Record(None);
        }
        self.foreign_use(stream, false)
    }

    /// A write on `stream`: orders it after every earlier use, and returns
    /// the guard that records it.
    #[inline]
    fn write_on<'a>(&'a self, stream: &'a CudaStream) -> SyncOnDrop<'a> {
        if self.is_own(stream) {
            if self.tracking() {
                if self.sync.foreign_write.load(Ordering::Acquire) {
                    self.own_waits_for_write();
                }
                if self.sync.foreign_read.swap(false, Ordering::AcqRel) {
                    if let Some(ev) = self.sync.read.get() {
                        let ctx = self.stream.context();
                        ctx.record_err(self.stream.wait(ev));
                    }
                }
            }
            return SyncOnDrop::Record(None);
        }
        self.foreign_use(stream, true)
    }

    #[cold]
    fn own_waits_for_write(&self) {
        if let Some(ev) = self.sync.write.get() {
            self.stream.context().record_err(self.stream.wait(ev));
        }
        self.sync.foreign_write.store(false, Ordering::Release);
    }

    /// A use on another stream than the buffer's own.
    #[cold]
    #[inline(never)]
    fn foreign_use<'a>(&'a self, stream: &'a CudaStream, write: bool) -> SyncOnDrop<'a> {
        if self.ptr != 0
            && self
                .alloc
                .record_stream(RawPtr(self.ptr), stream_id(stream))
                .is_err()
        {
            self.sync.sync_on_free.store(true, Ordering::Relaxed);
        }
        if !self.tracking() {
            return SyncOnDrop::Record(None);
        }
        let ctx = self.stream.context();
        let Some(own) = event(&self.sync.own, ctx) else {
            return SyncOnDrop::Sync(Some(stream));
        };
        ctx.record_err(own.record(&self.stream));
        ctx.record_err(stream.wait(own));
        if let Some(w) = self.sync.write.get() {
            ctx.record_err(stream.wait(w));
        }
        if write {
            if let Some(r) = self.sync.read.get() {
                ctx.record_err(stream.wait(r));
            }
        }
        let slot = if write {
            &self.sync.write
        } else {
            &self.sync.read
        };
        match event(slot, ctx) {
            Some(ev) => {
                let flag = if write {
                    &self.sync.foreign_write
                } else {
                    &self.sync.foreign_read
                };
                flag.store(true, Ordering::Release);
                SyncOnDrop::Record(Some((ev, stream)))
            }
            // No event to record into: wait for the stream instead.
            None => SyncOnDrop::Sync(Some(stream)),
        }
    }
}

/// The event in `slot`, created on first use; `None` (error noted in the
/// context) if the driver cannot create one.
fn event<'a>(
    slot: &'a OnceLock<CudaEvent>,
    ctx: &Arc<::cudarc::driver::CudaContext>,
) -> Option<&'a CudaEvent> {
    if let Some(ev) = slot.get() {
        return Some(ev);
    }
    match ctx.new_event(None) {
        Ok(ev) => Some(slot.get_or_init(|| ev)),
        Err(e) => {
            ctx.record_err::<()>(Err(e));
            None
        }
    }
}

/// `range` as `(start, end)` within `len`, or `None` if it does not fit.
fn bounds(range: impl RangeBounds<usize>, len: usize) -> Option<(usize, usize)> {
    let start = match range.start_bound() {
        Bound::Included(&s) => s,
        Bound::Excluded(&s) => s.checked_add(1)?,
        Bound::Unbounded => 0,
    };
    let end = match range.end_bound() {
        Bound::Included(&e) => e.checked_add(1)?,
        Bound::Excluded(&e) => e,
        Bound::Unbounded => len,
    };
    (start <= end && end <= len).then_some((start, end))
}

impl<T: Pod> CachedSlice<T> {
    fn check_len(&self, got: usize) -> Result<(), CudaError> {
        if got == self.len {
            Ok(())
        } else {
            Err(CudaError::LengthMismatch {
                buffer: self.len,
                host: got,
            })
        }
    }

    /// Copies `src` (same length) into the buffer on its stream and waits for the copy.
    pub fn copy_from_host(&mut self, src: &[T]) -> Result<(), CudaError> {
        self.check_len(src.len())?;
        if self.num_bytes() == 0 {
            return Ok(());
        }
        let stream = self.stream.clone();
        let _ctx = self.alloc.device().enter()?;
        let guard = self.write_on(&stream);
        // SAFETY: `src` covers num_bytes bytes and outlives the copy (the
        // stream is synchronised below); the destination is this buffer.
        unsafe {
            driver::memcpy_htod_async(
                RawPtr(self.ptr),
                src.as_ptr().cast::<u8>(),
                self.num_bytes(),
                stream_id(&stream),
            )?;
        }
        drop(guard);
        driver::stream_synchronize(stream_id(&stream))?;
        Ok(())
    }

    /// Copies the buffer into `dst` (same length) on its stream, after the
    /// work queued there, and waits for the copy.
    pub fn copy_to_host(&self, dst: &mut [T]) -> Result<(), CudaError> {
        self.check_len(dst.len())?;
        if self.num_bytes() == 0 {
            return Ok(());
        }
        let _ctx = self.alloc.device().enter()?;
        let guard = self.read_on(&self.stream);
        // SAFETY: `dst` covers num_bytes bytes, is exclusively borrowed and
        // untouched until the copy completed (synchronised below); any bytes
        // are a valid T (Pod).
        unsafe {
            driver::memcpy_dtoh_async(
                dst.as_mut_ptr().cast::<u8>(),
                RawPtr(self.ptr),
                self.num_bytes(),
                stream_id(&self.stream),
            )?;
        }
        drop(guard);
        driver::stream_synchronize(stream_id(&self.stream))?;
        Ok(())
    }

    /// The values on the host (waits for the copy).
    pub fn to_vec(&self) -> Result<Vec<T>, CudaError> {
        let mut v = vec![T::zeroed(); self.len];
        self.copy_to_host(&mut v)?;
        Ok(v)
    }

    /// Sets every value to `value`, queued on the buffer's stream: one
    /// memset when the value's bytes repeat every 1, 2 or 4 bytes (zero,
    /// `f32`, `f16`, `u8`, …), else a synchronous copy from the host.
    pub fn fill(&mut self, value: T) -> Result<(), CudaError> {
        if self.num_bytes() == 0 {
            return Ok(());
        }
        let stream = self.stream.clone();
        let _ctx = self.alloc.device().enter()?;
        let _guard = self.write_on(&stream);
        // SAFETY: the range is this buffer's memory, ordered on its stream by
        // `write_on`; any bit pattern is a valid T (Pod).
        unsafe { fill_pod(RawPtr(self.ptr), self.len, value, stream_id(&stream)) }
    }

    /// Blocks until the work queued on the buffer's stream completed.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.stream
            .synchronize()
            .map_err(|e| driver_error(e, "cuStreamSynchronize"))
    }
}

impl<T> Drop for CachedSlice<T> {
    fn drop(&mut self) {
        if self.ptr == 0 {
            return;
        }
        if self.tracking() {
            // The next user on the own stream must come after foreign writes
            // and reads; the allocator orders reuse on other streams itself.
            if *self.sync.foreign_write.get_mut() {
                self.own_waits_for_write();
            }
            if *self.sync.foreign_read.get_mut() {
                if let Some(ev) = self.sync.read.get() {
                    self.stream.context().record_err(self.stream.wait(ev));
                }
            }
        }
        if *self.sync.sync_on_free.get_mut() {
            // A foreign stream could not be recorded: wait for everything
            // rather than hand out memory that stream may still use.
            let _ = self.stream.context().synchronize();
        }
        // A failure means the allocator lost track of the pointer, which
        // cannot happen for one it handed out and that is freed once; Drop
        // cannot report it and must not panic.
        let _ = self.alloc.free(RawPtr(self.ptr));
    }
}

impl<T> DeviceSlice<T> for CachedSlice<T> {
    #[inline]
    fn len(&self) -> usize {
        self.len
    }
    #[inline]
    fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
}

impl<T> DevicePtr<T> for CachedSlice<T> {
    #[inline]
    fn device_ptr<'a>(&'a self, stream: &'a CudaStream) -> (CUdeviceptr, SyncOnDrop<'a>) {
        (self.ptr, self.read_on(stream))
    }
}

impl<T> DevicePtrMut<T> for CachedSlice<T> {
    #[inline]
    fn device_ptr_mut<'a>(&'a mut self, stream: &'a CudaStream) -> (CUdeviceptr, SyncOnDrop<'a>) {
        (self.ptr, self.write_on(stream))
    }
}

/// A read-only range of a [`CachedSlice`] (cudarc's `CudaView`).
pub struct CachedView<'a, T> {
    ptr: CUdeviceptr,
    len: usize,
    parent: &'a CachedSlice<T>,
}

/// A writable range of a [`CachedSlice`] (cudarc's `CudaViewMut`).
pub struct CachedViewMut<'a, T> {
    ptr: CUdeviceptr,
    len: usize,
    parent: &'a mut CachedSlice<T>,
}

impl<T> fmt::Debug for CachedView<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CachedView")
            .field("ptr", &RawPtr(self.ptr))
            .field("len", &self.len)
            .finish()
    }
}

impl<T> fmt::Debug for CachedViewMut<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CachedViewMut")
            .field("ptr", &RawPtr(self.ptr))
            .field("len", &self.len)
            .finish()
    }
}

impl<T> CachedView<'_, T> {
    /// Number of values.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether the view holds no values.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl<T> CachedViewMut<'_, T> {
    /// Number of values.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether the view holds no values.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl<T> DeviceSlice<T> for CachedView<'_, T> {
    fn len(&self) -> usize {
        self.len
    }
    fn stream(&self) -> &Arc<CudaStream> {
        &self.parent.stream
    }
}

impl<T> DeviceSlice<T> for CachedViewMut<'_, T> {
    fn len(&self) -> usize {
        self.len
    }
    fn stream(&self) -> &Arc<CudaStream> {
        &self.parent.stream
    }
}

impl<T> DevicePtr<T> for CachedView<'_, T> {
    #[inline]
    fn device_ptr<'a>(&'a self, stream: &'a CudaStream) -> (CUdeviceptr, SyncOnDrop<'a>) {
        (self.ptr, self.parent.read_on(stream))
    }
}

impl<T> DevicePtr<T> for CachedViewMut<'_, T> {
    #[inline]
    fn device_ptr<'a>(&'a self, stream: &'a CudaStream) -> (CUdeviceptr, SyncOnDrop<'a>) {
        (self.ptr, self.parent.read_on(stream))
    }
}

impl<T> DevicePtrMut<T> for CachedViewMut<'_, T> {
    #[inline]
    fn device_ptr_mut<'a>(&'a mut self, stream: &'a CudaStream) -> (CUdeviceptr, SyncOnDrop<'a>) {
        (self.ptr, self.parent.write_on(stream))
    }
}

// Kernel arguments: the device address, read from a field that lives as long
// as the borrow of the buffer (cudarc keeps a pointer to it until launch).
// SAFETY: a `CUdeviceptr` is a valid kernel parameter for a `T*` argument;
// the pointee outlives `'a` because the builder borrows it for `'b: 'a`.
unsafe impl<'a, 'b: 'a, T> PushKernelArg<&'b CachedSlice<T>> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b CachedSlice<T>) -> &mut Self {
        self.arg(&arg.ptr)
    }
}

// SAFETY: as for `&CachedSlice`.
unsafe impl<'a, 'b: 'a, T> PushKernelArg<&'b mut CachedSlice<T>> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b mut CachedSlice<T>) -> &mut Self {
        let ptr: &'b CUdeviceptr = &arg.ptr;
        self.arg(ptr)
    }
}

// SAFETY: as for `&CachedSlice`; the view's address field lives for `'b`.
unsafe impl<'a, 'b: 'a, 'c: 'b, T> PushKernelArg<&'b CachedView<'c, T>> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b CachedView<'c, T>) -> &mut Self {
        self.arg(&arg.ptr)
    }
}

// SAFETY: as for `&CachedSlice`.
unsafe impl<'a, 'b: 'a, 'c: 'b, T> PushKernelArg<&'b mut CachedViewMut<'c, T>> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b mut CachedViewMut<'c, T>) -> &mut Self {
        let ptr: &'b CUdeviceptr = &arg.ptr;
        self.arg(ptr)
    }
}

#[cfg(test)]
mod tests {
    use super::bounds;
    use std::ops::Bound;

    #[test]
    fn ranges_map_to_bounds_or_none() {
        assert_eq!(bounds(.., 10), Some((0, 10)));
        assert_eq!(bounds(2..5, 10), Some((2, 5)));
        assert_eq!(bounds(2..=5, 10), Some((2, 6)));
        assert_eq!(bounds(..=9, 10), Some((0, 10)));
        assert_eq!(bounds(10.., 10), Some((10, 10)));
        assert_eq!(bounds(..=10, 10), None);
        assert_eq!(bounds((Bound::Included(5), Bound::Excluded(4)), 10), None);
        assert_eq!(bounds(11.., 10), None);
        assert_eq!(bounds(..=usize::MAX, 10), None);
    }
}
