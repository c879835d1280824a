//! `Communicator::reshard` on virtual ranks on one GPU, exact against the global tensor: random layouts
//! (meshes of up to 16 ranks anywhere in the communicator, replicas, several axes on one dim, uneven and
//! empty shards, overlapping and coinciding meshes), every element type, both routes, both movers, every
//! CTA owner, one launch for all ranks or one per rank (barriers); destination buffers poisoned first.
//! Then the layer-sized case (a 7168 × 18432 bf16 weight, TP8 → TP2 × DP4 over 16 ranks, row- and
//! column-sharded sources) and misuse as typed errors. Skips loudly without a Hopper GPU.

mod common;

use cudarc::driver::{CudaSlice, CudaStream, CudaView, CudaViewMut};
use oxccl::reshard::{CtaOwner, Layout, Mesh, Placement, PlanOptions, Route};
use oxccl::{Communicator, Config, DType, Error, Mover, ReshardOptions};
use rand::RngExt;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

/// Case count: `OXCCL_RESHARD_CASES` or 200.
fn cases() -> usize {
    common::count_from_env("OXCCL_RESHARD_CASES", 200)
}

/// A random layout for a tensor of `rank` dims on a mesh inside ranks `0..world`.
fn random_layout(rng: &mut common::Rng, rank: usize, world: u32) -> Layout {
    let dims = loop {
        let axes = 1 + rng.random_range(0..3) as usize;
        let dims: Vec<u32> = (0..axes).map(|_| 1 + rng.random_range(0..4) as u32).collect();
        if dims.iter().product::<u32>() <= world {
            break dims;
        }
    };
    let size: u32 = dims.iter().product();
    let start = rng.random_range(0..u64::from(world - size) + 1) as u32;
    let placements = dims
        .iter()
        .map(|_| {
            if rank == 0 || rng.random_range(0..3) == 0 {
                Placement::Replicate
            } else {
                Placement::Shard(rng.random_range(0..rank as u64) as u32)
            }
        })
        .collect();
    Layout::new(Mesh::new(dims, start).unwrap(), placements).unwrap()
}

/// A random global shape: 0 to 3 dims, mostly small, sometimes large (at most 4 Mi elements, 1 Mi for
/// three dims, so no plan needs more than a few million row tasks).
fn random_shape(rng: &mut common::Rng) -> Vec<u64> {
    let rank = rng.random_range(0..4) as usize;
    let big = rng.random_range(0..3) == 0;
    let mut shape: Vec<u64> = (0..rank)
        .map(|_| match rng.random_range(0..12) {
            0 => 0,
            _ if big => 1 + rng.random_range(0..3000),
            _ => 1 + rng.random_range(0..9),
        })
        .collect();
    let limit = if rank == 3 { 1 << 20 } else { 4 << 20 };
    while shape.iter().product::<u64>() > limit {
        let d = rng.random_range(0..shape.len() as u64) as usize;
        shape[d] = shape[d].div_ceil(2);
    }
    shape
}

/// Every rank's shard of `global` (elements of `elem` bytes) under `layout`, as bytes.
fn shards(layout: &Layout, shape: &[u64], global: &[u8], elem: usize) -> HashMap<u32, Vec<u8>> {
    let sharding = layout.on(shape).unwrap();
    let strides: Vec<u64> = (0..shape.len()).map(|d| shape[d + 1..].iter().product()).collect();
    let mut out = HashMap::new();
    for rank in sharding.mesh().ranks() {
        let region = sharding.local_region(rank).unwrap();
        let mut bytes = Vec::with_capacity(region.volume() as usize * elem);
        if !region.is_empty() {
            let (run, outer) = region.extent.split_last().map_or((1, &[][..]), |(r, o)| (*r, o));
            let k = outer.len();
            let mut idx = vec![0u64; k];
            'rows: loop {
                let mut at = (0..k).map(|d| (region.start[d] + idx[d]) * strides[d]).sum::<u64>();
                if let Some(&s) = region.start.get(k) {
                    at += s;
                }
                let (a, b) = (at as usize * elem, (at + run) as usize * elem);
                bytes.extend_from_slice(&global[a..b]);
                let mut d = k;
                loop {
                    if d == 0 {
                        break 'rows;
                    }
                    d -= 1;
                    idx[d] += 1;
                    if idx[d] < outer[d] {
                        break;
                    }
                    idx[d] = 0;
                }
            }
        }
        out.insert(rank, bytes);
    }
    out
}

