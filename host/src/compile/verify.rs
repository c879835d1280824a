//! The verifiers run after each pass. A failure is a compiler bug; it is reported as
//! [`CompileError::Verify`] naming the pass and what broke, never a panic.
//!
//! Each runs in time linear in the program and keeps a few bits per op, so that the 8192-GPU
//! programs are verified as they compile: `tb-alloc` and `emit` are checked rank by rank as the
//! plan is emitted ([`PlanCheck`]).

use super::tballoc::{Connections, RankAlloc, RankTask, rank_tasks};
use super::{
    Allocation, CompileError, Connection, EndpointKind, Graph, OpSource, Plan, Prim, RankPlan, Schedule, Scheduler,
    Task, TbAlloc,
};
use crate::program::Rank;

/// Names a task in messages (formatted only when an error is reported).
#[derive(Copy, Clone)]
struct Here(Rank, usize, usize);

impl std::fmt::Display for Here {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} tb{} task {}", self.0, self.1, self.2)
    }
}

fn fail(pass: &'static str, message: String) -> CompileError {
    CompileError::Verify { pass, message }
}

/// A set of op ids, a bit each.
struct Bits(Vec<u64>);

impl Bits {
    fn new(n: usize) -> Bits {
        Bits(vec![0; n.div_ceil(64)])
    }
    #[inline]
    fn get(&self, i: usize) -> bool {
        self.0[i / 64] & (1 << (i % 64)) != 0
    }
    #[inline]
    fn set(&mut self, i: usize, on: bool) {
        if on {
            self.0[i / 64] |= 1 << (i % 64);
        } else {
            self.0[i / 64] &= !(1 << (i % 64));
        }
    }
}

/// After `deps`: one entry per op, successors are later ops, rows non-decreasing, each op's link joins
/// its ranks, and the producer counts match the successor lists (compared as sums of a hash of
/// the op over its producers and over the successor lists, so no per-op table is made).
pub fn graph(src: &impl OpSource, g: &Graph) -> Result<(), CompileError> {
    let p = "deps";
    let n = src.op_count();
    if g.ops != n || g.op_succs.rows() != n || g.op_succs.start.last().copied() != Some(g.op_succs.items.len() as u32) {
        return Err(fail(p, "one entry per op expected".into()));
    }
    if g.link_of_op.len() != n || g.chunk_of_op_len() != n {
        return Err(fail(p, "one link and one chunk per op expected".into()));
    }
    let (mut tasks, mut by_counts, mut by_succs) = (0usize, 0u64, 0u64);
    src.try_for_each_op(|id, op| {
        let a = id.index();
        tasks += Task::count(op);
        let l = g.links.links.get(g.link_of_op[a] as usize);
        if l.is_none_or(|l| l.src != op.src_rank() || l.dst != op.dst_rank() || l.local == op.is_transfer()) {
            return Err(fail(p, format!("{id}: link does not match the op")));
        }
        by_counts = by_counts.wrapping_add((g.pred_count(a) as u64).wrapping_mul(mix(id.0, 0, 0)));
        let row = g.op_succs.row(a);
        for (k, &b) in row.iter().enumerate() {
            if b as usize <= a || b as usize >= n || (k > 0 && row[k - 1] > b) {
                return Err(fail(p, format!("op{b} depends on op{a}, which is not earlier (or rows unsorted)")));
            }
            by_succs = by_succs.wrapping_add(mix(b, 0, 0));
        }
        Ok(())
    })?;
    if tasks != g.task_count() {
        return Err(fail(p, format!("{tasks} tasks, the graph says {}", g.task_count())));
    }
    if by_counts != by_succs {
        return Err(fail(p, "the producer counts do not match the successor lists".into()));
    }
    Ok(())
}

/// After `schedule`: a permutation sorted by sub-pipeline, producers first, and the scheduler's own
/// rules (one op per link per sub-pipeline for HPDS and round-robin; HPDS's intra-after-inter rule;
/// round-robin's producers in earlier sub-pipelines).
pub fn schedule(src: &impl OpSource, g: &Graph, s: &Schedule) -> Result<(), CompileError> {
    schedule_on(src, g, s, 1)
}

