//! Criterion benchmark of the two data movers: the mover sweep's cases (copy, reduce-add,
//! reduce-into; TMA and SIMT; 1 to 132 CTAs) on one Hopper GPU, each reported as throughput in bytes
//! read plus written (decimal GB). The same cases as one table, beside `cuMemcpyDtoD`, with threads
//! and registers per CTA: `oxccl bench movers`.
//!
//! ```text
//! cargo bench --bench movers                    # every case, 256 MiB per buffer
//! cargo bench --bench movers -- 'copy/tma'      # criterion's filter
//! OXCCL_BENCH_BYTES=1073741824 cargo bench --bench movers
//! ```
//!
//! Without a GPU it prints `skipped: no GPU (...)` and measures nothing.

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use oxccl::Mover;
use oxccl::bench::{MoverBench, SweepConfig, SweepOp};
use std::time::Duration;

/// Bytes per buffer unless `OXCCL_BENCH_BYTES` says otherwise.
const DEFAULT_BYTES: u64 = 256 << 20;

fn movers(c: &mut Criterion) {
    let ctx = match oxccl::engine::probe_gpu() {
        Ok(ctx) => ctx,
        Err(why) => {
            eprintln!("skipped: no GPU ({why})");
            return;
        }
    };
    let bytes = match std::env::var("OXCCL_BENCH_BYTES") {
        Ok(v) => v.parse().unwrap_or_else(|_| panic!("OXCCL_BENCH_BYTES={v}: give a byte count")),
        Err(_) => DEFAULT_BYTES,
    };
    let stream = ctx.default_stream();
    let cfg = SweepConfig { bytes, ..SweepConfig::default() };
    cfg.validate().unwrap_or_else(|e| panic!("sweep configuration: {e}"));
    let bench = MoverBench::new(&stream, bytes).unwrap_or_else(|e| panic!("mover bench setup: {e}"));
    for op in SweepOp::ALL {
        let mut group = c.benchmark_group(op.name());
        for mover in [Mover::Tma, Mover::Simt] {
            let name = if mover == Mover::Tma { "tma" } else { "simt" };
            for &ctas in &cfg.ctas {
                let case =
                    bench.case(&cfg, op, mover, ctas).unwrap_or_else(|e| panic!("{} {name} x{ctas}: {e}", op.name()));
                group.throughput(Throughput::BytesDecimal(case.traffic_bytes()));
                group.bench_with_input(BenchmarkId::new(name, ctas), &case, |b, case| {
                    b.iter_custom(|n| {
                        let ms = bench.time_ms(case, 0, n as usize).unwrap_or_else(|e| panic!("launch: {e}"));
                        Duration::from_secs_f64(ms * n as f64 * 1e-3)
                    })
                });
            }
        }
        group.finish();
    }
    bench.finish().unwrap_or_else(|e| panic!("device-side error: {e}"));
}

criterion_group! {
    name = benches;
    // Each launch moves hundreds of MiB: a few samples over a short window are enough.
    config = Criterion::default().sample_size(10).warm_up_time(Duration::from_millis(500)).measurement_time(Duration::from_secs(2));
    targets = movers
}
criterion_main!(benches);
