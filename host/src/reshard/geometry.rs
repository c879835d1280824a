//! Interval geometry shared by the planner and the traffic accounting: the source partition of each
//! tensor dim, the distinct source shards with their replicas, the distinct destination shards with
//! theirs, and the pieces (source shard ∩ destination shard) of a destination box.
//!
//! Nothing here enumerates elements: the work is proportional to ranks and pieces.

use super::layout::{Rank, Region, Sharding, for_each_index};
use std::collections::HashMap;

/// A distinct source box and the ranks holding it, ascending. Where the source layout has
/// `Partial` axes, the ranks hold partial sums of the box, and its values are their sum; `sets`
/// splits the ranks by replica index ([`super::layout::Sharding::replica_index`]): each set holds
/// every partial sum once, ascending by partial index, and a sum reads one whole set, so every
/// destination adds the partial sums in the same order (float sums are then the same bits on every
/// replica). Without `Partial` axes every set is one rank.
#[derive(Clone, Debug)]
pub(crate) struct SrcShard {
    pub region: Region,
    pub replicas: Vec<Rank>,
    pub sets: Vec<Vec<Rank>>,
}

impl SrcShard {
    /// How many partial sums the box is held as (1: its values).
    pub fn partials(&self) -> usize {
        self.sets.first().map_or(1, Vec::len)
    }

    /// Whether the box is held as several partial sums.
    pub fn is_partial(&self) -> bool {
        self.partials() > 1
    }

    /// The sets a sum for `rank` may read, best first by where they are: `rank`'s own set where it
    /// holds one; else the sets with the most ranks in `rank`'s domain (of `ds` ranks).
    pub fn nearest_sets(&self, rank: Rank, ds: u32) -> Vec<&[Rank]> {
        if let Some(own) = self.sets.iter().find(|s| holds(s, rank)) {
            return vec![own];
        }
        let near = |s: &[Rank]| s.iter().filter(|&&q| q / ds == rank / ds).count();
        let best = self.sets.iter().map(|s| near(s)).max().unwrap_or(0);
        self.sets.iter().filter(|s| near(s) == best).map(Vec::as_slice).collect()
    }
}

/// A distinct destination box and the ranks that must hold it, ascending.
#[derive(Clone, Debug)]
pub(crate) struct DstShard {
    pub region: Region,
    pub replicas: Vec<Rank>,
}

/// One piece of a destination box: the part one source shard supplies.
#[derive(Clone, Debug)]
pub(crate) struct Piece {
    /// Key of the source shard in [`Geometry::src_shards`].
    pub src_key: u64,
    /// The piece, in global elements (never empty).
    pub region: Region,
}

/// Both shardings, cut into intervals.
#[derive(Clone, Debug)]
pub(crate) struct Geometry {
    pub src: Sharding,
    pub dst: Sharding,
    /// Per tensor dim, the non-empty source intervals `(lo, hi)`, sorted: a partition of `0..n_d`.
    parts: Vec<Vec<(u64, u64)>>,
    /// Mixed-radix weights turning per-dim interval indices into a source shard key.
    radix: Vec<u64>,
    /// Distinct non-empty source shards by key.
    pub src_shards: HashMap<u64, SrcShard>,
    /// Distinct non-empty destination shards, in the order of their first replica.
    pub dst_shards: Vec<DstShard>,
}

