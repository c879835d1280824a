//! Grouped collectives: several T-CCL collectives of one element type and operator in one launch of
//! each rank, as between `ncclGroupStart` and `ncclGroupEnd`.
//!
//! A launch of one rank needs only its own row of the buffer table (its peers announce theirs), so
//! the other rows are free: a group puts its members' buffers there, in order, each in the slots it
//! needs ([`slots_needed`]: one for an in-place AllReduce, Broadcast or Reduce, whose input is its
//! output; two otherwise), and each CTA works on the members of one row (`TbProgram::table`): a row
//! holds four slots, so up to four in-place AllReduces or two out-of-place members. The rows share
//! the rank's CTAs in proportion to the bytes their members move, at least one each; a row's
//! members run their own T-CCL plans ([`crate::tccl::plan`]) with the row's CTA count, each CTA's
//! tasks member after member. A launch holds at most one row per CTA (and 16), and closes early
//! where one more row would leave a row far below its proportional share (a large member among many
//! small ones): a group takes as many launches as that needs ([`launches`]).

use crate::lowered::{Alias, Lowered};
use crate::tccl::{self, Collective, PlanError, PlanSpec, Reduction};
use oxccl_kernels::abi::{BUFFER_SLOTS, DType, MAX_RANKS, RedOp, Task, TbProgram, slot};
use std::ops::Range;

/// Slots of the buffer table `m` takes: one where its input is its output at the same offset on
/// every rank (in place, AllReduce, Broadcast and Reduce), else an input and an output.
pub fn slots_needed(m: &Member) -> usize {
    let same = matches!(m.collective, Collective::AllReduce | Collective::Broadcast { .. } | Collective::Reduce { .. });
    if m.in_place && same { 1 } else { 2 }
}

/// The members of each row, in order: a row takes members while their slots fit.
fn rows(members: &[Member]) -> Vec<Range<usize>> {
    let mut rows: Vec<Range<usize>> = Vec::new();
    let mut used = BUFFER_SLOTS;
    for (i, m) in members.iter().enumerate() {
        let need = slots_needed(m);
        if used + need > BUFFER_SLOTS {
            rows.push(i..i);
            used = 0;
        }
        used += need;
        rows.last_mut().expect("a row was opened").end = i + 1;
    }
    rows
}

/// One collective of a group: what [`PlanSpec`] says of a single call.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Member {
    /// The collective, with its root where it has one.
    pub collective: Collective,
    /// Elements per rank, as [`PlanSpec::count`].
    pub count: u64,
    /// Whether the output aliases the input.
    pub in_place: bool,
}

/// What every member of a launch shares.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Shared {
    /// The element type.
    pub dtype: DType,
    /// The reduction operator.
    pub op: RedOp,
    /// Ranks of the communicator.
    pub ranks: usize,
    /// CTAs per rank of the launch (every row gets at least one).
    pub ctas: u32,
    /// How shard-in combines.
    pub reduction: Reduction,
}

impl Shared {
    /// The spec of `m` alone with `ctas` CTAs per rank.
    pub fn spec(&self, m: &Member, ctas: u32) -> PlanSpec {
        PlanSpec {
            collective: m.collective,
            count: m.count,
            dtype: self.dtype,
            op: self.op,
            ranks: self.ranks,
            in_place: m.in_place,
            ctas,
            reduction: self.reduction,
        }
    }
}

/// Where a member's buffers are in a launch's buffer table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Place {
    /// The row (`TbProgram::table` is `row + 1`).
    pub row: usize,
    /// The slot of its input.
    pub input: u8,
    /// The slot of its output.
    pub output: u8,
}

/// One launch of a group.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupLaunch {
    /// Every rank's CTAs, rank-major, [`Shared::ctas`] each.
    pub lowered: Lowered,
    /// Where each member of the launch (in the order given) keeps its buffers.
    pub places: Vec<Place>,
}

