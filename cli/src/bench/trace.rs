//! `oxccl bench tma_trace`: the TMA copy's issuing loop timed item by item, alone and beside a
//! compute load, to show where a copy beside busy warps loses its time: in the loads' latency (the
//! issuer waits for data), or in the issuer itself (the data has landed when it looks).
//!
//! The kernel is the probe module's `bench_tma_trace`: lane 0 of each warp streams its slice
//! through its own ring of shared-memory stages as the engine's TMA mover does (same refill rule),
//! reading `%clock64` at each step, and first times a dependent instruction chain of the
//! [`ChainOp`] kind (ALU by default; its share of its scheduler's issue slots).

use super::{
    CHECK_PIECE, Compute, ComputeLoad, MAX_COMPUTE_MS, bench_function, encode_all, fill_periodic, pattern, sm_count,
    time_ms_on,
};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut, PushKernelArg};
use oxccl::DType;
use oxccl::{Error, Result};
use std::sync::Arc;

use oxccl_bench_kernels::trace_layout::{self as layout, BARRIER_BYTES, MAX_BARRIERS, MAX_LAG};
/// Items traced per warp at most (16 bytes of trace each).
const MAX_TRACED: u32 = 1 << 14;
/// Steps of the ALU chain (two dependent instructions each).
const CHAIN: u32 = 1 << 14;

/// The instructions of the issuer's timed chain (`bench_tma_trace`'s `chain_op`): each step
/// depends on the last, so the chain's cycles per step show how often the issuer gets a slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChainOp {
    /// Two ALU instructions per step (`xor`, `shf`).
    Alu = 0,
    /// Two `fma.rn.f32`, the FMA load's own pipe.
    Fma = 1,
    /// One `ld.shared` and its address arithmetic (the memory pipe).
    Shared = 2,
    /// Eight independent streams of the ALU step per step (16 instructions that need not wait on
    /// each other): whether a warp that could issue back to back gets more slots per turn.
    Ilp = 3,
}

impl ChainOp {
    /// Every chain, in the order of the codes the kernel takes.
    pub const ALL: [ChainOp; 4] = [ChainOp::Alu, ChainOp::Fma, ChainOp::Shared, ChainOp::Ilp];

    /// The name `--chain` takes and the rows report.
    pub fn name(self) -> &'static str {
        match self {
            ChainOp::Alu => "alu",
            ChainOp::Fma => "fma",
            ChainOp::Shared => "shared",
            ChainOp::Ilp => "ilp",
        }
    }
}

/// The parameters of [`tma_trace`].
#[derive(Clone, Debug)]
pub struct TmaTraceBench {
    /// What runs beside the copy in the second row (the first runs the copy alone).
    pub compute: ComputeLoad,
    /// Threads per CTA of the FMA and sleep loads (1..=1024).
    pub compute_threads: u32,
    /// CTAs per SM of the FMA and sleep loads (1..=64).
    pub compute_ctas_per_sm: u32,
    /// How long the compute alone should take (ms; `None`: three times the copy alone, so that
    /// the compute lasts the copy's time alone and more).
    pub compute_ms: Option<f64>,
    /// CTAs of the copy (1..=1024).
    pub ctas: u32,
    /// Issuing warps per CTA (1..=4), each with its own ring and slice.
    pub warps: u32,
    /// Bytes copied in all (rounded down to whole chunks per warp).
    pub bytes: u64,
    /// Bytes per stage, one item (a positive multiple of 16).
    pub chunk: u32,
    /// Stages of each warp's ring (every warp's together at most [`MAX_BARRIERS`]).
    pub stages: u32,
    /// Items per round: 1, the engine's item-by-item ring, or 4, rounds of four items, each step
    /// of a round as four independent instructions (then `stages` and each warp's items are
    /// multiples of 4).
    pub round: u32,
    /// Rounds the refill lags behind the stores, `1..=min(stages / round, MAX_LAG)` (the engine's
    /// `refill_lag`: half the rounds of stages, at least one).
    pub lag: u32,
    /// Copy without trace records: no clock read or store between the loop's steps (the medians
    /// are then 0; the copy's time, the chain and the check remain).
    pub untraced: bool,
    /// The copies carry an L2 evict-first policy (`createpolicy`), which leaves the compute's
    /// lines in the L2.
    pub evict_first: bool,
    /// Copy through 2-D tensor maps (`cp.async.bulk.tensor`, rows of
    /// [`TENSOR_ROW`](oxccl_bench_kernels::trace_layout::TENSOR_ROW) bytes, one box per item) instead of plain
    /// bulk copies; needs `round` 1, no `evict_first`, and a chunk of whole rows, at most 256.
    pub tensor: bool,
    /// The instructions of the issuer's timed chain.
    pub chain_op: ChainOp,
    /// Launch the compute before the copy (by default the copy goes first, as the overlap
    /// benchmark launches its collective).
    pub compute_first: bool,
    /// Untimed and timed runs of the copy alone (its time is the timed runs' mean; its trace is
    /// one more run's); the copy beside the compute runs once.
    pub warmup: usize,
    /// Timed runs of the copy alone (at least 1).
    pub iters: usize,
}

