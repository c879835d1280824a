//! Plan dumps: a stable text form ([`ReshardPlan`]'s `Display`, used by the golden tests) and the JSON
//! report printed by `oxccl reshard --json` ([`PlanReport`]).

use super::layout::{Layout, Rank, Region};
use super::plan::{ReadFrom, ReshardPlan, Route, Transfer};
use super::traffic::Workaround;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt;
use std::io;

fn list(values: &[u64]) -> String {
    values.iter().map(u64::to_string).collect::<Vec<_>>().join(", ")
}

/// `2 x 3 x 16B`: loop extents, then the run in bytes.
fn box_text(t: &Transfer) -> String {
    let (run, outer) = t.shape.split_last().unwrap_or((&0, &[]));
    let mut parts: Vec<String> = outer.iter().map(u64::to_string).collect();
    parts.push(format!("{run}B"));
    parts.join(" x ")
}

impl fmt::Display for Transfer {
    /// One line: `0 -> 4 read src@0 write @32 32B box 32B region [1..2, 0..8]`, with strides when the
    /// box has loops; a sum of partial sums names every source, `0+1 -> 4 …`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let read = match self.read {
            ReadFrom::Src => "src",
            ReadFrom::Dst => "dst",
        };
        let sources: Vec<String> = self.sources().map(|r| r.to_string()).collect();
        write!(
            f,
            "{} -> {} read {read}@{} write @{} {}B box {}",
            sources.join("+"),
            self.dst,
            self.src_offset,
            self.dst_offset,
            self.bytes,
            box_text(self)
        )?;
        if !self.is_contiguous() {
            write!(f, " strides read [{}] write [{}]", list(&self.src_strides), list(&self.dst_strides))?;
        }
        write!(f, " region {}", self.region)
    }
}

impl fmt::Display for ReshardPlan {
    /// The stable text form: header, every transfer by stage, the traffic figures.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let o = self.options();
        writeln!(
            f,
            "reshard shape [{}] elem {}B route {} domain_size {} min_split {}B",
            list(self.shape()),
            self.elem_bytes(),
            o.route,
            o.domain_size,
            o.min_split_bytes
        )?;
        for (side, sharding) in [("src", self.src_sharding()), ("dst", self.dst_sharding())] {
            writeln!(f, "{side} {}", sharding.layout())?;
            for rank in sharding.mesh().ranks() {
                let region = sharding.local_region(rank).unwrap_or_else(|| Region::full(&[]));
                writeln!(f, "  rank {rank}: {} ({}B)", region, region.volume() * self.elem_bytes())?;
            }
        }
        for (s, stage) in self.stages().iter().enumerate() {
            writeln!(f, "stage {s}: {} transfers", stage.transfers.len())?;
            for t in &stage.transfers {
                writeln!(f, "  {t}")?;
            }
        }
        let t = self.traffic();
        writeln!(
            f,
            "traffic: total {}B (intra-domain {}B, cross-domain {}B), local {}B, needed {}B",
            t.bytes_total, t.bytes_intra_domain, t.bytes_cross_domain, t.bytes_local, t.bytes_needed
        )?;
        let injected: Vec<String> = t.bytes_injected_per_domain.iter().map(|(d, b)| format!("{d}: {b}B")).collect();
        writeln!(f, "  injected per domain: {}", injected.join(", "))?;
        writeln!(
            f,
            "  busiest rank: sends {}B, receives {}B",
            t.max_bytes_sent_by_a_rank, t.max_bytes_received_by_a_rank
        )?;
        writeln!(
            f,
            "  flat sends: total {}B, cross-domain {}B",
            t.flat_sends.bytes_total, t.flat_sends.bytes_cross_domain
        )?;
        writeln!(
            f,
            "  gather+broadcast: total {}B, cross-domain {}B",
            t.gather_broadcast.bytes_total, t.gather_broadcast.bytes_cross_domain
        )
    }
}

