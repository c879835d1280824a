//! MSCCL files for the differential and fuzz tests: an element tree that prints as XML, generators of
//! correct algorithms in the shapes real producers write (rings with fused steps, all-pairs with
//! scratch, `nop` chains and fused reductions, direct all-to-all, and any random valid transfer
//! program with the dependencies it needs), and structural mutations of any file.

#![allow(dead_code)]

use crate::common::{Rng, random_program};
use oxccl_host::program::{BufferKind, Collective, OpKind, Program, Rank, RecvOp, Slice};
use quick_xml::Reader;
use quick_xml::events::Event;
use std::collections::HashMap;

/// An XML element.
#[derive(Clone, Debug, PartialEq)]
pub struct El {
    pub name: String,
    pub attrs: Vec<(String, String)>,
    pub kids: Vec<El>,
}

impl El {
    pub fn new(name: &str, attrs: &[(&str, String)]) -> El {
        El {
            name: name.into(),
            attrs: attrs.iter().map(|(k, v)| (k.to_string(), v.clone())).collect(),
            kids: Vec::new(),
        }
    }
    pub fn get(&self, k: &str) -> Option<&str> {
        self.attrs.iter().find(|(a, _)| a == k).map(|(_, v)| v.as_str())
    }
    pub fn set(&mut self, k: &str, v: impl ToString) {
        match self.attrs.iter_mut().find(|(a, _)| a == k) {
            Some(a) => a.1 = v.to_string(),
            None => self.attrs.push((k.into(), v.to_string())),
        }
    }
    /// The XML text, one element per line.
    pub fn print(&self) -> String {
        let mut s = String::new();
        self.print_into(&mut s, 0);
        s
    }
    fn print_into(&self, s: &mut String, depth: usize) {
        s.push_str(&"  ".repeat(depth));
        s.push('<');
        s.push_str(&self.name);
        for (k, v) in &self.attrs {
            let v = v.replace('&', "&amp;").replace('"', "&quot;").replace('<', "&lt;");
            s.push_str(&format!(" {k}=\"{v}\""));
        }
        if self.kids.is_empty() && self.name != "algo" {
            s.push_str("/>\n");
            return;
        }
        s.push_str(">\n");
        for k in &self.kids {
            k.print_into(s, depth + 1);
        }
        s.push_str(&"  ".repeat(depth));
        s.push_str(&format!("</{}>\n", self.name));
    }
    /// Reads a (well-formed) file into a tree; `None` if it is not.
    pub fn parse(xml: &str) -> Option<El> {
        let mut rd = Reader::from_str(xml);
        rd.config_mut().trim_text(true);
        let mut stack: Vec<El> = vec![El::new("#root", &[])];
        loop {
            match rd.read_event().ok()? {
                Event::Start(e) => stack.push(el_of(&e)?),
                Event::Empty(e) => stack.last_mut()?.kids.push(el_of(&e)?),
                Event::End(_) => {
                    let el = stack.pop()?;
                    stack.last_mut()?.kids.push(el);
                }
                Event::Eof => break,
                _ => {}
            }
        }
        let mut root = stack.pop()?;
        if !stack.is_empty() || root.kids.len() != 1 {
            return None;
        }
        root.kids.pop()
    }
}

fn el_of(e: &quick_xml::events::BytesStart<'_>) -> Option<El> {
    let mut el = El::new(&String::from_utf8_lossy(e.name().as_ref()), &[]);
    for a in e.attributes() {
        let a = a.ok()?;
        el.attrs.push((String::from_utf8_lossy(a.key.as_ref()).into_owned(), a.unescape_value().ok()?.into_owned()));
    }
    Some(el)
}

