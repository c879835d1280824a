//! `oxccl verify`: run a program on the CPU for every rank and compare with the collective's CPU
//! reference, twice: as the engine runs it (its lowering, level by level: what `run_program` runs)
//! and as its compiled schedule (the plan the simulator times: thread blocks, FIFOs,
//! micro-batches). Exits non-zero on any mismatch, deadlock or FIFO disorder.
//!
//! ```text
//! oxccl verify --xml host/tests/data/msccl/ndv4_ap-1pass.xml
//! oxccl verify --algo hm-allreduce --topo 2x4 --all
//! ```

use super::CliResult;
use super::plan::ProgramArgs;
use crate::progress::{LONG_RUN, Progress};
use oxccl_host::compile::direct::{DirectError, VerifyError};
use oxccl_host::compile::{self, Options, Plan, Scheduler, TbAlloc};
use oxccl_host::exec::{self, ExecError, ExecOptions, ReduceOp, VerifyReport};
use oxccl_host::program::BufferLayout;
use oxccl_host::sim::MAX_MICRO_BATCHES;

/// Flags of `oxccl verify`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// The program and how to compile it.
    #[command(flatten)]
    pub program: ProgramArgs,
    /// Micro-batches per chunk, 1..=65536.
    #[arg(long, default_value_t = 4, allow_negative_numbers = true)]
    pub micro_batches: u32,
    /// FIFO slots per connection, at least 1 (default: 8, or what the plan needs if more; fewer
    /// than it needs may deadlock, which the verification reports).
    #[arg(long, allow_negative_numbers = true)]
    pub slots: Option<u32>,
    /// Elements per chunk, at least 1 (every rank's storage at most 2^28 elements in all).
    #[arg(long, default_value_t = 16, allow_negative_numbers = true)]
    pub count: usize,
    /// Element type: f32, f64, i32, i64.
    #[arg(long, default_value = "f32")]
    pub dtype: String,
    /// Reduction: sum, min, max, prod (programs have no avg).
    #[arg(long, default_value = "sum")]
    pub redop: String,
    /// Verify every scheduler × TB allocator, not only the one given.
    #[arg(long)]
    pub all: bool,
}

/// The engine's verdict ([`oxccl_host::compile::direct::verify`]) at `args.count` elements per
/// chunk.
fn run_engine(
    program: &oxccl_host::program::Program,
    args: &Args,
    op: ReduceOp,
) -> Result<(VerifyReport, usize), VerifyError> {
    use oxccl_host::compile::direct::verify;
    use oxccl_kernels::abi::DType;
    match args.dtype.as_str() {
        "f64" => verify::<f64>(program, DType::F64, op, args.count),
        "i32" => verify::<i32>(program, DType::I32, op, args.count),
        "i64" => verify::<i64>(program, DType::I64, op, args.count),
        _ => verify::<f32>(program, DType::F32, op, args.count),
    }
}

fn run_one(plan: &Plan, args: &Args, op: ReduceOp, opts: &ExecOptions) -> Result<VerifyReport, exec::ExecError> {
    match args.dtype.as_str() {
        "f64" => exec::verify::<f64>(plan, op, args.count, opts),
        "i32" => exec::verify::<i32>(plan, op, args.count, opts),
        "i64" => exec::verify::<i64>(plan, op, args.count, opts),
        _ => exec::verify::<f32>(plan, op, args.count, opts),
    }
}

/// Refuses, once for every configuration, `--count`, `--micro-batches` and `--slots` that no
/// verification of `layout`'s program could run with.
fn check_sizes(args: &Args, layout: &BufferLayout) -> CliResult {
    if args.count == 0 {
        return Err("--count 0: a chunk needs at least one element".into());
    }
    if !(1..=MAX_MICRO_BATCHES).contains(&args.micro_batches) {
        return Err(format!("--micro-batches {}: give 1..={MAX_MICRO_BATCHES}", args.micro_batches).into());
    }
    if args.slots == Some(0) {
        return Err("--slots 0: a FIFO needs at least one slot".into());
    }
    exec::check_verify_size(layout, args.count).map_err(|why| format!("--count {}: {why}", args.count))?;
    Ok(())
}

