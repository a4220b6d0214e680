//! `hilum models fetch ID`: downloads the published checkpoint, checks its sha256 against the
//! manifest, then converts and installs it exactly like `hilum models import`. The manifest's
//! `fetch_files` (config, tokenizer) come from the same place as the weights and are installed
//! beside them.
//!
//! Two sources:
//!
//! * A manifest with `hf_repo` and `hf_file` (and no `url`, and no `--url` mirror) is fetched
//!   from the Hugging Face Hub the way `huggingface_hub` (Python) does it, so that the two share
//!   one cache: `HEAD {endpoint}/{repo}/resolve/{revision}/{file}` gives the commit
//!   (`X-Repo-Commit`) and the blob name (`X-Linked-Etag`, else `ETag`, without quotes); the
//!   file is downloaded into `HUB_CACHE/models--{org}--{name}/blobs/{etag}.incomplete`
//!   (resumed with HTTP Range), renamed to `blobs/{etag}`, linked from
//!   `snapshots/{commit}/{file}`, and `refs/{revision}` records the commit. A file whose
//!   snapshot is already in the cache is not downloaded again (no request at all), whichever
//!   tool put it there. An access token ([`HfToken`], `HF_TOKEN` in the CLI) goes to the Hub
//!   endpoint as `Authorization: Bearer`, never to the CDN it redirects to; 401 and 403 answers
//!   explain gated models. The endpoint (`HF_ENDPOINT`: a hospital's mirror) and the cache
//!   (`HF_HUB_CACHE`) are values in [`FetchOptions`]: this library reads no environment.
//! * A plain URL (the manifest's `url`, or `--url`): one file, resumable (HTTP Range on a
//!   `.partial` file in the model's download folder); extras from the same folder.
//!
//! Why not the `hf-hub` crate: its current release (1.0) is built on reqwest 0.13 and the
//! `hf-xet` client, a second HTTP stack beside the workspace's reqwest 0.12; the 0.4 line that
//! uses reqwest 0.12 resumes into its own `.sync.part` format (a trailer of committed bytes) that
//! neither reads nor leaves `huggingface_hub`'s `.incomplete` files, requires a ranged probe
//! with `Content-Range` before every download, unwraps server headers (a panic on a malformed
//! redirect), and reads `HF_HOME` itself. The Hub's download protocol is small; it is written
//! here on the workspace's reqwest and rustls, with the sha256 check and the error texts
//! Hilum needs.

use std::path::{Path, PathBuf};

use futures::StreamExt;
use tokio::io::AsyncWriteExt;

use crate::Manifest;
use crate::{import, sha256_file, ImportOptions, InstalledModel, ModelError, ModelRegistry};

/// The Hugging Face Hub's public endpoint (the CLI's `HF_ENDPOINT` replaces it).
pub const DEFAULT_HUB_ENDPOINT: &str = "https://huggingface.co";

/// Receives download progress (the CLI draws a progress bar).
pub trait FetchProgress: Send {
    /// `total` is the full size when known; `done` the bytes already on disk (resume).
    fn start(&mut self, _total: Option<u64>, _done: u64) {}
    /// `bytes` more are on disk.
    fn advance(&mut self, _bytes: u64) {}
    /// The download is complete.
    fn finish(&mut self) {}
}

/// Progress that goes nowhere.
pub struct NoProgress;
impl FetchProgress for NoProgress {}

/// A Hugging Face access token. Its `Debug` output hides the value, so that options printed
/// to a log never show it.
#[derive(Clone, PartialEq, Eq)]
pub struct HfToken(String);

impl HfToken {
    /// Wraps a token read from the settings or the environment.
    pub fn new(token: impl Into<String>) -> Self {
        HfToken(token.into())
    }

    /// The token itself, for the `Authorization` header.
    pub fn secret(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for HfToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("HfToken(<hidden>)")
    }
}

