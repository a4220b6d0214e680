//! The DICOMweb client against a real Orthanc (Debian's orthanc 1.10.1 with orthanc-dicomweb):
//! STOW-RS of the shared radiographs and of the SR, SEG and overlay the writers make for one of
//! them, QIDO-RS finding the three result series in the source's study, WADO-RS returning the
//! pixel data byte for byte, a resend that adds nothing, `pull_study`, and the error for a PACS
//! that is not there.
//!
//! The test starts its own Orthanc with scripts/deploy/orthanc_start.sh (on free 127.0.0.1 ports, files
//! under Cargo's target tmp folder) and kills it at the end; with HILUM_ORTHANC_URL set it uses
//! that server instead (and leaves it running). Without Orthanc it fails, naming
//! scripts/setup_pacs_tools.sh, unless HILUM_SKIP_PACS_TOOLS=1 says to skip.
//!
//! The error paths a real Orthanc does not produce (a bearer token's header, a 500 with a long
//! body, a slow server, a truncated WADO-RS body, a STOW-RS 409, a hostile SOP Instance UID) are
//! tested against a few lines of HTTP server in this file.

#[allow(dead_code)]
#[path = "it/common/mod.rs"]
mod common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use dicom_dictionary_std::tags;
use hilum_pacs::dicomweb::{pull_study, DicomWebClient, DicomWebConfig, DicomWebError};
use hilum_pacs::{
    read_dicom, sc, seg, sr, to_bytes, Device, FileDicomObject, Finding, InMemDicomObject,
    Measurement, ModelInfo, Overlay, ResultSet, Segment, Side, SourceImage,
};

use common::{dicom_dir, CR_NO_META, RG1, SIIM};

/// An Orthanc for this test: started by scripts/deploy/orthanc_start.sh (killed and its files removed
/// on drop), or the one HILUM_ORTHANC_URL names.
struct Orthanc {
    url: String,
    pid: Option<u32>,
    work: Option<PathBuf>,
}

impl Orthanc {
    fn start(test: &str) -> Option<Self> {
        Self::start_with(test, None)
    }

    /// `user` (`name:password`) starts an Orthanc of this test's own with HTTP basic
    /// authentication, even when HILUM_ORTHANC_URL is set.
    fn start_with(test: &str, user: Option<&str>) -> Option<Self> {
        if let (Ok(url), None) = (std::env::var("HILUM_ORTHANC_URL"), user) {
            eprintln!("{test}: using the Orthanc at HILUM_ORTHANC_URL={url}");
            return Some(Self {
                url,
                pid: None,
                work: None,
            });
        }
        if std::env::var("HILUM_SKIP_PACS_TOOLS").as_deref() == Ok("1") {
            eprintln!("{test}: skipped: HILUM_SKIP_PACS_TOOLS=1 (no Orthanc is started)");
            return None;
        }
        let fix = "run `bash scripts/setup_pacs_tools.sh` (installs Debian's orthanc and \
                   orthanc-dicomweb), or set HILUM_SKIP_PACS_TOOLS=1 to skip the Orthanc tests";
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let out = Command::new("bash")
            .arg(root.join("scripts/deploy/orthanc_start.sh"))
            .arg(env!("CARGO_TARGET_TMPDIR"))
            .env_remove("HILUM_ORTHANC_USER")
            .envs(user.map(|u| ("HILUM_ORTHANC_USER", u)))
            .output()
            .unwrap_or_else(|e| {
                panic!("{test}: cannot run scripts/deploy/orthanc_start.sh ({e}): {fix}")
            });
        let stdout = String::from_utf8_lossy(&out.stdout);
        let var = |name: &str| {
            stdout.lines().find_map(|l| {
                l.strip_prefix(&format!("export {name}="))
                    .map(str::to_string)
            })
        };
        let started = Self {
            url: var("HILUM_ORTHANC_URL").unwrap_or_default(),
            pid: var("HILUM_ORTHANC_PID").and_then(|p| p.parse().ok()),
            work: var("HILUM_ORTHANC_WORK").map(PathBuf::from),
        };
        assert!(
            out.status.success() && !started.url.is_empty(),
            "{test}: scripts/deploy/orthanc_start.sh failed: {}\n{fix}",
            String::from_utf8_lossy(&out.stderr)
        );
        Some(started)
    }

    fn config(&self) -> DicomWebConfig {
        DicomWebConfig::new(format!("{}/dicom-web", self.url))
    }

