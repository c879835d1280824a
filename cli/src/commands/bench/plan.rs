//! `oxccl bench plan --algo ...|--xml ...`: a transfer program (a built-in ResCCL algorithm or an
//! MSCCL file) run through `Communicator::run_program` on virtual ranks of one GPU, one nccl-tests
//! row per size, and each size's share of the program's own roofline.

use super::{CliResult, MoverArg, SweepArgs, finish_rows, print_json};
use crate::bench;
use crate::commands::{Dtype, Op};
use crate::progress::Progress;

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
    /// With --algo: NODESxGPUS, the generated program's shape (default 1x8 for ring algorithms,
    /// 2x4 otherwise). Every rank runs as a virtual rank of one GPU.
    #[arg(long, conflicts_with = "xml")]
    pub topo: Option<String>,
    /// Replicate the program K times over K-times finer chunks.
    #[arg(long, default_value_t = 1, allow_negative_numbers = true)]
    pub instances: u32,
    #[command(flatten)]
    pub(crate) sweep: SweepArgs,
    /// Element type.
    #[arg(short = 'd', long = "datatype", visible_alias = "dtype", value_enum, default_value = "f32")]
    pub dtype: Dtype,
    /// Reduction operator, for plans that reduce.
    #[arg(short = 'o', long = "op", value_enum)]
    pub op: Option<Op>,
    /// Data mover.
    #[arg(long, value_enum, default_value = "tma")]
    pub mover: MoverArg,
    /// CTAs per rank (default: each rank's share of the SMs).
    #[arg(long, allow_negative_numbers = true)]
    pub ctas: Option<u32>,
    /// Threads per CTA.
    #[arg(long, allow_negative_numbers = true)]
    pub threads: Option<u32>,
    /// Bytes per TMA stage.
    #[arg(long, allow_negative_numbers = true)]
    pub chunk: Option<u32>,
    /// Print JSON lines after the table.
    #[arg(long)]
    pub json: bool,
}

/// A JSON line of `oxccl bench plan`: the nccl-tests row, with the program it ran and how, so that
/// `oxccl plot` can draw it.
#[derive(Clone, Debug, serde::Serialize)]
pub struct PlanRow {
    /// The nccl-tests row.
    #[serde(flatten)]
    pub row: bench::CollectiveRow,
    /// The program's name.
    pub plan: String,
    /// How it ran: `engine` (level by level on the collectives' engine). Older logs also hold
    /// `compiled` and `interpreted` (the FIFO plan kernels, since removed) and `direct` (the engine).
    pub exec: String,
    /// Launches per call (the program's levels).
    pub levels: usize,
}

/// The benchmark and its program's shape, checked and lowered before any GPU is looked for.
pub fn check(a: &PlanArgs) -> Result<(bench::PlanBench, (u32, u32)), Box<dyn std::error::Error>> {
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
        instance_channels: "shared".into(),
        scheduler: "hpds".into(),
        tb_alloc: "state".into(),
    };
    // The launch limit first: a program of thousands of ranks takes long to generate.
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
    let collective = loaded.program.layout.collective;
    if a.op.is_some() && !collective.reduces() {
        return Err(format!(
            "-o/--op is for programs that reduce, not {} (its {} reduces nothing)",
            loaded.program.name,
            collective.program_name()
        )
        .into());
    }
    if a.mover == MoverArg::Simt && a.chunk.is_some() {
        return Err("--chunk shapes the TMA mover's pipeline; --mover simt has none".into());
    }
    let config = oxccl::Config {
        mover: a.mover.into(),
        threads: a.threads,
        chunk_bytes: a.chunk,
        max_ctas: a.ctas,
        timeout: std::time::Duration::from_secs(60),
        ..oxccl::Config::default()
    };
    let b = bench::PlanBench {
        name: loaded.program.name.clone(),
        dtype: a.dtype.device()?,
        op: a.op.unwrap_or(Op::Sum).into(),
        sweep,
        config,
        traffic: loaded.program.traffic_chunks(),
        program: loaded.program,
    };
    // The sweep, the configuration and the program lowered at every size.
    b.validate()?;
    Ok((b, (loaded.nodes, loaded.gpus_per_node)))
}

/// Runs the program at every size and prints the table.
pub fn run(a: PlanArgs) -> CliResult {
    let (b, (nodes, gpus_per_node)) = check(&a)?;
    let ctx = super::contexts(None)?[0].clone();
    let stream = ctx.default_stream();
    let l = &b.program.layout;
    println!("# oxccl program {} (engine): {}", b.name, super::command_line());
    println!(
        "# device: {}, {} virtual ranks ({}x{}), {}, {} chunks ({} instance{}), mover {:?}",
        ctx.name().unwrap_or_default(),
        l.ranks,
        nodes,
        gpus_per_node,
        if l.in_place { "in place" } else { "out of place" },
        l.chunks,
        a.instances,
        if a.instances == 1 { "" } else { "s" },
        a.mover,
    );
    println!("{}", bench::NCCL_HEADER);
    // On one GPU the program's bytes all go through the same memory: its roofline, as the collectives'.
    let roofline = bench::Roofline::before(&stream, true)?;
    let mut first = true;
    let mut json_rows = Vec::new();
    let progress = Progress::new(&b.name, b.sweep.sizes().count() as u64, a.json);
    let rows = bench::plan_bench(&stream, &b, |row, info| {
        if first {
            progress.println(format_args!(
                "# {} levels (a launch each), {} CTAs per rank, {} TMA slots per stage",
                info.levels, info.ctas, info.slots
            ));
            first = false;
        }
        progress.println(bench::nccl_line(row));
        progress.step(format!("{} B", row.size));
        json_rows.push(PlanRow { row: row.clone(), plan: b.name.clone(), exec: "engine".into(), levels: info.levels });
    })?;
    drop(progress);
    println!("{}", bench::nccl_footer(&rows));
    if let Some(roofline) = roofline
        && !rows.is_empty()
    {
        let (memcpy, how) = roofline.after(&stream)?;
        let (read, written) = b.traffic;
        println!("# roofline: the program's ops read {read} and write {written} chunks per call, at {how}");
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
