//! `oxccl simulate`: compile an algorithm and simulate the plan on a topology preset.
//!
//! ```text
//! oxccl simulate --algo hm-allreduce --topo 2x8 --preset a100 --size 256M --svg timeline.svg
//! ```

use super::CliResult;
use super::plan::ProgramArgs;
use oxccl_host::sim::{self, SimOptions, Topology};

/// Flags of `oxccl simulate`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// The program and how to compile it.
    #[command(flatten)]
    pub program: ProgramArgs,
    /// Topology preset: a100 (ResCCL's testbed) or h200.
    #[arg(long, default_value = "a100")]
    pub preset: String,
    /// Size of the larger user buffer per rank (nccl-tests' size), with optional K, M, G suffix
    /// (2^10): 1 B to 2^53 B (8 PiB, what the simulator's f64 byte counts hold exactly).
    #[arg(long, default_value = "256M", allow_hyphen_values = true)]
    pub size: String,
    /// Micro-batches per chunk, 1..=65536 (default: chunks cut into about --mb-size bytes, at most
    /// 512 micro-batches).
    #[arg(long, allow_negative_numbers = true)]
    pub micro_batches: Option<u32>,
    /// Target micro-batch size per chunk (at least 1 B), in place of --micro-batches.
    #[arg(long, default_value = "1M", conflicts_with = "micro_batches", allow_hyphen_values = true)]
    pub mb_size: String,
    /// FIFO slots per connection, at least 1.
    #[arg(long, default_value_t = 8, allow_negative_numbers = true)]
    pub slots: u32,
    /// Run sub-pipelines one after another machine-wide (ResCCL's execution model) instead of
    /// ordering TBs only by sync points and FIFOs.
    #[arg(long)]
    pub barrier: bool,
    /// Write an SVG timeline (one lane per link and per TB).
    #[arg(long)]
    pub svg: Option<std::path::PathBuf>,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
}

/// Parses `256M`, `1G`, `4096`; a size past 2^64 - 1 bytes is refused as such.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let (num, mul) = match t.chars().last() {
        Some('K' | 'k') => (&t[..t.len() - 1], 1u64 << 10),
        Some('M' | 'm') => (&t[..t.len() - 1], 1 << 20),
        Some('G' | 'g') => (&t[..t.len() - 1], 1 << 30),
        _ => (t, 1),
    };
    let bad = || format!("bad size `{s}` (e.g. 4096, 64K, 256M, 1G)");
    let too_large = || format!("size `{s}` is more than 2^64 - 1 bytes");
    match num.parse::<u64>() {
        Ok(v) => v.checked_mul(mul).ok_or_else(too_large),
        Err(e) if *e.kind() == std::num::IntErrorKind::PosOverflow => Err(too_large()),
        Err(_) => Err(bad()),
    }
}

/// Largest `--size`: 2^53 bytes, up to which the simulator's f64 byte counts are exact.
const MAX_SIM_BYTES: u64 = 1 << 53;

/// `--size`, `--mb-size`, `--micro-batches` and `--slots`, checked before anything is compiled:
/// (bytes, micro-batch bytes).
fn sizes(args: &Args) -> Result<(u64, u64), Box<dyn std::error::Error>> {
    let bytes = parse_size(&args.size).map_err(|e| format!("--size: {e}"))?;
    if bytes == 0 || bytes > MAX_SIM_BYTES {
        return Err(format!(
            "--size {}: give 1 B to 2^53 B (8 PiB, what the simulator's byte counts hold exactly)",
            args.size
        )
        .into());
    }
    let mb_bytes = parse_size(&args.mb_size).map_err(|e| format!("--mb-size: {e}"))?;
    if mb_bytes == 0 {
        return Err("--mb-size 0: give a micro-batch of at least 1 byte".into());
    }
    if let Some(m) = args.micro_batches
        && !(1..=sim::MAX_MICRO_BATCHES).contains(&m)
    {
        return Err(format!("--micro-batches {m}: give 1..={}", sim::MAX_MICRO_BATCHES).into());
    }
    if args.slots == 0 {
        return Err("--slots 0: a FIFO needs at least one slot".into());
    }
    Ok((bytes, mb_bytes))
}

/// Compiles the program, simulates the plan on the preset's topology and prints the report (time,
/// algbw and busbw in GB/s of 1e9 bytes, link and TB utilisation) or its JSON; with `--svg` also
/// writes the timeline.
pub fn run(args: Args) -> CliResult {
    let (bytes, mb_bytes) = sizes(&args)?;
    let (loaded, plan) = args.program.compile()?;
    let topo = Topology::preset(&args.preset, loaded.nodes, loaded.gpus_per_node)?;
    let mut opts = SimOptions::for_size(&plan, bytes, mb_bytes);
    if let Some(m) = args.micro_batches {
        opts.micro_batches = m;
    }
    opts.fifo_slots = args.slots;
    opts.timeline = args.svg.is_some();
    opts.subpipeline_barrier = args.barrier;
    let report = sim::simulate(&plan, &topo, &opts)?;
    if let Some(path) = &args.svg {
        let title = format!("{} ({}, {}) on {}", plan.name, plan.scheduler, plan.tb_alloc, topo.name);
        std::fs::write(path, sim::svg::timeline(&report, &title)).map_err(|e| format!("{}: {e}", path.display()))?;
    }
    if args.json {
        let mut v = serde_json::to_value(&report)?;
        if let Some(o) = v.as_object_mut() {
            o.remove("timeline");
            o.remove("lanes");
            o.insert("plan".into(), plan.summary_json());
        }
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    println!(
        "simulate {} ({}, {}) on {}: size {} B, {} micro-batches per chunk, {} FIFO slots{}",
        plan.name,
        plan.scheduler,
        plan.tb_alloc,
        topo.name,
        bytes,
        report.micro_batches,
        opts.fifo_slots,
        if opts.subpipeline_barrier { ", sub-pipeline barriers" } else { "" }
    );
    println!(
        "  time {:.1} us, algbw {:.2} GB/s, busbw {:.2} GB/s",
        report.time_us, report.algbw_gbps, report.busbw_gbps
    );
    println!(
        "  link utilisation: NVLink out {:.1}% (mean over used ports), NIC out {:.1}%",
        report.mean_nvlink_utilisation * 100.0,
        report.mean_nic_utilisation * 100.0
    );
    println!(
        "  TBs {} (max {} per rank), mean TB idle {:.1}%",
        report.tbs.len(),
        plan.stats.max_tbs_per_rank,
        report.mean_tb_idle_share * 100.0
    );
    if let Some(path) = &args.svg {
        println!("  timeline written to {}", path.display());
    }
    Ok(())
}
