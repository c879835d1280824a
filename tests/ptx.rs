//! Golden PTX: every `oxccl-ptx` wrapper's instruction appears in its probe kernel; every module
//! assembles with `ptxas -arch=sm_90a`; no unresolved externs; the engine's kernels exist with their
//! launch bounds; the shipped PTX equals a fresh build.

mod common;

use oxccl::engine::abi;
use std::process::Command;

/// (wrapper, probe kernel, exact instruction text the wrapper emits). In the text `#` stands for
/// one or more decimal digits (a register number), so a row can name every operand of its form.
const GOLDEN: &[(&str, &str, &str)] = &[
    ("mbarrier_init_shared_b64", "probe_mbarrier", "mbarrier.init.shared::cta.b64 ["),
    ("mbarrier_inval_shared_b64", "probe_mbarrier", "mbarrier.inval.shared::cta.b64 ["),
    ("mbarrier_arrive_shared_b64", "probe_mbarrier", "mbarrier.arrive.shared::cta.b64 %rd"),
    ("mbarrier_arrive_expect_tx_shared_b64", "probe_mbarrier", "mbarrier.arrive.expect_tx.shared::cta.b64 %rd"),
    ("mbarrier_expect_tx_relaxed_cta_shared_b64", "probe_mbarrier", "mbarrier.expect_tx.relaxed.cta.shared::cta.b64 ["),
    // The plain form ends after the parity operand; the suspend form has the time hint after it.
    (
        "mbarrier_try_wait_parity_shared_b64",
        "probe_mbarrier",
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%r#], %r#;",
    ),
    (
        "mbarrier_try_wait_parity_suspend_shared_b64",
        "probe_mbarrier",
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%r#], %r#, %r#;",
    ),
    ("fence_mbarrier_init_release_cluster", "probe_mbarrier", "fence.mbarrier_init.release.cluster;"),
    (
        "cp_async_bulk_shared_global_mbarrier",
        "probe_bulk_copy",
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [",
    ),
    ("cp_async_bulk_global_shared_bulk_group", "probe_bulk_copy", "cp.async.bulk.global.shared::cta.bulk_group ["),
    ("cp_async_bulk_commit_group", "probe_bulk_copy", "cp.async.bulk.commit_group;"),
    ("createpolicy_fractional_l2_evict_first", "bench_tma_trace", "createpolicy.fractional.L2::evict_first.b64 %rd"),
    (
        "cp_async_bulk_shared_global_mbarrier_hint",
        "bench_tma_trace",
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [",
    ),
    (
        "cp_async_bulk_global_shared_bulk_group_hint",
        "bench_tma_trace",
        "cp.async.bulk.global.shared::cta.bulk_group.L2::cache_hint [",
    ),
    ("cp_async_bulk_wait_group", "probe_bulk_copy", "cp.async.bulk.wait_group 0;"),
    ("cp_async_bulk_wait_group_read", "probe_bulk_copy", "cp.async.bulk.wait_group.read 0;"),
    ("cp_async_bulk_wait_group_read_at_most", "bench_tma_trace", "cp.async.bulk.wait_group.read 7;"),
    (
        "cp_reduce_async_bulk_global_shared_add_f32",
        "probe_reduce_add_f32",
        "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [",
    ),
    (
        "cp_reduce_async_bulk_global_shared_add_f64",
        "probe_reduce_add_f64",
        "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f64 [",
    ),
    (
        "cp_reduce_async_bulk_global_shared_add_noftz_f16",
        "probe_reduce_add_f16",
        "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.noftz.f16 [",
    ),
    (
        "cp_reduce_async_bulk_global_shared_add_noftz_bf16",
        "probe_reduce_add_bf16",
        "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.noftz.bf16 [",
    ),
    (
        "cp_reduce_async_bulk_global_shared_add_u32",
        "probe_reduce_add_u32",
        "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.u32 [",
    ),
    (
        "cp_reduce_async_bulk_global_shared_add_s32",
        "probe_reduce_add_s32",
        "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.s32 [",
    ),
    (
        "cp_reduce_async_bulk_global_shared_add_u64",
        "probe_reduce_add_u64",
        "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.u64 [",
    ),
    (
        "cp_reduce_async_bulk_global_shared_min_u32",
        "probe_reduce_min_u32",
        "cp.reduce.async.bulk.global.shared::cta.bulk_group.min.u32 [",
    ),
    (
        "cp_reduce_async_bulk_global_shared_min_s32",
        "probe_reduce_min_s32",
        "cp.reduce.async.bulk.global.shared::cta.bulk_group.min.s32 [",
    ),
    (
        "cp_reduce_async_bulk_global_shared_min_u64",
        "probe_reduce_min_u64",
        "cp.reduce.async.bulk.global.shared::cta.bulk_group.min.u64 [",
    ),
    (
        "cp_reduce_async_bulk_global_shared_min_s64",
        "probe_reduce_min_s64",
        "cp.reduce.async.bulk.global.shared::cta.bulk_group.min.s64 [",
    ),
    (
        "cp_reduce_async_bulk_global_shared_min_f16",
        "probe_reduce_min_f16",
        "cp.reduce.async.bulk.global.shared::cta.bulk_group.min.f16 [",
    ),
    (
        "cp_reduce_async_bulk_global_shared_min_bf16",
        "probe_reduce_min_bf16",
        "cp.reduce.async.bulk.global.shared::cta.bulk_group.min.bf16 [",
    ),
    (
        "cp_reduce_async_bulk_global_shared_max_u32",
        "probe_reduce_max_u32",
        "cp.reduce.async.bulk.global.shared::cta.bulk_group.max.u32 [",
    ),
    (
        "cp_reduce_async_bulk_global_shared_max_s32",
        "probe_reduce_max_s32",
        "cp.reduce.async.bulk.global.shared::cta.bulk_group.max.s32 [",
    ),
    (
        "cp_reduce_async_bulk_global_shared_max_u64",
        "probe_reduce_max_u64",
        "cp.reduce.async.bulk.global.shared::cta.bulk_group.max.u64 [",
    ),
    (
        "cp_reduce_async_bulk_global_shared_max_s64",
        "probe_reduce_max_s64",
        "cp.reduce.async.bulk.global.shared::cta.bulk_group.max.s64 [",
    ),
    (
        "cp_reduce_async_bulk_global_shared_max_f16",
        "probe_reduce_max_f16",
        "cp.reduce.async.bulk.global.shared::cta.bulk_group.max.f16 [",
    ),
    (
        "cp_reduce_async_bulk_global_shared_max_bf16",
        "probe_reduce_max_bf16",
        "cp.reduce.async.bulk.global.shared::cta.bulk_group.max.bf16 [",
    ),
    ("fence_proxy_async", "probe_sync", "fence.proxy.async;"),
    ("fence_proxy_async_shared_cta", "probe_sync", "fence.proxy.async.shared::cta;"),
    ("fence_proxy_async_global", "probe_sync", "fence.proxy.async.global;"),
    ("fence_acq_rel_cta", "probe_sync", "fence.acq_rel.cta;"),
    ("fence_acq_rel_gpu", "probe_sync", "fence.acq_rel.gpu;"),
    ("fence_acq_rel_sys", "probe_sync", "fence.acq_rel.sys;"),
    ("bar_sync", "probe_sync", "barrier.sync %r"),
    ("bar_sync_all", "probe_sync", "barrier.sync 0;"),
    ("bar_red_or_all", "probe_sync", "barrier.red.or.pred"),
    ("nanosleep_u32", "probe_sync", "nanosleep.u32 %r"),
    ("griddepcontrol_wait", "probe_sync", "griddepcontrol.wait;"),
    ("griddepcontrol_launch_dependents", "probe_sync", "griddepcontrol.launch_dependents;"),
    ("ld_relaxed_gpu_u32", "probe_memory", "ld.relaxed.gpu.global.u32 %r"),
    ("ld_relaxed_gpu_u64", "probe_memory", "ld.relaxed.gpu.global.u64 %rd"),
    ("ld_relaxed_sys_u32", "probe_memory", "ld.relaxed.sys.global.u32 %r"),
    ("ld_relaxed_sys_u64", "probe_memory", "ld.relaxed.sys.global.u64 %rd"),
    ("ld_acquire_gpu_u32", "probe_memory", "ld.acquire.gpu.global.u32 %r"),
    ("ld_acquire_gpu_u64", "probe_memory", "ld.acquire.gpu.global.u64 %rd"),
    ("ld_acquire_sys_u32", "probe_memory", "ld.acquire.sys.global.u32 %r"),
    ("ld_acquire_sys_u64", "probe_memory", "ld.acquire.sys.global.u64 %rd"),
    ("st_relaxed_gpu_u32", "probe_memory", "st.relaxed.gpu.global.u32 ["),
    ("st_relaxed_gpu_u64", "probe_memory", "st.relaxed.gpu.global.u64 ["),
    ("st_relaxed_sys_u32", "probe_memory", "st.relaxed.sys.global.u32 ["),
    ("st_relaxed_sys_u64", "probe_memory", "st.relaxed.sys.global.u64 ["),
    ("st_release_gpu_u32", "probe_memory", "st.release.gpu.global.u32 ["),
    ("st_release_gpu_u64", "probe_memory", "st.release.gpu.global.u64 ["),
    ("st_release_sys_u32", "probe_memory", "st.release.sys.global.u32 ["),
    ("st_release_sys_u64", "probe_memory", "st.release.sys.global.u64 ["),
    ("red_release_gpu_add_u32", "probe_memory", "red.release.gpu.global.add.u32 ["),
    ("red_release_gpu_add_u64", "probe_memory", "red.release.gpu.global.add.u64 ["),
    ("red_release_sys_add_u32", "probe_memory", "red.release.sys.global.add.u32 ["),
    ("red_release_sys_add_u64", "probe_memory", "red.release.sys.global.add.u64 ["),
    ("atom_relaxed_gpu_add_u32", "probe_memory", "atom.relaxed.gpu.global.add.u32 %r"),
    ("atom_relaxed_gpu_add_u64", "probe_memory", "atom.relaxed.gpu.global.add.u64 %rd"),
    ("atom_acq_rel_sys_add_u32", "probe_memory", "atom.acq_rel.sys.global.add.u32 %r"),
    ("atom_acq_rel_sys_or_b64", "probe_memory", "atom.acq_rel.sys.global.or.b64 %rd"),
    ("atom_acq_rel_gpu_or_b64", "probe_memory", "atom.acq_rel.gpu.global.or.b64 %rd"),
    ("atom_acq_rel_sys_cas_b64", "probe_memory", "atom.acq_rel.sys.global.cas.b64 %rd"),
    ("atom_relaxed_sys_cas_b64", "probe_memory", "atom.relaxed.sys.global.cas.b64 %rd"),
    ("atom_relaxed_gpu_cas_b64", "probe_memory", "atom.relaxed.gpu.global.cas.b64 %rd"),
    ("ld_global_v4_u32", "probe_vector", "ld.global.v4.u32 {%r"),
    ("st_global_v4_u32", "probe_vector", "st.global.v4.u32 [%rd"),
    ("ld_shared_v4_u32", "probe_vector", "ld.shared.v4.u32 {%r"),
    ("st_shared_v4_u32", "probe_vector", "st.shared.v4.u32 [%r"),
    ("ld_shared_u32", "probe_sync", "ld.shared.u32 %r"),
    ("st_shared_u32", "probe_sync", "st.shared.u32 [%r"),
    ("tid_x", "probe_sreg", "mov.u32 %r#, %tid.x;"),
    ("ntid_x", "probe_sreg", "mov.u32 %r#, %ntid.x;"),
    ("ctaid_x", "probe_sreg", "mov.u32 %r#, %ctaid.x;"),
    ("nctaid_x", "probe_sreg", "mov.u32 %r#, %nctaid.x;"),
    ("laneid", "probe_sreg", "mov.u32 %r#, %laneid;"),
    ("dynamic_smem_size", "probe_smem_size", "mov.u32 %r#, %dynamic_smem_size;"),
    ("smid", "probe_sreg", "mov.u32 %r#, %smid;"),
    ("globaltimer", "probe_sreg", "mov.u64 %rd#, %globaltimer;"),
    ("clock64", "bench_tma_trace", "mov.u64 %rd#, %clock64;"),
    ("warpid", "bench_tma_trace", "mov.u32 %r#, %warpid;"),
    ("elect_sync", "probe_sreg", "elect.sync _|p, %r"),
    ("add_rn_f16x2", "probe_arith", "add.rn.f16x2 %r"),
    ("min_f16x2", "probe_arith", "min.f16x2 %r"),
    ("max_f16x2", "probe_arith", "max.f16x2 %r"),
    ("add_rn_bf16x2", "probe_arith", "add.rn.bf16x2 %r"),
    ("min_bf16x2", "probe_arith", "min.bf16x2 %r"),
    ("max_bf16x2", "probe_arith", "max.bf16x2 %r"),
    ("mul_rn_f16x2", "probe_arith", "mul.rn.f16x2 %r"),
    ("mul_rn_bf16x2", "probe_arith", "mul.rn.bf16x2 %r"),
    ("cvt_f32_f16x2", "probe_arith", "cvt.f32.f16 %r"),
    ("cvt_rn_f16x2_f32", "probe_arith", "cvt.rn.f16x2.f32 %r"),
    ("cvt_rn_bf16x2_f32", "probe_arith", "cvt.rn.bf16x2.f32 %r"),
    ("cvt_f16x2_e4m3x2", "probe_fp8", "cvt.rn.f16x2.e4m3x2 %r"),
    ("cvt_f16x2_e5m2x2", "probe_fp8", "cvt.rn.f16x2.e5m2x2 %r"),
    ("cvt_rn_satfinite_e4m3x2_f32", "probe_fp8", "cvt.rn.satfinite.e4m3x2.f32 %rs"),
    ("cvt_rn_satfinite_e5m2x2_f32", "probe_fp8", "cvt.rn.satfinite.e5m2x2.f32 %rs"),
    ("Shared::from_generic", "probe_sync", "cvta.to.shared.u64 s, %rd"),
    ("cp_async_cg_shared_global_16", "bench_gemm_bf16", "cp.async.cg.shared.global [%r"),
    ("cp_async_commit_group", "bench_gemm_bf16", "cp.async.commit_group;"),
    ("cp_async_wait_group", "bench_gemm_bf16", "cp.async.wait_group 1;"),
    ("ldmatrix_sync_aligned_m8n8_x4_shared_b16", "bench_gemm_bf16", "ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%r"),
    (
        "mma_sync_aligned_m16n8k16_row_col_f32_bf16_bf16_f32",
        "bench_gemm_bf16",
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%r",
    ),
    ("wgmma_fence_sync_aligned", "bench_gemm_wgmma", "wgmma.fence.sync.aligned;"),
    ("bar_warp_sync", "bench_gemm_wgmma", "bar.warp.sync %r"),
    ("wgmma_fence_operands", "bench_gemm_wgmma", "// %r"),
    ("wgmma_commit_group_sync_aligned", "bench_gemm_wgmma", "wgmma.commit_group.sync.aligned;"),
    ("wgmma_wait_group_sync_aligned", "bench_gemm_wgmma", "wgmma.wait_group.sync.aligned 1;"),
    (
        "wgmma_mma_async_sync_aligned_m64n256k16_f32_bf16_bf16",
        "bench_gemm_wgmma",
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {\n%r",
    ),
];

/// The benchmark kernels' module, which the `oxccl` command embeds (`oxccl-cli`, whose own test
/// checks it equals a fresh build): the only kernels that use some wrappers (`mma`, `wgmma`,
/// `cp.async`, `%clock64`, ...), so their golden rows are checked there.
const BENCH: &str = include_str!("../cli/ptx/oxccl_bench.ptx");

/// Every PTX module of the workspace: the crate's two and the benchmark kernels.
const MODULES: [(&str, &str); 3] = [("kernels", oxccl::ptx::KERNELS), ("probes", oxccl::ptx::PROBES), ("bench", BENCH)];

/// The text of one `.entry` (up to the next entry or function).
fn entry<'a>(ptx: &'a str, name: &str) -> Option<&'a str> {
    let start = ptx.find(&format!(".entry {name}("))?;
    let rest = &ptx[start + 1..];
    let end =
        [rest.find("\n.visible .entry"), rest.find("\n.entry"), rest.find("\n.func"), rest.find("\n.visible .func")]
            .into_iter()
            .flatten()
            .min()
            .unwrap_or(rest.len());
    Some(&ptx[start..start + 1 + end])
}

/// Whether `text` contains `pattern`, where `#` in the pattern matches one or more digits.
fn contains_pattern(text: &str, pattern: &str) -> bool {
    let pieces: Vec<&str> = pattern.split('#').collect();
    assert!(pieces[1..].iter().all(|p| !p.starts_with(|c: char| c.is_ascii_digit())), "ambiguous pattern `{pattern}`");
    text.match_indices(pieces[0]).any(|(start, first)| {
        let mut rest = &text[start + first.len()..];
        pieces[1..].iter().all(|piece| {
            let digits = rest.len() - rest.trim_start_matches(|c: char| c.is_ascii_digit()).len();
            let ok = digits > 0 && rest[digits..].starts_with(piece);
            if ok {
                rest = &rest[digits + piece.len()..];
            }
            ok
        })
    })
}

/// The tensor wrappers' rows, in `GOLDEN`'s form: five per dimension count, one probe per count.
fn tensor_rows() -> Vec<(String, String, String)> {
    let mut rows = Vec::new();
    for d in 1..=5 {
        let kernel = format!("probe_tensor_{d}d");
        rows.push((
            format!("cp_async_bulk_tensor_{d}d_shared_global_tile_mbarrier"),
            kernel.clone(),
            format!("cp.async.bulk.tensor.{d}d.shared::cluster.global.tile.mbarrier::complete_tx::bytes ["),
        ));
        rows.push((
            format!("cp_async_bulk_tensor_{d}d_global_shared_tile_bulk_group"),
            kernel.clone(),
            format!("cp.async.bulk.tensor.{d}d.global.shared::cta.tile.bulk_group ["),
        ));
        for op in ["add", "min", "max"] {
            rows.push((
                format!("cp_reduce_async_bulk_tensor_{d}d_global_shared_{op}_tile_bulk_group"),
                kernel.clone(),
                format!("cp.reduce.async.bulk.tensor.{d}d.global.shared::cta.{op}.tile.bulk_group ["),
            ));
        }
    }
    rows
}

/// Checks each (wrapper, probe kernel, pattern) row against the probe module (or, for the
/// benchmark kernels, their module).
fn check_rows<'a>(rows: impl IntoIterator<Item = (&'a str, &'a str, &'a str)>) {
    let mut missing = Vec::new();
    for (wrapper, kernel, text) in rows {
        let module = if kernel.starts_with("bench_") { BENCH } else { oxccl::ptx::PROBES };
        match entry(module, kernel) {
            None => missing.push(format!("{wrapper}: probe kernel {kernel} missing")),
            Some(body) if !contains_pattern(body, text) => missing.push(format!("{wrapper}: `{text}` not in {kernel}")),
            Some(_) => {}
        }
    }
    assert!(missing.is_empty(), "golden PTX mismatches:\n{}", missing.join("\n"));
}

