//! The SIMT data mover: every thread of the CTA moves 16-byte vectors, `UNROLL` independent loads in
//! flight per source; ranges whose ends are not 16-byte aligned, or whose buffers disagree in their
//! alignment, go element by element. The honest baseline for the TMA mover, and the path for the
//! unaligned heads and tails of TMA tasks.

use super::Ctx;
use super::combine::Combine;
use crate::abi::BUFFER_SLOTS;
use oxccl_ptx::Global;
use oxccl_ptx::memory::{V4, ld_global_v4_u32, st_global_v4_u32};

/// Independent 16-byte vectors per thread per round.
const UNROLL: u32 = 8;

/// A set of equally long byte ranges: an optional leading address, then `rank`'s buffer in `slot` at
/// `offset` for every rank in `mask`, in ascending rank order.
#[derive(Clone, Copy)]
pub struct AddrSet {
    /// A leading range (0: none).
    pub first: u64,
    /// The ranks whose buffers are ranges, one bit per rank.
    pub mask: u32,
    /// The buffer slot of those ranks' ranges.
    pub slot: u8,
    /// Byte offset of every rank's range within its buffer.
    pub offset: u64,
}

impl AddrSet {
    /// Number of ranges.
    #[inline(always)]
    pub fn count(&self) -> u32 {
        (self.first != 0) as u32 + self.mask.count_ones()
    }

    /// The start address of every range, in order.
    #[inline(always)]
    pub fn iter(&self, ctx: &Ctx) -> AddrIter {
        AddrIter { table: ctx.buffer_table(), first: self.first, mask: self.mask, slot: self.slot, offset: self.offset }
    }

    /// Start address of the first range.
    #[inline(always)]
    pub fn head(&self, ctx: &Ctx) -> u64 {
        if self.first != 0 { self.first } else { ctx.buffer(self.mask.trailing_zeros(), self.slot) + self.offset }
    }
}

/// Iterator over an [`AddrSet`]'s start addresses. It holds the buffer table's address, not the
/// [`Ctx`]: a context reference kept in a value that outlives a loop pins the context in local memory.
pub struct AddrIter {
    table: *const u64,
    first: u64,
    mask: u32,
    slot: u8,
    offset: u64,
}

impl Iterator for AddrIter {
    type Item = u64;

    #[inline(always)]
    fn next(&mut self) -> Option<u64> {
        if self.first != 0 {
            let a = self.first;
            self.first = 0;
            return Some(a);
        }
        if self.mask == 0 {
            return None;
        }
        let r = self.mask.trailing_zeros();
        self.mask &= self.mask - 1;
        // SAFETY: as `Ctx::buffer` (the table outlives the CTA's walk; rank and slot are checked).
        Some(unsafe { *self.table.add(r as usize * BUFFER_SLOTS + self.slot as usize) } + self.offset)
    }
}

/// Sources, destinations and length of one move: every destination range receives the sources
/// combined in order.
#[derive(Clone, Copy)]
pub struct Operands {
    /// The ranges read and combined, in combining order.
    pub srcs: AddrSet,
    /// The ranges written, each with the combined sources.
    pub dsts: AddrSet,
    /// Length of every range, in bytes.
    pub bytes: u64,
    /// Nonzero: every result is complete, and the operator's last step ([`Combine::finish`], Avg's
    /// division) applies to it before it is stored, with this parameter
    /// ([`Combine::finish_param`] of the number of contributions).
    pub finish: u32,
}

impl Operands {
    /// The sub-range `[from, from + bytes)` of every range.
    #[inline(always)]
    pub fn window(&self, from: u64, bytes: u64) -> Operands {
        let shift =
            |s: AddrSet| AddrSet { first: if s.first != 0 { s.first + from } else { 0 }, offset: s.offset + from, ..s };
        Operands { srcs: shift(self.srcs), dsts: shift(self.dsts), bytes, finish: self.finish }
    }

    /// OR of every range's start address XOR the first source's, low 4 bits: zero when all ranges
    /// share their alignment modulo 16.
    #[inline(always)]
    pub fn misalignment(&self, ctx: &Ctx) -> u64 {
        let base = self.srcs.head(ctx);
        let mut mix = 0;
        for a in self.srcs.iter(ctx) {
            mix |= a ^ base;
        }
        for a in self.dsts.iter(ctx) {
            mix |= a ^ base;
        }
        mix & 15
    }

    /// Bytes before the first 16-byte boundary of the (commonly aligned) ranges.
    #[inline(always)]
    pub fn head_bytes(&self, ctx: &Ctx) -> u64 {
        ((16 - (self.srcs.head(ctx) & 15)) & 15).min(self.bytes)
    }
}

