//! Hostile input to the lowered-plan APIs: counts that overflow 32 or 64 bits, chunks too large for
//! the host, stale FIFO and progress counters are typed errors, never panics (debug or release) or
//! misleading reports; the race check of lowered programs keeps its semantics.

use oxccl_host::compile::lower::{LowerError, LowerOptions, LoweredPlan, lower, validate};
use oxccl_host::compile::{Options, Scheduler, TbAlloc, compile};
use oxccl_host::exec::ReduceOp;
use oxccl_host::exec::lowered::{LaunchOptions, LoweredExecError, MAX_MEMORY_BYTES, Memory, launch, verify};
use oxccl_host::program::{Program, Rank, text};
use oxccl_kernels::abi::FIFO_REGION_OFFSET;

fn program(t: &str) -> Program {
    let p = text::parse(t).expect("parse");
    p.verify().expect("verify");
    p
}

/// Two ranks: a transfer r0 → r1 and a local copy on r0, one TB per connection (r0 has two TBs).
fn two_rank_plan() -> LoweredPlan {
    let p = program(
        "program x\ncollective allreduce ranks=2 chunks=2 inplace\nscratch 0\n\
         op0 = xfer r0 in[0] -> r1 in[0] recv ch=0 chunk=0 step=0 stage=0\n\
         op1 = copy r0 in[0] -> in[1] ch=5 chunk=0 step=0 stage=0\n",
    );
    let plan = compile(&p, &Options::new(Scheduler::Hpds, TbAlloc::PerConn)).unwrap();
    lower(&plan, &LowerOptions::default()).unwrap()
}

