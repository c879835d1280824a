//! The communicator: ranks, their streams and workspaces, the plan cache, and the collective calls.

use crate::cache::BuildOnce;
use crate::config::{Config, Shape, check_issuers_fit, combine_direct, combining_ring, launch_shape, validate_config};
use crate::engine::{
    DeviceAlloc, Engine, InUse, LaunchSpec, PeerScope, StatusRecord, bind, check_kept, make_current, sync_context,
    sync_stream, wait_stream,
};
use crate::error::{Error, Result};
use crate::peer::Out;
use crate::plain::{Plain, Units, UnitsMut, in_units, unit_bytes, unit_of, whole_blocks};
use crate::program::{PlanKey, Prepared, Uploaded};
use crate::{DType, Element, ReduceOp};
use cudarc::driver::sys;
use cudarc::driver::{CudaContext, CudaStream, DevicePtr, DevicePtrMut, DeviceSlice};
use oxccl_host::lowered::Lowered;
use oxccl_host::tccl::{self, Collective, PlanSpec, Reduction};
use oxccl_kernels::abi::{self, BUFFER_SLOTS, MAX_RANKS, ReduceMode, Workspace, slot};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

pub(crate) mod group;
pub(crate) mod p2p;

/// A rank this communicator drives (a local rank): its index in the world, its device (an index
/// into `engines`), stream and workspace.
pub(crate) struct Rank {
    index: usize,
    device: usize,
    stream: Arc<CudaStream>,
    workspace: RankWorkspace,
}

/// A local rank's workspace: plain device memory where every rank is in this process, exported
/// memory that peers in other processes mapped otherwise.
pub(crate) enum RankWorkspace {
    Plain(DeviceAlloc),
    /// A per-rank communicator's, its ranks in this process: every rank holds every rank's
    /// ([`crate::peer::Link::_held`]), so none is freed before the last rank of the world drops (a
    /// peer's kernel may still write its flags into it).
    Held(Arc<DeviceAlloc>),
    Shared(Arc<crate::vmm::VmmAlloc>),
}

impl RankWorkspace {
    fn ptr(&self) -> u64 {
        match self {
            RankWorkspace::Plain(a) => a.ptr(),
            RankWorkspace::Held(a) => a.ptr(),
            RankWorkspace::Shared(a) => a.ptr(),
        }
    }

    /// Zeroes the barrier words (not the region table after them), ordered on `stream`.
    fn zero_async(&self, stream: &CudaStream) -> Result<()> {
        match self {
            RankWorkspace::Plain(a) => a.zero_async(stream),
            RankWorkspace::Held(a) => a.zero_async(stream),
            RankWorkspace::Shared(a) => a.zero_async(std::mem::size_of::<Workspace>(), stream),
        }
    }
}

/// What a communicator knows of every rank of its world, the same on every rank (built from the
/// ranks' exchanged facts, or from the local ranks where the communicator drives them all): CTA
/// counts, launch shapes and residency checks are derived from it, so that ranks launched apart
/// build the same plans.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct World {
    /// Per rank, its device: an index into `devices`.
    pub rank_device: Vec<usize>,
    /// The distinct devices of the world.
    pub devices: Vec<DeviceFacts>,
}

/// What a device contributes to the plans: its multiprocessors and opt-in shared memory per CTA.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct DeviceFacts {
    pub sms: u32,
    pub max_smem: u32,
}

impl World {
    /// Ranks of the world.
    fn ranks(&self) -> usize {
        self.rank_device.len()
    }

    /// Ranks on device `d`.
    fn ranks_on(&self, d: usize) -> usize {
        self.rank_device.iter().filter(|&&x| x == d).count()
    }

    /// Each rank's share of the multiprocessors of the busiest device (at least 1): the same on
    /// every rank, wherever launched, since it comes from the whole world.
    pub(crate) fn sm_share(&self) -> u32 {
        let share = (0..self.devices.len())
            .filter(|&d| self.ranks_on(d) > 0)
            .map(|d| (self.devices[d].sms as usize / self.ranks_on(d)).max(1));
        share.min().unwrap_or(1) as u32
    }

    /// The most ranks any device holds.
    fn most_on_a_device(&self) -> usize {
        (0..self.devices.len()).map(|d| self.ranks_on(d)).max().unwrap_or(0)
    }

    /// How far the barriers' flags must reach: GPU scope where one GPU holds the whole world (its
    /// L2 orders every rank's flags), system scope where any rank is on another GPU or host.
    fn peer_scope(&self) -> PeerScope {
        if self.devices.len() == 1 { PeerScope::Gpu } else { PeerScope::System }
    }
}

/// Ranks launched together: one kernel per group per call.
struct Group {
    device: usize,
    stream: Arc<CudaStream>,
    ranks: Vec<usize>,
    status: StatusRecord,
}

/// A local rank: rank `index` of the world, on engine `device`, queued on `stream`.
pub(crate) fn new_rank(index: usize, device: usize, stream: Arc<CudaStream>, workspace: RankWorkspace) -> Rank {
    Rank { index, device, stream, workspace }
}

/// A set of ranks that run collectives together: P virtual ranks on one GPU, one rank per GPU, or a
/// mix, 1 to [`MAX_RANKS`](crate::MAX_RANKS) (16) ranks. Calls take one buffer per rank, like a `ncclGroupStart`/`ncclGroupEnd` block over
/// `cudarc::nccl::Comm`s.
///
/// Calls are asynchronous on the ranks' streams; [`Communicator::synchronize`] waits for them and
/// reports any device-side error (a bounded wait that gave up, a rejected descriptor). The error
/// record lives in host memory the device maps, so a later call also sees an error an earlier call
/// recorded once it has reached host memory (as it is written, at the latest when that launch
/// ended: after any stream or device synchronisation), and then waits for the streams and returns
/// the error instead of launching; [`Communicator::query`] polls without waiting. A stream or context
/// synchronisation through cudarc (or a framework's device sync) waits for the calls but reports
/// nothing, and a call that gave up has partly written outputs: call `synchronize` (or `query`)
/// wherever results must be trusted (once per training step costs one stream wait). A rank whose
/// launch gave up is free of the call once that launch has ended: a peer that starts the call later
/// finds the rank withdrawn and touches none of its buffers, and one already running it is waited
/// for (up to twice the timeout, at least a second) before the launch ends. Plans are built
/// once per (collective, count, dtype, operator, in-place, CTAs, reduction) and kept, uploaded, until
/// [`Communicator::clear_plans`] (first calls racing on several threads for one plan wait for one
/// build; calls for other plans do not wait for it); dropping the communicator waits for its streams
/// first.
pub struct Communicator {
    config: Config,
    engines: Vec<Arc<Engine>>,
    /// The ranks this communicator drives (all of them, or one of a per-rank [`crate::Comm`]).
    ranks: Vec<Rank>,
    /// Every rank of the world.
    world: World,
    /// Every rank's workspace, as this process addresses it.
    workspaces: [u64; MAX_RANKS],
    /// How the ranks reach each other where this communicator does not drive them all.
    pub(crate) link: Option<crate::peer::Link>,
    groups: Vec<Group>,
    /// Each call's plan with its launch, checked to run once when the plan was built (the checks
    /// depend only on the plan, the configuration and the devices, none of which change).
    plans: BuildOnce<PlanSpec, (Arc<Uploaded>, LaunchSpec)>,
    pub(crate) reshard_plans: BuildOnce<PlanKey, Arc<Prepared>>,
    /// Transfer programs lowered onto the engine ([`Communicator::run_program`]).
    pub(crate) program_plans: BuildOnce<crate::program::ProgramKey, Arc<crate::program::ProgramRun>>,
    /// Point-to-point rounds' plans with their launches.
    p2p_plans: BuildOnce<p2p::P2pKey, (Arc<Uploaded>, LaunchSpec)>,
    /// Grouped collectives' launches: plan, where the members' buffers go, launch.
    #[allow(clippy::type_complexity)]
    group_plans: BuildOnce<group::GroupKey, ((Arc<Uploaded>, Arc<oxccl_host::group::GroupLaunch>), LaunchSpec)>,
    /// Plans launched while the ranks' streams were capturing a CUDA graph: the graph holds their
    /// device addresses, so [`Communicator::clear_plans`] leaves them alive (until
    /// [`Communicator::release_captured`] or the communicator's drop).
    captured: Mutex<Vec<Arc<dyn std::any::Any + Send + Sync>>>,
    /// Held while one call queues its launches on every group.
    launch_order: Mutex<()>,
    poison: Poison,
    /// Whether the last launch queued was a point-to-point round: the launch after it is not
    /// launched early either (see [`Communicator::launch_uploaded_as`]).
    after_p2p: std::sync::atomic::AtomicBool,
    /// A per-rank communicator's use of its device's context, dropped last: no memory there is
    /// freed while it lives (a free would hold up the launches its calls wait for; see `InUse`).
    _in_use: Vec<InUse>,
}

