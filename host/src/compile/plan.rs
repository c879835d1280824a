//! The compiled plan, and pass `emit` that builds it.
//!
//! # Execution semantics (what the CPU executor and the simulator implement)
//!
//! A [`Plan`] runs a collective whose user buffers are cut into `plan.layout.chunks` chunks (see
//! [`BufferLayout`]); every chunk is further cut into `M` equal **micro-batches** (`M` is chosen at launch;
//! micro-batch `m` of chunk `c` is elements `c*L + m*L/M ..` of the buffer when a chunk holds `L`
//! elements). A task with slice `in[a..b]` moves micro-batch `m` of chunks `a..b`.
//!
//! Every rank runs one thread block per [`TbPlan`] in [`RankPlan::tbs`]. A TB's task list is cut into
//! **segments**: maximal runs of consecutive tasks with the same [`TbTask::subpipeline`]
//! ([`TbPlan::segments`]). The TB runs
//!
//! ```text
//! for segment in tb.segments():
//!     for m in 0..M:
//!         for task in segment:
//!             for sp in tb.waits(task): wait until TB sp.tb of this rank has finished micro-batch m of its task sp.task
//!             run task.prim on micro-batch m
//!             if task.signal: publish "task finished micro-batch m" (a per-task or per-TB progress counter)
//! ```
//!
//! * [`Prim::Send`] pushes `src` (micro-batch `m`) into connection `conn`'s FIFO, waiting while the
//!   FIFO is full; [`Prim::Recv`] waits for the next message and stores it at `dst`;
//!   [`Prim::RecvReduceCopy`] reduces it into `dst` (`dst = dst ⊕ msg`; `src == dst` is the local
//!   operand); [`Prim::Copy`] copies `src` to `dst`; [`Prim::Reduce`] does `dst = dst ⊕ src`.
//! * A connection is a FIFO of slots from `conn.src` to `conn.dst` with step counters (NCCL's Simple
//!   protocol). Exactly one TB on each side uses a given connection, and both sides issue its messages
//!   in the same order (the verifier checks this), so the `k`-th receive takes the `k`-th send.
//! * Sync points ([`SyncPoint`]) are the only cross-TB waits within a rank; cross-rank order comes
//!   from the FIFOs alone. Sync points always name a task that comes earlier in the global order
//!   (same or earlier sub-pipeline, smaller [`TbTask::seq`]), which with FIFOs of at least
//!   [`PlanStats::fifo_slots_needed`] slots makes the plan deadlock-free: order all (task,
//!   micro-batch) pairs by (sub-pipeline, micro-batch, seq); every wait is on a smaller pair.
//! * A per-TB progress counter suffices for signalling: since a TB finishes its (segment,
//!   micro-batch, task) triples in order, "task `i` finished micro-batch `m`" is "the TB has finished
//!   at least `index(segment(i), m, i)` triples", with
//!   `index(s, m, i) = start(s)*M + m*len(s) + (i - start(s)) + 1`.
//!
//! With the algorithm-level scheduler every task has sub-pipeline 0, so every TB has one segment and
//! re-walks its whole list per micro-batch with per-step dependency flags: MSCCL's interpreted
//! execution structure (with the per-connection allocator, one TB per connection and stage).

use super::deps::Locations;
use super::memory;
use super::tballoc::{self, Connections, RankScratch, RankTask};
use super::verify::{self, PlanCheck};
use super::{CompileError, ConnId, FastMap, Graph, OpSource, Options, Prim, Schedule, Task, TbAlloc, TbId};
use crate::program::{BufferLayout, OpId, OpKind, Rank, Slice};
use serde::{Deserialize, Serialize};
use std::fmt::Write;

/// A compiled plan: per rank, per thread block, an ordered task list run for every micro-batch.
/// See the [module documentation](self) for the execution semantics.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Plan {
    /// The program's name.
    pub name: String,
    /// Collective, ranks, chunk counts and in-place aliasing of the user buffers.
    pub layout: BufferLayout,
    /// The scheduler the plan was compiled with.
    pub scheduler: super::Scheduler,
    /// The TB allocator the plan was compiled with.
    pub tb_alloc: TbAlloc,
    /// Ranks per node the plan was compiled for (`None`: one node).
    pub ranks_per_node: Option<u32>,
    /// Number of sub-pipelines (values of [`TbTask::subpipeline`] are below it).
    pub subpipelines: u32,
    /// The FIFO connections, indexed by [`ConnId`].
    pub connections: Vec<Connection>,
    /// One entry per rank, indexed by rank.
    pub ranks: Vec<RankPlan>,
    /// Counts and compile times ([`Plan::summary_json`] reports them).
    pub stats: PlanStats,
}

/// A FIFO connection (NCCL Simple-protocol semantics: a ring of slots in the receiver's workspace
/// with head and tail step counters).
#[derive(Copy, Clone, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
pub struct Connection {
    /// The sending rank.
    pub src: Rank,
    /// The receiving rank.
    pub dst: Rank,
    /// Distinguishes connections between the same two ranks: the program's channel (state-based
    /// allocation), or numbered densely from 0 per rank pair over (channel, stage) (per connection).
    pub channel: u32,
    /// `src` and `dst` are on different nodes.
    pub inter_node: bool,
}

