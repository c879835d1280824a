#!/usr/bin/env bash
# Builds the candle examples (examples/candle) on stable Rust, on a machine with or without CUDA.
# candle's CUDA backend compiles its kernels with nvcc, taken here from PyPI's CUDA 13 wheels (and
# the CCCL headers' wheel), and links against libcuda, cuBLAS, cuRAND, NVRTC and the CUDA runtime.
# Where those are missing, stand-ins with their sonames and the symbols the binaries use let the
# link through (made from a first link's undefined symbols); the real libraries are found when the
# binaries run. Arguments go to `cargo build --release`; the binaries are
# examples/candle/target/release/candle-{ddp,tp}.
set -euo pipefail
cd "$(dirname "$0")/../examples/candle"
cache="${OXCCL_CANDLE_CACHE:-$HOME/.cache/oxccl-candle}"
cu13() { python3 -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13"))' 2>/dev/null || true; }
site="$(cu13)"
if [ ! -x "$site/bin/nvcc" ]; then
  # A folder of its own (a system-wide pip install may be refused).
  [ -x "$cache/nvcc/nvidia/cu13/bin/nvcc" ] || python3 -m pip install --quiet --target "$cache/nvcc" 'nvidia-cuda-nvcc>=13,<14'
  site="$cache/nvcc/nvidia/cu13"
fi
[ -d "$cache/cccl/nvidia/cu13/include/cccl" ] || python3 -m pip install --quiet --target "$cache/cccl" 'nvidia-cuda-cccl>=13,<14'
stub="$cache/stub"
mkdir -p "$stub"
# lib:soname major:the symbols it provides (driver API cuX, runtime API cudaX and __cudaX, ...).
libs="cuda:1:^cu[A-Z] cublas:13:^cublas[^L] cublasLt:13:^cublasLt curand:10:^curand nvrtc:13:^nvrtc cudart:13:^_*cuda[A-Z]"
stand_ins() {
  for lib in $libs; do
    IFS=: read -r name major pattern <<<"$lib"
    grep -E "$pattern" "$stub/symbols.txt" 2>/dev/null | sed 's/.*/int &(void) { return 0; }/' > "$stub/$name.c" || true
    cc -shared -o "$stub/lib$name.so" -Wl,-soname,"lib$name.so.$major" "$stub/$name.c"
  done
}
touch "$stub/symbols.txt"
[ -f "$stub/libcuda.so" ] || stand_ins
rustup toolchain list | grep -q '^stable' || rustup toolchain install stable --profile minimal
# cudarc's bindings for CUDA 13.0 (it has none for the wheel's 13.x); candle's kernels for sm_90.
export CUDA_HOME="$site" PATH="$site/bin:$PATH" CUDA_COMPUTE_CAP=90 CUDARC_CUDA_VERSION=13000
export NVCC_PREPEND_FLAGS="-isystem $cache/cccl/nvidia/cu13/include/cccl"
# OXCCL_CANDLE_QUICK=1 (CI, where the binaries are only checked, never run): candle's kernels built
# at NVVM's and ptxas's -O1 (-O0 fails on some), in about half the time, and the Rust code
# unoptimized. Such binaries are slow where they run.
if [ -n "${OXCCL_CANDLE_QUICK:-}" ]; then
  export NVCC_APPEND_FLAGS="${NVCC_APPEND_FLAGS:-} -Xcicc -O1 -Xptxas -O1"
  export CARGO_PROFILE_RELEASE_OPT_LEVEL=0 CARGO_PROFILE_RELEASE_CODEGEN_UNITS=256
fi
# The link leaves symbols unresolved (a stand-in may lack one): the real libraries resolve them at load.
export RUSTFLAGS="-L native=$stub -C link-arg=-Wl,--unresolved-symbols=ignore-all"
# The shipped PTX: stable Rust does not build device code.
export OXCCL_PTX_BUILD=shipped
cargo +stable build --release "$@"
# An empty stand-in is dropped by the linker (`--as-needed`) and the binary then lacks the library:
# the symbols the binaries still miss go into the stand-ins, and the binaries are linked again.
bins=(target/release/candle-ddp target/release/candle-tp)
# (Names without their version suffix, `sym@LIB`, where a real library was linked.)
nm -D --undefined-only "${bins[@]}" | awk '/ U /{sub(/@.*/, "", $2); print $2}' | { grep -E '^_*cu|^nvrtc' || true; } \
  | sort -u > "$stub/wanted.txt"
missing="$(comm -23 "$stub/wanted.txt" "$stub/symbols.txt")"
if [ -n "$missing" ]; then
  sort -u -o "$stub/symbols.txt" "$stub/wanted.txt" "$stub/symbols.txt"
  stand_ins
  touch src/lib.rs
  cargo +stable build --release "$@"
fi
for b in "${bins[@]}"; do
  needed="$(readelf -d "$b")"
  [[ "$needed" == *"[libcuda.so.1]"* ]] || { echo "$b does not load libcuda.so.1" >&2; exit 1; }
done
