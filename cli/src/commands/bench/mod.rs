//! `oxccl bench`: one subcommand per benchmark, each with only its flags.
//!
//! ```text
//! oxccl bench all-reduce --ranks 8 -b 1M -e 1G -f 4 --ctas 8
//! oxccl bench movers -e 1G
//! oxccl bench reshard --shape 7168,18432 -d bfloat16 --src-mesh 8@0 --src S0 --dst-mesh 4x2@8 --dst R,S0
//! oxccl bench plan --algo hm-allreduce --topo 2x4 -b 1M -e 256M
//! ```
//!
//! nccl-tests' short flags where nccl-tests has one; a flag a benchmark does not read is refused by
//! the parser. Every benchmark checks its flags before it looks for a GPU.

mod collective;
mod group;
mod movers;
mod overlap;
mod plan;
mod reshard;
mod send_recv;
mod trace;

pub use collective::{AllGatherArgs, AllReduceArgs, AllToAllArgs, BroadcastArgs, ReduceArgs, ReduceScatterArgs};
pub use group::GroupArgs;
pub use movers::MoversArgs;
pub use overlap::{ComputeArgs, OverlapArgs};
pub use plan::{PlanArgs, PlanRow};
pub use reshard::ReshardArgs;
pub use send_recv::SendRecvArgs;
pub use trace::TraceArgs;

use super::CliResult;
use super::simulate::parse_size;
use std::sync::Arc;

/// The benchmarks.
#[derive(clap::Subcommand, Debug)]
pub enum Command {
    /// nccl-tests-style AllReduce table (size, time, algbw, busbw, #wrong; out of place and in place).
    #[command(visible_alias = "all_reduce")]
    AllReduce(AllReduceArgs),
    /// nccl-tests-style ReduceScatter table.
    #[command(visible_alias = "reduce_scatter")]
    ReduceScatter(ReduceScatterArgs),
    /// nccl-tests-style AllGather table.
    #[command(visible_alias = "all_gather")]
    AllGather(AllGatherArgs),
    /// nccl-tests-style Broadcast table.
    Broadcast(BroadcastArgs),
    /// nccl-tests-style Reduce table.
    Reduce(ReduceArgs),
    /// nccl-tests-style AllToAll table (out of place only).
    #[command(visible_alias = "all_to_all", visible_alias = "alltoall")]
    AllToAll(AllToAllArgs),
    /// Rank 0 sends to rank 1 (ranks as threads), against cuMemcpyDtoD of the same size.
    #[command(visible_alias = "send_recv")]
    SendRecv(SendRecvArgs),
    /// A group of AllReduces (ranks as threads) against one AllReduce of their total size and one
    /// call per tensor.
    Group(GroupArgs),
    /// The TMA and SIMT movers' CTA sweep (copy, reduce-into, reduce-add) against cuMemcpyDtoD.
    Movers(MoversArgs),
    /// An AllReduce beside a compute load: times alone, together, and the makespan.
    Overlap(OverlapArgs),
    /// A reshard plan against the two usual workarounds on the same engine and two speed-of-light
    /// models.
    Reshard(ReshardArgs),
    /// Diagnostic: the TMA copy's issuing loop timed item by item, alone and beside a compute load.
    #[command(visible_alias = "tma_trace")]
    TmaTrace(TraceArgs),
    /// A compiled ResCCL plan (built-in algorithm or MSCCL XML), compiled or interpreted.
    Plan(PlanArgs),
}

impl Command {
    /// The benchmark's name as given on the command line.
    pub fn name(&self) -> &'static str {
        match self {
            Command::AllReduce(_) => "all-reduce",
            Command::ReduceScatter(_) => "reduce-scatter",
            Command::AllGather(_) => "all-gather",
            Command::Broadcast(_) => "broadcast",
            Command::Reduce(_) => "reduce",
            Command::AllToAll(_) => "all-to-all",
            Command::SendRecv(_) => "send-recv",
            Command::Group(_) => "group",
            Command::Movers(_) => "movers",
            Command::Overlap(_) => "overlap",
            Command::Reshard(_) => "reshard",
            Command::TmaTrace(_) => "tma-trace",
            Command::Plan(_) => "plan",
        }
    }
}

