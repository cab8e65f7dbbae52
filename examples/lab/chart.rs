//! PNG charts of a run with plotters' bitmap backend. Text is drawn from the public-domain 8×8
//! bitmap font of the `font8x8` crate by a thin wrapper backend, so no system font, fontconfig
//! or font file is needed (plotters is built without its `ttf` and `ab_glyph` features).

use std::path::Path;

use anyhow::{Result, anyhow};
use font8x8::UnicodeFonts;
use plotters::prelude::*;
use plotters_backend::{
    BackendColor, BackendCoord, BackendStyle, BackendTextStyle, DrawingErrorKind, FontTransform,
    text_anchor::{HPos, VPos},
};

use crate::load::Outcome;
use crate::report::RunSummary;

/// [`BitMapBackend`] with text from an 8×8 bitmap font, scaled to the asked size.
struct Pixels<'a>(BitMapBackend<'a>);

type Error<'a> = DrawingErrorKind<<BitMapBackend<'a> as DrawingBackend>::ErrorType>;

fn glyph_scale(size: f64) -> i32 {
    ((size / 8.0).round() as i32).max(1)
}

impl<'a> DrawingBackend for Pixels<'a> {
    type ErrorType = <BitMapBackend<'a> as DrawingBackend>::ErrorType;

    fn get_size(&self) -> (u32, u32) {
        self.0.get_size()
    }
    fn ensure_prepared(&mut self) -> Result<(), Error<'a>> {
        self.0.ensure_prepared()
    }
    fn present(&mut self) -> Result<(), Error<'a>> {
        self.0.present()
    }
    fn draw_pixel(&mut self, point: BackendCoord, color: BackendColor) -> Result<(), Error<'a>> {
        self.0.draw_pixel(point, color)
    }
    fn draw_line<S: BackendStyle>(
        &mut self,
        from: BackendCoord,
        to: BackendCoord,
        style: &S,
    ) -> Result<(), Error<'a>> {
        self.0.draw_line(from, to, style)
    }
    fn draw_rect<S: BackendStyle>(
        &mut self,
        upper_left: BackendCoord,
        bottom_right: BackendCoord,
        style: &S,
        fill: bool,
    ) -> Result<(), Error<'a>> {
        self.0.draw_rect(upper_left, bottom_right, style, fill)
    }
    fn draw_path<S: BackendStyle, I: IntoIterator<Item = BackendCoord>>(
        &mut self,
        path: I,
        style: &S,
    ) -> Result<(), Error<'a>> {
        self.0.draw_path(path, style)
    }
    fn draw_circle<S: BackendStyle>(
        &mut self,
        center: BackendCoord,
        radius: u32,
        style: &S,
        fill: bool,
    ) -> Result<(), Error<'a>> {
        self.0.draw_circle(center, radius, style, fill)
    }
    fn fill_polygon<S: BackendStyle, I: IntoIterator<Item = BackendCoord>>(
        &mut self,
        vert: I,
        style: &S,
    ) -> Result<(), Error<'a>> {
        self.0.fill_polygon(vert, style)
    }
    fn blit_bitmap(
        &mut self,
        pos: BackendCoord,
        size: (u32, u32),
        src: &[u8],
    ) -> Result<(), Error<'a>> {
        self.0.blit_bitmap(pos, size, src)
    }

    fn estimate_text_size<TStyle: BackendTextStyle>(
        &self,
        text: &str,
        style: &TStyle,
    ) -> Result<(u32, u32), Error<'a>> {
        let s = glyph_scale(style.size()) as u32;
        Ok((text.chars().count() as u32 * 8 * s, 8 * s))
    }

    fn draw_text<TStyle: BackendTextStyle>(
        &mut self,
        text: &str,
        style: &TStyle,
        pos: BackendCoord,
    ) -> Result<(), Error<'a>> {
        let color = style.color();
        if color.alpha == 0.0 {
            return Ok(());
        }
        let s = glyph_scale(style.size());
        let width = text.chars().count() as i32 * 8 * s;
        let height = 8 * s;
        let dx = match style.anchor().h_pos {
            HPos::Left => 0,
            HPos::Right => -width,
            HPos::Center => -width / 2,
        };
        let dy = match style.anchor().v_pos {
            VPos::Top => 0,
            VPos::Center => -height / 2,
            VPos::Bottom => -height,
        };
        let transform: FontTransform = style.transform();
        let (w, h) = self.get_size();
        for (i, c) in text.chars().enumerate() {
            let rows = font8x8::BASIC_FONTS
                .get(c)
                .or_else(|| font8x8::LATIN_FONTS.get(c))
                .unwrap_or([0; 8]);
            for (row, bits) in rows.iter().enumerate() {
                for col in 0..8 {
                    if bits & (1 << col) == 0 {
                        continue;
                    }
                    for sy in 0..s {
                        for sx in 0..s {
                            let x = i as i32 * 8 * s + col * s + sx + dx;
                            let y = row as i32 * s + sy + dy;
                            let (x, y) = transform.transform(x, y);
                            let (x, y) = (pos.0 + x, pos.1 + y);
                            if x >= 0 && y >= 0 && x < w as i32 && y < h as i32 {
                                self.0.draw_pixel((x, y), color)?;
                            }
                        }
                    }
                }
            }
        }
        Ok(())
    }
}

