//! `hilum models fetch` against a real HTTP server on 127.0.0.1 serving the real lung U-Net
//! checkpoint: download, resume with HTTP Range, sha256 verification, conversion and install;
//! and a mirror of the tiny report model whose config and tokenizer files come along.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use std::collections::BTreeMap;

use axum::extract::{Path as UrlPath, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use hilum_models::{FetchOptions, FetchProgress, ImportOptions, ModelError, ModelRegistry};

#[derive(Clone)]
struct Served {
    bytes: Arc<Vec<u8>>,
    ranges: Arc<Mutex<Vec<Option<String>>>>,
}

async fn serve_file(State(s): State<Served>, headers: HeaderMap) -> Response {
    let range = headers
        .get(header::RANGE)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    s.ranges.lock().expect("lock").push(range.clone());
    let start = range
        .as_deref()
        .and_then(|r| r.strip_prefix("bytes="))
        .and_then(|r| r.strip_suffix('-'))
        .and_then(|n| n.parse::<usize>().ok());
    match start {
        Some(n) if n >= s.bytes.len() => StatusCode::RANGE_NOT_SATISFIABLE.into_response(),
        Some(n) => (
            StatusCode::PARTIAL_CONTENT,
            [(
                header::CONTENT_RANGE,
                format!("bytes {n}-{}/{}", s.bytes.len() - 1, s.bytes.len()),
            )],
            s.bytes[n..].to_vec(),
        )
            .into_response(),
        None => (StatusCode::OK, s.bytes.to_vec()).into_response(),
    }
}

/// Serves `app` on a free port of 127.0.0.1 for the rest of the test.
async fn spawn_on_loopback(app: Router) -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    addr
}

/// Serves `bytes` at http://127.0.0.1:PORT/lung.h5; returns the URL and the Range log.
async fn server(bytes: Vec<u8>) -> (String, Arc<Mutex<Vec<Option<String>>>>) {
    let served = Served {
        bytes: Arc::new(bytes),
        ranges: Arc::new(Mutex::new(Vec::new())),
    };
    let ranges = served.ranges.clone();
    let app = Router::new()
        .route("/lung.h5", get(serve_file))
        .with_state(served);
    let addr = spawn_on_loopback(app).await;
    (format!("http://{addr}/lung.h5"), ranges)
}

fn h5() -> PathBuf {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared/data/models/lung_seg_unet/lung_seg_valiou_088.h5");
    assert!(p.is_file(), "real test data missing: {}", p.display());
    p
}

fn opts(url: &str) -> FetchOptions {
    FetchOptions {
        url: Some(url.to_string()),
        import: ImportOptions::default(),
    }
}

#[derive(Default)]
struct Recorder {
    total: Option<u64>,
    start: u64,
    advanced: u64,
    finished: bool,
}

impl FetchProgress for Recorder {
    fn start(&mut self, total: Option<u64>, done: u64) {
        self.total = total;
        self.start = done;
    }
    fn advance(&mut self, bytes: u64) {
        self.advanced += bytes;
    }
    fn finish(&mut self) {
        self.finished = true;
    }
}

#[tokio::test]
async fn fetch_downloads_verifies_and_installs() {
    let bytes = std::fs::read(h5()).expect("read h5");
    let (url, _) = server(bytes.clone()).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let reg = ModelRegistry::new(dir.path()).expect("registry");
    let mut progress = Recorder::default();
    let inst = hilum_models::fetch(&reg, "lung-unet", &opts(&url), &mut progress)
        .await
        .expect("fetch");
    assert_eq!(inst.record.source, url);
    assert!(!inst.record.custom);
    assert_eq!(progress.total, Some(bytes.len() as u64));
    assert_eq!(progress.advanced, bytes.len() as u64);
    assert!(progress.finished);
    assert!(reg.verify("lung-unet").expect("verify").ok);
    assert!(
        !reg.model_dir("lung-unet").join("download").exists(),
        "download leftovers removed"
    );
}

