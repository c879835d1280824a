//! Per-rank communicators (`oxccl::Comm`) on the GPU: ranks as threads of this process and as
//! processes of their own (this test binary run again as each rank), every collective, both movers,
//! both reductions, in and out of place, random sizes and element offsets, buffers of every kind
//! across processes (symmetric, registered exportable memory, and cudarc's, which go through
//! staging), exact against the CPU
//! reference; a rank killed mid-call; misuse. Reshards (`Comm::reshard`) on threads and processes,
//! each rank passing only its own shards, exact against the global tensor; transfer programs
//! (`Comm::run_program`) against the CPU executor of their lowering.
//!
//! Processes sharing one GPU run their kernels side by side only under MPS: the multi-process
//! tests run where `OXCCL_MPS=1` says MPS is up (scripts/gpu-suite.sh starts it), and say they are
//! skipped otherwise. `processes_without_mps_end` (run with `OXCCL_NO_MPS=1`) checks that without
//! MPS a call ends, in results or a typed error, rather than hangs.

mod common;

use cudarc::driver::{CudaSlice, CudaStream, CudaView, CudaViewMut};
use oxccl::host::compile::direct::{DirectOptions, lower_direct};
use oxccl::host::lowered::HostBuffers;
use oxccl::host::program::generators::Algorithm;
use oxccl::host::program::{Program, msccl};
use oxccl::host::tccl::{self, PlanSpec};
use oxccl::reshard::{CtaOwner, Layout, Mesh, Placement, PlanOptions, Route};
use oxccl::{
    Collective, Comm, Config, DType, Element, Error, ExportableBuffer, Id, Mover, ReduceOp, Reduction, Registration,
    ReshardOptions, SymmetricBuffer,
};
use oxccl_kernels::abi::slot;
use rand::RngExt;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Bytes after each buffer, in its allocation, that a call must leave as they are.
const GUARD: usize = 64;
/// What the bytes around a buffer hold.
const MARK: u8 = 0xA5;

/// The communicators every rank builds, in this order, one [`Id`] each: (mover, reduction, CTAs).
const SHAPES: [(Mover, Reduction, u32); 4] = [
    (Mover::Tma, Reduction::Registers, 0),
    (Mover::Tma, Reduction::Tma, 2),
    (Mover::Simt, Reduction::Registers, 4),
    (Mover::Tma, Reduction::Registers, 1),
];

fn config(shape: (Mover, Reduction, u32)) -> Config {
    let (mover, reduction, ctas) = shape;
    Config {
        max_ctas: (ctas > 0).then_some(ctas),
        mover,
        reduction,
        deterministic: reduction == Reduction::Registers,
        timeout: common::timeout_from_env(Duration::from_secs(5)),
        // Under `OXCCL_RANK_MEET=1` (the sanitizer runs) staging memory for every case from the
        // start: a peer that maps grown staging memory while its kernel runs is memory the tool
        // did not know at that launch.
        staging_bytes: if meet() { 64 << 20 } else { oxccl::DEFAULT_STAGING_BYTES },
        ..Config::default()
    }
}

/// `OXCCL_RANK_MEET=1`: see [`config`] and `run_case`.
fn meet() -> bool {
    std::env::var_os("OXCCL_RANK_MEET").is_some_and(|v| v == "1")
}

/// One case, drawn alike on every rank from `seed` and the case number.
struct Case {
    spec: PlanSpec,
    /// Index into [`SHAPES`].
    shape: usize,
    inputs: Vec<Vec<u8>>,
    /// Per rank: element offset of its input and output in their allocations, and the memory they
    /// are in.
    shift: Vec<(usize, usize)>,
    memory: Vec<Memory>,
}

/// The memory a rank's buffers are in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Memory {
    /// cudarc's (a stream-ordered pool's): staged across processes.
    Cudarc,
    /// [`Comm::alloc_symmetric`]'s.
    Symmetric,
    /// An [`ExportableBuffer`], registered ([`Comm::register`]).
    Registered,
}

/// Per rank of `world`: cudarc's memory on threads; across processes any kind. `OXCCL_RANK_MEMORY`
/// (`cudarc`, `symmetric`, `registered`) gives every rank that kind instead (the sanitizer runs
/// tell pool memory from memory of their own that way).
fn draw_memory(rng: &mut common::Rng, world: usize, processes: bool) -> Vec<Memory> {
    let kinds = [Memory::Cudarc, Memory::Symmetric, Memory::Registered];
    let forced = std::env::var("OXCCL_RANK_MEMORY").ok().map(|m| match m.as_str() {
        "cudarc" => Memory::Cudarc,
        "symmetric" => Memory::Symmetric,
        "registered" => Memory::Registered,
        other => panic!("OXCCL_RANK_MEMORY={other}: give cudarc, symmetric or registered"),
    });
    (0..world)
        .map(|_| {
            let drawn = if processes { kinds[rng.random_range(0..3) as usize] } else { Memory::Cudarc };
            forced.unwrap_or(drawn)
        })
        .collect()
}

/// How many cases had buffers of each shared kind: "N on symmetric buffers, M on registered ones".
fn kinds_line(memory: impl Iterator<Item = Memory>) -> String {
    let (mut sym, mut reg) = (0, 0);
    for m in memory {
        sym += usize::from(m == Memory::Symmetric);
        reg += usize::from(m == Memory::Registered);
    }
    format!("{sym} on symmetric buffers, {reg} on registered ones")
}

