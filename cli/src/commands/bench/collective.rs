//! `oxccl bench all-reduce | reduce-scatter | all-gather | broadcast | reduce | all-to-all`: nccl-tests-style
//! tables on virtual ranks, one rank per GPU (`--gpus`), or every rank its own caller (`--procs`).

use super::{
    CliResult, MoverArg, ReductionArg, ShapeArgs, SweepArgs, check_gpus, check_ranks, contexts, finish_rows, placement,
    rank_streams,
};
use crate::bench::{self, CollectiveBench};
use crate::commands::{Dtype, Op};
use crate::progress::Progress;
use oxccl::{Collective, Config, Reduction};

/// What every collective's benchmark reads.
#[derive(clap::Args, Clone, Debug)]
pub struct Common {
    #[command(flatten)]
    pub(crate) sweep: SweepArgs,
    /// Element type (default f32).
    #[arg(short = 'd', long = "datatype", visible_alias = "dtype", value_enum, default_value = "f32")]
    pub dtype: Dtype,
    /// Ranks (default 8 virtual ranks on GPU 0; with --gpus N, N).
    #[arg(long, allow_negative_numbers = true)]
    pub ranks: Option<usize>,
    /// One rank per GPU on the first N GPUs, 1..=16 (rank r on GPU r mod N when --ranks has more),
    /// each on a stream of its own, buffers on its GPU, peer access between the GPUs. Without it:
    /// virtual ranks on GPU 0.
    #[arg(long, allow_negative_numbers = true)]
    pub gpus: Option<usize>,
    /// Every rank its own caller: N processes, one per rank, started as `oxccl launch` does (ranks
    /// sharing a GPU need MPS), each with its own communicator and stream; a row takes the slowest
    /// rank's time. With --rank-threads, N threads of this process.
    #[arg(long, value_name = "N", allow_negative_numbers = true)]
    pub procs: Option<usize>,
    /// With --procs: the ranks are threads of this process instead of processes.
    #[arg(long, requires = "procs")]
    pub rank_threads: bool,
    /// With --procs: `symmetric` (Comm::alloc_symmetric, the zero-copy path), `registered`
    /// (ExportableBuffer registered with Comm::register, also zero-copy) or `plain` (cudarc's
    /// allocations, which other processes reach through staging copies).
    #[arg(long, value_enum, requires = "procs", default_value = "symmetric")]
    pub buffers: BuffersArg,
    /// With --procs: P ranks to a node, in rank order (one host posing as several nodes): calls run
    /// staged, oxccl inside each node and --inter between the ranks of one local index.
    #[arg(long, value_name = "P", requires = "procs", allow_negative_numbers = true)]
    pub ranks_per_node: Option<u32>,
    /// With --ranks-per-node: the inter-node engine, `nccl` (libnccl.so.2 or OXCCL_NCCL; one GPU
    /// per rank of a group) or `engine` (oxccl's own, for nodes that share a host and GPUs).
    #[arg(long, value_enum, requires = "ranks_per_node", default_value = "nccl")]
    pub inter: InterArg,
    /// Capture the -n timed calls in a CUDA graph and time N launches of it (nccl-tests' -G; at most
    /// 1000000; 0, the default, launches each call).
    #[arg(short = 'G', long = "cudagraph", default_value_t = 0, allow_negative_numbers = true)]
    pub graph: usize,
    /// cudarc's event tracking off on the benchmark's contexts while it runs (as with -G): a call
    /// then waits on no event and records none per buffer, which cudarc otherwise does for every
    /// buffer a call borrows. The benchmark orders its buffers itself (each rank uses its own on
    /// its own stream).
    #[arg(long)]
    pub untracked: bool,
    /// CTAs per rank (default: all SMs divided among the ranks, at most 16).
    #[arg(long, allow_negative_numbers = true)]
    pub ctas: Option<u32>,
    /// Data mover.
    #[arg(long, value_enum, default_value = "tma")]
    pub mover: MoverArg,
    /// Calls whose every task moves fewer bytes run on the latency mover, whatever --mover says
    /// (0: never; default: the library's, `oxccl::DEFAULT_LATENCY_BELOW`).
    #[arg(long, value_parser = super::parse_size, allow_hyphen_values = true)]
    pub latency_below: Option<u64>,
    #[command(flatten)]
    pub(crate) shape: ShapeArgs,
    /// Print JSON lines after the table.
    #[arg(long)]
    pub json: bool,
}

