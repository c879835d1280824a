//! `mbarrier` instructions: shared-memory barriers that count thread arrivals and transaction bytes.
//!
//! A phase completes when the pending arrival count and the pending transaction count both reach zero;
//! waiters name the phase by its parity (0 for the first phase, 1 for the next, alternating).

use crate::{Mbarrier, Shared};
use core::arch::asm;

/// Initialises the barrier for `count` expected arrivals per phase, phase 0.
///
/// `mbarrier.init.shared::cta.b64 [addr], count;` · PTX ISA 7.8 (the `::cta` qualifier; plain `.shared` since 7.0) · sm_80
///
/// # Safety
/// - `bar` is an 8-byte-aligned address in this CTA's shared memory that no other thread uses
///   concurrently, and `1 <= count < 2^20`.
/// - The barrier is not live: never initialise a barrier another thread may still wait on or arrive at
///   (invalidate it with [`mbarrier_inval_shared_b64`] first, after every user is done).
/// - Before the async proxy uses it, make the initialisation visible with
///   [`fence_mbarrier_init_release_cluster`]; before another thread uses it, with that fence and a CTA
///   barrier (the initialising thread's own bulk copies, issued after the fence, need no barrier).
#[doc(alias = "mbarrier.init")]
#[inline(always)]
pub unsafe fn mbarrier_init_shared_b64(bar: Shared<Mbarrier>, count: u32) {
    // SAFETY: the caller guarantees the address and exclusivity (see `# Safety`).
    unsafe { asm!("mbarrier.init.shared::cta.b64 [{b}], {c};", b = in(reg32) bar.addr(), c = in(reg32) count) }
}

/// Invalidates the barrier so its memory may be reused or re-initialised.
///
/// `mbarrier.inval.shared::cta.b64 [addr];` · PTX ISA 7.8 (the `::cta` qualifier; plain `.shared` since 7.0) · sm_80
///
/// # Safety
/// `bar` is an initialised barrier in this CTA's shared memory on which no thread waits, no arrival is
/// pending and no bulk copy is still in flight.
#[doc(alias = "mbarrier.inval")]
#[inline(always)]
pub unsafe fn mbarrier_inval_shared_b64(bar: Shared<Mbarrier>) {
    // SAFETY: the caller guarantees the barrier is quiescent.
    unsafe { asm!("mbarrier.inval.shared::cta.b64 [{b}];", b = in(reg32) bar.addr()) }
}

/// Arrives once (release, CTA scope) and returns the phase state token.
///
/// `mbarrier.arrive.shared::cta.b64 state, [addr];` · PTX ISA 7.8 (the `::cta` qualifier; plain `.shared` since 7.0) · sm_80
///
/// # Safety
/// `bar` is an initialised barrier in this CTA's shared memory whose current phase still expects an
/// arrival from this thread.
#[doc(alias = "mbarrier.arrive")]
#[inline(always)]
pub unsafe fn mbarrier_arrive_shared_b64(bar: Shared<Mbarrier>) -> u64 {
    let state: u64;
    // SAFETY: the caller guarantees the barrier is initialised and expects this arrival.
    unsafe { asm!("mbarrier.arrive.shared::cta.b64 {s}, [{b}];", s = out(reg64) state, b = in(reg32) bar.addr()) }
    state
}

/// Arrives once and, in the same step, raises the current phase's expected transaction count by
/// `tx_bytes`; returns the phase state token.
///
/// `mbarrier.arrive.expect_tx.shared::cta.b64 state, [addr], tx_bytes;` · PTX ISA 8.0 · sm_90
///
/// # Safety
/// As [`mbarrier_arrive_shared_b64`]; `tx_bytes < 2^20`, and exactly `tx_bytes` bytes of bulk copies
/// completing on this barrier must be issued for this phase (or the phase never completes).
#[doc(alias = "mbarrier.arrive.expect_tx")]
#[inline(always)]
pub unsafe fn mbarrier_arrive_expect_tx_shared_b64(bar: Shared<Mbarrier>, tx_bytes: u32) -> u64 {
    let state: u64;
    // SAFETY: the caller guarantees the barrier is initialised and the byte count is honoured.
    unsafe {
        asm!(
            "mbarrier.arrive.expect_tx.shared::cta.b64 {s}, [{b}], {t};",
            s = out(reg64) state,
            b = in(reg32) bar.addr(),
            t = in(reg32) tx_bytes
        )
    }
    state
}

