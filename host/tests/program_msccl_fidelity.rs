//! The MSCCL importer keeps MSCCL's meaning of every step type, dependency and placement: small
//! files whose outcome under MSCCL's runtime is worked out by hand in each test.

use oxccl_host::compile::{Options, compile};
use oxccl_host::exec::{ExecOptions, ReduceOp, verify};
use oxccl_host::program::msccl::{ImportError, Placements, StepRef, import, import_as, import_unchecked};
use oxccl_host::program::{BufferKind, OpKind, ProgramError, Rank};

/// A step element: `s`, type, src (buffer, offset), dst (buffer, offset), cnt, depid, deps, hasdep.
#[allow(clippy::too_many_arguments)]
fn step(s: u32, ty: &str, src: (&str, i64), dst: (&str, i64), cnt: u32, depid: i64, deps: i64, hasdep: u32) -> String {
    format!(
        r#"      <step s="{s}" type="{ty}" srcbuf="{}" srcoff="{}" dstbuf="{}" dstoff="{}" cnt="{cnt}" depid="{depid}" deps="{deps}" hasdep="{hasdep}"/>"#,
        src.0, src.1, dst.0, dst.1
    )
}

/// A step without dependencies.
fn plain(s: u32, ty: &str, src: (&str, i64), dst: (&str, i64)) -> String {
    step(s, ty, src, dst, 1, -1, -1, 0)
}

/// A TB: id, send peer, recv peer, channel, steps.
fn tb(id: u32, send: i64, recv: i64, chan: u32, steps: &[String]) -> String {
    format!("    <tb id=\"{id}\" send=\"{send}\" recv=\"{recv}\" chan=\"{chan}\">\n{}\n    </tb>", steps.join("\n"))
}

/// An algorithm of `gpus.len()` GPUs, each `(i_chunks, o_chunks, s_chunks, tbs)`.
fn algo(coll: &str, chunks: u32, placement: &str, gpus: &[(u32, u32, u32, Vec<String>)]) -> String {
    let mut x = format!(
        "<algo name=\"t\" proto=\"Simple\" nchannels=\"2\" nchunksperloop=\"{chunks}\" ngpus=\"{}\" coll=\"{coll}\" {placement}>\n",
        gpus.len()
    );
    for (id, (i, o, s, tbs)) in gpus.iter().enumerate() {
        x += &format!(
            "  <gpu id=\"{id}\" i_chunks=\"{i}\" o_chunks=\"{o}\" s_chunks=\"{s}\">\n{}\n  </gpu>\n",
            tbs.join("\n")
        );
    }
    x + "</algo>\n"
}

/// Compiles and runs `xml`'s program on the CPU executor: the number of wrong output elements.
fn wrong_elements(xml: &str) -> u64 {
    let p = import(xml).unwrap_or_else(|e| panic!("{e}")).program;
    let plan = compile(&p, &Options::default()).unwrap();
    let opts = ExecOptions { micro_batches: 2, fifo_slots: plan.stats.fifo_slots_needed.max(2) };
    verify::<i64>(&plan, ReduceOp::Sum, 3, &opts).unwrap().wrong
}

/// `rrs` reduces and sends; it stores nothing. Here GPU 1 only forwards the sum of chunk 0 with
/// `rrs` and never stores it, so under MSCCL its chunk 0 keeps its own contribution: the file is
/// not an AllReduce. (Imported as a reduce that stores, it used to pass.)
#[test]
fn rrs_stores_nothing_locally() {
    let xml = algo(
        "allreduce",
        1,
        r#"inplace="1""#,
        &[
            (1, 0, 0, vec![tb(0, 1, 1, 0, &[plain(0, "s", ("i", 0), ("i", 0)), plain(1, "r", ("i", 0), ("i", 0))])]),
            (1, 0, 0, vec![tb(0, 0, 0, 0, &[plain(0, "rrs", ("i", 0), ("i", 0))])]),
        ],
    );
    match import(&xml).unwrap_err() {
        ImportError::Invalid { error: ProgramError::Postcondition { rank, detail, .. }, .. } => {
            assert_eq!(rank, Rank(1));
            assert!(detail.contains("1 contributions"), "{detail}");
        }
        other => panic!("expected GPU 1's output to be wrong, got {other:?}"),
    }
    // Unchecked, the `rrs` reduces into scratch of its own and sends from there.
    let p = import_unchecked(&xml).unwrap().program;
    assert_eq!(p.layout.scratch, vec![0, 1]);
    let reduces_into_scratch = p.ops.iter().any(|op| {
        matches!(op.kind, OpKind::Transfer { dst_rank: Rank(1), dst, .. } if dst.buffer == BufferKind::Scratch)
            && op.reduces()
    });
    assert!(reduces_into_scratch, "{:?}", p.ops);
}

