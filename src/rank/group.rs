//! Groups of a rank's calls, as between `ncclGroupStart` and `ncclGroupEnd`: collectives run
//! together in as few launches as the buffer table holds, sends and receives in rounds.

use super::Comm;
use crate::comm::group::{GroupCall, call_ranges};
use crate::comm::ordinal_of;
use crate::comm::p2p::P2pOp;
use crate::comm::{check_aligned, check_disjoint};
use crate::error::{Error, Result};
use crate::plain::{Plain, unit_bytes, unit_dtype};
use crate::{Collective, Element, ReduceOp};
use cudarc::driver::{DevicePtr, DevicePtrMut, SyncOnDrop};
use oxccl_host::group::Member;
use oxccl_host::p2p::Direction;

/// Calls of one rank queued together and run by [`Group::run`], as between `ncclGroupStart` and
/// `ncclGroupEnd`. Made by [`Comm::group`]; the buffers stay borrowed until the group runs or drops
/// (dropping it runs nothing).
///
/// **Collectives** (AllReduce, ReduceScatter, AllGather, Broadcast, Reduce, in place or not): those
/// of one element type and operator share launches and their barriers, instead of one each: a
/// launch holds up to one row of 4 buffers per CTA of the rank (16 at most), an in-place
/// AllReduce, Broadcast or Reduce taking one buffer and any other collective two (with 16 CTAs per
/// rank, 64 in-place AllReduces or 32 out of place in one launch); a launch closes early where a
/// large member would otherwise be left far less than its share of the CTAs. Every rank must queue
/// the same collectives (kind, count, root, in place or not, type, operator) in the same order,
/// else [`Error::CallMismatch`] (a group that only has more members than its peers' is caught at
/// the first launch that differs). The collectives' buffers must not overlap where one is written
/// (sends and receives run after them, so their buffers may be the collectives' too). Each distinct
/// group (its members' kinds, counts and order) keeps its plan on the device for the next run, until
/// [`Comm::clear_plans`]: a workload whose buckets keep changing should call it now and then.
///
/// **Sends and receives** run after the collectives, in as few launches as their matching allows
/// (one launch where every peer gets at most one send and one receive). A rank's transfers match
/// its peers' in order per peer and direction: the `i`-th send of rank `a` to `b` (in this group or
/// a later call) is the `i`-th receive of `b` from `a`, and the two must have the same length in
/// bytes (else [`Error::CallMismatch`]; a transfer the peer never makes ends in [`Error::Timeout`]).
/// Transfers to the rank itself are copies, paired in order.
///
/// **Across nodes** ([`Comm::with_inter_node`]) each collective runs as a staged call of its own,
/// in order, then the transfers: with ranks of the node on oxccl's engine, with the ranks of this
/// rank's local index on other nodes on the inter-node engine; a non-empty transfer with any other
/// rank (or any across nodes where the engine has no [`send_recv`](crate::internode::InterNode::send_recv)),
/// and `Avg`, are refused ([`Error::Unsupported`]) before anything of the group is queued.
///
/// **Host cost.** Where cudarc tracks events (a context with several streams, unless
/// `disable_event_tracking` was called before the buffers were made), it orders every buffer a
/// group takes with a stream wait and an event record: on one thread about 0.6 µs a buffer, and
/// several times that when threads of one context queue at once; a bucket of many small tensors
/// pays it per tensor.
pub struct Group<'a> {
    comm: &'a Comm,
    calls: Vec<GroupCall>,
    ops: Vec<P2pOp>,
    /// cudarc's ordering guards of the buffers: dropped once the group is queued.
    guards: Vec<SyncOnDrop<'a>>,
}

impl std::fmt::Debug for Group<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Group")
            .field("rank", &self.comm.rank())
            .field("collectives", &self.calls)
            .field("transfers", &self.ops)
            .finish()
    }
}

impl Comm {
    /// An empty [`Group`] of this rank's calls.
    pub fn group(&self) -> Group<'_> {
        Group { comm: self, calls: Vec::new(), ops: Vec::new(), guards: Vec::new() }
    }
}

