//! Writes the three result objects for a source DICOM with synthetic results (made-up areas,
//! probabilities and rectangular masks), to check the writers with other tools:
//!
//! ```sh
//! cargo run -p hilum-pacs --example demo_results -- SOURCE.dcm OUT_DIR
//! dciodvfy OUT_DIR/sr.dcm; dsrdump OUT_DIR/sr.dcm
//! scripts/.venv-pacs/bin/python scripts/pacs_check.py seg OUT_DIR/seg.dcm
//! ```
//!
//! The values mean nothing clinically; the objects say "research use only".

use std::path::PathBuf;

use hilum_pacs::{
    read_dicom, sc, seg, sr, to_bytes, Device, Finding, Measurement, ModelInfo, Overlay, ResultSet,
    Segment, Side, SourceImage,
};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let [_, source, out] = args.as_slice() else {
        return Err("usage: demo_results SOURCE.dcm OUT_DIR".into());
    };
    let out = PathBuf::from(out);
    std::fs::create_dir_all(&out)?;
    let source = SourceImage::from_object(&read_dicom(&std::fs::read(source)?)?)?;
    let models = vec![
        ModelInfo {
            id: "demo-classifier".into(),
            sha256: "0".repeat(64),
        },
        ModelInfo {
            id: "demo-segmenter".into(),
            sha256: "f".repeat(64),
        },
    ];
    let mut rs = ResultSet::new(
        source,
        "demo",
        Device::hilum(env!("CARGO_PKG_VERSION"), "demo"),
        models,
    );
    rs.research_only = true;

    // Rectangles for the lungs and the heart, in the source's size.
    let (rows, cols) = (usize::from(rs.source.rows), usize::from(rs.source.columns));
    let rect = |y0: usize, y1: usize, x0: usize, x1: usize| -> Vec<u8> {
        (0..rows * cols)
            .map(|i| u8::from((y0..y1).contains(&(i / cols)) && (x0..x1).contains(&(i % cols))))
            .collect()
    };
    let right = rect(rows / 5, 4 * rows / 5, cols / 8, cols / 2 - cols / 20);
    let left = rect(rows / 5, 4 * rows / 5, cols / 2 + cols / 20, 7 * cols / 8);
    let heart = rect(rows / 2, 3 * rows / 4, 2 * cols / 5, 3 * cols / 5);
    let count = |m: &[u8]| m.iter().map(|&v| u64::from(v)).sum::<u64>();
    rs.measurements = vec![
        Measurement::lung_area(Side::Right, count(&right), "demo-segmenter"),
        Measurement::lung_area(Side::Left, count(&left), "demo-segmenter"),
        Measurement::cardiothoracic_ratio(0.45, "demo-segmenter"),
    ];
    rs.findings = vec![
        Finding::new("Effusion", 0.25, "demo-classifier"),
        Finding::new("Cardiomegaly", 0.5, "demo-classifier"),
    ];
    rs.answer = Some("Demo answer: synthetic values, not an analysis of this image.".into());
    rs.segments = vec![
        Segment::right_lung(right, "demo-segmenter"),
        Segment::left_lung(left, "demo-segmenter"),
        Segment::heart(heart, "demo-segmenter"),
    ];
    let rgb = rs.segments[0]
        .mask
        .iter()
        .zip(&rs.segments[1].mask)
        .zip(&rs.segments[2].mask)
        .flat_map(|((&r, &l), &h)| [r * 200, l * 200, h * 200])
        .collect();
    rs.overlay = Some(Overlay {
        rows: rs.source.rows,
        columns: rs.source.columns,
        rgb,
        description: "Demo masks (right lung red, left lung green, heart blue)".into(),
    });

    for (name, file) in [
        ("sr.dcm", sr::write(&rs)?),
        ("seg.dcm", seg::write(&rs)?),
        ("sc.dcm", sc::write(&rs)?),
    ] {
        let path = out.join(name);
        std::fs::write(&path, to_bytes(&file)?)?;
        println!("{}", path.display());
    }
    Ok(())
}
