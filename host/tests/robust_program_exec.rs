//! Bad input to `Program::instanced`, `exec::verify`, `exec::execute`, `sim::simulate` and
//! `Plan::check_structure` gets a typed error, never a panic, an abort or silently dropped data.

use oxccl_host::compile::{Options, Plan, Prim, compile};
use oxccl_host::exec::reference::reduce_scatter;
use oxccl_host::exec::{ExecError, ExecOptions, MAX_VERIFY_ELEMENTS, ReduceOp, execute, test_inputs, verify};
use oxccl_host::program::generators::Algorithm;
use oxccl_host::program::{
    BufferKind, BufferLayout, Collective, OpId, Program, ProgramError, Rank, RecvOp, Slice, text,
};
use oxccl_host::sim::{SimError, SimOptions, Topology, simulate};

/// Parses and verifies a text program.
fn program(t: &str) -> Program {
    let p = text::parse(t).expect("parses");
    p.verify().expect("verifies");
    p
}

/// One transfer `r0 in[..] -> r1 in[..]` of an in-place two-rank AllReduce of two chunks.
fn two_rank_xfer(slices: &str, op: &str, chunk: u64) -> Program {
    program(&format!(
        "program x\ncollective allreduce ranks=2 chunks=2 inplace\nscratch 0\n\
         op0 = xfer r0 in[{slices}] -> r1 in[{slices}] {op} ch=0 chunk={chunk} step=0 stage=0\n"
    ))
}

/// Sets the destination of every receive of `plan` to `dst`.
fn set_recv_dst(plan: &mut Plan, dst: Slice) {
    for tb in plan.ranks.iter_mut().flat_map(|rp| rp.tbs.iter_mut()) {
        for t in tb.tasks.iter_mut().filter(|t| t.prim == Prim::Recv) {
            t.dst = Some(dst);
        }
    }
}

#[test]
fn instanced_chunk_label_overflow_is_an_error() {
    let p = two_rank_xfer("0", "rrc", 4_000_000_000);
    assert_eq!(
        p.instanced(2).unwrap_err(),
        ProgramError::ChunkLabelOverflow { op: OpId(0), chunk: 4_000_000_000, instances: 2 }
    );
    // The largest label that still fits: (2^31 - 1) * 2 + 1 == u32::MAX.
    let p = two_rank_xfer("0", "rrc", (1 << 31) - 1);
    let q = p.instanced(2).unwrap();
    assert_eq!(q.ops.iter().map(|o| o.chunk).collect::<Vec<_>>(), vec![u32::MAX - 1, u32::MAX]);
}

/// Instances on channels of their own: channel c of instance i is c + i × (channels), never wrapped.
#[test]
fn instanced_channel_overflow_is_an_error() {
    use oxccl_host::program::InstanceChannels;
    let on = |ch: u64| {
        program(&format!(
            "program x\ncollective allreduce ranks=2 chunks=2 inplace\nscratch 0\n\
             op0 = xfer r0 in[0] -> r1 in[0] rrc ch={ch} chunk=0 step=0 stage=0\n"
        ))
    };
    // One channel number per instance: (2^31 - 1) + 1 × 2^31 == u32::MAX fits; one more does not.
    let q = on((1 << 31) - 1).instanced_on(2, InstanceChannels::Separate).unwrap();
    assert_eq!(q.ops.iter().map(|o| o.channel()).collect::<Vec<_>>(), vec![(1 << 31) - 1, u32::MAX]);
    match on(1 << 31).instanced_on(2, InstanceChannels::Separate) {
        Err(ProgramError::BadLayout { reason }) => assert!(reason.contains("2^32 channels"), "{reason}"),
        other => panic!("{other:?}"),
    }
    // Shared channels never grow.
    assert!(on(u32::MAX as u64).instanced_on(2, InstanceChannels::Shared).is_ok());
}

#[test]
fn instanced_verifies_its_program_first() {
    let mut p = Program::new("x", BufferLayout::new(Collective::AllReduce, 2, 2, true));
    let bad = Slice::input(u32::MAX);
    p.transfer(0, bad, 1, Slice::input(0), RecvOp::Recv, 0, 0, 0);
    for k in [1, 2] {
        assert_eq!(
            p.instanced(k).unwrap_err(),
            ProgramError::SliceOutOfRange { op: OpId(0), rank: Rank(0), slice: bad, buffer_chunks: 2 },
            "{k} instances"
        );
    }
}

#[test]
fn verify_rejects_zero_chunk_len() {
    let p = Algorithm::RingReduceScatter.generate(1, 2).unwrap();
    let plan = compile(&p, &Options::default()).unwrap();
    let e = verify::<f32>(&plan, ReduceOp::Sum, 0, &ExecOptions::default()).unwrap_err();
    assert!(matches!(&e, ExecError::BadInput { reason } if reason.contains("chunk_len is 0")), "{e}");
    // The reference itself takes empty inputs.
    assert_eq!(reduce_scatter::<f32>(&[vec![], vec![]], ReduceOp::Sum).unwrap(), vec![Vec::<f32>::new(); 2]);
}

