//! Shared test helpers: random *valid* transfer programs and paths to the MSCCL files.
//!
//! A random program computes its collective by construction: every chunk travels a random
//! broadcast tree (gathers) or a random reduction tree (reductions), sometimes through scratch with
//! a local copy or reduce, on random channels, with the ops of different chunks randomly interleaved
//! (each chunk's own ops stay in order).

#![allow(dead_code)]

use oxccl_host::program::{BufferKind, BufferLayout, Collective, Op, OpKind, Program, Rank, RecvOp, Slice};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng as _, RngExt, SeedableRng};
use std::path::PathBuf;

/// A seeded generator (rand's `StdRng`) with the few draws the tests make.
pub struct Rng(StdRng);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(StdRng::seed_from_u64(seed))
    }
    pub fn next(&mut self) -> u64 {
        self.0.next_u64()
    }
    /// Uniform in `0..n` (0 for `n` of 0).
    pub fn below(&mut self, n: u32) -> u32 {
        self.0.random_range(0..n.max(1))
    }
    pub fn coin(&mut self) -> bool {
        self.0.random_bool(0.5)
    }
    pub fn shuffle<T>(&mut self, v: &mut [T]) {
        v.shuffle(&mut self.0);
    }
}

/// Program builder that keeps per-chunk op lists and scratch allocation.
struct Builder {
    rng: Rng,
    ranks: u32,
    channels: u32,
    scratch: Vec<u32>,
    chains: Vec<Vec<Op>>,
}

impl Builder {
    fn scratch_slot(&mut self, r: u32) -> Slice {
        let s = Slice::scratch(self.scratch[r as usize]);
        self.scratch[r as usize] += 1;
        s
    }
    #[allow(clippy::too_many_arguments)]
    fn xfer(&mut self, chain: usize, a: u32, src: Slice, b: u32, dst: Slice, op: RecvOp, chunk: u32) {
        let channel = self.rng.below(self.channels);
        let step = self.chains[chain].len() as u32;
        let stage = self.rng.below(2);
        self.chains[chain].push(Op {
            kind: OpKind::Transfer { src_rank: Rank(a), dst_rank: Rank(b), channel, src, dst, op },
            chunk,
            step,
            stage,
        });
    }
    fn local(&mut self, chain: usize, r: u32, src: Slice, dst: Slice, reduce: bool, chunk: u32) {
        let channel = self.rng.below(self.channels);
        let step = self.chains[chain].len() as u32;
        let stage = self.rng.below(2);
        let kind = if reduce {
            OpKind::Reduce { rank: Rank(r), channel, src, dst }
        } else {
            OpKind::Copy { rank: Rank(r), channel, src, dst }
        };
        self.chains[chain].push(Op { kind, chunk, step, stage });
    }

    /// Moves chunk location `loc` from `a` (which holds the value) to `b`'s `loc`, directly or
    /// through `b`'s scratch.
    fn deliver(&mut self, chain: usize, a: u32, src: Slice, b: u32, dst: Slice, chunk: u32) {
        if self.rng.below(4) == 0 {
            let s = self.scratch_slot(b);
            self.xfer(chain, a, src, b, s, RecvOp::Recv, chunk);
            self.local(chain, b, s, dst, false, chunk);
        } else {
            self.xfer(chain, a, src, b, dst, RecvOp::Recv, chunk);
        }
    }

    /// Reduces `a`'s partial at `src` into `b`'s `dst`, directly or through `b`'s scratch.
    fn accumulate(&mut self, chain: usize, a: u32, src: Slice, b: u32, dst: Slice, chunk: u32) {
        if self.rng.below(4) == 0 {
            let s = self.scratch_slot(b);
            self.xfer(chain, a, src, b, s, RecvOp::Recv, chunk);
            self.local(chain, b, s, dst, true, chunk);
        } else {
            self.xfer(chain, a, src, b, dst, RecvOp::RecvReduceCopy, chunk);
        }
    }

