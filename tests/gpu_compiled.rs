//! Compiled plans on the GPU against the CPU executor of the same descriptors
//! (`oxccl_host::exec::lowered`): ring AllReduce, hierarchical-mesh AllReduce and AllGather (2×4,
//! 2×8 as 8 and 16 virtual ranks) and the bundled MSCCL files, each lowered compiled (HPDS,
//! state-based TBs) and interpreted (MSCCL's shape: algorithm-level schedule, one TB per
//! connection and stage), on both movers, over dtypes, operators, micro-batch counts, sizes, FIFO
//! slots, buffer alignments and replays. Every buffer byte and every FIFO-region byte (counters and
//! rings) must equal the CPU executor's. Also: a plan with a dropped send ends in a typed timeout,
//! not a hang; per-TB timing records.
//!
//! Skips loudly without a Hopper GPU. `OXCCL_COMPILED_FILTER=substring` runs only the matching
//! cases of `plans_match_the_cpu_executor`; `OXCCL_MSCCL_DIR` names the MSCCL files' folder when the
//! binary runs away from its checkout.

mod common;

use cudarc::driver::CudaStream;
use oxccl::Error;
use oxccl::compiled::{CompiledConfig, CompiledPlan, PlanBuffers};
use oxccl::engine::Engine;
use oxccl_host::compile::lower::{LowerOptions, LoweredPlan, lower};
use oxccl_host::compile::{Options, Plan, Prim, Scheduler, SyncPoint, TbAlloc, TbId, compile};
use oxccl_host::exec::lowered::{LaunchOptions, Memory, launch};
use oxccl_host::program::generators::Algorithm;
use oxccl_host::program::msccl::import;
use oxccl_host::program::{InstanceChannels, Program};
use oxccl_kernels::abi::{BUFFER_SLOTS, DType, Mover, PlanMode, RedOp, WaitKind};
use std::sync::{Arc, Mutex, MutexGuard, Once};
use std::time::{Duration, Instant};

/// The GPU, with enough hardware queues for one stream per virtual rank.
fn gpu(test: &str) -> Option<Arc<CudaStream>> {
    static QUEUES: Once = Once::new();
    QUEUES.call_once(|| {
        if std::env::var_os("CUDA_DEVICE_MAX_CONNECTIONS").is_none() {
            // SAFETY: every test of this binary calls this before anything initialises CUDA, and
            // `Once` makes the others wait: no thread reads the environment concurrently through us.
            unsafe { std::env::set_var("CUDA_DEVICE_MAX_CONNECTIONS", "32") };
        }
    });
    common::gpu(test)
}

/// One stream per rank (at most 16) and the engine, shared by every case of a test; holds the GPU
/// for the test: a plan's CTAs must all be resident, so two tests must not share the GPU at once.
struct Device {
    engines: Vec<Arc<Engine>>,
    streams: Vec<Arc<CudaStream>>,
    _turn: MutexGuard<'static, ()>,
}

impl Device {
    fn new(stream: &Arc<CudaStream>) -> Device {
        Device::across(std::slice::from_ref(stream.context()))
    }

    /// Rank r on a stream of `gpus[r % gpus.len()]`.
    fn across(gpus: &[Arc<cudarc::driver::CudaContext>]) -> Device {
        static GPU: Mutex<()> = Mutex::new(());
        let turn = GPU.lock().unwrap_or_else(|e| e.into_inner());
        let engines = gpus.iter().map(|g| Arc::new(Engine::new(g).expect("engine"))).collect();
        let streams = (0..16).map(|r| gpus[r % gpus.len()].new_stream().expect("stream")).collect();
        Device { engines, streams, _turn: turn }
    }

    fn plan(&self, lp: &LoweredPlan, config: CompiledConfig) -> oxccl::Result<CompiledPlan> {
        CompiledPlan::on_engines(&self.engines, &self.streams[..lp.ranks.len()], lp, config)
    }
}

/// Random floats (`common::random_floats`) where `dtype` is a float type, else `common::small_integers`: a
/// plan combines every chunk in an order the plan fixes, which the CPU executor follows, so the GPU
/// must match it bitwise on these too, roundings included.
fn fill_random(dtype: DType, bytes: usize, rng: &mut common::Rng) -> Vec<u8> {
    match common::random_floats(dtype, rng, bytes) {
        Some(v) => v,
        None => common::small_integers(dtype, bytes, rng),
    }
}

/// ±1 and ±2 for products: one that overflows stays an infinity, never times zero (a NaN, whose
/// bits the CPU and the GPU spell differently).
fn signed_ones_and_twos(dtype: DType, bytes: usize, rng: &mut common::Rng) -> Vec<u8> {
    use rand::RngExt;
    let mut v = Vec::with_capacity(bytes + 8);
    while v.len() < bytes {
        v.extend(common::element(dtype, [-2.0, -1.0, 1.0, 2.0][rng.random_range(0..4usize)]));
    }
    v.truncate(bytes);
    v
}

/// The first byte where two memories differ, named.
fn first_difference(what: &str, a: &[u8], b: &[u8]) -> Option<String> {
    if a == b {
        return None;
    }
    if a.len() != b.len() {
        return Some(format!("{what}: {} bytes on the GPU, {} on the CPU", a.len(), b.len()));
    }
    let i = a.iter().zip(b).position(|(x, y)| x != y).unwrap_or(0);
    let n = a.iter().zip(b).filter(|(x, y)| x != y).count();
    Some(format!("{what}: {n} bytes differ, first at byte {i} (GPU {:#04x}, CPU {:#04x})", a[i], b[i]))
}

/// One GPU run of a lowered plan against the CPU executor.
#[derive(Clone, Debug)]
struct Case {
    name: String,
    mode: PlanMode,
    mover: Mover,
    dtype: DType,
    op: RedOp,
    micro_batches: u32,
    mb_bytes: u64,
    extra_slots: u32,
    /// Bytes every buffer starts past a 256-byte boundary (not a multiple of 16: SIMT element path).
    shift: u64,
    launches: u32,
}

