//! Input robustness of `reshard` and `tccl`: shapes with a 0 extent, hand-made transfers whose boxes
//! overlap or whose offsets pass 2^64, and in-place specs too large to plan give typed errors or exact
//! results, never a panic (overflow checks on or off), a wrapped value or an abort.

use oxccl_host::reshard::layout::row_major_strides;
use oxccl_host::reshard::{
    Buffers, ExecError, Layout, LayoutError, LowerError, LowerOptions, PlanOptions, Region, ReshardError, ReshardPlan,
    Stage, Transfer, execute_bytes, lower, plan, verify, verify_with_limit,
};
use oxccl_host::tccl::{self, Collective, PlanError, PlanSpec, Reduction};
use oxccl_kernels::abi::{DType, RedOp, slot};

fn layout(mesh: &str, placements: &str) -> Layout {
    Layout::parse(mesh, placements).unwrap()
}

/// `p` with its first transfer changed by `f`.
fn with_first(p: &ReshardPlan, f: impl FnOnce(&mut Transfer)) -> ReshardPlan {
    let mut stages: Vec<Stage> = p.stages().to_vec();
    f(&mut stages[0].transfers[0]);
    p.with_stages(stages)
}

#[test]
fn in_place_aliases_of_a_spec_too_large_to_plan_do_not_wrap() {
    for collective in [Collective::ReduceScatter, Collective::AllGather] {
        let spec = PlanSpec {
            collective,
            count: u64::MAX / 2,
            dtype: DType::F32,
            op: RedOp::Sum,
            ranks: 2,
            in_place: true,
            ctas: 1,
            reduction: Reduction::Registers,
        };
        assert_eq!(tccl::plan(&spec).unwrap_err(), PlanError::TooLarge { count: u64::MAX / 2 });
        let (outer, inner) = match collective {
            Collective::ReduceScatter => (slot::OUTPUT, slot::INPUT),
            _ => (slot::INPUT, slot::OUTPUT),
        };
        // Rank 1's block starts past 2^64 bytes: past any buffer, like `buffer_bytes`' u64::MAX.
        assert_eq!(spec.aliases(), vec![(0, outer, 0, inner, 0), (1, outer, 1, inner, u64::MAX)]);
    }
}

#[test]
fn strides_of_an_empty_tensor_saturate() {
    assert_eq!(row_major_strides(&[0, 1 << 40, 1 << 40]), vec![u64::MAX, 1 << 40, 1]);
    assert_eq!(row_major_strides(&[3, 4, 5]), vec![20, 5, 1]);
}

#[test]
fn a_tensor_with_a_zero_extent_plans_verifies_and_moves_nothing() {
    let (src, dst) = (layout("2", "S0"), layout("2", "R"));
    let p = plan(&[0, 1 << 40, 1 << 40], 4, &src, &dst, PlanOptions::default()).unwrap();
    assert_eq!(p.transfers().count(), 0);
    let report = verify(&p).unwrap();
    assert!(report.is_exact() && report.checked == 0, "{report}");
    let shards = p.src_sharding().local_shards::<f32>(&[]).unwrap();
    assert!(shards.len() == 2 && shards.values().all(Vec::is_empty));
    let out = execute_bytes(&p, &Buffers::new()).unwrap();
    assert!(out.len() == 2 && out.values().all(Vec::is_empty));
    assert_eq!(lower(&p, &LowerOptions::new(2, 1)).unwrap().task_count(), 0);

    // Empty in its last dim only: no "more than 2^64 elements", and 2^80 rows of nothing not walked.
    let p = plan(&[1 << 40, 1 << 40, 0], 4, &layout("2", "S1"), &dst, PlanOptions::default()).unwrap();
    assert_eq!(p.transfers().count(), 0);
    assert!(verify(&p).unwrap().is_exact());
    let shards = p.src_sharding().local_shards::<u8>(&[]).unwrap();
    assert!(shards.len() == 2 && shards.values().all(Vec::is_empty));
}

