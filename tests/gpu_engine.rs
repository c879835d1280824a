//! The engine on the GPU: both movers copy and reduce random data of random sizes and alignments
//! exactly as the CPU executor does; a rank that never arrives yields a timeout error, not a hang; a
//! peer already at a later call is an out-of-step error, not a pass; waits given up with bulk loads
//! in flight are reported and leave the engine exact. Skips loudly without a Hopper GPU.

mod common;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use oxccl::engine::abi::{self, BUFFER_SLOTS, MAX_RANKS, TASK_AFTER_WRITES, WaitKind, slot};
use oxccl::engine::{
    DType, DeviceAlloc, Engine, LaunchSpec, Mover, PeerScope, RedOp, ReduceMode, Status, Task, TbProgram,
};
use oxccl_host::lowered::{self, HostBuffers, Lowered};
use rand::RngExt;
use std::sync::Arc;

struct Case {
    mover: Mover,
    dtype: DType,
    op: RedOp,
    kind: abi::TaskKind,
    reduce_mode: ReduceMode,
    sources: usize,
    bytes: u64,
    /// Element offsets of the sources' and the destination's ranges inside their buffers.
    src_off: u64,
    dst_off: u64,
    ctas: u32,
    /// TMA pipeline stages (every refill lag from 1 to `MAX_STAGES / 2` gets exercised).
    stages: u32,
    /// TMA bytes per source per stage.
    chunk: u32,
    /// Issuing warps (1, or 2 or 4 for tasks that do not combine: one slot per stage).
    issuers: u32,
}

fn spec(c: &Case, timeout_ns: u64) -> LaunchSpec {
    LaunchSpec {
        mover: c.mover,
        dtype: c.dtype,
        op: c.op,
        // TMA: 64, 128 or 256 threads by the case's sizes (the issuing warp combines too at 64),
        // enough to hold its issuers.
        threads: match c.mover {
            Mover::Simt => 512,
            Mover::Latency => [64, 256][(c.bytes % 2) as usize],
            Mover::Tma => [64, 128, 256][((c.bytes + c.src_off + c.dst_off) % 3) as usize].max(32 * c.issuers),
        },
        chunk_bytes: c.chunk,
        stages: c.stages,
        reduce_mode: c.reduce_mode,
        timeout_ns,
        wait_suspend_ns: 0,
        issuers: c.issuers,
        combine_direct: false,
        call_key: 0,
        peer_scope: PeerScope::System,
        // Each case runs the mover it names.
        latency_below: 0,
    }
}

/// One task per CTA over a 16-byte-grained split of the range: sources are rows 0..k of the buffer
/// table (slot INPUT), the destination row 0 slot OUTPUT.
fn lowered(c: &Case) -> Lowered {
    let e = c.dtype.size() as u64;
    let mut programs = Vec::new();
    let mut tasks = Vec::new();
    for cta in 0..c.ctas {
        let (lo, hi) = oxccl_host::tccl::split(c.bytes, c.ctas as u64, 16, cta as u64);
        let first = tasks.len() as u32;
        if hi > lo {
            tasks.push(Task {
                kind: c.kind.raw(),
                dtype: c.dtype.raw(),
                op: c.op.raw(),
                src_slot: slot::INPUT,
                dst_slot: slot::OUTPUT,
                flags: 0,
                divisor: 0,
                src_ranks: (1u32 << c.sources) - 1,
                dst_ranks: 1,
                src_offset: c.src_off * e + lo,
                dst_offset: c.dst_off * e + lo,
                bytes: hi - lo,
            });
        }
        programs.push(TbProgram {
            rank: 0,
            cta,
            first_task: first,
            task_count: tasks.len() as u32 - first,
            barrier_ranks: 0,
            table: 0,
            key: 0,
            reserved: 0,
        });
    }
    let combines = c.sources > 1 || c.kind == abi::TaskKind::ReduceInto;
    // Several issuers split the ring: only tasks that stream one source at a time, through slot 0.
    let slots = if c.issuers > 1 { 1 } else { c.sources as u32 + 1 };
    Lowered { programs, tasks, ranks: c.sources, slots, combines }
}

/// Small integers in the element type: every summation order gives the same exact result (the
/// integer types' values spread over their range, `common::spread_i32` and `spread_u32`: their
/// sums wrap, and u32 values lie on both sides of 2^31).
fn exact_data(dtype: DType, rng: &mut common::Rng, bytes: usize) -> Vec<u8> {
    let mut v = Vec::with_capacity(bytes + 8);
    while v.len() < bytes {
        v.extend(common::element(dtype, rng.random_range(-15..=15) as f64));
    }
    v.truncate(bytes);
    v
}

