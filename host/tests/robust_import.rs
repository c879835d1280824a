//! Importers on hostile input: typed errors that name what is wrong, in little memory, instead of
//! dropped data, unbounded growth or silent overrides. (How fast the large inputs are imported or
//! refused is checked by `cargo bench -p oxccl-host --bench planners`.)

use oxccl_host::program::msccl::{ImportError, import, import_unchecked};
use oxccl_host::program::{ProgramError, text};
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

/// The system allocator, counting per thread the bytes it holds live and their peak since
/// [`reset_peak`]. A block freed by another thread than the one that allocated it is subtracted
/// there (the count is signed and may go below zero); the import under test runs on one thread.
struct Counting;

thread_local! {
    // `const` and without a destructor: reading them never allocates, nor fails during teardown.
    static LIVE: Cell<i64> = const { Cell::new(0) };
    static PEAK: Cell<i64> = const { Cell::new(0) };
}

/// Adds `delta` bytes to this thread's live count, raising its peak if passed. Never panics.
fn count(delta: i64) {
    let _ = LIVE.try_with(|live| {
        let now = live.get().saturating_add(delta);
        live.set(now);
        let _ = PEAK.try_with(|peak| peak.set(peak.get().max(now)));
    });
}

/// Starts a new peak at this thread's live count; returns that count.
fn reset_peak() -> i64 {
    let live = LIVE.with(Cell::get);
    PEAK.with(|peak| peak.set(live));
    live
}

/// This thread's peak live bytes since [`reset_peak`] returned `base`, above `base`.
fn peak_since(base: i64) -> u64 {
    PEAK.with(Cell::get).saturating_sub(base).max(0) as u64
}

fn layout_bytes(layout: Layout) -> i64 {
    i64::try_from(layout.size()).unwrap_or(i64::MAX)
}

