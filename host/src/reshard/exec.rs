//! The CPU executor: runs a [`ReshardPlan`] on host buffers, stage by stage, and [`verify`] checks every
//! destination element against the global tensor.
//!
//! Buffers are per-rank local shards (dense row-major boxes, see [`super::layout`]), as vectors of any
//! `Copy` unit standing for `unit_bytes` bytes: bytes (`u8`, unit 1), elements (`f32`, unit 4, …), or
//! tags. Every transfer is checked (well-formed box writing no byte twice, offsets and strides on unit
//! boundaries, inside both buffers) before it runs: a bad plan is an [`ExecError`], never a panic or an
//! out-of-bounds write.
//!
//! Within a stage all reads happen before any write, so a plan whose stage reads what the same stage
//! writes is caught by [`verify`] instead of working by luck of ordering.

use super::layout::{Rank, Region, for_each_index, row_major_strides};
use super::plan::{ReadFrom, ReshardPlan, Transfer};
use std::collections::BTreeMap;
use std::fmt;

/// Per-rank buffers, by rank.
pub type Buffers<T> = BTreeMap<Rank, Vec<T>>;

/// Why a plan could not run. Every variant names the rank, stage or transfer at fault.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ExecError {
    /// The element type's size differs from the plan's element size.
    #[error("the plan has {plan}-byte elements but the buffers {given}-byte ones")]
    ElementSize {
        /// Bytes per element in the plan.
        plan: u64,
        /// Bytes of the element type given.
        given: u64,
    },
    /// A source rank holding data passed no buffer.
    #[error("source rank {rank} holds data but passed no buffer")]
    MissingSource {
        /// The rank.
        rank: Rank,
    },
    /// A rank outside the source mesh passed a source buffer.
    #[error("rank {rank} is outside the source mesh but passed a source buffer")]
    UnexpectedSource {
        /// The rank.
        rank: Rank,
    },
    /// A source buffer's length differs from its shard's.
    #[error("source rank {rank}'s buffer has {got} units but its shard has {expected}")]
    SourceLength {
        /// The rank.
        rank: Rank,
        /// Units expected.
        expected: u64,
        /// Units given.
        got: u64,
    },
    /// A transfer is not a well-formed box on unit boundaries.
    #[error("stage {stage} transfer {index}: {why}")]
    MalformedTransfer {
        /// Stage index.
        stage: usize,
        /// Index within the stage.
        index: usize,
        /// What is wrong.
        why: String,
    },
    /// A transfer reaches past the end of a buffer.
    #[error(
        "stage {stage} transfer {index} reaches byte {end} of rank {rank}'s {buffer} buffer, which has {len} bytes"
    )]
    OutOfBounds {
        /// Stage index.
        stage: usize,
        /// Index within the stage.
        index: usize,
        /// The rank whose buffer it reaches past.
        rank: Rank,
        /// `"source"`, `"destination (read)"` or `"destination (write)"`.
        buffer: &'static str,
        /// Bytes the transfer needs.
        end: u64,
        /// Bytes the buffer has.
        len: u64,
    },
    /// The destination buffers together need more host memory than can be allocated, or than
    /// [`HOST_BUFFERS_LIMIT_BYTES`](super::layout::HOST_BUFFERS_LIMIT_BYTES).
    #[error(
        "the destination buffers need {bytes} bytes, more than can be allocated (at most {})",
        super::layout::HOST_BUFFERS_LIMIT_BYTES
    )]
    DestinationTooLarge {
        /// Bytes they need (`u64::MAX` past that).
        bytes: u64,
    },
    /// The plan sums partial sums (a `Partial` source) and was run without an addition
    /// ([`execute`], [`execute_bytes`]): use [`execute_summing`].
    #[error("stage {stage} transfer {index} sums partial sums: run the plan with an addition (execute_summing)")]
    NeedsSum {
        /// Stage index.
        stage: usize,
        /// Index within the stage.
        index: usize,
    },
    /// Verification would need more tag memory than allowed.
    #[error("verification needs {bytes} bytes of tags, over the {limit}-byte limit; verify a smaller shape")]
    TooLargeToVerify {
        /// Bytes of tags needed (8 per element of every source and destination buffer).
        bytes: u64,
        /// The limit.
        limit: u64,
    },
}

