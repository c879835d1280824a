//! The benchmark kernels, not probes: the compute loads the overlap benchmark runs beside a
//! collective (an FMA-bound kernel, a sleeping control, two bf16 tensor-core GEMMs) and the timed
//! TMA copy of the `tma-trace` diagnostic. Each is also the place where the golden-PTX test finds
//! the instructions of the wrappers only it uses (`mma`, `wgmma`, `cp.async`, `%clock64`, ...).

use crate::gemm_shape::{
    OPERAND as GEMM_OPERAND, ROW as GEMM_ROW, STAGE as GEMM_STAGE, STAGES as GEMM_STAGES, THREADS as GEMM_THREADS,
    TILE_K as GEMM_TILE_K, TILE_MN as GEMM_TILE_MN,
};
use crate::trace_layout;
use oxccl_ptx::arith::*;
use oxccl_ptx::bulk::*;
use oxccl_ptx::fence::*;
use oxccl_ptx::mbarrier::*;
use oxccl_ptx::memory::*;
use oxccl_ptx::mma::*;
use oxccl_ptx::sreg::*;
use oxccl_ptx::sync::*;
use oxccl_ptx::tensor::*;
use oxccl_ptx::{Global, Mbarrier, Shared, TensorMap};

/// Base of the dynamic shared memory, 128-byte aligned (tensor boxes need it).
#[repr(C, align(128))]
struct SmemBase([u8; 128]);

/// This CTA's dynamic shared memory.
#[inline(always)]
fn smem() -> Shared<u8> {
    let base = core::intrinsics::gpu::gpu_launch_sized_workgroup_mem::<SmemBase>();
    // SAFETY: the pointer addresses this CTA's dynamic shared memory.
    unsafe { Shared::from_generic(base.cast::<u8>()) }
}

/// An FMA-bound compute kernel for the overlap benchmark (`oxccl bench overlap`), not a probe: every
/// thread runs `iters` rounds of 8 independent `fma.rn.f32` on registers (no memory traffic), then
/// writes one value to `out[global thread id]` so the work cannot be optimised away.
///
/// # Safety
/// `out` holds one f32 per thread of the grid.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn bench_fma(out: u64, iters: u32, seed: f32) {
    let i = ctaid_x() * ntid_x() + tid_x();
    let mut acc = [0f32; 8];
    for (k, a) in acc.iter_mut().enumerate() {
        *a = seed + (i as f32) * 1e-7 + k as f32;
    }
    let (m, c) = (0.999_999_9_f32, 1e-7_f32);
    for _ in 0..iters {
        for a in acc.iter_mut() {
            *a = core::intrinsics::fmaf32(*a, m, c);
        }
    }
    let sum = acc.iter().sum::<f32>();
    // SAFETY: the host sizes `out` for every thread of the grid.
    unsafe { *Global::<f32>::from_addr(out).add(i as u64).ptr() = sum };
}

/// The control load of the overlap benchmark (`oxccl bench overlap --compute sleep`), not a probe:
/// CTAs that occupy their SM slots but issue almost nothing: every thread sleeps about 1 µs `iters`
/// times, then writes `iters` to `out[global thread id]`. Beside it a collective shows what
/// co-residence alone costs, without busy warps.
///
/// # Safety
/// `out` holds one u32 per thread of the grid.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn bench_sleep(out: u64, iters: u32, _seed: f32) {
    let i = ctaid_x() * ntid_x() + tid_x();
    for _ in 0..iters {
        nanosleep_u32(1000);
    }
    // SAFETY: the host sizes `out` for every thread of the grid.
    unsafe { *Global::<f32>::from_addr(out).add(i as u64).ptr() = iters as f32 };
}

