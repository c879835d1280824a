//! `oxccl-bench-kernels`: the device kernels of `oxccl bench` (compiled to their own PTX module,
//! which the `oxccl` command embeds), apart from the library's engine and from the instruction
//! wrappers of `oxccl-ptx`.
//!
//! [`gemm_shape`] and [`wgmma_shape`] hold the shapes of the two tensor-core GEMMs, and
//! [`trace_layout`] the layout of the timed TMA copy's shared memory and trace: these exist on every
//! target and are shared with the host that launches the kernels. The kernels themselves exist only
//! when compiling for `nvptx64`.
#![warn(missing_docs)]
#![no_std]
#![cfg_attr(
    target_arch = "nvptx64",
    feature(abi_ptx, asm_experimental_arch, gpu_launch_sized_workgroup_mem, gpu_intrinsics, core_intrinsics)
)]
#![cfg_attr(target_arch = "nvptx64", allow(internal_features))]

pub mod gemm_shape;
pub mod trace_layout;
pub mod wgmma_shape;

#[cfg(target_arch = "nvptx64")]
mod kernels;

/// The module needs a panic handler of its own: it is compiled as the root of its PTX module.
/// (`-Cpanic=immediate-abort` turns every panic into a trap before this is ever reached.)
#[cfg(target_arch = "nvptx64")]
#[panic_handler]
fn panic(_: &core::panic::PanicInfo) -> ! {
    oxccl_ptx::sync::trap()
}
