//! A [`Comm`](crate::Comm) across nodes: its rank's node communicator (oxccl's engine, NVLink)
//! and its group among the ranks of the same local index on the other nodes (an
//! [`InterNode`], NCCL by default), running the staged plans of [`oxccl_host::nodes`] on two
//! streams: intra-node steps on the rank's stream, inter-node steps on a stream of their own, each
//! step waiting for the one before it on the other side through an event, so that the inter-node
//! step of one piece runs beside the intra-node steps of the next.

use crate::comm::group::GroupCall;
use crate::comm::p2p::{P2pOp, own_transfers};
use crate::comm::{Count, Holders, Range, check_disjoint};
use crate::error::{Error, Result};
use crate::internode::{InterNode, Region, Transfer};
use crate::{Collective, Communicator, Element, ReduceOp};
use cudarc::driver::{CudaEvent, CudaStream, DevicePtr, sys};
use oxccl_host::nodes::{Kind, NodeMap, Path, Side, Staged};
use oxccl_host::p2p::Direction;
use std::sync::Arc;

/// Default bytes per piece of a staged collective: large enough that each side's calls run near
/// their bandwidth, small enough that the two sides overlap on a large buffer.
pub const DEFAULT_PIECE_BYTES: u64 = 64 << 20;

/// Steps of a staged call a rank queues before it waits for an earlier one to complete: enough for
/// the inter-node step of one piece to run beside the intra-node steps of the next two, while a rank
/// whose peers are held back (a Reduce's other local indices wait for nothing) never has more than
/// this many launches waiting in its streams.
const STEPS_AHEAD: usize = 8;

/// When the debug output began (its lines say the milliseconds since), where `OXCCL_DEBUG` (a
/// comma-separated list) names `staged` or `all`: each staged step is then printed as it is queued,
/// and a wait for the inter-node side says every few seconds where it is.
fn debug_start() -> Option<std::time::Instant> {
    static ON: std::sync::OnceLock<Option<std::time::Instant>> = std::sync::OnceLock::new();
    *ON.get_or_init(|| crate::engine::debug_names(&["staged", "all"]).then(std::time::Instant::now))
}

/// Prints a debug line for `rank` (see [`debug_start`]).
macro_rules! debug {
    ($rank:expr, $($arg:tt)*) => {
        if let Some(start) = debug_start() {
            eprintln!("oxccl[{:>8.1} ms, rank {}]: {}", start.elapsed().as_secs_f64() * 1e3, $rank, format_args!($($arg)*));
        }
    };
}

/// What a rank of a communicator across nodes holds beside its node communicator.
pub(crate) struct Nodes {
    /// Which node each rank is on.
    pub map: NodeMap,
    /// This rank in the whole world.
    pub rank: usize,
    /// This rank's group among the ranks of its local index.
    pub inter: Box<dyn InterNode>,
    /// The stream inter-node steps are queued on.
    pub inter_stream: Arc<CudaStream>,
    /// Bytes per piece.
    pub piece_bytes: u64,
    /// The bootstrap of the whole world.
    pub bootstrap: Box<dyn crate::Bootstrap>,
    /// Inter-node steps queued and not yet seen complete, oldest first, each as (ready: recorded
    /// once its inputs are there, done): whether the inter-node side makes progress
    /// ([`Nodes::progress`]).
    pub pending: std::sync::Mutex<std::collections::VecDeque<(CudaEvent, CudaEvent)>>,
    /// Set when a call failed partway (its group aborted): later calls are refused.
    pub failed: std::sync::atomic::AtomicBool,
    /// How long the inter-node side may make no progress before it is given up on.
    pub timeout: std::time::Duration,
}

/// `op` on `dtype` where a staged call takes it. Avg averages each node's ranks on the node side,
/// then the nodes' averages on the inter-node side: (1/nodes)·Σ (1/per node)·Σ, the average up to
/// rounding for floats. Integers would lose each node's remainder: refused.
fn staged_op(op: ReduceOp, dtype: crate::DType) -> Result<()> {
    if op == ReduceOp::Avg && !dtype.is_float() {
        return Err(Error::Unsupported {
            what: format!(
                "ReduceOp::Avg of {} across nodes (an average of per-node averages: integers would lose the remainders; Sum, then divide)",
                dtype.nccl_name()
            ),
        });
    }
    Ok(())
}

