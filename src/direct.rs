//! Transfer programs (ResCCL's generators, MSCCL files, the text format) run on the collective
//! engine: lowered level by level ([`oxccl_host::compile::direct`]) and launched as reshard's
//! stages are, data moved straight between the ranks' buffers. The same walker, launcher and
//! checks as every collective; no FIFOs.

use crate::comm::{Communicator, Range, call_key, check_aligned, check_disjoint, ordinal_of};
use crate::engine::DeviceAlloc;
use crate::error::{Error, Result};
use crate::peer::Out;
use crate::program::{Prepared, ProgramKey, ProgramRun, digest};
use crate::{DType, Element, ReduceOp};
use cudarc::driver::{DevicePtr, DevicePtrMut};
use oxccl_host::compile::direct::{DirectOptions, lower_direct};
use oxccl_host::program::Program;
use oxccl_kernels::abi::{BUFFER_SLOTS, MAX_RANKS, slot};
use std::sync::Arc;

/// One local rank's buffers of a call: its input (out of place) and output (or its one buffer in
/// place), as (address, bytes).
pub(crate) struct RankBuffers {
    pub rank: usize,
    pub input: Option<(u64, u64)>,
    pub output: (u64, u64),
}

/// The chunk size of a call of `program` (on `ranks` ranks, `in_place` or not) on `bufs`, of
/// `elem`-byte elements: the first output's bytes over its chunks, a positive multiple of 16; every
/// buffer then holds its chunks exactly and is aligned to its elements.
pub(crate) fn call_geometry(
    program: &Program,
    ranks: usize,
    in_place: bool,
    elem: u64,
    bufs: &[RankBuffers],
) -> Result<u64> {
    let l = &program.layout;
    let bad = |why: String| Error::Config { field: "program", why };
    if l.ranks as usize != ranks {
        return Err(bad(format!("{} is for {} ranks; the communicator has {ranks}", program.name, l.ranks)));
    }
    if l.in_place != in_place {
        let (is, call) =
            if l.in_place { ("in place", "run_program_in_place") } else { ("out of place", "run_program") };
        return Err(bad(format!("{} is laid out {is}: run it with {call}", program.name)));
    }
    let main = if in_place { l.input_chunks().max(l.output_chunks()) } else { l.output_chunks() };
    let first = bufs.first().ok_or(Error::BufferCount { what: "buffers", expected: ranks, got: 0 })?;
    let chunk_bytes = first.output.1 / u64::from(main.max(1));
    if chunk_bytes == 0 || !chunk_bytes.is_multiple_of(16) {
        return Err(bad(format!(
            "{} B over the {main} chunks of {}'s {}: a chunk must be a positive multiple of 16 bytes",
            first.output.1,
            program.name,
            if in_place { "buffer" } else { "output" }
        )));
    }
    let elems = |chunks: u32| (u64::from(chunks) * chunk_bytes / elem) as usize;
    for b in bufs {
        let what = if in_place { "buffer" } else { "receive buffer" };
        let (want, got) = (elems(main), (b.output.1 / elem) as usize);
        if got != want || b.output.1 % elem != 0 {
            return Err(Error::Length { what, rank: b.rank, expected: want, got });
        }
        check_aligned(b.output.0, b.rank, what, elem as usize)?;
        if let Some((p, bytes)) = b.input {
            let (want, got) = (elems(l.input_chunks()), (bytes / elem) as usize);
            if got != want || bytes % elem != 0 {
                return Err(Error::Length { what: "send buffer", rank: b.rank, expected: want, got });
            }
            check_aligned(p, b.rank, "send buffer", elem as usize)?;
        }
    }
    Ok(chunk_bytes)
}

