//! `oxccl bench`: nccl-tests-style collective benchmarks, the mover CTA sweep, the reshard
//! benchmark (the plan against the two workarounds on the same engine and two speed-of-light models)
//! and compiled ResCCL plans, compiled or interpreted, on the same engine and mover:
//!
//! ```text
//! oxccl bench reshard --shape 7168,18432 -d bfloat16 --src-mesh 8@0 --src S0 --dst-mesh 4x2@8 --dst R,S0
//! oxccl bench --algo hm-allreduce --topo 2x4 --exec compiled -b 1M -e 256M
//! oxccl bench --xml host/tests/data/msccl/ndv4_r48ll.xml --exec interpreted
//! ```

use super::CliResult;
use super::simulate::parse_size;
use crate::bench::{self, CollectiveBench, ReshardBench, Split, SweepConfig};
use oxccl::reshard::{CtaOwner, PlanOptions, Route};
use oxccl::{Collective, Config, DType, Mover, ReduceOp, Reduction, ReshardOptions};

/// The benchmarks `oxccl bench` runs by name (`Args::what`).
pub const BENCHMARKS: [&str; 9] =
    ["all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "movers", "overlap", "reshard", "tma_trace"];

/// Flags of `oxccl bench`: nccl-tests' short flags where nccl-tests has one, each refused where the
/// benchmark asked for does not read it ([`FLAG_USERS`]).
#[derive(clap::Args, Debug)]
pub struct Args {
    /// all_reduce | reduce_scatter | all_gather | broadcast | reduce | movers | overlap | reshard | tma_trace (none with
    /// --algo or --xml). tma_trace: a diagnostic, the TMA copy's issuing loop timed item by item
    /// alone and beside `--compute` (`-e` bytes over `--ctas` CTAs of `--issuers` warps, `--chunk`,
    /// `--stages`, `--lag`).
    pub what: Option<String>,
    /// Compiled plan of a built-in algorithm: ring-allreduce, hm-allreduce, hm-allgather, ... (see
    /// `oxccl plan`).
    #[arg(long, conflicts_with = "xml")]
    pub algo: Option<String>,
    /// Compiled plan of an MSCCL XML algorithm.
    #[arg(long)]
    pub xml: Option<std::path::PathBuf>,
    /// With --algo: NODESxGPUS (default 1x8 for ring algorithms, 2x4 otherwise); with --xml: which
    /// ranks share a node.
    #[arg(long)]
    pub topo: Option<String>,
    /// With --algo/--xml: `compiled` (HPDS schedule, state-based thread blocks, a segment per
    /// sub-pipeline) or `interpreted` (MSCCL's shape: algorithm-level schedule, a TB per connection
    /// and stage, the whole list re-walked per micro-batch). Same kernels, same mover.
    #[arg(long, default_value = "compiled")]
    pub exec: String,
    /// With --algo/--xml: micro-batches per chunk, 1..=65536.
    #[arg(long, default_value_t = 4, allow_negative_numbers = true)]
    pub micro_batches: u32,
    /// With --algo/--xml: replicate the program K times over K-times finer chunks (default 1);
    /// with --instance-channels separate, each instance on thread blocks of its own.
    #[arg(long, allow_negative_numbers = true)]
    pub instances: Option<u32>,
    /// With --instances: `shared` (every instance on the program's channels, the default) or
    /// `separate` (each on channels of its own, as MSCCL's instances: more thread blocks).
    #[arg(long = "instance-channels")]
    pub instance_channels: Option<String>,
    /// With --algo/--xml: FIFO slots per connection, at least 1 (default: what the plan needs, at
    /// least 2).
    #[arg(long, allow_negative_numbers = true)]
    pub slots: Option<u32>,
    /// Smallest size (bytes; K, M, G suffixes are powers of 1024), at least one element.
    #[arg(short = 'b', long = "minbytes", default_value = "1M", value_parser = parse_size, allow_hyphen_values = true)]
    pub min_bytes: u64,
    /// Largest size.
    #[arg(short = 'e', long = "maxbytes", default_value = "1G", value_parser = parse_size, allow_hyphen_values = true)]
    pub max_bytes: u64,
    /// Multiplication factor between sizes.
    #[arg(short = 'f', long = "stepfactor", default_value_t = 4, allow_negative_numbers = true)]
    pub factor: u64,
    /// Timed iterations per size, 1..=1000000 (tma_trace: of the copy alone; movers: 5 unless given).
    #[arg(short = 'n', long = "iters", default_value_t = 20, allow_negative_numbers = true)]
    pub iters: usize,
    /// Untimed warm-up iterations per size, at most 1000000 (movers: 2 unless given).
    #[arg(short = 'w', long = "warmup_iters", default_value_t = 5, allow_negative_numbers = true)]
    pub warmup: usize,
    /// The collectives: capture the -n timed calls in a CUDA graph and time N launches of it
    /// (nccl-tests' -G; at most 1000000; 0, the default, launches each call).
    #[arg(short = 'G', long = "cudagraph", allow_negative_numbers = true)]
    pub graph: Option<usize>,
    /// Check results in a separate untimed pass (1) or not (0).
    #[arg(short = 'c', long = "check", default_value_t = 1, value_parser = clap::value_parser!(u8).range(0..=1), allow_negative_numbers = true)]
    pub check: u8,
    /// Element type: float, half, bfloat16, int32, uint32 (default float; bfloat16 for reshard).
    #[arg(short = 'd', long = "datatype")]
    pub dtype: Option<String>,
    /// Reduction: sum (the default), min, max; for the collectives and plans that reduce (not
    /// all_gather, broadcast, or a plan that only moves data).
    #[arg(short = 'o', long = "op")]
    pub op: Option<String>,
    /// broadcast, reduce: the root rank (default 0).
    #[arg(short = 'r', long = "root", allow_negative_numbers = true)]
    pub root: Option<usize>,
    /// Ranks (default 8 virtual ranks on GPU 0; with --gpus N, N; for reshard, enough for both
    /// meshes).
    #[arg(long, allow_negative_numbers = true)]
    pub ranks: Option<usize>,
    /// One rank per GPU on the first N GPUs, 1..=16 (rank r on GPU r mod N when --ranks or the plan has more),
    /// each on a stream of its own, buffers on its GPU, peer access between the GPUs. Without it:
    /// virtual ranks on GPU 0.
    #[arg(long, allow_negative_numbers = true)]
    pub gpus: Option<usize>,
    /// CTAs per rank (default: all SMs divided among the ranks, at most 16; overlap and tma_trace: 8;
    /// movers: the sweep's list, 1, 2, 4, 8, 16, 32, 66 and 132).
    #[arg(long, allow_negative_numbers = true)]
    pub ctas: Option<u32>,
    /// Data mover: tma or simt.
    #[arg(long, default_value = "tma")]
    pub mover: String,
    /// Reduction path: registers (deterministic; the default) or tma (cp.reduce.async.bulk); overlap
    /// measures the TMA mover with both unless one is given.
    #[arg(long)]
    pub reduction: Option<String>,
    /// Threads per CTA (default: chosen by the mover; movers: of the TMA CTAs that combine the
    /// reduce-add's sources, copies and bulk reductions run one warp; overlap: of the TMA rows only).
    #[arg(long, allow_negative_numbers = true)]
    pub threads: Option<u32>,
    /// overlap: threads per CTA of the SIMT rows (default 512): fewer let a SIMT CTA share its SM
    /// with the compute's CTAs.
    #[arg(long, allow_negative_numbers = true)]
    pub simt_threads: Option<u32>,
    /// Bytes per source per pipeline stage (TMA; with --algo/--xml: per TMA stage of the plan kernels;
    /// tma_trace: default 32768).
    #[arg(long, allow_negative_numbers = true)]
    pub chunk: Option<u32>,
    /// movers: how the range is split between the CTAs: `contiguous` (one range per CTA), a size
    /// (pieces of that size dealt to the CTAs in turn; at least one per CTA), or `auto` (default:
    /// contiguous below 64 CTAs, 4 MiB pieces from there where every CTA gets one).
    #[arg(long, value_parser = parse_split, allow_hyphen_values = true)]
    pub piece: Option<Split>,
    /// Pipeline stages (TMA; default: chosen from the sources per stage, see `auto_pipeline`, 2 of
    /// the largest chunk where every combine stores from registers on one GPU (`combining_pipeline`),
    /// and 8 shared by 4 issuers where nothing combines; movers: one issuer, 32 KiB stages as deep
    /// as shared memory allows for copy (with --chunk too left open), `auto_pipeline` for
    /// reduce-into, `combining_pipeline` for reduce-add; tma_trace: per issuing warp, default 4).
    #[arg(long, allow_negative_numbers = true)]
    pub stages: Option<u32>,
    /// The collectives, reshard, overlap (TMA rows): issuing warps per TMA CTA for calls
    /// that only copy and bulk-reduce, 1..=4 (default 4, or 2, where each keeps two stages and the
    /// threads hold their warps; see `Config::issuers`); tma_trace: issuing warps per CTA, each with
    /// its own ring (default 1).
    #[arg(long, allow_negative_numbers = true)]
    pub issuers: Option<u32>,
    /// all_reduce, overlap (TMA mover, register reduction): `true`: the combining threads store
    /// AllReduce's result from registers to every rank; `false`: they bulk-store one shared copy;
    /// default: from registers where the call puts at most `COMBINE_DIRECT_MAX_CTAS` (32) CTAs on a
    /// device (`Config::combine_direct`).
    #[arg(long, value_name = "true|false")]
    pub combine_direct: Option<bool>,
    /// overlap, tma_trace: the compute load beside the collective, `fma` (FMA-bound probe kernel), `gemm`
    /// (cuBLAS bf16 GEMMs; needs a build with `--features gemm` and libcublas on the library path),
    /// `mma` (oxccl's own bf16 tensor-core GEMM, `mma.sync`, which leaves room on its SMs), `wgmma`
    /// (oxccl's Hopper GEMM: tensor copies and `wgmma`, one CTA per SM that leaves a collective CTA
    /// room beside it) or `sleep` (CTAs shaped as the FMA load's that only sleep: what sharing SMs
    /// costs without busy warps).
    #[arg(long, default_value = "fma")]
    pub compute: String,
    /// overlap, tma_trace, `--compute gemm|mma|wgmma`: M,N,K of each GEMM (default 8192,8192,8192;
    /// mma: M, N multiples of 128, K of 32; wgmma: M a multiple of 128, N of 256, K of 64).
    #[arg(long, value_delimiter = ',', allow_hyphen_values = true)]
    pub gemm: Option<Vec<u32>>,
    /// overlap: how long the compute work alone should take, in ms (default: as long as the first
    /// configuration's collective alone); tma_trace: the same (default: three times the copy alone).
    #[arg(long, allow_negative_numbers = true)]
    pub compute_ms: Option<f64>,
    /// overlap: size the compute for the SMs the collective's CTAs leave (cuBLAS's SM count target,
    /// or a smaller FMA grid: the GPU's SMs less `--ctas` times its ranks), as when SMs are
    /// partitioned between a GEMM and communication.
    #[arg(long)]
    pub partition: bool,
    /// overlap, tma_trace, `--compute mma`: at most one GEMM CTA per SM (each takes half the SM's shared
    /// memory), leaving half its registers and shared memory to what runs beside it.
    #[arg(long)]
    pub mma_one_per_sm: bool,
    /// overlap, tma_trace, `--compute fma` or `sleep`: its CTAs (256 threads each) per SM, 1..=8 (default 4).
    #[arg(long, allow_negative_numbers = true)]
    pub fma_ctas_per_sm: Option<u32>,
    /// tma_trace: rounds the ring's refill lags behind the stores, 1..=min(stages / round, 8)
    /// (default half the rounds of stages, at least one, as the engine's TMA mover).
    #[arg(long, allow_negative_numbers = true)]
    pub lag: Option<u32>,
    /// tma_trace: items per round, 1 (default: the engine's item-by-item ring) or 4 (rounds of four
    /// items through a multiple of four stages, each step of a round, refill, poll and store, as
    /// four independent instructions).
    #[arg(long, allow_negative_numbers = true)]
    pub round: Option<u32>,
    /// tma_trace: copy without per-item trace records (no clock read or store between the loop's
    /// steps; the medians print as 0).
    #[arg(long)]
    pub untraced: bool,
    /// tma_trace: the copies carry an L2 evict-first cache policy.
    #[arg(long)]
    pub l2_evict_first: bool,
    /// tma_trace: copy through 2-D tensor maps (`cp.async.bulk.tensor`, 1 KiB rows, one box per
    /// item; the chunk whole rows, at most 256) instead of plain bulk copies.
    #[arg(long)]
    pub tensor: bool,
    /// tma_trace: the issuer's timed chain, alu (default), fma, shared (a dependent ld.shared) or ilp
    /// (eight independent ALU streams: 16 instructions per step that need not wait on each other).
    #[arg(long)]
    pub chain: Option<String>,
    /// tma_trace: launch the compute before the copy (default: the copy first).
    #[arg(long)]
    pub compute_first: bool,
    /// Print JSON lines after the table.
    #[arg(long)]
    pub json: bool,
    /// The collectives with every rank its own caller: N processes, one per rank, started as
    /// `oxccl launch` does (ranks sharing a GPU need MPS), each with its own communicator and
    /// stream; a row takes the slowest rank's time. With --rank-threads, N threads of this process.
    #[arg(long, value_name = "N", allow_negative_numbers = true)]
    pub procs: Option<usize>,
    /// With --procs: the ranks are threads of this process instead of processes.
    #[arg(long)]
    pub rank_threads: bool,
    /// With --procs: `symmetric` (Comm::alloc_symmetric, the zero-copy path; the default) or
    /// `plain` (cudarc's allocations, which other processes reach through staging copies).
    #[arg(long, value_name = "KIND")]
    pub buffers: Option<String>,
    /// reshard: global shape, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "7168,18432", allow_hyphen_values = true)]
    pub shape: Vec<u64>,
    /// reshard: source mesh (`DIMSxDIMS@START`).
    #[arg(long, default_value = "8@0")]
    pub src_mesh: String,
    /// reshard: source placements (`S0`, `R,S1`, ...).
    #[arg(long, default_value = "S0")]
    pub src: String,
    /// reshard: destination mesh.
    #[arg(long, default_value = "4x2@8")]
    pub dst_mesh: String,
    /// reshard: destination placements.
    #[arg(long, default_value = "R,S0")]
    pub dst: String,
    /// reshard: route, direct or hierarchical.
    #[arg(long, default_value = "hierarchical")]
    pub route: String,
    /// reshard: ranks per NVLink domain.
    #[arg(long, default_value_t = 8, allow_negative_numbers = true)]
    pub domain_size: u32,
    /// reshard: hierarchical split threshold in bytes.
    #[arg(long, default_value_t = PlanOptions::MIN_SPLIT_BYTES, allow_negative_numbers = true)]
    pub min_split_bytes: u64,
    /// reshard: which rank's CTAs run a copy: reader, writer or balanced.
    #[arg(long, default_value = "reader")]
    pub owner: String,
    /// reshard, NVLink model: one rank's NVLink bandwidth per direction (GB/s; H200: 450).
    #[arg(long, default_value_t = 450.0, allow_negative_numbers = true)]
    pub nvlink_gbps: f64,
    /// reshard, NVLink model: one rank's bandwidth out of its domain per direction (GB/s; 400 Gb/s: 50).
    #[arg(long, default_value_t = 50.0, allow_negative_numbers = true)]
    pub cross_gbps: f64,
    /// The flags given on the command line (clap's argument ids, [`given_ids`]), filled by the `oxccl`
    /// binary: each is checked against the benchmarks that read it ([`FLAG_USERS`]), and the mover
    /// sweep takes `-n`/`-w` only where given (its own defaults are shorter). Empty: nothing checked,
    /// and the sweep keeps its defaults.
    #[arg(skip)]
    pub given: Vec<String>,
}

/// The ids of the arguments `m` holds from the command line itself (not defaults): what
/// [`Args::given`] takes.
pub fn given_ids(m: &clap::ArgMatches) -> Vec<String> {
    m.ids()
        .filter(|id| m.value_source(id.as_str()) == Some(clap::parser::ValueSource::CommandLine))
        .map(|id| id.to_string())
        .collect()
}

/// The kinds of `oxccl bench` run, as bits of [`FLAG_USERS`]' masks.
mod kind {
    pub const COLLECTIVE: u8 = 1;
    pub const MOVERS: u8 = 2;
    pub const OVERLAP: u8 = 4;
    pub const RESHARD: u8 = 8;
    pub const TRACE: u8 = 16;
    pub const PLAN: u8 = 32;
    /// How each kind is named in a refusal, in mask order.
    pub const NAMES: [&str; 6] = [
        "the collectives (all_reduce, reduce_scatter, all_gather, broadcast, reduce)",
        "movers",
        "overlap",
        "reshard",
        "tma_trace",
        "--algo/--xml",
    ];
    pub const ALL: u8 = (1 << NAMES.len()) - 1;
}

/// Which benchmarks read each flag: (clap's id, the kinds that read it, who they are where the mask
/// would say too much). Every flag of [`Args`] is here (a test checks it). A flag given to a benchmark that does not read
/// it is refused, not ignored. Finer rules (`--root` for the rooted collectives, `--combine-direct`
/// for all_reduce, `--mma-one-per-sm` for `--compute mma`, `--gemm` for `--compute gemm|mma|wgmma`, `-o`
/// for what reduces, `--chunk`/`--stages`/`--issuers` not with `--mover simt`) are checked where
/// those flags are read.
pub const FLAG_USERS: &[(&str, u8, Option<&str>)] = {
    use kind::*;
    &[
        ("topo", PLAN, None),
        ("exec", PLAN, None),
        ("micro_batches", PLAN, None),
        ("instances", PLAN, None),
        ("instance_channels", PLAN, None),
        ("slots", PLAN, None),
        ("min_bytes", COLLECTIVE | PLAN, None),
        ("max_bytes", COLLECTIVE | MOVERS | OVERLAP | TRACE | PLAN, None),
        ("factor", COLLECTIVE | PLAN, None),
        ("iters", ALL, None),
        ("warmup", ALL, None),
        ("graph", COLLECTIVE, None),
        ("check", COLLECTIVE | RESHARD | PLAN, None),
        ("dtype", COLLECTIVE | RESHARD | PLAN, None),
        ("op", COLLECTIVE | PLAN, None),
        ("root", COLLECTIVE, Some("broadcast and reduce")),
        ("ranks", COLLECTIVE | OVERLAP | RESHARD, None),
        ("gpus", COLLECTIVE | OVERLAP | PLAN, None),
        ("ctas", COLLECTIVE | MOVERS | OVERLAP | RESHARD | TRACE, None),
        ("mover", COLLECTIVE | RESHARD | PLAN, None),
        ("reduction", COLLECTIVE | OVERLAP, None),
        ("threads", COLLECTIVE | MOVERS | OVERLAP | RESHARD | PLAN, None),
        ("simt_threads", OVERLAP, None),
        ("chunk", ALL, None),
        ("piece", MOVERS, None),
        ("stages", COLLECTIVE | MOVERS | OVERLAP | RESHARD | TRACE, None),
        ("issuers", COLLECTIVE | OVERLAP | RESHARD | TRACE, None),
        ("combine_direct", COLLECTIVE | OVERLAP, Some("all_reduce and overlap")),
        ("compute", OVERLAP | TRACE, None),
        ("gemm", OVERLAP | TRACE, None),
        ("compute_ms", OVERLAP | TRACE, None),
        ("partition", OVERLAP, None),
        ("mma_one_per_sm", OVERLAP | TRACE, None),
        ("fma_ctas_per_sm", OVERLAP | TRACE, None),
        ("lag", TRACE, None),
        ("round", TRACE, None),
        ("untraced", TRACE, None),
        ("l2_evict_first", TRACE, None),
        ("tensor", TRACE, None),
        ("chain", TRACE, None),
        ("compute_first", TRACE, None),
        ("json", ALL, None),
        ("procs", COLLECTIVE, None),
        ("rank_threads", COLLECTIVE, None),
        ("buffers", COLLECTIVE, None),
        ("shape", RESHARD, None),
        ("src_mesh", RESHARD, None),
        ("src", RESHARD, None),
        ("dst_mesh", RESHARD, None),
        ("dst", RESHARD, None),
        ("route", RESHARD, None),
        ("domain_size", RESHARD, None),
        ("min_split_bytes", RESHARD, None),
        ("owner", RESHARD, None),
        ("nvlink_gbps", RESHARD, None),
        ("cross_gbps", RESHARD, None),
    ]
};

/// A flag as the user writes it, from its clap id: `-n/--iters`, `--ctas`.
fn flag_name(id: &str) -> String {
    use clap::Args as _;
    let cmd = Args::augment_args(clap::Command::new("bench"));
    let arg = cmd.get_arguments().find(|a| a.get_id() == id);
    match (arg.and_then(|a| a.get_short()), arg.and_then(|a| a.get_long())) {
        (Some(short), Some(long)) => format!("-{short}/--{long}"),
        (None, Some(long)) => format!("--{long}"),
        (Some(short), None) => format!("-{short}"),
        (None, None) => id.to_string(),
    }
}

/// The first flag in `given` that the benchmark `what` (of kind `k`) does not read, as a refusal.
fn unread_flag(given: &[String], k: u8, what: &str) -> Option<String> {
    let (id, users, named) =
        FLAG_USERS.iter().find(|(id, users, _)| users & k == 0 && given.iter().any(|g| g == id))?;
    let flag = flag_name(id);
    let owners = named.map(str::to_string).unwrap_or_else(|| {
        let names: Vec<&str> = (0..kind::NAMES.len()).filter(|b| users >> b & 1 == 1).map(|b| kind::NAMES[b]).collect();
        match names.split_last() {
            Some((last, [])) => last.to_string(),
            Some((last, rest)) => format!("{} and {last}", rest.join(", ")),
            None => "nothing".to_string(),
        }
    });
    Some(format!("{flag} is for {owners}, not {what}"))
}

fn parse_dtype(s: &str) -> Result<DType, String> {
    DType::ALL
        .iter()
        .copied()
        .find(|d| d.nccl_name() == s || format!("{d:?}").eq_ignore_ascii_case(s))
        .ok_or_else(|| format!("unknown datatype {s:?} (float, half, bfloat16, int32, uint32)"))
}

fn parse_op(s: &str) -> Result<ReduceOp, String> {
    ReduceOp::ALL
        .iter()
        .copied()
        .find(|o| o.nccl_name() == s)
        .ok_or_else(|| format!("unknown op {s:?} (sum, min, max)"))
}

fn parse_mover(s: &str) -> Result<Mover, String> {
    match s {
        "tma" => Ok(Mover::Tma),
        "simt" => Ok(Mover::Simt),
        _ => Err(format!("unknown mover {s:?} (tma, simt)")),
    }
}

/// The ranks' streams: with `--gpus N`, rank r on a new stream of GPU r mod N; else `same` for
/// every rank (virtual ranks launched together) or, with `distinct`, a new stream each on GPU 0.
fn rank_streams(
    gpus: &[std::sync::Arc<cudarc::driver::CudaContext>],
    ranks: usize,
    distinct: bool,
) -> Result<Vec<std::sync::Arc<cudarc::driver::CudaStream>>, Box<dyn std::error::Error>> {
    let mut out = Vec::with_capacity(ranks);
    for r in 0..ranks {
        let ctx = &gpus[r % gpus.len()];
        out.push(if gpus.len() > 1 || distinct { ctx.new_stream()? } else { ctx.default_stream() });
    }
    Ok(out)
}

/// The mover sweep's configuration from the flags: `-e` bytes, `--ctas` (one count; default the
/// sweep's list), `-n`/`-w` where given (default the sweep's own), the TMA shape and the split.
fn movers_config(a: &Args) -> SweepConfig {
    let d = SweepConfig::default();
    let given = |id: &str| a.given.iter().any(|g| g == id);
    SweepConfig {
        bytes: a.max_bytes,
        ctas: a.ctas.map_or(d.ctas.clone(), |c| vec![c]),
        iters: if given("iters") { a.iters } else { d.iters },
        warmup: if given("warmup") { a.warmup } else { d.warmup },
        chunk_bytes: a.chunk,
        stages: a.stages,
        tma_threads_combine: a.threads.unwrap_or(d.tma_threads_combine),
        split: a.piece.unwrap_or(d.split),
        ..d
    }
}

/// The flag that sets the field an [`Error::Config`](oxccl::Error::Config) of the library names
/// (a `Config` field, a field of the benchmarks' parameters), where one does: `max_ctas` is
/// `--ctas`, `chunk_bytes` `--chunk`, `bytes` (the size of every buffer of movers, overlap and
/// tma_trace) `-e`, ...
fn flag_of_field(field: &str) -> Option<&'static str> {
    Some(match field {
        "max_ctas" | "ctas" => "--ctas",
        "chunk_bytes" | "chunk" | "stage_bytes" => "--chunk",
        "stages" => "--stages",
        "issuers" => "--issuers",
        "threads" | "tma_threads_combine" => "--threads",
        "simt_threads" => "--simt-threads",
        "deterministic" => "--reduction",
        "split" => "--piece",
        "min_bytes" => "-b",
        "max_bytes" | "bytes" => "-e",
        "factor" => "-f",
        "iters" => "-n",
        "warmup" => "-w",
        "graph_launches" => "-G",
        "lag" => "--lag",
        "round" => "--round",
        "tensor" => "--tensor",
        "compute" => "--compute",
        "compute_ms" => "--compute-ms",
        "compute shape" => "--fma-ctas-per-sm",
        "gemm" | "gemm shape" => "--gemm",
        "partition" => "--partition",
        "shape" => "--shape",
        "micro_batches" => "--micro-batches",
        "slots" => "--slots",
        _ => return None,
    })
}