    /// A random broadcast of `loc(r)` from `root` to every rank.
    fn broadcast(&mut self, chain: usize, root: u32, loc: &dyn Fn(u32) -> Slice, chunk: u32) {
        let mut have = vec![root];
        let mut others: Vec<u32> = (0..self.ranks).filter(|&r| r != root).collect();
        self.rng.shuffle(&mut others);
        for d in others {
            let s = have[self.rng.below(have.len() as u32) as usize];
            self.deliver(chain, s, loc(s), d, loc(d), chunk);
            have.push(d);
        }
    }

    /// A random reduction of `loc(r)` over all ranks into `root`'s `loc(root)`.
    fn reduce(&mut self, chain: usize, root: u32, loc: &dyn Fn(u32) -> Slice, chunk: u32) {
        let mut order: Vec<u32> = (0..self.ranks).filter(|&r| r != root).collect();
        self.rng.shuffle(&mut order);
        order.push(root);
        for i in 0..order.len() - 1 {
            let u = order[i];
            let later = i + 1 + self.rng.below((order.len() - i - 1) as u32) as usize;
            let v = order[later];
            self.accumulate(chain, u, loc(u), v, loc(v), chunk);
        }
    }

    /// Interleaves the chains at random, keeping each chain's order.
    fn finish(mut self, name: &str, mut layout: BufferLayout, pre: Vec<Op>) -> Program {
        layout.scratch = self.scratch.clone();
        let mut p = Program::new(name, layout);
        p.ops.extend(pre);
        let mut heads = vec![0usize; self.chains.len()];
        let mut live: Vec<usize> = (0..self.chains.len()).filter(|&c| !self.chains[c].is_empty()).collect();
        while !live.is_empty() {
            let k = self.rng.below(live.len() as u32) as usize;
            let c = live[k];
            p.ops.push(self.chains[c][heads[c]]);
            heads[c] += 1;
            if heads[c] == self.chains[c].len() {
                live.swap_remove(k);
            }
        }
        p
    }
}

/// How many collectives [`nth_collective`] picks from.
#[allow(dead_code)]
pub const COLLECTIVES: usize = 6;

/// Collective `i` of [`Collective::every`] (modulo [`COLLECTIVES`]), a rooted one with its root
/// drawn from `seed` among `ranks`.
#[allow(dead_code)]
pub fn nth_collective(i: usize, seed: u64, ranks: u32) -> Collective {
    Collective::every((seed.rotate_left(17) % ranks.max(1) as u64) as u32)[i % COLLECTIVES]
}

