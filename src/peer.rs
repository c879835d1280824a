//! Memory shared between the processes of a communicator on one host.
//!
//! Each rank exports regions of device memory (its workspace is region 0; then symmetric buffers
//! and staging memory) and every peer maps each of them, keeping where in its region table (in its
//! workspace, `abi::REGIONS_OFFSET`), from which the engine resolves the peers' buffer addresses
//! (`abi::region_address`). A region is shared by pushing it: the owner sends the exported file
//! descriptor to every peer's service (`crate::fdpass`, a Unix socket), which maps it and answers
//! once its table holds it. Nothing is collective, so a rank can add a region (a buffer, more
//! staging) in the middle of its calls without the others taking part.

use crate::bootstrap::Bootstrap;
use crate::error::{Error, Result};
use crate::fdpass::{Client, Message, Service};
use crate::vmm::VmmAlloc;
use cudarc::driver::{CudaContext, CudaStream, sys};
use oxccl_kernels::abi::{self, MAX_REGIONS};
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

/// A request to a peer's service: map a region (its descriptor sent along) or unmap one.
const MAP: u8 = 1;
const UNMAP: u8 = 2;

/// What a peer's service needs: the request, `[op, from (u32), region (u32), bytes (u64)]`, little
/// endian.
fn request(op: u8, from: usize, region: u32, bytes: usize) -> Vec<u8> {
    let mut v = vec![op];
    v.extend_from_slice(&(from as u32).to_le_bytes());
    v.extend_from_slice(&region.to_le_bytes());
    v.extend_from_slice(&(bytes as u64).to_le_bytes());
    v
}

/// The fields of a request, or `None` for bytes that are not one.
fn parse(b: &[u8]) -> Option<(u8, usize, u32, usize)> {
    if b.len() != 17 {
        return None;
    }
    let from = u32::from_le_bytes(b[1..5].try_into().ok()?) as usize;
    let region = u32::from_le_bytes(b[5..9].try_into().ok()?);
    let bytes = u64::from_le_bytes(b[9..17].try_into().ok()?) as usize;
    Some((b[0], from, region, bytes))
}

/// What the service thread and the communicator share: the peers' regions mapped here and the
/// region table they are recorded in.
struct Mapped {
    ctx: Arc<CudaContext>,
    /// This rank's workspace, holding the region table.
    workspace: Arc<VmmAlloc>,
    /// Writes the region table: a stream of its own, so that an entry lands without waiting for
    /// (or on) the collectives running meanwhile, which may be waiting for the peer that asked.
    table_stream: Arc<CudaStream>,
    /// `regions[rank][k]`: rank `rank`'s region `k`, mapped here.
    regions: Mutex<Vec<Vec<Option<VmmAlloc>>>>,
}

/// One of this rank's regions.
enum Own {
    /// Memory this communicator allocated.
    Alloc(Arc<VmmAlloc>),
    /// A user's allocation, registered ([`PeerMemory::register`]) by `users` registrations (0
    /// while the peers are still mapping it: no call may name it yet).
    Registered { base: u64, bytes: usize, users: usize },
}

impl Own {
    /// Where it starts and how many bytes it holds.
    fn range(&self) -> (u64, usize) {
        match self {
            Own::Alloc(a) => (a.ptr(), a.bytes()),
            Own::Registered { base, bytes, .. } => (*base, *bytes),
        }
    }

    /// Whether calls may name it: every peer has mapped it.
    fn shared(&self) -> bool {
        !matches!(self, Own::Registered { users: 0, .. })
    }
}

