//! The verifier and the symbolic postcondition checker.

mod common;

use common::random_program;
use oxccl_host::program::generators::Algorithm;
use oxccl_host::program::{Collective, OpId, OpKind, ProgramError, Rank, RecvOp, Slice, text};
use proptest::prelude::*;

#[test]
fn generators_satisfy_their_postconditions() {
    for algo in Algorithm::ALL {
        for (n, g) in [(1, 1), (1, 2), (1, 5), (2, 1), (2, 3), (3, 3), (4, 2), (5, 2)] {
            let p = algo.generate(n, g).unwrap();
            p.check().unwrap_or_else(|e| panic!("{algo} {n}x{g}: {e}"));
        }
    }
}

#[test]
fn op_counts_of_generators() {
    // HM moves every chunk to every other rank exactly once in the gather: N(N-1) transfers.
    for (n, g) in [(2, 4), (4, 4), (3, 8)] {
        let big_n = n * g;
        let ag = Algorithm::HmAllGather.generate(n, g).unwrap();
        assert_eq!(ag.ops.len() as u32, big_n * (big_n - 1));
        let rs = Algorithm::HmReduceScatter.generate(n, g).unwrap();
        assert_eq!(rs.ops.len() as u32, big_n * (n * (g - 1) + (n - 1)));
        let ar = Algorithm::HmAllReduce.generate(n, g).unwrap();
        assert_eq!(ar.ops.len(), ag.ops.len() + rs.ops.len());
    }
    let ring = Algorithm::RingAllReduce.generate(1, 8).unwrap();
    assert_eq!(ring.ops.len(), 2 * 8 * 7);
}

fn ring() -> oxccl_host::program::Program {
    Algorithm::RingAllReduce.generate(1, 3).unwrap()
}

#[test]
fn structural_errors_name_the_op() {
    let mut p = ring();
    if let OpKind::Transfer { dst_rank, .. } = &mut p.ops[2].kind {
        *dst_rank = Rank(7);
    }
    assert_eq!(p.verify(), Err(ProgramError::RankOutOfRange { op: OpId(2), rank: 7, ranks: 3 }));

    let mut p = ring();
    if let OpKind::Transfer { src, .. } = &mut p.ops[4].kind {
        *src = Slice::input(3);
    }
    assert!(matches!(p.verify(), Err(ProgramError::SliceOutOfRange { op: OpId(4), .. })));

    let mut p = ring();
    if let OpKind::Transfer { dst, .. } = &mut p.ops[1].kind {
        dst.count = 2;
    }
    assert!(matches!(p.verify(), Err(ProgramError::CountMismatch { op: OpId(1), .. })));

    let mut p = ring();
    if let OpKind::Transfer { dst_rank, src_rank, .. } = &mut p.ops[0].kind {
        *dst_rank = *src_rank;
    }
    assert!(matches!(p.verify(), Err(ProgramError::SelfTransfer { op: OpId(0), .. })));

    let mut p = ring();
    p.ops.push(oxccl_host::program::Op {
        kind: OpKind::Copy {
            rank: Rank(0),
            channel: 0,
            src: Slice::new(oxccl_host::program::BufferKind::Input, 0, 2),
            dst: Slice::new(oxccl_host::program::BufferKind::Input, 1, 2),
        },
        chunk: 0,
        step: 0,
        stage: 0,
    });
    assert!(matches!(p.verify(), Err(ProgramError::OverlappingLocal { .. })));
}

#[test]
fn postcondition_failures_name_the_last_writer() {
    // A contribution counted twice.
    let mut p = ring();
    let dup = p.ops[0];
    p.ops.insert(1, dup);
    let e = p.check().unwrap_err();
    assert!(matches!(e, ProgramError::Postcondition { .. }), "{e}");
    assert!(e.to_string().contains("contributions"), "{e}");

    // A missing receive: the chunk never reaches one rank.
    let mut p = ring();
    let last = p.ops.len() - 1;
    p.ops.remove(last);
    match p.check() {
        Err(ProgramError::Postcondition { last_writer, .. }) => assert!(last_writer.is_some()),
        other => panic!("expected a postcondition error, got {other:?}"),
    }

    // A copy instead of a reduction.
    let mut p = ring();
    if let OpKind::Transfer { op, .. } = &mut p.ops[0].kind {
        *op = RecvOp::Recv;
    }
    let e = p.check().unwrap_err();
    assert!(e.to_string().contains("needs 3"), "{e}");

    // Reading scratch nobody wrote.
    let t = "program t\ncollective allgather ranks=2 chunks=2 inplace\nscratch 1\n\
             op0 = xfer r0 scr[0] -> r1 out[0] recv ch=0 chunk=0 step=0 stage=0\n\
             op1 = xfer r1 out[1] -> r0 out[1] recv ch=0 chunk=1 step=0 stage=0\n";
    let e = text::parse(t).unwrap().check().unwrap_err();
    assert!(e.to_string().contains("uninitialised"), "{e}");
    assert!(e.to_string().contains("op0"), "{e}");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, .. ProptestConfig::default() })]

    /// Random programs hold; dropping any one op breaks them.
    #[test]
    fn random_programs_check_and_need_every_op(seed in any::<u64>(), coll in 0usize..4, ranks in 2u32..6, k in 1u32..3, drop in any::<prop::sample::Index>()) {
        let c = [Collective::AllReduce, Collective::AllGather, Collective::ReduceScatter, Collective::AllToAll][coll];
        let p = random_program(seed, c, ranks, k, 2);
        prop_assert!(p.check().is_ok(), "{:?}", p.check());
        let mut q = p.clone();
        q.ops.remove(drop.index(p.ops.len()));
        prop_assert!(q.check().is_err());
    }
}