    fn client(&self) -> DicomWebClient {
        DicomWebClient::new(self.config()).unwrap()
    }
}

impl Drop for Orthanc {
    fn drop(&mut self) {
        if let Some(pid) = self.pid {
            let _ = Command::new("kill").arg(pid.to_string()).status();
            let deadline = Instant::now() + Duration::from_secs(10);
            while Instant::now() < deadline
                && Command::new("kill")
                    .args(["-0", &pid.to_string()])
                    .stderr(std::process::Stdio::null())
                    .status()
                    .is_ok_and(|s| s.success())
            {
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        if let Some(work) = &self.work {
            let _ = std::fs::remove_dir_all(work);
        }
    }
}

/// Every log line of every crate, at every level, from the first test that asks on (a global
/// tracing subscriber for this test binary).
#[derive(Clone, Default)]
struct LogBuf(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for LogBuf {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for LogBuf {
    type Writer = LogBuf;
    fn make_writer(&'a self) -> LogBuf {
        self.clone()
    }
}

fn logs() -> &'static LogBuf {
    static LOGS: std::sync::OnceLock<LogBuf> = std::sync::OnceLock::new();
    LOGS.get_or_init(|| {
        let buf = LogBuf::default();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(buf.clone())
            .with_max_level(tracing_subscriber::filter::LevelFilter::TRACE)
            .with_ansi(false)
            .finish();
        tracing::subscriber::set_global_default(subscriber)
            .expect("no other test of this binary sets a global tracing subscriber");
        buf
    })
}

/// Patient names, ids and birth dates of the shared files (values of 3 characters or more).
fn patient_data(sources: &[Sent]) -> Vec<String> {
    let mut phi = Vec::new();
    for s in sources {
        for tag in [
            tags::PATIENT_NAME,
            tags::PATIENT_ID,
            tags::PATIENT_BIRTH_DATE,
        ] {
            if let Some(v) = s.obj.get(tag).and_then(|e| e.to_str().ok()) {
                let v = v.trim_end_matches(['\0', ' ']).trim().to_string();
                if v.len() >= 3 {
                    phi.push(v);
                }
            }
        }
    }
    phi
}

/// A scratch folder removed when dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Self {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("dicomweb-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        Self(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Synthetic results for a source (as the demo_results example makes them): lung and heart
/// rectangles, areas, the CTR, two findings, an overlay.
fn results(source: SourceImage) -> ResultSet {
    let models = vec![
        ModelInfo {
            id: "test-classifier".into(),
            sha256: "0".repeat(64),
        },
        ModelInfo {
            id: "test-segmenter".into(),
            sha256: "f".repeat(64),
        },
    ];
    let mut rs = ResultSet::new(
        source,
        "dicomweb-test",
        Device::hilum(env!("CARGO_PKG_VERSION"), "test"),
        models,
    );
    rs.research_only = true;
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
        Measurement::lung_area(Side::Right, count(&right), "test-segmenter"),
        Measurement::lung_area(Side::Left, count(&left), "test-segmenter"),
        Measurement::cardiothoracic_ratio(0.45, "test-segmenter"),
    ];
    rs.findings = vec![Finding::new("Cardiomegaly", 0.5, "test-classifier")];
    let rgb = right
        .iter()
        .zip(&left)
        .zip(&heart)
        .flat_map(|((&r, &l), &h)| [r * 200, l * 200, h * 200])
        .collect();
    rs.segments = vec![
        Segment::right_lung(right, "test-segmenter"),
        Segment::left_lung(left, "test-segmenter"),
        Segment::heart(heart, "test-segmenter"),
    ];
    rs.overlay = Some(Overlay {
        rows: rs.source.rows,
        columns: rs.source.columns,
        rgb,
        description: "Test masks".into(),
    });
    rs
}

fn text(obj: &InMemDicomObject, tag: dicom_object::Tag) -> String {
    obj.element(tag)
        .unwrap_or_else(|e| panic!("{tag}: {e}"))
        .to_str()
        .unwrap()
        .trim_end_matches(['\0', ' '])
        .to_string()
}

/// What was sent: the Part 10 bytes, and the data set for the comparisons.
struct Sent {
    name: String,
    bytes: Vec<u8>,
    obj: FileDicomObject<InMemDicomObject>,
}

impl Sent {
    fn study(&self) -> String {
        text(&self.obj, tags::STUDY_INSTANCE_UID)
    }
    fn series(&self) -> String {
        text(&self.obj, tags::SERIES_INSTANCE_UID)
    }
    fn instance(&self) -> String {
        text(&self.obj, tags::SOP_INSTANCE_UID)
    }
}

fn sent(name: &str, bytes: Vec<u8>) -> Sent {
    let obj = read_dicom(&bytes).unwrap_or_else(|e| panic!("{name}: {e}"));
    Sent {
        name: name.to_string(),
        bytes,
        obj,
    }
}

/// The shared radiographs as Part 10 bytes. The one without a Part 10 header is read as
/// source.rs reads it (a File Meta built from its own SOP class and instance) and re-encoded.
/// `fake_monochrome1_variant.dcm` is left out: it is SIIM's image with SIIM's SOP Instance UID
/// and only PhotometricInterpretation changed, so a PACS would replace one with the other.
fn shared_sources() -> Vec<Sent> {
    [SIIM, RG1, CR_NO_META]
        .into_iter()
        .map(|name| {
            let raw = std::fs::read(dicom_dir().join(name))
                .unwrap_or_else(|e| panic!("{name}: {e} (../shared/data beside the checkout)"));
            let bytes = if name == CR_NO_META {
                to_bytes(&read_dicom(&raw).unwrap()).unwrap()
            } else {
                raw
            };
            sent(name, bytes)
        })
        .collect()
}

/// PixelData (7FE0,0010) as dicom-object reads it: native bytes, or the encapsulated fragments.
fn pixel_data(obj: &InMemDicomObject) -> &dicom_core::value::Value<InMemDicomObject> {
    obj.element(tags::PIXEL_DATA).unwrap().value()
}

/// Whether any ReferencedSOPInstanceUID (0008,1155), at any depth, is `uid`.
fn references(obj: &InMemDicomObject, uid: &str) -> bool {
    obj.iter().any(|e| {
        if e.header().tag == tags::REFERENCED_SOP_INSTANCE_UID
            && e.to_str()
                .is_ok_and(|v| v.trim_end_matches(['\0', ' ']) == uid)
        {
            return true;
        }
        match e.value() {
            dicom_core::value::Value::Sequence(seq) => {
                seq.items().iter().any(|item| references(item, uid))
            }
            _ => false,
        }
    })
}

async fn instance_uids(client: &DicomWebClient, study: &str) -> BTreeSet<String> {
    let mut uids = BTreeSet::new();
    for series in client.qido_series(study, &[]).await.unwrap() {
        for inst in client
            .qido_instances(study, &series.series_instance_uid)
            .await
            .unwrap()
        {
            uids.insert(inst.sop_instance_uid);
        }
    }
    uids
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn orthanc_stow_qido_wado_pull() {
    let test = "orthanc_stow_qido_wado_pull";
    logs();
    let Some(orthanc) = Orthanc::start(test) else {
        return;
    };
    let client = orthanc.client();

    // STOW-RS the shared radiographs in one request.
    let sources = shared_sources();
    let bytes: Vec<Vec<u8>> = sources.iter().map(|s| s.bytes.clone()).collect();
    let resp = client.stow(None, &bytes).await.unwrap();
    assert_eq!(resp.status, 200, "{resp:?}");
    assert!(resp.failed.is_empty(), "{:?}", resp.failed);
    let stored: BTreeSet<_> = resp.stored.iter().cloned().collect();
    let expected: BTreeSet<_> = sources.iter().map(Sent::instance).collect();
    assert_eq!(stored, expected);

    // The results the writers make for SIIM, into its study (STOW-RS with the study UID).
    let source = sources.iter().find(|s| s.name == SIIM).unwrap();
    let study = source.study();
    let rs = results(SourceImage::from_object(&source.obj).unwrap());
    let written: Vec<Sent> = [
        ("sr", sr::write(&rs).unwrap()),
        ("seg", seg::write(&rs).unwrap()),
        ("sc", sc::write(&rs).unwrap()),
    ]
    .into_iter()
    .map(|(name, file)| sent(name, to_bytes(&file).unwrap()))
    .collect();
    let result_bytes: Vec<Vec<u8>> = written.iter().map(|s| s.bytes.clone()).collect();
    let resp = client.stow(Some(&study), &result_bytes).await.unwrap();
    assert_eq!(resp.status, 200, "{resp:?}");
    let stored: BTreeSet<_> = resp.stored.iter().cloned().collect();
    assert_eq!(
        stored,
        written.iter().map(Sent::instance).collect::<BTreeSet<_>>()
    );

    // QIDO-RS: the study, and the SR, SEG and overlay series in it, beside the source's.
    let studies = client
        .qido_studies(&[("StudyInstanceUID", study.as_str())])
        .await
        .unwrap();
    assert_eq!(studies.len(), 1, "{studies:?}");
    assert_eq!(studies[0].study_instance_uid, study);
    let all = client.qido_studies(&[]).await.unwrap();
    for s in &sources {
        assert!(
            all.iter().any(|r| r.study_instance_uid == s.study()),
            "{}",
            s.name
        );
    }
    let series = client.qido_series(&study, &[]).await.unwrap();
    let source_modality = text(&source.obj, tags::MODALITY);
    for (w, modality) in written.iter().zip(["SR", "SEG", source_modality.as_str()]) {
        assert_eq!(
            w.study(),
            study,
            "{}: written into the source's study",
            w.name
        );
        assert_eq!(text(&w.obj, tags::MODALITY), modality, "{}", w.name);
        let found = series
            .iter()
            .find(|s| s.series_instance_uid == w.series())
            .unwrap_or_else(|| panic!("{}: series not found by QIDO-RS: {series:?}", w.name));
        assert_eq!(found.modality.as_deref(), Some(modality), "{}", w.name);
        let instances = client
            .qido_instances(&study, &found.series_instance_uid)
            .await
            .unwrap();
        assert_eq!(instances.len(), 1, "{}", w.name);
        assert_eq!(instances[0].sop_instance_uid, w.instance());
        assert_eq!(
            instances[0].sop_class_uid.as_deref(),
            Some(
                w.obj
                    .meta()
                    .media_storage_sop_class_uid()
                    .trim_end_matches('\0')
            )
        );
    }
    assert!(series
        .iter()
        .any(|s| s.series_instance_uid == source.series()));
    // A filter: only the SEG series.
    let segs = client
        .qido_series(&study, &[("Modality", "SEG")])
        .await
        .unwrap();
    assert_eq!(segs.len(), 1);
    assert_eq!(segs[0].series_instance_uid, written[1].series());

    // WADO-RS: every source's pixel data and every result object come back byte for byte.
    for s in sources.iter().chain(&written) {
        let got = client
            .wado_instance(&s.study(), &s.series(), &s.instance())
            .await
            .unwrap_or_else(|e| panic!("{}: {e}", s.name));
        // Orthanc keeps the file as sent and `transfer-syntax=*` returns it as stored.
        assert!(
            got == s.bytes,
            "{}: the file differs after the round trip",
            s.name
        );
        let got = read_dicom(&got).unwrap_or_else(|e| panic!("{}: {e}", s.name));
        assert_eq!(text(&got, tags::SOP_INSTANCE_UID), s.instance());
        if s.obj.element(tags::PIXEL_DATA).is_ok() {
            assert!(
                pixel_data(&got) == pixel_data(&s.obj),
                "{}: PixelData differs after the round trip",
                s.name
            );
        }
    }

    // The SR, SEG and overlay Orthanc returns reference the source instance.
    for w in &written {
        let got = client
            .wado_instance(&study, &w.series(), &w.instance())
            .await
            .unwrap();
        let got = read_dicom(&got).unwrap();
        assert!(!references(&got, "1.2.3.4.5"));
        assert!(
            references(&got, &source.instance()),
            "{}: no reference to the source's SOP Instance UID",
            w.name
        );
    }

    // A resend of the sources and the results stores nothing new.
    let before = instance_uids(&client, &study).await;
    let total_before = client.qido_studies(&[]).await.unwrap();
    let resp = client.stow(None, &bytes).await.unwrap();
    assert!(resp.failed.is_empty(), "{resp:?}");
    let resp = client.stow(Some(&study), &result_bytes).await.unwrap();
    assert!(resp.failed.is_empty(), "{resp:?}");
    assert_eq!(resp.stored.len(), 3);
    let after = instance_uids(&client, &study).await;
    assert_eq!(before, after);
    assert_eq!(after.len(), 4, "SIIM's study: source + SR + SEG + overlay");
    let total_after = client.qido_studies(&[]).await.unwrap();
    let counts = |v: &[hilum_pacs::dicomweb::StudyRecord]| {
        v.iter()
            .map(|s| (s.study_instance_uid.clone(), s.number_of_instances))
            .collect::<Vec<_>>()
    };
    assert_eq!(counts(&total_before), counts(&total_after));

    // pull_study writes every instance of the study as <SOPInstanceUID>.dcm.
    let dest = Scratch::new("pull");
    let paths = pull_study(&client, &study, &dest.0).await.unwrap();
    let names: BTreeSet<_> = paths
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    assert_eq!(
        names,
        after
            .iter()
            .map(|u| format!("{u}.dcm"))
            .collect::<BTreeSet<_>>()
    );
    let listed = std::fs::read_dir(&dest.0).unwrap().count();
    assert_eq!(listed, 4, "no temporary files are left");
    for p in &paths {
        let obj = read_dicom(&std::fs::read(p).unwrap()).unwrap();
        let uid = text(&obj, tags::SOP_INSTANCE_UID);
        assert_eq!(
            p.file_name().unwrap().to_string_lossy(),
            format!("{uid}.dcm")
        );
        if uid == source.instance() {
            assert!(pixel_data(&obj) == pixel_data(&source.obj));
        }
    }

    // Errors that say what to check.
    let e = client.wado_study("1.2.3.4.5.6.7.8.9").await.unwrap_err();
    assert!(matches!(e, DicomWebError::Http { status: 404, .. }), "{e}");
    let e = client.wado_study("../system").await.unwrap_err();
    assert!(matches!(e, DicomWebError::InvalidUid { .. }), "{e}");
    let nothing = client
        .qido_studies(&[("StudyInstanceUID", "1.2.3.4.5.6.7.8.9")])
        .await
        .unwrap();
    assert!(nothing.is_empty());

    // No patient data in any log line of any crate (reqwest, hyper included, at TRACE), even
    // after QIDO-RS searches by patient name and id, whose results carry them.
    let phi = patient_data(&sources);
    assert!(
        phi.len() >= 3,
        "the shared files have patient data to look for"
    );
    let siim_name = tag_of(&source.obj, tags::PATIENT_NAME);
    let siim_id = tag_of(&source.obj, tags::PATIENT_ID);
    for filter in [
        ("PatientName", siim_name.as_str()),
        ("PatientID", siim_id.as_str()),
    ] {
        let found = client.qido_studies(&[filter]).await.unwrap();
        assert!(
            found.iter().any(|s| s.study_instance_uid == study),
            "{filter:?}"
        );
    }
    let logs = String::from_utf8_lossy(&logs().0.lock().unwrap()).into_owned();
    assert!(
        logs.contains("stow-rs"),
        "the client logged nothing:\n{logs}"
    );
    for v in &phi {
        for line in logs.lines() {
            assert!(
                !line.contains(v.as_str()),
                "a log line carries patient data {v:?}: {line}"
            );
        }
    }
}

fn tag_of(obj: &InMemDicomObject, tag: dicom_object::Tag) -> String {
    obj.get(tag)
        .and_then(|e| e.to_str().ok())
        .map(|v| v.trim_end_matches(['\0', ' ']).to_string())
        .unwrap_or_default()
}

#[test]
fn missing_orthanc_names_the_setup_script() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let out = Command::new("bash")
        .arg(root.join("scripts/deploy/orthanc_start.sh"))
        .arg(env!("CARGO_TARGET_TMPDIR"))
        .env("HILUM_ORTHANC_BIN", "/nonexistent/Orthanc")
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(out.stdout.is_empty(), "no exports without an Orthanc");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("scripts/setup_pacs_tools.sh"), "{err}");
}

#[tokio::test]
async fn unreachable_pacs_says_to_check_it_is_running() {
    // A port nothing listens on: bind one, note it, close it.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let base = format!("http://127.0.0.1:{port}/dicom-web");
    let client = DicomWebClient::new(
        DicomWebConfig::new(&base).timeouts(Duration::from_secs(2), Duration::from_secs(5)),
    )
    .unwrap();
    let e = client
        .qido_studies(&[("PatientName", "Secret^Name")])
        .await
        .unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, DicomWebError::Unreachable { .. }), "{msg}");
    assert!(
        msg.contains(&format!("is the PACS at {base} running")),
        "{msg}"
    );
    assert!(!msg.contains("Secret"), "no query string in errors: {msg}");
    let e = client.stow(None, &[b"x".to_vec()]).await.unwrap_err();
    assert!(matches!(e, DicomWebError::Unreachable { .. }), "{e}");
}

