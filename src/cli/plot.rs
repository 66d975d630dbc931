//! `--plot`: an SVG of allocated, reserved and requested bytes over a
//! replay, with the peaks and the retry / OOM events marked, and a side
//! panel with the legend and the key figures.

use super::format::{grouped, size};
use cachealloc::core::replay::ReplayResult;
use plotters::coord::Shift;
use plotters::prelude::*;
use std::path::Path;

const SIZE: (u32, u32) = (1200, 700);
/// Width of the legend panel on the right.
const PANEL: u32 = 240;
/// At most this many vertical marks per kind; more are thinned evenly.
const MAX_MARKS: usize = 400;

const RESERVED: RGBColor = RGBColor(31, 119, 180);
const ALLOCATED: RGBColor = RGBColor(44, 160, 44);
const REQUESTED: RGBColor = RGBColor(140, 140, 140);
const RETRY: RGBColor = RGBColor(255, 127, 14);
const OOM: RGBColor = RGBColor(214, 39, 40);
const CAPACITY: RGBColor = RGBColor(120, 120, 120);

/// Writes the plot of `r` to `path`.
pub fn write(
    path: &Path,
    title: &str,
    r: &ReplayResult,
    capacity: Option<u64>,
) -> Result<(), String> {
    let root = SVGBackend::new(path, SIZE).into_drawing_area();
    draw(&root, title, r, capacity).map_err(|e| e.to_string())?;
    root.present().map_err(|e| e.to_string())
}

fn draw<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    title: &str,
    r: &ReplayResult,
    capacity: Option<u64>,
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    let t = &r.timeline;
    root.fill(&WHITE)?;
    let root = root.titled(title, ("sans-serif", 22))?;
    let (plot_area, panel) = root.split_horizontally(SIZE.0 - PANEL);
    let x_max = (r.events.max(11) - 1) as f64;
    let top = r
        .peak_reserved
        .max(r.peak_allocated)
        .max(capacity.unwrap_or(0))
        .max(1 << 20);
    // GiB, or MiB for small traces; the y values are in that unit.
    let (unit, y_desc) = if top >= 1 << 30 {
        ((1u64 << 30) as f64, "GiB (2^30 bytes)")
    } else {
        ((1u64 << 20) as f64, "MiB (2^20 bytes)")
    };
    let y_max = top as f64 / unit * 1.1;
    let (x_div, x_word) = if x_max >= 2e6 {
        (1e6, " (millions)")
    } else if x_max >= 2e3 {
        (1e3, " (thousands)")
    } else {
        (1.0, "")
    };

    let mut chart = ChartBuilder::on(&plot_area)
        .margin_left(10)
        .margin_right(10)
        .margin_top(10)
        .x_label_area_size(50)
        .y_label_area_size(70)
        .build_cartesian_2d(0f64..x_max, 0f64..y_max)?;
    chart
        .configure_mesh()
        .light_line_style(RGBColor(238, 238, 238))
        .bold_line_style(RGBColor(215, 215, 215))
        .x_desc(format!("events{x_word}"))
        .y_desc(y_desc)
        .x_label_formatter(&|x| {
            if x_div == 1.0 {
                format!("{x:.0}")
            } else {
                format_axis(*x / x_div)
            }
        })
        .y_label_formatter(&|y| format_axis(*y))
        .axis_desc_style(("sans-serif", 16))
        .label_style(("sans-serif", 14))
        .draw()?;

    // OOMs as full-height lines, retries as ticks along the top (an
    // allocation that retried and still failed shows both), drawn first so
    // that the memory lines lie over them.
    let oom_step = r.oom_events.len().div_ceil(MAX_MARKS).max(1);
    chart.draw_series(r.oom_events.iter().step_by(oom_step).map(|&e| {
        PathElement::new(
            vec![(e as f64, 0.0), (e as f64, y_max)],
            OOM.mix(0.45).stroke_width(1),
        )
    }))?;
    let retry_step = r.retry_events.len().div_ceil(MAX_MARKS).max(1);
    chart.draw_series(r.retry_events.iter().step_by(retry_step).map(|&e| {
        PathElement::new(
            vec![(e as f64, y_max * 0.96), (e as f64, y_max)],
            RETRY.stroke_width(2),
        )
    }))?;
    if let Some(c) = capacity {
        let y = c as f64 / unit;
        chart.draw_series(DashedLineSeries::new(
            vec![(0.0, y), (x_max, y)],
            8,
            5,
            CAPACITY.stroke_width(2),
        ))?;
    }
    // Requested first: it is at most allocated, and mostly hidden by it.
    let series = [
        (&t.requested, REQUESTED, 1),
        (&t.allocated, ALLOCATED, 2),
        (&t.reserved, RESERVED, 2),
    ];
    for (points, color, width) in series {
        chart.draw_series(LineSeries::new(
            points.iter().map(|&(e, b)| (e as f64, b as f64 / unit)),
            color.stroke_width(width),
        ))?;
    }

    // The peaks, labelled on the side with more room.
    let peaks = [
        (
            r.peak_reserved_event,
            r.peak_reserved,
            RESERVED,
            "peak reserved",
        ),
        (
            r.peak_allocated_event,
            r.peak_allocated,
            ALLOCATED,
            "peak allocated",
        ),
    ];
    for (event, bytes, color, name) in peaks {
        if bytes == 0 {
            continue;
        }
        let (x, y) = (event as f64, bytes as f64 / unit);
        let text = format!("{name} {} (event {})", size(bytes), grouped(event));
        let width = text.len() as i32 * 8;
        let dx = if x < x_max * 0.55 { 10 } else { -10 - width };
        chart.draw_series(std::iter::once(
            EmptyElement::at((x, y))
                + Circle::new((0, 0), 5, color.filled())
                + Circle::new((0, 0), 5, BLACK.stroke_width(1))
                + Text::new(
                    text,
                    (dx, -22),
                    ("sans-serif", 15).into_font().color(&color),
                ),
        ))?;
    }

    draw_panel(&panel, r, capacity)
}

