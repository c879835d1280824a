//! Point-to-point transfers (send / receive) between ranks that each launch alone.
//!
//! A rank's transfers are matched with its peers' in order, per peer and direction: the `i`-th send
//! of rank `a` to rank `b` is the `i`-th receive of `b` from `a`, whatever else either exchanges in
//! between. Each transfer runs in *pair slots* ([`PAIR_CTAS`]), barrier slots the two ranks use
//! with each other alone, so their call counts stay in step however many calls either makes with
//! others. [`rounds`] deals a group of transfers into launches: round `i` holds the `i`-th transfer
//! of every (peer, direction), which is round `i` at the peer too, so every launch meets launches
//! its peers make in the same order and none waits for a transfer a peer queued behind it.
//!
//! Both ends work: of a transfer's `2K` shares, the sender's `K` CTAs push the first half into the
//! receiver's buffer and the receiver's `K` pull the rest, so that a transfer moves with `2K` CTAs
//! while each rank spends `K` on it. `K` ([`ctas_per_transfer`]) depends on the communicator alone,
//! so that both ends agree on it and every round of a rank fits the CTAs it may keep resident.

use crate::lowered::Lowered;
use oxccl_kernels::abi::{DType, MAX_CTAS_PER_RANK, MAX_RANKS, PAIR_CTAS, RedOp, Task, TaskKind, TbProgram, slot};

/// Which way a transfer goes, seen from the rank that makes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Direction {
    /// This rank's buffer goes to the peer.
    Send,
    /// The peer's buffer comes into this rank's.
    Recv,
}

/// One transfer of a rank with a peer: `bytes` out of (send) or into (receive) a buffer of this rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Transfer {
    /// The other rank.
    pub peer: usize,
    /// Which way the bytes go.
    pub dir: Direction,
    /// Length in bytes; the peer's matching transfer must have the same.
    pub bytes: u64,
}

/// Why a round cannot be lowered.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum P2pError {
    /// A transfer names this rank or a rank outside the world.
    #[error("rank {me} of {world}: a transfer with rank {peer} (a peer must be another rank of the world)")]
    Peer {
        /// The rank making the transfer.
        me: usize,
        /// Ranks of the world.
        world: usize,
        /// The peer named.
        peer: usize,
    },
    /// Two transfers of a round go to the same peer in the same direction (use [`rounds`]).
    #[error("two transfers with rank {peer} in one direction in one round")]
    Repeated {
        /// The peer.
        peer: usize,
    },
    /// A length is not a whole number of the launch's elements.
    #[error("a transfer of {bytes} bytes with rank {peer} is not whole {dtype:?} elements")]
    Partial {
        /// The peer.
        peer: usize,
        /// The transfer's length.
        bytes: u64,
        /// The launch's element type.
        dtype: DType,
    },
}

/// CTAs each end spends on one transfer, with `ctas_per_rank` CTAs a rank may keep resident in a
/// world of `world` ranks: a round holds at most a send and a receive with each of the `world - 1`
/// peers, so `2 (world - 1)` transfers of `K` CTAs fit; at least one, at most half the pair slots
/// (both directions of a pair share them).
pub fn ctas_per_transfer(ctas_per_rank: u32, world: usize) -> u32 {
    let transfers = 2 * world.saturating_sub(1).max(1) as u32;
    (ctas_per_rank / transfers).clamp(1, (PAIR_CTAS / 2) as u32)
}

/// Deals `transfers` (in the caller's order) into rounds: round `i` holds the `i`-th transfer of
/// each (peer, direction), sorted by peer then direction. Returns the rounds as indices into
/// `transfers`.
pub fn rounds(transfers: &[Transfer]) -> Vec<Vec<usize>> {
    let mut seen: std::collections::HashMap<(usize, Direction), usize> = Default::default();
    let mut out: Vec<Vec<usize>> = Vec::new();
    for (i, t) in transfers.iter().enumerate() {
        let n = seen.entry((t.peer, t.dir)).or_insert(0);
        if out.len() <= *n {
            out.push(Vec::new());
        }
        out[*n].push(i);
        *n += 1;
    }
    for r in &mut out {
        r.sort_by_key(|&i| (transfers[i].peer, transfers[i].dir));
    }
    out
}

