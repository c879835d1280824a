# Probe: does a small CTA run beside cuBLAS's GEMM CTAs without displacing them? A kernel on a few
# SMs (or all) for as long as the GEMMs take alone, launched just before them; GEMM time beside it
# over alone (about 1: it co-resides; the share of SMs it holds, or 2 on every SM: the GEMM waited).
# Run on the GPU machine: `python3 -W ignore scripts/coresident_probe.py` (a kernel that spins with
# NREG live registers and shared-memory traffic), `... --sleep` (one that only sleeps) or `... --narrow`
# (the sleeping kernel within 8 registers per thread, the register file's unit per warp, beside
# 16 as a control: cuBLAS's 384 × 168-register CTA leaves one 256-register unit per scheduler).
import sys, torch, cupy as cp
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
}
extern "C" __global__ void nap(unsigned long long ns, unsigned int* out) {
  extern __shared__ unsigned int s[];
  unsigned long long t0, t; unsigned int smid;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
  s[threadIdx.x] = smid;
  do { __nanosleep(2000); asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
  if (threadIdx.x == 0) out[2*blockIdx.x] = s[0] + 1;
}'''
# The sleeping kernel written in PTX with `.maxnreg 8` (the compilers' lower bound for `nap` is 10).
NAP8 = r'''.version 8.0
.target sm_90
.address_size 64
.extern .shared .align 16 .b8 s[];
.visible .entry nap8(.param .u64 ns, .param .u64 out)
.maxnreg 8
{
.reg .b64 %rd<4>; .reg .b32 %r<3>; .reg .pred %p<2>;
ld.param.u64 %rd1, [ns];
mov.u64 %rd2, %globaltimer;
mov.u32 %r1, %smid;
mov.u32 %r2, s;
st.shared.u32 [%r2], %r1;
$L_again:
nanosleep.u32 2000;
mov.u64 %rd3, %globaltimer;
sub.u64 %rd3, %rd3, %rd2;
setp.lt.u64 %p1, %rd3, %rd1;
@%p1 bra $L_again;
ret;
}
'''
sleep = "--sleep" in sys.argv[1:]
# (live registers in the spin loop, register cap, shared bytes, CTAs, threads, carveout % or -1)
SPIN = [(1, 32, 16384, 8, 32, -1), (20, 32, 16384, 8, 32, -1), (28, 40, 16384, 8, 32, -1), (36, 48, 16384, 8, 32, -1),
        (56, 72, 16384, 8, 32, -1), (20, 32, 16384, 8, 64, -1), (20, 32, 33792, 32, 32, -1), (20, 32, 38912, 8, 32, -1)]
SLEEP = [(1, 32, 256, 132, 32, -1), (1, 16, 256, 132, 32, 100), (1, 32, 16384, 132, 32, -1), (1, 32, 16384, 132, 32, 100),
         (1, 32, 33792, 132, 32, 100), (1, 32, 34816, 132, 32, 100), (1, 32, 36864, 132, 32, 100),
         (1, 32, 33792, 132, 32, -1), (1, 40, 16384, 132, 32, 100), (1, 32, 16384, 132, 64, 100), (1, 32, 33792, 64, 32, 100)]
NARROW = [(1, 8, 256, 132, 32, 100), (1, 8, 256, 132, 32, -1), (1, 16, 256, 132, 32, 100), (1, 8, 16384, 132, 32, 100),
          (1, 8, 32768, 132, 32, 100), (1, 8, 36864, 132, 32, 100), (1, 8, 16384, 132, 128, 100),
          (1, 8, 16384, 264, 32, 100), (1, 8, 8192, 528, 32, 100),
          (1, 8, 256, 132, 32, 85), (1, 8, 256, 132, 32, 86), (1, 8, 8192, 132, 32, 85), (1, 8, 8192, 132, 32, 86),
          (1, 16, 256, 132, 32, 85), (1, 8, 4096, 132, 128, 85)]
narrow = "--narrow" in sys.argv[1:]
sleep = sleep or narrow
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
for nreg, regs, smem, ctas, threads, carve in (NARROW if narrow else SLEEP if sleep else SPIN):
    smem = max(smem, 4 * threads)  # the nap kernel writes one word per thread
    if narrow and regs == 8:
        with open('/tmp/nap8.ptx', 'w') as f: f.write(NAP8)
        k = cp.RawModule(path='/tmp/nap8.ptx').get_function('nap8')
    else:
        k = cp.RawKernel(src, 'nap' if sleep else 'spin', options=(f'-maxrregcount={regs}', f'-DNREG={nreg}'))
    k.max_dynamic_shared_size_bytes = smem
    if carve >= 0: k.preferred_shared_memory_carveout = carve
    ns = int(alone * 1e6)
    def both():
        with cp.cuda.ExternalStream(ks.cuda_stream):
            k((ctas,), (threads,), (cp.uint64(ns), out), shared_mem=smem)
        gemms(n)
    # the probe kernel first, then the GEMMs (gs waits for nothing; both streams run concurrently)
    t = min(timed(both) for _ in range(2 if sleep else 3))
    print(f"{'nap' if sleep else 'spin'} regs<={regs} (uses {k.num_regs}) smem {smem} B ctas {ctas} threads {threads} carveout {carve}: gemm x{n} beside {t:.3f} ms ({t/alone:.3f}x)")
if narrow:
    # The other order: the GEMMs first, then (2 ms later) the sleeping kernel for 1 ms; its end
    # measured from the GEMMs' start: about 3 ms if it found room beside their CTAs, the GEMMs'
    # whole time if it waited for them.
    import time
    for nreg, regs, smem, ctas, threads, carve in NARROW:
        smem = max(smem, 4 * threads)
        if regs == 8:
            k = cp.RawModule(path='/tmp/nap8.ptx').get_function('nap8')
        else:
            k = cp.RawKernel(src, 'nap', options=(f'-maxrregcount={regs}', '-DNREG=1'))
        k.max_dynamic_shared_size_bytes = smem
        if carve >= 0: k.preferred_shared_memory_carveout = carve
        torch.cuda.synchronize()
        e0 = torch.cuda.Event(enable_timing=True); e1 = torch.cuda.Event(enable_timing=True)
        e0.record(gs); gemms(n); time.sleep(0.002)
        with cp.cuda.ExternalStream(ks.cuda_stream):
            k((ctas,), (threads,), (cp.uint64(1000000), out), shared_mem=smem)
        e1.record(ks); torch.cuda.synchronize()
        print(f"after: nap regs<={regs} (uses {k.num_regs}) smem {smem} B ctas {ctas} threads {threads} carveout {carve}: ends {e0.elapsed_time(e1):.3f} ms after the GEMMs' start (GEMMs alone {alone:.3f})")