#[tokio::test]
async fn orthanc_basic_auth_and_refused_credentials() {
    let test = "orthanc_basic_auth_and_refused_credentials";
    let Some(orthanc) = Orthanc::start_with(test, Some("hilum:s3cret pass")) else {
        return;
    };
    let ok = DicomWebClient::new(orthanc.config().basic("hilum", "s3cret pass")).unwrap();
    assert!(ok.qido_studies(&[]).await.unwrap().is_empty());
    for (what, config) in [
        ("no credentials", orthanc.config()),
        ("a wrong password", orthanc.config().basic("hilum", "wrong")),
        (
            "a bearer token Orthanc does not know",
            orthanc.config().bearer("tok"),
        ),
    ] {
        let client = DicomWebClient::new(config).unwrap();
        let e = client.qido_studies(&[]).await.unwrap_err();
        let msg = e.to_string();
        assert!(
            matches!(e, DicomWebError::Unauthorized { status: 401, .. }),
            "{what}: {msg}"
        );
        assert!(msg.contains("check the credentials"), "{what}: {msg}");
        assert!(
            !msg.contains("wrong"),
            "{what}: the password is not in the message"
        );
        let e = client.stow(None, &[b"x".to_vec()]).await.unwrap_err();
        assert!(
            matches!(e, DicomWebError::Unauthorized { .. }),
            "{what}: {e}"
        );
    }
}

