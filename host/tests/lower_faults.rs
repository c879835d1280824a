//! Broken plans on the CPU executor of lowered descriptors: deadlocks, FIFO disorder, lost
//! messages, stale workspaces and corrupt descriptors are typed errors, never hangs or panics;
//! replays and accounting.

use oxccl_host::compile::lower::{LowerOptions, LoweredPlan, lower};
use oxccl_host::compile::{Options, Plan, Prim, Scheduler, TbAlloc, TbId, TbPlan, compile};
use oxccl_host::exec::ReduceOp;
use oxccl_host::exec::lowered::{LaunchOptions, LoweredExecError, Memory, launch, verify};
use oxccl_host::exec::test_inputs;
use oxccl_host::program::generators::Algorithm;
use oxccl_kernels::abi::{FIFO_REGION_OFFSET, PlanMode};

fn lowered(plan: &Plan, mode: PlanMode, micro_batches: u32, slots: u32) -> LoweredPlan {
    let opts = LowerOptions {
        mode,
        micro_batches,
        chunk_bytes: micro_batches as u64 * 32,
        fifo_slots: slots,
        ..LowerOptions::default()
    };
    lower(plan, &opts).unwrap()
}

/// Loads test inputs and launches once; corrupt descriptors are refused by the load already.
fn run(lp: &LoweredPlan) -> Result<Memory, LoweredExecError> {
    let mut mem = Memory::new(lp);
    let ic = lp.layout.input_chunks() as usize;
    let chunk = lp.ranks[0].header.chunk_bytes as usize / 4;
    mem.load_inputs(lp, &test_inputs::<f32>(lp.ranks.len(), ic * chunk))?;
    launch(lp, &mut mem, &LaunchOptions::default())?;
    Ok(mem)
}

/// Removes task `i` of `rank`'s TB `tb` from a plan, renumbering the sync points that follow it and
/// dropping those on it.
fn drop_task(plan: &mut Plan, rank: usize, tb: usize, i: usize) {
    let rp = &mut plan.ranks[rank];
    // Every TB's waits as explicit lists, renumbered.
    let mut waits: Vec<Vec<Vec<oxccl_host::compile::SyncPoint>>> =
        rp.tbs.iter().map(|t| (0..t.tasks.len()).map(|k| t.waits(k).to_vec()).collect()).collect();
    waits[tb].remove(i);
    rp.tbs[tb].tasks.remove(i);
    for w in waits.iter_mut().flatten() {
        w.retain(|s| !(s.tb == TbId::new(tb) && s.task as usize == i));
        for s in w.iter_mut().filter(|s| s.tb == TbId::new(tb) && s.task as usize > i) {
            s.task -= 1;
        }
    }
    for (t, tbp) in rp.tbs.iter_mut().enumerate() {
        tbp.syncs.clear();
        for (k, task) in tbp.tasks.iter_mut().enumerate() {
            task.wait_start = tbp.syncs.len() as u32;
            task.wait_count = waits[t][k].len() as u32;
            tbp.syncs.extend_from_slice(&waits[t][k]);
        }
    }
}

/// The last task whose primitive is `prim` in the first TB of more than one task that has one.
fn find_last(plan: &Plan, prim: Prim) -> (usize, usize, usize) {
    for (r, rp) in plan.ranks.iter().enumerate() {
        for (t, tb) in rp.tbs.iter().enumerate() {
            if tb.tasks.len() > 1
                && let Some(i) = tb.tasks.iter().rposition(|x| x.prim == prim)
            {
                return (r, t, i);
            }
        }
    }
    panic!("no {prim:?}");
}

