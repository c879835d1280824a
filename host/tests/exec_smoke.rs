use oxccl_host::compile::{Options, Scheduler, TbAlloc, compile};
use oxccl_host::exec::{ExecOptions, ReduceOp, verify};
use oxccl_host::program::generators::Algorithm;

#[test]
fn smoke() {
    for algo in Algorithm::ALL {
        for (n, g) in [(1, 4), (2, 2), (2, 4), (3, 2), (4, 2)] {
            let p = algo.generate(n, g).unwrap();
            p.check().unwrap_or_else(|e| panic!("{algo} {n}x{g}: {e}"));
            for s in Scheduler::ALL {
                for a in TbAlloc::ALL {
                    let plan = compile(&p, &Options::new(s, a))
                        .unwrap_or_else(|e| panic!("{algo} {n}x{g} {s} {a}: {e}"));
                    let opts = ExecOptions {
                        micro_batches: 3,
                        fifo_slots: plan.stats.fifo_slots_needed.max(1),
                    };
                    let rep = verify::<f32>(&plan, ReduceOp::Sum, 5, &opts)
                        .unwrap_or_else(|e| panic!("{algo} {n}x{g} {s} {a}: {e}"));
                    assert_eq!(rep.wrong, 0, "{algo} {n}x{g} {s} {a}");
                    println!(
                        "{algo} {n}x{g} {s} {a}: tbs {} sps {}",
                        plan.stats.max_tbs_per_rank, plan.subpipelines
                    );
                }
            }
        }
    }
}
