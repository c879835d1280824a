//! What both examples share: running a rank per thread (or per process under `oxccl launch`),
//! candle devices on oxccl communicators, and collectives on candle's CUDA tensors in place.

use candle_core::{CudaStorage, Device, InplaceOp1, Layout, Tensor};
use oxccl::{Comm, Config, ReduceOp};

/// The examples' error type: candle's, oxccl's and the checks' own.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A rank: its candle device (with a stream of its own) and its communicator on that stream.
pub struct Rank {
    /// The device the rank's tensors live on.
    pub device: Device,
    /// The rank's communicator.
    pub comm: Comm,
}

/// Runs `body` once per rank and returns the ranks' results in rank order: in this process, one
/// thread per rank (ranks dealt round-robin to the visible GPUs; `OXCCL_RANKS` sets how many,
/// default two per GPU on a single GPU, else one per GPU), or, when started by `oxccl launch` (or
/// torchrun: `RANK` is set), this process's rank only. `None` when there is no GPU to run on (said
/// on stdout).
pub fn run_ranks<T: Send + 'static>(
    config: Config,
    body: impl Fn(&Rank) -> Result<T, BoxError> + Send + Sync + 'static,
) -> Result<Option<Vec<T>>, BoxError> {
    if let Err(why) = oxccl::engine::probe_gpu() {
        println!("no GPU ({why}): nothing to run");
        return Ok(None);
    }
    let gpus = cudarc::driver::CudaContext::device_count()? as usize;
    if std::env::var_os("RANK").is_some() {
        let env = oxccl::LaunchEnv::from_env()?;
        let device = Device::new_cuda_with_stream(env.local_rank % gpus)?;
        let stream = device.as_cuda_device()?.cuda_stream();
        let comm = Comm::from_env(&stream, config)?;
        return Ok(Some(vec![body(&Rank { device, comm })?]));
    }
    let world = match std::env::var("OXCCL_RANKS") {
        Ok(n) => n.parse()?,
        Err(_) if gpus == 1 => 2,
        Err(_) => gpus,
    };
    let body = std::sync::Arc::new(body);
    let threads: Vec<_> = oxccl::bootstrap::LocalBootstrap::group(world, config.timeout)
        .into_iter()
        .enumerate()
        .map(|(rank, boot)| {
            let (config, body) = (config.clone(), body.clone());
            std::thread::spawn(move || -> Result<T, BoxError> {
                let device = Device::new_cuda_with_stream(rank % gpus)?;
                let stream = device.as_cuda_device()?.cuda_stream();
                let comm = Comm::new(&stream, Box::new(boot), config)?;
                body(&Rank { device, comm })
            })
        })
        .collect();
    let mut out = Vec::with_capacity(world);
    for (rank, t) in threads.into_iter().enumerate() {
        out.push(t.join().map_err(|_| format!("rank {rank}'s thread panicked"))??);
    }
    Ok(Some(out))
}

/// A contiguous f32 tensor's elements as a view of its CUDA storage.
fn elements<'a>(
    storage: &'a mut CudaStorage,
    layout: &Layout,
) -> candle_core::Result<cudarc::driver::CudaViewMut<'a, f32>> {
    let Some((start, end)) = layout.contiguous_offsets() else {
        candle_core::bail!("collectives take contiguous tensors");
    };
    Ok(storage.as_cuda_slice_mut::<f32>()?.slice_mut(start..end))
}

fn wrap(e: oxccl::Error) -> candle_core::Error {
    candle_core::Error::Msg(format!("oxccl: {e}"))
}

/// AllReduce in place on the tensor's own CUDA memory (no copy), as a candle in-place op.
struct AllReduce<'a> {
    comm: &'a Comm,
    op: ReduceOp,
}

impl InplaceOp1 for AllReduce<'_> {
    fn name(&self) -> &'static str {
        "oxccl-all-reduce"
    }

    fn cpu_fwd(&self, _: &mut candle_core::CpuStorage, _: &Layout) -> candle_core::Result<()> {
        candle_core::bail!("oxccl reduces CUDA tensors")
    }

    fn cuda_fwd(&self, storage: &mut CudaStorage, layout: &Layout) -> candle_core::Result<()> {
        let mut view = elements(storage, layout)?;
        self.comm.all_reduce_in_place(&mut view, self.op).map_err(wrap)
    }
}

/// `t` (f32, contiguous, on the rank's device) reduced with `op` across the ranks, in place.
pub fn all_reduce(comm: &Comm, t: &Tensor, op: ReduceOp) -> Result<(), BoxError> {
    Ok(t.inplace_op1(&AllReduce { comm, op })?)
}

/// `f` on a view of the f32 tensor `t`'s elements in its CUDA storage (made contiguous first).
fn with_elements<R>(
    t: &Tensor,
    f: impl FnOnce(cudarc::driver::CudaView<'_, f32>) -> Result<R, BoxError>,
) -> Result<R, BoxError> {
    let t = t.contiguous()?;
    let (storage, layout) = t.storage_and_layout();
    let candle_core::Storage::Cuda(cuda) = &*storage else { return Err("a CUDA tensor".into()) };
    let (start, end) = layout.contiguous_offsets().ok_or("a contiguous tensor")?;
    f(cuda.as_cuda_slice::<f32>()?.slice(start..end))
}

/// The rank's f32 tensor `t` gathered from every rank: a new tensor of `world × len` elements,
/// rank-major, shaped `shape`.
pub fn all_gather(rank: &Rank, t: &Tensor, shape: &[usize]) -> Result<Tensor, BoxError> {
    let mut recv = rank.comm.stream().alloc_zeros::<f32>(t.elem_count() * rank.comm.world())?;
    with_elements(t, |send| Ok(rank.comm.all_gather(&send, &mut recv)?))?;
    from_slice(rank, recv, shape)
}

/// The rank's f32 tensor `t` summed over the ranks and scattered: this rank's block of
/// `len / world` elements, shaped `shape`.
pub fn reduce_scatter(rank: &Rank, t: &Tensor, shape: &[usize]) -> Result<Tensor, BoxError> {
    let mut recv = rank.comm.stream().alloc_zeros::<f32>(t.elem_count() / rank.comm.world())?;
    with_elements(t, |send| Ok(rank.comm.reduce_scatter(&send, &mut recv, ReduceOp::Sum)?))?;
    from_slice(rank, recv, shape)
}

/// A tensor on the rank's device holding `slice` (no copy).
fn from_slice(rank: &Rank, slice: cudarc::driver::CudaSlice<f32>, shape: &[usize]) -> Result<Tensor, BoxError> {
    let storage = CudaStorage::wrap_cuda_slice(slice, rank.device.as_cuda_device()?.clone());
    Ok(Tensor::from_storage(candle_core::Storage::Cuda(storage), shape, candle_core::op::BackpropOp::none(), false))
}

/// Deterministic pseudo-random numbers (xorshift), the same on every rank for the same seed.
pub struct Lcg(u64);

impl Lcg {
    /// A generator from `seed`.
    pub fn new(seed: u64) -> Self {
        Lcg(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    /// The next value in [-1, 1).
    pub fn next_f32(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }

    /// The next small integer in -4..=4 (exact in any sum of a few hundred).
    pub fn next_small(&mut self) -> f32 {
        ((self.next_f32() + 1.0) * 4.5).floor().min(8.0) - 4.0
    }
}
