//! Drawing a [`Chart`]: an SVG with plotters, and on request a PNG of that SVG (resvg, with the
//! system's fonts for the text).

use super::charts::{Axis, Chart, size_name};
use plotters::prelude::*;

/// Pixels of every chart.
const SIZE: (u32, u32) = (960, 600);

/// Colours of the series, in order (Tableau 10: told apart in print and by most colour-blind
/// readers); a chart with more series starts again.
const PALETTE: [RGBColor; 10] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
];

/// The chart as SVG text, captioned `title`. An `Err` is plotters' message.
pub fn svg(chart: &Chart, title: &str) -> Result<String, String> {
    let mut text = String::new();
    {
        let root = SVGBackend::with_string(&mut text, SIZE).into_drawing_area();
        draw(&root, chart, title).map_err(|e| e.to_string())?;
        root.present().map_err(|e| e.to_string())?;
    }
    Ok(text)
}

/// The x range (in log-2 units) and the y range of the chart, padded, both finite and non-empty.
fn ranges(chart: &Chart) -> ((f64, f64), (f64, f64)) {
    let mut xs = chart.series.iter().flat_map(|s| s.points.iter().map(|p| p.0.log2()));
    let mut ys =
        chart.series.iter().flat_map(|s| s.points.iter().map(|p| p.1)).chain(chart.references.iter().map(|r| r.y));
    let span = |it: &mut dyn Iterator<Item = f64>| {
        it.filter(|v| v.is_finite())
            .fold(None, |acc: Option<(f64, f64)>, v| Some(acc.map_or((v, v), |(lo, hi)| (lo.min(v), hi.max(v)))))
    };
    let (x0, x1) = span(&mut xs).unwrap_or((0.0, 1.0));
    let (x0, x1) = (x0.floor(), x1.ceil());
    let x = if x1 > x0 { (x0, x1) } else { (x0 - 1.0, x1 + 1.0) };
    let (y0, y1) = span(&mut ys).unwrap_or((0.0, 1.0));
    // From zero where every value is positive: bandwidths and ratios read against zero.
    let y0 = y0.min(0.0);
    let pad = ((y1 - y0) * 0.08).max(f64::MIN_POSITIVE);
    let y = if y1 > y0 { (y0, y1 + pad) } else { (y0 - 1.0, y1 + 1.0) };
    (x, y)
}

/// A tick at log-2 position `v`: the size or count it stands for where `v` is a whole power of
/// two, nothing between.
fn tick(axis: Axis, v: f64) -> String {
    let r = v.round();
    if (v - r).abs() > 1e-6 || !(-60.0..=62.0).contains(&r) {
        return String::new();
    }
    let value = 2f64.powi(r as i32);
    match axis {
        Axis::Bytes => size_name(value),
        Axis::Count => format!("{value}"),
    }
}

