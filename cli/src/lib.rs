//! The `oxccl` command's machinery, apart from the library: its subcommands ([`commands`]), the
//! benchmarks ([`bench`](mod@bench)) that the command and the cargo benches run, their progress
//! bars ([`progress`]), the charts `oxccl plot` draws from their logs ([`plot`]) and the docs' tables
//! `oxccl tables` rewrites from a snapshot of them ([`tables`](mod@tables)).

#![warn(missing_docs)]

pub mod bench;
pub mod commands;
pub mod plot;
pub mod progress;
pub mod ptx;
pub mod tables;
