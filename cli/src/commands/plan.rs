//! `oxccl plan`: compile an algorithm (built-in, MSCCL XML or text IR) and print the plan summary.
//!
//! ```text
//! oxccl plan --algo hm-allgather --topo 2x8 --json
//! oxccl plan --xml host/tests/data/msccl/ndv4_r48ll.xml --scheduler algo --tb-alloc per-conn
//! oxccl plan --algo ring-allreduce --topo 1x4 --dump emit
//! oxccl plan --algo direct-allreduce --topo 1x4 --dump direct
//! ```

use super::CliResult;
use crate::progress::{LONG_RUN, Progress};
use oxccl_host::compile::{self, OpSource, Options, Plan, Scheduler, TbAlloc};
use oxccl_host::program::generators::{Algorithm, Generated};
use oxccl_host::program::{InstanceChannels, Program, msccl, text};
use std::path::PathBuf;

/// A built-in algorithm's generator and the machine shape it runs on ([`ProgramArgs::source`]).
pub struct Source {
    /// The generator, its ranks per node `gpus_per_node`.
    pub src: Generated,
    /// Nodes of the machine.
    pub nodes: u32,
    /// GPUs (ranks) per node.
    pub gpus_per_node: u32,
}

/// Where the program comes from and how to compile it (shared by `plan`, `simulate`, `verify`).
#[derive(clap::Args, Debug, Clone)]
pub struct ProgramArgs {
    /// Built-in algorithm: ring-allreduce, ring-allgather, ring-reducescatter, direct-allreduce,
    /// direct-allgather, direct-reducescatter, direct-alltoall, hm-allgather, hm-reducescatter,
    /// hm-allreduce, hier-allreduce, hier-reducescatter, hier-allgather, chain-broadcast,
    /// chain-reduce (rooted at rank 0).
    #[arg(long, conflicts_with_all = ["xml", "program"])]
    pub algo: Option<String>,
    /// MSCCL XML algorithm file.
    #[arg(long, conflicts_with = "program")]
    pub xml: Option<PathBuf>,
    /// Transfer program in oxccl's text format.
    #[arg(long)]
    pub program: Option<PathBuf>,
    /// Machine shape NODESxGPUS (e.g. 2x8): required with --algo; with --xml or --program it sets
    /// which ranks share a node (default: the program's `ranks-per-node`, else all on one node).
    #[arg(long)]
    pub topo: Option<String>,
    /// Replicate the program K times over K-times finer chunks (more independent work).
    #[arg(long, default_value_t = 1, allow_negative_numbers = true)]
    pub instances: u32,
    /// With --instances: `shared` (every instance on the program's channels) or `separate` (each
    /// on channels of its own, as MSCCL's instances: more links, FIFOs and thread blocks).
    #[arg(long = "instance-channels", default_value = "shared")]
    pub instance_channels: String,
    /// Scheduler: hpds, rr (round-robin), algo (algorithm level), stage (stage level).
    #[arg(long, default_value = "hpds")]
    pub scheduler: String,
    /// Thread-block allocation: state (state-based sharing) or per-conn (one per connection and stage).
    #[arg(long = "tb-alloc", default_value = "state")]
    pub tb_alloc: String,
}

/// A loaded program and the machine shape it runs on.
pub struct Loaded {
    /// The program, its `ranks_per_node` set to `gpus_per_node`.
    pub program: Program,
    /// Nodes of the machine.
    pub nodes: u32,
    /// GPUs (ranks) per node.
    pub gpus_per_node: u32,
}

/// Parses `NxG`.
pub fn parse_topo(s: &str) -> Result<(u32, u32), String> {
    let (a, b) = s.split_once(['x', 'X']).ok_or_else(|| format!("--topo `{s}`: expected NODESxGPUS, e.g. 2x8"))?;
    let n = a.trim().parse::<u32>().map_err(|_| format!("--topo `{s}`: bad node count"))?;
    let g = b.trim().parse::<u32>().map_err(|_| format!("--topo `{s}`: bad GPU count"))?;
    if n == 0 || g == 0 {
        return Err(format!("--topo `{s}`: needs at least one node and one GPU"));
    }
    let max = oxccl_host::program::BufferLayout::MAX_RANKS;
    if n.checked_mul(g).is_none_or(|r| r > max) {
        return Err(format!("--topo `{s}`: more than {max} GPUs"));
    }
    Ok((n, g))
}

