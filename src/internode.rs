//! The inter-node layer: collectives among the ranks of one local index (one per node), on an
//! engine other than oxccl's: NCCL ([`Nccl`]), whose library every GPU cluster has, or the user's
//! own ([`InterNode`]). oxccl runs the NVLink part inside each node; a staged plan
//! ([`oxccl_host::nodes::Staged`]) says which step runs where.
//!
//! NCCL is loaded when first asked for, from `OXCCL_NCCL` (a path) or the loader's search path
//! (`libnccl.so.2`, then `libnccl.so`: the soname NCCL's packages and Python wheels install). oxccl
//! binds the functions it calls itself: cudarc's `nccl` feature panics where the library is
//! missing and does not look for `libnccl.so.2`.

use crate::error::{Error, Result};
use crate::{DType, ReduceOp};
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, SyncOnDrop, sys};
use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::marker::PhantomData;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

/// Collectives among the ranks of one local index across the nodes (this rank's *group*),
/// queued on a stream. Calls are collective within the group and made in the same order by
/// every member, as NCCL's.
///
/// # Safety
///
/// Implementations receive raw device addresses: they read and write `count` elements of
/// `dtype` at each, on `stream`, and nothing else.
pub unsafe trait InterNode: Send + Sync {
    /// This rank's index in its group (its node's index).
    fn group_rank(&self) -> usize;

    /// Members of the group (the nodes).
    fn group_size(&self) -> usize;

    /// In place: `buf` becomes `op` over the group of every member's `buf`.
    ///
    /// # Safety
    ///
    /// `buf` addresses `count` elements of `dtype` on this rank's device, valid until `stream`
    /// has run the call.
    unsafe fn all_reduce(&self, buf: u64, count: usize, dtype: DType, op: ReduceOp, stream: &CudaStream) -> Result<()>;

    /// `recv` becomes member `root`'s `send` (`send` is read on the root only). `in_place` is the
    /// same on every member: the root's `send` is its `recv` (engines whose calls have an in-place
    /// form, as oxccl's, need every member to call the same form).
    ///
    /// # Safety
    ///
    /// `send` (on the root) and `recv` address `count` elements of `dtype`, equal where
    /// `in_place`, else disjoint, valid until `stream` has run the call.
    #[allow(clippy::too_many_arguments)]
    unsafe fn broadcast(
        &self,
        send: u64,
        recv: u64,
        count: usize,
        dtype: DType,
        root: usize,
        in_place: bool,
        stream: &CudaStream,
    ) -> Result<()>;

    /// `recv` of member `root` becomes `op` over the group of every member's `send` (`recv` is
    /// not used on the others).
    ///
    /// # Safety
    ///
    /// `send` and (on the root) `recv` address `count` elements of `dtype`, disjoint, valid until
    /// `stream` has run the call.
    #[allow(clippy::too_many_arguments)]
    unsafe fn reduce(
        &self,
        send: u64,
        recv: u64,
        count: usize,
        dtype: DType,
        op: ReduceOp,
        root: usize,
        stream: &CudaStream,
    ) -> Result<()>;

    /// Whether [`InterNode::send_recv`] carries transfers (an implementation that provides it says
    /// so here); `false` by default, and sends and receives across nodes are then refused before
    /// anything of the call is queued.
    fn sends_and_receives(&self) -> bool {
        false
    }

    /// Point-to-point transfers with other members, queued as one group (NCCL's `ncclSend` and
    /// `ncclRecv` between `ncclGroupStart` and `ncclGroupEnd`): the `i`-th send of member `a` to
    /// `b` is the `i`-th receive of `b` from `a`, of the same length. The default refuses
    /// ([`Error::Unsupported`]): an engine without point-to-point still carries the collectives.
    ///
    /// # Safety
    ///
    /// Each transfer's `ptr` addresses `bytes` bytes on this rank's device (written where it
    /// receives), disjoint from the other transfers' where one writes, valid until `stream` has
    /// run the call.
    unsafe fn send_recv(&self, transfers: &[Transfer], stream: &CudaStream) -> Result<()> {
        let _ = (transfers, stream);
        Err(Error::Unsupported { what: "point-to-point transfers on this inter-node engine".into() })
    }