/// Per-rank device buffers of one side, rank r's on `streams[r]`'s GPU: `Some` for ranks of the mesh
/// (at least 16 bytes allocated so empty shards still get a buffer to view), `None` elsewhere.
fn upload(streams: &[Arc<CudaStream>], data: &HashMap<u32, Vec<u8>>) -> Vec<Option<CudaSlice<u8>>> {
    (0..streams.len() as u32)
        .map(|r| {
            data.get(&r).map(|d| {
                let mut padded = d.clone();
                padded.resize(d.len().max(16), 0xA5);
                streams[r as usize].clone_htod(&padded).unwrap()
            })
        })
        .collect()
}

/// Runs one reshard with element type `T` on byte buffers; `lens[r]` is rank r's shard in bytes.
/// `empty_as_none`: ranks with empty shards pass `None` instead of an empty view. `op`: through
/// `reshard_reduce` with this operator (a `Partial` source) instead of `reshard`.
#[allow(clippy::too_many_arguments)]
fn call<T: oxccl::Element>(
    comm: &Communicator,
    src: &[Option<CudaSlice<u8>>],
    src_lens: &HashMap<u32, usize>,
    dst: &mut [Option<CudaSlice<u8>>],
    dst_lens: &HashMap<u32, usize>,
    shape: &[u64],
    layouts: (&Layout, &Layout),
    options: &ReshardOptions,
    empty_as_none: bool,
    op: Option<oxccl::ReduceOp>,
) -> Result<(), Error> {
    let e = std::mem::size_of::<T>();
    // SAFETY: byte buffers viewed as whole elements (lengths are multiples of the element size; cudarc
    // allocations are 256-byte aligned).
    let src_views: Vec<Option<CudaView<T>>> = src
        .iter()
        .enumerate()
        .map(|(r, b)| {
            let n = src_lens.get(&(r as u32)).copied().unwrap_or(0) / e;
            b.as_ref().filter(|_| !(empty_as_none && n == 0)).map(|b| unsafe { b.transmute::<T>(n) }.unwrap())
        })
        .collect();
    let mut dst_views: Vec<Option<CudaViewMut<T>>> = dst
        .iter_mut()
        .enumerate()
        .map(|(r, b)| {
            let n = dst_lens.get(&(r as u32)).copied().unwrap_or(0) / e;
            b.as_mut().filter(|_| !(empty_as_none && n == 0)).map(|b| unsafe { b.transmute_mut::<T>(n) }.unwrap())
        })
        .collect();
    let src_refs: Vec<Option<&CudaView<T>>> = src_views.iter().map(Option::as_ref).collect();
    let mut dst_refs: Vec<Option<&mut CudaViewMut<T>>> = dst_views.iter_mut().map(Option::as_mut).collect();
    match op {
        Some(op) => comm.reshard_reduce(&src_refs, &mut dst_refs, shape, layouts.0, layouts.1, op, options),
        None => comm.reshard(&src_refs, &mut dst_refs, shape, layouts.0, layouts.1, options),
    }
}

/// One random case.
struct Case {
    world: usize,
    shape: Vec<u64>,
    src: Layout,
    dst: Layout,
    dtype: DType,
    mover: Mover,
    ctas: u32,
    /// One launch per rank (meeting through barriers) instead of one for all.
    separate: bool,
    options: ReshardOptions,
    /// Ranks with empty shards pass `None` instead of an empty view.
    empty_as_none: bool,
    global: Vec<u8>,
}

