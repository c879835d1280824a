//! The planner: from a global shape, an element size and two layouts to an ordered list of stages of
//! strided transfers.
//!
//! # Algorithm
//!
//! 1. Bind both layouts to the shape ([`Layout::on`]); group source ranks by the box they hold
//!    (a source shard and its replicas) and destination ranks likewise (a destination shard and the
//!    ranks that must hold it).
//! 2. For each destination shard, intersect it with the source partition, dim by dim (binary search in
//!    sorted intervals), giving its pieces: one per source shard it meets.
//! 3. For each piece, group the destination shard's replicas by NVLink domain (`rank / domain_size`).
//!    Inside one domain:
//!    - a rank that holds the piece's source shard itself copies it locally (a local transfer,
//!      `src == dst`);
//!    - otherwise, when a replica of the source shard lives in the same domain, the rank reads from one
//!      of those (round robin);
//!    - otherwise the piece must enter the domain. Direct route: every such rank receives it from a
//!      source replica. Hierarchical route: the piece is split along its outermost non-unit dim into
//!      up to as many parts as ranks need it (parts of at least [`PlanOptions::min_split_bytes`]);
//!      each part lands in stage 0 on one of them (a receiving leader, rotating over the domain's
//!      replicas of the shard) and is forwarded from that leader's destination buffer to the others
//!      in stage 1. Split over `k` leaders, landing and forwarding are spread evenly, as in a
//!      scatter + all-gather broadcast.
//!
//!    Source replicas are picked round robin from one cursor per (source shard, candidate pool), so the
//!    deliveries of one piece, all of one size, are spread over the pool with counts that differ by at
//!    most one, and so are all deliveries of one source shard from one pool.
//!
//!    A `Partial` source holds each box as several partial sums (one per partial index, each with
//!    its replicas); no rank holds the values, so every destination rank needs every piece, and a
//!    delivery is a summing transfer reading one replica of every partial sum (the receiver's own
//!    where it holds one, else one in its domain, else any, round robin). Direct route: every
//!    destination rank sums the piece itself. Hierarchical route: the piece is split over the domain's
//!    ranks that need it, each summing one part (a reduce-scatter) and forwarding it to the others
//!    in stage 1 (an all-gather), so the bytes that cross links match a ring or direct AllReduce's.
//! 4. Each transfer's box is coalesced: dims of extent 1 dropped, dims that are contiguous on both
//!    sides merged, the innermost contiguous run expressed in bytes.

use super::geometry::{Geometry, holds, in_domain};
use super::layout::{Layout, LayoutError, Rank, Region, Sharding};
use super::traffic::Traffic;
pub use super::transfer::{ReadFrom, Stage, Transfer};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::fmt;

/// Why a reshard cannot be planned. Every variant names what was wrong.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ReshardError {
    /// The source layout does not fit the tensor.
    #[error("source layout: {0}")]
    Src(#[source] LayoutError),
    /// The destination layout does not fit the tensor.
    #[error("destination layout: {0}")]
    Dst(#[source] LayoutError),
    /// The element size is 0 bytes.
    #[error("the element size is 0 bytes")]
    ZeroElementSize,
    /// The NVLink domain size is 0 ranks.
    #[error("the NVLink domain size is 0 ranks")]
    ZeroDomainSize,
    /// The tensor's size in bytes, times one more than the destination mesh's rank count (the most
    /// copies any traffic figure counts), does not fit in a `u64`.
    #[error(
        "a tensor of shape {shape:?} with {elem_bytes}-byte elements is too large: one copy per destination rank exceeds 2^64 bytes"
    )]
    TensorTooLarge {
        /// The global shape.
        shape: Vec<u64>,
        /// Bytes per element.
        elem_bytes: u64,
    },
    /// The two sides describe tensors of different global shapes.
    #[error("the source's global shape {src:?} differs from the destination's {dst:?}")]
    GlobalShapeMismatch {
        /// The source side's global shape.
        src: Vec<u64>,
        /// The destination side's global shape.
        dst: Vec<u64>,
    },
    /// The two sides describe tensors of different element sizes.
    #[error("the source has {src}-byte elements but the destination {dst}-byte elements")]
    ElementSizeMismatch {
        /// The source side's bytes per element.
        src: u64,
        /// The destination side's bytes per element.
        dst: u64,
    },
    /// The layouts cut the tensor into more copies than a plan may hold ([`MAX_TRANSFERS`]).
    #[error("the two layouts cut the tensor into more than {max} copies (shard it more coarsely)")]
    TooManyTransfers {
        /// The most a plan may hold.
        max: usize,
    },
}

