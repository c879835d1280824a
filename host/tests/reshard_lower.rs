//! Tests of `reshard::lower` and `reshard::workaround`: lowered programs are race-free, run on host
//! buffers with the engine's semantics (`lowered::execute`, stage after stage) they reproduce every
//! destination shard exactly, byte for byte the same as the reshard CPU executor; CTAs are balanced;
//! every lowering error is typed; the text form of TP4 → TP2 × DP2; task counts of the layer-sized case.

mod reshard_common;

use oxccl_host::lowered::HostBuffers;
use oxccl_host::reshard::workaround::{flat_sends, gather_broadcast};
use oxccl_host::reshard::{
    CtaOwner, Layout, LowerError, LowerOptions, LoweredReshard, PlanOptions, ReadFrom, ReshardPlan, Route, Stage,
    execute_bytes, lower, plan,
};
use oxccl_kernels::abi::{DType, MAX_RANKS, TaskKind, slot};
use proptest::prelude::*;
use rand::SeedableRng;
use rand::rngs::StdRng;
use reshard_common::{Problem, problem_in};
use std::collections::BTreeMap;

fn layout(mesh: &str, placements: &str) -> Layout {
    Layout::parse(mesh, placements).unwrap()
}

/// A global tensor of `n` elements of `elem` bytes with every byte pseudo-random.
fn global_bytes(n: u64, elem: u64, seed: u64) -> Vec<u8> {
    let mut bytes = vec![0u8; (n * elem) as usize];
    StdRng::seed_from_u64(seed).fill_bytes(&mut bytes);
    bytes
}

/// Every rank's shard of a layout, as bytes cut from `global` (elements of `elem` bytes).
fn shards(sharding: &oxccl_host::reshard::Sharding, global: &[u8], elem: u64) -> BTreeMap<u32, Vec<u8>> {
    let index: Vec<u64> = (0..sharding.elements()).collect();
    let e = elem as usize;
    sharding
        .local_shards(&index)
        .unwrap()
        .into_iter()
        .map(|(r, idx)| (r, idx.iter().flat_map(|&i| global[i as usize * e..(i as usize + 1) * e].to_vec()).collect()))
        .collect()
}

/// Runs a lowered program on host buffers filled with the source shards of `global`; returns the
/// buffers after the last stage.
fn run(l: &LoweredReshard, plan: &ReshardPlan, global: &[u8]) -> HostBuffers {
    let mut bufs = l.host_buffers();
    for (r, shard) in shards(plan.src_sharding(), global, plan.elem_bytes()) {
        bufs[r as usize][slot::INPUT as usize] = shard;
    }
    l.execute(&mut bufs).unwrap_or_else(|e| panic!("{e}\n{l}"));
    bufs
}

/// Checks every destination rank's output buffer against its shard of `global`.
fn assert_delivers(bufs: &HostBuffers, plan: &ReshardPlan, global: &[u8], what: &str) {
    for (r, want) in shards(plan.dst_sharding(), global, plan.elem_bytes()) {
        assert!(bufs[r as usize][slot::OUTPUT as usize] == want, "{what}: rank {r}'s destination shard differs");
    }
}

/// Structural invariants of every lowered program: rank-major CTAs, every rank `ctas` of them with the
/// full barrier set, single-source single-destination `Move`s of the unit dtype, CTA spans balanced to
/// within 16 bytes of the owner's even share.
fn assert_well_formed(l: &LoweredReshard, opts: &LowerOptions) {
    let c = opts.ctas as usize;
    let all = if opts.ranks > 1 { (1u32 << opts.ranks) - 1 } else { 0 };
    for stage in &l.stages {
        assert_eq!(stage.programs.len(), opts.ranks * c);
        assert_eq!((stage.slots, stage.combines), (1, false));
        for (i, p) in stage.programs.iter().enumerate() {
            assert_eq!((p.rank as usize, p.cta as usize, p.barrier_ranks), (i / c, i % c, all));
        }
        for t in &stage.tasks {
            assert_eq!((t.kind, t.dtype, t.flags), (TaskKind::Move.raw(), l.dtype.raw(), 0));
            assert_eq!((t.src_ranks.count_ones(), t.dst_ranks.count_ones()), (1, 1));
            assert!(t.bytes > 0);
        }
        for rank in stage.programs.chunks(c) {
            let bytes: Vec<u64> = rank
                .iter()
                .map(|p| stage.tasks[p.first_task as usize..][..p.task_count as usize].iter().map(|t| t.bytes).sum())
                .collect();
            let total: u64 = bytes.iter().sum();
            for (k, &b) in bytes.iter().enumerate() {
                let lo = total * k as u64 / c as u64;
                let hi = total * (k as u64 + 1) / c as u64;
                assert!(
                    b.abs_diff(hi - lo) <= 16,
                    "CTA {k} of rank {} has {b} of {total} bytes: {bytes:?}",
                    rank[0].rank
                );
            }
        }
    }
}