/// `r0 -> r1 ch=0 intra`, as the dumps print a connection.
impl std::fmt::Display for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let link = if self.inter_node { "inter" } else { "intra" };
        write!(f, "{} -> {} ch={} {link}", self.src, self.dst, self.channel)
    }
}

/// The thread blocks of one rank.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct RankPlan {
    /// The rank these TBs run on; it is this entry's index in [`Plan::ranks`]
    /// ([`Plan::check_structure`] refuses a plan where it is not).
    pub rank: Rank,
    /// Indexed by [`TbId`].
    pub tbs: Vec<TbPlan>,
}

/// One thread block's program.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct TbPlan {
    /// Tasks in execution order: sorted by (`subpipeline`, `seq`).
    pub tasks: Vec<TbTask>,
    /// Sync points of all tasks, concatenated; task `i` owns
    /// `syncs[tasks[i].wait_start .. tasks[i].wait_start + tasks[i].wait_count]`.
    pub syncs: Vec<SyncPoint>,
}

/// Where a thread block is in its program: segment `seg`, micro-batch `mb`, task `pos`. A TB runs
/// each segment for every micro-batch before the next segment (see [`TbPlan::segments`]).
#[derive(Clone, Debug)]
pub struct TbCursor {
    /// The TB's segments ([`TbPlan::segments`]): index ranges into [`TbPlan::tasks`].
    pub segments: Vec<std::ops::Range<usize>>,
    /// Index into `segments` of the running segment; `segments.len()` once the TB has finished.
    pub seg: usize,
    /// The micro-batch the running segment is on, from 0 up to (excluding) the count given to
    /// [`TbCursor::advance`].
    pub mb: u32,
    /// Index into [`TbPlan::tasks`] of the next task to run, inside `segments[seg]` (0 once
    /// finished).
    pub pos: usize,
}

impl TbCursor {
    /// The start of `tb`'s program.
    pub fn new(tb: &TbPlan) -> Self {
        let segments = tb.segments();
        let pos = segments.first().map(|s| s.start).unwrap_or(0);
        TbCursor { segments, seg: 0, mb: 0, pos }
    }

    /// Whether every segment ran for every micro-batch.
    pub fn finished(&self) -> bool {
        self.seg >= self.segments.len()
    }

    /// Moves past the current task, with `mbs` micro-batches per segment (0 runs each segment once,
    /// as 1 does). Once [`TbCursor::finished`], nothing moves.
    pub fn advance(&mut self, mbs: u32) {
        let Some(seg) = self.segments.get(self.seg).cloned() else { return };
        self.pos += 1;
        if self.pos == seg.end {
            self.mb += 1;
            self.pos = seg.start;
            if self.mb >= mbs {
                self.mb = 0;
                self.seg += 1;
                self.pos = self.segments.get(self.seg).map(|s| s.start).unwrap_or(0);
            }
        }
    }
}

impl TbPlan {
    /// The sync points task `i` waits on.
    pub fn waits(&self, i: usize) -> &[SyncPoint] {
        let t = &self.tasks[i];
        &self.syncs[t.wait_start as usize..(t.wait_start + t.wait_count) as usize]
    }

    /// The segments: maximal index ranges of tasks with equal sub-pipeline, in order.
    pub fn segments(&self) -> Vec<std::ops::Range<usize>> {
        let mut v = Vec::new();
        let mut start = 0;
        for i in 1..=self.tasks.len() {
            if i == self.tasks.len() || self.tasks[i].subpipeline != self.tasks[start].subpipeline {
                if i > start {
                    v.push(start..i);
                }
                start = i;
            }
        }
        v
    }
}

/// One task of a TB program.
#[derive(Copy, Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct TbTask {
    /// The primitive.
    pub prim: Prim,
    /// The task's sub-pipeline; consecutive tasks with equal values form a segment.
    pub subpipeline: u32,
    /// The op's position in the global schedule order (a topological order).
    pub seq: u32,
    /// The other rank of a send or receive.
    pub peer: Option<Rank>,
    /// The FIFO of a send or receive.
    pub conn: Option<ConnId>,
    /// What the task reads: the data a send pushes; the local operand of a `recv_reduce_copy` (equal
    /// to `dst`); the source of a copy or reduce. `None` for a plain receive.
    pub src: Option<Slice>,
    /// What the task writes: the destination of a receive, copy or reduce. `None` for a send.
    pub dst: Option<Slice>,
    /// First sync point in [`TbPlan::syncs`].
    pub wait_start: u32,
    /// Number of sync points.
    pub wait_count: u32,
    /// Another TB of this rank waits on this task: publish progress after each micro-batch.
    pub signal: bool,
    /// The program op this task is half of (provenance).
    pub op: OpId,
}

/// "Wait until task `task` of thread block `tb` (same rank) has finished the current micro-batch."
#[derive(Copy, Clone, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
pub struct SyncPoint {
    /// The producer's TB, on the waiting task's rank.
    pub tb: TbId,
    /// Index into that TB's [`TbPlan::tasks`].
    pub task: u32,
}