/// [`schedule`] on up to `threads` threads, each checking a range of sub-pipelines (with the ops
/// of the earlier ones marked first); the first error in the order is reported.
pub fn schedule_on(src: &impl OpSource, g: &Graph, s: &Schedule, threads: usize) -> Result<(), CompileError> {
    let p = "schedule";
    let n = src.op_count();
    if g.link_of_op.len() != n {
        return Err(fail(p, "the graph's links were dropped before the check".into()));
    }
    let sp = &s.sp_start;
    if s.order.len() != n
        || sp.first() != Some(&0)
        || sp.last().map(|&x| x as usize) != Some(n)
        || sp.windows(2).any(|w| w[0] >= w[1])
    {
        return Err(fail(p, "schedule does not cover every op once, in non-empty sub-pipelines".into()));
    }
    let count = s.count();
    let t = (threads.max(1) as u32).min(count.max(1));
    // Sub-pipeline ranges of about equal op counts.
    let cut = |k: u32| sp.partition_point(|&x| (x as u64) < n as u64 * k as u64 / t as u64).min(count as usize) as u32;
    let ranges: Vec<std::ops::Range<u32>> =
        (0..t).map(|k| cut(k)..if k + 1 == t { count } else { cut(k + 1) }).collect();
    let results: Vec<Result<(), CompileError>> = if t == 1 {
        vec![schedule_range(g, s, n, 0..count)]
    } else {
        std::thread::scope(|scope| {
            let handles: Vec<_> =
                ranges[1..].iter().map(|r| scope.spawn(move || schedule_range(g, s, n, r.clone()))).collect();
            let mut v = vec![schedule_range(g, s, n, ranges[0].clone())];
            v.extend(handles.into_iter().map(|h| h.join().expect("a verifier thread panicked")));
            v
        })
    };
    results.into_iter().collect()
}

/// [`schedule`]'s checks of sub-pipelines `range`.
fn schedule_range(g: &Graph, s: &Schedule, n: usize, range: std::ops::Range<u32>) -> Result<(), CompileError> {
    let p = "schedule";
    let sp = &s.sp_start;
    let exclusive = matches!(s.scheduler, Scheduler::Hpds | Scheduler::RoundRobin);
    let links = &g.links.links;
    // Per link: the last (sub-pipeline, op) that used it.
    let mut link_last: Vec<(u32, u32)> = vec![(u32::MAX, 0); links.len()];
    let mut done = Bits::new(n);
    let mut cur = Bits::new(n);
    // The ops of earlier sub-pipelines come before (their own checks are another range's).
    for op in &s.order[..sp[range.start as usize] as usize] {
        if op.index() < n {
            done.set(op.index(), true);
        }
    }
    for k in range {
        let ops = &s.order[sp[k as usize] as usize..sp[k as usize + 1] as usize];
        for op in ops {
            if op.index() >= n || done.get(op.index()) || cur.get(op.index()) {
                return Err(fail(p, format!("order is not a permutation at {op}")));
            }
            cur.set(op.index(), true);
        }
        for &a in ops {
            let l = g.link_of_op[a.index()] as usize;
            if exclusive {
                if link_last[l].0 == k {
                    return Err(fail(p, format!("op{} and {a} share link l{l} in sub-pipeline {k}", link_last[l].1)));
                }
                link_last[l] = (k, a.0);
            }
            let inter_a = links[l].inter_node;
            for &b in g.op_succs.row(a.index()) {
                let b = b as usize;
                if done.get(b) {
                    return Err(fail(p, format!("op{b} is scheduled before its producer {a}")));
                }
                if cur.get(b) {
                    if s.scheduler == Scheduler::RoundRobin {
                        return Err(fail(p, format!("op{b} shares sub-pipeline {k} with its producer {a}")));
                    }
                    if s.scheduler == Scheduler::Hpds && inter_a && !links[g.link_of_op[b] as usize].inter_node {
                        return Err(fail(p, format!("intra-node op{b} joined the sub-pipeline of inter-node {a}")));
                    }
                }
            }
            // Later ops of this sub-pipeline may follow `a` but not precede it.
            done.set(a.index(), true);
        }
        for op in ops {
            cur.set(op.index(), false);
        }
    }
    Ok(())
}

