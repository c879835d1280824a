//! Warpgroup-level tensor-core matrix multiply (`wgmma.mma_async`, sm_90a): four warps (a
//! warpgroup, warps 4i..4i+3) multiply operands that lie in shared memory, described by 64-bit
//! matrix descriptors (`oxccl_bench_kernels::wgmma_shape::descriptor_sw128`), into f32 accumulators held in
//! their registers. The multiply runs asynchronously: the accumulators may be read, and the
//! operands' shared memory overwritten, only after a [`wgmma_wait_group_sync_aligned`] covers it.
//!
//! These serve the probe module's warpgroup GEMM, the overlap benchmark's Hopper-style tensor-core
//! load; the engine's movers do not use them.
//!
//! Accumulator layout of `m64nNk16` with f32 D (PTX ISA, "Matrix fragments for wgmma .m64nNk16"):
//! thread `t` of the warpgroup (warp `w = t / 32`, lane `l`) holds `d[4j + 0]`, `d[4j + 1]` at row
//! `16w + l / 4`, columns `8j + 2(l % 4)` and `+ 1`, and `d[4j + 2]`, `d[4j + 3]` at the same columns
//! of row `16w + l / 4 + 8`, for `j` in `0..N / 8`.

use core::arch::asm;

/// Expands to "{0}, {1}, …" for the listed operand numbers.
macro_rules! operand_list {
    ($first:literal $($rest:literal)*) => {
        concat!("{", stringify!($first), "}" $(, ", {", stringify!($rest), "}")*)
    };
}

/// Calls `$m!($args; 0 1 … 63)`: one number per register of a half of an m64n256 f32 D.
macro_rules! half {
    ($m:ident, $($args:tt)*) => {
        $m!($($args)*;
            0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31
            32 33 34 35 36 37 38 39 40 41 42 43 44 45 46 47 48 49 50 51 52 53 54 55 56 57 58 59 60 61 62 63)
    };
}

/// The 128 operand numbers of a whole m64n256 f32 D, as the instruction's register list.
macro_rules! d_operands {
    () => {
        operand_list!(
    0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31
    32 33 34 35 36 37 38 39 40 41 42 43 44 45 46 47 48 49 50 51 52 53 54 55 56 57 58 59 60 61 62 63
    64 65 66 67 68 69 70 71 72 73 74 75 76 77 78 79 80 81 82 83 84 85 86 87 88 89 90 91 92 93 94 95
    96 97 98 99 100 101 102 103 104 105 106 107 108 109 110 111 112 113 114 115 116 117 118 119 120 121 122 123 124 125 126 127
        )
    };
}

/// Orders this thread's register and shared-memory accesses before the warpgroup's next
/// `wgmma.mma_async` (needed before the first one and whenever the accumulators or the operands'
/// shared memory were touched since).
///
/// `wgmma.fence.sync.aligned;` · PTX ISA 8.0 · sm_90a
///
/// # Safety
/// Every thread of the warp executes it (`.sync.aligned`: not in a divergent branch).
#[doc(alias = "wgmma.fence")]
#[inline(always)]
pub unsafe fn wgmma_fence_sync_aligned() {
    // SAFETY: no operands; the caller guarantees a converged warp.
    unsafe { asm!("wgmma.fence.sync.aligned;") }
}

/// Closes the warpgroup's pending `wgmma.mma_async` operations into one group.
///
/// `wgmma.commit_group.sync.aligned;` · PTX ISA 8.0 · sm_90a
///
/// # Safety
/// Every thread of the warp executes it (`.sync.aligned`).
#[doc(alias = "wgmma.commit_group")]
#[inline(always)]
pub unsafe fn wgmma_commit_group_sync_aligned() {
    // SAFETY: no operands; the caller guarantees a converged warp.
    unsafe { asm!("wgmma.commit_group.sync.aligned;") }
}

