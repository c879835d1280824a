//! Lowered programs: the `abi` descriptors the GPU engine runs, executed on host memory.
//!
//! [`Lowered`] is what the device receives: one [`TbProgram`] per CTA and the task array. [`execute`]
//! runs it on per-rank host buffers with the engine's semantics (the CPU executor the tests compare the
//! GPU against), and [`check_races`] proves the CTAs of a program never touch a byte another CTA writes,
//! which is what makes running CTAs one after another on the CPU equal to running them concurrently.

use oxccl_kernels::abi::slot;
use oxccl_kernels::abi::{
    BUFFER_SLOTS, DType, MAX_CTAS_PER_RANK, MAX_RANKS, PAIR_CTAS, RedOp, TASK_AFTER_WRITES, Task, TaskKind, TbProgram,
    barrier_slot_fits, tma_can_reduce,
};
use serde::Serialize;
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::ops::Bound::Excluded;

/// A lowered program: CTA programs, their tasks, and what the launch needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lowered {
    /// One entry per CTA of the launch, in `blockIdx.x` order.
    pub programs: Vec<TbProgram>,
    /// The task array the programs index.
    pub tasks: Vec<Task>,
    /// Ranks the program addresses (buffer table rows 0..ranks).
    pub ranks: usize,
    /// Most sources a TMA-mover task combines in registers (shared-memory slots per stage).
    pub slots: u32,
    /// Whether any task combines several sources in registers (through a TMA stage) or reduces
    /// element by element (the CTA then needs more than one warp). Bulk reductions need only the
    /// issuing thread.
    pub combines: bool,
}

/// Why a lowered program is malformed or racy.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LoweredError {
    /// A program's task range is outside the task array.
    #[error("program {program}: task range outside the task array")]
    TaskRange {
        /// Index of the program in [`Lowered::programs`].
        program: usize,
    },
    /// A task names an unknown kind, dtype or operator, an empty or out-of-range rank set, a bad slot,
    /// or lengths that are not whole elements.
    #[error("task {task}: {why}")]
    BadTask {
        /// Index of the task in [`Lowered::tasks`].
        task: usize,
        /// What is wrong with it.
        why: &'static str,
    },
    /// A range is outside the buffer it addresses.
    #[error("task {task}: rank {rank} slot {slot}: range ends at byte {end}, buffer has {len}")]
    OutOfBounds {
        /// Index of the task in [`Lowered::tasks`].
        task: usize,
        /// The rank whose buffer the range overruns.
        rank: usize,
        /// The buffer slot.
        slot: u8,
        /// Byte offset just past the range, from the start of the slot.
        end: u64,
        /// The slot's length in bytes (for an aliased slot, what its target holds past the alias
        /// offset).
        len: u64,
    },
    /// A program names a rank or CTA index the engine's tables cannot hold.
    #[error("program {program}: {why}")]
    BadProgram {
        /// Index of the program in [`Lowered::programs`].
        program: usize,
        /// Which index is out of range.
        why: &'static str,
    },
    /// A task touches bytes an earlier task of the same CTA writes (or reads, where it writes) without
    /// `TASK_AFTER_WRITES`: on the GPU the two may overlap in time.
    #[error(
        "program {program}: task {task} touches bytes an earlier task of the CTA writes, without TASK_AFTER_WRITES"
    )]
    Unordered {
        /// Index of the CTA's program in [`Lowered::programs`].
        program: usize,
        /// Index of the later task in [`Lowered::tasks`] (not within the program).
        task: usize,
    },
    /// Two CTAs access the same bytes and at least one writes them.
    #[error("CTAs {first} and {second} race on rank {rank} slot {slot} bytes {start}..{end}")]
    Race {
        /// One of the CTAs, by index in [`Lowered::programs`].
        first: usize,
        /// The other CTA.
        second: usize,
        /// The rank of the bytes (the alias target's rank, for an aliased slot).
        rank: usize,
        /// The buffer slot of the bytes (the alias target's slot, for an aliased slot).
        slot: u8,
        /// Start of the two racing accesses' overlap, in bytes from the start of that slot.
        start: u64,
        /// Byte offset just past that overlap.
        end: u64,
    },
    /// An alias names a rank without buffers or a slot out of range, or starts past its target's end.
    #[error("alias {alias}: {why}")]
    BadAlias {
        /// Index of the alias in the `aliases` argument.
        alias: usize,
        /// What is wrong with it.
        why: &'static str,
    },
}