/// `e` with the field of a library [`Error::Config`](oxccl::Error::Config) shown as the flag that
/// sets it ([`flag_of_field`]): `--ctas: must be at least 1`, not `max_ctas: ...`. Other errors
/// are returned as they are.
fn named_by_flag(e: Box<dyn std::error::Error>) -> Box<dyn std::error::Error> {
    match e.downcast::<oxccl::Error>() {
        Ok(e) => match *e {
            oxccl::Error::Config { field, why } => match flag_of_field(field) {
                Some(flag) => format!("{flag}: {why}").into(),
                None => Box::new(oxccl::Error::Config { field, why }),
            },
            other => Box::new(other),
        },
        Err(e) => e,
    }
}

/// GPU 0, or the first `--gpus` GPUs.
fn contexts(a: &Args) -> Result<Vec<std::sync::Arc<cudarc::driver::CudaContext>>, Box<dyn std::error::Error>> {
    Ok(match a.gpus {
        Some(n) => oxccl::engine::probe_gpus(n).map_err(|why| format!("--gpus {n}: {why}"))?,
        None => vec![oxccl::engine::probe_gpu().map_err(|why| format!("no GPU to benchmark on: {why}"))?],
    })
}

/// The sweep of `-b -e -f -n -w -c`.
fn sweep(a: &Args) -> bench::Sweep {
    bench::Sweep {
        min_bytes: a.min_bytes,
        max_bytes: a.max_bytes,
        factor: a.factor,
        iters: a.iters,
        warmup: a.warmup,
        check: a.check != 0,
    }
}

