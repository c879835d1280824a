//! The host planners' speed on the large inputs the tests check for correctness (`lowered_checks`,
//! `reshard_plan`, `reshard_lower`, `robust_import`) and the compiler at scale: each workload's
//! best of three runs against its budget, which guards against a regression in complexity (linear
//! back to quadratic). Exits with status 1 naming any workload over its budget.
//!
//! The compiler is timed on the 1024-GPU HM AllReduce (2 M ops) always, and with
//! `OXCCL_BENCH_8192=1` on the 8192-GPU one (134 M ops, 268 M tasks; one run, about half a
//! minute): under 30 s and under 4 GB of peak resident memory, the compiler's part (the peak is
//! reset before it, where Linux allows).
//!
//! `cargo bench -p oxccl-host --bench planners`
//! `OXCCL_BENCH_8192=1 cargo bench -p oxccl-host --bench planners`

use oxccl_host::compile::{Options, compile_streaming};
use oxccl_host::lowered::{self, Lowered};
use oxccl_host::program::generators::Algorithm;
use oxccl_host::program::msccl::{import, import_unchecked};
use oxccl_host::reshard::{Layout, LowerOptions, PlanOptions, lower, plan};
use oxccl_kernels::abi::{DType, MAX_CTAS_PER_RANK, RedOp, Task, TaskKind, TbProgram, slot};
use std::time::{Duration, Instant};

/// Runs `f` three times; the shortest run.
fn best_of_3(mut f: impl FnMut()) -> Duration {
    (0..3)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed()
        })
        .min()
        .unwrap()
}

/// `n` tasks copying rank 0's first 16 input bytes to 16-byte pieces of its output, `per_cta` to a
/// CTA: race-free (as in `tests/lowered_checks.rs`).
fn pieces(n: u32, per_cta: u32) -> Lowered {
    let tasks = (0..n as u64)
        .map(|k| Task {
            kind: TaskKind::Move.raw(),
            dtype: DType::F32.raw(),
            op: RedOp::Sum.raw(),
            src_slot: slot::INPUT,
            dst_slot: slot::OUTPUT,
            flags: 0,
            divisor: 0,
            src_ranks: 1,
            dst_ranks: 1,
            src_offset: 0,
            dst_offset: k * 16,
            bytes: 16,
        })
        .collect();
    let programs = (0..n.div_ceil(per_cta))
        .map(|c| TbProgram {
            rank: 0,
            cta: c % MAX_CTAS_PER_RANK as u32,
            first_task: c * per_cta,
            task_count: per_cta.min(n - c * per_cta),
            barrier_ranks: 0,
            table: 0,
            key: 0,
            reserved: 0,
        })
        .collect();
    Lowered { programs, tasks, ranks: 1, slots: 1, combines: false }
}