#[test]
fn a_dropped_send_deadlocks() {
    // The last send of a TB: its receive waits for a message that never comes. (Compiled, that send
    // is alone in its segment; interpreted with several micro-batches, the receive would take the
    // next micro-batch's message first: a FIFO-order error, tested below.)
    for (mode, s, a, mbs) in [
        (PlanMode::Compiled, Scheduler::Hpds, TbAlloc::State, 1),
        (PlanMode::Compiled, Scheduler::Hpds, TbAlloc::State, 3),
        (PlanMode::Interpreted, Scheduler::Algorithm, TbAlloc::PerConn, 1),
    ] {
        let mut plan = compile(&Algorithm::RingAllReduce.generate(1, 4).unwrap(), &Options::new(s, a)).unwrap();
        let (r, t, i) = find_last(&plan, Prim::Send);
        let op = plan.ranks[r].tbs[t].tasks[i].op;
        drop_task(&mut plan, r, t, i);
        {
            match run(&lowered(&plan, mode, mbs, 4)) {
                Err(LoweredExecError::Deadlock { blocked }) => {
                    assert!(!blocked.is_empty());
                    let recv = blocked.iter().find(|b| b.op == op).expect("the receive of the dropped send is blocked");
                    assert!(recv.reason.contains("empty"), "{recv:?}");
                }
                other => panic!("{mode:?}: expected a deadlock, got {other:?}"),
            }
        }
    }
}

#[test]
fn receive_before_send_on_one_tb_deadlocks() {
    // r0 <-> r1 exchange, each rank on one TB that receives first.
    let mut plan = compile(&Algorithm::DirectAllGather.generate(1, 2).unwrap(), &Options::default()).unwrap();
    for rp in &mut plan.ranks {
        let mut tasks: Vec<_> = rp.tbs.iter().flat_map(|tb| tb.tasks.iter().copied()).collect();
        tasks.sort_by_key(|t| t.prim == Prim::Send);
        for t in &mut tasks {
            (t.wait_start, t.wait_count, t.subpipeline, t.signal) = (0, 0, 0, false);
        }
        rp.tbs = vec![TbPlan { tasks, syncs: Vec::new() }];
    }
    let e = run(&lowered(&plan, PlanMode::Compiled, 2, 8)).unwrap_err();
    let LoweredExecError::Deadlock { blocked } = &e else { panic!("{e}") };
    assert_eq!(blocked.len(), 2);
    assert!(blocked.iter().all(|b| b.prim == Prim::Recv && b.reason.contains("empty")));
    assert!(e.to_string().contains("deadlock"));
}

#[test]
fn too_few_slots_deadlock_enough_do_not() {
    // Two messages per connection per micro-batch, sent before the receiving TB's own sends are
    // received: one TB per rank, sends first, then receives.
    let p = Algorithm::DirectAllGather.generate(1, 2).unwrap().instanced(2).unwrap();
    let mut plan = compile(&p, &Options::new(Scheduler::Algorithm, TbAlloc::State)).unwrap();
    for rp in &mut plan.ranks {
        let mut tasks: Vec<_> = rp.tbs.iter().flat_map(|tb| tb.tasks.iter().copied()).collect();
        tasks.sort_by_key(|t| (t.prim != Prim::Send, t.seq));
        for t in &mut tasks {
            (t.wait_start, t.wait_count, t.subpipeline, t.signal) = (0, 0, 0, false);
        }
        rp.tbs = vec![TbPlan { tasks, syncs: Vec::new() }];
    }
    let lp = lowered(&plan, PlanMode::Compiled, 2, 1);
    assert_eq!(lp.slots_needed, 2);
    assert!(matches!(run(&lp), Err(LoweredExecError::Deadlock { .. })));
    assert!(run(&lowered(&plan, PlanMode::Compiled, 2, 2)).is_ok());
}

#[test]
fn fifo_disorder_and_lost_messages() {
    let p = Algorithm::DirectAllGather.generate(1, 2).unwrap().instanced(2).unwrap();
    let plan = compile(&p, &Options::new(Scheduler::Algorithm, TbAlloc::State)).unwrap();
    let recv_tb =
        |plan: &Plan| plan.ranks[1].tbs.iter().position(|tb| tb.tasks.iter().all(|t| t.prim == Prim::Recv)).unwrap();
    let mut swapped = plan.clone();
    let t = recv_tb(&swapped);
    swapped.ranks[1].tbs[t].tasks.swap(0, 1);
    let e = run(&lowered(&swapped, PlanMode::Compiled, 2, 4)).unwrap_err();
    assert!(matches!(e, LoweredExecError::FifoOrder { .. }), "{e}");

    let mut lost = plan.clone();
    let t = recv_tb(&lost);
    drop_task(&mut lost, 1, t, 1);
    // One micro-batch: the second message is never taken.
    let e = run(&lowered(&lost, PlanMode::Compiled, 1, 4)).unwrap_err();
    assert!(matches!(e, LoweredExecError::Unconsumed { messages: 1, .. }), "{e}");
    // Several: the next micro-batch's receive finds the missing task's message first.
    let e = run(&lowered(&lost, PlanMode::Compiled, 3, 4)).unwrap_err();
    assert!(matches!(e, LoweredExecError::FifoOrder { .. }), "{e}");
}

