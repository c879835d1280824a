//! Reshards from a `Partial` source (ranks holding partial sums of their boxes, DTensor's pending
//! sum): plans verify on random problems (both routes), the CPU executor and the lowered program
//! (engine semantics) deliver the sum exactly on integer data, the bytes moved are what the
//! accounting promises (a reduce-scatter's and an AllReduce's), and misuse is typed.

mod reshard_common;

use oxccl_host::lowered::HostBuffers;
use oxccl_host::reshard::workaround::{flat_sends, gather_broadcast};
use oxccl_host::reshard::{
    Buffers, ExecError, Layout, LayoutError, LowerError, LowerOptions, Mesh, Placement, PlanOptions, Rank,
    ReshardError, ReshardPlan, Route, Sharding, execute, execute_summing, lower, plan, verify,
};
use oxccl_kernels::abi::{DType, MAX_RANKS, slot};
use proptest::prelude::*;
use reshard_common::{Problem, partial_problem_in};

fn layout(mesh: &str, placements: &str) -> Layout {
    Layout::parse(mesh, placements).unwrap()
}

/// The same mesh with every `Partial` axis replicated: the boxes each rank covers.
fn boxes(sharding: &Sharding) -> Sharding {
    let l = sharding.layout();
    let placements =
        l.placements().iter().map(|&p| if p == Placement::Partial { Placement::Replicate } else { p }).collect();
    Layout::new(l.mesh().clone(), placements).unwrap().on(sharding.shape()).unwrap()
}

/// Pseudo-random u32 values, `n` of them, from `seed`.
fn values(n: u64, seed: u64) -> Vec<u32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 16) as u32
        })
        .collect()
}

/// Random partial sums of a plan's source: partial index `i` holds its own random tensor `G_i`
/// (every replica the same box of it). Returns every source rank's buffer and the global tensor
/// `Σ G_i` (wrapping), what the destination must hold.
fn partial_sums(plan: &ReshardPlan, seed: u64) -> (Buffers<u32>, Vec<u32>) {
    let src = plan.src_sharding();
    let n = src.elements();
    let mut global = vec![0u32; n as usize];
    let mut buffers = Buffers::new();
    let covered = boxes(src);
    for i in 0..src.partial_sums() {
        let g = values(n, seed + i);
        for (acc, v) in global.iter_mut().zip(&g) {
            *acc = acc.wrapping_add(*v);
        }
        for (rank, shard) in covered.local_shards(&g).unwrap() {
            if src.partial_index(rank) == Some(i) {
                buffers.insert(rank, shard);
            }
        }
    }
    (buffers, global)
}

