//! The TMA data mover: one issuing thread streams a task's 16-byte-aligned body through a ring of
//! shared-memory stages. Where no task of the launch combines sources, up to
//! [`MAX_ISSUERS`](crate::abi::MAX_ISSUERS) warps may issue instead (`LaunchArgs::issuers`): lane 0
//! of warp `w` streams every `W`-th item from item `w` through its own `stages / W` stages, so each
//! issuer's instruction stream is shorter and the work spreads over the SM's schedulers.
//!
//! Per item (one chunk of every source):
//! 1. the issuer arms the stage's mbarrier with the item's byte count and issues one bulk load per
//!    source into the stage's slots (`stages - lag` items are kept in flight ahead of the consumer);
//! 2. the consumer waits for the stage's phase; with several sources the CTA's threads combine the
//!    slots into slot 0 (`fence.proxy.async.shared::cta`, CTA barrier);
//! 3. the issuer bulk-stores (or bulk-reduces) slot 0 to every destination and commits the group.
//!
//! A task that does not combine (one source, copied or bulk-reduced into every destination) is the
//! issuers' alone ([`stream_issued`], a loop kept short for the issuing thread: beside compute on
//! the same SM its instruction count is what it loses). A task that combines several sources into
//! one destination takes its own pipeline ([`stream_combining`]): thread 0 issues the loads, the
//! combining warps fold the slots in registers and write the result with 16-byte global stores, and
//! a stage is refilled right after the CTA barrier that ends its combine (no bulk store reads it).
//! Several destinations (AllReduce's combine-and-store-everywhere) keep the steps above, one shared
//! copy bulk-stored to each, unless the launch sets `LaunchArgs::combine_direct`.
//!
//! In the steps above a stage is refilled only after `cp.async.bulk.wait_group.read` says the stores
//! of its previous item stopped reading it: the refill lags `lag = stages / 2` items behind the
//! consumer (at least one; with several issuers, `stages` is each issuer's share), so `stages - lag`
//! items of loads and `lag - 1` groups of stores may be in flight at once (`wait_group.read
//! lag-1`). Measured on an H200 (docs/PERF.md, 2026-11-29), the depth beyond that
//! buys nothing: every bulk operation costs the SM's copy engine about a quarter of a microsecond
//! whatever its size, so small chunks are bound by the operation count (16 KiB copies at 64–67 GB/s
//! per CTA with 4, 8 or 12 stages) and only chunks of about 24 KiB and more reach the SM's ~100 GB/s.
//! The host therefore sizes chunks before depth (`oxccl::auto_pipeline`). Completion of writes
//! (`wait_group 0`) is left to the walker, before it signals anyone. When a wait gives up (timeout),
//! the issuer still lets every load it issued land (`wait::mbarrier_drain`) before the stages are
//! reused or the CTA exits, so no bulk copy writes into shared memory the CTA no longer owns (a load
//! that never lands traps the launch).
//! Unaligned heads and tails, and ranges whose buffers disagree in alignment modulo 16, go through
//! the SIMT path.

use super::combine::Combine;
use super::pipeline::PipelineState;
use super::simt::{self, Operands};
use super::{Ctx, wait};
use crate::abi::{DType, RedOp, refill_lag};
use oxccl_ptx::Global;
use oxccl_ptx::bulk::*;
use oxccl_ptx::fence::fence_proxy_async_shared_cta;
use oxccl_ptx::mbarrier::mbarrier_arrive_expect_tx_shared_b64;
use oxccl_ptx::memory::{V4, ld_shared_v4_u32, st_global_v4_u32, st_shared_v4_u32};
use oxccl_ptx::sync::bar_sync_all;

/// How the issuer finishes an item.
#[derive(Clone, Copy)]
pub enum Write {
    /// Bulk-store slot 0 to every destination.
    Store,
    /// Bulk-reduce slot 0 into every destination with the hardware operator.
    Reduce(DType, RedOp),
}

