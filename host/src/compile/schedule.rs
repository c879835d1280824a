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
//! the priority queues compare after the use counts. The schedulers keep per op only the order
//! they build and a producer count; an op's chunk and link are computed from the op when it
//! becomes ready.

use super::deps::{is_inter, link_key};
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

/// Bytes [`run`] needs at its peak beside the graph, for `ops` ops: the order, a producer count per
/// op, a bit per op and the per-link queues (at most one entry per op).
pub fn estimate_bytes(ops: u64) -> u64 {
    ops * 4 + ops + ops / 8 + ops * 12 / 4
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

/// Dense chunk ids, in the order ops first name the chunks.
struct Chunks {
    /// Label → id + 1 (0: unseen), when labels are small enough for a table.
    table: Vec<u32>,
    /// Label → id otherwise.
    map: FastMap<u32, u32>,
    count: u32,
}

impl Chunks {
    fn new(src: &impl OpSource) -> Chunks {
        let mut max = 0u32;
        let _ = src.try_for_each_op(|_, op| -> Result<(), ()> {
            max = max.max(op.chunk);
            Ok(())
        });
        // A table when it is no larger than a few bytes per op.
        let table = if (max as usize) < (src.op_count() * 2).max(1 << 16) { vec![0u32; max as usize + 1] } else { Vec::new() };
        let mut c = Chunks { table, map: Default::default(), count: 0 };
        let _ = src.try_for_each_op(|_, op| -> Result<(), ()> {
            c.intern(op.chunk);
            Ok(())
        });
        c
    }

    fn intern(&mut self, label: u32) {
        if self.table.is_empty() {
            let next = self.count;
            if *self.map.entry(label).or_insert(next) == next {
                self.count += 1;
            }
        } else if self.table[label as usize] == 0 {
            self.count += 1;
            self.table[label as usize] = self.count;
        }
    }

    #[inline]
    fn id(&self, label: u32) -> u32 {
        if self.table.is_empty() { self.map[&label] } else { self.table[label as usize] - 1 }
    }
}

/// Dense link ids, given as links are first met (any order: the schedulers only tell links apart),
/// each with whether it crosses nodes.
#[derive(Default)]
struct Links {
    ids: FastMap<(u32, u32, u32, bool), u32>,
    inter: Vec<bool>,
}

impl Links {
    /// The id of `op`'s link, and whether it is new.
    #[inline]
    fn of(&mut self, op: &crate::program::Op, per_node: Option<u32>) -> (usize, bool) {
        let next = self.inter.len() as u32;
        let l = *self.ids.entry(link_key(op)).or_insert(next);
        if l == next {
            self.inter.push(is_inter(op, per_node));
        }
        (l as usize, l == next)
    }
}

/// Producer counts counted down as producers are scheduled.
struct Pending {
    counts: Vec<u8>,
    overflow: FastMap<u32, u32>,
}

impl Pending {
    /// One producer of `op` was scheduled: whether that was the last.
    #[inline]
    fn done_one(&mut self, op: usize) -> bool {
        match &mut self.counts[op] {
            255 => {
                let c = self.overflow.get_mut(&(op as u32)).expect("an overflowed count");
                *c -= 1;
                *c == 0
            }
            c => {
                *c -= 1;
                *c == 0
            }
        }
    }
}

const NONE: u32 = u32::MAX;

fn hpds(src: &impl OpSource, g: &Graph) -> Result<Schedule, CompileError> {
    let n = src.op_count();
    let per_node = g.ranks_per_node;
    let chunks = Chunks::new(src);
    let (counts, overflow) = g.pending()?;
    let mut pending = Pending { counts, overflow };
    // Ready ops wait on their link, least-used chunk first: (uses of the chunk when the op became
    // ready, chunk, op). Only one op per link fits a sub-pipeline, so the link's queue decides which
    // chunk gets it.
    let mut links = Links::default();
    let mut queue: Vec<BinaryHeap<Reverse<(u32, u32, u32)>>> = Vec::new();
    let mut link_sp: Vec<u32> = Vec::new();
    let mut listed: Vec<bool> = Vec::new();
    let mut used = vec![0u32; chunks.count as usize];
    // The ops with an inter-node producer in the sub-pipeline being built (a bit each), and the
    // list of them, cleared when it closes.
    let mut inter_pred = vec![0u64; n.div_ceil(64)];
    let mut marked: Vec<u32> = Vec::new();
    let mut order: Vec<OpId> = memory::try_vec(n, "the schedule's order")?;
    let mut sp_start: Vec<u32> = Vec::new();
    let mut active: Vec<u32> = Vec::new();
    // Queues `op` (ready) on its link; returns the link.
    let enqueue = |links: &mut Links,
                       queue: &mut Vec<BinaryHeap<Reverse<(u32, u32, u32)>>>,
                       link_sp: &mut Vec<u32>,
                       listed: &mut Vec<bool>,
                       active: &mut Vec<u32>,
                       op: &crate::program::Op,
                       id: u32,
                       uses: u32| {
        let (l, new) = links.of(op, per_node);
        if new {
            queue.push(BinaryHeap::new());
            link_sp.push(NONE);
            listed.push(false);
        }
        queue[l].push(Reverse((uses, chunks.id(op.chunk), id)));
        if !listed[l] {
            listed[l] = true;
            active.push(l as u32);
        }
        l
    };
    src.try_for_each_op(|id, op| -> Result<(), CompileError> {
        if g.pred_count(id.index()) == 0 {
            enqueue(&mut links, &mut queue, &mut link_sp, &mut listed, &mut active, op, id.0, 0);
        }
        Ok(())
    })?;
    let mut sp = 0u32;
    let mut work: Vec<u32> = Vec::new();
    let mut parked: Vec<(usize, (u32, u32, u32))> = Vec::new();
    while order.len() < n {
        sp_start.push(order.len() as u32);
        work.clear();
        work.extend(active.iter().rev());
        while let Some(l) = work.pop() {
            let l = l as usize;
            if link_sp[l] == sp {
                continue;
            }
            let inter = links.inter[l];
            while let Some(Reverse(entry)) = queue[l].pop() {
                let (_, c, op) = entry;
                let o = op as usize;
                // An intra-node op never joins the sub-pipeline of an inter-node producer.
                if !inter && inter_pred[o / 64] & (1 << (o % 64)) != 0 {
                    parked.push((l, entry));
                    continue;
                }
                link_sp[l] = sp;
                used[c as usize] += 1;
                order.push(OpId(op));
                for &s in g.op_succs.row(o) {
                    let su = s as usize;
                    if inter && inter_pred[su / 64] & (1 << (su % 64)) == 0 {
                        inter_pred[su / 64] |= 1 << (su % 64);
                        marked.push(s);
                    }
                    if pending.done_one(su) {
                        let sop = src.op(OpId(s));
                        let uses = used[chunks.id(sop.chunk) as usize];
                        let sl = enqueue(&mut links, &mut queue, &mut link_sp, &mut listed, &mut active, &sop, s, uses);
                        if link_sp[sl] != sp {
                            work.push(sl as u32);
                        }
                    }
                }
                break;
            }
        }
        for (l, entry) in parked.drain(..) {
            queue[l].push(Reverse(entry));
        }
        for s in marked.drain(..) {
            inter_pred[s as usize / 64] &= !(1 << (s % 64));
        }
        active.retain(|&l| {
            let keep = !queue[l as usize].is_empty();
            listed[l as usize] = keep;
            keep
        });
        sp += 1;
    }
    sp_start.push(order.len() as u32);
    if n == 0 {
        sp_start = vec![0];
    }
    Ok(Schedule { scheduler: Scheduler::Hpds, order, sp_start })
}

fn round_robin(src: &impl OpSource, g: &Graph) -> Result<Schedule, CompileError> {
    let n = src.op_count();
    let per_node = g.ranks_per_node;
    let chunks = Chunks::new(src);
    let nchunks = chunks.count as usize;
    let (counts, overflow) = g.pending()?;
    let mut pending = Pending { counts, overflow };
    let mut ready: Vec<BinaryHeap<Reverse<u32>>> = vec![BinaryHeap::new(); nchunks];
    let mut links = Links::default();
    let mut link_sp: Vec<u32> = Vec::new();
    let mut order: Vec<OpId> = memory::try_vec(n, "the schedule's order")?;
    let mut sp_start: Vec<u32> = Vec::new();
    src.try_for_each_op(|id, op| -> Result<(), CompileError> {
        if g.pred_count(id.index()) == 0 {
            ready[chunks.id(op.chunk) as usize].push(Reverse(id.0));
        }
        Ok(())
    })?;
    let mut sp = 0u32;
    let mut start = 0usize;
    let mut picked: Vec<u32> = Vec::new();
    let mut deferred: Vec<u32> = Vec::new();
    while order.len() < n {
        sp_start.push(order.len() as u32);
        for i in 0..nchunks {
            let c = (start + i) % nchunks;
            while let Some(Reverse(op)) = ready[c].pop() {
                let (link, new) = links.of(&src.op(OpId(op)), per_node);
                if new {
                    link_sp.push(NONE);
                }
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
                    ready[chunks.id(src.op(OpId(s)).chunk) as usize].push(Reverse(s));
                }
            }
        }
        picked.clear();
        start = (start + 1) % nchunks.max(1);
        sp += 1;
    }
    sp_start.push(order.len() as u32);
    if n == 0 {
        sp_start = vec![0];
    }
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
