//! CUDA graphs of calls made on several rank streams: [`capture`] records them as one graph that
//! replays every rank's launches.

use crate::error::{Error, Result};
use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode, CUstreamCaptureStatus};
use cudarc::driver::{CudaGraph, CudaStream};
use std::sync::Arc;

/// Captures the work `f` queues on `streams` (one per rank, repeats allowed; at least one) as one
/// instantiated graph. The first distinct stream begins the capture, the others join it through an
/// event and are joined back before it ends, so a replay runs every rank's launches. `f` must only
/// queue work: a prepared call ([`crate::Communicator::prepare`]), whose plan is already built.
/// Buffers used in `f` must not carry cudarc's event tracking (its waits on events recorded outside
/// the capture would end it). Whatever fails inside, the capture is ended before returning. The
/// communicator keeps the plans captured calls launched alive through
/// [`crate::Communicator::clear_plans`] (see [`crate::Communicator::captured_plans`]); the graph
/// must not be launched after the communicator is dropped.
pub fn capture(streams: &[Arc<CudaStream>], f: impl FnOnce() -> Result<()>) -> Result<CudaGraph> {
    let distinct = distinct_streams(streams);
    let Some((first, others)) = distinct.split_first() else {
        return Err(Error::BufferCount { what: "rank streams", expected: 1, got: 0 });
    };
    let event = |s: &Arc<CudaStream>| s.record_event(None).map_err(Error::driver("cuEventRecord"));
    first
        .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .map_err(Error::driver("cuStreamBeginCapture"))?;
    let forked = event(first)
        .and_then(|fork| others.iter().try_for_each(|s| s.wait(&fork).map_err(Error::driver("cuStreamWaitEvent"))));
    let called = forked.and_then(|()| f());
    let joined = others.iter().try_for_each(|s| first.wait(&event(s)?).map_err(Error::driver("cuStreamWaitEvent")));
    let end = || first.end_capture(CUgraphInstantiate_flags(0)).map_err(Error::driver("cuStreamEndCapture"));
    let mut graph = end();
    if graph.is_err() && !matches!(first.capture_status(), Ok(CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)) {
        // cudarc reports an error recorded earlier on the context before it ends the capture; the
        // second call ends it.
        graph = end();
    }
    called?;
    joined?;
    graph?.ok_or(Error::Config { field: "graph", why: "the capture recorded no work".into() })
}

/// `streams` without repeats (the same stream of the same device), in order.
pub fn distinct_streams(streams: &[Arc<CudaStream>]) -> Vec<&Arc<CudaStream>> {
    let mut distinct: Vec<&Arc<CudaStream>> = Vec::new();
    for s in streams {
        if !distinct.iter().any(|d| d.context().ordinal() == s.context().ordinal() && d.cu_stream() == s.cu_stream()) {
            distinct.push(s);
        }
    }
    distinct
}
