//! The communicator: ranks, their streams and workspaces, the plan cache, and the collective calls.

use crate::cache::BuildOnce;
use crate::engine::{
    DeviceAlloc, DeviceProgram, Engine, LaunchSpec, StatusRecord, bind, check_kept, sync_context, sync_stream,
    wait_stream,
};
use crate::error::{Error, Result};
use crate::{DType, Element, Mover, ReduceOp};
use cudarc::driver::sys;
use cudarc::driver::{CudaContext, CudaEvent, CudaStream, DevicePtr, DevicePtrMut, DeviceSlice};
use oxccl_host::lowered::Lowered;
use oxccl_host::tccl::{self, Collective, PlanSpec, Reduction};
use oxccl_kernels::abi::{self, BUFFER_SLOTS, MAX_RANKS, ReduceMode, Workspace, slot};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Tuning and policy of a communicator. `Config::default()` is a good start.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Config {
    /// CTAs per rank for a collective (`None`: as many as the device holds for all its ranks, at most
    /// 16 per rank).
    pub max_ctas: Option<u32>,
    /// The data mover.
    pub mover: Mover,
    /// How reductions run; see [`Reduction`].
    pub reduction: Reduction,
    /// Results bitwise identical run to run for a given configuration. Requires
    /// `Reduction::Registers` (the hardware bulk reduction does not fix the order between sources).
    pub deterministic: bool,
    /// Bytes per source per pipeline stage (TMA mover; `None`: see
    /// [`auto_pipeline`](crate::auto_pipeline), which also gives a fixed chunk as many stages, up to
    /// four, as fit in shared memory, or, where every combine stores from registers on one device,
    /// [`combining_pipeline`](crate::combining_pipeline); launches with several issuers: see `issuers`).
    pub chunk_bytes: Option<u32>,
    /// Pipeline stages (TMA mover; `None`: see [`auto_pipeline`](crate::auto_pipeline) and
    /// [`combining_pipeline`](crate::combining_pipeline); launches with several issuers: see `issuers`).
    /// Given without `chunk_bytes` where the combining ring applies, the stages get the largest chunk
    /// that fits (not capped at 32 KiB): to bound the shared memory a CTA takes, give `chunk_bytes`.
    pub stages: Option<u32>,
    /// Threads per CTA (`None`: one warp per issuer for a TMA CTA that only copies and bulk-reduces
    /// (see `issuers`), 256 when it
    /// combines sources in registers or reduces element by element, 512 for the SIMT mover). A
    /// one-warp CTA leaves its SM to kernels running beside it, but its single issuing thread then
    /// competes with their warps and slows (docs/PERF.md); more threads keep it from sharing the SM.
    pub threads: Option<u32>,
    /// Every device-side wait gives up after this long and the call reports [`Error::Timeout`] (the
    /// drain of bulk loads already issued when a wait gave up is bounded by at least a second, and a
    /// load that never lands traps the launch rather than write into shared memory later). A launch
    /// that gave up can take a few timeouts to end: each wait is bounded, and a rank that gives up
    /// waits up to twice the timeout (at least a second) for each peer already running the call.
    pub timeout: Duration,
    /// Suspend-time hint for device waits, in nanoseconds (0: spin). Non-zero values take fewer issue
    /// slots from kernels running beside the collective.
    pub wait_suspend_ns: u32,
    /// Issuing warps per TMA CTA for calls that only copy and bulk-reduce (AllGather, Broadcast,
    /// reshards, and AllReduce / ReduceScatter / Reduce with `Reduction::Tma`; at most 4, one per SM
    /// scheduler): each streams every W-th chunk through its own `stages / W` stages. Given: with the stages given
    /// (a multiple of W), or as many multiples of W as a given chunk leaves room for (two each at
    /// most, one each at least), or two each in the shared memory one issuer's default pipeline
    /// takes. `None`: the ring one issuer would get (stages and chunk as given, else
    /// [`auto_pipeline`](crate::auto_pipeline)'s) split among [`DEFAULT_ISSUERS`] or 2 where each
    /// keeps two stages and given threads hold their warps, else one; with neither stages nor chunk
    /// given, 8 stages of 16 KiB among 4. Beside one 256-thread compute CTA per SM four keep a copy
    /// at its speed alone where a lone issuer loses a quarter of its speed; beside compute that
    /// keeps every scheduler busy both are starved (docs/PERF.md). Alone they cost at most 1.5 %.
    /// Calls that combine sources in registers always use one.
    pub issuers: Option<u32>,
    /// How a TMA call that combines sources into several destinations (AllReduce with
    /// `Reduction::Registers`) writes the result: `Some(false)` one copy in shared memory,
    /// bulk-stored to every rank; `Some(true)` the combining threads store it from registers to every
    /// rank, as combines into one destination (ReduceScatter) always do. `None` (default): from
    /// registers where the call puts at most [`COMBINE_DIRECT_MAX_CTAS`] CTAs on any one device
    /// (docs/PERF.md: on one H200 +15-52 % there with 2, 4 and 8 virtual ranks, and at 64 CTAs
    /// -10 % / -9 % with 8 / 4 ranks, +3 % with 2; on four H200s, one rank each, +24 % at 4 CTAs,
    /// -2 % at 8, +4 % at 16). Ignored by the SIMT mover.
    pub combine_direct: Option<bool>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            max_ctas: None,
            mover: Mover::Tma,
            reduction: Reduction::Registers,
            deterministic: true,
            chunk_bytes: None,
            stages: None,
            threads: None,
            timeout: Duration::from_secs(10),
            wait_suspend_ns: 0,
            issuers: None,
            combine_direct: None,
        }
    }
}

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
    Shared(Arc<crate::vmm::VmmAlloc>),
}