fn draw(seed: u64, case: usize, world: usize, processes: bool) -> Case {
    let mut rng = common::rng(seed ^ (case as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    let shape = rng.random_range(0..SHAPES.len() as u64) as usize;
    let (_, reduction, _) = SHAPES[shape];
    let root = rng.random_range(0..world as u64) as u32;
    let collective = Collective::every(root)[rng.random_range(0..6) as usize];
    let count = match rng.random_range(0..6) {
        0 => [0, 1, 3, 7, 8, 9, 15, 16, 17, 33, 4095, 4097][rng.random_range(0..12) as usize],
        1..=3 => rng.random_range(0..5000),
        _ => rng.random_range(0..300_000),
    };
    let dtype = DType::ALL[rng.random_range(0..DType::ALL.len() as u64) as usize];
    let op = ReduceOp::ALL[rng.random_range(0..ReduceOp::ALL.len() as u64) as usize];
    let spec = PlanSpec {
        collective,
        count,
        dtype,
        op,
        ranks: world,
        in_place: rng.random_range(0..2) == 0 && collective.has_in_place(),
        // Filled by the communicator; the reference ignores it.
        ctas: 1,
        reduction,
    };
    // Small integers: exact in any order of combination (the bulk reduction's too). Products take
    // ±1 and ±2: an f16 product that overflows stays an infinity, never times zero (a NaN, whose
    // bits the CPU and the GPU spell differently).
    let (in_bytes, _) = spec.buffer_bytes();
    let elems = in_bytes as usize / dtype.size();
    let mut inputs: Vec<Vec<u8>> = (0..world).map(|_| Vec::new()).collect();
    for _ in 0..elems {
        for input in inputs.iter_mut() {
            let x = if op == ReduceOp::Prod {
                [-2.0, -1.0, 1.0, 2.0][rng.random_range(0..4) as usize]
            } else {
                rng.random_range(0..21) as f64 - 10.0
            };
            input.extend(common::element(dtype, x));
        }
    }
    let shifted = rng.random_range(0..3) == 0;
    let shift = (0..world)
        .map(|_| if shifted { (rng.random_range(0..9) as usize, rng.random_range(0..9) as usize) } else { (0, 0) })
        .collect();
    let memory = draw_memory(&mut rng, world, processes);
    Case { spec, shape, inputs, shift, memory }
}

/// A buffer at an offset into its allocation, marked around: ordinary cudarc memory, a symmetric
/// buffer or a registered exportable one.
enum Storage {
    Plain(CudaSlice<u8>),
    Symmetric(SymmetricBuffer<u8>),
    Registered(RegisteredAlloc),
}

/// An [`ExportableBuffer`] registered with the communicator's peers; the registration ends before
/// the memory is freed.
struct RegisteredAlloc {
    /// Ends first (fields drop in order): the memory is freed after.
    _registration: Registration,
    buf: ExportableBuffer<u8>,
}

impl RegisteredAlloc {
    fn new(comm: &Comm, bytes: &[u8]) -> RegisteredAlloc {
        let stream = comm.stream();
        let mut buf = ExportableBuffer::<u8>::new(stream, bytes.len()).expect("ExportableBuffer");
        stream.memcpy_htod(bytes, &mut *buf).unwrap();
        // SAFETY: `buf` is freed after the registration ends (drop order of the fields).
        let registration = unsafe { comm.register(&*buf) }.expect("register");
        RegisteredAlloc { _registration: registration, buf }
    }
}

struct Placed {
    storage: Storage,
    head: usize,
    len: usize,
}

impl Placed {
    fn new(comm: &Comm, memory: Memory, bytes: &[u8], head: usize) -> Placed {
        let stream = comm.stream();
        let mut all = vec![MARK; head + bytes.len() + GUARD];
        all[head..head + bytes.len()].copy_from_slice(bytes);
        let storage = match memory {
            Memory::Symmetric => {
                let mut b = comm.alloc_symmetric::<u8>(all.len()).expect("alloc_symmetric");
                stream.memcpy_htod(&all, &mut *b).unwrap();
                Storage::Symmetric(b)
            }
            Memory::Registered => Storage::Registered(RegisteredAlloc::new(comm, &all)),
            Memory::Cudarc => Storage::Plain(stream.clone_htod(&all).unwrap()),
        };
        Placed { storage, head, len: bytes.len() }
    }

    fn slice(&self) -> &CudaSlice<u8> {
        match &self.storage {
            Storage::Plain(s) => s,
            Storage::Symmetric(s) => s,
            Storage::Registered(s) => &s.buf,
        }
    }

    fn slice_mut(&mut self) -> &mut CudaSlice<u8> {
        match &mut self.storage {
            Storage::Plain(s) => s,
            Storage::Symmetric(s) => s,
            Storage::Registered(s) => &mut s.buf,
        }
    }

    /// The buffer's bytes, after checking the marks around it.
    fn read(&self, stream: &Arc<CudaStream>, what: &str) -> Vec<u8> {
        let all = stream.clone_dtoh(self.slice()).unwrap();
        let body = self.head..self.head + self.len;
        if let Some(i) = (0..self.head).chain(self.head + self.len..all.len()).find(|&i| all[i] != MARK) {
            panic!("{what}: the call wrote byte {i} of the allocation, outside its buffer at {body:?}");
        }
        all[body].to_vec()
    }

    fn view<T>(&self) -> CudaView<'_, T> {
        let size = std::mem::size_of::<T>();
        let s = self.slice();
        // SAFETY: the allocation's bytes, viewed as T (the element types are plain data).
        let whole = unsafe { s.transmute::<T>(s.len() / size) }.unwrap();
        whole.slice(self.head / size..(self.head + self.len) / size)
    }

    /// The whole allocation as T, with the buffer's element range in it.
    fn whole_mut<T>(&mut self) -> (CudaViewMut<'_, T>, std::ops::Range<usize>) {
        let size = std::mem::size_of::<T>();
        let range = self.head / size..(self.head + self.len) / size;
        let s = self.slice_mut();
        let n = s.len() / size;
        // SAFETY: as for `view`.
        (unsafe { s.transmute_mut::<T>(n) }.unwrap(), range)
    }
}

/// Runs case `case` on this rank; returns its output bytes (empty without one) after checking the
/// input was left as it was.
fn run_case(comm: &Comm, c: &Case) -> Result<Vec<u8>, Error> {
    let (spec, r) = (&c.spec, comm.rank());
    let (in_bytes, out_bytes) = spec.buffer_bytes();
    let size = spec.dtype.size();
    let stream = comm.stream().clone();
    let (shift_in, shift_out) = c.shift[r];
    let sym = c.memory[r];
    let (mut input, mut output) = (None, None);
    if spec.in_place {
        let len = in_bytes.max(out_bytes) as usize;
        let mut b = tccl::poison(spec, len);
        let at = if spec.collective == Collective::AllGather { r * in_bytes as usize } else { 0 };
        b[at..at + c.inputs[r].len()].copy_from_slice(&c.inputs[r]);
        output = Some(Placed::new(comm, sym, &b, shift_out * size));
    } else {
        let (has_in, has_out) = spec.rank_buffers(r);
        if has_in {
            input = Some(Placed::new(comm, sym, &c.inputs[r], shift_in * size));
        }
        if has_out {
            output = Some(Placed::new(comm, sym, &tccl::poison(spec, out_bytes as usize), shift_out * size));
        }
    }
    // `OXCCL_RANK_MEET=1`: every rank's buffers exist before any rank launches (the sanitizer
    // runs: a tool that checks a launch against the allocations it knows of at launch time).
    if meet() {
        comm.synchronize()?;
        comm.bootstrap().barrier()?;
    }
    macro_rules! call {
        ($t:ty) => {{
            let send = input.as_ref().map(|b| b.view::<$t>());
            let mut whole = output.as_mut().map(|b| b.whole_mut::<$t>());
            let mut recv = whole.as_mut().map(|(w, r)| w.slice_mut(r.clone()));
            match (spec.collective, spec.in_place) {
                (Collective::AllReduce, false) => {
                    comm.all_reduce(send.as_ref().unwrap(), recv.as_mut().unwrap(), spec.op)
                }
                (Collective::AllReduce, true) => comm.all_reduce_in_place(recv.as_mut().unwrap(), spec.op),
                (Collective::ReduceScatter, false) => {
                    comm.reduce_scatter(send.as_ref().unwrap(), recv.as_mut().unwrap(), spec.op)
                }
                (Collective::ReduceScatter, true) => comm.reduce_scatter_in_place(recv.as_mut().unwrap(), spec.op),
                (Collective::AllGather, false) => comm.all_gather(send.as_ref().unwrap(), recv.as_mut().unwrap()),
                (Collective::AllGather, true) => comm.all_gather_in_place(recv.as_mut().unwrap()),
                (Collective::Broadcast { root }, false) => {
                    comm.broadcast(send.as_ref(), recv.as_mut().unwrap(), root as usize)
                }
                (Collective::Broadcast { root }, true) => {
                    comm.broadcast_in_place(recv.as_mut().unwrap(), root as usize)
                }
                (Collective::Reduce { root }, false) => {
                    comm.reduce(send.as_ref().unwrap(), recv.as_mut(), spec.op, root as usize)
                }
                (Collective::Reduce { root }, true) => {
                    comm.reduce_in_place(recv.as_mut().unwrap(), spec.op, root as usize)
                }
                // Drawn out of place only.
                (Collective::AllToAll, _) => comm.all_to_all(send.as_ref().unwrap(), recv.as_mut().unwrap()),
            }
        }};
    }
    oxccl::with_element!(spec.dtype, |T| call!(T))?;
    comm.synchronize()?;
    if let Some(b) = &input {
        let after = b.read(&stream, &format!("{spec:?}: rank {r}'s input"));
        assert!(after == c.inputs[r], "{spec:?}: the call wrote rank {r}'s input buffer");
    }
    Ok(output.map(|b| b.read(&stream, &format!("{spec:?}: rank {r}'s output"))).unwrap_or_default())
}

/// The end of a rank's cases. A process that ends takes its memory service with it, and a peer
/// still making a buffer reachable there would get an error: processes meet before they leave.
/// Threads leave as they finish, while their peers are still in calls (which must not stall them).
fn leave(comms: &[Comm], processes: bool) {
    if processes {
        for c in comms {
            c.bootstrap().barrier().unwrap();
        }
    }
}

/// One rank's part of the random cases: builds its communicators (one per shape, from `ids`) on
/// `stream` and runs `cases` cases, each checked against the CPU reference. Returns how many ran,
/// and on this rank the kinds of memory they were on ([`kinds_line`]).
fn rank_cases(
    stream: &Arc<CudaStream>,
    rank: usize,
    world: usize,
    ids: &[Id],
    cases: usize,
    seed: u64,
    processes: bool,
) -> (usize, String) {
    let comms: Vec<Comm> = SHAPES
        .iter()
        .zip(ids)
        .map(|(&shape, id)| {
            Comm::from_rank(stream, rank, world, id, config(shape))
                .unwrap_or_else(|e| panic!("rank {rank}: building the {shape:?} communicator: {e}"))
        })
        .collect();
    if processes {
        // cudarc's pool memory cannot be shared between processes: registering it is refused.
        let pool = stream.alloc_zeros::<u8>(256).unwrap();
        // SAFETY: `pool` outlives the (refused) registration.
        let refused = unsafe { comms[0].register(&pool) };
        assert!(matches!(refused, Err(Error::PeerMemory { .. })), "rank {rank}: registering pool memory: {refused:?}");
        // Nor `cuMemAlloc` memory (it would need legacy IPC, which registration does not use).
        stream.context().bind_to_thread().unwrap();
        // SAFETY: a plain allocation, freed below after the (refused) registration.
        let legacy = unsafe { cudarc::driver::result::malloc_sync(4 << 20) }.unwrap();
        // SAFETY: as above; leaked back before the free.
        let view = unsafe { stream.upgrade_device_ptr::<u8>(legacy, 4 << 20) };
        let refused = unsafe { comms[0].register(&view) };
        assert!(
            matches!(refused, Err(Error::PeerMemory { .. })),
            "rank {rank}: registering cuMemAlloc memory: {refused:?}"
        );
        view.leak();
        // SAFETY: the allocation above, unused.
        unsafe { cudarc::driver::result::free_sync(legacy) }.unwrap();
    }
    let mut memory = Vec::new();
    for case in 0..cases {
        let c = draw(seed, case, world, processes);
        let comm = &comms[c.shape];
        let got = run_case(comm, &c).unwrap_or_else(|e| {
            panic!("rank {rank} case {case} (seed {seed}) {:?} {:?}: {e}", c.spec, SHAPES[c.shape])
        });
        let want = tccl::reference(&c.spec, &c.inputs);
        if got != want[rank] {
            let at = got.iter().zip(&want[rank]).position(|(a, b)| a != b);
            panic!(
                "rank {rank} case {case} (seed {seed}) {:?} {:?}: wrong output (first wrong byte {at:?}, {} vs {} bytes)",
                c.spec,
                SHAPES[c.shape],
                got.len(),
                want[rank].len()
            );
        }
        memory.push(c.memory[rank]);
    }
    leave(&comms, processes);
    (cases, kinds_line(memory.into_iter()))
}

fn cases() -> usize {
    common::count_from_env("OXCCL_RANK_CASES", 60)
}

/// Runs `f(stream, rank)` for every rank of `world`, each on a thread of its own with a new stream
/// on `stream`'s device; their results by rank (a rank that panics fails the test, its message above).
fn on_rank_threads<T: Send + 'static>(
    stream: &Arc<CudaStream>,
    world: usize,
    f: impl Fn(&Arc<CudaStream>, usize) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let f = Arc::new(f);
    let handles: Vec<_> = (0..world)
        .map(|rank| {
            let (ctx, f) = (stream.context().clone(), f.clone());
            std::thread::spawn(move || f(&ctx.new_stream().unwrap(), rank))
        })
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().unwrap_or_else(|_| panic!("a rank of {world} threads failed (see above)")))
        .collect()
}

/// Ranks as threads of this process on one GPU, each with its own stream and communicator.
#[test]
fn threads_match_the_cpu_reference() {
    let Some(stream) = common::gpu("threads_match_the_cpu_reference") else { return };
    let seed = common::seed_from_env(0x07A2_EAD5);
    let mut total = 0;
    for world in [2, 4, 8] {
        let ids: Vec<Id> = SHAPES.iter().map(|_| Id::new().unwrap()).collect();
        let ran =
            on_rank_threads(&stream, world, move |s, rank| rank_cases(s, rank, world, &ids, cases(), seed, false));
        total += ran.iter().map(|(n, _)| n).sum::<usize>();
    }
    eprintln!("{total} rank-cases on 2, 4 and 8 threads matched the CPU reference (seed {seed})");
}

