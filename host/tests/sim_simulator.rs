//! The discrete-event simulator and its SVG timelines.

use oxccl_host::compile::{Options, Plan, Prim, Scheduler, TbAlloc, TbPlan, compile};
use oxccl_host::program::generators::Algorithm;
use oxccl_host::sim::{SimError, SimOptions, Topology, simulate, svg};

fn plan(algo: Algorithm, n: u32, g: u32, s: Scheduler) -> Plan {
    compile(&algo.generate(n, g).unwrap(), &Options::new(s, TbAlloc::State)).unwrap()
}

fn run(p: &Plan, topo: &Topology, bytes: u64, barrier: bool) -> oxccl_host::sim::SimReport {
    let mut o = SimOptions::for_size(p, bytes, 1 << 20);
    o.subpipeline_barrier = barrier;
    simulate(p, topo, &o).unwrap()
}

#[test]
fn nic_bound_allgather_respects_the_nic_bandwidth() {
    // HM AllGather 2x4: every GPU sends its 1/8 of the output over the NIC once; two GPUs share a
    // 25 GB/s NIC.
    let p = plan(Algorithm::HmAllGather, 2, 4, Scheduler::Hpds);
    let topo = Topology::a100_testbed(2, 4);
    let bytes = 64u64 << 20;
    let r = run(&p, &topo, bytes, false);
    let per_nic = 2.0 * bytes as f64 / 8.0;
    let bound_us = per_nic / (25.0 * 1e3);
    assert!(r.time_us >= bound_us, "{} < {bound_us}", r.time_us);
    assert!(r.time_us < 2.0 * bound_us, "{} far above {bound_us}", r.time_us);
    assert!(r.mean_nic_utilisation > 0.5 && r.mean_nic_utilisation <= 1.0 + 1e-9);
    assert!(r.tbs.iter().all(|t| (0.0..=1.0).contains(&t.idle_share)));
    assert!((r.busbw_gbps - r.algbw_gbps * 7.0 / 8.0).abs() < 1e-9);
}

#[test]
fn deterministic() {
    let p = plan(Algorithm::HmAllReduce, 2, 4, Scheduler::Hpds);
    let topo = Topology::a100_testbed(2, 4);
    let a = run(&p, &topo, 16 << 20, false);
    let b = run(&p, &topo, 16 << 20, false);
    assert_eq!(a.time_us, b.time_us);
}

#[test]
fn task_level_beats_algorithm_level_and_hpds_beats_round_robin() {
    let topo = Topology::a100_testbed(2, 4);
    let bytes = 256u64 << 20;
    let hpds = run(&plan(Algorithm::HmAllReduce, 2, 4, Scheduler::Hpds), &topo, bytes, false);
    let algo = run(&plan(Algorithm::HmAllReduce, 2, 4, Scheduler::Algorithm), &topo, bytes, false);
    assert!(hpds.time_us * 1.5 < algo.time_us, "hpds {} algo {}", hpds.time_us, algo.time_us);
    // With sub-pipelines run one after another (ResCCL's model), HPDS's few, full sub-pipelines win.
    let hpds = run(&plan(Algorithm::HmAllGather, 2, 4, Scheduler::Hpds), &topo, bytes, true);
    let rr = run(&plan(Algorithm::HmAllGather, 2, 4, Scheduler::RoundRobin), &topo, bytes, true);
    assert!(hpds.time_us * 1.5 < rr.time_us, "hpds {} rr {}", hpds.time_us, rr.time_us);
}

#[test]
fn h200_preset_and_svg() {
    let p = plan(Algorithm::HmAllGather, 1, 8, Scheduler::Hpds);
    let topo = Topology::h200(1, 8);
    let mut o = SimOptions::for_size(&p, 8 << 20, 1 << 20);
    o.timeline = true;
    let r = simulate(&p, &topo, &o).unwrap();
    // Intra-node only: the NVLink ports carry everything.
    assert_eq!(r.mean_nic_utilisation, 0.0);
    assert!(r.mean_nvlink_utilisation > 0.0);
    let tbs: usize = p.ranks.iter().map(|rp| rp.tbs.len()).sum();
    assert_eq!(r.lanes.len(), 8 + tbs, "one lane per used NVLink port and per TB");
    let s = svg::timeline(&r, "hm <allgather>");
    assert!(s.starts_with("<svg") && s.ends_with("</svg>\n"));
    assert!(s.contains("hm &lt;allgather&gt;"));
    assert_eq!(s.matches("<rect").count(), 1 + 7 + r.lanes.len().div_ceil(2) + r.timeline.len());
}

#[test]
fn errors() {
    let p = plan(Algorithm::HmAllGather, 2, 2, Scheduler::Hpds);
    let e = simulate(&p, &Topology::a100_testbed(1, 2), &SimOptions::for_size(&p, 1 << 20, 1 << 20)).unwrap_err();
    assert!(matches!(e, SimError::BadInput { .. }), "{e}");
    assert!(Topology::preset("tpu", 1, 2).is_err());
    // A link that moves nothing (or at an impossible rate) is bad input, not a deadlock.
    let ok = plan(Algorithm::HmAllGather, 1, 2, Scheduler::Hpds);
    let opts = SimOptions::for_size(&ok, 1 << 20, 1 << 20);
    assert!(simulate(&ok, &Topology::h200(1, 2), &opts).is_ok());
    for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
        let mut t = Topology::h200(1, 2);
        t.nvlink.bw_gbps = bad;
        let e = simulate(&ok, &t, &opts).unwrap_err();
        assert!(matches!(&e, SimError::BadInput { reason } if reason.contains("nvlink")), "bw {bad}: {e}");
    }
    let mut t = Topology::h200(1, 2);
    t.hbm.concurrency = 0;
    let e = simulate(&ok, &t, &opts).unwrap_err();
    assert!(matches!(&e, SimError::BadInput { reason } if reason.contains("hbm")), "{e}");
    // A plan whose TBs receive before they send never finishes.
    let mut dl = compile(&Algorithm::DirectAllGather.generate(1, 2).unwrap(), &Options::default()).unwrap();
    for rp in &mut dl.ranks {
        let mut tasks: Vec<_> = rp.tbs.iter().flat_map(|tb| tb.tasks.iter().copied()).collect();
        tasks.sort_by_key(|t| t.prim == Prim::Send);
        rp.tbs = vec![TbPlan { tasks, syncs: Vec::new() }];
    }
    let e = simulate(&dl, &Topology::h200(1, 2), &SimOptions::for_size(&dl, 1 << 20, 1 << 20)).unwrap_err();
    // Both ranks' one TB waits at its first receive for a message no one sends.
    let SimError::Deadlock { blocked } = &e else { panic!("{e}") };
    assert_eq!(blocked.len(), 2, "{e}");
    for (r, b) in blocked.iter().enumerate() {
        assert_eq!((b.rank.0 as usize, b.tb.index(), b.task, b.micro_batch), (r, 0, 0, 0), "{e}");
        assert!(b.prim == Prim::Recv && b.reason.starts_with("FIFO c") && b.reason.ends_with(" empty"), "{e}");
    }
    assert!(e.to_string().starts_with("deadlock: 2 thread blocks cannot progress; r0 tb0 task 0 (recv "), "{e}");
}
