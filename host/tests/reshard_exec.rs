//! Tests of `reshard::exec`: the executor on real data, its input checks, and `verify` catching wrong
//! plans.

mod reshard_common;

use oxccl_host::reshard::{
    Buffers, ExecError, Found, Layout, PlanOptions, ReadFrom, ReshardPlan, Route, Stage, execute, execute_bytes,
    execute_elements, plan, verify, verify_with_limit,
};
use proptest::prelude::*;
use reshard_common::problem;

fn layout(mesh: &str, placements: &str) -> Layout {
    Layout::parse(mesh, placements).unwrap()
}

/// [6, 5] u32 rows over ranks 0..3 → (S1, R) on ranks 2..6 (overlapping), domains of 2, hierarchical,
/// pieces split over the leaders of each domain.
fn sample() -> ReshardPlan {
    let options = PlanOptions { route: Route::Hierarchical, domain_size: 2, min_split_bytes: 0 };
    plan(&[6, 5], 4, &layout("3@0", "S0"), &layout("2x2@2", "S1,R"), options).unwrap()
}

fn global(n: u32) -> Vec<u32> {
    (0..n).map(|i| i.wrapping_mul(2_654_435_761) ^ 0xa5a5).collect()
}

#[test]
fn runs_elements_and_bytes_to_the_destination_shards() {
    let p = sample();
    assert!(!p.stages()[1].transfers.is_empty(), "the sample exercises forwarding");
    let g = global(30);
    let src = p.src_sharding().local_shards(&g).unwrap();
    let want = p.dst_sharding().local_shards(&g).unwrap();
    assert_eq!(execute_elements(&p, &src).unwrap(), want);

    let bytes = |b: &Buffers<u32>| -> Buffers<u8> {
        b.iter().map(|(&r, v)| (r, v.iter().flat_map(|x| x.to_le_bytes()).collect())).collect()
    };
    assert_eq!(execute_bytes(&p, &bytes(&src)).unwrap(), bytes(&want));
    // Two-byte units work too: any divisor of the element size.
    let halves = |b: &Buffers<u32>| -> Buffers<u16> {
        b.iter().map(|(&r, v)| (r, v.iter().flat_map(|x| [*x as u16, (*x >> 16) as u16]).collect())).collect()
    };
    assert_eq!(execute(&p, 2, &halves(&src)).unwrap(), halves(&want));
}

#[test]
fn ranks_with_empty_shards_may_pass_nothing() {
    // 5 rows over 4 ranks: rank 3 holds nothing.
    let p = plan(&[5, 2], 4, &layout("4@0", "S0"), &layout("2@4", "S1"), PlanOptions::default()).unwrap();
    let g = global(10);
    let mut src = p.src_sharding().local_shards(&g).unwrap();
    assert!(src[&3].is_empty());
    src.remove(&3);
    assert_eq!(execute_elements(&p, &src).unwrap(), p.dst_sharding().local_shards(&g).unwrap());
}

#[test]
fn bad_inputs_are_typed_errors() {
    let p = sample();
    let src = p.src_sharding().local_shards(&global(30)).unwrap();
    let as16: Buffers<u16> = src.iter().map(|(&r, v)| (r, v.iter().map(|&x| x as u16).collect())).collect();
    assert_eq!(execute_elements(&p, &as16), Err(ExecError::ElementSize { plan: 4, given: 2 }));
    assert_eq!(execute(&p, 3, &src), Err(ExecError::ElementSize { plan: 4, given: 3 }));

    let mut missing = src.clone();
    missing.remove(&1);
    assert_eq!(execute_elements(&p, &missing), Err(ExecError::MissingSource { rank: 1 }));
    let mut extra = src.clone();
    extra.insert(5, vec![0; 10]);
    assert_eq!(execute_elements(&p, &extra), Err(ExecError::UnexpectedSource { rank: 5 }));
    let mut short = src.clone();
    short.get_mut(&2).unwrap().pop();
    assert_eq!(execute_elements(&p, &short), Err(ExecError::SourceLength { rank: 2, expected: 10, got: 9 }));
}

/// `sample()` with one transfer changed by `f`.
fn tampered(f: impl FnOnce(&mut Vec<Stage>)) -> ReshardPlan {
    let p = sample();
    let mut stages = p.stages().to_vec();
    f(&mut stages);
    p.with_stages(stages)
}