impl RankWorkspace {
    fn ptr(&self) -> u64 {
        match self {
            RankWorkspace::Plain(a) => a.ptr(),
            RankWorkspace::Shared(a) => a.ptr(),
        }
    }

    /// Zeroes the barrier words (not the region table after them), ordered on `stream`.
    fn zero_async(&self, stream: &CudaStream) -> Result<()> {
        match self {
            RankWorkspace::Plain(a) => a.zero_async(stream),
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

    /// The most ranks any device holds.
    fn most_on_a_device(&self) -> usize {
        (0..self.devices.len()).map(|d| self.ranks_on(d)).max().unwrap_or(0)
    }
}

/// Ranks launched together: one kernel per group per call.
struct Group {
    device: usize,
    stream: Arc<CudaStream>,
    ranks: Vec<usize>,
    status: StatusRecord,
}

/// A lowered program uploaded for every launch group of a communicator (each group's slice of the
/// programs, all the tasks).
pub(crate) struct Uploaded {
    /// The program as lowered (barriers dropped when one launch holds every rank).
    pub lowered: Lowered,
    per_group: Vec<DeviceProgram>,
    /// Recorded on each group's stream after its upload: complete once the tables are in place.
    uploaded: Vec<CudaEvent>,
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
    pub(crate) link: Option<crate::rank::Link>,
    groups: Vec<Group>,
    /// Each call's plan with its launch, checked to run once when the plan was built (the checks
    /// depend only on the plan, the configuration and the devices, none of which change).
    plans: BuildOnce<PlanSpec, (Arc<Uploaded>, LaunchSpec)>,
    pub(crate) reshard_plans: BuildOnce<crate::reshard::PlanKey, Arc<crate::reshard::Prepared>>,
    /// Held while one call queues its launches on every group.
    launch_order: Mutex<()>,
    poison: Poison,
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
    /// beyond that: with more ranks on separate streams of one device than queues, set it to at least
    /// that count before the CUDA driver is initialised, or a launch may wait behind another rank's
    /// work and the call report [`Error::Timeout`].
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
        link: Option<crate::rank::Link>,
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
            launch_order: Mutex::new(()),
            poison: Poison::default(),
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
        // SAFETY: only looks for the driver library; loading it has no side effects on failure.
        if !unsafe { sys::is_culib_present() } {
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
        // From the whole world, so that every rank, wherever launched, picks the same count.
        let w = &self.world;
        let most = (0..w.devices.len())
            .filter(|&d| w.ranks_on(d) > 0)
            .map(|d| (w.devices[d].sms as usize / w.ranks_on(d)).max(1));
        most.min().unwrap_or(1).min(16) as u32
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
    pub fn all_gather<T: Element, S: DevicePtr<T>, R: DevicePtrMut<T> + DevicePtr<T>>(
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

    /// In-place AllGather: block `r` of `buf[r]` is rank r's contribution (nccl's
    /// `sendbuff = recvbuff + rank × count`); every buffer ends with all blocks.
    pub fn all_gather_in_place<T: Element, R: DevicePtrMut<T> + DevicePtr<T>>(&self, bufs: &mut [R]) -> Result<()> {
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
    /// [`Communicator::broadcast_in_place`]).
    pub fn broadcast<T: Element, S: DevicePtr<T>, R: DevicePtrMut<T> + DevicePtr<T>>(
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

    /// In-place Broadcast: every `buf[r]` becomes a copy of `buf[root]`, which is left as it is.
    pub fn broadcast_in_place<T: Element, R: DevicePtrMut<T> + DevicePtr<T>>(
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
        let from_registers = combining_ring(&self.config, spec.collective, direct, self.world.devices.len());
        let mut launch = self.shaped_launch_spec(spec.dtype, spec.op, slots, combines, from_registers)?;
        launch.combine_direct = direct;
        Ok(launch)
    }

    /// The launch parameters of a program of `dtype` tasks reducing with `op` (ignored by copies) that
    /// needs `slots` shared-memory slots per stage and combines sources or not. It knows no CTA
    /// count nor collective, so `combine_direct` is `Config::combine_direct` or `false` and the ring is
    /// [`auto_pipeline`]'s; [`Self::launch_spec`] applies the automatic rules (and
    /// [`combining_pipeline`]'s ring) as a collective call does.
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
        })
    }

    /// The plan for `spec` and its launch, built, checked and uploaded on first use (the upload
    /// queued on the groups' streams, ahead of the call's launches).
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
            // The copies would be recorded into the graph, not run: the plan would stay unwritten.
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
            // Ordered on the group's stream, where its launches run (and where the tables of a plan
            // dropped after a failure here are freed, after their copies).
            per_group.push(engine.upload_on(&sub, 0..n, &g.stream)?);
        }
        let uploaded = self
            .groups
            .iter()
            .map(|g| {
                g.stream
                    .record_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))
                    .map_err(Error::driver("cuEventRecord"))
            })
            .collect::<Result<_>>()?;
        Ok(Uploaded { lowered, per_group, uploaded })
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
        let workspaces = self.workspaces;
        // Every group must see calls in the same order (barriers pair CTAs by a per-CTA call count):
        // calls from several threads queue their groups' launches one call at a time.
        let _order = self.launch_order.lock().unwrap_or_else(|e| e.into_inner());
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
                let launched = unsafe { engine.launch(&g.stream, prog, launch, buffers, workspaces, g.status.ptr()) };
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
        // The upload was queued on the groups' streams (by this call, or by another thread's that
        // built the plan and may not have finished it); a graph captured later may be replayed on
        // another stream.
        check_contexts(self.groups.iter().map(|g| g.stream.context()))?;
        for e in &plan.uploaded {
            e.synchronize().map_err(Error::driver("cuEventSynchronize"))?;
        }
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