/// The communicator configuration of a collective's benchmark, from the flags.
fn collective_config(a: &Args) -> Result<Config, Box<dyn std::error::Error>> {
    let reduction = parse_reduction(a.reduction.as_deref().unwrap_or("registers"))?;
    Ok(Config {
        max_ctas: a.ctas,
        mover: parse_mover(&a.mover)?,
        reduction,
        deterministic: reduction == Reduction::Registers,
        chunk_bytes: a.chunk,
        stages: a.stages,
        threads: a.threads,
        issuers: a.issuers,
        combine_direct: a.combine_direct,
        ..Config::default()
    })
}

/// Most timed (`-n`) or warm-up (`-w`) iterations per size: a million calls of even a 7 µs
/// collective already take seconds per size.
const MAX_ITERS: usize = 1_000_000;

/// Most launches `-G` takes (each of `-n` calls; a graph of a million launches of a 7 µs call
/// already runs for seconds per size).
const MAX_GRAPH_LAUNCHES: usize = 1_000_000;

/// The kind of benchmark `a` asks for and its name in refusals, once every flag it was given is
/// one that benchmark reads (an unknown benchmark, or a flag it would ignore, is an error naming it).
/// The `oxccl` command and the collectives bench call this before looking for a GPU.
pub fn checked_kind(a: &Args) -> Result<(u8, String), Box<dyn std::error::Error>> {
    let (k, what_named) = if a.algo.is_some() || a.xml.is_some() {
        (kind::PLAN, "--algo/--xml".to_string())
    } else {
        let Some(what) = a.what.clone() else {
            return Err(format!("give a benchmark ({}) or --algo/--xml", BENCHMARKS.join(", ")).into());
        };
        let k = match what.as_str() {
            "all_reduce" | "reduce_scatter" | "all_gather" | "broadcast" | "reduce" => kind::COLLECTIVE,
            "movers" => kind::MOVERS,
            "overlap" => kind::OVERLAP,
            "reshard" => kind::RESHARD,
            "tma_trace" => kind::TRACE,
            other => return Err(format!("unknown benchmark {other:?}: {}", BENCHMARKS.join(", ")).into()),
        };
        (k, what)
    };
    if let Some(refusal) = unread_flag(&a.given, k, &what_named) {
        return Err(if k == kind::TRACE {
            format!("{refusal} (tma_trace times one TMA copy of -e bytes: shape it with --ctas, --issuers, --chunk, --stages, --lag)")
        } else {
            refusal
        }
        .into());
    }
    Ok((k, what_named))
}

