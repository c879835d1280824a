//! A discrete-event simulator of a compiled plan on a topology.
//!
//! The simulator runs the plan with the executor's semantics ([`crate::exec`]): one program counter
//! per thread block over (segment, micro-batch, task), sync points, FIFO connections with a fixed
//! number of slots. Time comes from a fluid model of the hardware:
//!
//! * **Resources**: per GPU an NVLink/NVSwitch egress port, an ingress port and its HBM; per NIC an
//!   egress and an ingress side (NICs are shared by `gpus_per_nic` GPUs). Each has a bandwidth, a
//!   start-up latency α, a *concurrency* `c` and a contention penalty `p` ([`LinkParams`]).
//! * **Flows** share resources: one flow (one TB's transfer) gets at most `bw/c`; with `k > c` flows
//!   on a resource their aggregate drops to `bw / (1 + p·(k-c))`, shared equally. A flow moves at the
//!   smallest share over its resources; rates are recomputed whenever a flow starts or ends.
//! * **Tasks**: a send waits for a free FIFO slot, spends α of its link, then moves the micro-batch
//!   over the link (intra-node: source egress + destination ingress port; inter-node: the two NICs);
//!   the message is then in the receiver's FIFO. A receive waits for the message and copies it out
//!   through HBM (a `recv_reduce_copy` and a reduce move 1.5× the bytes), which frees the slot. Local
//!   copies and reductions use HBM. Every non-send task pays the HBM α as its step overhead.
//!
//! The result ([`SimReport`]) gives the completion time, algorithm and bus bandwidth (nccl-tests
//! conventions: GB = 10⁹ bytes), per-resource utilisation, per-TB busy time and idle share, and an
//! optional timeline that [`svg::timeline`] draws with one lane per link and per TB.

pub mod svg;

use crate::compile::{Plan, Prim, TbCursor};
use crate::exec::Blocked;
use serde::Serialize;
use std::cmp::Ordering;
use std::collections::{BinaryHeap, VecDeque};
use std::fmt;

/// Parameters of one class of resource.
#[derive(Copy, Clone, Debug, PartialEq, Serialize)]
pub struct LinkParams {
    /// Start-up latency per message, in microseconds.
    pub alpha_us: f64,
    /// Bandwidth per direction, in GB/s (10⁹ bytes per second).
    pub bw_gbps: f64,
    /// Flows needed to saturate the resource; one flow gets at most `bw / concurrency`.
    pub concurrency: u32,
    /// Aggregate bandwidth drops to `bw / (1 + penalty·(k - concurrency))` with `k > concurrency`
    /// flows.
    pub contention_penalty: f64,
}

/// A machine: `nodes` × `gpus_per_node` GPUs.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Topology {
    /// Label for reports (`h200-1x8`), copied to [`SimReport::topology`].
    pub name: String,
    /// Nodes (servers).
    pub nodes: u32,
    /// GPUs per node; ranks are numbered node by node (rank `r` is on node `r / gpus_per_node`).
    pub gpus_per_node: u32,
    /// Each GPU's NVLink/NVSwitch port, per direction.
    pub nvlink: LinkParams,
    /// Each NIC, per direction.
    pub nic: LinkParams,
    /// GPUs sharing one NIC.
    pub gpus_per_nic: u32,
    /// Each GPU's memory, for receive copy-out and local ops.
    pub hbm: LinkParams,
}

pub use crate::compile::MAX_MICRO_BATCHES;

impl Topology {
    /// ResCCL's testbed: A100 servers, NVSwitch at 300 GB/s per GPU and direction, one 200 Gb/s
    /// RoCE NIC per two GPUs.
    pub fn a100_testbed(nodes: u32, gpus_per_node: u32) -> Topology {
        Topology {
            name: format!("a100-{nodes}x{gpus_per_node}"),
            nodes,
            gpus_per_node,
            nvlink: LinkParams { alpha_us: 0.7, bw_gbps: 300.0, concurrency: 8, contention_penalty: 0.02 },
            nic: LinkParams { alpha_us: 4.0, bw_gbps: 25.0, concurrency: 1, contention_penalty: 0.05 },
            gpus_per_nic: 2,
            hbm: LinkParams { alpha_us: 0.2, bw_gbps: 1500.0, concurrency: 16, contention_penalty: 0.0 },
        }
    }