/// The inter-node engine of `--ranks-per-node`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum InterArg {
    /// NCCL, loaded at run time.
    Nccl,
    /// oxccl's own engine (`oxccl::internode::EngineGroup`).
    Engine,
}

/// Buffers of `--procs` ranks.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum BuffersArg {
    /// `Comm::alloc_symmetric`: memory every rank maps (zero copies).
    Symmetric,
    /// cudarc's allocations, staged through memory peers map.
    Plain,
    /// `ExportableBuffer`s registered with `Comm::register` (zero copies).
    Registered,
}

/// The reduction of the collectives that reduce.
#[derive(clap::Args, Clone, Debug)]
pub struct Reducing {
    /// Reduction operator.
    #[arg(short = 'o', long = "op", value_enum, default_value = "sum")]
    pub op: Op,
    /// Reduction path: registers (deterministic) or tma (cp.reduce.async.bulk).
    #[arg(long, value_enum, default_value = "registers")]
    pub reduction: ReductionArg,
}

/// Flags of `oxccl bench all-reduce`.
#[derive(clap::Args, Clone, Debug)]
pub struct AllReduceArgs {
    #[command(flatten)]
    pub(crate) common: Common,
    #[command(flatten)]
    pub(crate) reducing: Reducing,
    /// The TMA mover's register combine: `true` stores the result from registers to every rank,
    /// `false` bulk-stores one shared copy; default: from registers where the call puts at most
    /// `COMBINE_DIRECT_MAX_CTAS` (32) CTAs on a device (`Config::combine_direct`).
    #[arg(long, value_name = "true|false")]
    pub combine_direct: Option<bool>,
}

/// Flags of `oxccl bench reduce-scatter`.
#[derive(clap::Args, Clone, Debug)]
pub struct ReduceScatterArgs {
    #[command(flatten)]
    pub(crate) common: Common,
    #[command(flatten)]
    pub(crate) reducing: Reducing,
}

/// Flags of `oxccl bench all-gather`.
#[derive(clap::Args, Clone, Debug)]
pub struct AllGatherArgs {
    #[command(flatten)]
    pub(crate) common: Common,
}

/// Flags of `oxccl bench all-to-all`.
#[derive(clap::Args, Clone, Debug)]
pub struct AllToAllArgs {
    #[command(flatten)]
    pub(crate) common: Common,
}

/// Flags of `oxccl bench broadcast`.
#[derive(clap::Args, Clone, Debug)]
pub struct BroadcastArgs {
    #[command(flatten)]
    pub(crate) common: Common,
    /// The root rank.
    #[arg(short = 'r', long = "root", default_value_t = 0, allow_negative_numbers = true)]
    pub root: usize,
}

/// Flags of `oxccl bench reduce`.
#[derive(clap::Args, Clone, Debug)]
pub struct ReduceArgs {
    #[command(flatten)]
    pub(crate) common: Common,
    #[command(flatten)]
    pub(crate) reducing: Reducing,
    /// The root rank.
    #[arg(short = 'r', long = "root", default_value_t = 0, allow_negative_numbers = true)]
    pub root: usize,
}

/// One collective's benchmark, whichever subcommand asked for it.
pub struct Run {
    collective: Collective,
    common: Common,
    reducing: Option<Reducing>,
    combine_direct: Option<bool>,
    root: Option<usize>,
}

