//! The compiled-plan walker: one CTA runs one [`PlanTb`] of a lowered ResCCL plan, its segments ×
//! micro-batches × tasks in the plan's order, with NCCL Simple's FIFO primitives, exactly as the
//! host's CPU executor of the same descriptors (`oxccl_host::exec::lowered`) defines them.
//!
//! ```text
//! for seg in tb.segments: for m in 0..seg.micro_batches: for task in seg: wait; run; signal
//! ```
//!
//! A compiled plan (segments are sub-pipelines) and its interpreted lowering (one segment re-walked
//! per micro-batch, per-step flags) run through this same loop: only the descriptors differ.
//!
//! One *step* (a task on micro-batch `m`), every thread of the CTA:
//! 1. The issuing thread waits, each wait bounded ([`wait::flag_at_least`]): for every
//!    [`PlanWait`], until that TB's progress counter reaches `epoch × steps + base + m × per_mb`
//!    (→ `Progress`); then for its FIFO end ([`acquire_send`], [`acquire_recv`]): room in the ring
//!    (→ `FifoSpace`) or a message (→ `FifoData`). Then `fence.proxy.async.global`, so its bulk
//!    copies see what the acquires made visible (and do not overtake them), and it writes the FIFO
//!    slot's address into the shared-memory step record.
//! 2. A CTA barrier; the CTA leaves together if a wait gave up.
//! 3. Every thread moves the message's pieces with the kernel's mover, the T-CCL movers unchanged
//!    ([`tma::run_move`], [`simt::run`]): `send` local → slot, `recv` slot → local,
//!    `recv_reduce_copy` slot ⊕ local → local, `copy` local → local, `reduce` dst ⊕ src → dst (two
//!    sources are combined in registers by the movers' [`Combine`] path).
//! 4. The issuer completes the writes (`cp.async.bulk.wait_group 0`, `fence.proxy.async.global`); a
//!    CTA barrier orders every thread's stores before
//! 5. the issuer's releases: `st.release.sys` of tail + 1 (send) or head + 1 (receive) into the
//!    receiver's workspace and, for a task flagged [`FIFO_TASK_SIGNAL`], `st.release.gpu` of the TB's
//!    progress count (only TBs of the same rank, on the same GPU, wait on it).
//!
//! Every write of a step is complete before the next step starts (4), so a later task of the same
//! TB may read what an earlier one wrote, as in the CPU executor.
//!
//! **Counters.** Each TB reads its progress counter once at start (only it writes it): `epoch =
//! counter / steps`; when its last step is done it stores `(epoch + 1) × steps`. FIFO counters are
//! read where they live each time they are needed: a sender's own tail (relaxed; only it writes it)
//! and the receiver's head (acquire), both in the receiver's workspace; a receiver's own head and
//! the sender's tail in its own. Nothing is reset between launches (graph replays), and nothing is
//! published after a wait gave up: the host zeroes the workspace after an error.

use super::combine::{Combine, Copy};
use super::pipeline::PipelineState;
use super::simt::{self, AddrSet, Operands};
use super::walker::bad_task;
use super::{Ctx, tma, wait};
use crate::abi::{
    self, BUFFER_SLOTS, DType, FIFO_TASK_SIGNAL, FifoConn, FifoKind, FifoTask, PLAN_FLAG_TIMING, PlanLaunchArgs,
    PlanSegment, PlanTb, PlanWait, RedOp, TbTiming, WaitKind,
};
use oxccl_ptx::Global;
use oxccl_ptx::bulk::cp_async_bulk_wait_group;
use oxccl_ptx::fence::fence_proxy_async_global;
use oxccl_ptx::memory::{ld_relaxed_gpu_u64, ld_relaxed_sys_u64, st_release_gpu_u64, st_release_sys_u64};
use oxccl_ptx::sreg::globaltimer;

