//! The `oxccl` binary's flag checking: bad benchmark flags are refused with a message naming the
//! flag, before any GPU is looked for, so these run the same with or without one.

use std::process::Command;

/// Runs `oxccl ARGS`; returns (success, stdout, stderr).
fn run(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_oxccl")).args(args).output().expect("run oxccl");
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    (out.status.success(), text(&out.stdout), text(&out.stderr))
}

/// Runs `oxccl ARGS`; returns (success, stderr).
fn oxccl(args: &[&str]) -> (bool, String) {
    let (ok, _, err) = run(args);
    (ok, err)
}

/// Asserts `oxccl ARGS` fails with a message containing `want`, found before any GPU is looked for
/// (the message mentions none) and without a panic.
fn refused_before_any_gpu(args: &[&str], want: &str) {
    let (ok, err) = oxccl(args);
    assert!(!ok && err.contains(want), "{args:?}: {err}");
    assert!(!err.contains("GPU") && !err.contains("panicked"), "{args:?}: {err}");
}

/// Asserts the parser refuses `oxccl ARGS` for `flag`, which that benchmark does not read.
fn unexpected(args: &[&str], flag: &str) {
    let (ok, err) = oxccl(args);
    let want = format!("unexpected argument '{flag}'");
    assert!(!ok && err.contains(&want) && !err.contains("panicked"), "{args:?}: {err}");
}

/// Runs `oxccl ARGS`; returns (success, stdout).
fn oxccl_out(args: &[&str]) -> (bool, String) {
    let (ok, out, _) = run(args);
    (ok, out)
}

#[test]
fn gpus_is_refused_where_it_means_nothing() {
    for what in ["movers", "reshard"] {
        unexpected(&["bench", what, "--gpus", "2"], "--gpus");
    }
}

#[test]
fn a_size_of_no_whole_f32_is_named() {
    for (what, per) in [("movers", "per buffer"), ("overlap", "per rank")] {
        for size in ["6", "0"] {
            let (ok, err) = oxccl(&["bench", what, "-e", size]);
            let want = format!("-e: {size} B {per}: the buffers are of f32, give a positive multiple of 4 bytes");
            assert!(!ok && err.contains(&want), "{what} -e {size}: {err}");
        }
    }
}