/// Moves `ops` (sources combined in registers when there are several) with the TMA pipeline; the
/// unaligned parts with the SIMT path.
///
/// # Safety
/// As [`simt::run`]; the launch's shared memory holds `stages × slots × chunk_bytes` of stages and
/// `ops.srcs.count() <= ctx.slots`. Every thread of the CTA calls it with the same operands and state.
#[inline(always)]
pub unsafe fn run_move<C: Combine>(ctx: &Ctx, state: &mut PipelineState, ops: &Operands, elem: u32) {
    // SAFETY: forwarded contract.
    unsafe {
        if ops.misalignment(ctx) != 0 {
            simt::elements::<C>(ctx, ops, elem);
            return;
        }
        let head = ops.head_bytes(ctx);
        let body = (ops.bytes - head) & !15;
        simt::elements::<C>(ctx, &ops.window(0, head), elem);
        simt::elements::<C>(ctx, &ops.window(head + body, ops.bytes - head - body), elem);
        let sources = ops.srcs.count();
        stream::<C>(ctx, state, &ops.window(head, body), sources, Write::Store);
    }
}

/// Reduces every source into the single destination of `ops` with `cp.reduce.async.bulk`: one item
/// per (source, chunk), so the reduction order between sources is not fixed. The unaligned parts are
/// combined in registers by the SIMT path (destination first).
///
/// # Safety
/// As [`run_move`]; the hardware supports `(dtype, op)` (`abi::tma_can_reduce`); `ops.dsts` has one
/// range, which no source overlaps.
#[inline(always)]
pub unsafe fn run_reduce_into<C: Combine>(
    ctx: &Ctx,
    state: &mut PipelineState,
    ops: &Operands,
    elem: u32,
    dtype: DType,
    op: RedOp,
) {
    // SAFETY: forwarded contract.
    unsafe {
        let with_dst = Operands { srcs: simt::AddrSet { first: ops.dsts.head(ctx), ..ops.srcs }, ..*ops };
        if ops.misalignment(ctx) != 0 {
            simt::elements::<C>(ctx, &with_dst, elem);
            return;
        }
        let head = ops.head_bytes(ctx);
        let body = (ops.bytes - head) & !15;
        simt::elements::<C>(ctx, &with_dst.window(0, head), elem);
        simt::elements::<C>(ctx, &with_dst.window(head + body, ops.bytes - head - body), elem);
        // One pass per source through the same ring, over the aligned body (the window's offsets).
        let body_ops = ops.window(head, body);
        let mut m = ops.srcs.mask;
        while m != 0 {
            let r = m.trailing_zeros();
            m &= m - 1;
            let one = Operands { srcs: simt::AddrSet { first: 0, mask: 1 << r, ..body_ops.srcs }, ..body_ops };
            stream::<C>(ctx, state, &one, 1, Write::Reduce(dtype, op));
            if ctx.aborted() {
                return;
            }
        }
    }
}

