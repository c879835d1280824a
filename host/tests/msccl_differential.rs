//! Differential test of the MSCCL importer: an independent interpreter of MSCCL's semantics
//! (`msccl_model`, its own code from MSCCL's runtime) and `oxccl verify`'s paths (the importer, then
//! the compiler and the CPU executor of its schedule, and the lowering onto the engine that
//! `run_program` runs, on the host) must agree, on generated and mutated files, on whether a file
//! is the collective it names and, when it is, on every output element.
//!
//! `MSCCL_DIFF_CASES` sets how many cases (default 6000); every case is deterministic in its index.
//! A disagreement prints the file and both verdicts.

mod common;
mod msccl_gen;
mod msccl_model;

use common::{Rng, bundled_msccl, xml_files};
use msccl_gen::{El, generated, mutate, mutate_text};
use msccl_model::{Verdict, interpret};
use oxccl_host::compile::direct::run_on_host;
use oxccl_host::compile::{Options, Scheduler, TbAlloc, compile};
use oxccl_host::exec::{ExecOptions, ReduceOp, execute};
use oxccl_host::program::msccl::import;
use oxccl_kernels::abi::DType;

/// What oxccl concludes: the outputs of the imported program run on the CPU executor, or why not.
fn oxccl_verdict(xml: &str, inputs: Option<&[Vec<i64>]>, rng: &mut Rng) -> Result<Option<Vec<Vec<i64>>>, String> {
    let imp = import(xml).map_err(|e| format!("import: {e}"))?;
    let Some(inputs) = inputs else { return Ok(None) };
    let s = Scheduler::ALL[rng.below(Scheduler::ALL.len() as u32) as usize];
    let a = TbAlloc::ALL[rng.below(TbAlloc::ALL.len() as u32) as usize];
    let plan = compile(&imp.program, &Options::new(s, a)).map_err(|e| format!("compile ({s}, {a}): {e}"))?;
    let opts = ExecOptions { micro_batches: 1 + rng.below(2), fifo_slots: plan.stats.fifo_slots_needed.max(1) };
    execute::<i64>(&plan, inputs, ReduceOp::Sum, &opts).map(Some).map_err(|e| format!("execute ({s}, {a}): {e}"))
}

/// Compares the verdicts on `xml`: `None` where both refuse it, `Some(engine)` where all agree on
/// the outputs (`engine`: the engine's lowering was among them); `Err` describes a disagreement.
fn compare(xml: &str, seed: u64) -> Result<Option<bool>, String> {
    let mut rng = Rng::new(seed ^ 0xD1FF);
    let len = 1 + rng.below(2) as usize;
    let model = interpret(xml, len, seed);
    match (&model, oxccl_verdict(xml, None, &mut rng)) {
        (Verdict::Refused(_), Err(_)) => Ok(None),
        (Verdict::Refused(why), Ok(_)) => Err(format!("the interpreter refuses ({why}) but oxccl imports it")),
        (Verdict::Accepted { .. }, Err(e)) => Err(format!("the interpreter accepts but oxccl refuses: {e}")),
        (Verdict::Accepted { in_place, inputs, outputs }, Ok(_)) => {
            let got = oxccl_verdict(xml, Some(inputs), &mut rng)
                .map_err(|e| format!("the interpreter accepts (in place: {in_place}) but {e}"))?
                .expect("ran");
            if &got != outputs {
                return Err(format!("outputs differ (in place: {in_place}): oxccl {got:?}, interpreter {outputs:?}"));
            }
            // The engine's bulk copies need 16-byte chunks: two i64 elements.
            let engine = len == 2;
            if engine {
                let program = import(xml).expect("imported above").program;
                let (engine, _) = run_on_host(&program, DType::I64, ReduceOp::Sum, len, inputs)
                    .map_err(|e| format!("the interpreter accepts (in place: {in_place}) but the engine: {e}"))?;
                if &engine != outputs {
                    return Err(format!(
                        "engine outputs differ (in place: {in_place}): engine {engine:?}, interpreter {outputs:?}"
                    ));
                }
            }
            Ok(Some(engine))
        }
    }
}

/// The case of index `i`: a generated file, mutated by 0 to 3 structural mutations and now and
/// then by a textual one.
fn case(i: u64) -> String {
    let mut rng = Rng::new(i.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0x0C0F_FEE0);
    let mut doc = generated(&mut rng);
    let mutations = if i.is_multiple_of(4) { 0 } else { 1 + rng.below(3) };
    for _ in 0..mutations {
        mutate(&mut doc, &mut rng);
    }
    let xml = doc.print();
    if rng.below(10) == 0 { mutate_text(&xml, &mut rng) } else { xml }
}

fn cases() -> u64 {
    std::env::var("MSCCL_DIFF_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(6000)
}

#[test]
fn importer_agrees_with_an_independent_msccl_interpreter() {
    let n = cases();
    let (mut accepted, mut refused, mut on_engine) = (0u64, 0u64, 0u64);
    let mut disagreements = Vec::new();
    for i in 0..n {
        let xml = case(i);
        match compare(&xml, i) {
            Ok(Some(engine)) => {
                accepted += 1;
                on_engine += u64::from(engine);
            }
            Ok(None) => refused += 1,
            Err(why) => disagreements.push((i, why, xml)),
        }
    }
    use std::io::Write;
    let _ = writeln!(
        std::io::stderr(),
        "msccl differential: {n} cases, {accepted} accepted by both ({on_engine} also run as the engine's \
         lowering), {refused} refused by both, {} disagreements",
        disagreements.len()
    );
    if let Some((i, why, xml)) = disagreements.first() {
        panic!("{} disagreements; the first, case {i}: {why}\n{xml}", disagreements.len());
    }
    // The generators must keep producing both kinds, or the test proves little.
    assert!(accepted * 5 > n && refused * 5 > n, "{accepted} accepted, {refused} refused of {n}");
    assert!(on_engine * 4 > accepted, "only {on_engine} of {accepted} accepted cases ran as the engine's lowering");
}

/// The bundled real files, and mutations of them.
#[test]
fn real_files_and_their_mutations_agree() {
    let files = xml_files(&bundled_msccl());
    assert!(!files.is_empty());
    let per_file: u64 = std::env::var("MSCCL_DIFF_REAL").ok().and_then(|v| v.parse().ok()).unwrap_or(12);
    let mut disagreements = Vec::new();
    let mut checked = 0;
    for (k, f) in files.iter().enumerate() {
        let xml = std::fs::read_to_string(f).unwrap();
        assert!(matches!(compare(&xml, k as u64), Ok(Some(_))), "{}", f.display());
        let doc = El::parse(&xml).expect("a real file parses");
        for m in 0..per_file {
            let mut rng = Rng::new((k as u64) << 32 | m);
            let mut d = doc.clone();
            mutate(&mut d, &mut rng);
            let x = d.print();
            checked += 1;
            if let Err(why) = compare(&x, m) {
                disagreements.push(format!("{} mutation {m}: {why}", f.display()));
            }
        }
    }
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "msccl differential: {checked} mutations of {} real files", files.len());
    assert!(disagreements.is_empty(), "{}", disagreements.join("\n"));
}