/// Plan statistics.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct PlanStats {
    /// Number of ranks.
    pub ranks: u32,
    /// Thread blocks of each rank.
    pub tbs_per_rank: Vec<u32>,
    /// The largest entry of `tbs_per_rank` (0 without ranks).
    pub max_tbs_per_rank: u32,
    /// Program ops.
    pub ops: usize,
    /// Tasks (over all ranks).
    pub tasks: usize,
    /// Number of sub-pipelines, as [`Plan::subpipelines`].
    pub subpipelines: u32,
    /// Number of FIFO connections ([`Plan::connections`]).
    pub connections: usize,
    /// Sync points (over all TBs).
    pub sync_points: usize,
    /// FIFO slots that guarantee freedom from deadlock: the most messages one connection carries in
    /// one sub-pipeline per micro-batch.
    pub fifo_slots_needed: u32,
    /// Estimated idle share of TBs: the mean over TBs of the fraction of sub-pipelines in which the
    /// TB has no task (every sub-pipeline weighted alike).
    pub est_tb_idle_share: f64,
    /// Wall-clock time of all passes and verifiers, in milliseconds.
    pub compile_ms: f64,
    /// Wall-clock time of each pass with its verifier, in milliseconds.
    pub pass_ms: Vec<(String, f64)>,
}

impl Plan {
    /// The plan summary as JSON (`ranks`, `tbs_per_rank`, `max_tbs_per_rank`, `tasks`,
    /// `subpipelines`, `compile_ms`, ...).
    pub fn summary_json(&self) -> serde_json::Value {
        let s = &self.stats;
        serde_json::json!({
            "name": self.name,
            "collective": self.layout.collective.program_name(),
            "scheduler": self.scheduler.name(),
            "tb_alloc": self.tb_alloc.name(),
            "ranks": s.ranks,
            "chunks": self.layout.chunks,
            "tbs_per_rank": s.tbs_per_rank,
            "max_tbs_per_rank": s.max_tbs_per_rank,
            "ops": s.ops,
            "tasks": s.tasks,
            "subpipelines": s.subpipelines,
            "connections": s.connections,
            "sync_points": s.sync_points,
            "fifo_slots_needed": s.fifo_slots_needed,
            "est_tb_idle_share": s.est_tb_idle_share,
            "compile_ms": s.compile_ms,
            "pass_ms": s.pass_ms.iter().map(|(k, v)| serde_json::json!({ "pass": k, "ms": v })).collect::<Vec<_>>(),
        })
    }

