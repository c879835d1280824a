//! T-CCL plans: AllReduce, ReduceScatter, AllGather, Broadcast and Reduce as shard-in / shard-out
//! task lists.
//!
//! Each rank owns a balanced slice (shard) of the data, cut on 16-byte boundaries for AllReduce,
//! Broadcast and Reduce (ReduceScatter's and AllGather's shard is the rank's block, wherever the
//! block size puts it); its shard is cut into one piece per CTA. For the piece of CTA `c` of owner `r`:
//! - **shard-in** pulls the piece from every rank and reduces it;
//! - **shard-out** stores the reduced piece to every rank.
//!
//! With [`Reduction::Registers`] (the default) the two are one task: the owner's CTA bulk-loads the
//! piece of every rank into shared memory, its threads combine them in ascending rank order, and the
//! result is stored to every rank (from registers, or as one shared copy bulk-stored: the
//! communicator's `Config::combine_direct`): each input byte is read once and each output byte written
//! once, and the result is bitwise reproducible. With [`Reduction::Tma`] the owner copies its own piece
//! to its output, reduces every peer's piece into it with `cp.reduce.async.bulk` (order between peers
//! not fixed), then loads the result and stores it to every peer.
//!
//! ReduceScatter is shard-in alone; AllGather is shard-out alone. Broadcast is shard-out of the root's
//! data: each owner loads its shard of the root's input once and stores it to every rank. Reduce is
//! shard-in whose result goes to the root only: each owner combines its shard of every rank's input
//! and stores it into the root's output (with [`Reduction::Tma`]: copies the root's piece there and
//! bulk-reduces the other ranks' pieces into it). Plans are pure data ([`Lowered`]), executed by the
//! GPU engine and, in CI, by [`crate::lowered::execute`].

use crate::lowered::Lowered;
use oxccl_kernels::abi::{
    DType, MAX_CTAS_PER_RANK, MAX_RANKS, RedOp, TASK_AFTER_WRITES, Task, TaskKind, slot, tma_can_reduce,
};

pub use crate::collective::Collective;

/// How reductions are performed (see the module documentation).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum Reduction {
    /// Sources combined in registers in ascending rank order: deterministic, fewest bytes moved.
    #[default]
    Registers,
    /// Sources reduced into the owner's shard by `cp.reduce.async.bulk`; order between sources not
    /// fixed. Where the hardware cannot bulk-reduce the (dtype, operator) ([`PlanSpec::bulk`] is
    /// false), the plan is [`Reduction::Registers`]'s.
    Tma,
}

/// Everything a plan depends on (the plan-cache key).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PlanSpec {
    /// The collective, with its root where it has one.
    pub collective: Collective,
    /// Elements per rank: of each buffer for AllReduce, Broadcast and Reduce, of the output for
    /// ReduceScatter, of the input for AllGather, of each block (one per rank) for AllToAll
    /// (nccl's `count`).
    pub count: u64,
    /// The element type; its size turns `count` into bytes.
    pub dtype: DType,
    /// The reduction operator (written into every task; AllGather and Broadcast do not use it).
    pub op: RedOp,
    /// Ranks of the communicator, 1..=[`MAX_RANKS`].
    pub ranks: usize,
    /// Whether the output aliases the input, as in nccl ([`PlanSpec::aliases`]).
    pub in_place: bool,
    /// CTAs per rank.
    pub ctas: u32,
    /// How shard-in combines the ranks' pieces.
    pub reduction: Reduction,
}

/// Why a plan cannot be built.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    /// `ranks` is 0 or above what one launch can address.
    #[error("{ranks} ranks: must be 1..={max}")]
    Ranks {
        /// The requested ranks ([`PlanSpec::ranks`]).
        ranks: usize,
        /// The most one launch addresses ([`MAX_RANKS`]).
        max: usize,
    },
    /// `ctas` is 0 or above the engine's limit.
    #[error("{ctas} CTAs per rank: must be 1..={max}")]
    Ctas {
        /// The requested CTAs per rank ([`PlanSpec::ctas`]).
        ctas: u32,
        /// The engine's limit ([`MAX_CTAS_PER_RANK`]).
        max: u32,
    },
    /// The root of a Broadcast or Reduce is not one of the ranks.
    #[error("root {root}: must be one of the {ranks} ranks")]
    Root {
        /// The requested root.
        root: u32,
        /// The spec's ranks.
        ranks: usize,
    },
    /// The collective has no in-place form ([`Collective::has_in_place`]).
    #[error("{collective} has no in-place form")]
    InPlace {
        /// The collective's name.
        collective: &'static str,
    },
    /// A buffer would exceed the address space.
    #[error("count {count} overflows a buffer size")]
    TooLarge {
        /// The requested elements per rank: `count` × element size × `ranks` does not fit in a
        /// `u64` (checked for every collective).
        count: u64,
    },
}

