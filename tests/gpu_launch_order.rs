//! What the engine's early launches rely on: a kernel launched with programmatic stream
//! serialization (`Start::Early`) behind a `cuStreamWaitEvent` still waits for that event. The
//! staged path across nodes joins two streams between kernels this way; if the driver let the
//! kernel past the event, it would read what the other stream has not written yet.
//!
//! Hand-written kernels, no engine: a slow writer on one stream sets a flag; the other stream waits
//! for the writer's event and then runs a reader that takes the flag. Every case must read the flag
//! set.

mod common;

use cudarc::driver::sys;
use cudarc::driver::{CudaContext, CudaFunction, CudaStream};
use std::ffi::c_void;
use std::sync::Arc;

const PTX: &str = r#"
.version 8.0
.target sm_90
.address_size 64

// Spins `ns` nanoseconds of the global timer.
.func spin(.param .u64 ns)
{
    .reg .pred %p;
    .reg .b64 %rd<5>;
    ld.param.u64 %rd1, [ns];
    mov.u64 %rd2, %globaltimer;
$spin:
    nanosleep.u32 1000;
    mov.u64 %rd3, %globaltimer;
    sub.u64 %rd4, %rd3, %rd2;
    setp.lt.u64 %p, %rd4, %rd1;
    @%p bra $spin;
    ret;
}

// Spins `ns` nanoseconds, then sets *flag = 1 (release).
.visible .entry slow_set(.param .u64 flag, .param .u64 ns)
{
    .reg .b32 %r<2>;
    .reg .b64 %rd<3>;
    ld.param.u64 %rd1, [flag];
    ld.param.u64 %rd2, [ns];
    cvta.to.global.u64 %rd1, %rd1;
    call spin, (%rd2);
    mov.u32 %r1, 1;
    st.release.gpu.global.u32 [%rd1], %r1;
    ret;
}

// Lets its dependents launch at once, then spins `ns` nanoseconds: the shape of an engine kernel
// before a launch queued early behind it.
.visible .entry primary(.param .u64 ns)
{
    .reg .b64 %rd<2>;
    griddepcontrol.launch_dependents;
    ld.param.u64 %rd1, [ns];
    call spin, (%rd1);
    ret;
}

// Waits for the grids it depends on, then copies *flag to *out.
.visible .entry reader(.param .u64 flag, .param .u64 out)
{
    .reg .b32 %r<2>;
    .reg .b64 %rd<3>;
    griddepcontrol.wait;
    ld.param.u64 %rd1, [flag];
    ld.param.u64 %rd2, [out];
    cvta.to.global.u64 %rd1, %rd1;
    cvta.to.global.u64 %rd2, %rd2;
    ld.acquire.gpu.global.u32 %r1, [%rd1];
    st.global.u32 [%rd2], %r1;
    ret;
}
"#;

/// Launches `f` as one thread with `params` (pointers to each parameter's value) on `stream`, early
/// (programmatic stream serialization) or plainly.
fn launch(stream: &CudaStream, f: &CudaFunction, params: &mut [*mut c_void], early: bool) {
    // SAFETY: an all-zero attribute is a valid value of the union, then set as the driver reads it.
    let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
    attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attr.value.programmaticStreamSerializationAllowed = 1;
    let config = sys::CUlaunchConfig {
        gridDimX: 1,
        gridDimY: 1,
        gridDimZ: 1,
        blockDimX: 1,
        blockDimY: 1,
        blockDimZ: 1,
        sharedMemBytes: 0,
        hStream: stream.cu_stream(),
        attrs: &mut attr,
        numAttrs: u32::from(early),
    };
    // SAFETY: `params` matches the kernel's parameters and the values outlive the call (the driver
    // copies them when the launch is queued); the addresses they hold stay allocated until the
    // streams are synchronised.
    unsafe { sys::cuLaunchKernelEx(&config, f.cu_function(), params.as_mut_ptr(), std::ptr::null_mut()) }
        .result()
        .expect("cuLaunchKernelEx");
}

/// One device word, freed on drop.
struct Word(sys::CUdeviceptr);

