//! The stable text format of a [`Program`], for golden tests and hand-written programs.
//!
//! ```text
//! # comments run to the end of the line
//! program ring_allreduce_4
//! collective allreduce ranks=4 chunks=4 inplace   # broadcast and reduce add root=R after chunks=C
//! scratch 0                      # one size for every rank, or one per rank: scratch 0 12 0 12
//! ranks-per-node 4               # optional
//! op0 = xfer r0 in[0] -> r1 in[0] rrc ch=0 chunk=0 step=0 stage=0
//! op1 = xfer r1 in[1..3] -> r2 scr[0..2] recv ch=1 chunk=1 step=0 stage=0
//! op2 = copy r0 in[0] -> out[0] ch=0 chunk=0 step=1 stage=0
//! op3 = reduce r2 scr[0] -> in[1] ch=0 chunk=1 step=2 stage=1
//! ```
//!
//! Slices are `in`, `out` or `scr` with one chunk `[i]` or a half-open range `[a..b]`. Ops are
//! numbered from 0 in order. [`print()`] writes exactly this form, so `parse(print(p)) == p` for a
//! program whose name passes [`Program::check_name`] (one token without `#`; [`Program::verify`]
//! checks it). Another name is never written where `parse` would read it: see [`print()`].

use super::{BufferKind, BufferLayout, Collective, Op, OpKind, Program, ProgramError, Rank, RecvOp, Slice};
use std::fmt::Write;

/// Prints `p` in the text format. A name that [`Program::check_name`] refuses (empty, or with
/// whitespace, `#` or a control character) would be read back as another name or as more lines, so
/// it is not written as the name: the `program` line is left without one, which [`parse`] refuses,
/// and a comment on it gives the name, escaped, and why.
pub fn print(p: &Program) -> String {
    let mut s = String::new();
    let l = &p.layout;
    match Program::check_name(&p.name) {
        Ok(()) => {
            let _ = writeln!(s, "program {}", p.name);
        }
        Err(e) => {
            // The error shows the name escaped (`{:?}`): no line break or control character in it
            // reaches the text, so the comment stays on this line.
            let _ = writeln!(s, "program # not a name of this format: {e}");
        }
    }
    let root = l.collective.root().map(|r| format!(" root={r}")).unwrap_or_default();
    let _ = writeln!(
        s,
        "collective {} ranks={} chunks={}{root} {}",
        l.collective.program_name(),
        l.ranks,
        l.chunks,
        if l.in_place { "inplace" } else { "outofplace" }
    );
    if l.scratch.iter().all(|&x| x == l.scratch[0]) {
        let _ = writeln!(s, "scratch {}", l.scratch.first().copied().unwrap_or(0));
    } else {
        let sizes: Vec<String> = l.scratch.iter().map(|x| x.to_string()).collect();
        let _ = writeln!(s, "scratch {}", sizes.join(" "));
    }
    if let Some(g) = p.ranks_per_node {
        let _ = writeln!(s, "ranks-per-node {g}");
    }
    for (i, op) in p.ops.iter().enumerate() {
        let _ = writeln!(s, "op{i} = {}", op_text(op));
    }
    s
}

/// One op in the text format (without the `opN = ` prefix).
pub fn op_text(op: &Op) -> String {
    let tail = format!("chunk={} step={} stage={}", op.chunk, op.step, op.stage);
    match op.kind {
        OpKind::Transfer { src_rank, dst_rank, channel, src, dst, op: r } => {
            let r = match r {
                RecvOp::Recv => "recv",
                RecvOp::RecvReduceCopy => "rrc",
            };
            format!("xfer {src_rank} {src} -> {dst_rank} {dst} {r} ch={channel} {tail}")
        }
        OpKind::Copy { rank, channel, src, dst } => format!("copy {rank} {src} -> {dst} ch={channel} {tail}"),
        OpKind::Reduce { rank, channel, src, dst } => format!("reduce {rank} {src} -> {dst} ch={channel} {tail}"),
    }
}

fn err(line: usize, message: impl Into<String>) -> ProgramError {
    ProgramError::Parse { line, message: message.into() }
}

fn parse_u32(line: usize, what: &str, s: &str) -> Result<u32, ProgramError> {
    s.parse::<u32>().map_err(|_| err(line, format!("expected a number for {what}, found `{s}`")))
}

fn parse_rank(line: usize, s: &str) -> Result<Rank, ProgramError> {
    let n = s.strip_prefix('r').ok_or_else(|| err(line, format!("expected a rank like `r3`, found `{s}`")))?;
    Ok(Rank(parse_u32(line, "a rank", n)?))
}

