//! The direct lowering: a [`Program`] run by the collective engine's walker (the T-CCL and reshard
//! descriptors, [`Lowered`]), without FIFOs, for the ranks of one communicator,
//! whose buffers every rank addresses (virtual ranks of one GPU, GPUs with peer access).
//!
//! # Levels
//!
//! Every op gets a *level*: one past the highest level of the ops before it (in the program's
//! sequential order) that write a chunk it reads or writes, or read a chunk it writes. Chunks are
//! resolved to each rank's storage ([`BufferLayout::resolve`]), so in-place aliases conflict as one
//! location. Ops of one level then touch no chunk another op of the level writes, so they may run
//! at once, and running the levels in order gives the sequential semantics. Each level becomes one
//! launch ([`Lowered`]): its ops are tasks that move data straight between the ranks' buffers (a
//! transfer is a copy, or for `rrc` a reduction, from the sender's buffer into the receiver's), and
//! the levels are separated as a reshard's stages are: by stream order where one launch holds
//! every rank, else also by each launch's start barrier, which waits for every rank to reach it. A ring AllReduce on `n` ranks has `2(n - 1)` levels; a direct one `n` (the
//! `n - 1` reductions into one chunk write it in turn, in the program's order, so floats round as
//! the program's CPU executor rounds them).
//!
//! # Buffers
//!
//! Out of place, a rank's input is [`slot::INPUT`], its output [`slot::OUTPUT`], its scratch
//! [`slot::SCRATCH`]. In place the user's one buffer (the larger of input and output) is
//! `OUTPUT`, and the input and output are where [`BufferLayout::buffer_base`] puts them in it. Chunk `c`
//! of a buffer starts at byte `c × chunk_bytes`.
//!
//! # Tasks and CTAs
//!
//! A transfer `recv` or a local `copy` is a `Move`; `rrc` and a local `reduce` are a `ReduceInto`
//! (`dst = dst ⊕ src`). The receiving rank's CTAs run a transfer (it pulls, and reduces locally, as
//! T-CCL's shard-in does). Each rank's tasks of a level are cut into [`DirectOptions::ctas`] spans
//! of nearly equal bytes, split on 16-byte boundaries. `Avg` is refused: dividing needs to know
//! which reduction of a chunk is its last, which the program does not say.
//!
//! # Across nodes
//!
//! [`lower_by_node`] keeps the levels and splits each: ops inside a node stay engine tasks, whose
//! CTAs meet only their node's ranks; ops between nodes become [`WireTransfer`]s for a
//! point-to-point engine between nodes (a reduction lands in the receiver's [`slot::SCRATCH2`] and
//! the level's launch reduces it into place). The host runs it ([`ByNode::execute`]); the
//! communicator does not yet.

use crate::exec::reference::reference;
use crate::exec::{Element, ExecError, VerifyReport, check_verify_memory, test_inputs_for};
use crate::lowered::{self, Lowered, LoweredError, Staged};
use crate::program::{BufferKind, BufferLayout, Op, OpKind, Program, ProgramError, Rank, RecvOp, Slice};
use oxccl_kernels::abi::{BUFFER_SLOTS, DType, MAX_CTAS_PER_RANK, MAX_RANKS, RedOp, Task, TaskKind, slot};

/// How to lower a program directly.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DirectOptions {
    /// Bytes per chunk: a positive multiple of 16 (the bulk copies' alignment).
    pub chunk_bytes: u64,
    /// The element type of the reductions (copies move bytes whatever it is).
    pub dtype: DType,
    /// The reduction operator (any but `Avg`).
    pub op: RedOp,
    /// CTAs per rank, `1..=MAX_CTAS_PER_RANK`.
    pub ctas: u32,
    /// Most tasks one level may have.
    pub max_tasks: u64,
}

