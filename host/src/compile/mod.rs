//! The ResCCL compiler: from a [`Program`](crate::program::Program) (or any [`OpSource`]) to a
//! [`Plan`] (per rank, per thread block, an ordered task list that runs every micro-batch).
//!
//! ## Passes
//!
//! | pass | what it does |
//! |---|---|
//! | `deps` | split ops into per-rank tasks; data dependencies from declared reads/writes per chunk; links |
//! | `schedule` | sub-pipelines and a global order: HPDS, round-robin, algorithm level or stage level |
//! | `tb-alloc` | FIFO connections, and thread blocks for connection endpoints (state-based or per connection) |
//! | `emit` | per-TB ordered task lists with sync points, and statistics |
//!
//! The same table is [`PASSES`], for tools. The [`Plan`] is what the simulator ([`crate::sim`]) times
//! and the CPU executor ([`crate::exec`]) checks. The device runs programs through [`direct`]: each
//! level of hazard-free ops one launch of the collectives' engine, data moved straight between the
//! ranks' buffers; it does not take the plan's schedule or thread blocks (yet).
//!
//! Each pass is followed by its verifier ([`verify`]) unless [`Options::verify`] is off; every pass
//! has a text dump ([`Compilation`]) that the golden tests compare.
//!
//! ## Scale
//!
//! The passes read the program through [`OpSource`] and keep no copy of its ops, so a generated
//! program ([`crate::program::generators::Algorithm::source`]) compiles without ever being
//! stored. What they keep is compact, per op: successors and a producer count, a link and a chunk
//! (`deps`), the order (`schedule`); per connection its numbering (`tb-alloc`); per task, only in
//! batches, its position in the order (`emit`). Task-level dependencies, endpoints and TBs are found
//! rank by rank as the plan is emitted and dropped with the rank, unless the caller keeps it
//! ([`compile`]; [`compile_streaming`] hands each rank over).
//!
//! Before anything is allocated the compiler estimates its peak memory ([`estimate_bytes`], then
//! again before `schedule` and `emit` with the links and connections then known) and refuses a
//! program over [`Options::memory_limit`] with [`CompileError::TooLarge`]; its large tables are
//! allocated fallibly.
//!
//! With [`Options::threads`] (by default the machine's), the dependency walk splits the ranks over
//! threads, `emit` builds ranks on workers handed over in rank order, and the verifiers run beside
//! the next pass or split their work; the plan is the same for every thread count.
//!
//! The 8192-GPU HM AllReduce (134 M ops, 268 M tasks), streamed, compiles in about 3 GB and 25 s on
//! two idle cores (`cargo bench -p oxccl-host --bench planners` with `OXCCL_BENCH_8192=1`).
//!
//! ## The execution model the passes target (the simulator's and the executor's)
//!
//! A *task* is one rank's half of an op: the send or the receive of a transfer, or a local copy or
//! reduce. A *sub-pipeline* is a set of tasks that run together, each over every micro-batch, before
//! the next sub-pipeline's tasks on the same thread block start (sub-pipelines are not barriers between
//! TBs; data dependencies and FIFOs are the only synchronisation). The scheduler assigns every op a
//! sub-pipeline and a global position; a TB runs its tasks sorted by (sub-pipeline, position), looping
//! over micro-batches inside each sub-pipeline. See [`Plan`] for the exact semantics.

/// Most micro-batches the simulator and the CPU executor take (each is a full pass over the plan;
/// the automatic choice stays within 1..=512).
pub const MAX_MICRO_BATCHES: u32 = 1 << 16;

pub mod deps;
pub mod direct;
pub mod memory;
pub mod plan;
pub mod schedule;
pub mod source;
pub mod tballoc;
pub mod verify;

pub use deps::{Graph, Link, Prim, Task};
pub use memory::TooLarge;
pub use plan::{Connection, Plan, PlanStats, RankPlan, SyncPoint, TbCursor, TbPlan, TbTask};
pub use schedule::Schedule;
pub use source::OpSource;
pub use tballoc::{Allocation, Connections, Endpoint, EndpointKind};

use crate::program::{ProgramError, Rank, entity};
use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;
use std::time::Instant;