impl Case {
    /// A case on `worlds.0..=worlds.1` ranks.
    fn random(rng: &mut common::Rng, worlds: (usize, usize)) -> Case {
        let world = worlds.0 + rng.random_range(0..(worlds.1 - worlds.0 + 1) as u64) as usize;
        let shape = random_shape(rng);
        let src = random_layout(rng, shape.len(), world as u32);
        let dst = random_layout(rng, shape.len(), world as u32);
        let dtype = DType::ALL[rng.random_range(0..DType::ALL.len() as u64) as usize];
        let mover = if rng.random_range(0..3) == 0 { Mover::Simt } else { Mover::Tma };
        let ctas = 1 + rng.random_range(0..4) as u32;
        let separate = rng.random_range(0..8) == 0;
        let options = ReshardOptions {
            plan: PlanOptions {
                route: if rng.random_range(0..2) == 0 { Route::Direct } else { Route::Hierarchical },
                domain_size: 1 + rng.random_range(0..8) as u32,
                min_split_bytes: [0, 64, 4096, PlanOptions::MIN_SPLIT_BYTES, u64::MAX][rng.random_range(0..5) as usize],
            },
            owner: [CtaOwner::Reader, CtaOwner::Writer, CtaOwner::Balanced][rng.random_range(0..3) as usize],
        };
        let empty_as_none = rng.random_range(0..2) == 0;
        let n: u64 = shape.iter().product();
        let global = common::random_bytes(rng, n as usize * dtype.size());
        Case { world, shape, src, dst, dtype, mover, ctas, separate, options, empty_as_none, global }
    }

    fn describe(&self, case: usize, seed: u64) -> String {
        format!(
            "case {case} (seed {seed}): shape {:?} {:?} {} -> {} on {} ranks, {} CTAs, {:?}, separate launches {}, \
             {:?}",
            self.shape, self.dtype, self.src, self.dst, self.world, self.ctas, self.mover, self.separate, self.options
        )
    }

    /// (source shards, destination shards) cut from the global tensor.
    fn shards(&self) -> (HashMap<u32, Vec<u8>>, HashMap<u32, Vec<u8>>) {
        let e = self.dtype.size();
        (shards(&self.src, &self.shape, &self.global, e), shards(&self.dst, &self.shape, &self.global, e))
    }
}

/// Runs case `c` on `comm`, rank r's buffers on `streams[r]`'s GPU (destinations poisoned first),
/// and compares every destination shard byte for byte with the global tensor's; panics naming `what`.
fn run_case(comm: &Communicator, streams: &[Arc<CudaStream>], c: &Case, what: &str) {
    let (src_data, want) = c.shards();
    run_with(comm, streams, c, (&src_data, &want), None, what);
}

/// Every rank's shard, as bytes.
type Shards = HashMap<u32, Vec<u8>>;

/// Runs case `c` on `comm` from the source shards `data.0`, through `reshard_reduce` with `op` where
/// given, and compares every destination shard byte for byte with `data.1`; panics naming `what`.
fn run_with(
    comm: &Communicator,
    streams: &[Arc<CudaStream>],
    c: &Case,
    (src_data, want): (&Shards, &Shards),
    op: Option<oxccl::ReduceOp>,
    what: &str,
) {
    let poison: HashMap<u32, Vec<u8>> = want.iter().map(|(&r, w)| (r, vec![0xA5; w.len()])).collect();
    let src_bufs = upload(streams, src_data);
    let mut dst_bufs = upload(streams, &poison);
    for s in streams {
        s.synchronize().unwrap();
    }
    let src_lens = src_data.iter().map(|(&r, d)| (r, d.len())).collect();
    let dst_lens = want.iter().map(|(&r, d)| (r, d.len())).collect();
    let layouts = (&c.src, &c.dst);
    oxccl::with_element!(c.dtype, |T| call::<T>(
        comm,
        &src_bufs,
        &src_lens,
        &mut dst_bufs,
        &dst_lens,
        &c.shape,
        layouts,
        &c.options,
        c.empty_as_none,
        op
    ))
    .unwrap_or_else(|e| panic!("{what}: {e}"));
    comm.synchronize().unwrap_or_else(|e| panic!("{what}: {e}"));
    for (r, w) in want {
        let got = streams[*r as usize].clone_dtoh(dst_bufs[*r as usize].as_ref().unwrap()).unwrap();
        if let Some(at) = got[..w.len()].iter().zip(w).position(|(a, b)| a != b) {
            panic!("{what}: rank {r} first wrong byte {at} of {}", w.len());
        }
    }
}

