//! [`CachedBuffer`]: device memory from the caching allocator, given back on drop.

use super::device::CudaDevice;
use super::driver;
use super::CudaError;
use bytemuck::{Pod, Zeroable};
use cachealloc_core::{AllocError, CachingAllocator, DevicePtr, StreamId};
use cust::memory::{DeviceCopy, DevicePointer};
use std::fmt;
use std::marker::PhantomData;
use std::mem::size_of;

/// `len` values of `T` in device memory, taken from a [`CachingAllocator`]
/// on a stream and returned to its cache when dropped.
///
/// The buffer belongs to its stream: the allocator may hand the memory to the
/// next request on the same stream as soon as it is dropped, which is safe
/// because that request's work is queued after this buffer's. If another
/// stream uses the memory, call [`CachedBuffer::record_stream`] first; the
/// memory is then reused only after the work queued on that stream at drop
/// time completed.
///
/// `T` is cust's [`DeviceCopy`]: plain data without host pointers, so it can
/// be copied bytewise between host and device. Reading the buffer back
/// ([`CachedBuffer::copy_to_host`]) additionally relies on the device bytes
/// being valid `T` values — true for what was written from host values,
/// zeroed (`T: Zeroable`) or filled (`T: Pod`), and the caller's promise
/// after [`CachedBuffer::uninitialized`].
///
/// A zero-length buffer (or one of a zero-sized `T`) holds no memory and a
/// null pointer.
pub struct CachedBuffer<T: DeviceCopy> {
    alloc: &'static CachingAllocator<CudaDevice>,
    ptr: DevicePtr,
    len: usize,
    stream: StreamId,
    _values: PhantomData<T>,
}

impl<T: DeviceCopy> CachedBuffer<T> {
    /// A buffer of `len` values whose contents are whatever the memory held.
    ///
    /// # Safety
    /// The contents must be written (on `stream`, or ordered before by the
    /// caller) before they are read as `T` (e.g. by `copy_to_host`): the old
    /// bytes need not be a valid `T`.
    pub unsafe fn uninitialized(
        alloc: &'static CachingAllocator<CudaDevice>,
        len: usize,
        stream: StreamId,
    ) -> Result<Self, CudaError> {
        let bytes = len
            .checked_mul(size_of::<T>())
            .ok_or(AllocError::SizeTooLarge(u64::MAX))?;
        let ptr = if bytes == 0 {
            DevicePtr(0)
        } else {
            alloc.malloc(bytes as u64, stream)?
        };
        Ok(CachedBuffer {
            alloc,
            ptr,
            len,
            stream,
            _values: PhantomData,
        })
    }

    /// A buffer holding a copy of `data` (synchronous: returns when the copy is done).
    pub fn from_slice(
        alloc: &'static CachingAllocator<CudaDevice>,
        data: &[T],
        stream: StreamId,
    ) -> Result<Self, CudaError> {
        // SAFETY: every value is written by the copy below before anything
        // can read it; if the copy fails the buffer is dropped unread.
        let mut buf = unsafe { Self::uninitialized(alloc, data.len(), stream)? };
        buf.copy_from_host(data)?;
        Ok(buf)
    }

    /// A buffer of `len` zeroed values (the fill is queued on `stream`).
    pub fn zeroed(
        alloc: &'static CachingAllocator<CudaDevice>,
        len: usize,
        stream: StreamId,
    ) -> Result<Self, CudaError>
    where
        T: Zeroable,
    {
        // SAFETY: the zero fill is queued on the buffer's stream before any
        // read the caller can queue there; zero bytes are a valid T (Zeroable).
        let buf = unsafe { Self::uninitialized(alloc, len, stream)? };
        if buf.size_in_bytes() > 0 {
            let _ctx = buf.alloc.device().enter()?;
            let (words, tail) = (buf.size_in_bytes() / 4, buf.size_in_bytes() % 4);
            // SAFETY: the range is this buffer's own memory, used by its stream only.
            unsafe {
                if tail == 0 {
                    driver::memset_d32_async(buf.ptr, 0, words, stream)?;
                } else {
                    driver::memset_d8_async(buf.ptr, 0, buf.size_in_bytes(), stream)?;
                }
            }
        }
        Ok(buf)
    }

    /// Number of values.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer holds no values.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Size in bytes (`len · size_of::<T>()`).
    pub fn size_in_bytes(&self) -> usize {
        self.len * size_of::<T>()
    }

    /// The stream the buffer belongs to.
    pub fn stream(&self) -> StreamId {
        self.stream
    }

