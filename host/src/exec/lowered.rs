//! The CPU executor of lowered plans: runs the device descriptors of [`crate::compile::lower`] on
//! host memory, the way the engine will.
//!
//! Memory is bytes, as on the device ([`Memory`]): each rank's buffer slots, and each rank's FIFO
//! region (the workspace from [`FIFO_REGION_OFFSET`] on) holding the progress counters, the head and
//! tail counters and the rings of slots, at the offsets the descriptors name. A send writes its
//! message into slot `tail % slots` of the **receiver's** region and then advances the tail counter
//! there; a receive reads slot `head % slots` of its own region and advances the head. A send blocks
//! while `tail - head == slots` (the ring is full), a receive while `tail == head`; a task with waits
//! blocks until each named TB's progress counter reaches the threshold ([`PlanWait`]). Counters
//! start where the previous launch left them (epochs in memory, as the device does them), so running
//! the same [`Memory`] again is a graph replay.
//!
//! Every thread block has its own program counter (segment, micro-batch, task). TBs are stepped
//! round-robin, rank by rank, [`LaunchOptions::quantum`] steps per turn, deterministically. A whole
//! round in which no TB moves while work is left is a deadlock ([`LoweredExecError::Deadlock`],
//! naming each blocked TB and why), where a GPU would hang until its timeout.
//!
//! Beyond the device, the executor checks what the hardware cannot: a receive takes a message sent
//! for the same program op and of its size ([`LoweredExecError::FifoOrder`]), no message is left
//! over at the end ([`LoweredExecError::Unconsumed`]).
//!
//! It also keeps per-TB busy/idle accounts in executor turns ([`TbAccount`]), the counterpart of
//! the device's `%globaltimer` records ([`oxccl_kernels::abi::TbTiming`]).

pub use super::Blocked;
use super::{Element, ReduceOp, VerifyReport, reference, test_inputs};
use crate::compile::TbId;
use crate::compile::lower::{DescriptorError, LoweredPlan, place, validate};
use crate::lowered::combine_into;
use crate::program::{OpId, Rank, Slice};
use bytemuck::Pod;
use oxccl_kernels::abi::{
    BUFFER_SLOTS, DType, FIFO_REGION_OFFSET, FIFO_TASK_SIGNAL, FifoKind, FifoTask, PlanWait, RedOp,
};

/// Every rank's device memory, as bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Memory {
    /// `buffers[rank][slot]`: `buffer_chunks[slot] × chunk_bytes` bytes (empty when unused).
    pub buffers: Vec<[Vec<u8>; BUFFER_SLOTS]>,
    /// `workspaces[rank]`: the FIFO region, `fifo_bytes` bytes; byte `i` is workspace byte
    /// `FIFO_REGION_OFFSET + i`.
    pub workspaces: Vec<Vec<u8>>,
}

/// Most bytes of host memory (buffers and FIFO regions, over all ranks) [`Memory::try_new`], and so
/// [`verify`], allocates: the byte counterpart of [`super::MAX_VERIFY_ELEMENTS`] `f32` elements.
pub const MAX_MEMORY_BYTES: u64 = 1 << 30;

impl Memory {
    /// Zeroed memory of the sizes `lp` needs (a fresh communicator: every counter 0), however large.
    ///
    /// # Panics
    ///
    /// When a size does not fit `usize`; allocation aborts when the host runs out of memory.
    /// [`Memory::try_new`] returns an error instead.
    pub fn new(lp: &LoweredPlan) -> Memory {
        let buffers = lp
            .ranks
            .iter()
            .map(|r| {
                std::array::from_fn(|s| {
                    vec![0u8; (r.header.buffer_chunks[s] as usize).saturating_mul(r.header.chunk_bytes as usize)]
                })
            })
            .collect();
        let workspaces = lp.ranks.iter().map(|r| vec![0u8; r.header.fifo_bytes as usize]).collect();
        Memory { buffers, workspaces }
    }

    /// Bytes [`Memory::new`] allocates for `lp` (saturating at `u64::MAX`).
    pub fn bytes(lp: &LoweredPlan) -> u64 {
        lp.ranks.iter().fold(0u64, |total, r| {
            let h = &r.header;
            let buffers =
                h.buffer_chunks.iter().fold(0u64, |b, &k| b.saturating_add((k as u64).saturating_mul(h.chunk_bytes)));
            total.saturating_add(buffers).saturating_add(h.fifo_bytes)
        })
    }

