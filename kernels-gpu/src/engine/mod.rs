//! The device engine: per-CTA context, bounded waits, cross-rank barriers, the data movers and the
//! TB program walker.
//!
//! Layers, bottom up: `oxccl-ptx` (one wrapper per instruction) → [`wait`] and [`pipeline`] (bounded
//! waits, stage ring state) → the movers [`tma`] and [`simt`] (a task's byte range, moved or reduced;
//! the latency mover is [`simt::gathered`]) →
//! [`walker`] (a CTA's task list between a start and an end barrier) → `crate::entry` (the kernels).

pub mod combine;
pub mod pipeline;
pub mod simt;
pub mod tma;
pub mod wait;
pub mod walker;

use crate::abi::{self, BUFFER_SLOTS, LaunchArgs, ReduceMode, Status};
use oxccl_ptx::sreg::{ntid_x, tid_x};
use oxccl_ptx::{Global, Mbarrier, Shared};

/// The issuing warps a launch gets: `asked` when it is in 2..=`MAX_ISSUERS`, divides `stages` and
/// fits the CTA's warps; one otherwise (the host checks the same and refuses a launch that asks
/// for more than this gives).
#[inline(always)]
pub const fn issuers_for(asked: u32, stages: u32, threads: u32) -> u32 {
    if asked >= 2 && asked <= abi::MAX_ISSUERS && stages % asked == 0 && asked <= threads / 32 { asked } else { 1 }
}

const _: () = assert!(
    issuers_for(0, 4, 32) == 1
        && issuers_for(4, 8, 128) == 4
        && issuers_for(4, 6, 128) == 1
        && issuers_for(4, 8, 96) == 1
        && issuers_for(8, 16, 256) == 1
        && issuers_for(2, 4, 64) == 2,
    "issuers_for keeps one issuer unless the ask fits"
);

/// Base of the dynamic shared memory, 1024-byte aligned.
#[repr(C, align(1024))]
pub struct SmemBase([u8; 1024]);

/// What every thread of a CTA knows about its launch. Built once at kernel entry.
pub struct Ctx {
    /// This thread's index in the CTA (`%tid.x`).
    pub tid: u32,
    /// Threads in the CTA (`%ntid.x`).
    pub threads: u32,
    /// The thread that does the cross-rank signalling and issues the bulk copies of combining tasks
    /// (and of all tasks when the CTA has one issuer; see `ring_issuer`).
    pub issuer: bool,
    /// The rank this CTA works for.
    pub rank: u32,
    /// This CTA's index among its rank's CTAs.
    pub cta: u32,
    /// Generic pointer to the dynamic shared memory (header tables are read through it).
    pub smem: *mut u8,
    /// The same memory as a shared-window address (bulk copies and mbarriers use it).
    pub smem_shared: Shared<u8>,
    /// The launch's status record (host memory the device maps, or device memory): the first error
    /// any CTA hits is written here; later ones only count.
    pub status: Global<Status>,
    /// Every bounded wait gives up after this many nanoseconds (`LaunchArgs::timeout_ns`; the drain
    /// of issued loads waits at least one second).
    pub timeout_ns: u64,
    /// Bytes per source slot per pipeline stage (TMA mover; a multiple of 16).
    pub chunk_bytes: u32,
    /// Stages of the shared-memory ring (TMA mover).
    pub stages: u32,
    /// Source slots per stage: the most sources any task of the launch combines in registers.
    pub slots: u32,
    /// How combining tasks reduce: in registers or with the TMA's bulk reduction.
    pub reduce_mode: ReduceMode,
    /// Suspend time of the engine's waits, in nanoseconds: the hint of mbarrier try-waits and the
    /// sleep between cross-rank flag polls (0: plain spin).
    pub wait_suspend_ns: u32,
    /// This thread issues the bulk copies of its warp's share of a task that does not combine
    /// sources (lane 0 of warps `0..ring_stride`; with one issuer, the same thread as `issuer`).
    pub ring_issuer: bool,
    /// Its share: items `ring_first, ring_first + ring_stride, …` of each such task, through stages
    /// `ring_base .. ring_base + ring_len` of the ring.
    pub ring_first: u32,
    /// Issuing warps sharing the ring (the step between one issuer's items).
    pub ring_stride: u32,
    /// The first ring stage this issuer uses.
    pub ring_base: u32,
    /// Ring stages this issuer uses (`stages / ring_stride`).
    pub ring_len: u32,
    /// Combines into several destinations store from registers (`LaunchArgs::combine_direct`).
    pub combine_direct: bool,
    /// The call's key (`LaunchArgs::call_key`).
    pub call_key: u32,
}

