//! candle-ddp: a small MLP trained data parallel. Every rank holds the same initial weights and
//! its own shard of a synthetic batch; after each backward pass the gradients are averaged in
//! place on candle's own CUDA memory (`ReduceOp::Avg` through oxccl), and every rank takes the
//! same SGD step.
//!
//! Checks, on every rank: the weights stay bitwise equal across ranks (gathered and compared after
//! training), and each step's global loss matches training on the whole batch on one device within
//! a relative 1e-4 (the averaged gradient is the whole batch's up to rounding).
//!
//! ```sh
//! scripts/candle-examples.sh && cd examples/candle
//! target/release/candle-ddp                    # 2 ranks on one GPU, or one per GPU
//! OXCCL_RANKS=4 target/release/candle-ddp      # 4 ranks as threads
//! oxccl launch -n 4 -- target/release/candle-ddp  # 4 processes (MPS on one GPU)
//! ```
//!
//! Without a GPU it says so and exits 0.

use candle_core::{D, Device, Tensor, Var};
use oxccl::{Config, ReduceOp};
use oxccl_candle_examples::{BoxError, Lcg, Rank, all_gather, all_reduce, run_ranks};

const INPUTS: usize = 16;
const HIDDEN: usize = 64;
const ROWS_PER_RANK: usize = 128;
const STEPS: usize = 25;
const LEARNING_RATE: f64 = 0.05;

/// The synthetic data: row `i` of the global batch (features and target), the same on every rank.
fn rows(first: usize, n: usize) -> (Vec<f32>, Vec<f32>) {
    let teacher: Vec<f32> = {
        let mut g = Lcg::new(7);
        (0..INPUTS).map(|_| g.next_f32()).collect()
    };
    let (mut x, mut y) = (Vec::with_capacity(n * INPUTS), Vec::with_capacity(n));
    for i in first..first + n {
        let mut g = Lcg::new(1000 + i as u64);
        let row: Vec<f32> = (0..INPUTS).map(|_| g.next_f32()).collect();
        y.push(row.iter().zip(&teacher).map(|(a, b)| a * b).sum::<f32>().tanh());
        x.extend(row);
    }
    (x, y)
}

/// The model's parameters, initialised alike everywhere: W1, b1, W2, b2.
fn init(device: &Device) -> Result<Vec<Var>, BoxError> {
    let mut g = Lcg::new(42);
    let mut var = |shape: &[usize], scale: f32| -> Result<Var, BoxError> {
        let n = shape.iter().product();
        let v: Vec<f32> = (0..n).map(|_| g.next_f32() * scale).collect();
        Ok(Var::from_tensor(&Tensor::from_vec(v, shape, device)?)?)
    };
    Ok(vec![var(&[INPUTS, HIDDEN], 0.25)?, var(&[HIDDEN], 0.0)?, var(&[HIDDEN, 1], 0.125)?, var(&[1], 0.0)?])
}

fn loss(p: &[Var], x: &Tensor, y: &Tensor) -> candle_core::Result<Tensor> {
    let h = x.matmul(p[0].as_tensor())?.broadcast_add(p[1].as_tensor())?.relu()?;
    let out = h.matmul(p[2].as_tensor())?.broadcast_add(p[3].as_tensor())?.squeeze(D::Minus1)?;
    (out - y)?.sqr()?.mean_all()
}

/// Trains on rows `first..first + n`; with a rank, gradients and the reported loss are averaged
/// across the ranks. Returns each step's loss and the final parameters.
fn train(device: &Device, rank: Option<&Rank>, first: usize, n: usize) -> Result<(Vec<f32>, Vec<Var>), BoxError> {
    let (x, y) = rows(first, n);
    let x = Tensor::from_vec(x, (n, INPUTS), device)?;
    let y = Tensor::from_vec(y, n, device)?;
    let params = init(device)?;
    let mut losses = Vec::with_capacity(STEPS);
    for _ in 0..STEPS {
        let l = loss(&params, &x, &y)?;
        let grads = l.backward()?;
        let l = l.reshape(1)?.contiguous()?;
        for p in &params {
            let g = grads.get(p.as_tensor()).ok_or("a parameter without a gradient")?.contiguous()?;
            if let Some(rank) = rank {
                all_reduce(&rank.comm, &g, ReduceOp::Avg)?;
            }
            p.set(&(p.as_tensor() - (g * LEARNING_RATE)?)?)?;
        }
        if let Some(rank) = rank {
            all_reduce(&rank.comm, &l, ReduceOp::Avg)?;
        }
        losses.push(l.to_vec1::<f32>()?[0]);
    }
    Ok((losses, params))
}

fn main() -> Result<(), BoxError> {
    // Deterministic: the sum of every rank's gradient in rank order, so every rank computes the
    // same bits.
    let config = Config { deterministic: true, ..Config::default() };
    let Some(reports) = run_ranks(config, |rank| {
        let (r, world) = (rank.comm.rank(), rank.comm.world());
        let (losses, params) = train(&rank.device, Some(rank), r * ROWS_PER_RANK, ROWS_PER_RANK)?;
        // Every rank's parameters, gathered: each copy must equal this rank's bit for bit.
        let mine = Tensor::cat(&params.iter().map(|p| p.as_tensor().flatten_all()).collect::<Result<Vec<_>, _>>()?, 0)?;
        let n = mine.elem_count();
        let all = all_gather(rank, &mine, &[world, n])?.to_vec2::<f32>()?;
        let mine = mine.to_vec1::<f32>()?;
        for (q, theirs) in all.iter().enumerate() {
            if let Some(i) = theirs.iter().zip(&mine).position(|(a, b)| a.to_bits() != b.to_bits()) {
                return Err(format!("rank {r}: parameter {i} differs from rank {q}'s").into());
            }
        }
        // The whole batch on this rank's device alone.
        let (reference, _) = train(&rank.device, None, 0, world * ROWS_PER_RANK)?;
        for (s, (a, b)) in losses.iter().zip(&reference).enumerate() {
            if (a - b).abs() > 1e-4 * b.abs().max(1.0) {
                return Err(format!("rank {r} step {s}: loss {a}, one device {b}").into());
            }
        }
        Ok((world, losses[0], losses[STEPS - 1]))
    })?
    else {
        return Ok(());
    };
    let (world, first, last) = reports[0];
    println!(
        "candle-ddp: {world} ranks, {STEPS} steps: loss {first:.5} -> {last:.5}, weights bitwise equal on every rank, \
         losses within 1e-4 of one device on the whole batch"
    );
    Ok(())
}
