//! Per-rank communicators: every rank its own caller, a thread or a process with its own stream, as
//! with `cudarc::nccl::Comm`.
//!
//! A [`Comm`] is a [`Communicator`] that drives one rank of its world: the same plans, checks and
//! launches. The ranks find each other through a [`Bootstrap`] and learn each other's buffers at
//! every call's start barrier on the device (`abi::Workspace::announce`), so a call exchanges
//! nothing on the host. Where every rank is a thread of one process, buffers are addressed as they
//! are; ranks in several processes of one host share memory exported through CUDA's virtual-memory
//! API ([`crate::peer`]): [`SymmetricBuffer`]s, which peers map once, and staging memory through
//! which other buffers (cudarc's stream-ordered pools, which no other process can map) are copied.

use crate::bootstrap::{Bootstrap, Id, LaunchEnv, TcpBootstrap};
use crate::comm::group::GroupCall;
use crate::comm::{Count, DeviceFacts, Holders, RankWorkspace, World, enable_peer_access, ordinal_of};
use crate::engine::{DeviceAlloc, Engine, bind};
use crate::error::{Error, Result};
use crate::internode::InterNode;
use crate::internode::group_bootstrap;
use crate::peer::{Link, PeerMemory};
use crate::plain::{Plain, Units, UnitsMut, in_units, unit_bytes, whole_blocks};
use crate::reshard::{Layout, ReshardOptions};
use crate::staged::{DEFAULT_PIECE_BYTES, Nodes};
use crate::vmm::VmmAlloc;
use crate::{CallLaunch, Collective, Communicator, Config, Element, ReduceOp};
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, sys};
use oxccl_host::group::Member;
use oxccl_host::nodes::NodeMap;
use oxccl_host::program::Program;
use oxccl_kernels::abi::{self, MAX_RANKS};
use serde::{Deserialize, Serialize};
use std::mem::ManuallyDrop;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

mod group;
mod p2p;
pub use group::Group;

/// The workspaces of per-rank communicators whose ranks are all threads of this process, by
/// address: each rank of such a world finds its peers' here and holds them ([`Link::_held`]).
static IN_PROCESS_WORKSPACES: std::sync::Mutex<Vec<(u64, std::sync::Weak<DeviceAlloc>)>> =
    std::sync::Mutex::new(Vec::new());

/// What a rank tells the others when its communicator is built.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
struct Facts {
    /// The host (its name and boot id): ranks on one host can share memory.
    host: String,
    /// The process: ranks in one process address each other's memory as it is.
    pid: u32,
    /// The device's UUID (hex) and its ordinal in this process.
    uuid: String,
    ordinal: usize,
    sms: u32,
    max_smem: u32,
    /// The configuration, as `Debug` prints it: every rank must have the same.
    config: String,
    /// A random number; rank 0's names the communicator's services.
    nonce: u128,
}

/// This host's identity: its name and, on Linux, the boot id (two containers can share a name).
fn host_identity() -> String {
    let name = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    format!("{}/{}", name.trim(), boot.trim())
}

/// A random 128-bit number (the kernel's; the hasher's random keys where it has none).
fn random_u128() -> u128 {
    use std::io::Read;
    let mut b = [0u8; 16];
    if std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut b)).is_ok() {
        return u128::from_le_bytes(b);
    }
    use std::hash::{BuildHasher, RandomState};
    let s = RandomState::new();
    (s.hash_one(std::process::id()) as u128) << 64 | s.hash_one(std::time::SystemTime::now()) as u128
}

/// The UUID of `ctx`'s device, in hex.
fn device_uuid(ctx: &Arc<CudaContext>) -> Result<String> {
    bind(ctx)?;
    let mut uuid = std::mem::MaybeUninit::<sys::CUuuid>::uninit();
    // SAFETY: out-pointer and a valid device handle.
    unsafe { sys::cuDeviceGetUuid_v2(uuid.as_mut_ptr(), ctx.cu_device()) }
        .result()
        .map_err(Error::driver("cuDeviceGetUuid"))?;
    // SAFETY: initialised by the successful call above.
    let uuid = unsafe { uuid.assume_init() };
    Ok(uuid.bytes.iter().map(|b| format!("{:02x}", *b as u8)).collect())
}

/// An aliasing error unless `send_bytes` at `send` and `recv_bytes` at `recv` are disjoint (the
/// communicator's own check, on this rank's two buffers).
fn disjoint(send: u64, send_bytes: usize, recv: u64, recv_bytes: usize, rank: usize) -> Result<()> {
    let range = |start: u64, bytes: usize, writes, buffer| crate::comm::Range {
        start,
        end: start + bytes as u64,
        rank,
        device: 0,
        writes,
        buffer,
    };
    let ranges = [range(send, send_bytes, false, "send"), range(recv, recv_bytes, true, "receive")];
    crate::comm::check_disjoint(&ranges, "send and receive buffers (use the in-place call)")
}

/// Builds a rank's inter-node group: see [`Comm::with_inter_node`].
type MakeInter = Box<dyn FnOnce(&NodeMap, &dyn Bootstrap, &Arc<CudaStream>) -> Result<Box<dyn InterNode>>>;

/// One rank of a communicator, driven by its own caller (a thread or a process), with its own
/// stream: `comm.all_reduce(&send, &mut recv, ReduceOp::Sum)` on this rank's buffers, as with
/// `cudarc::nccl::Comm`. Every rank makes the same calls in the same order (a rank that calls
/// another collective than its peers gets [`Error::CallMismatch`], never a wrong result).
///
/// Build one per rank with [`Comm::from_rank`] (an [`Id`] made by one rank, passed to the others),
/// [`Comm::from_env`] (torchrun's variables; `oxccl launch` sets them) or [`Comm::new`] (any
/// [`Bootstrap`]). Ranks may be threads of one process (any buffers) or processes of one host.
/// Across processes, buffers from [`Comm::alloc_symmetric`] are reached where they are; other
/// buffers (cudarc's allocations) are copied through staging memory, which costs a copy in and
/// out (docs/PERF.md). Processes sharing a GPU need MPS to run their kernels side by side; without
/// it a call ends in [`Error::Timeout`], never a hang.
///
/// Calls are asynchronous on the rank's stream; [`Comm::synchronize`] waits and reports device
/// errors as [`Communicator::synchronize`] does.
pub struct Comm {
    /// Across nodes: the node map, the inter-node group and its stream. First, so that it drops
    /// first: its inter-node side ends (or is aborted) before `inner` waits for the rank's stream.
    nodes: Option<Box<Nodes>>,
    /// The communicator this rank drives: the whole world's, or across nodes its node's.
    inner: Communicator,
    /// This rank's index in `inner`.
    rank: usize,
}

impl std::fmt::Debug for Comm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Comm").field("rank", &self.rank).field("world", &self.world()).finish_non_exhaustive()
    }
}

impl Comm {
    /// Rank `rank` of `world`, meeting the others through the root `id` names (made by
    /// [`Id::new`] in one process and passed to every rank: as bytes, a string or a file). Every
    /// step of the setup gives up after `config.timeout`.
    pub fn from_rank(stream: &Arc<CudaStream>, rank: usize, world: usize, id: &Id, config: Config) -> Result<Self> {
        let bootstrap = TcpBootstrap::new(id, rank, world, config.timeout)?;
        Self::new(stream, Box::new(bootstrap), config)
    }