impl Geometry {
    pub fn new(src: Sharding, dst: Sharding) -> Self {
        let k = src.shape().len();
        let src_regions: Vec<(Rank, Region)> =
            src.mesh().ranks().filter_map(|r| src.local_region(r).map(|g| (r, g))).collect();

        // The distinct non-empty intervals along each dim partition it: the chunks along the mesh axes
        // that shard a dim tile it, and every combination of mesh coordinates occurs.
        let mut parts: Vec<Vec<(u64, u64)>> = vec![Vec::new(); k];
        for (_, g) in &src_regions {
            for (d, part) in parts.iter_mut().enumerate() {
                if g.extent[d] > 0 {
                    part.push((g.start[d], g.start[d] + g.extent[d]));
                }
            }
        }
        for part in &mut parts {
            part.sort_unstable();
            part.dedup();
        }
        let mut radix = vec![1u64; k];
        for d in (0..k.saturating_sub(1)).rev() {
            radix[d] = radix[d + 1] * parts[d + 1].len().max(1) as u64;
        }

        let mut geometry = Self { src, dst, parts, radix, src_shards: HashMap::new(), dst_shards: Vec::new() };
        // Per box, its ranks by replica index.
        let mut sets: HashMap<u64, std::collections::BTreeMap<u64, Vec<Rank>>> = HashMap::new();
        for (rank, region) in src_regions {
            if region.is_empty() {
                continue;
            }
            let key = geometry.key_of(&region);
            let replica = geometry.src.replica_index(rank).unwrap_or(0);
            sets.entry(key).or_default().entry(replica).or_default().push(rank);
            geometry
                .src_shards
                .entry(key)
                .or_insert_with(|| SrcShard { region, replicas: Vec::new(), sets: Vec::new() })
                .replicas
                .push(rank);
        }
        for (key, by_index) in sets {
            if let Some(shard) = geometry.src_shards.get_mut(&key) {
                // Ranks were pushed ascending; sets ordered by their first rank.
                shard.sets = by_index.into_values().collect();
                shard.sets.sort_unstable_by_key(|s| s[0]);
            }
        }

        let mut index: HashMap<Region, usize> = HashMap::new();
        for rank in geometry.dst.mesh().ranks() {
            let Some(region) = geometry.dst.local_region(rank) else {
                continue;
            };
            if region.is_empty() {
                continue;
            }
            let next = geometry.dst_shards.len();
            let i = *index.entry(region.clone()).or_insert(next);
            if i == next {
                geometry.dst_shards.push(DstShard { region, replicas: Vec::new() });
            }
            geometry.dst_shards[i].replicas.push(rank);
        }
        geometry
    }

    /// The key of a non-empty source box (one of the partition's boxes).
    fn key_of(&self, region: &Region) -> u64 {
        (0..region.start.len())
            .map(|d| {
                let i = self.parts[d].partition_point(|&(lo, _)| lo < region.start[d]);
                i as u64 * self.radix[d]
            })
            .sum()
    }

    /// The pieces of a non-empty box: its intersections with every source shard it meets, in key order.
    pub fn pieces(&self, region: &Region) -> Vec<Piece> {
        let k = region.start.len();
        let mut ranges = Vec::with_capacity(k);
        for d in 0..k {
            let (lo, hi) = (region.start[d], region.start[d] + region.extent[d]);
            let part = &self.parts[d];
            let first = part.partition_point(|&(_, phi)| phi <= lo);
            let last = part.partition_point(|&(plo, _)| plo < hi);
            if first >= last {
                return Vec::new();
            }
            ranges.push((first, last));
        }
        let counts: Vec<u64> = ranges.iter().map(|&(first, last)| (last - first) as u64).collect();
        let mut out = Vec::new();
        for_each_index(&counts, |offsets| {
            let mut start = Vec::with_capacity(k);
            let mut extent = Vec::with_capacity(k);
            let mut key = 0;
            for (d, &o) in offsets.iter().enumerate() {
                let i = ranges[d].0 + o as usize;
                let (plo, phi) = self.parts[d][i];
                let lo = plo.max(region.start[d]);
                let hi = phi.min(region.start[d] + region.extent[d]);
                start.push(lo);
                extent.push(hi - lo);
                key += i as u64 * self.radix[d];
            }
            out.push(Piece { src_key: key, region: Region { start, extent } });
        });
        out
    }

    /// The source shard a piece comes from. Every piece's key names an existing shard: the partition's
    /// boxes are exactly the non-empty source boxes.
    pub fn src_shard(&self, key: u64) -> &SrcShard {
        &self.src_shards[&key]
    }
}

/// Whether `rank` is in the ascending list `ranks`.
pub(crate) fn holds(ranks: &[Rank], rank: Rank) -> bool {
    ranks.binary_search(&rank).is_ok()
}

/// The part of the ascending list `ranks` inside domain `domain` (ranks `domain * size ..`).
pub(crate) fn in_domain(ranks: &[Rank], domain: u32, size: u32) -> &[Rank] {
    let lo = u64::from(domain) * u64::from(size);
    let hi = lo + u64::from(size);
    let a = ranks.partition_point(|&r| u64::from(r) < lo);
    let b = ranks.partition_point(|&r| u64::from(r) < hi);
    &ranks[a..b]
}
