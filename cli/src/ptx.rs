//! The embedded benchmark kernels (see `build.rs`).

/// The benchmark module (`bench-kernels`), PTX ISA 8.0 for sm_90a: the overlap benchmark's compute
/// loads (`bench_fma`, `bench_sleep`, `bench_gemm_bf16`, `bench_gemm_wgmma`) and the timed TMA copy
/// (`bench_tma_trace`).
pub const BENCH: &str = include_str!(concat!(env!("OUT_DIR"), "/oxccl_bench.ptx"));

/// Where [`BENCH`] came from: `"fresh"` (rebuilt from the workspace's sources by this build) or
/// `"shipped"` (`ptx/oxccl_bench.ptx`).
pub const SOURCE: &str = env!("OXCCL_BENCH_PTX_SOURCE");
