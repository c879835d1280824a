//! Warp-level tensor-core matrix multiply and the loads that feed it: `cp.async` (16-byte copies
//! global→shared by every thread, completed through their own groups), `ldmatrix` (8×8 b16 tiles
//! from shared memory into the fragment layout `mma` reads), and `mma.sync` m16n8k16 on bf16.
//!
//! These serve the tensor-core GEMM the overlap benchmark runs beside a collective; the engine's
//! movers use the bulk copies of [`crate::bulk`] instead.
//!
//! Fragment layouts (PTX ISA, "Matrix fragments for mma.m16n8k16"), for lane `l`, `g = l / 4`,
//! `t = l % 4`: A (16 × 16, row-major) `a[0]` = row g, columns 2t, 2t+1; `a[1]` row g+8; `a[2]` row g,
//! columns 2t+8, 2t+9; `a[3]` row g+8, columns 2t+8, 2t+9. B (16 × 8, "col": element (k, n) at
//! n·16 + k) `b[0]` = k 2t, 2t+1 of column g; `b[1]` k 2t+8, 2t+9. C/D (16 × 8 f32) `c[0], c[1]` row
//! g, columns 2t, 2t+1; `c[2], c[3]` row g+8. Two bf16 in one `u32`: the lower index in the low half.

use crate::{Global, Shared};
use core::arch::asm;

/// Copies 16 bytes from global to this CTA's shared memory asynchronously, bypassing L1 (`.cg`); the
/// copy belongs to the thread's next [`cp_async_commit_group`].
///
/// `cp.async.cg.shared.global [dst], [src], 16;` · PTX ISA 7.0 · sm_80
///
/// # Safety
/// - `dst` and `src` are 16-byte aligned and in bounds; `src` is not written while the copy runs.
/// - No thread still reads `dst` when the copy is issued (a CTA barrier after the last read of the
///   previous contents), and nobody writes it until the copy completes.
/// - `dst` may be read (by any thread) only after the executing thread's [`cp_async_wait_group`]
///   covers the copy's group and a CTA barrier follows it.
#[doc(alias = "cp.async")]
#[inline(always)]
pub unsafe fn cp_async_cg_shared_global_16(dst: Shared<u8>, src: Global<u8>) {
    // SAFETY: the caller guarantees alignment, bounds and completion handling.
    unsafe { asm!("cp.async.cg.shared.global [{d}], [{s}], 16;", d = in(reg32) dst.addr(), s = in(reg64) src.addr()) }
}

/// Closes the executing thread's pending `cp.async` copies into one group (possibly empty).
///
/// `cp.async.commit_group;` · PTX ISA 7.0 · sm_80
///
/// # Safety
/// Always sound to execute; `unsafe` because the waits that follow rely on where it is placed.
#[doc(alias = "cp.async.commit_group")]
#[inline(always)]
pub unsafe fn cp_async_commit_group() {
    // SAFETY: no operands.
    unsafe { asm!("cp.async.commit_group;") }
}

/// Waits until at most `N` of the executing thread's most recent `cp.async` groups are pending; the
/// older groups' shared-memory writes are then complete for this thread (other threads see them
/// after a CTA barrier).
///
/// `cp.async.wait_group N;` · PTX ISA 7.0 · sm_80
///
/// # Safety
/// Always sound to execute; `unsafe` because the reads that follow rely on where it is placed.
#[doc(alias = "cp.async.wait_group")]
#[inline(always)]
pub unsafe fn cp_async_wait_group<const N: u32>() {
    // SAFETY: an immediate operand only.
    unsafe { asm!("cp.async.wait_group {n};", n = const N) }
}

/// Loads four 8 × 8 matrices of 16-bit elements from shared memory, one per returned register:
/// lanes 8i..8i+7 give the addresses of matrix i's eight rows (16 bytes each), and lane `l` receives
/// row `l / 4`, elements 2(l % 4) and 2(l % 4) + 1 of each matrix.
///
/// `ldmatrix.sync.aligned.m8n8.x4.shared.b16 {d0, d1, d2, d3}, [addr];` · PTX ISA 6.5 · sm_75
///
/// # Safety
/// Every lane of the warp executes it (`.sync.aligned`: not in a divergent branch); each lane's `row`
/// is 16-byte aligned and in bounds, and the rows were written before a CTA barrier this warp passed.
#[doc(alias = "ldmatrix")]
#[inline(always)]
pub unsafe fn ldmatrix_sync_aligned_m8n8_x4_shared_b16(row: Shared<u8>) -> [u32; 4] {
    let (d0, d1, d2, d3): (u32, u32, u32, u32);
    // SAFETY: the caller guarantees a converged warp and valid, written row addresses.
    unsafe {
        asm!(
            "ldmatrix.sync.aligned.m8n8.x4.shared.b16 {{{d0}, {d1}, {d2}, {d3}}}, [{a}];",
            d0 = out(reg32) d0,
            d1 = out(reg32) d1,
            d2 = out(reg32) d2,
            d3 = out(reg32) d3,
            a = in(reg32) row.addr(),
        )
    }
    [d0, d1, d2, d3]
}

/// `d = a · b + c` on one warp's fragments: A 16 × 16 bf16 (row), B 16 × 8 bf16 (col), C and D
/// 16 × 8 f32 (layouts in the module docs).
///
/// `mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {d0..d3}, {a0..a3}, {b0, b1}, {c0..c3};` ·
/// PTX ISA 7.0 · sm_80
///
/// # Safety
/// Every lane of the warp executes it (`.sync.aligned`: not in a divergent branch).
#[doc(alias = "mma.sync")]
#[inline(always)]
pub unsafe fn mma_sync_aligned_m16n8k16_row_col_f32_bf16_bf16_f32(a: [u32; 4], b: [u32; 2], c: [f32; 4]) -> [f32; 4] {
    let (d0, d1, d2, d3): (f32, f32, f32, f32);
    // SAFETY: register operands only; the caller guarantees a converged warp.
    unsafe {
        asm!(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {{{d0}, {d1}, {d2}, {d3}}}, {{{a0}, {a1}, {a2}, {a3}}}, {{{b0}, {b1}}}, {{{c0}, {c1}, {c2}, {c3}}};",
            d0 = out(reg32) d0,
            d1 = out(reg32) d1,
            d2 = out(reg32) d2,
            d3 = out(reg32) d3,
            a0 = in(reg32) a[0],
            a1 = in(reg32) a[1],
            a2 = in(reg32) a[2],
            a3 = in(reg32) a[3],
            b0 = in(reg32) b[0],
            b1 = in(reg32) b[1],
            c0 = in(reg32) c[0],
            c1 = in(reg32) c[1],
            c2 = in(reg32) c[2],
            c3 = in(reg32) c[3],
            options(nomem, nostack),
        )
    }
    [d0, d1, d2, d3]
}
