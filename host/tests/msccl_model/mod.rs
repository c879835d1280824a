//! An MSCCL interpreter for the differential tests, written from MSCCL's runtime and sharing no code
//! with the importer (`oxccl_host::program::msccl`): it runs a file the way MSCCL's kernel would,
//! on concrete numbers, and says whether the file is the collective it names.
//!
//! What it follows, from msccl-executor-nccl (RCCL carries the same code):
//!
//! - the parser `mscclGetAlgoFromXmlFile`: per thread block, steps become *transmissions* in the
//!   order written; a `nop` adds its dependency to a running list that the next transmission takes
//!   (and must have one of its own, or the file is refused); a `re` whose destination and source
//!   buffer match the previous `re`'s and that has no dependency joins it (`numReductions`), until
//!   a `re` with `hasdep` or the thread block's 16th `re`;
//! - the kernel `mscclRunInterpreter`: a thread block runs its transmissions in order, first waiting
//!   for each dependency `(bid, step)` until thread block `bid`'s flag is at least `step`, adding the
//!   number of dependencies less one to its step counter, running the primitive (a fused reduction
//!   adds its reductions less one), publishing the counter as its flag when `hasDependence`, and
//!   counting one on;
//! - the primitives: `send(src)`, `recv(dst)`, `recvCopySend(dst)`, `recvReduceSend(src)`,
//!   `recvReduceCopy(src, dst)`, `recvReduceCopySend(src, dst)`, `localCopy(src, dst)` and the
//!   reduction loop `dst = dst ⊕ src₁ ⊕ …`, over connections that are FIFOs per (sender, receiver,
//!   channel), taken as unbounded.
//!
//! On top of that, the acceptance rules the importer's documentation states: the structure rules
//! (placement of elements, attributes, numbering, declared sizes, overlapping operands), no hang,
//! no message left over, no data race (checked with vector clocks along the run; a thread block
//! waiting on a flag is ordered after the *first* publication that satisfies it, which is all MSCCL
//! guarantees, so the check does not depend on the schedule), and outputs equal to the collective's
//! for every placement the file claims.

#![allow(dead_code)]

use quick_xml::Reader;
use quick_xml::events::Event;
use std::collections::{HashMap, VecDeque};

/// What the interpreter concludes about a file.
#[derive(Clone, Debug, PartialEq)]
pub enum Verdict {
    /// The file is its collective in every placement it claims. `outputs` are each rank's output
    /// buffer (`output chunks × len` elements) of the run in `in_place`'s placement (in place where
    /// claimed) on `inputs`.
    Accepted { in_place: bool, inputs: Vec<Vec<i64>>, outputs: Vec<Vec<i64>> },
    /// Why not.
    Refused(String),
}

type R<T> = Result<T, String>;