    /// [`Memory::new`], or [`LoweredExecError::TooLarge`] when it would allocate more than
    /// [`MAX_MEMORY_BYTES`].
    pub fn try_new(lp: &LoweredPlan) -> Result<Memory, LoweredExecError> {
        let bytes = Memory::bytes(lp);
        if bytes > MAX_MEMORY_BYTES {
            return Err(LoweredExecError::TooLarge { bytes, max: MAX_MEMORY_BYTES });
        }
        Ok(Memory::new(lp))
    }

    /// Writes each rank's input (`input_chunks × chunk_bytes` bytes of `T`) where the plan reads it.
    /// Refuses descriptors that fail [`validate`] and memory of other sizes than `lp`'s.
    pub fn load_inputs<T: Pod>(&mut self, lp: &LoweredPlan, inputs: &[Vec<T>]) -> Result<(), LoweredExecError> {
        validate(lp)?;
        check_memory(lp, self)?;
        let l = &lp.layout;
        let cb = chunk_bytes(lp);
        let ic = l.input_chunks() as usize;
        if inputs.len() != lp.ranks.len() {
            return Err(bad_input(format!("{} inputs for {} ranks", inputs.len(), lp.ranks.len())));
        }
        for (r, input) in inputs.iter().enumerate() {
            let bytes: &[u8] = bytemuck::cast_slice(input);
            if bytes.len() != ic * cb {
                return Err(bad_input(format!("rank {r}: {} input bytes, the plan needs {}", bytes.len(), ic * cb)));
            }
            for j in 0..ic {
                // `validate` proved every input chunk lies in a buffer the header sizes.
                let (s, c) = place(l, l.resolve(Rank(r as u32), Slice::input(j as u32)).expect("input resolves"));
                let at = c as usize * cb;
                self.buffers[r][s as usize][at..at + cb].copy_from_slice(&bytes[j * cb..(j + 1) * cb]);
            }
        }
        Ok(())
    }

    /// Each rank's output buffer, read where the plan leaves it. Refuses descriptors that fail
    /// [`validate`], memory of other sizes than `lp`'s, and a `T` whose size does not divide a chunk
    /// (the tail would be dropped).
    pub fn outputs<T: Pod>(&self, lp: &LoweredPlan) -> Result<Vec<Vec<T>>, LoweredExecError> {
        validate(lp)?;
        check_memory(lp, self)?;
        let l = &lp.layout;
        let cb = chunk_bytes(lp);
        let size = std::mem::size_of::<T>();
        if size == 0 || !cb.is_multiple_of(size) {
            return Err(bad_input(format!("{size}-byte elements do not divide a chunk of {cb} bytes")));
        }
        Ok((0..lp.ranks.len())
            .map(|r| {
                let mut out = Vec::with_capacity(l.output_chunks() as usize * cb);
                for j in 0..l.output_chunks() {
                    // `validate` proved every output chunk lies in a buffer the header sizes.
                    let (s, c) = place(l, l.resolve(Rank(r as u32), Slice::output(j)).expect("output resolves"));
                    let at = c as usize * cb;
                    out.extend_from_slice(&self.buffers[r][s as usize][at..at + cb]);
                }
                out.chunks_exact(size).map(bytemuck::pod_read_unaligned).collect()
            })
            .collect())
    }
}

fn chunk_bytes(lp: &LoweredPlan) -> usize {
    lp.ranks.first().map(|r| r.header.chunk_bytes as usize).unwrap_or(0)
}

fn bad_input(reason: String) -> LoweredExecError {
    LoweredExecError::BadInput { reason }
}

