//! The driver calls of CUDA IPC (sharing device memory with another
//! process): IPC handles of plain allocations (`cuIpcGetMemHandle` /
//! `cuIpcOpenMemHandle`), and physical pages of the virtual memory API
//! exported as POSIX file descriptors (`cuMemExportToShareableHandle`),
//! fetched from the sharing process (`pidfd_open` + `pidfd_getfd`) and
//! imported (`cuMemImportFromShareableHandle`), then mapped into a range of
//! this process's own. The wire format and the bookkeeping are in
//! `crate::capi_torch::ipc`.
//!
//! Like [`super::driver`], every function works in the calling thread's
//! current context.

use super::driver::{self, check};
use super::ffi;
pub use crate::capi_torch::ipc::Shareable;
use cachealloc_core::{DeviceError, DevicePtr};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::raw::{c_long, c_void};

/// `pidfd_open(2)`; the same number on every Linux architecture since 5.3.
const SYS_PIDFD_OPEN: c_long = 434;
/// `pidfd_getfd(2)`; the same number on every Linux architecture since 5.6.
const SYS_PIDFD_GETFD: c_long = 438;

extern "C" {
    /// libc's `syscall(2)`.
    fn syscall(number: c_long, ...) -> c_long;
}

/// Exports physical page `page` as a POSIX file descriptor, owned by the
/// caller (closed on drop). The page must have been created shareable
/// ([`driver::mem_create_with`]); the driver refuses others.
pub fn export_fd(page: u64) -> Result<OwnedFd, DeviceError> {
    let mut fd: i32 = -1;
    check(
        // SAFETY: for a POSIX file descriptor the driver writes one `int`
        // into `fd`, a valid local; `page` is checked by the driver.
        unsafe {
            ffi::cuMemExportToShareableHandle(
                (&mut fd as *mut i32).cast::<c_void>(),
                page,
                ffi::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0,
            )
        },
        "cuMemExportToShareableHandle",
    )?;
    if fd < 0 {
        return Err(DeviceError::Driver {
            name: format!("file descriptor {fd}"),
            call: "cuMemExportToShareableHandle",
        });
    }
    // SAFETY: the driver handed us this new descriptor; nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Imports a page from `handle` (a descriptor of this process, or a fabric
/// handle): a physical allocation handle to map and then release, as one of
/// [`driver::mem_create`]'s.
pub fn import(handle: &Imported<'_>) -> Result<u64, DeviceError> {
    let mut h: ffi::CuMemHandle = 0;
    let rc = match handle {
        Imported::Fd(fd) => {
            // SAFETY: for a POSIX file descriptor the driver takes the
            // descriptor's value in the pointer argument and reads nothing
            // through it; it writes one handle into `h`, a valid local. The
            // descriptor stays open during the call (borrowed).
            unsafe {
                ffi::cuMemImportFromShareableHandle(
                    &mut h,
                    fd.as_raw_fd() as isize as *mut c_void,
                    ffi::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                )
            }
        }
        Imported::Fabric(f) => {
            let mut bytes = **f;
            // SAFETY: for a fabric handle the driver reads 64 bytes through
            // the pointer (a valid local copy) and writes one handle into `h`.
            unsafe {
                ffi::cuMemImportFromShareableHandle(
                    &mut h,
                    bytes.as_mut_ptr().cast::<c_void>(),
                    ffi::CU_MEM_HANDLE_TYPE_FABRIC,
                )
            }
        }
    };
    check(rc, "cuMemImportFromShareableHandle")?;
    Ok(h)
}

/// What [`import`] imports from.
pub enum Imported<'a> {
    /// A descriptor of this process (from [`Pidfd::get`]).
    Fd(&'a OwnedFd),
    /// A fabric handle.
    Fabric(&'a [u8; 64]),
}

/// A process of this machine, to take file descriptors from (`pidfd_open`).
pub struct Pidfd {
    fd: OwnedFd,
    pid: i32,
}

impl Pidfd {
    /// Opens process `pid`.
    pub fn open(pid: i32) -> Result<Pidfd, String> {
        if pid <= 0 {
            return Err(format!("no process {pid} to take pages from"));
        }
        // SAFETY: pidfd_open takes a pid and flags by value and returns a new
        // descriptor or -1; no memory is passed.
        let fd = unsafe { syscall(SYS_PIDFD_OPEN, pid as c_long, 0 as c_long) };
        if fd < 0 {
            let e = std::io::Error::last_os_error();
            return Err(format!(
                "pidfd_open({pid}): {e}{}",
                if e.raw_os_error() == Some(38) {
                    " (the kernel lacks it: Linux 5.3 or later is needed to open pages \
                     of expandable segments another process shared)"
                } else {
                    " (the sharing process has exited?)"
                }
            ));
        }
        Ok(Pidfd {
            // SAFETY: a new descriptor the kernel just returned; nothing else owns it.
            fd: unsafe { OwnedFd::from_raw_fd(fd as RawFd) },
            pid,
        })
    }

    /// A copy, in this process, of descriptor `fd` of the process.
    pub fn get(&self, fd: i32) -> Result<OwnedFd, String> {
        // SAFETY: pidfd_getfd takes two descriptors and flags by value and
        // returns a new descriptor or -1; no memory is passed.
        let got = unsafe {
            syscall(
                SYS_PIDFD_GETFD,
                self.fd.as_raw_fd() as c_long,
                fd as c_long,
                0 as c_long,
            )
        };
        if got < 0 {
            let e = std::io::Error::last_os_error();
            let why = match e.raw_os_error() {
                Some(1) => format!(
                    " (the kernel's ptrace rules forbid taking descriptors of process {}: \
                     with kernel.yama.ptrace_scope 1 a process may take them from its \
                     descendants only, so share from a child to its parent, or share from \
                     plain segments: CACHEALLOC_CONF=segments or expandable_segments:False \
                     in the sending process)",
                    self.pid
                ),
                Some(38) => " (the kernel lacks it: Linux 5.6 or later is needed)".to_string(),
                _ => String::new(),
            };
            return Err(format!("pidfd_getfd({}, {fd}): {e}{why}", self.pid));
        }
        // SAFETY: a new descriptor the kernel just returned; nothing else owns it.
        Ok(unsafe { OwnedFd::from_raw_fd(got as RawFd) })
    }
}

/// The IPC handle (`cuIpcGetMemHandle`) of the plain allocation that starts
/// at `base`.
pub fn mem_handle(base: DevicePtr) -> Result<[u8; 64], DeviceError> {
    driver::ipc_mem_handle(base)
}

/// Opens the IPC handle of another process's plain allocation
/// (`cuIpcOpenMemHandle`, peer access enabled lazily): its address here.
/// A handle may be open once per context: the caller keeps one open
/// mapping per handle.
pub fn open_mem_handle(handle: &[u8; 64]) -> Result<DevicePtr, DeviceError> {
    let mut p: ffi::CuDevicePtr = 0;
    check(
        // SAFETY: the handle is passed by value (64 bytes); the driver writes
        // one device pointer into `p`, a valid local, or fails.
        unsafe {
            ffi::cuIpcOpenMemHandle_v2(
                &mut p,
                ffi::CuIpcMemHandle(*handle),
                ffi::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS,
            )
        },
        "cuIpcOpenMemHandle",
    )?;
    Ok(DevicePtr(p))
}

/// Closes a mapping of [`open_mem_handle`].
///
/// # Safety
/// `ptr` came from [`open_mem_handle`] and is closed once; no queued work
/// of this process still uses it.
pub unsafe fn close_mem_handle(ptr: DevicePtr) -> Result<(), DeviceError> {
    // SAFETY: the caller guarantees an open IPC mapping, closed once.
    check(
        unsafe { ffi::cuIpcCloseMemHandle(ptr.0) },
        "cuIpcCloseMemHandle",
    )
}

/// Whether device `ordinal` can export pages as POSIX file descriptors
/// (`CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED`).
pub fn posix_fd_supported(ordinal: i32) -> Result<bool, DeviceError> {
    driver::device_attribute(
        ordinal,
        ffi::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
    )
    .map(|v| v != 0)
}

/// Pages of another process mapped here side by side: what
/// [`map_imported`] made and [`unmap_imported`] takes apart.
#[derive(Debug)]
pub struct ImportedRange {
    /// The reserved range.
    pub base: DevicePtr,
    /// Its size in bytes (the pages' sum).
    pub bytes: u64,
    /// Each page's size, in address order.
    pages: Vec<u64>,
}

/// Imports the pages of another process (`pages`: each one's bytes and
/// shareable handle, side by side) and maps them, readable and writable by
/// device `ordinal` and its peers ([`driver::mem_map`]), into a range
/// reserved here, aligned to `alignment`. Descriptors are taken from process
/// `pid`. A failure undoes everything done so far.
pub fn map_imported(
    ordinal: i32,
    pid: i32,
    pages: &[(u64, Shareable)],
    alignment: u64,
) -> Result<ImportedRange, String> {
    let bytes = pages
        .iter()
        .try_fold(0u64, |n, &(b, _)| n.checked_add(b))
        .ok_or("the pages' sizes overflow")?;
    let pidfd = if pages.iter().any(|p| matches!(p.1, Shareable::Fd(_))) {
        Some(Pidfd::open(pid)?)
    } else {
        None
    };
    let base = driver::mem_address_reserve(bytes, alignment)
        .map_err(|e| format!("reserving {bytes} bytes of address space: {e}"))?;
    let mut range = ImportedRange {
        base,
        bytes,
        pages: Vec::with_capacity(pages.len()),
    };
    let mut at = base.0;
    for (i, &(size, ref handle)) in pages.iter().enumerate() {
        let fail = |range: ImportedRange, e: String| {
            // SAFETY: the pages mapped so far were mapped just now, by this
            // function, and no work can use them yet.
            let _ = unsafe { unmap_imported(range) };
            Err(format!("page {i} of {} ({size} bytes): {e}", pages.len()))
        };
        let page = match handle {
            Shareable::Fd(fd) => pidfd
                .as_ref()
                .expect("opened for descriptors")
                .get(*fd)
                .and_then(|local| import(&Imported::Fd(&local)).map_err(|e| e.to_string())),
            Shareable::Fabric(f) => import(&Imported::Fabric(f)).map_err(|e| e.to_string()),
        };
        let page = match page {
            Ok(page) => page,
            Err(e) => return fail(range, e),
        };
        let mapped = driver::mem_map(DevicePtr(at), page, size, ordinal);
        // The mapping holds the memory from here on (or nothing does).
        // SAFETY: imported just above, released once.
        let released = unsafe { driver::mem_release(page) };
        if mapped.is_ok() {
            range.pages.push(size);
            at += size;
        }
        if let Err(e) = mapped.and(released) {
            return fail(range, e.to_string());
        }
    }
    Ok(range)
}

/// Unmaps the pages of [`map_imported`] (their memory goes back to the
/// sending process's driver accounting once every process unmapped it) and
/// frees the range.
///
/// # Safety
/// No queued or running work of this process still uses the range.
pub unsafe fn unmap_imported(range: ImportedRange) -> Result<(), DeviceError> {
    let mut at = range.base.0;
    let mut result = Ok(());
    for size in range.pages {
        // SAFETY: each page was mapped whole by `map_imported`, once; the
        // caller guarantees no work uses it.
        let r = unsafe { driver::mem_unmap(DevicePtr(at), size) };
        result = result.and(r);
        at += size;
    }
    // One page that refused leaves the range reserved: the error says so,
    // and nothing else uses the address space.
    if result.is_ok() {
        // SAFETY: the range was reserved whole by `map_imported`, and every
        // page in it was just unmapped.
        result = unsafe { driver::mem_address_free(range.base, range.bytes) };
    }
    result
}
