//! Bounded waits. Every wait in the engine gives up after the launch's timeout (the drain of loads
//! already issued when a wait gave up: after at least a second), records what it waited for in the
//! launch's [`Status`](crate::abi::Status) and sets the CTA's abort flag; a barrier flag past the
//! value it should reach is recorded at once as out of step. The host turns the record into an `Err`
//! naming the wait. Nothing spins forever.

use super::Ctx;
use crate::abi::{
    BARRIER_ABORTED, BARRIER_REVOKED, BARRIER_SEQ, BARRIER_TAKEN, MAX_RANKS, Status, WaitKind, Workspace,
};
use oxccl_ptx::fence::{fence_acq_rel_gpu, fence_acq_rel_sys};
use oxccl_ptx::memory::{
    atom_acq_rel_gpu_or_b64, atom_acq_rel_sys_or_b64, atom_relaxed_gpu_add_u32, atom_relaxed_gpu_cas_b64,
    atom_relaxed_sys_cas_b64, ld_relaxed_gpu_u64, ld_relaxed_sys_u64, st_relaxed_gpu_u64, st_relaxed_sys_u64,
};
use oxccl_ptx::sreg::globaltimer;
use oxccl_ptx::sync::nanosleep_u32;
use oxccl_ptx::{Global, Mbarrier, Shared};

/// Polls between two reads of the (coarse) global timer.
const POLLS_PER_CLOCK_READ: u32 = 32;

/// Barrier flags at the launch's peer scope ([`Ctx::peers_on_gpu`]: GPU scope where every rank
/// met runs on this GPU, system scope otherwise). One branch on a value every thread shares.
impl Ctx {
    /// Acquire-release fence at the peer scope.
    ///
    /// # Safety
    /// Always sound to execute; `unsafe` because callers rely on its placement for the soundness of
    /// the accesses it orders.
    #[inline(always)]
    pub unsafe fn fence_peers(&self) {
        // SAFETY: fences have no operands.
        unsafe { if self.peers_on_gpu() { fence_acq_rel_gpu() } else { fence_acq_rel_sys() } }
    }

    /// Relaxed load at the peer scope.
    ///
    /// # Safety
    /// `at` is a naturally aligned global word of a workspace (this rank's or a peer's).
    #[inline(always)]
    pub unsafe fn load_flag(&self, at: Global<u64>) -> u64 {
        // SAFETY: the caller's contract.
        unsafe { if self.peers_on_gpu() { ld_relaxed_gpu_u64(at) } else { ld_relaxed_sys_u64(at) } }
    }

    /// Relaxed store at the peer scope.
    ///
    /// # Safety
    /// `at` is a naturally aligned global word of a workspace (this rank's or a peer's).
    #[inline(always)]
    pub unsafe fn store_flag(&self, at: Global<u64>, v: u64) {
        // SAFETY: the caller's contract.
        unsafe { if self.peers_on_gpu() { st_relaxed_gpu_u64(at, v) } else { st_relaxed_sys_u64(at, v) } }
    }

    /// Relaxed compare-and-swap at the peer scope; returns the previous value.
    ///
    /// # Safety
    /// `at` is a naturally aligned global word of a workspace (this rank's or a peer's).
    #[inline(always)]
    pub unsafe fn cas_flag(&self, at: Global<u64>, compare: u64, v: u64) -> u64 {
        // SAFETY: the caller's contract.
        unsafe {
            if self.peers_on_gpu() {
                atom_relaxed_gpu_cas_b64(at, compare, v)
            } else {
                atom_relaxed_sys_cas_b64(at, compare, v)
            }
        }
    }

    /// Acquire-release OR at the peer scope; returns the previous value.
    ///
    /// # Safety
    /// `at` is a naturally aligned global word of a workspace (this rank's or a peer's).
    #[inline(always)]
    pub unsafe fn or_flag(&self, at: Global<u64>, v: u64) -> u64 {
        // SAFETY: the caller's contract.
        unsafe { if self.peers_on_gpu() { atom_acq_rel_gpu_or_b64(at, v) } else { atom_acq_rel_sys_or_b64(at, v) } }
    }
}

