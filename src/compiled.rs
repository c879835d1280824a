//! Compiled ResCCL plans on the device engine: a lowered plan (`oxccl_host::compile::lower`)
//! uploaded once, a workspace per rank (the T-CCL [`abi::Workspace`], then the plan's FIFO region:
//! progress counters, FIFO head/tail counters, rings), and one kernel launch per rank per call,
//! one CTA per thread block, every rank on its own stream.
//!
//! The kernels are the plan kernels of `ptx::PLANS` (`abi::plan_kernel_name`); they reproduce the
//! host's CPU executor of the same descriptors (`oxccl_host::exec::lowered`). A compiled plan and
//! its interpreted lowering run with the same kernel and mover: only the descriptors differ.
//!
//! **Co-residency.** The thread blocks of every rank wait on each other (FIFOs, sync points), so
//! all CTAs of all ranks on a device must be resident at once. [`CompiledPlan::new`] picks the
//! threads per CTA and (TMA) the stage size so that the driver's occupancy calculator admits them
//! all, or fails with [`Error::TooManyCtas`]. Nothing else may occupy the device meanwhile.
//!
//! **Streams.** Ranks are separate launches: two ranks on one stream would run one after the other
//! and time out. With more than eight ranks on one device, set `CUDA_DEVICE_MAX_CONNECTIONS` to at
//! least the rank count before the CUDA driver is initialised (the `oxccl` CLI does; the driver's
//! default of eight hardware queues may otherwise delay a launch behind another rank's). A launch
//! that cannot meet its peers never hangs: every device wait is bounded and reported as
//! [`Error::Timeout`].
//!
//! **State.** FIFO and progress counters only grow and live in the workspaces, so repeated
//! launches (or a captured graph) need no reset. After a launch that reported an error, call
//! [`CompiledPlan::reset`] (zeroes workspaces and status records): until then further launches are
//! refused with [`Error::Poisoned`]. The status records live in host memory the devices map, so a
//! launch also sees an error an earlier launch recorded and [`CompiledPlan::synchronize`] has not
//! reported yet, once it has reached host memory (as it is written, at the latest when that launch
//! ended): it waits for the ranks' streams and returns that error instead of launching.

use crate::Element;
use crate::comm::{
    GuardKind, Poison, Range, any_capturing, check_aligned, check_contexts, check_disjoint, check_placed,
    enable_peer_access, ordinal_of, refuse_after_device_error,
};
use crate::config::check_timeout;
use crate::engine::{
    DeviceAlloc, Engine, InUse, Start, StatusRecord, launch_kernel, record_event, stream_on, stream_wait, sync_context,
    sync_stream, wait_stream,
};
use crate::error::{Error, Result};
use crate::peer::PeerMemory;
use crate::vmm::VmmAlloc;
use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig,
};
use oxccl_host::compile::lower::{LoweredPlan, LoweredRank, main_slot, validate};
use oxccl_host::exec::lowered::Memory;
use oxccl_kernels::abi::{
    self, BUFFER_SLOTS, DType, FIFO_REGION_OFFSET, MAX_RANKS, Mover, PLAN_FLAG_TIMING, PlanHeader, PlanLaunchArgs,
    RedOp, Status, TbTiming, slot,
};
use std::sync::Arc;
use std::time::Duration;

/// How a compiled plan is launched.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CompiledConfig {
    /// The data mover.
    pub mover: Mover,
    /// Threads per CTA (`None`: 128 for the TMA mover, 512 for the SIMT mover, halved down to 32
    /// until every CTA is co-resident).
    pub threads: Option<u32>,
    /// Bytes per source per TMA pipeline stage (`None`: the largest of 28 KiB, 26 KiB, … 2 KiB in
    /// steps of 2 KiB, then 1024, 512 and 256 B, that keeps every CTA co-resident).
    pub stage_bytes: Option<u32>,
    /// Every device-side wait gives up after this long and the launch reports [`Error::Timeout`].
    pub timeout: Duration,
}

impl Default for CompiledConfig {
    fn default() -> Self {
        CompiledConfig { mover: Mover::Tma, threads: None, stage_bytes: None, timeout: Duration::from_secs(10) }
    }
}

impl CompiledConfig {
    /// Checks, without a GPU, what any launch with this configuration would refuse: given threads
    /// that are not a multiple of 32 in `32..=1024` (`32..=512` for the SIMT mover), a given TMA
    /// stage size that is not a multiple of 16 of at least 16, or a timeout out of range. Whether a
    /// shape fits the device is checked when a plan is loaded ([`CompiledPlan::on_engines`]).
    pub fn validate(&self) -> Result<()> {
        if let Some(t) = self.threads {
            // The SIMT plan kernels are compiled for at most 512 threads.
            crate::config::check_threads("threads", t, if self.mover == Mover::Simt { 512 } else { 1024 })?;
        }
        if self.mover == Mover::Tma
            && let Some(b) = self.stage_bytes
            && (b < 16 || !b.is_multiple_of(16))
        {
            return Err(Error::Config {
                field: "stage_bytes",
                why: format!("{b} is not a multiple of 16 of at least 16"),
            });
        }
        check_timeout(self.timeout)
    }
}

/// The launch shape chosen for a plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaunchShape {
    /// Threads per CTA.
    pub threads: u32,
    /// Bytes per source per TMA stage (0 for the SIMT mover).
    pub stage_bytes: u32,
    /// Dynamic shared memory per CTA.
    pub smem_bytes: u32,
    /// CTAs of this kernel one SM holds at this shape (the occupancy calculator's figure).
    pub ctas_per_sm: u32,
    /// The most CTAs the plan puts on one device (every rank on it).
    pub ctas_per_device: u32,
}

/// One rank: where it runs, its descriptors on the device, its workspace, status and timing.
struct RankState {
    /// Its rank in the plan.
    id: usize,
    device: usize,
    stream: Arc<CudaStream>,
    header: PlanHeader,
    programs: DeviceAlloc,
    segments: DeviceAlloc,
    tasks: DeviceAlloc,
    waits: DeviceAlloc,
    connections: DeviceAlloc,
    workspace: PlanMemory,
    status: StatusRecord,
    timing: DeviceAlloc,
    /// Recorded after the rank's launch when a lead stream orders the call.
    done: CudaEvent,
}