#[test]
fn corrupt_descriptors_and_memory_are_errors_not_panics() {
    let plan = compile(&Algorithm::RingAllGather.generate(1, 3).unwrap(), &Options::default()).unwrap();
    let lp = lowered(&plan, PlanMode::Compiled, 2, 2);
    let mut bad = lp.clone();
    bad.ranks[0].tasks[0].kind = 99;
    assert!(matches!(run(&bad), Err(LoweredExecError::Descriptor(_))));
    let mut mem = Memory::new(&lp);
    mem.workspaces[1].pop();
    assert!(matches!(launch(&lp, &mut mem, &LaunchOptions::default()), Err(LoweredExecError::BadInput { .. })));
    let mut mem = Memory::new(&lp);
    assert!(matches!(launch(&lp, &mut mem, &LaunchOptions { quantum: 0 }), Err(LoweredExecError::BadInput { .. })));
    // A progress counter left midway by a failed launch.
    let mut mem = Memory::new(&lp);
    let at = (lp.ranks[2].tbs[0].progress_offset - FIFO_REGION_OFFSET as u64) as usize;
    mem.workspaces[2][at] = 1;
    let e = launch(&lp, &mut mem, &LaunchOptions::default()).unwrap_err();
    assert!(matches!(e, LoweredExecError::StaleWorkspace { .. }), "{e}");
    // Wrong element type for the plan.
    assert!(matches!(
        verify::<i32>(&lp, ReduceOp::Sum, 1, &LaunchOptions::default()),
        Err(LoweredExecError::BadInput { .. })
    ));
}

#[test]
fn counters_carry_over_launches_and_accounts_add_up() {
    let p = Algorithm::HmAllReduce.generate(2, 2).unwrap();
    for (mode, s, a) in [
        (PlanMode::Compiled, Scheduler::Hpds, TbAlloc::State),
        (PlanMode::Interpreted, Scheduler::Algorithm, TbAlloc::PerConn),
    ] {
        let plan = compile(&p, &Options::new(s, a)).unwrap();
        let lp = lowered(&plan, mode, 3, 2);
        let mut mem = Memory::new(&lp);
        let ic = lp.layout.input_chunks() as usize;
        for k in 1..=3u64 {
            mem.load_inputs(&lp, &test_inputs::<f32>(lp.ranks.len(), ic * 24)).unwrap();
            let rep = launch(&lp, &mut mem, &LaunchOptions { quantum: 2 }).unwrap();
            for (r, lr) in lp.ranks.iter().enumerate() {
                let ws = &mem.workspaces[r];
                let read = |off: u64| {
                    let at = (off - FIFO_REGION_OFFSET as u64) as usize;
                    u64::from_le_bytes(ws[at..at + 8].try_into().unwrap())
                };
                for (t, tb) in lr.tbs.iter().enumerate() {
                    assert_eq!(read(tb.progress_offset), k * tb.steps as u64, "launch {k} r{r} tb{t}");
                    assert_eq!(rep.tbs[r][t].busy, tb.steps as u64);
                    assert!(rep.tbs[r][t].finished_round <= rep.rounds);
                }
                for c in lr.connections.iter().filter(|c| c.receiver as usize == r) {
                    assert_eq!(read(c.head_offset), read(c.tail_offset));
                    assert!(read(c.head_offset) > 0 && read(c.head_offset).is_multiple_of(k));
                }
            }
        }
    }
}