/// The pipeline proper over a 16-byte-aligned range whose length is a multiple of 16.
///
/// # Safety
/// As [`run_move`].
#[inline(always)]
unsafe fn stream<C: Combine>(ctx: &Ctx, state: &mut PipelineState, ops: &Operands, sources: u32, write: Write) {
    let chunk = ctx.chunk_bytes as u64;
    let items = ops.bytes.div_ceil(chunk) as u32;
    let combine = sources > 1;
    if items == 0 {
        return;
    }
    if combine && matches!(write, Write::Store) && (ops.dsts.count() == 1 || ctx.combine_direct) {
        // One destination (ReduceScatter, a program's reduce): registers straight to global
        // memory. Several (AllReduce's combine-and-store-everywhere) keep the shared-memory result
        // and its bulk stores below, one per destination from a single copy, unless the launch asks
        // for plain stores to each (`LaunchArgs::combine_direct`).
        // SAFETY: forwarded contract.
        return unsafe { stream_combining::<C>(ctx, state, ops, sources, items) };
    }
    if !combine {
        // One source: the issuers alone, each through its warp's ring.
        // SAFETY: forwarded contract; `sources <= 1` here and the walker refuses tasks without a
        // source (`src_ranks != 0`), so `ops.srcs` has one range; `ONE_DST` only with one.
        return unsafe {
            if ops.dsts.count() == 1 {
                stream_issued::<true>(ctx, state, ops, items, write)
            } else {
                stream_issued::<false>(ctx, state, ops, items, write)
            }
        };
    }
    // The CTA combines in shared memory: every thread takes every item through the whole ring (the
    // walker allows that only with one issuer), and thread 0 issues.
    let stages = ctx.stages;
    let issuer = ctx.issuer;
    // Every thread waits on the stage barriers below: all must enter with the ring drained.
    // SAFETY: all threads of the CTA take this branch (same operands).
    unsafe { bar_sync_all() };
    let at = |j: u32| j as u64 * chunk;
    let len = |j: u32| (ops.bytes - at(j)).min(chunk) as u32;
    let mut producer = *state;
    let mut consumer = *state;

    // SAFETY (whole block): addresses and sizes are 16-byte multiples inside the ranges (caller's
    // contract); each stage is armed for exactly the bytes its loads bring; stages are refilled only
    // after the stores reading them have finished reading; consumers wait on the phase the producer
    // armed (`PipelineState` pairs index and parity).
    unsafe {
        let load = |p: &PipelineState, j: u32| load_item(ctx, ops, p.index, sources, at(j), len(j));

        // Items the refill lags behind the consumer: the stage item `i + stages - lag` uses was last
        // read by the stores of item `i - lag`, so `lag - 1` newer store groups may still be reading.
        let lag = refill_lag(stages);
        if issuer {
            let ahead = (stages - lag).min(items);
            for j in 0..ahead {
                load(&producer, j);
                producer.advance(stages);
            }
        }
        for j in 0..items {
            if issuer {
                let next = j + stages - lag;
                if next < items {
                    cp_async_bulk_wait_group_read_at_most(lag - 1);
                    load(&producer, next);
                    producer.advance(stages);
                }
            }
            let landed = wait::mbarrier_phase(ctx, ctx.stage_barrier(consumer.index), consumer.phase);
            if landed {
                combine_slots::<C>(ctx, consumer.index, sources, len(j), ops.finish);
            }
            fence_proxy_async_shared_cta();
            if ctx.sync_aborted() {
                break;
            }
            if issuer {
                let n = len(j);
                let slot = ctx.stage_slot(consumer.index, 0);
                for a in ops.dsts.iter(ctx) {
                    let dst = Global::<u8>::from_addr(a + at(j));
                    match write {
                        Write::Store => cp_async_bulk_global_shared_bulk_group(dst, slot, n),
                        Write::Reduce(dtype, op) => bulk_reduce(dst, slot, n, dtype, op),
                    }
                }
                cp_async_bulk_commit_group();
            }
            consumer.advance(stages);
        }
        if issuer {
            drain(ctx, 0, consumer, &producer, stages);
            cp_async_bulk_wait_group_read::<0>();
        }
    }
    state.advance_by(items, stages);
}

