//! The collectives (AllReduce, ReduceScatter, AllGather, Broadcast and Reduce with random roots) on
//! virtual ranks on one GPU, against the CPU reference: random ranks, counts,
//! dtypes, operators, in-place and out-of-place, CTA counts, both movers and both reductions; outputs
//! poisoned before each call so unwritten elements show; the deterministic mode bitwise stable over
//! repeated runs; misuse reported as typed errors. Skips loudly without a Hopper GPU.

mod common;

use cudarc::driver::{CudaSlice, CudaStream, CudaView, CudaViewMut};
use oxccl::{Collective, Communicator, Config, DType, Error, Mover, ReduceOp, Reduction};
use oxccl_host::tccl::{self, PlanSpec};
use oxccl_kernels::abi;
use rand::RngExt;
use std::sync::Arc;

/// Case count: `OXCCL_GPU_CASES` or 520.
fn cases() -> usize {
    common::count_from_env("OXCCL_GPU_CASES", 520)
}

/// Per-rank inputs of `elems` elements: integers in -10..=10 (exact in every order; spread over the
/// integer types' range, see `common::element`) or, for the float types where `integers` is false, random
/// floats; products ±1 and ±2.
/// In-place Min and Max on integers get values distinct across ranks at every element, the extreme
/// held by a random rank: the result then differs from every other rank's own input, so an element
/// a rank fails to write shows although its buffer starts as its input.
fn inputs(spec: &PlanSpec, elems: usize, rng: &mut common::Rng, integers: bool) -> Vec<Vec<u8>> {
    let (dtype, p) = (spec.dtype, spec.ranks);
    // Random floats are for the float types.
    let integers = integers || !dtype.is_float();
    let mut v: Vec<Vec<u8>> = (0..p).map(|_| Vec::with_capacity(elems * dtype.size())).collect();
    // A Broadcast in place likewise whatever its operator (a rank's unwritten element keeps its own value).
    let distinct = integers
        && spec.in_place
        && (matches!(spec.collective, Collective::Broadcast { .. })
            || (spec.op != ReduceOp::Sum && spec.collective != Collective::AllGather));
    let low = -8.0;
    for _ in 0..elems {
        let turn = rng.random_range(0..p as u64) as usize;
        for (r, input) in v.iter_mut().enumerate() {
            let x = if spec.op == ReduceOp::Prod && spec.collective.reduces() {
                // ±1 and ±2: an f16 product that overflows stays an infinity, never times zero (a
                // NaN, whose bits the CPU and the GPU spell differently).
                [-2.0, -1.0, 1.0, 2.0][rng.random_range(0..4) as usize]
            } else if distinct {
                ((r + turn) % p) as f64 + low
            } else if integers {
                rng.random_range(0..21) as f64 - 10.0
            } else {
                common::random_float(dtype, rng)
            };
            input.extend(common::element(dtype, x));
        }
    }
    v
}

/// Bytes after each buffer, in its allocation, that a call must leave as they are.
const GUARD: usize = 64;
/// What the bytes around a buffer hold: not the poison, so an output written past its end shows
/// here too.
const MARK: u8 = 0xA5;

/// A buffer placed in its allocation after `head` bytes of [`MARK`] and before [`GUARD`] more.
struct Placed {
    alloc: CudaSlice<u8>,
    head: usize,
    len: usize,
}

impl Placed {
    fn new(stream: &Arc<CudaStream>, bytes: &[u8], head: usize) -> Placed {
        let mut all = vec![MARK; head + bytes.len() + GUARD];
        all[head..head + bytes.len()].copy_from_slice(bytes);
        Placed { alloc: stream.clone_htod(&all).unwrap(), head, len: bytes.len() }
    }

    /// The buffer's bytes, after checking that the marks around it are untouched.
    fn read(&self, stream: &Arc<CudaStream>, what: &str) -> Vec<u8> {
        let all = stream.clone_dtoh(&self.alloc).unwrap();
        let (body, guard) = (self.head..self.head + self.len, self.head + self.len..all.len());
        if let Some(i) = (0..self.head).chain(guard).find(|&i| all[i] != MARK) {
            panic!("{what}: the call wrote byte {i} of the allocation, outside its buffer at {body:?}");
        }
        all[body].to_vec()
    }
}

/// Typed views of the placed buffers (exercises views as well as slices, at any element offset).
unsafe fn views<T>(bufs: &[Placed]) -> Vec<CudaView<'_, T>> {
    let size = std::mem::size_of::<T>();
    bufs.iter()
        .map(|b| {
            let whole = unsafe { b.alloc.transmute::<T>(b.alloc.len() / size) }.unwrap();
            whole.slice(b.head / size..(b.head + b.len) / size)
        })
        .collect()
}
/// Typed views of the placed buffers' whole allocations, with each buffer's element range in its
/// allocation (a mutable view of the range borrows the whole one).
unsafe fn views_mut<T>(bufs: &mut [Placed]) -> Vec<(CudaViewMut<'_, T>, std::ops::Range<usize>)> {
    let size = std::mem::size_of::<T>();
    bufs.iter_mut()
        .map(|b| {
            let range = b.head / size..(b.head + b.len) / size;
            (unsafe { b.alloc.transmute_mut::<T>(b.alloc.len() / size) }.unwrap(), range)
        })
        .collect()
}

/// Runs one collective call with the given per-rank input bytes, rank r's buffers on `streams[r]`'s
/// GPU; returns each rank's result bytes (output buffer, or the one buffer in place; empty for a rank
/// without an output, as [`tccl::reference`] has it). Outputs start poisoned ([`tccl::poison`]). Out
/// of place, a rank gets only the buffers it has ([`PlanSpec::rank_buffers`]). Each buffer is a view
/// that starts `shift(buffer)` elements into its allocation (0 for the allocation's start; inputs
/// are buffers 0.., outputs follow), with marked bytes around it that the call must not write.
fn run_gpu(
    comm: &Communicator,
    streams: &[Arc<CudaStream>],
    spec: &PlanSpec,
    inputs: &[Vec<u8>],
    mut shift: impl FnMut(usize) -> usize,
) -> Result<Vec<Vec<u8>>, Error> {
    let (in_bytes, out_bytes) = spec.buffer_bytes();
    let p = spec.ranks;
    let size = spec.dtype.size();
    let mut outs: Vec<Placed> = Vec::new();
    let mut ins: Vec<Placed> = Vec::new();
    // The rank of each input (out of place, a Broadcast has the root's alone).
    let mut in_ranks: Vec<usize> = Vec::new();
    if spec.in_place {
        let len = in_bytes.max(out_bytes) as usize;
        for (r, input) in inputs.iter().enumerate() {
            let mut b = tccl::poison(spec, len);
            let at = if spec.collective == Collective::AllGather { r * in_bytes as usize } else { 0 };
            b[at..at + input.len()].copy_from_slice(input);
            outs.push(Placed::new(&streams[r], &b, shift(p + r) * size));
        }
    } else {
        for (r, (input, stream)) in inputs.iter().zip(streams).enumerate() {
            let (has_in, has_out) = spec.rank_buffers(r);
            if has_in {
                ins.push(Placed::new(stream, input, shift(r) * size));
                in_ranks.push(r);
            }
            if has_out {
                outs.push(Placed::new(stream, &tccl::poison(spec, out_bytes as usize), shift(p + r) * size));
            }
        }
    }
    // Across GPUs the uploads run on each rank's stream: finish them before any rank reads a peer's
    // buffer. (On one GPU the calls go without host synchronisation.)
    if streams.iter().any(|s| s.context().ordinal() != streams[0].context().ordinal()) {
        for s in streams {
            s.synchronize().unwrap();
        }
    }
    macro_rules! call {
        ($t:ty) => {{
            let send = unsafe { views::<$t>(&ins) };
            let mut whole = unsafe { views_mut::<$t>(&mut outs) };
            let mut recv: Vec<CudaViewMut<$t>> = whole.iter_mut().map(|(w, r)| w.slice_mut(r.clone())).collect();
            match (spec.collective, spec.in_place) {
                (Collective::AllReduce, false) => comm.all_reduce(&send, &mut recv, spec.op),
                (Collective::AllReduce, true) => comm.all_reduce_in_place(&mut recv, spec.op),
                (Collective::ReduceScatter, false) => comm.reduce_scatter(&send, &mut recv, spec.op),
                (Collective::ReduceScatter, true) => comm.reduce_scatter_in_place(&mut recv, spec.op),
                (Collective::AllGather, false) => comm.all_gather(&send, &mut recv),
                (Collective::AllGather, true) => comm.all_gather_in_place(&mut recv),
                (Collective::Broadcast { root }, false) => comm.broadcast(&send[0], &mut recv, root as usize),
                (Collective::Broadcast { root }, true) => comm.broadcast_in_place(&mut recv, root as usize),
                (Collective::Reduce { root }, false) => comm.reduce(&send, &mut recv[0], spec.op, root as usize),
                (Collective::Reduce { root }, true) => comm.reduce_in_place(&mut recv, spec.op, root as usize),
                // Drawn out of place only.
                (Collective::AllToAll, _) => comm.all_to_all(&send, &mut recv),
            }
        }};
    }
    oxccl::with_element!(spec.dtype, |T| call!(T))?;
    comm.synchronize()?;
    let mut outs = outs.iter();
    let got = (0..p)
        .map(|r| {
            if spec.rank_buffers(r).1 {
                outs.next().unwrap().read(&streams[r], &format!("{spec:?}: rank {r}'s output"))
            } else {
                Vec::new()
            }
        })
        .collect();
    for (b, &r) in ins.iter().zip(&in_ranks) {
        let after = b.read(&streams[r], &format!("{spec:?}: rank {r}'s input"));
        assert!(after == inputs[r], "{spec:?}: the call wrote rank {r}'s input buffer");
    }
    Ok(got)
}

