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
//! Calls: the collectives, [`Communicator::reshard`] (M-to-N layout changes, [`reshard`]) and
//! [`Communicator::run_program`] (any transfer program: built-in ResCCL algorithms, MSCCL XML), all
//! on one engine.
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
pub mod config;
mod direct;
pub mod engine;
mod error;
#[cfg(target_os = "linux")]
mod fdpass;
mod fp8;
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
pub use config::{
    COMBINE_DIRECT_MAX_CTAS, Config, DEFAULT_ISSUERS, DEFAULT_LATENCY_BELOW, DEFAULT_STAGING_BYTES, MAX_TIMEOUT,
    auto_pipeline, combining_pipeline,
};
pub use error::{Error, Result};
pub use fp8::{F8E4M3, F8E5M2};
/// The `half` crate, whose `f16` and `bf16` are element types.
pub use half;
/// The host side (`oxccl-host`): the transfer IR, MSCCL import, the ResCCL compiler, the lowering
/// onto the engine, the simulator and the CPU executors; re-exported so one dependency serves.
pub use oxccl_host as host;
pub use oxccl_host::collective::Collective;
pub use oxccl_host::tccl::Reduction;
/// The most ranks a communicator has: one launch addresses every rank's buffers.
pub use oxccl_kernels::abi::MAX_RANKS;
pub use oxccl_kernels::abi::{DType, Mover, RedOp as ReduceOp};
pub use plain::Plain;
pub use rank::{Comm, ExportableBuffer, Group, Registration, SymmetricBuffer};
pub use reshard::ReshardOptions;

/// Element types the collectives move and reduce: `f32`, `f64`, `half::f16`, `half::bf16`,
/// [`F8E4M3`], [`F8E5M2`], `i8`, `u8`, `i32`, `u32`, `i64` and `u64`, with every [`ReduceOp`].
/// Integer sums and products wrap; Avg divides the wrapped integer sum truncating toward zero, and
/// multiplies a float sum by the nearest `1/n` (f32's; f64's for `f64`). FP8 values are combined
/// two at a time in f32 and each result rounded back (nearest even, saturating at the largest
/// finite magnitude), so a sum of many accumulates in FP8. Sealed: the device kernels know these
/// types and no others; copies (AllGather, Broadcast, AllToAll, reshard) take any [`Plain`] type.
///
/// Its engine name (`DTYPE`) and its host-side combine (`combine` on slices, `reduce` on one
/// element, `average`: the device's arithmetic, for references on the CPU) come from the host
/// executor's [`host::exec::Element`], which every element type implements.
pub trait Element: sealed::Sealed + Plain + oxccl_host::exec::Element {}

mod sealed {
    /// Implemented only for the types the kernels reduce.
    pub trait Sealed {}
}

macro_rules! elements {
    ($($t:ty),+ $(,)?) => {$(
        impl sealed::Sealed for $t {}
        impl Element for $t {}
    )+};
}

// Their engine names are the host trait's (`DTYPE`): this list only seals the set.
elements! {
    f32, f64, half::f16, half::bf16, i8, u8, i32, u32, i64, u64, F8E4M3, F8E5M2,
}

/// Evaluates `$body` with `$t` naming the [`Element`] type of the [`DType`] `$dtype`, for code that
/// picks the type at run time (a command-line flag, a generated test case):
/// `oxccl::with_element!(dtype, |T| comm.prepare::<T>(collective, n, op, false))`.
#[macro_export]
macro_rules! with_element {
    ($dtype:expr, |$t:ident| $body:expr) => {
        match $dtype {
            $crate::DType::F32 => {
                type $t = f32;
                $body
            }
            $crate::DType::F64 => {
                type $t = f64;
                $body
            }
            $crate::DType::F16 => {
                type $t = $crate::half::f16;
                $body
            }
            $crate::DType::Bf16 => {
                type $t = $crate::half::bf16;
                $body
            }
            $crate::DType::I8 => {
                type $t = i8;
                $body
            }
            $crate::DType::U8 => {
                type $t = u8;
                $body
            }
            $crate::DType::I32 => {
                type $t = i32;
                $body
            }
            $crate::DType::U32 => {
                type $t = u32;
                $body
            }
            $crate::DType::I64 => {
                type $t = i64;
                $body
            }
            $crate::DType::U64 => {
                type $t = u64;
                $body
            }
            $crate::DType::F8e4m3 => {
                type $t = $crate::F8E4M3;
                $body
            }
            $crate::DType::F8e5m2 => {
                type $t = $crate::F8E5M2;
                $body
            }
        }
    };
}

/// The README's Rust examples, compiled by `cargo test` (not run: they need a GPU).
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeExamples;

/// The usage guide's Rust examples (`docs/USAGE.md`), compiled the same way.
#[cfg(doctest)]
#[doc = include_str!("../docs/USAGE.md")]
struct UsageExamples;
