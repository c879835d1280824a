//! Ranks across nodes: the node map, and the staged hierarchical collectives against the flat CPU
//! references (2–64 nodes), their races, and the bytes each rank sends per link against the
//! simulator's `hier-*` programs.

mod common;

use common::Rng;
use oxccl_host::compile::{Options, compile};
use oxccl_host::exec::{ReduceOp, reference};
use oxccl_host::nodes::{Kind, NodeError, NodeMap, Path, Side, Staged, Step};
use oxccl_host::program::generators::Algorithm;
use oxccl_host::sim::{SimOptions, Topology, simulate};

#[test]
fn nodes_come_from_host_keys_in_order_of_their_first_rank() {
    let m = NodeMap::from_keys(&["b", "a", "b", "a", "b", "a"]).unwrap();
    assert_eq!((m.world(), m.nodes(), m.per_node()), (6, 2, 3));
    assert_eq!(
        (0..6).map(|r| (m.node(r), m.local(r))).collect::<Vec<_>>(),
        [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2)]
    );
    assert_eq!(m.node_ranks(1), [1, 3, 5]);
    assert_eq!(m.local_ranks(2), [4, 5]);
    assert_eq!(m.rank(1, 1), 3);
    let e = m.node_major("a staged AllGather").unwrap_err();
    assert_eq!(e, NodeError::NotNodeMajor { what: "a staged AllGather", rank: 1, node: 1, local: 0 });
    assert!(NodeMap::by_count(8, 4).unwrap().node_major("x").is_ok());
}

/// Transfers reach the node's ranks by local index, the same local index on other nodes by node,
/// and nothing else, on interleaved hosts as on node-major ones; every path is symmetric.
#[test]
fn transfer_paths_follow_nodes_and_local_indices() {
    let m = NodeMap::from_keys(&["b", "a", "b", "a", "b", "a"]).unwrap();
    assert_eq!(m.path(0, 4), Path::Node { local: 2 });
    assert_eq!(m.path(0, 0), Path::Node { local: 0 });
    assert_eq!(m.path(2, 3), Path::Group { node: 1 });
    assert_eq!(m.path(3, 2), Path::Group { node: 0 });
    assert_eq!(m.path(0, 3), Path::Relay);
    for map in [m, NodeMap::by_count(12, 4).unwrap(), NodeMap::by_count(4, 1).unwrap()] {
        for a in 0..map.world() {
            for b in 0..map.world() {
                let (ab, ba) = (map.path(a, b), map.path(b, a));
                match ab {
                    Path::Node { local } => {
                        assert_eq!(map.rank(map.node(a), local), b);
                        assert_eq!(ba, Path::Node { local: map.local(a) });
                    }
                    Path::Group { node } => {
                        assert_eq!(map.rank(node, map.local(a)), b);
                        assert_eq!(ba, Path::Group { node: map.node(a) });
                    }
                    Path::Relay => {
                        assert!(map.node(a) != map.node(b) && map.local(a) != map.local(b));
                        assert_eq!(ba, Path::Relay);
                    }
                }
            }
        }
        // One rank per node: every pair is direct.
        if map.per_node() == 1 {
            assert!((0..map.world()).all(|a| (0..map.world()).all(|b| map.path(a, b) != Path::Relay)));
        }
    }
}

#[test]
fn uneven_nodes_and_bad_counts_are_typed_errors() {
    let e = NodeMap::from_keys(&[1, 1, 2]).unwrap_err();
    assert_eq!(e, NodeError::Uneven { node: 1, ranks: 1, expected: 2 });
    assert!(e.to_string().contains("node 1 holds 1 ranks, node 0 holds 2"), "{e}");
    assert_eq!(NodeMap::by_count(6, 4).unwrap_err(), NodeError::BadRanksPerNode { world: 6, per_node: 4 });
    assert_eq!(NodeMap::by_count(6, 0).unwrap_err(), NodeError::BadRanksPerNode { world: 6, per_node: 0 });
    assert_eq!(NodeMap::from_keys::<u8>(&[]).unwrap_err(), NodeError::Empty);
    // A ranks-per-node count that puts two hosts' ranks on one node.
    let hosts = ["a", "a", "b", "b"];
    assert!(NodeMap::by_count(4, 2).unwrap().within_hosts(&hosts).is_ok());
    let e = NodeMap::by_count(4, 4).unwrap().within_hosts(&hosts).unwrap_err();
    assert_eq!(e, NodeError::SpansHosts { node: 0, first: 0, other: 2 });
}

