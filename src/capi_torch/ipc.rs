//! CUDA IPC behind PyTorch's `shareIpcHandle` and `getIpcDevPtr`
//! (`torch.multiprocessing` sending CUDA tensors to another process).
//!
//! The sending process names what backs a block
//! ([`CachingAllocator::export_block`]) in a handle (bytes) and an offset;
//! the receiving process opens the handle, once per handle however many
//! tensors use it (the driver maps a plain allocation once per process),
//! and closes it when the last user is gone ([`Imports`]). PyTorch's
//! reference counting (`CudaIPCSentData`) keeps the sender's block
//! allocated until every receiver released it; freeing it then is an
//! ordinary free. Blocks of expandable segments stay pinned meanwhile
//! (Note [Shared blocks are pinned] in `cachealloc_core`).
//!
//! Note [IPC handles]: the bytes of a handle, first byte the kind.
//!
//! - `c`: a block of a plain segment: the segment's `cudaIpcMemHandle_t`
//!   (64 bytes; `cuIpcGetMemHandle` of its base), opened with
//!   `cuIpcOpenMemHandle`. The offset is the block's in the segment.
//!   PyTorch 2.11's format (`SHAREABLE_CUDA_MALLOC`), so either side may be
//!   PyTorch's own allocator.
//! - `e`: a block of an expandable segment whose pages are all one size:
//!   PyTorch 2.11's `ShareHeader` (`pid_t` pid, 4 bytes of padding, `size_t`
//!   page size, `size_t` page count; 24 bytes in the host's byte order),
//!   then per page the sender's POSIX file descriptor (an `int`), or, from
//!   a PyTorch that uses fabric handles, a 64-byte `CUmemFabricHandle`
//!   (told apart here by the length; PyTorch's own receiver goes by its own
//!   setting). The receiver takes each descriptor from the sender
//!   (`pidfd_open` + `pidfd_getfd`), imports and maps the pages side by
//!   side. The offset is the block's from the first page.
//! - `C`: cachealloc's own, for a block over pages of several sizes (which
//!   `e` cannot say; PyTorch's receiver refuses it as "unexpected or
//!   illformed"): the magic `CAL`, a little-endian `u16` version (1) and
//!   `u16` kind (1: pages as POSIX file descriptors), `i32` pid, `u32` page
//!   count, `u64` total bytes; then per page `u64` bytes, `i32` descriptor,
//!   `u32` zero. 24 + 16 × pages bytes. A receiver refuses another version
//!   or kind by name.

use cachealloc_core::{AllocError, BlockBacking, CachingAllocator, Device, DevicePtr};
use std::collections::HashMap;

/// Kind byte of a plain segment's handle (PyTorch's `SHAREABLE_CUDA_MALLOC`).
const KIND_PLAIN: u8 = b'c';
/// Kind byte of pages of one size (PyTorch's `SHAREABLE_CUDA_EXPANDABLE_SEGMENT`).
const KIND_PAGES: u8 = b'e';
/// Kind byte of cachealloc's own handle of pages of several sizes.
const KIND_OWN: u8 = b'C';
/// The magic after [`KIND_OWN`].
const OWN_MAGIC: &[u8; 3] = b"CAL";
/// The version of cachealloc's own handle this library writes and reads.
const OWN_VERSION: u16 = 1;
/// The kind of cachealloc's own handle: pages as POSIX file descriptors.
const OWN_KIND_FDS: u16 = 1;
/// Bytes of PyTorch's `ShareHeader`.
const SHARE_HEADER: usize = 24;
/// Bytes of cachealloc's own header (kind byte included).
const OWN_HEADER: usize = 24;
/// Bytes per page of cachealloc's own handle.
const OWN_PAGE: usize = 16;
/// Pages a handle may name at most (a 2 MiB page each: 2 TiB).
const MAX_PAGES: u64 = 1 << 20;

/// A shareable handle of a page, as another process sent it.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum Shareable {
    /// A POSIX file descriptor number, in the sending process.
    Fd(i32),
    /// A fabric handle (`CUmemFabricHandle`).
    Fabric([u8; 64]),
}

