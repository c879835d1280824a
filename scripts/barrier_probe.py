# Probe: what a cross-rank barrier between K separately launched kernels on one GPU costs, by the
# memory scope of its fences and flags and by the steps it takes (the per-rank walker's start and
# end barriers, step by step). Each of K streams runs N one-CTA kernels; kernel i of stream s meets
# the other K-1 of call i through flags in each rank's workspace (release: a fence, then relaxed
# stores into every peer's slot; acquire: relaxed polls of its own slots, then a fence). A gate
# kernel holds every stream until all launches are queued. Printed: device time per call.
# Also the cost of one fence of each scope, alone and between other kernels' polls.
# Run on the GPU machine: `python3 -W ignore scripts/barrier_probe.py [N]` (cupy and a GPU).
import sys, cupy as cp

SRC = r'''
__device__ __forceinline__ unsigned long long now() { unsigned long long t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t; }
template <int SYS> __device__ __forceinline__ unsigned long long ld(unsigned long long* p) {
  unsigned long long v;
  if (SYS) asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  else asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
template <int SYS> __device__ __forceinline__ void st(unsigned long long* p, unsigned long long v) {
  if (SYS) asm volatile("st.relaxed.sys.global.u64 [%0], %1;" :: "l"(p), "l"(v) : "memory");
  else asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" :: "l"(p), "l"(v) : "memory");
}
template <int SYS> __device__ __forceinline__ void fence() {
  if (SYS) asm volatile("fence.acq_rel.sys;" ::: "memory");
  else asm volatile("fence.acq_rel.gpu;" ::: "memory");
}
template <int SYS> __device__ __forceinline__ unsigned long long cas(unsigned long long* p, unsigned long long a, unsigned long long b) {
  unsigned long long v;
  if (SYS) asm volatile("atom.relaxed.sys.global.cas.b64 %0, [%1], %2, %3;" : "=l"(v) : "l"(p), "l"(a), "l"(b) : "memory");
  else asm volatile("atom.relaxed.gpu.global.cas.b64 %0, [%1], %2, %3;" : "=l"(v) : "l"(p), "l"(a), "l"(b) : "memory");
  return v;
}
extern "C" __global__ void gate(unsigned long long until) { while (now() < until) {} }
// steps: 1 start flags, 2 take (CAS) + fence, 4 announce (5 words per peer, one round per word),
// 8 end flags, 16 announce in one round.
template <int SYS>
__device__ void bar_impl(unsigned long long* ws, int rank, int k, unsigned long long seq, int steps,
                         unsigned long long* times, unsigned slot) {
  unsigned long long t0 = now();
  if (threadIdx.x == 0) {
    unsigned long long* own = ws + rank * 64;
    unsigned long long acc = 0;
    for (int w = 0; w < 5; w++) own[32 + w] = seq * 8 + w;
    if (steps & 1) {
      fence<SYS>();
      for (int q = 0; q < k; q++) if (q != rank) st<SYS>(ws + q * 64 + rank, seq);
      for (int q = 0; q < k; q++) if (q != rank) { while (ld<SYS>(own + q) < seq) {} }
      fence<SYS>();
    }
    if (steps & 2) {
      for (int q = 0; q < k; q++) if (q != rank) acc += cas<SYS>(own + q, seq, seq);
      fence<SYS>();
    }
    if (steps & 4) {
      for (int w = 0; w < 5; w++) {
        unsigned long long r = 0;
        for (int q = 0; q < k; q++) if (q != rank) r += ld<SYS>(ws + q * 64 + 32 + w);
        acc += r * (acc + 1);
      }
    }
    if (steps & 16) {
      for (int q = 0; q < k; q++) if (q != rank) for (int w = 0; w < 5; w++) acc += ld<SYS>(ws + q * 64 + 32 + w);
    }
    if (steps & 8) {
      fence<SYS>();
      for (int q = 0; q < k; q++) if (q != rank) st<SYS>(ws + q * 64 + 8 + rank, seq);
      for (int q = 0; q < k; q++) if (q != rank) { while (ld<SYS>(own + 8 + q) < seq) {} }
      fence<SYS>();
    }
    if (acc == 12345) own[40] = acc;
  }
  __syncthreads();
  unsigned long long t1 = now();
  if (threadIdx.x == 0) { times[2 * slot] = t0; times[2 * slot + 1] = t1; }
}
extern "C" __global__ void bar_sys(unsigned long long* ws, int rank, int k, unsigned long long seq, int steps, unsigned long long* times, unsigned slot) { bar_impl<1>(ws, rank, k, seq, steps, times, slot); }
extern "C" __global__ void bar_gpu(unsigned long long* ws, int rank, int k, unsigned long long seq, int steps, unsigned long long* times, unsigned slot) { bar_impl<0>(ws, rank, k, seq, steps, times, slot); }
extern "C" __global__ void fences(int sys, int n, unsigned long long* out) {
  unsigned long long t0 = now();
  for (int i = 0; i < n; i++) { if (sys) fence<1>(); else fence<0>(); }
  unsigned long long t1 = now();
  if (threadIdx.x == 0) out[0] = t1 - t0;
}
extern "C" __global__ void nowk(unsigned long long* out) { out[0] = now(); }
'''
mod = cp.RawModule(code=SRC, options=("-std=c++17",))
gate, bar_sys, bar_gpu, fences, nowk = (mod.get_function(n) for n in ("gate", "bar_sys", "bar_gpu", "fences", "nowk"))


