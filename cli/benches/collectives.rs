//! `oxccl bench` as a cargo bench: the nccl-tests-style tables of the collectives (and every other
//! benchmark of the `oxccl` command) with the same flags.
//!
//! ```text
//! cargo bench --bench collectives                                   # all_reduce, 8 virtual ranks, 1 MiB - 1 GiB
//! cargo bench --bench collectives -- all_reduce --ranks 8 -b 1M -e 1G -f 4 --ctas 8 --mover tma
//! cargo bench --bench collectives -- --json                         # all_reduce unless a benchmark is named
//! ```
//!
//! Without a GPU it prints `skipped: no GPU (...)` and exits successfully (the `oxccl bench` command
//! itself fails there, with the same reason).

use clap::{CommandFactory, FromArgMatches, Parser};
use oxccl_cli::commands::bench::BENCHMARKS;
use std::process::ExitCode;

#[derive(Parser)]
#[command(name = "collectives", about = "oxccl bench as a cargo bench")]
struct Bench {
    #[command(flatten)]
    args: Box<oxccl_cli::commands::bench::Args>,
}

fn main() -> ExitCode {
    // `cargo bench` appends `--bench`, which is the harness's flag, not a benchmark's.
    let argv: Vec<String> = std::env::args().filter(|a| a != "--bench").collect();
    let matches = Bench::command().get_matches_from(&argv);
    let mut args = *Bench::from_arg_matches(&matches).unwrap_or_else(|e| e.exit()).args;
    // Flags its benchmark does not read are refused, as by the `oxccl` command.
    args.given = oxccl_cli::commands::bench::given_ids(&matches);
    match args.what.as_deref() {
        // A filter meant for another bench (`cargo bench copy/tma` hands it to every bench target).
        Some(w) if !BENCHMARKS.contains(&w) => {
            eprintln!(
                "collectives: {w:?} names no benchmark of oxccl bench ({}); nothing to run",
                BENCHMARKS.join(", ")
            );
            return ExitCode::SUCCESS;
        }
        // Bare `cargo bench`, or flags alone: the AllReduce (8 virtual ranks, 1 MiB - 1 GiB by default).
        None if args.algo.is_none() && args.xml.is_none() => args.what = Some("all_reduce".into()),
        _ => {}
    }
    // A flag its benchmark would ignore is refused with or without a GPU.
    if let Err(e) = oxccl_cli::commands::bench::checked_kind(&args) {
        eprintln!("collectives: {e}");
        return ExitCode::FAILURE;
    }
    if let Err(why) = oxccl::engine::probe_gpu() {
        eprintln!("skipped: no GPU ({why})");
        return ExitCode::SUCCESS;
    }
    match oxccl_cli::commands::bench::run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("collectives: {e}");
            ExitCode::FAILURE
        }
    }
}
