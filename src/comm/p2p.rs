//! Point-to-point rounds of a per-rank communicator: the launches behind [`crate::Comm::send`],
//! [`crate::Comm::recv`] and their groups (`oxccl_host::p2p` plans them).

use super::{Communicator, Range, check_disjoint};
use crate::engine::LaunchSpec;
use crate::error::{Error, Result};
use crate::peer::Out;
use crate::program::Uploaded;
use crate::{DType, ReduceOp};
use cudarc::driver::sys;
use oxccl_host::lowered::Lowered;
use oxccl_host::p2p::{self, Direction, Transfer};
use oxccl_kernels::abi::{BUFFER_SLOTS, MAX_RANKS, TbProgram, slot};
use std::sync::Arc;

/// One transfer of a call: `bytes` at device address `ptr` of the calling rank, sent to or received
/// from `peer` (the caller holds the buffer's ordering guard until the call is queued).
#[derive(Clone, Copy, Debug)]
pub(crate) struct P2pOp {
    pub peer: usize,
    pub dir: Direction,
    pub ptr: u64,
    pub bytes: usize,
}

/// What a round's cached plan is keyed by: its transfers (peer, direction, bytes; sorted) and the
/// unit its copies move.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct P2pKey {
    transfers: Vec<Transfer>,
    dtype: DType,
}

/// The transfers of `ops` with rank `me` itself, (sends, receives) in order, checked to pair up:
/// as many receives as sends, each as long as its send.
pub(crate) fn own_transfers(ops: &[P2pOp], me: usize) -> Result<(Vec<&P2pOp>, Vec<&P2pOp>)> {
    let own_sends: Vec<&P2pOp> = ops.iter().filter(|o| o.peer == me && o.dir == Direction::Send).collect();
    let own_recvs: Vec<&P2pOp> = ops.iter().filter(|o| o.peer == me && o.dir == Direction::Recv).collect();
    if own_sends.len() != own_recvs.len() {
        return Err(Error::BufferCount {
            what: "receives from this rank itself (one per send to itself)",
            expected: own_sends.len(),
            got: own_recvs.len(),
        });
    }
    for (s, r) in own_sends.iter().zip(&own_recvs) {
        if s.bytes != r.bytes {
            return Err(Error::Length {
                what: "receive buffer of a transfer to this rank itself (bytes)",
                rank: me,
                expected: s.bytes,
                got: r.bytes,
            });
        }
    }
    Ok((own_sends, own_recvs))
}

impl Communicator {
    /// Queues the transfers `ops` of this communicator's one rank with its peers, matched with
    /// theirs in order per peer and direction: transfers with itself as copies on its stream (its
    /// sends and receives paired in order), the others in rounds of one launch each.
    pub(crate) fn p2p(&self, ops: &[P2pOp]) -> Result<()> {
        self.check_usable()?;
        let [rank] = self.ranks.as_slice() else {
            return Err(Error::Unsupported {
                what: "send and receive on a communicator that drives several ranks (use a per-rank Comm)".into(),
            });
        };
        let me = rank.index;
        let world = self.ranks();
        // Arguments first, before anything is queued.
        let mut ranges = Vec::with_capacity(ops.len());
        for op in ops {
            if op.peer >= world {
                return Err(Error::NoSuchRank { rank: op.peer, ranks: world });
            }
            let what = match op.dir {
                Direction::Send => "send buffer",
                Direction::Recv => "receive buffer",
            };
            let writes = op.dir == Direction::Recv;
            let end = op.ptr + op.bytes as u64;
            ranges.push(Range { start: op.ptr, end, rank: me, device: rank.device, writes, buffer: what });
        }
        check_disjoint(&ranges, "a group's receive buffers and the other buffers of the group")?;
        let (own_sends, own_recvs) = own_transfers(ops, me)?;
        let others: Vec<&P2pOp> = ops.iter().filter(|o| o.peer != me).collect();
        let transfers: Vec<Transfer> =
            others.iter().map(|o| Transfer { peer: o.peer, dir: o.dir, bytes: o.bytes as u64 }).collect();
        // Plans (and their launch checks) for every round before anything is queued.
        let mut rounds = Vec::new();
        for round in p2p::rounds(&transfers) {
            let ops: Vec<P2pOp> = round.iter().map(|&i| *others[i]).collect();
            // Bytes: each end moves into or out of its peer's buffer too, whose alignment it does
            // not know (the bulk copies align themselves; only heads and tails go element-wise).
            let dtype = DType::U8;
            let (plan, launch) = self.p2p_plan(me, &ops, dtype)?;
            rounds.push((ops, plan, launch));
        }

        // Transfers to itself: plain copies, in the stream's order before the rounds.
        crate::engine::make_current(rank.stream.context()).map_err(Error::driver("cuCtxSetCurrent"))?;
        for (s, r) in own_sends.iter().zip(&own_recvs) {
            if s.bytes > 0 {
                // SAFETY: both ranges are live device memory of this rank, borrowed by the caller for
                // the call (their guards order them on this stream), and disjoint (checked above).
                unsafe { sys::cuMemcpyDtoDAsync_v2(r.ptr, s.ptr, s.bytes, rank.stream.cu_stream()) }
                    .result()
                    .map_err(Error::driver("cuMemcpyDtoDAsync"))?;
            }
        }
        let mut result = Ok(());
        for (ops, plan, launch) in rounds {
            result = self.launch_round(&ops, &plan, &launch);
            let released = self.release_plan(plan);
            result = result.and(released);
            if result.is_err() {
                break;
            }
        }
        result
    }

