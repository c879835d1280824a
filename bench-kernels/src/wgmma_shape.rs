//! The shape of the benchmark warpgroup GEMM (`bench_gemm_wgmma`), shared by the kernel and the
//! host that launches it, and the shared-memory matrix descriptor its `wgmma` instructions read (this
//! module exists on every target).
//!
//! One CTA of two warpgroups computes one 128 × 256 tile of `C = A · Bᵀ` (warpgroup `w` rows
//! `64w..64w + 64`, all 256 columns, 128 f32 accumulators per thread). K advances 64 bf16 (128 bytes)
//! at a time through [`STAGES`] shared-memory stages, each loaded by two tensor copies (the A box of
//! 128 rows and the B box of 256 rows, 128 bytes per row, 128-byte swizzle) that one thread issues.

/// Threads per CTA: two warpgroups, no warp of its own for the loads.
pub const THREADS: u32 = 256;
/// Rows of C per CTA: `m` must be a multiple of it.
pub const TILE_M: u32 = 128;
/// Columns of C per CTA: `n` must be a multiple of it.
pub const TILE_N: u32 = 256;
/// K per stage, in elements (one 128-byte swizzle row of bf16): `k` must be a multiple of it.
pub const TILE_K: u32 = 64;
/// Bytes of one operand row in a stage.
pub const ROW: u32 = TILE_K * 2;
/// Bytes of a stage's A box.
pub const A_BYTES: u32 = TILE_M * ROW;
/// Bytes of a stage's B box.
pub const B_BYTES: u32 = TILE_N * ROW;
/// Bytes of one stage: the A box, then the B box.
pub const STAGE: u32 = A_BYTES + B_BYTES;
/// Stages in flight.
pub const STAGES: u32 = 3;
/// Dynamic shared memory per CTA, in bytes: 1024 to align the stages (the 128-byte swizzle repeats
/// every 1024 bytes and the descriptors assume it starts there), the stages, and two mbarriers per
/// stage (loaded, released).
pub const SMEM: u32 = 1024 + STAGES * STAGE + 2 * STAGES * 8;
/// Registers per thread the kernel is held to (`.maxnreg`): eight warps of 168 leave 22528 of an
/// SM's 65536 for the CTAs beside it.
pub const MAX_REGISTERS: u32 = 168;

/// The `wgmma` matrix descriptor of a K-major operand at shared-memory address `addr` laid out as the
/// 128-byte-swizzled tensor copy writes it: rows of 128 bytes, 8-row groups 1024 bytes apart (the
/// stride byte offset), the swizzle pattern anchored at 1024-byte boundaries.
///
/// Bits (PTX ISA, "Matrix Descriptor Format"): 0–13 `addr >> 4`; 16–29 the leading byte offset
/// `>> 4` (unused for a swizzled K-major operand whose K fits one swizzle row; 1 by convention);
/// 32–45 the stride byte offset `>> 4` (1024 B); 49–51 the base offset (0: the pattern starts at a
/// 1024-byte boundary); 62–63 the swizzle mode (1: 128 bytes).
///
/// The k16 steps inside a 64-element row are `addr + 32 · step`.
pub const fn descriptor_sw128(addr: u32) -> u64 {
    ((addr as u64 >> 4) & 0x3fff) | (1 << 16) | ((1024u64 >> 4) << 32) | (1 << 62)
}

const _: () = assert!(ROW == 128 && STAGE.is_multiple_of(1024) && A_BYTES.is_multiple_of(1024) && STAGES >= 2);
const _: () = assert!(THREADS * MAX_REGISTERS <= 65536 && (TILE_M / 2) == 64 && TILE_N == 256);
