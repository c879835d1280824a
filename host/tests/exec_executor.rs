//! The CPU executor and the collectives' references.

mod common;

use common::random_program;
use oxccl_host::compile::{Options, Plan, Prim, Scheduler, TbAlloc, TbPlan, compile};
use oxccl_host::exec::reference::{all_gather, all_reduce, all_to_all, reduce_scatter};
use oxccl_host::exec::{Element, ExecError, ExecOptions, ReduceOp, execute, micro_batch_range, test_inputs, verify};
use oxccl_host::program::InstanceChannels;
use oxccl_host::program::generators::Algorithm;
use proptest::prelude::*;

#[test]
fn references() {
    let x = vec![vec![1i32, 2, 3, 4], vec![10, 20, 30, 40]];
    assert_eq!(all_reduce(&x, ReduceOp::Sum).unwrap(), vec![vec![11, 22, 33, 44]; 2]);
    assert_eq!(all_reduce(&x, ReduceOp::Max).unwrap()[0], vec![10, 20, 30, 40]);
    assert_eq!(all_reduce(&x, ReduceOp::Min).unwrap()[1], vec![1, 2, 3, 4]);
    assert_eq!(all_gather(&x).unwrap()[1], vec![1, 2, 3, 4, 10, 20, 30, 40]);
    assert_eq!(reduce_scatter(&x, ReduceOp::Sum).unwrap(), vec![vec![11, 22], vec![33, 44]]);
    assert_eq!(all_to_all(&x).unwrap(), vec![vec![1, 2, 10, 20], vec![3, 4, 30, 40]]);
    let f = vec![vec![0.5f32, 1.5], vec![2.0, -1.0]];
    assert_eq!(all_reduce(&f, ReduceOp::Sum).unwrap()[0], vec![2.5, 0.5]);
    assert!(reduce_scatter(&[vec![1i32; 3], vec![1i32; 3]], ReduceOp::Sum).is_err());
    assert!(all_reduce(&[vec![1i32; 3], vec![1; 2]], ReduceOp::Sum).is_err());
}

/// `Element::reduce` by hand for Min and Max of every float width and of u32 (Sum of u32 too).
/// Floats take Rust's `min`/`max`, the device's rule (`RedOp` docs): a NaN operand yields the other
/// operand, two NaNs a NaN. For 0.0 against -0.0 neither defines the sign (Rust leaves it
/// unspecified), so only the value is pinned.
#[test]
fn element_reduce_min_max_by_hand() {
    use ReduceOp::{Max, Min, Sum};
    macro_rules! floats {
        ($t:ty) => {{
            let r = |a: $t, b: $t, op| Element::reduce(a, b, op);
            assert_eq!(r(-3.5, 2.0, Min), -3.5);
            assert_eq!(r(2.0, -3.5, Min), -3.5);
            assert_eq!(r(-3.5, 2.0, Max), 2.0);
            assert_eq!(r(-7.0, -0.25, Max), -0.25);
            assert_eq!(r(-7.0, -0.25, Min), -7.0);
            assert_eq!(r(<$t>::NEG_INFINITY, -1e30, Min), <$t>::NEG_INFINITY);
            assert_eq!(r(<$t>::INFINITY, 1e30, Max), <$t>::INFINITY);
            for op in [Min, Max] {
                assert_eq!(r(<$t>::NAN, 1.5, op), 1.5, "{op:?}");
                assert_eq!(r(-1.5, <$t>::NAN, op), -1.5, "{op:?}");
                assert!(r(<$t>::NAN, <$t>::NAN, op).is_nan(), "{op:?}");
                assert_eq!(r(0.0, -0.0, op), 0.0, "{op:?}");
                assert_eq!(r(-0.0, 0.0, op), 0.0, "{op:?}");
            }
            // A NaN propagates through a sum.
            assert!(r(<$t>::NAN, 1.0, Sum).is_nan());
        }};
    }
    floats!(f32);
    floats!(f64);
    let r = |a: u32, b: u32, op| Element::reduce(a, b, op);
    // Unsigned order: values at and above 2^31 (negative as i32) are the largest.
    assert_eq!(r(u32::MAX, 1, Min), 1);
    assert_eq!(r(1, u32::MAX, Max), u32::MAX);
    assert_eq!(r(0x8000_0000, 0x7FFF_FFFF, Max), 0x8000_0000);
    assert_eq!(r(0x8000_0000, 0x7FFF_FFFF, Min), 0x7FFF_FFFF);
    assert_eq!(r(0, 5, Min), 0);
    assert_eq!(r(u32::MAX, 2, Sum), 1, "sums wrap");
    // i32 against the same bits: signed order.
    let s = |a: i32, b: i32, op| Element::reduce(a, b, op);
    assert_eq!(s(-1, 1, Min), -1);
    assert_eq!(s(i32::MIN, i32::MAX, Max), i32::MAX);
    assert_eq!(s(i32::MAX, 1, Sum), i32::MIN, "sums wrap");
    // The byte-wide integers: u8 unsigned, i8 signed on the same bits; sums and products wrap.
    let b = |a: u8, b: u8, op| Element::reduce(a, b, op);
    assert_eq!(b(0x80, 0x7F, Max), 0x80);
    assert_eq!(b(200, 100, Sum), 44, "sums wrap");
    assert_eq!(b(16, 17, ReduceOp::Prod), 16, "products wrap");
    let c = |a: i8, b: i8, op| Element::reduce(a, b, op);
    assert_eq!(c(-128, 127, Max), 127);
    assert_eq!(c(-128, 127, Min), -128);
    assert_eq!(c(100, 100, Sum), -56, "sums wrap");
    assert_eq!(c(-1, 5, ReduceOp::Avg), 4, "Avg combines as Sum");
}

