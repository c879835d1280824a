//! The device engine on one CUDA context: the loaded PTX, its kernels, owned device memory, and the
//! launch of a lowered program.
//!
//! This is the layer [`crate::Communicator`] is built on; it is public for tests, benchmarks and users
//! who lower their own programs ([`oxccl_host::lowered::Lowered`]).

use crate::error::{Error, Result};
use cudarc::driver::sys::{self, CUdevice_attribute, CUfunction_attribute};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaStream, DeviceRepr, DriverError, LaunchConfig, result,
};
use cudarc::nvrtc::Ptx;
use oxccl_host::lowered::Lowered;
pub use oxccl_kernels::abi::{
    self, DType, LaunchArgs, Mover, PeerScope, PhaseTimes, RedOp, ReduceMode, Status, Task, TbProgram,
};

/// [`PhaseTimes`] records an engine keeps: one per (rank, CTA).
const PHASE_RECORDS: usize = abi::MAX_RANKS * abi::MAX_CTAS_PER_RANK;
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

/// Device memory allocated with `cuMemAlloc` (not from a stream-ordered pool), so peers can map it.
/// Freed on drop, after the context's queued work; while a per-rank communicator of this
/// process uses the context, only once the last of them is dropped (a free waits for the whole
/// device and would hold up the launches their calls wait for).
pub struct DeviceAlloc {
    ctx: Arc<CudaContext>,
    ptr: sys::CUdeviceptr,
    bytes: usize,
}

impl DeviceAlloc {
    /// Allocates `bytes` (at least 1) and fills them with zeros; the zeros have landed when it
    /// returns (work on any stream sees them).
    pub fn zeroed(ctx: &Arc<CudaContext>, bytes: usize) -> Result<Self> {
        Self::filled(ctx, bytes, &[])
    }

    /// Allocates and fills with `data`, which has landed when it returns.
    pub fn from_bytes(ctx: &Arc<CudaContext>, data: &[u8]) -> Result<Self> {
        Self::filled(ctx, data.len(), data)
    }

    /// `bytes` (at least 1) of zeros, `data` at the start, then a wait for the context: `cuMemsetD8`
    /// and `cuMemcpyHtoD` may return before the device has written, and work queued on
    /// non-blocking streams does not wait for them.
    fn filled(ctx: &Arc<CudaContext>, bytes: usize, data: &[u8]) -> Result<Self> {
        bind(ctx)?;
        // SAFETY: a plain allocation of at least one byte, zeroed before it is handed out.
        let ptr = unsafe { result::malloc_sync(bytes.max(1)) }.map_err(Error::driver("cuMemAlloc"))?;
        let alloc = DeviceAlloc { ctx: ctx.clone(), ptr, bytes: bytes.max(1) };
        // SAFETY: `ptr` holds `bytes` bytes we own.
        unsafe { result::memset_d8_sync(ptr, 0, alloc.bytes) }.map_err(Error::driver("cuMemsetD8"))?;
        if !data.is_empty() {
            // SAFETY: the allocation holds `bytes >= data.len()` bytes.
            unsafe { result::memcpy_htod_sync(alloc.ptr, data) }.map_err(Error::driver("cuMemcpyHtoD"))?;
        }
        sync_context(ctx)?;
        Ok(alloc)
    }

    /// As [`DeviceAlloc::from_bytes`] (`bytes` long, `data` at the start), filled in `stream`'s
    /// order and waited for on that stream alone: a wait for the context would also wait for the
    /// calls other ranks of this process have queued, which may wait for this one.
    pub(crate) fn filled_on(stream: &CudaStream, bytes: usize, data: &[u8]) -> Result<Self> {
        let ctx = stream.context();
        bind(ctx)?;
        let bytes = bytes.max(data.len()).max(1);
        // SAFETY: a plain allocation of at least one byte, filled below before it is handed out.
        let ptr = unsafe { result::malloc_sync(bytes) }.map_err(Error::driver("cuMemAlloc"))?;
        let alloc = DeviceAlloc { ctx: ctx.clone(), ptr, bytes };
        // SAFETY: `ptr` holds `bytes >= data.len()` bytes we own, in the stream's context; `data`
        // outlives the copy (the stream is synchronised before returning).
        unsafe {
            result::memset_d8_async(ptr, 0, bytes, stream.cu_stream()).map_err(Error::driver("cuMemsetD8Async"))?;
            if !data.is_empty() {
                result::memcpy_htod_async(ptr, data, stream.cu_stream()).map_err(Error::driver("cuMemcpyHtoDAsync"))?;
            }
        }
        sync_stream(stream)?;
        Ok(alloc)
    }

    /// The device address.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Size in bytes.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Copies the contents to the host (synchronous).
    pub fn read(&self) -> Result<Vec<u8>> {
        bind(&self.ctx)?;
        let mut out = vec![0u8; self.bytes];
        // SAFETY: the allocation holds `bytes` bytes.
        unsafe { result::memcpy_dtoh_sync(&mut out, self.ptr) }.map_err(Error::driver("cuMemcpyDtoH"))?;
        Ok(out)
    }

    /// Overwrites the first `data.len()` bytes with `data` and waits for the context to finish it:
    /// `cuMemcpyHtoD` may return before its DMA lands, and work queued on non-blocking streams does
    /// not wait for it.
    pub fn write(&self, data: &[u8]) -> Result<()> {
        if data.len() > self.bytes {
            return Err(Error::Config { field: "data", why: format!("{} bytes into {}", data.len(), self.bytes) });
        }
        if data.is_empty() {
            return Ok(());
        }
        bind(&self.ctx)?;
        // SAFETY: the allocation holds at least `data.len()` bytes.
        unsafe { result::memcpy_htod_sync(self.ptr, data) }.map_err(Error::driver("cuMemcpyHtoD"))?;
        sync_context(&self.ctx)
    }

    /// Copies `len` bytes from byte `offset` to the host (synchronous).
    pub fn read_range(&self, offset: usize, len: usize) -> Result<Vec<u8>> {
        if offset.checked_add(len).is_none_or(|e| e > self.bytes) {
            return Err(Error::Config { field: "offset", why: format!("{offset}+{len} beyond {} bytes", self.bytes) });
        }
        bind(&self.ctx)?;
        let mut out = vec![0u8; len];
        if len > 0 {
            // SAFETY: the range lies inside the allocation.
            unsafe { result::memcpy_dtoh_sync(&mut out, self.ptr + offset as u64) }
                .map_err(Error::driver("cuMemcpyDtoH"))?;
        }
        Ok(out)
    }

    /// Zeroes the contents, ordered on `stream`, which must belong to the allocation's context.
    pub fn zero_async(&self, stream: &CudaStream) -> Result<()> {
        stream_on(stream, &self.ctx)?;
        // SAFETY: the allocation holds `bytes` bytes, in the stream's context (checked above), and
        // outlives the queued memset: dropping it waits for the context's queued work first.
        unsafe { result::memset_d8_async(self.ptr, 0, self.bytes, stream.cu_stream()) }
            .map_err(Error::driver("cuMemsetD8Async"))
    }
}

/// A `stream` configuration error unless `stream` belongs to `ctx`, the context of the memory or
/// engine it is to be used with.
pub(crate) fn stream_on(stream: &CudaStream, ctx: &CudaContext) -> Result<()> {
    if stream.context().cu_ctx() == ctx.cu_ctx() {
        return Ok(());
    }
    let (theirs, ours) = (stream.context().ordinal(), ctx.ordinal());
    Err(Error::Config {
        field: "stream",
        why: if theirs == ours {
            format!("a stream of another driver context of GPU {ours} than the one its memory and kernels are on")
        } else {
            format!("a stream of GPU {theirs}, used with memory or kernels of GPU {ours}")
        },
    })
}

impl Drop for DeviceAlloc {
    fn drop(&mut self) {
        release(&self.ctx, Freed::Device(self.ptr));
    }
}

/// Frees that wait for the device, held back while a per-rank communicator of this process
/// uses it (their calls wait for other threads' and processes' launches).
/// `cuMemFree` and `cuMemFreeHost` wait for the whole device and meanwhile hold up the launches
/// that other threads make: a rank that dropped its communicator while its peers on the same GPU
/// were in a call stalled them until their timeout (a peer's launch waited behind the free, the
/// free for the call, the call for that launch). So memory is freed at once only where no user
/// ([`InUse`]) of its context is left, else when the last one goes. One entry per context ever
/// used (by its handle; never removed, so that a user and a free of one context always meet at
/// one lock), each with its own lock: a free waits for its own device only.
static USERS: Mutex<Vec<Arc<Users>>> = Mutex::new(Vec::new());

/// The live users of one context (by its handle) and the frees held back for them.
struct Users {
    ctx: usize,
    state: Mutex<UsersState>,
}

#[derive(Default)]
struct UsersState {
    count: usize,
    held: Vec<(Arc<CudaContext>, Freed)>,
}

/// Memory to free: device memory of `cuMemAlloc`, or page-locked host memory of `cuMemHostAlloc`
/// (its address as a number).
enum Freed {
    Device(sys::CUdeviceptr),
    Host(usize),
}