impl Communicator {
    /// Runs `program` out of place on every rank of this communicator: `send[r]` is rank `r`'s
    /// input, `recv[r]` its output, of the program's input and output chunks of equal size (a
    /// positive multiple of 16 bytes each); reductions combine `T` with `op`. The program runs
    /// level by level on the collectives' engine and launcher ([`oxccl_host::compile::direct`]):
    /// ops that touch no chunk another one writes run in one launch, data moved straight between
    /// the ranks' buffers by the receiver's CTAs. The lowering is built and uploaded on the first
    /// call with a given program, chunk size, type and operator, and kept until
    /// [`Communicator::clear_plans`]; scratch chunks are the communicator's own device memory.
    /// Call it once before capturing it in a CUDA graph (a first call builds and uploads).
    ///
    /// Errors: [`Error::Config`] for a program that does not verify, is not laid out for this
    /// communicator's ranks or is in place (see [`Communicator::run_program_in_place`]), or whose
    /// chunks are not a multiple of 16 bytes; `Avg` where the program reduces; buffer errors as for
    /// the collectives ([`Error::BufferCount`], [`Error::Length`], [`Error::WrongDevice`],
    /// [`Error::Misaligned`], [`Error::Aliasing`]); [`Error::Capturing`] for a first call inside a
    /// CUDA graph capture.
    pub fn run_program<T: Element, S: DevicePtr<T>, R: DevicePtrMut<T>>(
        &self,
        program: &Program,
        send: &[S],
        recv: &mut [R],
        op: ReduceOp,
    ) -> Result<()> {
        self.check_usable()?;
        let n = self.ranks();
        for (what, got) in [("send buffers", send.len()), ("receive buffers", recv.len())] {
            if got != n {
                return Err(Error::BufferCount { what, expected: n, got });
            }
        }
        let mut guards = Vec::new();
        let mut bufs = Vec::with_capacity(n);
        let e = std::mem::size_of::<T>() as u64;
        for (r, (s, d)) in send.iter().zip(recv.iter_mut()).enumerate() {
            self.check_placement(s.len(), ordinal_of(s), r, None, "send buffer")?;
            self.check_placement(d.len(), ordinal_of(d), r, None, "receive buffer")?;
            let (ins, outs) = (s.len() as u64 * e, d.len() as u64 * e);
            let (sp, g) = s.device_ptr(self.rank_stream(r));
            guards.push(g);
            let (dp, g) = d.device_ptr_mut(self.rank_stream(r));
            guards.push(g);
            bufs.push(RankBuffers { rank: r, input: Some((sp, ins)), output: (dp, outs) });
        }
        let ran = self.program_call(program, T::DTYPE, op, e, &bufs, false);
        drop(guards);
        ran
    }

    /// [`Communicator::run_program`] for a program laid out in place: `bufs[r]` is rank `r`'s one
    /// buffer (the larger of its input and output, which alias in it as the program's layout
    /// says).
    pub fn run_program_in_place<T: Element, R: DevicePtrMut<T>>(
        &self,
        program: &Program,
        bufs: &mut [R],
        op: ReduceOp,
    ) -> Result<()> {
        self.check_usable()?;
        let n = self.ranks();
        if bufs.len() != n {
            return Err(Error::BufferCount { what: "buffers", expected: n, got: bufs.len() });
        }
        let e = std::mem::size_of::<T>() as u64;
        let mut guards = Vec::new();
        let mut entries = Vec::with_capacity(n);
        for (r, b) in bufs.iter_mut().enumerate() {
            self.check_placement(b.len(), ordinal_of(b), r, None, "buffer")?;
            let len = b.len() as u64 * e;
            let (p, g) = b.device_ptr_mut(self.rank_stream(r));
            guards.push(g);
            entries.push(RankBuffers { rank: r, input: None, output: (p, len) });
        }
        let ran = self.program_call(program, T::DTYPE, op, e, &entries, true);
        drop(guards);
        ran
    }