/// The ranks' devices, the launch groups (ranks launched together), the configuration and the
/// number of cached plans.
impl std::fmt::Debug for Communicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ordinals: Vec<usize> = self.engines.iter().map(|e| e.context().ordinal()).collect();
        f.debug_struct("Communicator")
            .field("ranks", &self.ranks.len())
            .field("rank_devices", &self.ranks.iter().map(|r| ordinals[r.device]).collect::<Vec<_>>())
            .field("launch_groups", &self.groups.iter().map(|g| &g.ranks).collect::<Vec<_>>())
            .field("config", &self.config)
            // Formatting must not wait for (or deadlock on) a thread holding the cache.
            .field("cached_plans", &self.plans.try_len())
            .finish()
    }
}

impl Communicator {
    /// `ranks` virtual ranks on the GPU of `stream`, all launched together on it.
    pub fn virtual_ranks(stream: &Arc<CudaStream>, ranks: usize, config: Config) -> Result<Self> {
        // Refused before the list is built: a huge count must be an error, not an allocation failure.
        if ranks == 0 || ranks > MAX_RANKS {
            return Err(Error::RankCount { ranks, max: MAX_RANKS });
        }
        let streams = vec![stream.clone(); ranks];
        Self::from_streams(&streams, config)
    }

    /// One rank per stream. Ranks on the same CUDA stream (the same handle, whichever `Arc` holds it)
    /// are launched together in one kernel; ranks on different streams or devices in separate kernels that meet through barriers
    /// in their workspaces. Peer access is enabled between the devices involved.
    ///
    /// Give ranks on separate streams buffers from separate allocations: views of one allocation
    /// share cudarc's one pair of ordering events, which each rank's use overwrites, so later work
    /// would wait for one rank's stream only.
    ///
    /// Separate launches on one device must run at the same time. The driver gives each device
    /// `CUDA_DEVICE_MAX_CONNECTIONS` hardware queues (8 by default) and shares them between streams
    /// beyond that: with more streams on one device than queues (the ranks', and one per process
    /// and device where plans' tables are copied), set it to at least that count before the CUDA
    /// driver is initialised, or a launch or a table's copy may wait behind another rank's work and
    /// the call report [`Error::Timeout`].
    pub fn from_streams(streams: &[Arc<CudaStream>], config: Config) -> Result<Self> {
        if streams.is_empty() || streams.len() > MAX_RANKS {
            return Err(Error::RankCount { ranks: streams.len(), max: MAX_RANKS });
        }
        validate_config(&config)?;
        let mut contexts: Vec<Arc<CudaContext>> = Vec::new();
        let mut engines = Vec::new();
        let mut ranks = Vec::new();
        for s in streams {
            let ctx = s.context();
            let device = match contexts.iter().position(|c| c.ordinal() == ctx.ordinal()) {
                Some(d) => d,
                None => {
                    contexts.push(ctx.clone());
                    engines.push(Engine::shared(ctx)?);
                    contexts.len() - 1
                }
            };
            let workspace = RankWorkspace::Plain(DeviceAlloc::zeroed(ctx, abi::COMM_WORKSPACE_BYTES)?);
            ranks.push(Rank { index: ranks.len(), device, stream: s.clone(), workspace });
        }
        enable_peer_access(&contexts)?;
        let world = World {
            rank_device: ranks.iter().map(|r| r.device).collect(),
            devices: engines.iter().map(|e| DeviceFacts { sms: e.sms, max_smem: e.max_smem }).collect(),
        };
        let mut workspaces = [0u64; MAX_RANKS];
        for r in &ranks {
            workspaces[r.index] = r.workspace.ptr();
        }
        Self::assemble(config, engines, ranks, world, workspaces, None)
    }

    /// A communicator driving `ranks` (each naming its index in `world`), meeting the others through
    /// `workspaces` (every rank's, as this process addresses them) and `link`.
    pub(crate) fn assemble(
        config: Config,
        engines: Vec<Arc<Engine>>,
        ranks: Vec<Rank>,
        world: World,
        workspaces: [u64; MAX_RANKS],
        link: Option<crate::peer::Link>,
    ) -> Result<Self> {
        let contexts: Vec<Arc<CudaContext>> = engines.iter().map(|e| e.context().clone()).collect();
        let mut groups: Vec<Group> = Vec::new();
        for rank in ranks.iter() {
            let r = rank.index;
            // The same CUDA stream may come as different `Arc`s (cudarc hands out a new one for the
            // default stream on every call): group by device and stream handle.
            let same = |g: &Group| g.device == rank.device && g.stream.cu_stream() == rank.stream.cu_stream();
            match groups.iter_mut().find(|g| same(g)) {
                Some(g) => g.ranks.push(r),
                None => groups.push(Group {
                    device: rank.device,
                    stream: rank.stream.clone(),
                    ranks: vec![r],
                    status: StatusRecord::new(&contexts[rank.device])?,
                }),
            }
        }
        let in_use = InUse::of(link.is_some(), &engines);
        let comm = Communicator {
            config,
            engines,
            ranks,
            world,
            workspaces,
            link,
            groups,
            plans: BuildOnce::new(),
            reshard_plans: BuildOnce::new(),
            program_plans: BuildOnce::new(),
            p2p_plans: BuildOnce::new(),
            group_plans: BuildOnce::new(),
            captured: Mutex::new(Vec::new()),
            launch_order: Mutex::new(()),
            poison: Poison::default(),
            after_p2p: std::sync::atomic::AtomicBool::new(false),
            _in_use: in_use,
        };
        // The workspaces were zeroed on the legacy streams: finish before any launch.
        comm.synchronize_devices()?;
        Ok(comm)
    }

    /// One rank per entry of `ordinals` (CUDA device numbers), each on a new stream of its device;
    /// peer access is enabled between the devices. A number given twice puts two ranks on that device,
    /// launched separately. Allocate each rank's buffers on [`Communicator::stream`]`(rank)` (they
    /// must live on the rank's device) and order other work against that stream.
    pub fn from_devices(ordinals: &[usize], config: Config) -> Result<Self> {
        if ordinals.is_empty() || ordinals.len() > MAX_RANKS {
            return Err(Error::RankCount { ranks: ordinals.len(), max: MAX_RANKS });
        }
        if !crate::engine::driver_present() {
            return Err(Error::NoDriver);
        }
        let devices = match CudaContext::device_count() {
            Ok(n) => n as usize,
            // A driver with no usable device (e.g. `CUDA_VISIBLE_DEVICES=""`) fails `cuInit` so.
            Err(e) if e.0 == sys::CUresult::CUDA_ERROR_NO_DEVICE => 0,
            Err(e) => return Err(Error::Driver { call: "cuDeviceGetCount", source: e }),
        };
        let mut contexts: Vec<Arc<CudaContext>> = Vec::new();
        let mut streams = Vec::with_capacity(ordinals.len());
        for &ordinal in ordinals {
            if ordinal >= devices {
                return Err(Error::NoSuchDevice { ordinal, devices });
            }
            let ctx = match contexts.iter().find(|c| c.ordinal() == ordinal) {
                Some(c) => c.clone(),
                None => {
                    let c = CudaContext::new(ordinal).map_err(Error::driver("cuDevicePrimaryCtxRetain"))?;
                    contexts.push(c.clone());
                    c
                }
            };
            streams.push(ctx.new_stream().map_err(Error::driver("cuStreamCreate"))?);
        }
        Self::from_streams(&streams, config)
    }

    /// The stream rank `rank` runs on: its buffers are allocated on it and its calls are queued on it.
    pub fn stream(&self, rank: usize) -> Result<&Arc<CudaStream>> {
        self.local(rank).map(|r| &r.stream).ok_or(Error::NoSuchRank { rank, ranks: self.ranks() })
    }

    /// Number of ranks.
    pub fn ranks(&self) -> usize {
        self.world.ranks()
    }

    /// The local rank with world index `rank` (`None` for a rank another process or communicator
    /// drives).
    fn local(&self, rank: usize) -> Option<&Rank> {
        match self.ranks.get(rank) {
            Some(r) if r.index == rank => Some(r),
            _ => self.ranks.iter().find(|r| r.index == rank),
        }
    }

    /// The configuration.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The engine of the device rank `rank` runs on.
    pub fn engine(&self, rank: usize) -> Result<&Engine> {
        let r = self.local(rank).ok_or(Error::NoSuchRank { rank, ranks: self.ranks() })?;
        Ok(&self.engines[r.device])
    }

    /// CTAs per rank a call uses with the current configuration.
    pub fn ctas_per_rank(&self) -> u32 {
        if let Some(c) = self.config.max_ctas {
            return c;
        }
        self.world.sm_share().min(16)
    }

    /// `recv[r] = op over all ranks q of send[q]`, element-wise. Every buffer has the same length;
    /// send and receive buffers must not overlap (use [`Communicator::all_reduce_in_place`]).
    pub fn all_reduce<T: Element, S: DevicePtr<T>, R: DevicePtrMut<T> + DevicePtr<T>>(
        &self,
        send: &[S],
        recv: &mut [R],
        op: ReduceOp,
    ) -> Result<()> {
        let (count, _) = common_len(send, "send buffers", self.ranks())?;
        self.collective::<T, S, R>(Collective::AllReduce, Count::FromSend(count), Some(send), recv, op, Holders::All)
    }

    /// In-place AllReduce: every `buf[r]` becomes the reduction of all of them.
    pub fn all_reduce_in_place<T: Element, R: DevicePtrMut<T> + DevicePtr<T>>(
        &self,
        bufs: &mut [R],
        op: ReduceOp,
    ) -> Result<()> {
        let (count, _) = common_len(bufs, "buffers", self.ranks())?;
        self.collective::<T, R, R>(Collective::AllReduce, Count::FromRecv(count), None, bufs, op, Holders::All)
    }