/// A rank's workspace (the T-CCL [`abi::Workspace`], then the plan's FIFO region): the plan's own
/// memory, or memory every peer process maps (a per-rank plan across processes).
pub(crate) enum PlanMemory {
    Local(Arc<DeviceAlloc>),
    Shared(Arc<VmmAlloc>),
}

impl PlanMemory {
    fn ptr(&self) -> u64 {
        match self {
            PlanMemory::Local(a) => a.ptr(),
            PlanMemory::Shared(a) => a.ptr(),
        }
    }

    /// Zeroes it in `stream`'s order.
    fn zero_async(&self, stream: &CudaStream) -> Result<()> {
        match self {
            PlanMemory::Local(a) => a.zero_async(stream),
            PlanMemory::Shared(a) => a.zero_async(a.bytes(), stream),
        }
    }

    /// `len` bytes from byte `offset` (synchronous).
    fn read_range(&self, offset: usize, len: usize, stream: &CudaStream) -> Result<Vec<u8>> {
        match self {
            PlanMemory::Local(a) => a.read_range(offset, len),
            PlanMemory::Shared(a) => a.read_range(offset, len, stream),
        }
    }
}

/// What a per-rank plan holds of its peers ([`Comm::load_plan`](crate::Comm::load_plan)).
pub(crate) struct PlanLink {
    /// Where every rank is in this process: the peers' workspaces (their kernels write into this
    /// rank's FIFO region and this rank's into theirs), freed by their last holder (see
    /// `engine::InUse`).
    pub(crate) _held: crate::peer::Held,
    /// Across processes: this rank's workspace as a region the peers map, withdrawn on drop.
    pub(crate) region: Option<(Arc<PeerMemory>, u32)>,
}

/// A lowered plan uploaded for its ranks, ready to launch. See the [module documentation](self).
pub struct CompiledPlan {
    engines: Vec<Arc<Engine>>,
    /// The ranks this process launches: all of the plan's, or one ([`RankPlan`]).
    ranks: Vec<RankState>,
    /// Every rank's workspace base as this process reaches it, by plan rank.
    workspaces: [u64; MAX_RANKS],
    /// Per engine, the CTAs the plan puts on its device (every rank there, launched here or not).
    ctas_on: Vec<u32>,
    link: Option<PlanLink>,
    lowered: LoweredPlan,
    config: CompiledConfig,
    shape: LaunchShape,
    dtype: DType,
    op: RedOp,
    /// A device error was reported and not yet reset: launches are refused until
    /// [`CompiledPlan::reset`] (its FIFO and progress counters are out of step).
    poison: Poison,
    /// The scratch slots of every rank for [`CompiledPlan::run`], allocated on first use and kept.
    scratch: std::sync::Mutex<Vec<[Option<DeviceAlloc>; BUFFER_SLOTS]>>,
    /// Held while a launch queues its ranks and while [`CompiledPlan::reset`] runs: every rank's
    /// stream sees launches in one order (their FIFO and progress counters pair them by count).
    launch_order: std::sync::Mutex<()>,
    /// A per-rank plan's use of its device's context, dropped last (see `Communicator`'s).
    _in_use: Vec<InUse>,
}

/// The stage sizes tried when the configuration does not fix one, largest first: 2 KiB steps from
/// 28 KiB (the eight stage slots and the header in the 227 KiB one CTA may have: 230400 B), so
/// each occupancy (one CTA per SM, two, ...) gets about the largest stage its share of shared
/// memory holds (two per SM: 14 KiB, where powers of two gave 8), then halving down to 256 B.
/// Measured on an H200 (docs/PERF.md, "Plan kernels: the stage size"), 8 virtual ranks, against
/// the powers of two from 16 KiB: the ring and HM AllReduce +20 % and +17 % busbw at 1 GiB (28 KiB
/// stages), an MSCCL AllReduce ring +7 % (6 KiB, four CTAs per SM); AllGathers within 3 %.
const STAGE_BYTES: [u32; 17] =
    [28672, 26624, 24576, 22528, 20480, 18432, 16384, 14336, 12288, 10240, 8192, 6144, 4096, 2048, 1024, 512, 256];

const _: () = assert!(
    abi::plan_smem_bytes(Mover::Tma, STAGE_BYTES[0]) <= 227 * 1024,
    "the largest stage fits one CTA's shared memory"
);

impl CompiledPlan {
    /// Every rank of `lowered` on the GPU of `ctx`, each on a new stream of its own.
    pub fn virtual_ranks(ctx: &Arc<CudaContext>, lowered: &LoweredPlan, config: CompiledConfig) -> Result<Self> {
        // Before a stream per rank: a plan of too many ranks is refused, not given streams.
        validate(lowered)?;
        let streams = (0..lowered.ranks.len())
            .map(|_| ctx.new_stream().map_err(Error::driver("cuStreamCreate")))
            .collect::<Result<Vec<_>>>()?;
        Self::new(&streams, lowered, config)
    }

    /// Rank `r` of `lowered` on `streams[r]` (distinct streams; ranks on several devices get peer
    /// access to each other). Validates the descriptors, uploads them, allocates and zeroes each
    /// rank's workspace (`FIFO_REGION_OFFSET + fifo_bytes` bytes) and picks the launch shape.
    pub fn new(streams: &[Arc<CudaStream>], lowered: &LoweredPlan, config: CompiledConfig) -> Result<Self> {
        let mut engines: Vec<Arc<Engine>> = Vec::new();
        for s in streams {
            if !engines.iter().any(|e| e.context().ordinal() == s.context().ordinal()) {
                engines.push(Engine::shared(s.context())?);
            }
        }
        Self::on_engines(&engines, streams, lowered, config)
    }

