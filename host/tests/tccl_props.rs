//! T-CCL plans on the CPU executor against the collectives' definitions: AllReduce, ReduceScatter,
//! AllGather, Broadcast and Reduce (random roots), random ranks (1..16), counts
//! (0..10^6, including lengths that are not multiples of 16 bytes), dtypes, operators, in-place and
//! out-of-place, CTA counts 1..32, both reductions. Integer-valued inputs make every summation order
//! exact (bitwise comparison); random f32, f16 and bf16 values are compared with a tolerance derived
//! from each dtype's unit roundoff (and bitwise for the deterministic register reduction, whose order
//! the executor reproduces).

use oxccl_host::fp8::Fp8;
use oxccl_host::group::{self, Member, Shared};
use oxccl_host::lowered::{self, HostBuffers};
use oxccl_host::tccl::{self, Collective, PlanSpec, Reduction};
use oxccl_kernels::abi::{DType, RedOp, slot};
use proptest::prelude::*;
use rand::SeedableRng;
use rand::rngs::StdRng;

fn element(dtype: DType, x: f64) -> Vec<u8> {
    match dtype {
        DType::F32 => (x as f32).to_le_bytes().to_vec(),
        DType::F16 => half::f16::from_f64(x).to_le_bytes().to_vec(),
        DType::Bf16 => half::bf16::from_f64(x).to_le_bytes().to_vec(),
        DType::I32 => (x as i32).to_le_bytes().to_vec(),
        // At least 1: 0 is the Min poison.
        DType::U32 => (x.abs() as u32 + 1).to_le_bytes().to_vec(),
        DType::U8 => vec![x.abs() as u8 + 1],
        DType::I8 => vec![x as i8 as u8],
        DType::F64 => x.to_le_bytes().to_vec(),
        DType::I64 => (x as i64).to_le_bytes().to_vec(),
        DType::U64 => (x.abs() as u64 + 1).to_le_bytes().to_vec(),
        DType::F8e4m3 => vec![Fp8::E4M3.from_f32(x as f32)],
        DType::F8e5m2 => vec![Fp8::E5M2.from_f32(x as f32)],
    }
}

fn to_f64(dtype: DType, b: &[u8]) -> f64 {
    match dtype {
        DType::F32 => f32::from_le_bytes(b.try_into().unwrap()) as f64,
        DType::F16 => half::f16::from_le_bytes(b.try_into().unwrap()).to_f64(),
        DType::Bf16 => half::bf16::from_le_bytes(b.try_into().unwrap()).to_f64(),
        DType::I32 => i32::from_le_bytes(b.try_into().unwrap()) as f64,
        DType::U32 => u32::from_le_bytes(b.try_into().unwrap()) as f64,
        DType::U8 => b[0] as f64,
        DType::I8 => b[0] as i8 as f64,
        DType::F64 => f64::from_le_bytes(b.try_into().unwrap()),
        DType::I64 => i64::from_le_bytes(b.try_into().unwrap()) as f64,
        DType::U64 => u64::from_le_bytes(b.try_into().unwrap()) as f64,
        DType::F8e4m3 => Fp8::E4M3.to_f32(b[0]) as f64,
        DType::F8e5m2 => Fp8::E5M2.to_f32(b[0]) as f64,
    }
}

/// Runs `spec` on the CPU executor with the given per-rank inputs; returns each rank's result buffer
/// (the output, or for in-place calls the one buffer). A buffer a rank does not have
/// ([`PlanSpec::rank_buffers`]) is empty: a task that touched it would fail the executor's bounds.
fn execute(spec: &PlanSpec, inputs: &[Vec<u8>]) -> Vec<Vec<u8>> {
    let plan = tccl::plan(spec).expect("plan");
    let mut bufs: HostBuffers = vec![Default::default(); spec.ranks];
    fill(spec, inputs, &mut bufs, 0);
    lowered::execute(&plan, &mut bufs, &spec.aliases()).expect("execute");
    take(spec, &mut bufs, 0)
}

