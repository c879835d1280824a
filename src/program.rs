//! Programs a communicator keeps on the device: a lowered program uploaded for every launch group
//! ([`Uploaded`], the collectives' plans and each reshard stage), and a reshard's uploaded stages
//! with the key they are cached by.

use crate::config::ReshardOptions;
use crate::engine::DeviceProgram;
use cudarc::driver::CudaEvent;
use oxccl_host::lowered::Lowered;
use oxccl_host::reshard::{Layout, LoweredReshard};
use oxccl_kernels::abi::DType;

/// A lowered program uploaded for every launch group of a communicator (each group's slice of the
/// programs, all the tasks).
pub(crate) struct Uploaded {
    /// The program as lowered (barriers dropped when one launch holds every rank).
    pub lowered: Lowered,
    pub(crate) per_group: Vec<DeviceProgram>,
    /// Recorded on each group's stream after its upload: complete once the tables are in place.
    pub(crate) uploaded: Vec<CudaEvent>,
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

/// A lowered reshard program uploaded for every launch group ([`crate::Communicator::prepare_reshard`]).
pub struct Prepared {
    /// The lowered program (stages, copy unit, buffer sizes).
    pub lowered: LoweredReshard,
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