/// The program of CTA `cta` of `rank` in a launch of `ranks` ranks whose every CTA meets every rank
/// at its barriers (none where there is one rank), its buffers in its rank's row: tasks `first ..
/// first + count` of the launch.
pub fn meeting_all(rank: usize, cta: usize, first: u32, count: u32, ranks: usize) -> TbProgram {
    let all: u32 = if ranks >= 32 { u32::MAX } else { (1u32 << ranks) - 1 };
    TbProgram {
        rank: rank as u32,
        cta: cta as u32,
        first_task: first,
        task_count: count,
        barrier_ranks: if ranks > 1 { all } else { 0 },
        table: 0,
        key: 0,
        reserved: 0,
    }
}

/// Per-rank host buffers, `buffers[rank][slot]`, as raw bytes. An empty vector is an unused slot.
pub type HostBuffers = Vec<[Vec<u8>; BUFFER_SLOTS]>;

fn decode(index: usize, t: &Task) -> Result<(TaskKind, DType, RedOp), LoweredError> {
    let bad = |why| LoweredError::BadTask { task: index, why };
    let kind = TaskKind::from_raw(t.kind).ok_or(bad("unknown kind"))?;
    let dtype = DType::from_raw(t.dtype).ok_or(bad("unknown dtype"))?;
    let op = RedOp::from_raw(t.op).ok_or(bad("unknown operator"))?;
    let limit = if MAX_RANKS >= 32 { u32::MAX } else { (1u32 << MAX_RANKS) - 1 };
    if t.src_ranks == 0 || t.dst_ranks == 0 || t.src_ranks & !limit != 0 || t.dst_ranks & !limit != 0 {
        return Err(bad("empty or out-of-range rank set"));
    }
    if t.src_slot as usize >= BUFFER_SLOTS || t.dst_slot as usize >= BUFFER_SLOTS {
        return Err(bad("slot out of range"));
    }
    let e = dtype.size() as u64;
    if !t.bytes.is_multiple_of(e) || !t.src_offset.is_multiple_of(e) || !t.dst_offset.is_multiple_of(e) {
        return Err(bad("lengths or offsets are not whole elements"));
    }
    if kind == TaskKind::ReduceInto && t.dst_ranks.count_ones() != 1 {
        return Err(bad("ReduceInto needs exactly one destination"));
    }
    if t.divisor > 1 && op != RedOp::Avg {
        return Err(bad("a divisor on an operator other than Avg"));
    }
    Ok((kind, dtype, op))
}

fn ranks(mask: u32) -> impl Iterator<Item = usize> {
    (0..32).filter(move |r| mask & (1 << r) != 0)
}

/// A slot that lives inside another: (rank, slot) is (target rank, target slot) from byte `offset` on.
pub type Alias = (usize, u8, usize, u8, u64);

/// Checks what does not depend on buffers: every program's task range lies in the task array and its
/// rank and CTA fit the engine's tables; every task decodes and its ranges do not overflow.
pub fn validate_structure(l: &Lowered) -> Result<(), LoweredError> {
    for (p, prog) in l.programs.iter().enumerate() {
        let end = prog.first_task as u64 + prog.task_count as u64;
        if end > l.tasks.len() as u64 {
            return Err(LoweredError::TaskRange { program: p });
        }
        if prog.rank as usize >= MAX_RANKS {
            return Err(LoweredError::BadProgram { program: p, why: "rank at or above MAX_RANKS" });
        }
        // The engine reads a workspace address per barrier rank from a table of MAX_RANKS.
        if (prog.barrier_ranks as u64) >> MAX_RANKS != 0 {
            return Err(LoweredError::BadProgram { program: p, why: "a barrier rank at or above MAX_RANKS" });
        }
        if !barrier_slot_fits(prog.rank, prog.cta, prog.barrier_ranks) {
            return Err(LoweredError::BadProgram {
                program: p,
                why: if prog.cta as usize >= MAX_CTAS_PER_RANK + PAIR_CTAS {
                    "CTA slot at or above MAX_CTAS_PER_RANK + PAIR_CTAS"
                } else {
                    "a pair slot (CTA at or above MAX_CTAS_PER_RANK) must meet exactly one other rank"
                },
            });
        }
        if prog.table as usize > MAX_RANKS {
            return Err(LoweredError::BadProgram { program: p, why: "buffer table row above MAX_RANKS" });
        }
    }
    for (i, t) in l.tasks.iter().enumerate() {
        decode(i, t)?;
        if t.src_offset.checked_add(t.bytes).is_none() || t.dst_offset.checked_add(t.bytes).is_none() {
            return Err(LoweredError::BadTask { task: i, why: "offset + bytes overflows" });
        }
    }
    Ok(())
}

