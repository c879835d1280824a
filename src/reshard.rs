//! M-to-N reshard on the engine: [`Communicator::reshard`] moves a tensor from one (mesh, placements)
//! layout to another, each destination rank receiving only the bytes it lacks.
//!
//! A call is checked without touching the device first ([`validate`]: layouts against the shape and
//! the communicator, both sides against each other, which ranks pass buffers and their lengths;
//! [`validate_local`] where the communicator drives some ranks of the world only, as a per-rank
//! [`crate::Comm`] does), then against the device (buffer devices, alignment, overlaps). The plan
//! (`oxccl_host::reshard::plan`) is lowered ([`oxccl_host::reshard::lower()`]: one engine program per
//! stage, race-checked) and uploaded once per (shape, element type, layouts, options, CTAs per rank);
//! stage 0 and then stage 1 (the hierarchical route's forwarding inside domains) are launched on the
//! ranks' streams. Across processes, buffers peers cannot map are copied through staging memory
//! around the launches. See `docs/RESHARD.md`.

use crate::comm::{Communicator, Holders, Range, call_key, check_aligned, check_disjoint, ordinal_of};
use crate::error::{Error, Result};
use crate::peer::Out;
use crate::plain::{Plain, unit_dtype};
use crate::program::PlanKey;
use crate::{DType, Element, ReduceOp};
use cudarc::driver::{DevicePtr, DevicePtrMut};
use oxccl_host::reshard::{LowerOptions, check_same_tensor, lower, plan};
use oxccl_kernels::abi::{BUFFER_SLOTS, MAX_RANKS, slot};
use std::sync::Arc;

pub use crate::config::ReshardOptions;
pub use crate::program::Prepared;
pub use oxccl_host::reshard::{
    CtaOwner, Layout, LayoutError, LowerError, Mesh, Placement, PlanOptions, ReshardError, Route,
};

/// One side of a reshard as a caller describes it, for [`validate`].
#[derive(Clone, Copy, Debug)]
pub struct Side<'a> {
    /// The global shape.
    pub shape: &'a [u64],
    /// Bytes per element.
    pub elem_bytes: u64,
    /// The layout.
    pub layout: &'a Layout,
    /// Per rank of the communicator, the element count of the buffer it passes for this side (`None`:
    /// no buffer).
    pub buffers: &'a [Option<usize>],
}

/// Checks a reshard call on a communicator of `world` ranks without touching any device: one buffer
/// entry per rank on each side; both layouts fit the shape and stay below rank `world`
/// ([`Layout::validate_in_world`]); both sides describe one tensor ([`check_same_tensor`]); every rank of
/// a side's mesh whose shard holds data passes a buffer of exactly its shard's length
/// ([`oxccl_host::reshard::Sharding::local_len`]), a rank whose shard is empty passes an empty buffer or
/// none, and a rank outside the mesh passes none.
///
/// Errors: [`Error::BufferCount`], [`Error::Reshard`] (`Src(..)` / `Dst(..)` name the side),
/// [`Error::Length`], [`Error::MissingBuffer`], [`Error::UnexpectedBuffer`].
pub fn validate(world: usize, src: &Side<'_>, dst: &Side<'_>) -> Result<()> {
    validate_driven(world, |_| true, src, dst)
}

/// [`validate`] for a caller that drives some ranks of the world only (a per-rank [`crate::Comm`]
/// drives its own): `local` lists the world ranks it drives. The buffer lists still hold one entry
/// per rank of the world, and the layouts and the tensor are checked as [`validate`] checks them;
/// lengths and presence are checked for the local ranks only (the other ranks' callers check
/// theirs), and the entry of every other rank must be `None`.
///
/// Errors: as [`validate`]; [`Error::RemoteBuffer`] for a buffer given for a rank not in `local`.
pub fn validate_local(world: usize, local: &[usize], src: &Side<'_>, dst: &Side<'_>) -> Result<()> {
    validate_driven(world, |rank| local.contains(&rank), src, dst)
}