/// Runs the benchmark `a` names (or the compiled plan of `--algo`/`--xml`) and prints its table,
/// headed by the reproducing command, then JSON lines with `--json`. An `Err` is a refused flag or
/// configuration (named by its flag), a device error, or a checked result with wrong elements.
pub fn run(a: Args) -> CliResult {
    run_named(a).map_err(named_by_flag)
}

/// [`run`], its library errors naming fields rather than flags.
fn run_named(a: Args) -> CliResult {
    if a.iters == 0 {
        return Err("-n: 0: give at least one timed run".into());
    }
    if a.iters > MAX_ITERS {
        return Err(format!("-n {}: give at most {MAX_ITERS} timed iterations per size", a.iters).into());
    }
    if a.warmup > MAX_ITERS {
        return Err(format!("-w {}: give at most {MAX_ITERS} warm-up iterations per size", a.warmup).into());
    }
    let (k, what_named) = checked_kind(&a)?;
    if (k == kind::COLLECTIVE || k == kind::PLAN)
        && a.min_bytes > a.max_bytes
        && !a.given.iter().any(|g| g == "min_bytes")
    {
        return Err(format!(
            "-b: {} B, its default, is above -e's {} B: no size to run; give a -b of at most -e",
            a.min_bytes, a.max_bytes
        )
        .into());
    }
    let overlap = k == kind::OVERLAP;
    let trace = k == kind::TRACE;
    if let Some(g) = a.graph
        && g > MAX_GRAPH_LAUNCHES
    {
        return Err(format!("-G {g}: give at most {MAX_GRAPH_LAUNCHES} launches").into());
    }
    if let Some(n) = a.gpus
        && !(1..=oxccl_kernels::abi::MAX_RANKS).contains(&n)
    {
        return Err(format!(
            "--gpus {n}: give 1..={} (one rank per GPU, at most {} ranks)",
            oxccl_kernels::abi::MAX_RANKS,
            oxccl_kernels::abi::MAX_RANKS
        )
        .into());
    }
    // The TMA pipeline's shape: where `--mover` picks the one mover, the SIMT mover has none to shape
    // (the overlap and trace benchmarks run TMA rows whatever `--mover` says, or none).
    if !overlap && !trace && a.mover == "simt" {
        for id in ["chunk", "stages", "issuers"] {
            if a.given.iter().any(|g| g == id) {
                return Err(format!("{} shapes the TMA mover's pipeline; --mover simt has none", flag_name(id)).into());
            }
        }
    }
    if k == kind::PLAN {
        return run_plan(&a);
    }
    let what = what_named;
    let collective = match what.as_str() {
        "all_reduce" => Some(Collective::AllReduce),
        "reduce_scatter" => Some(Collective::ReduceScatter),
        "all_gather" => Some(Collective::AllGather),
        "broadcast" => Some(Collective::Broadcast { root: a.root.unwrap_or(0).min(u32::MAX as usize) as u32 }),
        "reduce" => Some(Collective::Reduce { root: a.root.unwrap_or(0).min(u32::MAX as usize) as u32 }),
        _ => None,
    };
    if a.combine_direct.is_some() && what != "all_reduce" && what != "overlap" {
        return Err(format!("--combine-direct is for all_reduce and overlap, not {what}").into());
    }
    if a.combine_direct.is_some()
        && (a.reduction.as_deref() == Some("tma") || (what == "all_reduce" && a.mover == "simt"))
    {
        return Err(
            "--combine-direct is for the TMA mover's register combine, not --reduction tma or --mover simt".into()
        );
    }
    let command: Vec<String> = std::env::args().collect();
    if let Some(ranks) = a.ranks
        && (ranks == 0 || ranks > oxccl_kernels::abi::MAX_RANKS)
    {
        return Err(format!("--ranks {ranks}: must be 1..={}", oxccl_kernels::abi::MAX_RANKS).into());
    }
    let reshard = (what == "reshard").then(|| reshard_bench(&a)).transpose()?;
    if overlap || trace {
        compute_load(&a)?;
    }
    if let Some(n) = a.fma_ctas_per_sm
        && !(1..=8).contains(&n)
    {
        return Err(format!("--fma-ctas-per-sm {n}: give 1..=8 (256 threads each)").into());
    }
    if let Some(ms) = a.compute_ms
        && !(ms > 0.0 && ms <= bench::MAX_COMPUTE_MS)
    {
        return Err(format!("--compute-ms {ms}: give a time in (0, {}] ms", bench::MAX_COMPUTE_MS).into());
    }
    if trace {
        trace_args(&a)?.validate()?;
    }
    if overlap {
        // Every row's configuration, the compute shape and the size (the rank count is checked
        // again once the GPUs are known).
        overlap_args(&a, a.ranks.unwrap_or(1))?.validate()?;
    }
    if let Some(r) = a.reduction.as_deref() {
        parse_reduction(r)?;
    }
    if let Some(Split::Pieces(p)) = a.piece
        && (p == 0 || !p.is_multiple_of(16))
    {
        return Err(format!("--piece {p}: give a positive multiple of 16 bytes").into());
    }
    if what == "movers" {
        movers_config(&a).validate()?;
    }
    if a.root.is_some() && collective.and_then(|c| c.root()).is_none() {
        return Err(format!("--root is for broadcast and reduce, not {what}").into());
    }
    if let Some(root) = a.root {
        let ranks = a.ranks.or(a.gpus).unwrap_or(8);
        if root >= ranks {
            return Err(format!("--root {root}: must be below the {ranks} ranks").into());
        }
    }
    if let Some(c) = collective {
        let dtype = parse_dtype(a.dtype.as_deref().unwrap_or("float"))?;
        if a.op.is_some() && !c.reduces() {
            return Err(format!("-o/--op is for the collectives that reduce, not {what} (it reduces nothing)").into());
        }
        parse_op(a.op.as_deref().unwrap_or("sum"))?;
        sweep(&a).validate(dtype.size() as u64)?;
        oxccl::config::validate_config(&collective_config(&a)?)?;
    }
    if let Some(c) = collective {
        check_rank_flags(&a)?;
        if let Some(n) = a.procs {
            return run_ranks(&a, c, n, &command);
        }
    }
    let gpus = contexts(&a)?;
    let ctx = gpus[0].clone();
    let stream = ctx.default_stream();
    if let Some(b) = reshard {
        return run_reshard(&stream, &b, &a, &command, &ctx.name().unwrap_or_default());
    }
    if what == "overlap" {
        return run_overlap(&gpus, &a, &command, &ctx.name().unwrap_or_default());
    }
    if trace {
        return run_tma_trace(&stream, &a, &command, &ctx.name().unwrap_or_default());
    }
    let Some(collective) = collective else {
        let cfg = movers_config(&a);
        println!("# oxccl mover sweep: {}", command.join(" "));
        // Loaded here once and shared by the sweep's cases.
        let engine = oxccl::engine::Engine::shared(&ctx)?;
        println!("# device: {}, kernels from {}", ctx.name().unwrap_or_default(), engine.code);
        let given = |v: Option<u32>| v.map_or("default".to_string(), |v| v.to_string());
        println!(
            "# TMA pipeline: chunk {} B per source per stage, {} stages (default: the collectives' rule, two stages \
             of the largest chunk where the reduce-add combines in registers, 32 KiB stages as deep as shared \
             memory allows for the copy where neither is given; a given chunk cut where the sources' slots would not fit; each row \
             shows its chunk × stages)",
            given(cfg.chunk_bytes),
            given(cfg.stages)
        );
        match cfg.split {
            Split::Pieces(p) => println!("# each CTA moves {p}-byte pieces dealt in turn"),
            Split::Contiguous => println!("# each CTA moves one contiguous range"),
            Split::Auto => println!(
                "# each CTA moves one contiguous range below {} CTAs, {}-byte pieces dealt in turn from there \
                 (where every CTA gets one)",
                Split::AUTO_PIECES_FROM,
                Split::AUTO_PIECE
            ),
        }
        let (memcpy, rows) = bench::mover_sweep(&stream, &cfg)?;
        println!("# cuMemcpyDtoD {} B: {memcpy:.1} GB/s (read + written)", cfg.bytes);
        println!(
            "# {:<12} {:>5} {:>5} {:>8} {:>5} {:>13} {:>10} {:>10} {:>10} {:>8} {:>8}",
            "op", "mover", "CTAs", "threads", "regs", "chunk×stages", "ms", "GB/s", "GB/s/CTA", "memcpy%", "piece"
        );
        for r in &rows {
            let pipeline = if r.stages == 0 { "-".to_string() } else { format!("{}×{}", r.chunk_bytes, r.stages) };
            println!(
                "  {:<12} {:>5} {:>5} {:>8} {:>5} {:>13} {:>10.3} {:>10.1} {:>10.1} {:>7.1}% {:>8}",
                r.op,
                r.mover,
                r.ctas,
                r.threads,
                r.registers,
                pipeline,
                r.ms,
                r.gbps,
                r.gbps_per_cta,
                100.0 * r.of_memcpy,
                if r.piece_bytes == 0 { "-".to_string() } else { r.piece_bytes.to_string() }
            );
        }
        print_json(&rows, a.json)?;
        return Ok(());
    };
    let config = collective_config(&a)?;
    let b = CollectiveBench {
        collective,
        dtype: parse_dtype(a.dtype.as_deref().unwrap_or("float"))?,
        op: parse_op(a.op.as_deref().unwrap_or("sum"))?,
        ranks: a.ranks.unwrap_or(if a.gpus.is_some() { gpus.len() } else { 8 }),
        sweep: sweep(&a),
        graph_launches: a.graph.unwrap_or(0),
        config,
    };
    println!("# oxccl {}: {}", collective.name(), command.join(" "));
    // Loaded here once and shared by the benchmark's communicators on this device.
    let engine = oxccl::engine::Engine::shared(&ctx)?;
    println!(
        "# device: {}, {} {}, mover {}, reduction {}, kernels from {}",
        ctx.name().unwrap_or_default(),
        b.ranks,
        placement(gpus.len(), b.ranks),
        a.mover,
        a.reduction.as_deref().unwrap_or("registers"),
        engine.code
    );
    if b.graph_launches > 0 {
        println!(
            "# timed: the {} calls of each half captured in a CUDA graph, {} launches of it (nccl-tests' -G)",
            b.sweep.iters, b.graph_launches
        );
    }
    println!("{}", bench::NCCL_HEADER);
    let streams = if b.graph_launches > 0 && gpus.len() == 1 {
        // The same one stream for every rank, as without -G, but not the legacy default stream,
        // which cannot be captured.
        vec![gpus[0].new_stream()?; b.ranks]
    } else {
        rank_streams(&gpus, b.ranks, false)?
    };
    // On one GPU every rank's bytes go through the same memory: the HBM roofline, from a copy large
    // enough to reach it whatever the sweep's sizes (a 2 MiB copy reads well under it), measured
    // before and after the sweep (it varies by several per cent between runs); the faster is the
    // reference.
    let roofline_bytes = 1usize << 30;
    let memcpy_before = if gpus.len() == 1 { Some(bench::memcpy_rate(&stream, roofline_bytes, 3, 10)?) } else { None };
    let rows = bench::collective_bench(&streams, &b, |r| println!("{}", bench::nccl_line(r)))?;
    println!("{}", bench::nccl_footer(&rows));
    if let Some(before) = memcpy_before
        && !rows.is_empty()
    {
        let after = bench::memcpy_rate(&stream, roofline_bytes, 3, 10)?;
        let memcpy = before.max(after);
        println!(
            "# roofline: every input read once and every output written once, less what an in-place call \
             finds in place ({} ranks on this GPU), at \
             cuMemcpyDtoD's {memcpy:.1} GB/s ({roofline_bytes} B, read + written; {before:.1} before the sweep, \
             {after:.1} after). A copy reads as much as it writes: calls that mostly read (ReduceScatter, \
             Reduce) can pass 100 %.",
            b.ranks
        );
        println!("# {:>12} {:>14} {:>10} {:>14} {:>10}", "size", "oop bytes", "oop %", "ip bytes", "ip %");
        for r in &rows {
            let moved = |in_place| bench::min_traffic(collective, r.size, b.ranks, in_place);
            // `collective_bench` times both sides; `N/A` would mark one that did not run.
            let pct = |bytes: u64, us: Option<f64>| {
                us.map_or("N/A".into(), |us| format!("{:.1}%", 100.0 * bytes as f64 / (us * 1e-6) / 1e9 / memcpy))
            };
            let (oop, ip) = (moved(false), moved(true));
            println!("# {:>12} {:>14} {:>10} {:>14} {:>10}", r.size, oop, pct(oop, r.oop_us), ip, pct(ip, r.ip_us));
        }
    }
    finish_rows(&rows, a.json)
}