/// Puts `spec`'s buffers, holding `inputs` (and the poison where outputs go), into every rank's
/// slots `shift + INPUT` and `shift + OUTPUT`.
fn fill(spec: &PlanSpec, inputs: &[Vec<u8>], bufs: &mut HostBuffers, shift: u8) {
    let (in_bytes, out_bytes) = spec.buffer_bytes();
    for (r, input) in inputs.iter().enumerate() {
        let (has_in, has_out) = spec.rank_buffers(r);
        let row = &mut bufs[r];
        if spec.in_place {
            // One buffer per rank, in the slot the other aliases into.
            let (s, len) = match spec.collective {
                Collective::AllGather => (slot::OUTPUT, out_bytes),
                _ => (slot::INPUT, in_bytes),
            };
            let mut b = tccl::poison(spec, len as usize);
            let at = match spec.collective {
                Collective::AllGather => r * in_bytes as usize,
                _ => 0,
            };
            b[at..at + input.len()].copy_from_slice(input);
            row[(s + shift) as usize] = b;
        } else {
            row[(slot::INPUT + shift) as usize] = if has_in { input.clone() } else { Vec::new() };
            // Poison: any element the plan fails to write keeps it.
            row[(slot::OUTPUT + shift) as usize] =
                if has_out { tccl::poison(spec, out_bytes as usize) } else { Vec::new() };
        }
    }
}

/// Each rank's result of `spec` from the slots `fill` put it in.
fn take(spec: &PlanSpec, bufs: &mut HostBuffers, shift: u8) -> Vec<Vec<u8>> {
    let s = if spec.in_place && spec.collective != Collective::AllGather { slot::INPUT } else { slot::OUTPUT };
    bufs.iter_mut().map(|row| std::mem::take(&mut row[(s + shift) as usize])).collect()
}

fn spec_strategy() -> impl Strategy<Value = PlanSpec> {
    (
        // The root of Broadcast and Reduce is drawn below 16, then taken modulo the ranks.
        (0usize..6, 0u32..16).prop_map(|(k, root)| Collective::every(root)[k]),
        prop_oneof![
            1 => Just(0u64),
            // Lengths around 16-byte and chunk boundaries for every element size.
            1 => prop::sample::select(vec![1u64, 2, 3, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 4095, 4096, 4097]),
            4 => 0u64..300,
            2 => 0u64..20_000,
            1 => 0u64..1_000_000
        ],
        prop::sample::select(DType::ALL.to_vec()),
        prop::sample::select(RedOp::ALL.to_vec()),
        1usize..=16,
        any::<bool>(),
        1u32..=32,
        prop_oneof![Just(Reduction::Registers), Just(Reduction::Tma)],
    )
        .prop_map(|(collective, count, dtype, op, ranks, in_place, ctas, reduction)| {
            // Keep the total work of one case modest: large counts with few ranks.
            let count = if count > 100_000 { count / ranks as u64 } else { count };
            let collective = match collective {
                Collective::Broadcast { root } => Collective::Broadcast { root: root % ranks as u32 },
                Collective::Reduce { root } => Collective::Reduce { root: root % ranks as u32 },
                c => c,
            };
            // AllToAll has no in-place form (its refusal is tested on its own).
            let in_place = in_place && collective.has_in_place();
            PlanSpec { collective, count, dtype, op, ranks, in_place, ctas, reduction }
        })
}

