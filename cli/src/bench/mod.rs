//! Measurements that speak nccl-tests: device-event timing, the mover CTA sweep, and the collective
//! bandwidth table (size, count, type, redop, root, time, algbw, busbw, #wrong, out-of-place and
//! in-place, "Avg bus bandwidth"). algbw = bytes / seconds / 1e9; busbw = algbw × the collective's
//! factor. Correctness is checked in a separate, untimed pass. The reshard benchmark times a plan
//! against the two usual workarounds on the same engine and against two speed-of-light models. The
//! program benchmark ([`plan_bench`]) runs a transfer program (ResCCL algorithm, MSCCL XML) through
//! `run_program`.

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut};
use oxccl::engine::{DeviceAlloc, DeviceProgram, Engine, LaunchSpec, PeerScope, Status};
use oxccl::{Collective, Communicator, Config, DType, Mover, ReduceOp, Reduction, ReshardOptions};
use oxccl::{Error, Result};
use oxccl_host::lowered::Lowered;
use oxccl_host::reshard::{self, Layout, Loads, LowerOptions, Region, lower, workaround};
use oxccl_host::tccl::{PlanSpec, split};
use oxccl_kernels::abi::{self, BUFFER_SLOTS, MAX_RANKS, ReduceMode, Task, TaskKind, TbProgram, slot};
use std::collections::HashMap;
use std::sync::Arc;

mod ranks;
mod trace;
pub use ranks::{Buffers, rank_bench};
pub use trace::{ChainOp, TmaTraceBench, TraceRow, tma_trace, u32_tensor_map};

/// Average milliseconds per call of `f` over `iters` calls (at least one: 0 times one call) after
/// `warmup` untimed ones, measured with device events on `stream`.
pub fn time_ms(stream: &Arc<CudaStream>, warmup: usize, iters: usize, f: impl FnMut() -> Result<()>) -> Result<f64> {
    time_ms_on(std::slice::from_ref(stream), warmup, iters, f)
}

/// As [`time_ms`] for calls that run on several streams (one per rank, possibly on several GPUs):
/// events bracket the timed calls on every distinct stream and the longest span counts. The ranks'
/// launches meet at device barriers, so no stream's span can hide another's work.
pub fn time_ms_on(
    streams: &[Arc<CudaStream>],
    warmup: usize,
    iters: usize,
    mut f: impl FnMut() -> Result<()>,
) -> Result<f64> {
    let distinct = oxccl::graph::distinct_streams(streams);
    for _ in 0..warmup {
        f()?;
    }
    let record = |s: &Arc<CudaStream>| {
        s.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).map_err(Error::driver("cuEventRecord"))
    };
    let starts = distinct.iter().map(|s| record(s)).collect::<Result<Vec<_>>>()?;
    for _ in 0..iters.max(1) {
        f()?;
    }
    let ends = distinct.iter().map(|s| record(s)).collect::<Result<Vec<_>>>()?;
    let mut ms = 0f64;
    for (start, end) in starts.iter().zip(&ends) {
        end.synchronize().map_err(Error::driver("cuEventSynchronize"))?;
        ms = ms.max(start.elapsed_ms(end).map_err(Error::driver("cuEventElapsedTime"))? as f64);
    }
    Ok(ms / iters.max(1) as f64)
}

/// As [`time_ms_on`], with the calls in a CUDA graph (nccl-tests' `-G`): `iters` calls of `f` are
/// captured once ([`oxccl::graph::capture`]), the graph is launched once untimed and then `launches`
/// times between device events on the first stream; the result is milliseconds per call. `f` must
/// only queue work (a communicator's call of a prepared plan).
pub fn time_graph_ms_on(
    streams: &[Arc<CudaStream>],
    iters: usize,
    launches: usize,
    mut f: impl FnMut() -> Result<()>,
) -> Result<f64> {
    let calls = iters.max(1).checked_mul(launches.max(1)).ok_or_else(|| Error::Config {
        field: "graph_launches",
        why: format!("{launches} launches of {iters} calls are more calls than a usize counts"),
    })?;
    let graph = oxccl::graph::capture(streams, || (0..iters.max(1)).try_for_each(|_| f()))?;
    let first = &streams[0];
    // Once the graph runs, no return before it ends: the caller frees the buffers it uses.
    let timed = (|| -> Result<f64> {
        graph.launch().map_err(Error::driver("cuGraphLaunch"))?;
        let start =
            first.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).map_err(Error::driver("cuEventRecord"))?;
        for _ in 0..launches.max(1) {
            graph.launch().map_err(Error::driver("cuGraphLaunch"))?;
        }
        let end = first.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).map_err(Error::driver("cuEventRecord"))?;
        end.synchronize().map_err(Error::driver("cuEventSynchronize"))?;
        Ok(start.elapsed_ms(&end).map_err(Error::driver("cuEventElapsedTime"))? as f64)
    })();
    let synced = first.synchronize().map_err(Error::driver("cuStreamSynchronize"));
    let ms = timed?;
    synced?;
    Ok(ms / calls as f64)
}

/// `cuMemcpyDtoD` of `bytes` on `stream`'s GPU in GB/s, counting bytes read and written (the
/// one-GPU ceiling every roofline here is measured against).
pub fn memcpy_rate(stream: &Arc<CudaStream>, bytes: usize, warmup: usize, iters: usize) -> Result<f64> {
    let a: CudaSlice<u8> = stream.alloc_zeros(bytes).map_err(Error::driver("cuMemAlloc"))?;
    let mut d: CudaSlice<u8> = stream.alloc_zeros(bytes).map_err(Error::driver("cuMemAlloc"))?;
    let ms =
        time_ms(stream, warmup, iters, || stream.memcpy_dtod(&a, &mut d).map_err(Error::driver("cuMemcpyDtoDAsync")))?;
    Ok(2.0 * bytes as f64 / (ms * 1e-3) / 1e9)
}

/// A sweep's one-GPU roofline: `cuMemcpyDtoD` of [`Roofline::BYTES`] (large enough to reach the
/// rate whatever the sweep's sizes; a 2 MiB copy reads well under it), measured before the sweep
/// and after it (it varies by several per cent between runs); the faster is the reference.
pub struct Roofline {
    before: f64,
}

impl Roofline {
    /// Bytes of the measuring copy.
    pub const BYTES: usize = 1 << 30;

    /// The rate before the sweep where every rank is on one GPU (`one_gpu`), else none (the ranks'
    /// bytes then go through several memories).
    pub fn before(stream: &Arc<CudaStream>, one_gpu: bool) -> Result<Option<Roofline>> {
        if !one_gpu {
            return Ok(None);
        }
        Ok(Some(Roofline { before: memcpy_rate(stream, Self::BYTES, 3, 10)? }))
    }

    /// Measures again after the sweep: the reference rate, and how it was had, for the report.
    pub fn after(self, stream: &Arc<CudaStream>) -> Result<(f64, String)> {
        let after = memcpy_rate(stream, Self::BYTES, 3, 10)?;
        let rate = self.before.max(after);
        let how = format!(
            "cuMemcpyDtoD's {rate:.1} GB/s ({} B, read + written; {:.1} before the sweep, {after:.1} after)",
            Self::BYTES,
            self.before
        );
        Ok((rate, how))
    }

    /// `bytes` moved in `us` as a share of `rate` (GB/s), `N/A` for a side that did not run.
    pub fn percent(rate: f64, bytes: u64, us: Option<f64>) -> String {
        us.map_or("N/A".into(), |us| format!("{:.1}%", 100.0 * bytes as f64 / (us * 1e-6) / 1e9 / rate))
    }
}

/// What a mover-sweep row measures.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SweepOp {
    /// `dst = a`: bytes read + written = 2 × size.
    Copy,
    /// `dst = a + b` (f32), sources combined in shared memory / registers: 3 × size.
    ReduceAdd,
    /// `dst += b` (f32) by `cp.reduce.async.bulk` (TMA) or a load-add-store (SIMT): 3 × size.
    ReduceInto,
}

impl SweepOp {
    /// Every operation, in the sweep's order.
    pub const ALL: [SweepOp; 3] = [SweepOp::Copy, SweepOp::ReduceAdd, SweepOp::ReduceInto];

    /// The row's name in the sweep's table.
    pub fn name(self) -> &'static str {
        match self {
            SweepOp::Copy => "copy",
            SweepOp::ReduceAdd => "reduce-add",
            SweepOp::ReduceInto => "reduce-into",
        }
    }
    /// Sources per pipeline stage (shared-memory slots).
    fn sources(self) -> u32 {
        match self {
            SweepOp::ReduceAdd => 2,
            SweepOp::Copy | SweepOp::ReduceInto => 1,
        }
    }

    fn traffic(self) -> u64 {
        match self {
            SweepOp::Copy => 2,
            SweepOp::ReduceAdd | SweepOp::ReduceInto => 3,
        }
    }
}

/// The movers the launches of `programs` (those with tasks) run on under `c`, as a row names them:
/// the configured one, the latency mover for a program whose every task is small
/// (`Config::latency_below`, the launcher's rule), or both (`tma+latency`).
fn movers_of<'a>(c: &Config, programs: impl IntoIterator<Item = &'a Lowered>) -> &'static str {
    let (mut configured, mut latency) = (false, false);
    for l in programs.into_iter().filter(|l| !l.tasks.is_empty()) {
        let largest = l.tasks.iter().map(|t| t.bytes).max().unwrap_or(0);
        match oxccl::engine::mover_for(c.mover, c.latency_below, largest) {
            Mover::Latency => latency = true,
            _ => configured = true,
        }
    }
    match (c.mover, configured && latency) {
        (Mover::Tma, true) => "tma+latency",
        (Mover::Simt, true) => "simt+latency",
        (_, false) if latency => Mover::Latency.name(),
        (m, _) => m.name(),
    }
}

/// [`movers_of`] the plan of a collective of `count` elements on `ctas` CTAs per rank (the
/// configured mover where the plan cannot be built: the call then fails anyway).
fn ran_on(b: &CollectiveBench, count: u64, ctas: u32) -> &'static str {
    let c = &b.config;
    let spec = PlanSpec {
        collective: b.collective,
        count,
        dtype: b.dtype,
        op: b.op,
        ranks: b.ranks,
        in_place: false,
        ctas,
        reduction: c.reduction,
    };
    oxccl_host::tccl::plan(&spec).map_or(c.mover.name(), |l| movers_of(c, [&l]))
}

/// One row of the mover sweep.
#[derive(Clone, Debug, serde::Serialize)]
pub struct SweepRow {
    /// The operation, as [`SweepOp::name`] spells it.
    pub op: &'static str,
    /// `tma` or `simt`.
    pub mover: &'static str,
    /// CTAs the range is split between.
    pub ctas: u32,
    /// Threads per CTA.
    pub threads: u32,
    /// Registers per thread of the mover's f32-sum kernel.
    pub registers: u32,
    /// Bytes of each buffer ([`SweepConfig::bytes`]); the row's traffic is 2 or 3 times this.
    pub bytes: u64,
    /// The TMA pipeline's bytes per source per stage (0 for SIMT rows).
    pub chunk_bytes: u32,
    /// The TMA pipeline's stages (0 for SIMT rows).
    pub stages: u32,
    /// Milliseconds per launch, the mean over the timed launches.
    pub ms: f64,
    /// Bytes read + written per second / 1e9.
    pub gbps: f64,
    /// [`SweepRow::gbps`] divided by the CTA count.
    pub gbps_per_cta: f64,
    /// Against `cuMemcpyDtoD` of the same size in the same run.
    pub of_memcpy: f64,
    /// Bytes per piece dealt to the CTAs in turn (0: one contiguous range per CTA).
    pub piece_bytes: u64,
}

/// How the mover sweep splits its range between the CTAs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Split {
    /// One contiguous range per CTA (a 16-byte-grained split).
    Contiguous,
    /// Pieces of this many bytes (a multiple of 16) dealt to the CTAs in turn: CTA `c` moves pieces
    /// `c`, `c + ctas`, ….
    Pieces(u64),
    /// Contiguous below [`Split::AUTO_PIECES_FROM`] CTAs, pieces of [`Split::AUTO_PIECE`] from there
    /// (where every CTA gets at least one piece; contiguous otherwise).
    /// Measured on an H200 (docs/PERF.md, 2026-11-29): at 66 and 132 CTAs one distant contiguous
    /// stream per CTA left both movers at 68–81 % of `cuMemcpyDtoD`, pieces dealt in turn reached
    /// 86–93 %; at 32 CTAs and fewer the contiguous split was as fast or faster (a piece is a task,
    /// and the TMA ring drains between tasks).
    Auto,
}

impl Split {
    /// CTA count from which [`Split::Auto`] deals pieces.
    pub const AUTO_PIECES_FROM: u32 = 64;
    /// Piece size of [`Split::Auto`].
    pub const AUTO_PIECE: u64 = 4 << 20;

    /// The piece size for `bytes` over `ctas` CTAs (`None`: one contiguous range each).
    pub fn piece(self, bytes: u64, ctas: u32) -> Option<u64> {
        match self {
            Split::Contiguous => None,
            Split::Pieces(p) => Some(p),
            Split::Auto => {
                (ctas >= Self::AUTO_PIECES_FROM && bytes >= ctas as u64 * Self::AUTO_PIECE).then_some(Self::AUTO_PIECE)
            }
        }
    }
}

/// A one-rank program moving `bytes` with `ctas` CTAs: one task per CTA over a 16-byte-grained split,
/// or, with `piece`, pieces of `piece` bytes dealt to the CTAs in turn (CTA `c` moves pieces `c`,
/// `c + ctas`, …), so that the CTAs stream neighbouring addresses instead of one distant range each.
fn sweep_program(op: SweepOp, bytes: u64, ctas: u32, piece: Option<u64>) -> Lowered {
    let (kind, src_ranks) = match op {
        SweepOp::Copy => (TaskKind::Move, 0b1),
        SweepOp::ReduceAdd => (TaskKind::Move, 0b11),
        SweepOp::ReduceInto => (TaskKind::ReduceInto, 0b10),
    };
    let task = |lo: u64, hi: u64| Task {
        kind: kind.raw(),
        dtype: DType::F32.raw(),
        op: ReduceOp::Sum.raw(),
        src_slot: slot::INPUT,
        dst_slot: slot::OUTPUT,
        flags: 0,
        divisor: 0,
        src_ranks,
        dst_ranks: 1,
        src_offset: lo,
        dst_offset: lo,
        bytes: hi - lo,
    };
    let ranges = |c: u32| -> Vec<(u64, u64)> {
        match piece {
            Some(p) => (c as u64..bytes.div_ceil(p))
                .step_by(ctas as usize)
                .map(|i| (i * p, ((i + 1) * p).min(bytes)))
                .collect(),
            None => {
                let (lo, hi) = split(bytes, ctas as u64, 16, c as u64);
                if hi > lo { vec![(lo, hi)] } else { vec![] }
            }
        }
    };
    let mut programs = Vec::new();
    let mut tasks = Vec::new();
    for c in 0..ctas {
        let first = tasks.len() as u32;
        tasks.extend(ranges(c).into_iter().map(|(lo, hi)| task(lo, hi)));
        programs.push(TbProgram {
            rank: 0,
            cta: c,
            first_task: first,
            task_count: tasks.len() as u32 - first,
            barrier_ranks: 0,
            table: 0,
            key: 0,
            reserved: 0,
        });
    }
    // Only the reduce-add's warps combine; a copy and a bulk reduction are one issuing thread's work.
    let combines = op == SweepOp::ReduceAdd;
    Lowered { programs, tasks, ranks: 2, slots: op.sources(), combines }
}

/// Parameters of the mover sweep.
#[derive(Clone, Debug)]
pub struct SweepConfig {
    /// Bytes of each buffer, the range every row moves (a whole number of f32 elements).
    pub bytes: u64,
    /// The CTA counts swept, in order (each at least 1).
    pub ctas: Vec<u32>,
    /// Threads of a TMA CTA that copies or bulk-reduces (`cp.reduce.async.bulk`): one thread issues
    /// every operation, nothing combines.
    pub tma_threads_bulk: u32,
    /// Threads of a TMA CTA whose warps combine the reduce-add's two sources in registers.
    pub tma_threads_combine: u32,
    /// Threads of a SIMT CTA.
    pub simt_threads: u32,
    /// TMA chunk bytes per source per stage; left open (with [`SweepConfig::stages`]), the
    /// collectives' rule for the program: [`auto_pipeline`](oxccl::auto_pipeline) for reductions into one source,
    /// [`combining_pipeline`](oxccl::combining_pipeline) for the reduce-add's register combine, and,
    /// where both are left open, for the copy, which has the SM to itself, 32 KiB chunks as deep as
    /// shared memory allows (`lone_copy_pipeline`). A chunk whose stages would not fit the
    /// device's shared memory is cut to the largest 1 KiB multiple that does.
    pub chunk_bytes: Option<u32>,
    /// TMA pipeline stages (`None`: chosen as [`SweepConfig::chunk_bytes`] says).
    pub stages: Option<u32>,
    /// How the range is split between the CTAs.
    pub split: Split,
    /// Untimed launches before each row's timed ones.
    pub warmup: usize,
    /// Timed launches per row (at least one is run); the row's time is their mean.
    pub iters: usize,
}

impl Default for SweepConfig {
    fn default() -> Self {
        SweepConfig {
            bytes: 1 << 30,
            ctas: vec![1, 2, 4, 8, 16, 32, 66, 132],
            tma_threads_bulk: 32,
            tma_threads_combine: 256,
            simt_threads: 512,
            chunk_bytes: None,
            stages: None,
            split: Split::Auto,
            warmup: 2,
            iters: 5,
        }
    }
}

impl SweepConfig {
    /// Rows of [`mover_sweep`]: every operation with each mover at each CTA count.
    pub fn rows(&self) -> usize {
        SweepOp::ALL.len() * 2 * self.ctas.len()
    }

    /// Checks what the sweep would refuse, without a GPU: a size of at least one whole f32 element,
    /// at least one timed iteration, CTA counts in `1..=MAX_CTAS_PER_RANK`, threads that are
    /// multiples of 32 in `32..=1024` (`32..=512` for SIMT), a given chunk that is a positive
    /// multiple of 16, given stages in `1..=MAX_STAGES`, and explicit pieces that are positive
    /// multiples of 16, at most 2^20 of them, and at least one per CTA. (What the device's shared
    /// memory holds is left to the launch: a chunk too large for it is cut, see
    /// [`SweepConfig::chunk_bytes`].)
    pub fn validate(&self) -> Result<()> {
        check_f32_bytes(self.bytes, " per buffer")?;
        check_iters(self.iters)?;
        if self.ctas.contains(&0) {
            return Err(Error::Config { field: "ctas", why: "every CTA count of the sweep must be at least 1".into() });
        }
        if let Some(&c) = self.ctas.iter().find(|&&c| c as usize > abi::MAX_CTAS_PER_RANK) {
            return Err(Error::Config {
                field: "ctas",
                why: format!("{c} is above {} (the CTAs one launch of a rank may use)", abi::MAX_CTAS_PER_RANK),
            });
        }
        for (field, t, most) in [
            ("tma_threads_bulk", self.tma_threads_bulk, 1024),
            ("tma_threads_combine", self.tma_threads_combine, 1024),
            ("simt_threads", self.simt_threads, 512),
        ] {
            oxccl::config::check_threads(field, t, most)?;
        }
        if let Some(b) = self.chunk_bytes {
            oxccl::config::check_chunk_bytes("chunk_bytes", b)?;
        }
        if let Some(st) = self.stages {
            oxccl::config::check_stages("stages", st)?;
        }
        if let Split::Pieces(p) = self.split
            && p > 0
            && let Some(&most) = self.ctas.iter().max()
            && self.bytes.div_ceil(p) < most as u64
        {
            return Err(Error::Config {
                field: "split",
                why: format!(
                    "{p}-byte pieces cut {} B into {} pieces, fewer than the sweep's {most} CTAs (some would idle)",
                    self.bytes,
                    self.bytes.div_ceil(p)
                ),
            });
        }
        if let Split::Pieces(p) = self.split
            && (p == 0 || !p.is_multiple_of(16) || self.bytes.div_ceil(p) > MAX_SWEEP_PIECES)
        {
            return Err(Error::Config {
                field: "split",
                why: format!(
                    "{p} is not a positive multiple of 16 that cuts {} B into at most {MAX_SWEEP_PIECES} pieces",
                    self.bytes
                ),
            });
        }
        Ok(())
    }
}

/// The mover sweep: copy, reduce-add and reduce-into with the TMA and SIMT movers at each CTA count,
/// with `cuMemcpyDtoD` of the same size as the ceiling, `on_row` called as each row is measured
/// ([`SweepConfig::rows`] in all). Returns (memcpy GB/s, rows).
pub fn mover_sweep(
    stream: &Arc<CudaStream>,
    cfg: &SweepConfig,
    mut on_row: impl FnMut(&SweepRow),
) -> Result<(f64, Vec<SweepRow>)> {
    let bench = MoverBench::new(stream, cfg)?;
    let memcpy_gbps = memcpy_rate(stream, cfg.bytes as usize, cfg.warmup, cfg.iters)?;
    let mut rows = Vec::new();
    for op in SweepOp::ALL {
        for &ctas in &cfg.ctas {
            for mover in [Mover::Tma, Mover::Simt] {
                let case = bench.case(op, mover, ctas)?;
                let ms = case.time_ms(cfg.warmup, cfg.iters)?;
                let gbps = case.traffic_bytes() as f64 / (ms * 1e-3) / 1e9;
                let spec = case.spec();
                rows.push(SweepRow {
                    op: op.name(),
                    mover: mover.name(),
                    ctas,
                    threads: spec.threads,
                    registers: bench.registers(mover)?,
                    bytes: cfg.bytes,
                    chunk_bytes: if mover == Mover::Tma { spec.chunk_bytes } else { 0 },
                    stages: if mover == Mover::Tma { spec.stages } else { 0 },
                    ms,
                    gbps,
                    gbps_per_cta: gbps / ctas as f64,
                    of_memcpy: gbps / memcpy_gbps,
                    piece_bytes: case.piece_bytes(),
                });
                on_row(&rows[rows.len() - 1]);
            }
        }
    }
    bench.finish()?;
    Ok((memcpy_gbps, rows))
}

