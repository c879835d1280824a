//! The CPU executor of lowered descriptors computes every collective exactly, in both modes.

mod common;

use common::{bundled_msccl, shared_msccl, xml_files};
use oxccl_host::compile::lower::{LowerOptions, LoweredPlan, lower};
use oxccl_host::compile::{Options, Plan, Scheduler, TbAlloc, compile};
use oxccl_host::exec::ReduceOp;
use oxccl_host::exec::lowered::{AbiElement, LaunchOptions, verify};
use oxccl_host::program::Program;
use oxccl_host::program::generators::Algorithm;
use oxccl_host::program::msccl::import;
use oxccl_kernels::abi::PlanMode;

/// Lowers `plan` for `T` with `mbs` micro-batches of `mb_elems` elements and `slots` FIFO slots.
fn lowered<T: AbiElement>(
    plan: &Plan,
    mode: PlanMode,
    op: ReduceOp,
    mbs: u32,
    mb_elems: u64,
    slots: u32,
) -> LoweredPlan {
    let opts = LowerOptions {
        mode,
        micro_batches: mbs,
        chunk_bytes: mbs as u64 * mb_elems * std::mem::size_of::<T>() as u64,
        fifo_slots: slots,
        dtype: T::DTYPE,
        op,
        timing: false,
    };
    lower(plan, &opts).unwrap_or_else(|e| panic!("{}: {e}", plan.name))
}

/// Runs `program` compiled for each mode, with several micro-batch and slot counts, against the
/// reference.
fn check(program: &Program, what: &str) {
    let configs = [
        (PlanMode::Compiled, Options::new(Scheduler::Hpds, TbAlloc::State)),
        (PlanMode::Compiled, Options::new(Scheduler::Stage, TbAlloc::PerConn)),
        (PlanMode::Interpreted, Options::new(Scheduler::Algorithm, TbAlloc::PerConn)),
        (PlanMode::Interpreted, Options::new(Scheduler::Hpds, TbAlloc::State)),
    ];
    for (mode, opts) in configs {
        let plan = compile(program, &opts).unwrap_or_else(|e| panic!("{what}: {e}"));
        for (mbs, extra) in [(1, 0), (2, 1), (3, 0), (4, 6)] {
            let probe = lowered::<f32>(&plan, mode, ReduceOp::Sum, mbs, 4, 1);
            let slots = probe.slots_needed.max(1) + extra;
            for (k, launches) in [(0, 1), (1, 2)] {
                let tag = format!("{what} {mode:?} {} {} mbs={mbs} slots={slots}", opts.scheduler, opts.tb_alloc);
                let r = if k == 0 {
                    let lp = lowered::<f32>(&plan, mode, ReduceOp::Sum, mbs, 4, slots);
                    verify::<f32>(&lp, ReduceOp::Sum, launches, &LaunchOptions::default())
                } else {
                    let lp = lowered::<i32>(&plan, mode, ReduceOp::Max, mbs, 8, slots);
                    verify::<i32>(&lp, ReduceOp::Max, launches, &LaunchOptions { quantum: 3 })
                }
                .unwrap_or_else(|e| panic!("{tag}: {e}"));
                assert_eq!(r.wrong, 0, "{tag}: {r:?}");
            }
        }
    }
}

#[test]
fn ring() {
    for algo in [Algorithm::RingAllReduce, Algorithm::RingAllGather, Algorithm::RingReduceScatter] {
        for n in [2, 4] {
            check(&algo.generate(1, n).unwrap(), &format!("{algo} 1x{n}"));
        }
    }
}

#[test]
fn direct_all_pairs() {
    for algo in [
        Algorithm::DirectAllReduce,
        Algorithm::DirectAllGather,
        Algorithm::DirectReduceScatter,
        Algorithm::DirectAllToAll,
    ] {
        for n in [2, 3, 5] {
            check(&algo.generate(1, n).unwrap(), &format!("{algo} 1x{n}"));
        }
    }
}

#[test]
fn hierarchical_mesh() {
    for algo in [Algorithm::HmAllGather, Algorithm::HmAllReduce] {
        for (nodes, gpus) in [(2, 4), (2, 8)] {
            let mut p = algo.generate(nodes, gpus).unwrap();
            p.ranks_per_node = Some(gpus);
            check(&p, &format!("{algo} {nodes}x{gpus}"));
        }
    }
}