fn inputs(spec: &PlanSpec, seed: u64, integers: bool) -> Vec<Vec<u8>> {
    let (in_bytes, _) = spec.buffer_bytes();
    let e = spec.dtype.size();
    let mut rng = StdRng::seed_from_u64(seed);
    let mut next = move || rng.next_u64();
    // In-place Min and Max on integers: values distinct across ranks at every element, the extreme held
    // by a random rank, so the result differs from every other rank's own input and an element a rank
    // fails to write shows although its buffer starts as its input.
    // A Broadcast in place likewise whatever its operator: a rank's element left unwritten keeps its
    // own value, which differs from the root's.
    let distinct = integers
        && spec.in_place
        && (matches!(spec.collective, Collective::Broadcast { .. })
            || (spec.op != RedOp::Sum && spec.collective != Collective::AllGather));
    let low = if matches!(spec.dtype, DType::U32 | DType::U8 | DType::U64) { 0.0 } else { -8.0 };
    let p = spec.ranks;
    let mut v: Vec<Vec<u8>> = (0..p).map(|_| Vec::with_capacity(in_bytes as usize)).collect();
    for _ in 0..in_bytes as usize / e {
        let turn = next() as usize % p;
        for (r, input) in v.iter_mut().enumerate() {
            let x = if spec.op == RedOp::Prod && spec.collective.reduces() {
                // No zero: an overflowed f16 product times zero is a NaN.
                [-2.0, -1.0, 1.0, 2.0][next() as usize % 4]
            } else if distinct {
                ((r + turn) % p) as f64 + low
            } else if integers {
                (next() % 21) as f64 - 10.0
            } else {
                (next() % 2_000_001) as f64 / 1000.0 - 1000.0
            };
            input.extend(element(spec.dtype, x));
        }
    }
    v
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn plans_compute_the_collective_exactly_on_integers(spec in spec_strategy(), seed in any::<u64>()) {
        let ins = inputs(&spec, seed, true);
        let got = execute(&spec, &ins);
        let want = tccl::reference(&spec, &ins);
        prop_assert_eq!(got, want);
    }

    #[test]
    fn plans_are_race_free(spec in spec_strategy()) {
        let plan = tccl::plan(&spec).unwrap();
        // The launch's slots cover every task on the path the engine takes for it.
        let bulk = spec.reduction == Reduction::Tma;
        let needed = plan.tasks.iter().map(|t| lowered::tma_slots(t, bulk)).max().unwrap_or(1);
        prop_assert!(plan.slots >= needed, "plan declares {} slots, a task needs {}", plan.slots, needed);
        prop_assert_eq!(lowered::check_races(&plan, &spec.aliases()), Ok(()));
        prop_assert_eq!(plan.programs.len(), spec.ranks * spec.ctas as usize);
    }

    #[test]
    fn plans_match_the_reference_on_random_floats(
        spec in spec_strategy(),
        dtype in prop_oneof![Just(DType::F32), Just(DType::F16), Just(DType::Bf16)],
        seed in any::<u64>(),
    ) {
        let spec = PlanSpec { dtype, ..spec };
        let ins = inputs(&spec, seed, false);
        let got = execute(&spec, &ins);
        let want = tccl::reference(&spec, &ins);
        if spec.reduction == Reduction::Registers {
            // Sources combined in ascending rank order, as the reference does: bitwise equal.
            prop_assert_eq!(got, want);
        } else {
            // The bulk path accumulates into the destination rank's own value first: another order,
            // each partial sum rounded to the dtype (`lowered::combine_into`). Terms are at most
            // M = 1000 in magnitude, so either result is within (ranks - 1) · u · ranks · M of the exact
            // sum (u the dtype's unit roundoff; sums of these values do not overflow f16) and the two
            // within twice that. Min and Max are exact in any order.
            let u = match spec.dtype {
                DType::F32 => f64::powi(2.0, -24),
                DType::F16 => f64::powi(2.0, -11),
                DType::Bf16 => f64::powi(2.0, -8),
                other => unreachable!("{other:?} is not a float"),
            };
            let n = spec.ranks as f64;
            let bound = 2.0 * (n - 1.0) * u * n * 1000.0;
            let e = spec.dtype.size();
            for (g, w) in got.iter().zip(&want) {
                prop_assert_eq!(g.len(), w.len());
                for (a, b) in g.chunks(e).zip(w.chunks(e)) {
                    let (a, b) = (to_f64(spec.dtype, a), to_f64(spec.dtype, b));
                    // Equal values pass first: a Prod of ±1 and ±2 over 16 ranks overflows f16 to the
                    // same infinity in every order (exact powers of two), and inf - inf is NaN.
                    // An element left at the poison still fails: NaN equals nothing, and the
                    // infinite Min / Max poisons are never the result of these finite inputs.
                    prop_assert!(a == b || (a - b).abs() <= bound, "{:?}: {} vs {} (bound {})", spec.dtype, a, b, bound);
                }
            }
        }
    }
}