    /// The allocator the buffer came from.
    pub fn allocator(&self) -> &'static CachingAllocator<CudaDevice> {
        self.alloc
    }

    /// The device address (null for an empty buffer).
    pub fn device_ptr(&self) -> DevicePtr {
        self.ptr
    }

    /// The device address as a `CUdeviceptr`.
    pub fn as_raw(&self) -> u64 {
        self.ptr.0
    }

    /// The device address as a cust pointer, for kernel launches through cust.
    pub fn as_device_ptr(&self) -> DevicePointer<T> {
        DevicePointer::from_raw(self.ptr.0)
    }

    /// Marks the buffer as used by `stream` too: when dropped, its memory is
    /// reused only after the work queued on `stream` by then has completed.
    pub fn record_stream(&self, stream: StreamId) -> Result<(), CudaError> {
        if self.size_in_bytes() > 0 {
            self.alloc.record_stream(self.ptr, stream)?;
        }
        Ok(())
    }

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

    /// Copies `src` (same length) into the buffer, ordered on the buffer's
    /// stream, and waits for the copy.
    pub fn copy_from_host(&mut self, src: &[T]) -> Result<(), CudaError> {
        // SAFETY: we synchronise the stream before returning, so `src` outlives the copy.
        unsafe { self.copy_from_host_async(src)? };
        self.synchronize()
    }

    /// Copies the buffer into `dst` (same length), ordered on the buffer's
    /// stream after the work queued there, and waits for the copy.
    pub fn copy_to_host(&self, dst: &mut [T]) -> Result<(), CudaError> {
        // SAFETY: we synchronise the stream before returning, so `dst` is not
        // touched before the copy completed. Validity of the bytes as T is
        // the type-level contract of CachedBuffer (see the type's docs).
        unsafe { self.copy_to_host_async(dst)? };
        self.synchronize()
    }

    /// Queues a copy of `src` into the buffer on its stream and returns at once.
    ///
    /// # Safety
    /// `src` must stay valid and unmodified until the copy completed (e.g.
    /// [`CachedBuffer::synchronize`]): page-locked host memory is read
    /// asynchronously.
    pub unsafe fn copy_from_host_async(&mut self, src: &[T]) -> Result<(), CudaError> {
        self.check_len(src.len())?;
        if self.size_in_bytes() == 0 {
            return Ok(());
        }
        let _ctx = self.alloc.device().enter()?;
        // SAFETY: `src` covers size_in_bytes bytes (same length and T), the
        // caller keeps it alive until completion; the destination is ours.
        unsafe {
            driver::memcpy_htod_async(
                self.ptr,
                src.as_ptr().cast::<u8>(),
                self.size_in_bytes(),
                self.stream,
            )?
        };
        Ok(())
    }

    /// Queues a copy of the buffer into `dst` on its stream and returns at once.
    ///
    /// # Safety
    /// `dst` must not be read or written until the copy completed (e.g.
    /// [`CachedBuffer::synchronize`]), and the device bytes must be valid `T`
    /// values (see the type's docs).
    pub unsafe fn copy_to_host_async(&self, dst: &mut [T]) -> Result<(), CudaError> {
        self.check_len(dst.len())?;
        if self.size_in_bytes() == 0 {
            return Ok(());
        }
        let _ctx = self.alloc.device().enter()?;
        // SAFETY: `dst` covers size_in_bytes bytes and is exclusively borrowed;
        // the caller keeps it untouched until completion.
        unsafe {
            driver::memcpy_dtoh_async(
                dst.as_mut_ptr().cast::<u8>(),
                self.ptr,
                self.size_in_bytes(),
                self.stream,
            )?
        };
        Ok(())
    }

    /// Fills every 32-bit word of the buffer with `word` (queued on its stream).
    /// The size in bytes must be a multiple of 4.
    pub fn fill_u32(&mut self, word: u32) -> Result<(), CudaError>
    where
        T: Pod,
    {
        let bytes = self.size_in_bytes();
        if bytes % 4 != 0 {
            return Err(CudaError::NotWordSized { bytes });
        }
        if bytes == 0 {
            return Ok(());
        }
        let _ctx = self.alloc.device().enter()?;
        // SAFETY: the range is this buffer's own memory on its own stream; any
        // bit pattern is a valid T (Pod).
        unsafe { driver::memset_d32_async(self.ptr, word, bytes / 4, self.stream)? };
        Ok(())
    }

    /// Sets every value of the buffer to `value` (queued on its stream).
    ///
    /// A value whose bytes repeat with a period of 1, 2 or 4 bytes (any
    /// 1-, 2- or 4-byte type, `f16`/`bf16`, zero of any type) is one
    /// `cuMemsetD8/D16/D32Async`; other values are written from a host copy,
    /// which waits for the stream.
    pub fn fill(&mut self, value: T) -> Result<(), CudaError>
    where
        T: Pod,
    {
        let _ctx = self.alloc.device().enter()?;
        // SAFETY: the range is this buffer's own memory on its own stream;
        // any bit pattern is a valid T (Pod).
        unsafe { fill_pod(self.ptr, self.len, value, self.stream) }
    }

    /// Blocks until the work queued on the buffer's stream completed.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        let _ctx = self.alloc.device().enter()?;
        driver::stream_synchronize(self.stream)?;
        Ok(())
    }
}