/// `stream` for each of `ranks` virtual ranks.
fn same(stream: &Arc<CudaStream>, ranks: usize) -> Vec<Arc<CudaStream>> {
    vec![stream.clone(); ranks]
}

fn random_spec(rng: &mut common::Rng, max_ctas_total: u32) -> (PlanSpec, Mover) {
    let kind = rng.random_range(0..6);
    let ranks = 1 + rng.random_range(0..16) as usize;
    let root = rng.random_range(0..ranks as u64) as u32;
    let collective = Collective::every(root)[kind as usize];
    let count = match rng.random_range(0..8) {
        0 => 0,
        // Lengths around 16-byte and chunk boundaries for every element size.
        1 => [1, 2, 3, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 4095, 4096, 4097]
            [rng.random_range(0..19) as usize],
        2..=4 => rng.random_range(0..3000),
        5 | 6 => rng.random_range(0..200_000),
        // Up to 10^6 elements per buffer (ReduceScatter and AllGather buffers hold ranks × count).
        _ if matches!(collective, Collective::ReduceScatter | Collective::AllGather | Collective::AllToAll) => {
            rng.random_range(0..1_000_000) / ranks as u64
        }
        _ => rng.random_range(0..1_000_000),
    };
    let dtype = DType::ALL[rng.random_range(0..DType::ALL.len() as u64) as usize];
    let op = ReduceOp::ALL[rng.random_range(0..ReduceOp::ALL.len() as u64) as usize];
    let ctas = 1 + rng.random_range(0..(max_ctas_total / ranks as u32).clamp(1, 32) as u64) as u32;
    let reduction = if rng.random_range(0..3) == 0 { Reduction::Tma } else { Reduction::Registers };
    let mover =
        [Mover::Simt, Mover::Simt, Mover::Latency, Mover::Tma, Mover::Tma, Mover::Tma][rng.random_range(0..6) as usize];
    let in_place = rng.random_range(0..2) == 0 && collective.has_in_place();
    let spec = PlanSpec { collective, count, dtype, op, ranks, in_place, ctas, reduction };
    (spec, mover)
}

/// The communicator configuration of a case: one, two or four issuing warps by CTA count (calls
/// that combine sources keep one), AllReduce's combined result stored from registers to every rank
/// or not or by the default rule by CTA count, and register combines on 64 (the issuing warp
/// combines too), 128 or 256 threads.
fn config(spec: &PlanSpec, mover: Mover) -> Config {
    // Communicators are shared by cases of one (ranks, CTAs, mover, reduction): draw from those.
    let threads = match (mover, spec.reduction) {
        (Mover::Tma, Reduction::Registers) => [None, Some(64), Some(128)][(spec.ctas / 3 % 3) as usize],
        _ => None,
    };
    let issuers = [1, 2, 4][spec.ctas as usize % 3];
    Config {
        max_ctas: Some(spec.ctas),
        mover,
        reduction: spec.reduction,
        deterministic: spec.reduction == Reduction::Registers,
        timeout: std::time::Duration::from_secs(5),
        issuers: Some(threads.map_or(issuers, |t| issuers.min(t / 32))),
        combine_direct: [None, Some(true), Some(false)][(spec.ctas as usize + spec.ranks) % 3],
        threads,
        ..Config::default()
    }
}

/// Compares one case's results with the CPU reference: bitwise where the order of combination is
/// fixed, nothing is combined or the values are integers; within the rounding bound of two summation
/// orders for the hardware bulk reduction of random floats (see `rounding_bound`). Returns whether
/// the case took the bound.
fn check(
    case: usize,
    seed: u64,
    spec: &PlanSpec,
    mover: Mover,
    integers: bool,
    inputs: &[Vec<u8>],
    got: &[Vec<u8>],
) -> bool {
    let want = tccl::reference(spec, inputs);
    // Register reduction combines in ascending rank order like the reference: bitwise equal even on
    // random floats. The hardware bulk reduction may reorder: exact on integers, close on floats.
    // (Types the bulk reduction does not take reduce in registers whatever the configuration.)
    let integer_dtype = !spec.dtype.is_float();
    let sums = matches!(spec.collective, Collective::AllReduce | Collective::ReduceScatter | Collective::Reduce { .. });
    let bulk = spec.reduction == Reduction::Tma && abi::tma_can_reduce(spec.dtype, spec.op);
    if integers || integer_dtype || !sums || !bulk || spec.op != ReduceOp::Sum {
        if got != want {
            let (r, at) = got
                .iter()
                .zip(&want)
                .enumerate()
                .find_map(|(r, (g, w))| g.iter().zip(w).position(|(a, b)| a != b).map(|i| (r, i)))
                .unwrap();
            panic!("case {case} (seed {seed}) {spec:?} {mover:?}: rank {r} first wrong byte {at}");
        }
        return false;
    }
    let bound = rounding_bound(spec, inputs);
    let size = spec.dtype.size();
    for (r, ((g, w), b)) in got.iter().zip(&want).zip(&bound).enumerate() {
        assert_eq!(g.len(), w.len(), "case {case} {spec:?}: rank {r}'s output length");
        for (i, ((a, x), t)) in g.chunks(size).zip(w.chunks(size)).zip(b).enumerate() {
            let (a, x) = (float(spec.dtype, a), float(spec.dtype, x));
            // NaN (a poisoned, unwritten element) fails the comparison.
            assert!(
                (a - x).abs() <= *t,
                "case {case} (seed {seed}) {spec:?}: rank {r} element {i}: {a} vs {x} (bound {t})"
            );
        }
    }
    true
}

/// A float element's value.
fn float(dtype: DType, x: &[u8]) -> f64 {
    match dtype {
        DType::F32 => f32::from_le_bytes(x.try_into().unwrap()) as f64,
        DType::F16 => half::f16::from_le_bytes(x.try_into().unwrap()).to_f64(),
        DType::Bf16 => half::bf16::from_le_bytes(x.try_into().unwrap()).to_f64(),
        _ => unreachable!("integer dtypes are compared exactly"),
    }
}

/// Per output element, how far two sums of the same `ranks` terms in different orders may lie apart
/// when every partial sum is rounded to the element type: each order is within (n − 1)·u·Σ|x| of the
/// exact sum (u the type's unit roundoff), so the two within twice that. Σ|x| is the reference run
/// on the inputs' magnitudes (clearing the sign bit is exact); its own rounding is covered by 1 %
/// more.
fn rounding_bound(spec: &PlanSpec, inputs: &[Vec<u8>]) -> Vec<Vec<f64>> {
    let size = spec.dtype.size();
    let magnitudes: Vec<Vec<u8>> = inputs
        .iter()
        .map(|b| {
            let mut m = b.clone();
            // Little-endian: the sign bit is the top bit of an element's last byte.
            for e in m.chunks_mut(size) {
                e[size - 1] &= 0x7f;
            }
            m
        })
        .collect();
    let u = match spec.dtype {
        DType::F32 => f64::powi(2.0, -24),
        DType::F16 => f64::powi(2.0, -11),
        _ => f64::powi(2.0, -8),
    };
    let scale = 2.0 * (spec.ranks as f64 - 1.0) * u * 1.01;
    tccl::reference(spec, &magnitudes)
        .iter()
        .map(|b| b.chunks(size).map(|e| scale * float(spec.dtype, e)).collect())
        .collect()
}

#[test]
fn collectives_match_the_cpu_reference_on_virtual_ranks() {
    let Some(stream) = common::gpu("collectives_match_the_cpu_reference_on_virtual_ranks") else { return };
    let seed = common::seed_from_env(0xC011_EC71);
    let mut rng = common::rng(seed);
    let sms = oxccl::engine::Engine::new(stream.context()).unwrap().sms;
    let (mut done, mut bounded, mut shifted_cases) = (0, 0, 0);
    let mut by_collective = std::collections::BTreeMap::new();
    let mut comms: std::collections::HashMap<(usize, u32, Mover, Reduction, bool), Communicator> = Default::default();
    let rank_streams: Vec<Arc<CudaStream>> = (0..16).map(|_| stream.context().new_stream().unwrap()).collect();
    for case in 0..cases() {
        let (spec, mover) = random_spec(&mut rng, sms);
        // One case in four: every rank on its own stream, launched separately, meeting through the
        // workspace barriers (the multi-GPU code path), with no host synchronisation before the call.
        let per_rank = rng.random_range(0..4) == 0;
        let comm = comms.entry((spec.ranks, spec.ctas, mover, spec.reduction, per_rank)).or_insert_with(|| {
            if per_rank {
                Communicator::from_streams(&rank_streams[..spec.ranks], config(&spec, mover)).unwrap()
            } else {
                Communicator::virtual_ranks(&stream, spec.ranks, config(&spec, mover)).unwrap()
            }
        });
        let integers = rng.random_range(0..4) != 0;
        let (in_bytes, _) = spec.buffer_bytes();
        let elems = in_bytes as usize / spec.dtype.size();
        let inputs = inputs(&spec, elems, &mut rng, integers);
        // One case in three: every buffer a view 0 to 8 elements into its allocation, so that the
        // ranks' buffers start at different offsets modulo 16 bytes (unaligned heads and tails).
        let shifted = rng.random_range(0..3) == 0;
        let got = run_gpu(comm, &same(&stream, spec.ranks), &spec, &inputs, |_| {
            if shifted { rng.random_range(0..9) as usize } else { 0 }
        })
        .unwrap_or_else(|e| panic!("case {case} (shifted views: {shifted}) {spec:?} {mover:?}: {e}"));
        bounded += usize::from(check(case, seed, &spec, mover, integers, &inputs, &got));
        done += 1;
        shifted_cases += usize::from(shifted);
        *by_collective.entry(spec.collective.name()).or_insert(0usize) += 1;
    }
    eprintln!(
        "{done} collective cases matched the CPU reference (seed {seed}), {bounded} of them within the rounding \
         bound of the bulk reduction, the others bitwise; {shifted_cases} on views at element offsets, none \
         writing outside its buffers: {by_collective:?}"
    );
}

