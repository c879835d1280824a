//! `oxccl bench` (in progress).

use super::CliResult;

#[derive(clap::Args, Debug)]
pub struct Args {}

pub fn run(_args: Args) -> CliResult {
    Err("`oxccl bench` is not built yet".into())
}