/// A `<step>` element.
#[allow(clippy::too_many_arguments)]
pub fn step(s: usize, ty: &str, src: (&str, i64), dst: (&str, i64), cnt: u32, dep: Option<(usize, usize)>) -> El {
    let (depid, deps) = dep.map_or((-1, -1), |(t, s)| (t as i64, s as i64));
    El::new(
        "step",
        &[
            ("s", s.to_string()),
            ("type", ty.into()),
            ("srcbuf", src.0.into()),
            ("srcoff", src.1.to_string()),
            ("dstbuf", dst.0.into()),
            ("dstoff", dst.1.to_string()),
            ("cnt", cnt.to_string()),
            ("depid", depid.to_string()),
            ("deps", deps.to_string()),
            ("hasdep", "0".into()),
        ],
    )
}

fn tb_el(id: usize, send: i64, recv: i64, chan: u32) -> El {
    El::new(
        "tb",
        &[("id", id.to_string()), ("send", send.to_string()), ("recv", recv.to_string()), ("chan", chan.to_string())],
    )
}

fn algo_el(name: &str, coll: &str, ngpus: u32, chunks: u32, in_place: bool, rng: &mut Rng) -> El {
    let mut a = El::new(
        "algo",
        &[
            ("name", name.into()),
            ("proto", ["Simple", "LL", "LL128"][rng.below(3) as usize].into()),
            ("nchannels", "2".into()),
            ("nchunksperloop", chunks.to_string()),
            ("ngpus", ngpus.to_string()),
            ("coll", coll.into()),
            ("inplace", (in_place as u32).to_string()),
        ],
    );
    if rng.coin() {
        a.set("outofplace", (!in_place as u32).to_string());
    }
    if rng.coin() {
        a.set("minBytes", "0");
        a.set("maxBytes", "1073741824");
    }
    a
}

fn gpu_el(id: u32, i: u32, o: u32, s: u32) -> El {
    El::new(
        "gpu",
        &[
            ("id", id.to_string()),
            ("i_chunks", i.to_string()),
            ("o_chunks", o.to_string()),
            ("s_chunks", s.to_string()),
        ],
    )
}

/// A location that the step type does not use (MSCCL ignores it): something random.
fn junk(rng: &mut Rng) -> (&'static str, i64) {
    (["i", "o", "s"][rng.below(3) as usize], rng.below(5) as i64 - 1)
}

// ---------------------------------------------------------------------------------------------
// From a transfer program
// ---------------------------------------------------------------------------------------------

/// A thread block of a rank: sends to a peer, receives from one (or both), or local.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
enum Role {
    Send(u32, u32),
    Recv(u32, u32),
    Both(u32, u32),
    Local(u32),
}