    /// Ends the group's calls in flight (a peer died); later calls fail.
    fn abort(&self);

    /// An error the engine has recorded since its calls were queued (NCCL's asynchronous errors:
    /// a peer gone, a network failure), polled while the rank waits for its calls.
    fn check(&self) -> Result<()> {
        Ok(())
    }
}

/// One point-to-point transfer of [`InterNode::send_recv`]: `bytes` bytes at device address `ptr`
/// of this rank, sent to or received from member `peer` of the group.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Transfer {
    /// The other member (its index in the group: its node).
    pub peer: usize,
    /// Whether this rank sends (else it receives).
    pub send: bool,
    /// The device address of this rank's side.
    pub ptr: u64,
    /// Bytes moved.
    pub bytes: usize,
}

/// NCCL's `ncclUniqueId`.
#[repr(C)]
#[derive(Copy, Clone)]
pub struct NcclId(pub [c_char; 128]);

type Comm = *mut c_void;
type Res = c_int;

type GetUniqueId = unsafe extern "C" fn(*mut NcclId) -> Res;
type CommInitRank = unsafe extern "C" fn(*mut Comm, c_int, NcclId, c_int) -> Res;
type CommOp = unsafe extern "C" fn(Comm) -> Res;
type ErrorString = unsafe extern "C" fn(Res) -> *const c_char;
type GetVersion = unsafe extern "C" fn(*mut c_int) -> Res;
type AsyncError = unsafe extern "C" fn(Comm, *mut Res) -> Res;
type Coll = unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, Comm, sys::CUstream) -> Res;
type ReduceFn =
    unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, c_int, Comm, sys::CUstream) -> Res;
type P2p = unsafe extern "C" fn(*mut c_void, usize, c_int, c_int, Comm, sys::CUstream) -> Res;
type GroupMark = unsafe extern "C" fn() -> Res;

/// The NCCL functions oxccl calls, from the loaded library.
struct Api {
    get_unique_id: GetUniqueId,
    comm_init_rank: CommInitRank,
    comm_destroy: CommOp,
    comm_abort: CommOp,
    get_error_string: ErrorString,
    get_version: GetVersion,
    async_error: AsyncError,
    all_reduce: Coll,
    broadcast: Coll,
    reduce: ReduceFn,
    send: P2p,
    recv: P2p,
    group_start: GroupMark,
    group_end: GroupMark,
}

/// The loaded NCCL library: [`Nccl::load`].
pub struct Nccl {
    api: Api,
    /// Where it was found.
    path: String,
    version: i32,
}

impl std::fmt::Debug for Nccl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Nccl").field("path", &self.path).field("version", &self.version).finish_non_exhaustive()
    }
}

/// The names tried, in order.
pub fn nccl_candidates() -> Vec<String> {
    let mut v: Vec<String> = std::env::var("OXCCL_NCCL").ok().filter(|p| !p.is_empty()).into_iter().collect();
    v.extend(["libnccl.so.2".to_string(), "libnccl.so".to_string()]);
    v
}

/// The last `dlerror`, or `fallback`.
fn dl_error(fallback: &str) -> String {
    // SAFETY: dlerror returns null or a NUL-terminated string valid until the next dl call on this
    // thread, copied at once.
    let e = unsafe { libc::dlerror() };
    if e.is_null() { fallback.to_string() } else { unsafe { CStr::from_ptr(e) }.to_string_lossy().into_owned() }
}

