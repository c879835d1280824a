//! The text format: golden programs, round trips, parse errors.

mod common;

use common::{golden, random_program};
use oxccl_host::program::generators::Algorithm;
use oxccl_host::program::{Collective, ProgramError, text};
use proptest::prelude::*;

/// A change detector for the generators' text form: the files are the blessed output
/// (`OXCCL_BLESS=1`, read when blessed). The programs' correctness is checked by running them
/// (`exec_executor.rs`, `every_generator_every_configuration`), and the text form by the round
/// trips below.
#[test]
fn golden_generated_programs() {
    for (algo, n, g) in [
        (Algorithm::RingAllReduce, 1, 4),
        (Algorithm::HmAllGather, 2, 2),
        (Algorithm::HmReduceScatter, 3, 2),
        (Algorithm::HmAllReduce, 2, 2),
        (Algorithm::DirectAllToAll, 1, 3),
    ] {
        let p = algo.generate(n, g).unwrap();
        golden(&format!("program_{}.txt", p.name), &text::print(&p));
    }
}

#[test]
fn every_generator_round_trips() {
    for algo in Algorithm::ALL {
        for (n, g) in [(1, 3), (2, 2), (3, 2)] {
            let p = algo.generate(n, g).unwrap();
            let back = text::parse(&text::print(&p)).unwrap();
            assert_eq!(back, p, "{algo} {n}x{g}");
        }
    }
}

#[test]
fn parse_errors_name_the_line() {
    let head = "program t\ncollective allreduce ranks=2 chunks=2 inplace\nscratch 0\n";
    let cases = [
        ("op0 = xfer r0 in[0] -> r1 in[0] recv ch=0 chunk=0 step=0\n", "missing attribute `stage`"),
        ("op1 = xfer r0 in[0] -> r1 in[0] recv ch=0 chunk=0 step=0 stage=0\n", "expected `op0`"),
        ("op0 = xfer r0 in[0] -> r1 foo[0] recv ch=0 chunk=0 step=0 stage=0\n", "unknown buffer `foo`"),
        ("op0 = xfer r0 in[2..1] -> r1 in[0] recv ch=0 chunk=0 step=0 stage=0\n", "empty slice"),
        ("op0 = send r0 in[0] -> r1 in[0]\n", "unknown op `send`"),
        ("op0 = xfer q0 in[0] -> r1 in[0] recv ch=0 chunk=0 step=0 stage=0\n", "expected a rank"),
        ("op0 = xfer r0 in[0] -> r1 in[0] rrs ch=0 chunk=0 step=0 stage=0\n", "expected recv or rrc"),
        ("bogus\n", "unknown directive"),
    ];
    for (line, want) in cases {
        match text::parse(&format!("{head}{line}")) {
            Err(ProgramError::Parse { line: 4, message }) => {
                assert!(message.contains(want), "`{line}`: got `{message}`, want `{want}`")
            }
            other => panic!("`{line}`: expected a parse error on line 4, got {other:?}"),
        }
    }
    let e = text::parse("collective allreduce ranks=2 chunks=2 inplace\n").unwrap_err();
    assert!(matches!(e, ProgramError::Parse { .. }), "{e}");
    let e = text::parse("program t\ncollective allreduce ranks=2 chunks=2 inplace\nscratch 1 2 3\n").unwrap_err();
    assert!(e.to_string().contains("3 sizes for 2 ranks"), "{e}");
}

#[test]
fn storage_past_u32_chunks_is_a_layout_error_not_a_wrap() {
    // One rank's storage is counted in u32 chunks: a scratch or chunk count that would wrap it is
    // refused, by parse or by the checks, never indexed past its end.
    for (layout, scratch) in
        [("ranks=1 chunks=1 outofplace", "4294967295"), ("ranks=1 chunks=2147483648 outofplace", "0")]
    {
        let t = format!(
            "program t\ncollective allreduce {layout}\nscratch {scratch}\nop0 = copy r0 in[0] -> out[0] ch=0 chunk=0 step=0 stage=0\n"
        );
        let e = text::parse(&t).and_then(|p| p.check()).unwrap_err();
        assert!(matches!(&e, ProgramError::BadLayout { reason } if reason.contains("too large")), "{layout}: {e}");
    }
    // Instancing that would wrap the chunk count is refused the same way.
    let p = Algorithm::RingAllReduce.generate(1, 4).unwrap();
    let e = p.instanced(u32::MAX).unwrap_err();
    assert!(matches!(&e, ProgramError::BadLayout { reason } if reason.contains("too large")), "{e}");
    assert_eq!(p.instanced(3).unwrap().layout.chunks, p.layout.chunks * 3);
    // No instances is refused; one is the program itself.
    let e = p.instanced(0).unwrap_err();
    assert!(matches!(&e, ProgramError::BadLayout { reason } if reason.contains("0 instances")), "{e}");
    assert_eq!(p.instanced(1).unwrap(), p);
}