/// Rows one launch of `ctas` CTAs per rank holds: one per CTA at most, and the table's rows.
pub fn rows_per_launch(ctas: u32) -> usize {
    (ctas as usize).clamp(1, MAX_RANKS)
}

/// The members of each launch of a group: consecutive runs of rows, as many as one launch's rows
/// hold ([`rows_per_launch`]), and no more than keep the launch *balanced*: with the CTAs shared
/// out (at least one each, the rest in proportion), every row gets at least half of its
/// proportional share of them (a row of one large member among many small ones would otherwise be
/// left one CTA while the small ones take the rest, and the launch would wait on it). Rows of equal bytes are always balanced. Every rank
/// computes the same runs from the same members.
pub fn launches(shared: &Shared, members: &[Member]) -> Vec<Range<usize>> {
    let rows = rows(members);
    let weights: Vec<u64> = rows.iter().map(|r| members[r.clone()].iter().map(|m| weight(shared, m)).sum()).collect();
    let max = rows_per_launch(shared.ctas);
    let mut out: Vec<Range<usize>> = Vec::new();
    let mut first = 0;
    for i in 1..=rows.len() {
        let next = i < rows.len() && i - first < max && balanced(shared.ctas, &weights[first..=i]);
        if !next {
            out.push(rows[first].start..rows[i - 1].end);
            first = i;
        }
    }
    out
}

/// Bytes a member moves: what its rows are weighed by.
fn weight(shared: &Shared, m: &Member) -> u64 {
    let (i, o) = shared.spec(m, 1).buffer_bytes();
    i.saturating_add(o)
}

/// Whether rows of `weights` share `ctas` CTAs (at least one each, [`share`]) so that every row
/// gets at least half of its proportional share (`ctas × weight / Σ weights`).
fn balanced(ctas: u32, weights: &[u64]) -> bool {
    if weights.len() > ctas as usize {
        return false;
    }
    let total: u128 = weights.iter().map(|&w| w as u128).sum();
    let got = share(ctas, weights);
    weights.iter().zip(got).all(|(&w, g)| ctas as u128 * w as u128 <= 2 * total * g as u128)
}

/// Splits `total` CTAs between rows of the given weights: at least one each, the rest in proportion
/// (largest remainders first). `weights` is not empty and `total >= weights.len()`.
fn share(total: u32, weights: &[u64]) -> Vec<u32> {
    let n = weights.len() as u32;
    let spare = (total - n) as u128;
    let sum: u128 = weights.iter().map(|&w| w as u128).sum::<u128>().max(1);
    let mut got: Vec<u32> = weights.iter().map(|&w| 1 + (spare * w as u128 / sum) as u32).collect();
    let mut left = total - got.iter().sum::<u32>();
    let mut order: Vec<usize> = (0..weights.len()).collect();
    // Largest remainder first; ties to the earlier row.
    order.sort_by_key(|&i| std::cmp::Reverse((spare * weights[i] as u128) % sum));
    for &i in order.iter().cycle() {
        if left == 0 {
            break;
        }
        got[i] += 1;
        left -= 1;
    }
    got
}

/// Why a group launch cannot be built.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum GroupError {
    /// More rows than one launch holds, or no member.
    #[error("{members} members in {rows} rows of the buffer table: one launch holds 1..={max} rows")]
    Members {
        /// Members given.
        members: usize,
        /// The rows they take.
        rows: usize,
        /// The most rows one launch of this many CTAs holds.
        max: usize,
    },
    /// A member's own plan cannot be built.
    #[error("member {member}: {error}")]
    Member {
        /// Its index among the launch's members.
        member: usize,
        /// Why.
        error: PlanError,
    },
}