/// The entry of `ctx`, made on first use.
fn users_of(ctx: &CudaContext) -> Arc<Users> {
    let key = ctx.cu_ctx() as usize;
    let mut all = USERS.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(u) = all.iter().find(|u| u.ctx == key) {
        return u.clone();
    }
    let u = Arc::new(Users { ctx: key, state: Mutex::new(UsersState::default()) });
    all.push(u.clone());
    u
}

impl Users {
    fn state(&self) -> std::sync::MutexGuard<'_, UsersState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A communicator's use of a context: while one lives, memory of that context is not
/// freed ([`USERS`]); the last one to go frees what was held back.
pub(crate) struct InUse {
    users: Arc<Users>,
}

impl InUse {
    pub(crate) fn new(ctx: &Arc<CudaContext>) -> Self {
        let users = users_of(ctx);
        users.state().count += 1;
        InUse { users }
    }

    /// The uses of a communicator's engines' contexts: one each for a per-rank one,
    /// none for one that drives every rank (it launches them all itself: its calls wait for no
    /// other launcher).
    pub(crate) fn of(per_rank: bool, engines: &[Arc<Engine>]) -> Vec<InUse> {
        if per_rank { engines.iter().map(|e| InUse::new(e.context())).collect() } else { Vec::new() }
    }
}

impl Drop for InUse {
    fn drop(&mut self) {
        let mut state = self.users.state();
        state.count -= 1;
        if state.count == 0 {
            let held = std::mem::take(&mut state.held);
            // Under the lock: a user that comes meanwhile waits, rather than launch behind the frees.
            free_now(held);
        }
    }
}

/// Frees `what` of `ctx` now, or when the context's last user goes.
fn release(ctx: &Arc<CudaContext>, what: Freed) {
    let users = users_of(ctx);
    let mut state = users.state();
    if state.count > 0 {
        state.held.push((ctx.clone(), what));
        return;
    }
    // Under the lock, as in `InUse::drop`.
    free_now(vec![(ctx.clone(), what)]);
}

/// Frees `held` after its context's queued work, which may still use it.
fn free_now(held: Vec<(Arc<CudaContext>, Freed)>) {
    // Errors cannot be reported from drop; a failing free leaks the allocation. The context is made
    // current without taking the error cudarc may keep for it: that error belongs to a call that
    // will report it.
    let Some((ctx, _)) = held.first() else { return };
    if make_current(ctx).is_err() {
        return;
    }
    // Work queued on the memory (a launch, a `zero_async`) must end before it is freed, and the
    // frees only may synchronise: wait for the context (every entry is of one context). A failed
    // wait (an earlier launch's error) still frees, as the device then runs nothing of ours.
    let _ = result::ctx::synchronize();
    for (_, f) in held {
        let _ = match f {
            // SAFETY: allocated by `cuMemAlloc` in the context and freed once, here, after its work.
            Freed::Device(ptr) => unsafe { result::free_sync(ptr) },
            // SAFETY: allocated by `cuMemHostAlloc` in the context and freed once, here, after its work.
            Freed::Host(ptr) => unsafe { result::free_host(ptr as *mut std::ffi::c_void) },
        };
    }
}

/// A launch's [`Status`] in page-locked host memory that the device maps: the kernels record errors
/// in it as in device memory, and the host reads it at any time without waiting for them or copying.
/// That lets a call notice an error an earlier call recorded without a stream synchronisation.
pub struct StatusRecord {
    ctx: Arc<CudaContext>,
    host: *mut Status,
    dev: u64,
}

// SAFETY: the record is memory owned by this value, which the host reads and writes only through
// atomic 32-bit accesses, so sharing it between threads is sound.
unsafe impl Send for StatusRecord {}
// SAFETY: as for `Send`.
unsafe impl Sync for StatusRecord {}

impl StatusRecord {
    /// A zeroed record mapped into `ctx`'s device.
    pub fn new(ctx: &Arc<CudaContext>) -> Result<Self> {
        bind(ctx)?;
        let bytes = std::mem::size_of::<Status>();
        let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
        // SAFETY: a page-locked allocation of `bytes` bytes.
        let host =
            unsafe { result::malloc_host(bytes, flags) }.map_err(Error::driver("cuMemHostAlloc"))? as *mut Status;
        // SAFETY: `host` holds `bytes` writable bytes; zeroed before any reference to them exists.
        unsafe { std::ptr::write_bytes(host, 0, 1) };
        // Freed on drop from here on, also if the device address cannot be had.
        let mut record = StatusRecord { ctx: ctx.clone(), host, dev: 0 };
        // SAFETY: `host` was allocated with `CU_MEMHOSTALLOC_DEVICEMAP` in the current context.
        unsafe { sys::cuMemHostGetDevicePointer_v2(&mut record.dev, host.cast(), 0) }
            .result()
            .map_err(Error::driver("cuMemHostGetDevicePointer"))?;
        Ok(record)
    }

    /// The address kernels write the record at.
    pub fn ptr(&self) -> u64 {
        self.dev
    }

    /// The record's 32-bit words (a `Status` is ten of them, page-aligned).
    fn words(&self) -> &[std::sync::atomic::AtomicU32] {
        const WORDS: usize = std::mem::size_of::<Status>() / 4;
        // SAFETY: `host` holds one `Status` (40 bytes, page-aligned) for as long as `self` lives, and
        // the host touches it only through these atomics.
        unsafe { std::slice::from_raw_parts(self.host.cast::<std::sync::atomic::AtomicU32>(), WORDS) }
    }

    /// How many errors launches have recorded that the host can see so far: a launch's record
    /// reaches host memory as it is written, and at the latest when the launch ends (the first
    /// error's details are complete from then on).
    pub fn errors(&self) -> u32 {
        self.words()[0].load(Ordering::Acquire)
    }

    /// The record (complete once the launches that write it have ended).
    pub fn read(&self) -> Status {
        let mut w = [0u32; std::mem::size_of::<Status>() / 4];
        for (v, a) in w.iter_mut().zip(self.words()) {
            *v = a.load(Ordering::Acquire);
        }
        bytemuck::cast(w)
    }

    /// Zeroes the record. An error a launch records meanwhile may be lost: callers clear it only
    /// with no launch that writes it queued or running.
    pub fn clear(&self) {
        for a in self.words() {
            a.store(0, Ordering::Release);
        }
    }
}

impl Drop for StatusRecord {
    fn drop(&mut self) {
        // A launch may still record an error in it: freed after the context's work (see `release`).
        release(&self.ctx, Freed::Host(self.host as usize));
    }
}

/// A program's table on its device: an allocation of the engine's table pool ([`Engine::upload`]),
/// freed in the order of the stream its launches run on when dropped.
struct Table {
    ptr: sys::CUdeviceptr,
    stream: Arc<CudaStream>,
    /// Outlives its allocations: freeing a table of a pool destroyed before it faults in the driver.
    _pool: Arc<Uploads>,
}

impl Drop for Table {
    fn drop(&mut self) {
        // After the launches queued on the stream, which may still read it. Errors cannot be
        // reported from drop: a failed free leaves the memory to the pool's destruction.
        if make_current(self.stream.context()).is_ok() {
            // SAFETY: an allocation of the table pool, freed once, in the order of the only stream
            // its launches are queued on.
            let _ = unsafe { sys::cuMemFreeAsync(self.ptr, self.stream.cu_stream()) };
        }
    }
}

/// Page-locked bytes the tables are copied from (the address of a `cuMemHostAlloc`).
struct Staging(*mut u8);

// SAFETY: the pointer is only written under the `Uploads` mutex that holds it.
unsafe impl Send for Staging {}

/// Bytes of page-locked staging per engine (a larger table is copied in pieces).
const STAGING_BYTES: usize = 256 << 10;

/// How programs' tables reach the device while calls are queued: copied from page-locked memory,
/// on a stream that waits for nothing, into a memory pool that never makes an allocation wait for
/// another stream's free. A copy from pageable memory on the rank's stream can wait in the host
/// (in the driver's staging, holding up other threads' driver calls) behind the rank's queued
/// calls, which may wait for a peer whose launches that wait holds up.
struct Uploads {
    ctx: Arc<CudaContext>,
    /// Copies only: its work never waits for another stream's. Made through the driver, not
    /// cudarc: a cudarc stream would switch the context to cudarc's multi-stream mode, where every
    /// use of every buffer records events (on 8 virtual ranks, a small call took 20–30 µs instead
    /// of 6–7).
    stream: sys::CUstream,
    pool: sys::CUmemoryPool,
    staging: Mutex<Staging>,
}

// SAFETY: the pool is a driver handle used with its context bound; `staging` is behind a mutex.
unsafe impl Send for Uploads {}
// SAFETY: as for `Send`.
unsafe impl Sync for Uploads {}

impl Uploads {
    fn new(ctx: &Arc<CudaContext>) -> Result<Self> {
        bind(ctx)?;
        let stream =
            result::stream::create(result::stream::StreamKind::NonBlocking).map_err(Error::driver("cuStreamCreate"))?;
        // Destroyed in `Uploads::drop` from the moment it exists below; until then, here.
        let destroy = |e| {
            // SAFETY: the stream just made, with no work.
            let _ = unsafe { result::stream::destroy(stream) };
            e
        };
        // SAFETY: all-zero pool properties are valid (no handle types, no size cap); type and
        // location set below.
        let mut props: sys::CUmemPoolProps = unsafe { std::mem::zeroed() };
        props.allocType = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        props.location = device_location(ctx.ordinal());
        let mut pool = std::ptr::null_mut();
        // SAFETY: out-pointer and valid properties, the context current.
        unsafe { sys::cuMemPoolCreate(&mut pool, &props) }
            .result()
            .map_err(Error::driver("cuMemPoolCreate"))
            .map_err(destroy)?;
        // SAFETY: a page-locked allocation of `STAGING_BYTES`, freed in `Uploads::drop` (or below).
        let host = match unsafe { result::malloc_host(STAGING_BYTES, 0) } {
            Ok(h) => h.cast::<u8>(),
            Err(e) => {
                // SAFETY: the pool just made, with no allocation.
                unsafe { sys::cuMemPoolDestroy(pool) };
                return Err(destroy(Error::driver("cuMemHostAlloc")(e)));
            }
        };
        let uploads = Uploads { ctx: ctx.clone(), stream, pool, staging: Mutex::new(Staging(host)) };
        // Reuse only frees that have completed: an allocation the driver made wait for a rank's
        // stream would put the copies behind that rank's calls. Freed memory is kept for reuse.
        let set = |attr, value: *const std::ffi::c_void| {
            // SAFETY: the pool made above; `value` points at the type `attr` takes.
            unsafe { sys::cuMemPoolSetAttribute(pool, attr, value.cast_mut()) }
                .result()
                .map_err(Error::driver("cuMemPoolSetAttribute"))
        };
        use sys::CUmemPool_attribute::*;
        set(CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES, (&0i32 as *const i32).cast())?;
        set(CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, (&u64::MAX as *const u64).cast())?;
        Ok(uploads)
    }