#[test]
fn patterns_tell_apart_what_their_rows_name() {
    let wait = "mbarrier.try_wait.parity.shared::cta.b64 p, [%r#], %r#;";
    let suspend = "mbarrier.try_wait.parity.shared::cta.b64 p, [%r#], %r#, %r#;";
    let plain_line =
        "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%r24], %r5; selp.u32 %r4, 1, 0, p; }";
    let suspend_line =
        "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%r24], %r11, %r14; selp.u32 %r13, 1, 0, p; }";
    assert!(contains_pattern(plain_line, wait) && !contains_pattern(plain_line, suspend));
    assert!(contains_pattern(suspend_line, suspend) && !contains_pattern(suspend_line, wait));
    assert!(contains_pattern("\tmov.u32 %r1, %tid.x;", "mov.u32 %r#, %tid.x;"));
    assert!(!contains_pattern("\tmov.u32 %r1, %ntid.x;", "mov.u32 %r#, %tid.x;"));
    assert!(!contains_pattern("\tmov.u64 %rd7, %clock64;", "mov.u64 %rd#, %globaltimer;"));
    assert!(!contains_pattern("mov.u32 %r, %tid.x;", "mov.u32 %r#, %tid.x;"), "# needs a digit");
}

#[test]
fn every_wrapper_appears_in_its_probe() {
    check_rows(GOLDEN.iter().copied());
}