/// The largest counts with the most ranks, which the random specs keep small to bound their time:
/// 16 ranks, 999_999 f16 elements per AllReduce / Broadcast / Reduce buffer and per ReduceScatter /
/// AllGather block (an odd length: not a whole number of 16-byte vectors), every collective, in and
/// out of place.
#[test]
fn sixteen_ranks_at_a_million_elements_are_exact() {
    for collective in Collective::every(13) {
        for in_place in [false, true].into_iter().filter(|&i| !i || collective.has_in_place()) {
            let spec = PlanSpec {
                collective,
                count: 999_999,
                dtype: DType::F16,
                op: RedOp::Sum,
                ranks: 16,
                in_place,
                ctas: 32,
                reduction: Reduction::Registers,
            };
            let ins = inputs(&spec, 0x5EED ^ in_place as u64, true);
            assert!(execute(&spec, &ins) == tccl::reference(&spec, &ins), "{collective:?} in place {in_place}");
        }
    }
}

/// The poison is the operator's absorbing value, or NaN, repeated to the byte: a combine into it
/// keeps it, so an unwritten or combined-into output cannot pass as correct.
#[test]
fn poison_is_what_no_result_has() {
    let spec = |collective, dtype, op| PlanSpec {
        collective,
        count: 1,
        dtype,
        op,
        ranks: 2,
        in_place: false,
        ctas: 1,
        reduction: Reduction::Registers,
    };
    let f32_of = |b: &[u8]| f32::from_le_bytes(b[..4].try_into().unwrap());
    assert!(f32_of(&tccl::poison(&spec(Collective::AllReduce, DType::F32, RedOp::Sum), 8)).is_nan());
    // AllGather copies whatever its operator: NaN too.
    assert!(f32_of(&tccl::poison(&spec(Collective::AllGather, DType::F32, RedOp::Min), 4)).is_nan());
    assert_eq!(f32_of(&tccl::poison(&spec(Collective::ReduceScatter, DType::F32, RedOp::Min), 4)), f32::NEG_INFINITY);
    assert_eq!(tccl::poison(&spec(Collective::AllReduce, DType::U32, RedOp::Min), 4), 0u32.to_le_bytes());
    assert_eq!(tccl::poison(&spec(Collective::AllReduce, DType::I32, RedOp::Max), 4), i32::MAX.to_le_bytes());
    // Any length, the pattern cut where the buffer ends.
    assert_eq!(tccl::poison(&spec(Collective::AllReduce, DType::I32, RedOp::Sum), 6), vec![0xA5; 6]);
    assert_eq!(tccl::poison(&spec(Collective::AllReduce, DType::F16, RedOp::Max), 3), [0x00, 0x7C, 0x00]);
}

#[test]
fn every_byte_is_written_once_per_destination() {
    // AllReduce out-of-place, 8 ranks, a length that is not a multiple of 16 bytes: every output byte of
    // every rank is covered by exactly one task.
    for reduction in [Reduction::Registers, Reduction::Tma] {
        let spec = PlanSpec {
            collective: Collective::AllReduce,
            count: 1_000_003,
            dtype: DType::F16,
            op: RedOp::Sum,
            ranks: 8,
            in_place: false,
            ctas: 7,
            reduction,
        };
        let plan = tccl::plan(&spec).unwrap();
        let bytes = spec.count * 2;
        let mut cover = vec![vec![0u8; bytes as usize]; 8];
        for t in &plan.tasks {
            if t.kind != oxccl_kernels::abi::TaskKind::Move.raw() || t.dst_slot != slot::OUTPUT {
                continue;
            }
            for (r, c) in cover.iter_mut().enumerate() {
                if t.dst_ranks & (1 << r) != 0 && !(t.src_slot == slot::OUTPUT && t.src_ranks & (1 << r) != 0) {
                    for b in &mut c[t.dst_offset as usize..(t.dst_offset + t.bytes) as usize] {
                        *b += 1;
                    }
                }
            }
        }
        // With TMA reduction the owner's own output is written by its copy and by the reductions; count
        // the final writers only: shard-out moves (others) and the owner's copy.
        for (r, c) in cover.iter().enumerate() {
            assert!(
                c.iter().all(|&n| n == 1),
                "{reduction:?}: rank {r} has bytes written {:?} times",
                c.iter().copied().max()
            );
        }
    }
}