/// Moves `ops` with all threads of the CTA: vectors where alignment allows, elements elsewhere.
///
/// # Safety
/// Every range is in bounds of device memory this CTA may access, element-aligned for `elem`
/// (1, 2, 4 or 8 bytes), and `ops.bytes` is a multiple of `elem`; no other thread writes the sources
/// concurrently. Every thread of the CTA calls it with the same operands.
#[inline(always)]
pub unsafe fn run<C: Combine>(ctx: &Ctx, ops: &Operands, elem: u32) {
    // SAFETY: forwarded contract; the three windows partition the range.
    unsafe {
        if ops.misalignment(ctx) != 0 {
            elements::<C>(ctx, ops, elem);
            return;
        }
        let head = ops.head_bytes(ctx);
        let body = (ops.bytes - head) & !15;
        elements::<C>(ctx, &ops.window(0, head), elem);
        vectors::<C>(ctx, &ops.window(head, body));
        elements::<C>(ctx, &ops.window(head + body, ops.bytes - head - body), elem);
    }
}

/// Element-wise move (1-, 2-, 4- or 8-byte elements).
///
/// # Safety
/// As [`run`].
#[inline(always)]
pub unsafe fn elements<C: Combine>(ctx: &Ctx, ops: &Operands, elem: u32) {
    let n = ops.bytes / elem as u64;
    let mut i = ctx.tid as u64;
    while i < n {
        let at = i * elem as u64;
        let mut acc = 0u64;
        for (k, a) in ops.srcs.iter(ctx).enumerate() {
            // SAFETY: in bounds and element-aligned by the caller's contract.
            let v = unsafe { <u64 as Unit>::load(a + at, elem) };
            acc = if k == 0 { v } else { C::scalar(acc, v) };
        }
        if C::FINISHES && ops.finish != 0 {
            acc = C::finish(acc, ops.finish);
        }
        for a in ops.dsts.iter(ctx) {
            // SAFETY: as above.
            unsafe { <u64 as Unit>::store(a + at, elem, acc) };
        }
        i += ctx.threads as u64;
    }
}

/// 16-byte vector move; every range 16-byte aligned, `ops.bytes` a multiple of 16.
///
/// # Safety
/// As [`run`], with that alignment.
#[inline(always)]
pub unsafe fn vectors<C: Combine>(ctx: &Ctx, ops: &Operands) {
    let n = ops.bytes / 16;
    let t = ctx.threads as u64;
    let mut base = ctx.tid as u64;
    // Full rounds: UNROLL vectors per thread.
    while base + (UNROLL as u64 - 1) * t < n {
        // SAFETY: every index base + u t, u < UNROLL, is < n.
        unsafe { round::<C, { UNROLL as usize }>(ctx, ops, base, t) };
        base += UNROLL as u64 * t;
    }
    // The rest, one vector at a time.
    while base < n {
        // SAFETY: base < n.
        unsafe { round::<C, 1>(ctx, ops, base, t) };
        base += t;
    }
}

/// One round: vectors `base + u * stride` for `u < U`, every load of a source issued before any of
/// them is combined.
///
/// # Safety
/// Every vector index of the round is inside every range.
#[inline(always)]
unsafe fn round<C: Combine, const U: usize>(ctx: &Ctx, ops: &Operands, base: u64, stride: u64) {
    let step = 16 * stride;
    let mut acc: [V4; U] = [[0; 4]; U];
    for (k, a) in ops.srcs.iter(ctx).enumerate() {
        let p = a + 16 * base;
        let mut v: [V4; U] = [[0; 4]; U];
        for (u, x) in v.iter_mut().enumerate() {
            // SAFETY: 16-aligned and in bounds (caller's contract).
            *x = unsafe { ld_global_v4_u32(Global::<V4>::from_addr(p + u as u64 * step)) };
        }
        for u in 0..U {
            acc[u] = if k == 0 { v[u] } else { C::vec(acc[u], v[u]) };
        }
    }
    if C::FINISHES && ops.finish != 0 {
        for x in acc.iter_mut() {
            *x = C::finish_vec(*x, ops.finish);
        }
    }
    for a in ops.dsts.iter(ctx) {
        let p = a + 16 * base;
        for (u, x) in acc.iter().enumerate() {
            // SAFETY: as above.
            unsafe { st_global_v4_u32(Global::<V4>::from_addr(p + u as u64 * step), *x) };
        }
    }
}

/// Sources whose loads a thread of the latency mover has in flight together: a small move of up to
/// this many sources waits for memory once, not once per source.
const GATHER: usize = 8;

