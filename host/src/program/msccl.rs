//! The MSCCL XML importer.
//!
//! # What an MSCCL file means
//!
//! The meaning below is MSCCL's runtime's: its XML parser (`mscclGetAlgoFromXmlFile`) and its
//! interpreter kernel (`mscclRunInterpreter`) in msccl-executor-nccl, which RCCL carries too; the
//! files come from msccl-tools (MSCCLang), TACCL, TE-CCL and hand-written generators.
//!
//! A file has one `<algo coll= ngpus= nchunksperloop= inplace= outofplace=>`, per GPU a
//! `<gpu id= i_chunks= o_chunks= s_chunks=>`, and per GPU thread blocks `<tb id= send= recv= chan=>`
//! of steps `<step s= type= srcbuf= srcoff= dstbuf= dstoff= cnt= depid= deps= hasdep=>`. Every user
//! buffer is cut into `nchunksperloop` chunks (the larger of input and output; see [`BufferLayout`]), and a
//! step moves `cnt` consecutive chunks from offset `srcoff` of buffer `srcbuf` (`i`, `o`, `s`) or to
//! `dstoff` of `dstbuf`. In an in-place run the input and output alias as NCCL's do.
//!
//! A TB runs its steps one after another, in the order the file writes them. It receives from its
//! `recv` peer and sends to its `send` peer over the connection of its channel; a send completes when
//! its data is in the connection's FIFO (taken as unbounded: MSCCL cuts each step into pieces that fit,
//! `mscclMaxAllowedCount`), a receive waits for the next message of its connection, in order. What each
//! step type reads, writes and sends, with `in` the data it receives:
//!
//! | type | MSCCL primitive | reads | writes | sends |
//! |---|---|---|---|---|
//! | `s` | `send(src)` | src | | src |
//! | `r` | `recv(dst)` | | dst ← in | |
//! | `rcs` | `recvCopySend(dst)` | | dst ← in | in |
//! | `rrs` | `recvReduceSend(src)` | src | **nothing** | in ⊕ src |
//! | `rrc` | `recvReduceCopy(src, dst)` | src | dst ← in ⊕ src | |
//! | `rrcs` | `recvReduceCopySend(src, dst)` | src | dst ← in ⊕ src | in ⊕ src |
//! | `cpy` | `localCopy(src, dst)` | src | dst ← src | |
//! | `re` | reduce | src, dst | dst ← dst ⊕ src | |
//! | `nop` | none | | | |
//!
//! Only the operands in the table are used: a send's `dst*` and a receive's `src*` are ignored (the
//! receiving step alone says where the data goes: connections are taken as FIFOs, never as writes
//! straight into the peer's buffer).
//!
//! **Dependencies.** MSCCL keeps, per TB, a counter that is the index of the step it runs (see below
//! for `nop`), and after a step with `hasdep="1"` it publishes that counter as the TB's flag. A step
//! with `depid="b" deps="d"` first waits until TB `b` of its GPU has published a flag of at least `d`,
//! that is until the first step of TB `b` with `hasdep="1"` and index `d` or later is done: a TB that
//! never gets there leaves the waiter hanging. A `nop` does nothing but carry its dependency to the
//! next step that is not a `nop`, which then waits for all of them; MSCCL refuses a file where that
//! step has no dependency of its own, and drops the dependencies of `nop`s that end a TB. The counter
//! counts a `nop` only when it carries a dependency (the next step advances it by its dependencies
//! less one), as MSCCL does.
//!
//! **Fused reductions.** MSCCL fuses a run of `re` steps of one TB with the same destination and
//! source buffer, when none after the first has a dependency and none before the last has
//! `hasdep="1"` (and at most until the TB's 16th `re`): the run computes `dst ⊕ src₁ ⊕ src₂ …` at once,
//! and the dependencies of `nop`s inside it wait after it. It uses the last step's `cnt` for all of
//! them, so the importer refuses fused steps of different counts.
//!
//! **TACCL and msccl-tools' newer format.** `<op step= type= buf= off= cnt=>` spells a step with one
//! location (the source of a send, else the destination) standing for both; missing `cnt` is 1,
//! missing `depid`/`deps` is no dependency and missing `hasdep` is 0. TACCL's `<copy i_off= o_off=
//! cnt=>` inside a `<gpu>` copies input to output before any step runs.
//!
//! **In place, out of place.** `inplace` and `outofplace` say for which calls the algorithm is meant
//! (a file may declare both). Where neither is given, the layout is in place when every GPU declares
//! only one of `i_chunks` and `o_chunks`.
//!
//! # What the importer accepts
//!
//! A file imports when it is well formed, MSCCL's runtime would run it to the end (no step waits
//! forever, no message is left in a FIFO), it has no data race (two steps of different TBs that
//! touch a chunk, at least one writing it, are ordered by the TBs' order, dependencies and messages),
//! and the result is the collective it names, for each placement it claims. Beyond MSCCL's own parser
//! it refuses, naming the step or the line:
//!
//! - structure that would lose data or is ambiguous: a second `<algo>`, a `<gpu>` or `<tb>` inside one
//!   of its kind, a `<gpu>`, `<tb>`, `<step>`/`<op>` or `<copy>` outside its parent (MSCCL would skip
//!   it), an element left unclosed (a file without `</algo>`), a repeated attribute, steps not
//!   numbered `0, 1, …` in the order written;
//! - declared sizes that contradict the file: `i_chunks`/`o_chunks` larger than the buffers
//!   `nchunksperloop` gives, or a step reaching past the `i_chunks`/`o_chunks` its GPU declares;
//! - local operands that overlap without being the same chunks (a `cpy` onto itself, including an
//!   input and an output chunk that alias in place, changes nothing, though it races with a concurrent
//!   write like a read; an `rrc`/`rrcs` onto its own source reduces in place);
//! - fused `re` steps of different counts.
//!
//! It does not enforce MSCCL's capacity limits (256 steps per TB, counts below 72, 16-bit offsets),
//! and it tolerates missing attributes MSCCL requires (`proto`, `minBytes`, ...).
//!
//! # How it imports
//!
//! 1. **Read** the XML in one pass, linear in its size however wide an element is; accept
//!    `reducescatter`/`reduce_scatter`, unknown attributes and unknown elements (whose content must
//!    not hold the elements above). A `name` that is not a program name ([`Program::check_name`]) is
//!    made one (each offending character `_`), the file's spelling kept in [`Imported::file_name`].
//! 2. **Group** each TB's steps as MSCCL's parser does (dependencies of `nop`s, fused `re` runs,
//!    counters) and resolve every dependency to the step that releases it.
//! 3. **Split** steps into primitives with the table's meaning: `rcs` = recv + send of the stored
//!    data; `rrc`/`rrcs` = (copy src to dst unless they are the same chunks) + recv_reduce_copy into
//!    dst (+ send of dst); `rrs` = copy src to fresh scratch + recv_reduce_copy into it + send of it,
//!    so that nothing of the file's buffers is written.
//! 4. **Match** sends and receives in FIFO order per connection `(src, dst, channel)` and order the
//!    steps by happens-before (TB order, dependencies, send before its receive). A cycle is an error.
//!    Every pair of conflicting accesses of different TBs must be ordered: a data race is an error.
//! 5. **Linearize** into atomic ops placed by the data hazards alone, in happens-before order. A
//!    buffered exchange (a send whose source is overwritten, on both sides, before the matching
//!    receive) leaves a cycle: the sources of the stuck sends are copied into fresh scratch at the
//!    send's position, which makes every transfer atomic, and the ordering is retried. A cycle that
//!    remains is reported ([`ImportError::BufferedCycle`]), never broken by reordering.
//!
//! [`import`] then checks the collective's postcondition. When the file has `rrs` steps whose source
//! is scratch or an output chunk, it also builds the program with those steps reducing into their
//! source (no scratch copy: cheaper) and returns that one if it computes the collective too; both
//! hold the same values in every user buffer chunk at the end (the collective's result), and the
//! scratch copy is kept where it matters. Every error names the XML step or line it comes from.

use super::{BufferKind, BufferLayout, Collective, InputError, Op, OpKind, Program, ProgramError, Rank, RecvOp, Slice};
use crate::collective::ParseCollectiveError;
use quick_xml::Reader;
use quick_xml::events::{BytesStart, Event};
use std::collections::{BTreeMap, BinaryHeap, HashMap, HashSet};
use std::fmt;
use std::path::Path;

/// A step of the XML file: GPU, TB id and step index, as written there, and its line.
#[derive(Copy, Clone, PartialEq, Eq, Hash, Debug)]
pub struct StepRef {
    /// The `<gpu id=>`, which is the rank.
    pub gpu: u32,
    /// The `<tb id=>` on that GPU (`u32::MAX` for a TACCL `<copy>`).
    pub tb: u32,
    /// The step's `s=` (TACCL: `step=`), its index within the TB (`u32::MAX` for a TACCL `<copy>`).
    pub step: u32,
    /// The line of the step's tag, counted from 1.
    pub line: usize,
}

impl fmt::Display for StepRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.tb == u32::MAX {
            write!(f, "gpu {} <copy> (line {})", self.gpu, self.line)
        } else {
            write!(f, "gpu {} tb {} step {} (line {})", self.gpu, self.tb, self.step, self.line)
        }
    }
}

