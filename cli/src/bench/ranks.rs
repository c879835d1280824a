//! The nccl-tests table with every rank its own caller: one [`Comm`] per rank (a process each, or
//! a thread each), each timing its own stream; a row takes the slowest rank's time.

use super::{
    CollectiveBench, CollectiveRow, Expected, Untracked, check_staging, count_wrong_on_device, fill_periodic,
    nccl_count, pattern, poison, time_graph_ms_on, time_ms,
};
use cudarc::driver::{CudaSlice, CudaView, CudaViewMut};
use oxccl::{Collective, Comm, ExportableBuffer, Registration, SymmetricBuffer};
use oxccl::{Error, Result};
use oxccl_host::tccl::PlanSpec;

/// Where a per-rank benchmark's buffers come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Buffers {
    /// [`Comm::alloc_symmetric`]: peers reach them where they are.
    Symmetric,
    /// cudarc's own allocations: across processes they go through staging memory.
    Plain,
    /// [`ExportableBuffer`]s registered with the communicator ([`Comm::register`]): peers reach
    /// them where they are.
    Registered,
}

impl Buffers {
    /// The name the CLI and the table use.
    pub fn name(self) -> &'static str {
        match self {
            Buffers::Symmetric => "symmetric",
            Buffers::Plain => "plain",
            Buffers::Registered => "registered",
        }
    }
}

/// A buffer of any kind, as a cudarc slice.
enum Buf {
    Plain(CudaSlice<u8>),
    Symmetric(SymmetricBuffer<u8>),
    Registered(Registered),
}

/// An [`ExportableBuffer`] registered with the communicator ([`Comm::register`]); the registration
/// ends before the memory is freed.
struct Registered {
    /// Ends first (fields drop in order): the memory is freed after.
    _registration: Registration,
    buf: ExportableBuffer<u8>,
}

impl Registered {
    fn new(comm: &Comm, n: usize) -> Result<Registered> {
        let buf = ExportableBuffer::<u8>::new(comm.stream(), n)?;
        // SAFETY: `buf` is freed after the registration ends (drop order of the fields).
        let registration = unsafe { comm.register(&*buf) }?;
        Ok(Registered { _registration: registration, buf })
    }
}

impl std::ops::Deref for Buf {
    type Target = CudaSlice<u8>;
    fn deref(&self) -> &CudaSlice<u8> {
        match self {
            Buf::Plain(s) => s,
            Buf::Symmetric(s) => s,
            Buf::Registered(s) => &s.buf,
        }
    }
}

impl std::ops::DerefMut for Buf {
    fn deref_mut(&mut self) -> &mut CudaSlice<u8> {
        match self {
            Buf::Plain(s) => s,
            Buf::Symmetric(s) => s,
            Buf::Registered(s) => &mut s.buf,
        }
    }
}