/// The TMA copy's issuing loop, timed: the kernel of the diagnostic `oxccl bench tma_trace`, which
/// shows what compute beside it costs the copy (and the probe of `clock64`, `warpid` and the
/// cache-hinted bulk copies). Lane 0 of every warp copies its own `bytes` of `src` to `dst` (warp
/// `g` of the grid the `g`-th slice) through its own ring of `stages` shared-memory stages,
/// refilled as the engine's TMA mover refills: `lag` behind the stores, after
/// `cp.async.bulk.wait_group.read lag - 1`, so `stages - lag` loads run ahead. With `round` 4 it
/// copies in rounds of four items instead, every step of a round (refill, poll, store) as four
/// independent instructions, and `lag` counts rounds ([`TracedCopy::run`]). First it times
/// `chain` steps of a dependent chain, its share of its scheduler's issue slots: `chain_op` 0 two
/// ALU instructions per step, 1 two `fma.rn.f32`, 2 one `ld.shared` (with its address
/// arithmetic), 3 eight independent two-instruction ALU streams (16 instructions that need not
/// wait on each other). With `evict_first` nonzero the copies carry an L2 evict-first policy. With
/// `maps` nonzero (the address of two tensor maps in global memory, the source's then the
/// destination's) every load and store is a 2-D box through them (`cp.async.bulk.tensor`) instead
/// of a plain bulk copy.
///
/// `trace` holds, per warp `g`, [`trace_layout::HEADER_WORDS`] u32 of header, then
/// [`trace_layout::RECORD_WORDS`] for each of its first `traced` items (fields in
/// [`crate::trace_layout`]); with `traced` 0 the loop reads no clock and stores nothing between
/// its steps. Shared memory: the barriers from 0, the rings from [`trace_layout::BARRIER_BYTES`],
/// `stages × chunk` per warp. Every wait is on the CTA's own bulk loads and stores, which complete
/// unless the copy faults (then the launch fails).
///
/// # Safety
/// The block is a whole number of warps; `chunk` is a positive multiple of 16 and `bytes` a
/// multiple of `round × chunk`; `round` is 1 or 4 and divides `stages`; `1 <= lag <=
/// min(stages / round, MAX_LAG)`; warps × `stages` <= `MAX_BARRIERS`; the dynamic shared memory
/// holds `BARRIER_BYTES + warps × stages × chunk`; `src` and `dst` hold `bytes` for every warp of
/// the grid, 16-byte aligned, and do not overlap; `trace` holds `warp_words(traced)` u32 for every
/// warp. With `maps` nonzero: `round` 1 and `evict_first` 0; `maps` addresses two 64-byte aligned
/// `CUtensorMap`s written before the launch, each describing its buffer as rows of
/// [`trace_layout::TENSOR_ROW`] bytes (u32 elements) with boxes of `chunk / TENSOR_ROW` rows,
/// `chunk` and `bytes` being multiples of `TENSOR_ROW`.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn bench_tma_trace(
    dst: u64,
    src: u64,
    bytes: u32,
    chunk: u32,
    stages: u32,
    lag: u32,
    chain: u32,
    trace: u64,
    traced: u32,
    evict_first: u32,
    chain_op: u32,
    round: u32,
    maps: u64,
) {
    // The chain of kind 2 (below) loads words of the first 256 bytes of shared memory, where the
    // warps' barriers live later: lane 0 of every warp zeroes them and every thread of the CTA meets
    // before any warp initialises its barriers, so no zeroing reaches an initialised barrier (the
    // chain's loads of barrier words afterwards are harmless reads). Only then do lanes other than
    // 0 leave.
    if chain_op == 2 {
        if laneid() == 0 {
            for k in 0..64 {
                // SAFETY: the first 256 bytes of the dynamic shared memory (at least 1024 bytes).
                unsafe { st_shared_u32(smem().cast::<u32>().add(k), 0) };
            }
        }
        // SAFETY: `chain_op` is the same for every thread of the CTA and no thread has left yet, so
        // all of them arrive.
        unsafe { bar_sync_all() };
    }
    if laneid() != 0 {
        return;
    }
    let w = tid_x() / 32;
    let g = ctaid_x() * (ntid_x() / 32) + w;
    let bars = smem().cast::<Mbarrier>().add(w * stages);
    let ring = smem().byte_add::<u8>(trace_layout::BARRIER_BYTES + w * stages * chunk);
    let src = Global::<u8>::from_addr(src).byte_add::<u8>(g as u64 * bytes as u64);
    let dst = Global::<u8>::from_addr(dst).byte_add::<u8>(g as u64 * bytes as u64);
    let out = Global::<u32>::from_addr(trace).add(g as u64 * trace_layout::warp_words(traced as usize) as u64);
    let items = bytes / chunk;

    // The chain, `chain` steps of the kind `chain_op` names (ptxas cannot fold any): 0, ALU
    // x ← rotl(x ⊕ c, 1); 3, eight independent streams of that step; 1, two dependent
    // `fma.rn.f32`; 2, a dependent `ld.shared` of a word in the first 256 bytes of shared memory
    // (zeroed above).
    let mut x = g;
    let base = smem().addr();
    let t0 = clock64();
    // SAFETY (each loop): register arithmetic, or a load of the first 256 bytes of this CTA's
    // shared memory. Not `pure`: the chain stays between the two clock reads. One loop per kind,
    // so no step branches on the kind.
    match chain_op {
        1 => {
            for _ in 0..chain {
                unsafe {
                    core::arch::asm!(
                        "{{ .reg .f32 f; mov.b32 f, {x}; fma.rn.f32 f, f, 0f3F7FFFFF, 0f33D6BF95; fma.rn.f32 f, f, 0f3F7FFFFF, 0f33D6BF95; mov.b32 {x}, f; }}",
                        x = inout(reg32) x,
                        options(nomem, nostack)
                    )
                };
            }
        }
        2 => {
            for _ in 0..chain {
                unsafe {
                    core::arch::asm!(
                        "{{ .reg .b32 t; and.b32 t, {x}, 252; add.u32 t, t, {b}; ld.shared.u32 {x}, [t]; }}",
                        x = inout(reg32) x,
                        b = in(reg32) base,
                        options(nostack)
                    )
                };
            }
        }
        3 => {
            // Eight such streams per step, none waiting on another: 16 instructions a warp can
            // issue back to back.
            let c = items | 1;
            let mut v = [x, x ^ 1, x ^ 2, x ^ 3, x ^ 4, x ^ 5, x ^ 6, x ^ 7];
            for _ in 0..chain {
                unsafe {
                    core::arch::asm!(
                        "xor.b32 {a}, {a}, {c}; xor.b32 {b}, {b}, {c}; xor.b32 {d}, {d}, {c}; xor.b32 {e}, {e}, {c};",
                        "xor.b32 {f}, {f}, {c}; xor.b32 {g}, {g}, {c}; xor.b32 {h}, {h}, {c}; xor.b32 {i}, {i}, {c};",
                        "shf.l.wrap.b32 {a}, {a}, {a}, 1; shf.l.wrap.b32 {b}, {b}, {b}, 1; shf.l.wrap.b32 {d}, {d}, {d}, 1; shf.l.wrap.b32 {e}, {e}, {e}, 1;",
                        "shf.l.wrap.b32 {f}, {f}, {f}, 1; shf.l.wrap.b32 {g}, {g}, {g}, 1; shf.l.wrap.b32 {h}, {h}, {h}, 1; shf.l.wrap.b32 {i}, {i}, {i}, 1;",
                        a = inout(reg32) v[0],
                        b = inout(reg32) v[1],
                        d = inout(reg32) v[2],
                        e = inout(reg32) v[3],
                        f = inout(reg32) v[4],
                        g = inout(reg32) v[5],
                        h = inout(reg32) v[6],
                        i = inout(reg32) v[7],
                        c = in(reg32) c,
                        options(nomem, nostack)
                    )
                };
            }
            x = v.iter().fold(0, |acc, &y| acc ^ y);
        }
        _ => {
            for _ in 0..chain {
                unsafe {
                    core::arch::asm!(
                        "xor.b32 {x}, {x}, {c}; shf.l.wrap.b32 {x}, {x}, {x}, 1;",
                        x = inout(reg32) x,
                        c = in(reg32) items | 1,
                        options(nomem, nostack)
                    )
                };
            }
        }
    }
    let chain_cycles = (clock64() - t0) as u32;

    // Tensor mode: the source's and the destination's maps, rows of `TENSOR_ROW` bytes, this
    // warp's slice from row `g × bytes / TENSOR_ROW`, one box of `chunk / TENSOR_ROW` rows per item.
    let src_map = Global::<TensorMap>::from_addr(maps);
    let copy = TracedCopy {
        bars,
        ring,
        src,
        dst,
        out,
        chunk,
        stages,
        lag,
        traced,
        src_map,
        dst_map: src_map.add(1),
        row0: g * (bytes / trace_layout::TENSOR_ROW),
        rows: chunk / trace_layout::TENSOR_ROW,
    };
    // SAFETY (whole block): each warp's barriers and ring are its own (the host sizes shared memory
    // for `warps × stages` of both), initialised and used by its lane 0 alone, after the fence; `src` and `dst` hold `bytes` for every warp of the grid, `trace`
    // its records; `round` divides `stages` and `items`, and `lag` is 1..=stages / round (the
    // caller's contract, as `TracedCopy::run` needs).
    unsafe {
        for s in 0..stages {
            mbarrier_init_shared_b64(bars.add(s), 1);
        }
        fence_mbarrier_init_release_cluster();
        let start = clock64();
        // Each choice a constant of its own loop, so that no step branches on it.
        match (traced != 0, round, evict_first != 0, maps != 0) {
            (true, _, _, true) => copy.run::<true, 1, false, true>(items, start),
            (false, _, _, true) => copy.run::<false, 1, false, true>(items, start),
            (true, 4, false, _) => copy.run::<true, 4, false, false>(items, start),
            (true, 4, true, _) => copy.run::<true, 4, true, false>(items, start),
            (false, 4, false, _) => copy.run::<false, 4, false, false>(items, start),
            (false, 4, true, _) => copy.run::<false, 4, true, false>(items, start),
            (true, _, false, _) => copy.run::<true, 1, false, false>(items, start),
            (true, _, true, _) => copy.run::<true, 1, true, false>(items, start),
            (false, _, false, _) => copy.run::<false, 1, false, false>(items, start),
            (false, _, true, _) => copy.run::<false, 1, true, false>(items, start),
        }
        cp_async_bulk_wait_group::<0>();
        let copy_cycles = (clock64() - start) as u32;
        for s in 0..stages {
            mbarrier_inval_shared_b64(bars.add(s));
        }
        use trace_layout::*;
        for (k, v) in [
            (H_WARPID, warpid()),
            (H_SMID, smid()),
            (H_CHAIN_CYCLES, chain_cycles),
            (H_ITEMS, items),
            (H_COPY_CYCLES, copy_cycles),
            (H_CHAIN_VALUE, x),
        ] {
            *out.add(k as u64).ptr() = v;
        }
    }
}

