//! Property tests: any valid program, compiled any way and lowered in either mode, round-trips
//! through the descriptors and computes exactly the collective's reference on the CPU executor of
//! the lowered descriptors, for any micro-batch count, enough FIFO slots and any scheduling quantum.

mod common;

use common::random_program;
use oxccl_host::compile::lower::{LowerOptions, PlanView, decode, lower};
use oxccl_host::compile::{Options, Scheduler, TbAlloc, compile};
use oxccl_host::exec::ReduceOp;
use oxccl_host::exec::lowered::{AbiElement, LaunchOptions, red_op, verify};
use oxccl_host::program::{Collective, InstanceChannels};
use oxccl_kernels::abi::PlanMode;
use proptest::prelude::*;

fn opts<T: AbiElement>(mode: PlanMode, mbs: u32, mb_elems: u64, slots: u32, op: ReduceOp) -> LowerOptions {
    LowerOptions {
        mode,
        micro_batches: mbs,
        chunk_bytes: mbs as u64 * mb_elems * std::mem::size_of::<T>() as u64,
        fifo_slots: slots,
        dtype: T::DTYPE,
        op: red_op(op),
        timing: false,
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 160, .. ProptestConfig::default() })]

    #[test]
    fn any_program_lowered_matches_the_reference(
        seed in any::<u64>(),
        coll in 0usize..4,
        ranks in 2u32..17,
        k in 1u32..3,
        ch in 1u32..3,
        per_node in 1u32..4,
        sched in 0usize..4,
        alloc in 0usize..2,
        interpreted in any::<bool>(),
        mbs in 1u32..5,
        mb_vecs in 1u64..3,
        extra_slots in 0u32..3,
        quantum in 1u32..4,
        launches in 1u32..3,
        kind in 0usize..3,
        op in 0usize..3,
        instances in 1u32..4,
        separate in any::<bool>(),
    ) {
        let c = [Collective::AllReduce, Collective::AllGather, Collective::ReduceScatter, Collective::AllToAll][coll];
        let mut p = random_program(seed, c, ranks, k, ch);
        p.ranks_per_node = Some(per_node);
        let channels = if separate { InstanceChannels::Separate } else { InstanceChannels::Shared };
        let p = p.instanced_on(instances, channels).unwrap();
        let plan = compile(&p, &Options::new(Scheduler::ALL[sched], TbAlloc::ALL[alloc])).unwrap();
        let op = [ReduceOp::Sum, ReduceOp::Min, ReduceOp::Max][op];
        let mode = if interpreted { PlanMode::Interpreted } else { PlanMode::Compiled };
        let lo = ReduceOp::Sum;
        let needed = lower(&plan, &opts::<f32>(mode, mbs, 4, 1, lo)).unwrap().slots_needed.max(1);
        let slots = needed + extra_slots;
        let lp = lower(&plan, &opts::<f32>(mode, mbs, 4, slots, lo)).unwrap();
        prop_assert_eq!(decode(&lp).unwrap(), PlanView::of_plan(&plan, mode, mbs));
        let eo = LaunchOptions { quantum };
        // 16-byte micro-batches: 4 elements of 4 bytes per vector.
        let r = match kind {
            0 => verify::<f32>(&lower(&plan, &opts::<f32>(mode, mbs, 4 * mb_vecs, slots, op)).unwrap(), op, launches, &eo),
            1 => verify::<i32>(&lower(&plan, &opts::<i32>(mode, mbs, 4 * mb_vecs, slots, op)).unwrap(), op, launches, &eo),
            _ => verify::<u32>(&lower(&plan, &opts::<u32>(mode, mbs, 4 * mb_vecs, slots, op)).unwrap(), op, launches, &eo),
        };
        prop_assert!(r.is_ok(), "{:?}", r);
        prop_assert_eq!(r.unwrap().wrong, 0);
    }
}