    /// The block per rank of in-place buffers that hold one block per rank (an in-place ReduceScatter's
    /// or AllGather's): their common length over the ranks, or a length error naming a buffer `what`
    /// of a rank whose length does not divide.
    fn block_of<T, R: DeviceSlice<T>>(&self, bufs: &[R], what: &'static str) -> Result<usize> {
        let (total, holder) = common_len(bufs, "buffers", self.ranks())?;
        let p = self.ranks();
        if total % p != 0 {
            return Err(Error::Length { what, rank: holder, expected: total.next_multiple_of(p), got: total });
        }
        Ok(total / p)
    }

    /// `recv[r]` (count elements) = op over ranks q of block `r` of `send[q]` (ranks × count elements).
    pub fn reduce_scatter<T: Element, S: DevicePtr<T>, R: DevicePtrMut<T> + DevicePtr<T>>(
        &self,
        send: &[S],
        recv: &mut [R],
        op: ReduceOp,
    ) -> Result<()> {
        let (count, _) = common_len(recv, "receive buffers", self.ranks())?;
        self.collective::<T, S, R>(
            Collective::ReduceScatter,
            Count::FromRecv(count),
            Some(send),
            recv,
            op,
            Holders::All,
        )
    }

    /// In-place ReduceScatter: `buf[r]` holds ranks × count elements; block `r` of it becomes the
    /// reduction of block `r` of all of them (nccl's `recvbuff = sendbuff + rank × count`).
    pub fn reduce_scatter_in_place<T: Element, R: DevicePtrMut<T> + DevicePtr<T>>(
        &self,
        bufs: &mut [R],
        op: ReduceOp,
    ) -> Result<()> {
        let count = self.block_of(bufs, "in-place reduce_scatter buffer")?;
        self.collective::<T, R, R>(Collective::ReduceScatter, Count::FromRecv(count), None, bufs, op, Holders::All)
    }

    /// `recv[r]` (ranks × count elements) = the concatenation of every `send[q]` (count elements).
    /// Any [`Plain`] element type (moved byte for byte; lengths in errors count its units: 4-, 2- or
    /// 1-byte pieces of an element, see [`Plain`]'s module).
    pub fn all_gather<T: Plain, S: DevicePtr<T>, R: DevicePtrMut<T> + DevicePtr<T>>(
        &self,
        send: &[S],
        recv: &mut [R],
    ) -> Result<()> {
        in_units!(T, |U| {
            let send: Vec<_> = send.iter().map(Units::<T, U, S>::new).collect();
            let mut recv: Vec<_> = recv.iter_mut().map(UnitsMut::<T, U, R>::new).collect();
            self.all_gather_units::<U, _, _>(&send, &mut recv)
        })
    }

    fn all_gather_units<T: Element, S: DevicePtr<T>, R: DevicePtrMut<T> + DevicePtr<T>>(
        &self,
        send: &[S],
        recv: &mut [R],
    ) -> Result<()> {
        let (count, _) = common_len(send, "send buffers", self.ranks())?;
        self.collective::<T, S, R>(
            Collective::AllGather,
            Count::FromSend(count),
            Some(send),
            recv,
            ReduceOp::Sum,
            Holders::All,
        )
    }

    /// AllToAll: block `q` of `send[r]` becomes block `r` of `recv[q]` (every buffer ranks × count
    /// elements; out of place only, as `torch.distributed.all_to_all_single` with equal splits). Any
    /// [`Plain`] element type.
    pub fn all_to_all<T: Plain, S: DevicePtr<T>, R: DevicePtrMut<T> + DevicePtr<T>>(
        &self,
        send: &[S],
        recv: &mut [R],
    ) -> Result<()> {
        if unit_bytes::<T>() < std::mem::size_of::<T>() {
            whole_blocks(recv.iter().map(|b| b.len()).enumerate(), self.ranks(), "all_to_all receive buffer")?;
        }
        in_units!(T, |U| {
            let send: Vec<_> = send.iter().map(Units::<T, U, S>::new).collect();
            let mut recv: Vec<_> = recv.iter_mut().map(UnitsMut::<T, U, R>::new).collect();
            self.all_to_all_units::<U, _, _>(&send, &mut recv)
        })
    }

    fn all_to_all_units<T: Element, S: DevicePtr<T>, R: DevicePtrMut<T> + DevicePtr<T>>(
        &self,
        send: &[S],
        recv: &mut [R],
    ) -> Result<()> {
        let count = self.block_of(recv, "all_to_all receive buffer")?;
        self.collective::<T, S, R>(
            Collective::AllToAll,
            Count::FromRecv(count),
            Some(send),
            recv,
            ReduceOp::Sum,
            Holders::All,
        )
    }

    /// In-place AllGather: block `r` of `buf[r]` is rank r's contribution (nccl's
    /// `sendbuff = recvbuff + rank × count`); every buffer ends with all blocks. Any [`Plain`]
    /// element type.
    pub fn all_gather_in_place<T: Plain, R: DevicePtrMut<T> + DevicePtr<T>>(&self, bufs: &mut [R]) -> Result<()> {
        if unit_bytes::<T>() < std::mem::size_of::<T>() {
            whole_blocks(bufs.iter().map(|b| b.len()).enumerate(), self.ranks(), "in-place all_gather buffer")?;
        }
        in_units!(T, |U| {
            let mut bufs: Vec<_> = bufs.iter_mut().map(UnitsMut::<T, U, R>::new).collect();
            self.all_gather_in_place_units::<U, _>(&mut bufs)
        })
    }

    fn all_gather_in_place_units<T: Element, R: DevicePtrMut<T> + DevicePtr<T>>(&self, bufs: &mut [R]) -> Result<()> {
        let count = self.block_of(bufs, "in-place all_gather buffer")?;
        self.collective::<T, R, R>(
            Collective::AllGather,
            Count::FromRecv(count),
            None,
            bufs,
            ReduceOp::Sum,
            Holders::All,
        )
    }

    /// Broadcast: every `recv[r]` becomes a copy of `send`, rank `root`'s buffer (on its device; all
    /// buffers of one length). `send` must not overlap any receive buffer (use
    /// [`Communicator::broadcast_in_place`]). Any [`Plain`] element type.
    pub fn broadcast<T: Plain, S: DevicePtr<T>, R: DevicePtrMut<T> + DevicePtr<T>>(
        &self,
        send: &S,
        recv: &mut [R],
        root: usize,
    ) -> Result<()> {
        in_units!(T, |U| {
            let send = Units::<T, U, S>::new(send);
            let mut recv: Vec<_> = recv.iter_mut().map(UnitsMut::<T, U, R>::new).collect();
            self.broadcast_units::<U, _, _>(&send, &mut recv, root)
        })
    }

    fn broadcast_units<T: Element, S: DevicePtr<T>, R: DevicePtrMut<T> + DevicePtr<T>>(
        &self,
        send: &S,
        recv: &mut [R],
        root: usize,
    ) -> Result<()> {
        let collective = self.rooted(root, |root| Collective::Broadcast { root })?;
        // The count from the receive buffers, the many: a send buffer of another length is the one
        // named wrong.
        let (count, _) = common_len(recv, "receive buffers", self.ranks())?;
        self.collective::<T, S, R>(
            collective,
            Count::FromRecv(count),
            Some(std::slice::from_ref(send)),
            recv,
            ReduceOp::Sum,
            Holders::All,
        )
    }

    /// In-place Broadcast: every `buf[r]` becomes a copy of `buf[root]`, which is left as it is. Any
    /// [`Plain`] element type.
    pub fn broadcast_in_place<T: Plain, R: DevicePtrMut<T> + DevicePtr<T>>(
        &self,
        bufs: &mut [R],
        root: usize,
    ) -> Result<()> {
        in_units!(T, |U| {
            let mut bufs: Vec<_> = bufs.iter_mut().map(UnitsMut::<T, U, R>::new).collect();
            self.broadcast_in_place_units::<U, _>(&mut bufs, root)
        })
    }

    fn broadcast_in_place_units<T: Element, R: DevicePtrMut<T> + DevicePtr<T>>(
        &self,
        bufs: &mut [R],
        root: usize,
    ) -> Result<()> {
        let collective = self.rooted(root, |root| Collective::Broadcast { root })?;
        let (count, _) = common_len(bufs, "buffers", self.ranks())?;
        self.collective::<T, R, R>(collective, Count::FromRecv(count), None, bufs, ReduceOp::Sum, Holders::All)
    }

    /// Reduce: `recv`, rank `root`'s buffer (on its device), becomes op over all ranks q of `send[q]`,
    /// element-wise (all buffers of one length; `recv` must not overlap a send buffer: use
    /// [`Communicator::reduce_in_place`]).
    pub fn reduce<T: Element, S: DevicePtr<T>, R: DevicePtrMut<T> + DevicePtr<T>>(
        &self,
        send: &[S],
        recv: &mut R,
        op: ReduceOp,
        root: usize,
    ) -> Result<()> {
        let collective = self.rooted(root, |root| Collective::Reduce { root })?;
        let (count, _) = common_len(send, "send buffers", self.ranks())?;
        self.collective::<T, S, R>(
            collective,
            Count::FromSend(count),
            Some(send),
            std::slice::from_mut(recv),
            op,
            Holders::Root(root),
        )
    }

