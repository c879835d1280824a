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

use super::{ConnId, Connection, Graph, Prim, Schedule, Task, TbAlloc, TbId};
use crate::program::{OpId, OpKind, Program, Rank};
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

/// The result of the pass.
#[derive(Clone, Debug)]
pub struct Allocation {
    /// The allocator that produced it.
    pub policy: TbAlloc,
    /// The FIFO connections, indexed by [`ConnId`], in the order ops first use them; they become
    /// [`Plan::connections`](super::Plan::connections).
    pub connections: Vec<Connection>,
    /// The connection of each op, [`NO_CONN`] for local ops (see [`Allocation::conn_of`]).
    conn_of_op: Vec<u32>,
    /// Every endpoint of every rank, in the order tasks first use them.
    pub endpoints: Vec<Endpoint>,
    /// The endpoint (index into `endpoints`) of each task.
    pub endpoint_of_task: Vec<u32>,
    /// Thread blocks per rank.
    pub tbs_per_rank: Vec<u32>,
}

/// `conn_of_op` of a local op (four bytes per op rather than an `Option`'s eight).
const NO_CONN: u32 = u32::MAX;

impl Allocation {
    /// The connection of `op` (`None` for local ops).
    #[inline]
    pub fn conn_of(&self, op: OpId) -> Option<ConnId> {
        let c = self.conn_of_op[op.index()];
        (c != NO_CONN).then_some(ConnId(c))
    }

    /// The TB of task `t`.
    pub fn tb_of_task(&self, t: usize) -> TbId {
        self.endpoints[self.endpoint_of_task[t] as usize].tb
    }

    /// The text dump: connections, then each rank's TBs with their endpoints and intervals.
    pub fn dump(&self) -> String {
        let mut s = String::new();
        for (i, c) in self.connections.iter().enumerate() {
            let _ = writeln!(s, "c{i} = {c}");
        }
        let mut by_tb: Vec<Vec<Vec<&Endpoint>>> =
            self.tbs_per_rank.iter().map(|&n| vec![Vec::new(); n as usize]).collect();
        for e in &self.endpoints {
            by_tb[e.rank.index()][e.tb.index()].push(e);
        }
        for (r, tbs) in by_tb.iter().enumerate() {
            for (t, eps) in tbs.iter().enumerate() {
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

/// Runs the pass with `policy`.
pub fn run(program: &Program, g: &Graph, sched: &Schedule, policy: TbAlloc) -> Allocation {
    let per_conn = policy == TbAlloc::PerConn;
    // Connections.
    let mut conn_ids: super::FastMap<(u32, u32, u32, u32), ConnId> = Default::default();
    let mut pair_channels: super::FastMap<(u32, u32), u32> = Default::default();
    let mut connections = Vec::new();
    let mut conn_of_op = Vec::with_capacity(program.ops.len());
    for (i, op) in program.ops.iter().enumerate() {
        let c = match op.kind {
            OpKind::Transfer { src_rank, dst_rank, channel, .. } => {
                let stage = if per_conn { op.stage } else { 0 };
                let key = (src_rank.0, dst_rank.0, channel, stage);
                let next = ConnId::new(connections.len());
                let id = *conn_ids.entry(key).or_insert(next);
                if id == next {
                    let ch = if per_conn {
                        let n = pair_channels.entry((src_rank.0, dst_rank.0)).or_insert(0);
                        *n += 1;
                        *n - 1
                    } else {
                        channel
                    };
                    let inter_node = g.links[g.link_of_op[i].index()].inter_node;
                    connections.push(Connection { src: src_rank, dst: dst_rank, channel: ch, inter_node });
                }
                id.0
            }
            _ => NO_CONN,
        };
        conn_of_op.push(c);
    }
    // Endpoints and their intervals.
    let mut ep_ids: super::FastMap<(u32, EndpointKind), u32> = Default::default();
    let mut endpoints: Vec<Endpoint> = Vec::new();
    let mut endpoint_of_task = Vec::with_capacity(g.task_count());
    for (i, op) in program.ops.iter().enumerate() {
        let id = OpId::new(i);
        let sp = sched.subpipeline[i];
        for t in Task::split(id, op) {
            let kind = match (t.prim, conn_of_op[i]) {
                (Prim::Send, c) if c != NO_CONN => EndpointKind::Send(ConnId(c)),
                (Prim::Recv | Prim::RecvReduceCopy, c) if c != NO_CONN => EndpointKind::Recv(ConnId(c)),
                _ => EndpointKind::Local { channel: op.channel(), stage: per_conn.then_some(op.stage) },
            };
            let next = endpoints.len() as u32;
            let e = *ep_ids.entry((t.rank.0, kind)).or_insert(next);
            if e == next {
                endpoints.push(Endpoint { rank: t.rank, kind, first: sp, last: sp, tb: TbId(0) });
            } else {
                let e = &mut endpoints[e as usize];
                e.first = e.first.min(sp);
                e.last = e.last.max(sp);
            }
            endpoint_of_task.push(e);
        }
    }
    // Thread blocks.
    let nranks = program.ranks() as usize;
    let mut by_rank: Vec<Vec<u32>> = vec![Vec::new(); nranks];
    for (i, e) in endpoints.iter().enumerate() {
        by_rank[e.rank.index()].push(i as u32);
    }
    let mut tbs_per_rank = vec![0u32; nranks];
    for (r, eps) in by_rank.iter_mut().enumerate() {
        if per_conn {
            for (k, &e) in eps.iter().enumerate() {
                endpoints[e as usize].tb = TbId::new(k);
            }
            tbs_per_rank[r] = eps.len() as u32;
            continue;
        }
        eps.sort_by_key(|&e| (endpoints[e as usize].first, endpoints[e as usize].last, e));
        let mut active: BinaryHeap<Reverse<(u32, u32)>> = BinaryHeap::new();
        let mut free: BinaryHeap<Reverse<u32>> = BinaryHeap::new();
        let mut count = 0u32;
        for &e in eps.iter() {
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
        tbs_per_rank[r] = count;
    }
    Allocation { policy, connections, conn_of_op, endpoints, endpoint_of_task, tbs_per_rank }
}
