//! Traffic accounting: what a plan moves, what destinations lack, and what the two usual workarounds
//! would move.
//!
//! All figures are bytes. "Domains" are NVLink domains: rank `r` is in domain `r / domain_size`.
//!
//! | figure | meaning |
//! |---|---|
//! | `bytes_total` | bytes the plan copies between two different ranks (every stage) |
//! | `bytes_local` | bytes the plan copies inside one rank (a rank in both meshes holding a piece it needs) |
//! | `bytes_intra_domain` / `bytes_cross_domain` | `bytes_total` split by whether both ranks share a domain |
//! | `bytes_injected_per_domain` | per destination domain, bytes entering it from ranks outside it |
//! | `bytes_needed` | Σ over destination ranks of the bytes of their shard they do not hold as a source (from a `Partial` source: of every partial sum of it, less the one a rank holds): the minimum any direct delivery moves, and what the direct route's `bytes_total` equals |
//! | `flat_sends` | every destination rank is sent its whole shard point to point (no reuse of bytes it holds, one send per replica rather than per domain; sources picked inside the domain when one holds the data) |
//! | `gather_broadcast` | the source mesh's first rank gathers the whole tensor, then broadcasts it to every other destination rank (a pipelined broadcast enters each destination domain once) |

use super::geometry::{Geometry, holds, in_domain};
use super::layout::Rank;
use super::transfer::Stage;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet, HashMap};

/// What one of the workarounds would move.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Workaround {
    /// Bytes copied between two different ranks.
    pub bytes_total: u64,
    /// The part of `bytes_total` that crosses NVLink domains.
    pub bytes_cross_domain: u64,
}

/// The traffic of a plan and of the two usual workarounds (see the module documentation).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Traffic {
    /// Ranks per NVLink domain.
    pub domain_size: u32,
    /// Bytes the plan copies between two different ranks.
    pub bytes_total: u64,
    /// Bytes the plan copies within one rank (`src == dst`), not in `bytes_total`.
    pub bytes_local: u64,
    /// The part of `bytes_total` between ranks of one domain.
    pub bytes_intra_domain: u64,
    /// The part of `bytes_total` between ranks of different domains.
    pub bytes_cross_domain: u64,
    /// Bytes destination ranks lack: their shard minus what they hold themselves as a source.
    pub bytes_needed: u64,
    /// Per domain holding a destination rank, the bytes entering it from outside.
    pub bytes_injected_per_domain: BTreeMap<u32, u64>,
    /// The most bytes one rank sends to other ranks.
    pub max_bytes_sent_by_a_rank: u64,
    /// The most bytes one rank receives from other ranks.
    pub max_bytes_received_by_a_rank: u64,
    /// Workaround 1: flat direct sends of every destination shard to every replica.
    pub flat_sends: Workaround,
    /// Workaround 2: gather to the source mesh's first rank, then broadcast the tensor.
    pub gather_broadcast: Workaround,
}

/// Adds transfer bytes, saturating: plans from [`super::ReshardPlan::with_stages`] may carry any sizes.
fn add(total: &mut u64, bytes: u64) {
    *total = total.saturating_add(bytes);
}

impl Traffic {
    pub(crate) fn account(g: &Geometry, elem: u64, ds: u32, stages: &[Stage]) -> Self {
        let mut t = Traffic { domain_size: ds, ..Default::default() };
        for rank in g.dst.mesh().ranks() {
            t.bytes_injected_per_domain.insert(rank / ds, 0);
        }
        let mut sent: HashMap<Rank, u64> = HashMap::new();
        let mut received: HashMap<Rank, u64> = HashMap::new();
        // A sum moves its box from every source: each is counted as a copy of its own.
        for (tr, src) in stages.iter().flat_map(|s| &s.transfers).flat_map(|tr| tr.sources().map(move |s| (tr, s))) {
            if src == tr.dst {
                add(&mut t.bytes_local, tr.bytes);
                continue;
            }
            add(&mut t.bytes_total, tr.bytes);
            add(sent.entry(src).or_default(), tr.bytes);
            add(received.entry(tr.dst).or_default(), tr.bytes);
            if src / ds == tr.dst / ds {
                add(&mut t.bytes_intra_domain, tr.bytes);
            } else {
                add(&mut t.bytes_cross_domain, tr.bytes);
                add(t.bytes_injected_per_domain.entry(tr.dst / ds).or_default(), tr.bytes);
            }
        }
        t.max_bytes_sent_by_a_rank = sent.values().copied().max().unwrap_or(0);
        t.max_bytes_received_by_a_rank = received.values().copied().max().unwrap_or(0);

        // Needed and flat sends, from the shards alone. A piece held as `k` partial sums needs all
        // `k` (one of them may be the rank's own).
        for dshard in &g.dst_shards {
            for piece in g.pieces(&dshard.region) {
                let sshard = g.src_shard(piece.src_key);
                let bytes = piece.region.volume() * elem;
                let k = sshard.partials() as u64;
                for &r in &dshard.replicas {
                    t.bytes_needed += bytes * (k - u64::from(holds(&sshard.replicas, r)));
                }
                t.flat_sends.bytes_total += bytes * k * dshard.replicas.len() as u64;
                if sshard.is_partial() {
                    // Each replica sums the nearest set (the workaround's choice).
                    for &r in &dshard.replicas {
                        let set = sshard.nearest_sets(r, ds)[0];
                        let outside = set.iter().filter(|&&q| q / ds != r / ds).count() as u64;
                        t.flat_sends.bytes_cross_domain += outside * bytes;
                    }
                } else {
                    let replicas = &sshard.replicas;
                    let outside =
                        dshard.replicas.iter().filter(|&&r| in_domain(replicas, r / ds, ds).is_empty()).count() as u64;
                    t.flat_sends.bytes_cross_domain += outside * bytes;
                }
            }
        }

        // Gather to the source mesh's first rank, then broadcast the whole tensor.
        let root = g.src.mesh().start();
        let tensor = g.src.elements() * elem;
        for sshard in g.src_shards.values() {
            let bytes = sshard.region.volume() * elem;
            if sshard.is_partial() {
                // The root sums the nearest set.
                let set = sshard.nearest_sets(root, ds)[0];
                t.gather_broadcast.bytes_total += bytes * set.iter().filter(|&&q| q != root).count() as u64;
                t.gather_broadcast.bytes_cross_domain +=
                    bytes * set.iter().filter(|&&q| q / ds != root / ds).count() as u64;
            } else if !holds(&sshard.replicas, root) {
                t.gather_broadcast.bytes_total += bytes;
                if in_domain(&sshard.replicas, root / ds, ds).is_empty() {
                    t.gather_broadcast.bytes_cross_domain += bytes;
                }
            }
        }
        let receivers = g.dst.mesh().ranks().filter(|&r| r != root).count() as u64;
        let foreign_domains: BTreeSet<u32> = g.dst.mesh().ranks().map(|r| r / ds).filter(|&d| d != root / ds).collect();
        t.gather_broadcast.bytes_total += receivers * tensor;
        t.gather_broadcast.bytes_cross_domain += foreign_domains.len() as u64 * tensor;
        t
    }
}
