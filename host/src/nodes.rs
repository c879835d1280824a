//! Ranks across nodes: which node each rank is on ([`NodeMap`]), and the staged hierarchical
//! collectives ([`Staged`]): NVLink inside each node (oxccl's engine), an inter-node engine (NCCL)
//! among the ranks of one local index, cut into pieces so that the two sides overlap.
//!
//! A staged plan is a list of [`Step`]s in the order a rank issues them, each on one [`Side`] and
//! waiting for the step before it on the other side ([`Step::after`]). The communicator runs it on
//! two streams; [`Staged::run_cpu`] runs it on host vectors with the CPU references, the semantic
//! oracle; [`Staged::link_bytes`] counts what each rank sends over NVLink and over its NIC, which
//! the simulator's `hier-*` programs ([`crate::program::generators::Algorithm::HierAllReduce`])
//! reproduce.

use crate::collective::Collective;
use crate::exec::{Element, ExecError, ReduceOp, reference};
use std::ops::Range;

/// Why ranks do not form nodes a staged collective can run on.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum NodeError {
    /// No ranks.
    #[error("no ranks")]
    Empty,
    /// A node holds another number of ranks than the first (NCCL's groups among the ranks of one
    /// local index need every node to have each index once).
    #[error("node {node} holds {ranks} ranks, node 0 holds {expected}: every node needs the same number")]
    Uneven {
        /// The node, numbered in order of its first rank.
        node: u32,
        /// Its ranks.
        ranks: u32,
        /// Node 0's.
        expected: u32,
    },
    /// A ranks-per-node setting that does not divide the world.
    #[error("{per_node} ranks per node does not divide {world} ranks")]
    BadRanksPerNode {
        /// The ranks.
        world: usize,
        /// The setting.
        per_node: usize,
    },
    /// A node (by a ranks-per-node count) whose ranks are on different hosts: a node's ranks share
    /// memory, so they must share a host.
    #[error("node {node} holds ranks {first} and {other}, which are on different hosts")]
    SpansHosts {
        /// The node.
        node: u32,
        /// Its first rank.
        first: u32,
        /// A rank of it on another host.
        other: u32,
    },
    /// A collective that needs the ranks numbered node by node (rank = node × ranks per node +
    /// local index, as torchrun and `oxccl launch` number them).
    #[error("rank {rank} is on node {node} as local rank {local}: {what} needs ranks numbered node by node")]
    NotNodeMajor {
        /// What needed it.
        what: &'static str,
        /// The first rank out of place.
        rank: u32,
        /// Its node.
        node: u32,
        /// Its local index.
        local: u32,
    },
}

/// Which node each rank is on and its index there (its *local rank*). Nodes are numbered in order
/// of their first rank; local indices in rank order within a node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeMap {
    per_node: u32,
    node_of: Vec<u32>,
    local_of: Vec<u32>,
    /// Node by node, local index by local index: the rank.
    ranks: Vec<u32>,
}

/// How a rank's point-to-point transfers reach another rank ([`NodeMap::path`]).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Path {
    /// On the same node: the peer's local index there.
    Node {
        /// The peer's local index.
        local: u32,
    },
    /// On another node with the same local index: the peer's index in the inter-node group.
    Group {
        /// The peer's node.
        node: u32,
    },
    /// On another node with another local index: no engine of the rank's reaches it directly.
    Relay,
}

impl NodeMap {
    /// The nodes `keys` name (one key per rank, e.g. its host's identity): ranks with equal keys
    /// share a node.
    pub fn from_keys<K: PartialEq>(keys: &[K]) -> Result<NodeMap, NodeError> {
        if keys.is_empty() {
            return Err(NodeError::Empty);
        }
        let mut firsts: Vec<usize> = Vec::new();
        let mut node_of = Vec::with_capacity(keys.len());
        let mut counts: Vec<u32> = Vec::new();
        let mut local_of = Vec::with_capacity(keys.len());
        for (r, k) in keys.iter().enumerate() {
            let n = match firsts.iter().position(|&f| keys[f] == *k) {
                Some(n) => n,
                None => {
                    firsts.push(r);
                    counts.push(0);
                    firsts.len() - 1
                }
            };
            node_of.push(n as u32);
            local_of.push(counts[n]);
            counts[n] += 1;
        }
        let per_node = counts[0];
        if let Some(n) = counts.iter().position(|&c| c != per_node) {
            return Err(NodeError::Uneven { node: n as u32, ranks: counts[n], expected: per_node });
        }
        let mut ranks = vec![0u32; keys.len()];
        for r in 0..keys.len() {
            ranks[(node_of[r] * per_node + local_of[r]) as usize] = r as u32;
        }
        Ok(NodeMap { per_node, node_of, local_of, ranks })
    }

