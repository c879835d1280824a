//! Golden tests of the reshard planner: the text form of each plan (and one JSON report) compared with
//! the files under `tests/golden/reshard/`. Every case is also verified on the CPU executor.
//!
//! After a deliberate planner change, rewrite the files with `OXCCL_BLESS=1 cargo test -p oxccl-host
//! --test reshard_golden` and review the diff.

use oxccl_host::reshard::{Layout, PlanOptions, PlanReport, ReshardPlan, Route, plan, verify};
use std::path::PathBuf;

struct Case {
    name: &'static str,
    shape: &'static [u64],
    elem_bytes: u64,
    src: (&'static str, &'static str),
    dst: (&'static str, &'static str),
    route: Route,
    domain_size: u32,
    min_split_bytes: u64,
}

const CASES: &[Case] = &[
    // TP4 on ranks 0..4 → TP2 × DP2 on ranks 4..8 (the `oxccl reshard` example).
    Case {
        name: "tp4_to_tp2xdp2.hierarchical.d8",
        shape: &[4, 8],
        elem_bytes: 4,
        src: ("1x4@0", "R,S0"),
        dst: ("2x2@4", "R,S0"),
        route: Route::Hierarchical,
        domain_size: 8,
        min_split_bytes: PlanOptions::MIN_SPLIT_BYTES,
    },
    // The same with domains of 4: the destination ranks form one domain apart from the sources, so
    // each row enters it once and is forwarded to the other DP replica.
    Case {
        name: "tp4_to_tp2xdp2.hierarchical.d4",
        shape: &[4, 8],
        elem_bytes: 4,
        src: ("1x4@0", "R,S0"),
        dst: ("2x2@4", "R,S0"),
        route: Route::Hierarchical,
        domain_size: 4,
        min_split_bytes: PlanOptions::MIN_SPLIT_BYTES,
    },
    Case {
        name: "tp4_to_tp2xdp2.direct.d4",
        shape: &[4, 8],
        elem_bytes: 4,
        src: ("1x4@0", "R,S0"),
        dst: ("2x2@4", "R,S0"),
        route: Route::Direct,
        domain_size: 4,
        min_split_bytes: PlanOptions::MIN_SPLIT_BYTES,
    },
    // TP2 × PP2 → TP1 × PP1: a stack of 4 layers, PP over the layer dim (outer mesh axis), TP over
    // the output dim, gathered on one rank in another domain.
    Case {
        name: "tp2pp2_to_tp1pp1.stacked",
        shape: &[4, 6, 8],
        elem_bytes: 4,
        src: ("2x2@0", "S0,S1"),
        dst: ("1@4", "R"),
        route: Route::Hierarchical,
        domain_size: 4,
        min_split_bytes: PlanOptions::MIN_SPLIT_BYTES,
    },
    // The same per pipeline stage: each stage's [6, 8] weight from its TP2 pair to one rank.
    Case {
        name: "tp2pp2_to_tp1pp1.stage0",
        shape: &[6, 8],
        elem_bytes: 4,
        src: ("2@0", "S0"),
        dst: ("1@4", "R"),
        route: Route::Hierarchical,
        domain_size: 4,
        min_split_bytes: PlanOptions::MIN_SPLIT_BYTES,
    },
    Case {
        name: "tp2pp2_to_tp1pp1.stage1",
        shape: &[6, 8],
        elem_bytes: 4,
        src: ("2@2", "S0"),
        dst: ("1@4", "R"),
        route: Route::Hierarchical,
        domain_size: 4,
        min_split_bytes: PlanOptions::MIN_SPLIT_BYTES,
    },
    // Uneven torch.chunk shards, overlapping meshes (ranks 1, 2 are on both sides), two sharded axes,
    // strided boxes.
    Case {
        name: "uneven_overlap.f16",
        shape: &[5, 7],
        elem_bytes: 2,
        src: ("3@0", "S1"),
        dst: ("2x2@1", "S1,S0"),
        route: Route::Hierarchical,
        domain_size: 2,
        min_split_bytes: PlanOptions::MIN_SPLIT_BYTES,
    },
    // RL weight sync: TP2 on ranks 0..2 → TP2 × DP4 on ranks 8..16 (one domain). Each piece lands once
    // in the domain split over its four replicas, and each part is forwarded by its leader.
    Case {
        name: "tp2_to_tp2xdp4.split",
        shape: &[8, 16],
        elem_bytes: 2,
        src: ("2@0", "S0"),
        dst: ("4x2@8", "R,S0"),
        route: Route::Hierarchical,
        domain_size: 8,
        min_split_bytes: 0,
    },
];

fn golden_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/golden/reshard")
}

fn make(case: &Case) -> ReshardPlan {
    let src = Layout::parse(case.src.0, case.src.1).unwrap();
    let dst = Layout::parse(case.dst.0, case.dst.1).unwrap();
    let options =
        PlanOptions { route: case.route, domain_size: case.domain_size, min_split_bytes: case.min_split_bytes };
    plan(case.shape, case.elem_bytes, &src, &dst, options).unwrap()
}

/// Compares `text` with the golden file `name`, or writes it under `OXCCL_BLESS=1`.
fn check(name: &str, text: &str) -> Result<(), String> {
    let path = golden_dir().join(name);
    if std::env::var_os("OXCCL_BLESS").is_some() {
        std::fs::create_dir_all(golden_dir()).unwrap();
        std::fs::write(&path, text).unwrap();
        return Ok(());
    }
    let want = std::fs::read_to_string(&path)
        .map_err(|e| format!("{}: {e} (run with OXCCL_BLESS=1 to create it)", path.display()))?;
    if want != text {
        return Err(format!(
            "{} differs from the plan (OXCCL_BLESS=1 rewrites it after a deliberate change):\n--- golden\n{want}\n--- now\n{text}",
            path.display()
        ));
    }
    Ok(())
}

#[test]
fn plans_match_their_golden_text() {
    let mut failures = Vec::new();
    for case in CASES {
        let p = make(case);
        let report = verify(&p).unwrap();
        assert!(report.is_exact(), "{}: {report}", case.name);
        if let Err(e) = check(&format!("{}.txt", case.name), &p.to_string()) {
            failures.push(e);
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

#[test]
fn json_reports_match_their_golden_files() {
    // One with forwarding, one with strided boxes (shape and strides present) and local copies.
    for name in ["tp4_to_tp2xdp2.hierarchical.d4", "uneven_overlap.f16"] {
        let case = CASES.iter().find(|c| c.name == name).unwrap();
        let dtype = if case.elem_bytes == 2 { "f16" } else { "f32" };
        let report = PlanReport::new(&make(case), Some(dtype));
        let json = report.to_json();
        check(&format!("{name}.json"), &json).unwrap();
        // The layout is still JSON, and reads back to the same report.
        assert_eq!(serde_json::from_str::<PlanReport>(&json).unwrap(), report);
    }
}