/// The communicator case `c` runs on, built on first use: `c.world` virtual ranks of `stream`'s GPU
/// in one launch, or launched one per rank on `per_rank_streams` (`c.separate`).
fn comm_for<'a>(
    comms: &'a mut HashMap<(usize, u32, Mover, bool), Communicator>,
    c: &Case,
    stream: &Arc<CudaStream>,
    per_rank_streams: &[Arc<CudaStream>],
) -> &'a Communicator {
    comms.entry((c.world, c.ctas, c.mover, c.separate)).or_insert_with(|| {
        let config =
            Config { max_ctas: Some(c.ctas), mover: c.mover, timeout: Duration::from_secs(10), ..Config::default() };
        if c.separate {
            Communicator::from_streams(&per_rank_streams[..c.world], config).unwrap()
        } else {
            Communicator::virtual_ranks(stream, c.world, config).unwrap()
        }
    })
}

fn seed() -> u64 {
    common::seed_from_env(0x5E5A_4D00)
}

#[test]
fn random_reshards_match_the_global_tensor() {
    let Some(stream) = common::gpu("random_reshards_match_the_global_tensor") else { return };
    let seed = seed();
    let mut rng = common::rng(seed);
    let ctx = stream.context().clone();
    let per_rank_streams: Vec<Arc<CudaStream>> = (0..16).map(|_| ctx.new_stream().unwrap()).collect();
    let mut comms: HashMap<(usize, u32, Mover, bool), Communicator> = HashMap::new();
    for case in 0..cases() {
        let c = Case::random(&mut rng, (1, 16));
        let what = c.describe(case, seed);
        let comm = comm_for(&mut comms, &c, &stream, &per_rank_streams);
        run_case(comm, &vec![stream.clone(); c.world], &c, &what);
    }
    eprintln!("{} reshard cases matched the global tensor (seed {seed})", cases());
}

/// Random reshards with one rank per GPU (2 up to every visible GPU; each rank's buffers on its
/// GPU, one launch per rank meeting through barriers over NVLink): `OXCCL_MULTI_GPU_CASES` or 100.
#[test]
fn random_reshards_match_the_global_tensor_with_one_rank_per_gpu() {
    let Some(gpus) = common::gpus("random_reshards_match_the_global_tensor_with_one_rank_per_gpu") else { return };
    let cases = common::count_from_env("OXCCL_MULTI_GPU_CASES", 100);
    let seed = seed() ^ 0x6B0;
    let mut rng = common::rng(seed);
    let streams: Vec<Arc<CudaStream>> = gpus.iter().map(|g| g.new_stream().unwrap()).collect();
    let mut comms: HashMap<(usize, u32, Mover), Communicator> = HashMap::new();
    for case in 0..cases {
        let c = Case::random(&mut rng, (2, gpus.len()));
        let what = c.describe(case, seed);
        let streams = &streams[..c.world];
        let comm = comms.entry((c.world, c.ctas, c.mover)).or_insert_with(|| {
            let config = Config {
                max_ctas: Some(c.ctas),
                mover: c.mover,
                timeout: Duration::from_secs(10),
                ..Config::default()
            };
            Communicator::from_streams(streams, config).unwrap()
        });
        run_case(comm, streams, &c, &what);
    }
    eprintln!(
        "{cases} reshard cases with one rank per GPU ({} GPUs) matched the global tensor (seed {seed})",
        gpus.len()
    );
}

