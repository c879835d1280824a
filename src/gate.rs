//! Streams held on the host: [`HostGate`] makes work queued on several streams start together on the
//! device, or lets a test watch other work end while one stream waits.

use crate::error::{Error, Result};
use cudarc::driver::CudaStream;
use std::sync::Arc;

/// Streams held on the host (a host function each that blocks until [`HostGate::release`] or the
/// gate's drop), so the work queued behind them starts on the device when released, not while the
/// host queues it; or, in a test, so that other work can be seen to end while they are held. A
/// watchdog opens the gate after the `guard` given to [`HostGate::new`] ([`HostGate::forced`]
/// says so), should anything wait on a held stream.
pub struct HostGate {
    state: Arc<GateState>,
}

#[derive(Default)]
struct GateState {
    /// (open, opened by the watchdog)
    open: std::sync::Mutex<(bool, bool)>,
    changed: std::sync::Condvar,
}

impl GateState {
    fn lock(&self) -> std::sync::MutexGuard<'_, (bool, bool)> {
        self.open.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl HostGate {
    /// A closed gate whose watchdog opens it after `guard`.
    pub fn new(guard: std::time::Duration) -> HostGate {
        let state = Arc::new(GateState::default());
        let watchdog = state.clone();
        std::thread::spawn(move || {
            let open = watchdog.lock();
            let (mut open, _) =
                watchdog.changed.wait_timeout_while(open, guard, |o| !o.0).unwrap_or_else(|e| e.into_inner());
            if !open.0 {
                *open = (true, true);
                watchdog.changed.notify_all();
            }
        });
        HostGate { state }
    }

    /// Holds `stream`, after the work queued on it so far, until the gate opens.
    pub fn hold(&self, stream: &CudaStream) -> Result<()> {
        /// # Safety
        /// `arg` is an `Arc` of a gate's state turned into a raw pointer for this one call.
        unsafe extern "C" fn wait(arg: *mut std::ffi::c_void) {
            // SAFETY: made by `Arc::into_raw` below, taken back once, here.
            let state = unsafe { Arc::from_raw(arg as *const GateState) };
            let mut open = state.lock();
            while !open.0 {
                open = state.changed.wait(open).unwrap_or_else(|e| e.into_inner());
            }
        }
        crate::engine::bind(stream.context())?;
        // In a capture the function would become a graph node, run once per launch of the graph
        // (or never), while its argument is one counted reference taken back once.
        let status = stream.capture_status().map_err(Error::driver("cuStreamIsCapturing"))?;
        if status != cudarc::driver::sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE {
            return Err(Error::Capturing { what: "holding a stream at a host gate" });
        }
        let arg = Arc::into_raw(self.state.clone()) as *mut std::ffi::c_void;
        // SAFETY: a host function on a live stream; its argument is a counted reference to the gate's
        // state, which the function releases (or, if the launch fails, is released here).
        let queued = unsafe { cudarc::driver::sys::cuLaunchHostFunc(stream.cu_stream(), Some(wait), arg) }.result();
        if queued.is_err() {
            // SAFETY: not queued, so not taken back by `wait`.
            drop(unsafe { Arc::from_raw(arg as *const GateState) });
        }
        queued.map_err(Error::driver("cuLaunchHostFunc"))
    }

    /// Opens the gate: the held streams go on.
    pub fn release(&self) {
        self.state.lock().0 = true;
        self.state.changed.notify_all();
    }

    /// Whether the watchdog opened the gate.
    pub fn forced(&self) -> bool {
        self.state.lock().1
    }
}

impl Drop for HostGate {
    fn drop(&mut self) {
        self.release();
    }
}