impl Word {
    fn new() -> Word {
        let mut p = 0;
        // SAFETY: allocation into a local; the context is current (bound by the test).
        unsafe { sys::cuMemAlloc_v2(&mut p, 4) }.result().expect("cuMemAlloc");
        Word(p)
    }

    fn set(&self, v: u32) {
        // SAFETY: one u32 at an address this value allocated.
        unsafe { sys::cuMemsetD32_v2(self.0, v, 1) }.result().expect("cuMemsetD32");
    }

    fn get(&self) -> u32 {
        let mut v = 0u32;
        // SAFETY: one u32 from an address this value allocated, into a local.
        unsafe { sys::cuMemcpyDtoH_v2(&mut v as *mut u32 as *mut c_void, self.0, 4) }.result().expect("cuMemcpyDtoH");
        v
    }
}

impl Drop for Word {
    fn drop(&mut self) {
        // SAFETY: allocated by `new`, no launch uses it after the test synchronised.
        unsafe { sys::cuMemFree_v2(self.0) };
    }
}

/// How the reader's stream is set up before the reader is queued behind the writer's event.
#[derive(Clone, Copy, Debug)]
enum Case {
    /// A running early-launching primary kernel, then the event wait, then the reader early.
    PrimaryThenWaitEarly,
    /// The event wait then the reader early, nothing running on the stream before.
    WaitEarly,
    /// As `PrimaryThenWaitEarly`, the reader launched plainly (the control).
    PrimaryThenWaitPlain,
}

#[test]
fn an_early_launch_waits_for_an_event_its_stream_waits_on() {
    let Some(default) = common::gpu("an_early_launch_waits_for_an_event_its_stream_waits_on") else { return };
    let ctx: Arc<CudaContext> = default.context().clone();
    ctx.bind_to_thread().expect("bind");
    let module = ctx.load_module(cudarc::nvrtc::Ptx::from_src(PTX)).expect("load the test kernels");
    let slow_set = module.load_function("slow_set").expect("slow_set");
    let primary = module.load_function("primary").expect("primary");
    let reader = module.load_function("reader").expect("reader");
    let (writer_stream, reader_stream) = (ctx.new_stream().expect("stream"), ctx.new_stream().expect("stream"));
    let (flag, out) = (Word::new(), Word::new());
    let rounds = 50;
    let mut wrong = Vec::new();
    for case in [Case::PrimaryThenWaitEarly, Case::WaitEarly, Case::PrimaryThenWaitPlain] {
        let mut early_reads = 0;
        for _ in 0..rounds {
            flag.set(0);
            out.set(7);
            ctx.synchronize().expect("synchronize");
            let (mut f, mut o, mut slow_ns, mut primary_ns) = (flag.0, out.0, 200_000u64, 20_000u64);
            if !matches!(case, Case::WaitEarly) {
                launch(&reader_stream, &primary, &mut [&mut primary_ns as *mut u64 as *mut c_void], true);
            }
            launch(
                &writer_stream,
                &slow_set,
                &mut [&mut f as *mut u64 as *mut c_void, &mut slow_ns as *mut u64 as *mut c_void],
                false,
            );
            let written = writer_stream.record_event(None).expect("cuEventRecord");
            reader_stream.wait(&written).expect("cuStreamWaitEvent");
            let early = !matches!(case, Case::PrimaryThenWaitPlain);
            launch(
                &reader_stream,
                &reader,
                &mut [&mut f as *mut u64 as *mut c_void, &mut o as *mut u64 as *mut c_void],
                early,
            );
            ctx.synchronize().expect("synchronize");
            match out.get() {
                1 => {}
                0 => early_reads += 1,
                v => panic!("{case:?}: the reader wrote {v}, neither the flag's old value nor its new one"),
            }
        }
        println!("{case:?}: {early_reads} of {rounds} reads before the awaited event");
        if early_reads > 0 {
            wrong.push((case, early_reads));
        }
    }
    assert!(wrong.is_empty(), "launches ran before the event their stream waited on: {wrong:?} of {rounds} each");
}
