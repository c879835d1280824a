//! Lowering: a [`ReshardPlan`] becomes engine descriptors, one [`Lowered`] program per stage, launched
//! in order (stream order between launches separates the stages).
//!
//! # Buffers
//!
//! Each rank's buffers are named by [`slot`]: its source shard is [`slot::INPUT`], its destination
//! shard [`slot::OUTPUT`] (a rank in both meshes has both; they are distinct, reshard is out of place).
//! A transfer reading [`ReadFrom::Src`] reads the reader's `INPUT`; one reading [`ReadFrom::Dst`]
//! (hierarchical forwarding, stage 1) reads the forwarding rank's `OUTPUT`, filled in stage 0. Only the
//! gather + broadcast workaround ([`super::workaround`]) uses [`slot::SCRATCH`].
//!
//! # Row loops
//!
//! An engine task moves one contiguous byte range, so a transfer box becomes one `Move` per contiguous
//! run: its loops are unrolled into `Π shape[..n-1]` tasks of `shape[n-1]` bytes, each with
//! `src_ranks = 1 << reader` (with the other sources' bits for a sum), `dst_ranks = 1 << writer`. The planner already merged the dims of a box
//! that are contiguous on both sides; here runs of one (reader, slot, writer, slot) pair that continue
//! each other on both sides are merged across transfers too (a leader forwarding adjacent parts to one
//! peer, row pieces that meet). Boxes whose rows are short stay many tasks: the task count follows the
//! rows, not the bytes, and [`LowerOptions::max_tasks`] bounds it with a typed error. (The alternative,
//! `cp.async.bulk.tensor` boxes, needs device code the engine does not have yet.)
//!
//! # Copy unit
//!
//! The engine moves bytes but checks every offset and length against the task's [`DType`] size, and
//! its kernels exist for 2- and 4-byte types only. [`LowerOptions::dtype`] names the unit when the
//! caller knows the element type (its size must divide the element size). Otherwise: 4-byte elements
//! (and multiples of 4) move as `F32`, 2-byte ones (and other even sizes) as `F16`; odd sizes (1-, 3-byte
//! elements) move as the largest of `F32`/`F16` that divides every offset, stride and run of the plan,
//! and a plan with an odd offset or run is refused with [`LowerError::NoCopyUnit`]: a 1-byte unit
//! would need an engine kernel that does not exist, and splitting an odd run across units would write
//! bytes that belong to another rank's shard position.
//!
//! # Sums
//!
//! A transfer from a `Partial` source sums the partial sums of a box: its runs read every source
//! rank at the same offsets (`src_ranks` holds them all; the engine adds them in ascending rank
//! order, as the CPU executor does), so it moves whole elements of its type, which
//! [`LowerOptions::dtype`] must name ([`LowerError::SumUnit`]), and needs a shared-memory slot per
//! source ([`Lowered::slots`]). Its writer's CTAs run it, whatever [`CtaOwner`] says.
//!
//! # Which CTA runs a copy
//!
//! Each run is given to one rank's CTAs ([`CtaOwner`]): by default the rank that reads (push: it loads
//! its own memory and stores to the peer, as T-CCL's shard-out does). The owner's runs, in order, are
//! then cut into [`LowerOptions::ctas`] consecutive spans of nearly equal bytes; a run crossing a span
//! boundary is split at a 16-byte-aligned read offset (so only its first part has an unaligned head).
//!
//! Any owner choice is race-free, which is why the choice is free to follow performance: within one
//! stage no two tasks write the same byte, because the planner writes every destination element exactly
//! once in the whole plan and the lowering turns each transfer into disjoint runs, each given to exactly
//! one CTA; and no task reads a byte another task of its stage writes, because stage 0 reads only
//! `INPUT` buffers and writes only `OUTPUT` ones, while stage 1 reads only the bytes a leader landed in
//! stage 0, which nothing writes again. [`LoweredReshard::check_races`] proves it per program
//! ([`crate::lowered::check_races`]) and the tests run it on random plans.
//!
//! # Barriers
//!
//! Every rank of the communicator gets the same number of CTAs (empty ones where it has no work) and
//! every CTA names every rank in `barrier_ranks`, as the T-CCL plans do: when ranks run in separate
//! launches, the start barrier makes every rank's buffers ready before anyone touches them and the end
//! barrier keeps a rank's kernel running until every write into it is complete. Stage 1 of a rank is
//! queued after its stage 0 on its stream, and stage 1's start barrier waits for every rank to reach
//! it, so every write of stage 0 is complete before any forwarding read. A launch holding every rank
//! drops the barriers (stream order suffices).