/// Builds one launch of `members` (as many as [`rows_per_launch`] rows hold: one run of
/// [`launches`]).
pub fn lower(shared: &Shared, members: &[Member]) -> Result<GroupLaunch, GroupError> {
    let rows = rows(members);
    let max = rows_per_launch(shared.ctas);
    if members.is_empty() || rows.len() > max {
        return Err(GroupError::Members { members: members.len(), rows: rows.len(), max });
    }
    let weights: Vec<u64> = rows.iter().map(|r| members[r.clone()].iter().map(|m| weight(shared, m)).sum()).collect();
    let ctas = share(shared.ctas, &weights);
    // Every member's plan with its row's CTAs, and its slots in the row.
    let mut plans = Vec::with_capacity(members.len());
    let mut places = Vec::with_capacity(members.len());
    for (t, r) in rows.iter().enumerate() {
        let mut at = 0u8;
        for m in r.clone() {
            let plan = tccl::plan(&shared.spec(&members[m], ctas[t]))
                .map_err(|error| GroupError::Member { member: m, error })?;
            plans.push(plan);
            let output = if slots_needed(&members[m]) == 1 { at } else { at + 1 };
            places.push(Place { row: t, input: at, output });
            at = output + 1;
        }
    }
    let p = shared.ranks;
    let mut programs = Vec::with_capacity(p * shared.ctas as usize);
    let mut tasks = Vec::new();
    for r in 0..p {
        let mut slot_base = 0;
        for (t, row) in rows.iter().enumerate() {
            let c = ctas[t] as usize;
            for j in 0..c {
                let first = tasks.len() as u32;
                let mut barrier_ranks = 0;
                for m in row.clone() {
                    let (plan, place) = (&plans[m], places[m]);
                    let prog = plan.programs[r * c + j];
                    barrier_ranks |= prog.barrier_ranks;
                    let own = &plan.tasks[prog.first_task as usize..(prog.first_task + prog.task_count) as usize];
                    let to = |s: u8| if s == slot::INPUT { place.input } else { place.output };
                    tasks.extend(own.iter().map(|task| Task {
                        src_slot: to(task.src_slot),
                        dst_slot: to(task.dst_slot),
                        ..*task
                    }));
                }
                programs.push(TbProgram {
                    rank: r as u32,
                    cta: slot_base + j as u32,
                    first_task: first,
                    task_count: tasks.len() as u32 - first,
                    barrier_ranks,
                    table: t as u32 + 1,
                    key: 0,
                    reserved: 0,
                });
            }
            slot_base += c as u32;
        }
    }
    let lowered = Lowered {
        programs,
        tasks,
        ranks: p,
        slots: plans.iter().map(|l| l.slots).max().unwrap_or(1),
        combines: plans.iter().any(|l| l.combines),
    };
    Ok(GroupLaunch { lowered, places })
}

impl GroupLaunch {
    /// The CTAs of row `row` as a launch of their own (`table` 0): rows share no buffer, so the CPU
    /// executor runs a group launch one row at a time, each against that row's buffers.
    pub fn row(&self, row: usize) -> Lowered {
        let mut tasks = Vec::new();
        let mut programs = Vec::new();
        for p in self.lowered.programs.iter().filter(|p| p.table as usize == row + 1) {
            let first = tasks.len() as u32;
            tasks.extend_from_slice(&self.lowered.tasks[p.first_task as usize..(p.first_task + p.task_count) as usize]);
            programs.push(TbProgram { table: 0, first_task: first, ..*p });
        }
        Lowered { programs, tasks, ..self.lowered.clone() }
    }