/// The most copies (over both stages) a reshard plan may hold, a sum of `k` partial sums counting as
/// `k`: each is a record of its region and strides (a few hundred bytes), so a plan stays within a
/// few hundred megabytes. Two meshes of a
/// thousand ranks, each sharding the tensor along another dimension, need about a million.
pub const MAX_TRANSFERS: usize = 1 << 20;

/// Checks that both sides describe the same tensor: same global shape, same element size.
pub fn check_same_tensor(
    src_shape: &[u64],
    src_elem_bytes: u64,
    dst_shape: &[u64],
    dst_elem_bytes: u64,
) -> Result<(), ReshardError> {
    if src_shape != dst_shape {
        return Err(ReshardError::GlobalShapeMismatch { src: src_shape.to_vec(), dst: dst_shape.to_vec() });
    }
    if src_elem_bytes != dst_elem_bytes {
        return Err(ReshardError::ElementSizeMismatch { src: src_elem_bytes, dst: dst_elem_bytes });
    }
    Ok(())
}

/// How bytes reach destinations outside the source's NVLink domain.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Route {
    /// Every destination rank receives every byte it lacks straight from a source rank (one stage).
    Direct,
    /// Every byte enters each destination domain once, to a leader, which forwards it inside the
    /// domain in stage 1.
    #[default]
    Hierarchical,
}

impl fmt::Display for Route {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Direct => "direct",
            Self::Hierarchical => "hierarchical",
        })
    }
}

/// Planner settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct PlanOptions {
    /// The route; hierarchical by default.
    pub route: Route,
    /// Ranks per NVLink domain: rank `r` is in domain `r / domain_size`. 8 by default.
    pub domain_size: u32,
    /// Hierarchical route: a piece entering a domain where `k` ranks need it is split into up to `k`
    /// parts, landed on `k` leaders and forwarded by each, as long as parts keep at least this many
    /// bytes. [`PlanOptions::MIN_SPLIT_BYTES`] by default; 0 splits down to single rows, `u64::MAX`
    /// never splits.
    pub min_split_bytes: u64,
}

impl PlanOptions {
    /// The default `min_split_bytes`: 256 KiB, a guess that parts below it gain less from spreading
    /// than they lose in per-transfer overhead (to be measured on the engine).
    pub const MIN_SPLIT_BYTES: u64 = 256 << 10;

    /// The given route and domain size, the default split threshold.
    pub fn new(route: Route, domain_size: u32) -> Self {
        Self { route, domain_size, min_split_bytes: Self::MIN_SPLIT_BYTES }
    }
}

impl Default for PlanOptions {
    fn default() -> Self {
        Self::new(Route::Hierarchical, 8)
    }
}

/// A complete reshard plan. Stage 0 reads source buffers only (cross-domain sends, intra-domain reads
/// from in-domain source replicas, local copies); stage 1 (hierarchical route only, possibly empty)
/// forwards from receiving leaders' destination buffers to the other ranks of their domain.
///
/// Serializes as `{shape, elem_bytes, src, dst, options, stages, traffic}`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReshardPlan {
    src: Sharding,
    dst: Sharding,
    elem_bytes: u64,
    options: PlanOptions,
    stages: Vec<Stage>,
    traffic: Traffic,
}

impl Serialize for ReshardPlan {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        #[derive(Serialize)]
        struct Repr<'a> {
            shape: &'a [u64],
            elem_bytes: u64,
            src: &'a Layout,
            dst: &'a Layout,
            options: PlanOptions,
            stages: &'a [Stage],
            traffic: &'a Traffic,
        }
        Repr {
            shape: self.shape(),
            elem_bytes: self.elem_bytes,
            src: self.src(),
            dst: self.dst(),
            options: self.options,
            stages: &self.stages,
            traffic: &self.traffic,
        }
        .serialize(serializer)
    }
}

impl ReshardPlan {
    /// The global shape.
    pub fn shape(&self) -> &[u64] {
        self.src.shape()
    }

    /// Bytes per element.
    pub fn elem_bytes(&self) -> u64 {
        self.elem_bytes
    }

    /// The source layout.
    pub fn src(&self) -> &Layout {
        self.src.layout()
    }

    /// The destination layout.
    pub fn dst(&self) -> &Layout {
        self.dst.layout()
    }

    /// The source layout bound to the shape.
    pub fn src_sharding(&self) -> &Sharding {
        &self.src
    }

    /// The destination layout bound to the shape.
    pub fn dst_sharding(&self) -> &Sharding {
        &self.dst
    }

