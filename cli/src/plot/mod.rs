//! `oxccl plot`: charts from the benchmarks' JSON lines.
//!
//! A log is what a benchmark printed with `--json`: its table and, after it, one JSON object per
//! row (`oxccl bench all-reduce ... --json > ar.log`). scripts/nccl_bench.py's `--json` rows are read
//! too. Several logs are drawn together, each labelled by its file name or by `--label`. The charts
//! ([`Kind`]):
//!
//! | kind | rows | chart, one per |
//! |---|---|---|
//! | `busbw` | the collectives' | busbw against size (log 2), out of place solid, in place dashed; per collective |
//! | `compare` | the collectives' and NCCL's | busbw against size, one line per engine (TMA, SIMT, NCCL) and log, on the side NCCL's script runs; per collective |
//! | `movers` | `bench movers` | GB/s against CTAs per mover, with cuMemcpyDtoD's rate; per operation |
//! | `exec` | `bench plan` | busbw against size per program, one line per execution and log |
//! | `overlap` | `bench overlap` | makespan over serial time against the collective's CTAs; per compute load |
//!
//! Charts are SVG (`DIR/busbw-all_reduce.svg`, ...), and with `--png` PNG as well, rasterised from
//! the SVG with the system's fonts. Lines that are not rows are skipped and counted, never fatal;
//! logs with no row to draw are an error ([`PlotError`]).

mod charts;
mod draw;
mod rows;

pub use charts::{Axis, Chart, Reference, Series, Source, charts};
pub use draw::{png, svg};
pub use rows::{Parsed, Row, RowKind, Skipped, parse};

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};

/// Which charts to draw.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Kind {
    /// Every kind the logs have rows for (`compare` where there are NCCL rows or more than one
    /// engine or log to compare).
    Auto,
    /// Busbw against size per collective, out of place and in place.
    Busbw,
    /// TMA against SIMT against NCCL (and log against log): busbw per engine per collective.
    Compare,
    /// The mover sweep: GB/s against CTAs per operation and mover.
    Movers,
    /// Compiled against interpreted plans: busbw against size per plan.
    Exec,
    /// The overlap benchmark: makespan over serial time against CTAs.
    Overlap,
}

impl Kind {
    /// Every kind but [`Kind::Auto`].
    pub const CHARTS: [Kind; 5] = [Kind::Busbw, Kind::Compare, Kind::Movers, Kind::Exec, Kind::Overlap];

    /// The name as `--kind` takes it.
    pub fn name(self) -> &'static str {
        match self {
            Kind::Auto => "auto",
            Kind::Busbw => "busbw",
            Kind::Compare => "compare",
            Kind::Movers => "movers",
            Kind::Exec => "exec",
            Kind::Overlap => "overlap",
        }
    }

    /// The rows the kind draws, as messages name them.
    fn needs(self) -> &'static str {
        match self {
            Kind::Auto => "",
            Kind::Busbw => "collective rows (from oxccl bench all-reduce ... --json)",
            Kind::Compare => {
                "collective or NCCL rows (from oxccl bench all-reduce ... --json, scripts/nccl_bench.py --json)"
            }
            Kind::Movers => "mover-sweep rows (from oxccl bench movers --json)",
            Kind::Exec => "transfer-program rows (from oxccl bench plan --json)",
            Kind::Overlap => "overlap rows (from oxccl bench overlap --json)",
        }
    }
}

/// Why `oxccl plot` drew nothing, or not everything.
#[derive(Debug, thiserror::Error)]
pub enum PlotError {
    /// A log could not be read.
    #[error("{}: cannot read the log: {source}", path.display())]
    Read {
        /// The log.
        path: PathBuf,
        /// The operating system's error.
        source: std::io::Error,
    },
    /// `--label` was given, but not once per log.
    #[error("--label: {given} labels for {logs} logs; give one per log, in their order")]
    Labels {
        /// Labels given.
        given: usize,
        /// Logs given.
        logs: usize,
    },
    /// No log had a row `oxccl plot` reads.
    #[error(
        "no benchmark rows in {logs}: give what a benchmark printed with --json (or scripts/nccl_bench.py --json){skipped}"
    )]
    NoRows {
        /// The logs, named.
        logs: String,
        /// Where lines that looked like rows were skipped: the first one and why.
        skipped: String,
    },
    /// `--kind` asked for a chart whose rows the logs do not have.
    #[error("--kind {kind}: the logs have no {needs}; they have {found}")]
    NoRowsForKind {
        /// The kind asked for.
        kind: &'static str,
        /// The rows it draws.
        needs: &'static str,
        /// What the logs have, counted.
        found: String,
    },
    /// Rows were found, but none that the charts asked for can draw (reshard rows only, values
    /// that are not finite, sizes of zero on a log axis).
    #[error("nothing to draw: {why}")]
    NothingToDraw {
        /// What the rows were.
        why: String,
    },
    /// The output folder could not be made.
    #[error("{}: cannot make the output folder: {source}", path.display())]
    OutDir {
        /// The folder.
        path: PathBuf,
        /// The operating system's error.
        source: std::io::Error,
    },
    /// A chart could not be written.
    #[error("{}: cannot write the chart: {source}", path.display())]
    Write {
        /// The file.
        path: PathBuf,
        /// The operating system's error.
        source: std::io::Error,
    },
    /// plotters or resvg failed to draw a chart.
    #[error("{}: drawing failed: {why}", path.display())]
    Draw {
        /// The file.
        path: PathBuf,
        /// Their message.
        why: String,
    },
}