impl PlanSpec {
    /// Whether the plan reduces by `cp.reduce.async.bulk`: [`Reduction::Tma`] asked for, and the
    /// hardware takes the (dtype, operator). Otherwise every reduction combines in registers, in
    /// ascending rank order, whatever [`PlanSpec::reduction`] says.
    pub fn bulk(&self) -> bool {
        self.reduction == Reduction::Tma && tma_can_reduce(self.dtype, self.op)
    }

    /// Bytes of each rank's (input, output) buffer; `u64::MAX` where that does not fit in a `u64`
    /// (such a spec is [`PlanError::TooLarge`] for [`plan`]), so no size wraps to a small one. For
    /// Broadcast and Reduce, the root's (out of place, only the root has an input, resp. an output:
    /// [`PlanSpec::rank_buffers`]).
    pub fn buffer_bytes(&self) -> (u64, u64) {
        let b = self.count.saturating_mul(self.dtype.size() as u64);
        let p = self.ranks as u64;
        match self.collective {
            Collective::AllReduce | Collective::Broadcast { .. } | Collective::Reduce { .. } => (b, b),
            Collective::ReduceScatter => (b.saturating_mul(p), b),
            Collective::AllGather => (b, b.saturating_mul(p)),
            Collective::AllToAll => (b.saturating_mul(p), b.saturating_mul(p)),
        }
    }

    /// Whether rank `r` has an (input, output) buffer: every rank has both (in place, its one
    /// buffer), except out of place a Broadcast's input and a Reduce's output off the root, which
    /// the plan never addresses.
    pub fn rank_buffers(&self, r: usize) -> (bool, bool) {
        match (self.collective, self.in_place) {
            (Collective::Broadcast { root }, false) => (r == root as usize, true),
            (Collective::Reduce { root }, false) => (true, r == root as usize),
            _ => (true, true),
        }
    }

    /// For in-place plans, where the input of each rank lives: (rank, slot, aliased rank, aliased
    /// slot, byte offset). In-place follows nccl: AllReduce, Broadcast and Reduce input = output;
    /// ReduceScatter output = input + rank × block; AllGather input = output + rank × block. Like [`PlanSpec::buffer_bytes`],
    /// an offset that does not fit in a `u64` is `u64::MAX` (past any buffer), never a wrapped one.
    pub fn aliases(&self) -> Vec<crate::lowered::Alias> {
        if !self.in_place {
            return Vec::new();
        }
        let block = self.count.saturating_mul(self.dtype.size() as u64);
        let at = |r: usize| (r as u64).saturating_mul(block);
        (0..self.ranks)
            .map(|r| match self.collective {
                // AllToAll has no in-place plan ([`PlanError::InPlace`]).
                Collective::AllReduce
                | Collective::Broadcast { .. }
                | Collective::Reduce { .. }
                | Collective::AllToAll => (r, slot::OUTPUT, r, slot::INPUT, 0),
                Collective::ReduceScatter => (r, slot::OUTPUT, r, slot::INPUT, at(r)),
                Collective::AllGather => (r, slot::INPUT, r, slot::OUTPUT, at(r)),
            })
            .collect()
    }

    /// Whether the call writes rank `r`'s output (in place, its one buffer): every rank's, except a
    /// Broadcast's root in place and a Reduce's other ranks, which keep theirs as they are (out of
    /// place, those have none: [`PlanSpec::rank_buffers`]).
    pub fn writes(&self, r: usize) -> bool {
        match self.collective {
            Collective::Broadcast { root } if self.in_place => r != root as usize,
            Collective::Reduce { root } => r == root as usize,
            _ => true,
        }
    }