#[test]
fn bulk_reduction_plans_need_one_slot_and_no_combining_warp() {
    // Where the hardware reduces the (dtype, operator), the bulk path streams one source at a time
    // through slot 0 from the issuing thread: one slot per stage, no combining, so the CTA can be one
    // warp. Where it cannot (f32 min), the sources are combined in registers: a slot per rank.
    for collective in [Collective::AllReduce, Collective::ReduceScatter] {
        for (dtype, op, slots, combines) in
            [(DType::F32, RedOp::Sum, 1, false), (DType::Bf16, RedOp::Max, 1, false), (DType::F32, RedOp::Min, 8, true)]
        {
            let spec = PlanSpec {
                collective,
                count: 1 << 20,
                dtype,
                op,
                ranks: 8,
                in_place: false,
                ctas: 4,
                reduction: Reduction::Tma,
            };
            let plan = tccl::plan(&spec).unwrap();
            assert_eq!((plan.slots, plan.combines), (slots, combines), "{collective:?} {dtype:?} {op:?}");
            let registers = tccl::plan(&PlanSpec { reduction: Reduction::Registers, ..spec }).unwrap();
            assert_eq!((registers.slots, registers.combines), (8, true), "{collective:?} {dtype:?} {op:?} registers");
        }
    }
    // ReduceScatter blocks that are not 16-byte multiples misalign sources and destination: the
    // kernel reduces element by element there, with every thread of a combining CTA.
    let odd = PlanSpec {
        collective: Collective::ReduceScatter,
        count: (1 << 20) + 1,
        dtype: DType::F32,
        op: RedOp::Sum,
        ranks: 8,
        in_place: false,
        ctas: 4,
        reduction: Reduction::Tma,
    };
    let plan = tccl::plan(&odd).unwrap();
    assert_eq!((plan.slots, plan.combines), (1, true));
    let plan = tccl::plan(&PlanSpec { collective: Collective::AllReduce, ..odd }).unwrap();
    assert_eq!((plan.slots, plan.combines), (1, false), "AllReduce keeps source and destination offsets equal");
}

#[test]
fn invalid_specs_are_typed_errors() {
    let base = PlanSpec {
        collective: Collective::AllReduce,
        count: 10,
        dtype: DType::F32,
        op: RedOp::Sum,
        ranks: 4,
        in_place: false,
        ctas: 2,
        reduction: Reduction::Registers,
    };
    assert!(matches!(tccl::plan(&PlanSpec { ranks: 0, ..base }), Err(tccl::PlanError::Ranks { .. })));
    assert!(matches!(tccl::plan(&PlanSpec { ranks: 17, ..base }), Err(tccl::PlanError::Ranks { .. })));
    assert!(matches!(tccl::plan(&PlanSpec { ctas: 0, ..base }), Err(tccl::PlanError::Ctas { .. })));
    assert!(matches!(tccl::plan(&PlanSpec { count: u64::MAX / 2, ..base }), Err(tccl::PlanError::TooLarge { .. })));
    // AllToAll has no in-place form.
    let in_place = PlanSpec { collective: Collective::AllToAll, in_place: true, ..base };
    assert!(matches!(tccl::plan(&in_place), Err(tccl::PlanError::InPlace { collective: "all_to_all" })));
    assert!(matches!(
        tccl::plan(&PlanSpec { collective: Collective::AllToAll, count: u64::MAX / 8, ..base }),
        Err(tccl::PlanError::TooLarge { .. })
    ));
    // Near the limit the split's arithmetic must not overflow either: the plan covers every rank's
    // output exactly once (checked as intervals: the range is too large to count bytes).
    let big = PlanSpec { collective: Collective::ReduceScatter, count: (1 << 58) - 1, ranks: 16, ctas: 256, ..base };
    let plan = tccl::plan(&big).expect("2^58 - 1 f32 per rank plans");
    let out = big.buffer_bytes().1;
    for r in 0..16 {
        let mut ranges: Vec<(u64, u64)> = plan
            .tasks
            .iter()
            .filter(|t| t.dst_slot == slot::OUTPUT && t.dst_ranks & (1 << r) != 0)
            .map(|t| (t.dst_offset, t.bytes))
            .collect();
        ranges.sort();
        let mut at = 0;
        for (offset, bytes) in ranges {
            assert_eq!(offset, at, "rank {r}: a gap or an overlap at byte {at}");
            at += bytes;
        }
        assert_eq!(at, out, "rank {r}: {at} of {out} output bytes written");
    }
}