    /// `world` ranks, `per_node` to a node in rank order (one machine posing as several nodes).
    pub fn by_count(world: usize, per_node: usize) -> Result<NodeMap, NodeError> {
        if world == 0 {
            return Err(NodeError::Empty);
        }
        if per_node == 0 || !world.is_multiple_of(per_node) {
            return Err(NodeError::BadRanksPerNode { world, per_node });
        }
        let keys: Vec<usize> = (0..world).map(|r| r / per_node).collect();
        NodeMap::from_keys(&keys)
    }

    /// This map, where every node's ranks share a key of `keys` (one per rank: its host), else
    /// [`NodeError::SpansHosts`] naming the first node that does not.
    pub fn within_hosts<K: PartialEq>(self, keys: &[K]) -> Result<NodeMap, NodeError> {
        for node in 0..self.nodes() {
            let ranks = self.node_ranks(node);
            if let Some(&other) = ranks.iter().find(|&&r| keys[r as usize] != keys[ranks[0] as usize]) {
                return Err(NodeError::SpansHosts { node, first: ranks[0], other });
            }
        }
        Ok(self)
    }

    /// Ranks.
    pub fn world(&self) -> u32 {
        self.node_of.len() as u32
    }

    /// Nodes.
    pub fn nodes(&self) -> u32 {
        self.world() / self.per_node
    }

    /// Ranks per node.
    pub fn per_node(&self) -> u32 {
        self.per_node
    }

    /// The node of `rank`.
    pub fn node(&self, rank: u32) -> u32 {
        self.node_of[rank as usize]
    }

    /// The local index of `rank` on its node.
    pub fn local(&self, rank: u32) -> u32 {
        self.local_of[rank as usize]
    }

    /// The rank of local index `local` on `node`.
    pub fn rank(&self, node: u32, local: u32) -> u32 {
        self.ranks[(node * self.per_node + local) as usize]
    }

    /// The ranks of `node`, by local index: its intra-node group.
    pub fn node_ranks(&self, node: u32) -> &[u32] {
        let p = self.per_node as usize;
        &self.ranks[node as usize * p..(node as usize + 1) * p]
    }

    /// How rank `a`'s transfers reach rank `b` (both below [`NodeMap::world`]): through `a`'s node
    /// communicator, through its inter-node group, or only through a rank between them.
    pub fn path(&self, a: u32, b: u32) -> Path {
        let (node, local) = (self.node(b), self.local(b));
        if node == self.node(a) {
            Path::Node { local }
        } else if local == self.local(a) {
            Path::Group { node }
        } else {
            Path::Relay
        }
    }

    /// The ranks of local index `local`, node by node: its inter-node group.
    pub fn local_ranks(&self, local: u32) -> Vec<u32> {
        (0..self.nodes()).map(|n| self.rank(n, local)).collect()
    }

    /// Whether rank = node × ranks per node + local index for every rank; the first rank that
    /// breaks it as the error otherwise.
    pub fn node_major(&self, what: &'static str) -> Result<(), NodeError> {
        match (0..self.world()).find(|&r| r != self.node(r) * self.per_node + self.local(r)) {
            None => Ok(()),
            Some(rank) => Err(NodeError::NotNodeMajor { what, rank, node: self.node(rank), local: self.local(rank) }),
        }
    }
}

/// Which engine a step runs on.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Side {
    /// oxccl's engine among the ranks of one node (NVLink).
    Intra,
    /// The inter-node engine among the ranks of one local index (NICs).
    Inter,
}

