//! The verifiers run after each pass. A failure is a compiler bug; it is reported as
//! [`CompileError::Verify`] naming the pass and what broke, never a panic.

use super::{Allocation, CompileError, EndpointKind, Graph, Plan, Prim, RankPlan, Schedule, Scheduler, TbAlloc};
use crate::program::{OpId, Program};
use std::collections::HashMap;

/// Names a task in messages (formatted only when an error is reported).
#[derive(Copy, Clone)]
struct Here(crate::program::Rank, usize, usize);

impl std::fmt::Display for Here {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} tb{} task {}", self.0, self.1, self.2)
    }
}

fn fail(pass: &'static str, message: String) -> CompileError {
    CompileError::Verify { pass, message }
}

/// After `deps`: each op has its tasks, dependencies point back to earlier tasks of the same rank,
/// links match their ops.
pub fn graph(program: &Program, g: &Graph) -> Result<(), CompileError> {
    let p = "deps";
    let n = program.ops.len();
    if g.op_tasks.len() != n + 1 || g.link_of_op.len() != n || g.op_preds.rows() != n {
        return Err(fail(p, "one entry per op expected".into()));
    }
    if g.pred_sides.len() != g.op_preds.items.len() || g.op_tasks[0].0 != 0 {
        return Err(fail(p, "dependency tags do not match the dependencies".into()));
    }
    for (i, op) in program.ops.iter().enumerate() {
        let id = OpId::new(i);
        let ts = g.op_tasks[i].index()..g.op_tasks[i + 1].index();
        let want = if op.is_transfer() { 2 } else { 1 };
        if ts.len() != want {
            return Err(fail(p, format!("{id} has {} tasks, expected {want}", ts.len())));
        }
        let l = &g.links[g.link_of_op[i].index()];
        if l.src != op.src_rank() || l.dst != op.dst_rank() || l.local == op.is_transfer() {
            return Err(fail(p, format!("{id}: link does not match the op")));
        }
        let row = g.op_preds.start[i] as usize..g.op_preds.start[i + 1] as usize;
        for (k, (&a, &bits)) in g.op_preds.items[row.clone()].iter().zip(&g.pred_sides[row]).enumerate() {
            if a as usize >= i || (k > 0 && g.op_preds.row(i)[k - 1] >= a) {
                return Err(fail(p, format!("{id} depends on a later op op{a} (or rows unsorted)")));
            }
            // The rank of task `side` of an op (see `Task::split`) and the op's task count.
            let rank_of = |op: &crate::program::Op, side: usize| if side == 0 { op.src_rank() } else { op.dst_rank() };
            let (pa, na) = (&program.ops[a as usize], g.tasks_of(OpId(a)).len());
            if bits == 0 || bits >> 4 != 0 || (want == 1 && bits & 0b1100 != 0) || (na == 1 && bits & 0b1010 != 0) {
                return Err(fail(p, format!("{id}: bad dependency tag on op{a}")));
            }
            for side in 0..want {
                for s2 in 0..na {
                    if bits & (1 << (2 * side + s2)) != 0 && rank_of(pa, s2) != rank_of(op, side) {
                        let (t, pr) = (g.op_tasks[i].index() + side, g.op_tasks[a as usize].index() + s2);
                        let rank = rank_of(op, side);
                        return Err(fail(p, format!("t{t} depends on t{pr}, not an earlier task of {rank}")));
                    }
                }
            }
        }
    }
    Ok(())
}