/// A root that is not one of the ranks is refused, for both rooted collectives.
#[test]
fn a_root_outside_the_ranks_is_refused() {
    for collective in [Collective::Broadcast { root: 4 }, Collective::Reduce { root: 4 }] {
        let spec = PlanSpec {
            collective,
            count: 10,
            dtype: DType::F32,
            op: RedOp::Sum,
            ranks: 4,
            in_place: false,
            ctas: 1,
            reduction: Reduction::Registers,
        };
        assert_eq!(tccl::plan(&spec).err(), Some(tccl::PlanError::Root { root: 4, ranks: 4 }), "{collective:?}");
    }
}

/// `split` covers `0..total` in order with boundaries on the grain, and stays in range at the
/// extremes of its arguments (an index far past `parts`, the largest grain and total).
#[test]
fn split_covers_the_range_at_any_arguments() {
    for &(total, parts, grain) in &[
        (1000u64, 7u64, 16u64),
        (0, 3, 16),
        (17, 0, 0),
        (u64::MAX, u64::MAX, u64::MAX),
        (u64::MAX, 3, 1),
        (u64::MAX, 1, (1 << 63) + 1),
    ] {
        // A `parts` of 0 counts as 1.
        let parts = parts.max(1);
        let mut at = 0;
        for i in 0..parts.min(64) {
            let (lo, hi) = tccl::split(total, parts, grain, i);
            assert_eq!(lo, at, "split({total}, {parts}, {grain}, {i}) starts where the last ended");
            assert!(hi >= lo && hi <= total, "split({total}, {parts}, {grain}, {i}) = {lo}..{hi}");
            assert!(hi == total || hi % grain.max(1) == 0, "boundary {hi} on the grain {grain}");
            at = hi;
        }
        if parts <= 64 {
            assert_eq!(at, total, "split({total}, {parts}, {grain}, ..) covers the whole range");
        }
        for i in [parts, parts.saturating_add(1), u64::MAX] {
            assert_eq!(tccl::split(total, parts, grain, i), (total, total), "index {i} past {parts} parts");
        }
    }
}