/// What a handle names (Note [IPC handles]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Shared {
    /// A plain allocation's `cudaIpcMemHandle_t`.
    Plain([u8; 64]),
    /// Pages side by side, each (bytes, handle), of process `pid`.
    Pages {
        /// The sending process.
        pid: i32,
        /// The pages in address order.
        pages: Vec<(u64, Shareable)>,
    },
}

/// The handle of a plain segment (`c`).
pub fn plain_handle(ipc: &[u8; 64]) -> Vec<u8> {
    let mut out = Vec::with_capacity(65);
    out.push(KIND_PLAIN);
    out.extend_from_slice(ipc);
    out
}

/// The handle of pages exported as descriptors `(bytes, fd)` by process
/// `pid`: PyTorch's `e` when they are all one size, else cachealloc's own `C`.
pub fn pages_handle(pid: i32, pages: &[(u64, i32)]) -> Vec<u8> {
    let n = pages.len() as u64;
    if let Some(&(size, _)) = pages
        .first()
        .filter(|_| pages.iter().all(|p| p.0 == pages[0].0))
    {
        let mut out = Vec::with_capacity(1 + SHARE_HEADER + 4 * pages.len());
        out.push(KIND_PAGES);
        out.extend_from_slice(&pid.to_ne_bytes());
        out.extend_from_slice(&[0; 4]);
        out.extend_from_slice(&size.to_ne_bytes());
        out.extend_from_slice(&n.to_ne_bytes());
        for &(_, fd) in pages {
            out.extend_from_slice(&fd.to_ne_bytes());
        }
        return out;
    }
    let total: u64 = pages.iter().map(|p| p.0).sum();
    let mut out = Vec::with_capacity(OWN_HEADER + OWN_PAGE * pages.len());
    out.push(KIND_OWN);
    out.extend_from_slice(OWN_MAGIC);
    out.extend_from_slice(&OWN_VERSION.to_le_bytes());
    out.extend_from_slice(&OWN_KIND_FDS.to_le_bytes());
    out.extend_from_slice(&pid.to_le_bytes());
    out.extend_from_slice(&(pages.len() as u32).to_le_bytes());
    out.extend_from_slice(&total.to_le_bytes());
    for &(size, fd) in pages {
        out.extend_from_slice(&size.to_le_bytes());
        out.extend_from_slice(&fd.to_le_bytes());
        out.extend_from_slice(&0u32.to_le_bytes());
    }
    out
}

/// `N` bytes of `b` from `at` (the caller checked the length).
fn take<const N: usize>(b: &[u8], at: usize) -> [u8; N] {
    b[at..at + N].try_into().expect("length checked")
}

/// Reads a handle (Note [IPC handles]); anything malformed is an error
/// that says what is wrong.
pub fn parse(b: &[u8]) -> Result<Shared, String> {
    let Some(&kind) = b.first() else {
        return Err("an empty CUDA IPC handle".into());
    };
    match kind {
        KIND_PLAIN => {
            if b.len() != 65 {
                return Err(format!(
                    "a CUDA IPC handle of a plain allocation has 65 bytes, not {}",
                    b.len()
                ));
            }
            Ok(Shared::Plain(take::<64>(b, 1)))
        }
        KIND_PAGES => parse_pytorch_pages(b),
        KIND_OWN => parse_own_pages(b),
        k => Err(format!(
            "unknown kind {k:#04x} of CUDA IPC handle (PyTorch's are 'c' and 'e', \
             cachealloc's own 'C')"
        )),
    }
}

/// PyTorch's `e` handle.
fn parse_pytorch_pages(b: &[u8]) -> Result<Shared, String> {
    if b.len() < 1 + SHARE_HEADER {
        return Err(format!(
            "an expandable segment's CUDA IPC handle of {} bytes: shorter than its header",
            b.len()
        ));
    }
    let pid = i32::from_ne_bytes(take(b, 1));
    let size = u64::from_ne_bytes(take(b, 9));
    let n = u64::from_ne_bytes(take(b, 17));
    check_pages(n, size)?;
    let rest = &b[1 + SHARE_HEADER..];
    let pages = if rest.len() as u64 == 4 * n {
        rest.chunks_exact(4)
            .map(|c| {
                let fd = i32::from_ne_bytes(take(c, 0));
                (fd >= 0)
                    .then_some((size, Shareable::Fd(fd)))
                    .ok_or_else(|| format!("file descriptor {fd} in a CUDA IPC handle"))
            })
            .collect::<Result<Vec<_>, String>>()?
    } else if rest.len() as u64 == 64 * n {
        rest.chunks_exact(64)
            .map(|c| (size, Shareable::Fabric(take(c, 0))))
            .collect()
    } else {
        return Err(format!(
            "an expandable segment's CUDA IPC handle names {n} pages in {} bytes \
             (4 per page for file descriptors, 64 for fabric handles)",
            rest.len()
        ));
    };
    Ok(Shared::Pages { pid, pages })
}