use super::layout::{Rank, Sharding, for_each_index};
use super::plan::{ReadFrom, ReshardPlan};
use crate::lowered::{self, Lowered, LoweredError, StageError, Staged};
use oxccl_kernels::abi::{BUFFER_SLOTS, DType, MAX_CTAS_PER_RANK, MAX_RANKS, RedOp, Task, TaskKind, slot};
use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// Which rank's CTAs run a copy from one rank's buffer to another's.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CtaOwner {
    /// The rank whose buffer is read: it loads its own memory and stores to the peer (push).
    #[default]
    Reader,
    /// The rank whose buffer is written: it loads from the peer and stores locally (pull).
    Writer,
    /// Per run, whichever of the two has been given fewer bytes so far in the stage. With every rank on
    /// one GPU this spreads a stage over the CTAs of both sides.
    Balanced,
}

impl fmt::Display for CtaOwner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Reader => "reader",
            Self::Writer => "writer",
            Self::Balanced => "balanced",
        })
    }
}

impl FromStr for CtaOwner {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "reader" => Ok(Self::Reader),
            "writer" => Ok(Self::Writer),
            "balanced" => Ok(Self::Balanced),
            _ => Err(format!("unknown CTA owner {s:?} (reader, writer, balanced)")),
        }
    }
}

/// How to lower a plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LowerOptions {
    /// Ranks of the communicator (rows of the buffer table): every mesh must lie below it.
    pub ranks: usize,
    /// CTAs per rank.
    pub ctas: u32,
    /// Which side's CTAs run each copy.
    pub owner: CtaOwner,
    /// The copy unit (see the module documentation); `None` picks one from the element size.
    pub dtype: Option<DType>,
    /// How a transfer from a `Partial` source combines the partial sums (`Sum` by default: DTensor's
    /// pending sum; `Avg` divides by their count). Every task carries it: the engine's kernel is
    /// chosen by (unit, operator), and copies ignore it.
    pub op: RedOp,
    /// Most tasks one stage may have: at most [`LowerOptions::MAX_TASKS_LIMIT`], what the
    /// descriptors' 32-bit task indices reach.
    pub max_tasks: u64,
}

impl LowerOptions {
    /// The default task limit per stage: 4 Mi tasks, 160 MiB of descriptors.
    pub const MAX_TASKS: u64 = 1 << 22;

    /// The largest [`LowerOptions::max_tasks`]: a program's tasks are indexed by `u32`
    /// ([`oxccl_kernels::abi::TbProgram::first_task`], [`oxccl_kernels::abi::TbProgram::task_count`]).
    pub const MAX_TASKS_LIMIT: u64 = u32::MAX as u64;

    /// `ranks` ranks, `ctas` CTAs per rank, reader-owned copies, the unit from the element size.
    pub fn new(ranks: usize, ctas: u32) -> Self {
        Self { ranks, ctas, owner: CtaOwner::Reader, dtype: None, op: RedOp::Sum, max_tasks: Self::MAX_TASKS }
    }
}