impl Nccl {
    /// NCCL, loaded once per process from [`nccl_candidates`]; [`Error::NoNccl`] naming every
    /// name tried and why each failed where none loads.
    pub fn load() -> Result<&'static Nccl> {
        static LOADED: OnceLock<std::result::Result<Nccl, (Vec<String>, String)>> = OnceLock::new();
        LOADED
            .get_or_init(|| Nccl::load_from(&nccl_candidates()))
            .as_ref()
            .map_err(|(tried, why)| Error::NoNccl { tried: tried.clone(), why: why.clone() })
    }

    /// NCCL from the first of `names` that loads and has every function oxccl calls.
    pub fn load_from(names: &[String]) -> std::result::Result<Nccl, (Vec<String>, String)> {
        let mut why = Vec::new();
        for name in names {
            let Ok(c) = CString::new(name.as_str()) else {
                why.push(format!("{name}: a NUL byte in the name"));
                continue;
            };
            // SAFETY: a NUL-terminated name; the handle is kept for the process's life (NCCL is
            // never unloaded: its threads may outlive any one communicator).
            let handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
            if handle.is_null() {
                why.push(dl_error(name));
                continue;
            }
            match Nccl::bind(handle) {
                Ok(api) => {
                    let mut version = 0;
                    // SAFETY: an out-pointer; the function was found in the library.
                    unsafe { (api.get_version)(&mut version) };
                    return Ok(Nccl { api, path: name.clone(), version });
                }
                Err(missing) => why.push(format!("{name}: no symbol {missing}")),
            }
        }
        Err((names.to_vec(), why.join("; ")))
    }

    fn bind(handle: *mut c_void) -> std::result::Result<Api, &'static str> {
        macro_rules! sym {
            ($name:literal, $t:ty) => {{
                let c = concat!($name, "\0");
                // SAFETY: a NUL-terminated name on a live handle.
                let p = unsafe { libc::dlsym(handle, c.as_ptr().cast()) };
                if p.is_null() {
                    return Err($name);
                }
                // SAFETY: NCCL's C signature for this name (nccl.h), which the field's type spells.
                unsafe { std::mem::transmute::<*mut c_void, $t>(p) }
            }};
        }
        Ok(Api {
            get_unique_id: sym!("ncclGetUniqueId", GetUniqueId),
            comm_init_rank: sym!("ncclCommInitRank", CommInitRank),
            comm_destroy: sym!("ncclCommDestroy", CommOp),
            comm_abort: sym!("ncclCommAbort", CommOp),
            get_error_string: sym!("ncclGetErrorString", ErrorString),
            get_version: sym!("ncclGetVersion", GetVersion),
            async_error: sym!("ncclCommGetAsyncError", AsyncError),
            all_reduce: sym!("ncclAllReduce", Coll),
            broadcast: sym!("ncclBroadcast", Coll),
            reduce: sym!("ncclReduce", ReduceFn),
            // `ncclSend` takes a `const void*`: the same ABI as `P2p`'s pointer.
            send: sym!("ncclSend", P2p),
            recv: sym!("ncclRecv", P2p),
            group_start: sym!("ncclGroupStart", GroupMark),
            group_end: sym!("ncclGroupEnd", GroupMark),
        })
    }

    /// Where the library was loaded from.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// NCCL's version code (`ncclGetVersion`: 22809 for 2.28.9).
    pub fn version(&self) -> i32 {
        self.version
    }

    fn check(&self, call: &'static str, r: Res) -> Result<()> {
        if r == 0 {
            return Ok(());
        }
        // SAFETY: NCCL returns a static string for any result code.
        let text = unsafe { CStr::from_ptr((self.api.get_error_string)(r)) }.to_string_lossy().into_owned();
        Err(Error::InterNode { call, why: format!("{text} (ncclResult {r})") })
    }

    /// A new unique id (made by one member of a group and passed to the others).
    pub fn unique_id(&self) -> Result<NcclId> {
        let mut id = NcclId([0; 128]);
        // SAFETY: an out-pointer to a 128-byte id.
        self.check("ncclGetUniqueId", unsafe { (self.api.get_unique_id)(&mut id) })?;
        Ok(id)
    }
}

