//! Tables of the docs rewritten from a snapshot (`scripts/perf-snapshot.sh`'s output folder): the
//! numbers in a marked table are the ones the snapshot's runs printed, with the date, commit and
//! device they ran at.
//!
//! A table is marked in Markdown by two comments; what lies between them is replaced:
//!
//! ```text
//! <!-- snap-table rows=size cells=oop_us/ip_us small-tma-1="TMA, 1 CTA" small-graph-16="graph, 16" -->
//! (written by `oxccl tables`)
//! <!-- /snap-table -->
//! ```
//!
//! `rows` names the field that keys the rows (`size` is printed as 8 B, 4 KiB, …), `cells` the
//! fields each cell shows (joined by ` / `), and every `NAME="LABEL"` a column: the JSON rows of
//! snapshot `NAME` (`NAME.jsonl`, else the JSON lines of `NAME.log`). Times (`*_us`) are printed as
//! the benchmarks print them (nccl-tests' widths), bandwidths with two decimals.

use serde_json::{Map, Value};
use std::path::{Path, PathBuf};

/// Opening mark of a generated table.
const OPEN: &str = "<!-- snap-table ";
/// Closing mark.
const CLOSE: &str = "<!-- /snap-table -->";

/// Why a table could not be rewritten.
#[derive(Debug, thiserror::Error)]
pub enum TablesError {
    /// A mark that cannot be read.
    #[error("line {line}: {why}")]
    Mark {
        /// 1-based line of the document.
        line: usize,
        /// What is wrong with it.
        why: String,
    },
    /// A file of the snapshot that cannot be read.
    #[error("{}: {source}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// A snapshot whose run did not succeed, or that printed no rows.
    #[error("snapshot {name}: {why}")]
    Snapshot {
        /// The snapshot's name.
        name: String,
        /// What is wrong with it.
        why: String,
    },
}

/// One marked table: the row key, the cell fields and the columns (snapshot name, label).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mark {
    /// The field whose values key the rows.
    pub rows: String,
    /// The fields each cell shows.
    pub cells: Vec<String>,
    /// (snapshot name, column label), in order.
    pub columns: Vec<(String, String)>,
}

impl Mark {
    /// Reads a mark's words, from after `<!-- snap-table ` up to `-->`.
    pub fn parse(text: &str) -> Result<Mark, String> {
        let body = text.trim().strip_suffix("-->").ok_or("the mark does not end with -->")?;
        let mut rows = None;
        let mut cells = None;
        let mut columns = Vec::new();
        for (key, value) in words(body)? {
            match key.as_str() {
                "rows" => rows = Some(value),
                "cells" => cells = Some(value.split('/').map(str::to_string).collect::<Vec<_>>()),
                _ => columns.push((key, value)),
            }
        }
        let rows = rows.ok_or("no rows=FIELD")?;
        let cells = cells.ok_or("no cells=FIELD[/FIELD…]")?;
        if cells.iter().any(String::is_empty) {
            return Err("an empty field in cells".into());
        }
        if columns.is_empty() {
            return Err("no column (NAME=\"LABEL\")".into());
        }
        Ok(Mark { rows, cells, columns })
    }
}

/// `key=value` words, a value in double quotes where it holds spaces.
fn words(body: &str) -> Result<Vec<(String, String)>, String> {
    let mut out = Vec::new();
    let mut rest = body.trim_start();
    while !rest.is_empty() {
        let eq = rest.find('=').ok_or_else(|| format!("{rest:?}: not key=value"))?;
        let key = rest[..eq].to_string();
        if key.is_empty() || key.contains(char::is_whitespace) {
            return Err(format!("{key:?}: not a key"));
        }
        rest = &rest[eq + 1..];
        let value;
        if let Some(quoted) = rest.strip_prefix('"') {
            let end = quoted.find('"').ok_or_else(|| format!("{key}: unclosed quote"))?;
            value = quoted[..end].to_string();
            rest = &quoted[end + 1..];
        } else {
            let end = rest.find(char::is_whitespace).unwrap_or(rest.len());
            value = rest[..end].to_string();
            rest = &rest[end..];
        }
        out.push((key, value));
        rest = rest.trim_start();
    }
    Ok(out)
}

/// A snapshot folder and what its `machine.txt` says.
#[derive(Clone, Debug)]
pub struct Snapshot {
    /// The folder.
    pub dir: PathBuf,
    /// When it ran (`date (UTC): …`).
    pub date: String,
    /// At which commit (`commit: …`).
    pub commit: String,
    /// The first GPU's name and driver, from nvidia-smi's line.
    pub device: String,
    /// (name, status) of every run in `summary.tsv` (`ok`, `failed …`, `skipped: …`).
    pub runs: Vec<(String, String)>,
}

