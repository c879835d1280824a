//! Lowering: a compiled [`Plan`] becomes per-rank device descriptors ([`oxccl_kernels::abi`]'s
//! compiled-plan types), and back.
//!
//! [`lower`] turns a plan into one [`LoweredRank`] per rank: a [`PlanHeader`], one [`PlanTb`] per
//! thread block (one CTA each), their [`PlanSegment`]s, [`FifoTask`]s and [`PlanWait`]s, and the
//! rank's [`FifoConn`] table. One launch per rank runs it; the micro-batch loop is inside the
//! kernel. Two shapes ([`PlanMode`]):
//!
//! * **compiled** (ResCCL): a TB's segments are the plan's ([`TbPlan::segments`]): maximal runs of
//!   one sub-pipeline, each looping over every micro-batch before the next;
//! * **interpreted** (MSCCL's baseline): a TB's whole task list is one segment, re-walked for each
//!   micro-batch, every cross-TB dependency a per-step flag (the progress counter). Compile with the
//!   algorithm-level scheduler and the per-connection allocator (one TB per connection and stage)
//!   for MSCCL's exact shape; any other plan is interpreted the same way, TB by TB.
//!
//! Geometry is fixed at lowering ([`LowerOptions`]): micro-batch `m` of chunk `c` is bytes
//! `c * chunk_bytes + m * mb_bytes ..` `+ mb_bytes`, with `mb_bytes = chunk_bytes / micro_batches` a
//! multiple of 16 (bulk-copy granularity). Every slot of connection `c` holds its largest message.
//!
//! Each rank's FIFO region ([`FIFO_REGION_OFFSET`]) holds, in order: one progress counter per
//! TB, a head and a tail counter per incoming connection (each on its own [`FIFO_ALIGN`] line),
//! then the rings of the incoming connections, by connection index.
//!
//! Buffers: a task's slices are resolved through [`Layout::resolve`] and named by buffer slot
//! ([`slot`]) and chunk: out of place, input, output and scratch are `INPUT`, `OUTPUT` and
//! `SCRATCH`; in place, the larger user buffer holds both (the other is empty), as NCCL passes them
//! ([`place`]).
//!
//! [`decode`] reads descriptors back into a [`PlanView`], the comparable form that
//! [`PlanView::of_plan`] computes from a plan: the round trip is `decode(lower(p)) == of_plan(p)`.
//! [`validate`] checks everything an executor relies on, with typed errors.

use super::{Connection, Plan, Prim, SyncPoint, TbId, TbPlan};
use crate::program::{Layout, OpId, Rank, Slice};
use bytemuck::Zeroable;
use oxccl_kernels::abi::{
    BUFFER_SLOTS, CONN_INTER_NODE, DType, FIFO_ALIGN, FIFO_REGION_OFFSET, FIFO_TASK_SIGNAL, FifoConn, FifoKind,
    FifoTask, MAX_PLAN_CONNECTIONS, MAX_PLAN_TBS, MAX_RANKS, NO_CONN, PLAN_ABI_VERSION, PLAN_FLAG_TIMING, PlanHeader,
    PlanMode, PlanSegment, PlanTb, PlanWait, RedOp, slot,
};
use std::fmt::{self, Write};
use std::ops::Range;

/// What [`lower`] needs beyond the plan.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct LowerOptions {
    /// Compiled (segments are sub-pipelines) or interpreted (one segment per TB).
    pub mode: PlanMode,
    /// Micro-batches every chunk is cut into (at least 1).
    pub micro_batches: u32,
    /// Bytes per chunk: `micro_batches` times a multiple of 16.
    pub chunk_bytes: u64,
    /// Slots of every FIFO ring (at least 1; [`LoweredPlan::slots_needed`] makes the plan
    /// deadlock-free). Fewer are accepted, to study that limit: such a plan can stall, which the
    /// executors report (the CPU executor as a deadlock, the GPU as a FIFO wait's timeout).
    pub fifo_slots: u32,
    /// Element type.
    pub dtype: DType,
    /// Reduction operator.
    pub op: RedOp,
    /// Set [`PLAN_FLAG_TIMING`]: per-TB busy/idle time on the device.
    pub timing: bool,
}

impl Default for LowerOptions {
    fn default() -> Self {
        LowerOptions {
            mode: PlanMode::Compiled,
            micro_batches: 4,
            chunk_bytes: 4 * 1024,
            fifo_slots: 8,
            dtype: DType::F32,
            op: RedOp::Sum,
            timing: false,
        }
    }
}

/// One rank's descriptors: what one launch uploads.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoweredRank {
    /// The rank, the counts of every array below, and the chunk geometry, dtype and operator.
    pub header: PlanHeader,
    /// Indexed by TB (`blockIdx.x`).
    pub tbs: Vec<PlanTb>,
    /// Every TB's segments, concatenated in TB order ([`PlanTb::first_segment`]).
    pub segments: Vec<PlanSegment>,
    /// Every TB's tasks, concatenated in TB order, each TB's in plan order
    /// ([`PlanTb::first_task`]).
    pub tasks: Vec<FifoTask>,
    /// Every task's waits, concatenated in task order ([`FifoTask::wait_start`]).
    pub waits: Vec<PlanWait>,
    /// The connections this rank sends or receives on, by plan connection index.
    pub connections: Vec<FifoConn>,
}

/// A lowered plan: every rank's descriptors, plus what the host needs to place user data.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoweredPlan {
    /// The plan's name.
    pub name: String,
    /// The plan's layout: where inputs and outputs live in the buffer slots ([`place`]).
    pub layout: Layout,
    /// Indexed by rank.
    pub ranks: Vec<LoweredRank>,
    /// FIFO slots that make this lowering deadlock-free: the most messages one connection carries
    /// within one segment per micro-batch.
    pub slots_needed: u32,
}