#[test]
fn a_tensor_past_2_to_the_64_bytes_is_refused() {
    let (src, dst) = (layout("2", "S0"), layout("2", "R"));
    let e = plan(&[1 << 40, 1 << 30], 1, &src, &dst, PlanOptions::default()).unwrap_err();
    assert_eq!(e, ReshardError::Src(LayoutError::ShapeTooLarge { shape: vec![1 << 40, 1 << 30] }));
    let e = plan(&[1 << 40, 1 << 20], 1 << 8, &src, &dst, PlanOptions::default()).unwrap_err();
    assert_eq!(e, ReshardError::TensorTooLarge { shape: vec![1 << 40, 1 << 20], elem_bytes: 1 << 8 });
}

#[test]
fn regions_near_2_to_the_64_do_not_overflow() {
    let huge = Region { start: vec![0, 0], extent: vec![1 << 40, 1 << 40] };
    assert_eq!(huge.volume(), u64::MAX);
    assert_eq!(Region { start: vec![0, 0], extent: vec![0, u64::MAX] }.volume(), 0);
    let a = Region { start: vec![u64::MAX - 1], extent: vec![u64::MAX] };
    let b = Region { start: vec![1], extent: vec![u64::MAX] };
    assert_eq!(a.intersect(&b), Region { start: vec![u64::MAX - 1], extent: vec![1] });
    assert_eq!(a.to_string(), format!("[{}..{}]", u64::MAX - 1, 2 * u128::from(u64::MAX) - 1));
}

/// 16 bytes from rank 0 to rank 1 (one contiguous transfer), for hand-made boxes.
fn copy_16_bytes() -> ReshardPlan {
    plan(&[16], 1, &layout("1", "R"), &layout("1@1", "R"), PlanOptions::default()).unwrap()
}

#[test]
fn executing_a_box_whose_writes_overlap_is_refused_before_allocating() {
    let p = copy_16_bytes();
    let src: Buffers<u8> = [(0, vec![7u8; 16])].into_iter().collect();
    let rows = |n: u64, stride: u64, run: u64| {
        with_first(&p, |t| {
            t.shape = vec![n, run];
            t.src_strides = vec![0];
            t.dst_strides = vec![stride];
            t.bytes = n * run;
        })
    };
    // 2^40 one-byte rows onto one byte: in bounds, but staging their data would abort the process.
    // Then rows onto one byte, and 2-byte rows one byte apart: each writes some byte twice.
    for q in [rows(1 << 40, 0, 1), rows(16, 0, 1), rows(8, 1, 2)] {
        let e = execute_bytes(&q, &src).unwrap_err();
        assert!(
            matches!(e, ExecError::MalformedTransfer { stage: 0, index: 0, ref why } if why.contains("overlap on the write side")),
            "{e}"
        );
    }
    // Rows that tile the destination run (reads may overlap: every row is source byte 0).
    assert_eq!(execute_bytes(&rows(8, 2, 2), &src).unwrap()[&1], vec![7u8; 16]);
}

#[test]
fn lowering_a_box_whose_offsets_pass_2_to_the_64_is_refused() {
    let p = plan(&[4, 4], 4, &layout("1", "R"), &layout("1@1", "R"), PlanOptions::default()).unwrap();
    let src: Buffers<u8> = [(0, vec![1u8; 64])].into_iter().collect();
    // Row 1 is read at 16 + (2^64 - 16), which wraps to 0; and at 2^63 + 2^63, which wraps to 0.
    for (offset, stride) in [(16, u64::MAX - 15), (1 << 63, 1 << 63)] {
        let q = with_first(&p, |t| {
            t.shape = vec![2, 16];
            t.src_strides = vec![stride];
            t.dst_strides = vec![16];
            t.src_offset = offset;
            t.bytes = 32;
        });
        let e = execute_bytes(&q, &src).unwrap_err();
        assert!(matches!(e, ExecError::OutOfBounds { stage: 0, index: 0, buffer: "source", .. }), "{e}");
        let e = lower(&q, &LowerOptions::new(2, 1)).unwrap_err();
        assert_eq!(e, LowerError::MalformedTransfer { stage: 0, index: 0, why: "a run's offset passes 2^64 bytes" });
    }
}

