//! Kernel entry points of `oxccl_kernels.ptx`: the T-CCL engine, one kernel per mover and (dtype,
//! operator).

use crate::abi::{self, BUFFER_SLOTS, DType, LaunchArgs, MAX_RANKS, Mover, RedOp, Task, TbProgram};
use crate::engine::combine::{self, Combine};
use crate::engine::{Ctx, SmemBase, walker};
use oxccl_ptx::fence::fence_proxy_async_shared_cta;
use oxccl_ptx::mbarrier::{fence_mbarrier_init_release_cluster, mbarrier_init_shared_b64, mbarrier_inval_shared_b64};
use oxccl_ptx::sreg::ctaid_x;
use oxccl_ptx::sync::{bar_sync_all, griddepcontrol_wait};

macro_rules! kernels {
    ($($tma:ident, $simt:ident, $latency:ident: $dtype:ident, $op:ident, $combine:ident;)+) => {$(
        #[doc = concat!("The engine with the TMA mover for ", stringify!($dtype), " ", stringify!($op), ": CTA `blockIdx.x` runs `programs[blockIdx.x]`.")]
        ///
        /// # Safety
        /// See [`launch`].
        #[unsafe(no_mangle)]
        pub unsafe extern "ptx-kernel" fn $tma(args: LaunchArgs) {
            // SAFETY: forwarded contract.
            unsafe { launch::<{ Mover::Tma as u8 }, combine::$combine>(&args, DType::$dtype, RedOp::$op) }
        }

        #[doc = concat!("The engine with the SIMT mover for ", stringify!($dtype), " ", stringify!($op), ": CTA `blockIdx.x` runs `programs[blockIdx.x]`.")]
        ///
        /// # Safety
        /// See [`launch`].
        #[unsafe(no_mangle)]
        pub unsafe extern "ptx-kernel" fn $simt(args: LaunchArgs) {
            // SAFETY: forwarded contract.
            unsafe { launch::<{ Mover::Simt as u8 }, combine::$combine>(&args, DType::$dtype, RedOp::$op) }
        }

        #[doc = concat!("The engine with the latency mover for ", stringify!($dtype), " ", stringify!($op), ": CTA `blockIdx.x` runs `programs[blockIdx.x]`.")]
        ///
        /// # Safety
        /// See [`launch`].
        #[unsafe(no_mangle)]
        pub unsafe extern "ptx-kernel" fn $latency(args: LaunchArgs) {
            // SAFETY: forwarded contract.
            unsafe { launch::<{ Mover::Latency as u8 }, combine::$combine>(&args, DType::$dtype, RedOp::$op) }
        }
    )+};
}

abi::engine_kernels!(kernels);

/// Kernel body: sets up the CTA and walks its program.
///
/// `MOVER` is a [`Mover`]'s raw value. Launch with `LaunchArgs` by value,
/// `abi::smem::bytes(stages, slots, chunk_bytes)` bytes of dynamic shared memory (the TMA mover;
/// the others `abi::smem::STAGES`) and any block size that is a multiple of 32 (the TMA mover needs
/// one warp per issuer; combining several sources in registers uses every warp but the issuing one
/// above 64 threads, and the SIMT and latency movers all threads).
///
/// # Safety
/// `args` describes valid programs, tasks, buffers and workspaces (the host's lowering guarantees it);
/// `args.stages` is in `1..=MAX_STAGES` and `args.chunk_bytes` a positive multiple of 16 (TMA mover),
/// the dynamic shared memory and block size are as above (the host's `Engine::check` refuses any
/// other launch); all CTAs of the ranks that barrier with each other are co-resident.
#[inline(always)]
unsafe fn launch<const MOVER: u8, C: Combine>(args: &LaunchArgs, dtype: DType, op: RedOp) {
    let base = core::intrinsics::gpu::gpu_launch_sized_workgroup_mem::<SmemBase>().cast::<u8>();
    let block = ctaid_x();
    // SAFETY: the program array has one entry per CTA of the launch.
    let program: TbProgram = unsafe { *(args.programs as *const TbProgram).add(block as usize) };
    // SAFETY: `base` is the dynamic shared memory of this CTA, sized by the host for the header.
    let ctx = unsafe { Ctx::new(args, base, program.rank, program.cta, program.key) };
    let stages = args.stages.min(abi::MAX_STAGES as u32);
    // SAFETY: only the issuer writes the header, before the CTA barrier that publishes it; the stage
    // barriers are initialised once per launch (never while live) and invalidated at the end.
    unsafe {
        if ctx.issuer {
            let flat: [u64; MAX_RANKS * BUFFER_SLOTS] = core::mem::transmute(args.buffers);
            let buffers = base.add(abi::smem::BUFFERS) as *mut u64;
            copy_table!(buffers, flat, [
                0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31
                32 33 34 35 36 37 38 39 40 41 42 43 44 45 46 47 48 49 50 51 52 53 54 55 56 57 58 59 60 61 62 63
            ]);
            let workspaces = base.add(abi::smem::WORKSPACES) as *mut u64;
            copy_table!(workspaces, args.workspaces, [0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15]);
            // This CTA's own buffers from the row its program names (a point-to-point launch keeps
            // one per peer), before any peer's announcement overwrites a row.
            let own = program.rank as usize % MAX_RANKS;
            if program.table != 0 {
                let row = (program.table - 1) as usize % MAX_RANKS;
                for s in 0..BUFFER_SLOTS {
                    *buffers.add(own * BUFFER_SLOTS + s) = *buffers.add(row * BUFFER_SLOTS + s);
                }
            }
            // Where the walker adds its phase times (0: nowhere), beside its marks.
            *(base.add(abi::smem::PHASE_MARKS) as *mut u64).add(4) = args.phase_times;
            ctx.set_peer_scope(args.peer_scope);
            ctx.set_peers(program.barrier_ranks);
            ctx.clear_abort();
            for s in 0..stages {
                mbarrier_init_shared_b64(ctx.stage_barrier(s), 1);
            }
            fence_mbarrier_init_release_cluster();
            fence_proxy_async_shared_cta();
        }
        // Launched early behind this stream's previous kernel (programmatic stream serialization),
        // the CTA has set up its shared memory in the meantime; nothing that kernel writes (the
        // workspace's counters and flags, the phase records, the buffers) is touched before it
        // has ended. At once otherwise.
        griddepcontrol_wait();
        bar_sync_all();
        walker::run::<MOVER, C>(&ctx, &program, args.tasks as *const Task, dtype, op);
        if ctx.issuer {
            for s in 0..stages {
                mbarrier_inval_shared_b64(ctx.stage_barrier(s));
            }
        }
    }
}

const _: () =
    assert!(MAX_RANKS * BUFFER_SLOTS == 64 && MAX_RANKS == 16, "copy_table! and per_rank! list these indices");