/// The hardware bulk reduction of random floats, which may add the ranks' contributions in any order,
/// within the rounding bound of two summation orders (`check`) for every collective that sums, every
/// float type, in place and out of place, on 2, 5 and 16 ranks: the random matrix above meets this
/// case about once in a hundred.
#[test]
fn bulk_reduction_of_random_floats_is_within_the_rounding_bound() {
    let Some(stream) = common::gpu("bulk_reduction_of_random_floats_is_within_the_rounding_bound") else { return };
    let mut rng = common::rng(0xB0_0D);
    let mut case = 0;
    for ranks in [2, 5, 16] {
        let root = ranks as u32 - 1;
        for collective in [Collective::AllReduce, Collective::ReduceScatter, Collective::Reduce { root }] {
            for dtype in [DType::F32, DType::F16, DType::Bf16] {
                for in_place in [false, true] {
                    let (op, reduction) = (ReduceOp::Sum, Reduction::Tma);
                    let spec = PlanSpec { collective, count: 40_001, dtype, op, ranks, in_place, ctas: 4, reduction };
                    let comm = Communicator::virtual_ranks(&stream, ranks, config(&spec, Mover::Tma)).unwrap();
                    let (in_bytes, _) = spec.buffer_bytes();
                    let inputs = inputs(&spec, in_bytes as usize / dtype.size(), &mut rng, false);
                    let got = run_gpu(&comm, &same(&stream, ranks), &spec, &inputs, |_| 0)
                        .unwrap_or_else(|e| panic!("{spec:?}: {e}"));
                    assert!(check(case, 0xB00D, &spec, Mover::Tma, false, &inputs, &got), "{spec:?} compared bitwise");
                    case += 1;
                }
            }
        }
    }
    eprintln!("{case} bulk reductions of random floats within the rounding bound");
}

/// Multi-GPU case count: `OXCCL_MULTI_GPU_CASES` or 300.
fn multi_gpu_cases() -> usize {
    common::count_from_env("OXCCL_MULTI_GPU_CASES", 300)
}

#[test]
fn collectives_match_the_cpu_reference_with_one_rank_per_gpu() {
    let Some(gpus) = common::gpus("collectives_match_the_cpu_reference_with_one_rank_per_gpu") else { return };
    let seed = common::seed_from_env(0x6B0_0C11);
    let mut rng = common::rng(seed);
    let sms = oxccl::engine::Engine::new(&gpus[0]).unwrap().sms;
    let streams: Vec<Arc<CudaStream>> = gpus.iter().map(|g| g.new_stream().unwrap()).collect();
    let mut comms: std::collections::HashMap<(usize, u32, Mover, Reduction), Communicator> = Default::default();
    let mut per_ranks = vec![0usize; gpus.len() + 1];
    for case in 0..multi_gpu_cases() {
        let (mut spec, mover) = random_spec(&mut rng, sms);
        // Ranks 2..=GPUs, one per GPU; CTAs up to the whole GPU.
        spec.ranks = 2 + rng.random_range(0..gpus.len() as u64 - 1) as usize;
        let most = if rng.random_range(0..4) == 0 { sms as u64 } else { 32 };
        spec.ctas = 1 + rng.random_range(0..most) as u32;
        if matches!(spec.collective, Collective::ReduceScatter | Collective::AllGather | Collective::AllToAll) {
            spec.count = spec.count.min(2_000_000 / spec.ranks as u64);
        }
        // A root among the ranks kept.
        spec.collective = match spec.collective {
            Collective::Broadcast { root } => Collective::Broadcast { root: root % spec.ranks as u32 },
            Collective::Reduce { root } => Collective::Reduce { root: root % spec.ranks as u32 },
            c => c,
        };
        per_ranks[spec.ranks] += 1;
        let comm = comms
            .entry((spec.ranks, spec.ctas, mover, spec.reduction))
            .or_insert_with(|| Communicator::from_streams(&streams[..spec.ranks], config(&spec, mover)).unwrap());
        let integers = rng.random_range(0..4) != 0;
        let (in_bytes, _) = spec.buffer_bytes();
        let elems = in_bytes as usize / spec.dtype.size();
        let inputs = inputs(&spec, elems, &mut rng, integers);
        let shifted = rng.random_range(0..3) == 0;
        let got = run_gpu(comm, &streams[..spec.ranks], &spec, &inputs, |_| {
            if shifted { rng.random_range(0..9) as usize } else { 0 }
        })
        .unwrap_or_else(|e| panic!("case {case} (seed {seed}, shifted views: {shifted}) {spec:?} {mover:?}: {e}"));
        check(case, seed, &spec, mover, integers, &inputs, &got);
    }
    let by_ranks: Vec<String> =
        per_ranks.iter().enumerate().filter(|(_, n)| **n > 0).map(|(r, n)| format!("{n} on {r} GPUs")).collect();
    eprintln!(
        "{} collective cases with one rank per GPU matched the CPU reference ({}; seed {seed})",
        multi_gpu_cases(),
        by_ranks.join(", ")
    );
}

/// A graph of calls on several rank streams (`oxccl::graph::capture`, as `oxccl bench -G` times it)
/// runs every call it captured at each launch: an in-place sum over 4 ranks of ones, called once
/// before and 3 × 3 times in the graph, is 4^10 everywhere (exact in f32); ranks on one stream and
/// on two (the second joins the capture through events).
#[test]
fn a_graph_runs_the_captured_calls() {
    let Some(stream) = common::gpu("a_graph_runs_the_captured_calls") else { return };
    let ctx = stream.context().clone();
    let n = 50_001usize;
    let one = ctx.new_stream().unwrap();
    let two = [ctx.new_stream().unwrap(), ctx.new_stream().unwrap()];
    for streams in [vec![one.clone(); 4], vec![two[0].clone(), two[1].clone(), two[0].clone(), two[1].clone()]] {
        let comm = Communicator::from_streams(&streams, Config { max_ctas: Some(2), ..Config::default() }).unwrap();
        let tracking = ctx.is_event_tracking();
        // SAFETY: each buffer below is used on its rank's stream, after every stream is synchronised.
        unsafe { ctx.disable_event_tracking() };
        let mut bufs: Vec<CudaSlice<f32>> = streams.iter().map(|s| s.clone_htod(&vec![1.0f32; n]).unwrap()).collect();
        if tracking {
            // SAFETY: restores the default for buffers made later.
            unsafe { ctx.enable_event_tracking() };
        }
        for s in &streams {
            s.synchronize().unwrap();
        }
        // The plan is built outside the capture.
        comm.all_reduce_in_place(&mut bufs, ReduceOp::Sum).unwrap();
        comm.synchronize().unwrap();
        // Three calls captured once and the graph launched three times: ten calls in all.
        let graph = oxccl::graph::capture(&streams, || {
            (0..3).try_for_each(|_| comm.all_reduce_in_place(&mut bufs, ReduceOp::Sum))
        })
        .unwrap();
        for _ in 0..3 {
            graph.launch().unwrap();
        }
        comm.synchronize().unwrap();
        let want = 4f32.powi(10);
        for (r, (b, s)) in bufs.iter().zip(&streams).enumerate() {
            let got = s.clone_dtoh(b).unwrap();
            assert!(got.iter().all(|&x| x == want), "rank {r}: {} (want {want})", got[0]);
        }
        let distinct = if streams[0].cu_stream() == streams[1].cu_stream() { 1 } else { 2 };
        eprintln!("{distinct} distinct streams: ten calls exact through a graph");
    }
}

/// A plan a captured call launched outlives `clear_plans` (the graph holds its device addresses):
/// replays after the clear still sum exactly, and `release_captured` frees it once the graph is gone.
#[test]
fn a_captured_plan_outlives_clear_plans() {
    let Some(stream) = common::gpu("a_captured_plan_outlives_clear_plans") else { return };
    let ctx = stream.context().clone();
    let s = ctx.new_stream().unwrap();
    let (ranks, n) = (4usize, 65_537usize);
    let comm = Communicator::virtual_ranks(&s, ranks, Config { max_ctas: Some(2), ..Config::default() }).unwrap();
    comm.prepare::<f32>(Collective::AllReduce, n, ReduceOp::Sum, true).unwrap();
    // SAFETY: only this test's buffers are made while tracking is off; they live on one stream.
    unsafe { ctx.disable_event_tracking() };
    let mut bufs: Vec<CudaSlice<f32>> = (0..ranks).map(|_| s.clone_htod(&vec![1.0f32; n]).unwrap()).collect();
    // SAFETY: restores the default for buffers made later.
    unsafe { ctx.enable_event_tracking() };
    s.synchronize().unwrap();
    let graph =
        oxccl::graph::capture(std::slice::from_ref(&s), || comm.all_reduce_in_place(&mut bufs, ReduceOp::Sum)).unwrap();
    assert_eq!(comm.captured_plans(), 1, "the captured call's plan is kept");
    comm.clear_plans().unwrap();
    assert_eq!((comm.cached_plans(), comm.captured_plans()), (0, 1));
    for _ in 0..3 {
        graph.launch().unwrap();
    }
    s.synchronize().unwrap();
    let want = (ranks as f32).powi(3);
    for (r, b) in bufs.iter().enumerate() {
        let got = s.clone_dtoh(b).unwrap();
        assert!(got.iter().all(|&x| x == want), "rank {r}: {} (want {want})", got[0]);
    }
    drop(graph);
    // SAFETY: the only graph captured from this communicator is destroyed.
    unsafe { comm.release_captured() }.unwrap();
    assert_eq!(comm.captured_plans(), 0);
}

