# Probe: does any of cuBLASLt's algorithms for the overlap benchmark's GEMM leave room on its SMs for a
# collective's CTA, and how fast is it? For each algorithm cuBLASLt's heuristic offers for a bf16
# C (m x n) = A (m x k) . B (k x n) (column-major, f32 accumulation, the shape `oxccl bench overlap
# --compute gemm --gemm M,N,K` runs), this times N GEMMs alone, then beside a sleeping kernel of one CTA
# per SM launched just before them (the shapes of the TMA collective's CTAs: registers per thread,
# threads, shared memory). GEMMs beside / alone near 1: the sleeping CTAs found room beside the GEMM's;
# near 2: the GEMMs waited for them. The kernel each algorithm runs is named from the profiler.
# Run on the GPU machine: `python3 -W ignore scripts/cublaslt_room_probe.py [M N K]`.
import ctypes, glob, os, sys
import torch, cupy as cp

M, N, K = (int(x) for x in sys.argv[1:4]) if len(sys.argv) >= 4 else (8192, 8192, 2048)
REPS = 8

site = os.path.dirname(os.path.dirname(torch.__file__))
paths = sorted(glob.glob(os.path.join(site, "nvidia", "**", "libcublasLt.so*"), recursive=True))
lt = ctypes.CDLL(paths[0])
c_p, c_u64, c_i64, c_i32 = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int64, ctypes.c_int32


def ok(status, what):
    if status != 0:
        raise RuntimeError(f"{what}: cublasStatus {status}")


CUBLAS_COMPUTE_32F, CUDA_R_32F, CUDA_R_16BF = 68, 0, 14
PREF_MAX_WORKSPACE_BYTES = 1


class Heuristic(ctypes.Structure):
    _fields_ = [("algo", c_u64 * 8), ("workspace", ctypes.c_size_t), ("state", c_i32), ("waves", ctypes.c_float),
                ("reserved", c_i32 * 4)]


handle = c_p()
ok(lt.cublasLtCreate(ctypes.byref(handle)), "cublasLtCreate")
desc = c_p()
ok(lt.cublasLtMatmulDescCreate(ctypes.byref(desc), c_i32(CUBLAS_COMPUTE_32F), c_i32(CUDA_R_32F)), "MatmulDescCreate")


def layout(rows, cols):
    l = c_p()
    ok(lt.cublasLtMatrixLayoutCreate(ctypes.byref(l), c_i32(CUDA_R_16BF), c_u64(rows), c_u64(cols), c_i64(rows)),
       "MatrixLayoutCreate")
    return l


la, lb, lc = layout(M, K), layout(K, N), layout(M, N)
pref = c_p()
ok(lt.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "PreferenceCreate")
ws_bytes = 64 << 20
ws_val = c_u64(ws_bytes)
ok(lt.cublasLtMatmulPreferenceSetAttribute(pref, c_i32(PREF_MAX_WORKSPACE_BYTES), ctypes.byref(ws_val), c_u64(8)),
   "PreferenceSetAttribute")
want = 32
results = (Heuristic * want)()
got = c_i32()
ok(lt.cublasLtMatmulAlgoGetHeuristic(handle, desc, la, lb, lc, lc, pref, c_i32(want), results, ctypes.byref(got)),
   "AlgoGetHeuristic")

# Column-major A (m x k) is a row-major (k x m) tensor, and so on.
a = torch.randn(K, M, device="cuda", dtype=torch.bfloat16) * 0.05
b = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.05
c = torch.empty(N, M, device="cuda", dtype=torch.bfloat16)
ws = torch.empty(ws_bytes, device="cuda", dtype=torch.uint8)
alpha, beta = ctypes.c_float(1.0), ctypes.c_float(0.0)
gs, ks = torch.cuda.Stream(), torch.cuda.Stream()


