//! Registered user memory: `cuMemAlloc` allocations shared with peers in other processes through
//! CUDA's legacy IPC (`cuIpcGetMemHandle` / `cuIpcOpenMemHandle`).
//!
//! cudarc's own allocations come from stream-ordered pools, which no other process can map: those
//! are staged. Memory from `cuMemAlloc` (torch's caching allocator, a user's own) can be exported,
//! and [`crate::Comm::register`] makes its allocation a region peers map where it is (the zero-copy
//! path). CUDA leaves undefined a free of exported memory that a peer still has open, which is why
//! registration is explicit and unsafe, as NCCL's `ncclCommRegister` is: the registration must end
//! before the memory is freed.

use crate::engine::make_current;
use crate::error::{Error, Result};
use cudarc::driver::{CudaContext, sys};
use std::sync::Arc;

/// Bytes of a legacy IPC handle.
pub(crate) const HANDLE_BYTES: usize = 64;

/// CUDA sub-allocates smaller `cuMemAlloc` allocations from blocks of this size, and IPC then shares
/// the whole block (the other allocations in it too, and a peer cannot open two of them apart):
/// only allocations aligned to it and a multiple of it in size are registered.
pub(crate) const IPC_BLOCK: u64 = 2 << 20;

/// The allocation holding a buffer, exported: its whole range and the handle peers open it by.
pub(crate) struct Exported {
    pub(crate) base: u64,
    pub(crate) bytes: usize,
    pub(crate) handle: [u8; HANDLE_BYTES],
}

/// One pointer attribute of `ptr`, read into a zeroed `T` (the driver writes its own width of it).
fn attribute<T: Default>(ptr: u64, attr: sys::CUpointer_attribute, name: &'static str) -> Result<T> {
    let mut v = T::default();
    // SAFETY: `v` is at least as wide as the attribute's value (u64 addresses and sizes, u32 or
    // bool flags read into a zeroed u32 or larger).
    unsafe { sys::cuPointerGetAttribute((&mut v as *mut T).cast(), attr, ptr) }.result().map_err(|e| {
        Error::PeerMemory { what: format!("reading {name} of the buffer at {ptr:#x}"), why: e.to_string() }
    })?;
    Ok(v)
}

/// Exports the allocation holding `bytes` at `ptr` (device memory of `ctx`), or says why it cannot
/// be: not device memory of this rank's device, or memory IPC cannot export (a stream-ordered
/// pool's, cudarc's allocations among them; a virtual-memory mapping).
pub(crate) fn export(ctx: &Arc<CudaContext>, ptr: u64, bytes: usize) -> Result<Exported> {
    make_current(ctx).map_err(Error::driver("cuCtxSetCurrent"))?;
    use sys::CUpointer_attribute as A;
    let refuse = |why: String| Error::PeerMemory { what: format!("registering the buffer at {ptr:#x}"), why };
    let ordinal: i32 = attribute(ptr, A::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, "the device")?;
    if ordinal != ctx.ordinal() as i32 {
        return Err(refuse(format!("it is memory of device {ordinal}, the rank's is device {}", ctx.ordinal())));
    }
    let capable: u64 = attribute(ptr, A::CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, "IPC capability")?;
    if capable == 0 {
        return Err(refuse(
            "CUDA IPC cannot export its memory (a stream-ordered pool's, as cudarc's allocations, or a \
             virtual-memory mapping): use Comm::alloc_symmetric, or pass it unregistered (staged)"
                .into(),
        ));
    }
    let base: u64 = attribute(ptr, A::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, "the allocation's start")?;
    let size: u64 = attribute(ptr, A::CU_POINTER_ATTRIBUTE_RANGE_SIZE, "the allocation's size")?;
    if !base.is_multiple_of(IPC_BLOCK) || !size.is_multiple_of(IPC_BLOCK) {
        return Err(refuse(format!(
            "its allocation ({size} bytes at {base:#x}) is not whole 2 MiB blocks: CUDA sub-allocates smaller \
             ones and IPC would share the block around it; allocate a multiple of 2 MiB, or pass it \
             unregistered (staged)"
        )));
    }
    if ptr.checked_add(bytes as u64).is_none_or(|end| end > base + size) {
        return Err(refuse(format!("{bytes} bytes run past the end of its allocation ({size} bytes at {base:#x})")));
    }
    // SAFETY: an all-zero handle is a valid out-value.
    let mut handle: sys::CUipcMemHandle = unsafe { std::mem::zeroed() };
    // SAFETY: out-pointer; `base` starts a live allocation of the current context.
    unsafe { sys::cuIpcGetMemHandle(&mut handle, base) }.result().map_err(Error::driver("cuIpcGetMemHandle"))?;
    Ok(Exported { base, bytes: size as usize, handle: handle.reserved.map(|c| c as u8) })
}

/// A peer's allocation opened in this process; closed on drop.
pub(crate) struct IpcMapping {
    ctx: Arc<CudaContext>,
    ptr: u64,
}

// SAFETY: the value only holds a driver address; every use binds the context first.
unsafe impl Send for IpcMapping {}
// SAFETY: as for `Send`; no method mutates through `&self`.
unsafe impl Sync for IpcMapping {}

impl IpcMapping {
    /// Opens the allocation `handle` names (exported by another process) on `ctx`'s device.
    pub(crate) fn open(ctx: &Arc<CudaContext>, handle: &[u8; HANDLE_BYTES]) -> Result<Self> {
        make_current(ctx).map_err(Error::driver("cuCtxSetCurrent"))?;
        // SAFETY: an all-zero handle is a valid value, overwritten with the peer's bytes.
        let mut h: sys::CUipcMemHandle = unsafe { std::mem::zeroed() };
        h.reserved = handle.map(|b| b as std::ffi::c_char);
        let mut ptr = 0;
        let flags = sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32;
        // SAFETY: out-pointer and a handle by value.
        unsafe { sys::cuIpcOpenMemHandle_v2(&mut ptr, h, flags) }
            .result()
            .map_err(Error::driver("cuIpcOpenMemHandle"))?;
        Ok(IpcMapping { ctx: ctx.clone(), ptr })
    }

    /// The address in this process.
    pub(crate) fn ptr(&self) -> u64 {
        self.ptr
    }
}

impl Drop for IpcMapping {
    fn drop(&mut self) {
        // Nothing to report to from a drop; a failure leaves the mapping until the process ends.
        if make_current(&self.ctx).is_ok() {
            // SAFETY: an address `cuIpcOpenMemHandle` returned, closed once.
            let _ = unsafe { sys::cuIpcCloseMemHandle(self.ptr) };
        }
    }
}
