//! The inter-node layer without a GPU: NCCL's loader names what it tried, and the codes passed
//! to NCCL are nccl.h's.

#![cfg(unix)]

use oxccl::internode::{Nccl, nccl_dtype, nccl_op};
use oxccl::{Config, DType, Error, ReduceOp};

#[test]
fn a_missing_nccl_is_an_error_naming_every_name_tried() {
    let names = vec!["/nonexistent/oxccl-test/libnccl.so.2".to_string(), "liboxccl-no-such-nccl.so".to_string()];
    let (tried, why) = Nccl::load_from(&names).unwrap_err();
    assert_eq!(tried, names);
    assert!(why.contains("/nonexistent/oxccl-test/libnccl.so.2") && why.contains("liboxccl-no-such-nccl.so"), "{why}");
    let e = Error::NoNccl { tried, why };
    assert!(e.to_string().contains("set OXCCL_NCCL"), "{e}");
}

#[test]
fn a_library_without_nccls_functions_is_refused_by_name() {
    // The C library loads everywhere and has no NCCL symbol.
    let (_, why) = Nccl::load_from(&["libc.so.6".to_string()]).unwrap_err();
    assert!(why.contains("libc.so.6: no symbol ncclGetUniqueId"), "{why}");
}

#[test]
fn type_and_operator_codes_are_ncclh() {
    // ncclFloat32 7, ncclFloat16 6, ncclBfloat16 9, ncclInt32 2, ncclUint32 3, ncclUint8 1,
    // ncclFloat64 8, ncclInt64 4, ncclUint64 5, ncclInt8 0, ncclFloat8e4m3 10, ncclFloat8e5m2 11.
    let codes: Vec<i32> = DType::ALL.iter().map(|&d| nccl_dtype(d)).collect();
    assert_eq!(codes, [7, 6, 9, 2, 3, 1, 8, 4, 5, 0, 10, 11]);
    // ncclSum 0, ncclMin 3, ncclMax 2.
    assert_eq!(
        [ReduceOp::Sum, ReduceOp::Min, ReduceOp::Max, ReduceOp::Prod, ReduceOp::Avg].map(nccl_op),
        [0, 3, 2, 1, 4]
    );
}

#[test]
fn zero_ranks_per_node_and_empty_pieces_are_config_errors() {
    for (c, field) in [
        (Config { ranks_per_node: Some(0), ..Config::default() }, "ranks_per_node"),
        (Config { inter_piece_bytes: Some(0), ..Config::default() }, "inter_piece_bytes"),
    ] {
        match oxccl::config::validate_config(&c) {
            Err(Error::Config { field: f, .. }) => assert_eq!(f, field),
            other => panic!("{field}: {other:?}"),
        }
    }
}