/// The mover sweep's device side on one GPU: the engine, a [`SweepConfig`] and three f32 buffers of
/// its size (rank 0's input `a` and output `dst`, rank 1's input `b`), so that each (operation,
/// mover, CTA count) is prepared once ([`MoverBench::case`]) and timed by whichever harness measures
/// it: the sweep's table ([`mover_sweep`]) or criterion (`benches/movers.rs`). The buffers hold
/// zeros: the sweep measures bandwidth; `tests/gpu_engine.rs` checks the movers' results. Dropping
/// it waits for its launches.
pub struct MoverBench {
    stream: Arc<CudaStream>,
    engine: Arc<Engine>,
    cfg: SweepConfig,
    buffers: [[u64; BUFFER_SLOTS]; MAX_RANKS],
    status: DeviceAlloc,
    // Owned so that the addresses in `buffers` stay valid for every launch.
    _memory: [CudaSlice<f32>; 3],
}

/// One prepared measurement of a [`MoverBench`]: the program uploaded for its CTA count and the
/// launch (mover, threads, TMA pipeline). Dropping it waits for its launches.
pub struct MoverCase<'a> {
    bench: &'a MoverBench,
    op: SweepOp,
    spec: LaunchSpec,
    piece_bytes: u64,
    prog: DeviceProgram,
}

impl MoverBench {
    /// Loads the kernels on `stream`'s GPU (or shares them, [`Engine::shared`]) and allocates the buffers (3 × `cfg.bytes`), after
    /// [`SweepConfig::validate`].
    pub fn new(stream: &Arc<CudaStream>, cfg: &SweepConfig) -> Result<Self> {
        cfg.validate()?;
        let engine = Engine::shared(stream.context())?;
        let n = (cfg.bytes / 4) as usize;
        let alloc = || stream.alloc_zeros::<f32>(n).map_err(Error::driver("cuMemAlloc"));
        let memory = [alloc()?, alloc()?, alloc()?];
        let mut buffers = [[0u64; BUFFER_SLOTS]; MAX_RANKS];
        buffers[0][slot::INPUT as usize] = memory[0].device_ptr(stream).0;
        buffers[1][slot::INPUT as usize] = memory[1].device_ptr(stream).0;
        buffers[0][slot::OUTPUT as usize] = memory[2].device_ptr(stream).0;
        let status = DeviceAlloc::zeroed(engine.context(), std::mem::size_of::<Status>())?;
        Ok(MoverBench { stream: stream.clone(), engine, cfg: cfg.clone(), buffers, status, _memory: memory })
    }

    /// Prepares `op` with `mover` on `ctas` CTAs as the bench's configuration shapes it (threads,
    /// pipeline, split).
    pub fn case(&self, op: SweepOp, mover: Mover, ctas: u32) -> Result<MoverCase<'_>> {
        let cfg = &self.cfg;
        let piece = cfg.split.piece(cfg.bytes, ctas);
        let l = sweep_program(op, cfg.bytes, ctas, piece);
        let prog = self.engine.upload(&l, 0..l.programs.len(), &self.stream)?;
        let (chunk, stages) = sweep_pipeline(&self.engine, cfg, op, l.slots);
        let threads = match (mover, op) {
            (Mover::Simt, _) => cfg.simt_threads,
            (Mover::Latency, _) => oxccl_kernels::abi::LATENCY_THREADS,
            (Mover::Tma, SweepOp::Copy | SweepOp::ReduceInto) => cfg.tma_threads_bulk,
            (Mover::Tma, SweepOp::ReduceAdd) => cfg.tma_threads_combine,
        };
        let spec = LaunchSpec {
            mover,
            dtype: DType::F32,
            op: ReduceOp::Sum,
            threads,
            chunk_bytes: chunk,
            stages,
            reduce_mode: if op == SweepOp::ReduceInto { ReduceMode::Tma } else { ReduceMode::Registers },
            timeout_ns: 10_000_000_000,
            wait_suspend_ns: 0,
            issuers: 1,
            combine_direct: false,
            call_key: 0,
            peer_scope: PeerScope::System,
            // The sweep measures the mover it names at every size.
            latency_below: 0,
        };
        Ok(MoverCase { bench: self, op, spec, piece_bytes: piece.unwrap_or(0), prog })
    }

    /// Registers per thread of `mover`'s f32-sum kernel (the one every row runs).
    pub fn registers(&self, mover: Mover) -> Result<u32> {
        Ok(self.engine.kernel_info(mover, DType::F32, ReduceOp::Sum)?.registers)
    }

    /// Waits for every launch and turns a device-side error (a wait that gave up, a bad task) into
    /// an `Err`.
    pub fn finish(&self) -> Result<()> {
        self.stream.synchronize().map_err(Error::driver("cuStreamSynchronize"))?;
        let st: Status = bytemuck::pod_read_unaligned(&self.status.read()?[..std::mem::size_of::<Status>()]);
        match Error::from_status(&st) {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

impl Drop for MoverBench {
    fn drop(&mut self) {
        // The status record and the module are freed without stream order: let the launches end.
        let _ = self.stream.synchronize();
    }
}

impl MoverCase<'_> {
    /// How it launches (mover, threads, TMA pipeline).
    pub fn spec(&self) -> &LaunchSpec {
        &self.spec
    }

    /// Bytes per piece dealt to the CTAs in turn (0: one contiguous range per CTA).
    pub fn piece_bytes(&self) -> u64 {
        self.piece_bytes
    }

    /// Bytes read plus written by one launch (what the sweep's GB/s count).
    pub fn traffic_bytes(&self) -> u64 {
        self.op.traffic() * self.bench.cfg.bytes
    }

    /// Queues one launch on the bench's stream (asynchronous; [`MoverBench::finish`] reports a
    /// device-side error).
    pub fn launch(&self) -> Result<()> {
        let b = self.bench;
        // SAFETY: the program was built by `b` for its own buffers, which hold `cfg.bytes` each (every
        // task lies inside them); the buffers, the status record and the program outlive every launch
        // (the slices are freed in stream order, and dropping the bench or this case first waits for
        // the stream); the program has no barriers; `status` is the bench's own record (device memory).
        unsafe { b.engine.launch(&b.stream, &self.prog, &self.spec, b.buffers, [0; MAX_RANKS], b.status.ptr()) }
    }

    /// Milliseconds per launch over `iters` launches after `warmup` untimed ones, by device events.
    pub fn time_ms(&self, warmup: usize, iters: usize) -> Result<f64> {
        time_ms(&self.bench.stream, warmup, iters, || self.launch())
    }
}

impl Drop for MoverCase<'_> {
    fn drop(&mut self) {
        // The program's tables are freed without stream order: let its launches end.
        let _ = self.bench.stream.synchronize();
    }
}

/// Most pieces [`Split::Pieces`] may cut the range into (one task each).
const MAX_SWEEP_PIECES: u64 = 1 << 20;

/// The sweep's TMA pipeline `(chunk, stages)` for `op`'s program with `slots` sources per stage: the
/// collectives' rule for what the configuration leaves open (the reduce-add stores its combine from
/// registers, as ReduceScatter does), except that a copy left wholly open takes
/// [`lone_copy_pipeline`]; and a configured chunk that `stages × slots` of would not fit the
/// device's shared memory cut to the largest 1 KiB multiple that does.
fn sweep_pipeline(engine: &Engine, cfg: &SweepConfig, op: SweepOp, slots: u32) -> (u32, u32) {
    let room = (engine.max_smem as usize).saturating_sub(abi::smem::STAGES);
    let (chunk, stages) = match (op, cfg.chunk_bytes, cfg.stages) {
        (SweepOp::ReduceAdd, ..) => oxccl::combining_pipeline(room, slots, cfg.chunk_bytes, cfg.stages),
        (SweepOp::Copy, None, None) => lone_copy_pipeline(room),
        _ => oxccl::auto_pipeline(room, slots, cfg.chunk_bytes, cfg.stages),
    };
    let fit = room / (stages.max(1) as usize * slots.max(1) as usize);
    (chunk.min((fit / 1024 * 1024).max(16) as u32), stages)
}

/// The ring of a copy that has the SM's shared memory to itself (the sweep's copy rows: one source,
/// one issuing warp, no other kernel beside it): [`auto_pipeline`](oxccl::auto_pipeline)'s 32 KiB
/// chunk, as many stages as fit (at most `MAX_STAGES`). The collectives keep 4 stages or fewer per
/// issuer so that other kernels keep room on the SM. Measured on an H200 (docs/PERF.md, 2026-12-01,
/// TMA copy GB/s per CTA at 1 / 16 / 32 CTAs): 32 KiB × 4 100.6 / 99.6 / 91.1 (SIMT 97.0 / 96.0 /
/// 91.7), × 6 100.9 / 100.3 / 97.3, × 7 100.7 / 100.5 / 98.2; at 132 CTAs all 90.2-90.7 % of
/// `cuMemcpyDtoD`. Deeper rings of bulk reductions lose at 32 CTAs (reduce-into 32 KiB × 7: 88.7
/// against 109 with × 4), so reduce-into keeps the collectives' rule.
fn lone_copy_pipeline(room: usize) -> (u32, u32) {
    let (chunk, _) = oxccl::auto_pipeline(room, 1, None, None);
    let stages = (room / chunk.max(1) as usize).clamp(1, abi::MAX_STAGES);
    (chunk, stages as u32)
}

/// Parameters of a collective benchmark (nccl-tests flags).
#[derive(Clone, Debug)]
pub struct CollectiveBench {
    /// The collective, with its root for Broadcast and Reduce (below `ranks`).
    pub collective: Collective,
    /// Element type.
    pub dtype: DType,
    /// Reduction operator (unused by AllGather and Broadcast).
    pub op: ReduceOp,
    /// Ranks: one per stream given to [`collective_bench`].
    pub ranks: usize,
    /// Sizes, repetitions and checks (every rank's result, each side).
    pub sweep: Sweep,
    /// nccl-tests' `-G`: 0 launches the calls one by one; N > 0 captures the `iters` timed calls
    /// in a CUDA graph and times N launches of it ([`time_graph_ms_on`]).
    pub graph_launches: usize,
    /// cudarc's event tracking off while the benchmark runs (always so with `graph_launches`).
    pub untracked: bool,
    /// The communicator's configuration (mover, reduction, CTAs, pipeline).
    pub config: Config,
}

/// One row of the nccl-tests table.
#[derive(Clone, Debug, serde::Serialize)]
pub struct CollectiveRow {
    /// The collective's name (`all_reduce`, `reduce_scatter`, `all_gather`, `broadcast`, `reduce`,
    /// and for transfer programs `all_to_all`).
    pub collective: &'static str,
    /// The root of Broadcast and Reduce; -1 for the others (nccl-tests' column).
    pub root: i64,
    /// Ranks taking part.
    pub ranks: usize,
    /// CTAs per rank.
    pub ctas: u32,
    /// `tma` or `simt`.
    pub mover: &'static str,
    /// `registers` or `tma` (the reduction path).
    pub reduction: &'static str,
    /// nccl-tests' size: bytes of the largest per-rank buffer (the sweep's size rounded down to what
    /// the call moves).
    pub size: u64,
    /// nccl-tests' count: elements per rank in the smallest buffer (a ReduceScatter's output, an
    /// AllGather's input).
    pub count: u64,
    /// nccl-tests' type: `float`, `half`, `bfloat16`, `int32`, `uint32`.
    pub dtype: &'static str,
    /// nccl-tests' redop: `sum`, `min`, `max`, or `none` where nothing is reduced.
    pub redop: &'static str,
    /// Out of place: microseconds per call (`None` where that side did not run, as a transfer
    /// program runs one side: `N/A` in the table, `null` in JSON, as are its bandwidths).
    pub oop_us: Option<f64>,
    /// Out of place: algbw, `size` bytes per second / 1e9.
    pub oop_algbw: Option<f64>,
    /// Out of place: busbw, algbw times the collective's bus factor.
    pub oop_busbw: Option<f64>,
    /// Out of place: elements that differ from the expected result (`None`: not checked; `null` in
    /// JSON).
    pub oop_wrong: Option<u64>,
    /// In place: microseconds per call (`None` where that side did not run).
    pub ip_us: Option<f64>,
    /// In place: algbw, `size` bytes per second / 1e9.
    pub ip_algbw: Option<f64>,
    /// In place: busbw, algbw times the collective's bus factor.
    pub ip_busbw: Option<f64>,
    /// In place: elements that differ from the expected result (`None`: not checked; `null` in JSON).
    pub ip_wrong: Option<u64>,
}

/// A value every rank can compute for element `i` of rank `r`: small integers (1 to 9), exact in every
/// dtype and under any summation order (sums over 16 ranks stay within bf16's exact 256). Positive, so
/// a sum over two or more ranks differs from each rank's input: an element an in-place call leaves
/// unwritten shows (under min and max it shows unless its rank holds the extreme).
fn pattern(r: usize, i: u64) -> i32 {
    ((r as u64 * 7 + i * 13) % 17) as i32 / 2 + 1
}

/// The byte every output starts as before a check: 0x7F in every byte is NaN in f16 and FP8, about
/// 3.4e38 in f32 and bf16, 2139062143 in i32 and u32 and as large in the 8-byte types, none of
/// which [`pattern`]'s results reach, so an element a call leaves unwritten counts as wrong. (In
/// the 1-byte integer types 127 is a possible sum: there an unwritten element may pass.)
const POISON: u8 = 0x7F;

/// Fills `buf` with [`POISON`] on `stream`.
fn poison(stream: &Arc<CudaStream>, buf: &mut CudaSlice<u8>) -> Result<()> {
    oxccl::engine::bind(stream.context())?;
    let n = buf.len();
    let (ptr, _record) = buf.device_ptr_mut(stream);
    // SAFETY: `ptr` is `buf`'s live allocation of `n` bytes, written on `stream`, which cudarc's event
    // records order after the buffer's earlier uses.
    unsafe { cudarc::driver::result::memset_d8_async(ptr, POISON, n, stream.cu_stream()) }
        .map_err(Error::driver("cuMemsetD8Async"))
}

/// `n` elements `f(0), f(1), …` encoded as `dtype` (little-endian bytes).
fn encode_all(dtype: DType, n: u64, f: impl Fn(u64) -> i32) -> Vec<u8> {
    fn typed<T: bytemuck::Pod>(n: u64, f: impl Fn(u64) -> T) -> Vec<u8> {
        let v: Vec<T> = (0..n).map(f).collect();
        bytemuck::cast_slice(&v).to_vec()
    }
    match dtype {
        DType::F32 => typed(n, |i| f(i) as f32),
        DType::F16 => typed(n, |i| half::f16::from_f32(f(i) as f32)),
        DType::Bf16 => typed(n, |i| half::bf16::from_f32(f(i) as f32)),
        DType::I32 => typed(n, &f),
        DType::U32 => typed(n, |i| f(i).unsigned_abs()),
        DType::U8 => typed(n, |i| f(i).unsigned_abs() as u8),
        DType::I8 => typed(n, |i| f(i) as i8),
        DType::F64 => typed(n, |i| f(i) as f64),
        DType::I64 => typed(n, |i| f(i) as i64),
        DType::U64 => typed(n, |i| f(i).unsigned_abs() as u64),
        DType::F8e4m3 => typed(n, |i| oxccl::F8E4M3::from_f32(f(i) as f32)),
        DType::F8e5m2 => typed(n, |i| oxccl::F8E5M2::from_f32(f(i) as f32)),
    }
}

/// As [`encode_with`] for an `f` of period 17 (`f(i + 17) == f(i)`, as [`Expected`]'s values are):
/// one period is encoded and the bytes repeated, so multi-GiB buffers take memory-copy time.
#[cfg(test)]
fn encode_periodic_with(dtype: DType, n: u64, f: impl Fn(u64) -> Enc) -> Vec<u8> {
    let period = encode_with(dtype, n.min(17), f);
    let total = n as usize * dtype.size();
    let mut v = Vec::with_capacity(total);
    v.extend_from_slice(&period);
    while v.len() < total {
        let more = v.len().min(total - v.len());
        v.extend_from_within(..more);
    }
    v
}

/// One element's bytes (its first `dtype.size()` bytes).
type Enc = [u8; 8];

/// `v` as one element of `dtype` (u32: its magnitude), as [`encode_all`] writes it.
fn enc(dtype: DType, v: i32) -> Enc {
    let mut e = [0; 8];
    let bytes = encode_all(dtype, 1, |_| v);
    e[..bytes.len()].copy_from_slice(&bytes);
    e
}

/// `n` elements `f(0), f(1), …` given as their bytes.
fn encode_with(dtype: DType, n: u64, f: impl Fn(u64) -> Enc) -> Vec<u8> {
    let e = dtype.size();
    let mut v = Vec::with_capacity(n as usize * e);
    for i in 0..n {
        v.extend_from_slice(&f(i)[..e]);
    }
    v
}

/// `op` over `vals` (in rank order) as the device computes it, the engine's finishing step included
/// (Avg's division by the number of values).
fn reduce_enc(op: ReduceOp, dtype: DType, vals: impl Iterator<Item = i32>) -> Enc {
    let e = dtype.size();
    let (mut acc, mut n) = (Vec::new(), 0u32);
    for v in vals {
        let x = enc(dtype, v);
        if acc.is_empty() {
            acc = x[..e].to_vec();
        } else {
            oxccl::host::lowered::combine_into(dtype, op, &mut acc, &x[..e]);
        }
        n += 1;
    }
    oxccl::host::lowered::finish_into(dtype, op, &mut acc, n);
    let mut out = [0; 8];
    out[..acc.len()].copy_from_slice(&acc);
    out
}

/// The result element `i` of rank `r` must hold, for inputs made by [`pattern`].
struct Expected {
    collective: Collective,
    dtype: DType,
    count: u64,
    /// `pattern` has period 17 in the element index: its reduction over ranks is a 17-entry table.
    reduced: Vec<Enc>,
}

impl Expected {
    fn new(collective: Collective, dtype: DType, op: ReduceOp, ranks: usize, count: u64) -> Self {
        let reduced = (0..17).map(|m| reduce_enc(op, dtype, (0..ranks).map(|q| pattern(q, m)))).collect();
        Expected { collective, dtype, count, reduced }
    }

    fn value(&self, r: usize, i: u64) -> Enc {
        match self.collective {
            Collective::AllReduce => self.reduced[(i % 17) as usize],
            Collective::ReduceScatter => self.reduced[((r as u64 * self.count + i) % 17) as usize],
            Collective::AllGather => {
                let (q, j) = ((i / self.count.max(1)) as usize, i % self.count.max(1));
                enc(self.dtype, pattern(q, j))
            }
            Collective::Broadcast { root } => enc(self.dtype, pattern(root as usize, i)),
            // Block q is block r of rank q's input.
            Collective::AllToAll => {
                let (q, j) = ((i / self.count.max(1)) as usize, i % self.count.max(1));
                enc(self.dtype, pattern(q, r as u64 * self.count + j))
            }
            // Off the root only an in-place buffer exists, left as it was: the rank's input.
            Collective::Reduce { root } if r != root as usize => enc(self.dtype, pattern(r, i)),
            Collective::Reduce { .. } => self.reduced[(i % 17) as usize],
        }
    }

    /// Elements `start..start + n` of rank `r`'s result, encoded (period by period: see
    /// [`encode_periodic_with`]).
    #[cfg(test)]
    fn encode_range(&self, r: usize, start: u64, n: u64) -> Vec<u8> {
        if !self.blockwise() {
            return encode_periodic_with(self.dtype, n, |i| self.value(r, start + i));
        }
        // AllGather and AllToAll: block q comes from rank q, periodic within the block.
        let mut v = Vec::with_capacity(n as usize * self.dtype.size());
        let (mut at, end) = (start, start + n);
        while at < end {
            let len = ((at / self.count + 1) * self.count).min(end) - at;
            v.extend(encode_periodic_with(self.dtype, len, |j| self.value(r, at + j)));
            at += len;
        }
        v
    }
}

/// Elements per cyclic unit of [`Expected::count_wrong_range`] (a multiple of the period 17).
const UNIT_ELEMS: u64 = 17 * 4096;

impl Expected {
    /// Elements of `got` (elements `start..` of rank `r`'s result) that differ from the expected
    /// values, compared against a small encoded unit repeated in place: no allocation per element
    /// range, so multi-GiB results check at memory-compare speed.
    fn count_wrong_range(&self, r: usize, start: u64, got: &[u8]) -> u64 {
        let e = self.dtype.size();
        let n = (got.len() / e) as u64;
        let mut wrong = 0;
        let (mut at, end) = (start, start + n);
        while at < end {
            // A segment over which the expected values repeat every 17 elements from `base`.
            let (base, seg_end) = if self.blockwise() {
                let q = at / self.count;
                (q * self.count, ((q + 1) * self.count).min(end))
            } else {
                (0, end)
            };
            let unit = encode_with(self.dtype, UNIT_ELEMS, |k| self.periodic(r, base, k));
            let mut x = at;
            while x < seg_end {
                let phase = (x - base) % UNIT_ELEMS;
                let len = (UNIT_ELEMS - phase).min(seg_end - x);
                let g = &got[((x - start) as usize) * e..((x - start + len) as usize) * e];
                wrong += count_wrong(g, &unit[phase as usize * e..(phase + len) as usize * e], e);
                x += len;
            }
            at = seg_end;
        }
        wrong
    }

    /// Element `base + k` of rank `r`'s result for any `k`, where `base` starts a segment of
    /// [`Expected::count_wrong_range`] (AllGather: a block).
    fn periodic(&self, r: usize, base: u64, k: u64) -> Enc {
        match self.collective {
            Collective::AllGather if self.count > 0 => enc(self.dtype, pattern((base / self.count) as usize, k)),
            Collective::AllToAll if self.count > 0 => {
                enc(self.dtype, pattern((base / self.count) as usize, r as u64 * self.count + k))
            }
            _ => self.value(r, base + k),
        }
    }

    /// Whether the result is periodic only within each rank's block (AllGather, AllToAll).
    fn blockwise(&self) -> bool {
        matches!(self.collective, Collective::AllGather | Collective::AllToAll) && self.count > 0
    }
}

/// Bytes per piece when results are read back for checking.
const CHECK_PIECE: usize = 64 << 20;

/// Read-back staging for a check (none where nothing is checked): one pinned buffer of
/// [`CHECK_PIECE`] bytes per device of `streams`, keyed by ordinal (each read waits for its copy, so
/// the ranks of a device share it).
fn check_staging(
    streams: &[Arc<CudaStream>],
    check: bool,
) -> Result<Vec<(usize, cudarc::driver::PinnedHostSlice<u8>)>> {
    let mut staging: Vec<(usize, cudarc::driver::PinnedHostSlice<u8>)> = Vec::new();
    for s in streams.iter().filter(|_| check) {
        let ordinal = s.context().ordinal();
        if !staging.iter().any(|(o, _)| *o == ordinal) {
            // SAFETY: pinned host memory (flags 0: cached, readable by the host at full speed),
            // written by a device copy before every read.
            let pinned = unsafe { s.context().alloc_pinned_with_flags::<u8>(CHECK_PIECE, 0) }
                .map_err(Error::driver("cuMemHostAlloc"))?;
            staging.push((ordinal, pinned));
        }
    }
    Ok(staging)
}

