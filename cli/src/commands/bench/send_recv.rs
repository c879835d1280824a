//! `oxccl bench send-recv`: rank 0 sends to rank 1 (ranks as threads of this process, each with
//! its own [`Comm`] and stream), against `cuMemcpyDtoD` of the same size on the same GPU.

use super::{CliResult, MoverArg, SweepArgs};
use crate::bench::{memcpy_rate, time_ms};
use oxccl::{Comm, Config, Error, Id, Result};

/// Flags of `oxccl bench send-recv`.
#[derive(clap::Args, Clone, Debug)]
pub struct SendRecvArgs {
    /// Sizes, timing and check.
    #[command(flatten)]
    pub sweep: SweepArgs,
    /// Ranks of the communicator (threads, one GPU); rank 0 sends to rank 1, the others idle.
    #[arg(long, default_value_t = 2, allow_negative_numbers = true)]
    pub ranks: usize,
    /// The data mover.
    #[arg(long, value_enum, default_value = "tma")]
    pub mover: MoverArg,
    /// CTAs per rank (default: the communicator's choice); each end of a transfer takes its share.
    #[arg(long, allow_negative_numbers = true)]
    pub ctas: Option<u32>,
}

/// One rank's row: its time per call, the receiver's `cuMemcpyDtoD` rate (bytes copied per
/// second) and wrong bytes.
struct Row {
    us: f64,
    memcpy_gbps: f64,
    wrong: u64,
}

/// The flags, checked (before any GPU is looked for).
pub fn check(a: &SendRecvArgs) -> CliResult {
    a.sweep.sweep()?;
    if !(2..=oxccl::MAX_RANKS).contains(&a.ranks) {
        return Err(format!("--ranks {}: give 2..={}", a.ranks, oxccl::MAX_RANKS).into());
    }
    Ok(())
}

/// Runs the sweep and prints the table.
pub fn run(a: &SendRecvArgs) -> CliResult {
    check(a)?;
    let sweep = a.sweep.sweep()?;
    let ctx = oxccl::engine::probe_gpu().map_err(|why| format!("no GPU to benchmark on: {why}"))?;
    let config = Config { mover: a.mover.into(), max_ctas: a.ctas, ..Config::default() };
    let id = Id::new()?;
    let sizes: Vec<u64> = sweep.sizes().collect();
    let (iters, warmup, check) = (sweep.iters, sweep.warmup, sweep.check);
    let meet = super::Meet::new(a.ranks);
    println!("# send-recv: rank 0 -> rank 1 of {} ranks (threads), {:?} mover", a.ranks, config.mover);
    println!("# GB/s: bytes sent per second; memcpy: cuMemcpyDtoD of the same size, bytes copied per second");
    println!(
        "{:>12} {:>12} {:>10} {:>12} {:>10} {:>8}",
        "bytes", "time (us)", "GB/s", "memcpy GB/s", "of memcpy", "#wrong"
    );
    let threads: Vec<_> = (0..a.ranks)
        .map(|rank| {
            let (ctx, config, sizes, meet, world) = (ctx.clone(), config.clone(), sizes.clone(), meet.clone(), a.ranks);
            std::thread::spawn(move || -> Result<Vec<Row>> {
                let m = meet.clone();
                m.run(|| {
                    let stream = ctx.new_stream().map_err(Error::driver("cuStreamCreate"))?;
                    let comm = Comm::from_rank(&stream, rank, world, &id, config)?;
                    let mut rows = Vec::new();
                    for &bytes in &sizes {
                        let n = bytes as usize;
                        let pattern: Vec<u8> = (0..n).map(|i| (i % 251) as u8).collect();
                        let send = stream.clone_htod(&pattern).map_err(Error::driver("cuMemcpyHtoD"))?;
                        let mut recv = stream.alloc_zeros::<u8>(n).map_err(Error::driver("cuMemAlloc"))?;
                        // Both ends start their timed calls together.
                        comm.synchronize()?;
                        meet.wait()?;
                        let ms = time_ms(&stream, warmup, iters, || match rank {
                            0 => comm.send(&send, 1),
                            1 => comm.recv(&mut recv, 0),
                            _ => Ok(()),
                        })?;
                        comm.synchronize()?;
                        let mut wrong = 0;
                        if rank == 1 && check {
                            stream.memset_zeros(&mut recv).map_err(Error::driver("cuMemsetD8Async"))?;
                            comm.recv(&mut recv, 0)?;
                        } else if rank == 0 && check {
                            comm.send(&send, 1)?;
                        }
                        comm.synchronize()?;
                        if rank == 1 && check {
                            let got = stream.clone_dtoh(&recv).map_err(Error::driver("cuMemcpyDtoH"))?;
                            wrong = got.iter().zip(&pattern).filter(|(a, b)| a != b).count() as u64;
                        }
                        meet.wait()?;
                        let memcpy_gbps = if rank == 1 { memcpy_rate(&stream, n, warmup, iters)? / 2.0 } else { 0.0 };
                        meet.wait()?;
                        rows.push(Row { us: ms * 1e3, memcpy_gbps, wrong });
                    }
                    Ok(rows)
                })
            })
        })
        .collect();
    let results = super::joined(threads)?;
    for (i, &bytes) in sizes.iter().enumerate() {
        // The slower end's time; the receiver's memcpy and check.
        let (s, r) = (&results[0][i], &results[1][i]);
        let us = s.us.max(r.us);
        let gbps = bytes as f64 / (us * 1e-6) / 1e9;
        println!(
            "{:>12} {:>12.2} {:>10.2} {:>12.2} {:>9.1}% {:>8}",
            bytes,
            us,
            gbps,
            r.memcpy_gbps,
            100.0 * gbps / r.memcpy_gbps,
            r.wrong
        );
    }
    if results[1].iter().any(|r| r.wrong > 0) {
        return Err("wrong bytes received".into());
    }
    Ok(())
}