    /// `bytes` (at least one byte) on the device, complete when this returns: launches queued on
    /// any stream afterwards read them, and they are freed in `stream`'s order when dropped.
    fn table(self: &Arc<Self>, bytes: &[u8], stream: &Arc<CudaStream>) -> Result<Table> {
        let data = if bytes.is_empty() { &[0u8][..] } else { bytes };
        let staging = self.staging.lock().unwrap_or_else(|e| e.into_inner());
        bind(&self.ctx)?;
        let on = self.stream;
        let mut ptr = 0;
        // SAFETY: out-pointer, this engine's pool and stream, the context current.
        unsafe { sys::cuMemAllocFromPoolAsync(&mut ptr, data.len(), self.pool, on) }
            .result()
            .map_err(Error::driver("cuMemAllocFromPoolAsync"))?;
        // Freed from here on, also if a copy fails.
        let table = Table { ptr, stream: stream.clone(), _pool: self.clone() };
        for (i, piece) in data.chunks(STAGING_BYTES).enumerate() {
            // SAFETY: the staging holds `STAGING_BYTES >= piece.len()` bytes, written only under its
            // mutex, and no copy from it is in flight (each is waited for below).
            let host = unsafe {
                std::ptr::copy_nonoverlapping(piece.as_ptr(), staging.0, piece.len());
                std::slice::from_raw_parts(staging.0, piece.len())
            };
            // SAFETY: the destination lies inside the allocation; the source is page-locked and
            // stays unchanged until the wait below.
            unsafe { result::memcpy_htod_async(ptr + (i * STAGING_BYTES) as u64, host, on) }
                .map_err(Error::driver("cuMemcpyHtoDAsync"))?;
            // The copy stream waits for nothing else: this waits for the copy alone. Once it has
            // ended, the allocation and its bytes are complete for every stream.
            // SAFETY: a live stream of the current context.
            unsafe { result::stream::synchronize(on) }.map_err(Error::driver("cuStreamSynchronize"))?;
        }
        Ok(table)
    }
}

impl Drop for Uploads {
    fn drop(&mut self) {
        // No copy is in flight (each upload waits for its own), and every table's free is queued
        // (each holds the pool); the driver destroys the pool once those frees have run.
        let staging = self.staging.get_mut().unwrap_or_else(|e| e.into_inner());
        release(&self.ctx, Freed::Host(staging.0 as usize));
        if make_current(&self.ctx).is_ok() {
            // SAFETY: the pool and the stream made in `new`, destroyed once; the stream has no
            // work left.
            unsafe {
                let _ = sys::cuMemPoolDestroy(self.pool);
                let _ = result::stream::destroy(self.stream);
            }
        }
    }
}

/// A lowered program uploaded to one device.
pub struct DeviceProgram {
    programs: Table,
    tasks: Table,
    /// The stream [`Engine::upload`] ordered the tables on: the only one it launches on.
    stream: Arc<CudaStream>,
    /// CTAs of the launch (programs).
    pub ctas: u32,
    /// Shared-memory slots per stage the TMA mover needs.
    pub slots: u32,
    /// Whether the CTA needs more than one warp (see `Lowered::combines`).
    pub combines: bool,
    /// The longest task (the TMA mover counts a task's chunks in 32 bits).
    pub max_task_bytes: u64,
}

/// How to launch a program: mover, operator, CTA shape and pipeline.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LaunchSpec {
    /// The data mover: TMA (bulk copies and reductions issued by one thread) or SIMT (all threads).
    pub mover: Mover,
    /// The element type.
    pub dtype: DType,
    /// The reduction operator (`Sum` where nothing is reduced).
    pub op: RedOp,
    /// Threads per CTA (multiple of 32).
    pub threads: u32,
    /// Bytes per source per pipeline stage (TMA mover).
    pub chunk_bytes: u32,
    /// Pipeline stages (TMA mover).
    pub stages: u32,
    /// How the TMA mover reduces: in registers, or with `cp.reduce.async.bulk` where the hardware
    /// supports the type and operator.
    pub reduce_mode: ReduceMode,
    /// Every device-side wait gives up after this many nanoseconds and reports a timeout: at least
    /// 1 and at most [`MAX_TIMEOUT`](crate::MAX_TIMEOUT) ([`Engine::check`] refuses others).
    pub timeout_ns: u64,
    /// Suspend-time hint for waits (ns); 0 spins.
    pub wait_suspend_ns: u32,
    /// Issuing warps of a TMA CTA (0 or 1: one; see `abi::LaunchArgs::issuers`).
    pub issuers: u32,
    /// Combines into several destinations store from registers (`abi::LaunchArgs::combine_direct`).
    pub combine_direct: bool,
    /// What the call is, compared between ranks at the start barrier (`abi::LaunchArgs::call_key`;
    /// 0: unchecked).
    pub call_key: u32,
    /// How far the barriers' flags reach: [`PeerScope::Gpu`] only where every rank the launch
    /// meets runs on the launching GPU.
    pub peer_scope: PeerScope,
    /// A program whose every task moves fewer than this many bytes runs on the latency mover
    /// ([`Mover::Latency`], [`abi::LATENCY_THREADS`] threads), whatever `mover` says: its moves are
    /// bound by memory latency, which that mover's loads of all sources in flight together cut
    /// (0: never; see [`Config::latency_below`](crate::Config::latency_below)).
    pub latency_below: u64,
}

impl LaunchSpec {
    /// The launch of a program whose largest task moves `max_task_bytes` on the latency mover,
    /// where `latency_below` says so (`None`: as it is).
    pub fn for_latency(&self, max_task_bytes: u64) -> Option<LaunchSpec> {
        let switch = self.mover != mover_for(self.mover, self.latency_below, max_task_bytes);
        switch.then_some(LaunchSpec { mover: Mover::Latency, threads: abi::LATENCY_THREADS, ..*self })
    }
}

/// The mover a launch configured for `mover` runs a program whose largest task moves
/// `max_task_bytes` on: [`Mover::Latency`] below `latency_below` ([`LaunchSpec::latency_below`]).
pub fn mover_for(mover: Mover, latency_below: u64, max_task_bytes: u64) -> Mover {
    if max_task_bytes < latency_below { Mover::Latency } else { mover }
}

/// Per-kernel facts read from the driver.
#[derive(Clone, Copy, Debug)]
pub struct KernelInfo {
    /// Registers per thread.
    pub registers: u32,
    /// Local memory per thread (spills), bytes.
    pub local_bytes: u32,
}

/// How a module's device code was loaded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ModuleCode {
    /// The shipped sm_90a machine code (`ptx/*.sm_90a.cubin`): nothing compiled at load.
    Prebuilt,
    /// The PTX, compiled by the driver at load (its cache keeps the result for later processes).
    Ptx,
}

impl std::fmt::Display for ModuleCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ModuleCode::Prebuilt => "prebuilt sm_90a code",
            ModuleCode::Ptx => "PTX compiled by the driver",
        })
    }
}