/// Writes a valid program as an MSCCL file: each transfer a `s` and an `r`/`rrc` on thread blocks
/// of its connection, copies and reductions `cpy`/`re` on local ones, and every step depending (with
/// `nop` chains for several) on the last conflicting step of each other thread block of its GPU.
pub fn from_program(p: &Program, rng: &mut Rng) -> El {
    let l = &p.layout;
    let n = l.ranks;
    let mut algo = algo_el(&p.name, l.collective.name(), n, l.chunks, l.in_place, rng);
    let merge = rng.coin();
    // Per rank: thread blocks (role, steps), their ids by role, and per storage chunk the last
    // writer and the readers since, as (tb, step index).
    let mut tbs: Vec<Vec<(Role, Vec<El>)>> = vec![Vec::new(); n as usize];
    let mut ids: Vec<HashMap<Role, usize>> = vec![HashMap::new(); n as usize];
    type Hist = (Option<(usize, usize)>, Vec<(usize, usize)>);
    let mut hist: Vec<Vec<Hist>> =
        (0..n).map(|r| vec![(None, Vec::new()); l.storage_chunks(Rank(r)) as usize]).collect();
    let letter = |b: BufferKind| match b {
        BufferKind::Input => "i",
        BufferKind::Output => "o",
        BufferKind::Scratch => "s",
    };
    let mut emit = |rng: &mut Rng, r: u32, role: Role, mut st: El, reads: &[Slice], writes: &[Slice]| {
        let role = match role {
            Role::Send(q, c) | Role::Recv(q, c) if merge => Role::Both(q, c),
            other => other,
        };
        let rr = r as usize;
        let t = *ids[rr].entry(role).or_insert_with(|| {
            tbs[rr].push((role, Vec::new()));
            tbs[rr].len() - 1
        });
        // The chunks of rank `r`'s storage a slice covers.
        let span = |s: &Slice| {
            let at = l.resolve(Rank(r), *s).unwrap() as usize;
            at..at + s.count as usize
        };
        let mut deps: HashMap<usize, usize> = HashMap::new();
        let mut need = |d: (usize, usize)| {
            if d.0 != t {
                let e = deps.entry(d.0).or_insert(d.1);
                *e = (*e).max(d.1);
            }
        };
        for s in reads.iter().chain(writes) {
            for (w, _) in &hist[rr][span(s)] {
                if let Some(w) = *w {
                    need(w);
                }
            }
        }
        for s in writes {
            for (_, readers) in &hist[rr][span(s)] {
                for &rd in readers {
                    need(rd);
                }
            }
        }
        let mut deps: Vec<(usize, usize)> = deps.into_iter().collect();
        deps.sort();
        rng.shuffle(&mut deps);
        for &(dt, ds) in &deps {
            tbs[rr][dt].1[ds].set("hasdep", 1);
        }
        let steps = &mut tbs[rr][t].1;
        for (k, &(dt, ds)) in deps.iter().enumerate() {
            if k + 1 < deps.len() {
                let j = junk(rng);
                steps.push(step(steps.len(), "nop", j, j, 0, Some((dt, ds))));
            } else {
                st.set("depid", dt);
                st.set("deps", ds);
            }
        }
        let idx = steps.len();
        st.set("s", idx);
        steps.push(st);
        for s in reads {
            for (_, readers) in &mut hist[rr][span(s)] {
                readers.push((t, idx));
            }
        }
        for s in writes {
            for h in &mut hist[rr][span(s)] {
                *h = (Some((t, idx)), Vec::new());
            }
        }
    };
    for op in &p.ops {
        match op.kind {
            OpKind::Transfer { src_rank, dst_rank, channel, src, dst, op: rop } => {
                let (a, b) = (src_rank.0, dst_rank.0);
                let j = junk(rng);
                let s = step(0, "s", (letter(src.buffer), src.offset as i64), j, src.count, None);
                emit(rng, a, Role::Send(b, channel), s, &[src], &[]);
                let d = (letter(dst.buffer), dst.offset as i64);
                let (ty, srcloc) = match rop {
                    RecvOp::Recv => ("r", junk(rng)),
                    RecvOp::RecvReduceCopy => ("rrc", d),
                };
                let r = step(0, ty, srcloc, d, dst.count, None);
                let reads: &[Slice] = if ty == "rrc" { std::slice::from_ref(&dst) } else { &[] };
                emit(rng, b, Role::Recv(a, channel), r, reads, &[dst]);
            }
            OpKind::Copy { rank, channel, src, dst } | OpKind::Reduce { rank, channel, src, dst } => {
                let reduce = matches!(op.kind, OpKind::Reduce { .. });
                let ty = if reduce { "re" } else { "cpy" };
                let st = step(
                    0,
                    ty,
                    (letter(src.buffer), src.offset as i64),
                    (letter(dst.buffer), dst.offset as i64),
                    src.count,
                    None,
                );
                let reads: Vec<Slice> = if reduce { vec![src, dst] } else { vec![src] };
                emit(rng, rank.0, Role::Local(channel), st, &reads, &[dst]);
            }
        }
    }
    for r in 0..n {
        let mut g = gpu_el(r, l.input_chunks(), l.output_chunks(), l.scratch[r as usize]);
        for (id, (role, steps)) in tbs[r as usize].drain(..).enumerate() {
            let mut t = match role {
                Role::Send(q, c) => tb_el(id, q as i64, -1, c),
                Role::Recv(q, c) => tb_el(id, -1, q as i64, c),
                Role::Both(q, c) => tb_el(id, q as i64, q as i64, c),
                Role::Local(c) => tb_el(id, -1, -1, c),
            };
            t.kids = steps;
            g.kids.push(t);
        }
        algo.kids.push(g);
    }
    algo
}

