//! Probe kernels: each exercises one instruction family so that
//! - the golden-PTX test (`tests/ptx_golden.rs`) finds every wrapper's instruction text in the kernel
//!   named for it, assembled by `ptxas -arch=sm_90a`, and
//! - the GPU test (`tests/gpu_intrinsics.rs`) runs each family against a host expectation.
//!
//! Kernels take plain device addresses (`u64`) and write their observations to an `out` array.

use crate::arith::*;
use crate::bulk::*;
use crate::fence::*;
use crate::mbarrier::*;
use crate::memory::*;
use crate::mma::*;
use crate::sreg::*;
use crate::sync::*;
use crate::tensor::*;
use crate::{Global, Mbarrier, Shared, TensorMap};

/// Base of the dynamic shared memory, 128-byte aligned (tensor boxes need it).
#[repr(C, align(128))]
struct SmemBase([u8; 128]);

#[inline(always)]
fn smem() -> Shared<u8> {
    let base = core::intrinsics::gpu::gpu_launch_sized_workgroup_mem::<SmemBase>();
    // SAFETY: the pointer addresses this CTA's dynamic shared memory.
    unsafe { Shared::from_generic(base.cast::<u8>()) }
}

/// Layout of the probes' shared memory: an mbarrier at 0, data from 128.
const DATA: u32 = 128;

/// One thread initialises the barrier at the start of shared memory for one arrival and makes the
/// initialisation visible.
///
/// # Safety
/// `bar` is an 8-byte-aligned shared-memory word no barrier is live in; every thread of the CTA
/// calls this (it ends with a CTA barrier).
#[inline(always)]
unsafe fn init_barrier(bar: Shared<Mbarrier>) {
    // SAFETY: called by thread 0 only, before any other use of the barrier; followed by a CTA barrier.
    unsafe {
        if tid_x() == 0 {
            mbarrier_init_shared_b64(bar, 1);
            fence_mbarrier_init_release_cluster();
        }
        bar_sync_all();
    }
}

/// Spins until the phase with `parity` completes.
///
/// # Safety
/// `bar` is a live barrier (initialised and made visible, see [`init_barrier`]) whose phase
/// `parity` completes, or the thread spins for ever.
#[inline(always)]
unsafe fn wait(bar: Shared<Mbarrier>, parity: u32) {
    // SAFETY: forwarded contract: `bar` is live.
    while !unsafe { mbarrier_try_wait_parity_shared_b64(bar, parity) } {}
}

/// Special registers: `out[8 * tid + k]` = tid, ntid, ctaid, nctaid, laneid, smid, globaltimer, elected.
///
/// # Safety
/// The block is a whole number of warps (every lane runs `elect.sync` with the full mask); `out`
/// holds 8 u64 per thread of the grid.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn probe_sreg(out: u64) {
    let out = Global::<u64>::from_addr(out);
    let t = tid_x();
    // SAFETY: every lane of each warp executes elect.sync with the full mask, convergently.
    let elected = unsafe { elect_sync(u32::MAX) };
    let row = out.add(8 * (ctaid_x() * ntid_x() + t) as u64);
    let vals = [
        t as u64,
        ntid_x() as u64,
        ctaid_x() as u64,
        nctaid_x() as u64,
        laneid() as u64,
        smid() as u64,
        globaltimer(),
        elected as u64,
    ];
    for (k, v) in vals.into_iter().enumerate() {
        // SAFETY: the host sizes `out` for 8 words per thread.
        unsafe { *row.add(k as u64).ptr() = v };
    }
}

/// Shared-memory size: thread 0 of each CTA writes `%dynamic_smem_size` to `out[ctaid]`.
///
/// # Safety
/// `out` holds one u32 per CTA of the grid.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn probe_smem_size(out: u64) {
    if tid_x() == 0 {
        // SAFETY: the host sizes `out` for one word per CTA.
        unsafe { *Global::<u64>::from_addr(out).add(ctaid_x() as u64).ptr() = dynamic_smem_size() as u64 };
    }
}

