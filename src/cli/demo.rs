//! `oxccl demo` (in progress).

use super::CliResult;

#[derive(clap::Args, Debug)]
pub struct Args {}

pub fn run(_args: Args) -> CliResult {
    Err("`oxccl demo` is not built yet".into())
}