#[test]
fn tensor_wrappers_appear_in_their_probes() {
    let rows = tensor_rows();
    check_rows(rows.iter().map(|(w, k, t)| (w.as_str(), k.as_str(), t.as_str())));
}

/// Files of `ptx-intrinsics/src` that hold no instruction wrappers, and why. Every other file is
/// scanned for wrappers.
const NOT_WRAPPER_FILES: &[(&str, &str)] = &[
    ("lib.rs", "the crate root: module list, re-exports and the probe module's panic handler"),
    ("probes.rs", "the probe kernels themselves"),
    ("space.rs", "address-space types; their one instruction (`Shared::from_generic`) has a row by hand"),
];

/// The macros that define wrappers in the scanned files: (macro, which arguments of an invocation
/// name a wrapper, counted after its doc comments). A macro not listed here fails the scan.
const WRAPPER_MACROS: &[(&str, &[usize])] = &[
    ("packed", &[0]),
    ("pack_f32", &[0]),
    ("widen_f8", &[0]),
    ("narrow_f8", &[0]),
    ("fence", &[0]),
    ("sreg32", &[0]),
    ("load", &[0]),
    ("store", &[0]),
    ("red", &[0]),
    ("atom", &[0]),
    ("cp_reduce_async_bulk", &[0]),
    // (dims, load, store, add, min, max, coordinates, ..)
    ("tensor_family", &[1, 2, 3, 4, 5]),
    // wgmma.rs: operand lists and the instruction's body inside its wrappers, which are plain `fn`s.
    ("operand_list", &[]),
    ("half", &[]),
    ("d_operands", &[]),
    ("touch", &[]),
    ("mma_m64n256k16", &[]),
];

