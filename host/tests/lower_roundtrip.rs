//! Lowering round trips: descriptors decode to exactly the plan's TB programs, in both modes; the
//! text dump is golden; what does not fit the ABI is a typed error.

mod common;

use common::{bundled_msccl, golden, random_program, xml_files};
use oxccl_host::compile::lower::{LowerError, LowerOptions, PlanView, decode, lower, place, slot_chunks, unplace};
use oxccl_host::compile::{Connection, Options, Plan, Scheduler, TbAlloc, TbPlan, compile};
use oxccl_host::program::generators::Algorithm;
use oxccl_host::program::msccl::import;
use oxccl_host::program::{Collective, Program, Rank};
use oxccl_kernels::abi::{
    FIFO_ALIGN, FIFO_REGION_OFFSET, MAX_PLAN_CONNECTIONS, MAX_PLAN_TBS, PLAN_ABI_VERSION, PLAN_FLAG_TIMING, PlanMode,
};

fn opts(mode: PlanMode, micro_batches: u32, slots: u32) -> LowerOptions {
    LowerOptions {
        mode,
        micro_batches,
        chunk_bytes: micro_batches as u64 * 64,
        fifo_slots: slots,
        ..LowerOptions::default()
    }
}

/// Every scheduler, allocator and mode, and several micro-batch counts, round-trip.
fn round_trips(p: &Program, what: &str) {
    for s in Scheduler::ALL {
        for a in TbAlloc::ALL {
            let plan = compile(p, &Options::new(s, a)).unwrap_or_else(|e| panic!("{what}: {e}"));
            for mode in PlanMode::ALL.iter().copied() {
                for mbs in [1, 3] {
                    let lp = lower(&plan, &opts(mode, mbs, 2)).unwrap_or_else(|e| panic!("{what} {s} {a}: {e}"));
                    let got = decode(&lp).unwrap_or_else(|e| panic!("{what} {s} {a} {mode:?}: {e}"));
                    assert_eq!(got, PlanView::of_plan(&plan, mode, mbs), "{what} {s} {a} {mode:?} mbs={mbs}");
                    check_headers(&plan, &lp.ranks.iter().map(|r| r.header).collect::<Vec<_>>(), mode, mbs);
                    // Compiled: one segment per sub-pipeline run; interpreted: one per TB.
                    for (r, lr) in lp.ranks.iter().enumerate() {
                        for (t, tb) in lr.tbs.iter().enumerate() {
                            let want = match mode {
                                PlanMode::Compiled => plan.ranks[r].tbs[t].segments().len(),
                                PlanMode::Interpreted => 1,
                            };
                            assert_eq!(tb.segment_count as usize, want);
                        }
                    }
                    if mode == PlanMode::Compiled {
                        assert_eq!(lp.slots_needed, plan.stats.fifo_slots_needed, "{what} {s} {a}");
                    }
                }
            }
        }
    }
}

fn check_headers(plan: &Plan, headers: &[oxccl_kernels::abi::PlanHeader], mode: PlanMode, mbs: u32) {
    for (r, h) in headers.iter().enumerate() {
        assert_eq!(h.version, PLAN_ABI_VERSION);
        assert_eq!(h.mode, mode.raw());
        assert_eq!((h.rank as usize, h.ranks), (r, plan.layout.ranks));
        assert_eq!(h.tbs as usize, plan.ranks[r].tbs.len());
        assert_eq!(h.tasks as usize, plan.ranks[r].tbs.iter().map(|tb| tb.tasks.len()).sum::<usize>());
        assert_eq!(h.micro_batches, mbs);
        assert_eq!(h.chunk_bytes, h.mb_bytes * mbs as u64);
        assert_eq!(h.buffer_chunks, slot_chunks(&plan.layout, Rank(r as u32)));
        assert_eq!(h.flags, 0);
        assert!(h.fifo_bytes as usize >= h.tbs as usize * FIFO_ALIGN);
    }
}

#[test]
fn generators_round_trip() {
    for algo in Algorithm::ALL {
        for (n, g) in [(1, 4), (2, 2), (2, 3)] {
            round_trips(&algo.generate(n, g).unwrap(), &format!("{algo} {n}x{g}"));
        }
    }
}

#[test]
fn msccl_files_round_trip() {
    let files = xml_files(&bundled_msccl());
    assert!(files.len() >= 5, "bundled MSCCL files missing: {} found", files.len());
    for f in files {
        let name = f.file_name().unwrap().to_string_lossy().into_owned();
        let imp = import(&std::fs::read_to_string(&f).unwrap()).unwrap();
        round_trips(&imp.program, &name);
    }
}