/// Runs `plan` on byte buffers: `src` holds every source rank's local shard (ranks whose shard is empty
/// may be left out). Returns every destination rank's buffer.
pub fn execute_bytes(plan: &ReshardPlan, src: &Buffers<u8>) -> Result<Buffers<u8>, ExecError> {
    execute(plan, 1, src)
}

/// Runs `plan` on element buffers (`size_of::<T>()` must be the plan's element size).
pub fn execute_elements<T: Copy + Default>(plan: &ReshardPlan, src: &Buffers<T>) -> Result<Buffers<T>, ExecError> {
    let given = size_of::<T>() as u64;
    if given != plan.elem_bytes() {
        return Err(ExecError::ElementSize { plan: plan.elem_bytes(), given });
    }
    execute(plan, given, src)
}

/// Runs `plan` on buffers of units of `unit_bytes` bytes each (a divisor of the element size).
/// A plan that sums partial sums is refused ([`ExecError::NeedsSum`]): see [`execute_summing`].
///
/// Destination buffers start as `T::default()`.
pub fn execute<T: Copy + Default>(
    plan: &ReshardPlan,
    unit_bytes: u64,
    src: &Buffers<T>,
) -> Result<Buffers<T>, ExecError> {
    run(plan, unit_bytes, src, None)
}

/// Runs `plan` on element buffers (`size_of::<T>()` must be the plan's element size), a transfer
/// from several partial sums writing their sum: `add` folded over the sources in ascending rank
/// order, as the engine adds them.
pub fn execute_summing<T: Copy + Default>(
    plan: &ReshardPlan,
    src: &Buffers<T>,
    add: impl Fn(T, T) -> T,
) -> Result<Buffers<T>, ExecError> {
    let given = size_of::<T>() as u64;
    if given != plan.elem_bytes() {
        return Err(ExecError::ElementSize { plan: plan.elem_bytes(), given });
    }
    run(plan, given, src, Some(&add))
}