/// Validates every program and task against the buffer lengths `len[rank][slot]` (aliased slots
/// measured inside their target).
pub fn validate(l: &Lowered, len: &[[u64; BUFFER_SLOTS]], aliases: &[Alias]) -> Result<(), LoweredError> {
    validate_structure(l)?;
    for (k, &(ar, as_, tr, ts, off)) in aliases.iter().enumerate() {
        let bad = |why| LoweredError::BadAlias { alias: k, why };
        if ar >= len.len() || tr >= len.len() {
            return Err(bad("names a rank without buffers"));
        }
        if as_ as usize >= BUFFER_SLOTS || ts as usize >= BUFFER_SLOTS {
            return Err(bad("slot out of range"));
        }
        if off > len[tr][ts as usize] {
            return Err(bad("starts past the end of its target"));
        }
    }
    let len_of = |r: usize, s: u8| -> u64 {
        for &(ar, as_, tr, ts, off) in aliases {
            if ar == r && as_ == s {
                return len.get(tr).map(|x| x[ts as usize]).unwrap_or(0).saturating_sub(off);
            }
        }
        len.get(r).map(|x| x[s as usize]).unwrap_or(0)
    };
    for (i, t) in l.tasks.iter().enumerate() {
        let check = |mask: u32, slot: u8, off: u64| -> Result<(), LoweredError> {
            for r in ranks(mask) {
                if r >= len.len() {
                    return Err(LoweredError::BadTask { task: i, why: "names a rank without buffers" });
                }
                let have = len_of(r, slot);
                // `validate_structure` proved the sum does not overflow.
                if off + t.bytes > have {
                    return Err(LoweredError::OutOfBounds { task: i, rank: r, slot, end: off + t.bytes, len: have });
                }
            }
            Ok(())
        };
        check(t.src_ranks, t.src_slot, t.src_offset)?;
        check(t.dst_ranks, t.dst_slot, t.dst_offset)?;
    }
    Ok(())
}

/// A byte range of one rank's buffer: (rank, slot, start, end).
type Access = (usize, u8, u64, u64);

/// Byte ranges one task reads and writes.
fn accesses(t: &Task) -> (Vec<Access>, Vec<Access>) {
    let reads: Vec<_> = ranks(t.src_ranks).map(|r| (r, t.src_slot, t.src_offset, t.src_offset + t.bytes)).collect();
    // Accumulating (`ReduceInto`) also reads the destination; the write covers it.
    let writes: Vec<_> = ranks(t.dst_ranks).map(|r| (r, t.dst_slot, t.dst_offset, t.dst_offset + t.bytes)).collect();
    (reads, writes)
}

/// Byte ranges of one CTA's window, for overlap queries in `O(log n)`: `x` and `y` overlap when they
/// are of the same (rank, slot) and `x.start < y.end && y.start < x.end`.
///
/// Non-empty ranges are kept as the union of those that overlap, as disjoint ranges keyed by
/// (rank, slot, start) (touching ranges stay apart: they do not overlap). Empty ranges are kept as
/// points: `[p, p)` overlaps exactly the ranges with `start < p < end`.
#[derive(Default)]
struct Window {
    ranges: BTreeMap<(usize, u8, u64), u64>,
    points: BTreeSet<(usize, u8, u64)>,
}

impl Window {
    fn clear(&mut self) {
        self.ranges.clear();
        self.points.clear();
    }

    /// Whether `x` overlaps a range of the window.
    fn overlaps(&self, &(r, s, a, b): &Access) -> bool {
        // The kept range starting last before `b` ends last among them (they are disjoint).
        let range =
            self.ranges.range(..(r, s, b)).next_back().is_some_and(|(&(r2, s2, _), &e)| (r2, s2) == (r, s) && e > a);
        let point = a < b && self.points.range((Excluded((r, s, a)), Excluded((r, s, b)))).next().is_some();
        range || point
    }

    fn insert(&mut self, (r, s, mut a, mut b): Access) {
        if a >= b {
            self.points.insert((r, s, a));
            return;
        }
        // The kept ranges `x` overlaps are consecutive, ending with the last one starting before `b`.
        while let Some((&(r2, s2, a2), &b2)) = self.ranges.range(..(r, s, b)).next_back() {
            if (r2, s2) != (r, s) || b2 <= a {
                break;
            }
            self.ranges.remove(&(r2, s2, a2));
            (a, b) = (a.min(a2), b.max(b2));
        }
        self.ranges.insert((r, s, a), b);
    }
}

