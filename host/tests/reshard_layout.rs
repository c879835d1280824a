//! Tests of `reshard::layout`: parsing, validation errors, `torch.chunk` / DTensor shard boxes, local
//! shards, serde.

mod reshard_common;

use oxccl_host::reshard::{Layout, LayoutError, Mesh, Placement, Region, chunk, parse_placements};
use proptest::prelude::*;
use reshard_common::{oracle_elements, oracle_indices, problem};
use std::collections::BTreeSet;

#[test]
fn meshes_parse_and_print() {
    let m: Mesh = "2x4@8".parse().unwrap();
    assert_eq!((m.dims(), m.start(), m.size()), (&[2, 4][..], 8, 8));
    assert_eq!(m.to_string(), "2x4@8");
    assert_eq!(m.ranks(), 8..16);
    assert_eq!(m.coords(13), Some(vec![1, 1]));
    assert_eq!(m.coords(16), None);
    assert_eq!("4".parse::<Mesh>().unwrap(), Mesh::new(vec![4], 0).unwrap());
    for bad in ["", "x4", "2x", "2x4@", "2x4@-1", "a@0", "2y4@0"] {
        assert_eq!(bad.parse::<Mesh>(), Err(LayoutError::BadMesh { text: bad.into() }), "{bad:?}");
    }
    assert_eq!("2x0@0".parse::<Mesh>(), Err(LayoutError::ZeroMeshAxis { axis: 1 }));
    assert_eq!(Mesh::new(vec![], 0), Err(LayoutError::EmptyMesh));
    assert_eq!(Mesh::new(vec![2], u32::MAX - 1), Err(LayoutError::MeshTooLarge { dims: vec![2], start: u32::MAX - 1 }));
    assert_eq!(
        Mesh::new(vec![1 << 16, 1 << 16], 0),
        Err(LayoutError::MeshTooLarge { dims: vec![1 << 16, 1 << 16], start: 0 })
    );
    // Within u32 but past the planner's limit (planning walks every rank): refused, not planned.
    assert_eq!("65535x65535".parse::<Mesh>(), Err(LayoutError::MeshTooLarge { dims: vec![65535, 65535], start: 0 }));
    assert!(Mesh::new(vec![1 << 10, 1 << 10], 0).is_ok());
    assert_eq!(
        Mesh::new(vec![1 << 10, (1 << 10) + 1], 0),
        Err(LayoutError::MeshTooLarge { dims: vec![1 << 10, (1 << 10) + 1], start: 0 })
    );
}

#[test]
fn placements_parse_and_print() {
    assert_eq!(
        parse_placements("R,S0,s12,P").unwrap(),
        vec![Placement::Replicate, Placement::Shard(0), Placement::Shard(12), Placement::Partial]
    );
    assert_eq!(Placement::Shard(3).to_string(), "S3");
    for bad in ["", "S", "Sx", "X", "S-1"] {
        assert_eq!(bad.parse::<Placement>(), Err(LayoutError::BadPlacement { text: bad.into() }));
    }
}

#[test]
fn layouts_reject_what_they_cannot_hold() {
    assert_eq!(Layout::parse("2x2@0", "R"), Err(LayoutError::PlacementCount { mesh_axes: 2, placements: 1 }));
    // Partial sums are a source's business: a destination holds values.
    let partial = Layout::parse("2x2@0", "R,P").unwrap();
    assert!(partial.is_partial());
    assert_eq!(partial.check_not_partial(), Err(LayoutError::PartialDestination { axis: 1 }));
    let l = Layout::parse("2x2@4", "S1,R").unwrap();
    assert_eq!(l.validate(&[8]), Err(LayoutError::ShardDimOutOfRange { axis: 0, dim: 1, tensor_rank: 1 }));
    assert_eq!(l.validate(&[8, 8]), Ok(()));
    assert_eq!(l.validate(&[u64::MAX, 2]), Err(LayoutError::ShapeTooLarge { shape: vec![u64::MAX, 2] }));
    assert_eq!(l.validate_in_world(&[8, 8], 7), Err(LayoutError::RankOutOfRange { last_rank: 7, world_size: 7 }));
    assert_eq!(l.validate_in_world(&[8, 8], 8), Ok(()));
    // Messages name what was wrong.
    assert_eq!(
        LayoutError::PartialDestination { axis: 1 }.to_string(),
        "mesh axis 1 is placed Partial: a reshard's destination holds final values (Shard or Replicate), not partial sums"
    );
}

