//! `hilum models fetch` against a real HTTP server on 127.0.0.1 serving the real lung U-Net
//! checkpoint: download, resume with HTTP Range, sha256 verification, conversion and install.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use axum::extract::State;
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
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    (format!("http://{addr}/lung.h5"), ranges)
}

fn h5() -> PathBuf {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared/data/models/lung_seg_unet/lung_seg_valiou_088.h5");
    assert!(p.is_file(), "real test data missing: {}", p.display());
    p
}

fn opts(url: &str) -> FetchOptions {
    let venv = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/.venv-models/bin/python");
    let python = std::env::var_os("HILUM_PYTHON")
        .map(PathBuf::from)
        .or_else(|| venv.is_file().then_some(venv));
    FetchOptions {
        url: Some(url.to_string()),
        import: ImportOptions {
            python,
            ..Default::default()
        },
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
