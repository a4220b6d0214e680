//! `hilum models fetch` against a real HTTP server on 127.0.0.1 serving the real lung U-Net
//! checkpoint: download, resume with HTTP Range, sha256 verification, conversion and install;
//! a mirror of the tiny report model whose config and tokenizer files come along; and a server
//! with the Hugging Face Hub's layout (resolve URLs, ETag and X-Repo-Commit headers, a redirect
//! to a CDN on another port, a gated repository) filling the cache `huggingface_hub` shares.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use std::collections::BTreeMap;

use axum::extract::{Path as UrlPath, State};
use axum::http::Method;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use hilum_models::{
    FetchOptions, FetchProgress, HfToken, ImportOptions, Manifest, ModelError, ModelRegistry,
};
use sha2::{Digest, Sha256};

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
        ..FetchOptions::default()
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

// ---------------------------------------------------------------------------------------------
// The Hugging Face Hub's layout.

const COMMIT: &str = "3f7a1c5e9b2d4f6a8c0e1b3d5f7a9c2e4b6d8f01";
const TOKEN: &str = "hf_test_token_0123";
const LUNG_REPO: &str = "hilum-test/lung-unet";
const LUNG_FILE: &str = "lung_seg_valiou_088.h5";
const GATED_REPO: &str = "hilum-test/gated-report";

fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// One request as a server saw it.
#[derive(Clone, Debug)]
struct Seen {
    method: Method,
    path: String,
    range: Option<String>,
    auth: Option<String>,
}

type Log = Arc<Mutex<Vec<Seen>>>;

fn seen(log: &Log, method: Method, path: String, headers: &HeaderMap) -> Option<String> {
    let get = |h: header::HeaderName| {
        headers
            .get(h)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    };
    let range = get(header::RANGE);
    log.lock().expect("lock").push(Seen {
        method,
        path,
        range: range.clone(),
        auth: get(header::AUTHORIZATION),
    });
    range
}

/// `bytes` as a 200, or the 206/416 a `Range: bytes=N-` asks for.
fn ranged(bytes: &[u8], range: Option<&str>, mut resp_headers: HeaderMap) -> Response {
    let start = range
        .and_then(|r| r.strip_prefix("bytes="))
        .and_then(|r| r.strip_suffix('-'))
        .and_then(|n| n.parse::<usize>().ok());
    match start {
        Some(n) if n >= bytes.len() => StatusCode::RANGE_NOT_SATISFIABLE.into_response(),
        Some(n) => {
            let cr = format!("bytes {n}-{}/{}", bytes.len() - 1, bytes.len());
            resp_headers.insert(header::CONTENT_RANGE, cr.parse().expect("header"));
            (
                StatusCode::PARTIAL_CONTENT,
                resp_headers,
                bytes[n..].to_vec(),
            )
                .into_response()
        }
        None => (StatusCode::OK, resp_headers, bytes.to_vec()).into_response(),
    }
}

struct HubRepo {
    gated: bool,
    files: BTreeMap<String, Vec<u8>>,
}

#[derive(Clone)]
struct HubState {
    repos: Arc<BTreeMap<String, HubRepo>>,
    /// Base URL of the CDN that large files redirect to.
    cdn: String,
    log: Log,
}

/// Large files are stored as LFS objects on the Hub: their ETag is their sha256.
fn is_large(name: &str) -> bool {
    name.ends_with(".h5") || name.ends_with(".safetensors")
}

