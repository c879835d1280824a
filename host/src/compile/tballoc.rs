//! Pass `tb-alloc`: FIFO connections and thread blocks.
//!
//! Every transfer is mapped to a FIFO connection `(src, dst, channel)`. A *connection endpoint* is
//! one side of a connection (its send side on `src`, its receive side on `dst`), or a local lane
//! for copies and reductions. Each endpoint is driven by exactly one thread block, so the messages
//! of a FIFO leave and arrive in one order. An endpoint is *active* from the first to the last
//! sub-pipeline that uses it.
//!
//! * **State-based** (ResCCL): one connection per `(src, dst, program channel)`; endpoints whose
//!   active intervals never overlap share a TB. Per rank this is interval-graph colouring, which the
//!   greedy sweep by start solves optimally: the TB count is the largest number of endpoints active
//!   in one sub-pipeline.
//! * **Per connection** (MSCCL): one connection per `(src, dst, program channel, stage)` (channels are
//!   renumbered densely per rank pair) and one TB per endpoint.
//!
//! The pass has two halves. [`Connections::build`] numbers the connections over the whole program,
//! in the order ops first use them (a transfer's connection is its link, and its stage per
//! connection). [`allocate_rank`] finds one rank's endpoints, their intervals
//! and TBs from that rank's tasks alone; the compiler runs it rank by rank while it emits the plan
//! (nothing per task is kept between ranks), and [`run`] runs it for every rank to keep the whole
//! [`Allocation`] for dumps and tests.

use super::{ConnId, Connection, FastMap, Graph, OpSource, Prim, Schedule, Task, TbAlloc, TbId};
use crate::program::{Op, OpId, OpKind, Rank};
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::fmt::Write;

/// What an endpoint drives.
#[derive(Copy, Clone, PartialEq, Eq, Hash, Debug)]
pub enum EndpointKind {
    /// The send side of a connection.
    Send(ConnId),
    /// The receive side of a connection.
    Recv(ConnId),
    /// Local copies and reductions of one channel (and stage, per connection).
    Local {
        /// The program channel of the ops.
        channel: u32,
        /// The ops' stage under [`TbAlloc::PerConn`]; `None` under [`TbAlloc::State`].
        stage: Option<u32>,
    },
}

/// One endpoint and the TB that drives it.
#[derive(Copy, Clone, PartialEq, Eq, Debug)]
pub struct Endpoint {
    /// The rank it is on: the connection's sender for a send side, its receiver for a receive side,
    /// the ops' rank for a local lane.
    pub rank: Rank,
    /// The connection side or local lane.
    pub kind: EndpointKind,
    /// First sub-pipeline with a task of this endpoint.
    pub first: u32,
    /// Last sub-pipeline with a task of this endpoint (inclusive): the endpoint is active over
    /// `first..=last`.
    pub last: u32,
    /// The TB of `rank` that drives it: an index into that rank's
    /// [`RankPlan::tbs`](super::RankPlan::tbs).
    pub tb: TbId,
}

/// The FIFO connections of a program, numbered in the order ops first use them, and each
/// transfer's connection by its link (and stage, per connection).
#[derive(Clone, Debug)]
pub struct Connections {
    /// The allocator they were made for.
    pub policy: TbAlloc,
    /// Indexed by [`ConnId`]; they become [`Plan::connections`](super::Plan::connections).
    pub list: Vec<Connection>,
    /// State-based: the connection of each link (`NONE` for a local lane); a transfer link is a
    /// connection.
    by_link: Vec<u32>,
    /// Per connection: `(link, stage)` → connection.
    by_link_stage: FastMap<(u32, u32), u32>,
}

const NONE: u32 = u32::MAX;

impl Connections {
    /// The first half of the pass: every transfer's connection, numbered in program order. Reads
    /// the ops' links from `g` ([`Graph::link_of_op`]).
    pub fn build(src: &impl OpSource, g: &Graph, policy: TbAlloc) -> Connections {
        let per_conn = policy == TbAlloc::PerConn;
        let mut c = Connections {
            policy,
            list: Vec::new(),
            by_link: if per_conn { Vec::new() } else { vec![NONE; g.links.links.len()] },
            by_link_stage: Default::default(),
        };
        let mut pair_channels: FastMap<(u32, u32), u32> = Default::default();
        let _ = src.try_for_each_op(|id, op| -> Result<(), ()> {
            if let OpKind::Transfer { src_rank, dst_rank, channel, .. } = op.kind {
                let l = g.link_of_op[id.index()];
                let next = c.list.len() as u32;
                let slot = if per_conn {
                    c.by_link_stage.entry((l, op.stage)).or_insert(next)
                } else {
                    &mut c.by_link[l as usize]
                };
                if *slot == NONE {
                    *slot = next;
                }
                if *slot == next {
                    let ch = if per_conn {
                        let n = pair_channels.entry((src_rank.0, dst_rank.0)).or_insert(0);
                        *n += 1;
                        *n - 1
                    } else {
                        channel
                    };
                    let inter_node = g.links.links[l as usize].inter_node;
                    c.list.push(Connection { src: src_rank, dst: dst_rank, channel: ch, inter_node });
                }
            }
            Ok(())
        });
        c
    }

