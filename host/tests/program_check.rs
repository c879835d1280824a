//! The verifier and the symbolic postcondition checker.

mod common;

use common::random_program;
use oxccl_host::program::generators::Algorithm;
use oxccl_host::program::{OpId, OpKind, ProgramError, Rank, RecvOp, Slice, text};
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
    fn random_programs_check_and_need_every_op(seed in any::<u64>(), coll in 0usize..common::COLLECTIVES, ranks in 2u32..6, k in 1u32..3, drop in any::<prop::sample::Index>()) {
        let c = common::nth_collective(coll, seed, ranks);
        let p = random_program(seed, c, ranks, k, 2);
        prop_assert!(p.check().is_ok(), "{:?}", p.check());
        let mut q = p.clone();
        q.ops.remove(drop.index(p.ops.len()));
        prop_assert!(q.check().is_err());
    }
}

/// A chain broadcast from rank 2 of 4, out of place: the root copies its input to its output and
/// each rank forwards the chunk to the next.
fn chain_broadcast(root_copy: bool) -> String {
    let mut t =
        String::from("program chain_broadcast\ncollective broadcast ranks=4 chunks=2 root=2 outofplace\nscratch 0\n");
    let mut ops = Vec::new();
    for c in 0..2 {
        if root_copy {
            ops.push(format!("copy r2 in[{c}] -> out[{c}] ch=0 chunk={c} step=0 stage=0"));
        }
        for (i, (a, b)) in [(2, 3), (3, 0), (0, 1)].into_iter().enumerate() {
            ops.push(format!("xfer r{a} out[{c}] -> r{b} out[{c}] recv ch=0 chunk={c} step={} stage=0", i + 1));
        }
    }
    for (i, op) in ops.iter().enumerate() {
        t.push_str(&format!("op{i} = {op}\n"));
    }
    t
}

#[test]
fn a_broadcast_program_delivers_the_roots_input_to_every_rank() {
    let p = text::parse(&chain_broadcast(true)).unwrap();
    assert_eq!(p.layout.collective, oxccl_host::program::Collective::Broadcast { root: 2 });
    p.check().unwrap();
    assert_eq!(text::parse(&text::print(&p)).unwrap(), p);
    // Without the root's own copy its output, and everything forwarded from it, is uninitialised.
    let wrong = text::parse(&chain_broadcast(false)).unwrap();
    assert!(matches!(wrong.check(), Err(ProgramError::Postcondition { .. })), "{:?}", wrong.check());
}

#[test]
fn a_reduce_program_promises_only_the_roots_output() {
    // Ranks 0 and 1 reduce into rank 1's input, which rank 1 sends on to the root (2): rank 1's
    // input ends as a partial sum and ranks 0 and 1 write no output, all allowed off the root.
    let t = "program chain_reduce\ncollective reduce ranks=3 chunks=1 root=2 outofplace\nscratch 0\n\
             op0 = xfer r0 in[0] -> r1 in[0] rrc ch=0 chunk=0 step=0 stage=0\n\
             op1 = xfer r1 in[0] -> r2 in[0] rrc ch=0 chunk=0 step=1 stage=0\n\
             op2 = copy r2 in[0] -> out[0] ch=0 chunk=0 step=2 stage=0\n";
    let p = text::parse(t).unwrap();
    p.check().unwrap();
    // The same steps claimed as a reduce to rank 1 leave rank 1's output unwritten.
    let to_1 = text::parse(&t.replace("root=2", "root=1")).unwrap();
    assert!(matches!(to_1.check(), Err(ProgramError::Postcondition { rank: Rank(1), .. })), "{:?}", to_1.check());
    // Dropping rank 0's contribution leaves the root one short.
    let short = text::parse(
        &t.replace("op0 = xfer r0 in[0] -> r1 in[0] rrc ch=0 chunk=0 step=0 stage=0\n", "")
            .replace("op1", "op0")
            .replace("op2", "op1"),
    )
    .unwrap();
    assert!(matches!(short.check(), Err(ProgramError::Postcondition { rank: Rank(2), .. })), "{:?}", short.check());
}

#[test]
fn roots_are_named_where_they_belong_and_nowhere_else() {
    let head =
        |c: &str| format!("program p\n{c}\nscratch 0\nop0 = copy r0 in[0] -> out[0] ch=0 chunk=0 step=0 stage=0\n");
    for (line, why) in [
        ("collective broadcast ranks=2 chunks=1 outofplace", "needs its root"),
        ("collective reduce ranks=2 chunks=1 inplace", "needs its root"),
        ("collective allreduce ranks=2 chunks=1 root=0 outofplace", "has no root"),
        ("collective broadcast ranks=2 chunks=1 root=0 root=1 outofplace", "expected `collective KIND"),
    ] {
        let e = text::parse(&head(line)).unwrap_err().to_string();
        assert!(e.contains(why), "{line}: {e}");
    }
    // A root past the ranks is the layout's error, found as the text is read.
    let e = text::parse(&head("collective broadcast ranks=2 chunks=1 root=2 outofplace")).unwrap_err();
    assert!(matches!(e, ProgramError::BadLayout { .. }) && e.to_string().contains("root 2"), "{e}");
}

#[test]
fn an_msccl_file_names_no_root_so_a_rooted_one_is_refused() {
    use oxccl_host::program::msccl::{self, ImportError};
    for coll in ["broadcast", "reduce"] {
        let xml = format!(
            "<algo name=\"x\" proto=\"Simple\" nchannels=\"1\" nchunksperloop=\"2\" ngpus=\"2\" coll=\"{coll}\" inplace=\"0\">\n\
             <gpu id=\"0\" i_chunks=\"2\" o_chunks=\"2\" s_chunks=\"0\"></gpu>\n<gpu id=\"1\" i_chunks=\"2\" o_chunks=\"2\" s_chunks=\"0\"></gpu>\n</algo>\n"
        );
        let e = msccl::import(&xml).unwrap_err();
        assert!(matches!(&e, ImportError::RootedCollective { name, line: 1 } if name == coll), "{coll}: {e}");
    }
}