/// One row of [`tma_trace`]: medians over every traced item of every warp, in SM cycles, past the
/// first ring's worth of items. Items copied after the compute beside ended count too: where the
/// copy outlasts the compute, the chain (timed at the start, beside it) is the measure of what the
/// compute costs the issuer.
#[derive(Clone, Debug, serde::Serialize)]
pub struct TraceRow {
    /// `alone`, or the compute load's name.
    pub beside: String,
    /// [`TmaTraceBench::ctas`].
    pub ctas: u32,
    /// [`TmaTraceBench::warps`].
    pub warps: u32,
    /// [`TmaTraceBench::chunk`].
    pub chunk: u32,
    /// [`TmaTraceBench::stages`].
    pub stages: u32,
    /// [`TmaTraceBench::round`].
    pub round: u32,
    /// [`TmaTraceBench::lag`].
    pub lag: u32,
    /// [`TmaTraceBench::untraced`].
    pub untraced: bool,
    /// [`TmaTraceBench::evict_first`].
    pub evict_first: bool,
    /// [`TmaTraceBench::tensor`].
    pub tensor: bool,
    /// [`TmaTraceBench::chain_op`], by [`ChainOp::name`].
    pub chain_op: &'static str,
    /// [`TmaTraceBench::compute_first`].
    pub compute_first: bool,
    /// The copy's time: alone, the mean of the timed runs; beside the compute, from the common
    /// start to the copy's end.
    pub copy_ms: f64,
    /// Bytes copied per second / 1e9 (each byte counted once, not read + written).
    pub gbps: f64,
    /// Cycles per step of the issuer's dependent chain, timed before the copy ([`ChainOp`] says what
    /// a step is).
    pub chain_cycles_per_step: f64,
    /// Between the store commits of consecutive items (in rounds, of consecutive rounds).
    pub period: f64,
    /// From a load's issue to the issuer seeing it landed.
    pub latency: f64,
    /// From seeing an item landed to its store committed.
    pub store: f64,
    /// From an item's store commit (in rounds, a round's) to the next load issued (the
    /// `wait_group.read` and the refill).
    pub refill: f64,
    /// Share of items whose data had landed when the issuer first looked (no failed poll): near
    /// 1 the issuer is the bottleneck, near 0 the loads are.
    pub landed_first: f64,
    /// Failed polls per item, mean.
    pub polls: f64,
    /// Warps whose `%warpid` mod 4 (the SM sub-partition on current GPUs) is 0, 1, 2, 3.
    pub warp_slots_mod4: [u32; 4],
    /// The compute alone, one call (ms; 0 in the `alone` row).
    pub compute_alone_ms: f64,
    /// The compute beside the copy, from the common start to its end (ms; 0 in the `alone` row).
    pub compute_beside_ms: f64,
    /// 4-byte words of the destination that differ from the source after the run (the destination
    /// is zeroed before it): 0, or the copy is wrong.
    pub wrong: u64,
}

impl TmaTraceBench {
    /// Bytes each warp copies (whole chunks).
    pub fn bytes_per_warp(&self) -> u64 {
        let warps = self.ctas as u64 * self.warps as u64;
        if warps == 0 || self.chunk == 0 { 0 } else { self.bytes / warps / self.chunk as u64 * self.chunk as u64 }
    }

    /// Dynamic shared memory per CTA.
    pub fn smem_bytes(&self) -> u64 {
        BARRIER_BYTES as u64 + self.warps as u64 * self.stages as u64 * self.chunk as u64
    }