/// A random valid program of a random collective, written as an MSCCL file.
pub fn random_file(rng: &mut Rng) -> El {
    let coll = [Collective::AllReduce, Collective::AllGather, Collective::ReduceScatter, Collective::AllToAll]
        [rng.below(4) as usize];
    let ranks = 2 + rng.below(3);
    let p = random_program(rng.next(), coll, ranks, 1 + rng.below(2), 1 + rng.below(2));
    from_program(&p, rng)
}

// ---------------------------------------------------------------------------------------------
// Shapes real producers write
// ---------------------------------------------------------------------------------------------

/// A ring AllReduce (reduce-scatter then all-gather around a random ring), `k` chunks per block, in
/// one thread block per rank, with MSCCL's fused steps or their unfused equivalents at random.
pub fn ring_allreduce(rng: &mut Rng) -> El {
    let n = 2 + rng.below(4);
    let k = 1 + rng.below(2);
    let in_place = rng.coin();
    let mut ring: Vec<u32> = (0..n).collect();
    rng.shuffle(&mut ring);
    let pos_of = |r: u32| ring.iter().position(|&x| x == r).unwrap() as u32;
    let mut algo = algo_el("ring_ar", "allreduce", n, n * k, in_place, rng);
    // In place, input and output are one buffer: name either.
    let acc = |rng: &mut Rng| if in_place && rng.coin() { "o" } else { "i" };
    let res = |rng: &mut Rng| if in_place { ["i", "o"][rng.below(2) as usize] } else { "o" };
    for r in 0..n {
        let p = pos_of(r);
        let (next, prev) = (ring[((p + 1) % n) as usize], ring[((p + n - 1) % n) as usize]);
        let mut t = tb_el(0, next as i64, prev as i64, 0);
        let mut steps: Vec<El> = Vec::new();
        let mut push = |st: El| {
            let mut st = st;
            st.set("s", steps.len());
            steps.push(st);
        };
        for time in 0..2 * n - 1 {
            let blk = ((p + n * 2 - time) % n * k) as i64;
            let fused = rng.coin();
            let j = junk(rng);
            if time == 0 {
                push(step(0, "s", (acc(rng), blk), j, k, None));
            } else if time < n - 1 {
                if fused {
                    push(step(0, "rrs", (acc(rng), blk), j, k, None));
                } else {
                    let a = acc(rng);
                    push(step(0, "rrc", (a, blk), (a, blk), k, None));
                    push(step(0, "s", (a, blk), j, k, None));
                }
            } else if time == n - 1 {
                let (a, o) = (acc(rng), res(rng));
                if fused {
                    push(step(0, "rrcs", (a, blk), (o, blk), k, None));
                } else {
                    push(step(0, "rrc", (a, blk), (o, blk), k, None));
                    push(step(0, "s", (o, blk), j, k, None));
                }
            } else if time < 2 * n - 2 {
                let o = res(rng);
                if fused {
                    push(step(0, "rcs", j, (o, blk), k, None));
                } else {
                    push(step(0, "r", j, (o, blk), k, None));
                    push(step(0, "s", (o, blk), j, k, None));
                }
            } else {
                push(step(0, "r", j, (res(rng), blk), k, None));
            }
        }
        t.kids = steps;
        // In place the steps name both buffers (they alias), so both are declared.
        let mut g = gpu_el(r, n * k, n * k, 0);
        if in_place && rng.coin() {
            g.attrs.retain(|(a, _)| a != "o_chunks");
            for s in &mut t.kids {
                for b in ["srcbuf", "dstbuf"] {
                    if s.get(b) == Some("o") {
                        s.set(b, "i");
                    }
                }
            }
        }
        g.kids.push(t);
        algo.kids.push(g);
    }
    algo
}