/// Runs `case` of `plan`: `launches` launches on one workspace (a replay), each on fresh inputs (small
/// integers, or random floats for every other seed), comparing every buffer and FIFO region with
/// the CPU executor's after each.
fn run_case(dev: &Device, plan: &Plan, case: &Case, seed: u64) -> Result<(), String> {
    let probe = lower(plan, &LowerOptions { mode: case.mode, ..LowerOptions::default() }).map_err(|e| e.to_string())?;
    let opts = LowerOptions {
        mode: case.mode,
        micro_batches: case.micro_batches,
        chunk_bytes: case.micro_batches as u64 * case.mb_bytes,
        fifo_slots: probe.slots_needed.max(1) + case.extra_slots,
        dtype: case.dtype,
        op: case.op,
        timing: seed.is_multiple_of(3),
    };
    let lp = lower(plan, &opts).map_err(|e| format!("lower: {e}"))?;
    let config = CompiledConfig { mover: case.mover, timeout: Duration::from_secs(5), ..CompiledConfig::default() };
    let runner = dev.plan(&lp, config).map_err(|e| format!("upload: {e}"))?;
    let bufs = PlanBuffers::new(&runner, case.shift).map_err(|e| format!("buffers: {e}"))?;
    let mut cpu = Memory::new(&lp);
    let mut rng = common::rng(seed);
    let data = if case.op == RedOp::Prod {
        signed_ones_and_twos
    } else if seed % 4 >= 2 {
        fill_random
    } else {
        common::small_integers
    };
    for k in 0..case.launches {
        for b in cpu.buffers.iter_mut().flat_map(|r| r.iter_mut()) {
            let n = b.len();
            *b = data(case.dtype, n, &mut rng);
        }
        bufs.upload(&cpu).map_err(|e| format!("upload buffers: {e}"))?;
        // SAFETY: the buffers are this plan's, sized by it, alive until the synchronisation below.
        unsafe { runner.launch(&bufs.table(), None) }.map_err(|e| format!("launch {k}: {e}"))?;
        let device = runner.synchronize();
        launch(&lp, &mut cpu, &LaunchOptions::default()).map_err(|e| format!("CPU executor: {e}"))?;
        if let Err(e) = device {
            runner.reset().ok();
            return Err(format!("launch {k}: {e}"));
        }
        let got = bufs.download().map_err(|e| format!("download: {e}"))?;
        for (r, (g, c)) in got.iter().zip(&cpu.buffers).enumerate() {
            for s in 0..BUFFER_SLOTS {
                if let Some(d) = first_difference(&format!("launch {k} rank {r} slot {s}"), &g[s], &c[s]) {
                    return Err(d);
                }
            }
        }
        let regions = runner.fifo_regions().map_err(|e| format!("FIFO regions: {e}"))?;
        for (r, (g, c)) in regions.iter().zip(&cpu.workspaces).enumerate() {
            if let Some(d) = first_difference(&format!("launch {k} rank {r} FIFO region"), g, c) {
                return Err(d);
            }
        }
        if opts.timing {
            for (r, tbs) in runner.timing().map_err(|e| e.to_string())?.iter().enumerate() {
                for (t, x) in tbs.iter().enumerate() {
                    let ok =
                        x.start_ns > 0 && x.end_ns >= x.start_ns && x.busy_ns + x.idle_ns <= x.end_ns - x.start_ns + 1;
                    if !ok && lp.ranks[r].tbs[t].steps > 0 {
                        return Err(format!("rank {r} tb{t}: timing record {x:?}"));
                    }
                }
            }
        }
    }
    Ok(())
}

/// The algorithms: (name, program).
fn programs() -> Vec<(String, Program)> {
    let mut v = Vec::new();
    for n in [4, 8] {
        v.push((format!("ring-allreduce 1x{n}"), Algorithm::RingAllReduce.generate(1, n).unwrap()));
    }
    for algo in [Algorithm::HmAllReduce, Algorithm::HmAllGather] {
        for (nodes, gpus) in [(2, 4), (2, 8)] {
            let mut p = algo.generate(nodes, gpus).unwrap();
            p.ranks_per_node = Some(gpus);
            v.push((format!("{algo} {nodes}x{gpus}"), p));
        }
    }
    let dir = common::msccl_dir();
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "xml"))
        .collect();
    files.sort();
    assert!(files.len() >= 5, "MSCCL files missing in {}", dir.display());
    for f in files {
        let name = f.file_name().unwrap().to_string_lossy().into_owned();
        let p = import(&std::fs::read_to_string(&f).unwrap()).unwrap_or_else(|e| panic!("{name}: {e}")).program;
        v.push((name, p));
    }
    v
}

/// The lowering modes: compiled (HPDS, state-based TB sharing) and interpreted (MSCCL's shape).
const MODES: [(PlanMode, Scheduler, TbAlloc); 2] = [
    (PlanMode::Compiled, Scheduler::Hpds, TbAlloc::State),
    (PlanMode::Interpreted, Scheduler::Algorithm, TbAlloc::PerConn),
];

/// (micro-batches, bytes per micro-batch of a chunk, extra FIFO slots, shift in elements, launches).
const GEOMETRIES: [(u32, u64, u32, u64, u32); 8] = [
    (1, 16, 0, 0, 1),
    (2, 64, 1, 0, 2),
    (4, 1024, 0, 1, 1),
    (3, 4112, 2, 0, 1),
    (2, 65536, 0, 0, 2),
    (1, 262_144, 0, 0, 1),
    (4, 16_400, 0, 1, 1),
    (2, 48, 3, 0, 3),
];

/// The operators of the plan kernels: every one but `Avg` (which reduction of a chunk is its last,
/// where the division belongs, a plan does not say; refused, see `plans_match_the_cpu_executor`).
const PLAN_OPS: [RedOp; 4] = [RedOp::Sum, RedOp::Prod, RedOp::Min, RedOp::Max];