    /// A program call on the local ranks' buffers `bufs` (every local rank's, checked for device
    /// by the caller), elements of `elem` bytes reduced as `dtype` with `op`.
    pub(crate) fn program_call(
        &self,
        program: &Program,
        dtype: DType,
        op: ReduceOp,
        elem: u64,
        bufs: &[RankBuffers],
        in_place: bool,
    ) -> Result<()> {
        let chunk_bytes = call_geometry(program, self.ranks(), in_place, elem, bufs)?;
        let mut ranges = Vec::new();
        for b in bufs {
            let device = self.rank_device(b.rank);
            let what = if in_place { "buffer" } else { "receive buffer" };
            let (start, end) = (b.output.0, b.output.0 + b.output.1);
            ranges.push(Range { start, end, rank: b.rank, device, writes: true, buffer: what });
            if let Some((start, bytes)) = b.input {
                let (end, buffer) = (start + bytes, "send buffer");
                ranges.push(Range { start, end, rank: b.rank, device, writes: false, buffer });
            }
        }
        check_disjoint(&ranges, "a program's buffers")?;

        let run = self.program_run(program, dtype, op, chunk_bytes)?;
        // Across processes, peers reach the buffers through staging memory, as for reshard: the
        // inputs copied in before the first level, the outputs out after the last (in place the one
        // buffer both).
        let mut staging = None;
        let mut buffers = [[0u64; BUFFER_SLOTS]; MAX_RANKS];
        let mut at: Vec<(usize, Option<u64>, u64)> =
            bufs.iter().map(|b| (b.rank, b.input.map(|i| i.0), b.output.0)).collect();
        if let Some(link) = &self.link
            && link.peer.is_some()
        {
            let ins: Vec<(u64, usize)> = bufs.iter().filter_map(|b| b.input).map(|(p, n)| (p, n as usize)).collect();
            let mut outs: Vec<Out> = bufs
                .iter()
                .map(|b| Out { ptr: b.output.0, bytes: b.output.1 as usize, written: true, read: in_place })
                .collect();
            // Scratch: staging memory of its size, nothing copied either way (a program writes its
            // scratch before it reads it); no memory of the rank's stands behind it (address 0).
            let scratch_bytes = |r: usize| run.prepared.lowered.buffer_bytes[r][slot::SCRATCH as usize] as usize;
            let with_scratch: Vec<usize> = bufs.iter().map(|b| b.rank).filter(|&r| scratch_bytes(r) > 0).collect();
            outs.extend(with_scratch.iter().map(|&r| Out {
                ptr: 0,
                bytes: scratch_bytes(r),
                written: false,
                read: false,
            }));
            let st = link.stage(&ins, &outs)?;
            let mut i = st.inputs.iter();
            for (a, o) in at.iter_mut().zip(&st.outputs) {
                a.2 = *o;
                if a.1.is_some() {
                    a.1 = i.next().copied();
                }
            }
            for (&r, &o) in with_scratch.iter().zip(&st.outputs[bufs.len()..]) {
                buffers[r][slot::SCRATCH as usize] = o;
            }
            staging = Some(st);
        }
        // The one buffer in place, the output out of place, is the OUTPUT slot (`place`).
        for &(r, input, output) in &at {
            buffers[r][slot::OUTPUT as usize] = output;
            if let Some(i) = input {
                buffers[r][slot::INPUT as usize] = i;
            }
        }
        for (r, alloc) in &run.scratch {
            buffers[*r][slot::SCRATCH as usize] = alloc.ptr();
        }
        let stream = at.first().map(|&(r, _, _)| &**self.rank_stream(r));
        let launched = crate::peer::Staging::around(staging.as_ref(), stream, || {
            // SAFETY: every local rank's buffers were checked above (device, length against the
            // lowering's buffer sizes, alignment, disjointness) and are borrowed for the call, or are
            // this rank's staging memory standing in for them, held until the call is queued; scratch
            // is the run's own or this rank's staging memory, of the lowering's size; other ranks' rows are announced by their own
            // callers at each launch's start barrier.
            unsafe { self.launch_prepared(&run.prepared, buffers) }
        });
        drop(staging);
        let released = self.release_plan(run);
        launched.and(released)
    }

