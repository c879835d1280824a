//! Pass `schedule`: sub-pipelines and a global order of ops.
//!
//! A schedule gives every op a sub-pipeline and a position in one global order. The order is
//! sorted by sub-pipeline and is a topological order of the dependency graph; inside a thread block
//! tasks run in this order, looping over micro-batches per sub-pipeline (see [`super::Plan`]).
//!
//! * **HPDS** (ResCCL): a sub-pipeline takes every op with no pending dependency (its producers are
//!   in an earlier sub-pipeline *or in this one*, so dependent ops pipeline over micro-batches) and no
//!   link conflict (one op per link per sub-pipeline), giving contended links to the least-used chunk
//!   first (chunks in a priority queue by the number of their ops already scheduled); an intra-node op
//!   never joins the sub-pipeline of an inter-node op it depends on (the slow link would throttle it).
//!   When nothing else fits, the sub-pipeline closes. Ready ops queue per link, keyed by (uses of their
//!   chunk when they became ready, chunk, op), so a sub-pipeline costs time in the links it fills, not
//!   in the ops that wait: this keeps 8192-GPU programs tractable.
//! * **Round-robin**: chunks in a fixed rotation; each sub-pipeline takes at most one op per chunk,
//!   only ops whose producers are in earlier sub-pipelines, one per link.
//! * **Algorithm level**: one sub-pipeline with every op in program order (MSCCL: every TB walks its
//!   whole list per micro-batch, one micro-batch after another).
//! * **Stage level**: a sub-pipeline per stage, in dependency order: an op joins the latest
//!   sub-pipeline of its producers, or the next one when a producer belongs to another stage.
//!
//! Chunks are numbered densely in the order ops first name them (program order), which is what
//! the priority queues compare after the use counts ([`Graph::chunk_of_op`]). Beside the graph
//! the schedulers keep per op the order they build and a producer count.

use super::memory::{self, TooLarge};
use super::{CompileError, FastMap, Graph, OpSource, Scheduler};
use crate::program::OpId;
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::fmt::Write;

/// The result of the pass.
#[derive(Clone, Debug)]
pub struct Schedule {
    /// The scheduler that produced it.
    pub scheduler: Scheduler,
    /// Every op, sorted by sub-pipeline; a topological order. An op's position in it is its
    /// [`TbTask::seq`](super::TbTask::seq).
    pub order: Vec<OpId>,
    /// Sub-pipeline `k` is `order[sp_start[k]..sp_start[k + 1]]`: one entry per sub-pipeline plus
    /// the op count, non-decreasing.
    pub sp_start: Vec<u32>,
}

impl Schedule {
    /// Number of sub-pipelines.
    pub fn count(&self) -> u32 {
        self.sp_start.len().saturating_sub(1) as u32
    }

    /// The sub-pipeline of the op at position `pos` of the order.
    pub fn subpipeline_at(&self, pos: usize) -> u32 {
        (self.sp_start.partition_point(|&s| s as usize <= pos) - 1) as u32
    }

    /// The position of each op in the order (the inverse permutation), for checks and tests.
    pub fn positions(&self) -> Vec<u32> {
        let mut p = vec![0u32; self.order.len()];
        for (i, op) in self.order.iter().enumerate() {
            p[op.index()] = i as u32;
        }
        p
    }

    /// The sub-pipeline of each op, for checks and tests.
    pub fn subpipelines(&self) -> Vec<u32> {
        let mut v = vec![0u32; self.order.len()];
        for k in 0..self.count() as usize {
            for op in &self.order[self.sp_start[k] as usize..self.sp_start[k + 1] as usize] {
                v[op.index()] = k as u32;
            }
        }
        v
    }

    /// The text dump: one line per sub-pipeline with its ops in order.
    pub fn dump(&self) -> String {
        let mut s = String::new();
        for k in 0..self.count() as usize {
            let _ = write!(s, "sp{k}:");
            for op in &self.order[self.sp_start[k] as usize..self.sp_start[k + 1] as usize] {
                let _ = write!(s, " {op}");
            }
            s.push('\n');
        }
        s
    }