/// [`validate`] with the buffers of the ranks `drives` says yes to checked, every other rank's
/// entry required to be `None`.
fn validate_driven(world: usize, drives: impl Fn(usize) -> bool, src: &Side<'_>, dst: &Side<'_>) -> Result<()> {
    for (side, what) in [(src, "reshard source buffers"), (dst, "reshard destination buffers")] {
        if side.buffers.len() != world {
            return Err(Error::BufferCount { what, expected: world, got: side.buffers.len() });
        }
    }
    // Every mesh rank is a u32: a world past u32::MAX holds them all.
    let w = u32::try_from(world).unwrap_or(u32::MAX);
    let src_sharding = src
        .layout
        .validate_in_world(src.shape, w)
        .and_then(|()| src.layout.on(src.shape))
        .map_err(ReshardError::Src)?;
    dst.layout.check_not_partial().map_err(ReshardError::Dst)?;
    let dst_sharding = dst
        .layout
        .validate_in_world(dst.shape, w)
        .and_then(|()| dst.layout.on(dst.shape))
        .map_err(ReshardError::Dst)?;
    check_same_tensor(src.shape, src.elem_bytes, dst.shape, dst.elem_bytes)?;
    for (side, sharding, what) in
        [(src, &src_sharding, "reshard source buffer"), (dst, &dst_sharding, "reshard destination buffer")]
    {
        for (rank, given) in side.buffers.iter().enumerate() {
            if !drives(rank) {
                // Another caller's rank: its buffers are that caller's to pass and check.
                if given.is_some() {
                    return Err(Error::RemoteBuffer { what, rank });
                }
                continue;
            }
            let inside = sharding.mesh().contains(rank as u32);
            let expected = sharding.local_len(rank as u32);
            match *given {
                Some(_) if !inside => return Err(Error::UnexpectedBuffer { what, rank }),
                Some(got) if got as u64 != expected => {
                    return Err(Error::Length { what, rank, expected: expected as usize, got });
                }
                None if expected > 0 => return Err(Error::MissingBuffer { what, rank, elements: expected }),
                _ => {}
            }
        }
    }
    Ok(())
}

impl Communicator {
    /// Moves a tensor of global shape `shape` from layout `src_layout` to layout `dst_layout`.
    ///
    /// `src[r]` is rank `r`'s source shard and `dst[r]` its destination shard, each a dense row-major
    /// buffer of the rank's box (see `docs/RESHARD.md`): one entry per rank of the world, `None` for a
    /// rank outside that side's mesh (a rank whose shard is empty may pass `None` or an empty
    /// buffer), and `None` for every rank this communicator does not drive (their own callers pass
    /// theirs: a per-rank [`crate::Comm`] calls this with its rank's entries only, see
    /// [`crate::Comm::reshard`]). A rank in both meshes passes two distinct buffers (reshard is out of
    /// place). Destination buffers must not overlap any other buffer of the call; source buffers may
    /// overlap each other.
    ///
    /// Asynchronous on the ranks' streams like the collectives; [`Communicator::synchronize`] reports
    /// device-side errors (a rank whose peers made another reshard, or another call, gets
    /// [`Error::CallMismatch`]). The plan is built, lowered, race-checked and uploaded on the first
    /// call with a given (shape, `T`, layouts, options) and reused after. Across processes, a buffer
    /// outside this rank's exported memory (not a [`crate::SymmetricBuffer`]) is copied through
    /// staging memory: a source in before the launches, a destination out after them.
    ///
    /// Errors, found before anything is launched: see [`validate`] and [`validate_local`] (lengths
    /// and presence are checked for the ranks this communicator drives; a buffer given for another
    /// rank is [`Error::RemoteBuffer`]); [`Error::WrongDevice`], [`Error::Misaligned`],
    /// [`Error::Aliasing`]; [`Error::Reshard`] from the planner (for example a zero domain size);
    /// [`Error::ReshardLower`] when the plan needs more tasks than allowed; [`Error::Config`] and
    /// [`Error::TooManyCtas`] from the launch configuration; [`Error::Poisoned`] after an unreset
    /// device error; [`Error::PeerMemory`] or [`Error::Driver`] where staging memory cannot be had
    /// (across processes). A driver error while
    /// queueing the second stage (a hierarchical route's forwarding) is returned after the first
    /// stage was queued.
    ///
    /// (`src` takes shared references and `dst` mutable ones so that one call can borrow some ranks'
    /// buffers and leave others out; `R: DevicePtr` too because a destination buffer is also read when
    /// its rank forwards it.)
    ///
    /// A source placed `Partial` holds partial sums, which a copy cannot combine: it is refused with
    /// [`Error::Unsupported`] here; [`Communicator::reshard_reduce`] combines them.
    pub fn reshard<T: Plain, S: DevicePtr<T>, R: DevicePtrMut<T> + DevicePtr<T>>(
        &self,
        src: &[Option<&S>],
        dst: &mut [Option<&mut R>],
        shape: &[u64],
        src_layout: &Layout,
        dst_layout: &Layout,
        options: &ReshardOptions,
    ) -> Result<()> {
        if src_layout.is_partial() {
            return Err(Error::Unsupported {
                what: format!(
                    "reshard from {src_layout}, whose ranks hold partial sums: reshard copies; \
                     reshard_reduce combines partial sums (it takes an element type and an operator)"
                ),
            });
        }
        self.reshard_with(src, dst, shape, src_layout, dst_layout, (unit_dtype::<T>(), ReduceOp::Sum), options)
    }

