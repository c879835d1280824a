//! A communicator's configuration ([`Config`]) and its checks, and the launch shape derived from it:
//! what the API validates before a call and the launcher before a launch.

use crate::error::{Error, Result};
use crate::{Collective, Mover, Reduction};
use oxccl_host::reshard::{CtaOwner, PlanOptions};
use oxccl_kernels::abi;
use std::time::Duration;

/// Tuning and policy of a communicator. `Config::default()` is a good start.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Config {
    /// CTAs per rank for a collective (`None`: as many as the device holds for all its ranks, at most
    /// 16 per rank).
    pub max_ctas: Option<u32>,
    /// The data mover.
    pub mover: Mover,
    /// How reductions run; see [`Reduction`].
    pub reduction: Reduction,
    /// Results bitwise identical run to run for a given configuration. Requires
    /// `Reduction::Registers` (the hardware bulk reduction does not fix the order between sources).
    pub deterministic: bool,
    /// Bytes per source per pipeline stage (TMA mover; `None`: see
    /// [`auto_pipeline`], which also gives a fixed chunk as many stages, up to
    /// four, as fit in shared memory, or, where every combine stores from registers on one device,
    /// [`combining_pipeline`]; launches with several issuers: see `issuers`).
    pub chunk_bytes: Option<u32>,
    /// Pipeline stages (TMA mover; `None`: see [`auto_pipeline`] and
    /// [`combining_pipeline`]; launches with several issuers: see `issuers`).
    /// Given without `chunk_bytes` where the combining ring applies, the stages get the largest chunk
    /// that fits (not capped at 32 KiB): to bound the shared memory a CTA takes, give `chunk_bytes`.
    pub stages: Option<u32>,
    /// Threads per CTA (`None`: one warp per issuer for a TMA CTA that only copies and bulk-reduces
    /// (see `issuers`), 256 when it
    /// combines sources in registers or reduces element by element, 512 for the SIMT mover). A
    /// one-warp CTA leaves its SM to kernels running beside it, but its single issuing thread then
    /// competes with their warps and slows (docs/PERF.md); more threads keep it from sharing the SM.
    pub threads: Option<u32>,
    /// Every device-side wait gives up after this long and the call reports [`Error::Timeout`] (the
    /// drain of bulk loads already issued when a wait gave up is bounded by at least a second, and a
    /// load that never lands traps the launch rather than write into shared memory later). A launch
    /// that gave up can take a few timeouts to end: each wait is bounded, and a rank that gives up
    /// waits up to twice the timeout (at least a second) for each peer already running the call.
    pub timeout: Duration,
    /// Suspend-time hint for device waits, in nanoseconds (0: spin). Non-zero values take fewer issue
    /// slots from kernels running beside the collective.
    pub wait_suspend_ns: u32,
    /// Issuing warps per TMA CTA for calls that only copy and bulk-reduce (AllGather, Broadcast,
    /// reshards, and AllReduce / ReduceScatter / Reduce with `Reduction::Tma`; at most 4, one per SM
    /// scheduler): each streams every W-th chunk through its own `stages / W` stages. Given: with the stages given
    /// (a multiple of W), or as many multiples of W as a given chunk leaves room for (two each at
    /// most, one each at least), or two each in the shared memory one issuer's default pipeline
    /// takes. `None`: the ring one issuer would get (stages and chunk as given, else
    /// [`auto_pipeline`]'s) split among [`DEFAULT_ISSUERS`] or 2 where each
    /// keeps two stages and given threads hold their warps, else one; with neither stages nor chunk
    /// given, 8 stages of 16 KiB among 4. Beside one 256-thread compute CTA per SM four keep a copy
    /// at its speed alone where a lone issuer loses a quarter of its speed; beside compute that
    /// keeps every scheduler busy both are starved (docs/PERF.md). Alone they cost at most 1.5 %.
    /// Calls that combine sources in registers always use one.
    pub issuers: Option<u32>,
    /// How a TMA call that combines sources into several destinations (AllReduce with
    /// `Reduction::Registers`) writes the result: `Some(false)` one copy in shared memory,
    /// bulk-stored to every rank; `Some(true)` the combining threads store it from registers to every
    /// rank, as combines into one destination (ReduceScatter) always do. `None` (default): from
    /// registers where the call puts at most [`COMBINE_DIRECT_MAX_CTAS`] CTAs on any one device
    /// (docs/PERF.md: on one H200 +15-52 % there with 2, 4 and 8 virtual ranks, and at 64 CTAs
    /// -10 % / -9 % with 8 / 4 ranks, +3 % with 2; on four H200s, one rank each, +24 % at 4 CTAs,
    /// -2 % at 8, +4 % at 16). Ignored by the SIMT mover.
    pub combine_direct: Option<bool>,
    /// Ranks per node, in rank order (`None`: the ranks on one host form a node). Ranks on
    /// several nodes run [`crate::Comm::all_reduce`] staged: oxccl inside each node, NCCL between
    /// the ranks of one local index. A value below the ranks per host makes one host pose as
    /// several nodes.
    pub ranks_per_node: Option<u32>,
    /// Bytes per piece of a staged collective across nodes (`None`: 64 MiB): the inter-node step
    /// of one piece runs beside the intra-node steps of the next.
    pub inter_piece_bytes: Option<u64>,
    /// A launch whose every task moves fewer than this many bytes runs on [`Mover::Latency`]
    /// whatever `mover` says: a small move is bound by the round trips to memory, which that
    /// mover's loads of all sources in flight together cut (0: never). Default
    /// [`DEFAULT_LATENCY_BELOW`].
    pub latency_below: u64,
    /// Staging memory a per-rank communicator whose ranks are processes makes and shares at setup,
    /// for the buffers its peers cannot map (cudarc's allocations), in bytes (rounded up to the
    /// allocation granularity; 0: none until a call needs it). A call that stages more grows it,
    /// and every peer then maps the new memory during that call. Default [`DEFAULT_STAGING_BYTES`].
    pub staging_bytes: u64,
}

