//! `oxccl bench reshard`: a reshard plan against the two usual workarounds on the same engine and
//! two speed-of-light models.

use super::{CliResult, MoverArg, ShapeArgs, Timing, check_ranks, check_timing, print_json};
use crate::bench::{self, ReshardBench};
use crate::commands::Dtype;
use crate::commands::reshard::RouteArg;
use crate::progress::Progress;
use oxccl::reshard::{CtaOwner, PlanOptions, Route};
use oxccl::{Config, ReshardOptions};

/// Flags of `oxccl bench reshard`.
#[derive(clap::Args, Clone, Debug)]
pub struct ReshardArgs {
    /// Global shape, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "7168,18432", allow_hyphen_values = true)]
    pub shape: Vec<u64>,
    /// Element type.
    #[arg(short = 'd', long = "datatype", visible_alias = "dtype", value_enum, default_value = "bf16")]
    pub dtype: Dtype,
    /// Source mesh (`DIMSxDIMS@START`).
    #[arg(long, default_value = "8@0")]
    pub src_mesh: String,
    /// Source placements (`S0`, `R,S1`, `P,S1` with partial sums added on the way, ...).
    #[arg(long, default_value = "S0")]
    pub src: String,
    /// Destination mesh.
    #[arg(long, default_value = "4x2@8")]
    pub dst_mesh: String,
    /// Destination placements.
    #[arg(long, default_value = "R,S0")]
    pub dst: String,
    /// How bytes reach destinations.
    #[arg(long, value_enum, default_value = "hierarchical")]
    pub route: RouteArg,
    /// Ranks per NVLink domain.
    #[arg(long, default_value_t = 8, allow_negative_numbers = true)]
    pub domain_size: u32,
    /// Hierarchical split threshold in bytes.
    #[arg(long, default_value_t = PlanOptions::MIN_SPLIT_BYTES, allow_negative_numbers = true)]
    pub min_split_bytes: u64,
    /// Which rank's CTAs run a copy: reader, writer or balanced.
    #[arg(long, default_value = "reader", value_parser = |s: &str| s.parse::<CtaOwner>())]
    pub owner: CtaOwner,
    /// NVLink model: one rank's NVLink bandwidth per direction (GB/s; H200: 450).
    #[arg(long, default_value_t = 450.0, allow_negative_numbers = true)]
    pub nvlink_gbps: f64,
    /// NVLink model: one rank's bandwidth out of its domain per direction (GB/s; 400 Gb/s: 50).
    #[arg(long, default_value_t = 50.0, allow_negative_numbers = true)]
    pub cross_gbps: f64,
    /// Virtual ranks (default: enough for both meshes).
    #[arg(long, allow_negative_numbers = true)]
    pub ranks: Option<usize>,
    /// CTAs per rank.
    #[arg(long, allow_negative_numbers = true)]
    pub ctas: Option<u32>,
    /// Data mover.
    #[arg(long, value_enum, default_value = "tma")]
    pub mover: MoverArg,
    #[command(flatten)]
    pub(crate) shape_args: ShapeArgs,
    #[command(flatten)]
    pub(crate) timing: Timing,
    /// Check results in a separate untimed pass (1) or not (0).
    #[arg(short = 'c', long = "check", default_value_t = 1, value_parser = clap::value_parser!(u8).range(0..=1), allow_negative_numbers = true)]
    pub check: u8,
    /// Print JSON lines after the table.
    #[arg(long)]
    pub json: bool,
}

