#!/usr/bin/env bash
# Runs on the GPU machine over binaries staged by scripts/gpu-stage.sh (carried in .device/).
# Usage: scripts/gpu-suite.sh STEP... (info tests ranks nodes ranks-bench sanitizer sanitize-all sanitize-plans regression sweep benches sweep-configs sweep-pieces sweep-old ab ab-threads ar-stages allreduce overlap-mma overlap-clocks copy-beside-fma
# overlap-best copy-ab few-ctas module-load tma-trace trace-rounds allreduce-256m ar-matrix collectives overlap overlap-shapes issuers issuer-shapes combine-direct combine-threads reshard compiled compiled-bench plan-shapes cta-table multi-tests multi-bench multi-tune multi-overlap nccl compare);
# each step logs under $OUT. The multi-* and nccl steps need at least two GPUs.
set -uo pipefail
B=${B:-.device/bin}
# Binaries carried packed (scripts/gpu-stage.sh): unpacked once into $B, the MSCCL files beside it.
if [ ! -d "$B" ] && [ -f .device/pack/bins.tar.xz ]; then
  mkdir -p "$B" .device/host-msccl && tar -C "$B" -xJf .device/pack/bins.tar.xz
  cp "$B"/host-msccl/*.xml .device/host-msccl/
fi
OUT=${OUT:-/tmp/oxccl-out}
# Mover-sweep rows at CTA counts $1 (a regex alternation), matched on the CTAs column.
rows() { grep -E "copy|reduce" | awk -v c="^($1)\$" '$3 ~ c'; }
mkdir -p "$OUT"
export RUST_BACKTRACE=1
# NVLink multicast stays off on shared machines, also for anything these steps start.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
GPUS=${GPUS:-$(nvidia-smi --query-gpu=index --format=csv,noheader | wc -l)}
SIZES=${SIZES:--b 1M -e 4G -f 4}
CTAS=${CTAS:-4 8 16 132}
log() { echo "=== $* ($(date -u +%H:%M:%S))"; }
# Steps that failed (test binaries' exit status), reported at the end and in the script's own.
FAILED=""
# A compute-sanitizer log $1 passes with a clean summary and a passing test; else $2 joins FAILED.
sanitized() {
  grep -qE "ERROR SUMMARY: 0 errors|RACECHECK SUMMARY: 0 hazards displayed \(0 errors" "$1" && grep -q "test result: ok" "$1" || FAILED="$FAILED sanitizer:$2"
}
# LD_LIBRARY_PATH with libcublas for the GEMM load: the toolkit's, else the Python wheels'.
cublas_path() {
  local dirs
  dirs="$(python3 -c 'import glob, site; print(":".join(sorted({p.rsplit("/", 1)[0] for s in site.getsitepackages() for p in glob.glob(s + "/nvidia/**/libcublas.so*", recursive=True)})))' 2>/dev/null)"
  echo "${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}/usr/local/cuda/lib64${dirs:+:$dirs}"
}
# MPS for steps whose ranks are processes sharing the GPU: started with its pipe and log folders
# under /tmp, stopped after; each process takes a few hardware queues (many per process exhaust the
# GPU's channels, which fails context creation with out-of-memory under MPS).
mps_start() {
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/oxccl-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/oxccl-mps-log CUDA_DEVICE_MAX_CONNECTIONS=2
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d && log "MPS started"
}
mps_stop() {
  echo quit | nvidia-cuda-mps-control; sleep 1; log "MPS stopped"
  cp "$CUDA_MPS_LOG_DIRECTORY"/control.log "$OUT/mps_control.log" 2>/dev/null
  cp "$CUDA_MPS_LOG_DIRECTORY"/server.log "$OUT/mps_server.log" 2>/dev/null
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY CUDA_DEVICE_MAX_CONNECTIONS
}
for step in "$@"; do
  case "$step" in
    info)
      log info; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv ;;
    tests)
      # A GPU machine must run every GPU test: a missing or unusable GPU fails them (OXCCL_REQUIRE_GPU).
      # Ranks on up to 16 streams of one GPU: as many hardware queues, as the API docs ask.
      export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-32}
      for t in ${TESTS:-gpu_intrinsics gpu_engine gpu_collectives gpu_reshard gpu_nodes}; do
        log "$t"; OXCCL_REQUIRE_GPU=1 timeout 200 $B/$t --test-threads=1 --nocapture --skip one_rank_per_gpu > "$OUT/$t.log" 2>&1
        rc=$?; [ $rc -eq 0 ] || FAILED="$FAILED $t(rc=$rc)"
        grep -E "^test |test result|skipped|cases|panicked|timeout|error|observed" "$OUT/$t.log" ; done ;;
    ranks)
      # Per-rank communicators: threads of one process, then processes without MPS (a call must end,
      # never hang), then under MPS every collective on 2, 4 and 8 processes and a rank killed
      # mid-call.
      log "gpu_ranks (threads, misuse, no MPS)"
      CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-32} OXCCL_REQUIRE_GPU=1 OXCCL_NO_MPS=1 timeout 300 $B/gpu_ranks --test-threads=1 --nocapture > "$OUT/gpu_ranks.log" 2>&1
      rc=$?; [ $rc -eq 0 ] || FAILED="$FAILED gpu_ranks(rc=$rc)"
      grep -E "^test |test result|skipped|cases|panicked|rank [0-9]+:|error" "$OUT/gpu_ranks.log" | head -60
      log "example device_threads (4 ranks as threads on GPU 0)"
      CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-32} OXCCL_RANKS=4 timeout 120 $B/device_threads > "$OUT/device_threads.log" 2>&1
      rc=$?; [ $rc -eq 0 ] || FAILED="$FAILED device_threads(rc=$rc)"; tail -3 "$OUT/device_threads.log"
      # The candle examples link the CUDA libraries: the toolkit's, where the driver's folder lacks them.
      for ex in candle-ddp candle-tp; do
        [ -x "$B/$ex" ] || continue
        log "example $ex (2 ranks as threads on GPU 0)"
        LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}/usr/local/cuda-13.0/lib64" OXCCL_RANKS=2 timeout 120 "$B/$ex" > "$OUT/$ex.log" 2>&1
        rc=$?; [ $rc -eq 0 ] || FAILED="$FAILED $ex(rc=$rc)"; tail -3 "$OUT/$ex.log"
      done
      mps_start
      OXCCL_REQUIRE_GPU=1 OXCCL_MPS=1 timeout 500 $B/gpu_ranks --test-threads=1 --nocapture processes_ a_killed > "$OUT/gpu_ranks_mps.log" 2>&1
      rc=$?; [ $rc -eq 0 ] || FAILED="$FAILED gpu_ranks_mps(rc=$rc)"
      grep -E "^test |test result|skipped|cases|panicked|rank [0-9]+:|error|Err" "$OUT/gpu_ranks_mps.log" | head -80
      mps_stop ;;
    nodes)
      # Ranks posing as nodes on one GPU: the staged collectives (oxccl inside each node, oxccl's
      # engine between; NCCL refuses two ranks on one GPU, so it runs a group of one, loaded from
      # the image's wheel) and their speed against the same ranks as one node.
      NCCL_LIB=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib", "libnccl.so.2"))' 2>/dev/null)
      log "gpu_nodes (NCCL: $NCCL_LIB)"; CUDA_DEVICE_MAX_CONNECTIONS=32 OXCCL_REQUIRE_GPU=1 OXCCL_REQUIRE_NCCL=1 OXCCL_NCCL=$NCCL_LIB timeout 300 $B/gpu_nodes --test-threads=1 --nocapture > "$OUT/gpu_nodes.log" 2>&1
      rc=$?; [ $rc -eq 0 ] || FAILED="$FAILED gpu_nodes(rc=$rc)"; grep -E "^test |test result|cases|panicked|rank [0-9]+|NCCL|skipped" "$OUT/gpu_nodes.log" | head -20
      R=${RANKS:-8}; P=${PER_NODE:-4}; BIG="-b 1M -e 1G -f 4 -n 20 -w 5"
      for coll in all_reduce all_gather reduce_scatter broadcast reduce; do
        log "one node $coll"; CUDA_DEVICE_MAX_CONNECTIONS=32 timeout 150 $B/oxccl bench $coll --procs $R --rank-threads --ctas 2 $BIG > "$OUT/nodes_flat_$coll.log" 2>&1; echo "rc=$?"; tail -8 "$OUT/nodes_flat_$coll.log"
        log "$((R / P)) nodes $coll"; CUDA_DEVICE_MAX_CONNECTIONS=32 timeout 150 $B/oxccl bench $coll --procs $R --rank-threads --ctas 2 --ranks-per-node $P --inter engine $BIG > "$OUT/nodes_staged_$coll.log" 2>&1; echo "rc=$?"; tail -8 "$OUT/nodes_staged_$coll.log"
      done
      ;;
    ranks-bench)
      # One process per rank (MPS) against virtual ranks in one process, ReduceScatter / AllGather /
      # AllReduce at 64 MiB-1 GiB; symmetric, registered and plain (staged) buffers, ranks as threads; latency.
      R=${RANKS:-8}; BIG="-b 64M -e 1G -f 4 -n 20 -w 5"; SMALL="-b 8 -e 32K -f 2 -n 200 -w 20"
      for coll in all_reduce reduce_scatter all_gather; do
        log "virtual $coll"; timeout 120 $B/oxccl bench $coll --ranks $R $BIG --json > "$OUT/rb_virtual_$coll.log" 2>&1; grep -vE "^\{|^#  " "$OUT/rb_virtual_$coll.log" | tail -6
        log "threads $coll"; CUDA_DEVICE_MAX_CONNECTIONS=32 timeout 120 $B/oxccl bench $coll --procs $R --rank-threads $BIG --json > "$OUT/rb_threads_$coll.log" 2>&1; grep -vE "^\{" "$OUT/rb_threads_$coll.log" | tail -6
      done
      log "virtual latency"; timeout 120 $B/oxccl bench all_reduce --ranks $R $SMALL > "$OUT/rb_virtual_small.log" 2>&1; tail -16 "$OUT/rb_virtual_small.log"
      mps_start
      for coll in all_reduce reduce_scatter all_gather; do
        for buf in symmetric registered plain; do
          log "procs $coll $buf"; timeout 150 $B/oxccl bench $coll --procs $R --buffers $buf $BIG --json > "$OUT/rb_procs_${buf}_$coll.log" 2>&1; echo "rc=$?"; grep -vE "^\{" "$OUT/rb_procs_${buf}_$coll.log" | tail -6
        done
      done
      log "procs latency"; timeout 150 $B/oxccl bench all_reduce --procs $R $SMALL > "$OUT/rb_procs_small.log" 2>&1; echo "rc=$?"; tail -16 "$OUT/rb_procs_small.log"
      log "virtual latency under MPS"; timeout 120 $B/oxccl bench all_reduce --ranks $R $SMALL > "$OUT/rb_virtual_small_mps.log" 2>&1; tail -16 "$OUT/rb_virtual_small_mps.log"
      mps_stop ;;
    sanitize-all)
      # compute-sanitizer's memcheck, racecheck and synccheck over a reduced case of every GPU suite:
      # the collectives (random cases, graphs), transfer programs, reshard, per-rank threads, and
      # per-rank processes (the tool follows the rank processes the test starts). Every log
      # must end clean (sanitized); SAN_TOOLS picks the tools. The per-rank steps meet before each
      # call (OXCCL_RANK_MEET=1): memcheck checks a launch against the allocations it knows when the
      # launch is made, and a peer may make its buffers after (the kernel waits for them on the device);
      # their communicators wait 60 s (OXCCL_TEST_TIMEOUT): processes start slowly under the tool.
      # SAN_STEP_S bounds each step (default 600 s); SAN_STEPS picks steps (default all).
      export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-32}
      t=${SAN_STEP_S:-600}; steps=" ${SAN_STEPS:-collectives graphs compiled reshard threads procs} "
      on() { [[ "$steps" == *" $1 "* ]]; }
      for tool in ${SAN_TOOLS:-memcheck racecheck synccheck}; do
        san="compute-sanitizer --tool $tool --print-limit 20"
        on collectives && { log "$tool collectives"; OXCCL_GPU_CASES=6 timeout $t $san $B/gpu_collectives --test-threads=1 collectives_match_the_cpu_reference_on_virtual_ranks > "$OUT/san_${tool}_collectives.log" 2>&1; sanitized "$OUT/san_${tool}_collectives.log" "${tool}_collectives"; tail -3 "$OUT/san_${tool}_collectives.log"; }
        on graphs && { log "$tool graphs"; timeout $t $san $B/gpu_collectives --test-threads=1 captured > "$OUT/san_${tool}_graphs.log" 2>&1; sanitized "$OUT/san_${tool}_graphs.log" "${tool}_graphs"; tail -3 "$OUT/san_${tool}_graphs.log"; }
        on compiled && { log "$tool compiled"; timeout $t $san $B/gpu_compiled --test-threads=1 programs_run_on_the_collective_engine --exact > "$OUT/san_${tool}_compiled.log" 2>&1; sanitized "$OUT/san_${tool}_compiled.log" "${tool}_compiled"; tail -3 "$OUT/san_${tool}_compiled.log"; }
        on reshard && { log "$tool reshard"; OXCCL_RESHARD_CASES=4 timeout $t $san $B/gpu_reshard --test-threads=1 random_reshards_match_the_global_tensor --exact > "$OUT/san_${tool}_reshard.log" 2>&1; sanitized "$OUT/san_${tool}_reshard.log" "${tool}_reshard"; tail -3 "$OUT/san_${tool}_reshard.log"; }
        on threads && { log "$tool ranks (threads)"; OXCCL_TEST_TIMEOUT=60 OXCCL_RANK_MEET=1 OXCCL_RANK_CASES=3 timeout $t $san $B/gpu_ranks --test-threads=1 threads_match_the_cpu_reference > "$OUT/san_${tool}_threads.log" 2>&1; sanitized "$OUT/san_${tool}_threads.log" "${tool}_threads"; tail -3 "$OUT/san_${tool}_threads.log"; }
        on procs && { mps_start
        log "$tool ranks (processes)"; OXCCL_TEST_TIMEOUT=60 OXCCL_RANK_MEET=1 OXCCL_MPS=1 OXCCL_RANK_CASES=2 timeout $t $san --target-processes all $B/gpu_ranks --test-threads=1 processes_match_the_cpu_reference > "$OUT/san_${tool}_procs.log" 2>&1; sanitized "$OUT/san_${tool}_procs.log" "${tool}_procs"; tail -3 "$OUT/san_${tool}_procs.log"
        mps_stop; }
      done ;;
    sanitize-plans)
      # Which transfer programs draw a tool's reports (SAN_TOOL, default synccheck): each built-in
      # plan alone at a few sizes (one 16-byte grain per chunk of 8 ranks; long tasks, where
      # synccheck's report appeared: docs/perf-log/2026-12-08.md), then the ring under other
      # launch shapes. One line per run: the tool's summary and its first report's place.
      tool=${SAN_TOOL:-synccheck}
      san_plan() {
        local tag="$1"; shift
        timeout 60 compute-sanitizer --tool "$tool" --print-limit 1 $B/oxccl bench plan "$@" -n 1 -w 0 > "$OUT/san_plan.log" 2>&1
        echo "$tag: rc=$? $(grep -oE 'ERROR SUMMARY: [0-9]+ errors|RACECHECK SUMMARY: [0-9]+ hazards' "$OUT/san_plan.log" | head -1) $(grep -oE 'at oxccl_[a-z0-9_]+\+0x[0-9a-f]+' "$OUT/san_plan.log" | head -1)"
      }
      log "$tool plans"
      for t in "ring-allreduce 1x4" "ring-allreduce 1x8" "hm-allreduce 2x4" "hm-allgather 2x4" "chain-broadcast 1x8" "chain-reduce 1x8"; do
        read -r algo topo <<< "$t"
        for s in ${PLAN_SIZES:-128 262144 4194304}; do san_plan "$algo $topo $s B" --algo "$algo" --topo "$topo" -b "$s" -e "$s"; done
      done
      for k in "--ctas 1" "--ctas 1 --threads 64" "--threads 128" "--mover simt" "--mover latency"; do
        san_plan "ring-allreduce 1x4 262144 B $k" --algo ring-allreduce --topo 1x4 -b 262144 -e 262144 $k
      done ;;
    sanitizer)
      log memcheck
      OXCCL_MOVER_ROUNDS=4 timeout 100 compute-sanitizer --tool memcheck --print-limit 20 $B/gpu_engine --test-threads=1 movers_copy > "$OUT/memcheck.log" 2>&1; tail -5 "$OUT/memcheck.log"
      log racecheck
      OXCCL_MOVER_ROUNDS=4 timeout 100 compute-sanitizer --tool racecheck --print-limit 20 $B/gpu_engine --test-threads=1 movers_copy > "$OUT/racecheck.log" 2>&1; tail -5 "$OUT/racecheck.log"
      sanitized "$OUT/memcheck.log" memcheck; sanitized "$OUT/racecheck.log" racecheck
      # The overlap benchmark's GEMM (its cp.async ring and barriers) and tma_trace's timed copy.
      for tool in memcheck racecheck; do
        log "$tool tensor_core_gemm"; timeout 250 compute-sanitizer --tool $tool --print-limit 20 $B/gpu_intrinsics --test-threads=1 tensor_core_gemm_matches > "$OUT/${tool}_gemm.log" 2>&1; tail -4 "$OUT/${tool}_gemm.log"
        sanitized "$OUT/${tool}_gemm.log" "$tool gemm"
        for chain in alu_chain fma_chain shared_memory_chain independent_alu_streams rounds_of_four untraced_bulk_copies; do
          log "$tool timed_bulk_copies ($chain)"; timeout 100 compute-sanitizer --tool $tool --print-limit 20 $B/gpu_intrinsics --test-threads=1 "$chain" > "$OUT/${tool}_trace_$chain.log" 2>&1; tail -4 "$OUT/${tool}_trace_$chain.log"
          sanitized "$OUT/${tool}_trace_$chain.log" "$tool trace $chain"; done; done ;;
    regression)
      log regression-memcheck
      timeout 120 compute-sanitizer --tool memcheck --print-limit 5 $B/gpu_collectives --test-threads=1 regression_ > "$OUT/memcheck_regression.log" 2>&1; tail -4 "$OUT/memcheck_regression.log" ;;
    module-load)
      # Loading the kernels: the PTX compiled by the driver (with an empty compute cache, then with
      # the one the first run filled) against the prebuilt sm_90a code; each run is a whole `oxccl
      # demo` process. Then the acceptance AllReduce with each.
      TIMEFORMAT="%R s"
      for m in ptx prebuilt; do
        export CUDA_CACHE_PATH="$OUT/cache-$m"; rm -rf "$CUDA_CACHE_PATH"
        for run in "empty cache" "cache filled"; do
          log "OXCCL_MODULE=$m oxccl demo ($run)"; { time OXCCL_MODULE=$m $B/oxccl demo > "$OUT/demo_$m.log" 2>&1; } 2>&1; grep -E "ran|correct" "$OUT/demo_$m.log"; done
        log "OXCCL_MODULE=$m allreduce-tma"; OXCCL_MODULE=$m timeout 120 $B/oxccl bench all_reduce --ranks 8 -b 1M -e 1G -f 4 --ctas 8 --mover tma --json > "$OUT/ar_tma_8_$m.log" 2>&1; grep -v "^{" "$OUT/ar_tma_8_$m.log" | grep -vE "^#  +[0-9]+ +[0-9]+ +[0-9.]+%"
      done
      unset CUDA_CACHE_PATH ;;
    sweep)
      log sweep; timeout 90 $B/oxccl bench movers -e 1G --json > "$OUT/sweep.log" 2>&1; grep -v "^{" "$OUT/sweep.log" ;;
    benches)
      # The cargo benches (staged as bench-*): criterion's mover cases, and `oxccl bench` as a bench.
      log bench-movers; timeout 400 $B/bench-movers --bench > "$OUT/bench_movers.log" 2>&1; grep -E "^(copy|reduce)|thrpt|skipped|panicked" "$OUT/bench_movers.log"
      log bench-collectives; timeout 120 $B/bench-collectives --bench all_reduce --ranks 8 -b 64M -e 1G -f 4 --ctas 8 > "$OUT/bench_collectives.log" 2>&1; grep -v "^{" "$OUT/bench_collectives.log" ;;
    sweep-configs)
      # CONFIGS: chunk:stages pairs.
      for cs in ${CONFIGS:-16384:4 16384:8 24576:8 32768:6 16384:12 12288:16 8192:16}; do
        case "$cs" in *:*) ;; *) echo "CONFIGS entry $cs is not chunk:stages"; continue ;; esac; set -- ${cs/:/ }
        log "sweep chunk=$1 stages=$2"; $B/oxccl bench movers -e 1G --chunk $1 --stages $2 > "$OUT/sweep_$1_$2.log" 2>&1; rows "1|8|32|132" < "$OUT/sweep_$1_$2.log" ; done ;;
    sweep-pieces)
      # Contiguous range per CTA against pieces dealt in turn (do the CTAs' distant streams cost the 132-CTA rate?).
      for piece in ${PIECES:-contiguous 4M 1M 256K}; do
        log "sweep --piece $piece"; timeout 60 $B/oxccl bench movers -e 1G --piece $piece > "$OUT/sweep_piece_$piece.log" 2>&1; rows "1|32|66|132" < "$OUT/sweep_piece_$piece.log" ; done ;;
    ab)
      # A/B of two builds in one run: .device/bin/oxccl-old (stage a build, then copy its oxccl there)
      # against .device/bin/oxccl, or the binaries named in AB: movers at their defaults, AllReduce and
      # ReduceScatter at 1 and 8 CTAs (with AB_ARGS added, e.g. AB_ARGS="--reduction tma"; AB_MOVERS=0
      # leaves out the movers, for builds whose device code is the same).
      ab="${AB:-oxccl-old oxccl}"; missing=""; for b in $ab; do [ -x $B/$b ] || missing="$missing $b"; done
      [ -z "$missing" ] || { echo "ab skipped: not staged:$missing"; continue; }
      for b in $ab; do
        [ "${AB_MOVERS:-1}" = 0 ] || { log "$b movers"; timeout 60 $B/$b bench movers -e 1G > "$OUT/ab_movers_$b.log" 2>&1; rows "1|8|132" < "$OUT/ab_movers_$b.log"; }
        for coll in all_reduce reduce_scatter; do for c in 1 8; do
          log "$b $coll --ranks 8 --ctas $c"; timeout 60 $B/$b bench $coll --ranks 8 -b 64M -e 1G -f 4 -n 10 -w 3 --ctas $c ${AB_ARGS:-} > "$OUT/ab_${b}_${coll}_$c.log" 2>&1; grep -E "^ +1073741824 |Avg" "$OUT/ab_${b}_${coll}_$c.log" ; done; done; done ;;
    ab-threads)
      # A/B of two builds' register combines at few threads (binaries as in `ab`): the movers'
      # reduce-add at 32-256 threads, AllReduce and ReduceScatter at 64 threads.
      ab="${AB:-oxccl-old oxccl}"; missing=""; for b in $ab; do [ -x $B/$b ] || missing="$missing $b"; done
      [ -z "$missing" ] || { echo "ab-threads skipped: not staged:$missing"; continue; }
      for b in $ab; do
        for th in 32 64 128 256; do
          log "$b movers --threads $th"; timeout 60 $B/$b bench movers -e 256M -n 5 -w 2 --threads $th > "$OUT/abt_movers_${b}_$th.log" 2>&1; grep -E "^ +reduce-add +tma" "$OUT/abt_movers_${b}_$th.log" | awk '$3==1||$3==8||$3==32' ; done
        for rc in 8:1 8:8 2:8 4:4; do set -- ${rc/:/ }; for coll in all_reduce reduce_scatter; do
          log "$b $coll --ranks $1 --ctas $2 --threads 64"; timeout 60 $B/$b bench $coll --ranks $1 -b 1G -e 1G -n 10 -w 3 --ctas $2 --threads 64 > "$OUT/abt_${b}_${coll}_$1_$2.log" 2>&1; grep -E "^ +1073741824 " "$OUT/abt_${b}_${coll}_$1_$2.log" ; done; done; done ;;
    sweep-old)
      # The previous commit's binary (staged as oxccl-old) at the same pipeline, same run.
      [ -x $B/oxccl-old ] || { echo "sweep-old skipped: no $B/oxccl-old staged"; continue; }
      for b in oxccl-old oxccl; do log "$b movers 16384x4"; $B/$b bench movers -e 1G --chunk 16384 --stages 4 > "$OUT/sweep_$b.log" 2>&1; rows "1|8|132" < "$OUT/sweep_$b.log" ; done ;;
    ar-stages)
      # Stage count (chunk chosen to fill shared memory) for the three collectives, 8 virtual ranks.
      for coll in all_reduce reduce_scatter all_gather; do for st in ${STAGES:-4 8 12}; do
        log "$coll --ranks 8 --ctas 8 --stages $st"; timeout 60 $B/oxccl bench $coll --ranks 8 -b 16M -e 1G -f 4 -n 10 -w 3 --ctas 8 --stages $st --json >> "$OUT/ar_stages.log" 2>&1; echo "rc=$?"; tail -20 "$OUT/ar_stages.log" | grep -E "^ +(16777216|268435456|1073741824) |Avg" ; done; done ;;
    ar-matrix)
      for args in "--ctas 8 --mover tma" "--ctas 16 --mover tma" "--ctas 16 --mover simt" "--ctas 16 --mover tma --reduction tma"; do
        log "all_reduce $args"; $B/oxccl bench all_reduce --ranks 8 -b 1M -e 1G -f 4 -n 10 -w 3 $args --json >> "$OUT/ar_matrix.log" 2>&1; tail -9 "$OUT/ar_matrix.log" | grep -vE "^\{" ; done ;;
    overlap|multi-overlap)
      libs="$(cublas_path)"
      # CTA budgets of 8 and 32 in all: 8 virtual ranks x 1 or 4 CTAs, or per GPU with one rank each.
      # OV_BUDGETS: CTAs per rank (or per GPU); OV_ARGS: more flags (e.g. --compute-ms 10).
      where="--ranks 8"; budgets="${OV_BUDGETS:-1 4}"; [ "$step" = multi-overlap ] && where="--gpus $GPUS" && budgets="${OV_BUDGETS:-8 32}"
      # The FMA load at FMA_PER_SM CTAs of 256 threads per SM (default 4: it fills the GPU).
      for load in gemm $(for n in ${FMA_PER_SM:-4}; do echo "fma:$n"; done); do for c in $budgets; do
        compute=${load%%:*}; per_sm=""; [ "$compute" = fma ] && per_sm="--fma-ctas-per-sm ${load#*:}"
        log "overlap $where --compute $compute $per_sm --ctas $c ${OV_ARGS:-}"; LD_LIBRARY_PATH="$libs" timeout 200 $B/oxccl bench overlap $where --compute $compute $per_sm -e 256M --ctas $c ${OV_ARGS:-} -n 10 -w 3 --json >> "$OUT/$step.log" 2>&1; echo "rc=$?"; tail -15 "$OUT/$step.log" | grep -v "^{" ; done; done ;;
    overlap-shapes)
      # The collective's footprint against the compute beside it: the TMA rows with smaller pipelines
      # (chunk:stages) leave shared memory on their SMs to the compute's CTAs. OV_BIN (binary),
      # OV_CTAS (CTAs per rank), OV_COMPUTE (fma or gemm), REG_SHAPES and TMA_SHAPES (chunk:stages
      # lists, or default). Each run also re-measures the SIMT rows, as a same-run reference.
      libs="$(cublas_path)"
      for c in ${OV_CTAS:-1 4}; do for red in registers tma; do
        shapes="${REG_SHAPES:-default 8192:2 4096:2 2048:2}"; [ "$red" = tma ] && shapes="${TMA_SHAPES:-default 16384:2 8192:2}"
        for cs in $shapes; do
          args=""; [ "$cs" != default ] && args="--chunk ${cs%:*} --stages ${cs#*:}"
          log "${OV_BIN:-oxccl} overlap --compute ${OV_COMPUTE:-fma} --ctas $c --reduction $red $args"
          LD_LIBRARY_PATH="$libs" timeout 100 $B/${OV_BIN:-oxccl} bench overlap --ranks 8 --compute ${OV_COMPUTE:-fma} -e 256M --ctas $c --reduction $red $args -n 10 -w 3 --json >> "$OUT/overlap_shapes.log" 2>&1; echo "rc=$?"
          tail -15 "$OUT/overlap_shapes.log" | grep -E "^ +(tma|simt) " ; done; done; done ;;
    overlap-mma)
      # Beside oxccl's own tensor-core GEMM (`--compute mma`, which leaves room on its SMs): the GEMM
      # test, then overlap rows at fixed compute work (MMA_MS ms of MMA_GEMM GEMMs) over MMA_ROWS,
      # ";"-separated flag sets (CTA budgets, TMA shapes that fit beside a GEMM CTA, SIMT threads).
      log "gpu_intrinsics tensor_core_gemm"; timeout 60 $B/gpu_intrinsics --test-threads=1 --nocapture tensor_core > "$OUT/gpu_intrinsics_mma.log" 2>&1; grep -E "^test |test result|panicked" "$OUT/gpu_intrinsics_mma.log"
      IFS=';' read -ra rows <<< "${MMA_ROWS:---ctas 1;--ctas 4;--ctas 8;--ctas 4 --threads 128 --chunk 8192 --stages 2 --simt-threads 256;--ctas 8 --threads 128 --chunk 8192 --stages 2 --simt-threads 256;--ctas 8 --mma-one-per-sm;--ctas 8 --threads 128 --chunk 8192 --stages 2 --simt-threads 256 --mma-one-per-sm}"
      for r in "${rows[@]}"; do
        log "overlap --compute mma $r"; timeout 120 $B/oxccl bench overlap --ranks 8 --compute mma --gemm ${MMA_GEMM:-8192,8192,2048} --compute-ms ${MMA_MS:-3} -e 256M $r -n 10 -w 3 --json >> "$OUT/overlap_mma.log" 2>&1; echo "rc=$?"; tail -12 "$OUT/overlap_mma.log" | grep -vE "^\{|^# (oxccl|device)" ; done ;;
    overlap-clocks)
      # The co-resident shapes beside the FMA probe (4 CTAs per SM) and one beside the mma GEMM, with
      # the SM clock and power sampled every 200 ms and summarised per run (is a slowdown clock
      # throttling?).
      nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv,noheader -lms 200 > "$OUT/clocks.csv" 2>&1 &
      sampler=$!
      : > "$OUT/clock_runs.txt"
      small="--threads 128 --chunk 8192 --stages 2 --simt-threads 256"
      for r in "--compute fma --fma-ctas-per-sm 4 --ctas 8" "--compute fma --fma-ctas-per-sm 4 --ctas 8 $small" "--compute fma --fma-ctas-per-sm 4 --ctas 16 $small" "--compute fma --fma-ctas-per-sm 4 --ctas 4 $small" "--compute mma --gemm 8192,8192,2048 --ctas 16 $small"; do
        log "overlap $r --compute-ms 3"; start=$(date -u +%H:%M:%S.%3N)
        timeout 100 $B/oxccl bench overlap --ranks 8 -e 256M -n 10 -w 3 $r --compute-ms 3 2>&1 | grep -vE "^\{|^# (oxccl|device)"
        echo "$start $(date -u +%H:%M:%S.%3N) $r" >> "$OUT/clock_runs.txt"; done
      kill $sampler
      python3 -c '
