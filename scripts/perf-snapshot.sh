#!/usr/bin/env bash
# Reruns every command docs/PERF.md lists and saves each one's output under a dated folder. With
# --rewrite it then rewrites PERF.md's marked tables (`<!-- snap-table … -->`) whose runs it made
# (`oxccl tables OUT docs/PERF.md`); the prose around them is rewritten from those files by hand.
# Runs on a GPU machine from built binaries; a command whose needs are missing (a GPU, two GPUs,
# MPS, torch, /usr/bin/time, staged test binaries) is skipped, and says so.
#
# Usage: scripts/perf-snapshot.sh [--list | --dry-run | --rewrite] [NAME...]
#   NAME...    run only the snapshots with these names, or whose names begin with NAME- (`cta-table`,
#              `overlap-fma1`); the names are the `[snap: …]` marks in docs/PERF.md
#   --list     print every snapshot's name and command, run nothing
#   --dry-run  print what would run for the names given, run nothing
#   --rewrite  run, then rewrite docs/PERF.md's tables from what ran
# Environment:
#   OXCCL   the oxccl binary (default target/release/oxccl; the cuBLAS rows need a build with
#           `cargo build --release -p oxccl-cli --features gemm`, as scripts/gpu-stage.sh makes
#           it: .device/bin/oxccl once scripts/gpu-suite.sh has unpacked .device/pack)
#   OUT     the output folder (default target/perf-snapshots/<UTC date and time>)
#   OXCCL_COMMIT  the commit the binaries were built from, for machine.txt (default: the checkout's)
#   B       the test binaries staged by scripts/gpu-stage.sh, for `gpu-tests` (default .device/bin)
#   MSCCL   the folder of the MSCCL XML files (default host/tests/data/msccl)
#   SNAP_TIMEOUT  seconds allowed per command (default 900)
# Output: NAME.log (stdout and stderr), NAME.jsonl (its JSON lines, where it printed any),
# summary.tsv (name, status, seconds, command) and machine.txt (GPUs, driver, commit).
set -euo pipefail
cd "$(dirname "$0")/.."

OXCCL=${OXCCL:-target/release/oxccl}
B=${B:-.device/bin}
MSCCL=${MSCCL:-host/tests/data/msccl}
SNAP_TIMEOUT=${SNAP_TIMEOUT:-900}
MODE=run
REWRITE=0
case "${1:-}" in
  --list) MODE=list; shift ;;
  --dry-run) MODE=dry; shift ;;
  --rewrite) REWRITE=1; shift ;;
  -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
esac
SELECTED=("$@")

# NVLink multicast stays off on shared machines, also for NCCL and anything it starts.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

gpu_count() { nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true; }
GPUS=0
if [ "$MODE" = run ]; then GPUS=$(gpu_count); else OUT=${OUT:-OUT}; fi

if [ "$MODE" = run ]; then
  if [ ! -x "$OXCCL" ]; then
    echo "perf-snapshot: no oxccl binary at $OXCCL (build it, or set OXCCL)" >&2; exit 2
  fi
  OUT=${OUT:-target/perf-snapshots/$(date -u +%Y-%m-%d_%H%M%S)}
  mkdir -p "$OUT"
  {
    echo "date (UTC): $(date -u '+%Y-%m-%d %H:%M:%S')"
    echo "commit: ${OXCCL_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo "unknown (no git checkout; set OXCCL_COMMIT)")}"
    echo "oxccl binary: $OXCCL"
    nvidia-smi --query-gpu=index,name,driver_version,memory.total,clocks.max.sm --format=csv 2>/dev/null || echo "no nvidia-smi"
  } > "$OUT/machine.txt"
  printf 'name\tstatus\tseconds\tcommand\n' > "$OUT/summary.tsv"
fi