/// With GPU 1 receiving the sum back, the same file is an AllReduce, and `rrs`'s `dst` (here
/// chunk 1, which another TB uses at the same time) is left alone, as MSCCL leaves it.
#[test]
fn rrs_leaves_its_destination_alone() {
    let xml = algo(
        "allreduce",
        2,
        r#"inplace="1""#,
        &[
            (
                2,
                0,
                0,
                vec![
                    tb(
                        0,
                        1,
                        1,
                        0,
                        &[
                            plain(0, "s", ("i", 0), ("i", 0)),
                            plain(1, "r", ("i", 0), ("i", 0)),
                            plain(2, "s", ("i", 0), ("i", 0)),
                        ],
                    ),
                    tb(1, 1, 1, 1, &[plain(0, "rrs", ("i", 1), ("i", 0)), plain(1, "r", ("i", 1), ("i", 1))]),
                ],
            ),
            (
                2,
                0,
                0,
                vec![
                    tb(0, 0, 0, 0, &[plain(0, "rrs", ("i", 0), ("i", 1)), plain(1, "r", ("i", 0), ("i", 0))]),
                    tb(
                        1,
                        0,
                        0,
                        1,
                        &[
                            plain(0, "s", ("i", 1), ("i", 1)),
                            plain(1, "r", ("i", 1), ("i", 1)),
                            plain(2, "s", ("i", 1), ("i", 1)),
                        ],
                    ),
                ],
            ),
        ],
    );
    assert_eq!(wrong_elements(&xml), 0);
}