/// Instances on channels of their own compute the same collectives, each instance on thread blocks
/// of its own (the ring's two per rank become 2k).
#[test]
fn instances_on_separate_channels() {
    use oxccl_host::program::InstanceChannels;
    let mut programs = vec![
        (Algorithm::RingAllReduce.generate(1, 4).unwrap(), "ring-allreduce 1x4"),
        (Algorithm::RingAllGather.generate(1, 3).unwrap(), "ring-allgather 1x3"),
        (Algorithm::DirectReduceScatter.generate(1, 3).unwrap(), "direct-reducescatter 1x3"),
    ];
    let mut hm = Algorithm::HmAllReduce.generate(2, 2).unwrap();
    hm.ranks_per_node = Some(2);
    programs.push((hm, "hm-allreduce 2x2"));
    let xml = std::fs::read_to_string(bundled_msccl().join("ndv4_r48ll.xml")).unwrap();
    programs.push((import(&xml).unwrap().program, "ndv4_r48ll.xml"));
    let opts = Options::new(Scheduler::Hpds, TbAlloc::State);
    for (p, what) in &programs {
        for k in [2, 3] {
            let q = p.instanced_on(k, InstanceChannels::Separate).unwrap();
            let tag = format!("{what} x{k} separate");
            q.check().unwrap_or_else(|e| panic!("{tag}: {e}"));
            check(&q, &tag);
            if what.starts_with("ring-allreduce") {
                let tbs = |p: &Program| compile(p, &opts).unwrap().ranks.iter().map(|r| r.tbs.len()).max().unwrap();
                assert_eq!(tbs(&q), k as usize * tbs(p), "{tag}");
                assert_eq!(tbs(&p.instanced(k).unwrap()), tbs(p), "{what} x{k} shared");
            }
        }
    }
}

fn msccl_folder(dir: &std::path::Path) {
    let files = xml_files(dir);
    assert!(!files.is_empty(), "no MSCCL files in {}", dir.display());
    for f in files {
        let name = f.file_name().unwrap().to_string_lossy().into_owned();
        let imp = import(&std::fs::read_to_string(&f).unwrap()).unwrap_or_else(|e| panic!("{name}: {e}"));
        check(&imp.program, &name);
    }
}

#[test]
fn bundled_msccl_files() {
    assert!(xml_files(&bundled_msccl()).len() >= 5, "bundled MSCCL files missing");
    msccl_folder(&bundled_msccl());
}

#[test]
fn shared_msccl_files() {
    match shared_msccl() {
        Some(dir) => msccl_folder(&dir),
        None => {
            // Straight to stderr: the harness captures eprintln! of passing tests.
            use std::io::Write;
            let _ = writeln!(
                std::io::stderr(),
                "skipped: ../shared/msccl not found (the copies in host/tests/data/msccl are tested)"
            );
        }
    }
}

#[test]
fn sizes_of_the_largest_runs() {
    // ndv4_ap-1pass: 2016 ops on 8 ranks; the executor runs every (task, micro-batch).
    let f = bundled_msccl().join("ndv4_ap-1pass.xml");
    let p = import(&std::fs::read_to_string(f).unwrap()).unwrap().program;
    let plan = compile(&p, &Options::default()).unwrap();
    let lp = lowered::<f32>(&plan, PlanMode::Compiled, ReduceOp::Sum, 4, 4, plan.stats.fifo_slots_needed.max(1));
    let mut mem = oxccl_host::exec::lowered::Memory::new(&lp);
    let ic = lp.layout.input_chunks() as usize;
    mem.load_inputs(&lp, &oxccl_host::exec::test_inputs::<f32>(8, ic * 16)).unwrap();
    let rep = oxccl_host::exec::lowered::launch(&lp, &mut mem, &LaunchOptions::default()).unwrap();
    let steps: u64 = rep.tbs.iter().flatten().map(|a| a.busy).sum();
    assert_eq!(steps, 4 * plan.stats.tasks as u64);
    assert!(plan.stats.tasks >= 2016);
}