/// The same cases as the GPU test, through the call's validation and the lowering it uses, run on the
/// CPU with the engine's semantics: checks the test's case generator and shard cutting here, so a GPU
/// failure points at the device.
#[test]
fn random_reshard_cases_run_on_the_cpu_executor() {
    use oxccl_host::reshard::{LowerOptions, lower, plan};
    use oxccl_kernels::abi::slot;
    let seed = seed();
    let mut rng = common::rng(seed);
    let mut tasks = 0;
    for case in 0..cases() {
        let c = Case::random(&mut rng, (1, 16));
        let what = c.describe(case, seed);
        let (src_data, want) = c.shards();
        let e = c.dtype.size();
        let lens = |data: &HashMap<u32, Vec<u8>>| -> Vec<Option<usize>> {
            (0..c.world as u32)
                .map(|r| data.get(&r).map(|d| d.len() / e).filter(|&n| !(c.empty_as_none && n == 0)))
                .collect()
        };
        let (sl, dl) = (lens(&src_data), lens(&want));
        let side = |layout, buffers| oxccl::reshard::Side { shape: &c.shape, elem_bytes: e as u64, layout, buffers };
        oxccl::reshard::validate(c.world, &side(&c.src, &sl), &side(&c.dst, &dl))
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        let p = plan(&c.shape, e as u64, &c.src, &c.dst, c.options.plan).unwrap();
        let opts = LowerOptions { owner: c.options.owner, dtype: Some(c.dtype), ..LowerOptions::new(c.world, c.ctas) };
        let l = lower(&p, &opts).unwrap_or_else(|e| panic!("{what}: {e}"));
        tasks += l.task_count();
        let mut bufs = l.host_buffers();
        for (r, d) in src_data {
            bufs[r as usize][slot::INPUT as usize] = d;
        }
        l.execute(&mut bufs).unwrap_or_else(|e| panic!("{what}: {e}"));
        for (r, w) in &want {
            assert!(bufs[*r as usize][slot::OUTPUT as usize] == *w, "{what}: rank {r} differs");
        }
    }
    eprintln!("{} reshard cases exact on the CPU executor ({tasks} tasks; seed {seed})", cases());
}

/// A 7168 × 18432 bf16 weight, TP8 on ranks 0..8 → TP2 × DP4 on ranks 8..16, default configuration
/// (CTAs per rank from the SM count), both routes, row- and column-sharded sources; each twice (the
/// second call from the plan cache).
#[test]
fn layer_sized_tp8_to_tp2xdp4_is_exact() {
    let Some(stream) = common::gpu("layer_sized_tp8_to_tp2xdp4_is_exact") else { return };
    let shape = [7168u64, 18432];
    let comm =
        Communicator::virtual_ranks(&stream, 16, Config { timeout: Duration::from_secs(30), ..Config::default() })
            .unwrap();
    let mut rng = common::rng(7168);
    let global = common::random_bytes(&mut rng, (shape[0] * shape[1] * 2) as usize);
    let dst = Layout::parse("4x2@8", "R,S0").unwrap();
    let want = shards(&dst, &shape, &global, 2);
    let dst_lens: HashMap<u32, usize> = want.iter().map(|(&r, d)| (r, d.len())).collect();
    for src in [Layout::parse("8@0", "S0").unwrap(), Layout::parse("8@0", "S1").unwrap()] {
        let src_data = shards(&src, &shape, &global, 2);
        let src_bufs = upload(&vec![stream.clone(); 16], &src_data);
        let src_lens: HashMap<u32, usize> = src_data.iter().map(|(&r, d)| (r, d.len())).collect();
        for route in [Route::Hierarchical, Route::Direct] {
            let options = ReshardOptions { plan: PlanOptions::new(route, 8), ..ReshardOptions::default() };
            for round in 0..2 {
                let poison: HashMap<u32, Vec<u8>> = want.iter().map(|(&r, w)| (r, vec![0xA5; w.len()])).collect();
                let mut dst_bufs = upload(&vec![stream.clone(); 16], &poison);
                let layouts = (&src, &dst);
                call::<half::bf16>(
                    &comm,
                    &src_bufs,
                    &src_lens,
                    &mut dst_bufs,
                    &dst_lens,
                    &shape,
                    layouts,
                    &options,
                    false,
                    None,
                )
                .unwrap();
                comm.synchronize().unwrap_or_else(|e| panic!("{src} {route}: {e}"));
                for (r, w) in &want {
                    let got = stream.clone_dtoh(dst_bufs[*r as usize].as_ref().unwrap()).unwrap();
                    assert!(got[..w.len()] == w[..], "{src} -> {dst} {route} round {round}: rank {r} differs");
                }
            }
        }
    }
    eprintln!("layer-sized reshard exact: row- and column-sharded TP8 -> TP2 x DP4, both routes, twice each");
}