impl From<AllReduceArgs> for Run {
    fn from(a: AllReduceArgs) -> Self {
        Run {
            collective: Collective::AllReduce,
            common: a.common,
            reducing: Some(a.reducing),
            combine_direct: a.combine_direct,
            root: None,
        }
    }
}

impl From<ReduceScatterArgs> for Run {
    fn from(a: ReduceScatterArgs) -> Self {
        Run {
            collective: Collective::ReduceScatter,
            common: a.common,
            reducing: Some(a.reducing),
            combine_direct: None,
            root: None,
        }
    }
}

impl From<AllGatherArgs> for Run {
    fn from(a: AllGatherArgs) -> Self {
        Run { collective: Collective::AllGather, common: a.common, reducing: None, combine_direct: None, root: None }
    }
}

impl From<AllToAllArgs> for Run {
    fn from(a: AllToAllArgs) -> Self {
        Run { collective: Collective::AllToAll, common: a.common, reducing: None, combine_direct: None, root: None }
    }
}

impl From<BroadcastArgs> for Run {
    fn from(a: BroadcastArgs) -> Self {
        let root = a.root.min(u32::MAX as usize) as u32;
        Run {
            collective: Collective::Broadcast { root },
            common: a.common,
            reducing: None,
            combine_direct: None,
            root: Some(a.root),
        }
    }
}

impl From<ReduceArgs> for Run {
    fn from(a: ReduceArgs) -> Self {
        let root = a.root.min(u32::MAX as usize) as u32;
        Run {
            collective: Collective::Reduce { root },
            common: a.common,
            reducing: Some(a.reducing),
            combine_direct: None,
            root: Some(a.root),
        }
    }
}

/// Most launches `-G` takes (each of `-n` calls; a graph of a million launches of a 7 µs call
/// already runs for seconds per size).
const MAX_GRAPH_LAUNCHES: usize = 1_000_000;

/// Set in the environment of the processes `--procs` starts: each is a rank, not a launcher.
const RANK_CHILD: &str = "OXCCL_BENCH_RANK";

impl Run {
    fn op(&self) -> oxccl::ReduceOp {
        self.reducing.as_ref().map_or(oxccl::ReduceOp::Sum, |r| r.op.into())
    }

    fn reduction(&self) -> ReductionArg {
        self.reducing.as_ref().map_or(ReductionArg::Registers, |r| r.reduction)
    }

    /// The communicator configuration from the flags.
    fn config(&self) -> Config {
        let c = &self.common;
        let reduction: Reduction = self.reduction().into();
        Config {
            max_ctas: c.ctas,
            mover: c.mover.into(),
            reduction,
            deterministic: reduction == Reduction::Registers,
            chunk_bytes: c.shape.chunk,
            stages: c.shape.stages,
            threads: c.shape.threads,
            issuers: c.shape.issuers,
            combine_direct: self.combine_direct,
            ranks_per_node: c.ranks_per_node,
            latency_below: c.latency_below.unwrap_or(oxccl::DEFAULT_LATENCY_BELOW),
            ..Config::default()
        }
    }