#[test]
fn verify_bounds_scratch_storage() {
    for (scratch, chunk_len) in [(16_000_000u64, 1usize << 20), (4096, 1 << 20), (256, 1 << 20)] {
        let p = program(&format!(
            "program x\ncollective allreduce ranks=1 chunks=1 outofplace\nscratch {scratch}\n\
             op0 = copy r0 in[0] -> out[0] ch=0 chunk=0 step=0 stage=0\n"
        ));
        let plan = compile(&p, &Options::default()).unwrap();
        // Input and output are two chunks; scratch makes the rest.
        assert!((2 + scratch as usize) * chunk_len > MAX_VERIFY_ELEMENTS);
        let e = verify::<f32>(&plan, ReduceOp::Sum, chunk_len, &ExecOptions::default()).unwrap_err();
        assert!(matches!(&e, ExecError::BadInput { reason } if reason.contains("storage chunks")), "{e}");
    }
    // Four storage chunks: one element past the bound is refused, a small size runs.
    let p = program(
        "program x\ncollective allreduce ranks=1 chunks=1 outofplace\nscratch 2\n\
         op0 = copy r0 in[0] -> out[0] ch=0 chunk=0 step=0 stage=0\n",
    );
    let plan = compile(&p, &Options::default()).unwrap();
    let e = verify::<f32>(&plan, ReduceOp::Sum, MAX_VERIFY_ELEMENTS / 4 + 1, &ExecOptions::default()).unwrap_err();
    assert!(matches!(&e, ExecError::BadInput { reason } if reason.contains("4 storage chunks")), "{e}");
    let r = verify::<f32>(&plan, ReduceOp::Sum, 64, &ExecOptions::default()).unwrap();
    assert_eq!((r.checked, r.wrong), (64, 0));
}

#[test]
fn receive_larger_than_its_message_is_a_bad_plan() {
    let p = two_rank_xfer("0", "recv", 0);
    let mut plan = compile(&p, &Options::default()).unwrap();
    set_recv_dst(&mut plan, Slice::new(BufferKind::Input, 0, 2));
    let e = plan.check_structure().unwrap_err();
    assert!(e.contains("receives 2 chunks") && e.contains("pushes 1"), "{e}");
    let inputs = test_inputs::<f32>(2, 8);
    let e = execute(&plan, &inputs, ReduceOp::Sum, &ExecOptions::default()).unwrap_err();
    assert!(matches!(&e, ExecError::BadPlan { reason } if reason.contains("receives 2 chunks")), "{e}");
}

#[test]
fn receive_smaller_than_its_message_is_a_bad_plan() {
    let p = two_rank_xfer("0..2", "recv", 0);
    let mut plan = compile(&p, &Options::default()).unwrap();
    set_recv_dst(&mut plan, Slice::new(BufferKind::Input, 1, 1));
    let e = plan.check_structure().unwrap_err();
    assert!(e.contains("receives 1 chunks") && e.contains("pushes 2"), "{e}");
    let inputs = test_inputs::<f32>(2, 8);
    let e = execute(&plan, &inputs, ReduceOp::Sum, &ExecOptions::default()).unwrap_err();
    assert!(matches!(&e, ExecError::BadPlan { reason } if reason.contains("receives 1 chunks")), "{e}");
}

/// Two sends of one op on one connection, of 1 and 2 chunks, and two 2-chunk receives: the
/// structure check keys sends by (connection, op), so the executor's own size check must catch it.
#[test]
fn executor_checks_each_message_size() {
    let p = two_rank_xfer("0..2", "recv", 0);
    let mut plan = compile(&p, &Options::default()).unwrap();
    for tb in plan.ranks.iter_mut().flat_map(|rp| rp.tbs.iter_mut()) {
        if let Some(i) = tb.tasks.iter().position(|t| t.prim.is_comm()) {
            let mut first = tb.tasks[i];
            if first.prim == Prim::Send {
                first.src = Some(Slice::new(BufferKind::Input, 0, 1));
            }
            tb.tasks.insert(i, first);
        }
    }
    plan.check_structure().unwrap();
    let inputs = test_inputs::<f32>(2, 8);
    let e = execute(&plan, &inputs, ReduceOp::Sum, &ExecOptions::default()).unwrap_err();
    assert!(matches!(&e, ExecError::BadPlan { reason } if reason.contains("the data has")), "{e}");
}

#[test]
fn connection_to_a_missing_rank_is_a_bad_plan() {
    let p = two_rank_xfer("0", "recv", 0);
    let mut plan = compile(&p, &Options::default()).unwrap();
    let mut c = plan.connections[0];
    c.src = Rank(99);
    plan.connections.push(c);
    let e = plan.check_structure().unwrap_err();
    assert!(e.contains("r99 -> r1") && e.contains("outside the 2 ranks"), "{e}");
    let inputs = test_inputs::<f32>(2, 8);
    let e = execute(&plan, &inputs, ReduceOp::Sum, &ExecOptions::default()).unwrap_err();
    assert!(matches!(&e, ExecError::BadPlan { reason } if reason.contains("r99")), "{e}");
}