/// Checks that no two CTAs access overlapping bytes of the same (rank, slot) where at least one
/// writes. Buffers of different slots are assumed distinct unless `aliases` maps a (rank, slot) onto
/// another (rank, slot) at a byte offset (in-place collectives).
///
/// `O(n log n)` in the tasks.
pub fn check_races(l: &Lowered, aliases: &[Alias]) -> Result<(), LoweredError> {
    validate_structure(l)?;
    // (rank, slot, start, end, cta, is_write), in canonical (aliased) coordinates.
    let canon = |r: usize, s: u8, a: u64, b: u64| {
        for &(ar, as_, tr, ts, off) in aliases {
            if ar == r && as_ == s {
                return (tr, ts, a.saturating_add(off), b.saturating_add(off));
            }
        }
        (r, s, a, b)
    };
    let mut all = Vec::new();
    let (mut window_reads, mut window_writes) = (Window::default(), Window::default());
    for (c, prog) in l.programs.iter().enumerate() {
        // Inside one CTA, tasks since the last `TASK_AFTER_WRITES` may run concurrently (bulk writes
        // in flight, threads ahead of the issuer): none may touch bytes another one of them writes.
        window_reads.clear();
        window_writes.clear();
        let first = prog.first_task as usize;
        for (k, t) in l.tasks[first..first + prog.task_count as usize].iter().enumerate() {
            let (reads, writes) = accesses(t);
            let reads: Vec<Access> = reads.into_iter().map(|(r, s, a, b)| canon(r, s, a, b)).collect();
            let writes: Vec<Access> = writes.into_iter().map(|(r, s, a, b)| canon(r, s, a, b)).collect();
            if t.flags & TASK_AFTER_WRITES != 0 {
                window_reads.clear();
                window_writes.clear();
            } else {
                let conflict = reads.iter().chain(&writes).any(|x| window_writes.overlaps(x))
                    || writes.iter().any(|x| window_reads.overlaps(x));
                if conflict {
                    return Err(LoweredError::Unordered { program: c, task: first + k });
                }
            }
            for &x in &reads {
                window_reads.insert(x);
            }
            for &x in &writes {
                window_writes.insert(x);
            }
            for (r, s, a, b) in reads {
                all.push((r, s, a, b, c, false));
            }
            for (r, s, a, b) in writes {
                all.push((r, s, a, b, c, true));
            }
        }
    }
    all.retain(|x| x.2 < x.3);
    // Stable: equal starts keep CTA order, a task's reads before its writes.
    all.sort_by_key(|x| (x.0, x.1, x.2));
    // For access `i`, the accesses that start before it ends follow it in a run of its (rank, slot).
    // The first of them that races with `i` is the first of another CTA (when `i` writes) or the
    // first write of another CTA: both are found in O(1) from tables built right to left, so `i`
    // races with something iff that candidate starts before `i` ends.
    let n = all.len();
    // `other[i]`: the first access after `i` of another CTA.
    // `next_write[i]`: the first write after `i`.
    // `other_write[i]` (for a write `i`): the first write after `i` of another CTA.
    let (mut other, mut next_write, mut other_write) = (vec![n; n], vec![n; n], vec![n; n]);
    for i in (0..n.saturating_sub(1)).rev() {
        let (c, next) = (all[i].4, &all[i + 1]);
        other[i] = if next.4 != c { i + 1 } else { other[i + 1] };
        next_write[i] = if next.5 { i + 1 } else { next_write[i + 1] };
        let w = next_write[i];
        if all[i].5 && w < n {
            other_write[i] = if all[w].4 != c { w } else { other_write[w] };
        }
    }
    for i in 0..n {
        let (r, s, _, b, c, w) = all[i];
        let j = if w {
            other[i]
        } else {
            match next_write[i] {
                j if j < n && all[j].4 == c => other_write[j],
                j => j,
            }
        };
        if let Some(&(r2, s2, a2, b2, c2, _)) = all.get(j)
            && (r2, s2) == (r, s)
            && a2 < b
        {
            return Err(LoweredError::Race { first: c, second: c2, rank: r, slot: s, start: a2, end: b.min(b2) });
        }
    }
    Ok(())
}

