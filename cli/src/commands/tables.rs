//! `oxccl tables`: rewrites the docs' marked tables from a snapshot folder.
//!
//! ```text
//! OUT=snap scripts/perf-snapshot.sh small-tma-1 small-graph-16
//! oxccl tables snap docs/PERF.md
//! ```
//!
//! See [`crate::tables`] for the marks.

use super::CliResult;
use crate::tables::{Snapshot, rewrite};
use std::path::PathBuf;

/// Flags of `oxccl tables`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// The snapshot: a folder `scripts/perf-snapshot.sh` wrote (machine.txt, summary.tsv, NAME.log).
    #[arg(value_name = "SNAPSHOT")]
    pub snapshot: PathBuf,
    /// The documents whose `<!-- snap-table … -->` tables are rewritten in place.
    #[arg(value_name = "DOC", default_value = "docs/PERF.md")]
    pub docs: Vec<PathBuf>,
    /// Write nothing: say which tables would change, and fail if any would.
    #[arg(long)]
    pub check: bool,
}

/// Rewrites (or checks) each document's tables and says which were rewritten and which kept.
pub fn run(a: Args) -> CliResult {
    let snap = Snapshot::open(&a.snapshot)?;
    let mut stale = Vec::new();
    for doc in &a.docs {
        let text = std::fs::read_to_string(doc).map_err(|e| format!("{}: {e}", doc.display()))?;
        let r = rewrite(&text, &snap)?;
        let verb = if a.check { "would be rewritten" } else { "rewritten" };
        for line in &r.written {
            println!("{}:{line}: {verb} from {} ({})", doc.display(), snap.dir.display(), snap.commit);
        }
        for (line, missing) in &r.kept {
            println!("{}:{line}: kept (not in this snapshot: {})", doc.display(), missing.join(", "));
        }
        if r.text != text {
            if a.check {
                stale.push(doc.display().to_string());
            } else {
                std::fs::write(doc, &r.text).map_err(|e| format!("{}: {e}", doc.display()))?;
            }
        }
    }
    if !stale.is_empty() {
        return Err(format!("tables differ from the snapshot in {}", stale.join(", ")).into());
    }
    Ok(())
}
