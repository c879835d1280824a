//! `oxccl plot` on logs made here from the benchmarks' own row types, serialised as the benchmarks
//! print them (so a field renamed in a row breaks these tests, not the charts in the docs), and on
//! logs that are not logs. The values are shapes to draw, not measurements.

use oxccl_cli::bench::{CollectiveRow, OverlapRow, ReshardRow, SweepRow};
use oxccl_cli::commands::bench::PlanRow;
use oxccl_cli::plot::{self, Kind, Options, PlotError};
use proptest::prelude::*;
use std::path::{Path, PathBuf};
use std::process::Command;

/// A fresh folder for one test, removed when dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("oxccl-plot-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("make a scratch folder");
        Scratch(dir)
    }

    /// Writes `text` to `name` in the folder; returns its path.
    fn log(&self, name: &str, text: &str) -> PathBuf {
        let path = self.0.join(name);
        std::fs::write(&path, text).expect("write a log");
        path
    }

    fn out(&self) -> PathBuf {
        self.0.join("charts")
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A log as a benchmark prints it with `--json`: its header, a table line per row, the JSON lines.
fn log_text<T: serde::Serialize>(header: &str, rows: &[T]) -> String {
    let mut text = format!("{header}\n#       size    count   type ...\n");
    for _ in rows {
        text += "     1048576   262144  float ...\n";
    }
    for r in rows {
        text += &serde_json::to_string(r).expect("rows serialise");
        text.push('\n');
    }
    text
}

/// A collective row at `size` bytes with busbw `oop` and `ip`.
fn collective(collective: &'static str, mover: &'static str, size: u64, oop: f64, ip: Option<f64>) -> CollectiveRow {
    CollectiveRow {
        collective,
        root: -1,
        ranks: 8,
        ctas: 8,
        mover,
        reduction: "registers",
        size,
        count: size / 4,
        dtype: "float",
        redop: "sum",
        oop_us: Some(10.0),
        oop_algbw: Some(oop / 1.75),
        oop_busbw: Some(oop),
        oop_wrong: Some(0),
        ip_us: ip.map(|_| 10.0),
        ip_algbw: ip.map(|b| b / 1.75),
        ip_busbw: ip,
        ip_wrong: ip.map(|_| 0),
    }
}

/// A sweep of `collective` from 1 MiB to 64 MiB.
fn sweep(name: &'static str, mover: &'static str) -> Vec<CollectiveRow> {
    (0..4)
        .map(|i| collective(name, mover, 1 << (20 + 2 * i), 10.0 * (i + 1) as f64, Some(9.0 * (i + 1) as f64)))
        .collect()
}

fn mover_row(op: &'static str, mover: &'static str, ctas: u32) -> SweepRow {
    SweepRow {
        op,
        mover,
        ctas,
        threads: 128,
        registers: 32,
        bytes: 1 << 30,
        chunk_bytes: if mover == "tma" { 32768 } else { 0 },
        stages: if mover == "tma" { 4 } else { 0 },
        ms: 1.0,
        gbps: 100.0 * ctas as f64,
        gbps_per_cta: 100.0,
        of_memcpy: 0.05 * ctas as f64,
        piece_bytes: 0,
    }
}

fn overlap_row(mover: &'static str, ctas: u32) -> OverlapRow {
    OverlapRow {
        compute: "fma".into(),
        compute_reps: 100,
        compute_sms: 132,
        compute_registers: None,
        mover,
        reduction: "registers",
        ctas,
        threads: 128,
        smem_bytes: 65536,
        issuers: 1,
        combine_direct: false,
        suspend_ns: 0,
        compute_alone_ms: 3.0,
        collective_alone_ms: 3.0,
        compute_together_ms: 4.0,
        collective_together_ms: 4.0,
        makespan_ms: 4.0,
        makespan_over_serial: 4.0 / 6.0,
    }
}

fn plan_rows(exec: &str) -> Vec<PlanRow> {
    (0..3)
        .map(|i| PlanRow {
            row: CollectiveRow {
                ip_us: None,
                ip_algbw: None,
                ip_busbw: None,
                ip_wrong: None,
                ..sweep("all_reduce", "tma")[i].clone()
            },
            plan: "hm-allreduce".into(),
            exec: exec.into(),
            levels: 9,
        })
        .collect()
}

fn reshard_row() -> ReshardRow {
    ReshardRow {
        program: "plan",
        launches: 1,
        tasks: 8,
        bytes_between_ranks: 1 << 20,
        bytes_local: 0,
        bytes_cross_domain: 0,
        ms: 1.0,
        gbps: 1.0,
        sol_hbm_ms: 0.5,
        sol_nvlink_ms: 0.5,
        busiest_link: "nvlink out of rank 0".into(),
        wrong: Some(0),
    }
}

/// Runs `oxccl ARGS`; returns (success, stdout, stderr).
fn oxccl(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_oxccl")).args(args).output().expect("run oxccl");
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    (out.status.success(), text(&out.stdout), text(&out.stderr))
}

fn path(p: &Path) -> &str {
    p.to_str().expect("scratch paths are UTF-8")
}

fn read(p: PathBuf) -> String {
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

fn options(logs: Vec<PathBuf>, out: PathBuf) -> Options {
    Options { logs, labels: Vec::new(), out, kind: Kind::Auto, title: None, png: false }
}

#[test]
fn busbw_charts_per_collective_name_both_sides() {
    let s = Scratch::new("busbw");
    let mut rows = sweep("all_reduce", "tma");
    rows.extend(sweep("reduce_scatter", "tma"));
    let log = s.log("tma.log", &log_text("# oxccl all_reduce: oxccl bench all-reduce --json", &rows));
    let (ok, stdout, stderr) = oxccl(&["plot", path(&log), "-o", path(&s.out()), "--title", "test <&>"]);
    assert!(ok, "{stderr}");
    for collective in ["all_reduce", "reduce_scatter"] {
        let svg = read(s.out().join(format!("busbw-{collective}.svg")));
        assert!(svg.starts_with("<svg"), "{svg}");
        assert!(svg.contains("out of place") && svg.contains("in place"), "{svg}");
        assert!(svg.contains("test &lt;&amp;&gt;"), "the title, escaped: {svg}");
        assert!(stdout.contains(&format!("busbw-{collective}.svg")), "{stdout}");
    }
    // One log, one engine: nothing to compare.
    assert!(!s.out().join("compare-all_reduce.svg").exists());
    assert!(svg_count(&s.out()) == 2, "{stdout}");
}

fn svg_count(dir: &Path) -> usize {
    std::fs::read_dir(dir)
        .map_or(0, |d| d.filter(|e| e.as_ref().is_ok_and(|e| e.path().extension().is_some_and(|x| x == "svg"))).count())
}

#[test]
fn tma_simt_and_nccl_logs_overlay_under_their_labels() {
    let s = Scratch::new("compare");
    let tma = s.log("a.log", &log_text("# oxccl all_reduce: x", &sweep("all_reduce", "tma")));
    let simt = s.log("b.log", &log_text("# oxccl all_reduce: x", &sweep("all_reduce", "simt")));
    // scripts/nccl_bench.py's fields (a Python script: its rows are written out here).
    let nccl: Vec<serde_json::Value> = (0..4)
        .map(|i| {
            serde_json::json!({"library": "nccl", "collective": "all_reduce", "ranks": 8, "nccl_max_ctas": "default",
                "size": 1u64 << (20 + 2 * i), "time_us": 10.0, "algbw": 5.0, "busbw": 8.75, "wrong_ranks": 0})
        })
        .collect();
    let nccl = s.log("c.log", &log_text("# nccl 2.21 via torch", &nccl));
    let mut o = options(vec![tma, simt, nccl], s.out());
    o.labels = vec!["TMA".into(), "SIMT".into(), "NCCL".into()];
    let report = plot::plot(&o).expect("charts");
    let compare = read(s.out().join("compare-all_reduce.svg"));
    for label in ["TMA", "SIMT", "NCCL", "busbw (GB/s), in place"] {
        assert!(compare.contains(label), "{label}: {compare}");
    }
    let busbw = read(s.out().join("busbw-all_reduce.svg"));
    assert!(busbw.contains("TMA, out of place") && busbw.contains("SIMT, in place"), "{busbw}");
    assert!(!busbw.contains("NCCL"), "NCCL's rows are in the comparison only: {busbw}");
    let titles: Vec<&str> = report.written.iter().map(|w| w.title.as_str()).collect();
    assert_eq!(titles, ["AllReduce bus bandwidth", "AllReduce: oxccl and NCCL"]);
    assert_eq!(report.written[1].series, 3);
    assert_eq!(report.written[1].points, 12);
}

#[test]
fn the_mover_sweep_draws_gbps_against_ctas_per_operation() {
    let s = Scratch::new("movers");
    let mut rows = Vec::new();
    for op in ["copy", "reduce-add"] {
        for ctas in [1, 2, 4, 8] {
            rows.push(mover_row(op, "tma", ctas));
            rows.push(mover_row(op, "simt", ctas));
        }
    }
    let log = s.log("movers.log", &log_text("# oxccl mover sweep: x", &rows));
    let (ok, stdout, stderr) = oxccl(&["plot", path(&log), "-o", path(&s.out()), "--kind", "movers"]);
    assert!(ok, "{stderr}");
    for op in ["copy", "reduce-add"] {
        let svg = read(s.out().join(format!("movers-{op}.svg")));
        for want in ["tma", "simt", "cuMemcpyDtoD", "CTAs"] {
            assert!(svg.contains(want), "{op}: {want}: {svg}");
        }
    }
    assert!(stdout.contains("(2 series, 8 points)"), "{stdout}");
}

#[test]
fn compiled_and_interpreted_plans_share_a_chart() {
    let s = Scratch::new("exec");
    let compiled =
        s.log("compiled.log", &log_text("# oxccl compiled plan hm-allreduce (compiled): x", &plan_rows("compiled")));
    // A log from before the rows named their plan: the header does.
    let old: Vec<CollectiveRow> = plan_rows("interpreted").into_iter().map(|r| r.row).collect();
    let interpreted = s.log("interpreted.log", &log_text("# oxccl compiled plan hm-allreduce (interpreted): x", &old));
    let report = plot::plot(&options(vec![compiled, interpreted], s.out())).expect("charts");
    assert_eq!(report.written.len(), 1, "{report:?}");
    let svg = read(s.out().join("exec-hm-allreduce.svg"));
    assert!(svg.contains("compiled") && svg.contains("interpreted"), "{svg}");
    assert!(!svg.contains("in place<"), "a plan runs one side: {svg}");
}

#[test]
fn overlap_rows_draw_against_no_overlap() {
    let s = Scratch::new("overlap");
    let rows: Vec<OverlapRow> =
        [1, 2, 4].iter().flat_map(|&c| [overlap_row("tma", c), overlap_row("simt", c)]).collect();
    let log = s.log("overlap.log", &log_text("# oxccl overlap: x", &rows));
    plot::plot(&options(vec![log], s.out())).expect("charts");
    let svg = read(s.out().join("overlap-fma.svg"));
    for want in ["tma", "simt", "no overlap"] {
        assert!(svg.contains(want), "{want}: {svg}");
    }
}

#[test]
fn png_beside_the_svg_where_the_system_has_fonts() {
    let s = Scratch::new("png");
    let log = s.log("tma.log", &log_text("# oxccl all_reduce: x", &sweep("all_reduce", "tma")));
    let mut o = options(vec![log], s.out());
    o.png = true;
    match plot::plot(&o) {
        Ok(report) => {
            let png = std::fs::read(report.written[0].png.as_ref().expect("a PNG path")).expect("the PNG");
            assert!(png.starts_with(b"\x89PNG\r\n\x1a\n"), "not a PNG");
            assert!(s.out().join("busbw-all_reduce.svg").exists());
        }
        Err(e) => {
            assert!(e.to_string().contains("no font"), "{e}");
            eprintln!("skipped: the PNG check, no font on this system ({e})");
        }
    }
}

#[test]
fn bad_inputs_are_refused_by_name() {
    let s = Scratch::new("bad");
    let rows = sweep("all_reduce", "tma");
    let good = s.log("good.log", &log_text("# oxccl all_reduce: x", &rows));
    let line = serde_json::to_string(&rows[0]).unwrap();
    let cases: Vec<(Vec<String>, &str)> = vec![
        (vec![path(&s.0.join("missing.log")).into()], "missing.log: cannot read the log"),
        (vec![path(&s.log("empty.log", "")).into()], "no benchmark rows in"),
        (vec![path(&s.log("table.log", "# oxccl all_reduce\n  1048576 262144 float\n")).into()], "no benchmark rows"),
        (
            vec![path(&s.log("cut.log", &format!("{}\n", &line[..line.len() / 2]))).into()],
            "line 1: not a JSON object on one line",
        ),
        (
            vec![path(&s.log("typed.log", &line.replace("\"size\":1048576", "\"size\":\"1M\""))).into()],
            "a collective row with a field of the wrong type",
        ),
        (
            vec![path(&s.log("reshard.log", &log_text("# oxccl reshard: x", &[reshard_row()]))).into()],
            "nothing to draw: the logs have 1 reshard rows: no chart is drawn from them",
        ),
        (
            vec![path(&good).into(), "--kind".into(), "movers".into()],
            "--kind movers: the logs have no mover-sweep rows (from oxccl bench movers --json); they have 4 collective",
        ),
        (vec![path(&good).into(), "--label".into(), "a,b".into()], "--label: 2 labels for 1 logs"),
        (vec![path(&good).into(), "-o".into(), path(&good).into()], "cannot make the output folder"),
    ];
    for (args, want) in cases {
        let mut all: Vec<&str> = vec!["plot"];
        all.extend(args.iter().map(String::as_str));
        if !args.iter().any(|a| a == "-o") {
            all.extend(["-o", path(&s.0)]);
        }
        let (ok, _, stderr) = oxccl(&all);
        assert!(!ok && stderr.contains(want), "{all:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{all:?}: {stderr}");
    }
    // Without -o, or without a log, the parser refuses.
    for args in [&["plot", path(&good)][..], &["plot", "-o", path(&s.0)][..]] {
        let (ok, _, stderr) = oxccl(args);
        assert!(!ok && stderr.contains("required"), "{args:?}: {stderr}");
    }
}

#[test]
fn rows_with_nothing_drawable_are_named() {
    let s = Scratch::new("undrawable");
    // A size of zero has no place on a log axis; JSON has no NaN (serde_json writes null): no point.
    let rows = vec![
        collective("all_reduce", "tma", 0, 1.0, Some(1.0)),
        collective("all_reduce", "tma", 1 << 20, f64::NAN, None),
    ];
    let log = s.log("x.log", &log_text("# oxccl all_reduce: x", &rows));
    match plot::plot(&options(vec![log], s.out())) {
        Err(PlotError::NothingToDraw { why }) => assert!(why.contains("2 collective"), "{why}"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn skipped_lines_are_counted_beside_the_charts() {
    let s = Scratch::new("skipped");
    let mut text = log_text("# oxccl all_reduce: x", &sweep("all_reduce", "tma"));
    text += "{not json\n{\"unknown\": 1}\n\u{fffd}{\n";
    let mut bytes = text.into_bytes();
    bytes.extend_from_slice(b"\xff\xfe{\"a\"\n");
    let log = s.0.join("mixed.log");
    std::fs::write(&log, bytes).unwrap();
    let (ok, _, stderr) = oxccl(&["plot", path(&log), "-o", path(&s.out())]);
    assert!(ok, "{stderr}");
    assert!(stderr.contains("mixed.log: 2 lines that start with `{` skipped"), "{stderr}");
}

/// Progress bars are for terminals: a verification whose stderr is a pipe prints no bar.
#[test]
fn no_bar_without_a_terminal() {
    let (ok, stdout, stderr) = oxccl(&["verify", "--algo", "ring-allreduce", "--topo", "1x4", "--all"]);
    assert!(ok, "{stderr}");
    assert!(stderr.is_empty(), "{stderr:?}");
    assert!(stdout.lines().all(|l| l.starts_with("verify ") && l.contains(": OK")), "{stdout}");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, .. ProptestConfig::default() })]

    /// Any text, and any cut or splice of real rows, reads without a panic, and whatever rows it
    /// gives draw without one.
    #[test]
    fn no_text_panics_the_reader_or_the_charts(
        noise in "(\\{|\\}|\"|:|,|[a-z_]{1,8}|[0-9.eE+-]{1,6}|null|\n| ){0,40}",
        cut in any::<prop::sample::Index>(),
        pick in 0usize..4,
    ) {
        let lines = [
            serde_json::to_string(&sweep("all_reduce", "tma")[1]).unwrap(),
            serde_json::to_string(&mover_row("copy", "simt", 4)).unwrap(),
            serde_json::to_string(&overlap_row("tma", 2)).unwrap(),
            serde_json::to_string(&plan_rows("compiled")[0]).unwrap(),
        ];
        let line = &lines[pick];
        let at = cut.index(line.len() + 1);
        let at = (0..=at).rev().find(|&i| line.is_char_boundary(i)).unwrap_or(0);
        for text in [noise.clone(), format!("{}{noise}\n{line}", &line[..at]), format!("{{{noise}"), format!("{line}\n{}", &line[..at])] {
            let parsed = plot::parse(&text);
            let sources = [plot::Source { label: "x", rows: &parsed.rows }];
            for kind in Kind::CHARTS {
                for chart in plot::charts(kind, &sources) {
                    prop_assert!(plot::svg(&chart, "t").is_ok());
                }
            }
        }
    }
}
