//! Build-script support shared by oxccl's packages (`oxccl` embeds the engine and probe
//! modules, `oxccl-cli` the benchmark kernels): each package's device code is PTX built from the
//! workspace's device crates with the dated nightly, or, where that cannot be done (no workspace
//! sources beside the package, no nightly with `rust-src`), the files the package ships.
//!
//! `OXCCL_PTX_BUILD` selects the source: `auto` (default: fresh when possible, else shipped, with a
//! warning when a fresh build was possible but failed), `fresh` (fail the build if it cannot be
//! rebuilt), `shipped` (never rebuild).

use std::env;
use std::fs;
use std::path::Path;
use std::process::Command;

/// The nightly the device crates are built with; keep in step with `rust-toolchain.toml`.
pub const DEVICE_TOOLCHAIN: &str = "nightly-2026-05-20";

/// Code generation flags for every crate of the device build (core included, through build-std).
pub const DEVICE_RUSTFLAGS: &[&str] = &[
    "-Ctarget-cpu=sm_90a",
    "-Ctarget-feature=+ptx80",
    "-Copt-level=3",
    "-Zunstable-options",
    "-Cpanic=immediate-abort",
    // Functions from other crates (oxccl-ptx, core) must inline into the one emitted module, or they
    // become unresolved `.extern .func` declarations.
    "-Zcross-crate-inline-threshold=always",
];

/// One PTX module: a device crate built with some features.
pub struct Module {
    /// File name in the shipped folder and in `OUT_DIR`.
    pub file: &'static str,
    /// Package directory (relative to the workspace root) and package name.
    pub dir: &'static str,
    /// The package's name.
    pub package: &'static str,
    /// Its features for this module.
    pub features: &'static str,
    /// Cargo target directory under `OUT_DIR`: a package built with two feature sets needs two, since
    /// the newest `.s` of a target directory is taken as the module.
    pub target: &'static str,
}

/// Where the embedded PTX came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// Rebuilt from the workspace's sources by this build.
    Fresh,
    /// Copied from the package's shipped files.
    Shipped,
}

impl Source {
    /// `"fresh"` or `"shipped"`.
    pub fn name(self) -> &'static str {
        match self {
            Source::Fresh => "fresh",
            Source::Shipped => "shipped",
        }
    }
}

/// Writes every module's PTX into `out` (`OUT_DIR`): rebuilt from the device crates under
/// `workspace` when `OXCCL_PTX_BUILD` allows and the sources and the nightly are there, else copied
/// from `shipped`. `watch` names further source folders (relative to `workspace`) the modules build
/// from; `bounds` the launch bounds written after each matching entry's parameters (rustc has no
/// launch-bounds attribute for `ptx-kernel` functions). Prints cargo's rerun directives, and panics,
/// as build scripts report, where nothing usable can be written.
pub fn embed(
    workspace: &Path,
    shipped: &Path,
    out: &Path,
    modules: &[Module],
    watch: &[&str],
    bounds: &[(&str, &str)],
) -> Source {
    println!("cargo:rerun-if-env-changed=OXCCL_PTX_BUILD");
    for m in modules {
        println!("cargo:rerun-if-changed={}", shipped.join(m.file).display());
    }
    let mode = env::var("OXCCL_PTX_BUILD").unwrap_or_else(|_| "auto".into());
    let sources_present = modules.iter().all(|m| workspace.join(m.dir).join("src").is_dir());
    if sources_present {
        let dirs = modules.iter().map(|m| m.dir).chain(watch.iter().copied());
        for dir in dirs {
            println!("cargo:rerun-if-changed={}", workspace.join(dir).join("src").display());
            println!("cargo:rerun-if-changed={}", workspace.join(dir).join("Cargo.toml").display());
        }
        println!("cargo:rerun-if-changed={}", workspace.join("Cargo.lock").display());
    }
    let fresh = match mode.as_str() {
        "shipped" => false,
        "auto" | "fresh" => {
            let attempt = if sources_present {
                device_toolchain_ready().and_then(|()| build_fresh(workspace, out, modules, bounds))
            } else {
                Err("the device crates' sources are not beside this package".into())
            };
            match attempt {
                Ok(()) => true,
                Err(why) if mode == "fresh" => panic!("OXCCL_PTX_BUILD=fresh but the PTX could not be rebuilt: {why}"),
                Err(why) => {
                    if sources_present && why.starts_with("build failed") {
                        println!("cargo:warning=oxccl: using the shipped PTX; rebuilding it failed: {why}");
                    }
                    false
                }
            }
        }
        other => panic!("OXCCL_PTX_BUILD must be auto, fresh or shipped, not {other:?}"),
    };
    if fresh {
        return Source::Fresh;
    }
    for m in modules {
        let file = shipped.join(m.file);
        fs::copy(&file, out.join(m.file))
            .unwrap_or_else(|e| panic!("cannot read the shipped PTX {}: {e}", file.display()));
    }
    Source::Shipped
}

/// Checks that rustup has the dated nightly with `rust-src`, without installing anything.
pub fn device_toolchain_ready() -> Result<(), String> {
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

fn build_fresh(root: &Path, out: &Path, modules: &[Module], bounds: &[(&str, &str)]) -> Result<(), String> {
    for m in modules {
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
        fs::write(&dest, launch_bounds(&ptx, bounds)).map_err(|e| format!("build failed: {e}"))?;
    }
    Ok(())
}

/// Adds each entry's `bounds` after its parameter list.
fn launch_bounds(ptx: &str, bounds: &[(&str, &str)]) -> String {
    let mut out = String::with_capacity(ptx.len() + 1024);
    let mut pending: Option<&str> = None;
    for line in ptx.lines() {
        out.push_str(line);
        out.push('\n');
        if let Some(&(_, bounds)) = bounds.iter().find(|(start, _)| line.starts_with(start)) {
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
