//! `--plot FILE.png`: bandwidth and latency against block size, a line per batch size,
//! both axes logarithmic. The labels' font is embedded (DejaVu Sans, from the `dejavu`
//! crate): no font file is looked for at run time.

use crate::options::Options;
use crate::sweep::Row;
use std::path::Path;
use tools::units::size_label;

/// Most labels on the block-size axis; more sizes than this label every other one (or
/// every third...).
const MAX_X_LABELS: usize = 10;

/// Checks, before the sweep, that the plot can be written: a `.png` name in a directory
/// that exists and takes a new file (by opening the file for writing; one created for
/// the check is removed again).
pub(crate) fn check_plot_path(path: &Path) -> Result<(), String> {
    let shown = path.display();
    let png = path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("png"));
    if !png {
        return Err(format!(
            "--plot {shown}: the plot is a PNG file: name it FILE.png"
        ));
    }
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    if !dir.is_dir() {
        return Err(format!(
            "--plot {shown}: there is no directory {}: create it or name another",
            dir.display()
        ));
    }
    if path.is_dir() {
        return Err(format!(
            "--plot {shown} is a directory: name a FILE.png in it"
        ));
    }
    let existed = path.exists();
    std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .map_err(|e| format!("--plot {shown}: cannot write it ({e}): name a writable path"))?;
    if !existed {
        let _ = std::fs::remove_file(path);
    }
    Ok(())
}

/// Registers the embedded font as plotters' `sans-serif` (once).
fn register_font() -> Result<(), String> {
    static REGISTERED: std::sync::OnceLock<Result<(), String>> = std::sync::OnceLock::new();
    REGISTERED
        .get_or_init(|| {
            plotters::style::register_font(
                "sans-serif",
                plotters::style::FontStyle::Normal,
                dejavu::sans::regular(),
            )
            .map_err(|_| "the embedded font could not be loaded".to_string())
        })
        .clone()
}

/// The x axis: log2 of the block size, from half a step before the first size to half a
/// step after the last (so neither end's label is cut), and how many labels to ask for:
/// one per size, at most [`MAX_X_LABELS`] (plotters then labels every size, or every
/// second...).
pub(crate) fn x_axis(rows: &[Row]) -> ((f64, f64), usize) {
    let mut sizes: Vec<usize> = rows.iter().map(|r| r.block_size).collect();
    sizes.sort_unstable();
    sizes.dedup();
    let log = |s: &usize| (*s as f64).log2();
    let first = sizes.first().map_or(0.0, log);
    let last = sizes.last().map_or(1.0, log);
    (
        (first - 0.5, last + 0.5),
        sizes.len().clamp(1, MAX_X_LABELS),
    )
}

/// The label at `x` (log2 of a size): the size for a whole power of two, nothing between
/// them (a tick between two sizes would repeat a label).
pub(crate) fn x_label(x: f64) -> String {
    if (x - x.round()).abs() < 1e-9 {
        size_label(x.round().exp2() as u64)
    } else {
        String::new()
    }
}

/// A y-axis figure: three significant digits, no trailing zeros (`100`, `12.5`, `1`,
/// `0.05`).
fn figure(y: f64) -> String {
    let decimals = if y >= 100.0 {
        0
    } else if y >= 10.0 {
        1
    } else if y >= 1.0 {
        2
    } else {
        3
    };
    let text = format!("{y:.decimals$}");
    if text.contains('.') {
        text.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        text
    }
}

/// The lines' colours (matplotlib's tab10: distinct on white, also in grey print).
const COLORS: [(u8, u8, u8); 10] = [
    (0x1f, 0x77, 0xb4),
    (0xd6, 0x27, 0x28),
    (0x2c, 0xa0, 0x2c),
    (0xff, 0x7f, 0x0e),
    (0x94, 0x67, 0xbd),
    (0x8c, 0x56, 0x4b),
    (0xe3, 0x77, 0xc2),
    (0x7f, 0x7f, 0x7f),
    (0xbc, 0xbd, 0x22),
    (0x17, 0xbe, 0xcf),
];

