#!/usr/bin/env bash
# Builds the GPU test and benchmark binaries here (the GPU machine has no Rust toolchain) and copies
# them under .device/bin with stable names, ready to be carried to the GPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."
# Stale binaries would count against the device machine limit of 64 MiB: clear all but the A/B
# builds (`oxccl-*`, copied here by hand for gpu-suite.sh ab).
mkdir -p .device/bin
find .device/bin -maxdepth 1 -type f ! -name 'oxccl-*' -delete
export OXCCL_PTX_BUILD=fresh
# Cargo's messages of the builds below (all but candle's), for the check of the embedded PTX at the end.
BUILDS=$(mktemp); trap 'rm -f "$BUILDS"' EXIT
# The CLI with the cuBLAS GEMM load for `bench overlap --compute gemm`.
cargo build --release -p oxccl-cli --features gemm --bin oxccl --message-format=json-render-diagnostics >> "$BUILDS"
cp target/release/oxccl .device/bin/oxccl
cargo test --workspace --release --no-run --message-format=json-render-diagnostics \
  | tee -a "$BUILDS" | python3 -c '
import json, sys, shutil
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"]:
        name = m["target"]["name"]
        # Only the GPU suites: the CPU tests run in CI, and every binary embeds the PTX (the carried
        # folder must stay under the device machine limit of 64 MiB).
        if not name.startswith("gpu_"):
            continue
        shutil.copy(m["executable"], ".device/bin/" + name)
        print("staged", name)
'
# The cargo benches (criterion's mover cases, `oxccl bench` as a bench), as bench-movers and
# bench-collectives; run them with `--bench`.
cargo bench --no-run -p oxccl-cli --bench movers --bench collectives --message-format=json-render-diagnostics \
  | tee -a "$BUILDS" | python3 -c '
import json, sys, shutil
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["bench"]:
        shutil.copy(m["executable"], ".device/bin/bench-" + m["target"]["name"])
        print("staged bench-" + m["target"]["name"])
'
# The examples that run on a GPU (gpu-suite.sh ranks runs them).
cargo build --release --example device_threads --message-format=json-render-diagnostics >> "$BUILDS"
cp target/release/examples/device_threads .device/bin/
# The candle examples (their own build: scripts/candle-examples.sh; OXCCL_STAGE_CANDLE=0 skips).
if [ "${OXCCL_STAGE_CANDLE:-1}" != 0 ]; then
  scripts/candle-examples.sh
  cp examples/candle/target/release/candle-ddp examples/candle/target/release/candle-tp .device/bin/
fi
# The binaries must carry this checkout's device code. Where the device sources are as committed,
# every fresh engine PTX the builds embedded must equal the shipped one: one that differs came from a
# stale nested device build (its target directory under the build script's OUT_DIR), as when another
# checkout of the same crates built into this target directory.
if git diff --quiet HEAD -- kernels-gpu ptx-intrinsics ptx device-build 2>/dev/null; then
  python3 - "$BUILDS" <<'PY'
import json, os, sys, filecmp
bad = []
for line in open(sys.argv[1]):
    m = json.loads(line)
    if m.get("reason") == "build-script-executed":
        ptx = os.path.join(m.get("out_dir") or "", "oxccl_kernels.ptx")
        if os.path.exists(ptx) and not filecmp.cmp(ptx, "ptx/oxccl_kernels.ptx", shallow=False):
            bad.append(ptx)
for b in sorted(set(bad)):
    print(f"gpu-stage: {b} differs from ptx/oxccl_kernels.ptx though the device sources are as committed: "
          f"a stale nested build; remove {os.path.dirname(b)}/device-target* and stage again", file=sys.stderr)
sys.exit(1 if bad else 0)
PY
fi
# MSCCL files for `gpu-suite.sh compiled-bench` (the GPU machine has no checkout).
mkdir -p .device/host-msccl
cp host/tests/data/msccl/*.xml .device/host-msccl/
ls -la .device/bin
# The carried folders and the work tree share the device machine's 64 MiB: the stripped binaries
# and the MSCCL files packed with xz take a few MiB. Carry .device/pack alone; gpu-suite.sh unpacks it
# into .device/bin when that folder is missing there.
rm -rf .device/pack .device/stripped && mkdir -p .device/pack .device/stripped/host-msccl
# Debug sections go; symbols stay, so that a stack printed on the device names its functions.
for f in .device/bin/*; do strip --strip-debug -o ".device/stripped/${f##*/}" "$f"; done
cp .device/host-msccl/*.xml .device/stripped/host-msccl/
# Every binary embeds the same PTX: a dictionary larger than the whole tar lets xz store it once
# (all binaries with the candle examples: about 7 MiB instead of 38; minutes on two cores).
tar -C .device/stripped -cf - . | xz -T1 -9e --lzma2=dict=512MiB > .device/pack/bins.tar.xz
rm -rf .device/stripped
ls -la .device/pack