/// [`execute`], summing with `add` where a transfer has several sources (refused without it).
fn run<T: Copy + Default>(
    plan: &ReshardPlan,
    unit_bytes: u64,
    src: &Buffers<T>,
    add: Option<&dyn Fn(T, T) -> T>,
) -> Result<Buffers<T>, ExecError> {
    if unit_bytes == 0 || !plan.elem_bytes().is_multiple_of(unit_bytes) {
        return Err(ExecError::ElementSize { plan: plan.elem_bytes(), given: unit_bytes });
    }
    let units_per_elem = plan.elem_bytes() / unit_bytes;
    let src_sharding = plan.src_sharding();
    if let Some(&rank) = src.keys().find(|&&r| !src_sharding.mesh().contains(r)) {
        return Err(ExecError::UnexpectedSource { rank });
    }
    for rank in src_sharding.mesh().ranks() {
        let expected = src_sharding.local_len(rank) * units_per_elem;
        match src.get(&rank) {
            None if expected > 0 => return Err(ExecError::MissingSource { rank }),
            Some(buf) if buf.len() as u64 != expected => {
                return Err(ExecError::SourceLength { rank, expected, got: buf.len() as u64 });
            }
            _ => {}
        }
    }
    let dst_sharding = plan.dst_sharding();
    // Replicas hold the tensor once per rank: refused, not aborted, where that is past memory.
    let units = dst_sharding
        .mesh()
        .ranks()
        .try_fold(0u64, |acc, r| acc.checked_add(dst_sharding.local_len(r).checked_mul(units_per_elem)?));
    super::layout::reserve_host::<T>(units).map_err(|bytes| ExecError::DestinationTooLarge { bytes })?;
    let mut dst: Buffers<T> = dst_sharding
        .mesh()
        .ranks()
        .map(|r| (r, vec![T::default(); (dst_sharding.local_len(r) * units_per_elem) as usize]))
        .collect();
    let empty: Vec<T> = Vec::new();

    for (s, stage) in plan.stages().iter().enumerate() {
        let malformed = |index: usize, why: String| ExecError::MalformedTransfer { stage: s, index, why };
        let out_of_bounds = |index: usize, rank: Rank, buffer: &'static str| {
            move |(end, len)| ExecError::OutOfBounds { stage: s, index, rank, buffer, end, len }
        };
        // Check every transfer and read its data, then write: nothing reads what its stage writes.
        let mut staged: Vec<(Walk, Vec<T>)> = Vec::with_capacity(stage.transfers.len());
        for (i, t) in stage.transfers.iter().enumerate() {
            let walk = Walk::of(t, unit_bytes).map_err(|why| malformed(i, why))?;
            let (buf, name) = match t.read {
                ReadFrom::Src if src_sharding.mesh().contains(t.src) => (src.get(&t.src).unwrap_or(&empty), "source"),
                ReadFrom::Dst if dst_sharding.mesh().contains(t.src) => (&dst[&t.src], "destination (read)"),
                read => {
                    let why = format!("reads the {read:?} buffer of rank {}, which has none", t.src);
                    return Err(malformed(i, why));
                }
            };
            let Some(out) = dst.get(&t.dst) else {
                let why = format!("writes rank {}, which is outside the destination mesh", t.dst);
                return Err(malformed(i, why));
            };
            walk.check(buf.len(), walk.src_offset, &walk.src_strides, unit_bytes)
                .map_err(out_of_bounds(i, t.src, name))?;
            // The other partial sums of a summing transfer: source buffers of the same box.
            let mut partials = Vec::with_capacity(t.partials.len());
            if t.reduces() {
                if add.is_none() {
                    return Err(ExecError::NeedsSum { stage: s, index: i });
                }
                if t.read != ReadFrom::Src {
                    return Err(malformed(i, "sums buffers other than sources".into()));
                }
                for &p in &t.partials {
                    if !src_sharding.mesh().contains(p)
                        || p == t.src
                        || t.partials.iter().filter(|&&q| q == p).count() > 1
                    {
                        let why = format!("sums rank {p}, which holds no source buffer or is named twice");
                        return Err(malformed(i, why));
                    }
                    let pbuf = src.get(&p).unwrap_or(&empty);
                    walk.check(pbuf.len(), walk.src_offset, &walk.src_strides, unit_bytes)
                        .map_err(out_of_bounds(i, p, "source"))?;
                    partials.push((p, pbuf));
                }
            }
            walk.check(out.len(), walk.dst_offset, &walk.dst_strides, unit_bytes).map_err(out_of_bounds(
                i,
                t.dst,
                "destination (write)",
            ))?;
            // Writes that overlap (a zero stride, rows longer than their stride) are refused before the
            // data is staged: a box that writes no byte twice stages at most its destination buffer.
            if !walk.nested(&walk.dst_strides) {
                let why =
                    format!("its rows overlap on the write side (strides {:?}, shape {:?})", t.dst_strides, t.shape);
                return Err(malformed(i, why));
            }
            let read = |from: &[T]| {
                let mut data = Vec::with_capacity(walk.total_units() as usize);
                walk.for_each_run(walk.src_offset, &walk.src_strides, |at| {
                    data.extend_from_slice(&from[at..at + walk.run as usize]);
                });
                data
            };
            // A sum folds its sources in ascending rank order, `src` among the others.
            partials.push((t.src, buf));
            partials.sort_unstable_by_key(|&(r, _)| r);
            let mut data = read(partials[0].1);
            if let Some(add) = add {
                for &(_, from) in &partials[1..] {
                    for (acc, v) in data.iter_mut().zip(read(from)) {
                        *acc = add(*acc, v);
                    }
                }
            }
            staged.push((walk, data));
        }
        for (t, (walk, data)) in stage.transfers.iter().zip(staged) {
            // Present and long enough: checked above, and buffer lengths never change.
            let buf = dst.get_mut(&t.dst).expect("checked above");
            let run = walk.run as usize;
            let mut chunks = data.chunks_exact(run.max(1));
            walk.for_each_run(walk.dst_offset, &walk.dst_strides, |at| {
                if let Some(chunk) = chunks.next() {
                    buf[at..at + run].copy_from_slice(chunk);
                }
            });
        }
    }
    Ok(dst)
}