/// A prepared call builds nothing when made, so it can be captured in a CUDA graph; replays of the
/// graph run the collective again: one launch for all ranks, and ranks on two streams whose separate
/// launches meet at barriers (their counters live in device memory and count on across replays).
#[test]
fn prepared_calls_replay_in_a_cuda_graph() {
    use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
    let Some(stream) = common::gpu("prepared_calls_replay_in_a_cuda_graph") else { return };
    let ctx = stream.context().clone();
    // Capture needs a stream other than the legacy one.
    let s = ctx.new_stream().unwrap();
    let (ranks, n) = (4usize, 100_003usize);
    let comm = Communicator::virtual_ranks(&s, ranks, Config { max_ctas: Some(4), ..Config::default() }).unwrap();
    comm.prepare::<f32>(Collective::AllReduce, n, ReduceOp::Sum, true).unwrap();
    let plans = comm.cached_plans();
    assert!(plans >= 1);
    comm.prepare::<f32>(Collective::AllReduce, n, ReduceOp::Sum, true).unwrap();
    assert_eq!(comm.cached_plans(), plans, "preparing twice built a second plan");
    // Buffers without cudarc's cross-stream event tracking: its waits on events recorded before the
    // capture are not part of what is captured.
    struct Tracking(Arc<cudarc::driver::CudaContext>);
    impl Drop for Tracking {
        fn drop(&mut self) {
            // SAFETY: restores the context's default for slices created after this test.
            unsafe { self.0.enable_event_tracking() };
        }
    }
    // SAFETY: only this test's buffers are created while tracking is off; they live on one stream.
    unsafe { ctx.disable_event_tracking() };
    let restore = Tracking(ctx.clone());
    let mut bufs: Vec<CudaSlice<f32>> = (0..ranks).map(|r| s.clone_htod(&vec![r as f32 + 1.0; n]).unwrap()).collect();
    drop(restore);
    s.synchronize().unwrap();
    s.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).unwrap();
    // A size not prepared, and a poll, are refused inside the capture (the upload's copies would be
    // recorded into the graph, not run), and the capture goes on.
    let mut shorter: Vec<_> = bufs.iter_mut().map(|b| b.slice_mut(..n - 1)).collect();
    let unprepared = comm.all_reduce_in_place(&mut shorter, ReduceOp::Sum);
    assert!(matches!(unprepared, Err(Error::Capturing { .. })), "an unprepared call in a capture: {unprepared:?}");
    drop(shorter);
    assert!(matches!(comm.query(), Err(Error::Capturing { .. })), "a poll in a capture");
    let captured = comm.all_reduce_in_place(&mut bufs, ReduceOp::Sum);
    let graph = s.end_capture(CUgraphInstantiate_flags(0)).unwrap().expect("the capture holds the launch");
    captured.unwrap();
    assert_eq!(comm.cached_plans(), plans, "a call in the capture built a plan");
    // Nothing ran during the capture: the buffers still hold the inputs.
    assert_eq!(s.clone_dtoh(&bufs[1]).unwrap()[n - 1], 2.0);
    // Each replay sums in place: after k replays every element is (1 + 2 + ... + ranks) × ranks^(k-1).
    let first: f32 = (1..=ranks).map(|r| r as f32).sum();
    for replay in 1..=3 {
        graph.launch().unwrap();
        s.synchronize().unwrap();
        comm.synchronize().unwrap();
        let want = first * (ranks as f32).powi(replay - 1);
        for (r, b) in bufs.iter().enumerate() {
            let got = s.clone_dtoh(b).unwrap();
            assert!(got.iter().all(|&x| x == want), "replay {replay} rank {r}: {} (want {want})", got[0]);
        }
    }
    // Two ranks on separate streams (separate launches meeting at barriers whose counters live in
    // device memory): both streams join the capture (fork and join through events).
    let comm2 = Communicator::from_devices(&[0, 0], Config { max_ctas: Some(2), ..Config::default() }).unwrap();
    comm2.prepare::<f32>(Collective::AllReduce, n, ReduceOp::Sum, true).unwrap();
    let (s0, s1) = (comm2.stream(0).unwrap().clone(), comm2.stream(1).unwrap().clone());
    let ctx2 = s0.context().clone();
    // SAFETY: as above, for this communicator's context.
    unsafe { ctx2.disable_event_tracking() };
    let restore = Tracking(ctx2.clone());
    let mut pair = vec![s0.clone_htod(&vec![1.0f32; n]).unwrap(), s1.clone_htod(&vec![2.0f32; n]).unwrap()];
    drop(restore);
    s0.synchronize().unwrap();
    s1.synchronize().unwrap();
    s0.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).unwrap();
    let fork = s0.record_event(None).unwrap();
    s1.wait(&fork).unwrap();
    let captured = comm2.all_reduce_in_place(&mut pair, ReduceOp::Sum);
    let join = s1.record_event(None).unwrap();
    s0.wait(&join).unwrap();
    let graph2 = s0.end_capture(CUgraphInstantiate_flags(0)).unwrap().expect("the capture holds both launches");
    captured.unwrap();
    for replay in 1..=3 {
        graph2.launch().unwrap();
        s0.synchronize().unwrap();
        comm2.synchronize().unwrap();
        let want = 3.0 * 2f32.powi(replay - 1);
        for (r, b) in pair.iter().enumerate() {
            let got = comm2.stream(r).unwrap().clone_dtoh(b).unwrap();
            assert!(got.iter().all(|&x| x == want), "two streams, replay {replay} rank {r}: {} (want {want})", got[0]);
        }
    }
    // AllGather ignores the operator: one plan for both.
    comm.prepare::<f32>(Collective::AllGather, 7, ReduceOp::Max, false).unwrap();
    comm.prepare::<f32>(Collective::AllGather, 7, ReduceOp::Sum, false).unwrap();
    assert_eq!(comm.cached_plans(), plans + 1, "AllGather plans depend on no operator");
    // Cleared plans are built again by the next call, which still sums correctly.
    drop(graph);
    comm.clear_plans().unwrap();
    assert_eq!(comm.cached_plans(), 0);
    let mut fresh: Vec<CudaSlice<f32>> = (0..ranks).map(|r| s.clone_htod(&vec![r as f32 + 1.0; n]).unwrap()).collect();
    comm.all_reduce_in_place(&mut fresh, ReduceOp::Sum).unwrap();
    comm.synchronize().unwrap();
    assert_eq!(comm.cached_plans(), 1);
    for (r, b) in fresh.iter().enumerate() {
        let got = s.clone_dtoh(b).unwrap();
        assert!(got.iter().all(|&x| x == first), "after clear_plans, rank {r}: {} (want {first})", got[0]);
    }
}

/// `Communicator::from_devices` puts one rank on each listed device (every visible GPU, or GPU 0
/// twice on a one-GPU machine), each on a stream of its own that `stream(rank)` hands out.
#[test]
fn from_devices_runs_one_rank_per_listed_device() {
    let Some(_) = common::gpu("from_devices_runs_one_rank_per_listed_device") else { return };
    let devices = cudarc::driver::CudaContext::device_count().unwrap() as usize;
    let ordinals: Vec<usize> = if devices > 1 { (0..devices.min(8)).collect() } else { vec![0, 0] };
    let comm = Communicator::from_devices(&ordinals, Config { max_ctas: Some(4), ..Config::default() }).unwrap();
    let p = ordinals.len();
    assert!(matches!(comm.stream(p), Err(Error::NoSuchRank { rank, ranks }) if rank == p && ranks == p));
    // Communicators on one context share its engine (the PTX is loaded once).
    let other = Communicator::virtual_ranks(comm.stream(0).unwrap(), 2, Config::default()).unwrap();
    assert!(std::ptr::eq(comm.engine(0).unwrap(), other.engine(1).unwrap()), "a second engine for GPU 0");
    drop(other);
    let n = 70_001;
    let mut bufs = Vec::new();
    for (r, &d) in ordinals.iter().enumerate() {
        let s = comm.stream(r).unwrap();
        assert_eq!(s.context().ordinal(), d, "rank {r}");
        bufs.push(s.clone_htod(&vec![r as i32 + 1; n]).unwrap());
    }
    for r in 0..p {
        comm.stream(r).unwrap().synchronize().unwrap();
    }
    comm.all_reduce_in_place(&mut bufs, ReduceOp::Sum).unwrap();
    comm.synchronize().unwrap();
    let want = (1..=p as i32).sum::<i32>();
    for (r, b) in bufs.iter().enumerate() {
        let got = comm.stream(r).unwrap().clone_dtoh(b).unwrap();
        assert!(got.iter().all(|&x| x == want), "rank {r}: {} (want {want})", got[0]);
    }
}

