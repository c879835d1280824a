//! The program verifier (structure) and the symbolic postcondition checker (meaning).
//!
//! The postcondition checker runs the program once, sequentially, on *symbolic* values: every input
//! chunk `(rank q, chunk j)` is a distinct symbol, a copy moves a value, a reduction forms the sum of
//! two multisets of symbols. At the end each output location must hold exactly the multiset the
//! collective requires: one symbol for a gather, the set of all ranks' symbols for a reduction (a
//! contribution counted twice or missing is caught). Multisets are represented by a count and a
//! wrapping sum of 64-bit pseudo-random keys per symbol, so equality is exact on the count and
//! holds up to a 2⁻⁶⁴ collision chance on the content; this keeps the check linear in the program
//! size, which matters for the 1024-GPU programs. Locations nobody initialised (scratch, and an
//! out-of-place output before it is written) hold a poison value that taints every reduction.

use super::{BufferKind, BufferLayout, Collective, OpId, OpKind, Program, ProgramError, Rank, Slice};

/// Structural checks: the name ([`Program::check_name`]), layout, ranks in range, slices inside
/// their buffers, equal non-zero counts, no transfer to self, no overlapping local copy or reduce.
pub fn verify(p: &Program) -> Result<(), ProgramError> {
    Program::check_name(&p.name)?;
    p.layout.validate()?;
    let l = &p.layout;
    // Each op reads its source and writes its destination; a reduction reads the destination too.
    let accesses: u64 = p
        .ops
        .iter()
        .map(|op| {
            let reads_dst =
                matches!(op.kind, OpKind::Reduce { .. } | OpKind::Transfer { op: super::RecvOp::RecvReduceCopy, .. });
            op.src().count as u64 * if reads_dst { 3 } else { 2 }
        })
        .sum();
    if accesses > Program::MAX_CHUNK_ACCESSES {
        return Err(ProgramError::BadLayout {
            reason: format!(
                "{} ops touch {accesses} chunks, more than the supported {}",
                p.ops.len(),
                Program::MAX_CHUNK_ACCESSES
            ),
        });
    }
    for (i, op) in p.ops.iter().enumerate() {
        let id = OpId::new(i);
        let (sr, dr) = (op.src_rank(), op.dst_rank());
        for r in [sr, dr] {
            if r.0 >= l.ranks {
                return Err(ProgramError::RankOutOfRange { op: id, rank: r.0, ranks: l.ranks });
            }
        }
        let (s, d) = (op.src(), op.dst());
        if s.count != d.count || s.count == 0 {
            return Err(ProgramError::CountMismatch { op: id, src: s, dst: d });
        }
        for (r, sl) in [(sr, s), (dr, d)] {
            if l.resolve(r, sl).is_none() {
                return Err(ProgramError::SliceOutOfRange {
                    op: id,
                    rank: r,
                    slice: sl,
                    buffer_chunks: l.buffer_chunks(r, sl.buffer),
                });
            }
        }
        match op.kind {
            OpKind::Transfer { src_rank, dst_rank, .. } if src_rank == dst_rank => {
                return Err(ProgramError::SelfTransfer { op: id, rank: src_rank });
            }
            OpKind::Copy { rank, src, dst, .. } | OpKind::Reduce { rank, src, dst, .. } => {
                let a = l.resolve(rank, src).unwrap_or(0) as u64;
                let b = l.resolve(rank, dst).unwrap_or(0) as u64;
                if a < b + dst.count as u64 && b < a + src.count as u64 {
                    return Err(ProgramError::OverlappingLocal { op: id, rank });
                }
            }
            _ => {}
        }
    }
    Ok(())
}

/// A symbolic value: a multiset of input symbols (count + key sum), or poison.
#[derive(Copy, Clone, PartialEq, Eq, Debug)]
struct Sym {
    count: u32,
    sum: u64,
}

const POISON: Sym = Sym { count: u32::MAX, sum: 0 };

