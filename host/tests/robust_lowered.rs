//! Hostile input to the lowered-plan APIs: counts that overflow 32 or 64 bits, chunks too large for
//! the host, stale FIFO and progress counters are typed errors, never panics (debug or release) or
//! misleading reports; the race check of lowered programs keeps its semantics.

use oxccl_host::compile::lower::{LowerError, LowerOptions, LoweredPlan, lower, validate};
use oxccl_host::compile::{Options, Scheduler, TbAlloc, compile};
use oxccl_host::exec::ReduceOp;
use oxccl_host::exec::lowered::{LaunchOptions, LoweredExecError, MAX_MEMORY_BYTES, Memory, launch, verify};
use oxccl_host::lowered::{self, Lowered, LoweredError};
use oxccl_host::program::{Program, Rank, text};
use oxccl_kernels::abi::{
    DType, FIFO_REGION_OFFSET, MAX_CTAS_PER_RANK, RedOp, TASK_AFTER_WRITES, Task, TaskKind, TbProgram, slot,
};

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

fn task(src: u32, src_slot: u8, dst: u32, dst_slot: u8, offset: u64, bytes: u64, flags: u8) -> Task {
    Task {
        kind: TaskKind::Move.raw(),
        dtype: DType::F32.raw(),
        op: RedOp::Sum.raw(),
        src_slot,
        dst_slot,
        flags,
        reserved: 0,
        src_ranks: src,
        dst_ranks: dst,
        src_offset: offset,
        dst_offset: offset,
        bytes,
    }
}

fn lowered_of(programs: &[(u32, u32)], tasks: Vec<Task>) -> Lowered {
    let mut first = 0;
    let programs = programs
        .iter()
        .enumerate()
        .map(|(cta, &(rank, count))| {
            let p = TbProgram {
                rank,
                cta: cta as u32,
                first_task: first,
                task_count: count,
                barrier_ranks: 0,
                reserved: 0,
            };
            first += count;
            p
        })
        .collect();
    Lowered { programs, tasks, ranks: 2, slots: 2, combines: false }
}

#[test]
fn race_check_semantics_on_crafted_programs() {
    let (i, o) = (slot::INPUT, slot::OUTPUT);
    // One CTA: disjoint writes in one window are fine, touching bytes is not (half-open ranges).
    let l = lowered_of(
        &[(0, 3)],
        vec![task(1, i, 1, o, 0, 64, 0), task(1, i, 1, o, 64, 64, 0), task(1, i, 1, o, 128, 64, 0)],
    );
    assert_eq!(lowered::check_races(&l, &[]), Ok(()));
    // A later task reads what an earlier one of its window writes; the first conflicting one is named.
    let l = lowered_of(
        &[(0, 4)],
        vec![
            task(1, i, 1, o, 0, 64, 0),
            task(1, i, 1, o, 64, 64, 0),
            task(1, o, 1, i, 192, 64, 0),
            task(1, o, 1, i, 32, 8, 0),
        ],
    );
    assert_eq!(lowered::check_races(&l, &[]), Err(LoweredError::Unordered { program: 0, task: 3 }));
    // A task writing what an earlier one reads; TASK_AFTER_WRITES opens a new window.
    let s = slot::SCRATCH;
    let l = lowered_of(&[(0, 2)], vec![task(1, i, 1, o, 0, 64, 0), task(1, s, 1, i, 0, 16, 0)]);
    assert_eq!(lowered::check_races(&l, &[]), Err(LoweredError::Unordered { program: 0, task: 1 }));
    let l = lowered_of(&[(0, 2)], vec![task(1, i, 1, o, 0, 64, 0), task(1, s, 1, i, 0, 16, TASK_AFTER_WRITES)]);
    assert_eq!(lowered::check_races(&l, &[]), Ok(()));
    // Reads of the same bytes never conflict, in a window or across CTAs.
    let l = lowered_of(
        &[(0, 2), (1, 1)],
        vec![task(1, i, 1, o, 0, 64, 0), task(1, i, 2, o, 0, 64, 0), task(1, i, 2, i, 64, 64, 0)],
    );
    assert_eq!(lowered::check_races(&l, &[]), Ok(()));
    // Across CTAs: the same bytes of another rank are not shared; of the same rank they race.
    let l = lowered_of(&[(0, 1), (1, 1)], vec![task(1, i, 1, o, 0, 64, 0), task(2, i, 2, o, 0, 64, 0)]);
    assert_eq!(lowered::check_races(&l, &[]), Ok(()));
    let l = lowered_of(&[(0, 1), (1, 1)], vec![task(1, i, 1, o, 0, 64, 0), task(2, o, 1, i, 48, 64, 0)]);
    assert_eq!(
        lowered::check_races(&l, &[]),
        Err(LoweredError::Race { first: 0, second: 1, rank: 0, slot: i, start: 48, end: 64 })
    );
    // A write far from the start of a long read of another CTA still races with it.
    let l = lowered_of(
        &[(0, 1), (0, 2)],
        vec![task(1, i, 2, s, 0, 4096, 0), task(1, o, 1, s, 0, 16, 0), task(1, o, 1, i, 3000, 16, 0)],
    );
    assert_eq!(
        lowered::check_races(&l, &[]),
        Err(LoweredError::Race { first: 0, second: 1, rank: 0, slot: i, start: 3000, end: 3016 })
    );
    // Aliased slots share bytes: the output from byte 256 of the input.
    let l = lowered_of(&[(0, 1), (1, 1)], vec![task(1, o, 1, s, 0, 64, 0), task(1, s, 1, i, 256, 64, 0)]);
    assert_eq!(lowered::check_races(&l, &[]), Ok(()));
    assert!(matches!(lowered::check_races(&l, &[(0, o, 0, i, 256)]), Err(LoweredError::Race { .. })));
}