entity!(
    /// A task of the dependency graph ([`Graph::tasks`]). Printed `t5`.
    TaskId,
    "t"
);
entity!(
    /// A link of the dependency graph: `(src, dst, channel)` for transfers, `(rank, channel)` for
    /// local ops ([`Graph::links`]). Printed `l2`.
    LinkId,
    "l"
);
entity!(
    /// A FIFO connection of a plan ([`Plan::connections`]). Printed `c4`.
    ConnId,
    "c"
);
entity!(
    /// A thread block of one rank ([`RankPlan::tbs`]). Printed `tb1`.
    TbId,
    "tb"
);

/// One compiler pass: its name and a one-line description.
#[derive(Copy, Clone, Debug)]
pub struct PassInfo {
    /// The pass's name, as [`Compilation::dump`], [`CompileError::Verify`] and
    /// [`PlanStats::pass_ms`] spell it.
    pub name: &'static str,
    /// What the pass does, in one line.
    pub description: &'static str,
}

/// The pass table, in order.
pub const PASSES: [PassInfo; 4] = [
    PassInfo {
        name: "deps",
        description: "split ops into per-rank tasks; derive data dependencies from declared reads/writes \
                      per chunk, and links (communication dependencies) per (src, dst, channel)",
    },
    PassInfo {
        name: "schedule",
        description: "assign every op a sub-pipeline and a global position (HPDS, round-robin, \
                      algorithm level or stage level)",
    },
    PassInfo {
        name: "tb-alloc",
        description: "map transfers to FIFO connections and connection endpoints to thread blocks \
                      (state-based sharing or one per connection and stage)",
    },
    PassInfo { name: "emit", description: "order each TB's tasks, add cross-TB sync points, compute statistics" },
];

/// Which scheduler the `schedule` pass runs.
#[derive(Copy, Clone, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
pub enum Scheduler {
    /// ResCCL's HPDS: chunks in a priority queue (least-scheduled first); a sub-pipeline takes every
    /// ready op with a free link, including ops whose producers joined the same sub-pipeline, except an
    /// intra-node op whose producer is an inter-node op of the same sub-pipeline. Closed when nothing
    /// fits.
    Hpds,
    /// Baseline: chunks in a fixed rotation, at most one op per chunk per sub-pipeline, only ops whose
    /// producers are in earlier sub-pipelines, one free link each.
    RoundRobin,
    /// Baseline: the whole algorithm is one sub-pipeline: every TB walks its whole task list once per
    /// micro-batch (MSCCL's interpreter; one micro-batch after another).
    Algorithm,
    /// Baseline: one sub-pipeline per algorithm stage ([`crate::program::Op::stage`]) in dependency
    /// order (a new sub-pipeline wherever a dependency crosses stages).
    Stage,
}

impl Scheduler {
    /// The CLI name.
    pub fn name(self) -> &'static str {
        match self {
            Scheduler::Hpds => "hpds",
            Scheduler::RoundRobin => "rr",
            Scheduler::Algorithm => "algo",
            Scheduler::Stage => "stage",
        }
    }
    /// Every scheduler.
    pub const ALL: [Scheduler; 4] = [Scheduler::Hpds, Scheduler::RoundRobin, Scheduler::Algorithm, Scheduler::Stage];
}

impl FromStr for Scheduler {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "hpds" => Ok(Scheduler::Hpds),
            "rr" | "round-robin" => Ok(Scheduler::RoundRobin),
            "algo" | "algorithm" => Ok(Scheduler::Algorithm),
            "stage" => Ok(Scheduler::Stage),
            _ => Err(format!("unknown scheduler `{s}` (hpds, rr, algo, stage)")),
        }
    }
}

impl fmt::Display for Scheduler {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Which allocator the `tb-alloc` pass runs.
#[derive(Copy, Clone, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
pub enum TbAlloc {
    /// State-based: one FIFO per `(src, dst, channel)`; connection endpoints whose active
    /// sub-pipeline intervals never overlap share a TB (optimal interval colouring per rank).
    State,
    /// Baseline (MSCCL): one FIFO per `(src, dst, channel, stage)` and one TB per endpoint.
    PerConn,
}

impl TbAlloc {
    /// The CLI name.
    pub fn name(self) -> &'static str {
        match self {
            TbAlloc::State => "state",
            TbAlloc::PerConn => "per-conn",
        }
    }
    /// Every allocator.
    pub const ALL: [TbAlloc; 2] = [TbAlloc::State, TbAlloc::PerConn];
}