/// Which placements (in place, out of place) a file claims to compute its collective in.
#[derive(Copy, Clone, PartialEq, Eq, Debug)]
pub struct Placements {
    /// The algorithm is meant for in-place calls.
    pub in_place: bool,
    /// The algorithm is meant for out-of-place calls.
    pub out_of_place: bool,
}

/// Why an MSCCL file could not be imported.
#[derive(Clone, PartialEq, Debug, thiserror::Error)]
pub enum ImportError {
    /// The XML itself is malformed.
    #[error("malformed XML: {message}")]
    Xml {
        /// The parser's message, with the line.
        message: String,
    },
    /// The file could not be read ([`import_path`]).
    #[error("{0}")]
    Input(#[from] InputError),
    /// A required attribute is absent.
    #[error("line {line}: <{element}> {context}: missing attribute `{attribute}`")]
    MissingAttribute {
        /// The element's name, without brackets.
        element: String,
        /// The attribute's name (the first spelling where several are accepted).
        attribute: &'static str,
        /// Where the element is: `in <algo>`, `in gpu 1`, `gpu 1 tb 0 step 3`, ...
        context: String,
        /// The element's line.
        line: usize,
    },
    /// An attribute has a value that cannot be used.
    #[error("line {line}: <{element}> {context}: bad value `{value}` for `{attribute}`")]
    BadAttribute {
        /// The element's name, without brackets.
        element: String,
        /// The attribute's name (the first spelling where several are accepted).
        attribute: String,
        /// The value found.
        value: String,
        /// Where the element is, or what the value should have been.
        context: String,
        /// The element's line.
        line: usize,
    },
    /// An attribute given twice on one element.
    #[error("line {line}: <{element}> gives attribute `{attribute}` twice")]
    DuplicateAttribute {
        /// The element's name.
        element: String,
        /// The attribute's name.
        attribute: String,
        /// The element's line.
        line: usize,
    },
    /// The `coll` attribute names a collective oxccl does not know.
    #[error("line {line}: unknown collective `{name}`")]
    UnknownCollective {
        /// The `coll` value as written.
        name: String,
        /// The `<algo>`'s line.
        line: usize,
    },
    /// `coll="broadcast"` or `coll="reduce"`: MSCCL takes the root from the call, and a file does
    /// not say which root its steps were written for.
    #[error(
        "line {line}: `{name}` from an MSCCL file: the file does not say which rank is the root; write the program in the text format with `root=R`"
    )]
    RootedCollective {
        /// The `coll` value as written.
        name: String,
        /// The `<algo>`'s line.
        line: usize,
    },
    /// A step `type` that is not one of MSCCL's.
    #[error("{step}: unknown step type `{ty}`")]
    UnknownStepType {
        /// The step at fault.
        step: StepRef,
        /// Its `type` as written.
        ty: String,
    },
    /// A step sends (or receives) in a TB without a send (or receive) peer, or the peer is not a GPU.
    #[error("{step}: {direction} step in a TB whose {direction} peer is {peer}")]
    BadPeer {
        /// The step at fault.
        step: StepRef,
        /// `"send"` or `"recv"`.
        direction: &'static str,
        /// The TB's `send=` or `recv=` value: `-1` when absent, else out of range or the GPU itself.
        peer: i64,
    },
    /// Two TBs of one GPU use the same connection in the same direction.
    #[error("gpu {gpu}: tbs {} and {} both {direction} with gpu {peer} on channel {channel}", tbs.0, tbs.1)]
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
    /// A send with no receive left to match it on its connection: its message would stay in the FIFO.
    #[error("{step}: send to gpu {dst} on channel {channel} has no matching receive")]
    UnmatchedSend {
        /// The first send left over on the connection.
        step: StepRef,
        /// The receiving GPU.
        dst: u32,
        /// The connection's channel.
        channel: u32,
    },
    /// A receive with no send left to match it on its connection: it would wait forever.
    #[error("{step}: receive from gpu {src} on channel {channel} has no matching send")]
    UnmatchedRecv {
        /// The first receive left over on the connection.
        step: StepRef,
        /// The sending GPU.
        src: u32,
        /// The connection's channel.
        channel: u32,
    },
    /// A matched send and receive move different numbers of chunks.
    #[error("{send}: sends {send_count} chunks but the matching receive ({recv}) takes {recv_count}")]
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
    /// `depid`/`deps` name a TB that does not exist on the GPU, or a negative step.
    #[error("{step}: depends on tb {depid} step {deps}, which does not exist")]
    BadDependency {
        /// The waiting step.
        step: StepRef,
        /// The TB id waited on, as written.
        depid: i64,
        /// The step index waited on, as written.
        deps: i64,
    },
    /// A step waits for a TB to publish a flag it never publishes: no step of TB `depid` from step
    /// `deps` on has `hasdep="1"`, so MSCCL would wait forever.
    #[error(
        "{step}: waits for tb {depid} to pass step {deps}, but no step of tb {depid} from {deps} on has hasdep=\"1\": MSCCL would wait forever"
    )]
    NeverSignalled {
        /// The waiting step (for a `nop`'s dependency, the `nop`).
        step: StepRef,
        /// The TB waited on.
        depid: u32,
        /// The step index waited on.
        deps: i64,
    },
    /// `nop` dependencies before a step without a dependency of its own, which MSCCL's parser refuses.
    #[error(
        "{step}: the nop at {nop} hands its dependency to this step, which has none of its own (MSCCL refuses the file)"
    )]
    DanglingDependency {
        /// The step the `nop`s' dependencies would go to.
        step: StepRef,
        /// The first of those `nop`s.
        nop: StepRef,
    },
    /// A `re` step MSCCL fuses with the one before it (same destination) has a different count:
    /// MSCCL would use the last one's count for all of them.
    #[error(
        "{step}: MSCCL fuses this re with the one at {first} (same destination) and would use this step's cnt for both, which differ"
    )]
    FusedCount {
        /// The step with the other count.
        step: StepRef,
        /// The first `re` of the fused run.
        first: StepRef,
    },
    /// A local step whose source and destination overlap without being the same chunks (or a `re`
    /// onto its own source): threads would read what others write.
    #[error("{step}: source and destination overlap without being the same chunks")]
    OverlappingOperands {
        /// The step at fault.
        step: StepRef,
    },
    /// Two steps of different TBs access a chunk, at least one writing it, with nothing ordering them:
    /// the result would depend on timing.
    #[error(
        "{second}: accesses {slice} on gpu {rank}, which {first} also accesses, with nothing ordering them (a data race)"
    )]
    Race {
        /// The step that comes first in the importer's order.
        first: StepRef,
        /// The other step.
        second: StepRef,
        /// The GPU whose chunk it is.
        rank: u32,
        /// The slice the second step accesses, as it names it.
        slice: Slice,
    },
    /// The steps wait on each other in a cycle (this step is on it): MSCCL would hang.
    #[error("{step}: steps wait on each other in a cycle")]
    Cycle {
        /// A step on the cycle.
        step: StepRef,
    },
    /// Steps left in a cycle of data hazards after the sources of every stuck send were copied
    /// into scratch (how the importer makes buffered exchanges atomic); this step is on it.
    #[error("{step}: part of a buffered exchange that cannot be expressed with atomic transfers")]
    BufferedCycle {
        /// A step on the cycle.
        step: StepRef,
    },
    /// The imported program fails verification or its postcondition.
    #[error("{}{error}", step.as_ref().map(|s| format!("{s}: ")).unwrap_or_default())]
    Invalid {
        /// The step the failing op came from, when the error names an op.
        step: Option<StepRef>,
        /// The program's error. Its op ids index [`Imported::program`]'s ops, except in a
        /// [`ProgramError::SliceOutOfRange`] found while reading steps, which has the importer's own
        /// numbering; `step` locates both.
        error: ProgramError,
    },
    /// An element opened inside one of its own kind (`<tb>` in a `<tb>`, `<gpu>` in a `<gpu>`), or a
    /// second `<algo>`: reading on would drop the first one's content. Lines count from 1.
    #[error("{}", repeated(element, *line, *first_line))]
    RepeatedElement {
        /// `"algo"`, `"gpu"` or `"tb"`.
        element: &'static str,
        /// The line of the second opening tag.
        line: usize,
        /// The line of the first one (still open, except for `<algo>`).
        first_line: usize,
    },
    /// A known element (`<gpu>`, `<tb>`, `<step>`, `<op>`, `<copy>`, `<algo>`) outside its parent
    /// (`<algo>`, `<gpu>`, `<tb>`, `<tb>`, `<gpu>`, the top level): MSCCL would skip it.
    #[error(
        "line {line}: <{element}> {}, where it does not belong",
        parent.as_ref().map_or("at the top level".to_string(), |p| format!("inside <{p}>"))
    )]
    Misplaced {
        /// The element.
        element: String,
        /// Its line.
        line: usize,
        /// The element it is in (`None`: the top level).
        parent: Option<String>,
    },
    /// The file ends with an element still open (a file without `</algo>`).
    #[error("line {line}: <{element}> is never closed (the file ends inside it)")]
    Unclosed {
        /// The innermost open element.
        element: String,
        /// The line it opens on.
        line: usize,
    },
    /// A GPU declares more input or output chunks than the collective's buffers have.
    #[error(
        "line {line}: gpu {gpu} declares {attribute}=\"{declared}\" but the buffer has {limit} chunks (nchunksperloop and the collective)"
    )]
    DeclaredChunks {
        /// The GPU.
        gpu: u32,
        /// Its line.
        line: usize,
        /// `"i_chunks"` or `"o_chunks"`.
        attribute: &'static str,
        /// The declared count.
        declared: u32,
        /// The buffer's size from `nchunksperloop` and the collective.
        limit: u32,
    },
    /// A step reaches past the `i_chunks`/`o_chunks` its GPU declares.
    #[error("{step}: {slice} reaches past the {attribute}=\"{declared}\" its gpu declares")]
    BeyondDeclared {
        /// The step.
        step: StepRef,
        /// `"i_chunks"` or `"o_chunks"`.
        attribute: &'static str,
        /// The declared count.
        declared: u32,
        /// The slice the step names.
        slice: Slice,
    },
    /// `inplace="0"` and `outofplace="0"`: the algorithm is meant for no call.
    #[error("line {line}: inplace=\"0\" and outofplace=\"0\": the algorithm is meant for no call")]
    NoPlacement {
        /// The `<algo>`'s line.
        line: usize,
    },
    /// The file claims both placements and fails in this one.
    #[error("as an {} algorithm (the file claims both): {error}", placement_name(*in_place))]
    Placement {
        /// Which placement failed.
        in_place: bool,
        /// Why.
        error: Box<ImportError>,
    },
    /// [`import_as`] asked for a placement the file does not claim.
    #[error("the file does not claim to be an {} algorithm", placement_name(*in_place))]
    NotClaimed {
        /// The placement asked for.
        in_place: bool,
    },
    /// Checking the file would take more work than the importer allows (its size in words).
    #[error("too large to import: {reason}")]
    TooLarge {
        /// What is too large.
        reason: String,
    },
}