#[tokio::test]
async fn fetch_resumes_a_partial_download() {
    let bytes = std::fs::read(h5()).expect("read h5");
    let (url, ranges) = server(bytes.clone()).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let reg = ModelRegistry::new(dir.path()).expect("registry");
    let dl = reg.model_dir("lung-unet").join("download");
    std::fs::create_dir_all(&dl).expect("mkdir");
    let half = bytes.len() / 2;
    std::fs::write(dl.join("lung_seg_valiou_088.h5.partial"), &bytes[..half]).expect("write");
    let mut progress = Recorder::default();
    hilum_models::fetch(&reg, "lung-unet", &opts(&url), &mut progress)
        .await
        .expect("resumed fetch");
    assert_eq!(
        ranges.lock().expect("lock").as_slice(),
        &[Some(format!("bytes={half}-"))]
    );
    assert_eq!(progress.start, half as u64);
    assert_eq!(progress.advanced, (bytes.len() - half) as u64);
    assert!(reg.verify("lung-unet").expect("verify").ok);
}

#[tokio::test]
async fn corrupted_download_is_refused_and_not_installed() {
    let mut bytes = std::fs::read(h5()).expect("read h5");
    let n = bytes.len();
    bytes[n / 3] ^= 0xff;
    let (url, _) = server(bytes).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let reg = ModelRegistry::new(dir.path()).expect("registry");
    let err = hilum_models::fetch(
        &reg,
        "lung-unet",
        &opts(&url),
        &mut hilum_models::NoProgress,
    )
    .await
    .err();
    match err {
        Some(e @ ModelError::Checksum { .. }) => {
            assert!(
                e.to_string().contains("hilum models fetch lung-unet"),
                "{e}"
            )
        }
        other => panic!("expected a checksum error, got {other:?}"),
    }
    assert!(reg.installed("lung-unet").is_err());
}

#[tokio::test]
async fn model_without_download_url_points_to_import() {
    let dir = tempfile::tempdir().expect("tempdir");
    let reg = ModelRegistry::new(dir.path()).expect("registry");
    let err = hilum_models::fetch(
        &reg,
        "lung-unet",
        &FetchOptions::default(),
        &mut hilum_models::NoProgress,
    )
    .await
    .err()
    .map(|e| e.to_string())
    .unwrap_or_default();
    assert!(err.contains("hilum models import lung-unet PATH"), "{err}");
}

/// A mirror folder: serves `files` at http://127.0.0.1:PORT/mirror/NAME (404 for others) and
/// logs the names asked for.
async fn mirror(files: BTreeMap<String, Vec<u8>>) -> (String, Arc<Mutex<Vec<String>>>) {
    #[derive(Clone)]
    struct Mirror {
        files: Arc<BTreeMap<String, Vec<u8>>>,
        asked: Arc<Mutex<Vec<String>>>,
    }
    async fn serve(State(m): State<Mirror>, UrlPath(name): UrlPath<String>) -> Response {
        m.asked.lock().expect("lock").push(name.clone());
        match m.files.get(&name) {
            Some(b) => (StatusCode::OK, b.clone()).into_response(),
            None => StatusCode::NOT_FOUND.into_response(),
        }
    }
    let m = Mirror {
        files: Arc::new(files),
        asked: Arc::new(Mutex::new(Vec::new())),
    };
    let asked = m.asked.clone();
    let app = Router::new()
        .route("/mirror/{name}", get(serve))
        .with_state(m);
    let addr = spawn_on_loopback(app).await;
    (format!("http://{addr}/mirror"), asked)
}

const REPORT: &str = "chexpert-report-findings";

/// The tiny seeded report model as its Hugging Face repository lays it out: weights without
/// embedded config, config.json, and BertTokenizer's vocab.txt (written from the fixture's
/// tokenizer.json vocabulary, in id order).
fn report_repo() -> BTreeMap<String, Vec<u8>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/report/tiny_pad");
    let read = |f: &str| std::fs::read(src.join(f)).unwrap_or_else(|e| panic!("{f}: {e}"));
    let tok: serde_json::Value =
        serde_json::from_slice(&read("tokenizer.json")).expect("tokenizer.json");
    let vocab = tok["model"]["vocab"].as_object().expect("WordPiece vocab");
    let mut by_id: Vec<(u64, &str)> = vocab
        .iter()
        .map(|(t, id)| (id.as_u64().expect("id"), t.as_str()))
        .collect();
    by_id.sort();
    let vocab_txt: String = by_id.iter().map(|(_, t)| format!("{t}\n")).collect();
    BTreeMap::from([
        ("model.safetensors".to_string(), read("model.safetensors")),
        ("config.json".to_string(), read("config.json")),
        ("vocab.txt".to_string(), vocab_txt.into_bytes()),
        (
            "tokenizer_config.json".to_string(),
            br#"{"do_lower_case": true}"#.to_vec(),
        ),
    ])
}