/// Why a plan does not fit the descriptors.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LowerError {
    /// The plan is malformed ([`Plan::check_structure`]).
    BadPlan {
        /// What [`Plan::check_structure`] found.
        reason: String,
    },
    /// An option is out of range (zero micro-batches or slots, a chunk not cut into 16-byte multiples).
    BadOptions {
        /// Which option, and why it is out of range.
        reason: String,
    },
    /// More ranks than a launch addresses.
    TooManyRanks {
        /// Ranks of the plan's layout.
        ranks: u32,
        /// [`MAX_RANKS`].
        max: usize,
    },
    /// More thread blocks on one rank than a plan may have.
    TooManyTbs {
        /// The rank whose plan has too many thread blocks.
        rank: Rank,
        /// Its thread blocks.
        tbs: usize,
        /// [`MAX_PLAN_TBS`].
        max: usize,
    },
    /// More connections on one rank than its table indexes.
    TooManyConnections {
        /// The rank with too many connections.
        rank: Rank,
        /// Connections it sends or receives on.
        connections: usize,
        /// [`MAX_PLAN_CONNECTIONS`].
        max: usize,
    },
    /// More waits on one task than its descriptor counts.
    TooManyWaits {
        /// The task's rank.
        rank: Rank,
        /// The task's TB.
        tb: TbId,
        /// The task's index in [`TbPlan::tasks`].
        task: usize,
        /// Its sync points (at most `u16::MAX` fit).
        waits: usize,
    },
    /// A progress count (a TB's steps per launch) or a descriptor index does not fit 32 bits.
    CounterOverflow {
        /// The rank being lowered.
        rank: Rank,
        /// The TB being lowered when the count overflowed.
        tb: TbId,
        /// Which count or index.
        what: &'static str,
    },
    /// A size or one of a rank's descriptor counts does not fit its field: a FIFO slot's bytes and
    /// the segment, task and wait counts in 32 bits, a buffer's and the FIFO region's bytes in 64.
    TooLarge {
        /// Which size or count.
        what: &'static str,
    },
}

impl fmt::Display for LowerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LowerError::BadPlan { reason } => write!(f, "malformed plan: {reason}"),
            LowerError::BadOptions { reason } => write!(f, "bad lowering options: {reason}"),
            LowerError::TooManyRanks { ranks, max } => write!(f, "{ranks} ranks: a launch addresses at most {max}"),
            LowerError::TooManyTbs { rank, tbs, max } => write!(f, "{rank} has {tbs} thread blocks, at most {max}"),
            LowerError::TooManyConnections { rank, connections, max } => {
                write!(f, "{rank} uses {connections} connections, at most {max}")
            }
            LowerError::TooManyWaits { rank, tb, task, waits } => {
                write!(f, "{rank} {tb} task {task} has {waits} sync points to wait on, at most {}", u16::MAX)
            }
            LowerError::CounterOverflow { rank, tb, what } => write!(f, "{rank} {tb}: {what} overflows 32 bits"),
            LowerError::TooLarge { what } => write!(f, "{what} is too large for its descriptor field"),
        }
    }
}

impl std::error::Error for LowerError {}

/// Why descriptors are malformed ([`validate`], [`decode`]): what an engine would reject.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DescriptorError {
    /// The rank whose descriptors are wrong.
    pub rank: usize,
    /// What is wrong, naming the entry.
    pub what: String,
}

impl fmt::Display for DescriptorError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "rank {}: {}", self.rank, self.what)
    }
}

impl std::error::Error for DescriptorError {}

/// The buffer slot holding both user buffers of an in-place layout: the larger one (the output on
/// a tie).
pub fn main_slot(l: &Layout) -> u8 {
    if l.output_chunks() >= l.input_chunks() { slot::OUTPUT } else { slot::INPUT }
}

/// Where chunk `flat` of a rank's storage ([`Layout`]) lives: (buffer slot, chunk in the slot).
pub fn place(l: &Layout, flat: u32) -> (u8, u32) {
    let (i, o) = (l.input_chunks(), l.output_chunks());
    if l.in_place {
        let main = i.max(o);
        if flat < main { (main_slot(l), flat) } else { (slot::SCRATCH, flat - main) }
    } else if flat < i {
        (slot::INPUT, flat)
    } else if flat < i + o {
        (slot::OUTPUT, flat - i)
    } else {
        (slot::SCRATCH, flat - i - o)
    }
}

/// The inverse of [`place`]: `None` for a chunk outside every buffer.
pub fn unplace(l: &Layout, rank: Rank, slot_: u8, chunk: u32) -> Option<u32> {
    let have = slot_chunks(l, rank);
    if slot_ as usize >= BUFFER_SLOTS || chunk >= have[slot_ as usize] {
        return None;
    }
    let (i, o) = (l.input_chunks(), l.output_chunks());
    Some(match (l.in_place, slot_) {
        (_, slot::SCRATCH) => chunk + if l.in_place { i.max(o) } else { i + o },
        (true, _) => chunk,
        (false, slot::INPUT) => chunk,
        (false, _) => chunk + i,
    })
}

/// Chunks of each buffer slot of `rank`.
pub fn slot_chunks(l: &Layout, rank: Rank) -> [u32; BUFFER_SLOTS] {
    let (i, o) = (l.input_chunks(), l.output_chunks());
    let mut v = [0u32; BUFFER_SLOTS];
    if l.in_place {
        v[main_slot(l) as usize] = i.max(o);
    } else {
        v[slot::INPUT as usize] = i;
        v[slot::OUTPUT as usize] = o;
    }
    v[slot::SCRATCH as usize] = l.scratch.get(rank.index()).copied().unwrap_or(0);
    v
}

fn fifo_kind(p: Prim) -> FifoKind {
    match p {
        Prim::Send => FifoKind::Send,
        Prim::Recv => FifoKind::Recv,
        Prim::RecvReduceCopy => FifoKind::RecvReduceCopy,
        Prim::Copy => FifoKind::Copy,
        Prim::Reduce => FifoKind::Reduce,
    }
}