def device_now():
    out = cp.zeros(1, dtype=cp.uint64)
    nowk((1,), (1,), (out,))
    cp.cuda.Device().synchronize()
    return int(out.get()[0])


def run(scope, k, n, steps):
    f = bar_sys if scope == "sys" else bar_gpu
    streams = [cp.cuda.Stream(non_blocking=True) for _ in range(k)]
    ws = cp.zeros(64 * 8, dtype=cp.uint64)
    times = cp.zeros(2 * k * n, dtype=cp.uint64)
    cp.cuda.Device().synchronize()
    until = device_now() + 200_000_000 + 20_000 * k * n
    for s in streams:
        gate((1,), (32,), (cp.uint64(until),), stream=s)
    for i in range(n):
        for j, s in enumerate(streams):
            f((1,), (32,), (ws, cp.int32(j), cp.int32(k), cp.uint64(i + 1), cp.int32(steps), times, cp.uint32(i * k + j)), stream=s)
    cp.cuda.Device().synchronize()
    t = times.get().reshape(n, k, 2)
    span = int(t[-1, :, 1].max()) - int(t[0, :, 1].max())
    inside = (t[1:, :, 1].astype("int64") - t[1:, :, 0].astype("int64")).mean() / 1000
    print(f"{scope} streams={k} steps={steps:2}  {span / (n - 1) / 1000:7.2f} us per call, {inside:6.2f} us inside a kernel")


n = int(sys.argv[1]) if len(sys.argv) > 1 else 200
print(cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), "calls per run:", n)
out = cp.zeros(1, dtype=cp.uint64)
for sys_ in (1, 0):
    fences((1,), (32,), (cp.int32(sys_), cp.int32(1000), out))
    cp.cuda.Device().synchronize()
    print(f"fence.acq_rel.{'sys' if sys_ else 'gpu'} alone: {int(out.get()[0]) / 1000:.1f} ns each (1000 in a row)")
for scope in ("sys", "gpu"):
    for steps in (1, 1 | 8, 1 | 2 | 8, 1 | 2 | 4 | 8, 1 | 2 | 16 | 8):
        run(scope, 8, n, steps)
run("sys", 2, n, 1 | 2 | 4 | 8)
run("gpu", 2, n, 1 | 2 | 4 | 8)
