//! The FP8 element types: an FP8 value is its byte, as CUDA's `__nv_fp8_e4m3` and `__nv_fp8_e5m2`
//! and the `float8` crate hold it, so buffers of those types can be viewed as these
//! (`CudaSlice::transmute`) at no cost.

use oxccl_host::fp8::Fp8;

macro_rules! fp8_type {
    ($(#[$doc:meta])* $name:ident, $format:ident) => {
        $(#[$doc])*
        #[repr(transparent)]
        #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, bytemuck::Pod, bytemuck::Zeroable)]
        pub struct $name(pub u8);

        // SAFETY: a byte, valid for any bit pattern, as the device reads it.
        unsafe impl cudarc::driver::DeviceRepr for $name {}

        impl $name {
            /// `x` rounded to nearest even, magnitudes past the largest finite one saturated to it,
            /// as the kernels round their results.
            pub fn from_f32(x: f32) -> Self {
                $name(Fp8::$format.from_f32(x))
            }

            /// The value, exactly.
            pub fn to_f32(self) -> f32 {
                Fp8::$format.to_f32(self.0)
            }
        }
    };
}

fp8_type!(
    /// FP8 E4M3 (OCP "FN": 4 exponent bits, 3 mantissa bits, no infinities; largest finite 448).
    F8E4M3,
    E4M3
);
fp8_type!(
    /// FP8 E5M2 (5 exponent bits, 2 mantissa bits; largest finite 57344).
    F8E5M2,
    E5M2
);