/// Random floats (`common::random_floats`): where the combination's order is fixed (one source, or
/// sources combined in registers), the GPU must match the CPU executor bitwise on them too,
/// roundings included.
fn random_floats(dtype: DType, rng: &mut common::Rng, bytes: usize) -> Vec<u8> {
    common::random_floats(dtype, rng, bytes).expect("random floats are for the float types")
}

fn addr(stream: &Arc<CudaStream>, s: &CudaSlice<u8>) -> u64 {
    s.device_ptr(stream).0
}

/// Launches `prog` with a fresh status record, waits for it and returns the record.
///
/// # Safety
/// As [`Engine::launch`]: every buffer and workspace the program uses is a live device-addressable
/// allocation covering what its tasks touch.
unsafe fn launch_status(
    engine: &Engine,
    stream: &Arc<CudaStream>,
    prog: &oxccl::engine::DeviceProgram,
    spec: &LaunchSpec,
    buffers: [[u64; BUFFER_SLOTS]; MAX_RANKS],
    workspaces: [u64; MAX_RANKS],
) -> Status {
    let status = DeviceAlloc::zeroed(engine.context(), std::mem::size_of::<Status>()).unwrap();
    // SAFETY: forwarded contract; the status record outlives the synchronisation below.
    unsafe { engine.launch(stream, prog, spec, buffers, workspaces, status.ptr()) }.unwrap();
    stream.synchronize().unwrap();
    bytemuck::pod_read_unaligned(&status.read().unwrap()[..std::mem::size_of::<Status>()])
}

/// Runs `c` on the GPU and on the CPU executor with small integers; returns (gpu, cpu) destination
/// buffers.
fn run(engine: &Engine, stream: &Arc<CudaStream>, c: &Case, rng: &mut common::Rng) -> (Vec<u8>, Vec<u8>) {
    run_on(engine, stream, c, rng, exact_data)
}

/// [`run`] with the data `data` makes.
fn run_on(
    engine: &Engine,
    stream: &Arc<CudaStream>,
    c: &Case,
    rng: &mut common::Rng,
    data: fn(DType, &mut common::Rng, usize) -> Vec<u8>,
) -> (Vec<u8>, Vec<u8>) {
    let e = c.dtype.size() as u64;
    let src_len = (c.src_off * e + c.bytes) as usize;
    let dst_len = (c.dst_off * e + c.bytes + 2 * e) as usize;
    let srcs: Vec<Vec<u8>> = (0..c.sources).map(|_| data(c.dtype, rng, src_len)).collect();
    let dst0 = data(c.dtype, rng, dst_len);
    let d_srcs: Vec<CudaSlice<u8>> = srcs.iter().map(|s| stream.clone_htod(s).unwrap()).collect();
    let d_dst = stream.clone_htod(&dst0).unwrap();

    let l = lowered(c);
    let prog = engine.upload(&l, 0..l.programs.len(), stream).unwrap();
    let mut buffers = [[0u64; BUFFER_SLOTS]; MAX_RANKS];
    for (k, s) in d_srcs.iter().enumerate() {
        buffers[k][slot::INPUT as usize] = addr(stream, s);
    }
    buffers[0][slot::OUTPUT as usize] = addr(stream, &d_dst);
    // SAFETY: every buffer the tasks name is a live allocation covering its range (offsets plus
    // bytes) until `launch_status` has synchronised.
    let st = unsafe { launch_status(engine, stream, &prog, &spec(c, 5_000_000_000), buffers, [0; MAX_RANKS]) };
    assert_eq!(st.errors, 0, "device reported {st:?}");
    let gpu = stream.clone_dtoh(&d_dst).unwrap();

    let mut host: HostBuffers = Vec::new();
    for (k, s) in srcs.into_iter().enumerate() {
        let mut row: [Vec<u8>; BUFFER_SLOTS] = Default::default();
        row[slot::INPUT as usize] = s;
        if k == 0 {
            row[slot::OUTPUT as usize] = dst0.clone();
        }
        host.push(row);
    }
    lowered::execute(&l, &mut host, &[]).unwrap();
    (gpu, host[0][slot::OUTPUT as usize].clone())
}

fn dtypes() -> &'static [DType] {
    DType::ALL
}