/// Set in the environment of the processes `--procs` starts: each is a rank, not a launcher.
const RANK_CHILD: &str = "OXCCL_BENCH_RANK";

/// `--procs`, `--rank-threads` and `--buffers`, checked before any GPU is looked for.
fn check_rank_flags(a: &Args) -> CliResult {
    if a.procs.is_none() {
        if a.rank_threads {
            return Err("--rank-threads says how --procs runs its ranks; give --procs N".into());
        }
        if a.buffers.is_some() {
            return Err("--buffers is for --procs (each rank's own buffers); give --procs N".into());
        }
        return Ok(());
    }
    let n = a.procs.unwrap_or(0);
    let max = oxccl_kernels::abi::MAX_RANKS;
    if !(1..=max).contains(&n) {
        return Err(format!("--procs {n}: give 1..={max} ranks").into());
    }
    if a.ranks.is_some_and(|r| r != n) {
        return Err(format!("--ranks {} with --procs {n}: --procs sets the ranks", a.ranks.unwrap_or(0)).into());
    }
    if a.graph.is_some_and(|g| g > 0) {
        return Err("-G is not offered with --procs yet (each rank would capture its own graph)".into());
    }
    parse_buffers(a.buffers.as_deref())?;
    Ok(())
}

fn parse_buffers(s: Option<&str>) -> Result<bench::Buffers, String> {
    match s.unwrap_or("symmetric") {
        "symmetric" => Ok(bench::Buffers::Symmetric),
        "plain" => Ok(bench::Buffers::Plain),
        other => Err(format!("--buffers {other:?}: give symmetric or plain")),
    }
}