    /// In-place Reduce: `buf[root]` becomes the reduction of every `buf[r]`; the other buffers are
    /// left as they are.
    pub fn reduce_in_place<T: Element, R: DevicePtrMut<T> + DevicePtr<T>>(
        &self,
        bufs: &mut [R],
        op: ReduceOp,
        root: usize,
    ) -> Result<()> {
        let collective = self.rooted(root, |root| Collective::Reduce { root })?;
        let (count, _) = common_len(bufs, "buffers", self.ranks())?;
        self.collective::<T, R, R>(collective, Count::FromRecv(count), None, bufs, op, Holders::All)
    }

    /// The rooted collective `make(root)`, or [`Error::NoSuchRank`] for a root outside the ranks.
    pub(crate) fn rooted(&self, root: usize, make: impl Fn(u32) -> Collective) -> Result<Collective> {
        if root >= self.ranks() {
            return Err(Error::NoSuchRank { rank: root, ranks: self.ranks() });
        }
        Ok(make(root as u32))
    }

    /// Waits for every rank's stream and reports the first device-side error recorded since the
    /// communicator was built or last [`Communicator::reset`] (the record is kept: the same error is
    /// reported again until then). After an error the communicator refuses calls until `reset`.
    pub fn synchronize(&self) -> Result<()> {
        // Before the records are read: a reset meanwhile clears them, and then the error read here
        // must not poison the communicator the reset made usable.
        let epoch = self.poison.epoch();
        if self.capturing()? {
            return Err(Error::Capturing { what: "synchronize" });
        }
        for r in &self.ranks {
            sync_stream(&r.stream)?;
        }
        if let Some(e) = self.recorded_error() {
            self.poison.set_since(epoch);
            return Err(e);
        }
        Ok(())
    }

    /// The error the launch groups' status records hold, the cause first: a record that only says a
    /// CTA stopped because a peer gave up ([`Error::PeerAborted`]) where no group holds another.
    fn recorded_error(&self) -> Option<Error> {
        let errors: Vec<Error> = self.groups.iter().filter_map(|g| Error::from_status(&g.status.read())).collect();
        let cause = errors.iter().position(|e| !matches!(e, Error::PeerAborted { .. })).unwrap_or(0);
        errors.into_iter().nth(cause)
    }

    /// Polls: `Ok(true)` when every call queued so far has finished without a device-side error,
    /// `Ok(false)` while some still run and no error has reached host memory. It waits only when
    /// one has: for the ranks' streams (the launch that recorded it ends within its bounded waits: a
    /// few timeouts, see [`Config::timeout`]), and
    /// returns the error, as [`Communicator::synchronize`] does. Not while a rank's stream captures a
    /// CUDA graph ([`Error::Capturing`]).
    pub fn query(&self) -> Result<bool> {
        let epoch = self.poison.epoch();
        if self.capturing()? {
            return Err(Error::Capturing { what: "query" });
        }
        if self.groups.iter().any(|g| g.status.errors() != 0) {
            return self.synchronize().map(|()| true);
        }
        for r in &self.ranks {
            bind(r.stream.context())?;
            // SAFETY: a status query of a live stream of the context just made current.
            match unsafe { sys::cuStreamQuery(r.stream.cu_stream()) }.result() {
                Ok(()) => {}
                Err(e) if e.0 == sys::CUresult::CUDA_ERROR_NOT_READY => return Ok(false),
                Err(e) => return Err(Error::Driver { call: "cuStreamQuery", source: e }),
            }
        }
        // Every stream was idle: errors recorded before that are visible now.
        match self.recorded_error() {
            Some(e) => {
                self.poison.set_since(epoch);
                Err(e)
            }
            None => Ok(true),
        }
    }

    /// Clears device state after an error: waits for the streams, zeroes every workspace (barrier
    /// counters) and status record. Calls from other threads wait until it is done.
    pub fn reset(&self) -> Result<()> {
        // No call queues launches meanwhile: one would run between the wait and the zeroing, and an
        // error it recorded would be cleared unseen.
        let _order = self.launch_order.lock().unwrap_or_else(|e| e.into_inner());
        if self.capturing()? {
            return Err(Error::Capturing { what: "reset" });
        }
        for r in &self.ranks {
            sync_stream(&r.stream)?;
        }
        for r in &self.ranks {
            r.workspace.zero_async(&r.stream)?;
        }
        // The zeroing is queued: a kept error now belongs to a later call, not to this wait.
        for r in &self.ranks {
            wait_stream(&r.stream)?;
        }
        for g in &self.groups {
            g.status.clear();
        }
        // Ranks driven apart reset apart: none calls again before every one has zeroed its
        // workspace (a peer's first flag would be zeroed, or meet a stale count).
        if let Some(link) = &self.link {
            link.bootstrap.barrier()?;
        }
        self.poison.clear();
        Ok(())
    }

    /// The launch parameters a call of `spec` would use with `slots` shared-memory slots per stage
    /// and (where `combines`) threads combining sources (for inspection and benchmarks; it builds no
    /// plan).
    pub fn launch_spec(&self, spec: &PlanSpec, slots: u32, combines: bool) -> Result<LaunchSpec> {
        let per_device = self.world.most_on_a_device() as u64;
        let direct = combine_direct(&self.config, per_device * spec.ctas as u64);
        let from_registers = combining_ring(spec.bulk(), spec.collective, direct, self.world.devices.len());
        let mut launch = self.shaped_launch_spec(spec.dtype, spec.op, slots, combines, from_registers)?;
        launch.combine_direct = direct;
        Ok(launch)
    }

    /// The launch parameters of a program of `dtype` tasks reducing with `op` (ignored by copies) that
    /// needs `slots` shared-memory slots per stage and combines sources or not. It knows no CTA
    /// count nor collective, so `combine_direct` is `Config::combine_direct` or `false` and the ring is
    /// [`auto_pipeline`](crate::auto_pipeline)'s; [`Self::launch_spec`] applies the automatic rules (and
    /// [`combining_pipeline`](crate::combining_pipeline)'s ring) as a collective call does.
    pub fn launch_spec_for(&self, dtype: DType, op: ReduceOp, slots: u32, combines: bool) -> Result<LaunchSpec> {
        self.shaped_launch_spec(dtype, op, slots, combines, false)
    }

    /// [`Self::launch_spec_for`], with [`combining_pipeline`]'s ring where `from_registers` says that
    /// every combining task stores its result from registers.
    fn shaped_launch_spec(
        &self,
        dtype: DType,
        op: ReduceOp,
        slots: u32,
        combines: bool,
        from_registers: bool,
    ) -> Result<LaunchSpec> {
        let c = &self.config;
        let max_smem = self.world.devices.iter().map(|d| d.max_smem).min().unwrap_or(0) as usize;
        let room = max_smem.saturating_sub(abi::smem::STAGES);
        let shape = launch_shape(c, room, slots, combines, from_registers);
        check_issuers_fit(c, &shape, room, slots)?;
        let Shape { threads, chunk, stages, issuers } = shape;
        Ok(LaunchSpec {
            mover: c.mover,
            dtype,
            op,
            threads,
            chunk_bytes: chunk,
            stages,
            reduce_mode: match c.reduction {
                Reduction::Registers => ReduceMode::Registers,
                Reduction::Tma => ReduceMode::Tma,
            },
            timeout_ns: c.timeout.as_nanos().min(u64::MAX as u128) as u64,
            wait_suspend_ns: c.wait_suspend_ns,
            issuers,
            combine_direct: c.combine_direct.unwrap_or(false),
            call_key: 0,
            peer_scope: self.world.peer_scope(),
            latency_below: c.latency_below,
        })
    }

    /// The plan for `spec` and its launch, built, checked and uploaded on first use (the upload
    /// complete before the call's launches are queued).
    fn plan(&self, spec: &PlanSpec) -> Result<(Arc<Uploaded>, LaunchSpec)> {
        let (plan_and_launch, _) = self.plans.get_or_build(*spec, || {
            let lowered = tccl::plan(spec)?;
            // A plan whose launch cannot run is refused before it is uploaded and cached.
            let mut launch = self.launch_spec(spec, lowered.slots, lowered.combines)?;
            launch.call_key = call_key(spec);
            self.check_resident(&launch, spec.ctas, lowered.slots)?;
            Ok((Arc::new(self.upload(lowered, spec.ctas)?), launch))
        })?;
        Ok(plan_and_launch)
    }

    /// Errors with [`Error::Poisoned`] after a reported, unreset device error; with the error itself
    /// where a launch has recorded one that was not reported yet and has reached host memory (after
    /// waiting for the streams; during a CUDA graph capture, which a wait would end, at once).
    pub(crate) fn check_usable(&self) -> Result<()> {
        refuse_after_device_error(
            &self.poison,
            self.groups.iter().map(|g| &g.status),
            || self.capturing(),
            || self.synchronize(),
        )
    }

    /// Whether any rank's stream is capturing a CUDA graph (or was, and the capture broke).
    fn capturing(&self) -> Result<bool> {
        any_capturing(self.groups.iter().map(|g| &*g.stream))
    }

