//! Element-wise reduction operators on 32-bit words: one type per (dtype, operator), so each mover
//! is monomorphised once per combination and the inner loops carry no branches.
//!
//! A word holds one 4-byte element, two 2-byte elements (element 0 in the low half) or four bytes.
//! The scalar paths hold a single 2-byte or 1-byte element in the low bits; the rest is then
//! don't-care.

use oxccl_ptx::arith::*;
use oxccl_ptx::memory::V4;

/// A reduction operator on words.
pub trait Combine {
    /// Whether [`Self::finish`] does anything (only Avg's does): the movers skip the step otherwise.
    const FINISHES: bool = false;

    /// Combines two words element-wise.
    fn word(a: u32, b: u32) -> u32;

    /// The parameter of [`Self::finish`] for results of `n ≥ 2` contributions each, computed once per
    /// task (never 0): Avg's divisor, or its reciprocal for the float types.
    #[inline(always)]
    fn finish_param(n: u32) -> u32 {
        n
    }

    /// The last step on a word of complete results, with the task's [`Self::finish_param`].
    #[inline(always)]
    fn finish(a: u32, _param: u32) -> u32 {
        a
    }

    /// [`Self::finish`] on a 16-byte vector.
    #[inline(always)]
    fn finish_vec(a: V4, param: u32) -> V4 {
        [Self::finish(a[0], param), Self::finish(a[1], param), Self::finish(a[2], param), Self::finish(a[3], param)]
    }

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
    ProdF32 => |a, b| (f32::from_bits(a) * f32::from_bits(b)).to_bits();
    ProdF16 => |a, b| mul_rn_f16x2(a, b);
    ProdBf16 => |a, b| mul_rn_bf16x2(a, b);
    ProdI32 => |a, b| a.wrapping_mul(b);
    // Four wrapping byte sums in one word: the low seven bits of each byte added without carries
    // between bytes, then each byte's top bit set from the two top bits and the carry into it.
    SumU8 => |a, b| ((a & 0x7f7f_7f7f).wrapping_add(b & 0x7f7f_7f7f)) ^ ((a ^ b) & 0x8080_8080);
}

/// Avg: the sum, then each complete result divided by its number of contributions `n`. The float
/// types multiply by `1/n` (f32, rounded to nearest; exact for powers of two), as NCCL's average
/// multiplies too: an IEEE division per element would cost registers the movers' loops need. f16
/// and bf16 sums are widened exactly to f32 for it and rounded to nearest once. The integers divide
/// the wrapped sum, truncating toward zero.
macro_rules! average {
    ($($name:ident: $sum:ident, |$n:ident| $param:expr, |$a:ident, $p:ident| $finish:expr;)+) => {$(
        #[doc = concat!("Operator `", stringify!($name), "`: [`", stringify!($sum), "`], then divided.")]
        pub struct $name;
        impl Combine for $name {
            const FINISHES: bool = true;
            #[inline(always)]
            fn word(a: u32, b: u32) -> u32 {
                $sum::word(a, b)
            }
            #[inline(always)]
            fn finish_param($n: u32) -> u32 {
                $param
            }
            #[inline(always)]
            fn finish($a: u32, $p: u32) -> u32 {
                $finish
            }
        }
    )+};
}

/// The bits of the f32 nearest `1/n`.
#[inline(always)]
fn reciprocal(n: u32) -> u32 {
    (1.0 / n as f32).to_bits()
}

average! {
    AvgF32: SumF32, |n| reciprocal(n), |a, r| (f32::from_bits(a) * f32::from_bits(r)).to_bits();
    AvgF16: SumF16, |n| reciprocal(n), |a, r| {
        let (lo, hi) = cvt_f32_f16x2(a);
        cvt_rn_f16x2_f32(lo * f32::from_bits(r), hi * f32::from_bits(r))
    };
    AvgBf16: SumBf16, |n| reciprocal(n), |a, r| {
        let r = f32::from_bits(r);
        cvt_rn_bf16x2_f32(f32::from_bits(a << 16) * r, f32::from_bits(a & 0xffff_0000) * r)
    };
    AvgI32: SumI32, |n| n, |a, n| (a as i32).checked_div(n as i32).map_or(a, |q| q as u32);
    AvgU32: SumI32, |n| n, |a, n| a.checked_div(n).unwrap_or(a);
}