/// What every CTA of a launch reads from its [`PlanLaunchArgs`] (constant offsets only).
#[derive(Clone, Copy)]
pub struct Plan {
    programs: *const PlanTb,
    segments: *const PlanSegment,
    tasks: *const FifoTask,
    waits: *const PlanWait,
    connections: *const FifoConn,
    tbs: u32,
    connection_count: u32,
    chunk_bytes: u64,
    mb_bytes: u64,
    /// The [`TbTiming`] array, or 0 when the header does not ask for timing.
    timing: u64,
    dtype: DType,
    op: RedOp,
}

impl Plan {
    /// The launch's plan, for a kernel reducing `dtype` with `op`.
    #[inline(always)]
    pub fn new(args: &PlanLaunchArgs, dtype: DType, op: RedOp) -> Plan {
        let h = &args.header;
        Plan {
            programs: args.programs as *const PlanTb,
            segments: args.segments as *const PlanSegment,
            tasks: args.tasks as *const FifoTask,
            waits: args.waits as *const PlanWait,
            connections: args.connections as *const FifoConn,
            tbs: h.tbs,
            connection_count: h.connections,
            chunk_bytes: h.chunk_bytes,
            mb_bytes: h.mb_bytes,
            timing: if h.flags & PLAN_FLAG_TIMING != 0 { args.timing } else { 0 },
            dtype,
            op,
        }
    }
}

/// Per-TB time accounts (issuer only), kept when the plan asks for timing: the TB's start and its
/// time spent waiting, in shared memory (`smem::PLAN_CLOCK`) rather than in registers.
#[derive(Clone, Copy)]
struct Clock {
    on: bool,
    /// `[start_ns, idle_ns]`.
    at: *mut u64,
}

impl Clock {
    #[inline(always)]
    fn new(ctx: &Ctx, on: bool) -> Clock {
        // SAFETY: smem::PLAN_CLOCK is reserved for the two words (8-byte aligned, below the stages).
        let at = unsafe { ctx.smem.add(abi::smem::PLAN_CLOCK) as *mut u64 };
        Clock { on, at }
    }

    #[inline(always)]
    fn now(&self) -> u64 {
        if self.on { globaltimer() } else { 0 }
    }

    /// Starts the accounts (issuer).
    #[inline(always)]
    fn start(&self) {
        if self.on {
            // SAFETY: see `new`; only the issuer touches the accounts.
            unsafe {
                *self.at = globaltimer();
                *self.at.add(1) = 0;
            }
        }
    }

    /// Counts the time since `since` (a [`Clock::now`]) as waiting (issuer).
    #[inline(always)]
    fn idle_since(&self, since: u64) {
        if self.on {
            // SAFETY: as in `start`.
            unsafe { *self.at.add(1) += globaltimer() - since };
        }
    }

    /// The TB's record, ending now (issuer).
    #[inline(always)]
    fn record(&self) -> TbTiming {
        let end = globaltimer();
        // SAFETY: as in `start`.
        let (start, idle) = unsafe { (*self.at, *self.at.add(1)) };
        TbTiming { start_ns: start, end_ns: end, busy_ns: (end - start).saturating_sub(idle), idle_ns: idle }
    }
}

/// The FIFO slot a step writes (send) or reads (receive), and the counter its release advances.
#[derive(Clone, Copy)]
struct Slot {
    /// Device address of the slot's first byte.
    data: u64,
    /// The counter this end owns: the tail for a send, the head for a receive.
    counter: u64,
    /// Its value once the step is done.
    next: u64,
}