/// [`Config::staging_bytes`]'s default: one allocation granule (2 MiB on Hopper), what any size of
/// virtual-memory allocation takes anyway.
pub const DEFAULT_STAGING_BYTES: u64 = 2 << 20;

/// [`Config::latency_below`]'s default: where the latency mover stops being faster than the TMA
/// mover's default launch (docs/PERF.md).
pub const DEFAULT_LATENCY_BELOW: u64 = 16 << 10;

impl Default for Config {
    fn default() -> Self {
        Config {
            max_ctas: None,
            mover: Mover::Tma,
            reduction: Reduction::Registers,
            deterministic: true,
            chunk_bytes: None,
            stages: None,
            threads: None,
            timeout: Duration::from_secs(10),
            wait_suspend_ns: 0,
            issuers: None,
            combine_direct: None,
            ranks_per_node: None,
            inter_piece_bytes: None,
            latency_below: DEFAULT_LATENCY_BELOW,
            staging_bytes: DEFAULT_STAGING_BYTES,
        }
    }
}

/// A `field` error unless `threads` is a multiple of 32 in `32..=most` (a CTA of whole warps the
/// kernels are compiled for).
pub fn check_threads(field: &'static str, threads: u32, most: u32) -> Result<()> {
    if threads == 0 || !threads.is_multiple_of(32) || threads > most {
        return Err(Error::Config { field, why: format!("{threads} is not a multiple of 32 in 32..={most}") });
    }
    Ok(())
}

/// A `field` error unless `bytes` is a positive multiple of 16 (a bulk copy's size and alignment).
pub fn check_chunk_bytes(field: &'static str, bytes: u32) -> Result<()> {
    if bytes == 0 || !bytes.is_multiple_of(16) {
        return Err(Error::Config { field, why: format!("{bytes} is not a positive multiple of 16") });
    }
    Ok(())
}