fn placement_name(in_place: bool) -> &'static str {
    if in_place { "in-place" } else { "out-of-place" }
}

/// A repeated element's message: a second `<algo>`, or an element inside its own kind.
fn repeated(element: &str, line: usize, first_line: usize) -> String {
    if element == "algo" {
        format!("line {line}: a second <algo> (the first is at line {first_line}); a file holds one algorithm")
    } else {
        format!("line {line}: <{element}> inside the <{element}> of line {first_line}, which is not closed")
    }
}

/// An imported program and, for each op, the XML step it came from.
#[derive(Clone, Debug)]
pub struct Imported {
    /// The program, its ops in an order that respects every data hazard. Each op's `step` is its
    /// depth in the hazard graph, `stage` is 0 and `channel` is its (sending) TB's `chan=` (0 for
    /// TACCL `<copy>` pre-copies);
    /// `ranks_per_node` is `None`. Scratch may exceed the file's `s_chunks` where buffered exchanges
    /// were snapshotted or `rrs` steps reduce into scratch of their own.
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
    /// The placements the file claims; [`import`] checked each and returned the in-place program
    /// where in place is claimed (the out-of-place one with [`import_as`]).
    pub placements: Placements,
}

/// Imports an MSCCL XML algorithm, verifies it and checks its postcondition in every placement it
/// claims. The program returned is the in-place one where the file claims in place, else the
/// out-of-place one.
pub fn import(xml: &str) -> Result<Imported, ImportError> {
    let doc = read(xml)?;
    let claims = doc.placements()?;
    let both = claims.in_place && claims.out_of_place;
    // Where the file claims both, an error says which placement it is in.
    let named = |in_place: bool| {
        move |e: ImportError| if both { ImportError::Placement { in_place, error: Box::new(e) } } else { e }
    };
    let imported = import_doc(&doc, claims.in_place, claims).map_err(named(claims.in_place))?;
    if both {
        import_doc(&doc, false, claims).map_err(named(false))?;
    }
    Ok(imported)
}

/// [`import`], for one placement the file claims ([`ImportError::NotClaimed`] otherwise).
pub fn import_as(xml: &str, in_place: bool) -> Result<Imported, ImportError> {
    let doc = read(xml)?;
    let claims = doc.placements()?;
    if !(if in_place { claims.in_place } else { claims.out_of_place }) {
        return Err(ImportError::NotClaimed { in_place });
    }
    import_doc(&doc, in_place, claims)
}

/// [`import`] of the file at `path`, read with [`super::read_input`] up to
/// [`super::MAX_INPUT_BYTES`] ([`ImportError::Input`] when it cannot be read or is larger).
pub fn import_path(path: &Path) -> Result<Imported, ImportError> {
    import(&super::read_input(path, super::MAX_INPUT_BYTES).map_err(ImportError::Input)?)
}

/// Imports without checking the collective's postcondition, in the placement [`import`] returns:
/// structure errors, hangs and data races are still reported. `rrs` steps reduce into scratch.
pub fn import_unchecked(xml: &str) -> Result<Imported, ImportError> {
    let doc = read(xml)?;
    let claims = doc.placements()?;
    Ok(lower(&doc, claims.in_place, RrsForm::Scratch, claims)?.0)
}

/// Imports `doc` in one placement and checks it; then, where `rrs` steps could reduce into their
/// own source, tries that cheaper form and keeps it if it computes the collective too.
fn import_doc(doc: &XDoc, in_place: bool, claims: Placements) -> Result<Imported, ImportError> {
    let (imported, candidates) = lower(doc, in_place, RrsForm::Scratch, claims)?;
    check(&imported)?;
    if candidates
        && let Ok((cheaper, _)) = lower(doc, in_place, RrsForm::InPlace, claims)
        && check(&cheaper).is_ok()
    {
        return Ok(cheaper);
    }
    Ok(imported)
}

/// Verifies an imported program and its postcondition, naming the step of the failing op.
fn check(imp: &Imported) -> Result<(), ImportError> {
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
    imp.program.check().map_err(|e| ImportError::Invalid { step: at(&e), error: e })
}

// ---------------------------------------------------------------------------------------------
// 1. Reading
// ---------------------------------------------------------------------------------------------

/// A step's type: MSCCL's letters (and the longer `copy`/`reduce` some generators write).
#[derive(Copy, Clone, PartialEq, Eq, Debug)]
enum Kind {
    Nop,
    Send,
    Recv,
    RecvCopySend,
    RecvReduceSend,
    RecvReduceCopy,
    RecvReduceCopySend,
    Copy,
    Reduce,
}

impl Kind {
    fn parse(ty: &str) -> Option<Kind> {
        Some(match ty {
            "nop" => Kind::Nop,
            "s" => Kind::Send,
            "r" => Kind::Recv,
            "rcs" => Kind::RecvCopySend,
            "rrs" => Kind::RecvReduceSend,
            "rrc" => Kind::RecvReduceCopy,
            "rrcs" => Kind::RecvReduceCopySend,
            "cpy" | "copy" => Kind::Copy,
            "re" | "reduce" => Kind::Reduce,
            _ => return None,
        })
    }
    /// Whether the step reads its source operand.
    fn uses_src(self) -> bool {
        matches!(
            self,
            Kind::Send
                | Kind::RecvReduceSend
                | Kind::RecvReduceCopy
                | Kind::RecvReduceCopySend
                | Kind::Copy
                | Kind::Reduce
        )
    }
    /// Whether the step names a destination operand.
    fn uses_dst(self) -> bool {
        matches!(
            self,
            Kind::Recv
                | Kind::RecvCopySend
                | Kind::RecvReduceCopy
                | Kind::RecvReduceCopySend
                | Kind::Copy
                | Kind::Reduce
        )
    }
}

/// A location as written: buffer and offset, or the name of the attribute missing for it.
type Loc = Result<(BufferKind, i64), &'static str>;

#[derive(Clone, Debug)]
struct XStep {
    at: StepRef,
    kind: Kind,
    src: Loc,
    dst: Loc,
    cnt: u32,
    depid: i64,
    deps: i64,
    hasdep: bool,
}

#[derive(Clone, Debug)]
struct XTb {
    id: u32,
    line: usize,
    send: i64,
    recv: i64,
    chan: u32,
    steps: Vec<XStep>,
}

#[derive(Clone, Debug)]
struct XCopy {
    at: StepRef,
    i: u32,
    o: u32,
    cnt: u32,
}

#[derive(Clone, Debug)]
struct XGpu {
    id: u32,
    line: usize,
    i_chunks: Option<u32>,
    o_chunks: Option<u32>,
    s_chunks: u32,
    copies: Vec<XCopy>,
    tbs: Vec<XTb>,
}

#[derive(Clone, Debug)]
struct XDoc {
    name: String,
    line: usize,
    proto: Option<String>,
    coll: Collective,
    ngpus: u32,
    nchunks: Option<u32>,
    inplace: Option<bool>,
    outofplace: Option<bool>,
    gpus: Vec<XGpu>,
}

impl XDoc {
    /// The placements the file claims (see the module documentation).
    fn placements(&self) -> Result<Placements, ImportError> {
        let claims = match (self.inplace, self.outofplace) {
            (None, None) => {
                let i = self.gpus.iter().all(|g| g.i_chunks.unwrap_or(0) == 0 || g.o_chunks.unwrap_or(0) == 0);
                Placements { in_place: i, out_of_place: !i }
            }
            (Some(i), None) => Placements { in_place: i, out_of_place: !i },
            (None, Some(o)) => Placements { in_place: !o, out_of_place: o },
            (Some(i), Some(o)) => Placements { in_place: i, out_of_place: o },
        };
        if !claims.in_place && !claims.out_of_place {
            return Err(ImportError::NoPlacement { line: self.line });
        }
        Ok(claims)
    }
}

