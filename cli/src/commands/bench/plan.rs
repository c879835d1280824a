//! `oxccl bench plan --algo ...|--xml ... --exec compiled|interpreted`: a lowered ResCCL plan on
//! virtual ranks, one nccl-tests row per size.

use super::{CliResult, MoverArg, SweepArgs, check_gpus, contexts, finish_rows, placement, print_json, rank_streams};
use crate::bench;
use crate::commands::{Dtype, Op};
use crate::progress::Progress;
use oxccl_host::compile::{Scheduler, TbAlloc};
use oxccl_kernels::abi::PlanMode;

/// Flags of `oxccl bench plan`.
#[derive(clap::Args, Clone, Debug)]
#[command(group(clap::ArgGroup::new("source").required(true).args(["algo", "xml"])))]
pub struct PlanArgs {
    /// Built-in algorithm: ring-allreduce, hm-allreduce, hm-allgather, ... (see `oxccl plan`).
    #[arg(long)]
    pub algo: Option<String>,
    /// MSCCL XML algorithm file.
    #[arg(long)]
    pub xml: Option<std::path::PathBuf>,
    /// With --algo: NODESxGPUS (default 1x8 for ring algorithms, 2x4 otherwise); with --xml: which
    /// ranks share a node.
    #[arg(long)]
    pub topo: Option<String>,
    /// `compiled` (HPDS schedule, state-based thread blocks, a segment per sub-pipeline),
    /// `interpreted` (MSCCL's shape: algorithm-level schedule, a TB per connection and stage, the
    /// whole list re-walked per micro-batch; same kernels, same mover) or `direct` (no FIFOs: each
    /// level of the program one launch of the collective engine, through `run_program`; one GPU).
    #[arg(long, value_enum, default_value = "compiled")]
    pub exec: ExecArg,
    /// Micro-batches per chunk, 1..=65536.
    #[arg(long, default_value_t = 4, allow_negative_numbers = true)]
    pub micro_batches: u32,
    /// Replicate the program K times over K-times finer chunks.
    #[arg(long, default_value_t = 1, allow_negative_numbers = true)]
    pub instances: u32,
    /// With --instances: every instance on the program's channels, or each on channels (and thread
    /// blocks) of its own, as MSCCL's instances.
    #[arg(long = "instance-channels", value_enum, default_value = "shared")]
    pub instance_channels: ChannelsArg,
    /// FIFO slots per connection, at least 1 (default: what the plan needs, at least 2).
    #[arg(long, allow_negative_numbers = true)]
    pub slots: Option<u32>,
    #[command(flatten)]
    pub(crate) sweep: SweepArgs,
    /// Element type (compiled plans reduce f32, f16, bf16, i32 and u32).
    #[arg(short = 'd', long = "datatype", visible_alias = "dtype", value_enum, default_value = "f32")]
    pub dtype: Dtype,
    /// Reduction operator, for plans that reduce.
    #[arg(short = 'o', long = "op", value_enum)]
    pub op: Option<Op>,
    /// Ranks on the first N GPUs (rank r on GPU r mod N), 1..=16.
    #[arg(long, allow_negative_numbers = true)]
    pub gpus: Option<usize>,
    /// Data mover.
    #[arg(long, value_enum, default_value = "tma")]
    pub mover: MoverArg,
    /// With --exec direct: CTAs per rank (default: each rank's share of the SMs).
    #[arg(long, allow_negative_numbers = true)]
    pub ctas: Option<u32>,
    /// Threads per CTA.
    #[arg(long, allow_negative_numbers = true)]
    pub threads: Option<u32>,
    /// Bytes per TMA stage of the plan kernels.
    #[arg(long, allow_negative_numbers = true)]
    pub chunk: Option<u32>,
    /// Print JSON lines after the table.
    #[arg(long)]
    pub json: bool,
}

/// A JSON line of `oxccl bench plan`: the nccl-tests row, with the plan it ran and how, so that
/// `oxccl plot` can set compiled against interpreted runs.
#[derive(Clone, Debug, serde::Serialize)]
pub struct PlanRow {
    /// The nccl-tests row.
    #[serde(flatten)]
    pub row: bench::CollectiveRow,
    /// The plan's name.
    pub plan: String,
    /// `compiled` or `interpreted` (`--exec`).
    pub exec: String,
    /// Share of the TBs' time spent waiting ([`bench::PlanBenchInfo::idle_share`]; `null` for
    /// `--exec direct`).
    pub idle_share: Option<f64>,
}