/// mbarrier phases and transactions, one thread, the way the TMA pipeline uses them: phase 0 armed
/// by `arrive.expect_tx` and completed by a 64-byte bulk copy from `src`; phase 1 armed by
/// `expect_tx` plus `arrive.expect_tx` and completed by a second copy; then a plain `arrive` phase.
/// `out` = [phase 0 done before its copy, phase 0 done after, phase 1 done before its copy, phase 1
/// done after, first 8 bytes copied, phase 2 done after its arrive, arrive state != 0].
///
/// # Safety
/// One CTA of one thread with at least `DATA + 64` bytes of dynamic shared memory; `src` holds 64 bytes,
/// 16-byte aligned; `out` holds 7 u64.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn probe_mbarrier(out: u64, src: u64) {
    let out = Global::<u64>::from_addr(out);
    let bar = smem().cast::<Mbarrier>();
    let data = smem().byte_add(DATA);
    // SAFETY: one thread (launched with one) owns the barrier and the data region; `src` holds 64
    // readable, 16-aligned bytes; `out` 7 words.
    unsafe {
        init_barrier(bar);
        let _ = mbarrier_arrive_expect_tx_shared_b64(bar, 64);
        let p0_early = mbarrier_try_wait_parity_shared_b64(bar, 0);
        cp_async_bulk_shared_global_mbarrier(data, Global::from_addr(src), 64, bar);
        wait(bar, 0);
        let p0_done = mbarrier_try_wait_parity_shared_b64(bar, 0);
        mbarrier_expect_tx_relaxed_cta_shared_b64(bar, 32);
        let _ = mbarrier_arrive_expect_tx_shared_b64(bar, 32);
        let p1_early = mbarrier_try_wait_parity_shared_b64(bar, 1);
        cp_async_bulk_shared_global_mbarrier(data, Global::from_addr(src), 64, bar);
        while !mbarrier_try_wait_parity_suspend_shared_b64(bar, 1, 1000) {}
        let p1_done = mbarrier_try_wait_parity_shared_b64(bar, 1);
        let copied = ld_shared_u32(data.cast()) as u64 | (ld_shared_u32(data.byte_add(4)) as u64) << 32;
        let state = mbarrier_arrive_shared_b64(bar);
        wait(bar, 0);
        let p2_done = mbarrier_try_wait_parity_shared_b64(bar, 0);
        mbarrier_inval_shared_b64(bar);
        let vals = [
            p0_early as u64,
            p0_done as u64,
            p1_early as u64,
            p1_done as u64,
            copied,
            p2_done as u64,
            (state != 0) as u64,
        ];
        for (k, v) in vals.into_iter().enumerate() {
            *out.add(k as u64).ptr() = v;
        }
    }
}

/// Bulk copy global→shared→global of `bytes` (≤ 48 KiB - 128, multiple of 16), one thread.
///
/// # Safety
/// One CTA of one thread, with `DATA + bytes` bytes of dynamic shared memory; `bytes` is a multiple
/// of 16; `src` and `dst` hold `bytes`, 16-byte aligned, and do not overlap.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn probe_bulk_copy(dst: u64, src: u64, bytes: u32) {
    let bar = smem().cast::<Mbarrier>();
    // SAFETY: launched with one thread and enough dynamic shared memory; the host passes 16-aligned
    // addresses and a 16-multiple size.
    unsafe {
        init_barrier(bar);
        let _ = mbarrier_arrive_expect_tx_shared_b64(bar, bytes);
        cp_async_bulk_shared_global_mbarrier(smem().byte_add(DATA), Global::from_addr(src), bytes, bar);
        wait(bar, 0);
        cp_async_bulk_global_shared_bulk_group(Global::from_addr(dst), smem().byte_add(DATA), bytes);
        cp_async_bulk_commit_group();
        cp_async_bulk_wait_group_read::<0>();
        cp_async_bulk_wait_group::<0>();
        mbarrier_inval_shared_b64(bar);
    }
}

