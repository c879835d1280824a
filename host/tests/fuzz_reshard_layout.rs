//! Fuzzing the reshard layout specs: meshes (`2x4@8`), placements (`R,S0`), layouts in JSON, and
//! global shapes. Every spec must parse or give a typed error: no panic, no hang; a layout that
//! parses prints back to itself, and every rank's box of a valid sharding lies inside the tensor.
//! [`fuzz_common::cases`] executions per strategy.

mod fuzz_common;

use oxccl_host::reshard::{Layout, Mesh, Placement, parse_placements};
use proptest::prelude::*;

/// Parses `mesh` and `placements`, binds a layout that parses to `shape` and checks what it gives.
fn exercise(mesh: &str, placements: &str, shape: &[u64], world: u32) {
    let input = format!("mesh {mesh:?} placements {placements:?} shape {shape:?} world {world}");
    fuzz_common::guard(&input, || {
        if let Ok(m) = mesh.parse::<Mesh>() {
            assert_eq!(m.to_string().parse::<Mesh>().as_ref(), Ok(&m), "mesh round trip");
            assert!(m.size() >= 1 && m.size() <= Mesh::MAX_RANKS);
        }
        if let Ok(ps) = parse_placements(placements) {
            let printed: Vec<String> = ps.iter().map(Placement::to_string).collect();
            assert_eq!(parse_placements(&printed.join(",")).as_ref(), Ok(&ps), "placements round trip");
        }
        let Ok(l) = Layout::parse(mesh, placements) else { return };
        let json = serde_json::to_string(&l).expect("a layout serializes");
        assert_eq!(serde_json::from_str::<Layout>(&json).as_ref().ok(), Some(&l), "JSON round trip");
        let _ = l.validate_in_world(shape, world);
        let Ok(s) = l.on(shape) else { return };
        let m = l.mesh();
        // A few ranks' boxes (the mesh may have a million): inside the tensor, and none outside it.
        let step = (m.size() / 16).max(1);
        for r in (m.start()..m.start() + m.size()).step_by(step as usize) {
            let b = s.local_region(r).expect("a rank of the mesh has a box");
            assert_eq!(b.start.len(), shape.len());
            for ((&start, &extent), &n) in b.start.iter().zip(&b.extent).zip(shape) {
                assert!(start as u128 + extent as u128 <= n as u128 || extent == 0, "{b:?}");
            }
        }
        if m.start() > 0 {
            assert_eq!(s.local_region(m.start() - 1), None);
        }
        if s.elements() <= 4096 && m.size() <= 64 {
            let global: Vec<u32> = (0..s.elements() as u32).collect();
            let shards = s.local_shards(&global).expect("small shards fit");
            assert_eq!(shards.len(), m.size() as usize);
        }
    });
}

const PIECES: &[&str] = &[
    "0",
    "1",
    "2",
    "3",
    "4",
    "8",
    "16",
    "1024",
    "1025",
    "65535",
    "65536",
    "4294967295",
    "4294967296",
    "-1",
    "+2",
    " ",
    "x",
    "X",
    "@",
    "",
    "R",
    "r",
    "P",
    "S",
    "s",
    "S0",
    "S1",
    "S2",
    "S99",
    "S-1",
    ",",
    " , ",
];

fn spec() -> impl Strategy<Value = String> {
    prop::collection::vec(0..PIECES.len(), 0..10).prop_map(|v| v.into_iter().map(|i| PIECES[i]).collect())
}

/// A mesh text built from axes and a start, mostly well formed.
fn mesh() -> impl Strategy<Value = String> {
    let dim = prop_oneof![4 => 1u64..9, 1 => Just(0u64), 1 => Just(1 << 10), 1 => Just(1 << 16), 1 => Just(u32::MAX as u64 + 1)];
    (prop::collection::vec(dim, 0..5), prop::option::of(prop_oneof![0u64..64, Just(u32::MAX as u64)]), any::<bool>())
        .prop_map(|(dims, start, upper)| {
            let sep = if upper { "X" } else { "x" };
            let d: Vec<String> = dims.iter().map(u64::to_string).collect();
            match start {
                Some(s) => format!("{}@{s}", d.join(sep)),
                None => d.join(sep),
            }
        })
}

fn placements() -> impl Strategy<Value = String> {
    let one = prop_oneof![
        Just("R".to_string()),
        Just("P".to_string()),
        (0u32..5).prop_map(|d| format!("S{d}")),
        Just("Q".to_string())
    ];
    prop::collection::vec(one, 0..5).prop_map(|v| v.join(","))
}

fn shape() -> impl Strategy<Value = Vec<u64>> {
    prop::collection::vec(prop_oneof![4 => 0u64..40, 1 => Just(u64::MAX), 1 => Just(1 << 32), 1 => Just(0)], 0..4)
}

proptest! {
    #![proptest_config(fuzz_common::config())]

    #[test]
    fn random_text(mesh in ".{0,24}", placements in ".{0,24}", shape in shape(), world in any::<u32>()) {
        exercise(&mesh, &placements, &shape, world);
    }

    #[test]
    fn spec_soup(mesh in spec(), placements in spec(), shape in shape(), world in 0u32..2000) {
        exercise(&mesh, &placements, &shape, world);
    }

    #[test]
    fn near_valid_specs(mesh in mesh(), placements in placements(), shape in shape(), world in 0u32..2000) {
        exercise(&mesh, &placements, &shape, world);
    }

    #[test]
    fn layout_json(text in prop_oneof![
        ".{0,64}",
        (mesh(), placements()).prop_map(|(m, p)| format!(r#"{{"mesh":"{m}","placements":[{}]}}"#,
            p.split(',').filter(|s| !s.is_empty()).map(|s| format!("\"{s}\"")).collect::<Vec<_>>().join(","))),
    ]) {
        fuzz_common::guard(&text, || {
            if let Ok(l) = serde_json::from_str::<Layout>(&text) {
                assert_eq!(Layout::new(l.mesh().clone(), l.placements().to_vec()).as_ref(), Ok(&l));
            }
        });
    }
}