#[test]
fn malformed_or_out_of_bounds_transfers_are_typed_errors() {
    let src = sample().src_sharding().local_shards(&global(30)).unwrap();
    let run = |p: ReshardPlan| execute_elements(&p, &src).unwrap_err();

    let e = run(tampered(|s| s[0].transfers[0].src_offset += 2));
    assert_eq!(
        e,
        ExecError::MalformedTransfer { stage: 0, index: 0, why: "read offset 2 is not a multiple of 4 bytes".into() }
    );
    let e = run(tampered(|s| s[0].transfers[0].bytes += 4));
    assert!(matches!(e, ExecError::MalformedTransfer { stage: 0, index: 0, ref why } if why.contains("does not hold")));
    let e = run(tampered(|s| s[0].transfers[0].src_strides.push(4)));
    assert!(matches!(e, ExecError::MalformedTransfer { ref why, .. } if why.contains("strides")));
    let e = run(tampered(|s| s[0].transfers[0].src_offset += 4000));
    assert!(matches!(e, ExecError::OutOfBounds { stage: 0, index: 0, buffer: "source", .. }), "{e}");
    let e = run(tampered(|s| s[0].transfers[0].dst_offset += 4000));
    assert!(matches!(e, ExecError::OutOfBounds { buffer: "destination (write)", .. }), "{e}");
    let e = run(tampered(|s| s[0].transfers[0].dst = 99));
    assert!(matches!(e, ExecError::MalformedTransfer { ref why, .. } if why.contains("rank 99")), "{e}");
    let e = run(tampered(|s| {
        s[0].transfers[0].read = ReadFrom::Dst;
        s[0].transfers[0].src = 0;
    }));
    assert!(matches!(e, ExecError::MalformedTransfer { ref why, .. } if why.contains("rank 0")), "{e}");
    // Huge strides do not overflow into a wrong "in bounds".
    let e = run(tampered(|s| {
        let t = s[0].transfers.iter_mut().find(|t| !t.is_contiguous()).unwrap();
        t.src_strides[0] = u64::MAX / 4 * 4;
    }));
    assert!(matches!(e, ExecError::OutOfBounds { end: u64::MAX, .. }), "{e}");
}

#[test]
fn verify_notices_wrong_plans() {
    assert!(verify(&sample()).unwrap().is_exact());
    // A dropped transfer leaves elements never written.
    let r = verify(&tampered(|s| {
        s[0].transfers.pop();
    }))
    .unwrap();
    assert!(!r.is_exact());
    assert!(r.first.iter().all(|m| m.found == Found::Nothing));
    // A source offset one element off reads the wrong elements.
    let r = verify(&tampered(|s| {
        let t = s[0].transfers.iter_mut().find(|t| t.src_offset > 0).unwrap();
        t.src_offset -= 4;
    }))
    .unwrap();
    assert!(r.wrong > 0 && r.first.iter().all(|m| matches!(m.found, Found::Global(_))), "{r}");
    // Forwarding in the stage that receives: reads before the write, so the data never arrives.
    let r = verify(&tampered(|s| {
        let forward = s[1].transfers.remove(0);
        s[0].transfers.push(forward);
    }))
    .unwrap();
    assert!(!r.is_exact(), "{r}");
    assert!(r.to_string().starts_with("FAILED: "));
    // Too large to tag: refused before allocating.
    assert_eq!(
        verify_with_limit(&sample(), 100),
        Err(ExecError::TooLargeToVerify { bytes: 8 * (30 + 60), limit: 100 })
    );
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    /// Random problems with 4-byte elements on real data: both routes deliver exactly the destination
    /// shards cut from the global tensor.
    #[test]
    fn random_plans_deliver_the_destination_shards(mut p in problem()) {
        p.elem_bytes = 4;
        let n: u64 = p.shape.iter().product();
        let g = global(n as u32);
        for route in [Route::Direct, Route::Hierarchical] {
            let plan = p.plan(route);
            let src = plan.src_sharding().local_shards(&g).unwrap();
            prop_assert_eq!(execute_elements(&plan, &src).unwrap(), plan.dst_sharding().local_shards(&g).unwrap());
        }
    }
}

/// Element counts whose sum passes u64 are too large to verify, not a capacity-overflow panic.
#[test]
fn verifying_a_plan_past_u64_elements_is_refused() {
    let l = Layout::parse("2", "R").unwrap();
    let p = plan(&[1 << 62], 1, &l, &l, PlanOptions::default()).unwrap();
    assert!(matches!(verify(&p), Err(ExecError::TooLargeToVerify { bytes: u64::MAX, .. })));
}