/// A group's collective planned across nodes ([`Nodes::plan_call`]).
pub(crate) struct PlannedCall {
    staged: Staged,
    src: Source,
    recv: sys::CUdeviceptr,
    dtype: crate::DType,
    op: ReduceOp,
}

/// A rank's point-to-point transfers by the engine that carries them ([`Nodes::route`]).
pub(crate) struct Routed {
    /// With ranks of its node, peers by their index in the node.
    within: Vec<P2pOp>,
    /// With ranks of its local index on other nodes, peers by node.
    across: Vec<Transfer>,
}

/// What [`Nodes::progress`] saw.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) struct Progress {
    /// Inter-node steps that completed since the last look.
    pub done: usize,
    /// Inter-node steps still pending.
    pub pending: usize,
    /// Whether the oldest pending step has its inputs and has not completed: time counts against
    /// the inter-node side only then (not while the rank's own work runs before it).
    pub stalled: bool,
}

/// One call of the node communicator on regions (`send`: `None` in place; an empty list on a rank
/// that sends nothing, as a Broadcast's other ranks).
fn node_call<T: Element>(
    node: &Communicator,
    collective: Collective,
    len: u64,
    send: Option<&[Region<T>]>,
    recv: &mut Region<T>,
    op: ReduceOp,
) -> Result<()> {
    let count = Count::FromRecv(len as usize);
    node.collective::<T, Region<T>, Region<T>>(collective, count, send, std::slice::from_mut(recv), op, Holders::All)
}

/// Where a staged call's data comes from on this rank.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum Source {
    /// In place: the receive buffer.
    InPlace,
    /// A send buffer at this device address.
    At(sys::CUdeviceptr),
    /// Out of place, with nothing sent from this rank (a Broadcast's other ranks).
    Nothing,
}

impl Drop for Nodes {
    /// The inter-node side ends before its group is destroyed (NCCL's destroy waits for its calls):
    /// a side that makes no progress for the timeout is aborted instead of waited for.
    fn drop(&mut self) {
        if self.wait_inter(|| Ok(true)).is_err() {
            self.fail();
        }
    }
}

impl Nodes {
    /// Drops the inter-node steps that have completed from [`Nodes::pending`].
    pub(crate) fn progress(&self) -> Result<Progress> {
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        let mut done = 0;
        let query = |e: &CudaEvent| e.try_is_complete().map_err(Error::driver("cuEventQuery"));
        let mut stalled = false;
        while let Some((ready, end)) = pending.front() {
            if !query(end)? {
                stalled = query(ready)?;
                break;
            }
            pending.pop_front();
            done += 1;
        }
        Ok(Progress { done, pending: pending.len(), stalled })
    }

    /// Waits until the inter-node steps queued so far complete; where none completes for
    /// [`Nodes::timeout`] while the oldest has its inputs, or the engine reports an error, aborts
    /// the group (marking the communicator failed) and returns the error.
    pub(crate) fn wait_inter(&self, rank_done: impl Fn() -> Result<bool>) -> Result<()> {
        let mut since = std::time::Instant::now();
        let mut said = std::time::Instant::now();
        loop {
            if let Err(e) = self.inter.check() {
                self.fail();
                return Err(e);
            }
            let p = self.progress()?;
            if p.pending == 0 && rank_done()? {
                return Ok(());
            }
            if debug_start().is_some() && said.elapsed() > std::time::Duration::from_secs(5) {
                said = std::time::Instant::now();
                debug!(self.rank, "waiting: {p:?}");
            }
            if p.done > 0 || !p.stalled {
                since = std::time::Instant::now();
            } else if since.elapsed() > self.timeout {
                self.fail();
                return Err(Error::InterNode {
                    call: "synchronize",
                    why: format!(
                        "rank {}: no inter-node step completed for {:?} (a node stopped?); the communicator was aborted",
                        self.rank, self.timeout
                    ),
                });
            }
            std::thread::sleep(std::time::Duration::from_micros(200));
        }
    }

