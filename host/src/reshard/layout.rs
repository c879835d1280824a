//! The layout model: [`Mesh`], [`Placement`], [`Layout`], and [`Sharding`] (a layout bound to a global
//! shape), with the local shard every rank holds.
//!
//! # What a rank holds
//!
//! A layout places a tensor of global shape `[n_0, …, n_{k-1}]` on a mesh of ranks. The rank at mesh
//! coordinates `c` holds one axis-aligned sub-box of the global tensor, computed per tensor dim `d`:
//! start from `[0, n_d)`; for each mesh axis `a`, outer axis first, whose placement is `Shard(d)`, split
//! the current interval into `mesh.dims[a]` chunks with `torch.chunk` sizes (chunk length
//! `ceil(len / parts)`, trailing chunks shorter or empty) and keep chunk `c[a]`. Axes placed `Replicate`
//! do not split anything: ranks that differ only along them hold the same box (replicas). This is what
//! PyTorch's DTensor computes (`compute_local_shape_and_global_offset`).
//!
//! The rank's local buffer is that box as a dense row-major tensor of its own shape; a rank whose box is
//! empty (a trailing `torch.chunk` chunk) holds an empty buffer.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

/// A global rank index.
pub type Rank = u32;

/// Why a mesh, placement or layout is not usable. Every variant names what was wrong.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    /// The mesh has no axes.
    #[error("the mesh has no axes")]
    EmptyMesh,
    /// A mesh axis has size 0.
    #[error("mesh axis {axis} has size 0")]
    ZeroMeshAxis {
        /// The axis (outer first).
        axis: usize,
    },
    /// The mesh has more than [`Mesh::MAX_RANKS`] ranks, or its rank range does not fit in a `u32`
    /// (`start + product(dims)` overflows).
    #[error(
        "mesh {} starting at rank {start} has more than {} ranks or does not fit in 32-bit ranks",
        dims_text(dims),
        Mesh::MAX_RANKS
    )]
    MeshTooLarge {
        /// The mesh axis sizes.
        dims: Vec<u32>,
        /// The first rank.
        start: Rank,
    },
    /// The layout gives a different number of placements than the mesh has axes.
    #[error(
        "the mesh has {mesh_axes} ax{} but {placements} placement{} given (one per mesh axis)",
        if *mesh_axes == 1 { "is" } else { "es" },
        if *placements == 1 { " was" } else { "s were" }
    )]
    PlacementCount {
        /// Axes of the mesh.
        mesh_axes: usize,
        /// Placements given.
        placements: usize,
    },
    /// A destination layout places a mesh axis `Partial`: a reshard delivers final values, so a
    /// destination holds shards or replicas, never pending sums.
    #[error(
        "mesh axis {axis} is placed Partial: a reshard's destination holds final values (Shard or Replicate), not partial sums"
    )]
    PartialDestination {
        /// The mesh axis placed `Partial`.
        axis: usize,
    },
    /// A `Shard(dim)` placement names a tensor dim the tensor does not have.
    #[error("mesh axis {axis} shards tensor dim {dim} but the tensor has {tensor_rank} dims")]
    ShardDimOutOfRange {
        /// The mesh axis.
        axis: usize,
        /// The tensor dim it shards.
        dim: u32,
        /// The tensor's rank (number of dims).
        tensor_rank: usize,
    },
    /// The tensor's element count does not fit in a `u64`.
    #[error("shape {shape:?} has more than 2^64 elements")]
    ShapeTooLarge {
        /// The global shape.
        shape: Vec<u64>,
    },
    /// The mesh reaches past the last rank of the communicator.
    #[error("the mesh reaches rank {last_rank} but the communicator has {world_size} ranks")]
    RankOutOfRange {
        /// The last rank of the mesh.
        last_rank: Rank,
        /// The communicator's size.
        world_size: u32,
    },
    /// A mesh string is not `DIMSxDIMS[@START]` (for example `2x4@8`).
    #[error("mesh {text:?} is not DIMSxDIMS[@START] with positive sizes (for example 2x4@8)")]
    BadMesh {
        /// The text given.
        text: String,
    },
    /// A placement string is not `R`, `S<dim>` or `P`.
    #[error("placement {text:?} is not R (replicate), S<dim> (shard) or P (partial)")]
    BadPlacement {
        /// The text given.
        text: String,
    },
    /// A buffer given for a rank does not have the length its shard needs.
    #[error("rank {rank}'s buffer has {got} elements but its shard has {expected}")]
    BufferLength {
        /// The rank.
        rank: Rank,
        /// Elements expected.
        expected: u64,
        /// Elements given.
        got: u64,
    },
    /// Every rank's local shard together needs more host memory than can be allocated, or than
    /// [`HOST_BUFFERS_LIMIT_BYTES`].
    #[error(
        "every rank's local shard together needs {bytes} bytes, more than can be allocated (at most {HOST_BUFFERS_LIMIT_BYTES})"
    )]
    ShardsTooLarge {
        /// Bytes the shards need (`u64::MAX` past that).
        bytes: u64,
    },
}