/// This rank's part of the nccl-tests sweep `b` (its `ranks` must be the communicator's world):
/// every rank calls it; each times its own stream, and the row holds the slowest rank's time and
/// every rank's wrong elements. `on_row` runs on rank 0 only, with the row and the host time this
/// rank's calls took each (microseconds, the timed out-of-place calls': what the host adds when it
/// issues calls slower than the device runs them).
pub fn rank_bench(
    comm: &Comm,
    b: &CollectiveBench,
    buffers: Buffers,
    mut on_row: impl FnMut(&CollectiveRow, f64),
) -> Result<Vec<CollectiveRow>> {
    b.sweep.validate(b.dtype.size() as u64)?;
    let (r, p) = (comm.rank(), comm.world());
    if b.ranks != p {
        return Err(Error::BufferCount { what: "benchmark ranks", expected: p, got: b.ranks });
    }
    if let Some(root) = b.collective.root()
        && root >= p
    {
        return Err(Error::NoSuchRank { rank: root, ranks: p });
    }
    let stream = comm.stream().clone();
    // In graph mode (a capture cannot wait on events recorded outside it) and with `untracked`, the
    // buffers are made without cudarc's event tracking; every return below follows the rank's
    // synchronize.
    let _untracked = (b.graph_launches > 0 || b.untracked).then(|| Untracked::new(std::slice::from_ref(&stream)));
    let mut staging = check_staging(std::slice::from_ref(&stream), b.sweep.check)?;
    let e = b.dtype.size() as u64;
    let ctas = comm.communicator().ctas_per_rank();
    let mut rows = Vec::new();
    for size in b.sweep.sizes() {
        let count = nccl_count(b.collective, size, e, p);
        let spec = PlanSpec {
            collective: b.collective,
            count,
            dtype: b.dtype,
            op: b.op,
            ranks: p,
            in_place: false,
            ctas,
            reduction: b.config.reduction,
        };
        let (in_bytes, out_bytes) = spec.buffer_bytes();
        let moved = in_bytes.max(out_bytes);
        let expected = Expected::new(b.collective, b.dtype, b.op, p, count);
        let mut times = [0f64; 2];
        let mut wrong = [0u64; 2];
        let mut host = [0f64; 2];
        for (k, in_place) in [false, true].into_iter().enumerate() {
            if in_place && !b.collective.has_in_place() {
                continue;
            }
            let spec = PlanSpec { in_place, ..spec };
            let alloc = |n: u64| -> Result<Buf> {
                Ok(match buffers {
                    Buffers::Symmetric => Buf::Symmetric(comm.alloc_symmetric::<u8>(n as usize)?),
                    Buffers::Registered => Buf::Registered(Registered::new(comm, n as usize)?),
                    Buffers::Plain => {
                        Buf::Plain(stream.alloc_zeros::<u8>(n as usize).map_err(Error::driver("cuMemAlloc"))?)
                    }
                })
            };
            let input = |i| pattern(r, i);
            let (has_in, has_out) = spec.rank_buffers(r);
            let (mut send, mut recv): (Option<Buf>, Option<Buf>) = (None, None);
            if in_place {
                let mut buf = alloc(in_bytes.max(out_bytes))?;
                poison(&stream, &mut buf)?;
                let at = if b.collective == Collective::AllGather { r * in_bytes as usize } else { 0 };
                if !matches!(b.collective, Collective::Broadcast { root } if root as usize != r) {
                    fill_periodic(&stream, &mut buf, at, b.dtype, in_bytes / e, input)?;
                }
                recv = Some(buf);
            } else {
                if has_in {
                    let mut buf = alloc(in_bytes)?;
                    fill_periodic(&stream, &mut buf, 0, b.dtype, in_bytes / e, input)?;
                    send = Some(buf);
                }
                if has_out {
                    let mut buf = alloc(out_bytes)?;
                    poison(&stream, &mut buf)?;
                    recv = Some(buf);
                }
            }
            stream.synchronize().map_err(Error::driver("cuStreamSynchronize"))?;
            let call = |send: &Option<Buf>, recv: &mut Option<Buf>| -> Result<()> {
                macro_rules! go {
                    ($t:ty) => {{
                        // SAFETY: byte buffers read as whole elements of their dtype (lengths are
                        // multiples of the element size, allocations aligned).
                        let s: Option<CudaView<$t>> =
                            send.as_ref().map(|x| unsafe { x.transmute::<$t>(x.len() / e as usize) }.unwrap());
                        let mut d: Option<CudaViewMut<$t>> = recv.as_mut().map(|x| {
                            let n = x.len() / e as usize;
                            // SAFETY: as above.
                            unsafe { x.transmute_mut::<$t>(n) }.unwrap()
                        });
                        let (s, d) = (s.as_ref(), d.as_mut());
                        let missing = || Error::Config { field: "buffers", why: "a buffer this rank needs".into() };
                        match (b.collective, in_place) {
                            (Collective::AllReduce, false) => {
                                comm.all_reduce(s.ok_or_else(missing)?, d.ok_or_else(missing)?, b.op)
                            }
                            (Collective::AllReduce, true) => comm.all_reduce_in_place(d.ok_or_else(missing)?, b.op),
                            (Collective::ReduceScatter, false) => {
                                comm.reduce_scatter(s.ok_or_else(missing)?, d.ok_or_else(missing)?, b.op)
                            }
                            (Collective::ReduceScatter, true) => {
                                comm.reduce_scatter_in_place(d.ok_or_else(missing)?, b.op)
                            }
                            (Collective::AllGather, false) => {
                                comm.all_gather(s.ok_or_else(missing)?, d.ok_or_else(missing)?)
                            }
                            (Collective::AllGather, true) => comm.all_gather_in_place(d.ok_or_else(missing)?),
                            (Collective::Broadcast { root }, false) => {
                                comm.broadcast(s, d.ok_or_else(missing)?, root as usize)
                            }
                            (Collective::Broadcast { root }, true) => {
                                comm.broadcast_in_place(d.ok_or_else(missing)?, root as usize)
                            }
                            (Collective::Reduce { root }, false) => {
                                comm.reduce(s.ok_or_else(missing)?, d, b.op, root as usize)
                            }
                            (Collective::Reduce { root }, true) => {
                                comm.reduce_in_place(d.ok_or_else(missing)?, b.op, root as usize)
                            }
                            // Out of place only (the in-place pass is skipped).
                            (Collective::AllToAll, _) => {
                                comm.all_to_all(s.ok_or_else(missing)?, d.ok_or_else(missing)?)
                            }
                        }
                    }};
                }
                oxccl::with_element!(b.dtype, |T| go!(T))
            };
            let n = usize::try_from(count)
                .map_err(|_| Error::Config { field: "size", why: format!("{count} elements") })?;
            // Across nodes a call cannot be prepared (`Comm::prepare` is one node's): the check and
            // the untimed calls before the timed ones build its plans.
            if comm.node_map().is_none() {
                oxccl::with_element!(b.dtype, |T| comm.prepare::<T>(b.collective, n, b.op, in_place))?;
            }
            if b.sweep.check {
                call(&send, &mut recv)?;
                comm.synchronize()?;
                if let (Some(buf), Some((_, stage))) = (&recv, staging.first_mut()) {
                    let (base, n) = match (b.collective, in_place) {
                        (Collective::ReduceScatter, true) => (r as u64 * count, count),
                        _ => (0, out_bytes / e),
                    };
                    wrong[k] = count_wrong_on_device(&stream, buf, (base * e) as usize, n, &expected, r, stage)?;
                }
            }
            for _ in 0..b.sweep.warmup {
                call(&send, &mut recv)?;
            }
            comm.synchronize()?;
            // The phase times count the timed calls only (and the untimed one that lines them up).
            // The engine and its phase records know the rank by its index in the node.
            let local = comm.local_rank();
            comm.communicator().engine(local)?.reset_phase_times(local, &stream)?;
            // The ranks start their timed calls together (to the bootstrap's latency).
            comm.bootstrap().barrier()?;
            // One untimed call first: its barriers line the ranks up on the device, so that the
            // timed span starts together on every rank.
            let mut issuing = std::time::Duration::ZERO;
            let ms = if b.graph_launches > 0 {
                // Each rank captures its own calls and launches its own graph; the graphs' kernels
                // meet at the same device barriers as plain launches.
                time_graph_ms_on(std::slice::from_ref(&stream), b.sweep.iters, b.graph_launches, || {
                    call(&send, &mut recv)
                })?
            } else {
                time_ms(&stream, 1, b.sweep.iters, || {
                    let t = std::time::Instant::now();
                    let called = call(&send, &mut recv);
                    issuing += t.elapsed();
                    called
                })?
            };
            // A graph's calls are issued once, at capture: no host time per call (NaN).
            host[k] =
                if b.graph_launches > 0 { f64::NAN } else { issuing.as_secs_f64() * 1e6 / (b.sweep.iters + 1) as f64 };
            comm.synchronize()?;
            if k == 0 {
                super::print_phases(comm.communicator().engine(local)?, &[local], size)?;
            }
            // The slowest rank's time and every rank's wrong elements.
            let mut mine = ms.to_le_bytes().to_vec();
            mine.extend_from_slice(&wrong[k].to_le_bytes());
            let all = comm.bootstrap().all_gather(&mine)?;
            let (mut slowest, mut wrong_all) = (0f64, 0u64);
            for v in &all {
                if v.len() == 16 {
                    slowest = slowest.max(f64::from_le_bytes(v[..8].try_into().expect("8 bytes")));
                    wrong_all += u64::from_le_bytes(v[8..].try_into().expect("8 bytes"));
                }
            }
            times[k] = slowest * 1e3;
            wrong[k] = wrong_all;
        }
        let row = CollectiveRow::of(b, ctas, moved, count, times, wrong);
        if r == 0 {
            on_row(&row, host[0]);
        }
        rows.push(row);
    }
    Ok(rows)
}