/// Why a plan cannot be lowered. Every variant names what was wrong.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LowerError {
    /// `ranks` is 0 or above what one launch can address.
    #[error("{ranks} ranks: a launch addresses 1..={max}")]
    Ranks {
        /// The requested ranks ([`LowerOptions::ranks`]).
        ranks: usize,
        /// The most one launch addresses ([`MAX_RANKS`]).
        max: usize,
    },
    /// `ctas` is 0 or above the engine's limit.
    #[error("{ctas} CTAs per rank: must be 1..={max}")]
    Ctas {
        /// The requested CTAs per rank ([`LowerOptions::ctas`]).
        ctas: u32,
        /// The engine's limit ([`MAX_CTAS_PER_RANK`]).
        max: u32,
    },
    /// A mesh reaches past the communicator's last rank.
    #[error("the {side} mesh reaches rank {last_rank} but the communicator has {ranks} ranks")]
    MeshOutOfRange {
        /// `"source"` or `"destination"`.
        side: &'static str,
        /// The mesh's last rank.
        last_rank: Rank,
        /// The communicator's ranks.
        ranks: usize,
    },
    /// A transfer names a rank past the communicator's last rank.
    #[error("stage {stage} transfer {index} names rank {rank}; the communicator has {ranks} ranks")]
    RankOutOfRange {
        /// The stage's index in the plan.
        stage: usize,
        /// The transfer's index in its stage.
        index: usize,
        /// The rank it names (reader or writer).
        rank: Rank,
        /// The communicator's ranks.
        ranks: usize,
    },
    /// The requested copy unit's size does not divide the element size.
    #[error("copy unit {dtype:?} ({} bytes) does not divide the {elem_bytes}-byte element", .dtype.size())]
    DTypeSize {
        /// The requested unit ([`LowerOptions::dtype`]).
        dtype: DType,
        /// Bytes per element.
        elem_bytes: u64,
    },
    /// The plan sums partial sums (a `Partial` source), which needs the element type itself as the
    /// unit ([`LowerOptions::dtype`]), and none was given or its size is not the element size.
    #[error(
        "the plan sums partial sums of {elem_bytes}-byte elements: the unit must be their element type \
         (given: {dtype:?})"
    )]
    SumUnit {
        /// Bytes per element.
        elem_bytes: u64,
        /// The unit requested ([`LowerOptions::dtype`]).
        dtype: Option<DType>,
    },
    /// Odd-sized elements with an odd offset, stride or run: no 2- or 4-byte unit copies them.
    #[error(
        "{elem_bytes}-byte elements: stage {stage} transfer {index} has an odd offset, stride or run \
         ({value} bytes), and the engine copies whole 2- or 4-byte units"
    )]
    NoCopyUnit {
        /// Bytes per element.
        elem_bytes: u64,
        /// Stage of the first transfer with an odd value.
        stage: usize,
        /// Its index in the stage.
        index: usize,
        /// The odd offset, stride or run (bytes).
        value: u64,
    },
    /// A transfer is not something the engine can run.
    #[error("stage {stage} transfer {index}: {why}")]
    MalformedTransfer {
        /// The stage's index in the plan.
        stage: usize,
        /// The transfer's index in its stage.
        index: usize,
        /// What is wrong with it.
        why: &'static str,
    },
    /// [`LowerOptions::max_tasks`] is above what the descriptors can index.
    #[error("a task limit of {max_tasks} per stage: the descriptors index at most {max} tasks (32-bit indices)")]
    MaxTasks {
        /// The requested limit ([`LowerOptions::max_tasks`]).
        max_tasks: u64,
        /// The largest limit allowed ([`LowerOptions::MAX_TASKS_LIMIT`]).
        max: u64,
    },
    /// A stage would have more tasks than allowed.
    #[error(
        "stage {stage} needs {tasks} tasks (one per contiguous run), over the limit of {max}; \
         the boxes have too many short rows"
    )]
    TooManyTasks {
        /// The stage's index in the plan.
        stage: usize,
        /// Tasks the stage needs: its rows before merging (saturating at `u64::MAX`), or its tasks
        /// after merging and splitting.
        tasks: u64,
        /// The limit ([`LowerOptions::max_tasks`]).
        max: u64,
    },
    /// The lowered program failed validation against the buffer sizes.
    #[error("stage {stage}: {error}")]
    Invalid {
        /// The stage's index in the plan.
        stage: usize,
        /// What validation found (also what [`LoweredReshard::check_races`] and
        /// [`LoweredReshard::execute`] find, as a [`StageError`] that converts into this).
        #[source]
        error: LoweredError,
    },
}
/// A reshard lowered for the engine: one program per stage, launched in order
/// ([`crate::lowered::Staged`]).
pub type LoweredReshard = Staged;