/// Writes `n` elements `f(0), f(1), …` (period 17, as [`pattern`]) into `buf` from byte `at`: one
/// period-aligned block is uploaded and doubled in place on the device, so multi-GiB buffers fill
/// at device-copy speed.
fn fill_periodic(
    stream: &Arc<CudaStream>,
    buf: &mut CudaSlice<u8>,
    at: usize,
    dtype: DType,
    n: u64,
    f: impl Fn(u64) -> i32,
) -> Result<()> {
    assert!(at + n as usize * dtype.size() <= buf.len(), "fill past the buffer");
    let (base, _record) = buf.device_ptr_mut(stream);
    // SAFETY: the range lies inside `buf` (checked above), whose pending work `stream` waits for
    // (the guard records this use when it drops, after the copies are queued).
    unsafe { fill_periodic_at(stream, base + at as u64, dtype, n, f) }
}

/// [`fill_periodic`] at a device address.
///
/// # Safety
/// `ptr..ptr + n × dtype.size()` is device memory of `stream`'s context that nothing else uses until
/// the copies queued on `stream` complete.
unsafe fn fill_periodic_at(
    stream: &Arc<CudaStream>,
    ptr: u64,
    dtype: DType,
    n: u64,
    f: impl Fn(u64) -> i32,
) -> Result<()> {
    let total = n as usize * dtype.size();
    if total == 0 {
        return Ok(());
    }
    let unit = encode_all(dtype, n.min(17 << 16), f);
    // The raw copies below run in the current context: make it the stream's.
    oxccl::engine::bind(stream.context())?;
    // SAFETY: `unit` is no longer than the range (the caller's); from pageable memory the copy has
    // taken the bytes when it returns, so `unit` may be dropped after it.
    unsafe { cudarc::driver::result::memcpy_htod_async(ptr, &unit, stream.cu_stream()) }
        .map_err(Error::driver("cuMemcpyHtoDAsync"))?;
    let mut filled = unit.len();
    while filled < total {
        let len = filled.min(total - filled);
        // SAFETY: both ranges lie inside the caller's range and do not overlap; the copy is queued
        // on `stream` after the upload, in the range's context (bound above).
        unsafe { cudarc::driver::result::memcpy_dtod_async(ptr + filled as u64, ptr, len, stream.cu_stream()) }
            .map_err(Error::driver("cuMemcpyDtoDAsync"))?;
        filled += len;
    }
    Ok(())
}

/// Elements `0..n` of `buf` from byte `at` that differ from rank `r`'s expected result, read back in
/// pieces through `staging` (pinned).
fn count_wrong_on_device(
    stream: &Arc<CudaStream>,
    buf: &CudaSlice<u8>,
    at: usize,
    n: u64,
    expected: &Expected,
    r: usize,
    staging: &mut cudarc::driver::PinnedHostSlice<u8>,
) -> Result<u64> {
    let bytes = n as usize * expected.dtype.size();
    let view = buf.slice(at..at + bytes);
    let (ptr, _record) = view.device_ptr(stream);
    // SAFETY: the range lies inside `buf` (the slice above checks it), whose pending writes `stream`
    // waits for.
    unsafe { count_wrong_at(stream, ptr, n, expected, r, 0, staging) }
}

/// Elements of the `n` at device address `ptr` that differ from elements `first..first + n` of rank
/// `r`'s expected result, read back in pieces through `staging` (pinned).
///
/// # Safety
/// `ptr..ptr + n × element size` is device memory of `stream`'s context whose writes are complete
/// or queued on `stream`.
unsafe fn count_wrong_at(
    stream: &Arc<CudaStream>,
    ptr: u64,
    n: u64,
    expected: &Expected,
    r: usize,
    first: u64,
    staging: &mut cudarc::driver::PinnedHostSlice<u8>,
) -> Result<u64> {
    let e = expected.dtype.size();
    let piece = (staging.len() / e) as u64;
    oxccl::engine::bind(stream.context())?;
    let mut wrong = 0;
    let mut start = 0;
    while start < n {
        let len = piece.min(n - start);
        let bytes = len as usize * e;
        // Into pinned memory the copy is asynchronous: wait for the stream before reading.
        let host = &mut staging.as_mut_slice().map_err(Error::driver("cuEventSynchronize"))?[..bytes];
        // SAFETY: the piece lies inside the caller's range; `host` holds exactly its bytes and is read
        // only after the stream is synchronised. Where that synchronisation fails, the stream holds
        // an error that stops its queued work (a trap or fault is sticky), so the copy does not
        // land in `staging` after an early return frees it.
        unsafe { cudarc::driver::result::memcpy_dtoh_async(host, ptr + start * e as u64, stream.cu_stream()) }
            .map_err(Error::driver("cuMemcpyDtoHAsync"))?;
        stream.synchronize().map_err(Error::driver("cuStreamSynchronize"))?;
        wrong += expected.count_wrong_range(r, first + start, host);
        start += len;
    }
    Ok(wrong)
}

/// Elements of `got` that differ from `want` (same dtype, same length).
fn count_wrong(got: &[u8], want: &[u8], elem: usize) -> u64 {
    if got == want {
        return 0;
    }
    got.chunks_exact(elem).zip(want.chunks_exact(elem)).filter(|(a, b)| a != b).count() as u64
}

/// Refuses a measurement of no timed iteration.
fn check_iters(iters: usize) -> Result<()> {
    if iters == 0 {
        return Err(Error::Config { field: "iters", why: "at least one timed iteration".into() });
    }
    Ok(())
}

/// Refuses a size of f32 buffers (`per`: what it is the size of, e.g. " per rank") that holds no
/// element or a partial one.
fn check_f32_bytes(bytes: u64, per: &str) -> Result<()> {
    if bytes == 0 || !bytes.is_multiple_of(4) {
        return Err(Error::Config {
            field: "bytes",
            why: format!("{bytes} B{per}: the buffers are of f32, give a positive multiple of 4 bytes"),
        });
    }
    Ok(())
}

/// The sizes and repetitions of a benchmark's sweep, nccl-tests' `-b -e -f -n -w -c`.
#[derive(Clone, Copy, Debug)]
pub struct Sweep {
    /// Smallest size in bytes, `-b`: the larger per-rank buffer (at least one element).
    pub min_bytes: u64,
    /// Largest size in bytes, `-e`: no size above it runs.
    pub max_bytes: u64,
    /// Factor from one size to the next, `-f` (at least 2).
    pub factor: u64,
    /// Timed calls per size (and side), `-n` (at least 1; in a graph, the calls captured); the time
    /// is their mean.
    pub iters: usize,
    /// Untimed calls before the timed ones, `-w`.
    pub warmup: usize,
    /// Check the results of a separate untimed call per size (and side), `-c`; unchecked rows
    /// report `#wrong` as `N/A`.
    pub check: bool,
}

impl Sweep {
    /// The sweep as nccl-tests takes it, for elements of `elem_bytes` bytes: `min <= max`, both at
    /// least one element (a smaller size would run as one element, not as asked), a factor of at
    /// least 2 (a smaller one would never reach `max`), at least one timed iteration. Every
    /// benchmark checks these before it allocates anything.
    pub fn validate(&self, elem_bytes: u64) -> Result<()> {
        let Sweep { min_bytes, max_bytes, factor, .. } = *self;
        let bad = |field, why: String| Err(Error::Config { field, why });
        if min_bytes > max_bytes {
            return bad(
                "min_bytes",
                format!("{min_bytes} B is above the largest size ({max_bytes} B): no size to run"),
            );
        }
        if max_bytes < elem_bytes {
            return bad("max_bytes", format!("{max_bytes} B holds no {elem_bytes}-byte element: no size to run"));
        }
        if min_bytes < elem_bytes {
            return bad(
                "min_bytes",
                format!("{min_bytes} B holds no {elem_bytes}-byte element: the smallest size is {elem_bytes} B"),
            );
        }
        if factor < 2 {
            return bad("factor", format!("{factor}: sizes grow by a factor of at least 2"));
        }
        check_iters(self.iters)
    }

    /// The sizes of a sweep [`Sweep::validate`] accepted: `min_bytes`, then each `factor` times the
    /// last, up to `max_bytes` (ending early where the next would overflow).
    pub fn sizes(&self) -> impl Iterator<Item = u64> + use<> {
        let Sweep { min_bytes, max_bytes, factor, .. } = *self;
        std::iter::successors(Some(min_bytes), move |&s| s.checked_mul(factor)).take_while(move |&s| s <= max_bytes)
    }
}

/// nccl-tests' element count per rank for a row of `size` bytes (the larger per-rank buffer) of
/// `elem_bytes`-byte elements over `ranks` ranks: the count in the smaller buffer, for ReduceScatter
/// and AllGather rounded down to whole 16-byte blocks as nccl-tests rounds it (`(count / nranks) &
/// -(16 / eltSize)`), so both tools run the same calls at any rank count.
pub fn nccl_count(collective: Collective, size: u64, elem_bytes: u64, ranks: usize) -> u64 {
    let total = size / elem_bytes;
    match collective {
        Collective::AllReduce | Collective::Broadcast { .. } | Collective::Reduce { .. } => total,
        Collective::ReduceScatter | Collective::AllGather | Collective::AllToAll => {
            let block = (16 / elem_bytes).max(1);
            total / ranks.max(1) as u64 / block * block
        }
    }
}

/// Where `OXCCL_DEBUG=phases` keeps phase times ([`oxccl::engine::Engine::phase_times`]): prints,
/// for each rank of `ranks`, where its calls since its records were reset (the timed ones) spent
/// their time on average over its CTAs, to stderr; does nothing otherwise.
pub fn print_phases(engine: &oxccl::engine::Engine, ranks: &[usize], size: u64) -> Result<()> {
    let Some(now) = engine.phase_times()? else { return Ok(()) };
    for &r in ranks {
        let mine: Vec<_> = now.iter().filter(|(q, ..)| *q == r).map(|x| x.2).collect();
        let calls: u64 = mine.iter().map(|t| t.calls).sum();
        if calls == 0 {
            continue;
        }
        let mean =
            |f: fn(&oxccl::engine::PhaseTimes) -> u64| mine.iter().map(f).sum::<u64>() as f64 / calls as f64 / 1e3;
        let longest = |f: fn(&oxccl::engine::PhaseTimes) -> u64| mine.iter().map(f).max().unwrap_or(0) as f64 / 1e3;
        eprintln!(
            "phases {size} B rank {r}: {} calls x {} CTAs; per call: gap {:.2} us, start barrier {:.2}, tasks {:.2}, \
             drain {:.2}, end barrier {:.2} (longest gap {:.1})",
            calls / mine.len() as u64,
            mine.len(),
            mean(|t| t.gap_ns),
            mean(|t| t.start_ns),
            mean(|t| t.tasks_ns),
            mean(|t| t.drain_ns),
            mean(|t| t.end_ns),
            longest(|t| t.max_gap_ns)
        );
    }
    Ok(())
}

/// Runs the benchmark with rank `r` on `streams[r]` (the same stream for virtual ranks launched
/// together, or one stream per GPU), one row per size. Each rank's buffers live on its stream's GPU.
pub fn collective_bench(
    streams: &[Arc<CudaStream>],
    b: &CollectiveBench,
    mut on_row: impl FnMut(&CollectiveRow),
) -> Result<Vec<CollectiveRow>> {
    // The parameters first: they need no stream.
    b.sweep.validate(b.dtype.size() as u64)?;
    if let Some(root) = b.collective.root()
        && root >= b.ranks
    {
        return Err(Error::NoSuchRank { rank: root, ranks: b.ranks });
    }
    if streams.len() != b.ranks {
        return Err(Error::BufferCount { what: "rank streams", expected: b.ranks, got: streams.len() });
    }
    let comm = Communicator::from_streams(streams, b.config.clone())?;
    // In graph mode the buffers are made without cudarc's event tracking (a capture cannot wait on
    // events recorded before it); each is written on its rank's stream and every stream is
    // synchronised before the calls, which meet at device barriers.
    let _untracked = (b.graph_launches > 0 || b.untracked).then(|| Untracked::new(streams));
    let p = b.ranks;
    let mut staging = check_staging(streams, b.sweep.check)?;
    let e = b.dtype.size() as u64;
    let mut rows = Vec::new();
    for size in b.sweep.sizes() {
        let count = nccl_count(b.collective, size, e, p);
        let spec = PlanSpec {
            collective: b.collective,
            count,
            dtype: b.dtype,
            op: b.op,
            ranks: p,
            in_place: false,
            ctas: comm.ctas_per_rank(),
            reduction: b.config.reduction,
        };
        let (in_bytes, out_bytes) = spec.buffer_bytes();
        // The row's size is what the call moves, as nccl-tests prints it: the larger buffer per rank,
        // `size` rounded down to whole elements (and, for ReduceScatter and AllGather, to whole
        // 16-byte blocks per rank).
        let moved = in_bytes.max(out_bytes);
        let expected = Expected::new(b.collective, b.dtype, b.op, p, count);
        let mut times = [0f64; 2];
        let mut wrong = [0u64; 2];
        for (k, in_place) in [false, true].into_iter().enumerate() {
            if in_place && !b.collective.has_in_place() {
                continue;
            }
            // Each rank's buffers; out of place only those it has (a Broadcast's input and a Reduce's
            // output on the root alone). `recv_ranks[i]`: the rank of `recv[i]`.
            let spec = PlanSpec { in_place, ..spec };
            let mut send: Vec<CudaSlice<u8>> = Vec::new();
            let mut recv: Vec<CudaSlice<u8>> = Vec::new();
            let mut recv_ranks = Vec::new();
            let zeros =
                |s: &Arc<CudaStream>, n: u64| s.alloc_zeros::<u8>(n as usize).map_err(Error::driver("cuMemAlloc"));
            for (r, stream) in streams.iter().enumerate() {
                let input = |i| pattern(r, i);
                let (has_in, has_out) = spec.rank_buffers(r);
                if in_place {
                    // Poisoned where the input does not reach (the other ranks' blocks of an AllGather,
                    // the whole buffer of a Broadcast's other ranks, whose input nothing reads: nccl-tests
                    // zeroes those), so an element the call leaves unwritten counts as wrong.
                    let mut buf = zeros(stream, in_bytes.max(out_bytes))?;
                    poison(stream, &mut buf)?;
                    let at = if b.collective == Collective::AllGather { r * in_bytes as usize } else { 0 };
                    if !matches!(b.collective, Collective::Broadcast { root } if root as usize != r) {
                        fill_periodic(stream, &mut buf, at, b.dtype, in_bytes / e, input)?;
                    }
                    recv.push(buf);
                    recv_ranks.push(r);
                } else {
                    if has_in {
                        let mut buf = zeros(stream, in_bytes)?;
                        fill_periodic(stream, &mut buf, 0, b.dtype, in_bytes / e, input)?;
                        send.push(buf);
                    }
                    if has_out {
                        let mut buf = zeros(stream, out_bytes)?;
                        poison(stream, &mut buf)?;
                        recv.push(buf);
                        recv_ranks.push(r);
                    }
                }
            }
            // Dropped before the buffers (declared after them): on any return from here, every
            // stream's work ends before they are freed, also the calls of peers on other GPUs,
            // which cudarc's per-stream ordering does not see.
            let _drained = Drained(streams);
            // The uploads run on the ranks' streams; a rank's launch must not start before another
            // rank's buffers are written.
            for s in streams {
                s.synchronize().map_err(Error::driver("cuStreamSynchronize"))?;
            }
            let call = |recv: &mut Vec<CudaSlice<u8>>, send: &Vec<CudaSlice<u8>>| -> Result<()> {
                macro_rules! go {
                    ($t:ty) => {{
                        // SAFETY: byte buffers reinterpreted as whole elements of their dtype (lengths are
                        // multiples of the element size; cudarc allocations are 256-byte aligned).
                        let s: Vec<CudaView<$t>> =
                            send.iter().map(|x| unsafe { x.transmute::<$t>(x.len() / e as usize) }.unwrap()).collect();
                        let mut d: Vec<CudaViewMut<$t>> = recv
                            .iter_mut()
                            .map(|x| {
                                let n = x.len() / e as usize;
                                // SAFETY: as for the send views above.
                                unsafe { x.transmute_mut::<$t>(n) }.unwrap()
                            })
                            .collect();
                        match (b.collective, in_place) {
                            (Collective::AllReduce, false) => comm.all_reduce(&s, &mut d, b.op),
                            (Collective::AllReduce, true) => comm.all_reduce_in_place(&mut d, b.op),
                            (Collective::ReduceScatter, false) => comm.reduce_scatter(&s, &mut d, b.op),
                            (Collective::ReduceScatter, true) => comm.reduce_scatter_in_place(&mut d, b.op),
                            (Collective::AllGather, false) => comm.all_gather(&s, &mut d),
                            (Collective::AllGather, true) => comm.all_gather_in_place(&mut d),
                            // Out of place the root's buffer is the only send (Broadcast) or receive
                            // (Reduce) buffer.
                            (Collective::Broadcast { root }, false) => comm.broadcast(&s[0], &mut d, root as usize),
                            (Collective::Broadcast { root }, true) => comm.broadcast_in_place(&mut d, root as usize),
                            (Collective::Reduce { root }, false) => comm.reduce(&s, &mut d[0], b.op, root as usize),
                            (Collective::Reduce { root }, true) => comm.reduce_in_place(&mut d, b.op, root as usize),
                            // Out of place only (the in-place pass is skipped).
                            (Collective::AllToAll, _) => comm.all_to_all(&s, &mut d),
                        }
                    }};
                }
                oxccl::with_element!(b.dtype, |T| go!(T))
            };
            // The wrong elements of every rank's output, read back after the calls queued so far.
            let check = |recv: &Vec<CudaSlice<u8>>, staging: &mut Vec<(usize, cudarc::driver::PinnedHostSlice<u8>)>| {
                comm.synchronize()?;
                // One thread per device (each with its staging buffer), its ranks one after another.
                let recv_ranks = &recv_ranks;
                let expected = &expected;
                let per_device = std::thread::scope(|scope| {
                    let workers: Vec<_> = staging
                        .iter_mut()
                        .map(|(ordinal, stage)| {
                            let ordinal = *ordinal;
                            scope.spawn(move || -> Result<u64> {
                                let mut wrong = 0;
                                for (&r, buf) in recv_ranks.iter().zip(recv) {
                                    if streams[r].context().ordinal() != ordinal {
                                        continue;
                                    }
                                    let (base, n) = match (b.collective, in_place) {
                                        (Collective::ReduceScatter, true) => (r as u64 * count, count),
                                        _ => (0, out_bytes / e),
                                    };
                                    let at = (base * e) as usize;
                                    wrong += count_wrong_on_device(&streams[r], buf, at, n, expected, r, stage)?;
                                }
                                Ok(wrong)
                            })
                        })
                        .collect();
                    workers.into_iter().map(|w| w.join().expect("check thread")).collect::<Vec<Result<u64>>>()
                });
                per_device.into_iter().sum::<Result<u64>>()
            };
            // The plan is built and uploaded before anything is timed, whatever the warm-up (`-w 0`).
            let count = usize::try_from(count).map_err(|_| Error::Config {
                field: "size",
                why: format!("{count} elements per rank do not fit this host's usize"),
            })?;
            oxccl::with_element!(b.dtype, |T| comm.prepare::<T>(b.collective, count, b.op, in_place))?;
            // Correctness pass (untimed) on fresh data.
            if b.sweep.check {
                call(&mut recv, &send)?;
                wrong[k] += check(&recv, &mut staging)?;
            }
            times[k] = if b.graph_launches > 0 {
                // The plan is built (and the warm-up run) outside the capture.
                for _ in 0..b.sweep.warmup.max(1) {
                    call(&mut recv, &send)?;
                }
                comm.synchronize()?;
                // Out of place the outputs are poisoned first and checked after the graph, so the
                // row's `#wrong` also covers what the graph computed (in place each call changes
                // its data: checked before only).
                let recheck = b.sweep.check && !in_place;
                if recheck {
                    for (buf, &r) in recv.iter_mut().zip(&recv_ranks) {
                        poison(&streams[r], buf)?;
                    }
                    for s in streams {
                        s.synchronize().map_err(Error::driver("cuStreamSynchronize"))?;
                    }
                }
                let ms = time_graph_ms_on(streams, b.sweep.iters, b.graph_launches, || call(&mut recv, &send))?;
                if recheck {
                    wrong[k] += check(&recv, &mut staging)?;
                }
                ms
            } else {
                // The phase times count the warm-up and timed calls only.
                for (r, stream) in streams.iter().enumerate() {
                    comm.engine(r)?.reset_phase_times(r, stream)?;
                }
                time_ms_on(streams, b.sweep.warmup, b.sweep.iters, || call(&mut recv, &send))?
            } * 1e3;
            comm.synchronize()?;
            if k == 0 {
                for r in 0..p {
                    print_phases(comm.engine(r)?, &[r], size)?;
                }
            }
        }
        let row = CollectiveRow::of(b, comm.ctas_per_rank(), moved, count, times, wrong);
        on_row(&row);
        rows.push(row);
    }
    Ok(rows)
}

impl CollectiveRow {
    /// The row of benchmark `b` at one size: `moved` bytes per rank (nccl-tests' size), `count`
    /// elements in the smaller buffer, microseconds per call and wrong elements out of place and in
    /// place.
    pub(crate) fn of(b: &CollectiveBench, ctas: u32, moved: u64, count: u64, us: [f64; 2], wrong: [u64; 2]) -> Self {
        let bw = |us: f64| moved as f64 / (us * 1e-6) / 1e9;
        let factor = b.collective.bus_factor(b.ranks);
        let ip = b.collective.has_in_place();
        CollectiveRow {
            collective: b.collective.name(),
            root: b.collective.root().map_or(-1, |r| r as i64),
            ranks: b.ranks,
            ctas,
            mover: ran_on(b, count, ctas),
            reduction: if b.config.reduction == Reduction::Tma { "tma" } else { "registers" },
            size: moved,
            count,
            dtype: b.dtype.nccl_name(),
            // nccl-tests: "none" where nothing is reduced (AllGather, Broadcast).
            redop: if b.collective.reduces() { b.op.nccl_name() } else { "none" },
            oop_us: Some(us[0]),
            oop_algbw: Some(bw(us[0])),
            oop_busbw: Some(bw(us[0]) * factor),
            oop_wrong: b.sweep.check.then_some(wrong[0]),
            // Collectives without an in-place form print "N/A" there, as nccl-tests' AllToAll.
            ip_us: ip.then_some(us[1]),
            ip_algbw: ip.then(|| bw(us[1])),
            ip_busbw: ip.then(|| bw(us[1]) * factor),
            ip_wrong: (ip && b.sweep.check).then_some(wrong[1]),
        }
    }
}