    /// The program's lowering for `chunk_bytes` per chunk, built, uploaded and cached on first use.
    fn program_run(&self, program: &Program, dtype: DType, op: ReduceOp, chunk_bytes: u64) -> Result<Arc<ProgramRun>> {
        let ctas = self.ctas_per_rank();
        let key = ProgramKey { digest: digest(program), chunk_bytes, dtype, op, ctas };
        let (run, _) = self.program_plans.get_or_build(key, || {
            let opts = DirectOptions { op, ..DirectOptions::new(chunk_bytes, dtype, ctas) };
            let lowered =
                lower_direct(program, &opts).map_err(|e| Error::Config { field: "program", why: e.to_string() })?;
            let launch = self.staged_launch(&lowered)?;
            self.check_resident(&launch, ctas, lowered.slots())?;
            // Uploaded first: during a CUDA graph capture the upload refuses (`Error::Capturing`)
            // before anything is allocated or filled on a capturing stream.
            let prepared = Prepared { call_key: call_key(&key), ..self.prepare_staged(lowered, ctas)? };
            // Across processes scratch is staging memory, which peers reach (`program_call`).
            let mut scratch = Vec::new();
            let across = self.link.as_ref().is_some_and(|l| l.peer.is_some());
            for r in self.holding(crate::comm::Holders::All).into_iter().filter(|_| !across) {
                let bytes = prepared.lowered.buffer_bytes[r][slot::SCRATCH as usize];
                if bytes > 0 {
                    scratch.push((r, DeviceAlloc::filled_on(self.rank_stream(r), bytes as usize, &[])?));
                }
            }
            Ok(Arc::new(ProgramRun { program: program.clone(), prepared, scratch }))
        })?;
        if run.program != *program {
            // Two programs of one digest: never seen, but a wrong plan would be run silently.
            return Err(Error::Config {
                field: "program",
                why: format!("{} shares its digest with another cached program: call clear_plans", program.name),
            });
        }
        Ok(run)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use oxccl_host::program::generators::Algorithm;

    fn one(rank: usize, input: Option<(u64, u64)>, output: (u64, u64)) -> RankBuffers {
        RankBuffers { rank, input, output }
    }

    /// The ring AllReduce on 4 ranks (in place, 4 chunks) and the AllToAll on 4 (out of place).
    #[test]
    fn a_call_s_chunks_come_from_its_buffers_or_a_typed_error() {
        let ring = Algorithm::RingAllReduce.generate(1, 4).unwrap();
        let a2a = Algorithm::DirectAllToAll.generate(1, 4).unwrap();
        let at = |r: u64| (r + 1) << 20;
        let in_place: Vec<RankBuffers> = (0..4).map(|r| one(r, None, (at(r as u64), 4 * 64))).collect();
        assert_eq!(call_geometry(&ring, 4, true, 4, &in_place).unwrap(), 64);
        // The wrong form, rank count, chunk size (40 B: not a multiple of 16), a short buffer, an
        // unaligned one.
        let e = call_geometry(&ring, 4, false, 4, &in_place).unwrap_err();
        assert!(
            matches!(e, Error::Config { field: "program", ref why } if why.contains("run_program_in_place")),
            "{e}"
        );
        let e = call_geometry(&ring, 8, true, 4, &in_place).unwrap_err();
        assert!(matches!(e, Error::Config { field: "program", .. }), "{e}");
        let odd: Vec<RankBuffers> = (0..4).map(|r| one(r, None, (at(r as u64), 4 * 40))).collect();
        let e = call_geometry(&ring, 4, true, 4, &odd).unwrap_err();
        assert!(matches!(e, Error::Config { field: "program", ref why } if why.contains("multiple of 16")), "{e}");
        let mut short: Vec<RankBuffers> = (0..4).map(|r| one(r, None, (at(r as u64), 4 * 64))).collect();
        short[2].output.1 -= 4;
        let e = call_geometry(&ring, 4, true, 4, &short).unwrap_err();
        assert!(matches!(e, Error::Length { what: "buffer", rank: 2, expected: 64, got: 63 }), "{e}");
        let mut unaligned: Vec<RankBuffers> = (0..4).map(|r| one(r, None, (at(r as u64), 4 * 64))).collect();
        unaligned[1].output.0 += 2;
        let e = call_geometry(&ring, 4, true, 4, &unaligned).unwrap_err();
        assert!(matches!(e, Error::Misaligned { rank: 1, .. }), "{e}");
        assert!(matches!(call_geometry(&ring, 4, true, 4, &[]), Err(Error::BufferCount { .. })));
        // Out of place: the input must hold its chunks too.
        let l = &a2a.layout;
        let (i, o) = (u64::from(l.input_chunks()) * 32, u64::from(l.output_chunks()) * 32);
        let mut oop: Vec<RankBuffers> =
            (0..4).map(|r| one(r, Some((at(r as u64) + (1 << 19), i)), (at(r as u64), o))).collect();
        assert_eq!(call_geometry(&a2a, 4, false, 8, &oop).unwrap(), 32);
        oop[3].input = Some((at(3) + (1 << 19), i + 8));
        let e = call_geometry(&a2a, 4, false, 8, &oop).unwrap_err();
        assert!(matches!(e, Error::Length { what: "send buffer", rank: 3, .. }), "{e}");
    }
}
