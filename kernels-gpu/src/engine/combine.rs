//! Element-wise reduction operators: one type per (dtype, operator), so each mover is
//! monomorphised once per combination and the inner loops carry no branches.
//!
//! Vectors are 16 bytes: four words for the types of at most 4 bytes (a word holds one 4-byte
//! element, two 2-byte elements, element 0 in the low half, or four bytes), two 8-byte elements
//! otherwise. The scalar path holds one element in the low bits of a `u64`; the rest is
//! don't-care.

use crate::lanes::{bytewise, div_i64_small, div_u64_small};
use oxccl_ptx::arith::*;
use oxccl_ptx::memory::V4;

/// A reduction operator.
pub trait Combine {
    /// Whether [`Self::finish`] does anything (only Avg's does): the movers skip the step otherwise.
    const FINISHES: bool = false;

    /// Combines two elements held in the low bits of `a` and `b` (the element-by-element path); the
    /// bits above the element are don't-care.
    fn scalar(a: u64, b: u64) -> u64;

    /// Combines two 16-byte vectors element-wise.
    fn vec(a: V4, b: V4) -> V4;

    /// The parameter of [`Self::finish`] for results of `n ≥ 2` contributions each, computed once per
    /// task (never 0): Avg's divisor, or its reciprocal for the 4- and 2-byte float types.
    #[inline(always)]
    fn finish_param(n: u32) -> u32 {
        n
    }

    /// The last step on one complete result in the low bits of `a`, with [`Self::finish_param`].
    #[inline(always)]
    fn finish(a: u64, _param: u32) -> u64 {
        a
    }

    /// [`Self::finish`] on a 16-byte vector of complete results.
    #[inline(always)]
    fn finish_vec(a: V4, _param: u32) -> V4 {
        a
    }
}

/// The operator of a single-source move: never called (one source is a copy), so every mover has
/// one instantiation for copies whatever the kernel's operator.
pub struct Copy;
impl Combine for Copy {
    #[inline(always)]
    fn scalar(a: u64, _: u64) -> u64 {
        a
    }
    #[inline(always)]
    fn vec(a: V4, _: V4) -> V4 {
        a
    }
}

/// Operators on elements of at most 4 bytes, defined on 32-bit words: one 4-byte element, two
/// 2-byte elements (element 0 in the low half) or four bytes. A vector is four words; the scalar
/// path holds one element in the low bits.
macro_rules! words {
    ($($name:ident => |$a:ident, $b:ident| $body:expr;)+) => {$(
        #[doc = concat!("Operator `", stringify!($name), "`.")]
        pub struct $name;
        impl $name {
            #[inline(always)]
            fn word($a: u32, $b: u32) -> u32 {
                $body
            }
        }
        impl Combine for $name {
            #[inline(always)]
            fn scalar(a: u64, b: u64) -> u64 {
                Self::word(a as u32, b as u32) as u64
            }
            #[inline(always)]
            fn vec(a: V4, b: V4) -> V4 {
                [Self::word(a[0], b[0]), Self::word(a[1], b[1]), Self::word(a[2], b[2]), Self::word(a[3], b[3])]
            }
        }
    )+};
}

/// Operators on 8-byte elements: a vector is two elements, each in two words (low word first).
macro_rules! doubles {
    ($($name:ident => |$a:ident, $b:ident| $body:expr;)+) => {$(
        #[doc = concat!("Operator `", stringify!($name), "`.")]
        pub struct $name;
        impl Combine for $name {
            #[inline(always)]
            fn scalar($a: u64, $b: u64) -> u64 {
                $body
            }
            #[inline(always)]
            fn vec(a: V4, b: V4) -> V4 {
                let lo = Self::scalar(join(a[0], a[1]), join(b[0], b[1]));
                let hi = Self::scalar(join(a[2], a[3]), join(b[2], b[3]));
                [lo as u32, (lo >> 32) as u32, hi as u32, (hi >> 32) as u32]
            }
        }
    )+};
}

