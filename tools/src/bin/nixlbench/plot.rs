//! `--plot FILE.png`: bandwidth and latency against block size.

use crate::options::Options;
use crate::sweep::Row;

pub(crate) fn plot(path: &str, rows: &[Row], o: &Options) -> Result<(), String> {
    use plotters::prelude::*;
    let font = ["/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf"]
        .iter()
        .find_map(|p| std::fs::read(p).ok())
        .ok_or("--plot needs a TrueType font: install fonts-dejavu-core")?;
    plotters::style::register_font(
        "sans-serif",
        FontStyle::Normal,
        Box::leak(font.into_boxed_slice()),
    )
    .map_err(|_| "the font could not be loaded")?;
    let root = BitMapBackend::new(path, (1200, 500)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let (left, right) = root.split_horizontally(600);
    let batch = rows.first().map_or(1, |r| r.batch_size);
    let rows: Vec<&Row> = rows.iter().filter(|r| r.batch_size == batch).collect();
    let xs: Vec<f64> = rows.iter().map(|r| (r.block_size as f64).log2()).collect();
    let (x0, x1) = (
        xs.first().copied().unwrap_or(0.0),
        xs.last().copied().unwrap_or(1.0) + 0.01,
    );
    for (area, title, ys) in [
        (
            &left,
            "Bandwidth (GB/s)",
            rows.iter().map(|r| r.gbps).collect::<Vec<_>>(),
        ),
        (
            &right,
            "Avg latency (us)",
            rows.iter().map(|r| r.avg_lat_us).collect::<Vec<_>>(),
        ),
    ] {
        let ymax = ys.iter().copied().fold(0.0, f64::max) * 1.1 + 1e-9;
        let mut chart = ChartBuilder::on(area)
            .caption(
                format!("nixlbench {} {:?} batch {batch}: {title}", o.backend, o.op),
                ("sans-serif", 16),
            )
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(60)
            .build_cartesian_2d(x0..x1, 0.0..ymax)
            .map_err(|e| e.to_string())?;
        chart
            .configure_mesh()
            .x_desc("block size (log2 bytes)")
            .y_desc(title)
            .x_label_formatter(&|x| format!("{}", 1u64 << (*x as u32)))
            .draw()
            .map_err(|e| e.to_string())?;
        let points: Vec<(f64, f64)> = xs.iter().copied().zip(ys.iter().copied()).collect();
        chart
            .draw_series(LineSeries::new(points.clone(), &BLUE))
            .map_err(|e| e.to_string())?;
        chart
            .draw_series(points.iter().map(|p| Circle::new(*p, 3, BLUE.filled())))
            .map_err(|e| e.to_string())?;
    }
    root.present().map_err(|e| e.to_string())?;
    println!("plot written to {path}");
    Ok(())
}
