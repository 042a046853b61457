//! PNG charts (plotters, bitmap backend). Text is drawn with a TrueType font read at run time
//! (`FLOWPREFILL_FONT`, else common system locations such as Debian's fonts-dejavu-core), so
//! the build needs no font library. A chart never fails its command for want of a font: the
//! CSV, JSON and tables are written as always, the PNG is skipped, and one warning line says
//! how to get a font ([`drawable`]).

use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use plotters::style::FontStyle;
use std::path::Path;
use std::sync::OnceLock;

/// A chart that could not be drawn or written.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct PlotError(String);

impl<E: std::error::Error + Send + Sync> From<DrawingAreaErrorKind<E>> for PlotError {
    fn from(e: DrawingAreaErrorKind<E>) -> Self {
        Self(e.to_string())
    }
}

/// Results of the chart functions.
pub type Result<T> = std::result::Result<T, PlotError>;

/// `root.present()` with the file named on failure.
fn presented<E: std::error::Error + Send + Sync>(
    r: std::result::Result<(), DrawingAreaErrorKind<E>>,
    path: &Path,
) -> Result<()> {
    r.map_err(|e| PlotError(format!("writing {}: {e}", path.display())))
}

const FONT_PATHS: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    "/usr/share/fonts/liberation/LiberationSans-Regular.ttf",
    "/System/Library/Fonts/Supplemental/Arial.ttf",
];

/// Registers a font as "sans-serif" once; says how to get one when none is found.
/// `FLOWPREFILL_FONT`, when set, is the only place looked at.
pub fn init_font() -> Result<()> {
    static DONE: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    DONE.get_or_init(|| {
        let candidates: Vec<String> = match std::env::var("FLOWPREFILL_FONT") {
            Ok(p) => vec![p],
            Err(_) => FONT_PATHS.iter().map(|s| s.to_string()).collect(),
        };
        let path = candidates.iter().find(|p| Path::new(p).is_file()).ok_or_else(|| {
            format!(
                "no TrueType font found for the plots (looked at {}); install one (Debian: apt-get install \
                 fonts-dejavu-core) or set FLOWPREFILL_FONT",
                candidates.join(", ")
            )
        })?;
        let bytes = std::fs::read(path).map_err(|e| format!("reading font {path}: {e}"))?;
        // plotters keeps fonts for the whole process; the bytes are leaked once on purpose.
        let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
        plotters::style::register_font("sans-serif", FontStyle::Normal, bytes)
            .map_err(|_| format!("{path} is not a usable font"))
    })
    .clone()
    .map_err(PlotError)
}

/// Whether charts can be drawn (a font was found). The first time one cannot, one warning
/// line on stderr says that the PNG charts are skipped and why; the commands go on.
pub fn drawable() -> bool {
    static WARNED: std::sync::Once = std::sync::Once::new();
    match init_font() {
        Ok(()) => true,
        Err(e) => {
            // One write, so that under mpirun another process's output cannot split the line.
            let line = format!("warning: PNG charts skipped: {e}\n");
            WARNED.call_once(|| drop(std::io::Write::write_all(&mut std::io::stderr(), line.as_bytes())));
            false
        }
    }
}

/// `path` when the chart was written, for "wrote ..." lines.
pub fn written(path: &Path, drawn: bool) -> Option<String> {
    drawn.then(|| path.display().to_string())
}

/// One line of a chart.
pub struct Series {
    /// Legend label.
    pub name: String,
    /// (x, y) points, in x order.
    pub points: Vec<(f64, f64)>,
}

/// A distinct color per series index.
fn color(i: usize) -> RGBColor {
    const C: [RGBColor; 10] = [
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
    C[i % C.len()]
}

/// A line chart with markers and a legend. Returns false (and writes nothing) without a font.
pub fn line_chart(path: &Path, title: &str, x_label: &str, y_label: &str, series: &[Series]) -> Result<bool> {
    if !drawable() {
        return Ok(false);
    }
    let pts = series.iter().flat_map(|s| s.points.iter());
    let (mut x0, mut x1, mut y1) = (f64::MAX, f64::MIN, 0f64);
    for &(x, y) in pts {
        x0 = x0.min(x);
        x1 = x1.max(x);
        y1 = y1.max(y);
    }
    if x0 > x1 {
        (x0, x1) = (0.0, 1.0);
    }
    let pad = ((x1 - x0) * 0.05).max(1e-9);
    let root = BitMapBackend::new(path, (1100, 700)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 26))
        .margin(20)
        .x_label_area_size(50)
        .y_label_area_size(70)
        .build_cartesian_2d((x0 - pad)..(x1 + pad), 0.0..(y1 * 1.1).max(1e-9))?;
    chart.configure_mesh().x_desc(x_label).y_desc(y_label).label_style(("sans-serif", 16)).draw()?;
    draw_lines(&mut chart, series, |_| true, SeriesLabelPosition::LowerRight)?;
    presented(root.present(), path)?;
    Ok(true)
}