fn dims_text(dims: &[u32]) -> String {
    dims.iter().map(u32::to_string).collect::<Vec<_>>().join("x")
}

/// A mesh of ranks: `dims` (outer axis first) over the contiguous rank range
/// `start .. start + product(dims)`, numbered row-major (the last axis varies fastest).
///
/// Text form: `2x4@8` (axes 2 and 4, first rank 8); `@0` may be left out when parsing.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(into = "String", try_from = "String")]
pub struct Mesh {
    dims: Vec<u32>,
    start: Rank,
    size: u32,
}

impl Mesh {
    /// The most ranks a mesh may have (planning and verifying walk every rank).
    pub const MAX_RANKS: u32 = 1 << 20;

    /// A mesh with axis sizes `dims` (outer first) whose first rank is `start`.
    ///
    /// Errors: no axes ([`LayoutError::EmptyMesh`]), an axis of size 0, more than
    /// [`Mesh::MAX_RANKS`] ranks or a rank range past `u32` ([`LayoutError::MeshTooLarge`]).
    pub fn new(dims: Vec<u32>, start: Rank) -> Result<Self, LayoutError> {
        if dims.is_empty() {
            return Err(LayoutError::EmptyMesh);
        }
        if let Some(axis) = dims.iter().position(|&d| d == 0) {
            return Err(LayoutError::ZeroMeshAxis { axis });
        }
        let size = dims
            .iter()
            .try_fold(1u32, |acc, &d| acc.checked_mul(d))
            .filter(|&size| size <= Self::MAX_RANKS && start.checked_add(size).is_some())
            .ok_or_else(|| LayoutError::MeshTooLarge { dims: dims.clone(), start })?;
        Ok(Self { dims, start, size })
    }

    /// Axis sizes, outer first.
    pub fn dims(&self) -> &[u32] {
        &self.dims
    }

    /// The first rank.
    pub fn start(&self) -> Rank {
        self.start
    }

    /// Number of ranks.
    pub fn size(&self) -> u32 {
        self.size
    }

    /// The ranks of the mesh, in order.
    pub fn ranks(&self) -> std::ops::Range<Rank> {
        self.start..self.start + self.size
    }

    /// Whether `rank` is in the mesh.
    pub fn contains(&self, rank: Rank) -> bool {
        self.ranks().contains(&rank)
    }

    /// Mesh coordinates of `rank` (outer axis first), or `None` outside the mesh.
    pub fn coords(&self, rank: Rank) -> Option<Vec<u32>> {
        if !self.contains(rank) {
            return None;
        }
        let mut linear = rank - self.start;
        let mut coords = vec![0; self.dims.len()];
        for (c, &d) in coords.iter_mut().zip(&self.dims).rev() {
            *c = linear % d;
            linear /= d;
        }
        Some(coords)
    }

    /// Errors with [`LayoutError::RankOutOfRange`] when the mesh reaches past rank `world_size - 1`.
    pub fn check_world(&self, world_size: u32) -> Result<(), LayoutError> {
        let last_rank = self.start + (self.size - 1);
        if last_rank >= world_size {
            return Err(LayoutError::RankOutOfRange { last_rank, world_size });
        }
        Ok(())
    }
}

impl fmt::Display for Mesh {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}@{}", dims_text(&self.dims), self.start)
    }
}

impl FromStr for Mesh {
    type Err = LayoutError;

    /// Parses `DIMSxDIMS[@START]`, for example `2x2@4` or `8`.
    fn from_str(text: &str) -> Result<Self, LayoutError> {
        let bad = || LayoutError::BadMesh { text: text.to_owned() };
        let (dims, start) = match text.split_once('@') {
            Some((dims, start)) => (dims, start.trim().parse::<u32>().map_err(|_| bad())?),
            None => (text, 0),
        };
        let dims = dims
            .split(['x', 'X'])
            .map(|d| d.trim().parse::<u32>().map_err(|_| bad()))
            .collect::<Result<Vec<_>, _>>()?;
        Self::new(dims, start)
    }
}