    /// The rank torchrun's variables (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`; set by
    /// `oxccl launch` too) name. `stream` is on the device this process uses (by convention
    /// `LOCAL_RANK`'s; [`LaunchEnv::from_env`] reads it).
    pub fn from_env(stream: &Arc<CudaStream>, config: Config) -> Result<Self> {
        let env = LaunchEnv::from_env()?;
        let bootstrap = TcpBootstrap::from_launch_env(&env, config.timeout)?;
        Self::new(stream, Box::new(bootstrap), config)
    }

    /// This rank of the communicator `bootstrap` gathers (its rank and world), with its calls
    /// queued on `stream`. Every rank must pass the same `config`.
    pub fn new(stream: &Arc<CudaStream>, bootstrap: Box<dyn Bootstrap>, config: Config) -> Result<Self> {
        Self::build(stream, bootstrap, config, None)
    }

    /// As [`Comm::new`], with the inter-node group `make` builds where the ranks span several
    /// nodes (in place of NCCL): it is called on every rank with the node map, the world's
    /// bootstrap (for exchanging what the group needs) and the stream inter-node steps run on.
    /// [`EngineGroup`](crate::internode::EngineGroup) is one on oxccl's own engine, for nodes
    /// that share a host.
    pub fn with_inter_node(
        stream: &Arc<CudaStream>,
        bootstrap: Box<dyn Bootstrap>,
        config: Config,
        make: impl FnOnce(&NodeMap, &dyn Bootstrap, &Arc<CudaStream>) -> Result<Box<dyn InterNode>> + 'static,
    ) -> Result<Self> {
        Self::build(stream, bootstrap, config, Some(Box::new(make)))
    }

    fn build(
        stream: &Arc<CudaStream>,
        bootstrap: Box<dyn Bootstrap>,
        config: Config,
        make: Option<MakeInter>,
    ) -> Result<Self> {
        crate::config::validate_config(&config)?;
        let (me, world) = (bootstrap.rank(), bootstrap.world());
        if world == 0 || world > MAX_RANKS {
            return Err(Error::RankCount { ranks: world, max: MAX_RANKS });
        }
        if me >= world {
            return Err(Error::NoSuchRank { rank: me, ranks: world });
        }
        let ctx = stream.context().clone();
        let engine = Engine::shared(&ctx)?;
        let facts = Facts {
            host: host_identity(),
            pid: std::process::id(),
            uuid: device_uuid(&ctx)?,
            ordinal: ctx.ordinal(),
            sms: engine.sms,
            max_smem: engine.max_smem,
            config: format!("{config:?}"),
            nonce: random_u128(),
        };
        let mine = serde_json::to_vec(&facts).expect("facts serialise");
        let all: Vec<Facts> = bootstrap
            .all_gather(&mine)?
            .iter()
            .enumerate()
            .map(|(r, b)| {
                serde_json::from_slice(b).map_err(|e| Error::Mismatch {
                    field: "setup",
                    rank: r,
                    why: format!("sent facts this rank cannot read ({e}): another oxccl version?"),
                })
            })
            .collect::<Result<_>>()?;
        if let Some(r) = all.iter().position(|f| f.config != facts.config) {
            return Err(Error::Mismatch {
                field: "config",
                rank: r,
                why: format!("has {}, this rank {}", all[r].config, facts.config),
            });
        }
        // Nodes: by host, or as many ranks to a node as the configuration says.
        let map = match config.ranks_per_node {
            Some(p) => NodeMap::by_count(world, p as usize)?
                .within_hosts(&all.iter().map(|f| f.host.as_str()).collect::<Vec<_>>())?,
            None => NodeMap::from_keys(&all.iter().map(|f| f.host.as_str()).collect::<Vec<_>>())?,
        };
        if map.nodes() > 1 {
            let timeout = config.timeout;
            let make = make.unwrap_or_else(|| {
                Box::new(move |map: &NodeMap, bootstrap: &dyn Bootstrap, _: &Arc<CudaStream>| {
                    crate::internode::nccl_group(map, bootstrap, &ctx, timeout)
                })
            });
            return Self::across_nodes(stream, bootstrap, config, map, make);
        }
        // The devices: one per (host, UUID), in the order the ranks name them.
        let mut keys: Vec<(&str, &str)> = Vec::new();
        let mut devices = Vec::new();
        let mut rank_device = Vec::new();
        for f in &all {
            let key = (f.host.as_str(), f.uuid.as_str());
            let d = keys.iter().position(|k| *k == key).unwrap_or_else(|| {
                keys.push(key);
                devices.push(DeviceFacts { sms: f.sms, max_smem: f.max_smem });
                keys.len() - 1
            });
            rank_device.push(d);
        }
        let world_view = World { rank_device, devices };
        let one_process = all.iter().all(|f| f.host == facts.host && f.pid == facts.pid);
        let one_host = all.iter().all(|f| f.host == facts.host);
        let mut workspaces = [0u64; MAX_RANKS];
        let mut held = Vec::new();
        let (workspace, peer) = if one_process {
            let ws = Arc::new(DeviceAlloc::zeroed(&ctx, abi::COMM_WORKSPACE_BYTES)?);
            (workspaces, held) = share_in_process(&ws, bootstrap.as_ref())?;
            // Peer access between this rank's device and the others' (same process: same ordinals).
            let mut contexts = vec![ctx.clone()];
            for f in &all {
                if contexts.iter().all(|c| c.ordinal() != f.ordinal) {
                    contexts.push(CudaContext::new(f.ordinal).map_err(Error::driver("cuDevicePrimaryCtxRetain"))?);
                }
            }
            enable_peer_access(&contexts)?;
            (RankWorkspace::Held(ws), None)
        } else if one_host {
            let peer = PeerMemory::new(&ctx, me, world, all[0].nonce, config.timeout)?;
            // Every service is up before any rank pushes its workspace; every workspace is mapped
            // everywhere before any rank reads the table.
            bootstrap.barrier()?;
            peer.share_workspace()?;
            // Staging memory mapped by every peer now: a staged call that fits never waits for its
            // peers to map memory mid-call (nor launches while they do).
            if config.staging_bytes > 0 {
                let bytes = usize::try_from(config.staging_bytes).map_err(|_| Error::Config {
                    field: "staging_bytes",
                    why: format!("{} does not fit the address space", config.staging_bytes),
                })?;
                drop(peer.staging(bytes)?);
            }
            bootstrap.barrier()?;
            for (r, w) in workspaces.iter_mut().enumerate().take(world) {
                *w = peer.region_of(r, 0);
                if *w == 0 {
                    return Err(Error::PeerMemory {
                        what: format!("rank {r}'s workspace"),
                        why: "not mapped after every rank shared its own".into(),
                    });
                }
            }
            (RankWorkspace::Shared(peer.workspace()), Some(Arc::new(peer)))
        } else {
            return Err(Error::Unsupported {
                what: "ranks on several hosts (one communicator spans the GPUs of one host for now)".into(),
            });
        };
        let access = if one_process { all.iter().map(|f| f.ordinal).collect() } else { Vec::new() };
        let link = Link { bootstrap, peer, access, aborted: AtomicBool::new(false), _held: held };
        let ranks = vec![crate::comm::new_rank(me, 0, stream.clone(), workspace)];
        let inner = Communicator::assemble(config, vec![engine], ranks, world_view, workspaces, Some(link))?;
        let comm = Comm { nodes: None, inner, rank: me };
        // No rank launches before every rank has ended its setup, whose last steps wait for the
        // whole device (the workspace's zeros, the status record): a rank launching earlier would
        // wait at its start barrier for a peer that waits for that launch to end, until the timeout.
        comm.bootstrap().barrier()?;
        Ok(comm)
    }

