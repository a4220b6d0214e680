//! Builds the project's benchmark, `tests/fixtures/cxr_bench/metadata.jsonl`, in exactly the
//! ChestAgentBench format, from `../shared/data`. Every answer comes from ground truth, not from
//! Hilum's tools: lung sizes from the expert masks in `cxr/ground_truth`, image sizes and bit
//! depths from `cxr/images.csv`, DICOM attributes from `cxr/dicom/dicom.csv`.
//! Images are referenced relative to the data folder (pass it as `--images-dir`), never copied.
//!
//! ```text
//! cargo run -p hilum-eval --example make_cxr_bench -- ../shared/data tests/fixtures/cxr_bench/metadata.jsonl
//! ```
//! Rerunning it on the same data writes the same file (options are placed by a hash of the id).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::json;

type Res<T> = Result<T, String>;

/// A small CSV reader (quoted fields may hold commas); enough for the data's two tables.
fn read_csv(path: &Path) -> Res<Vec<BTreeMap<String, String>>> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let mut rows: Vec<Vec<String>> = Vec::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let (mut fields, mut cur, mut quoted) = (Vec::new(), String::new(), false);
        let mut chars = line.chars().peekable();
        while let Some(c) = chars.next() {
            match (c, quoted) {
                ('"', true) if chars.peek() == Some(&'"') => {
                    cur.push('"');
                    chars.next();
                }
                ('"', _) => quoted = !quoted,
                (',', false) => fields.push(std::mem::take(&mut cur)),
                _ => cur.push(c),
            }
        }
        fields.push(cur);
        rows.push(fields);
    }
    let header = rows
        .first()
        .ok_or(format!("{} is empty", path.display()))?
        .clone();
    Ok(rows[1..]
        .iter()
        .map(|r| header.iter().cloned().zip(r.iter().cloned()).collect())
        .collect())
}

/// Connected regions of a binary mask (4-neighbourhood): (area, mean x), largest first.
fn regions(mask: &[bool], w: usize, h: usize) -> Vec<(usize, f64)> {
    let mut seen = vec![false; mask.len()];
    let mut out = Vec::new();
    let mut stack = Vec::new();
    for start in 0..mask.len() {
        if !mask[start] || seen[start] {
            continue;
        }
        seen[start] = true;
        stack.push(start);
        let (mut area, mut sx) = (0usize, 0f64);
        while let Some(p) = stack.pop() {
            area += 1;
            sx += (p % w) as f64;
            let (x, y) = (p % w, p / w);
            let mut push = |q: usize| {
                if mask[q] && !seen[q] {
                    seen[q] = true;
                    stack.push(q);
                }
            };
            if x > 0 {
                push(p - 1);
            }
            if x + 1 < w {
                push(p + 1);
            }
            if y > 0 {
                push(p - w);
            }
            if y + 1 < h {
                push(p + w);
            }
        }
        out.push((area, sx / area as f64));
    }
    out.sort_by_key(|r| std::cmp::Reverse(r.0));
    out
}

fn load_mask(path: &Path) -> Res<(Vec<bool>, usize, usize)> {
    let img = image::open(path)
        .map_err(|e| format!("cannot decode {}: {e}", path.display()))?
        .to_luma8();
    let (w, h) = (img.width() as usize, img.height() as usize);
    Ok((img.pixels().map(|p| p.0[0] >= 128).collect(), w, h))
}

/// Ground-truth lungs of one image: (patient's right area, patient's left area, image pixels).
struct Lungs {
    image: String,
    source: String,
    right: usize,
    left: usize,
    total: usize,
}

/// The patient's right lung is on the image's left on a frontal view: the two largest regions
/// of a combined mask, ordered by mean x.
fn lungs_from_combined(mask: &Path, image: &str, source: &str) -> Res<Lungs> {
    let (m, w, h) = load_mask(mask)?;
    let r = regions(&m, w, h);
    let [a, b] = [r.first(), r.get(1)];
    let (a, b) = match (a, b) {
        (Some(a), Some(b)) => (*a, *b),
        _ => return Err(format!("{}: fewer than two lung regions", mask.display())),
    };
    let (right, left) = if a.1 < b.1 { (a.0, b.0) } else { (b.0, a.0) };
    Ok(Lungs {
        image: image.into(),
        source: source.into(),
        right,
        left,
        total: w * h,
    })
}

