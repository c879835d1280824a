//! Communicators across nodes on one GPU: eight ranks as threads, posing as two nodes of four
//! (`Config::ranks_per_node`), the inter-node steps on oxccl's own engine
//! ([`oxccl::internode::EngineGroup`]; NCCL refuses two ranks on one GPU). Staged AllReduce, in
//! and out of place, random counts (tails below the ranks per node included) and small pieces,
//! exact against the CPU sum.

mod common;

use oxccl::bootstrap::LocalBootstrap;
use oxccl::internode::EngineGroup;
use oxccl::{Bootstrap, Comm, Config, ReduceOp};
use rand::RngExt;
use std::time::Duration;

#[test]
fn staged_all_reduce_on_virtual_nodes_matches_the_cpu() {
    let Some(stream) = common::gpu("staged_all_reduce_on_virtual_nodes_matches_the_cpu") else { return };
    let ctx = stream.context().clone();
    let (world, per_node) = (8usize, 4u32);
    let config = Config {
        ranks_per_node: Some(per_node),
        inter_piece_bytes: Some(4096),
        // Node and group kernels of all eight ranks resident at once on one GPU.
        max_ctas: Some(2),
        timeout: Duration::from_secs(20),
        ..Config::default()
    };
    let seed = common::seed_from_env(0x5EED_0DE5);
    let mut rng = common::rng(seed);
    let counts: Vec<usize> = (0..12).map(|i| if i == 0 { 1 } else { rng.random_range(1..20_000) }).collect();
    let inputs: Vec<Vec<Vec<i32>>> = counts
        .iter()
        .map(|&n| (0..world).map(|_| (0..n).map(|_| rng.random_range(-100..=100)).collect()).collect())
        .collect();
    let handles: Vec<_> = LocalBootstrap::group(world, config.timeout)
        .into_iter()
        .map(|boot| {
            let (ctx, config, counts, inputs) = (ctx.clone(), config.clone(), counts.clone(), inputs.clone());
            std::thread::spawn(move || -> Result<Vec<(usize, bool)>, oxccl::Error> {
                let stream = ctx.new_stream().unwrap();
                let r = boot.rank();
                let inter_config = config.clone();
                let comm = Comm::with_inter_node(&stream, Box::new(boot), config, move |map, bootstrap, inter| {
                    Ok(Box::new(EngineGroup::new(map, bootstrap, inter, inter_config)?))
                })?;
                assert_eq!((comm.rank(), comm.world()), (r, world));
                assert_eq!(comm.node_map().map(|m| m.nodes()), Some(2));
                let mut out = Vec::new();
                for (case, &n) in counts.iter().enumerate() {
                    let send = stream.clone_htod(&inputs[case][r]).unwrap();
                    let mut recv = stream.alloc_zeros::<i32>(n).unwrap();
                    comm.all_reduce(&send, &mut recv, ReduceOp::Sum)?;
                    let mut buf = stream.clone_htod(&inputs[case][r]).unwrap();
                    comm.all_reduce_in_place(&mut buf, ReduceOp::Sum)?;
                    comm.synchronize()?;
                    let want: Vec<i32> = (0..n).map(|i| (0..world).map(|q| inputs[case][q][i]).sum()).collect();
                    let (a, b) = (stream.clone_dtoh(&recv).unwrap(), stream.clone_dtoh(&buf).unwrap());
                    out.push((n, a == want && b == want));
                }
                // What does not run across nodes yet is refused by name.
                let mut x = stream.alloc_zeros::<i32>(8).unwrap();
                let e = comm.all_gather_in_place(&mut x).unwrap_err();
                assert!(e.to_string().contains("across 2 nodes"), "{e}");
                Ok(out)
            })
        })
        .collect();
    let mut cases = 0;
    for (r, h) in handles.into_iter().enumerate() {
        let got = h.join().expect("a rank thread panicked").unwrap_or_else(|e| panic!("rank {r}: {e}"));
        for (n, ok) in got {
            assert!(ok, "rank {r}: staged AllReduce of {n} i32 differs from the CPU sum (seed {seed})");
            cases += 1;
        }
    }
    println!("{cases} rank-cases of staged AllReduce (2 nodes x 4, pieces of 4 KiB) exact (seed {seed})");
}
