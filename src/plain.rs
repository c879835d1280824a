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

/// The element type of the unit a `T` is moved as (one with copy kernels).
pub(crate) const fn unit_dtype<T>() -> crate::DType {
    unit_of(unit_bytes::<T>())
}

/// The element type with copy kernels of the unit a copy of `bytes`-byte elements moves (4, 2 or 1
/// bytes, the largest dividing it).
pub(crate) const fn unit_of(bytes: usize) -> crate::DType {
    if bytes.is_multiple_of(4) {
        crate::DType::U32
    } else if bytes.is_multiple_of(2) {
        crate::DType::F16
    } else {
        crate::DType::U8
    }
}

/// Runs `$body` with `$u` the unit type a `$t` is moved as (`u32`, `half::f16` or `u8`: element
/// types with copy kernels).
macro_rules! in_units {
    ($t:ty, |$u:ident| $body:block) => {{
        let per = std::mem::size_of::<$t>() / $crate::plain::unit_bytes::<$t>();
        let result = match $crate::plain::unit_bytes::<$t>() {
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
        };
        result.map_err(|e| $crate::plain::in_elements(e, per))
    }};
}
pub(crate) use in_units;

/// `e`, an error of a call made in units (`per` of them per element), with its counts told back
/// in elements (where they are whole elements, as every count the calls check
/// is once [`whole_blocks`] has passed).
pub(crate) fn in_elements(e: crate::Error, per: usize) -> crate::Error {
    use crate::Error;
    match e {
        Error::Length { what, rank, expected, got } if per > 1 && expected % per == 0 && got % per == 0 => {
            Error::Length { what, rank, expected: expected / per, got: got / per }
        }
        Error::MissingBuffer { what, rank, elements } if per > 1 && elements % per as u64 == 0 => {
            Error::MissingBuffer { what, rank, elements: elements / per as u64 }
        }
        e => e,
    }
}

/// Checks that each of `lens` (elements) splits into `ranks` whole blocks: in units a block could
/// otherwise cut an element between two ranks.
pub(crate) fn whole_blocks(
    lens: impl IntoIterator<Item = (usize, usize)>,
    ranks: usize,
    what: &'static str,
) -> crate::Result<()> {
    for (rank, len) in lens {
        if !len.is_multiple_of(ranks) {
            return Err(crate::Error::Length { what, rank, expected: len.next_multiple_of(ranks), got: len });
        }
    }
    Ok(())
}

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
    use super::{in_elements, unit_bytes, whole_blocks};
    use crate::Error;

    #[test]
    fn unit_counts_are_told_back_in_elements() {
        let e = in_elements(Error::Length { what: "receive buffer", rank: 2, expected: 12, got: 9 }, 3);
        assert!(matches!(e, Error::Length { rank: 2, expected: 4, got: 3, .. }), "{e:?}");
        let e = in_elements(Error::MissingBuffer { what: "broadcast send buffer", rank: 0, elements: 8 }, 2);
        assert!(matches!(e, Error::MissingBuffer { elements: 4, .. }), "{e:?}");
        // A count that is not whole elements stays as it is (no call checks one once the blocks
        // are whole).
        let e = in_elements(Error::Length { what: "buffer", rank: 0, expected: 10, got: 9 }, 3);
        assert!(matches!(e, Error::Length { expected: 10, got: 9, .. }), "{e:?}");
    }

    #[test]
    fn blocks_must_hold_whole_elements() {
        assert!(whole_blocks([(0, 8), (1, 12)], 4, "buffer").is_ok());
        // 6 elements on 4 ranks: in 3-byte units (18) no more divisible, but 2 elements on 3 ranks
        // would be (6 units): the elements are checked.
        let e = whole_blocks([(0, 8), (1, 6)], 4, "buffer").unwrap_err();
        assert!(matches!(e, Error::Length { rank: 1, expected: 8, got: 6, .. }), "{e:?}");
        assert!(whole_blocks([(0, 2)], 3, "buffer").is_err());
    }

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