/// Waits for a free slot of `conn` (issuer, send end): `tail − head < slots`, i.e. the receiver's
/// head at least `tail + 1 − slots` (acquire: the receiver is done reading the slot). The slot is
/// `tail % slots` of the receiver's ring. `None` if the wait gave up (`FifoSpace`).
///
/// # Safety
/// `conn` is this rank's entry of a connection it sends on; the workspace table holds the receiver.
#[inline(always)]
unsafe fn acquire_send(ctx: &Ctx, conn: &FifoConn) -> Option<Slot> {
    let ws = ctx.workspace(conn.receiver);
    let slots = conn.slots as u64;
    // SAFETY: the counters are 8-byte aligned in the receiver's FIFO region (the lowering's layout);
    // only this TB writes the tail, so a relaxed read of it sees its own last store.
    unsafe {
        let tail = ld_relaxed_sys_u64(Global::from_addr(ws + conn.tail_offset));
        let head = Global::from_addr(ws + conn.head_offset);
        if !wait::flag_at_least(ctx, head, (tail + 1).saturating_sub(slots), WaitKind::FifoSpace, conn.receiver) {
            return None;
        }
        let data = ws + conn.ring_offset + (tail % slots) * conn.slot_bytes as u64;
        Some(Slot { data, counter: ws + conn.tail_offset, next: tail + 1 })
    }
}

/// Waits for a message on `conn` (issuer, receive end): the sender's tail beyond this end's head
/// (acquire: the sender's writes into the slot are visible). The slot is `head % slots` of this
/// rank's ring. `None` if the wait gave up (`FifoData`).
///
/// # Safety
/// `conn` is this rank's entry of a connection it receives on.
#[inline(always)]
unsafe fn acquire_recv(ctx: &Ctx, conn: &FifoConn) -> Option<Slot> {
    let ws = ctx.workspace(ctx.rank);
    let slots = conn.slots as u64;
    // SAFETY: as in `acquire_send`; only this TB writes the head.
    unsafe {
        let head = ld_relaxed_sys_u64(Global::from_addr(ws + conn.head_offset));
        let tail = Global::from_addr(ws + conn.tail_offset);
        if !wait::flag_at_least(ctx, tail, head + 1, WaitKind::FifoData, conn.sender) {
            return None;
        }
        let data = ws + conn.ring_offset + (head % slots) * conn.slot_bytes as u64;
        Some(Slot { data, counter: ws + conn.head_offset, next: head + 1 })
    }
}

/// Publishes a finished step on its FIFO end: the message is complete (send) or the slot free
/// (receive).
///
/// # Safety
/// Issuer only, after the step's writes are complete and ordered (step 4 of the module docs).
#[inline(always)]
unsafe fn release(slot: &Slot) {
    // SAFETY: the counter's address came from the connection's descriptor.
    unsafe { st_release_sys_u64(Global::from_addr(slot.counter), slot.next) }
}

/// Waits until every sync point of `task` has finished micro-batch `m` (issuer). `false` if a wait
/// gave up or names no TB.
///
/// # Safety
/// The plan's arrays are the launch's; `epoch` is this TB's.
#[inline(always)]
unsafe fn sync_points(ctx: &Ctx, plan: &Plan, task: &FifoTask, m: u32, epoch: u64) -> bool {
    let own = ctx.workspace(ctx.rank);
    for k in 0..task.wait_count as u32 {
        // SAFETY: the wait range lies in the wait array (validated by the host); the TB index is
        // checked against the header before its descriptor is read.
        unsafe {
            let w = *plan.waits.add((task.wait_start + k) as usize);
            if w.tb >= plan.tbs {
                wait::record(ctx, WaitKind::BadTask, u32::MAX, w.tb as u64, 0);
                return false;
            }
            let target = plan.programs.add(w.tb as usize);
            let need = epoch * (*target).steps as u64 + w.base as u64 + m as u64 * w.per_mb as u64;
            let counter = Global::from_addr(own + (*target).progress_offset);
            if !wait::flag_at_least(ctx, counter, need, WaitKind::Progress, w.tb) {
                return false;
            }
        }
    }
    true
}

/// Moves `ops` with the kernel's mover: all threads, the same operands.
///
/// # Safety
/// As [`tma::run_move`] / [`simt::run`].
#[inline(always)]
unsafe fn mover<const TMA: bool, C: Combine>(ctx: &Ctx, state: &mut PipelineState, ops: &Operands, elem: u32) {
    // SAFETY: forwarded contract.
    unsafe {
        if TMA {
            tma::run_move::<C>(ctx, state, ops, elem);
        } else {
            simt::run::<C>(ctx, ops, elem);
        }
    }
}