// SAFETY: every call is forwarded to `System` with the caller's arguments, so `System`'s guarantees
// hold; the counting beside it touches only `Cell`s of this thread and neither allocates nor panics.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract for `alloc` (a non-zero size) is `System::alloc`'s.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            count(layout_bytes(layout));
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as for `alloc`.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            count(layout_bytes(layout));
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from this allocator, that is from `System`, with `layout`.
        unsafe { System.dealloc(ptr, layout) };
        count(-layout_bytes(layout));
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: `ptr` came from `System` with `layout`; the caller's contract on `new_size` is
        // `System::realloc`'s.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        // On failure the old block is left as it was, and counted.
        if !p.is_null() {
            count(i64::try_from(new_size).unwrap_or(i64::MAX).saturating_sub(layout_bytes(layout)));
        }
        p
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// A 2-GPU in-place AllReduce of `chunks` chunks where both GPUs send all their chunks `rounds`
/// times and then reduce the peer's into them as often, in one TB each: a buffered exchange whose
/// every send needs a snapshot of `chunks` scratch chunks on each GPU. (Several TBs doing this side
/// by side would be a data race.)
fn wide_exchange(chunks: u32, rounds: u32) -> String {
    let mut x = format!(r#"<algo name="x" nchunksperloop="{chunks}" ngpus="2" coll="allreduce" inplace="1">"#);
    x.push('\n');
    for g in 0..2 {
        let peer = 1 - g;
        x += &format!(r#"  <gpu id="{g}" i_chunks="{chunks}" o_chunks="0" s_chunks="0">"#);
        x += &format!("\n    <tb id=\"0\" send=\"{peer}\" recv=\"{peer}\" chan=\"0\">\n");
        for s in 0..2 * rounds {
            let ty = if s < rounds { "s" } else { "rrc" };
            x += &format!(
                r#"      <step s="{s}" type="{ty}" srcbuf="i" srcoff="0" dstbuf="i" dstoff="0" cnt="{chunks}" depid="-1" deps="-1" hasdep="0"/>"#
            );
            x.push('\n');
        }
        x += "    </tb>\n  </gpu>\n";
    }
    x += "</algo>\n";
    x
}

/// Asserts `e` is the snapshot-growth refusal.
fn assert_snapshot_too_large(e: &ImportError) {
    match e {
        ImportError::Invalid { step: Some(_), error: ProgramError::BadLayout { reason } } => {
            assert!(reason.contains("snapshots of buffered exchanges"), "{e}");
        }
        other => panic!("expected a snapshot-scratch BadLayout, got {other:?}"),
    }
}

#[test]
fn the_allocator_counts_this_threads_peak() {
    let base = reset_peak();
    let mut v = vec![0u8; 1 << 20];
    v.reserve_exact(3 << 20);
    drop(v);
    let after = LIVE.with(Cell::get);
    let peak = peak_since(base);
    assert!((4 << 20..5 << 20).contains(&peak), "{peak} bytes");
    // Another thread's allocations are not this thread's.
    std::thread::spawn(|| drop(vec![0u8; 64 << 20])).join().unwrap();
    assert_eq!(peak_since(base), peak);
    assert!(after - base < 1 << 20, "{} bytes still live", after - base);
}

#[test]
fn wide_exchange_within_limits_imports() {
    let xml = wide_exchange(1 << 20, 1);
    let imp = import(&xml).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(imp.program.layout.scratch, vec![1 << 20, 1 << 20], "one snapshot of every chunk per GPU");
    assert_eq!(imp.program.ops.len(), 4, "two snapshots and two transfers");
}

#[test]
fn snapshot_growth_is_refused_early() {
    // 32 rounds of 2^20-chunk exchanges: under 20 KB of XML asking for 2^25 scratch chunks per
    // GPU, more than `Layout::validate` allows. It used to grow to gigabytes before failing.
    let xml = wide_exchange(1 << 20, 32);
    assert!(xml.len() < 20_000, "{} bytes", xml.len());
    let base = reset_peak();
    let e = import_unchecked(&xml).expect_err("scratch beyond the layout limits");
    assert_snapshot_too_large(&e);
    assert_snapshot_too_large(&import(&xml).expect_err("scratch beyond the layout limits"));
    let peak = peak_since(base);
    assert!(peak < 256 << 20, "the imports held up to {} MiB at once", peak >> 20);
}

#[test]
fn exchanges_whose_snapshots_would_pass_u32_are_refused_by_the_access_limit() {
    // 1100 rounds of 2^22-chunk exchanges: one snapshot round would sum more than u32::MAX scratch
    // chunks on a GPU. Their steps touch more chunks than a program may (`MAX_CHUNK_ACCESSES`),
    // which is refused before any snapshot is sized.
    let xml = wide_exchange(1 << 22, 1100);
    let e = import_unchecked(&xml).expect_err("scratch beyond u32");
    match &e {
        ImportError::Invalid { step: None, error: ProgramError::BadLayout { reason } } => {
            assert!(reason.contains("chunks, more than the supported"), "{e}")
        }
        other => panic!("expected the chunk-access refusal, got {other:?}"),
    }
}

/// A valid 2-GPU AllGather (GPU 0's local copy into chunk 1 waits before the receive that
/// overwrites it); `extra_tb` goes inside GPU 0's second TB (line 7 opens that TB).
fn allgather_with(extra_tb: &str) -> String {
    format!(
        r#"<algo name="t" proto="Simple" nchannels="1" nchunksperloop="2" ngpus="2" coll="allgather" inplace="1">
  <gpu id="0" i_chunks="0" o_chunks="2" s_chunks="0">
    <tb id="0" send="1" recv="1" chan="0">
      <step s="0" type="s" srcbuf="o" srcoff="0" dstbuf="o" dstoff="0" cnt="1" depid="-1" deps="-1" hasdep="0"/>
      <step s="1" type="r" srcbuf="o" srcoff="1" dstbuf="o" dstoff="1" cnt="1" depid="1" deps="0" hasdep="0"/>
    </tb>
    <tb id="1" send="-1" recv="-1" chan="0">
      <step s="0" type="cpy" srcbuf="o" srcoff="0" dstbuf="o" dstoff="1" cnt="1" depid="-1" deps="-1" hasdep="1"/>
{extra_tb}
    </tb>
  </gpu>
  <gpu id="1" i_chunks="0" o_chunks="2" s_chunks="0">
    <tb id="0" send="0" recv="0" chan="0">
      <step s="0" type="s" srcbuf="o" srcoff="1" dstbuf="o" dstoff="1" cnt="1" depid="-1" deps="-1" hasdep="0"/>
      <step s="1" type="r" srcbuf="o" srcoff="0" dstbuf="o" dstoff="0" cnt="1" depid="-1" deps="-1" hasdep="0"/>
    </tb>
  </gpu>
</algo>
"#
    )
}

#[test]
fn control_file_imports() {
    let imp = import(&allgather_with("")).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(imp.program.ops.len(), 3, "two transfers and the copy");
}

#[test]
fn nested_tb_is_refused() {
    // The inner TB used to replace the outer one, dropping its copy step.
    for inner in [r#"      <tb id="2" send="-1" recv="-1" chan="1"></tb>"#, r#"      <tb id="2" chan="1"/>"#] {
        let xml = allgather_with(inner);
        let want = ImportError::RepeatedElement { element: "tb", line: 9, first_line: 7 };
        assert_eq!(import_unchecked(&xml).unwrap_err(), want, "{inner}");
        let e = import(&xml).unwrap_err();
        assert_eq!(e, want);
        assert_eq!(e.to_string(), "line 9: <tb> inside the <tb> of line 7, which is not closed");
    }
}

#[test]
fn nested_gpu_is_refused() {
    let xml = allgather_with(r#"      <gpu id="1" i_chunks="0" o_chunks="2" s_chunks="0"></gpu>"#);
    assert_eq!(import(&xml).unwrap_err(), ImportError::RepeatedElement { element: "gpu", line: 9, first_line: 2 });
}

#[test]
fn second_algo_is_refused() {
    // A first algorithm before the real one used to be dropped without a word.
    let first = r#"<algo name="first" nchunksperloop="2" ngpus="2" coll="allgather" inplace="1"></algo>"#;
    let xml = format!("{first}\n{}", allgather_with(""));
    let want = ImportError::RepeatedElement { element: "algo", line: 2, first_line: 1 };
    assert_eq!(import_unchecked(&xml).unwrap_err(), want);
    let e = import(&xml).unwrap_err();
    assert_eq!(e, want);
    assert!(e.to_string().contains("second <algo>"), "{e}");
    // Nested in the first, too.
    let nested = format!("<algo name=\"outer\" ngpus=\"2\" coll=\"allgather\">\n{}</algo>\n", allgather_with(""));
    assert_eq!(import(&nested).unwrap_err(), want);
}

const TEXT: &str = "program x\n\
collective allreduce ranks=2 chunks=2 inplace\n\
scratch 0\n\
ranks-per-node 2\n\
op0 = xfer r0 in[0] -> r1 in[0] rrc ch=0 chunk=0 step=0 stage=0\n";

#[test]
fn text_control_parses() {
    let p = text::parse(TEXT).unwrap();
    assert_eq!((p.name.as_str(), p.ranks_per_node, p.ops.len()), ("x", Some(2), 1));
}

#[test]
fn repeated_text_headers_are_refused() {
    // Each header repeated after a comment (line 7) used to override the first silently.
    for (header, line) in [
        ("program", "program y"),
        ("collective", "collective allreduce ranks=4 chunks=4 inplace"),
        ("scratch", "scratch 8"),
        ("ranks-per-node", "ranks-per-node 1"),
    ] {
        let first = TEXT.lines().position(|l| l.starts_with(header)).unwrap() + 1;
        let t = format!("{TEXT}# a comment\n{line}\n");
        match text::parse(&t) {
            Err(ProgramError::Parse { line: 7, message }) => {
                assert_eq!(message, format!("repeated `{header}` line (the first is line {first})"));
            }
            other => panic!("{header}: expected a parse error on line 7, got {other:?}"),
        }
    }
}

/// An `<algo name=>` that is not a program name (the text format could not hold it) is refused,
/// naming the attribute, never cut or rewritten: `ring#2` used to become `ring` on a round trip.
#[test]
fn an_algo_name_that_is_not_one_token_becomes_one_and_is_kept() {
    let good = allgather_with("");
    let imp = import(&good).unwrap();
    assert_eq!((imp.program.name.as_str(), imp.file_name), ("t", None));
    for (name, file, token) in [
        ("ring#2", "ring#2", "ring_2"),
        ("my ring", "my ring", "my_ring"),
        ("a&#10;op0", "a\nop0", "a_op0"),
        ("", "", "msccl"),
    ] {
        let xml = good.replacen(r#"name="t""#, &format!(r#"name="{name}""#), 1);
        let imp = import(&xml).unwrap_or_else(|e| panic!("{name:?}: {e}"));
        assert_eq!(imp.program.name, token, "{name:?}");
        assert_eq!(imp.file_name.as_deref(), Some(file), "{name:?}");
        // The text form reads back as the same program.
        assert_eq!(text::parse(&text::print(&imp.program)).unwrap(), imp.program, "{name:?}");
    }
}

/// A file cut before `</algo>` (or inside any element) is refused, naming the open element's line.
#[test]
fn unclosed_elements_are_refused() {
    let good = allgather_with("");
    let cut = good.trim_end().strip_suffix("</algo>").unwrap();
    let want = ImportError::Unclosed { element: "algo".into(), line: 1 };
    assert_eq!(import(cut).unwrap_err(), want);
    assert_eq!(import(cut).unwrap_err().to_string(), "line 1: <algo> is never closed (the file ends inside it)");
    let at_tb = &good[..good.find("</tb>").unwrap()];
    assert_eq!(import(at_tb).unwrap_err(), ImportError::Unclosed { element: "tb".into(), line: 3 });
    // An unknown element left open inside, too.
    let unknown = good.replacen("</tb>", "<note></tb>", 1);
    assert!(matches!(import(&unknown).unwrap_err(), ImportError::Xml { message } if message.starts_with("line 6:")));
}

/// Known elements outside their parent would be skipped by MSCCL: refused with their line.
#[test]
fn misplaced_elements_are_refused() {
    let good = allgather_with("");
    let cases = [
        (
            good.replacen("<tb id=\"1\"", "<wrap><tb id=\"1\"", 1).replacen(
                "</tb>\n  </gpu>",
                "</tb></wrap>\n  </gpu>",
                1,
            ),
            "tb",
            7,
            Some("wrap"),
        ),
        (format!("{}<gpu id=\"2\"/>\n", good), "gpu", 19, None),
        (good.replacen("<gpu id=\"1\"", "<step s=\"0\" type=\"nop\"/><gpu id=\"1\"", 1), "step", 12, Some("algo")),
        (format!("<root>\n{good}</root>\n"), "algo", 2, Some("root")),
    ];
    for (xml, element, line, parent) in cases {
        let want = ImportError::Misplaced { element: element.into(), line, parent: parent.map(str::to_string) };
        assert_eq!(import(&xml).unwrap_err(), want, "{xml}");
    }
}

#[test]
fn repeated_attributes_and_steps_out_of_order_are_refused() {
    let good = allgather_with("");
    let twice = good.replacen(r#"cnt="1""#, r#"cnt="1" cnt="2""#, 1);
    assert_eq!(
        import(&twice).unwrap_err(),
        ImportError::DuplicateAttribute { element: "step".into(), attribute: "cnt".into(), line: 4 }
    );
    // Steps numbered 1, 0: MSCCL runs them in the order written, and dependencies name the numbers.
    let swapped = good
        .replacen(r#"<step s="0""#, r#"<step s="X""#, 1)
        .replacen(r#"<step s="1""#, r#"<step s="0""#, 1)
        .replacen(r#"<step s="X""#, r#"<step s="1""#, 1);
    match import(&swapped).unwrap_err() {
        ImportError::BadAttribute { attribute, value, line: 4, .. } => {
            assert_eq!((attribute.as_str(), value.as_str()), ("s", "1"))
        }
        other => panic!("expected the step order refused, got {other:?}"),
    }
}

/// Declared chunk counts must agree with `nchunksperloop` and with the steps.
#[test]
fn declared_chunk_counts_that_contradict_the_file_are_refused() {
    let good = allgather_with("");
    // More output chunks than the 2 of `nchunksperloop`.
    let more = good.replacen(r#"<gpu id="1" i_chunks="0" o_chunks="2""#, r#"<gpu id="1" i_chunks="0" o_chunks="4""#, 1);
    let want = ImportError::DeclaredChunks { gpu: 1, line: 12, attribute: "o_chunks", declared: 4, limit: 2 };
    assert_eq!(import(&more).unwrap_err(), want);
    assert!(want.to_string().starts_with("line 12: gpu 1 declares o_chunks=\"4\""), "{want}");
    // A step reaching past the one output chunk GPU 0 declares.
    let fewer =
        good.replacen(r#"<gpu id="0" i_chunks="0" o_chunks="2""#, r#"<gpu id="0" i_chunks="0" o_chunks="1""#, 1);
    match import(&fewer).unwrap_err() {
        ImportError::BeyondDeclared { step, attribute: "o_chunks", declared: 1, slice } => {
            assert_eq!((step.gpu, step.tb, step.step, step.line, slice.offset), (0, 0, 1, 5, 1));
        }
        other => panic!("expected a step past the declared chunks, got {other:?}"),
    }
    // A step using the input buffer an in-place AllGather GPU declares empty.
    let input = good.replacen(r#"type="s" srcbuf="o" srcoff="0""#, r#"type="s" srcbuf="i" srcoff="0""#, 1);
    assert!(matches!(
        import(&input).unwrap_err(),
        ImportError::BeyondDeclared { attribute: "i_chunks", declared: 0, .. }
    ));
}

/// Reading a file stops at a byte limit with a typed error: `/dev/zero` does not end.
#[test]
fn input_files_are_read_up_to_a_limit() {
    use oxccl_host::program::{InputError, read_input};
    use std::path::Path;
    let zero = Path::new("/dev/zero");
    if zero.exists() {
        assert_eq!(read_input(zero, 1 << 16), Err(InputError::TooLarge { path: "/dev/zero".into(), limit: 1 << 16 }));
    }
    let dir = std::env::temp_dir().join(format!("oxccl-robust-import-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("ag.xml");
    std::fs::write(&file, allgather_with("")).unwrap();
    assert_eq!(oxccl_host::program::msccl::import_path(&file).unwrap().program.ops.len(), 3);
    assert!(matches!(read_input(&file, 100), Err(InputError::TooLarge { limit: 100, .. })));
    let binary = dir.join("bin.xml");
    std::fs::write(&binary, b"<algo \xff\xfe>").unwrap();
    assert!(matches!(read_input(&binary, 100), Err(InputError::NotUtf8 { at: 6, .. })));
    let missing = dir.join("missing.xml");
    match oxccl_host::program::msccl::import_path(&missing) {
        Err(ImportError::Input(InputError::Io { path, .. })) => assert!(path.ends_with("missing.xml")),
        other => panic!("expected an I/O error, got {other:?}"),
    }
    match text::parse_path(&missing) {
        Err(ProgramError::Input(InputError::Io { .. })) => {}
        other => panic!("expected an I/O error, got {other:?}"),
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A 1-GPU file of `wide` copies of the whole input to scratch, then `narrow` copies of one chunk
/// each: from the input (`into_input` false: each splits the chunks the wide copies read) or into it
/// (each a write that conflicts with every wide copy).
fn many_readers(wide: u32, narrow: u32, into_input: bool) -> String {
    let mut x = format!(
        "<algo name=\"readers\" ngpus=\"1\" coll=\"allreduce\" nchunksperloop=\"{narrow}\" inplace=\"1\">\n<gpu id=\"0\" i_chunks=\"{narrow}\" o_chunks=\"0\" s_chunks=\"{}\">\n<tb id=\"0\" send=\"-1\" recv=\"-1\" chan=\"0\">\n",
        2 * narrow
    );
    for s in 0..wide {
        x += &format!(
            "<step s=\"{s}\" type=\"cpy\" srcbuf=\"i\" srcoff=\"0\" dstbuf=\"s\" dstoff=\"0\" cnt=\"{narrow}\"/>\n"
        );
    }
    for j in 0..narrow {
        let (s, scratch) = (wide + j, narrow + j);
        let (src, dst) = if into_input { (("s", scratch), ("i", j)) } else { (("i", j), ("s", scratch)) };
        x += &format!(
            "<step s=\"{s}\" type=\"cpy\" srcbuf=\"{}\" srcoff=\"{}\" dstbuf=\"{}\" dstoff=\"{}\" cnt=\"1\"/>\n",
            src.0, src.1, dst.0, dst.1
        );
    }
    x + "</tb>\n</gpu>\n</algo>\n"
}

#[test]
fn many_readers_of_many_chunks_stay_small() {
    let xml = many_readers(3000, 3000, false);
    let base = reset_peak();
    let imp = import(&xml).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(imp.program.ops.len(), 6000);
    let peak = peak_since(base);
    // Copying the 3000 readers at each of 3000 splits held 142 MiB at once.
    assert!(peak < 48 << 20, "the import held up to {} MiB at once", peak >> 20);
}

/// Every one of many reads of a chunk conflicts with every one of many later writes of it: a small
/// file asking for work without bound is refused, quickly (it used to take 10 s).
#[test]
fn unbounded_conflicts_are_refused() {
    // 12000 wide copies from the input, then 12000 narrow copies into it: 144 million conflicts.
    let xml = many_readers(12_000, 12_000, true);
    let t = std::time::Instant::now();
    match import_unchecked(&xml) {
        Err(ImportError::TooLarge { reason }) => assert!(reason.contains("more than"), "{reason}"),
        other => panic!("expected the work limit, got {:?}", other.map(|i| i.program.ops.len())),
    }
    // A loose bound: the budget is in the planners bench.
    assert!(t.elapsed() < std::time::Duration::from_secs(10), "{:?}", t.elapsed());
}