    /// [`Communicator::reshard`] for a source whose layout may place mesh axes `Partial` (DTensor's
    /// pending sum, for example a row-parallel layer's output): every rank along those axes holds a
    /// partial value of its box, and the destination gets them combined with `op` (`Sum` for a
    /// pending sum; `Avg` divides by their count; FP8 and integer types as in
    /// [`Communicator::all_reduce`]), every destination adding them in the same order, so replicas
    /// hold the same bits. Within one NVLink domain the hierarchical route moves a reduce-scatter's
    /// bytes (to a sharded destination) or a reduce-scatter and an all-gather's (to a replicated
    /// one): see `docs/RESHARD.md`. Without `Partial` axes it is [`Communicator::reshard`].
    ///
    /// Errors: as [`Communicator::reshard`]; a destination placed `Partial` is
    /// [`Error::Reshard`] (`Dst(PartialDestination)`).
    #[allow(clippy::too_many_arguments)]
    pub fn reshard_reduce<T: Element, S: DevicePtr<T>, R: DevicePtrMut<T> + DevicePtr<T>>(
        &self,
        src: &[Option<&S>],
        dst: &mut [Option<&mut R>],
        shape: &[u64],
        src_layout: &Layout,
        dst_layout: &Layout,
        op: ReduceOp,
        options: &ReshardOptions,
    ) -> Result<()> {
        // Copies move units; sums add elements.
        let unit = if src_layout.is_partial() { (T::DTYPE, op) } else { (unit_dtype::<T>(), ReduceOp::Sum) };
        self.reshard_with(src, dst, shape, src_layout, dst_layout, unit, options)
    }