impl From<Mesh> for String {
    fn from(mesh: Mesh) -> String {
        mesh.to_string()
    }
}

impl TryFrom<String> for Mesh {
    type Error = LayoutError;
    fn try_from(text: String) -> Result<Self, LayoutError> {
        text.parse()
    }
}

/// How a tensor lies along one mesh axis.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(into = "String", try_from = "String")]
pub enum Placement {
    /// Split tensor dim `.0` into `torch.chunk` pieces along this axis. Text form `S<dim>`.
    Shard(u32),
    /// Every rank along this axis holds the same data. Text form `R`.
    Replicate,
    /// Every rank along this axis holds a partial sum of the same box (DTensor's `Partial()`, a
    /// pending sum): the tensor is the sum over the axis. Text form `P`. A reshard's source may be
    /// partial (the sum is taken on the way); its destination may not
    /// ([`LayoutError::PartialDestination`]).
    Partial,
}

impl fmt::Display for Placement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Shard(dim) => write!(f, "S{dim}"),
            Self::Replicate => write!(f, "R"),
            Self::Partial => write!(f, "P"),
        }
    }
}

impl FromStr for Placement {
    type Err = LayoutError;

    /// Parses `R`, `S<dim>` or `P` (case-insensitive).
    fn from_str(text: &str) -> Result<Self, LayoutError> {
        let t = text.trim();
        match t {
            "R" | "r" => Ok(Self::Replicate),
            "P" | "p" => Ok(Self::Partial),
            _ => t
                .strip_prefix(['S', 's'])
                .and_then(|dim| dim.parse::<u32>().ok())
                .map(Self::Shard)
                .ok_or_else(|| LayoutError::BadPlacement { text: text.to_owned() }),
        }
    }
}

impl From<Placement> for String {
    fn from(p: Placement) -> String {
        p.to_string()
    }
}

impl TryFrom<String> for Placement {
    type Error = LayoutError;
    fn try_from(text: String) -> Result<Self, LayoutError> {
        text.parse()
    }
}

/// Parses a comma-separated placement list, one per mesh axis: `R,S0`.
pub fn parse_placements(text: &str) -> Result<Vec<Placement>, LayoutError> {
    text.split(',').map(str::parse).collect()
}

/// A mesh and one placement per mesh axis. Independent of the tensor's shape; bind one with
/// [`Layout::on`] to get the shards.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "LayoutRepr")]
pub struct Layout {
    mesh: Mesh,
    placements: Vec<Placement>,
}

#[derive(Deserialize)]
struct LayoutRepr {
    mesh: Mesh,
    placements: Vec<Placement>,
}

impl TryFrom<LayoutRepr> for Layout {
    type Error = LayoutError;
    fn try_from(r: LayoutRepr) -> Result<Self, LayoutError> {
        Self::new(r.mesh, r.placements)
    }
}

impl Layout {
    /// A layout. Errors: the placement count differs from the mesh's axis count.
    pub fn new(mesh: Mesh, placements: Vec<Placement>) -> Result<Self, LayoutError> {
        if placements.len() != mesh.dims().len() {
            return Err(LayoutError::PlacementCount { mesh_axes: mesh.dims().len(), placements: placements.len() });
        }
        Ok(Self { mesh, placements })
    }

    /// Whether the ranks hold partial sums: some mesh axis of more than one rank is placed
    /// `Partial` (one of a single rank holds the whole value).
    pub fn is_partial(&self) -> bool {
        self.partial_sums() > 1
    }

    /// How many partial sums make up the tensor: the product of the sizes of the axes placed
    /// `Partial` (1 without any).
    pub fn partial_sums(&self) -> u64 {
        let axes = self.placements.iter().zip(&self.mesh.dims);
        axes.filter(|(p, _)| **p == Placement::Partial).map(|(_, &d)| u64::from(d)).product()
    }

    /// Errors with [`LayoutError::PartialDestination`] naming the first axis placed `Partial`: for a
    /// layout that must hold final values.
    pub fn check_not_partial(&self) -> Result<(), LayoutError> {
        match self.placements.iter().position(|p| *p == Placement::Partial) {
            Some(axis) => Err(LayoutError::PartialDestination { axis }),
            None => Ok(()),
        }
    }

