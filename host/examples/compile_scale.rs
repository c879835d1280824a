//! Compiles a built-in algorithm the way `oxccl plan` does (rank plans streamed and dropped) and
//! prints the pass times: `cargo run -p oxccl-host --release --example compile_scale -- hm-allreduce 1024 8`.
//! The program is generated on demand ([`Algorithm::source`]); with a fourth argument `stored` it
//! is generated into a [`Program`](oxccl_host::program::Program) first, as the CLI does today.

use oxccl_host::compile::{self, Options, Plan};
use oxccl_host::program::generators::Algorithm;
use std::time::Instant;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let algo: Algorithm = args.get(1).map_or("hm-allreduce", |s| s.as_str()).parse().unwrap();
    let nodes: u32 = args.get(2).map_or(64, |s| s.parse().unwrap());
    let gpus: u32 = args.get(3).map_or(8, |s| s.parse().unwrap());
    let stored = args.get(4).is_some_and(|s| s == "stored");
    let t = Instant::now();
    let result = if stored {
        algo.generate(nodes, gpus)
            .map_err(|e| e.to_string())
            .and_then(|p| compile::compile_streaming(&p, &opts(), &mut drop).map_err(|e| e.to_string()))
    } else {
        algo.source(nodes, gpus)
            .map_err(|e| e.to_string())
            .and_then(|p| compile::compile_streaming(&p, &opts(), &mut drop).map_err(|e| e.to_string()))
    };
    match result {
        Ok(plan) => report(&plan, t),
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(2);
        }
    }
}

fn report(plan: &Plan, t: Instant) {
    for (name, ms) in &plan.stats.pass_ms {
        eprintln!("  {name}: {:.2} s", ms / 1e3);
    }
    eprintln!(
        "total {:.2} s: {} ops, {} tasks, {} sub-pipelines, {} sync points, max {} TBs per rank",
        t.elapsed().as_secs_f64(),
        plan.stats.ops,
        plan.stats.tasks,
        plan.stats.subpipelines,
        plan.stats.sync_points,
        plan.stats.max_tbs_per_rank
    );
}

/// The default options; `OXCCL_NO_VERIFY=1` turns the verifiers off (to time the passes alone).
fn opts() -> Options {
    Options { verify: std::env::var_os("OXCCL_NO_VERIFY").is_none(), ..Options::default() }
}
