//! `oxccl demo`: an AllReduce over virtual ranks, on the GPU when one is present, otherwise the same
//! plan on the CPU executor; says which it used and checks the result against the reference.

use super::CliResult;
use oxccl::{Communicator, Config};
use oxccl_host::lowered::{self, HostBuffers};
use oxccl_host::tccl::{self, Collective, PlanSpec, Reduction};
use oxccl_kernels::abi::{BUFFER_SLOTS, DType, RedOp, slot};

/// Flags of `oxccl demo`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Virtual ranks.
    #[arg(long, default_value_t = 8, allow_negative_numbers = true)]
    pub ranks: usize,
    /// f32 elements per rank.
    #[arg(long, default_value_t = 1 << 20, allow_negative_numbers = true)]
    pub count: u64,
    /// CTAs per rank.
    #[arg(long, default_value_t = 4, allow_negative_numbers = true)]
    pub ctas: u32,
    /// Use the CPU executor even when a GPU is present.
    #[arg(long)]
    pub cpu: bool,
}

/// Copies of every rank's f32 buffer the demo holds on the host at once: the inputs as f32 and as
/// bytes, the reference, and the results (on the CPU executor, its input and output buffers, the
/// results taken from the latter).
const DEMO_HOST_COPIES: u64 = 5;

/// Most host memory the demo's buffers may take, all ranks and copies together (4 GiB).
const MAX_DEMO_HOST_BYTES: u64 = 4 << 30;

/// Refuses, before anything is allocated, `ranks` ranks of `count` f32 elements whose
/// [`DEMO_HOST_COPIES`] host copies would take more than [`MAX_DEMO_HOST_BYTES`].
fn check_host_memory(ranks: usize, count: u64) -> CliResult {
    let per_copy = (ranks as u64).checked_mul(count).and_then(|n| n.checked_mul(4));
    let bytes = per_copy.and_then(|b| b.checked_mul(DEMO_HOST_COPIES));
    if bytes.is_none_or(|b| b > MAX_DEMO_HOST_BYTES) {
        let most = MAX_DEMO_HOST_BYTES / (4 * DEMO_HOST_COPIES).saturating_mul(ranks.max(1) as u64);
        let total = bytes.map_or("more than 2^64 B".to_string(), |b| format!("{b} B"));
        return Err(format!(
            "--count {count} over --ranks {ranks}: the demo holds {DEMO_HOST_COPIES} copies of every rank's f32 \
             buffer on the host, {total}; at most {MAX_DEMO_HOST_BYTES} B (4 GiB) in all, so --count at most {most} \
             for {ranks} ranks"
        )
        .into());
    }
    // Within the bound, the machine may still hold less (a memory limit, a small host): asked for
    // at once here, and given back, a refusal names the size instead of aborting halfway.
    let total = bytes.unwrap_or(0) as usize;
    let mut probe: Vec<u8> = Vec::new();
    if probe.try_reserve_exact(total).is_err() {
        return Err(format!(
            "--count {count} over --ranks {ranks}: the demo's host buffers ({total} B) cannot be allocated here"
        )
        .into());
    }
    Ok(())
}

/// Runs the demo: plans the AllReduce, runs it on the GPU (or, with `--cpu` or without a GPU, on
/// the CPU executor), prints where it ran, and fails if any rank's result differs from the
/// reference. Sizes whose host buffers would exceed 4 GiB are refused first.
pub fn run(a: Args) -> CliResult {
    check_host_memory(a.ranks, a.count)?;
    let spec = PlanSpec {
        collective: Collective::AllReduce,
        count: a.count,
        dtype: DType::F32,
        op: RedOp::Sum,
        ranks: a.ranks,
        in_place: false,
        ctas: a.ctas,
        reduction: Reduction::Registers,
    };
    // Ranks, CTAs and size checked before anything is allocated.
    let plan = tccl::plan(&spec)?;
    // Rank r holds (r + 1) * (i mod 7): small integers, so the sum is exact in any order.
    let inputs: Vec<Vec<f32>> =
        (0..a.ranks).map(|r| (0..a.count).map(|i| ((r + 1) as u64 * (i % 7)) as f32).collect()).collect();
    let as_bytes: Vec<Vec<u8>> = inputs.iter().map(|v| bytemuck::cast_slice(v).to_vec()).collect();
    let want = tccl::reference(&spec, &as_bytes);

    let gpu = if a.cpu { Err("--cpu given".to_string()) } else { oxccl::engine::probe_gpu() };
    let (got, where_): (Vec<Vec<u8>>, String) = match gpu {
        Ok(ctx) => {
            let stream = ctx.default_stream();
            let config = Config { max_ctas: Some(a.ctas), ..Config::default() };
            let comm = Communicator::virtual_ranks(&stream, a.ranks, config)?;
            let send = inputs.iter().map(|v| stream.clone_htod(v)).collect::<Result<Vec<_>, _>>()?;
            // NaN: an element the collective does not write cannot match the reference.
            let mut recv = (0..a.ranks)
                .map(|_| stream.clone_htod(&vec![f32::NAN; a.count as usize]))
                .collect::<Result<Vec<_>, _>>()?;
            comm.all_reduce(&send, &mut recv, oxccl::ReduceOp::Sum)?;
            comm.synchronize()?;
            let out = recv
                .iter()
                .map(|b| stream.clone_dtoh(b).map(|v| bytemuck::cast_slice(&v).to_vec()))
                .collect::<Result<Vec<Vec<u8>>, _>>()?;
            let code = comm.engine(0)?.code;
            (out, format!("on the GPU ({}), TMA mover, kernels from {code}", ctx.name().unwrap_or_default()))
        }
        Err(why) => {
            let mut bufs: HostBuffers = as_bytes
                .iter()
                .map(|input| {
                    let mut row: [Vec<u8>; BUFFER_SLOTS] = Default::default();
                    row[slot::INPUT as usize] = input.clone();
                    // NaN: an element the plan does not write cannot match the reference.
                    row[slot::OUTPUT as usize] = vec![0xFF; input.len()];
                    row
                })
                .collect();
            lowered::execute(&plan, &mut bufs, &[])?;
            let out = bufs.into_iter().map(|mut row| std::mem::take(&mut row[slot::OUTPUT as usize])).collect();
            (out, format!("on the CPU executor (no GPU: {why}), same plan the GPU runs"))
        }
    };
    let wrong = got.iter().zip(&want).filter(|(g, w)| g != w).count();
    println!(
        "AllReduce (sum, f32) of {} elements over {} virtual ranks, {} CTAs per rank, ran {where_}",
        a.count, a.ranks, a.ctas
    );
    let sample: Vec<f32> =
        got[0].chunks_exact(4).take(7).map(|w| f32::from_le_bytes([w[0], w[1], w[2], w[3]])).collect();
    println!("rank 0 output starts {sample:?}");
    if wrong != 0 {
        return Err(super::WrongResult::boxed(format!("{wrong} of {} ranks hold a wrong result", a.ranks)));
    }
    if a.count == 0 {
        println!("result checked against the reference on every rank: correct (no elements to compare)");
    } else {
        println!("result checked against the reference on every rank: correct");
    }
    Ok(())
}