/// Each series as a line with markers in its color (points that `keep` refuses are left out),
/// joined in the order of x (lengths given out of order would draw a zig-zag), and the legend
/// at `legend`.
fn draw_lines<'a, X, Y>(
    chart: &mut ChartContext<'a, BitMapBackend<'a>, Cartesian2d<X, Y>>,
    series: &[Series],
    keep: impl Fn(&(f64, f64)) -> bool,
    legend: SeriesLabelPosition,
) -> Result<()>
where
    X: Ranged<ValueType = f64>,
    Y: Ranged<ValueType = f64>,
{
    for (i, s) in series.iter().enumerate() {
        let c = color(i);
        let pts = in_x_order(&s.points, &keep);
        chart
            .draw_series(LineSeries::new(pts.clone(), c.stroke_width(2)))?
            .label(&s.name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(3)));
        chart.draw_series(pts.into_iter().map(|p| Circle::new(p, 4, c.filled())))?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font(("sans-serif", 16))
        .position(legend)
        .draw()?;
    Ok(())
}

/// The points `keep` accepts, in the order of x.
fn in_x_order(points: &[(f64, f64)], keep: impl Fn(&(f64, f64)) -> bool) -> Vec<(f64, f64)> {
    let mut pts: Vec<(f64, f64)> = points.iter().copied().filter(|p| keep(p)).collect();
    pts.sort_by(|a, b| a.0.total_cmp(&b.0));
    pts
}

