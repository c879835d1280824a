//! The transfer-program IR: what an algorithm *is*, before any scheduling.
//!
//! A [`Program`] is a sequence of [`Op`]s over per-rank buffers cut into chunks. The main op is a
//! [`OpKind::Transfer`]: `Transfer(src_rank, dst_rank, step, chunk, op)` in ResCCL's words, a send of
//! a chunk range on `src_rank` matched by a receive on `dst_rank` that either stores the data
//! ([`RecvOp::Recv`]) or reduces it into the destination ([`RecvOp::RecvReduceCopy`]). Imported
//! algorithms also need local [`OpKind::Copy`] and [`OpKind::Reduce`].
//!
//! The order of `ops` is a *sequential semantics*: running the ops one after another, each atomic,
//! computes the collective. Nothing else is implied by the order; the compiler derives every
//! dependency from the locations each op reads and writes ([`crate::compile`]).
//!
//! ## Buffers and chunks
//!
//! Every rank has an input, an output and a scratch buffer, each a whole number of chunks. The sizes
//! of input and output follow from the collective and [`BufferLayout::chunks`] (see [`BufferLayout`]); scratch is
//! per rank. In-place programs alias input and output the way NCCL does (an in-place AllGather's
//! input is the rank's own block of the output); [`BufferLayout::resolve`] maps any reference to one flat
//! chunk index of the rank's storage, so aliases are the same location for the dependency analysis,
//! the checker and the executors.
//!
//! ## Submodules
//!
//! | module | what |
//! |---|---|
//! | [`text`] | the stable text format (print and parse), used by the golden tests |
//! | [`msccl`] | the MSCCL XML importer |
//! | [`generators`] | built-in algorithms: ring, direct (all-pairs), hierarchical mesh |
//! | [`check`] | the structural verifier and the symbolic postcondition checker |
//!
//! Files are read with [`read_input`], which stops at a byte limit ([`MAX_INPUT_BYTES`] by default)
//! with a typed error instead of reading without end (`/dev/zero`).

pub mod check;
pub mod generators;
pub mod msccl;
pub mod text;

use serde::{Deserialize, Serialize};
use std::fmt;
use std::io::Read;
use std::path::Path;

/// Declares a `u32` entity newtype (Cranelift style): a dense index with a short display prefix.
macro_rules! entity {
    ($(#[$meta:meta])* $name:ident, $prefix:literal) => {
        $(#[$meta])*
        #[derive(Copy, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Debug, Default, Serialize, Deserialize)]
        #[serde(transparent)]
        pub struct $name(pub u32);

        impl $name {
            /// The entity with dense index `index`.
            #[inline]
            pub fn new(index: usize) -> Self {
                debug_assert!(index <= u32::MAX as usize);
                Self(index as u32)
            }
            /// The dense index of this entity.
            #[inline]
            pub fn index(self) -> usize {
                self.0 as usize
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                write!(f, concat!($prefix, "{}"), self.0)
            }
        }
    };
}
pub(crate) use entity;

entity!(
    /// A rank (one GPU, or one virtual rank). Printed `r3`.
    Rank,
    "r"
);
entity!(
    /// An op of a [`Program`], its index in [`Program::ops`]. Printed `op7`.
    OpId,
    "op"
);

/// Which of a rank's buffers a [`Slice`] refers to.
#[derive(Copy, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Debug, Serialize, Deserialize)]
pub enum BufferKind {
    /// The user's send buffer. Text `in`, MSCCL `i`.
    Input,
    /// The user's receive buffer. Text `out`, MSCCL `o`.
    Output,
    /// Library-owned scratch space. Text `scr`, MSCCL `s`.
    Scratch,
}

impl BufferKind {
    /// The name used by the text format.
    pub fn name(self) -> &'static str {
        match self {
            BufferKind::Input => "in",
            BufferKind::Output => "out",
            BufferKind::Scratch => "scr",
        }
    }
}

/// `count` consecutive chunks of one buffer, starting at chunk `offset`. Printed `in[3]` or `in[3..5]`
/// (half open).
#[derive(Copy, Clone, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
pub struct Slice {
    /// Which buffer of the rank (the rank comes from the op that holds the slice).
    pub buffer: BufferKind,
    /// The first chunk, counted in chunks from the start of `buffer`.
    pub offset: u32,
    /// The number of chunks; at least 1 in a verified program.
    pub count: u32,
}

impl Slice {
    /// `count` chunks of `buffer` from `offset`.
    pub fn new(buffer: BufferKind, offset: u32, count: u32) -> Self {
        Slice { buffer, offset, count }
    }
    /// One chunk of the input buffer.
    pub fn input(offset: u32) -> Self {
        Slice::new(BufferKind::Input, offset, 1)
    }
    /// One chunk of the output buffer.
    pub fn output(offset: u32) -> Self {
        Slice::new(BufferKind::Output, offset, 1)
    }
    /// One chunk of the scratch buffer.
    pub fn scratch(offset: u32) -> Self {
        Slice::new(BufferKind::Scratch, offset, 1)
    }
    /// One past the last chunk.
    pub fn end(self) -> u64 {
        self.offset as u64 + self.count as u64
    }
}

impl fmt::Display for Slice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.count == 1 {
            write!(f, "{}[{}]", self.buffer.name(), self.offset)
        } else {
            write!(f, "{}[{}..{}]", self.buffer.name(), self.offset, self.end())
        }
    }
}