    /// An H200 node (or several): NVLink at 450 GB/s per GPU and direction, one 400 Gb/s NIC per GPU.
    pub fn h200(nodes: u32, gpus_per_node: u32) -> Topology {
        Topology {
            name: format!("h200-{nodes}x{gpus_per_node}"),
            nodes,
            gpus_per_node,
            nvlink: LinkParams { alpha_us: 0.6, bw_gbps: 450.0, concurrency: 8, contention_penalty: 0.02 },
            nic: LinkParams { alpha_us: 3.0, bw_gbps: 50.0, concurrency: 1, contention_penalty: 0.05 },
            gpus_per_nic: 1,
            hbm: LinkParams { alpha_us: 0.2, bw_gbps: 4800.0, concurrency: 16, contention_penalty: 0.0 },
        }
    }

    /// A preset by name (`a100`, `h200`).
    pub fn preset(name: &str, nodes: u32, gpus_per_node: u32) -> Result<Topology, SimError> {
        match name {
            "a100" | "resccl" | "a100-testbed" => Ok(Topology::a100_testbed(nodes, gpus_per_node)),
            "h200" => Ok(Topology::h200(nodes, gpus_per_node)),
            _ => Err(SimError::BadInput { reason: format!("unknown topology preset `{name}` (a100, h200)") }),
        }
    }

    /// Total GPUs (`u32::MAX` where the product does not fit, which no program's rank count matches).
    pub fn ranks(&self) -> u32 {
        self.nodes.saturating_mul(self.gpus_per_node)
    }

    fn node(&self, r: u32) -> u32 {
        r / self.gpus_per_node
    }

    fn nic(&self, r: u32) -> u32 {
        let per = self.gpus_per_nic.max(1);
        let nics_per_node = self.gpus_per_node.div_ceil(per);
        self.node(r) * nics_per_node + (r % self.gpus_per_node) / per
    }
}

/// Simulation options.
#[derive(Copy, Clone, Debug)]
pub struct SimOptions {
    /// Size of the larger user buffer per rank, in bytes (nccl-tests' "size": the AllReduce buffer,
    /// the AllGather output, the ReduceScatter input).
    pub bytes: u64,
    /// Micro-batches per chunk.
    pub micro_batches: u32,
    /// Slots per FIFO.
    pub fifo_slots: u32,
    /// Record the timeline (for SVG output).
    pub timeline: bool,
    /// Run sub-pipelines one after another across the whole machine (no task of sub-pipeline `s`
    /// starts before every task of earlier sub-pipelines finished every micro-batch), as in ResCCL's
    /// execution model. Off: the plan's own semantics, where only sync points and FIFOs order TBs.
    pub subpipeline_barrier: bool,
}

impl SimOptions {
    /// Options for `bytes` with micro-batches of about `mb_bytes` per chunk (clamped to 1..=512; an
    /// `mb_bytes` of 0 is taken as 1, which gives the most, 512, wherever a chunk holds that many
    /// bytes).
    pub fn for_size(plan: &Plan, bytes: u64, mb_bytes: u64) -> SimOptions {
        let chunk = bytes / plan.layout.chunks.max(1) as u64;
        let m = chunk.div_ceil(mb_bytes.max(1)).clamp(1, 512) as u32;
        SimOptions { bytes, micro_batches: m, fifo_slots: 8, timeline: false, subpipeline_barrier: false }
    }
}

/// Why a simulation could not run.
#[derive(Clone, PartialEq, Debug, thiserror::Error)]
pub enum SimError {
    /// The plan is malformed, its rank count is not the topology's, a link's parameters are invalid
    /// (`alpha_us`, `bw_gbps`, `concurrency`, `contention_penalty`), an option is out of range, or a
    /// preset name is unknown.
    #[error("bad simulation input: {reason}")]
    BadInput {
        /// What is wrong.
        reason: String,
    },
    /// No thread block can progress and no event is pending.
    #[error("{}", SimDeadlock(blocked))]
    Deadlock {
        /// Every unfinished TB, in (rank, TB) order, with its task and what that task waits for
        /// (as the CPU executor reports them).
        blocked: Vec<Blocked>,
    },
}

/// A simulated deadlock's message: the first eight stuck TBs, with their tasks.
struct SimDeadlock<'a>(&'a [Blocked]);