impl FromStr for TbAlloc {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "state" => Ok(TbAlloc::State),
            "per-conn" | "perconn" | "conn" => Ok(TbAlloc::PerConn),
            _ => Err(format!("unknown TB allocator `{s}` (state, per-conn)")),
        }
    }
}

impl fmt::Display for TbAlloc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Compiler options.
#[derive(Clone, Debug)]
pub struct Options {
    /// The scheduler the `schedule` pass runs (default [`Scheduler::Hpds`]).
    pub scheduler: Scheduler,
    /// The allocator the `tb-alloc` pass runs (default [`TbAlloc::State`]).
    pub tb_alloc: TbAlloc,
    /// Ranks per node, for the intra/inter-node distinction; `None` takes the program's hint, and
    /// without one every rank is on one node.
    pub ranks_per_node: Option<u32>,
    /// Run the verifier after every pass (on by default).
    pub verify: bool,
    /// Most bytes the compilation may take ([`estimate_bytes`], the program itself not counted);
    /// `None` (the default) takes what this process can still allocate
    /// ([`memory::default_limit`]).
    pub memory_limit: Option<u64>,
    /// Threads the compiler may use (`emit` builds ranks in parallel, `deps` walks ranks in
    /// parallel); `None` (the default) takes the machine's parallelism, at most 8. The plan does
    /// not depend on it.
    pub threads: Option<usize>,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            scheduler: Scheduler::Hpds,
            tb_alloc: TbAlloc::State,
            ranks_per_node: None,
            verify: true,
            memory_limit: None,
            threads: None,
        }
    }
}

impl Options {
    /// Options with the given scheduler and allocator.
    pub fn new(scheduler: Scheduler, tb_alloc: TbAlloc) -> Options {
        Options { scheduler, tb_alloc, ..Options::default() }
    }
}