/// The collective a program computes; it fixes the buffer sizes and the postcondition.
pub use crate::collective::Collective;

/// Buffer sizes and aliasing of a program, shared by the program, the compiled plan and the executors.
///
/// With `C = chunks` and `n = ranks`:
///
/// | collective | input chunks | output chunks | in place |
/// |---|---|---|---|
/// | AllReduce | C | C | input ≡ output |
/// | AllGather | C/n | C | input ≡ output block `r` |
/// | ReduceScatter | C | C/n | output ≡ input block `r` |
/// | AllToAll | C | C | input ≡ output |
/// | Broadcast, Reduce | C | C | input ≡ output |
///
/// Every rank has both buffers: a Broadcast reads only the root's input, and a Reduce promises only
/// the root's output (the others may serve as space for partial results).
///
/// A rank's *storage* is one flat array of chunks: out of place `[input | output | scratch]`, in place
/// `[main | scratch]` where `main` is the larger of input and output.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct BufferLayout {
    /// The collective; with `chunks` and `ranks` it fixes the input and output sizes.
    pub collective: Collective,
    /// The number of ranks, `1..=`[`BufferLayout::MAX_RANKS`] in a valid layout.
    pub ranks: u32,
    /// The size, in chunks, of the larger user buffer (MSCCL's `nchunksperloop`).
    pub chunks: u32,
    /// Whether input and output alias as the table above says; otherwise they are disjoint.
    pub in_place: bool,
    /// Scratch chunks per rank (`scratch.len() == ranks`).
    pub scratch: Vec<u32>,
}

impl BufferLayout {
    /// The most ranks a layout may have.
    pub const MAX_RANKS: u32 = 1 << 20;
    /// The most chunks (summed over ranks and buffers) a layout may have: the 2 × 8192² of the
    /// generators' largest programs (`Algorithm::MAX_RANKS` ranks, as many chunks, in and out). The
    /// checks keep about 20 bytes per chunk location, about 2.7 GB at the limit.
    pub const MAX_CHUNKS: u64 = 1 << 27;
    /// The most chunks a layout read from a file (MSCCL XML, the text form) may have: a few bytes
    /// of text must not ask for gigabytes ([`BufferLayout::validate_imported`]).
    pub const MAX_IMPORTED_CHUNKS: u64 = 1 << 24;

    /// A layout with no scratch.
    pub fn new(collective: Collective, ranks: u32, chunks: u32, in_place: bool) -> BufferLayout {
        BufferLayout { collective, ranks, chunks, in_place, scratch: vec![0; ranks as usize] }
    }

    /// Chunks of each rank's input buffer.
    pub fn input_chunks(&self) -> u32 {
        match self.collective {
            Collective::AllGather => self.chunks / self.ranks.max(1),
            _ => self.chunks,
        }
    }

    /// Chunks of each rank's output buffer.
    pub fn output_chunks(&self) -> u32 {
        match self.collective {
            Collective::ReduceScatter => self.chunks / self.ranks.max(1),
            _ => self.chunks,
        }
    }