/// One transfer in the JSON report: the [`Transfer`] with its stage, the box shape and strides only
/// when the box is strided.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TransferRow {
    /// Stage index (0: from source buffers; 1: forwarding inside destination domains).
    pub stage: usize,
    /// The rank whose buffer is read.
    pub src: Rank,
    /// The other ranks read and summed with `src` (a `Partial` source); absent for a copy.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub partials: Vec<Rank>,
    /// The rank whose destination buffer is written.
    pub dst: Rank,
    /// Which of `src`'s buffers is read.
    pub read: ReadFrom,
    /// Byte offset in the buffer read.
    pub src_offset: u64,
    /// Byte offset in `dst`'s destination buffer.
    pub dst_offset: u64,
    /// Bytes copied.
    pub bytes: u64,
    /// Loop extents then the run in bytes; absent for a contiguous copy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shape: Option<Vec<u64>>,
    /// Read-side byte strides of the loops; absent for a contiguous copy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub src_strides: Option<Vec<u64>>,
    /// Write-side byte strides of the loops; absent for a contiguous copy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dst_strides: Option<Vec<u64>>,
    /// The global box copied, in elements.
    pub region: Region,
}

/// Both workarounds' figures.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Workarounds {
    /// Flat direct sends of every destination shard to every replica.
    pub flat_sends: Workaround,
    /// Gather to the source mesh's first rank, then broadcast.
    pub gather_broadcast: Workaround,
}

/// The JSON report of a plan (`oxccl reshard --json`). Field meanings are those of
/// [`super::Traffic`]; `bytes_flat_sends` and `bytes_gather_broadcast` are the workarounds' totals.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlanReport {
    /// The global shape.
    pub shape: Vec<u64>,
    /// The element type's name, when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dtype: Option<String>,
    /// Bytes per element.
    pub elem_bytes: u64,
    /// The source layout.
    pub src: Layout,
    /// The destination layout.
    pub dst: Layout,
    /// The route.
    pub route: Route,
    /// Ranks per NVLink domain.
    pub domain_size: u32,
    /// The hierarchical route's split threshold.
    pub min_split_bytes: u64,
    /// Every transfer, stage by stage.
    pub transfers: Vec<TransferRow>,
    /// Bytes the plan copies between two different ranks.
    pub bytes_total: u64,
    /// Bytes destinations lack (the direct-delivery minimum).
    pub bytes_needed: u64,
    /// Bytes copied within one rank.
    pub bytes_local: u64,
    /// Part of `bytes_total` inside one domain.
    pub bytes_intra_domain: u64,
    /// Part of `bytes_total` across domains.
    pub bytes_cross_domain: u64,
    /// Per destination domain, bytes entering it from outside.
    pub bytes_injected_per_domain: BTreeMap<u32, u64>,
    /// The most bytes one rank sends.
    pub max_bytes_sent_by_a_rank: u64,
    /// The most bytes one rank receives.
    pub max_bytes_received_by_a_rank: u64,
    /// Total of the flat-sends workaround.
    pub bytes_flat_sends: u64,
    /// Total of the gather-then-broadcast workaround.
    pub bytes_gather_broadcast: u64,
    /// Both workarounds in detail.
    pub workarounds: Workarounds,
    /// The outcome of `--verify`, when it ran.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verify: Option<VerifySummary>,
}

/// The outcome of a verification in the JSON report.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct VerifySummary {
    /// Destination elements checked.
    pub elements_checked: u64,
    /// Elements that differ from the global tensor.
    pub mismatches: u64,
}

