//! The CPU executor of compiled plans (the semantic oracle) and the collectives' CPU references.
//!
//! [`execute`] runs a [`Plan`] on host memory for every rank with exactly the device semantics of
//! [`crate::compile::plan`]: one program counter per thread block, `(segment, micro-batch, task)` in
//! order, sync points on other TBs' progress, and FIFO connections of a fixed number of slots where a
//! send blocks while the FIFO is full and a receive blocks until a message is there. The TBs are
//! stepped round-robin, deterministically; when a full round makes no progress and work is left, the
//! plan deadlocks and the executor says where ([`ExecError::Deadlock`]), as a GPU would hang.
//!
//! Beyond the device, the executor also checks what the hardware cannot: that the message a receive
//! takes was sent for the same op, and that no message is left over.

pub mod reference;

use crate::compile::memory::{self, TooLarge};
use crate::compile::{ConnId, Plan, Prim, TbCursor, TbId, TbTask};
use crate::program::{BufferLayout, OpId, Rank, Slice};
use oxccl_kernels::abi::DType;
use std::collections::VecDeque;
use std::fmt;

/// The reduction operator: the engine's ([`oxccl_kernels::abi::RedOp`]), one type for every
/// executor. Compiled plans take every operator but `Avg` (their tasks do not know which of them
/// completes a reduction): the executor and references refuse it ([`ExecError::BadInput`]).
pub use oxccl_kernels::abi::RedOp as ReduceOp;

/// The operator named `s` as nccl-tests names it (`sum`, `min`, `max`, `prod`; `avg` is refused
/// here: no op of a program knows which reduction of a chunk is its last).
pub fn parse_op(s: &str) -> Result<ReduceOp, String> {
    match ReduceOp::ALL.iter().copied().find(|o| o.nccl_name() == s) {
        Some(ReduceOp::Avg) => Err("reduction `avg`: programs have no Avg (sum, min, max, prod)".into()),
        Some(op) => Ok(op),
        None => Err(format!("unknown reduction `{s}` (sum, min, max, prod)")),
    }
}

/// [`ExecError::BadInput`] for an operator compiled plans do not run (Avg).
pub(crate) fn check_op(op: ReduceOp) -> Result<(), ExecError> {
    if op == ReduceOp::Avg {
        return Err(ExecError::BadInput {
            reason: "ReduceOp::Avg: compiled plans have no Avg (their tasks do not know which completes a reduction)"
                .into(),
        });
    }
    Ok(())
}

/// An element type the executor and references handle. Its arithmetic is the device's, in one
/// place ([`crate::lowered::combine_into`], [`crate::lowered::finish_into`]): an implementation names
/// the engine's type and how a small integer looks in it.
pub trait Element: bytemuck::Pod + PartialEq + fmt::Debug + Default + 'static {
    /// The engine's name for the type.
    const DTYPE: DType;
    /// `acc[i] = acc[i] ⊕ src[i]` over the elements both hold (Avg combines as Sum;
    /// [`Element::average`] is its division, which the program executors refuse and the staged
    /// plans' `run_cpu` applies). The combine reads the elements' bytes as little-endian, as every
    /// CUDA host stores them.
    fn combine(acc: &mut [Self], src: &[Self], op: ReduceOp) {
        crate::lowered::combine_into(Self::DTYPE, op, bytemuck::cast_slice_mut(acc), bytemuck::cast_slice(src));
    }
    /// `self ⊕ other`, as [`Element::combine`] on one element.
    fn reduce(self, other: Self, op: ReduceOp) -> Self {
        let mut v = self;
        Self::combine(std::slice::from_mut(&mut v), std::slice::from_ref(&other), op);
        v
    }
    /// A sum of `n` contributions made their average as the engine's Avg makes it
    /// ([`crate::lowered::finish_into`]).
    fn average(self, n: u32) -> Self {
        let mut v = self;
        crate::lowered::finish_into(Self::DTYPE, ReduceOp::Avg, bytemuck::bytes_of_mut(&mut v), n);
        v
    }
    /// A small integer in this type: exact for |v| ≤ 256 in the floats and signed integers of 16
    /// bits and more (bf16 holds 8 significant bits) and for 0 ≤ v ≤ 256 in `u32` and `u64`,
    /// wrapped into `i8` and `u8` (and negatives into the unsigned types), rounded in FP8 (exact
    /// for |v| ≤ 16 in E4M3, 8 in E5M2).
    fn from_small(v: i32) -> Self;
}