/// Deterministic mode: five runs of each case on fresh poisoned outputs are bitwise equal to each
/// other and to the reference (random floats, where the order of combination shows): one launch for
/// all ranks and ranks launched separately, in and out of place, 4 to 16 ranks, both movers, and the
/// thread counts and direct stores `config` draws by CTA count.
#[test]
fn deterministic_mode_is_bitwise_stable() {
    let Some(stream) = common::gpu("deterministic_mode_is_bitwise_stable") else { return };
    let mut rng = common::rng(42);
    // (collective, dtype, ranks, CTAs per rank, in place, one stream per rank, count)
    let cases = [
        (Collective::AllReduce, DType::F32, 8, 8, false, false, 3_000_017),
        (Collective::AllReduce, DType::Bf16, 8, 8, false, false, 3_000_017),
        (Collective::ReduceScatter, DType::F16, 8, 8, false, false, 3_000_017),
        (Collective::AllReduce, DType::F32, 16, 4, true, false, 1_000_003),
        (Collective::AllReduce, DType::F16, 4, 3, false, true, 777_777),
        (Collective::ReduceScatter, DType::Bf16, 16, 2, true, true, 65_537),
        (Collective::AllReduce, DType::Bf16, 12, 5, true, true, 400_001),
        (Collective::Reduce { root: 3 }, DType::F32, 8, 8, false, false, 3_000_017),
        (Collective::Reduce { root: 0 }, DType::Bf16, 6, 4, true, true, 500_001),
    ];
    for (collective, dtype, ranks, ctas, in_place, per_rank, count) in cases {
        for mover in [Mover::Tma, Mover::Simt] {
            let spec = PlanSpec {
                collective,
                count,
                dtype,
                op: ReduceOp::Sum,
                ranks,
                in_place,
                ctas,
                reduction: Reduction::Registers,
            };
            let comm = if per_rank {
                let streams: Vec<Arc<CudaStream>> =
                    (0..ranks).map(|_| stream.context().new_stream().unwrap()).collect();
                Communicator::from_streams(&streams, config(&spec, mover)).unwrap()
            } else {
                Communicator::virtual_ranks(&stream, ranks, config(&spec, mover)).unwrap()
            };
            let what = format!(
                "{collective:?} {dtype:?} {ranks} ranks {ctas} CTAs in place {in_place} per-rank streams {per_rank} {mover:?}"
            );
            let elems = spec.buffer_bytes().0 as usize / dtype.size();
            let inputs = inputs(&spec, elems, &mut rng, false);
            let first =
                run_gpu(&comm, &same(&stream, ranks), &spec, &inputs, |_| 0).unwrap_or_else(|e| panic!("{what}: {e}"));
            for run in 1..5 {
                let again = run_gpu(&comm, &same(&stream, ranks), &spec, &inputs, |_| 0).unwrap();
                assert!(again == first, "{what}: run {run} differs bitwise from run 0");
            }
            assert!(first == tccl::reference(&spec, &inputs), "{what}: differs from the reference");
        }
    }
}

#[test]
fn misuse_is_a_typed_error() {
    let Some(stream) = common::gpu("misuse_is_a_typed_error") else { return };
    let comm = Communicator::virtual_ranks(&stream, 4, Config { max_ctas: Some(2), ..Config::default() }).unwrap();
    let shown = format!("{comm:?}");
    assert!(shown.contains("ranks: 4") && shown.contains("launch_groups: [[0, 1, 2, 3]]"), "{shown}");
    let send: Vec<CudaSlice<f32>> = (0..4).map(|_| stream.alloc_zeros::<f32>(100).unwrap()).collect();
    let mut recv: Vec<CudaSlice<f32>> = (0..4).map(|_| stream.alloc_zeros::<f32>(100).unwrap()).collect();
    // Wrong number of buffers.
    let e = comm.all_reduce(&send[..3], &mut recv, ReduceOp::Sum).unwrap_err();
    assert!(matches!(e, Error::BufferCount { expected: 4, got: 3, .. }), "{e}");
    // Wrong length.
    let mut short: Vec<CudaSlice<f32>> =
        (0..4).map(|i| stream.alloc_zeros::<f32>(if i == 2 { 99 } else { 100 }).unwrap()).collect();
    let e = comm.all_reduce(&send, &mut short, ReduceOp::Sum).unwrap_err();
    assert!(matches!(e, Error::Length { rank: 2, expected: 100, got: 99, .. }), "{e}");
    // The count is the length most buffers of its list share, and that list is checked first: the
    // odd buffer is the one named, not a right buffer of the other list (an AllReduce's count from
    // its send buffers, a ReduceScatter's from its receive buffers).
    let short_first: Vec<CudaSlice<f32>> =
        (0..4).map(|i| stream.alloc_zeros::<f32>(if i == 0 { 99 } else { 100 }).unwrap()).collect();
    let e = comm.all_reduce(&short_first, &mut recv, ReduceOp::Sum).unwrap_err();
    assert!(matches!(e, Error::Length { what: "send buffer", rank: 0, expected: 100, got: 99 }), "{e}");
    let mut recv_short_first: Vec<CudaSlice<f32>> =
        (0..4).map(|i| stream.alloc_zeros::<f32>(if i == 0 { 24 } else { 25 }).unwrap()).collect();
    let e = comm.reduce_scatter(&send, &mut recv_short_first, ReduceOp::Sum).unwrap_err();
    assert!(matches!(e, Error::Length { what: "receive buffer", rank: 0, expected: 25, got: 24 }), "{e}");
    // Two ranks whose send buffers disagree: the first one's length is the count, the other's named.
    let pair = Communicator::virtual_ranks(&stream, 2, Config::default()).unwrap();
    let e = pair.all_reduce(&short_first[..2], &mut recv[..2], ReduceOp::Sum).unwrap_err();
    assert!(matches!(e, Error::Length { what: "send buffer", rank: 1, expected: 99, got: 100 }), "{e}");
    // Overlapping send buffers are fine (they are only read): every rank sends the same buffer.
    let same: Vec<CudaView<f32>> = (0..4).map(|_| send[0].slice(..)).collect();
    comm.all_reduce(&same, &mut recv, ReduceOp::Sum).unwrap();
    // A send buffer overlapping a receive buffer is not: build one through a raw pointer (safe code
    // cannot express it) and hand it back without freeing it.
    {
        use cudarc::driver::DevicePtr;
        let raw = recv[1].device_ptr(&stream).0;
        let alias: CudaSlice<f32> = unsafe { stream.upgrade_device_ptr(raw, 100) };
        let sends: Vec<CudaView<f32>> = vec![send[0].slice(..), alias.slice(..), send[2].slice(..), send[3].slice(..)];
        let e = comm.all_reduce(&sends, &mut recv, ReduceOp::Sum).unwrap_err();
        let named = matches!(
            e,
            Error::Aliasing { rank: 1, buffer: "receive buffer", other_rank: 1, other_buffer: "send buffer", .. }
        );
        assert!(named, "{e}");
        drop(sends);
        alias.leak();
    }
    // Too many CTAs for the device.
    let greedy = Communicator::virtual_ranks(&stream, 4, Config { max_ctas: Some(200), ..Config::default() }).unwrap();
    let e = greedy.all_reduce(&send, &mut recv, ReduceOp::Sum).unwrap_err();
    match &e {
        // The device's count, and how the ranks make it up.
        Error::TooManyCtas { requested, max, why } => {
            assert!(requested % 4 == 0 && max < requested && why.contains("4 ranks on GPU"), "{e}")
        }
        _ => panic!("not a CTA error: {e}"),
    }
    // A refused launch leaves no plan behind.
    assert_eq!(greedy.cached_plans(), 0, "a plan that cannot launch is not cached");
    // A rank count past the limit is refused before anything is built for it.
    let e = Communicator::virtual_ranks(&stream, usize::MAX, Config::default()).err().unwrap();
    assert!(matches!(e, Error::RankCount { ranks: usize::MAX, .. }), "{e}");
    // Deterministic with the hardware reduction is refused up front.
    let e = Communicator::virtual_ranks(&stream, 4, Config { reduction: Reduction::Tma, ..Config::default() })
        .err()
        .unwrap();
    assert!(matches!(e, Error::Config { field: "deterministic", .. }), "{e}");
    // The in-place form checks divisibility.
    let mut odd: Vec<CudaSlice<f32>> = (0..4).map(|_| stream.alloc_zeros::<f32>(10).unwrap()).collect();
    let e = comm.reduce_scatter_in_place(&mut odd, ReduceOp::Sum).unwrap_err();
    assert!(matches!(e, Error::Length { .. }), "{e}");
    // Rooted collectives: a root outside the ranks, the root's buffer of the wrong length, a Reduce's
    // receive buffer overlapping a send buffer; in place, the other ranks' buffers may overlap each
    // other where they are only read (a Broadcast's root and a Reduce's other ranks).
    let e = comm.broadcast(&send[0], &mut recv, 4).unwrap_err();
    assert!(matches!(e, Error::NoSuchRank { rank: 4, ranks: 4 }), "{e}");
    let e = comm.reduce(&send, &mut recv[0], ReduceOp::Sum, 9).unwrap_err();
    assert!(matches!(e, Error::NoSuchRank { rank: 9, ranks: 4 }), "{e}");
    let e = comm.broadcast(&short[2], &mut recv, 2).unwrap_err();
    assert!(matches!(e, Error::Length { what: "send buffer", rank: 2, expected: 100, got: 99 }), "{e}");
    let e = comm.prepare::<f32>(Collective::Reduce { root: 5 }, 100, ReduceOp::Sum, false).unwrap_err();
    assert!(matches!(e, Error::NoSuchRank { rank: 5, ranks: 4 }), "{e}");
    let e = comm.reduce(&send[..3], &mut recv[0], ReduceOp::Max, 1).unwrap_err();
    assert!(matches!(e, Error::BufferCount { what: "send buffers", expected: 4, got: 3 }), "{e}");
    {
        use cudarc::driver::DevicePtr;
        let raw = send[3].device_ptr(&stream).0;
        let mut alias: CudaSlice<f32> = unsafe { stream.upgrade_device_ptr(raw, 100) };
        let e = comm.reduce(&send, &mut alias, ReduceOp::Sum, 1).unwrap_err();
        assert!(
            matches!(
                e,
                Error::Aliasing { rank: 1, buffer: "receive buffer", other_rank: 3, other_buffer: "send buffer", .. }
            ),
            "{e}"
        );
        alias.leak();
    }
    comm.reduce(&send, &mut recv[2], ReduceOp::Sum, 2).unwrap();
    comm.broadcast(&send[1], &mut recv, 1).unwrap();
    // In place: a Reduce's ranks off the root only read their buffers, so two of them may share one;
    // the root's buffer, which the call writes, may not be another rank's, nor may two buffers a
    // Broadcast writes.
    {
        use cudarc::driver::DevicePtr;
        let raw = recv[0].device_ptr(&stream).0;
        let alias = || -> CudaSlice<f32> { unsafe { stream.upgrade_device_ptr(raw, 100) } };
        let mut bufs = vec![alias(), recv[1].clone(), alias(), recv[3].clone()];
        comm.reduce_in_place(&mut bufs, ReduceOp::Max, 1).unwrap();
        comm.synchronize().unwrap();
        let e = comm.reduce_in_place(&mut bufs, ReduceOp::Max, 2).unwrap_err();
        assert!(matches!(e, Error::Aliasing { rank: 0, buffer: "buffer", other_rank: 2, .. }), "{e}");
        let e = comm.broadcast_in_place(&mut bufs, 1).unwrap_err();
        assert!(matches!(e, Error::Aliasing { rank: 0, other_rank: 2, .. }), "{e}");
        let [a, _, b, _] = <[CudaSlice<f32>; 4]>::try_from(bufs).unwrap();
        a.leak();
        b.leak();
    }
    // A good call still works afterwards.
    comm.all_reduce(&send, &mut recv, ReduceOp::Sum).unwrap();
    comm.synchronize().unwrap();
}