/// `n` tasks copying rank 0's first 16 input bytes to 16-byte pieces of its output (a broadcast),
/// `per_cta` to a CTA, in one window each (no `TASK_AFTER_WRITES`): race-free.
fn pieces(n: u32, per_cta: u32) -> Lowered {
    let tasks =
        (0..n as u64).map(|k| Task { src_offset: 0, ..task(1, slot::INPUT, 1, slot::OUTPUT, k * 16, 16, 0) }).collect();
    let programs = (0..n.div_ceil(per_cta))
        .map(|c| TbProgram {
            rank: 0,
            cta: c % MAX_CTAS_PER_RANK as u32,
            first_task: c * per_cta,
            task_count: per_cta.min(n - c * per_cta),
            barrier_ranks: 0,
            reserved: 0,
        })
        .collect();
    Lowered { programs, tasks, ranks: 1, slots: 1, combines: false }
}

#[test]
fn race_check_of_large_programs_is_fast_and_exact() {
    // Was quadratic in a window's tasks: 100k tasks took seconds, 3M minutes.
    let n = 100_000;
    for per_cta in [n, 100] {
        let mut l = pieces(n, per_cta);
        let started = std::time::Instant::now();
        assert_eq!(lowered::check_races(&l, &[]), Ok(()));
        let took = started.elapsed();
        if !cfg!(debug_assertions) {
            assert!(took.as_secs_f64() < 5.0, "{n} tasks, {per_cta} per CTA: {took:?}");
        }
        // The last task of the last CTA also reads a piece the first CTA writes.
        let last = l.tasks.len() - 1;
        l.tasks[last].src_slot = slot::OUTPUT;
        l.tasks[last].src_offset = 32;
        l.tasks[last].dst_offset = n as u64 * 16;
        let want = if per_cta == n {
            LoweredError::Unordered { program: 0, task: last }
        } else {
            LoweredError::Race {
                first: 0,
                second: l.programs.len() - 1,
                rank: 0,
                slot: slot::OUTPUT,
                start: 32,
                end: 48,
            }
        };
        assert_eq!(lowered::check_races(&l, &[]), Err(want));
    }
}