impl Mapped {
    /// Records `ptr` as where rank `rank`'s region `region` is mapped here (0: nowhere), and waits
    /// until the table holds it.
    fn record(&self, rank: usize, region: u32, ptr: u64) -> Result<()> {
        let at = self.workspace.ptr() + abi::region_entry_offset(rank, region as usize) as u64;
        crate::engine::make_current(&self.ctx).map_err(Error::driver("cuCtxSetCurrent"))?;
        let bytes = ptr.to_ne_bytes();
        // SAFETY: 8 bytes of the region table inside this rank's workspace; the source lives until
        // the stream is synchronised below.
        unsafe { cudarc::driver::result::memcpy_htod_async(at, &bytes, self.table_stream.cu_stream()) }
            .map_err(Error::driver("cuMemcpyHtoDAsync"))?;
        // SAFETY: a live stream of the current context.
        unsafe { cudarc::driver::result::stream::synchronize(self.table_stream.cu_stream()) }
            .map_err(Error::driver("cuStreamSynchronize"))
    }

    /// Answers a peer's request: maps its region (and records it) or unmaps one.
    fn serve(&self, msg: Message) -> Result<()> {
        let Some((op, from, region, bytes)) = parse(&msg.bytes) else {
            return Err(Error::PeerMemory { what: "a peer's request".into(), why: "malformed".into() });
        };
        let mut regions = self.regions.lock().unwrap_or_else(|e| e.into_inner());
        if from >= regions.len() || region as usize >= MAX_REGIONS {
            return Err(Error::PeerMemory {
                what: format!("rank {from}'s region {region}"),
                why: "outside the communicator's ranks or regions".into(),
            });
        }
        match op {
            MAP => {
                let mut fds = msg.fds;
                let (Some(fd), true) = (fds.pop(), fds.is_empty()) else {
                    return Err(Error::PeerMemory {
                        what: format!("mapping rank {from}'s region {region}"),
                        why: "the request carries no descriptor, or several".into(),
                    });
                };
                let alloc = VmmAlloc::import(&self.ctx, fd, bytes)?;
                self.record(from, region, alloc.ptr())?;
                // A region number reused: the old mapping was released by its owner already.
                regions[from][region as usize] = Some(alloc);
            }
            UNMAP => {
                self.record(from, region, 0)?;
                regions[from][region as usize] = None;
            }
            _ => {
                return Err(Error::PeerMemory { what: "a peer's request".into(), why: format!("unknown op {op}") });
            }
        }
        Ok(())
    }
}

/// The staging memory (its region and allocation) held for one call.
pub(crate) type StagingHold<'a> = MutexGuard<'a, Option<(u32, Arc<VmmAlloc>)>>;

/// A rank's shared memory: its exported regions, the peers' regions mapped here, and the service
/// through which peers push theirs.
pub(crate) struct PeerMemory {
    me: usize,
    mapped: Arc<Mapped>,
    /// This rank's regions by number (0: the workspace).
    own: Mutex<Vec<Option<Own>>>,
    /// Staging memory for buffers peers cannot map (cudarc's pool memory), grown on demand; its
    /// region number. Held for a call from its copy-in to its copy-out being queued.
    staging: Mutex<Option<(u32, Arc<VmmAlloc>)>>,
    /// Staging regions outgrown: kept, with their region numbers, until the end (a queued call may
    /// still use one; a number given to other memory would make it resolve there).
    retired: Mutex<Vec<Arc<VmmAlloc>>>,
    /// Held through a registration and a deregistration: one at a time, so that an allocation
    /// gains a user only while its region is alive.
    registering: Mutex<()>,
    /// A connection to each peer's service (`None`: this rank, or not connected yet).
    clients: Mutex<Vec<Option<Client>>>,
    /// Every peer's service name.
    names: Vec<String>,
    timeout: Duration,
    /// Served until dropped (first among the fields below it: no request arrives once it is gone).
    _service: Service,
}