/// Failures after which the remaining cases are skipped (a systematic fault would otherwise cost a
/// timeout per case).
const MAX_FAILURES: usize = 10;

/// Largest buffer bytes per rank a case may use (keeps the CPU executor's share of the test short).
const MAX_RANK_BYTES: u64 = 8 << 20;

/// Runs every (program, mode, mover, geometry) case on `dev`; returns the number run and the failures.
fn run_matrix(dev: &Device, programs: Vec<(String, Program)>, filter: Option<&str>) -> (usize, Vec<String>) {
    let dtypes = [DType::F32, DType::F16, DType::Bf16, DType::I32, DType::U32];
    let (mut ran, mut failures) = (0usize, Vec::new());
    for (pi, (name, program)) in programs.into_iter().enumerate() {
        let reduces = program.layout.collective.reduces();
        for (mi, &(mode, scheduler, tb_alloc)) in MODES.iter().enumerate() {
            let plan = compile(&program, &Options::new(scheduler, tb_alloc)).unwrap_or_else(|e| panic!("{name}: {e}"));
            let chunks = plan.layout.input_chunks().max(plan.layout.output_chunks()) as u64
                + plan.layout.scratch.iter().copied().max().unwrap_or(0) as u64;
            for mover in [Mover::Tma, Mover::Simt] {
                for (gi, &(mbs, mb_bytes, extra_slots, shift, launches)) in GEOMETRIES.iter().enumerate() {
                    // dtype and operator rotate over the cases so every pair meets every plan family.
                    let k = pi * 7 + mi * 3 + gi + (mover == Mover::Simt) as usize * 2;
                    let dtype = dtypes[k % dtypes.len()];
                    let op = if reduces { PLAN_OPS[(k / dtypes.len()) % PLAN_OPS.len()] } else { RedOp::Sum };
                    let elem = dtype.size() as u64;
                    // Cap the size: micro-batch bytes stay multiples of 16.
                    let cap = (MAX_RANK_BYTES / (chunks.max(1) * mbs as u64)) / 16 * 16;
                    let mb_bytes = mb_bytes.min(cap.max(16));
                    let case = Case {
                        name: format!(
                            "{name} {mode:?} {mover:?} {} {} mbs={mbs} mb={mb_bytes} +slots={extra_slots} shift={} x{launches}",
                            dtype.nccl_name(),
                            op.nccl_name(),
                            shift * elem
                        ),
                        mode,
                        mover,
                        dtype,
                        op,
                        micro_batches: mbs,
                        mb_bytes,
                        extra_slots,
                        shift: shift * elem,
                        launches,
                    };
                    if filter.is_some_and(|f| !case.name.contains(f)) {
                        continue;
                    }
                    if failures.len() >= MAX_FAILURES {
                        continue;
                    }
                    ran += 1;
                    if let Err(e) = run_case(dev, &plan, &case, 1000 + ran as u64) {
                        eprintln!("FAILED {}: {e}", case.name);
                        failures.push(format!("{}: {e}", case.name));
                    }
                }
            }
        }
    }
    if failures.len() >= MAX_FAILURES {
        eprintln!("stopped after {MAX_FAILURES} failures");
    }
    (ran, failures)
}

#[test]
fn plans_match_the_cpu_executor() {
    let Some(stream) = gpu("plans_match_the_cpu_executor") else { return };
    let dev = Device::new(&stream);
    let filter = std::env::var("OXCCL_COMPILED_FILTER").ok();
    let started = Instant::now();
    let (ran, failures) = run_matrix(&dev, programs(), filter.as_deref());
    eprintln!("{ran} cases in {:.1} s, {} failed", started.elapsed().as_secs_f64(), failures.len());
    // Avg has no plan kernel: refused with a typed error when the plan is made.
    let ring = compile(&Algorithm::RingAllReduce.generate(1, 4).unwrap(), &Options::default()).unwrap();
    let lp = lower(&ring, &LowerOptions { op: RedOp::Avg, ..LowerOptions::default() }).unwrap();
    let made = dev.plan(&lp, CompiledConfig::default());
    assert!(matches!(made, Err(Error::Unsupported { .. })), "Avg: {:?}", made.err());
    assert!(failures.is_empty(), "{} of {ran} cases failed:\n{}", failures.len(), failures.join("\n"));
    match &filter {
        None => assert!(ran >= 300, "only {ran} cases"),
        Some(f) => assert!(ran > 0, "OXCCL_COMPILED_FILTER={f} matched no case"),
    }
}

/// The same matrix with the ranks spread over every visible GPU (rank r on GPU r mod N, so
/// connections cross NVLink), plus ring and hierarchical plans with exactly one rank per GPU.
#[test]
fn plans_match_the_cpu_executor_across_gpus() {
    let _ = gpu("plans_match_the_cpu_executor_across_gpus");
    let Some(gpus) = common::gpus("plans_match_the_cpu_executor_across_gpus") else { return };
    let dev = Device::across(&gpus);
    let filter = std::env::var("OXCCL_COMPILED_FILTER").ok();
    let n = gpus.len() as u32;
    let mut one_per_gpu = vec![(format!("ring-allreduce 1x{n}"), Algorithm::RingAllReduce.generate(1, n).unwrap())];
    if n.is_multiple_of(2) {
        for algo in [Algorithm::HmAllReduce, Algorithm::HmAllGather] {
            let mut p = algo.generate(2, n / 2).unwrap_or_else(|e| panic!("{algo} 2x{}: {e}", n / 2));
            p.ranks_per_node = Some(n / 2);
            one_per_gpu.push((format!("{algo} 2x{}", n / 2), p));
        }
    }
    let plans = one_per_gpu.len();
    let started = Instant::now();
    let names: Vec<String> = one_per_gpu.iter().map(|(n, _)| n.clone()).collect();
    let (ran1, mut failures) = run_matrix(&dev, one_per_gpu, filter.as_deref());
    let (ran2, more) = run_matrix(&dev, programs(), filter.as_deref());
    failures.extend(more);
    let ran = ran1 + ran2;
    eprintln!(
        "{ran} cases on {n} GPUs in {:.1} s ({ran1} with one rank per GPU: {}), {} failed",
        started.elapsed().as_secs_f64(),
        names.join(", "),
        failures.len()
    );
    assert!(failures.is_empty(), "{} of {ran} cases failed:\n{}", failures.len(), failures.join("\n"));
    match &filter {
        // Every plan in every mode, mover and geometry ran.
        None => {
            assert_eq!(ran1, plans * MODES.len() * 2 * GEOMETRIES.len(), "one-rank-per-GPU cases");
            assert!(ran2 >= 300, "only {ran2} spread cases");
        }
        Some(f) => assert!(ran > 0, "OXCCL_COMPILED_FILTER={f} matched no case"),
    }
}

