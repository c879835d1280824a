//! A change detector for the whole compiler: a hash of every plan (each field, sequence numbers
//! included) and of every pass's dump, for every generator on several shapes and for random
//! programs, under every scheduler and allocator. The file is the blessed output
//! (`OXCCL_BLESS=1`), not an independent truth; it pins the output while the passes' data
//! structures change (see `exec_executor.rs` for what the plans compute).

mod common;

use common::{golden, random_program};
use oxccl_host::compile::{Options, PASSES, Plan, Scheduler, TbAlloc, compile, compile_streaming, run_passes};
use oxccl_host::program::generators::Algorithm;
use oxccl_host::program::{Collective, InstanceChannels, Program};
use std::fmt::Write;

/// FNV-1a, 64 bits: stable across platforms and releases.
fn fnv(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3))
}

/// The plan as JSON without its compile times.
fn plan_hash(plan: &Plan) -> u64 {
    let mut p = plan.clone();
    p.stats.compile_ms = 0.0;
    p.stats.pass_ms.clear();
    fnv(serde_json::to_string(&p).expect("a plan serializes").as_bytes())
}

/// One line per configuration: the plan's hash and each pass dump's hash; streaming compilation
/// must give the same rank plans and statistics.
fn fingerprint(p: &Program, out: &mut String) {
    for s in Scheduler::ALL {
        for a in TbAlloc::ALL {
            let opts = Options::new(s, a);
            let plan = compile(p, &opts).unwrap_or_else(|e| panic!("{} {s} {a}: {e}", p.name));
            let mut streamed = Vec::new();
            let mut head = compile_streaming(p, &opts, &mut |rp| streamed.push(rp)).unwrap();
            head.ranks = streamed;
            assert_eq!(plan_hash(&head), plan_hash(&plan), "{} {s} {a}: streaming differs", p.name);
            let c = run_passes(p, &opts).unwrap();
            let dumps: Vec<String> =
                PASSES.iter().map(|pass| format!("{:016x}", fnv(c.dump(p, pass.name).unwrap().as_bytes()))).collect();
            let _ = writeln!(out, "{} {s} {a}: plan {:016x} passes {}", p.name, plan_hash(&plan), dumps.join(" "));
        }
    }
}

#[test]
fn every_generator_and_random_programs_compile_as_blessed() {
    let mut out = String::new();
    let shapes = [(1, 2), (1, 3), (1, 5), (2, 2), (2, 3), (3, 2), (3, 4), (4, 4), (2, 8)];
    for algo in Algorithm::ALL {
        for (n, g) in shapes {
            fingerprint(&algo.generate(n, g).unwrap(), &mut out);
        }
    }
    let colls = [Collective::AllReduce, Collective::AllGather, Collective::ReduceScatter, Collective::AllToAll];
    for seed in 0..48u64 {
        let (ranks, k, ch) = (2 + (seed % 5) as u32, 1 + (seed / 5 % 2) as u32, 1 + (seed / 10 % 3) as u32);
        let mut p = random_program(seed, colls[seed as usize % 4], ranks, k, ch);
        p.ranks_per_node = [None, Some(1), Some(2), Some(3)][(seed / 3 % 4) as usize];
        if seed % 7 == 3 {
            let channels = if seed % 2 == 0 { InstanceChannels::Separate } else { InstanceChannels::Shared };
            p = p.instanced_on(2, channels).unwrap();
        }
        p.name = format!("{}_{seed}", p.name);
        fingerprint(&p, &mut out);
    }
    golden("compile_fingerprints.txt", &out);
}

#[test]
fn the_thread_count_does_not_change_the_plan() {
    let colls = [Collective::AllReduce, Collective::AllGather, Collective::ReduceScatter, Collective::AllToAll];
    let mut programs: Vec<Program> = vec![
        Algorithm::HmAllReduce.generate(4, 4).unwrap(),
        Algorithm::RingAllReduce.generate(1, 17).unwrap(),
        Algorithm::DirectAllToAll.generate(1, 9).unwrap(),
        Algorithm::HmAllGather.generate(3, 5).unwrap(),
    ];
    programs.extend((0..6u64).map(|seed| random_program(seed, colls[seed as usize % 4], 9 + seed as u32, 2, 2)));
    for p in &programs {
        for s in Scheduler::ALL {
            for a in TbAlloc::ALL {
                let hashes: Vec<u64> = [1, 2, 3, 5]
                    .iter()
                    .map(|&t| plan_hash(&compile(p, &Options { threads: Some(t), ..Options::new(s, a) }).unwrap()))
                    .collect();
                assert!(hashes.windows(2).all(|w| w[0] == w[1]), "{} {s} {a}: {hashes:x?}", p.name);
            }
        }
    }
}