/// NCCL's element type code for `dtype`.
pub fn nccl_dtype(dtype: DType) -> c_int {
    match dtype {
        DType::F32 => 7,
        DType::F16 => 6,
        DType::Bf16 => 9,
        DType::I32 => 2,
        DType::U32 => 3,
        DType::U8 => 1,
        DType::I8 => 0,
        DType::I64 => 4,
        DType::U64 => 5,
        DType::F64 => 8,
        DType::F8e4m3 => 10,
        DType::F8e5m2 => 11,
    }
}

/// NCCL's operator code for `op`.
pub fn nccl_op(op: ReduceOp) -> c_int {
    match op {
        ReduceOp::Sum => 0,
        ReduceOp::Prod => 1,
        ReduceOp::Max => 2,
        ReduceOp::Min => 3,
        ReduceOp::Avg => 4,
    }
}

/// An NCCL communicator of one group, as an [`InterNode`].
pub struct NcclGroup {
    nccl: &'static Nccl,
    /// The communicator's handle, taken by [`InterNode::abort`] (NCCL frees it then): no call
    /// starts after an abort. The lock is not held during a call, so that an abort from another
    /// thread can end a call blocked in NCCL (`ncclCommAbort`'s purpose).
    comm: std::sync::Mutex<Option<Handle>>,
    rank: usize,
    size: usize,
}

/// An `ncclComm_t`.
struct Handle(Comm);

// SAFETY: an NCCL communicator may be used from any thread, one call at a time, which the mutex
// around it guarantees.
unsafe impl Send for Handle {}

impl std::fmt::Debug for NcclGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclGroup").field("rank", &self.rank).field("size", &self.size).finish_non_exhaustive()
    }
}

impl NcclGroup {
    /// Member `rank` of `size`, meeting through `id` on the current device of this thread's
    /// context. NCCL's setup blocks until every member has called; it runs on a thread of its own
    /// and this call gives up after `timeout` with [`Error::InterNode`] (the setup thread is left
    /// blocked in NCCL: end the process).
    pub fn new(
        nccl: &'static Nccl,
        id: NcclId,
        rank: usize,
        size: usize,
        ctx: &Arc<cudarc::driver::CudaContext>,
        timeout: Duration,
    ) -> Result<NcclGroup> {
        let (tx, rx) = std::sync::mpsc::channel();
        let ctx = ctx.clone();
        let (r, n) = (c_int::try_from(rank), c_int::try_from(size));
        let (Ok(r), Ok(n)) = (r, n) else {
            return Err(Error::RankCount { ranks: size, max: c_int::MAX as usize });
        };
        std::thread::Builder::new()
            .name("oxccl-nccl-init".into())
            .spawn(move || {
                let bound = crate::engine::bind(&ctx);
                let mut comm: Comm = std::ptr::null_mut();
                // SAFETY: an out-pointer and NCCL's arguments by value, on a bound context.
                let res = bound.map(|()| unsafe { (nccl.api.comm_init_rank)(&mut comm, n, id, r) });
                let _ = tx.send((res, comm as usize));
            })
            .map_err(|e| Error::InterNode { call: "ncclCommInitRank", why: format!("starting its thread: {e}") })?;
        match rx.recv_timeout(timeout) {
            Ok((Ok(res), comm)) => {
                nccl.check("ncclCommInitRank", res)?;
                Ok(NcclGroup { nccl, comm: std::sync::Mutex::new(Some(Handle(comm as Comm))), rank, size })
            }
            Ok((Err(e), _)) => Err(e),
            Err(_) => Err(Error::InterNode {
                call: "ncclCommInitRank",
                why: format!("member {rank} of {size}: not every member joined within {timeout:?}"),
            }),
        }
    }
}