/// Why a program could not be compiled.
#[derive(Clone, PartialEq, Debug, thiserror::Error)]
pub enum CompileError {
    /// The program is structurally invalid.
    #[error("invalid program: {0}")]
    Program(#[from] ProgramError),
    /// A verifier found a broken invariant after a pass (a compiler bug, reported rather than
    /// panicking).
    #[error("verifier after `{pass}`: {message}")]
    Verify {
        /// The pass whose result broke the invariant (a name from [`PASSES`]).
        pass: &'static str,
        /// Which invariant broke, and where.
        message: String,
    },
    /// The compilation would take more memory than [`Options::memory_limit`] (estimated before
    /// anything was allocated), or an allocation failed.
    #[error("{0}")]
    TooLarge(#[from] TooLarge),
}

/// Every intermediate result of a compilation, for dumps and tests.
#[derive(Clone, Debug)]
pub struct Compilation {
    /// The result of `deps`.
    pub graph: Graph,
    /// The result of `schedule`.
    pub schedule: Schedule,
    /// The result of `tb-alloc`, every rank's half kept ([`tballoc::run`]).
    pub alloc: Allocation,
    /// The result of `emit`, with every rank plan, as [`compile`] returns it.
    pub plan: Plan,
}

impl Compilation {
    /// The text dump after pass `pass` (a name from [`PASSES`]) of `src`'s compilation.
    pub fn dump(&self, src: &impl OpSource, pass: &str) -> Option<String> {
        match pass {
            "deps" => Some(self.graph.dump(src)),
            "schedule" => Some(self.schedule.dump()),
            "tb-alloc" => Some(self.alloc.dump()),
            "emit" => Some(self.plan.dump()),
            _ => None,
        }
    }
}

/// Runs every pass (and its verifier) and keeps the intermediate results (for small programs:
/// the whole allocation is kept, see [`tballoc::run`]).
pub fn run_passes(src: &impl OpSource, opts: &Options) -> Result<Compilation, CompileError> {
    let mut ranks = Vec::with_capacity(src.ranks() as usize);
    let (mut plan, kept) = drive(src, opts, Keep::All, &mut |rp| ranks.push(rp))?;
    plan.ranks = ranks;
    let (graph, schedule) = kept.expect("kept on request");
    let alloc = tballoc::run(src, &graph, &schedule, opts.tb_alloc);
    if opts.verify {
        verify::alloc(src, &graph, &schedule, &alloc)?;
    }
    Ok(Compilation { graph, schedule, alloc, plan })
}

/// Compiles `src` into a [`Plan`].
pub fn compile(src: &impl OpSource, opts: &Options) -> Result<Plan, CompileError> {
    let mut ranks = Vec::with_capacity(src.ranks() as usize);
    let (mut plan, _) = drive(src, opts, Keep::Plan, &mut |rp| ranks.push(rp))?;
    plan.ranks = ranks;
    Ok(plan)
}

/// Compiles `src` like [`compile`], but hands each rank's plan to `sink` as soon as it is
/// emitted (and verified), in rank order, instead of keeping it. Returns the plan without its rank
/// plans (`ranks` is empty) but with its connections and statistics; `compile_ms` covers every pass
/// and verifier, as for [`compile`], and the time `sink` takes.
///
/// This is for callers that look at one rank at a time or only at the statistics: the whole plan
/// of an 8192-GPU HM AllReduce (268 M tasks) takes about 19 GB on its own, while compiling that
/// program this way from its generator ([`crate::program::generators::Algorithm::source`]) peaks at
/// about 3 GB.
pub fn compile_streaming(
    src: &impl OpSource,
    opts: &Options,
    sink: &mut dyn FnMut(RankPlan),
) -> Result<Plan, CompileError> {
    drive(src, opts, Keep::Nothing, sink).map(|(plan, _)| plan)
}

/// The sizes [`estimate_bytes`] reads from a program.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct Sizes {
    /// Ops.
    pub ops: u64,
    /// Transfers among them (a task on each of two ranks).
    pub transfers: u64,
    /// Chunks the ops' sources cover.
    pub reads: u64,
    /// Chunk locations of all ranks' storage.
    pub locations: u64,
    /// Ranks.
    pub ranks: u64,
    /// The most tasks one rank has.
    pub max_rank_tasks: u64,
    /// Bytes of a dense chunk id: 2 when every chunk label is below 2^16, else 4.
    pub chunk_bytes: u64,
}

impl Sizes {
    /// Counts them (one pass over the ops).
    pub fn of(src: &impl OpSource) -> Sizes {
        let l = src.layout();
        let mut per_rank = vec![0u64; l.ranks as usize];
        let mut s = Sizes {
            ops: src.op_count() as u64,
            locations: (0..l.ranks).map(|r| l.storage_chunks(Rank(r)) as u64).sum(),
            ranks: l.ranks as u64,
            chunk_bytes: 2,
            ..Sizes::default()
        };
        let _ = src.try_for_each_op(|_, op| -> Result<(), ()> {
            for r in [op.src_rank(), op.dst_rank()].into_iter().take(Task::count(op)) {
                if let Some(c) = per_rank.get_mut(r.index()) {
                    *c += 1;
                }
            }
            s.transfers += op.is_transfer() as u64;
            s.reads += op.src().count as u64;
            if op.chunk >= 1 << 16 {
                s.chunk_bytes = 4;
            }
            Ok(())
        });
        s.max_rank_tasks = per_rank.into_iter().max().unwrap_or(0);
        s
    }