/// Waits for every one of its streams when dropped (errors ignored: a failed wait means the stream
/// runs nothing more).
struct Drained<'a>(&'a [Arc<CudaStream>]);

impl Drop for Drained<'_> {
    fn drop(&mut self) {
        for s in self.0 {
            let _ = s.synchronize();
        }
    }
}

/// Event tracking off on the contexts of some streams while it lives (graph-mode benchmarks), as
/// it was when dropped. Meanwhile cudarc orders no slice of those contexts across streams, also
/// other threads' slices.
pub(crate) struct Untracked(Vec<(Arc<cudarc::driver::CudaContext>, bool)>);

impl Untracked {
    pub(crate) fn new(streams: &[Arc<CudaStream>]) -> Untracked {
        let mut ctxs: Vec<(Arc<cudarc::driver::CudaContext>, bool)> = Vec::new();
        for s in streams {
            if !ctxs.iter().any(|(c, _)| Arc::ptr_eq(c, s.context())) {
                let was = s.context().is_event_tracking();
                // SAFETY: the benchmark's buffers made meanwhile are used by the calls of one size
                // and side, and every stream's work ends before they drop (`Drained` in
                // `collective_bench`, on every return; in `rank_bench` each rank's buffers are
                // used on its own stream only, which orders their stream-ordered free after them).
                unsafe { s.context().disable_event_tracking() };
                ctxs.push((s.context().clone(), was));
            }
        }
        Untracked(ctxs)
    }
}

impl Drop for Untracked {
    fn drop(&mut self) {
        for (c, was) in &self.0 {
            if *was {
                // SAFETY: puts back what the context had before the benchmark.
                unsafe { c.enable_event_tracking() };
            }
        }
    }
}

/// Parameters of a transfer-program benchmark (`oxccl bench plan --algo ...|--xml ...`): the
/// program run through [`Communicator::run_program`] on virtual ranks of one GPU, each level of it
/// one launch of the collectives' engine.
pub struct PlanBench {
    /// What to call the program in reports.
    pub name: String,
    /// The transfer program.
    pub program: oxccl_host::program::Program,
    /// Element type.
    pub dtype: DType,
    /// Reduction operator (unused where the program's collective reduces nothing).
    pub op: ReduceOp,
    /// Sizes (the larger user buffer per rank, before it is cut into whole chunks; at least
    /// [`PlanBench::smallest_size`]), launches per size, and checks (AllReduce, AllGather and
    /// ReduceScatter programs; other rows report `N/A`).
    pub sweep: Sweep,
    /// The communicator's configuration: mover, threads, TMA stage bytes, CTAs per rank
    /// (`max_ctas`; `None`: each rank's share of the SMs, as the collectives take), timeout.
    pub config: Config,
    /// Chunks the program's ops read and write per call
    /// ([`oxccl_host::program::Program::traffic_chunks`]): times the chunk size, its own roofline.
    pub traffic: (u64, u64),
}

impl PlanBench {
    /// Checks what [`plan_bench`] would refuse, without a GPU: the sweep ([`Sweep::validate`]), the
    /// configuration and the program's lowering at every size of the sweep.
    pub fn validate(&self) -> Result<()> {
        self.sweep.validate(self.dtype.size() as u64)?;
        oxccl::config::validate_config(&self.config)?;
        // Below one 16-byte grain per chunk the program cannot run `-b` as asked; it would run a
        // larger size instead, so such a sweep is refused.
        let smallest = self.smallest_size();
        if self.sweep.min_bytes < smallest {
            return Err(Error::Config {
                field: "min_bytes",
                why: format!(
                    "{} B is below the program's smallest size, {smallest} B ({} chunks x 16 B)",
                    self.sweep.min_bytes,
                    self.user_chunks()
                ),
            });
        }
        for size in self.sweep.sizes() {
            // The CTA count may come from the GPU; one checks the rest.
            self.lowered(size, self.config.max_ctas.unwrap_or(1))?;
        }
        Ok(())
    }

    /// The program lowered level by level for the sweep's `size` with `ctas` CTAs per rank, and
    /// its bytes per chunk (a positive multiple of 16).
    fn lowered(&self, size: u64, ctas: u32) -> Result<(oxccl_host::lowered::Staged, u64)> {
        use oxccl_host::compile::direct::{DirectOptions, lower_direct};
        let chunk_bytes = (size / self.user_chunks() / 16).max(1) * 16;
        let opts = DirectOptions { op: self.op, ..DirectOptions::new(chunk_bytes, self.dtype, ctas) };
        let staged = lower_direct(&self.program, &opts)
            .map_err(|e| Error::Config { field: "plan", why: format!("at {size} B: {e}") })?;
        Ok((staged, chunk_bytes))
    }

    /// The nccl-tests row of one size of a program of layout `l`, run on `mover` ([`movers_of`]):
    /// `real` bytes (the larger user
    /// buffer per rank), `counts` (input, output) elements per rank, `us` per call, `wrong` elements.
    #[allow(clippy::too_many_arguments)]
    fn row(
        &self,
        l: &oxccl_host::program::BufferLayout,
        mover: &'static str,
        ctas: u32,
        real: u64,
        (count_in, count_out): (u64, u64),
        us: f64,
        wrong: Option<u64>,
    ) -> CollectiveRow {
        let p = l.ranks as usize;
        let bw = real as f64 / (us * 1e-6) / 1e9;
        let factor = l.collective.bus_factor(p);
        let (measured, none) = ((Some(us), Some(bw), Some(bw * factor), wrong), (None, None, None, None));
        let (oop, ip) = if l.in_place { (none, measured) } else { (measured, none) };
        CollectiveRow {
            // The spelling of the T-CCL rows (`all_reduce`), not the MSCCL one (`allreduce`).
            collective: l.collective.name(),
            root: l.collective.root().map_or(-1, |r| r as i64),
            ranks: p,
            ctas,
            mover,
            reduction: if self.config.reduction == Reduction::Tma { "tma" } else { "registers" },
            size: real,
            // nccl-tests' count: elements per rank in the smaller buffer; for AllToAll, the elements
            // a rank sends to each peer.
            count: if l.collective == Collective::AllToAll { count_in / p as u64 } else { count_in.min(count_out) },
            dtype: self.dtype.nccl_name(),
            // nccl-tests: "none" where nothing is reduced.
            redop: if l.collective.reduces() { self.op.nccl_name() } else { "none" },
            oop_us: oop.0,
            oop_algbw: oop.1,
            oop_busbw: oop.2,
            oop_wrong: oop.3,
            ip_us: ip.0,
            ip_algbw: ip.1,
            ip_busbw: ip.2,
            ip_wrong: ip.3,
        }
    }

    /// Bytes the program's ops read and write per call at nccl-tests' `size` (the larger user
    /// buffer per rank, whole chunks).
    pub fn traffic_bytes(&self, size: u64) -> u64 {
        (self.traffic.0 + self.traffic.1).saturating_mul(size / self.user_chunks())
    }

    /// Chunks of the program's larger user buffer per rank.
    fn user_chunks(&self) -> u64 {
        let l = &self.program.layout;
        (l.input_chunks() as u64).max(l.output_chunks() as u64).max(1)
    }

    /// The smallest size the program runs as asked: one 16-byte grain per chunk.
    pub fn smallest_size(&self) -> u64 {
        self.user_chunks() * 16
    }
}

/// What a program benchmark ran with, for the report's header.
#[derive(Clone, Debug, serde::Serialize)]
pub struct PlanBenchInfo {
    /// Ranks of the program.
    pub ranks: usize,
    /// CTAs per rank of every launch.
    pub ctas: u32,
    /// The TMA mover's slots per stage (the most sources a task combines).
    pub slots: u32,
    /// Launches per call: the program's levels.
    pub levels: usize,
}

/// Runs a transfer program on virtual ranks of `stream`'s GPU through
/// [`Communicator::run_program`] (lowered level by level, [`oxccl_host::compile::direct`], and
/// cached by its first call), one nccl-tests row per size: nccl-tests' size is the larger user
/// buffer per rank, cut into the program's chunks (each a multiple of 16 bytes). The program's
/// layout is either in place or out of place: the other half of the row is `None` (`N/A`).
/// Correctness is checked in a separate untimed call (every collective but AllToAll, whose
/// column is `N/A`).
pub fn plan_bench(
    stream: &Arc<CudaStream>,
    b: &PlanBench,
    mut on_row: impl FnMut(&CollectiveRow, &PlanBenchInfo),
) -> Result<Vec<CollectiveRow>> {
    use oxccl_host::program::{BufferKind, Rank};
    b.validate()?;
    let program = &b.program;
    let l = &program.layout;
    let p = l.ranks as usize;
    let comm = Communicator::virtual_ranks(stream, p, b.config.clone())?;
    let ctas = comm.ctas_per_rank();
    let e = b.dtype.size() as u64;
    let collective = (l.collective != Collective::AllToAll).then_some(l.collective);
    let mut staging = check_staging(std::slice::from_ref(stream), b.sweep.check)?;
    let mut rows = Vec::new();
    for size in b.sweep.sizes() {
        // The lowering's shape for the report; the calls go through `run_program`, which lowers
        // and caches the same program on its first call.
        let (staged, chunk_bytes) = b.lowered(size, ctas)?;
        let (slots, levels) = (staged.slots(), staged.stages.len());
        let alloc = |bytes: u64| stream.alloc_zeros::<u8>(bytes.max(16) as usize).map_err(Error::driver("cuMemAlloc"));
        // Each rank's user buffers: in place the larger of its input and output, out of place both.
        let main = u64::from(if l.in_place { l.input_chunks().max(l.output_chunks()) } else { l.output_chunks() });
        let mut outs: Vec<CudaSlice<u8>> = (0..p).map(|_| alloc(main * chunk_bytes)).collect::<Result<_>>()?;
        let ins: Vec<CudaSlice<u8>> = if l.in_place {
            Vec::new()
        } else {
            (0..p).map(|_| alloc(u64::from(l.input_chunks()) * chunk_bytes)).collect::<Result<_>>()?
        };
        // Where rank r's input and output start (in place, where the layout puts them in its buffer).
        let base = |r: usize, kind: BufferKind| u64::from(l.buffer_base(Rank(r as u32), kind)) * chunk_bytes;
        let input_at = |r: usize| match ins.get(r) {
            Some(i) => i.device_ptr(stream).0,
            None => outs[r].device_ptr(stream).0 + base(r, BufferKind::Input),
        };
        let output_at = |r: usize, outs: &[CudaSlice<u8>]| {
            outs[r].device_ptr(stream).0 + if l.in_place { base(r, BufferKind::Output) } else { 0 }
        };
        let count_in = u64::from(l.input_chunks()) * chunk_bytes / e;
        let count_out = u64::from(l.output_chunks()) * chunk_bytes / e;
        for r in 0..p {
            // SAFETY: rank r's input lies inside its buffers, on this GPU; nothing else uses them
            // until the synchronisation below.
            unsafe { fill_periodic_at(stream, input_at(r), b.dtype, count_in, |i| pattern(r, i))? };
        }
        stream.synchronize().map_err(Error::driver("cuStreamSynchronize"))?;
        let elems = |buf: &CudaSlice<u8>| buf.len() / e as usize;
        let launch = |outs: &mut [CudaSlice<u8>]| -> Result<()> {
            oxccl::with_element!(b.dtype, |T| {
                // SAFETY: byte buffers of whole elements viewed as `T` (cudarc allocations are
                // 256-byte aligned), each used by this call alone.
                let mut out: Vec<CudaViewMut<T>> = outs
                    .iter_mut()
                    .map(|o| {
                        let n = elems(o);
                        unsafe { o.transmute_mut::<T>(n) }.expect("sized above")
                    })
                    .collect();
                if l.in_place {
                    comm.run_program_in_place(program, &mut out, b.op)
                } else {
                    let send: Vec<CudaView<T>> =
                        ins.iter().map(|i| unsafe { i.transmute::<T>(elems(i)) }.expect("sized above")).collect();
                    comm.run_program(program, &send, &mut out, b.op)
                }
            })
        };
        let mut wrong = None;
        if b.sweep.check
            && let Some(c) = collective
        {
            launch(&mut outs)?;
            comm.synchronize()?;
            let count = if c == Collective::AllGather { count_in } else { count_out };
            let expected = Expected::new(c, b.dtype, b.op, p, count);
            let stage = &mut staging[0].1;
            let mut n = 0;
            // A program's Reduce promises nothing off its root.
            for r in (0..p).filter(|&r| c.defines_output(r)) {
                // SAFETY: rank r's output, written by the call synchronised above.
                n += unsafe { count_wrong_at(stream, output_at(r, &outs), count_out, &expected, r, 0, stage)? };
            }
            wrong = Some(n);
        }
        let us = time_ms(stream, b.sweep.warmup, b.sweep.iters, || launch(&mut outs))? * 1e3;
        comm.synchronize()?;
        drop((ins, outs));
        let real = b.user_chunks() * chunk_bytes;
        let row = b.row(l, movers_of(&b.config, &staged.stages), ctas, real, (count_in, count_out), us, wrong);
        on_row(&row, &PlanBenchInfo { ranks: p, ctas, slots, levels });
        rows.push(row);
    }
    Ok(rows)
}

/// The nccl-tests table header.
pub const NCCL_HEADER: &str = "#                                                              out-of-place                       in-place          \n\
#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong\n\
#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)       ";

/// One table line as nccl-tests prints it: the time as `%7.2f` below 100 µs, `%7.1f` below 10 ms and
/// `%7.0f` from there, `#wrong` as `%5g` (`N/A` when unchecked); a side that did not run shows `N/A`
/// for its time and bandwidths.
pub fn nccl_line(r: &CollectiveRow) -> String {
    let w = |n: Option<u64>| n.map_or("N/A".to_string(), |n| c_g(n as f64));
    let bw = |x: Option<f64>| x.map_or("N/A".to_string(), |x| format!("{x:.2}"));
    let time = |us: Option<f64>| us.map_or("N/A".to_string(), nccl_time);
    format!(
        "{:>12}  {:>12}  {:>8}  {:>6}  {:>6}  {:>7}  {:>6}  {:>6}  {:>5}  {:>7}  {:>6}  {:>6}  {:>5}",
        r.size,
        r.count,
        r.dtype,
        r.redop,
        r.root,
        time(r.oop_us),
        bw(r.oop_algbw),
        bw(r.oop_busbw),
        w(r.oop_wrong),
        time(r.ip_us),
        bw(r.ip_algbw),
        bw(r.ip_busbw),
        w(r.ip_wrong)
    )
}

/// nccl-tests' time column: fewer decimals as the time grows, so the column keeps its width.
pub fn nccl_time(us: f64) -> String {
    if us >= 10_000.0 {
        format!("{us:.0}")
    } else if us >= 100.0 {
        format!("{us:.1}")
    } else {
        format!("{us:.2}")
    }
}

/// C's `%g`: six significant digits, trailing zeros dropped, scientific notation below 1e-4 and from
/// 1e6 (as nccl-tests prints the average bus bandwidth and `#wrong`).
pub fn c_g(x: f64) -> String {
    if x == 0.0 || !x.is_finite() {
        return if x.is_nan() {
            "nan".into()
        } else if x.is_infinite() {
            format!("{}inf", if x < 0.0 { "-" } else { "" })
        } else {
            "0".into()
        };
    }
    let trim = |s: String| if s.contains('.') { s.trim_end_matches('0').trim_end_matches('.').to_string() } else { s };
    // The exponent after rounding to six significant digits.
    let sci = format!("{x:.5e}");
    let (mantissa, exp) = sci.split_once('e').expect("`{:e}` has an exponent");
    let exp: i32 = exp.parse().expect("`{:e}` has an integer exponent");
    if !(-4..6).contains(&exp) {
        format!("{}e{}{:02}", trim(mantissa.to_string()), if exp < 0 { '-' } else { '+' }, exp.unsigned_abs())
    } else {
        trim(format!("{x:.*}", (5 - exp) as usize))
    }
}

/// nccl-tests' closing lines, for `failed` checks (a size's out-of-place or in-place side with a
/// wrong element counts one, as nccl-tests counts its errors) and an average bus bandwidth `avg`.
fn nccl_closing(failed: u64, avg: f64) -> String {
    format!(
        "# Out of bounds values : {} {}\n# Avg bus bandwidth    : {} \n#",
        failed,
        if failed == 0 { "OK" } else { "FAILED" },
        c_g(avg)
    )
}

/// nccl-tests' closing lines for a set of rows: the average bus bandwidth is over the sides that
/// ran (both, as nccl-tests runs them, or a transfer program's one).
pub fn nccl_footer(rows: &[CollectiveRow]) -> String {
    let failed = rows.iter().flat_map(|r| [r.oop_wrong, r.ip_wrong]).flatten().filter(|&w| w > 0).count() as u64;
    let ran: Vec<f64> = rows.iter().flat_map(|r| [r.oop_busbw, r.ip_busbw]).flatten().collect();
    nccl_closing(failed, ran.iter().sum::<f64>() / ran.len().max(1) as f64)
}

/// The bytes a collective over `ranks` virtual ranks on one GPU must move through device memory at
/// least: every input read once and every output element written once. `size` is nccl-tests' size
/// (the larger per-rank buffer). In place, AllGather's shards and Broadcast's root buffer already
/// hold their part of the output, so that part is neither read again nor written.
pub fn min_traffic(collective: Collective, size: u64, ranks: usize, in_place: bool) -> u64 {
    let p = ranks as u64;
    match collective {
        // Input N and output N per rank.
        Collective::AllReduce => 2 * size * p,
        // ReduceScatter: input `size`, output size / P per rank; Reduce: every rank's input and the
        // root's output. In place the output overwrites input that was read anyway.
        Collective::ReduceScatter | Collective::Reduce { .. } => size * p + size,
        // AllGather: input size / P, output `size` per rank; Broadcast: the root's input and every
        // rank's output. In place one output's worth (the shards, the root's) is already there.
        Collective::AllGather | Collective::Broadcast { .. } => size * p + if in_place { 0 } else { size },
        // Every rank reads its `size` bytes and writes `size` (out of place only).
        Collective::AllToAll => 2 * size * p,
    }
}

/// Repetitions of a compute load whose `probe` repetitions took `probe_ms` that last about
/// `target_ms` (the nearest whole number, at least 1), or the `compute_ms` error where that count
/// does not fit the kernels' `u32`.
pub(crate) fn compute_reps(probe: u32, probe_ms: f64, target_ms: f64) -> Result<u32> {
    let want = (probe as f64 * target_ms / probe_ms.max(1e-6)).round().max(1.0);
    if want > u32::MAX as f64 {
        return Err(Error::Config {
            field: "compute_ms",
            why: format!("{target_ms} ms of compute needs {want:.0} repetitions per call, more than {}", u32::MAX),
        });
    }
    Ok(want as u32)
}

/// Parameters of the reshard benchmark (`oxccl bench reshard`).
#[derive(Clone, Debug)]
pub struct ReshardBench {
    /// Global shape.
    pub shape: Vec<u64>,
    /// Element type.
    pub dtype: DType,
    /// Source layout.
    pub src: Layout,
    /// Destination layout.
    pub dst: Layout,
    /// Virtual ranks on the GPU (every mesh must lie below).
    pub ranks: usize,
    /// Route, domain size, split threshold, CTA owner.
    pub options: ReshardOptions,
    /// Timed calls per program (at least 1); the time is their mean.
    pub iters: usize,
    /// Untimed calls before the timed ones (also before timing `cuMemcpyDtoD`).
    pub warmup: usize,
    /// Check every destination shard in a separate untimed pass.
    pub check: bool,
    /// The communicator's configuration.
    pub config: Config,
    /// The NVLink model's bandwidth of one rank's NVLink port, per direction (GB/s).
    pub nvlink_gbps: f64,
    /// The NVLink model's bandwidth of one rank's link out of its domain, per direction (GB/s).
    pub cross_gbps: f64,
}

impl ReshardBench {
    /// Programs [`reshard_bench`] times, one row each: the plan and the two workarounds.
    pub const PROGRAMS: usize = 3;
}

/// One row of the reshard benchmark: one program (the plan or a workaround) on the same engine.
#[derive(Clone, Debug, serde::Serialize)]
pub struct ReshardRow {
    /// `plan`, `flat_sends` or `gather_broadcast`.
    pub program: &'static str,
    /// Launches (stages with tasks).
    pub launches: usize,
    /// Tasks over every stage.
    pub tasks: usize,
    /// Bytes copied from one rank's buffer into another's.
    pub bytes_between_ranks: u64,
    /// Bytes copied inside one rank.
    pub bytes_local: u64,
    /// Bytes crossing NVLink domains.
    pub bytes_cross_domain: u64,
    /// Average milliseconds per call.
    pub ms: f64,
    /// Bytes copied (between ranks + local) per second / 1e9.
    pub gbps: f64,
    /// The one-GPU floor, the same for every program of a run: every destination byte written once
    /// and every element of the tensor read once through this GPU's memory, at the measured
    /// `cuMemcpyDtoD` rate (which counts bytes read and written).
    pub sol_hbm_ms: f64,
    /// The NVLink model, as if each rank were a GPU: the busiest link's bytes over its bandwidth.
    pub sol_nvlink_ms: f64,
    /// Which link is busiest in the NVLink model (`nvlink out of rank 3`, ...).
    pub busiest_link: String,
    /// Elements that differed in the check pass (`None`: not checked; `null` in JSON).
    pub wrong: Option<u64>,
}