    /// The connection of an op on `link` at `stage` (`None` for a local op).
    #[inline]
    pub fn of(&self, link: u32, stage: u32) -> Option<ConnId> {
        let c = if self.policy == TbAlloc::PerConn {
            self.by_link_stage.get(&(link, stage)).copied().unwrap_or(NONE)
        } else {
            self.by_link[link as usize]
        };
        (c != NONE).then_some(ConnId(c))
    }
}

/// The endpoint kind of `op`'s task on side `side` under `policy`, given the op's connection.
pub fn endpoint_kind(op: &Op, side: usize, conn: Option<ConnId>, policy: TbAlloc) -> EndpointKind {
    match (Task::prim_of(op, side), conn) {
        (Prim::Send, Some(c)) => EndpointKind::Send(c),
        (Prim::Recv | Prim::RecvReduceCopy, Some(c)) => EndpointKind::Recv(c),
        _ => EndpointKind::Local { channel: op.channel(), stage: (policy == TbAlloc::PerConn).then_some(op.stage) },
    }
}

/// One rank's half of the pass.
#[derive(Clone, Debug, Default)]
pub struct RankAlloc {
    /// The rank's endpoints in the order its tasks first use them in the program, each with its TB.
    pub endpoints: Vec<Endpoint>,
    /// The endpoint (index into `endpoints`) of each task, in the order the tasks were given.
    pub endpoint_of: Vec<u32>,
    /// Thread blocks of the rank.
    pub tbs: u32,
}

/// Scratch space of [`allocate_rank`], kept from rank to rank.
#[derive(Default)]
pub struct RankScratch {
    first_op: Vec<u32>,
    by_use: Vec<u32>,
    rename: Vec<u32>,
}

/// One task given to [`allocate_rank`]: its op, its side of the op, its connection, its
/// sub-pipeline and its endpoint.
#[derive(Copy, Clone, Debug)]
pub struct RankTask {
    /// The op's id.
    pub id: OpId,
    /// The op.
    pub op: Op,
    /// The task's side (see [`Task::split`]).
    pub side: usize,
    /// The op's connection.
    pub conn: Option<ConnId>,
    /// The op's sub-pipeline.
    pub sp: u32,
    /// Its endpoint, numbered from 0 in the order the tasks given first name each: two tasks share
    /// an endpoint when they share a link (and a stage, per connection), see [`EndpointKind`].
    pub endpoint: u32,
}

/// The second half of the pass for `rank`, from its tasks in any order: endpoints with their
/// active intervals, numbered in the order of first use in the program (by op id), then TBs.
pub fn allocate_rank(rank: Rank, tasks: &[RankTask], policy: TbAlloc, scratch: &mut RankScratch) -> RankAlloc {
    let RankScratch { first_op, by_use, rename } = scratch;
    first_op.clear();
    let mut endpoints: Vec<Endpoint> = Vec::new();
    let mut endpoint_of = Vec::with_capacity(tasks.len());
    for t in tasks {
        let e = t.endpoint;
        if e as usize == endpoints.len() {
            let kind = endpoint_kind(&t.op, t.side, t.conn, policy);
            endpoints.push(Endpoint { rank, kind, first: t.sp, last: t.sp, tb: TbId(0) });
            first_op.push(t.id.0);
        } else {
            let ep = &mut endpoints[e as usize];
            ep.first = ep.first.min(t.sp);
            ep.last = ep.last.max(t.sp);
            first_op[e as usize] = first_op[e as usize].min(t.id.0);
        }
        endpoint_of.push(e);
    }
    // Program order of first use: each op has one task on this rank, so first ops differ.
    by_use.clear();
    by_use.extend(0..endpoints.len() as u32);
    by_use.sort_unstable_by_key(|&e| first_op[e as usize]);
    rename.clear();
    rename.resize(endpoints.len(), 0);
    for (k, &e) in by_use.iter().enumerate() {
        rename[e as usize] = k as u32;
    }
    let endpoints: Vec<Endpoint> = by_use.iter().map(|&e| endpoints[e as usize]).collect();
    for e in &mut endpoint_of {
        *e = rename[*e as usize];
    }
    let mut a = RankAlloc { endpoints, endpoint_of, tbs: 0 };
    a.tbs = assign_tbs(&mut a.endpoints, policy);
    a
}