#[test]
fn chunks_follow_torch_chunk() {
    // torch.chunk(arange(10), 4) → sizes 3, 3, 3, 1.
    let sizes: Vec<u64> = (0..4).map(|i| chunk(10, 4, i)).map(|(lo, hi)| hi - lo).collect();
    assert_eq!(sizes, [3, 3, 3, 1]);
    // torch.chunk(arange(5), 4) → 2, 2, 1 and DTensor pads with an empty fourth shard.
    let c: Vec<(u64, u64)> = (0..4).map(|i| chunk(5, 4, i)).collect();
    assert_eq!(c, [(0, 2), (2, 4), (4, 5), (5, 5)]);
    // torch.chunk(arange(6), 4) → 2, 2, 2 and an empty fourth: sizes need not cover every part.
    let c: Vec<(u64, u64)> = (0..4).map(|i| chunk(6, 4, i)).collect();
    assert_eq!(c, [(0, 2), (2, 4), (4, 6), (6, 6)]);
    assert_eq!(chunk(0, 3, 2), (0, 0));
}

#[test]
fn several_axes_on_one_dim_split_outer_axis_first() {
    // Like DTensor: (Shard(0), Shard(0)) on a 2 × 2 mesh over 10 rows: outer halves 5 | 5, then
    // each half by torch.chunk: 3 | 2.
    let s = Layout::parse("2x2@0", "S0,S0").unwrap().on(&[10]).unwrap();
    let boxes: Vec<Region> = (0..4).map(|r| s.local_region(r).unwrap()).collect();
    let starts: Vec<(u64, u64)> = boxes.iter().map(|b| (b.start[0], b.extent[0])).collect();
    assert_eq!(starts, [(0, 3), (3, 2), (5, 3), (8, 2)]);
    // Different dims on two axes; a replicated axis in the middle.
    let s = Layout::parse("2x3x2@4", "S1,R,S0").unwrap().on(&[5, 7]).unwrap();
    assert_eq!(s.local_region(4).unwrap(), Region { start: vec![0, 0], extent: vec![3, 4] });
    assert_eq!(s.local_region(7).unwrap(), Region { start: vec![3, 0], extent: vec![2, 4] });
    assert_eq!(s.local_region(15).unwrap(), Region { start: vec![3, 4], extent: vec![2, 3] });
    assert_eq!(s.local_shape(3), None);
}

#[test]
fn empty_trailing_shards_hold_empty_buffers() {
    let s = Layout::parse("4@0", "S0").unwrap().on(&[5, 3]).unwrap();
    assert_eq!(s.local_len(3), 0);
    let global: Vec<u32> = (0..15).collect();
    let shards = s.local_shards(&global).unwrap();
    assert_eq!(shards[&0], vec![0, 1, 2, 3, 4, 5]);
    assert_eq!(shards[&2], vec![12, 13, 14]);
    assert!(shards[&3].is_empty());
    assert_eq!(s.local_shards(&global[1..]), Err(LayoutError::BufferLength { rank: 0, expected: 15, got: 14 }));
}

#[test]
fn layouts_round_trip_through_json_and_revalidate() {
    let l = Layout::parse("2x2@4", "R,S0").unwrap();
    let json = serde_json::to_string(&l).unwrap();
    assert_eq!(json, r#"{"mesh":"2x2@4","placements":["R","S0"]}"#);
    assert_eq!(serde_json::from_str::<Layout>(&json).unwrap(), l);
    let bad = r#"{"mesh":"2x2@4","placements":["R"]}"#;
    assert!(serde_json::from_str::<Layout>(bad).unwrap_err().to_string().contains("2 axes but 1 placement was given"));
    assert!(serde_json::from_str::<Layout>(r#"{"mesh":"0@4","placements":["R"]}"#).is_err());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Every rank's box equals the list-based `torch.chunk` oracle; distinct boxes tile the tensor; the
    /// local shard cut from a global tensor holds exactly the box's elements, row-major.
    #[test]
    fn shards_match_the_oracle_and_tile_the_tensor(p in problem()) {
        for layout in [&p.src, &p.dst] {
            let s = layout.on(&p.shape).unwrap();
            let elements: u64 = p.shape.iter().product();
            let global: Vec<u64> = (0..elements).collect();
            let shards = s.local_shards(&global).unwrap();
            let mut distinct: BTreeSet<Vec<u64>> = BTreeSet::new();
            for r in layout.mesh().ranks() {
                let region = s.local_region(r).unwrap();
                let lists = oracle_indices(&p.shape, layout, r).unwrap();
                let extent: Vec<u64> = lists.iter().map(|l| l.len() as u64).collect();
                prop_assert_eq!(&region.extent, &extent);
                for (d, l) in lists.iter().enumerate() {
                    if let Some(&first) = l.first() {
                        prop_assert_eq!(region.start[d], first);
                    }
                }
                let want: Vec<u64> = oracle_elements(&p.shape, layout, r).into_iter().collect();
                prop_assert_eq!(&shards[&r], &want);
                prop_assert_eq!(s.local_len(r), want.len() as u64);
                if !want.is_empty() {
                    distinct.insert(want);
                }
            }
            let mut covered: Vec<u64> = distinct.into_iter().flatten().collect();
            covered.sort_unstable();
            prop_assert_eq!(covered, global);
        }
    }
}