/// `acc[i] = acc[i] ⊕ src[i]` over whole slices of little-endian elements, with the device's
/// semantics: f16 and bf16 results rounded once to nearest even, float min/max return the non-NaN
/// operand, integer sums wrap. `acc` and `src` are meant to be equally long; only the whole elements
/// both hold are combined.
pub fn combine_into(dtype: DType, op: RedOp, acc: &mut [u8], src: &[u8]) {
    use half::{bf16, f16};
    macro_rules! each {
        ($t:ty, $f:expr) => {{
            let w = std::mem::size_of::<$t>();
            for (a, b) in acc.chunks_exact_mut(w).zip(src.chunks_exact(w)) {
                let x = <$t>::from_le_bytes((&*a).try_into().unwrap());
                let y = <$t>::from_le_bytes(b.try_into().unwrap());
                let r: $t = $f(x, y);
                a.copy_from_slice(&r.to_le_bytes());
            }
        }};
    }
    match (dtype, op) {
        (DType::F32, RedOp::Sum) => each!(f32, |x: f32, y: f32| x + y),
        (DType::F32, RedOp::Min) => each!(f32, |x: f32, y: f32| x.min(y)),
        (DType::F32, RedOp::Max) => each!(f32, |x: f32, y: f32| x.max(y)),
        // The sum of two f16 rounded to f32 and then to f16 is the correctly rounded f16 sum (f32's 24
        // bits are at least 2 × 11 + 2, so the double rounding is innocuous); f64 does the same for
        // bf16 (8 bits).
        (DType::F16, RedOp::Sum) => each!(f16, |x: f16, y: f16| f16::from_f32(x.to_f32() + y.to_f32())),
        (DType::F16, RedOp::Min) => each!(f16, |x: f16, y: f16| f16::from_f32(x.to_f32().min(y.to_f32()))),
        (DType::F16, RedOp::Max) => each!(f16, |x: f16, y: f16| f16::from_f32(x.to_f32().max(y.to_f32()))),
        (DType::Bf16, RedOp::Sum) => each!(bf16, |x: bf16, y: bf16| bf16::from_f64(x.to_f64() + y.to_f64())),
        (DType::Bf16, RedOp::Min) => each!(bf16, |x: bf16, y: bf16| bf16::from_f32(x.to_f32().min(y.to_f32()))),
        (DType::Bf16, RedOp::Max) => each!(bf16, |x: bf16, y: bf16| bf16::from_f32(x.to_f32().max(y.to_f32()))),
        (DType::I32, RedOp::Sum) => each!(i32, |x: i32, y: i32| x.wrapping_add(y)),
        (DType::I32, RedOp::Min) => each!(i32, |x: i32, y: i32| x.min(y)),
        (DType::I32, RedOp::Max) => each!(i32, |x: i32, y: i32| x.max(y)),
        (DType::U32, RedOp::Sum) => each!(u32, |x: u32, y: u32| x.wrapping_add(y)),
        (DType::U32, RedOp::Min) => each!(u32, |x: u32, y: u32| x.min(y)),
        (DType::U32, RedOp::Max) => each!(u32, |x: u32, y: u32| x.max(y)),
        // A product of two halves is exact in f32 (2 × 11 and 2 × 8 bits): rounded once, as the
        // hardware's multiply.
        (DType::F32, RedOp::Prod) => each!(f32, |x: f32, y: f32| x * y),
        (DType::F16, RedOp::Prod) => each!(f16, |x: f16, y: f16| f16::from_f32(x.to_f32() * y.to_f32())),
        (DType::Bf16, RedOp::Prod) => each!(bf16, |x: bf16, y: bf16| bf16::from_f32(x.to_f32() * y.to_f32())),
        (DType::I32, RedOp::Prod) => each!(i32, |x: i32, y: i32| x.wrapping_mul(y)),
        (DType::U32, RedOp::Prod) => each!(u32, |x: u32, y: u32| x.wrapping_mul(y)),
        (DType::U8, RedOp::Sum) => each!(u8, |x: u8, y: u8| x.wrapping_add(y)),
        (DType::U8, RedOp::Min) => each!(u8, |x: u8, y: u8| x.min(y)),
        (DType::U8, RedOp::Max) => each!(u8, |x: u8, y: u8| x.max(y)),
        (DType::U8, RedOp::Prod) => each!(u8, |x: u8, y: u8| x.wrapping_mul(y)),
        (DType::I8, RedOp::Sum) => each!(i8, |x: i8, y: i8| x.wrapping_add(y)),
        (DType::I8, RedOp::Min) => each!(i8, |x: i8, y: i8| x.min(y)),
        (DType::I8, RedOp::Max) => each!(i8, |x: i8, y: i8| x.max(y)),
        (DType::I8, RedOp::Prod) => each!(i8, |x: i8, y: i8| x.wrapping_mul(y)),
        (DType::F64, RedOp::Sum) => each!(f64, |x: f64, y: f64| x + y),
        (DType::F64, RedOp::Min) => each!(f64, |x: f64, y: f64| x.min(y)),
        (DType::F64, RedOp::Max) => each!(f64, |x: f64, y: f64| x.max(y)),
        (DType::F64, RedOp::Prod) => each!(f64, |x: f64, y: f64| x * y),
        (DType::I64, RedOp::Sum) => each!(i64, |x: i64, y: i64| x.wrapping_add(y)),
        (DType::I64, RedOp::Min) => each!(i64, |x: i64, y: i64| x.min(y)),
        (DType::I64, RedOp::Max) => each!(i64, |x: i64, y: i64| x.max(y)),
        (DType::I64, RedOp::Prod) => each!(i64, |x: i64, y: i64| x.wrapping_mul(y)),
        (DType::U64, RedOp::Sum) => each!(u64, |x: u64, y: u64| x.wrapping_add(y)),
        (DType::U64, RedOp::Min) => each!(u64, |x: u64, y: u64| x.min(y)),
        (DType::U64, RedOp::Max) => each!(u64, |x: u64, y: u64| x.max(y)),
        (DType::U64, RedOp::Prod) => each!(u64, |x: u64, y: u64| x.wrapping_mul(y)),
        // FP8: both values widened to f32, combined there, rounded once (`crate::fp8`).
        (DType::F8e4m3 | DType::F8e5m2, RedOp::Sum | RedOp::Min | RedOp::Max | RedOp::Prod) => {
            let f = fp8_format(dtype);
            let g: fn(f32, f32) -> f32 = match op {
                RedOp::Sum => |x, y| x + y,
                RedOp::Min => f32::min,
                RedOp::Max => f32::max,
                _ => |x, y| x * y,
            };
            each!(u8, |x: u8, y: u8| f.from_f32(g(f.to_f32(x), f.to_f32(y))))
        }
        // Avg combines as Sum; `finish_into` divides the complete result.
        (_, RedOp::Avg) => combine_into(dtype, RedOp::Sum, acc, src),
    }
}