#[inline(always)]
fn join(lo: u32, hi: u32) -> u64 {
    lo as u64 | (hi as u64) << 32
}

words! {
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
    // Four wrapping byte sums in one word (signed and unsigned alike): the low seven bits of each
    // byte added without carries between bytes, then each byte's top bit set from the two top bits
    // and the carry into it.
    SumU8 => |a, b| ((a & 0x7f7f_7f7f).wrapping_add(b & 0x7f7f_7f7f)) ^ ((a ^ b) & 0x8080_8080);
    MinU8 => |a, b| bytewise(a, b, |x, y| x.min(y));
    MaxU8 => |a, b| bytewise(a, b, |x, y| x.max(y));
    MinI8 => |a, b| bytewise(a, b, |x, y| (x as i8).min(y as i8) as u8);
    MaxI8 => |a, b| bytewise(a, b, |x, y| (x as i8).max(y as i8) as u8);
    // The low byte of a product is the same for signed and unsigned bytes.
    ProdU8 => |a, b| bytewise(a, b, |x, y| x.wrapping_mul(y));
    SumE4m3 => |a, b| e4m3(a, b, |x, y| x + y);
    MinE4m3 => |a, b| e4m3(a, b, f32::min);
    MaxE4m3 => |a, b| e4m3(a, b, f32::max);
    ProdE4m3 => |a, b| e4m3(a, b, |x, y| x * y);
    SumE5m2 => |a, b| e5m2(a, b, |x, y| x + y);
    MinE5m2 => |a, b| e5m2(a, b, f32::min);
    MaxE5m2 => |a, b| e5m2(a, b, f32::max);
    ProdE5m2 => |a, b| e5m2(a, b, |x, y| x * y);
}

/// `f` on the four FP8 values of two words: each pair widened exactly to f32, combined there and
/// rounded once to the format (nearest even, saturating at the largest finite magnitude), so a
/// result is the exactly rounded one as long as f32 holds the exact value (sums and products of
/// two E4M3 values; E5M2 sums whose exponents differ by more than 21 round twice, harmlessly: f32
/// carries more than twice E5M2's precision plus two bits).
#[inline(always)]
fn fp8(
    a: u32,
    b: u32,
    widen: impl Fn(u16) -> u32,
    narrow: impl Fn(f32, f32) -> u16,
    f: impl Fn(f32, f32) -> f32,
) -> u32 {
    let half = |x: u16, y: u16| {
        let (x0, x1) = cvt_f32_f16x2(widen(x));
        let (y0, y1) = cvt_f32_f16x2(widen(y));
        narrow(f(x0, y0), f(x1, y1)) as u32
    };
    half(a as u16, b as u16) | half((a >> 16) as u16, (b >> 16) as u16) << 16
}

#[inline(always)]
fn e4m3(a: u32, b: u32, f: impl Fn(f32, f32) -> f32) -> u32 {
    fp8(a, b, cvt_f16x2_e4m3x2, cvt_rn_satfinite_e4m3x2_f32, f)
}

#[inline(always)]
fn e5m2(a: u32, b: u32, f: impl Fn(f32, f32) -> f32) -> u32 {
    fp8(a, b, cvt_f16x2_e5m2x2, cvt_rn_satfinite_e5m2x2_f32, f)
}

doubles! {
    SumF64 => |a, b| (f64::from_bits(a) + f64::from_bits(b)).to_bits();
    MinF64 => |a, b| f64::from_bits(a).min(f64::from_bits(b)).to_bits();
    MaxF64 => |a, b| f64::from_bits(a).max(f64::from_bits(b)).to_bits();
    ProdF64 => |a, b| (f64::from_bits(a) * f64::from_bits(b)).to_bits();
    SumI64 => |a, b| a.wrapping_add(b);
    MinI64 => |a, b| (a as i64).min(b as i64) as u64;
    MaxI64 => |a, b| (a as i64).max(b as i64) as u64;
    MinU64 => |a, b| a.min(b);
    MaxU64 => |a, b| a.max(b);
    ProdI64 => |a, b| a.wrapping_mul(b);
}