impl ProgramArgs {
    /// Loads (generates, imports or parses) the program.
    pub fn load(&self) -> Result<Loaded, Box<dyn std::error::Error>> {
        let topo = self.topo.as_deref().map(parse_topo).transpose()?;
        let mut program = if let Some(name) = &self.algo {
            let algo: Algorithm = name.parse()?;
            let (n, g) = topo.ok_or("--algo needs --topo NODESxGPUS")?;
            algo.generate(n, g)?
        } else if let Some(path) = &self.xml {
            msccl::import_path(path)
                .map_err(|e| match e {
                    // A read error names the file already.
                    msccl::ImportError::Input(e) => e.to_string(),
                    e => format!("{}: {e}", path.display()),
                })?
                .program
        } else if let Some(path) = &self.program {
            let p = text::parse_path(path).map_err(|e| match e {
                oxccl_host::program::ProgramError::Input(e) => e.to_string(),
                e => format!("{}: {e}", path.display()),
            })?;
            p.check().map_err(|e| format!("{}: {e}", path.display()))?;
            p
        } else {
            return Err("give one of --algo, --xml, --program".into());
        };
        let ranks = program.ranks();
        let (nodes, gpus) = match topo {
            Some((n, g)) if n * g != ranks => {
                return Err(format!("--topo {n}x{g} has {} GPUs, the program {ranks} ranks", n * g).into());
            }
            Some((n, g)) => (n, g),
            None => match program.ranks_per_node {
                Some(g) if g > 0 && ranks % g == 0 => (ranks / g, g),
                _ => (1, ranks),
            },
        };
        program.ranks_per_node = Some(gpus);
        if self.instances == 0 {
            return Err("--instances must be at least 1".into());
        }
        let channels: InstanceChannels = self.instance_channels.parse()?;
        if self.instances == 1 && channels != InstanceChannels::Shared {
            return Err("--instance-channels separate needs --instances 2 or more".into());
        }
        if self.instances > 1 {
            program = program.instanced_on(self.instances, channels)?;
        }
        Ok(Loaded { program, nodes, gpus_per_node: gpus })
    }

    /// A built-in algorithm given once (`--algo`, one instance) as its generator: the same ops as
    /// [`ProgramArgs::load`]'s program, computed as the compiler reads them and never stored
    /// ([`Algorithm::source`]); `None` for any other program. The arguments are checked as
    /// [`ProgramArgs::load`] checks them.
    pub fn source(&self) -> Result<Option<Source>, Box<dyn std::error::Error>> {
        let (Some(name), 1) = (&self.algo, self.instances) else { return Ok(None) };
        let topo = self.topo.as_deref().map(parse_topo).transpose()?;
        let algo: Algorithm = name.parse()?;
        let (n, g) = topo.ok_or("--algo needs --topo NODESxGPUS")?;
        let src = algo.source(n, g)?;
        let channels: InstanceChannels = self.instance_channels.parse()?;
        if channels != InstanceChannels::Shared {
            return Err("--instance-channels separate needs --instances 2 or more".into());
        }
        Ok(Some(Source { src, nodes: n, gpus_per_node: g }))
    }

    /// The compiler options.
    pub fn options(&self) -> Result<Options, Box<dyn std::error::Error>> {
        let scheduler: Scheduler = self.scheduler.parse()?;
        let tb_alloc: TbAlloc = self.tb_alloc.parse()?;
        Ok(Options::new(scheduler, tb_alloc))
    }

    /// Loads and compiles.
    pub fn compile(&self) -> Result<(Loaded, Plan), Box<dyn std::error::Error>> {
        let loaded = self.load()?;
        let plan = compile::compile(&loaded.program, &self.options()?)?;
        Ok((loaded, plan))
    }
}