    /// Waits (polling) until step `step`'s completion event `done` has fired: the bound on how far a
    /// rank queues ahead of its peers ([`STEPS_AHEAD`]). An intra-node step ends within the engine's
    /// own timeouts; an inter-node step (`ready`: recorded once its inputs were there) is given up on
    /// as [`Nodes::wait_inter`] does, when the engine reports an error or when it has had its inputs
    /// for [`Nodes::timeout`] without completing. Time spent behind the caller's earlier work counts
    /// against nothing.
    fn wait_step(&self, done: &CudaEvent, ready: Option<&CudaEvent>, step: usize) -> Result<()> {
        let query = |e: &CudaEvent| e.try_is_complete().map_err(Error::driver("cuEventQuery"));
        let mut stalled_since = None;
        while !query(done)? {
            self.inter.check()?;
            if let Some(r) = ready
                && query(r)?
            {
                let since = *stalled_since.get_or_insert_with(std::time::Instant::now);
                if since.elapsed() > self.timeout {
                    return Err(Error::InterNode {
                        call: "staged step",
                        why: format!(
                            "rank {}: inter-node step {step} had its inputs and did not complete within {:?}",
                            self.rank, self.timeout
                        ),
                    });
                }
            }
            std::thread::sleep(std::time::Duration::from_micros(20));
        }
        Ok(())
    }

    /// Aborts the inter-node group and refuses later calls.
    pub(crate) fn fail(&self) {
        self.failed.store(true, std::sync::atomic::Ordering::SeqCst);
        self.inter.abort();
    }