macro_rules! probe_reduce {
    ($($kernel:ident => $wrapper:ident),+ $(,)?) => {$(
        /// Loads `bytes` of `src` into shared memory and reduces them into `dst` with one bulk reduction.
        ///
        /// # Safety
        /// One CTA of one thread, with `DATA + bytes` bytes of dynamic shared memory; `src` and `dst` hold `bytes` (a multiple of 16) of the kernel's type, 16-byte
        /// aligned, and do not overlap.
        #[unsafe(no_mangle)]
        pub unsafe extern "ptx-kernel" fn $kernel(dst: u64, src: u64, bytes: u32) {
            let bar = smem().cast::<Mbarrier>();
            // SAFETY: as `probe_bulk_copy`; `dst` holds elements of the wrapper's type.
            unsafe {
                init_barrier(bar);
                let _ = mbarrier_arrive_expect_tx_shared_b64(bar, bytes);
                cp_async_bulk_shared_global_mbarrier(smem().byte_add(DATA), Global::from_addr(src), bytes, bar);
                wait(bar, 0);
                $wrapper(Global::from_addr(dst), smem().byte_add(DATA), bytes);
                cp_async_bulk_commit_group();
                cp_async_bulk_wait_group::<0>();
                mbarrier_inval_shared_b64(bar);
            }
        }
    )+};
}

probe_reduce!(
    probe_reduce_add_f32 => cp_reduce_async_bulk_global_shared_add_f32,
    probe_reduce_add_f64 => cp_reduce_async_bulk_global_shared_add_f64,
    probe_reduce_add_f16 => cp_reduce_async_bulk_global_shared_add_noftz_f16,
    probe_reduce_add_bf16 => cp_reduce_async_bulk_global_shared_add_noftz_bf16,
    probe_reduce_add_u32 => cp_reduce_async_bulk_global_shared_add_u32,
    probe_reduce_add_s32 => cp_reduce_async_bulk_global_shared_add_s32,
    probe_reduce_add_u64 => cp_reduce_async_bulk_global_shared_add_u64,
    probe_reduce_min_u32 => cp_reduce_async_bulk_global_shared_min_u32,
    probe_reduce_min_s32 => cp_reduce_async_bulk_global_shared_min_s32,
    probe_reduce_min_u64 => cp_reduce_async_bulk_global_shared_min_u64,
    probe_reduce_min_s64 => cp_reduce_async_bulk_global_shared_min_s64,
    probe_reduce_min_f16 => cp_reduce_async_bulk_global_shared_min_f16,
    probe_reduce_min_bf16 => cp_reduce_async_bulk_global_shared_min_bf16,
    probe_reduce_max_u32 => cp_reduce_async_bulk_global_shared_max_u32,
    probe_reduce_max_s32 => cp_reduce_async_bulk_global_shared_max_s32,
    probe_reduce_max_u64 => cp_reduce_async_bulk_global_shared_max_u64,
    probe_reduce_max_s64 => cp_reduce_async_bulk_global_shared_max_s64,
    probe_reduce_max_f16 => cp_reduce_async_bulk_global_shared_max_f16,
    probe_reduce_max_bf16 => cp_reduce_async_bulk_global_shared_max_bf16,
);

macro_rules! probe_tensor {
    ($($kernel:ident: $load:ident, $store:ident, $add:ident, $min:ident, $max:ident, ($($c:ident),+);)+) => {$(
        /// Loads the box at the given coordinates from `src_map`, then stores it into `dst_map` at the
        /// same coordinates and reduces it into `red_map` (op 0 add, 1 min, 2 max). `box_bytes` is the
        /// map's box size in bytes. One thread.
        ///
        /// # Safety
        /// One CTA of one thread with `DATA + box_bytes` bytes of dynamic shared memory (its data
        /// 128-byte aligned); the three maps are valid `CUtensorMap`s in global memory, 64-byte
        /// aligned, of the kernel's rank and one element type, each describing a buffer it may
        /// read or write, with `box_bytes` their box size.
        #[unsafe(no_mangle)]
        pub unsafe extern "ptx-kernel" fn $kernel(src_map: u64, dst_map: u64, red_map: u64, op: u32, box_bytes: u32, $($c: i32),+) {
            let bar = smem().cast::<Mbarrier>();
            let data = smem().byte_add(DATA);
            // SAFETY: the host builds the three maps for the same box shape, copies them to global
            // memory before the launch and gives enough dynamic shared memory for one box.
            unsafe {
                init_barrier(bar);
                let _ = mbarrier_arrive_expect_tx_shared_b64(bar, box_bytes);
                $load(data, Global::<TensorMap>::from_addr(src_map), $($c,)+ bar);
                wait(bar, 0);
                $store(Global::<TensorMap>::from_addr(dst_map), $($c,)+ data);
                match op {
                    0 => $add(Global::<TensorMap>::from_addr(red_map), $($c,)+ data),
                    1 => $min(Global::<TensorMap>::from_addr(red_map), $($c,)+ data),
                    _ => $max(Global::<TensorMap>::from_addr(red_map), $($c,)+ data),
                }
                cp_async_bulk_commit_group();
                cp_async_bulk_wait_group::<0>();
                mbarrier_inval_shared_b64(bar);
            }
        }
    )+};
}

