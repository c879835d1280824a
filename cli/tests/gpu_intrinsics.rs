//! Every intrinsic family run in its probe kernel on the GPU, against a host expectation.
//! Skips loudly without a Hopper GPU.

#[path = "../../tests/common/mod.rs"]
mod common;

use cudarc::driver::sys;
use cudarc::driver::{CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;
use half::{bf16, f16};
use rand::RngExt;
use std::sync::Arc;

/// The probe module (`oxccl-ptx`'s probes) and the benchmark kernels' module (`oxccl-bench-kernels`),
/// loaded on one GPU.
struct Probes {
    stream: Arc<CudaStream>,
    module: Arc<CudaModule>,
    bench: Arc<CudaModule>,
}

impl Probes {
    fn new(test: &str) -> Option<Self> {
        let stream = common::gpu(test)?;
        let module = stream.context().load_module(Ptx::from_src(oxccl::ptx::PROBES)).expect("load probes");
        let bench = stream.context().load_module(Ptx::from_src(oxccl_cli::ptx::BENCH)).expect("load bench kernels");
        Some(Probes { stream, module, bench })
    }
    fn f(&self, name: &str) -> CudaFunction {
        let module = if name.starts_with("bench_") { &self.bench } else { &self.module };
        module.load_function(name).unwrap_or_else(|e| panic!("{name}: {e}"))
    }
    fn addr<T>(&self, s: &CudaSlice<T>) -> u64 {
        s.device_ptr(&self.stream).0
    }
    fn cfg(blocks: u32, threads: u32, smem: u32) -> LaunchConfig {
        LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: smem }
    }
}

#[test]
fn special_registers_and_elect() {
    let Some(p) = Probes::new("special_registers_and_elect") else { return };
    let (blocks, threads) = (2u32, 64u32);
    let out = p.stream.alloc_zeros::<u64>((8 * blocks * threads) as usize).unwrap();
    let f = p.f("probe_sreg");
    let a = p.addr(&out);
    unsafe { p.stream.launch_builder(&f).arg(&a).launch(Probes::cfg(blocks, threads, 0)) }.unwrap();
    let v = p.stream.clone_dtoh(&out).unwrap();
    let sms =
        p.stream.context().attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT).unwrap() as u64;
    let mut elected_per_warp = vec![0; (blocks * threads / 32) as usize];
    for b in 0..blocks as u64 {
        for t in 0..threads as u64 {
            let row = &v[(8 * (b * threads as u64 + t)) as usize..][..8];
            assert_eq!(&row[..5], &[t, threads as u64, b, blocks as u64, t % 32], "block {b} thread {t}");
            assert!(row[5] < sms, "smid {} >= {sms}", row[5]);
            assert!(row[6] > 0, "globaltimer read 0");
            elected_per_warp[((b * threads as u64 + t) / 32) as usize] += row[7];
        }
    }
    assert!(elected_per_warp.iter().all(|&n| n == 1), "elect.sync elected {elected_per_warp:?} per warp");
}

#[test]
fn dynamic_shared_memory_size() {
    let Some(p) = Probes::new("dynamic_shared_memory_size") else { return };
    let f = p.f("probe_smem_size");
    f.set_attribute(sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, 100 * 1024).unwrap();
    for smem in [0u32, 1040, 100 * 1024] {
        let out = p.stream.alloc_zeros::<u64>(2).unwrap();
        let a = p.addr(&out);
        unsafe { p.stream.launch_builder(&f).arg(&a).launch(Probes::cfg(2, 32, smem)) }.unwrap();
        assert_eq!(p.stream.clone_dtoh(&out).unwrap(), vec![smem as u64; 2], "%dynamic_smem_size");
    }
}

#[test]
fn mbarrier_phases_and_transactions() {
    let Some(p) = Probes::new("mbarrier_phases_and_transactions") else { return };
    let src_data: Vec<u64> = (0..8).map(|i| 0x0123_4567_89ab_cdef ^ (i * 0x1111)).collect();
    let src = p.stream.clone_htod(&src_data).unwrap();
    let out = p.stream.alloc_zeros::<u64>(7).unwrap();
    let (a, s) = (p.addr(&out), p.addr(&src));
    unsafe { p.stream.launch_builder(&p.f("probe_mbarrier")).arg(&a).arg(&s).launch(Probes::cfg(1, 1, 256)) }.unwrap();
    let v = p.stream.clone_dtoh(&out).unwrap();
    // What the engine relies on: each phase completes once its copy has landed (parity 0, then 1, then
    // 0 again), and the copied bytes are there. Whether a lone thread sees the phase still open just
    // before it issues the copy is not asserted: on an H200 try_wait reported such a phase complete
    // (see docs/PERF.md), so the engine never depends on that order.
    eprintln!("mbarrier probe observed {v:?}");
    assert_eq!(
        (v[1], v[3], v[4], v[5], v[6]),
        (1, 1, src_data[0], 1, 1),
        "[phase 0 done, phase 1 done, copied, phase 2 done, state]"
    );
}

