//! API misuse that needs no GPU: building a communicator from device numbers reports a missing
//! driver or device as a typed error, never a panic. Runs the same with or without a GPU.

use oxccl::{Communicator, Config, Error};

#[test]
fn from_devices_names_what_is_missing() {
    let e = Communicator::from_devices(&[], Config::default()).expect_err("no ranks");
    assert!(matches!(e, Error::RankCount { ranks: 0, .. }), "{e}");
    let e = Communicator::from_devices(&[0; 17], Config::default()).expect_err("too many ranks");
    assert!(matches!(e, Error::RankCount { ranks: 17, .. }), "{e}");
    // No machine has this many devices: without a driver that is what is reported, with one the
    // device number.
    let e = Communicator::from_devices(&[1 << 20], Config::default()).expect_err("no such device");
    match e {
        Error::NoDriver => assert_eq!(e.to_string(), "the CUDA driver library is not installed"),
        Error::NoSuchDevice { ordinal, devices } => assert!(ordinal == 1 << 20 && devices < ordinal, "{e}"),
        other => panic!("unexpected error: {other}"),
    }
}

/// The automatic TMA pipeline in an H200's shared memory (227 KiB less the engine's header): 32 KiB
/// chunks with four stages for one source, smaller chunks and fewer stages as sources share a stage,
/// and what the configuration fixes kept.
#[test]
fn auto_pipeline_prefers_large_chunks() {
    use oxccl::auto_pipeline;
    let room = 232_448 - oxccl_kernels::abi::smem::STAGES;
    assert_eq!(auto_pipeline(room, 1, None, None), (32 * 1024, 4));
    assert_eq!(auto_pipeline(room, 2, None, None), (28 * 1024, 4));
    assert_eq!(auto_pipeline(room, 4, None, None), (18 * 1024, 3));
    assert_eq!(auto_pipeline(room, 8, None, None), (14 * 1024, 2));
    assert_eq!(auto_pipeline(room, 16, None, None), (7 * 1024, 2));
    assert_eq!(auto_pipeline(room, 8, None, Some(4)), (7 * 1024, 4));
    assert_eq!(auto_pipeline(room, 1, Some(16384), None), (16384, 4));
    assert_eq!(auto_pipeline(room, 8, Some(16384), None), (16384, 1));
    assert_eq!(
        auto_pipeline(room, 8, Some(65536), None),
        (65536, 1),
        "a chunk too large is the engine's error to report"
    );
    assert_eq!(auto_pipeline(room, 2, Some(4096), Some(9)), (4096, 9));
    assert_eq!(auto_pipeline(room, 1, None, Some(0)), (32 * 1024, 0), "zero stages: the engine's check names it");
    for slots in 1..=16 {
        let (chunk, stages) = auto_pipeline(room, slots, None, None);
        assert!(chunk as usize * slots as usize * stages as usize <= room, "{slots} sources: {chunk} × {stages}");
        assert!(chunk >= 1024 && chunk % 1024 == 0 && (2..=4).contains(&stages), "{slots} sources: {chunk} × {stages}");
    }
}

/// Where every combine stores from registers: two stages of the largest chunk that fits (no 32 KiB
/// cap), at most 2^20 - 1 bytes per stage; a given chunk as `auto_pipeline`.
#[test]
fn combining_pipeline_takes_two_stages_of_the_largest_chunk() {
    use oxccl::{auto_pipeline, combining_pipeline};
    let room = 232_448 - oxccl_kernels::abi::smem::STAGES;
    assert_eq!(combining_pipeline(room, 2, None, None), (56 * 1024, 2));
    assert_eq!(combining_pipeline(room, 4, None, None), (28 * 1024, 2));
    assert_eq!(combining_pipeline(room, 8, None, None), (14 * 1024, 2));
    assert_eq!(combining_pipeline(room, 2, None, Some(4)), (28 * 1024, 4));
    assert_eq!(combining_pipeline(room, 2, None, Some(1)), (113 * 1024, 1));
    assert_eq!(combining_pipeline(room, 2, Some(16384), None), auto_pipeline(room, 2, Some(16384), None));
    assert_eq!(combining_pipeline(room, 2, Some(8192), Some(3)), (8192, 3));
    // The mbarrier counts at most 2^20 - 1 bytes per phase.
    let (chunk, stages) = combining_pipeline(8 << 20, 2, None, None);
    assert!((2 * chunk as usize) < (1 << 20) && stages == 2, "{chunk} × {stages}");
    for slots in 1..=16 {
        let (chunk, stages) = combining_pipeline(room, slots, None, None);
        assert!(chunk as usize * slots as usize * stages as usize <= room, "{slots} sources: {chunk} × {stages}");
        assert!(chunk >= auto_pipeline(room, slots, None, None).0, "{slots} sources: {chunk} not below the default");
    }
}