impl NcclGroup {
    /// Runs `call` with the live handle, [`Error::Aborted`] after an abort.
    fn with(&self, call: impl FnOnce(Comm) -> Result<()>) -> Result<()> {
        let handle = self.comm.lock().unwrap_or_else(|p| p.into_inner()).as_ref().map(|h| h.0);
        match handle {
            Some(h) => call(h),
            None => Err(Error::Aborted),
        }
    }
}

// SAFETY: every call passes the caller's addresses and counts to NCCL unchanged.
unsafe impl InterNode for NcclGroup {
    fn group_rank(&self) -> usize {
        self.rank
    }

    fn group_size(&self) -> usize {
        self.size
    }

    unsafe fn all_reduce(&self, buf: u64, count: usize, dtype: DType, op: ReduceOp, stream: &CudaStream) -> Result<()> {
        let p = buf as *mut c_void;
        self.with(|comm| {
            // SAFETY: the caller's contract.
            let r = unsafe {
                (self.nccl.api.all_reduce)(p, p, count, nccl_dtype(dtype), nccl_op(op), comm, stream.cu_stream())
            };
            self.nccl.check("ncclAllReduce", r)
        })
    }

    unsafe fn broadcast(
        &self,
        send: u64,
        recv: u64,
        count: usize,
        dtype: DType,
        root: usize,
        _in_place: bool,
        stream: &CudaStream,
    ) -> Result<()> {
        let root = c_int::try_from(root).map_err(|_| Error::NoSuchRank { rank: root, ranks: self.size })?;
        let t = nccl_dtype(dtype);
        let (send, recv) = (send as *const c_void, recv as *mut c_void);
        self.with(|comm| {
            // SAFETY: the caller's contract.
            let r = unsafe { (self.nccl.api.broadcast)(send, recv, count, t, root, comm, stream.cu_stream()) };
            self.nccl.check("ncclBroadcast", r)
        })
    }

    #[allow(clippy::too_many_arguments)]
    unsafe fn reduce(
        &self,
        send: u64,
        recv: u64,
        count: usize,
        dtype: DType,
        op: ReduceOp,
        root: usize,
        stream: &CudaStream,
    ) -> Result<()> {
        let root = c_int::try_from(root).map_err(|_| Error::NoSuchRank { rank: root, ranks: self.size })?;
        let (t, o) = (nccl_dtype(dtype), nccl_op(op));
        let (send, recv) = (send as *const c_void, recv as *mut c_void);
        self.with(|comm| {
            // SAFETY: the caller's contract.
            let r = unsafe { (self.nccl.api.reduce)(send, recv, count, t, o, root, comm, stream.cu_stream()) };
            self.nccl.check("ncclReduce", r)
        })
    }

    fn sends_and_receives(&self) -> bool {
        true
    }

    unsafe fn send_recv(&self, transfers: &[Transfer], stream: &CudaStream) -> Result<()> {
        // Bytes (`ncclUint8`): the transfers do not care what they move.
        let mut peers = Vec::with_capacity(transfers.len());
        for t in transfers {
            match c_int::try_from(t.peer) {
                Ok(p) if t.peer < self.size => peers.push(p),
                _ => return Err(Error::NoSuchRank { rank: t.peer, ranks: self.size }),
            }
        }
        let (api, bytes) = (&self.nccl.api, nccl_dtype(DType::U8));
        self.with(|comm| {
            // SAFETY: no arguments; paired with the `ncclGroupEnd` below whatever happens between.
            self.nccl.check("ncclGroupStart", unsafe { (api.group_start)() })?;
            let mut queued = Ok(());
            for (t, &peer) in transfers.iter().zip(&peers) {
                let (call, f) = if t.send { ("ncclSend", api.send) } else { ("ncclRecv", api.recv) };
                // SAFETY: the caller's contract (a `ptr` of `bytes` bytes on this device).
                let r = unsafe { f(t.ptr as *mut c_void, t.bytes, bytes, peer, comm, stream.cu_stream()) };
                queued = self.nccl.check(call, r);
                if queued.is_err() {
                    break;
                }
            }
            // SAFETY: closes the group opened above.
            let ended = self.nccl.check("ncclGroupEnd", unsafe { (api.group_end)() });
            queued.and(ended)
        })
    }