/// A pseudo-random non-zero element pattern (so zero-initialised destinations show unwritten elements).
fn reshard_pattern(i: u64, elem: usize) -> u64 {
    let mut z = i.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0x5DEE_CE66;
    z = (z ^ (z >> 29)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z ^= z >> 32;
    (z | 1) & (u64::MAX >> (64 - 8 * elem))
}

/// Rank `rank`'s shard of the pattern tensor under `sharding`, as bytes.
fn reshard_shard(sharding: &oxccl_host::reshard::Sharding, rank: u32, elem: usize) -> Vec<u8> {
    reshard_shard_with(sharding, rank, elem, |i| reshard_pattern(i, elem).to_le_bytes())
}

/// The elements of a tensor of partial sums (`k` of them) the benchmark gives global index `i`:
/// `i % 4 + 1`, held by partial sum `i % k` alone (the others hold 0), so that the sum is exact in
/// every type and a partial sum missed or added twice shows. The five values are encoded once: a
/// tensor's worth of elements (hundreds of millions in the larger benchmarks) costs no conversion
/// each.
struct Partials {
    values: [Enc; 5],
    k: u64,
}

impl Partials {
    fn new(dtype: DType, k: u64) -> Partials {
        Partials { values: std::array::from_fn(|v| enc(dtype, v as i32)), k }
    }

    /// Element `i` of partial sum `p`, or of the sum (`None`).
    fn at(&self, i: u64, p: Option<u64>) -> Enc {
        self.values[if p.is_none_or(|p| i % self.k == p) { (i % 4 + 1) as usize } else { 0 }]
    }
}

/// Rank `rank`'s box under `sharding`, element `i` of the global tensor given as `f(i)`'s first
/// `elem` bytes.
fn reshard_shard_with(
    sharding: &oxccl_host::reshard::Sharding,
    rank: u32,
    elem: usize,
    f: impl Fn(u64) -> [u8; 8],
) -> Vec<u8> {
    let Some(region) = sharding.local_region(rank) else { return Vec::new() };
    if region.is_empty() {
        return Vec::new();
    }
    // A non-empty region: no extent is 0, so the strides are at most the element count.
    let shape = sharding.shape();
    let strides: Vec<u64> = (0..shape.len()).map(|d| shape[d + 1..].iter().product()).collect();
    let mut out = Vec::with_capacity(region.volume() as usize * elem);
    let k = region.start.len().saturating_sub(1);
    let run = region.extent.last().copied().unwrap_or(1);
    let rows: u64 = region.extent[..k].iter().product();
    for row in 0..rows {
        let (mut rest, mut at) = (row, region.start.get(k).copied().unwrap_or(0));
        for d in (0..k).rev() {
            at += (region.start[d] + rest % region.extent[d]) * strides[d];
            rest /= region.extent[d];
        }
        for i in at..at + run {
            out.extend_from_slice(&f(i)[..elem]);
        }
    }
    out
}

/// The NVLink model's busiest link for `loads`: (bytes / bandwidth in seconds, description).
fn busiest_link(loads: &Loads, nvlink_gbps: f64, cross_gbps: f64) -> (f64, String) {
    let mut best = (0.0, "none".to_string());
    for r in 0..loads.sent.len() {
        let links = [
            (loads.sent[r] - loads.sent_cross_domain[r], nvlink_gbps, "NVLink out of"),
            (loads.received[r] - loads.received_cross_domain[r], nvlink_gbps, "NVLink into"),
            (loads.sent_cross_domain[r], cross_gbps, "domain link out of"),
            (loads.received_cross_domain[r], cross_gbps, "domain link into"),
        ];
        for (bytes, gbps, name) in links {
            let s = bytes as f64 / (gbps * 1e9);
            if s > best.0 {
                best = (s, format!("{name} rank {r} ({bytes} B)"));
            }
        }
    }
    best
}

/// Runs the reshard benchmark on virtual ranks of `stream`'s GPU: the plan through
/// [`Communicator::reshard`] ([`Communicator::reshard_reduce`] with `Sum` from a `Partial`
/// source), and the two workarounds (flat sends, gather + broadcast) lowered to the same
/// engine, each checked once (untimed) and timed, `on_row` called as each is
/// ([`ReshardBench::PROGRAMS`] rows). Returns (memcpy GB/s read + written, rows).
pub fn reshard_bench(
    stream: &Arc<CudaStream>,
    b: &ReshardBench,
    mut on_row: impl FnMut(&ReshardRow),
) -> Result<(f64, Vec<ReshardRow>)> {
    for (field, gbps) in [("nvlink_gbps", b.nvlink_gbps), ("cross_gbps", b.cross_gbps)] {
        if !(gbps.is_finite() && gbps > 0.0) {
            return Err(Error::Config { field, why: format!("{gbps} GB/s is not a positive bandwidth") });
        }
    }
    check_iters(b.iters)?;
    let comm = Communicator::virtual_ranks(stream, b.ranks, b.config.clone())?;
    let e = b.dtype.size();
    // The meshes within the ranks before planning (a mesh of a million ranks plans slowly).
    let world = u32::try_from(b.ranks).unwrap_or(u32::MAX);
    b.src.mesh().check_world(world).map_err(oxccl_host::reshard::ReshardError::Src)?;
    b.dst.mesh().check_world(world).map_err(oxccl_host::reshard::ReshardError::Dst)?;
    let plan = reshard::plan(&b.shape, e as u64, &b.src, &b.dst, b.options.plan)?;
    let ctas = comm.ctas_per_rank();
    let opts = LowerOptions { owner: b.options.owner, dtype: Some(b.dtype), ..LowerOptions::new(b.ranks, ctas) };
    let programs: [_; ReshardBench::PROGRAMS] = [
        ("plan", lower(&plan, &opts)?),
        ("flat_sends", lower(&workaround::flat_sends(&plan), &opts)?),
        ("gather_broadcast", workaround::gather_broadcast(&plan, &opts)?),
    ];

    // Device memory: every rank's source, destination and scratch buffers.
    let mut need = [[0u64; BUFFER_SLOTS]; MAX_RANKS];
    for (_, l) in &programs {
        for (r, bytes) in l.buffer_bytes.iter().enumerate() {
            for s in 0..BUFFER_SLOTS {
                need[r][s] = need[r][s].max(bytes[s]);
            }
        }
    }
    // Checked: a shape whose buffers add up past 2^64 bytes must not wrap into a small total.
    let total = need
        .iter()
        .flatten()
        .try_fold(0u64, |t, &b| t.checked_add(b))
        .and_then(|t| t.checked_add(plan.src_sharding().elements().checked_mul(2 * e as u64)?));
    oxccl::engine::bind(stream.context())?;
    let (free, _) = cudarc::driver::result::mem_get_info().map_err(Error::driver("cuMemGetInfo"))?;
    if total.is_none_or(|total| total as f64 > 0.9 * free as f64) {
        let total = total.map_or("more than 2^64".into(), |t| t.to_string());
        return Err(Error::Config {
            field: "shape",
            why: format!("the benchmark needs {total} bytes of device memory, {free} are free; use a smaller shape"),
        });
    }
    let (src_sh, dst_sh) = (plan.src_sharding(), plan.dst_sharding());
    // A source of partial sums holds numbers whose sum is exact; copies move the pattern.
    let k = src_sh.partial_sums();
    let partials = Partials::new(b.dtype, k.max(1));
    let source = |r: u32| match src_sh.partial_index(r) {
        Some(p) if k > 1 => reshard_shard_with(src_sh, r, e, |i| partials.at(i, Some(p))),
        _ => reshard_shard(src_sh, r, e),
    };
    // What each destination rank must hold, made once per distinct box (replicas share it) and
    // compared with every program's result.
    let mut wanted: Vec<Option<Arc<Vec<u8>>>> = vec![None; b.ranks];
    if b.check {
        let mut boxes: HashMap<Region, Arc<Vec<u8>>> = HashMap::new();
        for r in dst_sh.mesh().ranks() {
            let Some(region) = dst_sh.local_region(r) else { continue };
            let want = boxes.entry(region).or_insert_with(|| {
                Arc::new(if k > 1 {
                    reshard_shard_with(dst_sh, r, e, |i| partials.at(i, None))
                } else {
                    reshard_shard(dst_sh, r, e)
                })
            });
            wanted[r as usize] = Some(want.clone());
        }
    }
    let alloc = |bytes: u64| stream.alloc_zeros::<u8>(bytes.max(16) as usize).map_err(Error::driver("cuMemAlloc"));
    let mut bufs: Vec<[Option<CudaSlice<u8>>; BUFFER_SLOTS]> = Vec::new();
    for (r, need) in need.iter().enumerate().take(b.ranks) {
        let mut row: [Option<CudaSlice<u8>>; BUFFER_SLOTS] = Default::default();
        if src_sh.mesh().contains(r as u32) {
            let data = source(r as u32);
            row[slot::INPUT as usize] = Some(if data.is_empty() {
                alloc(0)?
            } else {
                stream.clone_htod(&data).map_err(Error::driver("cuMemcpyHtoD"))?
            });
        }
        for s in [slot::OUTPUT, slot::SCRATCH] {
            if need[s as usize] > 0 || (s == slot::OUTPUT && dst_sh.mesh().contains(r as u32)) {
                row[s as usize] = Some(alloc(need[s as usize])?);
            }
        }
        bufs.push(row);
    }
    let mut table = [[0u64; BUFFER_SLOTS]; MAX_RANKS];
    for (r, row) in bufs.iter().enumerate() {
        for (s, buf) in row.iter().enumerate() {
            if let Some(buf) = buf {
                table[r][s] = buf.device_ptr(stream).0;
            }
        }
    }

    // cuMemcpyDtoD of the tensor's size: the one-GPU model's bandwidth.
    let tensor_bytes = (plan.src_sharding().elements() * e as u64).max(1 << 20) as usize;
    let memcpy_gbps = memcpy_rate(stream, tensor_bytes, b.warmup, b.iters)?;

    // The one-GPU floor of any program: every destination byte written once and every element of
    // the tensor read at least once (a replicated destination's copies of one element may all be
    // served by one read; the L2 keeps the rest), at the memcpy rate, which counts both.
    let dst_bytes: u64 = dst_sh.mesh().ranks().map(|r| dst_sh.local_len(r) * e as u64).sum();
    let sol_hbm_bytes = src_sh.elements() * e as u64 + dst_bytes;
    let mut rows = Vec::new();
    for (name, lowered) in programs {
        let loads = lowered.loads(b.options.plan.domain_size);
        let cross: u64 = loads.sent_cross_domain.iter().sum();
        let launches = lowered.stages.iter().filter(|l| !l.tasks.is_empty()).count();
        let tasks = lowered.task_count();
        let prepared = if name == "plan" { None } else { Some(comm.prepare_staged(lowered, ctas)?) };
        let run = |bufs: &mut Vec<[Option<CudaSlice<u8>>; BUFFER_SLOTS]>| -> Result<()> {
            match &prepared {
                // SAFETY: `table` holds buffers of at least `buffer_bytes` for every (rank, slot) of every
                // program (allocated above from their maximum), alive until the end of this function;
                // every rank's buffers and launches are on the one `stream`, so buffers freed on an
                // early return are freed in its order, after the launches queued before.
                Some(p) => unsafe { comm.launch_prepared(p, table) },
                None => reshard_call(&comm, bufs, b, &plan),
            }
        };
        let wrong = if b.check {
            for row in bufs.iter_mut() {
                if let Some(out) = &mut row[slot::OUTPUT as usize] {
                    stream.memset_zeros(out).map_err(Error::driver("cuMemsetD8Async"))?;
                }
            }
            run(&mut bufs)?;
            comm.synchronize()?;
            let mut wrong = 0u64;
            for r in dst_sh.mesh().ranks() {
                let Some(want) = &wanted[r as usize] else { continue };
                let out = bufs[r as usize][slot::OUTPUT as usize].as_ref().expect("destination ranks have buffers");
                let got = stream.clone_dtoh(out).map_err(Error::driver("cuMemcpyDtoH"))?;
                let got = &got[..want.len()];
                // Elements counted only where the whole box differs.
                if got != want.as_slice() {
                    wrong += got.chunks(e).zip(want.chunks(e)).filter(|(a, b)| a != b).count() as u64;
                }
            }
            Some(wrong)
        } else {
            None
        };
        if !b.check {
            // The plan's first call plans, lowers and uploads it (the checked call above did): not
            // in the timed calls, whatever `-w`.
            run(&mut bufs)?;
        }
        let ms = time_ms(stream, b.warmup, b.iters, || run(&mut bufs))?;
        comm.synchronize()?;
        let copied = loads.between_ranks + loads.local;
        let (nvlink_s, link) = busiest_link(&loads, b.nvlink_gbps, b.cross_gbps);
        rows.push(ReshardRow {
            program: name,
            launches,
            tasks,
            bytes_between_ranks: loads.between_ranks,
            bytes_local: loads.local,
            bytes_cross_domain: cross,
            ms,
            gbps: copied as f64 / (ms * 1e-3) / 1e9,
            sol_hbm_ms: sol_hbm_bytes as f64 / (memcpy_gbps * 1e9) * 1e3,
            sol_nvlink_ms: nvlink_s * 1e3,
            busiest_link: link,
            wrong,
        });
        on_row(&rows[rows.len() - 1]);
    }
    stream.synchronize().map_err(Error::driver("cuStreamSynchronize"))?;
    Ok((memcpy_gbps, rows))
}

/// The plan through the public call, on the benchmark's byte buffers viewed as elements.
fn reshard_call(
    comm: &Communicator,
    bufs: &mut [[Option<CudaSlice<u8>>; BUFFER_SLOTS]],
    b: &ReshardBench,
    plan: &reshard::ReshardPlan,
) -> Result<()> {
    let e = b.dtype.size();
    macro_rules! go {
        ($t:ty) => {{
            let mut src: Vec<Option<CudaView<$t>>> = Vec::new();
            let mut dst: Vec<Option<CudaViewMut<$t>>> = Vec::new();
            for (r, row) in bufs.iter_mut().enumerate() {
                let (a, rest) = row.split_at_mut(1);
                let n_src = plan.src_buffer_bytes(r as u32) as usize / e;
                let n_dst = plan.dst_buffer_bytes(r as u32) as usize / e;
                // SAFETY: byte buffers of at least the shard's bytes viewed as whole elements (cudarc
                // allocations are 256-byte aligned).
                src.push(a[0].as_ref().map(|x| unsafe { x.transmute::<$t>(n_src) }.expect("sized above")));
                let out = rest[0].as_mut().filter(|_| plan.dst().mesh().contains(r as u32));
                // SAFETY: as for the source views.
                dst.push(out.map(|x| unsafe { x.transmute_mut::<$t>(n_dst) }.expect("sized above")));
            }
            let src: Vec<Option<&CudaView<$t>>> = src.iter().map(Option::as_ref).collect();
            let mut dst: Vec<Option<&mut CudaViewMut<$t>>> = dst.iter_mut().map(Option::as_mut).collect();
            if b.src.is_partial() {
                comm.reshard_reduce(&src, &mut dst, &b.shape, &b.src, &b.dst, ReduceOp::Sum, &b.options)
            } else {
                comm.reshard(&src, &mut dst, &b.shape, &b.src, &b.dst, &b.options)
            }
        }};
    }
    oxccl::with_element!(b.dtype, |T| go!(T))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rows name the movers the launcher runs: the latency mover for a plan of small tasks, the
    /// configured one for large tasks, both for a run of both kinds, never it at `latency_below` 0.
    #[test]
    fn rows_name_the_movers_the_launcher_picks() {
        let plan = |count: u64| {
            let spec = PlanSpec {
                collective: Collective::AllReduce,
                count,
                dtype: DType::F32,
                op: ReduceOp::Sum,
                ranks: 8,
                in_place: false,
                ctas: 1,
                reduction: Reduction::Registers,
            };
            oxccl_host::tccl::plan(&spec).unwrap()
        };
        let (small, large) = (plan(2), plan(1 << 20));
        let tma = Config::default();
        assert_eq!(movers_of(&tma, [&small]), "latency");
        assert_eq!(movers_of(&tma, [&large]), "tma");
        assert_eq!(movers_of(&tma, [&small, &large]), "tma+latency");
        let simt = Config { mover: Mover::Simt, ..Config::default() };
        assert_eq!(movers_of(&simt, [&large, &small]), "simt+latency");
        let never = Config { latency_below: 0, ..Config::default() };
        assert_eq!(movers_of(&never, [&small, &large]), "tma");
        let empty = Lowered { tasks: Vec::new(), ..small.clone() };
        assert_eq!(movers_of(&tma, [&empty, &large]), "tma", "a program without tasks is not launched");
    }

    #[test]
    fn compute_repetitions_scale_to_the_time_asked_or_are_refused() {
        // 1000 repetitions took 2 ms: 5 ms takes 2500; anything shorter than one repetition, 1.
        assert_eq!(compute_reps(1000, 2.0, 5.0).unwrap(), 2500);
        assert_eq!(compute_reps(1000, 2.0, 1e-9).unwrap(), 1);
        // A count past the kernels' u32 is an error naming the flag, not a silent cut.
        let e = compute_reps(16384, 0.01, 60_000.0).unwrap_err();
        assert!(matches!(e, Error::Config { field: "compute_ms", .. }), "{e}");
    }

    #[test]
    fn numbers_print_as_nccl_tests_prints_them() {
        // `%g`: six significant digits, no trailing zeros, exponent below 1e-4 and from 1e6.
        let g = [
            (0.0, "0"),
            (332.21594, "332.216"),
            (403.0, "403"),
            (1e6, "1e+06"),
            (1234567.0, "1.23457e+06"),
            (999999.6, "1e+06"),
            (0.0001, "0.0001"),
            (0.00001234, "1.234e-05"),
            (12.5, "12.5"),
            (-2.5, "-2.5"),
        ];
        for (x, want) in g {
            assert_eq!(c_g(x), want, "{x}");
        }
        // The time column: two decimals below 100 us, one below 10 ms, none from there.
        for (us, want) in
            [(11.3249, "11.32"), (99.994, "99.99"), (100.0, "100.0"), (4629.14, "4629.1"), (10000.4, "10000")]
        {
            assert_eq!(nccl_time(us), want, "{us}");
        }
        let row = CollectiveRow {
            collective: "all_reduce",
            root: -1,
            ranks: 8,
            ctas: 8,
            mover: "tma",
            reduction: "registers",
            size: 1 << 30,
            count: 1 << 28,
            dtype: "float",
            redop: "sum",
            oop_us: Some(12345.6),
            oop_algbw: Some(86.97),
            oop_busbw: Some(152.2),
            oop_wrong: Some(0),
            ip_us: Some(45.678),
            ip_algbw: Some(1.0),
            ip_busbw: Some(1.75),
            ip_wrong: None,
        };
        assert_eq!(
            nccl_line(&row),
            "  1073741824     268435456     float     sum      -1    12346   86.97  152.20      0    45.68    1.00    \
             1.75    N/A"
        );
        // Unchecked halves count no errors and hide none; as in nccl-tests, the count is of failed
        // checks (a size's side with wrong elements), not of wrong elements.
        let footer = nccl_footer(&[CollectiveRow { ip_wrong: Some(3), oop_wrong: None, ..row.clone() }]);
        assert!(footer.starts_with("# Out of bounds values : 1 FAILED"), "{footer}");
        let two = [
            CollectiveRow { oop_wrong: Some(5), ip_wrong: Some(7), ..row.clone() },
            CollectiveRow { oop_wrong: Some(0), ip_wrong: Some(0), ..row.clone() },
        ];
        assert!(nccl_footer(&two).starts_with("# Out of bounds values : 2 FAILED"), "{}", nccl_footer(&two));
        assert!(nccl_footer(&two[1..]).starts_with("# Out of bounds values : 0 OK"));
        // The average is over both sides: (152.2 + 1.75) / 2.
        assert!(nccl_footer(&two[1..]).contains("# Avg bus bandwidth    : 76.975 \n"), "{}", nccl_footer(&two[1..]));
        // A transfer program's row runs one side: the other shows `N/A` (not a time of 0), and the
        // average is over the side that ran, not halved by the one that did not.
        let in_place_only =
            CollectiveRow { oop_us: None, oop_algbw: None, oop_busbw: None, oop_wrong: None, ..row.clone() };
        assert_eq!(
            nccl_line(&in_place_only),
            "  1073741824     268435456     float     sum      -1      N/A     N/A     N/A    N/A    45.68    1.00    \
             1.75    N/A"
        );
        let one_side = [CollectiveRow { ip_wrong: Some(2), ..in_place_only.clone() }, in_place_only];
        let footer = nccl_footer(&one_side);
        assert!(footer.starts_with("# Out of bounds values : 1 FAILED"), "{footer}");
        assert!(footer.contains("# Avg bus bandwidth    : 1.75 \n"), "{footer}");
        let json = serde_json::to_string(&one_side[1]).unwrap();
        assert!(json.contains("\"oop_us\":null") && json.contains("\"oop_busbw\":null"), "{json}");
    }

    #[test]
    fn counts_are_nccl_tests_counts() {
        // 1 MiB of floats over 6 ranks: nccl-tests runs 43688 per rank (16-byte blocks), not 43690.
        assert_eq!(nccl_count(Collective::AllGather, 1 << 20, 4, 6), 43688);
        assert_eq!(nccl_count(Collective::ReduceScatter, 1 << 20, 4, 6), 43688);
        // Halves: blocks of 8 elements.
        assert_eq!(nccl_count(Collective::AllGather, 1 << 20, 2, 6), 87376);
        // Powers of two are whole already; too small a size runs no element, as in nccl-tests.
        assert_eq!(nccl_count(Collective::ReduceScatter, 1 << 20, 4, 8), 32768);
        assert_eq!(nccl_count(Collective::AllGather, 64, 4, 8), 0);
        // The others take the whole size.
        assert_eq!(nccl_count(Collective::AllReduce, 1 << 20, 4, 6), 262144);
        assert_eq!(nccl_count(Collective::Broadcast { root: 1 }, 10, 2, 3), 5);
        assert_eq!(nccl_count(Collective::Reduce { root: 0 }, 12, 4, 5), 3);
    }

    #[test]
    fn every_expected_result_differs_from_the_poison_and_sums_from_their_inputs() {
        let poison = |dtype: DType| vec![POISON; dtype.size()];
        for dtype in [DType::F32, DType::F16, DType::Bf16, DType::I32, DType::U32] {
            for ranks in 2..=16 {
                for &op in ReduceOp::ALL {
                    let e = Expected::new(Collective::AllReduce, dtype, op, ranks, 17);
                    for i in 0..17 {
                        let v = e.value(0, i);
                        assert_ne!(v[..dtype.size()], poison(dtype), "{dtype:?} {op:?} {ranks} ranks");
                        if op == ReduceOp::Sum {
                            let differs = (0..ranks).all(|r| enc(dtype, pattern(r, i)) != v);
                            assert!(differs, "{dtype:?} {ranks} ranks, element {i}");
                        }
                    }
                }
            }
        }
    }
    use oxccl_host::tccl::{self, PlanSpec};

    /// A sweep runs at least one size of at least one element, grows, and times something; each
    /// refusal names its field.
    #[test]
    fn sweeps_that_cannot_run_are_refused() {
        let check_sweep = |min_bytes, max_bytes, factor, iters, elem| {
            Sweep { min_bytes, max_bytes, factor, iters, warmup: 0, check: true }.validate(elem)
        };
        assert!(check_sweep(1 << 20, 1 << 30, 4, 20, 4).is_ok());
        assert!(check_sweep(8, 8, 2, 1, 4).is_ok());
        assert!(check_sweep(2, 2, 2, 1, 2).is_ok());
        for (args, want) in [
            ((2 << 20, 1 << 20, 4, 20, 4), "min_bytes"),
            ((1, 2, 2, 1, 2), "min_bytes"),
            ((0, 1 << 20, 4, 20, 4), "min_bytes"),
            ((1, 3, 2, 20, 4), "max_bytes"),
            ((8, 1 << 20, 1, 20, 4), "factor"),
            ((8, 8, 0, 20, 4), "factor"),
            ((8, 8, 2, 0, 4), "iters"),
        ] {
            let (min, max, factor, iters, elem) = args;
            match check_sweep(min, max, factor, iters, elem) {
                Err(Error::Config { field, .. }) => assert_eq!(field, want, "{args:?}"),
                other => panic!("{args:?}: {other:?}"),
            }
        }
    }

    /// A sweep's sizes grow by the factor up to the largest, and end where the next would overflow
    /// (a largest size of 2^64 - 1 B does not run forever).
    #[test]
    fn sweep_sizes_end() {
        let sweep_sizes = |min_bytes, max_bytes, factor| {
            Sweep { min_bytes, max_bytes, factor, iters: 1, warmup: 0, check: true }.sizes().collect::<Vec<_>>()
        };
        assert_eq!(sweep_sizes(4, 100, 4), [4, 16, 64]);
        assert_eq!(sweep_sizes(8, 8, 2), [8]);
        let all: Vec<u64> = sweep_sizes(1, u64::MAX, 2);
        assert_eq!((all.len(), all.last()), (64, Some(&(1u64 << 63))));
    }

    /// The roofline's byte counts for 8 ranks of a 1 MiB buffer: in place, AllGather and Broadcast
    /// find one buffer's worth of their output already there; the others read all they overwrite.
    #[test]
    fn minimum_traffic_counts_what_in_place_leaves_alone() {
        let s = 1u64 << 20;
        for c in Collective::every(3) {
            let (oop, ip) = match c {
                Collective::AllReduce => (16 * s, 16 * s),
                Collective::ReduceScatter | Collective::Reduce { .. } => (9 * s, 9 * s),
                Collective::AllGather | Collective::Broadcast { .. } => (9 * s, 8 * s),
                // No in-place form: the same count either way.
                Collective::AllToAll => (16 * s, 16 * s),
            };
            assert_eq!((min_traffic(c, s, 8, false), min_traffic(c, s, 8, true)), (oop, ip), "{c:?}");
        }
    }

    /// The roofline's count is what the default plans move: every task's sources read and
    /// destinations written (an accumulating task, which only `Reduction::Tma` plans hold, would
    /// also read its destination) add up to
    /// [`min_traffic`] for every collective, in and out of place, from 2 ranks (one rank in place
    /// moves nothing), whatever the CTA count and count.
    #[test]
    fn the_default_plans_move_exactly_the_roofline_bytes() {
        use oxccl_kernels::abi::TaskKind;
        for collective in Collective::every(1) {
            for (ranks, count, ctas) in [(2, 1000, 1), (3, 4097, 4), (8, 1 << 16, 16), (5, 77, 32)] {
                for in_place in [false, true].into_iter().filter(|&i| !i || collective.has_in_place()) {
                    let spec = PlanSpec {
                        collective,
                        count,
                        dtype: DType::F32,
                        op: ReduceOp::Sum,
                        ranks,
                        in_place,
                        ctas,
                        reduction: Reduction::Registers,
                    };
                    let lowered = tccl::plan(&spec).unwrap();
                    let moved: u64 = lowered
                        .tasks
                        .iter()
                        .map(|t| {
                            let into = TaskKind::from_raw(t.kind) == Some(TaskKind::ReduceInto);
                            (t.src_ranks.count_ones() as u64 + t.dst_ranks.count_ones() as u64 + into as u64) * t.bytes
                        })
                        .sum();
                    let (in_bytes, out_bytes) = spec.buffer_bytes();
                    let size = in_bytes.max(out_bytes);
                    assert_eq!(moved, min_traffic(collective, size, ranks, in_place), "{spec:?}");
                }
            }
        }
    }

    /// The sweep's copy ring: 32 KiB chunks, as many stages as the room holds (never none, never
    /// more than the kernels' ring).
    #[test]
    fn lone_copy_pipeline_fills_the_room_with_32k_stages() {
        let h200 = 227 * 1024 - abi::smem::STAGES;
        assert_eq!(lone_copy_pipeline(h200), (32768, 7));
        assert_eq!(lone_copy_pipeline(4 * 32768), (32768, 4));
        let (chunk, stages) = lone_copy_pipeline(40 * 1024);
        assert!(chunk as usize * stages as usize <= 40 * 1024 && stages >= 1, "{chunk} x {stages}");
        assert_eq!(lone_copy_pipeline(1 << 30).1, abi::MAX_STAGES as u32);
    }

    /// Every row the overlap benchmark measures has a configuration a communicator accepts (the
    /// bulk reductions are not deterministic, so those rows must not ask for it).
    #[test]
    fn overlap_rows_have_valid_configurations() {
        let mut b = OverlapBench {
            compute: ComputeLoad::Fma,
            ranks: 8,
            bytes: 1 << 20,
            ctas: 4,
            movers: vec![Mover::Tma, Mover::Simt],
            tma_reductions: vec![Reduction::Registers, Reduction::Tma],
            suspend_ns: vec![0, 1000],
            chunk_bytes: None,
            stages: None,
            threads: None,
            simt_threads: None,
            issuers: None,
            combine_direct: None,
            compute_threads: 256,
            compute_ctas_per_sm: 4,
            compute_ms: None,
            partition: false,
            iters: 1,
            warmup: 0,
        };
        let variants = overlap_variants(&b);
        assert_eq!(
            variants,
            [(Mover::Tma, Reduction::Registers), (Mover::Tma, Reduction::Tma), (Mover::Simt, Reduction::Registers)]
        );
        b.validate().unwrap();
        for (mover, reduction) in variants {
            for suspend in [0, 1000] {
                b.chunk_bytes = None;
                b.stages = None;
                b.threads = None;
                let c = overlap_config(&b, mover, reduction, suspend);
                oxccl::config::validate_config(&c).unwrap_or_else(|e| panic!("{mover:?} {reduction:?}: {e}"));
                assert_eq!((c.mover, c.reduction, c.max_ctas, c.wait_suspend_ns), (mover, reduction, Some(4), suspend));
                // A pipeline asked for shapes the TMA rows only (the SIMT mover has none).
                (b.chunk_bytes, b.stages, b.threads) = (Some(8192), Some(2), Some(64));
                let c = overlap_config(&b, mover, reduction, suspend);
                oxccl::config::validate_config(&c).unwrap_or_else(|e| panic!("{mover:?} {reduction:?}: {e}"));
                let want = if mover == Mover::Tma { (Some(8192), Some(2), Some(64)) } else { (None, None, None) };
                assert_eq!((c.chunk_bytes, c.stages, c.threads), want);
                // SIMT threads shape the SIMT rows only.
                b.simt_threads = Some(256);
                let c = overlap_config(&b, mover, reduction, suspend);
                assert_eq!(c.threads, if mover == Mover::Tma { Some(64) } else { Some(256) });
                b.simt_threads = None;
            }
        }
        // What validate refuses: a bad TMA pipeline, compute shape, compute length or size.
        b.chunk_bytes = Some(17);
        assert!(b.validate().is_err());
        b.chunk_bytes = None;
        b.compute_ctas_per_sm = 0;
        assert!(b.validate().is_err());
        b.compute_ctas_per_sm = 4;
        b.compute_ms = Some(0.0);
        assert!(b.validate().is_err());
        b.compute_ms = None;
        b.bytes = MAX_OVERLAP_BYTES + 1;
        assert!(b.validate().is_err());
        for bytes in [0, (1 << 20) + 2] {
            b.bytes = bytes;
            assert!(matches!(b.validate(), Err(Error::Config { field: "bytes", .. })), "{bytes} B");
        }
        b.bytes = 1 << 20;
        b.iters = 0;
        assert!(matches!(b.validate(), Err(Error::Config { field: "iters", .. })));
        b.iters = 1;
        b.validate().unwrap();

        // The compute's SMs: all of them, or with partitioning those the collective's CTAs leave on
        // that GPU (4 CTAs per rank here), refused where none are left.
        assert_eq!(compute_sms(&b, 132, 8).unwrap(), 132);
        b.partition = true;
        assert_eq!(compute_sms(&b, 132, 8).unwrap(), 100);
        assert_eq!(compute_sms(&b, 132, 1).unwrap(), 128);
        assert_eq!(compute_sms(&b, 132, 32).unwrap(), 4);
        assert!(compute_sms(&b, 132, 33).unwrap_err().to_string().contains("leave no SM"));

        // The mma load: tile multiples only, matrices of at most 2^30 elements, and no partition
        // (its grid is one CTA per tile).
        b.partition = false;
        for (m, n, k, ok) in [
            (8192, 8192, 8192, true),
            (128, 256, 32, true),
            (100, 128, 32, false),
            (128, 0, 32, false),
            (128, 128, 48, false),
            (65536, 32768, 128, false),
            (128, 8192, 262144, false),
            (8192, 128, 262144, false),
        ] {
            b.compute = ComputeLoad::Mma { m, n, k, one_per_sm: false };
            assert_eq!(b.validate().is_ok(), ok, "{m}x{n}x{k}");
        }
        for (m, n, k, ok) in [
            (8192, 8192, 2048, true),
            (128, 256, 64, true),
            (128, 128, 64, false),
            (64, 256, 64, false),
            (128, 256, 32, false),
            (128, 256, 0, false),
            (65536, 32768, 128, false),
        ] {
            b.compute = ComputeLoad::Wgmma { m, n, k };
            assert_eq!(b.validate().is_ok(), ok, "wgmma {m}x{n}x{k}");
        }
        assert_eq!(b.compute.name(), "wgmma-bf16-65536x32768x128");
        b.compute = ComputeLoad::Mma { m: 8192, n: 8192, k: 8192, one_per_sm: true };
        assert_eq!(b.compute.flops(), Some(2.0 * 8192f64.powi(3)));
        b.partition = true;
        assert!(b.validate().unwrap_err().to_string().contains("no SM count to size them for"));
        b.compute = ComputeLoad::Wgmma { m: 8192, n: 8192, k: 2048 };
        assert!(b.validate().unwrap_err().to_string().contains("no SM count to size them for"));
    }

    /// The warpgroup GEMM's shared-memory descriptor: the address's bits 4–17 in bits 0–13, a
    /// leading byte offset of 16 B, a stride of 1024 B (eight 128-byte rows), the 128-byte swizzle;
    /// the k16 steps move only the address.
    #[test]
    fn the_wgmma_descriptor_encodes_a_128_byte_swizzled_operand() {
        use oxccl_bench_kernels::wgmma_shape::{A_BYTES, SMEM, STAGE, STAGES, descriptor_sw128};
        let d = descriptor_sw128(0x400);
        assert_eq!(d & 0x3fff, 0x40);
        assert_eq!(d >> 16 & 0x3fff, 1);
        assert_eq!(d >> 32 & 0x3fff, 64);
        assert_eq!(d >> 49 & 0x7, 0);
        assert_eq!(d >> 62, 1);
        assert_eq!(descriptor_sw128(0x400 + 32) - d, 2);
        // Addresses wrap at 2^18 (14 bits of 16-byte units), as the hardware reads them.
        assert_eq!(descriptor_sw128(0x4_0000 + 0x400), d);
        // One CTA's stages, alignment slack and barriers fit an SM beside a collective CTA.
        assert_eq!(STAGE, A_BYTES * 3);
        const { assert!(SMEM == 1024 + STAGES * STAGE + 48 && SMEM < 160 * 1024) };
    }

    /// The automatic split is contiguous below 64 CTAs, and 4 MiB pieces from there when every CTA
    /// gets one; the others are what they say.
    #[test]
    fn split_pieces_per_cta_count() {
        let gib = 1 << 30;
        assert_eq!(Split::Auto.piece(gib, 1), None);
        assert_eq!(Split::Auto.piece(gib, 63), None);
        assert_eq!(Split::Auto.piece(gib, 64), Some(4 << 20));
        assert_eq!(Split::Auto.piece(gib, 132), Some(4 << 20));
        assert_eq!(Split::Auto.piece(132 << 22, 132), Some(4 << 20));
        assert_eq!(Split::Auto.piece((132 << 22) - 16, 132), None, "some CTA would get no piece");
        assert_eq!(Split::Auto.piece(64 << 20, 132), None);
        assert_eq!(Split::Contiguous.piece(gib, 132), None);
        assert_eq!(Split::Pieces(4096).piece(gib, 1), Some(4096));
    }

    /// What the sweep refuses before it touches a GPU: a size of no or partial f32 elements, a CTA count
    /// of 0 or above the engine's CTAs per rank, threads out of range, a chunk of 0, too many stages,
    /// no timed iteration, pieces that are no multiple of 16, too many of them, or fewer than the
    /// CTAs.
    #[test]
    fn sweep_configuration_refusals() {
        let ok = SweepConfig::default();
        ok.validate().unwrap();
        let refused = |c: SweepConfig, field: &str| match c.validate() {
            Err(Error::Config { field: f, .. }) => assert_eq!(f, field),
            other => panic!("expected a refusal of {field}, got {other:?}"),
        };
        refused(SweepConfig { bytes: (1 << 20) + 2, ..ok.clone() }, "bytes");
        refused(SweepConfig { bytes: 0, ..ok.clone() }, "bytes");
        refused(SweepConfig { iters: 0, ..ok.clone() }, "iters");
        refused(SweepConfig { ctas: vec![1, 0], ..ok.clone() }, "ctas");
        refused(SweepConfig { ctas: vec![257], ..ok.clone() }, "ctas");
        refused(SweepConfig { tma_threads_combine: 0, ..ok.clone() }, "tma_threads_combine");
        refused(SweepConfig { tma_threads_combine: 48, ..ok.clone() }, "tma_threads_combine");
        refused(SweepConfig { simt_threads: 1024, ..ok.clone() }, "simt_threads");
        refused(SweepConfig { chunk_bytes: Some(0), ..ok.clone() }, "chunk_bytes");
        refused(SweepConfig { stages: Some(17), ..ok.clone() }, "stages");
        SweepConfig {
            ctas: vec![256],
            tma_threads_combine: 1024,
            chunk_bytes: Some(16),
            stages: Some(16),
            ..ok.clone()
        }
        .validate()
        .unwrap();
        refused(SweepConfig { split: Split::Pieces(24), ..ok.clone() }, "split");
        refused(SweepConfig { split: Split::Pieces(16), ..ok.clone() }, "split");
        refused(SweepConfig { split: Split::Pieces(16 << 20), ..ok.clone() }, "split");
        SweepConfig { split: Split::Pieces(4 << 20), ..ok }.validate().unwrap();
    }

    /// The sweep's programs cover the range exactly once, contiguous per CTA or in pieces dealt in
    /// turn, whatever the remainder; only the reduce-add's CTAs need more than one warp.
    #[test]
    fn sweep_programs_cover_the_range_once() {
        for (bytes, ctas, piece) in
            [(1u64 << 20, 3u32, None), (1 << 20, 3, Some(4096u64)), (1000 * 16 + 32, 7, Some(160)), (64, 8, Some(16))]
        {
            for op in [SweepOp::Copy, SweepOp::ReduceAdd, SweepOp::ReduceInto] {
                let l = sweep_program(op, bytes, ctas, piece);
                assert_eq!(l.programs.len(), ctas as usize);
                // Only the reduce-add combines in registers; the rest run on one issuing warp.
                assert_eq!(l.combines, op == SweepOp::ReduceAdd, "{op:?}");
                assert_eq!(l.slots, op.sources());
                let mut covered = vec![0u8; bytes as usize];
                for (c, p) in l.programs.iter().enumerate() {
                    let mine = &l.tasks[p.first_task as usize..][..p.task_count as usize];
                    for (k, t) in mine.iter().enumerate() {
                        assert_eq!(t.src_offset, t.dst_offset);
                        if let Some(size) = piece {
                            assert_eq!(t.src_offset, (c as u64 + k as u64 * ctas as u64) * size, "piece order");
                        }
                        covered[t.src_offset as usize..][..t.bytes as usize].iter_mut().for_each(|b| *b += 1);
                    }
                }
                assert!(covered.iter().all(|&n| n == 1), "{bytes} B over {ctas} CTAs, pieces {piece:?}");
            }
        }
    }

    /// A rooted benchmark whose root is not among its ranks is a typed error, before any stream or
    /// device is used.
    #[test]
    fn a_root_outside_the_ranks_is_refused() {
        for collective in [Collective::Broadcast { root: 2 }, Collective::Reduce { root: 2 }] {
            let b = CollectiveBench {
                collective,
                dtype: DType::F32,
                op: ReduceOp::Sum,
                ranks: 2,
                sweep: Sweep { min_bytes: 1 << 20, max_bytes: 1 << 20, factor: 2, iters: 1, warmup: 0, check: true },
                graph_launches: 0,
                untracked: false,
                config: Config::default(),
            };
            let e = collective_bench(&[], &b, |_| {}).unwrap_err();
            assert!(matches!(e, Error::NoSuchRank { rank: 2, ranks: 2 }), "{collective:?}: {e}");
        }
    }

    /// The benchmark's expected outputs agree with the collectives' reference on the benchmark's
    /// inputs, for every collective, dtype and operator.
    #[test]
    fn expected_outputs_match_the_reference() {
        let rooted = |root| [Collective::Broadcast { root }, Collective::Reduce { root }];
        let collectives = [Collective::AllReduce, Collective::ReduceScatter, Collective::AllGather];
        // (collective, in place): the rooted collectives in place too, where the ranks off the root
        // keep their inputs (Reduce) or take the root's (Broadcast).
        let cases = collectives
            .map(|c| (c, false))
            .into_iter()
            .chain([0, 2].into_iter().flat_map(rooted).flat_map(|c| [(c, false), (c, true)]));
        for (collective, in_place) in cases {
            for &dtype in DType::ALL {
                for &op in ReduceOp::ALL {
                    for (ranks, count) in [(1, 5), (3, 40), (8, 37)] {
                        if collective.root().is_some_and(|root| root >= ranks) {
                            continue;
                        }
                        let spec = PlanSpec {
                            collective,
                            count,
                            dtype,
                            op,
                            ranks,
                            in_place,
                            ctas: 1,
                            reduction: Reduction::Registers,
                        };
                        let e = dtype.size() as u64;
                        let (in_bytes, out_bytes) = spec.buffer_bytes();
                        let inputs: Vec<Vec<u8>> =
                            (0..ranks).map(|r| encode_all(dtype, in_bytes / e, |i| pattern(r, i))).collect();
                        let want = tccl::reference(&spec, &inputs);
                        let exp = Expected::new(collective, dtype, op, ranks, count);
                        for (r, w) in want.iter().enumerate() {
                            if !spec.rank_buffers(r).1 {
                                // No output buffer on this rank (a Reduce's off the root).
                                assert!(w.is_empty(), "{collective:?} rank {r}");
                                continue;
                            }
                            let got = encode_with(dtype, out_bytes / e, |i| exp.value(r, i));
                            assert_eq!(got.len(), w.len(), "{collective:?} rank {r}");
                            assert_eq!(count_wrong(&got, w, e as usize), 0, "{collective:?} {dtype:?} {op:?} rank {r}");
                        }
                    }
                }
            }
        }
    }

    /// The tiled encodings used for multi-GiB buffers equal the element-by-element ones, also where
    /// lengths are not multiples of the period and AllGather blocks start mid-period.
    #[test]
    fn periodic_encodings_match_element_by_element() {
        for &dtype in DType::ALL {
            for n in [0, 1, 16, 17, 18, 100, 1000] {
                for r in 0..3 {
                    assert_eq!(
                        encode_periodic_with(dtype, n, |i| enc(dtype, pattern(r, i))),
                        encode_all(dtype, n, |i| pattern(r, i))
                    );
                }
            }
            for collective in Collective::every(0) {
                for (ranks, count) in [(1, 0), (2, 5), (3, 40), (8, 37)] {
                    let exp = Expected::new(collective, dtype, ReduceOp::Sum, ranks, count);
                    let n = if collective == Collective::AllGather { ranks as u64 * count } else { count };
                    for r in 0..ranks {
                        assert_eq!(
                            exp.encode_range(r, 0, n),
                            encode_with(dtype, n, |i| exp.value(r, i)),
                            "{collective:?} {dtype:?} rank {r}"
                        );
                    }
                }
            }
        }
    }

    /// The in-place cyclic comparison counts exactly what a full comparison against the encoded
    /// expectation counts, for ranges starting anywhere, across AllGather blocks, with planted errors.
    #[test]
    fn cyclic_comparison_matches_the_full_one() {
        use rand::{RngExt, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let mut next = |n: u64| rng.random_range(0..n);
        for &dtype in DType::ALL {
            for collective in Collective::every(1) {
                for (ranks, count) in [(2, 5), (3, 17), (4, 70_000), (8, 150_001)] {
                    let exp = Expected::new(collective, dtype, ReduceOp::Sum, ranks, count);
                    let total = if collective == Collective::AllGather { ranks as u64 * count } else { count };
                    let e = dtype.size();
                    for _ in 0..4 {
                        let r = next(ranks as u64) as usize;
                        let start = next(total);
                        let n = next(total - start) + 1;
                        let want = encode_with(dtype, n, |i| exp.value(r, start + i));
                        assert_eq!(exp.encode_range(r, start, n), want, "{collective:?} {dtype:?}");
                        let mut got = want.clone();
                        assert_eq!(exp.count_wrong_range(r, start, &got), 0, "{collective:?} {dtype:?}");
                        for _ in 0..1 + next(3) {
                            let i = next(n) as usize * e;
                            got[i] = !want[i];
                        }
                        assert_eq!(
                            exp.count_wrong_range(r, start, &got),
                            count_wrong(&got, &want, e),
                            "{collective:?} {dtype:?} rank {r} start {start} n {n}"
                        );
                        assert!(count_wrong(&got, &want, e) >= 1);
                    }
                }
            }
        }
    }

    #[test]
    fn count_wrong_counts_elements() {
        assert_eq!(count_wrong(&[1, 2, 3, 4], &[1, 2, 3, 4], 2), 0);
        assert_eq!(count_wrong(&[1, 2, 3, 5], &[1, 2, 3, 4], 2), 1);
        assert_eq!(count_wrong(&[0, 2, 3, 5], &[1, 2, 3, 4], 2), 2);
    }
}

#[cfg(test)]
mod reshard_tests {
    use super::*;

    #[test]
    fn partial_sums_add_up_exactly_in_every_type() {
        for &dtype in DType::ALL {
            for k in [2u64, 3, 8, 16] {
                for i in 0..64 {
                    let e = dtype.size();
                    let mut acc = Partials::new(dtype, k).at(i, Some(0))[..e].to_vec();
                    for p in 1..k {
                        oxccl::host::lowered::combine_into(
                            dtype,
                            ReduceOp::Sum,
                            &mut acc,
                            &Partials::new(dtype, k).at(i, Some(p))[..e],
                        );
                    }
                    assert_eq!(acc, Partials::new(dtype, k).at(i, None)[..e], "{dtype:?} k {k} element {i}");
                    assert_ne!(acc, vec![0; e], "a sum is never 0, so unwritten elements show");
                }
            }
        }
    }

    #[test]
    fn reshard_shards_are_cut_from_the_pattern_tensor() {
        for (shape, mesh, placements, elem) in [
            (vec![5u64, 7], "2x2@1", "S1,S0", 2usize),
            (vec![3, 4, 5], "3@0", "S2", 4),
            (vec![6], "4@2", "S0", 2),
            (vec![], "2@0", "R", 4),
        ] {
            let sharding = Layout::parse(mesh, placements).unwrap().on(&shape).unwrap();
            let global: Vec<u64> = (0..sharding.elements()).map(|i| reshard_pattern(i, elem)).collect();
            for (rank, want) in sharding.local_shards(&global).unwrap() {
                let want: Vec<u8> = want.iter().flat_map(|v| v.to_le_bytes()[..elem].to_vec()).collect();
                assert_eq!(reshard_shard(&sharding, rank, elem), want, "{shape:?} {mesh} {placements} rank {rank}");
            }
        }
        assert!((0..1000).all(|i| reshard_pattern(i, 2) != 0 && reshard_pattern(i, 2) <= 0xFFFF));
    }

    #[test]
    fn the_nvlink_model_picks_the_busiest_link() {
        // TP8 → TP2 × DP4 hierarchical: each receiving leader gets a quarter of its shard across the
        // domain boundary; the forwarding inside the destination domain is on NVLink.
        let plan = reshard::plan(
            &[7168, 18432],
            2,
            &Layout::parse("8@0", "S0").unwrap(),
            &Layout::parse("4x2@8", "R,S0").unwrap(),
            reshard::PlanOptions::default(),
        )
        .unwrap();
        let l = lower(&plan, &LowerOptions::new(16, 8)).unwrap();
        let loads = l.loads(8);
        let shard = 3584 * 18432 * 2u64;
        let (s, link) = busiest_link(&loads, 450.0, 50.0);
        // Every rank 0..8 sends its 33 MB shard out of domain 0 (4 parts of 8.3 MB): 33 MB / 50 GB/s.
        assert_eq!(loads.sent_cross_domain[0], shard / 4);
        assert!((s - (shard / 4) as f64 / 50e9).abs() < 1e-12, "{s} {link}");
        assert!(link.starts_with("domain link"), "{link}");
    }
}

/// The compute kernel of the overlap benchmark.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ComputeLoad {
    /// `bench_fma` (oxccl's probe module): FMA-bound, registers only, no memory traffic.
    Fma,
    /// `bench_sleep` (the probe module): CTAs shaped as the FMA load's that only sleep, the control
    /// for what sharing SMs costs without busy warps.
    Sleep,
    /// cuBLAS bf16 GEMMs `C = A·B` of `m × k` by `k × n` (f32 accumulation, tensor cores): the
    /// realistic neighbour of a collective in training. Needs the `gemm` feature and libcublas.
    Gemm {
        /// Rows of A and C.
        m: u32,
        /// Columns of B and C.
        n: u32,
        /// Columns of A and rows of B.
        k: u32,
    },
    /// oxccl's own bf16 tensor-core GEMM `C = A·Bᵀ` (`bench_gemm_bf16` in the probe module:
    /// `mma.sync`, f32 C): one 128 × 128 tile per CTA of 256 threads, 128 registers each and
    /// 61440 B of shared memory, so that unlike cuBLAS's kernel (384 threads × 168 registers, the
    /// whole register file) it leaves room on its SMs. `m`, `n` multiples of 128, `k` of 32.
    /// Two CTAs fit on an SM (together they fill its registers); `one_per_sm` launches each with
    /// half the SM's shared memory so that at most one does, leaving the other half of the SM's
    /// registers and shared memory free.
    Mma {
        /// Rows of A and C (a multiple of 128).
        m: u32,
        /// Rows of B and columns of C (a multiple of 128).
        n: u32,
        /// Columns of A and B (a multiple of 32).
        k: u32,
        /// Launch each CTA with half the SM's shared memory, so that at most one runs per SM.
        one_per_sm: bool,
    },
    /// oxccl's warpgroup GEMM `C = A·Bᵀ` (`bench_gemm_wgmma` in the probe module), built as Hopper
    /// GEMMs are: tensor copies load the operand tiles into shared memory, `wgmma.mma_async` multiplies
    /// them there, the threads mostly wait. One 128 × 256 tile per CTA of 256 threads, at most 168
    /// registers each and 148528 B (145 KiB) of shared memory: one CTA per SM, which leaves 22528 registers
    /// and about 81 KiB of shared memory for a collective's CTA beside it (cuBLAS's kernel leaves
    /// neither). `m` a multiple of 128, `n` of 256, `k` of 64.
    Wgmma {
        /// Rows of A and C (a multiple of 128).
        m: u32,
        /// Rows of B and columns of C (a multiple of 256).
        n: u32,
        /// Columns of A and B (a multiple of 64).
        k: u32,
    },
}

impl ComputeLoad {
    /// The load's name in reports: `fma`, `sleep`, `gemm-bf16-MxNxK` or `mma-bf16-MxNxK` (with
    /// `-one-per-sm` where it applies).
    pub fn name(self) -> String {
        match self {
            ComputeLoad::Fma => "fma".into(),
            ComputeLoad::Sleep => "sleep".into(),
            ComputeLoad::Gemm { m, n, k } => format!("gemm-bf16-{m}x{n}x{k}"),
            ComputeLoad::Mma { m, n, k, one_per_sm } => {
                format!("mma-bf16-{m}x{n}x{k}{}", if one_per_sm { "-one-per-sm" } else { "" })
            }
            ComputeLoad::Wgmma { m, n, k } => format!("wgmma-bf16-{m}x{n}x{k}"),
        }
    }

    /// Refuses a shape the load cannot run: for [`ComputeLoad::Mma`], `m` and `n` not multiples of
    /// the tile (128), `k` not a multiple of 32; for [`ComputeLoad::Wgmma`], `m` not a multiple of
    /// 128, `n` of 256 or `k` of 64; for either, a matrix over 2^30 elements (the benchmark fills the
    /// operands from the host; the kernel's offsets are 64-bit).
    pub fn validate(self) -> Result<()> {
        let (name, m, n, k, [tm, tn, tk]) = match self {
            ComputeLoad::Mma { m, n, k, .. } => {
                use oxccl_bench_kernels::gemm_shape::{TILE_K, TILE_MN};
                ("mma", m, n, k, [TILE_MN, TILE_MN, TILE_K])
            }
            ComputeLoad::Wgmma { m, n, k } => {
                use oxccl_bench_kernels::wgmma_shape::{TILE_K, TILE_M, TILE_N};
                ("wgmma", m, n, k, [TILE_M, TILE_N, TILE_K])
            }
            _ => return Ok(()),
        };
        let (m64, n64, k64) = (m as u64, n as u64, k as u64);
        if m == 0 || n == 0 || k == 0 || m % tm != 0 || n % tn != 0 || k % tk != 0 {
            return Err(Error::Config {
                field: "gemm",
                why: format!(
                    "{m}x{n}x{k}: for the {name} load M must be a positive multiple of {tm}, N of {tn}, K of {tk}"
                ),
            });
        }
        if [m64 * k64, n64 * k64, m64 * n64].iter().any(|&e| e > 1 << 30) {
            return Err(Error::Config {
                field: "gemm",
                why: format!("{m}x{n}x{k}: for the {name} load every matrix at most 2^30 elements"),
            });
        }
        Ok(())
    }

    /// Floating-point operations of one unit of work (one GEMM), where the load counts them.
    pub fn flops(self) -> Option<f64> {
        match self {
            ComputeLoad::Fma | ComputeLoad::Sleep => None,
            ComputeLoad::Gemm { m, n, k } | ComputeLoad::Mma { m, n, k, .. } | ComputeLoad::Wgmma { m, n, k } => {
                Some(2.0 * m as f64 * n as f64 * k as f64)
            }
        }
    }
}

/// Parameters of the overlap benchmark: an AllReduce on virtual ranks beside a compute kernel on
/// another stream.
#[derive(Clone, Debug)]
pub struct OverlapBench {
    /// What runs beside the collective.
    pub compute: ComputeLoad,
    /// Ranks: one per stream given to [`overlap_bench`].
    pub ranks: usize,
    /// Bytes per rank of the AllReduce (f32 sum).
    pub bytes: u64,
    /// CTAs per rank for the collective.
    pub ctas: u32,
    /// The movers measured: the TMA mover with each of [`OverlapBench::tma_reductions`], the SIMT
    /// mover with registers; each with every [`OverlapBench::suspend_ns`].
    pub movers: Vec<Mover>,
    /// How the TMA mover's rows reduce, each measured: [`Reduction::Registers`] combines the sources
    /// with a CTA of threads, [`Reduction::Tma`] hands them to the bulk reductions, by default from
    /// one warp (fewer issue slots taken from the compute beside it). SIMT rows always use registers.
    pub tma_reductions: Vec<Reduction>,
    /// Suspend-time hints for the collective's waits (ns), each measured.
    pub suspend_ns: Vec<u32>,
    /// The TMA rows' bytes per source per pipeline stage (`None`: the communicator's default). A
    /// smaller pipeline leaves shared memory on the collective's SMs to the compute kernel's CTAs.
    pub chunk_bytes: Option<u32>,
    /// The TMA rows' pipeline stages (`None`: the communicator's default).
    pub stages: Option<u32>,
    /// The TMA rows' threads per CTA (`None`: the communicator's default).
    pub threads: Option<u32>,
    /// The SIMT rows' threads per CTA (`None`: the mover's 512).
    pub simt_threads: Option<u32>,
    /// The TMA rows' issuing warps (`Config::issuers`).
    pub issuers: Option<u32>,
    /// The TMA rows' `Config::combine_direct`.
    pub combine_direct: Option<bool>,
    /// Threads per compute CTA of the FMA and sleep loads (1..=1024).
    pub compute_threads: u32,
    /// Compute CTAs per SM of the FMA and sleep loads (1..=64): their grid is this many times the
    /// SMs the compute is sized for.
    pub compute_ctas_per_sm: u32,
    /// How long the compute work alone should take, in ms (`None`: as long as the first
    /// configuration's collective alone). Repetitions are calibrated once to it.
    pub compute_ms: Option<f64>,
    /// Sizes the compute for the SMs the collective leaves: on each GPU the SMs less the
    /// collective's CTAs there ([`OverlapBench::ctas`] times the ranks on that GPU), given to cuBLAS
    /// as its SM count target (`cublasSetSmCountTarget`, which sizes its grid) or as the FMA grid
    /// (that many SMs' worth of CTAs; the block scheduler still places them on any SM with room).
    /// This is how GEMMs are sized beside communication when SMs are partitioned between the two
    /// (FlashOverlap, T-CCL's overlap benchmark); `false`: the compute is sized for every SM.
    pub partition: bool,
    /// Timed runs of each measurement (alone and together); the times are their means.
    pub iters: usize,
    /// Untimed runs before them.
    pub warmup: usize,
}

/// One row of the overlap benchmark (milliseconds, means over the iterations).
#[derive(Clone, Debug, serde::Serialize)]
pub struct OverlapRow {
    /// The compute load's name ([`ComputeLoad::name`]).
    pub compute: String,
    /// FMA iterations per thread, or GEMMs, per compute call (calibrated once so that the compute
    /// alone takes about [`OverlapBench::compute_ms`], or as long as the first configuration's
    /// collective; at least one).
    pub compute_reps: u32,
    /// SMs the compute is sized for on the first GPU (all unless [`OverlapBench::partition`]; the
    /// mma load is a grid of tiles sized for no SM count, and reports all).
    pub compute_sms: u32,
    /// Registers per thread of the compute kernel, where oxccl launches it (the mma load), as the
    /// driver reports them.
    pub compute_registers: Option<u32>,
    /// `tma` or `simt`.
    pub mover: &'static str,
    /// `registers` or `tma` (see [`OverlapBench::tma_reductions`]).
    pub reduction: &'static str,
    /// The collective's CTAs per rank, as the launch resolved them.
    pub ctas: u32,
    /// The collective's threads per CTA.
    pub threads: u32,
    /// The collective's dynamic shared memory per CTA, in bytes.
    pub smem_bytes: u32,
    /// The collective's issuing warps per TMA CTA (1 for SIMT rows).
    pub issuers: u32,
    /// Whether the TMA register combine stored AllReduce's result from registers to every rank
    /// (`Config::combine_direct`, as the launch resolved it; `false` for other rows).
    pub combine_direct: bool,
    /// Suspend-time hint of the collective's waits (ns).
    pub suspend_ns: u32,
    /// The compute work alone, per call.
    pub compute_alone_ms: f64,
    /// The AllReduce alone, per call.
    pub collective_alone_ms: f64,
    /// From the common start to the compute's end, when both run at once.
    pub compute_together_ms: f64,
    /// From the common start to the collective's end, when both run at once.
    pub collective_together_ms: f64,
    /// From the common start until both are done.
    pub makespan_ms: f64,
    /// Makespan over the sum of the times alone (1: no overlap, 0.5: perfect overlap of equals).
    pub makespan_over_serial: f64,
}

/// Longest compute work [`OverlapBench::compute_ms`] may ask for.
pub const MAX_COMPUTE_MS: f64 = 60_000.0;

/// Largest AllReduce per rank [`overlap_bench`] takes (its inputs are filled from the host).
pub const MAX_OVERLAP_BYTES: u64 = 16 << 30;

impl OverlapBench {
    /// Checks what [`overlap_bench`] would refuse, without a GPU: the rank count, the compute shape,
    /// every row's communicator configuration, the compute length, the buffer size and the
    /// iteration count.
    pub fn validate(&self) -> Result<()> {
        let b = self;
        if b.ranks == 0 || b.ranks > MAX_RANKS {
            return Err(Error::RankCount { ranks: b.ranks, max: MAX_RANKS });
        }
        b.compute.validate()?;
        if let Some(t) = b.simt_threads {
            oxccl::config::check_threads("simt_threads", t, 512)?;
        }
        if b.partition && matches!(b.compute, ComputeLoad::Mma { .. } | ComputeLoad::Wgmma { .. }) {
            return Err(Error::Config {
                field: "partition",
                why: "the mma and wgmma loads are grids of one CTA per tile, placed by the hardware wherever \
                      there is room: there is no SM count to size them for (fma and gemm take --partition)"
                    .into(),
            });
        }
        if b.compute_threads == 0 || b.compute_threads > 1024 || !(1..=64).contains(&b.compute_ctas_per_sm) {
            return Err(Error::Config {
                field: "compute shape",
                why: format!(
                    "{} CTAs of {} threads per SM: give 1..=64 CTAs of 1..=1024 threads",
                    b.compute_ctas_per_sm, b.compute_threads
                ),
            });
        }
        for (mover, reduction) in overlap_variants(b) {
            for &suspend in &b.suspend_ns {
                oxccl::config::validate_config(&overlap_config(b, mover, reduction, suspend))?;
            }
        }
        if let Some(ms) = b.compute_ms
            && !(ms > 0.0 && ms <= MAX_COMPUTE_MS)
        {
            return Err(Error::Config {
                field: "compute_ms",
                why: format!("{ms} ms: the compute work alone must take more than 0 and at most {MAX_COMPUTE_MS} ms"),
            });
        }
        check_f32_bytes(b.bytes, " per rank")?;
        check_iters(b.iters)?;
        if b.bytes > MAX_OVERLAP_BYTES {
            return Err(Error::Config {
                field: "bytes",
                why: format!(
                    "{} B per rank: the overlap benchmark fills its inputs from the host; at most {MAX_OVERLAP_BYTES}",
                    b.bytes
                ),
            });
        }
        Ok(())
    }
}

/// Runs the overlap benchmark with rank `r` on `streams[r]` (virtual ranks on one stream, or one
/// rank per GPU): the compute work runs on a stream of its own on every GPU involved. The compute
/// repetitions are chosen once so that the compute alone takes about `compute_ms`, or as long as
/// the first configuration's collective: every row runs the same compute, so their makespans
/// compare, and a row whose collective alone is longer or shorter than the compute has less to hide
/// (its `/serial` cannot go below max(compute, collective) / (compute + collective)). Together, the
/// collective and the compute are queued behind a start gate and start when it opens, the
/// collective first. Every configuration is checked before anything is
/// allocated. With several GPUs each time is the longest over the GPUs, every span
/// measured between events of one GPU from a common start (the collective's barriers align them).
/// `on_row` is called as each configuration is measured ([`OverlapBench::rows`] in all).
pub fn overlap_bench(
    streams: &[Arc<CudaStream>],
    b: &OverlapBench,
    mut on_row: impl FnMut(&OverlapRow),
) -> Result<Vec<OverlapRow>> {
    b.validate()?;
    if streams.len() != b.ranks {
        return Err(Error::BufferCount { what: "rank streams", expected: b.ranks, got: streams.len() });
    }
    // The collective's distinct streams ("lanes") and, per device, a compute stream and its work.
    let mut lanes: Vec<Arc<CudaStream>> = Vec::new();
    for s in streams {
        let same =
            |l: &Arc<CudaStream>| l.context().ordinal() == s.context().ordinal() && l.cu_stream() == s.cu_stream();
        if !lanes.iter().any(same) {
            lanes.push(s.clone());
        }
    }
    let mut ordinals: Vec<usize> = Vec::new();
    let mut compute_streams: Vec<Arc<CudaStream>> = Vec::new();
    let mut works: Vec<Compute> = Vec::new();
    for l in &lanes {
        let ordinal = l.context().ordinal();
        if !ordinals.contains(&ordinal) {
            let sms = sm_count(l.context())?;
            let ranks_here = streams.iter().filter(|s| s.context().ordinal() == ordinal).count() as u32;
            let compute_sms = compute_sms(b, sms, ranks_here)?;
            let cs = l.context().new_stream().map_err(Error::driver("cuStreamCreate"))?;
            works.push(Compute::new(&cs, b.compute, (b.compute_threads, b.compute_ctas_per_sm), compute_sms, sms)?);
            compute_streams.push(cs);
            ordinals.push(ordinal);
        }
    }
    // The compute stream (index) on each lane's device.
    let device_of: Vec<usize> =
        lanes.iter().map(|l| ordinals.iter().position(|&o| o == l.context().ordinal()).unwrap_or(0)).collect();
    let probe = works[0].probe_reps();
    let compute_sms = works[0].sms;
    let compute_registers = works[0].registers();
    let launch_compute = |works: &mut [Compute], reps: u32| -> Result<()> {
        for w in works.iter_mut() {
            w.launch(reps)?;
        }
        Ok(())
    };

    let n = (b.bytes / 4) as usize;
    let send: Vec<CudaSlice<f32>> = streams
        .iter()
        .enumerate()
        .map(|(r, s)| s.clone_htod(&vec![r as f32; n]).map_err(Error::driver("cuMemcpyHtoD")))
        .collect::<Result<_>>()?;
    let mut recv: Vec<CudaSlice<f32>> =
        streams.iter().map(|s| s.alloc_zeros(n).map_err(Error::driver("cuMemAlloc"))).collect::<Result<_>>()?;
    for s in streams {
        s.synchronize().map_err(Error::driver("cuStreamSynchronize"))?;
    }

    let event =
        |s: &CudaStream| s.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).map_err(Error::driver("cuEventRecord"));
    let elapsed = |a: &cudarc::driver::CudaEvent, z: &cudarc::driver::CudaEvent| -> Result<f64> {
        z.synchronize().map_err(Error::driver("cuEventSynchronize"))?;
        Ok(a.elapsed_ms(z).map_err(Error::driver("cuEventElapsedTime"))? as f64)
    };
    let sync_all = || -> Result<()> {
        for s in lanes.iter().chain(&compute_streams) {
            s.synchronize().map_err(Error::driver("cuStreamSynchronize"))?;
        }
        Ok(())
    };

    let mut rows = Vec::new();
    let mut reps = 0u32;
    for (mover, reduction) in overlap_variants(b) {
        for &suspend in &b.suspend_ns {
            let config = overlap_config(b, mover, reduction, suspend);
            let comm = Communicator::from_streams(streams, config)?;
            let launch = comm.prepare::<f32>(Collective::AllReduce, n, ReduceOp::Sum, false)?;
            let mut collective = || comm.all_reduce(&send, &mut recv, ReduceOp::Sum);
            let coll_alone = time_ms_on(streams, b.warmup, b.iters, &mut collective)?;
            if reps == 0 {
                // Calibrate once: the compute work alone takes about as long as asked, or as the
                // first collective (the nearest whole number of repetitions).
                let t = time_ms_on(&compute_streams, 1, 3, || launch_compute(&mut works, probe))?;
                works.iter().try_for_each(Compute::check)?;
                reps = compute_reps(probe, t, b.compute_ms.unwrap_or(coll_alone))?;
            }
            let comp_alone = time_ms_on(&compute_streams, b.warmup, b.iters, || launch_compute(&mut works, reps))?;
            let (mut comp_t, mut coll_t, mut span) = (0.0, 0.0, 0.0);
            for it in 0..b.warmup + b.iters {
                sync_all()?;
                // Everything is queued behind a gate and starts when it opens: the times do not
                // include the host's queuing. The collective is queued first, and the compute waits
                // for the collective's start (as T-CCL runs its AllReduce on a high-priority stream).
                let gate = oxccl::gate::HostGate::new(std::time::Duration::from_secs(60));
                for l in &lanes {
                    gate.hold(l)?;
                }
                let starts = lanes.iter().map(|l| event(l)).collect::<Result<Vec<_>>>()?;
                for (i, start) in starts.iter().enumerate() {
                    compute_streams[device_of[i]].wait(start).map_err(Error::driver("cuStreamWaitEvent"))?;
                }
                collective()?;
                launch_compute(&mut works, reps)?;
                let coll_ends = lanes.iter().map(|l| event(l)).collect::<Result<Vec<_>>>()?;
                let comp_ends = compute_streams.iter().map(|c| event(c)).collect::<Result<Vec<_>>>()?;
                let mut all_ends = Vec::with_capacity(lanes.len());
                for (i, l) in lanes.iter().enumerate() {
                    l.wait(&comp_ends[device_of[i]]).map_err(Error::driver("cuStreamWaitEvent"))?;
                    all_ends.push(event(l)?);
                }
                let forced = gate.forced();
                gate.release();
                if forced {
                    return Err(Error::Config {
                        field: "overlap",
                        why: "queuing the collective and the compute took over 60 s behind the start gate".into(),
                    });
                }
                if it >= b.warmup {
                    let (mut c, mut k, mut m) = (0f64, 0f64, 0f64);
                    for i in 0..lanes.len() {
                        k = k.max(elapsed(&starts[i], &coll_ends[i])?);
                        c = c.max(elapsed(&starts[i], &comp_ends[device_of[i]])?);
                        m = m.max(elapsed(&starts[i], &all_ends[i])?);
                    }
                    coll_t += k;
                    comp_t += c;
                    span += m;
                }
            }
            comm.synchronize()?;
            let k = b.iters.max(1) as f64;
            let (comp_t, coll_t, span) = (comp_t / k, coll_t / k, span / k);
            rows.push(OverlapRow {
                compute: b.compute.name(),
                compute_reps: reps,
                compute_sms,
                compute_registers,
                mover: mover.name(),
                reduction: match reduction {
                    Reduction::Registers => "registers",
                    Reduction::Tma => "tma",
                },
                ctas: launch.ctas_per_rank,
                threads: launch.spec.threads,
                smem_bytes: launch.smem_bytes,
                issuers: launch.spec.issuers.max(1),
                combine_direct: mover == Mover::Tma && reduction == Reduction::Registers && launch.spec.combine_direct,
                suspend_ns: suspend,
                compute_alone_ms: comp_alone,
                collective_alone_ms: coll_alone,
                compute_together_ms: comp_t,
                collective_together_ms: coll_t,
                makespan_ms: span,
                makespan_over_serial: span / (comp_alone + coll_alone),
            });
            on_row(&rows[rows.len() - 1]);
        }
    }
    // A warpgroup GEMM that gave up on a wait ran short: its times would mislead.
    works.iter().try_for_each(Compute::check)?;
    Ok(rows)
}