FAILED=0
MPS_ON=0
# MPS for the per-rank process runs (processes sharing one GPU need it to run side by side), as
# scripts/gpu-suite.sh starts it: a few hardware queues per process (many exhaust the GPU's channels).
mps_on() {
  [ "$MPS_ON" = 1 ] && return 0
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/oxccl-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/oxccl-mps-log CUDA_DEVICE_MAX_CONNECTIONS=2
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d && MPS_ON=1
}
mps_off() {
  [ "$MPS_ON" = 1 ] || return 0
  echo quit | nvidia-cuda-mps-control || true
  sleep 1
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY CUDA_DEVICE_MAX_CONNECTIONS
  MPS_ON=0
}
trap mps_off EXIT
# LD_LIBRARY_PATH with libcublas for `--compute gemm`: the toolkit's, else the Python wheels'.
cublas_path() {
  local dirs
  dirs="$(python3 -c 'import glob, site; print(":".join(sorted({p.rsplit("/", 1)[0] for s in site.getsitepackages() for p in glob.glob(s + "/nvidia/**/libcublas.so*", recursive=True)})))' 2>/dev/null || true)"
  echo "${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}/usr/local/cuda/lib64${dirs:+:$dirs}"
}

selected() {
  [ "${#SELECTED[@]}" -eq 0 ] && return 0
  local s
  for s in "${SELECTED[@]}"; do
    case "$1" in "$s" | "$s"-*) return 0 ;; esac
  done
  return 1
}

# Why a snapshot cannot run here, from its needs (comma separated; "-" for none), or nothing.
missing() {
  local need
  for need in ${1//,/ }; do
    case "$need" in
      -) ;;
      gpu) [ "$GPUS" -ge 1 ] || { echo "no GPU"; return; } ;;
      gpus2) [ "$GPUS" -ge 2 ] || { echo "fewer than 2 GPUs"; return; } ;;
      mps) command -v nvidia-cuda-mps-control >/dev/null || { echo "no nvidia-cuda-mps-control"; return; } ;;
      torch) python3 -c 'import torch' 2>/dev/null || { echo "no torch for scripts/nccl_bench.py"; return; } ;;
      time) [ -x /usr/bin/time ] || { echo "no /usr/bin/time"; return; } ;;
      staged) [ -x "$B/gpu_collectives" ] || [ -f .device/pack/bins.tar.xz ] || { echo "no test binaries in $B (scripts/gpu-stage.sh)"; return; } ;;
      *) echo "unknown need $need"; return ;;
    esac
  done
}

# snap NAME NEEDS COMMAND...: runs COMMAND, its output in $OUT/NAME.log.
snap() {
  local name=$1 needs=$2; shift 2
  selected "$name" || return 0
  case "$MODE" in
    list|dry) echo "$name: ${DESCRIBE[$1]:-$*}"; return 0 ;;
  esac
  local why
  why=$(missing "$needs")
  if [ -n "$why" ]; then
    echo "=== $name: skipped: $why"
    printf '%s\tskipped: %s\t0\t%s\n' "$name" "$why" "$*" >> "$OUT/summary.tsv"
    return 0
  fi
  case ",$needs," in
    *,mps,*) mps_on ;;
    *) mps_off ;;
  esac
  echo "=== $name ($(date -u +%H:%M:%S)): $*"
  local start=$SECONDS rc=0 status=ok
  if [ "$(type -t "$1")" = function ]; then
    "$@" > "$OUT/$name.log" 2>&1 || rc=$?
  else
    timeout "$SNAP_TIMEOUT" "$@" > "$OUT/$name.log" 2>&1 || rc=$?
  fi
  [ "$rc" -eq 0 ] || { status="failed (exit $rc)"; FAILED=$((FAILED + 1)); }
  grep '^{' "$OUT/$name.log" > "$OUT/$name.jsonl" || rm -f "$OUT/$name.jsonl"
  grep -v '^{' "$OUT/$name.log" | tail -n 4
  echo "=== $name: $status, $((SECONDS - start)) s"
  printf '%s\t%s\t%s\t%s\n' "$name" "$status" "$((SECONDS - start))" "$*" >> "$OUT/summary.tsv"
}

# Loading the kernels: a whole `oxccl demo` process, twice per mode, each mode with a fresh compute
# cache (the first run fills it), wall time per run.
module_load() {
  local m run cache TIMEFORMAT
  for m in ptx prebuilt; do
    cache=$(mktemp -d)
    for run in "empty cache" "cache filled"; do
      TIMEFORMAT="OXCCL_MODULE=$m oxccl demo ($run): %R s"
      time CUDA_CACHE_PATH=$cache OXCCL_MODULE=$m timeout "$SNAP_TIMEOUT" "$OXCCL" demo
    done
    rm -rf "$cache"
  done
}