/// Small integers (exact in every summation order), one vector per rank.
fn inputs(rng: &mut Rng, world: usize, len: usize) -> Vec<Vec<i32>> {
    (0..world).map(|_| (0..len).map(|_| rng.below(61) as i32 - 30).collect()).collect()
}

/// Node maps of `nodes` × `g`: numbered node by node, and (for AllReduce and Broadcast, which do
/// not need it) interleaved, rank `r` on node `r mod nodes`.
fn maps(nodes: usize, g: usize) -> Vec<NodeMap> {
    let interleaved: Vec<usize> = (0..nodes * g).map(|r| r % nodes).collect();
    vec![NodeMap::by_count(nodes * g, g).unwrap(), NodeMap::from_keys(&interleaved).unwrap()]
}

const SHAPES: [(usize, usize); 10] =
    [(2, 1), (2, 2), (2, 4), (3, 3), (4, 2), (4, 8), (8, 4), (16, 2), (32, 2), (64, 1)];

#[test]
fn staged_all_reduce_is_the_flat_reference() {
    let mut rng = Rng::new(41);
    let mut cases = 0;
    for (nodes, g) in SHAPES {
        for map in maps(nodes, g) {
            let world = nodes * g;
            for _ in 0..4 {
                let count = rng.below(200) as u64;
                let piece = 1 + rng.below(64) as u64;
                let op = [ReduceOp::Sum, ReduceOp::Min, ReduceOp::Max][rng.below(3) as usize];
                let staged = Staged::all_reduce(&map, count, piece);
                staged.check_races(&map).unwrap();
                let send = inputs(&mut rng, world, count as usize);
                let mut recv = vec![vec![-99i32; count as usize]; world];
                staged.run_cpu(&map, Some(&send), &mut recv, op).unwrap();
                let want = reference::all_reduce(&send, op).unwrap();
                assert_eq!(recv, want, "{nodes}x{g} count {count} piece {piece}");
                let mut buf = send.clone();
                staged.run_cpu(&map, None, &mut buf, op).unwrap();
                assert_eq!(buf, want, "in place: {nodes}x{g} count {count} piece {piece}");
                cases += 1;
            }
        }
    }
    assert_eq!(cases, SHAPES.len() * 2 * 4);
}

#[test]
fn staged_all_gather_and_broadcast_are_the_flat_references() {
    let mut rng = Rng::new(43);
    for (nodes, g) in SHAPES {
        let world = nodes * g;
        let map = NodeMap::by_count(world, g).unwrap();
        let count = rng.below(40) as u64;
        let staged = Staged::all_gather(&map, count).unwrap();
        staged.check_races(&map).unwrap();
        let send = inputs(&mut rng, world, count as usize);
        let mut recv = vec![vec![-99i32; world * count as usize]; world];
        staged.run_cpu(&map, Some(&send), &mut recv, ReduceOp::Sum).unwrap();
        let want = reference::all_gather(&send).unwrap();
        assert_eq!(recv, want, "AllGather {nodes}x{g} count {count}");
        // In place: block `rank` of each buffer holds the rank's input, the rest is stale.
        let c = count as usize;
        let mut buf = vec![vec![-99i32; world * c]; world];
        for (r, b) in buf.iter_mut().enumerate() {
            b[r * c..(r + 1) * c].copy_from_slice(&send[r]);
        }
        staged.run_cpu(&map, None, &mut buf, ReduceOp::Sum).unwrap();
        assert_eq!(buf, want, "in place: AllGather {nodes}x{g} count {count}");
        for map in maps(nodes, g) {
            let (count, piece, root) = (rng.below(150) as u64, 1 + rng.below(50) as u64, rng.below(world as u32));
            let staged = Staged::broadcast(&map, count, root, piece);
            staged.check_races(&map).unwrap();
            let send = inputs(&mut rng, world, count as usize);
            let mut recv = vec![vec![-99i32; count as usize]; world];
            staged.run_cpu(&map, Some(&send), &mut recv, ReduceOp::Sum).unwrap();
            assert!(recv.iter().all(|v| *v == send[root as usize]), "Broadcast {nodes}x{g} from {root}, count {count}");
            let mut buf = send.clone();
            staged.run_cpu(&map, None, &mut buf, ReduceOp::Sum).unwrap();
            assert!(buf.iter().all(|v| *v == send[root as usize]), "in place: Broadcast {nodes}x{g} from {root}");
        }
    }
    // The interleaved numbering is refused by name.
    let e = Staged::all_gather(&maps(2, 2)[1], 4).unwrap_err();
    assert!(e.to_string().contains("needs ranks numbered node by node"), "{e}");
}

