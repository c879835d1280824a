//! Grouped collectives of a per-rank communicator: the launches behind the collectives of a
//! [`crate::Group`] (`oxccl_host::group` plans them).

use super::{Communicator, Range, call_key, check_aligned, check_disjoint};
use crate::engine::LaunchSpec;
use crate::error::{Error, Result};
use crate::peer::Out;
use crate::program::Uploaded;
use crate::{DType, ReduceOp};
use oxccl_host::group::{self, GroupLaunch, Member, Shared};
use oxccl_kernels::abi::{BUFFER_SLOTS, MAX_RANKS};
use std::sync::Arc;

/// One collective of a group, as the calling rank sees it: its buffers' device addresses (`input`
/// 0 in place, or where the rank has none) and element type.
#[derive(Clone, Copy, Debug)]
pub(crate) struct GroupCall {
    pub member: Member,
    pub dtype: DType,
    pub op: ReduceOp,
    pub input: u64,
    pub output: u64,
    /// Element size of the buffers' type (their alignment is checked against it).
    pub align: usize,
}

/// What a group launch's cached plan is keyed by.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct GroupKey {
    shared: Shared,
    members: Vec<Member>,
}

impl Communicator {
    /// Queues the collectives `calls` of this communicator's one rank: those of one element type
    /// and operator together, in as few launches as the buffer table holds (`group::launches`).
    /// Every rank must make the same calls in the same order (else [`Error::CallMismatch`]).
    pub(crate) fn grouped(&self, calls: &[GroupCall]) -> Result<()> {
        self.check_usable()?;
        let [rank] = self.ranks.as_slice() else {
            return Err(Error::Unsupported {
                what: "grouped collectives on a communicator that drives several ranks (use a per-rank Comm)".into(),
            });
        };
        let me = rank.index;
        let world = self.ranks();
        // Arguments first (lengths were checked by the caller against the counts it derived).
        let ranges = call_ranges(calls, world, me, rank.device)?;
        check_disjoint(&ranges, "a group's buffers")?;

        // Launches per (element type, operator), members in call order; plans before anything is
        // queued.
        // (call index, call) per class: errors name the call as the caller numbered it.
        let mut classes: Vec<(Shared, Vec<(usize, &GroupCall)>)> = Vec::new();
        for (i, c) in calls.iter().enumerate() {
            let shared = self.shared(c);
            match classes.iter_mut().find(|(s, _)| *s == shared) {
                Some((_, v)) => v.push((i, c)),
                None => classes.push((shared, vec![(i, c)])),
            }
        }
        let mut launches = Vec::new();
        for (shared, members) in &classes {
            let specs: Vec<Member> = members.iter().map(|(_, c)| c.member).collect();
            let ranges = group::launches(shared, &specs);
            let count = ranges.len();
            for (i, range) in ranges.into_iter().enumerate() {
                let indices: Vec<usize> = members[range.clone()].iter().map(|&(i, _)| i).collect();
                let these: Vec<&GroupCall> = members[range].iter().map(|&(_, c)| c).collect();
                let (plan, mut launch) = self.group_plan(shared, &these, &indices)?;
                // Which launch of how many of a class of how many members: groups that differ only
                // in their length stop at the start barrier of a launch they share, instead of one
                // rank's extra launch waiting for a peer that never makes it.
                launch.call_key = call_key(&(launch.call_key, i, count, specs.len()));
                launches.push((these, plan, launch));
            }
        }
        let mut result = Ok(());
        for (these, (plan, layout), launch) in launches {
            result = self.launch_group(me, &these, &plan, &layout, &launch);
            let released = self.release_plan(plan);
            result = result.and(released);
            if result.is_err() {
                break;
            }
        }
        result
    }

    /// What the members of `c`'s launch share.
    fn shared(&self, c: &GroupCall) -> Shared {
        let reduces = c.member.collective.reduces();
        Shared {
            dtype: c.dtype,
            op: if reduces { c.op } else { ReduceOp::Sum },
            ranks: self.ranks(),
            ctas: self.ctas_per_rank(),
            reduction: self.config.reduction,
        }
    }

    /// The plan of one launch of `calls` (built, checked and uploaded on first use) and where its
    /// members' buffers go; `indices` numbers the calls as the caller queued them.
    #[allow(clippy::type_complexity)]
    fn group_plan(
        &self,
        shared: &Shared,
        calls: &[&GroupCall],
        indices: &[usize],
    ) -> Result<((Arc<Uploaded>, Arc<GroupLaunch>), LaunchSpec)> {
        let key = GroupKey { shared: *shared, members: calls.iter().map(|c| c.member).collect() };
        let (built, _) = self.group_plans.get_or_build(key.clone(), || {
            let g = group::lower(shared, &key.members).map_err(|e| match e {
                group::GroupError::Member { member, error } => Error::Config {
                    field: "grouped collectives",
                    why: format!("call {} of the group: {error}", indices[member]),
                },
                e => Error::Config { field: "grouped collectives", why: e.to_string() },
            })?;
            let (slots, combines) = (g.lowered.slots, g.lowered.combines);
            // The launch shape of the first member's collective, with the combining ring only where
            // every member would take it.
            let first = shared.spec(&key.members[0], shared.ctas);
            let mut launch = self.launch_spec(&first, slots, combines)?;
            if key.members.iter().any(|m| m.collective != first.collective) {
                launch = self.launch_spec_for(shared.dtype, shared.op, slots, combines)?;
            }
            launch.call_key = call_key(&key);
            self.check_resident(&launch, shared.ctas, slots)?;
            let uploaded = self.upload(g.lowered.clone(), shared.ctas)?;
            Ok(((Arc::new(uploaded), Arc::new(g)), launch))
        })?;
        Ok(built)
    }