impl Snapshot {
    /// Reads `dir/machine.txt` and `dir/summary.tsv`.
    pub fn open(dir: &Path) -> Result<Snapshot, TablesError> {
        let path = dir.join("machine.txt");
        let text = std::fs::read_to_string(&path).map_err(|source| TablesError::Read { path, source })?;
        let field = |prefix: &str| {
            text.lines().find_map(|l| l.strip_prefix(prefix)).map(|v| v.trim().to_string()).unwrap_or_default()
        };
        // nvidia-smi's CSV: "0, NVIDIA H200, 580.159.04, 143771 MiB, 1980 MHz".
        let device = text
            .lines()
            .find(|l| l.starts_with("0, "))
            .map(|l| {
                let f: Vec<&str> = l.split(',').map(str::trim).collect();
                match (f.get(1), f.get(2)) {
                    (Some(name), Some(driver)) => format!("{name} (driver {driver})"),
                    _ => l.to_string(),
                }
            })
            .unwrap_or_else(|| "no GPU listed".into());
        let path = dir.join("summary.tsv");
        let summary = std::fs::read_to_string(&path).map_err(|source| TablesError::Read { path, source })?;
        let runs = summary
            .lines()
            .skip(1)
            .filter_map(|l| {
                let mut f = l.split('\t');
                Some((f.next()?.to_string(), f.next().unwrap_or("").to_string()))
            })
            .collect();
        Ok(Snapshot { dir: dir.to_path_buf(), date: field("date (UTC):"), commit: field("commit:"), device, runs })
    }

    /// `name`'s status, where the snapshot ran it.
    fn status(&self, name: &str) -> Option<&str> {
        self.runs.iter().find(|(n, _)| n == name).map(|(_, s)| s.as_str())
    }

    /// The JSON rows snapshot `name` printed.
    fn rows(&self, name: &str) -> Result<Vec<Map<String, Value>>, TablesError> {
        let bad = |why: String| TablesError::Snapshot { name: name.to_string(), why };
        match self.status(name) {
            Some("ok") => {}
            Some(s) => return Err(bad(format!("its run did not succeed ({s})"))),
            None => return Err(bad("not in this snapshot's summary.tsv".into())),
        }
        let jsonl = self.dir.join(format!("{name}.jsonl"));
        let path = if jsonl.exists() { jsonl } else { self.dir.join(format!("{name}.log")) };
        let text = std::fs::read_to_string(&path).map_err(|source| TablesError::Read { path, source })?;
        let rows: Vec<_> = text
            .lines()
            .filter(|l| l.starts_with('{'))
            .filter_map(|l| serde_json::from_str::<Map<String, Value>>(l).ok())
            .collect();
        if rows.is_empty() {
            return Err(bad("printed no JSON rows".into()));
        }
        Ok(rows)
    }
}

/// `bytes` as the docs write sizes: 8 B, 4 KiB, 32 KiB, 2 MiB, 1 GiB.
pub fn size_name(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut unit = 0;
    let mut v = bytes;
    while v >= 1024 && v.is_multiple_of(1024) && unit + 1 < UNITS.len() {
        v /= 1024;
        unit += 1;
    }
    format!("{v} {}", UNITS[unit])
}

/// A field of a row as the benchmarks print it: times (`…_us`) with nccl-tests' decimals,
/// bandwidths (`…bw`) with two, other numbers and strings as they are; `N/A` where absent.
fn field_text(row: &Map<String, Value>, field: &str) -> String {
    match row.get(field) {
        Some(Value::Number(n)) => match n.as_f64() {
            Some(x) if field.ends_with("_us") => crate::bench::nccl_time(x),
            Some(x) if field.ends_with("bw") => format!("{x:.2}"),
            _ => n.to_string(),
        },
        Some(Value::String(s)) => s.clone(),
        Some(v) if !v.is_null() => v.to_string(),
        _ => "N/A".into(),
    }
}

/// The key of a row (`rows`), for ordering (numbers numerically) and printing.
fn row_key(row: &Map<String, Value>, rows: &str) -> Option<(f64, String)> {
    let v = row.get(rows)?;
    let text = match (rows, v.as_u64()) {
        ("size", Some(b)) => size_name(b),
        _ => field_text(row, rows),
    };
    Some((v.as_f64().unwrap_or(f64::NAN), text))
}

