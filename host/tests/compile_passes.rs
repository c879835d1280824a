//! Compiler passes: golden dumps after every pass, the pass table, and scheduler invariants.

mod common;

use common::{golden, random_program};
use oxccl_host::compile::{self, Options, PASSES, Prim, Scheduler, TbAlloc, run_passes};
use oxccl_host::program::OpId;
use oxccl_host::program::generators::Algorithm;
use proptest::prelude::*;

#[test]
fn pass_table_is_complete() {
    let names: Vec<&str> = PASSES.iter().map(|p| p.name).collect();
    assert_eq!(names, ["deps", "schedule", "tb-alloc", "emit"]);
    assert!(PASSES.iter().all(|p| !p.description.is_empty()));
}

/// A change detector for the passes' dumps: the files are the blessed output (`OXCCL_BLESS=1`,
/// read when blessed), not an independent truth. That these plans compute their collectives is
/// checked by running them: `exec_executor.rs` (`every_generator_every_configuration`, every
/// generator, scheduler and allocator against the reference).
#[test]
fn golden_dumps_after_every_pass() {
    let cases = [
        (Algorithm::RingAllReduce, 1, 4, Scheduler::Hpds, TbAlloc::State),
        (Algorithm::HmAllReduce, 2, 2, Scheduler::Hpds, TbAlloc::State),
        (Algorithm::HmAllGather, 2, 2, Scheduler::RoundRobin, TbAlloc::State),
        (Algorithm::HmAllGather, 2, 2, Scheduler::Algorithm, TbAlloc::PerConn),
        (Algorithm::HmAllReduce, 2, 2, Scheduler::Stage, TbAlloc::PerConn),
    ];
    for (algo, n, g, s, a) in cases {
        let p = algo.generate(n, g).unwrap();
        let c = run_passes(&p, &Options::new(s, a)).unwrap();
        for pass in PASSES {
            let dump = c.dump(&p, pass.name).unwrap();
            golden(&format!("compile_{}_{}_{}_{}.txt", p.name, s.name(), a.name(), pass.name), &dump);
        }
    }
}

#[test]
fn algorithm_level_per_connection_is_the_interpreted_shape() {
    // MSCCL's structure: one TB per connection endpoint and stage, one segment per TB re-walked per
    // micro-batch, dependency flags on the steps that wait and the steps waited on.
    let p = Algorithm::HmAllGather.generate(2, 4).unwrap();
    let plan = compile::compile(&p, &Options::new(Scheduler::Algorithm, TbAlloc::PerConn)).unwrap();
    assert_eq!(plan.subpipelines, 1);
    for rp in &plan.ranks {
        for tb in &rp.tbs {
            assert_eq!(tb.segments().len(), 1);
            let prims: std::collections::BTreeSet<_> = tb.tasks.iter().map(|t| t.prim == Prim::Send).collect();
            assert_eq!(prims.len(), 1, "a TB only sends or only receives");
            let conns: std::collections::BTreeSet<_> = tb.tasks.iter().map(|t| t.conn).collect();
            assert_eq!(conns.len(), 1, "one connection per TB");
        }
    }
    assert!(plan.ranks[0].tbs.iter().any(|tb| (0..tb.tasks.len()).any(|i| !tb.waits(i).is_empty())));
}

#[test]
fn hpds_keeps_intra_node_ops_out_of_their_inter_node_producers_sub_pipeline() {
    let p = Algorithm::HmAllGather.generate(2, 4).unwrap();
    let c = run_passes(&p, &Options::default()).unwrap();
    let sp = c.schedule.subpipelines();
    for a in 0..p.ops.len() {
        for &b in c.graph.op_succs.row(a) {
            let (oa, ob) = (p.op(OpId::new(a)), p.op(OpId(b)));
            if c.graph.is_inter(oa) && !c.graph.is_inter(ob) {
                assert!(sp[a] < sp[b as usize]);
            }
        }
    }
    // The local forwards of remote chunks come after the NIC receives: two sub-pipelines.
    assert_eq!(c.schedule.count(), 2);
}

#[test]
fn options_parse() {
    assert_eq!("hpds".parse::<Scheduler>().unwrap(), Scheduler::Hpds);
    assert_eq!("rr".parse::<Scheduler>().unwrap(), Scheduler::RoundRobin);
    assert_eq!("algo".parse::<Scheduler>().unwrap(), Scheduler::Algorithm);
    assert_eq!("stage".parse::<Scheduler>().unwrap(), Scheduler::Stage);
    assert!("fifo".parse::<Scheduler>().is_err());
    assert_eq!("per-conn".parse::<TbAlloc>().unwrap(), TbAlloc::PerConn);
    assert!("x".parse::<TbAlloc>().is_err());
}

