//! Scoped loads, stores, reductions and atomics on global memory (flags, counters), and the 16-byte
//! vector accesses the SIMT mover is built from.
//!
//! Ordering and scope are part of each name. `relaxed` forms order nothing: whoever uses them for
//! synchronisation must add the fence. `acquire` loads and `release` stores/reductions pair across
//! threads at the named scope (`gpu`: this GPU; `sys`: peer GPUs and the host too).

use crate::{Global, Shared};
use core::arch::asm;

macro_rules! load {
    ($(#[$doc:meta])* $name:ident, $ty:ty, $reg:ident, $text:literal) => {
        $(#[$doc])*
        ///
        #[doc = concat!("`", $text, " r, [addr];` · PTX ISA 6.0 · sm_70")]
        ///
        /// # Safety
        /// `addr` is a naturally aligned, readable global address.
        #[doc(alias = $text)]
        #[inline(always)]
        pub unsafe fn $name(addr: Global<$ty>) -> $ty {
            let v: $ty;
            // SAFETY: the caller guarantees the address.
            unsafe { asm!(concat!($text, " {v}, [{a}];"), v = out($reg) v, a = in(reg64) addr.addr()) }
            v
        }
    };
}

macro_rules! store {
    ($(#[$doc:meta])* $name:ident, $ty:ty, $reg:ident, $text:literal) => {
        $(#[$doc])*
        ///
        #[doc = concat!("`", $text, " [addr], v;` · PTX ISA 6.0 · sm_70")]
        ///
        /// # Safety
        /// `addr` is a naturally aligned, writable global address.
        #[doc(alias = $text)]
        #[inline(always)]
        pub unsafe fn $name(addr: Global<$ty>, v: $ty) {
            // SAFETY: the caller guarantees the address.
            unsafe { asm!(concat!($text, " [{a}], {v};"), a = in(reg64) addr.addr(), v = in($reg) v) }
        }
    };
}

load!(
    /// Relaxed load at GPU scope.
    ld_relaxed_gpu_u32, u32, reg32, "ld.relaxed.gpu.global.u32");
load!(
    /// Relaxed load at GPU scope.
    ld_relaxed_gpu_u64, u64, reg64, "ld.relaxed.gpu.global.u64");
load!(
    /// Relaxed load at system scope.
    ld_relaxed_sys_u32, u32, reg32, "ld.relaxed.sys.global.u32");
load!(
    /// Relaxed load at system scope.
    ld_relaxed_sys_u64, u64, reg64, "ld.relaxed.sys.global.u64");
load!(
    /// Acquire load at GPU scope.
    ld_acquire_gpu_u32, u32, reg32, "ld.acquire.gpu.global.u32");
load!(
    /// Acquire load at GPU scope.
    ld_acquire_gpu_u64, u64, reg64, "ld.acquire.gpu.global.u64");
load!(
    /// Acquire load at system scope: pairs with a peer's `st.release.sys` / `red.release.sys`.
    ld_acquire_sys_u32, u32, reg32, "ld.acquire.sys.global.u32");
load!(
    /// Acquire load at system scope.
    ld_acquire_sys_u64, u64, reg64, "ld.acquire.sys.global.u64");

store!(
    /// Relaxed store at GPU scope.
    st_relaxed_gpu_u32, u32, reg32, "st.relaxed.gpu.global.u32");
store!(
    /// Relaxed store at GPU scope.
    st_relaxed_gpu_u64, u64, reg64, "st.relaxed.gpu.global.u64");
store!(
    /// Relaxed store at system scope.
    st_relaxed_sys_u32, u32, reg32, "st.relaxed.sys.global.u32");
store!(
    /// Relaxed store at system scope.
    st_relaxed_sys_u64, u64, reg64, "st.relaxed.sys.global.u64");
store!(
    /// Release store at GPU scope.
    st_release_gpu_u32, u32, reg32, "st.release.gpu.global.u32");
store!(
    /// Release store at GPU scope.
    st_release_gpu_u64, u64, reg64, "st.release.gpu.global.u64");
store!(
    /// Release store at system scope: publishes this thread's prior writes to peers and the host.
    st_release_sys_u32, u32, reg32, "st.release.sys.global.u32");
store!(
    /// Release store at system scope.
    st_release_sys_u64, u64, reg64, "st.release.sys.global.u64");

macro_rules! red {
    ($(#[$doc:meta])* $name:ident, $ty:ty, $reg:ident, $text:literal) => {
        $(#[$doc])*
        ///
        #[doc = concat!("`", $text, " [addr], v;` · PTX ISA 6.0 · sm_70")]
        ///
        /// # Safety
        /// `addr` is a naturally aligned, writable global address.
        #[doc(alias = $text)]
        #[inline(always)]
        pub unsafe fn $name(addr: Global<$ty>, v: $ty) {
            // SAFETY: the caller guarantees the address.
            unsafe { asm!(concat!($text, " [{a}], {v};"), a = in(reg64) addr.addr(), v = in($reg) v) }
        }
    };
}

red!(
    /// Atomic add with release semantics at GPU scope, no result.
    red_release_gpu_add_u32, u32, reg32, "red.release.gpu.global.add.u32");
red!(
    /// Atomic add with release semantics at GPU scope, no result.
    red_release_gpu_add_u64, u64, reg64, "red.release.gpu.global.add.u64");
red!(
    /// Atomic add with release semantics at system scope, no result.
    red_release_sys_add_u32, u32, reg32, "red.release.sys.global.add.u32");
red!(
    /// Atomic add with release semantics at system scope, no result.
    red_release_sys_add_u64, u64, reg64, "red.release.sys.global.add.u64");

macro_rules! atom {
    ($(#[$doc:meta])* $name:ident, $ty:ty, $reg:ident, $text:literal) => {
        $(#[$doc])*
        ///
        #[doc = concat!("`", $text, " old, [addr], v;` · PTX ISA 6.0 · sm_70")]
        ///
        /// # Safety
        /// `addr` is a naturally aligned, writable global address.
        #[doc(alias = $text)]
        #[inline(always)]
        pub unsafe fn $name(addr: Global<$ty>, v: $ty) -> $ty {
            let old: $ty;
            // SAFETY: the caller guarantees the address.
            unsafe { asm!(concat!($text, " {o}, [{a}], {v};"), o = out($reg) old, a = in(reg64) addr.addr(), v = in($reg) v) }
            old
        }
    };
}

atom!(
    /// Relaxed atomic add at GPU scope; returns the previous value.
    atom_relaxed_gpu_add_u32, u32, reg32, "atom.relaxed.gpu.global.add.u32");
atom!(
    /// Relaxed atomic add at GPU scope; returns the previous value.
    atom_relaxed_gpu_add_u64, u64, reg64, "atom.relaxed.gpu.global.add.u64");
atom!(
    /// Acquire-release atomic add at system scope; returns the previous value.
    atom_acq_rel_sys_add_u32, u32, reg32, "atom.acq_rel.sys.global.add.u32");
atom!(
    /// Acquire-release atomic bitwise OR at system scope; returns the previous value. Two threads
    /// that each OR their own bit into one word settle who came first: the second sees the first's
    /// bit in the value it gets back.
    atom_acq_rel_sys_or_b64, u64, reg64, "atom.acq_rel.sys.global.or.b64");
atom!(
    /// As [`atom_acq_rel_sys_or_b64`] at GPU scope (every thread that uses the word runs on this GPU).
    atom_acq_rel_gpu_or_b64, u64, reg64, "atom.acq_rel.gpu.global.or.b64");

/// Acquire-release compare-and-swap at system scope: writes `value` where the word equals `compare`;
/// returns the previous value either way (equal to `compare` exactly when it wrote).
///
/// `atom.acq_rel.sys.global.cas.b64 old, [addr], compare, value;` · PTX ISA 6.0 · sm_70
///
/// # Safety
/// `addr` is a naturally aligned, writable global address.
#[doc(alias = "atom.acq_rel.sys.global.cas.b64")]
#[inline(always)]
pub unsafe fn atom_acq_rel_sys_cas_b64(addr: Global<u64>, compare: u64, value: u64) -> u64 {
    let old: u64;
    // SAFETY: the caller guarantees the address.
    unsafe {
        asm!(
            "atom.acq_rel.sys.global.cas.b64 {o}, [{a}], {c}, {v};",
            o = out(reg64) old,
            a = in(reg64) addr.addr(),
            c = in(reg64) compare,
            v = in(reg64) value
        )
    }
    old
}

/// Relaxed compare-and-swap at system scope: as [`atom_acq_rel_sys_cas_b64`] without ordering
/// other accesses. Several can be in flight at once; the caller orders what follows with a fence
/// (`fence.acq_rel.sys` after them makes them acquires, one fence for all).
///
/// `atom.relaxed.sys.global.cas.b64 old, [addr], compare, value;` · PTX ISA 6.0 · sm_70
///
/// # Safety
/// `addr` is a naturally aligned, writable global address.
#[doc(alias = "atom.relaxed.sys.global.cas.b64")]
#[inline(always)]
pub unsafe fn atom_relaxed_sys_cas_b64(addr: Global<u64>, compare: u64, value: u64) -> u64 {
    let old: u64;
    // SAFETY: the caller guarantees the address.
    unsafe {
        asm!(
            "atom.relaxed.sys.global.cas.b64 {o}, [{a}], {c}, {v};",
            o = out(reg64) old,
            a = in(reg64) addr.addr(),
            c = in(reg64) compare,
            v = in(reg64) value
        )
    }
    old
}

/// As [`atom_relaxed_sys_cas_b64`] at GPU scope (every thread that uses the word runs on this GPU).
///
/// `atom.relaxed.gpu.global.cas.b64 old, [addr], compare, value;` · PTX ISA 6.0 · sm_70
///
/// # Safety
/// `addr` is a naturally aligned, writable global address.
#[doc(alias = "atom.relaxed.gpu.global.cas.b64")]
#[inline(always)]
pub unsafe fn atom_relaxed_gpu_cas_b64(addr: Global<u64>, compare: u64, value: u64) -> u64 {
    let old: u64;
    // SAFETY: the caller guarantees the address.
    unsafe {
        asm!(
            "atom.relaxed.gpu.global.cas.b64 {o}, [{a}], {c}, {v};",
            o = out(reg64) old,
            a = in(reg64) addr.addr(),
            c = in(reg64) compare,
            v = in(reg64) value
        )
    }
    old
}

/// Four 32-bit words, the unit of the SIMT mover's 16-byte accesses.
pub type V4 = [u32; 4];

/// Loads 16 bytes from global memory (weak, no caching hint).
///
/// `ld.global.v4.u32 {a, b, c, d}, [addr];` · PTX ISA 1.0 · sm_20
///
/// # Safety
/// `addr` is 16-byte aligned and readable; no other thread writes it concurrently.
#[doc(alias = "ld.global.v4.u32")]
#[inline(always)]
pub unsafe fn ld_global_v4_u32(addr: Global<V4>) -> V4 {
    let (a, b, c, d): (u32, u32, u32, u32);
    // SAFETY: the caller guarantees the address.
    unsafe {
        asm!("ld.global.v4.u32 {{{a}, {b}, {c}, {d}}}, [{p}];",
            a = out(reg32) a, b = out(reg32) b, c = out(reg32) c, d = out(reg32) d, p = in(reg64) addr.addr())
    }
    [a, b, c, d]
}

/// Stores 16 bytes to global memory (weak).
///
/// `st.global.v4.u32 [addr], {a, b, c, d};` · PTX ISA 1.0 · sm_20
///
/// # Safety
/// `addr` is 16-byte aligned and writable; no other thread accesses it concurrently.
#[doc(alias = "st.global.v4.u32")]
#[inline(always)]
pub unsafe fn st_global_v4_u32(addr: Global<V4>, v: V4) {
    // SAFETY: the caller guarantees the address.
    unsafe {
        asm!("st.global.v4.u32 [{p}], {{{a}, {b}, {c}, {d}}};",
            p = in(reg64) addr.addr(), a = in(reg32) v[0], b = in(reg32) v[1], c = in(reg32) v[2], d = in(reg32) v[3])
    }
}

/// Loads 16 bytes from this CTA's shared memory.
///
/// `ld.shared.v4.u32 {a, b, c, d}, [addr];` · PTX ISA 1.0 · sm_20
///
/// # Safety
/// `addr` is 16-byte aligned, in this CTA's shared memory, and ordered after whatever wrote it (a CTA
/// barrier after generic stores, the mbarrier phase after bulk copies).
#[doc(alias = "ld.shared.v4.u32")]
#[inline(always)]
pub unsafe fn ld_shared_v4_u32(addr: Shared<V4>) -> V4 {
    let (a, b, c, d): (u32, u32, u32, u32);
    // SAFETY: the caller guarantees the address and ordering.
    unsafe {
        asm!("ld.shared.v4.u32 {{{a}, {b}, {c}, {d}}}, [{p}];",
            a = out(reg32) a, b = out(reg32) b, c = out(reg32) c, d = out(reg32) d, p = in(reg32) addr.addr())
    }
    [a, b, c, d]
}

/// Stores 16 bytes to this CTA's shared memory.
///
/// `st.shared.v4.u32 [addr], {a, b, c, d};` · PTX ISA 1.0 · sm_20
///
/// # Safety
/// `addr` is 16-byte aligned and in this CTA's shared memory; no bulk copy reads or writes it
/// concurrently. Before a bulk copy reads it: `fence.proxy.async.shared::cta` in this thread, then a
/// CTA barrier.
#[doc(alias = "st.shared.v4.u32")]
#[inline(always)]
pub unsafe fn st_shared_v4_u32(addr: Shared<V4>, v: V4) {
    // SAFETY: the caller guarantees the address and ordering.
    unsafe {
        asm!("st.shared.v4.u32 [{p}], {{{a}, {b}, {c}, {d}}};",
            p = in(reg32) addr.addr(), a = in(reg32) v[0], b = in(reg32) v[1], c = in(reg32) v[2], d = in(reg32) v[3])
    }
}

/// Loads one 32-bit word from this CTA's shared memory.
///
/// `ld.shared.u32 r, [addr];` · PTX ISA 1.0 · sm_20
///
/// # Safety
/// As [`ld_shared_v4_u32`], with 4-byte alignment.
#[doc(alias = "ld.shared.u32")]
#[inline(always)]
pub unsafe fn ld_shared_u32(addr: Shared<u32>) -> u32 {
    let v: u32;
    // SAFETY: the caller guarantees the address and ordering.
    unsafe { asm!("ld.shared.u32 {v}, [{p}];", v = out(reg32) v, p = in(reg32) addr.addr()) }
    v
}

/// Stores one 32-bit word to this CTA's shared memory.
///
/// `st.shared.u32 [addr], v;` · PTX ISA 1.0 · sm_20
///
/// # Safety
/// As [`st_shared_v4_u32`], with 4-byte alignment.
#[doc(alias = "st.shared.u32")]
#[inline(always)]
pub unsafe fn st_shared_u32(addr: Shared<u32>, v: u32) {
    // SAFETY: the caller guarantees the address and ordering.
    unsafe { asm!("st.shared.u32 [{p}], {v};", p = in(reg32) addr.addr(), v = in(reg32) v) }
}