/// A buffer of a queued collective: its address.
struct Buf {
    ptr: u64,
}

impl<'a> Group<'a> {
    /// Queues sending `buf` (all of it; any [`Plain`] type) to rank `peer`.
    pub fn send<T: Plain, S: DevicePtr<T>>(&mut self, buf: &'a S, peer: usize) -> Result<&mut Self> {
        self.check_peer(buf.len(), ordinal_of(buf), peer, "send buffer")?;
        let (ptr, guard) = buf.device_ptr(self.comm.stream());
        self.guards.push(guard);
        self.add_op(ptr, buf.len() * std::mem::size_of::<T>(), std::mem::align_of::<T>(), peer, Direction::Send)
    }

    /// Queues receiving into `buf` (all of it) from rank `peer`.
    pub fn recv<T: Plain, R: DevicePtrMut<T>>(&mut self, buf: &'a mut R, peer: usize) -> Result<&mut Self> {
        self.check_peer(buf.len(), ordinal_of(buf), peer, "receive buffer")?;
        let bytes = buf.len() * std::mem::size_of::<T>();
        let (ptr, guard) = buf.device_ptr_mut(self.comm.stream());
        self.guards.push(guard);
        self.add_op(ptr, bytes, std::mem::align_of::<T>(), peer, Direction::Recv)
    }

    /// Queues [`Comm::all_reduce`].
    pub fn all_reduce<T: Element, S: DevicePtr<T>, R: DevicePtrMut<T>>(
        &mut self,
        send: &'a S,
        recv: &'a mut R,
        op: ReduceOp,
    ) -> Result<&mut Self> {
        let n = send.len();
        let s = self.input(send, n, "send buffer")?;
        let r = self.output(recv, n, "receive buffer")?;
        self.reducing::<T>(Collective::AllReduce, n, Some(s), Some(r), false, op)
    }

    /// Queues [`Comm::all_reduce_in_place`].
    pub fn all_reduce_in_place<T: Element, R: DevicePtrMut<T>>(
        &mut self,
        buf: &'a mut R,
        op: ReduceOp,
    ) -> Result<&mut Self> {
        let n = buf.len();
        let b = self.output(buf, n, "buffer")?;
        self.reducing::<T>(Collective::AllReduce, n, None, Some(b), true, op)
    }

    /// Queues [`Comm::reduce_scatter`]: `recv` holds the count, `send` world × count elements.
    pub fn reduce_scatter<T: Element, S: DevicePtr<T>, R: DevicePtrMut<T>>(
        &mut self,
        send: &'a S,
        recv: &'a mut R,
        op: ReduceOp,
    ) -> Result<&mut Self> {
        let n = recv.len();
        let s = self.input(send, n * self.comm.world(), "send buffer")?;
        let r = self.output(recv, n, "receive buffer")?;
        self.reducing::<T>(Collective::ReduceScatter, n, Some(s), Some(r), false, op)
    }

    /// Queues [`Comm::reduce_scatter_in_place`].
    pub fn reduce_scatter_in_place<T: Element, R: DevicePtrMut<T>>(
        &mut self,
        buf: &'a mut R,
        op: ReduceOp,
    ) -> Result<&mut Self> {
        let n = self.comm.block(buf.len(), "in-place reduce_scatter buffer")?;
        let b = self.output(buf, buf.len(), "buffer")?;
        self.reducing::<T>(Collective::ReduceScatter, n, None, Some(b), true, op)
    }

    /// Queues [`Comm::reduce`]: `recv` on the root only.
    pub fn reduce<T: Element, S: DevicePtr<T>, R: DevicePtrMut<T>>(
        &mut self,
        send: &'a S,
        recv: Option<&'a mut R>,
        op: ReduceOp,
        root: usize,
    ) -> Result<&mut Self> {
        let n = send.len();
        let s = self.input(send, n, "send buffer")?;
        let r = self.root_buffer(recv, n, root, "reduce receive buffer", |g, b| g.output(b, n, "receive buffer"))?;
        self.reducing::<T>(Collective::Reduce { root: root as u32 }, n, Some(s), r, false, op)
    }

