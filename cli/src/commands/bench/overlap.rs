//! `oxccl bench overlap`: an AllReduce beside a compute load on every GPU, both movers.

use super::{
    CliResult, ReductionArg, ShapeArgs, Timing, check_gpus, check_ranks, check_timing, contexts, parse_size, placement,
    print_json, rank_streams,
};
use crate::bench;
use crate::progress::Progress;
use oxccl::Mover;

/// The compute load beside the collective (overlap and tma-trace).
#[derive(clap::Args, Clone, Debug)]
pub struct ComputeArgs {
    /// The compute load.
    #[arg(long, value_enum, default_value = "fma")]
    pub compute: ComputeKind,
    /// `--compute gemm|mma|wgmma`: M,N,K of each GEMM (default 8192,8192,8192; mma: M, N multiples
    /// of 128, K of 32; wgmma: M a multiple of 128, N of 256, K of 64).
    #[arg(long, value_delimiter = ',', allow_hyphen_values = true)]
    pub gemm: Option<Vec<u32>>,
    /// How long the compute work alone should take, in ms (overlap's default: as long as the first
    /// configuration's collective alone; tma-trace's: three times the copy alone).
    #[arg(long, allow_negative_numbers = true)]
    pub compute_ms: Option<f64>,
    /// `--compute mma`: at most one GEMM CTA per SM (each takes half the SM's shared memory),
    /// leaving half its registers and shared memory to what runs beside it.
    #[arg(long)]
    pub mma_one_per_sm: bool,
    /// `--compute fma` or `sleep`: its CTAs (256 threads each) per SM, 1..=8 (default 4).
    #[arg(long, allow_negative_numbers = true)]
    pub fma_ctas_per_sm: Option<u32>,
}

/// Compute loads.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum ComputeKind {
    /// An FMA-bound probe kernel.
    Fma,
    /// cuBLAS bf16 GEMMs (a build with `--features gemm`, libcublas on the library path).
    Gemm,
    /// oxccl's own bf16 tensor-core GEMM (`mma.sync`), which leaves room on its SMs.
    Mma,
    /// oxccl's Hopper GEMM (tensor copies and `wgmma`): one CTA per SM that leaves a collective CTA
    /// room beside it.
    Wgmma,
    /// CTAs shaped as the FMA load's that only sleep: what sharing SMs costs without busy warps.
    Sleep,
}

/// M,N,K of the GEMM loads when `--gemm` is not given.
const DEFAULT_GEMM: [u32; 3] = [8192, 8192, 8192];

impl ComputeArgs {
    /// The load from `--compute` and `--gemm`, each refused where it means nothing.
    pub fn load(&self) -> Result<bench::ComputeLoad, Box<dyn std::error::Error>> {
        let name = clap::ValueEnum::to_possible_value(&self.compute).map_or_else(String::new, |v| v.get_name().into());
        if self.mma_one_per_sm && self.compute != ComputeKind::Mma {
            return Err(format!("--mma-one-per-sm is for --compute mma, not {name}").into());
        }
        if let Some(n) = self.fma_ctas_per_sm {
            if !matches!(self.compute, ComputeKind::Fma | ComputeKind::Sleep) {
                return Err(format!("--fma-ctas-per-sm is for --compute fma or sleep, not {name}").into());
            }
            if !(1..=8).contains(&n) {
                return Err(format!("--fma-ctas-per-sm {n}: give 1..=8 (256 threads each)").into());
            }
        }
        if let Some(ms) = self.compute_ms
            && !(ms > 0.0 && ms <= bench::MAX_COMPUTE_MS)
        {
            return Err(format!("--compute-ms {ms}: give a time in (0, {}] ms", bench::MAX_COMPUTE_MS).into());
        }
        if self.gemm.is_some() && !matches!(self.compute, ComputeKind::Gemm | ComputeKind::Mma | ComputeKind::Wgmma) {
            return Err(format!("--gemm is for --compute gemm, mma or wgmma, not {name}").into());
        }
        match (self.compute, self.gemm.as_deref().unwrap_or(&DEFAULT_GEMM)) {
            (ComputeKind::Fma, _) => Ok(bench::ComputeLoad::Fma),
            (ComputeKind::Sleep, _) => Ok(bench::ComputeLoad::Sleep),
            (ComputeKind::Gemm, &[m, n, k]) if m > 0 && n > 0 && k > 0 && m.max(n).max(k) <= i32::MAX as u32 => {
                if !cfg!(feature = "gemm") {
                    return Err("--compute gemm: this build has no cuBLAS bindings; build with `--features gemm` \
                                (or use --compute mma, oxccl's own tensor-core GEMM)"
                        .into());
                }
                Ok(bench::ComputeLoad::Gemm { m, n, k })
            }
            (ComputeKind::Gemm, other) => Err(format!("--gemm {other:?}: give M,N,K, each in 1..2^31").into()),
            (ComputeKind::Mma, &[m, n, k]) => {
                let load = bench::ComputeLoad::Mma { m, n, k, one_per_sm: self.mma_one_per_sm };
                load.validate()?;
                Ok(load)
            }
            (ComputeKind::Mma, other) => Err(format!("--gemm {other:?}: give M,N,K for the mma load").into()),
            (ComputeKind::Wgmma, &[m, n, k]) => {
                let load = bench::ComputeLoad::Wgmma { m, n, k };
                load.validate()?;
                Ok(load)
            }
            (ComputeKind::Wgmma, other) => Err(format!("--gemm {other:?}: give M,N,K for the wgmma load").into()),
        }
    }
}

