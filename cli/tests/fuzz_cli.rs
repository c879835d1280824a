//! The command line's parsers under hostile input: any text to the value parsers, and any argument
//! list of the benchmarks' own flags with hostile values to clap and to the checks a benchmark
//! makes before it looks for a GPU. Nothing panics; what parses obeys its bounds.
//! `OXCCL_FUZZ_CASES` sets the cases per target (CI: 10,000).

use clap::{CommandFactory, Parser};
use oxccl_cli::commands::bench;
use oxccl_cli::commands::launch::{MAX_PROCESSES, parse_gpus, parse_grace};
use oxccl_cli::commands::plan::parse_topo;
use oxccl_cli::commands::simulate::parse_size;
use proptest::prelude::*;

fn cases() -> u32 {
    std::env::var("OXCCL_FUZZ_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(10_000)
}

/// `oxccl bench …` as the binary parses it.
#[derive(Parser, Debug)]
struct Bench {
    #[command(subcommand)]
    command: bench::Command,
}

/// Values a user might mistype or an attacker might try, for any flag.
const VALUES: &[&str] = &[
    "",
    " ",
    "0",
    "1",
    "-1",
    "2",
    "3",
    "8",
    "17",
    "4096",
    "1M",
    "1G",
    "64K",
    "16G",
    "999999999999",
    "18446744073709551616",
    "1e9",
    "nan",
    "inf",
    "0.5",
    "abc",
    "2x4",
    "1x8",
    "0x0",
    "x",
    "9999999x9999999",
    "0-3",
    "3-0",
    ",",
    "-",
    "f32",
    "bf16",
    "float",
    "int32",
    "f64",
    "tma",
    "simt",
    "registers",
    "sum",
    "max",
    "prod",
    "ring-allreduce",
    "hm-allreduce",
    "hier-allreduce",
    "R",
    "S0",
    "S9",
    "P",
    "2x4@8",
    "4x4@100",
    "8,8",
    "7168,18432",
    "symmetric",
    "plain",
    "nccl",
    "engine",
    "\u{0}",
    "é",
    "--",
    "/nonexistent/x.xml",
];

/// Every subcommand of `oxccl bench` with its long flags (`--name`), from clap's own definition.
fn flags() -> Vec<(String, Vec<String>)> {
    Bench::command()
        .get_subcommands()
        .map(|sub| {
            let longs = sub.get_arguments().filter_map(|a| a.get_long()).map(|l| format!("--{l}")).collect();
            (sub.get_name().to_string(), longs)
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), failure_persistence: None, .. ProptestConfig::default() })]

    #[test]
    fn value_parsers_take_any_text(text in ".{0,24}") {
        let _ = parse_size(&text);
        if let Ok((n, g)) = parse_topo(&text) {
            prop_assert!(n > 0 && g > 0);
        }
        if let Ok(list) = parse_gpus(&text) {
            prop_assert!(!list.gpus.is_empty() && list.gpus.len() <= MAX_PROCESSES);
        }
        if let Ok(d) = parse_grace(&text) {
            prop_assert!(d.as_secs_f64().is_finite());
        }
    }

    #[test]
    fn sizes_read_back_or_are_refused_as_too_large(n in any::<u64>(), suffix in 0usize..4) {
        let (unit, mul) = [("", 1u64), ("K", 1 << 10), ("M", 1 << 20), ("G", 1 << 30)][suffix];
        let parsed = parse_size(&format!("{n}{unit}"));
        match n.checked_mul(mul) {
            Some(bytes) => prop_assert_eq!(parsed, Ok(bytes)),
            None => prop_assert!(parsed.unwrap_err().contains("more than 2^64 - 1")),
        }
    }

    #[test]
    fn ranges_of_gpus_expand_in_order(a in 0u32..2000, len in 0u32..2000) {
        let text = format!("{a}-{}", a as u64 + len as u64);
        match parse_gpus(&text) {
            Ok(list) => prop_assert_eq!(list.gpus, (a..=a + len).collect::<Vec<_>>()),
            Err(e) => prop_assert!(len as usize + 1 > MAX_PROCESSES && e.contains("more than"), "{}", e),
        }
    }

    #[test]
    fn bench_flags_with_hostile_values_parse_or_are_refused(
        sub in any::<prop::sample::Index>(),
        picks in prop::collection::vec((any::<prop::sample::Index>(), any::<prop::sample::Index>(), any::<bool>()), 0..6),
    ) {
        let all = flags();
        let (name, longs) = &all[sub.index(all.len())];
        let mut argv = vec!["bench".to_string(), name.clone()];
        for (flag, value, with_value) in picks {
            if !longs.is_empty() {
                argv.push(longs[flag.index(longs.len())].clone());
            }
            if with_value {
                argv.push(VALUES[value.index(VALUES.len())].to_string());
            }
        }
        // A parse error is clap's refusal; a parsed command meets the checks made before any GPU is
        // looked for, which must answer without a panic.
        if let Ok(parsed) = Bench::try_parse_from(&argv) {
            let _ = bench::check(&parsed.command);
        }
    }
}

#[test]
fn the_vocabulary_reaches_every_benchmark() {
    let all = flags();
    assert!(all.len() >= 10, "{all:?}");
    assert!(all.iter().all(|(_, longs)| !longs.is_empty()));
    assert!(all.iter().any(|(n, l)| n == "all-reduce" && l.iter().any(|f| f == "--ranks-per-node")));
    // The path the fuzz takes: a parsed command reaches the checks, which accept and refuse.
    let ok = Bench::try_parse_from(["bench", "all-reduce", "--minbytes", "1M", "--maxbytes", "1G"]).unwrap();
    assert!(bench::check(&ok.command).is_ok());
    let bad = Bench::try_parse_from(["bench", "all-reduce", "--procs", "8", "--ranks-per-node", "3"]).unwrap();
    assert!(bench::check(&bad.command).unwrap_err().to_string().contains("--ranks-per-node 3"));
}