/// The pipeline of a task that does not combine (one source, copied or bulk-reduced into every
/// destination): lane 0 of each issuing warp streams its share, items `ring_first, ring_first +
/// ring_stride, …`, through its warp's stages `ring_base ..` (`ring_len` of them) alone; the other
/// threads only keep their view of the ring in step. Written for the issuer's instruction count,
/// which is what a copy beside compute on the same SM loses time to (docs/PERF.md, "Rounds without
/// trace records"): offsets advance by addition, the source's address is read once, and with
/// `ONE_DST` the destination's too.
///
/// # Safety
/// As [`stream`]; `ops.srcs` has exactly one range (its address is read from the buffer table
/// without a check) and, with `ONE_DST`, `ops.dsts` one.
#[inline(always)]
unsafe fn stream_issued<const ONE_DST: bool>(
    ctx: &Ctx,
    state: &mut PipelineState,
    ops: &Operands,
    items: u32,
    write: Write,
) {
    let (first, stride, base, stages) = (ctx.ring_first, ctx.ring_stride, ctx.ring_base, ctx.ring_len);
    let mine = if items > first { (items - first - 1) / stride + 1 } else { 0 };
    if !ctx.ring_issuer || mine == 0 {
        // The issuers run this range alone; keep this thread's view of its warp's ring in step.
        state.advance_by(mine, stages);
        return;
    }
    let chunk = ctx.chunk_bytes as u64;
    // Bytes between two items of this share, and the offsets of the next item to load and to store.
    let step = stride as u64 * chunk;
    let (mut load_at, mut store_at) = (first as u64 * chunk, first as u64 * chunk);
    let len = |at: u64| (ops.bytes - at).min(chunk) as u32;
    let src = ops.srcs.head(ctx);
    let dst = if ONE_DST { ops.dsts.head(ctx) } else { 0 };
    let lag = refill_lag(stages);
    let ahead = stages - lag;
    let mut producer = *state;
    let mut consumer = *state;
    // SAFETY (whole block): as in `stream`: every offset below `ops.bytes` and 16-byte aligned, each
    // stage armed for exactly its load's bytes and refilled only after `wait_group.read` says the
    // stores of its previous item (`lag` items back) stopped reading it.
    unsafe {
        let load = |p: &PipelineState, at: u64| {
            let (bar, n) = (ctx.stage_barrier(base + p.index), len(at));
            let _ = mbarrier_arrive_expect_tx_shared_b64(bar, n);
            let from = Global::<u8>::from_addr(src + at);
            cp_async_bulk_shared_global_mbarrier(ctx.stage_slot(base + p.index, 0), from, n, bar);
        };
        for _ in 0..ahead.min(mine) {
            load(&producer, load_at);
            producer.advance(stages);
            load_at += step;
        }
        for j in 0..mine {
            if j + ahead < mine {
                cp_async_bulk_wait_group_read_at_most(lag - 1);
                load(&producer, load_at);
                producer.advance(stages);
                load_at += step;
            }
            if !wait::mbarrier_phase(ctx, ctx.stage_barrier(base + consumer.index), consumer.phase) {
                break;
            }
            let (slot, n) = (ctx.stage_slot(base + consumer.index, 0), len(store_at));
            if ONE_DST {
                put(write, Global::<u8>::from_addr(dst + store_at), slot, n);
            } else {
                for a in ops.dsts.iter(ctx) {
                    put(write, Global::<u8>::from_addr(a + store_at), slot, n);
                }
            }
            cp_async_bulk_commit_group();
            consumer.advance(stages);
            store_at += step;
        }
        drain(ctx, base, consumer, &producer, stages);
        cp_async_bulk_wait_group_read::<0>();
    }
    state.advance_by(mine, stages);
}