/// Verifies the program as the engine runs it, then the plan of each configuration asked for (one,
/// or with `--all` every scheduler × TB allocator) on the CPU executor, one line each; an `Err` if
/// any failed, or, before any is run, if a flag is out of range for all of them. What the engine
/// cannot run (a chunk off 16 bytes, more ranks than one launch holds) is said, not counted as a
/// failure; a program whose engine buffers would not fit in memory is refused as bad input.
pub fn run(args: Args) -> CliResult {
    if !["f32", "f64", "i32", "i64"].contains(&args.dtype.as_str()) {
        return Err(format!("--dtype `{}`: expected f32, f64, i32 or i64", args.dtype).into());
    }
    let op: ReduceOp = exec::parse_op(&args.redop)?;
    let loaded = args.program.load()?;
    check_sizes(&args, &loaded.program.layout)?;
    let configs: Vec<Options> = if args.all {
        Scheduler::ALL.iter().flat_map(|&s| TbAlloc::ALL.iter().map(move |&a| Options::new(s, a))).collect()
    } else {
        vec![args.program.options()?]
    };
    let mut failures = 0;
    let layout = &loaded.program.layout;
    let redop = if layout.collective.reduces() { format!(" {}", args.redop) } else { String::new() };
    let head = format!(
        "verify {} (engine): {} {} ranks, {} elements per chunk, {}{redop}",
        loaded.program.name,
        layout.collective.program_name(),
        layout.ranks,
        args.count,
        args.dtype
    );
    match run_engine(&loaded.program, &args, op) {
        Ok((r, levels)) if r.wrong == 0 => {
            println!("{head}: OK ({} elements checked, {levels} launches)", r.checked)
        }
        Ok((r, _)) => {
            failures += 1;
            let (rank, i) = r.first.first().copied().unwrap_or((0, 0));
            println!("{head}: FAILED, {} of {} elements wrong (first: rank {rank}, index {i})", r.wrong, r.checked);
        }
        // What run_program would refuse (a chunk off 16 bytes, more ranks than a launch holds, a
        // level past the descriptors) is said; a lowering that fails its own checks is a failure.
        Err(VerifyError::Lower(
            e @ (DirectError::Options { .. } | DirectError::Ranks { .. } | DirectError::TooLarge { .. }),
        )) => println!("{head}: not run, the engine refuses it: {e}"),
        Err(VerifyError::Inputs(ExecError::TooLarge(e))) => return Err(format!("--count {}: {e}", args.count).into()),
        Err(e) => {
            failures += 1;
            println!("{head}: FAILED, {e}");
        }
    }
    let progress = Progress::after("verify", configs.len() as u64, false, LONG_RUN);
    for o in &configs {
        let plan = compile::compile(&loaded.program, o)?;
        let slots = args.slots.unwrap_or_else(|| plan.stats.fifo_slots_needed.max(8));
        let opts = ExecOptions { micro_batches: args.micro_batches, fifo_slots: slots };
        let head = format!(
            "verify {} (schedule {}, {}): {} {} ranks, {} elements per chunk, {}{redop}, {} micro-batches, {} FIFO slots",
            plan.name,
            plan.scheduler,
            plan.tb_alloc,
            plan.layout.collective.program_name(),
            plan.layout.ranks,
            args.count,
            args.dtype,
            args.micro_batches,
            slots
        );
        match run_one(&plan, &args, op, &opts) {
            Ok(r) if r.wrong == 0 => progress.println(format_args!("{head}: OK ({} elements checked)", r.checked)),
            Ok(r) => {
                failures += 1;
                let (rank, i) = r.first.first().copied().unwrap_or((0, 0));
                progress.println(format_args!(
                    "{head}: FAILED, {} of {} elements wrong (first: rank {rank}, index {i})",
                    r.wrong, r.checked
                ));
            }
            Err(e) => {
                failures += 1;
                progress.println(format_args!("{head}: FAILED, {e}"));
            }
        }
        progress.step(format!("{} / {}", plan.scheduler, plan.tb_alloc));
    }
    drop(progress);
    if failures > 0 {
        return Err(super::WrongResult::boxed(format!("{failures} of {} checks failed", configs.len() + 1)));
    }
    Ok(())
}