/// Flags of `oxccl bench overlap`.
#[derive(clap::Args, Clone, Debug)]
pub struct OverlapArgs {
    /// Bytes per rank of the AllReduce (K, M, G suffixes are powers of 1024).
    #[arg(short = 'e', long = "maxbytes", default_value = "1G", value_parser = parse_size, allow_hyphen_values = true)]
    pub bytes: u64,
    /// Ranks (default 8 virtual ranks on GPU 0; with --gpus N, N).
    #[arg(long, allow_negative_numbers = true)]
    pub ranks: Option<usize>,
    /// One rank per GPU on the first N GPUs, 1..=16; the compute runs on every GPU.
    #[arg(long, allow_negative_numbers = true)]
    pub gpus: Option<usize>,
    /// CTAs per rank.
    #[arg(long, default_value_t = 8, allow_negative_numbers = true)]
    pub ctas: u32,
    /// The TMA rows' reduction (default: a row for each).
    #[arg(long, value_enum)]
    pub reduction: Option<ReductionArg>,
    /// The TMA rows' shape (`--threads`: of the TMA rows only).
    #[command(flatten)]
    pub(crate) shape: ShapeArgs,
    /// Threads per CTA of the SIMT rows (default 512): fewer let a SIMT CTA share its SM with the
    /// compute's CTAs.
    #[arg(long, allow_negative_numbers = true)]
    pub simt_threads: Option<u32>,
    /// The TMA rows' register combine: `true` stores AllReduce's result from registers to every rank,
    /// `false` bulk-stores one shared copy (default: `Config::combine_direct`'s rule).
    #[arg(long, value_name = "true|false")]
    pub combine_direct: Option<bool>,
    #[command(flatten)]
    pub(crate) compute: ComputeArgs,
    /// Size the compute for the SMs the collective's CTAs leave (cuBLAS's SM count target, or a
    /// smaller FMA grid: the GPU's SMs less `--ctas` times its ranks), as when SMs are partitioned
    /// between a GEMM and communication.
    #[arg(long)]
    pub partition: bool,
    #[command(flatten)]
    pub(crate) timing: Timing,
    /// Print JSON lines after the table.
    #[arg(long)]
    pub json: bool,
}

/// The benchmark's parameters for `ranks` ranks, checked.
pub fn check(a: &OverlapArgs, ranks: usize) -> Result<bench::OverlapBench, Box<dyn std::error::Error>> {
    check_timing(a.timing.iters, a.timing.warmup)?;
    check_gpus(a.gpus)?;
    check_ranks(a.ranks)?;
    if a.combine_direct.is_some() && a.reduction == Some(ReductionArg::Tma) {
        return Err("--combine-direct is for the TMA mover's register combine, not --reduction tma".into());
    }
    let b = bench::OverlapBench {
        compute: a.compute.load()?,
        ranks,
        bytes: a.bytes,
        ctas: a.ctas,
        movers: vec![Mover::Tma, Mover::Simt],
        tma_reductions: match a.reduction {
            None => vec![oxccl::Reduction::Registers, oxccl::Reduction::Tma],
            Some(r) => vec![r.into()],
        },
        suspend_ns: vec![0, 1000],
        chunk_bytes: a.shape.chunk,
        stages: a.shape.stages,
        threads: a.shape.threads,
        simt_threads: a.simt_threads,
        issuers: a.shape.issuers,
        combine_direct: a.combine_direct,
        compute_threads: 256,
        compute_ctas_per_sm: a.compute.fma_ctas_per_sm.unwrap_or(4),
        compute_ms: a.compute.compute_ms,
        partition: a.partition,
        iters: a.timing.iters,
        warmup: a.timing.warmup,
    };
    b.validate()?;
    Ok(b)
}