#[test]
fn bulk_copy_round_trips() {
    let Some(p) = Probes::new("bulk_copy_round_trips") else { return };
    let mut rng = common::rng(7);
    for bytes in [16usize, 4096, 40960] {
        let data = common::random_bytes(&mut rng, bytes);
        let src = p.stream.clone_htod(&data).unwrap();
        let dst = p.stream.alloc_zeros::<u8>(bytes).unwrap();
        let (d, s, n) = (p.addr(&dst), p.addr(&src), bytes as u32);
        let cfg = Probes::cfg(1, 1, 128 + bytes as u32);
        unsafe { p.stream.launch_builder(&p.f("probe_bulk_copy")).arg(&d).arg(&s).arg(&n).launch(cfg) }.unwrap();
        assert_eq!(p.stream.clone_dtoh(&dst).unwrap(), data, "{bytes} bytes");
    }
}

/// Element type of a bulk-reduction probe and the host operator.
fn reduce_case(name: &str, a: &[u8], b: &[u8]) -> Vec<u8> {
    let (op, ty) = name.strip_prefix("probe_reduce_").unwrap().split_once('_').unwrap();
    macro_rules! ints {
        ($t:ty) => {{
            let w = std::mem::size_of::<$t>();
            a.chunks(w)
                .zip(b.chunks(w))
                .flat_map(|(x, y)| {
                    let (x, y) =
                        (<$t>::from_le_bytes(x.try_into().unwrap()), <$t>::from_le_bytes(y.try_into().unwrap()));
                    let r = match op {
                        "add" => x.wrapping_add(y),
                        "min" => x.min(y),
                        _ => x.max(y),
                    };
                    r.to_le_bytes()
                })
                .collect()
        }};
    }
    macro_rules! floats {
        ($t:ty, $w:expr, $to:expr, $from:expr) => {{
            a.chunks($w)
                .zip(b.chunks($w))
                .flat_map(|(x, y)| {
                    let (x, y): (f64, f64) = (
                        $to(<$t>::from_le_bytes(x.try_into().unwrap())),
                        $to(<$t>::from_le_bytes(y.try_into().unwrap())),
                    );
                    let r = match op {
                        "add" => x + y,
                        "min" => x.min(y),
                        _ => x.max(y),
                    };
                    let r: $t = $from(r);
                    r.to_le_bytes()
                })
                .collect()
        }};
    }
    match ty {
        "u32" => ints!(u32),
        "s32" => ints!(i32),
        "u64" => ints!(u64),
        "s64" => ints!(i64),
        "f32" => floats!(f32, 4, |x: f32| x as f64, |x: f64| x as f32),
        "f64" => floats!(f64, 8, |x: f64| x, |x: f64| x),
        "f16" => floats!(f16, 2, |x: f16| x.to_f64(), f16::from_f64),
        "bf16" => floats!(bf16, 2, |x: bf16| x.to_f64(), bf16::from_f64),
        _ => unreachable!("{name}"),
    }
}

/// Small integers (exact in every type) with a random sign; the integer types spread them over
/// their range (`x · (2^24 + 1)`, `x · (2^56 + 1)`): sums wrap, and the unsigned types' values lie
/// on both sides of the top bit (negative `x`), where a signed Min or Max would order them wrongly.
fn reduce_inputs(name: &str, rng: &mut common::Rng, bytes: usize) -> Vec<u8> {
    let ty = name.rsplit('_').next().unwrap();
    let n = |rng: &mut common::Rng| rng.random_range(-100..100i64);
    let (x32, x64) = (|x: i64| (x as i32) * ((1 << 24) + 1), |x: i64| x * ((1 << 56) + 1));
    let mut v = Vec::with_capacity(bytes);
    while v.len() < bytes {
        let x = n(rng);
        match ty {
            "u32" => v.extend_from_slice(&(x32(x) as u32).to_le_bytes()),
            "s32" => v.extend_from_slice(&x32(x).to_le_bytes()),
            "u64" => v.extend_from_slice(&(x64(x) as u64).to_le_bytes()),
            "s64" => v.extend_from_slice(&x64(x).to_le_bytes()),
            "f32" => v.extend_from_slice(&(x as f32).to_le_bytes()),
            "f64" => v.extend_from_slice(&(x as f64).to_le_bytes()),
            "f16" => v.extend_from_slice(&f16::from_f64(x as f64).to_le_bytes()),
            "bf16" => v.extend_from_slice(&bf16::from_f64(x as f64).to_le_bytes()),
            _ => unreachable!(),
        }
    }
    v
}

