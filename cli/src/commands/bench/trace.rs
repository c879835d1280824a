//! `oxccl bench tma-trace`: a diagnostic, the TMA copy's issuing loop timed item by item alone and
//! beside a compute load (see [`bench::tma_trace`]).

use super::{CliResult, ComputeArgs, Timing, check_timing, parse_size, print_json};
use crate::bench;

/// Flags of `oxccl bench tma-trace`: one TMA copy of `-e` bytes over `--ctas` CTAs of `--issuers`
/// warps.
#[derive(clap::Args, Clone, Debug)]
pub struct TraceArgs {
    /// Bytes copied (K, M, G suffixes are powers of 1024).
    #[arg(short = 'e', long = "maxbytes", default_value = "1G", value_parser = parse_size, allow_hyphen_values = true)]
    pub bytes: u64,
    /// CTAs.
    #[arg(long, default_value_t = 8, allow_negative_numbers = true)]
    pub ctas: u32,
    /// Issuing warps per CTA, each with its own ring.
    #[arg(long, default_value_t = 1, allow_negative_numbers = true)]
    pub issuers: u32,
    /// Bytes per item.
    #[arg(long, default_value_t = 32768, allow_negative_numbers = true)]
    pub chunk: u32,
    /// Stages per issuing warp.
    #[arg(long, default_value_t = 4, allow_negative_numbers = true)]
    pub stages: u32,
    /// Rounds the ring's refill lags behind the stores, 1..=min(stages / round, 8) (default half the
    /// rounds of stages, at least one, as the engine's TMA mover).
    #[arg(long, allow_negative_numbers = true)]
    pub lag: Option<u32>,
    /// Items per round, 1 (the engine's item-by-item ring) or 4 (rounds of four items through a
    /// multiple of four stages, each step of a round, refill, poll and store, as four independent
    /// instructions).
    #[arg(long, default_value_t = 1, allow_negative_numbers = true)]
    pub round: u32,
    /// Copy without per-item trace records (no clock read or store between the loop's steps; the
    /// medians print as 0).
    #[arg(long)]
    pub untraced: bool,
    /// The copies carry an L2 evict-first cache policy.
    #[arg(long)]
    pub l2_evict_first: bool,
    /// Copy through 2-D tensor maps (`cp.async.bulk.tensor`, 1 KiB rows, one box per item; the chunk
    /// whole rows, at most 256) instead of plain bulk copies.
    #[arg(long)]
    pub tensor: bool,
    /// The issuer's timed chain.
    #[arg(long, value_enum, default_value = "alu")]
    pub chain: ChainArg,
    /// Launch the compute before the copy (default: the copy first).
    #[arg(long)]
    pub compute_first: bool,
    #[command(flatten)]
    pub(crate) compute: ComputeArgs,
    #[command(flatten)]
    pub(crate) timing: Timing,
    /// Print JSON lines after the table.
    #[arg(long)]
    pub json: bool,
}

/// The issuer's timed chain.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChainArg {
    /// Two ALU instructions per step.
    Alu,
    /// Two `fma.rn.f32`, the FMA load's own pipe.
    Fma,
    /// A dependent `ld.shared` (the memory pipe).
    Shared,
    /// Eight independent ALU streams: 16 instructions per step that need not wait on each other.
    Ilp,
}

/// The diagnostic's parameters, checked (before any GPU is looked for).
pub fn check(a: &TraceArgs) -> Result<bench::TmaTraceBench, Box<dyn std::error::Error>> {
    check_timing(a.timing.iters, a.timing.warmup)?;
    // The default lag as the engine's, over the rounds of stages (a shape `validate` refuses keeps
    // a lag of 1 and is refused there by its round).
    let sets = a.stages.checked_div(a.round).unwrap_or(0);
    let b = bench::TmaTraceBench {
        compute: a.compute.load()?,
        compute_threads: 256,
        compute_ctas_per_sm: a.compute.fma_ctas_per_sm.unwrap_or(4),
        compute_ms: a.compute.compute_ms,
        ctas: a.ctas,
        warps: a.issuers,
        bytes: a.bytes,
        chunk: a.chunk,
        stages: a.stages,
        round: a.round,
        lag: a
            .lag
            .unwrap_or(oxccl_kernels::abi::refill_lag(sets.max(1)).min(oxccl_bench_kernels::trace_layout::MAX_LAG)),
        untraced: a.untraced,
        evict_first: a.l2_evict_first,
        tensor: a.tensor,
        chain_op: match a.chain {
            ChainArg::Alu => bench::ChainOp::Alu,
            ChainArg::Fma => bench::ChainOp::Fma,
            ChainArg::Shared => bench::ChainOp::Shared,
            ChainArg::Ilp => bench::ChainOp::Ilp,
        },
        compute_first: a.compute_first,
        warmup: a.timing.warmup,
        iters: a.timing.iters,
    };
    b.validate()?;
    Ok(b)
}

