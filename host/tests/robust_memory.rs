//! Sizes the machine cannot hold are typed errors, estimated before anything is allocated: the
//! generators ([`Algorithm::generate_within`]), the compiler ([`Options::memory_limit`]) and the CPU
//! executor ([`exec::verify_within`], per element size). Under an address-space limit
//! (`ulimit -v`) the defaults see the limit and nothing aborts.

use oxccl_host::compile::memory::{self, TooLarge};
use oxccl_host::compile::{CompileError, OpSource, Options, compile, compile_streaming, estimate_bytes, plan_bytes};
use oxccl_host::exec::{self, ExecError, ExecOptions, ReduceOp};
use oxccl_host::program::generators::Algorithm;
use std::process::Command;

#[test]
fn a_compilation_over_its_limit_is_refused_naming_program_and_sizes() {
    let src = Algorithm::HmAllReduce.source(16, 8).unwrap();
    let sizes = oxccl_host::compile::Sizes::of(&src);
    let need = estimate_bytes(&sizes);
    let opts = Options { memory_limit: Some(need - 1), ..Options::default() };
    let Err(CompileError::TooLarge(e)) = compile_streaming(&src, &opts, &mut drop) else { panic!("not refused") };
    assert_eq!((e.needed, e.limit), (need, Some(need - 1)));
    let text = e.to_string();
    assert!(text.contains("hm_allreduce_16x8") && text.contains(&format!("{} ops", src.op_count())), "{text}");
    // Streaming fits twice the estimate (checked again before `schedule` and `emit` with the links
    // and connections then known); keeping the whole plan needs the plan too.
    let opts = Options { memory_limit: Some(2 * need), ..Options::default() };
    assert!(compile_streaming(&src, &opts, &mut drop).is_ok());
    assert!(matches!(compile(&src, &opts), Err(CompileError::TooLarge(_))));
    let opts = Options { memory_limit: Some(2 * need + plan_bytes(sizes.tasks())), ..opts };
    assert!(compile(&src, &opts).is_ok());
}

#[test]
fn the_8192_gpu_compilations_are_estimated_within_4_gb() {
    for (algo, nodes, gpus) in [
        (Algorithm::HmAllReduce, 1024, 8),
        (Algorithm::RingAllReduce, 1, 8192),
        (Algorithm::DirectAllToAll, 1, 4096),
        (Algorithm::DirectAllReduce, 1, 4096),
    ] {
        let src = algo.source(nodes, gpus).unwrap();
        let need = estimate_bytes(&oxccl_host::compile::Sizes::of(&src));
        eprintln!("{algo} {nodes}x{gpus}: {need} B");
        assert!(need < 4_000_000_000, "{algo} {nodes}x{gpus}: {need} B");
    }
}

#[test]
fn verification_memory_counts_the_element_size() {
    let p = Algorithm::RingAllReduce.generate(1, 4).unwrap();
    let plan = compile(&p, &Options::default()).unwrap();
    let eo = ExecOptions::default();
    let (f32s, f64s) = (exec::verify_bytes(&plan, 1 << 20, 4, &eo), exec::verify_bytes(&plan, 1 << 20, 8, &eo));
    assert!(f64s > f32s * 19 / 10, "{f32s} {f64s}");
    let r = exec::verify_within::<f64>(&plan, ReduceOp::Sum, 1 << 20, &eo, f64s - 1);
    let Err(ExecError::TooLarge(e)) = r else { panic!("not refused: {r:?}") };
    assert!(e.to_string().contains("f64") && e.needed == f64s, "{e}");
    assert!(exec::verify_within::<f32>(&plan, ReduceOp::Sum, 1 << 20, &eo, f64s - 1).is_ok());
    // Before a plan exists, the buffers alone: 2^24 f64 elements per chunk on 4 ranks is GBs.
    let e = exec::check_verify_memory(&p.layout, 1 << 24, 8, 1 << 30).unwrap_err();
    assert!(e.needed > 2 << 30, "{e}");
    assert!(exec::check_verify_memory(&p.layout, 16, 8, 1 << 30).is_ok());
}

#[test]
fn a_failed_allocation_is_an_error() {
    let e: TooLarge = memory::try_vec::<u128>(usize::MAX / 64, "a table").unwrap_err();
    assert!(e.limit.is_none() && e.to_string().contains("a table"));
}

/// Runs in a child process under `ulimit -v`, from [`nothing_aborts_under_an_address_space_limit`].
#[test]
fn child_under_an_address_space_limit() {
    if std::env::var_os("OXCCL_MEMORY_CHILD").is_none() {
        return;
    }
    let limit = memory::default_limit();
    assert!(limit < 1 << 30, "the default limit sees ulimit -v: {limit}");
    // Stored, the 8192-rank ring takes 7 GB: refused before allocating.
    let e = Algorithm::RingAllReduce.generate(1, 8192).unwrap_err().to_string();
    assert!(e.contains("GiB"), "{e}");
    // Compiled from its generator it needs about 2 GB: refused by the estimate.
    let src = Algorithm::RingAllReduce.source(1, 8192).unwrap();
    let r = compile_streaming(&src, &Options::default(), &mut drop);
    assert!(matches!(r, Err(CompileError::TooLarge(_))), "{r:?}");
    // A verification of 2^24 f64 elements per chunk (within the element cap, 8 GiB of buffers):
    // refused.
    let p = Algorithm::RingAllReduce.generate(1, 4).unwrap();
    let plan = compile(&p, &Options::default()).unwrap();
    let r = exec::verify::<f64>(&plan, ReduceOp::Sum, 1 << 24, &ExecOptions::default());
    assert!(matches!(r, Err(ExecError::TooLarge(_))), "{r:?}");
    // What fits still runs.
    let src = Algorithm::HmAllReduce.source(16, 8).unwrap();
    assert!(compile_streaming(&src, &Options::default(), &mut drop).is_ok());
    assert_eq!(exec::verify::<f64>(&plan, ReduceOp::Sum, 64, &ExecOptions::default()).unwrap().wrong, 0);
}

#[test]
fn nothing_aborts_under_an_address_space_limit() {
    if !cfg!(target_os = "linux") || std::env::var_os("OXCCL_MEMORY_CHILD").is_some() {
        return;
    }
    let exe = std::env::current_exe().unwrap();
    // 768 MiB of address space: the test binary and its threads fit, the requests above do not.
    let out = Command::new("sh")
        .arg("-c")
        .arg("ulimit -v 786432 && exec \"$0\" --exact child_under_an_address_space_limit --test-threads 1")
        .arg(&exe)
        .env("OXCCL_MEMORY_CHILD", "1")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "the child failed or aborted ({:?}):\n{text}", out.status);
    assert!(text.contains("1 passed"), "{text}");
}