/// The latency mover: [`run`]'s ranges, each thread one vector (or element) at a time, with the
/// loads of up to [`GATHER`] sources issued before any is combined. A small move is bound by the
/// round trips to memory, and [`run`] makes one per source. Up to [`GATHER`] ranges a side (the
/// usual small move) are looked up once ([`Resolved`]).
///
/// # Safety
/// As [`run`].
#[inline(always)]
pub unsafe fn gathered<C: Combine>(ctx: &Ctx, ops: &Operands, elem: u32) {
    // SAFETY: forwarded contract; the three windows partition the range.
    unsafe {
        if ops.srcs.count() as usize <= GATHER && ops.dsts.count() as usize <= GATHER {
            let (srcs, dsts) = (Resolved::of(ctx, &ops.srcs), Resolved::of(ctx, &ops.dsts));
            let base = srcs.at[0];
            // Elements before and after a body of vectors; all elements where the ranges disagree
            // in their alignment. One instantiation per unit keeps the kernels small.
            let head = match srcs.misalignment(base) | dsts.misalignment(base) {
                0 => ((16 - (base & 15)) & 15).min(ops.bytes),
                _ => ops.bytes,
            };
            let body = (ops.bytes - head) & !15;
            let (tail_at, tail) = (head + body, ops.bytes - head - body);
            resolved::<C, u64>(ctx, &srcs, &dsts, [(0, head), (tail_at, tail)], ops.finish, elem);
            resolved::<C, V4>(ctx, &srcs, &dsts, [(head, body), (0, 0)], ops.finish, elem);
            return;
        }
        if ops.misalignment(ctx) != 0 {
            each::<C, u64>(ctx, ops, elem);
            return;
        }
        let head = ops.head_bytes(ctx);
        let body = (ops.bytes - head) & !15;
        each::<C, u64>(ctx, &ops.window(0, head), elem);
        each::<C, V4>(ctx, &ops.window(head, body), elem);
        each::<C, u64>(ctx, &ops.window(head + body, ops.bytes - head - body), elem);
    }
}

/// What a thread of the latency mover moves at a time: an element (1, 2, 4 or 8 bytes, held in a
/// `u64`; [`elements`] moves those too) or a 16-byte vector.
trait Unit: core::marker::Copy {
    const ZERO: Self;
    /// Bytes moved (for an element: `elem`).
    fn width(elem: u32) -> u64;
    /// # Safety
    /// `addr` is in bounds and aligned to the width.
    unsafe fn load(addr: u64, elem: u32) -> Self;
    /// # Safety
    /// As `load`.
    unsafe fn store(addr: u64, elem: u32, v: Self);
    fn combine<C: Combine>(a: Self, b: Self) -> Self;
    fn finish<C: Combine>(a: Self, param: u32) -> Self;
}

impl Unit for u64 {
    const ZERO: Self = 0;
    #[inline(always)]
    fn width(elem: u32) -> u64 {
        elem as u64
    }
    #[inline(always)]
    unsafe fn load(addr: u64, elem: u32) -> Self {
        // SAFETY: the caller's contract.
        unsafe {
            match elem {
                1 => *(addr as *const u8) as u64,
                2 => *(addr as *const u16) as u64,
                4 => *(addr as *const u32) as u64,
                _ => *(addr as *const u64),
            }
        }
    }
    #[inline(always)]
    unsafe fn store(addr: u64, elem: u32, v: Self) {
        // SAFETY: the caller's contract.
        unsafe {
            match elem {
                1 => *(addr as *mut u8) = v as u8,
                2 => *(addr as *mut u16) = v as u16,
                4 => *(addr as *mut u32) = v as u32,
                _ => *(addr as *mut u64) = v,
            }
        }
    }
    #[inline(always)]
    fn combine<C: Combine>(a: Self, b: Self) -> Self {
        C::scalar(a, b)
    }
    #[inline(always)]
    fn finish<C: Combine>(a: Self, param: u32) -> Self {
        C::finish(a, param)
    }
}

impl Unit for V4 {
    const ZERO: Self = [0; 4];
    #[inline(always)]
    fn width(_: u32) -> u64 {
        16
    }
    #[inline(always)]
    unsafe fn load(addr: u64, _: u32) -> Self {
        // SAFETY: the caller's contract.
        unsafe { ld_global_v4_u32(Global::<V4>::from_addr(addr)) }
    }
    #[inline(always)]
    unsafe fn store(addr: u64, _: u32, v: Self) {
        // SAFETY: the caller's contract.
        unsafe { st_global_v4_u32(Global::<V4>::from_addr(addr), v) }
    }
    #[inline(always)]
    fn combine<C: Combine>(a: Self, b: Self) -> Self {
        C::vec(a, b)
    }
    #[inline(always)]
    fn finish<C: Combine>(a: Self, param: u32) -> Self {
        C::finish_vec(a, param)
    }
}