    /// Route and domain size.
    pub fn options(&self) -> PlanOptions {
        self.options
    }

    /// The stages, in execution order.
    pub fn stages(&self) -> &[Stage] {
        &self.stages
    }

    /// Every transfer with its stage index, in execution order.
    pub fn transfers(&self) -> impl Iterator<Item = (usize, &Transfer)> {
        self.stages.iter().enumerate().flat_map(|(s, st)| st.transfers.iter().map(move |t| (s, t)))
    }

    /// The traffic accounting of this plan and of the two usual workarounds.
    pub fn traffic(&self) -> &Traffic {
        &self.traffic
    }

    /// The same problem and options with other stages, traffic recounted. For executors and checkers
    /// of hand-made or altered plans (tests feed it wrong plans to prove [`super::verify`] notices);
    /// [`plan()`] is the way to get a correct one.
    pub fn with_stages(&self, stages: Vec<Stage>) -> ReshardPlan {
        let geometry = Geometry::new(self.src.clone(), self.dst.clone());
        let traffic = Traffic::account(&geometry, self.elem_bytes, self.options.domain_size, &stages);
        ReshardPlan { stages, traffic, ..self.clone() }
    }

    /// Bytes of `rank`'s source buffer (0 outside the source mesh).
    pub fn src_buffer_bytes(&self, rank: Rank) -> u64 {
        self.src_sharding().local_len(rank) * self.elem_bytes
    }

    /// Bytes of `rank`'s destination buffer (0 outside the destination mesh).
    pub fn dst_buffer_bytes(&self, rank: Rank) -> u64 {
        self.dst_sharding().local_len(rank) * self.elem_bytes
    }
}

/// Plans the reshard of a tensor of global shape `shape` with `elem_bytes`-byte elements from layout
/// `src` to layout `dst`.
///
/// The meshes may be disjoint, overlap or coincide; buffers are out of place (a rank in both meshes has
/// a source buffer and a separate destination buffer). Errors: either layout invalid for the shape,
/// a zero element or domain size, or a tensor past 2^64 bytes.
pub fn plan(
    shape: &[u64],
    elem_bytes: u64,
    src: &Layout,
    dst: &Layout,
    options: PlanOptions,
) -> Result<ReshardPlan, ReshardError> {
    let src_sharding = src.on(shape).map_err(ReshardError::Src)?;
    dst.check_not_partial().map_err(ReshardError::Dst)?;
    let dst_sharding = dst.on(shape).map_err(ReshardError::Dst)?;
    if elem_bytes == 0 {
        return Err(ReshardError::ZeroElementSize);
    }
    if options.domain_size == 0 {
        return Err(ReshardError::ZeroDomainSize);
    }
    // Traffic figures count up to one copy of the tensor per destination rank plus one (the gather):
    // all of them fit in a u64 when this does.
    // A partial source counts each of its partial sums.
    src_sharding
        .elements()
        .checked_mul(elem_bytes)
        .and_then(|bytes| bytes.checked_mul(u64::from(dst_sharding.mesh().size()) + 1))
        .and_then(|bytes| bytes.checked_mul(src_sharding.partial_sums()))
        .ok_or_else(|| ReshardError::TensorTooLarge { shape: shape.to_vec(), elem_bytes })?;

    let geometry = Geometry::new(src_sharding, dst_sharding);
    let stages = route(&geometry, elem_bytes, options)?;
    let traffic = Traffic::account(&geometry, elem_bytes, options.domain_size, &stages);
    Ok(ReshardPlan { src: geometry.src, dst: geometry.dst, elem_bytes, options, stages, traffic })
}

/// Round-robin cursors: one per (source shard, pool) and one per (destination shard, domain).
#[derive(Default)]
struct Cursors {
    /// Pool of all replicas of a source shard.
    all: HashMap<u64, usize>,
    /// Pool of the replicas of a source shard inside one domain.
    in_domain: HashMap<(u64, u32), usize>,
    /// Receiving leaders of a destination shard inside one domain.
    leader: HashMap<(usize, u32), usize>,
    /// The sets of partial sums of a source shard nearest one domain.
    sets: HashMap<(u64, u32), usize>,
}

fn next<K: std::hash::Hash + Eq>(cursors: &mut HashMap<K, usize>, key: K, pool: &[Rank]) -> Rank {
    let c = cursors.entry(key).or_insert(0);
    let r = pool[*c % pool.len()];
    *c += 1;
    r
}

