//! Programs a communicator keeps on the device: a lowered program uploaded for every launch group
//! ([`Uploaded`], the collectives' plans and each reshard stage), a reshard's uploaded stages with
//! the key they are cached by, and a transfer program's ([`ProgramRun`], `Communicator::run_program`).

use crate::Communicator;
use crate::config::ReshardOptions;
use crate::engine::DeviceAlloc;
use crate::engine::DeviceProgram;
use crate::engine::LaunchSpec;
use crate::error::Result;
use oxccl_host::lowered::Lowered;
use oxccl_host::lowered::Staged;
use oxccl_host::program::Program;
use oxccl_host::reshard::Layout;
use oxccl_kernels::abi::DType;
use oxccl_kernels::abi::{BUFFER_SLOTS, MAX_RANKS};
use std::hash::{Hash, Hasher};

/// A lowered program uploaded for every launch group of a communicator (each group's slice of the
/// programs, all the tasks).
pub(crate) struct Uploaded {
    /// The program as lowered (barriers dropped when one launch holds every rank).
    pub lowered: Lowered,
    pub(crate) per_group: Vec<DeviceProgram>,
}

/// What a cached reshard is keyed by.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct PlanKey {
    pub(crate) shape: Vec<u64>,
    /// Bytes per element, and the unit the copies move.
    pub(crate) elem_bytes: u64,
    pub(crate) dtype: DType,
    /// How partial sums combine (a `Partial` source; `Sum` for copies).
    pub(crate) op: crate::ReduceOp,
    pub(crate) src: Layout,
    pub(crate) dst: Layout,
    pub(crate) options: ReshardOptions,
    pub(crate) ctas: u32,
}

/// What a program's lowering is cached by: the program (by digest, its ops compared on a hit),
/// its chunk size, element type, operator and CTAs per rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct ProgramKey {
    pub(crate) digest: u64,
    pub(crate) chunk_bytes: u64,
    pub(crate) dtype: DType,
    pub(crate) op: crate::ReduceOp,
    pub(crate) ctas: u32,
}

/// A program lowered and uploaded for this communicator, with each local rank's scratch.
pub(crate) struct ProgramRun {
    pub(crate) program: Program,
    pub(crate) prepared: Prepared,
    /// Scratch per local rank that has any (`cuMemAlloc`, zeroed), freed with the run; none across
    /// processes, where each call's staging memory holds it.
    pub(crate) scratch: Vec<(usize, DeviceAlloc)>,
}

/// A digest of a program: the key its lowerings are cached by (compared in full on a hit).
pub(crate) fn digest(p: &Program) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    let l = &p.layout;
    (&p.name, l.collective, l.ranks, l.chunks, l.in_place, &l.scratch, p.ranks_per_node, &p.ops).hash(&mut h);
    h.finish()
}

/// A staged program uploaded for every launch group ([`crate::Communicator::prepare_staged`]): a
/// reshard, or a transfer program lowered level by level.
pub struct Prepared {
    /// The lowered program (stages, unit and operator, buffer sizes).
    pub lowered: Staged,
    /// CTAs per rank.
    pub ctas: u32,
    /// The stages that have tasks, in launch order.
    pub(crate) stages: Vec<Uploaded>,
    /// What each stage's launch announces to the peers (`LaunchSpec::call_key`): a hash of the
    /// reshard's [`PlanKey`], so that ranks launched apart that made different reshards (or a
    /// reshard and a collective) stop at the start barrier with [`crate::Error::CallMismatch`]; 0 (not
    /// compared) for programs built otherwise.
    pub(crate) call_key: u32,
}

impl Communicator {
    /// The launch of a staged program: its unit's and operator's kernel, a pipeline stage holding
    /// a slot per source its tasks combine.
    pub(crate) fn staged_launch(&self, lowered: &Staged) -> Result<LaunchSpec> {
        self.launch_spec_for(lowered.dtype, lowered.op, lowered.slots(), lowered.combines())
    }

    /// Uploads the stages of a staged program that have tasks, to run with
    /// [`Communicator::launch_prepared`]: a reshard this communicator's planner made, another (the
    /// workarounds of `oxccl_host::reshard::workaround`), or a transfer program lowered level by
    /// level (`oxccl_host::compile::direct`). Its ranks are the communicator's and its CTAs per
    /// rank `ctas`.
    ///
    /// Errors: [`crate::Error::Config`] where the program is not laid out for this communicator: its
    /// ranks or buffer rows are not the communicator's, or a stage's programs are not `ctas` per
    /// rank, rank-major (rank `i / ctas`, CTA `i % ctas`); [`crate::Error::Lowered`] where a task is
    /// malformed or reaches past its buffer's size in `buffer_bytes`.
    pub fn prepare_staged(&self, lowered: Staged, ctas: u32) -> Result<Prepared> {
        let n = self.ranks();
        let c = ctas as usize;
        let bad = |why: String| crate::Error::Config { field: "staged program", why };
        if lowered.buffer_bytes.len() != n {
            return Err(bad(format!(
                "buffer sizes for {} ranks; the communicator has {n}",
                lowered.buffer_bytes.len()
            )));
        }
        for (s, l) in lowered.stages.iter().enumerate() {
            let laid_out = l.ranks == n
                && l.programs.len() == n * c
                && l.programs
                    .iter()
                    .enumerate()
                    .all(|(i, p)| (p.rank as usize, p.cta as usize) == (i / c.max(1), i % c.max(1)));
            if !laid_out {
                return Err(bad(format!(
                    "stage {s}: {} programs of {} ranks, not {ctas} CTAs per rank of {n} ranks in rank-major order",
                    l.programs.len(),
                    l.ranks
                )));
            }
            // Every task inside the buffer sizes the launch's caller promises (its fields are
            // public: a program made by hand is checked as a lowering checks its own).
            oxccl_host::lowered::validate(l, &lowered.buffer_bytes, &[])?;
        }
        let stages = lowered
            .stages
            .iter()
            .filter(|l| !l.tasks.is_empty())
            .map(|l| self.upload(l.clone(), ctas))
            .collect::<Result<_>>()?;
        Ok(Prepared { lowered, ctas, stages, call_key: 0 })
    }

    /// Launches the stages of `prepared` in order on every group, its program's buffers given by address.
    ///
    /// # Safety
    /// `buffers[r][s]` addresses, on rank `r`'s device, a buffer of at least
    /// `prepared.lowered.buffer_bytes[r][s]` bytes wherever that is non-zero, alive and not used by other
    /// work until the launches complete.
    pub unsafe fn launch_prepared(&self, prepared: &Prepared, buffers: [[u64; BUFFER_SLOTS]; MAX_RANKS]) -> Result<()> {
        let launch = LaunchSpec { call_key: prepared.call_key, ..self.staged_launch(&prepared.lowered)? };
        self.check_resident(&launch, prepared.ctas, prepared.lowered.slots())?;
        // SAFETY: the caller's contract; each stage was validated against `buffer_bytes` when prepared.
        // Stream order runs a group's stages one after the other; across groups, a stage's start
        // barrier waits for every rank to have finished the previous stage. All stages are queued
        // under one lock: no other call's launch, nor a reset, comes between them.
        unsafe { self.launch_uploaded(&prepared.stages, &launch, buffers) }
    }
}
