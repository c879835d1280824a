//! Reading logs: the JSON lines among a benchmark's table, each recognised by its fields.
//!
//! A log is what a benchmark printed with `--json` (comment lines, the table, then one JSON object
//! per line), several such outputs one after another, or scripts/nccl_bench.py's output. Lines that
//! start with `{` are read; the rest are table text, except the `# oxccl compiled plan NAME (EXEC)`
//! header of `oxccl bench plan`, which names the plan and its execution for logs whose rows do not
//! (rows printed before they carried `plan` and `exec`).

use serde::Deserialize;
use serde_json::{Map, Value};

/// The row kinds `oxccl plot` reads, by the fields that tell them apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RowKind {
    /// nccl-tests rows of `oxccl bench all-reduce|reduce-scatter|all-gather|broadcast|reduce`
    /// (`CollectiveRow`).
    Collective,
    /// `oxccl bench plan` rows: a `CollectiveRow` with the plan's name and execution.
    Plan,
    /// scripts/nccl_bench.py's rows (`"library": "nccl"`).
    Nccl,
    /// `oxccl bench movers` rows (`SweepRow`).
    Mover,
    /// `oxccl bench overlap` rows (`OverlapRow`).
    Overlap,
    /// `oxccl bench reshard` rows (`ReshardRow`): recognised, not drawn.
    Reshard,
}

impl RowKind {
    /// Every kind, in the order they are tried (the most specific first).
    const ALL: [RowKind; 5] = [RowKind::Nccl, RowKind::Collective, RowKind::Mover, RowKind::Overlap, RowKind::Reshard];

    /// Fields a row of this kind always has.
    fn fields(self) -> &'static [&'static str] {
        match self {
            RowKind::Nccl => &["library", "collective", "size", "busbw"],
            RowKind::Collective | RowKind::Plan => &["collective", "size", "oop_busbw", "ip_busbw"],
            RowKind::Mover => &["op", "mover", "ctas", "gbps"],
            RowKind::Overlap => &["compute", "mover", "ctas", "makespan_over_serial"],
            RowKind::Reshard => &["program", "ms", "sol_hbm_ms"],
        }
    }

    /// How the kind is named in messages.
    pub fn name(self) -> &'static str {
        match self {
            RowKind::Collective => "collective",
            RowKind::Plan => "compiled-plan",
            RowKind::Nccl => "NCCL",
            RowKind::Mover => "mover-sweep",
            RowKind::Overlap => "overlap",
            RowKind::Reshard => "reshard",
        }
    }
}

/// An nccl-tests row of oxccl: a collective benchmark's or a transfer program's.
#[derive(Clone, Debug, Deserialize)]
pub struct CollectivePoint {
    /// `all_reduce`, `reduce_scatter`, ...
    pub collective: String,
    /// Ranks taking part.
    pub ranks: u64,
    /// CTAs per rank.
    pub ctas: u64,
    /// `tma` or `simt`.
    pub mover: String,
    /// `registers` or `tma`.
    pub reduction: String,
    /// nccl-tests' size in bytes.
    pub size: f64,
    /// nccl-tests' type name.
    pub dtype: String,
    /// Out of place busbw (GB/s), where that side ran.
    pub oop_busbw: Option<f64>,
    /// In place busbw (GB/s), where that side ran.
    pub ip_busbw: Option<f64>,
    /// A transfer program's name (from the row, else from the log's header).
    #[serde(default)]
    pub plan: Option<String>,
    /// How a transfer program ran: `engine` (older logs: `compiled`, `interpreted`, `direct`).
    #[serde(default)]
    pub exec: Option<String>,
}

/// A row of scripts/nccl_bench.py.
#[derive(Clone, Debug, Deserialize)]
pub struct NcclPoint {
    /// `all_reduce`, ...
    pub collective: String,
    /// Ranks (processes, one per GPU).
    pub ranks: u64,
    /// `NCCL_MAX_CTAS` of the run: a number, or `default` where it was unset.
    #[serde(default)]
    pub nccl_max_ctas: Value,
    /// Bytes.
    pub size: f64,
    /// GB/s.
    pub busbw: f64,
}

/// A row of the mover sweep.
#[derive(Clone, Debug, Deserialize)]
pub struct MoverPoint {
    /// `copy`, `reduce-add` or `reduce-into`.
    pub op: String,
    /// `tma` or `simt`.
    pub mover: String,
    /// CTAs.
    pub ctas: f64,
    /// Bytes of each buffer.
    #[serde(default)]
    pub bytes: f64,
    /// Bytes read + written per second / 1e9.
    pub gbps: f64,
    /// Against cuMemcpyDtoD of the same size in the same run.
    #[serde(default)]
    pub of_memcpy: f64,
}

/// A row of the overlap benchmark.
#[derive(Clone, Debug, Deserialize)]
pub struct OverlapPoint {
    /// The compute load's name.
    pub compute: String,
    /// `tma` or `simt`.
    pub mover: String,
    /// `registers` or `tma`.
    pub reduction: String,
    /// The collective's CTAs per rank.
    pub ctas: f64,
    /// Suspend-time hint (ns).
    #[serde(default)]
    pub suspend_ns: f64,
    /// Makespan over the sum of the times alone.
    pub makespan_over_serial: f64,
}

/// A row of the reshard benchmark (counted, not drawn).
#[derive(Clone, Debug, Deserialize)]
pub struct ReshardPoint {
    /// `plan`, `flat_sends` or `gather_broadcast`.
    pub program: String,
}