    /// As [`CompiledPlan::new`], with engines already loaded (one per device of `streams`): plans of
    /// many sizes then share the loaded PTX modules.
    pub fn on_engines(
        engines: &[Arc<Engine>],
        streams: &[Arc<CudaStream>],
        lowered: &LoweredPlan,
        config: CompiledConfig,
    ) -> Result<Self> {
        validate(lowered)?;
        let n = lowered.ranks.len();
        if streams.len() != n {
            return Err(Error::BufferCount { what: "streams", expected: n, got: streams.len() });
        }
        for (i, a) in streams.iter().enumerate() {
            // Every context's legacy stream has the same (null) handle: a handle names a stream only
            // together with its device.
            let same = |b: &Arc<CudaStream>| {
                Arc::ptr_eq(a, b) || (a.cu_stream() == b.cu_stream() && a.context().ordinal() == b.context().ordinal())
            };
            if let Some(j) = streams[..i].iter().position(same) {
                return Err(Error::Config {
                    field: "streams",
                    why: format!("ranks {j} and {i} share a stream: each rank is a launch that waits for the others"),
                });
            }
        }
        // Every setting, before anything is uploaded for the plan.
        config.validate()?;
        let h0 = lowered.ranks[0].header;
        let dtype = DType::from_raw(h0.dtype).expect("validated");
        let op = RedOp::from_raw(h0.op).expect("validated");
        let mut used: Vec<Arc<Engine>> = Vec::new();
        let mut ranks = Vec::with_capacity(n);
        for (id, (lr, stream)) in lowered.ranks.iter().zip(streams).enumerate() {
            let ctx = stream.context();
            let device = match used.iter().position(|e| e.context().ordinal() == ctx.ordinal()) {
                Some(d) => d,
                None => {
                    let e = engines.iter().find(|e| e.context().ordinal() == ctx.ordinal()).ok_or_else(|| {
                        Error::Config { field: "engines", why: format!("no engine for device {}", ctx.ordinal()) }
                    })?;
                    used.push(e.clone());
                    used.len() - 1
                }
            };
            // The engine's kernels are launched on the stream: one driver context.
            stream_on(stream, used[device].context())?;
            let workspace = PlanMemory::Local(Arc::new(DeviceAlloc::zeroed(ctx, workspace_bytes(lr)?)?));
            ranks.push(RankState::upload(lr, id, device, stream, workspace)?);
        }
        let contexts: Vec<Arc<CudaContext>> = used.iter().map(|e| e.context().clone()).collect();
        enable_peer_access(&contexts)?;
        // The uploads and memsets above run on each context's legacy stream, which the ranks'
        // (non-blocking) streams do not wait for: finish them before any launch.
        for c in &contexts {
            sync_context(c)?;
        }
        let mut workspaces = [0u64; MAX_RANKS];
        for r in &ranks {
            workspaces[r.id] = r.workspace.ptr();
        }
        let ctas_on =
            (0..used.len()).map(|d| ranks.iter().filter(|r| r.device == d).map(|r| r.header.tbs).sum()).collect();
        Self::assemble(used, ranks, workspaces, ctas_on, None, lowered, config, dtype, op)
    }