    /// Every flag checked, before any GPU is looked for: the benchmark's parameters.
    pub fn check(&self) -> Result<CollectiveBench, Box<dyn std::error::Error>> {
        let c = &self.common;
        let sweep = c.sweep.sweep()?;
        if c.graph > MAX_GRAPH_LAUNCHES {
            return Err(format!("-G {}: give at most {MAX_GRAPH_LAUNCHES} launches", c.graph).into());
        }
        check_gpus(c.gpus)?;
        check_ranks(c.ranks)?;
        c.shape.check_mover(c.mover)?;
        if self.combine_direct.is_some() && (self.reduction() == ReductionArg::Tma || c.mover == MoverArg::Simt) {
            return Err(
                "--combine-direct is for the TMA mover's register combine, not --reduction tma or --mover simt".into(),
            );
        }
        if let Some(root) = self.root {
            let ranks = c.procs.or(c.ranks).or(c.gpus).unwrap_or(8);
            if root >= ranks {
                return Err(format!("--root {root}: must be below the {ranks} ranks").into());
            }
        }
        let dtype = c.dtype.device()?;
        sweep.validate(dtype.size() as u64)?;
        // The check folds the ranks' values in rank order; across nodes an FP8 sum or product is
        // folded per node first, and FP8 rounds every partial result: another correct answer.
        let fp8 = matches!(dtype, oxccl::DType::F8e4m3 | oxccl::DType::F8e5m2);
        if fp8 && c.ranks_per_node.is_some() && sweep.check && self.reducing.is_some() {
            return Err(format!(
                "-d {} with --ranks-per-node: the check's rank order is not the staged order of an FP8 reduction; give -c 0",
                c.dtype.name()
            )
            .into());
        }
        if let (Some(p), Some(n)) = (c.ranks_per_node, c.procs)
            && (p == 0 || !n.is_multiple_of(p as usize))
        {
            return Err(format!("--ranks-per-node {p}: must divide the --procs {n} ranks").into());
        }
        let config = self.config();
        oxccl::config::validate_config(&config)?;
        if let Some(n) = c.procs {
            let max = oxccl_kernels::abi::MAX_RANKS;
            if !(1..=max).contains(&n) {
                return Err(format!("--procs {n}: give 1..={max} ranks").into());
            }
            if let Some(r) = c.ranks.filter(|&r| r != n) {
                return Err(format!("--ranks {r} with --procs {n}: --procs sets the ranks").into());
            }
            if c.graph > 0 && c.ranks_per_node.is_some() {
                return Err("-G with --ranks-per-node: calls across nodes are not captured in graphs".into());
            }
        }
        Ok(CollectiveBench {
            collective: self.collective,
            dtype,
            op: self.op(),
            ranks: c.ranks.or(c.gpus).unwrap_or(8),
            sweep,
            graph_launches: c.graph,
            untracked: c.untracked,
            config,
        })
    }
}

/// Runs one collective's benchmark.
pub fn run(r: Run) -> CliResult {
    let mut b = r.check()?;
    let c = &r.common;
    if let Some(n) = c.procs {
        return run_ranks(&r, n);
    }
    let gpus = contexts(c.gpus)?;
    b.ranks = c.ranks.unwrap_or(if c.gpus.is_some() { gpus.len() } else { 8 });
    let ctx = gpus[0].clone();
    let stream = ctx.default_stream();
    let collective = b.collective;
    println!("# oxccl {}: {}", collective.name(), super::command_line());
    // Loaded here once and shared by the benchmark's communicators on this device.
    let engine = oxccl::engine::Engine::shared(&ctx)?;
    println!(
        "# device: {}, {} {}, mover {}{}, reduction {}, kernels from {}",
        ctx.name().unwrap_or_default(),
        b.ranks,
        placement(gpus.len(), b.ranks),
        lower(b.config.mover),
        latency_note(&b.config),
        lower(b.config.reduction),
        engine.code
    );
    if b.untracked {
        println!("# cudarc's event tracking off (--untracked)");
    }
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
    // On one GPU every rank's bytes go through the same memory: the HBM roofline.
    let roofline = bench::Roofline::before(&stream, gpus.len() == 1)?;
    let progress = Progress::new(collective.name(), b.sweep.sizes().count() as u64, c.json);
    let rows = bench::collective_bench(&streams, &b, |r| {
        progress.println(bench::nccl_line(r));
        progress.step(format!("{} B", r.size));
    })?;
    drop(progress);
    println!("{}", bench::nccl_footer(&rows));
    if let Some(roofline) = roofline
        && !rows.is_empty()
    {
        let (memcpy, how) = roofline.after(&stream)?;
        println!(
            "# roofline: every input read once and every output written once, less what an in-place call \
             finds in place ({} ranks on this GPU), at {how}. A copy reads as much as it writes: calls that \
             mostly read (ReduceScatter, Reduce) can pass 100 %.",
            b.ranks
        );
        println!("# {:>12} {:>14} {:>10} {:>14} {:>10}", "size", "oop bytes", "oop %", "ip bytes", "ip %");
        for r in &rows {
            let moved = |in_place| bench::min_traffic(collective, r.size, b.ranks, in_place);
            // `collective_bench` times both sides; `N/A` would mark one that did not run.
            let pct = |bytes: u64, us: Option<f64>| bench::Roofline::percent(memcpy, bytes, us);
            let (oop, ip) = (moved(false), moved(true));
            println!("# {:>12} {:>14} {:>10} {:>14} {:>10}", r.size, oop, pct(oop, r.oop_us), ip, pct(ip, r.ip_us));
        }
    }
    finish_rows(&rows, c.json)
}