/// Gives each endpoint (in first-use order) a TB; returns the TB count.
fn assign_tbs(endpoints: &mut [Endpoint], policy: TbAlloc) -> u32 {
    if policy == TbAlloc::PerConn {
        for (k, e) in endpoints.iter_mut().enumerate() {
            e.tb = TbId::new(k);
        }
        return endpoints.len() as u32;
    }
    let mut eps: Vec<u32> = (0..endpoints.len() as u32).collect();
    eps.sort_by_key(|&e| (endpoints[e as usize].first, endpoints[e as usize].last, e));
    let mut active: BinaryHeap<Reverse<(u32, u32)>> = BinaryHeap::new();
    let mut free: BinaryHeap<Reverse<u32>> = BinaryHeap::new();
    let mut count = 0u32;
    for &e in &eps {
        let (first, last) = (endpoints[e as usize].first, endpoints[e as usize].last);
        while let Some(&Reverse((end, tb))) = active.peek() {
            if end < first {
                active.pop();
                free.push(Reverse(tb));
            } else {
                break;
            }
        }
        let tb = match free.pop() {
            Some(Reverse(tb)) => tb,
            None => {
                count += 1;
                count - 1
            }
        };
        endpoints[e as usize].tb = TbId(tb);
        active.push(Reverse((last, tb)));
    }
    count
}

/// The whole result of the pass, for dumps and tests ([`run`]); the compiler itself keeps only
/// [`Connections`] and one rank's [`RankAlloc`] at a time.
#[derive(Clone, Debug)]
pub struct Allocation {
    /// The allocator that produced it.
    pub policy: TbAlloc,
    /// The FIFO connections, indexed by [`ConnId`], in the order ops first use them.
    pub connections: Vec<Connection>,
    /// Per rank, its endpoints and TBs, with its tasks in program order.
    pub ranks: Vec<RankAlloc>,
}

impl Allocation {
    /// Thread blocks per rank.
    pub fn tbs_per_rank(&self) -> Vec<u32> {
        self.ranks.iter().map(|r| r.tbs).collect()
    }

    /// The text dump: connections, then each rank's TBs with their endpoints and intervals.
    pub fn dump(&self) -> String {
        let mut s = String::new();
        for (i, c) in self.connections.iter().enumerate() {
            let _ = writeln!(s, "c{i} = {c}");
        }
        for (r, ra) in self.ranks.iter().enumerate() {
            let mut by_tb: Vec<Vec<&Endpoint>> = vec![Vec::new(); ra.tbs as usize];
            for e in &ra.endpoints {
                by_tb[e.tb.index()].push(e);
            }
            for (t, eps) in by_tb.iter().enumerate() {
                let parts: Vec<String> = eps
                    .iter()
                    .map(|e| {
                        let what = match e.kind {
                            EndpointKind::Send(c) => format!("send {c}"),
                            EndpointKind::Recv(c) => format!("recv {c}"),
                            EndpointKind::Local { channel, stage: None } => format!("local ch={channel}"),
                            EndpointKind::Local { channel, stage: Some(st) } => {
                                format!("local ch={channel} stage={st}")
                            }
                        };
                        format!("{what} [sp{}..sp{}]", e.first, e.last)
                    })
                    .collect();
                let _ = writeln!(s, "r{r} tb{t} = {}", parts.join(", "));
            }
        }
        s
    }
}

/// Runs the whole pass with `policy`, keeping every rank's result (for dumps and tests: it holds a
/// copy of the ops).
pub fn run(src: &impl OpSource, g: &Graph, sched: &Schedule, policy: TbAlloc) -> Allocation {
    let conns = Connections::build(src, g, policy);
    let mut scratch = RankScratch::default();
    let ranks = rank_tasks(src, g, sched, &conns)
        .iter()
        .enumerate()
        .map(|(r, tasks)| allocate_rank(Rank(r as u32), tasks, policy, &mut scratch))
        .collect();
    Allocation { policy, connections: conns.list, ranks }
}

/// Every rank's tasks in program order with their endpoints numbered, for [`run`] and
/// [`super::verify::alloc`].
pub(crate) fn rank_tasks(src: &impl OpSource, g: &Graph, sched: &Schedule, conns: &Connections) -> Vec<Vec<RankTask>> {
    let sp = sched.subpipelines();
    let nranks = src.ranks() as usize;
    let mut out: Vec<Vec<RankTask>> = (0..nranks).map(|_| Vec::new()).collect();
    let mut ids: Vec<FastMap<(u32, u32), u32>> = vec![Default::default(); nranks];
    let per_conn = conns.policy == TbAlloc::PerConn;
    let _ = src.try_for_each_op(|id, op| -> Result<(), ()> {
        let i = id.index();
        let link = g.link_of_op[i];
        let conn = conns.of(link, op.stage);
        for (side, t) in Task::split(id, op).enumerate() {
            let r = t.rank.index();
            let next = ids[r].len() as u32;
            let endpoint = *ids[r].entry((link, if per_conn { op.stage } else { 0 })).or_insert(next);
            out[r].push(RankTask { id, op: *op, side, conn, sp: sp[i], endpoint });
        }
        Ok(())
    });
    out
}
