//! The lowered-program checks reject what the GPU would get wrong: unordered dependent tasks in one
//! CTA, ranges that overflow, programs outside the engine's tables, and races between CTAs.

use oxccl_host::lowered::{self, Lowered, LoweredError};
use oxccl_kernels::abi::{
    DType, MAX_CTAS_PER_RANK, MAX_RANKS, PAIR_CTAS, RedOp, TASK_AFTER_WRITES, Task, TaskKind, TbProgram, slot,
};

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
        divisor: 0,
        src_ranks: src,
        dst_ranks: dst,
        src_offset: offset,
        dst_offset: offset,
        bytes,
    }
}

fn program(rank: u32, cta: u32, first: u32, count: u32) -> TbProgram {
    TbProgram { rank, cta, first_task: first, task_count: count, barrier_ranks: 0, table: 0, key: 0, reserved: 0 }
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
    // A barrier rank past the engine's table of MAX_RANKS workspaces.
    let mut far = lowered(vec![program(0, 0, 0, 1)], vec![ok]);
    far.programs[0].barrier_ranks = 1 << MAX_RANKS;
    let e = lowered::validate_structure(&far).unwrap_err();
    assert_eq!(e, LoweredError::BadProgram { program: 0, why: "a barrier rank at or above MAX_RANKS" });
    // Pair slots (point-to-point CTAs) meet exactly one other rank, inside the workspace's slots.
    let pair = |cta: u32, barrier_ranks: u32| {
        let mut l = lowered(vec![program(0, cta, 0, 1)], vec![ok]);
        l.programs[0].barrier_ranks = barrier_ranks;
        lowered::validate_structure(&l)
    };
    let first_pair = MAX_CTAS_PER_RANK as u32;
    assert_eq!(pair(first_pair, 0b11), Ok(()));
    assert_eq!(pair(first_pair + PAIR_CTAS as u32 - 1, 0b101), Ok(()));
    for (cta, barrier_ranks) in
        [(first_pair, 0b111), (first_pair, 0b1), (first_pair, 0), (first_pair + PAIR_CTAS as u32, 0b11)]
    {
        assert!(
            matches!(pair(cta, barrier_ranks), Err(LoweredError::BadProgram { program: 0, .. })),
            "slot {cta} meeting {barrier_ranks:#b}"
        );
    }
    // A row of the buffer table past MAX_RANKS; another row than the rank's, which the host
    // executor does not model, is refused there.
    let mut rows = lowered(vec![program(0, 0, 0, 1)], vec![ok]);
    rows.programs[0].table = MAX_RANKS as u32 + 1;
    assert!(matches!(lowered::validate_structure(&rows), Err(LoweredError::BadProgram { program: 0, .. })));
    rows.programs[0].table = 2;
    let mut bufs = vec![std::array::from_fn(|_| vec![0u8; 64]); 2];
    assert!(matches!(lowered::execute(&rows, &mut bufs, &[]), Err(LoweredError::BadProgram { program: 0, .. })));
}

#[test]
fn bad_aliases_and_missing_ranks_are_errors_not_panics() {
    // One rank with a 64-byte input and output; a zero-byte task, so no length check catches it.
    let bufs = || -> lowered::HostBuffers { vec![std::array::from_fn(|_| vec![0u8; 64])] };
    let zero = task(TaskKind::Move, 0b01, slot::INPUT, 0b01, slot::OUTPUT, 0, 0, 0);
    let l = lowered(vec![program(0, 0, 0, 1)], vec![zero]);
    // The output aliased into the input from byte 128: past the input's end.
    let past = [(0, slot::OUTPUT, 0, slot::INPUT, 128)];
    let why = "starts past the end of its target";
    assert_eq!(lowered::execute(&l, &mut bufs(), &past), Err(LoweredError::BadAlias { alias: 0, why }));
    // At the end exactly is an empty buffer, not an error.
    assert_eq!(lowered::execute(&l, &mut bufs(), &[(0, slot::OUTPUT, 0, slot::INPUT, 64)]), Ok(()));
    let why = "names a rank without buffers";
    assert_eq!(
        lowered::execute(&l, &mut bufs(), &[(0, slot::OUTPUT, 3, slot::INPUT, 0)]),
        Err(LoweredError::BadAlias { alias: 0, why })
    );
    let why = "slot out of range";
    assert_eq!(
        lowered::execute(&l, &mut bufs(), &[(0, 200, 0, slot::INPUT, 0)]),
        Err(LoweredError::BadAlias { alias: 0, why })
    );
    // A zero-byte task from a rank that has no buffers.
    let stray = task(TaskKind::Move, 0b10, slot::INPUT, 0b01, slot::OUTPUT, 0, 0, 0);
    let l = lowered(vec![program(0, 0, 0, 1)], vec![stray]);
    let why = "names a rank without buffers";
    assert_eq!(lowered::execute(&l, &mut bufs(), &[]), Err(LoweredError::BadTask { task: 0, why }));
}