    /// CTAs a rank may spend on a round: `Config::max_ctas` where set, else its share of the
    /// multiprocessors of the busiest device (every rank there may run a round at once). Not the
    /// collectives' default, which stops at 16: one transfer between two ranks needs more CTAs
    /// than that to copy at the memory's rate.
    fn p2p_ctas_per_rank(&self) -> u32 {
        if let Some(c) = self.config.max_ctas {
            return c;
        }
        self.world.sm_share()
    }

    /// The plan of one round of this rank's transfers (`ops`, sorted as `p2p::rounds` sorts),
    /// built, checked and uploaded on first use.
    fn p2p_plan(&self, me: usize, ops: &[P2pOp], dtype: DType) -> Result<(Arc<Uploaded>, LaunchSpec)> {
        let transfers: Vec<Transfer> =
            ops.iter().map(|o| Transfer { peer: o.peer, dir: o.dir, bytes: o.bytes as u64 }).collect();
        let key = P2pKey { transfers: transfers.clone(), dtype };
        let (plan_and_launch, _) = self.p2p_plans.get_or_build(key, || {
            let world = self.ranks();
            let k = p2p::ctas_per_transfer(self.p2p_ctas_per_rank(), world);
            let round = p2p::lower_round(me, world, &transfers, k, dtype)
                .map_err(|e| Error::Config { field: "point-to-point transfers", why: e.to_string() })?;
            let ctas = round.programs.len() as u32;
            let launch = self.launch_spec_for(dtype, ReduceOp::Sum, 1, false)?;
            // Every rank of the device may run a round of this many CTAs at once.
            self.check_resident(&launch, ctas, 1)?;
            // `upload` takes each local rank's CTAs from a rank-major list: this rank's at its place.
            let filler = <TbProgram as bytemuck::Zeroable>::zeroed();
            let mut programs = vec![filler; me * ctas as usize];
            programs.extend_from_slice(&round.programs);
            let lowered = Lowered { programs, ..round };
            Ok((Arc::new(self.upload(lowered, ctas)?), launch))
        })?;
        Ok(plan_and_launch)
    }

    /// Queues one round: its buffers in the rows of their peers (sends in `INPUT`, receives in
    /// `OUTPUT`), staged where peers in other processes cannot reach them.
    fn launch_round(&self, ops: &[P2pOp], plan: &Uploaded, launch: &LaunchSpec) -> Result<()> {
        let mut staging = None;
        let mut at: Vec<u64> = ops.iter().map(|o| o.ptr).collect();
        if let Some(link) = &self.link
            && link.peer.is_some()
        {
            let ins: Vec<(u64, usize)> =
                ops.iter().filter(|o| o.dir == Direction::Send).map(|o| (o.ptr, o.bytes)).collect();
            let outs: Vec<Out> = ops
                .iter()
                .filter(|o| o.dir == Direction::Recv)
                .map(|o| Out { ptr: o.ptr, bytes: o.bytes, written: true, read: false })
                .collect();
            let st = link.stage(&ins, &outs)?;
            let (mut i, mut o) = (st.inputs.iter(), st.outputs.iter());
            for (a, op) in at.iter_mut().zip(ops) {
                let next = if op.dir == Direction::Send { i.next() } else { o.next() };
                *a = *next.expect("one staged address per buffer");
            }
            staging = Some(st);
        }
        let mut buffers = [[0u64; BUFFER_SLOTS]; MAX_RANKS];
        for (op, &a) in ops.iter().zip(&at) {
            let s = if op.dir == Direction::Send { slot::INPUT } else { slot::OUTPUT };
            buffers[op.peer][s as usize] = a;
        }
        let stream = self.ranks.first().map(|r| &*r.stream);
        let launched = crate::peer::Staging::around(staging.as_ref(), stream, || {
            // SAFETY: every address is a buffer of this rank checked by the caller (device,
            // alignment, disjointness) and borrowed for the call, or this rank's staging memory
            // standing in for it, held (by `staging`) until the call is queued; the plan's tasks
            // address `bytes` of each, in the row of its peer and the slot of its direction.
            // Not early: a round meets some ranks only, so its CTAs passing their barriers does not
            // mean every rank's round is placed, and a kernel placed early behind it could hold
            // the room a round between two other ranks needs (a possible cause of the timeout
            // seen with 4 processes on one H100; not confirmed).
            unsafe { self.launch_uploaded_as([plan], launch, buffers, false) }
        });
        drop(staging);
        launched
    }
}