/// How [`fetch`] gets the weights: mirror, Hub endpoint, token, cache, and import options.
#[derive(Clone, Debug, Default)]
pub struct FetchOptions {
    /// Download from here instead of the manifest's source (a site mirror of the one file).
    pub url: Option<String>,
    /// The Hugging Face Hub (or a mirror of it) that manifests' `hf_repo` files come from;
    /// `None`: [`DEFAULT_HUB_ENDPOINT`].
    pub endpoint: Option<String>,
    /// Sent to the Hub endpoint for gated or private repositories.
    pub token: Option<HfToken>,
    /// The Hub cache shared with Python tools (`~/.cache/huggingface/hub`); `None`: a private
    /// cache in the model's download folder, removed after installation.
    pub hub_cache: Option<PathBuf>,
    /// How the downloaded file is imported once verified.
    pub import: ImportOptions,
}

/// Downloads, verifies, converts and installs model `id`.
pub async fn fetch(
    registry: &ModelRegistry,
    id: &str,
    opts: &FetchOptions,
    progress: &mut dyn FetchProgress,
) -> Result<InstalledModel, ModelError> {
    let manifest = registry.manifest(id)?;
    if opts.url.is_none() && manifest.source.url.is_none() {
        if let (Some(repo), Some(file)) = (&manifest.source.hf_repo, &manifest.source.hf_file) {
            return fetch_from_hub(registry, manifest, repo, file, opts, progress).await;
        }
    }
    let url = match opts.url.clone().or_else(|| manifest.source.download_url()) {
        Some(u) => u,
        None => {
            return Err(ModelError::NoDownload {
                id: id.to_string(),
                detail: manifest
                    .source
                    .homepage
                    .as_ref()
                    .map(|h| format!(" (its weights are published at {h})"))
                    .unwrap_or_default(),
            })
        }
    };
    let file_name = manifest
        .source
        .file
        .clone()
        .or_else(|| url.rsplit('/').next().map(str::to_string))
        .filter(|f| !f.is_empty() && !f.contains(".."))
        .unwrap_or_else(|| "download.bin".into());
    let dl_dir = registry.model_dir(id).join("download");
    std::fs::create_dir_all(&dl_dir).map_err(|e| ModelError::io(&dl_dir, e))?;
    let partial = dl_dir.join(format!("{file_name}.partial"));
    let done_path = dl_dir.join(&file_name);

    // The small files first: a missing one fails before a long download, and they lie beside
    // the weights when import checks them (the report models' layout comes from config.json).
    let extras = fetch_extras(id, &url, &manifest.source.fetch_list(), &dl_dir).await?;
    let client = client(&url)?;
    download(&client, &url, None, &partial, progress, &|_| None).await?;
    std::fs::rename(&partial, &done_path).map_err(|e| ModelError::io(&done_path, e))?;

    if let Some(expected) = &manifest.source.sha256 {
        let actual = sha256_file(&done_path)?;
        if !expected.eq_ignore_ascii_case(&actual) {
            let _ = std::fs::remove_file(&done_path);
            return Err(ModelError::Checksum {
                what: url.clone(),
                expected: expected.clone(),
                actual,
                hint: format!(
                    "the download is corrupt or the file changed upstream; run `hilum models fetch {id}` again"
                ),
            });
        }
    }
    let mut import_opts = opts.import.clone();
    import_opts.origin = Some(url);
    let installed = import(registry, id, &done_path, &import_opts)?;
    let model_dir = registry.model_dir(id);
    for name in &extras {
        // Same filesystem (the download folder is inside the model's), so rename is atomic.
        let dst = model_dir.join(name);
        std::fs::rename(dl_dir.join(name), &dst).map_err(|e| ModelError::io(&dst, e))?;
    }
    let _ = std::fs::remove_dir_all(&dl_dir);
    Ok(installed)
}