/// Whether any offset, stride or run of the plan is odd (then odd-sized elements have no copy unit).
fn has_odd_geometry(plan: &ReshardPlan) -> bool {
    plan.transfers().any(|(_, t)| {
        [t.src_offset, t.dst_offset, t.run_bytes()]
            .iter()
            .chain(&t.src_strides)
            .chain(&t.dst_strides)
            .any(|v| v % 2 != 0)
    })
}

fn check_problem(p: &Problem, route: Route, ctas: u32, owner: CtaOwner) -> Result<(), TestCaseError> {
    let plan = p.plan(route);
    let opts = LowerOptions { owner, ..LowerOptions::new(MAX_RANKS, ctas) };
    let n: u64 = p.shape.iter().product();
    let global = global_bytes(n, p.elem_bytes, n * 31 + p.elem_bytes);
    let lowered = match lower(&plan, &opts) {
        Err(LowerError::NoCopyUnit { elem_bytes, .. }) => {
            prop_assert!(elem_bytes % 2 == 1 && has_odd_geometry(&plan));
            return Ok(());
        }
        other => other.unwrap(),
    };
    prop_assert!(p.elem_bytes.is_multiple_of(2) || !has_odd_geometry(&plan));
    prop_assert_eq!(lowered.stages.len(), plan.stages().len());
    assert_well_formed(&lowered, &opts);
    lowered.check_races().unwrap();
    // Lowering keeps every byte: the loads are the plan's traffic.
    let loads = lowered.loads(p.domain_size);
    prop_assert_eq!(loads.between_ranks, plan.traffic().bytes_total);
    prop_assert_eq!(loads.local, plan.traffic().bytes_local);
    // No more tasks than runs, plus one split per CTA boundary.
    let runs: u64 = plan.transfers().map(|(_, t)| t.shape[..t.shape.len() - 1].iter().product::<u64>()).sum();
    let splits = (MAX_RANKS as u64) * u64::from(ctas - 1) * plan.stages().len() as u64;
    prop_assert!(lowered.task_count() as u64 <= runs + splits);

    let bufs = run(&lowered, &plan, &global);
    assert_delivers(&bufs, &plan, &global, "plan");
    // Byte for byte what the reshard CPU executor produces.
    let cpu = execute_bytes(&plan, &shards(plan.src_sharding(), &global, p.elem_bytes)).unwrap();
    for (r, out) in cpu {
        prop_assert_eq!(&bufs[r as usize][slot::OUTPUT as usize], &out);
    }

    // The workarounds deliver the same shards, moving what the traffic accounting says (their boxes
    // differ from the plan's, so odd-sized elements may have no copy unit there).
    let t = plan.traffic();
    let flat = flat_sends(&plan);
    prop_assert_eq!(flat.traffic().bytes_total + flat.traffic().bytes_local, t.flat_sends.bytes_total);
    prop_assert_eq!(flat.traffic().bytes_cross_domain, t.flat_sends.bytes_cross_domain);
    match lower(&flat, &opts) {
        Err(LowerError::NoCopyUnit { .. }) => prop_assert!(p.elem_bytes % 2 == 1 && has_odd_geometry(&flat)),
        lf => {
            let lf = lf.unwrap();
            assert_well_formed(&lf, &opts);
            assert_delivers(&run(&lf, &flat, &global), &flat, &global, "flat sends");
        }
    }
    match gather_broadcast(&plan, &opts) {
        Err(LowerError::NoCopyUnit { .. }) => prop_assert!(p.elem_bytes % 2 == 1),
        gb => {
            let gb = gb.unwrap();
            assert_well_formed(&gb, &opts);
            assert_delivers(&run(&gb, &plan, &global), &plan, &global, "gather + broadcast");
            prop_assert_eq!(gb.loads(p.domain_size).between_ranks, t.gather_broadcast.bytes_total);
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(192))]

    /// Random problems inside 16 ranks (element sizes 1, 2, 3, 4, 8; overlapping, disjoint and
    /// coinciding meshes; uneven and empty shards), both routes, 1 to 4 CTAs per rank, every owner.
    #[test]
    fn lowered_plans_deliver_every_destination_shard(
        p in problem_in(MAX_RANKS as u32),
        ctas in 1u32..=4,
        owner in prop::sample::select(vec![CtaOwner::Reader, CtaOwner::Writer, CtaOwner::Balanced]),
    ) {
        for route in [Route::Direct, Route::Hierarchical] {
            check_problem(&p, route, ctas, owner)?;
        }
    }
}