/// The plan primitive a FIFO kind lowers from.
pub fn prim_of(k: FifoKind) -> Prim {
    match k {
        FifoKind::Send => Prim::Send,
        FifoKind::Recv => Prim::Recv,
        FifoKind::RecvReduceCopy => Prim::RecvReduceCopy,
        FifoKind::Copy => Prim::Copy,
        FifoKind::Reduce => Prim::Reduce,
    }
}

/// Whether a task of kind `k` has a source and a destination operand.
fn operands(k: FifoKind) -> (bool, bool) {
    match k {
        FifoKind::Send => (true, false),
        FifoKind::Recv => (false, true),
        FifoKind::RecvReduceCopy | FifoKind::Copy | FifoKind::Reduce => (true, true),
    }
}

/// The segments a TB gets in `mode`: the plan's sub-pipeline runs, or the whole list.
pub fn segments_of(tb: &TbPlan, mode: PlanMode) -> Vec<Range<usize>> {
    match mode {
        PlanMode::Compiled => tb.segments(),
        PlanMode::Interpreted if tb.tasks.is_empty() => Vec::new(),
        PlanMode::Interpreted => std::iter::once(0..tb.tasks.len()).collect(),
    }
}

/// Steps finished through task `task` on micro-batch 0, and steps per micro-batch in its segment,
/// for a TB cut into `segs` with `m` micro-batches: the (`base`, `per_mb`) of a [`PlanWait`].
fn progress_point(segs: &[Range<usize>], m: u64, task: usize) -> Option<(u64, u64)> {
    let mut before = 0u64;
    for s in segs {
        if s.contains(&task) {
            return Some((before + (task - s.start) as u64 + 1, s.len() as u64));
        }
        before += s.len() as u64 * m;
    }
    None
}

