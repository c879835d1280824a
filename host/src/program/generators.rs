//! Built-in algorithms: ring, direct (all-pairs) and the expert hierarchical mesh (HM).
//!
//! Ranks are numbered node-major: rank `s*g + l` is GPU `l` of node `s` (`n` nodes of `g` GPUs).
//! Every generated program is in place, uses channel 0, and lists its ops step by step, so the
//! sequential order is the algorithm's own.
//! [`Algorithm::generate`] is the way in: it checks the topology before building the program.
//! [`Algorithm::source`] gives the same program without storing it ([`Generated`]): its ops are
//! computed when the compiler reads them, in order or by id, which is how the 8192-GPU programs
//! (134 M ops, 7 GB as a [`Program`]) compile in a few GB.

use super::{BufferLayout, Collective, Op, OpId, OpKind, Program, ProgramError, Rank, RecvOp, Slice};
use crate::compile::OpSource;
use crate::compile::memory;
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
    /// `hier-allreduce`: the staged hierarchical AllReduce, in place: a direct ReduceScatter inside
    /// each node onto the GPU of each chunk's local index (stage 0), a ring AllReduce among the GPUs
    /// of one local index across the nodes (over the NICs: stages 1 and 2), a direct AllGather
    /// inside each node (stage 3). What the communicator runs across nodes (NVLink inside, NCCL
    /// between).
    HierAllReduce,
    /// `hier-reducescatter`: the first two stages of `hier-allreduce` (intra-node direct
    /// ReduceScatter, inter-node ring ReduceScatter), in place.
    HierReduceScatter,
    /// `hier-allgather`: an inter-node ring AllGather among the GPUs of one local index, then a
    /// direct AllGather inside each node, in place.
    HierAllGather,
    /// `chain-broadcast`: a Broadcast from rank 0, in place, over `n` chunks pipelined down the
    /// chain 0 → 1 → … → n-1: chunk `c` takes hop `k` at step `c + k`.
    ChainBroadcast,
    /// `chain-reduce`: a Reduce into rank 0, in place, over `n` chunks pipelined up the chain
    /// n-1 → … → 1 → 0, each rank adding its part on the way: chunk `c` takes hop `k` at step
    /// `c + k`.
    ChainReduce,
}

impl Algorithm {
    /// Every algorithm, in CLI order.
    pub const ALL: [Algorithm; 15] = [
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
        Algorithm::HierAllReduce,
        Algorithm::HierReduceScatter,
        Algorithm::HierAllGather,
        Algorithm::ChainBroadcast,
        Algorithm::ChainReduce,
    ];