/// cachealloc's own `C` handle.
fn parse_own_pages(b: &[u8]) -> Result<Shared, String> {
    if b.len() < OWN_HEADER || &b[1..4] != OWN_MAGIC {
        return Err("a CUDA IPC handle of kind 'C' without cachealloc's header".into());
    }
    let version = u16::from_le_bytes(take(b, 4));
    let kind = u16::from_le_bytes(take(b, 6));
    if version != OWN_VERSION {
        return Err(format!(
            "version {version} of cachealloc's CUDA IPC handle; this library reads version \
             {OWN_VERSION} (the two processes run different cachealloc builds)"
        ));
    }
    if kind != OWN_KIND_FDS {
        return Err(format!(
            "cachealloc's CUDA IPC handle of kind {kind}: unknown here"
        ));
    }
    let pid = i32::from_le_bytes(take(b, 8));
    let n = u64::from(u32::from_le_bytes(take(b, 12)));
    let total = u64::from_le_bytes(take(b, 16));
    if (b.len() - OWN_HEADER) as u64 != OWN_PAGE as u64 * n {
        return Err(format!(
            "cachealloc's CUDA IPC handle names {n} pages in {} bytes",
            b.len() - OWN_HEADER
        ));
    }
    let mut pages = Vec::with_capacity(n as usize);
    let mut sum = 0u64;
    for c in b[OWN_HEADER..].chunks_exact(OWN_PAGE) {
        let size = u64::from_le_bytes(take(c, 0));
        let fd = i32::from_le_bytes(take(c, 8));
        let zero = u32::from_le_bytes(take(c, 12));
        check_pages(1, size)?;
        if fd < 0 || zero != 0 {
            return Err(format!(
                "a malformed page (descriptor {fd}) in a CUDA IPC handle"
            ));
        }
        sum = sum.checked_add(size).ok_or("the pages' sizes overflow")?;
        pages.push((size, Shareable::Fd(fd)));
    }
    check_pages(n, 1)?;
    if sum != total {
        return Err(format!(
            "cachealloc's CUDA IPC handle: pages of {sum} bytes, header says {total}"
        ));
    }
    Ok(Shared::Pages { pid, pages })
}

/// `n` pages of `size` bytes: at least one, not absurdly many or large.
fn check_pages(n: u64, size: u64) -> Result<(), String> {
    if n == 0 || n > MAX_PAGES {
        return Err(format!("a CUDA IPC handle of {n} pages"));
    }
    if size == 0 || size.checked_mul(n).map_or(true, |b| b > 1 << 50) {
        return Err(format!("a CUDA IPC handle of {n} pages of {size} bytes"));
    }
    Ok(())
}

/// Why a block could not be shared: `NotMine` is a lookup miss (the C
/// side asks each allocator in turn), `Failed` an error.
#[derive(Debug, PartialEq, Eq)]
pub enum ShareError {
    /// The allocator did not hand the pointer out.
    NotMine(String),
    /// Anything else.
    Failed(String),
}