/// Checks that `mem` has the sizes the (validated) `lp` needs.
fn check_memory(lp: &LoweredPlan, mem: &Memory) -> Result<(), LoweredExecError> {
    let n = lp.ranks.len();
    if mem.buffers.len() != n || mem.workspaces.len() != n {
        return Err(bad_input(format!("memory for {} ranks, the plan has {n}", mem.buffers.len())));
    }
    for (r, lr) in lp.ranks.iter().enumerate() {
        let h = &lr.header;
        for s in 0..BUFFER_SLOTS {
            // `validate` proved the product fits.
            if mem.buffers[r][s].len() as u64 != h.buffer_chunks[s] as u64 * h.chunk_bytes {
                return Err(bad_input(format!("rank {r} slot {s}: {} bytes", mem.buffers[r][s].len())));
            }
        }
        if mem.workspaces[r].len() as u64 != h.fifo_bytes {
            return Err(bad_input(format!("rank {r}: FIFO region of {} bytes", mem.workspaces[r].len())));
        }
    }
    Ok(())
}

/// Executor options.
#[derive(Copy, Clone, Debug)]
pub struct LaunchOptions {
    /// Steps (task × micro-batch) a TB runs per turn before the next TB's turn (at least 1; 1
    /// interleaves TBs most finely).
    pub quantum: u32,
}

impl Default for LaunchOptions {
    fn default() -> Self {
        LaunchOptions { quantum: 1 }
    }
}

/// Why a launch of a lowered plan failed.
#[derive(Clone, PartialEq, Eq, Debug, thiserror::Error)]
pub enum LoweredExecError {
    /// The descriptors are malformed ([`validate`]).
    #[error("malformed descriptors: {0}")]
    Descriptor(#[from] DescriptorError),
    /// Memory or inputs do not fit the plan.
    #[error("bad input: {reason}")]
    BadInput {
        /// What does not fit.
        reason: String,
    },
    /// A counter in a workspace is not where a launch leaves it (an earlier launch failed midway;
    /// the workspace must be zeroed).
    #[error("{rank}: stale workspace: {what}")]
    StaleWorkspace {
        /// The rank whose workspace holds the counter.
        rank: Rank,
        /// Which counter, and what is wrong with its value.
        what: String,
    },
    /// No thread block can make progress and work is left.
    #[error("{}", super::Deadlock(blocked))]
    Deadlock {
        /// Every unfinished TB, where it stopped and why, in (rank, TB) order.
        blocked: Vec<Blocked>,
    },
    /// A receive found a message of another op, or of another size: the two ends disagree on the
    /// FIFO order.
    #[error(
        "c{conn}: the receive of {receiver_op} ({receiver_chunks} chunks) found the message of {message_op} ({message_chunks} chunks)"
    )]
    FifoOrder {
        /// The plan's connection index ([`FifoConn::id`](oxccl_kernels::abi::FifoConn::id)).
        conn: u32,
        /// The program op of the receiving task.
        receiver_op: OpId,
        /// The program op the message in the slot was sent for; `OpId(u32::MAX)` (with
        /// `message_chunks` 0) when no send of this launch filled the slot.
        message_op: OpId,
        /// Chunks the receive takes per micro-batch.
        receiver_chunks: u32,
        /// Chunks the message carries.
        message_chunks: u32,
    },
    /// Messages are left in a FIFO after every TB finished.
    #[error("c{conn}: {messages} messages never received")]
    Unconsumed {
        /// The plan's connection index ([`FifoConn::id`](oxccl_kernels::abi::FifoConn::id)).
        conn: u32,
        /// Messages left: its tail counter minus its head counter.
        messages: u64,
    },
    /// The plan's memory ([`Memory::bytes`]) is more than a host run allocates.
    #[error("the plan needs {bytes} bytes of host memory, more than the {max} a host run allocates")]
    TooLarge {
        /// Bytes of host memory the run needs ([`Memory::bytes`], or [`verify_bytes`]).
        bytes: u64,
        /// The limit: [`MAX_MEMORY_BYTES`] for the memory, what this process can still allocate
        /// ([`crate::compile::memory::default_limit`]) for a whole verification.
        max: u64,
    },
}

/// One TB's account of a launch, in executor turns (the CPU counterpart of
/// [`oxccl_kernels::abi::TbTiming`]).
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct TbAccount {
    /// Steps run (task × micro-batch).
    pub busy: u64,
    /// Turns in which the TB was blocked (FIFO space, FIFO data or a sync point).
    pub idle: u64,
    /// The round in which it finished.
    pub finished_round: u64,
}