#[test]
fn separate_launches_per_rank_meet_through_barriers() {
    // Ranks on distinct streams are launched as separate kernels that synchronise through their
    // workspaces: the multi-GPU code path, exercised on one GPU.
    let Some(stream) = common::gpu("separate_launches_per_rank_meet_through_barriers") else { return };
    let ctx = stream.context().clone();
    let streams: Vec<Arc<CudaStream>> = (0..4).map(|_| ctx.new_stream().unwrap()).collect();
    let comm = Communicator::from_streams(&streams, Config { max_ctas: Some(4), ..Config::default() }).unwrap();
    let mut rng = common::rng(99);
    for _ in 0..10 {
        let n = 1 + rng.random_range(0..500_000) as usize;
        let host: Vec<Vec<f32>> = (0..4).map(|_| (0..n).map(|_| rng.random_range(0..100) as f32).collect()).collect();
        let send: Vec<CudaSlice<f32>> = host.iter().zip(&streams).map(|(h, s)| s.clone_htod(h).unwrap()).collect();
        let mut recv: Vec<CudaSlice<f32>> = streams.iter().map(|s| s.alloc_zeros::<f32>(n).unwrap()).collect();
        for s in &streams {
            s.synchronize().unwrap();
        }
        comm.all_reduce(&send, &mut recv, ReduceOp::Sum).unwrap();
        comm.synchronize().unwrap();
        let want: Vec<f32> = (0..n).map(|i| host.iter().map(|h| h[i]).sum()).collect();
        for (r, b) in recv.iter().enumerate() {
            assert_eq!(streams[r].clone_dtoh(b).unwrap(), want, "rank {r}");
        }
    }
}

/// Two ranks on streams of their own on `stream`'s device (one CTA each, a 50 ms timeout); rank
/// `r`'s input is `n` elements of `r + 1`, its output `n` zeros.
struct TwoRanks {
    streams: Vec<Arc<CudaStream>>,
    comm: Communicator,
    send: Vec<CudaSlice<f32>>,
    recv: Vec<CudaSlice<f32>>,
}

impl TwoRanks {
    fn new(stream: &Arc<CudaStream>, n: usize) -> Self {
        let ctx = stream.context().clone();
        let streams: Vec<Arc<CudaStream>> = (0..2).map(|_| ctx.new_stream().unwrap()).collect();
        let config = Config { max_ctas: Some(1), timeout: std::time::Duration::from_millis(50), ..Config::default() };
        let comm = Communicator::from_streams(&streams, config).unwrap();
        let send = streams.iter().enumerate().map(|(r, s)| s.clone_htod(&vec![r as f32 + 1.0; n]).unwrap()).collect();
        let recv = streams.iter().map(|s| s.alloc_zeros::<f32>(n).unwrap()).collect();
        TwoRanks { streams, comm, send, recv }
    }
}

/// Holds rank 1's stream on the host, calls AllReduce, and waits until rank 0's launch has ended,
/// which it can only do by giving up its wait for rank 1 at the start barrier; returns the gate,
/// still holding rank 1.
fn call_while_rank_1_is_held(
    streams: &[Arc<CudaStream>],
    comm: &Communicator,
    send: &[CudaSlice<f32>],
    recv: &mut [CudaSlice<f32>],
    what: &str,
) -> common::Gate {
    let gate = common::Gate::hold(&streams[1], std::time::Duration::from_secs(60));
    assert!(!comm.query().unwrap(), "{what}: rank 1's stream is held");
    comm.all_reduce(send, recv, ReduceOp::Sum).unwrap();
    let gave_up = common::ends_within(std::time::Duration::from_secs(30), || common::idle(&streams[0]));
    assert!(gave_up && !gate.forced(), "{what}: rank 0's launch did not end while rank 1 was held");
    gate
}

/// A device-side error reaches the host without `Communicator::synchronize`: after cudarc's own
/// stream waits (which read no error record) the next call returns it and launches nothing, and
/// `query` reports it without blocking; later calls are refused until `reset`, and calls after it
/// are exact. The error: rank 1's stream is held on the host until rank 0's launch has given up its
/// 50 ms wait for rank 1 at the start barrier.
#[test]
fn a_device_error_reaches_the_next_call_and_query() {
    let Some(stream) = common::gpu("a_device_error_reaches_the_next_call_and_query") else { return };
    let n = 4096;
    let TwoRanks { streams, comm, send, mut recv } = TwoRanks::new(&stream, n);
    let exact = |comm: &Communicator, recv: &mut [CudaSlice<f32>], what: &str| {
        comm.all_reduce(&send, recv, ReduceOp::Sum).unwrap();
        comm.synchronize().unwrap();
        assert!(comm.query().unwrap(), "{what}: nothing left to run");
        for (r, b) in recv.iter().enumerate() {
            assert_eq!(streams[r].clone_dtoh(b).unwrap(), vec![3.0; n], "{what}: rank {r}");
        }
    };
    for s in &streams {
        s.synchronize().unwrap();
    }
    exact(&comm, &mut recv, "before");
    for round in ["the next call", "query"] {
        let gate = call_while_rank_1_is_held(&streams, &comm, &send, &mut recv, round);
        gate.release();
        for s in &streams {
            s.synchronize().unwrap();
        }
        // Outputs marked, to show that the refused calls below launch nothing.
        for (b, s) in recv.iter_mut().zip(&streams) {
            s.memcpy_htod(&vec![-1.0f32; n], b).unwrap();
            s.synchronize().unwrap();
        }
        let e = match round {
            "query" => comm.query().expect_err("query must report the recorded error"),
            _ => comm.all_reduce(&send, &mut recv, ReduceOp::Sum).expect_err("the next call must report the error"),
        };
        eprintln!("{round}: {e}");
        assert!(
            matches!(&e, Error::Timeout { wait: oxccl::engine::abi::WaitKind::StartBarrier, rank: 0, peer: 1, .. }),
            "{round}: expected rank 0's start-barrier timeout, got {e}"
        );
        let refused = comm.all_reduce(&send, &mut recv, ReduceOp::Sum);
        assert!(matches!(refused, Err(Error::Poisoned)), "{round}: a call before the reset: {refused:?}");
        for (r, (b, s)) in recv.iter().zip(&streams).enumerate() {
            assert_eq!(s.clone_dtoh(b).unwrap(), vec![-1.0; n], "{round}: a refused call wrote rank {r}'s output");
        }
        comm.reset().unwrap();
        exact(&comm, &mut recv, round);
    }
}

