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
use crate::program::{OpId, OpKind, Program, ProgramError, Rank, RecvOp, Slice};
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
    pub op: OpId,
    pub rank: Rank,
    pub prim: Prim,
}

/// A link: the unit of communication conflict. Transfers on one `(src, dst, channel)` share a link;
/// local ops of one rank and channel share a (local) link.
#[derive(Copy, Clone, PartialEq, Eq, Hash, Debug)]
pub struct Link {
    pub src: Rank,
    pub dst: Rank,
    pub channel: u32,
    /// A local lane (copies and reductions), not a transfer link.
    pub local: bool,
    /// Source and destination are on different nodes.
    pub inter_node: bool,
}

/// The dependency graph: tasks, their data dependencies, and the op-level view the schedulers use.
#[derive(Clone, Debug)]
pub struct Graph {
    /// Tasks in program order; a transfer's send comes right before its receive.
    pub tasks: Vec<Task>,
    /// `op_tasks[op]`: the op's first task (a transfer has two, send then receive).
    pub op_tasks: Vec<TaskId>,
    /// Data dependencies of each task (earlier tasks of the same rank), sorted, deduplicated.
    pub preds: Csr,
    /// Op-level dependencies: `op_preds.row(b)` holds every op `a != b` that some task of `b`
    /// depends on.
    pub op_preds: Csr,
    /// The transpose of `op_preds`.
    pub op_succs: Csr,
    pub links: Vec<Link>,
    /// The link of each op.
    pub link_of_op: Vec<LinkId>,
    /// Ranks per node used for the intra/inter-node distinction.
    pub ranks_per_node: Option<u32>,
}

impl Graph {
    /// The tasks of `op` (one or two).
    pub fn tasks_of(&self, op: OpId) -> std::ops::Range<usize> {
        let a = self.op_tasks[op.index()].index();
        let b = self.op_tasks.get(op.index() + 1).map(|t| t.index()).unwrap_or(self.tasks.len());
        a..b
    }

    /// Whether `op` crosses nodes.
    pub fn is_inter(&self, op: OpId) -> bool {
        self.links[self.link_of_op[op.index()].index()].inter_node
    }

    /// The text dump: one line per task with its op, its link (tasks on one link are the
    /// communication dependencies) and its data dependencies; then the links.
    pub fn dump(&self, program: &Program) -> String {
        let mut s = String::new();
        for (i, t) in self.tasks.iter().enumerate() {
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
            let preds: Vec<String> = self.preds.row(i).iter().map(|p| format!("t{p}")).collect();
            let link = self.link_of_op[t.op.index()];
            let _ = write!(s, "t{i} = {} {what} ({}, {link})", t.rank, t.op);
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

/// Location bookkeeping for the walk: last writer and the readers since, per chunk.
struct Locations {
    base: Vec<usize>,
    last_writer: Vec<u32>,
    reader_head: Vec<u32>,
    /// (reader task, next) linked lists.
    pool: Vec<(u32, u32)>,
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
        Locations { base, last_writer: vec![NONE; acc], reader_head: vec![NONE; acc], pool: Vec::new() }
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
            self.pool.push((task, self.reader_head[loc]));
            self.reader_head[loc] = (self.pool.len() - 1) as u32;
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
                r = next;
            }
            self.reader_head[loc] = NONE;
            self.last_writer[loc] = task;
        }
    }
}