// ---------------------------------------------------------------------------------------------
// Reading
// ---------------------------------------------------------------------------------------------

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Buf {
    I,
    O,
    S,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Ty {
    Nop,
    S,
    R,
    Rcs,
    Rrs,
    Rrc,
    Rrcs,
    Cpy,
    Re,
}

#[derive(Clone, Debug)]
struct Step {
    line: usize,
    ty: Ty,
    /// (buffer, offset), or None when not given.
    src: Option<(Buf, i64)>,
    dst: Option<(Buf, i64)>,
    cnt: u32,
    depid: i64,
    deps: i64,
    hasdep: bool,
}

#[derive(Clone, Debug)]
struct Tb {
    id: u32,
    send: i64,
    recv: i64,
    chan: u32,
    steps: Vec<Step>,
}

#[derive(Clone, Debug)]
struct Gpu {
    id: u32,
    i_chunks: Option<u32>,
    o_chunks: Option<u32>,
    s_chunks: u32,
    copies: Vec<(u32, u32, u32)>,
    tbs: Vec<Tb>,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Coll {
    AllReduce,
    AllGather,
    ReduceScatter,
    AllToAll,
}

#[derive(Clone, Debug)]
struct Algo {
    coll: Coll,
    ngpus: u32,
    nchunks: Option<u32>,
    inplace: Option<bool>,
    outofplace: Option<bool>,
    gpus: Vec<Gpu>,
}

struct Attrs(HashMap<String, String>);

impl Attrs {
    fn s(&self, k: &str) -> Option<&str> {
        self.0.get(k).map(|v| v.trim())
    }
    fn i(&self, k: &str) -> R<Option<i64>> {
        match self.s(k) {
            None => Ok(None),
            Some(v) => v.parse::<i64>().map(Some).map_err(|_| format!("`{k}`: not an integer")),
        }
    }
    fn u(&self, k: &str) -> R<Option<u32>> {
        match self.i(k)? {
            None => Ok(None),
            Some(v) => u32::try_from(v).map(Some).map_err(|_| format!("`{k}`: not a u32")),
        }
    }
    /// The first of several spellings that is given.
    fn u_any(&self, ks: &[&str]) -> R<Option<u32>> {
        for k in ks {
            if self.s(k).is_some() {
                return self.u(k);
            }
        }
        Ok(None)
    }
    fn buf(&self, k: &str) -> R<Option<Buf>> {
        Ok(match self.s(k) {
            None => None,
            Some("i" | "input") => Some(Buf::I),
            Some("o" | "output") => Some(Buf::O),
            Some("s" | "scratch") => Some(Buf::S),
            Some(_) => return Err(format!("`{k}`: not a buffer")),
        })
    }
    /// `(buffer, offset)` from attributes `b` and `o` when both are given.
    fn loc(&self, b: &str, o: &str) -> R<Option<(Buf, i64)>> {
        Ok(match (self.buf(b)?, self.i(o)?) {
            (Some(b), Some(o)) => Some((b, o)),
            _ => None,
        })
    }
}

fn coll_of(name: &str) -> Option<Coll> {
    let n: String = name.chars().filter(|c| *c != '_' && *c != '-').collect::<String>().to_ascii_lowercase();
    Some(match n.as_str() {
        "allreduce" => Coll::AllReduce,
        "allgather" => Coll::AllGather,
        "reducescatter" => Coll::ReduceScatter,
        "alltoall" => Coll::AllToAll,
        _ => return None,
    })
}

fn ty_of(t: &str) -> Option<Ty> {
    Some(match t {
        "nop" => Ty::Nop,
        "s" => Ty::S,
        "r" => Ty::R,
        "rcs" => Ty::Rcs,
        "rrs" => Ty::Rrs,
        "rrc" => Ty::Rrc,
        "rrcs" => Ty::Rrcs,
        "cpy" | "copy" => Ty::Cpy,
        "re" | "reduce" => Ty::Re,
        _ => return None,
    })
}

fn parse(xml: &str) -> R<Algo> {
    let mut rd = Reader::from_str(xml);
    rd.config_mut().trim_text(true);
    let mut stack: Vec<String> = Vec::new();
    let mut algo: Option<Algo> = None;
    let mut gpu: Option<Gpu> = None;
    let mut tb: Option<Tb> = None;
    let mut line = 1usize;
    let mut last = 0usize;
    loop {
        let ev = rd.read_event().map_err(|e| format!("xml: {e}"))?;
        let pos = rd.buffer_position() as usize;
        line += xml.as_bytes()[last..pos].iter().filter(|&&b| b == b'\n').count();
        last = pos;
        match ev {
            Event::Start(ref e) | Event::Empty(ref e) => {
                let empty = matches!(ev, Event::Empty(_));
                let name = String::from_utf8_lossy(e.name().as_ref()).into_owned();
                let parent = stack.last().map(String::as_str).unwrap_or("");
                let known = matches!(name.as_str(), "algo" | "gpu" | "tb" | "copy" | "step" | "op");
                if known {
                    let want = match name.as_str() {
                        "algo" => "",
                        "gpu" => "algo",
                        "tb" | "copy" => "gpu",
                        _ => "tb",
                    };
                    if name == "algo" && algo.is_some() {
                        return Err("second algo".into());
                    }
                    if matches!(name.as_str(), "algo" | "gpu" | "tb") && stack.contains(&name) {
                        return Err(format!("{name} inside {name}"));
                    }
                    if parent != want {
                        return Err(format!("{name} inside `{parent}`"));
                    }
                    let mut map = HashMap::new();
                    for a in e.attributes().with_checks(false) {
                        let a = a.map_err(|e| format!("attribute: {e}"))?;
                        let k = String::from_utf8_lossy(a.key.as_ref()).into_owned();
                        let v = a.unescape_value().map_err(|e| format!("attribute value: {e}"))?.into_owned();
                        if map.insert(k, v).is_some() {
                            return Err("repeated attribute".into());
                        }
                    }
                    let a = Attrs(map);
                    match name.as_str() {
                        "algo" => {
                            let coll = coll_of(a.s("coll").ok_or("no coll")?).ok_or("unknown coll")?;
                            algo = Some(Algo {
                                coll,
                                ngpus: a.u("ngpus")?.ok_or("no ngpus")?,
                                nchunks: a.u("nchunksperloop")?,
                                inplace: a.i("inplace")?.map(|v| v != 0),
                                outofplace: a.i("outofplace")?.map(|v| v != 0),
                                gpus: Vec::new(),
                            });
                        }
                        "gpu" => {
                            gpu = Some(Gpu {
                                id: a.u("id")?.ok_or("gpu without id")?,
                                i_chunks: a.u("i_chunks")?,
                                o_chunks: a.u("o_chunks")?,
                                s_chunks: a.u("s_chunks")?.unwrap_or(0),
                                copies: Vec::new(),
                                tbs: Vec::new(),
                            })
                        }
                        "copy" => {
                            let i = a.u_any(&["i_off", "srcoff"])?.ok_or("copy without i_off")?;
                            let o = a.u_any(&["o_off", "dstoff"])?.ok_or("copy without o_off")?;
                            let cnt = a.u("cnt")?.unwrap_or(1);
                            if cnt == 0 {
                                return Err("copy of 0 chunks".into());
                            }
                            gpu.as_mut().unwrap().copies.push((i, o, cnt));
                        }
                        "tb" => {
                            tb = Some(Tb {
                                id: a.u("id")?.ok_or("tb without id")?,
                                send: a.i("send")?.unwrap_or(-1),
                                recv: a.i("recv")?.unwrap_or(-1),
                                chan: a.u("chan")?.unwrap_or(0),
                                steps: Vec::new(),
                            })
                        }
                        _ => {
                            let t = tb.as_mut().unwrap();
                            let s = a.u_any(&["s", "step"])?.ok_or("step without s")?;
                            if s as usize != t.steps.len() {
                                return Err("steps out of order".into());
                            }
                            let ty = ty_of(a.s("type").ok_or("step without type")?).ok_or("unknown type")?;
                            let shared = a.loc("buf", "off")?;
                            let src = a.loc("srcbuf", "srcoff")?.or(shared);
                            let dst = a.loc("dstbuf", "dstoff")?.or(shared);
                            let cnt = a.u("cnt")?.unwrap_or(1);
                            if cnt == 0 && ty != Ty::Nop {
                                return Err("step of 0 chunks".into());
                            }
                            let hasdep = match a.i("hasdep")? {
                                None | Some(0) => false,
                                Some(1) => true,
                                Some(_) => return Err("hasdep not 0 or 1".into()),
                            };
                            t.steps.push(Step {
                                line,
                                ty,
                                src,
                                dst,
                                cnt,
                                depid: a.i("depid")?.unwrap_or(-1),
                                deps: a.i("deps")?.unwrap_or(-1),
                                hasdep,
                            });
                        }
                    }
                    if empty {
                        close(&name, &mut algo, &mut gpu, &mut tb);
                    }
                }
                if !empty {
                    stack.push(name);
                }
            }
            Event::End(_) => {
                let name = stack.pop().ok_or("end without start")?;
                close(&name, &mut algo, &mut gpu, &mut tb);
            }
            Event::Eof => break,
            _ => {}
        }
    }
    if !stack.is_empty() {
        return Err("unclosed element".into());
    }
    let mut algo = algo.ok_or("no algo")?;
    algo.gpus.sort_by_key(|g| g.id);
    if algo.gpus.iter().enumerate().any(|(i, g)| g.id as usize != i) || algo.gpus.len() as u64 != algo.ngpus as u64 {
        return Err("gpu ids are not 0..ngpus".into());
    }
    Ok(algo)
}

fn close(name: &str, algo: &mut Option<Algo>, gpu: &mut Option<Gpu>, tb: &mut Option<Tb>) {
    match name {
        "tb" => {
            if let (Some(t), Some(g)) = (tb.take(), gpu.as_mut()) {
                g.tbs.push(t)
            }
        }
        "gpu" => {
            if let (Some(g), Some(a)) = (gpu.take(), algo.as_mut()) {
                a.gpus.push(g)
            }
        }
        _ => {}
    }
}

// ---------------------------------------------------------------------------------------------
// Buffers
// ---------------------------------------------------------------------------------------------

/// Sizes and aliasing of the user buffers (NCCL's: in place, an AllGather's input is the rank's
/// block of the output, a ReduceScatter's output the rank's block of the input).
#[derive(Clone, Copy, Debug)]
struct Shape {
    coll: Coll,
    n: u32,
    chunks: u32,
    in_place: bool,
}

impl Shape {
    fn ic(&self) -> u32 {
        if self.coll == Coll::AllGather { self.chunks / self.n } else { self.chunks }
    }
    fn oc(&self) -> u32 {
        if self.coll == Coll::ReduceScatter { self.chunks / self.n } else { self.chunks }
    }
    /// Chunks before scratch in a rank's memory.
    fn user(&self) -> u32 {
        if self.in_place { self.ic().max(self.oc()) } else { self.ic() + self.oc() }
    }
    /// Where chunk `off` of `b` lives in rank `r`'s memory (scratch after the user buffers).
    fn at(&self, r: u32, b: Buf, off: u32) -> u32 {
        match (b, self.in_place, self.coll) {
            (Buf::S, ..) => self.user() + off,
            (Buf::I, false, _) => off,
            (Buf::O, false, _) => self.ic() + off,
            (Buf::I, true, Coll::AllGather) => r * self.ic() + off,
            (Buf::O, true, Coll::ReduceScatter) => r * self.oc() + off,
            (_, true, _) => off,
        }
    }
}

// ---------------------------------------------------------------------------------------------
// MSCCL's parser: transmissions
// ---------------------------------------------------------------------------------------------

/// A transmission of a thread block, with its operands resolved to chunk indices of the rank's memory.
#[derive(Clone, Debug)]
struct Tr {
    ty: Ty,
    /// Source and destination chunk of the first chunk (memory index).
    src: u32,
    dst: u32,
    count: u32,
    /// For a fused reduction: the sources of every reduction.
    srcs: Vec<u32>,
    deps: Vec<(i64, i64)>,
    has_dep: bool,
}

const MAX_REDUCE_FUSION: u32 = 16;

/// A rank's thread blocks as MSCCL's parser leaves them, and what it needs for the run.
struct Rank {
    tbs: Vec<(Tb, Vec<Tr>)>,
    mem_chunks: u32,
}

fn transmissions(a: &Algo, g: &Gpu, t: &Tb, sh: &Shape) -> R<Vec<Tr>> {
    let r = g.id;
    // An operand: given, not negative, inside its buffer and what the GPU declares.
    let operand = |loc: Option<(Buf, i64)>, cnt: u32| -> R<u32> {
        let (b, off) = loc.ok_or("operand not given")?;
        let off = u32::try_from(off).map_err(|_| "negative offset")?;
        let (size, declared) = match b {
            Buf::I => (sh.ic(), g.i_chunks),
            Buf::O => (sh.oc(), g.o_chunks),
            Buf::S => (g.s_chunks, None),
        };
        let end = off as u64 + cnt as u64;
        if end > size as u64 || declared.is_some_and(|d| end > d as u64) {
            return Err("operand out of its buffer".into());
        }
        Ok(sh.at(r, b, off))
    };
    let _ = a;
    let mut out: Vec<Tr> = Vec::new();
    let mut num_deps: Vec<(i64, i64)> = Vec::new();
    let mut old_red: Option<(Buf, i64, Buf)> = None;
    let mut num_reductions = 0u32;
    for st in &t.steps {
        if st.depid >= 0 {
            num_deps.push((st.depid, st.deps));
        }
        if st.ty == Ty::Nop {
            continue;
        }
        let uses_src = matches!(st.ty, Ty::S | Ty::Rrs | Ty::Rrc | Ty::Rrcs | Ty::Cpy | Ty::Re);
        let uses_dst = matches!(st.ty, Ty::R | Ty::Rcs | Ty::Rrc | Ty::Rrcs | Ty::Cpy | Ty::Re);
        let src = if uses_src { operand(st.src, st.cnt)? } else { 0 };
        let dst = if uses_dst { operand(st.dst, st.cnt)? } else { 0 };
        let (c, s0, d0) = (st.cnt, src, dst);
        let overlap = s0 < d0 + c && d0 < s0 + c;
        match st.ty {
            Ty::Rrc | Ty::Rrcs | Ty::Cpy if s0 != d0 && overlap => return Err("operands overlap".into()),
            Ty::Re if overlap => return Err("reduction onto its own source".into()),
            _ => {}
        }
        let mut continuation = false;
        if st.ty == Ty::Re {
            let key = (st.dst.unwrap().0, st.dst.unwrap().1, st.src.unwrap().0);
            continuation = old_red == Some(key) && st.depid == -1;
        }
        if continuation {
            let tr = out.last_mut().unwrap();
            if tr.count != st.cnt {
                return Err("fused reductions of different counts".into());
            }
            tr.srcs.push(src);
            tr.has_dep = st.hasdep;
        } else {
            if !num_deps.is_empty() && st.depid < 0 {
                return Err("nop dependencies before a step without one".into());
            }
            out.push(Tr {
                ty: st.ty,
                src,
                dst,
                count: st.cnt,
                srcs: vec![src],
                deps: std::mem::take(&mut num_deps),
                has_dep: st.hasdep,
            });
        }
        if st.ty != Ty::Re {
            old_red = None;
        } else {
            num_reductions += 1;
            old_red = if st.hasdep || num_reductions == MAX_REDUCE_FUSION {
                None
            } else {
                Some((st.dst.unwrap().0, st.dst.unwrap().1, st.src.unwrap().0))
            };
        }
    }
    Ok(out)
}

// ---------------------------------------------------------------------------------------------
// The run
// ---------------------------------------------------------------------------------------------

type Clock = Vec<u32>;

fn join(a: &mut Clock, b: &Clock) {
    for (x, y) in a.iter_mut().zip(b) {
        *x = (*x).max(*y);
    }
}

/// The last write and the reads since of a chunk, as (thread block, its clock entry then).
#[derive(Clone, Default)]
struct Hist {
    write: Option<(usize, u32)>,
    reads: Vec<(usize, u32)>,
}

struct Message {
    data: Vec<Option<i64>>,
    count: u32,
    clock: Clock,
}

/// Runs the algorithm in one placement on `inputs`; the outputs, or why the run fails.
fn run_placement(a: &Algo, sh: Shape, len: usize, inputs: &[Vec<i64>]) -> R<Vec<Vec<i64>>> {
    let n = sh.n as usize;
    // Ranks: thread blocks with their transmissions.
    let mut ranks: Vec<Rank> = Vec::new();
    for g in &a.gpus {
        let mut tbs = Vec::new();
        let mut ids = std::collections::HashSet::new();
        for t in &g.tbs {
            if !ids.insert(t.id) {
                return Err("repeated tb id".into());
            }
            tbs.push((t.clone(), transmissions(a, g, t, &sh)?));
        }
        tbs.sort_by_key(|(t, _)| t.id);
        ranks.push(Rank { tbs, mem_chunks: sh.user() + g.s_chunks });
    }
    // Peers and connections: a direction of a (gpu, peer, channel) belongs to one thread block.
    let mut owners: HashMap<(usize, i64, u32, bool), u32> = HashMap::new();
    for (r, rk) in ranks.iter().enumerate() {
        for (t, trs) in &rk.tbs {
            for tr in trs {
                let sends = matches!(tr.ty, Ty::S | Ty::Rcs | Ty::Rrs | Ty::Rrcs);
                let recvs = matches!(tr.ty, Ty::R | Ty::Rcs | Ty::Rrs | Ty::Rrc | Ty::Rrcs);
                for (used, peer, dir) in [(sends, t.send, true), (recvs, t.recv, false)] {
                    if !used {
                        continue;
                    }
                    if peer < 0 || peer >= n as i64 || peer == r as i64 {
                        return Err("bad peer".into());
                    }
                    if *owners.entry((r, peer, t.chan, dir)).or_insert(t.id) != t.id {
                        return Err("two thread blocks on one connection".into());
                    }
                }
            }
        }
    }
    // Memory: inputs, then the pre-copies.
    let mut mem: Vec<Vec<Option<i64>>> = ranks.iter().map(|rk| vec![None; rk.mem_chunks as usize * len]).collect();
    for (r, m) in mem.iter_mut().enumerate() {
        for j in 0..sh.ic() {
            let at = sh.at(r as u32, Buf::I, j) as usize;
            for e in 0..len {
                m[at * len + e] = Some(inputs[r][j as usize * len + e]);
            }
        }
    }
    for (r, g) in a.gpus.iter().enumerate() {
        for &(i, o, cnt) in &g.copies {
            if i as u64 + cnt as u64 > sh.ic() as u64 || o as u64 + cnt as u64 > sh.oc() as u64 {
                return Err("pre-copy out of range".into());
            }
            let (s, d) = (sh.at(r as u32, Buf::I, i), sh.at(r as u32, Buf::O, o));
            if s != d && s < d + cnt && d < s + cnt {
                return Err("pre-copy overlaps".into());
            }
            let v: Vec<_> = mem[r][s as usize * len..(s + cnt) as usize * len].to_vec();
            mem[r][d as usize * len..(d + cnt) as usize * len].copy_from_slice(&v);
        }
    }
    // Thread blocks, numbered globally for the clocks.
    let mut tb_of: Vec<(usize, usize)> = Vec::new();
    for (r, rk) in ranks.iter().enumerate() {
        for k in 0..rk.tbs.len() {
            tb_of.push((r, k));
        }
    }
    let nt = tb_of.len();
    let global = |r: usize, k: usize| tb_of.iter().position(|&x| x == (r, k)).unwrap();
    let id_to_k: Vec<HashMap<u32, usize>> =
        ranks.iter().map(|rk| rk.tbs.iter().enumerate().map(|(k, (t, _))| (t.id, k)).collect()).collect();
    let mut pc = vec![0usize; nt];
    let mut counter = vec![0i64; nt];
    let mut clocks: Vec<Clock> = vec![vec![0; nt]; nt];
    // Published flags with the clock of the publishing step.
    let mut published: Vec<Vec<(i64, Clock)>> = vec![Vec::new(); nt];
    let mut fifos: HashMap<(usize, usize, u32), VecDeque<Message>> = HashMap::new();
    let mut hist: Vec<Vec<Hist>> = ranks.iter().map(|rk| vec![Hist::default(); rk.mem_chunks as usize]).collect();
    let red = |a: Option<i64>, b: Option<i64>| match (a, b) {
        (Some(x), Some(y)) => Some(x.wrapping_add(y)),
        _ => None,
    };
    loop {
        let mut progress = false;
        let mut done = true;
        for g in 0..nt {
            let (r, k) = tb_of[g];
            let (t, trs) = &ranks[r].tbs[k];
            while pc[g] < trs.len() {
                done = false;
                let tr = &trs[pc[g]];
                // Dependencies: each released by the first publication of at least its step.
                let mut wait_clocks = Vec::new();
                let mut ready = true;
                for &(bid, step) in &tr.deps {
                    let Some(&kb) = u32::try_from(bid).ok().and_then(|b| id_to_k[r].get(&b)) else {
                        return Err("dependency on a missing thread block".into());
                    };
                    if step < 0 {
                        return Err("dependency on a negative step".into());
                    }
                    match published[global(r, kb)].iter().find(|(v, _)| *v >= step) {
                        Some((_, c)) => wait_clocks.push(c.clone()),
                        None => ready = false,
                    }
                }
                let recvs = matches!(tr.ty, Ty::R | Ty::Rcs | Ty::Rrs | Ty::Rrc | Ty::Rrcs);
                let in_key = (t.recv as usize, r, t.chan);
                if recvs && fifos.get(&in_key).is_none_or(|q| q.is_empty()) {
                    ready = false;
                }
                if !ready {
                    break;
                }
                progress = true;
                let mut clock = clocks[g].clone();
                for c in &wait_clocks {
                    join(&mut clock, c);
                }
                if !tr.deps.is_empty() {
                    counter[g] += tr.deps.len() as i64 - 1;
                }
                let incoming = if recvs {
                    let m = fifos.get_mut(&in_key).unwrap().pop_front().unwrap();
                    if m.count != tr.count {
                        return Err("message of another count".into());
                    }
                    join(&mut clock, &m.clock);
                    Some(m.data)
                } else {
                    None
                };
                clock[g] += 1;
                let cl = tr.count as usize * len;
                let m = &mut mem[r];
                let read = |m: &Vec<Option<i64>>, at: u32| m[at as usize * len..at as usize * len + cl].to_vec();
                // Accesses for the race check: (first chunk, write?).
                let mut acc: Vec<(u32, bool)> = Vec::new();
                let mut outgoing = None;
                match tr.ty {
                    Ty::Nop => unreachable!(),
                    Ty::S => {
                        acc.push((tr.src, false));
                        outgoing = Some(read(m, tr.src));
                    }
                    Ty::R | Ty::Rcs => {
                        acc.push((tr.dst, true));
                        let data = incoming.unwrap();
                        m[tr.dst as usize * len..tr.dst as usize * len + cl].copy_from_slice(&data);
                        if tr.ty == Ty::Rcs {
                            outgoing = Some(data);
                        }
                    }
                    Ty::Rrs | Ty::Rrc | Ty::Rrcs => {
                        acc.push((tr.src, false));
                        let local = read(m, tr.src);
                        let data: Vec<_> = incoming.unwrap().iter().zip(&local).map(|(a, b)| red(*a, *b)).collect();
                        if tr.ty != Ty::Rrs {
                            acc.push((tr.dst, true));
                            m[tr.dst as usize * len..tr.dst as usize * len + cl].copy_from_slice(&data);
                        }
                        if tr.ty != Ty::Rrc {
                            outgoing = Some(data);
                        }
                    }
                    Ty::Cpy => {
                        if tr.src == tr.dst {
                            // Reads and writes the same values back: races only with a write.
                            acc.push((tr.src, false));
                        } else {
                            acc.push((tr.src, false));
                            acc.push((tr.dst, true));
                            let v = read(m, tr.src);
                            m[tr.dst as usize * len..tr.dst as usize * len + cl].copy_from_slice(&v);
                        }
                    }
                    Ty::Re => {
                        let mut o = read(m, tr.dst);
                        for &s in &tr.srcs {
                            acc.push((s, false));
                            for (x, y) in o.iter_mut().zip(read(m, s)) {
                                *x = red(*x, y);
                            }
                        }
                        acc.push((tr.dst, true));
                        m[tr.dst as usize * len..tr.dst as usize * len + cl].copy_from_slice(&o);
                    }
                }
                // Race check: every earlier conflicting access must happen before this one.
                for &(first, write) in &acc {
                    for c in first..first + tr.count {
                        let h = &mut hist[r][c as usize];
                        let before = |&(u, e): &(usize, u32)| u == g || clock[u] >= e;
                        if h.write.as_ref().is_some_and(|w| !before(w)) {
                            return Err("data race".into());
                        }
                        if write {
                            if h.reads.iter().any(|x| !before(x)) {
                                return Err("data race".into());
                            }
                            h.write = Some((g, clock[g]));
                            h.reads.clear();
                        } else {
                            h.reads.push((g, clock[g]));
                        }
                    }
                }
                if let Some(data) = outgoing {
                    let key = (r, t.send as usize, t.chan);
                    fifos.entry(key).or_default().push_back(Message { data, count: tr.count, clock: clock.clone() });
                }
                if tr.ty == Ty::Re {
                    counter[g] += tr.srcs.len() as i64 - 1;
                }
                if tr.has_dep {
                    published[g].push((counter[g], clock.clone()));
                }
                counter[g] += 1;
                clocks[g] = clock;
                pc[g] += 1;
            }
        }
        if done {
            break;
        }
        if !progress {
            return Err("hang".into());
        }
    }
    if fifos.values().any(|q| !q.is_empty()) {
        return Err("message left in a FIFO".into());
    }
    // Outputs and the collective's postcondition.
    let (ic, oc) = (sh.ic() as usize, sh.oc() as usize);
    let mut outputs = Vec::new();
    for r in 0..n {
        let mut out = Vec::with_capacity(oc * len);
        for j in 0..oc {
            let at = sh.at(r as u32, Buf::O, j as u32) as usize;
            for e in 0..len {
                let want = match sh.coll {
                    Coll::AllReduce => (0..n).fold(0i64, |s, q| s.wrapping_add(inputs[q][j * len + e])),
                    Coll::ReduceScatter => (0..n).fold(0i64, |s, q| s.wrapping_add(inputs[q][(r * oc + j) * len + e])),
                    Coll::AllGather => inputs[j / ic][(j % ic) * len + e],
                    Coll::AllToAll => {
                        let b = oc / n;
                        inputs[j / b][(r * b + j % b) * len + e]
                    }
                };
                match mem[r][at * len + e] {
                    Some(v) if v == want => out.push(v),
                    _ => return Err(format!("rank {r} output chunk {j} is wrong")),
                }
            }
        }
        outputs.push(out);
    }
    Ok(outputs)
}

/// Deterministic inputs: `ic × len` distinct large numbers per rank.
pub fn inputs(ranks: usize, ic: usize, len: usize, seed: u64) -> Vec<Vec<i64>> {
    let mut x = seed ^ 0x5DEE_CE66_D1CE_4E5B;
    (0..ranks)
        .map(|_| {
            (0..ic * len)
                .map(|_| {
                    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
                    let mut z = x;
                    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
                    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
                    (z ^ (z >> 31)) as i64
                })
                .collect()
        })
        .collect()
}

/// Most chunks over all ranks' memories the interpreter (and the importer) takes from a file.
const MAX_CHUNKS: u64 = 1 << 24;

/// Interprets `xml` with `len` elements per chunk on inputs from `seed`.
pub fn interpret(xml: &str, len: usize, seed: u64) -> Verdict {
    match interpret_inner(xml, len, seed) {
        Ok(v) => v,
        Err(why) => Verdict::Refused(why),
    }
}

fn interpret_inner(xml: &str, len: usize, seed: u64) -> R<Verdict> {
    let a = parse(xml)?;
    let n = a.ngpus;
    let chunks = match a.nchunks {
        Some(c) => c,
        None => a.gpus.iter().map(|g| g.i_chunks.unwrap_or(0).max(g.o_chunks.unwrap_or(0))).max().unwrap_or(0),
    };
    if n == 0 || chunks == 0 {
        return Err("no ranks or no chunks".into());
    }
    if a.coll != Coll::AllReduce && !chunks.is_multiple_of(n) {
        return Err("chunks not divisible by ranks".into());
    }
    let max_scratch = a.gpus.iter().map(|g| g.s_chunks as u64).max().unwrap_or(0);
    if (2 * chunks as u64 + max_scratch) * n as u64 > MAX_CHUNKS {
        return Err("too large".into());
    }
    let (in_place, out_of_place) = match (a.inplace, a.outofplace) {
        (None, None) => {
            let i = a.gpus.iter().all(|g| g.i_chunks.unwrap_or(0) == 0 || g.o_chunks.unwrap_or(0) == 0);
            (i, !i)
        }
        (Some(i), None) => (i, !i),
        (None, Some(o)) => (!o, o),
        (Some(i), Some(o)) => (i, o),
    };
    if !in_place && !out_of_place {
        return Err("no placement".into());
    }
    let shape = |ip: bool| Shape { coll: a.coll, n, chunks, in_place: ip };
    // Declared sizes must fit the buffers.
    let sh = shape(in_place);
    if a.gpus.iter().any(|g| g.i_chunks.is_some_and(|i| i > sh.ic()) || g.o_chunks.is_some_and(|o| o > sh.oc())) {
        return Err("declared chunks beyond the buffers".into());
    }
    let inputs = inputs(n as usize, sh.ic() as usize, len, seed);
    let primary = in_place;
    let outputs = run_placement(&a, shape(primary), len, &inputs)?;
    if in_place && out_of_place {
        run_placement(&a, shape(false), len, &inputs).map_err(|e| format!("out of place: {e}"))?;
    }
    Ok(Verdict::Accepted { in_place: primary, inputs, outputs })
}