/// Lowers `plan` into per-rank descriptors. See the [module documentation](self).
pub fn lower(plan: &Plan, opts: &LowerOptions) -> Result<LoweredPlan, LowerError> {
    plan.check_structure().map_err(|reason| LowerError::BadPlan { reason })?;
    let bad = |reason: String| Err(LowerError::BadOptions { reason });
    if opts.micro_batches == 0 || opts.fifo_slots == 0 {
        return bad("micro-batches and FIFO slots must be at least 1".into());
    }
    let m = opts.micro_batches as u64;
    if opts.chunk_bytes == 0 || !opts.chunk_bytes.is_multiple_of(m) || !(opts.chunk_bytes / m).is_multiple_of(16) {
        return bad(format!(
            "{} bytes per chunk do not cut into {} micro-batches of a non-zero multiple of 16 bytes",
            opts.chunk_bytes, opts.micro_batches
        ));
    }
    let mb_bytes = opts.chunk_bytes / m;
    let l = &plan.layout;
    let n = l.ranks as usize;
    if n > MAX_RANKS {
        return Err(LowerError::TooManyRanks { ranks: l.ranks, max: MAX_RANKS });
    }
    // Every buffer's size in bytes fits the 64-bit sizes executors and engines compute.
    for r in 0..l.ranks {
        if slot_chunks(l, Rank(r)).iter().any(|&k| (k as u64).checked_mul(opts.chunk_bytes).is_none()) {
            return Err(LowerError::TooLarge { what: "a buffer (chunks × chunk_bytes)" });
        }
    }
    for (r, rp) in plan.ranks.iter().enumerate() {
        if rp.tbs.len() > MAX_PLAN_TBS {
            return Err(LowerError::TooManyTbs { rank: Rank(r as u32), tbs: rp.tbs.len(), max: MAX_PLAN_TBS });
        }
    }
    // Per connection: the largest message (chunks) and who uses it.
    let nconn = plan.connections.len();
    let mut max_chunks = vec![0u32; nconn];
    for rp in &plan.ranks {
        for tb in &rp.tbs {
            for t in tb.tasks.iter().filter(|t| t.prim.is_comm()) {
                let c = t.conn.expect("checked plan").index();
                let count = t.src.or(t.dst).map(|s| s.count).unwrap_or(0);
                max_chunks[c] = max_chunks[c].max(count);
            }
        }
    }
    let slot_bytes: Vec<u32> = max_chunks
        .iter()
        .map(|&k| {
            let b = (k.max(1) as u64).checked_mul(mb_bytes).and_then(|b| b.checked_next_multiple_of(FIFO_ALIGN as u64));
            b.and_then(|b| u32::try_from(b).ok()).ok_or(LowerError::TooLarge { what: "a FIFO slot" })
        })
        .collect::<Result<_, _>>()?;
    // Each rank's connection table (by plan index) and the index of every connection in it.
    let mut tables: Vec<Vec<usize>> = vec![Vec::new(); n];
    for (c, conn) in plan.connections.iter().enumerate() {
        tables[conn.src.index()].push(c);
        if conn.dst != conn.src {
            tables[conn.dst.index()].push(c);
        }
    }
    for (r, t) in tables.iter().enumerate() {
        if t.len() > MAX_PLAN_CONNECTIONS {
            return Err(LowerError::TooManyConnections {
                rank: Rank(r as u32),
                connections: t.len(),
                max: MAX_PLAN_CONNECTIONS,
            });
        }
    }
    // FIFO regions: progress counters, head/tail counters of incoming connections, rings.
    let line = FIFO_ALIGN as u64;
    let too_large = || LowerError::TooLarge { what: "the FIFO region" };
    let mut counters_at = vec![(0u64, 0u64, 0u64); nconn]; // (head, tail, ring)
    let mut fifo_bytes = vec![0u64; n];
    let mut progress_at = vec![0u64; n];
    for r in 0..n {
        let mut at = FIFO_REGION_OFFSET as u64;
        progress_at[r] = at;
        at += plan.ranks[r].tbs.len() as u64 * line;
        let incoming: Vec<usize> =
            tables[r].iter().copied().filter(|&c| plan.connections[c].dst.index() == r).collect();
        for &c in &incoming {
            counters_at[c].0 = at;
            counters_at[c].1 = at + line;
            at += 2 * line;
        }
        for &c in &incoming {
            counters_at[c].2 = at;
            let ring = (opts.fifo_slots as u64).checked_mul(slot_bytes[c] as u64).ok_or_else(too_large)?;
            at = at.checked_add(ring).ok_or_else(too_large)?;
        }
        fifo_bytes[r] = at - FIFO_REGION_OFFSET as u64;
    }
    let m32 = opts.micro_batches;
    let mut ranks = Vec::with_capacity(n);
    let mut slots_needed = 0u32;
    for (r, rp) in plan.ranks.iter().enumerate() {
        let rank = Rank(r as u32);
        let mut local = vec![NO_CONN; nconn];
        let connections: Vec<FifoConn> = tables[r]
            .iter()
            .enumerate()
            .map(|(i, &c)| {
                local[c] = i as u16;
                let conn = &plan.connections[c];
                FifoConn {
                    id: c as u32,
                    sender: conn.src.0,
                    receiver: conn.dst.0,
                    channel: conn.channel,
                    slots: opts.fifo_slots,
                    slot_bytes: slot_bytes[c],
                    flags: if conn.inter_node { CONN_INTER_NODE } else { 0 },
                    reserved: 0,
                    ring_offset: counters_at[c].2,
                    head_offset: counters_at[c].0,
                    tail_offset: counters_at[c].1,
                }
            })
            .collect();
        let segs: Vec<Vec<Range<usize>>> = rp.tbs.iter().map(|tb| segments_of(tb, opts.mode)).collect();
        // A task signals if the plan says so or anyone waits on it.
        let mut signals: Vec<Vec<bool>> = rp.tbs.iter().map(|tb| tb.tasks.iter().map(|t| t.signal).collect()).collect();
        for tb in &rp.tbs {
            for w in &tb.syncs {
                signals[w.tb.index()][w.task as usize] = true;
            }
        }
        let mut out = LoweredRank {
            header: PlanHeader::zeroed(),
            tbs: Vec::with_capacity(rp.tbs.len()),
            segments: Vec::new(),
            tasks: Vec::new(),
            waits: Vec::new(),
            connections,
        };
        for (t, tb) in rp.tbs.iter().enumerate() {
            let tb_id = TbId::new(t);
            let overflow = |what| LowerError::CounterOverflow { rank, tb: tb_id, what };
            let first_task = u32::try_from(out.tasks.len()).map_err(|_| overflow("the task index"))?;
            let first_segment = u32::try_from(out.segments.len()).map_err(|_| overflow("the segment index"))?;
            let mut steps = 0u64;
            for s in &segs[t] {
                out.segments.push(PlanSegment {
                    first_task: first_task + s.start as u32,
                    task_count: s.len() as u32,
                    micro_batches: m32,
                    progress_base: u32::try_from(steps).map_err(|_| overflow("the progress count"))?,
                });
                steps += s.len() as u64 * m;
                // Messages per connection in this segment, per micro-batch.
                let mut sends: Vec<(u16, u32)> = Vec::new();
                for task in &tb.tasks[s.clone()] {
                    if task.prim == Prim::Send {
                        let c = local[task.conn.expect("checked plan").index()];
                        match sends.iter_mut().find(|x| x.0 == c) {
                            Some(x) => x.1 += 1,
                            None => sends.push((c, 1)),
                        }
                    }
                }
                slots_needed = slots_needed.max(sends.iter().map(|x| x.1).max().unwrap_or(0));
            }
            let steps = u32::try_from(steps).map_err(|_| overflow("the progress count"))?;
            for (i, task) in tb.tasks.iter().enumerate() {
                let waits = tb.waits(i);
                if waits.len() > u16::MAX as usize {
                    return Err(LowerError::TooManyWaits { rank, tb: tb_id, task: i, waits: waits.len() });
                }
                let wait_start = u32::try_from(out.waits.len()).map_err(|_| overflow("the wait index"))?;
                for w in waits {
                    let (base, per_mb) =
                        progress_point(&segs[w.tb.index()], m, w.task as usize).expect("checked plan: task exists");
                    let base = u32::try_from(base).map_err(|_| overflow("a wait's progress count"))?;
                    out.waits.push(PlanWait { tb: w.tb.0, task: w.task, base, per_mb: per_mb as u32 });
                }
                let resolve = |s: Option<Slice>| -> (u8, u32) {
                    s.map(|s| place(l, l.resolve(rank, s).expect("checked plan"))).unwrap_or((0, 0))
                };
                let (src_slot, src_chunk) = resolve(task.src);
                let (dst_slot, dst_chunk) = resolve(task.dst);
                out.tasks.push(FifoTask {
                    kind: fifo_kind(task.prim).raw(),
                    dtype: opts.dtype.raw(),
                    op: opts.op.raw(),
                    flags: if signals[t][i] { FIFO_TASK_SIGNAL } else { 0 },
                    src_slot,
                    dst_slot,
                    conn: task.conn.map(|c| local[c.index()]).unwrap_or(NO_CONN),
                    chunks: task.src.or(task.dst).map(|s| s.count).unwrap_or(0),
                    src_chunk,
                    dst_chunk,
                    wait_start,
                    wait_count: waits.len() as u16,
                    reserved: 0,
                    origin: task.op.0,
                });
            }
            out.tbs.push(PlanTb {
                rank: rank.0,
                tb: t as u32,
                first_segment,
                segment_count: segs[t].len() as u32,
                first_task,
                task_count: tb.tasks.len() as u32,
                steps,
                reserved: 0,
                progress_offset: progress_at[r] + t as u64 * line,
            });
        }
        let count = |x: usize, what| u32::try_from(x).map_err(|_| LowerError::TooLarge { what });
        out.header = PlanHeader {
            version: PLAN_ABI_VERSION,
            mode: opts.mode.raw(),
            rank: rank.0,
            ranks: l.ranks,
            tbs: out.tbs.len() as u32,
            segments: count(out.segments.len(), "the segment count")?,
            tasks: count(out.tasks.len(), "the task count")?,
            waits: count(out.waits.len(), "the wait count")?,
            connections: out.connections.len() as u32,
            micro_batches: m32,
            dtype: opts.dtype.raw(),
            op: opts.op.raw(),
            flags: if opts.timing { PLAN_FLAG_TIMING } else { 0 },
            reserved: 0,
            chunk_bytes: opts.chunk_bytes,
            mb_bytes,
            fifo_bytes: fifo_bytes[r],
            buffer_chunks: slot_chunks(l, rank),
        };
        ranks.push(out);
    }
    Ok(LoweredPlan { name: plan.name.clone(), layout: l.clone(), ranks, slots_needed })
}