#[test]
fn tp4_to_tp2xdp2_text_form() {
    // Rows over ranks 0..4 → TP2 × DP2 on ranks 4..8, domains of 4: one landing per row, forwarded once.
    let p =
        plan(&[4, 8], 4, &layout("1x4@0", "R,S0"), &layout("2x2@4", "R,S0"), PlanOptions::new(Route::Hierarchical, 4))
            .unwrap();
    let l = lower(&p, &LowerOptions::new(8, 1)).unwrap();
    let want = "\
lowered: unit F32, 8 ranks, 1 CTAs per rank, 2 stages, 8 tasks
stage 0: 4 tasks
  cta 0.0
    move 0:in@0 -> 4:out@0 32B
  cta 1.0
    move 1:in@0 -> 6:out@32 32B
  cta 2.0
    move 2:in@0 -> 5:out@0 32B
  cta 3.0
    move 3:in@0 -> 7:out@32 32B
stage 1: 4 tasks
  cta 4.0
    move 4:out@0 -> 6:out@0 32B
  cta 5.0
    move 5:out@0 -> 7:out@0 32B
  cta 6.0
    move 6:out@32 -> 4:out@32 32B
  cta 7.0
    move 7:out@32 -> 5:out@32 32B
";
    assert_eq!(l.to_string(), want);
    // Writers own the copies instead; two CTAs per rank split each 32-byte run at a 16-byte boundary.
    let l = lower(&p, &LowerOptions { owner: CtaOwner::Writer, ..LowerOptions::new(8, 2) }).unwrap();
    let want = "\
lowered: unit F32, 8 ranks, 2 CTAs per rank, 2 stages, 16 tasks
stage 0: 8 tasks
  cta 4.0
    move 0:in@0 -> 4:out@0 16B
  cta 4.1
    move 0:in@16 -> 4:out@16 16B
  cta 5.0
    move 2:in@0 -> 5:out@0 16B
  cta 5.1
    move 2:in@16 -> 5:out@16 16B
  cta 6.0
    move 1:in@0 -> 6:out@32 16B
  cta 6.1
    move 1:in@16 -> 6:out@48 16B
  cta 7.0
    move 3:in@0 -> 7:out@32 16B
  cta 7.1
    move 3:in@16 -> 7:out@48 16B
stage 1: 8 tasks
  cta 4.0
    move 6:out@32 -> 4:out@32 16B
  cta 4.1
    move 6:out@48 -> 4:out@48 16B
  cta 5.0
    move 7:out@32 -> 5:out@32 16B
  cta 5.1
    move 7:out@48 -> 5:out@48 16B
  cta 6.0
    move 4:out@0 -> 6:out@0 16B
  cta 6.1
    move 4:out@16 -> 6:out@16 16B
  cta 7.0
    move 5:out@0 -> 7:out@0 16B
  cta 7.1
    move 5:out@16 -> 7:out@16 16B
";
    assert_eq!(l.to_string(), want);
    let s0 = &l.stages[0];
    let rank4: Vec<_> = s0.programs.iter().filter(|p| p.rank == 4).collect();
    assert_eq!(rank4.iter().map(|p| p.task_count).collect::<Vec<_>>(), vec![1, 1]);
    let t: Vec<_> = s0.tasks[rank4[0].first_task as usize..][..2].iter().map(|t| (t.src_offset, t.bytes)).collect();
    assert_eq!(t, vec![(0, 16), (16, 16)]);
    // Direct: every destination rank is sent its two rows by the source ranks, in one stage.
    let d = plan(&[4, 8], 4, &layout("1x4@0", "R,S0"), &layout("2x2@4", "R,S0"), PlanOptions::new(Route::Direct, 4))
        .unwrap();
    let l = lower(&d, &LowerOptions::new(8, 1)).unwrap();
    assert_eq!(l.tasks_per_stage(), vec![8]);
}

