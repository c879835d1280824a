//! Kernel entry points of `oxccl_plans.ptx`: compiled ResCCL plans, one kernel per mover and
//! (dtype, operator), built with the crate's `plans` feature (a PTX module of its own, so the T-CCL
//! kernels' code generation does not depend on these).

use crate::abi::{self, BUFFER_SLOTS, DType, MAX_RANKS, PLAN_ABI_VERSION, PlanLaunchArgs, PlanTb, RedOp, WaitKind};
use crate::engine::combine::{self, Combine};
use crate::engine::{Ctx, SmemBase, plan, wait};
use oxccl_ptx::fence::fence_proxy_async_shared_cta;
use oxccl_ptx::mbarrier::{fence_mbarrier_init_release_cluster, mbarrier_init_shared_b64, mbarrier_inval_shared_b64};
use oxccl_ptx::sreg::{ctaid_x, dynamic_smem_size};
use oxccl_ptx::sync::bar_sync_all;

macro_rules! plan_kernels {
    ($($tma:ident, $simt:ident: $dtype:ident, $op:ident, $combine:ident;)+) => {$(
        #[doc = concat!("A compiled plan with the TMA mover for ", stringify!($dtype), " ", stringify!($op), ": CTA `blockIdx.x` runs thread block `blockIdx.x`.")]
        ///
        /// # Safety
        /// See [`plan_launch`].
        #[unsafe(no_mangle)]
        pub unsafe extern "ptx-kernel" fn $tma(args: PlanLaunchArgs) {
            // SAFETY: forwarded contract.
            unsafe { plan_launch::<true, combine::$combine>(&args, DType::$dtype, RedOp::$op) }
        }

        #[doc = concat!("A compiled plan with the SIMT mover for ", stringify!($dtype), " ", stringify!($op), ": CTA `blockIdx.x` runs thread block `blockIdx.x`.")]
        ///
        /// # Safety
        /// See [`plan_launch`].
        #[unsafe(no_mangle)]
        pub unsafe extern "ptx-kernel" fn $simt(args: PlanLaunchArgs) {
            // SAFETY: forwarded contract.
            unsafe { plan_launch::<false, combine::$combine>(&args, DType::$dtype, RedOp::$op) }
        }
    )+};
}

abi::plan_kernels!(plan_kernels);

/// Kernel body of a compiled plan: sets up the CTA and runs its thread block.
///
/// Launch one kernel per rank with that rank's `PlanLaunchArgs` by value, a grid of `header.tbs`
/// CTAs, `abi::plan_smem_bytes(mover, stage_bytes)` bytes of dynamic shared memory (the kernel reads
/// the size back to find its TMA stages) and any block size that is a multiple of 32 (the TMA mover
/// issues from one thread; combining and the SIMT mover use all). A launch this kernel cannot run
/// (another descriptor version, dtype or operator, a rank beyond the tables, no room for TMA stages)
/// records `BadTask` with task `u32::MAX` and does nothing else.
///
/// # Safety
/// `args` describes a lowered plan that passes `oxccl_host::compile::lower::validate`, its buffers
/// and workspaces (`FIFO_REGION_OFFSET + fifo_bytes` bytes each, counters as the previous launch
/// left them); every rank of the plan is launched, and all their CTAs are co-resident.
#[inline(always)]
unsafe fn plan_launch<const TMA: bool, C: Combine>(args: &PlanLaunchArgs, dtype: DType, op: RedOp) {
    let base = core::intrinsics::gpu::gpu_launch_sized_workgroup_mem::<SmemBase>().cast::<u8>();
    let block = ctaid_x();
    let header = &args.header;
    if block >= header.tbs {
        return;
    }
    let stage_bytes = if TMA { abi::plan_stage_bytes(dynamic_smem_size()) } else { 0 };
    // SAFETY: `base` is the dynamic shared memory of this CTA, sized by the host for the header.
    let ctx = unsafe { Ctx::for_plan(args, base, block, stage_bytes) };
    let runnable = header.version == PLAN_ABI_VERSION
        && header.dtype == dtype.raw()
        && header.op == op.raw()
        && (header.rank as usize) < MAX_RANKS
        && (!TMA || stage_bytes >= 16);
    if !runnable {
        if ctx.issuer {
            wait::record(&ctx, WaitKind::BadTask, u32::MAX, header.version as u64, stage_bytes as u64);
        }
        return;
    }
    // SAFETY: the program array has one entry per TB (`block < tbs`).
    let tb: PlanTb = unsafe { *(args.programs as *const PlanTb).add(block as usize) };
    let plan = plan::Plan::new(args, dtype, op);
    // SAFETY: only the issuer writes the tables, before the CTA barrier that publishes them; the
    // stage barriers are initialised once per launch (never while live) and invalidated at the end.
    unsafe {
        if ctx.issuer {
            // This rank's buffers where `Ctx::buffer(rank, slot)` looks them up.
            let buffers = (base.add(abi::smem::BUFFERS) as *mut u64).add(header.rank as usize * BUFFER_SLOTS);
            copy_table!(buffers, args.buffers, [0 1 2 3]);
            let workspaces = base.add(abi::smem::WORKSPACES) as *mut u64;
            copy_table!(workspaces, args.workspaces, [0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15]);
            ctx.clear_abort();
            // Plans' FIFOs may cross GPUs.
            ctx.set_peer_scope(abi::PeerScope::System as u32);
            if TMA {
                for s in 0..ctx.stages {
                    mbarrier_init_shared_b64(ctx.stage_barrier(s), 1);
                }
                fence_mbarrier_init_release_cluster();
                fence_proxy_async_shared_cta();
            }
        }
        bar_sync_all();
        plan::run::<TMA, C>(&ctx, &plan, &tb, block);
        bar_sync_all();
        if TMA && ctx.issuer {
            for s in 0..ctx.stages {
                mbarrier_inval_shared_b64(ctx.stage_barrier(s));
            }
        }
    }
}

const _: () = assert!(MAX_RANKS == 16 && BUFFER_SLOTS == 4, "copy_table! lists these indices");