/// One canned answer for every request, and the request heads seen.
struct Mock {
    base: String,
    heads: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
}

async fn mock(status: u16, content_type: &str, body: Vec<u8>, delay: Duration) -> Mock {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}/dicom-web", listener.local_addr().unwrap());
    let heads = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut response = format!(
        "HTTP/1.1 {status} Canned\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    response.extend_from_slice(&body);
    let response = std::sync::Arc::new(response);
    let seen = heads.clone();
    tokio::spawn(async move {
        loop {
            let Ok((mut sock, _)) = listener.accept().await else {
                return;
            };
            let (response, seen) = (response.clone(), seen.clone());
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = vec![0u8; 64 * 1024];
                let head_end = loop {
                    match sock.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    }
                    if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                        break i + 4;
                    }
                };
                let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
                let length: usize = head
                    .lines()
                    .find_map(|l| {
                        let (k, v) = l.split_once(':')?;
                        k.eq_ignore_ascii_case("content-length")
                            .then(|| v.trim().parse().ok())?
                    })
                    .unwrap_or(0);
                while buf.len() < head_end + length {
                    match sock.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    }
                }
                seen.lock().unwrap().push(head);
                tokio::time::sleep(delay).await;
                let _ = sock.write_all(&response).await;
                let _ = sock.shutdown().await;
            });
        }
    });
    Mock { base, heads }
}