/// The handle (Note [IPC handles]) and offset of the block at `ptr` of
/// `a`, for process `pid`'s receivers: `plain` gives a plain segment's IPC
/// handle, `page_fd` a page's file descriptor (exported once per page and
/// kept open by the device). A block of an expandable segment is pinned
/// until freed, even when a later step fails.
pub fn share<D: Device>(
    a: &CachingAllocator<D>,
    ptr: u64,
    pid: i32,
    plain: impl FnOnce(DevicePtr) -> Result<[u8; 64], String>,
    mut page_fd: impl FnMut(u64) -> Result<i32, String>,
) -> Result<(Vec<u8>, u64), ShareError> {
    let backing = a.export_block(DevicePtr(ptr)).map_err(|e| match e {
        AllocError::UnknownPointer(_) => ShareError::NotMine(e.to_string()),
        e => ShareError::Failed(format!("cachealloc: sharing {:#x}: {e}", ptr)),
    })?;
    let failed = |e: String| ShareError::Failed(format!("cachealloc: sharing {ptr:#x}: {e}"));
    match backing {
        BlockBacking::Segment { base, offset, .. } => {
            Ok((plain_handle(&plain(base).map_err(failed)?), offset))
        }
        BlockBacking::Pages { pages, offset, .. } => {
            let fds = pages
                .iter()
                .map(|&(page, bytes)| page_fd(page).map(|fd| (bytes, fd)))
                .collect::<Result<Vec<_>, String>>()
                .map_err(failed)?;
            Ok((pages_handle(pid, &fds), offset))
        }
    }
}

/// What opens and closes another process's memory here: the driver
/// (`exports`), a fake in the tests.
pub trait Opener {
    /// What closing an open mapping needs.
    type Mapping;
    /// Maps what `shared` names on `device`: its address here and what
    /// [`Opener::close`] needs.
    fn open(&self, device: i32, shared: &Shared) -> Result<(u64, Self::Mapping), String>;
    /// Unmaps a mapping of [`Opener::open`].
    fn close(&self, device: i32, mapping: Self::Mapping) -> Result<(), String>;
}

/// One open handle: its address here, its users, what closing it needs.
struct Entry<M> {
    addr: u64,
    users: u64,
    mapping: M,
}

/// What [`Imports::stats`] counts.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct ImportStats {
    /// Handles open now (one mapping each).
    pub open: u64,
    /// Users of them (opens not closed yet).
    pub users: u64,
    /// Handles opened so far (mappings made).
    pub opened: u64,
    /// Handles closed so far (mappings undone).
    pub closed: u64,
}

/// The handles of other processes open here, one mapping per (device,
/// handle), counted by users: PyTorch's `getIpcDevPtr` cache (a handle is
/// opened on its first use, closed when its last user closes it).
pub struct Imports<M> {
    open: HashMap<(i32, Vec<u8>), Entry<M>>,
    by_addr: HashMap<(i32, u64), Vec<u8>>,
    opened: u64,
    closed: u64,
}

impl<M> Default for Imports<M> {
    fn default() -> Self {
        Imports {
            open: HashMap::new(),
            by_addr: HashMap::new(),
            opened: 0,
            closed: 0,
        }
    }
}

impl<M> Imports<M> {
    /// The address of `handle` on `device`: mapped now if no user has it
    /// open (a malformed handle or a failed mapping is an error, and nothing
    /// is kept), else the same address with one more user.
    pub fn open<O: Opener<Mapping = M>>(
        &mut self,
        opener: &O,
        device: i32,
        handle: &[u8],
    ) -> Result<u64, String> {
        if let Some(e) = self.open.get_mut(&(device, handle.to_vec())) {
            e.users += 1;
            return Ok(e.addr);
        }
        let shared = parse(handle)?;
        let (addr, mapping) = opener.open(device, &shared)?;
        if self.by_addr.contains_key(&(device, addr)) {
            // A driver that mapped two handles at one address: refuse the
            // second rather than close the first under its users.
            let _ = opener.close(device, mapping);
            return Err(format!("two CUDA IPC handles opened at {addr:#x}"));
        }
        self.open.insert(
            (device, handle.to_vec()),
            Entry {
                addr,
                users: 1,
                mapping,
            },
        );
        self.by_addr.insert((device, addr), handle.to_vec());
        self.opened += 1;
        Ok(addr)
    }

    /// One user of the handle open at `addr` on `device` is done; the last
    /// one closes it. An address no handle is open at is an error.
    pub fn close<O: Opener<Mapping = M>>(
        &mut self,
        opener: &O,
        device: i32,
        addr: u64,
    ) -> Result<(), String> {
        let Some(handle) = self.by_addr.get(&(device, addr)) else {
            return Err(format!(
                "no CUDA IPC handle is open at {addr:#x} on device {device}"
            ));
        };
        let key = (device, handle.clone());
        let e = self.open.get_mut(&key).expect("both maps list a handle");
        e.users -= 1;
        if e.users > 0 {
            return Ok(());
        }
        let e = self.open.remove(&key).expect("listed");
        self.by_addr.remove(&(device, addr));
        self.closed += 1;
        opener.close(device, e.mapping)
    }

