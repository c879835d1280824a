//! Communicators across nodes on one GPU: eight ranks as threads, posing as two nodes of four
//! (`Config::ranks_per_node`), the inter-node steps on oxccl's own engine
//! ([`oxccl::internode::EngineGroup`]; NCCL refuses two ranks on one GPU). The five staged
//! collectives, in and out of place, random counts (tails below the ranks per node
//! included) and small pieces, exact against the CPU references.

mod common;

use cudarc::driver::{CudaContext, CudaStream};
use oxccl::bootstrap::LocalBootstrap;
use oxccl::internode::EngineGroup;
use oxccl::{Bootstrap, Comm, Config, ReduceOp};
use rand::RngExt;
use std::sync::Arc;
use std::time::Duration;

/// Rank `boot`'s stream and its communicator across the posing nodes, the inter-node steps on
/// [`EngineGroup`].
fn rank_comm(
    ctx: &Arc<CudaContext>,
    boot: LocalBootstrap,
    config: Config,
) -> Result<(Arc<CudaStream>, Comm), oxccl::Error> {
    let stream = ctx.new_stream().unwrap();
    let inter_config = config.clone();
    let comm = Comm::with_inter_node(&stream, Box::new(boot), config, move |map, bootstrap, inter| {
        Ok(Box::new(EngineGroup::new(map, bootstrap, inter, inter_config)?))
    })?;
    Ok((stream, comm))
}

/// Rank `r`'s errors, said at once (a thread's result is read only after the ranks before it end).
fn said(r: usize) -> impl Fn(oxccl::Error) -> oxccl::Error + Copy {
    move |e| {
        eprintln!("rank {r}: {e}");
        e
    }
}

/// Under `OXCCL_TEST_TRACE`, rank `r` says which step of which case it reaches (where a run stops).
fn tracer(r: usize) -> impl Fn(usize, &str) + Copy {
    let trace = std::env::var_os("OXCCL_TEST_TRACE").is_some();
    move |case, what| {
        if trace {
            eprintln!("rank {r} case {case}: {what}");
        }
    }
}