impl DirectOptions {
    /// `chunk_bytes` per chunk, `ctas` CTAs per rank, summing `dtype`, at most 4 Mi tasks a level.
    pub fn new(chunk_bytes: u64, dtype: DType, ctas: u32) -> Self {
        Self { chunk_bytes, dtype, op: RedOp::Sum, ctas, max_tasks: 1 << 22 }
    }
}

/// Why a program cannot be lowered directly. Every variant names what was wrong.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum DirectError {
    /// The program does not verify.
    #[error("the program: {0}")]
    Program(#[source] ProgramError),
    /// More ranks than one launch addresses.
    #[error("{ranks} ranks: one launch addresses at most {max}")]
    Ranks {
        /// The program's ranks.
        ranks: u32,
        /// [`MAX_RANKS`].
        max: usize,
    },
    /// A bad option.
    #[error("{field}: {why}")]
    Options {
        /// The option.
        field: &'static str,
        /// What is wrong with it.
        why: String,
    },
    /// A buffer or a level past what the descriptors hold.
    #[error("{what} is too large for the direct lowering")]
    TooLarge {
        /// What.
        what: String,
    },
    /// A level failed validation (a bug in the lowering, reported rather than launched).
    #[error("level {level}: {error}")]
    Invalid {
        /// The level.
        level: usize,
        /// What validation found.
        #[source]
        error: LoweredError,
    },
}

