//! Shared by the reshard integration tests: random problems and an element-level oracle that does not
//! reuse the planner's interval code.

#![allow(dead_code)]

use oxccl_host::reshard::{Layout, Mesh, Placement, PlanOptions, Rank, Region, ReshardPlan, Route, Transfer};
use proptest::prelude::*;
use std::collections::BTreeSet;

/// A random reshard problem.
#[derive(Clone, Debug)]
pub struct Problem {
    pub shape: Vec<u64>,
    pub elem_bytes: u64,
    pub src: Layout,
    pub dst: Layout,
    pub domain_size: u32,
    pub min_split_bytes: u64,
}

impl Problem {
    pub fn plan(&self, route: Route) -> ReshardPlan {
        oxccl_host::reshard::plan(
            &self.shape,
            self.elem_bytes,
            &self.src,
            &self.dst,
            PlanOptions { route, domain_size: self.domain_size, min_split_bytes: self.min_split_bytes },
        )
        .expect("random problems are valid")
    }
}

fn layout(rank: usize, max_ranks: u32) -> impl Strategy<Value = Layout> {
    let axes = prop::collection::vec(1u32..=4, 1..=3)
        .prop_filter("mesh too large", move |d| d.iter().product::<u32>() <= max_ranks);
    (axes, 0u32..=12).prop_flat_map(move |(dims, start)| placed(rank, dims, start))
}

/// A random layout for a tensor of `rank` dims on a mesh of at most `world` ranks lying inside ranks
/// `0..world`.
fn layout_in(rank: usize, world: u32) -> impl Strategy<Value = Layout> {
    let axes = prop::collection::vec(1u32..=4, 1..=3)
        .prop_filter("mesh too large", move |d| d.iter().product::<u32>() <= world);
    axes.prop_flat_map(move |dims| {
        let size: u32 = dims.iter().product();
        (Just(dims), 0u32..=world - size)
    })
    .prop_flat_map(move |(dims, start)| placed(rank, dims, start))
}

/// `dims` at `start` with random placements for a tensor of `rank` dims.
fn placed(rank: usize, dims: Vec<u32>, start: u32) -> impl Strategy<Value = Layout> {
    let placement = if rank == 0 {
        Just(Placement::Replicate).boxed()
    } else {
        prop_oneof![Just(Placement::Replicate), (0..rank as u32).prop_map(Placement::Shard)].boxed()
    };
    let n = dims.len();
    prop::collection::vec(placement, n)
        .prop_map(move |p| Layout::new(Mesh::new(dims.clone(), start).expect("positive dims"), p).expect("valid"))
}

/// Random problems: tensors of 0 to 3 dims (sizes 0 to 9, mostly positive), meshes of up to 24 ranks
/// with 1 to 3 axes starting anywhere in 0..=12 (so meshes are disjoint, overlap or coincide), any mix
/// of `R` and `S<dim>` (several axes may shard one dim), element sizes 1, 2, 3, 4, 8, domains of 1 to 8,
/// split thresholds from "split to rows" to "never".
pub fn problem() -> impl Strategy<Value = Problem> {
    (0usize..=3)
        .prop_flat_map(|rank| {
            let dim = prop_oneof![1 => Just(0u64), 12 => 1u64..=9];
            (
                prop::collection::vec(dim, rank),
                prop::sample::select(vec![1u64, 2, 3, 4, 8]),
                layout(rank, 24),
                layout(rank, 24),
                1u32..=8,
                prop::sample::select(vec![0u64, 1, 8, 24, 64, u64::MAX]),
            )
        })
        .prop_map(|(shape, elem_bytes, src, dst, domain_size, min_split_bytes)| Problem {
            shape,
            elem_bytes,
            src,
            dst,
            domain_size,
            min_split_bytes,
        })
}

/// Random problems like [`problem`] whose meshes lie inside ranks `0..world` (what one engine launch
/// addresses): meshes of up to `world` ranks starting anywhere that keeps them inside.
pub fn problem_in(world: u32) -> impl Strategy<Value = Problem> {
    problem_from(
        vec![1, 2, 3, 4, 8],
        move |rank| layout_in(rank, world).boxed(),
        move |rank| layout_in(rank, world).boxed(),
    )
}

/// Random problems of tensors of 0 to 3 dims, element sizes from `elem_bytes`, the two layouts from
/// `src` and `dst` (given the tensor's dims), domains of 1 to 8, every split threshold.
fn problem_from(
    elem_bytes: Vec<u64>,
    src: impl Fn(usize) -> BoxedStrategy<Layout> + Clone + 'static,
    dst: impl Fn(usize) -> BoxedStrategy<Layout> + Clone + 'static,
) -> impl Strategy<Value = Problem> {
    (0usize..=3)
        .prop_flat_map(move |rank| {
            let dim = prop_oneof![1 => Just(0u64), 12 => 1u64..=9];
            (
                prop::collection::vec(dim, rank),
                prop::sample::select(elem_bytes.clone()),
                src(rank),
                dst(rank),
                1u32..=8,
                prop::sample::select(vec![0u64, 1, 8, 24, 64, u64::MAX]),
            )
        })
        .prop_map(|(shape, elem_bytes, src, dst, domain_size, min_split_bytes)| Problem {
            shape,
            elem_bytes,
            src,
            dst,
            domain_size,
            min_split_bytes,
        })
}

