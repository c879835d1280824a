//! Errors: every misuse and every device failure is a value naming what was wrong.

use cudarc::driver::DriverError;
use oxccl_host::lowered::LoweredError;
use oxccl_host::reshard::{LowerError, ReshardError};
use oxccl_host::tccl::PlanError;
use oxccl_kernels::abi::{BARRIER_ABORTED, BARRIER_REVOKED, BARRIER_SEQ, BARRIER_TAKEN, Status, WaitKind};

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
///
/// Where a variant wraps another error (a driver error, a planner's, the bootstrap's),
/// [`source`](std::error::Error::source) returns it, and the message also ends with its text, so
/// printing the error alone says the whole story.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A CUDA driver call failed.
    #[error("CUDA driver call {call} failed: {source}")]
    Driver {
        /// The driver function (`cuLaunchKernel`, ...).
        call: &'static str,
        /// The driver's error.
        source: DriverError,
    },
    /// A CUDA driver call that cudarc could not report at once failed earlier (a buffer guard's
    /// stream wait or event record, a free: cudarc keeps the error for the `CudaContext`), and a call
    /// found it before its next step on that context: a call that launches (a collective, a reshard,
    /// a transfer program) before queueing any launch, so it did nothing; a wait (`synchronize`,
    /// `query`, `reset`, `clear_plans`) before that stream's wait, so call it again.
    #[error(
        "an earlier CUDA driver call on device {ordinal} failed where cudarc could not report it \
             (a buffer's stream wait or event, or a free): {source}; found before this call's next \
             step on that device (a call that launches queued nothing)"
    )]
    KeptDriverError {
        /// The ordinal of the device whose context kept the error.
        ordinal: usize,
        /// The driver's error.
        source: DriverError,
    },
    /// The CUDA driver library is not installed (no GPU can be used).
    #[error("the CUDA driver library is not installed")]
    NoDriver,
    /// A device number at or above the number of CUDA devices.
    #[error("no CUDA device {ordinal}: {devices} visible")]
    NoSuchDevice {
        /// The device asked for.
        ordinal: usize,
        /// How many devices the driver sees.
        devices: usize,
    },
    /// The device is not a Hopper (sm_90) GPU.
    #[error("device {ordinal} is sm_{major}{minor}; oxccl needs a Hopper GPU (sm_90)")]
    UnsupportedDevice {
        /// The device.
        ordinal: usize,
        /// Its compute capability's major number.
        major: i32,
        /// Its compute capability's minor number.
        minor: i32,
    },
    /// The communicator was built with no ranks, or more than one launch can address.
    #[error("{ranks} ranks: a communicator has 1..={max}")]
    RankCount {
        /// The ranks asked for.
        ranks: usize,
        /// The most a communicator has ([`crate::MAX_RANKS`]).
        max: usize,
    },
    /// A rank index at or above the communicator's rank count.
    #[error("rank {rank}: the communicator has ranks 0..{ranks}")]
    NoSuchRank {
        /// The index given.
        rank: usize,
        /// The communicator's (or plan's) rank count.
        ranks: usize,
    },
    /// A buffer slot index outside the plan's slots.
    #[error("buffer slot {slot}: a plan has slots 0..{slots}")]
    NoSuchSlot {
        /// The index given.
        slot: usize,
        /// The slots a plan has.
        slots: usize,
    },
    /// A list passed one entry per rank (buffers, streams, buffer tables) with another length than the ranks.
    #[error("{what}: {got} given, one per rank of {expected} ranks")]
    BufferCount {
        /// The list.
        what: &'static str,
        /// Entries needed: the ranks.
        expected: usize,
        /// Entries given.
        got: usize,
    },
    /// A rank's buffer has the wrong number of elements.
    #[error("{what} of rank {rank}: {got} elements, the call needs {expected}")]
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
    #[error("{what} of rank {rank} is on device {got}, the rank is on device {expected}")]
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
    #[error("{what}: the {buffer} of rank {rank} overlaps the {other_buffer} of rank {other_rank}")]
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
    #[error("{what} of rank {rank} at {address:#x} is not {align}-byte aligned")]
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
    #[error("{requested} CTAs requested, at most {max} can run: {why}")]
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
    #[error("{field}: {why}")]
    Config {
        /// The setting (a `Config` field, or what a call was given).
        field: &'static str,
        /// What is wrong with it and what would be accepted.
        why: String,
    },
    /// The planner rejected the call.
    #[error("plan: {0}")]
    Plan(#[from] PlanError),
    /// A lowered program failed validation.
    #[error("lowered program: {0}")]
    Lowered(#[from] LoweredError),
    /// A reshard's layouts do not fit the tensor or the communicator, or its two sides disagree
    /// (`ReshardError::Src` / `Dst` name the side).
    #[error("reshard: {0}")]
    Reshard(#[from] ReshardError),
    /// A reshard plan cannot be lowered for the engine (too many tasks, no copy unit, ...).
    #[error("reshard lowering: {0}")]
    ReshardLower(#[from] LowerError),
    /// A rank whose shard holds data passed no buffer for that side of a reshard.
    #[error("{what} of rank {rank} is missing: its shard has {elements} elements")]
    MissingBuffer {
        /// The buffer.
        what: &'static str,
        /// Its rank.
        rank: usize,
        /// Elements it would hold.
        elements: u64,
    },
    /// A rank outside a side's mesh passed a buffer for that side of a reshard.
    #[error("{what} given for rank {rank}, which is outside that side's mesh (pass None)")]
    UnexpectedBuffer {
        /// The buffer.
        what: &'static str,
        /// Its rank.
        rank: usize,
    },
    /// A buffer given for a rank this communicator does not drive (a per-rank [`crate::Comm`]'s
    /// peer): that rank's own caller passes it, and the entry here must be `None`.
    #[error(
        "{what} given for rank {rank}, which this communicator does not drive (that rank's own caller \
         passes it; pass None)"
    )]
    RemoteBuffer {
        /// The buffer.
        what: &'static str,
        /// Its rank.
        rank: usize,
    },
    /// A bounded wait on the device gave up: a peer never arrived or never finished.
    #[error(
        "timed out {}: rank {rank} CTA {cta}, peer {peer}, expected {expected}, saw {} \
         ({errors} CTA(s) reported errors)",
        wait_text(.wait),
        barrier_flag_text(.wait, .observed)
    )]
    Timeout {
        /// What the CTA was waiting for (a barrier, a bulk load, a peer's call).
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
    #[error("the engine rejected task {task} of rank {rank} CTA {cta}")]
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
    #[error(
        "calls out of step: rank {rank} CTA {cta} is at call {call}, peer {peer} already at call \
         {peer_call} ({errors} CTA(s) reported errors)"
    )]
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
    /// A CTA stopped at a call's start barrier because a peer has left the communicator (its
    /// host aborted it, dropped it, or dropped it after an error): that peer makes no more calls.
    /// Nothing was moved. Build a new communicator to go on.
    #[error("rank {rank} CTA {cta} stopped call {call}: peer {peer} left the communicator (aborted or dropped it)")]
    Withdrawn {
        /// The rank that stopped.
        rank: u32,
        /// Its CTA.
        cta: u32,
        /// The peer that left.
        peer: u32,
        /// The CTA's barrier count (the call).
        call: u64,
    },
    /// A CTA stopped because the matching CTA of a peer gave up the same call (that peer's own error
    /// is counted in `errors`, and is the one reported when the two reach the host together). The
    /// call's outputs are partly written; no rank touches another's buffers once its kernel has
    /// ended. `reset` the communicator before the next call.
    #[error(
        "rank {rank} CTA {cta} stopped call {call}: peer {peer} gave up that call ({errors} CTA(s) reported \
         errors)"
    )]
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
    #[error(
        "device {device} has no native atomics on device {peer}'s memory \
         (CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED is 0): the collectives need NVLink between their GPUs"
    )]
    NoPeerAtomics {
        /// The device that would access.
        device: usize,
        /// The device whose memory it would access.
        peer: usize,
    },
    /// The communicator is unusable after an earlier device error (call `reset` or build a new
    /// one).
    #[error("a device error was reported earlier; reset the communicator first")]
    Poisoned,
    /// `what` cannot run while a rank's stream is capturing a CUDA graph: a call whose plan is not
    /// built yet (its upload would become part of the graph: `prepare` it, or make a reshard's first
    /// call, before the capture), or a wait for or poll of the streams (`synchronize`, `query`,
    /// `reset`, `clear_plans`), which would end the capture.
    #[error(
        "{what} while a rank's stream captures a CUDA graph: make the first call of a kind before the \
         capture (Communicator::prepare builds a collective's plan; a reshard's or run_program's \
         first call allocates what later calls reuse), and wait, poll or reset outside it"
    )]
    Capturing {
        /// The call refused.
        what: &'static str,
    },
    /// A rank's buffer lies in memory another process exported that this rank has not mapped (the
    /// engine found it at the start barrier and moved nothing): a peer used a buffer from an
    /// allocation it freed, or the ranks' communicators disagree.
    #[error(
        "rank {rank} CTA {cta}: rank {peer}'s buffer lies in its exported region {region}, which rank \
         {rank} has not mapped (a buffer of a freed allocation, or communicators that disagree)"
    )]
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
    #[error(
        "rank {rank} CTA {cta}: peer {peer} made another call (collective, count, element type, operator \
         or in-place form differ); nothing was moved"
    )]
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
    #[error("bootstrap: {0}")]
    Bootstrap(#[from] crate::bootstrap::BootstrapError),
    /// Sharing memory with another process failed: `what` names the step, `rank` the peer (if any).
    #[error("sharing memory between processes: {what}: {why}")]
    PeerMemory {
        /// The step ("export the workspace", "map rank 3's region 2", ...).
        what: String,
        /// Why.
        why: String,
    },
    /// The ranks' communicators were built differently where they must agree (`field`): the value
    /// of `rank` differs from this rank's.
    #[error("the ranks' communicators disagree on {field}: rank {rank} {why}")]
    Mismatch {
        /// What differs ("config", "world", ...).
        field: &'static str,
        /// A rank that disagrees with this one.
        rank: usize,
        /// What each said.
        why: String,
    },
    /// Something the communicator does not do (yet), named.
    #[error("not supported: {what}")]
    Unsupported {
        /// What was asked.
        what: String,
    },
    /// The communicator was aborted ([`crate::Comm::abort`]): build a new one.
    #[error("the communicator was aborted; build a new one")]
    Aborted,
    /// The ranks do not form nodes a staged collective can run on.
    #[error(transparent)]
    Nodes(#[from] oxccl_host::nodes::NodeError),
    /// NCCL could not be loaded: every name tried, and why each failed.
    #[error("NCCL could not be loaded (tried {}): {why}; set OXCCL_NCCL to libnccl.so.2's path", tried.join(", "))]
    NoNccl {
        /// The names and paths tried, in order.
        tried: Vec<String>,
        /// Why each failed.
        why: String,
    },
    /// The inter-node engine failed in `call`.
    #[error("inter-node {call}: {why}")]
    InterNode {
        /// The engine's function (`ncclAllReduce`, ...).
        call: &'static str,
        /// Its error.
        why: String,
    },
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
            Some(WaitKind::Withdrawn) => Error::Withdrawn { rank: s.rank, cta: s.cta, peer: s.peer, call: s.expected },
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

/// What a CTA was doing when its bounded wait gave up.
fn wait_text(wait: &WaitKind) -> &'static str {
    match wait {
        WaitKind::StartBarrier => "waiting for peer to reach the collective (start barrier)",
        WaitKind::EndBarrier => "waiting for peer to finish writing (end barrier)",
        WaitKind::BulkLoad => "waiting for a bulk load to land in shared memory",
        WaitKind::BadTask => "bad task",
        WaitKind::OutOfStep => "at a barrier (calls out of step)",
        WaitKind::PeerAborted => "at a barrier (the peer gave up)",
        WaitKind::Unmapped => "resolving a peer's buffer",
        WaitKind::Mismatch => "comparing calls with a peer",
        WaitKind::Withdrawn => "at the start barrier (the peer left the communicator)",
    }
}

/// The value a wait saw, as a barrier flag where it is one: the call count, and what the bits above
/// it say (`arrive` flags: taken by this rank, revoked by the peer; `done` flags: aborted).
fn barrier_flag_text(wait: &WaitKind, &v: &u64) -> String {
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
