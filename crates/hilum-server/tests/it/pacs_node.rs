//! Hilum in the hospital's imaging workflow, end to end with real peers: `hilum serve`'s DICOM
//! node receives studies from dcmtk's `storescu` and from a real Orthanc that routes a study to
//! it (Debian's orthanc 1.10.1 with orthanc-dicomweb, started by scripts/deploy/orthanc_start.sh); the
//! protocol runs as an ordinary durable run with the real lung U-Net; the SR, SEG and overlay go
//! back into the same study in Orthanc by STOW-RS, where QIDO-RS finds them and each references
//! the source instance. A CT study matches no protocol and its job says why.
//!
//! Every log line of the run, at every level, is captured: none holds a shared file's patient
//! name, id or birth date.
//!
//! Needs `scripts/setup_pacs_tools.sh` (dcmtk, Orthanc); without them the test fails naming
//! it, unless HILUM_SKIP_PACS_TOOLS=1.

use crate::common::{config, data_dir, start};
use crate::pacs_peers::{forward, free_port, orthanc, repo, tools_missing};

use std::io::Write;
use std::path::Path;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hilum_imaging::ImageStore;
use hilum_models::{ImportOptions, ModelPool, ModelRegistry};
use hilum_pacs::dicomweb::{tag_str, DicomWebClient, DicomWebConfig};
use hilum_server::db::PacsJob;
use hilum_server::pacs::{Destination, PacsSettings};
use hilum_tools::{default_toolbox, ToolDeps};

const SIIM: &str = "siim_pneumothorax_neg_cr_pa_jpegbaseline.dcm";
const RG1: &str = "RG1_chest_cr_pa_jpeg2000_lossy.dcm";

#[derive(Clone, Default)]
struct LogBuf(Arc<Mutex<Vec<u8>>>);

impl Write for LogBuf {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .extend_from_slice(buf);
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

/// Captures every log line of this test binary from now on (the one global subscriber).
fn capture_logs() -> LogBuf {
    let buf = LogBuf::default();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(buf.clone())
        .with_max_level(tracing_subscriber::filter::LevelFilter::TRACE)
        .with_ansi(false)
        .finish();
    tracing::subscriber::set_global_default(subscriber)
        .expect("no other test of this binary sets a global tracing subscriber");
    buf
}

/// Patient names, ids and birth dates of the shared DICOM files.
fn patient_data() -> Vec<String> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(data_dir().join("cxr/dicom")).expect("shared DICOMs") {
        let path = entry.expect("entry").path();
        if path.extension().is_none_or(|e| e != "dcm") {
            continue;
        }
        let Ok((source, _)) =
            hilum_pacs::protocol::read_facts(&std::fs::read(&path).expect("read"))
        else {
            continue;
        };
        let p = source.patient;
        out.extend([p.name, p.id, p.birth_date].into_iter().flatten());
    }
    out.retain(|v| v.trim().len() >= 4);
    out
}

/// dcmtk's storescu sending `file` to the node as STORESCU (JPEG baseline proposed).
fn storescu(port: u16, file: &Path) -> std::process::Output {
    Command::new("storescu")
        .args(["-aet", "STORESCU", "-aec", "HILUM", "-xy", "127.0.0.1"])
        .arg(port.to_string())
        .arg(file)
        .output()
        .expect("run storescu")
}

fn lung_models(dir: &Path) -> Arc<ModelPool> {
    let reg = ModelRegistry::new(dir).expect("models dir");
    let h5 = data_dir().join("models/lung_seg_unet/lung_seg_valiou_088.h5");
    hilum_models::import(&reg, "lung-unet", &h5, &ImportOptions::default())
        .expect("import the lung U-Net");
    Arc::new(ModelPool::new(Arc::new(reg)))
}

/// A server over a database in `dir` with the real lung U-Net installed (the offer and the
/// coverage check know it), and its DICOM node's settings on `dicom_port`.
fn node_config(
    dir: &Path,
    dicom_port: u16,
    script: Option<&Path>,
) -> (hilum_server::ServerConfig, PacsSettings) {
    let pool = lung_models(&dir.join("models"));
    let mut cfg = config(&dir.join("h.db"), script);
    let deps = ToolDeps::new(Arc::new(ImageStore::default()), pool.clone());
    cfg.env = hilum_tools::environment(&deps, &[]);
    cfg.models = Some(pool.clone());
    cfg.toolbox = Arc::new(move |store: Arc<ImageStore>| {
        default_toolbox(&ToolDeps::new(store, pool.clone()))
    });
    let settings = PacsSettings::new(
        format!("127.0.0.1:{dicom_port}").parse().expect("addr"),
        dir.join("pacs"),
    );
    (cfg, settings)
}

