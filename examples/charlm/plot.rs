//! The loss curve as an SVG image (plotters' SVG back end: text is left
//! to the viewer's fonts, so no font files or system libraries are needed).
//!
//! It shows each batch's training loss (faint), its centred moving
//! average, the validation loss at each evaluation, and the unigram baseline.

use crate::train::History;
use crate::{Error, Result};
use plotters::prelude::*;
use std::path::Path;

/// Writes the loss curve of `history` to `path` (atomically: the image is
/// drawn in memory, then replaces the old file in one step).
pub fn loss_curve_svg(path: &Path, history: &History, unigram: f64, title: &str) -> Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    }
    let mut svg = String::new();
    draw(&mut svg, history, unigram, title).map_err(|e| Error::io(path, e))?;
    cellc_runtime::write_atomically(path, svg.as_bytes())?;
    Ok(())
}

/// Each point's loss replaced by the mean over the `window` points centred
/// on it (fewer at the ends), which follows the curve without lagging it.
fn moving_average(points: &[(usize, f64)], window: usize) -> Vec<(f64, f64)> {
    let half = window / 2;
    let mut prefix = vec![0.0];
    prefix.extend(points.iter().scan(0.0, |sum, &(_, loss)| {
        *sum += loss;
        Some(*sum)
    }));
    (0..points.len())
        .map(|i| {
            let (from, to) = (i.saturating_sub(half), (i + half + 1).min(points.len()));
            (points[i].0 as f64, (prefix[to] - prefix[from]) / (to - from) as f64)
        })
        .collect()
}

fn draw(
    svg: &mut String,
    history: &History,
    unigram: f64,
    title: &str,
) -> std::result::Result<(), Box<dyn std::error::Error>> {
    let steps = history.train.last().map_or(1, |&(s, _)| s).max(1) as f64;
    let highest = history.train.iter().chain(&history.valid).map(|&(_, l)| l).fold(unigram, f64::max);
    let y_max = (highest * 1.08).ceil().max(1.0);
    let blue = RGBColor(31, 119, 180);
    let orange = RGBColor(230, 85, 13);

    let root = SVGBackend::with_string(svg, (900, 520)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(18)
        .x_label_area_size(44)
        .y_label_area_size(56)
        .build_cartesian_2d(0.0..steps, 0.0..y_max)?;
    chart
        .configure_mesh()
        .x_desc("training step")
        .x_label_formatter(&|x| format!("{x:.0}"))
        .y_label_formatter(&|y| format!("{y:.1}"))
        .y_desc("loss (nats per character)")
        .light_line_style(RGBColor(235, 235, 235))
        .draw()?;

    let raw = history.train.iter().map(|&(s, l)| (s as f64, l));
    chart.draw_series(LineSeries::new(raw, blue.mix(0.25)))?;
    let window = (history.train.len() / 40).max(1) | 1;
    chart
        .draw_series(LineSeries::new(moving_average(&history.train, window), blue.stroke_width(2)))?
        .label(format!("training batches (mean of {window})"))
        .legend(move |(x, y)| PathElement::new([(x, y), (x + 24, y)], blue.stroke_width(2)));

    let valid: Vec<(f64, f64)> = history.valid.iter().map(|&(s, l)| (s as f64, l)).collect();
    chart
        .draw_series(LineSeries::new(valid.clone(), orange.stroke_width(2)))?
        .label("validation")
        .legend(move |(x, y)| PathElement::new([(x, y), (x + 24, y)], orange.stroke_width(2)));
    chart.draw_series(valid.iter().map(|&p| Circle::new(p, 3, orange.filled())))?;

    chart
        .draw_series(DashedLineSeries::new([(0.0, unigram), (steps, unigram)], 8, 6, BLACK.stroke_width(1)))?
        .label(format!("unigram baseline ({unigram:.3})"))
        .legend(|(x, y)| PathElement::new([(x, y), (x + 24, y)], BLACK.stroke_width(1)));

    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.9))
        .border_style(RGBColor(190, 190, 190))
        .label_font(("sans-serif", 15))
        .draw()?;
    root.present()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn moving_average_is_centred_and_shrinks_at_the_ends() {
        let points = [(1, 4.0), (2, 2.0), (3, 0.0), (4, 2.0), (5, 7.0)];
        let avg = moving_average(&points, 3);
        assert_eq!(avg, [(1.0, 3.0), (2.0, 2.0), (3.0, 4.0 / 3.0), (4.0, 3.0), (5.0, 4.5)]);
    }
}