/// Wrappers with no probe kernel, and why.
const UNPROBED: &[(&str, &str)] = &[(
    "trap",
    "a probe kernel would only abort; the probe module's panic handler calls it (checked in \
     `every_wrapper_has_a_golden_row`)",
)];

/// The top-level comma-separated arguments of the invocation starting at `text` (just after its
/// opening parenthesis), doc comments dropped.
fn macro_args(text: &str) -> Vec<String> {
    let (mut args, mut cur, mut depth, mut in_str) = (Vec::new(), String::new(), 0, false);
    for c in text.chars() {
        match c {
            '"' => in_str = !in_str,
            '(' | '[' | '{' if !in_str => depth += 1,
            ')' | ']' | '}' if !in_str && depth == 0 => break,
            ')' | ']' | '}' if !in_str => depth -= 1,
            ',' if !in_str && depth == 0 => {
                args.push(std::mem::take(&mut cur));
                continue;
            }
            _ => {}
        }
        cur.push(c);
    }
    args.push(cur);
    args.iter().map(|a| a.trim().to_string()).filter(|a| !a.is_empty()).collect()
}

/// Every public wrapper `ptx-intrinsics/src/<file>` defines: `pub [unsafe] fn NAME`, and the names
/// the invocations of the file's wrapper macros give.
fn wrappers_in(file: &str, src: &str) -> Vec<String> {
    // Doc and line comments dropped: they quote instruction texts and wrapper names.
    let code: String =
        src.lines().filter(|l| !l.trim_start().starts_with("//")).map(|l| format!("{l}\n")).collect::<String>();
    let ident = |s: &str| s.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect::<String>();
    let mut names = Vec::new();
    for decl in ["pub fn ", "pub unsafe fn "] {
        for (at, _) in code.match_indices(decl) {
            let name = ident(&code[at + decl.len()..]);
            if !name.is_empty() {
                names.push(name); // `$name` (inside a macro) gives "" and is read from the invocations
            }
        }
    }
    for (at, _) in code.match_indices("macro_rules! ") {
        let m = ident(&code[at + 13..]);
        assert!(WRAPPER_MACROS.iter().any(|w| w.0 == m), "{file}: macro `{m}` is not in WRAPPER_MACROS");
    }
    for &(m, positions) in WRAPPER_MACROS {
        for line_start in code.match_indices('\n').map(|(i, _)| i + 1) {
            let Some(rest) = code[line_start..].strip_prefix(&format!("{m}!(")) else { continue };
            let args = macro_args(rest);
            for &p in positions {
                let name = args.get(p).unwrap_or_else(|| panic!("{file}: {m}! has no argument {p}"));
                assert!(ident(name) == *name, "{file}: {m}! argument {p} is `{name}`, not a wrapper name");
                names.push(name.clone());
            }
        }
    }
    names
}

