//! The TB program walker: one CTA's task list between a start and an end barrier with its peers.
//!
//! Barriers pair CTA `c` of this rank with CTA `c` of every rank in the program's `barrier_ranks`,
//! through flags in each rank's workspace:
//! - start: `seq[c] += 1` (this CTA's private counter, in device memory so graph replays count on);
//!   release-store it into every peer's `arrive[rank][c]`; wait until every peer's `arrive[peer][c]`
//!   in our workspace equals it, taking each as the poll finds it (a compare-and-swap from `seq` to
//!   `seq | BARRIER_TAKEN`, [`BARRIER_TAKEN`](abi::BARRIER_TAKEN)), one fence making the swaps
//!   acquires. Peers' buffers are then ready to read and write. Before arriving, the CTA writes its
//!   rank's row of the buffer table into its own `announce[c]`; after the takes every thread of
//!   the CTA reads a word of the peers' rows into its table, so ranks launched separately (other
//!   streams, other processes) need only their own buffers. Addresses in another process's
//!   exported memory ([`region_address`](abi::region_address)) are then resolved through this
//!   rank's region table. Then the CTA lets the next launch on its stream be scheduled
//!   (`griddepcontrol.launch_dependents`; that launch waits at its entry for this one's end).
//! - scope: flags, fences and atomics are at GPU scope where every rank met runs on this GPU
//!   ([`PeerScope`](abi::PeerScope)), at system scope otherwise.
//! - end: every thread's writes are completed (`cp.async.bulk.wait_group 0`, proxy and system fences,
//!   CTA barrier); release-store `seq` into every peer's `done[rank][c]`; wait for every peer's
//!   `done[peer][c]` to equal it. Nobody writes into this rank's buffers after its kernel ends.
//! - giving up (any wait or task failed, here or at a peer): after the same completion of its own
//!   writes the CTA stores `seq | BARRIER_ABORTED` into every peer's `done[rank][c]` (it touches
//!   their buffers no more), then revokes its arrival at every peer (an atomic OR of
//!   [`BARRIER_REVOKED`](abi::BARRIER_REVOKED) into the peer's `arrive[rank][c]`). The word's order
//!   settles the race with the peer's take: the take succeeds only on the clean count, so a take
//!   ordered before the OR is seen by it (this CTA then waits for that peer's `done`, any end,
//!   before its kernel ends), and one after it finds the word revoked, or overwritten by this rank's
//!   next call, and gives up without touching this rank's buffers, however late it starts.
//!   So a rank's buffers are free for its stream's next work once its kernel has ended, whichever
//!   rank gave up; only a peer that holds on past that last wait's bound (twice the timeout, at least
//!   a second) could still touch them, and that wait's timeout is recorded as well.
//! A peer in step cannot move a flag's count past `seq` before this CTA has passed the barrier (it
//! would first need this CTA's flag of the next barrier), so a larger count means the ranks' calls
//! are out of step: the wait records `WaitKind::OutOfStep` instead of passing.
//! Only the issuing thread signals and waits; the others meet it at CTA barriers.

use super::combine::{Combine, Copy};
use super::pipeline::PipelineState;
use super::simt::{self, AddrSet, Operands};
use super::{Ctx, tma, wait};
use crate::abi::{
    self, BARRIER_ABORTED, BARRIER_REVOKED, BARRIER_SEQ, BARRIER_TAKEN, BUFFER_SLOTS, DType, MAX_RANKS, Mover,
    PhaseTimes, RedOp, ReduceMode, TASK_AFTER_WRITES, Task, TaskKind, TbProgram, WaitKind, Workspace,
};
use oxccl_ptx::Global;
use oxccl_ptx::bulk::cp_async_bulk_wait_group;
use oxccl_ptx::fence::fence_proxy_async_global;
use oxccl_ptx::memory::ld_relaxed_sys_u64;
use oxccl_ptx::sreg::globaltimer;
use oxccl_ptx::sync::{bar_sync_all, bar_warp_sync, griddepcontrol_launch_dependents};

