//! Independent readers agree with what Hilum wrote: highdicom (scripts/pacs_check.py, pinned in
//! scripts/requirements-pacs.txt) reads the SR's measurements and the SEG's masks, dicom3tools'
//! `dciodvfy` finds no errors in the SR, SEG and SC, dcmtk's `dsrdump` prints the SR.
//!
//! The tools come from `bash scripts/setup_pacs_tools.sh`, which prints
//! `export HILUM_PACS_PYTHON=...`. Without them these tests fail, naming that script, unless
//! HILUM_SKIP_PACS_TOOLS=1 says to skip them.

use std::path::{Path, PathBuf};
use std::process::Command;

use hilum_pacs::{sc, seg, sr, to_bytes, ResultSet};
use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::common::{CR_NO_META, RG1, SIIM};
use crate::sc::overlay_results;
use crate::seg::seg_results;

struct Tools {
    python: PathBuf,
}

/// The tools, or `None` when HILUM_SKIP_PACS_TOOLS=1 asks to skip; a missing tool otherwise
/// fails the test with what to run.
fn tools(test: &str) -> Option<Tools> {
    if std::env::var("HILUM_SKIP_PACS_TOOLS").as_deref() == Ok("1") {
        eprintln!(
            "{test}: skipped: HILUM_SKIP_PACS_TOOLS=1 (the independent DICOM readers are not run)"
        );
        return None;
    }
    let fix = "run `eval \"$(bash scripts/setup_pacs_tools.sh)\"` (or scripts/test.sh), \
               or set HILUM_SKIP_PACS_TOOLS=1 to skip the independent-reader tests";
    let python = std::env::var_os("HILUM_PACS_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| panic!("{test}: HILUM_PACS_PYTHON is not set: {fix}"));
    assert!(
        python.is_file(),
        "{test}: HILUM_PACS_PYTHON={} does not exist: {fix}",
        python.display()
    );
    for tool in ["dciodvfy", "dsrdump"] {
        if let Err(e) = Command::new(tool).arg("--help").output() {
            panic!("{test}: cannot run {tool} ({e}): {fix}");
        }
    }
    Some(Tools { python })
}

/// A scratch folder removed when dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("hilum-pacs-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }

    fn write(
        &self,
        name: &str,
        file: &hilum_pacs::FileDicomObject<hilum_pacs::InMemDicomObject>,
    ) -> PathBuf {
        let path = self.0.join(name);
        std::fs::write(&path, to_bytes(file).unwrap()).unwrap();
        path
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn pacs_check(tools: &Tools, kind: &str, path: &Path) -> Value {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/pacs_check.py");
    let out = Command::new(&tools.python)
        .arg(&script)
        .arg(kind)
        .arg(path)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "pacs_check.py {kind} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

fn code_of(v: &Value) -> (String, String) {
    (
        v["value"].as_str().unwrap_or_default().to_string(),
        v["scheme"].as_str().unwrap_or_default().to_string(),
    )
}

fn code_pair(c: &hilum_pacs::codes::Code) -> (String, String) {
    (c.value.clone(), c.scheme.clone())
}

/// A measurement's value as highdicom read it, from Python's repr (exact; serde_json's default
/// number parsing may miss the last bit).
fn exact(item: &Value) -> f64 {
    item["value_repr"].as_str().unwrap().parse().unwrap()
}

/// highdicom's TID 1500 reading equals the result set: every measurement (value exact, unit,
/// site, model), every finding (concept, probability exact, model), the texts, the references.
fn assert_sr_matches(rs: &ResultSet, got: &Value) {
    let src = &rs.source;
    assert_eq!(got["title"]["value"], "126000");
    assert_eq!(got["study"], src.study.instance_uid.as_str());
    assert_eq!(got["sop_instance"], sr::uids(rs).sop_instance_uid.as_str());
    let observer = &got["observers"][0];
    assert_eq!(observer["type"]["value"], "121007");
    assert_eq!(observer["name"], "Hilum");
    assert_eq!(observer["manufacturer"], "Hilum");
    assert_eq!(observer["model_name"], rs.device.model_name.as_str());
    let evidence = got["evidence"].as_array().unwrap();
    assert_eq!(evidence.len(), 1);
    assert_eq!(evidence[0]["sop_instance"], src.sop_instance_uid.as_str());
    assert_eq!(evidence[0]["series"], src.series_instance_uid.as_str());

    let groups = got["groups"].as_array().unwrap();
    assert_eq!(groups.len(), 1 + rs.findings.len());
    for g in groups {
        assert_eq!(g["source_images"][0], src.sop_instance_uid.as_str());
    }
    let measured = groups[0]["measurements"].as_array().unwrap();
    assert_eq!(groups[0]["tracking_identifier"], "Chest measurements");
    assert_eq!(measured.len(), rs.measurements.len());
    for m in &rs.measurements {
        let (value, unit) = m.resolved(src.pixel_spacing.as_ref());
        let item = measured
            .iter()
            .find(|i| i["tracking_identifier"] == m.name.as_str())
            .unwrap_or_else(|| panic!("highdicom has no measurement {:?}", m.name));
        assert_eq!(code_of(&item["name"]), code_pair(&m.code), "{}", m.name);
        assert_eq!(exact(item), value, "{}", m.name);
        assert_eq!(code_of(&item["unit"]), code_pair(&unit), "{}", m.name);
        let sites: Vec<(String, String)> = item["finding_sites"]
            .as_array()
            .unwrap()
            .iter()
            .map(code_of)
            .collect();
        assert_eq!(
            sites,
            m.site.iter().map(code_pair).collect::<Vec<_>>(),
            "{}",
            m.name
        );
        let model = rs
            .models
            .iter()
            .find(|x| Some(&x.id) == m.model_id.as_ref())
            .unwrap();
        assert_eq!(item["algorithm"]["name"], model.id.as_str());
        assert_eq!(item["algorithm"]["version"], model.sha256.as_str());
    }
    for f in &rs.findings {
        let g = groups
            .iter()
            .find(|g| g["tracking_identifier"] == f.label.as_str())
            .unwrap_or_else(|| panic!("highdicom has no group for finding {:?}", f.label));
        assert_eq!(
            code_of(&g["finding"]),
            code_pair(&f.concept()),
            "{}",
            f.label
        );
        let model = rs.models.iter().find(|x| x.id == f.model_id).unwrap();
        assert_eq!(g["algorithm"]["name"], model.id.as_str());
        assert_eq!(g["algorithm"]["version"], model.sha256.as_str());
        let p = &g["measurements"][0];
        assert_eq!(p["name"]["meaning"], "Probability");
        assert_eq!(exact(p), f.probability, "{}", f.label);
        assert_eq!(code_of(&p["unit"]), ("1".to_string(), "UCUM".to_string()));
    }
    let texts: Vec<&str> = got["qualitative_evaluations"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["text"].as_str().unwrap())
        .collect();
    assert!(texts.contains(&rs.answer.as_deref().unwrap()), "{texts:?}");
    assert!(
        texts.contains(&rs.question.as_deref().unwrap()),
        "{texts:?}"
    );
    assert!(
        texts.contains(&hilum_pacs::RESEARCH_ONLY_STATEMENT),
        "{texts:?}"
    );
    for m in &rs.models {
        let line = format!("{} sha256:{}", m.id, m.sha256);
        assert!(texts.contains(&line.as_str()), "{texts:?}");
    }
}

#[test]
fn highdicom_reads_the_sr_measurements_as_written() {
    let Some(tools) = tools("highdicom_reads_the_sr_measurements_as_written") else {
        return;
    };
    let scratch = Scratch::new("sr");
    // SIIM has a pixel spacing (areas in mm2); the bare data set has none (areas in pixels).
    for name in [SIIM, CR_NO_META] {
        let rs = seg_results(name, false);
        let path = scratch.write(&format!("{name}.sr.dcm"), &sr::write(&rs).unwrap());
        let got = pacs_check(&tools, "sr", &path);
        assert_sr_matches(&rs, &got);
        let unit = &got["groups"][0]["measurements"][0]["unit"]["value"];
        assert_eq!(unit, if name == SIIM { "mm2" } else { "{pixels}" });
    }
}

fn mask_digest(mask: &[u8]) -> (String, u64) {
    let bits: Vec<u8> = mask.iter().map(|&v| u8::from(v != 0)).collect();
    let count = bits.iter().map(|&b| u64::from(b)).sum();
    let digest = Sha256::digest(&bits);
    (digest.iter().map(|b| format!("{b:02x}")).collect(), count)
}

#[test]
fn highdicom_reads_the_seg_masks_pixel_for_pixel() {
    let Some(tools) = tools("highdicom_reads_the_seg_masks_pixel_for_pixel") else {
        return;
    };
    let scratch = Scratch::new("seg");
    // RG1 is 1955 x 1841: an odd pixel count, so its frames start in the middle of a byte.
    for (name, overlap) in [(SIIM, false), (RG1, false), (CR_NO_META, true)] {
        let rs = seg_results(name, overlap);
        let path = scratch.write(&format!("{name}.seg.dcm"), &seg::write(&rs).unwrap());
        let got = pacs_check(&tools, "seg", &path);
        assert_eq!(got["segmentation_type"], "BINARY");
        assert_eq!(got["study"], rs.source.study.instance_uid.as_str());
        assert_eq!(
            got["source_images"][0]["sop_instance"],
            rs.source.sop_instance_uid.as_str()
        );
        let segments = got["segments"].as_array().unwrap();
        assert_eq!(segments.len(), rs.segments.len());
        for (i, (s, g)) in rs.segments.iter().zip(segments).enumerate() {
            assert_eq!(g["number"].as_u64(), Some(i as u64 + 1));
            assert_eq!(g["label"], s.label.as_str());
            assert_eq!(code_of(&g["category"]), code_pair(&s.category));
            assert_eq!(code_of(&g["type"]), code_pair(&s.property_type));
            assert_eq!(g["algorithm_type"], "AUTOMATIC");
            assert_eq!(g["algorithm_name"], s.model_id.as_str());
            assert_eq!(
                g["shape"],
                serde_json::json!([rs.source.rows, rs.source.columns])
            );
            let (sha, count) = mask_digest(&s.mask);
            assert_eq!(g["pixels"].as_u64(), Some(count), "{name} {}", s.label);
            assert_eq!(
                g["sha256"],
                sha.as_str(),
                "{name} {}: highdicom's mask differs",
                s.label
            );
        }
    }
}

#[test]
fn pydicom_reads_the_overlay_pixels_as_written() {
    let Some(tools) = tools("pydicom_reads_the_overlay_pixels_as_written") else {
        return;
    };
    let scratch = Scratch::new("sc");
    let rs = overlay_results(SIIM, 1024, 1024);
    let path = scratch.write("overlay.dcm", &sc::write(&rs).unwrap());
    let got = pacs_check(&tools, "sc", &path);
    let overlay = rs.overlay.as_ref().unwrap();
    let sha: String = Sha256::digest(&overlay.rgb)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    assert_eq!(got["rgb_sha256"], sha.as_str());
    assert_eq!(got["shape"], serde_json::json!([1024, 1024, 3]));
    assert_eq!(got["burned_in_annotation"], "YES");
    assert_eq!(
        got["image_type"],
        serde_json::json!(["DERIVED", "SECONDARY"])
    );
    assert_eq!(got["source_images"][0], rs.source.sop_instance_uid.as_str());
}

/// dciodvfy's lines, Errors apart.
fn dciodvfy(path: &Path) -> (Vec<String>, Vec<String>) {
    let out = Command::new("dciodvfy").arg(path).output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<String> = text.lines().map(str::to_string).collect();
    let errors = lines
        .iter()
        .filter(|l| l.starts_with("Error"))
        .cloned()
        .collect();
    (errors, lines)
}

#[test]
fn dciodvfy_finds_no_errors_in_the_sr_seg_and_overlay() {
    let Some(_tools) = tools("dciodvfy_finds_no_errors_in_the_sr_seg_and_overlay") else {
        return;
    };
    let scratch = Scratch::new("dciodvfy");
    for name in [SIIM, RG1, CR_NO_META] {
        let mut rs = seg_results(name, false);
        rs.overlay = overlay_results(name, rs.source.rows, rs.source.columns).overlay;
        let files = [
            (
                "SR",
                scratch.write(&format!("{name}.sr.dcm"), &sr::write(&rs).unwrap()),
                "ComprehensiveSR",
            ),
            (
                "SEG",
                scratch.write(&format!("{name}.seg.dcm"), &seg::write(&rs).unwrap()),
                "Segmentation",
            ),
            (
                "SC",
                scratch.write(&format!("{name}.sc.dcm"), &sc::write(&rs).unwrap()),
                "SCImage",
            ),
        ];
        for (kind, path, iod) in files {
            let (errors, lines) = dciodvfy(&path);
            for l in lines.iter().filter(|l| l.starts_with("Warning")) {
                eprintln!("dciodvfy {kind} of {name}: {l}");
            }
            assert!(
                errors.is_empty(),
                "dciodvfy {kind} of {name}:\n{}",
                lines.join("\n")
            );
            assert!(
                lines.iter().any(|l| l == iod),
                "dciodvfy did not recognise the {kind} as {iod}:\n{}",
                lines.join("\n")
            );
        }
    }
}

#[test]
fn dsrdump_prints_the_title_and_measurements() {
    let Some(_tools) = tools("dsrdump_prints_the_title_and_measurements") else {
        return;
    };
    let scratch = Scratch::new("dsrdump");
    let rs = seg_results(SIIM, false);
    let path = scratch.write("sr.dcm", &sr::write(&rs).unwrap());
    let out = Command::new("dsrdump").arg(&path).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    // 61 234 and 52 101 pixels of 0.168 mm x 0.168 mm.
    assert_eq!(
        rs.source.pixel_spacing.unwrap().pixel_area_mm2(),
        0.168 * 0.168
    );
    for needle in [
        "Comprehensive SR Document".to_string(),
        "\"Imaging Measurement Report\"".to_string(),
        "\"Area\")=\"1728.268416\" (mm2,UCUM".to_string(),
        "\"Area\")=\"1470.498624\" (mm2,UCUM".to_string(),
        "(44029006,SCT,\"Left lung\")".to_string(),
        "(3341006,SCT,\"Right lung\")".to_string(),
        "\"Cardiothoracic ratio\")=\"0.4871\" (1,UCUM".to_string(),
        "(60046008,SCT,\"Pleural effusion\")".to_string(),
        "\"Probability\")=\"0.8125\"".to_string(),
        "\"Device Observer Model Name\")=\"Hilum 0.1.0\"".to_string(),
    ] {
        assert!(text.contains(&needle), "dsrdump lacks {needle}:\n{text}");
    }
}