#[test]
fn recv_reduce_copy_out_of_place() {
    // The ABI's recv_reduce_copy is `dst = src ⊕ message`; plans use it in place. Rewrite a lowered
    // plan so r1 reduces its input and r0's message straight into its output.
    let text = "program rrc_out_of_place\n\
                collective allreduce ranks=2 chunks=1 outofplace\n\
                scratch 0 1\n\
                op0 = xfer r0 in[0] -> r1 in[0] rrc ch=0 chunk=0 step=0 stage=0\n\
                op1 = copy r1 in[0] -> out[0] ch=0 chunk=0 step=1 stage=0\n\
                op2 = xfer r1 out[0] -> r0 out[0] recv ch=0 chunk=0 step=2 stage=0\n";
    let p = oxccl_host::program::text::parse(text).unwrap();
    let plan = compile(&p, &Options::default()).unwrap();
    let mut lp = lowered(&plan, PlanMode::Compiled, 2, 2);
    use oxccl_kernels::abi::{FifoKind, slot};
    for t in &mut lp.ranks[1].tasks {
        match FifoKind::from_raw(t.kind).unwrap() {
            FifoKind::RecvReduceCopy => (t.dst_slot, t.dst_chunk) = (slot::OUTPUT, 0),
            // The copy becomes harmless (output to scratch), keeping its place in the order.
            FifoKind::Copy => {
                ((t.src_slot, t.src_chunk), (t.dst_slot, t.dst_chunk)) = ((slot::OUTPUT, 0), (slot::SCRATCH, 0))
            }
            _ => {}
        }
    }
    let mut mem = Memory::new(&lp);
    let inputs = test_inputs::<f32>(2, 16);
    mem.load_inputs(&lp, &inputs).unwrap();
    launch(&lp, &mut mem, &LaunchOptions::default()).unwrap();
    let want = oxccl_host::exec::reference::all_reduce(&inputs, ReduceOp::Sum).unwrap();
    assert_eq!(mem.outputs::<f32>(&lp).unwrap(), want);
    // r1's input is untouched.
    assert_eq!(mem.buffers[1][slot::INPUT as usize], bytemuck::cast_slice::<f32, u8>(&inputs[1]));
}

/// A sync point no task waits on must still name a task that exists: the lowering marks its task
/// as signalling, and a deserialized plan may hold any entry.
#[test]
fn a_sync_point_on_no_task_is_a_bad_plan() {
    let mut plan = compile(&Algorithm::RingAllGather.generate(1, 3).unwrap(), &Options::default()).unwrap();
    let bogus = oxccl_host::compile::SyncPoint { tb: TbId::new(99), task: 0 };
    plan.ranks[0].tbs[0].syncs.push(bogus);
    assert!(plan.check_structure().is_err());
    let opts = LowerOptions { micro_batches: 1, chunk_bytes: 32, ..LowerOptions::default() };
    let e = lower(&plan, &opts).unwrap_err();
    assert!(e.to_string().contains("sync point"), "{e}");
}

/// A FIFO slot whose size passes u64 when rounded up to its alignment is a typed error, not a
/// wrapped 0-byte slot: an AllReduce of one chunk per buffer, so the buffers themselves fit.
#[test]
fn a_fifo_slot_past_u64_is_too_large() {
    let text = "program one_chunk\ncollective allreduce ranks=2 chunks=1 inplace\nscratch 0\n\
                op0 = xfer r0 in[0] -> r1 in[0] rrc ch=0 chunk=0 step=0 stage=0\n\
                op1 = xfer r1 in[0] -> r0 in[0] recv ch=0 chunk=0 step=1 stage=0\n";
    let program = oxccl_host::program::text::parse(text).unwrap_or_else(|e| panic!("{e}"));
    program.check().unwrap_or_else(|e| panic!("{e}"));
    let plan = compile(&program, &Options::default()).unwrap();
    let opts = LowerOptions { micro_batches: 1, chunk_bytes: u64::MAX - 15, ..LowerOptions::default() };
    let e = lower(&plan, &opts).unwrap_err();
    assert!(e.to_string().contains("a FIFO slot is too large"), "{e}");
}
