//! `oxccl plot`: SVG (and PNG) charts from the benchmarks' `--json` logs.
//!
//! ```text
//! oxccl bench all-reduce --gpus 8 -b 1M -e 4G --json > ar-tma.log
//! oxccl bench all-reduce --gpus 8 -b 1M -e 4G --mover simt --json > ar-simt.log
//! python3 scripts/nccl_bench.py --gpus 8 --collectives all_reduce -b 1M -e 4G --json > ar-nccl.log
//! oxccl plot ar-tma.log ar-simt.log ar-nccl.log --label tma,simt,nccl -o charts
//! ```
//!
//! See [`crate::plot`] for the charts each kind of row gives.

use super::CliResult;
use crate::plot::{self, Kind, Options};
use std::path::PathBuf;

/// Flags of `oxccl plot`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Logs: a benchmark's output with --json (table and JSON lines), or scripts/nccl_bench.py --json.
    #[arg(required = true, value_name = "LOG")]
    pub logs: Vec<PathBuf>,
    /// Folder for the charts (made if missing).
    #[arg(short = 'o', long = "out", value_name = "DIR")]
    pub out: PathBuf,
    /// Which charts: every kind the logs have rows for, or one.
    #[arg(long, value_enum, default_value = "auto")]
    pub kind: Kind,
    /// Put before each chart's caption (`H200 x8: AllReduce bus bandwidth`).
    #[arg(long, value_name = "T")]
    pub title: Option<String>,
    /// One label per log, in order, for the legends (comma separated or repeated; default: the
    /// file names without their extension).
    #[arg(long, value_delimiter = ',', value_name = "LABEL")]
    pub label: Vec<String>,
    /// Also write each chart as PNG, drawn from its SVG with the system's fonts.
    #[arg(long)]
    pub png: bool,
}

/// Reads the logs, writes the charts and lists them.
pub fn run(a: Args) -> CliResult {
    let report =
        plot::plot(&Options { logs: a.logs, labels: a.label, out: a.out, kind: a.kind, title: a.title, png: a.png })?;
    for note in &report.notes {
        eprintln!("oxccl plot: {note}");
    }
    for w in &report.written {
        let png = w.png.as_ref().map_or(String::new(), |p| format!(" and {}", p.display()));
        println!("{}{png}: {} ({} series, {} points)", w.svg.display(), w.title, w.series, w.points);
    }
    Ok(())
}
