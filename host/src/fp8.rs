//! The 8-bit float formats (OCP FP8 E4M3 "FN" and E5M2) as the engine reduces them: decoded to f32
//! exactly, results rounded to nearest even and saturated to the largest finite magnitude, as
//! `cvt.rn.satfinite.{e4m3x2,e5m2x2}.f32` does (NaN stays NaN; E5M2's infinities saturate too).

use std::sync::OnceLock;

/// An FP8 format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Fp8 {
    /// 4 exponent bits (bias 7), 3 mantissa bits, no infinities; largest finite 448.
    E4M3,
    /// 5 exponent bits (bias 15), 2 mantissa bits, IEEE-style infinities; largest finite 57344.
    E5M2,
}

/// The canonical NaN of both formats (sign clear, every exponent and mantissa bit set).
const NAN: u8 = 0x7f;

impl Fp8 {
    const fn mantissa_bits(self) -> u32 {
        match self {
            Fp8::E4M3 => 3,
            Fp8::E5M2 => 2,
        }
    }

    const fn bias(self) -> i32 {
        match self {
            Fp8::E4M3 => 7,
            Fp8::E5M2 => 15,
        }
    }

    /// Code of the largest finite magnitude (sign clear).
    const fn max_code(self) -> u8 {
        match self {
            Fp8::E4M3 => 0x7e,
            Fp8::E5M2 => 0x7b,
        }
    }

    /// The value of `code` (exact in f32).
    pub fn to_f32(self, code: u8) -> f32 {
        let sign = if code & 0x80 != 0 { -1.0 } else { 1.0 };
        let m_bits = self.mantissa_bits();
        let e = ((code & 0x7f) >> m_bits) as i32;
        let m = (code & ((1 << m_bits) - 1)) as i32;
        let top = (1 << (7 - m_bits)) - 1;
        match self {
            Fp8::E4M3 if e == top && m == (1 << m_bits) - 1 => return f32::NAN,
            Fp8::E5M2 if e == top => return if m == 0 { sign * f32::INFINITY } else { f32::NAN },
            _ => {}
        }
        let magnitude = if e == 0 {
            m as f32 * 2f32.powi(1 - self.bias() - m_bits as i32)
        } else {
            (1.0 + m as f32 / (1 << m_bits) as f32) * 2f32.powi(e - self.bias())
        };
        sign * magnitude
    }

    /// Every finite non-negative value, by code `0..=max_code` (increasing).
    fn magnitudes(self) -> &'static [f32] {
        static TABLES: [OnceLock<Vec<f32>>; 2] = [OnceLock::new(), OnceLock::new()];
        TABLES[self as usize].get_or_init(|| (0..=self.max_code()).map(|c| self.to_f32(c)).collect())
    }

    /// `x` rounded to nearest (ties to an even code, which is an even mantissa), magnitudes past the
    /// largest finite one (infinities included) saturated to it, NaN to NaN.
    pub fn from_f32(self, x: f32) -> u8 {
        if x.is_nan() {
            return NAN;
        }
        let sign = if x.is_sign_negative() { 0x80 } else { 0 };
        let a = x.abs();
        let table = self.magnitudes();
        // First code whose value is at least `a` (none: past the largest finite value).
        let hi = table.partition_point(|&v| v < a);
        let code = if hi == table.len() {
            self.max_code()
        } else if hi == 0 || table[hi] == a {
            hi as u8
        } else {
            let (below, above) = (a - table[hi - 1], table[hi] - a);
            if below < above || (below == above && (hi - 1) % 2 == 0) { hi as u8 - 1 } else { hi as u8 }
        };
        sign | code
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_code_decodes_and_encodes_back() {
        for f in [Fp8::E4M3, Fp8::E5M2] {
            for c in 0..=255u8 {
                let v = f.to_f32(c);
                if v.is_nan() {
                    assert_eq!(f.from_f32(v), NAN);
                } else if v.is_infinite() {
                    assert_eq!(f.from_f32(v), (c & 0x80) | f.max_code(), "{f:?} {c:#x}");
                } else {
                    assert_eq!(f.from_f32(v), c, "{f:?} {c:#x} = {v}");
                }
            }
        }
    }

    #[test]
    fn known_values_round_to_nearest_even_and_saturate() {
        let e4 = Fp8::E4M3;
        assert_eq!(e4.to_f32(0x7e), 448.0);
        assert_eq!(e4.to_f32(0x01), 2f32.powi(-9));
        assert_eq!(e4.to_f32(0x08), 2f32.powi(-6));
        // 17 lies halfway between 16 (mantissa 0) and 18 (mantissa 1): to 16.
        assert_eq!(e4.to_f32(e4.from_f32(17.0)), 16.0);
        // 19 lies halfway between 18 (odd) and 20 (even): to 20.
        assert_eq!(e4.to_f32(e4.from_f32(19.0)), 20.0);
        assert_eq!(e4.from_f32(1e6), 0x7e);
        assert_eq!(e4.from_f32(-1e6), 0xfe);
        assert_eq!(e4.from_f32(f32::INFINITY), 0x7e);
        assert_eq!(e4.from_f32(-0.0), 0x80);
        // Half the smallest subnormal is a tie with zero (even): zero.
        assert_eq!(e4.from_f32(2f32.powi(-10)), 0);
        let e5 = Fp8::E5M2;
        assert_eq!(e5.to_f32(0x7b), 57344.0);
        assert_eq!(e5.to_f32(0x7c), f32::INFINITY);
        assert_eq!(e5.to_f32(0x01), 2f32.powi(-16));
        assert_eq!(e5.from_f32(f32::NEG_INFINITY), 0xfb);
        assert_eq!(e5.to_f32(e5.from_f32(9.0)), 8.0);
        assert_eq!(e5.to_f32(e5.from_f32(11.0)), 12.0);
    }

    /// The same codes as the `float8` crate (a port of CUDA's host conversions in `cuda_fp8.hpp`,
    /// saturating to finite): every midpoint between neighbouring values and a float either side of
    /// it (the ties and the roundings next to them), and a sweep of magnitudes from 2^-20 to 2^20.
    #[test]
    fn rounding_agrees_with_cudas_host_conversion() {
        let check = |v: f32| {
            assert_eq!(Fp8::E4M3.from_f32(v), float8::F8E4M3::from_f32(v).to_bits(), "E4M3 {v:e}");
            assert_eq!(Fp8::E5M2.from_f32(v), float8::F8E5M2::from_f32(v).to_bits(), "E5M2 {v:e}");
        };
        for f in [Fp8::E4M3, Fp8::E5M2] {
            for w in f.magnitudes().windows(2) {
                let mid = (w[0] + w[1]) / 2.0;
                for v in [mid, f32::from_bits(mid.to_bits() - 1), f32::from_bits(mid.to_bits() + 1)] {
                    check(v);
                    check(-v);
                }
            }
        }
        let mut x = 0x2545_F491_4F6C_DD1Du64;
        for k in 0..400_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let unit = (x >> 40) as f32 / (1u64 << 23) as f32 - 1.0;
            check(unit * 2f32.powi(k % 41 - 20));
        }
        for v in [0.0, -0.0, f32::INFINITY, f32::NEG_INFINITY, f32::MAX, f32::MIN_POSITIVE, 1e-30] {
            check(v);
        }
    }
}