    /// Queues [`Comm::reduce_in_place`].
    pub fn reduce_in_place<T: Element, R: DevicePtrMut<T>>(
        &mut self,
        buf: &'a mut R,
        op: ReduceOp,
        root: usize,
    ) -> Result<&mut Self> {
        let n = buf.len();
        self.check_root(root)?;
        let b = self.output(buf, n, "buffer")?;
        self.reducing::<T>(Collective::Reduce { root: root as u32 }, n, None, Some(b), true, op)
    }

    /// Queues [`Comm::all_gather`]: `recv` holds world × `send.len()` elements.
    pub fn all_gather<T: Plain, S: DevicePtr<T>, R: DevicePtrMut<T>>(
        &mut self,
        send: &'a S,
        recv: &'a mut R,
    ) -> Result<&mut Self> {
        let n = send.len();
        let s = self.input(send, n, "send buffer")?;
        let r = self.output(recv, n * self.comm.world(), "receive buffer")?;
        self.copying::<T>(Collective::AllGather, n, Some(s), Some(r), false)
    }

    /// Queues [`Comm::all_gather_in_place`].
    pub fn all_gather_in_place<T: Plain, R: DevicePtrMut<T>>(&mut self, buf: &'a mut R) -> Result<&mut Self> {
        let n = self.comm.block(buf.len(), "in-place all_gather buffer")?;
        let b = self.output(buf, buf.len(), "buffer")?;
        self.copying::<T>(Collective::AllGather, n, None, Some(b), true)
    }

    /// Queues [`Comm::broadcast`]: `send` on the root only.
    pub fn broadcast<T: Plain, S: DevicePtr<T>, R: DevicePtrMut<T>>(
        &mut self,
        send: Option<&'a S>,
        recv: &'a mut R,
        root: usize,
    ) -> Result<&mut Self> {
        let n = recv.len();
        let s = self.root_buffer(send, n, root, "broadcast send buffer", |g, b| g.input(b, n, "send buffer"))?;
        let r = self.output(recv, n, "receive buffer")?;
        self.copying::<T>(Collective::Broadcast { root: root as u32 }, n, s, Some(r), false)
    }

    /// Queues [`Comm::broadcast_in_place`].
    pub fn broadcast_in_place<T: Plain, R: DevicePtrMut<T>>(
        &mut self,
        buf: &'a mut R,
        root: usize,
    ) -> Result<&mut Self> {
        let n = buf.len();
        self.check_root(root)?;
        let b = self.output(buf, n, "buffer")?;
        self.copying::<T>(Collective::Broadcast { root: root as u32 }, n, None, Some(b), true)
    }

    /// Queues everything of the group on the rank's stream: the collectives, then the transfers.
    pub fn run(self) -> Result<()> {
        self.comm.usable()?;
        if let Some(n) = &self.comm.nodes {
            // Across nodes each collective is a staged call of its own, in order, then the
            // transfers: node peers through the node communicator, others through the group.
            let device = self.comm.inner.rank_device(self.comm.rank);
            check_disjoint(&call_ranges(&self.calls, self.comm.world(), n.rank, device)?, "a group's buffers")?;
            // Every collective's plan and every transfer's route before anything is queued.
            let planned = self.calls.iter().map(|c| n.plan_call(c)).collect::<Result<Vec<_>>>()?;
            let routed = n.route(&self.comm.inner, &self.ops)?;
            let stream = self.comm.stream().clone();
            let mut queued = planned.iter().try_for_each(|c| n.call(&self.comm.inner, &stream, c));
            if queued.is_ok() {
                queued = n.p2p(&self.comm.inner, &stream, routed);
            }
            drop(self.guards);
            return queued;
        }
        let mut queued = Ok(());
        if !self.calls.is_empty() {
            queued = self.comm.inner.grouped(&self.calls);
        }
        if queued.is_ok() && !self.ops.is_empty() {
            queued = self.comm.inner.p2p(&self.ops);
        }
        drop(self.guards);
        queued
    }