/// The legend and the key figures, right of the chart.
fn draw_panel<DB: DrawingBackend>(
    panel: &DrawingArea<DB, Shift>,
    r: &ReplayResult,
    capacity: Option<u64>,
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    let font = ("sans-serif", 14).into_font();
    let bold = ("sans-serif", 15).into_font().style(FontStyle::Bold);
    let x = 10;
    let mut y = 20;
    panel.draw(&Text::new("legend", (x, y), bold.clone()))?;
    y += 26;
    let mut entries: Vec<(RGBColor, u32, bool, String)> = vec![
        (RESERVED, 2, false, "reserved".into()),
        (ALLOCATED, 2, false, "allocated".into()),
        (REQUESTED, 1, false, "requested".into()),
    ];
    if let Some(c) = capacity {
        entries.push((CAPACITY, 2, false, format!("capacity {}", size(c))));
    }
    entries.push((
        RETRY,
        2,
        true,
        format!(
            "alloc retry ({}), top",
            grouped(r.retry_events.len() as u64)
        ),
    ));
    entries.push((
        OOM,
        1,
        true,
        format!("out of memory ({})", grouped(r.oom_events.len() as u64)),
    ));
    for (color, width, vertical, label) in entries {
        let sample = if vertical {
            vec![(x + 12, y - 9), (x + 12, y + 9)]
        } else {
            vec![(x, y), (x + 24, y)]
        };
        let color = if vertical && color == OOM {
            OOM.mix(0.6).to_rgba()
        } else {
            color.to_rgba()
        };
        panel.draw(&PathElement::new(sample, color.stroke_width(width.max(2))))?;
        panel.draw(&Text::new(label, (x + 34, y - 8), font.clone()))?;
        y += 24;
    }
    panel.draw(&Circle::new((x + 12, y), 5, BLACK.stroke_width(1)))?;
    panel.draw(&Text::new("peak", (x + 34, y - 8), font.clone()))?;
    y += 44;

    panel.draw(&Text::new("figures", (x, y), bold))?;
    y += 26;
    let s = &r.stats;
    let figures = [
        format!("events {}", grouped(r.events)),
        format!("peak reserved {}", size(r.peak_reserved)),
        format!("peak allocated {}", size(r.peak_allocated)),
        format!("peak requested {}", size(r.peak_requested)),
        format!("reserved / allocated {:.3}", r.reserved_over_allocated()),
        format!("driver calls {}", grouped(r.device_calls())),
        format!(
            "retries {}, OOMs {}",
            grouped(s.num_alloc_retries),
            grouped(s.num_ooms)
        ),
    ];
    for line in figures {
        panel.draw(&Text::new(line, (x, y - 8), font.clone()))?;
        y += 22;
    }
    Ok(())
}

/// Axis numbers without needless decimals: `0`, `0.5`, `2.25`, `120`.
fn format_axis(v: f64) -> String {
    let text = format!("{v:.2}");
    let text = text.trim_end_matches('0').trim_end_matches('.');
    if text == "-0" {
        "0".into()
    } else {
        text.into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cachealloc::core::replay::Timeline;

    #[test]
    fn axis_numbers() {
        let shown: Vec<String> = [0.0, 0.5, 1.0, 2.25, 120.0, 1e-9]
            .into_iter()
            .map(format_axis)
            .collect();
        assert_eq!(shown, ["0", "0.5", "1", "2.25", "120", "0"]);
    }

    #[test]
    fn writes_an_svg_with_the_marks() {
        let dir = std::env::temp_dir().join(format!("cachealloc-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("p.svg");
        let points = |shift: u32| {
            (0..100u64)
                .map(|i| (i * 10, i << shift))
                .collect::<Vec<_>>()
        };
        let timeline = Timeline {
            allocated: points(24),
            reserved: points(25),
            requested: points(23),
        };
        let r = ReplayResult {
            events: 1000,
            peak_allocated: 99 << 24,
            peak_reserved: 99 << 25,
            peak_reserved_event: 990,
            peak_allocated_event: 990,
            retry_events: vec![500, 600],
            oom_events: vec![600],
            timeline,
            ..Default::default()
        };
        write(&path, "test", &r, Some(4 << 30)).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        assert!(svg.starts_with("<svg"));
        for needle in [
            "peak reserved 3.09 GiB (event 990)",
            "peak allocated 1.55 GiB",
            "alloc retry (2), top",
            "out of memory (1)",
            "GiB (2^30 bytes)",
            "capacity 4.00 GiB",
        ] {
            assert!(svg.contains(needle), "{needle}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