#[test]
fn movers_copy_and_reduce_random_sizes_exactly() {
    let Some(stream) = common::gpu("movers_copy_and_reduce_random_sizes_exactly") else { return };
    let engine = Engine::new(stream.context()).unwrap();
    let mut rng = common::rng(0x5eed);
    let fixed = [0u64, 4, 16, 17 * 16 + 4, 4096, 1 << 20];
    let (mut cases, mut float_cases) = (0, 0);
    let rounds = common::count_from_env("OXCCL_MOVER_ROUNDS", 40);
    for round in 0..rounds {
        for &mover in Mover::ALL {
            let dtype = dtypes()[rng.random_range(0..dtypes().len() as u64) as usize];
            // Products and averages are drawn by the collective suites, on inputs made for them.
            let op = [RedOp::Sum, RedOp::Min, RedOp::Max][rng.random_range(0..3) as usize];
            let e = dtype.size() as u64;
            let bytes = if round < fixed.len() {
                fixed[round] / e * e
            } else {
                let limit = if rng.random_range(0..4) == 0 { 64 << 20 } else { 300_000 };
                rng.random_range(0..limit) / e * e
            };
            let (kind, sources, reduce_mode) = match rng.random_range(0..4) {
                0 => (abi::TaskKind::Move, 1, ReduceMode::Registers),
                1 => (abi::TaskKind::Move, 1 + rng.random_range(0..8) as usize, ReduceMode::Registers),
                2 => (abi::TaskKind::ReduceInto, 1 + rng.random_range(0..7) as usize, ReduceMode::Registers),
                _ => (abi::TaskKind::ReduceInto, 1 + rng.random_range(0..7) as usize, ReduceMode::Tma),
            };
            // Equal shifts keep every range congruent modulo 16 (TMA body with unaligned head and tail);
            // different shifts make them disagree (element path).
            let (src_off, dst_off) = match rng.random_range(0..4) {
                0 => (0, 0),
                1 => {
                    let s = 1 + rng.random_range(0..8);
                    (s, s)
                }
                _ => (rng.random_range(0..9), rng.random_range(0..9)),
            };
            // As many stages of 4 KiB slots (one per source, plus the destination) as fit in 227 KiB.
            let fit = (231_424 / ((sources as u64 + 1) * 4096)).min(abi::MAX_STAGES as u64);
            let c = Case {
                mover,
                dtype,
                op,
                kind,
                reduce_mode,
                sources,
                bytes,
                src_off,
                dst_off,
                ctas: 1 + rng.random_range(0..8) as u32,
                stages: 1 + rng.random_range(0..fit) as u32,
                chunk: 4096,
                issuers: 1,
            };
            // Half the TMA tasks that stream one source at a time (copies, bulk reductions) get 2 or 4
            // issuing warps, each with 1 to 4 stages of its own.
            let streams_alone = c.kind == abi::TaskKind::Move && sources == 1
                || c.kind == abi::TaskKind::ReduceInto
                    && reduce_mode == ReduceMode::Tma
                    && abi::tma_can_reduce(dtype, op);
            let c = if mover == Mover::Tma && streams_alone && rng.random_range(0..2) == 0 {
                let w = [2, 4][rng.random_range(0..2) as usize];
                Case { issuers: w, stages: w * (1 + rng.random_range(0..4) as u32), ..c }
            } else {
                c
            };
            // Random floats in one float case in two where the result does not depend on the order
            // of combination: the hardware bulk reduction adds several sources in an order of its own.
            let fixed_order = sources == 1
                || op != RedOp::Sum
                || reduce_mode == ReduceMode::Registers
                || !abi::tma_can_reduce(dtype, op);
            let floats =
                matches!(dtype, DType::F32 | DType::F16 | DType::Bf16) && fixed_order && rng.random_range(0..2) == 0;
            let data = if floats { random_floats } else { exact_data };
            let (gpu, cpu) = run_on(&engine, &stream, &c, &mut rng, data);
            float_cases += usize::from(floats);
            assert!(
                gpu == cpu,
                "{mover:?} {kind:?} {dtype:?} {op:?} {reduce_mode:?} sources={sources} bytes={bytes} src_off={} dst_off={} ctas={} stages={} issuers={} floats={floats}: first difference at byte {:?}",
                c.src_off,
                c.dst_off,
                c.ctas,
                c.stages,
                c.issuers,
                gpu.iter().zip(&cpu).position(|(a, b)| a != b)
            );
            cases += 1;
        }
    }
    eprintln!("{cases} mover cases exact ({float_cases} of them on random floats)");
}