/// Fetches `file` of Hub repository `repo`, and the manifest's `fetch_files` from the same
/// revision, through the Hub cache; checks and installs them.
async fn fetch_from_hub(
    registry: &ModelRegistry,
    manifest: &Manifest,
    repo: &str,
    file: &str,
    opts: &FetchOptions,
    progress: &mut dyn FetchProgress,
) -> Result<InstalledModel, ModelError> {
    let id = manifest.id.as_str();
    let dl_dir = registry.model_dir(id).join("download");
    let cache = opts.hub_cache.clone().unwrap_or_else(|| dl_dir.join("hub"));
    let hub = Hub::new(id, repo, manifest.source.revision.as_deref(), opts, cache)?;
    if !valid_repo_path(file) {
        return Err(ModelError::Manifest {
            id: id.to_string(),
            reason: format!("hf_file `{file}` must be a path inside the repository"),
        });
    }
    // The small files first, as for a plain URL: a missing one fails before a long download.
    let mut extras = Vec::new();
    for (name, required) in manifest.source.fetch_list() {
        if name.is_empty() || name.contains(['/', '\\']) || name == ".." {
            return Err(ModelError::Manifest {
                id: id.to_string(),
                reason: format!("fetch_files entry `{name}` must be a plain file name"),
            });
        }
        if let Some(got) = hub.get(name, required, &mut NoProgress).await? {
            extras.push((name, got.path));
        }
    }
    let url = hub.url(file);
    let weights = hub
        .get(file, true, progress)
        .await?
        .ok_or_else(|| ModelError::Fetch {
            url: url.clone(),
            reason: "the Hub has no such file; check hf_file in the manifest".into(),
        })?;
    // The manifest's sha256, else the Hub's own for a large (LFS) file: its ETag.
    let expected = manifest
        .source
        .sha256
        .clone()
        .or_else(|| weights.etag.clone().filter(|e| is_sha256(e)));
    if let Some(expected) = expected {
        let actual = sha256_file(&weights.path)?;
        if !expected.eq_ignore_ascii_case(&actual) {
            hub.evict(&weights.path);
            return Err(ModelError::Checksum {
                what: format!("{url} (cached as {})", weights.path.display()),
                expected,
                actual,
                hint: format!(
                    "the download or the cached copy is corrupt, or the file changed upstream; \
                     the bad copy was removed from the cache: run `hilum models fetch {id}` again"
                ),
            });
        }
    }
    let mut import_opts = opts.import.clone();
    import_opts.origin = Some(url);
    let installed = import(registry, id, &weights.path, &import_opts)?;
    let model_dir = registry.model_dir(id);
    for (name, path) in &extras {
        // Copied (the cache keeps its own), under a temporary name first.
        let tmp = model_dir.join(format!("{name}.partial"));
        std::fs::copy(path, &tmp).map_err(|e| ModelError::io(&tmp, e))?;
        let dst = model_dir.join(name);
        std::fs::rename(&tmp, &dst).map_err(|e| ModelError::io(&dst, e))?;
    }
    let _ = std::fs::remove_dir_all(&dl_dir);
    Ok(installed)
}

/// One Hub repository at one revision, and its folder in the Hub cache.
struct Hub {
    id: String,
    endpoint: String,
    repo: String,
    revision: String,
    token: Option<HfToken>,
    /// `HUB_CACHE/models--{org}--{name}`.
    dir: PathBuf,
    /// `HUB_CACHE/.locks/models--{org}--{name}`, where `huggingface_hub` locks its blobs.
    locks: PathBuf,
    /// Follows redirects: a file's bytes, from the Hub or the CDN it sends the client to.
    client: reqwest::Client,
    /// Follows redirects on the same host only (a renamed repository): the Hub's own answer,
    /// whose headers name the commit and the blob, is read before it points to a CDN.
    head_client: reqwest::Client,
}

/// What the Hub says about one file.
struct Meta {
    commit: String,
    etag: String,
    size: Option<u64>,
}

/// A repository file in the cache: its snapshot path and, when known, its blob name.
struct Cached {
    path: PathBuf,
    etag: Option<String>,
}

