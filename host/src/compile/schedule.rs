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

use super::{CompileError, Graph, Scheduler};
use crate::program::{OpId, Program};
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::fmt::Write;

/// The result of the pass.
#[derive(Clone, Debug)]
pub struct Schedule {
    /// The scheduler that produced it.
    pub scheduler: Scheduler,
    /// The sub-pipeline of each op.
    pub subpipeline: Vec<u32>,
    /// Every op, sorted by sub-pipeline; a topological order.
    pub order: Vec<OpId>,
    /// `position[op]`: the op's index in `order`.
    pub position: Vec<u32>,
    /// Number of sub-pipelines.
    pub count: u32,
}

impl Schedule {
    fn from_order(scheduler: Scheduler, subpipeline: Vec<u32>, order: Vec<OpId>) -> Schedule {
        let mut position = vec![0u32; order.len()];
        for (i, op) in order.iter().enumerate() {
            position[op.index()] = i as u32;
        }
        let count = subpipeline.iter().map(|&s| s + 1).max().unwrap_or(0);
        Schedule { scheduler, subpipeline, order, position, count }
    }

    /// The text dump: one line per sub-pipeline with its ops in order.
    pub fn dump(&self, _program: &Program) -> String {
        let mut s = String::new();
        let mut cur = u32::MAX;
        for op in &self.order {
            let sp = self.subpipeline[op.index()];
            if sp != cur {
                if cur != u32::MAX {
                    s.push('\n');
                }
                let _ = write!(s, "sp{sp}:");
                cur = sp;
            }
            let _ = write!(s, " {op}");
        }
        if cur != u32::MAX {
            s.push('\n');
        }
        s
    }
}

/// Runs the pass with `scheduler`.
pub fn run(program: &Program, graph: &Graph, scheduler: Scheduler) -> Result<Schedule, CompileError> {
    Ok(match scheduler {
        Scheduler::Hpds => hpds(program, graph),
        Scheduler::RoundRobin => round_robin(program, graph),
        Scheduler::Algorithm => {
            let n = program.ops.len();
            Schedule::from_order(scheduler, vec![0; n], (0..n).map(OpId::new).collect())
        }
        Scheduler::Stage => stage(program, graph),
    })
}

/// Dense chunk ids (in order of first appearance) and the chunk of each op.
fn dense_chunks(program: &Program) -> (usize, Vec<u32>) {
    let mut ids: super::FastMap<u32, u32> = Default::default();
    let of_op = program
        .ops
        .iter()
        .map(|op| {
            let next = ids.len() as u32;
            *ids.entry(op.chunk).or_insert(next)
        })
        .collect();
    (ids.len(), of_op)
}

const NONE: u32 = u32::MAX;