/// A `field` error unless `stages` is in `1..=MAX_STAGES` (the mbarriers shared memory holds).
pub fn check_stages(field: &'static str, stages: u32) -> Result<()> {
    if stages == 0 || stages as usize > abi::MAX_STAGES {
        return Err(Error::Config { field, why: format!("{stages} is not in 1..={}", abi::MAX_STAGES) });
    }
    Ok(())
}

/// Every field of `c` in range and the fields consistent with each other, or the first
/// [`Error::Config`] naming the field.
pub fn validate_config(c: &Config) -> Result<()> {
    if c.deterministic && c.reduction == Reduction::Tma {
        return Err(Error::Config {
            field: "deterministic",
            why: "the hardware bulk reduction does not fix the order between sources; use Reduction::Registers".into(),
        });
    }
    if let Some(0) = c.max_ctas {
        return Err(Error::Config { field: "max_ctas", why: "must be at least 1".into() });
    }
    if let Some(st) = c.stages {
        check_stages("stages", st)?;
    }
    check_timeout(c.timeout)?;
    if let Some(m) = c.max_ctas
        && m as usize > abi::MAX_CTAS_PER_RANK
    {
        return Err(Error::Config { field: "max_ctas", why: format!("{m} is above {}", abi::MAX_CTAS_PER_RANK) });
    }
    if let Some(t) = c.threads {
        check_threads("threads", t, c.mover.max_threads())?;
    }
    if let Some(w) = c.issuers {
        if !(1..=abi::MAX_ISSUERS).contains(&w) {
            return Err(Error::Config { field: "issuers", why: format!("{w} is not in 1..={}", abi::MAX_ISSUERS) });
        }
        if let Some(st) = c.stages
            && c.mover == Mover::Tma
            && !st.is_multiple_of(w)
        {
            return Err(Error::Config {
                field: "issuers",
                why: format!("{w}: the {st} stages must be a multiple (each issuer owns a share)"),
            });
        }
        if let Some(t) = c.threads
            && c.mover == Mover::Tma
            && t < 32 * w
        {
            return Err(Error::Config { field: "issuers", why: format!("{w}: {t} threads hold fewer warps") });
        }
    }
    if let Some(b) = c.chunk_bytes {
        check_chunk_bytes("chunk_bytes", b)?;
    }
    if c.ranks_per_node == Some(0) {
        return Err(Error::Config { field: "ranks_per_node", why: "must be at least 1".into() });
    }
    if c.inter_piece_bytes == Some(0) {
        return Err(Error::Config { field: "inter_piece_bytes", why: "must be at least 1".into() });
    }
    Ok(())
}

/// Issuing warps of a TMA CTA that only copies and bulk-reduces when [`Config::issuers`] is `None`:
/// one per SM scheduler.
pub const DEFAULT_ISSUERS: u32 = 4;

/// The most CTAs on one device at which a call whose combine has several destinations stores the
/// result from registers by default (`Config::combine_direct`). Measured on one H200 with 2, 4 and
/// 8 virtual ranks (docs/PERF.md), with [`combining_pipeline`]'s ring where it stores from
/// registers: faster from registers up to 32 CTAs on the device (+15-52 %), slower at 64 with 8 and 4
/// ranks (-10 %, -9 %; +3 % with 2), level at 128 (8 ranks).
pub const COMBINE_DIRECT_MAX_CTAS: u64 = 32;

/// Whether a launch of `ctas_on_device` CTAs on its busiest device stores combines with several
/// destinations from registers (`Config::combine_direct`).
pub(crate) fn combine_direct(c: &Config, ctas_on_device: u64) -> bool {
    c.combine_direct.unwrap_or(ctas_on_device <= COMBINE_DIRECT_MAX_CTAS)
}