/// After `tb-alloc`, for one rank: every task has an endpoint of its rank whose kind and
/// connection match the task and whose interval covers the task's sub-pipeline; TBs are shared
/// only by endpoints with disjoint intervals (state-based) or not at all (per connection).
pub fn rank_alloc(
    rank: Rank,
    tasks: &[RankTask],
    a: &RankAlloc,
    connections: &[Connection],
    policy: TbAlloc,
) -> Result<(), CompileError> {
    let p = "tb-alloc";
    if a.endpoint_of.len() != tasks.len() {
        return Err(fail(p, format!("{rank}: one endpoint per task expected")));
    }
    for (t, &e) in tasks.iter().zip(&a.endpoint_of) {
        let here = || format!("{rank}'s task of {}", t.id);
        let e = a.endpoints.get(e as usize).ok_or_else(|| fail(p, format!("{}: no endpoint", here())))?;
        if e.rank != rank || t.sp < e.first || t.sp > e.last {
            return Err(fail(p, format!("{}: endpoint on another rank or interval misses sp{}", here(), t.sp)));
        }
        let conn = |c: super::ConnId| connections.get(c.index());
        let ok = match (Task::prim_of(&t.op, t.side), e.kind) {
            (Prim::Send, EndpointKind::Send(c)) => conn(c).is_some_and(|x| x.src == rank) && t.conn == Some(c),
            (Prim::Recv | Prim::RecvReduceCopy, EndpointKind::Recv(c)) => {
                conn(c).is_some_and(|x| x.dst == rank) && t.conn == Some(c)
            }
            (Prim::Copy | Prim::Reduce, EndpointKind::Local { .. }) => true,
            _ => false,
        };
        if !ok {
            return Err(fail(p, format!("{}: endpoint kind or connection does not match the task", here())));
        }
        if e.tb.0 >= a.tbs {
            return Err(fail(p, format!("{}: TB beyond the rank's count", here())));
        }
    }
    let mut by_tb: Vec<Vec<(u32, u32)>> = vec![Vec::new(); a.tbs as usize];
    for e in &a.endpoints {
        if e.tb.0 >= a.tbs {
            return Err(fail(p, format!("{rank}: an endpoint's TB is beyond the rank's count")));
        }
        by_tb[e.tb.index()].push((e.first, e.last));
    }
    for (tb, mut iv) in by_tb.into_iter().enumerate() {
        if policy == TbAlloc::PerConn && iv.len() > 1 {
            return Err(fail(p, format!("r{} tb{tb} drives {} endpoints under per-conn", rank.0, iv.len())));
        }
        iv.sort_unstable();
        if iv.windows(2).any(|w| w[0].1 >= w[1].0) {
            return Err(fail(p, format!("r{} tb{tb} drives endpoints with overlapping intervals", rank.0)));
        }
    }
    Ok(())
}

/// After `tb-alloc`, for a whole [`Allocation`] (see [`super::tballoc::run`]): [`rank_alloc`] for
/// every rank, its tasks in program order.
pub fn alloc(src: &impl OpSource, g: &Graph, s: &Schedule, a: &Allocation) -> Result<(), CompileError> {
    let nranks = src.ranks() as usize;
    if a.ranks.len() != nranks {
        return Err(fail("tb-alloc", format!("{} rank allocations for {nranks} ranks", a.ranks.len())));
    }
    let conns = Connections::build(src, g, a.policy);
    for (r, tasks) in rank_tasks(src, g, s, &conns).iter().enumerate() {
        rank_alloc(Rank(r as u32), tasks, &a.ranks[r], &a.connections, a.policy)?;
    }
    Ok(())
}

/// After `emit`, one rank plan at a time (emit streams them): each rank's plan holds exactly that
/// rank's tasks of the program, TB lists are sorted, sync points point backwards within the rank,
/// and both ends of each FIFO issue the same messages in the same order from one TB each.
///
/// Both halves of a transfer must carry the same connection, sub-pipeline and seq; with TB lists
/// sorted by seq and one TB per side of each connection, both sides then issue the connection's
/// messages in the same order. The checks are sums of a 64-bit hash, so that they stream over
/// 8192-GPU plans: per rank, over its tasks' (op, kind), against the program's
/// ([`PlanCheck::new`]); per connection and side, over its tasks' (op, sub-pipeline, seq), the two
/// sides' sums equal ([`PlanCheck::finish`]).
///
/// A rank's own checks ([`rank_plan`]) need nothing from other ranks and run where the rank is
/// built; [`PlanCheck::merge`] adds what they found to the plan-wide sums, in rank order.
pub struct PlanCheck<'a> {
    connections: &'a [Connection],
    /// Per rank: the sum and the number of its tasks' hashes in the program.
    expected: Vec<(u64, u64)>,
    /// Per connection: the hash sums of each side's (op, sub-pipeline, seq).
    pairs: Vec<[u64; 2]>,
    tasks: usize,
    expected_tasks: usize,
}