    /// A bound on one rank's storage in chunks: input and output, and the most scratch any rank has.
    fn per_rank_bound(&self) -> u64 {
        self.chunks as u64 * 2 + self.scratch.iter().map(|&s| s as u64).max().unwrap_or(0)
    }

    /// [`BufferLayout::validate`], and at most [`BufferLayout::MAX_IMPORTED_CHUNKS`] chunk locations: the check
    /// the importers run on a layout a file describes.
    pub fn validate_imported(&self) -> Result<(), ProgramError> {
        self.validate()?;
        let total = self.per_rank_bound() * self.ranks as u64;
        if total > Self::MAX_IMPORTED_CHUNKS {
            return Err(ProgramError::BadLayout {
                reason: format!(
                    "buffers of {} chunks per rank on {} ranks are more than the {} chunks a file may describe",
                    self.per_rank_bound(),
                    self.ranks,
                    Self::MAX_IMPORTED_CHUNKS
                ),
            });
        }
        Ok(())
    }

    /// Checks the sizes are consistent (chunks divisible by ranks where the collective needs it).
    pub fn validate(&self) -> Result<(), ProgramError> {
        if self.ranks == 0 {
            return Err(ProgramError::BadLayout { reason: "a program needs at least one rank".into() });
        }
        if self.chunks == 0 {
            return Err(ProgramError::BadLayout { reason: "a program needs at least one chunk".into() });
        }
        if self.ranks > Self::MAX_RANKS {
            return Err(ProgramError::BadLayout {
                reason: format!("{} ranks is more than the supported {}", self.ranks, Self::MAX_RANKS),
            });
        }
        let per_rank = self.per_rank_bound();
        // A rank's storage is counted in u32 chunks (`storage_chunks`).
        if per_rank * self.ranks as u64 > Self::MAX_CHUNKS || per_rank > u32::MAX as u64 {
            return Err(ProgramError::BadLayout {
                reason: format!("buffers of {} chunks per rank on {} ranks are too large", per_rank, self.ranks),
            });
        }
        if self.scratch.len() != self.ranks as usize {
            return Err(ProgramError::BadLayout {
                reason: format!("scratch sizes given for {} ranks, program has {}", self.scratch.len(), self.ranks),
            });
        }
        if let Some(root) = self.collective.root().filter(|&r| r >= self.ranks as usize) {
            return Err(ProgramError::BadLayout {
                reason: format!(
                    "{} from root {root}: the program has {} ranks",
                    self.collective.program_name(),
                    self.ranks
                ),
            });
        }
        let needs_divisible =
            matches!(self.collective, Collective::AllGather | Collective::ReduceScatter | Collective::AllToAll);
        if needs_divisible && !self.chunks.is_multiple_of(self.ranks) {
            return Err(ProgramError::BadLayout {
                reason: format!(
                    "{} needs chunks divisible by ranks, got {} chunks for {} ranks",
                    self.collective.program_name(),
                    self.chunks,
                    self.ranks
                ),
            });
        }
        Ok(())
    }

    fn main_chunks(&self) -> u32 {
        self.input_chunks().max(self.output_chunks())
    }

    /// Total chunks of `rank`'s storage (see the type's documentation).
    pub fn storage_chunks(&self, rank: Rank) -> u32 {
        let user = if self.in_place { self.main_chunks() } else { self.input_chunks() + self.output_chunks() };
        user + self.scratch[rank.index()]
    }

    /// The size of `buffer` on `rank`, in chunks.
    pub fn buffer_chunks(&self, rank: Rank, buffer: BufferKind) -> u32 {
        match buffer {
            BufferKind::Input => self.input_chunks(),
            BufferKind::Output => self.output_chunks(),
            BufferKind::Scratch => self.scratch[rank.index()],
        }
    }

    /// Where chunk 0 of `buffer` lives in `rank`'s flat storage.
    pub fn buffer_base(&self, rank: Rank, buffer: BufferKind) -> u32 {
        let (i, o) = (self.input_chunks(), self.output_chunks());
        if !self.in_place {
            return match buffer {
                BufferKind::Input => 0,
                BufferKind::Output => i,
                BufferKind::Scratch => i + o,
            };
        }
        match (self.collective, buffer) {
            (_, BufferKind::Scratch) => self.main_chunks(),
            (Collective::AllGather, BufferKind::Input) => rank.0 * i,
            (Collective::ReduceScatter, BufferKind::Output) => rank.0 * o,
            _ => 0,
        }
    }