/// Whether a call of `collective` on `devices` devices whose plan bulk-reduces or not (`bulk`,
/// `PlanSpec::bulk`) takes [`combining_pipeline`]'s
/// ring: every combine stores its result from registers (ReduceScatter and Reduce, whose combines
/// have one destination; AllReduce where `combine_direct` holds), so no bulk store reads a stage,
/// and every source is on one device. Over
/// NVLink the deeper ring of [`auto_pipeline`] keeps more loads in flight and wins at 8 CTAs (2
/// GPUs, docs/PERF.md: ReduceScatter 260.7 against 232.5 busbw, AllReduce 326.2 against 299.9).
pub(crate) fn combining_ring(bulk: bool, collective: Collective, direct: bool, devices: usize) -> bool {
    !bulk
        && devices == 1
        && match collective {
            Collective::ReduceScatter | Collective::Reduce { .. } => true,
            Collective::AllReduce => direct,
            Collective::AllGather | Collective::Broadcast { .. } | Collective::AllToAll => false,
        }
}

/// Threads, TMA pipeline and issuing warps of a launch (see [`launch_shape`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Shape {
    pub threads: u32,
    pub chunk: u32,
    pub stages: u32,
    pub issuers: u32,
}

/// The shape of a launch under `c` whose program needs `slots` slots per stage in `room` bytes of
/// shared memory and combines sources (in registers or element by element) or not. Several issuers
/// only where nothing combines; they split the ring, so each gets `stages / issuers` stages.
///
/// * Issuers given: the stages given, or as many multiples of the issuers as a given chunk leaves
///   room for (two each at most), or two each in one issuer's default shared memory.
/// * Issuers left open: the ring one issuer would get (stages and chunk as given, else
///   [`auto_pipeline`]'s), split among [`DEFAULT_ISSUERS`] or 2 where each keeps at least two stages
///   and the threads (if given) hold their warps; with neither stages nor chunk given, 8 stages of
///   one issuer's default shared memory for [`DEFAULT_ISSUERS`].
///
/// A warp per issuer unless the threads are given. A launch whose combining tasks all store from
/// registers (`from_registers`) takes [`combining_pipeline`]'s ring.
pub(crate) fn launch_shape(c: &Config, room: usize, slots: u32, combines: bool, from_registers: bool) -> Shape {
    let streams = c.mover == Mover::Tma && !combines && slots == 1;
    // One issuer's default pipeline: the shared memory several issuers share when nothing is given.
    let (one_chunk, one_stages) = auto_pipeline(room, slots, None, None);
    let split = |stages: u32| -> u32 {
        let each = (one_chunk as usize * one_stages as usize) / stages.max(1) as usize;
        chunk_grain(each).max(16)
    };
    let (issuers, chunk, stages) = match c.issuers {
        Some(w) if streams && w > 1 => {
            let stages = c.stages.unwrap_or_else(|| {
                let most = (2 * w).min(abi::MAX_STAGES as u32);
                match c.chunk_bytes {
                    Some(b) => {
                        let fit = (room / (slots.max(1) as usize * b.max(1) as usize)).min(most as usize) as u32;
                        // At least one each: a chunk too large for that is refused by the engine's
                        // shared-memory check, naming the size.
                        (fit / w * w).max(w)
                    }
                    None => most,
                }
            });
            let chunk = c.chunk_bytes.or((c.stages.is_none()).then(|| split(stages)));
            (w, chunk, Some(stages))
        }
        None if streams => {
            let fitted = |st: u32| {
                [DEFAULT_ISSUERS, 2]
                    .into_iter()
                    .find(|&w| st.is_multiple_of(w) && st / w >= 2 && c.threads.is_none_or(|t| t >= 32 * w))
                    .unwrap_or(1)
            };
            match (c.chunk_bytes, c.stages) {
                (None, None) => {
                    let st = (2 * DEFAULT_ISSUERS).min(abi::MAX_STAGES as u32);
                    let w = fitted(st);
                    if w > 1 { (w, Some(split(st)), Some(st)) } else { (1, None, None) }
                }
                (chunk, stages) => {
                    let st = stages.unwrap_or_else(|| auto_pipeline(room, slots, chunk, None).1);
                    (fitted(st), chunk, stages.or(Some(st)))
                }
            }
        }
        _ => (1, c.chunk_bytes, c.stages),
    };
    let threads = c.threads.unwrap_or(match c.mover {
        Mover::Tma if combines => 256,
        Mover::Tma => 32 * issuers,
        Mover::Simt | Mover::Latency => c.mover.max_threads(),
    });
    let (chunk, stages) = if from_registers && combines && c.mover == Mover::Tma {
        combining_pipeline(room, slots, chunk, stages)
    } else {
        auto_pipeline(room, slots, chunk, stages)
    };
    Shape { threads, chunk, stages, issuers }
}

