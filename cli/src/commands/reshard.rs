//! `oxccl reshard`: plan an M-to-N reshard between two (mesh, placements) layouts, print the transfers
//! and the traffic (or the JSON report), and optionally verify the plan on the CPU executor.
//!
//! ```text
//! oxccl reshard --shape 4,8 --dtype f32 --src-mesh 1x4@0 --src R,S0 --dst-mesh 2x2@4 --dst R,S0 --verify
//! ```

use super::{CliResult, Dtype};
use oxccl_host::reshard::{
    self, CtaOwner, Layout, LoweredReshard, Mesh, PlanOptions, PlanReport, Route, VerifySummary,
};

/// The route, as spelled on the command line.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum RouteArg {
    /// Every destination rank receives every byte it lacks straight from a source rank.
    Direct,
    /// Each byte enters each destination NVLink domain once, then is forwarded inside it.
    Hierarchical,
}

/// Flags of `oxccl reshard`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Global tensor shape, comma separated (`4,8`); any number of dims.
    #[arg(long, value_delimiter = ',', required = true, allow_hyphen_values = true)]
    pub shape: Vec<u64>,
    /// Element type.
    #[arg(long, value_enum, default_value = "f32")]
    pub dtype: Dtype,
    /// Source mesh: `DIMSxDIMS@START` (`1x4@0`), a contiguous row-major rank range.
    #[arg(long)]
    pub src_mesh: String,
    /// Source placements, one per source mesh axis: `R`, `S<dim>` or `P` (partial sums, added on the
    /// way) (`R,S0`, `P,S1`).
    #[arg(long)]
    pub src: String,
    /// Destination mesh: `DIMSxDIMS@START` (`2x2@4`).
    #[arg(long)]
    pub dst_mesh: String,
    /// Destination placements, one per destination mesh axis (`R,S0`).
    #[arg(long)]
    pub dst: String,
    /// How bytes reach destinations.
    #[arg(long, value_enum, default_value = "hierarchical")]
    pub route: RouteArg,
    /// Ranks per NVLink domain (rank r is in domain r / size).
    #[arg(long, default_value_t = 8, allow_negative_numbers = true)]
    pub domain_size: u32,
    /// Hierarchical route: split a piece entering a domain over up to that many of the domain's ranks
    /// needing it, keeping parts at least this many bytes (0: down to single rows).
    #[arg(long, default_value_t = PlanOptions::MIN_SPLIT_BYTES, allow_negative_numbers = true)]
    pub min_split_bytes: u64,
    /// Run the plan on the CPU executor and check every destination element against the global tensor;
    /// exit non-zero on any mismatch.
    #[arg(long)]
    pub verify: bool,
    /// Print the JSON report (every transfer and the traffic totals) instead of text.
    #[arg(long)]
    pub json: bool,
    /// Transfers listed in the text output (the JSON report lists all).
    #[arg(long, default_value_t = 64, allow_negative_numbers = true)]
    pub max_listed: usize,
    /// Also lower the plan for the engine (ranks: enough for both meshes) and print its task counts
    /// (and its text form when it has at most --max-listed tasks); with --verify, run the lowered
    /// program on the CPU with the engine's semantics too. Text only: not with --json.
    #[arg(long, conflicts_with = "json")]
    pub lower: bool,
    /// With --lower: CTAs per rank, 1..=256 (default 8).
    #[arg(long, requires = "lower", allow_negative_numbers = true)]
    pub ctas: Option<u32>,
    /// With --lower: which rank's CTAs run a copy, reader (the default), writer or balanced.
    #[arg(long, requires = "lower", value_parser = parse_owner)]
    pub owner: Option<CtaOwner>,
}

/// `--owner`: reader, writer or balanced.
fn parse_owner(s: &str) -> Result<CtaOwner, String> {
    s.parse()
}

/// CTAs per rank of `--lower` when `--ctas` is not given.
const DEFAULT_LOWER_CTAS: u32 = 8;

/// Parses one side's layout; errors name the flag or the side at fault.
pub(crate) fn layout(mesh: &str, placements: &str, flag: &str, side: &str) -> Result<Layout, String> {
    let mesh: Mesh = mesh.parse().map_err(|e| format!("--{flag}-mesh: {e}"))?;
    let placements = reshard::parse_placements(placements).map_err(|e| format!("--{flag}: {e}"))?;
    Layout::new(mesh, placements).map_err(|e| format!("{side} layout: {e}"))
}