#[test]
fn invalid_programs_are_compile_errors() {
    let mut p = Algorithm::RingAllGather.generate(1, 3).unwrap();
    p.ops[0].kind = match p.ops[0].kind {
        oxccl_host::program::OpKind::Transfer { src_rank, channel, src, dst, op, .. } => {
            oxccl_host::program::OpKind::Transfer {
                src_rank,
                dst_rank: oxccl_host::program::Rank(9),
                channel,
                src,
                dst,
                op,
            }
        }
        k => k,
    };
    let e = compile::compile(&p, &Options::default()).unwrap_err();
    assert!(e.to_string().contains("op0"), "{e}");
}

/// Each rank's endpoints, counted from the program's ops: a transfer's send side on its source
/// rank and receive side on its destination, one per (peer, channel) and, `per_conn`, per stage;
/// local ops one per (rank, channel) and, `per_conn`, per stage.
fn endpoints_per_rank(p: &oxccl_host::program::Program, per_conn: bool) -> Vec<u32> {
    use oxccl_host::program::OpKind;
    use std::collections::HashSet;
    let mut seen = HashSet::new();
    let mut count = vec![0u32; p.ranks() as usize];
    for op in &p.ops {
        let stage = if per_conn { op.stage } else { 0 };
        let sides = match op.kind {
            OpKind::Transfer { src_rank, dst_rank, channel, .. } => {
                let conn = (src_rank.0, dst_rank.0, channel, stage);
                vec![(src_rank.0, 0, conn), (dst_rank.0, 1, conn)]
            }
            _ => vec![(op.src_rank().0, 2, (0, 0, op.channel(), stage))],
        };
        for (rank, side, key) in sides {
            if seen.insert((rank, side, key)) {
                count[rank as usize] += 1;
            }
        }
    }
    count
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, .. ProptestConfig::default() })]

    /// Every scheduler and allocator produces a plan that passes every verifier, with TB counts
    /// bounded by the endpoint count, and state-based never above per-connection.
    #[test]
    fn every_configuration_verifies(seed in any::<u64>(), coll in 0usize..common::COLLECTIVES, ranks in 2u32..6, k in 1u32..3, ch in 1u32..3, per_node in 1u32..4) {
        let c = common::nth_collective(coll, seed, ranks);
        let mut p = random_program(seed, c, ranks, k, ch);
        p.ranks_per_node = Some(per_node);
        for s in Scheduler::ALL {
            let state = compile::compile(&p, &Options::new(s, TbAlloc::State));
            prop_assert!(state.is_ok(), "{s} state: {:?}", state.err());
            let per = compile::compile(&p, &Options::new(s, TbAlloc::PerConn));
            prop_assert!(per.is_ok(), "{s} per-conn: {:?}", per.err());
            let (state, per) = (state.unwrap(), per.unwrap());
            prop_assert!(state.stats.max_tbs_per_rank <= per.stats.max_tbs_per_rank);
            // Per connection: one TB per endpoint; state-based: at most one per endpoint.
            prop_assert_eq!(&per.stats.tbs_per_rank, &endpoints_per_rank(&p, true));
            for (r, (&tbs, eps)) in state.stats.tbs_per_rank.iter().zip(endpoints_per_rank(&p, false)).enumerate() {
                prop_assert!(tbs <= eps, "{} state: rank {} has {} TBs for {} endpoints", s, r, tbs, eps);
            }
            prop_assert_eq!(state.stats.tasks, p.ops.iter().map(|o| if o.is_transfer() { 2 } else { 1 }).sum::<usize>());
            if matches!(s, Scheduler::Hpds | Scheduler::RoundRobin) {
                prop_assert!(state.stats.fifo_slots_needed <= 1);
            }
        }
    }
}

#[test]
fn a_cursor_walks_every_segment_once_per_micro_batch() {
    use oxccl_host::compile::TbCursor;
    let plan = compile::compile(&Algorithm::HmAllReduce.generate(2, 2).unwrap(), &Options::default()).unwrap();
    for tb in plan.ranks.iter().flat_map(|rp| rp.tbs.iter()) {
        for (mbs, per_task) in [(0, 1), (1, 1), (3, 3)] {
            let mut c = TbCursor::new(tb);
            let mut steps = 0;
            while !c.finished() {
                assert!(c.segments[c.seg].contains(&c.pos), "{mbs} micro-batches: task {} outside its segment", c.pos);
                c.advance(mbs);
                steps += 1;
            }
            assert_eq!(steps, tb.tasks.len() * per_task, "{mbs} micro-batches");
            c.advance(mbs); // past the end: nothing moves
            assert!(c.finished());
        }
    }
}