/// `oxccl bench COLLECTIVE --procs N`: starts N processes of this command (through the launcher)
/// that each run [`run_rank`]; or, with `--rank-threads`, N threads here.
fn run_ranks(a: &Args, collective: Collective, n: usize, command: &[String]) -> CliResult {
    if std::env::var_os(RANK_CHILD).is_some() {
        let env = oxccl::LaunchEnv::from_env()?;
        let stream =
            oxccl::engine::probe_gpu().map_err(|why| format!("no GPU to benchmark on: {why}"))?.new_stream()?;
        let comm = oxccl::Comm::from_env(&stream, collective_config(a)?)?;
        return run_rank(
            a,
            collective,
            &comm,
            command,
            &format!("{n} processes, one rank each (rank {} of {})", env.rank, env.world),
        );
    }
    if a.rank_threads {
        let ctx = oxccl::engine::probe_gpu().map_err(|why| format!("no GPU to benchmark on: {why}"))?;
        let config = collective_config(a)?;
        let boots = oxccl::bootstrap::LocalBootstrap::group(n, config.timeout);
        let results: Vec<Result<(), String>> = std::thread::scope(|s| {
            let workers: Vec<_> = boots
                .into_iter()
                .map(|boot| {
                    let (ctx, config) = (ctx.clone(), config.clone());
                    s.spawn(move || -> Result<(), String> {
                        let stream = ctx.new_stream().map_err(|e| e.to_string())?;
                        let comm = oxccl::Comm::new(&stream, Box::new(boot), config).map_err(|e| e.to_string())?;
                        run_rank(a, collective, &comm, command, &format!("{n} threads of one process, one rank each"))
                            .map_err(|e| e.to_string())
                    })
                })
                .collect();
            workers.into_iter().map(|w| w.join().unwrap_or_else(|_| Err("a rank's thread panicked".into()))).collect()
        });
        // The cause first: a rank that stopped because a peer gave up says less than that peer.
        let errors: Vec<String> = results.into_iter().filter_map(Result::err).collect();
        let cause = errors.iter().find(|e| !e.contains("gave up that call")).or(errors.first());
        return match cause {
            Some(e) => Err(format!("{e} ({} of the {n} ranks failed)", errors.len()).into()),
            None => Ok(()),
        };
    }
    // No GPU, no processes: said here, as every benchmark says it, without making a context.
    // SAFETY: only looks for the driver library.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err("no GPU to benchmark on: the CUDA driver library is not installed".into());
    }
    match cudarc::driver::CudaContext::device_count() {
        Ok(d) if d > 0 => {}
        Ok(_) => return Err("no GPU to benchmark on: no CUDA device".into()),
        Err(e) => return Err(format!("no GPU to benchmark on: cuDeviceGetCount: {e}").into()),
    }
    // The launcher's ranks run this same command; the variable tells them they are ranks.
    // SAFETY: set before any thread of this process is started (the launcher's come after).
    unsafe { std::env::set_var(RANK_CHILD, "1") };
    let exe = std::env::current_exe()?;
    let mut cmd = vec![exe.into_os_string()];
    cmd.extend(std::env::args_os().skip(1));
    let launch = super::launch::Args {
        nproc: n as u16,
        gpus: a.gpus.map(|g| super::launch::parse_gpus(&format!("0-{}", g.saturating_sub(1)))).transpose()?,
        master_port: None,
        grace_secs: std::time::Duration::from_secs(5),
        tag: false,
        command: cmd,
    };
    match super::launch::run(launch)? {
        0 => Ok(()),
        code => Err(format!("a rank process failed (status {code})").into()),
    }
}

/// One rank's part of `--procs`: the nccl-tests table, printed by rank 0.
fn run_rank(a: &Args, collective: Collective, comm: &oxccl::Comm, command: &[String], placement: &str) -> CliResult {
    let buffers = parse_buffers(a.buffers.as_deref())?;
    let b = CollectiveBench {
        collective,
        dtype: parse_dtype(a.dtype.as_deref().unwrap_or("float"))?,
        op: parse_op(a.op.as_deref().unwrap_or("sum"))?,
        ranks: comm.world(),
        sweep: sweep(a),
        graph_launches: 0,
        config: comm.config().clone(),
    };
    let lead = comm.rank() == 0;
    if lead {
        let ctx = comm.stream().context();
        println!("# oxccl {}: {}", collective.name(), command.join(" "));
        println!(
            "# device: {}, {placement}, mover {}, reduction {}, {} buffers, kernels from {}",
            ctx.name().unwrap_or_default(),
            a.mover,
            a.reduction.as_deref().unwrap_or("registers"),
            buffers.name(),
            comm.communicator().engine(comm.rank())?.code
        );
        println!("# time: the slowest rank's, each timing its own stream");
        println!("{}", bench::NCCL_HEADER);
    }
    let mut host = Vec::new();
    let rows = bench::rank_bench(comm, &b, buffers, |r, us| {
        println!("{}", bench::nccl_line(r));
        host.push((r.size, us));
    })?;
    if lead {
        println!("{}", bench::nccl_footer(&rows));
        let each: Vec<String> = host.iter().map(|(size, us)| format!("{size} B: {us:.1}")).collect();
        println!("# rank 0's host time per out-of-place call (us): {}", each.join(", "));
        finish_rows(&rows, a.json)
    } else {
        finish_rows(&rows, false)
    }
}