/// An error that wraps another returns it from `source`, typed, down to the operating system's
/// error; its message also ends with the cause's text (once), so printing the error alone says it all.
/// An error with no cause has no source.
#[test]
fn an_error_chains_its_cause() {
    use oxccl::bootstrap::BootstrapError;
    use std::error::Error as _;
    let inner = oxccl_host::tccl::PlanError::Root { root: 9, ranks: 4 };
    let e = Error::from(inner.clone());
    assert_eq!(e.to_string(), format!("plan: {inner}"));
    let source = e.source().expect("a plan error's cause");
    assert_eq!(source.downcast_ref::<oxccl_host::tccl::PlanError>(), Some(&inner));

    let io = std::io::Error::other("connection refused");
    let e = Error::from(BootstrapError::Io { what: "connecting to the root".into(), source: io });
    assert_eq!(e.to_string(), "bootstrap: connecting to the root: connection refused");
    let bootstrap = e.source().expect("the bootstrap error");
    assert!(matches!(bootstrap.downcast_ref::<BootstrapError>(), Some(BootstrapError::Io { .. })), "{bootstrap}");
    let os = bootstrap.source().expect("the io error");
    assert_eq!(os.downcast_ref::<std::io::Error>().map(|e| e.kind()), Some(std::io::ErrorKind::Other));
    assert!(os.source().is_none());

    assert!(Error::NoDriver.source().is_none());
    assert!(Error::Config { field: "chunk", why: "not a multiple of 16".into() }.source().is_none());
}

/// What a training loop needs: a communicator and a compiled plan can move to and be shared between
/// threads, and errors convert into `anyhow`-style `Box<dyn Error + Send + Sync>`.
#[test]
fn handles_and_errors_cross_threads() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<Communicator>();
    send_sync::<Error>();
    let e: Box<dyn std::error::Error + Send + Sync + 'static> = Box::new(Error::NoDriver);
    assert_eq!(e.to_string(), "the CUDA driver library is not installed");
}

/// A device status record becomes the error that names it; barrier flags print as call counts with
/// what their high bits say, not as raw 64-bit words.
#[test]
fn device_records_read_as_errors() {
    use oxccl::engine::abi::{BARRIER_ABORTED, BARRIER_REVOKED, BARRIER_TAKEN, Status, WaitKind};
    let st = |kind: WaitKind, expected: u64, observed: u64| Status {
        errors: 2,
        kind: kind as u32,
        rank: 3,
        cta: 1,
        peer: 5,
        reserved: 0,
        expected,
        observed,
    };
    let text = |s: &Status| oxccl::engine::status_error(s).expect("an error").to_string();
    assert_eq!(
        text(&st(WaitKind::StartBarrier, 2, 1 | BARRIER_TAKEN)),
        "timed out waiting for peer to reach the collective (start barrier): rank 3 CTA 1, peer 5, expected 2, \
         saw 1 (taken) (2 CTA(s) reported errors)"
    );
    assert!(text(&st(WaitKind::StartBarrier, 2, 0)).contains("expected 2, saw 0 ("));
    assert!(text(&st(WaitKind::EndBarrier, 4, 3 | BARRIER_ABORTED)).contains("expected 4, saw 3 (aborted)"));
    assert!(text(&st(WaitKind::BulkLoad, 6, 5)).contains("expected 6, saw 5 ("));
    let e = oxccl::engine::status_error(&st(WaitKind::PeerAborted, 7, 7 | BARRIER_REVOKED)).expect("an error");
    assert!(matches!(e, Error::PeerAborted { rank: 3, cta: 1, peer: 5, call: 7, errors: 2 }), "{e}");
    assert_eq!(e.to_string(), "rank 3 CTA 1 stopped call 7: peer 5 gave up that call (2 CTA(s) reported errors)");
    let e = oxccl::engine::status_error(&st(WaitKind::OutOfStep, 1, 2 | BARRIER_TAKEN)).expect("an error");
    assert!(matches!(e, Error::OutOfStep { call: 1, peer_call: 2, .. }), "{e}");
    assert!(oxccl::engine::status_error(&Status { errors: 0, ..st(WaitKind::BulkLoad, 0, 0) }).is_none());
}
