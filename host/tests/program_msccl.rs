//! The MSCCL XML importer: every real file, tolerance, and every kind of invalid program.

mod common;

use common::{bundled_msccl, shared_msccl, xml_files};
use oxccl_host::compile::{Options, Scheduler, TbAlloc, compile};
use oxccl_host::exec::{ExecOptions, ReduceOp, verify};
use oxccl_host::program::msccl::{ImportError, StepRef, import};
use oxccl_host::program::{Collective, ProgramError, text};
use std::path::Path;

/// What each real file must import as: (file, collective, ranks, chunks, in place, ops).
const EXPECTED: [(&str, Collective, u32, u32, bool, usize); 5] = [
    ("ncv4_ar_hier_12_Simple.xml", Collective::AllReduce, 4, 24, true, 192),
    ("ndv4_a2a2ll.xml", Collective::AllToAll, 8, 16, false, 128),
    ("ndv4_ag-32m-1g.xml", Collective::AllGather, 8, 256, true, 1792),
    ("ndv4_ap-1pass.xml", Collective::AllReduce, 8, 32, true, 2016),
    ("ndv4_r48ll.xml", Collective::AllReduce, 8, 64, true, 896),
];

fn check_folder(dir: &Path) {
    let files = xml_files(dir);
    assert!(!files.is_empty(), "no XML files in {}", dir.display());
    let mut seen = Vec::new();
    for f in files {
        let name = f.file_name().unwrap().to_string_lossy().into_owned();
        let xml = std::fs::read_to_string(&f).unwrap();
        let imp = import(&xml).unwrap_or_else(|e| panic!("{name}: {e}"));
        let p = &imp.program;
        if let Some(&(file, coll, ranks, chunks, in_place, ops)) = EXPECTED.iter().find(|e| e.0 == name) {
            seen.push(file);
            assert_eq!(
                (p.layout.collective, p.layout.ranks, p.layout.chunks, p.layout.in_place, p.ops.len()),
                (coll, ranks, chunks, in_place, ops),
                "{name}"
            );
        }
        assert_eq!(imp.origin.len(), p.ops.len());
        // Every scheduler and allocator computes the collective on the CPU executor.
        for s in Scheduler::ALL {
            for a in TbAlloc::ALL {
                let plan = compile(p, &Options::new(s, a)).unwrap_or_else(|e| panic!("{name} {s} {a}: {e}"));
                let opts = ExecOptions { micro_batches: 2, fifo_slots: plan.stats.fifo_slots_needed.max(1) };
                let r = verify::<i32>(&plan, ReduceOp::Sum, 3, &opts).unwrap_or_else(|e| panic!("{name} {s} {a}: {e}"));
                assert_eq!(r.wrong, 0, "{name} {s} {a}");
            }
        }
        // The imported program survives the text format.
        assert_eq!(&text::parse(&text::print(p)).unwrap(), p, "{name}");
    }
    // Each expected shape was checked: a missing or renamed file fails here, not silently.
    let missing: Vec<&str> = EXPECTED.iter().map(|e| e.0).filter(|f| !seen.contains(f)).collect();
    assert!(missing.is_empty(), "{}: expected MSCCL files not found: {missing:?}", dir.display());
}

#[test]
fn bundled_msccl_files_import_and_run() {
    check_folder(&bundled_msccl());
}

#[test]
fn shared_msccl_files_import_and_run() {
    match shared_msccl() {
        Some(dir) => check_folder(&dir),
        None => {
            // Straight to stderr: the harness captures eprintln! of passing tests.
            use std::io::Write;
            let _ = writeln!(
                std::io::stderr(),
                "skipped: ../shared/msccl not found (the copies in host/tests/data/msccl are tested)"
            );
        }
    }
}

#[test]
fn golden_alltoall_import() {
    let xml = std::fs::read_to_string(bundled_msccl().join("ndv4_a2a2ll.xml")).unwrap();
    common::golden("program_msccl_ndv4_a2a2ll.txt", &text::print(&import(&xml).unwrap().program));
}

