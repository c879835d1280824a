//! Helpers shared by the integration tests.
#![allow(dead_code)]

use rand::RngExt;
use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;

/// `ptxas` from `OXCCL_PTXAS`, the PATH, or the `nvidia-cuda-nvcc` Python wheel; `None` if absent.
pub fn ptxas() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("OXCCL_PTXAS") {
        return Some(PathBuf::from(p));
    }
    if Command::new("ptxas").arg("--version").output().is_ok_and(|o| o.status.success()) {
        return Some(PathBuf::from("ptxas"));
    }
    let out = Command::new("python3")
        .args(["-c", "import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], 'cu13', 'bin', 'ptxas'))"])
        .output()
        .ok()?;
    let p = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    p.is_file().then_some(p)
}

/// Holds the GPUs for the calling test until its thread ends: a collective's CTAs must all be
/// resident, so two tests of one binary must not share the GPUs at once (`cargo test` runs tests on
/// parallel threads). Re-entrant on one thread, so tests run one after another on a single thread
/// (`--test-threads=1`) never wait on themselves.
fn hold_gpus() {
    use std::cell::RefCell;
    use std::sync::{Mutex, MutexGuard};
    static GPUS: Mutex<()> = Mutex::new(());
    thread_local!(static TURN: RefCell<Option<MutexGuard<'static, ()>>> = const { RefCell::new(None) });
    TURN.with(|t| {
        if t.borrow().is_none() {
            *t.borrow_mut() = Some(GPUS.lock().unwrap_or_else(|e| e.into_inner()));
        }
    });
}

/// The first CUDA device if it is a usable Hopper GPU, else `None` after printing why the caller's test
/// is skipped; with `OXCCL_REQUIRE_GPU=1` (the GPU machine's runs) a missing or unusable GPU fails the
/// test instead. Holds the GPUs for the calling test (see `hold_gpus`).
pub fn gpu(test: &str) -> Option<Arc<cudarc::driver::CudaStream>> {
    hold_gpus();
    match oxccl::engine::probe_gpu() {
        Ok(ctx) => Some(ctx.default_stream()),
        Err(why) => {
            no_gpu(test, &why);
            None
        }
    }
}

/// Skips loudly, or panics where `OXCCL_REQUIRE_GPU=1` says a GPU must be there.
fn no_gpu(test: &str, why: &str) {
    if std::env::var_os("OXCCL_REQUIRE_GPU").is_some_and(|v| v == "1") {
        panic!("{test}: OXCCL_REQUIRE_GPU=1 but no usable GPU: {why}");
    }
    skip(&format!("skipped: no GPU ({test}: {why})"));
}

/// Every visible CUDA device if there are at least two Hopper GPUs, else `None` after printing why
/// the caller's test is skipped. `OXCCL_GPUS` limits how many are used.
pub fn gpus(test: &str) -> Option<Vec<Arc<cudarc::driver::CudaContext>>> {
    hold_gpus();
    let have = match oxccl::engine::probe_gpu() {
        Ok(_) => cudarc::driver::CudaContext::device_count().unwrap_or(0) as usize,
        Err(why) => {
            no_gpu(test, &why);
            return None;
        }
    };
    let want = std::env::var("OXCCL_GPUS").ok().and_then(|s| s.parse().ok()).unwrap_or(have).min(have);
    if want < 2 {
        skip(&format!("skipped: fewer than 2 GPUs ({test}: {have} visible, {want} used)"));
        return None;
    }
    match oxccl::engine::probe_gpus(want) {
        Ok(g) => Some(g),
        Err(why) => {
            no_gpu(test, &why);
            None
        }
    }
}

/// The tests' generator: rand's `StdRng`, always seeded ([`rng`]), so a run reproduces from its
/// printed seed ([`seed_from_env`]).
pub type Rng = rand::rngs::StdRng;

/// A generator seeded with `seed`.
pub fn rng(seed: u64) -> Rng {
    rand::SeedableRng::seed_from_u64(seed)
}

/// `n` random bytes.
pub fn random_bytes(rng: &mut Rng, n: usize) -> Vec<u8> {
    let mut bytes = vec![0; n];
    rng.fill(&mut bytes[..]);
    bytes
}

/// Prints a skip notice straight to the terminal: the test harness captures `eprintln!` of passing
/// tests, and a skipped GPU test must not pass silently.
pub fn skip(message: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "{message}");
}