/// Waits until at most `N` of the warpgroup's most recent `wgmma` groups are pending: the older
/// groups' accumulators are written and their operands read.
///
/// `wgmma.wait_group.sync.aligned N;` · PTX ISA 8.0 · sm_90a
///
/// # Safety
/// Every thread of the warp executes it (`.sync.aligned`). Reading the accumulators of a group it
/// covers also needs [`wgmma_fence_operands`] after it, so that the compiler does not move the
/// reads above the wait.
#[doc(alias = "wgmma.wait_group")]
#[inline(always)]
pub unsafe fn wgmma_wait_group_sync_aligned<const N: u32>() {
    // SAFETY: an immediate operand only; the caller guarantees a converged warp.
    unsafe { asm!("wgmma.wait_group.sync.aligned {n};", n = const N) }
}

/// An instruction that does nothing but read and write 64 accumulator registers: placed after
/// [`wgmma_wait_group_sync_aligned`] (once per half of the accumulators), no use of them can be
/// scheduled before the wait.
///
/// No PTX instruction (a PTX comment naming the registers, which are its operands).
#[inline(always)]
pub fn wgmma_fence_operands(acc: &mut [f32; 64]) {
    macro_rules! touch {
        ($acc:ident; $($i:literal)*) => {
            asm!(concat!("// ", operand_list!($($i)*)), $(inout(reg32) $acc[$i],)* options(nomem, nostack, preserves_flags))
        };
    }
    // SAFETY: a comment; the registers are left as they are.
    unsafe { half!(touch, acc) }
}

/// `wgmma.mma_async` m64n256k16 with f32 D over `$lo[0..64]`, then `$hi[0..64]` (operands 0–127).
macro_rules! mma_m64n256k16 {
    ($lo:ident, $hi:ident, $a:expr, $b:expr; $($i:literal)*) => {
        asm!(
            "{{ .reg .pred p; setp.ne.b32 p, {scale_d}, 0;",
            "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {{",
            d_operands!(),
            "}}, {a}, {b}, p, 1, 1, 0, 0; }}",
            $(inout(reg32) $lo[$i],)*
            $(inout(reg32) $hi[$i],)*
            a = in(reg64) $a,
            b = in(reg64) $b,
            scale_d = in(reg32) 1u32,
        )
    };
}

/// `acc + A · Bᵀ` for one warpgroup: A 64 × 16 and B 256 × 16 bf16, both K-major (each row's 16
/// elements contiguous) in shared memory as `a_desc` and `b_desc` describe them; the 64 × 256 f32
/// block in the layout of the module docs, `d[0..64]` in `lo` and `d[64..128]` in `hi` (columns
/// 0–127 and 128–255). Two arrays, because LLVM keeps an array of 128 `f32` that every such
/// instruction reads and writes in local memory, and two of 64 in registers. Asynchronous: part of
/// the warpgroup's next [`wgmma_commit_group_sync_aligned`] group.
///
/// `wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {d0, …, d127}, a-desc, b-desc, p, 1, 1, 0, 0;`
/// (`p`: scale D by 1, i.e. accumulate) · PTX ISA 8.0 · sm_90a
///
/// # Safety
/// - All four warps of the warpgroup execute it, converged, after a [`wgmma_fence_sync_aligned`]
///   that follows every write of the accumulators and of the operands' shared memory.
/// - The descriptors address operands in this CTA's shared memory, written and visible to the async
///   proxy (a completed tensor copy, or `fence.proxy.async` after generic writes), not overwritten
///   before a wait covers this operation.
/// - The accumulators are neither read nor written until a [`wgmma_wait_group_sync_aligned`]
///   covers this operation, followed by [`wgmma_fence_operands`] on each half.
#[doc(alias = "wgmma.mma_async")]
#[inline(always)]
pub unsafe fn wgmma_mma_async_sync_aligned_m64n256k16_f32_bf16_bf16(
    lo: &mut [f32; 64],
    hi: &mut [f32; 64],
    a_desc: u64,
    b_desc: u64,
) {
    // SAFETY: the caller guarantees the warpgroup, the descriptors and the accumulators' use.
    unsafe { half!(mma_m64n256k16, lo, hi, a_desc, b_desc) }
}