/// A ring AllGather: in place straight in the output; out of place after copying the input into
/// the rank's output block (a `cpy` step that the first send waits for, or a TACCL `<copy>`).
pub fn ring_allgather(rng: &mut Rng) -> El {
    let n = 2 + rng.below(4);
    let k = 1 + rng.below(2);
    let in_place = rng.coin();
    let mut algo = algo_el("ring_ag", "allgather", n, n * k, in_place, rng);
    let precopy = rng.coin();
    for r in 0..n {
        let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
        let mut g = gpu_el(r, if in_place { 0 } else { k }, n * k, 0);
        let own = (r * k) as i64;
        let mut steps = Vec::new();
        let mut dep = None;
        if !in_place {
            if precopy {
                g.kids.push(El::new(
                    "copy",
                    &[("i_off", "0".into()), ("o_off", own.to_string()), ("cnt", k.to_string())],
                ));
            } else {
                let mut c = tb_el(1, -1, -1, 0);
                let mut st = step(0, "cpy", ("i", 0), ("o", own), k, None);
                st.set("hasdep", 1);
                c.kids.push(st);
                g.kids.push(c);
                dep = Some((1, 0));
            }
        }
        for time in 0..n {
            let blk = (((r + n - time) % n) * k) as i64;
            let j = junk(rng);
            let st = if time == 0 {
                if in_place || rng.coin() {
                    step(0, "s", ("o", own), j, k, dep)
                } else {
                    step(0, "s", ("i", 0), j, k, None)
                }
            } else if time < n - 1 {
                step(0, "rcs", j, ("o", blk), k, None)
            } else {
                step(0, "r", j, ("o", blk), k, None)
            };
            let mut st = st;
            st.set("s", steps.len());
            steps.push(st);
        }
        let mut t = tb_el(0, next as i64, prev as i64, 0);
        t.kids = steps;
        g.kids.insert(0, t);
        algo.kids.push(g);
    }
    algo
}

/// A ring ReduceScatter ending with a reduce-copy into the rank's output block.
pub fn ring_reducescatter(rng: &mut Rng) -> El {
    let n = 2 + rng.below(4);
    let in_place = rng.coin();
    let mut algo = algo_el("ring_rs", "reducescatter", n, n, in_place, rng);
    for r in 0..n {
        let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
        let mut t = tb_el(0, next as i64, prev as i64, 0);
        for time in 0..n {
            let blk = ((r + 2 * n - time - 1) % n) as i64;
            let j = junk(rng);
            let st = if time == 0 {
                step(time as usize, "s", ("i", blk), j, 1, None)
            } else if time < n - 1 {
                step(time as usize, "rrs", ("i", blk), j, 1, None)
            } else {
                step(time as usize, "rrc", ("i", blk), ("o", 0), 1, None)
            };
            t.kids.push(st);
        }
        let mut g = gpu_el(r, n, 1, 0);
        g.kids.push(t);
        algo.kids.push(g);
    }
    algo
}

/// A direct AllToAll: a thread block per peer sends the peer's block and receives its own; the
/// rank's own block is copied locally (in place a copy onto itself).
pub fn direct_alltoall(rng: &mut Rng) -> El {
    let n = 2 + rng.below(3);
    let in_place = rng.coin();
    let mut algo = algo_el("a2a", "alltoall", n, n, in_place, rng);
    for r in 0..n {
        let mut g = gpu_el(r, n, n, 0);
        let mut id = 0;
        for p in 0..n {
            if p == r {
                continue;
            }
            let mut t = tb_el(id, p as i64, p as i64, 0);
            t.kids.push(step(0, "s", ("i", p as i64), junk(rng), 1, None));
            t.kids.push(step(1, "r", junk(rng), ("o", p as i64), 1, None));
            g.kids.push(t);
            id += 1;
        }
        let mut c = tb_el(id, -1, -1, 0);
        c.kids.push(step(0, "cpy", ("i", r as i64), ("o", r as i64), 1, None));
        g.kids.push(c);
        algo.kids.push(g);
    }
    algo
}

