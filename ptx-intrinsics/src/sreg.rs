//! Special registers and warp election.

use core::arch::asm;

macro_rules! sreg32 {
    ($(#[$doc:meta])* $name:ident, $reg:literal, $isa:literal) => {
        $(#[$doc])*
        ///
        #[doc = concat!("`mov.u32 r, ", $reg, ";` · PTX ISA ", $isa, " · sm_20")]
        #[doc(alias = $reg)]
        #[inline(always)]
        pub fn $name() -> u32 {
            let r: u32;
            // SAFETY: reading a constant special register has no side effects.
            unsafe { asm!(concat!("mov.u32 {r}, ", $reg, ";"), r = out(reg32) r, options(pure, nomem, nostack)) }
            r
        }
    };
}

sreg32!(
    /// This thread's index in its CTA, x dimension.
    tid_x, "%tid.x", "1.0");
sreg32!(
    /// The CTA's size, x dimension.
    ntid_x, "%ntid.x", "1.0");
sreg32!(
    /// This CTA's index in the grid, x dimension.
    ctaid_x, "%ctaid.x", "1.0");
sreg32!(
    /// The grid's size in CTAs, x dimension.
    nctaid_x, "%nctaid.x", "1.0");
sreg32!(
    /// This thread's lane in its warp (0..32).
    laneid, "%laneid", "1.3");
sreg32!(
    /// Bytes of dynamic shared memory the launch gave this CTA (the `sharedMemBytes` of
    /// `cuLaunchKernel`): lets a kernel size its shared-memory ring from the launch alone.
    dynamic_smem_size, "%dynamic_smem_size", "4.1");

/// The SM this thread runs on (may change under preemption; for diagnostics only).
///
/// `mov.u32 r, %smid;` · PTX ISA 1.3 · sm_20
#[doc(alias = "%smid")]
#[inline(always)]
pub fn smid() -> u32 {
    let r: u32;
    // SAFETY: reading a special register; not `pure` since it may differ between reads.
    unsafe { asm!("mov.u32 {r}, %smid;", r = out(reg32) r, options(nomem, nostack)) }
    r
}

/// This thread's warp slot on its SM (may change under preemption; for diagnostics only).
///
/// `mov.u32 r, %warpid;` · PTX ISA 1.3 · sm_20
#[doc(alias = "%warpid")]
#[inline(always)]
pub fn warpid() -> u32 {
    let r: u32;
    // SAFETY: reading a special register; not `pure` since it may differ between reads.
    unsafe { asm!("mov.u32 {r}, %warpid;", r = out(reg32) r, options(nomem, nostack)) }
    r
}

/// The global nanosecond timer (coarse: it ticks in steps of about a microsecond on current GPUs).
///
/// `mov.u64 r, %globaltimer;` · PTX ISA 3.1 · sm_30
#[doc(alias = "%globaltimer")]
#[inline(always)]
pub fn globaltimer() -> u64 {
    let r: u64;
    // SAFETY: reading a special register; volatile (no `pure`): every read is a new time.
    unsafe { asm!("mov.u64 {r}, %globaltimer;", r = out(reg64) r, options(nomem, nostack)) }
    r
}

/// This SM's cycle counter (64 bits; per SM, so compare readings of one thread only).
///
/// `mov.u64 r, %clock64;` · PTX ISA 2.0 · sm_20
#[doc(alias = "%clock64")]
#[inline(always)]
pub fn clock64() -> u64 {
    let r: u64;
    // SAFETY: reading a special register; volatile (no `pure`): every read is a new count.
    unsafe { asm!("mov.u64 {r}, %clock64;", r = out(reg64) r, options(nomem, nostack)) }
    r
}

/// Elects one thread among the active lanes in `member_mask`; returns `true` in exactly one of them.
///
/// `elect.sync _|p, membermask;` · PTX ISA 8.0 · sm_90
///
/// # Safety
/// Every lane in `member_mask` executes this instruction convergently with the same mask.
#[doc(alias = "elect.sync")]
#[inline(always)]
pub unsafe fn elect_sync(member_mask: u32) -> bool {
    let elected: u32;
    // SAFETY: the caller guarantees convergence of the named lanes.
    unsafe {
        asm!(
            "{{ .reg .pred p; elect.sync _|p, {m}; selp.u32 {e}, 1, 0, p; }}",
            e = out(reg32) elected,
            m = in(reg32) member_mask,
            options(nomem, nostack)
        )
    }
    elected != 0
}