probe_tensor! {
    probe_tensor_1d: cp_async_bulk_tensor_1d_shared_global_tile_mbarrier, cp_async_bulk_tensor_1d_global_shared_tile_bulk_group,
        cp_reduce_async_bulk_tensor_1d_global_shared_add_tile_bulk_group, cp_reduce_async_bulk_tensor_1d_global_shared_min_tile_bulk_group,
        cp_reduce_async_bulk_tensor_1d_global_shared_max_tile_bulk_group, (c0);
    probe_tensor_2d: cp_async_bulk_tensor_2d_shared_global_tile_mbarrier, cp_async_bulk_tensor_2d_global_shared_tile_bulk_group,
        cp_reduce_async_bulk_tensor_2d_global_shared_add_tile_bulk_group, cp_reduce_async_bulk_tensor_2d_global_shared_min_tile_bulk_group,
        cp_reduce_async_bulk_tensor_2d_global_shared_max_tile_bulk_group, (c0, c1);
    probe_tensor_3d: cp_async_bulk_tensor_3d_shared_global_tile_mbarrier, cp_async_bulk_tensor_3d_global_shared_tile_bulk_group,
        cp_reduce_async_bulk_tensor_3d_global_shared_add_tile_bulk_group, cp_reduce_async_bulk_tensor_3d_global_shared_min_tile_bulk_group,
        cp_reduce_async_bulk_tensor_3d_global_shared_max_tile_bulk_group, (c0, c1, c2);
    probe_tensor_4d: cp_async_bulk_tensor_4d_shared_global_tile_mbarrier, cp_async_bulk_tensor_4d_global_shared_tile_bulk_group,
        cp_reduce_async_bulk_tensor_4d_global_shared_add_tile_bulk_group, cp_reduce_async_bulk_tensor_4d_global_shared_min_tile_bulk_group,
        cp_reduce_async_bulk_tensor_4d_global_shared_max_tile_bulk_group, (c0, c1, c2, c3);
    probe_tensor_5d: cp_async_bulk_tensor_5d_shared_global_tile_mbarrier, cp_async_bulk_tensor_5d_global_shared_tile_bulk_group,
        cp_reduce_async_bulk_tensor_5d_global_shared_add_tile_bulk_group, cp_reduce_async_bulk_tensor_5d_global_shared_min_tile_bulk_group,
        cp_reduce_async_bulk_tensor_5d_global_shared_max_tile_bulk_group, (c0, c1, c2, c3, c4);
}