/// Runs the pass (after [`Program::verify`], which it repeats: the walk relies on every slice
/// resolving). `ranks_per_node` decides which links cross nodes (`None`: one node).
pub fn build(program: &Program, ranks_per_node: Option<u32>) -> Result<Graph, ProgramError> {
    program.verify()?;
    let nops = program.ops.len();
    let mut tasks = Vec::with_capacity(nops * 2);
    let mut op_tasks = Vec::with_capacity(nops);
    let mut start = Vec::with_capacity(nops * 2 + 1);
    let mut items: Vec<u32> = Vec::with_capacity(nops * 2);
    start.push(0u32);
    let mut locs = Locations::new(program);
    let mut buf: Vec<u32> = Vec::new();
    let mut link_ids: super::FastMap<(u32, u32, u32, bool), u32> = Default::default();
    let mut links = Vec::new();
    let mut link_of_op = Vec::with_capacity(nops);
    let node = |r: Rank| Program::node_of(r, ranks_per_node);

    let finish = |buf: &mut Vec<u32>, items: &mut Vec<u32>, start: &mut Vec<u32>, me: u32| {
        buf.sort_unstable();
        buf.dedup();
        buf.retain(|&p| p != me);
        items.extend_from_slice(buf);
        start.push(items.len() as u32);
        buf.clear();
    };

    for (i, op) in program.ops.iter().enumerate() {
        let id = OpId::new(i);
        op_tasks.push(TaskId::new(tasks.len()));
        let key = match op.kind {
            OpKind::Transfer { src_rank, dst_rank, channel, src, dst, op: r } => {
                let t = tasks.len() as u32;
                tasks.push(Task { op: id, rank: src_rank, prim: Prim::Send });
                let range = locs.range(program, src_rank, src);
                locs.read(t, range, &mut buf);
                finish(&mut buf, &mut items, &mut start, t);

                let t = tasks.len() as u32;
                let prim = match r {
                    RecvOp::Recv => Prim::Recv,
                    RecvOp::RecvReduceCopy => Prim::RecvReduceCopy,
                };
                tasks.push(Task { op: id, rank: dst_rank, prim });
                let range = locs.range(program, dst_rank, dst);
                if prim == Prim::RecvReduceCopy {
                    locs.read(t, range.clone(), &mut buf);
                }
                locs.write(t, range, &mut buf);
                finish(&mut buf, &mut items, &mut start, t);
                (src_rank.0, dst_rank.0, channel, false)
            }
            OpKind::Copy { rank, src, dst, .. } | OpKind::Reduce { rank, src, dst, .. } => {
                let reduce = matches!(op.kind, OpKind::Reduce { .. });
                let t = tasks.len() as u32;
                tasks.push(Task { op: id, rank, prim: if reduce { Prim::Reduce } else { Prim::Copy } });
                let s = locs.range(program, rank, src);
                let d = locs.range(program, rank, dst);
                locs.read(t, s, &mut buf);
                if reduce {
                    locs.read(t, d.clone(), &mut buf);
                }
                locs.write(t, d, &mut buf);
                finish(&mut buf, &mut items, &mut start, t);
                (rank.0, rank.0, op.channel(), true)
            }
        };
        let next = links.len() as u32;
        let l = *link_ids.entry(key).or_insert(next);
        if l == next {
            let (s, d) = (Rank(key.0), Rank(key.1));
            links.push(Link { src: s, dst: d, channel: key.2, local: key.3, inter_node: node(s) != node(d) });
        }
        link_of_op.push(LinkId(l));
    }
    let preds = Csr { start, items };

    // Op-level dependencies.
    let mut ostart = Vec::with_capacity(nops + 1);
    let mut oitems = Vec::with_capacity(preds.items.len());
    ostart.push(0u32);
    for i in 0..nops {
        let a = op_tasks[i].index();
        let b = op_tasks.get(i + 1).map(|t| t.index()).unwrap_or(tasks.len());
        for t in a..b {
            for &p in preds.row(t) {
                let po = tasks[p as usize].op.0;
                if po != i as u32 {
                    buf.push(po);
                }
            }
        }
        buf.sort_unstable();
        buf.dedup();
        oitems.extend_from_slice(&buf);
        buf.clear();
        ostart.push(oitems.len() as u32);
    }
    let op_preds = Csr { start: ostart, items: oitems };
    let op_succs = op_preds.transpose(nops);
    Ok(Graph { tasks, op_tasks, preds, op_preds, op_succs, links, link_of_op, ranks_per_node })
}