    /// Rank `rank` of `lowered` alone, on `stream` of `engine`'s device, its peers launched
    /// elsewhere: `workspace` is its workspace (zeroed), `workspaces` every rank's as this process
    /// reaches them, `ctas_on_device` the CTAs of every rank on this device.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn for_rank(
        engine: &Arc<Engine>,
        stream: &Arc<CudaStream>,
        lowered: &LoweredPlan,
        rank: usize,
        workspace: PlanMemory,
        workspaces: [u64; MAX_RANKS],
        ctas_on_device: u32,
        link: PlanLink,
        config: CompiledConfig,
    ) -> Result<Self> {
        validate(lowered)?;
        config.validate()?;
        let lr = lowered.ranks.get(rank).ok_or(Error::NoSuchRank { rank, ranks: lowered.ranks.len() })?;
        let h0 = lowered.ranks[0].header;
        let dtype = DType::from_raw(h0.dtype).expect("validated");
        let op = RedOp::from_raw(h0.op).expect("validated");
        stream_on(stream, engine.context())?;
        // Everything in the stream's order: a wait for the context would wait for the calls of
        // other ranks of this process, which may wait for this rank.
        let state = RankState::upload(lr, rank, 0, stream, workspace)?;
        Self::assemble(
            vec![engine.clone()],
            vec![state],
            workspaces,
            vec![ctas_on_device],
            Some(link),
            lowered,
            config,
            dtype,
            op,
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn assemble(
        engines: Vec<Arc<Engine>>,
        ranks: Vec<RankState>,
        workspaces: [u64; MAX_RANKS],
        ctas_on: Vec<u32>,
        link: Option<PlanLink>,
        lowered: &LoweredPlan,
        config: CompiledConfig,
        dtype: DType,
        op: RedOp,
    ) -> Result<Self> {
        let in_use = InUse::of(link.is_some(), &engines);
        let mut plan = CompiledPlan {
            engines,
            ranks,
            workspaces,
            ctas_on,
            link,
            lowered: lowered.clone(),
            config,
            shape: LaunchShape { threads: 0, stage_bytes: 0, smem_bytes: 0, ctas_per_sm: 0, ctas_per_device: 0 },
            dtype,
            op,
            poison: Poison::default(),
            scratch: std::sync::Mutex::new(Vec::new()),
            launch_order: std::sync::Mutex::new(()),
            _in_use: in_use,
        };
        plan.shape = plan.choose_shape()?;
        plan.check_items()?;
        Ok(plan)
    }

    /// The first (threads, stage size) that fits every device's CTAs at once: stage sizes largest
    /// first, then threads largest first.
    fn choose_shape(&self) -> Result<LaunchShape> {
        let c = &self.config;
        let mover = c.mover;
        let default_threads = if mover == Mover::Tma { 128 } else { 512 };
        let threads: Vec<u32> = match c.threads {
            Some(t) => vec![t],
            None => std::iter::successors(Some(default_threads), |&t| (t > 32).then_some(t / 2)).collect(),
        };
        let stages: Vec<u32> = match (mover, c.stage_bytes) {
            (Mover::Simt, _) => vec![0],
            (Mover::Tma, Some(b)) => vec![b],
            (Mover::Tma, None) => STAGE_BYTES.to_vec(),
        };
        let ctas_per_device = self.ctas_on.iter().copied().max().unwrap_or(0);
        let mut last = String::new();
        // The most CTAs per device any shape tried admits (the error's `max`).
        let mut admitted = 0u32;
        for &stage_bytes in &stages {
            let smem = abi::plan_smem_bytes(mover, stage_bytes);
            if self.engines.iter().any(|e| smem > e.max_smem as usize) {
                last = format!("{smem} B of shared memory per CTA exceeds the device's limit");
                continue;
            }
            for &t in &threads {
                let mut fits = true;
                let mut per_sm_min = u32::MAX;
                let mut on_every = u32::MAX;
                for (d, engine) in self.engines.iter().enumerate() {
                    let f = engine.plan_function(mover, self.dtype, self.op)?;
                    let per_sm = f
                        .occupancy_max_active_blocks_per_multiprocessor(t, smem, None)
                        .map_err(Error::driver("cuOccupancyMaxActiveBlocksPerMultiprocessor"))?;
                    let on = self.ctas_on[d];
                    per_sm_min = per_sm_min.min(per_sm);
                    on_every = on_every.min(per_sm.saturating_mul(engine.sms));
                    if per_sm * engine.sms < on {
                        fits = false;
                        last = format!(
                            "{per_sm} CTA(s) of {t} threads and {smem} B shared memory fit per SM, {} SMs, for {on} CTAs",
                            engine.sms
                        );
                    }
                }
                admitted = admitted.max(on_every);
                if fits {
                    return Ok(LaunchShape {
                        threads: t,
                        stage_bytes,
                        smem_bytes: smem as u32,
                        ctas_per_sm: per_sm_min,
                        ctas_per_device,
                    });
                }
            }
        }
        Err(Error::TooManyCtas {
            requested: ctas_per_device,
            max: admitted,
            why: format!("the plan's thread blocks must all be resident at once; at the smallest shape tried: {last}"),
        })
    }

    /// The TMA mover counts a move's stages in 32 bits: refuses a plan whose largest move needs more
    /// than 2^32 stages of the chosen size (a stage size given far below the moves' sizes).
    fn check_items(&self) -> Result<()> {
        if self.config.mover != Mover::Tma {
            return Ok(());
        }
        let stage = self.shape.stage_bytes.max(1) as u64;
        for r in &self.lowered.ranks {
            let (cb, mb) = (r.header.chunk_bytes, r.header.mb_bytes);
            // As the plan kernel: a message is one move where a micro-batch is the whole chunk,
            // else one move per chunk of it.
            let largest = r.tasks.iter().map(|t| if mb == cb { t.chunks as u64 * mb } else { mb }).max().unwrap_or(0);
            if largest.div_ceil(stage) > u32::MAX as u64 {
                return Err(Error::Config {
                    field: "stage_bytes",
                    why: format!("a move of {largest} B needs more than 2^32 stages of {stage} B"),
                });
            }
        }
        Ok(())
    }

    /// Number of ranks.
    pub fn ranks(&self) -> usize {
        self.ranks.len()
    }

    /// The plan as lowered.
    pub fn lowered(&self) -> &LoweredPlan {
        &self.lowered
    }

    /// The launch shape in use.
    pub fn shape(&self) -> LaunchShape {
        self.shape
    }

    /// The configuration.
    pub fn config(&self) -> &CompiledConfig {
        &self.config
    }

    /// The stream rank `rank` launches on ([`Error::NoSuchRank`] outside the plan's ranks).
    pub fn stream(&self, rank: usize) -> Result<&Arc<CudaStream>> {
        Ok(&self.rank(rank)?.stream)
    }

    /// The engine of the device rank `rank` runs on ([`Error::NoSuchRank`] outside the plan's ranks).
    pub fn engine(&self, rank: usize) -> Result<&Engine> {
        Ok(&self.engines[self.rank(rank)?.device])
    }

    /// Bytes rank `rank`'s buffer in `slot` must hold (`buffer_chunks[slot] × chunk_bytes`);
    /// [`Error::NoSuchRank`] or [`Error::NoSuchSlot`] outside the plan's ranks and slots.
    pub fn buffer_bytes(&self, rank: usize, slot: usize) -> Result<u64> {
        let h = &self.rank(rank)?.header;
        let chunks = h.buffer_chunks.get(slot).ok_or(Error::NoSuchSlot { slot, slots: BUFFER_SLOTS })?;
        Ok(*chunks as u64 * h.chunk_bytes)
    }

    fn rank(&self, rank: usize) -> Result<&RankState> {
        self.ranks.iter().find(|r| r.id == rank).ok_or(Error::NoSuchRank { rank, ranks: self.lowered.ranks.len() })
    }

    /// Runs the plan once on cudarc buffers, out of place: rank `r` reads `send[r]` (its input, as
    /// many elements as [`CompiledPlan::buffer_bytes`] of `slot::INPUT` holds) and writes `recv[r]`
    /// (its output, `slot::OUTPUT`), both on rank `r`'s device, of the element type the plan was
    /// lowered for; the scratch slots are the plan's own (allocated on first use and kept). Each
    /// rank's launch waits for the buffers' earlier cudarc work on any stream and later work waits for
    /// it, as with the collectives. Asynchronous: [`CompiledPlan::synchronize`] waits and reports a
    /// device-side error. Buffers may not overlap (send buffers may share memory: they are only read).
    pub fn run<T: Element, S: DevicePtr<T>, R: DevicePtrMut<T> + DevicePtr<T>>(
        &self,
        send: &[S],
        recv: &mut [R],
    ) -> Result<()> {
        self.run_on(Some(send), recv)
    }

    /// As [`CompiledPlan::run`] for a plan lowered in place: `bufs[r]` holds rank `r`'s input and
    /// output as the lowering placed them (nccl's convention: an AllGather's input is block `r` of
    /// the buffer, a ReduceScatter's output block `r`).
    pub fn run_in_place<T: Element, R: DevicePtrMut<T> + DevicePtr<T>>(&self, bufs: &mut [R]) -> Result<()> {
        self.run_on::<T, R, R>(None, bufs)
    }

    fn run_on<T: Element, S: DevicePtr<T>, R: DevicePtrMut<T> + DevicePtr<T>>(
        &self,
        send: Option<&[S]>,
        recv: &mut [R],
    ) -> Result<()> {
        if T::DTYPE != self.dtype {
            return Err(Error::Config {
                field: "element type",
                why: format!("the plan was lowered for {:?} elements, the buffers hold {:?}", self.dtype, T::DTYPE),
            });
        }
        let in_place = self.lowered.layout.in_place;
        if in_place != send.is_none() {
            let (was, call) = if in_place { ("in place", "run_in_place") } else { ("out of place", "run") };
            return Err(Error::Config { field: "in_place", why: format!("the plan was lowered {was}: call {call}") });
        }
        let p = self.ranks.len();
        let recv_what = if in_place { "buffer" } else { "receive buffer" };
        if recv.len() != p {
            return Err(Error::BufferCount { what: "receive buffers", expected: p, got: recv.len() });
        }
        if let Some(s) = send
            && s.len() != p
        {
            return Err(Error::BufferCount { what: "send buffers", expected: p, got: s.len() });
        }
        let e = self.dtype.size();
        // In place the larger user buffer holds both (`lower::place`); the other slot is unused.
        let recv_slot = if in_place { main_slot(&self.lowered.layout) } else { slot::OUTPUT } as usize;
        let check = |i: usize, len: usize, ordinal: usize, slot: usize, what: &'static str| -> Result<()> {
            let r = &self.ranks[i];
            let device = self.engines[r.device].context().ordinal();
            let expected = (self.buffer_bytes(r.id, slot)? / e as u64) as usize;
            check_placed(len, ordinal, device, r.id, Some(expected), what)
        };
        for (r, b) in send.unwrap_or(&[]).iter().enumerate() {
            check(r, b.len(), ordinal_of(b), slot::INPUT as usize, "send buffer")?;
        }
        for (r, b) in recv.iter().enumerate() {
            check(r, b.len(), ordinal_of(b), recv_slot, recv_what)?;
        }
        // The plan's scratch, before any guard is taken (an allocation that fails leaves nothing
        // ordered), zeroed in each rank's stream order and waited for there (a wait for the context
        // would also wait for the calls of other ranks of this process, which may wait for this
        // rank). Not inside a graph capture: the allocation would be part of it.
        let mut scratch = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        if scratch.is_empty() {
            if self.capturing()? {
                return Err(Error::Capturing { what: "CompiledPlan::run's first call (its scratch allocation)" });
            }
            let mut all = Vec::with_capacity(p);
            for r in &self.ranks {
                let mut a: [Option<DeviceAlloc>; BUFFER_SLOTS] = Default::default();
                for s in [slot::SCRATCH as usize, slot::SCRATCH2 as usize] {
                    let bytes = self.buffer_bytes(r.id, s)?;
                    if bytes != 0 {
                        a[s] = Some(DeviceAlloc::filled_on(&r.stream, bytes as usize, &[])?);
                    }
                }
                all.push(a);
            }
            *scratch = all;
        }
        // cudarc's ordering guards on each rank's stream (dropped once every launch is queued); their
        // addresses are the ones checked and used.
        let mut guards = Vec::with_capacity(2 * p);
        let mut table = vec![[0u64; BUFFER_SLOTS]; p];
        let mut ranges = Vec::with_capacity(2 * p);
        for (r, b) in recv.iter_mut().enumerate() {
            let len = b.len();
            let (ptr, guard) = b.device_ptr_mut(&self.ranks[r].stream);
            guards.push(GuardKind::Write(guard));
            table[r][recv_slot] = ptr;
            ranges.push((r, ptr, len, true, recv_what));
        }
        for (r, b) in send.unwrap_or(&[]).iter().enumerate() {
            let (ptr, guard) = b.device_ptr(&self.ranks[r].stream);
            guards.push(GuardKind::Read(guard));
            table[r][slot::INPUT as usize] = ptr;
            ranges.push((r, ptr, b.len(), false, "send buffer"));
        }
        let mut spans = Vec::with_capacity(ranges.len());
        for &(i, ptr, len, writes, what) in &ranges {
            let (rank, device) = (self.ranks[i].id, self.ranks[i].device);
            check_aligned(ptr, rank, what, e)?;
            let end = ptr + (len * e) as u64;
            spans.push(Range { start: ptr, end, rank, device, writes, buffer: what });
        }
        check_disjoint(&spans, if in_place { "in-place buffers" } else { "send and receive buffers" })?;
        for (r, a) in scratch.iter().enumerate() {
            for s in [slot::SCRATCH as usize, slot::SCRATCH2 as usize] {
                table[r][s] = a[s].as_ref().map_or(0, |b| b.ptr());
            }
        }
        // SAFETY: every user address was checked above (device, length, alignment, disjointness) and
        // belongs to a buffer borrowed for this call, ordered on the rank's stream by its guard; the
        // scratch slots are the plan's own allocations of the plan's sizes, used only by its launches,
        // which run one after another on each rank's stream; in place the slot left 0 has no bytes.
        unsafe { self.launch(&table, None)? };
        drop(guards);
        Ok(())
    }

    /// Launches every rank once, each on its stream (asynchronous; see [`CompiledPlan::synchronize`]).
    /// With `lead`, every rank's launch waits for the work queued on `lead` so far and `lead` waits
    /// for every launch (one stream to time or order the call by).
    ///
    /// # Safety
    /// `buffers[r][s]` is, for every slot `s` whose [`CompiledPlan::buffer_bytes`] is non-zero, the
    /// address of that many bytes of device memory on rank `r`'s device, aligned to the element
    /// size, alive and used by nothing else until the launches complete (in place, the larger user
    /// buffer holds both input and output, as the lowering placed them).
    pub unsafe fn launch(&self, buffers: &[[u64; BUFFER_SLOTS]], lead: Option<&CudaStream>) -> Result<()> {
        let _order = self.launch_order.lock().unwrap_or_else(|e| e.into_inner());
        refuse_after_device_error(
            &self.poison,
            self.ranks.iter().map(|r| &r.status),
            || self.capturing(),
            || self.synchronize(),
        )?;
        let n = self.ranks.len();
        if buffers.len() != n {
            return Err(Error::BufferCount { what: "buffer tables", expected: n, got: buffers.len() });
        }
        let elem = self.dtype.size() as u64;
        for (rank, table) in self.ranks.iter().zip(buffers) {
            let r = rank.id;
            for (s, &addr) in table.iter().enumerate() {
                let bytes = self.buffer_bytes(r, s)?;
                if bytes != 0 && addr == 0 {
                    return Err(Error::MissingBuffer { what: "plan buffer", rank: r, elements: bytes / elem });
                }
                if bytes != 0 && !addr.is_multiple_of(elem) {
                    return Err(Error::Misaligned {
                        what: "plan buffer",
                        rank: r,
                        address: addr,
                        align: elem as usize,
                    });
                }
            }
        }
        let workspaces = self.workspaces;
        // Each device's kernel, and any error cudarc kept for a context (from a buffer guard, or
        // another thread's drop), before anything is queued: a failure then leaves no rank launched.
        let functions = self
            .engines
            .iter()
            .map(|e| e.plan_function(self.config.mover, self.dtype, self.op))
            .collect::<Result<Vec<_>>>()?;
        check_contexts(self.ranks.iter().map(|r| r.stream.context()).chain(lead.map(|l| l.context())))?;
        let ready = match lead {
            Some(lead) => Some(
                lead.record_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING))
                    .map_err(Error::driver("cuEventRecord"))?,
            ),
            None => None,
        };
        let mut queued = false;
        for (r, rank) in self.ranks.iter().enumerate() {
            // SAFETY: the caller's contract, for each rank in turn.
            let launched =
                unsafe { self.launch_rank(rank, &functions[rank.device], buffers[r], workspaces, ready.as_ref()) };
            if launched.is_err() && queued {
                // Queued ranks will wait for this one's messages: their FIFO counters and the others'
                // disagree until `reset` (which waits for the lock held here: the epoch is current).
                self.poison.set_since(self.poison.epoch());
            }
            launched?;
            queued |= rank.header.tbs != 0;
        }
        // Every rank is queued: a failure here leaves the lead stream short of a wait (the error names
        // the record or wait), never the ranks out of step.
        if let Some(lead) = lead {
            for rank in &self.ranks {
                record_event(&rank.done, &rank.stream)?;
                stream_wait(lead, &rank.done)?;
            }
        }
        Ok(())
    }

    /// Queues `rank`'s launch on its `buffers` (after `ready` where given).
    ///
    /// # Safety
    /// As [`CompiledPlan::launch`], for this rank.
    unsafe fn launch_rank(
        &self,
        rank: &RankState,
        f: &CudaFunction,
        buffers: [u64; BUFFER_SLOTS],
        workspaces: [u64; MAX_RANKS],
        ready: Option<&CudaEvent>,
    ) -> Result<()> {
        let s = &self.shape;
        if let Some(ready) = ready {
            stream_wait(&rank.stream, ready)?;
        }
        let h = &rank.header;
        if h.tbs != 0 {
            let args = Args(PlanLaunchArgs {
                header: *h,
                programs: rank.programs.ptr(),
                segments: rank.segments.ptr(),
                tasks: rank.tasks.ptr(),
                waits: rank.waits.ptr(),
                connections: rank.connections.ptr(),
                status: rank.status.ptr(),
                timing: if h.flags & PLAN_FLAG_TIMING != 0 { rank.timing.ptr() } else { 0 },
                timeout_ns: self.config.timeout.as_nanos().min(u64::MAX as u128) as u64,
                workspaces,
                buffers,
            });
            let cfg =
                LaunchConfig { grid_dim: (h.tbs, 1, 1), block_dim: (s.threads, 1, 1), shared_mem_bytes: s.smem_bytes };
            // SAFETY: the argument is the kernel's single by-value `PlanLaunchArgs`; `f` is the plan
            // kernel of the rank's device; the descriptors, workspaces, status and timing records
            // are this plan's own allocations; the caller vouches for the buffers; `launch` queues
            // every rank (or poisons the plan where one fails after others were queued).
            unsafe { launch_kernel(&rank.stream, f, cfg, &args, Start::AfterPrevious) }?;
        }
        Ok(())
    }

    /// Waits for every rank's stream and reports the first device-side error (a bounded wait that
    /// gave up, a rejected descriptor). After an error, [`CompiledPlan::reset`] before launching
    /// again.
    pub fn synchronize(&self) -> Result<()> {
        // Before the records are read: an error read before a concurrent reset must not poison the
        // plan the reset made usable.
        let epoch = self.poison.epoch();
        if self.capturing()? {
            return Err(Error::Capturing { what: "synchronize" });
        }
        for r in &self.ranks {
            sync_stream(&r.stream)?;
        }
        for s in self.statuses() {
            if let Some(e) = Error::from_status(&s) {
                self.poison.set_since(epoch);
                return Err(e);
            }
        }
        Ok(())
    }

    /// Whether any rank's stream is capturing a CUDA graph (or was, and the capture broke).
    fn capturing(&self) -> Result<bool> {
        any_capturing(self.ranks.iter().map(|r| &*r.stream))
    }

    /// Every rank's status record (complete after [`CompiledPlan::synchronize`]; read while launches
    /// run, it holds what has reached host memory so far, and the first error's details may be
    /// partly written).
    pub fn statuses(&self) -> Vec<Status> {
        self.ranks.iter().map(|r| r.status.read()).collect()
    }

    /// Every rank's per-TB timing of the last launch (`%globaltimer` ns; zeros unless the plan was
    /// lowered with timing).
    pub fn timing(&self) -> Result<Vec<Vec<TbTiming>>> {
        self.ranks
            .iter()
            .map(|r| {
                let bytes = r.timing.read()?;
                let n = r.header.tbs as usize * std::mem::size_of::<TbTiming>();
                Ok(bytes[..n].chunks_exact(std::mem::size_of::<TbTiming>()).map(bytemuck::pod_read_unaligned).collect())
            })
            .collect()
    }

    /// Every rank's FIFO region as bytes (the workspace from `FIFO_REGION_OFFSET` on: progress
    /// counters, FIFO counters, rings), the layout of `oxccl_host::exec::lowered::Memory::workspaces`.
    pub fn fifo_regions(&self) -> Result<Vec<Vec<u8>>> {
        self.ranks
            .iter()
            .map(|r| r.workspace.read_range(FIFO_REGION_OFFSET, r.header.fifo_bytes as usize, &r.stream))
            .collect()
    }

    /// Waits for the streams and zeroes every workspace, status and timing record (after an error).
    /// Launches from other threads wait until it is done.
    pub fn reset(&self) -> Result<()> {
        self.reset_after(|| Ok(()))
    }

    /// [`CompiledPlan::reset`], calling `settled` between the wait for the streams and the
    /// zeroing (a per-rank plan: until every rank's kernels have ended, a peer's may still write
    /// into this rank's FIFO region).
    fn reset_after(&self, settled: impl FnOnce() -> Result<()>) -> Result<()> {
        // No launch is queued meanwhile: one would run between the wait and the zeroing.
        let _order = self.launch_order.lock().unwrap_or_else(|e| e.into_inner());
        if self.capturing()? {
            return Err(Error::Capturing { what: "reset" });
        }
        // A failed wait still reaches `settled`: the peers wait there for this rank.
        let waited = self.ranks.iter().try_for_each(|r| sync_stream(&r.stream));
        settled()?;
        waited?;
        for r in &self.ranks {
            r.workspace.zero_async(&r.stream)?;
            r.timing.zero_async(&r.stream)?;
        }
        // The zeroing is queued: a kept error now belongs to a later call, not to this wait.
        for r in &self.ranks {
            wait_stream(&r.stream)?;
            r.status.clear();
        }
        self.poison.clear();
        Ok(())
    }
}