/// `combine_into` is what both the CPU executor and the tests' reference use, so its semantics are
/// pinned here by hand: one rounding to nearest even for f16 and bf16, the non-NaN operand for float
/// min and max, wrapping integer sums, unsigned comparisons for u32.
#[test]
fn combine_into_matches_hand_computed_values() {
    use half::{bf16, f16};
    fn run<T: Copy>(dtype: DType, op: RedOp, acc: &[T], src: &[T], bytes: fn(T) -> Vec<u8>) -> Vec<u8> {
        let mut a: Vec<u8> = acc.iter().flat_map(|&x| bytes(x)).collect();
        let s: Vec<u8> = src.iter().flat_map(|&x| bytes(x)).collect();
        lowered::combine_into(dtype, op, &mut a, &s);
        a
    }
    fn le<T: Copy>(v: &[T], bytes: fn(T) -> Vec<u8>) -> Vec<u8> {
        v.iter().flat_map(|&x| bytes(x)).collect()
    }
    let f32b: fn(f32) -> Vec<u8> = |x| x.to_le_bytes().to_vec();
    let f16b: fn(f16) -> Vec<u8> = |x| x.to_le_bytes().to_vec();
    let bf16b: fn(bf16) -> Vec<u8> = |x| x.to_le_bytes().to_vec();
    let i32b: fn(i32) -> Vec<u8> = |x| x.to_le_bytes().to_vec();
    let u32b: fn(u32) -> Vec<u8> = |x| x.to_le_bytes().to_vec();
    let nan = f32::NAN;

    assert_eq!(run(DType::F32, RedOp::Sum, &[1.5f32, -2.0], &[2.25, 0.5], f32b), le(&[3.75f32, -1.5], f32b));
    assert_eq!(run(DType::F32, RedOp::Min, &[nan, 1.0, -0.5], &[2.0, nan, 3.0], f32b), le(&[2.0f32, 1.0, -0.5], f32b));
    assert_eq!(run(DType::F32, RedOp::Max, &[nan, 1.0, -0.5], &[2.0, nan, 3.0], f32b), le(&[2.0f32, 1.0, 3.0], f32b));

    // f16: 1 + 2^-11 is halfway between 1 and 1 + 2^-10 (even: 1); (1 + 2^-10) + 2^-11 halfway between
    // 1 + 2^-10 and 1 + 2^-9 (even: 1 + 2^-9); 65504 + 8 rounds back to f16's largest finite value.
    let h = |x: f32| f16::from_f32(x);
    let tiny = h(2f32.powi(-11));
    assert_eq!(
        run(DType::F16, RedOp::Sum, &[h(1.0), h(1.0 + 2f32.powi(-10)), h(65504.0)], &[tiny, tiny, h(8.0)], f16b),
        le(&[h(1.0), h(1.0 + 2f32.powi(-9)), h(65504.0)], f16b)
    );
    assert_eq!(
        run(DType::F16, RedOp::Min, &[f16::NAN, h(-3.0)], &[h(2.0), h(1.0)], f16b),
        le(&[h(2.0), h(-3.0)], f16b)
    );
    assert_eq!(run(DType::F16, RedOp::Max, &[h(0.5), f16::NAN], &[h(-1.0), h(7.0)], f16b), le(&[h(0.5), h(7.0)], f16b));

    // bf16: 8 significant bits. 1 + 2^-8 is a tie (even: 1); (1 + 2^-7) + 2^-8 rounds to 1 + 2^-6.
    let b = |x: f32| bf16::from_f32(x);
    let half_ulp = b(2f32.powi(-8));
    assert_eq!(
        run(DType::Bf16, RedOp::Sum, &[b(1.0), b(1.0 + 2f32.powi(-7))], &[half_ulp, half_ulp], bf16b),
        le(&[b(1.0), b(1.0 + 2f32.powi(-6))], bf16b)
    );
    assert_eq!(
        run(DType::Bf16, RedOp::Min, &[bf16::NAN, b(4.0)], &[b(-2.0), b(8.0)], bf16b),
        le(&[b(-2.0), b(4.0)], bf16b)
    );
    assert_eq!(
        run(DType::Bf16, RedOp::Max, &[bf16::NAN, b(4.0)], &[b(-2.0), b(8.0)], bf16b),
        le(&[b(-2.0), b(8.0)], bf16b)
    );

    assert_eq!(run(DType::I32, RedOp::Sum, &[i32::MAX, -7], &[1, 3], i32b), le(&[i32::MIN, -4], i32b));
    assert_eq!(run(DType::I32, RedOp::Min, &[-5, 9], &[3, i32::MIN], i32b), le(&[-5, i32::MIN], i32b));
    assert_eq!(run(DType::I32, RedOp::Max, &[-5, 9], &[3, i32::MIN], i32b), le(&[3, 9], i32b));
    assert_eq!(run(DType::U32, RedOp::Sum, &[u32::MAX, 5], &[2, 6], u32b), le(&[1u32, 11], u32b));
    assert_eq!(run(DType::U32, RedOp::Min, &[u32::MAX, 0], &[1, 7], u32b), le(&[1u32, 0], u32b));
    assert_eq!(run(DType::U32, RedOp::Max, &[u32::MAX, 0], &[1, 7], u32b), le(&[u32::MAX, 7], u32b));

    // Products: one rounding (f16: 3 × 1365 = 4095 → 4096, the nearest even half), integers wrap.
    assert_eq!(
        run(DType::F16, RedOp::Prod, &[f16::from_f32(3.0)], &[f16::from_f32(1365.0)], f16b),
        f16b(f16::from_f32(4096.0))
    );
    assert_eq!(run(DType::I32, RedOp::Prod, &[i32::MAX, -3], &[2, 5], i32b), le(&[-2, -15], i32b));
    assert_eq!(run(DType::U32, RedOp::Prod, &[u32::MAX], &[3], u32b), le(&[u32::MAX - 2], u32b));
    // Avg combines as a sum; the division comes once, at the end (`finish_into`).
    assert_eq!(run(DType::F32, RedOp::Avg, &[1.5f32], &[2.25], f32b), le(&[3.75f32], f32b));
    let finish = |dtype: DType, mut acc: Vec<u8>, n: u32| {
        lowered::finish_into(dtype, RedOp::Avg, &mut acc, n);
        acc
    };
    // Floats multiply by the f32 nearest 1/n: 1/3 is below a third, so 3 × (1/3) is just below 1.
    assert_eq!(
        finish(DType::F32, le(&[3.0f32, 10.0], f32b), 3),
        le(&[3.0f32 * (1.0 / 3.0), 10.0 * (1.0f32 / 3.0)], f32b)
    );
    assert_eq!(finish(DType::F32, le(&[6.0f32], f32b), 4), le(&[1.5f32], f32b));
    assert_eq!(finish(DType::Bf16, le(&[bf16::from_f32(7.0)], bf16b), 2), le(&[bf16::from_f32(3.5)], bf16b));
    // f16: 1/3 widened product rounded once: 1.0 × 0.33333334 → 0.33325195 (the nearest half).
    assert_eq!(finish(DType::F16, le(&[f16::from_f32(1.0)], f16b), 3), le(&[f16::from_f32(1.0 / 3.0)], f16b));
    // Integers truncate toward zero, after the wrapped sum.
    assert_eq!(finish(DType::I32, le(&[-7, 7, i32::MIN], i32b), 2), le(&[-3, 3, i32::MIN / 2], i32b));
    assert_eq!(finish(DType::U32, le(&[7u32, u32::MAX], u32b), 4), le(&[1u32, u32::MAX / 4], u32b));
    // Other operators and a single contribution are left as they are.
    assert_eq!(finish(DType::I32, le(&[-7], i32b), 1), le(&[-7], i32b));
    let mut sum = le(&[-7], i32b);
    lowered::finish_into(DType::I32, RedOp::Sum, &mut sum, 4);
    assert_eq!(sum, le(&[-7], i32b));
}