/// What a step does, on this rank's buffers. Element offsets and counts; `local` below is the
/// rank's local index, `g` the ranks per node.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Kind {
    /// Inside each node, ReduceScatter of `send[at .. at + g·len]` in `g` blocks: block `local`
    /// reduced over the node lands in `recv[at + local·len ..][..len]`.
    IntraReduceScatter {
        /// First element of the piece.
        at: u64,
        /// Elements per block.
        len: u64,
    },
    /// Among the ranks of one local index, AllReduce in place of `recv[at + local·len ..][..len]`
    /// (of `recv[at ..][..len]` when not `sharded`).
    InterAllReduce {
        /// First element of the piece.
        at: u64,
        /// Elements.
        len: u64,
        /// Whether each local index reduces its own block of the piece.
        sharded: bool,
    },
    /// Inside each node, AllGather in place: block `local` of `recv[at .. at + g·len]` to every
    /// rank of the node.
    IntraAllGather {
        /// First element of the piece.
        at: u64,
        /// Elements per block.
        len: u64,
    },
    /// Inside each node, AllReduce of `send[at ..][..len]` into `recv[at ..][..len]`.
    IntraAllReduce {
        /// First element.
        at: u64,
        /// Elements.
        len: u64,
    },
    /// Inside the root's node, Broadcast of `recv[at ..][..len]` from local index `root_local`.
    IntraBroadcast {
        /// First element.
        at: u64,
        /// Elements.
        len: u64,
        /// The root's local index.
        root_local: u32,
    },
    /// Among the ranks of one local index, Broadcast from node `root_node` into
    /// `recv[at + local·len ..][..len]` (`recv[at ..][..len]` when not `sharded`): the root sends
    /// that region of its receive buffer, or `send[src_at ..][..len]` where given (out of place).
    InterBroadcast {
        /// First element of the piece.
        at: u64,
        /// Elements (per block when `sharded`).
        len: u64,
        /// The root's node.
        root_node: u32,
        /// Whether each local index broadcasts its own block of the piece.
        sharded: bool,
        /// Where the root's data is in its send buffer, out of place.
        src_at: Option<u64>,
    },
    /// Inside each node, AllGather in place of node `node`'s blocks: block `local` of
    /// `recv[node·g·len ..][..g·len]` to every rank of the node.
    IntraAllGatherOf {
        /// The node whose blocks move.
        node: u32,
        /// Elements per block.
        len: u64,
    },
    /// Inside each node, ReduceScatter of node `node`'s blocks, `send[node·g·len ..][..g·len]`:
    /// block `local` reduced over the node lands in `scratch[scratch_at ..][..len]`.
    IntraReduceScatterOf {
        /// The node whose blocks are reduced.
        node: u32,
        /// Elements per block.
        len: u64,
        /// Where its slot starts in the scratch buffer (elements).
        scratch_at: u64,
    },
    /// Inside each node, Reduce of `send[at ..][..len]` onto local index `root_local`, into its
    /// `scratch[scratch_at ..][..len]`.
    IntraReduce {
        /// First element of the piece.
        at: u64,
        /// Elements.
        len: u64,
        /// The local index reduced onto.
        root_local: u32,
        /// Where its slot starts in the scratch buffer (elements).
        scratch_at: u64,
    },
    /// Among the ranks of one local index, Reduce of `scratch[scratch_at ..][..len]` onto node
    /// `root_node`, into its `recv[into ..][..len]`.
    InterReduce {
        /// Elements.
        len: u64,
        /// Where its slot starts in the scratch buffer (elements).
        scratch_at: u64,
        /// The node reduced onto.
        root_node: u32,
        /// Where the result lands in the root's receive buffer.
        into: u64,
        /// Whether this is a ReduceScatter's: the result is the root's own block (in place, block
        /// `rank` of the buffer).
        scatter: bool,
    },
}

/// One step of a staged collective.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Step {
    /// The engine it runs on.
    pub side: Side,
    /// What it does.
    pub kind: Kind,
    /// The step (an index into [`Staged::steps`]) on the other side it waits for.
    pub after: Option<usize>,
    /// Whether only the ranks of this node take part (an intra-node broadcast).
    pub only_node: Option<u32>,
    /// Whether only the ranks of this local index take part (an inter-node reduce).
    pub only_local: Option<u32>,
}

impl Step {
    /// Whether the rank on `node` at local index `local` takes part.
    pub fn takes_part(&self, node: u32, local: u32) -> bool {
        self.only_node.is_none_or(|n| n == node) && self.only_local.is_none_or(|l| l == local)
    }
}

/// A staged hierarchical collective: the steps every rank issues, in order.
#[derive(Clone, Debug)]
pub struct Staged {
    /// The collective (never AllToAll: no staged plan exists for it).
    pub collective: Collective,
    /// Elements per rank (the AllGather's input).
    pub count: u64,
    /// The steps, in issue order.
    pub steps: Vec<Step>,
    /// Scratch elements each rank needs (partial sums between the sides).
    pub scratch: u64,
}