/// The pipeline of a task that combines `sources` (≥ 2) sources into its destinations, `items`
/// chunks long. Thread 0 issues every source's chunk into a stage's slots; the other warps (and
/// warp 0 too, thread 0 included, in a CTA of at most [`ISSUER_COMBINES_MAX_THREADS`] threads)
/// fold the slots in registers and write the
/// result to every destination with 16-byte stores, so no combined chunk goes back through shared
/// memory and no bulk store has to finish reading a stage. A stage is refilled right after the CTA
/// barrier that ends its combine: every other stage of the ring has its loads in flight meanwhile.
///
/// # Safety
/// As [`stream`]; one issuer (the walker refuses combining tasks on a shared ring).
#[inline(always)]
unsafe fn stream_combining<C: Combine>(ctx: &Ctx, state: &mut PipelineState, ops: &Operands, sources: u32, items: u32) {
    let chunk = ctx.chunk_bytes as u64;
    let stages = ctx.stages;
    let at = |j: u32| j as u64 * chunk;
    let len = |j: u32| (ops.bytes - at(j)).min(chunk) as u32;
    // Warp 0 issues; the rest combine, and warp 0 with them in a CTA of few warps.
    let first = if ctx.threads > ISSUER_COMBINES_MAX_THREADS { 32 } else { 0 };
    let combiner = ctx.tid >= first;
    let mut producer = *state;
    let mut consumer = *state;
    // SAFETY (whole block): as in `stream`; a stage is reloaded only after the CTA barrier that
    // follows the last reads of its previous item (bulk stores of earlier tasks finished reading the
    // ring at the end of their `stream`).
    unsafe {
        // Every thread waits on the stage barriers below: all must enter with the ring drained.
        bar_sync_all();
        let load = |p: &PipelineState, j: u32| load_item(ctx, ops, p.index, sources, at(j), len(j));
        if ctx.issuer {
            for j in 0..stages.min(items) {
                load(&producer, j);
                producer.advance(stages);
            }
        }
        for j in 0..items {
            if combiner && wait::mbarrier_phase(ctx, ctx.stage_barrier(consumer.index), consumer.phase) {
                combine_out::<C>(
                    ctx,
                    consumer.index,
                    sources,
                    len(j),
                    ops,
                    at(j),
                    ctx.tid - first,
                    ctx.threads - first,
                );
            }
            if ctx.sync_aborted() {
                break;
            }
            if ctx.issuer && j + stages < items {
                // The combiners' shared loads of this stage (generic proxy) come before the bulk
                // load that overwrites it (async proxy): the barrier above, then this fence.
                fence_proxy_async_shared_cta();
                load(&producer, j + stages);
                producer.advance(stages);
            }
            consumer.advance(stages);
        }
        if ctx.issuer {
            drain(ctx, 0, consumer, &producer, stages);
        }
        // Nobody may reload a stage (next task) before every combiner has read it.
        bar_sync_all();
    }
    state.advance_by(items, stages);
}

/// The most threads a CTA may have for its issuing warp to combine too (in [`stream_combining`]).
/// Measured on an H200 (docs/PERF.md), the issuing warp combining against combining apart:
/// reduce-add per CTA at 64 threads 63.1-66.8 against 48.4 GB/s; at 128 threads 73.5-76.9 against
/// 74.7 but ReduceScatter at 1 CTA 45.34 against 58.86 busbw (-23 %), at 256 threads 83.5 against
/// 94.2 and ReduceScatter 66.42 against 80.69 (-18 %). While its lane issues, the issuing warp's
/// combining waits: that costs less than a second combining warp brings where there is one.
const ISSUER_COMBINES_MAX_THREADS: u32 = 64;

/// Arms stage `stage`'s mbarrier for `n` bytes of each of `sources` sources and issues one bulk
/// load per source, from `offset` into the source, into the stage's slots.
///
/// # Safety
/// The issuing thread; the stage's previous item is no longer read; `offset + n` lies inside every
/// source, 16-byte multiples; `sources <= ctx.slots`.
#[inline(always)]
unsafe fn load_item(ctx: &Ctx, ops: &Operands, stage: u32, sources: u32, offset: u64, n: u32) {
    let bar = ctx.stage_barrier(stage);
    // SAFETY: forwarded contract; the barrier is armed for exactly the bytes the loads bring.
    unsafe {
        let _ = mbarrier_arrive_expect_tx_shared_b64(bar, n * sources);
        for (k, a) in ops.srcs.iter(ctx).enumerate() {
            let src = Global::<u8>::from_addr(a + offset);
            cp_async_bulk_shared_global_mbarrier(ctx.stage_slot(stage, k as u32), src, n, bar);
        }
    }
}

