//! Shared by the fuzz targets (`fuzz_*.rs`): how many executions to run, and a watchdog that turns a
//! hang into a failure naming the input.
//!
//! `OXCCL_FUZZ_CASES` sets the executions per target (default 10,000, what CI runs);
//! `scripts/fuzz.sh` runs many more.

#![allow(dead_code)]

use proptest::test_runner::Config;
use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};
use std::thread::ThreadId;
use std::time::{Duration, Instant};

/// Executions per fuzz target.
pub fn cases() -> u32 {
    std::env::var("OXCCL_FUZZ_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(10_000)
}

/// The proptest configuration of a fuzz target: [`cases`] executions from a fixed seed (the same
/// inputs every CI run; `PROPTEST_RNG_SEED` picks others, as `scripts/fuzz.sh` does), failures kept
/// as regression files next to the test.
pub fn config() -> Config {
    let mut c = Config { cases: cases(), max_shrink_iters: 2_000, ..Config::default() };
    if std::env::var_os("PROPTEST_RNG_SEED").is_none() {
        c.rng_seed = proptest::test_runner::RngSeed::Fixed(0x0C_C1_F0_22);
    }
    c
}

/// The longest one execution may take before the watchdog calls it a hang.
pub const HANG: Duration = Duration::from_secs(20);

/// The longest one execution may take before it fails as too slow (a small input handled in
/// quadratic time or worse shows here long before it hangs).
pub const SLOW: Duration = Duration::from_secs(2);

/// Per test thread, the input under test and when it started.
fn current() -> &'static Mutex<HashMap<ThreadId, (Instant, String)>> {
    static CURRENT: OnceLock<Mutex<HashMap<ThreadId, (Instant, String)>>> = OnceLock::new();
    CURRENT.get_or_init(|| Mutex::new(HashMap::new()))
}

/// Runs `f` on `input` under the watchdog: past [`HANG`] the process exits naming the input; past
/// [`SLOW`] the execution panics (a test failure proptest reports with the input).
pub fn guard<T>(input: &str, f: impl FnOnce() -> T) -> T {
    static WATCHDOG: OnceLock<()> = OnceLock::new();
    WATCHDOG.get_or_init(|| {
        std::thread::spawn(|| {
            loop {
                std::thread::sleep(Duration::from_millis(200));
                let cur = current().lock().unwrap_or_else(|p| p.into_inner());
                if let Some((_, input)) = cur.values().find(|(t, _)| t.elapsed() > HANG) {
                    use std::io::Write;
                    let shown: String = input.chars().take(4000).collect();
                    let _ =
                        writeln!(std::io::stderr(), "HANG: one execution ran past {HANG:?} on this input:\n{shown}");
                    std::process::exit(101);
                }
            }
        });
    });
    /// Takes the thread's entry out however `f` ends (a panic is a failure, not a hang).
    struct Entry(ThreadId);
    impl Drop for Entry {
        fn drop(&mut self) {
            current().lock().unwrap_or_else(|p| p.into_inner()).remove(&self.0);
        }
    }
    let me = std::thread::current().id();
    current().lock().unwrap_or_else(|p| p.into_inner()).insert(me, (Instant::now(), input.to_string()));
    let entry = Entry(me);
    let t = Instant::now();
    let out = f();
    let took = t.elapsed();
    drop(entry);
    assert!(took < SLOW, "one execution took {took:?} (more than {SLOW:?})");
    out
}