impl Ctx {
    /// Reads the launch parameters (constant offsets only) into a context.
    ///
    /// # Safety
    /// Called at kernel entry with the launch's dynamic shared memory base.
    #[inline(always)]
    pub unsafe fn new(args: &LaunchArgs, smem: *mut u8, rank: u32, cta: u32, key: u32) -> Self {
        let tid = tid_x();
        let threads = ntid_x();
        let issuers = issuers_for(args.issuers, args.stages, threads);
        let (warp, lane) = (tid / 32, tid % 32);
        let ring_len = args.stages / issuers;
        Ctx {
            tid,
            threads,
            issuer: tid == 0,
            rank,
            cta,
            smem,
            // SAFETY: `smem` is the dynamic shared memory base.
            smem_shared: unsafe { Shared::from_generic(smem) },
            status: Global::from_addr(args.status),
            timeout_ns: args.timeout_ns,
            chunk_bytes: args.chunk_bytes,
            stages: args.stages,
            slots: args.slots,
            reduce_mode: ReduceMode::from_raw(args.reduce_mode as u8).unwrap_or(ReduceMode::Registers),
            wait_suspend_ns: args.wait_suspend_ns,
            ring_issuer: lane == 0 && warp < issuers,
            ring_first: if warp < issuers { warp } else { 0 },
            ring_stride: issuers,
            ring_base: if warp < issuers { warp * ring_len } else { 0 },
            ring_len,
            combine_direct: args.combine_direct != 0,
            call_key: if key != 0 { key } else { args.call_key },
        }
    }

    /// Base address of `rank`'s buffer in `slot`, from the shared-memory buffer table.
    #[inline(always)]
    pub fn buffer(&self, rank: u32, slot: u8) -> u64 {
        let i = rank as usize * BUFFER_SLOTS + slot as usize;
        // SAFETY: the table was written at entry (before the CTA barrier) and is only read afterwards;
        // rank < MAX_RANKS and slot < BUFFER_SLOTS: the walker checks a task's before it runs, and the
        // host's `validate_structure` refuses programs whose own rank or barrier ranks are not.
        unsafe { *self.buffer_table().add(i) }
    }

    /// The shared-memory buffer table: `MAX_RANKS × BUFFER_SLOTS` addresses, rank-major.
    #[inline(always)]
    pub fn buffer_table(&self) -> *const u64 {
        // SAFETY: the table lies at a fixed offset inside the dynamic shared memory.
        unsafe { self.smem.add(abi::smem::BUFFERS) as *const u64 }
    }

    /// The buffer table for writing (issuer only, before the CTA barrier that publishes it: at
    /// entry, the peers' rows at the start barrier, and their resolution).
    #[inline(always)]
    pub fn buffer_table_mut(&self) -> *mut u64 {
        // SAFETY: as for `buffer_table`.
        unsafe { self.smem.add(abi::smem::BUFFERS) as *mut u64 }
    }

    /// Base address of `rank`'s workspace.
    #[inline(always)]
    pub fn workspace(&self, rank: u32) -> u64 {
        // SAFETY: as for `buffer` (the ranks passed here are a program's own, its barrier ranks, or a
        // task's, all below MAX_RANKS as said there).
        unsafe { *(self.smem.add(abi::smem::WORKSPACES) as *const u64).add(rank as usize) }
    }

    /// The mbarrier of pipeline stage `i`.
    #[inline(always)]
    pub fn stage_barrier(&self, i: u32) -> Shared<Mbarrier> {
        self.smem_shared.byte_add(abi::smem::BARRIERS as u32 + 8 * i)
    }