impl From<StageError> for LowerError {
    fn from(e: StageError) -> Self {
        LowerError::Invalid { stage: e.stage, error: e.error }
    }
}

/// One strided copy between two (rank, slot) buffers: a [`super::Transfer`]'s box with the buffers
/// named.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct BoxCopy {
    pub reader: Rank,
    /// Further ranks read at the same offsets and slot, their values summed with `reader`'s (the
    /// partial sums of a `Partial` source); empty for a copy.
    pub partials: Vec<Rank>,
    pub read_slot: u8,
    pub writer: Rank,
    pub write_slot: u8,
    pub src_offset: u64,
    pub dst_offset: u64,
    /// Loop extents, outer first, then the contiguous run in bytes.
    pub shape: Vec<u64>,
    pub src_strides: Vec<u64>,
    pub dst_strides: Vec<u64>,
}

/// One contiguous range: what one task moves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Run {
    reader: Rank,
    /// Bit mask of the further ranks read (the partial sums summed with `reader`'s); 0 for a copy.
    also: u32,
    read_slot: u8,
    writer: Rank,
    write_slot: u8,
    src_offset: u64,
    dst_offset: u64,
    bytes: u64,
}

/// Split points of a run shared by two CTAs fall on multiples of this many bytes of the read offset.
const GRAIN: u64 = 16;

/// Lowers `plan` for a communicator of `opts.ranks` ranks: stage `k` of the plan becomes
/// `stages[k]`. See the module documentation for buffers, row loops, the copy unit, CTA owners and
/// barriers.
pub fn lower(plan: &ReshardPlan, opts: &LowerOptions) -> Result<LoweredReshard, LowerError> {
    check_options(opts)?;
    check_mesh("source", plan.src_sharding(), opts.ranks)?;
    check_mesh("destination", plan.dst_sharding(), opts.ranks)?;
    let mut stages = Vec::with_capacity(plan.stages().len());
    for (s, stage) in plan.stages().iter().enumerate() {
        let mut copies = Vec::with_capacity(stage.transfers.len());
        for (i, t) in stage.transfers.iter().enumerate() {
            let read_slot = match t.read {
                ReadFrom::Src => slot::INPUT,
                ReadFrom::Dst if s == 0 => {
                    let why = "stage 0 reads a destination buffer, which no earlier stage filled";
                    return Err(LowerError::MalformedTransfer { stage: s, index: i, why });
                }
                ReadFrom::Dst => slot::OUTPUT,
            };
            if t.reduces() {
                let malformed = |why| LowerError::MalformedTransfer { stage: s, index: i, why };
                if t.read != ReadFrom::Src {
                    return Err(malformed("a sum reads partial sums, which are source buffers"));
                }
                let mut sources: Vec<Rank> = t.sources().collect();
                sources.sort_unstable();
                if sources.windows(2).any(|w| w[0] == w[1]) {
                    return Err(malformed("a sum names a rank twice"));
                }
            }
            copies.push(BoxCopy {
                reader: t.src,
                partials: t.partials.clone(),
                read_slot,
                writer: t.dst,
                write_slot: slot::OUTPUT,
                src_offset: t.src_offset,
                dst_offset: t.dst_offset,
                shape: t.shape.clone(),
                src_strides: t.src_strides.clone(),
                dst_strides: t.dst_strides.clone(),
            });
        }
        stages.push(copies);
    }
    let buffer_bytes = (0..opts.ranks as Rank)
        .map(|r| {
            let mut b = [0u64; BUFFER_SLOTS];
            b[slot::INPUT as usize] = plan.src_buffer_bytes(r);
            b[slot::OUTPUT as usize] = plan.dst_buffer_bytes(r);
            b
        })
        .collect();
    lower_copies(&stages, plan.elem_bytes(), buffer_bytes, opts)
}