    /// Builds a communicator across nodes on `map`: a node communicator among this rank's node
    /// (meeting through a root on this host, which the node's first rank serves), and the
    /// inter-node group `make_inter` builds (collective over `bootstrap`: every rank calls it).
    fn across_nodes(
        stream: &Arc<CudaStream>,
        bootstrap: Box<dyn Bootstrap>,
        config: Config,
        map: NodeMap,
        make_inter: MakeInter,
    ) -> Result<Self> {
        let me = bootstrap.rank() as u32;
        let (node, local) = (map.node(me), map.local(me));
        let (root, per_node) = (map.rank(node, 0) as usize, map.per_node() as usize);
        let node_bootstrap = group_bootstrap(bootstrap.as_ref(), root, local as usize, per_node, config.timeout)?;
        let inter_stream = stream.context().new_stream().map_err(Error::driver("cuStreamCreate"))?;
        let inter = make_inter(&map, bootstrap.as_ref(), &inter_stream)?;
        let piece_bytes = config.inter_piece_bytes.unwrap_or(DEFAULT_PIECE_BYTES);
        let node_config = Config { ranks_per_node: None, ..config };
        let node_comm = Comm::new(stream, Box::new(node_bootstrap), node_config)?;
        let (pending, failed, timeout) = (Default::default(), Default::default(), config.timeout);
        let nodes =
            Nodes { map, rank: me as usize, inter, inter_stream, piece_bytes, bootstrap, pending, failed, timeout };
        Ok(Comm { nodes: Some(Box::new(nodes)), inner: node_comm.inner, rank: node_comm.rank })
    }

    /// Queues this rank's part of `collective` (`(collective, elements per rank, in place)`)
    /// across nodes, planned as a group member's ([`Nodes::plan_call`], which maps the buffers to
    /// the staged steps' source and receive address): `input` is read unless in place (0 where the
    /// rank sends nothing), `output` written (0 where the rank receives nothing).
    fn across<T: Element>(
        &self,
        n: &Nodes,
        stream: &Arc<CudaStream>,
        (collective, count, in_place): (Collective, usize, bool),
        input: u64,
        output: u64,
        op: ReduceOp,
    ) -> Result<()> {
        let member = Member { collective, count: count as u64, in_place };
        let call = GroupCall { member, dtype: T::DTYPE, op, input, output, align: std::mem::size_of::<T>() };
        n.call(&self.inner, stream, &n.plan_call(&call)?)
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.nodes.as_ref().map_or(self.rank, |n| n.rank)
    }

    /// This rank's index in [`Comm::communicator`]: [`Comm::rank`] on one node, its index in its
    /// node across several.
    pub fn local_rank(&self) -> usize {
        self.rank
    }

    /// Ranks of the communicator.
    pub fn world(&self) -> usize {
        self.nodes.as_ref().map_or(self.inner.ranks(), |n| n.map.world() as usize)
    }

    /// Which node each rank is on, where the ranks span several (see [`Config::ranks_per_node`]);
    /// `None` on one node.
    pub fn node_map(&self) -> Option<&NodeMap> {
        self.nodes.as_ref().map(|n| &n.map)
    }

    /// An error naming `what` where the ranks span several nodes: reshard, transfer programs and
    /// graph capture do not run across nodes yet (the collectives, groups, sends and receives do).
    fn one_node(&self, what: &str) -> Result<()> {
        match &self.nodes {
            None => Ok(()),
            Some(n) => Err(Error::Unsupported {
                what: format!(
                    "{what} on a communicator across {} nodes (collectives, groups, sends and receives run there; reshard, programs and prepare do not yet)",
                    n.map.nodes()
                ),
            }),
        }
    }

