//! The generators on demand ([`Algorithm::source`]) are the stored programs
//! ([`Algorithm::generate`]): the same ops in the same order, read in order or by id, on every
//! shape up to a few dozen ranks (one node, one GPU per node, and both).

use oxccl_host::compile::OpSource;
use oxccl_host::program::generators::Algorithm;
use oxccl_host::program::{BufferLayout, Collective, Op, OpId, OpKind, Program, Rank, Slice};

#[test]
fn generated_ops_by_id_and_in_order_are_the_stored_program() {
    for algo in Algorithm::ALL {
        for nodes in 1..=6 {
            for gpus in 1..=6 {
                let p = algo.generate(nodes, gpus).unwrap();
                let g = algo.source(nodes, gpus).unwrap();
                assert_eq!(g.op_count(), p.ops.len(), "{algo} {nodes}x{gpus}");
                assert_eq!((g.name(), g.layout(), g.ranks_per_node()), (p.name.as_str(), &p.layout, p.ranks_per_node));
                for (i, op) in p.ops.iter().enumerate() {
                    assert_eq!(g.op(OpId::new(i)), *op, "{algo} {nodes}x{gpus} op{i}");
                }
                let mut in_order = Vec::new();
                g.try_for_each_op(|id, op| -> Result<(), ()> {
                    assert_eq!(id.index(), in_order.len());
                    in_order.push(*op);
                    Ok(())
                })
                .unwrap();
                assert_eq!(in_order, p.ops, "{algo} {nodes}x{gpus} in order");
                assert!(g.verify().is_ok() && Program::verify(&p).is_ok());
            }
        }
    }
}

#[test]
fn reading_in_order_stops_at_the_first_error() {
    let g = Algorithm::RingAllReduce.source(1, 4).unwrap();
    let mut seen = 0;
    let r = g.try_for_each_op(|id, _| {
        seen += 1;
        if id.index() == 5 { Err(id) } else { Ok(()) }
    });
    assert_eq!((r, seen), (Err(OpId(5)), 6));
}

#[test]
fn the_8192_gpu_programs_are_sources_of_a_few_hundred_bytes() {
    for algo in [Algorithm::HmAllReduce, Algorithm::RingAllReduce, Algorithm::DirectAllReduce] {
        let g = algo.source(1024, 8).unwrap();
        assert!(g.op_count() > 100_000_000, "{algo}: {} ops", g.op_count());
        let last = g.op(OpId::new(g.op_count() - 1));
        assert!(last.src_rank().0 < 8192 && last.dst_rank().0 < 8192);
        // Stored, the program takes gigabytes: `generate` refuses it under a smaller limit.
        let bytes = algo.program_bytes(1024, 8).unwrap();
        assert!(bytes > 5 << 30, "{algo}: {bytes} B");
        let e = algo.generate_within(1024, 8, 1 << 30).unwrap_err().to_string();
        assert!(e.contains("GiB") && e.contains(g.name()), "{e}");
    }
    assert!(Algorithm::HmAllReduce.source(1025, 8).is_err());
}

/// A ring moves what its steps say: AllReduce `n(n-1)` reductions (two chunks read, one written)
/// then `n(n-1)` stores; AllGather `n(n-1)` stores.
#[test]
fn ring_traffic_is_what_its_steps_move() {
    for n in 2..=9u64 {
        let ar = Algorithm::RingAllReduce.generate(1, n as u32).unwrap();
        assert_eq!(ar.traffic_chunks(), (3 * n * (n - 1), 2 * n * (n - 1)), "ring AllReduce on {n}");
        let ag = Algorithm::RingAllGather.generate(1, n as u32).unwrap();
        assert_eq!(ag.traffic_chunks(), (n * (n - 1), n * (n - 1)), "ring AllGather on {n}");
    }
}

/// A copy onto itself (an in-place AllGather's shard copied to where it already lies) moves
/// nothing; a copy elsewhere moves its chunks.
#[test]
fn a_copy_onto_itself_moves_nothing() {
    let mut p = Program::new("self_copy", BufferLayout::new(Collective::AllGather, 2, 1, true));
    let copy = |dst: u32| Op {
        kind: OpKind::Copy { rank: Rank(1), channel: 0, src: Slice::input(0), dst: Slice::output(dst) },
        chunk: 0,
        step: 0,
        stage: 0,
    };
    p.push(copy(1));
    assert_eq!(p.traffic_chunks(), (0, 0));
    p.push(copy(0));
    assert_eq!(p.traffic_chunks(), (1, 1));
}