    /// Parses a mesh (`2x2@4`) and a placement list (`R,S0`).
    pub fn parse(mesh: &str, placements: &str) -> Result<Self, LayoutError> {
        Self::new(mesh.parse()?, parse_placements(placements)?)
    }

    /// The mesh.
    pub fn mesh(&self) -> &Mesh {
        &self.mesh
    }

    /// One placement per mesh axis, outer first.
    pub fn placements(&self) -> &[Placement] {
        &self.placements
    }

    /// Checks the layout against a global shape: every sharded dim exists and the element count fits.
    pub fn validate(&self, global_shape: &[u64]) -> Result<(), LayoutError> {
        self.on(global_shape).map(|_| ())
    }

    /// [`Layout::validate`], and also that every rank of the mesh is below `world_size`.
    pub fn validate_in_world(&self, global_shape: &[u64], world_size: u32) -> Result<(), LayoutError> {
        self.mesh.check_world(world_size)?;
        self.validate(global_shape)
    }

    /// Binds the layout to a global shape (validating it), giving each rank's shard.
    pub fn on(&self, global_shape: &[u64]) -> Result<Sharding, LayoutError> {
        for (axis, p) in self.placements.iter().enumerate() {
            if let Placement::Shard(dim) = *p
                && dim as usize >= global_shape.len()
            {
                return Err(LayoutError::ShardDimOutOfRange { axis, dim, tensor_rank: global_shape.len() });
            }
        }
        // A 0 extent anywhere empties the tensor, however large the extents before it.
        let elements = if global_shape.contains(&0) {
            0
        } else {
            global_shape
                .iter()
                .try_fold(1u64, |acc, &n| acc.checked_mul(n))
                .ok_or_else(|| LayoutError::ShapeTooLarge { shape: global_shape.to_vec() })?
        };
        Ok(Sharding { layout: self.clone(), shape: global_shape.to_vec(), elements })
    }
}

impl fmt::Display for Layout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let p: Vec<String> = self.placements.iter().map(Placement::to_string).collect();
        write!(f, "{}:{}", self.mesh, p.join(","))
    }
}

/// An axis-aligned box of a global tensor, in elements: `start[d] .. start[d] + extent[d]` per dim.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Region {
    /// First index per dim.
    pub start: Vec<u64>,
    /// Length per dim.
    pub extent: Vec<u64>,
}

impl Region {
    /// The whole of a tensor of shape `shape`.
    pub fn full(shape: &[u64]) -> Self {
        Self { start: vec![0; shape.len()], extent: shape.to_vec() }
    }

    /// Number of elements (a 0-dim region holds one: a scalar); `u64::MAX` for a non-empty region of
    /// more than that many (no [`Sharding`] hands one out), never a wrapped count.
    pub fn volume(&self) -> u64 {
        if self.is_empty() {
            return 0;
        }
        self.extent.iter().try_fold(1u64, |acc, &e| acc.checked_mul(e)).unwrap_or(u64::MAX)
    }

    /// Whether the region holds no element.
    pub fn is_empty(&self) -> bool {
        self.extent.contains(&0)
    }

    /// The common part of two regions of one tensor (empty when they do not meet). Ends past 2^64 are
    /// taken as 2^64 - 1: no index reaches further.
    pub fn intersect(&self, other: &Region) -> Region {
        let mut start = Vec::with_capacity(self.start.len());
        let mut extent = Vec::with_capacity(self.start.len());
        for d in 0..self.start.len() {
            let lo = self.start[d].max(other.start[d]);
            let hi = self.start[d].saturating_add(self.extent[d]).min(other.start[d].saturating_add(other.extent[d]));
            start.push(lo);
            extent.push(hi.saturating_sub(lo));
        }
        Region { start, extent }
    }

    /// Whether the global index `coords` lies inside.
    pub fn contains(&self, coords: &[u64]) -> bool {
        coords.len() == self.start.len()
            && coords.iter().zip(self.start.iter().zip(&self.extent)).all(|(&c, (&s, &e))| c >= s && c - s < e)
    }

    /// Row-major element strides of a dense buffer holding exactly this region.
    pub fn strides(&self) -> Vec<u64> {
        row_major_strides(&self.extent)
    }
}