    /// Resolves `slice` on `rank` to the first flat storage index it covers, or `None` when it does
    /// not fit its buffer.
    pub fn resolve(&self, rank: Rank, slice: Slice) -> Option<u32> {
        if rank.0 >= self.ranks || slice.end() > self.buffer_chunks(rank, slice.buffer) as u64 {
            return None;
        }
        Some(self.buffer_base(rank, slice.buffer) + slice.offset)
    }
}

/// What the receiver of a transfer does with the data.
#[derive(Copy, Clone, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
pub enum RecvOp {
    /// Store the data at the destination (`recv`).
    Recv,
    /// Reduce the data into the destination: `dst = dst ⊕ data` (`recv_reduce_copy`, text `rrc`).
    RecvReduceCopy,
}

/// What an [`Op`] does.
#[derive(Copy, Clone, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
pub enum OpKind {
    /// Send `src` of `src_rank` over channel `channel` to `dst_rank`, which stores or reduces it into
    /// `dst`. The two slices have the same count.
    Transfer {
        /// The sending rank, which reads `src`.
        src_rank: Rank,
        /// The receiving rank, which writes `dst`; never `src_rank` in a verified program.
        dst_rank: Rank,
        /// Tells apart connections between the same two ranks: transfers of one
        /// `(src_rank, dst_rank, channel)` share a link.
        channel: u32,
        /// The slice read on `src_rank`.
        src: Slice,
        /// The slice written on `dst_rank`, of the same count as `src`.
        dst: Slice,
        /// Whether `dst_rank` stores the data or reduces it into `dst`.
        op: RecvOp,
    },
    /// Copy `src` to `dst` on one rank (non-overlapping slices of the same count). `channel` is the
    /// local lane: local ops of one lane conflict like transfers on one link.
    Copy {
        /// The rank that copies.
        rank: Rank,
        /// The local lane.
        channel: u32,
        /// The slice read.
        src: Slice,
        /// The slice overwritten, of the same count as `src` and not overlapping it.
        dst: Slice,
    },
    /// `dst = dst ⊕ src` on one rank, on local lane `channel`.
    Reduce {
        /// The rank that reduces.
        rank: Rank,
        /// The local lane.
        channel: u32,
        /// The operand read.
        src: Slice,
        /// The accumulator, read and written; same count as `src`, not overlapping it.
        dst: Slice,
    },
}

/// One op of a [`Program`].
#[derive(Copy, Clone, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
pub struct Op {
    /// What the op does and on which ranks and slices.
    pub kind: OpKind,
    /// The logical chunk (data item) the op moves: the unit the schedulers balance. Generators give
    /// the chunk's index in the collective; the importer gives the index of the user-buffer location
    /// the data came from.
    pub chunk: u32,
    /// The algorithm's step (a logical time; ops of one step are independent in the algorithm).
    pub step: u32,
    /// The algorithm's stage (a coarser phase, e.g. "inter-node exchange" and "intra-node forward").
    /// The stage-level scheduler and the per-connection TB allocator use it.
    pub stage: u32,
}