#[test]
fn movers_handle_more_than_a_gibibyte() {
    let Some(stream) = common::gpu("movers_handle_more_than_a_gibibyte") else { return };
    let engine = Engine::new(stream.context()).unwrap();
    let mut rng = common::rng(77);
    for mover in [Mover::Tma, Mover::Simt] {
        for (kind, sources) in [(abi::TaskKind::Move, 1), (abi::TaskKind::Move, 2)] {
            let c = Case {
                mover,
                dtype: DType::F32,
                op: RedOp::Sum,
                kind,
                reduce_mode: ReduceMode::Registers,
                sources,
                bytes: (1 << 30) + (1 << 24) + 20,
                src_off: 0,
                dst_off: 1,
                ctas: 32,
                stages: 4,
                chunk: 4096,
                issuers: 1,
            };
            let (gpu, cpu) = run(&engine, &stream, &c, &mut rng);
            assert!(gpu == cpu, "{mover:?} sources={sources}: > 1 GiB result differs");
        }
    }
}

#[test]
fn several_issuers_split_every_item_count_exactly() {
    // Every split of a task's items between 2 or 4 issuing warps, with 1 to 4 stages each: copies
    // and bulk reductions (a reduction done twice or missed shows), the last item partial.
    let Some(stream) = common::gpu("several_issuers_split_every_item_count_exactly") else { return };
    let engine = Engine::new(stream.context()).unwrap();
    let mut rng = common::rng(0x155e);
    let mut cases = 0;
    for issuers in [2u32, 4] {
        for ring in 1..=4u32 {
            for items in 0..=3 * issuers as u64 + 1 {
                for (kind, sources, reduce_mode) in
                    [(abi::TaskKind::Move, 1, ReduceMode::Registers), (abi::TaskKind::ReduceInto, 3, ReduceMode::Tma)]
                {
                    let c = Case {
                        mover: Mover::Tma,
                        dtype: DType::F32,
                        op: RedOp::Sum,
                        kind,
                        reduce_mode,
                        sources,
                        bytes: (items * 4096).saturating_sub(48),
                        src_off: 0,
                        dst_off: 0,
                        ctas: 1,
                        stages: issuers * ring,
                        chunk: 4096,
                        issuers,
                    };
                    let (gpu, cpu) = run(&engine, &stream, &c, &mut rng);
                    assert!(
                        gpu == cpu,
                        "{kind:?} issuers={issuers} stages={} items={items}: first difference at byte {:?}",
                        c.stages,
                        gpu.iter().zip(&cpu).position(|(a, b)| a != b)
                    );
                    cases += 1;
                }
            }
        }
    }
    eprintln!("{cases} splits between several issuers exact");
}

#[test]
fn reduce_after_writes_orders_dependent_tasks() {
    // Copy then ReduceInto the same destination in one CTA, the second task flagged TASK_AFTER_WRITES,
    // with the hardware bulk reduction: the reduction must see the copy. With several issuing warps
    // the reduction also starts a chunk (or half of one) later, so its items are not the ones each
    // warp copied itself: every warp must wait for its own bulk writes before the CTA moves on.
    let Some(stream) = common::gpu("reduce_after_writes_orders_dependent_tasks") else { return };
    let engine = Engine::new(stream.context()).unwrap();
    let bytes = 3 << 20;
    let a: Vec<f32> = (0..bytes / 4).map(|i| (i % 17) as f32).collect();
    let b: Vec<f32> = (0..bytes / 4).map(|i| (i % 5) as f32).collect();
    let (da, db) = (stream.clone_htod(&a).unwrap(), stream.clone_htod(&b).unwrap());
    for (issuers, shift) in [(1u32, 0u64), (2, 0), (4, 0), (2, 4096), (4, 4096), (4, 2048)] {
        let dst = stream.alloc_zeros::<f32>(bytes / 4).unwrap();
        let t = |kind: abi::TaskKind, src_ranks: u32, flags: u8, from: u64| Task {
            kind: kind.raw(),
            dtype: DType::F32.raw(),
            op: RedOp::Sum.raw(),
            src_slot: slot::INPUT,
            dst_slot: slot::OUTPUT,
            flags,
            divisor: 0,
            src_ranks,
            dst_ranks: 1,
            src_offset: from,
            dst_offset: from,
            bytes: bytes as u64 - from,
        };
        let l = Lowered {
            programs: vec![TbProgram {
                rank: 0,
                cta: 0,
                first_task: 0,
                task_count: 2,
                barrier_ranks: 0,
                table: 0,
                key: 0,
                reserved: 0,
            }],
            tasks: vec![t(abi::TaskKind::Move, 1, 0, 0), t(abi::TaskKind::ReduceInto, 2, TASK_AFTER_WRITES, shift)],
            ranks: 2,
            slots: if issuers > 1 { 1 } else { 2 },
            combines: issuers == 1,
        };
        let prog = engine.upload(&l, 0..1, &stream).unwrap();
        let mut buffers = [[0u64; BUFFER_SLOTS]; MAX_RANKS];
        buffers[0][0] = da.device_ptr(&stream).0;
        buffers[1][0] = db.device_ptr(&stream).0;
        buffers[0][1] = dst.device_ptr(&stream).0;
        let status = DeviceAlloc::zeroed(engine.context(), 64).unwrap();
        let c = Case {
            mover: Mover::Tma,
            dtype: DType::F32,
            op: RedOp::Sum,
            kind: abi::TaskKind::ReduceInto,
            reduce_mode: ReduceMode::Tma,
            sources: 2,
            bytes: 0,
            src_off: 0,
            dst_off: 0,
            ctas: 1,
            stages: 4 * issuers,
            chunk: 4096,
            issuers,
        };
        let first_reduced = (shift / 4) as usize;
        for _ in 0..20 {
            // SAFETY: the three buffers hold `bytes` each and outlive the launch (read back below).
            unsafe { engine.launch(&stream, &prog, &spec(&c, 5_000_000_000), buffers, [0; MAX_RANKS], status.ptr()) }
                .unwrap();
            let got = stream.clone_dtoh(&dst).unwrap();
            let want = |i: usize| a[i] + if i >= first_reduced { b[i] } else { 0.0 };
            let bad = (0..got.len()).position(|i| got[i] != want(i));
            assert_eq!(bad, None, "issuers={issuers} shift={shift}: copy then bulk-reduce lost the copy");
        }
    }
}