impl PlanReport {
    /// The report of `plan`, with an optional dtype name.
    pub fn new(plan: &ReshardPlan, dtype: Option<&str>) -> Self {
        let t = plan.traffic();
        let transfers = plan
            .transfers()
            .map(|(stage, tr)| {
                let strided = !tr.is_contiguous();
                TransferRow {
                    stage,
                    src: tr.src,
                    partials: tr.partials.clone(),
                    dst: tr.dst,
                    read: tr.read,
                    src_offset: tr.src_offset,
                    dst_offset: tr.dst_offset,
                    bytes: tr.bytes,
                    shape: strided.then(|| tr.shape.clone()),
                    src_strides: strided.then(|| tr.src_strides.clone()),
                    dst_strides: strided.then(|| tr.dst_strides.clone()),
                    region: tr.region.clone(),
                }
            })
            .collect();
        Self {
            shape: plan.shape().to_vec(),
            dtype: dtype.map(str::to_owned),
            elem_bytes: plan.elem_bytes(),
            src: plan.src().clone(),
            dst: plan.dst().clone(),
            route: plan.options().route,
            domain_size: plan.options().domain_size,
            min_split_bytes: plan.options().min_split_bytes,
            transfers,
            bytes_total: t.bytes_total,
            bytes_needed: t.bytes_needed,
            bytes_local: t.bytes_local,
            bytes_intra_domain: t.bytes_intra_domain,
            bytes_cross_domain: t.bytes_cross_domain,
            bytes_injected_per_domain: t.bytes_injected_per_domain.clone(),
            max_bytes_sent_by_a_rank: t.max_bytes_sent_by_a_rank,
            max_bytes_received_by_a_rank: t.max_bytes_received_by_a_rank,
            bytes_flat_sends: t.flat_sends.bytes_total,
            bytes_gather_broadcast: t.gather_broadcast.bytes_total,
            workarounds: Workarounds { flat_sends: t.flat_sends, gather_broadcast: t.gather_broadcast },
            verify: None,
        }
    }

    /// The report as JSON: one top-level field per line and one transfer per line, so that large
    /// reports stay readable and diffs stay small. Ends with a newline.
    pub fn to_json(&self) -> String {
        let mut out = Vec::new();
        let mut ser = serde_json::Serializer::with_formatter(&mut out, Lines::default());
        // Serializing plain data (no maps with non-string keys, no failing Serialize impls) into
        // memory cannot fail.
        self.serialize(&mut ser).expect("a report serializes");
        out.push(b'\n');
        String::from_utf8(out).expect("serde_json writes UTF-8")
    }
}

/// A JSON layout: the top-level object's fields one per line, objects inside top-level arrays one per
/// line, everything deeper on one line with `", "` and `": "` separators.
#[derive(Default)]
struct Lines {
    /// Open containers, outermost first: (is an array, lines were broken inside).
    open: Vec<(bool, bool)>,
}

impl serde_json::ser::Formatter for Lines {
    fn begin_object<W: ?Sized + io::Write>(&mut self, w: &mut W) -> io::Result<()> {
        if self.open.len() == 2 && self.open[1].0 {
            self.open[1].1 = true;
            w.write_all(b"\n    ")?;
        }
        self.open.push((false, false));
        w.write_all(b"{")
    }

    fn end_object<W: ?Sized + io::Write>(&mut self, w: &mut W) -> io::Result<()> {
        self.open.pop();
        w.write_all(if self.open.is_empty() { b"\n}" } else { b"}" })
    }

    fn begin_object_key<W: ?Sized + io::Write>(&mut self, w: &mut W, first: bool) -> io::Result<()> {
        if !first {
            w.write_all(b",")?;
        }
        if self.open.len() == 1 {
            w.write_all(b"\n  ")
        } else if !first {
            w.write_all(b" ")
        } else {
            Ok(())
        }
    }

    fn begin_object_value<W: ?Sized + io::Write>(&mut self, w: &mut W) -> io::Result<()> {
        w.write_all(b": ")
    }

    fn begin_array<W: ?Sized + io::Write>(&mut self, w: &mut W) -> io::Result<()> {
        self.open.push((true, false));
        w.write_all(b"[")
    }

    fn end_array<W: ?Sized + io::Write>(&mut self, w: &mut W) -> io::Result<()> {
        let broke = self.open.pop().is_some_and(|(_, broke)| broke);
        w.write_all(if broke { b"\n  ]" } else { b"]" })
    }

    fn begin_array_value<W: ?Sized + io::Write>(&mut self, w: &mut W, first: bool) -> io::Result<()> {
        if first {
            Ok(())
        } else if self.open.last().is_some_and(|&(_, broke)| broke) {
            // The next object of a top-level array of objects: it breaks the line itself.
            w.write_all(b",")
        } else {
            w.write_all(b", ")
        }
    }
}
