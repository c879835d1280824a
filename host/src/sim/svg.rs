//! SVG timelines of a simulation: one lane per link (flows) and per thread block (tasks), like the
//! ResCCL paper's figures.

use super::{SimReport, SpanKind};
use crate::compile::Prim;
use std::fmt::Write;

fn color(kind: SpanKind) -> &'static str {
    match kind {
        SpanKind::Task(Prim::Send) => "#4e79a7",
        SpanKind::Task(Prim::Recv) => "#59a14f",
        SpanKind::Task(Prim::RecvReduceCopy) => "#f28e2b",
        SpanKind::Task(Prim::Copy) => "#b07aa1",
        SpanKind::Task(Prim::Reduce) => "#e15759",
        SpanKind::IntraFlow => "#76b7b2",
        SpanKind::InterFlow => "#edc948",
    }
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

/// Draws the report's timeline (empty lanes if it was simulated without `timeline`).
pub fn timeline(report: &SimReport, title: &str) -> String {
    let lane_h = 12.0;
    let label_w = 110.0;
    let plot_w = 1400.0;
    let top = 40.0;
    let h = top + lane_h * report.lanes.len() as f64 + 30.0;
    let w = label_w + plot_w + 20.0;
    let t = report.time_us.max(1e-9);
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w:.0}" height="{h:.0}" viewBox="0 0 {w:.0} {h:.0}" font-family="monospace" font-size="9">"#
    );
    let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="4" y="14" font-size="12">{} — {:.1} us, algbw {:.1} GB/s, busbw {:.1} GB/s, mean TB idle {:.0}%</text>"#,
        escape(title),
        report.time_us,
        report.algbw_gbps,
        report.busbw_gbps,
        report.mean_tb_idle_share * 100.0
    );
    let legend = [
        ("send", SpanKind::Task(Prim::Send)),
        ("recv", SpanKind::Task(Prim::Recv)),
        ("rrc", SpanKind::Task(Prim::RecvReduceCopy)),
        ("copy", SpanKind::Task(Prim::Copy)),
        ("reduce", SpanKind::Task(Prim::Reduce)),
        ("intra flow", SpanKind::IntraFlow),
        ("inter flow", SpanKind::InterFlow),
    ];
    for (k, (name, kind)) in legend.iter().enumerate() {
        let x = 4.0 + k as f64 * 90.0;
        let _ = writeln!(s, r#"<rect x="{x:.1}" y="22" width="10" height="8" fill="{}"/>"#, color(*kind));
        let _ = writeln!(s, r#"<text x="{:.1}" y="30">{name}</text>"#, x + 13.0);
    }
    for (i, name) in report.lanes.iter().enumerate() {
        let y = top + i as f64 * lane_h;
        if i % 2 == 0 {
            let _ = writeln!(s, r##"<rect x="0" y="{y:.1}" width="{w:.0}" height="{lane_h}" fill="#f4f4f4"/>"##);
        }
        let _ = writeln!(s, r#"<text x="2" y="{:.1}">{}</text>"#, y + lane_h - 3.0, escape(name));
    }
    for sp in &report.timeline {
        let x = label_w + sp.start_us / t * plot_w;
        let bw = ((sp.end_us - sp.start_us) / t * plot_w).max(0.3);
        let y = top + sp.lane as f64 * lane_h + 1.0;
        let _ = writeln!(
            s,
            r#"<rect x="{x:.2}" y="{y:.1}" width="{bw:.2}" height="{:.1}" fill="{}"/>"#,
            lane_h - 2.0,
            color(sp.kind)
        );
    }
    let axis_y = top + lane_h * report.lanes.len() as f64 + 14.0;
    for k in 0..=10 {
        let x = label_w + k as f64 / 10.0 * plot_w;
        let _ = writeln!(s, r#"<text x="{x:.1}" y="{axis_y:.1}">{:.0}us</text>"#, t * k as f64 / 10.0);
    }
    s.push_str("</svg>\n");
    s
}