    /// A schedule from each op's sub-pipeline, ops of one sub-pipeline in program order (a counting
    /// sort, stable).
    fn from_subpipelines(scheduler: Scheduler, sp_of: &[u32]) -> Result<Schedule, TooLarge> {
        let count = sp_of.iter().map(|&s| s as usize + 1).max().unwrap_or(0);
        let mut sp_start = memory::try_filled(count + 1, 0u32, "the schedule's sub-pipelines")?;
        for &s in sp_of {
            sp_start[s as usize + 1] += 1;
        }
        for k in 0..count {
            sp_start[k + 1] += sp_start[k];
        }
        let mut fill = sp_start.clone();
        let mut order = memory::try_filled(sp_of.len(), OpId(0), "the schedule's order")?;
        for (i, &s) in sp_of.iter().enumerate() {
            order[fill[s as usize] as usize] = OpId::new(i);
            fill[s as usize] += 1;
        }
        Ok(Schedule { scheduler, order, sp_start })
    }
}

/// Bytes [`run`] needs at its peak beside the graph, for `ops` ops on `links` links: the order, a
/// producer count and a bit per op, each link's queue state, and queues beyond two ops (taken to
/// hold a twelfth of the ops at once; they grow fallibly beyond).
pub fn estimate_bytes(ops: u64, links: u64) -> u64 {
    ops * 4 + ops + ops / 8 + links * 40 + ops
}

/// Runs the pass with `scheduler`.
pub fn run(src: &impl OpSource, graph: &Graph, scheduler: Scheduler) -> Result<Schedule, CompileError> {
    Ok(match scheduler {
        Scheduler::Hpds => hpds(src, graph)?,
        Scheduler::RoundRobin => round_robin(src, graph)?,
        Scheduler::Algorithm => {
            let n = src.op_count();
            let mut order = memory::try_vec(n, "the schedule's order")?;
            order.extend((0..n).map(OpId::new));
            let sp_start = if n == 0 { vec![0] } else { vec![0, n as u32] };
            Schedule { scheduler, order, sp_start }
        }
        Scheduler::Stage => stage(src, graph)?,
    })
}

/// Producer counts counted down as producers are scheduled.
///
/// A byte per op: the count in its low seven bits (127: in `overflow`), and in its high bit a
/// mark HPDS sets on the successors of an inter-node op while a sub-pipeline is built (both are
/// read for the same op, so one cache line serves both).
struct Pending {
    counts: Vec<u8>,
    overflow: FastMap<u32, u32>,
}

const COUNT: u8 = 0x7f;
const MARK: u8 = 0x80;

impl Pending {
    fn new(g: &Graph) -> Result<Pending, TooLarge> {
        let (mut counts, mut overflow) = g.pending()?;
        for (op, c) in counts.iter_mut().enumerate() {
            if *c >= COUNT {
                overflow.entry(op as u32).or_insert(*c as u32);
                *c = COUNT;
            }
        }
        Ok(Pending { counts, overflow })
    }

    /// One producer of `op` was scheduled: whether that was the last.
    #[inline]
    fn done_one(&mut self, op: usize) -> bool {
        let b = &mut self.counts[op];
        if *b & COUNT == COUNT {
            let c = self.overflow.get_mut(&(op as u32)).expect("an overflowed count");
            *c -= 1;
            return *c == 0;
        }
        *b -= 1;
        *b & COUNT == 0
    }

    /// Marks `op`; whether it was unmarked.
    #[inline]
    fn mark(&mut self, op: usize) -> bool {
        let b = &mut self.counts[op];
        let fresh = *b & MARK == 0;
        *b |= MARK;
        fresh
    }

    #[inline]
    fn marked(&self, op: usize) -> bool {
        self.counts[op] & MARK != 0
    }

    #[inline]
    fn unmark(&mut self, op: usize) {
        self.counts[op] &= COUNT;
    }
}

const NONE: u32 = u32::MAX;

/// A ready op in HPDS's queue of its link: (uses of its chunk when it became ready, chunk, op).
type Entry = (u32, u32, u32);

/// One link's state in HPDS: its queue of ready ops (least first; two held in place, a heap
/// beyond), the last sub-pipeline it served, whether it is listed as active, whether it crosses
/// nodes. Queues rarely hold more than two ops, so this keeps a link's state in one cache line.
#[derive(Clone)]
struct LinkState {
    near: [Entry; 2],
    len: u8,
    listed: bool,
    inter: bool,
    /// Index into the spilled heaps, or `NONE` while the queue fits `near`.
    spill: u32,
    sp: u32,
}