/// A 2-GPU in-place AllGather; `{..}` placeholders are filled by the tests.
fn ag2(gpu0: &str, gpu1: &str, algo_attrs: &str) -> String {
    format!(
        r#"<algo name="t" proto="Simple" nchannels="1" nchunksperloop="2" ngpus="2" coll="allgather" {algo_attrs}>
  <gpu id="0" i_chunks="0" o_chunks="2" s_chunks="0">
{gpu0}
  </gpu>
  <gpu id="1" i_chunks="0" o_chunks="2" s_chunks="0">
{gpu1}
  </gpu>
</algo>"#
    )
}

const G0: &str = r#"    <tb id="0" send="1" recv="1" chan="0">
      <step s="0" type="s" srcbuf="o" srcoff="0" dstbuf="o" dstoff="0" cnt="1" depid="-1" deps="-1" hasdep="0"/>
      <step s="1" type="r" srcbuf="o" srcoff="1" dstbuf="o" dstoff="1" cnt="1" depid="-1" deps="-1" hasdep="0"/>
    </tb>"#;
const G1: &str = r#"    <tb id="0" send="0" recv="0" chan="0">
      <step s="0" type="s" srcbuf="o" srcoff="1" dstbuf="o" dstoff="1" cnt="1" depid="-1" deps="-1" hasdep="0"/>
      <step s="1" type="r" srcbuf="o" srcoff="0" dstbuf="o" dstoff="0" cnt="1" depid="-1" deps="-1" hasdep="0"/>
    </tb>"#;

#[test]
fn minimal_file_and_tolerated_attributes() {
    // Missing inplace/outofplace/minBytes/maxBytes, extra attributes, unknown elements.
    let xml = ag2(G0, &G1.replace("<tb ", "<tb extra=\"x\" "), "redop=\"sum\" future=\"1\"");
    let p = import(&xml).unwrap().program;
    assert!(p.layout.in_place, "in place inferred from o_chunks-only GPUs");
    assert_eq!(p.ops.len(), 2);
    let xml = ag2(G0, G1, "inplace=\"1\" minBytes=\"0\"")
        .replace("<algo ", "<!-- c --><algo ")
        .replace("</algo>", "<unknown/></algo>");
    import(&xml).unwrap();
    let xml = ag2(G0, G1, "outofplace=\"0\"");
    assert!(import(&xml).unwrap().program.layout.in_place);
}

#[test]
fn reduce_scatter_spellings() {
    for coll in ["reducescatter", "reduce_scatter", "ReduceScatter"] {
        let xml = format!(
            r#"<algo name="rs" nchunksperloop="2" ngpus="2" coll="{coll}" inplace="1">
  <gpu id="0" i_chunks="2" o_chunks="0" s_chunks="0">
    <tb id="0" send="1" recv="1" chan="0">
      <step s="0" type="s" srcbuf="i" srcoff="1" dstbuf="i" dstoff="1" cnt="1" depid="-1" deps="-1" hasdep="0"/>
      <step s="1" type="rrc" srcbuf="i" srcoff="0" dstbuf="i" dstoff="0" cnt="1" depid="-1" deps="-1" hasdep="0"/>
    </tb>
  </gpu>
  <gpu id="1" i_chunks="2" o_chunks="0" s_chunks="0">
    <tb id="0" send="0" recv="0" chan="0">
      <step s="0" type="s" srcbuf="i" srcoff="0" dstbuf="i" dstoff="0" cnt="1" depid="-1" deps="-1" hasdep="0"/>
      <step s="1" type="rrc" srcbuf="i" srcoff="1" dstbuf="i" dstoff="1" cnt="1" depid="-1" deps="-1" hasdep="0"/>
    </tb>
  </gpu>
</algo>"#
        );
        let p = import(&xml).unwrap_or_else(|e| panic!("{coll}: {e}")).program;
        assert_eq!(p.layout.collective, Collective::ReduceScatter);
    }
}

