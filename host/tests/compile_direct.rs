//! Tests of `compile::direct`: programs lowered level by level for the collective engine, run on
//! host buffers with the engine's semantics (`lowered::execute`), give the collective's reference
//! result exactly: every built-in algorithm on 2 to 16 ranks, the bundled MSCCL files, random
//! programs in and out of place with scratch and local ops; level counts; typed refusals.

mod common;

use oxccl_host::compile::direct::{DirectError, DirectOptions, lower_direct};
use oxccl_host::exec::reference::reference;
use oxccl_host::exec::{ReduceOp, test_inputs};
use oxccl_host::lowered::{HostBuffers, Staged};
use oxccl_host::program::generators::Algorithm;
use oxccl_host::program::{BufferKind, Program, Rank, msccl};
use oxccl_kernels::abi::{DType, slot};

/// Elements per chunk (i32): 8, so a chunk is 32 bytes.
const CHUNK: usize = 8;

fn bytes(v: &[i32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn ints(b: &[u8]) -> Vec<i32> {
    b.chunks(4).map(|c| i32::from_le_bytes(c.try_into().unwrap())).collect()
}

/// Lowers `p` with `ctas` CTAs per rank, runs it on the host with the reference inputs and checks
/// every rank's output against the collective's reference under `op`.
fn check(p: &Program, ctas: u32, op: ReduceOp) -> Staged {
    let opts = DirectOptions { op, ..DirectOptions::new((CHUNK * 4) as u64, DType::I32, ctas) };
    let d = lower_direct(p, &opts).unwrap_or_else(|e| panic!("{}: {e}", p.name));
    let what = format!("{} ({ctas} CTAs, {op:?})", p.name);
    give_the_reference(p, op, d.host_buffers(), |bufs| d.execute(bufs).map_err(|e| e.to_string()), &what);
    d
}

/// Fills `bufs` (a lowering's buffers of `p`) with the reference inputs, runs `run` on them and
/// checks every rank's output against the collective's reference under `op`.
fn give_the_reference(
    p: &Program,
    op: ReduceOp,
    mut bufs: HostBuffers,
    run: impl FnOnce(&mut HostBuffers) -> Result<(), String>,
    what: &str,
) {
    let l = &p.layout;
    let n = l.ranks as usize;
    let inputs: Vec<Vec<i32>> = test_inputs(n, l.input_chunks() as usize * CHUNK);
    let want = reference(l.collective, &inputs, op).unwrap();
    let at = |r: usize, kind: BufferKind| -> (usize, usize) {
        if l.in_place {
            (slot::OUTPUT as usize, l.buffer_base(Rank(r as u32), kind) as usize * CHUNK * 4)
        } else {
            (if kind == BufferKind::Input { slot::INPUT } else { slot::OUTPUT } as usize, 0)
        }
    };
    for (r, input) in inputs.iter().enumerate() {
        let (s, off) = at(r, BufferKind::Input);
        bufs[r][s][off..off + input.len() * 4].copy_from_slice(&bytes(input));
    }
    run(&mut bufs).unwrap_or_else(|e| panic!("{what}: {e}"));
    for (r, w) in want.iter().enumerate().filter(|(r, _)| l.collective.defines_output(*r)) {
        let (s, off) = at(r, BufferKind::Output);
        assert_eq!(&ints(&bufs[r][s][off..off + w.len() * 4]), w, "{what}: rank {r}");
    }
}

#[test]
fn built_in_algorithms_give_the_reference() {
    let mut checked = 0;
    for algo in Algorithm::ALL {
        for (nodes, gpus) in [(1, 2), (1, 3), (1, 4), (1, 8), (2, 2), (2, 4), (4, 4), (2, 8)] {
            let Ok(p) = algo.generate(nodes, gpus) else { continue };
            for ctas in [1, 3] {
                let d = check(&p, ctas, ReduceOp::Sum);
                if p.layout.collective.reduces() {
                    check(&p, ctas, ReduceOp::Max);
                }
                if algo == Algorithm::RingAllReduce && nodes == 1 {
                    assert_eq!(d.stages.len(), 2 * (gpus as usize - 1), "{}", p.name);
                }
                if algo == Algorithm::DirectAllReduce && nodes == 1 {
                    // The n - 1 reductions into one chunk write it in turn (the program orders
                    // them), then one level gathers.
                    assert_eq!(d.stages.len(), gpus as usize, "{}", p.name);
                    assert!(d.combines() && d.slots() == 2, "{}: reductions combine in registers", p.name);
                }
            }
            checked += 1;
        }
    }
    assert!(checked >= 40, "only {checked} algorithm shapes generated");
}

#[test]
fn bundled_msccl_files_give_the_reference() {
    let files = common::xml_files(&common::bundled_msccl());
    assert!(files.len() >= 5, "bundled MSCCL files missing");
    let mut lowered = 0;
    for f in files {
        let imported = msccl::import_path(&f).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
        let p = &imported.program;
        match lower_direct(p, &DirectOptions::new(32, DType::I32, 2)) {
            // Wider than one launch addresses.
            Err(DirectError::Ranks { .. }) => assert!(p.layout.ranks > 16),
            Ok(_) => {
                check(p, 2, ReduceOp::Sum);
                lowered += 1;
            }
            Err(e) => panic!("{}: {e}", f.display()),
        }
    }
    assert!(lowered >= 2, "only {lowered} bundled files fit 16 ranks");
}

#[test]
fn random_programs_give_the_reference() {
    for seed in 0..240u64 {
        let ranks = 2 + (seed % 7) as u32;
        let c = common::nth_collective(seed as usize, seed, ranks);
        let p = common::random_program(seed, c, ranks, 1 + (seed % 3) as u32, 1 + (seed % 2) as u32);
        check(&p, 1 + (seed % 4) as u32, if seed % 3 == 0 { ReduceOp::Max } else { ReduceOp::Sum });
    }
}

#[test]
fn refusals_are_typed() {
    let p = Algorithm::RingAllReduce.generate(1, 4).unwrap();
    let opts = DirectOptions::new(32, DType::F32, 2);
    for (field, o) in [
        ("chunk_bytes", DirectOptions { chunk_bytes: 24, ..opts }),
        ("chunk_bytes", DirectOptions { chunk_bytes: 0, ..opts }),
        ("ctas", DirectOptions { ctas: 0, ..opts }),
        ("ctas", DirectOptions { ctas: 257, ..opts }),
        ("op", DirectOptions { op: ReduceOp::Avg, ..opts }),
    ] {
        assert!(matches!(lower_direct(&p, &o), Err(DirectError::Options { field: f, .. }) if f == field), "{field}");
    }
    let wide = Algorithm::RingAllReduce.generate(1, 17).unwrap();
    assert!(matches!(lower_direct(&wide, &opts), Err(DirectError::Ranks { ranks: 17, max: 16 })));
    // A slice past its buffer.
    let mut broken = p.clone();
    if let oxccl_host::program::OpKind::Transfer { src, .. } = &mut broken.ops[0].kind {
        src.offset = 1000;
    }
    assert!(matches!(lower_direct(&broken, &opts), Err(DirectError::Program(_))));
}

/// What a lowering's tasks read and write, in bytes: a copy reads each source and writes each
/// destination; an accumulation also reads its destination.
fn task_traffic(d: &Staged) -> u64 {
    let mut total = 0u64;
    for level in &d.stages {
        for t in &level.tasks {
            let (srcs, dsts) = (u64::from(t.src_ranks.count_ones()), u64::from(t.dst_ranks.count_ones()));
            let reads = if t.kind == oxccl_kernels::abi::TaskKind::ReduceInto as u8 { srcs + dsts } else { srcs };
            total += t.bytes * (reads + dsts);
        }
    }
    total
}

/// The roofline `oxccl bench plan` prints (`Program::traffic_chunks` × the chunk size) is exactly
/// what the direct lowering's tasks move, for every generator and bundled MSCCL file.
#[test]
fn the_roofline_counts_what_the_tasks_move() {
    let mut programs: Vec<Program> = Vec::new();
    for algo in Algorithm::ALL {
        for (nodes, gpus) in [(1, 2), (1, 5), (1, 8), (2, 4), (3, 2)] {
            programs.push(algo.generate(nodes, gpus).unwrap());
        }
    }
    for f in common::xml_files(&common::bundled_msccl()) {
        programs.push(msccl::import_path(&f).unwrap_or_else(|e| panic!("{}: {e}", f.display())).program);
    }
    let cb = (CHUNK * 4) as u64;
    for p in &programs {
        for ctas in [1, 3] {
            let d = lower_direct(p, &DirectOptions::new(cb, DType::I32, ctas))
                .unwrap_or_else(|e| panic!("{}: {e}", p.name));
            let (read, written) = p.traffic_chunks();
            assert_eq!(task_traffic(&d), (read + written) * cb, "{} with {ctas} CTAs", p.name);
        }
    }
}

/// Programs lowered by node (`lower_by_node`) give the collective's reference on the host, the
/// transfers between nodes as copies and each node's launch with the engine's semantics: every
/// generator on 2 and 4 nodes, one-node programs and the bundled MSCCL files posed on nodes of 2
/// (and 4) ranks. No engine task and no CTA's barrier crosses a node; every transfer between nodes
/// does, and they carry exactly the bytes of the program's ops between nodes.
#[test]
fn programs_lowered_by_node_give_the_reference() {
    use oxccl_host::compile::direct::lower_by_node;
    let mut cases: Vec<(Program, u32)> = Vec::new();
    for algo in Algorithm::ALL {
        for (nodes, gpus) in [(2, 2), (2, 4), (4, 2), (4, 4)] {
            if let Ok(p) = algo.generate(nodes, gpus) {
                cases.push((p, gpus));
            }
        }
        for per_node in [2, 4] {
            cases.push((algo.generate(1, 8).unwrap(), per_node));
        }
    }
    for f in common::xml_files(&common::bundled_msccl()) {
        let p = msccl::import_path(&f).unwrap_or_else(|e| panic!("{}: {e}", f.display())).program;
        if p.layout.ranks <= 16 {
            cases.push((p.clone(), 2));
            if p.layout.ranks.is_multiple_of(4) {
                cases.push((p, 4));
            }
        }
    }
    let cb = (CHUNK * 4) as u64;
    let mut crossed = 0;
    for (p, per_node) in &cases {
        let node = |r: u32| r / per_node;
        for (op, ctas) in [(ReduceOp::Sum, 1), (ReduceOp::Max, 3)] {
            let opts = DirectOptions { op, ..DirectOptions::new(cb, DType::I32, ctas) };
            let what = format!("{} on nodes of {per_node}, {op:?}, {ctas} CTAs", p.name);
            let d = lower_by_node(p, &opts, *per_node).unwrap_or_else(|e| panic!("{what}: {e}"));
            let mask = |r: u32| (((1u64 << per_node) - 1) << (node(r) * per_node)) as u32;
            for level in &d.levels {
                for t in &level.engine.tasks {
                    let ranks = t.src_ranks | t.dst_ranks;
                    let r = ranks.trailing_zeros();
                    assert_eq!(ranks & !mask(r), 0, "{what}: an engine task crosses a node");
                }
                for prog in &level.engine.programs {
                    assert_eq!(prog.barrier_ranks & !mask(prog.rank), 0, "{what}: a barrier crosses a node");
                }
                for w in &level.wire {
                    assert_ne!(node(w.src_rank), node(w.dst_rank), "{what}: a wire transfer inside a node");
                }
            }
            let between: u64 = p
                .ops
                .iter()
                .filter(|o| node(o.src_rank().0) != node(o.dst_rank().0))
                .map(|o| u64::from(o.src().count) * cb)
                .sum();
            assert_eq!(d.wire_bytes(), between, "{what}: bytes between nodes");
            crossed += usize::from(between > 0);
            give_the_reference(p, op, d.host_buffers(), |bufs| d.execute(bufs).map_err(|e| e.to_string()), &what);
        }
    }
    assert!(crossed >= 100, "only {crossed} cases crossed nodes");
    // A node size that does not divide the ranks is refused.
    let ring = Algorithm::RingAllReduce.generate(1, 6).unwrap();
    let e = lower_by_node(&ring, &DirectOptions::new(cb, DType::I32, 1), 4).unwrap_err();
    assert!(matches!(e, DirectError::Options { field: "ranks_per_node", .. }), "{e}");
}

/// `direct::verify` (what `oxccl verify` reports for the engine): every built-in AllReduce on 4
/// ranks exact in f32 and i64 under Sum and Prod; a program missing its last op is caught; a chunk
/// off 16 bytes is the lowering's refusal, not a verdict.
#[test]
fn verify_reports_what_the_engine_would_compute() {
    use oxccl_host::compile::direct::{VerifyError, verify};
    for algo in [Algorithm::RingAllReduce, Algorithm::DirectAllReduce] {
        let p = algo.generate(1, 4).unwrap();
        for op in [ReduceOp::Sum, ReduceOp::Prod] {
            let (r, levels) = verify::<f32>(&p, DType::F32, op, 8).unwrap();
            assert!(r.wrong == 0 && r.checked > 0 && levels > 1, "{} {op:?}: {r:?}", p.name);
            let (r, _) = verify::<i64>(&p, DType::I64, op, 2).unwrap();
            assert!(r.wrong == 0 && r.checked > 0, "{} {op:?} i64: {r:?}", p.name);
        }
        let mut cut = p.clone();
        cut.ops.pop();
        let (r, _) = verify::<f32>(&cut, DType::F32, ReduceOp::Sum, 8).unwrap();
        assert!(r.wrong > 0 && !r.first.is_empty(), "{}: a dropped op passed", p.name);
    }
    let p = Algorithm::RingAllReduce.generate(1, 4).unwrap();
    assert!(matches!(verify::<f32>(&p, DType::F32, ReduceOp::Sum, 3), Err(VerifyError::Lower(_))));
    assert!(matches!(verify::<f32>(&p, DType::I64, ReduceOp::Sum, 8), Err(VerifyError::Inputs(_))));
}