/// After an abandoned wait, loads already issued may still be writing into the ring: lets those of
/// the stages from `consumer` up to `producer` (of the ring at `base`, `stages` long) land before the
/// stages are reused or the CTA exits. A load that does not land within the drain's bound (at least
/// a second) could still write into this shared memory after the CTA has ended and the SM has given
/// it to another kernel: the launch traps instead (its error recorded first), so the context fails
/// loudly rather than let a late copy corrupt whatever runs next.
///
/// # Safety
/// The issuing thread of that ring.
#[inline(always)]
unsafe fn drain(ctx: &Ctx, base: u32, mut consumer: PipelineState, producer: &PipelineState, stages: u32) {
    while consumer.index != producer.index || consumer.phase != producer.phase {
        // SAFETY: forwarded contract; the barrier is this ring's.
        if !unsafe { wait::mbarrier_drain(ctx, ctx.stage_barrier(base + consumer.index), consumer.phase) } {
            oxccl_ptx::sync::trap();
        }
        consumer.advance(stages);
    }
}

/// Vectors a combining thread folds at once in [`combine_out`] (independent shared loads in flight);
/// twice as many first where few threads combine ([`COMBINE_WIDE_MAX_THREADS`]).
const COMBINE_ILP: usize = 4;

/// Folds slots `0..sources` of stage `stage` (`len` bytes) in source order and stores the result at
/// `offset` into every destination of `ops`: thread `me` of `step` combining threads takes vectors
/// `me, me + step, …`, several at a time ([`fold`]). The fold order does not depend on the grouping,
/// so results are the same as the one-vector loop's.
///
/// # Safety
/// The stage's phase has completed; `offset + len` lies inside every destination, 16-aligned.
#[inline(always)]
unsafe fn combine_out<C: Combine>(
    ctx: &Ctx,
    stage: u32,
    sources: u32,
    len: u32,
    ops: &Operands,
    offset: u64,
    me: u32,
    step: u32,
) {
    // SAFETY (both arms): forwarded contract; every address stays inside a destination.
    unsafe {
        let param = ops.finish;
        let finish = |x: V4| if C::FINISHES && param != 0 { C::finish_vec(x, param) } else { x };
        if ops.dsts.count() == 1 {
            // One destination: its address once, not per vector.
            let d = ops.dsts.head(ctx) + offset;
            fold::<C>(ctx, stage, sources, len, me, step, |at, x| {
                st_global_v4_u32(Global::<V4>::from_addr(d + at), finish(x))
            });
        } else {
            fold::<C>(ctx, stage, sources, len, me, step, |at, x| {
                let x = finish(x);
                for a in ops.dsts.iter(ctx) {
                    st_global_v4_u32(Global::<V4>::from_addr(a + offset + at), x);
                }
            });
        }
    }
}

/// The loops of [`combine_out`], with the store of a vector given (by its byte offset into the
/// chunk): groups of twice [`COMBINE_ILP`] vectors where few threads combine, then groups of
/// [`COMBINE_ILP`], then one vector at a time. (Written as `fold_groups::<C, 1>`, the last loop
/// made the kernels 23 % slower at 64 threads: docs/PERF.md.)
///
/// # Safety
/// As [`combine_out`]; `store(at, x)` writes `x` at byte `at` of the chunk to every destination.
#[inline(always)]
unsafe fn fold<C: Combine>(ctx: &Ctx, stage: u32, sources: u32, len: u32, me: u32, step: u32, store: impl Fn(u64, V4)) {
    let n = len / 16;
    let mut v = me;
    // SAFETY (whole block): forwarded contract; every vector folded lies below `n`.
    unsafe {
        if step <= COMBINE_WIDE_MAX_THREADS {
            const W: usize = 2 * COMBINE_ILP;
            // The two thread counts a combine of at most two warps has (threads are whole warps),
            // as constants: a group's addresses are then one register plus an immediate each, which
            // spares two warps most of their integer work.
            v = match step {
                64 => fold_groups::<C, W>(ctx, stage, sources, n, v, 64, &store),
                32 => fold_groups::<C, W>(ctx, stage, sources, n, v, 32, &store),
                _ => v,
            };
        }
        v = fold_groups::<C, COMBINE_ILP>(ctx, stage, sources, n, v, step, &store);
        let slot = |k: u32, v: u32| ctx.stage_slot(stage, k).byte_add::<V4>(16 * v);
        while v < n {
            let mut acc = ld_shared_v4_u32(slot(0, v));
            for k in 1..sources {
                acc = C::vec(acc, ld_shared_v4_u32(slot(k, v)));
            }
            store(16 * v as u64, acc);
            v += step;
        }
    }
}