/// A transfer's box in units, checked to be well formed.
struct Walk {
    src_offset: u64,
    dst_offset: u64,
    /// Outer loop extents.
    outer: Vec<u64>,
    src_strides: Vec<u64>,
    dst_strides: Vec<u64>,
    /// Units per contiguous run.
    run: u64,
}

impl Walk {
    fn of(t: &Transfer, unit: u64) -> Result<Self, String> {
        let Some((&run_bytes, outer)) = t.shape.split_last() else {
            return Err("empty box shape".into());
        };
        if t.src_strides.len() != outer.len() || t.dst_strides.len() != outer.len() {
            return Err(format!(
                "box of {} dims with {} read and {} write strides (want {})",
                t.shape.len(),
                t.src_strides.len(),
                t.dst_strides.len(),
                outer.len()
            ));
        }
        let product = t.shape.iter().try_fold(1u64, |acc, &e| acc.checked_mul(e));
        if product != Some(t.bytes) {
            return Err(format!("box {:?} does not hold the stated {} bytes", t.shape, t.bytes));
        }
        let units = |what: &str, v: u64| {
            if v.is_multiple_of(unit) {
                Ok(v / unit)
            } else {
                Err(format!("{what} {v} is not a multiple of {unit} bytes"))
            }
        };
        Ok(Self {
            src_offset: units("read offset", t.src_offset)?,
            dst_offset: units("write offset", t.dst_offset)?,
            outer: outer.to_vec(),
            src_strides: t.src_strides.iter().map(|&s| units("read stride", s)).collect::<Result<_, _>>()?,
            dst_strides: t.dst_strides.iter().map(|&s| units("write stride", s)).collect::<Result<_, _>>()?,
            run: units("run", run_bytes)?,
        })
    }

    fn total_units(&self) -> u64 {
        self.outer.iter().product::<u64>() * self.run
    }

    /// Checks the box stays inside a buffer of `len` units; on failure gives (end, len) in bytes.
    fn check(&self, len: usize, offset: u64, strides: &[u64], unit: u64) -> Result<(), (u64, u64)> {
        let len = len as u64;
        if self.run == 0 || self.outer.contains(&0) {
            return Ok(());
        }
        let end = self
            .outer
            .iter()
            .zip(strides)
            .try_fold(offset.checked_add(self.run), |acc, (&e, &s)| Some(acc?.checked_add((e - 1).checked_mul(s)?)))
            .flatten();
        match end {
            Some(end) if end <= len => Ok(()),
            end => Err((end.map_or(u64::MAX, |e| e.saturating_mul(unit)), len * unit)),
        }
    }

    /// Whether the loops nest on a side with `strides`: taken by increasing stride, each loop (of
    /// extent above 1) steps past everything the loops inside it cover, so no unit is visited twice.
    /// Every box the planner makes nests on both sides (it is a sub-box of a dense row-major buffer).
    /// Call after [`Walk::check`]: spans inside a buffer do not overflow.
    fn nested(&self, strides: &[u64]) -> bool {
        if self.run == 0 || self.outer.contains(&0) {
            return true;
        }
        let mut loops: Vec<(u64, u64)> =
            strides.iter().zip(&self.outer).filter(|&(_, &e)| e > 1).map(|(&s, &e)| (s, e)).collect();
        loops.sort_unstable();
        let mut span = self.run;
        loops.into_iter().all(|(s, e)| {
            let fits = s >= span;
            span += (e - 1) * s;
            fits
        })
    }