/// The last task whose primitive is `prim` in the first TB of more than one task that has one.
fn find_last(plan: &Plan, prim: Prim) -> (usize, usize, usize) {
    for (r, rp) in plan.ranks.iter().enumerate() {
        for (t, tb) in rp.tbs.iter().enumerate() {
            if tb.tasks.len() > 1
                && let Some(i) = tb.tasks.iter().rposition(|x| x.prim == prim)
            {
                return (r, t, i);
            }
        }
    }
    panic!("no {prim:?}");
}

/// Removes task `i` of `rank`'s TB `tb`, renumbering the sync points after it and dropping those on
/// it (as `host/tests/lower_faults.rs` does).
fn drop_task(plan: &mut Plan, rank: usize, tb: usize, i: usize) {
    let rp = &mut plan.ranks[rank];
    let mut waits: Vec<Vec<Vec<SyncPoint>>> =
        rp.tbs.iter().map(|t| (0..t.tasks.len()).map(|k| t.waits(k).to_vec()).collect()).collect();
    waits[tb].remove(i);
    rp.tbs[tb].tasks.remove(i);
    for w in waits.iter_mut().flatten() {
        w.retain(|s| !(s.tb == TbId::new(tb) && s.task as usize == i));
        for s in w.iter_mut().filter(|s| s.tb == TbId::new(tb) && s.task as usize > i) {
            s.task -= 1;
        }
    }
    for (t, tbp) in rp.tbs.iter_mut().enumerate() {
        tbp.syncs.clear();
        for (k, task) in tbp.tasks.iter_mut().enumerate() {
            task.wait_start = tbp.syncs.len() as u32;
            task.wait_count = waits[t][k].len() as u32;
            tbp.syncs.extend_from_slice(&waits[t][k]);
        }
    }
}

#[test]
fn a_dropped_send_times_out_with_a_typed_error() {
    let Some(stream) = gpu("a_dropped_send_times_out_with_a_typed_error") else { return };
    let dev = Device::new(&stream);
    for mover in [Mover::Tma, Mover::Simt] {
        let program = Algorithm::RingAllReduce.generate(1, 4).unwrap();
        let mut plan = compile(&program, &Options::new(Scheduler::Hpds, TbAlloc::State)).unwrap();
        let (r, t, i) = find_last(&plan, Prim::Send);
        let receiver = plan.ranks[r].tbs[t].tasks[i].peer.expect("a send has a peer").0;
        drop_task(&mut plan, r, t, i);
        let opts = LowerOptions { micro_batches: 1, chunk_bytes: 1024, ..LowerOptions::default() };
        let lp = lower(&plan, &opts).unwrap();
        // The CPU executor calls it a deadlock.
        let mut cpu = Memory::new(&lp);
        assert!(matches!(
            launch(&lp, &mut cpu, &LaunchOptions::default()),
            Err(oxccl_host::exec::lowered::LoweredExecError::Deadlock { .. })
        ));
        let config = CompiledConfig { mover, timeout: Duration::from_millis(300), ..CompiledConfig::default() };
        let runner = dev.plan(&lp, config).unwrap();
        let bufs = PlanBuffers::new(&runner, 0).unwrap();
        let started = Instant::now();
        // SAFETY: the plan's own buffers, alive until the synchronisation.
        unsafe { runner.launch(&bufs.table(), None) }.unwrap();
        // A framework's device synchronisation waits for the launch and reads no error record; the
        // next launch finds the error there and returns it instead of launching.
        stream.context().synchronize().unwrap();
        let took = started.elapsed();
        // SAFETY: as above (refused before any launch).
        let e = unsafe { runner.launch(&bufs.table(), None) }.expect_err("the next launch must report the timeout");
        eprintln!("{mover:?}: dropped send of r{r} tb{t} -> {e} after {took:?}");
        assert!(matches!(e, Error::Timeout { .. }), "{mover:?}: expected a timeout, got {e}");
        assert!(took < Duration::from_secs(30), "{mover:?}: {took:?} to give up");
        // The record is kept until the reset: `synchronize` reports the same error.
        let again = runner.synchronize().expect_err("the error is kept until the reset");
        assert_eq!(again.to_string(), e.to_string(), "{mover:?}");
        // The receiver of the dropped message gave up waiting for it (or, first, for a thread block
        // of its own rank that waits on that receive).
        let statuses = runner.statuses();
        let recv = &statuses[receiver as usize];
        assert!(recv.errors > 0 && recv.rank == receiver, "{mover:?}: r{receiver} recorded nothing: {statuses:?}");
        let kind = WaitKind::from_raw(recv.kind);
        assert!(
            kind == Some(WaitKind::FifoData) && recv.peer == r as u32 || kind == Some(WaitKind::Progress),
            "{mover:?}: r{receiver} recorded {kind:?} (peer {}): {statuses:?}",
            recv.peer
        );
        // Until the reset its counters are out of step: a launch is refused.
        // SAFETY: refused before any launch.
        let again = unsafe { runner.launch(&bufs.table(), None) };
        assert!(matches!(again, Err(Error::Poisoned)), "{mover:?}: a launch after the error: {again:?}");
        // After a reset the workspace is clean: the intact plan runs on the same device.
        runner.reset().unwrap();
    }
    let plan = compile(&Algorithm::RingAllReduce.generate(1, 4).unwrap(), &Options::default()).unwrap();
    let case = Case {
        name: "after the timeout".into(),
        mode: PlanMode::Compiled,
        mover: Mover::Tma,
        dtype: DType::F32,
        op: RedOp::Sum,
        micro_batches: 2,
        mb_bytes: 256,
        extra_slots: 0,
        shift: 0,
        launches: 2,
    };
    run_case(&dev, &plan, &case, 7).unwrap();
}