#[test]
fn staged_collectives_on_virtual_nodes_match_the_cpu() {
    let Some(stream) = common::gpu("staged_collectives_on_virtual_nodes_match_the_cpu") else { return };
    let _dump = common::hang_dump_from_env();
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
            let name = format!("rank-{}", boot.rank());
            std::thread::Builder::new()
                .name(name)
                .spawn(move || -> Result<Vec<(usize, bool)>, oxccl::Error> {
                    let r = boot.rank();
                    let (said, at) = (said(r), tracer(r));
                    let (stream, comm) = rank_comm(&ctx, boot, config)?;
                    assert_eq!((comm.rank(), comm.world()), (r, world));
                    assert_eq!(comm.node_map().map(|m| m.nodes()), Some(2));
                    let mut out = Vec::new();
                    for (case, &n) in counts.iter().enumerate() {
                        // Every copy from the host first, while no call of this rank is queued: a
                        // copy from pageable memory may wait in the host for staging buffers held by
                        // copies queued behind other ranks' calls (see USAGE.md).
                        let m = n.min(3000);
                        let root = case % world;
                        let send = stream.clone_htod(&inputs[case][r]).unwrap();
                        let mut buf = stream.clone_htod(&inputs[case][r]).unwrap();
                        let mine = stream.clone_htod(&inputs[case][r][..m]).unwrap();
                        let mut all_in = stream.alloc_zeros::<i32>(m * world).unwrap();
                        stream.memcpy_htod(&inputs[case][r][..m], &mut all_in.slice_mut(r * m..(r + 1) * m)).unwrap();
                        let mut got_in = stream.clone_htod(&inputs[case][r]).unwrap();
                        let mut sum_in = stream.clone_htod(&inputs[case][r]).unwrap();
                        // Avg on f32 multiples of 8: the node side's division by 4 and the inter-node
                        // side's by 2 are exact, so the average of averages equals the average.
                        let eights = |v: &[i32]| v.iter().map(|&x| (8 * x) as f32).collect::<Vec<f32>>();
                        let favg = stream.clone_htod(&eights(&inputs[case][r])).unwrap();
                        let mut favg_in = stream.clone_htod(&eights(&inputs[case][r])).unwrap();
                        let gathered: Vec<i32> =
                            (0..world).flat_map(|q| inputs[case][q][..m].iter().copied()).collect();
                        let fall = stream.clone_htod(&eights(&gathered)).unwrap();
                        at(case, "all_reduce");
                        let mut recv = stream.alloc_zeros::<i32>(n).unwrap();
                        comm.all_reduce(&send, &mut recv, ReduceOp::Sum).map_err(said)?;
                        comm.all_reduce_in_place(&mut buf, ReduceOp::Sum).map_err(said)?;
                        comm.synchronize().map_err(said)?;
                        let want: Vec<i32> = (0..n).map(|i| (0..world).map(|q| inputs[case][q][i]).sum()).collect();
                        let (a, b) = (stream.clone_dtoh(&recv).unwrap(), stream.clone_dtoh(&buf).unwrap());
                        out.push((n, a == want && b == want));
                        at(case, "all_reduce, reduce_scatter, reduce (Avg)");
                        let mut frecv = stream.alloc_zeros::<f32>(n).unwrap();
                        let mut fblock = stream.alloc_zeros::<f32>(m).unwrap();
                        let mut fsum = stream.alloc_zeros::<f32>(n).unwrap();
                        comm.all_reduce(&favg, &mut frecv, ReduceOp::Avg).map_err(said)?;
                        comm.all_reduce_in_place(&mut favg_in, ReduceOp::Avg).map_err(said)?;
                        comm.reduce_scatter(&fall, &mut fblock, ReduceOp::Avg).map_err(said)?;
                        comm.reduce(&favg, if r == root { Some(&mut fsum) } else { None }, ReduceOp::Avg, root)
                            .map_err(said)?;
                        comm.synchronize().map_err(said)?;
                        let fwant: Vec<f32> = want.iter().map(|&x| x as f32).collect();
                        let (fa, fb) = (stream.clone_dtoh(&frecv).unwrap(), stream.clone_dtoh(&favg_in).unwrap());
                        out.push((n, fa == fwant && fb == fwant));
                        // Every rank sends the same gathered buffer: block r's average is block r.
                        let fblock_want = eights(&gathered[r * m..(r + 1) * m]);
                        out.push((m, stream.clone_dtoh(&fblock).unwrap() == fblock_want));
                        if r == root {
                            out.push((n, stream.clone_dtoh(&fsum).unwrap() == fwant));
                        }
                        // AllGather (out of place and in place) and Broadcast from a rank that moves with
                        // the case.
                        at(case, "all_gather, broadcast");
                        let mut all = stream.alloc_zeros::<i32>(m * world).unwrap();
                        comm.all_gather(&mine, &mut all).map_err(said)?;
                        comm.all_gather_in_place(&mut all_in).map_err(said)?;
                        let mut got = stream.alloc_zeros::<i32>(n).unwrap();
                        comm.broadcast(if r == root { Some(&send) } else { None }, &mut got, root).map_err(said)?;
                        comm.broadcast_in_place(&mut got_in, (root + 3) % world).map_err(said)?;
                        comm.synchronize().map_err(said)?;
                        let (c, d) = (stream.clone_dtoh(&all).unwrap(), stream.clone_dtoh(&all_in).unwrap());
                        let (f, h) = (stream.clone_dtoh(&got).unwrap(), stream.clone_dtoh(&got_in).unwrap());
                        out.push((m, c == gathered && d == gathered));
                        out.push((n, f == inputs[case][root] && h == inputs[case][(root + 3) % world]));
                        // ReduceScatter (block `r` of every rank's `world × m`: rank q's `all_in` is
                        // the gathered blocks) and Reduce onto `root`, out of place and in place.
                        at(case, "reduce_scatter, reduce");
                        let mut block = stream.alloc_zeros::<i32>(m).unwrap();
                        comm.reduce_scatter(&all, &mut block, ReduceOp::Sum).map_err(said)?;
                        comm.reduce_scatter_in_place(&mut all_in, ReduceOp::Sum).map_err(said)?;
                        let mut sum = stream.alloc_zeros::<i32>(n).unwrap();
                        comm.reduce(&send, if r == root { Some(&mut sum) } else { None }, ReduceOp::Sum, root)
                            .map_err(said)?;
                        comm.reduce_in_place(&mut sum_in, ReduceOp::Sum, root).map_err(said)?;
                        comm.synchronize().map_err(said)?;
                        // Every rank holds the same gathered buffer: the reduction of block r is world
                        // times block r.
                        let want_block: Vec<i32> = inputs[case][r][..m].iter().map(|x| x * world as i32).collect();
                        let (i, j) = (stream.clone_dtoh(&block).unwrap(), stream.clone_dtoh(&all_in).unwrap());
                        out.push((m, i == want_block && j[r * m..(r + 1) * m] == want_block[..]));
                        if r == root {
                            let (k, l) = (stream.clone_dtoh(&sum).unwrap(), stream.clone_dtoh(&sum_in).unwrap());
                            out.push((n, k == want && l == want));
                        }
                    }
                    // What does not run across nodes yet is refused by name.
                    let e = comm.prepare::<i32>(oxccl::Collective::AllReduce, 8, ReduceOp::Sum, true).unwrap_err();
                    assert!(e.to_string().contains("across 2 nodes"), "{e}");
                    // An integer average of per-node averages would lose the remainders: refused on
                    // every rank before anything is queued.
                    let (ints, mut out_ints) =
                        (stream.clone_htod(&[1i32; 8]).unwrap(), stream.alloc_zeros::<i32>(8).unwrap());
                    let e = comm.all_reduce(&ints, &mut out_ints, ReduceOp::Avg).unwrap_err();
                    assert!(matches!(e, oxccl::Error::Unsupported { .. }) && e.to_string().contains("int32"), "{e}");
                    Ok(out)
                })
                .unwrap()
        })
        .collect();
    let mut cases = 0;
    for (r, h) in handles.into_iter().enumerate() {
        let got = h.join().expect("a rank thread panicked").unwrap_or_else(|e| panic!("rank {r}: {e}"));
        for (n, ok) in got {
            assert!(ok, "rank {r}: a staged call on {n} elements differs from the CPU reference (seed {seed})");
            cases += 1;
        }
    }
    println!(
        "{cases} rank-cases of the five staged collectives and the f32 averages (2 nodes x 4, pieces of 4 KiB) exact (seed {seed})"
    );
}