    /// The stream this rank's calls are queued on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        self.inner.rank_stream(self.rank)
    }

    /// The configuration.
    pub fn config(&self) -> &Config {
        self.inner.config()
    }

    /// The bootstrap the ranks met through (for exchanging bytes among them, as the benchmarks
    /// do).
    pub fn bootstrap(&self) -> &dyn Bootstrap {
        if let Some(n) = &self.nodes {
            return n.bootstrap.as_ref();
        }
        self.inner.link.as_ref().expect("a Comm always has its link").bootstrap.as_ref()
    }

    /// The all-ranks communicator this rank's calls go through (plans, launches, checks).
    pub fn communicator(&self) -> &Communicator {
        &self.inner
    }

    fn usable(&self) -> Result<()> {
        let failed = self.nodes.as_ref().is_some_and(|n| n.failed.load(Ordering::SeqCst));
        match &self.inner.link {
            Some(l) if l.aborted.load(Ordering::SeqCst) => Err(Error::Aborted),
            _ if failed => Err(Error::Aborted),
            _ => Ok(()),
        }
    }

    /// `recv = op over all ranks of their send`, element-wise; `send` and `recv` of one length and
    /// disjoint (use [`Comm::all_reduce_in_place`]).
    pub fn all_reduce<T: Element, S: DevicePtr<T>, R: DevicePtrMut<T> + DevicePtr<T>>(
        &self,
        send: &S,
        recv: &mut R,
        op: ReduceOp,
    ) -> Result<()> {
        self.usable()?;
        if let Some(n) = &self.nodes {
            if send.len() != recv.len() {
                return Err(Error::Length {
                    what: "receive buffer",
                    rank: n.rank,
                    expected: send.len(),
                    got: recv.len(),
                });
            }
            let stream = self.stream().clone();
            let (s, _s) = send.device_ptr(&stream);
            let (r, _r) = recv.device_ptr_mut(&stream);
            let bytes = send.len() * std::mem::size_of::<T>();
            disjoint(s, bytes, r, bytes, n.rank)?;
            return self.across::<T>(n, &stream, (Collective::AllReduce, send.len(), false), s, r, op);
        }
        let count = Count::FromSend(send.len());
        self.inner.collective::<T, S, R>(
            Collective::AllReduce,
            count,
            Some(std::slice::from_ref(send)),
            std::slice::from_mut(recv),
            op,
            Holders::All,
        )
    }

    /// In-place AllReduce: `buf` becomes the reduction of every rank's.
    pub fn all_reduce_in_place<T: Element, R: DevicePtrMut<T> + DevicePtr<T>>(
        &self,
        buf: &mut R,
        op: ReduceOp,
    ) -> Result<()> {
        self.usable()?;
        if let Some(n) = &self.nodes {
            let (stream, count) = (self.stream().clone(), buf.len());
            let (r, _r) = buf.device_ptr_mut(&stream);
            return self.across::<T>(n, &stream, (Collective::AllReduce, count, true), 0, r, op);
        }
        let count = Count::FromRecv(buf.len());
        self.inner.collective::<T, R, R>(
            Collective::AllReduce,
            count,
            None,
            std::slice::from_mut(buf),
            op,
            Holders::All,
        )
    }

    /// `recv` (count elements) = op over all ranks of block `rank` of their `send` (world × count
    /// elements).
    pub fn reduce_scatter<T: Element, S: DevicePtr<T>, R: DevicePtrMut<T> + DevicePtr<T>>(
        &self,
        send: &S,
        recv: &mut R,
        op: ReduceOp,
    ) -> Result<()> {
        self.usable()?;
        if let Some(n) = &self.nodes {
            let count = recv.len();
            let expected = count * self.world();
            if send.len() != expected {
                return Err(Error::Length { what: "send buffer", rank: n.rank, expected, got: send.len() });
            }
            let stream = self.stream().clone();
            let (s, _s) = send.device_ptr(&stream);
            let (r, _r) = recv.device_ptr_mut(&stream);
            disjoint(s, expected * std::mem::size_of::<T>(), r, count * std::mem::size_of::<T>(), n.rank)?;
            return self.across::<T>(n, &stream, (Collective::ReduceScatter, count, false), s, r, op);
        }
        let count = Count::FromRecv(recv.len());
        self.inner.collective::<T, S, R>(
            Collective::ReduceScatter,
            count,
            Some(std::slice::from_ref(send)),
            std::slice::from_mut(recv),
            op,
            Holders::All,
        )
    }

    /// In-place ReduceScatter: `buf` holds world × count elements; block `rank` of it becomes the
    /// reduction of block `rank` of every rank's (nccl's `recvbuff = sendbuff + rank × count`).
    pub fn reduce_scatter_in_place<T: Element, R: DevicePtrMut<T> + DevicePtr<T>>(
        &self,
        buf: &mut R,
        op: ReduceOp,
    ) -> Result<()> {
        self.usable()?;
        let count = self.block(buf.len(), "in-place reduce_scatter buffer")?;
        if let Some(n) = &self.nodes {
            let stream = self.stream().clone();
            let (r, _r) = buf.device_ptr_mut(&stream);
            return self.across::<T>(n, &stream, (Collective::ReduceScatter, count, true), 0, r, op);
        }
        self.inner.collective::<T, R, R>(
            Collective::ReduceScatter,
            Count::FromRecv(count),
            None,
            std::slice::from_mut(buf),
            op,
            Holders::All,
        )
    }

    /// `recv` (world × count elements) = every rank's `send` (count elements), in rank order. Any
    /// [`Plain`] element type (moved byte for byte; lengths in errors count its 4-, 2- or 1-byte
    /// units).
    pub fn all_gather<T: Plain, S: DevicePtr<T>, R: DevicePtrMut<T> + DevicePtr<T>>(
        &self,
        send: &S,
        recv: &mut R,
    ) -> Result<()> {
        in_units!(T, |U| {
            self.all_gather_units::<U, _, _>(&Units::<T, U, S>::new(send), &mut UnitsMut::<T, U, R>::new(recv))
        })
    }

    fn all_gather_units<T: Element, S: DevicePtr<T>, R: DevicePtrMut<T> + DevicePtr<T>>(
        &self,
        send: &S,
        recv: &mut R,
    ) -> Result<()> {
        self.usable()?;
        if let Some(n) = &self.nodes {
            let count = send.len();
            let expected = count * self.world();
            if recv.len() != expected {
                return Err(Error::Length { what: "receive buffer", rank: n.rank, expected, got: recv.len() });
            }
            let stream = self.stream().clone();
            let (s, _s) = send.device_ptr(&stream);
            let (r, _r) = recv.device_ptr_mut(&stream);
            disjoint(s, count * std::mem::size_of::<T>(), r, expected * std::mem::size_of::<T>(), n.rank)?;
            return self.across::<T>(n, &stream, (Collective::AllGather, count, false), s, r, ReduceOp::Sum);
        }
        let count = Count::FromSend(send.len());
        self.inner.collective::<T, S, R>(
            Collective::AllGather,
            count,
            Some(std::slice::from_ref(send)),
            std::slice::from_mut(recv),
            ReduceOp::Sum,
            Holders::All,
        )
    }

    /// AllToAll: block `q` of `send` (world × count elements) goes to rank `q`, and `recv` (world ×
    /// count) ends with block `rank` of every rank's `send`, in rank order. Out of place only. Any
    /// [`Plain`] element type. Across nodes it runs as [`Comm::all_to_allv`]'s transfers, which pair
    /// ranks of other nodes only where they have the same local rank (one rank per node), else
    /// [`Error::Unsupported`].
    pub fn all_to_all<T: Plain, S: DevicePtr<T>, R: DevicePtrMut<T> + DevicePtr<T>>(
        &self,
        send: &S,
        recv: &mut R,
    ) -> Result<()> {
        if unit_bytes::<T>() < std::mem::size_of::<T>() {
            whole_blocks([(self.rank(), recv.len())], self.world(), "all_to_all receive buffer")?;
        }
        in_units!(T, |U| {
            self.all_to_all_units::<U, _, _>(&Units::<T, U, S>::new(send), &mut UnitsMut::<T, U, R>::new(recv))
        })
    }

    fn all_to_all_units<T: Element, S: DevicePtr<T>, R: DevicePtrMut<T> + DevicePtr<T>>(
        &self,
        send: &S,
        recv: &mut R,
    ) -> Result<()> {
        self.usable()?;
        let count = self.block(recv.len(), "all_to_all receive buffer")?;
        if self.nodes.is_some() {
            // Across nodes, as its sends and receives (ranks of one local rank on each node).
            let counts = vec![count; self.world()];
            return self.all_to_allv(send, &counts, recv, &counts);
        }
        self.inner.collective::<T, S, R>(
            Collective::AllToAll,
            Count::FromRecv(count),
            Some(std::slice::from_ref(send)),
            std::slice::from_mut(recv),
            ReduceOp::Sum,
            Holders::All,
        )
    }

    /// In-place AllGather: block `rank` of `buf` is this rank's contribution (nccl's `sendbuff =
    /// recvbuff + rank × count`); `buf` ends with every rank's block. Any [`Plain`] element type.
    pub fn all_gather_in_place<T: Plain, R: DevicePtrMut<T> + DevicePtr<T>>(&self, buf: &mut R) -> Result<()> {
        if unit_bytes::<T>() < std::mem::size_of::<T>() {
            whole_blocks([(self.rank(), buf.len())], self.world(), "in-place all_gather buffer")?;
        }
        in_units!(T, |U| { self.all_gather_in_place_units::<U, _>(&mut UnitsMut::<T, U, R>::new(buf)) })
    }

    fn all_gather_in_place_units<T: Element, R: DevicePtrMut<T> + DevicePtr<T>>(&self, buf: &mut R) -> Result<()> {
        self.usable()?;
        let count = self.block(buf.len(), "in-place all_gather buffer")?;
        if let Some(n) = &self.nodes {
            let stream = self.stream().clone();
            let (r, _r) = buf.device_ptr_mut(&stream);
            return self.across::<T>(n, &stream, (Collective::AllGather, count, true), 0, r, ReduceOp::Sum);
        }
        self.inner.collective::<T, R, R>(
            Collective::AllGather,
            Count::FromRecv(count),
            None,
            std::slice::from_mut(buf),
            ReduceOp::Sum,
            Holders::All,
        )
    }

    /// Broadcast: `recv` becomes a copy of rank `root`'s `send`. The root passes `Some(send)`
    /// (distinct from its `recv`; see [`Comm::broadcast_in_place`]); other ranks' `send` is not
    /// used (pass `None`). Any [`Plain`] element type.
    pub fn broadcast<T: Plain, S: DevicePtr<T>, R: DevicePtrMut<T> + DevicePtr<T>>(
        &self,
        send: Option<&S>,
        recv: &mut R,
        root: usize,
    ) -> Result<()> {
        in_units!(T, |U| {
            let send = send.map(Units::<T, U, S>::new);
            self.broadcast_units::<U, _, _>(send.as_ref(), &mut UnitsMut::<T, U, R>::new(recv), root)
        })
    }

    fn broadcast_units<T: Element, S: DevicePtr<T>, R: DevicePtrMut<T> + DevicePtr<T>>(
        &self,
        send: Option<&S>,
        recv: &mut R,
        root: usize,
    ) -> Result<()> {
        self.usable()?;
        if let Some(n) = &self.nodes {
            let (me, world) = (n.rank, self.world());
            if root >= world {
                return Err(Error::NoSuchRank { rank: root, ranks: world });
            }
            let count = recv.len();
            let stream = self.stream().clone();
            let (r, _r) = recv.device_ptr_mut(&stream);
            // The send buffer's guard lives until the steps are queued.
            let mut _guard = None;
            let input = match (root == me, send) {
                (true, Some(s)) => {
                    if s.len() != count {
                        return Err(Error::Length {
                            what: "broadcast send buffer",
                            rank: me,
                            expected: count,
                            got: s.len(),
                        });
                    }
                    let (p, guard) = s.device_ptr(&stream);
                    _guard = Some(guard);
                    disjoint(p, count * std::mem::size_of::<T>(), r, count * std::mem::size_of::<T>(), me)?;
                    p
                }
                (true, None) => {
                    return Err(Error::MissingBuffer {
                        what: "broadcast send buffer",
                        rank: root,
                        elements: count as u64,
                    });
                }
                // Not read: the other ranks receive only.
                (false, _) => 0,
            };
            let collective = Collective::Broadcast { root: root as u32 };
            return self.across::<T>(n, &stream, (collective, count, false), input, r, ReduceOp::Sum);
        }
        let collective = self.inner.rooted(root, |root| Collective::Broadcast { root })?;
        let send: &[S] = match (root == self.rank, send) {
            (true, Some(s)) => std::slice::from_ref(s),
            (true, None) => {
                return Err(Error::MissingBuffer {
                    what: "broadcast send buffer",
                    rank: root,
                    elements: recv.len() as u64,
                });
            }
            (false, _) => &[],
        };
        self.inner.collective::<T, S, R>(
            collective,
            Count::FromRecv(recv.len()),
            Some(send),
            std::slice::from_mut(recv),
            ReduceOp::Sum,
            Holders::All,
        )
    }

    /// In-place Broadcast: `buf` becomes a copy of rank `root`'s `buf`. Any [`Plain`] element type.
    pub fn broadcast_in_place<T: Plain, R: DevicePtrMut<T> + DevicePtr<T>>(
        &self,
        buf: &mut R,
        root: usize,
    ) -> Result<()> {
        in_units!(T, |U| { self.broadcast_in_place_units::<U, _>(&mut UnitsMut::<T, U, R>::new(buf), root) })
    }

    fn broadcast_in_place_units<T: Element, R: DevicePtrMut<T> + DevicePtr<T>>(
        &self,
        buf: &mut R,
        root: usize,
    ) -> Result<()> {
        self.usable()?;
        if let Some(n) = &self.nodes {
            if root >= self.world() {
                return Err(Error::NoSuchRank { rank: root, ranks: self.world() });
            }
            let (stream, count) = (self.stream().clone(), buf.len());
            let (r, _r) = buf.device_ptr_mut(&stream);
            let collective = Collective::Broadcast { root: root as u32 };
            return self.across::<T>(n, &stream, (collective, count, true), 0, r, ReduceOp::Sum);
        }
        let collective = self.inner.rooted(root, |root| Collective::Broadcast { root })?;
        self.inner.collective::<T, R, R>(
            collective,
            Count::FromRecv(buf.len()),
            None,
            std::slice::from_mut(buf),
            ReduceOp::Sum,
            Holders::All,
        )
    }

    /// Reduce: rank `root`'s `recv` becomes op over every rank's `send`, element-wise. The root
    /// passes `Some(recv)` (as long as `send`, distinct from it; see [`Comm::reduce_in_place`]);
    /// other ranks' `recv` is not used (pass `None`).
    pub fn reduce<T: Element, S: DevicePtr<T>, R: DevicePtrMut<T> + DevicePtr<T>>(
        &self,
        send: &S,
        recv: Option<&mut R>,
        op: ReduceOp,
        root: usize,
    ) -> Result<()> {
        self.usable()?;
        if let Some(n) = &self.nodes {
            let (me, world, count) = (n.rank, self.world(), send.len());
            if root >= world {
                return Err(Error::NoSuchRank { rank: root, ranks: world });
            }
            let stream = self.stream().clone();
            let (s, _s) = send.device_ptr(&stream);
            let call = (Collective::Reduce { root: root as u32 }, count, false);
            return match (root == me, recv) {
                (true, Some(r)) => {
                    if r.len() != count {
                        return Err(Error::Length {
                            what: "reduce receive buffer",
                            rank: me,
                            expected: count,
                            got: r.len(),
                        });
                    }
                    let (rp, _r) = r.device_ptr_mut(&stream);
                    disjoint(s, count * std::mem::size_of::<T>(), rp, count * std::mem::size_of::<T>(), me)?;
                    self.across::<T>(n, &stream, call, s, rp, op)
                }
                (true, None) => {
                    Err(Error::MissingBuffer { what: "reduce receive buffer", rank: root, elements: count as u64 })
                }
                // The other ranks have no receive buffer.
                (false, _) => self.across::<T>(n, &stream, call, s, 0, op),
            };
        }
        let collective = self.inner.rooted(root, |root| Collective::Reduce { root })?;
        let recv: &mut [R] = match (root == self.rank, recv) {
            (true, Some(r)) => std::slice::from_mut(r),
            (true, None) => {
                return Err(Error::MissingBuffer {
                    what: "reduce receive buffer",
                    rank: root,
                    elements: send.len() as u64,
                });
            }
            (false, _) => &mut [],
        };
        self.inner.collective::<T, S, R>(
            collective,
            Count::FromSend(send.len()),
            Some(std::slice::from_ref(send)),
            recv,
            op,
            Holders::Root(root),
        )
    }

    /// In-place Reduce: rank `root`'s `buf` becomes the reduction of every rank's `buf`; the others
    /// are left as they are.
    pub fn reduce_in_place<T: Element, R: DevicePtrMut<T> + DevicePtr<T>>(
        &self,
        buf: &mut R,
        op: ReduceOp,
        root: usize,
    ) -> Result<()> {
        self.usable()?;
        if let Some(n) = &self.nodes {
            if root >= self.world() {
                return Err(Error::NoSuchRank { rank: root, ranks: self.world() });
            }
            let (stream, count) = (self.stream().clone(), buf.len());
            let (r, _r) = buf.device_ptr_mut(&stream);
            let collective = Collective::Reduce { root: root as u32 };
            return self.across::<T>(n, &stream, (collective, count, true), 0, r, op);
        }
        let collective = self.inner.rooted(root, |root| Collective::Reduce { root })?;
        self.inner.collective::<T, R, R>(
            collective,
            Count::FromRecv(buf.len()),
            None,
            std::slice::from_mut(buf),
            op,
            Holders::All,
        )
    }

    /// Moves a tensor of global shape `shape` from layout `src_layout` to layout `dst_layout` (as
    /// [`Communicator::reshard`], with this rank's shards only): `src` is this rank's source shard
    /// and `dst` its destination shard, each a dense row-major buffer of the rank's box (see
    /// `docs/RESHARD.md`); `None` where this rank is outside that side's mesh, `None` or an empty
    /// buffer where its shard is empty. A rank in both meshes passes two distinct buffers (reshard
    /// is out of place). Every rank of the communicator calls it, with the same `shape`, element
    /// type, layouts and options, also a rank outside both meshes (it passes `None` twice and moves
    /// nothing, but its launches keep the ranks in step): a rank whose peers made another call gets
    /// [`Error::CallMismatch`] from [`Comm::synchronize`]. A call refused here (an error returned)
    /// launches nothing on this rank, and its peers' calls end in [`Error::Timeout`].
    ///
    /// Asynchronous on this rank's stream; [`Comm::synchronize`] waits and reports device errors.
    /// Across processes, buffers from [`Comm::alloc_symmetric`] are reached where they are; others
    /// are copied through staging memory (the source in before the call, the destination out after
    /// it). The plan is built, lowered and uploaded on the first call with a given (shape, `T`,
    /// layouts, options) and reused after.
    ///
    /// Errors: as [`Communicator::reshard`], for this rank's buffers ([`Error::Length`],
    /// [`Error::MissingBuffer`] and [`Error::UnexpectedBuffer`] name this rank); [`Error::Aborted`]
    /// after [`Comm::abort`].
    pub fn reshard<T: Plain, S: DevicePtr<T>, R: DevicePtrMut<T> + DevicePtr<T>>(
        &self,
        src: Option<&S>,
        dst: Option<&mut R>,
        shape: &[u64],
        src_layout: &Layout,
        dst_layout: &Layout,
        options: &ReshardOptions,
    ) -> Result<()> {
        let (srcs, mut dsts) = self.reshard_entries(src, dst)?;
        self.inner.reshard(&srcs, &mut dsts, shape, src_layout, dst_layout, options)
    }

    /// This rank's part of [`Communicator::run_program`]: every rank calls it with the same
    /// program, element type and operator, and buffers of the same size, its own input `send` and
    /// output `recv`. Across processes the buffers are staged as a collective's, and the program's
    /// scratch chunks are in the staging memory.
    ///
    /// Errors: as [`Communicator::run_program`], naming this rank; [`Error::CallMismatch`] where a
    /// peer runs another program, size, type or operator; [`Error::Aborted`] after
    /// [`Comm::abort`]; [`Error::Unsupported`] across nodes.
    pub fn run_program<T: Element, S: DevicePtr<T>, R: DevicePtrMut<T>>(
        &self,
        program: &Program,
        send: &S,
        recv: &mut R,
        op: ReduceOp,
    ) -> Result<()> {
        self.usable()?;
        self.one_node("run_program")?;
        let me = self.rank;
        self.inner.check_placement(send.len(), ordinal_of(send), me, None, "send buffer")?;
        self.inner.check_placement(recv.len(), ordinal_of(recv), me, None, "receive buffer")?;
        let e = std::mem::size_of::<T>() as u64;
        let (ins, outs) = (send.len() as u64 * e, recv.len() as u64 * e);
        let (input, g1) = send.device_ptr(self.stream());
        let (output, g2) = recv.device_ptr_mut(self.stream());
        let bufs = [crate::direct::RankBuffers { rank: me, input: Some((input, ins)), output: (output, outs) }];
        let ran = self.inner.program_call(program, T::DTYPE, op, e, &bufs, false);
        drop((g1, g2));
        ran
    }

    /// This rank's part of [`Communicator::run_program_in_place`]: `buf` is its one buffer.
    pub fn run_program_in_place<T: Element, R: DevicePtrMut<T>>(
        &self,
        program: &Program,
        buf: &mut R,
        op: ReduceOp,
    ) -> Result<()> {
        self.usable()?;
        self.one_node("run_program_in_place")?;
        let me = self.rank;
        self.inner.check_placement(buf.len(), ordinal_of(buf), me, None, "buffer")?;
        let e = std::mem::size_of::<T>() as u64;
        let len = buf.len() as u64 * e;
        let (output, g) = buf.device_ptr_mut(self.stream());
        let bufs = [crate::direct::RankBuffers { rank: me, input: None, output: (output, len) }];
        let ran = self.inner.program_call(program, T::DTYPE, op, e, &bufs, true);
        drop(g);
        ran
    }

    /// A reshard's buffer lists: one entry per rank of the world, this rank's given, `None` for
    /// the others (their own callers pass theirs); after this rank's usability checks.
    #[allow(clippy::type_complexity)]
    fn reshard_entries<'a, S, R>(
        &self,
        src: Option<&'a S>,
        dst: Option<&'a mut R>,
    ) -> Result<(Vec<Option<&'a S>>, Vec<Option<&'a mut R>>)> {
        self.usable()?;
        self.one_node("reshard")?;
        let mut srcs: Vec<Option<&S>> = vec![None; self.world()];
        let mut dsts: Vec<Option<&mut R>> = (0..self.world()).map(|_| None).collect();
        srcs[self.rank] = src;
        dsts[self.rank] = dst;
        Ok((srcs, dsts))
    }

    /// [`Comm::reshard`] from a source whose layout may place mesh axes `Partial`: this rank's
    /// source holds its partial value of its box, and the destination gets the ranks' partial
    /// values combined with `op` (as [`Communicator::reshard_reduce`]). Every rank calls it, with the
    /// same arguments but its own buffers.
    ///
    /// Errors: as [`Comm::reshard`]; a destination placed `Partial` is [`Error::Reshard`].
    #[allow(clippy::too_many_arguments)]
    pub fn reshard_reduce<T: Element, S: DevicePtr<T>, R: DevicePtrMut<T> + DevicePtr<T>>(
        &self,
        src: Option<&S>,
        dst: Option<&mut R>,
        shape: &[u64],
        src_layout: &Layout,
        dst_layout: &Layout,
        op: ReduceOp,
        options: &ReshardOptions,
    ) -> Result<()> {
        let (srcs, mut dsts) = self.reshard_entries(src, dst)?;
        self.inner.reshard_reduce(&srcs, &mut dsts, shape, src_layout, dst_layout, op, options)
    }

    /// Elements per rank of an in-place buffer of `len` elements holding one block per rank.
    fn block(&self, len: usize, what: &'static str) -> Result<usize> {
        let p = self.world();
        if !len.is_multiple_of(p) {
            return Err(Error::Length { what, rank: self.rank, expected: len.next_multiple_of(p), got: len });
        }
        Ok(len / p)
    }

    /// Builds and uploads the plan a later call with these arguments uses (as
    /// [`Communicator::prepare`]): that call then only queues its kernel (and, for buffers other
    /// processes cannot map, its staging copies), so it can be captured in a CUDA graph.
    pub fn prepare<T: Element>(
        &self,
        collective: Collective,
        count: usize,
        op: ReduceOp,
        in_place: bool,
    ) -> Result<CallLaunch> {
        self.usable()?;
        self.one_node("prepare")?;
        self.inner.prepare::<T>(collective, count, op, in_place)
    }

    /// [`Comm::prepare`] for a collective that only copies, of any [`Plain`] type (as
    /// [`Communicator::prepare_copy`]).
    pub fn prepare_copy<T: Plain>(&self, collective: Collective, count: usize, in_place: bool) -> Result<CallLaunch> {
        self.usable()?;
        self.one_node("prepare")?;
        self.inner.prepare_copy::<T>(collective, count, in_place)
    }

    /// Frees this rank's cached plans (collectives, reshards, transfers and groups) after waiting for
    /// its stream, as [`Communicator::clear_plans`]: a caller whose shapes or groups keep changing
    /// bounds the device memory the cache holds this way. Each rank clears its own; later calls
    /// build their plans again.
    pub fn clear_plans(&self) -> Result<()> {
        self.inner.clear_plans()
    }

    /// Waits for this rank's calls and reports a device-side error (as
    /// [`Communicator::synchronize`]).
    ///
    /// Across nodes it also watches the inter-node engine: an error it records, or calls still
    /// unfinished after [`Config::timeout`], aborts the inter-node group (NCCL's `ncclCommAbort`,
    /// which ends its calls in flight) and returns [`Error::InterNode`]; build a new communicator
    /// then.
    pub fn synchronize(&self) -> Result<()> {
        if let Some(n) = &self.nodes
            && let Err(e) = n.wait_inter(|| self.stream_done())
        {
            self.abort();
            return Err(e);
        }
        self.inner.synchronize()
    }

    /// Whether the rank's stream has run everything queued on it (`cuStreamQuery`).
    fn stream_done(&self) -> Result<bool> {
        let stream = self.stream();
        crate::engine::bind(stream.context())?;
        // SAFETY: a live stream of the context just made current.
        match unsafe { sys::cuStreamQuery(stream.cu_stream()) }.result() {
            Ok(()) => Ok(true),
            Err(cudarc::driver::DriverError(sys::CUresult::CUDA_ERROR_NOT_READY)) => Ok(false),
            Err(e) => Err(Error::Driver { call: "cuStreamQuery", source: e }),
        }
    }

    /// Polls this rank's calls (as [`Communicator::query`]); across nodes, an error the
    /// inter-node engine recorded too.
    pub fn query(&self) -> Result<bool> {
        if let Some(n) = &self.nodes {
            if let Err(e) = n.inter.check() {
                self.abort();
                return Err(e);
            }
            if !self.stream_done()? {
                return Ok(false);
            }
        }
        self.inner.query()
    }

    /// After an error: waits for this rank's stream, clears its device state, then waits for
    /// every other rank to have done the same (collective: every rank calls it).
    pub fn reset(&self) -> Result<()> {
        self.usable()?;
        self.inner.reset()
    }

    /// Stops using the communicator: later calls return [`Error::Aborted`] (across nodes the
    /// inter-node group is aborted too: NCCL ends its calls in flight). Calls already queued
    /// end within their bounded waits (peers that wait for this rank time out); drop the
    /// communicator and build a new one to go on.
    pub fn abort(&self) {
        if let Some(l) = &self.inner.link {
            l.aborted.store(true, Ordering::SeqCst);
        }
        // Peers waiting for this rank's next call give up at once.
        self.inner.withdraw();
        if let Some(n) = &self.nodes {
            n.fail();
        }
    }

    /// `len` elements of device memory every rank of the communicator reaches where it is (in
    /// other processes too: the zero-copy path), on this rank's stream's device, zeroed in that
    /// stream's order. Each rank
    /// allocates its own (not collective); use it like any cudarc buffer (it dereferences to a
    /// [`CudaSlice`]).
    pub fn alloc_symmetric<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        &self,
        len: usize,
    ) -> Result<SymmetricBuffer<T>> {
        let bytes = len
            .checked_mul(std::mem::size_of::<T>())
            .ok_or_else(|| Error::Config { field: "len", why: format!("{len} elements overflow the address space") })?;
        let stream = self.stream().clone();
        let (alloc, region) = match self.inner.link.as_ref().and_then(|l| l.peer.as_ref()) {
            Some(peer) => {
                let (region, alloc) = peer.alloc(bytes, Some(&stream))?;
                (alloc, Some(region))
            }
            None => {
                // One process: every rank's device reaches it where it is (the ranks' devices).
                let access = self.inner.link.as_ref().map(|l| l.access.clone()).unwrap_or_default();
                (Arc::new(VmmAlloc::new(stream.context(), bytes, &access, Some(&stream))?), None)
            }
        };
        let shared = region.zip(self.inner.link.as_ref().and_then(|l| l.peer.clone()));
        Ok(SymmetricBuffer { buf: ExportableBuffer::over(&stream, alloc, len), shared: shared.map(|(r, p)| (p, r)) })
    }
}