fn check(p: &Problem, route: Route) -> Result<(), TestCaseError> {
    let plan = p.plan(route);
    // Tags: every destination element holds the full sum of its partial sums.
    let report = verify(&plan).unwrap();
    prop_assert!(report.is_exact(), "{}", report);
    let t = plan.traffic();
    if route == Route::Direct {
        prop_assert_eq!(t.bytes_total, t.bytes_needed);
    }
    // Every summing transfer reads one replica of every partial sum.
    let sums = plan.src_sharding().partial_sums() as usize;
    for (_, tr) in plan.transfers().filter(|(_, tr)| tr.reduces()) {
        // Ascending ranks holding partial sums 0, 1, ...: every sum adds them in one order.
        let indices: Vec<u64> = tr.sources().map(|r| plan.src_sharding().partial_index(r).unwrap()).collect();
        prop_assert_eq!(indices, (0..sums as u64).collect::<Vec<_>>());
        prop_assert!(tr.sources().collect::<Vec<_>>().windows(2).all(|w| w[0] < w[1]));
    }
    if p.elem_bytes != 4 {
        return Ok(());
    }
    // Real data: the CPU executor and the lowered program (engine semantics) give the sum exactly.
    let (src, global) = partial_sums(&plan, p.shape.iter().product::<u64>() * 7 + 1);
    let want = plan.dst_sharding().local_shards(&global).unwrap();
    let cpu = execute_summing(&plan, &src, u32::wrapping_add).unwrap();
    prop_assert_eq!(&cpu, &want);
    let opts = LowerOptions { dtype: Some(DType::U32), ..LowerOptions::new(MAX_RANKS, 3) };
    let lowered = lower(&plan, &opts).unwrap();
    lowered.check_races().unwrap();
    let loads = lowered.loads(p.domain_size);
    prop_assert_eq!(loads.between_ranks, t.bytes_total);
    prop_assert_eq!(loads.local, t.bytes_local);
    let run = |l: &oxccl_host::reshard::LoweredReshard| -> HostBuffers {
        let mut bufs = l.host_buffers();
        for (&r, shard) in &src {
            bufs[r as usize][slot::INPUT as usize] = shard.iter().flat_map(|v| v.to_le_bytes()).collect();
        }
        l.execute(&mut bufs).unwrap_or_else(|e| panic!("{e}\n{l}"));
        bufs
    };
    let delivered = |bufs: &HostBuffers, what: &str| -> Result<(), TestCaseError> {
        for (&r, shard) in &want {
            let bytes: Vec<u8> = shard.iter().flat_map(|v| v.to_le_bytes()).collect();
            prop_assert_eq!(&bufs[r as usize][slot::OUTPUT as usize], &bytes, "{} rank {}", what, r);
        }
        Ok(())
    };
    delivered(&run(&lowered), "plan")?;
    // The workarounds sum too, moving what the accounting says.
    let flat = flat_sends(&plan);
    prop_assert_eq!(flat.traffic().bytes_total + flat.traffic().bytes_local, t.flat_sends.bytes_total);
    prop_assert_eq!(flat.traffic().bytes_cross_domain, t.flat_sends.bytes_cross_domain);
    delivered(&run(&lower(&flat, &opts).unwrap()), "flat sends")?;
    let gb = gather_broadcast(&plan, &opts).unwrap();
    prop_assert_eq!(gb.loads(p.domain_size).between_ranks, t.gather_broadcast.bytes_total);
    delivered(&run(&gb), "gather + broadcast")?;
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(160))]

    /// Random partial sources inside 16 ranks (one to three mesh axes, at least one `Partial`, mixed
    /// with `R` and `S<dim>`) to random `R`/`S` destinations, element sizes 1 to 8, both routes.
    #[test]
    fn partial_sources_reach_every_destination_summed(
        p in partial_problem_in(MAX_RANKS as u32, vec![1, 2, 4, 4, 4, 8]),
    ) {
        for route in [Route::Direct, Route::Hierarchical] {
            check(&p, route)?;
        }
    }
}

/// `n` ranks of one domain holding partial sums of a `[rows, 16]` u32 tensor, to `dst`: the most
/// bytes any rank receives.
fn received(n: u32, rows: u64, dst: &str) -> u64 {
    let src = Layout::new(Mesh::new(vec![n], 0).unwrap(), vec![Placement::Partial]).unwrap();
    let dst = layout(&n.to_string(), dst);
    let options = PlanOptions { route: Route::Hierarchical, domain_size: 8, min_split_bytes: 0 };
    let p = plan(&[rows, 16], 4, &src, &dst, options).unwrap();
    assert!(verify(&p).unwrap().is_exact());
    p.traffic().max_bytes_received_by_a_rank
}

#[test]
fn partial_to_shard_is_a_reduce_scatter_and_to_replicate_an_all_reduce() {
    for n in [2u32, 4, 8] {
        let tensor = 64 * 16 * 4;
        let n64 = u64::from(n);
        // P → S0: each rank sums its shard from the n - 1 others: (n - 1)/n of the tensor.
        assert_eq!(received(n, 64, "S0"), (n64 - 1) * tensor / n64, "{n} ranks, P -> S0");
        // P → R: a reduce-scatter, then an all-gather: 2 (n - 1)/n of the tensor, as a ring's.
        assert_eq!(received(n, 64, "R"), 2 * (n64 - 1) * tensor / n64, "{n} ranks, P -> R");
    }
}

