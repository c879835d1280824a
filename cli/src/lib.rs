//! The `oxccl` command's machinery, apart from the library: its subcommands ([`commands`]) and the
//! benchmarks ([`bench`](mod@bench)) that the command and the cargo benches run.

#![warn(missing_docs)]

pub mod bench;
pub mod commands;
pub mod plot;
pub mod progress;
pub mod ptx;