#[test]
fn every_wrapper_has_a_golden_row() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("ptx-intrinsics/src");
    let mut wrappers = Vec::new();
    let mut files: Vec<_> = std::fs::read_dir(&dir).expect("ptx-intrinsics/src").map(|e| e.unwrap().path()).collect();
    files.sort();
    for path in files.iter().filter(|p| p.extension().is_some_and(|e| e == "rs")) {
        let file = path.file_name().unwrap().to_string_lossy().into_owned();
        if NOT_WRAPPER_FILES.iter().any(|n| n.0 == file) {
            continue;
        }
        wrappers.extend(wrappers_in(&file, &std::fs::read_to_string(path).unwrap()));
    }
    // The scan must find the wrappers it is meant to find (a broken parser finds none).
    for known in ["mbarrier_init_shared_b64", "fence_acq_rel_sys", "ld_acquire_sys_u64", "tid_x", "trap"] {
        assert!(wrappers.iter().any(|w| w == known), "the scan missed `{known}`");
    }
    let tensor = tensor_rows();
    let rows: Vec<&str> = GOLDEN.iter().map(|r| r.0).chain(tensor.iter().map(|r| r.0.as_str())).collect();
    let unrowed: Vec<&String> =
        wrappers.iter().filter(|w| !rows.contains(&w.as_str()) && !UNPROBED.iter().any(|u| u.0 == *w)).collect();
    assert!(unrowed.is_empty(), "wrappers without a golden row (add a probe and a row): {unrowed:?}");
    // Rows and exceptions name real wrappers (`Type::method` rows are outside the scanned files).
    let stale: Vec<&str> = rows
        .iter()
        .copied()
        .chain(UNPROBED.iter().map(|u| u.0))
        .filter(|r| !r.contains("::") && !wrappers.iter().any(|w| w == r))
        .collect();
    assert!(stale.is_empty(), "rows for no wrapper: {stale:?}");
    for (u, _) in UNPROBED {
        assert!(!rows.contains(u), "{u} has a row: drop it from UNPROBED");
    }
    // `trap`: the probe module's panic handler is its call, one inline `trap;`.
    let handler = oxccl::ptx::PROBES.find("rust_begin_unwind(").expect("the probe module's panic handler");
    let body = &oxccl::ptx::PROBES[handler..];
    let body = &body[..body.find("\n}").unwrap_or(body.len())];
    assert!(
        body.contains("// begin inline asm\n\ttrap;\n\t// end inline asm"),
        "the panic handler does not call trap:\n{body}"
    );
}