#[test]
fn micro_batches_cover_each_chunk_once() {
    for len in 0..20 {
        for m in 1..6 {
            let mut next = 0;
            for b in 0..m {
                let r = micro_batch_range(len, m, b);
                assert_eq!(r.start, next);
                next = r.end;
            }
            assert_eq!(next, len);
        }
    }
}

#[test]
fn every_generator_every_configuration() {
    for algo in Algorithm::ALL {
        for (n, g) in [(1, 4), (2, 2), (2, 3), (3, 2)] {
            let p = algo.generate(n, g).unwrap();
            for s in Scheduler::ALL {
                for a in TbAlloc::ALL {
                    let plan = compile(&p, &Options::new(s, a)).unwrap();
                    for (dtype, op) in [("f32", ReduceOp::Sum), ("i32", ReduceOp::Max)] {
                        let opts = ExecOptions { micro_batches: 3, fifo_slots: plan.stats.fifo_slots_needed.max(1) };
                        let r = if dtype == "f32" {
                            verify::<f32>(&plan, op, 5, &opts)
                        } else {
                            verify::<i32>(&plan, op, 5, &opts)
                        }
                        .unwrap_or_else(|e| panic!("{algo} {n}x{g} {s} {a}: {e}"));
                        assert_eq!(r.wrong, 0, "{algo} {n}x{g} {s} {a} {dtype}");
                    }
                }
            }
        }
    }
}

fn exchange_plan() -> Plan {
    // r0 -> r1 and r1 -> r0, each rank with a send TB and a receive TB.
    let p = Algorithm::DirectAllGather.generate(1, 2).unwrap();
    compile(&p, &Options::default()).unwrap()
}

#[test]
fn receive_before_send_on_one_tb_deadlocks() {
    let mut plan = exchange_plan();
    for rp in &mut plan.ranks {
        let mut tasks: Vec<_> = rp.tbs.iter().flat_map(|tb| tb.tasks.iter().copied()).collect();
        tasks.sort_by_key(|t| t.prim == Prim::Send);
        for t in &mut tasks {
            t.wait_start = 0;
            t.wait_count = 0;
            t.subpipeline = 0;
        }
        rp.tbs = vec![TbPlan { tasks, syncs: Vec::new() }];
    }
    let inputs = test_inputs::<f32>(2, 4);
    match execute(&plan, &inputs, ReduceOp::Sum, &ExecOptions::default()) {
        Err(ExecError::Deadlock { blocked }) => {
            assert_eq!(blocked.len(), 2);
            assert!(blocked.iter().all(|b| b.prim == Prim::Recv && b.reason.contains("empty")));
        }
        other => panic!("expected a deadlock, got {other:?}"),
    }
    let e = execute(&plan, &inputs, ReduceOp::Sum, &ExecOptions::default()).unwrap_err();
    assert!(e.to_string().contains("deadlock"), "{e}");
}

#[test]
fn fifo_order_mismatch_and_lost_messages_are_errors() {
    // Two chunks from r0 to r1 on one connection, in one sub-pipeline.
    let p = Algorithm::DirectAllGather.generate(1, 2).unwrap().instanced(2).unwrap();
    let plan = compile(&p, &Options::new(Scheduler::Algorithm, TbAlloc::State)).unwrap();
    let inputs = test_inputs::<i32>(2, 4);
    let mut swapped = plan.clone();
    let tb = swapped.ranks[1].tbs.iter_mut().find(|tb| tb.tasks.iter().all(|t| t.prim == Prim::Recv)).unwrap();
    tb.tasks.swap(0, 1);
    let e = execute(&swapped, &inputs, ReduceOp::Sum, &ExecOptions::default()).unwrap_err();
    assert!(matches!(e, ExecError::FifoOrder { .. }), "{e}");

    let mut lost = plan.clone();
    let tb = lost.ranks[1].tbs.iter_mut().find(|tb| tb.tasks.iter().all(|t| t.prim == Prim::Recv)).unwrap();
    tb.tasks.pop();
    // One micro-batch: the second message is never taken.
    let one = ExecOptions { micro_batches: 1, fifo_slots: 8 };
    let e = execute(&lost, &inputs, ReduceOp::Sum, &one).unwrap_err();
    assert!(matches!(e, ExecError::Unconsumed { messages: 1, .. }), "{e}");
    // Several: the next micro-batch's receive finds the missing task's message first.
    let e = execute(&lost, &inputs, ReduceOp::Sum, &ExecOptions::default()).unwrap_err();
    assert!(matches!(e, ExecError::FifoOrder { .. }), "{e}");
}

