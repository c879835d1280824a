//! Per-rank communicators (`oxccl::Comm`) on the GPU: ranks as threads of this process and as
//! processes of their own (this test binary run again as each rank), every collective, both movers,
//! both reductions, in and out of place, random sizes and element offsets, buffers of both kinds
//! across processes (symmetric, and cudarc's, which go through staging), exact against the CPU
//! reference; a rank killed mid-call; misuse.
//!
//! Processes sharing one GPU run their kernels side by side only under MPS: the multi-process
//! tests run where `OXCCL_MPS=1` says MPS is up (scripts/gpu-suite.sh starts it), and say they are
//! skipped otherwise. `processes_without_mps_end` (run with `OXCCL_NO_MPS=1`) checks that without
//! MPS a call ends, in results or a typed error, rather than hangs.

mod common;

use cudarc::driver::{CudaSlice, CudaStream, CudaView, CudaViewMut};
use oxccl::host::tccl::{self, PlanSpec};
use oxccl::{Collective, Comm, Config, DType, Error, Id, Mover, ReduceOp, Reduction, SymmetricBuffer};
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
        timeout: Duration::from_secs(5),
        ..Config::default()
    }
}

/// `x` in the element type (integers spread over the integer types' range, as in gpu_collectives).
fn element(dtype: DType, x: f64) -> Vec<u8> {
    match dtype {
        DType::F32 => (x as f32).to_le_bytes().to_vec(),
        DType::F16 => half::f16::from_f64(x).to_le_bytes().to_vec(),
        DType::Bf16 => half::bf16::from_f64(x).to_le_bytes().to_vec(),
        DType::I32 => common::spread_i32(x as i32).to_le_bytes().to_vec(),
        DType::U32 => common::spread_u32(x as i32).to_le_bytes().to_vec(),
    }
}

/// One case, drawn alike on every rank from `seed` and the case number.
struct Case {
    spec: PlanSpec,
    /// Index into [`SHAPES`].
    shape: usize,
    inputs: Vec<Vec<u8>>,
    /// Per rank: element offset of its input and output in their allocations, and whether they are
    /// symmetric buffers.
    shift: Vec<(usize, usize)>,
    symmetric: Vec<bool>,
}

fn draw(seed: u64, case: usize, world: usize, processes: bool) -> Case {
    let mut rng = common::Rng(seed ^ (case as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    let shape = rng.below(SHAPES.len() as u64) as usize;
    let (_, reduction, _) = SHAPES[shape];
    let root = rng.below(world as u64) as u32;
    let collective = Collective::every(root)[rng.below(5) as usize];
    let count = match rng.below(6) {
        0 => [0, 1, 3, 7, 8, 9, 15, 16, 17, 33, 4095, 4097][rng.below(12) as usize],
        1..=3 => rng.below(5000),
        _ => rng.below(300_000),
    };
    let dtype = [DType::F32, DType::F16, DType::Bf16, DType::I32, DType::U32][rng.below(5) as usize];
    let op = [ReduceOp::Sum, ReduceOp::Min, ReduceOp::Max][rng.below(3) as usize];
    let spec = PlanSpec {
        collective,
        count,
        dtype,
        op,
        ranks: world,
        in_place: rng.below(2) == 0,
        // Filled by the communicator; the reference ignores it.
        ctas: 1,
        reduction,
    };
    // Small integers: exact in any order of combination (the bulk reduction's too).
    let (in_bytes, _) = spec.buffer_bytes();
    let elems = in_bytes as usize / dtype.size();
    let mut inputs: Vec<Vec<u8>> = (0..world).map(|_| Vec::new()).collect();
    for _ in 0..elems {
        for input in inputs.iter_mut() {
            input.extend(element(dtype, rng.below(21) as f64 - 10.0));
        }
    }
    let shifted = rng.below(3) == 0;
    let shift =
        (0..world).map(|_| if shifted { (rng.below(9) as usize, rng.below(9) as usize) } else { (0, 0) }).collect();
    let symmetric = (0..world).map(|_| processes && rng.below(2) == 0).collect();
    Case { spec, shape, inputs, shift, symmetric }
}

/// A buffer at an offset into its allocation, marked around: ordinary cudarc memory or a
/// symmetric buffer.
enum Storage {
    Plain(CudaSlice<u8>),
    Symmetric(SymmetricBuffer<u8>),
}

struct Placed {
    storage: Storage,
    head: usize,
    len: usize,
}

impl Placed {
    fn new(comm: &Comm, symmetric: bool, bytes: &[u8], head: usize) -> Placed {
        let stream = comm.stream();
        let mut all = vec![MARK; head + bytes.len() + GUARD];
        all[head..head + bytes.len()].copy_from_slice(bytes);
        let storage = if symmetric {
            let mut b = comm.alloc_symmetric::<u8>(all.len()).expect("alloc_symmetric");
            stream.memcpy_htod(&all, &mut *b).unwrap();
            Storage::Symmetric(b)
        } else {
            Storage::Plain(stream.clone_htod(&all).unwrap())
        };
        Placed { storage, head, len: bytes.len() }
    }

    fn slice(&self) -> &CudaSlice<u8> {
        match &self.storage {
            Storage::Plain(s) => s,
            Storage::Symmetric(s) => s,
        }
    }

    fn slice_mut(&mut self) -> &mut CudaSlice<u8> {
        match &mut self.storage {
            Storage::Plain(s) => s,
            Storage::Symmetric(s) => s,
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
    let sym = c.symmetric[r];
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
            }
        }};
    }
    match spec.dtype {
        DType::F32 => call!(f32),
        DType::F16 => call!(half::f16),
        DType::Bf16 => call!(half::bf16),
        DType::I32 => call!(i32),
        DType::U32 => call!(u32),
    }?;
    comm.synchronize()?;
    if let Some(b) = &input {
        let after = b.read(&stream, &format!("{spec:?}: rank {r}'s input"));
        assert!(after == c.inputs[r], "{spec:?}: the call wrote rank {r}'s input buffer");
    }
    Ok(output.map(|b| b.read(&stream, &format!("{spec:?}: rank {r}'s output"))).unwrap_or_default())
}