/// Runs `program` (its tasks from `tasks`) with every thread of the CTA, moving data with the mover
/// whose raw value is `MOVER`, and reducing `dtype` with `op` (implemented by `C`).
/// Each kernel instantiates one mover and one operator: one kernel holding every combination needs
/// several times the registers of any one of them.
///
/// # Safety
/// `ctx` was built at entry with the shared-memory tables written and the stage barriers initialised;
/// `tasks` addresses the launch's task array, which holds the program's range; every buffer and
/// workspace address in the tables is valid for what the tasks do with it.
#[inline(always)]
pub unsafe fn run<const MOVER: u8, C: Combine>(
    ctx: &Ctx,
    program: &TbProgram,
    tasks: *const Task,
    dtype: DType,
    op: RedOp,
) {
    // The host checked the barrier slot (`abi::barrier_slot_fits`) with the rest of the program.
    let peers = program.barrier_ranks;
    let mut seq = 0;
    if timed(ctx) {
        mark(ctx, 0);
    }
    // SAFETY: `start_barrier`/`end_barrier` run on the issuer only, with the workspace table written
    // at entry (caller's contract) and this CTA's own `seq` slot; every thread reaches each
    // CTA barrier (no early return between them; the abort verdict comes from `sync_aborted`); task
    // `first_task + t` is inside the launch's task array (the host validated the program's range);
    // `execute` checks each descriptor before touching memory; the fences before the end barrier
    // complete bulk writes (`wait_group 0`, proxy fence) and order every thread's writes at system
    // scope before the issuer's release stores.
    unsafe {
        if ctx.issuer && peers != 0 {
            seq = start_barrier(ctx, peers);
        }
        converge_issuer_warp(ctx);
        if peers != 0 && !ctx.sync_aborted() {
            read_announcements(ctx, peers);
        }
        if peers != 0 {
            // The announcements' checks (any thread's) reach the issuer here.
            bar_sync_all();
        }
        if ctx.issuer {
            if !ctx.aborted() {
                resolve_buffers(ctx, peers);
            }
            if timed(ctx) {
                mark(ctx, 1);
            }
        }
        converge_issuer_warp(ctx);
        // Every CTA of every rank this launch meets is resident (each has arrived): the next
        // launch on this rank's stream may now be scheduled, to wait at its entry for this one's
        // end, so that its launch and set-up overlap this call. Earlier, its CTAs could take the
        // room a peer's CTAs of this call still need.
        griddepcontrol_launch_dependents();
        if !ctx.sync_aborted() {
            let mut state = PipelineState::new();
            for t in 0..program.task_count {
                let task = *tasks.add((program.first_task + t) as usize);
                if !execute::<MOVER, C>(ctx, &mut state, &task, program.first_task + t, dtype, op) {
                    break;
                }
            }
        }
        if timed(ctx) {
            mark(ctx, 2);
        }
        // Read again: held in a register through the tasks, it took one the movers need.
        let peers = ctx.peers();
        // Complete every write before telling anyone (each issuer its own bulk groups; the other
        // movers issue none). A launch that meets no one tells no one: its kernel's end orders its
        // writes before its stream's next work, and a fence here would wait for every store.
        if MOVER == Mover::Tma as u8 && ctx.ring_issuer {
            cp_async_bulk_wait_group::<0>();
            fence_proxy_async_global();
        }
        if peers != 0 {
            ctx.fence_peers();
        }
        converge_issuing_warps::<MOVER>();
        bar_sync_all();
        if timed(ctx) {
            mark(ctx, 3);
        }
        if peers != 0 && ctx.issuer {
            if !ctx.aborted() {
                end_barrier(ctx, peers, seq);
            }
            // Here or at the end barrier, this CTA may have given up: withdraw from the call.
            if ctx.aborted() {
                withdraw(ctx, peers, seq);
            }
        }
        if timed(ctx) {
            add_phase_times(ctx);
        }
        converge_issuer_warp(ctx);
        bar_sync_all();
    }
}

