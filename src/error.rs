//! Errors: every misuse and every device failure is a value naming what was wrong.

use cudarc::driver::DriverError;
use oxccl_host::compile::lower::DescriptorError;
use oxccl_host::lowered::LoweredError;
use oxccl_host::reshard::{LowerError, ReshardError};
use oxccl_host::tccl::PlanError;
use oxccl_kernels::abi::{BARRIER_ABORTED, BARRIER_REVOKED, BARRIER_SEQ, BARRIER_TAKEN, Status, WaitKind};
use std::fmt;

/// oxccl's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong. In the variants' fields, `what` names the buffer or list a call
/// refused in the words of its API ("send buffer", "receive buffers", "plan buffer", ...), `rank`
/// the rank it belongs to, and `expected` / `got` what the call needed and what it was given.
///
/// Two misuses have no variant because they do not compile: an element type the kernels do not
/// handle (the calls take `T: Element`, a sealed trait implemented for `f32`, `half::f16`,
/// `half::bf16`, `i32` and `u32`; an operator is a closed `ReduceOp`, valid for every element
/// type), and a call on a communicator that is not set up (the constructors return the communicator
/// only once its workspaces, peer access and kernels are in place, else an error).
#[derive(Debug)]
#[non_exhaustive]
pub enum Error {
    /// A CUDA driver call failed.
    Driver {
        /// The driver function (`cuLaunchKernel`, ...).
        call: &'static str,
        /// The driver's error.
        source: DriverError,
    },
    /// A CUDA driver call that cudarc could not report at once failed earlier (a buffer guard's
    /// stream wait or event record, a free: cudarc keeps the error for the `CudaContext`), and a call
    /// found it before its next step on that context: a call that launches (a collective, a reshard,
    /// a compiled plan's launch) before queueing any launch, so it did nothing; a wait (`synchronize`,
    /// `query`, `reset`, `clear_plans`) before that stream's wait, so call it again.
    KeptDriverError {
        /// The ordinal of the device whose context kept the error.
        ordinal: usize,
        /// The driver's error.
        source: DriverError,
    },
    /// The CUDA driver library is not installed (no GPU can be used).
    NoDriver,
    /// A device number at or above the number of CUDA devices.
    NoSuchDevice {
        /// The device asked for.
        ordinal: usize,
        /// How many devices the driver sees.
        devices: usize,
    },
    /// The device is not a Hopper (sm_90) GPU.
    UnsupportedDevice {
        /// The device.
        ordinal: usize,
        /// Its compute capability's major number.
        major: i32,
        /// Its compute capability's minor number.
        minor: i32,
    },
    /// The communicator was built with no ranks, or more than one launch can address.
    RankCount {
        /// The ranks asked for.
        ranks: usize,
        /// The most a communicator has ([`crate::MAX_RANKS`]).
        max: usize,
    },
    /// A rank index at or above the communicator's rank count.
    NoSuchRank {
        /// The index given.
        rank: usize,
        /// The communicator's (or plan's) rank count.
        ranks: usize,
    },
    /// A buffer slot index outside the plan's slots.
    NoSuchSlot {
        /// The index given.
        slot: usize,
        /// The slots a plan has.
        slots: usize,
    },
    /// A list passed one entry per rank (buffers, streams, buffer tables) with another length than the ranks.
    BufferCount {
        /// The list.
        what: &'static str,
        /// Entries needed: the ranks.
        expected: usize,
        /// Entries given.
        got: usize,
    },
    /// A rank's buffer has the wrong number of elements.
    Length {
        /// The buffer.
        what: &'static str,
        /// Its rank.
        rank: usize,
        /// Elements the call needs.
        expected: usize,
        /// Elements the buffer holds.
        got: usize,
    },
    /// A rank's buffer lives on another device than the rank.
    WrongDevice {
        /// The buffer.
        what: &'static str,
        /// Its rank.
        rank: usize,
        /// The rank's device.
        expected: usize,
        /// The buffer's device.
        got: usize,
    },
    /// Two buffers overlap where the call needs them distinct (`buffer` of `rank` and `other_buffer`
    /// of `other_rank`, at least one of them written by the call).
    Aliasing {
        /// The set of buffers checked ("send and receive buffers", "in-place buffers", ...).
        what: &'static str,
        /// One buffer's rank.
        rank: usize,
        /// That buffer.
        buffer: &'static str,
        /// The other buffer's rank.
        other_rank: usize,
        /// The other buffer.
        other_buffer: &'static str,
    },
    /// A buffer's address is not aligned to its element size.
    Misaligned {
        /// The buffer.
        what: &'static str,
        /// Its rank.
        rank: usize,
        /// Its device address.
        address: u64,
        /// The alignment needed, in bytes.
        align: usize,
    },
    /// `max_ctas` (or a per-call CTA count) is outside what the device can run co-resident.
    TooManyCtas {
        /// CTAs asked for at once on one device: every rank's there where a communicator checks a
        /// call (`why` then says how many ranks), one launch's where a launch is checked.
        requested: u32,
        /// The most that can run.
        max: u32,
        /// What limits them (registers, shared memory, SMs).
        why: String,
    },
    /// A setting or an argument is out of range (shown as `field: why`).
    Config {
        /// The setting (a `Config` field, or what a call was given).
        field: &'static str,
        /// What is wrong with it and what would be accepted.
        why: String,
    },
    /// The planner rejected the call.
    Plan(PlanError),
    /// A lowered program failed validation.
    Lowered(LoweredError),
    /// A compiled plan's device descriptors are malformed (`oxccl_host::compile::lower::validate`).
    Descriptors(DescriptorError),
    /// A reshard's layouts do not fit the tensor or the communicator, or its two sides disagree
    /// (`ReshardError::Src` / `Dst` name the side).
    Reshard(ReshardError),
    /// A reshard plan cannot be lowered for the engine (too many tasks, no copy unit, ...).
    ReshardLower(LowerError),
    /// A rank whose shard holds data passed no buffer for that side of a reshard (or a compiled
    /// plan's buffer table left a slot the plan uses at address 0).
    MissingBuffer {
        /// The buffer.
        what: &'static str,
        /// Its rank.
        rank: usize,
        /// Elements it would hold.
        elements: u64,
    },
    /// A rank outside a side's mesh passed a buffer for that side of a reshard.
    UnexpectedBuffer {
        /// The buffer.
        what: &'static str,
        /// Its rank.
        rank: usize,
    },
    /// A buffer given for a rank this communicator does not drive (a per-rank [`crate::Comm`]'s
    /// peer): that rank's own caller passes it, and the entry here must be `None`.
    RemoteBuffer {
        /// The buffer.
        what: &'static str,
        /// Its rank.
        rank: usize,
    },
    /// A bounded wait on the device gave up: a peer never arrived or never finished.
    Timeout {
        /// What the CTA was waiting for (a barrier, FIFO space or data, a peer's progress).
        wait: WaitKind,
        /// The waiting rank.
        rank: u32,
        /// The waiting CTA.
        cta: u32,
        /// The rank it waited for.
        peer: u32,
        /// The counter value it waited for.
        expected: u64,
        /// The last value it saw.
        observed: u64,
        /// How many CTAs reported an error in that launch.
        errors: u32,
    },
    /// The engine rejected a task descriptor.
    BadTask {
        /// The rank.
        rank: u32,
        /// The CTA.
        cta: u32,
        /// The task's index in the CTA's list.
        task: u32,
    },
    /// At a barrier a rank met a peer that is already at a later call: the ranks' calls are out of
    /// step (one rank skipped a call, or an earlier call failed on some ranks only). At the start
    /// barrier the CTA stops before its tasks; at the end barrier its tasks have run. `call` and
    /// `peer_call` count that CTA's barriers since the communicator was built or last reset; after
    /// this error `reset` the communicator (it zeroes every rank's counters).
    OutOfStep {
        /// The rank that noticed.
        rank: u32,
        /// Its CTA.
        cta: u32,
        /// The peer already further on.
        peer: u32,
        /// The CTA's barrier count.
        call: u64,
        /// The peer's.
        peer_call: u64,
        /// How many CTAs reported an error in that launch.
        errors: u32,
    },
    /// A CTA stopped because the matching CTA of a peer gave up the same call (that peer's own error
    /// is counted in `errors`, and is the one reported when the two reach the host together). The
    /// call's outputs are partly written; no rank touches another's buffers once its kernel has
    /// ended. `reset` the communicator before the next call.
    PeerAborted {
        /// The rank that stopped.
        rank: u32,
        /// Its CTA.
        cta: u32,
        /// The peer that gave up.
        peer: u32,
        /// The CTA's barrier count (the call).
        call: u64,
        /// How many CTAs reported an error in that launch.
        errors: u32,
    },
    /// Two of the listed devices have no native atomics on each other's memory (PCIe without
    /// them): the collectives' barriers need them to settle a rank's withdrawal from a call.
    NoPeerAtomics {
        /// The device that would access.
        device: usize,
        /// The device whose memory it would access.
        peer: usize,
    },
    /// The communicator or compiled plan is unusable after an earlier device error (call `reset` or
    /// build a new one).
    Poisoned,
    /// `what` cannot run while a rank's stream is capturing a CUDA graph: a call whose plan is not
    /// built yet (its upload would become part of the graph: `prepare` it, or make a reshard's first
    /// call, before the capture), or a wait for or poll of the streams (`synchronize`, `query`,
    /// `reset`, `clear_plans`), which would end the capture.
    Capturing {
        /// The call refused.
        what: &'static str,
    },
    /// A rank's buffer lies in memory another process exported that this rank has not mapped (the
    /// engine found it at the start barrier and moved nothing): a peer used a buffer from an
    /// allocation it freed, or the ranks' communicators disagree.
    Unmapped {
        /// The rank whose CTA found it.
        rank: u32,
        /// Its CTA.
        cta: u32,
        /// The rank the buffer belongs to.
        peer: u32,
        /// The region of that rank's exported memory.
        region: u32,
    },
    /// A peer made another call than this rank (another collective, count, element type, operator,
    /// in-place form or configuration): found at the start barrier, before anything moved.
    /// `reset` the communicator (on every rank) before the next call.
    CallMismatch {
        /// The rank that found it.
        rank: u32,
        /// Its CTA.
        cta: u32,
        /// The peer whose call differs.
        peer: u32,
    },
    /// Setting up or reaching the other ranks failed (the bootstrap, or the exchange of memory
    /// between processes).
    Bootstrap(crate::bootstrap::BootstrapError),
    /// Sharing memory with another process failed: `what` names the step, `rank` the peer (if any).
    PeerMemory {
        /// The step ("export the workspace", "map rank 3's region 2", ...).
        what: String,
        /// Why.
        why: String,
    },
    /// The ranks' communicators were built differently where they must agree (`field`): the value
    /// of `rank` differs from this rank's.
    Mismatch {
        /// What differs ("config", "world", ...).
        field: &'static str,
        /// A rank that disagrees with this one.
        rank: usize,
        /// What each said.
        why: String,
    },
    /// Something the communicator does not do (yet), named.
    Unsupported {
        /// What was asked.
        what: String,
    },
    /// The communicator was aborted ([`crate::Comm::abort`]): build a new one.
    Aborted,
}