impl Drop for CompiledPlan {
    /// Waits for the ranks' streams before the descriptors and workspaces are freed (and, per
    /// rank across processes, withdrawn from the peers).
    fn drop(&mut self) {
        for r in &self.ranks {
            let _ = wait_stream(&r.stream);
        }
        if let Some((peer, region)) = self.link.as_mut().and_then(|l| l.region.take()) {
            peer.release(region);
        }
    }
}

/// A compiled plan loaded for one rank of a per-rank communicator ([`Comm::load_plan`]): this
/// rank's thread blocks, launched on the communicator's stream, meeting the peers' through FIFOs in
/// workspaces every rank maps. Every rank loads the same lowering; each runs it on its own buffers.
/// Every rank stops running a plan before any rank drops it: across processes a dropped rank's
/// FIFO workspace is withdrawn from its peers at once (after its own launches have ended).
///
/// [`Comm::load_plan`]: crate::Comm::load_plan
pub struct RankPlan {
    plan: CompiledPlan,
    rank: usize,
}

impl std::fmt::Debug for RankPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RankPlan")
            .field("name", &self.plan.lowered.name)
            .field("rank", &self.rank)
            .field("ranks", &self.plan.lowered.ranks.len())
            .field("shape", &self.plan.shape)
            .finish()
    }
}