    /// The stable text dump of the whole plan (golden tests). Compile time is left out.
    pub fn dump(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "plan {} scheduler={} tb-alloc={} ranks={} subpipelines={} tasks={}",
            self.name,
            self.scheduler.name(),
            self.tb_alloc.name(),
            self.layout.ranks,
            self.subpipelines,
            self.stats.tasks
        );
        for (i, c) in self.connections.iter().enumerate() {
            let _ = writeln!(s, "c{i} = {c}");
        }
        for rp in &self.ranks {
            let _ = writeln!(s, "{}:", rp.rank);
            for (t, tb) in rp.tbs.iter().enumerate() {
                let _ = writeln!(s, "  tb{t}:");
                for (i, task) in tb.tasks.iter().enumerate() {
                    let _ = write!(s, "    {i}: sp{} {}", task.subpipeline, task.prim.name());
                    match (task.prim, task.src, task.dst) {
                        (Prim::RecvReduceCopy, _, Some(d)) => {
                            let _ = write!(s, " {d}");
                        }
                        (_, Some(a), Some(b)) => {
                            let _ = write!(s, " {a} -> {b}");
                        }
                        (_, Some(a), None) => {
                            let _ = write!(s, " {a}");
                        }
                        (_, None, Some(b)) => {
                            let _ = write!(s, " -> {b}");
                        }
                        (_, None, None) => {}
                    }
                    match (task.prim, task.peer, task.conn) {
                        (Prim::Send, Some(p), Some(c)) => {
                            let _ = write!(s, " to {p} via {c}");
                        }
                        (_, Some(p), Some(c)) => {
                            let _ = write!(s, " from {p} via {c}");
                        }
                        _ => {}
                    }
                    let waits: Vec<String> = tb.waits(i).iter().map(|w| format!("{}.{}", w.tb, w.task)).collect();
                    if !waits.is_empty() {
                        let _ = write!(s, " wait {}", waits.join(" "));
                    }
                    if task.signal {
                        s.push_str(" signal");
                    }
                    let _ = writeln!(s, " ({})", task.op);
                }
            }
        }
        s
    }

    /// Checks what the executors rely on, for plans that did not come from [`super::compile`] (built
    /// by hand or deserialized): every TB's tasks have the operands their primitive needs, slices fit
    /// the layout, connections join ranks of the plan, sync points exist, tasks join the right ranks,
    /// and a receive takes as many chunks as the send of its op on its connection pushes. Every
    /// task's sub-pipeline is below [`Plan::subpipelines`], which is at most the task count (at most 1
    /// without tasks: the compiler never makes an empty sub-pipeline, and executors size tables by
    /// it), and a `recv_reduce_copy` reduces into its local operand (`src == dst`).
    pub fn check_structure(&self) -> Result<(), String> {
        let l = &self.layout;
        l.validate().map_err(|e| e.to_string())?;
        if self.ranks.len() != l.ranks as usize {
            return Err(format!("{} rank plans for {} ranks", self.ranks.len(), l.ranks));
        }
        for (i, c) in self.connections.iter().enumerate() {
            if c.src.0 >= l.ranks || c.dst.0 >= l.ranks {
                let c_id = ConnId::new(i);
                return Err(format!("{c_id}: {} -> {} names a rank outside the {} ranks", c.src, c.dst, l.ranks));
            }
        }
        // Chunks each (connection, op) sends, for the receives' size check below.
        let mut sent: super::FastMap<(ConnId, OpId), u32> = Default::default();
        let mut tasks = 0u64;
        for (r, rp) in self.ranks.iter().enumerate() {
            let rank = Rank(r as u32);
            if rp.rank != rank {
                return Err(format!("the rank plan at index {r} says it is {}", rp.rank));
            }
            for (t, tb) in rp.tbs.iter().enumerate() {
                for (i, task) in tb.tasks.iter().enumerate() {
                    let here = || format!("{rank} tb{t} task {i}");
                    tasks += 1;
                    if task.subpipeline >= self.subpipelines {
                        return Err(format!(
                            "{}: sub-pipeline {} is not below the plan's {} sub-pipelines",
                            here(),
                            task.subpipeline,
                            self.subpipelines
                        ));
                    }
                    let (need_src, need_dst) = match task.prim {
                        Prim::Send => (true, false),
                        Prim::Recv => (false, true),
                        Prim::RecvReduceCopy | Prim::Copy | Prim::Reduce => (true, true),
                    };
                    for (need, slice) in [(need_src, task.src), (need_dst, task.dst)] {
                        match slice {
                            Some(s) if l.resolve(rank, s).is_none() => {
                                return Err(format!("{}: {s} out of range", here()));
                            }
                            None if need => return Err(format!("{}: missing operand", here())),
                            _ => {}
                        }
                    }
                    if let (Some(a), Some(b)) = (task.src, task.dst)
                        && a.count != b.count
                    {
                        return Err(format!("{}: operands differ in size", here()));
                    }
                    // Both executors read the local operand of a `recv_reduce_copy` at its
                    // destination; the lowering reads it at `src`. They agree only when the two are one.
                    if let (Prim::RecvReduceCopy, Some(a), Some(b)) = (task.prim, task.src, task.dst)
                        && a != b
                    {
                        return Err(format!(
                            "{}: recv_reduce_copy reads {a} but reduces into {b}: its local operand is its \
                             destination (src == dst)",
                            here()
                        ));
                    }
                    if task.prim.is_comm() {
                        let c = task
                            .conn
                            .and_then(|c| self.connections.get(c.index()))
                            .ok_or_else(|| format!("{}: no valid connection", here()))?;
                        let (me, peer) = if task.prim == Prim::Send { (c.src, c.dst) } else { (c.dst, c.src) };
                        if me != rank || task.peer != Some(peer) {
                            return Err(format!("{}: connection does not join the rank and its peer", here()));
                        }
                        if let (Prim::Send, Some(conn), Some(s)) = (task.prim, task.conn, task.src) {
                            sent.insert((conn, task.op), s.count);
                        }
                    }
                    let end = task.wait_start as usize + task.wait_count as usize;
                    if end > tb.syncs.len() {
                        return Err(format!("{}: sync points out of range", here()));
                    }
                    for w in tb.waits(i) {
                        if rp.tbs.get(w.tb.index()).is_none_or(|x| w.task as usize >= x.tasks.len()) {
                            return Err(format!("{}: sync point {}.{} does not exist", here(), w.tb, w.task));
                        }
                    }
                }
            }
        }
        if self.subpipelines as u64 > tasks.max(1) {
            return Err(format!(
                "{} sub-pipelines for {tasks} tasks: an empty sub-pipeline is not a plan's",
                self.subpipelines
            ));
        }
        // Every sync point, waited on or not: the lowering marks each one's task as signalling.
        for (r, rp) in self.ranks.iter().enumerate() {
            for (t, tb) in rp.tbs.iter().enumerate() {
                if let Some(w) =
                    tb.syncs.iter().find(|w| rp.tbs.get(w.tb.index()).is_none_or(|x| w.task as usize >= x.tasks.len()))
                {
                    return Err(format!("rank {r} tb {t}: sync point {}.{} does not exist", w.tb, w.task));
                }
            }
        }
        // Every send is recorded above, so each receive can be matched in a second walk. A receive
        // whose op sends nothing on its connection is left to the executors (it never completes).
        for (r, rp) in self.ranks.iter().enumerate() {
            for (t, tb) in rp.tbs.iter().enumerate() {
                for (i, task) in tb.tasks.iter().enumerate() {
                    if !matches!(task.prim, Prim::Recv | Prim::RecvReduceCopy) {
                        continue;
                    }
                    let (Some(conn), Some(d)) = (task.conn, task.dst) else { continue };
                    if let Some(&n) = sent.get(&(conn, task.op))
                        && n != d.count
                    {
                        return Err(format!(
                            "r{r} tb{t} task {i}: receives {} chunks of {} on {conn}, the send pushes {n}",
                            d.count, task.op
                        ));
                    }
                }
            }
        }
        Ok(())
    }

    /// Total thread blocks over all ranks.
    pub fn total_tbs(&self) -> usize {
        self.ranks.iter().map(|r| r.tbs.len()).sum()
    }
}