    fn check_peer(&self, len: usize, ordinal: usize, peer: usize, what: &'static str) -> Result<()> {
        let world = self.comm.world();
        if peer >= world {
            return Err(Error::NoSuchRank { rank: peer, ranks: world });
        }
        self.comm.inner.check_placement(len, ordinal, self.comm.rank, None, what)
    }

    fn check_root(&self, root: usize) -> Result<()> {
        let world = self.comm.world();
        if root >= world {
            return Err(Error::NoSuchRank { rank: root, ranks: world });
        }
        Ok(())
    }

    fn add_op(&mut self, ptr: u64, bytes: usize, align: usize, peer: usize, dir: Direction) -> Result<&mut Self> {
        let what = if dir == Direction::Send { "send buffer" } else { "receive buffer" };
        check_aligned(ptr, self.comm.rank(), what, align)?;
        self.ops.push(P2pOp { peer, dir, ptr, bytes });
        Ok(self)
    }

    /// Checks that `buf` is on the rank's device and holds `len` elements, and takes its read guard.
    fn input<T, S: DevicePtr<T>>(&mut self, buf: &'a S, len: usize, what: &'static str) -> Result<Buf> {
        self.comm.inner.check_placement(buf.len(), ordinal_of(buf), self.comm.rank, Some(len), what)?;
        let (ptr, guard) = buf.device_ptr(self.comm.stream());
        self.guards.push(guard);
        Ok(Buf { ptr })
    }

    /// As [`Group::input`], taking the write guard.
    fn output<T, R: DevicePtrMut<T>>(&mut self, buf: &'a mut R, len: usize, what: &'static str) -> Result<Buf> {
        self.comm.inner.check_placement(buf.len(), ordinal_of(buf), self.comm.rank, Some(len), what)?;
        let (ptr, guard) = buf.device_ptr_mut(self.comm.stream());
        self.guards.push(guard);
        Ok(Buf { ptr })
    }

    /// The root's buffer of a rooted collective (required there, ignored elsewhere).
    fn root_buffer<B>(
        &mut self,
        buf: Option<B>,
        len: usize,
        root: usize,
        what: &'static str,
        take: impl FnOnce(&mut Self, B) -> Result<Buf>,
    ) -> Result<Option<Buf>> {
        self.check_root(root)?;
        match (root == self.comm.rank(), buf) {
            (true, Some(b)) => take(self, b).map(Some),
            (true, None) => Err(Error::MissingBuffer { what, rank: root, elements: len as u64 }),
            (false, _) => Ok(None),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn reducing<T: Element>(
        &mut self,
        collective: Collective,
        count: usize,
        input: Option<Buf>,
        output: Option<Buf>,
        in_place: bool,
        op: ReduceOp,
    ) -> Result<&mut Self> {
        let call = Call { collective, count, input, output, in_place };
        self.push(call, T::DTYPE, op, std::mem::size_of::<T>())
    }

    /// A copying collective of `count` elements of `T`, moved as units.
    fn copying<T: Plain>(
        &mut self,
        collective: Collective,
        count: usize,
        input: Option<Buf>,
        output: Option<Buf>,
        in_place: bool,
    ) -> Result<&mut Self> {
        let count = count * (std::mem::size_of::<T>() / unit_bytes::<T>());
        let call = Call { collective, count, input, output, in_place };
        self.push(call, unit_dtype::<T>(), ReduceOp::Sum, unit_bytes::<T>())
    }

    fn push(&mut self, call: Call, dtype: crate::DType, op: ReduceOp, align: usize) -> Result<&mut Self> {
        let Call { collective, count, input, output, in_place } = call;
        self.calls.push(GroupCall {
            member: Member { collective, count: count as u64, in_place },
            dtype,
            op,
            input: input.map_or(0, |b| b.ptr),
            output: output.map_or(0, |b| b.ptr),
            align,
        });
        Ok(self)
    }
}

/// A queued collective before its element type is known.
struct Call {
    collective: Collective,
    count: usize,
    input: Option<Buf>,
    output: Option<Buf>,
    in_place: bool,
}