/// Combining threads at most for [`fold`] to take twice [`COMBINE_ILP`] vectors at once first: with
/// two warps or fewer no other warp hides a group's shared loads, and the wider group measured
/// faster (docs/PERF.md, with the combining ring's 56 KiB chunks: reduce-add per CTA at 64 threads
/// 78.5 -> 83.3 GB/s, 32 threads 49.7 -> 55.5; ReduceScatter and AllReduce at 64 threads +2-7 %;
/// with the thread count as a constant in the group's addresses 88.2 and 58.7).
/// It raises the kernels' register count (f16/bf16 TMA kernels 140 -> 180), which matters only to
/// CTAs of more than 256 threads (two warps of 184 registers per scheduler's register file, three
/// of 144).
const COMBINE_WIDE_MAX_THREADS: u32 = 64;

/// The loop of [`fold`] over whole groups of `ILP` vectors from vector `v` (`v, v + step, …`):
/// returns the first vector of this thread not folded.
///
/// # Safety
/// As [`fold`]; `n` is the stage's vector count.
#[inline(always)]
unsafe fn fold_groups<C: Combine, const ILP: usize>(
    ctx: &Ctx,
    stage: u32,
    sources: u32,
    n: u32,
    mut v: u32,
    step: u32,
    store: &impl Fn(u64, V4),
) -> u32 {
    let slot = |k: u32, v: u32| ctx.stage_slot(stage, k).byte_add::<V4>(16 * v);
    // SAFETY: every slot address is 16-aligned inside the stage (each vector of a group is below n).
    unsafe {
        while v + (ILP as u32 - 1) * step < n {
            let mut acc = [[0u32; 4]; ILP];
            for (u, x) in acc.iter_mut().enumerate() {
                *x = ld_shared_v4_u32(slot(0, v + u as u32 * step));
            }
            for k in 1..sources {
                let mut more = [[0u32; 4]; ILP];
                for (u, x) in more.iter_mut().enumerate() {
                    *x = ld_shared_v4_u32(slot(k, v + u as u32 * step));
                }
                for u in 0..ILP {
                    acc[u] = C::vec(acc[u], more[u]);
                }
            }
            // The group's byte offsets as one 64-bit base plus a constant each where `step` is one.
            let at = 16 * v as u64;
            for (u, x) in acc.iter().enumerate() {
                store(at + (16 * u as u32 * step) as u64, *x);
            }
            v += ILP as u32 * step;
        }
    }
    v
}

const _: () = assert!(
    refill_lag(crate::abi::MAX_STAGES as u32) - 1 <= WAIT_GROUP_READ_MAX && refill_lag(1) == 1 && refill_lag(4) == 2,
    "cp_async_bulk_wait_group_read_at_most tells every lag apart"
);