/// Avg: the sum, then each complete result divided by its number of contributions `n`. The float
/// types multiply by `1/n` (rounded to nearest: f32's for f32, f16, bf16 and FP8, f64's for f64; exact
/// for powers of two), as NCCL's average multiplies too: an IEEE division per element would cost
/// registers the movers' loops need. f16 and bf16 sums are widened exactly to f32 for it and
/// rounded to nearest once. The integers divide the wrapped sum, truncating toward zero.
macro_rules! average {
    (words: $($name:ident: $sum:ident, |$n:ident| $param:expr, |$a:ident, $p:ident| $finish:expr;)+) => {$(
        #[doc = concat!("Operator `", stringify!($name), "`: [`", stringify!($sum), "`], then divided.")]
        pub struct $name;
        impl $name {
            #[inline(always)]
            fn finish_word($a: u32, $p: u32) -> u32 {
                $finish
            }
        }
        impl Combine for $name {
            const FINISHES: bool = true;
            #[inline(always)]
            fn scalar(a: u64, b: u64) -> u64 {
                $sum::scalar(a, b)
            }
            #[inline(always)]
            fn vec(a: V4, b: V4) -> V4 {
                $sum::vec(a, b)
            }
            #[inline(always)]
            fn finish_param($n: u32) -> u32 {
                $param
            }
            #[inline(always)]
            fn finish(a: u64, p: u32) -> u64 {
                Self::finish_word(a as u32, p) as u64
            }
            #[inline(always)]
            fn finish_vec(a: V4, p: u32) -> V4 {
                let f = |w| Self::finish_word(w, p);
                [f(a[0]), f(a[1]), f(a[2]), f(a[3])]
            }
        }
    )+};
    (doubles: $($name:ident: $sum:ident, |$a:ident, $p:ident| $finish:expr;)+) => {$(
        #[doc = concat!("Operator `", stringify!($name), "`: [`", stringify!($sum), "`], then divided.")]
        pub struct $name;
        impl Combine for $name {
            const FINISHES: bool = true;
            #[inline(always)]
            fn scalar(a: u64, b: u64) -> u64 {
                $sum::scalar(a, b)
            }
            #[inline(always)]
            fn vec(a: V4, b: V4) -> V4 {
                $sum::vec(a, b)
            }
            #[inline(always)]
            fn finish($a: u64, $p: u32) -> u64 {
                $finish
            }
            #[inline(always)]
            fn finish_vec(a: V4, p: u32) -> V4 {
                let lo = Self::finish(join(a[0], a[1]), p);
                let hi = Self::finish(join(a[2], a[3]), p);
                [lo as u32, (lo >> 32) as u32, hi as u32, (hi >> 32) as u32]
            }
        }
    )+};
}

/// The bits of the f32 nearest `1/n`.
#[inline(always)]
fn reciprocal(n: u32) -> u32 {
    (1.0 / n as f32).to_bits()
}

average! { words:
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
    AvgU8: SumU8, |n| n, |a, n| bytewise(a, 0, |x, _| (x as u32).checked_div(n).map_or(x, |q| q as u8));
    AvgI8: SumU8, |n| n, |a, n| {
        bytewise(a, 0, |x, _| (x as i8 as i32).checked_div(n as i32).map_or(x, |q| q as u8))
    };
    AvgE4m3: SumE4m3, |n| reciprocal(n), |a, r| e4m3(a, 0, |x, _| x * f32::from_bits(r));
    AvgE5m2: SumE5m2, |n| reciprocal(n), |a, r| e5m2(a, 0, |x, _| x * f32::from_bits(r));
}

// The parameter is the contribution count n (a finish parameter is 32 bits, too few for the f64
// nearest 1/n, which each element computes; n < 2^16 for the integer divisions).
average! { doubles:
    AvgF64: SumF64, |a, n| (f64::from_bits(a) * (1.0 / n as f64)).to_bits();
    AvgI64: SumI64, |a, n| div_i64_small(a, n);
    AvgU64: SumI64, |a, n| div_u64_small(a, n);
}