fn route(g: &Geometry, elem: u64, options: PlanOptions) -> Result<Vec<Stage>, ReshardError> {
    let ds = options.domain_size;
    let mut stage0 = Vec::new();
    let mut stage1 = Vec::new();
    let mut cursors = Cursors::default();
    // Sources of summing transfers past their first: a plan's size counts every rank it reads.
    let mut extra = 0usize;
    for (di, dshard) in g.dst_shards.iter().enumerate() {
        let d = &dshard.region;
        for piece in g.pieces(d) {
            let sshard = g.src_shard(piece.src_key);
            // A copy of `region` from `src`'s buffer (`read`) to `dst`'s destination buffer.
            let copy = |src: Rank, dst: Rank, read: ReadFrom, region: &Region| {
                let from = match read {
                    ReadFrom::Src => &sshard.region,
                    ReadFrom::Dst => d,
                };
                let geometry = boxed(region, from, d, elem);
                Transfer {
                    src,
                    partials: Vec::new(),
                    dst,
                    read,
                    src_offset: geometry.src_offset,
                    dst_offset: geometry.dst_offset,
                    bytes: geometry.bytes,
                    shape: geometry.shape,
                    src_strides: geometry.src_strides,
                    dst_strides: geometry.dst_strides,
                    region: region.clone(),
                }
            };
            // Destination replicas are ascending, so each domain's members are one run.
            for members in dshard.replicas.chunk_by(|x, y| x / ds == y / ds) {
                // Counted as they grow (below, per forwarded part too: a run of k members can add k²).
                if stage0.len() + stage1.len() + extra > MAX_TRANSFERS {
                    return Err(ReshardError::TooManyTransfers { max: MAX_TRANSFERS });
                }
                let domain = members[0] / ds;
                if sshard.is_partial() {
                    // No rank holds the piece's values: every member needs them. Each delivery sums
                    // one set of the partial sums (every partial sum once, ascending, so that every
                    // replica adds them in one order): the receiver's own where it holds one, else
                    // one of those with the most ranks in its domain (round robin).
                    let sources = sshard.partials();
                    let summed = |cursors: &mut Cursors, r: Rank, region: &Region| {
                        let near = sshard.nearest_sets(r, ds);
                        let c = cursors.sets.entry((piece.src_key, r / ds)).or_insert(0);
                        let set = near[*c % near.len()];
                        *c += 1;
                        Transfer { partials: set[1..].to_vec(), ..copy(set[0], r, ReadFrom::Src, region) }
                    };
                    if options.route == Route::Direct {
                        for &r in members {
                            extra += sources - 1;
                            stage0.push(summed(&mut cursors, r, &piece.region));
                        }
                    } else {
                        // Summed once per domain, split over the members (a reduce-scatter), each
                        // forwarding its part to the others (an all-gather).
                        for part in &split(&piece.region, members.len(), options.min_split_bytes, elem) {
                            if stage0.len() + stage1.len() + extra > MAX_TRANSFERS {
                                return Err(ReshardError::TooManyTransfers { max: MAX_TRANSFERS });
                            }
                            let leader = next(&mut cursors.leader, (di, domain), members);
                            extra += sources - 1;
                            stage0.push(summed(&mut cursors, leader, part));
                            for &r in members.iter().filter(|&&r| r != leader) {
                                stage1.push(copy(leader, r, ReadFrom::Dst, part));
                            }
                        }
                    }
                    continue;
                }
                let mut others = Vec::with_capacity(members.len());
                for &r in members {
                    if holds(&sshard.replicas, r) {
                        stage0.push(copy(r, r, ReadFrom::Src, &piece.region));
                    } else {
                        others.push(r);
                    }
                }
                if others.is_empty() {
                    continue;
                }
                let local_pool = in_domain(&sshard.replicas, domain, ds);
                if !local_pool.is_empty() {
                    for &r in &others {
                        let s = next(&mut cursors.in_domain, (piece.src_key, domain), local_pool);
                        stage0.push(copy(s, r, ReadFrom::Src, &piece.region));
                    }
                } else if options.route == Route::Direct {
                    for &r in &others {
                        let s = next(&mut cursors.all, piece.src_key, &sshard.replicas);
                        stage0.push(copy(s, r, ReadFrom::Src, &piece.region));
                    }
                } else {
                    // Land the piece once in the domain, split over up to `others.len()` leaders
                    // (consecutive on the domain's rotation), each forwarding its part to the others.
                    let parts = split(&piece.region, others.len(), options.min_split_bytes, elem);
                    for part in &parts {
                        if stage0.len() + stage1.len() > MAX_TRANSFERS {
                            return Err(ReshardError::TooManyTransfers { max: MAX_TRANSFERS });
                        }
                        let leader = next(&mut cursors.leader, (di, domain), &others);
                        let s = next(&mut cursors.all, piece.src_key, &sshard.replicas);
                        stage0.push(copy(s, leader, ReadFrom::Src, part));
                        for &r in others.iter().filter(|&&r| r != leader) {
                            stage1.push(copy(leader, r, ReadFrom::Dst, part));
                        }
                    }
                }
            }
        }
    }
    let order = |t: &Transfer| (t.dst, t.dst_offset, t.src);
    stage0.sort_by_key(order);
    stage1.sort_by_key(order);
    if stage0.len() + stage1.len() + extra > MAX_TRANSFERS {
        return Err(ReshardError::TooManyTransfers { max: MAX_TRANSFERS });
    }
    let mut stages = vec![Stage { transfers: stage0 }];
    if options.route == Route::Hierarchical {
        stages.push(Stage { transfers: stage1 });
    }
    Ok(stages)
}