    /// Runs `staged` for this rank: `src` and `recv` are the device addresses of the caller's
    /// buffers, held by the caller until the steps are queued; `stream` is the rank's. The call ends
    /// on `stream` (it waits for the last inter-node step).
    pub(crate) fn run<T: Element>(
        &self,
        node: &Communicator,
        stream: &Arc<CudaStream>,
        staged: &Staged,
        src: Source,
        recv: sys::CUdeviceptr,
        op: ReduceOp,
    ) -> Result<()> {
        staged_op(op, T::DTYPE)?;
        let g = self.map.per_node() as u64;
        let me = self.rank as u32;
        let local = self.map.local(me) as u64;
        let e = std::mem::size_of::<T>() as u64;
        let inter = &self.inter_stream;
        let region = |base: sys::CUdeviceptr, at: u64, len: u64| Region::<T>::new(base, at, len, stream);
        // Partial sums between the sides, in the stream's pool: freed on the rank's stream, which
        // has waited for the inter-node side by then.
        let scratch = if staged.scratch > 0 {
            let bytes = staged.scratch as usize * std::mem::size_of::<T>();
            match stream.alloc_zeros::<u8>(bytes) {
                Ok(b) => Some(b),
                Err(e) => {
                    // The peers' steps would wait for this rank's: they end with the group.
                    self.fail();
                    return Err(Error::driver("cuMemAllocAsync")(e));
                }
            }
        } else {
            None
        };
        let scratch_ptr = match &scratch {
            Some(b) => b.device_ptr(stream).0,
            None => 0,
        };
        // The send buffer's address, or in place the receive buffer's.
        let input = match src {
            Source::At(s) => s,
            _ => recv,
        };
        let mut events: Vec<CudaEvent> = Vec::with_capacity(staged.steps.len());
        // Per inter-node step, the event recorded once its inputs are there.
        let mut readies: Vec<Option<CudaEvent>> = Vec::with_capacity(staged.steps.len());
        let mut queue = || -> Result<()> {
            // A stream capturing a graph is not waited on: its steps are recorded, not run.
            let bounded = !crate::comm::any_capturing([&**stream, &**inter].into_iter())?;
            // The inter-node side starts after what the caller queued before the call.
            inter.join(stream).map_err(Error::driver("cuStreamWaitEvent"))?;
            debug!(me, "staged {:?} of {}: {} steps", staged.collective, staged.count, staged.steps.len());
            for (i, step) in staged.steps.iter().enumerate() {
                if bounded && i >= STEPS_AHEAD {
                    let j = i - STEPS_AHEAD;
                    self.wait_step(&events[j], readies[j].as_ref(), j)?;
                }
                let on: &Arc<CudaStream> = match step.side {
                    Side::Intra => stream,
                    Side::Inter => inter,
                };
                if let Some(a) = step.after {
                    on.wait(&events[a]).map_err(Error::driver("cuStreamWaitEvent"))?;
                }
                let ready = match step.side {
                    Side::Inter => Some(on.record_event(None).map_err(Error::driver("cuEventRecord"))?),
                    Side::Intra => None,
                };
                let takes_part = step.takes_part(self.map.node(me), local as u32);
                let what = if takes_part { "queueing" } else { "skipping" };
                debug!(me, "{what} step {i} {:?} {:?} after {:?}", step.side, step.kind, step.after);
                match step.kind {
                    _ if !takes_part => {}
                    Kind::IntraReduceScatter { at, len } => match src {
                        Source::At(s) => {
                            let from = [region(s, at, g * len)];
                            let mut to = region(recv, at + local * len, len);
                            node_call(node, Collective::ReduceScatter, len, Some(&from), &mut to, op)?;
                        }
                        _ => node_call(node, Collective::ReduceScatter, len, None, &mut region(recv, at, g * len), op)?,
                    },
                    Kind::InterAllReduce { at, len, sharded } => {
                        let at = if sharded { at + local * len } else { at };
                        // SAFETY: inside the caller's receive buffer, which outlives the call (it ends on
                        // the rank's stream after this step).
                        unsafe { self.inter.all_reduce(recv + at * e, len as usize, T::DTYPE, op, inter)? };
                    }
                    Kind::IntraAllGather { at, len } => {
                        let mut buf = region(recv, at, g * len);
                        node_call(node, Collective::AllGather, len, None, &mut buf, ReduceOp::Sum)?;
                    }
                    Kind::IntraAllReduce { at, len } => {
                        let from: Option<[Region<T>; 1]> = match src {
                            Source::At(s) => Some([region(s, at, len)]),
                            _ => None,
                        };
                        node_call(
                            node,
                            Collective::AllReduce,
                            len,
                            from.as_ref().map(|f| &f[..]),
                            &mut region(recv, at, len),
                            op,
                        )?;
                    }
                    Kind::IntraBroadcast { at, len, root_local } => {
                        let mut to = region(recv, at, len);
                        let collective = Collective::Broadcast { root: root_local };
                        match src {
                            Source::At(s) if local == root_local as u64 => {
                                node_call(node, collective, len, Some(&[region(s, at, len)]), &mut to, ReduceOp::Sum)?;
                            }
                            Source::InPlace => node_call(node, collective, len, None, &mut to, ReduceOp::Sum)?,
                            _ => node_call(node, collective, len, Some(&[]), &mut to, ReduceOp::Sum)?,
                        }
                    }
                    Kind::InterBroadcast { at, len, root_node, sharded, src_at } => {
                        let at = if sharded { at + local * len } else { at };
                        let to = recv + at * e;
                        // Out of place the root sends from its send buffer; in place (and on the other
                        // ranks) from where the data lands.
                        let out_of_place = matches!(src, Source::At(_)) && src_at.is_some();
                        let from = match (src, src_at) {
                            (Source::At(s), Some(o)) if self.map.node(me) == root_node => s + o * e,
                            _ => to,
                        };
                        let root = root_node as usize;
                        // SAFETY: inside the caller's buffers, as above; `from` is `to` where in place.
                        unsafe { self.inter.broadcast(from, to, len as usize, T::DTYPE, root, !out_of_place, inter)? };
                    }
                    Kind::IntraAllGatherOf { node: k, len } => {
                        let mut buf = region(recv, k as u64 * g * len, g * len);
                        node_call(node, Collective::AllGather, len, None, &mut buf, ReduceOp::Sum)?;
                    }
                    Kind::IntraReduceScatterOf { node: k, len, scratch_at } => {
                        let from = [region(input, k as u64 * g * len, g * len)];
                        let mut to = region(scratch_ptr, scratch_at, len);
                        node_call(node, Collective::ReduceScatter, len, Some(&from), &mut to, op)?;
                    }
                    Kind::IntraReduce { at, len, root_local, scratch_at } => {
                        let from = [region(input, at, len)];
                        let mut to = [region(scratch_ptr, scratch_at, len)];
                        let root = root_local as usize;
                        let to: &mut [Region<T>] = if local as usize == root { &mut to } else { &mut [] };
                        node.collective::<T, Region<T>, Region<T>>(
                            Collective::Reduce { root: root_local },
                            Count::FromSend(len as usize),
                            Some(&from),
                            to,
                            op,
                            Holders::Root(root),
                        )?;
                    }
                    Kind::InterReduce { len, scratch_at, root_node, into, scatter } => {
                        let from = scratch_ptr + scratch_at * e;
                        let into = match (scatter, src) {
                            // In place, a ReduceScatter's block is this rank's block of the buffer.
                            (true, Source::InPlace) => recv + me as u64 * len * e,
                            (true, _) => recv,
                            (false, Source::Nothing) => from,
                            (false, _) => recv + into * e,
                        };
                        // SAFETY: the scratch slot and the caller's receive buffer, as above.
                        unsafe {
                            self.inter.reduce(from, into, len as usize, T::DTYPE, op, root_node as usize, inter)?
                        };
                    }
                }
                events.push(on.record_event(None).map_err(Error::driver("cuEventRecord"))?);
                readies.push(ready);
            }
            debug!(me, "queued every step");
            Ok(())
        };
        let queued = queue();
        if let Err(e) = &queued {
            debug!(me, "queueing failed: {e}");
        }
        // Whatever was queued, the call ends on the rank's stream, and the scratch is freed after
        // it. Peers must not wait for steps this rank did not queue: a failure aborts the group.
        let joined = stream.join(inter).map_err(Error::driver("cuStreamWaitEvent"));
        if queued.is_err() {
            self.fail();
            // The node's peers would wait their timeout for the node steps this rank did not queue,
            // then again in every later call: they give up at once (`Error::Withdrawn`).
            node.withdraw();
        }
        if joined.is_ok() {
            drop(scratch);
        } else {
            // The inter-node side may still read it, with nothing ordering the free after it.
            std::mem::forget(scratch);
        }
        // Each inter-node step's (ready, done) pair: its done event is the one later steps waited on.
        let inter_steps = readies.into_iter().zip(events).filter_map(|(ready, done)| Some((ready?, done)));
        self.pending.lock().unwrap_or_else(|p| p.into_inner()).extend(inter_steps);
        let progressed = self.progress().map(drop);
        queued.and(joined).and(progressed)
    }