impl Comm {
    /// Registers the allocation holding `buf` with this rank's peers in other processes, so that
    /// calls on any buffer inside it reach it where it is (the zero-copy path) instead of copying
    /// it through staging memory. For virtual-memory allocations made with a POSIX
    /// file-descriptor handle type and mapped whole: an [`ExportableBuffer`], another
    /// communicator's [`SymmetricBuffer`], or a `cuMemCreate` of your own. cudarc's allocations
    /// come from stream-ordered pools, which CUDA cannot share between processes, and
    /// `cuMemAlloc` memory would need CUDA's legacy IPC, with which registered buffers stalled
    /// the peers' calls for a timeout on an H200 (opening or closing a mapping in a peer likely
    /// waits for its queued calls, which may wait for this rank): both are refused
    /// ([`Error::PeerMemory`]); pass them unregistered (staged). Where every rank is in this process
    /// nothing needs registering and the registration does nothing. Not collective: each rank
    /// registers its own. The registration ends when the returned value drops, which waits for this
    /// rank's stream and for every peer to unmap the allocation.
    ///
    /// # Safety
    /// The allocation must stay mapped at its addresses until the [`Registration`] has dropped:
    /// another allocation there would be taken for it (the peers keep the first one's memory
    /// alive, so freeing early loses no memory to them, but calls would move the wrong bytes).
    ///
    /// Errors: [`Error::PeerMemory`] for memory that cannot be shared (another device's, one not
    /// made as above) or a peer that could not map it; [`Error::Driver`] for a failing driver
    /// call; [`Error::Aborted`] after [`Comm::abort`].
    pub unsafe fn register<T, B: DevicePtr<T>>(&self, buf: &B) -> Result<Registration> {
        self.usable()?;
        let stream = self.stream().clone();
        let Some(peer) = self.inner.link.as_ref().and_then(|l| l.peer.clone()) else {
            return Ok(Registration { stream, shared: None });
        };
        let bytes = buf.num_bytes();
        let region = {
            let (ptr, _guard) = buf.device_ptr(&stream);
            // SAFETY: the caller keeps the allocation until the registration (which deregisters)
            // drops.
            unsafe { peer.register(ptr, bytes) }?
        };
        Ok(Registration { stream, shared: Some((peer, region)) })
    }
}

