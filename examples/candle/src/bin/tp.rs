//! candle-tp: a tensor-parallel MLP block (Megatron-style) on candle's CUDA tensors. The first
//! linear layer is split by columns (each rank computes its slice of the hidden units), the second
//! by rows (each rank's product is a partial sum of the output); oxccl's ReduceScatter sums the
//! partial outputs and leaves each rank a block of rows (sequence parallel), and AllGather puts
//! the whole output back on every rank.
//!
//! Check: every rank's output equals the unsplit block `relu(X W1) W2` computed on one device, bit
//! for bit (small integers: every sum is exact in any order).
//!
//! ```sh
//! scripts/candle-examples.sh && cd examples/candle
//! target/release/candle-tp                    # 2 ranks on one GPU, or one per GPU
//! OXCCL_RANKS=4 target/release/candle-tp
//! ```
//!
//! Without a GPU it says so and exits 0.

use candle_core::{Device, Tensor};
use oxccl::Config;
use oxccl_candle_examples::{BoxError, Lcg, all_gather, reduce_scatter, run_ranks};

const BATCH: usize = 64;
const MODEL: usize = 128;
const HIDDEN: usize = 512;

/// A `rows × cols` matrix of small integers from `seed`, the same on every rank.
fn matrix(seed: u64, rows: usize, cols: usize, device: &Device) -> Result<Tensor, BoxError> {
    let mut g = Lcg::new(seed);
    let v: Vec<f32> = (0..rows * cols).map(|_| g.next_small()).collect();
    Ok(Tensor::from_vec(v, (rows, cols), device)?)
}

fn main() -> Result<(), BoxError> {
    let Some(reports) = run_ranks(Config::default(), |rank| {
        let (r, world) = (rank.comm.rank(), rank.comm.world());
        if HIDDEN % world != 0 || BATCH % world != 0 {
            return Err(format!("{world} ranks do not divide {HIDDEN} hidden units and {BATCH} rows").into());
        }
        let d = &rank.device;
        let x = matrix(1, BATCH, MODEL, d)?;
        let w1 = matrix(2, MODEL, HIDDEN, d)?;
        let w2 = matrix(3, HIDDEN, MODEL, d)?;
        let part = HIDDEN / world;
        // Column-parallel: this rank's hidden units; row-parallel: its rows of W2.
        let hidden = x.matmul(&w1.narrow(1, r * part, part)?.contiguous()?)?.relu()?;
        let partial = hidden.matmul(&w2.narrow(0, r * part, part)?.contiguous()?)?;
        let rows = reduce_scatter(rank, &partial, &[BATCH / world, MODEL])?;
        let out = all_gather(rank, &rows, &[BATCH, MODEL])?;
        let want = x.matmul(&w1)?.relu()?.matmul(&w2)?;
        let (got, want) = (out.flatten_all()?.to_vec1::<f32>()?, want.flatten_all()?.to_vec1::<f32>()?);
        if let Some(i) = got.iter().zip(&want).position(|(a, b)| a.to_bits() != b.to_bits()) {
            return Err(format!("rank {r}: output element {i} is {}, unsplit {}", got[i], want[i]).into());
        }
        Ok(world)
    })?
    else {
        return Ok(());
    };
    println!(
        "candle-tp: {} ranks: column- then row-parallel block ({BATCH}x{MODEL}, {HIDDEN} hidden), ReduceScatter + \
         AllGather, equal to the unsplit block bit for bit",
        reports[0]
    );
    Ok(())
}