    /// The most ranks a generator accepts: the programs grow as the square of the rank count (an
    /// 8192-rank HM AllReduce has 134 M ops), and their layouts (as many chunks as ranks, in and
    /// out) stay within [`BufferLayout::MAX_CHUNKS`].
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
            Algorithm::HierAllReduce => "hier-allreduce",
            Algorithm::HierReduceScatter => "hier-reducescatter",
            Algorithm::HierAllGather => "hier-allgather",
            Algorithm::ChainBroadcast => "chain-broadcast",
            Algorithm::ChainReduce => "chain-reduce",
        }
    }

    /// Generates the program for `nodes` nodes of `gpus` GPUs each, if its ops fit in the memory
    /// this process can still allocate ([`memory::default_limit`]); see
    /// [`Algorithm::generate_within`].
    pub fn generate(self, nodes: u32, gpus: u32) -> Result<Program, ProgramError> {
        self.generate_within(nodes, gpus, memory::default_limit())
    }

    /// Generates the program for `nodes` nodes of `gpus` GPUs each, refusing one whose ops would
    /// take more than `limit` bytes ([`Algorithm::program_bytes`]) with a
    /// [`ProgramError::BadLayout`] that names the program, the estimate and the limit. Programs
    /// too large to store compile from [`Algorithm::source`] instead.
    pub fn generate_within(self, nodes: u32, gpus: u32, limit: u64) -> Result<Program, ProgramError> {
        let src = self.source(nodes, gpus)?;
        let bytes = src.program_bytes();
        let request = || format!("{} as a stored program ({} ops)", src.name, src.ops);
        memory::check(limit, bytes, request).map_err(|e| ProgramError::BadLayout { reason: e.to_string() })?;
        let mut p = Program::new(src.name.clone(), src.layout.clone());
        p.ranks_per_node = Some(gpus);
        p.ops = memory::try_vec(src.ops, &request()).map_err(|e| ProgramError::BadLayout { reason: e.to_string() })?;
        src.for_each(&mut |op| p.ops.push(op));
        Ok(p)
    }

    /// The program for `nodes` nodes of `gpus` GPUs each, generated on demand: the same ops as
    /// [`Algorithm::generate`] in the same order, none of them stored.
    pub fn source(self, nodes: u32, gpus: u32) -> Result<Generated, ProgramError> {
        if nodes == 0 || gpus == 0 {
            return Err(ProgramError::BadLayout { reason: format!("topology {nodes}x{gpus} has no GPUs") });
        }
        let n = nodes.checked_mul(gpus).filter(|&n| n <= Self::MAX_RANKS).ok_or_else(|| ProgramError::BadLayout {
            reason: format!("topology {nodes}x{gpus} is too large (at most {} ranks)", Self::MAX_RANKS),
        })?;
        let (collective, in_place) = match self {
            Algorithm::RingAllReduce
            | Algorithm::DirectAllReduce
            | Algorithm::HmAllReduce
            | Algorithm::HierAllReduce => (Collective::AllReduce, true),
            Algorithm::RingAllGather
            | Algorithm::DirectAllGather
            | Algorithm::HmAllGather
            | Algorithm::HierAllGather => (Collective::AllGather, true),
            Algorithm::RingReduceScatter
            | Algorithm::DirectReduceScatter
            | Algorithm::HmReduceScatter
            | Algorithm::HierReduceScatter => (Collective::ReduceScatter, true),
            Algorithm::DirectAllToAll => (Collective::AllToAll, false),
            Algorithm::ChainBroadcast => (Collective::Broadcast { root: 0 }, true),
            Algorithm::ChainReduce => (Collective::Reduce { root: 0 }, true),
        };
        let mut g = Generated {
            algo: self,
            nodes,
            gpus,
            name: format!("{}_{}x{}", self.name().replace('-', "_"), nodes, gpus),
            layout: BufferLayout::new(collective, n, n, in_place),
            ops: 0,
            blocks: Vec::new(),
            gpus_div: Divisor::new(gpus),
            peers_div: Divisor::new(gpus - 1),
            nodes_div: Divisor::new(nodes),
        };
        let mut start = 0;
        for b in g.block_list() {
            let len = g.len_of(b);
            g.blocks.push((start, len, b, g.divisors(b)));
            start += len;
        }
        // Every op id is a `u32` (at most 2 * 8192^2 ops at the rank limit).
        debug_assert!(start < u32::MAX as u64);
        g.ops = start as usize;
        Ok(g)
    }

    /// The bytes [`Algorithm::generate`]'s program takes for `nodes` × `gpus` (its ops), or `None`
    /// for a topology it refuses.
    pub fn program_bytes(self, nodes: u32, gpus: u32) -> Option<u64> {
        self.source(nodes, gpus).ok().map(|s| s.program_bytes())
    }
}

// Every generator's layout at the rank limit is a valid one.
const _: () = assert!(2 * (Algorithm::MAX_RANKS as u64) * (Algorithm::MAX_RANKS as u64) <= BufferLayout::MAX_CHUNKS);

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

/// A built-in algorithm's program with its ops computed on demand ([`Algorithm::source`]): an
/// [`OpSource`] for the compiler, holding a few numbers however many ops the program has.
///
/// The program is a short list of blocks, each a regular loop nest over steps and ranks: read in
/// order, a block runs its loop nest; read by id, it finds the loop indices by division.
#[derive(Clone, Debug)]
pub struct Generated {
    algo: Algorithm,
    nodes: u32,
    gpus: u32,
    name: String,
    layout: BufferLayout,
    ops: usize,
    /// The blocks, each with its first op, its length and its divisors.
    blocks: Vec<(u64, u64, Block, Divisors)>,
    /// Divides by the GPUs per node.
    gpus_div: Divisor,
    /// Divides by `gpus - 1`.
    peers_div: Divisor,
    /// Divides by the nodes.
    nodes_div: Divisor,
}