/// Plans the reshard and prints its stages, transfers and traffic (or the JSON report); with
/// `--verify` checks the plan on the CPU executor and with `--lower` lowers it for the engine. An
/// `Err` is a bad flag, a plan that cannot be made or lowered (both found before anything is
/// printed), or a verification that found a mismatch.
pub fn run(args: Args) -> CliResult {
    let src = layout(&args.src_mesh, &args.src, "src", "source")?;
    let dst = layout(&args.dst_mesh, &args.dst, "dst", "destination")?;
    let route = match args.route {
        RouteArg::Direct => Route::Direct,
        RouteArg::Hierarchical => Route::Hierarchical,
    };
    let options = PlanOptions { route, domain_size: args.domain_size, min_split_bytes: args.min_split_bytes };
    let plan = reshard::plan(&args.shape, args.dtype.bytes(), &src, &dst, options)?;
    // Lowered here, so that a bad --ctas (or a plan the engine cannot take) is reported before the
    // plan is printed.
    let lowered = args.lower.then(|| lower(&plan, &args)).transpose()?;
    let report = args.verify.then(|| reshard::verify(&plan)).transpose()?;

    if args.json {
        let mut json = PlanReport::new(&plan, Some(&args.dtype.name()));
        json.verify = report.as_ref().map(|r| VerifySummary { elements_checked: r.checked, mismatches: r.wrong });
        print!("{}", json.to_json());
    } else {
        print_text(&plan, &args);
        if let Some(r) = &report {
            println!("{r}");
        }
    }
    if let Some(r) = &report
        && !r.is_exact()
    {
        return Err(super::WrongResult::boxed(format!("verification failed: {} elements differ", r.wrong)));
    }
    if let Some(l) = &lowered {
        print_lowered(&plan, l, &args)?;
    }
    Ok(())
}

/// `--lower`: the plan as engine programs on enough ranks for both meshes, `--ctas` per rank, its
/// copies run by `--owner`'s CTAs; checked for races between its CTAs.
fn lower(plan: &reshard::ReshardPlan, args: &Args) -> Result<Lowering, Box<dyn std::error::Error>> {
    let last = |s: &reshard::Sharding| (s.mesh().start() + s.mesh().size()) as usize;
    let ranks = last(plan.src_sharding()).max(last(plan.dst_sharding()));
    let ctas = args.ctas.unwrap_or(DEFAULT_LOWER_CTAS);
    // Sums of partial sums add elements of the type itself; copies pick their unit.
    let dtype = if plan.src().is_partial() { Some(args.dtype.device()?) } else { None };
    let opts = reshard::LowerOptions {
        owner: args.owner.unwrap_or(CtaOwner::Reader),
        dtype,
        ..reshard::LowerOptions::new(ranks, ctas)
    };
    let l = reshard::lower(plan, &opts).map_err(|e| match e {
        reshard::LowerError::Ctas { .. } => format!("--ctas: {e}"),
        other => format!("--lower: {other}"),
    })?;
    l.check_races()?;
    Ok(Lowering { programs: l, ranks, ctas })
}

/// What `--lower` made: the programs, and the ranks and CTAs per rank they were lowered for.
struct Lowering {
    programs: LoweredReshard,
    ranks: usize,
    ctas: u32,
}

/// Prints the lowered programs of `plan` (or their task counts), and with `--verify` runs them
/// on the CPU against the global tensor.
fn print_lowered(plan: &reshard::ReshardPlan, lowering: &Lowering, args: &Args) -> CliResult {
    let l = &lowering.programs;
    if l.task_count() <= args.max_listed {
        print!("{l}");
    } else {
        println!(
            "lowered: unit {:?}, {} ranks, {} CTAs per rank, tasks per stage {:?} (text form over --max-listed)",
            l.dtype,
            lowering.ranks,
            lowering.ctas,
            l.tasks_per_stage()
        );
    }
    if args.verify {
        // Element i of the global tensor: bytes of i + 1 (never all zero, so unwritten bytes show).
        let e = plan.elem_bytes() as usize;
        let src = plan.src_sharding();
        let n = src.elements();
        let global: Vec<u64> = (0..n).collect();
        let bytes = |idx: &[u64]| -> Vec<u8> {
            idx.iter().flat_map(|&i| (0..e).map(move |k| ((i + 1) >> (8 * (k % 8))) as u8 ^ (k / 8) as u8)).collect()
        };
        // Partial sums are added as numbers: element i is i % 4 + 1, held by partial sum i % k
        // alone (the others hold 0), so every sum is exact in every type, and a partial sum
        // missing (0) or added twice (double) shows.
        let k = src.partial_sums();
        let partial = |idx: &[u64], p: u64| -> Vec<u8> {
            idx.iter().flat_map(|&i| small(args.dtype, if i % k == p { (i % 4 + 1) as u8 } else { 0 })).collect()
        };
        let summed =
            |idx: &[u64]| -> Vec<u8> { idx.iter().flat_map(|&i| small(args.dtype, (i % 4 + 1) as u8)).collect() };
        let mut bufs = l.host_buffers();
        let boxes = Layout::new(
            src.mesh().clone(),
            src.layout()
                .placements()
                .iter()
                .map(|&p| if p == reshard::Placement::Partial { reshard::Placement::Replicate } else { p })
                .collect(),
        )?
        .on(plan.shape())?;
        for (r, idx) in boxes.local_shards(&global)? {
            bufs[r as usize][oxccl_kernels::abi::slot::INPUT as usize] = match src.partial_index(r) {
                Some(p) if k > 1 => partial(&idx, p),
                _ => bytes(&idx),
            };
        }
        l.execute(&mut bufs)?;
        let mut wrong = 0;
        for (r, idx) in plan.dst_sharding().local_shards(&global)? {
            let want = if k > 1 { summed(&idx) } else { bytes(&idx) };
            wrong += usize::from(bufs[r as usize][oxccl_kernels::abi::slot::OUTPUT as usize] != want);
        }
        if wrong > 0 {
            return Err(super::WrongResult::boxed(format!(
                "lowered program: {wrong} destination ranks differ from the global tensor"
            )));
        }
        println!("lowered program verified on the CPU: every destination shard matches the global tensor");
    }
    Ok(())
}