impl RankPlan {
    pub(crate) fn new(plan: CompiledPlan, rank: usize) -> Self {
        RankPlan { plan, rank }
    }

    /// Runs this rank's part of the plan once, out of place: reads `send` (as many elements as
    /// [`RankPlan::buffer_bytes`] of `slot::INPUT` holds), writes `recv` (`slot::OUTPUT`), both on
    /// the communicator's device, of the element type the plan was lowered for. Every rank runs
    /// its plans in the same order. Asynchronous, ordered on the communicator's stream as its
    /// collectives are: [`RankPlan::synchronize`] waits and reports a device-side error (a peer
    /// that never runs its part is an [`Error::Timeout`] naming it).
    pub fn run<T: Element, S: DevicePtr<T>, R: DevicePtrMut<T> + DevicePtr<T>>(
        &self,
        send: &S,
        recv: &mut R,
    ) -> Result<()> {
        self.plan.run(std::slice::from_ref(send), std::slice::from_mut(recv))
    }

    /// As [`RankPlan::run`] for a plan lowered in place: `buf` holds this rank's input and output
    /// as the lowering placed them.
    pub fn run_in_place<T: Element, R: DevicePtrMut<T> + DevicePtr<T>>(&self, buf: &mut R) -> Result<()> {
        self.plan.run_in_place(std::slice::from_mut(buf))
    }