    fn abort(&self) {
        let taken = self.comm.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(h) = taken {
            // SAFETY: a live communicator, taken so that nothing uses it again; NCCL ends its
            // calls in flight and frees it.
            unsafe { (self.nccl.api.comm_abort)(h.0) };
        }
    }

    fn check(&self) -> Result<()> {
        self.with(|comm| {
            let mut state: Res = 0;
            // SAFETY: a live communicator and an out-pointer.
            self.nccl.check("ncclCommGetAsyncError", unsafe { (self.nccl.api.async_error)(comm, &mut state) })?;
            // 7 is ncclInProgress: calls still running, no error.
            if state == 7 { Ok(()) } else { self.nccl.check("ncclCommGetAsyncError", state) }
        })
    }
}

impl Drop for NcclGroup {
    fn drop(&mut self) {
        if let Some(h) = self.comm.get_mut().unwrap_or_else(|p| p.into_inner()).take() {
            // SAFETY: a live communicator (an aborted one was taken), destroyed once; its calls
            // were queued on streams the owner has synchronised.
            unsafe { (self.nccl.api.comm_destroy)(h.0) };
        }
    }
}

/// The least time a communicator across nodes gives NCCL's setup (`ncclCommInitRank` over every
/// node), whatever the communicator's timeout.
pub const NCCL_SETUP_TIMEOUT: Duration = Duration::from_secs(120);

/// The NCCL group of this rank (its local index's ranks, one per node, by node): NCCL loaded on
/// every rank, an id made by the group's member on node 0 and passed through `bootstrap`
/// (collective: every rank calls it; a rank that cannot load NCCL fails every rank's call, naming
/// it).
pub(crate) fn nccl_group(
    map: &oxccl_host::nodes::NodeMap,
    bootstrap: &dyn crate::Bootstrap,
    ctx: &Arc<cudarc::driver::CudaContext>,
    timeout: Duration,
) -> Result<Box<dyn InterNode>> {
    let me = bootstrap.rank() as u32;
    let (node, local) = (map.node(me), map.local(me));
    // NCCL loaded, and on node 0 an id made: a rank where either fails still takes part in the
    // exchange (one byte of status, 1 for ready, then the id), so that every rank fails at once.
    let made = Nccl::load().and_then(|n| if node == 0 { n.unique_id().map(|id| (n, Some(id))) } else { Ok((n, None)) });
    let mine: Vec<u8> = match &made {
        Ok((_, Some(id))) => std::iter::once(1u8).chain(id.0.iter().map(|&c| c as u8)).collect(),
        Ok((_, None)) => vec![1],
        Err(_) => vec![0],
    };
    let all = bootstrap.all_gather(&mine)?;
    let (nccl, _) = made?;
    if let Some(r) = all.iter().position(|b| b.first() != Some(&1)) {
        return Err(Error::Mismatch {
            field: "inter-node engine",
            rank: r,
            why: "could not load NCCL or make its id".into(),
        });
    }
    let from = &all[map.rank(0, local) as usize];
    if from.len() != 129 {
        return Err(Error::Mismatch {
            field: "inter-node engine",
            rank: map.rank(0, local) as usize,
            why: format!("sent an NCCL id of {} bytes", from.len().saturating_sub(1)),
        });
    }
    let mut id = NcclId([0; 128]);
    for (d, &b) in id.0.iter_mut().zip(&from[1..]) {
        *d = b as c_char;
    }
    // NCCL's setup over many nodes can take longer than one call's bounded waits.
    let setup = timeout.max(NCCL_SETUP_TIMEOUT);
    Ok(Box::new(NcclGroup::new(nccl, id, node as usize, map.nodes() as usize, ctx, setup)?))
}