#[test]
fn staged_reduce_scatter_and_reduce_are_the_flat_references() {
    let mut rng = Rng::new(47);
    for (nodes, g) in SHAPES {
        let world = nodes * g;
        let map = NodeMap::by_count(world, g).unwrap();
        let op = [ReduceOp::Sum, ReduceOp::Min, ReduceOp::Max][rng.below(3) as usize];
        let count = rng.below(30) as u64;
        let staged = Staged::reduce_scatter(&map, count).unwrap();
        staged.check_races(&map).unwrap();
        let send = inputs(&mut rng, world, world * count as usize);
        let mut recv = vec![vec![-99i32; count as usize]; world];
        staged.run_cpu(&map, Some(&send), &mut recv, op).unwrap();
        let want = reference::reduce_scatter(&send, op).unwrap();
        assert_eq!(recv, want, "ReduceScatter {nodes}x{g} count {count}");
        // In place: block `rank` of each rank's whole input becomes its result.
        let mut buf = send.clone();
        staged.run_cpu(&map, None, &mut buf, op).unwrap();
        let c = count as usize;
        for r in 0..world {
            assert_eq!(buf[r][r * c..(r + 1) * c], want[r][..], "in place: ReduceScatter {nodes}x{g}: rank {r}");
        }
        for map in maps(nodes, g) {
            let (count, piece, root) = (rng.below(150) as u64, 1 + rng.below(50) as u64, rng.below(world as u32));
            let staged = Staged::reduce(&map, count, root, piece);
            staged.check_races(&map).unwrap();
            let send = inputs(&mut rng, world, count as usize);
            let mut recv = vec![vec![-99i32; count as usize]; world];
            staged.run_cpu(&map, Some(&send), &mut recv, op).unwrap();
            let want = reference::all_reduce(&send, op).unwrap().swap_remove(0);
            let mut buf = send.clone();
            staged.run_cpu(&map, None, &mut buf, op).unwrap();
            for (r, (v, b)) in recv.iter().zip(&buf).enumerate() {
                if r == root as usize {
                    assert_eq!(*v, want, "Reduce {nodes}x{g} onto {root}, count {count}, piece {piece}");
                    assert_eq!(*b, want, "in place: Reduce {nodes}x{g} onto {root}");
                } else {
                    assert!(v.iter().all(|&x| x == -99), "Reduce {nodes}x{g}: rank {r}'s buffer written");
                    assert_eq!(*b, send[r], "in place: Reduce {nodes}x{g}: rank {r}'s buffer written");
                }
            }
        }
    }
    let e = Staged::reduce_scatter(&maps(2, 2)[1], 4).unwrap_err();
    assert!(e.to_string().contains("a staged ReduceScatter needs ranks numbered node by node"), "{e}");
}

#[test]
fn the_race_check_finds_a_scratch_slot_reused_too_early() {
    let map = NodeMap::by_count(12, 2).unwrap();
    let mut staged = Staged::reduce_scatter(&map, 8).unwrap();
    staged.check_races(&map).unwrap();
    // The third ReduceScatter reuses the first's slot; without waiting for the first Reduce it
    // overwrites what that Reduce reads.
    let third = staged.steps.iter().position(|s| matches!(s.kind, Kind::IntraReduceScatterOf { node: 2, .. })).unwrap();
    staged.steps[third].after = None;
    let e = staged.check_races(&map).unwrap_err().to_string();
    assert!(e.contains("IntraReduceScatterOf") && e.contains("InterReduce"), "{e}");
}