/// Runs the benchmark and prints its table, headed by the reproducing command, then JSON lines
/// with `--json`. An `Err` is a refused flag or configuration (named by its flag), a device error, or
/// a checked result with wrong elements.
pub fn run(command: Command) -> CliResult {
    run_named(command).map_err(named_by_flag)
}

fn run_named(command: Command) -> CliResult {
    match command {
        Command::AllReduce(a) => collective::run(a.into()),
        Command::ReduceScatter(a) => collective::run(a.into()),
        Command::AllGather(a) => collective::run(a.into()),
        Command::Broadcast(a) => collective::run(a.into()),
        Command::Reduce(a) => collective::run(a.into()),
        Command::AllToAll(a) => collective::run(a.into()),
        Command::SendRecv(a) => send_recv::run(&a),
        Command::Group(a) => group::run(&a),
        Command::Movers(a) => movers::run(a),
        Command::Overlap(a) => overlap::run(a),
        Command::Reshard(a) => reshard::run(a),
        Command::TmaTrace(a) => trace::run(a),
        Command::Plan(a) => plan::run(a),
    }
}

/// Checks what a benchmark can check without a GPU (the flags, the sizes, the plan), as
/// [`run`] does first: the collectives' cargo bench refuses a bad command before it looks for one.
pub fn check(command: &Command) -> CliResult {
    let checked = match command {
        Command::AllReduce(a) => collective::Run::from(a.clone()).check().map(|_| ()),
        Command::ReduceScatter(a) => collective::Run::from(a.clone()).check().map(|_| ()),
        Command::AllGather(a) => collective::Run::from(a.clone()).check().map(|_| ()),
        Command::Broadcast(a) => collective::Run::from(a.clone()).check().map(|_| ()),
        Command::Reduce(a) => collective::Run::from(a.clone()).check().map(|_| ()),
        Command::AllToAll(a) => collective::Run::from(a.clone()).check().map(|_| ()),
        Command::SendRecv(a) => send_recv::check(a),
        Command::Group(a) => group::check(a),
        Command::Movers(a) => movers::check(a).map(|_| ()),
        Command::Overlap(a) => overlap::check(a, a.ranks.unwrap_or(1)).map(|_| ()),
        Command::Reshard(a) => reshard::check(a).map(|_| ()),
        Command::TmaTrace(a) => trace::check(a).map(|_| ()),
        Command::Plan(a) => plan::check(a).map(|_| ()),
    };
    checked.map_err(named_by_flag)
}

/// Timed and warm-up iterations per size (`-n`, `-w`).
#[derive(clap::Args, Clone, Debug)]
pub struct Timing {
    /// Timed iterations per size, 1..=1000000.
    #[arg(short = 'n', long = "iters", default_value_t = 20, allow_negative_numbers = true)]
    pub iters: usize,
    /// Untimed warm-up iterations per size, at most 1000000.
    #[arg(short = 'w', long = "warmup_iters", default_value_t = 5, allow_negative_numbers = true)]
    pub warmup: usize,
}

/// Most timed (`-n`) or warm-up (`-w`) iterations per size: a million calls of even a 7 µs
/// collective already take seconds per size.
const MAX_ITERS: usize = 1_000_000;

/// `-n` at least one and at most [`MAX_ITERS`], `-w` at most that.
fn check_timing(iters: usize, warmup: usize) -> CliResult {
    if iters == 0 {
        return Err("-n: 0: give at least one timed run".into());
    }
    if iters > MAX_ITERS {
        return Err(format!("-n {iters}: give at most {MAX_ITERS} timed iterations per size").into());
    }
    if warmup > MAX_ITERS {
        return Err(format!("-w {warmup}: give at most {MAX_ITERS} warm-up iterations per size").into());
    }
    Ok(())
}