/// What to draw and where.
#[derive(Clone, Debug)]
pub struct Options {
    /// The logs.
    pub logs: Vec<PathBuf>,
    /// One label per log (empty: each log's file name without its extension).
    pub labels: Vec<String>,
    /// The folder the charts are written to (made if missing).
    pub out: PathBuf,
    /// Which charts.
    pub kind: Kind,
    /// Put before each chart's caption.
    pub title: Option<String>,
    /// Write a PNG beside each SVG.
    pub png: bool,
}

/// A chart written.
#[derive(Clone, Debug)]
pub struct Written {
    /// The SVG file.
    pub svg: PathBuf,
    /// The PNG file, with `--png`.
    pub png: Option<PathBuf>,
    /// The chart's caption.
    pub title: String,
    /// Its series.
    pub series: usize,
    /// Its points.
    pub points: usize,
}

/// What [`plot`] did.
#[derive(Clone, Debug, Default)]
pub struct Report {
    /// The charts, in the order written.
    pub written: Vec<Written>,
    /// Per log with lines skipped: a line saying how many, the first and why.
    pub notes: Vec<String>,
}

/// Reads a log (bytes that are not UTF-8 are replaced, never fatal).
pub fn read_log(path: &Path) -> Result<Parsed, PlotError> {
    let bytes = std::fs::read(path).map_err(|source| PlotError::Read { path: path.to_owned(), source })?;
    Ok(parse(&String::from_utf8_lossy(&bytes)))
}

/// A log's label by default: its file name without the extension.
fn default_label(path: &Path) -> String {
    path.file_stem().or(path.file_name()).map_or_else(|| path.display().to_string(), |s| s.to_string_lossy().into())
}