/// Loads a module from its prebuilt code where the build has it, else (or where the driver refuses
/// that code as not for it: a driver older than the `ptxas` that made it may) from its PTX. `OXCCL_MODULE` chooses:
/// `auto` (the default, as described), `ptx` (always the PTX) or `prebuilt` (the prebuilt code or an
/// error).
fn load_module(
    ctx: &Arc<CudaContext>,
    ptx: &'static str,
    prebuilt: &'static [u8],
) -> Result<(Arc<CudaModule>, ModuleCode)> {
    let choice = module_choice(&std::env::var("OXCCL_MODULE").unwrap_or_default())?;
    // SAFETY: `prebuilt` is empty or a whole image the build embedded after checking its hash
    // against ptx/cubins.txt.
    unsafe { load_module_as(ctx, ptx, prebuilt, choice) }
}

/// The engine's loading rule with the `OXCCL_MODULE` choice given: `None` loads `prebuilt` (when not empty) and falls
/// back to `ptx` where the driver refuses the code as not for it (`CUDA_ERROR_INVALID_IMAGE`,
/// `CUDA_ERROR_NO_BINARY_FOR_GPU`, `CUDA_ERROR_UNSUPPORTED_PTX_VERSION`); `Some` loads that code
/// or fails.
///
/// A `ptx` with a NUL byte is an [`Error::Config`] (cudarc would panic making it a C string).
///
/// # Safety
///
/// `prebuilt` must be empty or a whole module image, and `ptx` PTX text (the driver tells text
/// from an image by its first bytes): `cuModuleLoadData` takes no length and reads as far as an
/// image's own headers say (a cut-off image made it read past the end and kill the process on an
/// H200).
pub unsafe fn load_module_as(
    ctx: &Arc<CudaContext>,
    ptx: &str,
    prebuilt: &[u8],
    choice: Option<ModuleCode>,
) -> Result<(Arc<CudaModule>, ModuleCode)> {
    if ptx.contains('\0') {
        return Err(Error::Config { field: "ptx", why: "PTX text with a NUL byte".into() });
    }
    let from_ptx =
        || ctx.load_module(Ptx::from_src(ptx)).map(|m| (m, ModuleCode::Ptx)).map_err(Error::driver("cuModuleLoadData"));
    let from_prebuilt = || {
        // A heap copy (cudarc takes the image as a `Vec<u8>`): the driver parses it as an ELF file,
        // and the system allocator aligns a block this large further than `include_bytes!` does.
        ctx.load_module(Ptx::from_binary(prebuilt.to_vec()))
            .map(|m| (m, ModuleCode::Prebuilt))
            .map_err(Error::driver("cuModuleLoadData"))
    };
    // What a driver answers for machine code it cannot use; anything else (out of memory, a lost
    // device) is reported as it is.
    let refused = |e: &Error| {
        use sys::CUresult::{
            CUDA_ERROR_INVALID_IMAGE, CUDA_ERROR_NO_BINARY_FOR_GPU, CUDA_ERROR_UNSUPPORTED_PTX_VERSION,
        };
        matches!(e, Error::Driver { source, .. }
            if matches!(source.0, CUDA_ERROR_INVALID_IMAGE | CUDA_ERROR_NO_BINARY_FOR_GPU | CUDA_ERROR_UNSUPPORTED_PTX_VERSION))
    };
    match choice {
        Some(ModuleCode::Ptx) => from_ptx(),
        Some(ModuleCode::Prebuilt) if prebuilt.is_empty() => Err(Error::Config {
            field: "OXCCL_MODULE",
            why: "prebuilt: this build has no prebuilt code (its PTX differs from the PTX the shipped code was made from)"
                .into(),
        }),
        Some(ModuleCode::Prebuilt) => from_prebuilt(),
        None if prebuilt.is_empty() => from_ptx(),
        None => match from_prebuilt() {
            Err(e) if refused(&e) => from_ptx(),
            loaded => loaded,
        },
    }
}

/// Loads the engine's kernels from the file at `path` (`OXCCL_ENGINE_PTX`) instead of the embedded
/// code: a changed engine built from this build's device sources (the same ABI) tried without
/// rebuilding the host, as PTX (compiled by the driver, minutes for the whole engine) or as
/// `ptxas` output for the device (an ELF image, loaded at once). A file that cannot be read, or an
/// image cut short, is an [`Error::Config`]; one that lacks a kernel fails as the load of every
/// kernel does.
fn load_engine_file(ctx: &Arc<CudaContext>, path: &std::path::Path) -> Result<(Arc<CudaModule>, ModuleCode)> {
    match read_engine_file(path)? {
        // SAFETY: no prebuilt image is passed; `ptx` is text (a file that is not PTX is refused by
        // the driver's compiler, which reads it as text up to its NUL-free end).
        EngineFile::Ptx(ptx) => unsafe { load_module_as(ctx, &ptx, &[], Some(ModuleCode::Ptx)) },
        // SAFETY: a whole ELF image (its tables and every section and segment inside the file,
        // checked on reading).
        EngineFile::Image(image) => unsafe { load_module_as(ctx, "", &image, Some(ModuleCode::Prebuilt)) },
    }
}

/// What `OXCCL_ENGINE_PTX` names: PTX text, or a device image.
#[derive(Debug, PartialEq, Eq)]
enum EngineFile {
    Ptx(String),
    Image(Vec<u8>),
}

/// The file `OXCCL_ENGINE_PTX` names; an [`Error::Config`] naming the variable and the file where
/// it cannot be read, is neither text nor an ELF image, or is an image whose tables or contents
/// reach past its end (the driver would read past the buffer).
fn read_engine_file(path: &std::path::Path) -> Result<EngineFile> {
    let bad = |why: String| Error::Config { field: "OXCCL_ENGINE_PTX", why: format!("{}: {why}", path.display()) };
    let bytes = std::fs::read(path).map_err(|e| bad(e.to_string()))?;
    if bytes.starts_with(b"\x7fELF") {
        return match elf_end(&bytes) {
            Some(end) if end <= bytes.len() as u64 => Ok(EngineFile::Image(bytes)),
            _ => Err(bad(format!(
                "not a whole 64-bit ELF image (its tables or contents reach past its {} bytes, or are malformed)",
                bytes.len()
            ))),
        };
    }
    String::from_utf8(bytes).map(EngineFile::Ptx).map_err(|_| bad("neither PTX text nor an ELF image".into()))
}

/// Where a 64-bit little-endian ELF image's contents end (its header, its section and program
/// header tables, and every section and segment body they point at: the file must hold that much),
/// or `None` where it is not one or its tables are malformed (entry sizes other than ELF64's).
fn elf_end(b: &[u8]) -> Option<u64> {
    // The little-endian integer of `width` bytes at `at`.
    let int = |at: u64, width: usize| -> Option<u64> {
        let at = usize::try_from(at).ok()?;
        let bytes = b.get(at..at.checked_add(width)?)?;
        Some(bytes.iter().rev().fold(0u64, |v, &x| v << 8 | x as u64))
    };
    // ELFCLASS64, little-endian, and the header itself.
    if b.get(4..6)? != [2, 1] || b.len() < 64 {
        return None;
    }
    let mut end = 64u64;
    // Program headers (ELF64: 56 bytes, the body at p_offset 0x08 of p_filesz 0x20) and section
    // headers (64 bytes, the body at sh_offset 0x18 of sh_size 0x20; SHT_NOBITS, 8, has none):
    // (table offset, entry size and count fields, the entry size, whether entries have a type
    // without a body).
    for (off, size, count, want, typed) in [(0x20, 0x36, 0x38, 56, false), (0x28, 0x3a, 0x3c, 64, true)] {
        let (table, entry, n) = (int(off, 8)?, int(size, 2)?, int(count, 2)?);
        if n == 0 {
            continue;
        }
        if entry != want {
            return None;
        }
        end = end.max(table.checked_add(entry * n)?);
        for i in 0..n {
            let e = table + i * entry;
            if typed && int(e + 4, 4)? == 8 {
                continue;
            }
            let (at, len) = (int(e + if typed { 0x18 } else { 0x08 }, 8)?, int(e + 0x20, 8)?);
            end = end.max(at.checked_add(len)?);
        }
    }
    Some(end)
}

/// `OXCCL_MODULE`'s value: `None` for `auto` (or unset), else the code it asks for.
fn module_choice(value: &str) -> Result<Option<ModuleCode>> {
    match value {
        "" | "auto" => Ok(None),
        "ptx" => Ok(Some(ModuleCode::Ptx)),
        "prebuilt" => Ok(Some(ModuleCode::Prebuilt)),
        other => Err(Error::Config { field: "OXCCL_MODULE", why: format!("{other:?}: give auto, ptx or prebuilt") }),
    }
}

/// The engine on one CUDA context.
pub struct Engine {
    ctx: Arc<CudaContext>,
    /// How the engine module was loaded (its kernels, in `functions`, hold it loaded).
    pub code: ModuleCode,
    /// Every kernel of the engine module (`abi::KERNELS`), loaded by [`Engine::new`].
    functions: HashMap<&'static str, CudaFunction>,
    /// CTAs per SM by (kernel, threads, dynamic shared memory).
    occupancy: Mutex<HashMap<OccupancyKey, u32>>,
    /// Multiprocessors of the device.
    pub sms: u32,
    /// Most dynamic shared memory one CTA may use (opt-in limit).
    pub max_smem: u32,
    /// Where `OXCCL_DEBUG` names `phases`: every CTA's [`PhaseTimes`], by (rank, CTA).
    phase_times: Option<DeviceAlloc>,
    /// How the collective kernels are queued: early, unless `OXCCL_DEBUG` names `serial-launches`
    /// (read once here, not per launch).
    start: Start,
    /// Where [`Engine::upload`] copies tables (held by them too).
    uploads: Arc<Uploads>,
}