/// The operator's last step on complete results of `n` contributions each, as the device's
/// (`Combine::finish`): Avg divides, the floats by multiplying with the f32 nearest `1/n` (f16 and bf16
/// widened to f32 and rounded back to nearest even, FP8 likewise; f64 with the f64 nearest `1/n`), the integers
/// truncating toward zero; every other operator and `n ≤ 1` leave `acc` as it is.
pub fn finish_into(dtype: DType, op: RedOp, acc: &mut [u8], n: u32) {
    use half::{bf16, f16};
    if op != RedOp::Avg || n <= 1 {
        return;
    }
    macro_rules! each {
        ($t:ty, $f:expr) => {{
            let w = std::mem::size_of::<$t>();
            for a in acc.chunks_exact_mut(w) {
                let r: $t = $f(<$t>::from_le_bytes((&*a).try_into().unwrap()));
                a.copy_from_slice(&r.to_le_bytes());
            }
        }};
    }
    let r = 1.0 / n as f32;
    match dtype {
        DType::F32 => each!(f32, |x: f32| x * r),
        DType::F16 => each!(f16, |x: f16| f16::from_f32(x.to_f32() * r)),
        DType::Bf16 => each!(bf16, |x: bf16| bf16::from_f32(x.to_f32() * r)),
        DType::I32 => each!(i32, |x: i32| x / n as i32),
        DType::U32 => each!(u32, |x: u32| x / n),
        DType::U8 => each!(u8, |x: u8| (x as u32 / n) as u8),
        DType::I8 => each!(i8, |x: i8| (x as i32 / n as i32) as i8),
        DType::F64 => each!(f64, |x: f64| x * (1.0 / n as f64)),
        DType::I64 => each!(i64, |x: i64| x / n as i64),
        DType::U64 => each!(u64, |x: u64| x / n as u64),
        DType::F8e4m3 | DType::F8e5m2 => {
            let f = fp8_format(dtype);
            each!(u8, |x: u8| f.from_f32(f.to_f32(x) * r))
        }
    }
}

/// The FP8 format of an FP8 `dtype`.
fn fp8_format(dtype: DType) -> crate::fp8::Fp8 {
    match dtype {
        DType::F8e5m2 => crate::fp8::Fp8::E5M2,
        _ => crate::fp8::Fp8::E4M3,
    }
}

