//! Helpers shared by the integration tests.
#![allow(dead_code)]

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

/// A small deterministic generator (splitmix64) so GPU tests need no extra crates and are reproducible
/// from the printed seed.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 { 0 } else { self.next() % n }
    }
    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
}

/// Prints a skip notice straight to the terminal: the test harness captures `eprintln!` of passing
/// tests, and a skipped GPU test must not pass silently.
pub fn skip(message: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "{message}");
}

/// Holds `stream` on the host for `ms` milliseconds (a host function that sleeps): work queued on
/// it after this starts that much later.
pub fn hold(stream: &cudarc::driver::CudaStream, ms: u64) {
    /// # Safety
    /// None needed: the argument is a duration in milliseconds, never dereferenced.
    unsafe extern "C" fn sleep(ms: *mut std::ffi::c_void) {
        std::thread::sleep(std::time::Duration::from_millis(ms as u64));
    }
    stream.context().bind_to_thread().unwrap();
    // SAFETY: a host function on a live stream; its argument is the duration, not a pointer.
    unsafe { cudarc::driver::sys::cuLaunchHostFunc(stream.cu_stream(), Some(sleep), ms as *mut _) }.result().unwrap();
}