/// Issuers the configuration asked for whose stages (one each at least, the stages left open) do
/// not fit in `room`: an `issuers` error rather than the engine's later one about the chunk.
pub(crate) fn check_issuers_fit(c: &Config, shape: &Shape, room: usize, slots: u32) -> Result<()> {
    let Shape { chunk, stages, issuers, .. } = *shape;
    // Saturating: `slots` comes from the caller of `launch_spec_for`, and a product past usize is
    // as much "does not fit" as any other.
    let need = (stages as usize).saturating_mul(slots.max(1) as usize).saturating_mul(chunk as usize);
    if issuers > 1 && c.issuers.is_some() && c.stages.is_none() && need > room {
        return Err(Error::Config {
            field: "issuers",
            why: format!(
                "{issuers} issuers need a stage each at least: {stages} stages of {chunk} B are {need} B of shared \
                 memory, {room} B are available (give a smaller chunk_bytes or fewer issuers)"
            ),
        });
    }
    Ok(())
}

/// The TMA pipeline, `(chunk bytes per source, stages)`, for `slots` sources per stage in `room`
/// bytes of shared memory, filling in what the configuration leaves open.
///
/// Every bulk operation costs the SM's copy engine about a quarter of a microsecond whatever its
/// size, until it is large enough (about 24 KiB) to run at the SM's bandwidth instead; and the depth
/// of the ring beyond two loads in flight buys nothing (docs/PERF.md, 2026-11-29). So chunks come
/// first: up to 32 KiB per source, with four stages while each source still gets at least 16 KiB,
/// and fewer (down to two) when many sources share a stage. A given chunk gets as many stages (up
/// to four) as fit; given stages get the largest chunk that fits. Zero stages size the chunk as one
/// and are returned as given: they, and what does not fit `room`, are left for the engine's launch
/// check to report.
pub fn auto_pipeline(room: usize, slots: u32, chunk: Option<u32>, stages: Option<u32>) -> (u32, u32) {
    const MAX_CHUNK: usize = 32 * 1024;
    const MIN_CHUNK: usize = 16 * 1024;
    let slots = slots.max(1) as usize;
    let fit =
        |stages: usize| chunk_grain((room / (stages.max(1) * slots)).min(MAX_CHUNK).min(((1usize << 20) - 1) / slots));
    match (chunk, stages) {
        (Some(b), Some(st)) => (b, st),
        (None, Some(st)) => (fit(st as usize), st),
        (Some(b), None) => (b, (room / (slots * b.max(1) as usize)).clamp(1, 4) as u32),
        (None, None) => {
            let st = (2..=4).rev().find(|&st| fit(st) as usize >= MIN_CHUNK).unwrap_or(2);
            (fit(st), st as u32)
        }
    }
}