/// Runs the diagnostic and prints its table.
pub fn run(a: TraceArgs) -> CliResult {
    let b = check(&a)?;
    let ctx = oxccl::engine::probe_gpu().map_err(|why| format!("no GPU to benchmark on: {why}"))?;
    let device = ctx.name().unwrap_or_default();
    let stream = ctx.default_stream();
    println!("# oxccl tma-trace: {}", super::command_line());
    println!(
        "# device: {device}; {} B copied by {} CTAs x {} issuing warps ({} B each), {} B chunks, {} stages per warp, \
         {}, {} B of shared memory per CTA{}{}{}, chain {}{}; beside {}{}",
        b.bytes_per_warp() * (b.ctas * b.warps) as u64,
        b.ctas,
        b.warps,
        b.bytes_per_warp(),
        b.chunk,
        b.stages,
        if b.round == 1 {
            format!("refill {} behind ({} loads ahead)", b.lag, b.stages - b.lag)
        } else {
            format!(
                "in rounds of {} items (each step of a round as independent instructions), refill {} rounds behind \
                 ({} rounds of loads ahead)",
                b.round,
                b.lag,
                b.stages / b.round - b.lag
            )
        },
        b.smem_bytes(),
        if b.evict_first { ", L2 evict-first" } else { "" },
        if b.tensor { ", tensor copies (2-D maps, 1 KiB rows)" } else { "" },
        if b.untraced { ", untraced (no per-item records)" } else { "" },
        b.chain_op.name(),
        if b.compute_first { ", compute launched first" } else { "" },
        b.compute.name(),
        match b.compute {
            bench::ComputeLoad::Fma | bench::ComputeLoad::Sleep =>
                format!(" ({} CTAs of {} threads per SM)", b.compute_ctas_per_sm, b.compute_threads),
            _ => String::new(),
        }
    );
    let rows = bench::tma_trace(&stream, &b)?;
    println!(
        "# medians over the items of every warp, in SM cycles: period between store commits (of rounds, in rounds); \
         latency from load"
    );
    println!("# issued to landing seen; store from landing seen to store committed; refill from a commit to the next");
    println!(
        "# load issued; landed1st: items whose data had landed at the first look; chain: cycles per dependent step"
    );
    println!("# (timed at the start, beside the compute; the medians include items copied after the compute ended)");
    println!(
        "# {:>28} {:>9} {:>8} {:>7} {:>8} {:>8} {:>7} {:>8} {:>9} {:>7} {:>10} {:>11} {:>11} {:>7}",
        "beside",
        "copy(ms)",
        "GB/s",
        "chain",
        "period",
        "latency",
        "store",
        "refill",
        "landed1st",
        "polls",
        "slots%4",
        "compute(ms)",
        "compute||",
        "#wrong"
    );
    for r in &rows {
        let s = r.warp_slots_mod4;
        println!(
            "  {:>28} {:>9.3} {:>8.1} {:>7.2} {:>8.0} {:>8.0} {:>7.0} {:>8.0} {:>9.3} {:>7.1} {:>10} {:>11.3} {:>11.3} {:>7}",
            r.beside,
            r.copy_ms,
            r.gbps,
            r.chain_cycles_per_step,
            r.period,
            r.latency,
            r.store,
            r.refill,
            r.landed_first,
            r.polls,
            format!("{}/{}/{}/{}", s[0], s[1], s[2], s[3]),
            r.compute_alone_ms,
            r.compute_beside_ms,
            r.wrong
        );
    }
    print_json(&rows, a.json)?;
    if rows.iter().any(|r| r.wrong != 0) {
        return Err(crate::commands::WrongResult::boxed("the traced copy is wrong (see #wrong)"));
    }
    Ok(())
}