impl OverlapBench {
    /// Rows of [`overlap_bench`]: every (mover, reduction) with each suspend-time hint.
    pub fn rows(&self) -> usize {
        overlap_variants(self).len() * self.suspend_ns.len()
    }
}

/// The (mover, reduction) of every configuration [`overlap_bench`] measures: each TMA reduction
/// asked for, and the SIMT mover with registers.
fn overlap_variants(b: &OverlapBench) -> Vec<(Mover, Reduction)> {
    let mut v = Vec::new();
    for &mover in &b.movers {
        match mover {
            Mover::Tma => v.extend(b.tma_reductions.iter().map(|&r| (mover, r))),
            Mover::Simt | Mover::Latency => v.push((mover, Reduction::Registers)),
        }
    }
    v
}

/// The SMs of `ctx`'s GPU.
fn sm_count(ctx: &Arc<cudarc::driver::CudaContext>) -> Result<u32> {
    let n = ctx
        .attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        .map_err(Error::driver("cuDeviceGetAttribute"))?;
    Ok(n.max(0) as u32)
}

/// The SMs the compute is sized for on a GPU of `sms` SMs holding `ranks_here` of the collective's ranks:
/// all of them, or with [`OverlapBench::partition`] those the collective's CTAs leave.
fn compute_sms(b: &OverlapBench, sms: u32, ranks_here: u32) -> Result<u32> {
    if !b.partition {
        return Ok(sms);
    }
    let taken = b.ctas as u64 * ranks_here as u64;
    if taken >= sms as u64 {
        return Err(Error::Config {
            field: "partition",
            why: format!(
                "{} CTAs per rank x {ranks_here} ranks on a GPU of {sms} SMs leave no SM to the compute",
                b.ctas
            ),
        });
    }
    Ok(sms - taken as u32)
}