/// Queues a fill of `len` values of `T` at `ptr` with `value` on `stream`:
/// one memset when the value's bytes repeat every 1, 2 or 4 bytes, else a
/// synchronous copy from a filled host vector.
///
/// # Safety
/// `[ptr, ptr + len·size_of::<T>())` is device memory the caller owns, used
/// by no other stream concurrently; the caller holds a context guard.
pub(crate) unsafe fn fill_pod<T: Pod>(
    ptr: DevicePtr,
    len: usize,
    value: T,
    stream: StreamId,
) -> Result<(), CudaError> {
    let bytes = len * size_of::<T>();
    if bytes == 0 {
        return Ok(());
    }
    let pattern = bytemuck::bytes_of(&value);
    let period = fill_period(pattern);
    match period {
        Some(1) => {
            // SAFETY: the caller owns the `bytes` bytes at `ptr` on `stream`.
            unsafe { driver::memset_d8_async(ptr, pattern[0], bytes, stream)? }
        }
        Some(2) => {
            let v = u16::from_ne_bytes([pattern[0], pattern[1]]);
            // SAFETY: the caller owns the `bytes` bytes at `ptr` on `stream`.
            unsafe { driver::memset_d16_async(ptr, v, bytes / 2, stream)? }
        }
        Some(_) => {
            let v = u32::from_ne_bytes([pattern[0], pattern[1], pattern[2], pattern[3]]);
            // SAFETY: the caller owns the `bytes` bytes at `ptr` on `stream`.
            unsafe { driver::memset_d32_async(ptr, v, bytes / 4, stream)? }
        }
        None => {
            let host = vec![value; len];
            // SAFETY: `host` covers `bytes` bytes and outlives the copy: the
            // stream is synchronised before it is dropped.
            unsafe {
                driver::memcpy_htod_async(ptr, host.as_ptr().cast::<u8>(), bytes, stream)?;
            }
            driver::stream_synchronize(stream)?;
        }
    }
    Ok(())
}

/// The memset width (1, 2 or 4 bytes) that writes `pattern` repeated, if any.
fn fill_period(pattern: &[u8]) -> Option<usize> {
    [1usize, 2, 4].into_iter().find(|&p| {
        p <= pattern.len()
            && pattern.len() % p == 0
            && pattern.chunks_exact(p).all(|c| c == &pattern[..p])
    })
}

impl<T: DeviceCopy> Drop for CachedBuffer<T> {
    fn drop(&mut self) {
        if self.size_in_bytes() > 0 {
            // A failure here means the allocator lost track of the pointer,
            // which cannot happen for a pointer it handed out and that is freed
            // once; Drop cannot report it, and must not panic.
            let _ = self.alloc.free(self.ptr);
        }
    }
}

impl<T: DeviceCopy> fmt::Debug for CachedBuffer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CachedBuffer")
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .field("elem_size", &size_of::<T>())
            .field("stream", &self.stream)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::fill_period;

    #[test]
    fn fill_picks_the_narrowest_memset_or_none() {
        assert_eq!(fill_period(&[7]), Some(1));
        assert_eq!(fill_period(&0u64.to_ne_bytes()), Some(1));
        assert_eq!(fill_period(&0x1234u16.to_ne_bytes()), Some(2));
        assert_eq!(fill_period(&[1, 2, 1, 2, 1, 2, 1, 2]), Some(2));
        assert_eq!(fill_period(&1.5f32.to_ne_bytes()), Some(4));
        assert_eq!(fill_period(&[1, 2, 3, 4, 1, 2, 3, 4]), Some(4));
        assert_eq!(fill_period(&(-1.25f64).to_ne_bytes()), None);
        assert_eq!(fill_period(&[1, 2, 3]), None);
        assert_eq!(fill_period(&[1, 2, 3, 4, 5, 6]), None);
        assert_eq!(fill_period(&[]), None);
    }
}
