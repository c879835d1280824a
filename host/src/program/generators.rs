//! Built-in algorithms: ring, direct (all-pairs) and the expert hierarchical mesh (HM).
//!
//! Ranks are numbered node-major: rank `s*g + l` is GPU `l` of node `s` (`n` nodes of `g` GPUs).
//! Every generated program is in place, uses channel 0, and lists its ops step by step, so the
//! sequential order is the algorithm's own.
//! [`Algorithm::generate`] is the way in: it checks the topology before building the program.

use super::{Collective, Layout, Program, ProgramError, RecvOp, Slice};
use std::fmt;
use std::str::FromStr;

/// The built-in algorithms, by CLI name.
#[derive(Copy, Clone, PartialEq, Eq, Debug)]
pub enum Algorithm {
    /// `ring-allreduce`: over `n` ranks and `n` chunks, a ring ReduceScatter (stage 0) then a ring
    /// AllGather (stage 1), `2(n-1)` steps.
    RingAllReduce,
    /// `ring-allgather`: one chunk per rank, each forwarded around the ring, `n-1` steps on `n` ranks.
    RingAllGather,
    /// `ring-reducescatter`: one chunk per rank, each reduced on its way around the ring to its
    /// owner, `n-1` steps on `n` ranks.
    RingReduceScatter,
    /// `direct-allreduce`: a direct ReduceScatter (step 0, stage 0) then a direct AllGather (step 1,
    /// stage 1).
    DirectAllReduce,
    /// `direct-allgather`: every rank sends its chunk to every other rank, 1 step.
    DirectAllGather,
    /// `direct-reducescatter`: every rank sends chunk `q` to rank `q`, which reduces it, 1 step.
    DirectReduceScatter,
    /// `direct-alltoall`, out of place: block `q` of rank `r`'s input goes to block `r` of rank
    /// `q`'s output (the rank's own block is a local copy), 1 step.
    DirectAllToAll,
    /// `hm-allgather`: hierarchical mesh, one chunk per rank: step 0 sends each chunk to its node's
    /// other GPUs and over the NIC to the next node (stage 0); at each later step the chunk that came
    /// over the NIC goes on to the next node (stage 0) and to the node's other GPUs (stage 1); one
    /// step per node.
    HmAllGather,
    /// `hm-reducescatter`: hierarchical mesh, one chunk per rank: each node reduces its GPUs'
    /// contributions onto one GPU, which passes the partial sum over the NIC to the next node, one
    /// step per node.
    HmReduceScatter,
    /// `hm-allreduce`: the HM ReduceScatter then the HM AllGather, in place, two steps per node.
    HmAllReduce,
}

impl Algorithm {
    /// Every algorithm, in CLI order.
    pub const ALL: [Algorithm; 10] = [
        Algorithm::RingAllReduce,
        Algorithm::RingAllGather,
        Algorithm::RingReduceScatter,
        Algorithm::DirectAllReduce,
        Algorithm::DirectAllGather,
        Algorithm::DirectReduceScatter,
        Algorithm::DirectAllToAll,
        Algorithm::HmAllGather,
        Algorithm::HmReduceScatter,
        Algorithm::HmAllReduce,
    ];

    /// The most ranks a generator accepts: the programs grow as the square of the rank count (an
    /// 8192-rank HM AllReduce has 134 M ops), and their layouts (as many chunks as ranks, in and
    /// out) stay within [`Layout::MAX_CHUNKS`].
    pub const MAX_RANKS: u32 = 8192;