/// Whether `OXCCL_DEBUG` (a comma-separated list of diagnostics) names any of `names`:
/// - `phases`: every launch adds where each CTA's time went to its engine's records
///   ([`Engine::phase_times`]);
/// - `serial-launches`: every collective kernel is scheduled only after its stream's previous work
///   has ended ([`Start::AfterPrevious`]), to measure what launching early saves;
/// - `staged` (or `all`): the staged inter-node steps are printed as they are queued.
pub(crate) fn debug_names(names: &[&str]) -> bool {
    std::env::var("OXCCL_DEBUG").is_ok_and(|v| v.split(',').any(|t| names.contains(&t.trim())))
}

impl Engine {
    /// Loads the engine module on `ctx`: its prebuilt sm_90a code, else its PTX (see [`ModuleCode`];
    /// compiling the PTX takes the driver tens of seconds the first time, cached across processes).
    /// Every kernel in it is loaded here, not at a call: loaded lazily by the driver at a call, a
    /// kernel's first launch waited on the device for every stream of the context (docs/PERF.md).
    pub fn new(ctx: &Arc<CudaContext>) -> Result<Self> {
        let (major, minor) = ctx.compute_capability().map_err(Error::driver("cuDeviceGetAttribute"))?;
        if major != 9 {
            return Err(Error::UnsupportedDevice { ordinal: ctx.ordinal(), major, minor });
        }
        let (module, code) = match std::env::var_os("OXCCL_ENGINE_PTX") {
            Some(path) => load_engine_file(ctx, std::path::Path::new(&path))?,
            None => load_module(ctx, crate::ptx::KERNELS, crate::ptx::KERNELS_SM90A)?,
        };
        let attr = |a| ctx.attribute(a).map_err(Error::driver("cuDeviceGetAttribute"));
        let sms = attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as u32;
        let max_smem = attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)? as u32;
        let functions = load_all(&module, abi::KERNELS, max_smem)?;
        let phase_times = if debug_names(&["phases"]) {
            Some(DeviceAlloc::zeroed(ctx, PHASE_RECORDS * std::mem::size_of::<PhaseTimes>())?)
        } else {
            None
        };
        Ok(Engine {
            ctx: ctx.clone(),
            code,
            functions,
            occupancy: Mutex::new(HashMap::new()),
            sms,
            max_smem,
            phase_times,
            start: if debug_names(&["serial-launches"]) { Start::AfterPrevious } else { Start::Early },
            uploads: Arc::new(Uploads::new(ctx)?),
        })
    }

    /// Where `OXCCL_DEBUG` names `phases`: the phase times every CTA of this engine's launches has
    /// added since [`Engine::reset_phase_times`], as (rank, CTA, record) where it recorded calls
    /// (read without waiting for launches: synchronise first); `None` otherwise.
    pub fn phase_times(&self) -> Result<Option<Vec<(usize, usize, PhaseTimes)>>> {
        let Some(a) = &self.phase_times else { return Ok(None) };
        let bytes = a.read()?;
        let all: Vec<PhaseTimes> =
            bytes.chunks_exact(std::mem::size_of::<PhaseTimes>()).map(bytemuck::pod_read_unaligned).collect();
        let per = abi::MAX_CTAS_PER_RANK;
        Ok(Some(
            all.into_iter().enumerate().filter(|(_, r)| r.calls != 0).map(|(i, r)| (i / per, i % per, r)).collect(),
        ))
    }

    /// Zeroes rank `rank`'s phase times (where kept) in `stream`'s order and waits for that stream
    /// alone (a wait for the context would wait for other ranks' calls, which may wait for this
    /// one): call it where the rank's launches have ended, on the stream they run on. The next call
    /// then counts no gap before it.
    pub fn reset_phase_times(&self, rank: usize, stream: &CudaStream) -> Result<()> {
        let Some(a) = &self.phase_times else { return Ok(()) };
        if rank >= abi::MAX_RANKS {
            return Err(Error::NoSuchRank { rank, ranks: abi::MAX_RANKS });
        }
        stream_on(stream, &self.ctx)?;
        let bytes = abi::MAX_CTAS_PER_RANK * std::mem::size_of::<PhaseTimes>();
        // SAFETY: rank `rank`'s records lie inside the allocation, which the engine keeps alive
        // past the memset (waited for below).
        unsafe { result::memset_d8_async(a.ptr() + (rank * bytes) as u64, 0, bytes, stream.cu_stream()) }
            .map_err(Error::driver("cuMemsetD8Async"))?;
        sync_stream(stream)
    }

    /// The engine of `ctx`, shared by every communicator on that context while any holds it:
    /// the PTX is loaded, and kernel handles and occupancy queried, once per context rather than once
    /// per communicator.
    pub fn shared(ctx: &Arc<CudaContext>) -> Result<Arc<Self>> {
        static ENGINES: Mutex<Vec<(usize, std::sync::Weak<Engine>)>> = Mutex::new(Vec::new());
        let key = ctx.cu_ctx() as usize;
        let mut engines = ENGINES.lock().unwrap_or_else(|e| e.into_inner());
        engines.retain(|(_, e)| e.strong_count() > 0);
        if let Some(e) = engines.iter().find(|(k, _)| *k == key).and_then(|(_, e)| e.upgrade()) {
            return Ok(e);
        }
        let e = Arc::new(Engine::new(ctx)?);
        engines.push((key, Arc::downgrade(&e)));
        Ok(e)
    }

    /// The context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The engine kernel for (mover, dtype, op), with its dynamic shared-memory limit raised (loaded
    /// by [`Engine::new`]).
    pub fn function(&self, mover: Mover, dtype: DType, op: RedOp) -> Result<CudaFunction> {
        kernel(&self.functions, abi::kernel_name(mover, dtype, op), (mover, dtype, op))
    }

    /// Registers and local memory of an engine kernel.
    pub fn kernel_info(&self, mover: Mover, dtype: DType, op: RedOp) -> Result<KernelInfo> {
        let f = self.function(mover, dtype, op)?;
        Ok(KernelInfo {
            registers: f.num_regs().map_err(Error::driver("cuFuncGetAttribute"))? as u32,
            local_bytes: f.local_size_bytes().map_err(Error::driver("cuFuncGetAttribute"))? as u32,
        })
    }

    /// Uploads the programs `range` of `l` (one launch's CTAs) and all its tasks, for launches on
    /// `stream` (of this engine's context).
    ///
    /// The program's structure is checked first (task ranges, rank and CTA indices, descriptors,
    /// range arithmetic): the device indexes its tables by them. The tables are copied on a stream
    /// of the engine's that waits for nothing (so the host waits for no queued call, not even
    /// `stream`'s) and are complete when this returns. [`Engine::launch`] launches the program on
    /// `stream` only; its tables are freed in `stream`'s order when it is dropped.
    pub fn upload(
        &self,
        l: &Lowered,
        range: std::ops::Range<usize>,
        stream: &Arc<CudaStream>,
    ) -> Result<DeviceProgram> {
        oxccl_host::lowered::validate_structure(l)?;
        stream_on(stream, &self.ctx)?;
        let programs = l.programs.get(range.clone()).ok_or(Error::Config {
            field: "programs",
            why: format!("range {range:?} outside the {} programs", l.programs.len()),
        })?;
        Ok(DeviceProgram {
            programs: self.uploads.table(bytemuck::cast_slice(programs), stream)?,
            tasks: self.uploads.table(bytemuck::cast_slice(&l.tasks), stream)?,
            stream: stream.clone(),
            ctas: programs.len() as u32,
            slots: l.slots,
            combines: l.combines,
            max_task_bytes: l.tasks.iter().map(|t| t.bytes).max().unwrap_or(0),
        })
    }

    /// Dynamic shared memory a launch needs (`usize::MAX` where the product overflows, which no
    /// device allows).
    pub fn smem_bytes(spec: &LaunchSpec, slots: u32) -> usize {
        match spec.mover {
            Mover::Tma => abi::smem::bytes(spec.stages as usize, slots as usize, spec.chunk_bytes as usize),
            Mover::Simt | Mover::Latency => abi::smem::STAGES,
        }
    }

    /// Checks that `spec` can launch `ctas` co-resident CTAs of a program needing `slots` slots.
    pub fn check(&self, spec: &LaunchSpec, ctas: u32, slots: u32) -> Result<()> {
        let cfg = |field, why: String| Err(Error::Config { field, why });
        crate::config::check_timeout(std::time::Duration::from_nanos(spec.timeout_ns))?;
        // The most the mover's kernels are compiled for.
        crate::config::check_threads("threads", spec.threads, spec.mover.max_threads())?;
        if spec.mover == Mover::Tma {
            crate::config::check_chunk_bytes("chunk_bytes", spec.chunk_bytes)?;
            crate::config::check_stages("stages", spec.stages)?;
            if spec.issuers > 1 {
                let why = if spec.issuers > abi::MAX_ISSUERS {
                    Some(format!("{} is above {}", spec.issuers, abi::MAX_ISSUERS))
                } else if !spec.stages.is_multiple_of(spec.issuers) {
                    Some(format!(
                        "{}: the {} stages must be a multiple (each issuer owns a share)",
                        spec.issuers, spec.stages
                    ))
                } else if spec.issuers > spec.threads / 32 {
                    Some(format!("{}: the CTA has {} warps", spec.issuers, spec.threads / 32))
                } else if slots > 1 {
                    Some(format!(
                        "{}: the launch combines {slots} sources in registers through the whole ring",
                        spec.issuers
                    ))
                } else {
                    None
                };
                if let Some(why) = why {
                    return cfg("issuers", why);
                }
            }
            if spec.chunk_bytes as u64 * slots as u64 >= 1 << 20 {
                return cfg(
                    "chunk_bytes",
                    format!("{} × {slots} sources exceeds an mbarrier's 1 MiB", spec.chunk_bytes),
                );
            }
        }
        let smem = Self::smem_bytes(spec, slots);
        if smem > self.max_smem as usize {
            return cfg(
                "chunk_bytes",
                format!(
                    "{} stages × {slots} sources × {} B = {smem} B of shared memory; the device allows {}",
                    spec.stages, spec.chunk_bytes, self.max_smem
                ),
            );
        }
        let per_sm = self.ctas_per_sm(spec, smem)?;
        let max = per_sm * self.sms;
        if ctas > max {
            // Not even one CTA: say what the kernel's registers allow, the usual reason.
            let registers = if per_sm == 0 {
                let regs = self.function(spec.mover, spec.dtype, spec.op)?.num_regs().unwrap_or(0).max(0) as u32;
                format!(" (the kernel takes {regs} registers per thread: {})", threads_for_registers(regs))
            } else {
                String::new()
            };
            return Err(Error::TooManyCtas {
                requested: ctas,
                max,
                why: format!(
                    "{per_sm} CTA(s) of {} threads and {smem} B shared memory fit per SM{registers}, {} SMs; all \
                     CTAs of a launch must be resident at once",
                    spec.threads, self.sms
                ),
            });
        }
        Ok(())
    }

    /// CTAs of `spec`'s kernel with `smem` bytes of shared memory that fit on one SM, from the
    /// driver's occupancy calculator once per (kernel, threads, shared memory): every call checks it.
    fn ctas_per_sm(&self, spec: &LaunchSpec, smem: usize) -> Result<u32> {
        let key = (spec.mover, spec.dtype, spec.op, spec.threads, smem);
        if let Some(&n) = self.occupancy.lock().unwrap_or_else(|e| e.into_inner()).get(&key) {
            return Ok(n);
        }
        // The loading and the query run in the calling thread's current context: a thread's first
        // call may come before anything else bound this GPU's.
        bind(&self.ctx)?;
        let f = self.function(spec.mover, spec.dtype, spec.op)?;
        let n = f
            .occupancy_max_active_blocks_per_multiprocessor(spec.threads, smem, None)
            .map_err(Error::driver("cuOccupancyMaxActiveBlocksPerMultiprocessor"))?;
        self.occupancy.lock().unwrap_or_else(|e| e.into_inner()).insert(key, n);
        Ok(n)
    }

    /// Launches `prog` on `stream` (a program from [`Engine::upload`] only on the stream it was
    /// uploaded on, else a `stream` configuration error).
    ///
    /// # Safety
    /// `buffers` and `workspaces` hold valid device addresses for everything the program's tasks
    /// touch, alive until the launch completes; `status` addresses a writable [`Status`] (a
    /// [`StatusRecord`]'s, or device memory) that stays valid until the launch completes; the ranks the
    /// program's barriers name are launched too (or their waits time out); `prog` is dropped only
    /// after the launch is queued (its tables are freed in their stream's order).
    pub unsafe fn launch(
        &self,
        stream: &CudaStream,
        prog: &DeviceProgram,
        spec: &LaunchSpec,
        buffers: [[u64; abi::BUFFER_SLOTS]; abi::MAX_RANKS],
        workspaces: [u64; abi::MAX_RANKS],
        status: u64,
    ) -> Result<()> {
        // SAFETY: forwarded contract.
        unsafe { self.launch_as(stream, prog, spec, buffers, workspaces, status, true) }
    }

    /// [`Engine::launch`], launched early behind the stream's previous kernel where `early` (and
    /// `OXCCL_DEBUG=serial-launches` does not say otherwise), else after it has ended: a launch
    /// whose CTAs meet only some ranks must not take the room that other ranks' calls still need
    /// (its next launch would hold multiprocessors while peers that meet no one it waits for
    /// cannot be placed).
    ///
    /// # Safety
    /// As [`Engine::launch`].
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn launch_as(
        &self,
        stream: &CudaStream,
        prog: &DeviceProgram,
        spec: &LaunchSpec,
        buffers: [[u64; abi::BUFFER_SLOTS]; abi::MAX_RANKS],
        workspaces: [u64; abi::MAX_RANKS],
        status: u64,
        early: bool,
    ) -> Result<()> {
        let start = if early { self.start } else { Start::AfterPrevious };
        let latency = spec.for_latency(prog.max_task_bytes);
        let spec = latency.as_ref().unwrap_or(spec);
        self.check(spec, prog.ctas, prog.slots)?;
        if prog.stream.cu_stream() != stream.cu_stream() {
            return Err(Error::Config {
                field: "stream",
                why: "the program's tables were uploaded in another stream's order (Engine::upload)".into(),
            });
        }
        if spec.mover == Mover::Tma && prog.max_task_bytes.div_ceil(spec.chunk_bytes.max(1) as u64) > u32::MAX as u64 {
            return Err(Error::Config {
                field: "chunk_bytes",
                why: format!(
                    "a task of {} B needs more than 2^32 chunks of {} B",
                    prog.max_task_bytes, spec.chunk_bytes
                ),
            });
        }
        if prog.ctas == 0 {
            return Ok(());
        }
        let f = self.function(spec.mover, spec.dtype, spec.op)?;
        let args = Args(LaunchArgs {
            programs: prog.programs.ptr,
            tasks: prog.tasks.ptr,
            status,
            timeout_ns: spec.timeout_ns,
            chunk_bytes: spec.chunk_bytes,
            stages: spec.stages,
            slots: prog.slots,
            reduce_mode: spec.reduce_mode.raw() as u32,
            wait_suspend_ns: spec.wait_suspend_ns,
            issuers: spec.issuers,
            combine_direct: spec.combine_direct as u32,
            call_key: spec.call_key,
            peer_scope: spec.peer_scope as u32,
            reserved: 0,
            phase_times: self.phase_times.as_ref().map_or(0, DeviceAlloc::ptr),
            workspaces,
            buffers,
        });
        let cfg = LaunchConfig {
            grid_dim: (prog.ctas, 1, 1),
            block_dim: (spec.threads, 1, 1),
            shared_mem_bytes: Self::smem_bytes(spec, prog.slots) as u32,
        };
        // SAFETY: the argument is the kernel's single by-value `LaunchArgs` parameter; the caller
        // guarantees the addresses. The kernels wait at entry for the stream's previous kernel
        // (`griddepcontrol.wait`) before touching anything it may write.
        unsafe { launch_kernel(stream, &f, cfg, &args, start) }
    }
}