#[test]
fn taccl_copies_and_op_elements() {
    // Out-of-place AllGather in TACCL's newer spelling: <copy> pre-copies and <op step= buf= off=>.
    let xml = r#"<algo name="taccl" nchunksperloop="2" ngpus="2" coll="allgather" inplace="0">
  <gpu id="0" i_chunks="1" o_chunks="2" s_chunks="0">
    <copy i_off="0" o_off="0"/>
    <tb id="0" send="1" recv="-1" chan="0"><op step="0" type="s" buf="i" off="0"/></tb>
    <tb id="1" send="-1" recv="1" chan="0"><op step="0" type="r" buf="o" off="1"/></tb>
  </gpu>
  <gpu id="1" i_chunks="1" o_chunks="2" s_chunks="0">
    <copy i_off="0" o_off="1"/>
    <tb id="0" send="0" recv="-1" chan="0"><op step="0" type="s" buf="i" off="0"/></tb>
    <tb id="1" send="-1" recv="0" chan="0"><op step="0" type="r" buf="o" off="0"/></tb>
  </gpu>
</algo>"#;
    let p = import(xml).unwrap().program;
    assert!(!p.layout.in_place);
    assert_eq!(p.ops.len(), 4, "two pre-copies and two transfers");
}

#[test]
fn buffered_exchange_gets_a_snapshot() {
    // Both GPUs send chunk 0 and then reduce the peer's chunk 0 into it: the sends are buffered in
    // the FIFO, so atomic transfers need a snapshot of the source, taken in scratch.
    let g = |peer: u32| {
        format!(
            r#"    <tb id="0" send="{peer}" recv="{peer}" chan="0">
      <step s="0" type="s" srcbuf="i" srcoff="0" dstbuf="i" dstoff="0" cnt="1" depid="-1" deps="-1" hasdep="0"/>
      <step s="1" type="rrc" srcbuf="i" srcoff="0" dstbuf="i" dstoff="0" cnt="1" depid="-1" deps="-1" hasdep="0"/>
    </tb>"#
        )
    };
    let xml = format!(
        r#"<algo name="x" nchunksperloop="1" ngpus="2" coll="allreduce" inplace="1">
  <gpu id="0" i_chunks="1" o_chunks="0" s_chunks="0">
{}
  </gpu>
  <gpu id="1" i_chunks="1" o_chunks="0" s_chunks="0">
{}
  </gpu>
</algo>"#,
        g(1),
        g(0)
    );
    let p = import(&xml).unwrap().program;
    assert_eq!(p.layout.scratch, vec![1, 1]);
    assert_eq!(p.ops.len(), 4, "two snapshots and two transfers");
    let plan = compile(&p, &Options::default()).unwrap();
    assert_eq!(verify::<f32>(&plan, ReduceOp::Sum, 4, &ExecOptions::default()).unwrap().wrong, 0);
}

/// Step `step` of tb `tb` on gpu `gpu`, written on line `line`.
fn at(gpu: u32, tb: u32, step: u32, line: usize) -> StepRef {
    StepRef { gpu, tb, step, line }
}