    /// Refuses a shape the kernel cannot run: no CTAs, 0 or more than 4 warps, a chunk that is not a
    /// positive multiple of 16, more stages than barriers fit below the rings, a round other than 1
    /// or 4 or one that does not divide the stages or each warp's items, a lag outside `1..=min(stages
    /// / round, MAX_LAG)`, a slice of fewer than two rings of chunks or over 4 GiB, no timed run, or
    /// compute times out of range.
    pub fn validate(&self) -> Result<()> {
        let bad = |field: &'static str, why: String| Err(Error::Config { field, why });
        if !(1..=1024).contains(&self.ctas) {
            return bad("ctas", format!("{}: give 1..=1024", self.ctas));
        }
        if !(1..=4).contains(&self.warps) {
            return bad("issuers", format!("{}: give 1..=4 issuing warps per CTA", self.warps));
        }
        if self.chunk == 0 || !self.chunk.is_multiple_of(16) {
            return bad("chunk", format!("{}: give a positive multiple of 16 bytes", self.chunk));
        }
        if self.stages == 0 || self.warps as u64 * self.stages as u64 > MAX_BARRIERS as u64 {
            return bad(
                "stages",
                format!("{} stages x {} warps: give 1..={MAX_BARRIERS} stages in all", self.stages, self.warps),
            );
        }
        let per_warp = self.bytes_per_warp();
        let items = per_warp / self.chunk as u64;
        if !matches!(self.round, 1 | 4)
            || !self.stages.is_multiple_of(self.round)
            || !items.is_multiple_of(self.round as u64)
        {
            return bad(
                "round",
                format!(
                    "{}: give 1, or 4 with a multiple of 4 stages and whole rounds per warp ({} stages, {items} items)",
                    self.round, self.stages
                ),
            );
        }
        let sets = self.stages / self.round;
        if !(1..=sets.min(MAX_LAG)).contains(&self.lag) {
            return bad(
                "lag",
                format!("{}: give 1..={} (the rounds of stages, at most {MAX_LAG})", self.lag, sets.min(MAX_LAG)),
            );
        }
        if per_warp < 2 * self.stages as u64 * self.chunk as u64 || per_warp > u32::MAX as u64 {
            return bad(
                "bytes",
                format!(
                    "{} B over {} warps of {} B chunks: each warp needs two rings of chunks ({} B) to 4 GiB",
                    self.bytes,
                    self.ctas * self.warps,
                    self.chunk,
                    2 * self.stages as u64 * self.chunk as u64
                ),
            );
        }
        if self.bytes > super::MAX_OVERLAP_BYTES {
            return bad("bytes", format!("{} B: at most {}", self.bytes, super::MAX_OVERLAP_BYTES));
        }
        if self.iters == 0 {
            return bad("iters", "0: give at least one timed run".into());
        }
        if self.tensor
            && (self.round != 1
                || self.evict_first
                || !self.chunk.is_multiple_of(layout::TENSOR_ROW)
                || self.chunk / layout::TENSOR_ROW > 256)
        {
            return bad(
                "tensor",
                format!(
                    "round {}, chunk {} B{}: tensor copies take round 1, no L2 hint, and a chunk of 1..=256 rows of {} B",
                    self.round,
                    self.chunk,
                    if self.evict_first { ", L2 evict-first" } else { "" },
                    layout::TENSOR_ROW
                ),
            );
        }
        self.compute.validate()?;
        if self.compute_threads == 0 || self.compute_threads > 1024 || !(1..=64).contains(&self.compute_ctas_per_sm) {
            return bad(
                "compute shape",
                format!(
                    "{} CTAs of {} threads per SM: give 1..=64 CTAs of 1..=1024 threads",
                    self.compute_ctas_per_sm, self.compute_threads
                ),
            );
        }
        if let Some(ms) = self.compute_ms
            && !(ms > 0.0 && ms <= MAX_COMPUTE_MS)
        {
            return bad("compute_ms", format!("{ms} ms: give more than 0 and at most {MAX_COMPUTE_MS}"));
        }
        Ok(())
    }
}