/// Separate masks per lung; the file names are checked against the image side (a patient's
/// left lung lies on the image's right).
fn lungs_from_pair(dir: &Path, image: &str, source: &str) -> Res<Lungs> {
    let (r, w, h) = load_mask(&dir.join("right_lung.png"))?;
    let (l, _, _) = load_mask(&dir.join("left_lung.png"))?;
    let area = |m: &[bool]| m.iter().filter(|v| **v).count();
    let mean_x = |m: &[bool]| {
        let (s, n) = m
            .iter()
            .enumerate()
            .filter(|(_, v)| **v)
            .fold((0.0, 0usize), |(s, n), (i, _)| (s + (i % w) as f64, n + 1));
        s / n.max(1) as f64
    };
    if mean_x(&r) > mean_x(&l) {
        return Err(format!(
            "{}: right_lung.png lies on the image's right; the masks do not follow the patient's sides",
            dir.display()
        ));
    }
    Ok(Lungs {
        image: image.into(),
        source: source.into(),
        right: area(&r),
        left: area(&l),
        total: w * h,
    })
}

/// Places the right option among six by a hash of the id; returns the options and its letter.
fn place(id: &str, right: &str, wrong: &[String]) -> (Vec<String>, char) {
    let h = id
        .bytes()
        .fold(2166136261u32, |h, b| (h ^ b as u32).wrapping_mul(16777619));
    let pos = (h % 6) as usize;
    let mut opts: Vec<String> = wrong.iter().take(5).cloned().collect();
    opts.insert(pos.min(opts.len()), right.to_string());
    (opts, (b'A' + pos.min(5) as u8) as char)
}

struct Bench {
    lines: Vec<serde_json::Value>,
    per_case: BTreeMap<String, usize>,
}

impl Bench {
    #[allow(clippy::too_many_arguments)]
    fn add(
        &mut self,
        case: &str,
        image: &str,
        source: &str,
        stem: &str,
        right: &str,
        wrong: &[String],
        categories: &str,
        explanation: String,
    ) {
        let n = self.per_case.entry(case.to_string()).or_insert(0);
        *n += 1;
        let qid = format!("{case}_{n}");
        let (opts, letter) = place(&qid, right, wrong);
        let options: Vec<String> = opts
            .iter()
            .enumerate()
            .map(|(i, o)| format!("{}) {o}", (b'A' + i as u8) as char))
            .collect();
        self.lines.push(json!({
            "question_id": qid,
            "full_question_id": format!("hilum_cxr_bench_{qid}"),
            "case_id": case,
            "question": format!("{stem} {}", options.join(" ")),
            "answer": letter.to_string(),
            "images": [image],
            "categories": categories,
            "type": "multiple_choice",
            "sections": ["ground truth"],
            "explanation": explanation,
            "image_source_urls": [source],
        }));
    }
}