/// An inter-node group on oxccl's own engine: a [`Comm`](crate::Comm) among the group's ranks.
/// oxccl's communicators span one host, so this serves nodes that share one (a machine posing as
/// several nodes through [`Config::ranks_per_node`](crate::Config::ranks_per_node), and tests of
/// the staged collectives without NCCL, which refuses two ranks on one GPU).
#[derive(Debug)]
pub struct EngineGroup {
    comm: crate::Comm,
    rank: usize,
    size: usize,
}

impl EngineGroup {
    /// This rank's group, its calls on `stream` (the one [`Comm::with_inter_node`](crate::Comm::with_inter_node)
    /// passes). Collective over `bootstrap`: the group's rank on node 0 serves its root on this
    /// host.
    pub fn new(
        map: &oxccl_host::nodes::NodeMap,
        bootstrap: &dyn crate::Bootstrap,
        stream: &Arc<CudaStream>,
        config: crate::Config,
    ) -> Result<EngineGroup> {
        let me = bootstrap.rank() as u32;
        let (node, local) = (map.node(me), map.local(me));
        let (rank, size) = (node as usize, map.nodes() as usize);
        let root = map.rank(0, local) as usize;
        let group = group_bootstrap(bootstrap, root, rank, size, config.timeout)?;
        let config = crate::Config { ranks_per_node: None, ..config };
        let comm = crate::Comm::new(stream, Box::new(group), config)?;
        Ok(EngineGroup { comm, rank, size })
    }
}

/// The group's AllReduce in place of `count` elements of `T` at `buf`.
fn all_reduce_typed<T: crate::Element>(g: &EngineGroup, buf: u64, count: usize, op: ReduceOp) -> Result<()> {
    let mut region = Region::<T>::new(buf, 0, count as u64, g.comm.stream());
    g.comm.all_reduce_in_place(&mut region, op)
}

/// The group's Reduce of `count` elements of `T` from `send` into `recv` on `root`.
fn reduce_typed<T: crate::Element>(
    g: &EngineGroup,
    send: u64,
    recv: u64,
    count: usize,
    op: ReduceOp,
    root: usize,
) -> Result<()> {
    let stream = g.comm.stream();
    let from = Region::<T>::new(send, 0, count as u64, stream);
    let mut into = Region::<T>::new(recv, 0, count as u64, stream);
    g.comm.reduce(&from, (g.rank == root).then_some(&mut into), op, root)
}

/// The group's Broadcast of `count` elements of `T` from `send` on `root` into `recv`.
fn broadcast_typed<T: crate::Element>(
    g: &EngineGroup,
    send: u64,
    recv: u64,
    count: usize,
    root: usize,
    in_place: bool,
) -> Result<()> {
    let stream = g.comm.stream();
    let mut into = Region::<T>::new(recv, 0, count as u64, stream);
    if in_place {
        return g.comm.broadcast_in_place(&mut into, root);
    }
    let from = Region::<T>::new(send, 0, count as u64, stream);
    g.comm.broadcast((g.rank == root).then_some(&from), &mut into, root)
}

// SAFETY: every call runs on the caller's addresses and counts through the group's communicator,
// on its stream (the one the caller passes).
unsafe impl InterNode for EngineGroup {
    fn group_rank(&self) -> usize {
        self.rank
    }

    fn group_size(&self) -> usize {
        self.size
    }

    unsafe fn all_reduce(
        &self,
        buf: u64,
        count: usize,
        dtype: DType,
        op: ReduceOp,
        _stream: &CudaStream,
    ) -> Result<()> {
        crate::with_element!(dtype, |T| all_reduce_typed::<T>(self, buf, count, op))
    }

