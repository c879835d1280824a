//! Packed half-precision arithmetic for the SIMT reduction paths. Operands and results are two
//! elements in one `u32` (element 0 in the low half).

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
