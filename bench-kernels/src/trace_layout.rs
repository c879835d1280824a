//! The layout the benchmark module's timed TMA copy (`bench_tma_trace`) shares with its host side
//! (`oxccl bench tma-trace`, `oxccl_cli::bench::tma_trace`) and its GPU test (this module exists on
//! every target).

/// Dynamic shared memory below the rings: one 8-byte mbarrier per stage of every warp.
pub const BARRIER_BYTES: u32 = 1024;
/// Stages of all a CTA's warps together, at most (one barrier each).
pub const MAX_BARRIERS: u32 = BARRIER_BYTES / 8;
/// Rounds of items (single items where a round is one) the refill may lag behind the stores, at
/// most: the kernel waits with `cp.async.bulk.wait_group.read lag - 1`, whose immediate
/// `cp_async_bulk_wait_group_read_at_most` tells apart up to 7.
pub const MAX_LAG: u32 = 8;

/// Tensor mode: bytes of one row of the 2-D tensor maps (256 u32 elements, a box's widest row);
/// an item is a box of `chunk / TENSOR_ROW` rows (at most 256).
pub const TENSOR_ROW: u32 = 1024;

/// u32 words of each warp's header, which the per-item records follow.
pub const HEADER_WORDS: usize = 8;
/// u32 words of one item's record.
pub const RECORD_WORDS: usize = 4;

// Header words (indices into a warp's header; the words past `H_CHAIN_VALUE` are 0) and record
// words (indices into one item's record; times are `%clock64` cycles from the copy's start, cut to
// 32 bits).

/// Header word: the warp's `%warpid`.
pub const H_WARPID: usize = 0;
/// Header word: the warp's `%smid`.
pub const H_SMID: usize = 1;
/// Header word: `%clock64` cycles the dependent chain took, timed before the copy.
pub const H_CHAIN_CYCLES: usize = 2;
/// Header word: items (chunks) the warp copied.
pub const H_ITEMS: usize = 3;
/// Header word: `%clock64` cycles of the whole copy, until its last bulk group completed.
pub const H_COPY_CYCLES: usize = 4;
/// Header word: the chain's final value, stored so that the chain stays live.
pub const H_CHAIN_VALUE: usize = 5;

/// Record word: when the item's load was issued.
pub const R_ISSUED: usize = 0;
/// Record word: when the issuer saw the item landed (for a round of items, the whole round).
pub const R_LANDED: usize = 1;
/// Record word: when the item's store was committed (for a round, the round's one commit).
pub const R_COMMITTED: usize = 2;
/// Record word: `try_wait` polls that failed before the landing was seen (for a round, the round's
/// polls, in every item of it).
pub const R_POLLS: usize = 3;

/// u32 words of one warp's part of the trace with `traced` records.
pub const fn warp_words(traced: usize) -> usize {
    HEADER_WORDS + RECORD_WORDS * traced
}

const _: () = assert!(H_CHAIN_VALUE < HEADER_WORDS && R_POLLS < RECORD_WORDS && MAX_LAG - 1 == 7);