/// How a plan runs.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExecArg {
    /// HPDS schedule, state-based thread blocks, the micro-batch loop inside the kernel.
    Compiled,
    /// MSCCL's shape: algorithm-level schedule, a TB per connection and stage.
    Interpreted,
    /// No FIFOs: every level of the program (ops with no hazard between them) one launch of the
    /// collective engine, data moved straight between the ranks' buffers (virtual ranks of one GPU).
    Direct,
}

/// Channels of the instances.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChannelsArg {
    /// Every instance on the program's channels.
    Shared,
    /// Each instance on channels of its own.
    Separate,
}

/// The benchmark and its program's shape, checked and compiled before any GPU is looked for.
pub fn check(a: &PlanArgs) -> Result<(bench::PlanBench, (u32, u32)), Box<dyn std::error::Error>> {
    use oxccl::compiled::CompiledConfig;
    let (mode, scheduler, tb_alloc) = match a.exec {
        ExecArg::Compiled | ExecArg::Direct => (PlanMode::Compiled, Scheduler::Hpds, TbAlloc::State),
        ExecArg::Interpreted => (PlanMode::Interpreted, Scheduler::Algorithm, TbAlloc::PerConn),
    };
    check_gpus(a.gpus)?;
    let sweep = a.sweep.sweep()?;
    let topo = a
        .topo
        .clone()
        .or_else(|| a.algo.as_ref().map(|n| if n.starts_with("ring") { "1x8".to_string() } else { "2x4".to_string() }));
    let program = crate::commands::plan::ProgramArgs {
        algo: a.algo.clone(),
        xml: a.xml.clone(),
        program: None,
        topo,
        instances: a.instances,
        instance_channels: clap::ValueEnum::to_possible_value(&a.instance_channels)
            .map_or_else(String::new, |v| v.get_name().into()),
        scheduler: scheduler.to_string(),
        tb_alloc: tb_alloc.to_string(),
    };
    // The launch limit first: a program of thousands of ranks takes long to generate and compile.
    let max_ranks = oxccl_kernels::abi::MAX_RANKS;
    let too_many = |ranks: u64| format!("{ranks} ranks: a launch addresses at most {max_ranks}");
    if let Some(topo) = &program.topo {
        let (n, g) = crate::commands::plan::parse_topo(topo)?;
        let ranks = u64::from(n) * u64::from(g);
        if ranks > max_ranks as u64 {
            return Err(format!("--topo {topo}: {}", too_many(ranks)).into());
        }
    }
    let loaded = program.load()?;
    if loaded.program.ranks() as usize > max_ranks {
        return Err(too_many(loaded.program.ranks().into()).into());
    }
    let plan = oxccl_host::compile::compile(&loaded.program, &program.options()?)?;
    if a.op.is_some() && !plan.layout.collective.reduces() {
        return Err(format!(
            "-o/--op is for plans that reduce, not {} (its {} reduces nothing)",
            plan.name,
            plan.layout.collective.name()
        )
        .into());
    }
    match a.exec {
        ExecArg::Direct if a.slots.is_some() => return Err("--slots sizes FIFOs; --exec direct has none".into()),
        ExecArg::Direct if a.gpus.is_some_and(|g| g > 1) => {
            return Err("--exec direct runs on virtual ranks of one GPU (--gpus 1)".into());
        }
        ExecArg::Compiled | ExecArg::Interpreted if a.ctas.is_some() => {
            return Err("--ctas is for --exec direct (a compiled plan has its thread blocks)".into());
        }
        _ => {}
    }
    if a.mover == MoverArg::Simt && a.chunk.is_some() {
        return Err("--chunk shapes the TMA mover's pipeline; --mover simt has none".into());
    }
    let config = CompiledConfig {
        mover: a.mover.into(),
        threads: a.threads,
        stage_bytes: a.chunk,
        timeout: std::time::Duration::from_secs(60),
    };
    let b = bench::PlanBench {
        name: plan.name.clone(),
        plan,
        mode,
        dtype: a.dtype.device()?,
        op: a.op.unwrap_or(Op::Sum).into(),
        micro_batches: a.micro_batches,
        slots: a.slots,
        sweep,
        config,
        direct: (a.exec == ExecArg::Direct).then(|| bench::DirectRun { program: loaded.program.clone(), ctas: a.ctas }),
        traffic: loaded.program.traffic_chunks(),
    };
    // The sweep, the launch configuration and the plan lowered at every size.
    b.validate()?;
    Ok((b, (loaded.nodes, loaded.gpus_per_node)))
}

