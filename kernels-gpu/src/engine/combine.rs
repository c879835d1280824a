//! Element-wise reduction operators on 32-bit words: one type per (dtype, operator), so each mover
//! is monomorphised once per combination and the inner loops carry no branches.
//!
//! A word holds one 4-byte element or two 2-byte elements (element 0 in the low half). The scalar
//! paths hold a single 2-byte element in the low half; the high half is then don't-care.

use oxccl_ptx::arith::*;
use oxccl_ptx::memory::V4;

/// A reduction operator on words.
pub trait Combine {
    /// Combines two words element-wise.
    fn word(a: u32, b: u32) -> u32;

    /// Combines two 16-byte vectors element-wise.
    #[inline(always)]
    fn vec(a: V4, b: V4) -> V4 {
        [Self::word(a[0], b[0]), Self::word(a[1], b[1]), Self::word(a[2], b[2]), Self::word(a[3], b[3])]
    }
}

/// The operator of a single-source move: never called (one source is a copy), so every mover has
/// one instantiation for copies whatever the kernel's operator.
pub struct Copy;
impl Combine for Copy {
    #[inline(always)]
    fn word(a: u32, _: u32) -> u32 {
        a
    }
}

macro_rules! combine {
    ($($name:ident => |$a:ident, $b:ident| $body:expr;)+) => {$(
        #[doc = concat!("Operator `", stringify!($name), "`.")]
        pub struct $name;
        impl Combine for $name {
            #[inline(always)]
            fn word($a: u32, $b: u32) -> u32 {
                $body
            }
        }
    )+};
}

combine! {
    SumF32 => |a, b| (f32::from_bits(a) + f32::from_bits(b)).to_bits();
    MinF32 => |a, b| f32::from_bits(a).min(f32::from_bits(b)).to_bits();
    MaxF32 => |a, b| f32::from_bits(a).max(f32::from_bits(b)).to_bits();
    SumF16 => |a, b| add_rn_f16x2(a, b);
    MinF16 => |a, b| min_f16x2(a, b);
    MaxF16 => |a, b| max_f16x2(a, b);
    SumBf16 => |a, b| add_rn_bf16x2(a, b);
    MinBf16 => |a, b| min_bf16x2(a, b);
    MaxBf16 => |a, b| max_bf16x2(a, b);
    SumI32 => |a, b| a.wrapping_add(b);
    MinI32 => |a, b| (a as i32).min(b as i32) as u32;
    MaxI32 => |a, b| (a as i32).max(b as i32) as u32;
    MinU32 => |a, b| a.min(b);
    MaxU32 => |a, b| a.max(b);
}