/// Brings the issuer's warp together before a CTA barrier that follows code the issuer ran alone
/// (the start and end barriers, buffer resolution): its other lanes wait here for it, as
/// compute-sanitizer's synccheck requires ("Divergent thread(s) in block" without).
///
/// # Safety
/// Every thread of the CTA (whole warps) calls it.
#[inline(always)]
unsafe fn converge_issuer_warp(ctx: &Ctx) {
    if ctx.tid < 32 {
        // SAFETY: every lane of warp 0 arrives (caller's contract).
        unsafe { bar_warp_sync(u32::MAX) }
    }
}

/// Brings each warp of a TMA kernel together before a CTA barrier that follows code its issuers
/// ran alone (the issue loops, the bulk-group waits). It does not silence synccheck's "Divergent
/// thread(s) in block" on transfer programs (2026-12-07, H100): a warp that reaches the end-of-task
/// barrier diverged takes the compiler's divergent copy of it (`BRA.DIV` to `WARPSYNC.COLLECTIVE`)
/// with or without it, and is reported there; where that warp diverges is open (warp 0, in CTAs of
/// several warps, on long tasks; not the refill's jump table: 2026-12-08). In the other movers
/// every thread runs the tasks (the issuer alone only marks phase times or records a bad
/// task there); warp barriers at these points cost them 0.2 µs a call and moved synccheck's reports
/// into them (2026-12-07, H100).
///
/// # Safety
/// Every thread of the CTA (whole warps) calls it.
#[inline(always)]
unsafe fn converge_issuing_warps<const MOVER: u8>() {
    if MOVER == Mover::Tma as u8 {
        // SAFETY: every lane of every warp arrives (caller's contract).
        unsafe { bar_warp_sync(u32::MAX) }
    }
}

/// Shared-memory phase mark `i` (0..4) of this CTA's call ([`abi::smem::PHASE_MARKS`]; 4
/// ([`RECORDS`]): where they are added, 0 for nowhere): kept there, not in registers, which the
/// movers need.
#[inline(always)]
fn phase_mark(ctx: &Ctx, i: usize) -> *mut u64 {
    // SAFETY: five `u64`s at a fixed, 8-aligned offset of the header, unused otherwise by these kernels
    // (`abi::smem::PHASE_MARKS`); `i` is below 5 at every call.
    unsafe { (ctx.smem.add(abi::smem::PHASE_MARKS) as *mut u64).add(i) }
}

/// The phase mark that holds the address of the [`PhaseTimes`] records.
const RECORDS: usize = 4;

/// Whether this thread keeps the call's phase times: the issuer, where the launch asks for them
/// (the entry wrote mark [`RECORDS`] from `LaunchArgs::phase_times`).
#[inline(always)]
fn timed(ctx: &Ctx) -> bool {
    // SAFETY: the entry wrote the mark before the CTA barrier that precedes the walker.
    ctx.issuer && unsafe { *phase_mark(ctx, RECORDS) } != 0
}

/// Records the time as phase mark `i` (issuer only).
#[inline(always)]
fn mark(ctx: &Ctx, i: usize) {
    // SAFETY: the issuer alone touches the marks.
    unsafe { *phase_mark(ctx, i) = globaltimer() };
}

/// Adds one call's phases (the marks: entry, start barrier passed, tasks done, their writes
/// complete; now: end barrier passed) to this CTA's [`PhaseTimes`] (issuer only; the record is
/// this CTA's alone, and launches of one rank run one after another).
///
/// # Safety
/// Mark [`RECORDS`] addresses `MAX_RANKS × MAX_CTAS_PER_RANK` records.
#[inline(always)]
unsafe fn add_phase_times(ctx: &Ctx) {
    // Pair slots (point-to-point CTAs, several per slot number in one launch) keep no record.
    if ctx.cta as usize >= abi::MAX_CTAS_PER_RANK {
        return;
    }
    let i = ctx.rank as usize % MAX_RANKS * abi::MAX_CTAS_PER_RANK + ctx.cta as usize % abi::MAX_CTAS_PER_RANK;
    // SAFETY: the caller's contract; `i` is inside the array; the marks were written by this thread.
    unsafe {
        let t = [*phase_mark(ctx, 0), *phase_mark(ctx, 1), *phase_mark(ctx, 2), *phase_mark(ctx, 3), globaltimer()];
        let r = &mut *(*phase_mark(ctx, RECORDS) as *mut PhaseTimes).add(i);
        let gap = if r.calls == 0 { 0 } else { t[0].saturating_sub(r.last_end_ns) };
        r.calls += 1;
        r.gap_ns += gap;
        r.start_ns += t[1].saturating_sub(t[0]);
        r.tasks_ns += t[2].saturating_sub(t[1]);
        r.drain_ns += t[3].saturating_sub(t[2]);
        r.end_ns += t[4].saturating_sub(t[3]);
        r.last_end_ns = t[4];
        r.max_gap_ns = r.max_gap_ns.max(gap);
    }
}