/// An error cudarc kept for the context (what a failed buffer-guard wait or event, or a failed free
/// in a drop, leaves: cudarc's functions that cannot return an error store it) is reported by the
/// next call as `KeptDriverError` before either rank's launch is queued: the outputs keep their
/// mark, the communicator is not poisoned, and the call after it is exact. Before, the launch that
/// found it reported it, and with launches on several devices one found after another device's
/// launch was queued left the communicator poisoned.
#[test]
fn a_kept_cudarc_error_is_reported_before_any_launch() {
    use cudarc::driver::{DriverError, sys::CUresult};
    let Some(stream) = common::gpu("a_kept_cudarc_error_is_reported_before_any_launch") else { return };
    let n = 4096;
    let TwoRanks { streams, comm, send, mut recv } = TwoRanks::new(&stream, n);
    for (b, s) in recv.iter_mut().zip(&streams) {
        s.memcpy_htod(&vec![-1.0f32; n], b).unwrap();
        s.synchronize().unwrap();
    }
    // The plan is built and cached first (a first call's upload would meet the error instead).
    comm.prepare::<f32>(Collective::AllReduce, n, ReduceOp::Sum, false).unwrap();
    let ctx = stream.context();
    ctx.record_err::<()>(Err(DriverError(CUresult::CUDA_ERROR_INVALID_VALUE)));
    let e = comm.all_reduce(&send, &mut recv, ReduceOp::Sum).expect_err("the kept error must be reported");
    eprintln!("{e}");
    assert!(
        matches!(&e, Error::KeptDriverError { ordinal, source }
            if *ordinal == ctx.ordinal() && source.0 == CUresult::CUDA_ERROR_INVALID_VALUE),
        "expected the kept error, got {e:?}"
    );
    assert!(ctx.check_err().is_ok(), "the kept error is reported once, not left for the next call");
    for (r, (b, s)) in recv.iter().zip(&streams).enumerate() {
        assert_eq!(s.clone_dtoh(b).unwrap(), vec![-1.0; n], "rank {r}'s output written by a refused call");
    }
    assert!(comm.query().unwrap(), "nothing was queued and nothing recorded");
    comm.all_reduce(&send, &mut recv, ReduceOp::Sum).unwrap();
    comm.synchronize().unwrap();
    for (r, b) in recv.iter().enumerate() {
        assert_eq!(streams[r].clone_dtoh(b).unwrap(), vec![3.0; n], "the call after: rank {r}");
    }

    // Ranks whose streams come from two `CudaContext` values of one device (cudarc keeps an error
    // per value): an error kept by the second rank's is found before the first rank's launch, not
    // at the second rank's launch after the first one's was queued (which poisoned).
    let other = cudarc::driver::CudaContext::new(ctx.ordinal()).unwrap();
    assert!(!Arc::ptr_eq(&other, ctx), "a second CudaContext value");
    let streams = [ctx.new_stream().unwrap(), other.new_stream().unwrap()];
    let config = Config { max_ctas: Some(1), timeout: std::time::Duration::from_millis(50), ..Config::default() };
    let comm = Communicator::from_streams(&streams, config).unwrap();
    let send: Vec<CudaSlice<f32>> =
        streams.iter().enumerate().map(|(r, s)| s.clone_htod(&vec![r as f32 + 1.0; n]).unwrap()).collect();
    let mut recv: Vec<CudaSlice<f32>> = streams.iter().map(|s| s.clone_htod(&vec![-1.0f32; n]).unwrap()).collect();
    comm.prepare::<f32>(Collective::AllReduce, n, ReduceOp::Sum, false).unwrap();
    other.record_err::<()>(Err(DriverError(CUresult::CUDA_ERROR_INVALID_VALUE)));
    let e = comm.all_reduce(&send, &mut recv, ReduceOp::Sum).expect_err("the second context's kept error");
    assert!(matches!(&e, Error::KeptDriverError { .. }), "expected the kept error, got {e:?}");
    for (r, (b, s)) in recv.iter().zip(&streams).enumerate() {
        assert_eq!(
            s.clone_dtoh(b).unwrap(),
            vec![-1.0; n],
            "two contexts: rank {r}'s output written by a refused call"
        );
    }
    assert!(comm.query().unwrap(), "two contexts: nothing was queued and nothing recorded");
    comm.all_reduce(&send, &mut recv, ReduceOp::Sum).unwrap();
    comm.synchronize().unwrap();
    for (r, b) in recv.iter().enumerate() {
        assert_eq!(streams[r].clone_dtoh(b).unwrap(), vec![3.0; n], "two contexts, the call after: rank {r}");
    }
}

/// A rank that gave up a call is free of it once its launch has ended: a peer that starts the call
/// later finds the rank's arrival revoked and touches none of its buffers (before, it ran its tasks
/// and wrote its shard into the rank's output after the rank's stream had moved on). Rank 1's
/// stream is held on the host until rank 0's launch has given up its 50 ms wait at the start
/// barrier; then rank 0's stream overwrites its output, and only then is rank 1 released.
#[test]
fn a_late_peer_leaves_the_buffers_of_a_rank_that_gave_up_alone() {
    let Some(stream) = common::gpu("a_late_peer_leaves_the_buffers_of_a_rank_that_gave_up_alone") else { return };
    let n = 1 << 16;
    let TwoRanks { streams, comm, send, mut recv } = TwoRanks::new(&stream, n);
    // Rank 1's output marked before its stream is held: a task of rank 1 would overwrite it.
    streams[1].memcpy_htod(&vec![-2.0f32; n], &mut recv[1]).unwrap();
    for s in &streams {
        s.synchronize().unwrap();
    }
    let gate = call_while_rank_1_is_held(&streams, &comm, &send, &mut recv, "the call");
    // Rank 0's stream moves on: its output is its own again.
    streams[0].memcpy_htod(&vec![-1.0f32; n], &mut recv[0]).unwrap();
    streams[0].synchronize().unwrap();
    gate.release();
    streams[1].synchronize().unwrap();
    let late = streams[0].clone_dtoh(&recv[0]).unwrap();
    let written = late.iter().filter(|&&v| v != -1.0).count();
    assert_eq!(written, 0, "rank 1 wrote {written} elements of rank 0's output after rank 0's launch ended");
    let own = streams[1].clone_dtoh(&recv[1]).unwrap();
    assert!(own.iter().all(|&v| v == -2.0), "rank 1 ran tasks of a call rank 0 had withdrawn from");
    // Rank 1's launch records its stop (`PeerAborted`) in its own status record; the communicator
    // reports the cause.
    let e = comm.synchronize().expect_err("the call gave up");
    eprintln!("{e}");
    assert!(
        matches!(&e, Error::Timeout { wait: oxccl::engine::abi::WaitKind::StartBarrier, rank: 0, peer: 1, .. }),
        "expected rank 0's start-barrier timeout (the cause), got {e}"
    );
    comm.reset().unwrap();
    comm.all_reduce(&send, &mut recv, ReduceOp::Sum).unwrap();
    comm.synchronize().unwrap();
    for (r, b) in recv.iter().enumerate() {
        assert_eq!(streams[r].clone_dtoh(b).unwrap(), vec![3.0; n], "after the reset: rank {r}");
    }
}

#[test]
fn regression_in_place_reduce_scatter_odd_block_bulk_reduce() {
    // Found by the random cases: in-place ReduceScatter whose block (1474 B) leaves the outputs only
    // 2-byte aligned, reduced by cp.reduce.async.bulk.
    let Some(stream) = common::gpu("regression_in_place_reduce_scatter_odd_block_bulk_reduce") else { return };
    let mut rng = common::rng(61);
    for (dtype, op) in [(DType::Bf16, ReduceOp::Max), (DType::F32, ReduceOp::Sum), (DType::F16, ReduceOp::Sum)] {
        let spec = PlanSpec {
            collective: Collective::ReduceScatter,
            count: 737,
            dtype,
            op,
            ranks: 6,
            in_place: true,
            ctas: 17,
            reduction: Reduction::Tma,
        };
        let comm = Communicator::virtual_ranks(&stream, 6, config(&spec, Mover::Tma)).unwrap();
        let elems = spec.buffer_bytes().0 as usize / dtype.size();
        let inputs = inputs(&spec, elems, &mut rng, true);
        let got = run_gpu(&comm, &same(&stream, spec.ranks), &spec, &inputs, |_| 0)
            .unwrap_or_else(|e| panic!("{dtype:?} {op:?}: {e}"));
        assert!(got == tccl::reference(&spec, &inputs), "{dtype:?} {op:?}");
    }
}

/// A call waits for reads of its buffers queued on other streams (cudarc's events): an in-place
/// AllReduce queued after copies out of its buffers on another stream, which first spends tens of
/// milliseconds on other copies, leaves those copies the inputs.
#[test]
fn a_call_waits_for_reads_of_its_buffers_on_other_streams() {
    let Some(stream) = common::gpu("a_call_waits_for_reads_of_its_buffers_on_other_streams") else { return };
    let ctx = stream.context().clone();
    let (home, other) = (ctx.new_stream().unwrap(), ctx.new_stream().unwrap());
    let (ranks, n) = (4usize, 1usize << 20);
    let comm = Communicator::virtual_ranks(&home, ranks, Config { max_ctas: Some(2), ..Config::default() }).unwrap();
    // Prepared: the call queues its launch and nothing else (no upload, no device synchronisation).
    comm.prepare::<f32>(Collective::AllReduce, n, ReduceOp::Sum, true).unwrap();
    let mut bufs: Vec<CudaSlice<f32>> =
        (0..ranks).map(|r| home.clone_htod(&vec![r as f32 + 1.0; n]).unwrap()).collect();
    let mut copies: Vec<CudaSlice<f32>> = (0..ranks).map(|_| other.alloc_zeros::<f32>(n).unwrap()).collect();
    let scratch = other.alloc_zeros::<u8>(1 << 30).unwrap();
    let mut sink = other.alloc_zeros::<u8>(1 << 30).unwrap();
    home.synchronize().unwrap();
    other.synchronize().unwrap();
    for _ in 0..40 {
        other.memcpy_dtod(&scratch, &mut sink).unwrap();
    }
    for (b, c) in bufs.iter().zip(copies.iter_mut()) {
        other.memcpy_dtod(b, c).unwrap();
    }
    comm.all_reduce_in_place(&mut bufs, ReduceOp::Sum).unwrap();
    comm.synchronize().unwrap();
    other.synchronize().unwrap();
    let sum: f32 = (1..=ranks).map(|r| r as f32).sum();
    for r in 0..ranks {
        let copy = other.clone_dtoh(&copies[r]).unwrap();
        assert!(
            copy.iter().all(|&x| x == r as f32 + 1.0),
            "rank {r}: the copy read {} (the input was {})",
            copy[0],
            r + 1
        );
        let got = home.clone_dtoh(&bufs[r]).unwrap();
        assert!(got.iter().all(|&x| x == sum), "rank {r}: {} (want {sum})", got[0]);
    }
}