/// An engine kernel (mover, dtype, operator), its threads per CTA and dynamic shared memory.
type OccupancyKey = (Mover, DType, RedOp, u32, usize);

/// Makes `ctx` the calling thread's current context, first reporting any error cudarc keeps for it
/// (`CudaContext::check_err`: a failure in a cudarc function that could not return one, such as a
/// buffer guard's stream wait) as [`Error::KeptDriverError`] rather than as this call's own failure.
pub fn bind(ctx: &CudaContext) -> Result<()> {
    check_kept(ctx)?;
    make_current(ctx).map_err(Error::driver("cuCtxSetCurrent"))
}

/// Reports (and clears) the error cudarc keeps for `ctx`, if any, as [`Error::KeptDriverError`].
pub(crate) fn check_kept(ctx: &CudaContext) -> Result<()> {
    ctx.check_err().map_err(|source| Error::KeptDriverError { ordinal: ctx.ordinal(), source })
}

/// Waits for `stream`'s work, a kept error reported first as by [`bind`].
pub(crate) fn sync_stream(stream: &CudaStream) -> Result<()> {
    bind(stream.context())?;
    // SAFETY: a live stream of the context just made current.
    unsafe { result::stream::synchronize(stream.cu_stream()) }.map_err(Error::driver("cuStreamSynchronize"))
}

/// Waits for all work of `ctx`, a kept error reported first as by [`bind`].
pub(crate) fn sync_context(ctx: &CudaContext) -> Result<()> {
    bind(ctx)?;
    result::ctx::synchronize().map_err(Error::driver("cuCtxSynchronize"))
}