pub(crate) fn check_options(opts: &LowerOptions) -> Result<(), LowerError> {
    if opts.ranks == 0 || opts.ranks > MAX_RANKS {
        return Err(LowerError::Ranks { ranks: opts.ranks, max: MAX_RANKS });
    }
    if opts.ctas == 0 || opts.ctas as usize > MAX_CTAS_PER_RANK {
        return Err(LowerError::Ctas { ctas: opts.ctas, max: MAX_CTAS_PER_RANK as u32 });
    }
    if opts.max_tasks > LowerOptions::MAX_TASKS_LIMIT {
        return Err(LowerError::MaxTasks { max_tasks: opts.max_tasks, max: LowerOptions::MAX_TASKS_LIMIT });
    }
    Ok(())
}

pub(crate) fn check_mesh(side: &'static str, sharding: &Sharding, ranks: usize) -> Result<(), LowerError> {
    let mesh = sharding.mesh();
    let last_rank = mesh.start() + (mesh.size() - 1);
    if last_rank as usize >= ranks {
        return Err(LowerError::MeshOutOfRange { side, last_rank, ranks });
    }
    Ok(())
}

/// The copy unit: the requested one, or one chosen from the element size and the plan's geometry.
fn copy_unit(stages: &[Vec<BoxCopy>], elem_bytes: u64, requested: Option<DType>) -> Result<DType, LowerError> {
    // A sum adds elements: its unit is the element type.
    if stages.iter().flatten().any(|c| !c.partials.is_empty()) {
        return match requested {
            Some(dtype) if dtype.size() as u64 == elem_bytes => Ok(dtype),
            dtype => Err(LowerError::SumUnit { elem_bytes, dtype }),
        };
    }
    if let Some(dtype) = requested {
        if !elem_bytes.is_multiple_of(dtype.size() as u64) {
            return Err(LowerError::DTypeSize { dtype, elem_bytes });
        }
        return Ok(dtype);
    }
    if elem_bytes.is_multiple_of(4) {
        return Ok(DType::F32);
    }
    if elem_bytes.is_multiple_of(2) {
        return Ok(DType::F16);
    }
    // Odd element sizes: the greatest common power of two (up to 4) of every offset, stride and run.
    let mut gcd = 4u64;
    for (s, copies) in stages.iter().enumerate() {
        for (i, c) in copies.iter().enumerate() {
            let values = [c.src_offset, c.dst_offset, c.shape.last().copied().unwrap_or(0)];
            for v in values.into_iter().chain(c.src_strides.iter().copied()).chain(c.dst_strides.iter().copied()) {
                if v % 2 != 0 {
                    return Err(LowerError::NoCopyUnit { elem_bytes, stage: s, index: i, value: v });
                }
                if v % 4 != 0 {
                    gcd = 2;
                }
            }
        }
    }
    Ok(if gcd == 4 { DType::F32 } else { DType::F16 })
}