/// A registered allocation ([`Comm::register`]); dropping it waits for the rank's stream, then
/// closes the allocation on every peer.
pub struct Registration {
    stream: Arc<CudaStream>,
    /// Across processes: the shared memory it is a region of, and its number.
    shared: Option<(Arc<PeerMemory>, u32)>,
}

impl std::fmt::Debug for Registration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registration").field("region", &self.shared.as_ref().map(|s| s.1)).finish()
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        if let Some((peer, region)) = self.shared.take() {
            // The calls that used it (and so every peer's use of it) end before it is closed.
            let _ = crate::engine::wait_stream(&self.stream);
            peer.deregister(region);
        }
    }
}

/// Device memory every rank of a [`Comm`] reaches where it is: the zero-copy path between
/// processes (as torch's symmetric memory and NCCL's registered windows). Dereferences to a
/// cudarc [`CudaSlice`], so it is passed to calls, copied and sliced like any other buffer. Its
/// drop waits for its stream, then withdraws it from the peers and frees it.
pub struct SymmetricBuffer<T> {
    buf: ExportableBuffer<T>,
    /// Across processes: the shared memory it is a region of, and its number.
    shared: Option<(Arc<PeerMemory>, u32)>,
}

impl<T> std::ops::Deref for SymmetricBuffer<T> {
    type Target = CudaSlice<T>;
    fn deref(&self) -> &CudaSlice<T> {
        &self.buf
    }
}