/// The key both ends of a transfer announce (never 0): the same at the sender and the receiver
/// exactly when they agree on who sends, who receives and how many bytes.
pub fn transfer_key(src: usize, dst: usize, bytes: u64) -> u32 {
    // splitmix64 over the three values: fixed, so every process computes the same key.
    let mut h = 0x6f78_6363_6c70_3270u64;
    for v in [src as u64, dst as u64, bytes] {
        h = (h ^ v).wrapping_add(0x9e37_79b9_7f4a_7c15);
        h = (h ^ (h >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        h = (h ^ (h >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        h ^= h >> 31;
    }
    ((h ^ (h >> 32)) as u32).max(1)
}

/// Lowers one round of rank `me` (of `world`): for each transfer, `k` CTAs in its pair slots
/// (the direction from the lower rank to the higher first), meeting the peer alone, with this
/// rank's buffers in row `peer` of the launch's buffer table (slot `INPUT`: what it sends the
/// peer; `OUTPUT`: what it receives from it) and the transfer's key; each CTA moves its share of
/// the bytes with tasks of `dtype`. The programs are this rank's alone, one per CTA.
pub fn lower_round(me: usize, world: usize, round: &[Transfer], k: u32, dtype: DType) -> Result<Lowered, P2pError> {
    let k = k.clamp(1, (PAIR_CTAS / 2) as u32);
    let mut programs = Vec::new();
    let mut tasks = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for t in round {
        if t.peer == me || t.peer >= world || world > MAX_RANKS {
            return Err(P2pError::Peer { me, world, peer: t.peer });
        }
        if !seen.insert((t.peer, t.dir)) {
            return Err(P2pError::Repeated { peer: t.peer });
        }
        if !t.bytes.is_multiple_of(dtype.size() as u64) {
            return Err(P2pError::Partial { peer: t.peer, bytes: t.bytes, dtype });
        }
        let (src, dst) = match t.dir {
            Direction::Send => (me, t.peer),
            Direction::Recv => (t.peer, me),
        };
        // The pair's slots: the lower rank's sends first, then the higher rank's.
        let first_slot = if src < dst { 0 } else { k };
        let share = share_bytes(t.bytes, 2 * k);
        for c in 0..k {
            // The sender pushes shares 0..k, the receiver pulls k..2k.
            let s = if t.dir == Direction::Send { c } else { k + c } as u64;
            let start = (s * share).min(t.bytes);
            let end = ((s + 1) * share).min(t.bytes);
            let first_task = tasks.len() as u32;
            if end > start {
                tasks.push(Task {
                    kind: TaskKind::Move.raw(),
                    dtype: dtype.raw(),
                    op: RedOp::Sum.raw(),
                    src_slot: slot::INPUT,
                    dst_slot: slot::OUTPUT,
                    flags: 0,
                    divisor: 0,
                    src_ranks: 1 << src,
                    dst_ranks: 1 << dst,
                    src_offset: start,
                    dst_offset: start,
                    bytes: end - start,
                });
            }
            programs.push(TbProgram {
                rank: me as u32,
                cta: (MAX_CTAS_PER_RANK as u32) + first_slot + c,
                first_task,
                task_count: tasks.len() as u32 - first_task,
                barrier_ranks: (1 << me) | (1 << t.peer),
                table: t.peer as u32 + 1,
                key: transfer_key(src, dst, t.bytes),
                reserved: 0,
            });
        }
    }
    Ok(Lowered { programs, tasks, ranks: world, slots: 1, combines: false })
}

/// Bytes of each of `shares` shares of a transfer of `bytes`: equal, rounded up to 256 bytes, so
/// that both ends cut the transfer at the same places and the pieces start aligned for the bulk
/// copies wherever the buffers are.
fn share_bytes(bytes: u64, shares: u32) -> u64 {
    bytes.div_ceil(shares.max(1) as u64).next_multiple_of(256).max(256)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(peer: usize, dir: Direction, bytes: u64) -> Transfer {
        Transfer { peer, dir, bytes }
    }

    #[test]
    fn both_ends_of_a_transfer_meet_in_the_same_slots_with_the_same_key_and_cover_it_once() {
        for bytes in [0u64, 4, 256, 1000, 4096, 1 << 20, (1 << 20) + 12] {
            for k in [1, 3, 8] {
                let a = lower_round(1, 4, &[t(3, Direction::Send, bytes)], k, DType::U8).unwrap();
                let b = lower_round(3, 4, &[t(1, Direction::Recv, bytes)], k, DType::U8).unwrap();
                assert_eq!(a.programs.len(), k as usize);
                for (pa, pb) in a.programs.iter().zip(&b.programs) {
                    assert_eq!((pa.cta, pa.key, pa.barrier_ranks), (pb.cta, pb.key, pb.barrier_ranks));
                    assert_eq!((pa.table, pb.table), (4, 2), "each end's row is its peer's");
                }
                // Every byte once, from 1's INPUT to 3's OUTPUT.
                let mut covered = vec![0u8; bytes as usize];
                for task in a.tasks.iter().chain(&b.tasks) {
                    assert_eq!((task.src_ranks, task.dst_ranks), (1 << 1, 1 << 3));
                    assert_eq!(task.src_offset, task.dst_offset);
                    for x in &mut covered[task.src_offset as usize..(task.src_offset + task.bytes) as usize] {
                        *x += 1;
                    }
                }
                assert!(covered.iter().all(|&c| c == 1), "{bytes} bytes, k {k}");
            }
        }
    }

    #[test]
    fn the_two_directions_of_a_pair_take_different_slots_and_keys() {
        let lo = lower_round(0, 2, &[t(1, Direction::Send, 64), t(1, Direction::Recv, 64)], 2, DType::U8).unwrap();
        let hi = lower_round(1, 2, &[t(0, Direction::Recv, 64), t(0, Direction::Send, 64)], 2, DType::U8).unwrap();
        let slots = |l: &Lowered| {
            let mut v: Vec<(u32, u32)> = l.programs.iter().map(|p| (p.cta, p.key)).collect();
            v.sort();
            v
        };
        assert_eq!(slots(&lo), slots(&hi));
        let s = slots(&lo);
        assert_eq!(s.iter().map(|x| x.0).collect::<std::collections::HashSet<_>>().len(), 4);
        assert_ne!(transfer_key(0, 1, 64), transfer_key(1, 0, 64));
        assert_ne!(transfer_key(0, 1, 64), transfer_key(0, 1, 68));
    }

    #[test]
    fn rounds_pair_the_ith_transfers_of_each_peer_and_direction() {
        let ts = [
            t(2, Direction::Send, 1),
            t(1, Direction::Recv, 2),
            t(2, Direction::Send, 3),
            t(2, Direction::Recv, 4),
            t(1, Direction::Recv, 5),
        ];
        assert_eq!(rounds(&ts), vec![vec![1, 0, 3], vec![4, 2]]);
    }

    #[test]
    fn bad_rounds_are_refused() {
        let send = |peer| t(peer, Direction::Send, 8);
        assert!(matches!(lower_round(1, 4, &[send(1)], 1, DType::U8), Err(P2pError::Peer { peer: 1, .. })));
        assert!(matches!(lower_round(1, 4, &[send(4)], 1, DType::U8), Err(P2pError::Peer { peer: 4, .. })));
        assert!(matches!(lower_round(1, 4, &[send(2), send(2)], 1, DType::U8), Err(P2pError::Repeated { peer: 2 })));
        let odd = t(2, Direction::Recv, 6);
        assert!(matches!(lower_round(1, 4, &[odd], 1, DType::U32), Err(P2pError::Partial { bytes: 6, .. })));
    }

    #[test]
    fn a_full_round_fits_the_ctas_of_a_rank() {
        for world in 2..=MAX_RANKS {
            for per_rank in [1u32, 8, 16, 66, 132] {
                let k = ctas_per_transfer(per_rank, world);
                let all: Vec<Transfer> = (0..world)
                    .filter(|&q| q != 0)
                    .flat_map(|q| [t(q, Direction::Send, 1 << 20), t(q, Direction::Recv, 1 << 20)])
                    .collect();
                let l = lower_round(0, world, &all, k, DType::U32).unwrap();
                assert!(l.programs.len() as u32 <= per_rank.max(2 * (world as u32 - 1)), "{world} ranks, {per_rank}");
                crate::lowered::validate_structure(&l).unwrap();
            }
        }
    }
}