/// `GET`/`HEAD /{org}/{name}/resolve/{rev}/{file}` as the Hub answers it.
async fn hub_resolve(
    State(s): State<HubState>,
    method: Method,
    UrlPath((org, name, rev, file)): UrlPath<(String, String, String, String)>,
    headers: HeaderMap,
) -> Response {
    let path = format!("/{org}/{name}/resolve/{rev}/{file}");
    let range = seen(&s.log, method, path, &headers);
    let Some(repo) = s.repos.get(&format!("{org}/{name}")) else {
        return (StatusCode::UNAUTHORIZED, [("x-error-code", "RepoNotFound")]).into_response();
    };
    if repo.gated {
        let auth = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok());
        match auth {
            None => {
                return (StatusCode::UNAUTHORIZED, [("x-error-code", "GatedRepo")]).into_response()
            }
            Some(a) if a != format!("Bearer {TOKEN}") => {
                return (StatusCode::FORBIDDEN, [("x-error-code", "GatedRepo")]).into_response()
            }
            Some(_) => {}
        }
    }
    if rev != "main" && rev != COMMIT {
        return (
            StatusCode::NOT_FOUND,
            [("x-error-code", "RevisionNotFound")],
        )
            .into_response();
    }
    let Some(bytes) = repo.files.get(&file) else {
        return (
            StatusCode::NOT_FOUND,
            [("x-error-code", "EntryNotFound"), ("x-repo-commit", COMMIT)],
        )
            .into_response();
    };
    let sha = sha256_hex(bytes);
    let mut h = HeaderMap::new();
    h.insert("x-repo-commit", COMMIT.parse().expect("header"));
    if is_large(&file) {
        h.insert(
            "x-linked-etag",
            format!("\"{sha}\"").parse().expect("header"),
        );
        h.insert("x-linked-size", bytes.len().into());
        h.insert(header::ETAG, "\"redirect-etag\"".parse().expect("header"));
        let to = format!("{}/blobs/{sha}", s.cdn);
        h.insert(header::LOCATION, to.parse().expect("header"));
        return (StatusCode::FOUND, h).into_response();
    }
    // A git file: its ETag is a git object id (40 hex digits).
    h.insert(
        header::ETAG,
        format!("\"{}\"", &sha[..40]).parse().expect("header"),
    );
    ranged(bytes, range.as_deref(), h)
}

#[derive(Clone)]
struct CdnState {
    blobs: Arc<BTreeMap<String, Vec<u8>>>,
    log: Log,
}

async fn cdn_blob(
    State(s): State<CdnState>,
    method: Method,
    UrlPath(sha): UrlPath<String>,
    headers: HeaderMap,
) -> Response {
    let range = seen(&s.log, method, format!("/blobs/{sha}"), &headers);
    match s.blobs.get(&sha) {
        Some(b) => ranged(b, range.as_deref(), HeaderMap::new()),
        None => StatusCode::NOT_FOUND.into_response(),
    }
}

/// A Hub on one port of 127.0.0.1 and its CDN on another (so the token must not follow the
/// redirect); returns the Hub's base URL and both request logs.
async fn hub(repos: BTreeMap<String, HubRepo>) -> (String, Log, Log) {
    let blobs: BTreeMap<String, Vec<u8>> = repos
        .values()
        .flat_map(|r| r.files.iter())
        .filter(|(n, _)| is_large(n))
        .map(|(_, b)| (sha256_hex(b), b.clone()))
        .collect();
    let cdn_log = Log::default();
    let cdn = Router::new()
        .route("/blobs/{sha}", get(cdn_blob))
        .with_state(CdnState {
            blobs: Arc::new(blobs),
            log: cdn_log.clone(),
        });
    let cdn_addr = spawn_on_loopback(cdn).await;
    let hub_log = Log::default();
    let app = Router::new()
        .route("/{org}/{name}/resolve/{rev}/{*file}", get(hub_resolve))
        .with_state(HubState {
            repos: Arc::new(repos),
            cdn: format!("http://{cdn_addr}"),
            log: hub_log.clone(),
        });
    let addr = spawn_on_loopback(app).await;
    (format!("http://{addr}"), hub_log, cdn_log)
}

fn lung_hub() -> (Vec<u8>, BTreeMap<String, HubRepo>) {
    let bytes = std::fs::read(h5()).expect("read h5");
    let repo = HubRepo {
        gated: false,
        files: BTreeMap::from([(LUNG_FILE.to_string(), bytes.clone())]),
    };
    (bytes, BTreeMap::from([(LUNG_REPO.to_string(), repo)]))
}