impl Op {
    /// The rank that reads the op's source.
    pub fn src_rank(&self) -> Rank {
        match self.kind {
            OpKind::Transfer { src_rank, .. } => src_rank,
            OpKind::Copy { rank, .. } | OpKind::Reduce { rank, .. } => rank,
        }
    }
    /// The rank whose destination the op writes.
    pub fn dst_rank(&self) -> Rank {
        match self.kind {
            OpKind::Transfer { dst_rank, .. } => dst_rank,
            OpKind::Copy { rank, .. } | OpKind::Reduce { rank, .. } => rank,
        }
    }
    /// The source slice (on [`Op::src_rank`]).
    pub fn src(&self) -> Slice {
        match self.kind {
            OpKind::Transfer { src, .. } | OpKind::Copy { src, .. } | OpKind::Reduce { src, .. } => src,
        }
    }
    /// The destination slice (on [`Op::dst_rank`]).
    pub fn dst(&self) -> Slice {
        match self.kind {
            OpKind::Transfer { dst, .. } | OpKind::Copy { dst, .. } | OpKind::Reduce { dst, .. } => dst,
        }
    }
    /// Whether the destination is combined with the data (a reduce) rather than overwritten.
    pub fn reduces(&self) -> bool {
        matches!(self.kind, OpKind::Reduce { .. } | OpKind::Transfer { op: RecvOp::RecvReduceCopy, .. })
    }
    /// The channel of a transfer, or the lane of a local op.
    pub fn channel(&self) -> u32 {
        match self.kind {
            OpKind::Transfer { channel, .. } | OpKind::Copy { channel, .. } | OpKind::Reduce { channel, .. } => channel,
        }
    }
    /// Whether the op is a transfer between two ranks.
    pub fn is_transfer(&self) -> bool {
        matches!(self.kind, OpKind::Transfer { .. })
    }
}

/// A transfer program: an algorithm for one collective on a fixed number of ranks.
#[derive(Clone, PartialEq, Debug, Serialize, Deserialize)]
pub struct Program {
    /// A name for reports and the text format: one token, as [`Program::check_name`] requires
    /// ([`Program::verify`] checks it).
    pub name: String,
    /// Buffer sizes and aliasing, which every slice of `ops` must fit.
    pub layout: BufferLayout,
    /// How many consecutive ranks share a node, when the program was made for a known shape
    /// (generators set it; MSCCL files do not say, so `None`: one node).
    pub ranks_per_node: Option<u32>,
    /// The ops in sequential-semantics order (see the module documentation); an [`OpId`] is an index
    /// into it.
    pub ops: Vec<Op>,
}

impl Program {
    /// An empty program.
    pub fn new(name: impl Into<String>, layout: BufferLayout) -> Program {
        Program { name: name.into(), layout, ranks_per_node: None, ops: Vec::new() }
    }

    /// Number of ranks.
    pub fn ranks(&self) -> u32 {
        self.layout.ranks
    }

    /// Appends an op and returns its id.
    pub fn push(&mut self, op: Op) -> OpId {
        self.ops.push(op);
        OpId::new(self.ops.len() - 1)
    }

    /// Appends a transfer of one slice.
    #[allow(clippy::too_many_arguments)]
    pub fn transfer(
        &mut self,
        src_rank: u32,
        src: Slice,
        dst_rank: u32,
        dst: Slice,
        op: RecvOp,
        chunk: u32,
        step: u32,
        stage: u32,
    ) -> OpId {
        self.push(Op {
            kind: OpKind::Transfer { src_rank: Rank(src_rank), dst_rank: Rank(dst_rank), channel: 0, src, dst, op },
            chunk,
            step,
            stage,
        })
    }

    /// The op with id `id`.
    pub fn op(&self, id: OpId) -> &Op {
        &self.ops[id.index()]
    }

    /// The node of `rank` under [`Program::ranks_per_node`] (or `per_node` when given).
    pub fn node_of(rank: Rank, per_node: Option<u32>) -> u32 {
        match per_node {
            Some(g) if g > 0 => rank.0 / g,
            _ => 0,
        }
    }

    /// Checks `name` is a program name: not empty, without whitespace, `#` or control characters, so
    /// that it is one token of the text format's `program NAME` line (`#` starts a comment there).
    /// Every producer of programs holds names to this one rule: [`text::parse`] and the MSCCL
    /// importer refuse other names, [`Program::verify`] checks it, and [`text::print`] never writes
    /// another name where `parse` would read it.
    pub fn check_name(name: &str) -> Result<(), ProgramError> {
        let reason = if name.is_empty() {
            "it is empty"
        } else if name.chars().any(char::is_whitespace) {
            "it holds whitespace"
        } else if name.contains('#') {
            "it holds `#`, which starts a comment in the text format"
        } else if name.chars().any(char::is_control) {
            "it holds a control character"
        } else {
            return Ok(());
        };
        Err(ProgramError::BadName { name: name.to_string(), reason })
    }

    /// Structural checks (name, ranks, slices, counts); see [`check::verify`].
    pub fn verify(&self) -> Result<(), ProgramError> {
        check::verify(self)
    }