/// The table of `mark` from `snap`: a line naming the snapshot, then the Markdown table.
pub fn render(mark: &Mark, snap: &Snapshot) -> Result<String, TablesError> {
    let mut columns = Vec::new();
    for (name, _) in &mark.columns {
        columns.push(snap.rows(name)?);
    }
    // Every key any column has, in numeric order (strings after, in order of appearance).
    let mut keys: Vec<(f64, String)> = Vec::new();
    for rows in &columns {
        for r in rows {
            if let Some(k) = row_key(r, &mark.rows)
                && !keys.iter().any(|(_, t)| *t == k.1)
            {
                keys.push(k);
            }
        }
    }
    keys.sort_by(|a, b| a.0.total_cmp(&b.0));
    let names: Vec<&str> = mark.columns.iter().map(|(n, _)| n.as_str()).collect();
    let mut out = format!(
        "Snapshot {} UTC, {}, {} (`scripts/perf-snapshot.sh {}`; cells: {}):\n\n",
        snap.date,
        snap.commit,
        snap.device,
        names.join(" "),
        mark.cells.join(" / ")
    );
    out.push_str(&format!("| {} |", mark.rows));
    for (_, label) in &mark.columns {
        out.push_str(&format!(" {label} |"));
    }
    out.push_str(&format!("\n|---|{}\n", "---|".repeat(mark.columns.len())));
    for (_, key) in &keys {
        out.push_str(&format!("| {key} |"));
        for rows in &columns {
            // The last row with this key: a log with several runs of one size shows the last.
            let cell = rows.iter().rev().find(|r| row_key(r, &mark.rows).is_some_and(|k| k.1 == *key)).map_or_else(
                || "—".to_string(),
                |r| mark.cells.iter().map(|f| field_text(r, f)).collect::<Vec<_>>().join(" / "),
            );
            out.push_str(&format!(" {cell} |"));
        }
        out.push('\n');
    }
    Ok(out)
}

/// What [`rewrite`] did.
#[derive(Debug, Default)]
pub struct Rewritten {
    /// The document with its tables rewritten.
    pub text: String,
    /// Tables rewritten, by the line of their mark.
    pub written: Vec<usize>,
    /// Tables kept as they were (a column the snapshot did not run), by line, with the names missing.
    pub kept: Vec<(usize, Vec<String>)>,
}