/// The benchmark's parameters from the flags, checked before looking for a GPU.
pub fn check(a: &ReshardArgs) -> Result<ReshardBench, Box<dyn std::error::Error>> {
    check_timing(a.timing.iters, a.timing.warmup)?;
    check_ranks(a.ranks)?;
    a.shape_args.check_mover(a.mover)?;
    let src = crate::commands::reshard::layout(&a.src_mesh, &a.src, "src", "source")?;
    let dst = crate::commands::reshard::layout(&a.dst_mesh, &a.dst, "dst", "destination")?;
    let route = match a.route {
        RouteArg::Direct => Route::Direct,
        RouteArg::Hierarchical => Route::Hierarchical,
    };
    let last = |l: &oxccl::reshard::Layout| (l.mesh().start() + l.mesh().size()) as usize;
    let ranks = a.ranks.unwrap_or_else(|| last(&src).max(last(&dst)));
    let dtype = a.dtype.device()?;
    let options = ReshardOptions {
        plan: PlanOptions { route, domain_size: a.domain_size, min_split_bytes: a.min_split_bytes },
        owner: a.owner,
    };
    check_ranks(Some(ranks))?;
    if a.domain_size == 0 {
        return Err("--domain-size 0: give at least one rank per NVLink domain".into());
    }
    // The plan itself (its options, the tensor's size), then the layouts against the shape and the
    // ranks, here, so that a bad command fails without a GPU.
    oxccl_host::reshard::plan(&a.shape, dtype.size() as u64, &src, &dst, options.plan)?;
    let buffers = vec![None; ranks];
    let side =
        |layout| oxccl::reshard::Side { shape: &a.shape, elem_bytes: dtype.size() as u64, layout, buffers: &buffers };
    match oxccl::reshard::validate(ranks, &side(&src), &side(&dst)) {
        Ok(()) | Err(oxccl::Error::MissingBuffer { .. }) => {}
        Err(e) => return Err(e.into()),
    }
    let config = Config {
        max_ctas: a.ctas,
        mover: a.mover.into(),
        chunk_bytes: a.shape_args.chunk,
        stages: a.shape_args.stages,
        threads: a.shape_args.threads,
        issuers: a.shape_args.issuers,
        timeout: std::time::Duration::from_secs(60),
        ..Config::default()
    };
    oxccl::config::validate_config(&config)?;
    for (flag, gbps) in [("--nvlink-gbps", a.nvlink_gbps), ("--cross-gbps", a.cross_gbps)] {
        if !(gbps.is_finite() && gbps > 0.0) {
            return Err(format!("{flag} {gbps}: give a positive bandwidth in GB/s").into());
        }
    }
    Ok(ReshardBench {
        shape: a.shape.clone(),
        dtype,
        src,
        dst,
        ranks,
        options,
        iters: a.timing.iters,
        warmup: a.timing.warmup,
        check: a.check != 0,
        config,
        nvlink_gbps: a.nvlink_gbps,
        cross_gbps: a.cross_gbps,
    })
}

/// Runs the benchmark and prints its table.
pub fn run(a: ReshardArgs) -> CliResult {
    let b = check(&a)?;
    let ctx = oxccl::engine::probe_gpu().map_err(|why| format!("no GPU to benchmark on: {why}"))?;
    let device = ctx.name().unwrap_or_default();
    let stream = ctx.default_stream();
    // An extent of 0 makes the tensor empty, however large the others' product.
    let bytes =
        if b.shape.contains(&0) { 0 } else { b.shape.iter().fold(b.dtype.size() as u64, |t, &x| t.saturating_mul(x)) };
    println!("# oxccl reshard: {}", super::command_line());
    println!(
        "# device: {device}, {} virtual ranks, mover {}, owner {}, {} iterations after {} warm-up",
        b.ranks,
        format!("{:?}", b.config.mover).to_lowercase(),
        b.options.owner,
        b.iters,
        b.warmup
    );
    println!(
        "# tensor {:?} {} ({bytes} B): {} -> {}, route {}, domain size {}, split >= {} B",
        b.shape,
        b.dtype.nccl_name(),
        b.src,
        b.dst,
        b.options.plan.route,
        b.options.plan.domain_size,
        b.options.plan.min_split_bytes
    );
    let progress = Progress::new("reshard", ReshardBench::PROGRAMS as u64, a.json);
    let (memcpy, rows) = bench::reshard_bench(&stream, &b, |r| progress.step(r.program))?;
    drop(progress);
    println!("# cuMemcpyDtoD of the tensor's size: {memcpy:.1} GB/s (read + written)");
    println!(
        "# SOL models: hbm = (the tensor's bytes read once + every destination byte written once) / the memcpy \
         rate (every rank shares this GPU's memory); nvlink = \
         busiest link's bytes / its bandwidth as if each rank were a GPU ({} GB/s NVLink, {} GB/s out of a domain)",
        b.nvlink_gbps, b.cross_gbps
    );
    println!(
        "# {:<17} {:>8} {:>8} {:>14} {:>12} {:>14} {:>10} {:>9} {:>11} {:>7} {:>13} {:>7}",
        "program",
        "launches",
        "tasks",
        "between (B)",
        "local (B)",
        "cross (B)",
        "time (ms)",
        "GB/s",
        "hbm SOL ms",
        "of SOL",
        "nvlink SOL ms",
        "#wrong"
    );
    for r in &rows {
        let wrong = r.wrong.map_or("N/A".to_string(), |w| w.to_string());
        println!(
            "  {:<17} {:>8} {:>8} {:>14} {:>12} {:>14} {:>10.3} {:>9.1} {:>11.3} {:>6.1}% {:>13.3} {:>7}",
            r.program,
            r.launches,
            r.tasks,
            r.bytes_between_ranks,
            r.bytes_local,
            r.bytes_cross_domain,
            r.ms,
            r.gbps,
            r.sol_hbm_ms,
            100.0 * r.sol_hbm_ms / r.ms,
            r.sol_nvlink_ms,
            wrong
        );
    }
    for r in &rows {
        println!("# {}: NVLink model's busiest link: {}", r.program, r.busiest_link);
    }
    print_json(&rows, a.json)?;
    if rows.iter().any(|r| r.wrong.is_some_and(|w| w != 0)) {
        return Err(crate::commands::WrongResult::boxed("wrong results (see #wrong)"));
    }
    Ok(())
}