/// Runs one task; `false` if the CTA must stop (a bad descriptor or an abandoned wait).
///
/// # Safety
/// As [`run`].
#[inline(always)]
unsafe fn execute<const MOVER: u8, C: Combine>(
    ctx: &Ctx,
    state: &mut PipelineState,
    task: &Task,
    index: u32,
    dtype: DType,
    op: RedOp,
) -> bool {
    // A kernel serves one (dtype, operator): a task for another is malformed.
    let Some(kind) = TaskKind::from_raw(task.kind) else {
        return bad_task(ctx, index);
    };
    if task.dtype != dtype.raw() || task.op != op.raw() {
        return bad_task(ctx, index);
    }
    let rank_limit = if MAX_RANKS == 32 { u32::MAX } else { (1u32 << MAX_RANKS) - 1 };
    let elem = dtype.size() as u64;
    let well_formed = task.src_ranks != 0
        && task.dst_ranks != 0
        && task.src_ranks & !rank_limit == 0
        && task.dst_ranks & !rank_limit == 0
        && (task.src_slot as usize) < BUFFER_SLOTS
        && (task.dst_slot as usize) < BUFFER_SLOTS
        && task.bytes % elem == 0
        && task.src_offset % elem == 0
        && task.dst_offset % elem == 0
        && (kind != TaskKind::ReduceInto || task.dst_ranks.count_ones() == 1)
        && (task.divisor <= 1 || op == RedOp::Avg);
    if !well_formed {
        return bad_task(ctx, index);
    }

    // SAFETY: validated descriptor; addresses come from the tables (see `run`).
    unsafe {
        if task.flags & TASK_AFTER_WRITES != 0 {
            // Bulk writes (the TMA mover's alone) complete and reach the generic proxy first.
            if MOVER == Mover::Tma as u8 {
                if ctx.ring_issuer {
                    cp_async_bulk_wait_group::<0>();
                }
                fence_proxy_async_global();
            }
            converge_issuing_warps::<MOVER>();
            bar_sync_all();
        }
        let ops = Operands {
            srcs: AddrSet { first: 0, mask: task.src_ranks, slot: task.src_slot, offset: task.src_offset },
            dsts: AddrSet { first: 0, mask: task.dst_ranks, slot: task.dst_slot, offset: task.dst_offset },
            bytes: task.bytes,
            finish: if C::FINISHES && task.divisor > 1 { C::finish_param(task.divisor as u32) } else { 0 },
        };
        let with_dst = Operands { srcs: AddrSet { first: ops.dsts.head(ctx), ..ops.srcs }, ..ops };
        let elem = elem as u32;
        // Pick the path and its operands first, so each path is instantiated once per operator.
        let tma_reduces = ctx.reduce_mode == ReduceMode::Tma && abi::tma_can_reduce(dtype, op);
        let tma = MOVER == Mover::Tma as u8;
        let (path, operands) = match (tma, kind) {
            (false, TaskKind::Move) => (Path::Simt, ops),
            (false, TaskKind::ReduceInto) => (Path::Simt, with_dst),
            (true, TaskKind::Move) => (Path::TmaMove, ops),
            (true, TaskKind::ReduceInto) if tma_reduces => (Path::TmaReduceInto, ops),
            (true, TaskKind::ReduceInto) => (Path::TmaMove, with_dst),
        };
        // Combining sources needs the whole ring in one issuer's hands (the host never launches that;
        // this keeps a malformed launch from sharing stages between issuers).
        if path == Path::TmaMove
            && (operands.srcs.count() > ctx.slots || operands.srcs.count() > 1 && ctx.ring_stride > 1)
        {
            return bad_task(ctx, index);
        }
        // A single source is a copy: no operator, one instantiation.
        let copy = operands.srcs.count() == 1;
        let latency = MOVER == Mover::Latency as u8;
        match path {
            Path::Simt if latency && copy => simt::gathered::<Copy>(ctx, &operands, elem),
            Path::Simt if latency => simt::gathered::<C>(ctx, &operands, elem),
            Path::Simt if copy => simt::run::<Copy>(ctx, &operands, elem),
            Path::Simt => simt::run::<C>(ctx, &operands, elem),
            Path::TmaMove if copy => tma::run_move::<Copy>(ctx, state, &operands, elem),
            Path::TmaMove => tma::run_move::<C>(ctx, state, &operands, elem),
            Path::TmaReduceInto => tma::run_reduce_into::<C>(ctx, state, &operands, elem, dtype, op),
        }
        // The issuer pipelines copies and bulk reductions alone and may have given up a wait: the CTA
        // decides at a barrier, so all threads leave the task loop together.
        converge_issuing_warps::<MOVER>();
        !ctx.sync_aborted()
    }
}

