# Probe: does a small CTA (one warp, capped registers, some shared memory) run beside cuBLAS's GEMM
# CTAs without displacing them? A spin kernel on a few SMs for as long as the GEMMs take alone; GEMM
# time alone against beside it. Run on the GPU machine: `python3 scripts/coresident_probe.py`.
import torch, cupy as cp
src = r'''
extern "C" __global__ void spin(unsigned long long ns, unsigned int* out) {
  extern __shared__ unsigned int s[];
  unsigned long long t0, t; unsigned int smid;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
  unsigned int r[NREG]; 
  #pragma unroll
  for (int i = 0; i < NREG; i++) r[i] = threadIdx.x * (i + 1);
  unsigned int acc = threadIdx.x;
  do { s[threadIdx.x & 31] = acc;
       #pragma unroll
       for (int i = 0; i < NREG; i++) r[i] = r[i] * 3u + r[(i + 1) % NREG];
       acc += r[0] ^ s[(threadIdx.x + 1) & 31];
       asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
  #pragma unroll
  for (int i = 0; i < NREG; i++) acc += r[i];
  if (threadIdx.x == 0) { out[2*blockIdx.x] = smid; out[2*blockIdx.x+1] = acc; }
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
out = cp.zeros(64, dtype=cp.uint32)
for nreg, regs, smem, ctas, threads in [(1, 32, 16*1024, 8, 32), (20, 32, 16*1024, 8, 32), (28, 40, 16*1024, 8, 32), (36, 48, 16*1024, 8, 32), (56, 72, 16*1024, 8, 32), (20, 32, 16*1024, 8, 64), (20, 32, 33*1024, 32, 32), (20, 32, 38*1024, 8, 32)]:
    k = cp.RawKernel(src, 'spin', options=(f'-maxrregcount={regs}', f'-DNREG={nreg}'))
    k.max_dynamic_shared_size_bytes = smem
    ns = int(alone * 1e6)
    def both():
        with cp.cuda.ExternalStream(ks.cuda_stream):
            k((ctas,), (threads,), (cp.uint64(ns), out), shared_mem=smem)
        gemms(n)
    # the spin kernel first, then the GEMMs (gs waits for nothing; both streams run concurrently)
    t = min(timed(both) for _ in range(3))
    print(f"regs<={regs} (uses {k.num_regs}) smem {smem//1024} KiB ctas {ctas} threads {threads}: gemm x{n} beside {t:.3f} ms ({t/alone:.3f}x)")