    /// The CLI name (`ring-allreduce`, `hm-allgather`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Algorithm::RingAllReduce => "ring-allreduce",
            Algorithm::RingAllGather => "ring-allgather",
            Algorithm::RingReduceScatter => "ring-reducescatter",
            Algorithm::DirectAllReduce => "direct-allreduce",
            Algorithm::DirectAllGather => "direct-allgather",
            Algorithm::DirectReduceScatter => "direct-reducescatter",
            Algorithm::DirectAllToAll => "direct-alltoall",
            Algorithm::HmAllGather => "hm-allgather",
            Algorithm::HmReduceScatter => "hm-reducescatter",
            Algorithm::HmAllReduce => "hm-allreduce",
        }
    }

    /// Generates the program for `nodes` nodes of `gpus` GPUs each.
    pub fn generate(self, nodes: u32, gpus: u32) -> Result<Program, ProgramError> {
        if nodes == 0 || gpus == 0 {
            return Err(ProgramError::BadLayout { reason: format!("topology {nodes}x{gpus} has no GPUs") });
        }
        let n = nodes.checked_mul(gpus).filter(|&n| n <= Self::MAX_RANKS).ok_or_else(|| ProgramError::BadLayout {
            reason: format!("topology {nodes}x{gpus} is too large (at most {} ranks)", Self::MAX_RANKS),
        })?;
        let mut p = match self {
            Algorithm::RingAllReduce => ring_allreduce(n),
            Algorithm::RingAllGather => ring_allgather(n),
            Algorithm::RingReduceScatter => ring_reducescatter(n),
            Algorithm::DirectAllReduce => direct_allreduce(n),
            Algorithm::DirectAllGather => direct_allgather(n),
            Algorithm::DirectReduceScatter => direct_reducescatter(n),
            Algorithm::DirectAllToAll => direct_alltoall(n),
            Algorithm::HmAllGather => hm_allgather(nodes, gpus),
            Algorithm::HmReduceScatter => hm_reducescatter(nodes, gpus),
            Algorithm::HmAllReduce => hm_allreduce(nodes, gpus),
        };
        p.ranks_per_node = Some(gpus);
        p.name = format!("{}_{}x{}", self.name().replace('-', "_"), nodes, gpus);
        Ok(p)
    }
}

// Every generator's layout at the rank limit is a valid one.
const _: () = assert!(2 * (Algorithm::MAX_RANKS as u64) * (Algorithm::MAX_RANKS as u64) <= Layout::MAX_CHUNKS);

impl fmt::Display for Algorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Algorithm {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Algorithm::ALL.iter().copied().find(|a| a.name() == s).ok_or_else(|| {
            let names: Vec<&str> = Algorithm::ALL.iter().map(|a| a.name()).collect();
            format!("unknown algorithm `{s}` (known: {})", names.join(", "))
        })
    }
}

fn modn(x: i64, n: u32) -> u32 {
    x.rem_euclid(n as i64) as u32
}

/// Ring ReduceScatter steps `0..n-1` into `in[]`: at step `s` rank `r` sends chunk `r-s-1` to `r+1`,
/// which reduces it; rank `r` ends with chunk `r` fully reduced.
fn ring_rs_steps(p: &mut Program, n: u32, stage: u32) {
    for s in 0..n.saturating_sub(1) {
        for r in 0..n {
            let c = modn(r as i64 - s as i64 - 1, n);
            p.transfer(r, Slice::input(c), (r + 1) % n, Slice::input(c), RecvOp::RecvReduceCopy, c, s, stage);
        }
    }
}

/// Ring AllGather steps from `first_step`: at step `s` rank `r` forwards chunk `r-s` to `r+1`.
fn ring_ag_steps(p: &mut Program, n: u32, first_step: u32, stage: u32, out: bool) {
    let sl = |c| {
        if out { Slice::output(c) } else { Slice::input(c) }
    };
    for s in 0..n.saturating_sub(1) {
        for r in 0..n {
            let c = modn(r as i64 - s as i64, n);
            p.transfer(r, sl(c), (r + 1) % n, sl(c), RecvOp::Recv, c, first_step + s, stage);
        }
    }
}

/// Ring AllReduce over `n` ranks and `n` chunks: ReduceScatter (stage 0) then AllGather (stage 1).
fn ring_allreduce(n: u32) -> Program {
    let mut p = Program::new("ring_allreduce", Layout::new(Collective::AllReduce, n, n, true));
    ring_rs_steps(&mut p, n, 0);
    ring_ag_steps(&mut p, n, n.saturating_sub(1), 1, false);
    p
}