/// Records an error in the launch status (the first one wins) and sets the CTA's abort flag.
#[inline(always)]
pub fn record(ctx: &Ctx, kind: WaitKind, peer: u32, expected: u64, observed: u64) {
    // The out-of-line part takes plain values, not `&Ctx`: a reference passed to a call that is not
    // inlined would pin the whole context in local memory and turn every field read in the hot loops
    // into an `ld.local`.
    write_status(ctx.status, ctx.rank, ctx.cta, kind, peer, expected, observed);
    ctx.set_abort();
}

/// The first error of a launch into its `Status`; later ones only count.
#[inline(never)]
fn write_status(s: Global<Status>, rank: u32, cta: u32, kind: WaitKind, peer: u32, expected: u64, observed: u64) {
    // SAFETY: `status` is the launch's Status (host memory the device maps, or device memory); the
    // counter is updated atomically and only the thread that moved it from 0 writes the details,
    // which the host trusts once the launch has ended.
    unsafe {
        let old = atom_relaxed_gpu_add_u32(Global::from_addr(s.addr()), 1);
        if old == 0 {
            let st: *mut Status = s.ptr();
            (*st).kind = kind as u32;
            (*st).rank = rank;
            (*st).cta = cta;
            (*st).peer = peer;
            (*st).expected = expected;
            (*st).observed = observed;
        }
    }
}

/// Waits until the flag at `flag` (at the peer scope) reaches at least `expected` (acquire). On timeout records
/// `kind` and returns `false`.
///
/// # Safety
/// `flag` is an 8-byte-aligned address of device memory (a workspace word, this rank's or a peer's)
/// that the other side updates with release semantics.
#[inline(always)]
pub unsafe fn flag_at_least(ctx: &Ctx, flag: Global<u64>, expected: u64, kind: WaitKind, peer: u32) -> bool {
    // SAFETY: forwarded contract.
    unsafe { flag_wait(ctx, flag, expected, kind, peer, Until::AtLeast, ctx.timeout_ns) }
}

