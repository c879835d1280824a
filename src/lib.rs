//! oxccl: collective communication for NVIDIA Hopper GPUs in pure Rust.
//!
//! (The public API is being built; see README.md.)

pub mod cli;
pub mod ptx;