/// Runs the plan at every size and prints the table.
pub fn run(a: PlanArgs) -> CliResult {
    let (b, (nodes, gpus_per_node)) = check(&a)?;
    let ranks = b.plan.layout.ranks as usize;
    // One stream per virtual rank: more than the driver's default eight hardware queues must be
    // asked for before CUDA starts.
    if std::env::var_os("CUDA_DEVICE_MAX_CONNECTIONS").is_none() {
        // SAFETY: the CLI is single-threaded here and CUDA is not initialised yet.
        unsafe { std::env::set_var("CUDA_DEVICE_MAX_CONNECTIONS", "32") };
    }
    let gpus = contexts(a.gpus)?;
    let ctx = gpus[0].clone();
    let stream = ctx.default_stream();
    let streams = rank_streams(&gpus, ranks, true)?;
    let l = &b.plan.layout;
    let exec = clap::ValueEnum::to_possible_value(&a.exec).map_or_else(String::new, |v| v.get_name().into());
    println!("# oxccl compiled plan {} ({exec}): {}", b.name, super::command_line());
    println!(
        "# device: {}, {} {} ({}x{}), {}, {} chunks ({} instance{}, channels {:?}), mover {:?}, {} micro-batches, schedule {} / tb-alloc {}",
        ctx.name().unwrap_or_default(),
        ranks,
        placement(gpus.len(), ranks),
        nodes,
        gpus_per_node,
        if l.in_place { "in place" } else { "out of place" },
        l.chunks,
        a.instances,
        if a.instances == 1 { "" } else { "s" },
        a.instance_channels,
        a.mover,
        a.micro_batches,
        b.plan.scheduler,
        b.plan.tb_alloc
    );
    println!("{}", bench::NCCL_HEADER);
    // On one GPU the plan's bytes all go through the same memory: its roofline, as the collectives'.
    let roofline = bench::Roofline::before(&stream, gpus.len() == 1)?;
    let mut first = true;
    let mut json_rows = Vec::new();
    let progress = Progress::new(&b.name, b.sweep.sizes().count() as u64, a.json);
    let rows = bench::plan_bench(&stream, &streams, &b, |row, info| {
        if first {
            match info.levels {
                Some(levels) => progress.println(format_args!(
                    "# direct: {levels} levels (a launch each), {} CTAs per rank, {} TMA slots per stage",
                    info.tbs_per_rank, info.slots
                )),
                None => progress.println(format_args!(
                    "# {} TBs per rank (one CTA each), {} FIFO slots, {} threads per CTA, TMA stage {} B, {} registers",
                    info.tbs_per_rank, info.slots, info.threads, info.stage_bytes, info.registers
                )),
            }
            first = false;
        }
        progress.println(bench::nccl_line(row));
        if let Some(idle) = info.idle_share {
            progress.println(format_args!(
                "#   TB idle share {:.1} % (per-TB timing, the second of two separate launches)",
                100.0 * idle
            ));
        }
        progress.step(format!("{} B", row.size));
        json_rows.push(PlanRow {
            row: row.clone(),
            plan: b.name.clone(),
            exec: exec.clone(),
            idle_share: info.idle_share,
        });
    })?;
    drop(progress);
    println!("{}", bench::nccl_footer(&rows));
    if let Some(roofline) = roofline
        && !rows.is_empty()
    {
        let (memcpy, how) = roofline.after(&stream)?;
        let (read, written) = b.traffic;
        println!(
            "# roofline: the program's ops read {read} and write {written} chunks per call (FIFO copies not \
             counted), at {how}"
        );
        println!("# {:>12} {:>14} {:>10}", "size", "bytes", "roofline %");
        for r in &rows {
            let bytes = b.traffic_bytes(r.size);
            println!(
                "# {:>12} {:>14} {:>10}",
                r.size,
                bytes,
                bench::Roofline::percent(memcpy, bytes, r.oop_us.or(r.ip_us))
            );
        }
    }
    print_json(&json_rows, a.json)?;
    finish_rows(&rows, false)
}