fn parse_slice(line: usize, s: &str) -> Result<Slice, ProgramError> {
    let bad = || err(line, format!("expected a slice like `in[3]` or `scr[0..4]`, found `{s}`"));
    let open = s.find('[').ok_or_else(bad)?;
    let inner = s[open + 1..].strip_suffix(']').ok_or_else(bad)?;
    let buffer = match &s[..open] {
        "in" => BufferKind::Input,
        "out" => BufferKind::Output,
        "scr" => BufferKind::Scratch,
        other => {
            return Err(err(line, format!("unknown buffer `{other}` (in, out, scr)")));
        }
    };
    let (a, b) = match inner.split_once("..") {
        Some((a, b)) => (parse_u32(line, "a slice start", a)?, parse_u32(line, "a slice end", b)?),
        None => {
            let a = parse_u32(line, "a chunk", inner)?;
            (a, a.checked_add(1).ok_or_else(bad)?)
        }
    };
    if b <= a {
        return Err(err(line, format!("empty slice `{s}`")));
    }
    Ok(Slice::new(buffer, a, b - a))
}

/// Refuses a second header line of a kind (`slot` holds the first with its line): it would
/// silently replace the first.
fn once<T>(ln: usize, directive: &str, slot: &Option<(usize, T)>) -> Result<(), ProgramError> {
    match slot {
        Some((first, _)) => Err(err(ln, format!("repeated `{directive}` line (the first is line {first})"))),
        None => Ok(()),
    }
}

/// Reads `key=value` attributes; every key must be known and given once.
fn parse_attrs(line: usize, toks: &[&str], keys: &[&str]) -> Result<Vec<u32>, ProgramError> {
    let mut vals: Vec<Option<u32>> = vec![None; keys.len()];
    for t in toks {
        let (k, v) = t.split_once('=').ok_or_else(|| err(line, format!("expected key=value, found `{t}`")))?;
        let i = keys
            .iter()
            .position(|x| *x == k)
            .ok_or_else(|| err(line, format!("unknown attribute `{k}` (expected {})", keys.join(", "))))?;
        if vals[i].is_some() {
            return Err(err(line, format!("attribute `{k}` given twice")));
        }
        vals[i] = Some(parse_u32(line, k, v)?);
    }
    keys.iter().zip(vals).map(|(k, v)| v.ok_or_else(|| err(line, format!("missing attribute `{k}`")))).collect()
}

/// Reads the program file at `path` ([`super::read_input`], at most [`super::MAX_INPUT_BYTES`]) and
/// parses it ([`parse`]); a file that cannot be read is [`ProgramError::Input`].
pub fn parse_path(path: &std::path::Path) -> Result<Program, ProgramError> {
    parse(&super::read_input(path, super::MAX_INPUT_BYTES).map_err(ProgramError::Input)?)
}