impl fmt::Display for SimDeadlock<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let blocked = self.0;
        write!(f, "deadlock: {} thread blocks cannot progress", blocked.len())?;
        for b in blocked.iter().take(8) {
            let (prim, op, mb) = (b.prim.name(), b.op, b.micro_batch);
            write!(f, "; {} {} task {} ({prim} {op}, micro-batch {mb}): {}", b.rank, b.tb, b.task, b.reason)?;
        }
        if blocked.len() > 8 {
            write!(f, "; ...")?;
        }
        Ok(())
    }
}

/// Use of one resource.
#[derive(Clone, Debug, Serialize)]
pub struct LinkUse {
    /// The resource: `r0 nvlink out`, `r0 nvlink in`, `r0 hbm`, `nic1 out`, `nic1 in`.
    pub name: String,
    /// Bytes moved through it (fluid, so fractional; HBM counts a reduction's 1.5× the message).
    pub bytes: f64,
    /// Time with at least one flow.
    pub busy_us: f64,
    /// Bytes moved over what the bandwidth allows in the whole run.
    pub utilisation: f64,
}

/// Use of one thread block.
#[derive(Clone, Debug, Serialize)]
pub struct TbUse {
    /// The TB's rank.
    pub rank: u32,
    /// The TB's index within its rank.
    pub tb: u32,
    /// Time spent running tasks (latency, transfer, copy), not waiting.
    pub busy_us: f64,
    /// Share of the whole run not busy, in `0.0..=1.0`.
    pub idle_share: f64,
}

/// One bar of the timeline.
#[derive(Clone, Debug, Serialize)]
pub struct Span {
    /// Index into [`SimReport::lanes`].
    pub lane: u32,
    /// Start, in µs from the start of the run.
    pub start_us: f64,
    /// End, in µs from the start of the run.
    pub end_us: f64,
    /// What the bar shows.
    pub kind: SpanKind,
}

/// What a timeline bar shows.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize)]
pub enum SpanKind {
    /// A TB running one micro-batch of a task of this primitive, its α included (on a TB lane).
    Task(Prim),
    /// An intra-node transfer over NVLink (on the sender's `nvlink out` lane).
    IntraFlow,
    /// An inter-node transfer between NICs (on the sending NIC's `out` lane).
    InterFlow,
}

/// The result of a simulation.
#[derive(Clone, Debug, Serialize)]
pub struct SimReport {
    /// The topology's [`Topology::name`].
    pub topology: String,
    /// The simulated size, [`SimOptions::bytes`].
    pub bytes: u64,
    /// Micro-batches per chunk.
    pub micro_batches: u32,
    /// Completion time of the whole plan, in µs.
    pub time_us: f64,
    /// Algorithm bandwidth, `bytes / time`, in GB/s (10⁹ bytes per second).
    pub algbw_gbps: f64,
    /// Bus bandwidth: `algbw_gbps` × the collective's bus factor (nccl-tests), in GB/s.
    pub busbw_gbps: f64,
    /// Resources that carried traffic.
    pub links: Vec<LinkUse>,
    /// Every TB, in (rank, TB) order.
    pub tbs: Vec<TbUse>,
    /// Mean [`TbUse::idle_share`] over all TBs.
    pub mean_tb_idle_share: f64,
    /// Mean utilisation of the NVLink egress ports that carried traffic (0 when none did).
    pub mean_nvlink_utilisation: f64,
    /// Mean utilisation of the NIC egress sides that carried traffic (0 when none did).
    pub mean_nic_utilisation: f64,
    /// Lane names (links first, then TBs) and bars, when the timeline was asked for.
    pub lanes: Vec<String>,
    /// The bars, when [`SimOptions::timeline`] is set (empty otherwise).
    pub timeline: Vec<Span>,
}