/// Raises the current phase's expected transaction count by `tx_bytes` without arriving.
///
/// `mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [addr], tx_bytes;` · PTX ISA 8.0 · sm_90
///
/// # Safety
/// As [`mbarrier_arrive_expect_tx_shared_b64`], and the phase must not have completed yet.
#[doc(alias = "mbarrier.expect_tx")]
#[inline(always)]
pub unsafe fn mbarrier_expect_tx_relaxed_cta_shared_b64(bar: Shared<Mbarrier>, tx_bytes: u32) {
    // SAFETY: the caller guarantees the barrier is initialised and the byte count is honoured.
    unsafe {
        asm!(
            "mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [{b}], {t};",
            b = in(reg32) bar.addr(),
            t = in(reg32) tx_bytes
        )
    }
}

/// Tests whether the phase with the given parity has completed, waiting a system-dependent time
/// first; returns `true` once it has (with acquire semantics at CTA scope).
///
/// `mbarrier.try_wait.parity.shared::cta.b64 p, [addr], parity;` · PTX ISA 7.8 · sm_90
///
/// # Safety
/// `bar` is an initialised barrier in this CTA's shared memory; `parity` is 0 or 1 and names the
/// current or the immediately preceding phase.
#[doc(alias = "mbarrier.try_wait.parity")]
#[inline(always)]
pub unsafe fn mbarrier_try_wait_parity_shared_b64(bar: Shared<Mbarrier>, parity: u32) -> bool {
    let done: u32;
    // SAFETY: the caller guarantees the barrier is initialised; the predicate is scoped to the block.
    unsafe {
        asm!(
            "{{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [{b}], {q}; selp.u32 {d}, 1, 0, p; }}",
            d = out(reg32) done,
            b = in(reg32) bar.addr(),
            q = in(reg32) parity
        )
    }
    done != 0
}

/// As [`mbarrier_try_wait_parity_shared_b64`], but lets the thread stay suspended up to
/// `suspend_ns` nanoseconds while the phase is incomplete: a waiting issuer then takes fewer issue
/// slots from warps computing on the same SM.
///
/// `mbarrier.try_wait.parity.shared::cta.b64 p, [addr], parity, suspendTimeHint;` · PTX ISA 7.8 · sm_90
///
/// # Safety
/// As [`mbarrier_try_wait_parity_shared_b64`].
#[doc(alias = "mbarrier.try_wait.parity")]
#[inline(always)]
pub unsafe fn mbarrier_try_wait_parity_suspend_shared_b64(bar: Shared<Mbarrier>, parity: u32, suspend_ns: u32) -> bool {
    let done: u32;
    // SAFETY: the caller guarantees the barrier is initialised; the predicate is scoped to the block.
    unsafe {
        asm!(
            "{{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [{b}], {q}, {h}; selp.u32 {d}, 1, 0, p; }}",
            d = out(reg32) done,
            b = in(reg32) bar.addr(),
            q = in(reg32) parity,
            h = in(reg32) suspend_ns
        )
    }
    done != 0
}

/// Makes prior `mbarrier.init`s of this thread visible to the other threads and to the async proxy
/// (release, cluster scope).
///
/// `fence.mbarrier_init.release.cluster;` · PTX ISA 8.0 · sm_90
///
/// # Safety
/// Always sound to execute; listed as `unsafe` with the other ordering primitives because callers rely
/// on it for the soundness of later bulk copies.
#[doc(alias = "fence.mbarrier_init")]
#[inline(always)]
pub unsafe fn fence_mbarrier_init_release_cluster() {
    // SAFETY: a fence has no operands.
    unsafe { asm!("fence.mbarrier_init.release.cluster;") }
}