/// Members of a group: any collective of `shared`'s ranks (roots among them), counts up to a few
/// thousand elements, in place or not.
fn members_strategy(ranks: usize) -> impl Strategy<Value = Vec<Member>> {
    prop::collection::vec(
        ((0usize..6, 0u32..16).prop_map(|(k, root)| Collective::every(root)[k]), 0u64..3000, any::<bool>()),
        1..40,
    )
    .prop_map(move |ms| {
        ms.into_iter()
            .map(|(collective, count, in_place)| {
                let collective = match collective {
                    Collective::Broadcast { root } => Collective::Broadcast { root: root % ranks as u32 },
                    Collective::Reduce { root } => Collective::Reduce { root: root % ranks as u32 },
                    c => c,
                };
                Member { collective, count, in_place: in_place && collective.has_in_place() }
            })
            .collect()
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    /// Every launch of a group, run row by row on the CPU executor, leaves each member's buffers as
    /// that collective alone would (integer-valued inputs: exact in any order), and no CTA of a row
    /// races another.
    #[test]
    fn grouped_members_are_each_exact(
        ranks in 1usize..=8,
        ctas in 1u32..=20,
        dtype in prop::sample::select(vec![DType::F32, DType::Bf16, DType::I32, DType::U8, DType::F64]),
        op in prop::sample::select(RedOp::ALL.to_vec()),
        reduction in prop_oneof![Just(Reduction::Registers), Just(Reduction::Tma)],
        members in (1usize..=8).prop_flat_map(members_strategy),
        seed in any::<u64>(),
    ) {
        let shared = Shared { dtype, op, ranks, ctas, reduction };
        let members: Vec<Member> = members.into_iter().map(|m| Member {
            collective: match m.collective {
                Collective::Broadcast { root } => Collective::Broadcast { root: root % ranks as u32 },
                Collective::Reduce { root } => Collective::Reduce { root: root % ranks as u32 },
                c => c,
            },
            ..m
        }).collect();
        let launches = group::launches(&shared, &members);
        prop_assert_eq!(launches.iter().map(|r| r.len()).sum::<usize>(), members.len());
        for range in launches {
            let these = &members[range.clone()];
            let g = group::lower(&shared, these).expect("lower");
            prop_assert_eq!(g.lowered.programs.len(), ranks * ctas as usize);
            let specs: Vec<PlanSpec> = these.iter().map(|m| shared.spec(m, ctas)).collect();
            let ins: Vec<Vec<Vec<u8>>> =
                specs.iter().enumerate().map(|(k, s)| inputs(s, seed ^ (range.start + k) as u64, true)).collect();
            let rows = g.places.iter().map(|p| p.row).max().unwrap() + 1;
            for row in 0..rows {
                let mut bufs: HostBuffers = vec![Default::default(); ranks];
                let here: Vec<usize> = (0..these.len()).filter(|&m| g.places[m].row == row).collect();
                for &m in &here {
                    fill(&specs[m], &ins[m], &mut bufs, g.places[m].input);
                }
                let aliases = g.row_aliases(row, &specs);
                let plan = g.row(row);
                prop_assert_eq!(lowered::check_races(&plan, &aliases), Ok(()));
                lowered::execute(&plan, &mut bufs, &aliases).expect("execute");
                for &m in &here {
                    let got = take(&specs[m], &mut bufs, g.places[m].input);
                    prop_assert!(got == tccl::reference(&specs[m], &ins[m]), "member {} ({:?})", range.start + m, these[m]);
                }
            }
        }
    }
}

/// The addresses a rank's slots hold in place agree with the plan's aliases: every aliased slot is
/// its target slot's address plus the alias offset (the plans address the input through the alias,
/// the launch through the table).
#[test]
fn slot_addresses_agree_with_the_aliases() {
    for collective in Collective::every(1).into_iter().filter(|c| c.has_in_place()) {
        for dtype in [DType::U8, DType::F16, DType::F64] {
            let spec = PlanSpec {
                collective,
                count: 37,
                dtype,
                op: RedOp::Sum,
                ranks: 5,
                in_place: true,
                ctas: 3,
                reduction: Reduction::Registers,
            };
            let aliases = spec.aliases();
            assert_eq!(aliases.len(), 5, "one alias per rank");
            for (r, &(ar, s, tr, ts, off)) in aliases.iter().enumerate() {
                let (input, output) = spec.slot_addresses(r, 0, 0x10_0000);
                let at = |s: u8| if s == slot::INPUT { input } else { output };
                assert_eq!((ar, tr), (r, r));
                assert_eq!(at(s), at(ts) + off, "{collective:?} {dtype:?} rank {r}");
            }
        }
    }
    let out_of_place = PlanSpec {
        collective: Collective::AllGather,
        count: 4,
        dtype: DType::F32,
        op: RedOp::Sum,
        ranks: 2,
        in_place: false,
        ctas: 1,
        reduction: Reduction::Registers,
    };
    assert_eq!(out_of_place.slot_addresses(1, 0x100, 0x200), (0x100, 0x200));
}

/// The buffers a call writes: in place, not a Broadcast's root nor a Reduce's other ranks.
#[test]
fn writes_leaves_the_buffers_a_rooted_call_keeps() {
    let spec = |collective, in_place| PlanSpec {
        collective,
        count: 8,
        dtype: DType::F32,
        op: RedOp::Sum,
        ranks: 3,
        in_place,
        ctas: 1,
        reduction: Reduction::Registers,
    };
    let writes = |s: PlanSpec| (0..3).map(|r| s.writes(r)).collect::<Vec<_>>();
    assert_eq!(writes(spec(Collective::Broadcast { root: 1 }, true)), [true, false, true]);
    assert_eq!(writes(spec(Collective::Broadcast { root: 1 }, false)), [true, true, true]);
    assert_eq!(writes(spec(Collective::Reduce { root: 2 }, true)), [false, false, true]);
    assert_eq!(writes(spec(Collective::Reduce { root: 2 }, false)), [false, false, true]);
    assert_eq!(writes(spec(Collective::AllReduce, true)), [true, true, true]);
}
