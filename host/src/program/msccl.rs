//! The MSCCL XML importer.
//!
//! An MSCCL file lists, per GPU, thread blocks (`<tb send= recv= chan=>`) of steps
//! (`<step s= type= srcbuf= srcoff= dstbuf= dstoff= cnt= depid= deps= hasdep=>`). Each TB talks to at
//! most one send peer and one receive peer on its channel; steps run in order, `depid`/`deps` make a
//! step wait for step `deps` of TB `depid` on the same GPU, and `nop` steps only carry such waits
//! (chains of them give one step several dependencies).
//!
//! Import in four moves:
//!
//! 1. **Read** the XML, tolerantly: `reducescatter` and `reduce_scatter`; missing `inplace`,
//!    `outofplace`, `minBytes`, `maxBytes`, `nchunksperloop`; unknown attributes and elements are
//!    ignored; TACCL's `<copy i_off= o_off=>` pre-copies and its `<op step= buf= off=>` spelling of
//!    steps are understood. Only structure that would lose data is refused: a second `<algo>`, or a
//!    `<gpu>` or `<tb>` inside one of its own kind. A `name` that is not a program name
//!    ([`Program::check_name`]: the text format could not hold it) is made one (each offending
//!    character `_`), the file's spelling kept in [`Imported::file_name`].
//! 2. **Split** fused steps into primitives: `rcs` = recv + send, `rrc` = recv_reduce_copy, `rrs` and
//!    `rrcs` = recv_reduce_copy + send of the result (MSCCL only emits `rrs` where the stored result is
//!    dead, so storing it at the step's destination changes nothing), `cpy` = copy, `re` = reduce.
//! 3. **Match** sends and receives in FIFO order per connection `(src, dst, channel)`, and order every
//!    primitive by happens-before (TB order, `depid`, send before its receive). A cycle is an error.
//! 4. **Linearize** into atomic ops: a transfer's send and receive become one op, placed by the data
//!    hazards alone (read-after-write, write-after-read, write-after-write per chunk, in
//!    happens-before order). A buffered exchange (a send whose source is overwritten, on both sides,
//!    before the matching receive) leaves a cycle: the sources of the stuck sends are copied into
//!    fresh scratch at the send's position, which makes every transfer atomic, and the ordering is
//!    retried. A cycle that remains after that is reported ([`ImportError::BufferedCycle`]), never
//!    broken by reordering.
//!
//! [`import`] then verifies the program and checks the collective's postcondition; every error names
//! the XML step it comes from.

use super::{BufferKind, Collective, Layout, Op, OpKind, Program, ProgramError, Rank, RecvOp, Slice};
use quick_xml::Reader;
use quick_xml::events::{BytesStart, Event};
use std::collections::{BTreeMap, BinaryHeap, HashMap};
use std::fmt;

/// A step of the XML file: GPU, TB id and step index, as written there.
#[derive(Copy, Clone, PartialEq, Eq, Hash, Debug)]
pub struct StepRef {
    /// The `<gpu id=>`, which is the rank.
    pub gpu: u32,
    /// The `<tb id=>` on that GPU (`u32::MAX` for a TACCL `<copy>`).
    pub tb: u32,
    /// The step's `s=` (TACCL: `step=`), its index within the TB (`u32::MAX` for a TACCL `<copy>`).
    pub step: u32,
}

impl fmt::Display for StepRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "gpu {} tb {} step {}", self.gpu, self.tb, self.step)
    }
}

/// Why an MSCCL file could not be imported.
#[derive(Clone, PartialEq, Debug)]
pub enum ImportError {
    /// The XML itself is malformed.
    Xml {
        /// The parser's message, or what is misplaced or missing.
        message: String,
    },
    /// A required attribute is absent.
    MissingAttribute {
        /// The element's name, without brackets.
        element: String,
        /// The attribute's name (the first spelling where several are accepted).
        attribute: &'static str,
        /// Where the element is: `in <algo>`, `in gpu 1`, `gpu 1 tb 0 step 3`, ...
        context: String,
    },
    /// An attribute has a value that cannot be used.
    BadAttribute {
        /// The element's name, without brackets.
        element: String,
        /// The attribute's name (the first spelling where several are accepted).
        attribute: String,
        /// The value found.
        value: String,
        /// Where the element is, or what the value should have been.
        context: String,
    },
    /// The `coll` attribute names a collective oxccl does not know.
    UnknownCollective {
        /// The `coll` value as written.
        name: String,
    },
    /// A step `type` that is not one of MSCCL's.
    UnknownStepType {
        /// The step at fault.
        step: StepRef,
        /// Its `type` as written.
        ty: String,
    },
    /// A step sends (or receives) in a TB without a send (or receive) peer, or the peer is not a GPU.
    BadPeer {
        /// The step at fault.
        step: StepRef,
        /// `"send"` or `"recv"`.
        direction: &'static str,
        /// The TB's `send=` or `recv=` value: `-1` when absent, else out of range or the GPU itself.
        peer: i64,
    },
    /// Two TBs of one GPU use the same connection in the same direction.
    DuplicateConnection {
        /// The GPU with the two TBs.
        gpu: u32,
        /// The GPU at the other end of the connection.
        peer: u32,
        /// The connection's channel (`chan=`).
        channel: u32,
        /// `"send"` or `"recv"`.
        direction: &'static str,
        /// The two TB ids, smaller first.
        tbs: (u32, u32),
    },
    /// A send with no receive left to match it on its connection.
    UnmatchedSend {
        /// The first send left over on the connection.
        step: StepRef,
        /// The receiving GPU.
        dst: u32,
        /// The connection's channel.
        channel: u32,
    },
    /// A receive with no send left to match it on its connection.
    UnmatchedRecv {
        /// The first receive left over on the connection.
        step: StepRef,
        /// The sending GPU.
        src: u32,
        /// The connection's channel.
        channel: u32,
    },
    /// A matched send and receive move different numbers of chunks.
    CountMismatch {
        /// The sending step.
        send: StepRef,
        /// The receiving step it was matched with.
        recv: StepRef,
        /// Chunks sent (`cnt=` of the send).
        send_count: u32,
        /// Chunks received (`cnt=` of the receive).
        recv_count: u32,
    },
    /// `depid`/`deps` name a step that does not exist.
    BadDependency {
        /// The waiting step.
        step: StepRef,
        /// The TB id waited on, as written (`-1` when absent).
        depid: i64,
        /// The step index waited on, as written (`-1` when absent).
        deps: i64,
    },
    /// The steps wait on each other in a cycle (this step is on it).
    Cycle {
        /// A step on the cycle.
        step: StepRef,
    },
    /// Steps left in a cycle of data hazards after the sources of every stuck send were copied
    /// into scratch (how the importer makes buffered exchanges atomic); this step is on it.
    BufferedCycle {
        /// A step on the cycle.
        step: StepRef,
    },
    /// The imported program fails verification or its postcondition.
    Invalid {
        /// The step the failing op came from, when the error names an op.
        step: Option<StepRef>,
        /// The program's error. Its op ids index [`Imported::program`]'s ops, except in a
        /// [`ProgramError::SliceOutOfRange`] found while linearizing, which has the importer's own
        /// numbering; `step` locates both.
        error: ProgramError,
    },
    /// An element opened inside one of its own kind (`<tb>` in a `<tb>`, `<gpu>` in a `<gpu>`), or a
    /// second `<algo>`: reading on would drop the first one's content. Lines count from 1.
    RepeatedElement {
        /// `"algo"`, `"gpu"` or `"tb"`.
        element: &'static str,
        /// The line of the second opening tag.
        line: usize,
        /// The line of the first one (still open, except for `<algo>`).
        first_line: usize,
    },
}