/// Whether the multi-process tests can run: MPS is up (`OXCCL_MPS=1`), else skipped loudly.
fn mps(test: &str) -> bool {
    if std::env::var_os("OXCCL_MPS").is_some_and(|v| v == "1") {
        return true;
    }
    common::skip(&format!("skipped: {test} needs MPS (processes on one GPU); set OXCCL_MPS=1 where it is up"));
    false
}

/// Runs `test` (a test of this binary) as `world` child processes, rank by rank, with `env`;
/// returns each child's exit status and output, or panics if one outlives `limit`.
fn spawn_ranks(test: &str, world: usize, env: &[(&str, String)], limit: Duration) -> Vec<(Option<i32>, String)> {
    let exe = std::env::current_exe().unwrap();
    let children: Vec<_> = (0..world)
        .map(|rank| {
            let mut cmd = Command::new(&exe);
            cmd.args(["--exact", test, "--nocapture", "--test-threads=1"])
                .env("OXCCL_TEST_RANK", rank.to_string())
                .env("OXCCL_TEST_WORLD", world.to_string())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            for (k, v) in env {
                cmd.env(k, v);
            }
            cmd.spawn().unwrap()
        })
        .collect();
    let start = Instant::now();
    let mut out = Vec::new();
    for mut c in children {
        loop {
            if let Some(status) = c.try_wait().unwrap() {
                let o = c.wait_with_output().unwrap();
                let text = format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
                out.push((status.code(), text));
                break;
            }
            if start.elapsed() > limit {
                let _ = c.kill();
                panic!("a rank process of {test} ran past {limit:?}: hung");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    out
}

/// Panics with the output of every one of `world` rank processes that failed: the first to fail
/// is often not the cause (a peer that gave up first says why).
fn check_ranks(results: &[(Option<i32>, String)], world: usize) {
    let failed: Vec<String> = results
        .iter()
        .enumerate()
        .filter(|(_, (status, _))| *status != Some(0))
        .map(|(r, (status, text))| format!("rank {r} of {world} processes failed ({status:?}):\n{text}"))
        .collect();
    assert!(failed.is_empty(), "{}", failed.join("\n"));
}

/// How a rank's process ended (its exit status, `None` if killed) and what it printed.
type RankEnd = (Option<i32>, String);

/// Runs `test`'s ranks as processes for each world of `worlds`, with `ids` fresh ids
/// (`OXCCL_TEST_IDS`) and `seed` (`OXCCL_TEST_SEED`) in their environment; checks that every rank
/// passed and returns each world with its ranks' results.
fn spawn_worlds(test: &str, worlds: &[usize], ids: usize, seed: u64) -> Vec<(usize, Vec<RankEnd>)> {
    worlds
        .iter()
        .map(|&world| {
            let ids: Vec<String> = (0..ids).map(|_| Id::new().unwrap().to_string()).collect();
            let env = [("OXCCL_TEST_IDS", ids.join(",")), ("OXCCL_TEST_SEED", seed.to_string())];
            let results = spawn_ranks(test, world, &env, Duration::from_secs(300));
            check_ranks(&results, world);
            (world, results)
        })
        .collect()
}

/// This process's rank and world where it runs as a child of [`spawn_ranks`].
fn child() -> Option<(usize, usize)> {
    let r = std::env::var("OXCCL_TEST_RANK").ok()?.parse().ok()?;
    let w = std::env::var("OXCCL_TEST_WORLD").ok()?.parse().ok()?;
    Some((r, w))
}

fn ids_from_env(var: &str) -> Vec<Id> {
    std::env::var(var).unwrap().split(',').map(|s| s.parse().unwrap()).collect()
}

/// The random cases with every rank a process of its own (2, 4 and 8 of them on the GPU).
#[test]
fn processes_match_the_cpu_reference() {
    const TEST: &str = "processes_match_the_cpu_reference";
    if let Some((rank, world)) = child() {
        let stream = oxccl::engine::probe_gpu().unwrap().new_stream().unwrap();
        let seed: u64 = std::env::var("OXCCL_TEST_SEED").unwrap().parse().unwrap();
        let (n, sym) = rank_cases(&stream, rank, world, &ids_from_env("OXCCL_TEST_IDS"), cases(), seed, true);
        println!("rank {rank}: {n} cases matched, {sym}");
        return;
    }
    if common::gpu(TEST).is_none() || !mps(TEST) {
        return;
    }
    let seed = common::seed_from_env(0xD1CE_5EED);
    let mut total = 0;
    for (world, results) in spawn_worlds(TEST, &[2, 4, 8], SHAPES.len(), seed) {
        for (_, text) in results {
            total += cases();
            eprint!(
                "{}",
                text.lines()
                    .filter(|l| l.starts_with("rank "))
                    .map(|l| format!("{world} processes, {l}\n"))
                    .collect::<String>()
            );
        }
    }
    eprintln!("{total} rank-cases on 2, 4 and 8 processes matched the CPU reference (seed {seed})");
}

/// The communicators every rank builds for the reshard tests, in this order, one [`Id`] each:
/// (mover, CTAs per rank).
const RESHARD_SHAPES: [(Mover, u32); 2] = [(Mover::Tma, 2), (Mover::Simt, 1)];

/// One reshard case, drawn alike on every rank from the seed, the world and the case number.
struct ReshardCase {
    shape: Vec<u64>,
    src: Layout,
    dst: Layout,
    /// `F32` or `I32`: the values are integers below 2^19 in magnitude, exact in both.
    dtype: DType,
    options: ReshardOptions,
    /// Index into [`RESHARD_SHAPES`].
    comm: usize,
    /// The global tensor, row-major.
    global: Vec<i32>,
    /// Per rank: element offsets of its source and destination in their allocations.
    shift: Vec<(usize, usize)>,
    /// Per rank: the memory its buffers are in.
    memory: Vec<Memory>,
    /// Per rank: whether an empty shard is passed as `None` rather than as an empty buffer.
    empty_as_none: Vec<bool>,
}

impl ReshardCase {
    fn describe(&self) -> String {
        format!(
            "shape {:?} {:?} {} -> {} with {:?} on {:?}",
            self.shape, self.dtype, self.src, self.dst, self.options, RESHARD_SHAPES[self.comm]
        )
    }
}

/// A random layout for a tensor of `dims` dims on a mesh of up to 3 axes inside ranks `0..world`
/// (as in gpu_reshard: replicas, several axes on one dim, uneven and empty shards).
fn random_layout(rng: &mut common::Rng, dims: usize, world: u32) -> Layout {
    let axes = loop {
        let n = 1 + rng.random_range(0..3) as usize;
        let axes: Vec<u32> = (0..n).map(|_| 1 + rng.random_range(0..4) as u32).collect();
        if axes.iter().product::<u32>() <= world {
            break axes;
        }
    };
    let size: u32 = axes.iter().product();
    let start = rng.random_range(0..u64::from(world - size) + 1) as u32;
    let placements = axes
        .iter()
        .map(|_| {
            if dims == 0 || rng.random_range(0..3) == 0 {
                Placement::Replicate
            } else {
                Placement::Shard(rng.random_range(0..dims as u64) as u32)
            }
        })
        .collect();
    Layout::new(Mesh::new(axes, start).unwrap(), placements).unwrap()
}

/// A small random global shape: 0 to 3 dims, sometimes a zero one, at most 16 Ki elements.
fn random_reshard_shape(rng: &mut common::Rng) -> Vec<u64> {
    let dims = rng.random_range(0..4) as usize;
    let big = rng.random_range(0..3) == 0;
    let mut shape: Vec<u64> = (0..dims)
        .map(|_| match rng.random_range(0..12) {
            0 => 0,
            _ if big => 1 + rng.random_range(0..64),
            _ => 1 + rng.random_range(0..9),
        })
        .collect();
    while shape.iter().product::<u64>() > 1 << 14 {
        let d = rng.random_range(0..shape.len() as u64) as usize;
        shape[d] = shape[d].div_ceil(2);
    }
    shape
}

fn draw_reshard(seed: u64, case: usize, world: usize, processes: bool) -> ReshardCase {
    let mut rng = common::rng(seed ^ (case as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (world as u64) << 56);
    let shape = random_reshard_shape(&mut rng);
    let src = random_layout(&mut rng, shape.len(), world as u32);
    let dst = random_layout(&mut rng, shape.len(), world as u32);
    let dtype = if rng.random_range(0..2) == 0 { DType::F32 } else { DType::I32 };
    let options = ReshardOptions {
        plan: PlanOptions {
            route: if rng.random_range(0..2) == 0 { Route::Direct } else { Route::Hierarchical },
            domain_size: 1 + rng.random_range(0..8) as u32,
            min_split_bytes: [0, 64, 4096, PlanOptions::MIN_SPLIT_BYTES, u64::MAX][rng.random_range(0..5) as usize],
        },
        owner: [CtaOwner::Reader, CtaOwner::Writer, CtaOwner::Balanced][rng.random_range(0..3) as usize],
    };
    let comm = rng.random_range(0..RESHARD_SHAPES.len() as u64) as usize;
    let n: u64 = shape.iter().product();
    let global = (0..n).map(|_| rng.random_range(-(1 << 19)..1 << 19)).collect();
    let shifted = rng.random_range(0..3) == 0;
    let shift = (0..world)
        .map(|_| if shifted { (rng.random_range(0..9) as usize, rng.random_range(0..9) as usize) } else { (0, 0) })
        .collect();
    let memory = draw_memory(&mut rng, world, processes);
    let empty_as_none = (0..world).map(|_| rng.random_range(0..2) == 0).collect();
    ReshardCase { shape, src, dst, dtype, options, comm, global, shift, memory, empty_as_none }
}

/// `values` as little-endian elements of `dtype` (`F32` or `I32`).
fn element_bytes(dtype: DType, values: &[i32]) -> Vec<u8> {
    match dtype {
        DType::F32 => values.iter().flat_map(|&v| (v as f32).to_le_bytes()).collect(),
        DType::I32 => values.iter().flat_map(|&v| v.to_le_bytes()).collect(),
        other => unreachable!("the reshard cases draw F32 or I32, not {other:?}"),
    }
}

/// This rank's reshard call on its own buffers, as elements of `T`.
fn reshard_as<T: Element>(
    comm: &Comm,
    c: &ReshardCase,
    input: Option<&Placed>,
    output: Option<&mut Placed>,
) -> Result<(), Error> {
    let src = input.map(|b| b.view::<T>());
    let mut whole = output.map(|b| b.whole_mut::<T>());
    let mut dst = whole.as_mut().map(|(w, range)| w.slice_mut(range.clone()));
    comm.reshard(src.as_ref(), dst.as_mut(), &c.shape, &c.src, &c.dst, &c.options)
}

/// What rank `r` passes in case `c`, as bytes: its source shard and the destination shard it
/// receives, each cut from the global tensor by the host's reference (`Sharding::local_shards`);
/// `None` outside that side's mesh, and for an empty shard where the case says so.
fn rank_shards(c: &ReshardCase, r: usize) -> (Option<Vec<u8>>, Option<Vec<u8>>) {
    let shard = |layout: &Layout| -> Option<Vec<u8>> {
        let mut shards = layout.on(&c.shape).unwrap().local_shards(&c.global).unwrap();
        let mine = shards.remove(&(r as u32)).map(|s| element_bytes(c.dtype, &s));
        mine.filter(|b| !(b.is_empty() && c.empty_as_none[r]))
    };
    (shard(&c.src), shard(&c.dst))
}

/// Runs reshard case `c` on this rank, passing only its own shards ([`rank_shards`]); checks its
/// destination shard against the global tensor's, its source left as it was, and the bytes around
/// both untouched. Panics naming `what` on a wrong result; returns the call's error.
fn run_reshard_case(comm: &Comm, c: &ReshardCase, what: &str) -> Result<(), Error> {
    let r = comm.rank();
    let (src, want) = rank_shards(c, r);
    let size = c.dtype.size();
    let (shift_in, shift_out) = c.shift[r];
    let input = src.as_ref().map(|b| Placed::new(comm, c.memory[r], b, shift_in * size));
    // The destination starts as MARK bytes: no element of the global tensor is 0xA5A5A5A5 in
    // either type, so an element the call leaves unwritten is found.
    let mut output = want.as_ref().map(|w| Placed::new(comm, c.memory[r], &vec![MARK; w.len()], shift_out * size));
    match c.dtype {
        DType::F32 => reshard_as::<f32>(comm, c, input.as_ref(), output.as_mut()),
        DType::I32 => reshard_as::<i32>(comm, c, input.as_ref(), output.as_mut()),
        other => unreachable!("the reshard cases draw F32 or I32, not {other:?}"),
    }?;
    comm.synchronize()?;
    let stream = comm.stream();
    if let (Some(b), Some(s)) = (&input, &src) {
        let after = b.read(stream, &format!("{what}: rank {r}'s source"));
        assert!(after == *s, "{what}: the call wrote rank {r}'s source");
    }
    if let (Some(b), Some(w)) = (&output, &want) {
        let got = b.read(stream, &format!("{what}: rank {r}'s destination"));
        if let Some(at) = got.iter().zip(w).position(|(a, b)| a != b) {
            panic!(
                "{what}: rank {r}'s destination shard differs from the global tensor's (first wrong byte {at} of {})",
                w.len()
            );
        }
    }
    Ok(())
}

/// One rank's part of the reshard cases: builds its communicators (one per entry of
/// [`RESHARD_SHAPES`], from `ids`) on `stream` and runs `cases` cases. Returns how many ran, and of
/// on this rank the kinds of memory they were on ([`kinds_line`]).
fn reshard_rank_cases(
    stream: &Arc<CudaStream>,
    rank: usize,
    world: usize,
    ids: &[Id],
    cases: usize,
    seed: u64,
    processes: bool,
) -> (usize, String) {
    assert_eq!(ids.len(), RESHARD_SHAPES.len(), "one id per reshard communicator");
    let comms: Vec<Comm> = RESHARD_SHAPES
        .iter()
        .zip(ids)
        .map(|(&(mover, ctas), id)| {
            Comm::from_rank(stream, rank, world, id, config((mover, Reduction::Registers, ctas)))
                .unwrap_or_else(|e| panic!("rank {rank}: building the {mover:?} communicator: {e}"))
        })
        .collect();
    let mut memory = Vec::new();
    for case in 0..cases {
        let c = draw_reshard(seed, case, world, processes);
        let what = format!("rank {rank} of {world}, reshard case {case} (seed {seed}): {}", c.describe());
        run_reshard_case(&comms[c.comm], &c, &what).unwrap_or_else(|e| panic!("{what}: {e}"));
        memory.push(c.memory[rank]);
    }
    leave(&comms, processes);
    (cases, kinds_line(memory.into_iter()))
}

fn reshard_cases() -> usize {
    common::count_from_env("OXCCL_RANK_RESHARD_CASES", 40)
}

/// The default seeds of the thread and process reshard tests (`OXCCL_SEED` overrides both).
const THREAD_RESHARD_SEED: u64 = 0x5E5A_4D07;
const PROCESS_RESHARD_SEED: u64 = 0x5E5A_4D08;

/// The reshard cases of both tests, checked without a GPU: every rank's own call (its entries only)
/// passes the call's validation for a communicator driving that rank alone, and the lowered plan,
/// run by the CPU executor on the shards the ranks pass, gives every rank the shard it is checked
/// against. A GPU failure of those tests then points at the device path, not at the cases.
#[test]
fn reshard_cases_are_valid_per_rank_on_the_cpu() {
    use oxccl::host::reshard::{LowerOptions, lower, plan};
    use oxccl::reshard::{Side, validate_local};
    use oxccl_kernels::abi::slot;
    let mut checked = 0;
    let seeds =
        [(common::seed_from_env(THREAD_RESHARD_SEED), false), (common::seed_from_env(PROCESS_RESHARD_SEED), true)];
    for (seed, processes) in seeds {
        for world in [4, 8] {
            for case in 0..reshard_cases() {
                let c = draw_reshard(seed, case, world, processes);
                let what = format!("{world} ranks, reshard case {case} (seed {seed}): {}", c.describe());
                let e = c.dtype.size();
                let shards: Vec<_> = (0..world).map(|r| rank_shards(&c, r)).collect();
                for (r, (src, dst)) in shards.iter().enumerate() {
                    let only = |b: &Option<Vec<u8>>| -> Vec<Option<usize>> {
                        (0..world).map(|q| if q == r { b.as_ref().map(|b| b.len() / e) } else { None }).collect()
                    };
                    let (sl, dl) = (only(src), only(dst));
                    let side = |layout, buffers| Side { shape: &c.shape, elem_bytes: e as u64, layout, buffers };
                    validate_local(world, &[r], &side(&c.src, &sl), &side(&c.dst, &dl))
                        .unwrap_or_else(|err| panic!("{what}: rank {r}'s call: {err}"));
                }
                let p = plan(&c.shape, e as u64, &c.src, &c.dst, c.options.plan).unwrap();
                let (_, ctas) = RESHARD_SHAPES[c.comm];
                let opts =
                    LowerOptions { owner: c.options.owner, dtype: Some(c.dtype), ..LowerOptions::new(world, ctas) };
                let l = lower(&p, &opts).unwrap_or_else(|err| panic!("{what}: {err}"));
                l.check_races().unwrap_or_else(|err| panic!("{what}: {err}"));
                let mut bufs = l.host_buffers();
                for (r, (src, _)) in shards.iter().enumerate() {
                    if let Some(s) = src {
                        bufs[r][slot::INPUT as usize] = s.clone();
                    }
                }
                l.execute(&mut bufs).unwrap_or_else(|err| panic!("{what}: {err}"));
                for (r, (_, want)) in shards.iter().enumerate() {
                    if let Some(w) = want {
                        assert!(bufs[r][slot::OUTPUT as usize] == *w, "{what}: rank {r}'s destination differs");
                    }
                }
                checked += 1;
            }
        }
    }
    eprintln!("{checked} reshard cases valid per rank and exact on the CPU executor");
}

/// Reshards with ranks as threads of this process on one GPU (4 and 8 of them), each with its own
/// stream and communicators, each passing only its own shards.
#[test]
fn threads_reshard_matches_the_global_tensor() {
    let Some(stream) = common::gpu("threads_reshard_matches_the_global_tensor") else { return };
    let seed = common::seed_from_env(THREAD_RESHARD_SEED);
    let mut total = 0;
    for world in [4, 8] {
        let ids: Vec<Id> = RESHARD_SHAPES.iter().map(|_| Id::new().unwrap()).collect();
        let ran = on_rank_threads(&stream, world, move |s, rank| {
            reshard_rank_cases(s, rank, world, &ids, reshard_cases(), seed, false)
        });
        total += ran.iter().map(|(n, _)| n).sum::<usize>();
    }
    eprintln!("{total} rank-reshards on 4 and 8 threads matched the global tensor (seed {seed})");
}

/// The reshard cases with every rank a process of its own (4 and 8 of them on the GPU), each
/// rank's buffers symmetric, registered or cudarc's (staged) per case.
#[test]
fn processes_reshard_matches_the_global_tensor() {
    const TEST: &str = "processes_reshard_matches_the_global_tensor";
    if let Some((rank, world)) = child() {
        let stream = oxccl::engine::probe_gpu().unwrap().new_stream().unwrap();
        let seed: u64 = std::env::var("OXCCL_TEST_SEED").unwrap().parse().unwrap();
        let ids = ids_from_env("OXCCL_TEST_IDS");
        let (n, sym) = reshard_rank_cases(&stream, rank, world, &ids, reshard_cases(), seed, true);
        println!("rank {rank}: {n} reshards matched, {sym}");
        return;
    }
    if common::gpu(TEST).is_none() || !mps(TEST) {
        return;
    }
    let seed = common::seed_from_env(PROCESS_RESHARD_SEED);
    let mut total = 0;
    for (world, results) in spawn_worlds(TEST, &[4, 8], RESHARD_SHAPES.len(), seed) {
        for (_, text) in results {
            total += reshard_cases();
            eprint!(
                "{}",
                text.lines()
                    .filter(|l| l.starts_with("rank "))
                    .map(|l| format!("{world} processes, {l}\n"))
                    .collect::<String>()
            );
        }
    }
    eprintln!("{total} rank-reshards on 4 and 8 processes matched the global tensor (seed {seed})");
}

/// The programs every rank of `world` runs: the ring AllReduce; with 8 ranks also the
/// hierarchical-mesh AllReduce (2×4) and two MSCCL files (an AllToAll, and an in-place AllReduce
/// with scratch slots).
fn rank_plans(world: usize) -> Vec<(String, Program)> {
    let mut v =
        vec![(format!("ring-allreduce 1x{world}"), Algorithm::RingAllReduce.generate(1, world as u32).unwrap())];
    if world == 8 {
        let mut hm = Algorithm::HmAllReduce.generate(2, 4).unwrap();
        hm.ranks_per_node = Some(4);
        v.push(("hm-allreduce 2x4".into(), hm));
        for file in ["ndv4_a2a2ll.xml", "ndv4_ap-1pass.xml"] {
            let xml = std::fs::read_to_string(common::msccl_dir().join(file)).unwrap();
            v.push((file.into(), msccl::import(&xml).unwrap().program));
        }
    }
    v
}

/// One run of `program` on the collective engine by this rank (`Comm::run_program`), on cudarc
/// buffers holding `cpu`'s inputs for it in its `(send, recv)` slots (the same slot in place); the
/// output.
fn run_rank_program<T: Element + bytemuck::Pod>(
    stream: &Arc<CudaStream>,
    comm: &Comm,
    program: &Program,
    cpu: &HostBuffers,
    rank: usize,
    (send_slot, recv_slot): (usize, usize),
) -> Result<Vec<u8>, Error> {
    let send = stream.clone_htod(&bytemuck::pod_collect_to_vec::<u8, T>(&cpu[rank][send_slot])).unwrap();
    let mut recv = stream.clone_htod(&bytemuck::pod_collect_to_vec::<u8, T>(&cpu[rank][recv_slot])).unwrap();
    if program.layout.in_place {
        comm.run_program_in_place(program, &mut recv, oxccl::ReduceOp::Sum)?;
    } else {
        comm.run_program(program, &send, &mut recv, oxccl::ReduceOp::Sum)?;
    }
    comm.synchronize()?;
    Ok(bytemuck::cast_slice(&stream.clone_dtoh(&recv).unwrap()).to_vec())
}

/// This rank's part of every program of [`rank_plans`] on the collective engine (`Comm::run_program`),
/// f32 and i32 at two chunk sizes, each twice on this rank's own cudarc buffers, against the CPU
/// executor's run of the same lowering for every rank (one with scratch chunks, in staging memory
/// across processes); then a program for another rank count, refused. Returns the runs that
/// matched.
fn rank_plan_cases(stream: &Arc<CudaStream>, rank: usize, world: usize, id: &Id, seed: u64) -> usize {
    let comm =
        Comm::from_rank(stream, rank, world, id, Config::default()).unwrap_or_else(|e| panic!("rank {rank}: {e}"));
    let mut rng = common::rng(seed);
    let mut matched = 0;
    for (name, program) in rank_plans(world) {
        let slots = if program.layout.in_place { (slot::OUTPUT, slot::OUTPUT) } else { (slot::INPUT, slot::OUTPUT) };
        let slots = (slots.0 as usize, slots.1 as usize);
        for dtype in [DType::F32, DType::I32] {
            for chunk_bytes in [4096u64, 8208] {
                let what = format!("{name} on the engine {} {chunk_bytes} B chunks", dtype.nccl_name());
                let staged = lower_direct(&program, &DirectOptions::new(chunk_bytes, dtype, 1))
                    .unwrap_or_else(|e| panic!("{what}: {e}"));
                let mut cpu = staged.host_buffers();
                for k in 0..2 {
                    // The same inputs on every rank (one seed): each runs the whole program on the CPU.
                    for bufs in cpu.iter_mut() {
                        for s in [slots.0, slots.1] {
                            bufs[s] = common::small_integers(dtype, bufs[s].len(), &mut rng);
                        }
                    }
                    let got = match dtype {
                        DType::F32 => run_rank_program::<f32>(stream, &comm, &program, &cpu, rank, slots),
                        _ => run_rank_program::<i32>(stream, &comm, &program, &cpu, rank, slots),
                    };
                    let got = got.unwrap_or_else(|e| panic!("rank {rank}: {what} run {k}: {e}"));
                    staged.execute(&mut cpu).unwrap_or_else(|e| panic!("{what}: the CPU executor: {e}"));
                    assert!(got == cpu[rank][slots.1], "rank {rank}: {what} run {k}: output differs");
                    matched += 1;
                }
            }
        }
    }
    // A program for another rank count, refused before anything is exchanged.
    let half = Algorithm::RingAllReduce.generate(1, if world == 2 { 4 } else { 2 }).unwrap();
    let mut buf = stream.alloc_zeros::<f32>(64).unwrap();
    let e = if half.layout.in_place {
        comm.run_program_in_place(&half, &mut buf, oxccl::ReduceOp::Sum).unwrap_err()
    } else {
        comm.run_program(&half, &buf.clone(), &mut buf, oxccl::ReduceOp::Sum).unwrap_err()
    };
    assert!(matches!(e, Error::Config { field: "program", .. }), "rank {rank}: {e}");
    matched
}

/// Transfer programs per rank, with ranks as threads of this process (4 and 8 of them).
#[test]
fn threads_run_programs() {
    let Some(stream) = common::gpu("threads_run_programs") else { return };
    let seed = common::seed_from_env(0x91A4_5EED);
    let mut total = 0;
    for world in [4, 8] {
        let id = Id::new().unwrap();
        total += on_rank_threads(&stream, world, move |s, rank| rank_plan_cases(s, rank, world, &id, seed))
            .iter()
            .sum::<usize>();
    }
    eprintln!("{total} rank-runs of programs on the engine on 4 and 8 threads matched the CPU executor (seed {seed})");
}

/// Transfer programs per rank, every rank a process of its own (4 and 8 of them, under MPS).
#[test]
fn processes_run_programs() {
    const TEST: &str = "processes_run_programs";
    if let Some((rank, world)) = child() {
        let stream = oxccl::engine::probe_gpu().unwrap().new_stream().unwrap();
        let seed: u64 = std::env::var("OXCCL_TEST_SEED").unwrap().parse().unwrap();
        let n = rank_plan_cases(&stream, rank, world, &ids_from_env("OXCCL_TEST_IDS")[0], seed);
        println!("rank {rank}: {n} plan runs matched");
        return;
    }
    if common::gpu(TEST).is_none() || !mps(TEST) {
        return;
    }
    let seed = common::seed_from_env(0x91A4_5EEE);
    let mut total = 0;
    for (_, results) in spawn_worlds(TEST, &[4, 8], 1, seed) {
        for (_, text) in results {
            total += text
                .lines()
                .find_map(|l| l.split(": ").nth(1)?.strip_suffix(" plan runs matched")?.parse::<usize>().ok())
                .unwrap_or(0);
        }
    }
    eprintln!(
        "{total} rank-runs of programs on the engine on 4 and 8 processes matched the CPU executor (seed {seed})"
    );
}

/// A rank killed (SIGKILL) while its peers are in a call: each survivor's call ends within its
/// timeouts in a typed error naming the dead rank, and the survivors build a new communicator
/// among themselves that works.
#[test]
fn a_killed_rank_leaves_its_peers_a_typed_error() {
    const TEST: &str = "a_killed_rank_leaves_its_peers_a_typed_error";
    const VICTIM: usize = 2;
    if let Some((rank, world)) = child() {
        let stream = oxccl::engine::probe_gpu().unwrap().new_stream().unwrap();
        let ids = ids_from_env("OXCCL_TEST_IDS");
        let cfg = Config { timeout: Duration::from_secs(2), ..Config::default() };
        let comm = Comm::from_rank(&stream, rank, world, &ids[0], cfg.clone()).unwrap();
        let n = 1 << 20;
        let mut buf = comm.alloc_symmetric::<f32>(n).unwrap();
        stream.memcpy_htod(&vec![1.0f32; n], &mut *buf).unwrap();
        comm.all_reduce_in_place(&mut *buf, ReduceOp::Sum).unwrap();
        comm.synchronize().unwrap();
        if rank == VICTIM {
            // The others are in (or entering) the next call.
            std::thread::sleep(Duration::from_millis(300));
            // SAFETY: ends this process at once, as a crash or an OOM kill would.
            unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
            unreachable!();
        }
        let start = Instant::now();
        let e = comm
            .all_reduce_in_place(&mut *buf, ReduceOp::Sum)
            .and_then(|()| comm.synchronize())
            .expect_err("a call with a dead peer succeeded");
        let named = match &e {
            Error::Timeout { peer, .. } | Error::PeerAborted { peer, .. } | Error::OutOfStep { peer, .. } => {
                *peer as usize == VICTIM
            }
            _ => false,
        };
        println!("rank {rank}: after {:?}: {e}", start.elapsed());
        assert!(
            named || matches!(e, Error::PeerAborted { .. }),
            "rank {rank}: the error does not name rank {VICTIM}: {e}"
        );
        drop(buf);
        drop(comm);
        // The survivors, renumbered, in a new communicator.
        let survivors = world - 1;
        let new_rank = if rank > VICTIM { rank - 1 } else { rank };
        let comm = Comm::from_rank(&stream, new_rank, survivors, &ids[1], cfg).unwrap();
        let mut x = stream.clone_htod(&vec![1.0f32; 4096]).unwrap();
        comm.all_reduce_in_place(&mut x, ReduceOp::Sum).unwrap();
        comm.synchronize().unwrap();
        assert_eq!(stream.clone_dtoh(&x).unwrap()[4095], survivors as f32);
        println!("rank {rank}: the survivors' new communicator works");
        return;
    }
    if common::gpu(TEST).is_none() || !mps(TEST) {
        return;
    }
    let world = 4;
    let ids: Vec<String> = (0..2).map(|_| Id::new().unwrap().to_string()).collect();
    let env = [("OXCCL_TEST_IDS", ids.join(","))];
    let results = spawn_ranks(TEST, world, &env, Duration::from_secs(60));
    for (rank, (status, text)) in results.iter().enumerate() {
        if rank == VICTIM {
            assert_eq!(*status, None, "the victim was not killed:\n{text}");
            continue;
        }
        assert_eq!(*status, Some(0), "survivor {rank} failed:\n{text}");
        eprint!("{text}");
    }
}

/// Without MPS, processes sharing the GPU cannot run their kernels side by side: a call still ends
/// (results, or a typed error) within its bounded waits, never hangs. Run where MPS is off, with
/// `OXCCL_NO_MPS=1`.
#[test]
fn processes_without_mps_end() {
    const TEST: &str = "processes_without_mps_end";
    if let Some((rank, world)) = child() {
        let stream = oxccl::engine::probe_gpu().unwrap().new_stream().unwrap();
        let ids = ids_from_env("OXCCL_TEST_IDS");
        let cfg = Config { timeout: Duration::from_secs(2), ..Config::default() };
        let comm = Comm::from_rank(&stream, rank, world, &ids[0], cfg).unwrap();
        let mut x = comm.alloc_symmetric::<f32>(1 << 20).unwrap();
        let r = comm.all_reduce_in_place(&mut *x, ReduceOp::Sum).and_then(|()| comm.synchronize());
        println!(
            "rank {rank}: {}",
            match r {
                Ok(()) => "the call completed".to_string(),
                Err(e) => format!("typed error: {e}"),
            }
        );
        return;
    }
    if std::env::var_os("OXCCL_NO_MPS").is_none_or(|v| v != "1") {
        common::skip("skipped: processes_without_mps_end runs where MPS is off (OXCCL_NO_MPS=1)");
        return;
    }
    if common::gpu(TEST).is_none() {
        return;
    }
    let env = [("OXCCL_TEST_IDS", Id::new().unwrap().to_string())];
    for (rank, (status, text)) in spawn_ranks(TEST, 2, &env, Duration::from_secs(60)).into_iter().enumerate() {
        assert_eq!(status, Some(0), "rank {rank} failed:\n{text}");
        eprint!("{text}");
    }
}

/// Misuse on per-rank communicators (threads): calls that differ between ranks, configurations
/// that differ, roots out of range, a missing root buffer.
#[test]
fn per_rank_misuse_is_a_typed_error() {
    let Some(stream) = common::gpu("per_rank_misuse_is_a_typed_error") else { return };
    let ctx = stream.context().clone();
    let run = |configs: [Config; 2], f: fn(&Comm) -> Result<(), Error>| -> Vec<Result<(), Error>> {
        let id = Id::new().unwrap();
        let hs: Vec<_> = (0..2)
            .map(|rank| {
                let (ctx, cfg) = (ctx.clone(), configs[rank].clone());
                std::thread::spawn(move || {
                    let s = ctx.new_stream().unwrap();
                    let comm = Comm::from_rank(&s, rank, 2, &id, cfg)?;
                    f(&comm)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    };
    let quick = Config { timeout: Duration::from_secs(2), ..Config::default() };
    // Rank 0 reduces 1000 elements, rank 1 2000: both stop before moving anything.
    let got = run([quick.clone(), quick.clone()], |c| {
        let n = 1000 * (c.rank() + 1);
        let mut x = c.stream().clone_htod(&vec![1.0f32; n]).unwrap();
        c.all_reduce_in_place(&mut x, ReduceOp::Sum)?;
        c.synchronize()
    });
    for (rank, r) in got.iter().enumerate() {
        assert!(matches!(r, Err(Error::CallMismatch { peer, .. }) if *peer as usize == 1 - rank), "rank {rank}: {r:?}");
    }
    // Different configurations: refused when the communicator is built, naming the other rank.
    let other = Config { mover: Mover::Simt, ..quick.clone() };
    let got = run([quick.clone(), other], |_| Ok(()));
    for (rank, r) in got.iter().enumerate() {
        assert!(
            matches!(r, Err(Error::Mismatch { field: "config", rank: q, .. }) if *q == 1 - rank),
            "rank {rank}: {r:?}"
        );
    }
    let got = run([quick.clone(), quick.clone()], |c| {
        let x = c.stream().clone_htod(&[1.0f32; 16]).unwrap();
        let mut y = c.stream().alloc_zeros::<f32>(16).unwrap();
        let e = c.broadcast(Some(&x), &mut y, 2).unwrap_err();
        assert!(matches!(e, Error::NoSuchRank { rank: 2, ranks: 2 }), "{e}");
        if c.rank() == 0 {
            let e = c.broadcast::<f32, CudaSlice<f32>, _>(None, &mut y, 0).unwrap_err();
            assert!(matches!(e, Error::MissingBuffer { .. }), "{e}");
        }
        Ok(())
    });
    assert!(got.iter().all(Result::is_ok), "{got:?}");
    // A rank that leaves (aborts, or drops its communicator) while its peer waits for a call it will
    // never make: the peer stops with `Withdrawn`, not at its timeout (a minute, which would end the
    // call as `Timeout`).
    let patient = Config { timeout: Duration::from_secs(60), ..Config::default() };
    fn call(c: &Comm) -> Result<(), Error> {
        let mut x = c.stream().clone_htod(&[1.0f32; 64]).unwrap();
        c.all_reduce_in_place(&mut x, ReduceOp::Sum)?;
        c.synchronize()
    }
    let aborted = run([patient.clone(), patient.clone()], |c| match c.rank() {
        1 => {
            c.abort();
            Ok(())
        }
        _ => call(c),
    });
    // Rank 1 returns at once: its communicator drops.
    let dropped = run([patient.clone(), patient.clone()], |c| if c.rank() == 1 { Ok(()) } else { call(c) });
    for got in [aborted, dropped] {
        assert!(got[1].is_ok(), "{:?}", got[1]);
        assert!(matches!(got[0], Err(Error::Withdrawn { peer: 1, .. })), "rank 0: {:?}", got[0]);
    }
}

/// The communicators of the point-to-point tests, one [`Id`] each: (mover, reduction, CTAs per
/// rank; 0: the communicator's choice).
const P2P_SHAPES: [(Mover, Reduction, u32); 2] =
    [(Mover::Tma, Reduction::Registers, 0), (Mover::Simt, Reduction::Registers, 2)];

/// One point-to-point case, drawn alike on every rank: a group of transfers (source, destination,
/// bytes; a rank to itself among them) that each rank issues in this order, or an AllToAllv of
/// `counts[s][d]` elements.
struct P2pCase {
    transfers: Vec<(usize, usize, usize)>,
    all_to_allv: Option<Vec<Vec<usize>>>,
    /// Bytes per element: 1 (`u8`) or 4 (`u32`).
    unit: usize,
    /// Index into [`P2P_SHAPES`].
    shape: usize,
    /// Per rank: the memory its buffers are in, and their byte offset in their allocations.
    memory: Vec<Memory>,
    head: Vec<usize>,
}

fn draw_p2p(seed: u64, case: usize, world: usize, processes: bool) -> P2pCase {
    let mut rng = common::rng(seed ^ (case as u64).wrapping_mul(0xA24B_AED4_963E_E407));
    let unit = if rng.random_range(0..2) == 0 { 1 } else { 4 };
    let len = |rng: &mut common::Rng| {
        let elems = match rng.random_range(0..4) {
            0 => 0,
            1 => rng.random_range(1..300),
            2 => rng.random_range(300..20_000),
            _ => rng.random_range(20_000..600_000),
        };
        elems as usize * unit
    };
    let (transfers, all_to_allv) = if rng.random_range(0..3) == 0 {
        let counts = (0..world).map(|_| (0..world).map(|_| len(&mut rng) / unit).collect()).collect();
        (Vec::new(), Some(counts))
    } else {
        let n = rng.random_range(1..=2 * world as u32) as usize;
        let t = (0..n)
            .map(|_| {
                let (s, d) = (rng.random_range(0..world as u32) as usize, rng.random_range(0..world as u32) as usize);
                (s, d, len(&mut rng))
            })
            .collect();
        (t, None)
    };
    P2pCase {
        transfers,
        all_to_allv,
        unit,
        shape: rng.random_range(0..P2P_SHAPES.len() as u32) as usize,
        memory: draw_memory(&mut rng, world, processes),
        head: (0..world).map(|_| unit * rng.random_range(0..64) as usize).collect(),
    }
}

/// What transfer `t` of case `case` carries: `bytes` bytes that differ from transfer to transfer.
fn payload(case: usize, t: usize, bytes: usize) -> Vec<u8> {
    (0..bytes).map(|i| ((case * 131 + t * 7919 + i * 31 + i / 251) % 251) as u8).collect()
}

/// Runs point-to-point case `case` on this rank and checks what it received (and that it left
/// what it sent, and the bytes around every buffer, as they were).
fn run_p2p_case(comm: &Comm, c: &P2pCase, case: usize) -> Result<(), Error> {
    let (me, world) = (comm.rank(), comm.world());
    let (mem, head) = (c.memory[me], c.head[me]);
    let stream = comm.stream().clone();
    let what = |w: &str| format!("case {case} rank {me}: {w}");
    if let Some(counts) = &c.all_to_allv {
        let block = |s: usize, d: usize| payload(case, s * world + d, counts[s][d] * c.unit);
        let send: Vec<u8> = (0..world).flat_map(|d| block(me, d)).collect();
        let want: Vec<u8> = (0..world).flat_map(|s| block(s, me)).collect();
        let send_counts: Vec<usize> = counts[me].clone();
        let recv_counts: Vec<usize> = (0..world).map(|s| counts[s][me]).collect();
        let sent = Placed::new(comm, mem, &send, head);
        let mut recv = Placed::new(comm, mem, &vec![0u8; want.len()], head);
        macro_rules! call {
            ($t:ty) => {{
                let s = sent.view::<$t>();
                let (mut w, r) = recv.whole_mut::<$t>();
                let mut r = w.slice_mut(r);
                comm.all_to_allv(&s, &send_counts, &mut r, &recv_counts)
            }};
        }
        if c.unit == 4 { call!(u32) } else { call!(u8) }?;
        comm.synchronize()?;
        assert!(
            recv.read(&stream, &what("all_to_allv receive")) == want,
            "{}: wrong bytes received",
            what("all_to_allv")
        );
        assert!(
            sent.read(&stream, &what("all_to_allv send")) == send,
            "{}: the send buffer changed",
            what("all_to_allv")
        );
        return Ok(());
    }
    let sends: Vec<(usize, Placed)> = c
        .transfers
        .iter()
        .enumerate()
        .filter(|(_, t)| t.0 == me)
        .map(|(t, &(_, _, b))| (t, Placed::new(comm, mem, &payload(case, t, b), head)))
        .collect();
    let mut recvs: Vec<(usize, Placed)> = c
        .transfers
        .iter()
        .enumerate()
        .filter(|(_, t)| t.1 == me)
        .map(|(t, &(_, _, b))| (t, Placed::new(comm, mem, &vec![0u8; b], head)))
        .collect();
    macro_rules! call {
        ($t:ty) => {{
            let send_views: Vec<_> = sends.iter().map(|(_, p)| p.view::<$t>()).collect();
            let mut wholes: Vec<_> = recvs.iter_mut().map(|(_, p)| p.whole_mut::<$t>()).collect();
            let mut recv_views: Vec<_> = wholes.iter_mut().map(|(w, r)| w.slice_mut(r.clone())).collect();
            let (mut si, mut ri) = (send_views.iter(), recv_views.iter_mut());
            let mut g = comm.group();
            for &(s, d, _) in &c.transfers {
                if s == me {
                    g.send(si.next().unwrap(), d)?;
                }
                if d == me {
                    g.recv(ri.next().unwrap(), s)?;
                }
            }
            g.run()
        }};
    }
    if c.unit == 4 { call!(u32) } else { call!(u8) }?;
    comm.synchronize()?;
    for (t, p) in &recvs {
        let got = p.read(&stream, &what(&format!("transfer {t}'s receive buffer")));
        assert!(
            got == payload(case, *t, got.len()),
            "{}: wrong bytes",
            what(&format!("transfer {t} {:?}", c.transfers[*t]))
        );
    }
    for (t, p) in &sends {
        let got = p.read(&stream, &what(&format!("transfer {t}'s send buffer")));
        assert!(got == payload(case, *t, got.len()), "{}: the send buffer changed", what(&format!("transfer {t}")));
    }
    Ok(())
}

/// One rank's part of the point-to-point cases (communicators from `ids`, one per [`P2P_SHAPES`]);
/// returns how many ran and how many bytes this rank received.
fn p2p_rank_cases(
    stream: &Arc<CudaStream>,
    rank: usize,
    world: usize,
    ids: &[Id],
    cases: usize,
    seed: u64,
    processes: bool,
) -> (usize, usize) {
    let comms: Vec<Comm> = P2P_SHAPES
        .iter()
        .zip(ids)
        .map(|(&shape, id)| Comm::from_rank(stream, rank, world, id, config(shape)).unwrap())
        .collect();
    let mut received = 0;
    for case in 0..cases {
        let c = draw_p2p(seed, case, world, processes);
        run_p2p_case(&comms[c.shape], &c, case).unwrap_or_else(|e| {
            panic!("rank {rank} case {case} (seed {seed}) {:?} {:?}: {e}", c.transfers, P2P_SHAPES[c.shape])
        });
        received += match &c.all_to_allv {
            Some(counts) => (0..world).map(|s| counts[s][rank] * c.unit).sum::<usize>(),
            None => c.transfers.iter().filter(|t| t.1 == rank).map(|t| t.2).sum(),
        };
    }
    leave(&comms, processes);
    (cases, received)
}

/// Sends, receives, groups of them and AllToAllv between ranks on threads of this process, exact.
#[test]
fn threads_send_and_receive_exactly() {
    let Some(stream) = common::gpu("threads_send_and_receive_exactly") else { return };
    let seed = common::seed_from_env(0x5E4D_0B0E);
    let (mut total, mut bytes) = (0, 0);
    for world in [2, 3, 8] {
        let ids: Vec<Id> = P2P_SHAPES.iter().map(|_| Id::new().unwrap()).collect();
        let ran =
            on_rank_threads(&stream, world, move |s, rank| p2p_rank_cases(s, rank, world, &ids, cases(), seed, false));
        total += ran.iter().map(|r| r.0).sum::<usize>();
        bytes += ran.iter().map(|r| r.1).sum::<usize>();
    }
    eprintln!(
        "{total} rank-cases of send/recv groups and AllToAllv on 2, 3 and 8 threads exact, {bytes} bytes received (seed {seed})"
    );
}

/// The same with every rank a process of its own (buffers of every kind).
#[test]
fn processes_send_and_receive_exactly() {
    const TEST: &str = "processes_send_and_receive_exactly";
    if let Some((rank, world)) = child() {
        let stream = oxccl::engine::probe_gpu().unwrap().new_stream().unwrap();
        let seed: u64 = std::env::var("OXCCL_TEST_SEED").unwrap().parse().unwrap();
        let (n, bytes) = p2p_rank_cases(&stream, rank, world, &ids_from_env("OXCCL_TEST_IDS"), cases(), seed, true);
        println!("rank {rank}: {n} cases exact, {bytes} bytes received");
        return;
    }
    if common::gpu(TEST).is_none() || !mps(TEST) {
        return;
    }
    let seed = common::seed_from_env(0x5E4D_9C0C);
    let mut total = 0;
    for (world, _) in spawn_worlds(TEST, &[2, 4, 8], P2P_SHAPES.len(), seed) {
        total += world * cases();
    }
    eprintln!("{total} rank-cases of send/recv groups and AllToAllv on 2, 4 and 8 processes exact (seed {seed})");
}

/// Transfers that do not match: typed errors on both ends, nothing hangs.
#[test]
fn unmatched_transfers_are_typed_errors() {
    let Some(stream) = common::gpu("unmatched_transfers_are_typed_errors") else { return };
    let quick = Config { timeout: Duration::from_secs(2), ..Config::default() };
    let id = Id::new().unwrap();
    // Rank 0 sends 256 bytes, rank 1 expects 512: both stop before anything moves.
    let got = on_rank_threads(&stream, 2, move |s, rank| {
        let comm = Comm::from_rank(s, rank, 2, &id, quick.clone()).unwrap();
        // Host-side refusals first: no such peer; a receive from itself without its send.
        let mut y = s.alloc_zeros::<u8>(16).unwrap();
        assert!(matches!(comm.send(&y, 2), Err(Error::NoSuchRank { rank: 2, ranks: 2 })));
        assert!(matches!(comm.recv(&mut y, rank), Err(Error::BufferCount { .. })));
        let r = if rank == 0 {
            let x = s.clone_htod(&[7u8; 256]).unwrap();
            comm.send(&x, 1)
        } else {
            let mut x = s.alloc_zeros::<u8>(512).unwrap();
            comm.recv(&mut x, 0)
        };
        r.and_then(|_| comm.synchronize())
    });
    for (rank, r) in got.iter().enumerate() {
        assert!(matches!(r, Err(Error::CallMismatch { peer, .. }) if *peer as usize == 1 - rank), "rank {rank}: {r:?}");
    }
}

/// A member of a [`GroupCase`]: its spec, every rank's input and every rank's (input, output)
/// shift in elements.
type GroupMember = (PlanSpec, Vec<Vec<u8>>, Vec<(usize, usize)>);

/// A group of collectives of one element type (operators drawn per member) on one communicator.
struct GroupCase {
    shape: usize,
    dtype: DType,
    members: Vec<GroupMember>,
    memory: Vec<Memory>,
}

fn draw_group(seed: u64, case: usize, world: usize, processes: bool) -> GroupCase {
    let mut rng = common::rng(seed ^ (case as u64).wrapping_mul(0xA24B_AED4_963E_E407));
    let shape = rng.random_range(0..SHAPES.len() as u64) as usize;
    let dtype = DType::ALL[rng.random_range(0..DType::ALL.len() as u64) as usize];
    let n = [1, 2, 3, 7, 33, 40][rng.random_range(0..6) as usize];
    // A few operators per group: several launches of one group.
    let ops: Vec<ReduceOp> =
        (0..2).map(|_| ReduceOp::ALL[rng.random_range(0..ReduceOp::ALL.len() as u64) as usize]).collect();
    let members = (0..n)
        .map(|_| {
            let root = rng.random_range(0..world as u64) as u32;
            // AllToAll has no group form.
            let collective = Collective::every(root)[rng.random_range(0..5) as usize];
            let count = match rng.random_range(0..8) {
                0 => [0, 1, 3, 7, 8, 9, 15, 16, 17, 33][rng.random_range(0..10) as usize],
                1..=6 => rng.random_range(0..3000),
                _ => rng.random_range(0..100_000),
            };
            let op = ops[rng.random_range(0..2) as usize];
            let in_place = rng.random_range(0..2) == 0;
            let spec =
                PlanSpec { collective, count, dtype, op, ranks: world, in_place, ctas: 1, reduction: SHAPES[shape].1 };
            let (in_bytes, _) = spec.buffer_bytes();
            let mut inputs: Vec<Vec<u8>> = (0..world).map(|_| Vec::new()).collect();
            for _ in 0..in_bytes as usize / dtype.size() {
                for input in inputs.iter_mut() {
                    let x = if op == ReduceOp::Prod {
                        [-2.0, -1.0, 1.0, 2.0][rng.random_range(0..4) as usize]
                    } else {
                        rng.random_range(0..21) as f64 - 10.0
                    };
                    input.extend(common::element(dtype, x));
                }
            }
            let shift =
                (0..world).map(|_| (rng.random_range(0..5) as usize, rng.random_range(0..5) as usize)).collect();
            (spec, inputs, shift)
        })
        .collect();
    let memory = draw_memory(&mut rng, world, processes);
    GroupCase { shape, dtype, members, memory }
}

/// Queues every member of `c` in one group of `comm` and runs it; returns each member's output
/// bytes on this rank (empty without one), after checking the inputs were left as they were.
fn run_group_case(comm: &Comm, c: &GroupCase) -> Result<Vec<Vec<u8>>, Error> {
    let r = comm.rank();
    let stream = comm.stream().clone();
    let size = c.dtype.size();
    let sym = c.memory[r];
    let mut placed: Vec<(Option<Placed>, Option<Placed>)> = Vec::new();
    for (spec, inputs, shift) in &c.members {
        let (in_bytes, out_bytes) = spec.buffer_bytes();
        let (shift_in, shift_out) = shift[r];
        if spec.in_place {
            let len = in_bytes.max(out_bytes) as usize;
            let mut b = tccl::poison(spec, len);
            let at = if spec.collective == Collective::AllGather { r * in_bytes as usize } else { 0 };
            b[at..at + inputs[r].len()].copy_from_slice(&inputs[r]);
            placed.push((None, Some(Placed::new(comm, sym, &b, shift_out * size))));
        } else {
            let (has_in, has_out) = spec.rank_buffers(r);
            let input = has_in.then(|| Placed::new(comm, sym, &inputs[r], shift_in * size));
            let output =
                has_out.then(|| Placed::new(comm, sym, &tccl::poison(spec, out_bytes as usize), shift_out * size));
            placed.push((input, output));
        }
    }
    fn queue<T: Element>(
        comm: &Comm,
        c: &GroupCase,
        placed: &mut [(Option<Placed>, Option<Placed>)],
    ) -> Result<(), Error> {
        let (ins, outs): (Vec<_>, Vec<_>) = placed.iter_mut().map(|(i, o)| (i.as_ref(), o.as_mut())).unzip();
        let sends: Vec<Option<CudaView<T>>> = ins.iter().map(|b| b.map(|b| b.view::<T>())).collect();
        let mut wholes: Vec<Option<(CudaViewMut<T>, std::ops::Range<usize>)>> =
            outs.into_iter().map(|b| b.map(|b| b.whole_mut::<T>())).collect();
        let mut recvs: Vec<Option<CudaViewMut<T>>> =
            wholes.iter_mut().map(|w| w.as_mut().map(|(w, r)| w.slice_mut(r.clone()))).collect();
        let mut g = comm.group();
        for (((spec, _, _), send), recv) in c.members.iter().zip(&sends).zip(recvs.iter_mut()) {
            match (spec.collective, spec.in_place) {
                (Collective::AllReduce, false) => g.all_reduce(send.as_ref().unwrap(), recv.as_mut().unwrap(), spec.op),
                (Collective::AllReduce, true) => g.all_reduce_in_place(recv.as_mut().unwrap(), spec.op),
                (Collective::ReduceScatter, false) => {
                    g.reduce_scatter(send.as_ref().unwrap(), recv.as_mut().unwrap(), spec.op)
                }
                (Collective::ReduceScatter, true) => g.reduce_scatter_in_place(recv.as_mut().unwrap(), spec.op),
                (Collective::AllGather, false) => g.all_gather(send.as_ref().unwrap(), recv.as_mut().unwrap()),
                (Collective::AllGather, true) => g.all_gather_in_place(recv.as_mut().unwrap()),
                (Collective::Broadcast { root }, false) => {
                    g.broadcast(send.as_ref(), recv.as_mut().unwrap(), root as usize)
                }
                (Collective::Broadcast { root }, true) => g.broadcast_in_place(recv.as_mut().unwrap(), root as usize),
                (Collective::Reduce { root }, false) => {
                    g.reduce(send.as_ref().unwrap(), recv.as_mut(), spec.op, root as usize)
                }
                (Collective::Reduce { root }, true) => {
                    g.reduce_in_place(recv.as_mut().unwrap(), spec.op, root as usize)
                }
                (Collective::AllToAll, _) => unreachable!("not drawn"),
            }?;
        }
        g.run()
    }
    oxccl::with_element!(c.dtype, |T| queue::<T>(comm, c, &mut placed))?;
    comm.synchronize()?;
    let mut outputs = Vec::new();
    for (k, ((spec, inputs, _), (input, output))) in c.members.iter().zip(&placed).enumerate() {
        if let Some(b) = input {
            let after = b.read(&stream, &format!("member {k} {spec:?}: rank {r}'s input"));
            assert!(after == inputs[r], "member {k} {spec:?}: the group wrote rank {r}'s input buffer");
        }
        outputs.push(
            output
                .as_ref()
                .map(|b| b.read(&stream, &format!("member {k} {spec:?}: rank {r}'s output")))
                .unwrap_or_default(),
        );
    }
    Ok(outputs)
}

/// One rank's part of the grouped cases; returns how many cases and members ran.
fn group_rank_cases(
    stream: &Arc<CudaStream>,
    rank: usize,
    world: usize,
    ids: &[Id],
    cases: usize,
    seed: u64,
    processes: bool,
) -> (usize, usize) {
    let comms: Vec<Comm> = SHAPES
        .iter()
        .zip(ids)
        .map(|(&shape, id)| Comm::from_rank(stream, rank, world, id, config(shape)).unwrap())
        .collect();
    let mut members = 0;
    for case in 0..cases {
        let c = draw_group(seed, case, world, processes);
        let got = run_group_case(&comms[c.shape], &c)
            .unwrap_or_else(|e| panic!("rank {rank} case {case} (seed {seed}) {:?}: {e}", SHAPES[c.shape]));
        for (k, ((spec, inputs, _), got)) in c.members.iter().zip(&got).enumerate() {
            let want = tccl::reference(spec, inputs);
            if *got != want[rank] {
                let at = got.iter().zip(&want[rank]).position(|(a, b)| a != b);
                panic!(
                    "rank {rank} case {case} (seed {seed}) member {k} of {} {spec:?} {:?}: wrong output (first wrong byte {at:?})",
                    c.members.len(),
                    SHAPES[c.shape]
                );
            }
        }
        members += c.members.len();
    }
    leave(&comms, processes);
    (cases, members)
}

/// Groups of collectives (several launches where operators differ or members are many) on
/// threads of this process, each member exact.
#[test]
fn threads_run_grouped_collectives() {
    let Some(stream) = common::gpu("threads_run_grouped_collectives") else { return };
    let seed = common::seed_from_env(0x6209_0B5E);
    let (mut total, mut members) = (0, 0);
    for world in [2, 3, 8] {
        let ids: Vec<Id> = SHAPES.iter().map(|_| Id::new().unwrap()).collect();
        let ran = on_rank_threads(&stream, world, move |s, rank| {
            group_rank_cases(s, rank, world, &ids, cases() / 3, seed, false)
        });
        total += ran.iter().map(|r| r.0).sum::<usize>();
        members += ran.iter().map(|r| r.1).sum::<usize>();
    }
    eprintln!("{total} grouped rank-cases ({members} rank-members) on 2, 3 and 8 threads exact (seed {seed})");
}

/// The same with every rank a process of its own (buffers of every kind).
#[test]
fn processes_run_grouped_collectives() {
    const TEST: &str = "processes_run_grouped_collectives";
    if let Some((rank, world)) = child() {
        let stream = oxccl::engine::probe_gpu().unwrap().new_stream().unwrap();
        let seed: u64 = std::env::var("OXCCL_TEST_SEED").unwrap().parse().unwrap();
        let (n, m) = group_rank_cases(&stream, rank, world, &ids_from_env("OXCCL_TEST_IDS"), cases() / 3, seed, true);
        println!("rank {rank}: {n} grouped cases ({m} members) exact");
        return;
    }
    if common::gpu(TEST).is_none() || !mps(TEST) {
        return;
    }
    let seed = common::seed_from_env(0x6209_9C0C);
    let mut total = 0;
    for (world, _) in spawn_worlds(TEST, &[2, 4], SHAPES.len(), seed) {
        total += world * (cases() / 3);
    }
    eprintln!("{total} grouped rank-cases on 2 and 4 processes exact (seed {seed})");
}

/// Groups that differ between ranks, and a root outside the world: typed errors, nothing hangs.
#[test]
fn mismatched_groups_are_typed_errors() {
    let Some(stream) = common::gpu("mismatched_groups_are_typed_errors") else { return };
    let quick = Config { timeout: Duration::from_secs(2), ..Config::default() };
    let id = Id::new().unwrap();
    let got = on_rank_threads(&stream, 2, move |s, rank| {
        let comm = Comm::from_rank(s, rank, 2, &id, quick.clone()).unwrap();
        let mut y = s.alloc_zeros::<f32>(16).unwrap();
        let mut g = comm.group();
        assert!(matches!(g.broadcast_in_place(&mut y, 2), Err(Error::NoSuchRank { rank: 2, ranks: 2 })));
        drop(g);
        // Rank 0 reduces 256 elements, rank 1 512: both stop before anything moves.
        let x = s.clone_htod(&vec![1f32; 256 * (rank + 1)]).unwrap();
        let mut out = s.alloc_zeros::<f32>(256 * (rank + 1)).unwrap();
        let mut g = comm.group();
        g.all_reduce(&x, &mut out, ReduceOp::Sum).unwrap();
        g.run().and_then(|_| comm.synchronize())
    });
    for (rank, r) in got.iter().enumerate() {
        assert!(matches!(r, Err(Error::CallMismatch { peer, .. }) if *peer as usize == 1 - rank), "rank {rank}: {r:?}");
    }
}