macro_rules! element {
    ($t:ty, $d:ident, $small:expr) => {
        impl Element for $t {
            const DTYPE: DType = DType::$d;
            fn from_small(v: i32) -> Self {
                $small(v)
            }
        }
    };
}
element!(f32, F32, |v| v as f32);
element!(f64, F64, |v| v as f64);
element!(half::f16, F16, |v| half::f16::from_f64(v as f64));
element!(half::bf16, Bf16, |v| half::bf16::from_f64(v as f64));
element!(i8, I8, |v| v as i8);
element!(u8, U8, |v| v as u8);
element!(i32, I32, |v| v);
element!(i64, I64, |v| v as i64);
element!(u32, U32, |v| v as u32);
element!(u64, U64, |v| v as u64);

/// Executor options.
#[derive(Copy, Clone, Debug)]
pub struct ExecOptions {
    /// Micro-batches each chunk is cut into (at least 1).
    pub micro_batches: u32,
    /// Slots per FIFO connection (at least 1; NCCL uses 8).
    pub fifo_slots: u32,
}

impl Default for ExecOptions {
    fn default() -> Self {
        ExecOptions { micro_batches: 4, fifo_slots: 8 }
    }
}

/// Where a TB is stuck, for deadlock reports (of plans and of lowered plans).
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct Blocked {
    /// The rank the TB belongs to.
    pub rank: Rank,
    /// The TB, indexed within its rank.
    pub tb: TbId,
    /// Index of the task in the TB's list.
    pub task: u32,
    /// The blocked task's primitive.
    pub prim: Prim,
    /// The program op the task is part of (a lowered task: the op it was lowered from).
    pub op: OpId,
    /// The micro-batch the TB is at (from 0).
    pub micro_batch: u32,
    /// What it waits for: `FIFO c3 full`, `FIFO c3 empty`, `waits for tb1.4` (a sync point on task
    /// 4 of TB 1), or in a lowered plan another TB's progress counter below the threshold (`waits
    /// for tb1.4 (progress 7 < 9)`).
    pub reason: String,
}

/// `r0 tb1 task 4 (recv op7, micro-batch 2): FIFO c3 empty`.
impl fmt::Display for Blocked {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let Blocked { rank, tb, task, prim, op, micro_batch, reason } = self;
        write!(f, "{rank} {tb} task {task} ({} {op}, micro-batch {micro_batch}): {reason}", prim.name())
    }
}

/// A deadlock report: how many TBs are stuck, and where the first eight are.
/// A deadlock's message: how many TBs are stuck, and the first eight of them.
pub(crate) struct Deadlock<'a>(pub &'a [Blocked]);

impl fmt::Display for Deadlock<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "deadlock: {} thread blocks cannot progress", self.0.len())?;
        self.0.iter().take(8).try_for_each(|b| write!(f, "; {b}"))
    }
}

impl Blocked {
    /// Task `task` (index `i`) of rank `r`'s TB `t`, blocked at micro-batch `mb` on `reason`.
    pub(crate) fn at(r: usize, t: usize, i: usize, task: &TbTask, mb: u32, reason: String) -> Blocked {
        Blocked {
            rank: Rank(r as u32),
            tb: TbId::new(t),
            task: i as u32,
            prim: task.prim,
            op: task.op,
            micro_batch: mb,
            reason,
        }
    }
}