    /// Waits for this rank's stream and reports the first device-side error of its launches.
    pub fn synchronize(&self) -> Result<()> {
        self.plan.synchronize()
    }

    /// After an error, on every rank (collective, through `comm`'s bootstrap): waits for this
    /// rank's launches, meets the peers once all theirs have ended, zeroes this rank's workspace
    /// and status, and meets them again, so that no rank launches before every FIFO is empty.
    pub fn reset(&self, comm: &crate::Comm) -> Result<()> {
        if comm.rank() != self.rank || comm.world() != self.plan.lowered.ranks.len() {
            return Err(Error::Config {
                field: "comm",
                why: format!(
                    "rank {} of {}, the plan was loaded for rank {} of {}",
                    comm.rank(),
                    comm.world(),
                    self.rank,
                    self.plan.lowered.ranks.len()
                ),
            });
        }
        self.plan.reset_after(|| comm.bootstrap().barrier().map_err(Error::from))?;
        comm.bootstrap().barrier()?;
        Ok(())
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The plan as lowered (every rank's part).
    pub fn lowered(&self) -> &LoweredPlan {
        &self.plan.lowered
    }

    /// The launch shape in use.
    pub fn shape(&self) -> LaunchShape {
        self.plan.shape
    }

    /// Bytes this rank's buffer in `slot` must hold ([`Error::NoSuchSlot`] outside the slots).
    pub fn buffer_bytes(&self, slot: usize) -> Result<u64> {
        self.plan.buffer_bytes(self.rank, slot)
    }

    /// This rank's status record (see [`CompiledPlan::statuses`]).
    pub fn status(&self) -> Status {
        self.plan.ranks[0].status.read()
    }
}

impl RankState {
    /// Rank `id` of a lowering (`lr`) on `stream` of device `device`: its descriptors uploaded in
    /// the stream's order (complete when this returns), with `workspace`.
    fn upload(
        lr: &LoweredRank,
        id: usize,
        device: usize,
        stream: &Arc<CudaStream>,
        workspace: PlanMemory,
    ) -> Result<Self> {
        let ctx = stream.context();
        let upload = |bytes: &[u8]| DeviceAlloc::filled_on(stream, bytes.len(), bytes);
        let h = lr.header;
        Ok(RankState {
            id,
            device,
            stream: stream.clone(),
            header: h,
            programs: upload(bytemuck::cast_slice(&lr.tbs))?,
            segments: upload(bytemuck::cast_slice(&lr.segments))?,
            tasks: upload(bytemuck::cast_slice(&lr.tasks))?,
            waits: upload(bytemuck::cast_slice(&lr.waits))?,
            connections: upload(bytemuck::cast_slice(&lr.connections))?,
            workspace,
            status: StatusRecord::new(ctx)?,
            timing: DeviceAlloc::filled_on(stream, h.tbs as usize * std::mem::size_of::<TbTiming>(), &[])?,
            done: ctx
                .new_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING))
                .map_err(Error::driver("cuEventCreate"))?,
        })
    }
}