impl Error {
    /// Wraps a cudarc driver error from `call` (the driver function's name) as [`Error::Driver`]:
    /// `.map_err(Error::driver("cuMemAlloc"))`.
    pub fn driver(call: &'static str) -> impl FnOnce(DriverError) -> Error {
        move |source| Error::Driver { call, source }
    }

    /// The error a device status record describes, if any.
    pub fn from_status(s: &Status) -> Option<Error> {
        if s.errors == 0 {
            return None;
        }
        Some(match WaitKind::from_raw(s.kind) {
            Some(WaitKind::BadTask) => Error::BadTask { rank: s.rank, cta: s.cta, task: s.peer },
            Some(WaitKind::OutOfStep) => Error::OutOfStep {
                rank: s.rank,
                cta: s.cta,
                peer: s.peer,
                call: s.expected,
                peer_call: s.observed & BARRIER_SEQ,
                errors: s.errors,
            },
            Some(WaitKind::PeerAborted) => {
                Error::PeerAborted { rank: s.rank, cta: s.cta, peer: s.peer, call: s.expected, errors: s.errors }
            }
            Some(WaitKind::Mismatch) => Error::CallMismatch { rank: s.rank, cta: s.cta, peer: s.peer },
            Some(WaitKind::Unmapped) => {
                Error::Unmapped { rank: s.rank, cta: s.cta, peer: s.peer, region: s.expected as u32 }
            }
            Some(wait) => Error::Timeout {
                wait,
                rank: s.rank,
                cta: s.cta,
                peer: s.peer,
                expected: s.expected,
                observed: s.observed,
                errors: s.errors,
            },
            None => Error::BadTask { rank: s.rank, cta: s.cta, task: u32::MAX },
        })
    }
}

