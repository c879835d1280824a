//! The shipped benchmark module (`cli/ptx/oxccl_bench.ptx`, what a packaged `oxccl-cli` embeds)
//! equals a fresh build of `bench-kernels`. The golden-PTX checks of its kernels run with the
//! library's (`tests/ptx.rs` at the workspace root).

#[path = "../../tests/common/mod.rs"]
mod common;

#[test]
fn shipped_bench_ptx_equals_a_fresh_build() {
    if oxccl_cli::ptx::SOURCE != "fresh" {
        common::skip("skipped: the PTX was not rebuilt here (no device toolchain); the shipped file is embedded");
        return;
    }
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("ptx/oxccl_bench.ptx");
    let shipped = std::fs::read_to_string(&path).unwrap_or_default();
    if shipped != oxccl_cli::ptx::BENCH {
        if std::env::var_os("OXCCL_BLESS").is_some() {
            std::fs::write(&path, oxccl_cli::ptx::BENCH).unwrap();
            eprintln!("blessed {}", path.display());
        } else {
            panic!(
                "cli/ptx/oxccl_bench.ptx differs from a fresh build: run `OXCCL_BLESS=1 cargo test -p oxccl-cli --test ptx` and commit it"
            );
        }
    }
    assert!(oxccl_cli::ptx::BENCH.contains(".entry bench_gemm_wgmma("), "the benchmark module lacks its GEMM");
}