    /// A reshard whose tasks run the kernel of `(dtype, op)`: the copy unit and `Sum` for copies, the
    /// element type and the call's operator where partial sums are combined.
    #[allow(clippy::too_many_arguments)]
    fn reshard_with<T: Plain, S: DevicePtr<T>, R: DevicePtrMut<T> + DevicePtr<T>>(
        &self,
        src: &[Option<&S>],
        dst: &mut [Option<&mut R>],
        shape: &[u64],
        src_layout: &Layout,
        dst_layout: &Layout,
        (dtype, op): (DType, ReduceOp),
        options: &ReshardOptions,
    ) -> Result<()> {
        self.check_usable()?;
        let e = std::mem::size_of::<T>();
        let src_lens: Vec<Option<usize>> = src.iter().map(|b| b.map(|b| b.len())).collect();
        let dst_lens: Vec<Option<usize>> = dst.iter().map(|b| b.as_deref().map(|b| b.len())).collect();
        let side = |layout, buffers| Side { shape, elem_bytes: e as u64, layout, buffers };
        let (src_side, dst_side) = (side(src_layout, &src_lens), side(dst_layout, &dst_lens));
        // The world ranks this communicator drives: every rank (the all-ranks API, where this is
        // `validate`), or one (a per-rank `Comm`).
        let local = self.holding(Holders::All);
        validate_local(self.ranks(), &local, &src_side, &dst_side)?;
        // From here every `Some` entry is a local rank's (checked above): the lookups of its stream
        // and device below find it.
        // Devices first: cudarc's ordering guards below are taken only on buffers of the rank's own
        // device.
        for (r, b) in src.iter().enumerate() {
            if let Some(b) = b {
                self.check_placement(b.len(), ordinal_of(*b), r, None, "reshard source buffer")?;
            }
        }
        for (r, b) in dst.iter().enumerate() {
            if let Some(b) = b {
                self.check_placement(b.len(), ordinal_of(&**b), r, None, "reshard destination buffer")?;
            }
        }

        // The program needs no address: it fails, if at all, before a guard is taken.
        let prepared = self.reshard_program(shape, e as u64, (dtype, op), src_layout, dst_layout, options)?;

        // cudarc's stream-ordering guards, on each rank's stream (see the collectives), kept until every
        // launch is queued; their addresses are the ones checked and used.
        let mut guards = Vec::new();
        let mut ranges = Vec::new();
        // (rank, address, bytes) of every destination and source buffer given.
        let mut outs: Vec<(usize, u64, usize)> = Vec::new();
        let mut ins: Vec<(usize, u64, usize)> = Vec::new();
        for (r, b) in dst.iter_mut().enumerate() {
            if let Some(b) = b {
                let len = b.len();
                let (ptr, guard) = b.device_ptr_mut(self.rank_stream(r));
                guards.push(guard);
                check_aligned(ptr, r, "reshard destination buffer", dtype.size())?;
                let (start, end, device) = (ptr, ptr + (len * e) as u64, self.rank_device(r));
                ranges.push(Range { start, end, rank: r, device, writes: true, buffer: "destination buffer" });
                outs.push((r, ptr, len * e));
            }
        }
        for (r, b) in src.iter().enumerate() {
            if let Some(b) = b {
                let (ptr, guard) = b.device_ptr(self.rank_stream(r));
                guards.push(guard);
                check_aligned(ptr, r, "reshard source buffer", dtype.size())?;
                let (start, end, device) = (ptr, ptr + (b.len() * e) as u64, self.rank_device(r));
                ranges.push(Range { start, end, rank: r, device, writes: false, buffer: "source buffer" });
                ins.push((r, ptr, b.len() * e));
            }
        }
        check_disjoint(&ranges, "reshard source and destination buffers")?;

        // Across processes, peers reach a buffer outside this rank's exported memory through staging
        // memory (see the collectives): sources copied in before the first stage, destinations out
        // after the last. A destination is written (never copied in: the plan writes every byte of
        // it) and, on the hierarchical route, read back by the second stage's forwarding, which runs
        // between the two copies and so reads the staged bytes the first stage wrote.
        let mut staging = None;
        if let Some(link) = &self.link
            && link.peer.is_some()
        {
            let staged_ins: Vec<(u64, usize)> = ins.iter().map(|&(_, p, bytes)| (p, bytes)).collect();
            let staged_outs: Vec<Out> =
                outs.iter().map(|&(_, ptr, bytes)| Out { ptr, bytes, written: true, read: false }).collect();
            staging = Some(link.stage(&staged_ins, &staged_outs)?);
        }
        if let Some(st) = &staging {
            for ((_, p, _), sub) in ins.iter_mut().zip(&st.inputs) {
                *p = *sub;
            }
            for ((_, p, _), sub) in outs.iter_mut().zip(&st.outputs) {
                *p = *sub;
            }
        }
        let mut buffers = [[0u64; BUFFER_SLOTS]; MAX_RANKS];
        for &(r, ptr, _) in &outs {
            buffers[r][slot::OUTPUT as usize] = ptr;
        }
        for &(r, ptr, _) in &ins {
            buffers[r][slot::INPUT as usize] = ptr;
        }

        // Where anything is staged, the communicator drives one rank: its stream.
        let stream = local.first().map(|&r| &**self.rank_stream(r));
        let launched = crate::peer::Staging::around(staging.as_ref(), stream, || {
            // SAFETY: every buffer in the table was checked above (device, alignment, disjointness)
            // and its length is its shard's, which is what the lowered program was validated
            // against; ranks without a buffer here have empty shards, which no task addresses, or
            // are driven by other callers, whose launches announce their own buffers at the start
            // barrier; the buffers are borrowed for this call, and staged addresses are this rank's
            // staging memory, held (by `staging`) until the call is queued.
            unsafe { self.launch_prepared(&prepared, buffers) }
        });
        drop(staging);
        drop(guards);
        // Also after a failed launch: an earlier stage's may be queued.
        let released = self.release_plan(prepared);
        launched.and(released)
    }

