//! Embeds the benchmark kernels (`bench-kernels`, PTX) into the `oxccl` command: rebuilt from the
//! workspace's sources with the dated nightly where they are beside this package, else the shipped
//! `ptx/oxccl_bench.ptx` (see `oxccl-device-build` and `OXCCL_PTX_BUILD`).

use oxccl_device_build::Module;
use std::env;
use std::path::PathBuf;

const MODULES: &[Module] = &[Module {
    file: "oxccl_bench.ptx",
    dir: "bench-kernels",
    package: "oxccl-bench-kernels",
    features: "",
    target: "device-target-bench",
}];

/// Launch bounds written into the PTX after an entry's parameter list:
/// - the overlap benchmark's GEMM (`bench_gemm_bf16`): exactly `gemm_shape::THREADS` (256) threads,
///   a launch error otherwise, and two CTAs per SM, which caps it at 128 registers per thread: its
///   documented footprint does not depend on what the driver's JIT decides;
/// - the warpgroup GEMM (`bench_gemm_wgmma`): exactly `wgmma_shape::THREADS` (256) threads and at
///   most `wgmma_shape::MAX_REGISTERS` (168) registers per thread, so that it leaves room on its SM
///   for a collective's CTA.
const LAUNCH_BOUNDS: &[(&str, &str)] = &[
    (".visible .entry bench_gemm_bf16(", ".reqntid 256, 1, 1\n.minnctapersm 2"),
    (".visible .entry bench_gemm_wgmma(", ".reqntid 256, 1, 1\n.maxnreg 168"),
];

fn main() {
    let package = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let out = PathBuf::from(env::var_os("OUT_DIR").expect("OUT_DIR"));
    // The workspace root, where the device crates are when this package is built in its workspace.
    let workspace = package.parent().map(PathBuf::from).unwrap_or_else(|| package.clone());
    let source =
        oxccl_device_build::embed(&workspace, &package.join("ptx"), &out, MODULES, &["ptx-intrinsics"], LAUNCH_BOUNDS);
    println!("cargo:rustc-env=OXCCL_BENCH_PTX_SOURCE={}", source.name());
}