/// One recognised row.
#[derive(Clone, Debug)]
pub enum Row {
    /// [`RowKind::Collective`] or [`RowKind::Plan`] (the latter with `plan` or `exec` set).
    Collective(CollectivePoint),
    /// [`RowKind::Nccl`].
    Nccl(NcclPoint),
    /// [`RowKind::Mover`].
    Mover(MoverPoint),
    /// [`RowKind::Overlap`].
    Overlap(OverlapPoint),
    /// [`RowKind::Reshard`].
    Reshard(ReshardPoint),
}

impl Row {
    /// The row's kind.
    pub fn kind(&self) -> RowKind {
        match self {
            Row::Collective(c) if c.plan.is_some() || c.exec.is_some() => RowKind::Plan,
            Row::Collective(_) => RowKind::Collective,
            Row::Nccl(_) => RowKind::Nccl,
            Row::Mover(_) => RowKind::Mover,
            Row::Overlap(_) => RowKind::Overlap,
            Row::Reshard(_) => RowKind::Reshard,
        }
    }
}

/// A line that starts with `{` but is not a row `oxccl plot` reads.
#[derive(Clone, Debug, PartialEq)]
pub struct Skipped {
    /// 1-based line number.
    pub line: usize,
    /// Why: not JSON, not an object, no known kind, a field of the wrong type.
    pub why: String,
}

/// The rows of one log.
#[derive(Clone, Debug, Default)]
pub struct Parsed {
    /// Recognised rows, in the log's order.
    pub rows: Vec<Row>,
    /// Lines that looked like JSON rows and were not read.
    pub skipped: Vec<Skipped>,
}

/// `oxccl bench plan`'s header, `# oxccl program NAME (EXEC): COMMAND` (older logs: `# oxccl
/// compiled plan …`): (name, exec).
fn plan_header(line: &str) -> Option<(String, String)> {
    let rest = line.strip_prefix("# oxccl program ").or_else(|| line.strip_prefix("# oxccl compiled plan "))?;
    let (head, _) = rest.split_once("):")?;
    let (name, exec) = head.rsplit_once(" (")?;
    Some((name.to_owned(), exec.to_owned()))
}

/// Reads the rows of a log's text. Never fails: what it cannot read is in [`Parsed::skipped`].
pub fn parse(text: &str) -> Parsed {
    let mut out = Parsed::default();
    // The plan whose rows follow, from the latest benchmark header (any other one ends it).
    let mut plan: Option<(String, String)> = None;
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.starts_with("# oxccl ") {
            plan = plan_header(line);
            continue;
        }
        if !line.starts_with('{') {
            continue;
        }
        let skip = |why: String| Skipped { line: i + 1, why };
        let object = match serde_json::from_str::<Value>(line) {
            Ok(Value::Object(o)) => o,
            Ok(_) => {
                out.skipped.push(skip("not a JSON object".into()));
                continue;
            }
            Err(e) => {
                out.skipped.push(skip(format!("not a JSON object on one line ({e})")));
                continue;
            }
        };
        match row_of(object, plan.as_ref()) {
            Ok(row) => out.rows.push(row),
            Err(why) => out.skipped.push(skip(why)),
        }
    }
    out
}

/// The row an object is, by its fields; `plan` names the plan of rows under a plan header.
fn row_of(object: Map<String, Value>, plan: Option<&(String, String)>) -> Result<Row, String> {
    let kind = RowKind::ALL
        .into_iter()
        .find(|k| k.fields().iter().all(|f| object.contains_key(*f)))
        .ok_or_else(|| "no row kind oxccl plot reads has these fields".to_string())?;
    let value = Value::Object(object);
    let bad = |e: serde_json::Error| format!("a {} row with a field of the wrong type ({e})", kind.name());
    Ok(match kind {
        RowKind::Collective | RowKind::Plan => {
            let mut c: CollectivePoint = serde_json::from_value(value).map_err(bad)?;
            if let Some((name, exec)) = plan {
                c.plan.get_or_insert_with(|| name.clone());
                c.exec.get_or_insert_with(|| exec.clone());
            }
            Row::Collective(c)
        }
        RowKind::Nccl => Row::Nccl(serde_json::from_value(value).map_err(bad)?),
        RowKind::Mover => Row::Mover(serde_json::from_value(value).map_err(bad)?),
        RowKind::Overlap => Row::Overlap(serde_json::from_value(value).map_err(bad)?),
        RowKind::Reshard => Row::Reshard(serde_json::from_value(value).map_err(bad)?),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plan_headers_name_the_plan_and_its_execution() {
        assert_eq!(
            plan_header("# oxccl compiled plan hm-allreduce (2x4) (interpreted): oxccl bench plan --algo x"),
            Some(("hm-allreduce (2x4)".into(), "interpreted".into()))
        );
        assert_eq!(
            plan_header("# oxccl program ring_allreduce_1x8 (engine): oxccl bench plan --algo ring-allreduce"),
            Some(("ring_allreduce_1x8".into(), "engine".into()))
        );
        assert_eq!(plan_header("# oxccl all_reduce: oxccl bench all-reduce"), None);
        assert_eq!(plan_header("# oxccl compiled plan (: x"), None);
    }

    #[test]
    fn lines_that_are_not_rows_are_skipped_with_a_reason() {
        let text = "# table\n{\n{\"a\": 1}\n{\"op\": \"copy\", \"mover\": 3, \"ctas\": 1, \"gbps\": 2}\n  size 1\n{]\n";
        let p = parse(text);
        assert!(p.rows.is_empty());
        let lines: Vec<usize> = p.skipped.iter().map(|s| s.line).collect();
        assert_eq!(lines, [2, 3, 4, 6]);
        assert!(p.skipped[2].why.contains("mover-sweep row with a field of the wrong type"), "{:?}", p.skipped[2]);
    }
}