#[test]
fn timing_records_every_thread_block() {
    let Some(stream) = gpu("timing_records_every_thread_block") else { return };
    let dev = Device::new(&stream);
    let mut p = Algorithm::HmAllReduce.generate(2, 4).unwrap();
    p.ranks_per_node = Some(4);
    let plan = compile(&p, &Options::default()).unwrap();
    for mover in [Mover::Tma, Mover::Simt] {
        let opts = LowerOptions { micro_batches: 4, chunk_bytes: 4 << 16, timing: true, ..LowerOptions::default() };
        let lp = lower(&plan, &opts).unwrap();
        let runner = dev.plan(&lp, CompiledConfig { mover, ..CompiledConfig::default() }).unwrap();
        let bufs = PlanBuffers::new(&runner, 0).unwrap();
        // SAFETY: the plan's own buffers, alive until the synchronisation.
        unsafe { runner.launch(&bufs.table(), None) }.unwrap();
        runner.synchronize().unwrap();
        let timing = runner.timing().unwrap();
        let (mut busy, mut idle) = (0u64, 0u64);
        for (r, tbs) in timing.iter().enumerate() {
            assert_eq!(tbs.len(), lp.ranks[r].tbs.len());
            for (t, x) in tbs.iter().enumerate() {
                assert!(x.start_ns > 0 && x.end_ns >= x.start_ns, "r{r} tb{t}: {x:?}");
                assert_eq!(x.busy_ns + x.idle_ns, x.end_ns - x.start_ns, "r{r} tb{t}: {x:?}");
                busy += x.busy_ns;
                idle += x.idle_ns;
            }
        }
        eprintln!(
            "{mover:?}: shape {:?}; TB time busy {busy} ns, idle {idle} ns ({:.1}% idle)",
            runner.shape(),
            100.0 * idle as f64 / (busy + idle).max(1) as f64
        );
    }
}

#[test]
fn misuse_is_a_typed_error() {
    let Some(stream) = gpu("misuse_is_a_typed_error") else { return };
    let dev = Device::new(&stream);
    let plan = compile(&Algorithm::RingAllReduce.generate(1, 4).unwrap(), &Options::default()).unwrap();
    let lp = lower(&plan, &LowerOptions::default()).unwrap();
    // Two ranks on one stream would serialise and time out: refused.
    let same = vec![dev.streams[0].clone(); 4];
    let e = CompiledPlan::on_engines(&dev.engines, &same, &lp, CompiledConfig::default()).err().unwrap();
    assert!(matches!(e, Error::Config { field: "streams", .. }), "{e}");
    // Malformed descriptors: refused before anything is uploaded.
    let mut bad = lp.clone();
    bad.ranks[1].tasks[0].conn = 999;
    assert!(matches!(dev.plan(&bad, CompiledConfig::default()), Err(Error::Descriptors(_))));
    // A missing buffer.
    let runner = dev.plan(&lp, CompiledConfig::default()).unwrap();
    let mut table = PlanBuffers::new(&runner, 0).unwrap().table();
    let good = table[2];
    table[2] = [0; BUFFER_SLOTS];
    // SAFETY: refused before any launch.
    let e = unsafe { runner.launch(&table, None) }.unwrap_err();
    assert!(matches!(e, Error::MissingBuffer { what: "plan buffer", rank: 2, .. }), "{e}");
    // A misaligned one.
    table[2] = good.map(|a| if a == 0 { 0 } else { a + 1 });
    // SAFETY: refused before any launch.
    let e = unsafe { runner.launch(&table, None) }.unwrap_err();
    assert!(matches!(e, Error::Misaligned { what: "plan buffer", rank: 2, .. }), "{e}");
    // Ranks and slots outside the plan.
    assert!(matches!(runner.stream(4), Err(Error::NoSuchRank { rank: 4, ranks: 4 })));
    assert!(matches!(runner.engine(7), Err(Error::NoSuchRank { rank: 7, ranks: 4 })));
    assert!(matches!(runner.buffer_bytes(0, BUFFER_SLOTS), Err(Error::NoSuchSlot { .. })));
    let bufs = PlanBuffers::new(&runner, 0).unwrap();
    assert!(matches!(bufs.read(4, 0), Err(Error::NoSuchRank { .. })));
    assert!(matches!(bufs.write(0, BUFFER_SLOTS, &[]), Err(Error::NoSuchSlot { .. })));
    // An offset that would wrap the buffer addresses.
    let e = PlanBuffers::new(&runner, u64::MAX - 15).err().unwrap();
    assert!(matches!(e, Error::Config { field: "shift", .. }), "{e}");
    // A timeout the device's 64-bit nanosecond deadline cannot hold (it would never expire).
    let forever = CompiledConfig { timeout: Duration::MAX, ..CompiledConfig::default() };
    assert!(matches!(dev.plan(&lp, forever), Err(Error::Config { field: "timeout", .. })));
    // Too many CTAs: 64 instances of the ring on channels of their own give every rank thread blocks
    // of their own per instance, more CTAs of 1024 threads than the device holds at once (at most
    // two per SM). The error counts the plan's CTAs, and its bound is what a shape admitted, not a
    // figure of its own.
    let wide = Algorithm::RingAllReduce.generate(1, 4).unwrap().instanced_on(64, InstanceChannels::Separate).unwrap();
    let wide = lower(&compile(&wide, &Options::default()).unwrap(), &LowerOptions::default()).unwrap();
    let ctas: usize = wide.ranks.iter().map(|r| r.tbs.len()).sum();
    assert!(ctas > 2 * 132, "{ctas} CTAs: too few to overfill an H200");
    match dev.plan(&wide, CompiledConfig { threads: Some(1024), ..CompiledConfig::default() }) {
        Err(Error::TooManyCtas { requested, max, .. }) => {
            assert_eq!(requested as usize, ctas);
            assert!(max < requested, "{max} >= {requested}");
        }
        Err(e) => panic!("expected too many CTAs, got {e}"),
        Ok(_) => panic!("{ctas} CTAs of 1024 threads were admitted at once"),
    }
}