/// An all-pairs AllReduce through scratch, as `ndv4_ap-1pass.xml`: every rank sends chunk `q` to
/// rank `q`, which receives each peer's into scratch, waits for them (a `nop` chain), reduces them
/// into its chunk in one fused run of `re`, and sends the result back.
pub fn allpairs_allreduce(rng: &mut Rng) -> El {
    let n = 2 + rng.below(3);
    let mut algo = algo_el("allpairs", "allreduce", n, n, true, rng);
    for r in 0..n {
        let mut g = gpu_el(r, n, 0, n);
        let peers: Vec<u32> = (0..n).filter(|&q| q != r).collect();
        let red_tb = peers.len();
        for (t, &q) in peers.iter().enumerate() {
            let mut tb = tb_el(t, q as i64, q as i64, 0);
            tb.kids.push(step(0, "s", ("i", q as i64), junk(rng), 1, None));
            let mut rcv = step(1, "r", junk(rng), ("s", q as i64), 1, None);
            rcv.set("hasdep", 1);
            tb.kids.push(rcv);
            // Waits for the reduction (its last `re`) before sending the result.
            tb.kids.push(step(
                2,
                "s",
                ("i", r as i64),
                junk(rng),
                1,
                Some((red_tb, peers.len() - 1 + peers.len() - 1)),
            ));
            tb.kids.push(step(3, "r", junk(rng), ("i", q as i64), 1, None));
            g.kids.push(tb);
        }
        let mut red = tb_el(red_tb, -1, -1, 0);
        let m = peers.len();
        for (k, t) in (0..m).enumerate().skip(1) {
            red.kids.push(step(k - 1, "nop", ("i", -1), ("o", -1), 0, Some((t, 1))));
        }
        for (k, &q) in peers.iter().enumerate() {
            let dep = (k == 0).then_some((0usize, 1usize));
            red.kids.push(step(m - 1 + k, "re", ("s", q as i64), ("i", r as i64), 1, dep));
        }
        red.kids.last_mut().unwrap().set("hasdep", 1);
        g.kids.push(red);
        algo.kids.push(g);
    }
    algo
}

/// One of the generators, at random.
pub fn generated(rng: &mut Rng) -> El {
    match rng.below(7) {
        0 | 1 => random_file(rng),
        2 => ring_allreduce(rng),
        3 => ring_allgather(rng),
        4 => ring_reducescatter(rng),
        5 => direct_alltoall(rng),
        _ => allpairs_allreduce(rng),
    }
}

// ---------------------------------------------------------------------------------------------
// Mutations
// ---------------------------------------------------------------------------------------------

/// Every element of the tree with its path (indices from the root).
fn paths(el: &El, at: &mut Vec<usize>, out: &mut Vec<Vec<usize>>) {
    out.push(at.clone());
    for (i, k) in el.kids.iter().enumerate() {
        at.push(i);
        paths(k, at, out);
        at.pop();
    }
}

fn at_mut<'a>(el: &'a mut El, path: &[usize]) -> &'a mut El {
    path.iter().fold(el, |e, &i| &mut e.kids[i])
}

/// Renumbers the steps of every thread block 0, 1, ... in order.
fn renumber(el: &mut El) {
    if el.name == "tb" {
        for (i, s) in el.kids.iter_mut().enumerate() {
            if s.get("s").is_some() {
                s.set("s", i);
            }
        }
    }
    for k in &mut el.kids {
        renumber(k);
    }
}