/// A 2-GPU in-place AllReduce of `chunks` chunks exchanged whole `rounds` times in one TB per GPU
/// (as in `tests/robust_import.rs`).
fn wide_exchange(chunks: u32, rounds: u32) -> String {
    let mut x = format!(r#"<algo name="x" nchunksperloop="{chunks}" ngpus="2" coll="allreduce" inplace="1">"#);
    for g in 0..2 {
        let peer = 1 - g;
        x += &format!(r#"<gpu id="{g}" i_chunks="{chunks}" o_chunks="0" s_chunks="0">"#);
        x += &format!(r#"<tb id="0" send="{peer}" recv="{peer}" chan="0">"#);
        for s in 0..2 * rounds {
            let ty = if s < rounds { "s" } else { "rrc" };
            x += &format!(
                r#"<step s="{s}" type="{ty}" srcbuf="i" srcoff="0" dstbuf="i" dstoff="0" cnt="{chunks}" depid="-1" deps="-1" hasdep="0"/>"#
            );
        }
        x += "</tb></gpu>";
    }
    x + "</algo>"
}

/// A 1-GPU file of `wide` copies of the whole input to scratch, then `narrow` copies into one input
/// chunk each, every one conflicting with every wide copy (as in `tests/robust_import.rs`).
fn many_readers(wide: u32, narrow: u32) -> String {
    let mut x = format!(
        r#"<algo name="readers" ngpus="1" coll="allreduce" nchunksperloop="{narrow}" inplace="1"><gpu id="0" i_chunks="{narrow}" o_chunks="0" s_chunks="{}"><tb id="0" send="-1" recv="-1" chan="0">"#,
        2 * narrow
    );
    for s in 0..wide {
        x += &format!(r#"<step s="{s}" type="cpy" srcbuf="i" srcoff="0" dstbuf="s" dstoff="0" cnt="{narrow}"/>"#);
    }
    for j in 0..narrow {
        let s = wide + j;
        x += &format!(
            r#"<step s="{s}" type="cpy" srcbuf="s" srcoff="{}" dstbuf="i" dstoff="{j}" cnt="1"/>"#,
            narrow + j
        );
    }
    x + "</tb></gpu></algo>"
}

fn layout(mesh: &str, placements: &str) -> Layout {
    Layout::parse(mesh, placements).unwrap()
}

/// Peak resident memory the 8192-GPU compile may reach (issue 38: under 4 GB).
const PEAK_BUDGET: u64 = 4_000_000_000;

/// Resets the process's peak resident set (`VmHWM`) to its current size; whether it could.
fn reset_peak_rss() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

/// The process's peak resident set in bytes (`VmHWM` of `/proc/self/status`), where readable.
fn peak_rss() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    line.split_whitespace().nth(1)?.parse::<u64>().ok().map(|kib| kib * 1024)
}

fn main() {
    let ms = Duration::from_millis;
    let s = Duration::from_secs;
    let mut rows: Vec<(&str, Duration, Duration)> = Vec::new();

    let race_cases = [("race check, 100k tasks in 1 CTA", 100_000), ("race check, 100k tasks, 100 per CTA", 100)];
    for (name, per_cta) in race_cases {
        let l = pieces(100_000, per_cta);
        rows.push((name, best_of_3(|| lowered::check_races(&l, &[]).unwrap()), s(5)));
    }

    let weight = [7168, 18432];
    let (tp8, tp2_dp4) = (layout("8@0", "S0"), layout("4x2@8", "R,S0"));
    let took = best_of_3(|| drop(plan(&weight, 2, &tp8, &tp2_dp4, PlanOptions::default()).unwrap()));
    rows.push(("plan 7168x18432 bf16 TP8 -> TP2xDP4", took, ms(200)));
    let (rows256, cols256) = (layout("256@0", "S0"), layout("256@256", "S1"));
    let took = best_of_3(|| drop(plan(&[8192, 8192], 2, &rows256, &cols256, PlanOptions::default()).unwrap()));
    rows.push(("plan 256 rows -> 256 columns", took, s(1)));
    let (src3, dst3) = (layout("8x8x4@0", "S0,S1,R"), layout("4x16x4@256", "S1,S0,S0"));
    let took = best_of_3(|| drop(plan(&[10007, 4099], 4, &src3, &dst3, PlanOptions::default()).unwrap()));
    rows.push(("plan 256 -> 256 ranks, 3-D meshes", took, s(1)));

    let opts = LowerOptions { dtype: Some(DType::Bf16), ..LowerOptions::new(16, 8) };
    let cols = plan(&weight, 2, &layout("8@0", "S1"), &tp2_dp4, PlanOptions::default()).unwrap();
    rows.push(("lower layer-sized, TP8 columns", best_of_3(|| drop(lower(&cols, &opts).unwrap())), s(2)));
    let l = lower(&cols, &opts).unwrap();
    rows.push(("race check of it, 57k tasks", best_of_3(|| l.check_races().unwrap()), s(5)));

    let xml = wide_exchange(1 << 20, 1);
    rows.push(("import 2^20-chunk exchange", best_of_3(|| drop(import(&xml).unwrap())), s(2)));
    let xml = wide_exchange(1 << 20, 32);
    let took = best_of_3(|| {
        import_unchecked(&xml).unwrap_err();
        import(&xml).unwrap_err();
    });
    rows.push(("refuse snapshot growth, 32 rounds", took, s(2)));
    // One element of 100k attributes: reading attributes used to compare each with every other.
    let mut xml = String::from(r#"<algo name="wide" ngpus="1" coll="allreduce" nchunksperloop="1""#);
    for i in 0..100_000 {
        xml += &format!(" a{i}=\"1\"");
    }
    xml += r#"><gpu id="0" i_chunks="1"/></algo>"#;
    rows.push(("import an element of 100k attributes", best_of_3(|| drop(import(&xml).unwrap())), ms(500)));
    let xml = many_readers(12_000, 12_000);
    rows.push(("refuse 144M conflicting accesses", best_of_3(|| drop(import_unchecked(&xml).unwrap_err())), s(2)));
    let xml = wide_exchange(1 << 22, 1100);
    rows.push(("refuse past the access limit", best_of_3(|| drop(import_unchecked(&xml).unwrap_err())), s(10)));

    // The compiler on generated programs, as `oxccl plan` runs it: rank plans streamed and dropped.
    let compile = |algo: Algorithm, nodes: u32, gpus: u32| {
        let src = algo.source(nodes, gpus).unwrap();
        move || drop(compile_streaming(&src, &Options::default(), &mut drop).unwrap())
    };
    let took = best_of_3(compile(Algorithm::HmAllReduce, 128, 8));
    rows.push(("compile hm-allreduce 128x8, 2 M ops", took, s(5)));
    let took = best_of_3(compile(Algorithm::RingAllReduce, 1, 1024));
    rows.push(("compile ring-allreduce 1x1024, 2 M ops", took, s(5)));
    let mut peak = None;
    if std::env::var_os("OXCCL_BENCH_8192").is_some() {
        let run = compile(Algorithm::HmAllReduce, 1024, 8);
        let before = reset_peak_rss();
        let t = Instant::now();
        run();
        rows.push(("compile hm-allreduce 1024x8, 134 M ops", t.elapsed(), s(30)));
        peak = before.then(peak_rss).flatten();
    }

    println!("# cargo bench -p oxccl-host --bench planners: best of 3 (the 8192-GPU compile: one run)");
    println!("{:<40} {:>12} {:>10}", "workload", "measured", "budget");
    for (name, took, budget) in &rows {
        println!("{name:<40} {:>10.1}ms {:>8}ms", took.as_secs_f64() * 1e3, budget.as_millis());
    }
    let mut over: Vec<&str> = rows.iter().filter(|(_, took, budget)| took > budget).map(|(name, ..)| *name).collect();
    if let Some(bytes) = peak {
        println!(
            "{:<40} {:>10.1}MB {:>8}MB",
            "  its peak resident memory",
            bytes as f64 / 1e6,
            PEAK_BUDGET / 1_000_000
        );
        if bytes > PEAK_BUDGET {
            over.push("compile hm-allreduce 1024x8 peak memory");
        }
    }
    if !over.is_empty() {
        eprintln!("over budget: {}", over.join("; "));
        std::process::exit(1);
    }
}