#[test]
fn modules_target_sm90a_with_no_unresolved_externs() {
    for (name, ptx) in MODULES {
        assert!(ptx.contains(".target sm_90a"), "{name}: not built for sm_90a");
        let version = ptx.lines().find_map(|l| l.strip_prefix(".version ")).expect(".version line");
        let (major, minor) = version.trim().split_once('.').expect("version x.y");
        let v: (u32, u32) = (major.parse().unwrap(), minor.parse().unwrap());
        assert!(v >= (8, 0), "{name}: PTX ISA {version} < 8.0");
        let externs: Vec<_> = ptx.lines().filter(|l| l.contains(".extern .func")).collect();
        assert!(externs.is_empty(), "{name}: unresolved externs: {externs:?}");
    }
}

/// The engine's CTA barriers are the forms without `.aligned` (`bar.sync` and `bar.red` are
/// aligned): LLVM may copy an inline-assembly barrier into both arms of a branch, so that one warp's
/// threads reach different copies, which the aligned forms leave undefined (the engine's kernels
/// hung on an H200 once the end barrier of the walker had been copied so).
#[test]
fn engine_modules_use_no_aligned_cta_barrier() {
    let ptx = oxccl::ptx::KERNELS;
    let aligned: Vec<&str> = ptx
        .lines()
        .map(str::trim)
        .filter(|l| {
            l.contains("bar.sync")
                || l.contains("bar.red")
                || l.contains("bar.arrive")
                || l.contains("barrier.sync.aligned")
                || l.contains("barrier.red.aligned")
        })
        .filter(|l| !l.contains("bar.warp.sync"))
        .take(3)
        .collect();
    assert!(aligned.is_empty(), "aligned CTA barriers {aligned:?}");
    assert!(ptx.contains("barrier.sync 0;"), "no CTA barrier found: the check would pass vacuously");
}

/// The engine module calls no function but the status writer (`wait::write_status`, kept apart on
/// purpose): a mover's step outlined by LLVM (a closure over the write kind, taken at run time
/// through memory) is what made the TMA bulk reductions wrong on an H200 until it was a function
/// inlined always. Every data path stays inside its kernel.
#[test]
fn engine_modules_outline_nothing_but_the_status_writer() {
    let funcs: Vec<&str> = oxccl::ptx::KERNELS
        .lines()
        .filter(|l| l.starts_with(".func") || l.starts_with(".visible .func") || l.starts_with(".weak .func"))
        .filter(|l| !l.contains("write_status") && !l.contains("rust_begin_unwind"))
        .collect();
    assert!(funcs.is_empty(), "outlined functions {funcs:?}");
}

#[test]
fn every_engine_kernel_exists_and_the_thread_bounded_ones_are_bounded() {
    for &(dtype, op, [tma, simt, latency]) in abi::KERNELS {
        let t = entry(oxccl::ptx::KERNELS, tma).unwrap_or_else(|| panic!("{tma} ({dtype:?} {op:?}) missing"));
        assert!(!t.contains(".maxntid"), "{tma} must not carry a launch bound");
        let s = entry(oxccl::ptx::KERNELS, simt).unwrap_or_else(|| panic!("{simt} missing"));
        assert!(s.contains(".maxntid 512, 1, 1"), "{simt} lacks its launch bound");
        let l = entry(oxccl::ptx::KERNELS, latency).unwrap_or_else(|| panic!("{latency} missing"));
        assert!(l.contains(".maxntid 256, 1, 1"), "{latency} lacks its launch bound");
        assert!(t.contains("cp.async.bulk.shared::cluster.global"), "{tma} has no bulk loads");
        assert!(s.contains("ld.global.v4.u32"), "{simt} has no vector loads");
        assert!(l.contains("ld.global.v4.u32"), "{latency} has no vector loads");
        assert!(!l.contains("cp.async.bulk"), "{latency} issues bulk copies");
    }
}