impl Hub {
    fn new(
        id: &str,
        repo: &str,
        revision: Option<&str>,
        opts: &FetchOptions,
        cache: PathBuf,
    ) -> Result<Hub, ModelError> {
        let bad = |reason: String| ModelError::Manifest {
            id: id.to_string(),
            reason,
        };
        if !valid_repo_path(repo) || repo.split('/').count() > 2 {
            return Err(bad(format!(
                "hf_repo `{repo}` must be a Hugging Face repository id such as `org/name`"
            )));
        }
        let revision = revision.unwrap_or("main");
        if !valid_repo_path(revision) {
            return Err(bad(format!(
                "revision `{revision}` must be a branch, tag or commit of `{repo}`"
            )));
        }
        let endpoint = opts
            .endpoint
            .as_deref()
            .map(str::trim)
            .filter(|e| !e.is_empty())
            .unwrap_or(DEFAULT_HUB_ENDPOINT)
            .trim_end_matches('/')
            .to_string();
        let folder = format!("models--{}", repo.replace('/', "--"));
        let same_host_only = reqwest::redirect::Policy::custom(|attempt| {
            if attempt.previous().len() > 10 {
                return attempt.error("too many redirects");
            }
            let next = attempt.url();
            let same = attempt.previous().last().is_some_and(|prev| {
                prev.host_str() == next.host_str()
                    && prev.port_or_known_default() == next.port_or_known_default()
            });
            if same {
                attempt.follow()
            } else {
                attempt.stop()
            }
        });
        let build_error = |e: reqwest::Error| ModelError::Fetch {
            url: endpoint.clone(),
            reason: e.to_string(),
        };
        let head_client = client_builder()
            .redirect(same_host_only)
            .build()
            .map_err(build_error)?;
        let client = client_builder().build().map_err(build_error)?;
        Ok(Hub {
            id: id.to_string(),
            endpoint: endpoint.clone(),
            repo: repo.to_string(),
            revision: revision.to_string(),
            token: opts.token.clone(),
            dir: cache.join(&folder),
            locks: cache.join(".locks").join(&folder),
            client,
            head_client,
        })
    }

    /// `{endpoint}/{repo}/resolve/{revision}/{file}` (a `/` in the revision encoded, as
    /// `huggingface_hub` does).
    fn url(&self, file: &str) -> String {
        format!(
            "{}/{}/resolve/{}/{file}",
            self.endpoint,
            self.repo,
            self.revision.replace('/', "%2F")
        )
    }

    fn snapshot(&self, commit: &str, file: &str) -> PathBuf {
        self.dir.join("snapshots").join(commit).join(file)
    }

    /// The marker `huggingface_hub` leaves for a file the repository does not have.
    fn no_exist(&self, commit: &str, file: &str) -> PathBuf {
        self.dir.join(".no_exist").join(commit).join(file)
    }

    /// The commit the revision is known to stand for: itself when it is a commit hash, else
    /// what `refs/{revision}` says.
    fn cached_commit(&self) -> Option<String> {
        if is_commit(&self.revision) {
            return Some(self.revision.clone());
        }
        let text = std::fs::read_to_string(self.dir.join("refs").join(&self.revision)).ok()?;
        let commit = text.trim();
        is_commit(commit).then(|| commit.to_string())
    }