/// An element's attributes, each given once.
struct Attrs {
    element: String,
    line: usize,
    map: HashMap<String, String>,
}

impl Attrs {
    /// Reads the attributes in one pass (quick-xml's own duplicate check compares each attribute
    /// with every earlier one: quadratic in a wide element), refusing a repeated one.
    fn of(e: &BytesStart<'_>, element: &str, line: usize) -> Result<Attrs, ImportError> {
        let mut map = HashMap::new();
        let xml = |err: &dyn fmt::Display| ImportError::Xml { message: format!("line {line}: <{element}>: {err}") };
        for a in e.attributes().with_checks(false) {
            let a = a.map_err(|err| xml(&err))?;
            let k = String::from_utf8_lossy(a.key.as_ref()).into_owned();
            let v = a.unescape_value().map_err(|err| xml(&err))?.into_owned();
            if map.contains_key(&k) {
                return Err(ImportError::DuplicateAttribute { element: element.to_string(), attribute: k, line });
            }
            map.insert(k, v);
        }
        Ok(Attrs { element: element.to_string(), line, map })
    }
    fn get(&self, keys: &[&str]) -> Option<&str> {
        keys.iter().find_map(|k| self.map.get(*k).map(|s| s.trim()))
    }
    fn bad(&self, attribute: &str, value: &str, ctx: &str) -> ImportError {
        ImportError::BadAttribute {
            element: self.element.clone(),
            attribute: attribute.to_string(),
            value: value.to_string(),
            context: ctx.to_string(),
            line: self.line,
        }
    }
    fn int(&self, keys: &[&'static str], ctx: &str) -> Result<Option<i64>, ImportError> {
        match self.get(keys) {
            None => Ok(None),
            Some(v) => v.parse::<i64>().map(Some).map_err(|_| self.bad(keys[0], v, ctx)),
        }
    }
    fn req(&self, keys: &[&'static str], ctx: &str) -> Result<i64, ImportError> {
        self.int(keys, ctx)?.ok_or_else(|| ImportError::MissingAttribute {
            element: self.element.clone(),
            attribute: keys[0],
            context: ctx.to_string(),
            line: self.line,
        })
    }
    /// A non-negative `u32` attribute; absent, `default` (an error where `None`).
    fn nonneg(&self, keys: &[&'static str], ctx: &str, default: Option<u32>) -> Result<u32, ImportError> {
        let v = match (self.int(keys, ctx)?, default) {
            (Some(v), _) => v,
            (None, Some(d)) => return Ok(d),
            (None, None) => return self.req(keys, ctx).map(|_| 0),
        };
        u32::try_from(v).map_err(|_| self.bad(keys[0], &v.to_string(), ctx))
    }
    fn opt_nonneg(&self, key: &'static str, ctx: &str) -> Result<Option<u32>, ImportError> {
        match self.int(&[key], ctx)? {
            None => Ok(None),
            Some(_) => self.nonneg(&[key], ctx, None).map(Some),
        }
    }
    /// A `0`/`1` attribute (MSCCL reads any other integer as true).
    fn flag(&self, key: &'static str, ctx: &str) -> Result<Option<bool>, ImportError> {
        Ok(self.int(&[key], ctx)?.map(|v| v != 0))
    }
    fn buffer(&self, keys: &[&'static str], ctx: &str) -> Result<Option<BufferKind>, ImportError> {
        match self.get(keys) {
            None => Ok(None),
            Some("i") | Some("input") => Ok(Some(BufferKind::Input)),
            Some("o") | Some("output") => Ok(Some(BufferKind::Output)),
            Some("s") | Some("scratch") => Ok(Some(BufferKind::Scratch)),
            Some(v) => Err(self.bad(keys[0], v, ctx)),
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

/// The line (from 1) of byte `pos` of `text`.
fn line_of(text: &str, pos: u64) -> usize {
    let pos = usize::try_from(pos).unwrap_or(usize::MAX).min(text.len());
    1 + text.as_bytes()[..pos].iter().filter(|&&b| b == b'\n').count()
}

/// The parent each known element must have (`""`: the top level).
fn parent_of(element: &str) -> Option<&'static str> {
    Some(match element {
        "algo" => "",
        "gpu" => "algo",
        "tb" | "copy" => "gpu",
        "step" | "op" => "tb",
        _ => return None,
    })
}

fn read(xml: &str) -> Result<XDoc, ImportError> {
    let mut reader = Reader::from_str(xml);
    reader.config_mut().trim_text(true);
    let mut lines = Lines { text: xml.as_bytes(), pos: 0, line: 1 };
    // The open elements with their lines, outermost first.
    let mut open: Vec<(String, usize)> = Vec::new();
    let mut doc: Option<XDoc> = None;
    let mut gpu: Option<XGpu> = None;
    let mut tb: Option<XTb> = None;
    loop {
        let ev = match reader.read_event() {
            Ok(ev) => ev,
            Err(e) => {
                let line = line_of(xml, reader.error_position());
                return Err(ImportError::Xml { message: format!("line {line}: {e}") });
            }
        };
        match ev {
            Event::Start(ref e) | Event::Empty(ref e) => {
                let empty = matches!(ev, Event::Empty(_));
                let line = lines.of_tag_ending_at(reader.buffer_position());
                let name = String::from_utf8_lossy(e.name().as_ref()).into_owned();
                if let Some(parent) = parent_of(&name) {
                    // A second element of a kind would replace the first and drop what was read into it.
                    let repeated = |element: &'static str| -> Option<usize> {
                        open.iter().find(|(n, _)| n == element).map(|&(_, l)| l)
                    };
                    match name.as_str() {
                        "algo" => {
                            if let Some(first_line) = doc.as_ref().map(|d| d.line).or_else(|| repeated("algo")) {
                                return Err(ImportError::RepeatedElement { element: "algo", line, first_line });
                            }
                        }
                        "gpu" | "tb" => {
                            let element = if name == "gpu" { "gpu" } else { "tb" };
                            if let Some(first_line) = repeated(element) {
                                return Err(ImportError::RepeatedElement { element, line, first_line });
                            }
                        }
                        _ => {}
                    }
                    let actual = open.last().map(|(n, _)| n.as_str()).unwrap_or("");
                    if actual != parent {
                        return Err(ImportError::Misplaced {
                            element: name,
                            line,
                            parent: open.last().map(|(n, _)| n.clone()),
                        });
                    }
                    let a = Attrs::of(e, &name, line)?;
                    read_element(&a, line, &mut doc, &mut gpu, &mut tb)?;
                    if empty {
                        close_element(&name, &mut doc, &mut gpu, &mut tb);
                    }
                }
                if !empty {
                    open.push((name, line));
                }
            }
            Event::End(_) => {
                // quick-xml has checked the name matches the last open element.
                if let Some((name, _)) = open.pop() {
                    close_element(&name, &mut doc, &mut gpu, &mut tb);
                }
            }
            Event::Eof => break,
            _ => {}
        }
    }
    if let Some((element, line)) = open.pop() {
        return Err(ImportError::Unclosed { element, line });
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
                line: g.line,
            });
        }
    }
    if doc.gpus.len() as u64 != doc.ngpus as u64 {
        return Err(ImportError::BadAttribute {
            element: "algo".into(),
            attribute: "ngpus".into(),
            value: doc.ngpus.to_string(),
            context: format!("the file has {} <gpu> elements", doc.gpus.len()),
            line: doc.line,
        });
    }
    Ok(doc)
}

/// Reads a known element (its parent checked) into the document being built.
fn read_element(
    a: &Attrs,
    line: usize,
    doc: &mut Option<XDoc>,
    gpu: &mut Option<XGpu>,
    tb: &mut Option<XTb>,
) -> Result<(), ImportError> {
    match a.element.as_str() {
        "algo" => {
            let ctx = "in <algo>";
            let coll_name = a.get(&["coll"]).ok_or_else(|| ImportError::MissingAttribute {
                element: "algo".into(),
                attribute: "coll",
                context: ctx.into(),
                line,
            })?;
            let coll = Collective::parse(coll_name, None).map_err(|e| match e {
                ParseCollectiveError::NoRoot { .. } => {
                    ImportError::RootedCollective { name: coll_name.to_string(), line }
                }
                _ => ImportError::UnknownCollective { name: coll_name.to_string(), line },
            })?;
            *doc = Some(XDoc {
                name: a.get(&["name"]).unwrap_or("msccl").to_string(),
                line,
                proto: a.get(&["proto"]).map(str::to_string),
                coll,
                ngpus: a.nonneg(&["ngpus"], ctx, None)?,
                nchunks: a.opt_nonneg("nchunksperloop", ctx)?,
                inplace: a.flag("inplace", ctx)?,
                outofplace: a.flag("outofplace", ctx)?,
                gpus: Vec::new(),
            });
        }
        "gpu" => {
            let ctx = "in <gpu>";
            *gpu = Some(XGpu {
                id: a.nonneg(&["id"], ctx, None)?,
                line,
                i_chunks: a.opt_nonneg("i_chunks", ctx)?,
                o_chunks: a.opt_nonneg("o_chunks", ctx)?,
                s_chunks: a.nonneg(&["s_chunks"], ctx, Some(0))?,
                copies: Vec::new(),
                tbs: Vec::new(),
            });
        }
        "copy" => {
            let g = gpu.as_mut().expect("the parent <gpu> is open");
            let ctx = format!("in gpu {}", g.id);
            let i = a.nonneg(&["i_off", "srcoff"], &ctx, None)?;
            let o = a.nonneg(&["o_off", "dstoff"], &ctx, None)?;
            let cnt = a.nonneg(&["cnt"], &ctx, Some(1))?;
            if cnt == 0 {
                return Err(a.bad("cnt", "0", &ctx));
            }
            g.copies.push(XCopy { at: StepRef { gpu: g.id, tb: u32::MAX, step: u32::MAX, line }, i, o, cnt });
        }
        "tb" => {
            let g = gpu.as_ref().expect("the parent <gpu> is open");
            let ctx = format!("in gpu {}", g.id);
            *tb = Some(XTb {
                id: a.nonneg(&["id"], &ctx, None)?,
                line,
                send: a.int(&["send"], &ctx)?.unwrap_or(-1),
                recv: a.int(&["recv"], &ctx)?.unwrap_or(-1),
                chan: a.nonneg(&["chan"], &ctx, Some(0))?,
                steps: Vec::new(),
            });
        }
        _ => {
            // <step> or <op>
            let (g, t) = (gpu.as_ref().expect("<gpu> is open"), tb.as_mut().expect("the parent <tb> is open"));
            let s = a.nonneg(&["s", "step"], &format!("in gpu {} tb {}", g.id, t.id), None)?;
            let at = StepRef { gpu: g.id, tb: t.id, step: s, line };
            let ctx = format!("gpu {} tb {} step {}", g.id, t.id, s);
            if s as usize != t.steps.len() {
                return Err(a.bad(
                    "s",
                    &s.to_string(),
                    &format!("{ctx}: steps must be numbered 0, 1, ... in the order written"),
                ));
            }
            let ty = a.get(&["type"]).ok_or_else(|| ImportError::MissingAttribute {
                element: a.element.clone(),
                attribute: "type",
                context: ctx.clone(),
                line,
            })?;
            let kind = Kind::parse(ty).ok_or_else(|| ImportError::UnknownStepType { step: at, ty: ty.to_string() })?;
            // A location, or the name of its missing attribute (a buffer without an offset names the
            // offset); the newer format's shared `buf`/`off` stand in for both.
            let loc = |bk: &[&'static str], ok: &[&'static str]| -> Result<Loc, ImportError> {
                Ok(match (a.buffer(bk, &ctx)?, a.int(ok, &ctx)?) {
                    (Some(b), Some(o)) => Ok((b, o)),
                    (Some(_), None) => Err(ok[0]),
                    (None, _) => Err(bk[0]),
                })
            };
            let shared = loc(&["buf"], &["off"])?;
            let src = loc(&["srcbuf"], &["srcoff"])?.or_else(|missing| shared.map_err(|_| missing));
            let dst = loc(&["dstbuf"], &["dstoff"])?.or_else(|missing| shared.map_err(|_| missing));
            let cnt = a.nonneg(&["cnt"], &ctx, Some(1))?;
            if cnt == 0 && kind != Kind::Nop {
                return Err(a.bad("cnt", "0", &ctx));
            }
            let hasdep = match a.int(&["hasdep"], &ctx)? {
                None | Some(0) => false,
                Some(1) => true,
                Some(v) => return Err(a.bad("hasdep", &v.to_string(), &ctx)),
            };
            t.steps.push(XStep {
                at,
                kind,
                src,
                dst,
                cnt,
                depid: a.int(&["depid"], &ctx)?.unwrap_or(-1),
                deps: a.int(&["deps"], &ctx)?.unwrap_or(-1),
                hasdep,
            });
        }
    }
    Ok(())
}

/// Ends a known element: a TB joins its GPU, a GPU its algorithm.
fn close_element(name: &str, doc: &mut Option<XDoc>, gpu: &mut Option<XGpu>, tb: &mut Option<XTb>) {
    match name {
        "tb" => {
            if let (Some(t), Some(g)) = (tb.take(), gpu.as_mut()) {
                g.tbs.push(t);
            }
        }
        "gpu" => {
            if let (Some(g), Some(d)) = (gpu.take(), doc.as_mut()) {
                d.gpus.push(g);
            }
        }
        _ => {}
    }
}

// ---------------------------------------------------------------------------------------------
// 2.-5. Grouping, splitting, matching, linearizing
// ---------------------------------------------------------------------------------------------

/// MSCCL fuses at most this many `re` steps of a TB (`MSCCL_MAX_REDUCE_FUSION`; its parser compares
/// the TB's running count of `re` steps with it).
const MAX_REDUCE_FUSION: u32 = 16;

/// The most work (vector-clock entries updated) the data-race check may do: about a second.
const MAX_RACE_CHECK_WORK: u128 = 1 << 31;

/// How `rrs` steps are imported.
#[derive(Copy, Clone, PartialEq, Eq, Debug)]
enum RrsForm {
    /// As MSCCL runs them: the source is copied to fresh scratch, the received data reduced into
    /// that and sent from there; no chunk of the file's buffers is written.
    Scratch,
    /// Reduced into the source and sent from there, where the source is scratch or an output chunk
    /// (kept only when the program computes the collective too: see [`import`]).
    InPlace,
}

/// A step as MSCCL's parser leaves it: with the dependencies it waits for (its own and those of the
/// `nop`s before it) and the flag it publishes when done.
struct RtStep<'a> {
    st: &'a XStep,
    /// The TB, an index into the TB table.
    tb: usize,
    /// (TB id waited on, flag waited for, the step the dependency is written on).
    waits: Vec<(i64, i64, StepRef)>,
    /// The flag the step publishes (`hasdep="1"`): MSCCL's counter for it.
    signal: Option<i64>,
}

/// A TB of the file.
struct TbInfo {
    gpu: u32,
    id: u32,
    send: i64,
    recv: i64,
    chan: u32,
    /// Its steps are `first..first + len` of the step table.
    first: usize,
}

/// Groups one TB's steps as MSCCL's parser does: `nop`s hand their dependencies on, fused `re`
/// runs share their first step's, and the counter that flags publish advances.
fn group_steps<'a>(t: &'a XTb, tb: usize, rt: &mut Vec<RtStep<'a>>) -> Result<(), ImportError> {
    let mut pending: Vec<(i64, i64, StepRef)> = Vec::new();
    // MSCCL's `step` counter before the next transfer.
    let mut counter: i64 = 0;
    // The `re` run the next `re` may join: (dst buffer, dst offset, src buffer, cnt, first step).
    let mut run: Option<(BufferKind, i64, BufferKind, u32, StepRef)> = None;
    let mut reductions = 0u32;
    for st in &t.steps {
        if st.depid >= 0 {
            pending.push((st.depid, st.deps, st.at));
        }
        if st.kind == Kind::Nop {
            continue;
        }
        let mut joined = None;
        if st.kind == Kind::Reduce {
            let (sb, _) = st.src.map_err(|attribute| missing(st.at, attribute))?;
            let (db, doff) = st.dst.map_err(|attribute| missing(st.at, attribute))?;
            if let Some((rb, roff, rsb, rcnt, first)) = run
                && st.depid == -1
                && (rb, roff, rsb) == (db, doff, sb)
            {
                if st.cnt != rcnt {
                    return Err(ImportError::FusedCount { step: st.at, first });
                }
                joined = Some(first);
            }
            reductions += 1;
            run = if st.hasdep || reductions == MAX_REDUCE_FUSION {
                None
            } else {
                Some((db, doff, sb, st.cnt, joined.unwrap_or(st.at)))
            };
        } else {
            run = None;
        }
        let waits = if joined.is_some() { Vec::new() } else { std::mem::take(&mut pending) };
        if let Some(&(_, _, nop)) = waits.first() {
            if st.depid < 0 {
                return Err(ImportError::DanglingDependency { step: st.at, nop });
            }
            counter += waits.len() as i64 - 1;
        }
        let signal = st.hasdep.then_some(counter);
        counter += 1;
        rt.push(RtStep { st, tb, waits, signal });
    }
    // The dependencies of `nop`s that end the TB go nowhere, as in MSCCL.
    Ok(())
}