impl<T> std::ops::DerefMut for SymmetricBuffer<T> {
    fn deref_mut(&mut self) -> &mut CudaSlice<T> {
        &mut self.buf
    }
}

impl<T> std::fmt::Debug for SymmetricBuffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SymmetricBuffer")
            .field("len", &self.buf.len())
            .field("bytes", &self.buf.alloc.bytes())
            .field("region", &self.shared.as_ref().map(|s| s.1))
            .finish()
    }
}

impl<T> Drop for SymmetricBuffer<T> {
    fn drop(&mut self) {
        if let Some((peer, region)) = self.shared.take() {
            // The calls that used it (and so every peer's use of it) end before it is withdrawn;
            // the memory is freed after, when `buf` drops.
            let _ = crate::engine::wait_stream(self.buf.stream());
            peer.release(region);
        }
    }
}

/// Device memory other processes can map (CUDA's virtual-memory API, with a POSIX file-descriptor
/// handle), not tied to a communicator: register it with any of them ([`Comm::register`]), such as
/// a gradient bucket that a data-parallel and a tensor-parallel group both reduce. Dereferences to
/// a cudarc [`CudaSlice`]; its drop waits for its stream, then frees it.
pub struct ExportableBuffer<T> {
    /// The memory as a cudarc slice, never freed through cudarc (leaked on drop).
    slice: ManuallyDrop<CudaSlice<T>>,
    alloc: Arc<VmmAlloc>,
}