/// Waits for `stream`'s work without taking the error cudarc keeps for its context: for waits after
/// a call's launches were queued (its error would claim the call did nothing) and for drops.
pub(crate) fn wait_stream(stream: &CudaStream) -> Result<()> {
    make_current(stream.context()).map_err(Error::driver("cuCtxSetCurrent"))?;
    // SAFETY: a live stream of the context just made current.
    unsafe { result::stream::synchronize(stream.cu_stream()) }.map_err(Error::driver("cuStreamSynchronize"))
}

/// Makes `ctx` current without taking the error cudarc keeps for it (which `bind_to_thread`
/// reports and clears): for launches, which must neither fail on nor swallow an error another
/// thread's call will report (`comm::check_contexts` reports a call's own first), and for drops.
pub(crate) fn make_current(ctx: &CudaContext) -> std::result::Result<(), DriverError> {
    if result::ctx::get_current()? != Some(ctx.cu_ctx()) {
        // SAFETY: `ctx` is alive (its `CudaContext` holds it).
        unsafe { result::ctx::set_current(ctx.cu_ctx()) }?;
    }
    Ok(())
}

/// When a queued kernel may be scheduled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Start {
    /// Once its stream's previous work has ended (a plain launch).
    AfterPrevious,
    /// Once the stream's previous kernel lets it (`griddepcontrol.launch_dependents`; at that
    /// kernel's end otherwise): launched with programmatic stream serialization, so that its launch
    /// and set-up overlap the previous kernel. Only for kernels that wait for that kernel themselves
    /// (`griddepcontrol.wait` before their first access to memory it may write). Per-rank launches
    /// on one GPU pass through its front end one after another (about 1 µs each, measured:
    /// docs/PERF.md); this takes that off each call's path.
    Early,
}

/// Queues `f` on `stream` with `args` as its one by-value parameter, in the stream's context (made
/// current without taking cudarc's kept error: see [`make_current`]), to be scheduled as `start`
/// says.
///
/// # Safety
/// `f` takes exactly one parameter, of `A`'s layout, and the addresses in `args` are valid for the
/// kernel until it completes; `f` belongs to `stream`'s context; with [`Start::Early`], `f` waits
/// as that variant says.
pub(crate) unsafe fn launch_kernel<A: DeviceRepr>(
    stream: &CudaStream,
    f: &CudaFunction,
    cfg: LaunchConfig,
    args: &A,
    start: Start,
) -> Result<()> {
    make_current(stream.context()).map_err(Error::driver("cuCtxSetCurrent"))?;
    let mut params = [args as *const A as *mut std::ffi::c_void];
    if start == Start::AfterPrevious {
        // SAFETY: the caller's contract; `params` points at `args`, alive across the call (the
        // driver copies parameters when the launch is queued).
        return unsafe {
            result::launch_kernel(
                f.cu_function(),
                cfg.grid_dim,
                cfg.block_dim,
                cfg.shared_mem_bytes,
                stream.cu_stream(),
                &mut params,
            )
        }
        .map_err(Error::driver("cuLaunchKernel"));
    }
    // SAFETY: an all-zero attribute is a valid value of the union, then set as the driver reads it.
    let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
    attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attr.value.programmaticStreamSerializationAllowed = 1;
    let config = sys::CUlaunchConfig {
        gridDimX: cfg.grid_dim.0,
        gridDimY: cfg.grid_dim.1,
        gridDimZ: cfg.grid_dim.2,
        blockDimX: cfg.block_dim.0,
        blockDimY: cfg.block_dim.1,
        blockDimZ: cfg.block_dim.2,
        sharedMemBytes: cfg.shared_mem_bytes,
        hStream: stream.cu_stream(),
        attrs: &mut attr,
        numAttrs: 1,
    };
    // SAFETY: the caller's contract; `config`, `attr` and `params` outlive the call (the driver
    // copies the parameters when the launch is queued).
    unsafe { sys::cuLaunchKernelEx(&config, f.cu_function(), params.as_mut_ptr(), std::ptr::null_mut()) }
        .result()
        .map_err(Error::driver("cuLaunchKernelEx"))
}

/// Loads every kernel of `table` from `module` now, so that no call loads one later. With the
/// driver's lazy loading (`CUDA_MODULE_LOADING=LAZY`, its default) a kernel is loaded at its first
/// `cuModuleGetFunction`, and a launch queued after that load waits on the device for the work
/// queued before it on every stream of the context (measured: an AllReduce whose kernel was loaded
/// by the call ended only after another stream's pending 1 s host function; with its kernel loaded
/// beforehand, after 0.1 ms: docs/PERF.md).
fn load_all(
    module: &Arc<CudaModule>,
    table: &[(DType, RedOp, [&'static str; 3])],
    max_smem: u32,
) -> Result<HashMap<&'static str, CudaFunction>> {
    let mut map = HashMap::new();
    for &(_, _, names) in table {
        for (&mover, name) in Mover::ALL.iter().zip(names) {
            map.insert(name, load_function(module, name, mover, max_smem)?);
        }
    }
    Ok(map)
}

/// The kernel `name` from `map`, where its module's table put it when the module was loaded (a name
/// outside the table is an error: loading it here would be the lazy load [`load_all`] avoids).
/// The kernel `name` (none: the module has no kernel for `what`) from its module's kernels.
fn kernel(
    map: &HashMap<&'static str, CudaFunction>,
    name: Option<&'static str>,
    what: (Mover, DType, RedOp),
) -> Result<CudaFunction> {
    let (mover, dtype, op) = what;
    let Some(name) = name else {
        return Err(Error::Unsupported {
            what: format!("{op:?} on {dtype:?} with the {mover:?} mover in this module"),
        });
    };
    map.get(name).cloned().ok_or_else(|| Error::Config {
        field: "kernel",
        why: format!("{name} is not among the kernels loaded with its module"),
    })
}

/// Loads the kernel `name` of `module`, with its shared-memory limits raised.
fn load_function(module: &Arc<CudaModule>, name: &'static str, mover: Mover, max_smem: u32) -> Result<CudaFunction> {
    let f = module.load_function(name).map_err(Error::driver("cuModuleGetFunction"))?;
    raise_smem(&f, mover, max_smem)?;
    Ok(f)
}

/// Raises a kernel's dynamic shared-memory limit to the device's; a TMA kernel also asks for the
/// largest shared-memory carveout, so that the SMs it runs on keep the shared memory it leaves
/// free (and every CTA's reserved kilobyte) for kernels running beside it, rather than a carveout
/// cut just above its own stages. (Beside the FMA probe, whose CTAs need only that kilobyte, it
/// measured the same as the driver's choice: docs/PERF.md.) The SIMT kernels keep the driver's
/// choice (they read through L1).
fn raise_smem(f: &CudaFunction, mover: Mover, max_smem: u32) -> Result<()> {
    f.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, max_smem as i32)
        .map_err(Error::driver("cuFuncSetAttribute"))?;
    if mover == Mover::Tma {
        // CU_SHAREDMEM_CARVEOUT_MAX_SHARED: 100 % of the unified L1/shared memory as shared.
        f.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, 100)
            .map_err(Error::driver("cuFuncSetAttribute"))?;
    }
    Ok(())
}

/// `LaunchArgs` passed by value as the kernel's only parameter.
#[repr(transparent)]
struct Args(LaunchArgs);
// SAFETY: `LaunchArgs` is `#[repr(C)]`, `Pod`, 8-byte aligned: its bytes are the kernel parameter.
unsafe impl DeviceRepr for Args {}

/// Registers per SM on sm_90 (32-bit), in four equal files, one per scheduler (SM sub-partition),
/// allocated to a warp in units of 256.
const SM_REGISTERS: u32 = 65536;
const SUBPARTITIONS: u32 = 4;

/// The most threads per CTA that one SM's registers hold for a kernel of `regs` registers per thread,
/// as a phrase for errors. A CTA's warps are dealt to the four sub-partitions in turn and each warp's
/// registers (`regs` rounded up to a multiple of 8, times 32) come from its sub-partition's file, so
/// the bound is four times what one file holds: at 170 registers 2 warps per file, 256 threads, not
/// the 352 the whole register file would suggest (the driver refuses 320 such threads: docs/PERF.md,
/// 2026-12-02).
fn threads_for_registers(regs: u32) -> String {
    let per_warp = regs.div_ceil(8) * 8 * 32;
    let per_file = SM_REGISTERS / SUBPARTITIONS;
    let threads = per_file.checked_div(per_warp).map_or(1024, |warps| (SUBPARTITIONS * warps * 32).min(1024));
    format!(
        "at most {threads} threads per CTA fit in the SM's {SM_REGISTERS} registers ({SUBPARTITIONS} files of {per_file}, one \
         per scheduler)"
    )
}

/// Whether the CUDA driver library can be loaded: checked here rather than through cudarc, whose
/// check exists only where it loads the library at run time, while a crate beside oxccl (candle
/// turns on cudarc's `dynamic-linking`) may have it linked instead, already loaded then.
pub fn driver_present() -> bool {
    #[cfg(unix)]
    {
        ["libcuda.so.1", "libcuda.so"].iter().any(|name| {
            let name = std::ffi::CString::new(*name).expect("no NUL in the name");
            // SAFETY: a NUL-terminated name; the handle, if any, is closed at once (the library
            // stays loaded where cudarc or the linker loaded it).
            let handle = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_LAZY | libc::RTLD_LOCAL) };
            if !handle.is_null() {
                // SAFETY: a handle dlopen returned, closed once.
                unsafe { libc::dlclose(handle) };
            }
            !handle.is_null()
        })
    }
    #[cfg(not(unix))]
    {
        // No loader check written for this platform: the driver calls report its absence.
        true
    }
}