#[test]
fn the_gemm_probe_carries_its_launch_bounds() {
    // Exactly its threads (another block size fails to launch) and two CTAs per SM, which caps it
    // at 128 registers: the footprint the overlap benchmark documents.
    let body = entry(BENCH, "bench_gemm_bf16").expect("bench_gemm_bf16 missing");
    let threads = oxccl_bench_kernels::gemm_shape::THREADS;
    assert!(body.contains(&format!(".reqntid {threads}, 1, 1\n.minnctapersm 2\n")), "launch bounds missing");
    assert!(!body.contains(".local"), "the GEMM's accumulators spilled to local memory");
}

#[test]
fn the_warpgroup_gemm_carries_its_launch_bounds_and_its_warp_discipline() {
    // Exactly its threads and at most the registers that leave room for a collective's CTA, both
    // from `wgmma_shape`, which the benchmark documents; accumulators in registers.
    let body = entry(BENCH, "bench_gemm_wgmma").expect("bench_gemm_wgmma missing");
    let (threads, registers) =
        (oxccl_bench_kernels::wgmma_shape::THREADS, oxccl_bench_kernels::wgmma_shape::MAX_REGISTERS);
    assert!(body.contains(&format!(".reqntid {threads}, 1, 1\n.maxnreg {registers}\n")), "launch bounds missing");
    assert!(!body.contains(".local"), "the accumulators spilled to local memory");
    // What made the kernel run on the H200 (it hung in its first multiplies without): every warp
    // synchronised between a barrier wait and the next `wgmma.fence`, and no store (a one-lane
    // branch) between a `wgmma.fence` and the wait that follows it.
    let (fence, wait, poll) = ("wgmma.fence.sync.aligned", "wgmma.wait_group.sync.aligned", "mbarrier.try_wait");
    let mut at = 0;
    let mut fences = 0;
    while let Some(f) = body[at..].find(fence).map(|f| at + f) {
        let before = &body[..f];
        let last_poll = before.rfind(poll).expect("a barrier wait before the multiplies");
        assert!(before[last_poll..].contains("bar.warp.sync"), "no warp sync between the wait and `{fence}`");
        let end = body[f..].find(wait).map(|w| f + w).expect("a wait after the multiplies");
        assert!(!body[f..end].contains("st."), "a store between `{fence}` and `{wait}`");
        at = end;
        fences += 1;
    }
    assert!(fences > 0, "no `{fence}` in bench_gemm_wgmma");
}