    /// Slot `k` of pipeline stage `i`.
    #[inline(always)]
    pub fn stage_slot(&self, i: u32, k: u32) -> Shared<u8> {
        self.smem_shared.byte_add(abi::smem::STAGES as u32 + (i * self.slots + k) * self.chunk_bytes)
    }

    /// The CTA-wide abort flag in shared memory: set by any thread whose bounded wait gave up, read by
    /// all after each CTA barrier so the whole CTA leaves together.
    #[inline(always)]
    fn abort_flag(&self) -> &core::sync::atomic::AtomicU32 {
        // SAFETY: the word after the barriers is reserved for the flag (smem::ABORT < smem::STAGES),
        // 4-byte aligned, lives as long as the CTA, and is only ever accessed through this atomic.
        unsafe { core::sync::atomic::AtomicU32::from_ptr(self.smem.add(abi::smem::ABORT) as *mut u32) }
    }

    /// Marks the CTA as aborting.
    #[inline(always)]
    pub fn set_abort(&self) {
        // Several threads may store the same value while others read it (the mover loops after
        // `stream_issued` read it while the issuer may be storing it): every access is a relaxed
        // atomic one (`ld`/`st.relaxed.sys.shared`), so none races. A thread that reads it before
        // the store lands learns of it at the next `sync_aborted`: the storing thread reads its own
        // store and brings it to the barrier's OR, whose verdict every thread gets.
        self.abort_flag().store(1, core::sync::atomic::Ordering::Relaxed)
    }

    /// CTA barrier, then whether any thread had set the abort flag when it arrived: one verdict for
    /// every thread, so all leave a loop together even if a thread aborts right after the barrier.
    ///
    /// # Safety
    /// Every thread of the CTA calls it (a CTA barrier).
    #[inline(always)]
    pub unsafe fn sync_aborted(&self) -> bool {
        // SAFETY: forwarded contract.
        unsafe { oxccl_ptx::sync::bar_red_or_all(self.aborted()) }
    }

    /// Whether any thread set the abort flag (meaningful after a CTA barrier).
    #[inline(always)]
    pub fn aborted(&self) -> bool {
        // See `set_abort`.
        self.abort_flag().load(core::sync::atomic::Ordering::Relaxed) != 0
    }

    /// Whether every rank the barriers meet runs on this GPU, so that they synchronize at GPU scope
    /// ([`abi::smem::PEER_SCOPE`], written at entry; system scope otherwise).
    #[inline(always)]
    pub fn peers_on_gpu(&self) -> bool {
        // SAFETY: a `u32` of the header, written before the entry's CTA barrier and only read after.
        unsafe { *(self.smem.add(abi::smem::PEER_SCOPE) as *const u32) == abi::PeerScope::Gpu as u32 }
    }

    /// Sets the peer scope `peers_on_gpu` reads (entry, issuer, before the first CTA barrier): a
    /// [`abi::PeerScope`] value; any other reads as system scope.
    #[inline(always)]
    pub fn set_peer_scope(&self, scope: u32) {
        // SAFETY: a `u32` of the header, this thread's alone until the CTA barrier.
        unsafe { *(self.smem.add(abi::smem::PEER_SCOPE) as *mut u32) = scope }
    }

    /// The program's barrier ranks, as the entry kept them in shared memory.
    #[inline(always)]
    pub fn peers(&self) -> u32 {
        // SAFETY: a `u32` at a fixed, aligned offset of the header, written at entry before the CTA
        // barrier that precedes the walker.
        unsafe { *(self.smem.add(abi::smem::PEERS) as *const u32) }
    }

    /// Keeps the program's barrier ranks in shared memory (the issuer, at entry).
    #[inline(always)]
    pub fn set_peers(&self, peers: u32) {
        // SAFETY: as [`Ctx::peers`]; only the issuer writes it, before that barrier.
        unsafe { *(self.smem.add(abi::smem::PEERS) as *mut u32) = peers }
    }

    /// Clears the abort flag (entry, before the first CTA barrier).
    #[inline(always)]
    pub fn clear_abort(&self) {
        // See `set_abort`.
        self.abort_flag().store(0, core::sync::atomic::Ordering::Relaxed)
    }
}