/// One rank's part of the random cases: builds its communicators (one per shape, from `ids`) on
/// `stream` and runs `cases` cases, each checked against the CPU reference. Returns how many ran,
/// and of them how many had a symmetric buffer on this rank.
fn rank_cases(
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
        .map(|(&shape, id)| {
            Comm::from_rank(stream, rank, world, id, config(shape))
                .unwrap_or_else(|e| panic!("rank {rank}: building the {shape:?} communicator: {e}"))
        })
        .collect();
    let mut symmetric = 0;
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
        symmetric += usize::from(c.symmetric[rank]);
    }
    (cases, symmetric)
}

fn cases() -> usize {
    common::count_from_env("OXCCL_RANK_CASES", 60)
}

/// Ranks as threads of this process on one GPU, each with its own stream and communicator.
#[test]
fn threads_match_the_cpu_reference() {
    let Some(stream) = common::gpu("threads_match_the_cpu_reference") else { return };
    let seed = common::seed_from_env(0x07A2_EAD5);
    let mut total = 0;
    for world in [2, 4, 8] {
        let ids: Vec<Id> = SHAPES.iter().map(|_| Id::new().unwrap()).collect();
        let ctx = stream.context().clone();
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let (ctx, ids) = (ctx.clone(), ids.clone());
                std::thread::spawn(move || {
                    let s = ctx.new_stream().unwrap();
                    rank_cases(&s, rank, world, &ids, cases(), seed, false)
                })
            })
            .collect();
        for h in handles {
            let (n, _) = h.join().unwrap_or_else(|_| panic!("a rank of {world} threads failed (see above)"));
            total += n;
        }
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
        println!("rank {rank}: {n} cases matched, {sym} on symmetric buffers");
        return;
    }
    if common::gpu(TEST).is_none() || !mps(TEST) {
        return;
    }
    let seed = common::seed_from_env(0xD1CE_5EED);
    let mut total = 0;
    for world in [2, 4, 8] {
        let ids: Vec<String> = SHAPES.iter().map(|_| Id::new().unwrap().to_string()).collect();
        let env = [("OXCCL_TEST_IDS", ids.join(",")), ("OXCCL_TEST_SEED", seed.to_string())];
        for (rank, (status, text)) in spawn_ranks(TEST, world, &env, Duration::from_secs(300)).into_iter().enumerate() {
            assert_eq!(status, Some(0), "rank {rank} of {world} processes failed:\n{text}");
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
}