/// One block of a generated program (see [`Generated`]).
#[derive(Copy, Clone, Debug)]
enum Block {
    /// Ring ReduceScatter steps `0..n-1` (`ring_rs_steps`).
    RingRs { stage: u32 },
    /// Ring AllGather steps from `first_step` (`ring_ag_steps`), into the output or the input.
    RingAg { first_step: u32, stage: u32, out: bool },
    /// Direct ReduceScatter, step 0, stage 0.
    DirectRs,
    /// Every rank sends its own chunk of `buf` to every other rank (direct AllGather, and the
    /// second half of the direct AllReduce), at `step` and `stage`.
    DirectBcast { out: bool, step: u32 },
    /// Direct AllToAll: per rank its local copy, then its sends.
    AllToAll,
    /// HM AllGather, step `first_step`: each GPU's chunk to its node and over the NIC.
    HmAgFirst { first_step: u32, out: bool },
    /// HM AllGather, steps `first_step + k` for `k` in `k0..k1`: the chunk that came over the NIC
    /// goes on over the NIC (when `nic`) and to the node's other GPUs.
    HmAgLater { first_step: u32, out: bool, k0: u32, k1: u32, nic: bool },
    /// HM ReduceScatter steps `e0..e1`: local reductions, then NIC hops when `nic`.
    HmRs { e0: u32, e1: u32, nic: bool },
    /// Hierarchical, step 0, stage 0: inside each node, every GPU sends each chunk of local index
    /// `l` to GPU `l`, which reduces it.
    HierIntraRs,
    /// Hierarchical: a ring among the GPUs of one local index across the nodes, over the chunks of
    /// that index: a ReduceScatter (chunk `t·g + l` ends reduced on node `t`) or an AllGather (from
    /// node `t` to all), `nodes - 1` steps from `first_step`.
    HierRing { ag: bool, first_step: u32, stage: u32, out: bool },
    /// Hierarchical: inside each node, every GPU sends its chunks (those of its local index) to the
    /// node's other GPUs, at `step` and `stage`.
    HierIntraAg { step: u32, stage: u32, out: bool },
    /// A pipelined chain through ranks 0 … n-1: a Broadcast down it or a Reduce up it.
    Chain { reduce: bool },
}

/// The divisors [`Generated::op`] finds a block's loop indices with, per block.
#[derive(Copy, Clone, Debug)]
struct Divisors {
    /// Ops per outer iteration of the block (per step, or per sending rank).
    outer: Divisor,
    /// Ops per GPU within it (HM blocks).
    per_gpu: Divisor,
}

/// `x mod n` for `x < 2n`.
#[inline]
fn wrap(x: u32, n: u32) -> u32 {
    if x >= n { x - n } else { x }
}

/// `(a - b) mod n` for `a, b < n`.
#[inline]
fn sub_mod(a: u32, b: u32, n: u32) -> u32 {
    if a >= b { a - b } else { a + n - b }
}

/// Division of a `u32` by a fixed divisor as a multiplication (Lemire, Kaser and Kurz, "Faster
/// remainder by direct computation", 2019): exact for every `u32` dividend.
#[derive(Copy, Clone, Debug)]
struct Divisor {
    d: u32,
    /// `ceil(2^64 / d)`, for `d >= 2`.
    m: u64,
}

impl Divisor {
    fn new(d: u32) -> Divisor {
        Divisor { d, m: if d <= 1 { 0 } else { u64::MAX / d as u64 + 1 } }
    }

    /// `(x / d, x % d)` (`d` of 0 is never divided by: its blocks are empty).
    #[inline]
    fn divmod(self, x: u32) -> (u32, u32) {
        if self.d <= 1 {
            return (x, 0);
        }
        let q = ((self.m as u128 * x as u128) >> 64) as u32;
        (q, x - q * self.d)
    }
}