/// The global indices a rank holds, by the list-based `torch.chunk` rule: along each dim, start with
/// the index list `0..n` and, for each mesh axis sharding that dim (outer first), split the list into
/// `ceil(len / parts)`-long chunks and keep the rank's one. `None` outside the mesh.
pub fn oracle_indices(shape: &[u64], layout: &Layout, rank: Rank) -> Option<Vec<Vec<u64>>> {
    let mesh = layout.mesh();
    if !mesh.contains(rank) {
        return None;
    }
    let mut linear = rank - mesh.start();
    let mut coords = vec![0u32; mesh.dims().len()];
    for a in (0..coords.len()).rev() {
        coords[a] = linear % mesh.dims()[a];
        linear /= mesh.dims()[a];
    }
    let mut lists: Vec<Vec<u64>> = shape.iter().map(|&n| (0..n).collect()).collect();
    for (a, p) in layout.placements().iter().enumerate() {
        if let Placement::Shard(d) = *p {
            let list = &lists[d as usize];
            let parts = mesh.dims()[a] as usize;
            let size = list.len().div_ceil(parts);
            let chunks: Vec<Vec<u64>> =
                if size == 0 { Vec::new() } else { list.chunks(size).map(<[u64]>::to_vec).collect() };
            lists[d as usize] = chunks.get(coords[a] as usize).cloned().unwrap_or_default();
        }
    }
    Some(lists)
}

/// The global row-major linear indices of every element a rank holds (empty outside the mesh).
pub fn oracle_elements(shape: &[u64], layout: &Layout, rank: Rank) -> BTreeSet<u64> {
    let Some(lists) = oracle_indices(shape, layout, rank) else {
        return BTreeSet::new();
    };
    let mut out = BTreeSet::new();
    let mut acc = vec![0u64];
    for (d, list) in lists.iter().enumerate() {
        let mut next = Vec::with_capacity(acc.len() * list.len());
        for &a in &acc {
            for &i in list {
                next.push(a * shape[d] + i);
            }
        }
        acc = next;
    }
    out.extend(acc);
    out
}

/// The global linear indices a transfer writes, in order, decoded from its write side: `dst`'s box
/// (from the oracle) and the byte geometry. Panics on a write not on element boundaries.
pub fn written_elements(plan: &ReshardPlan, t: &Transfer) -> Vec<u64> {
    let shape = plan.shape();
    let elem = plan.elem_bytes();
    let lists = oracle_indices(shape, plan.dst(), t.dst).expect("writes go to destination ranks");
    let extent: Vec<u64> = lists.iter().map(|l| l.len() as u64).collect();
    let (run, outer) = t.shape.split_last().expect("non-empty box");
    assert_eq!(run % elem, 0, "run of {run} bytes is not whole elements");
    let mut out = Vec::new();
    let mut idx = vec![0u64; outer.len()];
    loop {
        let at = t.dst_offset + idx.iter().zip(&t.dst_strides).map(|(i, s)| i * s).sum::<u64>();
        assert_eq!(at % elem, 0, "write at byte {at} is not on an element");
        for e in 0..run / elem {
            // Unravel the local element index in the destination box, map to global.
            let mut local = at / elem + e;
            let mut coords = vec![0u64; shape.len()];
            for d in (0..shape.len()).rev() {
                coords[d] = lists[d][(local % extent[d]) as usize];
                local /= extent[d];
            }
            out.push(coords.iter().zip(shape).fold(0, |acc, (&c, &n)| acc * n + c));
        }
        let mut d = outer.len();
        loop {
            if d == 0 {
                return out;
            }
            d -= 1;
            idx[d] += 1;
            if idx[d] < outer[d] {
                break;
            }
            idx[d] = 0;
        }
    }
}

/// The global linear indices of a region.
pub fn region_elements(shape: &[u64], region: &Region) -> BTreeSet<u64> {
    let mut acc = vec![0u64];
    for (d, &n) in shape.iter().enumerate() {
        let mut next = Vec::new();
        for &a in &acc {
            for i in region.start[d]..region.start[d] + region.extent[d] {
                next.push(a * n + i);
            }
        }
        acc = next;
    }
    acc.into_iter().collect()
}

/// A random layout like [`layout_in`]'s whose mesh has at least one axis placed `Partial` (a source
/// holding partial sums).
fn partial_layout_in(rank: usize, world: u32) -> impl Strategy<Value = Layout> {
    let axes = prop::collection::vec(1u32..=4, 1..=3)
        .prop_filter("mesh too large", move |d| d.iter().product::<u32>() <= world);
    axes.prop_flat_map(move |dims| {
        let size: u32 = dims.iter().product();
        let n = dims.len();
        let placement = if rank == 0 {
            prop_oneof![Just(Placement::Replicate), Just(Placement::Partial)].boxed()
        } else {
            prop_oneof![
                Just(Placement::Replicate),
                Just(Placement::Partial),
                (0..rank as u32).prop_map(Placement::Shard)
            ]
            .boxed()
        };
        (Just(dims), 0u32..=world - size, prop::collection::vec(placement, n), 0..n)
    })
    .prop_map(|(dims, start, mut placements, forced)| {
        placements[forced] = Placement::Partial;
        Layout::new(Mesh::new(dims, start).expect("positive dims"), placements).expect("valid")
    })
}

/// Random problems like [`problem_in`] whose source is partial (at least one `Partial` axis) and
/// whose elements are `elem_bytes` wide.
pub fn partial_problem_in(world: u32, elem_bytes: Vec<u64>) -> impl Strategy<Value = Problem> {
    problem_from(
        elem_bytes,
        move |rank| partial_layout_in(rank, world).boxed(),
        move |rank| layout_in(rank, world).boxed(),
    )
}