/// A launch of one TMA warp with a small pipeline.
fn one_warp_spec(timeout_ns: u64) -> LaunchSpec {
    LaunchSpec {
        mover: Mover::Tma,
        dtype: DType::F32,
        op: RedOp::Sum,
        threads: 32,
        chunk_bytes: 1024,
        stages: 2,
        reduce_mode: ReduceMode::Registers,
        timeout_ns,
        wait_suspend_ns: 0,
        issuers: 1,
        combine_direct: false,
        call_key: 0,
        peer_scope: PeerScope::System,
        // Each case runs the mover it names.
        latency_below: 0,
    }
}

/// A hand-built launch whose timeout is 0 (every wait not already met would fail at once) or past
/// `MAX_TIMEOUT` (the device's deadline saturates, so a missing peer would hang it) is refused.
#[test]
fn launches_with_a_zero_or_unbounded_timeout_are_refused() {
    let Some(stream) = common::gpu("launches_with_a_zero_or_unbounded_timeout_are_refused") else { return };
    let engine = Engine::new(stream.context()).unwrap();
    let max = oxccl::MAX_TIMEOUT.as_nanos() as u64;
    for t in [0, max + 1, u64::MAX] {
        let e = engine.check(&one_warp_spec(t), 1, 1).expect_err("refused");
        assert!(matches!(e, oxccl::Error::Config { field: "timeout", .. }), "{t} ns: {e}");
    }
    for t in [1, max] {
        engine.check(&one_warp_spec(t), 1, 1).unwrap_or_else(|e| panic!("{t} ns: {e}"));
    }
}

/// Launches one CTA of rank 0 with no tasks and barriers with rank 1, which is never launched;
/// rank 0's workspace holds the u64 `writes` (byte offset, value) first. Returns the status.
fn launch_rank0_barrier_only(
    engine: &Engine,
    stream: &Arc<CudaStream>,
    workspace_bytes: usize,
    writes: &[(usize, u64)],
    timeout_ns: u64,
) -> (Status, Vec<u8>) {
    let ctx = engine.context();
    let l = Lowered {
        programs: vec![TbProgram {
            rank: 0,
            cta: 0,
            first_task: 0,
            task_count: 0,
            barrier_ranks: 0b11,
            table: 0,
            key: 0,
            reserved: 0,
        }],
        tasks: vec![],
        ranks: 2,
        slots: 1,
        combines: false,
    };
    let prog = engine.upload(&l, 0..1, stream).unwrap();
    let mut own = vec![0u8; workspace_bytes];
    for &(at, v) in writes {
        own[at..][..8].copy_from_slice(&v.to_le_bytes());
    }
    let ws = [DeviceAlloc::from_bytes(ctx, &own).unwrap(), DeviceAlloc::zeroed(ctx, workspace_bytes).unwrap()];
    let mut workspaces = [0u64; MAX_RANKS];
    workspaces[0] = ws[0].ptr();
    workspaces[1] = ws[1].ptr();
    let spec = one_warp_spec(timeout_ns);
    // SAFETY: the program has no tasks (no buffer is touched); both workspaces are live device
    // allocations of the workspace's size until `launch_status` has synchronised.
    let st = unsafe { launch_status(engine, stream, &prog, &spec, [[0; BUFFER_SLOTS]; MAX_RANKS], workspaces) };
    (st, ws[1].read().unwrap())
}