/// Ring AllGather over `n` ranks, one chunk per rank.
fn ring_allgather(n: u32) -> Program {
    let mut p = Program::new("ring_allgather", Layout::new(Collective::AllGather, n, n, true));
    ring_ag_steps(&mut p, n, 0, 0, true);
    p
}

/// Ring ReduceScatter over `n` ranks, one chunk per rank.
fn ring_reducescatter(n: u32) -> Program {
    let mut p = Program::new("ring_reducescatter", Layout::new(Collective::ReduceScatter, n, n, true));
    ring_rs_steps(&mut p, n, 0);
    p
}

/// Direct AllGather: every rank sends its chunk to every other rank in one step.
fn direct_allgather(n: u32) -> Program {
    let mut p = Program::new("direct_allgather", Layout::new(Collective::AllGather, n, n, true));
    for r in 0..n {
        for d in 1..n {
            let q = (r + d) % n;
            p.transfer(r, Slice::output(r), q, Slice::output(r), RecvOp::Recv, r, 0, 0);
        }
    }
    p
}

fn direct_rs_step(p: &mut Program, n: u32) {
    for q in 0..n {
        for d in 1..n {
            let r = (q + d) % n;
            p.transfer(r, Slice::input(q), q, Slice::input(q), RecvOp::RecvReduceCopy, q, 0, 0);
        }
    }
}

/// Direct ReduceScatter: every rank sends chunk `q` to rank `q`, which reduces it.
fn direct_reducescatter(n: u32) -> Program {
    let mut p = Program::new("direct_reducescatter", Layout::new(Collective::ReduceScatter, n, n, true));
    direct_rs_step(&mut p, n);
    p
}

/// Direct AllReduce: direct ReduceScatter (step 0, stage 0) then direct AllGather (step 1, stage 1).
fn direct_allreduce(n: u32) -> Program {
    let mut p = Program::new("direct_allreduce", Layout::new(Collective::AllReduce, n, n, true));
    direct_rs_step(&mut p, n);
    for r in 0..n {
        for d in 1..n {
            let q = (r + d) % n;
            p.transfer(r, Slice::input(r), q, Slice::input(r), RecvOp::Recv, r, 1, 1);
        }
    }
    p
}

/// Direct AllToAll (out of place): block `q` of rank `r`'s input goes to block `r` of rank `q`'s
/// output; the rank's own block is a local copy.
fn direct_alltoall(n: u32) -> Program {
    let mut p = Program::new("direct_alltoall", Layout::new(Collective::AllToAll, n, n, false));
    for r in 0..n {
        p.push(super::Op {
            kind: super::OpKind::Copy { rank: super::Rank(r), channel: 0, src: Slice::input(r), dst: Slice::output(r) },
            chunk: r,
            step: 0,
            stage: 0,
        });
        for d in 1..n {
            let q = (r + d) % n;
            p.transfer(r, Slice::input(q), q, Slice::output(r), RecvOp::Recv, q, 0, 0);
        }
    }
    p
}