    fn write_ref(&self, commit: &str) -> Result<(), ModelError> {
        if self.revision == commit || self.cached_commit().as_deref() == Some(commit) {
            return Ok(());
        }
        let path = self.dir.join("refs").join(&self.revision);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).map_err(|e| ModelError::io(parent, e))?;
        }
        std::fs::write(&path, commit).map_err(|e| ModelError::io(&path, e))
    }

    /// `file` from the cache, downloaded first if it is not there; `None` when the repository
    /// has no such file and it is not `required`.
    async fn get(
        &self,
        file: &str,
        required: bool,
        progress: &mut dyn FetchProgress,
    ) -> Result<Option<Cached>, ModelError> {
        if let Some(commit) = self.cached_commit() {
            let snap = self.snapshot(&commit, file);
            if snap.is_file() {
                let etag = blob_name(&snap);
                return Ok(Some(Cached { path: snap, etag }));
            }
            if !required && self.no_exist(&commit, file).is_file() {
                return Ok(None);
            }
        }
        let url = self.url(file);
        let Some(meta) = self.head(&url, file, required).await? else {
            return Ok(None);
        };
        self.write_ref(&meta.commit)?;
        let snap = self.snapshot(&meta.commit, file);
        if snap.is_file() {
            let etag = blob_name(&snap).or(Some(meta.etag));
            return Ok(Some(Cached { path: snap, etag }));
        }
        let blob = self.dir.join("blobs").join(&meta.etag);
        if !blob.is_file() {
            self.download_blob(&url, &meta, &blob, progress).await?;
        }
        link(&blob, &meta.etag, &snap, file)?;
        Ok(Some(Cached {
            path: snap,
            etag: Some(meta.etag),
        }))
    }

    /// What a 401 or 403 from the Hub means, and what to do.
    fn refusal(&self, status: reqwest::StatusCode) -> Option<String> {
        if !matches!(
            status,
            reqwest::StatusCode::UNAUTHORIZED | reqwest::StatusCode::FORBIDDEN
        ) {
            return None;
        }
        let repo = &self.repo;
        Some(match self.token {
            None => format!(
                "the Hub answered {status}: `{repo}` is a gated or private model (or there is no \
                 such repository): accept its license at https://huggingface.co/{repo} while \
                 logged in, create an access token at https://huggingface.co/settings/tokens \
                 and set HF_TOKEN to it"
            ),
            Some(_) => format!(
                "the Hub answered {status} to the token in HF_TOKEN: its account has no access \
                 to `{repo}` (a gated model: accept its license at https://huggingface.co/{repo} \
                 with that account), or the token cannot read repositories, or there is no such \
                 repository"
            ),
        })
    }

    /// The Hub's headers for `file` (`HEAD` on its resolve URL); `None` when it is missing and
    /// not `required`.
    async fn head(
        &self,
        url: &str,
        file: &str,
        required: bool,
    ) -> Result<Option<Meta>, ModelError> {
        let fail = |reason: String| ModelError::Fetch {
            url: url.to_string(),
            reason,
        };
        let resp = file_request(self.head_client.head(url), self.token.as_ref())
            .send()
            .await
            .map_err(|e| {
                fail(format!(
                    "{e}; check the network or proxy (HTTPS_PROXY) and the Hub endpoint {} \
                     (HF_ENDPOINT)",
                    self.endpoint
                ))
            })?;
        let status = resp.status();
        let headers = resp.headers();
        let commit = header(headers, "x-repo-commit").filter(|c| is_commit(c));
        if status == reqwest::StatusCode::NOT_FOUND && !required {
            if let Some(commit) = &commit {
                // Remembered as huggingface_hub does, so the next fetch does not ask again.
                let marker = self.no_exist(commit, file);
                if let Some(parent) = marker.parent() {
                    let _ =
                        std::fs::create_dir_all(parent).and_then(|()| std::fs::write(&marker, b""));
                }
            }
            return Ok(None);
        }
        if let Some(reason) = self.refusal(status) {
            return Err(fail(reason));
        }
        if status == reqwest::StatusCode::NOT_FOUND {
            return Err(fail(format!(
                "the Hub answered {status}: `{}` has no {file} at revision `{}`; check hf_repo, \
                 hf_file and revision in models/{}.toml, and the endpoint {} (HF_ENDPOINT)",
                self.repo, self.revision, self.id, self.endpoint
            )));
        }
        if !(status.is_success() || status.is_redirection()) {
            return Err(fail(format!(
                "the Hub answered {status}; try again later, or download the file another way \
                 and run `hilum models import {} PATH`",
                self.id
            )));
        }
        let not_a_hub = |what: &str| {
            fail(format!(
                "the answer has no {what} header: {} does not serve the Hugging Face Hub's \
                 layout; set HF_ENDPOINT to a Hub mirror, or give the file's own URL with --url",
                self.endpoint
            ))
        };
        let commit = commit.ok_or_else(|| not_a_hub("X-Repo-Commit"))?;
        let etag = header(headers, "x-linked-etag")
            .or_else(|| header(headers, "etag"))
            .map(|e| normalize_etag(&e))
            .filter(|e| valid_blob_name(e))
            .ok_or_else(|| not_a_hub("ETag"))?;
        let size = header(headers, "x-linked-size")
            .or_else(|| {
                status
                    .is_success()
                    .then(|| header(headers, "content-length"))
                    .flatten()
            })
            .and_then(|s| s.parse().ok());
        Ok(Some(Meta { commit, etag, size }))
    }

    /// Downloads a blob into `blobs/{etag}.incomplete` (resuming what is there), then renames
    /// it; under `huggingface_hub`'s lock for that blob.
    async fn download_blob(
        &self,
        url: &str,
        meta: &Meta,
        blob: &Path,
        progress: &mut dyn FetchProgress,
    ) -> Result<(), ModelError> {
        let blobs = self.dir.join("blobs");
        for d in [&blobs, &self.locks] {
            std::fs::create_dir_all(d).map_err(|e| ModelError::io(d, e))?;
        }
        let lock_path = self.locks.join(format!("{}.lock", meta.etag));
        let lock = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(|e| ModelError::io(&lock_path, e))?;
        match lock.try_lock() {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => {
                return Err(ModelError::Fetch {
                    url: url.to_string(),
                    reason: format!(
                        "another process is downloading this file into the cache (it holds {}); \
                         wait for it to finish, then run the same command again",
                        lock_path.display()
                    ),
                })
            }
            Err(std::fs::TryLockError::Error(e)) => return Err(ModelError::io(&lock_path, e)),
        }
        if blob.is_file() {
            return Ok(()); // finished by the process that held the lock
        }
        let incomplete = blobs.join(format!("{}.incomplete", meta.etag));
        download(
            &self.client,
            url,
            self.token.as_ref(),
            &incomplete,
            progress,
            &|s| self.refusal(s),
        )
        .await?;
        let got = std::fs::metadata(&incomplete).map_or(0, |m| m.len());
        if let Some(size) = meta.size.filter(|&s| s != got) {
            return Err(ModelError::Fetch {
                url: url.to_string(),
                reason: format!(
                    "got {got} of {size} bytes (kept in {}); run the same command again to resume",
                    incomplete.display()
                ),
            });
        }
        std::fs::rename(&incomplete, blob).map_err(|e| ModelError::io(blob, e))?;
        drop(lock);
        Ok(())
    }

    /// Removes a file that failed its check from the cache: the snapshot entry and its blob.
    fn evict(&self, snap: &Path) {
        if let (Ok(target), Some(dir)) = (std::fs::read_link(snap), snap.parent()) {
            let _ = std::fs::remove_file(dir.join(target));
        }
        let _ = std::fs::remove_file(snap);
    }
}

