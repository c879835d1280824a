//! The shape of the benchmark tensor-core GEMM (`bench_gemm_bf16`), shared by the kernel and
//! the host that launches it (this module exists on every target).

/// Threads per CTA (eight warps as 2 × 4, each a 64 × 32 block of C).
pub const THREADS: u32 = 256;
/// Rows and columns of C per CTA: `m` and `n` must be multiples of it.
pub const TILE_MN: u32 = 128;
/// K per shared-memory stage: `k` must be a multiple of it.
pub const TILE_K: u32 = 32;
/// Bytes between rows of an operand tile in shared memory: `TILE_K` bf16 and 16 bytes of padding,
/// so the eight rows one `ldmatrix` reads fall in distinct banks.
pub const ROW: u32 = 80;
/// Bytes of one operand tile in shared memory: `TILE_MN` rows of [`ROW`] bytes.
pub const OPERAND: u32 = TILE_MN * ROW;
/// Bytes of one shared-memory stage: the A tile, then the B tile.
pub const STAGE: u32 = 2 * OPERAND;
/// Stages in flight.
pub const STAGES: u32 = 3;
/// Dynamic shared memory per CTA, in bytes: every stage's A and B tiles.
pub const SMEM: u32 = STAGES * STAGE;

/// Dynamic shared memory that keeps a second CTA off an SM of `per_sm` bytes of shared memory: half
/// of it (each CTA also holds 1 KiB the system reserves), or [`SMEM`] where that is more.
pub const fn one_per_sm_smem(per_sm: u32) -> u32 {
    if per_sm / 2 > SMEM { per_sm / 2 } else { SMEM }
}

// Rows hold a K tile and start 16-byte aligned; the eight 16-byte row pieces one `ldmatrix`
// phase reads, ROW bytes apart, fall in eight distinct groups of four banks (128 bytes) exactly
// when ROW / 16 is odd.
const _: () = assert!(ROW.is_multiple_of(16) && ROW >= TILE_K * 2 && (ROW / 16) % 2 == 1 && STAGES >= 2);