fn client_for(base: &str) -> DicomWebClient {
    DicomWebClient::new(
        DicomWebConfig::new(base)
            .bearer("tok-123")
            .timeouts(Duration::from_secs(2), Duration::from_secs(1)),
    )
    .unwrap()
}

#[tokio::test]
async fn errors_say_what_to_check() {
    // The bearer token goes in the Authorization header; QIDO filters in the query only.
    let m = mock(
        200,
        "application/dicom+json",
        b"[]".to_vec(),
        Duration::ZERO,
    )
    .await;
    let client = client_for(&m.base);
    assert!(client
        .qido_studies(&[("PatientID", "p1")])
        .await
        .unwrap()
        .is_empty());
    let head = m.heads.lock().unwrap()[0].to_ascii_lowercase();
    assert!(
        head.starts_with("get /dicom-web/studies?patientid=p1 "),
        "{head}"
    );
    assert!(head.contains("authorization: bearer tok-123"), "{head}");
    assert!(head.contains("accept: application/dicom+json"), "{head}");

    // A 500 gives its status, a hint and the body's first 200 characters.
    let body = format!("database is locked {}", "x".repeat(1000));
    let m = mock(500, "text/plain", body.into_bytes(), Duration::ZERO).await;
    let e = client_for(&m.base).wado_study("1.2.3").await.unwrap_err();
    let msg = e.to_string();
    match &e {
        DicomWebError::Http { status, body, .. } => {
            assert_eq!(*status, 500);
            assert_eq!(body.chars().count(), 200);
            assert!(body.starts_with("database is locked"));
        }
        other => panic!("{other}"),
    }
    assert!(msg.contains("see the PACS's log"), "{msg}");

    // A server slower than the timeout.
    let m = mock(
        200,
        "application/dicom+json",
        b"[]".to_vec(),
        Duration::from_secs(3),
    )
    .await;
    let e = client_for(&m.base).qido_studies(&[]).await.unwrap_err();
    assert!(matches!(e, DicomWebError::Timeout { secs: 1, .. }), "{e}");
    assert!(e.to_string().contains("did not answer within 1 s"), "{e}");

    // JSON that is not a QIDO-RS result.
    let m = mock(
        200,
        "application/dicom+json",
        b"{\"a\":1}".to_vec(),
        Duration::ZERO,
    )
    .await;
    let e = client_for(&m.base).qido_studies(&[]).await.unwrap_err();
    assert!(matches!(e, DicomWebError::BadResponse { .. }), "{e}");

    // A WADO-RS body cut short.
    let siim = std::fs::read(dicom_dir().join(SIIM)).unwrap();
    let (ct, body) = hilum_pacs::multipart::build_related(
        &[hilum_pacs::multipart::Part::dicom(siim.clone())],
        "b1",
    )
    .unwrap();
    let m = mock(200, &ct, body[..body.len() / 2].to_vec(), Duration::ZERO).await;
    let e = client_for(&m.base).wado_study("1.2.3").await.unwrap_err();
    assert!(matches!(e, DicomWebError::BadResponse { .. }), "{e}");
    assert!(e.to_string().contains("cut off"), "{e}");

    // STOW-RS 409: nothing stored, each failure with its reason.
    let conflict = serde_json::json!({
        "00081198": {"vr": "SQ", "Value": [{
            "00081150": {"vr": "UI", "Value": ["1.2.840.10008.5.1.4.1.1.7"]},
            "00081155": {"vr": "UI", "Value": ["1.2.3.4"]},
            "00081197": {"vr": "US", "Value": [49152]}
        }]}
    });
    let m = mock(
        409,
        "application/dicom+json",
        conflict.to_string().into_bytes(),
        Duration::ZERO,
    )
    .await;
    let resp = client_for(&m.base)
        .stow(Some("1.2.3"), std::slice::from_ref(&siim))
        .await
        .unwrap();
    assert_eq!(resp.status, 409);
    assert!(resp.stored.is_empty());
    assert_eq!(resp.failed.len(), 1);
    assert_eq!(resp.failed[0].sop_instance_uid.as_deref(), Some("1.2.3.4"));
    assert_eq!(resp.failed[0].failure_reason, Some(0xC000));
    let head = m.heads.lock().unwrap()[0].to_ascii_lowercase();
    assert!(head.starts_with("post /dicom-web/studies/1.2.3 "), "{head}");
    assert!(
        head.contains("content-type: multipart/related; type=\"application/dicom\"; boundary="),
        "{head}"
    );

    // A SOP Instance UID that would name a file outside the folder stops the pull before
    // anything is written.
    let uid = b"1.2.276.0.7230010.3.1.4.8323329.6904.1517875201.850819";
    let evil: Vec<u8> = b"../evil"
        .iter()
        .copied()
        .chain(std::iter::repeat(b'.'))
        .take(uid.len())
        .collect();
    // The data set's copy (the File Meta's, first in the file, stays valid).
    let mut hostile = siim.clone();
    let first = hostile.windows(uid.len()).position(|w| w == uid).unwrap();
    let second = first
        + uid.len()
        + hostile[first + uid.len()..]
            .windows(uid.len())
            .position(|w| w == uid)
            .unwrap();
    hostile[second..second + uid.len()].copy_from_slice(&evil);
    let (ct, body) =
        hilum_pacs::multipart::build_related(&[hilum_pacs::multipart::Part::dicom(hostile)], "b2")
            .unwrap();
    let m = mock(200, &ct, body, Duration::ZERO).await;
    let scratch = Scratch::new("hostile");
    let dest = scratch.0.join("dest");
    let e = pull_study(&client_for(&m.base), "1.2.3", &dest)
        .await
        .unwrap_err();
    assert!(
        matches!(e, DicomWebError::BadInstanceUid { index: 1, .. }),
        "{e}"
    );
    assert!(e.to_string().contains("not a UID"), "{e}");
    assert!(!dest.exists(), "nothing written");
    assert!(!scratch.0.exists() || std::fs::read_dir(&scratch.0).unwrap().count() == 0);
}
