//! Packed half-precision arithmetic and FP8 conversions for the register reduction paths. Packed
//! operands and results hold element 0 in the low half (or byte).

use core::arch::asm;

macro_rules! packed {
    ($(#[$doc:meta])* $name:ident, $text:literal, $isa:literal, $sm:literal) => {
        $(#[$doc])*
        ///
        #[doc = concat!("`", $text, " d, a, b;` · PTX ISA ", $isa, " · ", $sm)]
        #[doc(alias = $text)]
        #[inline(always)]
        pub fn $name(a: u32, b: u32) -> u32 {
            let d: u32;
            // SAFETY: register arithmetic only.
            unsafe { asm!(concat!($text, " {d}, {a}, {b};"), d = out(reg32) d, a = in(reg32) a, b = in(reg32) b, options(pure, nomem, nostack)) }
            d
        }
    };
}

packed!(
    /// Element-wise f16 add, round to nearest even (subnormals kept).
    add_rn_f16x2, "add.rn.f16x2", "4.2", "sm_53");
packed!(
    /// Element-wise bf16 add, round to nearest even.
    add_rn_bf16x2, "add.rn.bf16x2", "7.8", "sm_90");
packed!(
    /// Element-wise f16 minimum (if one operand is NaN, the other).
    min_f16x2, "min.f16x2", "7.0", "sm_80");
packed!(
    /// Element-wise f16 maximum (if one operand is NaN, the other).
    max_f16x2, "max.f16x2", "7.0", "sm_80");
packed!(
    /// Element-wise bf16 minimum (if one operand is NaN, the other).
    min_bf16x2, "min.bf16x2", "7.0", "sm_80");
packed!(
    /// Element-wise bf16 maximum (if one operand is NaN, the other).
    max_bf16x2, "max.bf16x2", "7.0", "sm_80");
packed!(
    /// Element-wise f16 multiply, round to nearest even.
    mul_rn_f16x2, "mul.rn.f16x2", "4.2", "sm_53");
packed!(
    /// Element-wise bf16 multiply, round to nearest even.
    mul_rn_bf16x2, "mul.rn.bf16x2", "7.8", "sm_90");

/// Both f16 halves of `a` as f32 (exact), the low half first.
///
/// `cvt.f32.f16 d, a;` twice · PTX ISA 1.0 · sm_20
#[doc(alias = "cvt.f32.f16")]
#[inline(always)]
pub fn cvt_f32_f16x2(a: u32) -> (f32, f32) {
    let (lo, hi): (f32, f32);
    // SAFETY: register arithmetic only.
    unsafe {
        asm!(
            "{{ .reg .b16 l, h; mov.b32 {{l, h}}, {a}; cvt.f32.f16 {lo}, l; cvt.f32.f16 {hi}, h; }}",
            a = in(reg32) a, lo = out(reg32) lo, hi = out(reg32) hi, options(pure, nomem, nostack)
        )
    }
    (lo, hi)
}

macro_rules! pack_f32 {
    ($(#[$doc:meta])* $name:ident, $text:literal, $isa:literal, $sm:literal) => {
        $(#[$doc])*
        ///
        #[doc = concat!("`", $text, " d, hi, lo;` · PTX ISA ", $isa, " · ", $sm)]
        #[doc(alias = $text)]
        #[inline(always)]
        pub fn $name(lo: f32, hi: f32) -> u32 {
            let d: u32;
            // SAFETY: register arithmetic only.
            unsafe { asm!(concat!($text, " {d}, {hi}, {lo};"), d = out(reg32) d, hi = in(reg32) hi, lo = in(reg32) lo, options(pure, nomem, nostack)) }
            d
        }
    };
}

pack_f32!(
    /// `lo` and `hi` rounded to f16 (nearest even) and packed, `lo` in the low half.
    cvt_rn_f16x2_f32, "cvt.rn.f16x2.f32", "7.0", "sm_80");
pack_f32!(
    /// `lo` and `hi` rounded to bf16 (nearest even) and packed, `lo` in the low half. (A bf16
    /// becomes an f32 exactly by a shift: no instruction needed the other way.)
    cvt_rn_bf16x2_f32, "cvt.rn.bf16x2.f32", "7.0", "sm_80");

macro_rules! widen_f8 {
    ($(#[$doc:meta])* $name:ident, $text:literal) => {
        $(#[$doc])*
        ///
        #[doc = concat!("`", $text, " d, a;` · PTX ISA 7.8 · sm_89")]
        #[doc(alias = $text)]
        #[inline(always)]
        pub fn $name(a: u16) -> u32 {
            let d: u32;
            // SAFETY: register arithmetic only.
            unsafe { asm!(concat!($text, " {d}, {a};"), d = out(reg32) d, a = in(reg16) a, options(pure, nomem, nostack)) }
            d
        }
    };
}

widen_f8!(
    /// Two FP8 E4M3 values (element 0 in the low byte) as f16x2 (exact; element 0 in the low half).
    cvt_f16x2_e4m3x2, "cvt.rn.f16x2.e4m3x2");
widen_f8!(
    /// Two FP8 E5M2 values (element 0 in the low byte) as f16x2 (exact; element 0 in the low half).
    cvt_f16x2_e5m2x2, "cvt.rn.f16x2.e5m2x2");

macro_rules! narrow_f8 {
    ($(#[$doc:meta])* $name:ident, $text:literal) => {
        $(#[$doc])*
        ///
        #[doc = concat!("`", $text, " d, hi, lo;` · PTX ISA 7.8 · sm_89")]
        #[doc(alias = $text)]
        #[inline(always)]
        pub fn $name(lo: f32, hi: f32) -> u16 {
            let d: u16;
            // SAFETY: register arithmetic only.
            unsafe { asm!(concat!($text, " {d}, {hi}, {lo};"), d = out(reg16) d, hi = in(reg32) hi, lo = in(reg32) lo, options(pure, nomem, nostack)) }
            d
        }
    };
}

narrow_f8!(
    /// `lo` and `hi` rounded to FP8 E4M3 (nearest even; magnitudes past 448 saturate to it, NaN stays
    /// NaN) and packed, `lo` in the low byte.
    cvt_rn_satfinite_e4m3x2_f32, "cvt.rn.satfinite.e4m3x2.f32");
narrow_f8!(
    /// `lo` and `hi` rounded to FP8 E5M2 (nearest even; magnitudes past 57344, infinities included,
    /// saturate to it, NaN stays NaN) and packed, `lo` in the low byte.
    cvt_rn_satfinite_e5m2x2_f32, "cvt.rn.satfinite.e5m2x2.f32");