    /// The addresses rank `r`'s input and output slots hold, given its buffers: out of place its
    /// `input` and `output` (0 where it has none, [`PlanSpec::rank_buffers`]); in place its one
    /// buffer `output`, the input slot placed as [`PlanSpec::aliases`] says (ReduceScatter's output
    /// at block `r` of it, AllGather's input there).
    pub fn slot_addresses(&self, r: usize, input: u64, output: u64) -> (u64, u64) {
        if !self.in_place {
            return (input, output);
        }
        let block = self.count * self.dtype.size() as u64;
        match self.collective {
            Collective::ReduceScatter => (output, output + r as u64 * block),
            Collective::AllGather => (output + r as u64 * block, output),
            _ => (output, output),
        }
    }
}

/// Splits `total` bytes into `parts` contiguous ranges whose boundaries fall on multiples of `grain`
/// (except the end), as evenly as whole grains allow. Returns the `i`-th range (empty at `total` for
/// `i >= parts`). A `parts` or `grain` of 0 counts as 1.
pub fn split(total: u64, parts: u64, grain: u64, i: u64) -> (u64, u64) {
    let (parts, grain) = (parts.max(1), grain.max(1));
    // In u128: grains × (i + 1) overflows u64 for buffers near the address-space limit.
    // `i` past `parts` is the empty range at the end; clamped first so the product stays below
    // 2^64 × 2^64.
    let i = i.min(parts);
    let (grains, parts, grain, i) = (total.div_ceil(grain) as u128, parts as u128, grain as u128, i as u128);
    let at = |k: u128| ((grains * k / parts * grain).min(total as u128)) as u64;
    (at(i), at(i + 1))
}

/// Bulk copies need 16-byte-aligned ranges: shard and piece boundaries fall on 16-byte multiples.
const GRAIN: u64 = 16;