    /// The staged plan of one collective of a rank's group (`call`, buffers by address, checked by
    /// the caller), where its data comes from and where it lands: every member's before any is
    /// queued, so that a group refused across nodes queues nothing.
    pub(crate) fn plan_call(&self, call: &GroupCall) -> Result<PlannedCall> {
        let (count, me) = (call.member.count, self.rank as u32);
        staged_op(call.op, call.dtype)?;
        // `align` is the size of the element (or unit) the call moves.
        let piece = (self.piece_bytes / call.align as u64).max(1);
        let staged = match call.member.collective {
            Collective::AllReduce => Staged::all_reduce(&self.map, count, piece),
            Collective::ReduceScatter => Staged::reduce_scatter(&self.map, count)?,
            Collective::AllGather => Staged::all_gather(&self.map, count)?,
            Collective::Broadcast { root } => Staged::broadcast(&self.map, count, root, piece),
            Collective::Reduce { root } => Staged::reduce(&self.map, count, root, piece),
            Collective::AllToAll => {
                return Err(Error::Unsupported { what: format!("all_to_all across {} nodes", self.map.nodes()) });
            }
        };
        let (src, recv) = match call.member.collective {
            _ if call.member.in_place => (Source::InPlace, call.output),
            Collective::Broadcast { root } if root != me => (Source::Nothing, call.output),
            // A Reduce's other ranks have no receive buffer: the address is never written.
            Collective::Reduce { root } if root != me => (Source::At(call.input), call.input),
            _ => (Source::At(call.input), call.output),
        };
        Ok(PlannedCall { staged, src, recv, dtype: call.dtype, op: call.op })
    }

    /// Runs a collective [`Nodes::plan_call`] planned.
    pub(crate) fn call(&self, node: &Communicator, stream: &Arc<CudaStream>, c: &PlannedCall) -> Result<()> {
        crate::with_element!(c.dtype, |T| self.run::<T>(node, stream, &c.staged, c.src, c.recv, c.op))
    }