#[test]
fn reshard_misuse_is_a_typed_error() {
    let Some(stream) = common::gpu("reshard_misuse_is_a_typed_error") else { return };
    let comm = Communicator::virtual_ranks(&stream, 4, Config { max_ctas: Some(2), ..Config::default() }).unwrap();
    let (src, dst) = (Layout::parse("2@0", "S0").unwrap(), Layout::parse("2@2", "S1").unwrap());
    let shape = [4u64, 8];
    let a: Vec<CudaSlice<f32>> = (0..4).map(|_| stream.alloc_zeros::<f32>(16).unwrap()).collect();
    let mut b: Vec<CudaSlice<f32>> = (0..4).map(|_| stream.alloc_zeros::<f32>(16).unwrap()).collect();
    let opts = ReshardOptions::default();
    fn srcs(a: &[CudaSlice<f32>]) -> Vec<Option<CudaView<'_, f32>>> {
        vec![Some(a[0].slice(..)), Some(a[1].slice(..)), None, None]
    }
    // Correct.
    {
        let s = srcs(&a);
        let s: Vec<_> = s.iter().map(Option::as_ref).collect();
        let (x, y) = b.split_at_mut(3);
        let mut d: Vec<Option<&mut CudaSlice<f32>>> = vec![None, None, Some(&mut x[2]), Some(&mut y[0])];
        comm.reshard(&s, &mut d, &shape, &src, &dst, &opts).unwrap();
        // A destination rank passing nothing.
        let mut d: Vec<Option<&mut CudaSlice<f32>>> = vec![None, None, None, Some(&mut y[0])];
        let e = comm.reshard(&s, &mut d, &shape, &src, &dst, &opts).unwrap_err();
        assert!(matches!(e, Error::MissingBuffer { rank: 2, elements: 16, .. }), "{e}");
    }
    // A source rank outside the source mesh passing a buffer; a short source buffer.
    {
        let s = [Some(a[0].slice(..)), Some(a[1].slice(..)), Some(a[2].slice(..)), None];
        let s: Vec<_> = s.iter().map(Option::as_ref).collect();
        let (_, y) = b.split_at_mut(2);
        let (y0, y1) = y.split_at_mut(1);
        let mut d: Vec<Option<&mut CudaSlice<f32>>> = vec![None, None, Some(&mut y0[0]), Some(&mut y1[0])];
        let e = comm.reshard(&s, &mut d, &shape, &src, &dst, &opts).unwrap_err();
        assert!(matches!(e, Error::UnexpectedBuffer { rank: 2, .. }), "{e}");
        let s = [Some(a[0].slice(..15)), Some(a[1].slice(..)), None, None];
        let s: Vec<_> = s.iter().map(Option::as_ref).collect();
        let e = comm.reshard(&s, &mut d, &shape, &src, &dst, &opts).unwrap_err();
        assert!(matches!(e, Error::Length { rank: 0, expected: 16, got: 15, .. }), "{e}");
        // A mesh past the communicator.
        let wide = Layout::parse("2x2@2", "R,S1").unwrap();
        let e = comm.reshard(&s, &mut d, &shape, &src, &wide, &opts).unwrap_err();
        assert!(matches!(e, Error::Reshard(_)), "{e}");
    }
    // Partial sums: `reshard` copies and refuses them; a destination of partial sums is refused.
    {
        let partial = Layout::parse("2@0", "P").unwrap();
        let s = [Some(a[0].slice(..)), Some(a[1].slice(..)), None, None];
        let s: Vec<_> = s.iter().map(Option::as_ref).collect();
        let (_, y) = b.split_at_mut(2);
        let (y0, y1) = y.split_at_mut(1);
        let mut d: Vec<Option<&mut CudaSlice<f32>>> = vec![None, None, Some(&mut y0[0]), Some(&mut y1[0])];
        let shape = [2u64, 16];
        let e = comm.reshard(&s, &mut d, &shape, &partial, &dst, &opts).unwrap_err();
        assert!(matches!(e, Error::Unsupported { .. }), "{e}");
        let e = comm
            .reshard_reduce(&s, &mut d, &shape, &src, &Layout::parse("2@2", "P").unwrap(), oxccl::ReduceOp::Sum, &opts)
            .unwrap_err();
        assert!(matches!(e, Error::Reshard(oxccl::reshard::ReshardError::Dst(_))), "{e}");
    }
    // A destination buffer overlapping a source buffer: rank 2 writes into rank 0's source.
    {
        use cudarc::driver::DevicePtr;
        let raw = a[0].device_ptr(&stream).0;
        let mut alias: CudaSlice<f32> = unsafe { stream.upgrade_device_ptr(raw, 16) };
        let s = srcs(&a);
        let s: Vec<_> = s.iter().map(Option::as_ref).collect();
        let mut d: Vec<Option<&mut CudaSlice<f32>>> = vec![None, None, Some(&mut alias), Some(&mut b[3])];
        let e = comm.reshard(&s, &mut d, &shape, &src, &dst, &opts).unwrap_err();
        let named = matches!(
            e,
            Error::Aliasing { rank: 2, buffer: "destination buffer", other_rank: 0, other_buffer: "source buffer", .. }
        );
        assert!(named, "{e}");
        drop(d);
        alias.leak();
    }
    comm.synchronize().unwrap();
}