/// A queue's allocation failed.
fn queue_full() -> TooLarge {
    TooLarge { request: "HPDS's queue of ready ops on a link".into(), needed: 0, limit: None }
}

/// The links' queues.
struct Queues {
    links: Vec<LinkState>,
    spilled: Vec<BinaryHeap<Reverse<Entry>>>,
    free: Vec<u32>,
}

impl Queues {
    fn new(g: &Graph) -> Queues {
        let links = g
            .links
            .links
            .iter()
            .map(|l| LinkState {
                near: [(0, 0, 0); 2],
                len: 0,
                listed: false,
                inter: l.inter_node,
                spill: NONE,
                sp: NONE,
            })
            .collect();
        Queues { links, spilled: Vec::new(), free: Vec::new() }
    }

    /// Queues `e` on link `l` (a failed allocation is an error, not an abort).
    #[inline]
    fn push(&mut self, l: usize, e: Entry) -> Result<(), TooLarge> {
        let q = &mut self.links[l];
        if q.spill != NONE {
            let h = &mut self.spilled[q.spill as usize];
            h.try_reserve(1).map_err(|_| queue_full())?;
            h.push(Reverse(e));
            return Ok(());
        }
        match q.len {
            0 => q.near[0] = e,
            1 if e < q.near[0] => q.near = [e, q.near[0]],
            1 => q.near[1] = e,
            _ => {
                let at = match self.free.pop() {
                    Some(at) => at,
                    None => {
                        self.spilled.push(BinaryHeap::new());
                        self.spilled.len() as u32 - 1
                    }
                };
                let h = &mut self.spilled[at as usize];
                h.try_reserve(3).map_err(|_| queue_full())?;
                h.extend([Reverse(q.near[0]), Reverse(q.near[1]), Reverse(e)]);
                q.spill = at;
            }
        }
        q.len = q.len.saturating_add(1).min(2);
        Ok(())
    }

    #[inline]
    fn pop(&mut self, l: usize) -> Option<Entry> {
        let q = &mut self.links[l];
        if q.spill != NONE {
            let h = &mut self.spilled[q.spill as usize];
            let e = h.pop().map(|Reverse(e)| e);
            if h.is_empty() {
                self.free.push(q.spill);
                q.spill = NONE;
                q.len = 0;
            }
            return e;
        }
        match q.len {
            0 => None,
            n => {
                let e = q.near[0];
                q.near[0] = q.near[1];
                q.len = n - 1;
                Some(e)
            }
        }
    }

    #[inline]
    fn is_empty(&self, l: usize) -> bool {
        let q = &self.links[l];
        q.spill == NONE && q.len == 0
    }
}

fn hpds(src: &impl OpSource, g: &Graph) -> Result<Schedule, CompileError> {
    let n = src.op_count();
    let mut pending = Pending::new(g)?;
    // Ready ops wait on their link, least-used chunk first: (uses of the chunk when the op became
    // ready, chunk, op). Only one op per link fits a sub-pipeline, so the link's queue decides which
    // chunk gets it.
    let mut q = Queues::new(g);
    let mut used = vec![0u32; g.chunks as usize];
    // The ops with an inter-node producer in the sub-pipeline being built (marked in `pending`),
    // cleared when it closes.
    let mut marked: Vec<u32> = Vec::new();
    let mut order: Vec<OpId> = memory::try_vec(n, "the schedule's order")?;
    let mut sp_start: Vec<u32> = Vec::new();
    let mut active: Vec<u32> = Vec::new();
    for i in 0..n {
        if g.pred_count(i) == 0 {
            let l = g.link_of_op[i] as usize;
            q.push(l, (0, g.chunk_of_op.get(i), i as u32))?;
            if !q.links[l].listed {
                q.links[l].listed = true;
                active.push(l as u32);
            }
        }
    }
    let mut sp = 0u32;
    let mut work: Vec<u32> = Vec::new();
    let mut parked: Vec<(usize, Entry)> = Vec::new();
    while order.len() < n {
        sp_start.push(order.len() as u32);
        work.clear();
        work.extend(active.iter().rev());
        while let Some(l) = work.pop() {
            let l = l as usize;
            if q.links[l].sp == sp {
                continue;
            }
            let inter = q.links[l].inter;
            while let Some(entry) = q.pop(l) {
                let (_, c, op) = entry;
                let o = op as usize;
                // An intra-node op never joins the sub-pipeline of an inter-node producer.
                if !inter && pending.marked(o) {
                    parked.push((l, entry));
                    continue;
                }
                q.links[l].sp = sp;
                used[c as usize] += 1;
                order.push(OpId(op));
                for &s in g.op_succs.row(o) {
                    let su = s as usize;
                    if inter && pending.mark(su) {
                        marked.push(s);
                    }
                    if pending.done_one(su) {
                        let sl = g.link_of_op[su] as usize;
                        let c = g.chunk_of_op.get(su);
                        q.push(sl, (used[c as usize], c, s))?;
                        let ls = &mut q.links[sl];
                        if !ls.listed {
                            ls.listed = true;
                            active.push(sl as u32);
                        }
                        if ls.sp != sp {
                            work.push(sl as u32);
                        }
                    }
                }
                break;
            }
        }
        for (l, entry) in parked.drain(..) {
            q.push(l, entry)?;
        }
        for s in marked.drain(..) {
            pending.unmark(s as usize);
        }
        active.retain(|&l| {
            let keep = !q.is_empty(l as usize);
            q.links[l as usize].listed = keep;
            keep
        });
        sp += 1;
    }
    sp_start.push(order.len() as u32);
    Ok(Schedule { scheduler: Scheduler::Hpds, order, sp_start })
}

