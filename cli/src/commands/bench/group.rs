//! `oxccl bench group`: a group of AllReduces (a bucket of gradient tensors) against one AllReduce
//! of their total size and against one call per tensor (ranks as threads of this process, each
//! with its own [`Comm`] and stream, on one GPU).

use super::{CliResult, MoverArg, SweepArgs};
use crate::bench::time_ms;
use oxccl::{Comm, Config, Error, Id, ReduceOp, Result};

/// Flags of `oxccl bench group`.
#[derive(clap::Args, Clone, Debug)]
pub struct GroupArgs {
    /// Sizes of each tensor, timing and check.
    #[command(flatten)]
    pub sweep: SweepArgs,
    /// Tensors in the group (f32; out of place unless --in-place), each of the row's size.
    #[arg(long, default_value_t = 100, allow_negative_numbers = true)]
    pub tensors: usize,
    /// Ranks of the communicator (threads, one GPU).
    #[arg(long, default_value_t = 8, allow_negative_numbers = true)]
    pub ranks: usize,
    /// The data mover.
    #[arg(long, value_enum, default_value = "tma")]
    pub mover: MoverArg,
    /// CTAs per rank (default: the communicator's choice).
    #[arg(long, allow_negative_numbers = true)]
    pub ctas: Option<u32>,
    /// In place (as data-parallel training reduces its gradients): each tensor is its own output,
    /// and a launch holds twice as many.
    #[arg(long)]
    pub in_place: bool,
    /// cudarc's event tracking off for the benchmark's buffers (as one-stream applications such as
    /// candle run): a buffer then costs its call no stream wait and no event record.
    #[arg(long)]
    pub untracked: bool,
}

/// One rank's times per call (µs): the group, one AllReduce of the total, one call per tensor;
/// and the group's wrong elements.
struct Row {
    group: f64,
    whole: f64,
    each: f64,
    wrong: u64,
}

/// The flags, checked (before any GPU is looked for).
pub fn check(a: &GroupArgs) -> CliResult {
    a.sweep.sweep()?;
    if !(1..=oxccl::MAX_RANKS).contains(&a.ranks) {
        return Err(format!("--ranks {}: give 1..={}", a.ranks, oxccl::MAX_RANKS).into());
    }
    if !(1..=10_000).contains(&a.tensors) {
        return Err(format!("--tensors {}: give 1..=10000", a.tensors).into());
    }
    Ok(())
}

