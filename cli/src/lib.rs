//! The `oxccl` command's machinery, apart from the library: its subcommands ([`commands`]), the
//! benchmarks ([`bench`](mod@bench)) that the command and the cargo benches run, their progress
//! bars ([`progress`]) and the charts `oxccl plot` draws from their logs ([`plot`]).

#![warn(missing_docs)]

pub mod bench;
pub mod commands;
pub mod plot;
pub mod progress;
pub mod ptx;