/// Parses the text format. Each header (`program`, `collective`, `scratch`, `ranks-per-node`) is
/// given at most once. Errors name the line; the result is not verified (call [`Program::verify`]).
pub fn parse(text: &str) -> Result<Program, ProgramError> {
    // Each header with the line it is on.
    let mut name: Option<(usize, String)> = None;
    let mut layout: Option<(usize, BufferLayout)> = None;
    let mut scratch: Option<(usize, Vec<u32>)> = None;
    let mut per_node: Option<(usize, u32)> = None;
    let mut ops = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let ln = i + 1;
        let content = raw.split('#').next().unwrap_or("").trim();
        if content.is_empty() {
            continue;
        }
        let toks: Vec<&str> = content.split_whitespace().collect();
        match toks[0] {
            "program" => {
                once(ln, "program", &name)?;
                if toks.len() != 2 {
                    return Err(err(ln, "expected `program NAME`"));
                }
                Program::check_name(toks[1]).map_err(|e| err(ln, e.to_string()))?;
                name = Some((ln, toks[1].to_string()));
            }
            "collective" => {
                once(ln, "collective", &layout)?;
                // Broadcast and Reduce name their root: `root=R` after the chunks.
                let rooted = toks.len() == 6;
                if !(5..=6).contains(&toks.len()) {
                    return Err(err(ln, "expected `collective KIND ranks=N chunks=C [root=R] inplace|outofplace`"));
                }
                let keys: &[&str] = if rooted { &["ranks", "chunks", "root"] } else { &["ranks", "chunks"] };
                let v = parse_attrs(ln, &toks[2..toks.len() - 1], keys)?;
                let c = Collective::parse(toks[1], v.get(2).copied()).map_err(|e| err(ln, e.to_string()))?;
                let in_place = match toks[toks.len() - 1] {
                    "inplace" => true,
                    "outofplace" => false,
                    o => {
                        return Err(err(ln, format!("expected inplace or outofplace, found `{o}`")));
                    }
                };
                // Checked before `BufferLayout::new` allocates its per-rank scratch sizes.
                if v[0] > BufferLayout::MAX_RANKS {
                    return Err(err(
                        ln,
                        format!("{} ranks is more than the supported {}", v[0], BufferLayout::MAX_RANKS),
                    ));
                }
                layout = Some((ln, BufferLayout::new(c, v[0], v[1], in_place)));
            }
            "scratch" => {
                once(ln, "scratch", &scratch)?;
                let v = toks[1..].iter().map(|t| parse_u32(ln, "a scratch size", t)).collect::<Result<Vec<_>, _>>()?;
                if v.is_empty() {
                    return Err(err(ln, "expected `scratch S` or one size per rank"));
                }
                scratch = Some((ln, v));
            }
            "ranks-per-node" => {
                once(ln, "ranks-per-node", &per_node)?;
                if toks.len() != 2 {
                    return Err(err(ln, "expected `ranks-per-node G`"));
                }
                per_node = Some((ln, parse_u32(ln, "ranks per node", toks[1])?));
            }
            t if t.starts_with("op") => {
                let want = format!("op{}", ops.len());
                if t != want {
                    return Err(err(ln, format!("expected `{want}` (ops are numbered in order), found `{t}`")));
                }
                if toks.get(1) != Some(&"=") || toks.len() < 3 {
                    return Err(err(ln, format!("expected `{want} = ...`")));
                }
                ops.push(parse_op(ln, &toks[2..])?);
            }
            other => return Err(err(ln, format!("unknown directive `{other}`"))),
        }
    }
    let (_, name) = name.ok_or_else(|| err(1, "missing `program NAME`"))?;
    let (_, mut layout) = layout.ok_or_else(|| err(1, "missing `collective ...` line"))?;
    if let Some((ln, v)) = scratch {
        layout.scratch = match v.len() {
            1 => vec![v[0]; layout.ranks as usize],
            n if n == layout.ranks as usize => v,
            n => {
                return Err(err(ln, format!("scratch: {n} sizes for {} ranks", layout.ranks)));
            }
        };
    }
    // A file's layout is held to the importers' bound before anything is sized by it.
    layout.validate_imported()?;
    Ok(Program { name, layout, ranks_per_node: per_node.map(|(_, g)| g), ops })
}

fn parse_op(ln: usize, t: &[&str]) -> Result<Op, ProgramError> {
    match t[0] {
        "xfer" => {
            // xfer rA SLICE -> rB SLICE recv|rrc ch=C chunk= step= stage=
            if t.len() < 7 || t[3] != "->" {
                return Err(err(ln, "expected `xfer rA SLICE -> rB SLICE recv|rrc ch=C chunk=K step=S stage=T`"));
            }
            let op = match t[6] {
                "recv" => RecvOp::Recv,
                "rrc" => RecvOp::RecvReduceCopy,
                o => return Err(err(ln, format!("expected recv or rrc, found `{o}`"))),
            };
            let v = parse_attrs(ln, &t[7..], &["ch", "chunk", "step", "stage"])?;
            Ok(Op {
                kind: OpKind::Transfer {
                    src_rank: parse_rank(ln, t[1])?,
                    src: parse_slice(ln, t[2])?,
                    dst_rank: parse_rank(ln, t[4])?,
                    dst: parse_slice(ln, t[5])?,
                    op,
                    channel: v[0],
                },
                chunk: v[1],
                step: v[2],
                stage: v[3],
            })
        }
        kind @ ("copy" | "reduce") => {
            if t.len() < 5 || t[3] != "->" {
                return Err(err(ln, format!("expected `{kind} rA SLICE -> SLICE ch=C chunk=K step=S stage=T`")));
            }
            let rank = parse_rank(ln, t[1])?;
            let (src, dst) = (parse_slice(ln, t[2])?, parse_slice(ln, t[4])?);
            let v = parse_attrs(ln, &t[5..], &["ch", "chunk", "step", "stage"])?;
            let channel = v[0];
            let kind = if kind == "copy" {
                OpKind::Copy { rank, channel, src, dst }
            } else {
                OpKind::Reduce { rank, channel, src, dst }
            };
            Ok(Op { kind, chunk: v[1], step: v[2], stage: v[3] })
        }
        o => Err(err(ln, format!("unknown op `{o}` (xfer, copy, reduce)"))),
    }
}