/// A line chart on log-log axes (lengths and times spanning decades), markers and a legend.
/// Returns false (and writes nothing) without a font.
pub fn line_chart_log(path: &Path, title: &str, x_label: &str, y_label: &str, series: &[Series]) -> Result<bool> {
    if !drawable() {
        return Ok(false);
    }
    let pts = series.iter().flat_map(|s| s.points.iter()).filter(|p| p.0 > 0.0 && p.1 > 0.0);
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for &(x, y) in pts {
        (x0, x1, y0, y1) = (x0.min(x), x1.max(x), y0.min(y), y1.max(y));
    }
    if x0 > x1 || y0 > y1 {
        (x0, x1, y0, y1) = (1.0, 10.0, 1.0, 10.0);
    }
    let root = BitMapBackend::new(path, (1100, 700)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(20)
        .x_label_area_size(50)
        .y_label_area_size(80)
        .build_cartesian_2d((x0 / 1.2..x1 * 1.2).log_scale(), (y0 / 1.3..y1 * 1.3).log_scale())?;
    let short = |v: &f64| if *v >= 100.0 { format!("{v:.0}") } else { format!("{v:.2}") };
    chart
        .configure_mesh()
        .x_desc(x_label)
        .y_desc(y_label)
        .x_label_formatter(&short)
        .y_label_formatter(&short)
        .y_labels(12)
        .label_style(("sans-serif", 16))
        .draw()?;
    // Log axes have no place for zero or negative values.
    draw_lines(&mut chart, series, |p| p.0 > 0.0 && p.1 > 0.0, SeriesLabelPosition::UpperLeft)?;
    presented(root.present(), path)?;
    Ok(true)
}

/// The name of item `v` on an axis whose items sit at the integers 0, 1, ... (blank between).
fn centre_label(names: &[String], v: f64) -> String {
    let i = v.round();
    if (v - i).abs() < 1e-6 && i >= 0.0 {
        names.get(i as usize).cloned().unwrap_or_default()
    } else {
        String::new()
    }
}

/// One method's values with their intervals, one per group (`None` where it has none).
pub struct IntervalSeries {
    /// Legend label.
    pub name: String,
    /// Per group: (value, low, high).
    pub values: Vec<Option<(f64, f64, f64)>>,
}

/// Values with interval whiskers, grouped on the x axis (`groups`), the series of a group side
/// by side in their colors, with a dashed reference line at `reference` (100% retention).
/// Returns false (and writes nothing) without a font.
pub fn interval_chart(
    path: &Path,
    title: &str,
    y_label: &str,
    groups: &[String],
    series: &[IntervalSeries],
    reference: f64,
) -> Result<bool> {
    if !drawable() || groups.is_empty() {
        return Ok(false);
    }
    let tops = series.iter().flat_map(|s| s.values.iter().flatten().map(|v| v.2));
    let y1 = tops.fold(reference, f64::max) * 1.08;
    let n = groups.len() as f64;
    let root = BitMapBackend::new(path, (1100, 700)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(20)
        .x_label_area_size(50)
        .y_label_area_size(70)
        .build_cartesian_2d(-0.5..n - 0.5, 0.0..y1)?;
    let group_label = |x: &f64| centre_label(groups, *x);
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(2 * groups.len() + 1)
        .x_label_formatter(&group_label)
        .y_desc(y_label)
        .label_style(("sans-serif", 16))
        .draw()?;
    chart.draw_series(std::iter::once(PathElement::new(
        vec![(-0.5, reference), (n - 0.5, reference)],
        BLACK.mix(0.5).stroke_width(1),
    )))?;
    let width = 0.7 / series.len().max(1) as f64;
    for (i, s) in series.iter().enumerate() {
        let c = color(i);
        let dx = -0.35 + width * (i as f64 + 0.5);
        let pts: Vec<(f64, (f64, f64, f64))> =
            s.values.iter().enumerate().filter_map(|(g, v)| v.map(|v| (g as f64 + dx, v))).collect();
        chart
            .draw_series(
                pts.iter().map(|&(x, (_, lo, hi))| PathElement::new(vec![(x, lo), (x, hi)], c.stroke_width(2))),
            )?
            .label(&s.name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(3)));
        chart.draw_series(pts.iter().map(|&(x, (v, _, _))| Circle::new((x, v), 5, c.filled())))?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font(("sans-serif", 16))
        .position(SeriesLabelPosition::UpperRight)
        .draw()?;
    presented(root.present(), path)?;
    Ok(true)
}

/// A grid of fractions in [0, 1], red (0) to green (1), with the value written in each cell;
/// cells without data (`None`) are grey and say so. `values[row][col]`; row 0 is drawn at the
/// bottom. Returns false (and writes nothing) without a font.
pub fn heatmap(
    path: &Path,
    title: &str,
    x_label: &str,
    y_label: &str,
    cols: &[String],
    rows: &[String],
    values: &[Vec<Option<f64>>],
) -> Result<bool> {
    if !drawable() {
        return Ok(false);
    }
    let size = ((180 + 120 * cols.len() as u32).max(480), 150 + 60 * rows.len() as u32);
    let root = BitMapBackend::new(path, size).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(15)
        .x_label_area_size(50)
        .y_label_area_size(90)
        .build_cartesian_2d(-0.5..cols.len() as f64 - 0.5, -0.5..rows.len() as f64 - 0.5)?;
    // Cell i spans [i - 0.5, i + 0.5], so the integer ticks sit at the cell centres.
    let label = centre_label;
    chart
        .configure_mesh()
        .disable_mesh()
        .x_desc(x_label)
        .y_desc(y_label)
        .x_labels(cols.len())
        .y_labels(rows.len())
        .x_label_formatter(&|x| label(cols, *x))
        .y_label_formatter(&|y| label(rows, *y))
        .label_style(("sans-serif", 15))
        .draw()?;
    for (r, row) in values.iter().enumerate() {
        for (c, v) in row.iter().enumerate() {
            let (fill, text) = match v {
                Some(v) => {
                    let v = v.clamp(0.0, 1.0);
                    (RGBColor((220.0 * (1.0 - v)) as u8 + 30, (190.0 * v) as u8 + 40, 60), format!("{:.0}%", 100.0 * v))
                }
                None => (RGBColor(200, 200, 200), "no data".to_string()),
            };
            let (x, y) = (c as f64, r as f64);
            chart.draw_series(std::iter::once(Rectangle::new(
                [(x - 0.5, y - 0.5), (x + 0.5, y + 0.5)],
                fill.filled(),
            )))?;
            let style = ("sans-serif", 16).into_font().color(&WHITE).pos(Pos::new(HPos::Center, VPos::Center));
            chart.draw_series(std::iter::once(Text::new(text, (x, y), style)))?;
        }
    }
    presented(root.present(), path)?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    /// Lengths given out of order (`--lengths 8000,2048,4096`) are joined from left to right.
    #[test]
    fn lines_join_points_in_the_order_of_x() {
        let pts = [(8000.0, 3.0), (2048.0, 1.0), (0.0, 9.0), (4096.0, 2.0)];
        assert_eq!(super::in_x_order(&pts, |p| p.0 > 0.0), vec![(2048.0, 1.0), (4096.0, 2.0), (8000.0, 3.0)]);
    }
}
