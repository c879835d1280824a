//! `oxccl bench` as a cargo bench: the nccl-tests-style tables of the collectives (and every other
//! benchmark of the `oxccl` command) with the same flags.
//!
//! ```text
//! cargo bench --bench collectives                                   # all_reduce, 8 virtual ranks, 1 MiB - 1 GiB
//! cargo bench --bench collectives -- all_reduce --ranks 8 -b 1M -e 1G -f 4 --ctas 8 --mover tma
//! cargo bench --bench collectives -- reduce_scatter --json
//! ```
//!
//! Without a GPU it prints `skipped: no GPU (...)` and exits successfully (the `oxccl bench` command
//! itself fails there, with the same reason).

use clap::Parser;
use std::process::ExitCode;

#[derive(Parser)]
#[command(name = "collectives", about = "oxccl bench as a cargo bench")]
struct Bench {
    #[command(flatten)]
    args: Box<oxccl::cli::bench::Args>,
}

fn main() -> ExitCode {
    // `cargo bench` adds `--bench` (and a filter when one is given before `--`): not ours.
    let mut argv: Vec<String> = std::env::args().filter(|a| a != "--bench").collect();
    if argv.len() == 1 {
        argv.extend(["all_reduce", "--ranks", "8", "-b", "1M", "-e", "1G", "-f", "4"].map(String::from));
    }
    let bench = Bench::parse_from(&argv);
    if let Err(why) = oxccl::engine::probe_gpu() {
        eprintln!("skipped: no GPU ({why})");
        return ExitCode::SUCCESS;
    }
    match oxccl::cli::bench::run(*bench.args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("collectives: {e}");
            ExitCode::FAILURE
        }
    }
}