fn missing(at: StepRef, attribute: &'static str) -> ImportError {
    ImportError::MissingAttribute { element: "step".into(), attribute, context: at.to_string(), line: at.line }
}

/// A primitive part of a step.
#[derive(Copy, Clone, Debug)]
enum Part {
    Send {
        slice: Slice,
    },
    Recv {
        slice: Slice,
        reduce: bool,
    },
    Copy {
        src: Slice,
        dst: Slice,
    },
    Reduce {
        src: Slice,
        dst: Slice,
    },
    /// A copy onto itself: no op, but MSCCL reads the chunks and writes them back, which a concurrent
    /// write would race with (a concurrent read would not: the value stays), so the race check sees it
    /// as a read.
    Touch {
        slice: Slice,
    },
}

/// One read or write of a slice by an op, at a position of the happens-before order (`sub` orders
/// accesses at the same position), made by step `step` of the step table (`usize::MAX`: a TACCL
/// pre-copy, which runs before every step).
#[derive(Copy, Clone, Debug)]
struct Access {
    pos: usize,
    sub: u8,
    op: usize,
    step: usize,
    rank: u32,
    slice: Slice,
    write: bool,
    read: bool,
}

/// Start of each rank's storage in one flat array, and the total.
fn storage_bases(layout: &BufferLayout) -> (Vec<usize>, usize) {
    let mut base = Vec::with_capacity(layout.ranks as usize + 1);
    let mut acc = 0usize;
    base.push(0);
    for r in 0..layout.ranks {
        acc += layout.storage_chunks(Rank(r)) as usize;
        base.push(acc);
    }
    (base, acc)
}