    /// Uploads a program of `ctas` CTAs per rank (rank-major, every rank of the communicator) for every
    /// launch group: each group gets its ranks' programs and all the tasks.
    pub(crate) fn upload(&self, mut lowered: Lowered, ctas: u32) -> Result<Uploaded> {
        if self.capturing()? {
            // Plans are built outside captures (`prepare` first): tables are freed in their stream's
            // order, which a capture would record into the graph rather than run.
            return Err(Error::Capturing { what: "a call whose plan is not built yet" });
        }
        check_contexts(self.groups.iter().map(|g| g.stream.context()))?;
        if self.groups.len() == 1 && self.ranks.len() == self.ranks() {
            // One launch holds every rank: the stream orders it after the producers of every input and
            // before the consumers of every output, so no barrier is needed.
            for p in &mut lowered.programs {
                p.barrier_ranks = 0;
            }
        }
        let c = ctas as usize;
        let mut per_group = Vec::new();
        for g in &self.groups {
            let engine = &self.engines[g.device];
            let mut sub = Lowered { programs: Vec::new(), ..lowered.clone() };
            for &r in &g.ranks {
                sub.programs.extend_from_slice(&lowered.programs[r * c..(r + 1) * c]);
            }
            let n = sub.programs.len();
            // For launches on the group's stream (which frees the tables after them); complete
            // when it returns.
            per_group.push(engine.upload(&sub, 0..n, &g.stream)?);
        }
        Ok(Uploaded { lowered, per_group })
    }

    /// Waits for all work on every device of the communicator (its contexts' legacy streams included).
    fn synchronize_devices(&self) -> Result<()> {
        for e in &self.engines {
            sync_context(e.context())?;
        }
        Ok(())
    }

    /// Checks that every launch on a device, `ctas` CTAs per rank needing `slots` slots, can be
    /// resident together with the others on it.
    pub(crate) fn check_resident(&self, launch: &LaunchSpec, ctas: u32, slots: u32) -> Result<()> {
        for (d, engine) in self.engines.iter().enumerate() {
            // Every rank of the world on this device, whoever launches it: all must be resident.
            let ranks = self
                .ranks
                .iter()
                .find(|r| r.device == d)
                .map_or(0, |r| self.world.ranks_on(self.world.rank_device[r.index])) as u32;
            // The engine counts the device's CTAs; say how they come about, since the caller set
            // CTAs per rank.
            engine.check(launch, ranks * ctas, slots).map_err(|e| match e {
                Error::TooManyCtas { requested, max, why } if ranks > 1 => Error::TooManyCtas {
                    requested,
                    max,
                    why: format!("{ranks} ranks on GPU {} × {ctas} CTAs each; {why}", engine.context().ordinal()),
                },
                e => e,
            })?;
        }
        Ok(())
    }