def gemms(h, n):
    for _ in range(n):
        ok(lt.cublasLtMatmul(handle, desc, ctypes.byref(alpha), c_p(a.data_ptr()), la, c_p(b.data_ptr()), lb,
                             ctypes.byref(beta), c_p(c.data_ptr()), lc, c_p(c.data_ptr()), lc, ctypes.byref(h.algo),
                             c_p(ws.data_ptr()), c_u64(h.workspace), c_p(gs.cuda_stream)), "Matmul")


def timed(fn):
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    e0.record(gs)
    fn()
    e1.record(gs)
    torch.cuda.synchronize()
    return e0.elapsed_time(e1)


# A CTA that sleeps, asking for NREG values to stay live, and a shared-memory word. The compiler may
# keep fewer: the header line prints the registers each shape got (10 for every shape on CUDA 13's
# NVRTC, 2026-12-02), so its rows probe the shared memory and threads, at the fewest registers.
SRC = r'''
extern "C" __global__ void nap(unsigned long long ns, unsigned int* out) {
  extern __shared__ unsigned int s[];
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  unsigned int r[NREG];
  #pragma unroll
  for (int i = 0; i < NREG; i++) r[i] = threadIdx.x * (i + 3);
  do { __nanosleep(2000);
       #pragma unroll
       for (int i = 0; i < NREG; i++) asm volatile("" : "+r"(r[i]));
       asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
  unsigned int acc = 0;
  #pragma unroll
  for (int i = 0; i < NREG; i++) acc += r[i];
  s[threadIdx.x] = acc;
  if (threadIdx.x == 0) out[blockIdx.x] = s[0];
}'''
# (threads, live registers, register cap, shared bytes): the smallest CTA (one warp, 1 KiB), a
# one-warp bulk CTA, the 128-thread TMA CTA, the 256-thread register-combine CTA. `ROOM_SHAPES`
# replaces them: "threads:live:cap:bytes;...".
SHAPES = [(32, 1, 16, 1024), (32, 16, 32, 49152), (128, 150, 176, 132096), (256, 150, 176, 230400)]
if os.environ.get("ROOM_SHAPES"):
    SHAPES = [tuple(int(x) for x in s.split(":")) for s in os.environ["ROOM_SHAPES"].split(";")]
kernels = []
for threads, nreg, cap, smem in SHAPES:
    k = cp.RawKernel(SRC, "nap", options=(f"-maxrregcount={cap}", f"-DNREG={nreg}"))
    k.max_dynamic_shared_size_bytes = smem
    k.preferred_shared_memory_carveout = 100
    kernels.append((threads, smem, k))
out = cp.zeros(1024, dtype=cp.uint32)
sms = torch.cuda.get_device_properties(0).multi_processor_count
flop = 2.0 * M * N * K * REPS
print(f"# cuBLASLt {os.path.basename(paths[0])}: {got.value} algorithms for bf16 {M}x{N}x{K}, {REPS} GEMMs per timing")
print("# sleeping CTAs, one per SM: " + "; ".join(
    f"{t} threads x {k.num_regs} registers, {s} B shared" for t, s, k in kernels))
names = {}
for i in range(got.value):
    h = results[i]
    if h.state != 0:
        continue
    try:
        gemms(h, 2)
        torch.cuda.synchronize()
    except RuntimeError as e:
        print(f"algo {i}: {e}")
        continue
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        gemms(h, 1)
        torch.cuda.synchronize()
    kern = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    alone = min(timed(lambda: gemms(h, REPS)) for _ in range(3))
    row = [f"algo {i:2d}", f"{alone:7.3f} ms", f"{flop / alone / 1e9:6.1f} TFLOP/s", f"ws {h.workspace >> 20} MiB"]
    for threads, smem, k in kernels:
        ns = int(alone * 1e6)

        def both():
            with cp.cuda.ExternalStream(ks.cuda_stream):
                k((sms,), (threads,), (cp.uint64(ns), out), shared_mem=smem)
            gemms(h, REPS)

        t = min(timed(both) for _ in range(2))
        row.append(f"{threads}t:{t / alone:5.3f}x")
    print("  ".join(row) + "  " + ",".join(sorted(set(kern)))[:160])