/// The TMA pipeline, `(chunk bytes per source, stages)`, of a launch whose combining tasks all
/// store their result from registers (ReduceScatter, and AllReduce where `Config::combine_direct`
/// applies): there no bulk store reads a stage, so a stage is refilled as soon as it is combined and
/// two stages keep one stage of loads in flight while the other is combined. What costs is the
/// number of stages the threads go through (a barrier and a phase wait each) and of bulk loads, so
/// left open the pipeline is two stages of the largest chunk that fits (no 32 KiB cap; at most
/// 2^20 - 1 bytes per stage, the mbarrier's transaction count). Measured on an H200 (docs/PERF.md,
/// 2026-11-29): reduce-add per CTA 96.0 -> 107.0 GB/s at 256 threads (56 KiB against 28 KiB x 4),
/// 63.5 -> 78.7 at 64; ReduceScatter over 4 virtual ranks x 4 CTAs 211.9 -> 266.9 busbw. The
/// communicator takes it where every source is on the calling rank's device (one GPU): with a peer's
/// sources over NVLink the deeper ring of [`auto_pipeline`] keeps more loads in flight and wins at 8
/// CTAs. Given values as [`auto_pipeline`], except that given stages get the largest chunk without
/// the cap.
pub fn combining_pipeline(room: usize, slots: u32, chunk: Option<u32>, stages: Option<u32>) -> (u32, u32) {
    let per_stage = room / stages.unwrap_or(2).max(1) as usize / slots.max(1) as usize;
    let b = per_stage.min(((1usize << 20) - 1) / slots.max(1) as usize);
    match (chunk, stages) {
        (None, st) => (chunk_grain(b), st.unwrap_or(2)),
        (Some(_), _) => auto_pipeline(room, slots, chunk, stages),
    }
}

/// The largest chunk of at most `bytes`: a multiple of 1 KiB from 1 KiB, of 16 bytes below.
fn chunk_grain(bytes: usize) -> u32 {
    (if bytes >= 1024 { bytes / 1024 * 1024 } else { bytes / 16 * 16 }) as u32
}

/// A device-wait timeout in (0, [`MAX_TIMEOUT`]], or the `timeout` error.
pub fn check_timeout(t: Duration) -> Result<()> {
    if t.is_zero() || t > MAX_TIMEOUT {
        return Err(Error::Config {
            field: "timeout",
            why: format!("{t:?} is not in (0, {MAX_TIMEOUT:?}] (device waits add it to a 64-bit nanosecond clock)"),
        });
    }
    Ok(())
}

/// Longest device-side wait a configuration may ask for.
pub const MAX_TIMEOUT: Duration = Duration::from_secs(24 * 3600);

