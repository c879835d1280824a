//! What a reshard plan is made of: strided copies ([`Transfer`]) grouped in stages of
//! independent copies ([`Stage`]). The planner ([`super::plan`]) makes them and the traffic
//! accounting ([`super::traffic`]) reads them.

use super::layout::{Rank, Region};
use serde::{Deserialize, Serialize};

/// Which of the reading rank's two buffers a transfer reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ReadFrom {
    /// The reading rank's local shard of the source layout (the tensor it passed as source).
    Src,
    /// The reading rank's buffer of the destination layout, filled by an earlier stage (hierarchical
    /// forwarding from a domain leader).
    Dst,
}

/// One strided copy from one rank's buffer to another rank's destination buffer, or, from a
/// `Partial` source, the sum of several ranks' partial sums of one box.
///
/// The copy is a box of `shape.len()` dims, outer first: `shape[..n-1]` are loop extents and
/// `shape[n-1]` is a contiguous run in bytes. Byte `b` of the run at loop index `i` is read at
/// `src_offset + Σ i[j] * src_strides[j] + b` of the source-side buffer and written at
/// `dst_offset + Σ i[j] * dst_strides[j] + b` of `dst`'s destination buffer. A contiguous copy has
/// `shape == [bytes]` and no strides.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Transfer {
    /// The rank whose buffer is read.
    pub src: Rank,
    /// Ranks whose buffers hold the other partial sums of the box (a `Partial` source; empty
    /// otherwise): each is read at the same offsets and strides as `src`'s (they hold the same box),
    /// and the destination gets the sum of `src`'s values and theirs, added in ascending rank order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub partials: Vec<Rank>,
    /// The rank whose destination buffer is written. Equal to `src` for a local copy.
    pub dst: Rank,
    /// Which of `src`'s buffers is read.
    pub read: ReadFrom,
    /// Byte offset of the box's first byte in the buffer read.
    pub src_offset: u64,
    /// Byte offset of the box's first byte in `dst`'s destination buffer.
    pub dst_offset: u64,
    /// Bytes copied: the product of `shape`.
    pub bytes: u64,
    /// Loop extents, outer first, then the contiguous run in bytes.
    pub shape: Vec<u64>,
    /// Byte strides of the loops on the read side (`shape.len() - 1` of them).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub src_strides: Vec<u64>,
    /// Byte strides of the loops on the write side (`shape.len() - 1` of them).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub dst_strides: Vec<u64>,
    /// The global box copied, in elements (for reading plans and checking them).
    pub region: Region,
}

impl Transfer {
    /// Whether the copy stays on one rank (one source, the writer itself).
    pub fn is_local(&self) -> bool {
        self.src == self.dst && self.partials.is_empty()
    }

    /// Every rank read: `src`, then `partials`.
    pub fn sources(&self) -> impl Iterator<Item = Rank> + '_ {
        std::iter::once(self.src).chain(self.partials.iter().copied())
    }

    /// Whether the transfer sums partial sums (more than one source).
    pub fn reduces(&self) -> bool {
        !self.partials.is_empty()
    }

    /// Whether the copy is one contiguous run.
    pub fn is_contiguous(&self) -> bool {
        self.shape.len() == 1
    }

    /// Bytes of the contiguous run.
    pub fn run_bytes(&self) -> u64 {
        self.shape.last().copied().unwrap_or(0)
    }
}

/// Transfers with no dependency among them. Every transfer of stage `k + 1` may depend on any of stage
/// `k` (it reads a destination buffer written there); none depends on a transfer of its own stage.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Stage {
    /// The transfers, sorted by (`dst`, `dst_offset`, `src`).
    pub transfers: Vec<Transfer>,
}