/// The built-in manifest `id`, published as `file` of Hub repository `repo` at `revision`.
fn on_hub(id: &str, repo: &str, file: &str, revision: &str) -> Manifest {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut m = ModelRegistry::new(dir.path())
        .expect("registry")
        .manifest(id)
        .expect("manifest")
        .clone();
    m.source.url = None;
    m.source.hf_repo = Some(repo.to_string());
    m.source.hf_file = Some(file.to_string());
    m.source.revision = Some(revision.to_string());
    m
}

fn registry(dir: &Path, manifest: &Manifest) -> ModelRegistry {
    ModelRegistry::new(dir)
        .expect("registry")
        .with_manifest(manifest.clone())
}

fn hub_opts(endpoint: &str, cache: &Path, token: Option<&str>) -> FetchOptions {
    FetchOptions {
        endpoint: Some(endpoint.to_string()),
        token: token.map(HfToken::new),
        hub_cache: Some(cache.to_path_buf()),
        ..FetchOptions::default()
    }
}

fn count(log: &Log) -> usize {
    log.lock().expect("lock").len()
}

fn names_in(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

#[tokio::test]
async fn hub_fetch_fills_the_shared_cache_and_a_second_fetch_asks_nothing() {
    let (bytes, repos) = lung_hub();
    let sha = sha256_hex(&bytes);
    let (endpoint, hub_log, cdn_log) = hub(repos).await;
    let manifest = on_hub("lung-unet", LUNG_REPO, LUNG_FILE, "main");
    let cache = tempfile::tempdir().expect("cache");
    let models = tempfile::tempdir().expect("models");
    let reg = registry(models.path(), &manifest);
    let mut progress = Recorder::default();
    // A trailing slash, as people write HF_ENDPOINT.
    let opts = hub_opts(&format!("{endpoint}/"), cache.path(), None);
    let inst = hilum_models::fetch(&reg, "lung-unet", &opts, &mut progress)
        .await
        .expect("fetch from the hub");
    assert_eq!(
        inst.record.source,
        format!("{endpoint}/{LUNG_REPO}/resolve/main/{LUNG_FILE}")
    );
    assert_eq!(progress.total, Some(bytes.len() as u64));
    assert!(reg.verify("lung-unet").expect("verify").ok);

    // huggingface_hub's layout.
    let repo_dir = cache.path().join("models--hilum-test--lung-unet");
    assert_eq!(
        std::fs::read_to_string(repo_dir.join("refs/main")).expect("refs/main"),
        COMMIT
    );
    let snap = repo_dir.join("snapshots").join(COMMIT).join(LUNG_FILE);
    assert_eq!(
        std::fs::read_link(&snap).expect("snapshot is a link"),
        PathBuf::from(format!("../../blobs/{sha}"))
    );
    assert_eq!(std::fs::read(&snap).expect("read through the link"), bytes);
    assert_eq!(names_in(&repo_dir.join("blobs")), vec![sha.clone()]);
    assert!(!reg.model_dir("lung-unet").join("download").exists());

    // HEAD then GET on the Hub (which redirects to the CDN); one GET on the CDN.
    let hub_seen = hub_log.lock().expect("lock").clone();
    let methods: Vec<_> = hub_seen.iter().map(|s| s.method.clone()).collect();
    assert_eq!(methods, vec![Method::HEAD, Method::GET], "{hub_seen:?}");
    let path = format!("/{LUNG_REPO}/resolve/main/{LUNG_FILE}");
    assert!(hub_seen.iter().all(|s| s.path == path), "{hub_seen:?}");
    assert_eq!(count(&cdn_log), 1);

    // The same file for another installation: from the cache, no request at all.
    let models2 = tempfile::tempdir().expect("models");
    let reg2 = registry(models2.path(), &manifest);
    let mut progress = Recorder::default();
    hilum_models::fetch(&reg2, "lung-unet", &opts, &mut progress)
        .await
        .expect("fetch from the cache");
    assert_eq!(count(&hub_log), 2, "{:?}", hub_log.lock().expect("lock"));
    assert_eq!(count(&cdn_log), 1);
    assert_eq!(progress.advanced, 0);
    assert!(reg2.verify("lung-unet").expect("verify").ok);
}

#[tokio::test]
async fn gated_repo_needs_hf_token_which_never_reaches_the_cdn() {
    let mut files = report_repo();
    files.remove("tokenizer_config.json");
    let repos = BTreeMap::from([(
        GATED_REPO.to_string(),
        HubRepo {
            gated: true,
            files: files.clone(),
        },
    )]);
    let (endpoint, hub_log, cdn_log) = hub(repos).await;
    // Pinned to a commit, as the report manifests are.
    let manifest = on_hub(REPORT, GATED_REPO, "model.safetensors", COMMIT);
    let cache = tempfile::tempdir().expect("cache");
    let models = tempfile::tempdir().expect("models");
    let reg = registry(models.path(), &manifest);
    let fetch = |token: Option<&'static str>| {
        let opts = hub_opts(&endpoint, cache.path(), token);
        let reg = &reg;
        async move { hilum_models::fetch(reg, REPORT, &opts, &mut hilum_models::NoProgress).await }
    };

    let err = fetch(None)
        .await
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(
        err.contains("401") && err.contains("gated") && err.contains("set HF_TOKEN"),
        "{err}"
    );
    assert!(!err.contains(TOKEN));
    let err = fetch(Some("hf_wrong"))
        .await
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(
        err.contains("403") && err.contains("HF_TOKEN") && err.contains("no access"),
        "{err}"
    );
    assert!(!err.contains("hf_wrong"), "{err}");
    assert!(reg.installed(REPORT).is_err());
    assert_eq!(count(&cdn_log), 0);

    let inst = fetch(Some(TOKEN)).await.expect("fetch with the token");
    let model_dir = models.path().join(REPORT);
    for f in ["config.json", "vocab.txt"] {
        let got = std::fs::read(model_dir.join(f)).unwrap_or_else(|e| panic!("{f}: {e}"));
        assert_eq!(got, files[f], "{f}");
    }
    assert!(!model_dir.join("tokenizer_config.json").exists());
    let repo_dir = cache.path().join("models--hilum-test--gated-report");
    assert!(repo_dir
        .join(".no_exist")
        .join(COMMIT)
        .join("tokenizer_config.json")
        .is_file());
    assert!(
        !repo_dir.join("refs").exists(),
        "a commit revision needs no ref"
    );
    hilum_models::report::ReportModel::load_files(
        &inst.weights,
        None,
        0,
        hilum_models::Device::Cpu,
    )
    .expect("installed report model loads");
    let bearer = format!("Bearer {TOKEN}");
    let hub_seen = hub_log.lock().expect("lock").clone();
    assert!(
        hub_seen
            .iter()
            .any(|s| s.method == Method::GET && s.auth.as_deref() == Some(bearer.as_str())),
        "{hub_seen:?}"
    );
    let cdn_seen = cdn_log.lock().expect("lock").clone();
    assert_eq!(cdn_seen.len(), 1, "{cdn_seen:?}");
    assert!(
        cdn_seen.iter().all(|s| s.auth.is_none()),
        "the token went to the CDN: {cdn_seen:?}"
    );

    // Everything, the missing optional file included, is known now: no request.
    let before = count(&hub_log);
    let models2 = tempfile::tempdir().expect("models");
    let reg2 = registry(models2.path(), &manifest);
    let opts = hub_opts(&endpoint, cache.path(), Some(TOKEN));
    hilum_models::fetch(&reg2, REPORT, &opts, &mut hilum_models::NoProgress)
        .await
        .expect("fetch from the cache");
    assert_eq!(count(&hub_log), before);
    assert_eq!(count(&cdn_log), 1);
}