/// How a reshard is planned and run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct ReshardOptions {
    /// Route, NVLink domain size and split threshold of the planner (hierarchical, 8, 256 KiB by
    /// default).
    pub plan: PlanOptions,
    /// Which side's CTAs run each copy (the reading rank's by default).
    pub owner: CtaOwner,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Several issuers only where nothing combines (four by default), a warp and two stages each in
    /// one issuer's default shared memory; what the configuration gives is kept.
    #[test]
    fn launch_shapes_give_issuers_their_warps_and_stages() {
        let room = 227 * 1024;
        let tma = Config { mover: Mover::Tma, ..Config::default() };
        let alone = launch_shape(&Config { issuers: Some(1), ..tma }, room, 1, false, false);
        assert_eq!((alone.threads, alone.stages, alone.issuers, alone.chunk), (32, 4, 1, 32 * 1024));
        let four = launch_shape(&Config { issuers: Some(4), ..tma }, room, 1, false, false);
        assert_eq!((four.threads, four.stages, four.issuers, four.chunk), (128, 8, 4, 16 * 1024));
        assert_eq!(four.stages * four.chunk, alone.stages * alone.chunk, "the same shared memory, split");
        assert_eq!(launch_shape(&tma, room, 1, false, false), four, "four issuers by default");
        let two = launch_shape(&Config { issuers: Some(2), ..tma }, room, 1, false, false);
        assert_eq!((two.threads, two.stages, two.chunk), (64, 4, 32 * 1024));
        // Left open, the issuers split the ring one issuer would get, keeping two stages each at
        // least and a warp each in given threads: given stages or chunks keep their footprint.
        let six = launch_shape(&Config { stages: Some(6), ..tma }, room, 1, false, false);
        assert_eq!((six.issuers, six.stages, six.threads), (2, 6, 64));
        assert_eq!(launch_shape(&Config { threads: Some(64), ..tma }, room, 1, false, false).issuers, 2);
        assert_eq!(launch_shape(&Config { threads: Some(32), ..tma }, room, 1, false, false), alone);
        let twelve = launch_shape(&Config { stages: Some(12), ..tma }, room, 1, false, false);
        assert_eq!((twelve.issuers, twelve.stages, twelve.chunk), (4, 12, 18 * 1024));
        let small = launch_shape(&Config { chunk_bytes: Some(16384), ..tma }, room, 1, false, false);
        assert_eq!((small.issuers, small.stages, small.chunk), (2, 4, 16384), "one issuer's 4 stages, split");
        let large = launch_shape(&Config { chunk_bytes: Some(65536), ..tma }, room, 1, false, false);
        assert_eq!((large.issuers, large.stages), (1, 3), "three stages fit: one issuer, as before");
        assert_eq!(launch_shape(&Config { stages: Some(3), ..tma }, room, 1, false, false).issuers, 1);
        let combining = launch_shape(&Config { issuers: Some(4), ..tma }, room, 8, true, false);
        assert_eq!((combining.threads, combining.issuers), (256, 1));
        let given = launch_shape(
            &Config { issuers: Some(2), stages: Some(6), threads: Some(96), ..tma },
            room,
            1,
            false,
            false,
        );
        assert_eq!((given.threads, given.stages, given.issuers), (96, 6, 2));
        let simt = launch_shape(&Config { mover: Mover::Simt, issuers: Some(4), ..tma }, room, 1, false, false);
        assert_eq!((simt.threads, simt.issuers), (512, 1));
        // Each mover's threads up to what its kernels are compiled for.
        let latency = Config { mover: Mover::Latency, ..tma };
        assert_eq!(launch_shape(&latency, room, 1, false, false).threads, abi::LATENCY_THREADS);
        assert!(validate_config(&Config { threads: Some(256), ..latency }).is_ok());
        assert!(validate_config(&Config { threads: Some(512), ..latency }).is_err());
        assert!(validate_config(&Config { threads: Some(512), mover: Mover::Simt, ..tma }).is_ok());
        assert!(validate_config(&Config { threads: Some(1024), mover: Mover::Simt, ..tma }).is_err());
        assert!(validate_config(&Config { threads: Some(1024), ..tma }).is_ok());
        assert!(validate_config(&Config { issuers: Some(5), ..tma }).is_err());
        assert!(validate_config(&Config { issuers: Some(0), ..tma }).is_err());
        assert!(validate_config(&Config { issuers: Some(4), ..tma }).is_ok());
        assert!(validate_config(&Config { issuers: Some(4), stages: Some(6), ..tma }).is_err());
        assert!(validate_config(&Config { issuers: Some(4), threads: Some(96), ..tma }).is_err());
        // A given chunk gets the stages that fit, in multiples of the issuers.
        let big = launch_shape(&Config { issuers: Some(4), chunk_bytes: Some(32768), ..tma }, room, 1, false, false);
        assert_eq!((big.stages, big.chunk, big.issuers), (4, 32768, 4));
        let huge_config = Config { issuers: Some(4), chunk_bytes: Some(200_000), ..tma };
        let huge = launch_shape(&huge_config, room, 1, false, false);
        assert_eq!(huge.stages, 4, "at least one stage per issuer");
        let err = check_issuers_fit(&huge_config, &huge, room, 1).unwrap_err().to_string();
        assert!(err.contains("issuers") && err.contains("4 stages of 200000 B"), "{err}");
        assert!(check_issuers_fit(&tma, &launch_shape(&tma, room, 1, false, false), room, 1).is_ok());
        assert!(check_issuers_fit(&Config { issuers: Some(4), ..tma }, &four, room, 1).is_ok());
        // Several slots per stage keep one issuer whatever the lowering says about combining.
        assert_eq!(launch_shape(&Config { issuers: Some(4), ..tma }, room, 2, false, false).issuers, 1);
    }

    /// Launches whose combines all store from registers take two stages of the largest chunk; the
    /// rest, and what the configuration gives, keep `auto_pipeline`'s ring.
    #[test]
    fn register_stores_take_the_combining_pipeline() {
        let room = 227 * 1024;
        let tma = Config { mover: Mover::Tma, ..Config::default() };
        let direct = launch_shape(&tma, room, 2, true, true);
        assert_eq!((direct.chunk, direct.stages, direct.threads), (56 * 1024, 2, 256));
        let shared = launch_shape(&tma, room, 2, true, false);
        assert_eq!((shared.chunk, shared.stages), auto_pipeline(room, 2, None, None));
        let given =
            launch_shape(&Config { chunk_bytes: Some(16384), stages: Some(4), ..tma.clone() }, room, 2, true, true);
        assert_eq!((given.chunk, given.stages), (16384, 4));
        // Given stages get the largest chunk, uncapped; a given chunk the stages that fit, up to four.
        let stages = launch_shape(&Config { stages: Some(2), ..tma.clone() }, room, 2, true, true);
        assert_eq!((stages.chunk, stages.stages), (56 * 1024, 2));
        let capped = launch_shape(&Config { stages: Some(2), ..tma.clone() }, room, 2, true, false);
        assert_eq!((capped.chunk, capped.stages), (32 * 1024, 2), "the shared copy's ring keeps the cap");
        let chunk = launch_shape(&Config { chunk_bytes: Some(16384), ..tma.clone() }, room, 2, true, true);
        assert_eq!((chunk.chunk, chunk.stages), (16384, 4));
        let copy = launch_shape(&tma, room, 1, false, true);
        assert_eq!(copy, launch_shape(&tma, room, 1, false, false), "nothing combines: as before");
        let simt = launch_shape(&Config { mover: Mover::Simt, ..tma }, room, 2, true, true);
        assert_eq!((simt.threads, simt.chunk, simt.stages), (512, 28 * 1024, 4), "no combining ring for SIMT");
    }

    /// The combining ring only where every combine stores from registers and every source is local.
    #[test]
    fn the_combining_ring_needs_register_stores_on_one_device() {
        assert!(combining_ring(false, Collective::ReduceScatter, false, 1));
        assert!(combining_ring(false, Collective::AllReduce, true, 1));
        assert!(!combining_ring(false, Collective::AllReduce, false, 1), "the shared copy's bulk stores read the ring");
        assert!(!combining_ring(false, Collective::AllGather, true, 1));
        assert!(!combining_ring(false, Collective::ReduceScatter, false, 2), "peers' sources over NVLink");
        assert!(!combining_ring(true, Collective::ReduceScatter, false, 1));
    }

    #[test]
    fn combine_direct_follows_the_device_cta_count_unless_given() {
        let auto = Config::default();
        assert!(combine_direct(&auto, 8));
        assert!(combine_direct(&auto, COMBINE_DIRECT_MAX_CTAS));
        assert!(!combine_direct(&auto, COMBINE_DIRECT_MAX_CTAS + 1));
        assert!(!combine_direct(&auto, 64));
        assert!(combine_direct(&Config { combine_direct: Some(true), ..auto.clone() }, 128));
        assert!(!combine_direct(&Config { combine_direct: Some(false), ..auto }, 1));
    }
}