/// Bytes [`emit`] needs at its peak beside the schedule and [`links_by_position`], for `tasks`
/// tasks over `ranks` ranks and `links` links with `threads` workers: the batches of ranks' tasks,
/// each worker's rank in the making and its scratch (`rank_tasks` tasks, about 250 bytes each), the
/// rank plans waiting to be handed over, and per-rank and per-link tables.
pub fn estimate_bytes(tasks: u64, ranks: u64, rank_tasks: u64, links: u64, threads: u64) -> u64 {
    let batches = (tasks * std::mem::size_of::<Placed>() as u64).min(BATCH_BYTES as u64).max(rank_tasks * 12 * threads);
    let waiting = threads * (QUEUED_CHUNKS as u64 + 2) * CHUNK_RANKS as u64 * rank_tasks * 100;
    batches + threads * (rank_tasks * 250 + ranks * 8 + links * 4) + waiting + ranks * 48 + links * 8
}

/// Bytes of the batches of ranks' tasks [`emit`]'s workers copy out of the order at a time, all
/// workers together: 1.5 GiB, so that each of two workers scans the order of the 8192-GPU
/// programs twice.
const BATCH_BYTES: usize = 3 << 29;

/// Ranks a worker builds and hands over together.
const CHUNK_RANKS: usize = 4;

/// Chunks of built ranks a worker may have waiting for the consumer.
const QUEUED_CHUNKS: usize = 2;

/// A task of a batch of ranks: its op's position in the order, the op and its link.
#[derive(Copy, Clone)]
struct Placed {
    pos: u32,
    op: OpId,
    link: u32,
}

/// The link of each op in schedule order (`order[pos]`'s link at `pos`), so that a rank's tasks
/// read it at their positions, as they read their ops; gathered by up to `threads` threads, each
/// a range of positions.
pub fn links_by_position(g: &Graph, sched: &Schedule, threads: usize) -> Result<Vec<u32>, memory::TooLarge> {
    let n = sched.order.len();
    let mut v = memory::try_filled(n, 0u32, "the link of each op in schedule order")?;
    let t = threads.clamp(1, 8).min(n.div_ceil(1 << 16).max(1));
    let gather = |ops: &[OpId], links: &mut [u32]| {
        for (l, op) in links.iter_mut().zip(ops) {
            *l = g.link_of_op[op.index()];
        }
    };
    std::thread::scope(|scope| {
        let per = n.div_ceil(t).max(1);
        let mut parts = sched.order.chunks(per).zip(v.chunks_mut(per));
        let first = parts.next();
        for (ops, links) in parts {
            scope.spawn(move || gather(ops, links));
        }
        if let Some((ops, links)) = first {
            gather(ops, links);
        }
    });
    Ok(v)
}

/// What the rank plans are built from, shared by the workers.
struct Shared<'a, S> {
    src: &'a S,
    layout: &'a BufferLayout,
    /// Each link's ranks: `(src, dst)`, `dst` being `u32::MAX` for a local lane.
    link_ranks: Vec<(u32, u32)>,
    links: &'a [super::Link],
    link_by_pos: &'a [u32],
    sched: &'a Schedule,
    conns: &'a Connections,
    /// With the verifiers on: per rank, what its tasks in the program add up to
    /// ([`PlanCheck::expected`]).
    expected: Option<Vec<(u64, u64)>>,
    /// `rank_start[r]..rank_start[r + 1]`: rank `r`'s tasks, counted over all ranks.
    rank_start: Vec<usize>,
}

/// One rank's plan and what the statistics and the plan-wide checks need from it.
struct Built {
    plan: RankPlan,
    tbs: u32,
    /// Segments of each TB.
    segments: Vec<u32>,
    sync_points: usize,
    fifo_slots: u32,
    alloc: std::time::Duration,
    /// With the verifiers on, what the rank adds to the plan-wide checks ([`verify::rank_plan`]).
    sums: Option<verify::RankSums>,
}

/// A worker's scratch space, kept from rank to rank.
struct Scratch {
    batch: Vec<Placed>,
    /// Per rank: where its next task goes in `batch`, `usize::MAX` when it is not in the batch.
    fill: Vec<usize>,
    /// The rank's tasks, and each one's link and position in the order.
    tasks: Vec<RankTask>,
    at: Vec<(u32, u32)>,
    /// A rank's endpoints: by link under state-based allocation (a link is one endpoint of the
    /// rank), by (link, stage) per connection.
    slot: Vec<u32>,
    slot_stage: FastMap<(u32, u32), u32>,
    named: Vec<u32>,
    alloc: RankScratch,
    locs: Locations,
    found: Vec<u32>,
    place: Vec<(u32, u32)>,
    waits: Vec<(u32, u32)>,
    /// This rank's sends per endpoint (a send endpoint is one connection's send side): (sub-pipeline,
    /// messages in it so far).
    fifo: Vec<(u32, u32)>,
}