/// One warp's part of [`bench_tma_trace`]'s copy: its barriers and ring, its slices of the source
/// and the destination, its trace records.
struct TracedCopy {
    bars: Shared<Mbarrier>,
    ring: Shared<u8>,
    src: Global<u8>,
    dst: Global<u8>,
    out: Global<u32>,
    chunk: u32,
    stages: u32,
    lag: u32,
    traced: u32,
    /// Tensor mode: the maps of the source and the destination (2-D, rows of
    /// [`trace_layout::TENSOR_ROW`] bytes), this warp's first row and the rows of one item.
    src_map: Global<TensorMap>,
    dst_map: Global<TensorMap>,
    row0: u32,
    rows: u32,
}

impl TracedCopy {
    /// Copies `items` chunks in rounds of `ROUND` items: `stages / ROUND` rounds of stages, each
    /// round's stages refilled `lag` rounds behind its stores (after `cp.async.bulk.wait_group.read
    /// lag - 1`, one group per round), so `stages / ROUND - lag` rounds of loads run ahead. Each step
    /// of a round (refill, poll, store) is `ROUND` independent instructions; `ROUND` 1 is the
    /// engine's item-by-item ring. With `TRACE` it records each item's times from `start` (a clock
    /// read and a store per record); without, nothing between the steps. With `HINT` the copies
    /// carry an L2 evict-first policy. With `TENSOR` (and `ROUND` 1, no `HINT`) every load and store
    /// is one box of `rows` rows through the tensor maps (`cp.async.bulk.tensor.2d`) instead of a
    /// plain bulk copy.
    ///
    /// # Safety
    /// The warp's lane 0, once, after its `stages` barriers were initialised (one arrival each);
    /// its ring holds `stages × chunk` bytes; `ROUND` divides `stages` (else the running stage
    /// index passes the ring's end) and `items`; `1 <= lag <= stages / ROUND`, `lag <= MAX_LAG`;
    /// the slices hold `items × chunk` bytes, the trace `warp_words(traced)` words; with `TENSOR`
    /// the maps describe both buffers as rows of `TENSOR_ROW` bytes with boxes of `rows` rows, and
    /// `chunk` is `rows × TENSOR_ROW`.
    #[inline(always)]
    unsafe fn run<const TRACE: bool, const ROUND: u32, const HINT: bool, const TENSOR: bool>(
        &self,
        items: u32,
        start: u64,
    ) {
        let (chunk, stages) = (self.chunk, self.stages);
        let rounds = items / ROUND;
        let ahead = stages / ROUND - self.lag;
        let policy = createpolicy_fractional_l2_evict_first();
        let stamp = |j: u32, field: usize, v: u32| {
            if TRACE && j < self.traced {
                let at = trace_layout::HEADER_WORDS + trace_layout::RECORD_WORDS * j as usize + field;
                // SAFETY: record `j < traced` of this warp's trace (the caller's contract).
                unsafe { *self.out.add(at as u64).ptr() = v };
            }
        };
        let now = || if TRACE { (clock64() - start) as u32 } else { 0 };
        // SAFETY (whole block): stage `j % stages` of item `j` is armed with exactly the bytes its
        // load brings and refilled only after the stores that read it finished reading (`lag`
        // rounds behind); every address lies inside this warp's slices and ring.
        unsafe {
            // Stage indices and parities kept as running values (no division in the loop): the
            // first stage of the next round to load, and of the round to store with its parity.
            let next = |base: u32| if base + ROUND == stages { 0 } else { base + ROUND };
            let load_round = |q: u32, base: u32| {
                for s in 0..ROUND {
                    let j = q * ROUND + s;
                    let stage = base + s;
                    stamp(j, trace_layout::R_ISSUED, now());
                    let bar = self.bars.add(stage);
                    let _ = mbarrier_arrive_expect_tx_shared_b64(bar, chunk);
                    let (to, from) = (self.ring.byte_add(stage * chunk), self.src.byte_add(j as u64 * chunk as u64));
                    if TENSOR {
                        let row = (self.row0 + j * self.rows) as i32;
                        cp_async_bulk_tensor_2d_shared_global_tile_mbarrier(to, self.src_map, 0, row, bar);
                    } else if HINT {
                        cp_async_bulk_shared_global_mbarrier_hint(to, from, chunk, bar, policy);
                    } else {
                        cp_async_bulk_shared_global_mbarrier(to, from, chunk, bar);
                    }
                }
            };
            let mut loading = 0u32;
            for q in 0..ahead.min(rounds) {
                load_round(q, loading);
                loading = next(loading);
            }
            let (mut base, mut parity) = (0u32, 0u32);
            for r in 0..rounds {
                if r + ahead < rounds {
                    cp_async_bulk_wait_group_read_at_most(self.lag - 1);
                    load_round(r + ahead, loading);
                    loading = next(loading);
                }
                let first = r * ROUND;
                let mut polls = 0u32;
                loop {
                    let mut landed = true;
                    for s in 0..ROUND {
                        landed &= mbarrier_try_wait_parity_shared_b64(self.bars.add(base + s), parity);
                    }
                    if landed {
                        break;
                    }
                    polls += 1;
                }
                let seen = now();
                for s in 0..ROUND {
                    let j = first + s;
                    stamp(j, trace_layout::R_LANDED, seen);
                    stamp(j, trace_layout::R_POLLS, polls);
                    let (to, from) =
                        (self.dst.byte_add(j as u64 * chunk as u64), self.ring.byte_add((base + s) * chunk));
                    if TENSOR {
                        let row = (self.row0 + j * self.rows) as i32;
                        cp_async_bulk_tensor_2d_global_shared_tile_bulk_group(self.dst_map, 0, row, from);
                    } else if HINT {
                        cp_async_bulk_global_shared_bulk_group_hint(to, from, chunk, policy);
                    } else {
                        cp_async_bulk_global_shared_bulk_group(to, from, chunk);
                    }
                }
                cp_async_bulk_commit_group();
                let committed = now();
                for s in 0..ROUND {
                    stamp(first + s, trace_layout::R_COMMITTED, committed);
                }
                base = next(base);
                parity ^= (base == 0) as u32;
            }
        }
    }
}