/// Slot 0 ⊕= slots 1..sources of stage `stage`, `len` bytes, all threads; then the operator's last
/// step where `finish` is nonzero ([`Operands::finish`]).
///
/// # Safety
/// The stage's phase has completed (its loads landed) and no bulk store reads it yet.
#[inline(always)]
unsafe fn combine_slots<C: Combine>(ctx: &Ctx, stage: u32, sources: u32, len: u32, finish: u32) {
    let mut v = ctx.tid;
    while v < len / 16 {
        // SAFETY: every address is 16-aligned inside the stage's slots.
        unsafe {
            let dst = ctx.stage_slot(stage, 0).byte_add(16 * v);
            let mut acc = ld_shared_v4_u32(dst);
            for k in 1..sources {
                acc = C::vec(acc, ld_shared_v4_u32(ctx.stage_slot(stage, k).byte_add(16 * v)));
            }
            if C::FINISHES && finish != 0 {
                acc = C::finish_vec(acc, finish);
            }
            st_shared_v4_u32(dst, acc);
        }
        v += ctx.threads;
    }
}

/// Writes `n` bytes of shared memory at `slot` to `to` as `write` says. A function, not a closure, so
/// that it is always inlined: an outlined copy (taking `write` at run time, through memory) made the
/// bulk reductions of the TMA kernels wrong on an H200 (gpu_engine's ReduceInto cases, 2026-12-05).
///
/// # Safety
/// As `cp_async_bulk_global_shared_bulk_group` and [`bulk_reduce`].
#[inline(always)]
unsafe fn put(write: Write, to: Global<u8>, slot: oxccl_ptx::Shared<u8>, n: u32) {
    // SAFETY: forwarded contract.
    unsafe {
        match write {
            Write::Store => cp_async_bulk_global_shared_bulk_group(to, slot, n),
            Write::Reduce(dtype, op) => bulk_reduce(to, slot, n, dtype, op),
        }
    }
}

/// Bulk-reduces `n` bytes of shared memory into global memory with the operator for `(dtype, op)`.
///
/// # Safety
/// As `cp_reduce_async_bulk_*`; `abi::tma_can_reduce(dtype, op)`.
#[inline(always)]
unsafe fn bulk_reduce(dst: Global<u8>, src: oxccl_ptx::Shared<u8>, n: u32, dtype: DType, op: RedOp) {
    // SAFETY: forwarded contract; the last arm (f32 min/max, bytes, 8-byte types, any product or average) is unreachable
    // by the precondition and falls back to nothing rather than to a wrong operator.
    unsafe {
        match (dtype, op) {
            (DType::F32, RedOp::Sum) => cp_reduce_async_bulk_global_shared_add_f32(dst, src, n),
            (DType::F16, RedOp::Sum) => cp_reduce_async_bulk_global_shared_add_noftz_f16(dst, src, n),
            (DType::Bf16, RedOp::Sum) => cp_reduce_async_bulk_global_shared_add_noftz_bf16(dst, src, n),
            (DType::I32 | DType::U32, RedOp::Sum) => cp_reduce_async_bulk_global_shared_add_u32(dst, src, n),
            (DType::F16, RedOp::Min) => cp_reduce_async_bulk_global_shared_min_f16(dst, src, n),
            (DType::F16, RedOp::Max) => cp_reduce_async_bulk_global_shared_max_f16(dst, src, n),
            (DType::Bf16, RedOp::Min) => cp_reduce_async_bulk_global_shared_min_bf16(dst, src, n),
            (DType::Bf16, RedOp::Max) => cp_reduce_async_bulk_global_shared_max_bf16(dst, src, n),
            (DType::I32, RedOp::Min) => cp_reduce_async_bulk_global_shared_min_s32(dst, src, n),
            (DType::I32, RedOp::Max) => cp_reduce_async_bulk_global_shared_max_s32(dst, src, n),
            (DType::U32, RedOp::Min) => cp_reduce_async_bulk_global_shared_min_u32(dst, src, n),
            (DType::U32, RedOp::Max) => cp_reduce_async_bulk_global_shared_max_u32(dst, src, n),
            (DType::F32, RedOp::Min | RedOp::Max)
            | (DType::U8 | DType::I8 | DType::F8e4m3 | DType::F8e5m2 | DType::F64 | DType::I64 | DType::U64, _)
            | (_, RedOp::Prod | RedOp::Avg) => {}
        }
    }
}