# The oxccl and NCCL runs on two GPUs side by side (mean busbw from 64 MiB), from their logs.
compare_gpus2() {
  local logs=("$OUT"/gpus2-*.log)
  if [ ! -s "$OUT/nccl-gpus2.log" ] || [ ! -e "${logs[0]}" ]; then
    echo "no gpus2-* or nccl-gpus2 logs in $OUT to compare"; return 1
  fi
  python3 scripts/compare_nccl.py --oxccl "${logs[@]}" --nccl "$OUT/nccl-gpus2.log"
}

# What the snapshots that run a function here do, for --list.
declare -A DESCRIBE=(
  [module_load]="CUDA_CACHE_PATH=<fresh folder> OXCCL_MODULE=ptx|prebuilt $OXCCL demo, twice per folder, timed"
  [compare_gpus2]="python3 scripts/compare_nccl.py --oxccl OUT/gpus2-*.log --nccl OUT/nccl-gpus2.log"
)

X=$OXCCL
# AllReduce by CTA count
for m in tma simt; do for c in 1 2 4 8 16; do
  snap "cta-table-$m-$c" gpu "$X" bench all-reduce --ranks 8 -b 1M -e 1G -f 4 -n 10 -w 3 --ctas "$c" --mover "$m" --json
done; done
snap allreduce gpu "$X" bench all-reduce --ranks 8 -b 1M -e 1G -f 4 --ctas 8 --mover tma --json
for op in sum avg prod; do
  snap "allreduce-ops-$op" gpu "$X" bench all-reduce --ranks 8 -b 64M -e 1G -f 4 -n 20 -w 5 --op "$op" --json
done
# Other collectives on 8 virtual ranks
snap reduce-scatter-16 gpu "$X" bench reduce-scatter --ranks 8 -b 256M -e 1G -f 4 --ctas 16 -n 10 -w 3 --json
snap all-gather-16 gpu "$X" bench all-gather --ranks 8 -b 256M -e 1G -f 4 --ctas 16 -n 10 -w 3 --json
snap broadcast gpu "$X" bench broadcast --root 1 --ranks 8 -b 1M -e 1G -f 4 --json
snap reduce gpu "$X" bench reduce --root 1 --ranks 8 -b 1M -e 1G -f 4 --json
snap all-to-all gpu "$X" bench all-to-all --ranks 8 -b 1M -e 1G -f 4 --ctas 16 -n 10 -w 3 --json
snap send-recv gpu "$X" bench send-recv -b 1M -e 1G -f 4 -n 20 -w 5
snap send-recv-small gpu "$X" bench send-recv -b 8 -e 32K -f 8 -n 200 -w 20
snap group gpu "$X" bench group -b 64K -e 4M -f 4 -n 20 -w 5 --tensors 100
snap group-untracked gpu "$X" bench group -b 64K -e 4M -f 4 -n 20 -w 5 --tensors 100 --untracked
# Small messages and CUDA graphs
# Every mover at every size (--latency-below 0: no switch to the latency mover for small tasks).
for m in tma simt latency; do for c in 1 4 16; do
  snap "small-$m-$c" gpu "$X" bench all-reduce --ranks 8 -b 8 -e 2M -f 8 -n 50 -w 10 --ctas "$c" --mover "$m" --latency-below 0 --json
done; done
snap small-default-16 gpu "$X" bench all-reduce --ranks 8 -b 8 -e 2M -f 8 -n 50 -w 10 --ctas 16 --json
snap small-graph-16 gpu "$X" bench all-reduce --ranks 8 -b 8 -e 2M -f 8 -n 50 -w 10 --ctas 16 -G 10 --json
# Movers
snap movers gpu "$X" bench movers -e 1G --json
snap movers-64-threads gpu "$X" bench movers -e 256M -n 5 -w 2 --threads 64 --json
# Per-rank communicators (MPS only for the process runs)
for coll in all-reduce reduce-scatter all-gather; do
  snap "ranks-virtual-$coll" gpu "$X" bench "$coll" --ranks 8 -b 64M -e 1G -f 4 -n 20 -w 5 --json
  snap "ranks-threads-$coll" gpu env CUDA_DEVICE_MAX_CONNECTIONS=32 "$X" bench "$coll" --procs 8 --rank-threads -b 64M -e 1G -f 4 -n 20 -w 5 --json