/// Waits until the call count of the barrier flag of every rank in `peers` (a mask without this
/// CTA's rank; rank `q`'s flag at byte `offset(q, cta)` of this rank's workspace) equals
/// `expected` ([`BARRIER_SEQ`] of it), with no end-of-call bit: a barrier flag, which a peer in
/// step with this rank can never move past `expected` before this rank has passed the barrier. A
/// larger count records [`WaitKind::OutOfStep`]; the count with [`BARRIER_REVOKED`] or
/// [`BARRIER_ABORTED`] (the peer gave up this call) records [`WaitKind::PeerAborted`]; a timeout
/// records `kind`; all three return `false`. The acquire is one fence once all are there. Each round loads
/// every pending flag before it looks at any, so the peers' flags cost one memory round trip a
/// round rather than one each: a barrier of 8 ranks waited for its 7 peers one after the other.
/// Records against the lowest rank that fails (or, on timeout, is still pending).
///
/// With `take`, each poll is a compare-and-swap from `expected` to `expected | BARRIER_TAKEN`: a
/// flag is taken in the poll that finds it there, clean (the start barrier's arrivals, which a
/// peer that gives up revokes; the word's order settles that race), with no round of its own.
///
/// # Safety
/// This rank's workspace holds every flag named; the peers update them with release semantics.
#[inline(always)]
pub unsafe fn flags_reach(
    ctx: &Ctx,
    peers: u32,
    offset: fn(usize, usize) -> usize,
    expected: u64,
    kind: WaitKind,
    take: bool,
) -> bool {
    let own = ctx.workspace(ctx.rank);
    let at = |q: usize| Global::<u64>::from_addr(own + offset(q, ctx.cta as usize) as u64);
    let mut pending = peers;
    let mut deadline = 0u64;
    let mut polls = 0u32;
    loop {
        // Loads first, every one in flight, then the checks (in constant positions: registers).
        let mut seen = [0u64; MAX_RANKS];
        per_rank!(q => {
            if pending & (1 << q) != 0 {
                // SAFETY: the caller guarantees the flags.
                seen[q] = unsafe {
                    if take { ctx.cas_flag(at(q), expected, expected | BARRIER_TAKEN) } else { ctx.load_flag(at(q)) }
                };
            }
        });
        let mut failed = None;
        per_rank!(q => {
            let v = seen[q];
            let count = v & BARRIER_SEQ;
            if pending & (1 << q) != 0 && count >= expected {
                if count != expected {
                    failed = failed.or(Some((WaitKind::OutOfStep, q, v)));
                } else if v & (BARRIER_REVOKED | BARRIER_ABORTED) != 0 {
                    failed = failed.or(Some((WaitKind::PeerAborted, q, v)));
                }
                pending &= !(1 << q);
            }
        });
        if let Some((why, q, v)) = failed {
            record(ctx, why, q as u32, expected, v);
            return false;
        }
        if pending == 0 {
            // SAFETY: a fence has no operands; it makes the reads that ended the wait acquires.
            unsafe { ctx.fence_peers() };
            return true;
        }
        polls += 1;
        if polls % POLLS_PER_CLOCK_READ == 0 {
            // A peer that left the communicator never arrives: the start barrier gives up at once
            // (as at its timeout, before anything is touched); so does a call this rank queued
            // before it left itself (aborted), whose peers may never come. Other waits keep their
            // bound: a peer that left may still have kernels queued that touch this rank's buffers.
            // The errors below report the flag's value as loaded again (the polls' values are not
            // kept past their checks: sixteen of them held over this path took registers every
            // kernel's peak counts).
            if kind == WaitKind::StartBarrier {
                let mut gone = None;
                let watched = pending | (1 << ctx.rank);
                per_rank!(q => {
                    if watched & (1 << q) != 0 && gone.is_none() {
                        let w = Global::<u64>::from_addr(own + Workspace::withdrawn_offset(q) as u64);
                        // SAFETY: the word is in this rank's workspace, which the caller guarantees.
                        if unsafe { ctx.load_flag(w) } != 0 {
                            gone = Some(q);
                        }
                    }
                });
                if let Some(q) = gone {
                    // SAFETY: the caller guarantees the flags.
                    let last = unsafe { ctx.load_flag(at(q)) };
                    record(ctx, WaitKind::Withdrawn, q as u32, expected, last);
                    return false;
                }
            }
            let now = globaltimer();
            if deadline == 0 {
                deadline = now.saturating_add(ctx.timeout_ns);
            } else if now > deadline {
                let q = pending.trailing_zeros() as usize;
                // SAFETY: the caller guarantees the flags (`q` is a pending peer, below MAX_RANKS).
                let last = unsafe { ctx.load_flag(at(q)) };
                record(ctx, kind, q as u32, expected, last);
                return false;
            }
            if ctx.wait_suspend_ns != 0 {
                nanosleep_u32(ctx.wait_suspend_ns);
            }
        }
    }
}

/// Waits until the call count of the barrier flag at `flag` reaches `expected`, however the peer's
/// call ended (a `done` flag, clean or [`BARRIER_ABORTED`]): the peer touches this rank's buffers
/// no more. Bounded by `timeout_ns`; on timeout records [`WaitKind::EndBarrier`] and returns
/// `false`.
///
/// # Safety
/// As [`flag_at_least`].
#[inline(always)]
pub unsafe fn flag_settles(ctx: &Ctx, flag: Global<u64>, expected: u64, peer: u32, timeout_ns: u64) -> bool {
    // SAFETY: forwarded contract.
    unsafe { flag_wait(ctx, flag, expected, WaitKind::EndBarrier, peer, Until::Settled, timeout_ns) }
}

/// What a flag wait waits for.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Until {
    /// The whole value at least `expected` (counters).
    AtLeast,
    /// The call count at least `expected`, any bits.
    Settled,
}