#[test]
fn lowering_runs_summing_past_2_to_the_64_bytes_is_an_invalid_program() {
    let p = copy_16_bytes();
    let mut stages = p.stages().to_vec();
    let t = &mut stages[0].transfers[0];
    t.shape = vec![1 << 63];
    t.bytes = 1 << 63;
    let twice = t.clone();
    stages[0].transfers.push(twice);
    for owner in [oxccl_host::reshard::CtaOwner::Reader, oxccl_host::reshard::CtaOwner::Balanced] {
        let e = lower(&p.with_stages(stages.clone()), &LowerOptions { owner, ..LowerOptions::new(2, 2) }).unwrap_err();
        assert!(matches!(e, LowerError::Invalid { stage: 0, .. }), "{e}");
    }
}

/// Layouts that cut the tensor into more copies than a plan may hold are refused by name, with the
/// plan's memory bounded (2048 × 2048 pieces: four million copies asked for).
#[test]
fn a_reshard_of_too_many_copies_is_refused() {
    let (src, dst) = (layout("2048", "S0"), layout("2048@2048", "S1"));
    let e = plan(&[2048, 2048], 4, &src, &dst, PlanOptions::default()).unwrap_err();
    assert_eq!(e, ReshardError::TooManyTransfers { max: oxccl_host::reshard::MAX_TRANSFERS });
    assert!(e.to_string().contains("more than 1048576 copies"), "{e}");
}

/// A destination replicated over half a million ranks asks the CPU executor (and `local_shards`) for a
/// copy of the tensor per rank, 8 TiB here: a typed refusal, not an allocation abort.
#[test]
fn host_buffers_past_memory_are_refused() {
    let (src, dst) = (layout("1", "R"), layout("524288", "R"));
    // One copy per destination rank (the hierarchical route forwards within domains: more copies).
    let options = PlanOptions { route: oxccl_host::reshard::Route::Direct, ..PlanOptions::default() };
    let p = plan(&[1 << 24], 1, &src, &dst, options).unwrap();
    let global = vec![7u8; 1 << 24];
    let shards = p.src_sharding().local_shards(&global).unwrap();
    let e = execute_bytes(&p, &shards).unwrap_err();
    assert_eq!(e, ExecError::DestinationTooLarge { bytes: 1 << 43 });
    let e = p.dst_sharding().local_shards(&global).unwrap_err();
    assert_eq!(e, LayoutError::ShardsTooLarge { bytes: 1 << 43 });
}

/// A caller's tag limit past what the host allocates is held to the host bound: a tensor of 2^61
/// elements is refused, not a capacity overflow.
#[test]
fn verify_holds_any_limit_to_the_host_bound() {
    use oxccl_host::reshard::layout::HOST_BUFFERS_LIMIT_BYTES;
    let l = layout("1@0", "R");
    let p = plan(&[1 << 61], 1, &l, &l, PlanOptions::default()).unwrap();
    for limit in [u64::MAX, HOST_BUFFERS_LIMIT_BYTES + 1] {
        let e = verify_with_limit(&p, limit).unwrap_err();
        assert_eq!(e, ExecError::TooLargeToVerify { bytes: u64::MAX, limit: HOST_BUFFERS_LIMIT_BYTES });
    }
    // Within the bound, a large limit verifies as the default does.
    let p = plan(&[64], 1, &l, &l, PlanOptions::default()).unwrap();
    assert_eq!(verify_with_limit(&p, u64::MAX).unwrap().wrong, 0);
}

/// Descriptors index a stage's tasks with `u32`: a task limit past that would let the count wrap.
#[test]
fn a_task_limit_past_32_bits_is_refused() {
    let l = layout("2@0", "S0");
    let p = plan(&[64], 4, &l, &layout("2@0", "R"), PlanOptions::default()).unwrap();
    let max = LowerOptions::MAX_TASKS_LIMIT;
    assert_eq!(max, u32::MAX as u64);
    for max_tasks in [max + 1, u64::MAX] {
        let e = lower(&p, &LowerOptions { max_tasks, ..LowerOptions::new(2, 1) }).unwrap_err();
        assert_eq!(e, LowerError::MaxTasks { max_tasks, max });
        assert!(e.to_string().contains(&format!("at most {max} tasks")), "{e}");
    }
    lower(&p, &LowerOptions { max_tasks: max, ..LowerOptions::new(2, 1) }).unwrap();
}
