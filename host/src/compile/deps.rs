//! Pass `deps`: tasks, data dependencies and links.
//!
//! Every op becomes one task per rank it runs on: a transfer becomes a [`Prim::Send`] on the source
//! rank and a [`Prim::Recv`] or [`Prim::RecvReduceCopy`] on the destination rank; local ops become one
//! [`Prim::Copy`] or [`Prim::Reduce`]. Each task declares what it reads and writes:
//!
//! | task | reads | writes |
//! |---|---|---|
//! | send | source | |
//! | recv | | destination |
//! | recv_reduce_copy | destination | destination |
//! | copy | source | destination |
//! | reduce | source, destination | destination |
//!
//! Walking the tasks in program order, every chunk location keeps its last writer and the readers
//! since; a task depends on the last writer of what it reads or writes (read-after-write,
//! write-after-write) and on the readers of what it writes (write-after-read). Dependencies are
//! therefore per chunk and always between tasks of one rank. A receive depends on its send through
//! the FIFO (the *pair*); tasks on one link (same `(src, dst, channel)`, or the same rank and channel
//! for local ops) share it, which is the communication dependency the schedulers respect.

use super::{Csr, LinkId, TaskId};
use crate::program::{Op, OpId, OpKind, Program, ProgramError, Rank, RecvOp, Slice};
use serde::{Deserialize, Serialize};
use std::fmt::Write;

/// The primitive a task runs (NCCL's names, in data-flow order).
#[derive(Copy, Clone, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
pub enum Prim {
    /// Push the source chunks into the connection's FIFO.
    Send,
    /// Pop from the FIFO into the destination.
    Recv,
    /// Pop from the FIFO and reduce into the destination: `dst = dst ⊕ data`.
    RecvReduceCopy,
    /// Local copy source → destination.
    Copy,
    /// Local reduction: `dst = dst ⊕ src`.
    Reduce,
}

impl Prim {
    /// The name used in dumps (`send`, `recv`, `rrc`, `copy`, `reduce`).
    pub fn name(self) -> &'static str {
        match self {
            Prim::Send => "send",
            Prim::Recv => "recv",
            Prim::RecvReduceCopy => "rrc",
            Prim::Copy => "copy",
            Prim::Reduce => "reduce",
        }
    }
    /// Whether the task moves data through a FIFO.
    pub fn is_comm(self) -> bool {
        matches!(self, Prim::Send | Prim::Recv | Prim::RecvReduceCopy)
    }
}

/// One rank's half of an op.
#[derive(Copy, Clone, PartialEq, Eq, Debug)]
pub struct Task {
    /// The op the task belongs to: one of a transfer's two tasks, or a local op's only task.
    pub op: OpId,
    /// The rank that runs it: a transfer's source for the send, its destination for the receive.
    pub rank: Rank,
    /// What it runs.
    pub prim: Prim,
}

impl Task {
    /// The tasks `op` (with id `id`) splits into, in task order: a transfer's send then its receive
    /// (sides 0 and 1), or a local op's one task (side 0).
    pub fn split(id: OpId, op: &Op) -> impl Iterator<Item = Task> {
        let tasks = match op.kind {
            OpKind::Transfer { src_rank, dst_rank, op: r, .. } => {
                let prim = match r {
                    RecvOp::Recv => Prim::Recv,
                    RecvOp::RecvReduceCopy => Prim::RecvReduceCopy,
                };
                [Some(Task { op: id, rank: src_rank, prim: Prim::Send }), Some(Task { op: id, rank: dst_rank, prim })]
            }
            OpKind::Copy { rank, .. } => [Some(Task { op: id, rank, prim: Prim::Copy }), None],
            OpKind::Reduce { rank, .. } => [Some(Task { op: id, rank, prim: Prim::Reduce }), None],
        };
        tasks.into_iter().flatten()
    }

    /// The side (`0` or `1`, see [`Task::split`]) of `op`'s task on `rank`: a transfer runs on two
    /// different ranks, a local op on one.
    pub fn side_on(op: &Op, rank: Rank) -> usize {
        usize::from(op.is_transfer() && op.dst_rank() == rank)
    }
}