#[test]
fn unmatched_send_and_receive() {
    let g1_no_recv = G1.replace(r#"      <step s="1" type="r" srcbuf="o" srcoff="0" dstbuf="o" dstoff="0" cnt="1" depid="-1" deps="-1" hasdep="0"/>
"#, "");
    let e = import(&ag2(G0, &g1_no_recv, "")).unwrap_err();
    assert_eq!(e, ImportError::UnmatchedSend { step: at(0, 0, 0, 4), dst: 1, channel: 0 });
    let g1_no_send = G1
        .replace(r#"      <step s="0" type="s" srcbuf="o" srcoff="1" dstbuf="o" dstoff="1" cnt="1" depid="-1" deps="-1" hasdep="0"/>
"#, "")
        .replace(r#"s="1" type="r""#, r#"s="0" type="r""#);
    let e = import(&ag2(G0, &g1_no_send, "")).unwrap_err();
    assert_eq!(e, ImportError::UnmatchedRecv { step: at(0, 0, 1, 5), src: 1, channel: 0 });
    assert!(e.to_string().contains("gpu 0 tb 0 step 1"), "{e}");
}

#[test]
fn out_of_range_rank_and_chunk() {
    let e = import(&ag2(&G0.replace(r#"send="1""#, r#"send="5""#), G1, "")).unwrap_err();
    assert_eq!(e, ImportError::BadPeer { step: at(0, 0, 0, 4), direction: "send", peer: 5 });
    let e = import(&ag2(&G0.replace(r#"srcoff="0""#, r#"srcoff="7""#), G1, "")).unwrap_err();
    match e {
        ImportError::Invalid { step: Some(s), error: ProgramError::SliceOutOfRange { .. } } => {
            assert_eq!(s, at(0, 0, 0, 4))
        }
        other => panic!("expected an out-of-range chunk, got {other:?}"),
    }
    let e = import(&ag2(&G0.replace(r#"srcoff="0""#, r#"srcoff="-2""#), G1, "")).unwrap_err();
    assert!(matches!(e, ImportError::BadAttribute { .. }), "{e}");
}

#[test]
fn cycles_are_reported() {
    let g0 = r#"    <tb id="0" send="1" recv="-1" chan="0">
      <step s="0" type="s" srcbuf="o" srcoff="0" dstbuf="o" dstoff="0" cnt="1" depid="1" deps="0" hasdep="1"/>
    </tb>
    <tb id="1" send="-1" recv="1" chan="0">
      <step s="0" type="r" srcbuf="o" srcoff="1" dstbuf="o" dstoff="1" cnt="1" depid="0" deps="0" hasdep="1"/>
    </tb>"#;
    let e = import(&ag2(g0, G1, "")).unwrap_err();
    assert!(matches!(e, ImportError::Cycle { step } if step.gpu == 0), "{e}");
    // Step 0 waits for a TB that does not exist, then for a flag its TB never publishes.
    let wait = |depid: &str, deps: &str| {
        let g0 = G0.replace(
            r#"depid="-1" deps="-1" hasdep="0"/>
      <step s="1""#,
            &format!(
                r#"depid="{depid}" deps="{deps}" hasdep="0"/>
      <step s="1""#
            ),
        );
        import(&ag2(&g0, G1, "")).unwrap_err()
    };
    assert_eq!(wait("7", "0"), ImportError::BadDependency { step: at(0, 0, 0, 4), depid: 7, deps: 0 });
    assert_eq!(wait("0", "-2"), ImportError::BadDependency { step: at(0, 0, 0, 4), depid: 0, deps: -2 });
    let e = wait("0", "9");
    assert_eq!(e, ImportError::NeverSignalled { step: at(0, 0, 0, 4), depid: 0, deps: 9 });
    assert!(e.to_string().contains("line 4"), "{e}");
    // Waiting on its own TB's later step: MSCCL would hang.
    let g0 = G0
        .replace(
            r#"depid="-1" deps="-1" hasdep="0"/>
      <step s="1""#,
            r#"depid="0" deps="1" hasdep="0"/>
      <step s="1""#,
        )
        .replace(
            r#"dstoff="1" cnt="1" depid="-1" deps="-1" hasdep="0""#,
            r#"dstoff="1" cnt="1" depid="-1" deps="-1" hasdep="1""#,
        );
    assert!(matches!(import(&ag2(&g0, G1, "")).unwrap_err(), ImportError::Cycle { .. }));
}

#[test]
fn postcondition_failures() {
    // GPU 1 receives into the wrong chunk: its chunk 0 is never written.
    let wrong = G1.replace(
        r#"type="r" srcbuf="o" srcoff="0" dstbuf="o" dstoff="0""#,
        r#"type="r" srcbuf="o" srcoff="1" dstbuf="o" dstoff="1""#,
    );
    let e = import(&ag2(G0, &wrong, "")).unwrap_err();
    assert!(
        matches!(&e, ImportError::Invalid { step: None, error: ProgramError::Postcondition { last_writer: None, .. } }),
        "{e:?}"
    );
    assert!(e.to_string().contains("never written"), "{e}");
    // GPU 0 reduces into its uninitialised output instead of storing: the step is named.
    let e = import(&ag2(&G0.replace(r#"type="r""#, r#"type="rrc""#), G1, "")).unwrap_err();
    match &e {
        ImportError::Invalid { step: Some(s), error: ProgramError::Postcondition { .. } } => {
            assert_eq!(*s, at(1, 0, 0, 10), "named by the send of the offending transfer")
        }
        other => panic!("expected a postcondition error naming a step, got {other:?}"),
    }
}

#[test]
fn other_malformed_files() {
    let e = import(&ag2(&G0.replace(r#"type="s""#, r#"type="xyz""#), G1, "")).unwrap_err();
    assert_eq!(e, ImportError::UnknownStepType { step: at(0, 0, 0, 4), ty: "xyz".into() });
    let e = import(&ag2(
        G0,
        &G1.replace(
            r#"type="r" srcbuf="o" srcoff="0" dstbuf="o" dstoff="0" cnt="1""#,
            r#"type="r" srcbuf="o" srcoff="0" dstbuf="o" dstoff="0" cnt="2""#,
        ),
        "",
    ))
    .unwrap_err();
    assert!(matches!(e, ImportError::CountMismatch { send_count: 1, recv_count: 2, .. }), "{e}");
    let dup = format!("{G0}\n{}", G0.replace(r#"<tb id="0""#, r#"<tb id="1""#));
    let e = import(&ag2(&dup, G1, "")).unwrap_err();
    assert!(matches!(e, ImportError::DuplicateConnection { gpu: 0, peer: 1, .. }), "{e}");
    let e = import(&ag2(G0, G1, "").replace(r#"coll="allgather""#, r#"coll="broadcastish""#)).unwrap_err();
    assert!(matches!(e, ImportError::UnknownCollective { .. }), "{e}");
    let e = import("<algo name=\"t\" ngpus=\"1\" coll=\"allreduce\"><gpu id=\"0\"").unwrap_err();
    assert!(matches!(e, ImportError::Xml { .. } | ImportError::MissingAttribute { .. }), "{e}");
    let e = import(&ag2(G0, G1, "").replace(r#"ngpus="2""#, r#"ngpus="3""#)).unwrap_err();
    assert!(matches!(e, ImportError::BadAttribute { .. }), "{e}");
    let e = import(&ag2(G0, G1, "").replace(r#" coll="allgather""#, "")).unwrap_err();
    assert!(matches!(e, ImportError::MissingAttribute { attribute: "coll", .. }), "{e}");
    // A send's missing source names the attribute that is missing, buffer or offset.
    let send = r#"type="s" srcbuf="o" srcoff="0""#;
    for (without, missing) in [(r#"type="s" srcbuf="o""#, "srcoff"), (r#"type="s" srcoff="0""#, "srcbuf")] {
        let e = import(&ag2(&G0.replacen(send, without, 1), G1, "")).unwrap_err();
        assert!(matches!(e, ImportError::MissingAttribute { attribute, .. } if attribute == missing), "{missing}: {e}");
        assert!(e.to_string().contains("gpu 0 tb 0 step 0"), "{e}");
    }
}

/// Inputs a few dozen bytes long that once panicked or asked for tens of gigabytes are typed errors.
#[test]
fn tiny_hostile_files_are_errors() {
    // A pre-copy of zero chunks at the end of the input buffer.
    let zero = r#"<algo coll="allreduce" ngpus="1" nchunksperloop="1" inplace="1"><gpu id="0" i_chunks="1"><copy i_off="1" o_off="0" cnt="0"/></gpu></algo>"#;
    let e = import(zero).unwrap_err();
    assert!(matches!(&e, ImportError::BadAttribute { attribute, .. } if attribute == "cnt"), "{e}");
    // 2^31 - 1 chunks per loop on one GPU: refused by the layout's size limit, not allocated.
    let huge = r#"<algo coll="allreduce" ngpus="1" nchunksperloop="2147483647"><gpu id="0"/></algo>"#;
    let e = import(huge).unwrap_err();
    assert!(e.to_string().contains("too large"), "{e}");
}