#[test]
fn short_rows_are_one_task_each_and_adjacent_runs_merge() {
    // [6, 4] u16 columns 0..2 and 2..4 on ranks 0, 1 → rows on ranks 2, 3: 4-byte rows, one task each.
    let p = plan(&[6, 4], 2, &layout("2@0", "S1"), &layout("2@2", "S0"), PlanOptions::new(Route::Direct, 8)).unwrap();
    let l = lower(&p, &LowerOptions::new(4, 1)).unwrap();
    assert_eq!(l.task_count(), 12);
    assert!(l.stages[0].tasks.iter().all(|t| t.bytes == 4));
    assert_eq!(l.dtype, DType::F16);
    // Adjacent parts of one (reader, writer) pair merge into one task: the planner lands the two halves
    // of a piece on ranks 2 and 3 and each forwards its half; a hand-made plan landing both on rank 2,
    // which forwards both to rank 3, needs one task per stage.
    let src = layout("1@0", "R");
    let dst = layout("2@2", "R");
    let p =
        plan(&[4, 8], 4, &src, &dst, PlanOptions { min_split_bytes: 0, ..PlanOptions::new(Route::Hierarchical, 2) })
            .unwrap();
    assert_eq!(p.stages()[0].transfers.len(), 2);
    let mut stage0 = p.stages()[0].clone();
    let mut stage1 = Stage::default();
    for t in &mut stage0.transfers {
        t.dst = 2;
        let mut fwd = t.clone();
        (fwd.src, fwd.dst, fwd.read, fwd.src_offset) = (2, 3, ReadFrom::Dst, t.dst_offset);
        stage1.transfers.push(fwd);
    }
    let merged = p.with_stages(vec![stage0, stage1]);
    assert!(oxccl_host::reshard::verify(&merged).unwrap().is_exact());
    let l = lower(&merged, &LowerOptions::new(4, 1)).unwrap();
    assert_eq!(l.tasks_per_stage(), vec![1, 1]);
    assert_eq!(l.stages[1].tasks[0].bytes, 128);
}

#[test]
fn copy_units() {
    let (s, d) = (layout("2@0", "S0"), layout("2@2", "S1"));
    let unit = |shape: &[u64], elem, dtype| {
        let p = plan(shape, elem, &s, &d, PlanOptions::default()).unwrap();
        lower(&p, &LowerOptions { dtype, ..LowerOptions::new(4, 1) }).map(|l| l.dtype)
    };
    assert_eq!(unit(&[4, 8], 4, None), Ok(DType::F32));
    assert_eq!(unit(&[4, 8], 8, None), Ok(DType::F32));
    assert_eq!(unit(&[4, 8], 2, None), Ok(DType::F16));
    assert_eq!(unit(&[4, 8], 2, Some(DType::Bf16)), Ok(DType::Bf16));
    assert_eq!(unit(&[4, 8], 6, None), Ok(DType::F16));
    // Bytes: columns of 4 bytes fit a 4-byte unit, of 2 bytes a 2-byte one, of 1 byte none.
    assert_eq!(unit(&[4, 8], 1, None), Ok(DType::F32));
    assert_eq!(unit(&[4, 4], 1, None), Ok(DType::F16));
    assert_eq!(unit(&[4, 2], 1, None), Err(LowerError::NoCopyUnit { elem_bytes: 1, stage: 0, index: 0, value: 1 }));
    assert_eq!(unit(&[4, 8], 2, Some(DType::F32)), Err(LowerError::DTypeSize { dtype: DType::F32, elem_bytes: 2 }));
    let e = unit(&[4, 2], 3, None).unwrap_err();
    assert_eq!(
        e.to_string(),
        "3-byte elements: stage 0 transfer 0 has an odd offset, stride or run (3 bytes), and the engine copies \
         whole 2- or 4-byte units"
    );
}