const _: () = assert!(trace_layout::MAX_LAG - 1 <= WAIT_GROUP_READ_MAX, "bench_tma_trace's waits tell every lag apart");

/// Runs `$body` four times with the constant `$i` = 0, 1, 2, 3.
macro_rules! unroll4 {
    ($i:ident, $body:block) => {{
        {
            const $i: usize = 0;
            $body
        }
        {
            const $i: usize = 1;
            $body
        }
        {
            const $i: usize = 2;
            $body
        }
        {
            const $i: usize = 3;
            $body
        }
    }};
}

/// Waits for `bar`'s phase `parity` for at most a second (by the global timer); on time-out stores
/// `code` at `status` and returns, so that a stage that never lands ends the kernel instead of hanging
/// it.
///
/// # Safety
/// `bar` is a live barrier; `status` addresses a writable u32.
#[inline(always)]
unsafe fn wait_at_most_a_second(bar: Shared<Mbarrier>, parity: u32, status: u64, code: u32) {
    let start = globaltimer();
    // SAFETY: forwarded contract: `bar` is live.
    while !unsafe { mbarrier_try_wait_parity_shared_b64(bar, parity) } {
        if globaltimer().wrapping_sub(start) > 1_000_000_000 {
            // SAFETY: the caller's contract: `status` is a writable u32.
            unsafe { *Global::<u32>::from_addr(status).ptr() = code };
            return;
        }
    }
}