#[test]
fn bulk_reductions_every_type_and_operator() {
    let Some(p) = Probes::new("bulk_reductions_every_type_and_operator") else { return };
    let names = [
        "probe_reduce_add_f32",
        "probe_reduce_add_f64",
        "probe_reduce_add_f16",
        "probe_reduce_add_bf16",
        "probe_reduce_add_u32",
        "probe_reduce_add_s32",
        "probe_reduce_add_u64",
        "probe_reduce_min_u32",
        "probe_reduce_min_s32",
        "probe_reduce_min_u64",
        "probe_reduce_min_s64",
        "probe_reduce_min_f16",
        "probe_reduce_min_bf16",
        "probe_reduce_max_u32",
        "probe_reduce_max_s32",
        "probe_reduce_max_u64",
        "probe_reduce_max_s64",
        "probe_reduce_max_f16",
        "probe_reduce_max_bf16",
    ];
    let mut rng = common::rng(11);
    let bytes = 512;
    for name in names {
        let (a, b) = (reduce_inputs(name, &mut rng, bytes), reduce_inputs(name, &mut rng, bytes));
        let dst = p.stream.clone_htod(&a).unwrap();
        let src = p.stream.clone_htod(&b).unwrap();
        let (d, s, n) = (p.addr(&dst), p.addr(&src), bytes as u32);
        unsafe {
            p.stream.launch_builder(&p.f(name)).arg(&d).arg(&s).arg(&n).launch(Probes::cfg(1, 1, 128 + bytes as u32))
        }
        .unwrap();
        assert_eq!(p.stream.clone_dtoh(&dst).unwrap(), reduce_case(name, &a, &b), "{name}");
    }
}

/// The tensor map of a packed u32 tensor, as the library's benches build it.
fn tensor_map(dims: &[u64], boxd: &[u32], addr: u64) -> [u64; 16] {
    oxccl_cli::bench::u32_tensor_map(addr, dims, boxd).unwrap_or_else(|e| panic!("tensor map {dims:?} {boxd:?}: {e}"))
}

#[test]
fn tensor_tiles_load_store_reduce_1d_to_5d() {
    let Some(p) = Probes::new("tensor_tiles_load_store_reduce_1d_to_5d") else { return };
    let all_dims = [16u64, 4, 3, 2, 2];
    let all_box = [8u32, 2, 2, 1, 1];
    let all_at = [8i32, 1, 1, 1, 0];
    let mut rng = common::rng(5);
    for d in 1..=5usize {
        for op in 0..3u32 {
            let (dims, boxd, at) = (&all_dims[..d], &all_box[..d], &all_at[..d]);
            let n: u64 = dims.iter().product();
            let src_h: Vec<u32> = (0..n).map(|_| rng.random_range(0..1000) as u32).collect();
            let dst_h: Vec<u32> = (0..n).map(|_| rng.random_range(0..1000) as u32).collect();
            let red_h: Vec<u32> = (0..n).map(|_| rng.random_range(0..1000) as u32).collect();
            let (src, dst, red) = (
                p.stream.clone_htod(&src_h).unwrap(),
                p.stream.clone_htod(&dst_h).unwrap(),
                p.stream.clone_htod(&red_h).unwrap(),
            );
            let maps: Vec<u64> = [&src, &dst, &red].iter().flat_map(|b| tensor_map(dims, boxd, p.addr(b))).collect();
            let maps_d = p.stream.clone_htod(&maps).unwrap();
            let base = p.addr(&maps_d);
            let (ms, md, mr) = (base, base + 128, base + 256);
            let box_bytes: u32 = boxd.iter().product::<u32>() * 4;
            let f = p.f(&format!("probe_tensor_{d}d"));
            let mut b = p.stream.launch_builder(&f);
            b.arg(&ms).arg(&md).arg(&mr).arg(&op).arg(&box_bytes);
            for c in at {
                b.arg(c);
            }
            unsafe { b.launch(Probes::cfg(1, 1, 128 + box_bytes)) }.unwrap();
            let (dst_after, red_after) = (p.stream.clone_dtoh(&dst).unwrap(), p.stream.clone_dtoh(&red).unwrap());
            // Host expectation: elements inside the box take the source (store) or combine (reduce).
            for i in 0..n as usize {
                let mut rem = i as u64;
                let mut inside = true;
                for k in 0..d {
                    let x = rem % dims[k];
                    rem /= dims[k];
                    inside &= x >= at[k] as u64 && x < at[k] as u64 + boxd[k] as u64;
                }
                let want_dst = if inside { src_h[i] } else { dst_h[i] };
                let want_red = if !inside {
                    red_h[i]
                } else {
                    match op {
                        0 => red_h[i] + src_h[i],
                        1 => red_h[i].min(src_h[i]),
                        _ => red_h[i].max(src_h[i]),
                    }
                };
                assert_eq!((dst_after[i], red_after[i]), (want_dst, want_red), "{d}-D op {op} element {i}");
            }
        }
    }
}

