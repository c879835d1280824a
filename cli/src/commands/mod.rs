//! Subcommands of the `oxccl` binary. Each module has an `Args` (clap) and a `run`.

pub mod bench;
pub mod demo;
// Linux only: process groups, PR_SET_PDEATHSIG and sigwait (oxccl's GPUs are on Linux).
#[cfg(target_os = "linux")]
pub mod launch;
pub mod plan;
pub mod reshard;
pub mod simulate;
pub mod verify;

/// What a subcommand reports on failure: a message for the user; the process exits non-zero.
pub type CliResult = Result<(), Box<dyn std::error::Error>>;