/// Runs `$body` eight times with the constant `$i` = 0, 1, …, 7.
macro_rules! unroll8 {
    ($i:ident, $body:block) => {{
        unroll4!(LOW, {
            const $i: usize = LOW;
            $body
        });
        unroll4!(HIGH, {
            const $i: usize = HIGH + 4;
            $body
        });
    }};
}

/// The tensor-core GEMM of the overlap benchmark (`oxccl bench overlap --compute mma`), and the
/// probe of `oxccl_ptx::mma`: `C = A · Bᵀ` with A (`m × k`) and B (`n × k`) row-major bf16 (both
/// K-contiguous, as a linear layer's input and weight), C (`m × n`) row-major f32, accumulated in
/// f32 by `mma.sync` m16n8k16.
///
/// One CTA of 256 threads computes one 128 × 128 tile of C (a grid of `m / 128 · n / 128` CTAs,
/// row by row of tiles): eight warps as 2 × 4, each a 64 × 32 block of 4 × 4 `mma` tiles. K
/// advances 32 at a time through three shared-memory stages filled by `cp.async` (every thread
/// copies 16-byte pieces), read with `ldmatrix` (shape in [`crate::gemm_shape`]). Needs `m` and `n`
/// multiples of 128, `k` a multiple of 32 (the host checks), and `gemm_shape::SMEM` bytes of
/// dynamic shared memory.
///
/// # Safety
/// - A launch of exactly `m / 128 · n / 128` CTAs of 256 threads (the PTX carries `.reqntid 256`:
///   another block size fails to launch) with at least `gemm_shape::SMEM` bytes of dynamic shared
///   memory, where A holds `m × k` and B `n × k` bf16 and C `m × n` f32 (the grid is the only bound
///   on `m`), each 16-byte aligned.
/// - Nothing else writes A or B, or touches C, while it runs.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn bench_gemm_bf16(a: u64, b: u64, c: u64, n: u32, k: u32) {
    // The loops below are written for this shape: two 16-byte pieces per thread and operand, four
    // pieces per row, eight warps as 2 × 4 of 64 × 32, two k16 steps per stage.
    const _: () = assert!(GEMM_THREADS == 256 && GEMM_TILE_MN == 128 && GEMM_TILE_K == 32);
    let (tid, lane, warp) = (tid_x(), tid_x() % 32, tid_x() / 32);
    let tiles_n = n / GEMM_TILE_MN;
    let (m0, n0) = (ctaid_x() / tiles_n * GEMM_TILE_MN, ctaid_x() % tiles_n * GEMM_TILE_MN);
    let (wm, wn) = (warp / 4 * 64, warp % 4 * 32);
    let base = smem();
    let row_bytes = k as u64 * 2;
    let a_tile = Global::<u8>::from_addr(a).byte_add::<u8>(m0 as u64 * row_bytes);
    let b_tile = Global::<u8>::from_addr(b).byte_add::<u8>(n0 as u64 * row_bytes);
    let k_tiles = k / GEMM_TILE_K;
    // Every thread copies two 16-byte pieces of each 128 × 64-byte operand tile.
    let load = |slot: u32, kt: u32| {
        let stage = base.byte_add::<u8>(slot * GEMM_STAGE);
        for j in 0..2 {
            let piece = tid + j * GEMM_THREADS;
            let (row, col) = (piece / 4, piece % 4 * 16);
            let src = row as u64 * row_bytes + (kt * GEMM_TILE_K * 2 + col) as u64;
            let dst = row * GEMM_ROW + col;
            // SAFETY: both operands hold 128 rows of `k` bf16 from the tile's first row (the host
            // checks the shapes); the pieces are 16-byte aligned (`k` is a multiple of 32, rows of
            // shared memory 80 bytes apart) and read only after this thread's wait and a barrier.
            unsafe {
                cp_async_cg_shared_global_16(stage.byte_add(dst), a_tile.byte_add(src));
                cp_async_cg_shared_global_16(stage.byte_add(GEMM_OPERAND + dst), b_tile.byte_add(src));
            }
        }
    };
    let mut acc = [[[0f32; 4]; 4]; 4];
    for kt in 0..GEMM_STAGES - 1 {
        if kt < k_tiles {
            load(kt, kt);
        }
        // SAFETY: groups only count this thread's copies.
        unsafe { cp_async_commit_group() };
    }
    let (mut read, mut write) = (0u32, GEMM_STAGES - 1);
    for kt in 0..k_tiles {
        // SAFETY: every thread of the CTA runs the same loop; after the wait and the barrier, stage
        // `read` holds tile `kt` from every thread's copies, and every warp is done with stage
        // `write` (read in the previous round).
        unsafe {
            cp_async_wait_group::<{ GEMM_STAGES - 2 }>();
            bar_sync_all();
        }
        if kt + GEMM_STAGES - 1 < k_tiles {
            load(write, kt + GEMM_STAGES - 1);
        }
        // SAFETY: as above.
        unsafe { cp_async_commit_group() };
        let stage = base.byte_add::<u8>(read * GEMM_STAGE);
        for kk in 0..2 {
            let k_byte = kk * 32;
            let mut fa = [[0u32; 4]; 4];
            for (mi, f) in fa.iter_mut().enumerate() {
                let row = wm + mi as u32 * 16 + lane % 8 + (lane / 8 % 2) * 8;
                // SAFETY: the warp is converged; the row lies in this stage's A tile, written
                // before the barrier above.
                *f = unsafe {
                    ldmatrix_sync_aligned_m8n8_x4_shared_b16(stage.byte_add(row * GEMM_ROW + k_byte + lane / 16 * 16))
                };
            }
            let mut fb = [[0u32; 2]; 4];
            for nj in 0..2 {
                let row = wn + nj * 16 + lane % 8 + lane / 16 * 8;
                // SAFETY: as above, in the B tile.
                let r = unsafe {
                    ldmatrix_sync_aligned_m8n8_x4_shared_b16(
                        stage.byte_add(GEMM_OPERAND + row * GEMM_ROW + k_byte + (lane / 8 % 2) * 16),
                    )
                };
                fb[2 * nj as usize] = [r[0], r[1]];
                fb[2 * nj as usize + 1] = [r[2], r[3]];
            }
            for (mi, row) in acc.iter_mut().enumerate() {
                for (ni, t) in row.iter_mut().enumerate() {
                    // SAFETY: the warp is converged.
                    *t = unsafe { mma_sync_aligned_m16n8k16_row_col_f32_bf16_bf16_f32(fa[mi], fb[ni], *t) };
                }
            }
        }
        read = if read + 1 == GEMM_STAGES { 0 } else { read + 1 };
        write = if write + 1 == GEMM_STAGES { 0 } else { write + 1 };
    }
    let out = Global::<f32>::from_addr(c);
    let (g, t) = (lane / 4, lane % 4);
    // Straight-line (constant indices) so the accumulators stay in registers.
    unroll4!(MI, {
        unroll4!(NI, {
            let v = acc[MI][NI];
            let r = (m0 + wm + MI as u32 * 16 + g) as u64;
            let col = (n0 + wn + NI as u32 * 8 + 2 * t) as u64;
            // SAFETY: C holds `m × n` f32 and the row and column lie inside this CTA's tile.
            unsafe {
                let p = out.add(r * n as u64 + col);
                *p.ptr() = v[0];
                *p.add(1).ptr() = v[1];
                let q = out.add((r + 8) * n as u64 + col);
                *q.ptr() = v[2];
                *q.add(1).ptr() = v[3];
            }
        });
    });
}