/// The sizes of a sweep (`-b`, `-e`, `-f`) and its timing and check (`-n`, `-w`, `-c`).
#[derive(clap::Args, Clone, Debug)]
pub struct SweepArgs {
    /// Smallest size (bytes; K, M, G suffixes are powers of 1024), at least one element.
    #[arg(short = 'b', long = "minbytes", value_parser = parse_size, allow_hyphen_values = true)]
    pub min_bytes: Option<u64>,
    /// Largest size.
    #[arg(short = 'e', long = "maxbytes", default_value = "1G", value_parser = parse_size, allow_hyphen_values = true)]
    pub max_bytes: u64,
    /// Multiplication factor between sizes.
    #[arg(short = 'f', long = "stepfactor", default_value_t = 4, allow_negative_numbers = true)]
    pub factor: u64,
    #[command(flatten)]
    pub(crate) timing: Timing,
    /// Check results in a separate untimed pass (1) or not (0).
    #[arg(short = 'c', long = "check", default_value_t = 1, value_parser = clap::value_parser!(u8).range(0..=1), allow_negative_numbers = true)]
    pub check: u8,
}

/// `-b`'s default.
const DEFAULT_MIN_BYTES: u64 = 1 << 20;

impl SweepArgs {
    /// The sweep, `-b` defaulting to 1 MiB; a default `-b` above a given `-e` is named.
    fn sweep(&self) -> Result<crate::bench::Sweep, String> {
        check_timing(self.timing.iters, self.timing.warmup).map_err(|e| e.to_string())?;
        let min_bytes = self.min_bytes.unwrap_or(DEFAULT_MIN_BYTES);
        if self.min_bytes.is_none() && min_bytes > self.max_bytes {
            return Err(format!(
                "-b: {min_bytes} B, its default, is above -e's {} B: no size to run; give a -b of at most -e",
                self.max_bytes
            ));
        }
        Ok(crate::bench::Sweep {
            min_bytes,
            max_bytes: self.max_bytes,
            factor: self.factor,
            iters: self.timing.iters,
            warmup: self.timing.warmup,
            check: self.check != 0,
        })
    }
}

/// The data movers.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum MoverArg {
    /// The Tensor Memory Accelerator: bulk copies and reductions issued by a few threads.
    Tma,
    /// Every thread moves 16-byte vectors (the baseline).
    Simt,
    /// Every thread moves one vector at a time, its loads from all sources in flight together
    /// (small messages).
    Latency,
}

impl From<MoverArg> for oxccl::Mover {
    fn from(m: MoverArg) -> Self {
        match m {
            MoverArg::Tma => oxccl::Mover::Tma,
            MoverArg::Simt => oxccl::Mover::Simt,
            MoverArg::Latency => oxccl::Mover::Latency,
        }
    }
}

/// How reductions run.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReductionArg {
    /// Sources combined in registers, in a fixed order (deterministic).
    Registers,
    /// `cp.reduce.async.bulk`: the hardware reduces on the way (order not fixed).
    Tma,
}

impl From<ReductionArg> for oxccl::Reduction {
    fn from(r: ReductionArg) -> Self {
        match r {
            ReductionArg::Registers => oxccl::Reduction::Registers,
            ReductionArg::Tma => oxccl::Reduction::Tma,
        }
    }
}

/// The TMA pipeline's shape and the threads per CTA.
#[derive(clap::Args, Clone, Debug)]
pub struct ShapeArgs {
    /// Threads per CTA (default: chosen by the mover).
    #[arg(long, allow_negative_numbers = true)]
    pub threads: Option<u32>,
    /// Bytes per source per pipeline stage (TMA).
    #[arg(long, allow_negative_numbers = true)]
    pub chunk: Option<u32>,
    /// Pipeline stages (TMA; default: chosen from the sources per stage, see `auto_pipeline`, 2 of
    /// the largest chunk where every combine stores from registers on one GPU
    /// (`combining_pipeline`), and 8 shared by 4 issuers where nothing combines).
    #[arg(long, allow_negative_numbers = true)]
    pub stages: Option<u32>,
    /// Issuing warps per TMA CTA for calls that only copy and bulk-reduce, 1..=4 (default 4, or 2,
    /// where each keeps two stages and the threads hold their warps; see `Config::issuers`).
    #[arg(long, allow_negative_numbers = true)]
    pub issuers: Option<u32>,
}

