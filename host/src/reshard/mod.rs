//! M-to-N reshard: move a tensor from one (mesh, placements) layout to another, sending each destination
//! only the byte ranges it lacks, once per destination NVLink domain.
//!
//! | module | what it holds |
//! |---|---|
//! | [`layout`] | [`Mesh`], [`Placement`], [`Layout`], [`Sharding`]: the model and what each rank holds |
//! | [`mod@plan`] | the planner: [`plan()`] → [`ReshardPlan`] (stages of strided [`Transfer`]s) |
//! | [`traffic`] | [`Traffic`]: bytes the plan moves, bytes destinations lack, the two usual workarounds |
//! | [`exec`] | the CPU executor and [`verify`], the exact check against the global tensor |
//! | [`mod@lower`] | [`lower()`]: a plan as engine descriptors, one [`crate::lowered::Lowered`] per stage |
//! | [`workaround`] | the two usual workarounds as programs for the same engine |
//! | [`report`] | the text form (golden tests) and the JSON report (`oxccl reshard --json`) |
//!
//! ```
//! use oxccl_host::reshard::{Layout, PlanOptions, plan, verify};
//!
//! // A [4, 8] f32 tensor sharded by rows over ranks 0..4, to TP2 × DP2 on ranks 4..8.
//! let src = Layout::parse("1x4@0", "R,S0")?;
//! let dst = Layout::parse("2x2@4", "R,S0")?;
//! let plan = plan(&[4, 8], 4, &src, &dst, PlanOptions::default())?;
//! assert_eq!(plan.traffic().bytes_needed, 4 * 2 * 8 * 4); // four ranks, two rows each
//! assert!(verify(&plan)?.is_exact());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! The model, the algorithm and the accounting are described in `docs/RESHARD.md`.

pub mod exec;
mod geometry;
pub mod layout;
pub mod lower;
pub mod plan;
pub mod report;
pub mod traffic;
mod transfer;
pub mod workaround;

pub use crate::lowered::Loads;
pub use exec::{
    Buffers, ExecError, Found, Mismatch, VerifyReport, execute, execute_bytes, execute_elements, execute_summing,
    verify, verify_with_limit,
};
pub use layout::{Layout, LayoutError, Mesh, Placement, Rank, Region, Sharding, chunk, parse_placements};
pub use lower::{CtaOwner, LowerError, LowerOptions, LoweredReshard, lower};
pub use plan::{
    MAX_TRANSFERS, PlanOptions, ReadFrom, ReshardError, ReshardPlan, Route, Stage, Transfer, check_same_tensor, plan,
};
pub use report::{PlanReport, TransferRow, VerifySummary, Workarounds};
pub use traffic::{Traffic, Workaround};