/// The flag word at byte `at` of a workspace's bytes.
fn word(ws: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(ws[at..][..8].try_into().unwrap())
}

#[test]
fn a_rank_that_never_arrives_is_a_timeout_not_a_hang() {
    let Some(stream) = common::gpu("a_rank_that_never_arrives_is_a_timeout_not_a_hang") else { return };
    let engine = Engine::new(stream.context()).unwrap();
    // Rank 0 expects rank 1 at its start barrier; rank 1 is never launched.
    let t0 = std::time::Instant::now();
    let (st, peer_ws) =
        launch_rank0_barrier_only(&engine, &stream, std::mem::size_of::<abi::Workspace>(), &[], 50_000_000);
    let waited = t0.elapsed();
    assert_eq!(st.errors, 1);
    assert_eq!(WaitKind::from_raw(st.kind), Some(WaitKind::StartBarrier));
    assert_eq!((st.rank, st.cta, st.peer, st.expected), (0, 0, 1, 1));
    // Rank 0 withdrew from call 1 in rank 1's workspace: its arrival revoked (rank 1, should it
    // start late, stops without touching rank 0's buffers) and its done flag marked aborted.
    assert_eq!(word(&peer_ws, abi::Workspace::arrive_offset(0, 0)), 1 | abi::BARRIER_REVOKED);
    assert_eq!(word(&peer_ws, abi::Workspace::done_offset(0, 0)), 1 | abi::BARRIER_ABORTED);
    // The device honours its 50 ms deadline: not a speed check (it allows 100 times the deadline),
    // it catches a deadline misread by orders of magnitude.
    assert!(waited.as_secs_f64() < 5.0, "the wait took {waited:?}");
    let err = oxccl::engine::status_error(&st).expect("an error");
    let text = err.to_string();
    assert!(text.contains("start barrier") && text.contains("peer 1"), "{text}");
    eprintln!("timeout reported after {waited:?}: {text}");
}

/// Launches `c` with its sources in mapped pinned host memory, so every bulk load crosses PCIe and
/// lands microseconds after it is issued, with the device waits bounded by `timeout_ns`; returns
/// the launch's status (the destination's contents are not checked).
fn launch_from_host_memory(engine: &Engine, stream: &Arc<CudaStream>, c: &Case, timeout_ns: u64) -> Status {
    use cudarc::driver::sys;
    let ctx = engine.context();
    let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
    // SAFETY: the host never reads these buffers; the device only loads from them.
    let srcs: Vec<_> = (0..c.sources)
        .map(|_| unsafe { ctx.alloc_pinned_with_flags::<u8>(c.bytes as usize, flags) }.unwrap())
        .collect();
    let d_dst = stream.alloc_zeros::<u8>(c.bytes as usize).unwrap();
    let l = lowered(c);
    let prog = engine.upload(&l, 0..l.programs.len(), stream).unwrap();
    let mut buffers = [[0u64; BUFFER_SLOTS]; MAX_RANKS];
    for (k, s) in srcs.iter().enumerate() {
        let mut dptr: sys::CUdeviceptr = 0;
        // SAFETY: `s` is a live mapped pinned allocation of this context.
        unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dptr, s.as_ptr().unwrap() as *mut _, 0) }.result().unwrap();
        buffers[k][slot::INPUT as usize] = dptr;
    }
    buffers[0][slot::OUTPUT as usize] = addr(stream, &d_dst);
    // SAFETY: the sources are mapped pinned allocations of `c.bytes` each (device-addressable), the
    // destination a device allocation of the same size, all alive until `launch_status` has
    // synchronised.
    unsafe { launch_status(engine, stream, &prog, &spec(c, timeout_ns), buffers, [0; MAX_RANKS]) }
}