/// Why [`verify`] could not compare a lowering with the reference.
#[derive(Debug, thiserror::Error)]
pub enum VerifyError {
    /// The program does not lower onto the engine with these options (what `run_program` refuses).
    #[error(transparent)]
    Lower(#[from] DirectError),
    /// The lowering failed on the host (bounds, races).
    #[error(transparent)]
    Run(#[from] lowered::StageError),
    /// Inputs that do not fit (an element type of another size than the engine's), an operator
    /// without a reference (Avg), or host buffers past the memory this process can still allocate
    /// ([`ExecError::TooLarge`]).
    #[error(transparent)]
    Inputs(#[from] ExecError),
}

/// Runs `program` lowered onto the engine (what `run_program` runs) on the host with `inputs`
/// (every rank's input buffer, `input_chunks × chunk_len` elements of `T`, the engine's `dtype`):
/// every rank's output buffer (`output_chunks × chunk_len` elements), and the lowering's levels
/// (launches per call).
pub fn run_on_host<T: bytemuck::Pod>(
    program: &Program,
    dtype: DType,
    op: RedOp,
    chunk_len: usize,
    inputs: &[Vec<T>],
) -> Result<(Vec<Vec<T>>, usize), VerifyError> {
    let bad = |reason: String| VerifyError::Inputs(ExecError::BadInput { reason });
    let size = std::mem::size_of::<T>();
    if dtype.size() != size {
        return Err(bad(format!("{dtype:?} is {} bytes, the host type {size}", dtype.size())));
    }
    let l = &program.layout;
    // Refused before anything is allocated (the buffers, and the outputs copied out).
    check_verify_memory(l, chunk_len, size, crate::compile::memory::default_limit()).map_err(ExecError::from)?;
    let want_in = l.input_chunks() as usize * chunk_len;
    if inputs.len() != l.ranks as usize || inputs.iter().any(|v| v.len() != want_in) {
        return Err(bad(format!("{} ranks of {want_in} elements each expected", l.ranks)));
    }
    let chunk_bytes = (chunk_len * size) as u64;
    let staged = lower_direct(program, &DirectOptions { op, ..DirectOptions::new(chunk_bytes, dtype, 1) })?;
    let mut bufs = staged.host_buffers();
    for (r, input) in inputs.iter().enumerate() {
        let (s, off) = place(l, Rank(r as u32), BufferKind::Input, chunk_bytes);
        let bytes: &[u8] = bytemuck::cast_slice(input);
        let Some(dst) = bufs[r][s as usize].get_mut(off as usize..off as usize + bytes.len()) else {
            return Err(bad(format!("rank {r}'s input does not fit its slot {s} of the lowering")));
        };
        dst.copy_from_slice(bytes);
    }
    staged.execute(&mut bufs)?;
    let out_bytes = l.output_chunks() as usize * chunk_len * size;
    let outputs = (0..inputs.len())
        .map(|r| {
            let (s, off) = place(l, Rank(r as u32), BufferKind::Output, chunk_bytes);
            let b = bufs[r][s as usize].get(off as usize..off as usize + out_bytes);
            let b = b.ok_or_else(|| bad(format!("rank {r}'s output does not fit its slot {s} of the lowering")))?;
            Ok(b.chunks_exact(size).map(bytemuck::pod_read_unaligned).collect())
        })
        .collect::<Result<_, VerifyError>>()?;
    Ok((outputs, staged.stages.len()))
}

/// [`run_on_host`] with the collectives' reference inputs ([`crate::exec::test_inputs_for`]),
/// every rank's output compared with the collective's reference under `op`.
pub fn verify<T: Element + bytemuck::Pod>(
    program: &Program,
    dtype: DType,
    op: RedOp,
    chunk_len: usize,
) -> Result<(VerifyReport, usize), VerifyError> {
    let l = &program.layout;
    // The inputs and the reference first: refused before they are made.
    let limit = crate::compile::memory::default_limit();
    check_verify_memory(l, chunk_len, std::mem::size_of::<T>(), limit).map_err(ExecError::from)?;
    let inputs: Vec<Vec<T>> = test_inputs_for(l.ranks as usize, l.input_chunks() as usize * chunk_len, op);
    let want = reference(l.collective, &inputs, op)?;
    let (got, levels) = run_on_host(program, dtype, op, chunk_len, &inputs)?;
    let mut report = VerifyReport::default();
    for (r, (g, w)) in got.iter().zip(&want).enumerate().filter(|(r, _)| l.collective.defines_output(*r)) {
        report.tally(r, g, w);
    }
    Ok((report, levels))
}

/// Where chunk 0 of `buffer` of `rank` is in a direct lowering with `chunk_bytes` per chunk:
/// (slot, byte offset).
pub fn place(l: &BufferLayout, rank: Rank, buffer: BufferKind, chunk_bytes: u64) -> (u8, u64) {
    match (l.in_place, buffer) {
        (_, BufferKind::Scratch) => (slot::SCRATCH, 0),
        (false, BufferKind::Input) => (slot::INPUT, 0),
        (false, BufferKind::Output) => (slot::OUTPUT, 0),
        (true, b) => (slot::OUTPUT, u64::from(l.buffer_base(rank, b)) * chunk_bytes),
    }
}

/// Lowers `program` level by level (see the module documentation).
/// The result is one stage per level ([`Staged::stages`]).
pub fn lower_direct(program: &Program, opts: &DirectOptions) -> Result<Staged, DirectError> {
    let buffer_bytes = checked_buffers(program, opts)?;
    let (l, n) = (&program.layout, program.layout.ranks as usize);

    let mut levels: Vec<Vec<Task>> = Vec::new();
    let mut owners: Vec<Vec<usize>> = Vec::new();
    for (op, level) in program.ops.iter().zip(op_levels(program)?) {
        if levels.len() <= level {
            levels.resize_with(level + 1, Vec::new);
            owners.resize_with(level + 1, Vec::new);
        }
        levels[level].push(task_of(l, op, opts));
        owners[level].push(op.dst_rank().index());
    }

    let mut out = Vec::with_capacity(levels.len());
    for (level, (tasks, owner)) in levels.into_iter().zip(owners).enumerate() {
        let lowered = distribute(tasks, &owner, n, opts)?;
        if lowered.tasks.len() as u64 > opts.max_tasks {
            return Err(DirectError::TooLarge {
                what: format!("level {level}: {} tasks (limit {})", lowered.tasks.len(), opts.max_tasks),
            });
        }
        lowered::validate(&lowered, &buffer_bytes, &[]).map_err(|error| DirectError::Invalid { level, error })?;
        lowered::check_races(&lowered, &[]).map_err(|error| DirectError::Invalid { level, error })?;
        out.push(lowered);
    }
    Ok(Staged { stages: out, dtype: opts.dtype, op: opts.op, buffer_bytes })
}

/// Checks `program` (verified, at most [`MAX_RANKS`] ranks) and `opts` for a direct lowering, and
/// gives each rank's buffer sizes (`buffer_bytes[rank][slot]`).
fn checked_buffers(program: &Program, opts: &DirectOptions) -> Result<Vec<[u64; BUFFER_SLOTS]>, DirectError> {
    program.verify().map_err(DirectError::Program)?;
    let l = &program.layout;
    if l.ranks as usize > MAX_RANKS {
        return Err(DirectError::Ranks { ranks: l.ranks, max: MAX_RANKS });
    }
    let bad = |field, why: &str| Err(DirectError::Options { field, why: why.into() });
    if opts.chunk_bytes == 0 || !opts.chunk_bytes.is_multiple_of(16) {
        return bad("chunk_bytes", "must be a positive multiple of 16");
    }
    if opts.ctas == 0 || opts.ctas as usize > MAX_CTAS_PER_RANK {
        return bad("ctas", "must be 1..=256");
    }
    if opts.op == RedOp::Avg && program.ops.iter().any(|op| op.reduces()) {
        return bad("op", "Avg needs to know which reduction of a chunk is its last; the program does not say");
    }
    let bytes = |chunks: u32| {
        u64::from(chunks)
            .checked_mul(opts.chunk_bytes)
            .ok_or_else(|| DirectError::TooLarge { what: format!("{chunks} chunks") })
    };
    let mut buffer_bytes = Vec::with_capacity(l.ranks as usize);
    for r in 0..l.ranks {
        let mut b = [0u64; BUFFER_SLOTS];
        if l.in_place {
            b[slot::OUTPUT as usize] = bytes(l.input_chunks().max(l.output_chunks()))?;
        } else {
            b[slot::INPUT as usize] = bytes(l.input_chunks())?;
            b[slot::OUTPUT as usize] = bytes(l.output_chunks())?;
        }
        b[slot::SCRATCH as usize] = bytes(l.scratch[r as usize])?;
        buffer_bytes.push(b);
    }
    Ok(buffer_bytes)
}

/// The level of every op of a verified `program` (see the module documentation): one past the
/// last level that writes a chunk it reads or writes, or reads a chunk it writes.
fn op_levels(program: &Program) -> Result<Vec<usize>, DirectError> {
    let l = &program.layout;
    let base: Vec<usize> = (0..l.ranks)
        .scan(0usize, |at, r| {
            let b = *at;
            *at += l.storage_chunks(Rank(r)) as usize;
            Some(b)
        })
        .collect();
    let total = (0..l.ranks).map(|r| l.storage_chunks(Rank(r)) as usize).sum::<usize>();
    let mut last_write: Vec<i64> = Vec::new();
    let mut last_read: Vec<i64> = Vec::new();
    for v in [&mut last_write, &mut last_read] {
        v.try_reserve_exact(total).map_err(|_| DirectError::TooLarge { what: format!("{total} chunk locations") })?;
        v.resize(total, -1);
    }
    let range = |rank: Rank, s: Slice| {
        // Verified programs' slices resolve.
        let first = l.resolve(rank, s).expect("a verified program's slices resolve") as usize;
        base[rank.index()] + first..base[rank.index()] + first + s.count as usize
    };
    let mut out = Vec::with_capacity(program.ops.len());
    for op in &program.ops {
        let (reads, writes) = (range(op.src_rank(), op.src()), range(op.dst_rank(), op.dst()));
        let mut level = 0i64;
        for i in reads.clone() {
            level = level.max(last_write[i] + 1);
        }
        for i in writes.clone() {
            level = level.max(last_write[i] + 1).max(last_read[i] + 1);
        }
        for i in reads {
            last_read[i] = last_read[i].max(level);
        }
        for i in writes {
            last_write[i] = level;
            if op.reduces() {
                last_read[i] = last_read[i].max(level);
            }
        }
        out.push(level as usize);
    }
    Ok(out)
}

/// The engine task of `op`: a `Move` for a store, a `ReduceInto` for a reduction, from the source
/// rank's buffer into the destination rank's.
fn task_of(l: &BufferLayout, op: &Op, opts: &DirectOptions) -> Task {
    let cb = opts.chunk_bytes;
    let (src_rank, dst_rank) = (op.src_rank(), op.dst_rank());
    let (src_slot, src_base) = place(l, src_rank, op.src().buffer, cb);
    let (dst_slot, dst_base) = place(l, dst_rank, op.dst().buffer, cb);
    let reduce = matches!(op.kind, OpKind::Reduce { .. } | OpKind::Transfer { op: RecvOp::RecvReduceCopy, .. });
    let kind = if reduce { TaskKind::ReduceInto } else { TaskKind::Move };
    Task {
        kind: kind.raw(),
        dtype: opts.dtype.raw(),
        op: opts.op.raw(),
        src_slot,
        dst_slot,
        flags: 0,
        divisor: 0,
        src_ranks: 1 << src_rank.0,
        dst_ranks: 1 << dst_rank.0,
        src_offset: src_base + u64::from(op.src().offset) * cb,
        dst_offset: dst_base + u64::from(op.dst().offset) * cb,
        bytes: u64::from(op.src().count) * cb,
    }
}

/// One level's tasks given to their owners' CTAs: each rank's tasks cut into `ctas` spans of nearly
/// equal bytes (a task crossing a boundary split at a 16-byte multiple), every rank `ctas` CTAs,
/// rank-major, each meeting every rank at its barriers.
fn distribute(tasks: Vec<Task>, owner: &[usize], n: usize, opts: &DirectOptions) -> Result<Lowered, DirectError> {
    let c = opts.ctas as usize;
    let mut per_rank: Vec<Vec<Task>> = vec![Vec::new(); n];
    for (t, &o) in tasks.into_iter().zip(owner) {
        per_rank[o].push(t);
    }
    let mut programs = Vec::with_capacity(n * c);
    let mut out: Vec<Task> = Vec::new();
    let mut slots = 1;
    let mut combines = false;
    for (rank, list) in per_rank.iter().enumerate() {
        let total: u64 = list.iter().map(|t| t.bytes).sum();
        let (mut k, mut pos) = (0usize, 0u64);
        let mut spans: Vec<Vec<Task>> = vec![Vec::new(); c];
        for &t in list {
            let mut t = t;
            loop {
                let end = (u128::from(total) * (k as u128 + 1) / c as u128) as u64;
                if k + 1 >= c || pos + t.bytes <= end {
                    pos += t.bytes;
                    spans[k].push(t);
                    break;
                }
                let cut = (end - pos.min(end)) & !15;
                if cut > 0 {
                    spans[k].push(Task { bytes: cut, ..t });
                    t.src_offset += cut;
                    t.dst_offset += cut;
                    t.bytes -= cut;
                    pos += cut;
                }
                k += 1;
            }
        }
        for (cta, span) in spans.into_iter().enumerate() {
            let first =
                u32::try_from(out.len()).map_err(|_| DirectError::TooLarge { what: "a level's task array".into() })?;
            for t in &span {
                if t.kind == TaskKind::ReduceInto.raw() {
                    // Accumulator and operand combined in registers, through a slot each.
                    slots = slots.max(lowered::tma_slots(t, false));
                    combines = true;
                }
            }
            programs.push(lowered::meeting_all(rank, cta, first, span.len() as u32, n));
            out.extend(span);
        }
    }
    Ok(Lowered { programs, tasks: out, ranks: n, slots, combines })
}

/// A transfer between nodes of a program lowered by node ([`lower_by_node`]): `bytes` from rank
/// `src_rank`'s buffer `src_slot` at `src_offset` into rank `dst_rank`'s `dst_slot` at
/// `dst_offset`, moved by the engine between nodes (point-to-point, as NCCL's send and receive).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WireTransfer {
    /// The sending rank.
    pub src_rank: u32,
    /// Its buffer slot.
    pub src_slot: u8,
    /// Byte offset in that buffer.
    pub src_offset: u64,
    /// The receiving rank.
    pub dst_rank: u32,
    /// Its buffer slot: the destination's, or [`slot::SCRATCH2`] for data it then reduces.
    pub dst_slot: u8,
    /// Byte offset in that buffer.
    pub dst_offset: u64,
    /// Bytes moved.
    pub bytes: u64,
}

/// One level of a program lowered by node: its transfers between nodes, then one launch of the
/// collective engine whose CTAs meet only their own node's ranks (the level's stores and reductions
/// inside each node, and the reductions of what crossed into a receiver's [`slot::SCRATCH2`]).
#[derive(Clone, Debug)]
pub struct NodeLevel {
    /// Transfers between nodes, all independent of each other.
    pub wire: Vec<WireTransfer>,
    /// The launch inside the nodes, after the transfers.
    pub engine: Lowered,
}

/// A program lowered level by level for ranks spread over nodes ([`lower_by_node`]).
#[derive(Clone, Debug)]
pub struct ByNode {
    /// The levels, in order.
    pub levels: Vec<NodeLevel>,
    /// Consecutive ranks per node.
    pub ranks_per_node: u32,
    /// `buffer_bytes[rank][slot]`: as [`lower_direct`]'s, and [`slot::SCRATCH2`] the most a rank
    /// receives to reduce in one level.
    pub buffer_bytes: Vec<[u64; BUFFER_SLOTS]>,
}

impl ByNode {
    /// Zeroed host buffers of every rank, of [`ByNode::buffer_bytes`].
    pub fn host_buffers(&self) -> lowered::HostBuffers {
        self.buffer_bytes.iter().map(|b| std::array::from_fn(|s| vec![0u8; b[s] as usize])).collect()
    }

    /// Runs every level on host buffers: the transfers between nodes as copies, then the engine's
    /// launch with the engine's semantics ([`lowered::execute`]). Returns the level that failed.
    pub fn execute(&self, bufs: &mut lowered::HostBuffers) -> Result<(), lowered::StageError> {
        for (stage, level) in self.levels.iter().enumerate() {
            for (task, w) in level.wire.iter().enumerate() {
                let fail = |rank: u32, slot: u8, end: u64, len: usize| lowered::StageError {
                    stage,
                    error: LoweredError::OutOfBounds { task, rank: rank as usize, slot, end, len: len as u64 },
                };
                let src = &bufs[w.src_rank as usize][w.src_slot as usize];
                let (s, e) = (w.src_offset as usize, (w.src_offset + w.bytes) as usize);
                let data = src.get(s..e).ok_or_else(|| fail(w.src_rank, w.src_slot, e as u64, src.len()))?.to_vec();
                let dst = &mut bufs[w.dst_rank as usize][w.dst_slot as usize];
                let (s, e) = (w.dst_offset as usize, (w.dst_offset + w.bytes) as usize);
                let len = dst.len();
                dst.get_mut(s..e).ok_or_else(|| fail(w.dst_rank, w.dst_slot, e as u64, len))?.copy_from_slice(&data);
            }
            lowered::execute(&level.engine, bufs, &[]).map_err(|error| lowered::StageError { stage, error })?;
        }
        Ok(())
    }

    /// Bytes that cross between nodes per run.
    pub fn wire_bytes(&self) -> u64 {
        self.levels.iter().flat_map(|l| &l.wire).map(|w| w.bytes).sum()
    }
}

/// One level of [`lower_by_node`] as it is gathered: transfers between nodes, engine tasks and
/// their owners, and each rank's bytes received into its temporary slot so far.
#[derive(Default)]
struct SplitLevel {
    wire: Vec<WireTransfer>,
    tasks: Vec<Task>,
    owners: Vec<usize>,
    received: Vec<u64>,
}

/// Lowers `program` level by level ([`lower_direct`]'s levels) for ranks on nodes of
/// `ranks_per_node` consecutive ranks: an op between two ranks of one node is an engine task, as
/// there; a transfer between nodes is a [`WireTransfer`], straight into its destination for a
/// store, into the receiver's [`slot::SCRATCH2`] for a reduction, which the level's engine launch
/// then reduces into the destination. Within a level the transfers run before the launch (the
/// level's ops touch no chunk another one writes, so only those reductions depend on them), and
/// every CTA of a launch meets only its own node's ranks.
pub fn lower_by_node(program: &Program, opts: &DirectOptions, ranks_per_node: u32) -> Result<ByNode, DirectError> {
    let per_node = ranks_per_node;
    let mut buffer_bytes = checked_buffers(program, opts)?;
    let l = &program.layout;
    if per_node == 0 || !l.ranks.is_multiple_of(per_node) {
        return Err(DirectError::Options {
            field: "ranks_per_node",
            why: format!("{per_node} does not divide the program's {} ranks", l.ranks),
        });
    }
    let n = l.ranks as usize;
    let node = |r: u32| r / per_node;
    let mut levels: Vec<SplitLevel> = Vec::new();
    for (op, level) in program.ops.iter().zip(op_levels(program)?) {
        if levels.len() <= level {
            levels.resize_with(level + 1, || SplitLevel { received: vec![0; n], ..SplitLevel::default() });
        }
        let SplitLevel { wire, tasks, owners, received } = &mut levels[level];
        let t = task_of(l, op, opts);
        let (src, dst) = (op.src_rank().0, op.dst_rank().0);
        if node(src) == node(dst) {
            tasks.push(t);
            owners.push(dst as usize);
            continue;
        }
        let mut w = WireTransfer {
            src_rank: src,
            src_slot: t.src_slot,
            src_offset: t.src_offset,
            dst_rank: dst,
            dst_slot: t.dst_slot,
            dst_offset: t.dst_offset,
            bytes: t.bytes,
        };
        if t.kind == TaskKind::ReduceInto.raw() {
            // Received into the temporary slot (its level's bytes so far), reduced there after.
            let temp = received[dst as usize];
            received[dst as usize] += t.bytes;
            w.dst_slot = slot::SCRATCH2;
            w.dst_offset = temp;
            let room = &mut buffer_bytes[dst as usize][slot::SCRATCH2 as usize];
            *room = (*room).max(temp + t.bytes);
            tasks.push(Task { src_ranks: 1 << dst, src_slot: slot::SCRATCH2, src_offset: temp, ..t });
            owners.push(dst as usize);
        }
        wire.push(w);
    }
    let mut out = Vec::with_capacity(levels.len());
    for (level, SplitLevel { wire, tasks, owners, .. }) in levels.into_iter().enumerate() {
        let mut engine = distribute(tasks, &owners, n, opts)?;
        for p in &mut engine.programs {
            // Each CTA meets its own node's ranks: the other nodes run their own launch.
            let first = node(p.rank) * per_node;
            let mask = ((1u64 << per_node) - 1) << first;
            p.barrier_ranks = if per_node > 1 { (mask & u64::from(u32::MAX)) as u32 } else { 0 };
        }
        if engine.tasks.len() as u64 > opts.max_tasks {
            return Err(DirectError::TooLarge {
                what: format!("level {level}: {} tasks (limit {})", engine.tasks.len(), opts.max_tasks),
            });
        }
        lowered::validate(&engine, &buffer_bytes, &[]).map_err(|error| DirectError::Invalid { level, error })?;
        lowered::check_races(&engine, &[]).map_err(|error| DirectError::Invalid { level, error })?;
        out.push(NodeLevel { wire, engine });
    }
    Ok(ByNode { levels: out, ranks_per_node: per_node, buffer_bytes })
}