/// A plan's launch waits for no other stream: the plan module's kernels are loaded when the plan is
/// built, not by its first launch (a kernel loaded lazily by a launch made it wait on the device for
/// every stream of the context, docs/PERF.md). With another stream held on the host (a host function
/// that blocks until the test lets it go), the first launch ends while that stream is still held,
/// and equals the CPU executor.
#[test]
fn a_first_plan_launch_ends_before_a_held_stream() {
    let Some(stream) = gpu("a_first_plan_launch_ends_before_a_held_stream") else { return };
    let dev = Device::new(&stream);
    let other = stream.context().new_stream().unwrap();
    let plan = compile(&Algorithm::RingAllReduce.generate(1, 4).unwrap(), &Options::default()).unwrap();
    let lp = lower(&plan, &LowerOptions { micro_batches: 2, chunk_bytes: 2 << 16, ..LowerOptions::default() }).unwrap();
    let runner = dev.plan(&lp, CompiledConfig::default()).unwrap();
    let bufs = PlanBuffers::new(&runner, 0).unwrap();
    let mut cpu = Memory::new(&lp);
    let mut rng = common::rng(7);
    for b in cpu.buffers.iter_mut().flat_map(|r| r.iter_mut()) {
        let n = b.len();
        *b = common::small_integers(DType::F32, n, &mut rng);
    }
    bufs.upload(&cpu).unwrap();
    for s in &dev.streams {
        s.synchronize().unwrap();
    }
    let gate = common::Gate::hold(&other, Duration::from_secs(60));
    // SAFETY: the plan's own buffers, alive until the synchronisation.
    unsafe { runner.launch(&bufs.table(), None) }.unwrap();
    let ended = common::ends_within(Duration::from_secs(30), || dev.streams.iter().all(|s| common::idle(s)));
    let forced = gate.forced();
    gate.release();
    runner.synchronize().unwrap();
    assert!(ended && !forced, "the first launch did not end while the other stream was held");
    launch(&lp, &mut cpu, &LaunchOptions::default()).unwrap();
    let got = bufs.download().unwrap();
    for (r, (g, c)) in got.iter().zip(&cpu.buffers).enumerate() {
        for s in 0..BUFFER_SLOTS {
            if let Some(d) = first_difference(&format!("rank {r} slot {s}"), &g[s], &c[s]) {
                panic!("{d}");
            }
        }
    }
    other.synchronize().unwrap();
}