async fn fetch_report(
    files: BTreeMap<String, Vec<u8>>,
    dir: &Path,
) -> (
    Result<hilum_models::InstalledModel, ModelError>,
    String,
    Vec<String>,
) {
    let (base, asked) = mirror(files).await;
    let reg = ModelRegistry::new(dir).expect("registry");
    let r = hilum_models::fetch(
        &reg,
        REPORT,
        &opts(&format!("{base}/model.safetensors")),
        &mut hilum_models::NoProgress,
    )
    .await;
    let asked = asked.lock().expect("lock").clone();
    (r, base, asked)
}

#[tokio::test]
async fn fetch_installs_the_files_listed_beside_the_weights() {
    let repo = report_repo();
    let dir = tempfile::tempdir().expect("tempdir");
    let (r, base, _) = fetch_report(repo.clone(), dir.path()).await;
    let inst = r.expect("fetch");
    assert_eq!(inst.record.source, format!("{base}/model.safetensors"));
    let model_dir = dir.path().join(REPORT);
    for f in ["config.json", "vocab.txt", "tokenizer_config.json"] {
        let got = std::fs::read(model_dir.join(f)).unwrap_or_else(|e| panic!("{f}: {e}"));
        assert_eq!(got, repo[f], "{f}");
    }
    assert!(
        !model_dir.join("download").exists(),
        "download leftovers removed"
    );
    let leftovers: Vec<_> = std::fs::read_dir(&model_dir)
        .expect("read dir")
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".partial"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
    // The report loader finds config and tokenizer where fetch put them.
    let model = hilum_models::report::ReportModel::load_files(
        &inst.weights,
        None,
        0,
        hilum_models::Device::Cpu,
    )
    .expect("installed report model loads");
    drop(model);
    let reg = ModelRegistry::new(dir.path()).expect("registry");
    assert!(reg.verify(REPORT).expect("verify").ok);
}

#[tokio::test]
async fn optional_file_missing_upstream_is_skipped() {
    let mut repo = report_repo();
    repo.remove("tokenizer_config.json");
    let dir = tempfile::tempdir().expect("tempdir");
    let (r, _, asked) = fetch_report(repo, dir.path()).await;
    let inst = r.expect("fetch without the optional file");
    assert!(
        asked.contains(&"tokenizer_config.json".to_string()),
        "{asked:?}"
    );
    let model_dir = dir.path().join(REPORT);
    assert!(!model_dir.join("tokenizer_config.json").exists());
    assert!(model_dir.join("vocab.txt").is_file());
    hilum_models::report::ReportModel::load_files(
        &inst.weights,
        None,
        0,
        hilum_models::Device::Cpu,
    )
    .expect("loads with vocab.txt alone");
}

#[tokio::test]
async fn required_file_missing_upstream_is_an_error_naming_its_url() {
    let mut repo = report_repo();
    repo.remove("vocab.txt");
    let dir = tempfile::tempdir().expect("tempdir");
    let (r, base, asked) = fetch_report(repo, dir.path()).await;
    match r {
        Err(e @ ModelError::Fetch { .. }) => {
            let msg = e.to_string();
            assert!(msg.contains(&format!("{base}/vocab.txt")), "{msg}");
            assert!(msg.contains("404"), "{msg}");
        }
        other => panic!("expected a fetch error, got {other:?}"),
    }
    // Found before the weights were downloaded, and nothing was installed.
    assert!(
        !asked.contains(&"model.safetensors".to_string()),
        "{asked:?}"
    );
    let reg = ModelRegistry::new(dir.path()).expect("registry");
    assert!(reg.installed(REPORT).is_err());
}