/// Pieces of at most `piece` elements, each a multiple of `g`, over `count`, and the tail below `g`
/// left over: `(at, block)` per piece, block = piece / g.
fn pieces(count: u64, g: u64, piece: u64) -> (Vec<(u64, u64)>, Range<u64>) {
    let piece = (piece / g).max(1) * g;
    let body = count - count % g;
    let mut out = Vec::new();
    let mut at = 0;
    while at < body {
        let len = piece.min(body - at);
        out.push((at, len / g));
        at += len;
    }
    (out, body..count)
}

/// Pushes `step`, returning its index.
fn push(steps: &mut Vec<Step>, side: Side, kind: Kind, after: Option<usize>) -> usize {
    steps.push(Step { side, kind, after, only_node: None, only_local: None });
    steps.len() - 1
}

impl Staged {
    /// AllReduce of `count` elements per rank on `map`'s nodes in pieces of about `piece`
    /// elements: per piece an intra-node ReduceScatter, an inter-node AllReduce of each local
    /// index's block, an intra-node AllGather. Intra-node steps are issued one piece ahead, so the
    /// inter-node AllReduce of piece `i` runs beside the ReduceScatter of piece `i+1`. A tail below
    /// the ranks per node is reduced whole on both sides.
    pub fn all_reduce(map: &NodeMap, count: u64, piece: u64) -> Staged {
        let g = map.per_node() as u64;
        let (ps, tail) = pieces(count, g, piece);
        let mut steps = Vec::new();
        let mut rs = Vec::with_capacity(ps.len());
        let mut ar = Vec::with_capacity(ps.len());
        for (i, &(at, len)) in ps.iter().enumerate() {
            rs.push(push(&mut steps, Side::Intra, Kind::IntraReduceScatter { at, len }, None));
            ar.push(push(&mut steps, Side::Inter, Kind::InterAllReduce { at, len, sharded: true }, Some(rs[i])));
            if i > 0 {
                let (at, len) = ps[i - 1];
                push(&mut steps, Side::Intra, Kind::IntraAllGather { at, len }, Some(ar[i - 1]));
            }
        }
        if let Some(&(at, len)) = ps.last() {
            push(&mut steps, Side::Intra, Kind::IntraAllGather { at, len }, ar.last().copied());
        }
        if !tail.is_empty() {
            let (at, len) = (tail.start, tail.end - tail.start);
            let a = push(&mut steps, Side::Intra, Kind::IntraAllReduce { at, len }, None);
            push(&mut steps, Side::Inter, Kind::InterAllReduce { at, len, sharded: false }, Some(a));
        }
        Staged { collective: Collective::AllReduce, count, steps, scratch: 0 }
    }

    /// AllGather of `count` elements per rank (ranks numbered node by node): per node `k`, an
    /// inter-node Broadcast among the ranks of each local index of node `k`'s rank's block into its
    /// place in the output, then an intra-node AllGather of node `k`'s blocks, which runs beside the
    /// next node's Broadcast.
    pub fn all_gather(map: &NodeMap, count: u64) -> Result<Staged, NodeError> {
        map.node_major("a staged AllGather")?;
        let g = map.per_node() as u64;
        let mut steps = Vec::new();
        for node in 0..map.nodes() {
            let at = node as u64 * g * count;
            let kind = Kind::InterBroadcast { at, len: count, root_node: node, sharded: true, src_at: Some(0) };
            let b = push(&mut steps, Side::Inter, kind, None);
            push(&mut steps, Side::Intra, Kind::IntraAllGatherOf { node, len: count }, Some(b));
        }
        Ok(Staged { collective: Collective::AllGather, count, steps, scratch: 0 })
    }

    /// Broadcast of `count` elements from `root`: inside the root's node to every local index,
    /// then per piece an inter-node Broadcast of each local index's block from the root's node and
    /// an intra-node AllGather. A tail below the ranks per node goes whole over the inter-node side
    /// (every local index's group broadcasts it).
    pub fn broadcast(map: &NodeMap, count: u64, root: u32, piece: u64) -> Staged {
        let g = map.per_node() as u64;
        let (root_node, root_local) = (map.node(root), map.local(root));
        let mut steps = Vec::new();
        let first = push(&mut steps, Side::Intra, Kind::IntraBroadcast { at: 0, len: count, root_local }, None);
        steps[first].only_node = Some(root_node);
        let (ps, tail) = pieces(count, g, piece);
        for &(at, len) in &ps {
            let b = push(
                &mut steps,
                Side::Inter,
                Kind::InterBroadcast { at, len, root_node, sharded: true, src_at: None },
                Some(first),
            );
            push(&mut steps, Side::Intra, Kind::IntraAllGather { at, len }, Some(b));
        }
        if !tail.is_empty() {
            let (at, len) = (tail.start, tail.end - tail.start);
            let kind = Kind::InterBroadcast { at, len, root_node, sharded: false, src_at: None };
            push(&mut steps, Side::Inter, kind, Some(first));
        }
        Staged { collective: Collective::Broadcast { root }, count, steps, scratch: 0 }
    }