#[test]
fn an_abandoned_load_lands_before_the_cta_moves_on() {
    // Waits bounded far below a load's latency (1 ns; sources in host memory): the CTA gives up a
    // stage's wait with later loads of the ring still in flight. The CTA must let them land before
    // its stages are reused or it exits (else they write into shared memory the next CTA on that
    // SM owns), report the timeout, and leave the engine exact for the next launch. Copies (the
    // issuer alone) and combines (every thread waits), several ring depths. What this checks is the
    // report, a clean exit (also under compute-sanitizer memcheck) and the next launch; it cannot
    // see the drain itself (every CTA of these launches fits on the GPU at once, so no later CTA
    // reuses an aborted CTA's shared memory).
    let Some(stream) = common::gpu("an_abandoned_load_lands_before_the_cta_moves_on") else { return };
    let engine = Engine::new(stream.context()).unwrap();
    let mut rng = common::rng(0xab0);
    // (sources, stages, chunk, issuers, bytes past 8 MiB): four issuing warps drain their own shares
    // of the ring (with 16 stages each owns four and keeps two loads ahead); the extra bytes pick the
    // case's threads (`spec`): 8 MiB runs on 256, 8 MiB + 16 on 64, where the issuing warp combines.
    for (sources, stages, chunk, issuers, extra) in [
        (1, 2, 48 << 10, 1, 0),
        (1, 8, 12 << 10, 1, 0),
        (1, 8, 12 << 10, 4, 0),
        (1, 16, 4 << 10, 4, 0),
        (3, 2, 24 << 10, 1, 0),
        (3, 2, 24 << 10, 1, 16),
        (3, 6, 8 << 10, 1, 0),
        (3, 6, 8 << 10, 1, 16),
    ] {
        let mut c = Case {
            mover: Mover::Tma,
            dtype: DType::F32,
            op: RedOp::Sum,
            kind: abi::TaskKind::Move,
            reduce_mode: ReduceMode::Registers,
            sources,
            bytes: (8 << 20) + extra,
            src_off: 0,
            dst_off: 0,
            ctas: 132,
            stages,
            chunk,
            issuers,
        };
        let threads = spec(&c, 1).threads;
        let st = launch_from_host_memory(&engine, &stream, &c, 1);
        assert!(
            st.errors > 0,
            "sources={sources} stages={stages} issuers={issuers} threads={threads}: no wait gave up"
        );
        assert_eq!(
            WaitKind::from_raw(st.kind),
            Some(WaitKind::BulkLoad),
            "sources={sources} stages={stages} issuers={issuers}: {st:?}"
        );
        c.bytes += 4 * 16 + 4;
        let (gpu, cpu) = run(&engine, &stream, &c, &mut rng);
        assert!(
            gpu == cpu,
            "sources={sources} stages={stages} issuers={issuers}: the launch after the abandoned one differs"
        );
    }
    eprintln!("every launch gave up a wait with loads in flight and reported it; the next launches exact");
}

#[test]
fn a_peer_already_at_a_later_call_is_out_of_step_not_ignored() {
    // Rank 1's start flag for rank 0 says call 2 while rank 0 makes call 1: in step that cannot
    // happen (rank 1 cannot pass call 1's end barrier without rank 0), so rank 0 must stop with
    // an out-of-step error instead of reading buffers rank 1 is already using for call 2.
    let Some(stream) = common::gpu("a_peer_already_at_a_later_call_is_out_of_step_not_ignored") else { return };
    let engine = Engine::new(stream.context()).unwrap();
    let at = abi::Workspace::arrive_offset(1, 0);
    // A 5 s timeout: had rank 0 waited instead, the error would be a start-barrier timeout.
    let (st, _) =
        launch_rank0_barrier_only(&engine, &stream, std::mem::size_of::<abi::Workspace>(), &[(at, 2)], 5_000_000_000);
    assert_eq!(WaitKind::from_raw(st.kind), Some(WaitKind::OutOfStep), "{st:?}");
    assert_eq!((st.rank, st.cta, st.peer, st.expected, st.observed), (0, 0, 1, 1, 2));
    let text = oxccl::engine::status_error(&st).expect("an error");
    assert!(text.to_string().contains("out of step") && text.to_string().contains("peer 1"), "{text}");
    eprintln!("{text}");
}