/// A link: the unit of communication conflict. Transfers on one `(src, dst, channel)` share a link;
/// local ops of one rank and channel share a (local) link.
#[derive(Copy, Clone, PartialEq, Eq, Hash, Debug)]
pub struct Link {
    /// The sending rank; for a local link, the rank itself.
    pub src: Rank,
    /// The receiving rank; equal to `src` for a local link.
    pub dst: Rank,
    /// The program channel of the link's ops.
    pub channel: u32,
    /// A local lane (copies and reductions), not a transfer link.
    pub local: bool,
    /// Source and destination are on different nodes.
    pub inter_node: bool,
}

/// The dependency graph: the op-level dependencies the schedulers use, which tasks of the two ops
/// each one joins, and the links.
///
/// Tasks are numbered in program order (a transfer's send right before its receive) and are not
/// stored: [`Task::split`] gives an op's tasks, [`Graph::tasks_of`] their ids. Task-level
/// dependencies are stored as op-level edges tagged with the sides they join
/// ([`Graph::pred_sides`]); [`Graph::task_preds`] expands them. This keeps the graph at about 30
/// bytes per op, which is what lets the 8192-GPU programs (134 M ops) compile in memory.
#[derive(Clone, Debug)]
pub struct Graph {
    /// `op_tasks[op] .. op_tasks[op + 1]`: the op's tasks (a transfer has two, send then receive);
    /// one entry per op plus the task count.
    pub op_tasks: Vec<TaskId>,
    /// Op-level dependencies: `op_preds.row(b)` holds, sorted, every op `a != b` that some task of
    /// `b` depends on (earlier ops; always tasks of one rank).
    pub op_preds: Csr,
    /// One entry per item of `op_preds`: bit `2*s + s2` is set when task `s` of the op (its side,
    /// see [`Task::split`]) depends on task `s2` of the producer.
    pub pred_sides: Vec<u8>,
    /// The transpose of `op_preds` (for the schedulers; the compiler drops it after `schedule`).
    pub op_succs: Csr,
    /// Every link, indexed by [`LinkId`], in the order ops first use them.
    pub links: Vec<Link>,
    /// The link of each op.
    pub link_of_op: Vec<LinkId>,
    /// Ranks per node used for the intra/inter-node distinction.
    pub ranks_per_node: Option<u32>,
}

impl Graph {
    /// The tasks of `op` (one or two).
    pub fn tasks_of(&self, op: OpId) -> std::ops::Range<usize> {
        self.op_tasks[op.index()].index()..self.op_tasks[op.index() + 1].index()
    }

    /// Number of tasks.
    pub fn task_count(&self) -> usize {
        self.op_tasks.last().map_or(0, |t| t.index())
    }

    /// Every task with its id, in order.
    pub fn tasks<'a>(&'a self, program: &'a Program) -> impl Iterator<Item = (TaskId, Task)> + 'a {
        program.ops.iter().enumerate().flat_map(move |(i, op)| {
            let first = self.op_tasks[i].index();
            Task::split(OpId::new(i), op).enumerate().map(move |(k, t)| (TaskId::new(first + k), t))
        })
    }

