//! Integer helpers of the reduction operators that need no PTX, so that they are tested on the host.

/// `f` on each of the four bytes of two words (byte 0 the lowest). Shifts, not a byte array: an
/// array indexed per byte would live in local memory.
#[inline(always)]
pub fn bytewise(a: u32, b: u32, f: impl Fn(u8, u8) -> u8) -> u32 {
    let mut r = 0;
    let mut s = 0;
    while s < 32 {
        r |= (f((a >> s) as u8, (b >> s) as u8) as u32) << s;
        s += 8;
    }
    r
}

/// `a / n`, truncated, for `1 ≤ n < 2^16` (an Avg's divisor, [`crate::abi::Task::divisor`]), in
/// three 32-bit divisions: a 64-bit division inlined into every element of the movers' unrolled
/// loops makes them spill registers. `n = 0` is taken as 1.
#[inline(always)]
pub fn div_u64_small(a: u64, n: u32) -> u64 {
    let n = n.clamp(1, 0xffff);
    let (hi, lo) = ((a >> 32) as u32, a as u32);
    let (q2, r2) = (hi / n, hi % n);
    // r2 < n ≤ 2^16 - 1: each partial dividend is below n · 2^16, so each quotient fits 16 bits.
    let mid = (r2 << 16) | (lo >> 16);
    let (q1, r1) = (mid / n, mid % n);
    let q0 = ((r1 << 16) | (lo & 0xffff)) / n;
    (q2 as u64) << 32 | (q1 as u64) << 16 | q0 as u64
}

/// `a / n` on a two's-complement 64-bit `a`, truncated toward zero, as [`div_u64_small`].
#[inline(always)]
pub fn div_i64_small(a: u64, n: u32) -> u64 {
    let a = a as i64;
    let q = div_u64_small(a.unsigned_abs(), n);
    if a < 0 { q.wrapping_neg() } else { q }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytewise_applies_to_each_byte() {
        let a = u32::from_le_bytes([1, 200, 7, 255]);
        let b = u32::from_le_bytes([3, 100, 9, 1]);
        assert_eq!(bytewise(a, b, |x, y| x.wrapping_add(y)), u32::from_le_bytes([4, 44, 16, 0]));
        assert_eq!(bytewise(a, b, |x, y| (x as i8).min(y as i8) as u8), u32::from_le_bytes([1, 200, 7, 255]));
    }

    #[test]
    fn small_divisions_match_the_64_bit_ones() {
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let edges = [0, 1, u64::MAX, u64::MAX - 1, 1 << 63, (1 << 63) - 1, (1 << 63) + 1, 1 << 32, (1 << 32) - 1];
        for k in 0..200_000u32 {
            let n = match k % 4 {
                0 => 1 + k % 17,
                1 => 0xffff - k % 3,
                _ => 1 + (next() % 0xffff) as u32,
            };
            let a = if k < edges.len() as u32 * 8 { edges[(k / 8) as usize] } else { next() };
            assert_eq!(div_u64_small(a, n), a / n as u64, "{a} / {n}");
            assert_eq!(div_i64_small(a, n) as i64, a as i64 / n as i64, "{} / {n}", a as i64);
        }
    }
}
