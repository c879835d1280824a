//! API misuse that needs no GPU: building a communicator from device numbers reports a missing
//! driver or device as a typed error, never a panic. Runs the same with or without a GPU.

use oxccl::{Communicator, Config, Error};

#[test]
fn from_devices_names_what_is_missing() {
    let e = Communicator::from_devices(&[], Config::default()).err().expect("no ranks");
    assert!(matches!(e, Error::RankCount { ranks: 0, .. }), "{e}");
    let e = Communicator::from_devices(&[0; 17], Config::default()).err().expect("too many ranks");
    assert!(matches!(e, Error::RankCount { ranks: 17, .. }), "{e}");
    // No machine has this many devices: without a driver that is what is reported, with one the
    // device number.
    let e = Communicator::from_devices(&[1 << 20], Config::default()).err().expect("no such device");
    match e {
        Error::NoDriver => assert_eq!(e.to_string(), "the CUDA driver library is not installed"),
        Error::NoSuchDevice { ordinal, devices } => assert!(ordinal == 1 << 20 && devices < ordinal, "{e}"),
        other => panic!("unexpected error: {other}"),
    }
}