#[test]
fn errors_are_typed() {
    let p = plan(&[4, 8], 4, &layout("4@0", "S0"), &layout("2x2@4", "R,S0"), PlanOptions::default()).unwrap();
    let err = |o: LowerOptions| lower(&p, &o).unwrap_err();
    assert_eq!(err(LowerOptions::new(0, 1)), LowerError::Ranks { ranks: 0, max: MAX_RANKS });
    assert_eq!(err(LowerOptions::new(17, 1)), LowerError::Ranks { ranks: 17, max: MAX_RANKS });
    assert_eq!(err(LowerOptions::new(8, 0)), LowerError::Ctas { ctas: 0, max: 256 });
    assert_eq!(err(LowerOptions::new(8, 257)), LowerError::Ctas { ctas: 257, max: 256 });
    assert_eq!(
        err(LowerOptions::new(6, 1)),
        LowerError::MeshOutOfRange { side: "destination", last_rank: 7, ranks: 6 }
    );
    assert_eq!(err(LowerOptions::new(3, 1)), LowerError::MeshOutOfRange { side: "source", last_rank: 3, ranks: 3 });
    assert_eq!(
        err(LowerOptions { max_tasks: 3, ..LowerOptions::new(8, 1) }),
        LowerError::TooManyTasks { stage: 0, tasks: 8, max: 3 }
    );
    assert_eq!(
        err(LowerOptions::new(6, 1)).to_string(),
        "the destination mesh reaches rank 7 but the communicator has 6 ranks"
    );
    // Hand-made plans: a forward in stage 0, a rank past the communicator, a box past a buffer.
    let mut stages = p.stages().to_vec();
    stages[0].transfers[0].read = ReadFrom::Dst;
    let e = lower(&p.with_stages(stages), &LowerOptions::new(8, 1)).unwrap_err();
    assert!(matches!(e, LowerError::MalformedTransfer { stage: 0, index: 0, .. }), "{e}");
    let mut stages = p.stages().to_vec();
    stages[0].transfers[0].dst = 12;
    let e = lower(&p.with_stages(stages), &LowerOptions::new(8, 1)).unwrap_err();
    assert_eq!(e, LowerError::RankOutOfRange { stage: 0, index: 0, rank: 12, ranks: 8 });
    let mut stages = p.stages().to_vec();
    stages[0].transfers[0].dst_offset = 64;
    let e = lower(&p.with_stages(stages), &LowerOptions::new(8, 1)).unwrap_err();
    assert!(matches!(e, LowerError::Invalid { stage: 0, .. }), "{e}");
}

/// The layer-sized case of the GPU benchmark: a 7168 × 18432 bf16 weight, TP8 on ranks 0..8 → TP2 × DP4
/// on ranks 8..16, 8 CTAs per rank. Task counts are what docs/RESHARD.md quotes; the time to lower and
/// race-check the column-sharded case is checked by `cargo bench -p oxccl-host --bench planners`.
#[test]
fn layer_sized_task_counts() {
    let shape = [7168, 18432];
    let dst = layout("4x2@8", "R,S0");
    let opts = LowerOptions { dtype: Some(DType::Bf16), ..LowerOptions::new(16, 8) };
    let rows = plan(&shape, 2, &layout("8@0", "S0"), &dst, PlanOptions::default()).unwrap();
    let l = lower(&rows, &opts).unwrap();
    l.check_races().unwrap();
    assert_eq!(l.tasks_per_stage(), vec![64, 128]);
    let loads = l.loads(8);
    assert_eq!(loads.between_ranks, rows.traffic().bytes_total);
    assert_eq!(loads.sent.iter().max(), Some(&rows.traffic().max_bytes_sent_by_a_rank));
    let flat = lower(&flat_sends(&rows), &opts).unwrap();
    assert_eq!(flat.tasks_per_stage(), vec![64]);
    let gb = gather_broadcast(&rows, &opts).unwrap();
    assert_eq!(gb.tasks_per_stage(), vec![64, 8, 64]);
    let direct = PlanOptions::new(Route::Direct, 8);
    let rows_direct = plan(&shape, 2, &layout("8@0", "S0"), &dst, direct).unwrap();
    assert_eq!(lower(&rows_direct, &opts).unwrap().tasks_per_stage(), vec![64]);

    // Column-sharded source (TP8 on dim 1): every piece landed in stage 0 is 896 rows of 4608 bytes, one
    // task per row; forwarding merges the eight column blocks of a leader's rows back into one range per
    // (leader, peer).
    let cols = plan(&shape, 2, &layout("8@0", "S1"), &dst, PlanOptions::default()).unwrap();
    let l = lower(&cols, &opts).unwrap();
    assert_eq!(l.tasks_per_stage(), vec![57_344, 80]);
    l.check_races().unwrap();
    let cols_direct = plan(&shape, 2, &layout("8@0", "S1"), &dst, direct).unwrap();
    assert_eq!(lower(&cols_direct, &opts).unwrap().tasks_per_stage(), vec![229_376]);
}