/// A copy whose source and destination alias in place does nothing (RCCL's tools write them).
#[test]
fn in_place_self_copies_are_no_ops() {
    // Input and output chunk 0 are one location in place; the copy waits for the reduction.
    let gpu = |peer: i64| {
        let exchange = [plain(0, "s", ("i", 0), ("i", 0)), step(1, "rrc", ("i", 0), ("i", 0), 1, -1, -1, 1)];
        (
            1,
            1,
            0,
            vec![tb(0, peer, peer, 0, &exchange), tb(1, -1, -1, 0, &[step(0, "cpy", ("i", 0), ("o", 0), 1, 0, 1, 0)])],
        )
    };
    let xml = algo("allreduce", 1, r#"inplace="1""#, &[gpu(1), gpu(0)]);
    let imp = import(&xml).unwrap_or_else(|e| panic!("{e}"));
    // What is left: the two transfers of the buffered exchange and the snapshots of their sources.
    let to_output = imp.program.ops.iter().filter(|op| op.dst().buffer == BufferKind::Output).count();
    assert_eq!((imp.program.ops.len(), to_output), (4, 0), "{:?}", imp.program.ops);
    assert_eq!(wrong_elements(&xml), 0);
    // Operands that overlap without being the same chunks are refused.
    let one = |ty: &str, src: (&str, i64), dst: (&str, i64)| {
        let steps = [step(0, ty, src, dst, 2, -1, -1, 0)];
        algo("allreduce", 3, r#"inplace="1""#, &[(3, 3, 0, vec![tb(0, -1, -1, 0, &steps)])])
    };
    for (ty, src, dst) in [("cpy", ("i", 0), ("o", 1)), ("re", ("i", 1), ("i", 0)), ("re", ("i", 0), ("o", 0))] {
        let e = import_unchecked(&one(ty, src, dst)).unwrap_err();
        assert!(
            matches!(e, ImportError::OverlappingOperands { step: StepRef { gpu: 0, tb: 0, step: 0, .. } }),
            "{ty}: {e:?}"
        );
    }
}

/// An AllGather written for both placements: out of place each GPU copies its input into its own
/// output block; in place that copy is a copy onto itself.
fn allgather_both(copy_own_block: bool) -> String {
    let gpu = |r: i64| {
        let peer = 1 - r;
        let mut tbs =
            vec![tb(0, peer, peer, 0, &[plain(0, "s", ("i", 0), ("o", r)), plain(1, "r", ("o", peer), ("o", peer))])];
        if copy_own_block {
            tbs.push(tb(1, -1, -1, 0, &[plain(0, "cpy", ("i", 0), ("o", r))]));
        }
        (1, 2, 0, tbs)
    };
    algo("allgather", 2, r#"inplace="1" outofplace="1""#, &[gpu(0), gpu(1)])
}

#[test]
fn files_may_claim_both_placements() {
    let xml = allgather_both(true);
    let imp = import(&xml).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(imp.placements, Placements { in_place: true, out_of_place: true });
    assert!(imp.program.layout.in_place);
    assert_eq!(imp.program.ops.len(), 2, "in place the copies do nothing");
    let out = import_as(&xml, false).unwrap_or_else(|e| panic!("{e}"));
    assert!(!out.program.layout.in_place);
    assert_eq!(out.program.ops.len(), 4);
    assert_eq!(wrong_elements(&xml), 0);
    // Without the copies it is an in-place AllGather only: the claim of out of place is refused.
    let e = import(&allgather_both(false)).unwrap_err();
    match &e {
        ImportError::Placement { in_place: false, error } => {
            assert!(matches!(**error, ImportError::Invalid { error: ProgramError::Postcondition { .. }, .. }), "{e}")
        }
        other => panic!("expected the out-of-place claim to fail, got {other:?}"),
    }
    assert!(e.to_string().starts_with("as an out-of-place algorithm"), "{e}");
    let only_in = allgather_both(false).replace(r#"outofplace="1""#, r#"outofplace="0""#);
    import(&only_in).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(import_as(&only_in, false).unwrap_err(), ImportError::NotClaimed { in_place: false });
    let neither = only_in.replace(r#"inplace="1""#, r#"inplace="0""#);
    assert_eq!(import(&neither).unwrap_err(), ImportError::NoPlacement { line: 1 });
}

/// Two TBs write one chunk with nothing ordering them: MSCCL's result would depend on timing.
#[test]
fn data_races_are_refused() {
    let gpu = |peer: i64, dep: (i64, i64)| {
        vec![
            tb(
                0,
                peer,
                peer,
                0,
                &[plain(0, "s", ("i", 0), ("i", 0)), step(1, "rrc", ("i", 0), ("i", 0), 1, -1, -1, 1)],
            ),
            tb(1, -1, -1, 0, &[step(0, "cpy", ("i", 0), ("s", 0), 1, dep.0, dep.1, 0)]),
        ]
    };
    // The copy reads chunk 0 while TB 0's reduction writes it.
    let racy = algo("allreduce", 1, r#"inplace="1""#, &[(1, 0, 1, gpu(1, (-1, -1))), (1, 0, 1, gpu(0, (-1, -1)))]);
    match import(&racy).unwrap_err() {
        ImportError::Race { first, second, rank: 0, slice } => {
            assert_eq!((first.tb.min(second.tb), first.tb.max(second.tb)), (0, 1), "{first} {second}");
            assert_eq!(slice.buffer, BufferKind::Input);
        }
        other => panic!("expected a race, got {other:?}"),
    }
    // Waiting for the reduction orders them.
    let ordered = algo("allreduce", 1, r#"inplace="1""#, &[(1, 0, 1, gpu(1, (0, 1))), (1, 0, 1, gpu(0, (0, 1)))]);
    assert_eq!(wrong_elements(&ordered), 0);
}

/// `nop`s hand their dependencies to the next step, which MSCCL requires to have one of its own.
#[test]
fn nop_dependencies() {
    let gpu = |peer: i64, last: String| {
        vec![
            tb(
                0,
                peer,
                peer,
                0,
                &[plain(0, "s", ("i", 0), ("i", 0)), step(1, "rrc", ("i", 0), ("i", 0), 1, -1, -1, 1)],
            ),
            tb(1, -1, -1, 0, &[step(0, "nop", ("i", -1), ("o", -1), 0, 0, 1, 0), last]),
        ]
    };
    let file = |last: String| {
        let l2 = last.clone();
        algo("allreduce", 1, r#"inplace="1""#, &[(1, 0, 1, gpu(1, last)), (1, 0, 1, gpu(0, l2))])
    };
    // The copy waits for the reduction through the nop (and for TB 0's step 0 of its own).
    assert_eq!(wrong_elements(&file(step(1, "cpy", ("i", 0), ("s", 0), 1, 0, 0, 0))), 0);
    let e = import(&file(plain(1, "cpy", ("i", 0), ("s", 0)))).unwrap_err();
    assert!(
        matches!(
            e,
            ImportError::DanglingDependency {
                step: StepRef { tb: 1, step: 1, .. },
                nop: StepRef { tb: 1, step: 0, .. }
            }
        ),
        "{e:?}"
    );
}

/// MSCCL fuses consecutive `re` steps onto one destination and runs them with the last one's count.
#[test]
fn fused_reductions_of_different_counts_are_refused() {
    let gpu = |steps: Vec<String>| (2, 0, 4, vec![tb(0, -1, -1, 0, &steps)]);
    let steps = vec![step(0, "re", ("s", 0), ("i", 0), 1, -1, -1, 0), step(1, "re", ("s", 2), ("i", 0), 2, -1, -1, 0)];
    let xml = algo("allreduce", 2, r#"inplace="1""#, &[gpu(steps.clone()), gpu(steps)]);
    let e = import_unchecked(&xml).unwrap_err();
    assert!(
        matches!(e, ImportError::FusedCount { step: StepRef { step: 1, .. }, first: StepRef { step: 0, .. } }),
        "{e:?}"
    );
    // A dependency on the second ends the run (it is not fused, so its count is its own).
    let steps = vec![step(0, "re", ("s", 0), ("i", 0), 1, -1, -1, 1), step(1, "re", ("s", 2), ("i", 0), 2, -1, -1, 0)];
    let xml = algo("allreduce", 2, r#"inplace="1""#, &[gpu(steps.clone()), gpu(steps)]);
    assert!(!matches!(import_unchecked(&xml), Err(ImportError::FusedCount { .. })));
}