/// Rewrites every marked table of `doc` whose columns `snap` ran; keeps the others.
pub fn rewrite(doc: &str, snap: &Snapshot) -> Result<Rewritten, TablesError> {
    let mut out = Rewritten::default();
    let mut lines = doc.lines().enumerate();
    while let Some((i, line)) = lines.next() {
        out.text.push_str(line);
        out.text.push('\n');
        let Some(spec) = line.trim_start().strip_prefix(OPEN) else { continue };
        let mark = Mark::parse(spec).map_err(|why| TablesError::Mark { line: i + 1, why })?;
        let mut old = String::new();
        let mut closed = false;
        for (_, l) in lines.by_ref() {
            if l.trim() == CLOSE {
                closed = true;
                break;
            }
            old.push_str(l);
            old.push('\n');
        }
        if !closed {
            return Err(TablesError::Mark { line: i + 1, why: format!("no {CLOSE} after it") });
        }
        let missing: Vec<String> =
            mark.columns.iter().filter(|(n, _)| snap.status(n).is_none()).map(|(n, _)| n.clone()).collect();
        if missing.is_empty() {
            out.text.push_str(&render(&mark, snap)?);
            out.written.push(i + 1);
        } else {
            out.text.push_str(&old);
            out.kept.push((i + 1, missing));
        }
        out.text.push_str(CLOSE);
        out.text.push('\n');
    }
    if !doc.ends_with('\n') {
        out.text.pop();
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A snapshot folder with `machine.txt`, `summary.tsv` and one log per (name, status, rows).
    fn snapshot(runs: &[(&str, &str, &[&str])]) -> (tempdir::Dir, Snapshot) {
        let d = tempdir::Dir::new();
        std::fs::write(
            d.0.join("machine.txt"),
            "date (UTC): 2026-12-07 05:00:00\ncommit: abc1234\nindex, name\n0, NVIDIA H200, 580.159.04, 143771 MiB, 1980 MHz\n",
        )
        .unwrap();
        let mut summary = "name\tstatus\tseconds\tcommand\n".to_string();
        for (name, status, rows) in runs {
            summary.push_str(&format!("{name}\t{status}\t1\toxccl bench\n"));
            std::fs::write(d.0.join(format!("{name}.log")), format!("# table\n{}\n", rows.join("\n"))).unwrap();
        }
        std::fs::write(d.0.join("summary.tsv"), summary).unwrap();
        let s = Snapshot::open(&d.0).unwrap();
        (d, s)
    }

    mod tempdir {
        /// A folder under the system's temporary one, removed on drop.
        pub struct Dir(pub std::path::PathBuf);
        impl Dir {
            pub fn new() -> Dir {
                use std::sync::atomic::{AtomicUsize, Ordering};
                static N: AtomicUsize = AtomicUsize::new(0);
                let p = std::env::temp_dir().join(format!(
                    "oxccl-tables-{}-{}",
                    std::process::id(),
                    N.fetch_add(1, Ordering::SeqCst)
                ));
                std::fs::create_dir_all(&p).unwrap();
                Dir(p)
            }
        }
        impl Drop for Dir {
            fn drop(&mut self) {
                let _ = std::fs::remove_dir_all(&self.0);
            }
        }
    }

    const DOC: &str = "# Perf\n\ntext\n<!-- snap-table rows=size cells=oop_us/ip_us a=\"TMA, 1\" b=\"graph\" -->\nold table\n<!-- /snap-table -->\nafter\n";

    /// The marked table is replaced by the snapshot's rows, times as the benchmarks print them, a
    /// size a column lacks as a dash; the rest of the document is kept byte for byte.
    #[test]
    fn a_marked_table_is_rewritten_from_the_snapshot() {
        let (_d, snap) = snapshot(&[
            (
                "a",
                "ok",
                &[
                    r#"{"size":8,"oop_us":7.135999,"ip_us":6.97152}"#,
                    r#"{"size":4096,"oop_us":123.456,"ip_us":12345.6}"#,
                ],
            ),
            ("b", "ok", &[r#"{"size":8,"oop_us":4.829951,"ip_us":4.85024}"#]),
        ]);
        let r = rewrite(DOC, &snap).unwrap();
        assert_eq!(r.written, vec![4]);
        assert!(r.kept.is_empty());
        let want = "# Perf\n\ntext\n<!-- snap-table rows=size cells=oop_us/ip_us a=\"TMA, 1\" b=\"graph\" -->\n\
            Snapshot 2026-12-07 05:00:00 UTC, abc1234, NVIDIA H200 (driver 580.159.04) (`scripts/perf-snapshot.sh a b`; cells: oop_us / ip_us):\n\n\
            | size | TMA, 1 | graph |\n|---|---|---|\n| 8 B | 7.14 / 6.97 | 4.83 / 4.85 |\n| 4 KiB | 123.5 / 12346 | — |\n\
            <!-- /snap-table -->\nafter\n";
        assert_eq!(r.text, want);
        // Rewriting again from the same snapshot changes nothing.
        assert_eq!(rewrite(&r.text, &snap).unwrap().text, want);
    }

    /// A table with a column the snapshot did not run is kept as it was; one whose run failed, or
    /// a mark that cannot be read or is never closed, is an error naming it.
    #[test]
    fn tables_the_snapshot_cannot_fill_are_kept_or_refused() {
        let (_d, snap) = snapshot(&[("a", "ok", &[r#"{"size":8,"oop_us":1.0,"ip_us":2.0}"#])]);
        let r = rewrite(DOC, &snap).unwrap();
        assert_eq!(r.text, DOC);
        assert_eq!(r.kept, vec![(4, vec!["b".to_string()])]);

        let (_d, snap) = snapshot(&[("a", "ok", &[r#"{"size":8}"#]), ("b", "failed (1)", &[])]);
        let e = rewrite(DOC, &snap).unwrap_err();
        assert!(e.to_string().contains("snapshot b: its run did not succeed (failed (1))"), "{e}");

        let (_d, snap) = snapshot(&[("a", "ok", &["no json"]), ("b", "ok", &[r#"{"size":8}"#])]);
        assert!(rewrite(DOC, &snap).unwrap_err().to_string().contains("snapshot a: printed no JSON rows"));

        std::fs::remove_file(snap.dir.join("summary.tsv")).unwrap();
        let e = Snapshot::open(&snap.dir).unwrap_err();
        assert!(e.to_string().contains("summary.tsv"), "{e}");

        let unclosed = DOC.replace("<!-- /snap-table -->\n", "");
        assert!(rewrite(&unclosed, &snap).unwrap_err().to_string().starts_with("line 4: no <!-- /snap-table -->"));
        for (bad, why) in [
            ("<!-- snap-table cells=x a=\"A\" -->", "no rows=FIELD"),
            ("<!-- snap-table rows=size a=\"A\" -->", "no cells="),
            ("<!-- snap-table rows=size cells=x -->", "no column"),
            ("<!-- snap-table rows=size cells=x a=\"A -->", "unclosed quote"),
            ("<!-- snap-table rows=size cells=x a", "does not end with -->"),
        ] {
            let e = rewrite(&format!("{bad}\n<!-- /snap-table -->\n"), &snap).unwrap_err();
            assert!(e.to_string().starts_with("line 1: ") && e.to_string().contains(why), "{bad}: {e}");
        }
    }

    /// Sizes as the docs write them.
    #[test]
    fn sizes_are_named_in_binary_units() {
        assert_eq!(size_name(8), "8 B");
        assert_eq!(size_name(4096), "4 KiB");
        assert_eq!(size_name(32 << 10), "32 KiB");
        assert_eq!(size_name(3 << 20), "3 MiB");
        assert_eq!(size_name(1 << 30), "1 GiB");
        assert_eq!(size_name(1000), "1000 B");
    }
}