    /// Collective plans built and uploaded so far (each kept until [`Communicator::clear_plans`] or
    /// the communicator's end).
    pub fn cached_plans(&self) -> usize {
        self.plans.len()
    }

    /// Frees every cached plan (collectives and reshards) after waiting for the ranks' streams: a
    /// caller whose counts change from call to call (dynamic shapes) bounds the device memory the
    /// cache holds this way. Later calls build their plans again. Callable while other threads make
    /// calls: it waits for any call queueing its launches, and a call that took a plan from the
    /// cache before it was cleared waits for its own launches before that plan is freed. A CUDA
    /// graph captured from this communicator's calls holds its plans' device addresses: destroy such
    /// graphs first (replaying one afterwards, or after the communicator is dropped, reads freed
    /// memory).
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
        Ok(())
    }

    /// Drops a call's reference to its plan once its launches are queued. Where
    /// [`Communicator::clear_plans`] has taken the plan out of the cache meanwhile, this reference
    /// is the last and the plan's device memory is freed with it: the ranks' streams are waited for
    /// first, since the launches still read it. (The cache's own reference keeps it otherwise: no
    /// other call can take it once it is out of the cache, so the count cannot rise again.)
    pub(crate) fn release_plan<P>(&self, plan: Arc<P>) -> Result<()> {
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
            dtype: T::DTYPE,
            // AllGather and Broadcast reduce nothing: one plan whatever the operator.
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
        let written = |r: usize| match (collective, in_place) {
            (Collective::Broadcast { root }, true) => r != root as usize,
            (Collective::Reduce { root }, true) => r == root as usize,
            _ => true,
        };
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
            let outs: Vec<(u64, usize, bool)> =
                recv_ptr.iter().map(|&(r, p)| (p, expected_recv * e, written(r))).collect();
            staging = Some(link.stage(&ins, &outs, in_place)?);
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
        let block = count as u64 * e as u64;
        for &(r, out) in &recv_ptr {
            let (input, output) = match collective {
                Collective::ReduceScatter if in_place => (out, out + r as u64 * block),
                Collective::AllGather if in_place => (out + r as u64 * block, out),
                _ if in_place => (out, out),
                _ => (0, out),
            };
            buffers[r][slot::INPUT as usize] = input;
            buffers[r][slot::OUTPUT as usize] = output;
        }
        for &(r, input) in &send_ptr {
            buffers[r][slot::INPUT as usize] = input;
        }
        // Where anything is staged, the communicator drives one rank: its stream.
        let stream = self.ranks.first().map(|r| &*r.stream);
        let launched = crate::rank::Staging::around(staging.as_ref(), stream, || {
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
    /// kernels still in flight read them.
    fn drop(&mut self) {
        for r in &self.ranks {
            let _ = wait_stream(&r.stream);
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

/// A `field` error unless `threads` is a multiple of 32 in `32..=most` (a CTA of whole warps the
/// kernels are compiled for).
pub(crate) fn check_threads(field: &'static str, threads: u32, most: u32) -> Result<()> {
    if threads == 0 || !threads.is_multiple_of(32) || threads > most {
        return Err(Error::Config { field, why: format!("{threads} is not a multiple of 32 in 32..={most}") });
    }
    Ok(())
}

/// A `field` error unless `bytes` is a positive multiple of 16 (a bulk copy's size and alignment).
pub(crate) fn check_chunk_bytes(field: &'static str, bytes: u32) -> Result<()> {
    if bytes == 0 || !bytes.is_multiple_of(16) {
        return Err(Error::Config { field, why: format!("{bytes} is not a positive multiple of 16") });
    }
    Ok(())
}

/// A `field` error unless `stages` is in `1..=MAX_STAGES` (the mbarriers shared memory holds).
pub(crate) fn check_stages(field: &'static str, stages: u32) -> Result<()> {
    if stages == 0 || stages as usize > abi::MAX_STAGES {
        return Err(Error::Config { field, why: format!("{stages} is not in 1..={}", abi::MAX_STAGES) });
    }
    Ok(())
}

pub(crate) fn validate_config(c: &Config) -> Result<()> {
    if c.deterministic && c.reduction == Reduction::Tma {
        return Err(Error::Config {
            field: "deterministic",
            why: "the hardware bulk reduction does not fix the order between sources; use Reduction::Registers".into(),
        });
    }
    if let Some(0) = c.max_ctas {
        return Err(Error::Config { field: "max_ctas", why: "must be at least 1".into() });
    }
    if let Some(st) = c.stages {
        check_stages("stages", st)?;
    }
    check_timeout(c.timeout)?;
    if let Some(m) = c.max_ctas
        && m as usize > abi::MAX_CTAS_PER_RANK
    {
        return Err(Error::Config { field: "max_ctas", why: format!("{m} is above {}", abi::MAX_CTAS_PER_RANK) });
    }
    if let Some(t) = c.threads {
        check_threads("threads", t, if c.mover == Mover::Simt { 512 } else { 1024 })?;
    }
    if let Some(w) = c.issuers {
        if !(1..=abi::MAX_ISSUERS).contains(&w) {
            return Err(Error::Config { field: "issuers", why: format!("{w} is not in 1..={}", abi::MAX_ISSUERS) });
        }
        if let Some(st) = c.stages
            && c.mover == Mover::Tma
            && !st.is_multiple_of(w)
        {
            return Err(Error::Config {
                field: "issuers",
                why: format!("{w}: the {st} stages must be a multiple (each issuer owns a share)"),
            });
        }
        if let Some(t) = c.threads
            && c.mover == Mover::Tma
            && t < 32 * w
        {
            return Err(Error::Config { field: "issuers", why: format!("{w}: {t} threads hold fewer warps") });
        }
    }
    if let Some(b) = c.chunk_bytes {
        check_chunk_bytes("chunk_bytes", b)?;
    }
    Ok(())
}

/// Issuing warps of a TMA CTA that only copies and bulk-reduces when [`Config::issuers`] is `None`:
/// one per SM scheduler.
pub const DEFAULT_ISSUERS: u32 = 4;

/// The most CTAs on one device at which a call whose combine has several destinations stores the
/// result from registers by default (`Config::combine_direct`). Measured on one H200 with 2, 4 and
/// 8 virtual ranks (docs/PERF.md), with [`combining_pipeline`]'s ring where it stores from
/// registers: faster from registers up to 32 CTAs on the device (+15-52 %), slower at 64 with 8 and 4
/// ranks (-10 %, -9 %; +3 % with 2), level at 128 (8 ranks).
pub const COMBINE_DIRECT_MAX_CTAS: u64 = 32;

/// Whether a launch of `ctas_on_device` CTAs on its busiest device stores combines with several
/// destinations from registers (`Config::combine_direct`).
pub(crate) fn combine_direct(c: &Config, ctas_on_device: u64) -> bool {
    c.combine_direct.unwrap_or(ctas_on_device <= COMBINE_DIRECT_MAX_CTAS)
}

/// Whether a call of `collective` under `c` on `devices` devices takes [`combining_pipeline`]'s
/// ring: every combine stores its result from registers (ReduceScatter and Reduce, whose combines
/// have one destination; AllReduce where `combine_direct` holds), so no bulk store reads a stage,
/// and every source is on one device. Over
/// NVLink the deeper ring of [`auto_pipeline`] keeps more loads in flight and wins at 8 CTAs (2
/// GPUs, docs/PERF.md: ReduceScatter 260.7 against 232.5 busbw, AllReduce 326.2 against 299.9).
pub(crate) fn combining_ring(c: &Config, collective: Collective, direct: bool, devices: usize) -> bool {
    c.reduction == Reduction::Registers
        && devices == 1
        && match collective {
            Collective::ReduceScatter | Collective::Reduce { .. } => true,
            Collective::AllReduce => direct,
            Collective::AllGather | Collective::Broadcast { .. } => false,
        }
}

/// Threads, TMA pipeline and issuing warps of a launch (see [`launch_shape`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Shape {
    pub threads: u32,
    pub chunk: u32,
    pub stages: u32,
    pub issuers: u32,
}

/// The shape of a launch under `c` whose program needs `slots` slots per stage in `room` bytes of
/// shared memory and combines sources (in registers or element by element) or not. Several issuers
/// only where nothing combines; they split the ring, so each gets `stages / issuers` stages.
///
/// * Issuers given: the stages given, or as many multiples of the issuers as a given chunk leaves
///   room for (two each at most), or two each in one issuer's default shared memory.
/// * Issuers left open: the ring one issuer would get (stages and chunk as given, else
///   [`auto_pipeline`]'s), split among [`DEFAULT_ISSUERS`] or 2 where each keeps at least two stages
///   and the threads (if given) hold their warps; with neither stages nor chunk given, 8 stages of
///   one issuer's default shared memory for [`DEFAULT_ISSUERS`].
///
/// A warp per issuer unless the threads are given. A launch whose combining tasks all store from
/// registers (`from_registers`) takes [`combining_pipeline`]'s ring.
pub(crate) fn launch_shape(c: &Config, room: usize, slots: u32, combines: bool, from_registers: bool) -> Shape {
    let streams = c.mover == Mover::Tma && !combines && slots == 1;
    // One issuer's default pipeline: the shared memory several issuers share when nothing is given.
    let (one_chunk, one_stages) = auto_pipeline(room, slots, None, None);
    let split = |stages: u32| -> u32 {
        let each = (one_chunk as usize * one_stages as usize) / stages.max(1) as usize;
        chunk_grain(each).max(16)
    };
    let (issuers, chunk, stages) = match c.issuers {
        Some(w) if streams && w > 1 => {
            let stages = c.stages.unwrap_or_else(|| {
                let most = (2 * w).min(abi::MAX_STAGES as u32);
                match c.chunk_bytes {
                    Some(b) => {
                        let fit = (room / (slots.max(1) as usize * b.max(1) as usize)).min(most as usize) as u32;
                        // At least one each: a chunk too large for that is refused by the engine's
                        // shared-memory check, naming the size.
                        (fit / w * w).max(w)
                    }
                    None => most,
                }
            });
            let chunk = c.chunk_bytes.or((c.stages.is_none()).then(|| split(stages)));
            (w, chunk, Some(stages))
        }
        None if streams => {
            let fitted = |st: u32| {
                [DEFAULT_ISSUERS, 2]
                    .into_iter()
                    .find(|&w| st.is_multiple_of(w) && st / w >= 2 && c.threads.is_none_or(|t| t >= 32 * w))
                    .unwrap_or(1)
            };
            match (c.chunk_bytes, c.stages) {
                (None, None) => {
                    let st = (2 * DEFAULT_ISSUERS).min(abi::MAX_STAGES as u32);
                    let w = fitted(st);
                    if w > 1 { (w, Some(split(st)), Some(st)) } else { (1, None, None) }
                }
                (chunk, stages) => {
                    let st = stages.unwrap_or_else(|| auto_pipeline(room, slots, chunk, None).1);
                    (fitted(st), chunk, stages.or(Some(st)))
                }
            }
        }
        _ => (1, c.chunk_bytes, c.stages),
    };
    let threads = c.threads.unwrap_or(match c.mover {
        Mover::Tma if combines => 256,
        Mover::Tma => 32 * issuers,
        Mover::Simt => 512,
    });
    let (chunk, stages) = if from_registers && combines && c.mover == Mover::Tma {
        combining_pipeline(room, slots, chunk, stages)
    } else {
        auto_pipeline(room, slots, chunk, stages)
    };
    Shape { threads, chunk, stages, issuers }
}

/// Issuers the configuration asked for whose stages (one each at least, the stages left open) do
/// not fit in `room`: an `issuers` error rather than the engine's later one about the chunk.
pub(crate) fn check_issuers_fit(c: &Config, shape: &Shape, room: usize, slots: u32) -> Result<()> {
    let Shape { chunk, stages, issuers, .. } = *shape;
    // Saturating: `slots` comes from the caller of `launch_spec_for`, and a product past usize is
    // as much "does not fit" as any other.
    let need = (stages as usize).saturating_mul(slots.max(1) as usize).saturating_mul(chunk as usize);
    if issuers > 1 && c.issuers.is_some() && c.stages.is_none() && need > room {
        return Err(Error::Config {
            field: "issuers",
            why: format!(
                "{issuers} issuers need a stage each at least: {stages} stages of {chunk} B are {need} B of shared \
                 memory, {room} B are available (give a smaller chunk_bytes or fewer issuers)"
            ),
        });
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

/// The TMA pipeline, `(chunk bytes per source, stages)`, for `slots` sources per stage in `room`
/// bytes of shared memory, filling in what the configuration leaves open.
///
/// Every bulk operation costs the SM's copy engine about a quarter of a microsecond whatever its
/// size, until it is large enough (about 24 KiB) to run at the SM's bandwidth instead; and the depth
/// of the ring beyond two loads in flight buys nothing (docs/PERF.md, 2026-11-29). So chunks come
/// first: up to 32 KiB per source, with four stages while each source still gets at least 16 KiB,
/// and fewer (down to two) when many sources share a stage. A given chunk gets as many stages (up
/// to four) as fit; given stages get the largest chunk that fits. Zero stages size the chunk as one
/// and are returned as given: they, and what does not fit `room`, are left for the engine's launch
/// check to report.
pub fn auto_pipeline(room: usize, slots: u32, chunk: Option<u32>, stages: Option<u32>) -> (u32, u32) {
    const MAX_CHUNK: usize = 32 * 1024;
    const MIN_CHUNK: usize = 16 * 1024;
    let slots = slots.max(1) as usize;
    let fit =
        |stages: usize| chunk_grain((room / (stages.max(1) * slots)).min(MAX_CHUNK).min(((1usize << 20) - 1) / slots));
    match (chunk, stages) {
        (Some(b), Some(st)) => (b, st),
        (None, Some(st)) => (fit(st as usize), st),
        (Some(b), None) => (b, (room / (slots * b.max(1) as usize)).clamp(1, 4) as u32),
        (None, None) => {
            let st = (2..=4).rev().find(|&st| fit(st) as usize >= MIN_CHUNK).unwrap_or(2);
            (fit(st), st as u32)
        }
    }
}

/// The TMA pipeline, `(chunk bytes per source, stages)`, of a launch whose combining tasks all
/// store their result from registers (ReduceScatter, and AllReduce where `Config::combine_direct`
/// applies): there no bulk store reads a stage, so a stage is refilled as soon as it is combined and
/// two stages keep one stage of loads in flight while the other is combined. What costs is the
/// number of stages the threads go through (a barrier and a phase wait each) and of bulk loads, so
/// left open the pipeline is two stages of the largest chunk that fits (no 32 KiB cap; at most
/// 2^20 - 1 bytes per stage, the mbarrier's transaction count). Measured on an H200 (docs/PERF.md,
/// 2026-11-29): reduce-add per CTA 96.0 -> 107.0 GB/s at 256 threads (56 KiB against 28 KiB x 4),
/// 63.5 -> 78.7 at 64; ReduceScatter over 4 virtual ranks x 4 CTAs 211.9 -> 266.9 busbw. The
/// communicator takes it where every source is on the calling rank's device (one GPU): with a peer's
/// sources over NVLink the deeper ring of [`auto_pipeline`] keeps more loads in flight and wins at 8
/// CTAs. Given values as [`auto_pipeline`], except that given stages get the largest chunk without
/// the cap.
pub fn combining_pipeline(room: usize, slots: u32, chunk: Option<u32>, stages: Option<u32>) -> (u32, u32) {
    let per_stage = room / stages.unwrap_or(2).max(1) as usize / slots.max(1) as usize;
    let b = per_stage.min(((1usize << 20) - 1) / slots.max(1) as usize);
    match (chunk, stages) {
        (None, st) => (chunk_grain(b), st.unwrap_or(2)),
        (Some(_), _) => auto_pipeline(room, slots, chunk, stages),
    }
}

/// The largest chunk of at most `bytes`: a multiple of 1 KiB from 1 KiB, of 16 bytes below.
fn chunk_grain(bytes: usize) -> u32 {
    (if bytes >= 1024 { bytes / 1024 * 1024 } else { bytes / 16 * 16 }) as u32
}

/// Whether any of `streams` is capturing a CUDA graph (or was, and the capture broke): communicators
/// and compiled plans then neither wait nor upload.
pub(crate) fn any_capturing<'a>(mut streams: impl Iterator<Item = &'a CudaStream>) -> Result<bool> {
    streams.try_fold(false, |any, s| {
        check_kept(s.context())?;
        let status = s.capture_status().map_err(Error::driver("cuStreamIsCapturing"))?;
        Ok(any || status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
    })
}

/// What a launch checks first (communicators and compiled plans): [`Error::Poisoned`] after a
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

/// Whether a communicator or compiled plan refuses launches after a device error, and how many
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

/// A device-wait timeout in (0, [`MAX_TIMEOUT`]], or the `timeout` error (communicators and compiled plans).
pub(crate) fn check_timeout(t: Duration) -> Result<()> {
    if t.is_zero() || t > MAX_TIMEOUT {
        return Err(Error::Config {
            field: "timeout",
            why: format!("{t:?} is not in (0, {MAX_TIMEOUT:?}] (device waits add it to a 64-bit nanosecond clock)"),
        });
    }
    Ok(())
}

/// Longest device-side wait a configuration may ask for.
pub const MAX_TIMEOUT: Duration = Duration::from_secs(24 * 3600);

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
                location: device_location(a.ordinal()),
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

    /// Several issuers only where nothing combines (four by default), a warp and two stages each in
    /// one issuer's default shared memory; what the configuration gives is kept.
    #[test]
    fn launch_shapes_give_issuers_their_warps_and_stages() {
        let room = 227 * 1024;
        let tma = Config { mover: Mover::Tma, ..Config::default() };
        let alone = launch_shape(&Config { issuers: Some(1), ..tma }, room, 1, false, false);
        assert_eq!((alone.threads, alone.stages, alone.issuers, alone.chunk), (32, 4, 1, 32 * 1024));
        let four = launch_shape(&Config { issuers: Some(4), ..tma }, room, 1, false, false);
        assert_eq!((four.threads, four.stages, four.issuers, four.chunk), (128, 8, 4, 16 * 1024));
        assert_eq!(four.stages * four.chunk, alone.stages * alone.chunk, "the same shared memory, split");
        assert_eq!(launch_shape(&tma, room, 1, false, false), four, "four issuers by default");
        let two = launch_shape(&Config { issuers: Some(2), ..tma }, room, 1, false, false);
        assert_eq!((two.threads, two.stages, two.chunk), (64, 4, 32 * 1024));
        // Left open, the issuers split the ring one issuer would get, keeping two stages each at
        // least and a warp each in given threads: given stages or chunks keep their footprint.
        let six = launch_shape(&Config { stages: Some(6), ..tma }, room, 1, false, false);
        assert_eq!((six.issuers, six.stages, six.threads), (2, 6, 64));
        assert_eq!(launch_shape(&Config { threads: Some(64), ..tma }, room, 1, false, false).issuers, 2);
        assert_eq!(launch_shape(&Config { threads: Some(32), ..tma }, room, 1, false, false), alone);
        let twelve = launch_shape(&Config { stages: Some(12), ..tma }, room, 1, false, false);
        assert_eq!((twelve.issuers, twelve.stages, twelve.chunk), (4, 12, 18 * 1024));
        let small = launch_shape(&Config { chunk_bytes: Some(16384), ..tma }, room, 1, false, false);
        assert_eq!((small.issuers, small.stages, small.chunk), (2, 4, 16384), "one issuer's 4 stages, split");
        let large = launch_shape(&Config { chunk_bytes: Some(65536), ..tma }, room, 1, false, false);
        assert_eq!((large.issuers, large.stages), (1, 3), "three stages fit: one issuer, as before");
        assert_eq!(launch_shape(&Config { stages: Some(3), ..tma }, room, 1, false, false).issuers, 1);
        let combining = launch_shape(&Config { issuers: Some(4), ..tma }, room, 8, true, false);
        assert_eq!((combining.threads, combining.issuers), (256, 1));
        let given = launch_shape(
            &Config { issuers: Some(2), stages: Some(6), threads: Some(96), ..tma },
            room,
            1,
            false,
            false,
        );
        assert_eq!((given.threads, given.stages, given.issuers), (96, 6, 2));
        let simt = launch_shape(&Config { mover: Mover::Simt, issuers: Some(4), ..tma }, room, 1, false, false);
        assert_eq!((simt.threads, simt.issuers), (512, 1));
        assert!(validate_config(&Config { issuers: Some(5), ..tma }).is_err());
        assert!(validate_config(&Config { issuers: Some(0), ..tma }).is_err());
        assert!(validate_config(&Config { issuers: Some(4), ..tma }).is_ok());
        assert!(validate_config(&Config { issuers: Some(4), stages: Some(6), ..tma }).is_err());
        assert!(validate_config(&Config { issuers: Some(4), threads: Some(96), ..tma }).is_err());
        // A given chunk gets the stages that fit, in multiples of the issuers.
        let big = launch_shape(&Config { issuers: Some(4), chunk_bytes: Some(32768), ..tma }, room, 1, false, false);
        assert_eq!((big.stages, big.chunk, big.issuers), (4, 32768, 4));
        let huge_config = Config { issuers: Some(4), chunk_bytes: Some(200_000), ..tma };
        let huge = launch_shape(&huge_config, room, 1, false, false);
        assert_eq!(huge.stages, 4, "at least one stage per issuer");
        let err = check_issuers_fit(&huge_config, &huge, room, 1).unwrap_err().to_string();
        assert!(err.contains("issuers") && err.contains("4 stages of 200000 B"), "{err}");
        assert!(check_issuers_fit(&tma, &launch_shape(&tma, room, 1, false, false), room, 1).is_ok());
        assert!(check_issuers_fit(&Config { issuers: Some(4), ..tma }, &four, room, 1).is_ok());
        // Several slots per stage keep one issuer whatever the lowering says about combining.
        assert_eq!(launch_shape(&Config { issuers: Some(4), ..tma }, room, 2, false, false).issuers, 1);
    }

    /// Launches whose combines all store from registers take two stages of the largest chunk; the
    /// rest, and what the configuration gives, keep `auto_pipeline`'s ring.
    #[test]
    fn register_stores_take_the_combining_pipeline() {
        let room = 227 * 1024;
        let tma = Config { mover: Mover::Tma, ..Config::default() };
        let direct = launch_shape(&tma, room, 2, true, true);
        assert_eq!((direct.chunk, direct.stages, direct.threads), (56 * 1024, 2, 256));
        let shared = launch_shape(&tma, room, 2, true, false);
        assert_eq!((shared.chunk, shared.stages), auto_pipeline(room, 2, None, None));
        let given =
            launch_shape(&Config { chunk_bytes: Some(16384), stages: Some(4), ..tma.clone() }, room, 2, true, true);
        assert_eq!((given.chunk, given.stages), (16384, 4));
        // Given stages get the largest chunk, uncapped; a given chunk the stages that fit, up to four.
        let stages = launch_shape(&Config { stages: Some(2), ..tma.clone() }, room, 2, true, true);
        assert_eq!((stages.chunk, stages.stages), (56 * 1024, 2));
        let capped = launch_shape(&Config { stages: Some(2), ..tma.clone() }, room, 2, true, false);
        assert_eq!((capped.chunk, capped.stages), (32 * 1024, 2), "the shared copy's ring keeps the cap");
        let chunk = launch_shape(&Config { chunk_bytes: Some(16384), ..tma.clone() }, room, 2, true, true);
        assert_eq!((chunk.chunk, chunk.stages), (16384, 4));
        let copy = launch_shape(&tma, room, 1, false, true);
        assert_eq!(copy, launch_shape(&tma, room, 1, false, false), "nothing combines: as before");
        let simt = launch_shape(&Config { mover: Mover::Simt, ..tma }, room, 2, true, true);
        assert_eq!((simt.threads, simt.chunk, simt.stages), (512, 28 * 1024, 4), "no combining ring for SIMT");
    }

    /// The combining ring only where every combine stores from registers and every source is local.
    #[test]
    fn the_combining_ring_needs_register_stores_on_one_device() {
        let c = Config::default();
        assert!(combining_ring(&c, Collective::ReduceScatter, false, 1));
        assert!(combining_ring(&c, Collective::AllReduce, true, 1));
        assert!(!combining_ring(&c, Collective::AllReduce, false, 1), "the shared copy's bulk stores read the ring");
        assert!(!combining_ring(&c, Collective::AllGather, true, 1));
        assert!(!combining_ring(&c, Collective::ReduceScatter, false, 2), "peers' sources over NVLink");
        let bulk = Config { reduction: Reduction::Tma, ..c };
        assert!(!combining_ring(&bulk, Collective::ReduceScatter, false, 1));
    }

    #[test]
    fn combine_direct_follows_the_device_cta_count_unless_given() {
        let auto = Config::default();
        assert!(combine_direct(&auto, 8));
        assert!(combine_direct(&auto, COMBINE_DIRECT_MAX_CTAS));
        assert!(!combine_direct(&auto, COMBINE_DIRECT_MAX_CTAS + 1));
        assert!(!combine_direct(&auto, 64));
        assert!(combine_direct(&Config { combine_direct: Some(true), ..auto.clone() }, 128));
        assert!(!combine_direct(&Config { combine_direct: Some(false), ..auto }, 1));
    }
}
