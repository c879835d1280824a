//! The lowered-program checks reject what the GPU would get wrong: unordered dependent tasks in one
//! CTA, ranges that overflow, programs outside the engine's tables, and races between CTAs.

use oxccl_host::lowered::{self, Lowered, LoweredError};
use oxccl_kernels::abi::{DType, MAX_RANKS, RedOp, TASK_AFTER_WRITES, Task, TaskKind, TbProgram, slot};

/// A task descriptor with the test's fixed dtype and operator (the arguments are its fields).
#[allow(clippy::too_many_arguments)]
fn task(kind: TaskKind, src: u32, src_slot: u8, dst: u32, dst_slot: u8, offset: u64, bytes: u64, flags: u8) -> Task {
    Task {
        kind: kind.raw(),
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

fn program(rank: u32, cta: u32, first: u32, count: u32) -> TbProgram {
    TbProgram { rank, cta, first_task: first, task_count: count, barrier_ranks: 0, reserved: 0 }
}

fn lowered(programs: Vec<TbProgram>, tasks: Vec<Task>) -> Lowered {
    Lowered { programs, tasks, ranks: 2, slots: 2, combines: true }
}

#[test]
fn a_dependent_task_without_after_writes_is_unordered() {
    // Copy own input to the output, then reduce the peer's into it: the second task must wait.
    let copy = task(TaskKind::Move, 0b01, slot::INPUT, 0b01, slot::OUTPUT, 0, 1024, 0);
    let unflagged = task(TaskKind::ReduceInto, 0b10, slot::INPUT, 0b01, slot::OUTPUT, 0, 1024, 0);
    let l = lowered(vec![program(0, 0, 0, 2)], vec![copy, unflagged]);
    assert_eq!(lowered::check_races(&l, &[]), Err(LoweredError::Unordered { program: 0, task: 1 }));
    let flagged = Task { flags: TASK_AFTER_WRITES, ..unflagged };
    let l = lowered(vec![program(0, 0, 0, 2)], vec![copy, flagged]);
    assert_eq!(lowered::check_races(&l, &[]), Ok(()));
}

#[test]
fn writing_what_an_earlier_task_reads_needs_the_flag_too() {
    let read = task(TaskKind::Move, 0b01, slot::INPUT, 0b01, slot::OUTPUT, 0, 256, 0);
    let overwrite_input = task(TaskKind::Move, 0b10, slot::INPUT, 0b01, slot::INPUT, 0, 256, 0);
    let l = lowered(vec![program(0, 0, 0, 2)], vec![read, overwrite_input]);
    assert_eq!(lowered::check_races(&l, &[]), Err(LoweredError::Unordered { program: 0, task: 1 }));
}

#[test]
fn disjoint_tasks_in_one_cta_need_no_flag() {
    let a = task(TaskKind::Move, 0b01, slot::INPUT, 0b01, slot::OUTPUT, 0, 256, 0);
    let b = task(TaskKind::Move, 0b01, slot::INPUT, 0b01, slot::OUTPUT, 256, 256, 0);
    assert_eq!(lowered::check_races(&lowered(vec![program(0, 0, 0, 2)], vec![a, b]), &[]), Ok(()));
}

#[test]
fn two_ctas_writing_the_same_bytes_race() {
    let a = task(TaskKind::Move, 0b01, slot::INPUT, 0b01, slot::OUTPUT, 0, 256, 0);
    let b = task(TaskKind::Move, 0b10, slot::INPUT, 0b01, slot::OUTPUT, 128, 256, 0);
    let l = lowered(vec![program(0, 0, 0, 1), program(0, 1, 1, 1)], vec![a, b]);
    assert!(matches!(lowered::check_races(&l, &[]), Err(LoweredError::Race { .. })));
}

#[test]
fn overflowing_ranges_and_bad_programs_are_errors_not_panics() {
    let huge = task(TaskKind::Move, 0b01, slot::INPUT, 0b01, slot::OUTPUT, u64::MAX - 8, 256, 0);
    let l = lowered(vec![program(0, 0, 0, 1)], vec![huge]);
    assert!(matches!(lowered::check_races(&l, &[]), Err(LoweredError::BadTask { task: 0, .. })));
    let mut bufs = vec![Default::default(); 2];
    assert!(matches!(lowered::execute(&l, &mut bufs, &[]), Err(LoweredError::BadTask { task: 0, .. })));

    let ok = task(TaskKind::Move, 0b01, slot::INPUT, 0b01, slot::OUTPUT, 0, 16, 0);
    let l = lowered(vec![program(MAX_RANKS as u32, 0, 0, 1)], vec![ok]);
    assert!(matches!(lowered::check_races(&l, &[]), Err(LoweredError::BadProgram { program: 0, .. })));
    let l = lowered(vec![program(0, 0, 0, 2)], vec![ok]);
    assert_eq!(lowered::check_races(&l, &[]), Err(LoweredError::TaskRange { program: 0 }));
}
