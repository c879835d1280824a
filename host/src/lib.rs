//! `oxccl-host`: everything oxccl decides on the host, in pure Rust with no CUDA.
//!
//! | module | what it holds |
//! |---|---|
//! | [`collective`] | the collectives, one type for every front end |
//! | [`tccl`] | T-CCL plans: shard-in / shard-out task lists for AllReduce, ReduceScatter, AllGather, Broadcast and Reduce, and their CPU reference (`tccl::reference`) |
//! | [`group`] | grouped collectives: several T-CCL plans in one launch of each rank, a row of the buffer table (four buffers) per CTA |
//! | [`program`] | the transfer-program IR, its text format, the MSCCL XML importer and the built-in generators |
//! | [`compile`] | compiler passes (dependencies, schedulers, thread-block allocation), the compiled plan, and the lowering of a program onto the engine (`compile::direct`) |
//! | [`sim`] | discrete-event simulator of a compiled plan on a topology, SVG timelines |
//! | [`exec`] | the CPU executor of compiled plans (the schedule's semantic oracle) and the collectives' CPU references |
//! | [`fp8`] | the 8-bit float formats' values and rounding, as the engine reduces them |
//! | [`lowered`] | the engine's descriptors executed on host memory, and the race checker for them |
//! | [`reshard`] | M-to-N reshard planner between two (mesh, placements) layouts |
//! | [`p2p`] | point-to-point transfers between ranks that launch alone: pair slots, rounds, their task lists |
//! | [`verify`] | the report of a check of outputs against what they should hold, for every executor |
//! | [`nodes`] | ranks across nodes, and the staged hierarchical collectives (NVLink inside, an inter-node engine between) |

#![warn(missing_docs)]

pub mod collective;
pub mod compile;
pub mod exec;
pub mod fp8;
pub mod group;
pub mod lowered;
pub mod nodes;
pub mod p2p;
pub mod program;
pub mod reshard;
pub mod sim;
pub mod tccl;
pub mod verify;
