//! Device memory through CUDA's virtual-memory API: allocations other processes can map.
//!
//! cudarc allocates from stream-ordered pools, which no other process can import. Memory peers in
//! other processes reach (a communicator's workspace, [`crate::SymmetricBuffer`]s, staging) is
//! made here instead: `cuMemCreate` with a POSIX file-descriptor handle type, mapped into a
//! reserved range of this process's addresses; `export` gives the descriptor a peer's
//! [`VmmAlloc::import`] maps into its own.

use crate::engine::make_current;
use crate::error::{Error, Result};
use cudarc::driver::sys;
use cudarc::driver::{CudaContext, CudaStream};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;

/// A physical allocation mapped at `ptr` in this process, unmapped and released on drop (the driver
/// frees physical memory when its last mapping, in any process, is gone). Drop does not wait for the
/// device: its owner waits for the work that uses it first (a symmetric buffer for its stream, a
/// communicator for its ranks' streams). Waiting for the whole context there would wait for the
/// calls of other ranks of the same process, which may wait for this one.
pub(crate) struct VmmAlloc {
    ctx: Arc<CudaContext>,
    handle: sys::CUmemGenericAllocationHandle,
    ptr: u64,
    bytes: usize,
}

// SAFETY: the value only holds driver handles and addresses; every use binds the context first.
unsafe impl Send for VmmAlloc {}
// SAFETY: as for `Send`; no method mutates through `&self`.
unsafe impl Sync for VmmAlloc {}

/// `CUmemLocation` of device `ordinal` (see `engine::device_location` for the layout).
fn location(ordinal: usize) -> sys::CUmemLocation {
    crate::engine::device_location(ordinal)
}

/// Makes `ctx` current without taking cudarc's kept error (the service thread maps memory while
/// the rank's calls go on; their errors are theirs to report).
fn current(ctx: &CudaContext) -> Result<()> {
    make_current(ctx).map_err(Error::driver("cuCtxSetCurrent"))
}

/// The allocation properties of exportable device memory on `ordinal`.
fn properties(ordinal: usize) -> sys::CUmemAllocationProp {
    // SAFETY: an all-zero CUmemAllocationProp is a valid value (no flags, no metadata).
    let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.requestedHandleTypes = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    prop.location = location(ordinal);
    prop
}

/// The allocation granularity of exportable memory on `ctx`'s device (sizes are multiples of it).
pub(crate) fn granularity(ctx: &Arc<CudaContext>) -> Result<usize> {
    current(ctx)?;
    let prop = properties(ctx.ordinal());
    let mut g = 0usize;
    // SAFETY: out-pointer and a valid property struct.
    unsafe {
        sys::cuMemGetAllocationGranularity(
            &mut g,
            &prop,
            sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
        )
    }
    .result()
    .map_err(Error::driver("cuMemGetAllocationGranularity"))?;
    Ok(g.max(1))
}

impl VmmAlloc {
    /// At least `bytes` of exportable memory on `ctx`'s device (rounded up to the granularity),
    /// readable and writable by the devices `access` (ordinals in this process; the allocation's
    /// own device is always included); zeroed on `zero_on` where given (in that stream's order:
    /// a wait for the whole context would wait for other ranks' calls in this process).
    pub(crate) fn new(
        ctx: &Arc<CudaContext>,
        bytes: usize,
        access: &[usize],
        zero_on: Option<&CudaStream>,
    ) -> Result<Self> {
        let g = granularity(ctx)?;
        let bytes = bytes.max(1).checked_next_multiple_of(g).ok_or_else(|| Error::Config {
            field: "bytes",
            why: format!("{bytes} bytes cannot be rounded to the allocation granularity {g}"),
        })?;
        current(ctx)?;
        let prop = properties(ctx.ordinal());
        let mut handle = 0;
        // SAFETY: out-pointer and a valid property struct; the handle is released on drop.
        unsafe { sys::cuMemCreate(&mut handle, bytes, &prop, 0) }.result().map_err(Error::driver("cuMemCreate"))?;
        let alloc = Self::map(ctx, handle, bytes, access)?;
        if let Some(stream) = zero_on {
            alloc.zero_async(bytes, stream)?;
        }
        Ok(alloc)
    }

    /// Maps a peer's allocation, exported as `fd` (`bytes` long), on `ctx`'s device.
    pub(crate) fn import(ctx: &Arc<CudaContext>, fd: OwnedFd, bytes: usize) -> Result<Self> {
        current(ctx)?;
        let mut handle = 0;
        // SAFETY: the POSIX handle type takes the descriptor itself as the pointer-sized handle;
        // the driver duplicates what it needs, and `fd` is closed when dropped below.
        unsafe {
            sys::cuMemImportFromShareableHandle(
                &mut handle,
                fd.as_raw_fd() as isize as *mut std::ffi::c_void,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            )
        }
        .result()
        .map_err(Error::driver("cuMemImportFromShareableHandle"))?;
        drop(fd);
        Self::map(ctx, handle, bytes, &[])
    }

