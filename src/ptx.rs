//! The embedded device code (see `build.rs`).

/// The engine module (`kernels-gpu`), PTX ISA 8.0 for sm_90a: the engine's kernels (`oxccl_run_*`).
pub const KERNELS: &str = include_str!(concat!(env!("OUT_DIR"), "/oxccl_kernels.ptx"));

/// The probe module (`ptx-intrinsics` with its `probes` feature): one kernel per instruction family.
pub const PROBES: &str = include_str!(concat!(env!("OUT_DIR"), "/oxccl_probes.ptx"));

/// [`KERNELS`] as sm_90a machine code (`ptx/oxccl_kernels.sm_90a.cubin`), loaded without
/// compilation; empty where `ptx/cubins.txt` does not vouch for it beside this build's PTX (other PTX,
/// or other code than it records).
pub const KERNELS_SM90A: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/oxccl_kernels.sm_90a.cubin"));

/// The prebuilt modules and their manifest (`ptx/cubins.txt`), as `build.rs` reads them.
pub mod prebuilt {
    include!("prebuilt.rs");
}

/// Where the embedded PTX came from: `"fresh"` (rebuilt from the workspace sources by this build) or
/// `"shipped"` (the committed files under `ptx/`).
pub const SOURCE: &str = env!("OXCCL_PTX_SOURCE");