fn print_text(plan: &reshard::ReshardPlan, args: &Args) {
    let o = plan.options();
    let tensor_bytes = plan.src_sharding().elements() * plan.elem_bytes();
    println!(
        "reshard {:?} {} ({tensor_bytes} B), route {}, domain size {}",
        plan.shape(),
        args.dtype.name(),
        o.route,
        o.domain_size
    );
    for (side, sharding) in [("src", plan.src_sharding()), ("dst", plan.dst_sharding())] {
        println!("{side} {}", sharding.layout());
        for rank in sharding.mesh().ranks() {
            if let Some(region) = sharding.local_region(rank) {
                println!(
                    "  rank {rank:>4}  domain {:>3}  {region}  {} B",
                    rank / o.domain_size,
                    region.volume() * plan.elem_bytes()
                );
            }
        }
    }
    let total: usize = plan.stages().iter().map(|s| s.transfers.len()).sum();
    let mut listed = 0;
    for (s, stage) in plan.stages().iter().enumerate() {
        let what = if s == 0 { "from source buffers" } else { "forwarding inside destination domains" };
        println!("stage {s} ({what}): {} transfers", stage.transfers.len());
        for t in &stage.transfers {
            if listed == args.max_listed {
                break;
            }
            println!("  {t}");
            listed += 1;
        }
    }
    if listed < total {
        println!("  ({listed} of {total} transfers listed; --max-listed N or --json for all)");
    }
    let t = plan.traffic();
    println!("traffic (bytes)");
    println!("  total (between ranks)   {:>14}", t.bytes_total);
    println!("    intra-domain          {:>14}", t.bytes_intra_domain);
    println!("    cross-domain          {:>14}", t.bytes_cross_domain);
    println!("  local copies            {:>14}", t.bytes_local);
    println!("  needed by destinations  {:>14}", t.bytes_needed);
    for (d, b) in &t.bytes_injected_per_domain {
        println!("  injected into domain {d:<3}{b:>14}");
    }
    println!("  busiest sender          {:>14}", t.max_bytes_sent_by_a_rank);
    println!("  busiest receiver        {:>14}", t.max_bytes_received_by_a_rank);
    println!(
        "  flat sends              {:>14}  (cross-domain {})",
        t.flat_sends.bytes_total, t.flat_sends.bytes_cross_domain
    );
    println!(
        "  gather + broadcast      {:>14}  (cross-domain {})",
        t.gather_broadcast.bytes_total, t.gather_broadcast.bytes_cross_domain
    );
}

/// A small whole number (at most a few) as one element of `dtype`, exact in every type.
fn small(dtype: super::Dtype, v: u8) -> Vec<u8> {
    use super::Dtype as D;
    let f = f32::from(v);
    match dtype {
        D::F64 => f64::from(f).to_le_bytes().to_vec(),
        D::F32 => f.to_le_bytes().to_vec(),
        D::F16 => oxccl::half::f16::from_f32(f).to_le_bytes().to_vec(),
        D::Bf16 => oxccl::half::bf16::from_f32(f).to_le_bytes().to_vec(),
        D::F8e4m3 => vec![oxccl::F8E4M3::from_f32(f).0],
        D::F8e5m2 => vec![oxccl::F8E5M2::from_f32(f).0],
        // Little-endian, positive: the same bytes signed or unsigned.
        int => {
            let mut b = vec![0u8; int.bytes() as usize];
            b[0] = v;
            b
        }
    }
}