/// Every unit of `ops` (whose length is a multiple of the unit's width, every range aligned to it),
/// unit `i` on thread `i` modulo the CTA's threads; the sources combined in order, as [`run`]
/// combines them (the same results, bit for bit).
///
/// # Safety
/// As [`run`].
#[inline(always)]
unsafe fn each<C: Combine, U: Unit>(ctx: &Ctx, ops: &Operands, elem: u32) {
    let width = U::width(elem);
    let n = ops.bytes / width;
    let mut i = ctx.tid as u64;
    while i < n {
        let at = i * width;
        let mut srcs = ops.srcs.iter(ctx);
        let mut acc = U::ZERO;
        let mut first = true;
        loop {
            // Up to GATHER loads issued, then combined: the indices are constants once the loops
            // unroll, so the batch stays in registers.
            let mut v = [U::ZERO; GATHER];
            let mut got = 0;
            for x in v.iter_mut() {
                if let Some(a) = srcs.next() {
                    // SAFETY: in bounds and aligned (the caller's contract).
                    *x = unsafe { U::load(a + at, elem) };
                    got += 1;
                }
            }
            for (j, &x) in v.iter().enumerate() {
                if j < got {
                    acc = if first { x } else { U::combine::<C>(acc, x) };
                    first = false;
                }
            }
            if got < GATHER {
                break;
            }
        }
        if C::FINISHES && ops.finish != 0 {
            acc = U::finish::<C>(acc, ops.finish);
        }
        for a in ops.dsts.iter(ctx) {
            // SAFETY: as above.
            unsafe { U::store(a + at, elem, acc) };
        }
        i += ctx.threads as u64;
    }
}

/// The start addresses of up to [`GATHER`] ranges, read from the buffer table once. A small move
/// otherwise looks every address up again in each pass (alignment, head, body, tail, every unit):
/// chains of shared-memory loads that the one busy warp of a small move cannot hide.
struct Resolved {
    /// The addresses, `n` of them first.
    at: [u64; GATHER],
    n: usize,
}

impl Resolved {
    /// The ranges of `set`, which has at most [`GATHER`].
    #[inline(always)]
    fn of(ctx: &Ctx, set: &AddrSet) -> Resolved {
        let mut it = set.iter(ctx);
        let (mut at, mut n) = ([0; GATHER], 0);
        // Constant indices once unrolled: the addresses stay in registers.
        for x in at.iter_mut() {
            if let Some(a) = it.next() {
                *x = a;
                n += 1;
            }
        }
        Resolved { at, n }
    }

    /// OR of every address XOR `base`, low 4 bits.
    #[inline(always)]
    fn misalignment(&self, base: u64) -> u64 {
        let mut mix = 0;
        for (j, &a) in self.at.iter().enumerate() {
            if j < self.n {
                mix |= a ^ base;
            }
        }
        mix & 15
    }
}

/// [`each`] on two windows `(from, bytes)` of ranges already [`Resolved`], as one run of units:
/// every source's load of a unit issued before any is combined, the sources combined in order.
///
/// # Safety
/// As [`run`], for the windows; the ranges are at most [`GATHER`] on each side.
#[inline(always)]
unsafe fn resolved<C: Combine, U: Unit>(
    ctx: &Ctx,
    srcs: &Resolved,
    dsts: &Resolved,
    windows: [(u64, u64); 2],
    finish: u32,
    elem: u32,
) {
    let width = U::width(elem);
    let first = windows[0].1 / width;
    let n = first + windows[1].1 / width;
    let mut i = ctx.tid as u64;
    while i < n {
        let at = if i < first { windows[0].0 + i * width } else { windows[1].0 + (i - first) * width };
        let mut v = [U::ZERO; GATHER];
        for (j, x) in v.iter_mut().enumerate() {
            if j < srcs.n {
                // SAFETY: in bounds and aligned (the caller's contract).
                *x = unsafe { U::load(srcs.at[j] + at, elem) };
            }
        }
        let mut acc = v[0];
        for (j, &x) in v.iter().enumerate().skip(1) {
            if j < srcs.n {
                acc = U::combine::<C>(acc, x);
            }
        }
        if C::FINISHES && finish != 0 {
            acc = U::finish::<C>(acc, finish);
        }
        for (j, &a) in dsts.at.iter().enumerate() {
            if j < dsts.n {
                // SAFETY: as above.
                unsafe { U::store(a + at, elem, acc) };
            }
        }
        i += ctx.threads as u64;
    }
}