impl PeerMemory {
    /// This rank's (`me` of `world`) workspace, exported, and its service, named after `nonce`
    /// (the same on every rank) and the rank.
    pub(crate) fn new(ctx: &Arc<CudaContext>, me: usize, world: usize, nonce: u128, timeout: Duration) -> Result<Self> {
        let table_stream = ctx.new_stream().map_err(Error::driver("cuStreamCreate"))?;
        let workspace = Arc::new(VmmAlloc::new(ctx, abi::COMM_WORKSPACE_BYTES, &[], Some(&table_stream))?);
        crate::engine::wait_stream(&table_stream)?;
        let mapped = Arc::new(Mapped {
            ctx: ctx.clone(),
            workspace: workspace.clone(),
            table_stream,
            regions: Mutex::new((0..world).map(|_| (0..MAX_REGIONS).map(|_| None).collect()).collect()),
        });
        // This rank's own workspace is its region 0 too: the engine resolves its own buffers alike.
        mapped.record(me, 0, workspace.ptr())?;
        let names: Vec<String> = (0..world).map(|r| format!("oxccl/{nonce:032x}/{r}")).collect();
        let served = mapped.clone();
        let service = Service::start(&names[me], move |msg| match served.serve(msg) {
            Ok(()) => Vec::new(),
            Err(e) => e.to_string().into_bytes(),
        })
        .map_err(|e| Error::PeerMemory { what: format!("starting rank {me}'s service"), why: e.to_string() })?;
        let mut own: Vec<Option<Own>> = (0..MAX_REGIONS).map(|_| None).collect();
        own[0] = Some(Own::Alloc(workspace));
        Ok(PeerMemory {
            me,
            mapped,
            own: Mutex::new(own),
            staging: Mutex::new(None),
            retired: Mutex::new(Vec::new()),
            registering: Mutex::new(()),
            clients: Mutex::new((0..world).map(|_| None).collect()),
            names,
            timeout,
            _service: service,
        })
    }

    /// This rank's workspace.
    pub(crate) fn workspace(&self) -> Arc<VmmAlloc> {
        self.mapped.workspace.clone()
    }

    /// Where rank `rank`'s region `region` is mapped here (0 if it is not; this rank's own: its
    /// allocation's address). Region 0 is a rank's workspace.
    pub(crate) fn region_of(&self, rank: usize, region: u32) -> u64 {
        if rank == self.me {
            let own = self.own.lock().unwrap_or_else(|e| e.into_inner());
            return own.get(region as usize).and_then(Option::as_ref).map_or(0, |o| o.range().0);
        }
        let regions = self.mapped.regions.lock().unwrap_or_else(|e| e.into_inner());
        regions.get(rank).and_then(|r| r.get(region as usize)?.as_ref()).map_or(0, |a| a.ptr())
    }

    /// Sends `req` (and `fd`, the region's descriptor, where it maps) to every peer's service and
    /// waits for each to answer. Every peer is asked, also after one failed (an unmap must reach
    /// all it can); the first failure is returned.
    fn push(&self, req: &[u8], fd: Option<&OwnedFd>) -> Result<()> {
        let mut clients = self.clients.lock().unwrap_or_else(|e| e.into_inner());
        let mut first = None;
        for (q, client) in clients.iter_mut().enumerate() {
            if q == self.me {
                continue;
            }
            let fail = |why: String| Error::PeerMemory { what: format!("sharing memory with rank {q}"), why };
            let answered = (|| {
                if client.is_none() {
                    *client = Some(Client::connect(&self.names[q], self.timeout).map_err(|e| fail(e.to_string()))?);
                }
                let c = client.as_mut().expect("connected above");
                let fds: Vec<_> = fd.iter().map(|f| f.as_fd()).collect();
                let answer = match c.call(req, &fds, self.timeout) {
                    Ok(a) => a,
                    Err(e) => {
                        // A call that failed part-way leaves the connection unusable: connect anew next time.
                        *client = None;
                        return Err(fail(e.to_string()));
                    }
                };
                if answer.is_empty() { Ok(()) } else { Err(fail(String::from_utf8_lossy(&answer).into_owned())) }
            })();
            if let Err(e) = answered {
                first.get_or_insert(e);
            }
        }
        first.map_or(Ok(()), Err)
    }

    /// Exports region 0, this rank's workspace, to every peer.
    pub(crate) fn share_workspace(&self) -> Result<()> {
        let ws = self.mapped.workspace.clone();
        self.push(&request(MAP, self.me, 0, ws.bytes()), Some(&ws.export()?))
    }