/// A call waits for no other stream: three calls, each queued while another stream of the device is
/// held on the host (a host function that blocks until the test lets it go), must each end while
/// that stream is still held.
/// The first call of the communicator (its kernel loaded by the engine beforehand, not by the call:
/// a kernel loaded lazily by the call made its launch wait for the held stream, docs/PERF.md), a
/// call of a new size (its plan uploaded in order on the ranks' streams, not with a device-wide
/// wait) and a repeated call.
#[test]
fn calls_end_before_a_held_stream_on_the_device() {
    use std::time::Duration;
    let Some(stream) = common::gpu("calls_end_before_a_held_stream_on_the_device") else { return };
    let ctx = stream.context().clone();
    let (home, other) = (ctx.new_stream().unwrap(), ctx.new_stream().unwrap());
    let ranks = 4;
    let comm = Communicator::virtual_ranks(&home, ranks, Config { max_ctas: Some(2), ..Config::default() }).unwrap();
    let mut late = Vec::new();
    for (what, n) in [("first call", 300_001usize), ("new size", 200_003), ("repeated call", 200_003)] {
        let send: Vec<CudaSlice<f32>> = (0..ranks).map(|r| home.clone_htod(&vec![r as f32; n]).unwrap()).collect();
        let mut recv: Vec<CudaSlice<f32>> = (0..ranks).map(|_| home.alloc_zeros::<f32>(n).unwrap()).collect();
        home.synchronize().unwrap();
        other.synchronize().unwrap();
        let gate = common::Gate::hold(&other, Duration::from_secs(60));
        comm.all_reduce(&send, &mut recv, ReduceOp::Sum).unwrap();
        let ended = common::ends_within(Duration::from_secs(30), || comm.query().unwrap());
        if !ended || gate.forced() {
            late.push(what);
        }
        gate.release();
        comm.synchronize().unwrap();
        for (r, b) in recv.iter().enumerate() {
            assert_eq!(home.clone_dtoh(b).unwrap(), vec![6.0; n], "{what}: rank {r}");
        }
    }
    other.synchronize().unwrap();
    assert!(late.is_empty(), "calls that did not end while the other stream was held: {late:?}");
}

/// `clear_plans` through a shared reference while another thread makes calls: every call's plan is
/// either the cached one or one taken before a clear, which lives until its launches end. Every
/// call's result is checked: the calls rotate over four sets of buffers, each with inputs of its own
/// and outputs zeroed before its call, and each batch of four is checked before the next.
#[test]
fn plans_clear_while_another_thread_calls() {
    let Some(stream) = common::gpu("plans_clear_while_another_thread_calls") else { return };
    let comm = Communicator::virtual_ranks(&stream, 4, Config::default()).unwrap();
    let n = 1 << 16;
    // Set s: rank r's input is r + 1 + s, so the sum is 10 + 4s.
    let sets = 4;
    let send: Vec<Vec<CudaSlice<f32>>> =
        (0..sets).map(|s| (0..4).map(|r| stream.clone_htod(&vec![(r + 1 + s) as f32; n]).unwrap()).collect()).collect();
    let mut recv: Vec<Vec<CudaSlice<f32>>> =
        (0..sets).map(|_| (0..4).map(|_| stream.alloc_zeros::<f32>(n).unwrap()).collect()).collect();
    let calls = 200;
    let mut clears = 0;
    std::thread::scope(|scope| {
        let caller = scope.spawn(|| {
            for batch in 0..calls / sets {
                for (s, (send, recv)) in send.iter().zip(recv.iter_mut()).enumerate() {
                    for b in recv.iter_mut() {
                        stream.memset_zeros(b).unwrap();
                    }
                    comm.all_reduce(send, recv, ReduceOp::Sum).unwrap_or_else(|e| panic!("batch {batch} set {s}: {e}"));
                }
                comm.synchronize().unwrap();
                for (s, recv) in recv.iter().enumerate() {
                    let want = (10 + 4 * s) as f32;
                    for (r, b) in recv.iter().enumerate() {
                        let got = stream.clone_dtoh(b).unwrap();
                        let wrong = got.iter().filter(|&&x| x != want).count();
                        assert_eq!(wrong, 0, "batch {batch} set {s} rank {r}: {wrong} elements not {want}");
                    }
                }
            }
        });
        while !caller.is_finished() {
            comm.clear_plans().unwrap();
            clears += 1;
        }
        caller.join().unwrap();
    });
    assert!(clears > 0);
    println!("{calls} calls beside {clears} clears of the plan cache");
}

/// AllGather, Broadcast and AllToAll of element types without kernels of their own (f64, i64, a
/// 3-byte struct), moved byte for byte in 4- and 1-byte units, out of place and in place, on
/// 4 virtual ranks, at counts that leave odd tails: every rank's result equals the definition.
#[test]
fn plain_types_are_copied_exactly() {
    let Some(stream) = common::gpu("plain_types_are_copied_exactly") else { return };
    let p = 4;
    let comm = Communicator::from_streams(&same(&stream, p), Config::default()).unwrap();
    fn check<T: oxccl::Plain + PartialEq + std::fmt::Debug>(
        comm: &Communicator,
        stream: &Arc<CudaStream>,
        value: impl Fn(usize, usize) -> T,
        zero: T,
    ) {
        let p = comm.ranks();
        for n in [1usize, 7, 1000, 4099] {
            let inputs: Vec<Vec<T>> = (0..p).map(|r| (0..n).map(|i| value(r, i)).collect()).collect();
            let send: Vec<CudaSlice<T>> = inputs.iter().map(|v| stream.clone_htod(v).unwrap()).collect();
            // AllGather.
            let mut recv: Vec<CudaSlice<T>> = (0..p).map(|_| stream.clone_htod(&vec![zero; n * p]).unwrap()).collect();
            // The plan `prepare_copy` builds is the one the call takes.
            comm.prepare_copy::<T>(Collective::AllGather, n, false).unwrap();
            let plans = comm.cached_plans();
            comm.all_gather(&send, &mut recv).unwrap();
            assert_eq!(comm.cached_plans(), plans, "the call built a plan prepare_copy did not");
            let gathered: Vec<T> = inputs.concat();
            let mut bufs: Vec<CudaSlice<T>> = (0..p)
                .map(|r| {
                    let mut b = vec![zero; n * p];
                    b[r * n..(r + 1) * n].copy_from_slice(&inputs[r]);
                    stream.clone_htod(&b).unwrap()
                })
                .collect();
            comm.all_gather_in_place(&mut bufs).unwrap();
            comm.synchronize().unwrap();
            for r in 0..p {
                assert_eq!(stream.clone_dtoh(&recv[r]).unwrap(), gathered, "all_gather, rank {r}, {n} elements");
                assert_eq!(stream.clone_dtoh(&bufs[r]).unwrap(), gathered, "all_gather in place, rank {r}, {n}");
            }
            // Broadcast from rank 1, out of place and in place.
            let mut recv: Vec<CudaSlice<T>> = (0..p).map(|_| stream.clone_htod(&vec![zero; n]).unwrap()).collect();
            comm.broadcast(&send[1], &mut recv, 1).unwrap();
            let mut bufs: Vec<CudaSlice<T>> = inputs.iter().map(|v| stream.clone_htod(v).unwrap()).collect();
            comm.broadcast_in_place(&mut bufs, 2).unwrap();
            comm.synchronize().unwrap();
            for r in 0..p {
                assert_eq!(stream.clone_dtoh(&recv[r]).unwrap(), inputs[1], "broadcast, rank {r}, {n}");
                assert_eq!(stream.clone_dtoh(&bufs[r]).unwrap(), inputs[2], "broadcast in place, rank {r}, {n}");
            }
            // AllToAll: block q of rank r's send to block r of rank q's receive buffer.
            let blocks: Vec<Vec<T>> = (0..p).map(|r| (0..n * p).map(|i| value(r, i + 7)).collect()).collect();
            let send: Vec<CudaSlice<T>> = blocks.iter().map(|v| stream.clone_htod(v).unwrap()).collect();
            let mut recv: Vec<CudaSlice<T>> = (0..p).map(|_| stream.clone_htod(&vec![zero; n * p]).unwrap()).collect();
            comm.all_to_all(&send, &mut recv).unwrap();
            comm.synchronize().unwrap();
            for q in 0..p {
                let want: Vec<T> = (0..p).flat_map(|r| blocks[r][q * n..(q + 1) * n].iter().copied()).collect();
                assert_eq!(stream.clone_dtoh(&recv[q]).unwrap(), want, "all_to_all, rank {q}, {n}");
            }
        }
    }
    check(&comm, &stream, |r, i| (r * 1_000_003 + i) as f64 * 0.5 - 7.25, 0.0);
    check(&comm, &stream, |r, i| -((r as i64) << 40) - i as i64, 0);
    check(&comm, &stream, |r, i| common::Rgb([r as u8, i as u8, (i >> 8) as u8 ^ 0x5a]), common::Rgb([0; 3]));
    println!("f64, i64 and a 3-byte type copied exactly by AllGather, Broadcast and AllToAll on {p} ranks");
}