/// The warpgroup GEMM of the overlap benchmark (`oxccl bench overlap --compute wgmma`), and the probe
/// of `oxccl_ptx::wgmma`: `C = A · Bᵀ` as [`bench_gemm_bf16`] computes it (A `m × k`, B `n × k`
/// row-major bf16, C `m × n` row-major f32), the way Hopper GEMMs do: tensor copies load the operand
/// tiles, `wgmma.mma_async` multiplies them from shared memory, the threads only wait.
///
/// One CTA of two warpgroups computes one 128 × 256 tile of C (a grid of `m / 128 · n / 256` CTAs,
/// row by row of tiles; shape in [`crate::wgmma_shape`]). Thread 0 issues each stage's two tensor
/// copies (the A box at `maps`, the B box at `maps + 128`, both 64 × rows bf16 with 128-byte
/// swizzle) on the stage's `loaded` barrier; every warp arrives on its `released` barrier once its
/// multiplies have read the stage, and thread 0 refills it with the tile `STAGES` further on.
///
/// # Safety
/// - A launch of exactly `m / 128 · n / 256` CTAs of 256 threads (`.reqntid 256`) with at least
///   `wgmma_shape::SMEM` bytes of dynamic shared memory.
/// - `maps` holds two tile-mode tensor maps written before the launch: A (bf16, dimensions `k` and
///   `m`) and B (bf16, `k` and `n`), each with a box of 64 × 128 (A) or 64 × 256 (B) elements,
///   128-byte swizzle; C holds `m × n` f32, 8-byte aligned; `k` is a positive multiple of 64.
/// - `status` holds nine u32, zero at the launch. A barrier wait that lasts a second (a stage that
///   never lands: a wrong tensor map) gives up, stores in word 0 `1 << 28 | tile` (a load) or `2 <<
///   28 | tile` (a release) and lets the kernel end with C wrong, so that the host reports a hang
///   instead of waiting on it. Words 1–8: CTA 0's warps record how far they got (`step << 24 |
///   tile`: 1 barriers ready, 2 first loads issued, 3 tile landed, 4 multiplies done, 5 C stored;
///   system-scope stores, so that a host can read them from mapped memory while the kernel runs).
///   No record sits between a `wgmma.fence` and the wait that ends its multiplies: a branch taken
///   by one lane there splits the warp across the warp syncs the compiler puts before them.
/// - Nothing else writes A or B, or touches C, while it runs.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn bench_gemm_wgmma(maps: u64, c: u64, status: u64, n: u32, k: u32) {
    use crate::wgmma_shape::{A_BYTES, STAGE, STAGES, THREADS, TILE_K, TILE_M, TILE_N, descriptor_sw128};
    use oxccl_ptx::wgmma::*;
    const _: () = assert!(THREADS == 256 && TILE_M == 128 && TILE_N == 256);
    let (tid, lane, warp) = (tid_x(), tid_x() % 32, tid_x() / 32);
    let group = warp / 4;
    let tiles_n = n / TILE_N;
    let (m0, n0) = (ctaid_x() / tiles_n * TILE_M, ctaid_x() % tiles_n * TILE_N);
    let raw = smem();
    // The swizzle pattern repeats every 1024 bytes and the descriptors assume it starts at a stage.
    let base = raw.byte_add::<u8>((1024 - raw.addr() % 1024) % 1024);
    let loaded = base.byte_add::<Mbarrier>(STAGES * STAGE);
    let released = loaded.add(STAGES);
    let (a_map, b_map) = (Global::<TensorMap>::from_addr(maps), Global::<TensorMap>::from_addr(maps + 128));
    let k_tiles = k / TILE_K;
    let progress = |step: u32, kt: u32| {
        if ctaid_x() == 0 && lane == 0 {
            // SAFETY: `status` holds nine u32 (the caller's contract); each warp writes its own word.
            unsafe { st_relaxed_sys_u32(Global::<u32>::from_addr(status + 4 * (1 + warp as u64)), step << 24 | kt) };
        }
    };
    // SAFETY: thread 0 initialises the barriers before any use, made visible by the fence and the
    // CTA barrier: `loaded` completes on thread 0's arrival and the copies' bytes, `released` on one
    // arrival per warp.
    unsafe {
        if tid == 0 {
            for s in 0..STAGES {
                mbarrier_init_shared_b64(loaded.add(s), 1);
                mbarrier_init_shared_b64(released.add(s), THREADS / 32);
            }
            fence_mbarrier_init_release_cluster();
        }
        bar_sync_all();
    }
    // Thread 0 loads tile `kt` into stage `kt % STAGES`.
    let load = |kt: u32| {
        let s = kt % STAGES;
        let stage = base.byte_add::<u8>(s * STAGE);
        // SAFETY: the stage is free (first use, or every warp released it, see the loop), the maps
        // describe A and B (the caller's contract) and the boxes fit the stage; the barrier's phase
        // expects exactly the two boxes' bytes.
        unsafe {
            mbarrier_arrive_expect_tx_shared_b64(loaded.add(s), STAGE);
            let kc = (kt * TILE_K) as i32;
            cp_async_bulk_tensor_2d_shared_global_tile_mbarrier(stage, a_map, kc, m0 as i32, loaded.add(s));
            cp_async_bulk_tensor_2d_shared_global_tile_mbarrier(
                stage.byte_add(A_BYTES),
                b_map,
                kc,
                n0 as i32,
                loaded.add(s),
            );
        }
    };
    progress(1, 0);
    if tid == 0 {
        for kt in 0..(STAGES - 1).min(k_tiles) {
            load(kt);
        }
    }
    progress(2, 0);
    // The 64 × 256 block of this warpgroup: columns 0–127 in `lo`, 128–255 in `hi`.
    let (mut lo, mut hi) = ([0f32; 64], [0f32; 64]);
    for kt in 0..k_tiles {
        let s = kt % STAGES;
        let stage = base.byte_add::<u8>(s * STAGE);
        // SAFETY: the barrier is live; its phase for this tile completes when both copies land.
        unsafe { wait_at_most_a_second(loaded.add(s), kt / STAGES % 2, status, 1 << 28 | kt) };
        progress(3, kt);
        // The loop above branches on each lane's own result: nothing tells the compiler that the
        // warp is whole again, and the `.aligned` multiplies below need every lane together.
        // SAFETY: every lane of every warp passes here once per tile.
        unsafe { bar_warp_sync(u32::MAX) };
        let a = stage.byte_add::<u8>(group * (A_BYTES / 2)).addr();
        let b = stage.byte_add::<u8>(A_BYTES).addr();
        // SAFETY: every warp of both warpgroups runs this loop convergently (thread 0's branches
        // below rejoin before the next fence); the stage holds tile `kt`, written by the tensor
        // copies (async proxy) whose completion the wait observed; `lo` and `hi` are touched only
        // after the last wait and the operand fences below.
        unsafe {
            wgmma_fence_sync_aligned();
            const _: () = assert!(TILE_K / 16 == 4);
            unroll4!(STEP, {
                wgmma_mma_async_sync_aligned_m64n256k16_f32_bf16_bf16(
                    &mut lo,
                    &mut hi,
                    descriptor_sw128(a + 32 * STEP as u32),
                    descriptor_sw128(b + 32 * STEP as u32),
                );
            });
            wgmma_commit_group_sync_aligned();
        }
        // SAFETY: as above. The previous tile's multiplies are done: its stage may be refilled.
        unsafe { wgmma_wait_group_sync_aligned::<1>() };
        // Tile `kt + STAGES - 1` goes to the stage tile `kt - 1` used (at `kt` = 0, the one stage the
        // first loads left empty), once every warp has released it.
        if kt > 0 && lane == 0 {
            // SAFETY: the barrier is live; this warp's multiplies of tile `kt - 1` completed.
            unsafe { mbarrier_arrive_shared_b64(released.add((kt - 1) % STAGES)) };
        }
        let next = kt + STAGES - 1;
        if tid == 0 && next < k_tiles {
            if kt > 0 {
                // SAFETY: the barrier is live; its phase completes when all eight warps released
                // tile `kt - 1` (its `(kt - 1) / STAGES`-th use of the stage).
                unsafe {
                    wait_at_most_a_second(released.add((kt - 1) % STAGES), (kt - 1) / STAGES % 2, status, 2 << 28 | kt)
                };
            }
            load(next);
        }
        // Warp 0 reconverges after thread 0's loads, before the next `.aligned` instruction.
        // SAFETY: every lane of every warp passes here once per tile.
        unsafe { bar_warp_sync(u32::MAX) };
    }
    // SAFETY: as above; then the accumulators are final and fenced from the compiler.
    unsafe { wgmma_wait_group_sync_aligned::<0>() };
    progress(4, k_tiles);
    wgmma_fence_operands(&mut lo);
    wgmma_fence_operands(&mut hi);
    let out = Global::<f32>::from_addr(c);
    let row = m0 + group * 64 + warp % 4 * 16 + lane / 4;
    // Straight-line (constant indices) so the accumulators stay in registers.
    unroll4!(JA, {
        unroll8!(JB, {
            const J: usize = JA * 8 + JB;
            let col = (n0 + 8 * J as u32 + 2 * (lane % 4)) as u64;
            // SAFETY: C holds `m × n` f32 and rows `row`, `row + 8` and the two columns lie in this
            // CTA's tile.
            unsafe {
                let p = out.add(row as u64 * n as u64 + col);
                let (h, q) = if J < 16 { (&lo, 4 * J) } else { (&hi, 4 * J - 64) };
                *p.ptr() = h[q];
                *p.add(1).ptr() = h[q + 1];
                let p = out.add((row as u64 + 8) * n as u64 + col);
                *p.ptr() = h[q + 2];
                *p.add(1).ptr() = h[q + 3];
            }
        });
    });
    progress(5, k_tiles);
}
