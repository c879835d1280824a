//! Criterion benchmark of the two data movers: the mover sweep's cases (copy, reduce-add,
//! reduce-into; TMA and SIMT; 1 to 132 CTAs) on one Hopper GPU, each reported as throughput in bytes
//! read plus written (decimal GB). The same cases as one table, beside `cuMemcpyDtoD`, with threads
//! and registers per CTA: `oxccl bench movers`.
//!
//! ```text
//! cargo bench --bench movers                    # every case, 1 GiB per buffer (as `oxccl bench movers`)
//! cargo bench --bench movers -- 'copy/tma'      # criterion's filter
//! OXCCL_BENCH_BYTES=268435456 cargo bench --bench movers   # 256 MiB (66 and 132 CTAs then get one range each)
//! ```
//!
//! Without a GPU it prints `skipped: no GPU (...)` and measures nothing.

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use oxccl::Mover;
use oxccl_cli::bench::{MoverBench, SweepConfig, SweepOp};
use std::time::Duration;

/// Bytes per buffer unless `OXCCL_BENCH_BYTES` says otherwise: the sweep's, so that 66 and 132 CTAs
/// get the sweep's 4 MiB pieces (the automatic split needs 4 MiB per CTA).
const DEFAULT_BYTES: u64 = 1 << 30;

/// Stops the bench with `why` (bad input, named before any GPU is looked for).
fn refuse(why: String) -> ! {
    eprintln!("{why}");
    std::process::exit(2)
}

fn movers(c: &mut Criterion) {
    let bytes = match std::env::var("OXCCL_BENCH_BYTES") {
        Ok(v) => v.parse().unwrap_or_else(|_| refuse(format!("OXCCL_BENCH_BYTES={v}: give a byte count"))),
        Err(_) => DEFAULT_BYTES,
    };
    let cfg = SweepConfig { bytes, ..SweepConfig::default() };
    if let Err(e) = cfg.validate() {
        refuse(format!("OXCCL_BENCH_BYTES={bytes}: {e}"));
    }
    let ctx = match oxccl::engine::probe_gpu() {
        Ok(ctx) => ctx,
        Err(why) => {
            eprintln!("skipped: no GPU ({why})");
            return;
        }
    };
    let stream = ctx.default_stream();
    let bench = MoverBench::new(&stream, &cfg).unwrap_or_else(|e| panic!("mover bench setup: {e}"));
    for op in SweepOp::ALL {
        let mut group = c.benchmark_group(op.name());
        for mover in [Mover::Tma, Mover::Simt] {
            let name = if mover == Mover::Tma { "tma" } else { "simt" };
            for &ctas in &cfg.ctas {
                let what = format!("{}/{name}/{ctas}", op.name());
                let case = bench.case(op, mover, ctas).unwrap_or_else(|e| panic!("{what}: {e}"));
                group.throughput(Throughput::BytesDecimal(case.traffic_bytes()));
                group.bench_with_input(BenchmarkId::new(name, ctas), &case, |b, case| {
                    b.iter_custom(|n| {
                        let ms = case.time_ms(0, n as usize).unwrap_or_else(|e| panic!("{what}: {e}"));
                        Duration::from_secs_f64(ms * n as f64 * 1e-3)
                    })
                });
                // A wait that gave up is reported here, not after the rest of the cases.
                bench.finish().unwrap_or_else(|e| panic!("{what}: device-side error: {e}"));
            }
        }
        group.finish();
    }
}

criterion_group! {
    name = benches;
    // Each launch moves hundreds of MiB: a few samples over a short window are enough.
    config = Criterion::default().sample_size(10).warm_up_time(Duration::from_millis(500)).measurement_time(Duration::from_secs(2));
    targets = movers
}
criterion_main!(benches);
