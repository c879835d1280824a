//! `oxccl-kernels`: the device engine.
//!
//! Compiled for `nvptx64-nvidia-cuda` it is the PTX module `oxccl_kernels.ptx` (entry points in
//! [`entry`]). Compiled for the host it is only [`abi`]: the `#[repr(C)]` descriptors the host lowers
//! plans into, defined once for both sides.
#![no_std]
#![cfg_attr(target_arch = "nvptx64", feature(abi_ptx, gpu_launch_sized_workgroup_mem, gpu_intrinsics, core_intrinsics))]
#![cfg_attr(target_arch = "nvptx64", allow(internal_features))]

pub mod abi;
#[cfg(target_arch = "nvptx64")]
pub mod engine;
#[cfg(target_arch = "nvptx64")]
pub mod entry;

#[cfg(target_arch = "nvptx64")]
#[panic_handler]
fn panic(_: &core::panic::PanicInfo) -> ! {
    oxccl_ptx::sync::trap()
}