    /// Calls `f` with the unit index of each run's start, in row-major loop order.
    fn for_each_run(&self, offset: u64, strides: &[u64], mut f: impl FnMut(usize)) {
        if self.run == 0 {
            return;
        }
        for_each_index(&self.outer, |idx| {
            f((offset + idx.iter().zip(strides).map(|(i, s)| i * s).sum::<u64>()) as usize);
        });
    }
}

/// The default limit of [`verify`]'s tag memory: 1 GiB.
pub const VERIFY_TAG_LIMIT_BYTES: u64 = 1 << 30;

/// One destination element that does not hold what it should.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mismatch {
    /// The destination rank.
    pub rank: Rank,
    /// Element index in its local buffer.
    pub local_index: u64,
    /// The global index it should hold.
    pub expected: Vec<u64>,
    /// What it holds instead.
    pub found: Found,
}

/// What a wrong destination element holds, in a [`Mismatch`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Found {
    /// Nothing was written there.
    Nothing,
    /// The value of the element at this global index.
    Global(Vec<u64>),
    /// A value that is no element's: from a `Partial` source, a sum missing a partial sum or
    /// holding one twice.
    Other,
}

/// The outcome of [`verify`]: every element of every destination buffer checked, the first wrong
/// ones described.
pub type VerifyReport = crate::verify::VerifyReport<Mismatch>;

impl fmt::Display for VerifyReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_exact() {
            return write!(f, "verified: all {} destination elements match the global tensor", self.checked);
        }
        writeln!(
            f,
            "FAILED: {} of {} destination elements differ from the global tensor (first {} listed)",
            self.wrong,
            self.checked,
            self.first.len()
        )?;
        for m in &self.first {
            let (rank, index, want) = (m.rank, m.local_index, &m.expected);
            match &m.found {
                Found::Global(found) => {
                    writeln!(f, "  rank {rank} element {index}: want global {want:?}, holds global {found:?}")?
                }
                Found::Nothing => writeln!(f, "  rank {rank} element {index}: want global {want:?}, never written")?,
                Found::Other => writeln!(
                    f,
                    "  rank {rank} element {index}: want global {want:?}, holds a sum that is no element's \
                     (a partial sum missing or added twice)"
                )?,
            }
        }
        Ok(())
    }
}

/// Runs `plan` on tag buffers, each element tagged with its global index, and checks every element of
/// every destination buffer. From a `Partial` source, partial sum `i` of the element tagged `t`
/// holds `t × w_i` (wrapping, `w_i` odd pseudo-random weights, one even where their count is
/// even, so that their sum `W` is odd), the plan runs summing, and the element must hold `t × W`:
/// a partial sum missing or added twice changes it. Refuses (with [`ExecError::TooLargeToVerify`]) when the tags would need
/// more than [`VERIFY_TAG_LIMIT_BYTES`].
pub fn verify(plan: &ReshardPlan) -> Result<VerifyReport, ExecError> {
    verify_with_limit(plan, VERIFY_TAG_LIMIT_BYTES)
}

