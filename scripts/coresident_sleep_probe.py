# Does a CTA that only sleeps (nanosleep), one on every SM, run beside cuBLAS's GEMM? GEMM time beside it
# over alone: about 1 means it co-resides, about 2 that the GEMM waited for its SMs. Run on the GPU
# machine: `python3 -W ignore scripts/coresident_sleep_probe.py`.
import torch, cupy as cp
src = r'''
extern "C" __global__ void nap(unsigned long long ns, unsigned int* out) {
  extern __shared__ unsigned int s[];
  unsigned long long t0, t; unsigned int smid;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
  s[threadIdx.x] = smid;
  do { __nanosleep(2000); asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
  if (threadIdx.x == 0) out[blockIdx.x] = s[0] + 1;
}'''
M = 8192
a = torch.randn(M, M, device='cuda', dtype=torch.bfloat16); b = torch.randn(M, M, device='cuda', dtype=torch.bfloat16)
gs = torch.cuda.Stream(); ks = torch.cuda.Stream()
def gemms(n):
    with torch.cuda.stream(gs):
        for _ in range(n): torch.matmul(a, b)
def timed(fn):
    e0 = torch.cuda.Event(enable_timing=True); e1 = torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(); e0.record(gs); fn(); e1.record(gs); torch.cuda.synchronize(); return e0.elapsed_time(e1)
gemms(3); torch.cuda.synchronize()
n = 12; alone = min(timed(lambda: gemms(n)) for _ in range(3))
print(f"gemm x{n} alone {alone:.3f} ms")
out = cp.zeros(1024, dtype=cp.uint32)
for regs, smem, ctas, threads, carve in [(32,256,132,32,-1),(16,256,132,32,100),(32,16384,132,32,-1),(32,16384,132,32,100),(32,33*1024,132,32,100),(32,34*1024,132,32,100),(32,36*1024,132,32,100),(32,33*1024,132,32,-1),(40,16384,132,32,100),(32,16384,132,64,100),(32,33*1024,64,32,100)]:
    k = cp.RawKernel(src, 'nap', options=(f'-maxrregcount={regs}',))
    k.max_dynamic_shared_size_bytes = max(smem, 256)
    if carve >= 0: k.preferred_shared_memory_carveout = carve
    ns = int(alone * 1e6)
    def both():
        with cp.cuda.ExternalStream(ks.cuda_stream):
            k((ctas,), (threads,), (cp.uint64(ns), out), shared_mem=max(smem,256))
        gemms(n)
    t = min(timed(both) for _ in range(2))
    print(f"regs<={regs} (uses {k.num_regs}) smem {smem} B ctas {ctas} threads {threads} carveout {carve}: gemm x{n} beside {t:.3f} ms ({t/alone:.3f}x)")
