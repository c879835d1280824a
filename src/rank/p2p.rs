//! Point-to-point calls of a rank: send, receive, groups of them, and AllToAllv.

use super::Comm;
use crate::comm::p2p::P2pOp;
use crate::comm::{check_aligned, ordinal_of};
use crate::error::{Error, Result};
use crate::plain::Plain;
use cudarc::driver::{DevicePtr, DevicePtrMut};
use oxccl_host::p2p::Direction;

impl Comm {
    /// Sends `buf` to rank `peer`, which receives it with [`Comm::recv`] (or in a group): the
    /// `i`-th send to a peer is its `i`-th receive from this rank. Asynchronous on the rank's stream.
    pub fn send<T: Plain, S: DevicePtr<T>>(&self, buf: &S, peer: usize) -> Result<()> {
        let mut g = self.group();
        g.send(buf, peer)?;
        g.run()
    }

    /// Receives into `buf` (as many bytes as it holds) what rank `peer` sends.
    pub fn recv<T: Plain, R: DevicePtrMut<T>>(&self, buf: &mut R, peer: usize) -> Result<()> {
        let mut g = self.group();
        g.recv(buf, peer)?;
        g.run()
    }

    /// AllToAllv: `send_counts[q]` elements of `send` (blocks in rank order, back to back) go to rank
    /// `q`, and `recv` ends with `recv_counts[q]` elements from each rank `q`, in rank order, back to
    /// back (torch's `all_to_all_single` with split sizes). Rank `q`'s `send_counts[p]` must equal
    /// rank `p`'s `recv_counts[q]` (else [`Error::CallMismatch`]). One group of sends and receives.
    pub fn all_to_allv<T: Plain, S: DevicePtr<T>, R: DevicePtrMut<T>>(
        &self,
        send: &S,
        send_counts: &[usize],
        recv: &mut R,
        recv_counts: &[usize],
    ) -> Result<()> {
        let world = self.world();
        for (counts, what) in [(send_counts, "send counts"), (recv_counts, "receive counts")] {
            if counts.len() != world {
                return Err(Error::BufferCount { what, expected: world, got: counts.len() });
            }
        }
        let total = |c: &[usize]| c.iter().try_fold(0usize, |a, &n| a.checked_add(n));
        let (me, e) = (self.rank(), std::mem::size_of::<T>());
        for (counts, len, what) in
            [(send_counts, send.len(), "send buffer"), (recv_counts, recv.len(), "receive buffer")]
        {
            match total(counts) {
                Some(n) if n == len => {}
                n => return Err(Error::Length { what, rank: me, expected: n.unwrap_or(usize::MAX), got: len }),
            }
        }
        // The node communicator knows the rank by its index there (across nodes, not `me`).
        self.inner.check_placement(send.len(), ordinal_of(send), self.rank, None, "send buffer")?;
        self.inner.check_placement(recv.len(), ordinal_of(recv), self.rank, None, "receive buffer")?;
        self.usable()?;
        let stream = self.stream().clone();
        let (s, _s) = send.device_ptr(&stream);
        let (r, _r) = recv.device_ptr_mut(&stream);
        check_aligned(s, me, "send buffer", std::mem::align_of::<T>())?;
        check_aligned(r, me, "receive buffer", std::mem::align_of::<T>())?;
        let mut ops = Vec::with_capacity(2 * world);
        let (mut at_s, mut at_r) = (s, r);
        for q in 0..world {
            let (sb, rb) = (send_counts[q] * e, recv_counts[q] * e);
            ops.push(P2pOp { peer: q, dir: Direction::Send, ptr: at_s, bytes: sb });
            ops.push(P2pOp { peer: q, dir: Direction::Recv, ptr: at_r, bytes: rb });
            at_s += sb as u64;
            at_r += rb as u64;
        }
        match &self.nodes {
            Some(n) => n.p2p(&self.inner, &stream, n.route(&self.inner, &ops)?),
            None => self.inner.p2p(&ops),
        }
    }
}