#[test]
fn random_programs_round_trip() {
    for seed in 0..24u64 {
        let c = [Collective::AllReduce, Collective::AllGather, Collective::ReduceScatter, Collective::AllToAll]
            [seed as usize % 4];
        round_trips(&random_program(seed, c, 2 + seed as u32 % 4, 1 + seed as u32 % 2, 2), &format!("seed {seed}"));
    }
}

#[test]
fn storage_placement_inverts() {
    for algo in Algorithm::ALL {
        let mut p = algo.generate(1, 4).unwrap();
        for in_place in [false, true] {
            p.layout.in_place = in_place;
            p.layout.scratch = vec![3; 4];
            let l = &p.layout;
            let r = Rank(2);
            for flat in 0..l.storage_chunks(r) {
                let (s, c) = place(l, flat);
                assert!(c < slot_chunks(l, r)[s as usize], "{algo} {in_place} {flat}");
                assert_eq!(unplace(l, r, s, c), Some(flat));
            }
            assert_eq!(slot_chunks(l, r).iter().sum::<u32>(), l.storage_chunks(r));
        }
    }
}

/// A change detector for the lowered descriptors' dump: the files are the blessed output
/// (`OXCCL_BLESS=1`, read when blessed). The same lowerings are run against the reference in
/// `lower_exec.rs` (`ring`).
#[test]
fn golden_ring_allreduce() {
    let p = Algorithm::RingAllReduce.generate(1, 4).unwrap();
    let plan = compile(&p, &Options::default()).unwrap();
    let lp = lower(&plan, &opts(PlanMode::Compiled, 2, 2)).unwrap();
    golden("lower_ring_allreduce_1x4_compiled.txt", &lp.dump());
    let plan = compile(&p, &Options::new(Scheduler::Algorithm, TbAlloc::PerConn)).unwrap();
    let needed = lower(&plan, &opts(PlanMode::Interpreted, 2, 1)).unwrap().slots_needed;
    assert_eq!(needed, 3, "a connection carries 3 messages per micro-batch in the whole list");
    let lp = lower(&plan, &opts(PlanMode::Interpreted, 2, needed)).unwrap();
    golden("lower_ring_allreduce_1x4_interpreted.txt", &lp.dump());
}

#[test]
fn fifo_layout() {
    let p = Algorithm::HmAllReduce.generate(2, 4).unwrap();
    let plan = compile(&p, &Options::default()).unwrap();
    let lp = lower(&plan, &LowerOptions { timing: true, ..opts(PlanMode::Compiled, 4, 3) }).unwrap();
    for (r, lr) in lp.ranks.iter().enumerate() {
        assert_eq!(lr.header.flags, PLAN_FLAG_TIMING);
        let region = FIFO_REGION_OFFSET as u64..FIFO_REGION_OFFSET as u64 + lr.header.fifo_bytes;
        for c in &lr.connections {
            assert!(c.sender as usize == r || c.receiver as usize == r);
            assert_eq!(c.slots, 3);
            assert_eq!(c.slot_bytes as usize % FIFO_ALIGN, 0);
            // The ring and counters are in the receiver's region.
            let recv = &lp.ranks[c.receiver as usize].header;
            let end = FIFO_REGION_OFFSET as u64 + recv.fifo_bytes;
            assert!(c.ring_offset + c.slots as u64 * c.slot_bytes as u64 <= end);
            assert!(c.head_offset + 8 <= end && c.tail_offset + 8 <= end);
            assert_ne!(c.head_offset / FIFO_ALIGN as u64, c.tail_offset / FIFO_ALIGN as u64);
        }
        for tb in &lr.tbs {
            assert!(region.contains(&tb.progress_offset));
        }
    }
}

fn small_plan() -> Plan {
    compile(&Algorithm::RingAllReduce.generate(1, 4).unwrap(), &Options::default()).unwrap()
}

#[test]
fn options_out_of_range() {
    let plan = small_plan();
    for bad in [
        LowerOptions { micro_batches: 0, ..LowerOptions::default() },
        LowerOptions { fifo_slots: 0, ..LowerOptions::default() },
        LowerOptions { micro_batches: 3, chunk_bytes: 64, ..LowerOptions::default() },
        LowerOptions { micro_batches: 2, chunk_bytes: 40, ..LowerOptions::default() },
        LowerOptions { chunk_bytes: 0, ..LowerOptions::default() },
    ] {
        assert!(matches!(lower(&plan, &bad), Err(LowerError::BadOptions { .. })), "{bad:?}");
    }
}