/// The HM AllGather transfers into `sl(q)` locations, steps from `first_step`.
///
/// Stage 0: at step 0 every GPU sends its chunk to the `g-1` GPUs of its node and, over the NIC, to
/// the GPU with the same local index on the next node; at steps `1..n-1` it forwards the chunk it
/// received over the NIC at the previous step to the next node. Stage 1: at step `k` (`1..n`) it
/// forwards the remote chunk received at step `k-1` to the `g-1` local GPUs.
fn hm_ag_ops(p: &mut Program, nodes: u32, g: u32, first_step: u32, sl: impl Fn(u32) -> Slice) {
    let n = nodes;
    let rank = |s: u32, l: u32| s * g + l;
    for s in 0..n {
        for l in 0..g {
            let r = rank(s, l);
            for d in 1..g {
                let l2 = (l + d) % g;
                p.transfer(r, sl(r), rank(s, l2), sl(r), RecvOp::Recv, r, first_step, 0);
            }
            if n > 1 {
                p.transfer(r, sl(r), rank((s + 1) % n, l), sl(r), RecvOp::Recv, r, first_step, 0);
            }
        }
    }
    for k in 1..n {
        for s in 0..n {
            for l in 0..g {
                let r = rank(s, l);
                let q = rank(modn(s as i64 - k as i64, n), l);
                if k + 1 < n {
                    p.transfer(r, sl(q), rank((s + 1) % n, l), sl(q), RecvOp::Recv, q, first_step + k, 0);
                }
                for d in 1..g {
                    let l2 = (l + d) % g;
                    p.transfer(r, sl(q), rank(s, l2), sl(q), RecvOp::Recv, q, first_step + k, 1);
                }
            }
        }
    }
}

/// The HM ReduceScatter transfers into `in[]`, steps `0..n` (the mirror image of the AllGather).
///
/// Chunk `q` (owner: GPU `lq` of node `sq`) travels the NIC ring forward from node `sq+1` to node
/// `sq`. On the node at ring position `e` (`e = 0..n-2`), step `e`: the `g-1` local GPUs reduce their
/// contribution onto GPU `lq` (stage 0), which then sends the partial sum over the NIC to the next
/// node, reducing it there (stage 0). On the owner's node (position `n-1`), step `n-1`: the local
/// GPUs reduce onto the owner (stage 1).
fn hm_rs_ops(p: &mut Program, nodes: u32, g: u32) {
    let n = nodes;
    let rank = |s: u32, l: u32| s * g + l;
    for e in 0..n {
        let stage = if e + 1 == n { 1 } else { 0 };
        // Local reductions of this step.
        for sq in 0..n {
            let s = (sq + 1 + e) % n;
            for lq in 0..g {
                let q = rank(sq, lq);
                for d in 1..g {
                    let l2 = (lq + d) % g;
                    let sl = Slice::input(q);
                    p.transfer(rank(s, l2), sl, rank(s, lq), sl, RecvOp::RecvReduceCopy, q, e, stage);
                }
            }
        }
        // NIC hops of this step.
        if e + 1 < n {
            for sq in 0..n {
                let s = (sq + 1 + e) % n;
                for lq in 0..g {
                    let q = rank(sq, lq);
                    let sl = Slice::input(q);
                    p.transfer(rank(s, lq), sl, rank((s + 1) % n, lq), sl, RecvOp::RecvReduceCopy, q, e, 0);
                }
            }
        }
    }
}

/// HM AllGather for `nodes` × `g` GPUs, one chunk per rank (see `hm_ag_ops`).
fn hm_allgather(nodes: u32, g: u32) -> Program {
    let n = nodes * g;
    let mut p = Program::new("hm_allgather", Layout::new(Collective::AllGather, n, n, true));
    hm_ag_ops(&mut p, nodes, g, 0, Slice::output);
    p
}

/// HM ReduceScatter for `nodes` × `g` GPUs, one chunk per rank.
fn hm_reducescatter(nodes: u32, g: u32) -> Program {
    let n = nodes * g;
    let mut p = Program::new("hm_reducescatter", Layout::new(Collective::ReduceScatter, n, n, true));
    hm_rs_ops(&mut p, nodes, g);
    p
}

/// HM AllReduce: HM ReduceScatter (steps `0..n`) then HM AllGather (steps `n..2n`), in place.
/// Each half keeps its own stages (`hm_rs_ops`, `hm_ag_ops`).
fn hm_allreduce(nodes: u32, g: u32) -> Program {
    let n = nodes * g;
    let mut p = Program::new("hm_allreduce", Layout::new(Collective::AllReduce, n, n, true));
    hm_rs_ops(&mut p, nodes, g);
    hm_ag_ops(&mut p, nodes, g, nodes, Slice::input);
    p
}