impl<S: OpSource> Shared<'_, S> {
    fn scratch(&self) -> Result<Scratch, CompileError> {
        let state = self.conns.policy == TbAlloc::State;
        Ok(Scratch {
            batch: Vec::new(),
            fill: vec![usize::MAX; self.layout.ranks as usize],
            tasks: Vec::new(),
            at: Vec::new(),
            slot: vec![u32::MAX; if state { self.links.len() } else { 0 }],
            slot_stage: Default::default(),
            named: Vec::new(),
            alloc: RankScratch::default(),
            locs: Locations::one_rank(0)?,
            found: Vec::new(),
            place: Vec::new(),
            waits: Vec::new(),
            fifo: Vec::new(),
        })
    }

    /// Builds the ranks of chunks `w, w + workers, ...` (chunks of [`CHUNK_RANKS`] ranks), a batch
    /// of them at a time (one scan of the order each), and hands each chunk's ranks to `deliver`
    /// in order; stops when `deliver` says so or at the first error (which it is handed).
    fn work(
        &self,
        w: usize,
        workers: usize,
        budget: usize,
        deliver: &mut dyn FnMut(usize, Result<Vec<Built>, CompileError>) -> bool,
    ) {
        let mut scratch = match self.scratch() {
            Ok(s) => s,
            Err(e) => {
                deliver(w, Err(e));
                return;
            }
        };
        let nranks = self.layout.ranks as usize;
        let nchunks = nranks.div_ceil(CHUNK_RANKS);
        let ranks_of = |c: usize| c * CHUNK_RANKS..((c + 1) * CHUNK_RANKS).min(nranks);
        let tasks_of = |c: usize| self.rank_start[ranks_of(c).end] - self.rank_start[ranks_of(c).start];
        let mine: Vec<usize> = (w..nchunks).step_by(workers).collect();
        let mut i = 0;
        while i < mine.len() {
            // The next batch: as many of this worker's chunks as fit the budget (at least one).
            let mut j = i + 1;
            let mut total = tasks_of(mine[i]);
            while j < mine.len() && total + tasks_of(mine[j]) <= budget {
                total += tasks_of(mine[j]);
                j += 1;
            }
            if let Err(e) = self.fill_batch(&mut scratch, &mine[i..j], &ranks_of, total) {
                deliver(mine[i], Err(e));
                return;
            }
            let mut at = 0;
            for &c in &mine[i..j] {
                let mut built = Vec::with_capacity(CHUNK_RANKS);
                let mut failed = None;
                for r in ranks_of(c) {
                    let n = self.rank_start[r + 1] - self.rank_start[r];
                    match self.rank(&mut scratch, Rank(r as u32), at..at + n) {
                        Ok(b) => built.push(b),
                        Err(e) => {
                            failed = Some(e);
                            break;
                        }
                    }
                    at += n;
                }
                let failed_now = failed.is_some();
                if !deliver(c, failed.map_or(Ok(built), Err)) || failed_now {
                    return;
                }
            }
            i = j;
        }
    }

    /// Copies the tasks of `chunks`' ranks (`total` of them) out of the order into the batch,
    /// each rank's in schedule order.
    fn fill_batch(
        &self,
        s: &mut Scratch,
        chunks: &[usize],
        ranks_of: &dyn Fn(usize) -> std::ops::Range<usize>,
        total: usize,
    ) -> Result<(), CompileError> {
        s.batch.clear();
        s.batch.try_reserve_exact(total).map_err(|_| memory::TooLarge {
            request: "a batch of ranks' tasks".into(),
            needed: (total * std::mem::size_of::<Placed>()) as u64,
            limit: None,
        })?;
        s.batch.resize(total, Placed { pos: 0, op: OpId(0), link: 0 });
        let mut at = 0;
        for &c in chunks {
            for r in ranks_of(c) {
                s.fill[r] = at;
                at += self.rank_start[r + 1] - self.rank_start[r];
            }
        }
        let fill = &mut s.fill;
        let batch = &mut s.batch;
        for (pos, (&l, &op)) in self.link_by_pos.iter().zip(&self.sched.order).enumerate() {
            let (a, b) = self.link_ranks[l as usize];
            for r in [a, b] {
                if let Some(f) = fill.get_mut(r as usize)
                    && *f != usize::MAX
                {
                    batch[*f] = Placed { pos: pos as u32, op, link: l };
                    *f += 1;
                }
            }
        }
        for &c in chunks {
            for r in ranks_of(c) {
                fill[r] = usize::MAX;
            }
        }
        Ok(())
    }

    /// Builds `rank`'s plan from its tasks, `s.batch[tasks]`.
    fn rank(&self, s: &mut Scratch, rank: Rank, tasks: std::ops::Range<usize>) -> Result<Built, CompileError> {
        let (sched, links, policy) = (self.sched, self.links, self.conns.policy);
        let placed = &s.batch[tasks];
        s.at.clear();
        s.at.extend(placed.iter().map(|p| (p.link, p.pos)));
        s.tasks.clear();
        let mut k = 0usize;
        for (p, &(link, seq)) in placed.iter().zip(&s.at) {
            let op = self.src.op(p.op);
            let side = usize::from(!links[link as usize].local && links[link as usize].src != rank);
            while sched.sp_start[k + 1] <= seq {
                k += 1;
            }
            let next = s.named.len() as u32;
            let e = if policy == TbAlloc::State {
                &mut s.slot[link as usize]
            } else {
                s.slot_stage.entry((link, op.stage)).or_insert(next)
            };
            if *e == u32::MAX || *e == next {
                *e = next;
                s.named.push(link);
            }
            let endpoint = *e;
            s.tasks.push(RankTask { id: p.op, op, side, conn: self.conns.of(link, op.stage), sp: k as u32, endpoint });
        }
        for &l in &s.named {
            if let Some(e) = s.slot.get_mut(l as usize) {
                *e = u32::MAX;
            }
        }
        s.named.clear();
        s.slot_stage.clear();
        let started = std::time::Instant::now();
        let alloc = tballoc::allocate_rank(rank, &s.tasks, policy, &mut s.alloc);
        if self.expected.is_some() {
            verify::rank_alloc(rank, &s.tasks, &alloc, &self.conns.list, policy)?;
        }
        let alloc_time = started.elapsed();
        // Each task's TB and index in it (tasks are pushed in schedule order), and the TB sizes.
        let mut sizes = vec![0u32; alloc.tbs as usize];
        s.place.clear();
        s.place.extend(alloc.endpoint_of.iter().map(|&e| {
            let tb = alloc.endpoints[e as usize].tb.0;
            sizes[tb as usize] += 1;
            (tb, sizes[tb as usize] - 1)
        }));
        let mut tbs: Vec<TbPlan> =
            sizes.iter().map(|&n| TbPlan { tasks: Vec::with_capacity(n as usize), syncs: Vec::new() }).collect();
        let mut fifo_slots = 0u32;
        s.fifo.clear();
        s.fifo.resize(alloc.endpoints.len(), (u32::MAX, 0));
        for ((t, &(tb, _)), &(_, seq)) in s.tasks.iter().zip(&s.place).zip(&s.at) {
            let prim = Task::prim_of(&t.op, t.side);
            let (peer, src, dst) = match (prim, t.op.kind) {
                (Prim::Send, OpKind::Transfer { dst_rank, src, .. }) => (Some(dst_rank), Some(src), None),
                (Prim::Recv, OpKind::Transfer { src_rank, dst, .. }) => (Some(src_rank), None, Some(dst)),
                (Prim::RecvReduceCopy, OpKind::Transfer { src_rank, dst, .. }) => {
                    (Some(src_rank), Some(dst), Some(dst))
                }
                (_, OpKind::Copy { src, dst, .. } | OpKind::Reduce { src, dst, .. }) => (None, Some(src), Some(dst)),
                (_, OpKind::Transfer { .. }) => unreachable!("transfer tasks are comm tasks"),
            };
            tbs[tb as usize].tasks.push(TbTask {
                prim,
                subpipeline: t.sp,
                seq,
                peer,
                conn: t.conn,
                src,
                dst,
                wait_start: 0,
                wait_count: 0,
                signal: false,
                op: t.id,
            });
            if let (Prim::Send, Some(_)) = (prim, t.conn) {
                // A connection's sends are all on this rank, in schedule order here.
                let e = &mut s.fifo[t.endpoint as usize];
                if e.0 != t.sp {
                    *e = (t.sp, 0);
                }
                e.1 += 1;
                fifo_slots = fifo_slots.max(e.1);
            }
        }
        // Sync points: for each cross-TB dependency (always on this rank, on a task earlier in the
        // schedule) keep the latest task per producer TB; mark the producers as signalling. The
        // dependencies come from a walk over the rank's storage in schedule order, a topological
        // order, which finds the same producers as the program-order walk of `deps`.
        s.locs.reset_one_rank(self.layout.storage_chunks(rank));
        let mut sync_points = 0;
        for (i, t) in s.tasks.iter().enumerate() {
            s.locs.task(self.layout, &t.op, t.side, Rank(0), i as u32, &mut s.found)?;
            let (tb, index) = s.place[i];
            s.waits.clear();
            for &p in &s.found {
                let (ptb, pidx) = s.place[p as usize];
                if p as usize != i && ptb != tb {
                    s.waits.push((ptb, pidx));
                }
            }
            s.found.clear();
            if s.waits.is_empty() {
                continue;
            }
            s.waits.sort_unstable_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)));
            s.waits.dedup_by_key(|w| w.0);
            let tbp = &mut tbs[tb as usize];
            let i = index as usize;
            tbp.tasks[i].wait_start = tbp.syncs.len() as u32;
            tbp.tasks[i].wait_count = s.waits.len() as u32;
            tbp.syncs.extend(s.waits.iter().map(|&(ptb, pidx)| SyncPoint { tb: TbId(ptb), task: pidx }));
            for &(ptb, pidx) in &s.waits {
                tbs[ptb as usize].tasks[pidx as usize].signal = true;
            }
            sync_points += s.waits.len();
        }
        let plan = RankPlan { rank, tbs };
        let sums = match &self.expected {
            Some(e) => Some(verify::rank_plan(&plan, &self.conns.list, e[rank.index()])?),
            None => None,
        };
        let segments = plan
            .tbs
            .iter()
            .map(|tb| {
                (tb.tasks.windows(2).filter(|w| w[0].subpipeline != w[1].subpipeline).count()
                    + usize::from(!tb.tasks.is_empty())) as u32
            })
            .collect();
        Ok(Built { plan, tbs: alloc.tbs, segments, sync_points, fifo_slots, alloc: alloc_time, sums })
    }
}