#[test]
fn a_revoked_arrival_stops_the_peer_before_its_tasks() {
    // Rank 1 arrived at call 1 and withdrew (it gave up): rank 0 must not start the call, whose
    // tasks would touch rank 1's buffers after rank 1's kernel may have ended. With a 5 s timeout,
    // waiting instead would show as a start-barrier timeout.
    let Some(stream) = common::gpu("a_revoked_arrival_stops_the_peer_before_its_tasks") else { return };
    let engine = Engine::new(stream.context()).unwrap();
    let at = abi::Workspace::arrive_offset(1, 0);
    let (st, peer_ws) = launch_rank0_barrier_only(
        &engine,
        &stream,
        std::mem::size_of::<abi::Workspace>(),
        &[(at, 1 | abi::BARRIER_REVOKED)],
        5_000_000_000,
    );
    assert_eq!(WaitKind::from_raw(st.kind), Some(WaitKind::PeerAborted), "{st:?}");
    assert_eq!((st.rank, st.cta, st.peer, st.expected, st.observed), (0, 0, 1, 1, 1 | abi::BARRIER_REVOKED));
    let e = oxccl::engine::status_error(&st).expect("an error");
    assert!(matches!(e, oxccl::Error::PeerAborted { rank: 0, cta: 0, peer: 1, call: 1, .. }), "{e}");
    // And rank 0 withdrew in turn.
    assert_eq!(word(&peer_ws, abi::Workspace::arrive_offset(0, 0)), 1 | abi::BARRIER_REVOKED);
    assert_eq!(word(&peer_ws, abi::Workspace::done_offset(0, 0)), 1 | abi::BARRIER_ABORTED);
    eprintln!("{e}");
}

/// The module loader keeps the prebuilt code where the driver takes it and falls back to the PTX
/// where the driver refuses it: code for another GPU (sm_80 on an H200), and code from a newer
/// `ptxas` than the shipped code's (which an older driver may refuse: either outcome is right, and
/// the test says which). Each loaded module's kernel must then run. (Not a cut-off image:
/// `cuModuleLoadData` takes no length, and one killed the process.)
#[test]
fn refused_machine_code_falls_back_to_the_ptx() {
    use oxccl::engine::{ModuleCode, load_module_as};
    let Some(stream) = common::gpu("refused_machine_code_falls_back_to_the_ptx") else { return };
    let ctx = stream.context();
    let ptx = include_str!("data/load_probe.ptx");
    let sm90a: &[u8] = include_bytes!("data/load_probe.sm_90a.cubin");
    let sm80: &[u8] = include_bytes!("data/load_probe.sm_80.cubin");
    let newer: &[u8] = include_bytes!("data/load_probe.sm_90a.ptxas-13.5.cubin");
    let mut out = stream.alloc_zeros::<u32>(1).unwrap();
    let mut runs = |module: &std::sync::Arc<cudarc::driver::CudaModule>, value: u32| {
        use cudarc::driver::{LaunchConfig, PushKernelArg};
        let f = module.load_function("oxccl_load_probe").unwrap();
        let mut b = stream.launch_builder(&f);
        b.arg(&mut out).arg(&value);
        // SAFETY: the kernel stores one u32 through its first argument, a one-element buffer.
        unsafe { b.launch(LaunchConfig { grid_dim: (1, 1, 1), block_dim: (1, 1, 1), shared_mem_bytes: 0 }) }.unwrap();
        assert_eq!(stream.clone_dtoh(&out).unwrap(), vec![value]);
    };
    for (what, code, want) in [
        ("sm_90a code", sm90a, Some(ModuleCode::Prebuilt)),
        ("sm_80 code", sm80, Some(ModuleCode::Ptx)),
        ("sm_90a code of ptxas 13.5", newer, None),
    ] {
        // SAFETY (here and below): each image is a whole file as ptxas wrote it.
        let (module, got) = unsafe { load_module_as(ctx, ptx, code, None) }.unwrap_or_else(|e| panic!("{what}: {e}"));
        if let Some(want) = want {
            assert_eq!(got, want, "{what}");
        }
        runs(&module, 7 + got as u32);
        eprintln!("{what}: loaded from {got}");
    }
    // Asked for by name: the PTX always loads; refused machine code is an error, not the PTX.
    let (module, got) = unsafe { load_module_as(ctx, ptx, sm80, Some(ModuleCode::Ptx)) }.unwrap();
    assert_eq!(got, ModuleCode::Ptx);
    runs(&module, 11);
    let e = unsafe { load_module_as(ctx, ptx, sm80, Some(ModuleCode::Prebuilt)) }.map(|(_, c)| c).unwrap_err();
    assert!(e.to_string().contains("cuModuleLoadData"), "{e}");
    eprintln!("sm_80 code asked for by name: {e}");
}