#[derive(Copy, Clone, PartialEq)]
struct Time(f64);
impl Eq for Time {}
impl PartialOrd for Time {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Time {
    fn cmp(&self, o: &Self) -> Ordering {
        self.0.total_cmp(&o.0)
    }
}

#[derive(Clone)]
struct Res {
    name: String,
    p: LinkParams,
    active: u32,
    bytes: f64,
    busy_us: f64,
    lane: u32,
    is_nvl_tx: bool,
    is_nic_tx: bool,
}

struct Flow {
    res: [usize; 2],
    nres: usize,
    remaining: f64,
    rate: f64,
    owner: (usize, usize),
    start: f64,
    inter: bool,
}

#[derive(Copy, Clone, PartialEq)]
enum Phase {
    Idle,
    /// Waiting for the α timer, then the flow.
    Alpha,
    Flowing,
}

struct TbSim {
    cursor: TbCursor,
    phase: Phase,
    item_start: f64,
    busy: f64,
}

impl TbSim {
    fn finished(&self) -> bool {
        self.cursor.finished()
    }
}

const EPS: f64 = 1e-9;

/// Simulates `plan` on `topo`.
pub fn simulate(plan: &Plan, topo: &Topology, opts: &SimOptions) -> Result<SimReport, SimError> {
    plan.check_structure().map_err(|reason| SimError::BadInput { reason: format!("malformed plan: {reason}") })?;
    let n = plan.layout.ranks;
    if n != topo.ranks() {
        return Err(SimError::BadInput {
            reason: format!("the plan has {n} ranks, the topology {} GPUs", topo.ranks()),
        });
    }
    for (what, p) in [("nvlink", topo.nvlink), ("nic", topo.nic), ("hbm", topo.hbm)] {
        let ok = p.alpha_us.is_finite()
            && p.alpha_us >= 0.0
            && p.bw_gbps.is_finite()
            && p.bw_gbps > 0.0
            && p.concurrency >= 1
            && p.contention_penalty.is_finite()
            && p.contention_penalty >= 0.0;
        if !ok {
            return Err(SimError::BadInput {
                reason: format!(
                    "topology `{}` {what}: {p:?}: give a finite alpha_us >= 0, bw_gbps > 0, concurrency >= 1 and \
                     contention_penalty >= 0",
                    topo.name
                ),
            });
        }
    }
    if opts.micro_batches == 0 || opts.fifo_slots == 0 {
        return Err(SimError::BadInput { reason: "micro-batches and FIFO slots must be at least 1".into() });
    }
    if opts.micro_batches > MAX_MICRO_BATCHES {
        return Err(SimError::BadInput {
            reason: format!("{} micro-batches: at most {MAX_MICRO_BATCHES}", opts.micro_batches),
        });
    }
    let mbs = opts.micro_batches;
    let chunk_mb_bytes = opts.bytes as f64 / plan.layout.chunks.max(1) as f64 / mbs as f64;
    // Resources: per rank [nvl_tx, nvl_rx, hbm], then per NIC [tx, rx].
    let nics = topo.nodes * topo.gpus_per_node.div_ceil(topo.gpus_per_nic.max(1));
    let mut res: Vec<Res> = Vec::with_capacity((3 * n + 2 * nics) as usize);
    let mk = |name: String, p: LinkParams, tx: (bool, bool)| Res {
        name,
        p,
        active: 0,
        bytes: 0.0,
        busy_us: 0.0,
        lane: u32::MAX,
        is_nvl_tx: tx.0,
        is_nic_tx: tx.1,
    };
    for r in 0..n {
        res.push(mk(format!("r{r} nvlink out"), topo.nvlink, (true, false)));
        res.push(mk(format!("r{r} nvlink in"), topo.nvlink, (false, false)));
        res.push(mk(format!("r{r} hbm"), topo.hbm, (false, false)));
    }
    for k in 0..nics {
        res.push(mk(format!("nic{k} out"), topo.nic, (false, true)));
        res.push(mk(format!("nic{k} in"), topo.nic, (false, false)));
    }
    let nic_base = 3 * n as usize;
    let nvl_tx = |r: u32| 3 * r as usize;
    let nvl_rx = |r: u32| 3 * r as usize + 1;
    let hbm = |r: u32| 3 * r as usize + 2;
    let nic_tx = |r: u32| nic_base + 2 * topo.nic(r) as usize;
    let nic_rx = |r: u32| nic_base + 2 * topo.nic(r) as usize + 1;

    let mut tbs: Vec<Vec<TbSim>> = plan
        .ranks
        .iter()
        .map(|rp| {
            rp.tbs
                .iter()
                .map(|tb| TbSim { cursor: TbCursor::new(tb), phase: Phase::Idle, item_start: 0.0, busy: 0.0 })
                .collect()
        })
        .collect();
    let mut done: Vec<Vec<Vec<u32>>> =
        plan.ranks.iter().map(|rp| rp.tbs.iter().map(|tb| vec![0u32; tb.tasks.len()]).collect()).collect();
    // FIFO per connection: occupied slots and arrival state of queued messages.
    let mut fifo_used = vec![0u32; plan.connections.len()];
    let mut fifo_arrived: Vec<VecDeque<bool>> = vec![VecDeque::new(); plan.connections.len()];
    let mut flows: Vec<Flow> = Vec::new();
    let mut timers: BinaryHeap<std::cmp::Reverse<(Time, usize, usize)>> = BinaryHeap::new();
    let mut lanes: Vec<String> = Vec::new();
    let mut spans: Vec<Span> = Vec::new();
    // (rank, tb, start, end, prim), given lanes after the link lanes at the end.
    let mut tb_spans: Vec<(u32, u32, f64, f64, Prim)> = Vec::new();
    let mut now = 0.0f64;
    let mut rates_dirty = true;
    // Items (task × micro-batch) left per sub-pipeline, for the barrier mode.
    let mut left_in_sp = vec![0u64; plan.subpipelines as usize + 1];
    for rp in &plan.ranks {
        for tb in &rp.tbs {
            for task in &tb.tasks {
                left_in_sp[task.subpipeline as usize] += mbs as u64;
            }
        }
    }
    let mut open_sp = left_in_sp.iter().position(|&x| x > 0).unwrap_or(0) as u32;

    // Bytes of a task's micro-batch.
    let task_bytes = |r: usize, t: usize, i: usize| -> f64 {
        let task = &plan.ranks[r].tbs[t].tasks[i];
        let count = task.src.or(task.dst).map(|s| s.count).unwrap_or(1);
        count as f64 * chunk_mb_bytes
    };

    loop {
        // 1. Start whatever can start.
        let mut started = true;
        while started {
            started = false;
            for r in 0..n as usize {
                for t in 0..tbs[r].len() {
                    if tbs[r][t].phase != Phase::Idle || tbs[r][t].finished() {
                        continue;
                    }
                    let (i, mb) = (tbs[r][t].cursor.pos, tbs[r][t].cursor.mb);
                    let tbp = &plan.ranks[r].tbs[t];
                    let task = &tbp.tasks[i];
                    if opts.subpipeline_barrier && task.subpipeline > open_sp {
                        continue;
                    }
                    if tbp.waits(i).iter().any(|w| done[r][w.tb.index()][w.task as usize] <= mb) {
                        continue;
                    }
                    match task.prim {
                        Prim::Send => {
                            let c = task.conn.expect("verified plan").index();
                            if fifo_used[c] >= opts.fifo_slots {
                                continue;
                            }
                            fifo_used[c] += 1;
                            fifo_arrived[c].push_back(false);
                            let conn = &plan.connections[c];
                            let alpha = if conn.inter_node { topo.nic.alpha_us } else { topo.nvlink.alpha_us };
                            tbs[r][t].phase = Phase::Alpha;
                            tbs[r][t].item_start = now;
                            timers.push(std::cmp::Reverse((Time(now + alpha), r, t)));
                        }
                        Prim::Recv | Prim::RecvReduceCopy => {
                            let c = task.conn.expect("verified plan").index();
                            if fifo_arrived[c].front() != Some(&true) {
                                continue;
                            }
                            tbs[r][t].phase = Phase::Alpha;
                            tbs[r][t].item_start = now;
                            timers.push(std::cmp::Reverse((Time(now + topo.hbm.alpha_us), r, t)));
                        }
                        Prim::Copy | Prim::Reduce => {
                            tbs[r][t].phase = Phase::Alpha;
                            tbs[r][t].item_start = now;
                            timers.push(std::cmp::Reverse((Time(now + topo.hbm.alpha_us), r, t)));
                        }
                    }
                    started = true;
                }
            }
        }
        // 2. Rates.
        if rates_dirty {
            for f in flows.iter_mut() {
                let mut rate = f64::INFINITY;
                for &x in &f.res[..f.nres] {
                    let p = res[x].p;
                    let k = res[x].active.max(1) as f64;
                    let c = p.concurrency.max(1) as f64;
                    let bw = p.bw_gbps * 1e3; // bytes per microsecond
                    let share = if k <= c { bw / c } else { bw / (1.0 + p.contention_penalty * (k - c)) / k };
                    rate = rate.min(share);
                }
                f.rate = rate;
            }
            rates_dirty = false;
        }
        // 3. Next event.
        let next_flow = flows.iter().map(|f| now + f.remaining / f.rate).fold(f64::INFINITY, f64::min);
        let next_timer = timers.peek().map(|x| (x.0).0.0).unwrap_or(f64::INFINITY);
        let next = next_flow.min(next_timer);
        if !next.is_finite() {
            // Nothing pending: finished or deadlocked. Every unfinished TB is idle at a task that
            // could not start; say why, as the start step above decided.
            let mut blocked = Vec::new();
            for (r, rank_tbs) in tbs.iter().enumerate() {
                for (t, tb) in rank_tbs.iter().enumerate() {
                    if tb.finished() {
                        continue;
                    }
                    let (i, mb) = (tb.cursor.pos, tb.cursor.mb);
                    let tbp = &plan.ranks[r].tbs[t];
                    let task = &tbp.tasks[i];
                    let waits_on = tbp.waits(i).iter().find(|w| done[r][w.tb.index()][w.task as usize] <= mb);
                    let reason = if opts.subpipeline_barrier && task.subpipeline > open_sp {
                        format!("sub-pipeline {} not yet open", task.subpipeline)
                    } else if let Some(w) = waits_on {
                        format!("waits for {}.{}", w.tb, w.task)
                    } else if let Some(c) = task.conn {
                        let state = if task.prim == Prim::Send { "full" } else { "empty" };
                        format!("FIFO {c} {state}")
                    } else {
                        "cannot start".to_string()
                    };
                    blocked.push(Blocked::at(r, t, i, task, mb, reason));
                }
            }
            if !blocked.is_empty() {
                return Err(SimError::Deadlock { blocked });
            }
            break;
        }
        let dt = next - now;
        for x in res.iter_mut() {
            if x.active > 0 {
                x.busy_us += dt;
            }
        }
        for f in flows.iter_mut() {
            let moved = (f.rate * dt).min(f.remaining);
            f.remaining -= moved;
            for &x in &f.res[..f.nres] {
                res[x].bytes += moved;
            }
        }
        now = next;
        // 4. Completions: α timers start flows; finished flows finish items.
        let mut finished_items: Vec<(usize, usize)> = Vec::new();
        while let Some(&std::cmp::Reverse((Time(tm), r, t))) = timers.peek() {
            if tm > now + EPS {
                break;
            }
            timers.pop();
            let i = tbs[r][t].cursor.pos;
            let task = &plan.ranks[r].tbs[t].tasks[i];
            let rank = r as u32;
            let bytes = task_bytes(r, t, i);
            let (rs, nres, inter, factor) = match task.prim {
                Prim::Send => {
                    let conn = &plan.connections[task.conn.expect("verified plan").index()];
                    if conn.inter_node {
                        ([nic_tx(conn.src.0), nic_rx(conn.dst.0)], 2, true, 1.0)
                    } else {
                        ([nvl_tx(conn.src.0), nvl_rx(conn.dst.0)], 2, false, 1.0)
                    }
                }
                Prim::Recv | Prim::Copy => ([hbm(rank), 0], 1, false, 1.0),
                Prim::RecvReduceCopy | Prim::Reduce => ([hbm(rank), 0], 1, false, 1.5),
            };
            let total = bytes * factor;
            if total <= EPS {
                finished_items.push((r, t));
                continue;
            }
            for &x in &rs[..nres] {
                res[x].active += 1;
            }
            flows.push(Flow { res: rs, nres, remaining: total, rate: 0.0, owner: (r, t), start: now, inter });
            tbs[r][t].phase = Phase::Flowing;
            rates_dirty = true;
        }
        let mut k = 0;
        while k < flows.len() {
            // Done, or so little left that its end is not a later time than `now` in f64 (far into a
            // long simulation): finishing it there keeps time moving.
            if flows[k].remaining <= 1e-3 || now + flows[k].remaining / flows[k].rate <= now {
                let f = flows.swap_remove(k);
                for &x in &f.res[..f.nres] {
                    res[x].active -= 1;
                }
                if opts.timeline && f.nres == 2 {
                    for &x in &f.res[..1] {
                        if res[x].lane == u32::MAX {
                            res[x].lane = lanes.len() as u32;
                            lanes.push(res[x].name.clone());
                        }
                        spans.push(Span {
                            lane: res[x].lane,
                            start_us: f.start,
                            end_us: now,
                            kind: if f.inter { SpanKind::InterFlow } else { SpanKind::IntraFlow },
                        });
                    }
                }
                finished_items.push(f.owner);
                rates_dirty = true;
            } else {
                k += 1;
            }
        }
        for (r, t) in finished_items {
            let i = tbs[r][t].cursor.pos;
            let mb = tbs[r][t].cursor.mb;
            let task = &plan.ranks[r].tbs[t].tasks[i];
            match task.prim {
                Prim::Send => {
                    let c = task.conn.expect("verified plan").index();
                    // The oldest message not yet arrived is this one (one sender TB per FIFO).
                    if let Some(slot) = fifo_arrived[c].iter_mut().find(|a| !**a) {
                        *slot = true;
                    }
                }
                Prim::Recv | Prim::RecvReduceCopy => {
                    let c = task.conn.expect("verified plan").index();
                    fifo_arrived[c].pop_front();
                    fifo_used[c] -= 1;
                }
                _ => {}
            }
            let tb = &mut tbs[r][t];
            tb.busy += now - tb.item_start;
            if opts.timeline {
                tb_spans.push((r as u32, t as u32, tb.item_start, now, task.prim));
            }
            tb.phase = Phase::Idle;
            done[r][t][i] = mb + 1;
            left_in_sp[task.subpipeline as usize] -= 1;
            while (open_sp as usize) < left_in_sp.len() - 1 && left_in_sp[open_sp as usize] == 0 {
                open_sp += 1;
            }
            tb.cursor.advance(mbs);
        }
    }

    // Report.
    let time = now.max(EPS);
    let algbw = opts.bytes as f64 / (time * 1e3);
    let mut links = Vec::new();
    let (mut nvl_sum, mut nvl_n, mut nic_sum, mut nic_n) = (0.0, 0, 0.0, 0);
    for x in &res {
        if x.bytes > 0.0 {
            let util = x.bytes / (x.p.bw_gbps * 1e3 * time);
            if x.is_nvl_tx {
                nvl_sum += util;
                nvl_n += 1;
            }
            if x.is_nic_tx {
                nic_sum += util;
                nic_n += 1;
            }
            links.push(LinkUse { name: x.name.clone(), bytes: x.bytes, busy_us: x.busy_us, utilisation: util });
        }
    }
    let mut tb_uses = Vec::new();
    let mut idle_sum = 0.0;
    for (r, rank_tbs) in tbs.iter().enumerate() {
        for (t, tb) in rank_tbs.iter().enumerate() {
            let idle = 1.0 - (tb.busy / time).min(1.0);
            idle_sum += idle;
            tb_uses.push(TbUse { rank: r as u32, tb: t as u32, busy_us: tb.busy, idle_share: idle });
        }
    }
    // TB lanes come after the link lanes, in (rank, tb) order.
    if opts.timeline {
        let mut first_lane = Vec::with_capacity(tbs.len());
        for (r, rank_tbs) in tbs.iter().enumerate() {
            first_lane.push(lanes.len() as u32);
            for t in 0..rank_tbs.len() {
                lanes.push(format!("r{r} tb{t}"));
            }
        }
        spans.extend(tb_spans.into_iter().map(|(r, t, a, b, prim)| Span {
            lane: first_lane[r as usize] + t,
            start_us: a,
            end_us: b,
            kind: SpanKind::Task(prim),
        }));
    }
    let ntb = tb_uses.len().max(1) as f64;
    Ok(SimReport {
        topology: topo.name.clone(),
        bytes: opts.bytes,
        micro_batches: mbs,
        time_us: now,
        algbw_gbps: algbw,
        busbw_gbps: algbw * plan.layout.collective.bus_factor(n as usize),
        links,
        tbs: tb_uses,
        mean_tb_idle_share: idle_sum / ntb,
        mean_nvlink_utilisation: if nvl_n > 0 { nvl_sum / nvl_n as f64 } else { 0.0 },
        mean_nic_utilisation: if nic_n > 0 { nic_sum / nic_n as f64 } else { 0.0 },
        lanes,
        timeline: spans,
    })
}