/// The collective's configuration in one row of [`overlap_bench`]: deterministic where the
/// reduction allows it (registers), not with the bulk reductions; the pipeline and threads asked
/// for apply to the TMA rows, the SIMT threads to the SIMT rows.
fn overlap_config(b: &OverlapBench, mover: Mover, reduction: Reduction, suspend_ns: u32) -> Config {
    let tma = mover == Mover::Tma;
    Config {
        max_ctas: Some(b.ctas),
        mover,
        reduction,
        deterministic: reduction == Reduction::Registers,
        wait_suspend_ns: suspend_ns,
        chunk_bytes: b.chunk_bytes.filter(|_| tma),
        stages: b.stages.filter(|_| tma),
        threads: if tma { b.threads } else { b.simt_threads },
        issuers: b.issuers.filter(|_| tma),
        combine_direct: b.combine_direct.filter(|_| tma),
        ..Config::default()
    }
}

/// The overlap benchmark's compute work on its own stream, launched `reps` times per call.
struct Compute {
    stream: Arc<CudaStream>,
    /// SMs the work is sized for.
    sms: u32,
    kind: ComputeKind,
}

/// What [`Compute`] launches.
enum ComputeKind {
    /// The probe module's FMA or sleep kernel, a fixed grid.
    Probe {
        function: cudarc::driver::CudaFunction,
        /// One f32 per thread of the grid; `out_ptr` is its address.
        _out: CudaSlice<f32>,
        out_ptr: u64,
        config: cudarc::driver::LaunchConfig,
    },
    /// The probe module's tensor-core GEMM (`bench_gemm_bf16`), one CTA per tile of C.
    Mma {
        function: cudarc::driver::CudaFunction,
        /// The operands and C, kept alive for the launches; `ptrs` are their addresses.
        _operands: [CudaSlice<half::bf16>; 2],
        _c: CudaSlice<f32>,
        ptrs: [u64; 3],
        n: u32,
        k: u32,
        config: cudarc::driver::LaunchConfig,
        /// Registers per thread of the loaded kernel, as the driver reports them.
        registers: u32,
    },
    /// The probe module's warpgroup GEMM (`bench_gemm_wgmma`), one CTA per tile of C.
    Wgmma {
        function: cudarc::driver::CudaFunction,
        /// The operands, C and the two tensor maps (A's, then B's), kept alive for the launches;
        /// `ptrs` are the maps' and C's addresses.
        _operands: [CudaSlice<half::bf16>; 2],
        _c: CudaSlice<f32>,
        _maps: CudaSlice<u64>,
        /// The kernel's time-out record (zero while every wait succeeds).
        status: CudaSlice<u32>,
        ptrs: [u64; 3],
        n: u32,
        k: u32,
        config: cudarc::driver::LaunchConfig,
        /// Registers per thread of the loaded kernel, as the driver reports them.
        registers: u32,
    },
    /// cuBLAS bf16 GEMMs on column-major matrices, C (m × n) = A (m × k) · B (k × n).
    #[cfg(feature = "gemm")]
    Gemm {
        blas: cudarc::cublas::CudaBlas,
        a: CudaSlice<half::bf16>,
        b: CudaSlice<half::bf16>,
        c: CudaSlice<half::bf16>,
        m: u32,
        n: u32,
        k: u32,
    },
}