/// `oxccl bench --algo ...|--xml ... --exec compiled|interpreted`: a lowered ResCCL plan on virtual
/// ranks, one nccl-tests row per size. The flags are checked and the plan compiled before looking
/// for a GPU.
fn run_plan(a: &Args) -> CliResult {
    use oxccl::compiled::CompiledConfig;
    use oxccl_host::compile::{Scheduler, TbAlloc};
    use oxccl_kernels::abi::PlanMode;
    if let Some(w) = &a.what {
        return Err(format!("`{w}` and --algo/--xml: give one").into());
    }
    let (mode, scheduler, tb_alloc) = match a.exec.as_str() {
        "compiled" => (PlanMode::Compiled, Scheduler::Hpds, TbAlloc::State),
        "interpreted" => (PlanMode::Interpreted, Scheduler::Algorithm, TbAlloc::PerConn),
        other => return Err(format!("unknown --exec {other:?} (compiled, interpreted)").into()),
    };
    let topo = a
        .topo
        .clone()
        .or_else(|| a.algo.as_ref().map(|n| if n.starts_with("ring") { "1x8".to_string() } else { "2x4".to_string() }));
    let program = super::plan::ProgramArgs {
        algo: a.algo.clone(),
        xml: a.xml.clone(),
        program: None,
        topo,
        instances: a.instances.unwrap_or(1),
        instance_channels: a.instance_channels.clone().unwrap_or_else(|| "shared".into()),
        scheduler: scheduler.to_string(),
        tb_alloc: tb_alloc.to_string(),
    };
    // The launch limit first: a program of thousands of ranks takes long to generate and compile.
    let max_ranks = oxccl_kernels::abi::MAX_RANKS;
    let too_many = |ranks: u64| format!("{ranks} ranks: a launch addresses at most {max_ranks}");
    if let Some(topo) = &program.topo {
        let (n, g) = super::plan::parse_topo(topo)?;
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
    let ranks = plan.layout.ranks as usize;
    let config = CompiledConfig {
        mover: parse_mover(&a.mover)?,
        threads: a.threads,
        stage_bytes: a.chunk,
        timeout: std::time::Duration::from_secs(60),
    };
    let b = bench::PlanBench {
        name: plan.name.clone(),
        plan,
        mode,
        dtype: parse_dtype(a.dtype.as_deref().unwrap_or("float"))?,
        op: parse_op(a.op.as_deref().unwrap_or("sum"))?,
        micro_batches: a.micro_batches,
        slots: a.slots,
        sweep: sweep(a),
        config,
    };
    // One stream per virtual rank: more than the driver's default eight hardware queues must be
    // asked for before CUDA starts.
    if std::env::var_os("CUDA_DEVICE_MAX_CONNECTIONS").is_none() {
        // SAFETY: the CLI is single-threaded here and CUDA is not initialised yet.
        unsafe { std::env::set_var("CUDA_DEVICE_MAX_CONNECTIONS", "32") };
    }
    let command: Vec<String> = std::env::args().collect();
    // The sweep, the launch configuration and the plan lowered at every size, before any GPU.
    b.validate()?;
    let gpus = contexts(a)?;
    let ctx = gpus[0].clone();
    let stream = ctx.default_stream();
    let streams = rank_streams(&gpus, ranks, true)?;
    let l = &b.plan.layout;
    println!("# oxccl compiled plan {} ({}): {}", b.name, a.exec, command.join(" "));
    println!(
        "# device: {}, {} {} ({}x{}), {}, {} chunks ({} instance{}, channels {}), mover {}, {} micro-batches, schedule {} / tb-alloc {}",
        ctx.name().unwrap_or_default(),
        ranks,
        placement(gpus.len(), ranks),
        loaded.nodes,
        loaded.gpus_per_node,
        if l.in_place { "in place" } else { "out of place" },
        l.chunks,
        a.instances.unwrap_or(1),
        if a.instances.unwrap_or(1) == 1 { "" } else { "s" },
        a.instance_channels.as_deref().unwrap_or("shared"),
        a.mover,
        a.micro_batches,
        b.plan.scheduler,
        b.plan.tb_alloc
    );
    println!("{}", bench::NCCL_HEADER);
    let mut first = true;
    let rows = bench::plan_bench(&stream, &streams, &b, |row, info| {
        if first {
            println!(
                "# {} TBs per rank (one CTA each), {} FIFO slots, {} threads per CTA, TMA stage {} B, {} registers",
                info.tbs_per_rank, info.slots, info.threads, info.stage_bytes, info.registers
            );
            first = false;
        }
        println!("{}", bench::nccl_line(row));
        println!(
            "#   TB idle share {:.1} % (per-TB timing, the second of two separate launches)",
            100.0 * info.idle_share
        );
    })?;
    println!("{}", bench::nccl_footer(&rows));
    finish_rows(&rows, a.json)
}

/// The reshard benchmark's parameters from the flags (checked before looking for a GPU).
fn reshard_bench(a: &Args) -> Result<ReshardBench, Box<dyn std::error::Error>> {
    let src = super::reshard::layout(&a.src_mesh, &a.src, "src", "source")?;
    let dst = super::reshard::layout(&a.dst_mesh, &a.dst, "dst", "destination")?;
    let route = match a.route.as_str() {
        "direct" => Route::Direct,
        "hierarchical" => Route::Hierarchical,
        other => return Err(format!("unknown route {other:?} (direct, hierarchical)").into()),
    };
    let last = |l: &oxccl::reshard::Layout| (l.mesh().start() + l.mesh().size()) as usize;
    let ranks = a.ranks.unwrap_or_else(|| last(&src).max(last(&dst)));
    let dtype = parse_dtype(a.dtype.as_deref().unwrap_or("bfloat16"))?;
    let options = ReshardOptions {
        plan: PlanOptions { route, domain_size: a.domain_size, min_split_bytes: a.min_split_bytes },
        owner: a.owner.parse::<CtaOwner>()?,
    };
    if ranks == 0 || ranks > oxccl_kernels::abi::MAX_RANKS {
        return Err(format!("--ranks {ranks}: must be 1..={}", oxccl_kernels::abi::MAX_RANKS).into());
    }
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
        mover: parse_mover(&a.mover)?,
        chunk_bytes: a.chunk,
        stages: a.stages,
        threads: a.threads,
        issuers: a.issuers,
        timeout: std::time::Duration::from_secs(60),
        ..Config::default()
    };
    // The configuration's own checks too, before any GPU use.
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
        iters: a.iters,
        warmup: a.warmup,
        check: a.check != 0,
        config,
        nvlink_gbps: a.nvlink_gbps,
        cross_gbps: a.cross_gbps,
    })
}

fn run_reshard(
    stream: &std::sync::Arc<cudarc::driver::CudaStream>,
    b: &ReshardBench,
    a: &Args,
    command: &[String],
    device: &str,
) -> CliResult {
    // An extent of 0 makes the tensor empty, however large the others' product.
    let bytes =
        if b.shape.contains(&0) { 0 } else { b.shape.iter().fold(b.dtype.size() as u64, |t, &x| t.saturating_mul(x)) };
    println!("# oxccl reshard: {}", command.join(" "));
    println!(
        "# device: {device}, {} virtual ranks, mover {}, owner {}, {} iterations after {} warm-up",
        b.ranks, a.mover, b.options.owner, b.iters, b.warmup
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
    let (memcpy, rows) = bench::reshard_bench(stream, b)?;
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
        return Err("wrong results (see #wrong)".into());
    }
    Ok(())
}

/// `oxccl bench overlap`: an AllReduce of `-e` bytes per rank on `--ranks` virtual ranks (or one rank
/// per GPU with `--gpus`) with `--ctas` CTAs per rank, beside a compute load on another stream of
/// every GPU, for both movers (the TMA mover with both reductions, or the `--reduction` given; its
/// pipeline and threads from `--chunk`, `--stages`, `--threads`) and the suspend hints 0 and 1000 ns.
fn run_overlap(
    gpus: &[std::sync::Arc<cudarc::driver::CudaContext>],
    a: &Args,
    command: &[String],
    device: &str,
) -> CliResult {
    let ranks = a.ranks.unwrap_or(if a.gpus.is_some() { gpus.len() } else { 8 });
    let streams = rank_streams(gpus, ranks, false)?;
    let b = overlap_args(a, ranks)?;
    println!("# oxccl overlap: {}", command.join(" "));
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
                oxccl_ptx::gemm_shape::THREADS,
                oxccl_ptx::gemm_shape::SMEM,
                if one_per_sm { ", launched with half an SM's so at most one per SM" } else { "" },
                tile = oxccl_ptx::gemm_shape::TILE_MN
            ),
            bench::ComputeLoad::Wgmma { .. } => format!(
                ", one CTA of {} threads per {} x {} tile of C with {} B of shared memory",
                oxccl_ptx::wgmma_shape::THREADS,
                oxccl_ptx::wgmma_shape::TILE_M,
                oxccl_ptx::wgmma_shape::TILE_N,
                oxccl_ptx::wgmma_shape::SMEM,
            ),
        }
    );
    let rows = bench::overlap_bench(&streams, &b)?;
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
    print_json(&rows, a.json)?;
    Ok(())
}

/// `oxccl bench tma_trace`: the TMA copy's issuing loop timed item by item, alone and beside
/// `--compute` (see [`bench::tma_trace`]).
fn run_tma_trace(
    stream: &std::sync::Arc<cudarc::driver::CudaStream>,
    a: &Args,
    command: &[String],
    device: &str,
) -> CliResult {
    let b = trace_args(a)?;
    // The header below computes with the shape: refuse a bad one first.
    b.validate()?;
    println!("# oxccl tma_trace: {}", command.join(" "));
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
    let rows = bench::tma_trace(stream, &b)?;
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
        return Err("the traced copy is wrong (see #wrong)".into());
    }
    Ok(())
}

