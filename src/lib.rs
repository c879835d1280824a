//! oxccl: collective communication for NVIDIA Hopper GPUs, in pure Rust.
//!
//! ```no_run
//! use cudarc::driver::CudaContext;
//! use oxccl::{Communicator, Config, ReduceOp};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let stream = CudaContext::new(0)?.default_stream();
//! // Eight virtual ranks on one GPU, each with its own buffers.
//! let comm = Communicator::virtual_ranks(&stream, 8, Config::default())?;
//! let send: Vec<_> = (0..8).map(|r| stream.clone_htod(&vec![r as f32; 1 << 20])).collect::<Result<_, _>>()?;
//! let mut recv: Vec<_> = (0..8).map(|_| stream.alloc_zeros::<f32>(1 << 20)).collect::<Result<_, _>>()?;
//! comm.all_reduce(&send, &mut recv, ReduceOp::Sum)?;
//! comm.synchronize()?;
//! assert_eq!(stream.clone_dtoh(&recv[3])?[0], 28.0);
//! # Ok(()) }
//! ```
//!
//! Calls: the collectives, and [`Communicator::reshard`] (M-to-N layout changes, [`reshard`]).
//! Compiled ResCCL plans (lowered by `oxccl_host::compile::lower`) run through [`compiled`].
//!
//! Layers: [`Communicator`] (ranks, plan cache, calls) → [`engine`] (PTX module, launches, owned device
//! memory) → the device engine in `oxccl-kernels` → the PTX wrappers in `oxccl-ptx`. Plans are built by
//! `oxccl-host`, which also executes them on the CPU.
//!
//! Every misuse (buffer counts and lengths, devices, overlapping buffers, configurations) is a typed
//! [`Error`] naming it, and every device-side wait is bounded ([`Error::Timeout`], never a hang).
//! The `oxccl` command and the benchmarks live in the `oxccl-cli` package, apart from this library.

#![warn(missing_docs)]

pub mod bootstrap;
mod cache;
mod comm;
pub mod compiled;
pub mod config;
pub mod engine;
mod error;
#[cfg(target_os = "linux")]
mod fdpass;
pub mod gate;
pub mod graph;
#[cfg(unix)]
pub mod internode;
mod peer;
mod plain;
mod program;
pub mod ptx;
mod rank;
pub mod reshard;
#[cfg(unix)]
mod staged;
mod vmm;

pub use bootstrap::{Bootstrap, Id, LaunchEnv};
pub use comm::{CallLaunch, Communicator};
pub use config::{COMBINE_DIRECT_MAX_CTAS, Config, DEFAULT_ISSUERS, MAX_TIMEOUT, auto_pipeline, combining_pipeline};
pub use error::{Error, Result};
/// The host side (`oxccl-host`): the transfer IR, MSCCL import, the ResCCL compiler and its lowering
/// for [`compiled::CompiledPlan`], the simulator and the CPU executor; re-exported so one dependency
/// serves.
pub use oxccl_host as host;
pub use oxccl_host::tccl::{Collective, Reduction};
/// The most ranks a communicator (or a compiled plan) has: one launch addresses every rank's buffers.
pub use oxccl_kernels::abi::MAX_RANKS;
pub use oxccl_kernels::abi::{DType, Mover, RedOp as ReduceOp};
pub use plain::Plain;
pub use rank::{Comm, SymmetricBuffer};
pub use reshard::ReshardOptions;

/// Element types the collectives move and reduce: `f32`, `half::f16`, `half::bf16`, `i32` and `u32`.
/// Sealed: the device kernels know these five and no others.
pub trait Element: sealed::Sealed + Plain + 'static {
    /// The engine's name for the type.
    const DTYPE: DType;
}

mod sealed {
    /// Implemented only for the types the kernels move.
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::f16 {}
    impl Sealed for half::bf16 {}
    impl Sealed for i32 {}
    impl Sealed for u32 {}
    impl Sealed for u8 {}
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
}
impl Element for half::f16 {
    const DTYPE: DType = DType::F16;
}
impl Element for half::bf16 {
    const DTYPE: DType = DType::Bf16;
}
impl Element for i32 {
    const DTYPE: DType = DType::I32;
}
impl Element for u32 {
    const DTYPE: DType = DType::U32;
}
/// Sums wrap; Min, Max, Prod and Avg have no kernel yet ([`Error::Unsupported`]).
impl Element for u8 {
    const DTYPE: DType = DType::U8;
}

/// The README's Rust examples, compiled by `cargo test` (not run: they need a GPU).
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeExamples;

/// The usage guide's Rust examples (`docs/USAGE.md`), compiled the same way.
#[cfg(doctest)]
#[doc = include_str!("../docs/USAGE.md")]
struct UsageExamples;