impl Run {
    /// A rank's communicator: with `--inter engine`, its inter-node group on oxccl's engine.
    fn comm(
        &self,
        stream: &std::sync::Arc<cudarc::driver::CudaStream>,
        boot: Box<dyn oxccl::Bootstrap>,
        config: Config,
    ) -> oxccl::Result<oxccl::Comm> {
        match (self.common.ranks_per_node, self.common.inter) {
            (Some(_), InterArg::Engine) => {
                let group = config.clone();
                oxccl::Comm::with_inter_node(stream, boot, config, move |map, bootstrap, inter| {
                    Ok(Box::new(oxccl::internode::EngineGroup::new(map, bootstrap, inter, group)?))
                })
            }
            _ => oxccl::Comm::new(stream, boot, config),
        }
    }
}

/// The header's word on the latency mover: which calls switch to it (none where it is the mover
/// or `--latency-below 0`).
fn latency_note(c: &Config) -> String {
    match c.latency_below {
        0 => String::new(),
        _ if c.mover == oxccl::Mover::Latency => String::new(),
        b => format!(" (latency mover where every task moves under {b} B)"),
    }
}

/// `--procs N`: starts N processes of this command (through the launcher) that each run
/// [`run_rank`]; or, with `--rank-threads`, N threads here.
fn run_ranks(r: &Run, n: usize) -> CliResult {
    if std::env::var_os(RANK_CHILD).is_some() {
        let env = oxccl::LaunchEnv::from_env()?;
        let stream =
            oxccl::engine::probe_gpu().map_err(|why| format!("no GPU to benchmark on: {why}"))?.new_stream()?;
        let config = r.config();
        let boot = oxccl::bootstrap::TcpBootstrap::from_launch_env(&env, config.timeout)?;
        let comm = r.comm(&stream, Box::new(boot), config)?;
        return run_rank(r, &comm, &format!("{n} processes, one rank each (rank {} of {})", env.rank, env.world));
    }
    if r.common.rank_threads {
        let ctx = oxccl::engine::probe_gpu().map_err(|why| format!("no GPU to benchmark on: {why}"))?;
        // Once for the threads' one context: a guard per thread would turn tracking back on when
        // the first thread ends, under the others still running (theirs then change nothing).
        let untracked = r.common.graph > 0 || r.common.untracked;
        let _untracked = untracked.then(|| bench::Untracked::new(std::slice::from_ref(&ctx.default_stream())));
        let config = r.config();
        let boots = oxccl::bootstrap::LocalBootstrap::group(n, config.timeout);
        let results: Vec<Result<(), String>> = std::thread::scope(|s| {
            let workers: Vec<_> = boots
                .into_iter()
                .map(|boot| {
                    let (ctx, config) = (ctx.clone(), config.clone());
                    s.spawn(move || -> Result<(), String> {
                        let stream = ctx.new_stream().map_err(|e| e.to_string())?;
                        let comm = r.comm(&stream, Box::new(boot), config).map_err(|e| e.to_string())?;
                        run_rank(r, &comm, &format!("{n} threads of one process, one rank each"))
                            .map_err(|e| e.to_string())
                    })
                })
                .collect();
            workers.into_iter().map(|w| w.join().unwrap_or_else(|_| Err("a rank's thread panicked".into()))).collect()
        });
        // The cause first: a rank that stopped because a peer gave up or left says less than
        // that peer.
        let errors: Vec<(usize, String)> =
            results.into_iter().enumerate().filter_map(|(r, e)| e.err().map(|e| (r, e))).collect();
        let secondary = |e: &str| e.contains("gave up that call") || e.contains("left the group");
        let cause = errors.iter().find(|(_, e)| !secondary(e)).or(errors.first());
        return match cause {
            Some((r, e)) => Err(format!("rank {r}: {e} ({} of the {n} ranks failed)", errors.len()).into()),
            None => Ok(()),
        };
    }
    // No GPU, no processes: said here, as every benchmark says it, without making a context.
    if !oxccl::engine::driver_present() {
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
    let launch = crate::commands::launch::Args {
        nproc: n as u16,
        gpus: r
            .common
            .gpus
            .map(|g| crate::commands::launch::parse_gpus(&format!("0-{}", g.saturating_sub(1))))
            .transpose()?,
        master_port: None,
        grace_secs: std::time::Duration::from_secs(5),
        tag: false,
        command: cmd,
    };
    match crate::commands::launch::run(launch)? {
        0 => Ok(()),
        code => Err(format!("a rank process failed (status {code})").into()),
    }
}

/// One rank's part of `--procs`: the nccl-tests table, printed by rank 0.
fn run_rank(r: &Run, comm: &oxccl::Comm, placement: &str) -> CliResult {
    let buffers = match r.common.buffers {
        BuffersArg::Symmetric => bench::Buffers::Symmetric,
        BuffersArg::Plain => bench::Buffers::Plain,
        BuffersArg::Registered => bench::Buffers::Registered,
    };
    let b = CollectiveBench { ranks: comm.world(), config: comm.config().clone(), ..r.check()? };
    let lead = comm.rank() == 0;
    if lead {
        let ctx = comm.stream().context();
        println!("# oxccl {}: {}", b.collective.name(), super::command_line());
        println!(
            "# device: {}, {placement}, mover {}{}, reduction {}, {} buffers, kernels from {}",
            ctx.name().unwrap_or_default(),
            lower(b.config.mover),
            latency_note(&b.config),
            lower(b.config.reduction),
            buffers.name(),
            comm.communicator().engine(comm.local_rank())?.code
        );
        if let Some(m) = comm.node_map() {
            let inter = lower(r.common.inter);
            println!("# nodes: {} of {} ranks each, staged; between them: {inter}", m.nodes(), m.per_node());
        }
        println!("# time: the slowest rank's, each timing its own stream");
        if b.untracked {
            println!("# cudarc's event tracking off (--untracked)");
        }
        println!("{}", bench::NCCL_HEADER);
    }
    let mut host = Vec::new();
    // `on_row` runs on rank 0 only: its bar is the one drawn.
    let progress = if lead {
        Progress::new(b.collective.name(), b.sweep.sizes().count() as u64, r.common.json)
    } else {
        Progress::hidden()
    };
    let rows = bench::rank_bench(comm, &b, buffers, |r, us| {
        progress.println(bench::nccl_line(r));
        progress.step(format!("{} B", r.size));
        host.push((r.size, us));
    })?;
    drop(progress);
    if lead {
        println!("{}", bench::nccl_footer(&rows));
        if b.graph_launches == 0 {
            let each: Vec<String> = host.iter().map(|(size, us)| format!("{size} B: {us:.1}")).collect();
            println!("# rank 0's host time per out-of-place call (us): {}", each.join(", "));
        }
        finish_rows(&rows, r.common.json)
    } else {
        finish_rows(&rows, false)
    }
}

/// A mover or reduction as the flags spell it (`tma`, `registers`).
fn lower(x: impl std::fmt::Debug) -> String {
    format!("{x:?}").to_lowercase()
}