const TENANT_COLORS: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
    RGBColor(255, 127, 14),
    RGBColor(23, 190, 207),
];

fn tenant_color(index: usize) -> RGBColor {
    TENANT_COLORS[index % TENANT_COLORS.len()]
}

/// Legend boxes are sized by plotters' own text estimate, about half as wide as the 8-pixel
/// glyphs drawn here: pad the labels so the box fits them.
fn legend(label: &str) -> String {
    format!("{label}{}", " ".repeat(label.len() + 2))
}

fn err(e: impl std::fmt::Display) -> anyhow::Error {
    anyhow!("chart: {e}")
}

/// Three panels: TTFT of every admitted request by arrival time and tenant; the global limit,
/// in-flight and vLLM's running/waiting/KV over time; admitted and shed per tenant. With
/// several tollgate replicas, the second panel is the deployment's (the fleet's limit, the sum
/// of the shares, the sum of in flight) and a fourth shows each replica's share and in flight.
pub fn run_chart(
    path: &Path,
    summary: &RunSummary,
    outcome: &Outcome,
    tenant_names: &[String],
) -> Result<()> {
    let replicas = outcome
        .samples
        .iter()
        .map(|s| s.replicas.len())
        .max()
        .unwrap_or(0);
    let panel_count = if replicas > 1 { 4 } else { 3 };
    // About the size of a three-panel chart either way: the PNGs are kept in docs/lab/.
    let panel_height = if replicas > 1 { 240 } else { 310 };
    let backend = Pixels(BitMapBackend::new(
        path,
        (900, 30 + panel_height * panel_count),
    ));
    let root = backend.into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let title = format!(
        "{} / {} (tollgate {})",
        summary.scenario,
        summary.run,
        if summary.tollgate { "on" } else { "off" }
    );
    let (top, rest) = root.split_vertically(30);
    top.draw(&Text::new(title, (10, 8), ("sans-serif", 16).into_font()))
        .map_err(err)?;
    let panels = rest.split_evenly((panel_count as usize, 1));
    let end = outcome
        .records
        .iter()
        .filter_map(|r| Some(r.at + r.e2e?))
        .fold(summary.duration_s, f64::max);
    let label_font = ("sans-serif", 8).into_font();

    // 1. TTFT by arrival, log scale.
    let ttfts: Vec<(usize, f64, f64)> = outcome
        .records
        .iter()
        .filter(|r| r.status == 200)
        .filter_map(|r| Some((r.tenant, r.at, r.ttft?.max(0.01))))
        .collect();
    let max_ttft = ttfts.iter().map(|t| t.2).fold(1.0, f64::max) * 1.5;
    let mut chart = ChartBuilder::on(&panels[0])
        .caption(
            "TTFT of admitted requests (s, log) by arrival time",
            ("sans-serif", 16),
        )
        .margin(8)
        .x_label_area_size(24)
        .y_label_area_size(56)
        .build_cartesian_2d(0.0..end, (0.05..max_ttft).log_scale())
        .map_err(err)?;
    chart
        .configure_mesh()
        .light_line_style(TRANSPARENT)
        .label_style(label_font.clone())
        .x_labels(10)
        .y_labels(8)
        .draw()
        .map_err(err)?;
    for (index, name) in tenant_names.iter().enumerate() {
        let color = tenant_color(index);
        chart
            .draw_series(
                ttfts
                    .iter()
                    .filter(|t| t.0 == index)
                    .map(|t| Circle::new((t.1, t.2), 2, color.filled())),
            )
            .map_err(err)?
            .label(legend(name))
            .legend(move |(x, y)| Circle::new((x, y), 4, color.filled()));
    }
    for (row, call) in summary.admin_calls.iter().enumerate() {
        chart
            .draw_series(std::iter::once(PathElement::new(
                vec![(call.sent_s, 0.05), (call.sent_s, max_ttft)],
                Color::stroke_width(&ADMIN_COLOR, 2),
            )))
            .map_err(err)?;
        let at = chart.backend_coord(&(call.sent_s, max_ttft));
        admin_label(&root, call, row, at, call.sent_s > end / 2.0)?;
    }
    chart
        .configure_series_labels()
        .label_font(label_font.clone())
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperRight)
        .draw()
        .map_err(err)?;

    // 2. Gauges over time.
    type Series = (
        &'static str,
        RGBColor,
        fn(&crate::load::Sample) -> Option<f64>,
    );
    let (limit_label, inflight_label, caption) = if replicas > 1 {
        (
            "deployment limit",
            "in flight, all replicas",
            format!("All {replicas} replicas: limit, shares, in flight; vLLM"),
        )
    } else {
        (
            "tollgate limit",
            "tollgate in flight",
            "Global limit, in flight, vLLM running / waiting / KV %".to_owned(),
        )
    };
    let series: [Series; 6] = [
        (limit_label, RGBColor(0, 0, 0), |s| s.tollgate_limit),
        ("sum of the shares", RGBColor(255, 127, 14), |s| {
            s.replicas
                .iter()
                .map(|r| r.share)
                .try_fold(0.0, |sum, share| Some(sum + share?))
                .filter(|_| s.replicas.len() > 1)
        }),
        (inflight_label, RGBColor(127, 127, 127), |s| {
            s.tollgate_inflight
        }),
        ("vLLM running", RGBColor(31, 119, 180), |s| s.vllm_running),
        ("vLLM waiting", RGBColor(214, 39, 40), |s| s.vllm_waiting),
        ("vLLM KV usage %", RGBColor(44, 160, 44), |s| {
            s.vllm_kv_usage.map(|kv| kv * 100.0)
        }),
    ];
    let top = outcome
        .samples
        .iter()
        .flat_map(|s| series.iter().filter_map(move |(_, _, f)| f(s)))
        .fold(10.0, f64::max)
        * 1.1;
    let mut chart = ChartBuilder::on(&panels[1])
        .caption(caption, ("sans-serif", 16))
        .margin(8)
        .x_label_area_size(24)
        .y_label_area_size(56)
        .build_cartesian_2d(0.0..end, 0.0..top)
        .map_err(err)?;
    chart
        .configure_mesh()
        .light_line_style(TRANSPARENT)
        .label_style(label_font.clone())
        .x_labels(10)
        .draw()
        .map_err(err)?;
    for (row, call) in summary.admin_calls.iter().enumerate() {
        chart
            .draw_series(std::iter::once(PathElement::new(
                vec![(call.sent_s, 0.0), (call.sent_s, top)],
                Color::stroke_width(&ADMIN_COLOR, 2),
            )))
            .map_err(err)?;
        let at = chart.backend_coord(&(call.sent_s, top));
        admin_label(&root, call, row, at, call.sent_s > end / 2.0)?;
    }
    for (name, color, f) in series {
        let points: Vec<(f64, f64)> = outcome
            .samples
            .iter()
            .filter_map(|s| Some((s.t, f(s)?)))
            .collect();
        if points.is_empty() {
            continue;
        }
        chart
            .draw_series(LineSeries::new(points, Color::stroke_width(&color, 2)))
            .map_err(err)?
            .label(legend(name))
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 16, y)], Color::stroke_width(&color, 2))
            });
    }
    chart
        .configure_series_labels()
        .label_font(label_font.clone())
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperRight)
        .draw()
        .map_err(err)?;

    // 3. Admitted / shed per tenant.
    type Bar = (
        &'static str,
        RGBColor,
        fn(&crate::report::TenantSummary) -> u64,
    );
    let bars: [Bar; 5] = [
        ("completed", RGBColor(44, 160, 44), |t| t.completed),
        ("400/413", RGBColor(148, 103, 189), |t| t.rejected_4xx),
        ("429", RGBColor(255, 127, 14), |t| t.rejected_429),
        ("503", RGBColor(214, 39, 40), |t| t.rejected_503),
        ("truncated/other/hung", RGBColor(90, 90, 90), |t| {
            t.truncated + t.other_errors - t.rejected_4xx + t.unfinished
        }),
    ];
    let highest = summary
        .tenants
        .iter()
        .flat_map(|t| bars.iter().map(move |(_, _, f)| f(t)))
        .max()
        .unwrap_or(1)
        .max(1) as f64
        * 1.15;
    let n = summary.tenants.len() as f64;
    let mut chart = ChartBuilder::on(&panels[2])
        .caption(
            "Requests per tenant: completed and shed",
            ("sans-serif", 16),
        )
        .margin(8)
        .x_label_area_size(24)
        .y_label_area_size(56)
        .build_cartesian_2d(0.0..n, 0.0..highest)
        .map_err(err)?;
    chart
        .configure_mesh()
        .light_line_style(TRANSPARENT)
        .label_style(label_font.clone())
        .disable_x_mesh()
        .x_labels(0)
        .draw()
        .map_err(err)?;
    let width = 0.8 / bars.len() as f64;
    for (b, (name, color, f)) in bars.iter().enumerate() {
        let color = *color;
        let rects: Vec<Rectangle<(f64, f64)>> = summary
            .tenants
            .iter()
            .enumerate()
            .map(|(i, t)| {
                let x0 = i as f64 + 0.1 + b as f64 * width;
                Rectangle::new([(x0, 0.0), (x0 + width * 0.9, f(t) as f64)], color.filled())
            })
            .collect();
        chart
            .draw_series(rects)
            .map_err(err)?
            .label(legend(name))
            .legend(move |(x, y)| Rectangle::new([(x, y - 4), (x + 10, y + 4)], color.filled()));
    }
    for (i, t) in summary.tenants.iter().enumerate() {
        chart
            .draw_series(std::iter::once(Text::new(
                t.name.clone(),
                (i as f64 + 0.45, highest * 0.97),
                ("sans-serif", 16).into_font(),
            )))
            .map_err(err)?;
    }
    chart
        .configure_series_labels()
        .label_font(label_font.clone())
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperRight)
        .draw()
        .map_err(err)?;

    // 4. Each replica's share and in flight.
    if replicas > 1 {
        let top = outcome
            .samples
            .iter()
            .flat_map(|s| s.replicas.iter())
            .flat_map(|r| [r.share, r.inflight])
            .flatten()
            .fold(4.0, f64::max)
            * 1.15;
        let mut chart = ChartBuilder::on(&panels[3])
            .caption(
                "Each replica: share (thick), in flight (thin)",
                ("sans-serif", 16),
            )
            .margin(8)
            .x_label_area_size(24)
            .y_label_area_size(56)
            .build_cartesian_2d(0.0..end, 0.0..top)
            .map_err(err)?;
        chart
            .configure_mesh()
            .light_line_style(TRANSPARENT)
            .label_style(label_font.clone())
            .x_labels(10)
            .draw()
            .map_err(err)?;
        for index in 0..replicas {
            let color = REPLICA_COLORS[index % REPLICA_COLORS.len()];
            type Gauge = fn(&crate::load::ReplicaSample) -> Option<f64>;
            let gauges: [(&str, u32, Gauge); 2] =
                [("share", 2, |r| r.share), ("in flight", 1, |r| r.inflight)];
            for (what, width, gauge) in gauges {
                let points: Vec<(f64, f64)> = outcome
                    .samples
                    .iter()
                    .filter_map(|s| Some((s.t, gauge(s.replicas.get(index)?)?)))
                    .collect();
                chart
                    .draw_series(LineSeries::new(points, Color::stroke_width(&color, width)))
                    .map_err(err)?
                    .label(legend(&format!("replica {} {what}", index + 1)))
                    .legend(move |(x, y)| {
                        PathElement::new(
                            vec![(x, y), (x + 16, y)],
                            Color::stroke_width(&color, width),
                        )
                    });
            }
        }
        chart
            .configure_series_labels()
            .label_font(label_font)
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .position(SeriesLabelPosition::UpperRight)
            .draw()
            .map_err(err)?;
    }
    root.present().map_err(err)?;
    Ok(())
}