/// NCCL loaded at run time (`OXCCL_NCCL`, or the loader's path) and driven through the binding: a
/// group of one rank (NCCL refuses two ranks on one GPU) whose AllReduce, Broadcast and Reduce
/// leave the data as it is. Skipped loudly where NCCL cannot be loaded, unless
/// `OXCCL_REQUIRE_NCCL` is set.
#[test]
fn nccl_through_the_binding_on_a_one_rank_group() {
    use oxccl::internode::{InterNode, Nccl, NcclGroup};
    let Some(stream) = common::gpu("nccl_through_the_binding_on_a_one_rank_group") else { return };
    let nccl = match Nccl::load() {
        Ok(n) => n,
        Err(e) if std::env::var_os("OXCCL_REQUIRE_NCCL").is_none() => {
            common::skip(&format!("skipped: NCCL not loaded ({e})"));
            return;
        }
        Err(e) => panic!("{e}"),
    };
    println!("NCCL {} from {}", nccl.version(), nccl.path());
    let id = nccl.unique_id().unwrap();
    let group = NcclGroup::new(nccl, id, 0, 1, stream.context(), Duration::from_secs(20)).unwrap();
    assert_eq!((group.group_rank(), group.group_size()), (0, 1));
    let data: Vec<f32> = (0..4096).map(|i| i as f32 * 0.5).collect();
    let mut buf = stream.clone_htod(&data).unwrap();
    let mut out = stream.alloc_zeros::<f32>(data.len()).unwrap();
    {
        use cudarc::driver::DevicePtrMut;
        let (b, _b) = buf.device_ptr_mut(&stream);
        let (o, _o) = out.device_ptr_mut(&stream);
        // SAFETY: both buffers hold 4096 f32 on this device and outlive the synchronize below.
        unsafe {
            group.all_reduce(b, data.len(), oxccl::DType::F32, ReduceOp::Sum, &stream).unwrap();
            group.broadcast(b, o, data.len(), oxccl::DType::F32, 0, false, &stream).unwrap();
            group.reduce(o, o, data.len(), oxccl::DType::F32, ReduceOp::Max, 0, &stream).unwrap();
        }
    }
    stream.synchronize().unwrap();
    group.check().unwrap();
    assert_eq!(stream.clone_dtoh(&buf).unwrap(), data);
    assert_eq!(stream.clone_dtoh(&out).unwrap(), data);
    // A missing library is a typed error naming what was tried.
    let (tried, why) = Nccl::load_from(&["/nonexistent/libnccl.so.2".into()]).unwrap_err();
    assert!(tried.len() == 1 && why.contains("/nonexistent/libnccl.so.2"), "{why}");
}

/// The value rank `a` sends rank `b` at element `i` in case `case`: each pair and position its own.
fn sent(case: usize, a: usize, b: usize, i: usize) -> i32 {
    (case * 1_000_003 + a * 10_007 + b * 101 + i) as i32
}