impl fmt::Display for Region {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // In u128: a hand-made region may end past 2^64.
        let dims: Vec<String> = self
            .start
            .iter()
            .zip(&self.extent)
            .map(|(&s, &e)| format!("{s}..{}", u128::from(s) + u128::from(e)))
            .collect();
        write!(f, "[{}]", dims.join(", "))
    }
}

/// Row-major strides (in elements) of a dense tensor of shape `extent`.
///
/// A stride that does not fit in a `u64` is `u64::MAX`. That happens only where no element is
/// addressed through it: in a tensor with a 0 extent (`[0, 2^40, 2^40]` holds nothing), or in one of
/// more than 2^64 elements, which [`Layout::on`] refuses.
pub fn row_major_strides(extent: &[u64]) -> Vec<u64> {
    let mut strides = vec![1u64; extent.len()];
    for d in (0..extent.len().saturating_sub(1)).rev() {
        strides[d] = strides[d + 1].saturating_mul(extent[d + 1]);
    }
    strides
}

/// Chunk `index` of `parts` `torch.chunk` chunks of `0..len`, as `(lo, hi)`: chunks have length
/// `ceil(len / parts)`, the last non-empty one may be shorter, and the ones after it are empty.
pub fn chunk(len: u64, parts: u64, index: u64) -> (u64, u64) {
    let size = len.div_ceil(parts.max(1));
    let lo = index.saturating_mul(size).min(len);
    (lo, lo.saturating_add(size).min(len))
}

/// A layout bound to a global shape (made by [`Layout::on`], so valid): the shard of every rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Sharding {
    layout: Layout,
    shape: Vec<u64>,
    elements: u64,
}

impl Sharding {
    /// The layout.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// The mesh.
    pub fn mesh(&self) -> &Mesh {
        &self.layout.mesh
    }

    /// The global shape.
    pub fn shape(&self) -> &[u64] {
        &self.shape
    }

    /// Elements of the global tensor.
    pub fn elements(&self) -> u64 {
        self.elements
    }

    /// The box `rank` holds, or `None` when `rank` is outside the mesh. The box may be empty.
    pub fn local_region(&self, rank: Rank) -> Option<Region> {
        let coords = self.layout.mesh.coords(rank)?;
        let mut start = vec![0u64; self.shape.len()];
        let mut extent = self.shape.clone();
        for (axis, p) in self.layout.placements.iter().enumerate() {
            if let Placement::Shard(dim) = *p {
                let d = dim as usize;
                let parts = u64::from(self.layout.mesh.dims[axis]);
                let (lo, hi) = chunk(extent[d], parts, u64::from(coords[axis]));
                start[d] += lo;
                extent[d] = hi - lo;
            }
        }
        Some(Region { start, extent })
    }

    /// Which partial sum `rank` holds: its coordinates along the axes placed `Partial`, as one
    /// row-major index below [`Sharding::partial_sums`] (0 for every rank of a layout without
    /// `Partial` axes); `None` outside the mesh. Ranks holding the same box with the same index are
    /// replicas; the tensor is the sum over the indices.
    pub fn partial_index(&self, rank: Rank) -> Option<u64> {
        self.index_along(rank, Placement::Partial)
    }

    /// `rank`'s coordinates along the axes placed `placement`, as one row-major index.
    fn index_along(&self, rank: Rank, placement: Placement) -> Option<u64> {
        let coords = self.layout.mesh.coords(rank)?;
        let axes = self.layout.placements.iter().zip(&self.layout.mesh.dims).zip(coords);
        Some(axes.filter(|((p, _), _)| **p == placement).fold(0, |i, ((_, &d), c)| i * u64::from(d) + u64::from(c)))
    }

    /// How many partial sums make up the tensor ([`Layout::partial_sums`]).
    pub fn partial_sums(&self) -> u64 {
        self.layout.partial_sums()
    }

    /// Which copy of its box's partial sums `rank` belongs to: its coordinates along the axes
    /// placed `Replicate`, as one row-major index; `None` outside the mesh. The ranks holding one
    /// box with one such index hold every partial sum once, in ascending rank order by partial
    /// index (the mesh is numbered row-major), so a sum over them adds the partial sums in one order
    /// whoever reads them.
    pub fn replica_index(&self, rank: Rank) -> Option<u64> {
        self.index_along(rank, Placement::Replicate)
    }

    /// The shape of `rank`'s local buffer, or `None` outside the mesh.
    pub fn local_shape(&self, rank: Rank) -> Option<Vec<u64>> {
        self.local_region(rank).map(|r| r.extent)
    }