/// Bytes of a rank's plan workspace: the T-CCL workspace, then its FIFO region.
pub(crate) fn workspace_bytes(lr: &LoweredRank) -> Result<usize> {
    usize::try_from(FIFO_REGION_OFFSET as u64 + lr.header.fifo_bytes)
        .map_err(|_| Error::Config { field: "fifo_bytes", why: format!("{} bytes", lr.header.fifo_bytes) })
}

/// Device buffers for every rank's buffer slots of a plan (tests and benchmarks): `buffer_chunks[s]
/// × chunk_bytes` bytes each, starting `shift` bytes into their allocation (a shift that is not a
/// multiple of 16 sends every move through the SIMT element path).
pub struct PlanBuffers {
    allocs: Vec<[Option<DeviceAlloc>; BUFFER_SLOTS]>,
    sizes: Vec<[u64; BUFFER_SLOTS]>,
    shift: u64,
}

impl PlanBuffers {
    /// The largest offset into the allocations (enough for any misalignment).
    pub const MAX_SHIFT: u64 = 4096;

    /// Zeroed buffers for `plan`, on each rank's device (complete when this returns); `shift` is at
    /// most [`PlanBuffers::MAX_SHIFT`].
    pub fn new(plan: &CompiledPlan, shift: u64) -> Result<Self> {
        if shift > Self::MAX_SHIFT {
            return Err(Error::Config { field: "shift", why: format!("{shift} B is above {} B", Self::MAX_SHIFT) });
        }
        let mut allocs = Vec::with_capacity(plan.ranks());
        let mut sizes = Vec::with_capacity(plan.ranks());
        for r in 0..plan.ranks() {
            let ctx = plan.engine(r)?.context();
            let mut size = [0u64; BUFFER_SLOTS];
            for (s, b) in size.iter_mut().enumerate() {
                *b = plan.buffer_bytes(r, s)?;
            }
            let mut a: [Option<DeviceAlloc>; BUFFER_SLOTS] = Default::default();
            for s in 0..BUFFER_SLOTS {
                if size[s] != 0 {
                    let bytes = size[s].checked_add(shift).and_then(|b| usize::try_from(b).ok()).ok_or_else(|| {
                        Error::Config { field: "buffer", why: format!("{} B plus a {shift} B shift", size[s]) }
                    })?;
                    a[s] = Some(DeviceAlloc::zeroed(ctx, bytes)?);
                }
            }
            allocs.push(a);
            sizes.push(size);
            sync_context(ctx)?;
        }
        Ok(PlanBuffers { allocs, sizes, shift })
    }

    /// The buffer table of [`CompiledPlan::launch`].
    pub fn table(&self) -> Vec<[u64; BUFFER_SLOTS]> {
        self.allocs.iter().map(|a| std::array::from_fn(|s| a[s].as_ref().map_or(0, |b| b.ptr() + self.shift))).collect()
    }

    /// Writes rank `rank`'s slot `slot` (exactly its size; complete when this returns).
    pub fn write(&self, rank: usize, slot: usize, data: &[u8]) -> Result<()> {
        let size = self.size(rank, slot)?;
        if data.len() as u64 != size {
            return Err(Error::Config {
                field: "data",
                why: format!("{} bytes for rank {rank}'s slot {slot}, which holds {size}", data.len()),
            });
        }
        match &self.allocs[rank][slot] {
            None => Ok(()),
            Some(a) => {
                let mut bytes = vec![0u8; self.shift as usize];
                bytes.extend_from_slice(data);
                a.write(&bytes)
            }
        }
    }

    /// Reads rank `rank`'s slot `slot` (after the launches that write it are synchronised).
    pub fn read(&self, rank: usize, slot: usize) -> Result<Vec<u8>> {
        let size = self.size(rank, slot)?;
        match &self.allocs[rank][slot] {
            None => Ok(Vec::new()),
            Some(a) => a.read_range(self.shift as usize, size as usize),
        }
    }

    /// The byte size of rank `rank`'s slot `slot`, or which index is out of range.
    fn size(&self, rank: usize, slot: usize) -> Result<u64> {
        let sizes = self.sizes.get(rank).ok_or(Error::NoSuchRank { rank, ranks: self.sizes.len() })?;
        sizes.get(slot).copied().ok_or(Error::NoSuchSlot { slot, slots: BUFFER_SLOTS })
    }

    /// Uploads every buffer of `mem` (the CPU executor's memory of the same plan).
    pub fn upload(&self, mem: &Memory) -> Result<()> {
        for (r, bufs) in mem.buffers.iter().enumerate() {
            for (s, b) in bufs.iter().enumerate() {
                self.write(r, s, b)?;
            }
        }
        Ok(())
    }

    /// Every buffer, in the layout of `Memory::buffers`.
    pub fn download(&self) -> Result<Vec<[Vec<u8>; BUFFER_SLOTS]>> {
        (0..self.allocs.len())
            .map(|r| {
                let mut out: [Vec<u8>; BUFFER_SLOTS] = Default::default();
                for (s, o) in out.iter_mut().enumerate() {
                    *o = self.read(r, s)?;
                }
                Ok(out)
            })
            .collect()
    }
}

/// `PlanLaunchArgs` passed by value as the kernel's only parameter.
#[repr(transparent)]
struct Args(PlanLaunchArgs);
// SAFETY: `PlanLaunchArgs` is `#[repr(C)]`, `Pod`, 8-byte aligned: its bytes are the kernel parameter.
unsafe impl DeviceRepr for Args {}

#[cfg(test)]
mod tests {
    use super::STAGE_BYTES;
    use oxccl_kernels::abi::{self, Mover};

    /// The ladder runs largest first in whole vectors, and one SM's shared memory (228 KiB, 1 KiB of
    /// it reserved per CTA) holds one CTA at its top rung and two at 14 KiB: the shapes the plans'
    /// measurements ran at.
    #[test]
    fn stage_ladder_descends_and_fits_one_and_two_ctas_per_sm() {
        assert!(STAGE_BYTES.windows(2).all(|w| w[0] > w[1]));
        assert!(STAGE_BYTES.iter().all(|b| b.is_multiple_of(16)));
        let per_sm = 228 * 1024;
        let fits = |b: u32, ctas: usize| ctas * (abi::plan_smem_bytes(Mover::Tma, b) + 1024) <= per_sm;
        assert!(fits(STAGE_BYTES[0], 1));
        let two = *STAGE_BYTES.iter().find(|&&b| fits(b, 2)).unwrap();
        assert_eq!(two, 14336);
    }
}