fn round_robin(src: &impl OpSource, g: &Graph) -> Result<Schedule, CompileError> {
    let n = src.op_count();
    let nchunks = g.chunks as usize;
    let mut pending = Pending::new(g)?;
    let mut ready: Vec<BinaryHeap<Reverse<u32>>> = vec![BinaryHeap::new(); nchunks];
    let mut link_sp = vec![NONE; g.links.links.len()];
    let mut order: Vec<OpId> = memory::try_vec(n, "the schedule's order")?;
    let mut sp_start: Vec<u32> = Vec::new();
    for i in 0..n {
        if g.pred_count(i) == 0 {
            ready[g.chunk_of_op.get(i) as usize].push(Reverse(i as u32));
        }
    }
    let mut sp = 0u32;
    let mut start = 0usize;
    let mut picked: Vec<u32> = Vec::new();
    let mut deferred: Vec<u32> = Vec::new();
    while order.len() < n {
        sp_start.push(order.len() as u32);
        for i in 0..nchunks {
            let c = (start + i) % nchunks;
            while let Some(Reverse(op)) = ready[c].pop() {
                let link = g.link_of_op[op as usize] as usize;
                if link_sp[link] == sp {
                    deferred.push(op);
                    continue;
                }
                link_sp[link] = sp;
                order.push(OpId(op));
                picked.push(op);
                break;
            }
            ready[c].extend(deferred.drain(..).map(Reverse));
        }
        for &op in &picked {
            for &s in g.op_succs.row(op as usize) {
                if pending.done_one(s as usize) {
                    ready[g.chunk_of_op.get(s as usize) as usize].push(Reverse(s));
                }
            }
        }
        picked.clear();
        start = (start + 1) % nchunks.max(1);
        sp += 1;
    }
    sp_start.push(order.len() as u32);
    Ok(Schedule { scheduler: Scheduler::RoundRobin, order, sp_start })
}

fn stage(src: &impl OpSource, g: &Graph) -> Result<Schedule, CompileError> {
    let n = src.op_count();
    // A new sub-pipeline wherever a dependency crosses from one stage to another: stage labels need
    // not be monotone (HM AllReduce reuses the labels of its two stage kinds in both halves). Each
    // op's sub-pipeline is final when it is reached (its producers come earlier) and is pushed to
    // its successors.
    let mut sp_of: Vec<u32> = memory::try_filled(n, 0u32, "the stage scheduler's sub-pipelines")?;
    src.try_for_each_op(|id, op| -> Result<(), CompileError> {
        let a = id.index();
        for &b in g.op_succs.row(a) {
            let sb = sp_of[a] + u32::from(src.op(OpId(b)).stage != op.stage);
            sp_of[b as usize] = sp_of[b as usize].max(sb);
        }
        Ok(())
    })?;
    Ok(Schedule::from_subpipelines(Scheduler::Stage, &sp_of)?)
}