/// The waits above: polls `flag` until `until` holds, giving up after `timeout_ns`. The polls are
/// relaxed and the value that ends the wait is made an acquire by one fence after it
/// (an acquire pattern): an acquire load per poll would fence on every poll.
///
/// # Safety
/// As [`flag_at_least`].
#[inline(always)]
unsafe fn flag_wait(
    ctx: &Ctx,
    flag: Global<u64>,
    expected: u64,
    kind: WaitKind,
    peer: u32,
    until: Until,
    timeout_ns: u64,
) -> bool {
    let mut deadline = 0u64;
    let mut polls = 0u32;
    loop {
        // SAFETY: the caller guarantees the address.
        let seen = unsafe { ctx.load_flag(flag) };
        let count = if until == Until::AtLeast { seen } else { seen & BARRIER_SEQ };
        if count >= expected {
            // SAFETY: a fence has no operands; it orders this thread's later accesses after the read.
            unsafe { ctx.fence_peers() };
            return true;
        }
        polls += 1;
        if polls % POLLS_PER_CLOCK_READ == 0 {
            let now = globaltimer();
            if deadline == 0 {
                deadline = now.saturating_add(timeout_ns);
            } else if now > deadline {
                record(ctx, kind, peer, expected, seen);
                return false;
            }
            if ctx.wait_suspend_ns != 0 {
                nanosleep_u32(ctx.wait_suspend_ns);
            }
        }
    }
}

/// Waits until the phase of `bar` with `parity` completes. On timeout records `BulkLoad` and returns
/// `false`.
///
/// # Safety
/// `bar` is a live mbarrier of this CTA whose phase `parity` is the current or the preceding one.
#[inline(always)]
pub unsafe fn mbarrier_phase(ctx: &Ctx, bar: Shared<Mbarrier>, parity: u32) -> bool {
    // SAFETY: forwarded contract.
    unsafe { mbarrier_phase_within(ctx, bar, parity, ctx.timeout_ns) }
}

/// Shortest bound on the wait for a bulk load that was already issued when its consumer gave up
/// ([`mbarrier_drain`]).
const DRAIN_TIMEOUT_NS: u64 = 1_000_000_000;

/// Waits for the phase of a load issued before the CTA gave up a wait, so that the load does not
/// write into shared memory after the stages are reused or the CTA exits. A load that was issued
/// completes unless the memory system fails, so the bound is the launch's timeout but at least
/// [`DRAIN_TIMEOUT_NS`] (a tiny timeout must not cut the drain short). Records `BulkLoad` when it
/// gives up.
///
/// # Safety
/// As [`mbarrier_phase`].
#[inline(always)]
pub unsafe fn mbarrier_drain(ctx: &Ctx, bar: Shared<Mbarrier>, parity: u32) -> bool {
    // SAFETY: forwarded contract.
    unsafe { mbarrier_phase_within(ctx, bar, parity, ctx.timeout_ns.max(DRAIN_TIMEOUT_NS)) }
}

/// [`mbarrier_phase`] bounded by `timeout_ns`.
///
/// # Safety
/// As [`mbarrier_phase`].
#[inline(always)]
unsafe fn mbarrier_phase_within(ctx: &Ctx, bar: Shared<Mbarrier>, parity: u32, timeout_ns: u64) -> bool {
    use oxccl_ptx::mbarrier::{mbarrier_try_wait_parity_shared_b64, mbarrier_try_wait_parity_suspend_shared_b64};
    // One loop per kind of poll, so that the common case (the phase already complete at the first
    // look) costs the issuer one `try_wait` and one branch.
    let suspend = ctx.wait_suspend_ns;
    if suspend == 0 {
        // SAFETY: forwarded contract (`bar` live, `parity` its current or preceding phase).
        poll_within(ctx, bar, parity, timeout_ns, || unsafe { mbarrier_try_wait_parity_shared_b64(bar, parity) })
    } else {
        poll_within(ctx, bar, parity, timeout_ns, || {
            // SAFETY: as above; the hint only bounds how long one poll may suspend.
            unsafe { mbarrier_try_wait_parity_suspend_shared_b64(bar, parity, suspend) }
        })
    }
}

/// Polls `done` until it says the phase of `bar` with `parity` completed, or records `BulkLoad`
/// and returns `false` after `timeout_ns`.
#[inline(always)]
fn poll_within(ctx: &Ctx, bar: Shared<Mbarrier>, parity: u32, timeout_ns: u64, done: impl Fn() -> bool) -> bool {
    let mut deadline = 0u64;
    loop {
        if done() {
            return true;
        }
        // try_wait already blocks for a hardware-defined interval, so the clock is read every round.
        let now = globaltimer();
        if deadline == 0 {
            deadline = now.saturating_add(timeout_ns);
        } else if now > deadline {
            record(ctx, WaitKind::BulkLoad, bar.addr(), parity as u64, 0);
            return false;
        }
    }
}