#[test]
fn scoped_memory_operations() {
    let Some(p) = Probes::new("scoped_memory_operations") else { return };
    // 96 threads: bits 0..32 are ORed by two threads each, so only one of each pair may see it new.
    let threads = 96u32;
    let flags = p.stream.alloc_zeros::<u64>(10).unwrap();
    let out = p.stream.alloc_zeros::<u64>(8 + threads as usize).unwrap();
    let (f, o) = (p.addr(&flags), p.addr(&out));
    unsafe { p.stream.launch_builder(&p.f("probe_memory")).arg(&f).arg(&o).launch(Probes::cfg(1, threads, 0)) }
        .unwrap();
    let v = p.stream.clone_dtoh(&out).unwrap();
    assert_eq!(&v[..6], &[11, 12, 13, 14, 17, 34]);
    let bits = if threads >= 64 { u64::MAX } else { (1u64 << threads) - 1 };
    assert_eq!(v[6], bits, "atom.acq_rel.sys.or.b64 sets every thread's bit");
    assert_eq!(v[7], u64::from(threads.min(64)), "atom.or returns the previous value: one first setter per bit");
    let fl = p.stream.clone_dtoh(&flags).unwrap();
    let t = threads as u64;
    assert_eq!(fl[4], t | (2 * t) << 32, "red.release.{{gpu,sys}}.add.u32");
    assert_eq!(fl[5], 7 * t, "red.release.{{gpu,sys}}.add.u64");
    assert_eq!(fl[6], t | t << 32, "atom.add tickets");
    assert_eq!(fl[8], t, "atom.cas.b64: every thread's increment by compare-and-swap, none lost");
    assert_eq!((fl[9], fl[2]), (13, 13), "atom.cas.b64 that must fail returns the word and leaves it");
    let mut tickets: Vec<u64> = v[8..].to_vec();
    tickets.sort();
    assert_eq!(tickets, (0..t).collect::<Vec<_>>(), "atom.relaxed.gpu.add.u32 returns distinct old values");
}

#[test]
fn fences_barriers_and_sleep() {
    let Some(p) = Probes::new("fences_barriers_and_sleep") else { return };
    let threads = 128u32;
    let out = p.stream.alloc_zeros::<u64>(threads as usize).unwrap();
    let o = p.addr(&out);
    unsafe { p.stream.launch_builder(&p.f("probe_sync")).arg(&o).launch(Probes::cfg(1, threads, 128 + 4 * threads)) }
        .unwrap();
    let v = p.stream.clone_dtoh(&out).unwrap();
    // Neighbour ids; bit 32: barrier-OR of "last thread" (true everywhere); bit 33: of `false`.
    assert_eq!(v, (0..threads as u64).map(|t| ((t + 1) % threads as u64) | (1 << 32)).collect::<Vec<_>>());
}

#[test]
fn vector_loads_and_stores() {
    let Some(p) = Probes::new("vector_loads_and_stores") else { return };
    let threads = 96u32;
    let data = common::random_bytes(&mut common::rng(3), 16 * threads as usize);
    let src = p.stream.clone_htod(&data).unwrap();
    let dst = p.stream.alloc_zeros::<u8>(data.len()).unwrap();
    let (d, s) = (p.addr(&dst), p.addr(&src));
    unsafe {
        p.stream.launch_builder(&p.f("probe_vector")).arg(&d).arg(&s).launch(Probes::cfg(
            1,
            threads,
            128 + 16 * threads,
        ))
    }
    .unwrap();
    assert_eq!(p.stream.clone_dtoh(&dst).unwrap(), data);
}