fn hpds(program: &Program, g: &Graph) -> Schedule {
    let n = program.ops.len();
    let (nchunks, chunk) = dense_chunks(program);
    let nlinks = g.links.len();
    let mut pending: Vec<u32> = (0..n).map(|i| g.op_preds.row(i).len() as u32).collect();
    // Ready ops wait on their link, least-used chunk first: (uses of the chunk when the op became
    // ready, chunk, op). Only one op per link fits a sub-pipeline, so the link's queue decides which
    // chunk gets it.
    let mut queue: Vec<BinaryHeap<Reverse<(u32, u32, u32)>>> = vec![BinaryHeap::new(); nlinks];
    let mut used = vec![0u32; nchunks];
    let mut link_sp = vec![NONE; nlinks];
    let mut sp_of = vec![NONE; n];
    let inter: Vec<bool> = (0..n).map(|i| g.is_inter(OpId::new(i))).collect();
    let link = |op: usize| g.link_of_op[op].index();
    let mut order = Vec::with_capacity(n);
    let mut active: Vec<u32> = Vec::new();
    let mut listed = vec![false; nlinks];
    for i in 0..n {
        if pending[i] == 0 {
            let l = link(i);
            queue[l].push(Reverse((0, chunk[i], i as u32)));
            if !listed[l] {
                listed[l] = true;
                active.push(l as u32);
            }
        }
    }
    let mut sp = 0u32;
    let mut work: Vec<u32> = Vec::new();
    let mut parked: Vec<(usize, (u32, u32, u32))> = Vec::new();
    while order.len() < n {
        work.clear();
        work.extend(active.iter().rev());
        while let Some(l) = work.pop() {
            let l = l as usize;
            if link_sp[l] == sp {
                continue;
            }
            while let Some(Reverse(entry)) = queue[l].pop() {
                let (_, c, op) = entry;
                let o = op as usize;
                // An intra-node op never joins the sub-pipeline of an inter-node producer.
                if !inter[o] && g.op_preds.row(o).iter().any(|&p| sp_of[p as usize] == sp && inter[p as usize]) {
                    parked.push((l, entry));
                    continue;
                }
                sp_of[o] = sp;
                link_sp[l] = sp;
                used[c as usize] += 1;
                order.push(OpId(op));
                for &s in g.op_succs.row(o) {
                    let su = s as usize;
                    pending[su] -= 1;
                    if pending[su] == 0 {
                        let sl = link(su);
                        queue[sl].push(Reverse((used[chunk[su] as usize], chunk[su], s)));
                        if !listed[sl] {
                            listed[sl] = true;
                            active.push(sl as u32);
                        }
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
        active.retain(|&l| {
            let keep = !queue[l as usize].is_empty();
            listed[l as usize] = keep;
            keep
        });
        sp += 1;
    }
    // Free the per-op scratch before `from_order` allocates the positions (it is the pass's peak).
    drop((pending, inter, chunk, queue));
    Schedule::from_order(Scheduler::Hpds, sp_of, order)
}

fn round_robin(program: &Program, g: &Graph) -> Schedule {
    let n = program.ops.len();
    let (nchunks, chunk) = dense_chunks(program);
    let mut pending: Vec<u32> = (0..n).map(|i| g.op_preds.row(i).len() as u32).collect();
    let mut ready: Vec<BinaryHeap<Reverse<u32>>> = vec![BinaryHeap::new(); nchunks];
    let mut link_sp = vec![NONE; g.links.len()];
    let mut sp_of = vec![NONE; n];
    let mut order = Vec::with_capacity(n);
    for i in 0..n {
        if pending[i] == 0 {
            ready[chunk[i] as usize].push(Reverse(i as u32));
        }
    }
    let mut sp = 0u32;
    let mut start = 0usize;
    let mut picked: Vec<u32> = Vec::new();
    let mut deferred: Vec<u32> = Vec::new();
    while order.len() < n {
        for i in 0..nchunks {
            let c = (start + i) % nchunks;
            while let Some(Reverse(op)) = ready[c].pop() {
                let link = g.link_of_op[op as usize].index();
                if link_sp[link] == sp {
                    deferred.push(op);
                    continue;
                }
                link_sp[link] = sp;
                sp_of[op as usize] = sp;
                order.push(OpId(op));
                picked.push(op);
                break;
            }
            ready[c].extend(deferred.drain(..).map(Reverse));
        }
        for &op in &picked {
            for &s in g.op_succs.row(op as usize) {
                pending[s as usize] -= 1;
                if pending[s as usize] == 0 {
                    ready[chunk[s as usize] as usize].push(Reverse(s));
                }
            }
        }
        picked.clear();
        start = (start + 1) % nchunks.max(1);
        sp += 1;
    }
    drop((pending, chunk, ready));
    Schedule::from_order(Scheduler::RoundRobin, sp_of, order)
}

fn stage(program: &Program, g: &Graph) -> Schedule {
    let n = program.ops.len();
    // A new sub-pipeline wherever a dependency crosses from one stage to another: stage labels need
    // not be monotone (HM AllReduce reuses the labels of its two stage kinds in both halves).
    let mut sp_of = vec![0u32; n];
    for b in 0..n {
        let sb = program.ops[b].stage;
        sp_of[b] = g
            .op_preds
            .row(b)
            .iter()
            .map(|&a| sp_of[a as usize] + u32::from(program.ops[a as usize].stage != sb))
            .max()
            .unwrap_or(0);
    }
    let mut order: Vec<OpId> = (0..n).map(OpId::new).collect();
    order.sort_by_key(|o| sp_of[o.index()]);
    Schedule::from_order(Scheduler::Stage, sp_of, order)
}