impl ShapeArgs {
    /// `--chunk`, `--stages` and `--issuers` shape the TMA pipeline: refused with the SIMT mover.
    fn check_mover(&self, mover: MoverArg) -> CliResult {
        if mover != MoverArg::Tma {
            for (flag, given) in [
                ("--chunk", self.chunk.is_some()),
                ("--stages", self.stages.is_some()),
                ("--issuers", self.issuers.is_some()),
            ] {
                if given {
                    let name = oxccl::Mover::from(mover).name();
                    return Err(format!("{flag} shapes the TMA mover's pipeline; --mover {name} has none").into());
                }
            }
        }
        Ok(())
    }
}

/// The flag that sets the field an [`Error::Config`](oxccl::Error::Config) of the library names
/// (a `Config` field, a field of the benchmarks' parameters), where one does: `max_ctas` is
/// `--ctas`, `chunk_bytes` `--chunk`, `bytes` (the size of every buffer of movers, overlap and
/// tma-trace) `-e`, ...
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

/// `--gpus N` in range: one rank per GPU, at most as many GPUs as ranks.
fn check_gpus(gpus: Option<usize>) -> CliResult {
    let max = oxccl_kernels::abi::MAX_RANKS;
    match gpus {
        Some(n) if !(1..=max).contains(&n) => {
            Err(format!("--gpus {n}: give 1..={max} (one rank per GPU, at most {max} ranks)").into())
        }
        _ => Ok(()),
    }
}

/// `--ranks N` in range.
fn check_ranks(ranks: Option<usize>) -> CliResult {
    match ranks {
        Some(r) if r == 0 || r > oxccl_kernels::abi::MAX_RANKS => {
            Err(format!("--ranks {r}: must be 1..={}", oxccl_kernels::abi::MAX_RANKS).into())
        }
        _ => Ok(()),
    }
}

/// GPU 0, or the first `gpus` GPUs.
fn contexts(gpus: Option<usize>) -> Result<Vec<Arc<cudarc::driver::CudaContext>>, Box<dyn std::error::Error>> {
    Ok(match gpus {
        Some(n) => oxccl::engine::probe_gpus(n).map_err(|why| format!("--gpus {n}: {why}"))?,
        None => vec![oxccl::engine::probe_gpu().map_err(|why| format!("no GPU to benchmark on: {why}"))?],
    })
}

/// The ranks' streams: with several GPUs, rank r on a new stream of GPU r mod N; else the default
/// stream for every rank (virtual ranks launched together) or, with `distinct`, a new stream each.
fn rank_streams(
    gpus: &[Arc<cudarc::driver::CudaContext>],
    ranks: usize,
    distinct: bool,
) -> Result<Vec<Arc<cudarc::driver::CudaStream>>, Box<dyn std::error::Error>> {
    let mut out = Vec::with_capacity(ranks);
    for r in 0..ranks {
        let ctx = &gpus[r % gpus.len()];
        out.push(if gpus.len() > 1 || distinct { ctx.new_stream()? } else { ctx.default_stream() });
    }
    Ok(out)
}

/// How the ranks sit on the GPUs, for report headers.
fn placement(gpus: usize, ranks: usize) -> String {
    match gpus {
        1 => "virtual ranks on one GPU".to_string(),
        g if g == ranks => format!("ranks, one per GPU ({g} GPUs, peer access)"),
        g => format!("ranks on {g} GPUs (rank r on GPU r mod {g}, peer access)"),
    }
}