/// Median of `v` (0 when empty).
fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Summarises one traced run: `trace` as `bench_tma_trace` writes it (layout in
/// `oxccl_bench_kernels::trace_layout`) for `warps` warps of `traced` records, leaving out each warp's first
/// `skip` items (at least its first, which has no predecessor; a multiple of `round`). Items go in
/// rounds of `round` (1: one by one), which share one commit: the period and the refill are
/// measured per round, from the last commit of the round before; `ahead` is the items whose loads
/// the ring keeps ahead (`(stages / round - lag) × round`), which pairs that commit with the refill
/// it allows. The shape fields are left for the caller.
fn summarize(trace: &[u32], warps: usize, traced: usize, skip: usize, ahead: usize, round: usize) -> TraceRow {
    use layout::*;
    let stride = warp_words(traced);
    let (mut chain, mut period, mut latency, mut store, mut refill) = (vec![], vec![], vec![], vec![], vec![]);
    let (mut first, mut polls, mut counted) = (0u64, 0u64, 0u64);
    let mut slots = [0u32; 4];
    for w in 0..warps {
        let h = &trace[w * stride..][..stride];
        slots[(h[H_WARPID] % 4) as usize] += 1;
        chain.push(h[H_CHAIN_CYCLES] as f64 / CHAIN as f64);
        let items = (h[H_ITEMS] as usize).min(traced);
        let rec = |j: usize| &h[HEADER_WORDS + RECORD_WORDS * j..][..RECORD_WORDS];
        for j in skip.max(1)..items {
            let (r, prev) = (rec(j), rec(j - 1));
            // The first item of a round: the round before it committed last at `prev`, and the
            // refill that commit allows is the load of the item `ahead` on.
            if j % round.max(1) == 0 {
                period.push(r[R_COMMITTED].wrapping_sub(prev[R_COMMITTED]) as f64);
                if j + ahead < items {
                    refill.push(rec(j + ahead)[R_ISSUED].wrapping_sub(prev[R_COMMITTED]) as f64);
                }
            }
            latency.push(r[R_LANDED].wrapping_sub(r[R_ISSUED]) as f64);
            store.push(r[R_COMMITTED].wrapping_sub(r[R_LANDED]) as f64);
            first += (r[R_POLLS] == 0) as u64;
            polls += r[R_POLLS] as u64;
            counted += 1;
        }
    }
    let per = |x: u64| if counted == 0 { 0.0 } else { x as f64 / counted as f64 };
    TraceRow {
        beside: String::new(),
        ctas: 0,
        warps: 0,
        chunk: 0,
        stages: 0,
        round: 0,
        lag: 0,
        untraced: false,
        evict_first: false,
        tensor: false,
        chain_op: "",
        compute_first: false,
        copy_ms: 0.0,
        gbps: 0.0,
        chain_cycles_per_step: median(chain),
        period: median(period),
        latency: median(latency),
        store: median(store),
        refill: median(refill),
        landed_first: per(first),
        polls: per(polls),
        warp_slots_mod4: slots,
        compute_alone_ms: 0.0,
        compute_beside_ms: 0.0,
        wrong: 0,
    }
}

/// 4-byte words of `dst` that differ from the source pattern ([`pattern`] of rank 0 as u32, period
/// 17 words), read back in pieces.
fn count_wrong(stream: &Arc<CudaStream>, dst: &CudaSlice<u8>) -> Result<u64> {
    let unit = encode_all(DType::U32, 17, |i| pattern(0, i));
    let mut wrong = 0;
    let mut at = 0;
    while at < dst.len() {
        let len = CHECK_PIECE.min(dst.len() - at);
        let got = stream.clone_dtoh(&dst.slice(at..at + len)).map_err(Error::driver("cuMemcpyDtoH"))?;
        // `at` is a multiple of the piece, itself a multiple of 4: word k of the piece is word
        // at / 4 + k of the buffer.
        let first = at / 4;
        wrong +=
            got.chunks_exact(4).enumerate().filter(|&(k, w)| w != &unit[(first + k) % 17 * 4..][..4]).count() as u64;
        at += len;
    }
    Ok(wrong)
}

/// A tile-mode tensor map (`cuTensorMapEncodeTiled`) of the packed u32 tensor at the device
/// address `addr`: `dims` innermost first (1 to 5 of them), boxes of `boxd` elements per dimension,
/// no interleave, swizzle, L2 promotion or out-of-bounds fill. The 128-byte map, as the kernels read
/// it from global memory.
///
/// # Errors
/// [`Error::Config`] naming `tensor map` when `dims` and `boxd` differ in length or are not 1 to
/// 5 long, or the tensor's bytes overflow a u64; the driver's error when it refuses the map (an unaligned address or row, a box over 256
/// elements).
pub fn u32_tensor_map(addr: u64, dims: &[u64], boxd: &[u32]) -> Result<[u64; 16]> {
    use cudarc::driver::sys;
    if dims.len() != boxd.len() || !(1..=5).contains(&dims.len()) {
        return Err(Error::Config {
            field: "tensor map",
            why: format!("dims {dims:?}, box {boxd:?}: give 1 to 5 of each, as many boxes as dimensions"),
        });
    }
    // Packed: each dimension's stride (bytes) is the product of those inside it.
    let mut strides = Vec::with_capacity(dims.len());
    let mut stride = 4u64;
    for d in dims {
        stride = stride.checked_mul(*d).ok_or_else(|| Error::Config {
            field: "tensor map",
            why: format!("dims {dims:?}: more than 2^64 bytes"),
        })?;
        strides.push(stride);
    }
    encode_tiled_map(
        sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT32,
        addr,
        dims,
        &strides,
        boxd,
        sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_NONE,
        sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_NONE,
    )
}

/// `cuTensorMapEncodeTiled` of the tensor at `addr`: `dims` (innermost first, 1 to 5), the byte
/// strides of all but the innermost, boxes of `boxd` elements, no interleave, no out-of-bounds fill,
/// the given swizzle and L2 promotion. The 128-byte map, as the kernels read it from global memory.
///
/// # Errors
/// The driver's error when it refuses the map.
pub(crate) fn encode_tiled_map(
    data_type: cudarc::driver::sys::CUtensorMapDataType,
    addr: u64,
    dims: &[u64],
    strides: &[u64],
    boxd: &[u32],
    swizzle: cudarc::driver::sys::CUtensorMapSwizzle,
    promotion: cudarc::driver::sys::CUtensorMapL2promotion,
) -> Result<[u64; 16]> {
    use cudarc::driver::sys;
    debug_assert!(boxd.len() == dims.len() && strides.len() + 1 >= dims.len() && (1..=5).contains(&dims.len()));
    let elem_strides = vec![1u32; dims.len()];
    let mut map = std::mem::MaybeUninit::<sys::CUtensorMap>::uninit();
    // SAFETY: `dims`, `boxd` and the element strides have the rank's length and `strides` at least
    // one less (the driver reads rank - 1; the callers build them so); `map` is written by the call
    // and read only after it reports success. The driver checks the address, strides and box and
    // refuses what it cannot map.
    let r = unsafe {
        sys::cuTensorMapEncodeTiled(
            map.as_mut_ptr(),
            data_type,
            dims.len() as u32,
            addr as *mut _,
            dims.as_ptr(),
            strides.as_ptr(),
            boxd.as_ptr(),
            elem_strides.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            swizzle,
            promotion,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    r.result().map_err(Error::driver("cuTensorMapEncodeTiled"))?;
    // SAFETY: written by the successful call above.
    Ok(unsafe { map.assume_init() }.opaque)
}

/// Runs the traced copy on `stream`'s GPU alone, then beside `b.compute` on another stream (the
/// copy launched first, as the overlap benchmark launches its collective), and returns the two rows.
pub fn tma_trace(stream: &Arc<CudaStream>, b: &TmaTraceBench) -> Result<Vec<TraceRow>> {
    b.validate()?;
    let ctx = stream.context();
    let optin = ctx
        .attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
        .map_err(Error::driver("cuDeviceGetAttribute"))? as u64;
    if b.smem_bytes() > optin {
        return Err(Error::Config {
            field: "stages",
            why: format!(
                "{} warps x {} stages x {} B (+{BARRIER_BYTES}) = {} B of shared memory: this GPU allows {optin} per CTA",
                b.warps,
                b.stages,
                b.chunk,
                b.smem_bytes()
            ),
        });
    }
    // Within the GPU's per-CTA limit (checked above).
    let function = bench_function(stream, "bench_tma_trace", b.smem_bytes() as u32)?;
    let per_warp = b.bytes_per_warp();
    let warps = (b.ctas * b.warps) as usize;
    let total = per_warp as usize * warps;
    let items = (per_warp / b.chunk as u64) as u32;
    let traced = if b.untraced { 0 } else { items.min(MAX_TRACED) };
    let mut src: CudaSlice<u8> = stream.alloc_zeros(total).map_err(Error::driver("cuMemAlloc"))?;
    fill_periodic(stream, &mut src, 0, DType::U32, total as u64 / 4, |i| pattern(0, i))?;
    let mut dst: CudaSlice<u8> = stream.alloc_zeros(total).map_err(Error::driver("cuMemAlloc"))?;
    let mut trace: CudaSlice<u32> =
        stream.alloc_zeros(warps * layout::warp_words(traced as usize)).map_err(Error::driver("cuMemAlloc"))?;
    let (src_ptr, dst_ptr, trace_ptr) =
        (src.device_ptr(stream).0, dst.device_ptr_mut(stream).0, trace.device_ptr_mut(stream).0);
    // Tensor mode: both buffers as rows of TENSOR_ROW bytes, one box of chunk / TENSOR_ROW rows per
    // item; the two maps in global memory (the allocation's start is 256-byte aligned, the second
    // map 128 bytes on).
    let maps: Option<CudaSlice<u64>> = if b.tensor {
        let rows = total as u64 / layout::TENSOR_ROW as u64;
        let row_words = (layout::TENSOR_ROW / 4) as u64;
        let words: Vec<u64> = [src_ptr, dst_ptr]
            .into_iter()
            .map(|addr| u32_tensor_map(addr, &[row_words, rows], &[row_words as u32, b.chunk / layout::TENSOR_ROW]))
            .collect::<Result<Vec<_>>>()?
            .concat();
        Some(stream.clone_htod(&words).map_err(Error::driver("cuMemcpyHtoD"))?)
    } else {
        None
    };
    let maps_ptr = maps.as_ref().map_or(0, |m| m.device_ptr(stream).0);
    let config = cudarc::driver::LaunchConfig {
        grid_dim: (b.ctas, 1, 1),
        block_dim: (32 * b.warps, 1, 1),
        shared_mem_bytes: b.smem_bytes() as u32,
    };
    let (bytes, chunk, stages, round, lag, chain) = (per_warp as u32, b.chunk, b.stages, b.round, b.lag, CHAIN);
    let evict_first = b.evict_first as u32;
    let chain_op = b.chain_op as u32;
    let copy = || -> Result<()> {
        let mut l = stream.launch_builder(&function);
        l.arg(&dst_ptr)
            .arg(&src_ptr)
            .arg(&bytes)
            .arg(&chunk)
            .arg(&stages)
            .arg(&lag)
            .arg(&chain)
            .arg(&trace_ptr)
            .arg(&traced)
            .arg(&evict_first)
            .arg(&chain_op)
            .arg(&round)
            .arg(&maps_ptr);
        // SAFETY: the kernel's contract: blocks of whole warps; `validate` checked chunk, stages,
        // round and lag (and `bytes` is whole rounds of chunks), and for tensor copies round 1, no
        // hint and whole rows per chunk (`maps` then holds both buffers' maps, written above);
        // `src` and `dst` (distinct allocations, 16-aligned) hold `bytes` for each of the grid's
        // warps and `trace` `warp_words(traced)` u32 each; the shared memory holds the barriers and
        // every warp's ring (`smem_bytes`, allowed by the attribute).
        unsafe { l.launch(config) }.map(|_| ()).map_err(Error::driver("cuLaunchKernel"))
    };
    let read = |trace: &CudaSlice<u32>| -> Result<Vec<u32>> {
        stream.clone_dtoh(trace).map_err(Error::driver("cuMemcpyDtoH"))
    };
    let skip = b.stages as usize;
    let ahead = ((b.stages / b.round - b.lag) * b.round) as usize;
    let row = |trace: &[u32], beside: String, ms: f64| TraceRow {
        beside,
        ctas: b.ctas,
        warps: b.warps,
        chunk: b.chunk,
        stages: b.stages,
        round: b.round,
        lag: b.lag,
        untraced: b.untraced,
        evict_first: b.evict_first,
        tensor: b.tensor,
        chain_op: b.chain_op.name(),
        compute_first: b.compute_first,
        copy_ms: ms,
        gbps: total as f64 / (ms * 1e-3) / 1e9,
        ..summarize(trace, warps, traced as usize, skip, ahead, b.round as usize)
    };

    let alone_ms = time_ms_on(std::slice::from_ref(stream), b.warmup, b.iters, copy)?;
    // The alone row's trace and check: one more run into a zeroed destination.
    stream.memset_zeros(&mut dst).map_err(Error::driver("cuMemsetD8Async"))?;
    copy()?;
    let alone = TraceRow { wrong: count_wrong(stream, &dst)?, ..row(&read(&trace)?, "alone".into(), alone_ms) };

    let cs = ctx.new_stream().map_err(Error::driver("cuStreamCreate"))?;
    let sms = sm_count(ctx)?;
    let mut work = Compute::new(&cs, b.compute, (b.compute_threads, b.compute_ctas_per_sm), sms, sms)?;
    let probe = work.probe_reps();
    let t = time_ms_on(std::slice::from_ref(&cs), 1, 1, || work.launch(probe))?;
    let target = b.compute_ms.unwrap_or(3.0 * alone_ms);
    let reps = super::compute_reps(probe, t, target)?;
    let compute_alone = time_ms_on(std::slice::from_ref(&cs), 1, 1, || work.launch(reps))?;
    // A warpgroup GEMM that gave up on a wait ran short: its times would mislead.
    work.check()?;

    let event = |s: &CudaStream| {
        s.record_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(Error::driver("cuEventRecord"))
    };
    stream.memset_zeros(&mut dst).map_err(Error::driver("cuMemsetD8Async"))?;
    stream.synchronize().map_err(Error::driver("cuStreamSynchronize"))?;
    cs.synchronize().map_err(Error::driver("cuStreamSynchronize"))?;
    let start = event(stream)?;
    cs.wait(&start).map_err(Error::driver("cuStreamWaitEvent"))?;
    if b.compute_first {
        work.launch(reps)?;
        copy()?;
    } else {
        copy()?;
        work.launch(reps)?;
    }
    let (copy_end, compute_end) = (event(stream)?, event(&cs)?);
    compute_end.synchronize().map_err(Error::driver("cuEventSynchronize"))?;
    copy_end.synchronize().map_err(Error::driver("cuEventSynchronize"))?;
    let ms =
        |z: &cudarc::driver::CudaEvent| start.elapsed_ms(z).map(f64::from).map_err(Error::driver("cuEventElapsedTime"));
    let beside = TraceRow {
        compute_alone_ms: compute_alone,
        compute_beside_ms: ms(&compute_end)?,
        wrong: count_wrong(stream, &dst)?,
        ..row(&read(&trace)?, b.compute.name(), ms(&copy_end)?)
    };
    Ok(vec![alone, beside])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A trace of one warp: the header, then (issued, landed seen, committed, polls) per item.
    fn one_warp(records: &[[u32; 4]]) -> Vec<u32> {
        let mut t = vec![5, 7, 2 * CHAIN, records.len() as u32, 999, 0, 0, 0];
        assert_eq!((t.len(), layout::H_ITEMS, layout::RECORD_WORDS), (layout::HEADER_WORDS, 3, 4));
        for r in records {
            t.extend_from_slice(r);
        }
        t
    }

    #[test]
    fn summary_takes_medians_of_each_step() {
        let t = one_warp(&[[0, 100, 110, 3], [10, 300, 320, 0], [20, 500, 530, 4], [320, 800, 840, 0]]);
        let r = summarize(&t, 1, 4, 1, 2, 1);
        // Items 1..4: periods 210, 210, 310; latencies 290, 480, 480; stores 20, 30, 40.
        assert_eq!((r.period, r.latency, r.store), (210.0, 480.0, 30.0));
        // Item 1 refills item 3: issued at 320, 320 - 110 after item 0's commit.
        assert_eq!(r.refill, 210.0);
        assert_eq!((r.landed_first, r.polls), (2.0 / 3.0, 4.0 / 3.0));
        assert_eq!((r.chain_cycles_per_step, r.warp_slots_mod4), (2.0, [0, 1, 0, 0]));
    }

    #[test]
    fn rounds_are_summarised_per_round() {
        // Rounds of four, two rounds of stages, one ahead: iteration r loads round r + 1 first,
        // then sees round r landed and commits it (round 0 was loaded before the loop).
        let round = |issued, landed, committed| [[issued, landed, committed, 0]; 4];
        let recs = [round(0, 100, 110), round(10, 300, 320), round(200, 400, 430)].concat();
        let t = one_warp(&recs);
        let r = summarize(&t, 1, 12, 1, 4, 4);
        // Periods between round commits: 320 - 110, 430 - 320.
        assert_eq!(r.period, 210.0);
        // Round 2's load (issued at 200) is the refill round 0's commit (at 110) allows; round 3
        // does not exist. (Paired item by item, 3 of 4 items would pair a load issued before the
        // commit.)
        assert_eq!(r.refill, 90.0);
        // Per item: latencies 100 (x3), 290 (x4), 200 (x4); stores 10 (x3), 20 (x4), 30 (x4).
        assert_eq!((r.latency, r.store), (200.0, 20.0));
    }

    #[test]
    fn tensor_maps_need_one_box_per_dimension_and_one_to_five() {
        // Refused before the driver is asked (no GPU needed).
        for (dims, boxd) in
            [(&[256u64, 4][..], &[256u32][..]), (&[], &[]), (&[1; 6], &[1; 6]), (&[1 << 40, 1 << 30], &[1, 1])]
        {
            match u32_tensor_map(0, dims, boxd) {
                Err(Error::Config { field: "tensor map", .. }) => {}
                other => panic!("dims {dims:?}, box {boxd:?}: expected a tensor-map error, got {other:?}"),
            }
        }
    }

    /// The field a refused shape's error names.
    fn field_of(b: TmaTraceBench) -> &'static str {
        match b.validate() {
            Err(Error::Config { field, .. }) => field,
            other => panic!("expected a config error, got {other:?}"),
        }
    }

    #[test]
    fn bad_shapes_are_refused_by_name() {
        let ok = TmaTraceBench {
            compute: ComputeLoad::Fma,
            compute_threads: 256,
            compute_ctas_per_sm: 4,
            compute_ms: None,
            ctas: 8,
            warps: 1,
            bytes: 1 << 30,
            chunk: 32768,
            stages: 4,
            round: 1,
            lag: 2,
            untraced: false,
            evict_first: false,
            tensor: false,
            chain_op: ChainOp::Alu,
            compute_first: false,
            warmup: 1,
            iters: 1,
        };
        ok.validate().unwrap();
        // Tensor copies: whole 1 KiB rows per chunk, at most 256, item by item, no L2 hint.
        TmaTraceBench { tensor: true, ..ok.clone() }.validate().unwrap();
        TmaTraceBench { tensor: true, chunk: 1 << 18, stages: 2, lag: 1, ..ok.clone() }.validate().unwrap();
        assert_eq!(field_of(TmaTraceBench { tensor: true, chunk: 32784, ..ok.clone() }), "tensor");
        assert_eq!(
            field_of(TmaTraceBench { tensor: true, chunk: (1 << 18) + 1024, stages: 2, lag: 1, ..ok.clone() }),
            "tensor"
        );
        assert_eq!(field_of(TmaTraceBench { tensor: true, round: 4, lag: 1, ..ok.clone() }), "tensor");
        assert_eq!(field_of(TmaTraceBench { tensor: true, evict_first: true, ..ok.clone() }), "tensor");
        assert_eq!(ok.bytes_per_warp(), 1 << 27);
        assert_eq!(field_of(TmaTraceBench { warps: 5, ..ok.clone() }), "issuers");
        assert_eq!(field_of(TmaTraceBench { chunk: 24, ..ok.clone() }), "chunk");
        assert_eq!(field_of(TmaTraceBench { lag: 5, ..ok.clone() }), "lag");
        assert_eq!(field_of(TmaTraceBench { stages: 16, lag: 9, bytes: 1 << 31, ..ok.clone() }), "lag");
        assert_eq!(field_of(TmaTraceBench { warps: 4, stages: 1 << 30, lag: 1, ..ok.clone() }), "stages");
        assert_eq!(field_of(TmaTraceBench { bytes: 8 * 7 * 32768, ..ok.clone() }), "bytes");
        assert_eq!(field_of(TmaTraceBench { iters: 0, ..ok.clone() }), "iters");
        assert_eq!(field_of(TmaTraceBench { lag: 0, ..ok.clone() }), "lag");
        // Rounds of four: a multiple of four stages, whole rounds, the lag counted in rounds.
        TmaTraceBench { round: 4, lag: 1, ..ok.clone() }.validate().unwrap();
        TmaTraceBench { round: 4, stages: 12, lag: 3, bytes: 1 << 31, ..ok.clone() }.validate().unwrap();
        assert_eq!(field_of(TmaTraceBench { round: 4, lag: 2, ..ok.clone() }), "lag");
        assert_eq!(field_of(TmaTraceBench { round: 4, stages: 6, lag: 1, ..ok.clone() }), "round");
        assert_eq!(field_of(TmaTraceBench { round: 4, lag: 1, bytes: 8 * 10 * 32768, ..ok.clone() }), "round");
        assert_eq!(field_of(TmaTraceBench { round: 2, ..ok.clone() }), "round");
        assert_eq!(field_of(TmaTraceBench { stages: 0, ..ok.clone() }), "stages");
        assert_eq!(field_of(TmaTraceBench { warps: 4, stages: 33, lag: 1, ..ok.clone() }), "stages");
        assert_eq!(field_of(TmaTraceBench { bytes: 1000, ..ok.clone() }), "bytes");
        assert_eq!(field_of(TmaTraceBench { ctas: 0, ..ok.clone() }), "ctas");
        assert_eq!(field_of(TmaTraceBench { compute_ms: Some(-1.0), ..ok }), "compute_ms");
    }
}