/// Runs the benchmark: an AllReduce of `-e` bytes per rank on `--ranks` virtual ranks (or one rank
/// per GPU with `--gpus`) with `--ctas` CTAs per rank, beside the compute load on another stream of
/// every GPU, for both movers (the TMA mover with both reductions, or the one given) and the suspend
/// hints 0 and 1000 ns.
pub fn run(a: OverlapArgs) -> CliResult {
    check(&a, a.ranks.unwrap_or(1))?;
    let gpus = contexts(a.gpus)?;
    let device = gpus[0].name().unwrap_or_default();
    let ranks = a.ranks.unwrap_or(if a.gpus.is_some() { gpus.len() } else { 8 });
    let streams = rank_streams(&gpus, ranks, false)?;
    let b = check(&a, ranks)?;
    println!("# oxccl overlap: {}", super::command_line());
    println!(
        "# device: {device}; AllReduce f32 sum of {} B per rank on {} {} beside {} (on every GPU){}",
        b.bytes,
        b.ranks,
        placement(gpus.len(), b.ranks),
        b.compute.name(),
        match b.compute {
            bench::ComputeLoad::Fma | bench::ComputeLoad::Sleep =>
                format!(", {} CTAs of {} threads per SM", b.compute_ctas_per_sm, b.compute_threads),
            bench::ComputeLoad::Gemm { .. } => String::new(),
            bench::ComputeLoad::Mma { one_per_sm, .. } => format!(
                ", one CTA of {} threads per {tile} x {tile} tile of C with {} B of shared memory{}",
                oxccl_bench_kernels::gemm_shape::THREADS,
                oxccl_bench_kernels::gemm_shape::SMEM,
                if one_per_sm { ", launched with half an SM's so at most one per SM" } else { "" },
                tile = oxccl_bench_kernels::gemm_shape::TILE_MN
            ),
            bench::ComputeLoad::Wgmma { .. } => format!(
                ", one CTA of {} threads per {} x {} tile of C with {} B of shared memory",
                oxccl_bench_kernels::wgmma_shape::THREADS,
                oxccl_bench_kernels::wgmma_shape::TILE_M,
                oxccl_bench_kernels::wgmma_shape::TILE_N,
                oxccl_bench_kernels::wgmma_shape::SMEM,
            ),
        }
    );
    let progress = Progress::new("overlap", b.rows() as u64, a.json);
    let rows = bench::overlap_bench(&streams, &b, |r| {
        progress.step(format!("{} {} {} CTAs, suspend {} ns", r.mover, r.reduction, r.ctas, r.suspend_ns));
    })?;
    drop(progress);
    if let Some(r) = rows.first() {
        match b.compute {
            bench::ComputeLoad::Mma { .. } | bench::ComputeLoad::Wgmma { .. } => println!(
                "# compute: a grid of tiles, placed by the hardware; {} registers per thread",
                r.compute_registers.map_or("?".into(), |n| n.to_string())
            ),
            _ => println!(
                "# compute sized for {} SMs on the first GPU{}",
                r.compute_sms,
                if b.partition { " (the SMs the collective's CTAs leave there)" } else { " (all)" }
            ),
        }
        if let Some(flops) = b.compute.flops() {
            println!(
                "# compute alone (first row): {} GEMMs in {:.3} ms, {:.1} TFLOP/s",
                r.compute_reps,
                r.compute_alone_ms,
                r.compute_reps as f64 * flops / (r.compute_alone_ms * 1e-3) / 1e12
            );
        }
    }
    println!(
        "# {:>5} {:>9} {:>5} {:>7} {:>7} {:>6} {:>7} {:>8} {:>8} {:>12} {:>12} {:>12} {:>12} {:>10} {:>8}",
        "mover",
        "reduction",
        "CTAs",
        "threads",
        "issuers",
        "direct",
        "smem",
        "susp_ns",
        "reps",
        "compute(ms)",
        "coll(ms)",
        "compute||",
        "coll||",
        "makespan",
        "/serial"
    );
    for r in &rows {
        println!(
            "  {:>5} {:>9} {:>5} {:>7} {:>7} {:>6} {:>7} {:>8} {:>8} {:>12.3} {:>12.3} {:>12.3} {:>12.3} {:>10.3} {:>8.3}",
            r.mover,
            r.reduction,
            r.ctas,
            r.threads,
            r.issuers,
            if r.combine_direct { "yes" } else { "no" },
            r.smem_bytes,
            r.suspend_ns,
            r.compute_reps,
            r.compute_alone_ms,
            r.collective_alone_ms,
            r.compute_together_ms,
            r.collective_together_ms,
            r.makespan_ms,
            r.makespan_over_serial
        );
    }
    print_json(&rows, a.json)
}