fn study_uid(path: &Path) -> String {
    let bytes = std::fs::read(path).expect("read");
    let (source, _) = hilum_pacs::protocol::read_facts(&bytes).expect("facts");
    source.study.instance_uid
}

fn sop_uid(path: &Path) -> String {
    let bytes = std::fs::read(path).expect("read");
    let (source, _) = hilum_pacs::protocol::read_facts(&bytes).expect("facts");
    source.sop_instance_uid
}

async fn wait_job(db: &hilum_server::Db, study: &str, timeout: Duration) -> PacsJob {
    let until = Instant::now() + timeout;
    loop {
        let jobs = db.pacs_jobs(100).await.expect("jobs");
        if let Some(j) = jobs.iter().find(|j| j.study_uid == study) {
            if j.state == "done" || j.state == "failed" {
                return j.clone();
            }
        }
        assert!(
            Instant::now() < until,
            "the job of {study} did not end: {jobs:#?}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// The result series of a study in Orthanc, by modality, each checked to reference `source`.
async fn results_in(client: &DicomWebClient, study: &str, source_sop: &str) -> Vec<String> {
    let series = client.qido_series(study, &[]).await.expect("QIDO series");
    let mut found = Vec::new();
    for s in &series {
        let modality = tag_str(&s.json, "00080060").unwrap_or_default();
        let series_uid = tag_str(&s.json, "0020000E").unwrap_or_default();
        let instances = client
            .qido_instances(study, &series_uid)
            .await
            .expect("QIDO instances");
        for i in instances {
            let sop = tag_str(&i.json, "00080018").unwrap_or_default();
            if sop == source_sop {
                continue;
            }
            let bytes = client
                .wado_instance(study, &series_uid, &sop)
                .await
                .expect("WADO");
            let text = String::from_utf8_lossy(&bytes);
            assert!(
                text.contains(source_sop),
                "{modality} {sop} does not reference the source instance"
            );
            found.push(modality.clone());
        }
    }
    found.sort();
    found
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn studies_from_storescu_and_orthanc_get_results_back_in_the_same_study() {
    if let Some(tool) = tools_missing() {
        if std::env::var("HILUM_SKIP_PACS_TOOLS").as_deref() == Ok("1") {
            eprintln!("skipped: {tool} is missing and HILUM_SKIP_PACS_TOOLS=1");
            return;
        }
        panic!("{tool} is missing: run `bash scripts/setup_pacs_tools.sh`");
    }
    let logs = capture_logs();
    let dir = tempfile::tempdir().expect("tempdir");
    let dicom_port = free_port();
    let pacs = orthanc(Some(dicom_port));
    let (mut cfg, mut settings) = node_config(dir.path(), dicom_port, None);
    settings.quiet = Duration::from_millis(500);
    settings.allowed_callers = vec!["STORESCU".into(), "ORTHANC".into()];
    settings.protocols =
        vec![serde_json::from_value(serde_json::json!({"name": "cxr"})).expect("protocol")];
    settings.destination = Some(Destination {
        url: format!("{}/dicom-web", pacs.url),
        bearer: None,
    });
    cfg.pacs = Some(settings);
    let srv = start(cfg).await;
    let db = srv.state.db();
    let client = DicomWebClient::new(DicomWebConfig::new(format!("{}/dicom-web", pacs.url)))
        .expect("client");

    // 1. storescu sends a CR to Hilum's node.
    let siim = data_dir().join("cxr/dicom").join(SIIM);
    let out = storescu(dicom_port, &siim);
    assert!(
        out.status.success(),
        "storescu: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let study = study_uid(&siim);
    let job = wait_job(db, &study, Duration::from_secs(240)).await;
    assert_eq!(job.state, "done", "{job:#?}");
    assert_eq!(job.protocol.as_deref(), Some("cxr"));
    assert!(
        job.run_id.is_some(),
        "the plan ran as a durable run: {job:#?}"
    );
    // The source is not in Orthanc (storescu sent it to Hilum only): the results are.
    let found = results_in(&client, &study, &sop_uid(&siim)).await;
    assert!(found.contains(&"SR".to_string()), "{found:?}");
    assert!(found.contains(&"SEG".to_string()), "{found:?}");
    assert_eq!(found.len(), 3, "SR, SEG and the overlay: {found:?}");

    // highdicom reads the node's own SR and SEG (as stored in Orthanc): the lung areas equal
    // segment_lungs' output, in mm² from the file's pixel spacing, and the mask's pixel count
    // equals the lungs' area.
    let python = std::env::var_os("HILUM_PACS_PYTHON");
    assert!(
        python.is_some() || std::env::var("HILUM_SKIP_PACS_TOOLS").as_deref() == Ok("1"),
        "HILUM_PACS_PYTHON is not set: run `eval \"$(bash scripts/setup_pacs_tools.sh)\"` (or scripts/test.sh)"
    );
    if let Some(python) = python {
        let job = wait_job(db, &study, Duration::from_secs(5)).await;
        let events = db
            .pacs_job_events(job.id.clone())
            .await
            .expect("events")
            .expect("job");
        let lungs = events
            .iter()
            .find(|e| e["type"] == "tool_finished" && e["name"] == "segment_lungs")
            .expect("segment_lungs ran")["data"]
            .clone();
        let (right, left) = (
            lungs["right_lung"]["area_px"].as_f64().expect("right"),
            lungs["left_lung"]["area_px"].as_f64().expect("left"),
        );
        let spacing = lungs["pixel_spacing_mm"]
            .as_array()
            .expect("SIIM has a pixel spacing");
        let mm2 = spacing[0].as_f64().expect("row") * spacing[1].as_f64().expect("column");
        let read = |modality: &str| {
            let (client, study, python) = (&client, &study, &python);
            let modality = modality.to_string();
            async move {
                for series in client.qido_series(study, &[]).await.expect("QIDO") {
                    if tag_str(&series.json, "00080060").as_deref() != Some(modality.as_str()) {
                        continue;
                    }
                    let uid = tag_str(&series.json, "0020000E").unwrap_or_default();
                    let i = client
                        .qido_instances(study, &uid)
                        .await
                        .expect("QIDO")
                        .remove(0);
                    let sop = tag_str(&i.json, "00080018").unwrap_or_default();
                    let bytes = client.wado_instance(study, &uid, &sop).await.expect("WADO");
                    let file = std::env::temp_dir().join(format!("hilum-node-{sop}.dcm"));
                    std::fs::write(&file, bytes).expect("write");
                    let out = Command::new(python)
                        .arg(repo().join("scripts/pacs_check.py"))
                        .arg(modality.to_lowercase())
                        .arg(&file)
                        .output()
                        .expect("run pacs_check.py");
                    let _ = std::fs::remove_file(&file);
                    assert!(
                        out.status.success(),
                        "{}",
                        String::from_utf8_lossy(&out.stderr)
                    );
                    return serde_json::from_slice::<serde_json::Value>(&out.stdout).expect("JSON");
                }
                panic!("no {modality} series");
            }
        };
        let sr = read("SR").await;
        let measured = sr["groups"][0]["measurements"]
            .as_array()
            .expect("measurements");
        for (name, px) in [("Right lung area", right), ("Left lung area", left)] {
            let m = measured
                .iter()
                .find(|m| m["tracking_identifier"] == name)
                .unwrap_or_else(|| panic!("highdicom finds no {name}: {sr}"));
            let value: f64 = m["value_repr"]
                .as_str()
                .expect("exact")
                .parse()
                .expect("number");
            assert!(
                (value - px * mm2).abs() <= 1e-9 * value.max(1.0),
                "{name}: {value} vs {px} px"
            );
            assert_eq!(m["unit"]["value"], "mm2");
        }
        let seg = read("SEG").await;
        assert_eq!(
            seg["segments"][0]["pixels"].as_f64(),
            Some(right + left),
            "{seg}"
        );
    }

    // 2. Orthanc holds a study and routes it to Hilum (C-STORE from Orthanc).
    let rg1 = data_dir().join("cxr/dicom").join(RG1);
    let stow = client
        .stow(None, &[std::fs::read(&rg1).expect("read RG1")])
        .await
        .expect("STOW the source into Orthanc");
    assert_eq!(stow.stored.len(), 1);
    let http = reqwest::Client::new();
    let studies: Vec<String> = http
        .get(format!("{}/studies", pacs.url))
        .send()
        .await
        .expect("GET /studies")
        .json()
        .await
        .expect("JSON");
    let rg1_study = study_uid(&rg1);
    let mut orthanc_id = None;
    for id in studies {
        let v: serde_json::Value = http
            .get(format!("{}/studies/{id}", pacs.url))
            .send()
            .await
            .expect("GET study")
            .json()
            .await
            .expect("JSON");
        if v["MainDicomTags"]["StudyInstanceUID"] == rg1_study.as_str() {
            orthanc_id = Some(id);
        }
    }
    let orthanc_id = orthanc_id.expect("Orthanc knows the RG1 study");
    let routed = http
        .post(format!("{}/modalities/hilum/store", pacs.url))
        .body(serde_json::json!({"Resources": [orthanc_id], "Synchronous": true}).to_string())
        .send()
        .await
        .expect("route the study to Hilum");
    assert!(routed.status().is_success(), "{:?}", routed.text().await);
    let job = wait_job(db, &rg1_study, Duration::from_secs(240)).await;
    assert_eq!(job.state, "done", "{job:#?}");
    let found = results_in(&client, &rg1_study, &sop_uid(&rg1)).await;
    assert_eq!(found.len(), 3, "SR, SEG and the overlay: {found:?}");

    // The job's run, as the web UI shows it: what segment_lungs found.
    let tok = crate::common::token(&srv.state, "radiologist");
    let v: serde_json::Value = http
        .get(srv.url(&format!("/v1/pacs/jobs/{}/events", job.id)))
        .bearer_auth(&tok)
        .send()
        .await
        .expect("job events")
        .json()
        .await
        .expect("JSON");
    let tools: Vec<&str> = v["events"]
        .as_array()
        .expect("events")
        .iter()
        .filter(|e| e["type"] == "tool_finished")
        .filter_map(|e| e["name"].as_str())
        .collect();
    assert!(tools.contains(&"segment_lungs"), "{tools:?}");

    // 3. A resend of the same study replaces its results: still one set in Orthanc.
    let out = storescu(dicom_port, &siim);
    assert!(out.status.success());
    tokio::time::sleep(Duration::from_secs(1)).await;
    let job = wait_job(db, &study, Duration::from_secs(240)).await;
    assert_eq!(job.state, "done", "{job:#?}");
    let found = results_in(&client, &study, &sop_uid(&siim)).await;
    assert_eq!(found.len(), 3, "a resend duplicated results: {found:?}");

    // 4. A router pushes a study by STOW-RS into Hilum's endpoint (the API's bearer token): the
    //    DICOM instance is stored, the other part refused; the results reach Orthanc.
    let pushed = dir.path().join("pushed.dcm");
    make_copy(&siim, &pushed, "DX", "987654321098765432");
    let parts = vec![
        hilum_pacs::multipart::Part::dicom(std::fs::read(&pushed).expect("read")),
        hilum_pacs::multipart::Part::dicom(b"not a DICOM object".to_vec()),
    ];
    let boundary = hilum_pacs::multipart::new_boundary(&parts);
    let (content_type, body) =
        hilum_pacs::multipart::build_related(&parts, &boundary).expect("multipart body");
    let stow_url = srv.url("/dicomweb/studies");
    let refused = http
        .post(&stow_url)
        .header("content-type", &content_type)
        .body(body.clone())
        .send()
        .await
        .expect("STOW-RS without a token");
    assert_eq!(refused.status(), 401);
    let tok = crate::common::token(&srv.state, "router");
    let answer = http
        .post(&stow_url)
        .bearer_auth(&tok)
        .header("content-type", &content_type)
        .body(body)
        .send()
        .await
        .expect("STOW-RS into Hilum");
    assert_eq!(answer.status(), 202, "one stored, one failed");
    let v: serde_json::Value = answer.json().await.expect("DICOM JSON");
    assert_eq!(
        v["00081199"]["Value"][0]["00081155"]["Value"][0],
        sop_uid(&pushed).as_str()
    );
    assert_eq!(v["00081198"]["Value"][0]["00081197"]["Value"][0], 0xC000);
    let job = wait_job(db, &study_uid(&pushed), Duration::from_secs(240)).await;
    assert_eq!(job.state, "done", "{job:#?}");
    let found = results_in(&client, &study_uid(&pushed), &sop_uid(&pushed)).await;
    assert_eq!(found.len(), 3, "SR, SEG and the overlay: {found:?}");

    // 5. A study already in the PACS is pulled on demand (API: QIDO-RS + WADO-RS) and run.
    let held = dir.path().join("held.dcm");
    make_copy(&siim, &held, "CR", "555555555555555555");
    client
        .stow(None, &[std::fs::read(&held).expect("read")])
        .await
        .expect("STOW the study into Orthanc");
    let pulled = http
        .post(srv.url("/v1/pacs/pull"))
        .bearer_auth(&tok)
        .json(&serde_json::json!({"study": study_uid(&held)}))
        .send()
        .await
        .expect("pull");
    assert_eq!(pulled.status(), 202, "{:?}", pulled.text().await);
    let job = wait_job(db, &study_uid(&held), Duration::from_secs(240)).await;
    assert_eq!(job.state, "done", "{job:#?}");
    assert_eq!(job.instances, 1);
    // The source is in Orthanc too this time: 3 results besides it.
    let found = results_in(&client, &study_uid(&held), &sop_uid(&held)).await;
    assert_eq!(found.len(), 3, "{found:?}");

    // 6. A CT matches no protocol: its job says why and nothing is sent.
    let ct = dir.path().join("ct.dcm");
    make_ct(&siim, &ct);
    let out = storescu(dicom_port, &ct);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let job = wait_job(db, &study_uid(&ct), Duration::from_secs(60)).await;
    assert_eq!(job.state, "done");
    assert_eq!(job.protocol, None);
    let detail = job.detail.unwrap_or_default();
    assert!(
        detail.contains("modality CT is not one of CR, DX"),
        "{detail}"
    );
    srv.stop().await;

    // 7. No patient data in any log line.
    let text =
        String::from_utf8_lossy(&logs.0.lock().unwrap_or_else(|p| p.into_inner())).into_owned();
    assert!(
        text.contains("DICOM node"),
        "the node's lines were captured"
    );
    let phi = patient_data();
    assert!(!phi.is_empty());
    for value in phi {
        assert!(
            !text.contains(value.trim()),
            "a log line holds patient data `{value}`"
        );
    }
}

/// A copy of `src` as a CT of a study of its own.
fn make_ct(src: &Path, out: &Path) {
    make_copy(src, out, "CT", "1234567890123456789");
}

/// A copy of `src` with `modality`, in a new study, series and instance (UIDs from `seed`).
fn make_copy(src: &Path, out: &Path, modality: &str, seed: &str) {
    use dicom_core::{DataElement, PrimitiveValue, VR};
    use dicom_dictionary_std::tags;
    use dicom_object::meta::FileMetaTableBuilder;
    let bytes = std::fs::read(src).expect("read");
    let file = hilum_pacs::read_dicom(&bytes).expect("read DICOM");
    let ts = file
        .meta()
        .transfer_syntax()
        .trim_end_matches('\0')
        .to_string();
    let class = file
        .meta()
        .media_storage_sop_class_uid()
        .trim_end_matches('\0')
        .to_string();
    let mut obj = file.into_inner();
    let (study, series, sop) = (
        format!("2.25.{seed}1"),
        format!("2.25.{seed}2"),
        format!("2.25.{seed}3"),
    );
    for (tag, vr, v) in [
        (tags::MODALITY, VR::CS, modality),
        (tags::STUDY_INSTANCE_UID, VR::UI, study.as_str()),
        (tags::SERIES_INSTANCE_UID, VR::UI, series.as_str()),
        (tags::SOP_INSTANCE_UID, VR::UI, sop.as_str()),
    ] {
        obj.put(DataElement::new(tag, vr, PrimitiveValue::from(v)));
    }
    let meta = FileMetaTableBuilder::new()
        .transfer_syntax(ts)
        .media_storage_sop_class_uid(class)
        .media_storage_sop_instance_uid(sop.as_str());
    obj.with_meta(meta)
        .expect("a file meta table")
        .write_to_file(out)
        .expect("write the copy");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_send_to_a_stopped_pacs_retries_then_fails_and_a_retry_sends() {
    if let Some(tool) = tools_missing() {
        if std::env::var("HILUM_SKIP_PACS_TOOLS").as_deref() == Ok("1") {
            eprintln!("skipped: {tool} is missing and HILUM_SKIP_PACS_TOOLS=1");
            return;
        }
        panic!("{tool} is missing: run `bash scripts/setup_pacs_tools.sh`");
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let dicom_port = free_port();
    let pacs = orthanc(Some(dicom_port));
    // The destination's address answers nothing yet: the PACS is down.
    let down_port = free_port();
    // The reasoning model answers the protocol's question after calling the lung tool; its
    // words leave out the figures, so the answer carries Hilum's statement of them.
    let script = crate::common::write_script(
        dir.path(),
        serde_json::json!([
            {"content": "", "tool_calls": [{"name": "segment_lungs", "arguments": {"image": "$IMAGE"}}]},
            {"content": "The lungs were measured."},
            {"content": "The lungs were measured."},
            {"content": "The lungs were measured."}
        ]),
    );
    let (mut cfg, mut settings) = node_config(dir.path(), dicom_port, Some(&script));
    settings.quiet = Duration::from_millis(300);
    // A protocol with a question: the agent's answer goes into the SR.
    settings.protocols = vec![hilum_pacs::protocol::Protocol {
        question: Some("How large are the lungs?".into()),
        ..hilum_pacs::protocol::Protocol::default_cxr()
    }];
    settings.max_send_attempts = 3;
    settings.retry_base = Duration::from_millis(200);
    settings.destination = Some(Destination {
        url: format!("http://127.0.0.1:{down_port}/dicom-web"),
        bearer: None,
    });
    cfg.pacs = Some(settings);
    let srv = start(cfg).await;
    let db = srv.state.db();
    let siim = data_dir().join("cxr/dicom").join(SIIM);
    let out = storescu(dicom_port, &siim);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let study = study_uid(&siim);
    let started = Instant::now();
    let job = wait_job(db, &study, Duration::from_secs(240)).await;
    assert_eq!(job.state, "failed", "{job:#?}");
    assert_eq!(job.attempts, 3, "{job:#?}");
    let detail = job.detail.clone().unwrap_or_default();
    assert!(detail.contains("after 3 attempt(s)"), "{detail}");
    assert!(
        detail.contains("running"),
        "the reason names what to check: {detail}"
    );
    assert!(detail.contains("hilum pacs retry"), "{detail}");
    // Backoff: 200 ms then 400 ms between the three attempts.
    assert!(started.elapsed() >= Duration::from_millis(600));

    // The PACS is back on its address; a retry runs the job again and sends.
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", down_port))
        .await
        .expect("the PACS's old address");
    let orthanc_http = pacs.url.trim_start_matches("http://").to_string();
    tokio::spawn(forward(listener, orthanc_http));
    assert!(db.pacs_retry(job.id.clone()).await.expect("retry"));
    let job = wait_job(db, &study, Duration::from_secs(240)).await;
    assert_eq!(job.state, "done", "{job:#?}");
    let client = DicomWebClient::new(DicomWebConfig::new(format!("{}/dicom-web", pacs.url)))
        .expect("client");
    let found = results_in(&client, &study, &sop_uid(&siim)).await;
    assert_eq!(found.len(), 3, "{found:?}");
    // The SR carries the protocol's question and the agent's answer.
    let mut sr_text = String::new();
    for series in client.qido_series(&study, &[]).await.expect("QIDO") {
        if tag_str(&series.json, "00080060").as_deref() != Some("SR") {
            continue;
        }
        let uid = tag_str(&series.json, "0020000E").unwrap_or_default();
        for i in client.qido_instances(&study, &uid).await.expect("QIDO") {
            let sop = tag_str(&i.json, "00080018").unwrap_or_default();
            let bytes = client
                .wado_instance(&study, &uid, &sop)
                .await
                .expect("WADO");
            sr_text.push_str(&String::from_utf8_lossy(&bytes));
        }
    }
    assert!(
        sr_text.contains("How large are the lungs?"),
        "the question is in the SR"
    );
    assert!(
        sr_text.contains("the lungs cover"),
        "the answer (with the tool's figures) is in the SR"
    );
    srv.stop().await;
}