#[test]
fn the_race_check_finds_an_all_gather_that_does_not_wait() {
    let map = NodeMap::by_count(8, 4).unwrap();
    let mut staged = Staged::all_reduce(&map, 64, 16);
    let ag = staged.steps.iter().position(|s| matches!(s.kind, Kind::IntraAllGather { .. })).unwrap();
    staged.steps[ag].after = None;
    let e = staged.check_races(&map).unwrap_err().to_string();
    assert!(e.contains("may run at once") && e.contains("IntraAllGather"), "{e}");
    // An inter-node step on the same elements as an intra-node one, unordered.
    let steps = vec![
        Step {
            side: Side::Intra,
            kind: Kind::IntraAllReduce { at: 0, len: 8 },
            after: None,
            only_node: None,
            only_local: None,
        },
        Step {
            side: Side::Inter,
            kind: Kind::InterAllReduce { at: 4, len: 8, sharded: false },
            after: None,
            only_node: None,
            only_local: None,
        },
    ];
    let bad = Staged { steps, ..staged };
    assert!(bad.check_races(&map).is_err());
}

#[test]
fn pieces_overlap_the_two_sides() {
    // Piece i's inter-node AllReduce waits only for its own ReduceScatter; the ReduceScatter of
    // piece i+1 is issued before piece i's AllGather, which waits for the AllReduce.
    let map = NodeMap::by_count(16, 8).unwrap();
    let s = Staged::all_reduce(&map, 8 * 1024, 8 * 256);
    let kinds: Vec<&str> = s
        .steps
        .iter()
        .map(|s| match s.kind {
            Kind::IntraReduceScatter { .. } => "RS",
            Kind::InterAllReduce { .. } => "AR",
            Kind::IntraAllGather { .. } => "AG",
            _ => "?",
        })
        .collect();
    assert_eq!(kinds, ["RS", "AR", "RS", "AR", "AG", "RS", "AR", "AG", "RS", "AR", "AG", "AG"]);
    assert_eq!(s.steps[1].after, Some(0));
    assert_eq!(s.steps[4].after, Some(1));
    assert!(s.steps.iter().all(|st| st.side == if matches!(st.kind, Kind::InterAllReduce { .. }) { Side::Inter } else { Side::Intra }));
}

/// Bytes through each NVLink egress port and each NIC's egress side in the simulation of `algo`
/// on `nodes` × `g` at `bytes` per rank.
fn simulated(algo: Algorithm, nodes: u32, g: u32, bytes: u64) -> (Vec<f64>, Vec<f64>) {
    let plan = compile(&algo.generate(nodes, g).unwrap(), &Options::default()).unwrap();
    let r = simulate(&plan, &Topology::h200(nodes, g), &SimOptions::for_size(&plan, bytes, 1 << 20)).unwrap();
    let of = |kind: &str, prefix: &str| -> Vec<f64> {
        (0..nodes * g)
            .map(|i| r.links.iter().find(|l| l.name == format!("{prefix}{i} {kind}")).map_or(0.0, |l| l.bytes))
            .collect()
    };
    (of("nvlink out", "r"), of("out", "nic"))
}

#[test]
fn bytes_per_link_match_the_simulated_hier_programs() {
    for (nodes, g) in [(2u32, 2u32), (2, 4), (4, 2), (3, 3), (4, 4)] {
        let map = NodeMap::by_count((nodes * g) as usize, g as usize).unwrap();
        let n = (nodes * g) as u64;
        // A count every block divides, and pieces of it: the bytes do not depend on the pieces.
        let count = n * 1024;
        for (algo, staged, bytes) in [
            (Algorithm::HierAllReduce, Staged::all_reduce(&map, count, count / 4), count * 4),
            (Algorithm::HierAllGather, Staged::all_gather(&map, count).unwrap(), n * count * 4),
        ] {
            let want = staged.link_bytes(&map, 4).unwrap();
            let (nvlink, nic) = simulated(algo, nodes, g, bytes);
            // The simulator's bytes are fluid (sums of rate × time): equal to a part in 10⁹.
            let close = |a: f64, b: u64| (a - b as f64).abs() <= 1e-9 * b as f64;
            for r in 0..n as usize {
                assert!(
                    close(nvlink[r], want.nvlink),
                    "{algo} {nodes}x{g}: rank {r} over NVLink {} != {}",
                    nvlink[r],
                    want.nvlink
                );
                assert!(close(nic[r], want.nic), "{algo} {nodes}x{g}: rank {r}'s NIC {} != {}", nic[r], want.nic);
            }
            assert!(want.nic > 0 && want.nvlink > 0);
        }
    }
}

