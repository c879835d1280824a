//! `oxccl verify` (in progress).

use super::CliResult;

#[derive(clap::Args, Debug)]
pub struct Args {}

pub fn run(_args: Args) -> CliResult {
    Err("`oxccl verify` is not built yet".into())
}