    /// ReduceScatter of `count` elements per rank out (ranks numbered node by node): per node `k`,
    /// an intra-node ReduceScatter of node `k`'s blocks into a scratch slot (each local index gets
    /// its node's partial sum of node `k`'s block of its index), then an inter-node Reduce of that
    /// slot onto node `k`, where it lands in the receive buffer. Two slots: the Reduce of node `k`
    /// runs beside the ReduceScatter of node `k+1`.
    pub fn reduce_scatter(map: &NodeMap, count: u64) -> Result<Staged, NodeError> {
        map.node_major("a staged ReduceScatter")?;
        let mut steps = Vec::new();
        let mut reduces: Vec<usize> = Vec::new();
        for node in 0..map.nodes() {
            let slot = node as u64 % 2;
            // A slot is reused once the Reduce that read it two nodes before has ended.
            let free = (node >= 2).then(|| reduces[node as usize - 2]);
            let scratch_at = slot * count;
            let rs = push(&mut steps, Side::Intra, Kind::IntraReduceScatterOf { node, len: count, scratch_at }, free);
            let kind = Kind::InterReduce { len: count, scratch_at, root_node: node, into: 0, scatter: true };
            reduces.push(push(&mut steps, Side::Inter, kind, Some(rs)));
        }
        Ok(Staged { collective: Collective::ReduceScatter, count, steps, scratch: 2 * count })
    }

    /// Reduce of `count` elements onto `root`, in pieces of about `piece` elements: per piece an
    /// intra-node Reduce onto the root's local index in every node (into a scratch slot), then an
    /// inter-node Reduce among that local index's ranks onto the root. The other local indices'
    /// NICs stay idle.
    pub fn reduce(map: &NodeMap, count: u64, root: u32, piece: u64) -> Staged {
        let (root_node, root_local) = (map.node(root), map.local(root));
        let piece = piece.max(1).min(count.max(1));
        let mut steps = Vec::new();
        let mut reduces: Vec<usize> = Vec::new();
        let mut at = 0;
        while at < count {
            let len = piece.min(count - at);
            let i = reduces.len();
            let slot = i as u64 % 2;
            let free = (i >= 2).then(|| reduces[i - 2]);
            // Slots a whole piece apart: the last piece may be shorter.
            let scratch_at = slot * piece;
            let intra = push(&mut steps, Side::Intra, Kind::IntraReduce { at, len, root_local, scratch_at }, free);
            let kind = Kind::InterReduce { len, scratch_at, root_node, into: at, scatter: false };
            let inter = push(&mut steps, Side::Inter, kind, Some(intra));
            steps[inter].only_local = Some(root_local);
            reduces.push(inter);
            at += len;
        }
        Staged { collective: Collective::Reduce { root }, count, steps, scratch: 2 * piece.min(count) }
    }

    /// Bytes each rank sends over NVLink and over its NIC for `elem` bytes per element, with
    /// direct intra-node and ring inter-node collectives (what the `hier-*` programs move); `None`
    /// for a Broadcast, whose ranks send unequal shares.
    pub fn link_bytes(&self, map: &NodeMap, elem: u64) -> Option<LinkBytes> {
        if !matches!(self.collective, Collective::AllReduce | Collective::AllGather) {
            return None;
        }
        let (g, n) = (map.per_node() as u64, map.nodes() as u64);
        let mut b = LinkBytes::default();
        // A Broadcast's bytes summed over its group: a chain from the root, every member but the
        // last forwarding the block; over the AllGather's broadcasts, rooted in turn on every node,
        // each member is last once.
        let mut group_bytes = 0;
        for s in &self.steps {
            match s.kind {
                Kind::IntraReduceScatter { len, .. }
                | Kind::IntraAllGather { len, .. }
                | Kind::IntraAllGatherOf { len, .. } => b.nvlink += (g - 1) * len * elem,
                // Direct: a ReduceScatter and an AllGather of blocks of `len / g` (rounded up).
                Kind::IntraAllReduce { len, .. } => b.nvlink += 2 * (g - 1) * len.div_ceil(g) * elem,
                // Ring: a ReduceScatter and an AllGather of blocks of `len / n` (rounded up).
                Kind::InterAllReduce { len, .. } => b.nic += 2 * (n - 1) * len.div_ceil(n) * elem,
                Kind::InterBroadcast { len, .. } => group_bytes += (n - 1) * len * elem,
                Kind::IntraBroadcast { .. }
                | Kind::IntraReduceScatterOf { .. }
                | Kind::IntraReduce { .. }
                | Kind::InterReduce { .. } => {}
            }
        }
        b.nic += group_bytes / n;
        Some(b)
    }
}