    /// Reserves addresses for `handle` (`bytes`), maps it there and grants `ctx`'s device and
    /// `access` read and write; releases `handle` on failure.
    fn map(
        ctx: &Arc<CudaContext>,
        handle: sys::CUmemGenericAllocationHandle,
        bytes: usize,
        access: &[usize],
    ) -> Result<Self> {
        let mut alloc = VmmAlloc { ctx: ctx.clone(), handle, ptr: 0, bytes };
        // From here on drop releases what was done (`ptr` 0: nothing reserved yet).
        let g = granularity(ctx)?;
        let mut ptr = 0;
        // SAFETY: out-pointer; a fresh reservation of `bytes` (a multiple of the granularity).
        unsafe { sys::cuMemAddressReserve(&mut ptr, bytes, g, 0, 0) }
            .result()
            .map_err(Error::driver("cuMemAddressReserve"))?;
        // SAFETY: maps the whole allocation into the reservation just made.
        let mapped = unsafe { sys::cuMemMap(ptr, bytes, 0, handle, 0) }.result();
        if let Err(e) = mapped {
            // SAFETY: the reservation made above, unused.
            let _ = unsafe { sys::cuMemAddressFree(ptr, bytes) };
            return Err(Error::Driver { call: "cuMemMap", source: e });
        }
        alloc.ptr = ptr;
        let mut devices = vec![ctx.ordinal()];
        devices.extend(access.iter().copied().filter(|&d| d != ctx.ordinal()));
        devices.dedup();
        let desc: Vec<sys::CUmemAccessDesc> = devices
            .iter()
            .map(|&d| sys::CUmemAccessDesc {
                location: location(d),
                flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
            })
            .collect();
        // SAFETY: the mapped range and one descriptor per device.
        unsafe { sys::cuMemSetAccess(ptr, bytes, desc.as_ptr(), desc.len()) }
            .result()
            .map_err(Error::driver("cuMemSetAccess"))?;
        Ok(alloc)
    }

    /// A file descriptor a peer process can [`VmmAlloc::import`].
    pub(crate) fn export(&self) -> Result<OwnedFd> {
        current(&self.ctx)?;
        export_handle(self.handle)
    }

    /// The address in this process.
    pub(crate) fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Size in bytes.
    pub(crate) fn bytes(&self) -> usize {
        self.bytes
    }

    /// Zeroes the first `bytes`, ordered on `stream` (of the allocation's context).
    pub(crate) fn zero_async(&self, bytes: usize, stream: &CudaStream) -> Result<()> {
        crate::engine::stream_on(stream, &self.ctx)?;
        // SAFETY: `bytes` (at most the allocation's) of mapped memory of the stream's context; the
        // allocation outlives the memset (its owner waits for the stream before dropping it).
        unsafe { cudarc::driver::result::memset_d8_async(self.ptr, 0, bytes.min(self.bytes), stream.cu_stream()) }
            .map_err(Error::driver("cuMemsetD8Async"))
    }
}

impl Drop for VmmAlloc {
    fn drop(&mut self) {
        // Errors cannot be reported from drop.
        if make_current(&self.ctx).is_ok() {
            // SAFETY: the mapping and reservation made by `map`, undone once, after the owner waited
            // for the work that uses them (see the type's docs); then the handle this value owns.
            unsafe {
                if self.ptr != 0 {
                    let _ = sys::cuMemUnmap(self.ptr, self.bytes);
                    let _ = sys::cuMemAddressFree(self.ptr, self.bytes);
                }
                let _ = sys::cuMemRelease(self.handle);
            }
        }
    }
}