/// Runs the sweep and prints the table.
pub fn run(a: &GroupArgs) -> CliResult {
    check(a)?;
    let sweep = a.sweep.sweep()?;
    let ctx = oxccl::engine::probe_gpu().map_err(|why| format!("no GPU to benchmark on: {why}"))?;
    let config = Config { mover: a.mover.into(), max_ctas: a.ctas, ..Config::default() };
    let id = Id::new()?;
    let sizes: Vec<u64> = sweep.sizes().collect();
    let (iters, warmup, check, tensors, world) = (sweep.iters, sweep.warmup, sweep.check, a.tensors, a.ranks);
    let in_place = a.in_place;
    let place = if in_place { "in place" } else { "out of place" };
    let meet = super::Meet::new(world);
    // Each rank's buffers are used on its own stream only, and read back after its synchronize.
    let _untracked = a.untracked.then(|| crate::bench::Untracked::new(std::slice::from_ref(&ctx.default_stream())));
    let tracking = if a.untracked { "event tracking off" } else { "event tracking on" };
    println!(
        "# group: {tensors} AllReduces of f32 ({place}) on {world} ranks (threads), {:?} mover, cudarc {tracking}",
        config.mover
    );
    println!("# group: one group of the tensors; whole: one AllReduce of their total size; each: one call per tensor");
    println!(
        "{:>12} {:>8} {:>12} {:>12} {:>9} {:>12} {:>11} {:>8}",
        "bytes each", "tensors", "group (us)", "whole (us)", "ratio", "each (us)", "busbw GB/s", "#wrong"
    );
    let threads: Vec<_> = (0..world)
        .map(|rank| {
            let (ctx, config, sizes, meet) = (ctx.clone(), config.clone(), sizes.clone(), meet.clone());
            std::thread::spawn(move || -> Result<Vec<Row>> {
                let m = meet.clone();
                m.run(|| {
                    let stream = ctx.new_stream().map_err(Error::driver("cuStreamCreate"))?;
                    let comm = Comm::from_rank(&stream, rank, world, &id, config)?;
                    let mut rows = Vec::new();
                    for &bytes in &sizes {
                        let n = (bytes as usize / 4).max(1);
                        let total = n * tensors;
                        // Tensors of their own (as gradients are), and one buffer of their total size.
                        let value = vec![(rank + 1) as f32; n];
                        let sends = (0..tensors)
                            .map(|_| stream.clone_htod(&value).map_err(Error::driver("cuMemcpyHtoD")))
                            .collect::<Result<Vec<_>>>()?;
                        let mut recvs = (0..tensors)
                            .map(|_| stream.alloc_zeros::<f32>(n).map_err(Error::driver("cuMemAlloc")))
                            .collect::<Result<Vec<_>>>()?;
                        let send = stream
                            .clone_htod(&vec![(rank + 1) as f32; total])
                            .map_err(Error::driver("cuMemcpyHtoD"))?;
                        let mut recv = stream.alloc_zeros::<f32>(total).map_err(Error::driver("cuMemAlloc"))?;
                        let grouped = |recvs: &mut [cudarc::driver::CudaSlice<f32>]| -> Result<()> {
                            let mut g = comm.group();
                            for (input, out) in sends.iter().zip(recvs.iter_mut()) {
                                if in_place {
                                    g.all_reduce_in_place(out, ReduceOp::Sum)?;
                                } else {
                                    g.all_reduce(input, out, ReduceOp::Sum)?;
                                }
                            }
                            g.run()
                        };
                        let one = |i: &cudarc::driver::CudaSlice<f32>, o: &mut cudarc::driver::CudaSlice<f32>| {
                            if in_place {
                                comm.all_reduce_in_place(o, ReduceOp::Sum)
                            } else {
                                comm.all_reduce(i, o, ReduceOp::Sum)
                            }
                        };
                        comm.synchronize()?;
                        meet.wait()?;
                        let group = time_ms(&stream, warmup, iters, || grouped(&mut recvs))?;
                        comm.synchronize()?;
                        meet.wait()?;
                        let whole = time_ms(&stream, warmup, iters, || one(&send, &mut recv))?;
                        comm.synchronize()?;
                        meet.wait()?;
                        let each = time_ms(&stream, warmup.min(2), iters.min(5), || {
                            sends.iter().zip(recvs.iter_mut()).try_for_each(|(i, o)| one(i, o))
                        })?;
                        comm.synchronize()?;
                        let mut wrong = 0;
                        if check {
                            // In place the timed calls kept summing: every tensor starts again from its
                            // value. Out of place the outputs start at 0, which no correct sum is.
                            for r in recvs.iter_mut() {
                                if in_place {
                                    stream.memcpy_htod(&value, r).map_err(Error::driver("cuMemcpyHtoD"))?;
                                } else {
                                    stream.memset_zeros(r).map_err(Error::driver("cuMemsetD8Async"))?;
                                }
                            }
                            grouped(&mut recvs)?;
                            comm.synchronize()?;
                            let want = (world * (world + 1) / 2) as f32;
                            for r in &recvs {
                                let got = stream.clone_dtoh(r).map_err(Error::driver("cuMemcpyDtoH"))?;
                                wrong += got.iter().filter(|&&x| x != want).count() as u64;
                            }
                        }
                        meet.wait()?;
                        rows.push(Row { group: group * 1e3, whole: whole * 1e3, each: each * 1e3, wrong });
                    }
                    Ok(rows)
                })
            })
        })
        .collect();
    let results = super::joined(threads)?;
    let mut wrong = 0;
    for (i, &bytes) in sizes.iter().enumerate() {
        // The slowest rank's times.
        let max = |f: fn(&Row) -> f64| results.iter().map(|r| f(&r[i])).fold(0.0, f64::max);
        let (group, whole, each) = (max(|r| r.group), max(|r| r.whole), max(|r| r.each));
        let w: u64 = results.iter().map(|r| r[i].wrong).sum();
        wrong += w;
        let total = (bytes.max(4) / 4 * 4) as f64 * tensors as f64;
        let busbw = total / (group * 1e-6) / 1e9 * 2.0 * (world as f64 - 1.0) / world as f64;
        println!(
            "{:>12} {:>8} {:>12.2} {:>12.2} {:>8.3}x {:>12.2} {:>11.2} {:>8}",
            bytes,
            tensors,
            group,
            whole,
            group / whole,
            each,
            busbw,
            w
        );
    }
    if wrong > 0 {
        return Err("wrong elements in the group's results".into());
    }
    Ok(())
}