/// Scoped loads, stores, reductions and atomics. `flags` holds 10 u64 words, zeroed by the host.
/// Thread 0 writes `out[0..6]` and into `flags[9]` what a compare-and-swap that must fail (on
/// `flags[2]`, 13, expecting 999) returned; every thread adds to `flags[4]`, `flags[5]`, takes a
/// ticket from `flags[6]`, written to `out[8 + tid]`, adds 1 to `flags[8]` by compare-and-swap
/// until one succeeds, and ORs bit `tid % 64` into `out[6]`, adding 1 to `out[7]` where the value
/// it got back lacked that bit (so `out[7]` ends at min(threads, 64)).
///
/// # Safety
/// `flags` holds 10 u64, zeroed, and `out` `8 + threads` u64 of device memory (system-scope accesses
/// reach them); one CTA.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn probe_memory(flags: u64, out: u64) {
    let f = Global::<u64>::from_addr(flags);
    let out = Global::<u64>::from_addr(out);
    let t = tid_x();
    // SAFETY: the host zeroes 10 flag words and sizes `out` for 8 + ntid words; words 0..4 and 9 are
    // touched by thread 0 alone, 4..9 only through atomics.
    unsafe {
        if t == 0 {
            st_relaxed_gpu_u32(f.cast(), 11);
            st_release_gpu_u32(f.add(1).cast(), 12);
            st_relaxed_sys_u64(f.add(2), 13);
            st_release_sys_u64(f.add(3), 14);
            *out.ptr() = ld_relaxed_gpu_u32(f.cast()) as u64;
            *out.add(1).ptr() = ld_acquire_gpu_u32(f.add(1).cast()) as u64;
            *out.add(2).ptr() = ld_relaxed_sys_u64(f.add(2));
            *out.add(3).ptr() = ld_acquire_sys_u64(f.add(3));
            st_relaxed_gpu_u64(f.add(7), 15);
            st_relaxed_sys_u32(f.add(7).cast(), 16);
            st_release_gpu_u64(f.add(7), ld_relaxed_gpu_u64(f.add(7)) + 1);
            *out.add(4).ptr() = ld_acquire_gpu_u64(f.add(7));
            st_release_sys_u32(f.add(7).cast(), 17);
            *out.add(5).ptr() = ld_relaxed_sys_u32(f.add(7).cast()) as u64 + ld_acquire_sys_u32(f.add(7).cast()) as u64;
            *f.add(9).ptr() = atom_acq_rel_sys_cas_b64(f.add(2), 999, 1);
            // Compare values the words never hold, an OR of nothing: the words stay as they are.
            let _ = atom_relaxed_gpu_cas_b64(f.add(2), 998, 1);
            let _ = atom_acq_rel_gpu_or_b64(f.add(2), 0);
        }
        red_release_gpu_add_u32(f.add(4).cast(), 1);
        red_release_sys_add_u32(f.add(4).cast::<u32>().add(1), 2);
        red_release_gpu_add_u64(f.add(5), 3);
        red_release_sys_add_u64(f.add(5), 4);
        let ticket = atom_relaxed_gpu_add_u32(f.add(6).cast(), 1) as u64;
        let _ = atom_relaxed_gpu_add_u64(f.add(7), 0);
        let _ = atom_acq_rel_sys_add_u32(f.add(6).cast::<u32>().add(1), 1);
        *out.add(8 + t as u64).ptr() = ticket;
        let mut seen = ld_relaxed_sys_u64(f.add(8));
        loop {
            let old = atom_relaxed_sys_cas_b64(f.add(8), seen, seen + 1);
            if old == seen {
                break;
            }
            seen = old;
        }
        let bit = 1u64 << (t % 64);
        if atom_acq_rel_sys_or_b64(out.add(6), bit) & bit == 0 {
            red_release_gpu_add_u64(out.add(7), 1);
        }
    }
}

/// Fences and barriers: each thread writes its id to shared memory, fences, meets the others, reads its
/// neighbour's id and writes it to `out[tid]`, with bit 32 set when a barrier-OR of "I am the last
/// thread" was true and bit 33 when a barrier-OR of `false` was.
///
/// # Safety
/// One CTA of a whole number of warps with `DATA + 4 × threads` bytes of dynamic shared memory;
/// `out` holds one u64 per thread.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn probe_sync(out: u64) {
    let t = tid_x();
    let n = ntid_x();
    let s = smem().byte_add::<u32>(DATA);
    // SAFETY: launched with `n` threads (a multiple of 32) and `DATA + 4 n` bytes of shared memory.
    unsafe {
        st_shared_u32(s.add(t), t);
        fence_proxy_async();
        fence_proxy_async_shared_cta();
        fence_proxy_async_global();
        fence_acq_rel_cta();
        fence_acq_rel_gpu();
        fence_acq_rel_sys();
        nanosleep_u32(100);
        // No grid before this one programmatically: both return at once.
        griddepcontrol_wait();
        griddepcontrol_launch_dependents();
        bar_sync(1, n);
        let neighbour = ld_shared_u32(s.add((t + 1) % n));
        bar_sync_all();
        let any_last = bar_red_or_all(t == n - 1) as u64;
        let any_none = bar_red_or_all(false) as u64;
        *Global::<u64>::from_addr(out).add(t as u64).ptr() = neighbour as u64 | any_last << 32 | any_none << 33;
    }
}