/// A task in comparable form: storage chunks instead of slots, plan connections instead of table
/// indices, sync points instead of progress thresholds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ViewTask {
    /// The task's primitive (from its descriptor's kind).
    pub prim: Prim,
    /// The connection of a send or receive.
    pub conn: Option<Connection>,
    /// The plan's connection index.
    pub conn_id: Option<u32>,
    /// (first storage chunk, chunks) read: a send's data, a `recv_reduce_copy`'s local operand, a
    /// local op's source.
    pub src: Option<(u32, u32)>,
    /// (first storage chunk, chunks) written.
    pub dst: Option<(u32, u32)>,
    /// The tasks of other TBs of this rank it waits on, per micro-batch.
    pub waits: Vec<SyncPoint>,
    /// Whether it publishes its progress: the plan marks it
    /// ([`TbTask::signal`](super::TbTask::signal)) or some task waits on it.
    pub signal: bool,
    /// The program op it came from ([`TbTask::op`](super::TbTask::op)).
    pub origin: OpId,
}

/// A TB in comparable form.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ViewTb {
    /// Task index ranges and their micro-batch counts.
    pub segments: Vec<(Range<usize>, u32)>,
    /// The TB's tasks, in execution order.
    pub tasks: Vec<ViewTask>,
}

/// A plan's TB programs in a form both a [`Plan`] (with a mode) and lowered descriptors give.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlanView {
    /// The shape the segments follow (compiled: one per sub-pipeline run; interpreted: one per TB).
    pub mode: PlanMode,
    /// Micro-batches every chunk is cut into.
    pub micro_batches: u32,
    /// `ranks[r][tb]`.
    pub ranks: Vec<Vec<ViewTb>>,
}

impl PlanView {
    /// What lowering `plan` in `mode` with `micro_batches` must decode to.
    pub fn of_plan(plan: &Plan, mode: PlanMode, micro_batches: u32) -> PlanView {
        let l = &plan.layout;
        let ranks = plan
            .ranks
            .iter()
            .enumerate()
            .map(|(r, rp)| {
                let rank = Rank(r as u32);
                let mut signals: Vec<Vec<bool>> =
                    rp.tbs.iter().map(|tb| tb.tasks.iter().map(|t| t.signal).collect()).collect();
                for tb in &rp.tbs {
                    for w in &tb.syncs {
                        signals[w.tb.index()][w.task as usize] = true;
                    }
                }
                rp.tbs
                    .iter()
                    .enumerate()
                    .map(|(t, tb)| ViewTb {
                        segments: segments_of(tb, mode).into_iter().map(|s| (s, micro_batches)).collect(),
                        tasks: tb
                            .tasks
                            .iter()
                            .enumerate()
                            .map(|(i, task)| {
                                let at =
                                    |s: Option<Slice>| s.map(|s| (l.resolve(rank, s).unwrap_or(u32::MAX), s.count));
                                ViewTask {
                                    prim: task.prim,
                                    conn: task.conn.map(|c| plan.connections[c.index()]),
                                    conn_id: task.conn.map(|c| c.0),
                                    src: at(task.src),
                                    dst: at(task.dst),
                                    waits: tb.waits(i).to_vec(),
                                    signal: signals[t][i],
                                    origin: task.op,
                                }
                            })
                            .collect(),
                    })
                    .collect()
            })
            .collect();
        PlanView { mode, micro_batches, ranks }
    }
}

