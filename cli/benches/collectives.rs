//! `oxccl bench` as a cargo bench: the nccl-tests-style tables of the collectives (and every other
//! benchmark of the `oxccl` command) with the same subcommands and flags.
//!
//! ```text
//! cargo bench --bench collectives                                   # all-reduce, 8 virtual ranks, 1 MiB - 1 GiB
//! cargo bench --bench collectives -- all-reduce --ranks 8 -b 1M -e 1G -f 4 --ctas 8 --mover tma
//! cargo bench --bench collectives -- reduce-scatter --json
//! ```
//!
//! Without a GPU it prints `skipped: no GPU (...)` and exits successfully (the `oxccl bench` command
//! itself fails there, with the same reason).

use clap::{CommandFactory, Parser, Subcommand};
use oxccl_cli::commands::bench::{self, Command};
use std::process::ExitCode;

#[derive(Parser)]
#[command(name = "collectives", about = "oxccl bench as a cargo bench")]
struct Bench {
    #[command(subcommand)]
    command: Command,
}

fn main() -> ExitCode {
    // `cargo bench` appends `--bench`, which is the harness's flag, not a benchmark's.
    let mut argv: Vec<String> = std::env::args().filter(|a| a != "--bench").collect();
    match argv.get(1) {
        // Bare `cargo bench`, or flags alone: the AllReduce (8 virtual ranks, 1 MiB - 1 GiB by default).
        None => argv.push("all-reduce".into()),
        Some(first) if first.starts_with('-') && !matches!(first.as_str(), "-h" | "--help" | "-V" | "--version") => {
            argv.insert(1, "all-reduce".into())
        }
        // A filter meant for another bench (`cargo bench copy/tma` hands it to every bench target).
        Some(first) if !Command::has_subcommand(first) => {
            let names: Vec<String> = Bench::command().get_subcommands().map(|c| c.get_name().to_string()).collect();
            eprintln!(
                "collectives: {first:?} names no benchmark of oxccl bench ({}); nothing to run",
                names.join(", ")
            );
            return ExitCode::SUCCESS;
        }
        Some(_) => {}
    }
    let command = Bench::parse_from(&argv).command;
    // A bad command is refused with or without a GPU.
    if let Err(e) = bench::check(&command) {
        eprintln!("collectives: {e}");
        return ExitCode::FAILURE;
    }
    if let Err(why) = oxccl::engine::probe_gpu() {
        eprintln!("skipped: no GPU ({why})");
        return ExitCode::SUCCESS;
    }
    match bench::run(command) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("collectives: {e}");
            ExitCode::FAILURE
        }
    }
}
