# Probe: what does it cost the GPU to run one call as K separate launches that meet (as K per-rank
# communicators on one GPU do), against one launch? Each of K streams runs N one-CTA kernels; kernel i
# on stream s adds one to a counter and spins until all K kernels of call i have added theirs (the
# meeting of a collective's start barrier, nothing else). A gate kernel holds every stream until the
# host has queued all launches, so the host's launch rate does not count. Printed: device time per
# call (first start to last end over N), for `meet` and for `empty` kernels (no meeting) on K streams.
# Run on the GPU machine: `python3 -W ignore scripts/launch_probe.py [N] [--ctas C] [--smem BYTES]`
# (cupy and a GPU): C CTAs per kernel, each with BYTES of dynamic shared memory, as the collective
# kernels launch (16 CTAs of about 200 KiB per rank by default); every CTA of every stream's kernel
# meets, so streams × C CTAs must fit the GPU at once.
import argparse, sys, cupy as cp

SRC = r'''
extern "C" __global__ void gate(unsigned long long until) {
  unsigned long long t;
  do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t < until);
}
extern "C" __global__ void meet(unsigned long long* counter, unsigned long long target,
                                unsigned long long* times, unsigned int slot) {
  unsigned long long t0, t1;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  if (threadIdx.x == 0) {
    atomicAdd(counter, 1ull);
    while (atomicAdd(counter, 0ull) < target) {}
  }
  __syncthreads();
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t1));
  if (blockIdx.x == 0 && threadIdx.x == 0) { times[2 * slot] = t0; times[2 * slot + 1] = t1; }
}
extern "C" __global__ void empty(unsigned long long* times, unsigned int slot) {
  unsigned long long t0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  if (blockIdx.x == 0 && threadIdx.x == 0) { times[2 * slot] = t0; times[2 * slot + 1] = t0; }
}
extern "C" __global__ void now(unsigned long long* out) {
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(out[0]));
}
'''
mod = cp.RawModule(code=SRC)
gate, meet, empty, now = (mod.get_function(n) for n in ("gate", "meet", "empty", "now"))


def device_now():
    out = cp.zeros(1, dtype=cp.uint64)
    now((1,), (1,), (out,))
    cp.cuda.Device().synchronize()
    return int(out.get()[0])


def run(kind, k, n, ctas, smem):
    streams = [cp.cuda.Stream(non_blocking=True) for _ in range(k)]
    counter = cp.zeros(1, dtype=cp.uint64)
    times = cp.zeros(2 * k * n, dtype=cp.uint64)
    cp.cuda.Device().synchronize()
    # Long enough for the host to queue k * n launches (a few µs each).
    until = device_now() + 200_000_000 + 20_000 * k * n
    for s in streams:
        gate((1,), (32,), (cp.uint64(until),), stream=s)
    for i in range(n):
        for j, s in enumerate(streams):
            slot = cp.uint32(i * k + j)
            if kind == "meet":
                args = (counter, cp.uint64(k * ctas * (i + 1)), times, slot)
                meet((ctas,), (32,), args, stream=s, shared_mem=smem)
            else:
                empty((ctas,), (32,), (times, slot), stream=s, shared_mem=smem)
    cp.cuda.Device().synchronize()
    t = times.get().reshape(n, k, 2)
    late = (t[:, :, 0].astype("int64") - int(until))
    if late.min() < 0:
        print(f"  {kind} k={k}: a launch started before the gate opened: the host was slower", file=sys.stderr)
    # Calls 1..n-1: the first waits on the gate's opening.
    span = int(t[-1, :, 1].max()) - int(t[0, :, 1].max())
    per_call = span / (n - 1) / 1000
    # Skew: the last start of a call minus its first, averaged (the meeting's wait).
    skew = (t[1:, :, 0].max(axis=1).astype("int64") - t[1:, :, 0].min(axis=1).astype("int64")).mean() / 1000
    print(f"{kind:5} streams={k} ctas={ctas} smem={smem}  {per_call:7.2f} us per call  start skew {skew:6.2f} us")


ap = argparse.ArgumentParser()
ap.add_argument("n", nargs="?", type=int, default=200, help="calls per run")
ap.add_argument("--ctas", type=int, default=1, help="CTAs per kernel")
ap.add_argument("--smem", type=int, default=0, help="dynamic shared memory per CTA, bytes")
a = ap.parse_args()
for f in (meet, empty):
    f.max_dynamic_shared_size_bytes = max(a.smem, 0)
print(cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), "calls per run:", a.n)
for kind in ("empty", "meet"):
    for k in (1, 2, 4, 8):
        run(kind, k, a.n, a.ctas, a.smem)