/// A copy task (the race tests' only kind).
fn copy(src: u32, src_slot: u8, dst: u32, dst_slot: u8, offset: u64, bytes: u64, flags: u8) -> Task {
    task(TaskKind::Move, src, src_slot, dst, dst_slot, offset, bytes, flags)
}

/// Programs of (rank, task count) in CTA order over consecutive tasks, two ranks, no combines.
fn lowered_of(programs: &[(u32, u32)], tasks: Vec<Task>) -> Lowered {
    let mut first = 0;
    let programs = programs
        .iter()
        .enumerate()
        .map(|(cta, &(rank, count))| {
            first += count;
            program(rank, cta as u32, first - count, count)
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
        vec![copy(1, i, 1, o, 0, 64, 0), copy(1, i, 1, o, 64, 64, 0), copy(1, i, 1, o, 128, 64, 0)],
    );
    assert_eq!(lowered::check_races(&l, &[]), Ok(()));
    // A later task reads what an earlier one of its window writes; the first conflicting one is named.
    let l = lowered_of(
        &[(0, 4)],
        vec![
            copy(1, i, 1, o, 0, 64, 0),
            copy(1, i, 1, o, 64, 64, 0),
            copy(1, o, 1, i, 192, 64, 0),
            copy(1, o, 1, i, 32, 8, 0),
        ],
    );
    assert_eq!(lowered::check_races(&l, &[]), Err(LoweredError::Unordered { program: 0, task: 3 }));
    // A task writing what an earlier one reads; TASK_AFTER_WRITES opens a new window.
    let s = slot::SCRATCH;
    let l = lowered_of(&[(0, 2)], vec![copy(1, i, 1, o, 0, 64, 0), copy(1, s, 1, i, 0, 16, 0)]);
    assert_eq!(lowered::check_races(&l, &[]), Err(LoweredError::Unordered { program: 0, task: 1 }));
    let l = lowered_of(&[(0, 2)], vec![copy(1, i, 1, o, 0, 64, 0), copy(1, s, 1, i, 0, 16, TASK_AFTER_WRITES)]);
    assert_eq!(lowered::check_races(&l, &[]), Ok(()));
    // Reads of the same bytes never conflict, in a window or across CTAs.
    let l = lowered_of(
        &[(0, 2), (1, 1)],
        vec![copy(1, i, 1, o, 0, 64, 0), copy(1, i, 2, o, 0, 64, 0), copy(1, i, 2, i, 64, 64, 0)],
    );
    assert_eq!(lowered::check_races(&l, &[]), Ok(()));
    // Across CTAs: the same bytes of another rank are not shared; of the same rank they race.
    let l = lowered_of(&[(0, 1), (1, 1)], vec![copy(1, i, 1, o, 0, 64, 0), copy(2, i, 2, o, 0, 64, 0)]);
    assert_eq!(lowered::check_races(&l, &[]), Ok(()));
    let l = lowered_of(&[(0, 1), (1, 1)], vec![copy(1, i, 1, o, 0, 64, 0), copy(2, o, 1, i, 48, 64, 0)]);
    assert_eq!(
        lowered::check_races(&l, &[]),
        Err(LoweredError::Race { first: 0, second: 1, rank: 0, slot: i, start: 48, end: 64 })
    );
    // A write far from the start of a long read of another CTA still races with it.
    let l = lowered_of(
        &[(0, 1), (0, 2)],
        vec![copy(1, i, 2, s, 0, 4096, 0), copy(1, o, 1, s, 0, 16, 0), copy(1, o, 1, i, 3000, 16, 0)],
    );
    assert_eq!(
        lowered::check_races(&l, &[]),
        Err(LoweredError::Race { first: 0, second: 1, rank: 0, slot: i, start: 3000, end: 3016 })
    );
    // Aliased slots share bytes: the output from byte 256 of the input.
    let l = lowered_of(&[(0, 1), (1, 1)], vec![copy(1, o, 1, s, 0, 64, 0), copy(1, s, 1, i, 256, 64, 0)]);
    assert_eq!(lowered::check_races(&l, &[]), Ok(()));
    assert!(matches!(lowered::check_races(&l, &[(0, o, 0, i, 256)]), Err(LoweredError::Race { .. })));
}

/// `n` tasks copying rank 0's first 16 input bytes to 16-byte pieces of its output (a broadcast),
/// `per_cta` to a CTA, in one window each (no `TASK_AFTER_WRITES`): race-free.
fn pieces(n: u32, per_cta: u32) -> Lowered {
    let tasks =
        (0..n as u64).map(|k| Task { src_offset: 0, ..copy(1, slot::INPUT, 1, slot::OUTPUT, k * 16, 16, 0) }).collect();
    let programs = (0..n.div_ceil(per_cta))
        .map(|c| program(0, c % MAX_CTAS_PER_RANK as u32, c * per_cta, per_cta.min(n - c * per_cta)))
        .collect();
    Lowered { programs, tasks, ranks: 1, slots: 1, combines: false }
}

#[test]
fn race_check_of_large_programs_is_exact() {
    // Its speed on these programs (it was quadratic in a window's tasks) is checked by
    // `cargo bench -p oxccl-host --bench planners`.
    let n = 100_000;
    for per_cta in [n, 100] {
        let mut l = pieces(n, per_cta);
        assert_eq!(lowered::check_races(&l, &[]), Ok(()));
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