    /// Sorts this rank's point-to-point transfers `ops` (peers by world rank) by the engine that
    /// carries them, checking them: ranks of its node through the node communicator, the ranks of
    /// its local index on other nodes through its inter-node group. A transfer with a rank of
    /// another node and another local index is refused (only a rank between the two could carry
    /// it), unless it is empty: it is then left out, as the peer leaves out its half.
    pub(crate) fn route(&self, node: &Communicator, ops: &[P2pOp]) -> Result<Routed> {
        let world = self.map.world() as usize;
        let me = self.rank as u32;
        let (my_node, my_local) = (self.map.node(me), self.map.local(me));
        let device = node.rank_device(my_local as usize);
        let (mut within, mut across, mut ranges) = (Vec::new(), Vec::new(), Vec::new());
        for op in ops {
            if op.peer >= world {
                return Err(Error::NoSuchRank { rank: op.peer, ranks: world });
            }
            let q = op.peer as u32;
            let send = op.dir == Direction::Send;
            match self.map.path(me, q) {
                Path::Node { local } => within.push(P2pOp { peer: local as usize, ..*op }),
                Path::Group { node } => {
                    across.push(Transfer { peer: node as usize, send, ptr: op.ptr, bytes: op.bytes });
                }
                // Nothing to carry: the peer skips its empty half too (the path is symmetric).
                Path::Relay if op.bytes == 0 => continue,
                Path::Relay => {
                    let (node_q, local_q) = (self.map.node(q), self.map.local(q));
                    return Err(Error::Unsupported {
                        what: format!(
                            "a transfer between rank {me} (node {my_node}, local rank {my_local}) and rank {q} \
                             (node {node_q}, local rank {local_q}): across nodes, sends and receives run between \
                             ranks of the same local rank"
                        ),
                    });
                }
            }
            let buffer = if send { "send buffer" } else { "receive buffer" };
            let end = op.ptr + op.bytes as u64;
            ranges.push(Range { start: op.ptr, end, rank: self.rank, device, writes: !send, buffer });
        }
        check_disjoint(&ranges, "a group's receive buffers and the other buffers of the group")?;
        own_transfers(&within, my_local as usize)?;
        if !across.is_empty() && !self.inter.sends_and_receives() {
            return Err(Error::Unsupported {
                what: "sends and receives across nodes on this inter-node engine".into(),
            });
        }
        Ok(Routed { within, across })
    }

    /// Queues transfers [`Nodes::route`] sorted: those across nodes on the inter-node stream,
    /// which joins the rank's stream before and after them.
    pub(crate) fn p2p(&self, node: &Communicator, stream: &Arc<CudaStream>, routed: Routed) -> Result<()> {
        let Routed { within, across } = routed;
        if !within.is_empty()
            && let Err(e) = node.p2p(&within)
        {
            // The peers on other nodes would wait for this rank's half: they end with the group.
            if !across.is_empty() {
                self.fail();
            }
            return Err(e);
        }
        if across.is_empty() {
            return Ok(());
        }
        let inter = &self.inter_stream;
        let queued = (|| -> Result<(CudaEvent, CudaEvent)> {
            inter.join(stream).map_err(Error::driver("cuStreamWaitEvent"))?;
            let ready = inter.record_event(None).map_err(Error::driver("cuEventRecord"))?;
            // SAFETY: the caller's buffers, borrowed until the call is queued and ordered on the
            // rank's stream, which waits for the inter-node stream below.
            unsafe { self.inter.send_recv(&across, inter)? };
            let done = inter.record_event(None).map_err(Error::driver("cuEventRecord"))?;
            Ok((ready, done))
        })();
        let joined = stream.join(inter).map_err(Error::driver("cuStreamWaitEvent"));
        match queued {
            Ok(events) => self.pending.lock().unwrap_or_else(|p| p.into_inner()).push_back(events),
            // The peers' halves would wait for this rank's: they end with the group.
            Err(e) => {
                self.fail();
                return Err(e);
            }
        }
        joined.and(self.progress().map(drop))
    }
}

#[cfg(test)]
mod tests {
    use super::STEPS_AHEAD;
    use oxccl_host::nodes::{NodeMap, Side, Staged};

    /// One operation a rank queues on one of its two streams, in the model of a series of calls.
    struct Op {
        side: Side,
        /// Operations of the same rank it waits for (its stream's previous one aside).
        deps: Vec<usize>,
        /// The collective it takes part in: (call, step); `None` for joins and skipped steps.
        collective: Option<(usize, usize)>,
        /// Where the host waits before queueing it: the operation of step `i - ahead` of its call.
        held_by: Option<usize>,
    }