impl fmt::Display for ImportError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ImportError::Xml { message } => write!(f, "malformed XML: {message}"),
            ImportError::MissingAttribute { element, attribute, context } => {
                write!(f, "<{element}> {context}: missing attribute `{attribute}`")
            }
            ImportError::BadAttribute { element, attribute, value, context } => {
                write!(f, "<{element}> {context}: bad value `{value}` for `{attribute}`")
            }
            ImportError::UnknownCollective { name } => write!(f, "unknown collective `{name}`"),
            ImportError::UnknownStepType { step, ty } => {
                write!(f, "{step}: unknown step type `{ty}`")
            }
            ImportError::BadPeer { step, direction, peer } => {
                write!(f, "{step}: {direction} step in a TB whose {direction} peer is {peer}")
            }
            ImportError::DuplicateConnection { gpu, peer, channel, direction, tbs } => write!(
                f,
                "gpu {gpu}: tbs {} and {} both {direction} with gpu {peer} on channel {channel}",
                tbs.0, tbs.1
            ),
            ImportError::UnmatchedSend { step, dst, channel } => {
                write!(f, "{step}: send to gpu {dst} on channel {channel} has no matching receive")
            }
            ImportError::UnmatchedRecv { step, src, channel } => {
                write!(f, "{step}: receive from gpu {src} on channel {channel} has no matching send")
            }
            ImportError::CountMismatch { send, recv, send_count, recv_count } => {
                write!(f, "{send}: sends {send_count} chunks but the matching receive ({recv}) takes {recv_count}")
            }
            ImportError::BadDependency { step, depid, deps } => {
                write!(f, "{step}: depends on tb {depid} step {deps}, which does not exist")
            }
            ImportError::Cycle { step } => write!(f, "{step}: steps wait on each other in a cycle"),
            ImportError::BufferedCycle { step } => {
                write!(f, "{step}: part of a buffered exchange that cannot be expressed with atomic transfers")
            }
            ImportError::Invalid { step: Some(s), error } => write!(f, "{s}: {error}"),
            ImportError::Invalid { step: None, error } => write!(f, "{error}"),
            ImportError::RepeatedElement { element: "algo", line, first_line } => {
                write!(
                    f,
                    "line {line}: a second <algo> (the first is at line {first_line}); a file holds one algorithm"
                )
            }
            ImportError::RepeatedElement { element, line, first_line } => {
                write!(f, "line {line}: <{element}> inside the <{element}> of line {first_line}, which is not closed")
            }
        }
    }
}

impl std::error::Error for ImportError {}

/// An imported program and, for each op, the XML step it came from.
#[derive(Clone, Debug)]
pub struct Imported {
    /// The program, its ops in an order that respects every data hazard. Each op's `step` is its
    /// depth in the hazard graph, `stage` is 0 and `channel` is its (sending) TB's `chan=` (0 for
    /// TACCL `<copy>` pre-copies);
    /// `ranks_per_node` is `None`. Scratch may exceed the file's `s_chunks` where buffered exchanges
    /// were snapshotted.
    pub program: Program,
    /// `origin[op]`: the step of the op's send (transfers) or the local step (copies, reductions;
    /// TACCL pre-copies name step `u32::MAX` of tb `u32::MAX`).
    pub origin: Vec<StepRef>,
    /// The file's protocol attribute (`Simple`, `LL`, `LL128`), informational.
    pub proto: Option<String>,
    /// The `<algo name=...>` attribute as the file spells it, where it is not a program name
    /// ([`Program::check_name`]: empty, or with whitespace, `#` or control characters): the
    /// program's name is then this one with each such character made `_` (`msccl` for an empty
    /// one), and the original is kept here. `None` where the program's name is the file's.
    pub file_name: Option<String>,
}

/// Imports an MSCCL XML algorithm, verifies it and checks its postcondition.
pub fn import(xml: &str) -> Result<Imported, ImportError> {
    let imp = import_unchecked(xml)?;
    let at = |e: &ProgramError| -> Option<StepRef> {
        let op = match e {
            ProgramError::RankOutOfRange { op, .. }
            | ProgramError::SliceOutOfRange { op, .. }
            | ProgramError::CountMismatch { op, .. }
            | ProgramError::SelfTransfer { op, .. }
            | ProgramError::OverlappingLocal { op, .. } => Some(*op),
            ProgramError::Postcondition { last_writer, .. } => *last_writer,
            _ => None,
        };
        op.and_then(|o| imp.origin.get(o.index()).copied())
    };
    if let Err(e) = imp.program.check() {
        return Err(ImportError::Invalid { step: at(&e), error: e });
    }
    Ok(imp)
}

/// Imports without verifying (structure errors of the XML are still reported).
pub fn import_unchecked(xml: &str) -> Result<Imported, ImportError> {
    let doc = read(xml)?;
    lower(&doc)
}

// ---------------------------------------------------------------------------------------------
// 1. Reading
// ---------------------------------------------------------------------------------------------

