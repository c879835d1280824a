//! Address-space newtypes: shared and global addresses are different types, so one cannot be passed
//! where the other is expected.

use core::arch::asm;
use core::marker::PhantomData;

/// A 32-bit address in the executing CTA's shared-memory window (`.shared::cta`), pointing at a `T`.
///
/// Obtained from a generic pointer into shared memory with [`Shared::from_generic`]; arithmetic keeps it
/// in the shared window. Holding one proves nothing about alignment: each instruction's contract says
/// what it needs.
#[repr(transparent)]
pub struct Shared<T> {
    addr: u32,
    _ty: PhantomData<*mut T>,
}

impl<T> Clone for Shared<T> {
    #[inline(always)]
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for Shared<T> {}

impl<T> Shared<T> {
    /// Converts a generic pointer into shared memory to its shared-window address
    /// (`cvta.to.shared.u64` then `cvt.u32.u64`; PTX ISA 2.0 · sm_20).
    ///
    /// # Safety
    /// `ptr` must point into the executing CTA's shared memory (for example a pointer derived from
    /// `gpu_launch_sized_workgroup_mem`). A generic pointer to any other space gives a meaningless address.
    #[doc(alias = "cvta.to.shared")]
    #[inline(always)]
    pub unsafe fn from_generic(ptr: *mut T) -> Self {
        let addr: u32;
        // SAFETY: pure address arithmetic; no memory is accessed.
        unsafe {
            asm!(
                "{{ .reg .b64 s; cvta.to.shared.u64 s, {p}; cvt.u32.u64 {a}, s; }}",
                p = in(reg64) ptr as u64,
                a = out(reg32) addr,
                options(pure, nomem, nostack)
            );
        }
        Shared { addr, _ty: PhantomData }
    }

    /// The raw 32-bit shared-window address.
    #[inline(always)]
    pub fn addr(self) -> u32 {
        self.addr
    }

    /// The address `bytes` further on, viewed as a `U`.
    #[inline(always)]
    pub fn byte_add<U>(self, bytes: u32) -> Shared<U> {
        Shared { addr: self.addr.wrapping_add(bytes), _ty: PhantomData }
    }

    /// The address of element `n` after this one.
    #[inline(always)]
    pub fn add(self, n: u32) -> Self {
        self.byte_add(n.wrapping_mul(core::mem::size_of::<T>() as u32))
    }

    /// The same address viewed as another type.
    #[inline(always)]
    pub fn cast<U>(self) -> Shared<U> {
        self.byte_add(0)
    }
}

/// A pointer into global memory (`.global`), pointing at a `T`.
///
/// On sm_90 a generic address of global memory is numerically its global address; the wrapper keeps the
/// distinction in the type so shared addresses cannot be passed by mistake. Peer memory mapped through
/// peer access or IPC is global memory too.
#[repr(transparent)]
pub struct Global<T> {
    ptr: *mut T,
}

impl<T> Clone for Global<T> {
    #[inline(always)]
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for Global<T> {}

impl<T> Global<T> {
    /// Wraps a pointer the caller knows to address global memory (a device allocation, a peer mapping).
    #[inline(always)]
    pub fn new(ptr: *mut T) -> Self {
        Global { ptr }
    }

    /// Wraps a raw device address.
    #[inline(always)]
    pub fn from_addr(addr: u64) -> Self {
        Global { ptr: addr as *mut T }
    }

    /// The raw address.
    #[inline(always)]
    pub fn addr(self) -> u64 {
        self.ptr as u64
    }

    /// The underlying pointer.
    #[inline(always)]
    pub fn ptr(self) -> *mut T {
        self.ptr
    }

    /// The address `bytes` further on, viewed as a `U`.
    #[inline(always)]
    pub fn byte_add<U>(self, bytes: u64) -> Global<U> {
        Global { ptr: (self.ptr as u64).wrapping_add(bytes) as *mut U }
    }

    /// The address of element `n` after this one.
    #[inline(always)]
    pub fn add(self, n: u64) -> Self {
        self.byte_add(n.wrapping_mul(core::mem::size_of::<T>() as u64))
    }

    /// The same address viewed as another type.
    #[inline(always)]
    pub fn cast<U>(self) -> Global<U> {
        self.byte_add(0)
    }
}

/// The 8-byte object an `mbarrier` instruction operates on. It lives only in shared memory and is only
/// ever named as a `Shared<Mbarrier>`.
#[repr(C, align(8))]
pub struct Mbarrier(u64);

/// A 128-byte `CUtensorMap` built on the host (`cuTensorMapEncodeTiled`) and copied to global memory
/// before the launch. Kernels name it as a `Global<TensorMap>`: oxccl keeps tensor maps out of kernel
/// parameters.
#[repr(C, align(64))]
pub struct TensorMap([u64; 16]);