#[test]
fn what_does_not_fit_is_a_typed_error() {
    // Ranks: a launch addresses at most MAX_RANKS.
    let p = Algorithm::RingAllGather.generate(1, 17).unwrap();
    let plan = compile(&p, &Options::default()).unwrap();
    assert!(matches!(lower(&plan, &LowerOptions::default()), Err(LowerError::TooManyRanks { ranks: 17, .. })));

    // Thread blocks.
    let mut plan = small_plan();
    plan.ranks[1].tbs.resize(MAX_PLAN_TBS + 1, TbPlan::default());
    let e = lower(&plan, &LowerOptions::default()).unwrap_err();
    assert!(matches!(e, LowerError::TooManyTbs { rank: Rank(1), .. }), "{e}");

    // Connections: one rank's table indexes at most MAX_PLAN_CONNECTIONS.
    let mut plan = small_plan();
    let extra = Connection { src: Rank(0), dst: Rank(2), channel: 99, inter_node: false };
    plan.connections.extend(std::iter::repeat_n(extra, MAX_PLAN_CONNECTIONS));
    let e = lower(&plan, &LowerOptions::default()).unwrap_err();
    assert!(matches!(e, LowerError::TooManyConnections { rank: Rank(0), .. }), "{e}");
    assert!(e.to_string().contains("connections"), "{e}");

    // Progress counters: steps per launch must fit 32 bits.
    let plan = small_plan();
    let huge = LowerOptions { micro_batches: 1 << 31, chunk_bytes: 16 << 31, ..LowerOptions::default() };
    let e = lower(&plan, &huge).unwrap_err();
    assert!(matches!(e, LowerError::CounterOverflow { .. }), "{e}");

    // A slot must fit 32 bits.
    let big = LowerOptions { micro_batches: 1, chunk_bytes: 1 << 33, ..LowerOptions::default() };
    assert!(matches!(lower(&plan, &big), Err(LowerError::TooLarge { .. })));

    // A malformed plan.
    let mut plan = small_plan();
    plan.ranks[0].tbs[0].tasks[0].conn = None;
    plan.ranks[0].tbs[0].tasks[0].prim = oxccl_host::compile::Prim::Send;
    assert!(matches!(lower(&plan, &LowerOptions::default()), Err(LowerError::BadPlan { .. })));
}

#[test]
fn corrupt_descriptors_are_rejected() {
    let plan = small_plan();
    let lp = lower(&plan, &opts(PlanMode::Compiled, 2, 2)).unwrap();
    assert!(decode(&lp).is_ok());
    let mut cases: Vec<(&str, oxccl_host::compile::lower::LoweredPlan)> = Vec::new();
    let mut x = lp.clone();
    x.ranks[1].header.version += 1;
    cases.push(("version", x));
    let mut x = lp.clone();
    x.ranks[1].tasks[0].kind = 1; // a T-CCL TaskKind, not a FifoKind
    cases.push(("unknown kind", x));
    let mut x = lp.clone();
    x.ranks[2].tasks[0].conn = 77;
    cases.push(("connection", x));
    let mut x = lp.clone();
    x.ranks[0].tasks[0].dst_chunk = 1000;
    x.ranks[0].tasks[0].src_chunk = 1000;
    cases.push(("outside", x));
    let mut x = lp.clone();
    x.ranks[3].connections[0].ring_offset += FIFO_ALIGN as u64;
    cases.push(("differs", x));
    let mut x = lp.clone();
    let c = *x.ranks[1].connections.iter().find(|c| c.receiver == 1).unwrap();
    let moved = oxccl_kernels::abi::FifoConn { tail_offset: x.ranks[1].tbs[0].progress_offset, ..c };
    for r in [c.sender, c.receiver] {
        for e in x.ranks[r as usize].connections.iter_mut().filter(|e| e.id == c.id) {
            *e = moved;
        }
    }
    cases.push(("overlaps", x));
    let mut x = lp.clone();
    x.ranks[0].segments[0].progress_base = 5;
    cases.push(("progress base", x));
    let mut x = lp.clone();
    x.ranks[0].header.tasks += 1;
    cases.push(("header says", x));
    let mut x = lp.clone();
    x.ranks[2].header.mb_bytes *= 2;
    x.ranks[2].header.chunk_bytes *= 2;
    cases.push(("disagrees", x));
    let mut x = lp.clone();
    x.ranks[0].header = bytemuck::Zeroable::zeroed();
    cases.push(("version", x));
    let r = lp.ranks.iter().position(|lr| !lr.waits.is_empty()).expect("the small plan lowers to at least one wait");
    let mut x = lp.clone();
    x.ranks[r].waits[0].base += 1;
    cases.push(("threshold", x));
    for (want, x) in cases {
        let e = decode(&x).unwrap_err();
        assert!(e.to_string().contains(want), "expected `{want}`, got: {e}");
    }
}