/// A transfer of one slice on channel 0.
#[allow(clippy::too_many_arguments)]
fn xfer(src_rank: u32, src: Slice, dst_rank: u32, dst: Slice, op: RecvOp, chunk: u32, step: u32, stage: u32) -> Op {
    Op {
        kind: OpKind::Transfer { src_rank: Rank(src_rank), dst_rank: Rank(dst_rank), channel: 0, src, dst, op },
        chunk,
        step,
        stage,
    }
}

fn buf(out: bool, c: u32) -> Slice {
    if out { Slice::output(c) } else { Slice::input(c) }
}

impl Generated {
    /// The blocks of the program, in order.
    fn block_list(&self) -> Vec<Block> {
        let (nodes, n) = (self.nodes, self.layout.ranks);
        let hm_ag = |first_step: u32, out: bool| {
            let last = nodes.saturating_sub(1).max(1);
            [
                Block::HmAgFirst { first_step, out },
                Block::HmAgLater { first_step, out, k0: 1, k1: last, nic: true },
                Block::HmAgLater { first_step, out, k0: last, k1: nodes.max(1), nic: false },
            ]
        };
        let last = nodes.saturating_sub(1);
        let hm_rs = [Block::HmRs { e0: 0, e1: last, nic: true }, Block::HmRs { e0: last, e1: nodes, nic: false }];
        match self.algo {
            Algorithm::RingAllReduce => vec![
                Block::RingRs { stage: 0 },
                Block::RingAg { first_step: n.saturating_sub(1), stage: 1, out: false },
            ],
            Algorithm::RingAllGather => vec![Block::RingAg { first_step: 0, stage: 0, out: true }],
            Algorithm::RingReduceScatter => vec![Block::RingRs { stage: 0 }],
            Algorithm::DirectAllReduce => vec![Block::DirectRs, Block::DirectBcast { out: false, step: 1 }],
            Algorithm::DirectAllGather => vec![Block::DirectBcast { out: true, step: 0 }],
            Algorithm::DirectReduceScatter => vec![Block::DirectRs],
            Algorithm::DirectAllToAll => vec![Block::AllToAll],
            Algorithm::HmAllGather => hm_ag(0, true).to_vec(),
            Algorithm::HmReduceScatter => hm_rs.to_vec(),
            Algorithm::HmAllReduce => [hm_rs.as_slice(), &hm_ag(nodes, false)].concat(),
            Algorithm::HierAllReduce => vec![
                Block::HierIntraRs,
                Block::HierRing { ag: false, first_step: 1, stage: 1, out: false },
                Block::HierRing { ag: true, first_step: nodes, stage: 2, out: false },
                Block::HierIntraAg { step: 2 * nodes - 1, stage: 3, out: false },
            ],
            Algorithm::HierReduceScatter => {
                vec![Block::HierIntraRs, Block::HierRing { ag: false, first_step: 1, stage: 1, out: false }]
            }
            Algorithm::HierAllGather => vec![
                Block::HierRing { ag: true, first_step: 0, stage: 0, out: true },
                Block::HierIntraAg { step: nodes - 1, stage: 1, out: true },
            ],
            Algorithm::ChainBroadcast => vec![Block::Chain { reduce: false }],
            Algorithm::ChainReduce => vec![Block::Chain { reduce: true }],
        }
    }

    /// The bytes the program takes stored ([`Algorithm::generate`]): its ops and its layout.
    pub fn program_bytes(&self) -> u64 {
        self.ops as u64 * std::mem::size_of::<Op>() as u64 + self.layout.ranks as u64 * 4 + 256
    }

    /// Calls `f` with every op, in order.
    pub fn for_each(&self, f: &mut impl FnMut(Op)) {
        for &(_, _, b, _) in &self.blocks {
            self.each_in(b, f);
        }
    }

    /// Ranks of node `s`: rank `s*g + l` is GPU `l` of node `s`.
    #[inline]
    fn rank(&self, s: u32, l: u32) -> u32 {
        s * self.gpus + l
    }

