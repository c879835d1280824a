//! Embeds the device code (PTX) into the `oxccl` crate.
//!
//! Three PTX modules come out of the workspace's device crates:
//! - `oxccl_kernels.ptx` from `kernels-gpu` (the T-CCL engine the library launches),
//! - `oxccl_plans.ptx` from `kernels-gpu` with its `plans` feature (the compiled-plan kernels), and
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
//! The engine and plan modules also ship as sm_90a machine code (`ptx/*.sm_90a.cubin`, made by the
//! `ptxas` that `ptx/cubins.txt` names from the PTX whose hash it records, with the code's own hash),
//! so loading them needs no compilation by the driver. Each is embedded only where the manifest
//! vouches for both: a build whose PTX differs (edited device sources) or whose code file does not
//! match embeds none, with a warning, and the driver compiles the PTX.

use std::env;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The nightly the device crates are built with; keep in step with `rust-toolchain.toml`.
const DEVICE_TOOLCHAIN: &str = "nightly-2026-05-20";

/// Code generation flags for every crate of the device build (core included, through build-std).
const DEVICE_RUSTFLAGS: &[&str] = &[
    "-Ctarget-cpu=sm_90a",
    "-Ctarget-feature=+ptx80",
    "-Copt-level=3",
    "-Zunstable-options",
    "-Cpanic=immediate-abort",
    // Functions from other crates (oxccl-ptx, core) must inline into the one emitted module, or they
    // become unresolved `.extern .func` declarations.
    "-Zcross-crate-inline-threshold=always",
];

// The manifest helpers the crate exports as `oxccl::ptx::prebuilt` (some unused here).
#[allow(dead_code)]
mod prebuilt {
    include!("src/prebuilt.rs");
}
use prebuilt::{PREBUILT, vouched};

struct Module {
    /// File name under `ptx/` and in `OUT_DIR`.
    file: &'static str,
    /// Package directory (relative to the workspace root) and package name.
    dir: &'static str,
    package: &'static str,
    features: &'static str,
    /// Cargo target directory under `OUT_DIR`: a package built with two feature sets needs two, since
    /// the newest `.s` of a target directory is taken as the module.
    target: &'static str,
}