/// What one rank's plan adds to the plan-wide checks: per connection side it drives, the
/// connection, the side (0 send, 1 receive) and the sum of its tasks' hashes; and its task count.
#[derive(Clone, Debug, Default)]
pub struct RankSums {
    sides: Vec<(u32, u8, u64)>,
    tasks: usize,
}

/// A 64-bit mix of three words (SplitMix64's finaliser over them).
fn mix(a: u32, b: u32, c: u32) -> u64 {
    let mut z = (a as u64) ^ ((c as u64) << 32) ^ (b as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The kind of a task as the rank check tells them apart: a send, a receive, a local op.
fn kind(p: Prim) -> u32 {
    match p {
        Prim::Send => 0,
        Prim::Recv | Prim::RecvReduceCopy => 1,
        Prim::Copy | Prim::Reduce => 2,
    }
}

/// Per rank of `src`, the sum of a hash of its tasks' (op, kind) and their number: what
/// [`rank_plan`] compares each rank's plan with.
pub fn expected_sums(src: &impl OpSource) -> Vec<(u64, u64)> {
    let mut expected = vec![(0u64, 0u64); src.ranks() as usize];
    let _ = src.try_for_each_op(|id, op| -> Result<(), ()> {
        for (side, t) in Task::split(id, op).enumerate() {
            if let Some(e) = expected.get_mut(t.rank.index()) {
                e.0 = e.0.wrapping_add(mix(id.0, kind(Task::prim_of(op, side)), 0));
                e.1 += 1;
            }
        }
        Ok(())
    });
    expected
}

/// The checks of one rank's plan that need no other rank (see [`PlanCheck`]): sorted TB lists,
/// sync points backwards to signalling tasks of other TBs, the rank's tasks the program's
/// (`expected`: their hash sum and count, [`PlanCheck::expected`]), connections joining the rank
/// and its peer, each connection side driven by one TB. Returns what the plan-wide checks add up.
pub fn rank_plan(rp: &RankPlan, connections: &[Connection], expected: (u64, u64)) -> Result<RankSums, CompileError> {
    let p = "emit";
    let mut sum = (0u64, 0u64);
    // Per connection side on this rank: (connection, side, TB, hash sum); a rank drives few, and
    // runs of tasks share one, so the last one used is tried first.
    let mut sides: Vec<(u32, u8, u32, u64)> = Vec::new();
    let mut index: super::FastMap<(u32, u8), usize> = Default::default();
    let mut last = 0usize;
    for (ti, tb) in rp.tbs.iter().enumerate() {
        for (i, task) in tb.tasks.iter().enumerate() {
            let here = Here(rp.rank, ti, i);
            if i > 0 {
                let prev = &tb.tasks[i - 1];
                if (prev.subpipeline, prev.seq) >= (task.subpipeline, task.seq) {
                    return Err(fail(p, format!("{here}: tasks not sorted by (sub-pipeline, seq)")));
                }
            }
            let end = task.wait_start as usize + task.wait_count as usize;
            if end > tb.syncs.len() {
                return Err(fail(p, format!("{here}: sync points out of range")));
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
            sum.0 = sum.0.wrapping_add(mix(task.op.0, kind(task.prim), 0));
            sum.1 += 1;
            if task.prim.is_comm() {
                let c = task.conn.ok_or_else(|| fail(p, format!("{here}: no connection")))?;
                let conn = connections
                    .get(c.index())
                    .ok_or_else(|| fail(p, format!("{here}: connection {c} does not exist")))?;
                let send = task.prim == Prim::Send;
                let (me, peer) = if send { (conn.src, conn.dst) } else { (conn.dst, conn.src) };
                if me != rp.rank || task.peer != Some(peer) {
                    return Err(fail(p, format!("{here}: connection {c} does not join {} and its peer", rp.rank)));
                }
                let key = (c.0, u8::from(!send));
                if sides.get(last).is_none_or(|e| (e.0, e.1) != key) {
                    let found = if sides.len() <= 16 {
                        sides.iter().position(|e| (e.0, e.1) == key)
                    } else {
                        if index.is_empty() {
                            index.extend(sides.iter().enumerate().map(|(k, e)| ((e.0, e.1), k)));
                        }
                        index.get(&key).copied()
                    };
                    last = found.unwrap_or_else(|| {
                        sides.push((key.0, key.1, ti as u32, 0));
                        if !index.is_empty() {
                            index.insert(key, sides.len() - 1);
                        }
                        sides.len() - 1
                    });
                }
                let side = &mut sides[last];
                if side.2 != ti as u32 {
                    return Err(fail(p, format!("{c}: one side is driven by two TBs")));
                }
                side.3 = side.3.wrapping_add(mix(task.op.0, task.subpipeline, task.seq));
            } else if task.conn.is_some() || task.peer.is_some() {
                return Err(fail(p, format!("{here}: a local task with a connection")));
            }
        }
    }
    if sum != expected {
        return Err(fail(
            p,
            format!("{}: its tasks are not the program's (missing, repeated or of another kind)", rp.rank),
        ));
    }
    Ok(RankSums { sides: sides.into_iter().map(|(c, side, _, h)| (c, side, h)).collect(), tasks: sum.1 as usize })
}

impl<'a> PlanCheck<'a> {
    /// A check of the plan emitted for `src` over these connections (one pass over the program).
    pub fn new(src: &impl OpSource, graph: &Graph, connections: &'a Connections) -> PlanCheck<'a> {
        PlanCheck::with_expected(expected_sums(src), graph, connections)
    }

    /// [`PlanCheck::new`] with the program's sums already made ([`expected_sums`]).
    pub fn with_expected(expected: Vec<(u64, u64)>, graph: &Graph, connections: &'a Connections) -> PlanCheck<'a> {
        PlanCheck {
            connections: &connections.list,
            expected,
            pairs: vec![[0; 2]; connections.list.len()],
            tasks: 0,
            expected_tasks: graph.task_count(),
        }
    }

    /// Bytes a check keeps for `ranks` ranks and `conns` connections.
    pub fn estimate_bytes(ranks: u64, conns: u64) -> u64 {
        ranks * 16 + conns * 16
    }

    /// The connections it checks against.
    pub fn connections(&self) -> &'a [Connection] {
        self.connections
    }

    /// What rank `r`'s tasks in the program add up to (for [`rank_plan`]); `(0, 0)` for a rank
    /// the program does not have.
    pub fn expected(&self, r: Rank) -> (u64, u64) {
        self.expected.get(r.index()).copied().unwrap_or((0, 0))
    }

    /// Adds one rank's sums ([`rank_plan`]).
    pub fn merge(&mut self, sums: RankSums) {
        self.tasks += sums.tasks;
        for (c, side, h) in sums.sides {
            let pair = &mut self.pairs[c as usize][side as usize];
            *pair = pair.wrapping_add(h);
        }
    }

    /// Checks one rank's plan: [`rank_plan`], then [`PlanCheck::merge`].
    pub fn rank(&mut self, rp: &RankPlan) -> Result<(), CompileError> {
        let sums = rank_plan(rp, self.connections, self.expected(rp.rank))?;
        self.merge(sums);
        Ok(())
    }

    /// Checks that the rank plans seen hold every task of the program, and that the two sides of
    /// every connection carried the same ops with the same sub-pipelines and seqs.
    pub fn finish(self) -> Result<(), CompileError> {
        let p = "emit";
        if self.tasks != self.expected_tasks {
            return Err(fail(p, format!("plan has {} tasks, the graph {}", self.tasks, self.expected_tasks)));
        }
        if let Some(c) = self.pairs.iter().position(|s| s[0] != s[1]) {
            return Err(fail(
                p,
                format!("c{c}: its sends and receives do not pair up (ops, sub-pipelines or positions differ)"),
            ));
        }
        Ok(())
    }
}

/// After `emit`, for a whole plan: [`PlanCheck`] over every rank plan.
pub fn plan(src: &impl OpSource, g: &Graph, conns: &Connections, plan: &Plan) -> Result<(), CompileError> {
    let mut check = PlanCheck::new(src, g, conns);
    if plan.ranks.len() != src.ranks() as usize {
        return Err(fail("emit", format!("{} rank plans for {} ranks", plan.ranks.len(), src.ranks())));
    }
    for rp in &plan.ranks {
        check.rank(rp)?;
    }
    check.finish()
}