#[test]
fn packed_half_arithmetic() {
    let Some(p) = Probes::new("packed_half_arithmetic") else { return };
    let n = 4096u32;
    let mut rng = common::rng(9);
    let finite = |rng: &mut common::Rng| -> f32 { (rng.random_range(0..2_000_001) as f32 - 1_000_000.0) / 997.0 };
    let pack = |lo: u16, hi: u16| lo as u32 | (hi as u32) << 16;
    let mut a = Vec::new();
    let mut b = Vec::new();
    for i in 0..n {
        // Even words: f16 pairs; odd words: bf16 pairs (both probes read every word both ways; only the
        // matching half of the results is checked).
        let (x0, x1, y0, y1) = (finite(&mut rng), finite(&mut rng), finite(&mut rng), finite(&mut rng));
        if i % 2 == 0 {
            a.push(pack(f16::from_f32(x0 / 64.0).to_bits(), f16::from_f32(x1 / 64.0).to_bits()));
            b.push(pack(f16::from_f32(y0 / 64.0).to_bits(), f16::from_f32(y1 / 64.0).to_bits()));
        } else {
            a.push(pack(bf16::from_f32(x0).to_bits(), bf16::from_f32(x1).to_bits()));
            b.push(pack(bf16::from_f32(y0).to_bits(), bf16::from_f32(y1).to_bits()));
        }
    }
    let (da, db) = (p.stream.clone_htod(&a).unwrap(), p.stream.clone_htod(&b).unwrap());
    let out = p.stream.alloc_zeros::<u32>(10 * n as usize).unwrap();
    let (o, x, y) = (p.addr(&out), p.addr(&da), p.addr(&db));
    unsafe {
        p.stream.launch_builder(&p.f("probe_arith")).arg(&o).arg(&x).arg(&y).arg(&n).launch(Probes::cfg(
            n.div_ceil(128),
            128,
            0,
        ))
    }
    .unwrap();
    let v = p.stream.clone_dtoh(&out).unwrap();
    for i in 0..n as usize {
        for half in 0..2 {
            let (ax, bx) = ((a[i] >> (16 * half)) as u16, (b[i] >> (16 * half)) as u16);
            let got = |k: usize| (v[10 * i + k] >> (16 * half)) as u16;
            if i % 2 == 0 {
                let (x, y) = (f16::from_bits(ax).to_f32(), f16::from_bits(bx).to_f32());
                assert_eq!(got(0), f16::from_f32(x + y).to_bits(), "add.rn.f16x2 {x} {y}");
                assert_eq!(got(1), f16::from_f32(x.min(y)).to_bits(), "min.f16x2 {x} {y}");
                assert_eq!(got(2), f16::from_f32(x.max(y)).to_bits(), "max.f16x2 {x} {y}");
                // The product of two f16 is exact in f32: one rounding, as the hardware's.
                assert_eq!(got(6), f16::from_f32(x * y).to_bits(), "mul.rn.f16x2 {x} {y}");
                assert_eq!(got(8), f16::from_f32(x / 3.0).to_bits(), "cvt.rn.f16x2.f32 of {x} / 3");
            } else {
                let (x, y) = (bf16::from_bits(ax).to_f64(), bf16::from_bits(bx).to_f64());
                assert_eq!(got(3), bf16::from_f64(x + y).to_bits(), "add.rn.bf16x2 {x} {y}");
                assert_eq!(got(4), bf16::from_f64(x.min(y)).to_bits(), "min.bf16x2 {x} {y}");
                assert_eq!(got(5), bf16::from_f64(x.max(y)).to_bits(), "max.bf16x2 {x} {y}");
                assert_eq!(got(7), bf16::from_f64(x * y).to_bits(), "mul.rn.bf16x2 {x} {y}");
                assert_eq!(got(9), bf16::from_f32(x as f32 / 3.0).to_bits(), "cvt.rn.bf16x2.f32 of {x} / 3");
            }
        }
    }
}

#[test]
fn tensor_core_gemm_matches_the_cpu() {
    use oxccl_bench_kernels::gemm_shape::{SMEM, THREADS, TILE_MN, one_per_sm_smem};
    let Some(p) = Probes::new("tensor_core_gemm_matches_the_cpu") else { return };
    let f = p.f("bench_gemm_bf16");
    // Up to half an SM's shared memory, as `--mma-one-per-sm` launches it.
    let per_sm = p
        .stream
        .context()
        .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR)
        .unwrap() as u32;
    let half = one_per_sm_smem(per_sm);
    f.set_attribute(sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, half as i32).unwrap();
    // Small integers: every product and every sum is exact in bf16 inputs and f32 accumulation, so
    // C must match bit for bit. K of 1, 3 (the ring's depth), 8 and 64 stages' worth; each shape
    // three times (a missing wait or barrier need not show in one launch), the last with half an
    // SM's shared memory.
    for (m, n, k) in [(128u32, 128u32, 32u32), (256, 384, 96), (384, 256, 256), (256, 256, 2048)] {
        let av: Vec<i32> = (0..m * k).map(|i| ((i / k * 7 + i % k * 3) % 9) as i32 - 4).collect();
        let bv: Vec<i32> = (0..n * k).map(|i| ((i / k * 5 + i % k * 11) % 7) as i32 - 3).collect();
        let host = |v: &[i32]| v.iter().map(|&x| bf16::from_f32(x as f32)).collect::<Vec<_>>();
        let a = p.stream.clone_htod(&host(&av)).unwrap();
        let b = p.stream.clone_htod(&host(&bv)).unwrap();
        let (ku, nu) = (k as usize, n as usize);
        let want: Vec<f32> = (0..m as usize * nu)
            .map(|e| (0..ku).map(|kk| av[e / nu * ku + kk] * bv[e % nu * ku + kk]).sum::<i32>() as f32)
            .collect();
        for (round, smem) in [SMEM, SMEM, half].into_iter().enumerate() {
            let c = p.stream.clone_htod(&vec![f32::NAN; (m * n) as usize]).unwrap();
            let (pa, pb, pc) = (p.addr(&a), p.addr(&b), p.addr(&c));
            let cfg = Probes::cfg((m / TILE_MN) * (n / TILE_MN), THREADS, smem);
            // SAFETY: A (m × k), B (n × k) and C (m × n) hold the grid's shape; 256 threads and at
            // least `SMEM` bytes, allowed by the attribute above.
            unsafe { p.stream.launch_builder(&f).arg(&pa).arg(&pb).arg(&pc).arg(&n).arg(&k).launch(cfg) }.unwrap();
            let got = p.stream.clone_dtoh(&c).unwrap();
            if let Some(e) = (0..want.len()).find(|&e| got[e].to_bits() != want[e].to_bits()) {
                panic!(
                    "{m}x{n}x{k}, launch {round} ({smem} B): C[{}][{}] = {}, want {}",
                    e / nu,
                    e % nu,
                    got[e],
                    want[e]
                );
            }
        }
    }
}