/// Checks every descriptor of `lp` against the others and the layout: what the CPU executor and
/// the engine rely on. The first problem found is the error.
pub fn validate(lp: &LoweredPlan) -> Result<(), DescriptorError> {
    let l = &lp.layout;
    let n = lp.ranks.len();
    if n == 0 || n > MAX_RANKS || n != l.ranks as usize {
        return Err(DescriptorError { rank: 0, what: format!("{n} ranks for a layout of {}", l.ranks) });
    }
    for (r, lr) in lp.ranks.iter().enumerate() {
        let err = |what: String| Err(DescriptorError { rank: r, what });
        let h = &lr.header;
        if h.version != PLAN_ABI_VERSION {
            return err(format!("ABI version {} (expected {PLAN_ABI_VERSION})", h.version));
        }
        if PlanMode::from_raw(h.mode).is_none() || DType::from_raw(h.dtype).is_none() || RedOp::from_raw(h.op).is_none()
        {
            return err("unknown mode, dtype or operator in the header".into());
        }
        if h.rank as usize != r || h.ranks as usize != n || h.flags & !PLAN_FLAG_TIMING != 0 {
            return err("header names another rank, rank count or unknown flags".into());
        }
        // Messages cross ranks: every rank cuts chunks alike, in one mode, for one dtype and operator.
        let h0 = &lp.ranks[0].header;
        if (h.mode, h.micro_batches, h.chunk_bytes, h.mb_bytes, h.dtype, h.op)
            != (h0.mode, h0.micro_batches, h0.chunk_bytes, h0.mb_bytes, h0.dtype, h0.op)
        {
            return err("header disagrees with rank 0's on mode, geometry, dtype or operator".into());
        }
        let counts = [
            (h.tbs as usize, lr.tbs.len(), "TBs"),
            (h.segments as usize, lr.segments.len(), "segments"),
            (h.tasks as usize, lr.tasks.len(), "tasks"),
            (h.waits as usize, lr.waits.len(), "waits"),
            (h.connections as usize, lr.connections.len(), "connections"),
        ];
        for (said, have, what) in counts {
            if said != have {
                return err(format!("header says {said} {what}, there are {have}"));
            }
        }
        if lr.tbs.len() > MAX_PLAN_TBS || lr.connections.len() > MAX_PLAN_CONNECTIONS {
            return err("too many TBs or connections".into());
        }
        if h.micro_batches == 0
            || h.mb_bytes == 0
            || !h.mb_bytes.is_multiple_of(16)
            || h.mb_bytes.checked_mul(h.micro_batches as u64) != Some(h.chunk_bytes)
        {
            return err(
                "chunk geometry: chunk_bytes must be micro_batches × mb_bytes, mb_bytes a multiple of 16".into()
            );
        }
        if h.buffer_chunks != slot_chunks(l, Rank(r as u32)) {
            return err("buffer sizes differ from the layout's".into());
        }
        for (s, &chunks) in h.buffer_chunks.iter().enumerate() {
            if (chunks as u64).checked_mul(h.chunk_bytes).is_none() {
                return err(format!("buffer slot {s}: {chunks} chunks of {} bytes overflow 64 bits", h.chunk_bytes));
            }
        }
        // Everything in the FIFO region: (start, end, what), checked for overlap below.
        let Some(region_end) = (FIFO_REGION_OFFSET as u64).checked_add(h.fifo_bytes) else {
            return err(format!("a FIFO region of {} bytes overflows 64 bits", h.fifo_bytes));
        };
        let region = FIFO_REGION_OFFSET as u64..region_end;
        let mut used: Vec<(u64, u64, String)> = Vec::new();
        let counter = |at: u64, what: String| -> Result<(u64, u64, String), DescriptorError> {
            if !at.is_multiple_of(8) || at < region.start || at.saturating_add(8) > region.end {
                return Err(DescriptorError { rank: r, what: format!("{what} at {at} is outside the FIFO region") });
            }
            Ok((at, at + 8, what))
        };
        // TBs and segments.
        let mut next_task = 0u32;
        let mut next_segment = 0u32;
        for (t, tb) in lr.tbs.iter().enumerate() {
            if tb.rank as usize != r || tb.tb as usize != t {
                return err(format!("tb{t} names rank {} tb{}", tb.rank, tb.tb));
            }
            if tb.first_task != next_task || tb.first_segment != next_segment {
                return err(format!("tb{t}: tasks and segments must follow the previous TB's"));
            }
            let (Some(end_task), Some(end_segment)) =
                (tb.first_task.checked_add(tb.task_count), tb.first_segment.checked_add(tb.segment_count))
            else {
                return err(format!("tb{t}: task or segment range overflows 32 bits"));
            };
            (next_task, next_segment) = (end_task, end_segment);
            if next_task as usize > lr.tasks.len() || next_segment as usize > lr.segments.len() {
                return err(format!("tb{t}: task or segment range outside the arrays"));
            }
            if (tb.task_count == 0) != (tb.segment_count == 0) {
                return err(format!("tb{t}: segments without tasks or tasks without segments"));
            }
            let mut at = tb.first_task;
            let mut steps = 0u64;
            for s in &lr.segments[tb.first_segment as usize..next_segment as usize] {
                if s.first_task != at || s.task_count == 0 || s.micro_batches != h.micro_batches {
                    return err(format!("tb{t}: segments must tile its tasks, each over every micro-batch"));
                }
                if s.progress_base as u64 != steps {
                    return err(format!("tb{t}: segment progress base {} (expected {steps})", s.progress_base));
                }
                let Some(end) = at.checked_add(s.task_count) else {
                    return err(format!("tb{t}: segment task counts overflow 32 bits"));
                };
                at = end;
                steps += s.task_count as u64 * s.micro_batches as u64;
            }
            if at != next_task || tb.steps as u64 != steps {
                return err(format!("tb{t}: segments cover {} tasks, {steps} steps", at - tb.first_task));
            }
            used.push(counter(tb.progress_offset, format!("tb{t}'s progress counter"))?);
        }
        if next_task as usize != lr.tasks.len() || next_segment as usize != lr.segments.len() {
            return err("tasks or segments belong to no TB".into());
        }
        // Connections.
        for (i, c) in lr.connections.iter().enumerate() {
            if (c.sender as usize != r && c.receiver as usize != r)
                || c.sender == c.receiver
                || c.sender as usize >= n
                || c.receiver as usize >= n
            {
                return err(format!("connection {i} does not join this rank to another"));
            }
            if c.slots == 0
                || c.slot_bytes == 0
                || !(c.slot_bytes as usize).is_multiple_of(FIFO_ALIGN)
                || c.flags & !CONN_INTER_NODE != 0
            {
                return err(format!("connection {i}: bad slots, slot size or flags"));
            }
            if i > 0 && lr.connections[i - 1].id >= c.id {
                return err("connection table not sorted by plan index".into());
            }
            // The other end holds an equal entry.
            let other = if c.sender as usize == r { c.receiver } else { c.sender } as usize;
            if !lp.ranks[other].connections.iter().any(|x| x == c) {
                return err(format!("connection {i} (plan c{}) differs from rank {other}'s entry", c.id));
            }
            if c.receiver as usize == r {
                used.push(counter(c.head_offset, format!("connection {i}'s head"))?);
                used.push(counter(c.tail_offset, format!("connection {i}'s tail"))?);
                let bytes = c.slots as u64 * c.slot_bytes as u64;
                if !c.ring_offset.is_multiple_of(FIFO_ALIGN as u64)
                    || c.ring_offset < region.start
                    || c.ring_offset.checked_add(bytes).is_none_or(|e| e > region.end)
                {
                    return err(format!("connection {i}'s ring is outside the FIFO region"));
                }
                used.push((c.ring_offset, c.ring_offset + bytes, format!("connection {i}'s ring")));
            }
        }
        used.sort();
        for w in used.windows(2) {
            if w[1].0 < w[0].1 {
                return err(format!("{} overlaps {}", w[0].2, w[1].2));
            }
        }
        // Tasks and waits.
        let mut drivers: Vec<[Option<usize>; 2]> = vec![[None; 2]; lr.connections.len()];
        for (t, tb) in lr.tbs.iter().enumerate() {
            for i in tb.first_task..tb.first_task + tb.task_count {
                let task = &lr.tasks[i as usize];
                let here = format!("tb{t} task {}", i - tb.first_task);
                let Some(kind) = FifoKind::from_raw(task.kind) else {
                    return err(format!("{here}: unknown kind {}", task.kind));
                };
                if task.dtype != h.dtype || task.op != h.op || task.flags & !FIFO_TASK_SIGNAL != 0 || task.reserved != 0
                {
                    return err(format!("{here}: dtype, operator or flags differ from the header's"));
                }
                if task.chunks == 0 {
                    return err(format!("{here}: moves no chunks"));
                }
                let (has_src, has_dst) = operands(kind);
                for (has, s, c, what) in [
                    (has_src, task.src_slot, task.src_chunk, "source"),
                    (has_dst, task.dst_slot, task.dst_chunk, "destination"),
                ] {
                    let fits = (s as usize) < BUFFER_SLOTS
                        && (c as u64 + task.chunks as u64) <= h.buffer_chunks[s as usize] as u64;
                    if has && !fits {
                        return err(format!("{here}: {what} slot {s} chunks {c}.. outside the buffer"));
                    }
                }
                if has_src && has_dst {
                    // Local operands are disjoint, or (a recv_reduce_copy in place) identical.
                    let a = unplace(l, Rank(r as u32), task.src_slot, task.src_chunk).unwrap_or(0) as u64;
                    let b = unplace(l, Rank(r as u32), task.dst_slot, task.dst_chunk).unwrap_or(0) as u64;
                    let in_place = kind == FifoKind::RecvReduceCopy && a == b;
                    if !in_place && a < b + task.chunks as u64 && b < a + task.chunks as u64 {
                        return err(format!("{here}: source and destination overlap"));
                    }
                }
                let is_comm = !matches!(kind, FifoKind::Copy | FifoKind::Reduce);
                if is_comm {
                    let Some(c) = lr.connections.get(task.conn as usize) else {
                        return err(format!("{here}: connection {} is not in the table", task.conn));
                    };
                    let side = if kind == FifoKind::Send { c.sender } else { c.receiver };
                    if side as usize != r {
                        return err(format!("{here}: this rank is not the connection's {} end", kind_name(kind)));
                    }
                    if (task.chunks as u64).checked_mul(h.mb_bytes).is_none_or(|b| b > c.slot_bytes as u64) {
                        return err(format!("{here}: message larger than a slot"));
                    }
                    let d = &mut drivers[task.conn as usize][(kind != FifoKind::Send) as usize];
                    if d.is_some_and(|d| d != t) {
                        return err(format!("{here}: another TB drives the same end of connection {}", task.conn));
                    }
                    *d = Some(t);
                } else if task.conn != NO_CONN {
                    return err(format!("{here}: a local op names a connection"));
                }
                let end = task.wait_start as u64 + task.wait_count as u64;
                if end > lr.waits.len() as u64 {
                    return err(format!("{here}: waits outside the wait array"));
                }
                for w in &lr.waits[task.wait_start as usize..end as usize] {
                    let Some(target) = lr.tbs.get(w.tb as usize) else {
                        return err(format!("{here}: waits on tb{}, which does not exist", w.tb));
                    };
                    if w.tb as usize == t || w.task >= target.task_count {
                        return err(format!("{here}: waits on itself or on a task that does not exist"));
                    }
                    let segs: Vec<Range<usize>> = lr.segments
                        [target.first_segment as usize..(target.first_segment + target.segment_count) as usize]
                        .iter()
                        .map(|s| {
                            let a = (s.first_task - target.first_task) as usize;
                            a..a + s.task_count as usize
                        })
                        .collect();
                    let want = progress_point(&segs, h.micro_batches as u64, w.task as usize);
                    if want != Some((w.base as u64, w.per_mb as u64)) {
                        return err(format!("{here}: wait on tb{}.{} has the wrong progress threshold", w.tb, w.task));
                    }
                    let tt = &lr.tasks[(target.first_task + w.task) as usize];
                    if tt.flags & FIFO_TASK_SIGNAL == 0 {
                        return err(format!("{here}: waits on tb{}.{}, which does not signal", w.tb, w.task));
                    }
                }
            }
        }
    }
    Ok(())
}