#[tokio::test]
async fn hub_fetch_resumes_an_incomplete_blob() {
    let (bytes, repos) = lung_hub();
    let sha = sha256_hex(&bytes);
    let (endpoint, _, cdn_log) = hub(repos).await;
    let manifest = on_hub("lung-unet", LUNG_REPO, LUNG_FILE, "main");
    let cache = tempfile::tempdir().expect("cache");
    let blobs = cache.path().join("models--hilum-test--lung-unet/blobs");
    std::fs::create_dir_all(&blobs).expect("mkdir");
    // What an interrupted download (this one's or huggingface_hub's) leaves.
    let half = bytes.len() / 2;
    std::fs::write(blobs.join(format!("{sha}.incomplete")), &bytes[..half]).expect("write");
    let models = tempfile::tempdir().expect("models");
    let reg = registry(models.path(), &manifest);
    let mut progress = Recorder::default();
    let opts = hub_opts(&endpoint, cache.path(), None);
    hilum_models::fetch(&reg, "lung-unet", &opts, &mut progress)
        .await
        .expect("resumed fetch");
    let ranges: Vec<_> = cdn_log
        .lock()
        .expect("lock")
        .iter()
        .map(|s| s.range.clone())
        .collect();
    assert_eq!(ranges, vec![Some(format!("bytes={half}-"))]);
    assert_eq!(progress.start, half as u64);
    assert_eq!(progress.advanced, (bytes.len() - half) as u64);
    assert_eq!(names_in(&blobs), vec![sha]);
    assert!(reg.verify("lung-unet").expect("verify").ok);
}

