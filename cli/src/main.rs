//! The `oxccl` command: benchmarks, plans, simulations, verification, reshard planning and a demo.

use clap::{Parser, Subcommand};
use oxccl_cli::commands as cli;
use std::process::ExitCode;

#[derive(Parser)]
#[command(name = "oxccl", version, about = "Collective communication for NVIDIA Hopper GPUs in pure Rust")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run an AllReduce over 8 ranks: on the GPU when one is present, otherwise the same plan on the CPU executor.
    Demo(cli::demo::Args),
    /// Benchmarks: nccl-tests-style collectives, the movers, overlap, reshard, transfer programs.
    #[command(subcommand)]
    Bench(cli::bench::Command),
    /// Compile an algorithm and print the plan summary.
    Plan(cli::plan::Args),
    /// Simulate a compiled plan on a topology.
    Simulate(cli::simulate::Args),
    /// Run a program on the CPU, as the engine runs it and as its compiled schedule, against the collective's reference.
    Verify(cli::verify::Args),
    /// Plan an M-to-N reshard between two (mesh, placements) layouts.
    Reshard(cli::reshard::Args),
    /// Draw SVG (and PNG) charts from benchmarks' --json logs: busbw against size, TMA against SIMT
    /// against NCCL, the mover sweep, compiled against interpreted plans, overlap.
    Plot(cli::plot::Args),
    /// Rewrite the docs' marked tables (`<!-- snap-table … -->`) from a scripts/perf-snapshot.sh folder.
    Tables(cli::tables::Args),
    /// Start N processes of a command on this host, torchrun-style: rank, world size, master port and
    /// GPU in each one's environment.
    #[cfg(target_os = "linux")]
    Launch(cli::launch::Args),
}

fn main() -> ExitCode {
    restore_sigpipe();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Demo(a) => cli::demo::run(a),
        Command::Bench(b) => cli::bench::run(b),
        Command::Plan(a) => cli::plan::run(a),
        Command::Simulate(a) => cli::simulate::run(a),
        Command::Verify(a) => cli::verify::run(a),
        Command::Reshard(a) => cli::reshard::run(a),
        Command::Plot(a) => cli::plot::run(a),
        Command::Tables(a) => cli::tables::run(a),
        // The launcher ends as its ranks did: it gives the status to exit with.
        #[cfg(target_os = "linux")]
        Command::Launch(a) => match cli::launch::run(a) {
            Ok(status) => return ExitCode::from(status),
            Err(e) => Err(e),
        },
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("oxccl: {e}");
            ExitCode::from(status_of(&*e))
        }
    }
}

/// The exit status of a failed command: wrong results have one of their own, apart from refused
/// input and errors (1).
fn status_of(e: &(dyn std::error::Error + 'static)) -> u8 {
    if e.is::<cli::WrongResult>() { cli::WrongResult::STATUS } else { 1 }
}

/// Puts back the default action of SIGPIPE, which the Rust runtime ignores: a reader that closes
/// the pipe early (`oxccl verify ... | head -1`) then ends the command quietly, as any Unix filter,
/// where `println!` would panic on the broken pipe.
fn restore_sigpipe() {
    #[cfg(unix)]
    // SAFETY: called first thing in `main`, before any other thread exists or any handler is
    // installed; SIG_DFL is a valid disposition for SIGPIPE and the previous one is not needed.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wrong_results_exit_apart_from_refusals() {
        assert_eq!(status_of(&*cli::WrongResult::boxed("2 of 8 configurations failed")), 3);
        let refused: Box<dyn std::error::Error> = "--count 0: a chunk needs at least one element".into();
        assert_eq!(status_of(&*refused), 1);
    }
}