fn kind_name(k: FifoKind) -> &'static str {
    prim_of(k).name()
}

/// Reads `lp` back into the comparable form (after [`validate`]).
pub fn decode(lp: &LoweredPlan) -> Result<PlanView, DescriptorError> {
    validate(lp)?;
    let l = &lp.layout;
    let h0 = &lp.ranks[0].header;
    let mode = PlanMode::from_raw(h0.mode).expect("validated");
    let mut ranks = Vec::with_capacity(lp.ranks.len());
    for (r, lr) in lp.ranks.iter().enumerate() {
        let rank = Rank(r as u32);
        let mut tbs = Vec::with_capacity(lr.tbs.len());
        for tb in &lr.tbs {
            let segments = lr.segments[tb.first_segment as usize..(tb.first_segment + tb.segment_count) as usize]
                .iter()
                .map(|s| {
                    let a = (s.first_task - tb.first_task) as usize;
                    (a..a + s.task_count as usize, s.micro_batches)
                })
                .collect();
            let tasks = lr.tasks[tb.first_task as usize..(tb.first_task + tb.task_count) as usize]
                .iter()
                .map(|task| {
                    let kind = FifoKind::from_raw(task.kind).expect("validated");
                    let (has_src, has_dst) = operands(kind);
                    let at = |has: bool, s: u8, c: u32| {
                        has.then(|| (unplace(l, rank, s, c).expect("validated"), task.chunks))
                    };
                    let conn = (task.conn != NO_CONN).then(|| lr.connections[task.conn as usize]);
                    ViewTask {
                        prim: prim_of(kind),
                        conn: conn.map(|c| Connection {
                            src: Rank(c.sender),
                            dst: Rank(c.receiver),
                            channel: c.channel,
                            inter_node: c.flags & CONN_INTER_NODE != 0,
                        }),
                        conn_id: conn.map(|c| c.id),
                        src: at(has_src, task.src_slot, task.src_chunk),
                        dst: at(has_dst, task.dst_slot, task.dst_chunk),
                        waits: lr.waits[task.wait_start as usize..(task.wait_start + task.wait_count as u32) as usize]
                            .iter()
                            .map(|w| SyncPoint { tb: TbId(w.tb), task: w.task })
                            .collect(),
                        signal: task.flags & FIFO_TASK_SIGNAL != 0,
                        origin: OpId(task.origin),
                    }
                })
                .collect();
            tbs.push(ViewTb { segments, tasks });
        }
        ranks.push(tbs);
    }
    Ok(PlanView { mode, micro_batches: h0.micro_batches, ranks })
}

