//! `hilum models fetch ID`: HTTPS download of the published checkpoint, resumable (HTTP Range
//! on a `.partial` file), sha256-verified against the manifest, then converted and installed
//! exactly like `hilum models import`. The manifest's `fetch_files` (config, tokenizer) come
//! from the same folder as the weights and are installed beside them.

use std::path::{Path, PathBuf};

use futures::StreamExt;
use tokio::io::AsyncWriteExt;

use crate::{import, sha256_file, ImportOptions, InstalledModel, ModelError, ModelRegistry};

/// Receives download progress (the CLI draws a progress bar).
pub trait FetchProgress: Send {
    /// `total` is the full size when known; `done` the bytes already on disk (resume).
    fn start(&mut self, _total: Option<u64>, _done: u64) {}
    fn advance(&mut self, _bytes: u64) {}
    fn finish(&mut self) {}
}

/// Progress that goes nowhere.
pub struct NoProgress;
impl FetchProgress for NoProgress {}

#[derive(Clone, Debug, Default)]
pub struct FetchOptions {
    /// Download from here instead of the manifest's source (a site mirror).
    pub url: Option<String>,
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
    download(&url, &partial, progress).await?;
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

fn client(url: &str) -> Result<reqwest::Client, ModelError> {
    reqwest::Client::builder()
        .user_agent(concat!("hilum/", env!("CARGO_PKG_VERSION")))
        .build()
        .map_err(|e| ModelError::Fetch {
            url: url.to_string(),
            reason: e.to_string(),
        })
}

/// Downloads `url` into `partial`, continuing from its current length when the server
/// supports ranges.
async fn download(
    url: &str,
    partial: &PathBuf,
    progress: &mut dyn FetchProgress,
) -> Result<(), ModelError> {
    let fail = |reason: String| ModelError::Fetch {
        url: url.to_string(),
        reason,
    };
    let have = std::fs::metadata(partial).map(|m| m.len()).unwrap_or(0);
    let client = client(url)?;
    let mut req = client.get(url);
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
    use super::sibling_url;

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
}