/// No reader: the end of a run's list of readers.
const NO_READER: u32 = u32::MAX;

/// What the accesses so far left on a run of locations: the last writer (`usize::MAX`: none) and
/// the readers since, as keys (ops or steps): a list in [`walk_conflicts`]'s arena, newest first,
/// whose tail runs split from one another share (a split costs nothing, however many readers).
#[derive(Copy, Clone, Debug)]
struct RunState {
    writer: usize,
    readers: u32,
}

/// The most work [`walk_conflicts`] may do (runs visited, readers listed, conflicts reported): a
/// second or so. A file of few steps can ask for far more: every one of many reads of a chunk
/// conflicts with every one of many later writes of it.
const MAX_WALK_WORK: u64 = 1 << 27;

/// Walks `accesses` (sorted by position) and calls `conflict(earlier, access)` for every earlier
/// access's key that conflicts with `access` on some chunk: the chunk's last writer, and for a
/// write, its readers since (read-after-write, write-after-write, write-after-read). Keys equal to
/// the access's own are skipped.
///
/// The locations `0..total` are kept as runs in one state, keyed by their first location. An
/// access splits at most the two runs at its ends and visits the runs it spans. The chunks accessed
/// are held to [`Program::MAX_CHUNK_ACCESSES`] and the whole walk to [`MAX_WALK_WORK`]
/// ([`ImportError::TooLarge`]), so that no file makes it run long or hold much memory.
fn walk_conflicts(
    layout: &BufferLayout,
    base: &[usize],
    total: usize,
    accesses: &[Access],
    key: impl Fn(&Access) -> usize,
    mut conflict: impl FnMut(usize, &Access),
) -> Result<(), ImportError> {
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
    let too_much = || ImportError::TooLarge {
        reason: format!(
            "ordering the steps' {} accesses takes more than {MAX_WALK_WORK} steps of work (many reads and writes of the same chunks)",
            accesses.len()
        ),
    };
    // Reader lists: (key, next), each list newest first.
    let mut readers: Vec<(usize, u32)> = Vec::new();
    let mut work = 0u64;
    let mut runs: BTreeMap<usize, RunState> = BTreeMap::new();
    runs.insert(0, RunState { writer: usize::MAX, readers: NO_READER });
    let split = |runs: &mut BTreeMap<usize, RunState>, at: usize| {
        if at < total && !runs.contains_key(&at) {
            let (_, &run) = runs.range(..at).next_back().expect("runs tile 0..total");
            runs.insert(at, run);
        }
    };
    for a in accesses {
        let (id, rank) = (key(a), Rank(a.rank));
        let start = layout.resolve(rank, a.slice).expect("every access was resolved when it was made");
        let lo = base[rank.index()] + start as usize;
        let hi = lo + a.slice.count as usize;
        split(&mut runs, lo);
        split(&mut runs, hi);
        // Every chunk of a run is in the same state, so it gives the same conflicts as the run.
        for run in runs.range_mut(lo..hi).map(|(_, r)| r) {
            work += 1;
            if run.writer != usize::MAX && run.writer != id {
                conflict(run.writer, a);
            }
            if a.write {
                let mut r = run.readers;
                while r != NO_READER {
                    let (rd, next) = readers[r as usize];
                    if rd != id {
                        conflict(rd, a);
                    }
                    work += 1;
                    r = next;
                }
            } else if a.read {
                if readers.len() >= NO_READER as usize {
                    return Err(too_much());
                }
                readers.push((id, run.readers));
                run.readers = (readers.len() - 1) as u32;
            }
            if work > MAX_WALK_WORK {
                return Err(too_much());
            }
        }
        if a.write {
            // The written locations are one run again: written by this access, not read since.
            let inner: Vec<usize> = runs.range(lo + 1..hi).map(|(&k, _)| k).collect();
            for k in inner {
                runs.remove(&k);
            }
            runs.insert(lo, RunState { writer: id, readers: NO_READER });
        }
    }
    Ok(())
}

/// Data-hazard successors of each of `ops` ops, from `accesses` sorted by position.
fn hazard_edges(
    layout: &BufferLayout,
    base: &[usize],
    total: usize,
    ops: usize,
    accesses: &[Access],
) -> Result<Vec<Vec<usize>>, ImportError> {
    let mut op_succ: Vec<Vec<usize>> = vec![Vec::new(); ops];
    walk_conflicts(
        layout,
        base,
        total,
        accesses,
        |a| a.op,
        |w, a| {
            if op_succ[w].last() != Some(&a.op) {
                op_succ[w].push(a.op);
            }
        },
    )?;
    for s in op_succ.iter_mut() {
        s.sort_unstable();
        s.dedup();
    }
    Ok(op_succ)
}