/// What one rank sends, by link.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct LinkBytes {
    /// Over NVLink (to the other ranks of its node).
    pub nvlink: u64,
    /// Over its NIC (to ranks of other nodes).
    pub nic: u64,
}

/// A buffer of every rank, as a step reads or writes it.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum Buf {
    Send,
    Recv,
    Scratch,
}

/// Element ranges of a step, over all ranks (a superset of any one rank's).
struct Touches {
    reads: Vec<(Buf, Range<u64>)>,
    writes: Vec<(Buf, Range<u64>)>,
}

fn at_len(at: u64, len: u64) -> Range<u64> {
    at..at + len
}

/// Copies `src` into `dst[at..]`.
fn put<T: Copy>(dst: &mut [T], at: u64, src: &[T]) {
    dst[at as usize..at as usize + src.len()].copy_from_slice(src);
}

fn part<T: Copy>(v: &[T], at: u64, len: u64) -> Vec<T> {
    v[at as usize..(at + len) as usize].to_vec()
}

impl Kind {
    /// In place the send buffer is the receive buffer, and a root's data is already in its
    /// receive buffer.
    fn touches(&self, g: u64, in_place: bool) -> Touches {
        use Buf::{Recv, Scratch};
        let send = if in_place { Recv } else { Buf::Send };
        let (reads, writes) = match *self {
            Kind::IntraReduceScatter { at, len } => {
                (vec![(send, at_len(at, g * len))], vec![(Recv, at_len(at, g * len))])
            }
            Kind::InterAllReduce { at, len, sharded } => {
                let r = at_len(at, if sharded { g * len } else { len });
                (vec![(Recv, r.clone())], vec![(Recv, r)])
            }
            Kind::InterBroadcast { at, len, sharded, src_at, .. } => {
                let r = at_len(at, if sharded { g * len } else { len });
                let from = match src_at {
                    Some(s) if !in_place => (Buf::Send, at_len(s, len)),
                    _ => (Recv, r.clone()),
                };
                (vec![from], vec![(Recv, r)])
            }
            Kind::IntraAllGather { at, len } => (vec![(Recv, at_len(at, g * len))], vec![(Recv, at_len(at, g * len))]),
            Kind::IntraAllReduce { at, len } | Kind::IntraBroadcast { at, len, .. } => {
                (vec![(send, at_len(at, len))], vec![(Recv, at_len(at, len))])
            }
            Kind::IntraAllGatherOf { node, len } => {
                let r = at_len(node as u64 * g * len, g * len);
                (vec![(Recv, r.clone())], vec![(Recv, r)])
            }
            Kind::IntraReduceScatterOf { node, len, scratch_at } => {
                (vec![(send, at_len(node as u64 * g * len, g * len))], vec![(Scratch, at_len(scratch_at, len))])
            }
            Kind::IntraReduce { at, len, scratch_at, .. } => {
                (vec![(send, at_len(at, len))], vec![(Scratch, at_len(scratch_at, len))])
            }
            Kind::InterReduce { len, scratch_at, root_node, into, scatter } => {
                // A ReduceScatter's root writes its own block: the start of its receive buffer, or
                // in place its block of the buffer, in node `root_node`'s blocks.
                let writes = if scatter && in_place {
                    vec![(Recv, at_len(root_node as u64 * g * len, g * len))]
                } else if scatter {
                    vec![(Recv, at_len(0, len))]
                } else {
                    vec![(Recv, at_len(into, len))]
                };
                (vec![(Scratch, at_len(scratch_at, len))], writes)
            }
        };
        Touches { reads, writes }
    }
}

fn overlap(a: &[(Buf, Range<u64>)], b: &[(Buf, Range<u64>)]) -> bool {
    a.iter().any(|(x, r)| {
        b.iter().any(|(y, s)| x == y && r.start < s.end && s.start < r.end && !r.is_empty() && !s.is_empty())
    })
}