/// The value a wait saw, as a barrier flag where it is one: the call count, and what the bits above
/// it say (`arrive` flags: taken by this rank, revoked by the peer; `done` flags: aborted).
fn barrier_flag_text(wait: WaitKind, v: u64) -> String {
    let (high, taken) = match wait {
        WaitKind::StartBarrier => ("revoked", v & BARRIER_TAKEN != 0),
        WaitKind::EndBarrier => ("aborted", false),
        _ => return v.to_string(),
    };
    let tags: Vec<&str> = [(v & (BARRIER_REVOKED | BARRIER_ABORTED) != 0, high), (taken, "taken")]
        .into_iter()
        .filter_map(|(on, tag)| on.then_some(tag))
        .collect();
    match tags.is_empty() {
        true => (v & BARRIER_SEQ).to_string(),
        false => format!("{} ({})", v & BARRIER_SEQ, tags.join(", ")),
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Driver { call, source } => write!(f, "CUDA driver call {call} failed: {source}"),
            Error::KeptDriverError { ordinal, source } => write!(
                f,
                "an earlier CUDA driver call on device {ordinal} failed where cudarc could not report it \
                 (a buffer's stream wait or event, or a free): {source}; found before this call's next \
                 step on that device (a call that launches queued nothing)"
            ),
            Error::UnsupportedDevice { ordinal, major, minor } => {
                write!(f, "device {ordinal} is sm_{major}{minor}; oxccl needs a Hopper GPU (sm_90)")
            }
            Error::RankCount { ranks, max } => write!(f, "{ranks} ranks: a communicator has 1..={max}"),
            Error::NoSuchRank { rank, ranks } => write!(f, "rank {rank}: the communicator has ranks 0..{ranks}"),
            Error::NoSuchSlot { slot, slots } => write!(f, "buffer slot {slot}: a plan has slots 0..{slots}"),
            Error::BufferCount { what, expected, got } => {
                write!(f, "{what}: {got} given, one per rank of {expected} ranks")
            }
            Error::Length { what, rank, expected, got } => {
                write!(f, "{what} of rank {rank}: {got} elements, the call needs {expected}")
            }
            Error::WrongDevice { what, rank, expected, got } => {
                write!(f, "{what} of rank {rank} is on device {got}, the rank is on device {expected}")
            }
            Error::Aliasing { what, rank, buffer, other_rank, other_buffer } => {
                write!(f, "{what}: the {buffer} of rank {rank} overlaps the {other_buffer} of rank {other_rank}")
            }
            Error::Misaligned { what, rank, address, align } => {
                write!(f, "{what} of rank {rank} at {address:#x} is not {align}-byte aligned")
            }
            Error::TooManyCtas { requested, max, why } => {
                write!(f, "{requested} CTAs requested, at most {max} can run: {why}")
            }
            Error::Config { field, why } => write!(f, "{field}: {why}"),
            Error::Plan(e) => write!(f, "plan: {e}"),
            Error::Lowered(e) => write!(f, "lowered program: {e}"),
            Error::Descriptors(e) => write!(f, "compiled plan descriptors: {e}"),
            Error::Reshard(e) => write!(f, "reshard: {e}"),
            Error::ReshardLower(e) => write!(f, "reshard lowering: {e}"),
            Error::MissingBuffer { what, rank, elements } => {
                write!(f, "{what} of rank {rank} is missing: its shard has {elements} elements")
            }
            Error::UnexpectedBuffer { what, rank } => {
                write!(f, "{what} given for rank {rank}, which is outside that side's mesh (pass None)")
            }
            Error::RemoteBuffer { what, rank } => write!(
                f,
                "{what} given for rank {rank}, which this communicator does not drive (that rank's own caller \
                 passes it; pass None)"
            ),
            Error::Timeout { wait, rank, cta, peer, expected, observed, errors } => {
                let what = match wait {
                    WaitKind::StartBarrier => "waiting for peer to reach the collective (start barrier)",
                    WaitKind::EndBarrier => "waiting for peer to finish writing (end barrier)",
                    WaitKind::BulkLoad => "waiting for a bulk load to land in shared memory",
                    WaitKind::BadTask => "bad task",
                    WaitKind::FifoSpace => "waiting for a free FIFO slot (receiver's head)",
                    WaitKind::FifoData => "waiting for FIFO data (sender's tail)",
                    WaitKind::Progress => "waiting for another CTA's progress (sync point)",
                    WaitKind::OutOfStep => "at a barrier (calls out of step)",
                    WaitKind::PeerAborted => "at a barrier (the peer gave up)",
                    WaitKind::Unmapped => "resolving a peer's buffer",
                    WaitKind::Mismatch => "comparing calls with a peer",
                };
                let saw = barrier_flag_text(*wait, *observed);
                write!(
                    f,
                    "timed out {what}: rank {rank} CTA {cta}, peer {peer}, expected {expected}, saw {saw} \
                     ({errors} CTA(s) reported errors)"
                )
            }
            Error::BadTask { rank, cta, task } => {
                write!(f, "the engine rejected task {task} of rank {rank} CTA {cta}")
            }
            Error::OutOfStep { rank, cta, peer, call, peer_call, errors } => write!(
                f,
                "calls out of step: rank {rank} CTA {cta} is at call {call}, peer {peer} already at call \
                 {peer_call} ({errors} CTA(s) reported errors)"
            ),
            Error::PeerAborted { rank, cta, peer, call, errors } => write!(
                f,
                "rank {rank} CTA {cta} stopped call {call}: peer {peer} gave up that call ({errors} CTA(s) reported \
                 errors)"
            ),
            Error::NoPeerAtomics { device, peer } => write!(
                f,
                "device {device} has no native atomics on device {peer}'s memory \
                 (CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED is 0): the collectives need NVLink between their GPUs"
            ),
            Error::Poisoned => write!(f, "a device error was reported earlier; reset the communicator or plan first"),
            Error::Capturing { what } => write!(
                f,
                "{what} while a rank's stream captures a CUDA graph: make the first call of a kind before the \
                 capture (Communicator::prepare builds a collective's plan; a reshard's or CompiledPlan::run's \
                 first call allocates what later calls reuse), and wait, poll or reset outside it"
            ),
            Error::Unmapped { rank, cta, peer, region } => write!(
                f,
                "rank {rank} CTA {cta}: rank {peer}'s buffer lies in its exported region {region}, which rank \
                 {rank} has not mapped (a buffer of a freed allocation, or communicators that disagree)"
            ),
            Error::CallMismatch { rank, cta, peer } => write!(
                f,
                "rank {rank} CTA {cta}: peer {peer} made another call (collective, count, element type, operator \
                 or in-place form differ); nothing was moved"
            ),
            Error::Bootstrap(e) => write!(f, "bootstrap: {e}"),
            Error::PeerMemory { what, why } => write!(f, "sharing memory between processes: {what}: {why}"),
            Error::Mismatch { field, rank, why } => {
                write!(f, "the ranks' communicators disagree on {field}: rank {rank} {why}")
            }
            Error::Unsupported { what } => write!(f, "not supported: {what}"),
            Error::Aborted => write!(f, "the communicator was aborted; build a new one"),
            Error::NoDriver => write!(f, "the CUDA driver library is not installed"),
            Error::NoSuchDevice { ordinal, devices } => {
                write!(f, "no CUDA device {ordinal}: {devices} visible")
            }
        }
    }
}

/// Each message already says its cause (a driver error's text, a plan error's): `source` returns
/// none, so a report that walks the chain (anyhow's `{:#}`) does not print the cause twice. The
/// typed cause stays reachable by matching the variant.
impl std::error::Error for Error {}

impl From<crate::bootstrap::BootstrapError> for Error {
    fn from(e: crate::bootstrap::BootstrapError) -> Self {
        Error::Bootstrap(e)
    }
}

impl From<PlanError> for Error {
    fn from(e: PlanError) -> Self {
        Error::Plan(e)
    }
}

impl From<LoweredError> for Error {
    fn from(e: LoweredError) -> Self {
        Error::Lowered(e)
    }
}

impl From<DescriptorError> for Error {
    fn from(e: DescriptorError) -> Self {
        Error::Descriptors(e)
    }
}

impl From<ReshardError> for Error {
    fn from(e: ReshardError) -> Self {
        Error::Reshard(e)
    }
}

impl From<LowerError> for Error {
    fn from(e: LowerError) -> Self {
        Error::ReshardLower(e)
    }
}