impl Sym {
    fn combine(self, other: Sym) -> Sym {
        if self == POISON || other == POISON {
            return POISON;
        }
        Sym { count: self.count.saturating_add(other.count), sum: self.sum.wrapping_add(other.sum) }
    }
}

/// splitmix64: a bijective mix, so distinct symbols get distinct keys.
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

fn symbol(rank: u32, chunk: u32) -> Sym {
    Sym { count: 1, sum: mix(((rank as u64) << 32) | chunk as u64) }
}

/// Runs the program on symbols and checks the collective's postcondition on every output chunk
/// (after the structural checks of [`verify`]).
pub fn check_postcondition(p: &Program) -> Result<(), ProgramError> {
    verify(p)?;
    let l = &p.layout;
    let n = l.ranks;
    let base: Vec<usize> = prefix(l);
    let total = *base.last().unwrap_or(&0);
    let mut mem = vec![POISON; total];
    let mut writer = vec![u32::MAX; total];
    // Inputs.
    for q in 0..n {
        let r = Rank(q);
        for j in 0..l.input_chunks() {
            let at = l.resolve(r, Slice::input(j)).expect("input chunk resolves");
            mem[base[q as usize] + at as usize] = symbol(q, j);
        }
    }
    let mut tmp: Vec<Sym> = Vec::new();
    for (i, op) in p.ops.iter().enumerate() {
        let (s, d) = (op.src(), op.dst());
        let sa = base[op.src_rank().index()] + l.resolve(op.src_rank(), s).expect("verified") as usize;
        let da = base[op.dst_rank().index()] + l.resolve(op.dst_rank(), d).expect("verified") as usize;
        tmp.clear();
        tmp.extend_from_slice(&mem[sa..sa + s.count as usize]);
        for (k, v) in tmp.iter().enumerate() {
            let slot = &mut mem[da + k];
            *slot = if op.reduces() { slot.combine(*v) } else { *v };
            writer[da + k] = i as u32;
        }
    }
    // Postcondition.
    let oc = l.output_chunks();
    let ic = l.input_chunks();
    let reduced = |c: u32| (0..n).fold(Sym { count: 0, sum: 0 }, |acc, q| acc.combine(symbol(q, c)));
    let mut all_ranks_sum: Vec<Option<Sym>> = vec![None; ic as usize];
    for r in (0..n).filter(|&r| l.collective.defines_output(r as usize)) {
        for j in 0..oc {
            let expected = match l.collective {
                Collective::AllReduce | Collective::Reduce { .. } => {
                    *all_ranks_sum[j as usize].get_or_insert_with(|| reduced(j))
                }
                Collective::Broadcast { root } => symbol(root, j),
                Collective::ReduceScatter => {
                    let c = r * oc + j;
                    *all_ranks_sum[c as usize].get_or_insert_with(|| reduced(c))
                }
                Collective::AllGather => symbol(j / ic, j % ic),
                Collective::AllToAll => {
                    let b = oc / n;
                    symbol(j / b, r * b + j % b)
                }
            };
            let at = base[r as usize] + l.resolve(Rank(r), Slice::output(j)).expect("output resolves") as usize;
            let got = mem[at];
            if got != expected {
                let detail = if got == POISON {
                    "holds an uninitialised value".to_string()
                } else if got.count != expected.count {
                    format!("holds {} contributions, the collective needs {}", got.count, expected.count)
                } else {
                    format!("holds {} contributions but not the right ones", got.count)
                };
                let w = writer[at];
                return Err(ProgramError::Postcondition {
                    rank: Rank(r),
                    slice: Slice::new(BufferKind::Output, j, 1),
                    last_writer: (w != u32::MAX).then_some(OpId(w)),
                    detail,
                });
            }
        }
    }
    Ok(())
}

/// Start of each rank's storage in one flat array (length `ranks + 1`).
fn prefix(l: &BufferLayout) -> Vec<usize> {
    let mut v = Vec::with_capacity(l.ranks as usize + 1);
    let mut acc = 0usize;
    v.push(0);
    for r in 0..l.ranks {
        acc += l.storage_chunks(Rank(r)) as usize;
        v.push(acc);
    }
    v
}