impl Staged {
    /// Steps that may run at the same time (on the two sides, neither waiting for the other
    /// through [`Step::after`] and the order of its own side) touch disjoint elements, out of place
    /// and in place: the first pair that does not, as an error naming both.
    pub fn check_races(&self, map: &NodeMap) -> Result<(), ExecError> {
        self.races_in(map, false)?;
        self.races_in(map, true)
    }

    /// [`Staged::check_races`] out of place or in place.
    fn races_in(&self, map: &NodeMap, in_place: bool) -> Result<(), ExecError> {
        let n = self.steps.len();
        // before[j]: the steps that finish before step `j` starts.
        let mut before: Vec<Vec<bool>> = vec![vec![false; n]; n];
        for j in 0..n {
            let mut direct: Vec<usize> = (0..j).filter(|&i| self.steps[i].side == self.steps[j].side).collect();
            direct.extend(self.steps[j].after);
            for i in direct {
                let earlier = before[i].clone();
                let row = &mut before[j];
                row[i] = true;
                row.iter_mut().zip(earlier).for_each(|(b, e)| *b |= e);
            }
        }
        let g = map.per_node() as u64;
        let touches: Vec<Touches> = self.steps.iter().map(|s| s.kind.touches(g, in_place)).collect();
        for j in 0..n {
            for i in 0..j {
                if before[j][i] || self.steps[i].side == self.steps[j].side {
                    continue;
                }
                let (a, b) = (&touches[i], &touches[j]);
                if overlap(&a.writes, &b.reads) || overlap(&a.writes, &b.writes) || overlap(&b.writes, &a.reads) {
                    return Err(ExecError::BadInput {
                        reason: format!(
                            "steps {i} ({:?}) and {j} ({:?}) may run at once and touch the same elements{}",
                            self.steps[i].kind,
                            self.steps[j].kind,
                            if in_place { " (in place)" } else { "" }
                        ),
                    });
                }
            }
        }
        Ok(())
    }