#[test]
fn summing_plans_have_a_text_form() {
    // Two ranks of partial sums of a [2, 4] tensor to rows: each rank sums its row from both.
    let p = plan(&[2, 4], 4, &layout("2", "P"), &layout("2", "S0"), PlanOptions::default()).unwrap();
    let l = lower(&p, &LowerOptions { dtype: Some(DType::F32), ..LowerOptions::new(2, 1) }).unwrap();
    assert_eq!(
        l.to_string(),
        "lowered: unit F32, 2 ranks, 1 CTAs per rank, 2 stages, 2 tasks\n\
         stage 0: 2 tasks\n  cta 0.0\n    move 0+1:in@0 -> 0:out@0 16B\n  cta 1.0\n    move 0+1:in@16 -> 1:out@0 16B\n\
         stage 1: 0 tasks\n"
    );
    // Sums are run by their writers, and need a slot per source.
    assert_eq!(l.stages[0].slots, 2);
    assert!(l.stages[0].combines);
}

#[test]
fn misuse_is_typed() {
    let options = PlanOptions::default();
    // A destination of partial sums.
    assert_eq!(
        plan(&[4], 4, &layout("2", "S0"), &layout("2", "P"), options).unwrap_err(),
        ReshardError::Dst(LayoutError::PartialDestination { axis: 0 })
    );
    let p = plan(&[4], 4, &layout("2", "P"), &layout("2", "R"), options).unwrap();
    // Summing needs the element type as the unit.
    for dtype in [None, Some(DType::F16), Some(DType::F64)] {
        let e = lower(&p, &LowerOptions { dtype, ..LowerOptions::new(2, 1) }).unwrap_err();
        assert_eq!(e, LowerError::SumUnit { elem_bytes: 4, dtype });
    }
    // Copying executors refuse a plan that sums; the summing one needs whole elements.
    let src: Buffers<u8> = (0..2).map(|r: Rank| (r, vec![0u8; 16])).collect();
    assert!(matches!(execute(&p, 1, &src), Err(ExecError::NeedsSum { stage: 0, .. })));
    assert!(matches!(execute_summing(&p, &src, u8::wrapping_add), Err(ExecError::ElementSize { plan: 4, given: 1 })));
}

#[test]
fn a_sum_missing_a_partial_sum_is_caught() {
    let p = plan(&[3, 5], 4, &layout("2x2", "P,S1"), &layout("4", "R"), PlanOptions::default()).unwrap();
    assert!(verify(&p).unwrap().is_exact());
    let mut stages = p.stages().to_vec();
    let t = stages[0].transfers.iter_mut().find(|t| t.reduces()).unwrap();
    t.partials.clear();
    let r = verify(&p.with_stages(stages)).unwrap();
    assert!(!r.is_exact());
    assert!(r.first.iter().all(|m| m.found == oxccl_host::reshard::Found::Other), "{r}");
}

#[test]
fn partial_sums_combine_with_the_calls_operator() {
    // Four ranks of partial values of a [4, 8] i32 tensor, to rows and to replicas, both routes.
    for (dst, route) in [("S0", Route::Direct), ("S0", Route::Hierarchical), ("R", Route::Hierarchical)] {
        let options = PlanOptions { route, domain_size: 8, min_split_bytes: 0 };
        let p = plan(&[4, 8], 4, &layout("4", "P"), &layout("4", dst), options).unwrap();
        let part = |r: i32, i: i32| (r * 37 + i * 11) % 23 - 11;
        for (op, fold) in [
            (oxccl_kernels::abi::RedOp::Max, (|a: i32, b: i32| a.max(b)) as fn(i32, i32) -> i32),
            (oxccl_kernels::abi::RedOp::Avg, |a: i32, b: i32| a + b),
        ] {
            let opts = LowerOptions { dtype: Some(DType::I32), op, ..LowerOptions::new(4, 2) };
            let l = lower(&p, &opts).unwrap();
            let mut bufs = l.host_buffers();
            for (r, b) in bufs.iter_mut().enumerate() {
                b[slot::INPUT as usize] = (0..32).flat_map(|i| part(r as i32, i).to_le_bytes()).collect();
            }
            l.execute(&mut bufs).unwrap();
            let whole: Vec<i32> = (0..32)
                .map(|i| {
                    let v = (1..4).fold(part(0, i), |acc, r| fold(acc, part(r, i)));
                    if op == oxccl_kernels::abi::RedOp::Avg { v / 4 } else { v }
                })
                .collect();
            for r in 0..4u32 {
                let want = p.dst_sharding().local_shards(&whole).unwrap().remove(&r).unwrap();
                let got: Vec<i32> = bufs[r as usize][slot::OUTPUT as usize]
                    .chunks(4)
                    .map(|b| i32::from_le_bytes(b.try_into().unwrap()))
                    .collect();
                assert_eq!(got, want, "{op:?} to {dst} ({route}), rank {r}");
            }
        }
    }
}