/// Splits a piece into at most `ways` parts along its outermost dim longer than one, with lengths
/// differing by at most one and none under `min_bytes` (unless the piece itself is): one part when
/// the piece is too small or has no such dim.
fn split(region: &Region, ways: usize, min_bytes: u64, elem: u64) -> Vec<Region> {
    let Some(dim) = region.extent.iter().position(|&e| e > 1) else {
        return vec![region.clone()];
    };
    let extent = region.extent[dim];
    let by_size = (region.volume() * elem).checked_div(min_bytes).map_or(u64::MAX, |n| n.max(1));
    let n = (ways as u64).min(extent).min(by_size);
    (0..n)
        .map(|i| {
            // In u128: `extent * i` may pass u64 for a huge dim.
            let at = |i: u64| (u128::from(extent) * u128::from(i) / u128::from(n)) as u64;
            let (lo, hi) = (at(i), at(i + 1));
            let mut part = region.clone();
            part.start[dim] += lo;
            part.extent[dim] = hi - lo;
            part
        })
        .collect()
}

/// A piece's byte geometry between two dense row-major buffers.
pub(crate) struct BoxGeometry {
    pub src_offset: u64,
    pub dst_offset: u64,
    pub bytes: u64,
    pub shape: Vec<u64>,
    pub src_strides: Vec<u64>,
    pub dst_strides: Vec<u64>,
}

/// The byte geometry of `piece` read from a buffer holding box `a` and written to one holding box `b`.
pub(crate) fn boxed(piece: &Region, a: &Region, b: &Region, elem: u64) -> BoxGeometry {
    let (sa, sb) = (a.strides(), b.strides());
    let offset = |outer: &Region, strides: &[u64]| -> u64 {
        (0..piece.start.len()).map(|d| (piece.start[d] - outer.start[d]) * strides[d]).sum::<u64>() * elem
    };
    let (shape, src_strides, dst_strides) = coalesce(&piece.extent, &sa, &sb, elem);
    BoxGeometry {
        src_offset: offset(a, &sa),
        dst_offset: offset(b, &sb),
        bytes: piece.volume() * elem,
        shape,
        src_strides,
        dst_strides,
    }
}

/// Coalesces a box of `extent` with element strides `sa` (read side) and `sb` (write side) into the
/// fewest loops: extent-1 dims dropped, neighbours contiguous on both sides merged, the innermost
/// unit-stride dim turned into a run of bytes. Returns (shape, read strides, write strides) in bytes.
pub(crate) fn coalesce(extent: &[u64], sa: &[u64], sb: &[u64], elem: u64) -> (Vec<u64>, Vec<u64>, Vec<u64>) {
    // Innermost first: (extent, read stride, write stride).
    let mut dims: Vec<(u64, u64, u64)> = Vec::with_capacity(extent.len());
    for d in (0..extent.len()).rev() {
        if extent[d] == 1 {
            continue;
        }
        match dims.last_mut() {
            Some(inner) if sa[d] == inner.0 * inner.1 && sb[d] == inner.0 * inner.2 => inner.0 *= extent[d],
            _ => dims.push((extent[d], sa[d], sb[d])),
        }
    }
    let run = match dims.first() {
        Some(&(e, 1, 1)) => {
            dims.remove(0);
            e
        }
        _ => 1,
    };
    let mut shape: Vec<u64> = dims.iter().rev().map(|d| d.0).collect();
    shape.push(run * elem);
    let src_strides = dims.iter().rev().map(|d| d.1 * elem).collect();
    let dst_strides = dims.iter().rev().map(|d| d.2 * elem).collect();
    (shape, src_strides, dst_strides)
}