/// The tma_trace diagnostic's parameters from the flags.
fn trace_args(a: &Args) -> Result<bench::TmaTraceBench, Box<dyn std::error::Error>> {
    let stages = a.stages.unwrap_or(4);
    let round = a.round.unwrap_or(1);
    // The default lag as the engine's, over the rounds of stages (a shape `validate` refuses keeps
    // a lag of 1 and is refused there by its round).
    let sets = stages.checked_div(round).unwrap_or(0);
    Ok(bench::TmaTraceBench {
        compute: compute_load(a)?,
        compute_threads: 256,
        compute_ctas_per_sm: a.fma_ctas_per_sm.unwrap_or(4),
        compute_ms: a.compute_ms,
        ctas: a.ctas.unwrap_or(8),
        warps: a.issuers.unwrap_or(1),
        bytes: a.max_bytes,
        chunk: a.chunk.unwrap_or(32768),
        stages,
        round,
        lag: a.lag.unwrap_or(oxccl_kernels::abi::refill_lag(sets.max(1)).min(oxccl_ptx::trace_layout::MAX_LAG)),
        untraced: a.untraced,
        evict_first: a.l2_evict_first,
        tensor: a.tensor,
        chain_op: match a.chain.as_deref() {
            None => bench::ChainOp::Alu,
            Some(name) => bench::ChainOp::ALL
                .into_iter()
                .find(|c| c.name() == name)
                .ok_or_else(|| format!("unknown --chain {name:?} (alu, fma, shared, ilp)"))?,
        },
        compute_first: a.compute_first,
        warmup: a.warmup,
        iters: a.iters,
    })
}

/// How the ranks sit on the GPUs, for report headers.
fn placement(gpus: usize, ranks: usize) -> String {
    match gpus {
        1 => "virtual ranks on one GPU".to_string(),
        g if g == ranks => format!("ranks, one per GPU ({g} GPUs, peer access)"),
        g => format!("ranks on {g} GPUs (rank r on GPU r mod {g}, peer access)"),
    }
}

/// The overlap benchmark's parameters from the flags, for `ranks` ranks.
fn overlap_args(a: &Args, ranks: usize) -> Result<bench::OverlapBench, Box<dyn std::error::Error>> {
    Ok(bench::OverlapBench {
        compute: compute_load(a)?,
        ranks,
        bytes: a.max_bytes,
        ctas: a.ctas.unwrap_or(8),
        movers: vec![Mover::Tma, Mover::Simt],
        tma_reductions: match a.reduction.as_deref() {
            None => vec![Reduction::Registers, Reduction::Tma],
            Some(r) => vec![parse_reduction(r)?],
        },
        suspend_ns: vec![0, 1000],
        chunk_bytes: a.chunk,
        stages: a.stages,
        threads: a.threads,
        simt_threads: a.simt_threads,
        issuers: a.issuers,
        combine_direct: a.combine_direct,
        compute_threads: 256,
        compute_ctas_per_sm: a.fma_ctas_per_sm.unwrap_or(4),
        compute_ms: a.compute_ms,
        partition: a.partition,
        iters: a.iters,
        warmup: a.warmup,
    })
}

/// `--reduction`: `registers` or `tma`.
fn parse_reduction(name: &str) -> Result<Reduction, Box<dyn std::error::Error>> {
    match name {
        "registers" => Ok(Reduction::Registers),
        "tma" => Ok(Reduction::Tma),
        other => Err(format!("unknown reduction {other:?} (registers, tma)").into()),
    }
}

/// M,N,K of the GEMM loads when `--gemm` is not given.
const DEFAULT_GEMM: [u32; 3] = [8192, 8192, 8192];

/// The overlap benchmark's compute load from `--compute` and `--gemm` (each refused where it means
/// nothing: `--gemm` beside a load without GEMMs, `gemm` in a build without cuBLAS).
fn compute_load(a: &Args) -> Result<bench::ComputeLoad, Box<dyn std::error::Error>> {
    if a.mma_one_per_sm && a.compute != "mma" {
        return Err(format!("--mma-one-per-sm is for --compute mma, not {}", a.compute).into());
    }
    if a.fma_ctas_per_sm.is_some() && a.compute != "fma" && a.compute != "sleep" {
        return Err(format!("--fma-ctas-per-sm is for --compute fma or sleep, not {}", a.compute).into());
    }
    if a.gemm.is_some() && !["gemm", "mma", "wgmma"].contains(&a.compute.as_str()) {
        return Err(format!("--gemm is for --compute gemm, mma or wgmma, not {}", a.compute).into());
    }
    match (a.compute.as_str(), a.gemm.as_deref().unwrap_or(&DEFAULT_GEMM)) {
        ("fma", _) => Ok(bench::ComputeLoad::Fma),
        ("sleep", _) => Ok(bench::ComputeLoad::Sleep),
        ("gemm", &[m, n, k]) if m > 0 && n > 0 && k > 0 && m.max(n).max(k) <= i32::MAX as u32 => {
            if !cfg!(feature = "gemm") {
                return Err("--compute gemm: this build has no cuBLAS bindings; build with `--features gemm` \
                            (or use --compute mma, oxccl's own tensor-core GEMM)"
                    .into());
            }
            Ok(bench::ComputeLoad::Gemm { m, n, k })
        }
        ("gemm", other) => Err(format!("--gemm {other:?}: give M,N,K, each in 1..2^31").into()),
        ("mma", &[m, n, k]) => {
            let load = bench::ComputeLoad::Mma { m, n, k, one_per_sm: a.mma_one_per_sm };
            load.validate()?;
            Ok(load)
        }
        ("mma", other) => Err(format!("--gemm {other:?}: give M,N,K for the mma load").into()),
        ("wgmma", &[m, n, k]) => {
            let load = bench::ComputeLoad::Wgmma { m, n, k };
            load.validate()?;
            Ok(load)
        }
        ("wgmma", other) => Err(format!("--gemm {other:?}: give M,N,K for the wgmma load").into()),
        (other, _) => Err(format!("unknown --compute {other:?} (fma, gemm, mma, sleep, wgmma)").into()),
    }
}

/// Prints `rows` as JSON lines, one per row, when `json` is set.
fn print_json<T: serde::Serialize>(rows: &[T], json: bool) -> CliResult {
    if json {
        for r in rows {
            println!("{}", serde_json::to_string(r)?);
        }
    }
    Ok(())
}

/// Prints the rows as JSON lines when asked, and fails if any checked row has wrong elements.
fn finish_rows(rows: &[bench::CollectiveRow], json: bool) -> CliResult {
    print_json(rows, json)?;
    let wrong = |n: Option<u64>| n.is_some_and(|n| n != 0);
    if rows.iter().any(|r| wrong(r.oop_wrong) || wrong(r.ip_wrong)) {
        return Err("wrong results (see #wrong)".into());
    }
    Ok(())
}

/// `--piece`: `auto`, `contiguous` or a size.
fn parse_split(s: &str) -> Result<Split, String> {
    match s.trim() {
        "auto" => Ok(Split::Auto),
        "contiguous" => Ok(Split::Contiguous),
        size => parse_size(size).map(Split::Pieces).map_err(|e| format!("{e}, or auto, or contiguous")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every flag of `Args` has its row in `FLAG_USERS` (a flag without one would never be refused),
    /// and every row names a flag; the positional benchmark and `--algo`/`--xml` choose the kind.
    #[test]
    fn every_flag_has_its_readers() {
        use clap::Args as _;
        let cmd = Args::augment_args(clap::Command::new("bench"));
        let ids: Vec<String> = cmd.get_arguments().map(|a| a.get_id().to_string()).collect();
        for id in &ids {
            let kinds = ["what", "algo", "xml"];
            assert!(
                kinds.contains(&id.as_str()) || FLAG_USERS.iter().any(|(f, ..)| f == id),
                "{id}: no row in FLAG_USERS"
            );
        }
        for (id, users, _) in FLAG_USERS {
            assert!(ids.iter().any(|a| a == id), "{id}: no such flag");
            assert!(*users != 0 && users & !kind::ALL == 0, "{id}: kinds {users:#b}");
        }
        assert_eq!(flag_name("iters"), "-n/--iters");
        assert_eq!(flag_name("root"), "-r/--root");
        assert_eq!(flag_name("ctas"), "--ctas");
    }
}