    /// Tasks.
    pub fn tasks(&self) -> u64 {
        self.ops + self.transfers
    }
}

/// The compiler's peak memory for a program of these sizes, in bytes, the program itself not
/// counted, taking two dependencies per op (the generated programs have at most two on average) and
/// leaving out what grows with the links (checked again once they are known): the largest of
/// `deps` ([`deps::estimate_bytes`]), `schedule` beside the graph ([`schedule::estimate_bytes`]),
/// and `emit` beside the order and the links ([`plan::estimate_bytes`]).
pub fn estimate_bytes(s: &Sizes) -> u64 {
    let edges = 2 * s.ops;
    let deps = deps::estimate_bytes(s.ops, edges, s.reads, s.locations, s.chunk_bytes, deps::MAX_WALK_THREADS as u64);
    let schedule = deps::graph_bytes(s.ops, edges, s.chunk_bytes) + schedule::estimate_bytes(s.ops, 0);
    let emit = s.ops * 12 + plan::estimate_bytes(s.tasks(), s.ranks, s.max_rank_tasks, 0, 1);
    deps.max(schedule).max(emit)
}

/// What a compilation's caller keeps beside the statistics, for the memory estimate.
#[derive(Copy, Clone, PartialEq, Eq)]
enum Keep {
    /// Nothing: each rank plan is handed over and dropped ([`compile_streaming`]).
    Nothing,
    /// Every rank plan ([`compile`]).
    Plan,
    /// Every rank plan and every pass's result ([`run_passes`]).
    All,
}

/// Bytes a whole plan of `tasks` tasks takes: its tasks and about one sync point each.
pub fn plan_bytes(tasks: u64) -> u64 {
    tasks * (std::mem::size_of::<TbTask>() + std::mem::size_of::<SyncPoint>()) as u64
}

/// Runs the passes, each followed by its verifier, handing rank plans to `sink`. With
/// [`Keep::All`] it returns the graph and the schedule; otherwise it drops each as soon as no later
/// pass needs it.
fn drive(
    src: &impl OpSource,
    opts: &Options,
    keep: Keep,
    sink: &mut dyn FnMut(RankPlan),
) -> Result<(Plan, Option<(Graph, Schedule)>), CompileError> {
    let start = Instant::now();
    let mut times: Vec<(String, f64)> = Vec::new();
    let mut lap = Instant::now();
    let mut mark = |name: &str, times: &mut Vec<(String, f64)>| {
        times.push((name.to_string(), lap.elapsed().as_secs_f64() * 1e3));
        lap = Instant::now();
    };
    src.verify()?;
    let sizes = Sizes::of(src);
    let limit = opts.memory_limit.unwrap_or_else(memory::default_limit);
    let tasks = sizes.tasks();
    let kept = match keep {
        Keep::Nothing => 0,
        // The whole plan, and for dumps a copy of the ops and the graph's tables.
        Keep::Plan => plan_bytes(tasks),
        Keep::All => plan_bytes(tasks) + sizes.ops * 96,
    };
    // Checked before anything is allocated, and again before `schedule` and `emit` with what is
    // then known (dependencies, links, connections).
    let check = |need: u64| {
        memory::check(limit, need.saturating_add(kept), || {
            let what = if keep == Keep::Nothing { "" } else { ", keeping the whole plan" };
            format!("compiling {} ({} ops, {tasks} tasks on {} ranks{what})", src.name(), sizes.ops, sizes.ranks)
        })
    };
    check(estimate_bytes(&sizes))?;
    let per_node = opts.ranks_per_node.or(src.ranks_per_node());
    let threads = plan::threads(opts);
    let mut graph = deps::build(src, per_node, threads)?;
    mark("deps", &mut times);
    let links = graph.links.links.len() as u64;
    check(graph.heap_bytes() + schedule::estimate_bytes(sizes.ops, links))?;
    // With threads, work that needs only the graph runs beside the scheduler: the graph's
    // verifier (its error, the earlier pass's, comes first), the connections (`tb-alloc`'s first
    // half) and the emit verifier's sums over the program. Their time counts in `schedule`.
    let verify = opts.verify;
    let helper = || {
        let checked = if verify { verify::graph(src, &graph) } else { Ok(()) };
        let conns = tballoc::Connections::build(src, &graph, opts.tb_alloc);
        let expected = verify.then(|| verify::expected_sums(src));
        (checked, conns, expected)
    };
    let ((checked, conns, expected), schedule) = if threads < 2 {
        let h = helper();
        (h, schedule::run(src, &graph, opts.scheduler))
    } else {
        std::thread::scope(|scope| {
            let h = scope.spawn(helper);
            let schedule = schedule::run(src, &graph, opts.scheduler);
            (h.join().expect("a compiler thread panicked"), schedule)
        })
    };
    checked?;
    let schedule = schedule?;
    mark("schedule", &mut times);
    if verify {
        verify::schedule_on(src, &graph, &schedule, threads)?;
    }
    let keep_all = keep == Keep::All;
    if !keep_all {
        // Only the schedulers and their verifier walk successors and read chunks.
        graph.op_succs = Csr::default();
        graph.chunk_of_op = deps::Dense::U16(Vec::new());
    }
    mark("tb-alloc", &mut times);
    let conn_bytes = conns.list.len() as u64 * 48;
    let check_bytes = verify::PlanCheck::estimate_bytes(sizes.ranks, conns.list.len() as u64);
    let emit = plan::estimate_bytes(tasks, sizes.ranks, sizes.max_rank_tasks, links, threads as u64);
    check(graph.heap_bytes() + sizes.ops * 8 + conn_bytes + check_bytes + emit)?;
    let link_by_pos = plan::links_by_position(&graph, &schedule, threads)?;
    if !keep_all {
        graph.link_of_op = Vec::new();
    }
    let mut check = expected.map(|e| verify::PlanCheck::with_expected(e, &graph, &conns));
    let (mut plan, alloc_ms) =
        plan::emit(src, &graph, &link_by_pos, &schedule, &conns, opts, check.as_mut(), &mut |rp| {
            sink(rp);
            Ok(())
        })?;
    if let Some(c) = check {
        c.finish()?;
    }
    mark("emit", &mut times);
    // The per-rank half of `tb-alloc` ran inside `emit`'s loop: its time moves to `tb-alloc`.
    times[2].1 += alloc_ms;
    times[3].1 -= alloc_ms;
    plan.stats.compile_ms = start.elapsed().as_secs_f64() * 1e3;
    plan.stats.pass_ms = times;
    Ok((plan, keep_all.then_some((graph, schedule))))
}

/// A fast, non-cryptographic hasher for the compiler's integer keys (a multiply-rotate mix in the
/// style of rustc's FxHash); the default SipHash dominated the passes on million-op programs.
#[derive(Default, Clone, Copy)]
pub(crate) struct FastHasher(u64);

impl std::hash::Hasher for FastHasher {
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(b as u64);
        }
    }
    #[inline]
    fn write_u8(&mut self, i: u8) {
        self.write_u64(i as u64);
    }
    #[inline]
    fn write_u32(&mut self, i: u32) {
        self.write_u64(i as u64);
    }
    #[inline]
    fn write_usize(&mut self, i: usize) {
        self.write_u64(i as u64);
    }
    #[inline]
    fn write_u64(&mut self, i: u64) {
        self.0 = (self.0.rotate_left(5) ^ i).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }
    #[inline]
    fn finish(&self) -> u64 {
        self.0
    }
}