/// Reshards of element types without kernels of their own (f64 in 4-byte units, a 3-byte struct
/// in bytes): rows on ranks 0 and 1 (`S0` on `2@0`) to columns on ranks 2 and 3 (`S1` on `2@2`) of
/// a 4 × 8 tensor, exact.
#[test]
fn plain_types_reshard_exactly() {
    let Some(stream) = common::gpu("plain_types_reshard_exactly") else { return };
    let comm = Communicator::virtual_ranks(&stream, 4, Config { max_ctas: Some(2), ..Config::default() }).unwrap();
    let (src, dst) = (Layout::parse("2@0", "S0").unwrap(), Layout::parse("2@2", "S1").unwrap());
    fn check<T: oxccl::Plain + PartialEq + std::fmt::Debug>(
        comm: &Communicator,
        stream: &Arc<CudaStream>,
        src: &Layout,
        dst: &Layout,
        value: impl Fn(usize, usize) -> T,
        zero: T,
    ) {
        // Rank r of the source holds rows 2r and 2r + 1; rank 2 + k of the destination columns
        // 4k..4k + 4 of every row.
        let rows = |r: usize| -> Vec<T> {
            (2 * r..2 * r + 2).flat_map(|i| (0..8).map(move |j| (i, j))).map(|(i, j)| value(i, j)).collect()
        };
        let a: Vec<CudaSlice<T>> = (0..2).map(|r| stream.clone_htod(&rows(r)).unwrap()).collect();
        let mut b: Vec<CudaSlice<T>> = (0..2).map(|_| stream.clone_htod(&vec![zero; 16]).unwrap()).collect();
        let s: Vec<Option<&CudaSlice<T>>> = vec![Some(&a[0]), Some(&a[1]), None, None];
        let (b0, b1) = b.split_at_mut(1);
        let mut d: Vec<Option<&mut CudaSlice<T>>> = vec![None, None, Some(&mut b0[0]), Some(&mut b1[0])];
        comm.reshard(&s, &mut d, &[4, 8], src, dst, &ReshardOptions::default()).unwrap();
        comm.synchronize().unwrap();
        for (k, buf) in b.iter().enumerate() {
            let want: Vec<T> =
                (0..4).flat_map(|i| (4 * k..4 * k + 4).map(move |j| (i, j))).map(|(i, j)| value(i, j)).collect();
            assert_eq!(stream.clone_dtoh(buf).unwrap(), want, "destination rank {}", 2 + k);
        }
    }
    check(&comm, &stream, &src, &dst, |i, j| (i * 8 + j) as f64 * 1.25 - 3.0, 0.0);
    check(
        &comm,
        &stream,
        &src,
        &dst,
        |i, j| common::Rgb([i as u8, j as u8, (i * 8 + j) as u8 ^ 0xa5]),
        common::Rgb([0; 3]),
    );
    println!("f64 and a 3-byte type resharded exactly");
}