/// `CompiledPlan::run` / `run_in_place` on cudarc buffers: an in-place ring AllReduce (4 ranks), the
/// out-of-place MSCCL AllToAll (8 ranks) and an in-place MSCCL AllReduce with scratch slots (8
/// ranks), each against the CPU executor of the same plan on the same inputs, twice (the second run
/// reuses the plan's scratch); then the misuse a user can make:
/// the wrong element type, the wrong call for the layout, a short buffer, a buffer count, overlapping
/// buffers.
#[test]
fn run_takes_cudarc_buffers() {
    use cudarc::driver::{CudaSlice, CudaView, DevicePtr};
    let Some(stream) = gpu("run_takes_cudarc_buffers") else { return };
    let dev = Device::new(&stream);
    let as_f32 =
        |b: &[u8]| -> Vec<f32> { b.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect() };
    let mut rng = common::rng(7);
    let ring = compile(&Algorithm::RingAllReduce.generate(1, 4).unwrap(), &Options::default()).unwrap();
    let xml = std::fs::read_to_string(common::msccl_dir().join("ndv4_a2a2ll.xml")).unwrap();
    let a2a = compile(&import(&xml).unwrap().program, &Options::default()).unwrap();
    // In place with scratch slots: the plan's own, allocated by the first run and reused by the second.
    let xml = std::fs::read_to_string(common::msccl_dir().join("ndv4_ap-1pass.xml")).unwrap();
    let pairs = compile(&import(&xml).unwrap().program, &Options::default()).unwrap();
    for (name, plan) in [("ring-allreduce 1x4", &ring), ("ndv4_a2a2ll", &a2a), ("ndv4_ap-1pass", &pairs)] {
        let lp =
            lower(plan, &LowerOptions { micro_batches: 2, chunk_bytes: 2 << 12, ..LowerOptions::default() }).unwrap();
        let runner = dev.plan(&lp, CompiledConfig::default()).unwrap();
        let in_place = lp.layout.in_place;
        let p = lp.ranks.len();
        let mut cpu = Memory::new(&lp);
        for _ in 0..2 {
            for b in cpu.buffers.iter_mut().flat_map(|r| r.iter_mut()) {
                let n = b.len();
                *b = common::small_integers(DType::F32, n, &mut rng);
            }
            let main = oxccl_host::compile::lower::main_slot(&lp.layout) as usize;
            let (send_slot, recv_slot) = if in_place { (main, main) } else { (0, 1) };
            let send: Vec<CudaSlice<f32>> =
                (0..p).map(|r| dev.streams[r].clone_htod(&as_f32(&cpu.buffers[r][send_slot])).unwrap()).collect();
            let mut recv: Vec<CudaSlice<f32>> =
                (0..p).map(|r| dev.streams[r].clone_htod(&as_f32(&cpu.buffers[r][recv_slot])).unwrap()).collect();
            if in_place {
                runner.run_in_place(&mut recv).unwrap();
            } else {
                runner.run(&send, &mut recv).unwrap();
            }
            runner.synchronize().unwrap();
            launch(&lp, &mut cpu, &LaunchOptions::default()).unwrap();
            for (r, b) in recv.iter().enumerate() {
                let got = dev.streams[r].clone_dtoh(b).unwrap();
                assert_eq!(got, as_f32(&cpu.buffers[r][recv_slot]), "{name}: rank {r}");
            }
        }
        let scratch: u64 =
            (0..p).map(|r| runner.buffer_bytes(r, 2).unwrap() + runner.buffer_bytes(r, 3).unwrap()).sum();
        assert_eq!(scratch > 0, name == "ndv4_ap-1pass", "{name}: {scratch} scratch bytes");
        println!(
            "{name}: {} ranks, {} on cudarc buffers ({scratch} B of scratch), as the CPU executor",
            p,
            if in_place { "in place" } else { "out of place" }
        );
    }
    // Misuse, on the out-of-place AllToAll.
    let lp = lower(&a2a, &LowerOptions { micro_batches: 2, chunk_bytes: 2 << 12, ..LowerOptions::default() }).unwrap();
    let runner = dev.plan(&lp, CompiledConfig::default()).unwrap();
    let n = (runner.buffer_bytes(0, 0).unwrap() / 4) as usize;
    // Inputs of the CPU executor's run below; outputs marked, so that a refused call that wrote shows.
    let mut cpu = Memory::new(&lp);
    for r in 0..8 {
        cpu.buffers[r][0] = common::small_integers(DType::F32, n * 4, &mut rng);
        cpu.buffers[r][1] = (0..n).flat_map(|_| (-1234.5f32).to_le_bytes()).collect();
    }
    let send: Vec<CudaSlice<f32>> =
        (0..8).map(|r| dev.streams[r].clone_htod(&as_f32(&cpu.buffers[r][0])).unwrap()).collect();
    let mut recv: Vec<CudaSlice<f32>> =
        (0..8).map(|r| dev.streams[r].clone_htod(&as_f32(&cpu.buffers[r][1])).unwrap()).collect();
    let ints: Vec<CudaSlice<i32>> = (0..8).map(|r| dev.streams[r].alloc_zeros::<i32>(n).unwrap()).collect();
    let mut int_recv: Vec<CudaSlice<i32>> = (0..8).map(|r| dev.streams[r].alloc_zeros::<i32>(n).unwrap()).collect();
    let e = runner.run(&ints, &mut int_recv).unwrap_err();
    assert!(matches!(e, Error::Config { field: "element type", .. }), "{e}");
    let e = runner.run_in_place(&mut recv).unwrap_err();
    assert!(matches!(e, Error::Config { field: "in_place", .. }), "{e}");
    let e = runner.run(&send[..7], &mut recv).unwrap_err();
    assert!(matches!(e, Error::BufferCount { what: "send buffers", expected: 8, got: 7 }), "{e}");
    let short: Vec<CudaView<f32>> =
        (0..8).map(|r| if r == 3 { send[r].slice(1..) } else { send[r].slice(..) }).collect();
    let e = runner.run(&short, &mut recv).unwrap_err();
    assert!(matches!(e, Error::Length { what: "send buffer", rank: 3, .. }), "{e}");
    {
        // A send buffer that is another rank's receive buffer (built through a raw pointer, handed
        // back without freeing it).
        let raw = recv[5].device_ptr(&dev.streams[5]).0;
        let alias: CudaSlice<f32> = unsafe { dev.streams[2].upgrade_device_ptr(raw, n) };
        let sends: Vec<CudaView<f32>> =
            (0..8).map(|r| if r == 2 { alias.slice(..) } else { send[r].slice(..) }).collect();
        let e = runner.run(&sends, &mut recv).unwrap_err();
        assert!(matches!(e, Error::Aliasing { .. }), "{e}");
        drop(sends);
        alias.leak();
    }
    {
        // An error cudarc kept for the context (a failed guard wait or free leaves one): reported
        // before any rank is queued, without poisoning the plan.
        use cudarc::driver::{DriverError, sys::CUresult};
        let ctx = dev.streams[0].context();
        ctx.record_err::<()>(Err(DriverError(CUresult::CUDA_ERROR_INVALID_VALUE)));
        let e = runner.run(&send, &mut recv).unwrap_err();
        assert!(
            matches!(&e, Error::KeptDriverError { ordinal, source }
                if *ordinal == ctx.ordinal() && source.0 == CUresult::CUDA_ERROR_INVALID_VALUE),
            "{e:?}"
        );
    }
    // Nothing ran: the outputs hold their mark, and the plan still works.
    for (r, b) in recv.iter().enumerate() {
        assert_eq!(dev.streams[r].clone_dtoh(b).unwrap(), vec![-1234.5; n], "a refused call wrote rank {r}'s output");
    }
    runner.run(&send, &mut recv).unwrap();
    runner.synchronize().unwrap();
    launch(&lp, &mut cpu, &LaunchOptions::default()).unwrap();
    for (r, b) in recv.iter().enumerate() {
        assert_eq!(dev.streams[r].clone_dtoh(b).unwrap(), as_f32(&cpu.buffers[r][1]), "after the refusals: rank {r}");
    }
}