#[test]
fn malformed_plans_are_errors_not_panics() {
    let inputs = test_inputs::<f32>(2, 4);
    let opts = ExecOptions::default();
    let mut p = exchange_plan();
    p.ranks[0].tbs[0].tasks[0].conn = None;
    assert!(matches!(execute(&p, &inputs, ReduceOp::Sum, &opts), Err(ExecError::BadPlan { .. })));
    let mut p = exchange_plan();
    p.ranks[1].tbs[0].tasks[0].wait_count = 3;
    assert!(matches!(execute(&p, &inputs, ReduceOp::Sum, &opts), Err(ExecError::BadPlan { .. })));
    let mut p = exchange_plan();
    for tb in &mut p.ranks[0].tbs {
        for t in &mut tb.tasks {
            t.src = t.src.map(|s| oxccl_host::program::Slice { offset: 9, ..s });
            t.dst = t.dst.map(|s| oxccl_host::program::Slice { offset: 9, ..s });
        }
    }
    let e = execute(&p, &inputs, ReduceOp::Sum, &opts).unwrap_err();
    assert!(e.to_string().contains("out of range"), "{e}");
}

#[test]
fn bad_inputs() {
    let plan = exchange_plan();
    let opts = ExecOptions::default();
    assert!(matches!(execute(&plan, &test_inputs::<f32>(3, 4), ReduceOp::Sum, &opts), Err(ExecError::BadInput { .. })));
    assert!(matches!(
        execute(&plan, &[vec![1.0f32; 3], vec![1.0; 4]], ReduceOp::Sum, &opts),
        Err(ExecError::BadInput { .. })
    ));
    let zero = ExecOptions { micro_batches: 0, fifo_slots: 1 };
    assert!(matches!(execute(&plan, &test_inputs::<f32>(2, 4), ReduceOp::Sum, &zero), Err(ExecError::BadInput { .. })));
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 160, .. ProptestConfig::default() })]

    /// Any valid program, compiled with any scheduler and allocator, computes exactly what the
    /// collective's CPU reference computes, for any micro-batch count and enough FIFO slots.
    #[test]
    fn any_program_any_configuration_matches_the_reference(
        seed in any::<u64>(),
        coll in 0usize..common::COLLECTIVES,
        ranks in 2u32..17,
        k in 1u32..3,
        ch in 1u32..3,
        per_node in 1u32..4,
        sched in 0usize..4,
        alloc in 0usize..2,
        mbs in 1u32..5,
        extra_slots in 0u32..3,
        len in 1usize..6,
        kind in 0usize..5,
        op in 0usize..3,
        instances in 1u32..4,
        separate in any::<bool>(),
    ) {
        let c = common::nth_collective(coll, seed, ranks);
        let mut p = random_program(seed, c, ranks, k, ch);
        p.ranks_per_node = Some(per_node);
        // Instances on the program's channels or on channels of their own compute the same.
        let channels = if separate { InstanceChannels::Separate } else { InstanceChannels::Shared };
        let p = p.instanced_on(instances, channels).unwrap();
        let opts = Options::new(Scheduler::ALL[sched], TbAlloc::ALL[alloc]);
        let plan = compile(&p, &opts).unwrap();
        let eo = ExecOptions { micro_batches: mbs, fifo_slots: plan.stats.fifo_slots_needed.max(1) + extra_slots };
        let op = [ReduceOp::Sum, ReduceOp::Min, ReduceOp::Max][op];
        // Inputs are integers of at most 17: sums over the ranks stay exact in f16 (integers to
        // 2048) and, up to 15 ranks, in bf16 (integers to 256); with more ranks the bf16 case runs
        // in f16.
        let kind = if kind == 4 && ranks > 15 { 3 } else { kind };
        let r = match kind {
            0 => verify::<f32>(&plan, op, len, &eo),
            1 => verify::<i32>(&plan, op, len, &eo),
            2 => verify::<f64>(&plan, op, len, &eo),
            3 => verify::<half::f16>(&plan, op, len, &eo),
            _ => verify::<half::bf16>(&plan, op, len, &eo),
        };
        prop_assert!(r.is_ok(), "{:?}", r);
        prop_assert_eq!(r.unwrap().wrong, 0);
    }
}