    /// `bytes` of memory (zeroed in `zero_on`'s order where given) every peer maps: a new region,
    /// recorded here and pushed to every peer.
    pub(crate) fn alloc(&self, bytes: usize, zero_on: Option<&CudaStream>) -> Result<(u32, Arc<VmmAlloc>)> {
        let alloc = Arc::new(VmmAlloc::new(&self.mapped.ctx, bytes, &[], zero_on)?);
        let region = self.take_region(Own::Alloc(alloc.clone()))?;
        let req = request(MAP, self.me, region, alloc.bytes());
        self.share(region, alloc.ptr(), &req, alloc.export())?;
        Ok((region, alloc))
    }

    /// A free region number, now `own`'s.
    fn take_region(&self, own: Own) -> Result<u32> {
        let mut regions = self.own.lock().unwrap_or_else(|e| e.into_inner());
        let Some(k) = regions.iter().position(Option::is_none) else {
            return Err(Error::PeerMemory {
                what: format!("exporting {} bytes", own.range().1),
                why: format!("every one of the {MAX_REGIONS} regions a rank may export is in use"),
            });
        };
        regions[k] = Some(own);
        Ok(k as u32)
    }

    /// Records region `region` (at `ptr` here) and pushes `req` with `fd` (its descriptor) to every
    /// peer; releases the region where that fails.
    fn share(&self, region: u32, ptr: u64, req: &[u8], fd: Result<OwnedFd>) -> Result<()> {
        let shared = fd.and_then(|fd| {
            self.mapped.record(self.me, region, ptr)?;
            self.push(req, Some(&fd))
        });
        if let Err(e) = shared {
            self.release(region);
            return Err(e);
        }
        Ok(())
    }

    /// Registers the user's allocation holding `bytes` at `ptr`: every peer maps it (an allocation
    /// registered already gains a user). Returns its region, for [`PeerMemory::deregister`].
    ///
    /// # Safety
    /// The allocation stays mapped at its addresses until `deregister` has returned (another
    /// allocation there would be taken for it).
    pub(crate) unsafe fn register(&self, ptr: u64, bytes: usize) -> Result<u32> {
        let _one = self.registering.lock().unwrap_or_else(|e| e.into_inner());
        let exported = crate::vmm::export_user(&self.mapped.ctx, ptr, bytes)?;
        {
            let mut own = self.own.lock().unwrap_or_else(|e| e.into_inner());
            let known = own.iter_mut().enumerate().find_map(|(k, o)| match o {
                Some(Own::Registered { base, users, .. }) if *base == exported.base => Some((k, users)),
                _ => None,
            });
            if let Some((k, users)) = known {
                *users += 1;
                return Ok(k as u32);
            }
        }
        let (base, size) = (exported.base, exported.bytes);
        // Not named by calls (`users` 0) until every peer has mapped it.
        let region = self.take_region(Own::Registered { base, bytes: size, users: 0 })?;
        self.share(region, base, &request(MAP, self.me, region, size), Ok(exported.fd))?;
        if let Some(Own::Registered { users, .. }) =
            self.own.lock().unwrap_or_else(|e| e.into_inner())[region as usize].as_mut()
        {
            *users = 1;
        }
        Ok(region)
    }

    /// Ends one registration of region `region`; the last one unmaps it on every peer. The caller
    /// has waited for every call that used it.
    pub(crate) fn deregister(&self, region: u32) {
        let _one = self.registering.lock().unwrap_or_else(|e| e.into_inner());
        {
            let mut own = self.own.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(Own::Registered { users, .. }) = own[region as usize].as_mut()
                && *users > 1
            {
                *users -= 1;
                return;
            }
        }
        self.release(region);
    }

    /// Withdraws region `region` from the peers and this rank's table (its memory is freed when
    /// the last holder drops it). The caller has waited for every call that used it.
    pub(crate) fn release(&self, region: u32) {
        // Errors cannot be reported from a buffer's drop: a peer that does not answer keeps its
        // mapping until its communicator ends.
        let _ = self.push(&request(UNMAP, self.me, region, 0), None);
        let _ = self.mapped.record(self.me, region, 0);
        self.own.lock().unwrap_or_else(|e| e.into_inner())[region as usize] = None;
    }