    /// The data dependencies of task `side` of `op`: earlier tasks of the same rank, ascending.
    pub fn task_preds(&self, op: OpId, side: usize) -> impl Iterator<Item = TaskId> + '_ {
        self.task_preds_in(self.pred_row(op), side)
    }

    /// Where `op`'s dependencies are in `op_preds.items` and `pred_sides`.
    #[inline]
    pub fn pred_row(&self, op: OpId) -> std::ops::Range<usize> {
        self.op_preds.start[op.index()] as usize..self.op_preds.start[op.index() + 1] as usize
    }

    /// [`Graph::task_preds`] of task `side` of the op whose [`Graph::pred_row`] is `row`.
    pub fn task_preds_in(&self, row: std::ops::Range<usize>, side: usize) -> impl Iterator<Item = TaskId> + '_ {
        self.op_preds.items[row.clone()].iter().zip(&self.pred_sides[row]).flat_map(move |(&p, &bits)| {
            let first = self.op_tasks[p as usize].0;
            (0..2u32).filter(move |&s2| bits & (1 << (2 * side as u32 + s2)) != 0).map(move |s2| TaskId(first + s2))
        })
    }

    /// Whether `op` crosses nodes.
    pub fn is_inter(&self, op: OpId) -> bool {
        self.links[self.link_of_op[op.index()].index()].inter_node
    }

    /// The text dump: one line per task with its op, its link (tasks on one link are the
    /// communication dependencies) and its data dependencies; then the links.
    pub fn dump(&self, program: &Program) -> String {
        let mut s = String::new();
        for (i, t) in self.tasks(program) {
            let op = program.op(t.op);
            let what = match (t.prim, op.kind) {
                (Prim::Send, OpKind::Transfer { src, dst_rank, channel, .. }) => {
                    format!("send {src} to {dst_rank} ch={channel}")
                }
                (_, OpKind::Transfer { dst, src_rank, channel, .. }) => {
                    format!("{} {dst} from {src_rank} ch={channel}", t.prim.name())
                }
                (_, k) => {
                    let (src, dst) = match k {
                        OpKind::Copy { src, dst, .. } | OpKind::Reduce { src, dst, .. } => (src, dst),
                        OpKind::Transfer { .. } => unreachable!(),
                    };
                    format!("{} {src} -> {dst}", t.prim.name())
                }
            };
            let side = i.index() - self.op_tasks[t.op.index()].index();
            let preds: Vec<String> = self.task_preds(t.op, side).map(|p| p.to_string()).collect();
            let link = self.link_of_op[t.op.index()];
            let _ = write!(s, "{i} = {} {what} ({}, {link})", t.rank, t.op);
            if !preds.is_empty() {
                let _ = write!(s, " after {}", preds.join(" "));
            }
            s.push('\n');
        }
        for (i, l) in self.links.iter().enumerate() {
            let kind = if l.local {
                "local"
            } else if l.inter_node {
                "inter"
            } else {
                "intra"
            };
            let _ = writeln!(s, "l{i} = {} -> {} ch={} {kind}", l.src, l.dst, l.channel);
        }
        s
    }
}

const NONE: u32 = u32::MAX;

/// Location bookkeeping for the walk: last writer and the readers since, per chunk. Tasks are
/// named `op * 2 + side` here, so the op of a dependency needs no lookup.
struct Locations {
    base: Vec<usize>,
    last_writer: Vec<u32>,
    reader_head: Vec<u32>,
    /// (reader, next) linked lists; the cells of a list a write clears go to the free list.
    pool: Vec<(u32, u32)>,
    free: u32,
}

impl Locations {
    fn new(program: &Program) -> Locations {
        let l = &program.layout;
        let mut base = Vec::with_capacity(l.ranks as usize + 1);
        let mut acc = 0usize;
        base.push(0);
        for r in 0..l.ranks {
            acc += l.storage_chunks(Rank(r)) as usize;
            base.push(acc);
        }
        Locations { base, last_writer: vec![NONE; acc], reader_head: vec![NONE; acc], pool: Vec::new(), free: NONE }
    }

    fn range(&self, program: &Program, rank: Rank, s: Slice) -> std::ops::Range<usize> {
        let a = self.base[rank.index()] + program.layout.resolve(rank, s).expect("verified program") as usize;
        a..a + s.count as usize
    }

    fn read(&mut self, task: u32, locs: std::ops::Range<usize>, preds: &mut Vec<u32>) {
        for loc in locs {
            let w = self.last_writer[loc];
            if w != NONE {
                preds.push(w);
            }
            let cell = (task, self.reader_head[loc]);
            let at = if self.free != NONE {
                let at = self.free;
                self.free = self.pool[at as usize].1;
                self.pool[at as usize] = cell;
                at
            } else {
                self.pool.push(cell);
                (self.pool.len() - 1) as u32
            };
            self.reader_head[loc] = at;
        }
    }

    fn write(&mut self, task: u32, locs: std::ops::Range<usize>, preds: &mut Vec<u32>) {
        for loc in locs {
            let w = self.last_writer[loc];
            if w != NONE {
                preds.push(w);
            }
            let mut r = self.reader_head[loc];
            while r != NONE {
                let (t, next) = self.pool[r as usize];
                preds.push(t);
                self.pool[r as usize].1 = self.free;
                self.free = r;
                r = next;
            }
            self.reader_head[loc] = NONE;
            self.last_writer[loc] = task;
        }
    }
}

/// The most ops a program may have: tasks are `u32` ids, two per transfer.
pub const MAX_OPS: usize = (u32::MAX / 2) as usize;