/// A descriptor of `handle` (an allocation made with the POSIX file-descriptor handle type) that a
/// peer process can [`VmmAlloc::import`]; the allocation's context is current.
fn export_handle(handle: sys::CUmemGenericAllocationHandle) -> Result<OwnedFd> {
    let mut fd: std::ffi::c_int = -1;
    // SAFETY: the POSIX handle type writes an `int` descriptor, which the value below owns.
    unsafe {
        sys::cuMemExportToShareableHandle(
            (&mut fd as *mut std::ffi::c_int).cast(),
            handle,
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            0,
        )
    }
    .result()
    .map_err(Error::driver("cuMemExportToShareableHandle"))?;
    // SAFETY: a descriptor the driver just opened for this process, owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// A user's allocation, exported for peers to map: its mapped range and a descriptor of it.
pub(crate) struct Exported {
    pub(crate) base: u64,
    pub(crate) bytes: usize,
    pub(crate) fd: OwnedFd,
}

/// Exports the virtual-memory allocation holding `bytes` at `ptr` (device memory of `ctx`, made by
/// `cuMemCreate` with a POSIX file-descriptor handle type and mapped whole), or says why it
/// cannot be: memory of another device, or not such an allocation (`cuMemAlloc`'s, or a
/// stream-ordered pool's, as cudarc's allocations).
pub(crate) fn export_user(ctx: &Arc<CudaContext>, ptr: u64, bytes: usize) -> Result<Exported> {
    current(ctx)?;
    let refuse = |why: String| Error::PeerMemory { what: format!("registering the buffer at {ptr:#x}"), why };
    let (mut base, mut size) = (0, 0);
    // SAFETY: out-pointers; any address is a valid query.
    unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr) }
        .result()
        .map_err(|e| refuse(format!("not device memory of this context ({e})")))?;
    if ptr.checked_add(bytes as u64).is_none_or(|end| end > base + size as u64) {
        return Err(refuse(format!("{bytes} bytes run past the end of its allocation ({size} bytes at {base:#x})")));
    }
    // A pool's memory (cudarc's) and cuMemAlloc's (legacy-IPC capable) are told apart by asking the
    // pointer first: `cuMemRetainAllocationHandle` fails on them, and compute-sanitizer reports every
    // such failure as an error.
    let attribute = |a: sys::CUpointer_attribute| -> Result<u64> {
        let mut value = 0u64;
        // SAFETY: an 8-byte out-buffer (these attributes write a handle or a boolean); `ptr` is
        // device memory of this context (checked above).
        unsafe { sys::cuPointerGetAttribute((&mut value as *mut u64).cast(), a, ptr) }
            .result()
            .map_err(Error::driver("cuPointerGetAttribute"))?;
        Ok(value)
    };
    let pooled = attribute(sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE)? != 0;
    let legacy = attribute(sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE)? != 0;
    let mut handle = 0;
    let retained = if pooled || legacy {
        Err(())
    } else {
        // SAFETY: out-pointer; `base` starts a mapped range (checked above). Fails for memory not
        // mapped through the virtual-memory API.
        unsafe { sys::cuMemRetainAllocationHandle(&mut handle, base as *mut std::ffi::c_void) }.result().map_err(drop)
    };
    retained.map_err(|()| {
        refuse(
            "not a virtual-memory allocation: cudarc's allocations (a stream-ordered pool's) cannot be shared \
             between processes, and cuMemAlloc memory would need CUDA's legacy IPC, which stalled the peers' \
             queued calls in a test; allocate with ExportableBuffer or Comm::alloc_symmetric, or pass it \
             unregistered (staged)"
                .into(),
        )
    })?;
    // The retained handle is released on every path below.
    let exported = (|| {
        // The driver writes C enums, and the handle types as a bit mask, which need not be values of
        // the bindings' Rust enums: read as plain integers at their C offsets, never as the enums.
        const HANDLE_TYPES: usize = std::mem::offset_of!(sys::CUmemAllocationProp, requestedHandleTypes);
        const LOCATION_ID: usize = std::mem::offset_of!(sys::CUmemAllocationProp, location) + 4;
        let mut prop = std::mem::MaybeUninit::<sys::CUmemAllocationProp>::zeroed();
        // SAFETY: out-pointer to a property struct's storage and the handle retained above.
        unsafe { sys::cuMemGetAllocationPropertiesFromHandle(prop.as_mut_ptr(), handle) }
            .result()
            .map_err(Error::driver("cuMemGetAllocationPropertiesFromHandle"))?;
        let at = |offset: usize| -> u32 {
            // SAFETY: a 4-byte integer inside the struct's initialised storage.
            unsafe { prop.as_ptr().cast::<u8>().add(offset).cast::<u32>().read_unaligned() }
        };
        // `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`'s bit in the C mask.
        const POSIX_FD: u32 = 0x1;
        if at(HANDLE_TYPES) & POSIX_FD == 0 {
            return Err(refuse("its allocation was made without a POSIX file-descriptor handle type".into()));
        }
        let device = at(LOCATION_ID) as i32;
        if device != ctx.ordinal() as i32 {
            return Err(refuse(format!("it is memory of device {device}, the rank's is device {}", ctx.ordinal())));
        }
        Ok(Exported { base, bytes: size, fd: export_handle(handle)? })
    })();
    // SAFETY: the reference `cuMemRetainAllocationHandle` took.
    let _ = unsafe { sys::cuMemRelease(handle) };
    exported
}