/// Builds the plan.
pub fn plan(spec: &PlanSpec) -> Result<Lowered, PlanError> {
    let p = spec.ranks;
    if p == 0 || p > MAX_RANKS {
        return Err(PlanError::Ranks { ranks: p, max: MAX_RANKS });
    }
    if spec.ctas == 0 || spec.ctas as usize > MAX_CTAS_PER_RANK {
        return Err(PlanError::Ctas { ctas: spec.ctas, max: MAX_CTAS_PER_RANK as u32 });
    }
    if let Some(root) = spec.collective.root()
        && root >= p
    {
        return Err(PlanError::Root { root: root as u32, ranks: p });
    }
    if spec.in_place && !spec.collective.has_in_place() {
        return Err(PlanError::InPlace { collective: spec.collective.name() });
    }
    let elem = spec.dtype.size() as u64;
    let block = spec.count.checked_mul(elem).filter(|b| b.checked_mul(p as u64).is_some());
    let Some(block) = block else {
        return Err(PlanError::TooLarge { count: spec.count });
    };
    let all: u32 = if p == 32 { u32::MAX } else { (1u32 << p) - 1 };
    let task = |kind: TaskKind,
                src: u32,
                src_slot: u8,
                src_offset: u64,
                dst: u32,
                dst_slot: u8,
                dst_offset: u64,
                bytes: u64,
                flags: u8| Task {
        kind: kind.raw(),
        dtype: spec.dtype.raw(),
        op: spec.op.raw(),
        src_slot,
        dst_slot,
        flags,
        // Every combining task of these plans completes its reductions: Avg divides there.
        divisor: if spec.op == RedOp::Avg && (kind == TaskKind::ReduceInto || src.count_ones() > 1) {
            p as u16
        } else {
            0
        },
        src_ranks: src,
        dst_ranks: dst,
        src_offset,
        dst_offset,
        bytes,
    };
    let c = spec.ctas as u64;
    let tma = spec.bulk();
    // A ReduceInto the hardware bulk-reduces is one stream per source through slot 0, issued by one
    // thread: no stage holds two sources and no warp combines, so the CTA can be a single warp that
    // leaves the SM's threads and most of its shared memory to other kernels.
    let (reduce_into_slots, reduce_into_combines) = (1, false);
    // Shard-in of one piece into one rank's output (ReduceScatter's owner, Reduce's root): every
    // rank's input at `src_at`, reduced, → rank mask `to`'s output at `a`, `n` bytes. In place, `to`'s
    // own input is there already. Returns the slots and whether a warp combines.
    let shard_in = |tasks: &mut Vec<Task>, src_at: u64, to: u32, a: u64, n: u64| -> (u32, bool) {
        use TaskKind::{Move, ReduceInto};
        let (inp, out) = (slot::INPUT, slot::OUTPUT);
        if p == 1 || !tma {
            if !(p == 1 && spec.in_place) {
                tasks.push(task(Move, all, inp, src_at, to, out, a, n, 0));
            }
            (p as u32, p > 1)
        } else {
            // `to`'s piece first, then the others' reduced into it.
            let mut flags = 0;
            if !spec.in_place {
                tasks.push(task(Move, to, inp, src_at, to, out, a, n, 0));
                flags = TASK_AFTER_WRITES;
            }
            tasks.push(task(ReduceInto, all & !to, inp, src_at, to, out, a, n, flags));
            (reduce_into_slots, reduce_into_combines)
        }
    };
    let mut programs = Vec::with_capacity(p * spec.ctas as usize);
    let mut tasks = Vec::new();
    let mut slots = 1;
    let mut combines = false;
    for r in 0..p {
        let me = 1u32 << r;
        let others = all & !me;
        // The bytes rank r owns: for AllReduce a 1/P shard of the buffer; for ReduceScatter and
        // AllGather its whole block (block r of the reduction, or its own input). Then this CTA's piece.
        let shard = match spec.collective {
            Collective::AllReduce | Collective::Broadcast { .. } | Collective::Reduce { .. } => {
                split(block, p as u64, GRAIN, r as u64)
            }
            Collective::ReduceScatter | Collective::AllGather | Collective::AllToAll => (0, block),
        };
        for cta in 0..c {
            let (lo, hi) = split(shard.1 - shard.0, c, GRAIN, cta);
            let (a, n) = (shard.0 + lo, hi - lo);
            let first = tasks.len() as u32;
            if n > 0 {
                use TaskKind::{Move, ReduceInto};
                let (inp, out) = (slot::INPUT, slot::OUTPUT);
                match spec.collective {
                    Collective::AllReduce if p == 1 => {
                        if !spec.in_place {
                            tasks.push(task(Move, me, inp, a, me, out, a, n, 0));
                        }
                    }
                    Collective::AllReduce if !tma => {
                        tasks.push(task(Move, all, inp, a, all, out, a, n, 0));
                        slots = slots.max(p as u32);
                        combines = true;
                    }
                    Collective::AllReduce => {
                        // Own contribution first, then the peers' reduced into it, then shard-out.
                        let mut flags = 0;
                        if !spec.in_place {
                            tasks.push(task(Move, me, inp, a, me, out, a, n, 0));
                            flags = TASK_AFTER_WRITES;
                        }
                        tasks.push(task(ReduceInto, others, inp, a, me, out, a, n, flags));
                        tasks.push(task(Move, me, out, a, others, out, a, n, TASK_AFTER_WRITES));
                        slots = slots.max(reduce_into_slots);
                        combines |= reduce_into_combines;
                    }
                    Collective::ReduceScatter => {
                        // Block r of every rank's input → rank r's output.
                        let (s, c) = shard_in(&mut tasks, r as u64 * block + a, me, a, n);
                        slots = slots.max(s);
                        // Bulk-reduced blocks that are not 16-byte multiples put the sources and the
                        // destination at different offsets modulo 16: the kernel then reduces
                        // element by element with every thread, so keep the CTA's warps.
                        combines |= c || (tma && p > 1 && block % GRAIN != 0);
                    }
                    Collective::AllGather => {
                        // Rank r's input → block r of every rank's output.
                        let dst_at = r as u64 * block + a;
                        let dsts = if spec.in_place { others } else { all };
                        if dsts != 0 {
                            tasks.push(task(Move, me, inp, a, dsts, out, dst_at, n, 0));
                        }
                    }
                    Collective::Broadcast { root } => {
                        // Piece a of the root's input → every rank's output (the root's own is its
                        // input in place).
                        let from = 1u32 << root;
                        let dsts = if spec.in_place { all & !from } else { all };
                        if dsts != 0 {
                            tasks.push(task(Move, from, inp, a, dsts, out, a, n, 0));
                        }
                    }
                    Collective::Reduce { root } => {
                        // Piece a of every rank's input, reduced, → the root's output.
                        let (s, c) = shard_in(&mut tasks, a, 1u32 << root, a, n);
                        slots = slots.max(s);
                        combines |= c;
                    }
                    Collective::AllToAll => {
                        // Piece a of block j of rank r's input → block r of rank j's output, the
                        // destinations taken from r + 1 on, so that the ranks start on different
                        // peers.
                        for k in 1..=p {
                            let j = (r + k) % p;
                            tasks.push(task(
                                Move,
                                me,
                                inp,
                                j as u64 * block + a,
                                1 << j,
                                out,
                                r as u64 * block + a,
                                n,
                                0,
                            ));
                        }
                    }
                }
            }
            programs.push(crate::lowered::meeting_all(r, cta as usize, first, tasks.len() as u32 - first, p));
        }
    }
    Ok(Lowered { programs, tasks, ranks: p, slots, combines })
}