/// Lowers stages of box copies (see [`lower`]).
pub(crate) fn lower_copies(
    stages: &[Vec<BoxCopy>],
    elem_bytes: u64,
    buffer_bytes: Vec<[u64; BUFFER_SLOTS]>,
    opts: &LowerOptions,
) -> Result<LoweredReshard, LowerError> {
    check_options(opts)?;
    let dtype = copy_unit(stages, elem_bytes, opts.dtype)?;
    let mut out = Vec::with_capacity(stages.len());
    for (s, copies) in stages.iter().enumerate() {
        // Count first: a box of many short rows must not allocate its runs before being refused.
        let mut count = 0u64;
        for (i, c) in copies.iter().enumerate() {
            let malformed = |why| LowerError::MalformedTransfer { stage: s, index: i, why };
            let Some((_, outer)) = c.shape.split_last() else {
                return Err(malformed("empty box shape"));
            };
            if c.src_strides.len() != outer.len() || c.dst_strides.len() != outer.len() {
                return Err(malformed("one stride per loop needed on each side"));
            }
            for &rank in [c.reader, c.writer].iter().chain(&c.partials) {
                if rank as usize >= opts.ranks {
                    return Err(LowerError::RankOutOfRange { stage: s, index: i, rank, ranks: opts.ranks });
                }
            }
            count = count.saturating_add(outer.iter().try_fold(1u64, |a, &e| a.checked_mul(e)).unwrap_or(u64::MAX));
        }
        if count > opts.max_tasks {
            return Err(LowerError::TooManyTasks { stage: s, tasks: count, max: opts.max_tasks });
        }
        let mut runs = Vec::with_capacity(count as usize);
        for (i, c) in copies.iter().enumerate() {
            expand(c, &mut runs).map_err(|why| LowerError::MalformedTransfer { stage: s, index: i, why })?;
        }
        let runs = coalesce(runs);
        let l = distribute(&runs, opts, dtype);
        if l.tasks.len() as u64 > opts.max_tasks {
            return Err(LowerError::TooManyTasks { stage: s, tasks: l.tasks.len() as u64, max: opts.max_tasks });
        }
        lowered::validate(&l, &buffer_bytes, &[]).map_err(|error| LowerError::Invalid { stage: s, error })?;
        out.push(l);
    }
    Ok(Staged { stages: out, dtype, op: opts.op, buffer_bytes })
}

/// Unrolls a box's loops into its contiguous runs, in row-major order. Errors when a run's offset or
/// end does not fit in a `u64` (a wrapped offset could land back inside a buffer and pass validation).
fn expand(c: &BoxCopy, out: &mut Vec<Run>) -> Result<(), &'static str> {
    let (&run, outer) = c.shape.split_last().expect("checked by the caller");
    if run == 0 {
        return Ok(());
    }
    // The start of the run at loop index `idx`, checked to end inside 64 bits.
    let at = |base: u64, strides: &[u64], idx: &[u64]| {
        let start = idx.iter().zip(strides).try_fold(base, |acc, (&i, &s)| acc.checked_add(i.checked_mul(s)?))?;
        start.checked_add(run).map(|_| start)
    };
    let mut wrapped = false;
    for_each_index(outer, |idx| {
        let (Some(src_offset), Some(dst_offset)) =
            (at(c.src_offset, &c.src_strides, idx), at(c.dst_offset, &c.dst_strides, idx))
        else {
            wrapped = true;
            return;
        };
        out.push(Run {
            reader: c.reader,
            also: c.partials.iter().fold(0, |m, &r| m | 1 << r),
            read_slot: c.read_slot,
            writer: c.writer,
            write_slot: c.write_slot,
            src_offset,
            dst_offset,
            bytes: run,
        });
    });
    if wrapped {
        return Err("a run's offset passes 2^64 bytes");
    }
    Ok(())
}

/// Merges runs of one (reader, slot, writer, slot) pair that continue each other on both sides.
fn coalesce(mut runs: Vec<Run>) -> Vec<Run> {
    runs.sort_unstable_by_key(|r| (r.reader, r.also, r.read_slot, r.writer, r.write_slot, r.src_offset, r.dst_offset));
    let mut out: Vec<Run> = Vec::with_capacity(runs.len());
    for r in runs {
        match out.last_mut() {
            Some(last)
                if (last.reader, last.also, last.read_slot, last.writer, last.write_slot)
                    == (r.reader, r.also, r.read_slot, r.writer, r.write_slot)
                    && last.src_offset + last.bytes == r.src_offset
                    && last.dst_offset + last.bytes == r.dst_offset =>
            {
                last.bytes += r.bytes
            }
            _ => out.push(r),
        }
    }
    out
}

