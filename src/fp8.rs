//! The FP8 element types: an FP8 value is its byte, as CUDA's `__nv_fp8_e4m3` and `__nv_fp8_e5m2`
//! and the `float8` crate hold it, so buffers of those types can be viewed as these
//! (`CudaSlice::transmute`) at no cost.

use oxccl_host::fp8::Fp8;
use oxccl_kernels::abi::{DType, RedOp};

macro_rules! fp8_type {
    ($(#[$doc:meta])* $name:ident, $format:ident, $dtype:ident) => {
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

        impl oxccl_host::exec::Element for $name {
            const DTYPE: DType = DType::$dtype;
            /// Widened to f32, combined there, rounded back once, as the kernels combine.
            fn reduce(self, other: Self, op: RedOp) -> Self {
                let mut acc = self;
                oxccl_host::lowered::combine_into(DType::$dtype, op, bytemuck::bytes_of_mut(&mut acc), bytemuck::bytes_of(&other));
                acc
            }
            fn from_small(v: i32) -> Self {
                Self::from_f32(v as f32)
            }
        }
    };
}

fp8_type!(
    /// FP8 E4M3 (OCP "FN": 4 exponent bits, 3 mantissa bits, no infinities; largest finite 448).
    F8E4M3,
    E4M3,
    F8e4m3
);
fp8_type!(
    /// FP8 E5M2 (5 exponent bits, 2 mantissa bits; largest finite 57344).
    F8E5M2,
    E5M2,
    F8e5m2
);

#[cfg(test)]
mod tests {
    use super::*;
    use oxccl_host::exec::Element as _;

    /// The host combine of both FP8 types is the f32 result of the two values rounded once, for
    /// every operator (Avg combines as Sum): every non-NaN byte against every seventh.
    #[test]
    fn host_combine_is_the_f32_result_rounded_once() {
        macro_rules! check {
            ($t:ident) => {{
                let mut checked = 0;
                for a in (0..=255u8).map($t).filter(|v| !v.to_f32().is_nan()) {
                    for b in (0..=255u8).step_by(7).map($t).filter(|v| !v.to_f32().is_nan()) {
                        let (x, y) = (a.to_f32(), b.to_f32());
                        for (op, want) in [
                            (RedOp::Sum, x + y),
                            (RedOp::Avg, x + y),
                            (RedOp::Min, x.min(y)),
                            (RedOp::Max, x.max(y)),
                            (RedOp::Prod, x * y),
                        ] {
                            assert_eq!(a.reduce(b, op), $t::from_f32(want), "{a:?} {op:?} {b:?}");
                            checked += 1;
                        }
                    }
                }
                assert!(checked > 5 * 200 * 30, "{checked} combines checked");
            }};
        }
        check!(F8E4M3);
        check!(F8E5M2);
    }
}