/// A hash map with [`FastHasher`].
pub(crate) type FastMap<K, V> = std::collections::HashMap<K, V, std::hash::BuildHasherDefault<FastHasher>>;

/// A compressed sparse row adjacency: `items[start[i]..start[i+1]]` belong to `i`.
#[derive(Clone, Debug, Default)]
pub struct Csr {
    /// Row boundaries: one entry per row plus the total item count, non-decreasing (empty for a
    /// default, row-less `Csr`).
    pub start: Vec<u32>,
    /// Every row's items, concatenated in row order (dense indices such as op ids).
    pub items: Vec<u32>,
}

impl Csr {
    /// The items of row `i`.
    #[inline]
    pub fn row(&self, i: usize) -> &[u32] {
        &self.items[self.start[i] as usize..self.start[i + 1] as usize]
    }
    /// Number of rows.
    pub fn rows(&self) -> usize {
        self.start.len().saturating_sub(1)
    }
    /// The transpose (rows become columns) with `rows` rows; each row comes out sorted.
    pub fn transpose(&self, rows: usize) -> Csr {
        // `start[x]` counts row `x`, then sums up to its end, then is moved back to its start while
        // the rows are filled from their ends, walking the input backwards.
        let mut start = vec![0u32; rows + 1];
        for &x in &self.items {
            start[x as usize] += 1;
        }
        for x in 1..rows {
            start[x] += start[x - 1];
        }
        start[rows] = self.items.len() as u32;
        let mut items = vec![0u32; self.items.len()];
        for i in (0..self.rows()).rev() {
            for &x in self.row(i).iter().rev() {
                start[x as usize] -= 1;
                items[start[x as usize] as usize] = i as u32;
            }
        }
        Csr { start, items }
    }
}