/// What a checked call's outputs hold before it, `len` bytes: a value no correct result has and
/// that a wrong reduction into it keeps, so an element the call fails to write, or combines into
/// instead of overwriting, differs from [`reference()`]: NaN for float sums and copies (AllGather,
/// Broadcast), the operator's absorbing extreme for Min and Max (-inf, `i32::MIN`, 0 for Min;
/// +inf, `i32::MAX`, `u32::MAX` for Max; u32 inputs must then be at least 1), 0xA5 bytes for integer
/// sums.
pub fn poison(spec: &PlanSpec, len: usize) -> Vec<u8> {
    use half::{bf16, f16};
    let op = if spec.collective.reduces() { spec.op } else { RedOp::Sum };
    let one: Vec<u8> = match (spec.dtype, op) {
        (DType::F32, RedOp::Sum) => f32::NAN.to_le_bytes().to_vec(),
        (DType::F32, RedOp::Min) => f32::NEG_INFINITY.to_le_bytes().to_vec(),
        (DType::F32, RedOp::Max) => f32::INFINITY.to_le_bytes().to_vec(),
        (DType::F16, RedOp::Sum) => f16::NAN.to_le_bytes().to_vec(),
        (DType::F16, RedOp::Min) => f16::NEG_INFINITY.to_le_bytes().to_vec(),
        (DType::F16, RedOp::Max) => f16::INFINITY.to_le_bytes().to_vec(),
        (DType::Bf16, RedOp::Sum) => bf16::NAN.to_le_bytes().to_vec(),
        (DType::Bf16, RedOp::Min) => bf16::NEG_INFINITY.to_le_bytes().to_vec(),
        (DType::Bf16, RedOp::Max) => bf16::INFINITY.to_le_bytes().to_vec(),
        (DType::I32, RedOp::Min) => i32::MIN.to_le_bytes().to_vec(),
        (DType::I32, RedOp::Max) => i32::MAX.to_le_bytes().to_vec(),
        (DType::U32, RedOp::Min) => 0u32.to_le_bytes().to_vec(),
        (DType::U32, RedOp::Max) => u32::MAX.to_le_bytes().to_vec(),
        (DType::F32, RedOp::Prod | RedOp::Avg) => f32::NAN.to_le_bytes().to_vec(),
        (DType::F16, RedOp::Prod | RedOp::Avg) => f16::NAN.to_le_bytes().to_vec(),
        (DType::Bf16, RedOp::Prod | RedOp::Avg) => bf16::NAN.to_le_bytes().to_vec(),
        (DType::I32 | DType::U32, RedOp::Sum | RedOp::Prod | RedOp::Avg) => vec![0xA5; 4],
        (DType::U8, RedOp::Min) => vec![0],
        (DType::U8, RedOp::Max) => vec![u8::MAX],
        (DType::U8, RedOp::Sum | RedOp::Prod | RedOp::Avg) => vec![0xA5],
        (DType::I8, RedOp::Min) => vec![i8::MIN as u8],
        (DType::I8, RedOp::Max) => vec![i8::MAX as u8],
        (DType::I8, RedOp::Sum | RedOp::Prod | RedOp::Avg) => vec![0xA5],
        (DType::F64, RedOp::Min) => f64::NEG_INFINITY.to_le_bytes().to_vec(),
        (DType::F64, RedOp::Max) => f64::INFINITY.to_le_bytes().to_vec(),
        (DType::F64, RedOp::Sum | RedOp::Prod | RedOp::Avg) => f64::NAN.to_le_bytes().to_vec(),
        (DType::I64, RedOp::Min) => i64::MIN.to_le_bytes().to_vec(),
        (DType::I64, RedOp::Max) => i64::MAX.to_le_bytes().to_vec(),
        (DType::U64, RedOp::Min) => 0u64.to_le_bytes().to_vec(),
        (DType::U64, RedOp::Max) => u64::MAX.to_le_bytes().to_vec(),
        (DType::I64 | DType::U64, RedOp::Sum | RedOp::Prod | RedOp::Avg) => vec![0xA5; 8],
        // NaN, or the largest finite magnitude: a Min or Max through f32 and back keeps it, where
        // an infinity would come back saturated.
        (DType::F8e4m3 | DType::F8e5m2, RedOp::Sum | RedOp::Prod | RedOp::Avg) => vec![0x7f],
        (DType::F8e4m3, RedOp::Min) => vec![0xfe],
        (DType::F8e4m3, RedOp::Max) => vec![0x7e],
        (DType::F8e5m2, RedOp::Min) => vec![0xfb],
        (DType::F8e5m2, RedOp::Max) => vec![0x7b],
    };
    one.iter().copied().cycle().take(len).collect()
}