/// Every replica of a destination sums the partial sums in one order (each sum reads one set of
/// them, ascending by partial index), so float sums are the same bits on every replica, whichever
/// axis is partial, on both routes.
#[test]
fn replicas_hold_the_same_float_sum() {
    for (mesh, placements) in [("2x3", "R,P"), ("3x2", "P,R"), ("2x2x2", "R,P,P")] {
        for (route, ds) in [(Route::Direct, 8), (Route::Hierarchical, 2), (Route::Hierarchical, 8)] {
            let src = layout(mesh, placements);
            let n = src.mesh().size();
            let options = PlanOptions { route, domain_size: ds, min_split_bytes: 0 };
            let p = plan(&[4], 4, &src, &layout(&n.to_string(), "R"), options).unwrap();
            let l = lower(&p, &LowerOptions { dtype: Some(DType::F32), ..LowerOptions::new(n as usize, 1) }).unwrap();
            let mut bufs = l.host_buffers();
            let sharding = p.src_sharding();
            for r in 0..n {
                // Values whose f32 sum depends on the order: 1e8, -1e8 and 1 by partial index.
                let v = [1e8f32, -1e8, 1.0, 3.0][sharding.partial_index(r).unwrap() as usize];
                bufs[r as usize][slot::INPUT as usize] = (0..4).flat_map(|_| v.to_le_bytes()).collect();
            }
            l.execute(&mut bufs).unwrap();
            let first = bufs[0][slot::OUTPUT as usize].clone();
            for (r, b) in bufs.iter().enumerate().skip(1) {
                assert_eq!(b[slot::OUTPUT as usize], first, "{mesh} {placements} {route} domains of {ds}: rank {r}");
            }
        }
    }
}

#[test]
fn sizes_count_every_partial_sum() {
    // Traffic figures count each partial sum: refused before they could wrap.
    let e = plan(&[1 << 61], 1, &layout("8", "P"), &layout("1@8", "R"), PlanOptions::new(Route::Direct, 8));
    assert!(matches!(e, Err(ReshardError::TensorTooLarge { .. })), "{e:?}");
    // A plan's size counts every rank a sum reads: 1024 sums of 16384 partial sums are too many.
    let e = plan(&[1024], 4, &layout("16384", "P"), &layout("1024@16384", "S0"), PlanOptions::default());
    assert!(matches!(e, Err(ReshardError::TooManyTransfers { .. })), "{e:?}");
    // A partial axis of one rank holds the value: nothing to sum.
    assert!(!layout("1x4", "P,S0").is_partial());
    let p = plan(&[8], 4, &layout("1x4", "P,S0"), &layout("4", "R"), PlanOptions::default()).unwrap();
    assert!(p.transfers().all(|(_, t)| !t.reduces()));
    assert!(lower(&p, &LowerOptions::new(4, 1)).is_ok(), "copies pick their unit");
}

#[test]
fn hand_made_sums_are_checked_when_lowered() {
    let p = plan(&[4, 8], 4, &layout("2", "P"), &layout("2", "S0"), PlanOptions::new(Route::Direct, 8)).unwrap();
    let opts = LowerOptions { dtype: Some(DType::F32), ..LowerOptions::new(2, 1) };
    let mut twice = p.stages().to_vec();
    let src = twice[0].transfers[0].src;
    twice[0].transfers[0].partials.push(src);
    let e = lower(&p.with_stages(twice), &opts).unwrap_err();
    assert!(matches!(e, LowerError::MalformedTransfer { why: "a sum names a rank twice", .. }), "{e}");
}