/// Refuses data races: every pair of conflicting accesses by steps of different TBs must be
/// ordered by happens-before (`preds`: each step's predecessors other than the one before it in its
/// TB; `order`: a topological order of the steps).
///
/// Conflicting pairs come from [`walk_conflicts`] (each access against the chunk's last writer and,
/// for a write, the readers since: every conflicting pair is then ordered through those). Whether a
/// step happens before another is read off vector clocks over the TBs (entry `t` of a step's clock:
/// how many steps of TB `t` happen before it or are it), computed along `order` for a group of
/// source TBs at a time so that the clocks fit in a bounded table.
#[allow(clippy::too_many_arguments)]
fn check_races(
    layout: &BufferLayout,
    base: &[usize],
    total: usize,
    accesses: &[Access],
    rt: &[RtStep<'_>],
    tbs: &[TbInfo],
    preds: &[Vec<usize>],
    order: &[usize],
) -> Result<(), ImportError> {
    // (earlier step, later step) → the later access's rank and slice, for the error.
    let mut pairs: Vec<(usize, usize, u32, Slice)> = Vec::new();
    let mut seen: HashSet<(usize, usize)> = HashSet::new();
    walk_conflicts(
        layout,
        base,
        total,
        accesses,
        |a| a.step,
        |x, a| {
            let y = a.step;
            if x != usize::MAX && y != usize::MAX && rt[x].tb != rt[y].tb && seen.insert((x, y)) {
                pairs.push((x, y, a.rank, a.slice));
            }
        },
    )?;
    if pairs.is_empty() {
        return Ok(());
    }
    let race = |&(x, y, rank, slice): &(usize, usize, u32, Slice)| ImportError::Race {
        first: rt[x].st.at,
        second: rt[y].st.at,
        rank,
        slice,
    };
    // The TBs that are the earlier side of a pair, numbered densely.
    let mut dense = vec![u32::MAX; tbs.len()];
    let mut sources = 0usize;
    for &(x, ..) in &pairs {
        let t = rt[x].tb;
        if dense[t] == u32::MAX {
            dense[t] = sources as u32;
            sources += 1;
        }
    }
    let mut by_target: Vec<Vec<usize>> = vec![Vec::new(); rt.len()];
    for (k, &(_, y, ..)) in pairs.iter().enumerate() {
        by_target[y].push(k);
    }
    // Snapshots are kept of the clocks of steps that other steps depend on.
    let mut snap_of = vec![u32::MAX; rt.len()];
    let mut snaps = 0usize;
    for p in preds.iter().flatten() {
        if snap_of[*p] == u32::MAX {
            snap_of[*p] = snaps as u32;
            snaps += 1;
        }
    }
    let cross: usize = preds.iter().map(Vec::len).sum();
    let width = ((1usize << 22) / (tbs.len() + snaps).max(1)).clamp(1, sources);
    let passes = sources.div_ceil(width);
    let work = passes as u128 * (rt.len() + (tbs.len() + cross + snaps) * width) as u128;
    if work > MAX_RACE_CHECK_WORK {
        return Err(ImportError::TooLarge {
            reason: format!(
                "checking {} steps of {} thread blocks for data races takes about {work} clock updates, more than the {MAX_RACE_CHECK_WORK} allowed",
                rt.len(),
                tbs.len()
            ),
        });
    }
    let index_in_tb = |s: usize| (s - tbs[rt[s].tb].first) as u32 + 1;
    for pass in 0..passes {
        let (lo, hi) = (pass * width, ((pass + 1) * width).min(sources));
        let w = hi - lo;
        let mut clock = vec![0u32; tbs.len() * w];
        let mut snap = vec![0u32; snaps * w];
        for &y in order {
            let t = rt[y].tb;
            let own = &mut clock[t * w..(t + 1) * w];
            for &p in &preds[y] {
                let s = snap_of[p] as usize;
                for (c, &v) in own.iter_mut().zip(&snap[s * w..(s + 1) * w]) {
                    *c = (*c).max(v);
                }
            }
            let d = dense[t] as usize;
            if (lo..hi).contains(&d) {
                own[d - lo] = index_in_tb(y);
            }
            for &k in &by_target[y] {
                let x = pairs[k].0;
                let dx = dense[rt[x].tb] as usize;
                if (lo..hi).contains(&dx) && own[dx - lo] < index_in_tb(x) {
                    return Err(race(&pairs[k]));
                }
            }
            if snap_of[y] != u32::MAX {
                let s = snap_of[y] as usize;
                snap[s * w..(s + 1) * w].copy_from_slice(own);
            }
        }
    }
    Ok(())
}

/// Imports `doc` in one placement with `rrs` steps in `form`; also says whether any `rrs` step could
/// take the other form (its source is scratch or an output chunk).
fn lower(doc: &XDoc, in_place: bool, form: RrsForm, claims: Placements) -> Result<(Imported, bool), ImportError> {
    let n = doc.ngpus;
    let chunks = doc.nchunks.unwrap_or_else(|| {
        doc.gpus.iter().map(|g| g.i_chunks.unwrap_or(0).max(g.o_chunks.unwrap_or(0))).max().unwrap_or(0)
    });
    // The buffers as the file declares them; `layout` grows scratch for `rrs` steps and snapshots.
    let mut file_layout = BufferLayout::new(doc.coll, n, chunks, in_place);
    file_layout.scratch = doc.gpus.iter().map(|g| g.s_chunks).collect();
    file_layout.validate_imported().map_err(|e| ImportError::Invalid { step: None, error: e })?;
    for g in &doc.gpus {
        for (attribute, declared, limit) in [
            ("i_chunks", g.i_chunks, file_layout.input_chunks()),
            ("o_chunks", g.o_chunks, file_layout.output_chunks()),
        ] {
            if let Some(declared) = declared
                && declared > limit
            {
                return Err(ImportError::DeclaredChunks { gpu: g.id, line: g.line, attribute, declared, limit });
            }
        }
    }
    let mut layout = file_layout.clone();

    // 2. Group steps per TB, TBs of a GPU in id order.
    let mut rt: Vec<RtStep<'_>> = Vec::new();
    let mut tbs: Vec<TbInfo> = Vec::new();
    let mut tb_index: HashMap<(u32, u32), usize> = HashMap::new();
    for g in &doc.gpus {
        let mut sorted: Vec<&XTb> = g.tbs.iter().collect();
        sorted.sort_by_key(|t| t.id);
        for t in sorted {
            if tb_index.insert((g.id, t.id), tbs.len()).is_some() {
                return Err(ImportError::BadAttribute {
                    element: "tb".into(),
                    attribute: "id".into(),
                    value: t.id.to_string(),
                    context: format!("gpu {}: repeated tb id", g.id),
                    line: t.line,
                });
            }
            let first = rt.len();
            group_steps(t, tbs.len(), &mut rt)?;
            tbs.push(TbInfo { gpu: g.id, id: t.id, send: t.send, recv: t.recv, chan: t.chan, first });
        }
    }
    let ns = rt.len();
    // Happens-before: each step's successors.
    let mut succ: Vec<Vec<usize>> = vec![Vec::new(); ns];
    for i in 1..ns {
        if rt[i].tb == rt[i - 1].tb {
            succ[i - 1].push(i);
        }
    }
    // Each dependency is released by the first step of its TB that publishes a flag at least as
    // large: flags grow along a TB, so a binary search finds it.
    let mut signals: Vec<Vec<(i64, usize)>> = vec![Vec::new(); tbs.len()];
    for (i, s) in rt.iter().enumerate() {
        if let Some(v) = s.signal {
            signals[s.tb].push((v, i));
        }
    }
    for i in 0..ns {
        let gpu = tbs[rt[i].tb].gpu;
        for &(depid, deps, from) in &rt[i].waits {
            let bad = ImportError::BadDependency { step: from, depid, deps };
            let (Ok(dt), true) = (u32::try_from(depid), deps >= 0) else { return Err(bad) };
            let &t = tb_index.get(&(gpu, dt)).ok_or(bad)?;
            let k = signals[t].partition_point(|&(v, _)| v < deps);
            let &(_, release) = signals[t].get(k).ok_or(ImportError::NeverSignalled { step: from, depid: dt, deps })?;
            succ[release].push(i);
        }
    }

    // 3. Split steps into parts with MSCCL's meaning.
    let mut candidates = false;
    let mut parts: Vec<Vec<Part>> = Vec::with_capacity(ns);
    for (i, s) in rt.iter().enumerate() {
        let (st, g) = (s.st, &doc.gpus[tbs[s.tb].gpu as usize]);
        let rank = Rank(g.id);
        let operand = |loc: Loc, which: &'static str| -> Result<(Slice, u32), ImportError> {
            let (b, off) = loc.map_err(|attribute| missing(st.at, attribute))?;
            let off = u32::try_from(off).map_err(|_| ImportError::BadAttribute {
                element: "step".into(),
                attribute: format!("{which}off"),
                value: off.to_string(),
                context: st.at.to_string(),
                line: st.at.line,
            })?;
            let slice = Slice::new(b, off, st.cnt);
            let flat = file_layout.resolve(rank, slice).ok_or_else(|| ImportError::Invalid {
                step: Some(st.at),
                error: ProgramError::SliceOutOfRange {
                    op: super::OpId::new(i),
                    rank,
                    slice,
                    buffer_chunks: file_layout.buffer_chunks(rank, b),
                },
            })?;
            let declared = match b {
                BufferKind::Input => g.i_chunks.map(|d| ("i_chunks", d)),
                BufferKind::Output => g.o_chunks.map(|d| ("o_chunks", d)),
                BufferKind::Scratch => None,
            };
            if let Some((attribute, declared)) = declared
                && slice.end() > declared as u64
            {
                return Err(ImportError::BeyondDeclared { step: st.at, attribute, declared, slice });
            }
            Ok((slice, flat))
        };
        let src = if st.kind.uses_src() { Some(operand(st.src, "src")?) } else { None };
        let dst = if st.kind.uses_dst() { Some(operand(st.dst, "dst")?) } else { None };
        let cnt = st.cnt;
        let overlap = |a: u32, b: u32| a < b + cnt && b < a + cnt;
        // Whether the final value of a chunk is user-visible only through the postcondition: scratch
        // and output chunks (an input chunk out of place is the caller's, never written here).
        let writable = |(slice, flat): (Slice, u32)| {
            let out = file_layout.buffer_base(rank, BufferKind::Output);
            slice.buffer == BufferKind::Scratch
                || (flat >= out && flat as u64 + cnt as u64 <= out as u64 + file_layout.output_chunks() as u64)
        };
        let mut p = Vec::with_capacity(3);
        match st.kind {
            Kind::Nop => unreachable!("nops are not steps of the table"),
            Kind::Send => p.push(Part::Send { slice: src.expect("used").0 }),
            Kind::Recv => p.push(Part::Recv { slice: dst.expect("used").0, reduce: false }),
            Kind::RecvCopySend => {
                let d = dst.expect("used").0;
                p.push(Part::Recv { slice: d, reduce: false });
                p.push(Part::Send { slice: d });
            }
            Kind::RecvReduceSend => {
                let src = src.expect("used");
                candidates |= writable(src);
                let acc = if form == RrsForm::InPlace && writable(src) {
                    src.0
                } else {
                    // Fresh scratch of its own: MSCCL writes no chunk of the file's buffers here.
                    let r = rank.index();
                    let tmp = Slice::new(BufferKind::Scratch, layout.scratch[r], cnt);
                    layout.scratch[r] = layout.scratch[r].checked_add(cnt).ok_or_else(|| ImportError::TooLarge {
                        reason: format!("the rrs steps of gpu {} need more than 2^32 scratch chunks", g.id),
                    })?;
                    p.push(Part::Copy { src: src.0, dst: tmp });
                    tmp
                };
                p.push(Part::Recv { slice: acc, reduce: true });
                p.push(Part::Send { slice: acc });
            }
            Kind::RecvReduceCopy | Kind::RecvReduceCopySend => {
                let (s, d) = (src.expect("used"), dst.expect("used"));
                if s.1 != d.1 {
                    if overlap(s.1, d.1) {
                        return Err(ImportError::OverlappingOperands { step: st.at });
                    }
                    p.push(Part::Copy { src: s.0, dst: d.0 });
                }
                p.push(Part::Recv { slice: d.0, reduce: true });
                if st.kind == Kind::RecvReduceCopySend {
                    p.push(Part::Send { slice: d.0 });
                }
            }
            Kind::Copy => {
                let (s, d) = (src.expect("used"), dst.expect("used"));
                if s.1 == d.1 {
                    p.push(Part::Touch { slice: d.0 });
                } else if overlap(s.1, d.1) {
                    return Err(ImportError::OverlappingOperands { step: st.at });
                } else {
                    p.push(Part::Copy { src: s.0, dst: d.0 });
                }
            }
            Kind::Reduce => {
                let (s, d) = (src.expect("used"), dst.expect("used"));
                if overlap(s.1, d.1) {
                    return Err(ImportError::OverlappingOperands { step: st.at });
                }
                p.push(Part::Reduce { src: s.0, dst: d.0 });
            }
        }
        parts.push(p);
    }
    // The scratch of `rrs` steps is held to the imported-layout limits before anything is sized by it.
    if let Err(e) = layout.validate_imported() {
        return Err(ImportError::TooLarge { reason: format!("with scratch for its rrs steps: {e}") });
    }

    // 4. Connections: FIFO matching per (src, dst, channel).
    type ConnKey = (u32, u32, u32);
    let mut send_tb: HashMap<ConnKey, u32> = HashMap::new();
    let mut recv_tb: HashMap<ConnKey, u32> = HashMap::new();
    // Per connection, its sends and its receives in FIFO order: (step, part index).
    let mut sends: HashMap<ConnKey, Vec<(usize, usize)>> = HashMap::new();
    let mut recvs: HashMap<ConnKey, Vec<(usize, usize)>> = HashMap::new();
    for (i, s) in rt.iter().enumerate() {
        let t = &tbs[s.tb];
        for (k, part) in parts[i].iter().enumerate() {
            let (peer, dir) = match part {
                Part::Send { .. } => (t.send, "send"),
                Part::Recv { .. } => (t.recv, "recv"),
                _ => continue,
            };
            if peer < 0 || peer >= n as i64 || peer == t.gpu as i64 {
                return Err(ImportError::BadPeer { step: s.st.at, direction: dir, peer });
            }
            let peer = peer as u32;
            let (key, owners, list) = if dir == "send" {
                ((t.gpu, peer, t.chan), &mut send_tb, &mut sends)
            } else {
                ((peer, t.gpu, t.chan), &mut recv_tb, &mut recvs)
            };
            let owner = *owners.entry(key).or_insert(t.id);
            if owner != t.id {
                return Err(ImportError::DuplicateConnection {
                    gpu: t.gpu,
                    peer,
                    channel: t.chan,
                    direction: dir,
                    tbs: (owner.min(t.id), owner.max(t.id)),
                });
            }
            list.entry(key).or_default().push((i, k));
        }
    }
    // send_match[(step, part)] = (receiving step, part).
    let mut send_match: HashMap<(usize, usize), (usize, usize)> = HashMap::new();
    let mut keys: Vec<&ConnKey> = sends.keys().chain(recvs.keys()).collect();
    keys.sort();
    keys.dedup();
    for key in keys {
        let s = sends.get(key).map(Vec::as_slice).unwrap_or(&[]);
        let r = recvs.get(key).map(Vec::as_slice).unwrap_or(&[]);
        for (j, &(si, sk)) in s.iter().enumerate() {
            let Some(&(ri, rk)) = r.get(j) else {
                return Err(ImportError::UnmatchedSend { step: rt[si].st.at, dst: key.1, channel: key.2 });
            };
            let (Part::Send { slice: a }, Part::Recv { slice: b, .. }) = (parts[si][sk], parts[ri][rk]) else {
                unreachable!("lists hold sends and receives");
            };
            if a.count != b.count {
                return Err(ImportError::CountMismatch {
                    send: rt[si].st.at,
                    recv: rt[ri].st.at,
                    send_count: a.count,
                    recv_count: b.count,
                });
            }
            succ[si].push(ri);
            send_match.insert((si, sk), (ri, rk));
        }
        if r.len() > s.len() {
            let (ri, _) = r[s.len()];
            return Err(ImportError::UnmatchedRecv { step: rt[ri].st.at, src: key.0, channel: key.2 });
        }
    }

    // Topological order of steps (Kahn, smallest index first: deterministic).
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
        return Err(ImportError::Cycle { step: rt[stuck].st.at });
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
        let rank = Rank(g.id);
        for c in &g.copies {
            let (src, dst) = (Slice::new(BufferKind::Input, c.i, c.cnt), Slice::new(BufferKind::Output, c.o, c.cnt));
            let resolve = |slice: Slice| {
                file_layout.resolve(rank, slice).ok_or_else(|| ImportError::Invalid {
                    step: Some(c.at),
                    error: ProgramError::SliceOutOfRange {
                        op: super::OpId::new(ops.len()),
                        rank,
                        slice,
                        buffer_chunks: file_layout.buffer_chunks(rank, slice.buffer),
                    },
                })
            };
            let (a, b) = (resolve(src)?, resolve(dst)?);
            if a == b {
                continue; // A copy onto itself (input and output alias in place).
            }
            if a < b + c.cnt && b < a + c.cnt {
                return Err(ImportError::OverlappingOperands { step: c.at });
            }
            let id = ops.len();
            ops.push(Pending {
                op: Op { kind: OpKind::Copy { rank, channel: 0, src, dst }, chunk: 0, step: 0, stage: 0 },
                origin: c.at,
                first_pos: pos,
            });
            let access =
                |slice, write| Access { pos, sub: 0, op: id, step: usize::MAX, rank: g.id, slice, write, read: !write };
            accesses.push(access(src, false));
            accesses.push(access(dst, true));
            pos += 1;
        }
    }
    let mut op_of_recv: HashMap<(usize, usize), usize> = HashMap::new();
    // Accesses of copies onto themselves, which only the race check sees.
    let mut touches: Vec<Access> = Vec::new();
    for &i in &order {
        let (s, t) = (&rt[i], &tbs[rt[i].tb]);
        let rank = t.gpu;
        for (k, part) in parts[i].iter().enumerate() {
            let access = |op, slice, write, read| Access { pos, sub: 0, op, step: i, rank, slice, write, read };
            match *part {
                Part::Send { slice } => {
                    let (ri, rk) = send_match[&(i, k)];
                    let Part::Recv { slice: dst, reduce } = parts[ri][rk] else { unreachable!() };
                    let id = ops.len();
                    ops.push(Pending {
                        op: Op {
                            kind: OpKind::Transfer {
                                src_rank: Rank(rank),
                                dst_rank: Rank(tbs[rt[ri].tb].gpu),
                                channel: t.chan,
                                src: slice,
                                dst,
                                op: if reduce { RecvOp::RecvReduceCopy } else { RecvOp::Recv },
                            },
                            chunk: 0,
                            step: 0,
                            stage: 0,
                        },
                        origin: s.st.at,
                        first_pos: pos,
                    });
                    op_of_recv.insert((ri, rk), id);
                    accesses.push(access(id, slice, false, true));
                }
                Part::Recv { slice, reduce } => {
                    let id = op_of_recv[&(i, k)];
                    accesses.push(access(id, slice, true, reduce));
                }
                Part::Touch { slice } => touches.push(access(usize::MAX, slice, false, true)),
                Part::Copy { src, dst } | Part::Reduce { src, dst } => {
                    let reduce = matches!(part, Part::Reduce { .. });
                    let (rank, channel) = (Rank(rank), t.chan);
                    let kind = if reduce {
                        OpKind::Reduce { rank, channel, src, dst }
                    } else {
                        OpKind::Copy { rank, channel, src, dst }
                    };
                    let id = ops.len();
                    ops.push(Pending { op: Op { kind, chunk: 0, step: 0, stage: 0 }, origin: s.st.at, first_pos: pos });
                    accesses.push(access(id, src, false, true));
                    accesses.push(access(id, dst, true, reduce));
                }
            }
            pos += 1;
        }
    }
    accesses.sort_by_key(|a| (a.pos, a.sub));

    // Data races, on the file's own accesses (the cheaper `rrs` form writes where MSCCL does not:
    // it is checked by the postcondition instead).
    if form == RrsForm::Scratch {
        let mut preds: Vec<Vec<usize>> = vec![Vec::new(); ns];
        for (a, s) in succ.iter().enumerate() {
            for &b in s {
                if !(b == a + 1 && rt[a].tb == rt[b].tb) {
                    preds[b].push(a);
                }
            }
        }
        let (base, total) = storage_bases(&layout);
        let mut all = accesses.clone();
        all.append(&mut touches);
        all.sort_by_key(|a| (a.pos, a.sub));
        check_races(&layout, &base, total, &all, &rt, &tbs, &preds, &order)?;
    }
    // Linearize by data hazards. A cycle means a buffered exchange (a send whose source is
    // overwritten before the matching receive happens, on both sides): snapshot those sends'
    // sources into fresh scratch at the send position, which makes every transfer atomic, and retry.
    // Each round's scratch is held to `BufferLayout::validate_imported`'s limits before the next round
    // sizes its tables by it: a small file of wide exchanges would otherwise grow it without bound.
    let mut snapshotted = vec![false; ops.len()];
    let (op_order, level, base, acc) = loop {
        let (base, acc) = storage_bases(&layout);
        accesses.sort_by_key(|a| (a.pos, a.sub));
        let op_succ = hazard_edges(&layout, &base, acc, ops.len(), &accesses)?;
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
        // Where each transfer reads its source among the (sorted) accesses.
        let mut read_of = vec![usize::MAX; ops.len()];
        for (j, a) in accesses.iter().enumerate() {
            if !a.write && ops[a.op].op.is_transfer() {
                read_of[a.op] = j;
            }
        }
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
            let read_at = read_of[x];
            let read = &mut accesses[read_at];
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
            let step = accesses[read_at].step;
            accesses.push(Access { pos, sub: 0, op: id, step, rank: src_rank.0, slice: src, write: false, read: true });
            accesses.push(Access {
                pos,
                sub: 0,
                op: id,
                step,
                rank: src_rank.0,
                slice: snap,
                write: true,
                read: false,
            });
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
    Ok((Imported { program, origin, proto: doc.proto.clone(), file_name, placements: claims }, candidates))
}