    /// Runs block `b`'s loop nest (the algorithm as its math reads).
    fn each_in(&self, b: Block, f: &mut impl FnMut(Op)) {
        let (nn, g, n) = (self.nodes, self.gpus, self.layout.ranks);
        match b {
            Block::RingRs { stage } => {
                // At step s rank r sends chunk r-s-1 to r+1, which reduces it.
                for s in 0..n.saturating_sub(1) {
                    for r in 0..n {
                        f(self.ring_rs(stage, s, r));
                    }
                }
            }
            Block::RingAg { first_step, stage, out } => {
                // At step s rank r forwards chunk r-s to r+1.
                for s in 0..n.saturating_sub(1) {
                    for r in 0..n {
                        f(self.ring_ag(first_step, stage, out, s, r));
                    }
                }
            }
            Block::DirectRs => {
                // Every rank sends chunk q to rank q, which reduces it.
                for q in 0..n {
                    for d in 1..n {
                        f(self.direct_rs(q, d));
                    }
                }
            }
            Block::DirectBcast { out, step } => {
                for r in 0..n {
                    for d in 1..n {
                        f(self.direct_bcast(out, step, r, d));
                    }
                }
            }
            Block::AllToAll => {
                for r in 0..n {
                    for j in 0..n {
                        f(self.alltoall(r, j));
                    }
                }
            }
            Block::HmAgFirst { first_step, out } => {
                for s in 0..nn {
                    for l in 0..g {
                        for j in 0..self.hm_ag_first_len() {
                            f(self.hm_ag_first(first_step, out, s, l, j));
                        }
                    }
                }
            }
            Block::HmAgLater { first_step, out, k0, k1, nic } => {
                for k in k0..k1 {
                    for s in 0..nn {
                        for l in 0..g {
                            for j in 0..(g - 1 + nic as u32) {
                                f(self.hm_ag_later(first_step, out, nic, k, s, l, j));
                            }
                        }
                    }
                }
            }
            Block::HmRs { e0, e1, nic } => {
                for e in e0..e1 {
                    for sq in 0..nn {
                        for lq in 0..g {
                            for d in 1..g {
                                f(self.hm_rs_local(e, sq, lq, d));
                            }
                        }
                    }
                    if nic {
                        for sq in 0..nn {
                            for lq in 0..g {
                                f(self.hm_rs_nic(e, sq, lq));
                            }
                        }
                    }
                }
            }
            Block::HierIntraRs | Block::HierIntraAg { .. } => {
                for s in 0..nn {
                    for l in 0..g {
                        for t in 0..nn {
                            for d in 1..g {
                                f(self.hier_intra(b, s, l, t, d));
                            }
                        }
                    }
                }
            }
            Block::HierRing { .. } => {
                for k in 0..nn.saturating_sub(1) {
                    for r in 0..n {
                        f(self.hier_ring(b, k, r));
                    }
                }
            }
            Block::Chain { reduce } => {
                // Hop k of every chunk, hop by hop: each hop reads what the one before wrote.
                for k in 0..n.saturating_sub(1) {
                    for c in 0..n {
                        f(self.chain(reduce, k, c));
                    }
                }
            }
        }
    }

    /// Number of ops of block `b`.
    fn len_of(&self, b: Block) -> u64 {
        let (nn, g, n) = (self.nodes as u64, self.gpus as u64, self.layout.ranks as u64);
        match b {
            Block::RingRs { .. } | Block::RingAg { .. } => n.saturating_sub(1) * n,
            Block::DirectRs | Block::DirectBcast { .. } => n * n.saturating_sub(1),
            Block::AllToAll => n * n,
            Block::HmAgFirst { .. } => nn * g * self.hm_ag_first_len() as u64,
            Block::HmAgLater { k0, k1, nic, .. } => k1.saturating_sub(k0) as u64 * nn * g * (g - 1 + nic as u64),
            Block::HmRs { e0, e1, nic } => e1.saturating_sub(e0) as u64 * (nn * g * (g - 1) + nic as u64 * nn * g),
            Block::HierIntraRs | Block::HierIntraAg { .. } => n * nn * (g - 1),
            Block::HierRing { .. } => nn.saturating_sub(1) * n,
            Block::Chain { .. } => n.saturating_sub(1) * n,
        }
    }