done
snap latency-virtual gpu "$X" bench all-reduce --ranks 8 -b 8 -e 32K -f 2 -n 200 -w 20 --json
for n in 2 8; do
  snap "latency-threads-$n" gpu env CUDA_DEVICE_MAX_CONNECTIONS=32 "$X" bench all-reduce --procs "$n" --rank-threads -b 8 -e 32K -f 4 -n 200 -w 20 --json
  snap "latency-threads-$n-graph" gpu env CUDA_DEVICE_MAX_CONNECTIONS=32 "$X" bench all-reduce --procs "$n" --rank-threads -b 8 -e 32K -f 4 -n 200 -w 20 -G 10 --json
done
snap launch-probe gpu python3 -W ignore scripts/launch_probe.py 200
snap barrier-probe gpu python3 -W ignore scripts/barrier_probe.py 200
for coll in all-reduce reduce-scatter all-gather; do for buf in symmetric registered plain; do
  snap "ranks-procs-$buf-$coll" gpu,mps "$X" bench "$coll" --procs 8 --buffers "$buf" -b 64M -e 1G -f 4 -n 20 -w 5 --json
done; done
snap latency-procs gpu,mps "$X" bench all-reduce --procs 8 -b 8 -e 32K -f 2 -n 200 -w 20 --json
# Several GPUs
for coll in all-reduce reduce-scatter all-gather; do for c in 8 16; do
  snap "gpus2-$coll-$c" gpus2 "$X" bench "$coll" --gpus 2 --ctas "$c" -b 64M -e 4G -f 4 -n 20 -w 5 --json
done; done
snap nccl-gpus2 gpus2,torch python3 scripts/nccl_bench.py --gpus 2 --ctas 8,16,default -b 64M -e 4G -f 4 --json
snap compare-gpus2 gpus2 compare_gpus2
# Transfer programs (built-in ResCCL algorithms, MSCCL files) through run_program
plans=("ring-allreduce:--algo ring-allreduce --topo 1x8" "hm-allreduce:--algo hm-allreduce --topo 2x4")
for f in "$MSCCL"/*.xml; do n=${f##*/}; plans+=("msccl-${n%.xml}:--xml $f"); done
for plan in "${plans[@]}"; do
  read -ra args <<< "${plan#*:}"
  snap "plan-${plan%%:*}" gpu "$X" bench plan "${args[@]}" -b 64K -e 1G -f 4 -n 5 -w 2 --json
