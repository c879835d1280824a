//! From rows to charts: which charts a set of logs gives, their series and their points.
//!
//! A series is the rows that share everything but the x value (the log, the mover, the CTAs, ...);
//! its legend names only what differs between the series of its chart. Points with the same x in
//! one series (a size measured twice) are averaged; points that cannot be drawn (a non-positive x
//! on a log axis, a value that is not finite) are left out.

use super::Kind;
use super::rows::{CollectivePoint, Row};
use std::collections::BTreeMap;

/// The rows of one log and its label.
pub struct Source<'a> {
    /// The label of its series where several logs are drawn together.
    pub label: &'a str,
    /// Its rows.
    pub rows: &'a [Row],
}

/// What the x axis counts. Both are drawn on a log-2 scale.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Axis {
    /// Bytes: ticks read `64K`, `1M`, `1G` (powers of 1024, as the benchmarks' `-b` and `-e`).
    Bytes,
    /// A count (CTAs).
    Count,
}

/// One line of a chart.
#[derive(Clone, Debug)]
pub struct Series {
    /// Its legend.
    pub label: String,
    /// (x, y), x increasing.
    pub points: Vec<(f64, f64)>,
    /// Dashed: the in-place side of an nccl-tests row.
    pub dashed: bool,
    /// Its colour, an index into the palette: the two sides of one configuration share one.
    pub color: usize,
}

/// A horizontal reference line (cuMemcpyDtoD's bandwidth, no overlap).
#[derive(Clone, Debug)]
pub struct Reference {
    /// Its legend.
    pub label: String,
    /// Its value.
    pub y: f64,
}

/// A chart to draw.
#[derive(Clone, Debug)]
pub struct Chart {
    /// The kind of chart.
    pub kind: Kind,
    /// The file name without extension (`busbw-all_reduce`).
    pub stem: String,
    /// The caption.
    pub title: String,
    /// What x counts.
    pub x: Axis,
    /// The x axis' description.
    pub x_desc: String,
    /// The y axis' description.
    pub y_desc: String,
    /// The lines.
    pub series: Vec<Series>,
    /// Reference lines.
    pub references: Vec<Reference>,
}

impl Chart {
    /// Points over every series.
    pub fn points(&self) -> usize {
        self.series.iter().map(|s| s.points.len()).sum()
    }
}