    /// The divisors of block `b`.
    fn divisors(&self, b: Block) -> Divisors {
        let (nn, g, n) = (self.nodes, self.gpus, self.layout.ranks);
        let (outer, per_gpu) = match b {
            Block::RingRs { .. } | Block::RingAg { .. } | Block::AllToAll | Block::Chain { .. } => (n, 1),
            Block::DirectRs | Block::DirectBcast { .. } => (n - 1, 1),
            Block::HmAgFirst { .. } => (self.hm_ag_first_len(), self.hm_ag_first_len()),
            Block::HmAgLater { nic, .. } => {
                let per = g - 1 + nic as u32;
                (nn * g * per, per)
            }
            Block::HmRs { nic, .. } => (nn * g * (g - 1) + nic as u32 * nn * g, 1),
            Block::HierIntraRs | Block::HierIntraAg { .. } => (g - 1, 1),
            Block::HierRing { .. } => (n, 1),
        };
        Divisors { outer: Divisor::new(outer), per_gpu: Divisor::new(per_gpu) }
    }

    /// Op `i` of block `b` (`i` below its length): the loop indices of [`Generated::each_in`].
    fn at_in(&self, b: Block, dv: Divisors, i: u32) -> Op {
        let g = self.gpus;
        match b {
            Block::RingRs { stage } => {
                let (s, r) = dv.outer.divmod(i);
                self.ring_rs(stage, s, r)
            }
            Block::RingAg { first_step, stage, out } => {
                let (s, r) = dv.outer.divmod(i);
                self.ring_ag(first_step, stage, out, s, r)
            }
            Block::DirectRs => {
                let (q, d) = dv.outer.divmod(i);
                self.direct_rs(q, d + 1)
            }
            Block::DirectBcast { out, step } => {
                let (r, d) = dv.outer.divmod(i);
                self.direct_bcast(out, step, r, d + 1)
            }
            Block::AllToAll => {
                let (r, j) = dv.outer.divmod(i);
                self.alltoall(r, j)
            }
            Block::HmAgFirst { first_step, out } => {
                let (sl, j) = dv.per_gpu.divmod(i);
                let (s, l) = self.gpus_div.divmod(sl);
                self.hm_ag_first(first_step, out, s, l, j)
            }
            Block::HmAgLater { first_step, out, k0, nic, .. } => {
                let (k, rest) = dv.outer.divmod(i);
                let (sl, j) = dv.per_gpu.divmod(rest);
                let (s, l) = self.gpus_div.divmod(sl);
                self.hm_ag_later(first_step, out, nic, k0 + k, s, l, j)
            }
            Block::HmRs { e0, .. } => {
                let local = self.nodes * g * (g - 1);
                let (e, j) = dv.outer.divmod(i);
                if j < local {
                    let (sl, d) = self.peers_div.divmod(j);
                    let (sq, lq) = self.gpus_div.divmod(sl);
                    self.hm_rs_local(e0 + e, sq, lq, d + 1)
                } else {
                    let (sq, lq) = self.gpus_div.divmod(j - local);
                    self.hm_rs_nic(e0 + e, sq, lq)
                }
            }
            Block::HierIntraRs | Block::HierIntraAg { .. } => {
                let (slt, d) = dv.outer.divmod(i);
                let (sl, t) = self.nodes_div.divmod(slt);
                let (s, l) = self.gpus_div.divmod(sl);
                self.hier_intra(b, s, l, t, d + 1)
            }
            Block::HierRing { .. } => {
                let (k, r) = dv.outer.divmod(i);
                self.hier_ring(b, k, r)
            }
            Block::Chain { reduce } => {
                let (k, c) = dv.outer.divmod(i);
                self.chain(reduce, k, c)
            }
        }
    }

    /// Hop `k` of chunk `c` down the chain from rank 0 (a Broadcast: `k` to `k+1`) or up it to
    /// rank 0 (a Reduce: `n-1-k` adds its partial into `n-2-k`), at step `c + k`.
    fn chain(&self, reduce: bool, k: u32, c: u32) -> Op {
        let n = self.layout.ranks;
        let sl = Slice::input(c);
        if reduce {
            xfer(n - 1 - k, sl, n - 2 - k, sl, RecvOp::RecvReduceCopy, c, c + k, 0)
        } else {
            xfer(k, sl, k + 1, sl, RecvOp::Recv, c, c + k, 0)
        }
    }