    /// What rank `r` of `map` queues for `calls` made back to back, as [`super::Nodes::run`] does:
    /// the inter-node stream joins the rank's stream at each call's start, each step waits for its
    /// stream's previous operation and for its `after` step (also where the rank skips it), the
    /// rank's stream joins the inter-node stream at the call's end; the host queues step `i` once
    /// step `i - ahead` has completed.
    fn ops_of(map: &NodeMap, r: u32, calls: &[Staged], order: &[usize], ahead: usize) -> Vec<Op> {
        let mut ops: Vec<Op> = Vec::new();
        let last = |ops: &[Op], side: Side| ops.iter().rposition(|o| o.side == side);
        for &c in order {
            let staged = &calls[c];
            let joined = last(&ops, Side::Intra).into_iter().collect();
            ops.push(Op { side: Side::Inter, deps: joined, collective: None, held_by: None });
            let mut at = Vec::with_capacity(staged.steps.len());
            for (i, step) in staged.steps.iter().enumerate() {
                let takes = step.takes_part(map.node(r), map.local(r));
                at.push(ops.len());
                ops.push(Op {
                    side: step.side,
                    deps: step.after.map(|a| at[a]).into_iter().collect(),
                    collective: takes.then_some((c, i)),
                    held_by: i.checked_sub(ahead).map(|j| at[j]),
                });
            }
            let joined = last(&ops, Side::Inter).into_iter().collect();
            ops.push(Op { side: Side::Intra, deps: joined, collective: None, held_by: None });
        }
        ops
    }

    /// Whether every rank of `map` completes `calls` made back to back (see [`ops_of`]), rank `r`
    /// making them in the order `orders[r]`: a collective step completes on all its members at
    /// once, when each can run it.
    fn series_completes(map: &NodeMap, calls: &[Staged], orders: &[Vec<usize>], ahead: usize) -> bool {
        let world = map.world() as usize;
        let ops: Vec<Vec<Op>> = (0..world).map(|r| ops_of(map, r as u32, calls, &orders[r], ahead)).collect();
        // Each rank's operation of every (call, step) it takes part in.
        let index: Vec<std::collections::HashMap<(usize, usize), usize>> = ops
            .iter()
            .map(|o| o.iter().enumerate().filter_map(|(k, op)| op.collective.map(|cs| (cs, k))).collect())
            .collect();
        // The ranks of rank `r`'s communicator on `side` (its node's for an intra-node step, its
        // local index's for an inter-node one) that take part in (call, step) `cs`.
        let members = |r: usize, side: Side, cs: (usize, usize)| -> Vec<usize> {
            let (node, local) = (map.node(r as u32), map.local(r as u32));
            (0..world)
                .filter(|&q| match side {
                    Side::Intra => map.node(q as u32) == node,
                    Side::Inter => map.local(q as u32) == local,
                })
                .filter(|&q| index[q].contains_key(&cs))
                .collect()
        };
        let mut queued = vec![0usize; world];
        let mut done: Vec<Vec<bool>> = ops.iter().map(|o| vec![false; o.len()]).collect();
        let ready = |done: &[Vec<bool>], queued: &[usize], r: usize, k: usize| {
            let op = &ops[r][k];
            k < queued[r]
                && !done[r][k]
                && (0..k).rev().find(|&j| ops[r][j].side == op.side).is_none_or(|j| done[r][j])
                && op.deps.iter().all(|&d| done[r][d])
        };
        loop {
            let mut moved = false;
            for r in 0..world {
                while queued[r] < ops[r].len() && ops[r][queued[r]].held_by.is_none_or(|h| done[r][h]) {
                    queued[r] += 1;
                    moved = true;
                }
            }
            for r in 0..world {
                for k in 0..ops[r].len() {
                    if !ready(&done, &queued, r, k) {
                        continue;
                    }
                    match ops[r][k].collective {
                        None => done[r][k] = true,
                        Some((c, i)) => {
                            let all = members(r, ops[r][k].side, (c, i));
                            if !all.iter().all(|&q| ready(&done, &queued, q, index[q][&(c, i)])) {
                                continue;
                            }
                            for q in all {
                                done[q][index[q][&(c, i)]] = true;
                            }
                        }
                    }
                    moved = true;
                }
            }
            if !moved {
                return done.iter().all(|d| d.iter().all(|&x| x));
            }
        }
    }