/// The worker threads [`emit`] uses: [`Options::threads`], else the machine's parallelism (at most
/// 8), at least one.
pub fn threads(opts: &Options) -> usize {
    opts.threads.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get().min(8))).max(1)
}

/// Runs pass `emit` with the per-rank half of `tb-alloc`: builds the rank plans and hands each to
/// `each`, in rank order (which may check it, keep it or drop it; an error stops the pass).
/// Returns the plan without its rank plans (`ranks` is empty), with the statistics, and the
/// share of its wall time spent in [`tballoc::allocate_rank`] (the `tb-alloc` pass's per-rank
/// half), in milliseconds.
///
/// Ranks are built by [`threads`] workers, in chunks of a few ranks handed over in order, so the
/// plan is the same whatever the thread count. Beside the schedule and `link_by_pos`
/// ([`links_by_position`]), the workers keep batches of their ranks' tasks, copied out of the order
/// by a scan each, and one rank in the making each: its tasks are gathered, allocated to TBs,
/// given their dependencies (a walk over the rank's storage in schedule order, see
/// [`super::deps`]) and emitted.
#[allow(clippy::too_many_arguments)]
pub fn emit<S: OpSource>(
    src: &S,
    g: &Graph,
    link_by_pos: &[u32],
    sched: &Schedule,
    conns: &Connections,
    opts: &Options,
    mut check: Option<&mut PlanCheck<'_>>,
    each: &mut dyn FnMut(RankPlan) -> Result<(), CompileError>,
) -> Result<(Plan, f64), CompileError> {
    let started = std::time::Instant::now();
    let layout = src.layout();
    let nranks = layout.ranks as usize;
    let links = &g.links.links;
    let link_ranks: Vec<(u32, u32)> =
        links.iter().map(|l| (l.src.0, if l.local { u32::MAX } else { l.dst.0 })).collect();
    let mut rank_start = vec![0usize; nranks + 1];
    for &l in link_by_pos {
        let (a, b) = link_ranks[l as usize];
        rank_start[a as usize + 1] += 1;
        if b != u32::MAX {
            rank_start[b as usize + 1] += 1;
        }
    }
    for r in 0..nranks {
        rank_start[r + 1] += rank_start[r];
    }
    let shared = Shared {
        src,
        layout,
        link_ranks,
        links,
        link_by_pos,
        sched,
        conns,
        expected: check.as_deref().map(|c| (0..nranks as u32).map(|r| c.expected(Rank(r))).collect()),
        rank_start,
    };
    let nchunks = nranks.div_ceil(CHUNK_RANKS);
    let workers = threads(opts).min(nchunks.max(1));
    let budget = BATCH_BYTES / std::mem::size_of::<Placed>() / workers;

    let mut fifo_slots_needed = 0u32;
    let mut sync_points = 0usize;
    let (mut idle_sum, mut ntbs) = (0.0, 0usize);
    let mut tbs_per_rank = Vec::with_capacity(nranks);
    let mut alloc_time = std::time::Duration::ZERO;
    let spn = sched.count().max(1) as f64;
    // The consumer: checks and hands over each rank in order, and sums the statistics in that
    // order (so they do not depend on the thread count).
    let mut take = |built: Vec<Built>| -> Result<(), CompileError> {
        for b in built {
            if let (Some(c), Some(sums)) = (check.as_deref_mut(), b.sums) {
                c.merge(sums);
            }
            for &segments in &b.segments {
                idle_sum += 1.0 - segments as f64 / spn;
                ntbs += 1;
            }
            sync_points += b.sync_points;
            fifo_slots_needed = fifo_slots_needed.max(b.fifo_slots);
            tbs_per_rank.push(b.tbs);
            alloc_time += b.alloc;
            each(b.plan)?;
        }
        Ok(())
    };
    if workers <= 1 {
        let mut result = Ok(());
        shared.work(0, 1, budget, &mut |_, built| {
            result = built.and_then(&mut take);
            result.is_ok()
        });
        result?;
    } else {
        std::thread::scope(|scope| -> Result<(), CompileError> {
            let mut queues = Vec::with_capacity(workers);
            for w in 0..workers {
                let (tx, rx) = std::sync::mpsc::sync_channel(QUEUED_CHUNKS);
                queues.push(rx);
                let shared = &shared;
                scope.spawn(move || shared.work(w, workers, budget, &mut |c, built| tx.send((c, built)).is_ok()));
            }
            // Chunk `c` comes from worker `c % workers`, each worker's in order. Returning drops
            // the queues, which stops the workers.
            for c in 0..nchunks {
                let (from, built) = queues[c % workers].recv().map_err(|_| CompileError::Verify {
                    pass: "emit",
                    message: format!("a worker stopped before chunk {c}"),
                })?;
                debug_assert_eq!(from, c);
                take(built?)?;
            }
            Ok(())
        })?;
    }
    let stats = PlanStats {
        ranks: nranks as u32,
        max_tbs_per_rank: tbs_per_rank.iter().copied().max().unwrap_or(0),
        tbs_per_rank,
        ops: src.op_count(),
        tasks: g.task_count(),
        subpipelines: sched.count(),
        connections: conns.list.len(),
        sync_points,
        fifo_slots_needed,
        est_tb_idle_share: if ntbs > 0 { idle_sum / ntbs as f64 } else { 0.0 },
        compile_ms: 0.0,
        pass_ms: Vec::new(),
    };
    let plan = Plan {
        name: src.name().to_string(),
        layout: layout.clone(),
        scheduler: sched.scheduler,
        tb_alloc: opts.tb_alloc,
        ranks_per_node: g.ranks_per_node,
        subpipelines: sched.count(),
        connections: conns.list.clone(),
        ranks: Vec::new(),
        stats,
    };
    // The allocation's share of the wall time: its time summed over the workers, spread over them.
    let alloc_ms = (alloc_time.as_secs_f64() * 1e3 / workers as f64).min(started.elapsed().as_secs_f64() * 1e3);
    Ok((plan, alloc_ms))
}