#[test]
fn comments_and_per_rank_scratch() {
    let t = "# a comment\nprogram t   # trailing\ncollective allgather ranks=2 chunks=2 outofplace\nscratch 0 1\n\
             op0 = copy r0 in[0] -> out[0] ch=0 chunk=0 step=0 stage=0\n\
             op1 = copy r1 in[0] -> out[1] ch=0 chunk=1 step=0 stage=0\n\
             op2 = xfer r0 out[0] -> r1 scr[0] recv ch=1 chunk=0 step=1 stage=0\n\
             op3 = copy r1 scr[0] -> out[0] ch=0 chunk=0 step=2 stage=1\n\
             op4 = xfer r1 in[0] -> r0 out[1] recv ch=0 chunk=1 step=1 stage=0\n";
    let p = text::parse(t).unwrap();
    assert_eq!(p.layout.scratch, vec![0, 1]);
    assert_eq!(p.layout.collective, Collective::AllGather);
    p.check().unwrap();
    assert_eq!(text::parse(&text::print(&p)).unwrap(), p);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, .. ProptestConfig::default() })]

    #[test]
    fn random_programs_round_trip(seed in any::<u64>(), coll in 0usize..common::COLLECTIVES, ranks in 2u32..6, k in 1u32..3, ch in 1u32..3) {
        let c = common::nth_collective(coll, seed, ranks);
        let p = random_program(seed, c, ranks, k, ch);
        let t = text::print(&p);
        prop_assert_eq!(text::parse(&t).unwrap(), p);
    }
}

#[test]
fn a_rank_count_past_the_limit_is_refused_before_any_allocation() {
    let e = text::parse("program p\ncollective allreduce ranks=4294967295 chunks=1 inplace\n").unwrap_err();
    assert!(e.to_string().contains("more than the supported"), "{e}");
}

/// A small file whose ops touch more chunks than a program may is refused by `verify` (and so by
/// every pass after it) before the dependency pass sizes anything by them.
#[test]
fn a_program_touching_too_many_chunks_is_refused() {
    let mut t = String::from("program wide\ncollective allreduce ranks=1 chunks=4194304 outofplace\nscratch 0\n");
    for i in 0..300 {
        t.push_str(&format!("op{i} = copy r0 in[0..4194304] -> out[0..4194304] ch=0 chunk=0 step={i} stage=0\n"));
    }
    assert!(t.len() < 40_000, "{} bytes", t.len());
    let p = text::parse(&t).unwrap_or_else(|e| panic!("{e}"));
    match p.verify() {
        Err(ProgramError::BadLayout { reason }) => assert!(reason.contains("touch 2516582400 chunks"), "{reason}"),
        other => panic!("expected the chunk-access refusal, got {other:?}"),
    }
}

/// Generated layouts reach `BufferLayout::MAX_CHUNKS` at the generators' rank limit; a file may describe
/// only `BufferLayout::MAX_IMPORTED_CHUNKS` chunk locations.
#[test]
fn generator_layouts_fit_and_files_are_held_to_less() {
    use oxccl_host::program::BufferLayout;
    let n = Algorithm::MAX_RANKS;
    let largest = BufferLayout::new(Collective::AllReduce, n, n, true);
    largest.validate().unwrap_or_else(|e| panic!("{e}"));
    assert!(matches!(largest.validate_imported(), Err(ProgramError::BadLayout { .. })));
    let t = format!("program big\ncollective allreduce ranks={n} chunks={n} inplace\nscratch 0\n");
    match text::parse(&t) {
        Err(ProgramError::BadLayout { reason }) => assert!(reason.contains("a file may describe"), "{reason}"),
        other => panic!("expected the file-size refusal, got {other:?}"),
    }
    assert!(matches!(
        BufferLayout::new(Collective::AllReduce, n + 1, n + 1, true).validate(),
        Err(ProgramError::BadLayout { .. })
    ));
}

/// Names that are not one token of a `program NAME` line (or hold control characters) would read
/// back as another name or as more lines: `verify` and `parse` refuse them, and `print` writes a
/// `program` line without a name, which `parse` refuses, instead of text it would read differently.
#[test]
fn a_name_that_is_not_one_token_is_refused_and_never_printed_as_one() {
    use oxccl_host::program::Program;
    let mut p = Algorithm::RingAllReduce.generate(1, 2).unwrap();
    for (name, reason) in [
        ("", "it is empty"),
        ("my ring", "it holds whitespace"),
        ("ring\nop0", "it holds whitespace"),
        ("ring\u{2028}2", "it holds whitespace"),
        ("ring#2", "it holds `#`, which starts a comment in the text format"),
        ("ring\u{1}", "it holds a control character"),
    ] {
        let want = ProgramError::BadName { name: name.to_string(), reason };
        assert_eq!(Program::check_name(name), Err(want.clone()));
        p.name = name.to_string();
        assert_eq!(p.verify(), Err(want.clone()));
        let t = text::print(&p);
        let first = t.lines().next().unwrap();
        assert_eq!(first, format!("program # not a name of this format: {want}"));
        // program, collective, scratch, ranks-per-node, the ops: nothing more.
        assert_eq!(t.lines().count(), 4 + p.ops.len(), "{t}");
        match text::parse(&t) {
            Err(ProgramError::Parse { line: 1, message }) => assert_eq!(message, "expected `program NAME`"),
            other => panic!("{name:?}: {other:?}"),
        }
    }
    // A control character in a one-token name is refused by `parse` too.
    let e = text::parse("program a\u{7f}b\ncollective allreduce ranks=1 chunks=1 inplace\n").unwrap_err();
    assert_eq!(
        e,
        ProgramError::Parse { line: 1, message: "bad program name \"a\\u{7f}b\": it holds a control character".into() }
    );
    // Any other name round trips.
    p.name = "ring-2.x_é".into();
    p.verify().unwrap();
    assert_eq!(text::parse(&text::print(&p)).unwrap(), p);
}