/// The collective computed directly from its definition (no plan involved): the reference the plans'
/// results are compared with. `inputs[r]` is rank `r`'s input buffer (bytes); returns every rank's
/// output buffer. For in-place specs the inputs are given as they are before the call (for AllGather
/// in place: rank r's own block) and outputs are the buffers after it. Out of place, a rank without an
/// output (a Reduce's off the root) gets an empty one, and a Broadcast reads only the root's input.
///
/// # Panics
/// A test oracle: `inputs` must hold `spec.ranks ≥ 1` buffers of at least the spec's input size
/// (check the spec with [`plan`] first).
pub fn reference(spec: &PlanSpec, inputs: &[Vec<u8>]) -> Vec<Vec<u8>> {
    let block = spec.count as usize * spec.dtype.size();
    let p = spec.ranks;
    let reduce = |slices: Vec<&[u8]>| -> Vec<u8> {
        let mut acc = slices[0].to_vec();
        for s in &slices[1..] {
            crate::lowered::combine_into(spec.dtype, spec.op, &mut acc, s);
        }
        crate::lowered::finish_into(spec.dtype, spec.op, &mut acc, slices.len() as u32);
        acc
    };
    match spec.collective {
        Collective::AllReduce => {
            let sum = reduce(inputs.iter().map(|v| &v[..block]).collect());
            vec![sum; p]
        }
        Collective::ReduceScatter => (0..p)
            .map(|r| {
                let res = reduce(inputs.iter().map(|v| &v[r * block..(r + 1) * block]).collect());
                if spec.in_place {
                    let mut buf = inputs[r].clone();
                    buf[r * block..(r + 1) * block].copy_from_slice(&res);
                    buf
                } else {
                    res
                }
            })
            .collect(),
        Collective::AllGather => {
            let cat: Vec<u8> = inputs.iter().flat_map(|v| v[..block].iter().copied()).collect();
            vec![cat; p]
        }
        Collective::Broadcast { root } => vec![inputs[root as usize][..block].to_vec(); p],
        Collective::AllToAll => (0..p)
            .map(|r| inputs.iter().flat_map(|v| v[r * block..(r + 1) * block].iter().copied()).collect())
            .collect(),
        Collective::Reduce { root } => {
            let res = reduce(inputs.iter().map(|v| &v[..block]).collect());
            (0..p)
                .map(|r| match (r == root as usize, spec.in_place) {
                    (true, _) => res.clone(),
                    (false, true) => inputs[r][..block].to_vec(),
                    (false, false) => Vec::new(),
                })
                .collect()
        }
    }
}