/// The kernel `name` of the benchmark module (the overlap benchmark's compute kernels, the
/// `tma_trace` copy), loaded on `stream`'s GPU, allowed `smem` bytes of dynamic shared memory per
/// launch and asking, as the engine's kernels do, for the whole unified L1 / shared memory as
/// shared memory: an SM the driver configured for one kernel then fits the other's CTAs, whichever
/// launched first (with the driver's choice, CTAs of a kernel launched after this one that need
/// shared memory wait for its SMs to drain), and what one kernel's CTAs leave is there for the
/// CTAs beside them.
fn bench_function(stream: &Arc<CudaStream>, name: &str, smem: u32) -> Result<cudarc::driver::CudaFunction> {
    use cudarc::driver::sys::CUfunction_attribute::{
        CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
    };
    let module = stream
        .context()
        .load_module(cudarc::nvrtc::Ptx::from_src(crate::ptx::BENCH))
        .map_err(Error::driver("cuModuleLoadData"))?;
    let function = module.load_function(name).map_err(Error::driver("cuModuleGetFunction"))?;
    let smem = i32::try_from(smem)
        .map_err(|_| Error::Config { field: "shared memory", why: format!("{smem} B for {name}") })?;
    function
        .set_attribute(CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem)
        .map_err(Error::driver("cuFuncSetAttribute"))?;
    function
        .set_attribute(CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, 100)
        .map_err(Error::driver("cuFuncSetAttribute"))?;
    Ok(function)
}

/// The two tensor maps `bench_gemm_wgmma` reads (A's, then B's, 128 bytes each, as 32 words): the
/// row-major bf16 operands at `a` (`m × k`) and `b` (`n × k`), boxes of 64 × 128 and 64 × 256
/// elements, 128-byte swizzle, as `wgmma_shape` lays out a stage.
///
/// # Errors
/// The driver's error when it refuses a map (an address not 16-byte aligned, a row of more than
/// 2^40 bytes).
pub fn wgmma_maps(a: u64, b: u64, m: u32, n: u32, k: u32) -> Result<[u64; 32]> {
    use cudarc::driver::sys;
    use oxccl_bench_kernels::wgmma_shape::{TILE_K, TILE_M, TILE_N};
    let map = |addr: u64, rows: u32, box_rows: u32| {
        trace::encode_tiled_map(
            sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
            addr,
            &[k as u64, rows as u64],
            &[k as u64 * 2],
            &[TILE_K, box_rows],
            sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        )
    };
    let mut out = [0u64; 32];
    out[..16].copy_from_slice(&map(a, m, TILE_M)?);
    out[16..].copy_from_slice(&map(b, n, TILE_N)?);
    Ok(out)
}

/// A GEMM operand of `len` bf16 on `stream`: small values, so products stay finite; the values do
/// not matter for timing.
fn gemm_operand(stream: &Arc<CudaStream>, len: u64, step: u64) -> Result<CudaSlice<half::bf16>> {
    let host: Vec<half::bf16> = (0..len).map(|i| half::bf16::from_f32(((i * step) % 7) as f32 / 64.0 - 0.05)).collect();
    stream.clone_htod(&host).map_err(Error::driver("cuMemcpyHtoD"))
}

impl Compute {
    /// The compute work `load` on `stream`, sized for `sms` of the GPU's `all_sms` SMs (the FMA
    /// grid of `ctas_per_sm` CTAs of `threads` per SM, or cuBLAS's SM count target where fewer
    /// than all).
    fn new(
        stream: &Arc<CudaStream>,
        load: ComputeLoad,
        (threads, ctas_per_sm): (u32, u32),
        sms: u32,
        all_sms: u32,
    ) -> Result<Compute> {
        let kind = match load {
            ComputeLoad::Fma | ComputeLoad::Sleep => {
                let function =
                    bench_function(stream, if load == ComputeLoad::Fma { "bench_fma" } else { "bench_sleep" }, 0)?;
                let grid = sms * ctas_per_sm;
                let mut out: CudaSlice<f32> =
                    stream.alloc_zeros((grid * threads) as usize).map_err(Error::driver("cuMemAlloc"))?;
                let out_ptr = out.device_ptr_mut(stream).0;
                let config = cudarc::driver::LaunchConfig {
                    grid_dim: (grid, 1, 1),
                    block_dim: (threads, 1, 1),
                    shared_mem_bytes: 0,
                };
                ComputeKind::Probe { function, _out: out, out_ptr, config }
            }
            ComputeLoad::Gemm { m, n, k } => Self::gemm(stream, m, n, k, (sms < all_sms).then_some(sms))?,
            ComputeLoad::Mma { m, n, k, one_per_sm } => Self::mma(stream, m, n, k, one_per_sm)?,
            ComputeLoad::Wgmma { m, n, k } => Self::wgmma(stream, m, n, k)?,
        };
        Ok(Compute { stream: stream.clone(), sms, kind })
    }

    /// The probe module's tensor-core GEMM and its matrices (shape checked by
    /// [`ComputeLoad::validate`], through [`OverlapBench::validate`] at the start of
    /// [`overlap_bench`]).
    fn mma(stream: &Arc<CudaStream>, m: u32, n: u32, k: u32, one_per_sm: bool) -> Result<ComputeKind> {
        use oxccl_bench_kernels::gemm_shape::{SMEM, THREADS, TILE_MN, one_per_sm_smem};
        let smem = if one_per_sm {
            let per_sm = stream
                .context()
                .attribute(
                    cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR,
                )
                .map_err(Error::driver("cuDeviceGetAttribute"))? as u32;
            one_per_sm_smem(per_sm)
        } else {
            SMEM
        };
        let function = bench_function(stream, "bench_gemm_bf16", smem)?;
        let registers = function
            .get_attribute(cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_NUM_REGS)
            .map_err(Error::driver("cuFuncGetAttribute"))? as u32;
        let (a, b) = (gemm_operand(stream, m as u64 * k as u64, 3)?, gemm_operand(stream, n as u64 * k as u64, 5)?);
        let mut c: CudaSlice<f32> = stream.alloc_zeros(m as usize * n as usize).map_err(Error::driver("cuMemAlloc"))?;
        let ptrs = [a.device_ptr(stream).0, b.device_ptr(stream).0, c.device_ptr_mut(stream).0];
        let config = cudarc::driver::LaunchConfig {
            grid_dim: ((m / TILE_MN) * (n / TILE_MN), 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: smem,
        };
        Ok(ComputeKind::Mma { function, _operands: [a, b], _c: c, ptrs, n, k, config, registers })
    }

    /// The probe module's warpgroup GEMM, its matrices and their tensor maps (shape checked as for
    /// [`Compute::mma`]).
    fn wgmma(stream: &Arc<CudaStream>, m: u32, n: u32, k: u32) -> Result<ComputeKind> {
        use oxccl_bench_kernels::wgmma_shape::{SMEM, THREADS, TILE_M, TILE_N};
        let function = bench_function(stream, "bench_gemm_wgmma", SMEM)?;
        let registers = function
            .get_attribute(cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_NUM_REGS)
            .map_err(Error::driver("cuFuncGetAttribute"))? as u32;
        let (a, b) = (gemm_operand(stream, m as u64 * k as u64, 3)?, gemm_operand(stream, n as u64 * k as u64, 5)?);
        let mut c: CudaSlice<f32> = stream.alloc_zeros(m as usize * n as usize).map_err(Error::driver("cuMemAlloc"))?;
        let host = wgmma_maps(a.device_ptr(stream).0, b.device_ptr(stream).0, m, n, k)?;
        let maps: CudaSlice<u64> = stream.clone_htod(&host[..]).map_err(Error::driver("cuMemcpyHtoD"))?;
        // Word 0: a wait that gave up; 1–8: CTA 0's progress (see the kernel).
        let mut status: CudaSlice<u32> = stream.alloc_zeros(9).map_err(Error::driver("cuMemAlloc"))?;
        let ptrs = [maps.device_ptr(stream).0, c.device_ptr_mut(stream).0, status.device_ptr_mut(stream).0];
        let config = cudarc::driver::LaunchConfig {
            grid_dim: ((m / TILE_M) * (n / TILE_N), 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: SMEM,
        };
        Ok(ComputeKind::Wgmma {
            function,
            _operands: [a, b],
            _c: c,
            _maps: maps,
            status,
            ptrs,
            n,
            k,
            config,
            registers,
        })
    }

    /// cuBLAS and the GEMM's matrices; `sm_target`: the SMs cuBLAS should plan for.
    #[cfg(feature = "gemm")]
    fn gemm(stream: &Arc<CudaStream>, m: u32, n: u32, k: u32, sm_target: Option<u32>) -> Result<ComputeKind> {
        let (m64, n64, k64) = (m as u64, n as u64, k as u64);
        if m == 0 || n == 0 || k == 0 || [m64 * k64, k64 * n64, m64 * n64].iter().any(|&e| e > 1 << 30) {
            return Err(Error::Config {
                field: "gemm shape",
                why: format!("{m}x{n}x{k}: every dimension at least 1, every matrix at most 2^30 elements"),
            });
        }
        // SAFETY: only looks for the library; loading it has no side effects on failure.
        if !unsafe { cudarc::cublas::sys::is_culib_present() } {
            return Err(Error::Config {
                field: "compute",
                why: "libcublas was not found: put its folder on LD_LIBRARY_PATH".into(),
            });
        }
        let blas = cudarc::cublas::CudaBlas::new(stream.clone())
            .map_err(|e| Error::Config { field: "compute", why: format!("cublasCreate: {e:?}") })?;
        if let Some(target) = sm_target {
            // SAFETY: the handle is live (owned by `blas`); the call only sets a planning hint.
            let status = unsafe { cudarc::cublas::sys::cublasSetSmCountTarget(*blas.handle(), target as i32) };
            if status != cudarc::cublas::sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
                return Err(Error::Config {
                    field: "partition",
                    why: format!("cublasSetSmCountTarget({target}): {status:?}"),
                });
            }
        }
        let a = gemm_operand(stream, m64 * k64, 3)?;
        let b = gemm_operand(stream, k64 * n64, 5)?;
        let c = stream.alloc_zeros(m64 as usize * n as usize).map_err(Error::driver("cuMemAlloc"))?;
        Ok(ComputeKind::Gemm { blas, a, b, c, m, n, k })
    }

    /// Refuses the GEMM load: this build has no cuBLAS bindings.
    #[cfg(not(feature = "gemm"))]
    fn gemm(_: &Arc<CudaStream>, _: u32, _: u32, _: u32, _: Option<u32>) -> Result<ComputeKind> {
        Err(Error::Config {
            field: "compute",
            why: "this build has no cuBLAS bindings: build with `--features gemm` for the GEMM load".into(),
        })
    }

    /// Refuses work that did not run as launched: the warpgroup GEMM records a wait that gave up
    /// (waits for the compute stream first).
    fn check(&self) -> Result<()> {
        if let ComputeKind::Wgmma { status, .. } = &self.kind {
            let st = self.stream.clone_dtoh(status).map_err(Error::driver("cuMemcpyDtoH"))?[0];
            if st != 0 {
                return Err(Error::Config {
                    field: "compute",
                    why: format!(
                        "the wgmma GEMM gave up waiting for tile {} to be {} (a second): its stage never completed",
                        st & 0xfff_ffff,
                        if st >> 28 == 1 { "loaded" } else { "released" }
                    ),
                });
            }
        }
        Ok(())
    }

    /// Registers per thread of the kernel oxccl launches for this work (the mma load's).
    fn registers(&self) -> Option<u32> {
        match self.kind {
            ComputeKind::Mma { registers, .. } | ComputeKind::Wgmma { registers, .. } => Some(registers),
            _ => None,
        }
    }

    /// Repetitions for the calibration run.
    fn probe_reps(&self) -> u32 {
        match self.kind {
            ComputeKind::Probe { .. } => 1 << 14,
            ComputeKind::Mma { .. } | ComputeKind::Wgmma { .. } => 4,
            #[cfg(feature = "gemm")]
            ComputeKind::Gemm { .. } => 4,
        }
    }

    /// Queues the work on the compute stream: `reps` FMA iterations per thread, or `reps` GEMMs.
    fn launch(&mut self, reps: u32) -> Result<()> {
        use cudarc::driver::PushKernelArg;
        match &mut self.kind {
            ComputeKind::Probe { function, out_ptr, config, .. } => {
                let seed = 1.0f32;
                let mut l = self.stream.launch_builder(function);
                l.arg(&*out_ptr).arg(&reps).arg(&seed);
                // SAFETY: `out` holds one f32 per thread of the grid; the kernel touches nothing else.
                unsafe { l.launch(*config) }.map(|_| ()).map_err(Error::driver("cuLaunchKernel"))
            }
            ComputeKind::Mma { function, ptrs, n, k, config, .. }
            | ComputeKind::Wgmma { function, ptrs, n, k, config, .. } => {
                for _ in 0..reps {
                    let mut l = self.stream.launch_builder(function);
                    l.arg(&ptrs[0]).arg(&ptrs[1]).arg(&ptrs[2]).arg(&*n).arg(&*k);
                    // SAFETY: the buffers behind `ptrs` were allocated for the grid's shape, which
                    // `ComputeLoad::validate` checked against the kernel's tile: for the mma GEMM
                    // A (m × k), B (n × k) and C (m × n), 16-byte aligned; for the wgmma GEMM the
                    // two tensor maps of A and B (`wgmma_maps`), C and the nine status words. The
                    // block and the dynamic shared memory are the kernel's (`gemm_shape` or
                    // `wgmma_shape`), allowed by the attribute set in `Compute::mma` or
                    // `Compute::wgmma`; nothing else touches the buffers.
                    unsafe { l.launch(*config) }.map_err(Error::driver("cuLaunchKernel"))?;
                }
                Ok(())
            }
            #[cfg(feature = "gemm")]
            ComputeKind::Gemm { blas, a, b, c, m, n, k } => {
                use cudarc::cublas::{Gemm, GemmConfig, sys::cublasOperation_t::CUBLAS_OP_N};
                // cuBLAS launches in the current context: make it this GPU's.
                oxccl::engine::bind(self.stream.context())?;
                // Column-major C (m × n) = A (m × k) · B (k × n).
                let cfg = GemmConfig {
                    transa: CUBLAS_OP_N,
                    transb: CUBLAS_OP_N,
                    m: *m as i32,
                    n: *n as i32,
                    k: *k as i32,
                    alpha: half::bf16::ONE,
                    lda: *m as i32,
                    ldb: *k as i32,
                    beta: half::bf16::ZERO,
                    ldc: *m as i32,
                };
                for _ in 0..reps {
                    // SAFETY: A, B and C were allocated with exactly these shapes and leading dimensions.
                    unsafe { blas.gemm(cfg, &*a, &*b, &mut *c) }
                        .map_err(|e| Error::Config { field: "compute", why: format!("cublasGemmEx: {e:?}") })?;
                }
                Ok(())
            }
        }
    }
}