#[test]
fn warpgroup_gemm_matches_the_cpu() {
    use oxccl_bench_kernels::wgmma_shape::{SMEM, THREADS, TILE_M, TILE_N};
    let Some(p) = Probes::new("warpgroup_gemm_matches_the_cpu") else { return };
    let f = p.f("bench_gemm_wgmma");
    f.set_attribute(sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, SMEM as i32).unwrap();
    // The kernel's status words in mapped host memory (one address for host and device), readable
    // while it runs.
    let mut host: *mut std::ffi::c_void = std::ptr::null_mut();
    // SAFETY: allocates 36 bytes of pinned, mapped host memory in the current context; freed below.
    unsafe {
        sys::cuMemHostAlloc(&mut host, 36, 0x02 /* CU_MEMHOSTALLOC_DEVICEMAP */)
    }
    .result()
    .unwrap();
    let status = host.cast::<u32>();
    // Small integers: every product and every sum is exact in bf16 inputs and f32 accumulation, so
    // C must match bit for bit. K of 1, 2, 3 (the ring's depth), 4, 10 and 32 stages' worth, several
    // tiles in each direction; each shape three times (a missing wait need not show in one launch).
    for (m, n, k) in
        [(128u32, 256u32, 64u32), (256, 512, 128), (128, 256, 192), (384, 256, 256), (256, 768, 640), (256, 256, 2048)]
    {
        let av: Vec<i32> = (0..m * k).map(|i| ((i / k * 7 + i % k * 3) % 9) as i32 - 4).collect();
        let bv: Vec<i32> = (0..n * k).map(|i| ((i / k * 5 + i % k * 11) % 7) as i32 - 3).collect();
        let host = |v: &[i32]| v.iter().map(|&x| bf16::from_f32(x as f32)).collect::<Vec<_>>();
        let a = p.stream.clone_htod(&host(&av)).unwrap();
        let b = p.stream.clone_htod(&host(&bv)).unwrap();
        let maps = oxccl_cli::bench::wgmma_maps(p.addr(&a), p.addr(&b), m, n, k).unwrap();
        let maps = p.stream.clone_htod(&maps[..]).unwrap();
        let (ku, nu) = (k as usize, n as usize);
        let want: Vec<f32> = (0..m as usize * nu)
            .map(|e| (0..ku).map(|kk| av[e / nu * ku + kk] * bv[e % nu * ku + kk]).sum::<i32>() as f32)
            .collect();
        for round in 0..3 {
            let c = p.stream.clone_htod(&vec![f32::NAN; (m * n) as usize]).unwrap();
            // SAFETY: the kernel has ended (the stream was idle at the last check); nothing else
            // touches the words.
            unsafe { (0..9).for_each(|w| status.add(w).write_volatile(0)) };
            let (pm, pc, ps) = (p.addr(&maps), p.addr(&c), status as u64);
            let cfg = Probes::cfg((m / TILE_M) * (n / TILE_N), THREADS, SMEM);
            // SAFETY: the maps describe A (m × k) and B (n × k), C holds m × n f32, `status` nine
            // mapped u32, and the grid has the shape's tiles; 256 threads and `SMEM` bytes,
            // allowed by the attribute above.
            unsafe { p.stream.launch_builder(&f).arg(&pm).arg(&pc).arg(&ps).arg(&n).arg(&k).launch(cfg) }.unwrap();
            // A kernel that hangs is reported, with how far CTA 0's warps got, not waited on.
            let start = std::time::Instant::now();
            // SAFETY: a query of a live stream.
            while unsafe { sys::cuStreamQuery(p.stream.cu_stream()) } == sys::CUresult::CUDA_ERROR_NOT_READY {
                if start.elapsed() > std::time::Duration::from_secs(10) {
                    // SAFETY: mapped host memory the kernel writes with system-scope stores.
                    let words: Vec<u32> = (0..9).map(|w| unsafe { status.add(w).read_volatile() }).collect();
                    let steps: Vec<String> =
                        words[1..].iter().map(|w| format!("{}:{}", w >> 24, w & 0xff_ffff)).collect();
                    println!(
                        "{m}x{n}x{k}, launch {round}: still running after 10 s; gave up {:#x}; CTA 0 warps (step:tile) {}",
                        words[0],
                        steps.join(" ")
                    );
                    std::process::exit(2);
                }
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
            // SAFETY: as above; the kernel has ended.
            let st = unsafe { status.read_volatile() };
            assert_eq!(
                st,
                0,
                "{m}x{n}x{k}, launch {round}: a wait gave up (kind {}, tile {})",
                st >> 28,
                st & 0xfff_ffff
            );
            let got = p.stream.clone_dtoh(&c).unwrap();
            if let Some(e) = (0..want.len()).find(|&e| got[e].to_bits() != want[e].to_bits()) {
                let wrong = (0..want.len()).filter(|&e| got[e].to_bits() != want[e].to_bits()).count();
                panic!(
                    "{m}x{n}x{k}, launch {round}: C[{}][{}] = {}, want {} ({wrong} of {} wrong)",
                    e / nu,
                    e % nu,
                    got[e],
                    want[e],
                    want.len()
                );
            }
        }
    }
    // SAFETY: allocated above; no kernel uses it any more.
    unsafe { sys::cuMemFreeHost(host) }.result().unwrap();
    println!("warpgroup GEMM exact on 6 shapes, 3 launches each");
}

#[test]
fn tensor_core_gemm_refuses_another_block_size() {
    use oxccl_bench_kernels::gemm_shape::SMEM;
    let Some(p) = Probes::new("tensor_core_gemm_refuses_another_block_size") else { return };
    let f = p.f("bench_gemm_bf16");
    f.set_attribute(sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, SMEM as i32).unwrap();
    // The block size is part of the kernel (`.reqntid`): another fails to launch.
    let (a, b) = (p.stream.alloc_zeros::<bf16>(128 * 32).unwrap(), p.stream.alloc_zeros::<bf16>(128 * 32).unwrap());
    let c = p.stream.alloc_zeros::<f32>(128 * 128).unwrap();
    let (pa, pb, pc, n, k) = (p.addr(&a), p.addr(&b), p.addr(&c), 128u32, 32u32);
    // SAFETY: refused at launch (the block size); were it not, one 128 × 128 tile fits the buffers.
    let wrong = unsafe {
        p.stream.launch_builder(&f).arg(&pa).arg(&pb).arg(&pc).arg(&n).arg(&k).launch(Probes::cfg(1, 128, SMEM))
    };
    assert!(wrong.is_err(), "a 128-thread launch of the 256-thread GEMM was accepted");
}

// The `tma_trace` kernel's timed copy, one test per kind of timed chain (so that each runs, and runs
// under the sanitizers, on its own): ALU without an L2 policy, FMA with the evict-first policy,
// shared-memory loads and independent ALU streams without.
#[test]
fn timed_bulk_copies_with_an_alu_chain() {
    timed_bulk_copies("timed_bulk_copies_with_an_alu_chain", 0, 0);
}

#[test]
fn timed_bulk_copies_with_an_l2_policy_and_an_fma_chain() {
    timed_bulk_copies("timed_bulk_copies_with_an_l2_policy_and_an_fma_chain", 1, 1);
}

#[test]
fn timed_bulk_copies_with_a_shared_memory_chain() {
    timed_bulk_copies("timed_bulk_copies_with_a_shared_memory_chain", 0, 2);
}

#[test]
fn timed_bulk_copies_with_independent_alu_streams() {
    timed_bulk_copies("timed_bulk_copies_with_independent_alu_streams", 0, 3);
}

#[test]
fn timed_bulk_copies_in_rounds_of_four() {
    // One round of stages refilled after its own stores, then two rounds with one ahead, then three
    // with one ahead and the refill two rounds behind.
    for (evict_first, shape) in [(0, (4, 1, 12)), (1, (4, 1, 12)), (0, (8, 1, 16)), (1, (12, 2, 24))] {
        timed_copies("timed_bulk_copies_in_rounds_of_four", evict_first, 0, 4, shape, true, false);
    }
}

#[test]
fn untraced_bulk_copies() {
    for (round, shape) in [(1, (4, 2, 8)), (4, (8, 1, 16))] {
        timed_copies("untraced_bulk_copies", 0, 0, round, shape, false, false);
    }
}

#[test]
fn timed_tensor_copies() {
    // Each item one box of four 1 KiB rows through the two maps, traced and untraced.
    for traced in [true, false] {
        timed_copies("timed_tensor_copies", 0, 0, 1, (4, 2, 8), traced, true);
    }
}

fn timed_bulk_copies(test: &str, evict_first: u32, chain_op: u32) {
    timed_copies(test, evict_first, chain_op, 1, (3, 1, 6), true, false);
}

/// Two CTAs of two issuing warps, each copying `items` chunks of 4 KiB through `stages` stages in
/// rounds of `round` items, refilled `lag` rounds behind, with trace records or without:
/// `%clock64` times, `%warpid`, `createpolicy` and the `.L2::cache_hint` copies exercised; with
/// `tensor` through 2-D tensor maps of both buffers (rows of `TENSOR_ROW` bytes, one box of
/// `chunk / TENSOR_ROW` rows per item).
fn timed_copies(
    test: &str,
    evict_first: u32,
    chain_op: u32,
    round: u32,
    (stages, lag, items): (u32, u32, u32),
    traced: bool,
    tensor: bool,
) {
    use oxccl_bench_kernels::trace_layout::*;
    let Some(p) = Probes::new(test) else { return };
    let (ctas, warps, chunk, chain) = (2u32, 2u32, 4096u32, 64u32);
    let bytes = chunk * items;
    let total = (ctas * warps * bytes) as usize;
    let f = p.f("bench_tma_trace");
    let smem = BARRIER_BYTES + warps * stages * chunk;
    f.set_attribute(sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem as i32).unwrap();
    let sms =
        p.stream.context().attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT).unwrap() as u32;
    let data: Vec<u8> = (0..total).map(|i| (i * 7 + i / 4096) as u8).collect();
    let src = p.stream.clone_htod(&data).unwrap();
    let dst = p.stream.alloc_zeros::<u8>(total).unwrap();
    let traced = if traced { items } else { 0 };
    let stride = warp_words(traced as usize);
    let trace = p.stream.alloc_zeros::<u32>((ctas * warps) as usize * stride).unwrap();
    let (d, s, t) = (p.addr(&dst), p.addr(&src), p.addr(&trace));
    // Both buffers as rows of TENSOR_ROW bytes (u32 elements), boxes of one chunk.
    let row_words = (TENSOR_ROW / 4) as u64;
    let rows = total as u64 / TENSOR_ROW as u64;
    let box_rows = [row_words as u32, chunk / TENSOR_ROW];
    let maps = p
        .stream
        .clone_htod(
            &[tensor_map(&[row_words, rows], &box_rows, s), tensor_map(&[row_words, rows], &box_rows, d)].concat(),
        )
        .unwrap();
    let m = if tensor { p.addr(&maps) } else { 0u64 };
    let mut l = p.stream.launch_builder(&f);
    l.arg(&d)
        .arg(&s)
        .arg(&bytes)
        .arg(&chunk)
        .arg(&stages)
        .arg(&lag)
        .arg(&chain)
        .arg(&t)
        .arg(&traced)
        .arg(&evict_first)
        .arg(&chain_op)
        .arg(&round)
        .arg(&m);
    // SAFETY: whole warps; chunk a multiple of 16 and bytes whole rounds of chunks; `round` divides
    // `stages`, 1 <= lag <= stages / round; the shared memory holds the barriers and both warps'
    // rings; `src` and `dst` (distinct) hold every warp's slice and `trace` its words; with `tensor`,
    // `maps` holds both buffers' maps (whole rows, boxes of one 4 KiB chunk), round 1, no hint.
    unsafe { l.launch(Probes::cfg(ctas, 32 * warps, smem)) }.unwrap();
    assert!(p.stream.clone_dtoh(&dst).unwrap() == data, "evict_first {evict_first}, tensor {tensor}: the copy differs");
    let v = p.stream.clone_dtoh(&trace).unwrap();
    for w in 0..(ctas * warps) as usize {
        let h = &v[w * stride..][..stride];
        assert!(h[H_WARPID] < 64 && h[H_SMID] < sms, "warp {w}: %warpid {} / %smid {}", h[H_WARPID], h[H_SMID]);
        assert_eq!(h[H_ITEMS], items, "warp {w}: items");
        // 64 dependent steps of two instructions (or of a shared-memory load) cannot take fewer
        // than 128 cycles; 64 steps of 16 instructions (independent streams) not fewer than 1024,
        // one instruction per cycle being a warp's most.
        let (chain_cycles, copy_cycles) = (h[H_CHAIN_CYCLES], h[H_COPY_CYCLES]);
        let least = if chain_op == 3 { 16 * chain } else { 2 * chain };
        assert!(chain_cycles >= least && copy_cycles > 0, "warp {w}: chain {chain_cycles}, copy {copy_cycles}");
        let rec = |j: usize| &h[HEADER_WORDS + RECORD_WORDS * j..][..RECORD_WORDS];
        for j in 0..traced as usize {
            let (issued, landed, committed) = (rec(j)[R_ISSUED], rec(j)[R_LANDED], rec(j)[R_COMMITTED]);
            assert!(
                issued <= landed && landed <= committed && committed <= copy_cycles,
                "warp {w} item {j}: {:?}",
                rec(j)
            );
            // One item after another, or (in rounds) one round after another.
            if j > 0 && j % round as usize == 0 {
                assert!(committed > rec(j - 1)[R_COMMITTED], "warp {w} item {j}: commits out of order");
            }
        }
    }
}