    /// The staged test's series of calls (2 nodes of 4, pieces of 1024 elements: AllReduce,
    /// AllGather, Broadcast, ReduceScatter and Reduce, each twice, case after case) completes
    /// with steps queued ahead bounded as the engine bounds them, and each communicator's members
    /// take part in the same calls in the same order (their calls are matched by count). A model
    /// of the queues only: where the staged test stalls on a GPU, the cause is outside it.
    #[test]
    fn series_of_staged_calls_complete_in_step() {
        let map = NodeMap::by_count(8, 4).unwrap();
        let world = 8u32;
        let mut calls = Vec::new();
        for (case, &n) in [1u64, 19523, 3000, 18004, 4097, 257].iter().enumerate() {
            let m = n.min(3000);
            let root = case as u32 % world;
            calls.extend([
                Staged::all_reduce(&map, n, 1024),
                Staged::all_reduce(&map, n, 1024),
                Staged::all_gather(&map, m).unwrap(),
                Staged::all_gather(&map, m).unwrap(),
                Staged::broadcast(&map, n, root, 1024),
                Staged::broadcast(&map, n, (root + 3) % world, 1024),
                Staged::reduce_scatter(&map, m).unwrap(),
                Staged::reduce_scatter(&map, m).unwrap(),
                Staged::reduce(&map, n, root, 1024),
                Staged::reduce(&map, n, root, 1024),
            ]);
        }
        let in_order: Vec<usize> = (0..calls.len()).collect();
        let orders = vec![in_order.clone(); world as usize];
        // Members of a communicator (a node, a local index) take part in the same steps in order.
        let taken = |r: u32, side: Side| -> Vec<(usize, usize)> {
            ops_of(&map, r, &calls, &in_order, STEPS_AHEAD)
                .iter()
                .filter(|o| o.side == side)
                .filter_map(|o| o.collective)
                .collect()
        };
        for r in 0..world {
            for q in 0..world {
                if map.node(q) == map.node(r) {
                    assert_eq!(taken(r, Side::Intra), taken(q, Side::Intra), "node of ranks {r} and {q}");
                }
                if map.local(q) == map.local(r) {
                    assert_eq!(taken(r, Side::Inter), taken(q, Side::Inter), "group of ranks {r} and {q}");
                }
            }
        }
        let (node_steps, group_steps) = (taken(1, Side::Intra).len(), taken(1, Side::Inter).len());
        assert!(node_steps > 400 && group_steps > 250, "{node_steps} node and {group_steps} group steps");
        for ahead in [1, 2, STEPS_AHEAD] {
            assert!(series_completes(&map, &calls, &orders, ahead), "{ahead} ahead");
        }
        // The model can tell a series that cannot complete: one rank making two calls in the other
        // order waits for its peers' second call while they wait for its first.
        let mut swapped = orders.clone();
        swapped[0].swap(0, 1);
        assert!(!series_completes(&map, &calls, &swapped, STEPS_AHEAD), "calls out of order complete");
    }

    /// Every staged collective completes with any bound from one step to [`STEPS_AHEAD`] on steps
    /// queued ahead, on 2 to 4 nodes of 1 to 4 ranks, whole and in pieces, every root; with a rank
    /// allowed to queue nothing, none does (the model can tell).
    #[test]
    fn staged_calls_complete_with_steps_queued_ahead_bounded() {
        let mut checked = 0;
        for nodes in 2..=4 {
            for per_node in 1..=4 {
                let map = NodeMap::by_count(nodes * per_node, per_node).unwrap();
                let world = (nodes * per_node) as u32;
                // Every rank makes the one call.
                let one = vec![vec![0]; world as usize];
                for (count, piece) in [(1u64, 1u64), (37, 4), (1000, 64), (4096, 4096)] {
                    let mut all = vec![
                        Staged::all_reduce(&map, count, piece),
                        Staged::all_gather(&map, count).unwrap(),
                        Staged::reduce_scatter(&map, count).unwrap(),
                    ];
                    for root in 0..world {
                        all.push(Staged::broadcast(&map, count, root, piece));
                        all.push(Staged::reduce(&map, count, root, piece));
                    }
                    for staged in &all {
                        for ahead in 1..=STEPS_AHEAD {
                            assert!(
                                series_completes(&map, std::slice::from_ref(staged), &one, ahead),
                                "{staged:?} on {nodes} x {per_node}, {ahead} ahead"
                            );
                        }
                        checked += 1;
                    }
                    assert!(!series_completes(&map, &all[..1], &one, 0), "nothing queued completes");
                }
            }
        }
        assert!(checked > 300, "{checked}");
    }
}