    /// Counts of the handles of `device` (every device with `None`).
    pub fn stats(&self, device: Option<i32>) -> ImportStats {
        let mine = || {
            self.open
                .iter()
                .filter(move |((d, _), _)| device.map_or(true, |x| x == *d))
        };
        ImportStats {
            open: mine().count() as u64,
            users: mine().map(|(_, e)| e.users).sum(),
            opened: self.opened,
            closed: self.closed,
        }
    }
}

// ---- The statistics of `cachealloc_torch_ipc_stats` ---------------------

/// IPC statistic: handles of other processes open on the device now.
pub const CACHEALLOC_IPC_STATS_OPEN: usize = 0;
/// IPC statistic: users of those handles (tensors' storages here).
pub const CACHEALLOC_IPC_STATS_USERS: usize = 1;
/// IPC statistic: handles opened so far (all devices).
pub const CACHEALLOC_IPC_STATS_OPENED: usize = 2;
/// IPC statistic: handles closed so far (all devices).
pub const CACHEALLOC_IPC_STATS_CLOSED: usize = 3;
/// IPC statistic: blocks of the device's allocator shared and not freed (pinned).
pub const CACHEALLOC_IPC_STATS_PINNED_BLOCKS: usize = 4;
/// IPC statistic: their bytes.
pub const CACHEALLOC_IPC_STATS_PINNED_BYTES: usize = 5;
/// IPC statistic: pages of the device exported as file descriptors, kept open.
pub const CACHEALLOC_IPC_STATS_EXPORTED_PAGES: usize = 6;
/// IPC statistic: 1 when the device's pages of expandable segments are
/// created shareable, 0 when not (their blocks cannot be shared), -1 when the
/// device has no allocator yet or no virtual memory API.
pub const CACHEALLOC_IPC_STATS_PAGES_SHAREABLE: usize = 7;
/// Length of the IPC statistics vector.
pub const CACHEALLOC_IPC_STATS_LEN: usize = 8;

#[cfg(feature = "cuda")]
pub use exports::*;

#[cfg(feature = "cuda")]
mod exports {
    //! The exported functions over [`crate::cuda`]'s allocators and driver.

    use super::*;
    use crate::capi::{panic_text, record_message};
    use crate::cuda::{driver, ipc, CudaDevice};
    use parking_lot::Mutex;
    use std::ffi::{c_int, c_void};
    use std::panic::{catch_unwind, AssertUnwindSafe};

    type Alloc = CachingAllocator<CudaDevice>;