impl<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits> ExportableBuffer<T> {
    /// `len` elements on `stream`'s device, zeroed in that stream's order.
    pub fn new(stream: &Arc<CudaStream>, len: usize) -> Result<Self> {
        let bytes = len
            .checked_mul(std::mem::size_of::<T>())
            .ok_or_else(|| Error::Config { field: "len", why: format!("{len} elements overflow the address space") })?;
        let access = peer_devices(stream.context().ordinal())?;
        let alloc = Arc::new(VmmAlloc::new(stream.context(), bytes, &access, Some(stream))?);
        Ok(ExportableBuffer::over(stream, alloc, len))
    }
}

/// The other devices that can reach device `ordinal`'s memory (peer access): virtual-memory
/// allocations name each device that may touch them, so that ranks of one process on those
/// devices reach an [`ExportableBuffer`] where it is, as they do cudarc's memory.
fn peer_devices(ordinal: usize) -> Result<Vec<usize>> {
    use cudarc::driver::result::device;
    let n = CudaContext::device_count().map_err(Error::driver("cuDeviceGetCount"))?;
    let own = device::get(ordinal as i32).map_err(Error::driver("cuDeviceGet"))?;
    let mut peers = Vec::new();
    for d in (0..n).filter(|&d| d as usize != ordinal) {
        let dev = device::get(d).map_err(Error::driver("cuDeviceGet"))?;
        let mut can = 0;
        // SAFETY: an out-pointer and two valid device handles.
        unsafe { sys::cuDeviceCanAccessPeer(&mut can, dev, own) }
            .result()
            .map_err(Error::driver("cuDeviceCanAccessPeer"))?;
        if can != 0 {
            peers.push(d as usize);
        }
    }
    Ok(peers)
}

impl<T> ExportableBuffer<T> {
    /// `len` elements of `alloc` (which holds at least that many, of `stream`'s device) as a slice
    /// on `stream`.
    fn over(stream: &Arc<CudaStream>, alloc: Arc<VmmAlloc>, len: usize) -> Self {
        // SAFETY: `alloc` holds at least `len` elements of this stream's device and outlives the
        // slice: drop leaks the slice (never frees it through cudarc) before it drops `alloc`.
        let slice = unsafe { stream.upgrade_device_ptr::<T>(alloc.ptr(), len) };
        ExportableBuffer { slice: ManuallyDrop::new(slice), alloc }
    }
}

impl<T> std::ops::Deref for ExportableBuffer<T> {
    type Target = CudaSlice<T>;
    fn deref(&self) -> &CudaSlice<T> {
        &self.slice
    }
}

impl<T> std::ops::DerefMut for ExportableBuffer<T> {
    fn deref_mut(&mut self) -> &mut CudaSlice<T> {
        &mut self.slice
    }
}

impl<T> std::fmt::Debug for ExportableBuffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExportableBuffer").field("len", &self.slice.len()).field("bytes", &self.alloc.bytes()).finish()
    }
}

impl<T> Drop for ExportableBuffer<T> {
    fn drop(&mut self) {
        // SAFETY: taken once, here; the slice is not used again.
        let slice = unsafe { ManuallyDrop::take(&mut self.slice) };
        let stream = slice.stream().clone();
        // cudarc's free would be `cuMemFreeAsync` of memory it did not allocate: leak the slice.
        let _ = slice.leak();
        // The calls that used it end before the memory is freed (when `alloc` drops after this).
        let _ = crate::engine::wait_stream(&stream);
    }
}

/// Shares `ws`, this rank's workspace, with the other ranks, all threads of this process
/// (collective): every rank's address, by rank, and every rank's workspace, held by this one. Each
/// takes them before the closing barrier, which no rank passes until all have theirs.
fn share_in_process(
    ws: &Arc<DeviceAlloc>,
    bootstrap: &dyn Bootstrap,
) -> Result<([u64; MAX_RANKS], Vec<Arc<DeviceAlloc>>)> {
    let field = "setup";
    let mut known = IN_PROCESS_WORKSPACES.lock().unwrap_or_else(|e| e.into_inner());
    known.retain(|(_, w)| w.strong_count() > 0);
    known.push((ws.ptr(), Arc::downgrade(ws)));
    drop(known);
    let mut workspaces = [0u64; MAX_RANKS];
    let mut held = Vec::new();
    for (r, a) in bootstrap.all_gather(&ws.ptr().to_le_bytes())?.iter().enumerate() {
        workspaces[r] = u64::from_le_bytes(a.as_slice().try_into().map_err(|_| Error::Mismatch {
            field,
            rank: r,
            why: "sent a workspace address of another size".into(),
        })?);
        let known = IN_PROCESS_WORKSPACES.lock().unwrap_or_else(|e| e.into_inner());
        let w = known.iter().find(|(p, _)| *p == workspaces[r]).and_then(|(_, w)| w.upgrade());
        held.push(w.ok_or(Error::Mismatch { field, rank: r, why: "its workspace was freed during setup".into() })?);
    }
    bootstrap.barrier()?;
    Ok((workspaces, held))
}