impl LoweredPlan {
    /// The stable text dump of every descriptor (golden tests); of a plan that fails [`validate`],
    /// the reason alone (its offsets and ranges would not be meaningful).
    pub fn dump(&self) -> String {
        if let Err(e) = validate(self) {
            return format!("invalid lowered plan: {e}\n");
        }
        let mut s = String::new();
        let h0 = self.ranks.first().map(|r| r.header).unwrap_or_else(PlanHeader::zeroed);
        let mode = match PlanMode::from_raw(h0.mode) {
            Some(PlanMode::Compiled) => "compiled",
            Some(PlanMode::Interpreted) => "interpreted",
            None => "?",
        };
        let dtype = DType::from_raw(h0.dtype).map(DType::nccl_name).unwrap_or("?");
        let op = RedOp::from_raw(h0.op).map(RedOp::nccl_name).unwrap_or("?");
        let _ = writeln!(
            s,
            "lowered {} mode={mode} ranks={} micro-batches={} chunk-bytes={} mb-bytes={} dtype={dtype} op={op} slots-needed={}",
            self.name,
            self.ranks.len(),
            h0.micro_batches,
            h0.chunk_bytes,
            h0.mb_bytes,
            self.slots_needed
        );
        let slot_name = |s: u8| match s {
            slot::INPUT => "in",
            slot::OUTPUT => "out",
            slot::SCRATCH => "scr",
            _ => "scr2",
        };
        let region = |at: u64| at - FIFO_REGION_OFFSET as u64;
        for lr in &self.ranks {
            let h = &lr.header;
            let _ = writeln!(
                s,
                "r{}: tbs={} tasks={} waits={} fifo-bytes={} buffers={:?}",
                h.rank, h.tbs, h.tasks, h.waits, h.fifo_bytes, h.buffer_chunks
            );
            for (i, c) in lr.connections.iter().enumerate() {
                let _ = write!(
                    s,
                    "  conn{i} = c{} r{} -> r{} ch={} slots={}x{}",
                    c.id, c.sender, c.receiver, c.channel, c.slots, c.slot_bytes
                );
                if c.receiver == h.rank {
                    let _ = write!(
                        s,
                        " head=+{} tail=+{} ring=+{}",
                        region(c.head_offset),
                        region(c.tail_offset),
                        region(c.ring_offset)
                    );
                }
                let _ = writeln!(s, "{}", if c.flags & CONN_INTER_NODE != 0 { " inter" } else { "" });
            }
            for tb in &lr.tbs {
                let _ = writeln!(s, "  tb{} steps={} progress=+{}", tb.tb, tb.steps, region(tb.progress_offset));
                for seg in &lr.segments[tb.first_segment as usize..(tb.first_segment + tb.segment_count) as usize] {
                    let a = seg.first_task - tb.first_task;
                    let _ = writeln!(
                        s,
                        "    seg {}..{} x{} base={}",
                        a,
                        a + seg.task_count,
                        seg.micro_batches,
                        seg.progress_base
                    );
                    for i in seg.first_task..seg.first_task + seg.task_count {
                        let t = &lr.tasks[i as usize];
                        let kind = FifoKind::from_raw(t.kind);
                        let _ = write!(s, "      {}: {}", i - tb.first_task, kind.map(kind_name).unwrap_or("?"));
                        let (has_src, has_dst) = kind.map(operands).unwrap_or((false, false));
                        if has_src && kind != Some(FifoKind::RecvReduceCopy) {
                            let _ = write!(s, " {}[{}]x{}", slot_name(t.src_slot), t.src_chunk, t.chunks);
                        }
                        if has_dst {
                            let _ = write!(s, " -> {}[{}]x{}", slot_name(t.dst_slot), t.dst_chunk, t.chunks);
                        }
                        if t.conn != NO_CONN {
                            let _ = write!(s, " conn{}", t.conn);
                        }
                        for w in &lr.waits[t.wait_start as usize..(t.wait_start + t.wait_count as u32) as usize] {
                            let _ = write!(s, " wait tb{}.{}>={}+{}m", w.tb, w.task, w.base, w.per_mb);
                        }
                        if t.flags & FIFO_TASK_SIGNAL != 0 {
                            s.push_str(" signal");
                        }
                        let _ = writeln!(s, " (op{})", t.origin);
                    }
                }
            }
        }
        s
    }

    /// Every rank's FIFO region size, the bytes each workspace needs after [`FIFO_REGION_OFFSET`].
    pub fn fifo_bytes(&self) -> Vec<u64> {
        self.ranks.iter().map(|r| r.header.fifo_bytes).collect()
    }
}