    /// Queues one launch: each member's buffers in its row and slots, staged where peers in other
    /// processes cannot reach them.
    fn launch_group(
        &self,
        me: usize,
        calls: &[&GroupCall],
        plan: &Uploaded,
        layout: &GroupLaunch,
        launch: &LaunchSpec,
    ) -> Result<()> {
        // Each member's (input, output) addresses in this rank's table, in-place aliases resolved.
        let mut at: Vec<(u64, u64)> =
            calls.iter().map(|c| self.shared(c).spec(&c.member, 1).slot_addresses(me, c.input, c.output)).collect();
        let mut staging = None;
        if let Some(link) = &self.link
            && link.peer.is_some()
        {
            // In place, the one buffer is staged as an output read first; its input alias is an
            // offset into it.
            let mut ins = Vec::new();
            let mut outs = Vec::new();
            for (c, &(i, _)) in calls.iter().zip(&at) {
                let spec = self.shared(c).spec(&c.member, 1);
                let (in_bytes, out_bytes) = spec.buffer_bytes();
                let (has_in, has_out) = spec.rank_buffers(me);
                if c.member.in_place {
                    let bytes = in_bytes.max(out_bytes) as usize;
                    outs.push(Out { ptr: c.output, bytes, written: spec.writes(me), read: true });
                } else {
                    ins.push((if has_in { i } else { 0 }, if has_in { in_bytes as usize } else { 0 }));
                    let bytes = if has_out { out_bytes as usize } else { 0 };
                    outs.push(Out { ptr: if has_out { c.output } else { 0 }, bytes, written: true, read: false });
                }
            }
            let st = link.stage(&ins, &outs)?;
            let (mut i, mut o) = (st.inputs.iter(), st.outputs.iter());
            for (c, a) in calls.iter().zip(at.iter_mut()) {
                let out = *o.next().expect("one staged address per output");
                if c.member.in_place {
                    // The aliases keep their offsets into the staged buffer.
                    *a = (out + (a.0 - c.output), out + (a.1 - c.output));
                } else {
                    *a = (*i.next().expect("one staged address per input"), out);
                }
            }
            staging = Some(st);
        }
        let mut buffers = [[0u64; BUFFER_SLOTS]; MAX_RANKS];
        for (place, &(input, output)) in layout.places.iter().zip(&at) {
            buffers[place.row][place.input as usize] = input;
            buffers[place.row][place.output as usize] = output;
        }
        let stream = self.ranks.first().map(|r| &*r.stream);
        let launched = crate::peer::Staging::around(staging.as_ref(), stream, || {
            // SAFETY: every address is a buffer of this rank checked by the caller and `grouped`
            // (device, length, alignment, disjointness) and borrowed for the call, or this rank's
            // staging memory standing in for it, held (by `staging`) until the call is queued; each
            // member's tasks address its own lengths in its own row and slots (`group::lower`), and
            // never a slot the rank has no buffer for (`PlanSpec::rank_buffers`).
            unsafe { self.launch_uploaded([plan], launch, buffers) }
        });
        drop(staging);
        launched
    }
}

/// Checks the collectives `calls` of rank `me` of `world` on `device` (roots, alignment) and returns
/// the ranges their buffers span, for [`check_disjoint`].
pub(crate) fn call_ranges(calls: &[GroupCall], world: usize, me: usize, device: usize) -> Result<Vec<Range>> {
    let mut ranges = Vec::with_capacity(2 * calls.len());
    for c in calls {
        if let Some(root) = c.member.collective.root()
            && root >= world
        {
            return Err(Error::NoSuchRank { rank: root, ranks: world });
        }
        // The buffers' sizes and roles depend on the collective and the world only.
        let shared = Shared { dtype: c.dtype, op: c.op, ranks: world, ctas: 1, reduction: Default::default() };
        let spec = shared.spec(&c.member, 1);
        let (in_bytes, out_bytes) = spec.buffer_bytes();
        let (has_in, has_out) = spec.rank_buffers(me);
        let written = spec.writes(me);
        if c.member.in_place {
            let bytes = in_bytes.max(out_bytes);
            check_aligned(c.output, me, "buffer", c.align)?;
            ranges.push(range(c.output, bytes, me, device, written, "buffer"));
        } else {
            if has_in {
                check_aligned(c.input, me, "send buffer", c.align)?;
                ranges.push(range(c.input, in_bytes, me, device, false, "send buffer"));
            }
            if has_out {
                check_aligned(c.output, me, "receive buffer", c.align)?;
                ranges.push(range(c.output, out_bytes, me, device, true, "receive buffer"));
            }
        }
    }
    Ok(ranges)
}

fn range(start: u64, bytes: u64, rank: usize, device: usize, writes: bool, buffer: &'static str) -> Range {
    Range { start, end: start + bytes, rank, device, writes, buffer }
}