    /// Chunks the ops read and write per run, `(read, written)`: a store reads its source and
    /// writes its destination, a reduction reads both and writes the destination; a copy onto
    /// itself (the same storage of one rank, as in-place layouts alias) moves nothing. Times the
    /// chunk size, the bytes any executor must move through memory: a plan's own roofline.
    pub fn traffic_chunks(&self) -> (u64, u64) {
        let (mut read, mut written) = (0u64, 0u64);
        for op in &self.ops {
            let (src, dst) = (op.src(), op.dst());
            let count = u64::from(dst.count);
            let same = op.src_rank() == op.dst_rank()
                && self.layout.resolve(op.src_rank(), src) == self.layout.resolve(op.dst_rank(), dst);
            if same && !op.reduces() {
                continue;
            }
            read += if op.reduces() { 2 * count } else { count };
            written += count;
        }
        (read, written)
    }

    /// Structural checks and the collective's postcondition; see [`check::check_postcondition`].
    pub fn check(&self) -> Result<(), ProgramError> {
        check::check_postcondition(self)
    }

    /// Replicates the program `k` times over `k`-times finer chunks: chunk `c` becomes chunks
    /// `c*k .. c*k+k`, and every op is repeated once per instance (ops on several chunks are split
    /// into one op per chunk, since an instance's chunks are no longer adjacent). Scratch grows `k`
    /// times. The result computes the same collective; it gives the schedulers more independent work.
    /// Every instance stays on the program's channels: [`Program::instanced_on`] with
    /// [`InstanceChannels::Shared`].
    pub fn instanced(&self, k: u32) -> Result<Program, ProgramError> {
        self.instanced_on(k, InstanceChannels::Shared)
    }

    /// [`Program::instanced`], with each instance's channels as `channels` says. The program is
    /// verified first ([`Program::verify`]'s errors); [`ProgramError::BadLayout`] when `k` is 0, the `k`-times
    /// larger buffers are too large or `k` instances' channels do not fit a `u32`,
    /// [`ProgramError::ChunkLabelOverflow`] when an op's chunk label times `k` does not fit a `u32`.
    pub fn instanced_on(&self, k: u32, channels: InstanceChannels) -> Result<Program, ProgramError> {
        if k == 0 {
            return Err(ProgramError::BadLayout { reason: "0 instances: a program needs at least one".into() });
        }
        // After this, every slice fits its buffer and has equal counts on both sides, so the mapped
        // offsets below stay under the validated `k`-times larger buffer sizes.
        self.verify()?;
        if k == 1 {
            return Ok(self.clone());
        }
        let too_large = || ProgramError::BadLayout {
            reason: format!("{k} instances of {} chunks per buffer are too large", self.layout.chunks),
        };
        let mut layout = self.layout.clone();
        layout.chunks = layout.chunks.checked_mul(k).ok_or_else(too_large)?;
        for s in &mut layout.scratch {
            *s = s.checked_mul(k).ok_or_else(too_large)?;
        }
        layout.validate()?;
        let ops = self.ops.iter().map(|op| op.src().count as u64).sum::<u64>() * k as u64;
        if ops > Self::MAX_INSTANCED_OPS {
            return Err(ProgramError::BadLayout {
                reason: format!("{k} instances make {ops} ops, more than {}", Self::MAX_INSTANCED_OPS),
            });
        }
        // Instance i's channel c is c + i × width; `width` is 0 where the instances share channels.
        let width = match channels {
            InstanceChannels::Shared => 0,
            InstanceChannels::Separate => self.ops.iter().map(|op| op.channel() as u64 + 1).max().unwrap_or(1),
        };
        if width * k as u64 > u32::MAX as u64 + 1 {
            return Err(ProgramError::BadLayout {
                reason: format!("{k} instances of {width} channels each make more than 2^32 channels"),
            });
        }
        let moved = |channel: u32, i: u32| (channel as u64 + i as u64 * width) as u32;
        let mut out = Program {
            name: match channels {
                InstanceChannels::Shared => format!("{}_x{}", self.name, k),
                InstanceChannels::Separate => format!("{}_x{}_channels", self.name, k),
            },
            layout,
            ranks_per_node: self.ranks_per_node,
            ops: Vec::with_capacity(self.ops.len() * k as usize),
        };
        let map = |s: Slice, x: u32, i: u32| Slice::new(s.buffer, (s.offset + x) * k + i, 1);
        for (id, op) in self.ops.iter().enumerate() {
            let count = op.src().count;
            // The largest label this op gets is `(chunk + count) * k - 1`.
            if (op.chunk as u64 + count as u64) * k as u64 - 1 > u32::MAX as u64 {
                return Err(ProgramError::ChunkLabelOverflow { op: OpId::new(id), chunk: op.chunk, instances: k });
            }
            for x in 0..count {
                for i in 0..k {
                    let kind = match op.kind {
                        OpKind::Transfer { src_rank, dst_rank, channel, src, dst, op } => OpKind::Transfer {
                            src_rank,
                            dst_rank,
                            channel: moved(channel, i),
                            src: map(src, x, i),
                            dst: map(dst, x, i),
                            op,
                        },
                        OpKind::Copy { rank, channel, src, dst } => {
                            OpKind::Copy { rank, channel: moved(channel, i), src: map(src, x, i), dst: map(dst, x, i) }
                        }
                        OpKind::Reduce { rank, channel, src, dst } => OpKind::Reduce {
                            rank,
                            channel: moved(channel, i),
                            src: map(src, x, i),
                            dst: map(dst, x, i),
                        },
                    };
                    out.ops.push(Op { kind, chunk: (op.chunk + x) * k + i, step: op.step, stage: op.stage });
                }
            }
        }
        Ok(out)
    }