/// 16-byte vector moves: each thread copies one 16-byte vector of `src` to `dst` through shared memory.
///
/// # Safety
/// One CTA with `DATA + 16 × threads` bytes of dynamic shared memory; `src` and `dst` hold 16
/// bytes per thread, 16-byte aligned.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn probe_vector(dst: u64, src: u64) {
    let t = tid_x() as u64;
    let s = smem().byte_add::<V4>(DATA).add(t as u32);
    // SAFETY: `src` and `dst` hold 16 * ntid bytes, 16-aligned; shared memory holds DATA + 16 * ntid.
    unsafe {
        let v = ld_global_v4_u32(Global::<V4>::from_addr(src).add(t));
        st_shared_v4_u32(s, v);
        bar_sync_all();
        st_global_v4_u32(Global::<V4>::from_addr(dst).add(t), ld_shared_v4_u32(s));
    }
}

/// Packed half arithmetic: for each i, `out[10 i .. 10 i + 10]` = add/min/max/mul of `a[i]`, `b[i]` as
/// f16x2, then as bf16x2, then `a[i]`'s halves through f32 divided by 3 and rounded back, as f16x2
/// and as bf16x2.
///
/// # Safety
/// `a` and `b` hold `n` u32 (f16x2 / bf16x2 pairs) and `out` `10 n` u32.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn probe_arith(out: u64, a: u64, b: u64, n: u32) {
    let i = ctaid_x() * ntid_x() + tid_x();
    if i >= n {
        return;
    }
    // SAFETY: `a`, `b` hold `n` words and `out` 6 n words.
    unsafe {
        let x = *Global::<u32>::from_addr(a).add(i as u64).ptr();
        let y = *Global::<u32>::from_addr(b).add(i as u64).ptr();
        let (lo, hi) = cvt_f32_f16x2(x);
        let (blo, bhi) = (f32::from_bits(x << 16), f32::from_bits(x & 0xffff_0000));
        let r = [
            add_rn_f16x2(x, y),
            min_f16x2(x, y),
            max_f16x2(x, y),
            add_rn_bf16x2(x, y),
            min_bf16x2(x, y),
            max_bf16x2(x, y),
            mul_rn_f16x2(x, y),
            mul_rn_bf16x2(x, y),
            cvt_rn_f16x2_f32(lo / 3.0, hi / 3.0),
            cvt_rn_bf16x2_f32(blo / 3.0, bhi / 3.0),
        ];
        let o = Global::<u32>::from_addr(out).add(10 * i as u64);
        for (k, v) in r.into_iter().enumerate() {
            *o.add(k as u64).ptr() = v;
        }
    }
}

/// The FP8 conversions, one thread per element: `out[2 i]` is word `i` of `a` (four E4M3 values)
/// widened, rounded back through f32 and repacked, `out[2 i + 1]` the same for E5M2.
///
/// # Safety
/// `a` holds `n` u32 and `out` `2 n` u32.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn probe_fp8(out: u64, a: u64, n: u32) {
    let i = ctaid_x() * ntid_x() + tid_x();
    if i >= n {
        return;
    }
    // SAFETY: `a` holds `n` words and `out` 2 n words.
    unsafe {
        let x = *Global::<u32>::from_addr(a).add(i as u64).ptr();
        let half = |h: u16, widen: fn(u16) -> u32, narrow: fn(f32, f32) -> u16| {
            let (lo, hi) = cvt_f32_f16x2(widen(h));
            narrow(lo, hi) as u32
        };
        let e4 = half(x as u16, cvt_f16x2_e4m3x2, cvt_rn_satfinite_e4m3x2_f32)
            | half((x >> 16) as u16, cvt_f16x2_e4m3x2, cvt_rn_satfinite_e4m3x2_f32) << 16;
        let e5 = half(x as u16, cvt_f16x2_e5m2x2, cvt_rn_satfinite_e5m2x2_f32)
            | half((x >> 16) as u16, cvt_f16x2_e5m2x2, cvt_rn_satfinite_e5m2x2_f32) << 16;
        let o = Global::<u32>::from_addr(out).add(2 * i as u64);
        *o.ptr() = e4;
        *o.add(1).ptr() = e5;
    }
}