/// Avg across nodes averages each node's ranks, then the nodes' averages: on every staged reducing
/// collective (AllReduce in pieces, ReduceScatter, Reduce onto every root; out of place and in
/// place) that is the flat average of the world, within f64 rounding (exact where `1/g` and
/// `1/nodes` are, as for powers of two).
#[test]
fn staged_averages_are_the_world_average() {
    let mut rng = Rng::new(53);
    let mut checked = 0;
    for (nodes, g) in SHAPES {
        let world = nodes * g;
        let map = NodeMap::by_count(world, g).unwrap();
        let exact = nodes.is_power_of_two() && g.is_power_of_two();
        let inputs = |rng: &mut Rng, len: usize| -> Vec<Vec<f64>> {
            inputs(rng, world, len)
                .into_iter()
                .map(|v| v.into_iter().map(|x| (x * world as i32) as f64).collect())
                .collect()
        };
        let mean = |v: Vec<f64>| -> Vec<f64> { v.into_iter().map(|x| x / world as f64).collect() };
        let close = |got: &[f64], want: &[f64], what: &str| {
            assert_eq!(got.len(), want.len(), "{what}");
            for (i, (a, b)) in got.iter().zip(want).enumerate() {
                let ok = if exact { a == b } else { (a - b).abs() <= 1e-12 * b.abs().max(1.0) };
                assert!(ok, "{what} on {nodes}x{g}: element {i} is {a}, the average {b}");
            }
        };
        // Out of place into `len` elements per rank, and in place.
        let run = |staged: &Staged, send: &[Vec<f64>], len: usize| {
            let mut recv = vec![vec![-99.0; len]; world];
            staged.run_cpu(&map, Some(send), &mut recv, ReduceOp::Avg).unwrap();
            let mut buf = send.to_vec();
            staged.run_cpu(&map, None, &mut buf, ReduceOp::Avg).unwrap();
            (recv, buf)
        };
        let (count, piece) = (1 + rng.below(120) as u64, 1 + rng.below(40) as u64);
        let send = inputs(&mut rng, count as usize);
        let want = mean(reference::all_reduce(&send, ReduceOp::Sum).unwrap().swap_remove(0));
        let (recv, buf) = run(&Staged::all_reduce(&map, count, piece), &send, count as usize);
        for r in 0..world {
            close(&recv[r], &want, "AllReduce");
            close(&buf[r], &want, "AllReduce in place");
            checked += 2;
        }
        let c = rng.below(20) as usize;
        let send = inputs(&mut rng, world * c);
        let want: Vec<Vec<f64>> =
            reference::reduce_scatter(&send, ReduceOp::Sum).unwrap().into_iter().map(mean).collect();
        let (recv, buf) = run(&Staged::reduce_scatter(&map, c as u64).unwrap(), &send, c);
        for r in 0..world {
            close(&recv[r], &want[r], "ReduceScatter");
            close(&buf[r][r * c..(r + 1) * c], &want[r], "ReduceScatter in place");
            checked += 2;
        }
        let root = rng.below(world as u32);
        let send = inputs(&mut rng, count as usize);
        let want = mean(reference::all_reduce(&send, ReduceOp::Sum).unwrap().swap_remove(0));
        let (recv, buf) = run(&Staged::reduce(&map, count, root, piece), &send, count as usize);
        close(&recv[root as usize], &want, "Reduce");
        close(&buf[root as usize], &want, "Reduce in place");
        checked += 2;
    }
    assert!(checked > 500, "{checked}");
}