/// Points `snap` at its blob with a relative symbolic link, as `huggingface_hub` does; where
/// links cannot be made, the blob moves into the snapshot (as it does too).
fn link(blob: &Path, etag: &str, snap: &Path, file: &str) -> Result<(), ModelError> {
    if let Some(parent) = snap.parent() {
        std::fs::create_dir_all(parent).map_err(|e| ModelError::io(parent, e))?;
    }
    let _ = std::fs::remove_file(snap); // a dangling link left by a removed blob
    #[cfg(unix)]
    {
        // From snapshots/{commit}/{dirs of file} up to the repository folder.
        let up = "../".repeat(file.split('/').count() + 1);
        let target = PathBuf::from(up).join("blobs").join(etag);
        if std::os::unix::fs::symlink(&target, snap).is_ok() {
            return Ok(());
        }
    }
    #[cfg(not(unix))]
    let _ = (etag, file);
    std::fs::rename(blob, snap).map_err(|e| ModelError::io(snap, e))
}

/// The blob a snapshot entry links to.
fn blob_name(snap: &Path) -> Option<String> {
    let target = std::fs::read_link(snap).ok()?;
    target.file_name()?.to_str().map(str::to_string)
}

fn header(headers: &reqwest::header::HeaderMap, name: &str) -> Option<String> {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
}

/// An ETag as a blob name: no weak marker, no quotes.
fn normalize_etag(etag: &str) -> String {
    let e = etag.trim();
    e.strip_prefix("W/")
        .unwrap_or(e)
        .trim_matches('"')
        .to_string()
}