/// What a launch did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LaunchReport {
    /// Rounds of the round-robin scheduler.
    pub rounds: u64,
    /// `tbs[rank][tb]`.
    pub tbs: Vec<Vec<TbAccount>>,
}

#[derive(Clone, Copy, Default)]
struct TbState {
    started: bool,
    finished: bool,
    epoch: u64,
    /// Index of the current segment among the TB's.
    seg: u32,
    mb: u32,
    /// Absolute index of the current task.
    pos: u32,
}

fn read_u64(ws: &[u8], offset: u64) -> u64 {
    let at = (offset - FIFO_REGION_OFFSET as u64) as usize;
    u64::from_le_bytes(ws[at..at + 8].try_into().expect("8 bytes"))
}

fn write_u64(ws: &mut [u8], offset: u64, v: u64) {
    let at = (offset - FIFO_REGION_OFFSET as u64) as usize;
    ws[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

enum Step {
    Ran,
    Blocked(String),
}

/// Runs one launch of `lp` (every rank) on `mem`. See the [module documentation](self).
// Rank and TB indices address several parallel tables (descriptors, state, memory, report).
#[allow(clippy::needless_range_loop)]
pub fn launch(lp: &LoweredPlan, mem: &mut Memory, opts: &LaunchOptions) -> Result<LaunchReport, LoweredExecError> {
    validate(lp)?;
    if opts.quantum == 0 {
        return Err(bad_input("the quantum must be at least 1".into()));
    }
    let n = lp.ranks.len();
    check_memory(lp, mem)?;
    // A launch leaves every FIFO drained: a message left over, or a head past its tail, is an
    // earlier launch's that failed midway.
    for (r, lr) in lp.ranks.iter().enumerate() {
        for c in lr.connections.iter().filter(|c| c.receiver as usize == r) {
            let (head, tail) =
                (read_u64(&mem.workspaces[r], c.head_offset), read_u64(&mem.workspaces[r], c.tail_offset));
            if head != tail {
                return Err(LoweredExecError::StaleWorkspace {
                    rank: Rank(r as u32),
                    what: format!("c{}'s head counter {head} is not its tail counter {tail}", c.id),
                });
            }
        }
    }
    // Message tags (op, chunks) per connection and slot: what the hardware cannot check.
    let nconn = lp.ranks.iter().flat_map(|r| r.connections.iter().map(|c| c.id as usize + 1)).max().unwrap_or(0);
    let mut tags: Vec<Vec<Option<(u32, u32)>>> = vec![Vec::new(); nconn];
    for lr in &lp.ranks {
        for c in &lr.connections {
            tags[c.id as usize] = vec![None; c.slots as usize];
        }
    }
    let mut state: Vec<Vec<TbState>> = lp.ranks.iter().map(|r| vec![TbState::default(); r.tbs.len()]).collect();
    let mut report =
        LaunchReport { rounds: 0, tbs: lp.ranks.iter().map(|r| vec![TbAccount::default(); r.tbs.len()]).collect() };
    let mut scratch: Vec<u8> = Vec::new();
    loop {
        report.rounds += 1;
        let mut progress = false;
        let mut all_done = true;
        let mut blocked = Vec::new();
        for r in 0..n {
            let lr = &lp.ranks[r];
            let h = &lr.header;
            let (mb_bytes, cb) = (h.mb_bytes as usize, h.chunk_bytes as usize);
            let dtype = DType::from_raw(h.dtype).expect("validated");
            let op = RedOp::from_raw(h.op).expect("validated");
            for t in 0..lr.tbs.len() {
                let tb = &lr.tbs[t];
                for _ in 0..opts.quantum {
                    let st = state[r][t];
                    if st.finished {
                        break;
                    }
                    if !st.started {
                        let c = read_u64(&mem.workspaces[r], tb.progress_offset);
                        let s = &mut state[r][t];
                        s.started = true;
                        progress = true;
                        if tb.steps == 0 {
                            s.finished = true;
                            report.tbs[r][t].finished_round = report.rounds;
                            break;
                        }
                        let stale = |what| LoweredExecError::StaleWorkspace { rank: Rank(r as u32), what };
                        if !c.is_multiple_of(tb.steps as u64) {
                            return Err(stale(format!(
                                "tb{t}'s progress counter {c} is not a multiple of {}",
                                tb.steps
                            )));
                        }
                        // The launch takes the counter to `c + steps`.
                        if c.checked_add(tb.steps as u64).is_none() {
                            return Err(stale(format!(
                                "tb{t}'s progress counter {c} cannot advance {} steps",
                                tb.steps
                            )));
                        }
                        s.epoch = c / tb.steps as u64;
                        s.seg = 0;
                        s.mb = 0;
                        s.pos = lr.segments[tb.first_segment as usize].first_task;
                        continue;
                    }
                    let seg = lr.segments[(tb.first_segment + st.seg) as usize];
                    let (i, m) = (st.pos, st.mb);
                    let task: &FifoTask = &lr.tasks[i as usize];
                    let kind = FifoKind::from_raw(task.kind).expect("validated");
                    let waits: &[PlanWait] =
                        &lr.waits[task.wait_start as usize..task.wait_start as usize + task.wait_count as usize];
                    let piece = |chunk: u32, j: u32| (chunk + j) as usize * cb + m as usize * mb_bytes;
                    let outcome = 'step: {
                        for w in waits {
                            let target = &lr.tbs[w.tb as usize];
                            let have = read_u64(&mem.workspaces[r], target.progress_offset);
                            let need = st
                                .epoch
                                .checked_mul(target.steps as u64)
                                .and_then(|e| e.checked_add(w.base as u64 + m as u64 * w.per_mb as u64))
                                .ok_or_else(|| LoweredExecError::StaleWorkspace {
                                    rank: Rank(r as u32),
                                    what: format!("tb{t} at launch {} waits for tb{} past 2^64 steps", st.epoch, w.tb),
                                })?;
                            if have < need {
                                break 'step Step::Blocked(format!(
                                    "waits for tb{}.{} (progress {have} < {need})",
                                    w.tb, w.task
                                ));
                            }
                        }
                        match kind {
                            FifoKind::Send => {
                                let c = &lr.connections[task.conn as usize];
                                let ws = &mut mem.workspaces[c.receiver as usize];
                                let (head, tail) = (read_u64(ws, c.head_offset), read_u64(ws, c.tail_offset));
                                if tail - head >= c.slots as u64 {
                                    break 'step Step::Blocked(format!("FIFO c{} full", c.id));
                                }
                                let k = (tail % c.slots as u64) as usize;
                                let at =
                                    (c.ring_offset - FIFO_REGION_OFFSET as u64) as usize + k * c.slot_bytes as usize;
                                let src = &mem.buffers[r][task.src_slot as usize];
                                for j in 0..task.chunks {
                                    let from = piece(task.src_chunk, j);
                                    let to = at + j as usize * mb_bytes;
                                    ws[to..to + mb_bytes].copy_from_slice(&src[from..from + mb_bytes]);
                                }
                                let Some(next) = tail.checked_add(1) else {
                                    return Err(LoweredExecError::StaleWorkspace {
                                        rank: Rank(c.receiver),
                                        what: format!("c{}'s tail counter {tail} cannot advance", c.id),
                                    });
                                };
                                tags[c.id as usize][k] = Some((task.origin, task.chunks));
                                write_u64(ws, c.tail_offset, next);
                            }
                            FifoKind::Recv | FifoKind::RecvReduceCopy => {
                                let c = &lr.connections[task.conn as usize];
                                let ws = &mut mem.workspaces[r];
                                let (head, tail) = (read_u64(ws, c.head_offset), read_u64(ws, c.tail_offset));
                                if tail == head {
                                    break 'step Step::Blocked(format!("FIFO c{} empty", c.id));
                                }
                                let k = (head % c.slots as u64) as usize;
                                let tag = tags[c.id as usize][k].take();
                                if tag != Some((task.origin, task.chunks)) {
                                    let (message_op, message_chunks) = tag.unwrap_or((u32::MAX, 0));
                                    return Err(LoweredExecError::FifoOrder {
                                        conn: c.id,
                                        receiver_op: OpId(task.origin),
                                        message_op: OpId(message_op),
                                        receiver_chunks: task.chunks,
                                        message_chunks,
                                    });
                                }
                                let at =
                                    (c.ring_offset - FIFO_REGION_OFFSET as u64) as usize + k * c.slot_bytes as usize;
                                // recv: dst = message; recv_reduce_copy: dst = src ⊕ message.
                                scratch.clear();
                                scratch.extend_from_slice(&ws[at..at + task.chunks as usize * mb_bytes]);
                                if kind == FifoKind::RecvReduceCopy {
                                    let src = &mem.buffers[r][task.src_slot as usize];
                                    for j in 0..task.chunks as usize {
                                        let from = piece(task.src_chunk, j as u32);
                                        let mut local = src[from..from + mb_bytes].to_vec();
                                        combine_into(dtype, op, &mut local, &scratch[j * mb_bytes..(j + 1) * mb_bytes]);
                                        scratch[j * mb_bytes..(j + 1) * mb_bytes].copy_from_slice(&local);
                                    }
                                }
                                let dst = &mut mem.buffers[r][task.dst_slot as usize];
                                for j in 0..task.chunks as usize {
                                    let to = piece(task.dst_chunk, j as u32);
                                    dst[to..to + mb_bytes].copy_from_slice(&scratch[j * mb_bytes..(j + 1) * mb_bytes]);
                                }
                                write_u64(ws, c.head_offset, head + 1);
                            }
                            FifoKind::Copy | FifoKind::Reduce => {
                                scratch.clear();
                                let src = &mem.buffers[r][task.src_slot as usize];
                                for j in 0..task.chunks {
                                    let from = piece(task.src_chunk, j);
                                    scratch.extend_from_slice(&src[from..from + mb_bytes]);
                                }
                                let dst = &mut mem.buffers[r][task.dst_slot as usize];
                                for j in 0..task.chunks {
                                    let to = piece(task.dst_chunk, j);
                                    let data = &scratch[j as usize * mb_bytes..(j as usize + 1) * mb_bytes];
                                    if kind == FifoKind::Reduce {
                                        combine_into(dtype, op, &mut dst[to..to + mb_bytes], data);
                                    } else {
                                        dst[to..to + mb_bytes].copy_from_slice(data);
                                    }
                                }
                            }
                        }
                        Step::Ran
                    };
                    match outcome {
                        Step::Blocked(reason) => {
                            report.tbs[r][t].idle += 1;
                            blocked.push(Blocked {
                                rank: Rank(r as u32),
                                tb: TbId::new(t),
                                task: i - tb.first_task,
                                prim: crate::compile::lower::prim_of(kind),
                                op: OpId(task.origin),
                                micro_batch: m,
                                reason,
                            });
                            break;
                        }
                        Step::Ran => {
                            progress = true;
                            report.tbs[r][t].busy += 1;
                            let base = st.epoch * tb.steps as u64;
                            if task.flags & FIFO_TASK_SIGNAL != 0 {
                                let done = seg.progress_base as u64
                                    + m as u64 * seg.task_count as u64
                                    + (i - seg.first_task) as u64
                                    + 1;
                                write_u64(&mut mem.workspaces[r], tb.progress_offset, base + done);
                            }
                            let s = &mut state[r][t];
                            s.pos += 1;
                            if s.pos == seg.first_task + seg.task_count {
                                s.pos = seg.first_task;
                                s.mb += 1;
                                if s.mb == seg.micro_batches {
                                    s.mb = 0;
                                    s.seg += 1;
                                    if s.seg == tb.segment_count {
                                        s.finished = true;
                                        report.tbs[r][t].finished_round = report.rounds;
                                        write_u64(&mut mem.workspaces[r], tb.progress_offset, base + tb.steps as u64);
                                    } else {
                                        s.pos = lr.segments[(tb.first_segment + s.seg) as usize].first_task;
                                    }
                                }
                            }
                        }
                    }
                }
                if !state[r][t].finished {
                    all_done = false;
                }
            }
        }
        if all_done {
            break;
        }
        if !progress {
            return Err(LoweredExecError::Deadlock { blocked });
        }
    }
    for lr in &lp.ranks {
        for c in lr.connections.iter().filter(|c| c.receiver == lr.header.rank) {
            let ws = &mem.workspaces[c.receiver as usize];
            let (head, tail) = (read_u64(ws, c.head_offset), read_u64(ws, c.tail_offset));
            if head != tail {
                return Err(LoweredExecError::Unconsumed { conn: c.id, messages: tail.wrapping_sub(head) });
            }
        }
    }
    Ok(report)
}