/// The colour of the `i`-th batch size.
fn color(i: usize) -> plotters::style::RGBColor {
    let (r, g, b) = COLORS[i % COLORS.len()];
    plotters::style::RGBColor(r, g, b)
}

/// The plot's size in pixels.
const SIZE: (u32, u32) = (1400, 560);

/// Writes the plot of `rows` to `path` (a PNG).
pub(crate) fn plot(path: &Path, rows: &[Row], o: &Options) -> Result<(), String> {
    use plotters::prelude::*;
    let root = BitMapBackend::new(path, SIZE).into_drawing_area();
    draw(&root, rows, o).map_err(|e| format!("drawing {}: {e}", path.display()))?;
    println!("plot written to {}", path.display());
    Ok(())
}

/// Draws the two panels on `root`.
fn draw<DB: plotters::prelude::DrawingBackend>(
    root: &plotters::prelude::DrawingArea<DB, plotters::coord::Shift>,
    rows: &[Row],
    o: &Options,
) -> Result<(), String> {
    use plotters::prelude::*;
    if rows.is_empty() {
        return Err("no rows to plot".into());
    }
    register_font()?;
    let draw = |e: DrawingAreaErrorKind<DB::ErrorType>| e.to_string();
    root.fill(&WHITE).map_err(draw)?;
    let (left, right) = root.split_horizontally(700);
    let ((x0, x1), x_labels) = x_axis(rows);
    let mut batches: Vec<usize> = rows.iter().map(|r| r.batch_size).collect();
    batches.sort_unstable();
    batches.dedup();
    /// What a panel plots of a row.
    type Column = fn(&Row) -> f64;
    let panels: [(_, &str, Column); 2] = [
        (&left, "bandwidth (GB/s)", |r| r.gbps),
        (&right, "average latency (us)", |r| r.avg_lat_us),
    ];
    for (area, title, value) in panels {
        let positive: Vec<f64> = rows.iter().map(value).filter(|v| *v > 0.0).collect();
        let lo = positive.iter().copied().fold(f64::MAX, f64::min);
        let hi = positive.iter().copied().fold(0.0, f64::max);
        let (lo, hi) = if positive.is_empty() {
            (1e-3, 1.0)
        } else {
            (lo / 1.5, hi * 1.5)
        };
        let mut chart = ChartBuilder::on(area)
            .caption(
                format!("nixlbench {} {:?}: {title}", o.backend, o.op),
                ("sans-serif", 18),
            )
            .margin(16)
            .x_label_area_size(44)
            .y_label_area_size(64)
            .build_cartesian_2d(x0..x1, (lo..hi).log_scale())
            .map_err(draw)?;
        chart
            .configure_mesh()
            .x_desc("block size (bytes)")
            .y_desc(title)
            .x_labels(x_labels)
            .x_label_formatter(&|x| x_label(*x))
            .y_labels(8)
            .y_label_formatter(&|y| figure(*y))
            .label_style(("sans-serif", 13))
            .draw()
            .map_err(draw)?;
        for (i, &batch) in batches.iter().enumerate() {
            let color = color(i);
            let points: Vec<(f64, f64)> = rows
                .iter()
                .filter(|r| r.batch_size == batch && value(r) > 0.0)
                .map(|r| ((r.block_size as f64).log2(), value(r)))
                .collect();
            chart
                .draw_series(LineSeries::new(points.clone(), color.stroke_width(2)))
                .map_err(draw)?
                .label(format!("batch {batch}"))
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
                });
            chart
                .draw_series(points.iter().map(|p| Circle::new(*p, 3, color.filled())))
                .map_err(draw)?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .label_font(("sans-serif", 13))
            .draw()
            .map_err(draw)?;
    }
    root.present().map_err(draw)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::options::parse_args;

    fn row(block: usize, batch: usize) -> Row {
        Row {
            block_size: block,
            batch_size: batch,
            gbps: (block * batch) as f64 / 1e5,
            avg_lat_us: 2.0 + (block * batch) as f64 / 1e4,
            prep: (0.0, 0.0),
            post: (0.0, 0.0),
            tx: (0.0, 0.0),
        }
    }

    fn temp_dir(name: &str) -> std::path::PathBuf {
        let dir =
            std::env::temp_dir().join(format!("nixlbench-plot-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn the_path_is_checked_before_the_sweep() {
        let dir = temp_dir("path");
        let ok = dir.join("out.png");
        check_plot_path(&ok).unwrap();
        assert!(!ok.exists(), "the check leaves no file behind");
        let e = check_plot_path(&dir.join("out.svg")).unwrap_err();
        assert!(e.contains("name it FILE.png"), "{e}");
        let e = check_plot_path(&dir.join("missing/out.png")).unwrap_err();
        assert!(e.contains("there is no directory"), "{e}");
        let e = check_plot_path(Path::new("/proc/nixlbench-test.png")).unwrap_err();
        assert!(e.contains("cannot write it"), "{e}");
        std::fs::create_dir_all(dir.join("d.png")).unwrap();
        let e = check_plot_path(&dir.join("d.png")).unwrap_err();
        assert!(e.contains("is a directory"), "{e}");
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn x_labels_are_distinct_sizes_and_at_most_ten() {
        use plotters::coord::ranged1d::Ranged;
        use plotters::coord::types::RangedCoordf64;
        // Every sweep from one to 27 block sizes, from 1 B or 4 KiB.
        for first in [0, 12] {
            for count in 1..=27 {
                let rows: Vec<Row> = (first..first + count)
                    .flat_map(|p| [row(1 << p, 1), row(1 << p, 4)])
                    .collect();
                let ((x0, x1), n) = x_axis(&rows);
                let keys = RangedCoordf64::from(x0..x1).key_points(n);
                let labels: Vec<String> = keys
                    .iter()
                    .map(|x| x_label(*x))
                    .filter(|l| !l.is_empty())
                    .collect();
                let mut unique = labels.clone();
                unique.sort();
                unique.dedup();
                let sweep = format!("{count} sizes from 2^{first}: {keys:?}");
                assert_eq!(labels.len(), unique.len(), "{sweep}");
                assert!(labels.len() <= MAX_X_LABELS, "{sweep}");
                assert!(labels.len() >= count.min(2) as usize, "{sweep}: {labels:?}");
                // Each label is a size of the sweep (the margins hold none).
                for x in keys.iter().filter(|x| !x_label(**x).is_empty()) {
                    assert!(*x >= first as f64 && *x < (first + count) as f64, "{sweep}");
                }
            }
        }
        assert_eq!(x_label(12.0), "4K");
        assert_eq!(x_label(12.5), "");
        assert_eq!(figure(123.4), "123");
        assert_eq!(figure(12.34), "12.3");
        assert_eq!(figure(10.0), "10");
        assert_eq!(figure(1.0), "1");
        assert_eq!(figure(0.5), "0.5");
        assert_eq!(figure(0.001), "0.001");
    }

    #[test]
    fn a_line_per_batch_size_in_a_png() {
        let dir = temp_dir("draw");
        let path = dir.join("sweep.png");
        let o = parse_args(&["--max_batch_size".into(), "4".into()]).unwrap();
        let rows: Vec<Row> = (12..=20)
            .flat_map(|p| [row(1 << p, 1), row(1 << p, 2), row(1 << p, 4)])
            .collect();
        plot(&path, &rows, &o).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
        let _ = std::fs::remove_dir_all(dir);
        // The same drawing in memory: each batch size's colour is there, a fourth is not.
        use plotters::prelude::*;
        let mut pixels = vec![0u8; (SIZE.0 * SIZE.1 * 3) as usize];
        {
            let root = BitMapBackend::with_buffer(&mut pixels, SIZE).into_drawing_area();
            draw(&root, &rows, &o).unwrap();
        }
        let count = |i: usize| {
            let c = color(i);
            pixels
                .chunks(3)
                .filter(|p| p[0] == c.0 && p[1] == c.1 && p[2] == c.2)
                .count()
        };
        for i in 0..3 {
            assert!(count(i) > 100, "batch line {i}: {} pixels", count(i));
        }
        assert_eq!(count(3), 0);
    }
}