    fn ring_rs(&self, stage: u32, s: u32, r: u32) -> Op {
        let n = self.layout.ranks;
        let c = sub_mod(r, s + 1, n);
        xfer(r, Slice::input(c), wrap(r + 1, n), Slice::input(c), RecvOp::RecvReduceCopy, c, s, stage)
    }

    fn ring_ag(&self, first_step: u32, stage: u32, out: bool, s: u32, r: u32) -> Op {
        let n = self.layout.ranks;
        let c = sub_mod(r, s, n);
        xfer(r, buf(out, c), wrap(r + 1, n), buf(out, c), RecvOp::Recv, c, first_step + s, stage)
    }

    fn direct_rs(&self, q: u32, d: u32) -> Op {
        let r = wrap(q + d, self.layout.ranks);
        xfer(r, Slice::input(q), q, Slice::input(q), RecvOp::RecvReduceCopy, q, 0, 0)
    }

    fn direct_bcast(&self, out: bool, step: u32, r: u32, d: u32) -> Op {
        let q = wrap(r + d, self.layout.ranks);
        xfer(r, buf(out, r), q, buf(out, r), RecvOp::Recv, r, step, step)
    }

    /// Block `q` of rank `r`'s input goes to block `r` of rank `q`'s output (`j`-th op of rank `r`:
    /// its own block first, as a local copy).
    fn alltoall(&self, r: u32, j: u32) -> Op {
        if j == 0 {
            return Op {
                kind: OpKind::Copy { rank: Rank(r), channel: 0, src: Slice::input(r), dst: Slice::output(r) },
                chunk: r,
                step: 0,
                stage: 0,
            };
        }
        let q = wrap(r + j, self.layout.ranks);
        xfer(r, Slice::input(q), q, Slice::output(r), RecvOp::Recv, q, 0, 0)
    }

    /// Ops per GPU of the HM AllGather's first step: one to each local peer, one over the NIC.
    fn hm_ag_first_len(&self) -> u32 {
        self.gpus - 1 + u32::from(self.nodes > 1)
    }

    /// Stage 0, first step: GPU `l` of node `s` sends its chunk to local GPU `l+j+1` (`j < g-1`),
    /// then over the NIC to GPU `l` of the next node.
    fn hm_ag_first(&self, first_step: u32, out: bool, s: u32, l: u32, j: u32) -> Op {
        let (nn, g) = (self.nodes, self.gpus);
        let r = self.rank(s, l);
        let dst = if j < g - 1 { self.rank(s, wrap(l + j + 1, g)) } else { self.rank(wrap(s + 1, nn), l) };
        xfer(r, buf(out, r), dst, buf(out, r), RecvOp::Recv, r, first_step, 0)
    }

    /// Step `first_step + k`: GPU `l` of node `s` forwards the chunk of node `s-k` that came over
    /// the NIC: first on to the next node (stage 0, when `nic`), then to local GPU `l+d` (stage 1).
    #[allow(clippy::too_many_arguments)]
    fn hm_ag_later(&self, first_step: u32, out: bool, nic: bool, k: u32, s: u32, l: u32, j: u32) -> Op {
        let (nn, g) = (self.nodes, self.gpus);
        let r = self.rank(s, l);
        let q = self.rank(sub_mod(s, k, nn), l);
        let sl = buf(out, q);
        if nic && j == 0 {
            return xfer(r, sl, self.rank(wrap(s + 1, nn), l), sl, RecvOp::Recv, q, first_step + k, 0);
        }
        let d = j + 1 - u32::from(nic);
        xfer(r, sl, self.rank(s, wrap(l + d, g)), sl, RecvOp::Recv, q, first_step + k, 1)
    }