/// What tells a series from the others of its chart: (field, value) pairs in the order a legend
/// reads them. Empty values are left out of legends.
type Key = Vec<(&'static str, String)>;

/// A series being built: x (as bits, positive only) → the values measured there.
type Points = BTreeMap<u64, Vec<f64>>;

/// The series of charts being built, each chart and series in the order their first row came.
#[derive(Default)]
struct Builder {
    charts: Vec<(String, Vec<(Key, Points)>)>,
}

/// A series key's field that says which side of an nccl-tests row it is: in place is dashed, in
/// the colour of the out-of-place line of the same configuration.
const SIDE: &str = "side";

impl Builder {
    /// Adds (x, y) to the series `key` of chart `chart`, where it can be drawn.
    fn add(&mut self, chart: &str, key: Key, x: f64, y: Option<f64>) {
        let Some(y) = y.filter(|y| y.is_finite()) else { return };
        if !(x.is_finite() && x > 0.0) {
            return;
        }
        let c = match self.charts.iter().position(|(name, _)| name == chart) {
            Some(c) => c,
            None => {
                self.charts.push((chart.to_owned(), Vec::new()));
                self.charts.len() - 1
            }
        };
        let series = &mut self.charts[c].1;
        let s = match series.iter().position(|(k, _)| *k == key) {
            Some(s) => s,
            None => {
                series.push((key, Points::new()));
                series.len() - 1
            }
        };
        // The bits of positive finite floats order as the floats do.
        series[s].1.entry(x.to_bits()).or_default().push(y);
    }

    /// Each chart's series, labelled by what differs between them.
    fn finish(self) -> Vec<(String, Vec<Series>)> {
        self.charts
            .into_iter()
            .map(|(chart, series)| {
                let keys: Vec<&Key> = series.iter().map(|(k, _)| k).collect();
                let labels = labels(&keys);
                // One colour per configuration, its two sides alike.
                let mut configurations: Vec<Key> = Vec::new();
                let series = series
                    .iter()
                    .zip(labels)
                    .map(|((key, points), label)| {
                        let configuration: Key = key.iter().filter(|f| f.0 != SIDE).cloned().collect();
                        let color = configurations.iter().position(|c| *c == configuration).unwrap_or_else(|| {
                            configurations.push(configuration);
                            configurations.len() - 1
                        });
                        Series {
                            label,
                            points: points
                                .iter()
                                .map(|(&x, ys)| (f64::from_bits(x), ys.iter().sum::<f64>() / ys.len() as f64))
                                .collect(),
                            dashed: key.iter().any(|f| f.0 == SIDE && f.1 == IN_PLACE),
                            color,
                        }
                    })
                    .collect();
                (chart, series)
            })
            .collect()
    }
}

/// Legends for the series of one chart: the fields that tell them apart, taken in key order (the
/// log first) where each splits series that the fields before it leave together; where one series
/// is alone, its second field (the first is the log: the mover, the execution, ...).
fn labels(keys: &[&Key]) -> Vec<String> {
    let Some(first) = keys.first() else { return Vec::new() };
    let groups = |fields: &[usize]| {
        keys.iter()
            .map(|k| fields.iter().map(|&i| k.get(i).map(|f| f.1.as_str())).collect::<Vec<_>>())
            .collect::<std::collections::BTreeSet<_>>()
            .len()
    };
    let mut shown: Vec<usize> = Vec::new();
    for i in 0..first.len() {
        let before = groups(&shown);
        shown.push(i);
        if groups(&shown) == before {
            shown.pop();
        }
    }
    if shown.is_empty() {
        shown.push(1.min(first.len().saturating_sub(1)));
    }
    keys.iter()
        .map(|k| {
            let parts: Vec<String> = shown
                .iter()
                .filter_map(|&i| k.get(i))
                .filter(|(_, v)| !v.is_empty())
                .map(|(f, v)| field(f, v))
                .collect();
            if parts.is_empty() { "-".to_string() } else { parts.join(", ") }
        })
        .collect()
}

/// A field's value as a legend reads it.
fn field(name: &str, value: &str) -> String {
    match name {
        "ctas" => format!("{value} CTAs"),
        "ranks" => format!("{value} ranks"),
        "suspend" => format!("suspend {value} ns"),
        "bytes" => format!("{value} buffers"),
        _ => value.to_owned(),
    }
}

/// How a collective's name reads in a caption.
fn collective_title(name: &str) -> &str {
    match name {
        "all_reduce" => "AllReduce",
        "reduce_scatter" => "ReduceScatter",
        "all_gather" => "AllGather",
        "broadcast" => "Broadcast",
        "reduce" => "Reduce",
        "all_to_all" => "AllToAll",
        other => other,
    }
}

/// The side scripts/nccl_bench.py runs each collective on (torch's forms): in place for
/// AllReduce, Broadcast and Reduce, out of place for ReduceScatter and AllGather. The comparison
/// takes oxccl's rows on the same side.
fn nccl_in_place(collective: &str) -> bool {
    !matches!(collective, "reduce_scatter" | "all_gather")
}

/// A size as the benchmarks' flags write it: `512`, `64K`, `1M`, `3G` (powers of 1024), or in
/// bytes where it is not a whole multiple.
pub fn size_name(bytes: f64) -> String {
    for (unit, scale) in [("G", (1u64 << 30) as f64), ("M", (1u64 << 20) as f64), ("K", 1024.0)] {
        if bytes >= scale && (bytes / scale).fract() == 0.0 {
            return format!("{}{unit}", bytes / scale);
        }
    }
    format!("{bytes}")
}

/// The oxccl collective row's common series fields (after the log's label).
fn collective_key(label: &str, c: &CollectivePoint) -> Key {
    vec![
        ("source", label.to_owned()),
        ("mover", c.mover.clone()),
        ("reduction", c.reduction.clone()),
        ("ctas", c.ctas.to_string()),
        ("ranks", c.ranks.to_string()),
        ("dtype", c.dtype.clone()),
    ]
}

fn with(mut key: Key, field: &'static str, value: &str) -> Key {
    key.push((field, value.to_owned()));
    key
}

const OUT_OF_PLACE: &str = "out of place";
const IN_PLACE: &str = "in place";

/// Busbw against size per collective, out of place (solid) and in place (dashed), for oxccl's
/// collective rows.
fn busbw(sources: &[Source]) -> Vec<Chart> {
    let mut b = Builder::default();
    for s in sources {
        for row in s.rows {
            if let Row::Collective(c) = row
                && c.plan.is_none()
                && c.exec.is_none()
            {
                let key = collective_key(s.label, c);
                b.add(&c.collective, with(key.clone(), SIDE, OUT_OF_PLACE), c.size, c.oop_busbw);
                b.add(&c.collective, with(key, SIDE, IN_PLACE), c.size, c.ip_busbw);
            }
        }
    }
    b.finish()
        .into_iter()
        .map(|(collective, series)| Chart {
            kind: Kind::Busbw,
            stem: format!("busbw-{collective}"),
            title: format!("{} bus bandwidth", collective_title(&collective)),
            x: Axis::Bytes,
            x_desc: "size per rank (bytes)".into(),
            y_desc: "busbw (GB/s)".into(),
            series,
            references: Vec::new(),
        })
        .collect()
}

/// One line per engine (TMA, SIMT, NCCL) and log per collective, on the side NCCL's script runs.
fn compare(sources: &[Source]) -> Vec<Chart> {
    let mut b = Builder::default();
    for s in sources {
        for row in s.rows {
            match row {
                Row::Collective(c) if c.plan.is_none() && c.exec.is_none() => {
                    let busbw = if nccl_in_place(&c.collective) { c.ip_busbw } else { c.oop_busbw };
                    let mut key = collective_key(s.label, c);
                    key.truncate(5);
                    b.add(&c.collective, key, c.size, busbw);
                }
                Row::Nccl(n) => {
                    let ctas = match &n.nccl_max_ctas {
                        serde_json::Value::String(v) => v.clone(),
                        serde_json::Value::Null => String::new(),
                        v => v.to_string(),
                    };
                    let key = vec![
                        ("source", s.label.to_owned()),
                        ("mover", "nccl".to_owned()),
                        ("reduction", String::new()),
                        ("ctas", ctas),
                        ("ranks", n.ranks.to_string()),
                    ];
                    b.add(&n.collective, key, n.size, Some(n.busbw));
                }
                _ => {}
            }
        }
    }
    b.finish()
        .into_iter()
        .map(|(collective, series)| Chart {
            kind: Kind::Compare,
            stem: format!("compare-{collective}"),
            title: format!("{}: oxccl and NCCL", collective_title(&collective)),
            x: Axis::Bytes,
            x_desc: "size per rank (bytes)".into(),
            y_desc: format!("busbw (GB/s), {}", if nccl_in_place(&collective) { IN_PLACE } else { OUT_OF_PLACE }),
            series,
            references: Vec::new(),
        })
        .collect()
}

/// Busbw against size per transfer program, one line per execution and log (`engine`; logs from
/// before the FIFO plans were removed also hold `compiled`, `interpreted` and `direct`).
fn exec(sources: &[Source]) -> Vec<Chart> {
    let mut b = Builder::default();
    for s in sources {
        for row in s.rows {
            if let Row::Collective(c) = row
                && (c.plan.is_some() || c.exec.is_some())
            {
                let plan = c.plan.clone().unwrap_or_default();
                let chart = if plan.is_empty() { c.collective.clone() } else { format!("{plan}\u{0}{}", c.collective) };
                let mut key = collective_key(s.label, c);
                key.insert(1, ("exec", c.exec.clone().unwrap_or_else(|| "?".into())));
                b.add(&chart, with(key.clone(), SIDE, OUT_OF_PLACE), c.size, c.oop_busbw);
                b.add(&chart, with(key, SIDE, IN_PLACE), c.size, c.ip_busbw);
            }
        }
    }
    b.finish()
        .into_iter()
        .map(|(chart, series)| {
            let (plan, collective) = chart.split_once('\u{0}').unwrap_or(("", &chart));
            let name = if plan.is_empty() { collective_title(collective).to_owned() } else { plan.to_owned() };
            Chart {
                kind: Kind::Exec,
                stem: format!("exec-{name}"),
                title: format!("{name}: by execution"),
                x: Axis::Bytes,
                x_desc: "size per rank (bytes)".into(),
                y_desc: "busbw (GB/s)".into(),
                series,
                references: Vec::new(),
            }
        })
        .collect()
}

/// GB/s against CTAs per mover-sweep operation, with cuMemcpyDtoD's rate of each log.
fn movers(sources: &[Source]) -> Vec<Chart> {
    let mut b = Builder::default();
    // chart → (log, bytes) → the memcpy rates the rows imply.
    let mut memcpy: BTreeMap<String, BTreeMap<(String, String), Vec<f64>>> = BTreeMap::new();
    for s in sources {
        for row in s.rows {
            if let Row::Mover(m) = row {
                let bytes = if m.bytes > 0.0 { size_name(m.bytes) } else { String::new() };
                let key = vec![("source", s.label.to_owned()), ("mover", m.mover.clone()), ("bytes", bytes.clone())];
                b.add(&m.op, key, m.ctas, Some(m.gbps));
                let rate = m.gbps / m.of_memcpy;
                if rate.is_finite() && rate > 0.0 {
                    memcpy.entry(m.op.clone()).or_default().entry((s.label.to_owned(), bytes)).or_default().push(rate);
                }
            }
        }
    }
    b.finish()
        .into_iter()
        .map(|(op, series)| {
            let references = memcpy
                .get(&op)
                .map(|m| {
                    let logs = m.keys().map(|k| &k.0).collect::<std::collections::BTreeSet<_>>().len();
                    let sizes = m.keys().map(|k| &k.1).collect::<std::collections::BTreeSet<_>>().len();
                    m.iter()
                        .map(|((log, bytes), rates)| {
                            let mut label = "cuMemcpyDtoD".to_string();
                            if logs > 1 {
                                label += &format!(", {log}");
                            }
                            if sizes > 1 && !bytes.is_empty() {
                                label += &format!(", {bytes}");
                            }
                            Reference { label, y: rates.iter().sum::<f64>() / rates.len() as f64 }
                        })
                        .collect()
                })
                .unwrap_or_default();
            Chart {
                kind: Kind::Movers,
                stem: format!("movers-{op}"),
                title: format!("mover sweep: {op}"),
                x: Axis::Count,
                x_desc: "CTAs".into(),
                y_desc: "GB/s (bytes read + written)".into(),
                series,
                references,
            }
        })
        .collect()
}

/// Makespan over the serial time against the collective's CTAs, per compute load.
fn overlap(sources: &[Source]) -> Vec<Chart> {
    let mut b = Builder::default();
    for s in sources {
        for row in s.rows {
            if let Row::Overlap(o) = row {
                let key = vec![
                    ("source", s.label.to_owned()),
                    ("mover", o.mover.clone()),
                    ("reduction", o.reduction.clone()),
                    ("suspend", o.suspend_ns.to_string()),
                ];
                b.add(&o.compute, key, o.ctas, Some(o.makespan_over_serial));
            }
        }
    }
    b.finish()
        .into_iter()
        .map(|(compute, series)| Chart {
            kind: Kind::Overlap,
            stem: format!("overlap-{compute}"),
            title: format!("AllReduce beside {compute}"),
            x: Axis::Count,
            x_desc: "the collective's CTAs per rank".into(),
            y_desc: "makespan / (compute alone + collective alone)".into(),
            series,
            references: vec![Reference { label: "no overlap".into(), y: 1.0 }],
        })
        .collect()
}

/// The charts of `kind` (never [`Kind::Auto`]) that the sources' rows give.
pub fn charts(kind: Kind, sources: &[Source]) -> Vec<Chart> {
    match kind {
        Kind::Auto => Vec::new(),
        Kind::Busbw => busbw(sources),
        Kind::Compare => compare(sources),
        Kind::Exec => exec(sources),
        Kind::Movers => movers(sources),
        Kind::Overlap => overlap(sources),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_read_as_the_flags_write_them() {
        assert_eq!(size_name(512.0), "512");
        assert_eq!(size_name(65536.0), "64K");
        assert_eq!(size_name((1u64 << 30) as f64), "1G");
        assert_eq!(size_name(1536.0 * 1024.0), "1536K");
        assert_eq!(size_name(1000.0), "1000");
    }

    #[test]
    fn legends_name_what_differs() {
        let k = |m: &str, c: &str| vec![("source", "a".to_string()), ("mover", m.to_string()), ("ctas", c.to_string())];
        let (a, b, c) = (k("tma", "8"), k("simt", "8"), k("tma", "16"));
        assert_eq!(labels(&[&a, &b, &c]), ["tma, 8 CTAs", "simt, 8 CTAs", "tma, 16 CTAs"]);
        assert_eq!(labels(&[&a, &b]), ["tma", "simt"]);
        assert_eq!(labels(&[&a]), ["tma"]);
        assert!(labels(&[]).is_empty());
        // A log per engine: the logs' labels say it all.
        let l = |log: &str, m: &str| vec![("source", log.to_string()), ("mover", m.to_string())];
        let (t, s, n) = (l("TMA", "tma"), l("SIMT", "simt"), l("NCCL", "nccl"));
        assert_eq!(labels(&[&t, &s, &n]), ["TMA", "SIMT", "NCCL"]);
    }

    #[test]
    fn points_that_cannot_be_drawn_are_left_out_and_repeats_averaged() {
        let mut b = Builder::default();
        let key = vec![("source", "a".to_string()), ("mover", "tma".to_string())];
        for (x, y) in
            [(0.0, Some(1.0)), (-4.0, Some(1.0)), (f64::NAN, Some(1.0)), (8.0, None), (8.0, Some(f64::INFINITY))]
        {
            b.add("c", key.clone(), x, y);
        }
        assert!(b.charts.is_empty());
        b.add("c", key.clone(), 8.0, Some(1.0));
        b.add("c", key.clone(), 8.0, Some(3.0));
        b.add("c", key, 2.0, Some(5.0));
        let charts = b.finish();
        assert_eq!(charts[0].1[0].points, [(2.0, 5.0), (8.0, 2.0)]);
    }
}