/// The first CUDA device as a context, if a CUDA driver is installed and device 0 is a Hopper GPU;
/// otherwise why not.
pub fn probe_gpu() -> std::result::Result<Arc<CudaContext>, String> {
    if !driver_present() {
        return Err("the CUDA driver library is not installed".into());
    }
    let n = CudaContext::device_count().map_err(|e| format!("cuDeviceGetCount: {e}"))?;
    if n < 1 {
        return Err("no CUDA device".into());
    }
    let ctx = CudaContext::new(0).map_err(|e| format!("cuCtxCreate: {e}"))?;
    let (major, minor) = ctx.compute_capability().map_err(|e| format!("compute capability: {e}"))?;
    if major != 9 {
        return Err(format!("device 0 is sm_{major}{minor}, not Hopper"));
    }
    Ok(ctx)
}

/// The first `n` CUDA devices, each checked to be Hopper, for one rank per GPU; an error names the
/// device that is missing or not usable.
pub fn probe_gpus(n: usize) -> std::result::Result<Vec<Arc<CudaContext>>, String> {
    let first = probe_gpu()?;
    let have = CudaContext::device_count().map_err(|e| format!("cuDeviceGetCount: {e}"))? as usize;
    if n == 0 || n > have {
        return Err(format!("{n} GPUs asked for, {have} visible"));
    }
    let mut out = vec![first];
    for d in 1..n {
        let ctx = CudaContext::new(d).map_err(|e| format!("cuCtxCreate on device {d}: {e}"))?;
        let (major, minor) = ctx.compute_capability().map_err(|e| format!("compute capability: {e}"))?;
        if major != 9 {
            return Err(format!("device {d} is sm_{major}{minor}, not Hopper"));
        }
        out.push(ctx);
    }
    Ok(out)
}

/// The error a device [`Status`] record describes (`None` when it records none).
pub fn status_error(s: &Status) -> Option<Error> {
    Error::from_status(s)
}

/// `CUmemLocation { type = DEVICE, id = ordinal }`. cudarc's bindings spell `id` as a plain field for
/// some CUDA versions and inside an anonymous union for others; in C it is `{ int type; int id; }`
/// either way, so the id is written at byte offset 4.
pub(crate) fn device_location(ordinal: usize) -> sys::CUmemLocation {
    const _: () = assert!(std::mem::size_of::<sys::CUmemLocation>() == 8);
    // SAFETY: an all-zero CUmemLocation is valid (type 0, id 0); the id is the `int` at offset 4 of
    // the 8-byte C struct, written unaligned-safely.
    unsafe {
        let mut loc: sys::CUmemLocation = std::mem::zeroed();
        loc.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        std::ptr::addr_of_mut!(loc).cast::<u8>().add(4).cast::<i32>().write_unaligned(ordinal as i32);
        loc
    }
}

#[cfg(test)]
mod tests {
    use super::{
        EngineFile, LaunchSpec, ModuleCode, Mover, PeerScope, module_choice, mover_for, read_engine_file,
        threads_for_registers,
    };
    use crate::error::Error;
    use oxccl_kernels::abi::{self, DType, RedOp, ReduceMode};

    /// A launch switches to the latency mover only where every task moves fewer bytes than
    /// `latency_below`, with the threads that mover's kernels are compiled for; 0 never switches.
    #[test]
    fn small_programs_switch_to_the_latency_mover() {
        assert_eq!(mover_for(Mover::Tma, 16 << 10, (16 << 10) - 1), Mover::Latency);
        assert_eq!(mover_for(Mover::Tma, 16 << 10, 16 << 10), Mover::Tma);
        assert_eq!(mover_for(Mover::Simt, 1 << 20, 0), Mover::Latency);
        assert_eq!(mover_for(Mover::Tma, 0, 0), Mover::Tma);
        let spec = LaunchSpec {
            mover: Mover::Tma,
            dtype: DType::F32,
            op: RedOp::Sum,
            threads: 64,
            chunk_bytes: 8192,
            stages: 4,
            reduce_mode: ReduceMode::Registers,
            timeout_ns: 1,
            wait_suspend_ns: 0,
            issuers: 2,
            combine_direct: false,
            call_key: 7,
            peer_scope: PeerScope::Gpu,
            latency_below: 4096,
        };
        let small = spec.for_latency(4095).expect("a 4095-byte task is under the switch");
        assert_eq!((small.mover, small.threads), (Mover::Latency, abi::LATENCY_THREADS));
        assert_eq!(LaunchSpec { mover: spec.mover, threads: spec.threads, ..small }, spec, "nothing else changes");
        assert_eq!(spec.for_latency(4096), None);
        let latency = LaunchSpec { mover: Mover::Latency, threads: 128, ..spec };
        assert_eq!(latency.for_latency(1), None, "a launch on the latency mover keeps its threads");
    }

    /// `OXCCL_ENGINE_PTX`: a file that cannot be read is a typed error naming the variable and the
    /// file; PTX is read as text, an ELF image whole, a cut image or other bytes refused.
    #[test]
    fn an_engine_ptx_file_is_read_or_named() {
        let e = read_engine_file(std::path::Path::new("/nonexistent/engine.ptx")).unwrap_err();
        assert!(matches!(&e, Error::Config { field: "OXCCL_ENGINE_PTX", .. }), "{e}");
        assert!(e.to_string().contains("/nonexistent/engine.ptx"), "{e}");
        let path = std::env::temp_dir().join(format!("oxccl-engine-ptx-{}.ptx", std::process::id()));
        std::fs::write(&path, ".version 8.0\n").unwrap();
        assert_eq!(read_engine_file(&path).unwrap(), EngineFile::Ptx(".version 8.0\n".into()));
        // The shipped device image is read whole; cut short, it is refused by name.
        let image = crate::ptx::KERNELS_SM90A;
        if !image.is_empty() {
            std::fs::write(&path, image).unwrap();
            assert_eq!(read_engine_file(&path).unwrap(), EngineFile::Image(image.to_vec()));
            std::fs::write(&path, &image[..image.len() / 2]).unwrap();
            let e = read_engine_file(&path).unwrap_err();
            assert!(e.to_string().contains("reach past"), "{e}");
            // Whole tables, but a section whose body reaches past the end (the last section with
            // a body given the file's length as its size).
            let mut long = image.to_vec();
            let le = |at: usize, w: usize| long[at..at + w].iter().rev().fold(0usize, |v, &x| v << 8 | x as usize);
            let (table, n) = (le(0x28, 8), le(0x3c, 2));
            let body = (0..n).rev().map(|i| table + i * 64).find(|&h| le(h + 4, 4) != 8).unwrap();
            long[body + 0x20..body + 0x28].copy_from_slice(&(image.len() as u64).to_le_bytes());
            std::fs::write(&path, &long).unwrap();
            let e = read_engine_file(&path).unwrap_err();
            assert!(e.to_string().contains("reach past"), "{e}");
        }
        std::fs::write(&path, [0xffu8, 0xfe, 0]).unwrap();
        assert!(read_engine_file(&path).unwrap_err().to_string().contains("neither PTX"));
        std::fs::remove_file(&path).unwrap();
    }

    /// `OXCCL_MODULE`: auto (or unset), ptx or prebuilt; anything else is a typed error naming it.
    #[test]
    fn module_choice_reads_its_three_values() {
        assert_eq!(module_choice("").unwrap(), None);
        assert_eq!(module_choice("auto").unwrap(), None);
        assert_eq!(module_choice("ptx").unwrap(), Some(ModuleCode::Ptx));
        assert_eq!(module_choice("prebuilt").unwrap(), Some(ModuleCode::Prebuilt));
        let e = module_choice("cubin").unwrap_err();
        assert!(matches!(&e, Error::Config { field: "OXCCL_MODULE", .. }), "{e}");
        assert!(e.to_string().contains("\"cubin\""), "{e}");
    }

    /// The register file's limit on a CTA's threads, as the driver allocates registers.
    #[test]
    fn registers_bound_the_threads_of_a_cta() {
        // 170 and 176 registers: 5632 per warp, two warps per 16384-register file (the driver
        // refused 320 threads of a 170-register kernel on the H200).
        assert!(threads_for_registers(170).contains("at most 256 threads"));
        assert!(threads_for_registers(176).contains("at most 256 threads"));
        assert!(threads_for_registers(180).contains("at most 256 threads"), "180 registers round up to 184");
        // cuBLAS's 168-register kernels launch 384 threads: three warps of 5376 per file.
        assert!(threads_for_registers(168).contains("at most 384 threads"));
        assert!(threads_for_registers(128).contains("at most 512 threads"));
        assert!(threads_for_registers(122).contains("at most 512 threads"));
        assert!(threads_for_registers(32).contains("at most 1024 threads"), "capped at 1024");
        assert!(threads_for_registers(0).contains("at most 1024 threads"));
    }
}