/// After `schedule`: a permutation sorted by sub-pipeline, producers first, and the scheduler's own
/// rules (one op per link per sub-pipeline for HPDS and round-robin; HPDS's intra-after-inter rule;
/// round-robin's producers in earlier sub-pipelines).
pub fn schedule(program: &Program, g: &Graph, s: &Schedule) -> Result<(), CompileError> {
    let p = "schedule";
    let n = program.ops.len();
    if s.order.len() != n || s.subpipeline.len() != n || s.position.len() != n {
        return Err(fail(p, "schedule does not cover every op once".into()));
    }
    let mut seen = vec![false; n];
    for (i, op) in s.order.iter().enumerate() {
        if op.index() >= n || seen[op.index()] || s.position[op.index()] as usize != i {
            return Err(fail(p, format!("order is not a permutation at position {i}")));
        }
        seen[op.index()] = true;
        if i > 0 && s.subpipeline[s.order[i - 1].index()] > s.subpipeline[op.index()] {
            return Err(fail(p, format!("order not sorted by sub-pipeline at {op}")));
        }
        if s.subpipeline[op.index()] >= s.count {
            return Err(fail(p, format!("{op} in sub-pipeline beyond the count")));
        }
    }
    let exclusive = matches!(s.scheduler, Scheduler::Hpds | Scheduler::RoundRobin);
    // Ops come sorted by sub-pipeline in `order`: remember the last (sub-pipeline, op) per link.
    let mut link_last: Vec<(u32, u32)> = vec![(u32::MAX, 0); g.links.len()];
    if exclusive {
        for op in &s.order {
            let (l, sp) = (g.link_of_op[op.index()].index(), s.subpipeline[op.index()]);
            if link_last[l].0 == sp {
                return Err(fail(p, format!("op{} and {op} share link l{l} in sub-pipeline {sp}", link_last[l].1)));
            }
            link_last[l] = (sp, op.0);
        }
    }
    for b in 0..n {
        let sb = s.subpipeline[b];
        for &a in g.op_preds.row(b) {
            let sa = s.subpipeline[a as usize];
            if sa > sb || s.position[a as usize] >= s.position[b] {
                return Err(fail(p, format!("op{b} is scheduled before its producer op{a}")));
            }
            if s.scheduler == Scheduler::RoundRobin && sa == sb {
                return Err(fail(p, format!("op{b} shares sub-pipeline {sb} with its producer op{a}")));
            }
            if s.scheduler == Scheduler::Hpds && sa == sb && g.is_inter(OpId(a)) && !g.is_inter(OpId::new(b)) {
                return Err(fail(p, format!("intra-node op{b} joined the sub-pipeline of inter-node op{a}")));
            }
        }
    }
    Ok(())
}

/// After `tb-alloc`: endpoints match their tasks, intervals cover them, and TBs are shared only by
/// endpoints with disjoint intervals (state-based) or not at all (per connection).
pub fn alloc(program: &Program, g: &Graph, s: &Schedule, a: &Allocation) -> Result<(), CompileError> {
    let p = "tb-alloc";
    if a.endpoint_of_task.len() != g.task_count() {
        return Err(fail(p, "one endpoint per task expected".into()));
    }
    for (t, task) in g.tasks(program) {
        let t = t.index();
        let e = a.endpoints.get(a.endpoint_of_task[t] as usize).ok_or_else(|| fail(p, format!("t{t}: no endpoint")))?;
        let sp = s.subpipeline[task.op.index()];
        if e.rank != task.rank || sp < e.first || sp > e.last {
            return Err(fail(p, format!("t{t}: endpoint on another rank or interval misses sp{sp}")));
        }
        let ok = match (task.prim, e.kind) {
            (Prim::Send, EndpointKind::Send(c)) => {
                let conn = &a.connections[c.index()];
                conn.src == task.rank && a.conn_of(task.op) == Some(c)
            }
            (Prim::Recv | Prim::RecvReduceCopy, EndpointKind::Recv(c)) => {
                let conn = &a.connections[c.index()];
                conn.dst == task.rank && a.conn_of(task.op) == Some(c)
            }
            (Prim::Copy | Prim::Reduce, EndpointKind::Local { .. }) => true,
            _ => false,
        };
        if !ok {
            return Err(fail(p, format!("t{t}: endpoint kind or connection does not match the task")));
        }
        if e.tb.0 >= a.tbs_per_rank[task.rank.index()] {
            return Err(fail(p, format!("t{t}: TB beyond the rank's count")));
        }
    }
    let mut by_tb: HashMap<(u32, u32), Vec<(u32, u32)>> = HashMap::new();
    for e in &a.endpoints {
        by_tb.entry((e.rank.0, e.tb.0)).or_default().push((e.first, e.last));
    }
    for ((r, tb), mut iv) in by_tb {
        if a.policy == TbAlloc::PerConn && iv.len() > 1 {
            return Err(fail(p, format!("r{r} tb{tb} drives {} endpoints under per-conn", iv.len())));
        }
        iv.sort_unstable();
        for w in iv.windows(2) {
            if w[0].1 >= w[1].0 {
                return Err(fail(p, format!("r{r} tb{tb} drives endpoints with overlapping intervals")));
            }
        }
    }
    Ok(())
}

/// After `emit`, one rank plan at a time (emit streams them): every task once, TB lists sorted,
/// sync points backwards within the rank, and both ends of each FIFO issue the same messages in the
/// same order from one TB each. [`PlanCheck::finish`] checks that every task was seen.
///
/// Both halves of a transfer must carry the connection, sub-pipeline and seq the schedule and the
/// allocation gave the op; with TB lists sorted by seq, one TB per side of each connection means
/// both sides issue the connection's messages in the same order. Per op only the sides seen so far
/// are kept (one byte), so the check streams over 8192-GPU plans.
pub struct PlanCheck<'a> {
    graph: &'a Graph,
    sched: &'a Schedule,
    alloc: &'a Allocation,
    /// Per op: bit 0 its send was seen, bit 1 its receive, bit 2 its local task.
    seen: Vec<u8>,
    /// Per connection: the (rank, TB) driving each side.
    side_tb: Vec<[(u32, u32); 2]>,
    tasks: usize,
}