#[derive(Clone, Debug)]
struct XStep {
    s: u32,
    ty: String,
    /// The source location, or the name of the attribute that is missing for it.
    src: Result<(BufferKind, i64), &'static str>,
    /// The destination location, or the name of the attribute that is missing for it.
    dst: Result<(BufferKind, i64), &'static str>,
    cnt: u32,
    depid: i64,
    deps: i64,
}

#[derive(Clone, Debug)]
struct XTb {
    id: u32,
    send: i64,
    recv: i64,
    chan: u32,
    steps: Vec<XStep>,
}

#[derive(Clone, Debug, Default)]
struct XGpu {
    id: u32,
    i_chunks: u32,
    o_chunks: u32,
    s_chunks: u32,
    copies: Vec<(u32, u32, u32)>,
    tbs: Vec<XTb>,
}

#[derive(Clone, Debug)]
struct XDoc {
    name: String,
    proto: Option<String>,
    coll: Collective,
    ngpus: u32,
    nchunks: Option<u32>,
    inplace: Option<bool>,
    gpus: Vec<XGpu>,
}

struct Attrs {
    element: String,
    map: HashMap<String, String>,
}

impl Attrs {
    fn of(e: &BytesStart<'_>) -> Result<Attrs, ImportError> {
        let element = String::from_utf8_lossy(e.name().as_ref()).into_owned();
        let mut map = HashMap::new();
        for a in e.attributes() {
            let a = a.map_err(|err| ImportError::Xml { message: err.to_string() })?;
            let k = String::from_utf8_lossy(a.key.as_ref()).into_owned();
            let v = a.unescape_value().map_err(|err| ImportError::Xml { message: err.to_string() })?;
            map.insert(k, v.into_owned());
        }
        Ok(Attrs { element, map })
    }
    fn get(&self, keys: &[&str]) -> Option<&str> {
        keys.iter().find_map(|k| self.map.get(*k).map(|s| s.trim()))
    }
    fn int(&self, keys: &[&'static str], ctx: &str) -> Result<Option<i64>, ImportError> {
        match self.get(keys) {
            None => Ok(None),
            Some(v) => v.parse::<i64>().map(Some).map_err(|_| ImportError::BadAttribute {
                element: self.element.clone(),
                attribute: keys[0].to_string(),
                value: v.to_string(),
                context: ctx.to_string(),
            }),
        }
    }
    fn req(&self, keys: &[&'static str], ctx: &str) -> Result<i64, ImportError> {
        self.int(keys, ctx)?.ok_or_else(|| ImportError::MissingAttribute {
            element: self.element.clone(),
            attribute: keys[0],
            context: ctx.to_string(),
        })
    }
    fn nonneg(&self, keys: &[&'static str], ctx: &str, default: Option<u32>) -> Result<u32, ImportError> {
        let v = match (self.int(keys, ctx)?, default) {
            (Some(v), _) => v,
            (None, Some(d)) => return Ok(d),
            (None, None) => return self.req(keys, ctx).map(|_| 0),
        };
        u32::try_from(v).map_err(|_| ImportError::BadAttribute {
            element: self.element.clone(),
            attribute: keys[0].to_string(),
            value: v.to_string(),
            context: ctx.to_string(),
        })
    }
    fn flag(&self, key: &'static str, ctx: &str) -> Result<Option<bool>, ImportError> {
        Ok(self.int(&[key], ctx)?.map(|v| v != 0))
    }
    fn buffer(&self, keys: &[&'static str], ctx: &str) -> Result<Option<BufferKind>, ImportError> {
        match self.get(keys) {
            None => Ok(None),
            Some("i") | Some("input") => Ok(Some(BufferKind::Input)),
            Some("o") | Some("output") => Ok(Some(BufferKind::Output)),
            Some("s") | Some("scratch") => Ok(Some(BufferKind::Scratch)),
            Some(v) => Err(ImportError::BadAttribute {
                element: self.element.clone(),
                attribute: keys[0].to_string(),
                value: v.to_string(),
                context: ctx.to_string(),
            }),
        }
    }
}

/// Line numbers (from 1) of byte positions, counted on from the last position asked: positions
/// must not go back, so numbering a whole file stays linear.
struct Lines<'a> {
    text: &'a [u8],
    pos: usize,
    line: usize,
}

impl Lines<'_> {
    /// The line of the tag that ends just before byte `end` (the reader's position after an event).
    fn of_tag_ending_at(&mut self, end: u64) -> usize {
        let end = usize::try_from(end).unwrap_or(usize::MAX).min(self.text.len());
        let start = self.text[..end].iter().rposition(|&b| b == b'<').unwrap_or(end).max(self.pos);
        self.line += self.text[self.pos..start].iter().filter(|&&b| b == b'\n').count();
        self.pos = start;
        self.line
    }
}

fn read(xml: &str) -> Result<XDoc, ImportError> {
    let mut reader = Reader::from_str(xml);
    reader.config_mut().trim_text(true);
    let mut lines = Lines { text: xml.as_bytes(), pos: 0, line: 1 };
    // Each open element with the line it starts on: a second one of a kind would replace it and
    // drop what was read into it.
    let mut doc: Option<XDoc> = None;
    let mut algo_line = 0;
    let mut gpu: Option<XGpu> = None;
    let mut gpu_line = 0;
    let mut tb: Option<XTb> = None;
    let mut tb_line = 0;
    loop {
        let ev = reader
            .read_event()
            .map_err(|e| ImportError::Xml { message: format!("at byte {}: {e}", reader.buffer_position()) })?;
        match ev {
            Event::Start(ref e) | Event::Empty(ref e) => {
                let empty = matches!(ev, Event::Empty(_));
                let a = Attrs::of(e)?;
                let line = lines.of_tag_ending_at(reader.buffer_position());
                match a.element.as_str() {
                    "algo" => {
                        if doc.is_some() {
                            return Err(ImportError::RepeatedElement { element: "algo", line, first_line: algo_line });
                        }
                        algo_line = line;
                        let ctx = "in <algo>";
                        let coll_name = a.get(&["coll"]).ok_or_else(|| ImportError::MissingAttribute {
                            element: "algo".into(),
                            attribute: "coll",
                            context: ctx.into(),
                        })?;
                        let coll = Collective::parse(coll_name)
                            .ok_or_else(|| ImportError::UnknownCollective { name: coll_name.to_string() })?;
                        let inplace = match (a.flag("inplace", ctx)?, a.flag("outofplace", ctx)?) {
                            (Some(i), _) => Some(i),
                            (None, Some(o)) => Some(!o),
                            (None, None) => None,
                        };
                        let name = a.get(&["name"]).unwrap_or("msccl");
                        doc = Some(XDoc {
                            name: name.to_string(),
                            proto: a.get(&["proto"]).map(str::to_string),
                            coll,
                            ngpus: a.nonneg(&["ngpus"], ctx, None)?,
                            nchunks: match a.int(&["nchunksperloop"], ctx)? {
                                Some(_) => Some(a.nonneg(&["nchunksperloop"], ctx, None)?),
                                None => None,
                            },
                            inplace,
                            gpus: Vec::new(),
                        });
                    }
                    "gpu" => {
                        if gpu.is_some() {
                            return Err(ImportError::RepeatedElement { element: "gpu", line, first_line: gpu_line });
                        }
                        let ctx = "in <gpu>";
                        let g = XGpu {
                            id: a.nonneg(&["id"], ctx, None)?,
                            i_chunks: a.nonneg(&["i_chunks"], ctx, Some(0))?,
                            o_chunks: a.nonneg(&["o_chunks"], ctx, Some(0))?,
                            s_chunks: a.nonneg(&["s_chunks"], ctx, Some(0))?,
                            copies: Vec::new(),
                            tbs: Vec::new(),
                        };
                        if empty {
                            push_gpu(&mut doc, g)?;
                        } else {
                            gpu = Some(g);
                            gpu_line = line;
                        }
                    }
                    "copy" => {
                        let g = gpu
                            .as_mut()
                            .ok_or_else(|| ImportError::Xml { message: "<copy> outside a <gpu>".into() })?;
                        let ctx = format!("in gpu {}", g.id);
                        let i = a.nonneg(&["i_off", "srcoff"], &ctx, None)?;
                        let o = a.nonneg(&["o_off", "dstoff"], &ctx, None)?;
                        let cnt = a.nonneg(&["cnt"], &ctx, Some(1))?;
                        if cnt == 0 {
                            return Err(ImportError::BadAttribute {
                                element: "copy".into(),
                                attribute: "cnt".into(),
                                value: "0".into(),
                                context: ctx,
                            });
                        }
                        g.copies.push((i, o, cnt));
                    }
                    "tb" => {
                        if tb.is_some() {
                            return Err(ImportError::RepeatedElement { element: "tb", line, first_line: tb_line });
                        }
                        let g =
                            gpu.as_ref().ok_or_else(|| ImportError::Xml { message: "<tb> outside a <gpu>".into() })?;
                        let ctx = format!("in gpu {}", g.id);
                        let t = XTb {
                            id: a.nonneg(&["id"], &ctx, None)?,
                            send: a.int(&["send"], &ctx)?.unwrap_or(-1),
                            recv: a.int(&["recv"], &ctx)?.unwrap_or(-1),
                            chan: a.nonneg(&["chan"], &ctx, Some(0))?,
                            steps: Vec::new(),
                        };
                        if empty {
                            if let Some(g) = gpu.as_mut() {
                                g.tbs.push(t);
                            }
                        } else {
                            tb = Some(t);
                            tb_line = line;
                        }
                    }
                    "step" | "op" => {
                        let (g, t) = match (gpu.as_ref(), tb.as_mut()) {
                            (Some(g), Some(t)) => (g, t),
                            _ => {
                                return Err(ImportError::Xml { message: "<step> outside a <tb>".into() });
                            }
                        };
                        let s = a.nonneg(&["s", "step"], &format!("in gpu {} tb {}", g.id, t.id), None)?;
                        let ctx = format!("gpu {} tb {} step {}", g.id, t.id, s);
                        let ty = a.get(&["type"]).ok_or_else(|| ImportError::MissingAttribute {
                            element: a.element.clone(),
                            attribute: "type",
                            context: ctx.clone(),
                        })?;
                        // A location, or the name of its missing attribute (a buffer without an
                        // offset names the offset); TACCL's shared `buf`/`off` stand in for both.
                        let loc = |bk: &[&'static str],
                                   ok: &[&'static str]|
                         -> Result<Result<(BufferKind, i64), &'static str>, ImportError> {
                            Ok(match (a.buffer(bk, &ctx)?, a.int(ok, &ctx)?) {
                                (Some(b), Some(o)) => Ok((b, o)),
                                (Some(_), None) => Err(ok[0]),
                                (None, _) => Err(bk[0]),
                            })
                        };
                        let shared = loc(&["buf"], &["off"])?;
                        let src = loc(&["srcbuf"], &["srcoff"])?.or_else(|missing| shared.map_err(|_| missing));
                        let dst = loc(&["dstbuf"], &["dstoff"])?.or_else(|missing| shared.map_err(|_| missing));
                        t.steps.push(XStep {
                            s,
                            ty: ty.to_string(),
                            src,
                            dst,
                            cnt: a.nonneg(&["cnt"], &ctx, Some(1))?,
                            depid: a.int(&["depid"], &ctx)?.unwrap_or(-1),
                            deps: a.int(&["deps"], &ctx)?.unwrap_or(-1),
                        });
                    }
                    _ => {} // Unknown elements are ignored.
                }
            }
            Event::End(ref e) => match e.name().as_ref() {
                b"tb" => {
                    if let (Some(t), Some(g)) = (tb.take(), gpu.as_mut()) {
                        g.tbs.push(t);
                    }
                }
                b"gpu" => {
                    if let Some(g) = gpu.take() {
                        push_gpu(&mut doc, g)?;
                    }
                }
                _ => {}
            },
            Event::Eof => break,
            _ => {}
        }
    }
    let mut doc = doc.ok_or_else(|| ImportError::Xml { message: "no <algo> element".into() })?;
    doc.gpus.sort_by_key(|g| g.id);
    for (i, g) in doc.gpus.iter().enumerate() {
        if g.id as usize != i {
            return Err(ImportError::BadAttribute {
                element: "gpu".into(),
                attribute: "id".into(),
                value: g.id.to_string(),
                context: format!("gpu ids must be 0..{} without gaps or repeats", doc.gpus.len()),
            });
        }
    }
    if doc.gpus.len() as u32 != doc.ngpus {
        return Err(ImportError::BadAttribute {
            element: "algo".into(),
            attribute: "ngpus".into(),
            value: doc.ngpus.to_string(),
            context: format!("the file has {} <gpu> elements", doc.gpus.len()),
        });
    }
    Ok(doc)
}

fn push_gpu(doc: &mut Option<XDoc>, g: XGpu) -> Result<(), ImportError> {
    doc.as_mut().ok_or_else(|| ImportError::Xml { message: "<gpu> outside <algo>".into() })?.gpus.push(g);
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// 2.-4. Splitting, matching, linearizing
// ---------------------------------------------------------------------------------------------

/// A primitive part of a step.
#[derive(Copy, Clone, Debug)]
enum Part {
    Send { slice: Slice },
    Recv { slice: Slice, reduce: bool },
    Copy { src: Slice, dst: Slice },
    Reduce { src: Slice, dst: Slice },
}

struct FlatStep {
    at: StepRef,
    gpu: u32,
    tb_index: usize,
    parts: Vec<Part>,
}

fn slice_of(
    at: StepRef,
    loc: Result<(BufferKind, i64), &'static str>,
    cnt: u32,
    which: &'static str,
) -> Result<Slice, ImportError> {
    let (b, off) = loc.map_err(|attribute| ImportError::MissingAttribute {
        element: "step".into(),
        attribute,
        context: at.to_string(),
    })?;
    let off = u32::try_from(off).map_err(|_| ImportError::BadAttribute {
        element: "step".into(),
        attribute: format!("{which}off"),
        value: off.to_string(),
        context: at.to_string(),
    })?;
    Ok(Slice::new(b, off, cnt))
}

fn split(at: StepRef, st: &XStep) -> Result<Vec<Part>, ImportError> {
    let src = || slice_of(at, st.src, st.cnt, "src");
    let dst = || slice_of(at, st.dst, st.cnt, "dst");
    // recv_reduce_copy into dst with local operand src: when they differ, copy src to dst first.
    let rrc = |parts: &mut Vec<Part>| -> Result<Slice, ImportError> {
        let (s, d) = (src()?, dst()?);
        if s != d {
            parts.push(Part::Copy { src: s, dst: d });
        }
        parts.push(Part::Recv { slice: d, reduce: true });
        Ok(d)
    };
    let mut parts = Vec::new();
    match st.ty.as_str() {
        "nop" => {}
        "s" => parts.push(Part::Send { slice: src()? }),
        "r" => parts.push(Part::Recv { slice: dst()?, reduce: false }),
        "rcs" => {
            let d = dst()?;
            parts.push(Part::Recv { slice: d, reduce: false });
            parts.push(Part::Send { slice: d });
        }
        "rrc" => {
            rrc(&mut parts)?;
        }
        "rrs" | "rrcs" => {
            let d = rrc(&mut parts)?;
            parts.push(Part::Send { slice: d });
        }
        "cpy" | "copy" => parts.push(Part::Copy { src: src()?, dst: dst()? }),
        "re" | "reduce" => parts.push(Part::Reduce { src: src()?, dst: dst()? }),
        other => {
            return Err(ImportError::UnknownStepType { step: at, ty: other.to_string() });
        }
    }
    if st.cnt == 0 && !parts.is_empty() {
        return Err(ImportError::BadAttribute {
            element: "step".into(),
            attribute: "cnt".into(),
            value: "0".into(),
            context: at.to_string(),
        });
    }
    Ok(parts)
}

/// One read or write of a slice by an op, at a position of the happens-before order (`sub` orders
/// accesses at the same position).
#[derive(Copy, Clone, Debug)]
struct Access {
    pos: usize,
    sub: u8,
    op: usize,
    rank: u32,
    slice: Slice,
    write: bool,
    read: bool,
}

/// Start of each rank's storage in one flat array, and the total.
fn storage_bases(layout: &Layout) -> (Vec<usize>, usize) {
    let mut base = Vec::with_capacity(layout.ranks as usize + 1);
    let mut acc = 0usize;
    base.push(0);
    for r in 0..layout.ranks {
        acc += layout.storage_chunks(Rank(r)) as usize;
        base.push(acc);
    }
    (base, acc)
}

/// What the accesses so far left on a run of locations: the last writer (`usize::MAX`: none) and
/// the readers since.
#[derive(Clone, Debug)]
struct RunState {
    writer: usize,
    readers: Vec<usize>,
}

/// Data-hazard successors of each op (read-after-write, write-after-write, write-after-read per
/// chunk), walking the accesses in happens-before order.
///
/// The locations `0..total` are kept as runs in one state, keyed by their first location. An
/// access splits at most the two runs at its ends and visits the runs it spans: the work grows with
/// the number of accesses times the runs each spans, at most their chunk counts, which are held to
/// [`Program::MAX_CHUNK_ACCESSES`] (a small file of wide steps over few runs stays cheap).
fn hazard_edges(
    layout: &Layout,
    base: &[usize],
    total: usize,
    origin: &[StepRef],
    accesses: &mut [Access],
) -> Result<Vec<Vec<usize>>, ImportError> {
    let chunks: u64 = accesses.iter().map(|a| a.slice.count as u64).sum();
    if chunks > Program::MAX_CHUNK_ACCESSES {
        return Err(ImportError::Invalid {
            step: None,
            error: ProgramError::BadLayout {
                reason: format!(
                    "the steps touch {chunks} chunks, more than the supported {}",
                    Program::MAX_CHUNK_ACCESSES
                ),
            },
        });
    }
    let mut runs: BTreeMap<usize, RunState> = BTreeMap::new();
    runs.insert(0, RunState { writer: usize::MAX, readers: Vec::new() });
    let split = |runs: &mut BTreeMap<usize, RunState>, at: usize| {
        if at < total && !runs.contains_key(&at) {
            let (_, run) = runs.range(..at).next_back().expect("runs tile 0..total");
            let run = run.clone();
            runs.insert(at, run);
        }
    };
    let mut op_succ: Vec<Vec<usize>> = vec![Vec::new(); origin.len()];
    accesses.sort_by_key(|a| (a.pos, a.sub));
    for a in accesses.iter() {
        let (id, rank, slice) = (a.op, Rank(a.rank), a.slice);
        let start = layout.resolve(rank, slice).ok_or_else(|| ImportError::Invalid {
            step: Some(origin[id]),
            error: ProgramError::SliceOutOfRange {
                op: super::OpId::new(id),
                rank,
                slice,
                buffer_chunks: layout.buffer_chunks(rank, slice.buffer),
            },
        })?;
        let lo = base[rank.index()] + start as usize;
        let hi = lo + slice.count as usize;
        split(&mut runs, lo);
        split(&mut runs, hi);
        // Every chunk of a run is in the same state, so it gives the same edges as the run.
        for run in runs.range_mut(lo..hi).map(|(_, r)| r) {
            let w = run.writer;
            if w != usize::MAX && w != id && op_succ[w].last() != Some(&id) {
                op_succ[w].push(id);
            }
            if a.write {
                for &rd in &run.readers {
                    if rd != id && op_succ[rd].last() != Some(&id) {
                        op_succ[rd].push(id);
                    }
                }
            } else if a.read {
                run.readers.push(id);
            }
        }
        if a.write {
            // The written locations are one run again: written by this op, not read since.
            let inner: Vec<usize> = runs.range(lo + 1..hi).map(|(&k, _)| k).collect();
            for k in inner {
                runs.remove(&k);
            }
            runs.insert(lo, RunState { writer: id, readers: Vec::new() });
        }
    }
    for s in op_succ.iter_mut() {
        s.sort_unstable();
        s.dedup();
    }
    Ok(op_succ)
}

fn lower(doc: &XDoc) -> Result<Imported, ImportError> {
    let n = doc.ngpus;
    let chunks = doc.nchunks.unwrap_or_else(|| doc.gpus.iter().map(|g| g.i_chunks.max(g.o_chunks)).max().unwrap_or(0));
    let in_place = doc.inplace.unwrap_or_else(|| doc.gpus.iter().all(|g| g.i_chunks == 0 || g.o_chunks == 0));
    let mut layout = Layout::new(doc.coll, n, chunks, in_place);
    layout.scratch = doc.gpus.iter().map(|g| g.s_chunks).collect();
    layout.validate_imported().map_err(|e| ImportError::Invalid { step: None, error: e })?;

    // Flatten steps: index steps per GPU per TB.
    let mut steps: Vec<FlatStep> = Vec::new();
    // (gpu, tb id) -> (tb index in gpu, flat index of its first step, its step count)
    let mut tb_first: HashMap<(u32, u32), (usize, usize, usize)> = HashMap::new();
    let mut tb_info: Vec<Vec<&XTb>> = Vec::new();
    for g in &doc.gpus {
        let mut tbs: Vec<&XTb> = g.tbs.iter().collect();
        tbs.sort_by_key(|t| t.id);
        for (ti, t) in tbs.iter().enumerate() {
            if tb_first.insert((g.id, t.id), (ti, steps.len(), t.steps.len())).is_some() {
                return Err(ImportError::BadAttribute {
                    element: "tb".into(),
                    attribute: "id".into(),
                    value: t.id.to_string(),
                    context: format!("gpu {}: repeated tb id", g.id),
                });
            }
            let mut ordered: Vec<&XStep> = t.steps.iter().collect();
            ordered.sort_by_key(|s| s.s);
            for (k, st) in ordered.iter().enumerate() {
                if st.s as usize != k {
                    return Err(ImportError::BadAttribute {
                        element: "step".into(),
                        attribute: "s".into(),
                        value: st.s.to_string(),
                        context: format!("gpu {} tb {}: steps must be numbered 0..{}", g.id, t.id, t.steps.len()),
                    });
                }
                let at = StepRef { gpu: g.id, tb: t.id, step: st.s };
                steps.push(FlatStep { at, gpu: g.id, tb_index: ti, parts: split(at, st)? });
            }
        }
        tb_info.push(tbs);
    }
    let step_index = |gpu: u32, tb: u32, s: u32| -> Option<usize> {
        tb_first.get(&(gpu, tb)).and_then(|&(_, first, len)| ((s as usize) < len).then_some(first + s as usize))
    };

    // Happens-before edges.
    let ns = steps.len();
    let mut succ: Vec<Vec<usize>> = vec![Vec::new(); ns];
    for i in 0..ns {
        let st = &steps[i];
        if st.at.step > 0 {
            succ[i - 1].push(i);
        }
    }
    for g in &doc.gpus {
        for t in &g.tbs {
            for st in &t.steps {
                if st.depid >= 0 || st.deps >= 0 {
                    let at = StepRef { gpu: g.id, tb: t.id, step: st.s };
                    let bad = ImportError::BadDependency { step: at, depid: st.depid, deps: st.deps };
                    let (Ok(dt), Ok(ds)) = (u32::try_from(st.depid), u32::try_from(st.deps)) else {
                        return Err(bad);
                    };
                    let from = step_index(g.id, dt, ds).ok_or(bad)?;
                    let to = step_index(g.id, t.id, st.s).expect("step exists");
                    succ[from].push(to);
                }
            }
        }
    }

    // Connections: FIFO matching per (src, dst, channel).
    type ConnKey = (u32, u32, u32);
    let mut send_tb: HashMap<ConnKey, u32> = HashMap::new();
    let mut recv_tb: HashMap<ConnKey, u32> = HashMap::new();
    // Per connection, its sends and its receives in FIFO order: (step flat index, part index).
    let mut sends: HashMap<ConnKey, Vec<(usize, usize)>> = HashMap::new();
    let mut recvs: HashMap<ConnKey, Vec<(usize, usize)>> = HashMap::new();
    for (i, st) in steps.iter().enumerate() {
        let t = tb_info[st.gpu as usize][st.tb_index];
        for (k, part) in st.parts.iter().enumerate() {
            let (peer, dir) = match part {
                Part::Send { .. } => (t.send, "send"),
                Part::Recv { .. } => (t.recv, "recv"),
                _ => continue,
            };
            if peer < 0 || peer >= n as i64 || peer == st.gpu as i64 {
                return Err(ImportError::BadPeer { step: st.at, direction: dir, peer });
            }
            let peer = peer as u32;
            let (key, owners, list) = if dir == "send" {
                ((st.gpu, peer, t.chan), &mut send_tb, &mut sends)
            } else {
                ((peer, st.gpu, t.chan), &mut recv_tb, &mut recvs)
            };
            let owner = *owners.entry(key).or_insert(t.id);
            if owner != t.id {
                return Err(ImportError::DuplicateConnection {
                    gpu: st.gpu,
                    peer,
                    channel: t.chan,
                    direction: dir,
                    tbs: (owner.min(t.id), owner.max(t.id)),
                });
            }
            list.entry(key).or_default().push((i, k));
        }
    }
    // matched[(step, part)] = (peer step, peer part) for sends.
    let mut send_match: HashMap<(usize, usize), (usize, usize)> = HashMap::new();
    let mut keys: Vec<&ConnKey> = sends.keys().chain(recvs.keys()).collect();
    keys.sort();
    keys.dedup();
    for key in keys {
        let s = sends.get(key).map(Vec::as_slice).unwrap_or(&[]);
        let r = recvs.get(key).map(Vec::as_slice).unwrap_or(&[]);
        for (j, &(si, sk)) in s.iter().enumerate() {
            let Some(&(ri, rk)) = r.get(j) else {
                return Err(ImportError::UnmatchedSend { step: steps[si].at, dst: key.1, channel: key.2 });
            };
            let (Part::Send { slice: a }, Part::Recv { slice: b, .. }) = (steps[si].parts[sk], steps[ri].parts[rk])
            else {
                unreachable!("lists hold sends and receives");
            };
            if a.count != b.count {
                return Err(ImportError::CountMismatch {
                    send: steps[si].at,
                    recv: steps[ri].at,
                    send_count: a.count,
                    recv_count: b.count,
                });
            }
            succ[si].push(ri);
            send_match.insert((si, sk), (ri, rk));
        }
        if r.len() > s.len() {
            let (ri, _) = r[s.len()];
            return Err(ImportError::UnmatchedRecv { step: steps[ri].at, src: key.0, channel: key.2 });
        }
    }

    // Topological order of steps (Kahn, smallest flat index first: deterministic).
    let mut indeg = vec![0u32; ns];
    for s in &succ {
        for &t in s {
            indeg[t] += 1;
        }
    }
    let mut heap: BinaryHeap<std::cmp::Reverse<usize>> =
        (0..ns).filter(|&i| indeg[i] == 0).map(std::cmp::Reverse).collect();
    let mut order = Vec::with_capacity(ns);
    while let Some(std::cmp::Reverse(i)) = heap.pop() {
        order.push(i);
        for &t in &succ[i] {
            indeg[t] -= 1;
            if indeg[t] == 0 {
                heap.push(std::cmp::Reverse(t));
            }
        }
    }
    if order.len() < ns {
        let stuck = (0..ns).find(|&i| indeg[i] > 0).expect("a step is left");
        return Err(ImportError::Cycle { step: steps[stuck].at });
    }

    // Ops: pre-copies, then one op per transfer (keyed by its send part) and per local part.
    struct Pending {
        op: Op,
        origin: StepRef,
        /// Position in the happens-before order of the op's first part (a transfer's send): the
        /// tie-break among ops the hazards leave unordered.
        first_pos: usize,
    }
    let mut ops: Vec<Pending> = Vec::new();
    let mut accesses: Vec<Access> = Vec::new();
    let mut pos = 0usize;
    for g in &doc.gpus {
        for &(i, o, cnt) in &g.copies {
            let (src, dst) = (Slice::new(BufferKind::Input, i, cnt), Slice::new(BufferKind::Output, o, cnt));
            let id = ops.len();
            ops.push(Pending {
                op: Op { kind: OpKind::Copy { rank: Rank(g.id), channel: 0, src, dst }, chunk: 0, step: 0, stage: 0 },
                origin: StepRef { gpu: g.id, tb: u32::MAX, step: u32::MAX },
                first_pos: pos,
            });
            accesses.push(Access { pos, sub: 0, op: id, rank: g.id, slice: src, write: false, read: true });
            accesses.push(Access { pos, sub: 0, op: id, rank: g.id, slice: dst, write: true, read: false });
            pos += 1;
        }
    }
    let mut op_of_recv: HashMap<(usize, usize), usize> = HashMap::new();
    let tb_chan = |st: &FlatStep| tb_info[st.gpu as usize][st.tb_index].chan;
    for &i in &order {
        let st = &steps[i];
        for (k, part) in st.parts.iter().enumerate() {
            let rank = st.gpu;
            match *part {
                Part::Send { slice } => {
                    let (ri, rk) = send_match[&(i, k)];
                    let Part::Recv { slice: dst, reduce } = steps[ri].parts[rk] else { unreachable!() };
                    let id = ops.len();
                    ops.push(Pending {
                        op: Op {
                            kind: OpKind::Transfer {
                                src_rank: Rank(rank),
                                dst_rank: Rank(steps[ri].gpu),
                                channel: tb_chan(st),
                                src: slice,
                                dst,
                                op: if reduce { RecvOp::RecvReduceCopy } else { RecvOp::Recv },
                            },
                            chunk: 0,
                            step: 0,
                            stage: 0,
                        },
                        origin: st.at,
                        first_pos: pos,
                    });
                    op_of_recv.insert((ri, rk), id);
                    accesses.push(Access { pos, sub: 0, op: id, rank, slice, write: false, read: true });
                }
                Part::Recv { slice, reduce } => {
                    let id = op_of_recv[&(i, k)];
                    accesses.push(Access { pos, sub: 0, op: id, rank, slice, write: true, read: reduce });
                }
                Part::Copy { src, dst } | Part::Reduce { src, dst } => {
                    let reduce = matches!(part, Part::Reduce { .. });
                    let kind = if reduce {
                        OpKind::Reduce { rank: Rank(rank), channel: tb_chan(st), src, dst }
                    } else {
                        OpKind::Copy { rank: Rank(rank), channel: tb_chan(st), src, dst }
                    };
                    let id = ops.len();
                    ops.push(Pending { op: Op { kind, chunk: 0, step: 0, stage: 0 }, origin: st.at, first_pos: pos });
                    accesses.push(Access { pos, sub: 0, op: id, rank, slice: src, write: false, read: true });
                    accesses.push(Access { pos, sub: 0, op: id, rank, slice: dst, write: true, read: reduce });
                }
            }
            pos += 1;
        }
    }

    // Linearize by data hazards. A cycle means a buffered exchange (a send whose source is
    // overwritten before the matching receive happens, on both sides): snapshot those sends'
    // sources into fresh scratch at the send position, which makes every transfer atomic, and retry.
    // Each round's scratch is held to `Layout::validate_imported`'s limits before the next round
    // sizes its tables by it: a small file of wide exchanges would otherwise grow it without bound.
    let mut snapshotted = vec![false; ops.len()];
    let (op_order, level, base, acc) = loop {
        let (base, acc) = storage_bases(&layout);
        let op_succ =
            hazard_edges(&layout, &base, acc, &ops.iter().map(|o| o.origin).collect::<Vec<_>>(), &mut accesses)?;
        let no = ops.len();
        let mut indeg = vec![0u32; no];
        for s in &op_succ {
            for &t in s {
                indeg[t] += 1;
            }
        }
        let mut heap: BinaryHeap<std::cmp::Reverse<(usize, usize)>> =
            (0..no).filter(|&i| indeg[i] == 0).map(|i| std::cmp::Reverse((ops[i].first_pos, i))).collect();
        let mut op_order = Vec::with_capacity(no);
        let mut level = vec![0u32; no];
        while let Some(std::cmp::Reverse((_, i))) = heap.pop() {
            op_order.push(i);
            for &t in &op_succ[i] {
                level[t] = level[t].max(level[i] + 1);
                indeg[t] -= 1;
                if indeg[t] == 0 {
                    heap.push(std::cmp::Reverse((ops[t].first_pos, t)));
                }
            }
        }
        if op_order.len() == no {
            break (op_order, level, base, acc);
        }
        let stuck: Vec<usize> =
            (0..no).filter(|&i| indeg[i] > 0 && ops[i].op.is_transfer() && !snapshotted[i]).collect();
        if stuck.is_empty() {
            let at = (0..no).find(|&i| indeg[i] > 0).expect("an op is left");
            return Err(ImportError::BufferedCycle { step: ops[at].origin });
        }
        let too_large = |at: StepRef, r: usize, scratch: u64, why: &str| ImportError::Invalid {
            step: Some(at),
            error: ProgramError::BadLayout {
                reason: format!("snapshots of buffered exchanges need {scratch} scratch chunks on gpu {r}: {why}"),
            },
        };
        let first = ops[stuck[0]].origin;
        for x in stuck {
            let OpKind::Transfer { src_rank, src, .. } = ops[x].op.kind else { unreachable!() };
            let r = src_rank.0 as usize;
            let snap = Slice::new(BufferKind::Scratch, layout.scratch[r], src.count);
            // Defensive: the file's layout (at most 2^24 chunks) and the chunk-access limit (2^30)
            // keep a round's scratch far below u32 before this sum.
            layout.scratch[r] = layout.scratch[r].checked_add(src.count).ok_or_else(|| {
                let need = layout.scratch[r] as u64 + src.count as u64;
                too_large(ops[x].origin, r, need, "more than a rank's storage can count")
            })?;
            let read = accesses
                .iter_mut()
                .find(|a| a.op == x && !a.write && a.rank == src_rank.0)
                .expect("a transfer reads its source");
            read.slice = snap;
            read.sub = 1;
            let pos = read.pos;
            let id = ops.len();
            let (channel, origin, first_pos) = (ops[x].op.channel(), ops[x].origin, ops[x].first_pos);
            ops.push(Pending {
                op: Op { kind: OpKind::Copy { rank: src_rank, channel, src, dst: snap }, chunk: 0, step: 0, stage: 0 },
                origin,
                first_pos,
            });
            accesses.push(Access { pos, sub: 0, op: id, rank: src_rank.0, slice: src, write: false, read: true });
            accesses.push(Access { pos, sub: 0, op: id, rank: src_rank.0, slice: snap, write: true, read: false });
            if let OpKind::Transfer { src, .. } = &mut ops[x].op.kind {
                *src = snap;
            }
            snapshotted[x] = true;
            snapshotted.push(true);
        }
        if let Err(e) = layout.validate_imported() {
            let most = layout.scratch.iter().copied().max().unwrap_or(0);
            let r = layout.scratch.iter().position(|&s| s == most).unwrap_or(0);
            let why = match e {
                ProgramError::BadLayout { reason } => reason,
                other => other.to_string(),
            };
            return Err(too_large(first, r, most as u64, &why));
        }
    };
    let no = ops.len();

    // Chunk labels: user-buffer locations carry their own index, scratch inherits from writes.
    let mut label = vec![0u32; acc];
    for r in 0..n {
        let rk = Rank(r);
        for b in [BufferKind::Input, BufferKind::Output] {
            for j in 0..layout.buffer_chunks(rk, b) {
                let flat = layout.resolve(rk, Slice::new(b, j, 1)).expect("in range");
                // In place, the label is the index in the shared main buffer (an AllGather input
                // chunk is its output block's chunk); out of place, the index in its own buffer.
                label[base[r as usize] + flat as usize] = if layout.in_place { flat } else { j };
            }
        }
    }
    // A name the text format could not hold becomes one token; the file's spelling is kept.
    let (name, file_name) = match Program::check_name(&doc.name) {
        Ok(()) => (doc.name.clone(), None),
        Err(_) if doc.name.is_empty() => ("msccl".to_string(), Some(doc.name.clone())),
        Err(_) => {
            let token = doc
                .name
                .chars()
                .map(|c| if c.is_whitespace() || c.is_control() || c == '#' { '_' } else { c })
                .collect();
            (token, Some(doc.name.clone()))
        }
    };
    let mut program = Program::new(name, layout.clone());
    let mut origin = Vec::with_capacity(no);
    for &i in &op_order {
        let mut op = ops[i].op;
        let (sr, dr) = (op.src_rank(), op.dst_rank());
        let s = base[sr.index()] + layout.resolve(sr, op.src()).expect("resolved above") as usize;
        let d = base[dr.index()] + layout.resolve(dr, op.dst()).expect("resolved above") as usize;
        op.chunk = label[s];
        op.step = level[i];
        if !op.reduces() {
            for c in 0..op.src().count as usize {
                label[d + c] = label[s + c];
            }
        }
        program.ops.push(op);
        origin.push(ops[i].origin);
    }
    Ok(Imported { program, origin, proto: doc.proto.clone(), file_name })
}