/// The step record in shared memory: the FIFO slot the issuer acquired for the current step (kept
/// there rather than in registers across the move).
#[inline(always)]
fn step_record(ctx: &Ctx) -> *mut Slot {
    // SAFETY: smem::PLAN_STEP is reserved for it (8-byte aligned, 24 bytes, below the stages).
    unsafe { ctx.smem.add(abi::smem::PLAN_STEP) as *mut Slot }
}

/// Runs task `index` on micro-batch `m` (one step) with every thread of the CTA: waits, the move,
/// the FIFO release. `false` if the CTA must stop (a bad descriptor or an abandoned wait).
///
/// # Safety
/// As [`run`]; `epoch` is this TB's (meaningful in the issuer).
#[inline(always)]
unsafe fn step<const TMA: bool, C: Combine>(
    ctx: &Ctx,
    plan: &Plan,
    state: &mut PipelineState,
    clock: &Clock,
    task: &FifoTask,
    index: u32,
    m: u32,
    epoch: u64,
) -> bool {
    let Some(kind) = FifoKind::from_raw(task.kind) else {
        return bad_task(ctx, index);
    };
    let fifo = !matches!(kind, FifoKind::Copy | FifoKind::Reduce);
    let well_formed = task.dtype == plan.dtype.raw()
        && task.op == plan.op.raw()
        && (task.src_slot as usize) < BUFFER_SLOTS
        && (task.dst_slot as usize) < BUFFER_SLOTS
        && task.chunks != 0
        && (!fifo || (task.conn as u32) < plan.connection_count);
    if !well_formed {
        return bad_task(ctx, index);
    }
    // SAFETY (whole block): descriptors validated above and by the host's lowering; the protocol of
    // the module documentation orders every access.
    unsafe {
        // 1. Waits (issuer), then the FIFO slot into the step record.
        if ctx.issuer {
            let mut slot = Slot { data: 0, counter: 0, next: 0 };
            let since = clock.now();
            let mut ready = sync_points(ctx, plan, task, m, epoch);
            if ready && fifo {
                let conn = *plan.connections.add(task.conn as usize);
                let acquired = if kind == FifoKind::Send { acquire_send(ctx, &conn) } else { acquire_recv(ctx, &conn) };
                match acquired {
                    Some(s) => slot = s,
                    None => ready = false,
                }
            }
            if ready {
                // Also what orders the previous step's results, which the combining threads may have
                // written with plain stores (`tma::stream_combining`), before this step's bulk
                // loads (the CTA barrier at the previous step's end, then this fence): keep it here.
                fence_proxy_async_global();
            }
            clock.idle_since(since);
            *step_record(ctx) = slot;
        }
        // 2. Everyone learns the slot, or that the CTA stops.
        if ctx.sync_aborted() {
            return false;
        }
        // 3. The move, piece by piece. A message is the `chunks` pieces of micro-batch `m`, packed;
        // with one micro-batch per chunk the pieces are contiguous in the buffers too.
        let message = (*step_record(ctx)).data;
        let (cb, mb) = (plan.chunk_bytes, plan.mb_bytes);
        let (pieces, bytes) = if mb == cb { (1, task.chunks as u64 * mb) } else { (task.chunks, mb) };
        let elem = plan.dtype.size() as u32;
        for j in 0..pieces {
            let at = |chunk: u32| (chunk + j) as u64 * cb + m as u64 * mb;
            let local = |slot: u8, chunk: u32| ctx.buffer(ctx.rank, slot) + at(chunk);
            let piece = message + j as u64 * mb;
            // (first source, whether the local source joins it, destination)
            let (first, second, dst) = match kind {
                FifoKind::Send => (local(task.src_slot, task.src_chunk), false, piece),
                FifoKind::Recv => (piece, false, local(task.dst_slot, task.dst_chunk)),
                FifoKind::RecvReduceCopy => (piece, true, local(task.dst_slot, task.dst_chunk)),
                FifoKind::Copy => (local(task.src_slot, task.src_chunk), false, local(task.dst_slot, task.dst_chunk)),
                FifoKind::Reduce => {
                    let d = local(task.dst_slot, task.dst_chunk);
                    (d, true, d)
                }
            };
            let ops = Operands {
                srcs: AddrSet {
                    first,
                    mask: if second { 1 << ctx.rank } else { 0 },
                    slot: task.src_slot,
                    offset: at(task.src_chunk),
                },
                dsts: AddrSet { first: dst, mask: 0, slot: 0, offset: 0 },
                bytes,
                finish: 0,
            };
            if second {
                mover::<TMA, C>(ctx, state, &ops, elem);
            } else {
                mover::<TMA, Copy>(ctx, state, &ops, elem);
            }
            if ctx.aborted() {
                break;
            }
        }
        // 4. Complete the writes; order every thread's before the releases.
        if TMA && ctx.issuer {
            cp_async_bulk_wait_group::<0>();
            fence_proxy_async_global();
        }
        if ctx.sync_aborted() {
            return false;
        }
        // 5. Release the FIFO end.
        if fifo && ctx.issuer {
            release(&*step_record(ctx));
        }
        true
    }
}