#[tokio::test]
async fn corrupted_cached_blob_fails_the_sha256_check_and_is_fetched_again() {
    let (bytes, repos) = lung_hub();
    let sha = sha256_hex(&bytes);
    let (endpoint, _, cdn_log) = hub(repos).await;
    let manifest = on_hub("lung-unet", LUNG_REPO, LUNG_FILE, "main");
    let cache = tempfile::tempdir().expect("cache");
    let opts = hub_opts(&endpoint, cache.path(), None);
    let models = tempfile::tempdir().expect("models");
    hilum_models::fetch(
        &registry(models.path(), &manifest),
        "lung-unet",
        &opts,
        &mut hilum_models::NoProgress,
    )
    .await
    .expect("first fetch");
    let repo_dir = cache.path().join("models--hilum-test--lung-unet");
    let blob = repo_dir.join("blobs").join(&sha);
    let mut bad = bytes.clone();
    bad[bytes.len() / 3] ^= 0xff;
    std::fs::write(&blob, &bad).expect("corrupt the blob");

    let models2 = tempfile::tempdir().expect("models");
    let reg2 = registry(models2.path(), &manifest);
    let err = hilum_models::fetch(&reg2, "lung-unet", &opts, &mut hilum_models::NoProgress)
        .await
        .err();
    match err {
        Some(e @ ModelError::Checksum { .. }) => {
            let msg = e.to_string();
            assert!(msg.contains("hilum models fetch lung-unet"), "{msg}");
            assert!(msg.contains("removed from the cache"), "{msg}");
        }
        other => panic!("expected a checksum error, got {other:?}"),
    }
    assert!(reg2.installed("lung-unet").is_err());
    assert!(!blob.exists());
    assert_eq!(count(&cdn_log), 1);
    // The next fetch downloads it again.
    hilum_models::fetch(&reg2, "lung-unet", &opts, &mut hilum_models::NoProgress)
        .await
        .expect("fetch after the bad copy was removed");
    assert_eq!(count(&cdn_log), 2);
    assert_eq!(std::fs::read(&blob).expect("blob"), bytes);
    assert!(reg2.verify("lung-unet").expect("verify").ok);
}

#[tokio::test]
async fn an_endpoint_that_is_not_a_hub_is_explained() {
    async fn plain(UrlPath(_): UrlPath<String>) -> Response {
        (StatusCode::OK, b"not a hub".to_vec()).into_response()
    }
    let addr = spawn_on_loopback(Router::new().route("/{*path}", get(plain))).await;
    let manifest = on_hub("lung-unet", LUNG_REPO, LUNG_FILE, "main");
    let cache = tempfile::tempdir().expect("cache");
    let models = tempfile::tempdir().expect("models");
    let opts = hub_opts(&format!("http://{addr}"), cache.path(), None);
    let err = hilum_models::fetch(
        &registry(models.path(), &manifest),
        "lung-unet",
        &opts,
        &mut hilum_models::NoProgress,
    )
    .await
    .err()
    .map(|e| e.to_string())
    .unwrap_or_default();
    assert!(
        err.contains("X-Repo-Commit") && err.contains("HF_ENDPOINT") && err.contains("--url"),
        "{err}"
    );
}