const NONE: u32 = u32::MAX;

impl<'a> PlanCheck<'a> {
    /// A check of the plan emitted from these pass results.
    pub fn new(graph: &'a Graph, sched: &'a Schedule, alloc: &'a Allocation) -> PlanCheck<'a> {
        let nops = graph.op_tasks.len().saturating_sub(1);
        PlanCheck {
            graph,
            sched,
            alloc,
            seen: vec![0u8; nops],
            side_tb: vec![[(NONE, NONE); 2]; alloc.connections.len()],
            tasks: 0,
        }
    }

    /// Checks one rank's plan.
    pub fn rank(&mut self, rp: &RankPlan) -> Result<(), CompileError> {
        let p = "emit";
        let nops = self.seen.len();
        for (ti, tb) in rp.tbs.iter().enumerate() {
            self.tasks += tb.tasks.len();
            for (i, task) in tb.tasks.iter().enumerate() {
                let here = Here(rp.rank, ti, i);
                if i > 0 {
                    let prev = &tb.tasks[i - 1];
                    if (prev.subpipeline, prev.seq) >= (task.subpipeline, task.seq) {
                        return Err(fail(p, format!("{here}: tasks not sorted by (sub-pipeline, seq)")));
                    }
                }
                for w in tb.waits(i) {
                    let target = rp
                        .tbs
                        .get(w.tb.index())
                        .and_then(|t| t.tasks.get(w.task as usize))
                        .ok_or_else(|| fail(p, format!("{here}: sync point {}.{} does not exist", w.tb, w.task)))?;
                    if w.tb.index() == ti || target.seq >= task.seq || !target.signal {
                        return Err(fail(p, format!("{here}: bad sync point {}.{}", w.tb, w.task)));
                    }
                }
                let o = task.op.index();
                let bit = match task.prim {
                    Prim::Send => 1u8,
                    Prim::Recv | Prim::RecvReduceCopy => 2,
                    Prim::Copy | Prim::Reduce => 4,
                };
                if o >= nops || self.seen[o] & bit != 0 {
                    return Err(fail(p, format!("{here}: {} is not an op or appears too often", task.op)));
                }
                self.seen[o] |= bit;
                if task.prim.is_comm() {
                    let c = task.conn.ok_or_else(|| fail(p, format!("{here}: no connection")))?;
                    let conn = self
                        .alloc
                        .connections
                        .get(c.index())
                        .ok_or_else(|| fail(p, format!("{here}: connection {c} does not exist")))?;
                    let send = task.prim == Prim::Send;
                    let (me, peer) = if send { (conn.src, conn.dst) } else { (conn.dst, conn.src) };
                    if me != rp.rank || task.peer != Some(peer) {
                        return Err(fail(p, format!("{here}: connection {c} does not join {} and its peer", rp.rank)));
                    }
                    let want = (self.alloc.conn_of(task.op), self.sched.subpipeline[o], self.sched.position[o]);
                    if (Some(c), task.subpipeline, task.seq) != want {
                        return Err(fail(p, format!("op{o}: its send and receive do not pair up on one connection")));
                    }
                    let owner = &mut self.side_tb[c.index()][usize::from(!send)];
                    if owner.0 == NONE {
                        *owner = (rp.rank.0, ti as u32);
                    } else if *owner != (rp.rank.0, ti as u32) {
                        return Err(fail(p, format!("{c}: one side is driven by two TBs")));
                    }
                } else if task.conn.is_some() || task.peer.is_some() {
                    return Err(fail(p, format!("{here}: a local task with a connection")));
                }
            }
        }
        Ok(())
    }

    /// Checks that the rank plans seen hold every task of the graph.
    pub fn finish(self) -> Result<(), CompileError> {
        let p = "emit";
        if self.tasks != self.graph.task_count() {
            return Err(fail(p, format!("plan has {} tasks, the graph {}", self.tasks, self.graph.task_count())));
        }
        for (o, &seen) in self.seen.iter().enumerate() {
            let want = if self.graph.tasks_of(OpId::new(o)).len() == 2 { 0b011 } else { 0b100 };
            if seen != want {
                return Err(fail(p, format!("op{o}: its send and receive do not pair up on one connection")));
            }
        }
        Ok(())
    }
}

/// After `emit`, for a whole plan: [`PlanCheck`] over every rank plan.
pub fn plan(g: &Graph, s: &Schedule, a: &Allocation, plan: &Plan) -> Result<(), CompileError> {
    let mut check = PlanCheck::new(g, s, a);
    for rp in &plan.ranks {
        check.rank(rp)?;
    }
    check.finish()
}