/// Every program of the matrix on the collective engine (`Communicator::run_program`, level by
/// level, no FIFOs) on virtual ranks, f32 and i32 sums at three chunk sizes (one 16-byte grain,
/// an odd multiple of 16, 64 KiB), twice each on the same buffers: the outputs must equal the CPU
/// executor's of the program's FIFO lowering on the same inputs. Then misuse: typed errors.
#[test]
fn programs_run_on_the_collective_engine() {
    use cudarc::driver::CudaSlice;
    let Some(stream) = gpu("programs_run_on_the_collective_engine") else { return };
    let dev = Device::new(&stream);
    let mut rng = common::rng(11);
    let mut ran = 0;
    for (name, program) in programs() {
        let p = program.ranks() as usize;
        let comm = oxccl::Communicator::virtual_ranks(&dev.streams[0], p, oxccl::Config::default()).unwrap();
        let plan = compile(&program, &Options::default()).unwrap();
        for dtype in [DType::F32, DType::I32] {
            for chunk_bytes in [16u64, 4112, 65536] {
                let what = format!("{name} {} {chunk_bytes} B chunks", dtype.nccl_name());
                let opts = LowerOptions { micro_batches: 1, chunk_bytes, dtype, ..LowerOptions::default() };
                let lp = lower(&plan, &opts).unwrap();
                let mut cpu = Memory::new(&lp);
                let main = oxccl_host::compile::lower::main_slot(&lp.layout) as usize;
                let (send_slot, recv_slot) = if lp.layout.in_place { (main, main) } else { (0, 1) };
                for k in 0..2 {
                    for r in 0..p {
                        for s in [send_slot, recv_slot] {
                            let n = cpu.buffers[r][s].len();
                            cpu.buffers[r][s] = common::small_integers(dtype, n, &mut rng);
                        }
                    }
                    let got: Vec<Vec<u8>> = match dtype {
                        DType::F32 => {
                            run_program_on::<f32>(&comm, &dev.streams[0], &program, &cpu, (send_slot, recv_slot))
                        }
                        _ => run_program_on::<i32>(&comm, &dev.streams[0], &program, &cpu, (send_slot, recv_slot)),
                    }
                    .unwrap_or_else(|e| panic!("{what} run {k}: {e}"));
                    launch(&lp, &mut cpu, &LaunchOptions::default()).unwrap();
                    for (r, g) in got.iter().enumerate() {
                        if let Some(d) =
                            first_difference(&format!("{what} run {k} rank {r}"), g, &cpu.buffers[r][recv_slot])
                        {
                            panic!("{d}");
                        }
                    }
                    ran += 1;
                }
            }
        }
    }
    // Misuse: the wrong layout, a chunk off 16 bytes, a short buffer, the wrong rank count.
    let ring = Algorithm::RingAllReduce.generate(1, 4).unwrap();
    let comm = oxccl::Communicator::virtual_ranks(&stream, 4, oxccl::Config::default()).unwrap();
    let s = &dev.streams[0];
    let send: Vec<CudaSlice<f32>> = (0..4).map(|_| s.alloc_zeros::<f32>(64).unwrap()).collect();
    let mut recv: Vec<CudaSlice<f32>> = (0..4).map(|_| s.alloc_zeros::<f32>(64).unwrap()).collect();
    let in_place = ring.layout.in_place;
    let e = if in_place {
        comm.run_program(&ring, &send, &mut recv, oxccl::ReduceOp::Sum).unwrap_err()
    } else {
        comm.run_program_in_place(&ring, &mut recv, oxccl::ReduceOp::Sum).unwrap_err()
    };
    assert!(matches!(e, Error::Config { field: "program", .. }), "{e}");
    let mut odd: Vec<CudaSlice<f32>> = (0..4).map(|_| s.alloc_zeros::<f32>(4 * 3).unwrap()).collect();
    let e = if in_place {
        comm.run_program_in_place(&ring, &mut odd, oxccl::ReduceOp::Sum).unwrap_err()
    } else {
        comm.run_program(&ring, &odd.clone(), &mut odd, oxccl::ReduceOp::Sum).unwrap_err()
    };
    assert!(matches!(e, Error::Config { field: "program", .. }), "{e}");
    let mut short: Vec<CudaSlice<f32>> =
        (0..4).map(|r| s.alloc_zeros::<f32>(if r == 2 { 60 } else { 64 }).unwrap()).collect();
    let e = if in_place {
        comm.run_program_in_place(&ring, &mut short, oxccl::ReduceOp::Sum).unwrap_err()
    } else {
        comm.run_program(&ring, &send, &mut short, oxccl::ReduceOp::Sum).unwrap_err()
    };
    assert!(matches!(e, Error::Length { rank: 2, .. }), "{e}");
    let eight = Algorithm::RingAllReduce.generate(1, 8).unwrap();
    let e = if in_place {
        comm.run_program_in_place(&eight, &mut recv, oxccl::ReduceOp::Sum).unwrap_err()
    } else {
        comm.run_program(&eight, &send, &mut recv, oxccl::ReduceOp::Sum).unwrap_err()
    };
    assert!(matches!(e, Error::Config { field: "program", .. }), "{e}");
    eprintln!("{ran} program runs on the collective engine matched the CPU executor");
}

/// One run of `program` on `comm`'s virtual ranks over cudarc buffers holding `cpu`'s slots
/// `(send, recv)` of every rank (the same slot in place); every rank's output bytes.
fn run_program_on<T: oxccl::Element + bytemuck::Pod>(
    comm: &oxccl::Communicator,
    stream: &Arc<CudaStream>,
    program: &Program,
    cpu: &Memory,
    (send_slot, recv_slot): (usize, usize),
) -> oxccl::Result<Vec<Vec<u8>>> {
    let up = |b: &[u8]| stream.clone_htod(&bytemuck::pod_collect_to_vec::<u8, T>(b)).unwrap();
    let p = program.ranks() as usize;
    let send: Vec<_> = (0..p).map(|r| up(&cpu.buffers[r][send_slot])).collect();
    let mut recv: Vec<_> = (0..p).map(|r| up(&cpu.buffers[r][recv_slot])).collect();
    if program.layout.in_place {
        comm.run_program_in_place(program, &mut recv, oxccl::ReduceOp::Sum)?;
    } else {
        comm.run_program(program, &send, &mut recv, oxccl::ReduceOp::Sum)?;
    }
    comm.synchronize()?;
    Ok(recv.iter().map(|b| bytemuck::cast_slice(&stream.clone_dtoh(b).unwrap()).to_vec()).collect())
}
