//! Memory fences: proxy fences between the generic and async (TMA) proxies, and acquire-release fences
//! at CTA, GPU and system scope.

use core::arch::asm;

macro_rules! fence {
    ($(#[$doc:meta])* $name:ident, $text:literal, $isa:literal, $sm:literal) => {
        $(#[$doc])*
        ///
        #[doc = concat!("`", $text, ";` · PTX ISA ", $isa, " · ", $sm)]
        ///
        /// # Safety
        /// Always sound to execute; `unsafe` because callers rely on its placement for the soundness of
        /// the accesses it orders.
        #[doc(alias = $text)]
        #[inline(always)]
        pub unsafe fn $name() {
            // SAFETY: a fence has no operands.
            unsafe { asm!(concat!($text, ";")) }
        }
    };
}

fence!(
    /// Orders this thread's prior generic-proxy accesses to all state spaces before its subsequent
    /// async-proxy operations (bulk copies), and the other way round.
    fence_proxy_async, "fence.proxy.async", "8.0", "sm_90");
fence!(
    /// As [`fence_proxy_async`], for shared memory (`.shared::cta`) only: run by every thread that
    /// wrote shared memory with ordinary stores before a bulk copy reads it (then a CTA barrier).
    fence_proxy_async_shared_cta, "fence.proxy.async.shared::cta", "8.0", "sm_90");
fence!(
    /// As [`fence_proxy_async`], for global memory only: after `cp.async.bulk.wait_group 0` and before a
    /// release that publishes bulk writes; after an acquire and before bulk reads of what it published.
    fence_proxy_async_global, "fence.proxy.async.global", "8.0", "sm_90");
fence!(
    /// Acquire-release fence at CTA scope.
    fence_acq_rel_cta, "fence.acq_rel.cta", "6.0", "sm_70");
fence!(
    /// Acquire-release fence at GPU scope.
    fence_acq_rel_gpu, "fence.acq_rel.gpu", "6.0", "sm_70");
fence!(
    /// Acquire-release fence at system scope (peer GPUs and the host).
    fence_acq_rel_sys, "fence.acq_rel.sys", "6.0", "sm_70");