/// Gives every run to its owner rank, cuts each rank's runs into `ctas` spans of nearly equal bytes,
/// and writes the programs (rank-major, every rank `ctas` CTAs).
fn distribute(runs: &[Run], opts: &LowerOptions, dtype: DType) -> Lowered {
    let n = opts.ranks;
    let c = opts.ctas as usize;
    let mut per_rank: Vec<Vec<Run>> = vec![Vec::new(); n];
    let mut load = vec![0u64; n];
    for &r in runs {
        let owner = match opts.owner {
            // A sum is run by its writer (it reads every partial sum and stores once, as T-CCL's
            // shard-in): the lowest reader would run every sum of a reduce-scatter.
            _ if r.also != 0 => r.writer,
            CtaOwner::Reader => r.reader,
            CtaOwner::Writer => r.writer,
            CtaOwner::Balanced if load[r.writer as usize] < load[r.reader as usize] => r.writer,
            CtaOwner::Balanced => r.reader,
        } as usize;
        per_rank[owner].push(r);
        // Saturating: a hand-made plan's runs may sum past 2^64 before validation refuses them.
        load[owner] = load[owner].saturating_add(r.bytes);
    }
    let mut programs = Vec::with_capacity(n * c);
    let mut tasks = Vec::with_capacity(runs.len() + n * c);
    let task = |r: &Run| Task {
        kind: TaskKind::Move.raw(),
        dtype: dtype.raw(),
        op: opts.op.raw(),
        src_slot: r.read_slot,
        dst_slot: r.write_slot,
        flags: 0,
        // An average of partial sums divides by their count.
        divisor: if opts.op == RedOp::Avg && r.also != 0 { 1 + r.also.count_ones() as u16 } else { 0 },
        src_ranks: 1 << r.reader | r.also,
        dst_ranks: 1 << r.writer,
        src_offset: r.src_offset,
        dst_offset: r.dst_offset,
        bytes: r.bytes,
    };
    for (rank, list) in per_rank.iter().enumerate() {
        let spans = spans(list, load[rank], c);
        for (cta, span) in spans.iter().enumerate() {
            let first = tasks.len() as u32;
            tasks.extend(span.iter().map(task));
            programs.push(lowered::meeting_all(rank, cta, first, span.len() as u32, n));
        }
    }
    // A sum combines its sources in registers: one shared-memory slot per source.
    let slots = runs.iter().map(|r| 1 + r.also.count_ones()).max().unwrap_or(1);
    Lowered { programs, tasks, ranks: n, slots, combines: slots > 1 }
}

/// Cuts `runs` (of `total` bytes, in order) into `c` consecutive spans, span `k` ending near byte
/// `total × (k + 1) / c`; a run crossing a boundary is split where its read offset is a multiple of
/// [`GRAIN`] (a split point that would leave its first part empty moves the boundary instead).
fn spans(runs: &[Run], total: u64, c: usize) -> Vec<Vec<Run>> {
    let mut out = vec![Vec::new(); c];
    let mut k = 0;
    let mut pos = 0u64;
    for &run in runs {
        let mut run = run;
        loop {
            if k + 1 >= c {
                out[k].push(run);
                pos = pos.saturating_add(run.bytes);
                break;
            }
            let end = (u128::from(total) * (k as u128 + 1) / c as u128) as u64;
            if pos >= end {
                k += 1;
                continue;
            }
            if pos.saturating_add(run.bytes) <= end {
                out[k].push(run);
                pos = pos.saturating_add(run.bytes);
                break;
            }
            let cut = ((run.src_offset + (end - pos)) & !(GRAIN - 1)).saturating_sub(run.src_offset);
            if cut > 0 {
                out[k].push(Run { bytes: cut, ..run });
                run.src_offset += cut;
                run.dst_offset += cut;
                run.bytes -= cut;
                pos += cut;
            }
            k += 1;
        }
    }
    out
}
