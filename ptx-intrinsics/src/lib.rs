//! `oxccl-ptx`: one `#[inline(always)]` wrapper per PTX instruction form used by oxccl.
//!
//! Each wrapper is named after its mnemonic (destination operand first), documents the exact PTX text,
//! the PTX ISA version and minimum `sm` it needs, and carries a `# Safety` contract. Fences, commits and
//! waits are separate wrappers: they are composed one layer up, in the engine (`oxccl-kernels`), where a
//! reader can see them.
//!
//! Address spaces are types: `Shared<T>` is a 32-bit address in the executing CTA's shared window,
//! `Global<T>` a pointer into global memory, an `Mbarrier` can only be named through a
//! `Shared<Mbarrier>`, and a `TensorMap` (a `cp.async.bulk.tensor` descriptor) through a
//! `Global<TensorMap>`.
//!
//! The wrappers exist only when compiling for `nvptx64`; on the host this crate is empty, so calling one
//! from host code is a compile error rather than a silent no-op.
//!
//! | module | instructions |
//! |---|---|
//! | `mbarrier` | `mbarrier.init/inval/arrive/arrive.expect_tx/expect_tx/try_wait.parity`, `fence.mbarrier_init` |
//! | `bulk` | `cp.async.bulk` (global→shared, shared→global; with an L2 `createpolicy` hint), `cp.reduce.async.bulk`, `commit_group`, `wait_group[.read]` |
//! | `tensor` | `cp.async.bulk.tensor.{1..5}d` tile load / store, `cp.reduce.async.bulk.tensor.{1..5}d` add/min/max |
//! | `fence` | `fence.proxy.async{,.shared::cta,.global}`, `fence.acq_rel.{cta,gpu,sys}` |
//! | `memory` | `ld.{relaxed,acquire}.{gpu,sys}`, `st.{relaxed,release}.{gpu,sys}`, `red.release.{gpu,sys}.add`, `atom.add`, `atom.acq_rel.sys.or.b64`, `atom.acq_rel.sys.cas.b64`, vector loads/stores |
//! | `sreg` | `%tid`, `%ntid`, `%ctaid`, `%nctaid`, `%smid`, `%warpid`, `%laneid`, `%dynamic_smem_size`, `%globaltimer`, `%clock64`, `elect.sync` |
//! | `sync` | `barrier.sync`, `barrier.red.or`, `nanosleep`, `trap` |
//! | `arith` | packed `f16x2` / `bf16x2` add, min, max |
//! | `mma` | `cp.async` (16 B, `.cg`), `cp.async.commit_group/wait_group`, `ldmatrix.x4`, `mma.sync` m16n8k16 bf16→f32 |
//! | `wgmma` | `wgmma.fence`, `wgmma.mma_async` m64n256k16 bf16→f32, `wgmma.commit_group/wait_group` |
#![warn(missing_docs)]
#![no_std]
#![cfg_attr(target_arch = "nvptx64", feature(asm_experimental_arch))]
#![cfg_attr(
    all(target_arch = "nvptx64", feature = "probes"),
    feature(abi_ptx, gpu_launch_sized_workgroup_mem, gpu_intrinsics, core_intrinsics)
)]
#![cfg_attr(all(target_arch = "nvptx64", feature = "probes"), allow(internal_features))]

#[cfg(target_arch = "nvptx64")]
pub mod arith;
#[cfg(target_arch = "nvptx64")]
pub mod bulk;
#[cfg(target_arch = "nvptx64")]
pub mod fence;
#[cfg(target_arch = "nvptx64")]
pub mod mbarrier;
#[cfg(target_arch = "nvptx64")]
pub mod memory;
#[cfg(target_arch = "nvptx64")]
pub mod mma;
#[cfg(target_arch = "nvptx64")]
mod space;
#[cfg(target_arch = "nvptx64")]
pub mod sreg;
#[cfg(target_arch = "nvptx64")]
pub mod sync;
#[cfg(target_arch = "nvptx64")]
pub mod tensor;
#[cfg(target_arch = "nvptx64")]
pub mod wgmma;

#[cfg(target_arch = "nvptx64")]
pub use space::{Global, Mbarrier, Shared, TensorMap};

#[cfg(all(target_arch = "nvptx64", feature = "probes"))]
mod probes;

/// The probe module needs a panic handler of its own: it is compiled as the root of its PTX module.
/// (`-Cpanic=immediate-abort` turns every panic into a trap before this is ever reached.)
#[cfg(all(target_arch = "nvptx64", feature = "probes"))]
#[panic_handler]
fn panic(_: &core::panic::PanicInfo) -> ! {
    sync::trap()
}
