//! M-to-N reshard on the engine: [`Communicator::reshard`] moves a tensor from one (mesh, placements)
//! layout to another, each destination rank receiving only the bytes it lacks.
//!
//! A call is checked without touching the device first ([`validate`]: layouts against the shape and
//! the communicator, both sides against each other, which ranks pass buffers and their lengths), then
//! against the device (buffer devices, alignment, overlaps). The plan (`oxccl_host::reshard::plan`) is
//! lowered ([`oxccl_host::reshard::lower()`]: one engine program per stage, race-checked) and uploaded
//! once per (shape, element type, layouts, options, CTAs per rank); stage 0 and then stage 1 (the
//! hierarchical route's forwarding inside domains) are launched on the ranks' streams. See
//! `docs/RESHARD.md`.

use crate::comm::{Communicator, Range, Uploaded, check_aligned, check_disjoint, ordinal_of};
use crate::error::{Error, Result};
use crate::{Element, ReduceOp};
use cudarc::driver::{DevicePtr, DevicePtrMut};
use oxccl_host::reshard::{LowerOptions, LoweredReshard, check_same_tensor, lower, plan};
use oxccl_kernels::abi::{BUFFER_SLOTS, DType, MAX_RANKS, slot};
use std::sync::Arc;

pub use oxccl_host::reshard::{
    CtaOwner, Layout, LayoutError, LowerError, Mesh, Placement, PlanOptions, ReshardError, Route,
};

/// How a reshard is planned and run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct ReshardOptions {
    /// Route, NVLink domain size and split threshold of the planner (hierarchical, 8, 256 KiB by
    /// default).
    pub plan: PlanOptions,
    /// Which side's CTAs run each copy (the reading rank's by default).
    pub owner: CtaOwner,
}

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

/// What a cached reshard is keyed by.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct PlanKey {
    shape: Vec<u64>,
    dtype: DType,
    src: Layout,
    dst: Layout,
    options: ReshardOptions,
    ctas: u32,
}

/// A lowered reshard uploaded for every launch group.
pub(crate) struct Prepared {
    /// The lowered program (stages, copy unit, buffer sizes).
    pub lowered: LoweredReshard,
    /// CTAs per rank.
    pub ctas: u32,
    /// The stages that have tasks, in launch order.
    stages: Vec<Uploaded>,
}

impl Communicator {
    /// Moves a tensor of global shape `shape` from layout `src_layout` to layout `dst_layout`.
    ///
    /// `src[r]` is rank `r`'s source shard and `dst[r]` its destination shard, each a dense row-major
    /// buffer of the rank's box (see `docs/RESHARD.md`): one entry per rank of the communicator, `None`
    /// for a rank outside that side's mesh (a rank whose shard is empty may pass `None` or an empty
    /// buffer). A rank in both meshes passes two distinct buffers (reshard is out of place). Destination
    /// buffers must not overlap any other buffer of the call; source buffers may overlap each other.
    ///
    /// Asynchronous on the ranks' streams like the collectives; [`Communicator::synchronize`] reports
    /// device-side errors. The plan is built, lowered, race-checked and uploaded on the first call with
    /// a given (shape, `T`, layouts, options) and reused after.
    ///
    /// Errors, found before anything is launched: see [`validate`]; [`Error::WrongDevice`], [`Error::Misaligned`],
    /// [`Error::Aliasing`]; [`Error::Reshard`] from the planner (for example a zero domain size);
    /// [`Error::ReshardLower`] when the plan needs more tasks than allowed; [`Error::Config`] and
    /// [`Error::TooManyCtas`] from the launch configuration; [`Error::Poisoned`] after an unreset
    /// device error. A driver error while queueing the second stage (a hierarchical route's
    /// forwarding) is returned after the first stage was queued.
    ///
    /// (`src` takes shared references and `dst` mutable ones so that one call can borrow some ranks'
    /// buffers and leave others out; `R: DevicePtr` too because a destination buffer is also read when
    /// its rank forwards it.)
    pub fn reshard<T: Element, S: DevicePtr<T>, R: DevicePtrMut<T> + DevicePtr<T>>(
        &self,
        src: &[Option<&S>],
        dst: &mut [Option<&mut R>],
        shape: &[u64],
        src_layout: &Layout,
        dst_layout: &Layout,
        options: &ReshardOptions,
    ) -> Result<()> {
        self.check_usable()?;
        let e = std::mem::size_of::<T>();
        let src_lens: Vec<Option<usize>> = src.iter().map(|b| b.map(|b| b.len())).collect();
        let dst_lens: Vec<Option<usize>> = dst.iter().map(|b| b.as_deref().map(|b| b.len())).collect();
        let side = |layout, buffers| Side { shape, elem_bytes: e as u64, layout, buffers };
        validate(self.ranks(), &side(src_layout, &src_lens), &side(dst_layout, &dst_lens))?;
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
        let prepared = self.reshard_program::<T>(shape, src_layout, dst_layout, options)?;

        // cudarc's stream-ordering guards, on each rank's stream (see the collectives), kept until every
        // launch is queued; their addresses are the ones checked and used.
        let mut guards = Vec::new();
        let mut ranges = Vec::new();
        let mut buffers = [[0u64; BUFFER_SLOTS]; MAX_RANKS];
        for (r, b) in dst.iter_mut().enumerate() {
            if let Some(b) = b {
                let len = b.len();
                let (ptr, guard) = b.device_ptr_mut(self.rank_stream(r));
                guards.push(guard);
                check_aligned(ptr, r, "reshard destination buffer", e)?;
                let (start, end, device) = (ptr, ptr + (len * e) as u64, self.rank_device(r));
                ranges.push(Range { start, end, rank: r, device, writes: true, buffer: "destination buffer" });
                buffers[r][slot::OUTPUT as usize] = ptr;
            }
        }
        for (r, b) in src.iter().enumerate() {
            if let Some(b) = b {
                let (ptr, guard) = b.device_ptr(self.rank_stream(r));
                guards.push(guard);
                check_aligned(ptr, r, "reshard source buffer", e)?;
                let (start, end, device) = (ptr, ptr + (b.len() * e) as u64, self.rank_device(r));
                ranges.push(Range { start, end, rank: r, device, writes: false, buffer: "source buffer" });
                buffers[r][slot::INPUT as usize] = ptr;
            }
        }
        check_disjoint(&ranges, "reshard source and destination buffers")?;

        // SAFETY: every buffer in the table was checked above (device, alignment, disjointness) and its
        // length is its shard's, which is what the lowered program was validated against; ranks without
        // a buffer have empty shards, which no task addresses; the buffers are borrowed for this call.
        let launched = unsafe { self.launch_prepared(&prepared, buffers) };
        drop(guards);
        // Also after a failed launch: an earlier stage's may be queued.
        let released = self.release_plan(prepared);
        launched.and(released)
    }

