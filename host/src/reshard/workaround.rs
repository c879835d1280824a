//! The two usual workarounds, as programs the same engine runs, so a benchmark compares like with like.
//! Their traffic is what [`super::Traffic`] counts for them.
//!
//! - [`flat_sends`]: every destination rank is sent its whole shard point to point (from a `Partial`
//!   source, every partial sum of it, summed on arrival), one send per replica (no forwarding inside a domain, no reuse of bytes a rank holds as a source): a
//!   [`ReshardPlan`] of one stage, lowered like any plan.
//! - [`gather_broadcast`]: the source mesh's first rank gathers the whole tensor into its scratch
//!   buffer (summing the partial sums of a `Partial` source), sends it whole to every other destination rank's scratch buffer, and every destination rank
//!   cuts its shard out of its copy: three stages, lowered directly (the scratch buffers are not part of
//!   the plan model). Each scratch buffer holds the whole tensor.

use super::geometry::{Geometry, holds, in_domain};
use super::layout::{Rank, Region};
use super::lower::{BoxCopy, LowerError, LowerOptions, LoweredReshard, check_mesh, check_options, lower_copies};
use super::plan::{ReadFrom, ReshardPlan, Stage, Transfer, boxed};
use oxccl_kernels::abi::{BUFFER_SLOTS, slot};
use std::collections::HashMap;

/// Workaround 1 as a plan: for every destination rank and every piece of its shard, one transfer from a
/// source replica, picked round robin among the replicas in the rank's domain other than itself when
/// there are any, else among all replicas other than itself (a rank that is a piece's only holder copies
/// it locally). Same options as `plan`; one stage.
///
/// Its traffic equals [`super::Traffic::flat_sends`] except where a rank is the only holder of a piece
/// it needs (that copy is local here, counted as sent there).
pub fn flat_sends(plan: &ReshardPlan) -> ReshardPlan {
    let g = Geometry::new(plan.src_sharding().clone(), plan.dst_sharding().clone());
    let elem = plan.elem_bytes();
    let ds = plan.options().domain_size;
    let mut cursors: HashMap<(u64, Option<u32>), usize> = HashMap::new();
    let mut transfers = Vec::new();
    for dshard in &g.dst_shards {
        for piece in g.pieces(&dshard.region) {
            let sshard = g.src_shard(piece.src_key);
            for &r in &dshard.replicas {
                // From partial sums, the nearest set of them (every partial sum once, ascending).
                let (src, partials) = if sshard.is_partial() {
                    let set = sshard.nearest_sets(r, ds)[0];
                    (set[0], set[1..].to_vec())
                } else {
                    let local = in_domain(&sshard.replicas, r / ds, ds);
                    let (pool, key) =
                        if local.is_empty() { (&sshard.replicas[..], None) } else { (local, Some(r / ds)) };
                    let others: Vec<Rank> = pool.iter().copied().filter(|&s| s != r).collect();
                    let src = if others.is_empty() {
                        r
                    } else {
                        let c = cursors.entry((piece.src_key, key)).or_insert(0);
                        *c += 1;
                        others[(*c - 1) % others.len()]
                    };
                    (src, Vec::new())
                };
                let b = boxed(&piece.region, &sshard.region, &dshard.region, elem);
                transfers.push(Transfer {
                    src,
                    partials,
                    dst: r,
                    read: ReadFrom::Src,
                    src_offset: b.src_offset,
                    dst_offset: b.dst_offset,
                    bytes: b.bytes,
                    shape: b.shape,
                    src_strides: b.src_strides,
                    dst_strides: b.dst_strides,
                    region: piece.region.clone(),
                });
            }
        }
    }
    transfers.sort_by_key(|t| (t.dst, t.dst_offset, t.src));
    plan.with_stages(vec![Stage { transfers }])
}

/// Workaround 2 lowered: stage 0 gathers every source shard the root (the source mesh's first rank)
/// lacks from one replica (in the root's domain when one is) into the root's [`slot::SCRATCH`], and
/// copies the root's own shard there; stage 1 copies the root's scratch buffer whole into the scratch
/// buffer of every other destination rank; stage 2 copies each destination rank's shard from its
/// scratch buffer to its [`slot::OUTPUT`]. `buffer_bytes` asks for a whole-tensor scratch buffer on the
/// root and on every destination rank.
pub fn gather_broadcast(plan: &ReshardPlan, opts: &LowerOptions) -> Result<LoweredReshard, LowerError> {
    check_options(opts)?;
    check_mesh("source", plan.src_sharding(), opts.ranks)?;
    check_mesh("destination", plan.dst_sharding(), opts.ranks)?;
    let g = Geometry::new(plan.src_sharding().clone(), plan.dst_sharding().clone());
    let elem = plan.elem_bytes();
    let ds = plan.options().domain_size;
    let full = Region::full(plan.shape());
    let tensor_bytes = g.src.elements() * elem;
    let root = g.src.mesh().start();
    let copy = |reader, read_slot, writer, write_slot, piece: &Region, from: &Region, to: &Region| {
        let b = boxed(piece, from, to, elem);
        BoxCopy {
            reader,
            partials: Vec::new(),
            read_slot,
            writer,
            write_slot,
            src_offset: b.src_offset,
            dst_offset: b.dst_offset,
            shape: b.shape,
            src_strides: b.src_strides,
            dst_strides: b.dst_strides,
        }
    };

    let mut keys: Vec<u64> = g.src_shards.keys().copied().collect();
    keys.sort_unstable();
    let gather = keys
        .iter()
        .map(|key| {
            let s = &g.src_shards[key];
            if s.is_partial() {
                // The nearest set of partial sums (every partial sum once, ascending), summed.
                let set = s.nearest_sets(root, ds)[0];
                let gather = copy(set[0], slot::INPUT, root, slot::SCRATCH, &s.region, &s.region, &full);
                return BoxCopy { partials: set[1..].to_vec(), ..gather };
            }
            let reader = if holds(&s.replicas, root) {
                root
            } else {
                *in_domain(&s.replicas, root / ds, ds).first().unwrap_or(&s.replicas[0])
            };
            copy(reader, slot::INPUT, root, slot::SCRATCH, &s.region, &s.region, &full)
        })
        .collect();
    let receivers: Vec<Rank> = g.dst.mesh().ranks().filter(|&r| r != root).collect();
    let broadcast = if tensor_bytes == 0 {
        Vec::new()
    } else {
        receivers.iter().map(|&r| copy(root, slot::SCRATCH, r, slot::SCRATCH, &full, &full, &full)).collect()
    };
    let extract = g
        .dst
        .mesh()
        .ranks()
        .filter_map(|r| {
            let region = g.dst.local_region(r).filter(|x| !x.is_empty())?;
            Some(copy(r, slot::SCRATCH, r, slot::OUTPUT, &region, &full, &region))
        })
        .collect();

    let buffer_bytes = (0..opts.ranks as Rank)
        .map(|r| {
            let mut b = [0u64; BUFFER_SLOTS];
            b[slot::INPUT as usize] = plan.src_buffer_bytes(r);
            b[slot::OUTPUT as usize] = plan.dst_buffer_bytes(r);
            if r == root || g.dst.mesh().contains(r) {
                b[slot::SCRATCH as usize] = tensor_bytes;
            }
            b
        })
        .collect();
    lower_copies(&[gather, broadcast, extract], elem, buffer_bytes, opts)
}