/// Runs `l` on `bufs` with the engine's semantics: CTAs one after another, tasks in order; a `Move`
/// combines its sources in ascending rank order; `ReduceInto` accumulates the sources into the
/// destination in ascending rank order (`tma_reduce` only records whether the GPU may reorder them:
/// the CPU result is one of the GPU's admissible results, exact for integer-valued data).
///
/// Returns an error for a malformed program or a race between CTAs (the GPU result would then be
/// undefined).
pub fn execute(l: &Lowered, bufs: &mut HostBuffers, aliases: &[Alias]) -> Result<(), LoweredError> {
    let lens: Vec<[u64; BUFFER_SLOTS]> = bufs.iter().map(|s| std::array::from_fn(|k| s[k].len() as u64)).collect();
    validate(l, &lens, aliases)?;
    check_races(l, aliases)?;
    let resolve = |r: usize, s: u8, off: u64| -> (usize, usize, u64) {
        for &(ar, as_, tr, ts, o) in aliases {
            if ar == r && as_ == s {
                return (tr, ts as usize, off + o);
            }
        }
        (r, s as usize, off)
    };
    // `bufs[rank]` is each rank's one row: a program that names another row (a launch of one
    // rank keeping several, as point-to-point rounds do) is not what this executor models.
    if let Some(p) = l.programs.iter().position(|p| p.table != 0) {
        return Err(LoweredError::BadProgram {
            program: p,
            why: "its buffers in another row of the table (the host executor runs launches of every rank)",
        });
    }
    for prog in &l.programs {
        let first = prog.first_task as usize;
        for (task, t) in
            l.tasks[first..first + prog.task_count as usize].iter().enumerate().map(|(k, t)| (first + k, t))
        {
            let (kind, dtype, op) = decode(task, t)?;
            let read = |bufs: &HostBuffers, r: usize, slot: u8, off: u64| -> Vec<u8> {
                let (r, s, off) = resolve(r, slot, off);
                bufs[r][s][off as usize..off as usize + t.bytes as usize].to_vec()
            };
            let mut acc: Vec<u8> = match kind {
                TaskKind::Move => Vec::new(),
                TaskKind::ReduceInto => read(bufs, t.dst_ranks.trailing_zeros() as usize, t.dst_slot, t.dst_offset),
            };
            let mut operands = (kind == TaskKind::ReduceInto) as u32;
            for r in ranks(t.src_ranks) {
                let src = read(bufs, r, t.src_slot, t.src_offset);
                if acc.is_empty() && kind == TaskKind::Move {
                    acc = src;
                } else {
                    combine_into(dtype, op, &mut acc, &src);
                }
                operands += 1;
            }
            // As the device: a single operand is a copy, which no operator finishes.
            if operands > 1 {
                finish_into(dtype, op, &mut acc, t.divisor as u32);
            }
            for r in ranks(t.dst_ranks) {
                let (r, s, off) = resolve(r, t.dst_slot, t.dst_offset);
                bufs[r][s][off as usize..off as usize + t.bytes as usize].copy_from_slice(&acc);
            }
        }
    }
    Ok(())
}

/// Shared-memory slots per stage the TMA mover needs to run `t`: one per source combined in
/// registers, plus the destination when a `ReduceInto` is combined in registers (always, unless
/// `bulk_reduce` is set and the hardware reduces the task's (dtype, operator)).
pub fn tma_slots(t: &Task, bulk_reduce: bool) -> u32 {
    let sources = t.src_ranks.count_ones();
    match (TaskKind::from_raw(t.kind), DType::from_raw(t.dtype), RedOp::from_raw(t.op)) {
        (Some(TaskKind::ReduceInto), Some(d), Some(o)) if bulk_reduce && tma_can_reduce(d, o) => 1,
        (Some(TaskKind::ReduceInto), _, _) => sources + 1,
        _ => sources,
    }
}

/// A stage of a [`Staged`] program that failed a check.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("stage {stage}: {error}")]
pub struct StageError {
    /// The stage.
    pub stage: usize,
    /// What its check found.
    #[source]
    pub error: LoweredError,
}

/// A program of several launches run in order, each a [`Lowered`] (stream order separates them, and
/// where the ranks launch apart each launch's start barrier too): a reshard's stages ([`crate::reshard::lower()`]), a transfer
/// program's levels ([`crate::compile::direct`]). One kernel runs every stage: the unit's and the
/// operator's.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Staged {
    /// The programs, in launch order (a stage may be empty: it need not be launched).
    pub stages: Vec<Lowered>,
    /// The element type (or copy unit) of every task: the kernel's.
    pub dtype: DType,
    /// The operator of every task: the kernel's (copies ignore it).
    pub op: RedOp,
    /// `buffer_bytes[rank][slot]`: the size each buffer must have (0: unused).
    pub buffer_bytes: Vec<[u64; BUFFER_SLOTS]>,
}

/// Bytes a lowered program copies, per rank and over the whole program.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Loads {
    /// Bytes copied from one rank's buffer into another rank's buffer.
    pub between_ranks: u64,
    /// Bytes copied inside one rank.
    pub local: u64,
    /// Per rank, bytes it sends to other ranks (all stages).
    pub sent: Vec<u64>,
    /// Per rank, bytes it receives from other ranks.
    pub received: Vec<u64>,
    /// Per rank, the part of `sent` that leaves its domain.
    pub sent_cross_domain: Vec<u64>,
    /// Per rank, the part of `received` that comes from outside its domain.
    pub received_cross_domain: Vec<u64>,
}

impl Staged {
    /// Tasks of every stage.
    pub fn task_count(&self) -> usize {
        self.stages.iter().map(|l| l.tasks.len()).sum()
    }

    /// Shared-memory slots per pipeline stage the TMA mover needs: the most sources a task combines.
    pub fn slots(&self) -> u32 {
        self.stages.iter().map(|l| l.slots).max().unwrap_or(1)
    }

    /// Whether a task combines several sources (the CTAs then need more than one warp).
    pub fn combines(&self) -> bool {
        self.stages.iter().any(|l| l.combines)
    }