fn put(ws: &mut [u8], offset: u64, v: u64) {
    let at = (offset - FIFO_REGION_OFFSET as u64) as usize;
    ws[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

fn stale(e: &LoweredExecError, rank: u32, says: &str) -> bool {
    matches!(e, LoweredExecError::StaleWorkspace { rank: r, what } if *r == Rank(rank) && what.contains(says))
}

#[test]
fn segment_and_task_counts_that_overflow_are_descriptor_errors() {
    let lp = two_rank_plan();
    let last = lp.ranks[0].tbs.len() - 1;

    let mut bad = lp.clone();
    bad.ranks[0].tbs[last].segment_count = u32::MAX;
    let e = validate(&bad).unwrap_err();
    assert_eq!(e.rank, 0);
    assert_eq!(e.what, format!("tb{last}: task or segment range overflows 32 bits"));

    let mut bad = lp.clone();
    bad.ranks[0].tbs[last].task_count = u32::MAX;
    assert_eq!(validate(&bad).unwrap_err().what, format!("tb{last}: task or segment range overflows 32 bits"));

    let mut bad = lp.clone();
    let seg = bad.ranks[0].tbs[last].first_segment as usize;
    bad.ranks[0].segments[seg].task_count = u32::MAX;
    let e = validate(&bad).unwrap_err();
    assert_eq!((e.rank, e.what), (0, format!("tb{last}: segment task counts overflow 32 bits")));
    // The executors validate first: the same error, not a panic.
    assert!(matches!(
        launch(&bad, &mut Memory::new(&lp), &LaunchOptions::default()),
        Err(LoweredExecError::Descriptor(_))
    ));
}

#[test]
fn header_sizes_that_overflow_are_descriptor_errors() {
    let lp = two_rank_plan();
    let mut bad = lp.clone();
    bad.ranks[1].header.fifo_bytes = u64::MAX;
    let e = validate(&bad).unwrap_err();
    assert_eq!((e.rank, e.what.as_str()), (1, "a FIFO region of 18446744073709551615 bytes overflows 64 bits"));

    // Chunks of 2^63 bytes: the two-chunk buffer overflows 64 bits (every rank agrees on geometry).
    let mut bad = lp.clone();
    for r in &mut bad.ranks {
        (r.header.chunk_bytes, r.header.mb_bytes) = (1 << 63, 1 << 61);
    }
    let e = validate(&bad).unwrap_err();
    assert!(e.what.contains("2 chunks of 9223372036854775808 bytes overflow 64 bits"), "{e}");
    assert!(matches!(
        launch(&bad, &mut Memory::new(&lp), &LaunchOptions::default()),
        Err(LoweredExecError::Descriptor(_))
    ));
}

#[test]
fn lower_refuses_buffers_whose_size_overflows() {
    let p = program(
        "program x\ncollective allreduce ranks=1 chunks=4 outofplace\nscratch 0\n\
         op0 = copy r0 in[0] -> out[0] ch=0 chunk=0 step=0 stage=0\n",
    );
    let plan = compile(&p, &Options::default()).unwrap();
    let opts = LowerOptions { chunk_bytes: 1 << 62, ..LowerOptions::default() };
    assert_eq!(lower(&plan, &opts), Err(LowerError::TooLarge { what: "a buffer (chunks × chunk_bytes)" }));
}

#[test]
fn chunks_too_large_for_the_host_are_refused_before_allocating() {
    let p = program(
        "program x\ncollective allreduce ranks=1 chunks=1 outofplace\nscratch 0\n\
         op0 = copy r0 in[0] -> out[0] ch=0 chunk=0 step=0 stage=0\n",
    );
    let plan = compile(&p, &Options::default()).unwrap();
    // 1 TiB per chunk: a valid lowering (a device might hold it), not a host run.
    let lp = lower(&plan, &LowerOptions { chunk_bytes: 1 << 40, ..LowerOptions::default() }).unwrap();
    let bytes = Memory::bytes(&lp);
    assert!(bytes >= 2 << 40, "{bytes}");
    let want = LoweredExecError::TooLarge { bytes, max: MAX_MEMORY_BYTES };
    assert_eq!(Memory::try_new(&lp).unwrap_err(), want);
    assert_eq!(verify::<f32>(&lp, ReduceOp::Sum, 1, &LaunchOptions::default()).unwrap_err(), want);
    assert!(want.to_string().contains("bytes of host memory"), "{want}");
    // Within the bound verification runs as before.
    let lp = lower(&plan, &LowerOptions::default()).unwrap();
    assert!(Memory::bytes(&lp) <= MAX_MEMORY_BYTES);
    assert_eq!(Memory::try_new(&lp).unwrap(), Memory::new(&lp));
    assert_eq!(verify::<f32>(&lp, ReduceOp::Sum, 2, &LaunchOptions::default()).unwrap().wrong, 0);
}

#[test]
fn a_fifo_head_past_its_tail_is_a_stale_workspace() {
    let lp = two_rank_plan();
    let c = lp.ranks[1].connections[0];
    let mut mem = Memory::new(&lp);
    put(&mut mem.workspaces[1], c.head_offset, 5);
    let e = launch(&lp, &mut mem, &LaunchOptions::default()).unwrap_err();
    assert!(stale(&e, 1, "head counter 5 is not its tail counter 0"), "{e}");

    // A message left over (tail ahead of head) is one too, not a FIFO disorder.
    let mut mem = Memory::new(&lp);
    put(&mut mem.workspaces[1], c.tail_offset, 1);
    let e = launch(&lp, &mut mem, &LaunchOptions::default()).unwrap_err();
    assert!(stale(&e, 1, "head counter 0 is not its tail counter 1"), "{e}");

    // Drained at a counter that cannot advance: the send cannot publish its message.
    let mut mem = Memory::new(&lp);
    put(&mut mem.workspaces[1], c.head_offset, u64::MAX);
    put(&mut mem.workspaces[1], c.tail_offset, u64::MAX);
    let e = launch(&lp, &mut mem, &LaunchOptions::default()).unwrap_err();
    assert!(stale(&e, 1, "tail counter 18446744073709551615 cannot advance"), "{e}");

    // A replay from where a launch leaves the counters still runs.
    let mut mem = Memory::new(&lp);
    put(&mut mem.workspaces[1], c.head_offset, 7);
    put(&mut mem.workspaces[1], c.tail_offset, 7);
    launch(&lp, &mut mem, &LaunchOptions::default()).unwrap();
}

/// One rank, two TBs: tb0 copies three chunks one after another (three steps per micro-batch),
/// tb1 waits for tb0's first copy before its own.
fn waiting_plan() -> LoweredPlan {
    let p = program(
        "program x\ncollective allreduce ranks=1 chunks=4 outofplace\nscratch 0\n\
         op0 = copy r0 in[0] -> out[0] ch=0 chunk=0 step=0 stage=0\n\
         op1 = copy r0 in[1] -> out[1] ch=0 chunk=0 step=1 stage=0\n\
         op2 = copy r0 in[2] -> out[2] ch=0 chunk=0 step=2 stage=0\n\
         op3 = copy r0 out[0] -> out[3] ch=1 chunk=0 step=3 stage=0\n",
    );
    let plan = compile(&p, &Options::new(Scheduler::Hpds, TbAlloc::PerConn)).unwrap();
    lower(&plan, &LowerOptions { micro_batches: 1, chunk_bytes: 16, ..LowerOptions::default() }).unwrap()
}

#[test]
fn progress_counters_near_the_wrap_are_stale_workspaces() {
    let lp = waiting_plan();
    let r0 = &lp.ranks[0];
    // Every counter a whole number of launches, the last that cannot advance another one.
    let mut mem = Memory::new(&lp);
    for tb in &r0.tbs {
        put(&mut mem.workspaces[0], tb.progress_offset, u64::MAX / tb.steps as u64 * tb.steps as u64);
    }
    let e = launch(&lp, &mut mem, &LaunchOptions::default()).unwrap_err();
    assert!(stale(&e, 0, "cannot advance"), "{e}");

    // The waiter's counter at a launch count whose threshold on the other TB passes 2^64.
    let (waiter, target) = {
        let t = r0.tbs.iter().position(|tb| {
            r0.tasks[tb.first_task as usize..(tb.first_task + tb.task_count) as usize].iter().any(|x| x.wait_count > 0)
        });
        let t = t.expect("a TB that waits");
        let w = r0.tasks[r0.tbs[t].first_task as usize..].iter().find(|x| x.wait_count > 0).unwrap();
        (t, r0.waits[w.wait_start as usize].tb as usize)
    };
    let (ws, ts) = (r0.tbs[waiter].steps as u64, r0.tbs[target].steps as u64);
    assert!(ts > ws, "the target runs more steps ({ts}) than the waiter ({ws})");
    let epoch = u64::MAX / ts + 1;
    let mut mem = Memory::new(&lp);
    put(&mut mem.workspaces[0], r0.tbs[waiter].progress_offset, epoch * ws);
    let e = launch(&lp, &mut mem, &LaunchOptions::default()).unwrap_err();
    assert!(stale(&e, 0, &format!("tb{waiter} at launch {epoch} waits for tb{target} past 2^64 steps")), "{e}");

    // Counters of a few launches replay.
    let mut mem = Memory::new(&lp);
    for _ in 0..3 {
        launch(&lp, &mut mem, &LaunchOptions::default()).unwrap();
    }
}

/// `verify`, `load_inputs` and `outputs` place chunks by `lp.layout` in buffers the headers size:
/// a layout the headers disagree with is a descriptor error before any buffer is touched.
#[test]
fn a_layout_the_headers_disagree_with_is_a_descriptor_error() {
    let lp = two_rank_plan();
    let mut mem = Memory::new(&lp);
    let mut bad = lp.clone();
    bad.layout.chunks = 8;
    let e = validate(&bad).unwrap_err();
    assert_eq!((e.rank, e.what.as_str()), (0, "buffer sizes differ from the layout's"));
    let want = LoweredExecError::Descriptor(e);
    assert_eq!(verify::<f32>(&bad, ReduceOp::Sum, 1, &LaunchOptions::default()).unwrap_err(), want);
    let inputs = vec![vec![0f32; 8 * 2 * 4]; 2];
    assert_eq!(mem.load_inputs(&bad, &inputs).unwrap_err(), want);
    assert_eq!(mem.outputs::<f32>(&bad).unwrap_err(), want);
}

/// Memory made for another plan is refused by `load_inputs` and `outputs` as it is by `launch`.
#[test]
fn memory_of_another_plan_is_bad_input() {
    let lp = two_rank_plan();
    let other = waiting_plan();
    let mut mem = Memory::new(&other);
    let chunk = lp.ranks[0].header.chunk_bytes as usize / 4;
    let inputs: Vec<Vec<f32>> = (0..2).map(|r| (0..2 * chunk).map(|i| (r * 1000 + i) as f32).collect()).collect();
    let e = mem.load_inputs(&lp, &inputs).unwrap_err();
    assert_eq!(e, LoweredExecError::BadInput { reason: "memory for 1 ranks, the plan has 2".into() });
    assert_eq!(mem.outputs::<f32>(&lp).unwrap_err(), e);
    // Its own memory loads and reads back (in place, the output is the input buffer).
    let mut mem = Memory::new(&lp);
    mem.load_inputs(&lp, &inputs).unwrap();
    assert_eq!(mem.outputs::<f32>(&lp).unwrap(), inputs);
}

/// Elements whose size does not divide a chunk would leave its tail out of `outputs`.
#[test]
fn outputs_of_elements_that_do_not_divide_a_chunk_are_bad_input() {
    let lp = two_rank_plan();
    let cb = lp.ranks[0].header.chunk_bytes;
    assert!(cb.is_multiple_of(16), "{cb}");
    let mem = Memory::new(&lp);
    let e = mem.outputs::<[u8; 3]>(&lp).unwrap_err();
    assert_eq!(
        e,
        LoweredExecError::BadInput { reason: format!("3-byte elements do not divide a chunk of {cb} bytes") }
    );
    let e = mem.outputs::<()>(&lp).unwrap_err();
    assert_eq!(
        e,
        LoweredExecError::BadInput { reason: format!("0-byte elements do not divide a chunk of {cb} bytes") }
    );
    assert_eq!(mem.outputs::<[u8; 16]>(&lp).unwrap()[0].len() as u64, 2 * cb / 16);
}