import sys
samples = []
for line in open(sys.argv[1]):
    f = line.strip().split(", ")
    try: samples.append((f[0].split()[1], int(f[1].split()[0]), float(f[2].split()[0])))
    except (IndexError, ValueError): pass
for run in open(sys.argv[2]):
    start, end, flags = run.split(" ", 2)
    v = [(c, w) for t, c, w in samples if start <= t <= end]
    if not v: print("no samples during", flags.strip()); continue
    c = sorted(x for x, _ in v)
    print(f"{len(v)} samples, sm MHz min/median/max {c[0]}/{c[len(c) // 2]}/{c[-1]}, W max {max(w for _, w in v)}: {flags.strip()}")
' "$OUT/clocks.csv" "$OUT/clock_runs.txt" ;;
    copy-beside-fma)
      # The movers alone beside the FMA probe and beside CTAs of its shape that only sleep (the
      # control): one rank's AllReduce is a copy (send -> recv, 1 GiB, 8 CTAs), TMA with 4 issuers or
      # one with 64 KiB chunks, SIMT with 512 or 256 threads, beside 1, 2 and 4 CTAs per SM (0 ns rows).
      for load in fma sleep; do for fma in 1 2 4; do for extra in "" "--issuers 4" "--chunk 65536 --stages 3 --issuers 1" "--simt-threads 256"; do
        log "overlap --ranks 1 --compute $load --fma-ctas-per-sm $fma --ctas 8 $extra"
        timeout 60 $B/oxccl bench overlap --ranks 1 --compute $load --fma-ctas-per-sm $fma --compute-ms 3 -e 1G --ctas 8 -n 5 -w 2 $extra 2>&1 | grep -E "^ +(tma|simt) " | awk '$8==0' ; done; done; done ;;
    copy-ab)
      # A/B of the engine's copy beside the FMA probe: one rank's AllReduce (a 1 GiB copy, 8 CTAs),
      # the binary staged as $B/oxccl-old (by hand: the build before a change) against $B/oxccl, the
      # one-issuer ring and the default four issuers, beside 1 and 4 FMA CTAs per SM (0 ns rows).
      for bin in oxccl-old oxccl; do [ -x "$B/$bin" ] || continue; for fma in 1 4; do for extra in "--issuers 1 --chunk 32768 --stages 4" "--issuers 4"; do
        log "$bin overlap --ranks 1 --fma-ctas-per-sm $fma $extra"
        timeout 60 $B/$bin bench overlap --ranks 1 --compute fma --fma-ctas-per-sm $fma --compute-ms 3 -e 1G --ctas 8 -n 5 -w 2 $extra 2>&1 | grep -E "^ +(tma|simt) |^# mover" | awk '$1=="#" || $8==0'
      done; done; done ;;
    overlap-best)
      # The best configuration of each mover at one fixed compute load: 8 virtual ranks, AllReduce of
      # 256 MiB per rank, the compute calibrated to BEST_MS ms alone, CTAs per rank 1..16, default and
      # small (co-resident) shapes (BEST_SMALL); the minimum makespan per mover over every row (both hints).
      # `gemm` is cuBLAS's GEMM (libcublas from the toolkit or the Python wheels).
      IFS=';' read -ra loads <<< "${BEST_LOADS:-fma --fma-ctas-per-sm 1;fma --fma-ctas-per-sm 4;mma --gemm 8192,8192,2048}"
      export LD_LIBRARY_PATH="$(cublas_path)"
      for load in "${loads[@]}"; do
        : > "$OUT/best.tmp"
        for c in ${BEST_CTAS:-1 2 4 8 16}; do for shape in "" "${BEST_SMALL:---threads 128 --chunk 8192 --stages 2 --simt-threads 256}"; do
          log "overlap --ranks 8 --compute $load --compute-ms ${BEST_MS:-3} -e 256M --ctas $c $shape"
          timeout 120 $B/oxccl bench overlap --ranks 8 --compute $load --compute-ms ${BEST_MS:-3} -e 256M --ctas $c -n 5 -w 2 $shape 2>&1 | tee -a "$OUT/overlap_best.log" | grep -E "^ +(tma|simt) " | tee -a "$OUT/best.tmp" ; done; done
        echo "## best of $load: $(awk '{k=$1; if(!(k in m)||$14<m[k]) m[k]=$14} END{for(k in m) printf "%s %.3f | ", k, m[k]}' "$OUT/best.tmp")"
        awk '{k=$1; if(!(k in m)||$14<m[k]){m[k]=$14; r[k]=$0}} END{for(k in r) print "##   " r[k]}' "$OUT/best.tmp"; done ;;
    tma-trace)
      # The TMA copy's issuing loop timed item by item (oxccl bench tma_trace), alone and beside the
      # FMA probe (1 and 4 CTAs per SM), the sleep control and the mma GEMM: where the copy beside busy
      # warps loses its time. TRACE_SHAPES: issuers:chunk:stages:lag.
      for s in ${TRACE_SHAPES:-1:32768:4:2 1:32768:4:1 1:32768:6:1 1:16384:12:1 4:16384:2:1 4:16384:3:1 4:32768:1:1}; do
        IFS=: read -r w ch st lg <<< "$s"
        for load in "fma --fma-ctas-per-sm 1" "fma --fma-ctas-per-sm 4" "sleep --fma-ctas-per-sm 4" "mma --gemm 8192,8192,2048"; do
          log "tma_trace --issuers $w --chunk $ch --stages $st --lag $lg --compute $load"
          timeout 60 $B/oxccl bench tma_trace -e 1G --ctas 8 --issuers $w --chunk $ch --stages $st --lag $lg --compute $load >> "$OUT/tma_trace.log" 2>&1; echo "rc=$?"
          tail -2 "$OUT/tma_trace.log" ; done; done ;;
    trace-rounds)
      # The copy in rounds of four items (each step of a round as independent instructions) against
      # the engine's item-by-item ring, without per-item records (--untraced) unless the shape says
      # traced, alone and beside the FMA probe at 4 and 1 CTAs per SM. ROUND_SHAPES:
      # round:stages:chunk:lag[:traced].
      for s in ${ROUND_SHAPES:-1:4:32768:2 1:4:32768:2:traced 4:4:32768:1 4:8:16384:1 4:12:16384:1}; do
        IFS=: read -r rd st ch lg tr <<< "$s"
        for load in "fma --fma-ctas-per-sm 4" "fma --fma-ctas-per-sm 1"; do
          log "tma_trace --round $rd --stages $st --chunk $ch --lag $lg ${tr:-untraced} --compute $load"
          timeout 60 $B/oxccl bench tma_trace -e 1G --ctas 8 --issuers 1 --round $rd --stages $st --chunk $ch --lag $lg $([ -z "$tr" ] && echo --untraced) --compute $load >> "$OUT/trace_rounds.log" 2>&1
          rc=$?; [ $rc -eq 0 ] || FAILED="$FAILED trace-rounds(rc=$rc)"
          tail -2 "$OUT/trace_rounds.log" ; done; done ;;
    issuers)
      # Several issuing warps (branch next/multi-issuer): the bulk path beside FMA loads of 1 and 4 CTAs
      # per SM, and the collectives alone, with 1, 2 and 4 issuers.
      # W:stages pairs: two and four stages per issuer (ISSUER_SHAPES).
      for ws in ${ISSUER_SHAPES:-1:4 2:4 2:8 4:8 4:16}; do
        w=${ws%:*}; st=${ws#*:}
        for n in 1 4; do
          log "overlap fma --fma-ctas-per-sm $n --reduction tma --issuers $w --stages $st"
          timeout 100 $B/oxccl bench overlap --ranks 8 --compute fma -e 256M --ctas 1 --reduction tma --issuers $w --stages $st --fma-ctas-per-sm $n -n 10 -w 3 --json >> "$OUT/issuers.log" 2>&1; echo "rc=$?"
          tail -10 "$OUT/issuers.log" | grep -E "^ +(tma|simt) " ; done
        for c in 1 8; do for coll in all_reduce all_gather; do
          log "$coll --ranks 8 --ctas $c --reduction tma --issuers $w --stages $st"
          timeout 60 $B/oxccl bench $coll --ranks 8 -b 64M -e 1G -f 4 -n 10 -w 3 --ctas $c $([ "$coll" = all_reduce ] && echo --reduction tma) --issuers $w --stages $st >> "$OUT/issuers.log" 2>&1; echo "rc=$?"
          tail -4 "$OUT/issuers.log" | grep -E "^ +1073741824 |Avg" ; done; done; done ;;
    issuer-shapes)
      # The bulk path with 1, 2 or 4 issuers and a shared-memory footprint that leaves room for the
      # compute's CTAs, beside FMA loads of 1, 2, 4 and 8 CTAs per SM (SHAPE_FMA) and the cuBLAS GEMM.
      # SHAPES: issuers:stages:chunk triples.
      shapes="${SHAPES:-1:4:32768 2:4:32768 4:4:32768 2:8:16384 4:8:16384 4:8:24576 4:4:16384}"
      for n in ${SHAPE_FMA:-1 2 4 8}; do for s in $shapes; do
        IFS=: read -r w st ch <<< "$s"
        log "overlap fma --fma-ctas-per-sm $n --reduction tma --issuers $w --stages $st --chunk $ch"
        timeout 100 $B/oxccl bench overlap --ranks 8 --compute fma -e 256M --ctas ${SHAPE_CTAS:-1} --reduction tma --issuers $w --stages $st --chunk $ch --fma-ctas-per-sm $n -n 10 -w 3 --json >> "$OUT/issuer_shapes.log" 2>&1; echo "rc=$?"
        tail -10 "$OUT/issuer_shapes.log" | grep -E "^ +(tma|simt) " | grep -E " 0 +[0-9]+ +[0-9.]+ " ; done; done
      libs="$(cublas_path)"
      for s in ${GEMM_SHAPES:-1:4:32768 4:8:16384 4:4:8192}; do
        IFS=: read -r w st ch <<< "$s"
        log "overlap gemm --reduction tma --issuers $w --stages $st --chunk $ch"
        LD_LIBRARY_PATH="$libs" timeout 100 $B/oxccl bench overlap --ranks 8 --compute gemm -e 256M --ctas ${SHAPE_CTAS:-1} --reduction tma --issuers $w --stages $st --chunk $ch -n 10 -w 3 --json >> "$OUT/issuer_shapes.log" 2>&1; echo "rc=$?"
        tail -10 "$OUT/issuer_shapes.log" | grep -E "^ +(tma|simt) " ; done ;;
    combine-direct)
      # AllReduce's combine into every rank stored from registers (true) or as one shared copy
      # bulk-stored (false), at CD_RC "ranks:ctas" pairs; ReduceScatter (always from registers);
      # the movers' reduce-add at 64-256 threads; overlap at the default (Config::combine_direct).
      for rc in ${CD_RC:-8:1 8:2 8:4 8:8 8:16 4:4 4:8 4:16 2:8 2:16 2:32}; do set -- ${rc/:/ }
        for flag in false true; do
          log "all_reduce --ranks $1 --ctas $2 --combine-direct $flag"; timeout 60 $B/oxccl bench all_reduce --ranks $1 -b 1G -e 1G -n 10 -w 3 --ctas $2 --combine-direct $flag > "$OUT/cd_ar_$1_$2_$flag.log" 2>&1; grep -E "^ +1073741824 " "$OUT/cd_ar_$1_$2_$flag.log" ; done
        log "reduce_scatter --ranks $1 --ctas $2"; timeout 60 $B/oxccl bench reduce_scatter --ranks $1 -b 1G -e 1G -n 10 -w 3 --ctas $2 > "$OUT/cd_rs_$1_$2.log" 2>&1; grep -E "^ +1073741824 " "$OUT/cd_rs_$1_$2.log" ; done
      for th in 64 128 256; do
        log "movers --threads $th"; timeout 60 $B/oxccl bench movers -e 256M -n 5 -w 2 --threads $th > "$OUT/cd_movers_$th.log" 2>&1; grep -E "^ +reduce-add" "$OUT/cd_movers_$th.log" | awk '$3==1||$3==32' ; done
      libs="$(cublas_path)"
      for load in gemm fma; do for c in 1 4; do
        log "overlap --compute $load --ctas $c --reduction registers"; LD_LIBRARY_PATH="$libs" timeout 100 $B/oxccl bench overlap --ranks 8 --compute $load -e 256M --ctas $c --reduction registers -n 10 -w 3 --json >> "$OUT/cd_overlap.log" 2>&1; echo "rc=$?"; tail -8 "$OUT/cd_overlap.log" | grep -E "^ +(tma|simt) " ; done; done ;;
    combine-threads)
      # Register combines by threads per CTA: the movers' reduce-add, AllReduce and ReduceScatter.
      for th in 32 64 128 256; do
        log "movers --threads $th"; timeout 60 $B/oxccl bench movers -e 256M -n 5 -w 2 --threads $th > "$OUT/ct_movers_$th.log" 2>&1; grep -E "^ +reduce-add" "$OUT/ct_movers_$th.log" | awk '$3==1||$3==32' ; done
      for th in 64 128 256; do for c in 1 8; do for coll in all_reduce reduce_scatter; do
        log "$coll --threads $th --ctas $c"; timeout 60 $B/oxccl bench $coll --ranks 8 -b 1G -e 1G -n 10 -w 3 --ctas $c --threads $th > "$OUT/ct_${coll}_${th}_$c.log" 2>&1; grep -E "^ +1073741824 " "$OUT/ct_${coll}_${th}_$c.log" ; done; done; done ;;
    reshard)
      log gpu_reshard; timeout 300 $B/gpu_reshard --test-threads=1 --nocapture > "$OUT/gpu_reshard.log" 2>&1; grep -E "^test |test result|cases|panicked" "$OUT/gpu_reshard.log"
      log bench-reshard; timeout 200 $B/oxccl bench reshard --json > "$OUT/bench_reshard.log" 2>&1; grep -v "^{" "$OUT/bench_reshard.log" ;;
    allreduce-256m)
      log allreduce-tma-256m; timeout 100 $B/oxccl bench all_reduce --ranks 8 -b 1M -e 256M -f 4 --ctas 8 --mover tma --json > "$OUT/ar_tma_8_256m.log" 2>&1; grep -v "^{" "$OUT/ar_tma_8_256m.log" ;;
    collectives)
      log gpu_collectives; timeout 150 $B/gpu_collectives --test-threads=1 --nocapture collectives_match > "$OUT/gpu_collectives_random.log" 2>&1; grep -E "^test |test result|cases|panicked" "$OUT/gpu_collectives_random.log" ;;
    allreduce)
      log allreduce-tma; timeout 120 $B/oxccl bench all_reduce --ranks 8 -b 1M -e 1G -f 4 --ctas 8 --mover tma --json > "$OUT/ar_tma_8.log" 2>&1; grep -v "^{" "$OUT/ar_tma_8.log" ;;
    compiled)
      export CUDA_DEVICE_MAX_CONNECTIONS=32
      log gpu_intrinsics-smem; timeout 60 $B/gpu_intrinsics --test-threads=1 --nocapture dynamic_shared_memory_size > "$OUT/gpu_intrinsics_smem.log" 2>&1; grep -E "^test |test result|panicked" "$OUT/gpu_intrinsics_smem.log"
      log gpu_compiled; timeout 600 $B/gpu_compiled --test-threads=1 --nocapture > "$OUT/gpu_compiled.log" 2>&1; grep -E "^test |test result|cases|FAILED|panicked|timed out|shape|skipped" "$OUT/gpu_compiled.log" ;;
    compiled-bench)
      # Transfer programs through run_program, each at its own roofline.
      for args in "--algo ring-allreduce --topo 1x8" "--algo hm-allreduce --topo 2x4" "--algo hm-allgather --topo 2x8" "--xml .device/host-msccl/ndv4_r48ll.xml" "--xml .device/host-msccl/ndv4_ag-32m-1g.xml"; do
        log "bench $args"; timeout 120 $B/oxccl bench plan $args -b 1M -e 1G -f 4 -n 10 -w 3 --json >> "$OUT/compiled_bench.log" 2>&1; tail -24 "$OUT/compiled_bench.log" | grep -vE "^\{" ; done ;;
    plan-shapes)
      # Transfer programs by launch shape (threads, TMA stage bytes, CTAs, mover) at 256 MiB, in
      # place. PLAN_VARIANTS: flag sets separated by ';' (an empty one: the defaults).
      IFS=';' read -ra variants <<< "${PLAN_VARIANTS:-;--threads 256;--chunk 24576;--chunk 24576 --threads 256;--ctas 4;--ctas 8;--mover simt}"
      for args in "--algo ring-allreduce --topo 1x8" "--algo hm-allreduce --topo 2x4" "--algo hm-allgather --topo 2x8"; do
        for v in "${variants[@]}"; do
          log "bench $args $v"
          timeout 60 $B/oxccl bench plan $args $v -b 256M -e 256M -n 5 -w 2 2>&1 | grep -E "^ +268435456 |levels|^oxccl|rror" ; done; done ;;
    few-ctas)
      # The TMA AllReduce at 1 and 2 CTAs per rank (8 virtual ranks, 256 MiB per rank), by combining
      # threads and by where the combined shard goes, against SIMT: what bounds the register combine
      # where it trails SIMT.
      # FEW_VARIANTS: flag sets separated by ';'.
      IFS=';' read -ra variants <<< "${FEW_VARIANTS:---mover simt;--threads 128;--threads 256;--threads 512;--threads 1024;--combine-direct false}"
      for c in ${FEW_CTAS:-1 2}; do for v in "${variants[@]}"; do
        log "all_reduce --ranks 8 -e 256M --ctas $c $v"
        timeout 60 $B/oxccl bench all_reduce --ranks 8 -b 256M -e 256M -n 5 -w 2 --ctas $c $v 2>&1 | grep -E "^ +268435456 |^oxccl|rror" ; done; done ;;
    cta-table)
      # 16 CTAs per rank is every SM (8 x 16 of 132; one CTA per SM); 32 asks for more CTAs than
      # can be resident at once (the communicator refuses a launch whose CTAs cannot all run).
      for m in tma simt; do for c in 1 2 4 8 16 32; do
        log "all_reduce 8 virtual ranks --ctas $c --mover $m"; timeout 60 $B/oxccl bench all_reduce --ranks 8 -b 1M -e 1G -f 4 -n 10 -w 3 --ctas $c --mover $m --json >> "$OUT/cta_table.log" 2>&1; echo "rc=$?"; tail -20 "$OUT/cta_table.log" | grep -E "^#? +(268435456|1073741824) |Avg|roofline" ; done; done ;;
    multi-tests)
      export CUDA_DEVICE_MAX_CONNECTIONS=32
      export OXCCL_REQUIRE_GPU=1
      log "gpu_collectives one rank per GPU"; timeout 200 $B/gpu_collectives --test-threads=1 --nocapture one_rank_per_gpu > "$OUT/multi_collectives.log" 2>&1
      rc=$?; [ $rc -eq 0 ] || FAILED="$FAILED multi-gpu_collectives(rc=$rc)"; grep -E "^test |test result|cases|panicked|skipped" "$OUT/multi_collectives.log"
      log "gpu_reshard one rank per GPU"; timeout 150 $B/gpu_reshard --test-threads=1 --nocapture one_rank_per_gpu > "$OUT/multi_reshard.log" 2>&1
      rc=$?; [ $rc -eq 0 ] || FAILED="$FAILED multi-gpu_reshard(rc=$rc)"; grep -E "^test |test result|cases|panicked|skipped" "$OUT/multi_reshard.log" ;;
    multi-bench)
      for coll in ${MULTI_COLLECTIVES:-all_reduce reduce_scatter all_gather broadcast reduce}; do for c in $CTAS; do
        log "oxccl $coll --gpus $GPUS --ctas $c"; timeout 150 $B/oxccl bench $coll --gpus $GPUS --ctas $c $SIZES -n 20 -w 5 --json >> "$OUT/multi_bench.log" 2>&1; echo "rc=$?"; tail -12 "$OUT/multi_bench.log" | grep -vE "^\{" ; done; done ;;
    multi-tune)
      # Bytes in flight per CTA against NVLink at one size: the default, then deeper rings of
      # smaller chunks filling 192 KiB of stages (one slot per source: GPUS sources per stage).
      for coll in reduce_scatter all_reduce; do for c in 8 16; do for st in 4 6 8 12; do
        chunk=""; [ "$st" != 4 ] && chunk="--chunk $(( 196608 / (st * GPUS) / 1024 * 1024 ))"
        log "oxccl $coll --gpus $GPUS --ctas $c --stages $st $chunk"; timeout 90 $B/oxccl bench $coll --gpus $GPUS --ctas $c --stages $st $chunk -b 1G -e 1G -n 10 -w 3 --json >> "$OUT/multi_tune.log" 2>&1; echo "rc=$?"; tail -4 "$OUT/multi_tune.log" | grep -E "^ +1073741824" ; done; done; done ;;
    nccl)
      log "nccl --gpus $GPUS"; timeout 300 python3 scripts/nccl_bench.py --gpus $GPUS --ctas "${NCCL_CTAS:-4,8,16,32,64,default}" $SIZES --json > "$OUT/nccl_bench.log" 2>&1; echo "rc=$?"; grep -v "^{" "$OUT/nccl_bench.log" | tail -120 ;;
    compare)
      log "oxccl vs NCCL"; python3 scripts/compare_nccl.py --oxccl "$OUT/multi_bench.log" --nccl "$OUT/nccl_bench.log" ;;
    *) echo "unknown step $step" ;;
  esac
done
if [ -n "$FAILED" ]; then echo "=== FAILED:$FAILED"; exit 1; fi