/// The data path of a task.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Path {
    Simt,
    TmaMove,
    TmaReduceInto,
}

/// Records a malformed descriptor (`WaitKind::BadTask`, naming the task) and stops the CTA. Every
/// thread calls it with the same verdict; the issuer records.
pub(crate) fn bad_task(ctx: &Ctx, index: u32) -> bool {
    if ctx.issuer {
        wait::record(ctx, WaitKind::BadTask, index, 0, 0);
    }
    ctx.set_abort();
    false
}

/// The ranks in `peers` other than this CTA's, lowest first.
#[inline(always)]
fn others(ctx: &Ctx, peers: u32) -> impl Iterator<Item = u32> {
    let mut m = peers & !(1 << ctx.rank);
    core::iter::from_fn(move || {
        if m == 0 {
            return None;
        }
        let q = m.trailing_zeros();
        m &= m - 1;
        Some(q)
    })
}

/// The one rank in `peers` other than this CTA's (a pair slot's peer; for a collective's CTA,
/// which meets many, the value is unused by [`abi::private_slot`]).
#[inline(always)]
fn only_peer(ctx: &Ctx, peers: u32) -> usize {
    (peers & !(1 << ctx.rank)).trailing_zeros() as usize
}

/// The address of this CTA's flag (`offset(rank, cta)`) in rank `q`'s workspace.
#[inline(always)]
fn flag_at_peer(ctx: &Ctx, q: u32, offset: fn(usize, usize) -> usize) -> Global<u64> {
    Global::from_addr(ctx.workspace(q) + offset(ctx.rank as usize, ctx.cta as usize) as u64)
}

/// The address of rank `q`'s flag (`offset(q, cta)`) in this rank's workspace.
#[inline(always)]
fn flag_of_peer(ctx: &Ctx, q: u32, offset: fn(usize, usize) -> usize) -> Global<u64> {
    Global::from_addr(ctx.workspace(ctx.rank) + offset(q as usize, ctx.cta as usize) as u64)
}

/// Stores `value` into this CTA's flag (`offset`) in every peer's workspace with release
/// semantics: one fence at the peer scope, then relaxed stores (a release pattern for each). A
/// release store per peer would fence once per peer.
///
/// # Safety
/// The workspace table holds every rank in `peers`.
#[inline(always)]
unsafe fn publish(ctx: &Ctx, peers: u32, offset: fn(usize, usize) -> usize, value: u64) {
    // SAFETY: a fence has no operands; it orders this thread's earlier writes before the stores.
    unsafe { ctx.fence_peers() };
    for q in others(ctx, peers) {
        // SAFETY: the caller's contract: the flag lies in peer `q`'s workspace.
        unsafe { ctx.store_flag(flag_at_peer(ctx, q, offset), value) };
    }
}