    /// Launches each of `programs` in turn once per group, on the groups' streams, with the buffer
    /// table `buffers`, under one hold of the launch order (no other call's launches between them).
    ///
    /// # Safety
    /// `buffers` holds, for every (rank, slot) the programs' tasks touch, the address of a buffer on
    /// that rank's device large enough for every range the tasks address, alive (and not used by other
    /// work) until the launches complete.
    pub(crate) unsafe fn launch_uploaded<'a>(
        &self,
        programs: impl IntoIterator<Item = &'a Uploaded>,
        launch: &LaunchSpec,
        buffers: [[u64; BUFFER_SLOTS]; MAX_RANKS],
    ) -> Result<()> {
        // SAFETY: forwarded contract.
        unsafe { self.launch_uploaded_as(programs, launch, buffers, true) }
    }

    /// [`Communicator::launch_uploaded`], each kernel launched early behind its stream's previous
    /// one where `early` (see [`Engine::launch_as`]). `early` is false for point-to-point rounds,
    /// and then also for the launch after one: a kernel placed early behind a round holds room
    /// while ranks the round did not meet may still need it for theirs.
    ///
    /// # Safety
    /// As [`Communicator::launch_uploaded`].
    pub(crate) unsafe fn launch_uploaded_as<'a>(
        &self,
        programs: impl IntoIterator<Item = &'a Uploaded>,
        launch: &LaunchSpec,
        buffers: [[u64; BUFFER_SLOTS]; MAX_RANKS],
        early: bool,
    ) -> Result<()> {
        let workspaces = self.workspaces;
        // Every group must see calls in the same order (barriers pair CTAs by a per-CTA call count):
        // calls from several threads queue their groups' launches one call at a time.
        let _order = self.launch_order.lock().unwrap_or_else(|e| e.into_inner());
        // In launch order (under the lock): whether the previous launch was a round.
        let early = !self.after_p2p.swap(!early, Ordering::SeqCst) && early;
        // Again under the lock: another thread's call may have failed halfway since this call's check.
        if self.poison.is_set() {
            return Err(Error::Poisoned);
        }
        // An error cudarc kept for a stream's context may be a buffer guard's failed stream wait (the
        // wait is then not in place): report it before any group is queued.
        check_contexts(self.groups.iter().map(|g| g.stream.context()))?;
        for (i, program) in programs.into_iter().enumerate() {
            for (k, (g, prog)) in self.groups.iter().zip(&program.per_group).enumerate() {
                let engine = &self.engines[g.device];
                // SAFETY: the caller vouches for the buffer table; the status record is the group's
                // own; every group of the communicator is launched here, so barriers meet.
                let launched =
                    unsafe { engine.launch_as(&g.stream, prog, launch, buffers, workspaces, g.status.ptr(), early) };
                if let Err(e) = launched {
                    if i > 0 || k > 0 {
                        // Earlier launches are queued and will wait for this one at their barriers:
                        // the call counts of the groups now disagree until `reset` (which waits for
                        // the lock held here: the epoch is current).
                        self.poison.set_since(self.poison.epoch());
                    }
                    return Err(e);
                }
            }
        }
        Ok(())
    }

    /// The stream of rank `rank`.
    pub(crate) fn rank_stream(&self, rank: usize) -> &Arc<CudaStream> {
        &self.local(rank).expect("a local rank").stream
    }

    /// Builds and uploads the plan that a later call with these arguments uses, and checks that its
    /// launch fits the devices: that call then only queues kernels (no allocation, upload or host
    /// synchronisation). Prepare every size this way before capturing calls in a CUDA graph, where
    /// a first call would upload its plan inside the capture. Every rank's stream must take part in
    /// the capture (ranks on other streams are launched separately and meet at barriers: capture one
    /// stream alone and the others' launches run at once and wait for a partner that never comes).
    /// A plan is copied in order on the ranks' streams, and it waits for that copy (its own, or that
    /// of another thread's call that built the plan) before returning, so the plan is in place for
    /// launches on any stream. `count` is the call's
    /// count: AllReduce, Broadcast and Reduce, elements per buffer; ReduceScatter, elements each rank
    /// receives; AllGather, elements each rank sends (in place, the buffers hold ranks × count). `op`
    /// is ignored for AllGather and Broadcast. Returns how the call launches (threads, pipeline,
    /// shared memory: what kernels beside it must leave room for).
    pub fn prepare<T: Element>(
        &self,
        collective: Collective,
        count: usize,
        op: ReduceOp,
        in_place: bool,
    ) -> Result<CallLaunch> {
        self.check_usable()?;
        if let Some(root) = collective.root() {
            // As the calls name it.
            self.rooted(root, |_| collective)?;
        }
        let spec = self.spec::<T>(collective, count, op, in_place);
        let (plan, launch) = self.plan(&spec)?;
        // The tables are complete once uploaded, for a graph replayed on any stream.
        check_contexts(self.groups.iter().map(|g| g.stream.context()))?;
        let slots = plan.lowered.slots;
        for g in &self.groups {
            self.engines[g.device].function(launch.mover, launch.dtype, launch.op)?;
        }
        Ok(CallLaunch {
            spec: launch,
            ctas_per_rank: spec.ctas,
            slots,
            smem_bytes: Engine::smem_bytes(&launch, slots) as u32,
        })
    }

    /// [`Communicator::prepare`] for a collective that only copies (AllGather, Broadcast, AllToAll)
    /// of any [`Plain`] type, `count` in elements of `T` as the call counts them: the plan its calls
    /// take (one per 4-, 2- or 1-byte unit). A collective that reduces is
    /// [`Error::Unsupported`] here: prepare it with its [`Element`] type.
    pub fn prepare_copy<T: Plain>(&self, collective: Collective, count: usize, in_place: bool) -> Result<CallLaunch> {
        if collective.reduces() {
            return Err(Error::Unsupported {
                what: format!("prepare_copy of {} (it reduces: prepare it with its element type)", collective.name()),
            });
        }
        let units = count * (std::mem::size_of::<T>() / unit_bytes::<T>());
        in_units!(T, |U| { self.prepare::<U>(collective, units, ReduceOp::Sum, in_place) })
    }

    /// Collective plans built and uploaded so far (each kept until [`Communicator::clear_plans`] or
    /// the communicator's end).
    pub fn cached_plans(&self) -> usize {
        self.plans.len()
    }

    /// Frees every cached plan (collectives and reshards) after waiting for the ranks' streams: a
    /// caller whose counts change from call to call (dynamic shapes) bounds the device memory the
    /// cache holds this way. Later calls build their plans again. Callable while other threads make
    /// calls: it waits for any call queueing its launches, and a call that took a plan from the
    /// cache before it was cleared waits for its own launches before that plan is freed.
    ///
    /// A plan a call launched while the ranks' streams were capturing a CUDA graph is not freed:
    /// the graph holds its device addresses, and a replay after this call still finds the plan
    /// ([`Communicator::captured_plans`] counts them). They are freed with the communicator (a graph
    /// must not be replayed after that), or by [`Communicator::release_captured`] once every such
    /// graph is destroyed.
    pub fn clear_plans(&self) -> Result<()> {
        let _order = self.launch_order.lock().unwrap_or_else(|e| e.into_inner());
        if self.capturing()? {
            return Err(Error::Capturing { what: "clear_plans" });
        }
        for r in &self.ranks {
            sync_stream(&r.stream)?;
        }
        self.plans.clear();
        self.reshard_plans.clear();
        self.program_plans.clear();
        self.p2p_plans.clear();
        self.group_plans.clear();
        Ok(())
    }

    /// The plans kept for CUDA graphs captured from this communicator's calls (see
    /// [`Communicator::clear_plans`]).
    pub fn captured_plans(&self) -> usize {
        self.captured.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// Frees the plans kept for captured CUDA graphs (those not also in the cache) after waiting
    /// for the ranks' streams.
    ///
    /// # Safety
    /// No CUDA graph captured from this communicator's calls is launched afterwards (destroy them
    /// first): a replay would read the freed plans.
    pub unsafe fn release_captured(&self) -> Result<()> {
        let _order = self.launch_order.lock().unwrap_or_else(|e| e.into_inner());
        if self.capturing()? {
            return Err(Error::Capturing { what: "release_captured" });
        }
        for r in &self.ranks {
            sync_stream(&r.stream)?;
        }
        self.captured.lock().unwrap_or_else(|e| e.into_inner()).clear();
        Ok(())
    }

    /// Drops a call's reference to its plan once its launches are queued. Where
    /// [`Communicator::clear_plans`] has taken the plan out of the cache meanwhile, this reference
    /// is the last and the plan's device memory is freed with it: the ranks' streams are waited for
    /// first, since the launches still read it. (The cache's own reference keeps it otherwise: no
    /// other call can take it once it is out of the cache, so the count cannot rise again.)
    pub(crate) fn release_plan<P: Send + Sync + 'static>(&self, plan: Arc<P>) -> Result<()> {
        // A captured launch: the graph keeps reading the plan at every replay.
        if self.capturing()? {
            let mut captured = self.captured.lock().unwrap_or_else(|e| e.into_inner());
            let plan: Arc<dyn std::any::Any + Send + Sync> = plan;
            if !captured.iter().any(|p| Arc::ptr_eq(p, &plan)) {
                captured.push(plan);
            }
            return Ok(());
        }
        // `into_inner` yields the plan to exactly one of the calls that drop the last references at
        // once (a count read before the drop could read 2 in both).
        // (Its tables are freed in their streams' order in any case; the wait reports a device error
        // before the call returns.)
        if let Some(last) = Arc::into_inner(plan) {
            // The call's launches are queued: a kept error is left for a later call (reported here, it
            // would say the call did nothing).
            let waited = self.ranks.iter().try_for_each(|r| wait_stream(&r.stream));
            drop(last);
            return waited;
        }
        Ok(())
    }

    /// The plan key of a call.
    fn spec<T: Element>(&self, collective: Collective, count: usize, op: ReduceOp, in_place: bool) -> PlanSpec {
        PlanSpec {
            collective,
            count: count as u64,
            // Collectives that only copy move units of 4, 2 or 1 bytes (`crate::plain`): one plan per
            // unit whatever the element type, and whatever the operator.
            dtype: if collective.reduces() { T::DTYPE } else { unit_of(T::DTYPE.size()) },
            op: if collective.reduces() { op } else { ReduceOp::Sum },
            ranks: self.ranks(),
            in_place,
            ctas: self.ctas_per_rank(),
            reduction: self.config.reduction,
        }
    }

    /// Checks and launches one call. `send` (`None` in place) holds one buffer per rank; `recv` one per
    /// rank, or the root's alone where `recv_holders` says so (an out-of-place Reduce). An
    /// out-of-place Broadcast's `send` is the root's buffer alone.
    pub(crate) fn collective<T: Element, S: DevicePtr<T>, R: DevicePtrMut<T> + DevicePtr<T>>(
        &self,
        collective: Collective,
        count: Count,
        send: Option<&[S]>,
        recv: &mut [R],
        op: ReduceOp,
        recv_holders: Holders,
    ) -> Result<()> {
        let (count, send_first) = match count {
            Count::FromSend(n) => (n, true),
            Count::FromRecv(n) => (n, false),
        };
        self.check_usable()?;
        let p = self.ranks();
        let in_place = send.is_none();
        let spec = self.spec::<T>(collective, count, op, in_place);
        let send_holders = match collective {
            Collective::Broadcast { root } => Holders::Root(root as usize),
            _ => Holders::All,
        };
        let (in_bytes, out_bytes) = spec.buffer_bytes();
        let e = std::mem::size_of::<T>();
        let (in_len, out_len) = ((in_bytes as usize) / e, (out_bytes as usize) / e);

        // Count, device and length first: they need no address, and cudarc's ordering guards below
        // are taken only on buffers of the rank's own device.
        // The ranks each list's buffers belong to, in order: this communicator's ranks, or the root
        // where it is one of them.
        let (recv_ranks, send_ranks) = (self.holding(recv_holders), self.holding(send_holders));
        if recv.len() != recv_ranks.len() {
            return Err(Error::BufferCount { what: "receive buffers", expected: recv_ranks.len(), got: recv.len() });
        }
        if let Some(s) = send
            && s.len() != send_ranks.len()
        {
            return Err(Error::BufferCount { what: "send buffers", expected: send_ranks.len(), got: s.len() });
        }
        let expected_recv = if in_place { in_len.max(out_len) } else { out_len };
        let recv_what = if in_place { "buffer" } else { "receive buffer" };
        let check_recv = || {
            recv.iter().enumerate().try_for_each(|(i, b)| {
                self.check_placement(b.len(), ordinal_of(b), recv_ranks[i], Some(expected_recv), recv_what)
            })
        };
        let check_send = || {
            send.unwrap_or(&[]).iter().enumerate().try_for_each(|(i, b)| {
                self.check_placement(b.len(), ordinal_of(b), send_ranks[i], Some(in_len), "send buffer")
            })
        };
        // The list the count came from (`common_len`) is checked first, so a wrong buffer there is
        // the one named, not a right one of the other list.
        if send_first {
            check_send()?;
            check_recv()?;
        } else {
            check_recv()?;
            check_send()?;
        }

        // The plan and its launch need no address either: anything that fails there fails before a
        // guard is taken.
        // Every launch on a device was checked to be resident with the others on it when the plan was
        // built.
        let (plan, launch) = self.plan(&spec)?;

        // cudarc's stream-ordering guards, on each rank's stream: it waits for the buffer's last write
        // (and, for a buffer this call writes, its last read), and the guards record this call's use
        // when they drop, after every launch is queued. Their addresses are the ones checked and used.
        // In place, a rooted collective leaves some buffers as they are: those are only read. They are
        // taken and dropped outside the launch lock: another thread's launch queued between a guard's
        // wait and this call's launch, or between this launch and the guard's event, only adds
        // ordering (the wait still precedes this launch, the event still follows it).
        let written = |r: usize| spec.writes(r);
        let mut guards = Vec::with_capacity(2 * p);
        let mut recv_ptr = Vec::with_capacity(recv.len());
        for (i, b) in recv.iter_mut().enumerate() {
            let r = recv_ranks[i];
            let stream = &self.local_rank(r).stream;
            if written(r) {
                let (ptr, guard) = b.device_ptr_mut(stream);
                recv_ptr.push((r, ptr));
                guards.push(GuardKind::Write(guard));
            } else {
                let (ptr, guard) = b.device_ptr(stream);
                recv_ptr.push((r, ptr));
                guards.push(GuardKind::Read(guard));
            }
        }
        let mut send_ptr = Vec::with_capacity(p);
        for (i, b) in send.unwrap_or(&[]).iter().enumerate() {
            let r = send_ranks[i];
            let (ptr, guard) = b.device_ptr(&self.local_rank(r).stream);
            send_ptr.push((r, ptr));
            guards.push(GuardKind::Read(guard));
        }
        let mut ranges = Vec::with_capacity(2 * p);
        for (ptrs, len, what, writes) in
            [(&recv_ptr, expected_recv, recv_what, true), (&send_ptr, in_len, "send buffer", false)]
        {
            for &(r, ptr) in ptrs.iter() {
                check_aligned(ptr, r, what, e)?;
                let start = ptr;
                let end = ptr + (len * e) as u64;
                let writes = writes && written(r);
                ranges.push(Range { start, end, rank: r, device: self.local_rank(r).device, writes, buffer: what });
            }
        }
        check_disjoint(&ranges, if in_place { "in-place buffers" } else { "send and receive buffers" })?;

        // Where peers in other processes must reach a buffer they cannot map (cudarc's pool memory),
        // it goes through this rank's staging memory: copied in before the launch, out after. The
        // hold keeps another thread's call from using the staging memory in between.
        let mut staging = None;
        if let Some(link) = &self.link
            && link.peer.is_some()
        {
            let ins: Vec<(u64, usize)> = send_ptr.iter().map(|&(_, p)| (p, in_len * e)).collect();
            let outs: Vec<Out> = recv_ptr
                .iter()
                .map(|&(r, ptr)| Out { ptr, bytes: expected_recv * e, written: written(r), read: in_place })
                .collect();
            staging = Some(link.stage(&ins, &outs)?);
        }
        if let Some(st) = &mut staging {
            for ((_, p), sub) in send_ptr.iter_mut().zip(&st.inputs) {
                *p = *sub;
            }
            for ((_, p), sub) in recv_ptr.iter_mut().zip(&st.outputs) {
                *p = *sub;
            }
        }
        // The buffer table: every rank's input and output, and in-place aliases resolved. A buffer a
        // rank does not have (a Broadcast's input, a Reduce's output, off the root) stays 0: its plan
        // never addresses it.
        let mut buffers = [[0u64; BUFFER_SLOTS]; MAX_RANKS];
        for &(r, out) in &recv_ptr {
            let (input, output) = spec.slot_addresses(r, 0, out);
            buffers[r][slot::INPUT as usize] = input;
            buffers[r][slot::OUTPUT as usize] = output;
        }
        for &(r, input) in &send_ptr {
            buffers[r][slot::INPUT as usize] = input;
        }
        // Where anything is staged, the communicator drives one rank: its stream.
        let stream = self.ranks.first().map(|r| &*r.stream);
        let launched = crate::peer::Staging::around(staging.as_ref(), stream, || {
            // SAFETY: every address in the table was checked above (device, length, alignment,
            // disjointness) and belongs to buffers borrowed for this call, or to this rank's
            // staging memory standing in for them, held (by `staging`) until the call is queued;
            // the plan addresses exactly these lengths, and never a slot left 0
            // (`PlanSpec::rank_buffers`).
            unsafe { self.launch_uploaded([&*plan], &launch, buffers) }
        });
        drop(staging);
        drop(guards);
        // Also after a failed launch: another group's may be queued.
        let released = self.release_plan(plan);
        launched.and(released)
    }

    /// Checks that a buffer of rank `rank` (`len` elements, on the device of ordinal `ordinal`) is on
    /// that rank's device and, where `expected` is given, holds that many elements.
    pub(crate) fn check_placement(
        &self,
        len: usize,
        ordinal: usize,
        rank: usize,
        expected: Option<usize>,
        what: &'static str,
    ) -> Result<()> {
        let device = self.engines[self.local_rank(rank).device].context().ordinal();
        check_placed(len, ordinal, device, rank, expected, what)
    }

    /// The engine index of rank `rank`'s device.
    pub(crate) fn rank_device(&self, rank: usize) -> usize {
        self.local_rank(rank).device
    }

    /// The local rank `rank` (one the caller knows this communicator drives: a buffer list's).
    fn local_rank(&self, rank: usize) -> &Rank {
        self.local(rank).expect("buffer lists hold this communicator's ranks only")
    }

    /// The world ranks whose buffers a list of `holders` holds, in order: this communicator's
    /// ranks, or the root where this communicator drives it.
    pub(crate) fn holding(&self, holders: Holders) -> Vec<usize> {
        match holders {
            Holders::All => self.ranks.iter().map(|r| r.index).collect(),
            Holders::Root(root) => self.local(root).map(|r| vec![r.index]).unwrap_or_default(),
        }
    }
}