#[test]
fn a_rank_plan_at_another_rank_s_index_is_a_bad_plan() {
    let p = two_rank_xfer("0", "recv", 0);
    let mut plan = compile(&p, &Options::default()).unwrap();
    plan.check_structure().unwrap();
    plan.ranks.swap(0, 1);
    let e = plan.check_structure().unwrap_err();
    assert!(e.contains("the rank plan at index 0 says it is r1"), "{e}");
    let inputs = test_inputs::<f32>(2, 8);
    let e = execute(&plan, &inputs, ReduceOp::Sum, &ExecOptions::default()).unwrap_err();
    assert!(matches!(&e, ExecError::BadPlan { reason } if reason.contains("says it is r1")), "{e}");
}

/// `simulate` on one node of two GPUs, the report dropped.
fn simulate_two(plan: &Plan) -> Result<(), SimError> {
    let opts =
        SimOptions { bytes: 1 << 20, micro_batches: 2, fifo_slots: 8, timeline: false, subpipeline_barrier: false };
    simulate(plan, &Topology::h200(1, 2), &opts).map(|_| ())
}

fn bad_sim_plan(e: &SimError, says: &str) -> bool {
    matches!(e, SimError::BadInput { reason } if reason.contains("malformed plan") && reason.contains(says))
}

/// The simulator sizes a table by `subpipelines` and indexes it by each task's sub-pipeline.
#[test]
fn a_task_past_the_plan_s_subpipelines_is_a_bad_plan() {
    let p = two_rank_xfer("0", "recv", 0);
    let mut plan = compile(&p, &Options::default()).unwrap();
    assert_eq!(plan.subpipelines, 1);
    simulate_two(&plan).unwrap();
    plan.subpipelines = 0;
    let e = plan.check_structure().unwrap_err();
    assert!(e.contains("sub-pipeline 0 is not below the plan's 0 sub-pipelines"), "{e}");
    let e = simulate_two(&plan).unwrap_err();
    assert!(bad_sim_plan(&e, "sub-pipeline 0 is not below"), "{e}");
    let inputs = test_inputs::<f32>(2, 8);
    let e = execute(&plan, &inputs, ReduceOp::Sum, &ExecOptions::default()).unwrap_err();
    assert!(matches!(&e, ExecError::BadPlan { reason } if reason.contains("sub-pipeline 0")), "{e}");

    // A task in a sub-pipeline past the count, the count unchanged.
    let mut plan = compile(&p, &Options::default()).unwrap();
    plan.ranks[1].tbs[0].tasks[0].subpipeline = 7;
    let e = simulate_two(&plan).unwrap_err();
    assert!(bad_sim_plan(&e, "sub-pipeline 7 is not below the plan's 1 sub-pipelines"), "{e}");
}

/// A count of sub-pipelines past the tasks would size the simulator's table by it (32 GiB at
/// `u32::MAX`) before anything ran.
#[test]
fn more_subpipelines_than_tasks_is_a_bad_plan() {
    let p = two_rank_xfer("0", "recv", 0);
    let mut plan = compile(&p, &Options::default()).unwrap();
    plan.subpipelines = 2;
    plan.check_structure().unwrap();
    for n in [3, u32::MAX] {
        plan.subpipelines = n;
        let e = plan.check_structure().unwrap_err();
        assert_eq!(e, format!("{n} sub-pipelines for 2 tasks: an empty sub-pipeline is not a plan's"));
        let e = simulate_two(&plan).unwrap_err();
        assert!(bad_sim_plan(&e, &format!("{n} sub-pipelines for 2 tasks")), "{e}");
    }
    // Without tasks, one sub-pipeline is still a plan's; two are not.
    let mut plan =
        compile(&Program::new("x", BufferLayout::new(Collective::AllReduce, 2, 2, true)), &Options::default()).unwrap();
    for (n, ok) in [(0, true), (1, true), (2, false)] {
        plan.subpipelines = n;
        assert_eq!(plan.check_structure().is_ok(), ok, "{n} sub-pipelines");
    }
}

/// The executor reduces a `recv_reduce_copy`'s message into `dst`; a plan whose `src` differs would
/// read one place and write another, so it is refused.
#[test]
fn a_recv_reduce_copy_whose_source_is_not_its_destination_is_a_bad_plan() {
    let p = two_rank_xfer("0", "rrc", 0);
    let mut plan = compile(&p, &Options::default()).unwrap();
    let task = plan.ranks[1].tbs[0].tasks.iter_mut().find(|t| t.prim == Prim::RecvReduceCopy).unwrap();
    assert_eq!(task.src, task.dst);
    task.src = Some(Slice::input(1));
    let e = plan.check_structure().unwrap_err();
    assert!(e.contains("recv_reduce_copy reads in[1] but reduces into in[0]"), "{e}");
    let inputs = test_inputs::<f32>(2, 8);
    let e = execute(&plan, &inputs, ReduceOp::Sum, &ExecOptions::default()).unwrap_err();
    assert!(matches!(&e, ExecError::BadPlan { reason } if reason.contains("reads in[1]")), "{e}");
    let e = simulate_two(&plan).unwrap_err();
    assert!(bad_sim_plan(&e, "reads in[1]"), "{e}");
}