    /// The region address (`abi::region_address`) of `bytes` at `ptr` where they lie in one of
    /// this rank's regions, else `None`.
    pub(crate) fn portable(&self, ptr: u64, bytes: usize) -> Option<u64> {
        let own = self.own.lock().unwrap_or_else(|e| e.into_inner());
        own.iter().enumerate().skip(1).find_map(|(k, a)| {
            let a = a.as_ref().filter(|a| a.shared())?;
            let (base, len) = a.range();
            let inside = ptr >= base && ptr + bytes as u64 <= base + len as u64;
            inside.then(|| abi::region_address(k as u32, ptr - base))
        })
    }

    /// The staging memory, at least `bytes` of it (grown, and pushed to the peers, where smaller),
    /// held until the guard drops: (region, local address) inside.
    pub(crate) fn staging(&self, bytes: usize) -> Result<StagingHold<'_>> {
        let mut st = self.staging.lock().unwrap_or_else(|e| e.into_inner());
        if st.as_ref().is_none_or(|(_, a)| a.bytes() < bytes) {
            // Doubling bounds how often the peers are asked to map more.
            let want = st.as_ref().map_or(0, |(_, a)| 2 * a.bytes()).max(bytes);
            let (region, alloc) = self.alloc(want, None)?;
            if let Some((_, a)) = st.replace((region, alloc)) {
                // Its region number stays taken (see `retired`).
                self.retired.lock().unwrap_or_else(|e| e.into_inner()).push(a);
            }
        }
        Ok(st)
    }
}

/// How the ranks of a per-rank communicator reach each other.
pub(crate) struct Link {
    pub(crate) bootstrap: Box<dyn Bootstrap>,
    /// Memory shared between processes (`None` where every rank is in this process).
    pub(crate) peer: Option<Arc<PeerMemory>>,
    /// Where every rank is in this process: the devices of the ranks, which a symmetric buffer is
    /// made accessible to.
    pub(crate) access: Vec<usize>,
    pub(crate) aborted: AtomicBool,
    /// Where every rank is in this process: every rank's workspace, held until this rank drops (a
    /// peer's kernel writes its flags into this rank's, and this rank's into the peers').
    pub(crate) _held: Held,
}

/// Workspaces of other ranks held by this one ([`Link::_held`]): the last holder frees a
/// workspace, once no per-rank communicator or plan of the process uses its device (see
/// `engine::InUse`).
pub(crate) type Held = Vec<Arc<crate::engine::DeviceAlloc>>;

/// A call's buffers where peers in other processes reach them: each as a region address of this
/// rank's memory, the buffers they cannot map copied through staging memory, held for the call.
pub(crate) struct Staging<'a> {
    /// The inputs' addresses for the buffer table, in the order given.
    pub(crate) inputs: Vec<u64>,
    /// The outputs' addresses.
    pub(crate) outputs: Vec<u64>,
    /// (destination, source, bytes) copied before the launch and after it.
    before: Vec<(u64, u64, usize)>,
    after: Vec<(u64, u64, usize)>,
    _hold: Option<StagingHold<'a>>,
}

impl Staging<'_> {
    fn copy(list: &[(u64, u64, usize)], stream: &CudaStream) -> Result<()> {
        for &(dst, src, bytes) in list {
            crate::engine::make_current(stream.context()).map_err(Error::driver("cuCtxSetCurrent"))?;
            // SAFETY: both ranges are live device memory of this rank (a call's buffer, checked, and
            // the staging memory the guard holds), `bytes` long; queued on the rank's stream.
            unsafe { sys::cuMemcpyDtoDAsync_v2(dst, src, bytes, stream.cu_stream()) }
                .result()
                .map_err(Error::driver("cuMemcpyDtoDAsync"))?;
        }
        Ok(())
    }

    /// Queues `launch` on `stream`, with the copies into staging memory before it and out of it
    /// after, where `staging` has any (a call across processes; otherwise `launch` alone).
    pub(crate) fn around(
        staging: Option<&Staging<'_>>,
        stream: Option<&CudaStream>,
        launch: impl FnOnce() -> Result<()>,
    ) -> Result<()> {
        match (staging, stream) {
            (Some(st), Some(stream)) => {
                Self::copy(&st.before, stream)?;
                launch()?;
                Self::copy(&st.after, stream)
            }
            _ => launch(),
        }
    }
}

