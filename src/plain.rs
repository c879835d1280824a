//! Element types the collectives that only copy (AllGather, Broadcast, AllToAll) move byte for
//! byte: any plain type ([`Plain`]), moved as the widest unit the engine has that divides its size
//! (4-byte words, 2-byte halves or bytes), so that one set of copy kernels serves every type.

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, DeviceSlice, SyncOnDrop, sys};
use std::marker::PhantomData;
use std::sync::Arc;

/// A type the copying collectives move byte for byte: any [`bytemuck::Pod`] type cudarc can hold in
/// a buffer ([`DeviceRepr`]), as `f64`, `i64`, `i8`, or a `#[repr(C)]` struct of them. Collectives
/// that reduce take an [`Element`](crate::Element).
pub trait Plain: bytemuck::Pod + DeviceRepr + Send + Sync {}

impl<T: bytemuck::Pod + DeviceRepr + Send + Sync> Plain for T {}

/// Bytes of the unit a `T` is moved as: 4, 2 or 1, the largest that divides its size.
pub(crate) const fn unit_bytes<T>() -> usize {
    let s = std::mem::size_of::<T>();
    if s.is_multiple_of(4) {
        4
    } else if s.is_multiple_of(2) {
        2
    } else {
        1
    }
}

/// Runs `$body` with `$u` the unit type a `$t` is moved as (`u32`, `half::f16` or `u8`: element
/// types with copy kernels).
macro_rules! in_units {
    ($t:ty, |$u:ident| $body:block) => {
        match $crate::plain::unit_bytes::<$t>() {
            4 => {
                type $u = u32;
                $body
            }
            2 => {
                type $u = half::f16;
                $body
            }
            _ => {
                type $u = u8;
                $body
            }
        }
    };
}
pub(crate) use in_units;

/// A buffer of `T` read as a buffer of units `U` (the same bytes, `size_of::<T>() /
/// size_of::<U>()` units per element).
pub(crate) struct Units<'a, T, U, B> {
    inner: &'a B,
    _t: PhantomData<(T, U)>,
}

impl<'a, T, U, B> Units<'a, T, U, B> {
    pub(crate) fn new(inner: &'a B) -> Self {
        Units { inner, _t: PhantomData }
    }
}

/// Units of `U` in `len` elements of `T`.
fn units<T, U>(len: usize) -> usize {
    len * (std::mem::size_of::<T>() / std::mem::size_of::<U>())
}

impl<T, U, B: DeviceSlice<T>> DeviceSlice<U> for Units<'_, T, U, B> {
    fn len(&self) -> usize {
        units::<T, U>(self.inner.len())
    }
    fn stream(&self) -> &Arc<CudaStream> {
        self.inner.stream()
    }
}

impl<T, U, B: DevicePtr<T>> DevicePtr<U> for Units<'_, T, U, B> {
    fn device_ptr<'b>(&'b self, stream: &'b CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'b>) {
        self.inner.device_ptr(stream)
    }
}

/// A buffer of `T` written as a buffer of units `U` (see [`Units`]).
pub(crate) struct UnitsMut<'a, T, U, B> {
    inner: &'a mut B,
    _t: PhantomData<(T, U)>,
}

impl<'a, T, U, B> UnitsMut<'a, T, U, B> {
    pub(crate) fn new(inner: &'a mut B) -> Self {
        UnitsMut { inner, _t: PhantomData }
    }
}

impl<T, U, B: DeviceSlice<T>> DeviceSlice<U> for UnitsMut<'_, T, U, B> {
    fn len(&self) -> usize {
        units::<T, U>(self.inner.len())
    }
    fn stream(&self) -> &Arc<CudaStream> {
        self.inner.stream()
    }
}

impl<T, U, B: DevicePtr<T>> DevicePtr<U> for UnitsMut<'_, T, U, B> {
    fn device_ptr<'b>(&'b self, stream: &'b CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'b>) {
        self.inner.device_ptr(stream)
    }
}

impl<T, U, B: DevicePtrMut<T>> DevicePtrMut<U> for UnitsMut<'_, T, U, B> {
    fn device_ptr_mut<'b>(&'b mut self, stream: &'b CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'b>) {
        self.inner.device_ptr_mut(stream)
    }
}

#[cfg(test)]
mod tests {
    use super::unit_bytes;

    #[test]
    fn units_are_the_widest_that_divide_the_size() {
        #[derive(Clone, Copy)]
        #[repr(C)]
        struct Three([u8; 3]);
        #[derive(Clone, Copy)]
        #[repr(C)]
        struct Six([u16; 3]);
        assert_eq!(unit_bytes::<f64>(), 4);
        assert_eq!(unit_bytes::<i64>(), 4);
        assert_eq!(unit_bytes::<[f32; 3]>(), 4);
        assert_eq!(unit_bytes::<f32>(), 4);
        assert_eq!(unit_bytes::<half::bf16>(), 2);
        assert_eq!(unit_bytes::<Six>(), 2);
        assert_eq!(unit_bytes::<i8>(), 1);
        assert_eq!(unit_bytes::<Three>(), 1);
    }
}