    /// Elements in `rank`'s local buffer (0 outside the mesh).
    pub fn local_len(&self, rank: Rank) -> u64 {
        self.local_region(rank).map_or(0, |r| r.volume())
    }

    /// Every rank's local shard cut out of a dense row-major global tensor. For a layout with
    /// `Partial` axes, the ranks of partial index 0 ([`Sharding::partial_index`]) get their box and
    /// every other rank zeros (`T::default()`): one way to split the tensor into partial sums.
    ///
    /// Errors with [`LayoutError::BufferLength`] (naming the mesh's first rank) when `global` does not
    /// hold exactly the global shape's element count.
    pub fn local_shards<T: Copy + Default>(&self, global: &[T]) -> Result<BTreeMap<Rank, Vec<T>>, LayoutError> {
        if global.len() as u64 != self.elements {
            return Err(LayoutError::BufferLength {
                rank: self.mesh().start(),
                expected: self.elements,
                got: global.len() as u64,
            });
        }
        // Replicas copy the tensor once per rank: refused, not aborted, where that is past memory.
        let elements = self.mesh().ranks().try_fold(0u64, |acc, r| acc.checked_add(self.local_len(r)));
        reserve_host::<T>(elements).map_err(|bytes| LayoutError::ShardsTooLarge { bytes })?;
        Ok(self
            .mesh()
            .ranks()
            .filter_map(|rank| {
                let region = self.local_region(rank)?;
                if self.partial_index(rank) != Some(0) {
                    return Some((rank, vec![T::default(); region.volume() as usize]));
                }
                Some((rank, extract(global, &self.shape, &region)))
            })
            .collect())
    }
}

/// The most host memory the CPU side of a reshard allocates for buffers it makes (every rank's local
/// shards, the executor's destination buffers): a fixed bound, the same on every machine.
pub const HOST_BUFFERS_LIMIT_BYTES: u64 = 1 << 34;

/// Checks that `elements` (`None`: past `u64`) values of `T` are within
/// [`HOST_BUFFERS_LIMIT_BYTES`] and can be allocated (reserving them once); `Err` with the bytes
/// asked for (`u64::MAX` past that).
pub(crate) fn reserve_host<T>(elements: Option<u64>) -> Result<(), u64> {
    let bytes = elements.and_then(|n| n.checked_mul(size_of::<T>() as u64)).unwrap_or(u64::MAX);
    if bytes > HOST_BUFFERS_LIMIT_BYTES {
        return Err(bytes);
    }
    let mut probe: Vec<T> = Vec::new();
    probe.try_reserve_exact(bytes as usize / size_of::<T>().max(1)).map_err(|_| bytes)
}

/// The elements of `region` out of a dense row-major tensor of shape `shape`, row-major.
/// `region` must lie inside `shape` (it does for every region a [`Sharding`] hands out).
pub(crate) fn extract<T: Copy>(global: &[T], shape: &[u64], region: &Region) -> Vec<T> {
    // Before walking the rows: a box empty only in its last dim still has rows to walk, 2^80 of them
    // in a [2^40, 2^40, 0] tensor.
    if region.is_empty() {
        return Vec::new();
    }
    let mut out = Vec::with_capacity(region.volume() as usize);
    let strides = row_major_strides(shape);
    let Some((&run, outer)) = region.extent.split_last() else {
        // A scalar.
        out.extend_from_slice(&global[..1]);
        return out;
    };
    let k = outer.len();
    for_each_index(outer, |idx| {
        let base = (0..k).map(|d| (region.start[d] + idx[d]) * strides[d]).sum::<u64>() + region.start[k];
        out.extend_from_slice(&global[base as usize..(base + run) as usize]);
    });
    out
}

/// Calls `f` with every index of a box of extents `extent`, row-major (last index fastest): once with
/// `[]` for no dims, never when an extent is 0.
pub(crate) fn for_each_index(extent: &[u64], mut f: impl FnMut(&[u64])) {
    if extent.contains(&0) {
        return;
    }
    let mut idx = vec![0u64; extent.len()];
    loop {
        f(&idx);
        let mut d = extent.len();
        loop {
            if d == 0 {
                return;
            }
            d -= 1;
            idx[d] += 1;
            if idx[d] < extent[d] {
                break;
            }
            idx[d] = 0;
        }
    }
}