    /// The reshard program for a call on `elem_bytes`-byte elements moved in units of `dtype` (whose
    /// partial sums, if any, combine with `op`), built on first use.
    fn reshard_program(
        &self,
        shape: &[u64],
        elem_bytes: u64,
        (dtype, op): (DType, ReduceOp),
        src: &Layout,
        dst: &Layout,
        options: &ReshardOptions,
    ) -> Result<Arc<Prepared>> {
        let ctas = self.ctas_per_rank();
        let key = PlanKey {
            shape: shape.to_vec(),
            elem_bytes,
            dtype,
            op,
            src: src.clone(),
            dst: dst.clone(),
            options: *options,
            ctas,
        };
        let announced = call_key(&key);
        let (prepared, _) = self.reshard_plans.get_or_build(key, || {
            let plan = plan(shape, elem_bytes, src, dst, options.plan)?;
            let opts =
                LowerOptions { owner: options.owner, dtype: Some(dtype), op, ..LowerOptions::new(self.ranks(), ctas) };
            let lowered = lower(&plan, &opts)?;
            lowered.check_races().map_err(LowerError::from)?;
            // A launch that cannot run is refused before the stages are uploaded and cached.
            let launch = self.staged_launch(&lowered)?;
            self.check_resident(&launch, ctas, lowered.slots())?;
            Ok(Arc::new(Prepared { call_key: announced, ..self.prepare_staged(lowered, ctas)? }))
        })?;
        Ok(prepared)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(mesh: &str, placements: &str) -> Layout {
        Layout::parse(mesh, placements).unwrap()
    }

    /// TP4 rows of a [4, 8] tensor on ranks 0..4 → TP2 × DP2 on ranks 4..8, on a communicator of 8.
    fn check(src: &[Option<usize>], dst: &[Option<usize>]) -> Result<()> {
        let (s, d) = (layout("4@0", "S0"), layout("2x2@4", "R,S0"));
        validate(
            8,
            &Side { shape: &[4, 8], elem_bytes: 4, layout: &s, buffers: src },
            &Side { shape: &[4, 8], elem_bytes: 4, layout: &d, buffers: dst },
        )
    }

    const SRC: [Option<usize>; 8] = [Some(8), Some(8), Some(8), Some(8), None, None, None, None];
    const DST: [Option<usize>; 8] = [None, None, None, None, Some(16), Some(16), Some(16), Some(16)];

    #[test]
    fn a_correct_call_passes() {
        check(&SRC, &DST).unwrap();
    }

    #[test]
    fn buffer_counts_lengths_and_presence_are_typed() {
        assert!(matches!(
            check(&SRC[..7], &DST),
            Err(Error::BufferCount { what: "reshard source buffers", expected: 8, got: 7 })
        ));
        assert!(matches!(
            check(&SRC, &[None; 9]),
            Err(Error::BufferCount { what: "reshard destination buffers", expected: 8, got: 9 })
        ));
        let mut src = SRC;
        src[2] = Some(9);
        assert!(matches!(
            check(&src, &DST),
            Err(Error::Length { what: "reshard source buffer", rank: 2, expected: 8, got: 9 })
        ));
        let mut dst = DST;
        dst[5] = None;
        let e = check(&SRC, &dst).unwrap_err();
        assert!(matches!(e, Error::MissingBuffer { what: "reshard destination buffer", rank: 5, elements: 16 }));
        assert_eq!(e.to_string(), "reshard destination buffer of rank 5 is missing: its shard has 16 elements");
        let mut dst = DST;
        dst[0] = Some(16);
        assert!(matches!(
            check(&SRC, &dst),
            Err(Error::UnexpectedBuffer { what: "reshard destination buffer", rank: 0 })
        ));
        let mut src = SRC;
        src[7] = Some(0);
        assert!(matches!(check(&src, &DST), Err(Error::UnexpectedBuffer { what: "reshard source buffer", rank: 7 })));
    }

    #[test]
    fn empty_shards_may_pass_nothing_or_an_empty_buffer() {
        // 3 rows on 4 ranks: rank 3's shard is empty.
        let (s, d) = (layout("4@0", "S0"), layout("1@4", "R"));
        let call = |r3: Option<usize>| {
            let src = [Some(8), Some(8), Some(8), r3, None];
            let dst = [None, None, None, None, Some(24)];
            validate(
                5,
                &Side { shape: &[3, 8], elem_bytes: 2, layout: &s, buffers: &src },
                &Side { shape: &[3, 8], elem_bytes: 2, layout: &d, buffers: &dst },
            )
        };
        call(None).unwrap();
        call(Some(0)).unwrap();
        assert!(matches!(call(Some(8)), Err(Error::Length { rank: 3, expected: 0, got: 8, .. })));
    }

    /// `check`'s call through [`validate_local`], for a caller driving the world ranks `local` only.
    fn check_local(local: &[usize], src: &[Option<usize>], dst: &[Option<usize>]) -> Result<()> {
        let (s, d) = (layout("4@0", "S0"), layout("2x2@4", "R,S0"));
        validate_local(
            8,
            local,
            &Side { shape: &[4, 8], elem_bytes: 4, layout: &s, buffers: src },
            &Side { shape: &[4, 8], elem_bytes: 4, layout: &d, buffers: dst },
        )
    }

    /// `SRC` / `DST` with the entries of ranks outside `local` left `None`, as a per-rank caller passes them.
    fn only(local: &[usize], all: &[Option<usize>]) -> Vec<Option<usize>> {
        all.iter().enumerate().map(|(r, b)| if local.contains(&r) { *b } else { None }).collect()
    }

    #[test]
    fn each_rank_alone_passes_its_own_buffers() {
        for rank in 0..8 {
            let local = [rank];
            check_local(&local, &only(&local, &SRC), &only(&local, &DST))
                .unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        }
        // Any subset, and every rank (where it is `validate`).
        let some = [1, 4, 6];
        check_local(&some, &only(&some, &SRC), &only(&some, &DST)).unwrap();
        let all: Vec<usize> = (0..8).collect();
        check_local(&all, &SRC, &DST).unwrap();
        // No rank at all: only the layouts and the lists' lengths are checked.
        check_local(&[], &[None; 8], &[None; 8]).unwrap();
    }

    #[test]
    fn a_buffer_given_for_a_rank_driven_elsewhere_is_typed() {
        // Rank 5's communicator given rank 4's destination (which rank 4's own caller passes).
        let mut dst = only(&[5], &DST);
        dst[4] = Some(16);
        let e = check_local(&[5], &only(&[5], &SRC), &dst).unwrap_err();
        assert!(matches!(e, Error::RemoteBuffer { what: "reshard destination buffer", rank: 4 }), "{e}");
        assert_eq!(
            e.to_string(),
            "reshard destination buffer given for rank 4, which this communicator does not drive (that rank's own \
             caller passes it; pass None)"
        );
        // Also a buffer the rank's own caller would have been refused (outside the mesh): this caller
        // does not drive it either way.
        let mut src = only(&[0], &SRC);
        src[7] = Some(0);
        let e = check_local(&[0], &src, &only(&[0], &DST)).unwrap_err();
        assert!(matches!(e, Error::RemoteBuffer { what: "reshard source buffer", rank: 7 }), "{e}");
        // Every rank of the world is local: the all-ranks errors, as `validate` gives them.
        let all: Vec<usize> = (0..8).collect();
        let mut src = SRC;
        src[7] = Some(0);
        assert!(matches!(
            check_local(&all, &src, &DST),
            Err(Error::UnexpectedBuffer { what: "reshard source buffer", rank: 7 })
        ));
    }

    #[test]
    fn the_local_ranks_buffers_are_checked_as_before() {
        let local = [2, 5];
        let (src, dst) = (only(&local, &SRC), only(&local, &DST));
        let mut short = src.clone();
        short[2] = Some(7);
        assert!(matches!(
            check_local(&local, &short, &dst),
            Err(Error::Length { what: "reshard source buffer", rank: 2, expected: 8, got: 7 })
        ));
        let mut missing = dst.clone();
        missing[5] = None;
        assert!(matches!(
            check_local(&local, &src, &missing),
            Err(Error::MissingBuffer { what: "reshard destination buffer", rank: 5, elements: 16 })
        ));
        let mut outside = dst.clone();
        outside[2] = Some(16);
        assert!(matches!(
            check_local(&local, &src, &outside),
            Err(Error::UnexpectedBuffer { what: "reshard destination buffer", rank: 2 })
        ));
        // The lists still hold one entry per rank of the world, and the layouts are checked whole.
        assert!(matches!(
            check_local(&local, &src[..2], &dst),
            Err(Error::BufferCount { what: "reshard source buffers", expected: 8, got: 2 })
        ));
        let (s, wide) = (layout("4@0", "S0"), layout("2x2@6", "R,S0"));
        let e = validate_local(
            8,
            &[0],
            &Side { shape: &[4, 8], elem_bytes: 4, layout: &s, buffers: &only(&[0], &SRC) },
            &Side { shape: &[4, 8], elem_bytes: 4, layout: &wide, buffers: &[None; 8] },
        )
        .unwrap_err();
        assert!(matches!(
            e,
            Error::Reshard(ReshardError::Dst(LayoutError::RankOutOfRange { last_rank: 9, world_size: 8 }))
        ));
    }

    /// Where every rank is local, `validate_local` is `validate`: the same result on every call of a
    /// sweep over lengths, presence and extra entries.
    #[test]
    fn every_rank_local_is_validate() {
        let all: Vec<usize> = (0..8).collect();
        let choices = [None, Some(0), Some(8), Some(16)];
        for r in 0..8 {
            for (side, c) in [0, 1].into_iter().flat_map(|side| choices.iter().map(move |c| (side, *c))) {
                let (mut src, mut dst) = (SRC, DST);
                if side == 0 {
                    src[r] = c;
                } else {
                    dst[r] = c;
                }
                let a = check(&src, &dst).map_err(|e| e.to_string());
                let b = check_local(&all, &src, &dst).map_err(|e| e.to_string());
                assert_eq!(a, b, "rank {r} side {side} entry {c:?}");
            }
        }
    }

    #[test]
    fn layouts_are_checked_against_the_shape_the_world_and_each_other() {
        let (ok, bad, wide) = (layout("4@0", "S0"), layout("4@0", "S2"), layout("2x2@2", "R,S0"));
        fn side<'a>(shape: &'a [u64], elem_bytes: u64, layout: &'a Layout) -> Side<'a> {
            Side { shape, elem_bytes, layout, buffers: &[None; 4] }
        }
        let e = validate(4, &side(&[4, 8], 4, &bad), &side(&[4, 8], 4, &ok)).unwrap_err();
        assert!(matches!(
            e,
            Error::Reshard(ReshardError::Src(LayoutError::ShardDimOutOfRange { axis: 0, dim: 2, tensor_rank: 2 }))
        ));
        assert_eq!(e.to_string(), "reshard: source layout: mesh axis 0 shards tensor dim 2 but the tensor has 2 dims");
        let e = validate(4, &side(&[4, 8], 4, &ok), &side(&[4, 8], 4, &wide)).unwrap_err();
        assert!(matches!(
            e,
            Error::Reshard(ReshardError::Dst(LayoutError::RankOutOfRange { last_rank: 5, world_size: 4 }))
        ));
        let e = validate(4, &side(&[4, 8], 4, &ok), &side(&[8, 4], 4, &ok)).unwrap_err();
        assert!(matches!(e, Error::Reshard(ReshardError::GlobalShapeMismatch { .. })));
        let e = validate(4, &side(&[4, 8], 4, &ok), &side(&[4, 8], 2, &ok)).unwrap_err();
        assert!(matches!(e, Error::Reshard(ReshardError::ElementSizeMismatch { src: 4, dst: 2 })));
        // Partial sums are for sources: a destination holds values.
        let partial = layout("4@0", "P");
        let e = validate(4, &side(&[4, 8], 4, &ok), &side(&[4, 8], 4, &partial)).unwrap_err();
        assert!(matches!(e, Error::Reshard(ReshardError::Dst(LayoutError::PartialDestination { axis: 0 }))));
        // As a source it passes the layout checks (and reaches the buffers' own).
        let e = validate(4, &side(&[4, 8], 4, &partial), &side(&[4, 8], 4, &ok)).unwrap_err();
        assert!(matches!(e, Error::MissingBuffer { rank: 0, elements: 32, .. }), "{e}");
    }
}