/// Reshards from `Partial` sources on virtual ranks (`OXCCL_RESHARD_CASES` / 2 cases): random source
/// layouts with at least one axis `Partial` (mixed with `R` and `S<dim>`) to random destinations,
/// every element type with Sum, Min, Max and Avg, both routes and movers, 1 to 4 CTAs, one launch
/// or one per rank; every source rank holds small integers of its own. Checked byte for byte
/// against the host running the same lowered program (the engine's semantics: the partial values
/// combined in ascending rank order), destinations poisoned first.
#[test]
fn random_partial_reshards_match_the_host_engine() {
    use oxccl::ReduceOp;
    use oxccl::host::reshard::{LowerOptions, lower, plan};
    use oxccl_kernels::abi::slot;
    let Some(stream) = common::gpu("random_partial_reshards_match_the_host_engine") else { return };
    let seed = seed() ^ 0x9A27;
    let mut rng = common::rng(seed);
    let ctx = stream.context().clone();
    let per_rank_streams: Vec<Arc<CudaStream>> = (0..16).map(|_| ctx.new_stream().unwrap()).collect();
    let mut comms: HashMap<(usize, u32, Mover, bool), Communicator> = HashMap::new();
    let cases = cases().div_ceil(2);
    for case in 0..cases {
        let mut c = Case::random(&mut rng, (2, 16));
        // Some axes of the source hold partial sums, at least one.
        let mut placements = c.src.placements().to_vec();
        let forced = rng.random_range(0..placements.len() as u64) as usize;
        for (axis, p) in placements.iter_mut().enumerate() {
            if axis == forced || rng.random_range(0..3) == 0 {
                *p = Placement::Partial;
            }
        }
        c.src = Layout::new(c.src.mesh().clone(), placements).unwrap();
        let op = [ReduceOp::Sum, ReduceOp::Min, ReduceOp::Max, ReduceOp::Avg][rng.random_range(0..4) as usize];
        let what = format!("{} {op:?}", c.describe(case, seed));
        let e = c.dtype.size();
        let plan = plan(&c.shape, e as u64, &c.src, &c.dst, c.options.plan).unwrap();
        let opts =
            LowerOptions { owner: c.options.owner, dtype: Some(c.dtype), op, ..LowerOptions::new(c.world, c.ctas) };
        let lowered = lower(&plan, &opts).unwrap_or_else(|e| panic!("{what}: {e}"));
        let src_data: HashMap<u32, Vec<u8>> = c
            .src
            .mesh()
            .ranks()
            .map(|r| (r, common::small_integers(c.dtype, plan.src_buffer_bytes(r) as usize, &mut rng)))
            .collect();
        let mut host = lowered.host_buffers();
        for (&r, d) in &src_data {
            host[r as usize][slot::INPUT as usize] = d.clone();
        }
        lowered.execute(&mut host).unwrap_or_else(|e| panic!("{what}: {e}"));
        let want: HashMap<u32, Vec<u8>> =
            c.dst.mesh().ranks().map(|r| (r, host[r as usize][slot::OUTPUT as usize].clone())).collect();

        let comm = comm_for(&mut comms, &c, &stream, &per_rank_streams);
        run_with(comm, &vec![stream.clone(); c.world], &c, (&src_data, &want), Some(op), &what);
    }
    eprintln!("{cases} partial reshard cases matched the host engine (seed {seed})");
}