/// Why a plan could not be executed.
#[derive(Clone, PartialEq, Debug, thiserror::Error)]
pub enum ExecError {
    /// Inputs do not fit the plan (rank count, lengths) or options are out of range.
    #[error("bad input: {reason}")]
    BadInput {
        /// What does not fit.
        reason: String,
    },
    /// The plan is malformed (see [`Plan::check_structure`]).
    #[error("malformed plan: {reason}")]
    BadPlan {
        /// What is malformed.
        reason: String,
    },
    /// No thread block can make progress and work is left.
    #[error("{}", Deadlock(blocked))]
    Deadlock {
        /// Every unfinished TB, where it stopped and why, in (rank, TB) order.
        blocked: Vec<Blocked>,
    },
    /// A receive found a message sent for another op: the two ends disagree on the FIFO order.
    #[error("{conn}: the receive of {receiver_op} found the message of {message_op} (FIFO order mismatch)")]
    FifoOrder {
        /// The connection whose oldest message belongs to another op.
        conn: ConnId,
        /// The op of the receiving task.
        receiver_op: OpId,
        /// The op the message at the head of the FIFO was sent for.
        message_op: OpId,
    },
    /// Messages are left in a FIFO after every TB finished.
    #[error("{conn}: {messages} messages never received")]
    Unconsumed {
        /// The lowest-numbered connection with messages left.
        conn: ConnId,
        /// Messages left in it.
        messages: usize,
    },
    /// The run would take more memory than its limit ([`verify_bytes`], estimated before anything
    /// is allocated), or an allocation failed.
    #[error("{0}")]
    TooLarge(#[from] TooLarge),
}

struct Message<T> {
    op: OpId,
    data: Vec<T>,
}

/// Micro-batch `m` of `mbs` of a chunk of `len` elements (`mbs` of 0 counts as 1; `m >= mbs` is the
/// empty range at the end).
pub fn micro_batch_range(len: usize, mbs: u32, m: u32) -> std::ops::Range<usize> {
    let mbs = mbs.max(1) as u128;
    let m = m.min(mbs as u32) as u128;
    let at = |k: u128| (k * len as u128 / mbs) as usize;
    at(m)..at((m + 1).min(mbs))
}

enum Step {
    Blocked(String),
    Done,
}

/// Runs `plan` on `inputs` (one vector per rank, `input_chunks × L` elements each) and returns each
/// rank's output buffer (`output_chunks × L` elements).
pub fn execute<T: Element>(
    plan: &Plan,
    inputs: &[Vec<T>],
    op: ReduceOp,
    opts: &ExecOptions,
) -> Result<Vec<Vec<T>>, ExecError> {
    plan.check_structure().map_err(|reason| ExecError::BadPlan { reason })?;
    check_op(op)?;
    let l = &plan.layout;
    let n = l.ranks as usize;
    if inputs.len() != n {
        return Err(ExecError::BadInput { reason: format!("{} inputs for {n} ranks", inputs.len()) });
    }
    if opts.micro_batches == 0 || opts.fifo_slots == 0 {
        return Err(ExecError::BadInput { reason: "micro-batches and FIFO slots must be at least 1".into() });
    }
    if opts.micro_batches > crate::compile::MAX_MICRO_BATCHES {
        return Err(ExecError::BadInput {
            reason: format!("{} micro-batches: at most {}", opts.micro_batches, crate::compile::MAX_MICRO_BATCHES),
        });
    }
    let ic = l.input_chunks() as usize;
    let len0 = inputs[0].len();
    if ic == 0 || !len0.is_multiple_of(ic) || inputs.iter().any(|v| v.len() != len0) {
        return Err(ExecError::BadInput {
            reason: format!("every rank needs the same number of elements, a multiple of {ic} input chunks"),
        });
    }
    let cl = len0 / ic;
    // Storage per rank, allocated fallibly: scratch can make it far larger than the inputs.
    let mut mem: Vec<Vec<T>> = Vec::with_capacity(n);
    for r in 0..n {
        let chunks = l.storage_chunks(Rank(r as u32));
        let cannot = || ExecError::BadInput {
            reason: format!("r{r}: storage of {chunks} chunks of {cl} elements cannot be allocated"),
        };
        let len = (chunks as usize).checked_mul(cl).ok_or_else(cannot)?;
        let mut v = Vec::new();
        v.try_reserve_exact(len).map_err(|_| cannot())?;
        v.resize(len, T::default());
        mem.push(v);
    }
    for (r, input) in inputs.iter().enumerate() {
        for j in 0..ic {
            let at = l.resolve(Rank(r as u32), Slice::input(j as u32)).expect("input resolves") as usize;
            mem[r][at * cl..(at + 1) * cl].copy_from_slice(&input[j * cl..(j + 1) * cl]);
        }
    }
    let mut fifos: Vec<VecDeque<Message<T>>> = (0..plan.connections.len()).map(|_| VecDeque::new()).collect();
    let mut done: Vec<Vec<Vec<u32>>> =
        plan.ranks.iter().map(|rp| rp.tbs.iter().map(|tb| vec![0u32; tb.tasks.len()]).collect()).collect();
    let mut state: Vec<Vec<TbCursor>> =
        plan.ranks.iter().map(|rp| rp.tbs.iter().map(TbCursor::new).collect()).collect();
    let mbs = opts.micro_batches;
    let slots = opts.fifo_slots as usize;
    let mut scratch: Vec<T> = Vec::new();

    loop {
        let mut progress = false;
        let mut all_done = true;
        let mut blocked: Vec<Blocked> = Vec::new();
        for r in 0..n {
            for t in 0..plan.ranks[r].tbs.len() {
                loop {
                    let st = &state[r][t];
                    if st.finished() {
                        break;
                    }
                    let (i, mb) = (st.pos, st.mb);
                    let tbp = &plan.ranks[r].tbs[t];
                    let task = &tbp.tasks[i];
                    let outcome = (|| -> Result<Step, ExecError> {
                        for w in tbp.waits(i) {
                            if done[r][w.tb.index()][w.task as usize] <= mb {
                                return Ok(Step::Blocked(format!("waits for {}.{}", w.tb, w.task)));
                            }
                        }
                        let range = micro_batch_range(cl, mbs, mb);
                        let rank = Rank(r as u32);
                        let gather = |mem: &Vec<Vec<T>>, s: Slice, out: &mut Vec<T>| {
                            out.clear();
                            let base = l.resolve(rank, s).expect("verified plan") as usize;
                            for j in 0..s.count as usize {
                                let c = (base + j) * cl;
                                out.extend_from_slice(&mem[r][c + range.start..c + range.end]);
                            }
                        };
                        // Fails when `data` is not exactly `s`'s micro-batch: a receive whose size
                        // differs from the message's would otherwise read past it or drop a part.
                        let scatter = |mem: &mut Vec<Vec<T>>, s: Slice, data: &[T], reduce: bool| {
                            let base = l.resolve(rank, s).expect("verified plan") as usize;
                            let w = range.len();
                            if data.len() != s.count as usize * w {
                                return Err(ExecError::BadPlan {
                                    reason: format!(
                                        "{rank} {} task {i} ({}): writes {} elements to {s}, the data has {}",
                                        TbId::new(t),
                                        task.op,
                                        s.count as usize * w,
                                        data.len()
                                    ),
                                });
                            }
                            for j in 0..s.count as usize {
                                let c = (base + j) * cl;
                                let dst = &mut mem[r][c + range.start..c + range.end];
                                let src = &data[j * w..(j + 1) * w];
                                if reduce {
                                    T::combine(dst, src, op);
                                } else {
                                    dst.copy_from_slice(src);
                                }
                            }
                            Ok(())
                        };
                        match task.prim {
                            Prim::Send => {
                                let c = task.conn.expect("verified plan").index();
                                if fifos[c].len() >= slots {
                                    return Ok(Step::Blocked(format!("FIFO c{c} full")));
                                }
                                let mut data = Vec::new();
                                gather(&mem, task.src.expect("send has a source"), &mut data);
                                fifos[c].push_back(Message { op: task.op, data });
                            }
                            Prim::Recv | Prim::RecvReduceCopy => {
                                let c = task.conn.expect("verified plan");
                                let Some(front) = fifos[c.index()].front() else {
                                    return Ok(Step::Blocked(format!("FIFO {c} empty")));
                                };
                                if front.op != task.op {
                                    return Err(ExecError::FifoOrder {
                                        conn: c,
                                        receiver_op: task.op,
                                        message_op: front.op,
                                    });
                                }
                                let msg = fifos[c.index()].pop_front().expect("front exists");
                                scatter(
                                    &mut mem,
                                    task.dst.expect("receive has a destination"),
                                    &msg.data,
                                    task.prim == Prim::RecvReduceCopy,
                                )?;
                            }
                            Prim::Copy | Prim::Reduce => {
                                gather(&mem, task.src.expect("local op has a source"), &mut scratch);
                                let data = std::mem::take(&mut scratch);
                                let written = scatter(
                                    &mut mem,
                                    task.dst.expect("local op has a destination"),
                                    &data,
                                    task.prim == Prim::Reduce,
                                );
                                scratch = data;
                                written?;
                            }
                        }
                        Ok(Step::Done)
                    })()?;
                    match outcome {
                        Step::Blocked(reason) => {
                            blocked.push(Blocked::at(r, t, i, task, mb, reason));
                            break;
                        }
                        Step::Done => {
                            progress = true;
                            done[r][t][i] = mb + 1;
                            state[r][t].advance(mbs);
                        }
                    }
                }
                if !state[r][t].finished() {
                    all_done = false;
                }
            }
        }
        if all_done {
            break;
        }
        if !progress {
            return Err(ExecError::Deadlock { blocked });
        }
    }
    if let Some((c, f)) = fifos.iter().enumerate().find(|(_, f)| !f.is_empty()) {
        return Err(ExecError::Unconsumed { conn: ConnId::new(c), messages: f.len() });
    }
    // Outputs, each rank's storage freed once its output is out.
    let oc = l.output_chunks() as usize;
    let mut outs = Vec::with_capacity(n);
    for (r, m) in mem.into_iter().enumerate() {
        let mut out = memory::try_vec(oc * cl, &format!("r{r}'s output of {} elements", oc * cl))?;
        for j in 0..oc {
            let at = l.resolve(Rank(r as u32), Slice::output(j as u32)).expect("output resolves") as usize;
            out.extend_from_slice(&m[at * cl..(at + 1) * cl]);
        }
        outs.push(out);
    }
    Ok(outs)
}

/// Test inputs whose reductions are exact in every element type but FP8 and in every order: small
/// integers, distinct across ranks and positions (FP8 sums round at each step: [`verify`] refuses
/// them).
pub fn test_inputs<T: Element>(ranks: usize, len: usize) -> Vec<Vec<T>> {
    (0..ranks).map(|r| (0..len).map(|i| T::from_small(((r * 131 + i * 7 + 3) % 17) as i32 + 1)).collect()).collect()
}

/// The inputs [`verify`] runs `op` on: [`test_inputs`], or for Prod 1s and 2s, whose products are
/// exact in every type in any order (past the type's range a float product is +inf, an FP8 one the
/// largest finite value, in any order).
pub fn test_inputs_for<T: Element>(ranks: usize, len: usize, op: ReduceOp) -> Vec<Vec<T>> {
    if op != ReduceOp::Prod {
        return test_inputs(ranks, len);
    }
    (0..ranks).map(|r| (0..len).map(|i| T::from_small(((r * 131 + i * 7 + 3) % 17 % 2) as i32 + 1)).collect()).collect()
}

/// The outcome of [`verify`]: the output elements compared with the reference over every rank, and
/// the first wrong ones as (rank, index).
pub type VerifyReport = crate::verify::VerifyReport<(usize, usize)>;

/// Most elements of storage (input, output and scratch), over all ranks, [`verify`] builds on the
/// host, whatever their size (the bytes are bounded by [`verify_bytes`] against a memory limit).
pub const MAX_VERIFY_ELEMENTS: usize = 1 << 28;

/// Whether a host verification of `l`'s program with `chunk_len` elements per chunk stays within
/// [`MAX_VERIFY_ELEMENTS`]: `execute` allocates every rank's whole storage, scratch included, so
/// that is what is bounded. `Err` says by how much, in words, or what is wrong with `l`. The
/// element count only: [`check_verify_memory`] bounds the bytes, for an element size.
pub fn check_verify_size(l: &BufferLayout, chunk_len: usize) -> Result<(), String> {
    l.validate().map_err(|e| e.to_string())?;
    let storage: u64 = (0..l.ranks).map(|r| l.storage_chunks(Rank(r)) as u64).sum();
    if (storage as u128) * chunk_len as u128 > MAX_VERIFY_ELEMENTS as u128 {
        return Err(format!(
            "{storage} storage chunks of {chunk_len} elements over {} ranks: more than the \
             {MAX_VERIFY_ELEMENTS} elements a host verification holds",
            l.ranks
        ));
    }
    Ok(())
}

/// Bytes of the buffers [`verify`] holds at once for `l`'s program with `chunk_len` elements of
/// `elem_bytes` bytes per chunk: the inputs, every rank's storage (scratch included), the outputs
/// and the reference (every rank's output, and one input's worth for a reduction), saturating.
pub fn verify_buffer_bytes(l: &BufferLayout, chunk_len: usize, elem_bytes: usize) -> u64 {
    let n = l.ranks as u64;
    let storage: u64 = (0..l.ranks).map(|r| l.storage_chunks(Rank(r)) as u64).sum();
    let chunks = n
        .saturating_mul(l.input_chunks() as u64)
        .saturating_add(storage)
        .saturating_add(n.saturating_mul(l.output_chunks() as u64).saturating_mul(2))
        .saturating_add(l.input_chunks() as u64);
    chunks.saturating_mul(chunk_len as u64).saturating_mul(elem_bytes as u64)
}

/// Bytes [`verify`] takes for `plan` with `chunk_len` elements of `elem_bytes` bytes per chunk:
/// [`verify_buffer_bytes`], the messages FIFOs can hold (`opts.fifo_slots` per connection, each a
/// micro-batch of the largest slice) and the executor's per-task state, saturating.
pub fn verify_bytes(plan: &Plan, chunk_len: usize, elem_bytes: usize, opts: &ExecOptions) -> u64 {
    let tasks = plan.ranks.iter().flat_map(|r| &r.tbs).map(|tb| tb.tasks.len() as u64).sum::<u64>();
    let widest = plan
        .ranks
        .iter()
        .flat_map(|r| &r.tbs)
        .flat_map(|tb| &tb.tasks)
        .map(|t| t.src.or(t.dst).map_or(0, |s| s.count as u64))
        .max()
        .unwrap_or(0);
    let mb = (chunk_len as u64).div_ceil(opts.micro_batches.max(1) as u64);
    let message = widest.saturating_mul(mb).saturating_mul(elem_bytes as u64).saturating_add(48);
    let fifos = (plan.connections.len() as u64).saturating_mul(opts.fifo_slots as u64).saturating_mul(message);
    verify_buffer_bytes(&plan.layout, chunk_len, elem_bytes).saturating_add(fifos).saturating_add(tasks * 24)
}

/// Refuses, with [`TooLarge`] naming the sizes, a verification of `l`'s program whose buffers
/// ([`verify_buffer_bytes`]) would take more than `limit` bytes: the check a caller can make
/// before it has a plan (a command line's `--count` and `--dtype`).
pub fn check_verify_memory(l: &BufferLayout, chunk_len: usize, elem_bytes: usize, limit: u64) -> Result<(), TooLarge> {
    let need = verify_buffer_bytes(l, chunk_len, elem_bytes);
    memory::check(limit, need, || {
        format!("verifying on the host: {} ranks, {chunk_len} elements of {elem_bytes} bytes per chunk", l.ranks)
    })
}

/// Executes `plan` on [`test_inputs`] with `chunk_len` elements per chunk and compares every output
/// element with the collective's reference ([`ExecError::BadInput`] for a `chunk_len` of 0, or when
/// the ranks' storage is beyond [`MAX_VERIFY_ELEMENTS`]; [`ExecError::TooLarge`] when it would
/// take more memory than this process can still allocate, [`memory::default_limit`]).
pub fn verify<T: Element>(
    plan: &Plan,
    op: ReduceOp,
    chunk_len: usize,
    opts: &ExecOptions,
) -> Result<VerifyReport, ExecError> {
    verify_within::<T>(plan, op, chunk_len, opts, memory::default_limit())
}

/// [`verify`] within `limit` bytes ([`verify_bytes`], checked before anything is allocated).
pub fn verify_within<T: Element>(
    plan: &Plan,
    op: ReduceOp,
    chunk_len: usize,
    opts: &ExecOptions,
    limit: u64,
) -> Result<VerifyReport, ExecError> {
    let l = &plan.layout;
    l.validate().map_err(|e| ExecError::BadPlan { reason: e.to_string() })?;
    if chunk_len == 0 {
        return Err(ExecError::BadInput { reason: "a chunk needs at least one element (chunk_len is 0)".into() });
    }
    check_verify_size(l, chunk_len).map_err(|reason| ExecError::BadInput { reason })?;
    if matches!(T::DTYPE, DType::F8e4m3 | DType::F8e5m2) && matches!(op, ReduceOp::Sum | ReduceOp::Avg) {
        return Err(ExecError::BadInput {
            reason: format!("{op:?} of FP8 rounds at each step, so no order-free reference exists to verify against"),
        });
    }
    let size = std::mem::size_of::<T>();
    memory::check(limit, verify_bytes(plan, chunk_len, size, opts), || {
        format!(
            "verifying {} on the host: {} ranks, {chunk_len} elements of {} ({size} bytes) per chunk",
            plan.name,
            l.ranks,
            std::any::type_name::<T>()
        )
    })?;
    let elements = l.input_chunks() as usize * chunk_len;
    let inputs = test_inputs_for::<T>(l.ranks as usize, elements, op);
    let got = execute(plan, &inputs, op, opts)?;
    let want = reference::reference(l.collective, &inputs, op)?;
    let mut report = VerifyReport::default();
    for (r, (g, w)) in got.iter().zip(&want).enumerate().filter(|(r, _)| l.collective.defines_output(*r)) {
        report.tally(r, g, w);
    }
    Ok(report)
}