/// A random valid program for `collective` on `ranks` ranks with `k` chunks per block.
pub fn random_program(seed: u64, collective: Collective, ranks: u32, k: u32, channels: u32) -> Program {
    let mut rng = Rng::new(seed);
    let in_place = match collective {
        Collective::AllToAll => false,
        _ => rng.coin(),
    };
    let chunks = match collective {
        Collective::AllReduce | Collective::Broadcast { .. } | Collective::Reduce { .. } => ranks * k + rng.below(3),
        _ => ranks * k,
    };
    let layout = BufferLayout::new(collective, ranks, chunks, in_place);
    let nchains = chunks as usize;
    let mut b = Builder { rng, ranks, channels, scratch: vec![0; ranks as usize], chains: vec![Vec::new(); nchains] };
    let mut pre = Vec::new();
    let lane = |b: &mut Builder| b.rng.below(b.channels);
    match collective {
        Collective::AllGather => {
            let ic = layout.input_chunks();
            for c in 0..chunks {
                let owner = c / ic;
                if !in_place {
                    let ch = lane(&mut b);
                    pre.push(Op {
                        kind: OpKind::Copy {
                            rank: Rank(owner),
                            channel: ch,
                            src: Slice::input(c % ic),
                            dst: Slice::output(c),
                        },
                        chunk: c,
                        step: 0,
                        stage: 0,
                    });
                }
                b.broadcast(c as usize, owner, &|_| Slice::output(c), c);
            }
        }
        Collective::ReduceScatter => {
            let oc = layout.output_chunks();
            for c in 0..chunks {
                let owner = c / oc;
                b.reduce(c as usize, owner, &|_| Slice::input(c), c);
                if !in_place {
                    b.local(c as usize, owner, Slice::input(c), Slice::output(c % oc), false, c);
                }
            }
        }
        Collective::AllReduce => {
            for c in 0..chunks {
                let root = b.rng.below(ranks);
                let buf = if in_place && b.rng.coin() { BufferKind::Output } else { BufferKind::Input };
                if in_place {
                    b.reduce(c as usize, root, &|_| Slice::new(buf, c, 1), c);
                    b.broadcast(c as usize, root, &|_| Slice::new(buf, c, 1), c);
                } else {
                    b.reduce(c as usize, root, &|_| Slice::input(c), c);
                    b.local(c as usize, root, Slice::input(c), Slice::output(c), false, c);
                    b.broadcast(c as usize, root, &|_| Slice::output(c), c);
                }
            }
        }
        Collective::Broadcast { root } => {
            for c in 0..chunks {
                if in_place {
                    b.broadcast(c as usize, root, &|_| Slice::input(c), c);
                } else {
                    b.local(c as usize, root, Slice::input(c), Slice::output(c), false, c);
                    b.broadcast(c as usize, root, &|_| Slice::output(c), c);
                }
            }
        }
        Collective::Reduce { root } => {
            for c in 0..chunks {
                b.reduce(c as usize, root, &|_| Slice::input(c), c);
                if !in_place {
                    b.local(c as usize, root, Slice::input(c), Slice::output(c), false, c);
                }
            }
        }
        Collective::AllToAll => {
            let blk = chunks / ranks;
            for r in 0..ranks {
                for q in 0..ranks {
                    for j in 0..blk {
                        let chain = (r * blk + j) as usize % nchains;
                        let (src, dst) = (Slice::input(q * blk + j), Slice::output(r * blk + j));
                        let chunk = q * blk + j;
                        if r == q {
                            b.local(chain, r, src, dst, false, chunk);
                        } else if ranks > 2 && b.rng.below(3) == 0 {
                            let mut m = b.rng.below(ranks);
                            while m == r || m == q {
                                m = (m + 1) % ranks;
                            }
                            let s = b.scratch_slot(m);
                            b.xfer(chain, r, src, m, s, RecvOp::Recv, chunk);
                            b.xfer(chain, m, s, q, dst, RecvOp::Recv, chunk);
                        } else {
                            b.xfer(chain, r, src, q, dst, RecvOp::Recv, chunk);
                        }
                    }
                }
            }
        }
    }
    b.finish(&format!("random_{}", collective.program_name()), layout, pre)
}

/// The folder with the bundled MSCCL files (always present in the repository).
pub fn bundled_msccl() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/msccl")
}

/// `../shared/msccl` next to the repository, when the checkout has it.
pub fn shared_msccl() -> Option<PathBuf> {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/msccl");
    p.is_dir().then_some(p)
}

/// The `.xml` files of a folder, sorted.
pub fn xml_files(dir: &std::path::Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok().map(|e| e.path())).filter(|p| p.extension().is_some_and(|e| e == "xml")).collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// Compares `actual` with the golden file `tests/golden/<name>`; `OXCCL_BLESS=1` rewrites it.
pub fn golden(name: &str, actual: &str) {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/golden").join(name);
    if std::env::var_os("OXCCL_BLESS").is_some() {
        std::fs::write(&path, actual).expect("write golden file");
        return;
    }
    let expected = std::fs::read_to_string(&path)
        .unwrap_or_else(|_| panic!("missing golden file {} (run with OXCCL_BLESS=1 to create it)", path.display()));
    if expected != actual {
        let first = expected.lines().zip(actual.lines()).position(|(a, b)| a != b);
        panic!(
            "{} differs from the golden file (first differing line: {:?}); rerun with OXCCL_BLESS=1 if the change is intended",
            path.display(),
            first.map(|i| i + 1)
        );
    }
}