    /// The reshard program for a call, built on first use.
    fn reshard_program<T: Element>(
        &self,
        shape: &[u64],
        src: &Layout,
        dst: &Layout,
        options: &ReshardOptions,
    ) -> Result<Arc<Prepared>> {
        let ctas = self.ctas_per_rank();
        let key = PlanKey {
            shape: shape.to_vec(),
            dtype: T::DTYPE,
            src: src.clone(),
            dst: dst.clone(),
            options: *options,
            ctas,
        };
        let (prepared, _) = self.reshard_plans.get_or_build(key, || {
            let plan = plan(shape, std::mem::size_of::<T>() as u64, src, dst, options.plan)?;
            let opts =
                LowerOptions { owner: options.owner, dtype: Some(T::DTYPE), ..LowerOptions::new(self.ranks(), ctas) };
            let lowered = lower(&plan, &opts)?;
            lowered.check_races()?;
            // A launch that cannot run is refused before the stages are uploaded and cached.
            let launch = self.launch_spec_for(lowered.dtype, ReduceOp::Sum, 1, false)?;
            self.check_resident(&launch, ctas, 1)?;
            Ok(Arc::new(self.prepare_reshard(lowered, ctas)?))
        })?;
        Ok(prepared)
    }

    /// Uploads the stages of a lowered reshard (or workaround) that have tasks.
    pub(crate) fn prepare_reshard(&self, lowered: LoweredReshard, ctas: u32) -> Result<Prepared> {
        let stages = lowered
            .stages
            .iter()
            .filter(|l| !l.tasks.is_empty())
            .map(|l| self.upload(l.clone(), ctas))
            .collect::<Result<_>>()?;
        Ok(Prepared { lowered, ctas, stages })
    }

    /// Launches the stages of `prepared` in order on every group.
    ///
    /// # Safety
    /// `buffers[r][s]` addresses, on rank `r`'s device, a buffer of at least
    /// `prepared.lowered.buffer_bytes[r][s]` bytes wherever that is non-zero, alive and not used by other
    /// work until the launches complete.
    pub(crate) unsafe fn launch_prepared(
        &self,
        prepared: &Prepared,
        buffers: [[u64; BUFFER_SLOTS]; MAX_RANKS],
    ) -> Result<()> {
        let launch = self.launch_spec_for(prepared.lowered.dtype, ReduceOp::Sum, 1, false)?;
        self.check_resident(&launch, prepared.ctas, 1)?;
        // SAFETY: the caller's contract; each stage was validated against `buffer_bytes` when lowered.
        // Stream order runs a group's stages one after the other; across groups, a stage's start
        // barrier waits for every rank to have finished the previous stage. All stages are queued
        // under one lock: no other call's launch, nor a reset, comes between them.
        unsafe { self.launch_uploaded(&prepared.stages, &launch, buffers) }
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
    }
}