    /// Tasks per stage.
    pub fn tasks_per_stage(&self) -> Vec<usize> {
        self.stages.iter().map(|l| l.tasks.len()).collect()
    }

    /// Proves that no two CTAs of a stage touch a byte one of them writes.
    pub fn check_races(&self) -> Result<(), StageError> {
        for (stage, l) in self.stages.iter().enumerate() {
            check_races(l, &[]).map_err(|error| StageError { stage, error })?;
        }
        Ok(())
    }

    /// Zeroed host buffers of the sizes the program needs.
    pub fn host_buffers(&self) -> HostBuffers {
        self.buffer_bytes.iter().map(|b| std::array::from_fn(|s| vec![0u8; b[s] as usize])).collect()
    }

    /// Runs every stage in order on host buffers with the engine's semantics ([`execute`], which
    /// also checks bounds and races). Returns the stage that failed.
    pub fn execute(&self, bufs: &mut HostBuffers) -> Result<(), StageError> {
        for (stage, l) in self.stages.iter().enumerate() {
            execute(l, bufs, &[]).map_err(|error| StageError { stage, error })?;
        }
        Ok(())
    }

    /// Bytes copied, per rank and in all, with `domain_size` ranks per NVLink domain.
    pub fn loads(&self, domain_size: u32) -> Loads {
        let n = self.buffer_bytes.len();
        let ds = domain_size.max(1) as usize;
        let mut loads = Loads {
            sent: vec![0; n],
            received: vec![0; n],
            sent_cross_domain: vec![0; n],
            received_cross_domain: vec![0; n],
            ..Loads::default()
        };
        // The stages are public fields: a task naming no source rank, or ranks past the buffers,
        // is left out rather than indexed, and the sums saturate.
        for t in self.stages.iter().flat_map(|l| &l.tasks) {
            for (s, d) in (0..n.min(32))
                .filter(|s| t.src_ranks & (1 << s) != 0)
                .flat_map(|s| (0..n.min(32)).filter(|d| t.dst_ranks & (1 << d) != 0).map(move |d| (s, d)))
            {
                if d == s {
                    loads.local = loads.local.saturating_add(t.bytes);
                    continue;
                }
                loads.between_ranks = loads.between_ranks.saturating_add(t.bytes);
                loads.sent[s] = loads.sent[s].saturating_add(t.bytes);
                loads.received[d] = loads.received[d].saturating_add(t.bytes);
                if s / ds != d / ds {
                    loads.sent_cross_domain[s] = loads.sent_cross_domain[s].saturating_add(t.bytes);
                    loads.received_cross_domain[d] = loads.received_cross_domain[d].saturating_add(t.bytes);
                }
            }
        }
        loads
    }
}

fn slot_name(s: u8) -> &'static str {
    match s {
        slot::INPUT => "in",
        slot::OUTPUT => "out",
        slot::SCRATCH => "scratch",
        _ => "scratch2",
    }
}

impl fmt::Display for Staged {
    /// The stable text form: a header, then per stage every non-empty CTA and its tasks,
    /// `move 0:in@0 -> 4:out@32 32B`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ctas = self.stages.first().map_or(0, |l| l.programs.len() / l.ranks.max(1));
        writeln!(
            f,
            "lowered: unit {:?}, {} ranks, {ctas} CTAs per rank, {} stages, {} tasks",
            self.dtype,
            self.buffer_bytes.len(),
            self.stages.len(),
            self.task_count()
        )?;
        for (s, l) in self.stages.iter().enumerate() {
            writeln!(f, "stage {s}: {} tasks", l.tasks.len())?;
            for p in l.programs.iter().filter(|p| p.task_count > 0) {
                writeln!(f, "  cta {}.{}", p.rank, p.cta)?;
                for t in &l.tasks[p.first_task as usize..(p.first_task + p.task_count) as usize] {
                    let ranks = |mask: u32, sep: &str| {
                        let r: Vec<String> = (0..32).filter(|d| mask & (1 << d) != 0).map(|d| d.to_string()).collect();
                        r.join(sep)
                    };
                    // `move` writes the combination of its sources; `reduce` combines into its
                    // destination.
                    let kind = if t.kind == TaskKind::ReduceInto.raw() { "reduce" } else { "move" };
                    writeln!(
                        f,
                        "    {kind} {}:{}@{} -> {}:{}@{} {}B",
                        ranks(t.src_ranks, "+"),
                        slot_name(t.src_slot),
                        t.src_offset,
                        ranks(t.dst_ranks, ","),
                        slot_name(t.dst_slot),
                        t.dst_offset,
                        t.bytes
                    )?;
                }
            }
        }
        Ok(())
    }
}
