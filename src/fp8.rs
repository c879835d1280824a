//! The FP8 element types: an FP8 value is its byte, as CUDA's `__nv_fp8_e4m3` and `__nv_fp8_e5m2`
//! and the `float8` crate hold it, so buffers of those types can be viewed as these
//! (`CudaSlice::transmute`) at no cost.

use oxccl_host::fp8::Fp8;
use oxccl_kernels::abi::DType;

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
    use oxccl_kernels::abi::RedOp;

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

    /// Bytes worked out by hand: rounding to nearest even and saturation at the largest finite
    /// value.
    #[test]
    fn host_combine_by_hand() {
        let e4 = |a: u8, b: u8, op| F8E4M3(a).reduce(F8E4M3(b), op).0;
        // 1 + 1 = 2; 1 + 2^-4 ties between 1 and 1.125 (to 1, even); 1.125 + 2^-4 ties between
        // 1.125 and 1.25 (to 1.25, even); 448 + 448 saturates to 448.
        assert_eq!(e4(0x38, 0x38, RedOp::Sum), 0x40);
        assert_eq!(e4(0x38, 0x18, RedOp::Sum), 0x38);
        assert_eq!(e4(0x39, 0x18, RedOp::Sum), 0x3A);
        assert_eq!(e4(0x7E, 0x7E, RedOp::Sum), 0x7E);
        assert_eq!(e4(0xFE, 0x7E, RedOp::Prod), 0xFE, "-448 × 448 saturates to -448");
        let e5 = |a: u8, b: u8, op| F8E5M2(a).reduce(F8E5M2(b), op).0;
        // 1 + 1 = 2; 57344 + 57344 saturates to 57344; min(-1, 2) = -1.
        assert_eq!(e5(0x3C, 0x3C, RedOp::Sum), 0x40);
        assert_eq!(e5(0x7B, 0x7B, RedOp::Sum), 0x7B);
        assert_eq!(e5(0xBC, 0x40, RedOp::Min), 0xBC);
    }

    /// The host verification runs FP8 where its reference is order-free (Max, Prod of 1s and 2s)
    /// and refuses sums, which round at each step.
    #[test]
    fn host_verify_refuses_fp8_sums() {
        use oxccl_host::compile::{Options, compile};
        use oxccl_host::exec::{ExecError, ExecOptions, verify};
        let program = oxccl_host::program::generators::Algorithm::RingAllReduce.generate(1, 4).unwrap();
        let plan = compile(&program, &Options::default()).unwrap();
        let opts = ExecOptions { micro_batches: 2, fifo_slots: plan.stats.fifo_slots_needed.max(1) };
        for op in [RedOp::Max, RedOp::Prod] {
            let report = verify::<F8E4M3>(&plan, op, 3, &opts).unwrap();
            assert_eq!(report.wrong, 0, "{op:?}");
        }
        for op in [RedOp::Sum, RedOp::Avg] {
            let e = verify::<F8E5M2>(&plan, op, 3, &opts).unwrap_err();
            assert!(matches!(e, ExecError::BadInput { .. }) && e.to_string().contains("FP8"), "{e}");
        }
    }
}