/// A stream held on the host until the test releases it (or the watchdog, after `guard`): work
/// queued on it afterwards waits, and a test can check that other work ends meanwhile without timing
/// anything.
pub struct Gate(oxccl::gate::HostGate);

impl Gate {
    /// Holds `stream` after the work queued on it so far until [`Gate::release`], or for `guard`.
    pub fn hold(stream: &cudarc::driver::CudaStream, guard: std::time::Duration) -> Gate {
        let gate = oxccl::gate::HostGate::new(guard);
        gate.hold(stream).unwrap();
        Gate(gate)
    }

    /// Lets the held stream go on.
    pub fn release(&self) {
        self.0.release()
    }

    /// Whether the watchdog had to open the gate.
    pub fn forced(&self) -> bool {
        self.0.forced()
    }
}

/// Polls `done` until it says true, for at most `guard` (a guard against a hang, long enough never
/// to decide a result): whether it did.
pub fn ends_within(guard: std::time::Duration, mut done: impl FnMut() -> bool) -> bool {
    let start = std::time::Instant::now();
    loop {
        if done() {
            return true;
        }
        if start.elapsed() > guard {
            return false;
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

/// Whether everything queued on `stream` has ended.
pub fn idle(stream: &cudarc::driver::CudaStream) -> bool {
    stream.context().bind_to_thread().unwrap();
    // SAFETY: a status query of a live stream.
    match unsafe { cudarc::driver::sys::cuStreamQuery(stream.cu_stream()) } {
        cudarc::driver::sys::CUresult::CUDA_SUCCESS => true,
        cudarc::driver::sys::CUresult::CUDA_ERROR_NOT_READY => false,
        e => panic!("cuStreamQuery: {e:?}"),
    }
}

/// A count of cases or rounds from the environment variable `name`, else `default`. A value that
/// does not parse, or 0, fails the test: a run of no cases would pass having checked nothing.
pub fn count_from_env(name: &str, default: usize) -> usize {
    match std::env::var(name) {
        Err(std::env::VarError::NotPresent) => default,
        Ok(v) => match v.parse::<usize>() {
            Ok(n) if n > 0 => n,
            _ => panic!("{name}={v}: give a positive count"),
        },
        Err(e) => panic!("{name}: {e}"),
    }
}

/// The timeout of the communicators a test builds from `OXCCL_TEST_TIMEOUT` (seconds), else
/// `default`: a run under compute-sanitizer starts each process and launch many times slower, and
/// its bootstrap and waits need longer bounds. A value that does not parse, or 0, fails the test.
pub fn timeout_from_env(default: std::time::Duration) -> std::time::Duration {
    std::time::Duration::from_secs(count_from_env("OXCCL_TEST_TIMEOUT", default.as_secs() as usize) as u64)
}

/// The random seed from `OXCCL_SEED`, else `default`. A value that does not parse fails the test:
/// a mistyped seed would otherwise rerun the default and seem to reproduce nothing.
pub fn seed_from_env(default: u64) -> u64 {
    match std::env::var("OXCCL_SEED") {
        Err(std::env::VarError::NotPresent) => default,
        Ok(v) => v.parse().unwrap_or_else(|_| panic!("OXCCL_SEED={v}: give a decimal u64")),
        Err(e) => panic!("OXCCL_SEED: {e}"),
    }
}

/// A small integer `x` (|x| ≤ 15) spread over the whole i32 range: `x · (2^27 + 1)`, monotonic in
/// `x`, never `i32::MIN` or `i32::MAX` (the Min and Max poisons), and large enough that sums of a few
/// wrap, so integer tests exercise wrapping adds.
pub fn spread_i32(x: i32) -> i32 {
    assert!(x.abs() <= 15, "{x}: spread_i32 takes |x| <= 15");
    x * ((1 << 27) + 1)
}

/// [`spread_i32`] as u32, plus 1: never 0 or `u32::MAX` (the Min and Max poisons); a negative `x`
/// gives a value from 2^31 up, which a signed comparison would order below the others, so Min and
/// Max on u32 must compare unsigned to match the reference.
pub fn spread_u32(x: i32) -> u32 {
    (spread_i32(x) as u32).wrapping_add(1)
}

/// `x` encoded as `dtype`, the one encoding of test values. The float types hold `x` rounded to
/// the type (FP8: to nearest, saturating). The integer types take a small integer (`|x| ≤ 15`) spread over their range,
/// monotonic in `x` and never their Min or Max poison, so that sums of a few wrap: i32 and u32 as
/// [`spread_i32`] and [`spread_u32`], i64 and u64 likewise with `2^59 + 1`, i8 as `8x + 1`, u8 as
/// `8x + 129` (odd: a product of several is not 0 modulo 256).
pub fn element(dtype: oxccl::DType, x: f64) -> Vec<u8> {
    use oxccl::DType;
    let int = || {
        assert!(x.fract() == 0.0 && x.abs() <= 15.0, "{x}: integer elements take |x| <= 15");
        x as i32
    };
    let spread_i64 = |x: i32| x as i64 * ((1 << 59) + 1);
    match dtype {
        DType::F32 => (x as f32).to_le_bytes().to_vec(),
        DType::F64 => x.to_le_bytes().to_vec(),
        DType::F16 => half::f16::from_f64(x).to_le_bytes().to_vec(),
        DType::Bf16 => half::bf16::from_f64(x).to_le_bytes().to_vec(),
        DType::I32 => spread_i32(int()).to_le_bytes().to_vec(),
        DType::U32 => spread_u32(int()).to_le_bytes().to_vec(),
        DType::I64 => spread_i64(int()).to_le_bytes().to_vec(),
        DType::U64 => (spread_i64(int()) as u64).wrapping_add(1).to_le_bytes().to_vec(),
        DType::I8 => vec![(int() * 8 + 1) as i8 as u8],
        DType::U8 => vec![(int() * 8 + 129) as u8],
        DType::F8e4m3 => vec![oxccl::F8E4M3::from_f32(x as f32).0],
        DType::F8e5m2 => vec![oxccl::F8E5M2::from_f32(x as f32).0],
    }
}

/// Random floats ([`random_float`], rounded to the element type), `bytes` of them encoded; `None`
/// for the integer types.
pub fn random_floats(dtype: oxccl::DType, rng: &mut Rng, bytes: usize) -> Option<Vec<u8>> {
    if !dtype.is_float() {
        return None;
    }
    let mut v = Vec::with_capacity(bytes + 8);
    while v.len() < bytes {
        v.extend(element(dtype, random_float(dtype, rng)));
    }
    v.truncate(bytes);
    Some(v)
}

/// A random float for `dtype`: in [-1000, 1000] in steps of 0.001, or for FP8 in [-16, 16] in
/// steps of 1/64 (E4M3 holds no more than 448: wider values would mostly saturate).
pub fn random_float(dtype: oxccl::DType, rng: &mut Rng) -> f64 {
    use oxccl::DType;
    match dtype {
        DType::F8e4m3 | DType::F8e5m2 => rng.random_range(0..2049) as f64 / 64.0 - 16.0,
        _ => rng.random_range(0..2_000_001) as f64 / 1000.0 - 1000.0,
    }
}

/// Where a test stops, for runs on machines without a debugger: unless dropped within `after`,
/// prints every thread's name, state and kernel wait channel, then each thread's stack (signalled
/// in turn to print its own). Set from `OXCCL_TEST_HANG_DUMP` (seconds) by the tests that use it.
pub struct HangDump {
    done: Arc<std::sync::atomic::AtomicBool>,
}

impl Drop for HangDump {
    fn drop(&mut self) {
        self.done.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

/// A [`HangDump`] after the seconds `OXCCL_TEST_HANG_DUMP` gives; none where it is unset.
pub fn hang_dump_from_env() -> Option<HangDump> {
    let secs: u64 = std::env::var("OXCCL_TEST_HANG_DUMP").ok()?.parse().ok()?;
    Some(hang_dump(std::time::Duration::from_secs(secs)))
}

/// See [`HangDump`].
pub fn hang_dump(after: std::time::Duration) -> HangDump {
    extern "C" fn print_stack(_: libc::c_int) {
        // Not async-signal-safe (it allocates): a diagnostic of a process that has stopped anyway.
        let bt = std::backtrace::Backtrace::force_capture();
        // SAFETY: gettid takes no arguments and cannot fail.
        let tid = unsafe { libc::syscall(libc::SYS_gettid) };
        eprintln!("--- thread {tid} ({:?}):\n{bt}", std::thread::current().name());
    }
    // SAFETY: a handler installed once for SIGUSR2, which nothing else in the tests uses.
    unsafe {
        let mut action: libc::sigaction = std::mem::zeroed();
        action.sa_sigaction = print_stack as extern "C" fn(libc::c_int) as usize;
        libc::sigemptyset(&mut action.sa_mask);
        libc::sigaction(libc::SIGUSR2, &action, std::ptr::null_mut());
    }
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watching = done.clone();
    std::thread::spawn(move || {
        let start = std::time::Instant::now();
        while start.elapsed() < after {
            if watching.load(std::sync::atomic::Ordering::SeqCst) {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        // SAFETY: as above.
        let me = unsafe { libc::syscall(libc::SYS_gettid) };
        let pid = std::process::id();
        let read = |p: String| std::fs::read_to_string(p).unwrap_or_default().trim().to_string();
        let mut tids = Vec::new();
        for t in std::fs::read_dir("/proc/self/task").into_iter().flatten().flatten() {
            let tid = t.file_name().to_string_lossy().into_owned();
            let stat = read(format!("/proc/self/task/{tid}/stat"));
            let state = stat.rsplit(')').next().unwrap_or("").split_whitespace().next().unwrap_or("?").to_string();
            eprintln!(
                "hang dump: thread {tid} {:?} state {state} wchan {:?} syscall {:?}",
                read(format!("/proc/self/task/{tid}/comm")),
                read(format!("/proc/self/task/{tid}/wchan")),
                read(format!("/proc/self/task/{tid}/syscall")),
            );
            tids.push(tid.parse::<libc::c_long>().unwrap_or(0));
        }
        for tid in tids.into_iter().filter(|&t| t != me && t != 0) {
            // SAFETY: a signal to a thread of this process, whose handler prints its stack.
            unsafe { libc::syscall(libc::SYS_tgkill, pid as libc::c_long, tid, libc::SIGUSR2 as libc::c_long) };
            std::thread::sleep(std::time::Duration::from_millis(300));
        }
        eprintln!("hang dump: done");
    });
    HangDump { done }
}

/// A plain 3-byte element type (no kernel of its own: moved in 1-byte units), for the tests of
/// copies of `oxccl::Plain` types.
#[derive(Clone, Copy, Debug, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C)]
pub struct Rgb(pub [u8; 3]);
// SAFETY: plain bytes, any bit pattern valid.
unsafe impl cudarc::driver::DeviceRepr for Rgb {}

/// The bundled MSCCL files: `OXCCL_MSCCL_DIR`, else this checkout's `host/tests/data/msccl`, else
/// the same path below the working directory, else `.device/host-msccl` (where
/// `scripts/gpu-stage.sh` puts them for a machine without the checkout).
pub fn msccl_dir() -> std::path::PathBuf {
    let candidates = [
        std::env::var_os("OXCCL_MSCCL_DIR").map(std::path::PathBuf::from),
        Some(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("host/tests/data/msccl")),
        Some("host/tests/data/msccl".into()),
        Some(".device/host-msccl".into()),
    ];
    candidates
        .into_iter()
        .flatten()
        .find(|d| d.is_dir())
        .expect("MSCCL files not found: set OXCCL_MSCCL_DIR to host/tests/data/msccl")
}

/// Small integers encoded as `dtype`: exact under any summation order for up to 16 ranks (the
/// integer types' values spread over their range, `common::spread_i32` and `spread_u32`: their
/// sums wrap, and u32 values lie on both sides of 2^31).
pub fn small_integers(dtype: oxccl::DType, bytes: usize, rng: &mut Rng) -> Vec<u8> {
    let mut out = Vec::with_capacity(bytes + 8);
    while out.len() < bytes {
        out.extend(element(dtype, rng.random_range(-8..=8) as f64));
    }
    out.truncate(bytes);
    out
}