    /// The in-place aliases of row `row`'s members (`spec` gives each member's [`PlanSpec`]), in
    /// their slots of the row.
    pub fn row_aliases(&self, row: usize, specs: &[PlanSpec]) -> Vec<Alias> {
        let mut out = Vec::new();
        for (m, place) in self.places.iter().enumerate().filter(|(_, p)| p.row == row) {
            // A member in one slot has no alias: its input is that slot.
            if place.input == place.output {
                continue;
            }
            let to = |s: u8| if s == slot::INPUT { place.input } else { place.output };
            out.extend(specs[m].aliases().into_iter().map(|(r, s, tr, ts, o)| (r, to(s), tr, to(ts), o)));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_share_the_ctas_in_proportion_at_least_one_each() {
        assert_eq!(share(16, &[1, 1, 1, 1]), vec![4, 4, 4, 4]);
        assert_eq!(share(16, &[100, 0, 0]), vec![14, 1, 1]);
        assert_eq!(share(3, &[5, 5, 5]), vec![1, 1, 1]);
        // 15 spare: 11.25 and 3.75, the larger remainder taking the last one.
        assert_eq!(share(17, &[3, 1]), vec![12, 5]);
    }

    #[test]
    fn rows_hold_four_slots_and_launches_a_row_per_cta_at_most() {
        let m = |collective, in_place| Member { collective, count: 1, in_place };
        let out = m(Collective::AllReduce, false);
        let one = m(Collective::AllReduce, true);
        let shared =
            |ctas| Shared { dtype: DType::F32, op: RedOp::Sum, ranks: 8, ctas, reduction: Reduction::Registers };
        assert_eq!(launches(&shared(16), &[out; 100]), vec![0..32, 32..64, 64..96, 96..100]);
        assert_eq!(launches(&shared(16), &[one; 100]), vec![0..64, 64..100]);
        assert_eq!(launches(&shared(1), &[out; 3]), vec![0..2, 2..3]);
        assert_eq!(launches(&shared(16), &[]), Vec::<Range<usize>>::new());
        assert_eq!(launches(&shared(64), &[out; 40]), vec![0..32, 32..40]);
        // An in-place ReduceScatter's output is inside its input at another offset per rank: two
        // slots. A row: 1 + 2, then the next member does not fit.
        let rs = m(Collective::ReduceScatter, true);
        assert_eq!(rows(&[one, rs, out, one]), vec![0..2, 2..4]);
    }

    /// A large member is not left one CTA among many small ones: the launch closes while the
    /// shares stay balanced, and the small ones go on together.
    #[test]
    fn a_large_member_keeps_its_share_of_the_ctas() {
        let shared = Shared { dtype: DType::F32, op: RedOp::Sum, ranks: 8, ctas: 16, reduction: Reduction::Registers };
        let ar = |count| Member { collective: Collective::AllReduce, count, in_place: true };
        let mut members = vec![ar(1 << 28)];
        members.extend([ar(8); 124]);
        let l = launches(&shared, &members);
        // The large member's row (it and three small ones) and eight rows of small ones: the row
        // keeps 8 of the 16 CTAs (with every small row in, it would keep 1).
        assert_eq!(l[0], 0..36, "{l:?}");
        assert_eq!(l[1..], [36..100, 100..125], "the small ones 16 rows a launch");
        for r in &l {
            let these = &members[r.clone()];
            let weights: Vec<u64> =
                rows(these).iter().map(|x| these[x.clone()].iter().map(|m| weight(&shared, m)).sum()).collect();
            assert!(balanced(16, &weights), "{r:?}: {weights:?}");
        }
    }

    #[test]
    fn every_cta_names_its_row_and_a_slot_of_its_own() {
        let shared = Shared { dtype: DType::F32, op: RedOp::Sum, ranks: 4, ctas: 8, reduction: Reduction::Registers };
        let ar = |count| Member { collective: Collective::AllReduce, count, in_place: false };
        let g = lower(&shared, &[ar(1000), ar(10), ar(3000)]).expect("lower");
        assert_eq!(g.lowered.programs.len(), 4 * 8);
        assert_eq!(g.places[1], Place { row: 0, input: 2, output: 3 });
        assert_eq!(g.places[2], Place { row: 1, input: 0, output: 1 });
        for r in 0..4 {
            let own = &g.lowered.programs[r * 8..(r + 1) * 8];
            let slots: Vec<u32> = own.iter().map(|p| p.cta).collect();
            assert_eq!(slots, (0..8).collect::<Vec<_>>());
            assert!(own.iter().all(|p| p.rank == r as u32 && (p.table == 1 || p.table == 2)));
        }
        assert!(matches!(lower(&shared, &[ar(1); 17]), Err(GroupError::Members { members: 17, rows: 9, max: 8 })));
    }
}