const MODULES: &[Module] = &[
    Module {
        file: "oxccl_kernels.ptx",
        dir: "kernels-gpu",
        package: "oxccl-kernels",
        features: "",
        target: "device-target",
    },
    Module {
        file: "oxccl_plans.ptx",
        dir: "kernels-gpu",
        package: "oxccl-kernels",
        features: "plans",
        target: "device-target-plans",
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
    println!("cargo:rerun-if-env-changed=OXCCL_PTX_BUILD");
    println!("cargo:rustc-check-cfg=cfg(oxccl_fresh_ptx)");
    for m in MODULES {
        println!("cargo:rerun-if-changed=ptx/{}", m.file);
    }

    let mode = env::var("OXCCL_PTX_BUILD").unwrap_or_else(|_| "auto".into());
    let sources_present = MODULES.iter().all(|m| root.join(m.dir).join("src").is_dir());
    if sources_present {
        for dir in ["kernels-gpu", "ptx-intrinsics"] {
            println!("cargo:rerun-if-changed={dir}/src");
            println!("cargo:rerun-if-changed={dir}/Cargo.toml");
        }
        println!("cargo:rerun-if-changed=Cargo.lock");
    }

    let fresh = match mode.as_str() {
        "shipped" => None,
        "auto" | "fresh" => {
            let attempt = if sources_present {
                device_toolchain_ready().and_then(|()| build_fresh(&root, &out))
            } else {
                Err("the device crates' sources are not beside this package".into())
            };
            match attempt {
                Ok(()) => Some(()),
                Err(why) if mode == "fresh" => panic!("OXCCL_PTX_BUILD=fresh but the PTX could not be rebuilt: {why}"),
                Err(why) => {
                    if sources_present && why.starts_with("build failed") {
                        println!("cargo:warning=oxccl: using the shipped PTX; rebuilding it failed: {why}");
                    }
                    None
                }
            }
        }
        other => panic!("OXCCL_PTX_BUILD must be auto, fresh or shipped, not {other:?}"),
    };

    if fresh.is_some() {
        println!("cargo:rustc-cfg=oxccl_fresh_ptx");
        println!("cargo:rustc-env=OXCCL_PTX_SOURCE=fresh");
    } else {
        for m in MODULES {
            let shipped = root.join("ptx").join(m.file);
            fs::copy(&shipped, out.join(m.file))
                .unwrap_or_else(|e| panic!("cannot read the shipped PTX {}: {e}", shipped.display()));
        }
        println!("cargo:rustc-env=OXCCL_PTX_SOURCE=shipped");
    }
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

/// Checks that rustup has the dated nightly with `rust-src`, without installing anything.
fn device_toolchain_ready() -> Result<(), String> {
    let sysroot = rustup_command()
        .args(["run", DEVICE_TOOLCHAIN, "rustc", "--print", "sysroot"])
        .output()
        .map_err(|e| format!("rustup not usable: {e}"))?;
    if !sysroot.status.success() {
        return Err(format!("toolchain {DEVICE_TOOLCHAIN} is not installed"));
    }
    let sysroot = String::from_utf8_lossy(&sysroot.stdout).trim().to_string();
    let core = Path::new(&sysroot).join("lib/rustlib/src/rust/library/core");
    if !core.is_dir() {
        return Err(format!("toolchain {DEVICE_TOOLCHAIN} lacks the rust-src component"));
    }
    Ok(())
}

/// `rustup` with an environment cleaned of everything the outer cargo set, so that the nested build
/// uses the device toolchain and its own flags (an inherited `RUSTC` or `CARGO_*` makes it use the
/// wrong compiler or wait on the outer build's locks).
fn rustup_command() -> Command {
    let mut cmd = Command::new("rustup");
    for (key, _) in env::vars_os() {
        let k = key.to_string_lossy();
        let inherited_build_var = (k.starts_with("CARGO_") && k != "CARGO_HOME")
            || matches!(
                k.as_ref(),
                "RUSTC"
                    | "RUSTC_WRAPPER"
                    | "RUSTC_WORKSPACE_WRAPPER"
                    | "RUSTDOC"
                    | "RUSTUP_TOOLCHAIN"
                    | "RUSTFLAGS"
                    | "RUSTDOCFLAGS"
                    | "CARGO"
                    | "TARGET"
                    | "HOST"
                    | "OUT_DIR"
                    | "OPT_LEVEL"
                    | "PROFILE"
                    | "DEBUG"
                    | "NUM_JOBS"
                    | "CARGO_MAKEFLAGS"
                    | "MAKEFLAGS"
                    | "MFLAGS"
            );
        if inherited_build_var {
            cmd.env_remove(&key);
        }
    }
    cmd.env("RUSTUP_AUTO_INSTALL", "0");
    cmd
}

fn build_fresh(root: &Path, out: &Path) -> Result<(), String> {
    for m in MODULES {
        let target_dir = out.join(m.target);
        let dest = out.join(m.file);
        let mut cmd = rustup_command();
        cmd.args(["run", DEVICE_TOOLCHAIN, "cargo", "rustc", "--quiet", "--release", "--lib"])
            .arg("--manifest-path")
            .arg(root.join(m.dir).join("Cargo.toml"))
            .args(["-p", m.package, "--target", "nvptx64-nvidia-cuda", "-Zbuild-std=core"])
            .arg("--target-dir")
            .arg(&target_dir);
        if !m.features.is_empty() {
            cmd.args(["--features", m.features]);
        }
        cmd.args(["--", "--emit=asm"]);
        cmd.env("CARGO_ENCODED_RUSTFLAGS", DEVICE_RUSTFLAGS.join("\x1f"));
        let output = cmd.output().map_err(|e| format!("build failed to start: {e}"))?;
        if !output.status.success() {
            return Err(format!("build failed for {}:\n{}", m.package, String::from_utf8_lossy(&output.stderr)));
        }
        // rustc writes `<crate>-<hash>.s` beside the rlib; when cargo finds the crate fresh it does not
        // run rustc, and the file from the last build is still the current one. Take the newest.
        let deps = target_dir.join("nvptx64-nvidia-cuda/release/deps");
        let prefix = format!("{}-", m.package.replace('-', "_"));
        let asm = fs::read_dir(&deps)
            .map_err(|e| format!("build failed: {}: {e}", deps.display()))?
            .filter_map(|e| e.ok())
            .filter(|e| {
                let n = e.file_name().to_string_lossy().into_owned();
                n.starts_with(&prefix) && n.ends_with(".s")
            })
            .max_by_key(|e| e.metadata().and_then(|m| m.modified()).ok())
            .ok_or_else(|| format!("build failed: no {prefix}*.s in {}", deps.display()))?
            .path();
        fs::copy(&asm, &dest).map_err(|e| format!("build failed: {e}"))?;
        let ptx = fs::read_to_string(&dest).map_err(|e| format!("build failed: no PTX at {}: {e}", dest.display()))?;
        if let Some(line) = ptx.lines().find(|l| l.trim_start().starts_with(".extern .func")) {
            return Err(format!("build failed: {} has an unresolved extern: {line}", m.file));
        }
        fs::write(&dest, launch_bounds(&ptx)).map_err(|e| format!("build failed: {e}"))?;
    }
    Ok(())
}

/// Launch bounds written into the PTX after an entry's parameter list (rustc has no launch-bounds
/// attribute for `ptx-kernel` functions): (start of the entry's line, directives).
/// - The SIMT movers: `.maxntid 512` tells ptxas to fit 512 threads' registers in one SM (at most
///   128 per thread).
/// - The overlap benchmark's GEMM (`bench_gemm_bf16`): exactly `gemm_shape::THREADS` (256) threads,
///   a launch error otherwise, and two CTAs per SM, which caps it at 128 registers per thread: its
///   documented footprint does not depend on what the driver's JIT decides.
/// - The warpgroup GEMM (`bench_gemm_wgmma`): exactly `wgmma_shape::THREADS` (256) threads and at
///   most `wgmma_shape::MAX_REGISTERS` (168) registers per thread, so that it leaves room on its SM
///   for a collective's CTA.
const LAUNCH_BOUNDS: &[(&str, &str)] = &[
    (".visible .entry oxccl_run_simt_", ".maxntid 512, 1, 1"),
    (".visible .entry oxccl_plan_simt_", ".maxntid 512, 1, 1"),
    (".visible .entry bench_gemm_bf16(", ".reqntid 256, 1, 1\n.minnctapersm 2"),
    (".visible .entry bench_gemm_wgmma(", ".reqntid 256, 1, 1\n.maxnreg 168"),
];

/// Adds each entry's [`LAUNCH_BOUNDS`] after its parameter list.
fn launch_bounds(ptx: &str) -> String {
    let mut out = String::with_capacity(ptx.len() + 1024);
    let mut pending: Option<&str> = None;
    for line in ptx.lines() {
        out.push_str(line);
        out.push('\n');
        if let Some(&(_, bounds)) = LAUNCH_BOUNDS.iter().find(|(start, _)| line.starts_with(start)) {
            pending = Some(bounds);
        } else if line == ")"
            && let Some(bounds) = pending.take()
        {
            out.push_str(bounds);
            out.push('\n');
        }
    }
    out
}