    /// Most ops [`Program::instanced`] builds.
    pub const MAX_INSTANCED_OPS: u64 = 1 << 24;

    /// Most chunk accesses (each op's read and written chunks, summed over its slices) a program may
    /// make: the dependency pass and the importers keep a record per access not yet overwritten,
    /// indexed by `u32`. The largest generated program, the 8192-rank HM AllReduce, makes about
    /// 4 × 10^8.
    pub const MAX_CHUNK_ACCESSES: u64 = 1 << 30;
}

/// Which channels [`Program::instanced_on`] gives each instance.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum InstanceChannels {
    /// Every instance on the program's own channels: the same links (and FIFOs and thread blocks),
    /// `k` times as many chunks on each.
    #[default]
    Shared,
    /// Instance `i` on channels of its own (channel `c` becomes `c + i × C`, `C` one more than the
    /// program's highest channel), as MSCCL's instances: `k` times the links, each with its own FIFO, so the
    /// compiler gives the instances thread blocks of their own and they run side by side.
    Separate,
}

impl std::str::FromStr for InstanceChannels {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "shared" => Ok(InstanceChannels::Shared),
            "separate" => Ok(InstanceChannels::Separate),
            other => Err(format!("unknown instance channels {other:?} (shared, separate)")),
        }
    }
}