/// The admin calls' markers: a vertical line at the time each was sent, and what it sent.
const ADMIN_COLOR: RGBColor = RGBColor(255, 0, 255);

/// `PUT {kv_cache_threshold:0.85,queue_depth_threshold:10}` (or `PUT /path` without a body)
/// beside the marker's line, whose top is at pixel `at`: to its right, or to its left in the
/// chart's right half; one text row lower for each call before it, so that labels never
/// overlap.
fn admin_label<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    call: &crate::load::AdminCallResult,
    row: usize,
    at: (i32, i32),
    left: bool,
) -> Result<()> {
    // The body's values, without the keys' quotes: short enough to sit on a chart.
    let what = match &call.call.body {
        Some(body) => body.to_string().replace('"', ""),
        None => call.call.path.clone(),
    };
    let (h_pos, dx) = if left {
        (HPos::Right, -4)
    } else {
        (HPos::Left, 4)
    };
    let style = ("sans-serif", 8)
        .into_font()
        .color(&ADMIN_COLOR)
        .pos(plotters::style::text_anchor::Pos::new(h_pos, VPos::Top));
    area.draw(&Text::new(
        format!("{} {what}", call.call.method),
        (at.0 + dx, at.1 + 2 + 10 * row as i32),
        style,
    ))
    .map_err(err)
}

const REPLICA_COLORS: [RGBColor; 4] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
];