/// [`verify`] with a chosen tag-memory limit in bytes. A limit above
/// [`HOST_BUFFERS_LIMIT_BYTES`](super::layout::HOST_BUFFERS_LIMIT_BYTES) is taken as that bound
/// (the one every host buffer of a reshard is held to), and tags that cannot be allocated are
/// refused too: both with [`ExecError::TooLargeToVerify`], naming the limit that applied.
pub fn verify_with_limit(plan: &ReshardPlan, limit: u64) -> Result<VerifyReport, ExecError> {
    let limit = limit.min(super::layout::HOST_BUFFERS_LIMIT_BYTES);
    let (src, dst) = (plan.src_sharding(), plan.dst_sharding());
    // Summed without wrapping: a sum past u64 is as much too large as any.
    let mut lens = src.mesh().ranks().map(|r| src.local_len(r)).chain(dst.mesh().ranks().map(|r| dst.local_len(r)));
    let elements = lens.try_fold(0u64, |acc, n| acc.checked_add(n));
    let bytes = elements.map_or(u64::MAX, |e| e.saturating_mul(8));
    if bytes > limit {
        return Err(ExecError::TooLargeToVerify { bytes, limit });
    }
    super::layout::reserve_host::<u64>(elements).map_err(|bytes| ExecError::TooLargeToVerify { bytes, limit })?;
    let shape = plan.shape();
    let sums = src.partial_sums();
    let weight = |i: u64| if sums == 1 { 1 } else { partial_weight(i, sums) };
    let total = (0..sums).fold(0u64, |acc, i| acc.wrapping_add(weight(i)));
    let tags: Buffers<u64> = src
        .mesh()
        .ranks()
        .map(|r| {
            let w = weight(src.partial_index(r).unwrap_or(0));
            let tags = src.local_region(r).map_or_else(Vec::new, |g| region_tags(shape, &g));
            (r, tags.into_iter().map(|t| t.wrapping_mul(w)).collect())
        })
        .collect();
    let out = run(plan, plan.elem_bytes(), &tags, Some(&u64::wrapping_add))?;
    // `total` is odd: the tag an element's full sum stands for is its product with the inverse.
    let inverse = odd_inverse(total);
    let elements = src.elements();
    let unravel = |linear: u64| -> Vec<u64> {
        let mut coords = vec![0; shape.len()];
        let mut rest = linear;
        for d in (0..shape.len()).rev() {
            coords[d] = rest % shape[d];
            rest /= shape[d];
        }
        coords
    };
    let mut report = VerifyReport::default();
    for (&rank, got) in &out {
        let want = dst.local_region(rank).map_or_else(Vec::new, |g| region_tags(shape, &g));
        report.checked += want.len() as u64;
        for (i, (&w, &g)) in want.iter().zip(got).enumerate() {
            if w.wrapping_mul(total) != g {
                report.record(1, || {
                    let tag = g.wrapping_mul(inverse);
                    let found = match g {
                        0 => Found::Nothing,
                        _ if (1..=elements).contains(&tag) => Found::Global(unravel(tag - 1)),
                        _ => Found::Other,
                    };
                    Mismatch { rank, local_index: i as u64, expected: unravel(w - 1), found }
                });
            }
        }
    }
    Ok(report)
}

/// [`verify`]'s weight of partial sum `index` of `sums` (> 1): odd, pseudo-random, except index 0's,
/// which is even (and not 0) where `sums` is even, so that the weights add up to an odd number.
fn partial_weight(index: u64, sums: u64) -> u64 {
    // splitmix64's finalizer: weights far apart, so that no two partial sums stand in for each other.
    let mut z = index.wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    if index == 0 && sums.is_multiple_of(2) { (z | 2) & !1 } else { z | 1 }
}

/// The inverse of an odd number modulo 2^64 (Newton's iteration doubles the correct bits).
fn odd_inverse(odd: u64) -> u64 {
    let mut x = odd;
    for _ in 0..6 {
        x = x.wrapping_mul(2u64.wrapping_sub(odd.wrapping_mul(x)));
    }
    x
}

/// The tags (global row-major index + 1; 0 means "never written") of a region, row-major.
fn region_tags(shape: &[u64], region: &Region) -> Vec<u64> {
    let mut out = Vec::with_capacity(region.volume() as usize);
    let strides = row_major_strides(shape);
    for_each_index(&region.extent, |idx| {
        out.push(1 + (0..idx.len()).map(|d| (region.start[d] + idx[d]) * strides[d]).sum::<u64>());
    });
    out
}