    /// Runs `f`, turning a panic into `fallback` with the last error set.
    fn guard<T>(fallback: T, f: impl FnOnce() -> T) -> T {
        catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|p| {
            let msg = panic_text(p);
            record_message(&format!("cachealloc: internal error (panic): {msg}"));
            fallback
        })
    }

    /// An open mapping of another process's memory.
    pub(super) enum Mapping {
        /// `cuIpcOpenMemHandle`'s.
        Plain(DevicePtr),
        /// Imported pages.
        Pages(ipc::ImportedRange),
    }

    /// The driver as [`Opener`], on the devices' primary contexts.
    struct Driver;

    impl Opener for Driver {
        type Mapping = Mapping;

        fn open(&self, device: i32, shared: &Shared) -> Result<(u64, Mapping), String> {
            let a = crate::cuda::allocator(device).map_err(|e| e.to_string())?;
            let _ctx = a.device().enter().map_err(|e| e.to_string())?;
            match shared {
                Shared::Plain(h) => {
                    let p = ipc::open_mem_handle(h).map_err(|e| e.to_string())?;
                    Ok((p.0, Mapping::Plain(p)))
                }
                Shared::Pages { pid, pages } => {
                    let g = a.device().vmm_support().map_err(|why| {
                        format!("pages of another process need the virtual memory API: {why}")
                    })?;
                    if let Some(&(bytes, _)) = pages.iter().find(|p| p.0 % g != 0) {
                        return Err(format!(
                            "a page of {bytes} bytes: not a multiple of this device's \
                             granularity ({g} bytes)"
                        ));
                    }
                    let range = ipc::map_imported(device, *pid, pages, g)?;
                    Ok((range.base.0, Mapping::Pages(range)))
                }
            }
        }

        fn close(&self, device: i32, mapping: Mapping) -> Result<(), String> {
            let a = crate::cuda::allocator(device).map_err(|e| e.to_string())?;
            let _ctx = a.device().enter().map_err(|e| e.to_string())?;
            match mapping {
                // SAFETY: opened by `open`, closed once (the entry is gone);
                // PyTorch synchronized the user's stream before releasing it.
                Mapping::Plain(p) => unsafe { ipc::close_mem_handle(p) },
                Mapping::Pages(range) => {
                    // Unmapping does not wait for the device, as freeing
                    // would: work queued on any stream must be done first.
                    driver::ctx_synchronize().map_err(|e| e.to_string())?;
                    // SAFETY: the device is idle, so no work uses the range.
                    unsafe { ipc::unmap_imported(range) }
                }
            }
            .map_err(|e| e.to_string())
        }
    }

    /// The handles of other processes open in this one.
    static IMPORTS: Mutex<Option<Imports<Mapping>>> = Mutex::new(None);

    /// Shares the block at `ptr` of allocator `h` (PyTorch's
    /// `shareIpcHandle`): writes its handle (Note [IPC handles]) to `out`
    /// when it fits in `cap` bytes, and the block's offset from what the
    /// handle names to `*offset`; returns the handle's length (larger than
    /// `cap`: nothing written, call again with room). -2 when `h` did not
    /// hand `ptr` out (no error set: the caller asks each allocator in
    /// turn); -1 on any other error (the last error says why: a freed block,
    /// a pointer inside a block, pages that are not shareable, ...). A block
    /// of an expandable segment stays pinned until freed (Note [Shared
    /// blocks are pinned]).
    ///
    /// # Safety
    /// `h` is NULL or a live allocator handle (`cachealloc_torch_device`, or
    /// `cachealloc_torch_pool_new` not yet dropped); `out` points at `cap`
    /// writable bytes (or is NULL with `cap` 0); `offset` is NULL or writable.
    #[no_mangle]
    pub unsafe extern "C" fn cachealloc_torch_ipc_share(
        h: *const c_void,
        ptr: *mut c_void,
        out: *mut u8,
        cap: usize,
        offset: *mut i64,
    ) -> i64 {
        guard(-1, || {
            if h.is_null() {
                record_message("cachealloc: NULL allocator handle");
                return -1;
            }
            // SAFETY: per the contract `h` points at a live allocator.
            let a = unsafe { &*(h as *const Alloc) };
            let dev = a.device();
            let shared = share(
                a,
                ptr as usize as u64,
                std::process::id() as i32,
                |base| {
                    let _ctx = dev.enter().map_err(|e| e.to_string())?;
                    ipc::mem_handle(base).map_err(|e| e.to_string())
                },
                |page| dev.export_page_fd(page),
            );
            match shared {
                Ok((bytes, off)) => {
                    if !offset.is_null() {
                        // SAFETY: non-null and writable per the contract.
                        unsafe { *offset = off as i64 };
                    }
                    if bytes.len() <= cap && !out.is_null() {
                        // SAFETY: `out` has room for `cap` ≥ len bytes per the contract.
                        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), out, bytes.len()) };
                    }
                    bytes.len() as i64
                }
                Err(ShareError::NotMine(_)) => -2,
                Err(ShareError::Failed(m)) => {
                    record_message(&m);
                    -1
                }
            }
        })
    }

    /// Opens a handle another process shared (PyTorch's `getIpcDevPtr`) on
    /// `device`: the address here of what it names (add the offset the
    /// sender gave), or NULL with the last error set (a malformed handle, a
    /// sender that exited, a kernel that forbids taking its descriptors,
    /// ...). A handle already open here gives the same address, counted:
    /// every open is matched by one `cachealloc_torch_ipc_close`.
    ///
    /// # Safety
    /// `handle` points at `len` readable bytes.
    #[no_mangle]
    pub unsafe extern "C" fn cachealloc_torch_ipc_open(
        device: c_int,
        handle: *const u8,
        len: usize,
    ) -> *mut c_void {
        guard(std::ptr::null_mut(), || {
            if handle.is_null() || len == 0 {
                record_message("cachealloc: an empty CUDA IPC handle");
                return std::ptr::null_mut();
            }
            // SAFETY: `handle` has `len` readable bytes per the contract.
            let bytes = unsafe { std::slice::from_raw_parts(handle, len) };
            let mut imports = IMPORTS.lock();
            let imports = imports.get_or_insert_with(Imports::default);
            match imports.open(&Driver, device, bytes) {
                Ok(addr) => addr as usize as *mut c_void,
                Err(m) => {
                    record_message(&format!(
                        "cachealloc: opening a CUDA IPC handle on device {device}: {m}"
                    ));
                    std::ptr::null_mut()
                }
            }
        })
    }

    /// One user of the handle opened at `ptr` on `device` is done; the last
    /// one unmaps it. 0, or -1 with the last error set (no handle open
    /// there, or the driver refused to unmap).
    #[no_mangle]
    pub extern "C" fn cachealloc_torch_ipc_close(device: c_int, ptr: *mut c_void) -> c_int {
        guard(-1, || {
            let mut imports = IMPORTS.lock();
            let imports = imports.get_or_insert_with(Imports::default);
            match imports.close(&Driver, device, ptr as usize as u64) {
                Ok(()) => 0,
                Err(m) => {
                    record_message(&format!("cachealloc: closing a CUDA IPC handle: {m}"));
                    -1
                }
            }
        })
    }

    /// Writes the `CACHEALLOC_IPC_STATS_LEN` IPC statistics of `device`
    /// (`CACHEALLOC_IPC_STATS_*`) into `out` (`n` ≥ that): 0, or -1.
    ///
    /// # Safety
    /// `out` points at `n` writable `int64_t`.
    #[no_mangle]
    pub unsafe extern "C" fn cachealloc_torch_ipc_stats(
        device: c_int,
        out: *mut i64,
        n: usize,
    ) -> c_int {
        guard(-1, || {
            if out.is_null() || n < CACHEALLOC_IPC_STATS_LEN {
                record_message(&format!(
                    "cachealloc: ipc_stats needs {CACHEALLOC_IPC_STATS_LEN} slots"
                ));
                return -1;
            }
            let s = IMPORTS
                .lock()
                .as_ref()
                .map(|i| i.stats(Some(device)))
                .unwrap_or_default();
            let a = crate::cuda::existing_allocator(device);
            let (pinned, pinned_bytes, exported) = a
                .map(|a| {
                    let (b, bytes) = a.pinned_blocks();
                    (b, bytes, a.device().exported_pages() as u64)
                })
                .unwrap_or_default();
            let shareable = match a.map(|a| a.device()) {
                Some(d) if d.vmm_support().is_ok() => i64::from(d.pages_shareable().is_ok()),
                _ => -1,
            };
            let mut v = [0i64; CACHEALLOC_IPC_STATS_LEN];
            let i = |x: u64| i64::try_from(x).unwrap_or(i64::MAX);
            v[CACHEALLOC_IPC_STATS_OPEN] = i(s.open);
            v[CACHEALLOC_IPC_STATS_USERS] = i(s.users);
            v[CACHEALLOC_IPC_STATS_OPENED] = i(s.opened);
            v[CACHEALLOC_IPC_STATS_CLOSED] = i(s.closed);
            v[CACHEALLOC_IPC_STATS_PINNED_BLOCKS] = i(pinned);
            v[CACHEALLOC_IPC_STATS_PINNED_BYTES] = i(pinned_bytes);
            v[CACHEALLOC_IPC_STATS_EXPORTED_PAGES] = i(exported);
            v[CACHEALLOC_IPC_STATS_PAGES_SHAREABLE] = shareable;
            // SAFETY: `out` has room for `n` ≥ LEN values per the contract.
            unsafe { std::ptr::copy_nonoverlapping(v.as_ptr(), out, CACHEALLOC_IPC_STATS_LEN) };
            0
        })
    }
}

#[cfg(test)]
mod tests;