fn run(data: &Path, out: &Path) -> Res<()> {
    let cxr = data.join("cxr");
    let gt = cxr.join("ground_truth");
    let images = read_csv(&cxr.join("images.csv"))?;
    let source_of = |file: &str| {
        images
            .iter()
            .find(|r| r.get("file").map(String::as_str) == Some(file))
            .and_then(|r| r.get("source_repo").cloned())
            .unwrap_or_else(|| "shared/data".into())
    };
    let mut lungs = Vec::new();
    for r in read_csv(&gt.join("lung_masks/pairs.csv"))? {
        let (img, mask) = (&r["image"], &r["mask"]);
        let image = format!("cxr/images/{img}");
        lungs.push(lungs_from_combined(
            &gt.join("lung_masks").join(mask),
            &image,
            &source_of(img),
        )?);
    }
    for i in 1..=4 {
        let image = format!("cxr/ground_truth/lung_masks_imlab/imlab_{i}.jpg");
        let mask = gt.join(format!("lung_masks_imlab/imlab_{i}.mask.png"));
        lungs.push(lungs_from_combined(
            &mask,
            &image,
            "lung_masks_imlab (MIT)",
        )?);
    }
    let mut multi: Vec<PathBuf> = std::fs::read_dir(gt.join("multiclass"))
        .map_err(|e| format!("cannot list {}: {e}", gt.join("multiclass").display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .collect();
    multi.sort();
    for dir in multi {
        let name = dir
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default()
            .to_string();
        let file = images
            .iter()
            .filter_map(|r| r.get("file"))
            .find(|f| f.rsplit_once('.').map(|(s, _)| s) == Some(name.as_str()))
            .ok_or(format!("no image in images.csv for {}", dir.display()))?
            .clone();
        lungs.push(lungs_from_pair(
            &dir,
            &format!("cxr/images/{file}"),
            &source_of(&file),
        )?);
    }

    let mut b = Bench {
        lines: vec![],
        per_case: BTreeMap::new(),
    };
    let case_of = |image: &str| {
        Path::new(image)
            .file_stem()
            .and_then(|s| s.to_str())
            .unwrap_or(image)
            .replace(['.', ' '], "_")
    };
    for l in &lungs {
        let case = case_of(&l.image);
        let (larger, smaller, big, small) = if l.left > l.right {
            ("left", "right", l.left, l.right)
        } else {
            ("right", "left", l.right, l.left)
        };
        let diff = (big - small) as f64 / small as f64 * 100.0;
        let right = format!("The patient's {larger} lung");
        let wrong = vec![
            format!("The patient's {smaller} lung"),
            "Both lungs have exactly the same area".into(),
            "Neither lung can be seen".into(),
            "Only one lung is present".into(),
            "The question cannot be answered from a chest radiograph".into(),
        ];
        b.add(
            &case,
            &l.image,
            &l.source,
            "On this frontal chest radiograph, which lung field has the larger area: the patient's left or the patient's right?",
            &right,
            &wrong,
            "comparison,localization",
            format!(
                "Ground-truth masks: patient's right lung {} px, left lung {} px; the {larger} is {diff:.1}% larger.",
                l.right, l.left
            ),
        );
        let cover = (l.right + l.left) as f64 / l.total as f64 * 100.0;
        let bins = [
            "Less than 10% of the image",
            "10% to 20% of the image",
            "20% to 30% of the image",
            "30% to 40% of the image",
            "40% to 50% of the image",
            "More than 50% of the image",
        ];
        let k = ((cover / 10.0).floor() as usize).min(5);
        let wrong: Vec<String> = bins
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != k)
            .map(|(_, s)| s.to_string())
            .collect();
        b.add(
            &case,
            &l.image,
            &l.source,
            "About how much of the image area do the two lung fields cover together?",
            bins[k],
            &wrong,
            "measurement",
            format!("Ground-truth masks cover {cover:.1}% of the image."),
        );
    }

    // Image size and bit depth from images.csv, for images of several sizes and depths.
    let picks = [
        "nih_00000001_000_cardiomegaly.png",
        "nih_00001369_000_cardiomegaly.png",
        "medrax_effusion1.png",
        "medrax_normal1.jpg",
        "medrax_normal3.jpg",
        "kermany_person1946_bacteria_4874.jpeg",
        "covid_12941_2020_358_Fig1_HTML.jpg",
        "covid_X-ray_of_cyst_in_pneumocystis_pneumonia_1.jpg",
        "derived_RG1_chest_pa_16bit.png",
        "derived_CR-MONO1-10-chest_16bit.png",
    ];
    let sizes: Vec<(String, String)> = images
        .iter()
        .map(|r| (r["width"].clone(), r["height"].clone()))
        .collect();
    for file in picks {
        let r = images
            .iter()
            .find(|r| r["file"] == file)
            .ok_or(format!("{file} is not in images.csv"))?;
        let (w, h) = (r["width"].clone(), r["height"].clone());
        let image = format!("cxr/images/{file}");
        let case = case_of(&image);
        let right = format!("{w} x {h} pixels (width x height)");
        let mut wrong = vec![format!("{h} x {w} pixels (width x height)")];
        if w == h {
            wrong.clear();
        }
        for (ow, oh) in &sizes {
            let o = format!("{ow} x {oh} pixels (width x height)");
            if o != right && !wrong.contains(&o) && wrong.len() < 5 {
                wrong.push(o);
            }
        }
        for extra in ["256 x 256", "224 x 224", "4096 x 4096"] {
            if wrong.len() < 5 {
                wrong.push(format!("{extra} pixels (width x height)"));
            }
        }
        b.add(
            &case,
            &image,
            &r["source_repo"],
            "What are the pixel dimensions of this image?",
            &right,
            &wrong,
            "measurement,acquisition",
            format!("images.csv: {w} x {h}."),
        );
        let bits = r["bits_per_sample"].clone();
        let depths = ["1-bit", "8-bit", "10-bit", "12-bit", "16-bit", "32-bit"];
        let right = format!("{bits}-bit");
        let wrong: Vec<String> = depths
            .iter()
            .filter(|d| **d != right)
            .map(|d| d.to_string())
            .collect();
        b.add(
            &case,
            &image,
            &r["source_repo"],
            "What is the bit depth of each stored pixel sample in this image file?",
            &right,
            &wrong,
            "acquisition",
            format!("images.csv: {bits} bits per sample."),
        );
    }

    // DICOM attributes from dicom.csv.
    for r in read_csv(&cxr.join("dicom/dicom.csv"))? {
        let image = format!("cxr/dicom/{}", r["file"]);
        let case = case_of(&image);
        let src = &r["source_repo"];
        let pick = |right: &str, all: &[&str]| -> Vec<String> {
            all.iter()
                .filter(|x| **x != right)
                .map(|x| x.to_string())
                .collect()
        };
        let modality = r["modality"].clone();
        b.add(
            &case,
            &image,
            src,
            "What imaging modality does this DICOM file record?",
            &modality,
            &pick(&modality, &["CR", "DX", "CT", "MR", "US", "MG"]),
            "acquisition,dicom",
            format!("dicom.csv: Modality {modality}."),
        );
        let view = r["view"].clone();
        b.add(
            &case,
            &image,
            src,
            "Which projection (view position) does this DICOM file record?",
            &view,
            &pick(&view, &["PA", "AP", "LL", "RL", "AP supine", "Oblique"]),
            "acquisition,dicom",
            format!("dicom.csv: view {view}."),
        );
        let photometric = r["photometric"].clone();
        b.add(
            &case,
            &image,
            src,
            "What is the photometric interpretation of this DICOM image?",
            &photometric,
            &pick(
                &photometric,
                &[
                    "MONOCHROME1",
                    "MONOCHROME2",
                    "RGB",
                    "PALETTE COLOR",
                    "YBR_FULL",
                    "YBR_FULL_422",
                ],
            ),
            "acquisition,dicom",
            format!("dicom.csv: PhotometricInterpretation {photometric}."),
        );
        let stored = format!("{} bits", r["bits_stored"]);
        b.add(
            &case,
            &image,
            src,
            "How many bits are stored per pixel (BitsStored) in this DICOM image?",
            &stored,
            &pick(
                &stored,
                &[
                    "8 bits", "10 bits", "12 bits", "14 bits", "15 bits", "16 bits",
                ],
            ),
            "acquisition,dicom",
            format!("dicom.csv: BitsStored {}.", r["bits_stored"]),
        );
        // Pixel spacing only where the file records a real one.
        let spacing = r["pixel_spacing"].trim_matches(['[', ']']).to_string();
        let first = spacing.split(',').next().unwrap_or("").trim().to_string();
        if first.parse::<f64>().is_ok_and(|v| v > 0.0) {
            let right = format!("{first} mm");
            b.add(
                &case,
                &image,
                src,
                "What is the pixel spacing of this DICOM image (row spacing, in mm)?",
                &right,
                &pick(
                    &right,
                    &[
                        "0.100 mm", "0.139 mm", "0.143 mm", "0.168 mm", "0.200 mm", "0.250 mm",
                        "1.000 mm",
                    ],
                ),
                "measurement,dicom",
                format!("dicom.csv: PixelSpacing [{spacing}]."),
            );
        }
    }

    let mut text = String::new();
    for l in &b.lines {
        text.push_str(&l.to_string());
        text.push('\n');
    }
    if let Some(dir) = out.parent() {
        std::fs::create_dir_all(dir)
            .map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    }
    std::fs::write(out, text).map_err(|e| format!("cannot write {}: {e}", out.display()))?;
    let mut cats: BTreeMap<String, usize> = BTreeMap::new();
    for l in &b.lines {
        for c in l["categories"].as_str().unwrap_or("").split(',') {
            *cats.entry(c.to_string()).or_default() += 1;
        }
    }
    println!(
        "wrote {} questions ({} cases) to {}; per category: {:?}",
        b.lines.len(),
        b.per_case.len(),
        out.display(),
        cats
    );
    for l in &lungs {
        println!(
            "  {}: patient's right {} px, left {} px",
            l.image, l.right, l.left
        );
    }
    Ok(())
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (data, out) = match args.as_slice() {
        [d, o] => (PathBuf::from(d), PathBuf::from(o)),
        _ => {
            eprintln!("usage: make_cxr_bench DATA_DIR OUT.jsonl   (e.g. ../shared/data tests/fixtures/cxr_bench/metadata.jsonl)");
            std::process::exit(2);
        }
    };
    if let Err(e) = run(&data, &out) {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}
