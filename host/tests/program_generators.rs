//! The generators on demand ([`Algorithm::source`]) are the stored programs
//! ([`Algorithm::generate`]): the same ops in the same order, read in order or by id, on every
//! shape up to a few dozen ranks (one node, one GPU per node, and both).

use oxccl_host::compile::OpSource;
use oxccl_host::program::generators::Algorithm;
use oxccl_host::program::{OpId, Program};

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