/// A blob name that stays inside `blobs/` (the Hub's are hex digests).
fn valid_blob_name(name: &str) -> bool {
    !name.is_empty()
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

/// A relative path inside a repository: no empty, `.` or `..` parts, no backslash.
fn valid_repo_path(path: &str) -> bool {
    !path.contains('\\')
        && path
            .split('/')
            .all(|part| !part.is_empty() && part != "." && part != "..")
}

fn is_hex(s: &str, len: usize) -> bool {
    s.len() == len && s.bytes().all(|b| b.is_ascii_hexdigit())
}

fn is_commit(s: &str) -> bool {
    is_hex(s, 40)
}

fn is_sha256(s: &str) -> bool {
    is_hex(s, 64)
}

/// The URL of `name` in the folder of `weights_url` (query and fragment dropped).
fn sibling_url(weights_url: &str, name: &str) -> String {
    let end = weights_url.find(['?', '#']).unwrap_or(weights_url.len());
    let path = &weights_url[..end];
    match path.rfind('/') {
        Some(i) => format!("{}/{name}", &path[..i]),
        None => name.to_string(),
    }
}

/// Downloads the manifest's `fetch_files` into `dir`; returns the names that were found
/// (an optional file the server does not have is skipped).
async fn fetch_extras(
    id: &str,
    weights_url: &str,
    files: &[(&str, bool)],
    dir: &Path,
) -> Result<Vec<String>, ModelError> {
    let mut got = Vec::new();
    if files.is_empty() {
        return Ok(got);
    }
    let client = client(weights_url)?;
    for &(name, required) in files {
        let url = sibling_url(weights_url, name);
        let fail = |reason: String| ModelError::Fetch {
            url: url.clone(),
            reason,
        };
        if name.is_empty() || name.contains(['/', '\\']) || name == ".." {
            return Err(ModelError::Manifest {
                id: id.to_string(),
                reason: format!("fetch_files entry `{name}` must be a plain file name"),
            });
        }
        let resp = client
            .get(&url)
            .send()
            .await
            .map_err(|e| fail(format!("{e}; check the network or proxy (HTTPS_PROXY)")))?;
        let status = resp.status();
        if !required
            && matches!(
                status,
                reqwest::StatusCode::NOT_FOUND | reqwest::StatusCode::GONE
            )
        {
            continue;
        }
        if !status.is_success() {
            return Err(fail(format!(
                "server answered {status}; `{id}` needs {name} beside its weights: put it next \
                 to the weights on the mirror, or install with `hilum models import` (see \
                 models/{id}.toml)"
            )));
        }
        let body = resp
            .bytes()
            .await
            .map_err(|e| fail(format!("{e}; run the same command again")))?;
        // Written under a temporary name, then renamed: never half a file under the real one.
        let tmp = dir.join(format!("{name}.partial"));
        std::fs::write(&tmp, &body).map_err(|e| ModelError::io(&tmp, e))?;
        let dst = dir.join(name);
        std::fs::rename(&tmp, &dst).map_err(|e| ModelError::io(&dst, e))?;
        got.push(name.to_string());
    }
    Ok(got)
}

fn client_builder() -> reqwest::ClientBuilder {
    reqwest::Client::builder().user_agent(concat!("hilum/", env!("CARGO_PKG_VERSION")))
}

fn client(url: &str) -> Result<reqwest::Client, ModelError> {
    client_builder().build().map_err(|e| ModelError::Fetch {
        url: url.to_string(),
        reason: e.to_string(),
    })
}

/// `req` for the file's own bytes (sizes and ETags are the raw file's, and a compressed
/// transfer could not be resumed by byte offset), with the token when there is one.
fn file_request(req: reqwest::RequestBuilder, token: Option<&HfToken>) -> reqwest::RequestBuilder {
    let req = req.header(reqwest::header::ACCEPT_ENCODING, "identity");
    match token {
        Some(t) => req.bearer_auth(t.secret()),
        None => req,
    }
}

/// Downloads `url` into `partial`, continuing from its current length when the server
/// supports ranges. `token` goes with the request (reqwest drops it on a redirect to another
/// host); `explain` words a refusal (401, 403) for the user.
async fn download(
    client: &reqwest::Client,
    url: &str,
    token: Option<&HfToken>,
    partial: &Path,
    progress: &mut dyn FetchProgress,
    explain: &(dyn Fn(reqwest::StatusCode) -> Option<String> + Sync),
) -> Result<(), ModelError> {
    let fail = |reason: String| ModelError::Fetch {
        url: url.to_string(),
        reason,
    };
    let have = std::fs::metadata(partial).map(|m| m.len()).unwrap_or(0);
    let mut req = file_request(client.get(url), token);
    if have > 0 {
        req = req.header(reqwest::header::RANGE, format!("bytes={have}-"));
    }
    let resp = req.send().await.map_err(|e| {
        fail(format!(
            "{e}; check the network or proxy (HTTPS_PROXY), or download the file elsewhere and \
             use `hilum models import`"
        ))
    })?;
    let status = resp.status();
    if status == reqwest::StatusCode::RANGE_NOT_SATISFIABLE && have > 0 {
        return Ok(()); // the partial file is already complete
    }
    if let Some(reason) = explain(status) {
        return Err(fail(reason));
    }
    if !status.is_success() {
        return Err(fail(format!("server answered {status}")));
    }
    let resumed = status == reqwest::StatusCode::PARTIAL_CONTENT;
    let start = if resumed { have } else { 0 };
    let total = resp.content_length().map(|n| n + start);
    let mut file = tokio::fs::OpenOptions::new()
        .create(true)
        .write(true)
        .append(resumed)
        .truncate(!resumed)
        .open(partial)
        .await
        .map_err(|e| ModelError::io(partial, e))?;
    progress.start(total, start);
    let mut stream = resp.bytes_stream();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| {
            fail(format!(
                "{e}; the part already downloaded is kept: run the same command again to resume"
            ))
        })?;
        file.write_all(&chunk)
            .await
            .map_err(|e| ModelError::io(partial, e))?;
        progress.advance(chunk.len() as u64);
    }
    file.flush().await.map_err(|e| ModelError::io(partial, e))?;
    progress.finish();
    if let Some(total) = total {
        let got = std::fs::metadata(partial).map(|m| m.len()).unwrap_or(0);
        if got != total {
            return Err(fail(format!(
                "got {got} of {total} bytes; run the same command again to resume"
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sibling_files_come_from_the_weights_folder() {
        assert_eq!(
            sibling_url(
                "https://huggingface.co/o/r/resolve/abc/model.safetensors",
                "vocab.txt"
            ),
            "https://huggingface.co/o/r/resolve/abc/vocab.txt"
        );
        assert_eq!(
            sibling_url("https://m/x/model.safetensors?download=1#f", "config.json"),
            "https://m/x/config.json"
        );
    }

    #[test]
    fn etags_become_blob_names_and_paths_stay_inside_the_cache() {
        assert_eq!(normalize_etag("\"abc123\""), "abc123");
        assert_eq!(normalize_etag("W/\"abc123\""), "abc123");
        assert!(valid_blob_name("0123abcdef"));
        for bad in ["", "..", "../x", "a/b", ".hidden"] {
            assert!(!valid_blob_name(bad), "{bad}");
        }
        assert!(valid_repo_path("org/name"));
        assert!(valid_repo_path("onnx/model.onnx"));
        for bad in ["", "/abs", "a//b", "a/../b", "a\\b", "."] {
            assert!(!valid_repo_path(bad), "{bad}");
        }
        assert!(is_commit("5817dc88403a38a6c173188702465ae5021be361"));
        assert!(!is_commit("main"));
    }

    #[test]
    fn hub_urls_use_the_endpoint_and_encode_the_revision() {
        let opts = FetchOptions {
            endpoint: Some("https://hf-mirror.example.org/".into()),
            ..FetchOptions::default()
        };
        let hub = Hub::new(
            "m",
            "org/name",
            Some("refs/pr/1"),
            &opts,
            PathBuf::from("/c"),
        )
        .expect("hub");
        assert_eq!(
            hub.url("model.safetensors"),
            "https://hf-mirror.example.org/org/name/resolve/refs%2Fpr%2F1/model.safetensors"
        );
        assert_eq!(hub.dir, PathBuf::from("/c/models--org--name"));
        let hub =
            Hub::new("m", "org/name", None, &FetchOptions::default(), "/c".into()).expect("hub");
        assert_eq!(
            hub.url("a.bin"),
            "https://huggingface.co/org/name/resolve/main/a.bin"
        );
        assert!(Hub::new("m", "a/b/c", None, &opts, "/c".into()).is_err());
        assert!(Hub::new("m", "org/name", Some("../x"), &opts, "/c".into()).is_err());
    }

    #[test]
    fn the_token_never_shows_in_debug_output() {
        let opts = FetchOptions {
            token: Some(HfToken::new("hf_secretvalue")),
            ..FetchOptions::default()
        };
        let shown = format!("{opts:?}");
        assert!(!shown.contains("hf_secretvalue"), "{shown}");
        assert!(shown.contains("<hidden>"), "{shown}");
    }
}