/// Runs the thread block `tb` (CTA `block` of the launch) with every thread of the CTA, moving data
/// with the TMA mover if `TMA`, else with the SIMT mover, reducing with `C`.
///
/// # Safety
/// `ctx` was built at entry with the shared-memory tables written (this rank's buffers and every
/// rank's workspace) and, for the TMA mover, the stage barriers initialised; `plan` and `tb` are
/// the launch's valid descriptors (`oxccl_host::compile::lower::validate`), each workspace holds
/// `FIFO_REGION_OFFSET + fifo_bytes` bytes; every TB of every rank of the plan runs concurrently.
#[inline(always)]
pub unsafe fn run<const TMA: bool, C: Combine>(ctx: &Ctx, plan: &Plan, tb: &PlanTb, block: u32) {
    let clock = Clock::new(ctx, plan.timing != 0);
    if ctx.issuer {
        clock.start();
    }
    let progress = Global::<u64>::from_addr(ctx.workspace(ctx.rank) + tb.progress_offset);
    let steps = tb.steps as u64;
    // SAFETY (whole block): the caller's contract; see the module documentation for the protocol.
    unsafe {
        if steps != 0 {
            // This TB's epoch: its counter is a multiple of `steps` between launches.
            let base = if ctx.issuer { ld_relaxed_gpu_u64(progress) / steps * steps } else { 0 };
            let epoch = base / steps;
            let mut state = PipelineState::new();
            let mut finished = true;
            'tb: for s in 0..tb.segment_count {
                let seg = *plan.segments.add((tb.first_segment + s) as usize);
                for m in 0..seg.micro_batches {
                    for i in 0..seg.task_count {
                        let index = seg.first_task + i;
                        let task = *plan.tasks.add(index as usize);
                        if !step::<TMA, C>(ctx, plan, &mut state, &clock, &task, index, m, epoch) {
                            finished = false;
                            break 'tb;
                        }
                        if ctx.issuer && task.flags & FIFO_TASK_SIGNAL != 0 {
                            let done = seg.progress_base as u64 + m as u64 * seg.task_count as u64 + i as u64 + 1;
                            st_release_gpu_u64(progress, base + done);
                        }
                    }
                }
            }
            if TMA && ctx.issuer {
                cp_async_bulk_wait_group::<0>();
            }
            if finished && ctx.issuer {
                st_release_gpu_u64(progress, base + steps);
            }
        }
        if clock.on && ctx.issuer {
            *(plan.timing as *mut TbTiming).add(block as usize) = clock.record();
        }
    }
}