/// The command line, for report headers.
fn command_line() -> String {
    std::env::args().collect::<Vec<_>>().join(" ")
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
fn finish_rows(rows: &[crate::bench::CollectiveRow], json: bool) -> CliResult {
    print_json(rows, json)?;
    let wrong = |n: Option<u64>| n.is_some_and(|n| n != 0);
    if rows.iter().any(|r| wrong(r.oop_wrong) || wrong(r.ip_wrong)) {
        return Err(crate::commands::WrongResult::boxed("wrong results (see #wrong)"));
    }
    Ok(())
}

/// Where the ranks' threads of a benchmark meet between timed phases: a barrier that a thread
/// which fails breaks ([`Meet::run`]), so that the others stop with an error instead of waiting for
/// it for ever.
pub(crate) struct Meet {
    /// Threads arrived in this round, the round, and whether a thread failed.
    state: std::sync::Mutex<(usize, u64, bool)>,
    turn: std::sync::Condvar,
    threads: usize,
}

impl Meet {
    /// A barrier of `threads` threads.
    pub(crate) fn new(threads: usize) -> std::sync::Arc<Self> {
        std::sync::Arc::new(Self {
            state: std::sync::Mutex::new((0, 0, false)),
            turn: std::sync::Condvar::new(),
            threads,
        })
    }

    /// Waits until every thread has arrived; an error once a thread has failed.
    pub(crate) fn wait(&self) -> oxccl::Result<()> {
        let broken = || oxccl::Error::Config { field: "ranks", why: "another rank's thread failed".into() };
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if st.2 {
            return Err(broken());
        }
        st.0 += 1;
        if st.0 == self.threads {
            st.0 = 0;
            st.1 += 1;
            self.turn.notify_all();
            return Ok(());
        }
        let round = st.1;
        while st.1 == round && !st.2 {
            st = self.turn.wait(st).unwrap_or_else(|e| e.into_inner());
        }
        if st.1 == round { Err(broken()) } else { Ok(()) }
    }

    /// Runs a thread's work, breaking the barrier for the others if it fails.
    pub(crate) fn run<T>(&self, work: impl FnOnce() -> oxccl::Result<T>) -> oxccl::Result<T> {
        let result = work();
        if result.is_err() {
            let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
            st.2 = true;
            self.turn.notify_all();
        }
        result
    }
}

/// The results of the ranks' threads, or the first error that is not a rank stopping because
/// another failed (the failure itself).
pub(crate) fn joined<T>(
    threads: Vec<std::thread::JoinHandle<oxccl::Result<T>>>,
) -> Result<Vec<T>, Box<dyn std::error::Error>> {
    let mut results = Vec::new();
    let mut first: Option<oxccl::Error> = None;
    for t in threads {
        match t.join().map_err(|_| "a rank's thread panicked")? {
            Ok(r) => results.push(r),
            Err(e) => {
                let secondary = matches!(&e, oxccl::Error::Config { field: "ranks", .. });
                if first.as_ref().is_none_or(|f| matches!(f, oxccl::Error::Config { field: "ranks", .. }) && !secondary)
                {
                    first = Some(e);
                }
            }
        }
    }
    match first {
        Some(e) => Err(e.into()),
        None => Ok(results),
    }
}

#[cfg(test)]
mod meet_tests {
    use super::{Meet, joined};

    #[test]
    fn threads_meet_and_a_failure_releases_the_others() {
        let meet = Meet::new(3);
        let threads: Vec<_> = (0..3)
            .map(|_| {
                let m = meet.clone();
                std::thread::spawn(move || m.run(|| (0..4).try_for_each(|_| m.wait())))
            })
            .collect();
        assert!(joined(threads).is_ok(), "three threads meet four times");

        let meet = Meet::new(3);
        let threads: Vec<_> = (0..3)
            .map(|t| {
                let m = meet.clone();
                std::thread::spawn(move || {
                    m.run(|| {
                        m.wait()?;
                        if t == 1 {
                            return Err(oxccl::Error::Config { field: "test", why: "rank 1 fails".into() });
                        }
                        m.wait()
                    })
                })
            })
            .collect();
        let e = joined(threads).expect_err("rank 1 failed");
        assert!(e.to_string().contains("rank 1 fails"), "the failure itself is reported: {e}");
    }
}
