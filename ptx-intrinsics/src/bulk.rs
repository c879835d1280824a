//! Non-tensor bulk copies and reductions on the Tensor Memory Accelerator, and their completion groups.
//!
//! All bulk addresses and sizes are multiples of 16 bytes. A global→shared copy completes on an
//! mbarrier (`complete_tx::bytes`); shared→global copies and reductions complete through bulk groups:
//! [`cp_async_bulk_commit_group`] closes a group, [`cp_async_bulk_wait_group_read`] waits until the
//! source shared memory of older groups may be reused, and [`cp_async_bulk_wait_group`] until their
//! writes are complete.

use crate::{Global, Mbarrier, Shared};
use core::arch::asm;

/// Copies `bytes` from global to this CTA's shared memory; completion is signalled on `bar` as
/// `bytes` transaction bytes.
///
/// `cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [dst], [src], size, [mbar];`
/// · PTX ISA 8.0 · sm_90
///
/// # Safety
/// - `dst`, `src` and `bytes` are multiples of 16; `dst..dst+bytes` lies in this CTA's shared memory and
///   `src..src+bytes` in readable global memory, neither written concurrently.
/// - `bar` is an initialised, live barrier whose current phase expects these bytes
///   (`mbarrier.arrive.expect_tx` by the issuing thread or another).
/// - `dst` may be read only after the phase completes (`mbarrier.try_wait.parity`). If `src` was written
///   by the generic proxy of another thread, order that write before this copy (acquire, then
///   `fence.proxy.async`).
#[doc(alias = "cp.async.bulk")]
#[inline(always)]
pub unsafe fn cp_async_bulk_shared_global_mbarrier(
    dst: Shared<u8>,
    src: Global<u8>,
    bytes: u32,
    bar: Shared<Mbarrier>,
) {
    // SAFETY: the caller guarantees alignment, bounds and the barrier's expectation.
    unsafe {
        asm!(
            "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [{d}], [{s}], {n}, [{b}];",
            d = in(reg32) dst.addr(),
            s = in(reg64) src.addr(),
            n = in(reg32) bytes,
            b = in(reg32) bar.addr()
        )
    }
}

/// Copies `bytes` from this CTA's shared memory to global memory, in the current bulk group.
///
/// `cp.async.bulk.global.shared::cta.bulk_group [dst], [src], size;` · PTX ISA 8.0 · sm_90
///
/// # Safety
/// - `dst`, `src` and `bytes` are multiples of 16; ranges in bounds; `src` was completely written before
///   the copy is issued (bulk loads: their mbarrier phase completed; generic stores: each writing thread
///   ran `fence.proxy.async.shared::cta`, then a CTA barrier).
/// - `src` must not be overwritten before `cp.async.bulk.wait_group.read` covers this copy's group, and
///   `dst` is complete only after `cp.async.bulk.wait_group` covers it.
#[doc(alias = "cp.async.bulk")]
#[inline(always)]
pub unsafe fn cp_async_bulk_global_shared_bulk_group(dst: Global<u8>, src: Shared<u8>, bytes: u32) {
    // SAFETY: the caller guarantees alignment, bounds and completion handling.
    unsafe {
        asm!(
            "cp.async.bulk.global.shared::cta.bulk_group [{d}], [{s}], {n};",
            d = in(reg64) dst.addr(),
            s = in(reg32) src.addr(),
            n = in(reg32) bytes
        )
    }
}

/// An L2 cache policy for the `.L2::cache_hint` forms of the bulk copies: the lines they touch
/// are the first the L2 evicts, so a stream of copies leaves the lines of other work (a GEMM's
/// operands beside a collective) in place.
///
/// `createpolicy.fractional.L2::evict_first.b64 policy, 1.0;` · PTX ISA 7.4 · sm_80
#[doc(alias = "createpolicy")]
#[inline(always)]
pub fn createpolicy_fractional_l2_evict_first() -> u64 {
    let p: u64;
    // SAFETY: computes a policy value in a register; touches no memory.
    unsafe {
        asm!("createpolicy.fractional.L2::evict_first.b64 {p}, 1.0;", p = out(reg64) p, options(pure, nomem, nostack))
    }
    p
}

/// As [`cp_async_bulk_shared_global_mbarrier`], with an L2 cache policy (from
/// [`createpolicy_fractional_l2_evict_first`]) for the lines it reads.
///
/// `cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [dst], [src], size, [mbar], policy;` · PTX ISA 8.0 · sm_90
///
/// # Safety
/// As [`cp_async_bulk_shared_global_mbarrier`]; `policy` was made by `createpolicy`.
#[doc(alias = "cp.async.bulk")]
#[inline(always)]
pub unsafe fn cp_async_bulk_shared_global_mbarrier_hint(
    dst: Shared<u8>,
    src: Global<u8>,
    bytes: u32,
    bar: Shared<Mbarrier>,
    policy: u64,
) {
    // SAFETY: the caller guarantees alignment, bounds, the barrier's expectation and the policy.
    unsafe {
        asm!(
            "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [{d}], [{s}], {n}, [{b}], {p};",
            d = in(reg32) dst.addr(),
            s = in(reg64) src.addr(),
            n = in(reg32) bytes,
            b = in(reg32) bar.addr(),
            p = in(reg64) policy
        )
    }
}