done
snap plan-ring-instances-4 gpu "$X" bench plan --algo ring-allreduce --topo 1x8 --instances 4 -b 64M -e 1G -f 4 -n 10 -w 3 --json
# Reshard
snap reshard gpu "$X" bench reshard -n 5 -w 1 --json
# From partial sums (a row-parallel layer's output, 128 MiB bf16 on 8 ranks) to rows and to
# replicas, beside the collectives moving the same bytes.
snap reshard-partial-rows gpu "$X" bench reshard --shape 8192,8192 -d bf16 --src-mesh 8@0 --src P --dst-mesh 8@0 --dst S0 -n 10 -w 2 --json
snap reshard-partial-replicas gpu "$X" bench reshard --shape 8192,8192 -d bf16 --src-mesh 8@0 --src P --dst-mesh 8@0 --dst R -n 10 -w 2 --json
snap reshard-partial-collectives gpu "$X" bench reduce-scatter --ranks 8 -d bf16 -b 128M -e 128M -n 10 -w 2 --json
snap reshard-partial-allreduce gpu "$X" bench all-reduce --ranks 8 -d bf16 -b 128M -e 128M -n 10 -w 2 --json
# Overlap with compute: every CTA budget with the default shapes and with small ones
CUBLAS_LIBS=$(cublas_path)
for c in 1 2 4 8 16; do
  snap "overlap-fma1-$c" gpu "$X" bench overlap --ranks 8 --compute fma --fma-ctas-per-sm 1 --compute-ms 3 -e 256M --ctas "$c" -n 5 -w 2 --json
  snap "overlap-fma1-$c-small" gpu "$X" bench overlap --ranks 8 --compute fma --fma-ctas-per-sm 1 --compute-ms 3 -e 256M --ctas "$c" -n 5 -w 2 --threads 128 --chunk 8192 --stages 2 --simt-threads 256 --json
  snap "overlap-fma4-$c" gpu "$X" bench overlap --ranks 8 --compute fma --fma-ctas-per-sm 4 --compute-ms 3 -e 256M --ctas "$c" -n 5 -w 2 --json
  snap "overlap-fma4-$c-small" gpu "$X" bench overlap --ranks 8 --compute fma --fma-ctas-per-sm 4 --compute-ms 3 -e 256M --ctas "$c" -n 5 -w 2 --threads 128 --chunk 8192 --stages 2 --simt-threads 256 --json
  snap "overlap-gemm-$c" gpu env LD_LIBRARY_PATH="$CUBLAS_LIBS" "$X" bench overlap --ranks 8 --compute gemm --gemm 8192,8192,2048 --compute-ms 3 -e 256M --ctas "$c" -n 5 -w 2 --json
  snap "overlap-gemm-$c-small" gpu env LD_LIBRARY_PATH="$CUBLAS_LIBS" "$X" bench overlap --ranks 8 --compute gemm --gemm 8192,8192,2048 --compute-ms 3 -e 256M --ctas "$c" -n 5 -w 2 --threads 128 --chunk 8192 --stages 2 --simt-threads 256 --json
done
for c in 2 4 8 16; do
  snap "overlap-wgmma-$c" gpu "$X" bench overlap --ranks 8 --compute wgmma --gemm 8192,8192,2048 --compute-ms 3 -e 256M --ctas "$c" -n 5 -w 2 --json
  snap "overlap-wgmma-$c-small" gpu "$X" bench overlap --ranks 8 --compute wgmma --gemm 8192,8192,2048 --compute-ms 3 -e 256M --ctas "$c" -n 5 -w 2 --threads 128 --chunk 4096 --stages 2 --simt-threads 256 --json
done
# Loading the kernels
snap module-load gpu module_load
# Planners and compile speed (host only)
for at in hm-allgather:128x8 hm-allreduce:128x8 hm-allreduce:256x8 hm-allgather:512x8 hm-allreduce:512x8 hm-allreduce:1024x8; do
  snap "compile-${at%%:*}-${at#*:}" time /usr/bin/time -v "$X" plan --algo "${at%%:*}" --topo "${at#*:}" --json
done
snap simulate-hpds - "$X" simulate --algo hm-allreduce --topo 2x8 --preset a100 --size 256M --scheduler hpds --barrier
snap simulate-rr - "$X" simulate --algo hm-allreduce --topo 2x8 --preset a100 --size 256M --scheduler rr --barrier
snap tbs-state - "$X" plan --algo hm-allreduce --topo 2x8 --tb-alloc state --json
snap tbs-per-conn - "$X" plan --algo hm-allreduce --topo 2x8 --tb-alloc per-conn --json
# GPU tests (the staged test binaries; scripts/gpu-suite.sh starts MPS for the process tests itself)
snap gpu-tests gpu,staged env B="$B" OUT="$OUT/gpu-tests" scripts/gpu-suite.sh tests ranks
snap gpu-tests-multi gpus2,staged env B="$B" OUT="$OUT/gpu-tests-multi" GPUS="$GPUS" scripts/gpu-suite.sh multi-tests

mps_off
if [ "$MODE" = run ]; then
  echo "=== saved under $OUT ($FAILED failed; summary.tsv lists every snapshot)."
  if [ "$REWRITE" = 1 ]; then
    "$OXCCL" tables "$OUT" docs/PERF.md || FAILED=$((FAILED + 1))
  else
    echo "    docs/PERF.md was not changed: --rewrite (or \`$OXCCL tables $OUT\`) rewrites its marked tables."
  fi
  [ "$FAILED" -eq 0 ]
fi
