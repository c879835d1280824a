//! CTA barriers, sleeping and trapping.

use core::arch::asm;

/// Waits until `threads` threads (a multiple of 32, counted per warp) of this CTA reach named barrier
/// `id`; orders their prior shared and global accesses before their later ones (CTA scope).
///
/// `barrier.sync id, threads;` · PTX ISA 6.0 · sm_70
///
/// The CTA barriers here are the forms without `.aligned` (`bar.sync` is `barrier.sync.aligned`):
/// an inline-assembly barrier is not convergent to LLVM, which may copy it into both arms of a
/// branch, so that the threads of one warp reach different copies; the aligned forms make that
/// undefined (on an H200 the engine's kernels hung), the others count every copy as the barrier.
///
/// # Safety
/// Every warp that takes part executes it with the same `id` and `threads`, `id < 16`, and exactly
/// `threads / 32` warps take part; otherwise the CTA deadlocks.
#[doc(alias = "barrier.sync")]
#[inline(always)]
pub unsafe fn bar_sync(id: u32, threads: u32) {
    // SAFETY: the caller guarantees every participating warp arrives.
    unsafe { asm!("barrier.sync {i}, {n};", i = in(reg32) id, n = in(reg32) threads) }
}

/// Waits until all threads of this CTA reach barrier 0.
///
/// `barrier.sync 0;` · PTX ISA 6.0 · sm_70 (not `.aligned`: see [`bar_sync`])
///
/// # Safety
/// Every thread of the CTA executes it (it must not sit in a branch some threads skip).
#[doc(alias = "barrier.sync")]
#[inline(always)]
pub unsafe fn bar_sync_all() {
    // SAFETY: the caller guarantees every thread arrives.
    unsafe { asm!("barrier.sync 0;") }
}

/// Waits until every lane of `mask` in the executing warp reaches this point (the warp reconverges
/// there), with memory ordering among them.
///
/// `bar.warp.sync membermask;` · PTX ISA 6.0 · sm_70
///
/// # Safety
/// Every lane in `mask` executes this same instruction, the executing lane included; otherwise the
/// behaviour is undefined.
#[doc(alias = "bar.warp.sync")]
#[inline(always)]
pub unsafe fn bar_warp_sync(mask: u32) {
    // SAFETY: the caller guarantees that every lane of the mask arrives.
    unsafe { asm!("bar.warp.sync {m};", m = in(reg32) mask) }
}

/// Waits until all threads of this CTA reach barrier 0, and returns whether `pred` was true in any of
/// them: one decision every thread of the CTA shares, whatever any thread does after the barrier.
///
/// `barrier.red.or.pred p, 0, q;` · PTX ISA 6.0 · sm_70 (not `.aligned`: see [`bar_sync`])
///
/// # Safety
/// Every thread of the CTA executes it (it must not sit in a branch some threads skip).
#[doc(alias = "barrier.red")]
#[inline(always)]
pub unsafe fn bar_red_or_all(pred: bool) -> bool {
    let any: u32;
    // SAFETY: the caller guarantees every thread arrives; the predicates are local to the block.
    unsafe {
        asm!(
            "{{ .reg .pred q, p; setp.ne.u32 q, {x}, 0; barrier.red.or.pred p, 0, q; selp.u32 {r}, 1, 0, p; }}",
            x = in(reg32) pred as u32,
            r = out(reg32) any,
        )
    }
    any != 0
}

/// Waits until every grid this one depends on programmatically (the kernel before it in its stream,
/// where this one was launched with programmatic stream serialization) has completed and its
/// memory operations are visible; at once where there is none.
///
/// `griddepcontrol.wait;` · PTX ISA 7.8 · sm_90
///
/// # Safety
/// Always sound to execute; `unsafe` because callers rely on its placement for the soundness of
/// the accesses after it.
#[doc(alias = "griddepcontrol.wait")]
#[inline(always)]
pub unsafe fn griddepcontrol_wait() {
    // SAFETY: no operands.
    unsafe { asm!("griddepcontrol.wait;") }
}

/// Lets the grid launched after this one with programmatic stream serialization start (its CTAs
/// scheduled as resources allow) once every CTA of this grid has executed this or exited. It starts
/// early only: it still waits for this grid's completion at its `griddepcontrol.wait`.
///
/// `griddepcontrol.launch_dependents;` · PTX ISA 7.8 · sm_90
///
/// # Safety
/// Always sound to execute; the dependent's CTAs may then take resources this grid's other
/// launches (those it waits for) would need: callers trigger only once those are resident.
#[doc(alias = "griddepcontrol.launch_dependents")]
#[inline(always)]
pub unsafe fn griddepcontrol_launch_dependents() {
    // SAFETY: no operands.
    unsafe { asm!("griddepcontrol.launch_dependents;") }
}

/// Suspends the thread for about `ns` nanoseconds (at most 1 ms), giving its issue slots to other warps.
///
/// `nanosleep.u32 t;` · PTX ISA 6.3 · sm_70
#[doc(alias = "nanosleep")]
#[inline(always)]
pub fn nanosleep_u32(ns: u32) {
    // SAFETY: no memory is accessed; the sleep is only a hint.
    unsafe { asm!("nanosleep.u32 {t};", t = in(reg32) ns, options(nomem, nostack)) }
}

/// Aborts the kernel with an error the host sees as a launch failure.
///
/// `trap;` · PTX ISA 1.0 · sm_10
#[inline(always)]
pub fn trap() -> ! {
    // SAFETY: ends execution; nothing after it runs.
    unsafe { asm!("trap;", options(noreturn, nostack)) }
}