/// As [`cp_async_bulk_global_shared_bulk_group`], with an L2 cache policy for the lines it writes.
///
/// `cp.async.bulk.global.shared::cta.bulk_group.L2::cache_hint [dst], [src], size, policy;` · PTX ISA 8.0 · sm_90
///
/// # Safety
/// As [`cp_async_bulk_global_shared_bulk_group`]; `policy` was made by `createpolicy`.
#[doc(alias = "cp.async.bulk")]
#[inline(always)]
pub unsafe fn cp_async_bulk_global_shared_bulk_group_hint(dst: Global<u8>, src: Shared<u8>, bytes: u32, policy: u64) {
    // SAFETY: the caller guarantees alignment, bounds, completion handling and the policy.
    unsafe {
        asm!(
            "cp.async.bulk.global.shared::cta.bulk_group.L2::cache_hint [{d}], [{s}], {n}, {p};",
            d = in(reg64) dst.addr(),
            s = in(reg32) src.addr(),
            n = in(reg32) bytes,
            p = in(reg64) policy
        )
    }
}

macro_rules! cp_reduce_async_bulk {
    ($(#[$doc:meta])* $name:ident, $op_ty:literal, $isa:literal) => {
        $(#[$doc])*
        #[doc = concat!("`cp.reduce.async.bulk.global.shared::cta.bulk_group.", $op_ty, " [dst], [src], size;` · PTX ISA ", $isa, " · sm_90")]
        ///
        /// Each element of `dst` becomes `dst ⊕ src` (element-wise, atomic per element, relaxed at GPU
        /// scope); reductions from different copies to the same element may apply in any order.
        ///
        /// # Safety
        /// As [`cp_async_bulk_global_shared_bulk_group`]; additionally `dst` and `bytes` are multiples of
        /// the element size and `dst` holds elements of this type.
        #[doc(alias = "cp.reduce.async.bulk")]
        #[inline(always)]
        pub unsafe fn $name(dst: Global<u8>, src: Shared<u8>, bytes: u32) {
            // SAFETY: the caller guarantees alignment, bounds, type and completion handling.
            unsafe {
                asm!(
                    concat!("cp.reduce.async.bulk.global.shared::cta.bulk_group.", $op_ty, " [{d}], [{s}], {n};"),
                    d = in(reg64) dst.addr(),
                    s = in(reg32) src.addr(),
                    n = in(reg32) bytes
                )
            }
        }
    };
}

cp_reduce_async_bulk!(
    /// Bulk reduction, f32 add.
    cp_reduce_async_bulk_global_shared_add_f32, "add.f32", "8.0");
cp_reduce_async_bulk!(
    /// Bulk reduction, f64 add.
    cp_reduce_async_bulk_global_shared_add_f64, "add.f64", "8.0");
cp_reduce_async_bulk!(
    /// Bulk reduction, f16 add without flushing subnormals.
    cp_reduce_async_bulk_global_shared_add_noftz_f16, "add.noftz.f16", "8.0");
cp_reduce_async_bulk!(
    /// Bulk reduction, bf16 add without flushing subnormals.
    cp_reduce_async_bulk_global_shared_add_noftz_bf16, "add.noftz.bf16", "8.0");
cp_reduce_async_bulk!(
    /// Bulk reduction, u32 add (also s32: two's-complement addition is the same operation).
    cp_reduce_async_bulk_global_shared_add_u32, "add.u32", "8.0");
cp_reduce_async_bulk!(
    /// Bulk reduction, s32 add.
    cp_reduce_async_bulk_global_shared_add_s32, "add.s32", "8.0");
cp_reduce_async_bulk!(
    /// Bulk reduction, u64 add.
    cp_reduce_async_bulk_global_shared_add_u64, "add.u64", "8.0");
cp_reduce_async_bulk!(
    /// Bulk reduction, u32 minimum.
    cp_reduce_async_bulk_global_shared_min_u32, "min.u32", "8.0");
cp_reduce_async_bulk!(
    /// Bulk reduction, s32 minimum.
    cp_reduce_async_bulk_global_shared_min_s32, "min.s32", "8.0");
cp_reduce_async_bulk!(
    /// Bulk reduction, u64 minimum.
    cp_reduce_async_bulk_global_shared_min_u64, "min.u64", "8.0");
cp_reduce_async_bulk!(
    /// Bulk reduction, s64 minimum.
    cp_reduce_async_bulk_global_shared_min_s64, "min.s64", "8.0");
cp_reduce_async_bulk!(
    /// Bulk reduction, f16 minimum.
    cp_reduce_async_bulk_global_shared_min_f16, "min.f16", "8.0");
cp_reduce_async_bulk!(
    /// Bulk reduction, bf16 minimum.
    cp_reduce_async_bulk_global_shared_min_bf16, "min.bf16", "8.0");
cp_reduce_async_bulk!(
    /// Bulk reduction, u32 maximum.
    cp_reduce_async_bulk_global_shared_max_u32, "max.u32", "8.0");
cp_reduce_async_bulk!(
    /// Bulk reduction, s32 maximum.
    cp_reduce_async_bulk_global_shared_max_s32, "max.s32", "8.0");
cp_reduce_async_bulk!(
    /// Bulk reduction, u64 maximum.
    cp_reduce_async_bulk_global_shared_max_u64, "max.u64", "8.0");
cp_reduce_async_bulk!(
    /// Bulk reduction, s64 maximum.
    cp_reduce_async_bulk_global_shared_max_s64, "max.s64", "8.0");
cp_reduce_async_bulk!(
    /// Bulk reduction, f16 maximum.
    cp_reduce_async_bulk_global_shared_max_f16, "max.f16", "8.0");
cp_reduce_async_bulk!(
    /// Bulk reduction, bf16 maximum.
    cp_reduce_async_bulk_global_shared_max_bf16, "max.bf16", "8.0");

/// Closes the current bulk group: every bulk store/reduction this thread issued since the last commit
/// joins one group that the wait instructions can name.
///
/// `cp.async.bulk.commit_group;` · PTX ISA 8.0 · sm_90
///
/// # Safety
/// Always sound to execute; `unsafe` because the waits that follow rely on where it is placed.
#[doc(alias = "cp.async.bulk.commit_group")]
#[inline(always)]
pub unsafe fn cp_async_bulk_commit_group() {
    // SAFETY: no operands.
    unsafe { asm!("cp.async.bulk.commit_group;") }
}

/// Waits until at most `N` of this thread's most recent bulk groups are pending, counting a group as
/// done when its writes to the destination are complete and visible to the executing thread.
///
/// `cp.async.bulk.wait_group N;` · PTX ISA 8.0 · sm_90
///
/// # Safety
/// Always sound to execute. Use `N = 0` before publishing completion to another thread or rank (then
/// `fence.proxy.async.global` and a release).
#[doc(alias = "cp.async.bulk.wait_group")]
#[inline(always)]
pub unsafe fn cp_async_bulk_wait_group<const N: u32>() {
    // SAFETY: an immediate operand only.
    unsafe { asm!("cp.async.bulk.wait_group {n};", n = const N) }
}

/// Waits until at most `N` of this thread's most recent bulk groups still read their shared-memory
/// source: the sources of older groups may then be overwritten. Their global writes may still be in
/// flight: never publish a completion flag after only this wait.
///
/// `cp.async.bulk.wait_group.read N;` · PTX ISA 8.0 · sm_90
///
/// # Safety
/// Always sound to execute; it orders nothing in global memory.
#[doc(alias = "cp.async.bulk.wait_group.read")]
#[inline(always)]
pub unsafe fn cp_async_bulk_wait_group_read<const N: u32>() {
    // SAFETY: an immediate operand only.
    unsafe { asm!("cp.async.bulk.wait_group.read {n};", n = const N) }
}

/// Most pending groups [`cp_async_bulk_wait_group_read_at_most`] tells apart.
pub const WAIT_GROUP_READ_MAX: u32 = 7;

/// [`cp_async_bulk_wait_group_read`] for a run-time `pending`: the instruction takes an
/// immediate, so this selects one of `N = 0..=WAIT_GROUP_READ_MAX`; a larger `pending` waits as
/// for [`WAIT_GROUP_READ_MAX`] (fewer groups left reading: stricter, never less safe).
///
/// `cp.async.bulk.wait_group.read N;` · PTX ISA 8.0 · sm_90
///
/// # Safety
/// As [`cp_async_bulk_wait_group_read`]: always sound to execute; it orders nothing in global memory.
#[doc(alias = "cp.async.bulk.wait_group.read")]
#[inline(always)]
pub unsafe fn cp_async_bulk_wait_group_read_at_most(pending: u32) {
    // SAFETY: immediate operands only.
    unsafe {
        match pending {
            0 => cp_async_bulk_wait_group_read::<0>(),
            1 => cp_async_bulk_wait_group_read::<1>(),
            2 => cp_async_bulk_wait_group_read::<2>(),
            3 => cp_async_bulk_wait_group_read::<3>(),
            4 => cp_async_bulk_wait_group_read::<4>(),
            5 => cp_async_bulk_wait_group_read::<5>(),
            6 => cp_async_bulk_wait_group_read::<6>(),
            _ => cp_async_bulk_wait_group_read::<WAIT_GROUP_READ_MAX>(),
        }
    }
}