/// An element type of both the CPU references and the device ABI.
pub trait AbiElement: Element + Pod {
    /// The ABI's name for it.
    const DTYPE: DType;
}

impl AbiElement for f32 {
    const DTYPE: DType = DType::F32;
}
impl AbiElement for i32 {
    const DTYPE: DType = DType::I32;
}
impl AbiElement for u32 {
    const DTYPE: DType = DType::U32;
}
impl AbiElement for half::f16 {
    const DTYPE: DType = DType::F16;
}
impl AbiElement for half::bf16 {
    const DTYPE: DType = DType::Bf16;
}

/// Bytes [`verify`] holds at once for `lp` (saturating): the [`Memory`], and each rank's inputs,
/// outputs and reference outputs.
pub fn verify_bytes(lp: &LoweredPlan) -> u64 {
    let l = &lp.layout;
    let cb = lp.ranks.first().map_or(0, |r| r.header.chunk_bytes);
    let per_rank = (l.input_chunks() as u64 + 2 * l.output_chunks() as u64).saturating_mul(cb);
    Memory::bytes(lp)
        .saturating_add(per_rank.saturating_mul(l.ranks as u64))
        .saturating_add(l.input_chunks() as u64 * cb)
}

/// Runs `lp` `launches` times on one [`Memory`] (a graph replayed: counters carry over), each time
/// on fresh [`test_inputs`], and compares every output element with the collective's reference. The
/// plan must have been lowered for `T` and `op`; descriptors that fail [`validate`] are refused
/// before anything is sized by them, and so is a run that would take more memory than this
/// process can still allocate ([`verify_bytes`], [`LoweredExecError::TooLarge`]).
pub fn verify<T: AbiElement>(
    lp: &LoweredPlan,
    op: ReduceOp,
    launches: u32,
    opts: &LaunchOptions,
) -> Result<VerifyReport, LoweredExecError> {
    validate(lp)?;
    let h = lp.ranks.first().map(|r| r.header).ok_or_else(|| bad_input("no ranks".into()))?;
    if h.dtype != T::DTYPE.raw() || h.op != op.raw() {
        return Err(bad_input("the plan was lowered for another dtype or operator".into()));
    }
    let l = &lp.layout;
    let chunk_len = h.chunk_bytes as usize / std::mem::size_of::<T>();
    // The memory's own bound first, then the whole run's against what the process can allocate.
    let bytes = Memory::bytes(lp);
    if bytes > MAX_MEMORY_BYTES {
        return Err(LoweredExecError::TooLarge { bytes, max: MAX_MEMORY_BYTES });
    }
    let (bytes, max) = (verify_bytes(lp), crate::compile::memory::default_limit());
    if bytes > max {
        return Err(LoweredExecError::TooLarge { bytes, max });
    }
    let mut mem = Memory::try_new(lp)?;
    let mut report = VerifyReport { elements: 0, wrong: 0, first_wrong: None };
    for k in 0..launches {
        let mut inputs = test_inputs::<T>(l.ranks as usize, l.input_chunks() as usize * chunk_len);
        // Different data each launch, so a replay that reads stale slots is caught.
        for v in inputs.iter_mut().flatten() {
            *v = v.reduce(T::from_small(k as i32), ReduceOp::Sum);
        }
        // Out-of-place outputs start from garbage, as user buffers may.
        for bufs in &mut mem.buffers {
            bufs[oxccl_kernels::abi::slot::OUTPUT as usize].fill(0xA5);
        }
        if l.in_place {
            for bufs in &mut mem.buffers {
                for b in bufs.iter_mut() {
                    b.fill(0);
                }
            }
        }
        mem.load_inputs(lp, &inputs)?;
        launch(lp, &mut mem, opts)?;
        let got = mem.outputs::<T>(lp)?;
        let want = reference::reference(l.collective, &inputs, op).map_err(|e| bad_input(e.to_string()))?;
        for (r, (g, w)) in got.iter().zip(&want).enumerate() {
            report.tally(r, g, w);
        }
    }
    Ok(report)
}