#[test]
fn ptxas_assembles_every_module() {
    let Some(ptxas) = common::ptxas() else {
        common::skip("skipped: ptxas not found (pip install nvidia-cuda-nvcc, or set OXCCL_PTXAS)");
        return;
    };
    let dir = std::env::temp_dir().join(format!("oxccl-ptxas-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for (name, ptx) in MODULES {
        let src = dir.join(format!("{name}.ptx"));
        std::fs::write(&src, ptx).unwrap();
        let out = Command::new(&ptxas)
            .args(["-arch=sm_90a", "-v", "-o"])
            .arg(dir.join(format!("{name}.cubin")))
            .arg(&src)
            .output()
            .expect("run ptxas");
        let log = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "ptxas rejected {name}:\n{log}");
        // The collectives' kernels spill no registers (a spill is local-memory traffic in every
        // combine; ptxas keeps an entry with `.maxntid N` within 65536 / N registers by spilling, so
        // the bound itself cannot fail). `checked` counts the kernels' entries so the check cannot
        // pass vacuously.
        let (mut function, mut checked) = (String::new(), 0);
        for line in log.lines() {
            if let Some(rest) = line.split("Function properties for ").nth(1) {
                function = rest.trim().to_string();
            }
            if let Some(bytes) = line.split(" bytes spill stores").next().filter(|_| line.contains("spill stores")) {
                let spilled: u32 = bytes.rsplit(' ').next().and_then(|s| s.parse().ok()).unwrap();
                if name == "kernels" && ptx.contains(&format!(".entry {function}(")) {
                    assert_eq!(spilled, 0, "{name}: {function} spills {spilled} bytes");
                    checked += 1;
                }
            }
        }
        if name == "kernels" {
            let entries = ptx.matches(".entry ").count();
            assert_eq!(checked, entries, "{name}: {entries} entries, {checked} with their spills checked");
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn shipped_ptx_equals_a_fresh_build() {
    if oxccl::ptx::SOURCE != "fresh" {
        common::skip("skipped: the PTX was not rebuilt here (no device toolchain); the shipped files are embedded");
        return;
    }
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("ptx");
    let bless = std::env::var_os("OXCCL_BLESS").is_some();
    for (file, fresh) in [("oxccl_kernels.ptx", oxccl::ptx::KERNELS), ("oxccl_probes.ptx", oxccl::ptx::PROBES)] {
        let path = root.join(file);
        let shipped = std::fs::read_to_string(&path).unwrap_or_default();
        if shipped != fresh {
            if bless {
                std::fs::write(&path, fresh).unwrap();
                eprintln!("blessed {}", path.display());
            } else {
                panic!(
                    "ptx/{file} differs from a fresh build: run `OXCCL_BLESS=1 cargo test --test ptx` and commit it"
                );
            }
        }
    }
}

/// The prebuilt modules (`ptx/*.sm_90a.cubin`): `ptx/cubins.txt` records the hash of the PTX each
/// was made from, which must be this build's PTX, and the code's own hash (so the build embedded
/// the code); with `OXCCL_CUBIN_PTXAS` (the `ptxas` the manifest names; `.ci/run` installs it) each
/// is remade from the PTX and must equal the shipped bytes. `OXCCL_BLESS=1` with that `ptxas`
/// rewrites the code and the manifest.
#[test]
fn prebuilt_code_is_made_from_the_shipped_ptx() {
    use oxccl::ptx::prebuilt::{ManifestEntry, PREBUILT, code_hash, manifest_entry, vouched};
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("ptx");
    // This build's PTX and embedded code, per `PREBUILT` entry.
    let embedded = |ptx: &str| match ptx {
        "oxccl_kernels.ptx" => (oxccl::ptx::KERNELS, oxccl::ptx::KERNELS_SM90A),
        other => panic!("{other}: a prebuilt module this test does not know"),
    };
    let bless = std::env::var_os("OXCCL_BLESS").is_some();
    let hint = "run `OXCCL_BLESS=1 OXCCL_CUBIN_PTXAS=PATH cargo test --release --test ptx` with the ptxas ptx/cubins.txt names, and commit ptx/";
    let manifest_path = root.join("cubins.txt");
    let manifest = std::fs::read_to_string(&manifest_path).unwrap_or_default();
    if !bless {
        for &(ptx, code) in PREBUILT {
            let (text, code_embedded) = embedded(ptx);
            let shipped = std::fs::read(root.join(code)).unwrap_or_default();
            vouched(&manifest, ptx, text.as_bytes(), &shipped).unwrap_or_else(|why| panic!("{why}: {hint}"));
            assert!(code_embedded == shipped.as_slice(), "the build did not embed ptx/{code}");
        }
    }
    let Some(ptxas) = std::env::var_os("OXCCL_CUBIN_PTXAS").map(std::path::PathBuf::from) else {
        assert!(!bless, "OXCCL_BLESS needs OXCCL_CUBIN_PTXAS to remake the code");
        common::skip(
            "skipped: remaking the prebuilt code (set OXCCL_CUBIN_PTXAS to the ptxas ptx/cubins.txt names); the hashes match",
        );
        return;
    };
    let version = Command::new(&ptxas).arg("--version").output().expect("run ptxas --version");
    let version = String::from_utf8_lossy(&version.stdout).lines().last().unwrap_or_default().trim().to_string();
    let dir = std::env::temp_dir().join(format!("oxccl-prebuilt-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // ptxas takes tens of seconds per module: all at once.
    let made: Vec<Vec<u8>> = std::thread::scope(|s| {
        let jobs: Vec<_> = PREBUILT
            .iter()
            .map(|&(ptx, code)| {
                let (dir, ptxas, text) = (&dir, &ptxas, embedded(ptx).0);
                s.spawn(move || {
                    let (src, out) = (dir.join(ptx), dir.join(code));
                    std::fs::write(&src, text).unwrap();
                    let run = Command::new(ptxas).arg("-arch=sm_90a").arg("-o").arg(&out).arg(&src).output().unwrap();
                    assert!(run.status.success(), "ptxas rejected {ptx}: {}", String::from_utf8_lossy(&run.stderr));
                    std::fs::read(&out).unwrap()
                })
            })
            .collect();
        jobs.into_iter().map(|j| j.join().unwrap()).collect()
    });
    std::fs::remove_dir_all(&dir).ok();
    let mut lines = vec![
        "# sm_90a machine code shipped beside the PTX (`ptxas -arch=sm_90a`): FNV-1a of the PTX it was made from, the PTX, the code, FNV-1a of the code, the ptxas that made it (build.rs, src/prebuilt.rs, tests/ptx.rs)".to_string(),
    ];
    for (&(ptx, code), bytes) in PREBUILT.iter().zip(&made) {
        let entry = ManifestEntry {
            ptx_hash: code_hash(embedded(ptx).0.as_bytes()),
            ptx: ptx.to_string(),
            code: code.to_string(),
            code_hash: code_hash(bytes),
            ptxas: version.clone(),
        };
        lines.push(entry.line());
        if bless {
            std::fs::write(root.join(code), bytes).unwrap();
            eprintln!("blessed ptx/{code}");
            continue;
        }
        let recorded =
            manifest_entry(&manifest, ptx).unwrap_or_else(|| panic!("ptx/cubins.txt has no line for {ptx}: {hint}"));
        assert_eq!(recorded.ptxas, version, "{ptx}: OXCCL_CUBIN_PTXAS is another ptxas than the manifest's");
        assert_eq!(recorded, entry, "ptx/{code} differs from ptxas's output for {ptx}: {hint}");
    }
    if bless {
        std::fs::write(&manifest_path, lines.join("\n") + "\n").unwrap();
        eprintln!("blessed {}", manifest_path.display());
    }
}
