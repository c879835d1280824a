//! One thread per device, each owning its stream and its own `Comm`, as burn's and cubecl's
//! per-device servers run: every step each thread averages its gradient with the others'
//! (`ReduceOp::Avg`, as data parallelism divides by the world size) and gathers the others' token
//! ids (an `i64` buffer: any plain type is copied byte for byte).
//!
//! ```sh
//! cargo run --release --example device_threads            # one rank per visible GPU
//! OXCCL_RANKS=4 cargo run --release --example device_threads  # 4 ranks on GPU 0
//! ```
//!
//! (More than 8 ranks on one GPU need `CUDA_DEVICE_MAX_CONNECTIONS` at least their count.)
//!
//! Without a Hopper GPU it says so and exits 0.

use cudarc::driver::CudaContext;
use oxccl::bootstrap::LocalBootstrap;
use oxccl::{Comm, Config, ReduceOp};
use std::sync::Arc;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Rank `r`'s gradient at step `s`: small integers, so every average below is exact in f32.
fn gradient(r: usize, s: usize, len: usize) -> Vec<f32> {
    (0..len).map(|i| ((r * 3 + s + i) % 8) as f32 * 4.0).collect()
}

fn main() -> Result<(), BoxError> {
    let first = match oxccl::engine::probe_gpu() {
        Ok(ctx) => ctx,
        Err(why) => {
            println!("no GPU ({why}): nothing to run");
            return Ok(());
        }
    };
    let gpus = CudaContext::device_count()? as usize;
    // Several ranks on one GPU: as many hardware queues as streams (set before the driver starts),
    // and every rank's kernels must fit side by side.
    let (world, contexts): (usize, Vec<Arc<CudaContext>>) = match std::env::var("OXCCL_RANKS") {
        Ok(n) => {
            let n: usize = n.parse()?;
            (n, vec![first; n])
        }
        Err(_) => (gpus, (0..gpus).map(CudaContext::new).collect::<Result<_, _>>()?),
    };
    let config = Config { max_ctas: Some(if world > gpus { 4 } else { 16 }), ..Config::default() };
    let (len, tokens, steps) = (1 << 20, 1000, 3);
    let threads: Vec<_> = LocalBootstrap::group(world, config.timeout)
        .into_iter()
        .zip(contexts)
        .map(|(boot, ctx)| {
            let config = config.clone();
            std::thread::spawn(move || -> Result<(), BoxError> {
                let rank = oxccl::Bootstrap::rank(&boot);
                let stream = ctx.new_stream()?;
                let comm = Comm::new(&stream, Box::new(boot), config)?;
                for step in 0..steps {
                    let mut grad = stream.clone_htod(&gradient(rank, step, len))?;
                    comm.all_reduce_in_place(&mut grad, ReduceOp::Avg)?;
                    let ids: Vec<i64> = (0..tokens).map(|i| ((rank as i64) << 32) + i as i64).collect();
                    let ids = stream.clone_htod(&ids)?;
                    let mut all_ids = stream.alloc_zeros::<i64>(tokens * world)?;
                    comm.all_gather(&ids, &mut all_ids)?;
                    comm.synchronize()?;
                    // The sum (exact: small integers), times the f32 nearest 1/world, as Avg computes it.
                    let mut want = vec![0f32; len];
                    for q in 0..world {
                        want.iter_mut().zip(gradient(q, step, len)).for_each(|(w, g)| *w += g);
                    }
                    let inverse = 1.0 / world as f32;
                    let got = stream.clone_dtoh(&grad)?;
                    if let Some(i) = got.iter().zip(&want).position(|(g, w)| *g != w * inverse) {
                        return Err(format!("rank {rank} step {step}: gradient {i} is {}", got[i]).into());
                    }
                    let all_ids = stream.clone_dtoh(&all_ids)?;
                    for (k, id) in all_ids.iter().enumerate() {
                        if *id != (((k / tokens) as i64) << 32) + (k % tokens) as i64 {
                            return Err(format!("rank {rank} step {step}: token id {k} is {id}").into());
                        }
                    }
                }
                Ok(())
            })
        })
        .collect();
    for (rank, t) in threads.into_iter().enumerate() {
        t.join().map_err(|_| format!("rank {rank}'s thread panicked"))??;
    }
    println!(
        "{world} ranks: {steps} steps of averaged gradients ({len} f32) and gathered token ids ({tokens} i64 per rank) exact"
    );
    Ok(())
}