    unsafe fn broadcast(
        &self,
        send: u64,
        recv: u64,
        count: usize,
        dtype: DType,
        root: usize,
        in_place: bool,
        _stream: &CudaStream,
    ) -> Result<()> {
        crate::with_element!(dtype, |T| broadcast_typed::<T>(self, send, recv, count, root, in_place))
    }

    #[allow(clippy::too_many_arguments)]
    unsafe fn reduce(
        &self,
        send: u64,
        recv: u64,
        count: usize,
        dtype: DType,
        op: ReduceOp,
        root: usize,
        _stream: &CudaStream,
    ) -> Result<()> {
        crate::with_element!(dtype, |T| reduce_typed::<T>(self, send, recv, count, op, root))
    }

    fn sends_and_receives(&self) -> bool {
        true
    }

    unsafe fn send_recv(&self, transfers: &[Transfer], _stream: &CudaStream) -> Result<()> {
        let stream = self.comm.stream();
        let (mut sends, mut recvs) = (Vec::new(), Vec::new());
        for t in transfers {
            let region = Region::<u8>::new(t.ptr, 0, t.bytes as u64, stream);
            if t.send { sends.push((t.peer, region)) } else { recvs.push((t.peer, region)) }
        }
        // The group keeps each direction's order per peer, which is all the matching needs.
        let mut group = self.comm.group();
        for (peer, region) in &sends {
            group.send(region, *peer)?;
        }
        for (peer, region) in &mut recvs {
            group.recv(region, *peer)?;
        }
        group.run()
    }

    fn abort(&self) {
        self.comm.abort();
    }

    fn check(&self) -> Result<()> {
        self.comm.query().map(drop)
    }
}

/// `len` elements at `ptr` on this rank's device, as a buffer the node communicator takes. Its
/// owner (the caller's buffer) orders it on the stream; the region adds no guard of its own.
pub(crate) struct Region<T> {
    ptr: sys::CUdeviceptr,
    len: usize,
    stream: Arc<CudaStream>,
    _t: PhantomData<T>,
}

impl<T> Region<T> {
    pub(crate) fn new(base: sys::CUdeviceptr, at: u64, len: u64, stream: &Arc<CudaStream>) -> Region<T> {
        let e = std::mem::size_of::<T>() as u64;
        Region { ptr: base + at * e, len: len as usize, stream: stream.clone(), _t: PhantomData }
    }
}

impl<T> DeviceSlice<T> for Region<T> {
    fn len(&self) -> usize {
        self.len
    }
    fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
}

impl<T> DevicePtr<T> for Region<T> {
    fn device_ptr<'a>(&'a self, _stream: &'a CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        (self.ptr, SyncOnDrop::Sync(None))
    }
}

impl<T> DevicePtrMut<T> for Region<T> {
    fn device_ptr_mut<'a>(&'a mut self, _stream: &'a CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        (self.ptr, SyncOnDrop::Sync(None))
    }
}

/// A bootstrap among the ranks of one group (a node, or one local index across nodes): world rank
/// `root` serves it on this host, and this rank joins as member `index` of `size`. Collective over
/// `world`: every rank calls it once, in the same order; a root that cannot start still takes part
/// in the exchange, so that its members fail at once instead of waiting.
pub(crate) fn group_bootstrap(
    world: &dyn crate::Bootstrap,
    root: usize,
    index: usize,
    size: usize,
    timeout: std::time::Duration,
) -> Result<crate::bootstrap::TcpBootstrap> {
    let serving = (world.rank() == root).then(|| crate::Id::new_on(std::net::SocketAddr::from(([127, 0, 0, 1], 0))));
    let mine = match &serving {
        Some(Ok(id)) => id.to_bytes().to_vec(),
        _ => Vec::new(),
    };
    let ids = world.all_gather(&mine)?;
    if let Some(Err(e)) = serving {
        return Err(e.into());
    }
    let id = crate::Id::from_bytes(&ids[root])?;
    Ok(crate::bootstrap::TcpBootstrap::new(&id, index, size, timeout)?)
}