/// The start barrier (issuer only); returns this collective's sequence number.
///
/// # Safety
/// The workspace table holds every rank in `peers`; this CTA alone uses its `seq` slot.
#[inline(always)]
unsafe fn start_barrier(ctx: &Ctx, peers: u32) -> u64 {
    let slot = abi::private_slot(ctx.cta as usize, only_peer(ctx, peers));
    let seq_at = (ctx.workspace(ctx.rank) + Workspace::seq_offset(slot) as u64) as *mut u64;
    // SAFETY: the caller's contract; plain accesses to `seq` are private to this CTA across launches
    // (stream order separates launches).
    unsafe {
        let seq = *seq_at + 1;
        *seq_at = seq;
        // This rank's buffers for the peers, before the arrival that orders them (release).
        let own = ctx.workspace(ctx.rank);
        let word = |w: usize| (own + Workspace::announce_offset(slot, w) as u64) as *mut u64;
        for s in 0..BUFFER_SLOTS {
            *word(s) = ctx.buffer(ctx.rank, s as u8);
        }
        *word(BUFFER_SLOTS) = ctx.call_key as u64;
        publish(ctx, peers, Workspace::arrive_offset, seq);
        // Every arrival is taken (a compare-and-swap from the clean count, in the poll that finds
        // it): a word that no longer holds it was revoked (the peer gave up this call and may have
        // ended) or already overwritten by the peer's next call (which it can only reach by giving
        // this one up): none of the call's tasks may run (the arrivals taken make their peers wait
        // for this CTA's `done`, which `withdraw` writes). The fence that ends the wait makes the
        // swaps acquires: each peer's announced buffers, written before its arrival, are its
        // buffers in this call (the peer rewrites them only in its next call, which it reaches
        // after this CTA's `done`).
        let others_mask = peers & !(1 << ctx.rank);
        if wait::flags_reach(ctx, others_mask, Workspace::arrive_offset, seq, WaitKind::StartBarrier, true) {
            // Later bulk loads of peer buffers (async proxy) come after the acquires above.
            fence_proxy_async_global();
        }
        seq
    }
}

/// Reads every peer's announcement (its row of the buffer table and its call key) into this CTA's
/// table, one word per thread, all in flight at once (a word at a time per peer would cost a
/// round trip each); a call key that differs from this rank's records [`WaitKind::Mismatch`].
/// Every thread of the CTA, after the CTA barrier that follows the issuer's start barrier (whose
/// acquires it extends to them).
///
/// # Safety
/// As [`start_barrier`], which has passed.
#[inline(always)]
unsafe fn read_announcements(ctx: &Ctx, peers: u32) {
    let others_mask = peers & !(1 << ctx.rank);
    let table = ctx.buffer_table_mut();
    let words = BUFFER_SLOTS as u32 + 1;
    // Where each peer announced for this CTA: its slot towards this rank.
    let slot = abi::private_slot(ctx.cta as usize, ctx.rank as usize);
    let mut i = ctx.tid;
    while i < MAX_RANKS as u32 * words {
        let (q, w) = ((i / words) as usize, (i % words) as usize);
        if others_mask & (1 << q) != 0 {
            let at = Global::<u64>::from_addr(ctx.workspace(q as u32) + Workspace::announce_offset(slot, w) as u64);
            // SAFETY: the word lies in peer `q`'s workspace (the caller's contract); entry `(q, w)`
            // of the table is this thread's alone, read only after the next CTA barrier.
            unsafe {
                let v = ctx.load_flag(at);
                if w < BUFFER_SLOTS {
                    *table.add(q * BUFFER_SLOTS + w) = v;
                } else if v != ctx.call_key as u64 && v != 0 && ctx.call_key != 0 {
                    wait::record(ctx, WaitKind::Mismatch, q as u32, ctx.call_key as u64, v);
                }
            }
        }
        i += ctx.threads;
    }
}