/// A structural mutation of a file: a value changed a little, an attribute dropped or added, a step
/// retyped, dropped, duplicated or moved, a dependency redirected, ...
pub fn mutate(doc: &mut El, rng: &mut Rng) {
    let mut all = Vec::new();
    paths(doc, &mut Vec::new(), &mut all);
    let path = all[rng.below(all.len() as u32) as usize].clone();
    let kind = rng.below(12);
    let el = at_mut(doc, &path);
    match kind {
        // A numeric attribute nudged.
        0..=2 => {
            let numeric: Vec<usize> =
                (0..el.attrs.len()).filter(|&i| el.attrs[i].1.trim().parse::<i64>().is_ok()).collect();
            if let Some(&i) = numeric.get(rng.below(numeric.len().max(1) as u32) as usize) {
                let v: i64 = el.attrs[i].1.trim().parse().unwrap();
                let d = [-2, -1, 1, 2, 0][rng.below(5) as usize];
                el.attrs[i].1 = if d == 0 { "-1".into() } else { (v + d).to_string() };
            }
        }
        // A step retyped.
        3 => {
            if el.name == "step" {
                let ty = ["s", "r", "rcs", "rrs", "rrc", "rrcs", "cpy", "re", "nop", "x"][rng.below(10) as usize];
                el.set("type", ty);
            }
        }
        // A buffer renamed.
        4 => {
            for k in ["srcbuf", "dstbuf"] {
                if el.get(k).is_some() && rng.coin() {
                    el.set(k, ["i", "o", "s"][rng.below(3) as usize]);
                }
            }
        }
        // An attribute dropped.
        5 => {
            if !el.attrs.is_empty() {
                let i = rng.below(el.attrs.len() as u32) as usize;
                el.attrs.remove(i);
            }
        }
        // A child dropped, duplicated or two swapped; steps renumbered (mostly).
        6..=8 => {
            if !el.kids.is_empty() {
                let i = rng.below(el.kids.len() as u32) as usize;
                match kind {
                    6 => {
                        el.kids.remove(i);
                    }
                    7 => {
                        let k = el.kids[i].clone();
                        el.kids.insert(i, k);
                    }
                    _ => {
                        let j = rng.below(el.kids.len() as u32) as usize;
                        el.kids.swap(i, j);
                    }
                }
                if rng.below(8) != 0 {
                    renumber(el);
                }
            }
        }
        // hasdep flipped, or a dependency added or redirected.
        9 => {
            if el.name == "step" {
                if rng.coin() {
                    let h = el.get("hasdep") == Some("1");
                    el.set("hasdep", (!h) as u32);
                } else {
                    el.set("depid", rng.below(4));
                    el.set("deps", rng.below(6));
                }
            }
        }
        // Placement claims changed.
        10 => {
            let root = doc;
            match rng.below(4) {
                0 => root.set("inplace", rng.below(2)),
                1 => root.set("outofplace", rng.below(2)),
                2 => root.attrs.retain(|(k, _)| k != "inplace" && k != "outofplace"),
                _ => {
                    root.set("inplace", 1);
                    root.set("outofplace", 1);
                }
            }
        }
        // Peers or channel of a thread block changed.
        _ => {
            if el.name == "tb" {
                let k = ["send", "recv", "chan"][rng.below(3) as usize];
                el.set(k, rng.below(4) as i64 - 1);
            }
        }
    }
}

/// A mutation of the text itself: cut short, a byte dropped or doubled, a quote or bracket added.
pub fn mutate_text(xml: &str, rng: &mut Rng) -> String {
    let b = xml.as_bytes();
    if b.is_empty() {
        return String::new();
    }
    let i = rng.below(b.len() as u32) as usize;
    let mut v = b.to_vec();
    match rng.below(5) {
        0 => v.truncate(i),
        1 => {
            v.remove(i);
        }
        2 => v.insert(i, b[i]),
        3 => v.insert(i, b"<>\"/="[rng.below(5) as usize]),
        _ => {
            let cut = xml.rfind("</algo>").unwrap_or(xml.len());
            v.truncate(cut);
        }
    }
    String::from_utf8_lossy(&v).into_owned()
}