/// Errors unless a buffer `what` of rank `rank` (`len` elements, on the device of ordinal `ordinal`)
/// is on the rank's device (`device`) and, where `expected` is given, holds that many elements.
pub(crate) fn check_placed(
    len: usize,
    ordinal: usize,
    device: usize,
    rank: usize,
    expected: Option<usize>,
    what: &'static str,
) -> Result<()> {
    if ordinal != device {
        return Err(Error::WrongDevice { what, rank, expected: device, got: ordinal });
    }
    match expected {
        Some(expected) if len != expected => Err(Error::Length { what, rank, expected, got: len }),
        _ => Ok(()),
    }
}

/// The key a call announces to its peers (`abi::LaunchArgs::call_key`): a hash of everything its
/// plan depends on, never 0 (which means unchecked). Processes of one build hash alike
/// (`DefaultHasher::new` has fixed keys).
pub(crate) fn call_key<K: std::hash::Hash>(key: &K) -> u32 {
    use std::hash::{BuildHasher, BuildHasherDefault};
    let h = BuildHasherDefault::<std::hash::DefaultHasher>::default().hash_one(key);
    ((h ^ (h >> 32)) as u32).max(1)
}

/// Errors with [`Error::Misaligned`] unless the buffer of rank `rank` at `address` is aligned to its
/// elements' `align` bytes.
pub(crate) fn check_aligned(address: u64, rank: usize, what: &'static str, align: usize) -> Result<()> {
    if !address.is_multiple_of(align as u64) {
        return Err(Error::Misaligned { what, rank, address, align });
    }
    Ok(())
}

impl Drop for Communicator {
    /// Waits for the ranks' streams before the workspaces, status records and cached plans are freed:
    /// kernels still in flight read them. A rank of a per-rank communicator then withdraws, so that
    /// a peer waiting for a call this rank will never make gives up at once; after an error it
    /// withdraws first, so that its own queued calls and the peers' end together instead of each
    /// at its timeout.
    fn drop(&mut self) {
        let failed = self.poison.is_set() || self.link.as_ref().is_some_and(|l| l.aborted.load(Ordering::SeqCst));
        if failed {
            self.withdraw();
        }
        for r in &self.ranks {
            let _ = wait_stream(&r.stream);
        }
        if !failed {
            self.withdraw();
        }
    }
}

impl Communicator {
    /// Marks this communicator's ranks as gone in every rank's workspace (a per-rank communicator's;
    /// others launch every rank together): a peer's CTA waiting at a start barrier for one of them
    /// gives up with [`Error::Withdrawn`] at its next look instead of at its timeout. Queued on a
    /// stream of its own, since the ranks' streams may be held up behind the calls it ends; waited
    /// for. Best effort: a failure leaves the peers their timeouts.
    pub(crate) fn withdraw(&self) {
        if self.link.is_none() {
            return;
        }
        // Every peer's workspace is alive while this communicator is: held (ranks in this process)
        // or mapped (across processes).
        for rank in &self.ranks {
            let ctx = rank.stream.context();
            if make_current(ctx).is_err() {
                continue;
            }
            let Ok(stream) = ctx.new_stream() else { continue };
            let offset = abi::Workspace::withdrawn_offset(rank.index) as u64;
            for &w in self.workspaces.iter().take(self.ranks()).filter(|&&w| w != 0) {
                // SAFETY: every rank's workspace is mapped in this context (checked at setup), and
                // the word is inside it; two 32-bit words of 1 make the u64 flag non-zero.
                let _ = unsafe { sys::cuMemsetD32Async(w + offset, 1, 2, stream.cu_stream()) };
            }
            let _ = wait_stream(&stream);
        }
    }
}

/// Which ranks a call's list of buffers belongs to: every rank in order, or the root alone.
#[derive(Clone, Copy)]
pub(crate) enum Holders {
    All,
    Root(usize),
}

/// A cudarc ordering guard of a buffer the call reads or writes; dropped after the launches.
pub(crate) enum GuardKind<A, B> {
    Read(A),
    Write(B),
}

/// A call's element count and the list it came from ([`common_len`]), which is checked first.
#[derive(Clone, Copy)]
pub(crate) enum Count {
    FromSend(usize),
    FromRecv(usize),
}

/// The call's count: the length most of `bufs` share (the first buffer's where it ties for most,
/// else the earliest of those that tie), so that a length error names the odd buffer out; with the
/// rank of the first buffer of that length. An empty slice is a buffer-count error.
fn common_len<T, S: DeviceSlice<T>>(bufs: &[S], what: &'static str, ranks: usize) -> Result<(usize, usize)> {
    let votes = |n: usize| bufs.iter().filter(|b| b.len() == n).count();
    let first = bufs.first().ok_or(Error::BufferCount { what, expected: ranks, got: 0 })?.len();
    let mut best = (votes(first), first, 0);
    for (i, b) in bufs.iter().enumerate().skip(1) {
        let v = votes(b.len());
        if v > best.0 {
            best = (v, b.len(), i);
        }
    }
    Ok((best.1, best.2))
}

/// The ordinal of the device a cudarc buffer lives on.
pub(crate) fn ordinal_of<T, S: DeviceSlice<T>>(s: &S) -> usize {
    s.stream().context().ordinal()
}

/// A buffer range a call touches: bytes `start..end` of rank `rank`'s buffer `buffer` (what errors
/// call it) on engine `device`, and whether the call writes it.
#[derive(Clone, Copy)]
pub(crate) struct Range {
    pub start: u64,
    pub end: u64,
    pub rank: usize,
    pub device: usize,
    pub writes: bool,
    pub buffer: &'static str,
}