/// Resolves the buffer table's [`region_address`](abi::region_address)es (memory other processes
/// exported) to this rank's mappings, through its region table (issuer only, before the CTA barrier
/// that publishes the table). An address in a region this rank has not mapped records
/// `WaitKind::Unmapped` and aborts the CTA before any task touches memory. Only the rows of this
/// rank and of the ranks it meets (`peers`) can hold one: a launch that meets no one holds every
/// rank of one process, whose buffers are its own. A loop over those rows, not over the whole
/// table: unrolled over every entry, the code took about 3 µs of each call (measured with
/// `OXCCL_DEBUG=phases` on virtual ranks, where it was all the start phase held).
///
/// # Safety
/// The table was written at entry (and the peers' rows at the start barrier); this rank's workspace
/// is a communicator workspace with its region table at [`abi::REGIONS_OFFSET`].
#[inline(always)]
unsafe fn resolve_buffers(ctx: &Ctx, peers: u32) {
    let table = ctx.buffer_table_mut();
    let regions = ctx.workspace(ctx.rank);
    let mut rows = (peers | 1 << ctx.rank) & ((1u64 << MAX_RANKS) - 1) as u32;
    while rows != 0 {
        let r = rows.trailing_zeros() as usize;
        rows &= rows - 1;
        for s in 0..BUFFER_SLOTS {
            // SAFETY: the table holds MAX_RANKS × BUFFER_SLOTS entries (r < MAX_RANKS: masked); the
            // region entry lies in the region table (region < MAX_REGIONS checked); the host wrote it
            // before any launch that names the region (relaxed at system scope: not a line another
            // launch left in L1).
            unsafe {
                let at = table.add(r * BUFFER_SLOTS + s);
                let Some((region, offset)) = abi::split_region_address(*at) else { continue };
                let base = if (region as usize) < abi::MAX_REGIONS {
                    ld_relaxed_sys_u64(Global::from_addr(regions + abi::region_entry_offset(r, region as usize) as u64))
                } else {
                    0
                };
                if base == 0 {
                    wait::record(ctx, WaitKind::Unmapped, r as u32, region as u64, *at);
                    return;
                }
                *at = base + offset;
            }
        }
    }
}

/// Withdraws this CTA from call `seq`, which it gave up (issuer only, after every write of the CTA
/// is complete and fenced): tells every peer it touches their buffers no more, revokes its
/// arrivals, and waits for the peers that took one before it did to be done with this rank's
/// buffers.
///
/// # Safety
/// As [`start_barrier`]; `seq` is what it returned.
#[inline(always)]
unsafe fn withdraw(ctx: &Ctx, peers: u32, seq: u64) {
    // A peer that took the arrival is running the call's tasks: its waits are bounded by the
    // timeout, after which it withdraws too.
    let bound = ctx.timeout_ns.saturating_mul(2).max(WITHDRAW_TIMEOUT_NS);
    // SAFETY: the caller's contract.
    unsafe {
        publish(ctx, peers, Workspace::done_offset, seq | BARRIER_ABORTED);
        for q in others(ctx, peers) {
            let seen = ctx.or_flag(flag_at_peer(ctx, q, Workspace::arrive_offset), BARRIER_REVOKED);
            if seen & BARRIER_TAKEN != 0 && seen & BARRIER_SEQ == seq {
                // On timeout the wait is recorded; nothing more can be done without hanging.
                let _ = wait::flag_settles(ctx, flag_of_peer(ctx, q, Workspace::done_offset), seq, q, bound);
            }
        }
    }
}

/// Shortest bound on [`withdraw`]'s wait for a peer that is running the call.
const WITHDRAW_TIMEOUT_NS: u64 = 1_000_000_000;

/// The end barrier (issuer only, after every write of the CTA is complete and fenced).
///
/// # Safety
/// As [`start_barrier`]; `seq` is what it returned.
#[inline(always)]
unsafe fn end_barrier(ctx: &Ctx, peers: u32, seq: u64) {
    // SAFETY: the caller's contract.
    unsafe {
        publish(ctx, peers, Workspace::done_offset, seq);
        let _ =
            wait::flags_reach(ctx, peers & !(1 << ctx.rank), Workspace::done_offset, seq, WaitKind::EndBarrier, false);
    }
}
