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
//!
//! ## What is kept
//!
//! The schedulers need op-level dependencies only: [`Graph`] keeps, per op, its successors, the
//! number of its producers, its link and its chunk, about 17 bytes per op. Task-level dependencies
//! are recomputed where they are needed, one rank at a time ([`Locations::one_rank`] over that
//! rank's tasks, in schedule order: any topological order of the dependencies finds the same
//! producers, since it keeps each location's writes in order and its reads between the same
//! writes), or for dumps over the whole program ([`task_preds`]). This is what lets the 8192-GPU
//! programs (134 M ops) compile in a few GB.
//!
//! Dependencies are between tasks of one rank, so the walk splits the ranks over threads
//! ([`build`]).

use super::memory::{self, TooLarge};
use super::{CompileError, Csr, FastMap, LinkId, OpSource, TaskId};
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

    /// The primitive of `op`'s task on side `side`.
    pub fn prim_of(op: &Op, side: usize) -> Prim {
        match op.kind {
            OpKind::Transfer { .. } if side == 0 => Prim::Send,
            OpKind::Transfer { op: RecvOp::Recv, .. } => Prim::Recv,
            OpKind::Transfer { op: RecvOp::RecvReduceCopy, .. } => Prim::RecvReduceCopy,
            OpKind::Copy { .. } => Prim::Copy,
            OpKind::Reduce { .. } => Prim::Reduce,
        }
    }

    /// Number of tasks of `op`: two for a transfer, one for a local op.
    pub fn count(op: &Op) -> usize {
        1 + usize::from(op.is_transfer())
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

/// What identifies `op`'s link: `(src, dst, channel, local)`.
#[inline]
pub fn link_key(op: &Op) -> (u32, u32, u32, bool) {
    (op.src_rank().0, op.dst_rank().0, op.channel(), !op.is_transfer())
}

/// Whether `op` crosses nodes when `ranks_per_node` ranks share one (`None`: one node).
#[inline]
pub fn is_inter(op: &Op, ranks_per_node: Option<u32>) -> bool {
    Program::node_of(op.src_rank(), ranks_per_node) != Program::node_of(op.dst_rank(), ranks_per_node)
}

/// One of a rank's few links: `(dst, channel, local, id)`.
type FewLink = (u32, u32, bool, u32);

/// The links of a program, numbered in the order ops first use them, and looked up from an op's
/// ranks and channel: per source rank a short list searched in order (a rank has a few links in
/// the generated programs), hashed once a rank has many.
#[derive(Clone, Debug, Default)]
pub struct LinkTable {
    /// Every link, by id.
    pub links: Vec<Link>,
    /// Per source rank, `(dst, channel, local, id)` of its links while they are few; `None` once
    /// they are in `many`.
    few: Vec<Option<Vec<FewLink>>>,
    many: FastMap<(u32, u32, u32, bool), u32>,
}

/// Links a rank keeps in its short list before they are hashed.
const FEW_LINKS: usize = 24;

impl LinkTable {
    /// An empty table for `ranks` ranks.
    pub fn new(ranks: u32) -> LinkTable {
        LinkTable { links: Vec::new(), few: vec![Some(Vec::new()); ranks as usize], many: Default::default() }
    }

    /// The id of `op`'s link, if it has one.
    #[inline]
    pub fn get(&self, op: &Op) -> Option<u32> {
        let (s, d, c, local) = link_key(op);
        match self.few.get(s as usize)? {
            Some(v) => v.iter().find(|e| (e.0, e.1, e.2) == (d, c, local)).map(|e| e.3),
            None => self.many.get(&(s, d, c, local)).copied(),
        }
    }

    /// The id of `op`'s link, numbering it if it is new (`ranks_per_node` says whether it crosses
    /// nodes). `op`'s source rank is below the table's rank count.
    #[inline]
    pub fn intern(&mut self, op: &Op, ranks_per_node: Option<u32>) -> u32 {
        if let Some(l) = self.get(op) {
            return l;
        }
        let (s, d, c, local) = link_key(op);
        let id = self.links.len() as u32;
        self.links.push(Link {
            src: Rank(s),
            dst: Rank(d),
            channel: c,
            local,
            inter_node: is_inter(op, ranks_per_node),
        });
        match &mut self.few[s as usize] {
            Some(v) if v.len() < FEW_LINKS => v.push((d, c, local, id)),
            slot => {
                for (d, c, local, l) in slot.take().into_iter().flatten() {
                    self.many.insert((s, d, c, local), l);
                }
                self.many.insert((s, d, c, local), id);
            }
        }
        id
    }
}

/// A dense id per op, in the narrowest of `u16` and `u32` that holds every id.
#[derive(Clone, Debug)]
pub enum Dense {
    /// Ids below 2^16.
    U16(Vec<u16>),
    /// Any ids.
    U32(Vec<u32>),
}

impl Dense {
    /// Id of op `i`.
    #[inline]
    pub fn get(&self, i: usize) -> u32 {
        match self {
            Dense::U16(v) => v[i] as u32,
            Dense::U32(v) => v[i],
        }
    }
    fn push(&mut self, x: u32) {
        match self {
            Dense::U16(v) => v.push(x as u16),
            Dense::U32(v) => v.push(x),
        }
    }
    /// `n` ids below `bound`, with room allocated fallibly.
    fn with_capacity(n: usize, bound: u64, what: &str) -> Result<Dense, TooLarge> {
        Ok(if bound <= 1 << 16 { Dense::U16(memory::try_vec(n, what)?) } else { Dense::U32(memory::try_vec(n, what)?) })
    }
}

/// Dense chunk ids, in the order ops first name the chunks (what the schedulers' queues compare).
struct ChunkIds {
    /// Label → id + 1 (0: unseen), when labels are small enough for a table.
    table: Vec<u32>,
    /// Label → id otherwise.
    map: FastMap<u32, u32>,
    count: u32,
}

impl ChunkIds {
    /// A numbering for labels up to `max` in a program of `ops` ops.
    fn new(max: u32, ops: usize) -> ChunkIds {
        // A table when it is no larger than a few bytes per op.
        let table = if (max as usize) < (ops * 2).max(1 << 16) { vec![0u32; max as usize + 1] } else { Vec::new() };
        ChunkIds { table, map: Default::default(), count: 0 }
    }

    #[inline]
    fn intern(&mut self, label: u32) -> u32 {
        if self.table.is_empty() {
            let next = self.count;
            let id = *self.map.entry(label).or_insert(next);
            if id == next {
                self.count += 1;
            }
            id
        } else {
            if self.table[label as usize] == 0 {
                self.count += 1;
                self.table[label as usize] = self.count;
            }
            self.table[label as usize] - 1
        }
    }
}

/// The dependency graph at op level, and each op's link and chunk: what the schedulers use.
///
/// Tasks are numbered in program order (a transfer's send right before its receive) and are not
/// stored: [`Task::split`] gives an op's tasks. Task-level dependencies are not stored either
/// (see the [module documentation](self)).
#[derive(Clone, Debug)]
pub struct Graph {
    /// Number of ops.
    pub ops: usize,
    /// Number of tasks.
    pub tasks: usize,
    /// Op-level dependencies, forwards: `op_succs.row(a)` holds, non-decreasing, every later op
    /// with a task that depends on a task of `a` (always on a rank the two ops share). When the
    /// walk runs on several threads, an op both of whose tasks depend on `a` and whose tasks two
    /// threads walked is listed twice (and counted twice in `pred_counts`): the schedulers count
    /// occurrences, so this changes nothing they do.
    pub op_succs: Csr,
    /// Per op, the number of times it is listed as a successor, 255 standing for "255 or more,
    /// see `pred_overflow`".
    pred_counts: Vec<u8>,
    /// The producer counts of 255 and more.
    pred_overflow: FastMap<u32, u32>,
    /// Every link, in the order ops first use them, and their look-up.
    pub links: LinkTable,
    /// The link of each op (the compiler drops it once the plan's tasks are grouped by rank).
    pub link_of_op: Vec<u32>,
    /// The chunk of each op, numbered densely in the order ops first name chunks (for the
    /// schedulers; the compiler drops it after `schedule`).
    pub chunk_of_op: Dense,
    /// Number of distinct chunks.
    pub chunks: u32,
    /// Ranks per node used for the intra/inter-node distinction.
    pub ranks_per_node: Option<u32>,
}

impl Graph {
    /// Number of tasks.
    pub fn task_count(&self) -> usize {
        self.tasks
    }

    /// The number of times `op` is listed as a successor (see [`Graph::op_succs`]).
    #[inline]
    pub fn pred_count(&self, op: usize) -> u32 {
        match self.pred_counts[op] {
            255 => self.pred_overflow[&(op as u32)],
            c => c as u32,
        }
    }

    /// Per op, the number of ops it depends on, as the schedulers count them down: a byte per op,
    /// 255 meaning "look in the map".
    pub(crate) fn pending(&self) -> Result<(Vec<u8>, FastMap<u32, u32>), TooLarge> {
        let mut v = memory::try_vec(self.ops, "the schedulers' producer counts")?;
        v.extend_from_slice(&self.pred_counts);
        Ok((v, self.pred_overflow.clone()))
    }

    /// Bytes the graph's tables take (their allocations).
    pub fn heap_bytes(&self) -> u64 {
        let chunks = match &self.chunk_of_op {
            Dense::U16(v) => v.capacity() * 2,
            Dense::U32(v) => v.capacity() * 4,
        };
        (self.op_succs.start.capacity() * 4
            + self.op_succs.items.capacity() * 4
            + self.pred_counts.capacity()
            + self.pred_overflow.capacity() * 16
            + self.links.links.capacity() * std::mem::size_of::<Link>()
            + self.links.many.capacity() * 24
            + self.links.few.len() * 32
            + self.link_of_op.capacity() * 4
            + chunks) as u64
    }

    /// Number of entries of [`Graph::chunk_of_op`].
    pub fn chunk_of_op_len(&self) -> usize {
        match &self.chunk_of_op {
            Dense::U16(v) => v.len(),
            Dense::U32(v) => v.len(),
        }
    }

    /// Whether `op` crosses nodes.
    pub fn is_inter(&self, op: &Op) -> bool {
        is_inter(op, self.ranks_per_node)
    }

    /// The text dump: one line per task with its op, its link (tasks on one link are the
    /// communication dependencies) and its data dependencies; then the links.
    pub fn dump(&self, src: &impl OpSource) -> String {
        let preds = task_preds(src).expect("a graph was built from this program");
        let mut s = String::new();
        let mut t = 0usize;
        let _ = src.try_for_each_op(|id, op| -> Result<(), ()> {
            for task in Task::split(id, op) {
                let what = match (task.prim, op.kind) {
                    (Prim::Send, OpKind::Transfer { src, dst_rank, channel, .. }) => {
                        format!("send {src} to {dst_rank} ch={channel}")
                    }
                    (_, OpKind::Transfer { dst, src_rank, channel, .. }) => {
                        format!("{} {dst} from {src_rank} ch={channel}", task.prim.name())
                    }
                    (_, OpKind::Copy { src, dst, .. } | OpKind::Reduce { src, dst, .. }) => {
                        format!("{} {src} -> {dst}", task.prim.name())
                    }
                };
                let after: Vec<String> = preds.row(t).iter().map(|p| TaskId(*p).to_string()).collect();
                let link = LinkId(self.link_of_op[id.index()]);
                let _ = write!(s, "{} = {} {what} ({}, {link})", TaskId::new(t), task.rank, id);
                if !after.is_empty() {
                    let _ = write!(s, " after {}", after.join(" "));
                }
                s.push('\n');
                t += 1;
            }
            Ok(())
        });
        for (i, l) in self.links.links.iter().enumerate() {
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

/// Location bookkeeping for a dependency walk: last writer and the readers since, per chunk of
/// each rank's storage. Tasks are named by the caller (any `u32` but `u32::MAX`).
pub struct Locations {
    base: Vec<usize>,
    /// Per location: its last writer and the head of its reader list.
    at: Vec<Loc>,
    /// (reader, next) linked lists; the cells of a list a write clears go to the free list.
    pool: Vec<(u32, u32)>,
    free: u32,
}

/// One location's accesses (see [`Locations`]).
#[derive(Copy, Clone)]
struct Loc {
    writer: u32,
    readers: u32,
}

const UNTOUCHED: Loc = Loc { writer: NONE, readers: NONE };

impl Locations {
    /// Locations for every rank of `src`'s layout.
    pub fn new(layout: &crate::program::BufferLayout) -> Result<Locations, TooLarge> {
        let mut base = Vec::with_capacity(layout.ranks as usize + 1);
        let mut acc = 0usize;
        base.push(0);
        for r in 0..layout.ranks {
            acc += layout.storage_chunks(Rank(r)) as usize;
            base.push(acc);
        }
        Ok(Locations {
            base,
            at: memory::try_filled(acc, UNTOUCHED, "the dependency walk's locations")?,
            pool: Vec::new(),
            free: NONE,
        })
    }

    /// Locations for the ranks `ranks` of `layout` (rank `r` at base `r - ranks.start`).
    pub fn for_ranks(
        layout: &crate::program::BufferLayout,
        ranks: std::ops::Range<u32>,
    ) -> Result<Locations, TooLarge> {
        let mut base = Vec::with_capacity(ranks.len() + 1);
        let mut acc = 0usize;
        base.push(0);
        for r in ranks {
            acc += layout.storage_chunks(Rank(r)) as usize;
            base.push(acc);
        }
        Ok(Locations {
            base,
            at: memory::try_filled(acc, UNTOUCHED, "the dependency walk's locations")?,
            pool: Vec::new(),
            free: NONE,
        })
    }

    /// Locations for one rank's storage of `chunks` chunks (base 0), for walks rank by rank.
    pub fn one_rank(chunks: u32) -> Result<Locations, TooLarge> {
        let n = chunks as usize;
        Ok(Locations {
            base: vec![0, n],
            at: memory::try_filled(n, UNTOUCHED, "a rank's dependency walk")?,
            pool: Vec::new(),
            free: NONE,
        })
    }

    /// Forgets every access, keeping one rank's storage of `chunks` chunks (see
    /// [`Locations::one_rank`]).
    pub fn reset_one_rank(&mut self, chunks: u32) {
        let n = chunks as usize;
        self.base.clear();
        self.base.extend([0, n]);
        self.at.clear();
        self.at.resize(n, UNTOUCHED);
        self.pool.clear();
        self.free = NONE;
    }

    /// The locations `s` covers on `rank` (`rank` is 0 for a one-rank walk), or `None` when it does
    /// not fit the rank's buffers.
    #[inline]
    pub fn range(
        &self,
        layout: &crate::program::BufferLayout,
        rank: Rank,
        at: Rank,
        s: Slice,
    ) -> Option<std::ops::Range<usize>> {
        let a = self.base[at.index()] + layout.resolve(rank, s)? as usize;
        Some(a..a + s.count as usize)
    }

    /// `task` reads `locs`: their last writers go to `preds`.
    pub fn read(&mut self, task: u32, locs: std::ops::Range<usize>, preds: &mut Vec<u32>) -> Result<(), TooLarge> {
        for loc in locs {
            let Loc { writer, readers } = self.at[loc];
            if writer != NONE {
                preds.push(writer);
            }
            let cell = (task, readers);
            let at = if self.free != NONE {
                let c = self.free;
                self.free = self.pool[c as usize].1;
                self.pool[c as usize] = cell;
                c
            } else {
                if self.pool.len() == self.pool.capacity() {
                    let more = self.pool.len().max(1 << 10);
                    self.pool.try_reserve(more).map_err(|_| TooLarge {
                        request: "the dependency walk's reader lists".into(),
                        needed: ((self.pool.len() + more) * 8) as u64,
                        limit: None,
                    })?;
                }
                self.pool.push(cell);
                (self.pool.len() - 1) as u32
            };
            self.at[loc].readers = at;
        }
        Ok(())
    }

    /// `task` writes `locs`: their last writers and readers since go to `preds`.
    pub fn write(&mut self, task: u32, locs: std::ops::Range<usize>, preds: &mut Vec<u32>) {
        for loc in locs {
            let Loc { writer, readers } = self.at[loc];
            if writer != NONE {
                preds.push(writer);
            }
            let mut r = readers;
            while r != NONE {
                let (t, next) = self.pool[r as usize];
                preds.push(t);
                self.pool[r as usize].1 = self.free;
                self.free = r;
                r = next;
            }
            self.at[loc] = Loc { writer: task, readers: NONE };
        }
    }

    /// Walks task `side` of `op` (named `task`) as the table of the module documentation says,
    /// its rank's storage at `at` (the rank itself, or 0 for a one-rank walk); `preds` gets the
    /// tasks it depends on, possibly with repeats and with `task` itself.
    pub fn task(
        &mut self,
        layout: &crate::program::BufferLayout,
        op: &Op,
        side: usize,
        at: Rank,
        task: u32,
        preds: &mut Vec<u32>,
    ) -> Result<(), CompileError> {
        let bad = |rank: Rank, slice: Slice| {
            CompileError::Program(ProgramError::SliceOutOfRange {
                op: OpId(NONE),
                rank,
                slice,
                buffer_chunks: if rank.0 < layout.ranks { layout.buffer_chunks(rank, slice.buffer) } else { 0 },
            })
        };
        let range = |rank: Rank, s: Slice| self.range(layout, rank, at, s).ok_or_else(|| bad(rank, s));
        match op.kind {
            OpKind::Transfer { src_rank, src, .. } if side == 0 => {
                let r = range(src_rank, src)?;
                self.read(task, r, preds)?;
            }
            // A destination that is read and written (a reduction's) finds no more producers
            // than one that is only written: its write finds the same last writers, and the
            // readers since, besides the task itself.
            OpKind::Transfer { dst_rank, dst, .. } => {
                let r = range(dst_rank, dst)?;
                self.write(task, r, preds);
            }
            OpKind::Copy { rank, src, dst, .. } | OpKind::Reduce { rank, src, dst, .. } => {
                let (s, d) = (range(rank, src)?, range(rank, dst)?);
                self.read(task, s, preds)?;
                self.write(task, d, preds);
            }
        }
        Ok(())
    }
}

/// The most ops a program may have: tasks are `u32` ids, two per transfer.
pub const MAX_OPS: usize = (u32::MAX / 2) as usize;

/// Bytes [`build`] holds at its peak for `ops` ops with `edges` op-level dependencies, whose
/// sources read `reads` chunks, on a storage of `locations` chunk locations over all ranks, with
/// chunk ids `chunk_bytes` wide: the
/// walk over `threads` threads (the locations, a reader cell per read not yet overwritten, the
/// dependencies found, a count per op and thread) beside each op's link, then the transpose
/// (dependencies and successors side by side), then the graph ([`graph_bytes`]); the link table
/// aside.
pub fn estimate_bytes(ops: u64, edges: u64, reads: u64, locations: u64, chunk_bytes: u64, threads: u64) -> u64 {
    let walk = locations * 8 + reads * 8 + edges * 4 + ops * threads;
    let (walk, transpose) = (walk + ops * 4, edges * 8 + ops * (threads + 9));
    walk.max(transpose).max(graph_bytes(ops, edges, chunk_bytes))
}

/// Bytes of a [`Graph`] of `ops` ops and `edges` dependencies, its chunk ids `chunk_bytes` wide
/// ([`Dense`]): successors, producer counts, and each op's link and chunk (the link table aside).
pub fn graph_bytes(ops: u64, edges: u64, chunk_bytes: u64) -> u64 {
    ops * 4 + edges * 4 + ops + ops * 4 + ops * chunk_bytes
}

/// The producers of every task, as a CSR indexed by task id with task ids as items, ascending: the
/// program-order walk of the module documentation, for dumps and checks of small programs.
pub fn task_preds(src: &impl OpSource) -> Result<Csr, CompileError> {
    let layout = src.layout();
    let mut locs = Locations::new(layout)?;
    let mut csr = Csr { start: vec![0], items: Vec::new() };
    let mut found = Vec::new();
    let mut t = 0u32;
    src.try_for_each_op(|id, op| {
        let first = t;
        for side in 0..Task::count(op) {
            let rank = if side == 0 { op.src_rank() } else { op.dst_rank() };
            locs.task(layout, op, side, rank, t, &mut found).map_err(|e| with_op(e, id))?;
            found.retain(|&p| p < first);
            found.sort_unstable();
            found.dedup();
            csr.items.append(&mut found);
            csr.start.push(csr.items.len() as u32);
            t += 1;
        }
        Ok::<(), CompileError>(())
    })?;
    Ok(csr)
}

/// Names `id` in a slice error found by the walk.
fn with_op(e: CompileError, id: OpId) -> CompileError {
    match e {
        CompileError::Program(ProgramError::SliceOutOfRange { rank, slice, buffer_chunks, .. }) => {
            CompileError::Program(ProgramError::SliceOutOfRange { op: id, rank, slice, buffer_chunks })
        }
        e => e,
    }
}

/// One thread's share of the walk: the producers its ranks' tasks find, per op.
struct Part {
    /// Per op, the number of its producers this part found (255: see `overflow`).
    counts: Vec<u8>,
    overflow: FastMap<u32, u32>,
    /// The producers, op by op, each op's sorted.
    items: Vec<u32>,
}

impl Part {
    #[inline]
    fn count(&self, op: usize) -> usize {
        match self.counts[op] {
            255 => self.overflow[&(op as u32)] as usize,
            c => c as usize,
        }
    }
}

/// The first error of a part of the walk, in program order: (op, which check, error), the rank
/// check before the slices of side 0 and side 1.
type Failure = (u32, u8, CompileError);

/// Walks the tasks on `ranks` over the whole program (see the module documentation), and with
/// `check_ranks` checks every op's ranks; room for `reserve` dependencies is allocated first.
fn walk_part(
    src: &impl OpSource,
    ranks: std::ops::Range<u32>,
    check_ranks: bool,
    reserve: usize,
) -> Result<Part, Failure> {
    let layout = src.layout();
    let nops = src.op_count();
    let at_start = |e: TooLarge| (0, 0, CompileError::TooLarge(e));
    let mut locs = Locations::for_ranks(layout, ranks.clone()).map_err(at_start)?;
    let mut part = Part {
        counts: memory::try_vec(nops, "the dependency graph's producer counts").map_err(at_start)?,
        overflow: Default::default(),
        items: memory::try_vec(reserve, "the dependency graph").map_err(at_start)?,
    };
    let mut found: Vec<u32> = Vec::new();
    let mut deps: Vec<u32> = Vec::new();
    let n = layout.ranks;
    src.try_for_each_op(|id, op| -> Result<(), Failure> {
        let b = id.0;
        let (s, d) = (op.src_rank(), op.dst_rank());
        if check_ranks {
            for r in [s, d] {
                if r.0 >= n {
                    return Err((b, 0, ProgramError::RankOutOfRange { op: id, rank: r.0, ranks: n }.into()));
                }
            }
        }
        // Tasks are named `op * 2 + side` here, so the op of a dependency is a shift away.
        for side in 0..Task::count(op) {
            let rank = if side == 0 { s } else { d };
            if !ranks.contains(&rank.0) {
                continue;
            }
            let at = Rank(rank.0 - ranks.start);
            locs.task(layout, op, side, at, b * 2 + side as u32, &mut found)
                .map_err(|e| (b, 1 + side as u8, with_op(e, id)))?;
            deps.extend(found.drain(..).map(|p| p >> 1).filter(|&a| a != b));
        }
        deps.sort_unstable();
        deps.dedup();
        let items = &mut part.items;
        if items.capacity() - items.len() < deps.len() {
            let more = items.len().max(deps.len());
            items.try_reserve(more).map_err(|_| {
                let needed = ((items.len() + more) * 4) as u64;
                (b, 0, CompileError::TooLarge(TooLarge { request: "the dependency graph".into(), needed, limit: None }))
            })?;
        }
        items.extend_from_slice(&deps);
        if deps.len() >= 255 {
            part.overflow.insert(b, deps.len() as u32);
        }
        part.counts.push(deps.len().min(255) as u8);
        deps.clear();
        Ok(())
    })?;
    Ok(part)
}

/// Runs the pass (after [`OpSource::verify`]; the walk checks ranks and slices itself, so a source
/// that skips checks still gets typed errors). `ranks_per_node` decides which links cross nodes
/// (`None`: one node). Its tables are allocated fallibly; [`estimate_bytes`] says how large they
/// get, for a check before.
///
/// The walk is split over up to `threads` threads by ranks (a task's dependencies are on its own
/// rank): each walks the whole program for the tasks of its ranks; the successor lists are built
/// from all of their findings. The links of the ops are numbered beside the walk, their chunks
/// last.
pub fn build(src: &impl OpSource, ranks_per_node: Option<u32>, threads: usize) -> Result<Graph, CompileError> {
    src.verify()?;
    let nops = src.op_count();
    if nops > MAX_OPS {
        return Err(
            ProgramError::BadLayout { reason: format!("{nops} ops is more than the supported {MAX_OPS}") }.into()
        );
    }
    let ranks = src.layout().ranks;
    let t = threads.clamp(1, MAX_WALK_THREADS).min(ranks.max(1) as usize) as u32;
    let range = |k: u32| (ranks as u64 * k as u64 / t as u64) as u32..(ranks as u64 * (k as u64 + 1) / t as u64) as u32;
    // The links are numbered beside the walk (on a thread of their own when there are threads).
    let (results, numbered) = std::thread::scope(|scope| {
        let numbering = (threads > 1).then(|| scope.spawn(|| number_links(src, ranks_per_node)));
        let reserve = nops * 2 / t as usize;
        let others: Vec<_> = (1..t).map(|k| scope.spawn(move || walk_part(src, range(k), false, reserve))).collect();
        let mut results: Vec<Result<Part, Failure>> = vec![walk_part(src, range(0), true, reserve)];
        results.extend(others.into_iter().map(|h| h.join().expect("a walk thread panicked")));
        let numbered = match numbering {
            Some(h) => h.join().expect("the link numbering panicked"),
            None => number_links(src, ranks_per_node),
        };
        (results, numbered)
    });
    let mut parts = Vec::with_capacity(results.len());
    let mut first: Option<Failure> = None;
    for r in results {
        match r {
            Ok(p) => parts.push(p),
            Err(f) => {
                if first.as_ref().is_none_or(|g| (f.0, f.1) < (g.0, g.1)) {
                    first = Some(f);
                }
            }
        }
    }
    if let Some((_, _, e)) = first {
        return Err(e);
    }
    // Each op's producer count over the parts (a producer two parts found for the op's two tasks
    // counts twice, and is listed twice among its successors).
    let summed = if parts.len() == 1 {
        None
    } else {
        let mut counts: Vec<u8> = memory::try_vec(nops, "the dependency graph's producer counts")?;
        let mut overflow: FastMap<u32, u32> = Default::default();
        counts.extend((0..nops).map(|b| {
            let c: usize = if parts.iter().any(|p| p.counts[b] == 255) {
                parts.iter().map(|p| p.count(b)).sum()
            } else {
                parts.iter().map(|p| p.counts[b] as usize).sum()
            };
            if c >= 255 {
                overflow.insert(b as u32, c as u32);
            }
            c.min(255) as u8
        }));
        Some((counts, overflow))
    };
    let edges: usize = parts.iter().map(|p| p.items.len()).sum();
    if edges > u32::MAX as usize {
        return Err(ProgramError::BadLayout { reason: format!("{edges} dependencies are more than 2^32") }.into());
    }
    // The transpose, then (the walk's tables gone) each op's link and chunk.
    let (start, succ) = transpose(nops, &parts, threads)?;
    let (counts, overflow) = match summed {
        Some(c) => c,
        None => {
            let p = parts.pop().expect("one part");
            (p.counts, p.overflow)
        }
    };
    drop(parts);
    let (links, link_of_op, transfers) = numbered?;
    let (chunk_of_op, chunks) = number_chunks(src)?;
    Ok(Graph {
        ops: nops,
        tasks: nops + transfers,
        op_succs: Csr { start, items: succ },
        pred_counts: counts,
        pred_overflow: overflow,
        links,
        link_of_op,
        chunk_of_op,
        chunks,
        ranks_per_node,
    })
}

/// Threads the dependency walk uses at most (each keeps a byte per op).
pub const MAX_WALK_THREADS: usize = 4;

/// The successors from the parts' producers (each part's op by op): `start[a]` counts `a`'s
/// successors, then sums up to its row's end, then is moved back to its start while the rows are
/// filled from their ends, walking the ops backwards. Rows come out non-decreasing (a successor is
/// listed once per part that found the dependency). Up to `threads` threads each own a range of
/// rows (their counts and their part of the successors) and read every part.
fn transpose(nops: usize, parts: &[Part], threads: usize) -> Result<(Vec<u32>, Vec<u32>), TooLarge> {
    let edges: usize = parts.iter().map(|p| p.items.len()).sum();
    let mut start: Vec<u32> = memory::try_filled(nops + 1, 0u32, "the dependency graph's successors")?;
    let t = threads.clamp(1, MAX_WALK_THREADS).min(nops.max(1));
    let cuts: Vec<usize> = (0..=t).map(|k| nops * k / t).collect();
    // Splits `v` into the threads' ranges, shifted by `base`.
    fn split<'v>(mut v: &'v mut [u32], cuts: &[usize], base: &[usize]) -> Vec<&'v mut [u32]> {
        let mut out = Vec::with_capacity(cuts.len() - 1);
        for k in 0..cuts.len() - 1 {
            let (a, rest) = v.split_at_mut(base[k + 1] - base[k]);
            out.push(a);
            v = rest;
        }
        out
    }
    // Runs `work` on each thread's share, the first on this thread.
    fn on_threads<S: Send>(shares: Vec<S>, work: &(dyn Fn(usize, S) + Sync)) {
        std::thread::scope(|scope| {
            let mut shares = shares.into_iter().enumerate();
            let first = shares.next();
            for (k, share) in shares {
                scope.spawn(move || work(k, share));
            }
            if let Some((k, share)) = first {
                work(k, share);
            }
        });
    }
    on_threads(split(&mut start[..nops], &cuts, &cuts), &|k, chunk: &mut [u32]| {
        let rows = cuts[k]..cuts[k + 1];
        for p in parts {
            for &a in &p.items {
                if rows.contains(&(a as usize)) {
                    chunk[a as usize - rows.start] += 1;
                }
            }
        }
    });
    for x in 1..nops {
        start[x] += start[x - 1];
    }
    start[nops] = edges as u32;
    // Thread `k`'s rows fill `succ[base[k]..base[k + 1]]`.
    let base: Vec<usize> = cuts.iter().map(|&c| if c == 0 { 0 } else { start[c - 1] as usize }).collect();
    let mut succ: Vec<u32> = memory::try_filled(edges, 0u32, "the dependency graph's successors")?;
    let shares: Vec<_> =
        split(&mut start[..nops], &cuts, &cuts).into_iter().zip(split(&mut succ, &cuts, &base)).collect();
    on_threads(shares, &|k, (start, succ): (&mut [u32], &mut [u32])| {
        let (rows, at) = (cuts[k]..cuts[k + 1], base[k] as u32);
        let mut ends: Vec<usize> = parts.iter().map(|p| p.items.len()).collect();
        for b in (0..nops).rev() {
            for (p, end) in parts.iter().zip(&mut ends) {
                let row = *end - p.count(b)..*end;
                for &a in p.items[row.clone()].iter().rev() {
                    if rows.contains(&(a as usize)) {
                        let x = &mut start[a as usize - rows.start];
                        *x -= 1;
                        succ[(*x - at) as usize] = b as u32;
                    }
                }
                *end = row.start;
            }
        }
    });
    Ok((start, succ))
}

/// Each op's link, numbered in program order (what the schedulers read per op), and the number of
/// transfers. An op naming a rank the layout does not have gets `u32::MAX` (the walk reports it).
fn number_links(src: &impl OpSource, ranks_per_node: Option<u32>) -> Result<(LinkTable, Vec<u32>, usize), TooLarge> {
    let ranks = src.layout().ranks;
    let mut links = LinkTable::new(ranks);
    let mut link_of_op: Vec<u32> = memory::try_vec(src.op_count(), "the link of each op")?;
    let mut transfers = 0usize;
    let _ = src.try_for_each_op(|_, op| -> Result<(), ()> {
        let valid = op.src_rank().0 < ranks && op.dst_rank().0 < ranks;
        link_of_op.push(if valid { links.intern(op, ranks_per_node) } else { NONE });
        transfers += op.is_transfer() as usize;
        Ok(())
    });
    Ok((links, link_of_op, transfers))
}

/// Each op's chunk, numbered densely in the order ops first name chunks, and the chunk count.
fn number_chunks(src: &impl OpSource) -> Result<(Dense, u32), TooLarge> {
    let nops = src.op_count();
    let mut max_chunk = 0u32;
    let _ = src.try_for_each_op(|_, op| -> Result<(), ()> {
        max_chunk = max_chunk.max(op.chunk);
        Ok(())
    });
    let mut chunk_ids = ChunkIds::new(max_chunk, nops);
    let bound = if chunk_ids.table.is_empty() { u64::MAX } else { max_chunk as u64 + 1 };
    let mut chunk_of_op = Dense::with_capacity(nops, bound, "the chunk of each op")?;
    let _ = src.try_for_each_op(|_, op| -> Result<(), ()> {
        chunk_of_op.push(chunk_ids.intern(op.chunk));
        Ok(())
    });
    Ok((chunk_of_op, chunk_ids.count))
}
