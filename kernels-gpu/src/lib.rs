//! `oxccl-kernels`: the device engine.
//!
//! Compiled for `nvptx64-nvidia-cuda` it is the PTX module `oxccl_kernels.ptx` (entry points in
//! `entry`): the collectives, reshard and transfer programs all run on it. Compiled for the host it
//! is only [`abi`], the `#[repr(C)]`
//! descriptors the host lowers plans into, defined once for both sides, and [`lanes`], the
//! operators' integer helpers (tested there).
#![warn(missing_docs)]
#![no_std]
#![cfg_attr(target_arch = "nvptx64", feature(abi_ptx, gpu_launch_sized_workgroup_mem, gpu_intrinsics, core_intrinsics))]
#![cfg_attr(target_arch = "nvptx64", allow(internal_features))]

/// Copies a table from the (by-value) kernel parameter to shared memory with constant indices only:
/// a dynamic index into a kernel parameter would make the compiler copy all of it to local memory.
#[cfg(target_arch = "nvptx64")]
macro_rules! copy_table {
    ($dst:expr, $src:expr, [$($i:literal)+]) => {$(
        *$dst.add($i) = $src[$i];
    )+};
}

/// Runs `body` once for each rank index `q` in `0..MAX_RANKS`, each with `q` a constant: arrays
/// indexed by it stay in registers (a loop the compiler does not unroll would put them in local
/// memory, and every store there would wait for the load that feeds it).
#[cfg(target_arch = "nvptx64")]
macro_rules! per_rank {
    ($q:ident => $body:block) => {
        per_rank!(@ $q $body [0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15])
    };
    (@ $q:ident $body:block [$($i:literal)+]) => {$({
        let $q: usize = $i;
        $body
    })+};
}

pub mod abi;
#[cfg(target_arch = "nvptx64")]
pub mod engine;
#[cfg(target_arch = "nvptx64")]
pub mod entry;
pub mod lanes;

#[cfg(target_arch = "nvptx64")]
#[panic_handler]
fn panic(_: &core::panic::PanicInfo) -> ! {
    oxccl_ptx::sync::trap()
}