/// What is wrong with a program. Every variant names the op (or the line) at fault.
#[derive(Clone, PartialEq, Debug, thiserror::Error)]
pub enum ProgramError {
    /// The buffer sizes are inconsistent.
    #[error("bad buffer layout: {reason}")]
    BadLayout {
        /// What is inconsistent, in words.
        reason: String,
    },
    /// An op names a rank the program does not have.
    #[error("{op}: rank {rank} out of range (program has {ranks} ranks)")]
    RankOutOfRange {
        /// The op at fault.
        op: OpId,
        /// The rank it names (the source or destination rank).
        rank: u32,
        /// How many ranks the program has.
        ranks: u32,
    },
    /// An op's slice does not fit its buffer.
    #[error("{op}: {slice} on {rank} out of range (buffer has {buffer_chunks} chunks)")]
    SliceOutOfRange {
        /// The op at fault.
        op: OpId,
        /// The rank the slice is on.
        rank: Rank,
        /// The slice that does not fit.
        slice: Slice,
        /// The size of the slice's buffer on `rank`, in chunks.
        buffer_chunks: u32,
    },
    /// Source and destination slices of an op have different counts (or a count of zero).
    #[error("{op}: source {src} and destination {dst} differ in size (or are empty)")]
    CountMismatch {
        /// The op at fault.
        op: OpId,
        /// Its source slice.
        src: Slice,
        /// Its destination slice.
        dst: Slice,
    },
    /// A transfer from a rank to itself (use a copy).
    #[error("{op}: transfer from {rank} to itself")]
    SelfTransfer {
        /// The op at fault.
        op: OpId,
        /// The rank that is both source and destination.
        rank: Rank,
    },
    /// A local copy or reduce whose source and destination overlap.
    #[error("{op}: source and destination overlap on {rank}")]
    OverlappingLocal {
        /// The op at fault.
        op: OpId,
        /// The rank the op runs on.
        rank: Rank,
    },
    /// A location of a user buffer does not hold what the collective requires at the end.
    #[error("postcondition fails at {slice} on {rank}: {detail} ({})", match last_writer {
        Some(op) => format!("last written by {op}"),
        None => "never written".to_string(),
    })]
    Postcondition {
        /// The rank whose output is wrong.
        rank: Rank,
        /// The first wrong location: one chunk of the output buffer.
        slice: Slice,
        /// The op that wrote the location last, if any.
        last_writer: Option<OpId>,
        /// What the location holds instead, in words.
        detail: String,
    },
    /// The program's name is not one token of the text format ([`Program::check_name`]).
    #[error("bad program name {name:?}: {reason}")]
    BadName {
        /// The name as given.
        name: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The text format could not be parsed.
    #[error("line {line}: {message}")]
    Parse {
        /// The line at fault, counted from 1.
        line: usize,
        /// What is wrong with it.
        message: String,
    },
    /// The program's file could not be read ([`text::parse_path`]).
    #[error("{0}")]
    Input(#[from] InputError),
    /// [`Program::instanced`] would give an op chunk labels beyond `u32::MAX`.
    #[error("{op}: chunk label {chunk} in {instances} instances does not fit 32 bits")]
    ChunkLabelOverflow {
        /// The op of the original program.
        op: OpId,
        /// Its chunk label ([`Op::chunk`]).
        chunk: u32,
        /// The number of instances asked for.
        instances: u32,
    },
}

/// The most bytes [`read_input`] reads from a file by default: MSCCL files and programs are a few
/// megabytes at most (the largest bundled MSCCL file is under 1 MB).
pub const MAX_INPUT_BYTES: u64 = 64 << 20;

/// Why an input file could not be read.
#[derive(Clone, PartialEq, Eq, Debug, thiserror::Error)]
pub enum InputError {
    /// Opening or reading failed.
    #[error("{path}: {message}")]
    Io {
        /// The path as given.
        path: String,
        /// The operating system's message.
        message: String,
    },
    /// The file holds more than the limit (or never ends, like `/dev/zero`).
    #[error("{path}: more than {limit} bytes, the most an input file may hold")]
    TooLarge {
        /// The path as given.
        path: String,
        /// The limit, in bytes.
        limit: u64,
    },
    /// The file is not UTF-8 text.
    #[error("{path}: not UTF-8 text (byte {at})")]
    NotUtf8 {
        /// The path as given.
        path: String,
        /// The byte offset of the first invalid sequence.
        at: usize,
    },
}

/// Reads the text file at `path`, at most `limit` bytes: one byte more is
/// [`InputError::TooLarge`], so an endless source (`/dev/zero`, a pipe that never closes its end
/// after writing) costs at most `limit + 1` bytes of memory before the error.
pub fn read_input(path: &Path, limit: u64) -> Result<String, InputError> {
    let name = path.display().to_string();
    let io = |e: std::io::Error| InputError::Io { path: name.clone(), message: e.to_string() };
    let file = std::fs::File::open(path).map_err(io)?;
    // The size the file claims only sizes the first allocation; the read itself is what is bounded.
    let hint = file.metadata().map(|m| m.len()).unwrap_or(0).min(limit);
    let mut bytes = Vec::with_capacity(usize::try_from(hint).unwrap_or(0));
    file.take(limit.saturating_add(1)).read_to_end(&mut bytes).map_err(io)?;
    if bytes.len() as u64 > limit {
        return Err(InputError::TooLarge { path: name, limit });
    }
    String::from_utf8(bytes).map_err(|e| InputError::NotUtf8 { path: name, at: e.utf8_error().valid_up_to() })
}