/// Flags of `oxccl plan`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// The program and how to compile it.
    #[command(flatten)]
    pub program: ProgramArgs,
    /// Print the summary as JSON (ranks, tbs_per_rank, max_tbs_per_rank, tasks, subpipelines,
    /// compile_ms, ...).
    #[arg(long)]
    pub json: bool,
    /// Print a text dump instead: `program`, the result of a pass (deps, schedule, tb-alloc, emit),
    /// or `direct`: the program lowered level by level for the collective engine (what
    /// `run_program` runs), 16-byte f32 chunks, one CTA per rank.
    #[arg(long)]
    pub dump: Option<String>,
}

/// Compiles the program and prints its summary (as text or JSON), or with `--dump` the program or
/// one pass's result as text.
pub fn run(args: Args) -> CliResult {
    // A built-in algorithm compiles from its generator: its ops are never stored (the 8192-GPU HM
    // AllReduce's 134 M ops would take 7 GB), and the plan is the same.
    if args.dump.is_none()
        && let Some(s) = args.program.source()?
    {
        return summarize(&s.src, &args.program.options()?, args.json, s.nodes, s.gpus_per_node);
    }
    let loaded = args.program.load()?;
    let opts = args.program.options()?;
    if let Some(pass) = &args.dump {
        if pass == "program" {
            print!("{}", text::print(&loaded.program));
            return Ok(());
        }
        if pass == "direct" {
            use oxccl_host::compile::direct::{DirectOptions, lower_direct};
            let opts = DirectOptions::new(16, oxccl_kernels::abi::DType::F32, 1);
            print!("{}", lower_direct(&loaded.program, &opts)?);
            return Ok(());
        }
        let c = compile::run_passes(&loaded.program, &opts)?;
        let names: Vec<&str> = compile::PASSES.iter().map(|p| p.name).collect();
        let dump = c
            .dump(&loaded.program, pass)
            .ok_or_else(|| format!("--dump `{pass}`: expected program, direct or one of {}", names.join(", ")))?;
        print!("{dump}");
        return Ok(());
    }
    summarize(&loaded.program, &opts, args.json, loaded.nodes, loaded.gpus_per_node)
}

/// Compiles `src` and prints the plan's summary. The summary reads no rank plan: each is emitted,
/// verified and dropped at once, which is what lets an 8192-GPU program compile here (its whole
/// plan alone would take about 19 GB).
fn summarize(src: &impl OpSource, opts: &Options, json: bool, nodes: u32, gpus: u32) -> CliResult {
    // A bar over the ranks emitted, for compiles that take long enough to want one.
    let progress = Progress::after("compile", src.ranks().into(), json, LONG_RUN);
    let plan = compile::compile_streaming(src, opts, &mut |rank_plan| {
        drop(rank_plan);
        progress.step("ranks emitted");
    })?;
    drop(progress);
    if json {
        println!("{}", serde_json::to_string_pretty(&plan.summary_json())?);
        return Ok(());
    }
    print_summary(&plan, nodes, gpus);
    Ok(())
}

/// The human-readable plan summary.
pub fn print_summary(plan: &Plan, nodes: u32, gpus: u32) {
    let s = &plan.stats;
    let l = &plan.layout;
    let tbs = &s.tbs_per_rank;
    let min = tbs.iter().copied().min().unwrap_or(0);
    let mean = tbs.iter().map(|&x| x as f64).sum::<f64>() / tbs.len().max(1) as f64;
    println!(
        "plan {}: {} on {} ranks ({nodes}x{gpus}), {} chunks, {}",
        plan.name,
        l.collective.program_name(),
        l.ranks,
        l.chunks,
        if l.in_place { "in place" } else { "out of place" }
    );
    println!("  scheduler {}, tb-alloc {}", plan.scheduler, plan.tb_alloc);
    println!(
        "  ops {}, tasks {}, sub-pipelines {}, connections {}, sync points {}",
        s.ops, s.tasks, s.subpipelines, s.connections, s.sync_points
    );
    println!("  TBs per rank: max {} (min {min}, mean {mean:.1})", s.max_tbs_per_rank);
    println!(
        "  estimated TB idle share {:.1}%, FIFO slots needed {}",
        s.est_tb_idle_share * 100.0,
        s.fifo_slots_needed
    );
    println!("  compile time {:.2} ms", s.compile_ms);
}