    /// Step `e`'s local reduction of chunk `q` (GPU `lq` of node `sq`) on the node at ring position
    /// `e` from `sq+1`: local GPU `lq+d` reduces its contribution onto GPU `lq` (stage 1 on the
    /// owner's node, at the last step; stage 0 before).
    fn hm_rs_local(&self, e: u32, sq: u32, lq: u32, d: u32) -> Op {
        let (nn, g) = (self.nodes, self.gpus);
        let stage = u32::from(e + 1 == nn);
        let s = wrap(wrap(sq + 1, nn) + e, nn);
        let q = self.rank(sq, lq);
        let sl = Slice::input(q);
        xfer(self.rank(s, wrap(lq + d, g)), sl, self.rank(s, lq), sl, RecvOp::RecvReduceCopy, q, e, stage)
    }

    /// Step `e`'s NIC hop of chunk `q`: GPU `lq` passes the node's partial sum to the next node.
    fn hm_rs_nic(&self, e: u32, sq: u32, lq: u32) -> Op {
        let nn = self.nodes;
        let s = wrap(wrap(sq + 1, nn) + e, nn);
        let q = self.rank(sq, lq);
        let sl = Slice::input(q);
        xfer(self.rank(s, lq), sl, self.rank(wrap(s + 1, nn), lq), sl, RecvOp::RecvReduceCopy, q, e, 0)
    }
}

impl Generated {
    /// Chunk `t·g + l` inside node `s` ([`Block::HierIntraRs`], [`Block::HierIntraAg`]): between
    /// GPU `l` and GPU `l+d`.
    fn hier_intra(&self, b: Block, s: u32, l: u32, t: u32, d: u32) -> Op {
        let g = self.gpus;
        let (owner, other) = (self.rank(s, l), self.rank(s, wrap(l + d, g)));
        let q = self.rank(t, l);
        match b {
            Block::HierIntraAg { step, stage, out } => {
                xfer(owner, buf(out, q), other, buf(out, q), RecvOp::Recv, q, step, stage)
            }
            _ => xfer(other, Slice::input(q), owner, Slice::input(q), RecvOp::RecvReduceCopy, q, 0, 0),
        }
    }

    /// Ring step `k` of [`Block::HierRing`] from rank `r` (GPU `l` of node `s`) to GPU `l` of the
    /// next node: the chunk of local index `l` and node `s-k-1` (ReduceScatter) or `s-k`
    /// (AllGather).
    fn hier_ring(&self, b: Block, k: u32, r: u32) -> Op {
        let Block::HierRing { ag, first_step, stage, out } = b else { unreachable!("a ring block") };
        let (s, l) = self.gpus_div.divmod(r);
        let nn = self.nodes;
        let t = if ag { sub_mod(s, k, nn) } else { sub_mod(s, k + 1, nn) };
        let q = self.rank(t, l);
        let op = if ag { RecvOp::Recv } else { RecvOp::RecvReduceCopy };
        xfer(r, buf(out, q), self.rank(wrap(s + 1, nn), l), buf(out, q), op, q, first_step + k, stage)
    }
}

impl OpSource for Generated {
    fn name(&self) -> &str {
        &self.name
    }
    fn layout(&self) -> &BufferLayout {
        &self.layout
    }
    fn ranks_per_node(&self) -> Option<u32> {
        Some(self.gpus)
    }
    fn op_count(&self) -> usize {
        self.ops
    }
    fn op(&self, id: OpId) -> Op {
        let i = id.index() as u64;
        let &(start, _, b, dv) = self
            .blocks
            .iter()
            .find(|&&(start, len, _, _)| i >= start && i - start < len)
            .unwrap_or_else(|| panic!("{id} is beyond the {} ops of {}", self.ops, self.name));
        self.at_in(b, dv, (i - start) as u32)
    }
    fn try_for_each_op<E>(&self, mut f: impl FnMut(OpId, &Op) -> Result<(), E>) -> Result<(), E> {
        let mut next = 0u32;
        let mut failed = None;
        self.for_each(&mut |op| {
            if failed.is_none()
                && let Err(e) = f(OpId(next), &op)
            {
                failed = Some(e);
            }
            next += 1;
        });
        failed.map_or(Ok(()), Err)
    }
    fn verify(&self) -> Result<(), ProgramError> {
        Program::check_name(&self.name)?;
        self.layout.validate()
    }
}