fn draw<DB: DrawingBackend>(
    root: &DrawingArea<DB, plotters::coord::Shift>,
    chart: &Chart,
    title: &str,
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    root.fill(&WHITE)?;
    let ((x0, x1), (y0, y1)) = ranges(chart);
    let mut ctx = ChartBuilder::on(root)
        .caption(title, ("sans-serif", 22))
        .margin(16)
        .x_label_area_size(48)
        .y_label_area_size(64)
        .build_cartesian_2d(x0..x1, y0..y1)?;
    let ticks = |v: &f64| tick(chart.x, *v);
    // As many decimals as the range needs: `250`, `2.5`, `0.75`.
    let decimals = if y1 - y0 >= 20.0 {
        0
    } else if y1 - y0 >= 2.0 {
        1
    } else {
        2
    };
    let values = |v: &f64| format!("{v:.decimals$}");
    ctx.configure_mesh()
        // One label per power of two where they fit.
        .x_labels(((x1 - x0) as usize + 1).min(24))
        .x_label_formatter(&ticks)
        .y_labels(10)
        .y_label_formatter(&values)
        .x_desc(chart.x_desc.as_str())
        .y_desc(chart.y_desc.as_str())
        .axis_desc_style(("sans-serif", 15))
        .label_style(("sans-serif", 13))
        .light_line_style(RGBColor(235, 235, 235))
        .draw()?;
    for s in &chart.series {
        let color = PALETTE[s.color % PALETTE.len()];
        let style = color.stroke_width(2);
        let points: Vec<(f64, f64)> = s.points.iter().map(|&(x, y)| (x.log2(), y)).collect();
        let legend = if s.dashed {
            ctx.draw_series(DashedLineSeries::new(points.clone(), 8, 5, style))?
        } else {
            ctx.draw_series(LineSeries::new(points.clone(), style))?
        };
        // The legend's sample: one stroke, or two for a dashed line.
        let (a, b) = if s.dashed { (7, 12) } else { (10, 10) };
        legend.label(s.label.as_str()).legend(move |(x, y)| {
            EmptyElement::at((x, y))
                + PathElement::new(vec![(0, 0), (a, 0)], style)
                + PathElement::new(vec![(b, 0), (20, 0)], style)
        });
        // Markers: a series of one point is still seen.
        ctx.draw_series(points.iter().map(|&p| Circle::new(p, 3, color.filled())))?;
    }
    let colors = chart.series.iter().map(|s| s.color + 1).max().unwrap_or(0);
    for (i, r) in chart.references.iter().enumerate() {
        let style = PALETTE[(colors + i) % PALETTE.len()].mix(0.8).stroke_width(1);
        ctx.draw_series(DashedLineSeries::new(vec![(x0, r.y), (x1, r.y)], 4, 4, style))?
            .label(r.label.as_str())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], style));
    }
    ctx.configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(RGBColor(200, 200, 200))
        .label_font(("sans-serif", 13))
        .draw()?;
    Ok(())
}

/// The SVG `svg` rasterised to PNG bytes, its text in the system's fonts. An `Err` says why not
/// (no font to draw the text with, an SVG resvg cannot read).
pub fn png(svg: &str) -> Result<Vec<u8>, String> {
    use resvg::{tiny_skia, usvg};
    let mut opt = usvg::Options::default();
    let db = opt.fontdb_mut();
    db.load_system_fonts();
    if db.is_empty() {
        return Err("no font on this system to draw the text with (the SVG charts need none)".into());
    }
    // plotters asks for `sans-serif`; where the usual family is missing any sans face (or any face)
    // stands in.
    let sans = usvg::fontdb::Query { families: &[usvg::fontdb::Family::SansSerif], ..Default::default() };
    if db.query(&sans).is_none() {
        let names: Vec<String> = db.faces().filter_map(|f| f.families.first().map(|(n, _)| n.clone())).collect();
        if let Some(name) = names.iter().find(|n| n.contains("Sans") && !n.contains("Mono")).or(names.first()) {
            db.set_sans_serif_family(name.clone());
        }
    }
    let tree = usvg::Tree::from_str(svg, &opt).map_err(|e| format!("the SVG could not be read back: {e}"))?;
    let size = tree.size().to_int_size();
    let mut pixmap = tiny_skia::Pixmap::new(size.width(), size.height())
        .ok_or_else(|| format!("no {}x{} image could be made", size.width(), size.height()))?;
    pixmap.fill(tiny_skia::Color::WHITE);
    resvg::render(&tree, tiny_skia::Transform::default(), &mut pixmap.as_mut());
    pixmap.encode_png().map_err(|e| format!("PNG encoding failed: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks_name_whole_powers_of_two_only() {
        assert_eq!(tick(Axis::Bytes, 20.0), "1M");
        assert_eq!(tick(Axis::Bytes, 20.5), "");
        assert_eq!(tick(Axis::Count, 3.0), "8");
        assert_eq!(tick(Axis::Count, 1e9), "");
    }
}