    /// Runs the steps in issue order on host vectors, one per rank, with the CPU references, as
    /// the communicator runs them: `recv` (one vector per rank, of the collective's output length)
    /// is what the device's receive buffers become. `send` `None` runs in place: every input is
    /// read from `recv` (a ReduceScatter's whole input, an AllGather's block `rank`), a root's data
    /// too, and a ReduceScatter's result lands in block `rank` of `recv`. Avg averages on each side
    /// as the steps do: each reducing step divides its results by its group's size (the node's
    /// ranks, then the nodes), so the result is an average of per-node averages.
    pub fn run_cpu<T: Element>(
        &self,
        map: &NodeMap,
        send: Option<&[Vec<T>]>,
        recv: &mut [Vec<T>],
        op: ReduceOp,
    ) -> Result<(), ExecError> {
        let world = map.world() as usize;
        if send.is_some_and(|s| s.len() != world) || recv.len() != world {
            return Err(ExecError::BadInput {
                reason: format!("{:?} send and {} receive vectors for {world} ranks", send.map(<[_]>::len), recv.len()),
            });
        }
        // Rank `r`'s input at `at`: its send vector, or in place its receive vector.
        let input = |recv: &[Vec<T>], r: usize, at: u64, len: u64| part(send.map_or(&recv[r], |s| &s[r]), at, len);
        let (g, nodes) = (map.per_node(), map.nodes());
        // A reducing step's result over `n` contributions (Avg's division, per side).
        let avg = |v: Vec<T>, n: u32| -> Vec<T> {
            if op == ReduceOp::Avg { v.into_iter().map(|x| x.average(n)).collect() } else { v }
        };
        let mut scratch = vec![vec![T::default(); self.scratch as usize]; world];
        for step in &self.steps {
            match step.kind {
                Kind::IntraReduceScatter { at, len } => {
                    for k in 0..nodes {
                        let group = map.node_ranks(k);
                        let ins: Vec<Vec<T>> =
                            group.iter().map(|&r| input(recv, r as usize, at, g as u64 * len)).collect();
                        for (l, out) in reference::reduce_scatter(&ins, op)?.into_iter().enumerate() {
                            put(&mut recv[group[l] as usize], at + l as u64 * len, &avg(out, g));
                        }
                    }
                }
                Kind::InterAllReduce { at, len, sharded } => {
                    for l in 0..g {
                        let group = map.local_ranks(l);
                        let from = if sharded { at + l as u64 * len } else { at };
                        let ins: Vec<Vec<T>> = group.iter().map(|&r| part(&recv[r as usize], from, len)).collect();
                        let out = reference::all_reduce(&ins, op)?;
                        for (&r, o) in group.iter().zip(out) {
                            put(&mut recv[r as usize], from, &avg(o, nodes));
                        }
                    }
                }
                Kind::IntraAllGather { at, len } => {
                    for k in 0..nodes {
                        let group = map.node_ranks(k);
                        let ins: Vec<Vec<T>> =
                            (0..g).map(|l| part(&recv[group[l as usize] as usize], at + l as u64 * len, len)).collect();
                        let out = reference::all_gather(&ins)?;
                        for (&r, o) in group.iter().zip(out) {
                            put(&mut recv[r as usize], at, &o);
                        }
                    }
                }
                Kind::IntraAllReduce { at, len } => {
                    for k in 0..nodes {
                        let group = map.node_ranks(k);
                        let ins: Vec<Vec<T>> = group.iter().map(|&r| input(recv, r as usize, at, len)).collect();
                        for (&r, o) in group.iter().zip(reference::all_reduce(&ins, op)?) {
                            put(&mut recv[r as usize], at, &avg(o, g));
                        }
                    }
                }
                Kind::IntraBroadcast { at, len, root_local } => {
                    let k = step.only_node.unwrap_or(0);
                    let group = map.node_ranks(k);
                    let data = input(recv, group[root_local as usize] as usize, at, len);
                    for &r in group {
                        put(&mut recv[r as usize], at, &data);
                    }
                }
                Kind::InterBroadcast { at, len, root_node, sharded, src_at } => {
                    for l in 0..g {
                        let from = if sharded { at + l as u64 * len } else { at };
                        let root = map.rank(root_node, l) as usize;
                        let data = match (src_at, send) {
                            (Some(o), Some(send)) => part(&send[root], o, len),
                            _ => part(&recv[root], from, len),
                        };
                        for r in map.local_ranks(l) {
                            put(&mut recv[r as usize], from, &data);
                        }
                    }
                }
                Kind::IntraReduceScatterOf { node, len, scratch_at } => {
                    let base = node as u64 * g as u64 * len;
                    for k in 0..nodes {
                        let group = map.node_ranks(k);
                        let ins: Vec<Vec<T>> =
                            group.iter().map(|&r| input(recv, r as usize, base, g as u64 * len)).collect();
                        for (l, out) in reference::reduce_scatter(&ins, op)?.into_iter().enumerate() {
                            put(&mut scratch[group[l] as usize], scratch_at, &avg(out, g));
                        }
                    }
                }
                Kind::IntraReduce { at, len, root_local, scratch_at } => {
                    for k in 0..nodes {
                        let group = map.node_ranks(k);
                        let ins: Vec<Vec<T>> = group.iter().map(|&r| input(recv, r as usize, at, len)).collect();
                        let sum = reference::all_reduce(&ins, op)?.swap_remove(0);
                        put(&mut scratch[group[root_local as usize] as usize], scratch_at, &avg(sum, g));
                    }
                }
                Kind::InterReduce { len, scratch_at, root_node, into, scatter } => {
                    for l in (0..g).filter(|&l| step.only_local.is_none_or(|o| o == l)) {
                        let group = map.local_ranks(l);
                        let ins: Vec<Vec<T>> =
                            group.iter().map(|&r| part(&scratch[r as usize], scratch_at, len)).collect();
                        let sum = avg(reference::all_reduce(&ins, op)?.swap_remove(0), nodes);
                        let root = map.rank(root_node, l);
                        // In place, a ReduceScatter's result is block `rank` of the buffer.
                        let into = if scatter && send.is_none() { root as u64 * len } else { into };
                        put(&mut recv[root as usize], into, &sum);
                    }
                }
                Kind::IntraAllGatherOf { node, len } => {
                    let base = node as u64 * g as u64 * len;
                    for k in 0..nodes {
                        let group = map.node_ranks(k);
                        let ins: Vec<Vec<T>> = (0..g)
                            .map(|l| part(&recv[group[l as usize] as usize], base + l as u64 * len, len))
                            .collect();
                        for (&r, o) in group.iter().zip(reference::all_gather(&ins)?) {
                            put(&mut recv[r as usize], base, &o);
                        }
                    }
                }
            }
        }
        Ok(())
    }
}