/// Runs the pass (after [`Program::verify`], which it repeats: the walk relies on every slice
/// resolving). `ranks_per_node` decides which links cross nodes (`None`: one node).
pub fn build(program: &Program, ranks_per_node: Option<u32>) -> Result<Graph, ProgramError> {
    program.verify()?;
    let nops = program.ops.len();
    if nops > MAX_OPS {
        return Err(ProgramError::BadLayout { reason: format!("{nops} ops is more than the supported {MAX_OPS}") });
    }
    let mut op_tasks = Vec::with_capacity(nops + 1);
    let mut ntasks = 0u32;
    let mut start = Vec::with_capacity(nops + 1);
    let mut items: Vec<u32> = Vec::with_capacity(nops * 2);
    let mut sides: Vec<u8> = Vec::with_capacity(nops * 2);
    start.push(0u32);
    let mut locs = Locations::new(program);
    // The dependencies of the op being walked, as `(producer op << 2) | (side << 1) | producer side`.
    let mut deps: Vec<u64> = Vec::new();
    let mut found: Vec<u32> = Vec::new();
    let mut link_ids: super::FastMap<(u32, u32, u32, bool), u32> = Default::default();
    let mut links = Vec::new();
    let mut link_of_op = Vec::with_capacity(nops);
    let node = |r: Rank| Program::node_of(r, ranks_per_node);

    // Moves the dependencies `found` for task `side` of op `b` into `deps` (named `op * 2 + side`,
    // see `Locations`), leaving out the task itself.
    let collect = |found: &mut Vec<u32>, deps: &mut Vec<u64>, b: u32, side: u32| {
        for &p in found.iter() {
            if p >> 1 != b {
                deps.push(((p as u64 >> 1) << 2) | ((side as u64) << 1) | (p as u64 & 1));
            }
        }
        found.clear();
    };

    for (i, op) in program.ops.iter().enumerate() {
        let b = i as u32;
        op_tasks.push(TaskId(ntasks));
        let key = match op.kind {
            OpKind::Transfer { src_rank, dst_rank, channel, src, dst, op: r } => {
                let range = locs.range(program, src_rank, src);
                locs.read(b * 2, range, &mut found);
                collect(&mut found, &mut deps, b, 0);
                let range = locs.range(program, dst_rank, dst);
                if r == RecvOp::RecvReduceCopy {
                    locs.read(b * 2 + 1, range.clone(), &mut found);
                }
                locs.write(b * 2 + 1, range, &mut found);
                collect(&mut found, &mut deps, b, 1);
                ntasks += 2;
                (src_rank.0, dst_rank.0, channel, false)
            }
            OpKind::Copy { rank, src, dst, .. } | OpKind::Reduce { rank, src, dst, .. } => {
                let reduce = matches!(op.kind, OpKind::Reduce { .. });
                let s = locs.range(program, rank, src);
                let d = locs.range(program, rank, dst);
                locs.read(b * 2, s, &mut found);
                if reduce {
                    locs.read(b * 2, d.clone(), &mut found);
                }
                locs.write(b * 2, d, &mut found);
                collect(&mut found, &mut deps, b, 0);
                ntasks += 1;
                (rank.0, rank.0, op.channel(), true)
            }
        };
        // One edge per producer op, tagged with the (side, producer side) pairs it joins.
        deps.sort_unstable();
        for &d in &deps {
            let (a, bit) = ((d >> 2) as u32, 1u8 << (d & 3));
            if items.len() > *start.last().expect("row start") as usize && *items.last().expect("item") == a {
                *sides.last_mut().expect("item") |= bit;
            } else {
                items.push(a);
                sides.push(bit);
            }
        }
        deps.clear();
        start.push(items.len() as u32);
        let next = links.len() as u32;
        let l = *link_ids.entry(key).or_insert(next);
        if l == next {
            let (s, d) = (Rank(key.0), Rank(key.1));
            links.push(Link { src: s, dst: d, channel: key.2, local: key.3, inter_node: node(s) != node(d) });
        }
        link_of_op.push(LinkId(l));
    }
    op_tasks.push(TaskId(ntasks));
    drop(locs);
    items.shrink_to_fit();
    sides.shrink_to_fit();
    let op_preds = Csr { start, items };
    let op_succs = op_preds.transpose(nops);
    Ok(Graph { op_tasks, op_preds, pred_sides: sides, op_succs, links, link_of_op, ranks_per_node })
}