#[test]
fn a_bad_compute_load_is_named() {
    let (ok, err) = oxccl(&["bench", "overlap", "--compute", "matmul"]);
    assert!(!ok && err.contains("invalid value 'matmul' for '--compute"), "{err}");
    let (ok, err) = oxccl(&["bench", "overlap", "--compute", "gemm", "--gemm", "8,8"]);
    assert!(!ok && err.contains("--gemm [8, 8]"), "{err}");
    let (ok, err) = oxccl(&["bench", "overlap", "--compute", "gemm", "--gemm", "8,0,8"]);
    assert!(!ok && err.contains("--gemm [8, 0, 8]"), "{err}");
    let (ok, err) = oxccl(&["bench", "overlap", "--compute", "mma", "--gemm", "8192,8192,100"]);
    assert!(
        !ok && err.contains(
            "--gemm: 8192x8192x100: for the mma load M must be a positive multiple of 128, N of 128, K of 32"
        ),
        "{err}"
    );
    let (ok, err) = oxccl(&["bench", "overlap", "--compute", "wgmma", "--gemm", "8192,8320,2048"]);
    assert!(
        !ok && err.contains(
            "--gemm: 8192x8320x2048: for the wgmma load M must be a positive multiple of 128, N of 256, K of 64"
        ),
        "{err}"
    );
    let (ok, err) = oxccl(&["bench", "overlap", "--compute", "mma", "--gemm", "65536,32768,128"]);
    assert!(
        !ok && err.contains("--gemm: 65536x32768x128: for the mma load every matrix at most 2^30 elements"),
        "{err}"
    );
    let (ok, err) = oxccl(&["bench", "overlap", "--mma-one-per-sm"]);
    assert!(!ok && err.contains("--mma-one-per-sm is for --compute mma, not fma"), "{err}");
    let (ok, err) = oxccl(&["bench", "overlap", "--compute", "mma", "--fma-ctas-per-sm", "2"]);
    assert!(!ok && err.contains("--fma-ctas-per-sm is for --compute fma or sleep, not mma"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    for (flag, name) in [("--simt-threads=64", "--simt-threads"), ("--mma-one-per-sm", "--mma-one-per-sm")] {
        unexpected(&["bench", "all_reduce", flag], name);
    }
    for t in ["100", "0", "1024"] {
        let (ok, err) = oxccl(&["bench", "overlap", "--simt-threads", t]);
        assert!(!ok && err.contains(&format!("--simt-threads: {t} is not a multiple of 32 in 32..=512")), "{t}: {err}");
        assert!(!err.contains("panicked"), "{t}: {err}");
    }
}

#[test]
fn an_unknown_reduction_is_named() {
    for what in ["all_reduce", "overlap"] {
        let (ok, err) = oxccl(&["bench", what, "--reduction", "atomics"]);
        assert!(!ok && err.contains("invalid value 'atomics' for '--reduction"), "{what}: {err}");
        assert!(!err.contains("panicked"), "{what}: {err}");
    }
}

#[test]
fn a_bad_compute_time_is_named() {
    for ms in ["0", "-3", "NaN", "1e9"] {
        let flag = format!("--compute-ms={ms}");
        let (ok, err) = oxccl(&["bench", "overlap", &flag]);
        assert!(!ok && err.contains("--compute-ms") && err.contains("give a time in (0, 60000] ms"), "{ms}: {err}");
    }
    for n in ["0", "9"] {
        let (ok, err) = oxccl(&["bench", "overlap", "--fma-ctas-per-sm", n]);
        assert!(!ok && err.contains(&format!("--fma-ctas-per-sm {n}: give 1..=8")), "{n}: {err}");
    }
    unexpected(&["bench", "all_reduce", "--compute-ms", "5"], "--compute-ms");
    unexpected(
        &["bench", "plan", "--algo", "ring-allreduce", "--topo", "1x2", "--fma-ctas-per-sm", "2"],
        "--fma-ctas-per-sm",
    );
    unexpected(&["bench", "reduce_scatter", "--partition"], "--partition");
}

#[test]
fn combine_direct_is_refused_where_it_means_nothing() {
    for what in ["reduce_scatter", "movers"] {
        unexpected(&["bench", what, "--combine-direct", "true"], "--combine-direct");
    }
    unexpected(
        &["bench", "plan", "--algo", "ring-allreduce", "--topo", "1x2", "--combine-direct", "false"],
        "--combine-direct",
    );
    for args in
        [["all_reduce", "--reduction", "tma"], ["all_reduce", "--mover", "simt"], ["overlap", "--reduction", "tma"]]
    {
        let (ok, err) = oxccl(&[&["bench"][..], &args[..], &["--combine-direct", "true"]].concat());
        assert!(!ok && err.contains("--combine-direct is for the TMA mover's register combine"), "{args:?}: {err}");
    }
    // A value is required, so the flag cannot swallow the benchmark's name.
    let (ok, err) = oxccl(&["bench", "all_reduce", "--combine-direct"]);
    assert!(!ok && err.contains("--combine-direct"), "{err}");
    let (ok, err) = oxccl(&["bench", "all_reduce", "--combine-direct", "all_reduce"]);
    assert!(!ok && err.contains("invalid value 'all_reduce' for '--combine-direct"), "{err}");
}

#[test]
fn issuers_are_refused_where_they_mean_nothing() {
    unexpected(&["bench", "movers", "--issuers", "2"], "--issuers");
    for what in ["overlap", "reshard"] {
        let (ok, err) = oxccl(&["bench", what, "--issuers", "5"]);
        assert!(!ok && err.contains("--issuers: 5 is not in 1..=4"), "{what}: {err}");
        assert!(!err.contains("no GPU") && !err.contains("panicked"), "{what}: {err}");
    }
}

#[test]
fn a_bad_overlap_pipeline_is_named() {
    for (flag, value, want) in [
        ("--chunk", "17", "--chunk: 17 is not a positive multiple of 16"),
        ("--stages", "0", "--stages: 0 is not in 1..=16"),
        ("--threads", "48", "--threads: 48 is not a multiple of 32"),
        ("--ctas", "0", "--ctas: must be at least 1"),
    ] {
        let (ok, err) = oxccl(&["bench", "overlap", flag, value]);
        assert!(!ok && err.contains(want), "{flag} {value}: {err}");
        assert!(!err.contains("no GPU") && !err.contains("panicked"), "{flag} {value}: {err}");
    }
}

#[test]
fn an_unknown_benchmark_is_named() {
    let (ok, err) = oxccl(&["bench", "all_to_none"]);
    assert!(!ok && err.contains("unrecognized subcommand 'all_to_none'"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

/// Every subcommand of `oxccl bench` (the names the cargo bench `collectives` accepts), and each
/// one's alias, runs: here, without a GPU, each gets as far as looking for one.
#[test]
fn every_listed_benchmark_is_known() {
    if oxccl::engine::probe_gpu().is_ok() {
        // Straight to the terminal: the harness captures `eprintln!` of passing tests.
        use std::io::Write;
        let _ = writeln!(
            std::io::stderr(),
            "skipped: a GPU is present (every_listed_benchmark_is_known: the benchmarks would run)"
        );
        return;
    }
    use clap::Subcommand;
    let bench = oxccl_cli::commands::bench::Command::augment_subcommands(clap::Command::new("bench"));
    let mut names = 0;
    for sub in bench.get_subcommands() {
        for what in std::iter::once(sub.get_name()).chain(sub.get_all_aliases()) {
            let plan = ["--algo", "ring-allreduce", "--topo", "1x2", "-e", "1M"];
            let args = if what == "plan" { &plan[..] } else { &[][..] };
            let (ok, err) = oxccl(&[&["bench", what][..], args].concat());
            assert!(!ok && err.contains("no GPU"), "{what}: {err}");
            names += 1;
        }
    }
    assert!(names >= 10, "{names} benchmark names");
}

#[test]
fn a_bad_piece_is_named() {
    let (ok, err) = oxccl(&["bench", "movers", "--piece", "17"]);
    assert!(!ok && err.contains("--piece 17: give a positive multiple of 16"), "{err}");
    let (ok, err) = oxccl(&["bench", "movers", "-e", "64M", "--piece", "4M"]);
    assert!(
        !ok && err
            .contains("--piece: 4194304-byte pieces cut 67108864 B into 16 pieces, fewer than the sweep's 132 CTAs"),
        "{err}"
    );
    let (ok, err) = oxccl(&["bench", "movers", "--piece", "halves"]);
    assert!(!ok && err.contains("bad size `halves`") && err.contains("or auto, or contiguous"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    unexpected(&["bench", "plan", "--algo", "ring-allreduce", "--piece", "1M"], "--piece");
    unexpected(&["bench", "all_reduce", "--piece", "1M"], "--piece");
}

/// `-G` (CUDA-graph timing) is for the collectives' table only.
#[test]
fn graph_timing_is_for_the_collectives() {
    for (args, flag) in [
        (&["bench", "movers", "-G", "2"][..], "-G"),
        (&["bench", "overlap", "--cudagraph", "1"], "--cudagraph"),
        (&["bench", "plan", "--algo", "ring-allreduce", "-G", "1"], "-G"),
    ] {
        unexpected(args, flag);
    }
    // Bounded before any GPU is looked for (a count that large would never end).
    let (ok, err) = oxccl(&["bench", "all_reduce", "-G", "18446744073709551615"]);
    assert!(!ok && err.contains("-G 18446744073709551615: give at most 1000000 launches"), "{err}");
    // A flag a benchmark does not read is refused whatever its value, -G 0 too.
    unexpected(&["bench", "plan", "--algo", "ring-allreduce", "-G", "0"], "-G");
}

/// `--untracked` (cudarc's event tracking off) is the collectives' flag, as `-G`; accepted there
/// and checked like any other run (no GPU here: refused as such).
#[test]
fn untracked_is_for_the_collectives() {
    unexpected(&["bench", "movers", "--untracked"], "--untracked");
    unexpected(&["bench", "plan", "--algo", "ring-allreduce", "--untracked"], "--untracked");
    if std::env::var_os("OXCCL_REQUIRE_GPU").is_none() && !std::path::Path::new("/dev/nvidia0").exists() {
        let (ok, err) = oxccl(&["bench", "all_reduce", "--untracked", "-b", "1M", "-e", "1M"]);
        assert!(!ok && err.contains("no GPU to benchmark on"), "{err}");
    }
}

/// `--instances` shapes a program: refused for the collectives, checked before any GPU is looked
/// for. Channels only mattered to FIFO plans: the engine has none, so the flag is refused.
#[test]
fn instances_are_for_plans_and_checked_first() {
    unexpected(&["bench", "all_reduce", "--instances", "2"], "--instances");
    unexpected(&["bench", "movers", "--instance-channels", "separate"], "--instance-channels");
    unexpected(
        &["bench", "plan", "--algo", "ring-allreduce", "--instance-channels", "separate"],
        "--instance-channels",
    );
    for (n, want) in [("0", "--instances must be at least 1"), ("4294967295", "too large")] {
        let (ok, err) = oxccl(&["bench", "plan", "--algo", "ring-allreduce", "--instances", n]);
        assert!(!ok && err.contains(want), "{n}: {err}");
        assert!(!err.contains("panicked") && !err.contains("GPU"), "{n}: {err}");
    }
}

/// `oxccl plan --dump direct` prints the program's levels: a ring AllReduce on 4 ranks is 6.
#[test]
fn direct_lowerings_print_their_levels() {
    let (ok, out) = oxccl_out(&["plan", "--algo", "ring-allreduce", "--topo", "1x4", "--dump", "direct"]);
    assert!(ok && out.starts_with("lowered: unit F32, 4 ranks, 1 CTAs per rank, 6 stages"), "{out}");
    assert!(out.contains("    reduce ") && out.contains("    move "), "{out}");
}

/// `bench plan` lowers the program level by level before any GPU is looked for: what it cannot
/// run is refused by name.
#[test]
fn programs_are_lowered_first() {
    let plan = ["bench", "plan", "--algo", "ring-allreduce"];
    for (args, want) in [
        (&[&plan[..], &["-o", "avg"]].concat(), "Avg needs to know which reduction of a chunk is its last"),
        (&[&plan[..], &["--ctas", "0"]].concat(), "--ctas: must be at least 1"),
        // An MSCCL file has its own ranks; every rank runs on one GPU.
        (&vec!["bench", "plan", "--xml", "x.xml", "--topo", "2x4"], "cannot be used with"),
    ] {
        refused_before_any_gpu(args, want);
    }
}

#[test]
fn out_of_range_sizes_and_counts_are_named_not_panics() {
    for (args, want) in [
        (&["bench", "all_reduce", "--ranks", "1000000000000"][..], "--ranks 1000000000000: must be 1..=16"),
        (&["bench", "overlap", "--ranks", "0"], "--ranks 0: must be 1..=16"),
        (&["bench", "reshard", "--ranks", "100000000000"], "--ranks 100000000000: must be 1..=16"),
        (&["demo", "--ranks", "0", "--cpu"], "0 ranks"),
        (&["bench", "all_reduce", "--ctas", "0"], "--ctas: must be at least 1"),
        (&["bench", "reduce_scatter", "--chunk", "8"], "--chunk: 8 is not a positive multiple of 16"),
        (&["bench", "broadcast", "--stages", "0"], "--stages: 0 is not in 1..=16"),
        (&["bench", "all_gather", "--issuers", "9"], "--issuers: 9 is not in 1..=4"),
        (&["demo", "--count", "100000000000", "--cpu"], "--count 100000000000"),
        (&["plan", "--algo", "ring-allreduce", "--topo", "4x1073741826"], "more than 1048576 GPUs"),
        (&["plan", "--algo", "ring-allreduce", "--topo", "1x4", "--instances", "4294967295"], "too large"),
        // Refused before the 8192-rank program is generated and compiled (which takes long).
        (
            &["bench", "plan", "--algo", "direct-alltoall", "--topo", "1x8192"],
            "--topo 1x8192: 8192 ranks: a launch addresses at most 16",
        ),
    ] {
        let (ok, err) = oxccl(args);
        assert!(!ok && err.contains(want) && !err.contains("panicked"), "{args:?}: {err}");
    }
    let (ok, err) = oxccl(&["simulate", "--algo", "ring-allreduce", "--topo", "1x4", "--micro-batches", "4294967295"]);
    assert!(!ok && err.contains("--micro-batches 4294967295: give 1..=65536"), "{err}");
    // verify refuses the size once, before any configuration runs.
    let (ok, out, err) =
        run(&["verify", "--algo", "ring-allreduce", "--topo", "1x4", "--count", "4611686018427387904"]);
    assert!(
        !ok && out.is_empty()
            && err.contains("--count 4611686018427387904: ")
            && err.contains("a host verification holds"),
        "{out}\n{err}"
    );
}

#[test]
fn edge_sizes_run_to_the_end() {
    // No elements at all: the demo checks nothing wrong, on the CPU executor.
    let (ok, out) = oxccl_out(&["demo", "--count", "0", "--ranks", "3", "--cpu"]);
    assert!(ok && out.contains("correct (no elements to compare)"), "{out}");
    // A simulation far into f64 time still finishes (time keeps moving).
    let (ok, out) = oxccl_out(&["simulate", "--algo", "ring-allreduce", "--topo", "1x4", "--size", "16384G"]);
    assert!(ok && out.contains("TBs"), "{out}");
}

#[test]
fn the_trace_diagnostic_names_its_bad_flags() {
    for (args, want) in [
        (&["--lag", "9"][..], "--lag: 9: give 1..=4 (the rounds of stages, at most 8)"),
        (&["--stages", "3", "--lag", "0"][..], "--lag: 0: give 1..=3 (the rounds of stages, at most 8)"),
        (&["--stages", "16", "--lag", "9"][..], "--lag: 9: give 1..=8 (the rounds of stages, at most 8)"),
        (
            &["--round", "4", "--stages", "6"][..],
            "--round: 4: give 1, or 4 with a multiple of 4 stages and whole rounds per warp (6 stages",
        ),
        (&["--round", "3"][..], "--round: 3: give 1, or 4"),
        (&["--round", "4", "--stages", "8", "--lag", "3"][..], "--lag: 3: give 1..=2 (the rounds of stages"),
        (
            &["--stages", "1073741824", "--issuers", "4", "--lag", "1"][..],
            "--stages: 1073741824 stages x 4 warps: give 1..=128 stages in all",
        ),
        (&["--threads", "256"][..], "unexpected argument '--threads'"),
        (&["--ranks", "8"][..], "unexpected argument '--ranks'"),
        (&["--mover", "simt"][..], "unexpected argument '--mover'"),
        (&["-n", "0"][..], "-n: 0: give at least one timed run"),
        (&["--chain", "imad"][..], "invalid value 'imad' for '--chain"),
        (&["--issuers", "5"][..], "--issuers: 5: give 1..=4 issuing warps per CTA"),
        (&["--chunk", "100"][..], "--chunk: 100: give a positive multiple of 16 bytes"),
        (&["--stages", "40", "--issuers", "4", "--lag", "1"][..], "give 1..=128 stages in all"),
        (
            &["-e", "1K"][..],
            "-e: 1024 B over 8 warps of 32768 B chunks: each warp needs two rings of chunks (262144 B) to 4 GiB",
        ),
        (&["-e", "1M"][..], "each warp needs two rings of chunks (262144 B) to 4 GiB"),
        (&["--simt-threads", "256"][..], "unexpected argument '--simt-threads'"),
        (&["--compute", "sleep", "--mma-one-per-sm"][..], "--mma-one-per-sm is for --compute mma, not sleep"),
    ] {
        let mut all = vec!["bench", "tma_trace"];
        all.extend_from_slice(args);
        let (ok, err) = oxccl(&all);
        assert!(!ok && err.contains(want), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
    for what in ["all_reduce", "overlap"] {
        for flag in ["--lag=2", "--round=4", "--untraced", "--l2-evict-first", "--chain=fma", "--compute-first"] {
            unexpected(&["bench", what, flag], flag.split('=').next().unwrap_or(flag));
        }
    }
    unexpected(&["bench", "plan", "--algo", "ring-allreduce", "--lag", "2"], "--lag");
}

#[test]
fn a_sweep_that_cannot_run_is_refused() {
    for (args, flag) in [
        (&["bench", "all_reduce", "-b", "2M", "-e", "1M"][..], "-b: "),
        (&["bench", "reduce_scatter", "-f", "1"][..], "-f: "),
        (&["bench", "all_gather", "-f", "0"][..], "-f: "),
        (&["bench", "all_reduce", "-n", "0"][..], "-n: 0: give at least one timed run"),
        (&["bench", "plan", "--algo", "ring-allreduce", "-f", "1"][..], "-f: "),
        (&["bench", "movers", "-n", "0"][..], "-n: 0: give at least one timed run"),
        (&["bench", "reshard", "--nvlink-gbps", "0"][..], "--nvlink-gbps 0"),
        (&["bench", "reshard", "--cross-gbps=-5"][..], "--cross-gbps -5"),
    ] {
        let (ok, err) = oxccl(args);
        assert!(!ok && err.contains(flag), "{args:?}: {err}");
        assert!(!err.contains("no GPU") && !err.contains("panicked"), "{args:?}: {err}");
    }
}

#[test]
fn a_root_is_for_the_rooted_collectives_and_below_the_ranks() {
    unexpected(&["bench", "all_reduce", "--root", "1"], "--root");
    unexpected(&["bench", "plan", "--algo", "ring-allreduce", "--root", "1"], "--root");
    for what in ["broadcast", "reduce"] {
        let (ok, err) = oxccl(&["bench", what, "--root", "8"]);
        assert!(!ok && err.contains("--root 8: must be below the 8 ranks"), "{what}: {err}");
        let (ok, err) = oxccl(&["bench", what, "--ranks", "4", "-r", "4"]);
        assert!(!ok && err.contains("--root 4: must be below the 4 ranks"), "{what}: {err}");
        assert!(!err.contains("no GPU") && !err.contains("panicked"), "{what}: {err}");
    }
}

/// Every flag a benchmark does not read is refused by the parser (none is silently ignored),
/// before any GPU is looked for.
#[test]
fn flags_a_benchmark_does_not_read_are_refused() {
    let plan = ["bench", "plan", "--algo", "ring-allreduce"];
    for (args, flag) in [
        (&["bench", "movers", "-b", "1M"][..], "-b"),
        (&["bench", "movers", "--mover", "simt"], "--mover"),
        (&["bench", "movers", "-d", "half"], "-d"),
        (&["bench", "movers", "--ranks", "4"], "--ranks"),
        (&[&plan[..], &["--stages", "3"]].concat(), "--stages"),
        (&[&plan[..], &["--ranks", "4"]].concat(), "--ranks"),
        (&[&plan[..], &["--reduction", "tma"]].concat(), "--reduction"),
        (&[&plan[..], &["--exec", "compiled"]].concat(), "--exec"),
        (&[&plan[..], &["--slots", "4"]].concat(), "--slots"),
        (&[&plan[..], &["--micro-batches", "2"]].concat(), "--micro-batches"),
        (&[&plan[..], &["--gpus", "2"]].concat(), "--gpus"),
        (&["bench", "all_reduce", "--topo", "2x4"], "--topo"),
        (&["bench", "all_reduce", "--exec", "compiled"], "--exec"),
        (&["bench", "all_gather", "--slots", "4"], "--slots"),
        (&["bench", "reduce", "--micro-batches", "2"], "--micro-batches"),
        (&["bench", "overlap", "--mover", "tma"], "--mover"),
        (&["bench", "reshard", "-e", "1G"], "-e"),
        (&["bench", "all_reduce", "--shape", "8,8"], "--shape"),
        (&["bench", "movers", "--procs", "2"], "--procs"),
        (&["bench", "all_gather", "-o", "max"], "-o"),
        (&["bench", "broadcast", "--op", "sum"], "--op"),
    ] {
        unexpected(args, flag);
    }
    refused_before_any_gpu(
        &["bench", "movers", "--ctas", "0"],
        "--ctas: every CTA count of the sweep must be at least 1",
    );
}

/// The collectives' element type and operation, and a sweep too small for one element, are named
/// before any GPU is looked for.
/// The verifier takes the compiled plans' operators (prod too) and refuses avg by name.
#[test]
fn verify_takes_prod_and_refuses_avg() {
    let (ok, out) = oxccl_out(&["verify", "--algo", "ring-allreduce", "--topo", "1x4", "--redop", "prod"]);
    assert!(ok && out.contains("prod"), "{out}");
    let (ok, err) = oxccl(&["verify", "--algo", "ring-allreduce", "--topo", "1x4", "--redop", "avg"]);
    assert!(!ok && err.contains("programs have no Avg"), "{err}");
}

#[test]
fn a_collective_benchmark_checks_its_type_and_sizes_first() {
    for (args, want) in [
        (&["bench", "all_reduce", "-d", "int16"][..], "-d i16: the device kernels move f32, f16, bf16, i32, u32"),
        (&["bench", "all_reduce", "-o", "mean"], "invalid value 'mean' for '--op"),
        (&["bench", "all_reduce", "-b", "1", "-e", "3"], "-e: 3 B holds no 4-byte element"),
        (
            &["bench", "plan", "--algo", "ring-allreduce", "-d", "half", "-b", "1", "-e", "1"],
            "-e: 1 B holds no 2-byte element",
        ),
    ] {
        refused_before_any_gpu(args, want);
    }
}

/// Refused input exits 1, the parser's usage errors 2 (wrong results exit 3: see `status_of` in
/// `main.rs`).
#[test]
fn bad_input_exits_with_its_status() {
    let status =
        |args: &[&str]| Command::new(env!("CARGO_BIN_EXE_oxccl")).args(args).output().expect("run oxccl").status.code();
    assert_eq!(status(&["verify", "--algo", "ring-allreduce", "--topo", "1x4", "--count", "0"]), Some(1));
    assert_eq!(status(&["verify", "--no-such-flag"]), Some(2));
    assert_eq!(status(&["verify", "--algo", "ring-allreduce", "--topo", "1x4"]), Some(0));
}

/// An input file is read up to a limit: an endless one is refused by name, not read until memory
/// runs out.
#[cfg(unix)]
#[test]
fn an_endless_input_file_is_refused() {
    for cmd in ["verify", "plan"] {
        refused_before_any_gpu(&[cmd, "--xml", "/dev/zero"], "/dev/zero: more than 67108864 bytes");
        refused_before_any_gpu(&[cmd, "--program", "/dev/zero"], "/dev/zero: more than 67108864 bytes");
    }
}

/// A reader that closes the pipe early (`oxccl verify ... | head -1`) ends the command quietly, by
/// SIGPIPE as any Unix filter: no panic on the broken pipe, nothing on stderr.
#[cfg(unix)]
#[test]
fn a_closed_stdout_ends_the_command_quietly() {
    use std::os::unix::process::ExitStatusExt;
    // The read end is closed before the command starts: its first line meets a broken pipe.
    let (reader, writer) = std::io::pipe().expect("a pipe");
    drop(reader);
    let out = Command::new(env!("CARGO_BIN_EXE_oxccl"))
        .args(["verify", "--algo", "hm-allreduce", "--topo", "2x4", "--all"])
        .stdout(writer)
        .output()
        .expect("run oxccl");
    let err = String::from_utf8_lossy(&out.stderr);
    const SIGPIPE: i32 = 13;
    assert_eq!(out.status.signal(), Some(SIGPIPE), "{:?}: {err}", out.status);
    assert!(err.is_empty(), "{err}");
}

/// The demo's host buffers (every rank's, several copies) are bounded in all, not per rank: a size
/// that would exhaust the host is refused before anything is allocated; the default runs.
#[test]
fn the_demo_bounds_its_host_memory_over_every_rank() {
    let (ok, err) = oxccl(&["demo", "--ranks", "16", "--count", "268435456", "--cpu"]);
    assert!(
        !ok && err.contains("--count 268435456 over --ranks 16: the demo holds 5 copies")
            && err.contains("at most 4294967296 B (4 GiB) in all, so --count at most 13421772 for 16 ranks"),
        "{err}"
    );
    let (ok, err) = oxccl(&["demo", "--ranks", "18446744073709551615", "--count", "2", "--cpu"]);
    assert!(!ok && err.contains("more than 2^64 B") && !err.contains("panicked"), "{err}");
    let (ok, out) = oxccl_out(&["demo", "--cpu"]);
    assert!(ok && out.contains("1048576 elements over 8 virtual ranks") && out.contains(": correct"), "{out}");
}

/// A demo size within its bound that the process's memory limit cannot hold is refused by name,
/// not aborted by a failed allocation.
#[cfg(target_os = "linux")]
#[test]
fn the_demo_refuses_what_the_memory_limit_cannot_hold() {
    use std::os::unix::process::CommandExt;
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_oxccl"));
    cmd.args(["demo", "--count", "26843545", "--cpu"]);
    // SAFETY: only setrlimit runs in the child before exec (async-signal-safe).
    unsafe {
        cmd.pre_exec(|| {
            let limit = libc::rlimit { rlim_cur: 3 << 30, rlim_max: 3 << 30 };
            if libc::setrlimit(libc::RLIMIT_AS, &limit) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let out = cmd.output().expect("run oxccl");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("the demo's host buffers (4294967200 B) cannot be allocated here"), "{err}");
}

/// A value the command would not read is refused, before anything is printed: `reshard`'s --owner
/// and --ctas (for --lower only, checked before the plan is printed), `--gemm` beside a load
/// without GEMMs, `-o` for a collective or plan that reduces nothing, `-c` other than 0 or 1.
#[test]
fn values_a_command_would_ignore_are_refused() {
    let reshard = ["reshard", "--shape", "4,8", "--src-mesh", "1x4@0", "--src", "R,S0", "--dst-mesh", "2x2@4"];
    let reshard = [&reshard[..], &["--dst", "R,S0"]].concat();
    for (extra, want) in [
        (&["--owner", "foo"][..], "invalid value 'foo' for '--owner <OWNER>': unknown CTA owner \"foo\""),
        (&["--lower", "--owner", "foo"], "unknown CTA owner \"foo\" (reader, writer, balanced)"),
        (&["--owner", "writer"], "--lower"),
        (&["--ctas", "3"], "--lower"),
        (&["--lower", "--ctas", "0"], "--ctas: 0 CTAs per rank: must be 1..=256"),
        (&["--lower", "--ctas", "300", "--verify"], "--ctas: 300 CTAs per rank: must be 1..=256"),
        (&["--lower", "--json"], "the argument '--lower' cannot be used with '--json'"),
    ] {
        let args = [&reshard[..], extra].concat();
        let (ok, out, err) = run(&args);
        assert!(!ok && err.contains(want) && out.is_empty(), "{extra:?}: {out}\n{err}");
    }
    let (ok, out) = oxccl_out(&[&reshard[..], &["--lower", "--ctas", "2", "--owner", "balanced", "--verify"]].concat());
    assert!(ok && out.contains("lowered program verified on the CPU"), "{out}");
    for (args, want) in [
        (&["bench", "overlap", "--gemm", "1,2,3"][..], "--gemm is for --compute gemm, mma or wgmma, not fma"),
        (
            &["bench", "tma_trace", "--compute", "sleep", "--gemm", "128,128,32"],
            "--gemm is for --compute gemm, mma or wgmma, not sleep",
        ),
        (
            &["bench", "plan", "--algo", "hm-allgather", "-o", "min"],
            "-o/--op is for programs that reduce, not hm_allgather_2x4",
        ),
        (&["bench", "all_reduce", "-c", "2"], "invalid value '2' for '--check <CHECK>': 2 is not in 0..=1"),
        (&["bench", "all_reduce", "--mover", "simt", "--chunk", "8192"], "--chunk shapes the TMA mover's pipeline"),
        (&["bench", "reshard", "--mover", "simt", "--stages", "2"], "--stages shapes the TMA mover's pipeline"),
        (&["bench", "all_reduce", "--mover", "latency", "--issuers", "2"], "--mover latency has none"),
        (&["bench", "all_reduce", "--latency-below", "4Q"], "--latency-below"),
        (&["bench", "plan", "--algo", "hm-allreduce", "--mover", "simt", "--chunk", "4096"], "--chunk shapes the TMA"),
    ] {
        refused_before_any_gpu(args, want);
    }
}

/// The library's configuration refusals reach the user named by the flag they typed, not by the
/// field it sets (`--ctas`, not `max_ctas`).
#[test]
fn configuration_refusals_name_the_flag() {
    for (args, want) in [
        (&["bench", "all_reduce", "--threads", "2000"][..], "--threads: 2000 is not a multiple of 32 in 32..=1024"),
        (&["bench", "all_reduce", "--stages", "4", "--issuers", "3"], "--issuers: 3: the 4 stages must be a multiple"),
        (&["bench", "reshard", "--threads", "48"], "--threads: 48 is not a multiple of 32 in 32..=1024"),
        (&["bench", "reshard", "--ctas", "0"], "--ctas: must be at least 1"),
        (&["bench", "overlap", "--ctas", "300"], "--ctas: 300 is above 256"),
        (&["bench", "tma_trace", "--ctas", "2000"], "--ctas: 2000: give 1..=1024"),
        (&["bench", "reduce", "-b", "2G", "-e", "1G"], "-b: 2147483648 B is above the largest size (1073741824 B)"),
        // `-b` left at its default above `-e`: the message says the value is the default.
        (&["bench", "all_reduce", "-e", "64K"], "-b: 1048576 B, its default, is above -e's 65536 B"),
        (
            &["bench", "plan", "--algo", "ring-allreduce", "-e", "4K"],
            "-b: 1048576 B, its default, is above -e's 4096 B",
        ),
        // A program cannot run below one 16-byte grain per chunk: refused, not run larger.
        (
            &["bench", "plan", "--algo", "ring-allreduce", "--topo", "1x8", "-b", "4", "-e", "64"],
            "-b: 4 B is below the program's smallest size",
        ),
    ] {
        let (ok, err) = oxccl(args);
        assert!(!ok && err.contains(want), "{args:?}: {err}");
        for field in ["max_ctas", "chunk_bytes", "min_bytes", "max_bytes", "config."] {
            assert!(!err.contains(field), "{args:?}: {err}");
        }
    }
}

/// `oxccl verify` checks --count, --micro-batches and --slots once, before the first configuration:
/// one clear refusal, not one FAILED line per scheduler and TB allocator.
#[test]
fn verify_checks_its_sizes_once() {
    for (flag, value, want) in [
        ("--count", "0", "--count 0: a chunk needs at least one element"),
        ("--micro-batches", "0", "--micro-batches 0: give 1..=65536"),
        ("--micro-batches", "65537", "--micro-batches 65537: give 1..=65536"),
        ("--slots", "0", "--slots 0: a FIFO needs at least one slot"),
    ] {
        let (ok, out, err) = run(&["verify", "--algo", "hm-allreduce", "--topo", "2x4", "--all", flag, value]);
        assert!(!ok && out.is_empty() && err.contains(want), "{flag} {value}: {out}\n{err}");
        assert_eq!(err.lines().count(), 1, "{flag} {value}: {err}");
    }
    let (ok, out) = oxccl_out(&["verify", "--algo", "hm-allreduce", "--topo", "2x4", "--all", "--slots", "8"]);
    // The engine's line, then the eight schedules'.
    assert!(ok && out.lines().count() == 9 && out.lines().all(|l| l.contains(": OK (")), "{out}");
    assert!(out.lines().next().is_some_and(|l| l.contains("(engine)")), "{out}");
}

/// `oxccl bench` checks every flag before looking for a GPU: each of these is refused by the
/// flag's own message, with or without one, never with "no GPU".
#[test]
fn every_flag_is_checked_before_the_gpu_probe() {
    for (args, want) in [
        (&["bench", "all_reduce", "--gpus", "0"][..], "--gpus 0: give 1..=16"),
        (&["bench", "overlap", "--gpus", "17"], "--gpus 17: give 1..=16"),
        (&["bench", "movers", "--threads", "0"], "--threads: 0 is not a multiple of 32 in 32..=1024"),
        (&["bench", "movers", "--chunk", "0"], "--chunk: 0 is not a positive multiple of 16"),
        (&["bench", "movers", "--stages", "999"], "--stages: 999 is not in 1..=16"),
        (&["bench", "movers", "--ctas", "99999"], "--ctas: 99999 is above 256"),
        (
            &["bench", "plan", "--algo", "hm-allreduce", "--threads", "0"],
            "--threads: 0 is not a multiple of 32 in 32..=1024",
        ),
        (
            &["bench", "plan", "--algo", "hm-allreduce", "--mover", "simt", "--threads", "1024"],
            "--threads: 1024 is not a multiple of 32 in 32..=512",
        ),
        (&["bench", "plan", "--algo", "hm-allreduce", "--chunk", "0"], "--chunk: 0 is not a positive multiple of 16"),
        (&["bench", "reshard", "--domain-size", "0"], "--domain-size 0: give at least one rank per NVLink domain"),
    ] {
        let (ok, err) = oxccl(args);
        assert!(!ok && err.contains(want), "{args:?}: {err}");
        assert!(!err.contains("GPU to benchmark") && !err.contains("panicked"), "{args:?}: {err}");
    }
    if !cfg!(feature = "gemm") {
        let (ok, err) = oxccl(&["bench", "overlap", "--compute", "gemm"]);
        assert!(!ok && err.contains("--compute gemm: this build has no cuBLAS bindings"), "{err}");
    }
}

/// A smallest size below one element is refused, naming the smallest size, not quietly raised to
/// one element.
#[test]
fn a_smallest_size_of_no_element_is_refused() {
    for (args, want) in [
        (&["bench", "all_reduce", "-b", "0"][..], "-b: 0 B holds no 4-byte element: the smallest size is 4 B"),
        (
            &["bench", "reduce_scatter", "-d", "half", "-b", "1"],
            "-b: 1 B holds no 2-byte element: the smallest size is 2 B",
        ),
        (
            &["bench", "plan", "--algo", "ring-allreduce", "-b", "3"],
            "-b: 3 B holds no 4-byte element: the smallest size is 4 B",
        ),
    ] {
        refused_before_any_gpu(args, want);
    }
}

/// Sizes and counts that would be silently adjusted or never end are refused by flag: simulate's
/// size of 0, one past 2^53 B or past 2^64 B, a micro-batch size of 0 (or one beside
/// --micro-batches, which it would not shape), 0 micro-batches or slots; bench's -n and -w
/// above a million.
#[test]
fn nonsense_sizes_and_counts_are_refused() {
    let sim = ["simulate", "--algo", "ring-allreduce", "--topo", "1x4"];
    for (extra, want) in [
        (&["--size", "0"][..], "--size 0: give 1 B to 2^53 B"),
        (&["--size", "16000000000G"], "--size 16000000000G: give 1 B to 2^53 B"),
        (&["--size", "17179869184G"], "--size: size `17179869184G` is more than 2^64 - 1 bytes"),
        (&["--size", "99999999999999999999"], "--size: size `99999999999999999999` is more than 2^64 - 1 bytes"),
        (&["--mb-size", "0"], "--mb-size 0: give a micro-batch of at least 1 byte"),
        (&["--micro-batches", "4", "--mb-size", "2M"], "cannot be used with"),
        (&["--micro-batches", "0"], "--micro-batches 0: give 1..=65536"),
        (&["--slots", "0"], "--slots 0: a FIFO needs at least one slot"),
    ] {
        let args = [&sim[..], extra].concat();
        let (ok, out, err) = run(&args);
        assert!(!ok && out.is_empty() && err.contains(want), "{extra:?}: {out}\n{err}");
    }
    let (ok, out) = oxccl_out(&[&sim[..], &["--size", "8192G", "--mb-size", "1"]].concat());
    assert!(ok && out.contains("512 micro-batches per chunk"), "{out}");
    for (args, want) in [
        (&["bench", "all_reduce", "-n", "100000000000"][..], "-n 100000000000: give at most 1000000 timed iterations"),
        (&["bench", "movers", "-n", "1000001"], "-n 1000001: give at most 1000000 timed iterations"),
        (&["bench", "reshard", "-w", "2000000"], "-w 2000000: give at most 1000000 warm-up iterations"),
        (&["bench", "plan", "--algo", "ring-allreduce", "-w", "1000001"], "-w 1000001: give at most 1000000"),
    ] {
        refused_before_any_gpu(args, want);
    }
}

/// A negative number given to a numeric flag reaches that flag's value parser, which names the
/// value and the flag, rather than clap's advice to pass it after `--`.
#[test]
fn a_negative_number_is_refused_by_its_flag() {
    for (args, want) in [
        (&["bench", "all_reduce", "-b", "-5"][..], "invalid value '-5' for '--minbytes <MIN_BYTES>': bad size `-5`"),
        (&["bench", "all_reduce", "-e", "-5K"], "invalid value '-5K' for '--maxbytes <MAX_BYTES>': bad size `-5K`"),
        (&["bench", "all_reduce", "--ctas", "-1"], "invalid value '-1' for '--ctas <CTAS>'"),
        (&["bench", "all_reduce", "-n", "-3"], "invalid value '-3' for '--iters <ITERS>'"),
        (&["bench", "overlap", "--compute-ms", "-3"], "--compute-ms -3: give a time in (0, 60000] ms"),
        (&["bench", "movers", "--piece", "-16"], "invalid value '-16' for '--piece <PIECE>'"),
        (&["bench", "overlap", "--compute", "mma", "--gemm", "-1,2,3"], "invalid value '-1' for '--gemm <GEMM>'"),
        (&["bench", "reshard", "--shape", "-4,8"], "invalid value '-4' for '--shape <SHAPE>'"),
        (&["bench", "reshard", "--nvlink-gbps", "-1"], "--nvlink-gbps -1: give a positive bandwidth"),
        (&["demo", "--ranks", "-2"], "invalid value '-2' for '--ranks <RANKS>'"),
        (
            &["plan", "--algo", "ring-allreduce", "--topo", "1x4", "--instances", "-1"],
            "invalid value '-1' for '--instances",
        ),
        (&["verify", "--algo", "ring-allreduce", "--topo", "1x4", "--slots", "-1"], "invalid value '-1' for '--slots"),
        (&["simulate", "--algo", "ring-allreduce", "--topo", "1x4", "--size", "-1M"], "--size: bad size `-1M`"),
    ] {
        let (ok, err) = oxccl(args);
        assert!(!ok && err.contains(want), "{args:?}: {err}");
        assert!(!err.contains("unexpected argument") && !err.contains("use '--"), "{args:?}: {err}");
    }
}

/// `--procs` and its flags: refused where they do not fit, before any GPU is looked for; without
/// a GPU the per-rank benchmark says so before starting any process.
#[test]
fn per_rank_bench_flags_are_checked() {
    refused_before_any_gpu(&["bench", "all_reduce", "--rank-threads"], "--procs <N>");
    refused_before_any_gpu(&["bench", "all_reduce", "--buffers", "plain"], "--procs <N>");
    refused_before_any_gpu(&["bench", "all_reduce", "--procs", "0"], "--procs 0: give 1..=16");
    refused_before_any_gpu(&["bench", "all_reduce", "--procs", "17"], "--procs 17: give 1..=16");
    refused_before_any_gpu(
        &["bench", "all_reduce", "--procs", "2", "--buffers", "pool"],
        "invalid value 'pool' for '--buffers",
    );
    refused_before_any_gpu(&["bench", "all_reduce", "--procs", "2", "--ranks", "4"], "--procs sets the ranks");
    refused_before_any_gpu(&["bench", "all_reduce", "--ranks-per-node", "2"], "--procs <N>");
    refused_before_any_gpu(&["bench", "all_reduce", "--procs", "4", "--inter", "engine"], "--ranks-per-node <P>");
    refused_before_any_gpu(
        &["bench", "all_reduce", "--procs", "8", "--ranks-per-node", "3"],
        "--ranks-per-node 3: must divide the --procs 8 ranks",
    );
    refused_before_any_gpu(&["bench", "all_reduce", "--procs", "8", "--ranks-per-node", "0"], "--ranks-per-node 0");
    // CI has no GPU: the processes are not started (no rank's failure is reported).
    if std::env::var_os("OXCCL_REQUIRE_GPU").is_none() && !std::path::Path::new("/dev/nvidia0").exists() {
        let (ok, err) = oxccl(&["bench", "all_reduce", "--procs", "2", "-b", "1M", "-e", "1M"]);
        assert!(!ok && err.contains("no GPU to benchmark on") && !err.contains("rank"), "{err}");
    }
}

/// `oxccl tables`: `--check` says a marked table would change and fails; without it the table is
/// rewritten in place, after which `--check` passes; a folder without machine.txt is named.
#[test]
fn tables_are_rewritten_from_a_snapshot_folder() {
    let dir = std::env::temp_dir().join(format!("oxccl-cli-tables-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("machine.txt"),
        "date (UTC): 2026-12-07 05:00:00\ncommit: abc1234\n0, NVIDIA H200, 580.159.04\n",
    )
    .unwrap();
    std::fs::write(dir.join("summary.tsv"), "name\tstatus\tseconds\tcommand\nsmall\tok\t1\toxccl bench\n").unwrap();
    std::fs::write(dir.join("small.jsonl"), "{\"size\":8,\"oop_us\":4.83,\"ip_us\":4.85}\n").unwrap();
    let doc = dir.join("PERF.md");
    std::fs::write(
        &doc,
        "a\n<!-- snap-table rows=size cells=oop_us/ip_us small=\"graph\" -->\nold\n<!-- /snap-table -->\n",
    )
    .unwrap();
    let (d, p) = (dir.to_str().unwrap(), doc.to_str().unwrap());
    let (ok, out, err) = run(&["tables", d, p, "--check"]);
    assert!(!ok && out.contains("PERF.md:2: would be rewritten") && err.contains("tables differ"), "{out}{err}");
    let (ok, out, err) = run(&["tables", d, p]);
    assert!(ok && out.contains("PERF.md:2: rewritten from"), "{out}{err}");
    let text = std::fs::read_to_string(&doc).unwrap();
    assert!(text.contains("| 8 B | 4.83 / 4.85 |") && !text.contains("old"), "{text}");
    assert!(run(&["tables", d, p, "--check"]).0);
    let (ok, err) = oxccl(&["tables", &format!("{d}/missing"), p]);
    assert!(!ok && err.contains("machine.txt"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}