/// Elements rank `a` sends rank `b` in case `case` (tails of every length below a vector).
fn sent_len(case: usize, a: usize, b: usize) -> usize {
    1 + (case * 977 + a * 131 + b * 37) % 5000
}

/// Sends and receives across posing nodes (`world` ranks as threads, `per_node` a node, the
/// inter-node transfers on [`EngineGroup`]): per case a group with an AllReduce, a transfer each
/// way with every rank it may reach (its node's, and its local rank's on other nodes) and a second
/// one with the next and previous node, then single sends and receives between paired nodes; a
/// transfer to another node's other local rank is
/// refused before anything is queued, and the communicator goes on. With one rank per node every
/// rank reaches every other: AllToAllv and AllToAll too. Returns the rank-cases checked.
fn transfers_on_virtual_nodes(world: usize, per_node: u32, cases: usize) -> usize {
    let Some(stream) = common::gpu("transfers_across_virtual_nodes_match_the_cpu") else { return 0 };
    let ctx = stream.context().clone();
    let p = per_node as usize;
    let config = Config {
        ranks_per_node: Some(per_node),
        inter_piece_bytes: Some(4096),
        max_ctas: Some(2),
        timeout: Duration::from_secs(20),
        ..Config::default()
    };
    let handles: Vec<_> = LocalBootstrap::group(world, config.timeout)
        .into_iter()
        .map(|boot| {
            let (ctx, config) = (ctx.clone(), config.clone());
            std::thread::Builder::new()
                .name(format!("rank-{}", boot.rank()))
                .spawn(move || -> Result<Vec<(String, bool)>, oxccl::Error> {
                    let r = boot.rank();
                    let (said, at) = (said(r), tracer(r));
                    let (stream, comm) = rank_comm(&ctx, boot, config)?;
                    let reach = |q: usize| q / p == r / p || q % p == r % p;
                    let mut out = Vec::new();
                    for case in 0..cases {
                        at(case, "group");
                        let peers: Vec<usize> = (0..world).filter(|&q| q != r && reach(q)).collect();
                        let sends: Vec<_> = peers
                            .iter()
                            .map(|&q| {
                                let v: Vec<i32> = (0..sent_len(case, r, q)).map(|i| sent(case, r, q, i)).collect();
                                stream.clone_htod(&v).unwrap()
                            })
                            .collect();
                        let mut recvs: Vec<_> =
                            peers.iter().map(|&q| stream.alloc_zeros::<i32>(sent_len(case, q, r)).unwrap()).collect();
                        let n = 1 + case * 1000;
                        let mine: Vec<i32> = (0..n).map(|i| (r * 7 + i) as i32).collect();
                        let mut sum = stream.clone_htod(&mine).unwrap();
                        // A second transfer to the same local rank on the next node and from the
                        // previous one (the same peer on two nodes): matched in order after the first.
                        let nodes = world / p;
                        let (next, prev) = ((r + p) % world, (r + world - p) % world);
                        let one = stream.clone_htod(&vec![r as i32; 100 + case]).unwrap();
                        let mut got = stream.alloc_zeros::<i32>(100 + case).unwrap();
                        {
                            let mut g = comm.group();
                            g.all_reduce_in_place(&mut sum, ReduceOp::Sum)?;
                            for (s, &q) in sends.iter().zip(&peers) {
                                g.send(s, q)?;
                            }
                            for (d, &q) in recvs.iter_mut().zip(&peers) {
                                g.recv(d, q)?;
                            }
                            if nodes > 1 {
                                g.send(&one, next)?.recv(&mut got, prev)?;
                            }
                            g.run().map_err(said)?;
                        }
                        at(case, "single calls");
                        // Single calls with the same local rank on the paired node (0 with 1, 2 with
                        // 3): the lower node sends first, the other receives first (two ranks whose
                        // sends come first would each wait for the other's receive, as with NCCL).
                        let node = r / p;
                        let partner = ((node ^ 1) < nodes).then(|| (node ^ 1) * p + r % p);
                        let pair = stream.clone_htod(&vec![-(r as i32); 50 + case]).unwrap();
                        let mut paired = stream.alloc_zeros::<i32>(50 + case).unwrap();
                        if let Some(q) = partner {
                            if node < q / p {
                                comm.send(&pair, q).map_err(said)?;
                                comm.recv(&mut paired, q).map_err(said)?;
                            } else {
                                comm.recv(&mut paired, q).map_err(said)?;
                                comm.send(&pair, q).map_err(said)?;
                            }
                        }
                        at(case, "synchronize");
                        comm.synchronize().map_err(said)?;
                        at(case, "check");
                        let want: Vec<i32> = (0..n).map(|i| (0..world).map(|q| (q * 7 + i) as i32).sum()).collect();
                        out.push((format!("case {case}: group AllReduce"), stream.clone_dtoh(&sum).unwrap() == want));
                        for (d, &q) in recvs.iter().zip(&peers) {
                            let want: Vec<i32> = (0..sent_len(case, q, r)).map(|i| sent(case, q, r, i)).collect();
                            out.push((
                                format!("case {case}: group receive from {q}"),
                                stream.clone_dtoh(d).unwrap() == want,
                            ));
                        }
                        if nodes > 1 {
                            let ok = stream.clone_dtoh(&got).unwrap() == vec![prev as i32; 100 + case];
                            out.push((format!("case {case}: second group receive from {prev}"), ok));
                        }
                        if let Some(q) = partner {
                            let ok = stream.clone_dtoh(&paired).unwrap() == vec![-(q as i32); 50 + case];
                            out.push((format!("case {case}: receive from {q}"), ok));
                        }
                        // Another node's other local rank: refused by name, nothing queued.
                        if let Some(far) = (0..world).find(|&q| !reach(q)) {
                            let e = comm.send(&one, far).unwrap_err();
                            let ok = matches!(e, oxccl::Error::Unsupported { .. })
                                && e.to_string().contains("same local rank");
                            out.push((format!("case {case}: refused {e}"), ok));
                        }
                        if p == 1 {
                            // AllToAllv: rank a sends rank b sent_len(case, a, b) elements.
                            let send_counts: Vec<usize> = (0..world).map(|q| sent_len(case, r, q)).collect();
                            let recv_counts: Vec<usize> = (0..world).map(|q| sent_len(case, q, r)).collect();
                            let v: Vec<i32> = (0..world)
                                .flat_map(|q| (0..send_counts[q]).map(move |i| sent(case, r, q, i)))
                                .collect();
                            let s = stream.clone_htod(&v).unwrap();
                            let mut d = stream.alloc_zeros::<i32>(recv_counts.iter().sum()).unwrap();
                            comm.all_to_allv(&s, &send_counts, &mut d, &recv_counts).map_err(said)?;
                            let m = 1 + case * 300;
                            let blocks: Vec<i32> =
                                (0..world).flat_map(|q| (0..m).map(move |i| sent(case, r, q, i))).collect();
                            let s2 = stream.clone_htod(&blocks).unwrap();
                            let mut d2 = stream.alloc_zeros::<i32>(m * world).unwrap();
                            comm.all_to_all(&s2, &mut d2).map_err(said)?;
                            comm.synchronize().map_err(said)?;
                            let want: Vec<i32> = (0..world)
                                .flat_map(|q| (0..recv_counts[q]).map(move |i| sent(case, q, r, i)))
                                .collect();
                            out.push((format!("case {case}: all_to_allv"), stream.clone_dtoh(&d).unwrap() == want));
                            let want2: Vec<i32> =
                                (0..world).flat_map(|q| (0..m).map(move |i| sent(case, q, r, i))).collect();
                            out.push((format!("case {case}: all_to_all"), stream.clone_dtoh(&d2).unwrap() == want2));
                        }
                    }
                    Ok(out)
                })
                .unwrap()
        })
        .collect();
    // Every rank's outcome before any verdict: the first error a rank met is the cause, its peers'
    // timeouts follow from it.
    let outcomes: Vec<_> = handles.into_iter().map(|h| h.join().expect("a rank thread panicked")).collect();
    let failed: Vec<String> =
        outcomes.iter().enumerate().filter_map(|(r, o)| o.as_ref().err().map(|e| format!("rank {r}: {e}"))).collect();
    assert!(failed.is_empty(), "{world} ranks, {per_node} a node:\n{}", failed.join("\n"));
    let mut checked = 0;
    for (r, got) in outcomes.into_iter().enumerate() {
        for (what, ok) in got.unwrap() {
            assert!(ok, "rank {r} of {world} ({per_node} a node): {what}");
            checked += 1;
        }
    }
    checked
}

#[test]
fn transfers_across_virtual_nodes_match_the_cpu() {
    let mut checked = 0;
    for (world, per_node) in [(4, 1), (6, 2), (8, 4)] {
        checked += transfers_on_virtual_nodes(world, per_node, 4);
    }
    if checked > 0 {
        println!("{checked} rank-checks of sends, receives, groups and AllToAll(v) across posing nodes exact");
    }
}