/// Every written range must be disjoint from every other range on its device; ranges that are only
/// read may overlap each other.
pub(crate) fn check_disjoint(ranges: &[Range], what: &'static str) -> Result<()> {
    let mut v: Vec<Range> = ranges.iter().filter(|r| r.start < r.end).copied().collect();
    v.sort_by_key(|r| (r.device, r.start));
    for (i, a) in v.iter().enumerate() {
        for b in &v[i + 1..] {
            if b.device != a.device || b.start >= a.end {
                break;
            }
            if a.writes || b.writes {
                return Err(Error::Aliasing {
                    what,
                    rank: a.rank,
                    buffer: a.buffer,
                    other_rank: b.rank,
                    other_buffer: b.buffer,
                });
            }
        }
    }
    Ok(())
}

/// How a collective call launches on every rank ([`Communicator::prepare`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CallLaunch {
    /// The kernels' launch: mover, dtype and operator, threads per CTA, TMA pipeline (chunk bytes
    /// per source, stages), reduction mode, timeout, wait hint, issuers and whether AllReduce's
    /// combine stores from registers.
    pub spec: LaunchSpec,
    /// CTAs per rank.
    pub ctas_per_rank: u32,
    /// Shared-memory slots per pipeline stage (sources a stage holds at once).
    pub slots: u32,
    /// Dynamic shared memory per CTA, in bytes (the device adds 1 KiB per CTA of its own).
    pub smem_bytes: u32,
}

/// Whether any of `streams` is capturing a CUDA graph (or was, and the capture broke): communicators
/// then neither wait nor upload.
pub(crate) fn any_capturing<'a>(mut streams: impl Iterator<Item = &'a CudaStream>) -> Result<bool> {
    streams.try_fold(false, |any, s| {
        check_kept(s.context())?;
        let status = s.capture_status().map_err(Error::driver("cuStreamIsCapturing"))?;
        Ok(any || status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
    })
}

/// What a launch checks first: [`Error::Poisoned`] after a
/// reported, unreset device error (`poisoned`); where one of the launches' `records` holds an error
/// not reported yet, that error: from `synchronize`, which waits for the launches and reports it,
/// or, while a stream captures a graph (`capturing`; a wait would end the capture), at once as
/// [`recorded_while_running`] reads it, poisoning.
pub(crate) fn refuse_after_device_error<'a>(
    poison: &Poison,
    mut records: impl Iterator<Item = &'a StatusRecord>,
    capturing: impl FnOnce() -> Result<bool>,
    synchronize: impl FnOnce() -> Result<()>,
) -> Result<()> {
    let epoch = poison.epoch();
    if poison.is_set() {
        return Err(Error::Poisoned);
    }
    if let Some(record) = records.find(|r| r.errors() != 0) {
        if capturing()? {
            poison.set_since(epoch);
            return Err(recorded_while_running(&record.read()));
        }
        synchronize()?;
    }
    Ok(())
}

/// Whether a communicator refuses launches after a device error, and how many
/// `reset`s it has seen: an error read before a reset poisons only if no reset came since (a reset
/// clears the records it was read from, and a thread that read one before must not poison the
/// state the reset made usable).
#[derive(Debug, Default)]
pub(crate) struct Poison {
    /// The resets so far, shifted left by one; the low bit set while poisoned.
    state: AtomicU64,
}

impl Poison {
    /// The resets so far: take it before reading the status records whose error may poison.
    pub(crate) fn epoch(&self) -> u64 {
        self.state.load(Ordering::SeqCst) >> 1
    }

    /// Whether launches are refused.
    pub(crate) fn is_set(&self) -> bool {
        self.state.load(Ordering::SeqCst) & 1 != 0
    }

    /// Poisons, unless a reset came after `epoch` was taken.
    pub(crate) fn set_since(&self, epoch: u64) {
        let _ = self.state.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |s| (s >> 1 == epoch).then_some(s | 1));
    }

    /// Clears, starting a new epoch (a reset, once the records are cleared).
    pub(crate) fn clear(&self) {
        let _ = self.state.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |s| Some(((s >> 1) + 1) << 1));
    }
}

/// Reports an error cudarc kept for any of `contexts` (`CudaContext::check_err`, which also clears
/// it): a failure in a cudarc call that could not return one (a buffer guard's stream wait or event
/// record). Pass the contexts of the streams the call queues on: cudarc keeps an error per
/// `CudaContext` value, and two values (two `CudaContext::new` of one device) keep theirs apart. A
/// call checks before it queues any launch; its launches then neither fail on nor take a kept error
/// ([`crate::engine`]'s launches bind without it), so one recorded by another thread meanwhile is
/// left to that thread's call.
pub(crate) fn check_contexts<'a>(contexts: impl IntoIterator<Item = &'a Arc<CudaContext>>) -> Result<()> {
    contexts.into_iter().try_for_each(|c| check_kept(c))
}

/// The error a record holds while the launch that wrote it may still run (a capture forbids the
/// wait): its details, if they have reached host memory, else [`Error::Poisoned`].
fn recorded_while_running(s: &abi::Status) -> Error {
    match abi::WaitKind::from_raw(s.kind) {
        Some(_) => Error::from_status(s).unwrap_or(Error::Poisoned),
        None => Error::Poisoned,
    }
}

/// Enables peer access between every pair of distinct devices, and lets each device's peers read and
/// write its default memory pool (cudarc allocates user buffers from stream-ordered pools).
pub(crate) fn enable_peer_access(contexts: &[Arc<CudaContext>]) -> Result<()> {
    for a in contexts {
        for b in contexts {
            if a.ordinal() == b.ordinal() {
                continue;
            }
            // The barriers settle a rank's withdrawal from a call against a peer's take with atomics
            // on each other's memory: they must be native between the two devices (NVLink).
            let mut native = 0;
            // SAFETY: an out-pointer and two valid device handles.
            unsafe {
                sys::cuDeviceGetP2PAttribute(
                    &mut native,
                    sys::CUdevice_P2PAttribute::CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED,
                    a.cu_device(),
                    b.cu_device(),
                )
            }
            .result()
            .map_err(Error::driver("cuDeviceGetP2PAttribute"))?;
            if native == 0 {
                return Err(Error::NoPeerAtomics { device: a.ordinal(), peer: b.ordinal() });
            }
            bind(a)?;
            // SAFETY: both contexts are alive; enabling twice reports PEER_ACCESS_ALREADY_ENABLED.
            let r = unsafe { sys::cuCtxEnablePeerAccess(b.cu_ctx(), 0) };
            if r != sys::CUresult::CUDA_SUCCESS && r != sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED {
                return Err(Error::Driver { call: "cuCtxEnablePeerAccess", source: cudarc::driver::DriverError(r) });
            }
            // Let device `a` access `b`'s default pool.
            let mut pool = std::mem::MaybeUninit::uninit();
            // SAFETY: out-pointer for the pool handle of a valid device.
            unsafe { sys::cuDeviceGetDefaultMemPool(pool.as_mut_ptr(), b.cu_device()) }
                .result()
                .map_err(Error::driver("cuDeviceGetDefaultMemPool"))?;
            let desc = sys::CUmemAccessDesc {
                location: crate::engine::device_location(a.ordinal()),
                flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
            };
            // SAFETY: one valid descriptor for a valid pool.
            unsafe { sys::cuMemPoolSetAccess(pool.assume_init(), &desc, 1) }
                .result()
                .map_err(Error::driver("cuMemPoolSetAccess"))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An error read before a reset does not poison after it; one read since does; a reset clears.
    #[test]
    fn poison_follows_the_resets() {
        let p = Poison::default();
        assert!(!p.is_set());
        let before = p.epoch();
        p.clear();
        p.set_since(before);
        assert!(!p.is_set(), "an error read before the reset poisoned the state it cleared");
        p.set_since(p.epoch());
        assert!(p.is_set());
        p.set_since(p.epoch());
        assert!(p.is_set(), "poisoning twice stays poisoned");
        p.clear();
        assert!(!p.is_set());
        assert_eq!(p.epoch(), before + 2);
    }

    /// GPU scope only where one device holds every rank: a world over two GPUs (of one host or two
    /// hosts posing as one, `(host, UUID)` apart) meets at system scope.
    #[test]
    fn barriers_reach_as_far_as_the_world_spreads() {
        let h200 = DeviceFacts { sms: 132, max_smem: 232448 };
        let one = World { rank_device: vec![0; 8], devices: vec![h200] };
        assert_eq!(one.peer_scope(), PeerScope::Gpu);
        let two = World { rank_device: vec![0, 0, 0, 0, 1, 1, 1, 1], devices: vec![h200, h200] };
        assert_eq!(two.peer_scope(), PeerScope::System);
    }

    /// A record read while its launch may run: its error once the details are there, else
    /// `Poisoned` (never a made-up kind).
    #[test]
    fn a_record_read_early_reports_only_what_it_holds() {
        let mut s = abi::Status { errors: 1, ..bytemuck::Zeroable::zeroed() };
        assert!(matches!(recorded_while_running(&s), Error::Poisoned), "details not written yet");
        s.kind = abi::WaitKind::StartBarrier.raw();
        s.peer = 3;
        let e = recorded_while_running(&s);
        assert!(matches!(e, Error::Timeout { wait: abi::WaitKind::StartBarrier, peer: 3, .. }), "{e}");
    }
}