/// An output of a call to stage ([`Link::stage`]).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Out {
    pub ptr: u64,
    pub bytes: usize,
    /// The call writes it (a rooted call in place leaves some buffers as they are).
    pub written: bool,
    /// The call reads it first: in place, the buffer is also the input.
    pub read: bool,
}

impl Link {
    /// The addresses peers resolve for a call's inputs (`(address, bytes)`) and outputs, staging
    /// those outside this rank's exported memory.
    pub(crate) fn stage(&self, ins: &[(u64, usize)], outs: &[Out]) -> Result<Staging<'_>> {
        let peer = self.peer.as_ref().expect("staging is only asked of a communicator across processes");
        let mut st =
            Staging { inputs: Vec::new(), outputs: Vec::new(), before: Vec::new(), after: Vec::new(), _hold: None };
        // Offsets in the staging memory of what must be staged, 256-byte aligned.
        let mut need = 0usize;
        let mut place = |bytes: usize| {
            let at = need;
            need = (need + bytes).next_multiple_of(256);
            at
        };
        // An empty buffer is never addressed: its address goes as it is (nothing to stage, and no
        // staging memory to point into where nothing else is staged).
        let reach = |p: u64, b: usize| if b == 0 { Some(p) } else { peer.portable(p, b) };
        let ins: Vec<(u64, usize, Option<u64>, usize)> = ins.iter().map(|&(p, b)| (p, b, reach(p, b), 0)).collect();
        let ins: Vec<_> =
            ins.into_iter().map(|(p, b, a, _)| (p, b, a, if a.is_none() { place(b) } else { 0 })).collect();
        let outs: Vec<_> = outs
            .iter()
            .map(|o| {
                let a = reach(o.ptr, o.bytes);
                (o, a, if a.is_none() { place(o.bytes) } else { 0 })
            })
            .collect();
        let mut base = None;
        if need > 0 {
            let hold = peer.staging(need)?;
            let (region, alloc) = hold.as_ref().expect("staging() leaves memory in place");
            base = Some((*region, alloc.ptr()));
            st._hold = Some(hold);
        }
        for (p, b, a, at) in ins {
            st.inputs.push(match (a, base) {
                (Some(a), _) => a,
                (None, Some((region, local))) => {
                    st.before.push((local + at as u64, p, b));
                    abi::region_address(region, at as u64)
                }
                (None, None) => unreachable!("need > 0 when anything is staged"),
            });
        }
        for (o, a, at) in outs {
            st.outputs.push(match (a, base) {
                (Some(a), _) => a,
                (None, Some((region, local))) => {
                    if o.read {
                        st.before.push((local + at as u64, o.ptr, o.bytes));
                    }
                    if o.written {
                        st.after.push((o.ptr, local + at as u64, o.bytes));
                    }
                    abi::region_address(region, at as u64)
                }
                (None, None) => unreachable!("need > 0 when anything is staged"),
            });
        }
        Ok(st)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_parse_back_and_wrong_lengths_are_refused() {
        let map = request(MAP, 3, 7, 1 << 21);
        assert_eq!(parse(&map), Some((MAP, 3, 7, 1 << 21)));
        assert_eq!(parse(&map[..16]), None);
        let mut long = request(UNMAP, 1, 2, 0);
        long.push(0);
        assert_eq!(parse(&long), None);
        assert_eq!(parse(&[]), None);
    }
}
