//! Embeds the device code (PTX) into the `oxccl` crate.
//!
//! Two PTX modules come out of the workspace's device crates:
//! - `oxccl_kernels.ptx` from `kernels-gpu` (the engine the library launches), and
//! - `oxccl_probes.ptx` from `ptx-intrinsics` with its `probes` feature (one small kernel per
//!   instruction family, used by the golden-PTX and GPU intrinsic tests).
//!
//! All are committed under `ptx/`, so a crate that depends on `oxccl` builds on stable Rust with no
//! CUDA toolkit and no nightly. When the workspace sources are present and the dated nightly named in
//! `rust-toolchain.toml` (with `rust-src`) is installed, the PTX is rebuilt from source through a nested
//! cargo; `tests/ptx.rs` (`shipped_ptx_equals_a_fresh_build`) then proves the committed files equal the
//! fresh build.
//!
//! `OXCCL_PTX_BUILD` selects the source: `auto` (default: fresh when possible, else shipped, with a
//! warning when a fresh build was possible but failed), `fresh` (fail the build if it cannot be rebuilt),
//! `shipped` (never rebuild).
//!
//! The engine module also ships as sm_90a machine code (`ptx/*.sm_90a.cubin`, made by the
//! `ptxas` that `ptx/cubins.txt` names from the PTX whose hash it records, with the code's own hash),
//! so loading them needs no compilation by the driver. Each is embedded only where the manifest
//! vouches for both: a build whose PTX differs (edited device sources) or whose code file does not
//! match embeds none, with a warning, and the driver compiles the PTX.

use std::env;
use std::fs;
use std::path::{Path, PathBuf};

// The manifest helpers the crate exports as `oxccl::ptx::prebuilt` (some unused here).
#[allow(dead_code)]
mod prebuilt {
    include!("src/prebuilt.rs");
}
use prebuilt::{PREBUILT, vouched};

use oxccl_device_build::Module;

const MODULES: &[Module] = &[
    Module {
        file: "oxccl_kernels.ptx",
        dir: "kernels-gpu",
        package: "oxccl-kernels",
        features: "",
        target: "device-target",
    },
    Module {
        file: "oxccl_probes.ptx",
        dir: "ptx-intrinsics",
        package: "oxccl-ptx",
        features: "probes",
        target: "device-target",
    },
];

fn main() {
    let root = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let out = PathBuf::from(env::var_os("OUT_DIR").expect("OUT_DIR"));
    println!("cargo:rustc-check-cfg=cfg(oxccl_fresh_ptx)");
    let source = oxccl_device_build::embed(&root, &root.join("ptx"), &out, MODULES, &["ptx-intrinsics"], LAUNCH_BOUNDS);
    if source == oxccl_device_build::Source::Fresh {
        println!("cargo:rustc-cfg=oxccl_fresh_ptx");
    }
    println!("cargo:rustc-env=OXCCL_PTX_SOURCE={}", source.name());
    embed_prebuilt(&root, &out);
}

/// Copies each prebuilt module into `OUT_DIR` if `ptx/cubins.txt` records both the hash of the PTX
/// this build embeds and the code's own; otherwise writes an empty file there (no prebuilt code: the
/// driver compiles the PTX), with a warning where shipped code was refused.
fn embed_prebuilt(root: &Path, out: &Path) {
    println!("cargo:rerun-if-changed=ptx/cubins.txt");
    let manifest = fs::read_to_string(root.join("ptx").join("cubins.txt")).unwrap_or_default();
    for (ptx, code) in PREBUILT {
        println!("cargo:rerun-if-changed=ptx/{code}");
        let embedded = fs::read(out.join(ptx)).unwrap_or_else(|e| panic!("no PTX {ptx} in OUT_DIR: {e}"));
        let shipped = fs::read(root.join("ptx").join(code)).unwrap_or_default();
        let bytes = match vouched(&manifest, ptx, &embedded, &shipped) {
            Ok(()) => shipped,
            Err(why) => {
                if !shipped.is_empty() {
                    println!("cargo:warning=oxccl: no prebuilt {code} embedded (the driver compiles the PTX): {why}");
                }
                Vec::new()
            }
        };
        fs::write(out.join(code), bytes).unwrap_or_else(|e| panic!("cannot write {code} to OUT_DIR: {e}"));
    }
}

/// Launch bounds written into the PTX after an entry's parameter list (rustc has no launch-bounds
/// attribute for `ptx-kernel` functions): the SIMT movers' `.maxntid 512` tells ptxas to fit 512
/// threads' registers in one SM (at most 128 per thread), the latency movers' `.maxntid 256` 256
/// threads' (at most 255: the loads of all sources in flight together).
const LAUNCH_BOUNDS: &[(&str, &str)] = &[
    (".visible .entry oxccl_run_simt_", ".maxntid 512, 1, 1"),
    (".visible .entry oxccl_run_latency_", ".maxntid 256, 1, 1"),
];