/// A chart's file name: letters, digits, `.`, `_` and `-` kept, anything else `_`.
fn file_stem(stem: &str) -> String {
    let s: String =
        stem.chars().map(|c| if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') { c } else { '_' }).collect();
    s.trim_start_matches('.').to_owned()
}

/// `n` rows of each kind, as messages count them: `12 collective, 3 reshard`.
fn counted(rows: &[&Row]) -> String {
    let mut n: BTreeMap<&str, usize> = BTreeMap::new();
    for r in rows {
        *n.entry(r.kind().name()).or_default() += 1;
    }
    if n.is_empty() {
        return "none".into();
    }
    n.iter().map(|(k, v)| format!("{v} {k}")).collect::<Vec<_>>().join(", ")
}

/// Whether `auto` draws `kind` for these rows.
fn auto_draws(kind: Kind, sources: &[Source]) -> bool {
    let rows = || sources.iter().flat_map(|s| s.rows.iter());
    let has = |k: RowKind| rows().any(|r| r.kind() == k);
    match kind {
        Kind::Auto => false,
        Kind::Busbw => has(RowKind::Collective),
        // Something to compare: NCCL's rows, or oxccl's from more than one engine or log.
        Kind::Compare => {
            let engines: HashSet<(usize, &str)> = sources
                .iter()
                .enumerate()
                .flat_map(|(i, s)| {
                    s.rows.iter().filter_map(move |r| match r {
                        Row::Collective(c) if r.kind() == RowKind::Collective => Some((i, c.mover.as_str())),
                        _ => None,
                    })
                })
                .collect();
            has(RowKind::Nccl) || engines.len() > 1
        }
        Kind::Movers => has(RowKind::Mover),
        Kind::Exec => has(RowKind::Plan),
        Kind::Overlap => has(RowKind::Overlap),
    }
}

/// Reads the logs and writes the charts asked for. Errors: a log that cannot be read, `--label`
/// not once per log, logs with no rows, no rows for the `--kind` asked, nothing drawable, the
/// output folder or a chart that cannot be written.
pub fn plot(o: &Options) -> Result<Report, PlotError> {
    if !o.labels.is_empty() && o.labels.len() != o.logs.len() {
        return Err(PlotError::Labels { given: o.labels.len(), logs: o.logs.len() });
    }
    let mut report = Report::default();
    let mut logs = Vec::with_capacity(o.logs.len());
    for (i, path) in o.logs.iter().enumerate() {
        let parsed = read_log(path)?;
        if let Some(first) = parsed.skipped.first() {
            report.notes.push(format!(
                "{}: {} line{} that start with `{{` skipped (line {}: {})",
                path.display(),
                parsed.skipped.len(),
                if parsed.skipped.len() == 1 { "" } else { "s" },
                first.line,
                first.why
            ));
        }
        let label = o.labels.get(i).cloned().unwrap_or_else(|| default_label(path));
        logs.push((label, parsed));
    }
    let sources: Vec<Source> = logs.iter().map(|(label, p)| Source { label, rows: &p.rows }).collect();
    let all: Vec<&Row> = sources.iter().flat_map(|s| s.rows.iter()).collect();
    if all.is_empty() {
        let names: Vec<String> = o.logs.iter().map(|p| p.display().to_string()).collect();
        let skipped = logs
            .iter()
            .zip(&o.logs)
            .find_map(|((_, p), path)| p.skipped.first().map(|s| (path, s)))
            .map_or(String::new(), |(path, s)| format!("; {}: line {}: {}", path.display(), s.line, s.why));
        return Err(PlotError::NoRows { logs: names.join(", "), skipped });
    }
    let kinds: Vec<Kind> = match o.kind {
        Kind::Auto => Kind::CHARTS.into_iter().filter(|&k| auto_draws(k, &sources)).collect(),
        k => vec![k],
    };
    let mut drawn: Vec<Chart> = Vec::new();
    for &k in &kinds {
        let c = charts(k, &sources);
        if c.is_empty() && o.kind != Kind::Auto {
            let has_rows = match k {
                Kind::Busbw => all.iter().any(|r| r.kind() == RowKind::Collective),
                Kind::Compare => all.iter().any(|r| matches!(r.kind(), RowKind::Collective | RowKind::Nccl)),
                Kind::Movers => all.iter().any(|r| r.kind() == RowKind::Mover),
                Kind::Exec => all.iter().any(|r| r.kind() == RowKind::Plan),
                Kind::Overlap => all.iter().any(|r| r.kind() == RowKind::Overlap),
                Kind::Auto => false,
            };
            if !has_rows {
                return Err(PlotError::NoRowsForKind { kind: k.name(), needs: k.needs(), found: counted(&all) });
            }
        }
        drawn.extend(c);
    }
    if drawn.is_empty() {
        let why = if kinds.is_empty() {
            "no chart is drawn from them (oxccl plot draws collective, NCCL, compiled-plan, mover-sweep and overlap \
             rows)"
                .to_string()
        } else {
            "no point of their charts has a positive x and a finite value".to_string()
        };
        return Err(PlotError::NothingToDraw { why: format!("the logs have {} rows: {why}", counted(&all)) });
    }
    std::fs::create_dir_all(&o.out).map_err(|source| PlotError::OutDir { path: o.out.clone(), source })?;
    let mut used: HashSet<String> = HashSet::new();
    for chart in drawn {
        // Two charts whose names read the same once cleaned get numbered files.
        let base = file_stem(&chart.stem);
        let mut stem = base.clone();
        let mut n = 1;
        while !used.insert(stem.clone()) {
            n += 1;
            stem = format!("{base}-{n}");
        }
        let title = match &o.title {
            Some(t) => format!("{t}: {}", chart.title),
            None => chart.title.clone(),
        };
        let svg_path = o.out.join(format!("{stem}.svg"));
        let text = svg(&chart, &title).map_err(|why| PlotError::Draw { path: svg_path.clone(), why })?;
        std::fs::write(&svg_path, &text).map_err(|source| PlotError::Write { path: svg_path.clone(), source })?;
        let png_path = if o.png {
            let path = o.out.join(format!("{stem}.png"));
            let bytes = png(&text).map_err(|why| PlotError::Draw { path: path.clone(), why })?;
            std::fs::write(&path, bytes).map_err(|source| PlotError::Write { path: path.clone(), source })?;
            Some(path)
        } else {
            None
        };
        report.written.push(Written {
            svg: svg_path,
            png: png_path,
            title,
            series: chart.series.len(),
            points: chart.points(),
        });
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_names_keep_only_plain_characters() {
        assert_eq!(file_stem("exec-hm-allreduce (2x4)"), "exec-hm-allreduce__2x4_");
        assert_eq!(file_stem("busbw-../../etc"), "busbw-.._.._etc");
        assert_eq!(file_stem("../x"), "_x");
    }
}
