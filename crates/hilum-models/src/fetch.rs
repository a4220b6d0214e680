//! `hilum models fetch ID`: HTTPS download of the published checkpoint, resumable (HTTP Range
//! on a `.partial` file), sha256-verified against the manifest, then converted and installed
//! exactly like `hilum models import`.

use std::path::PathBuf;

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
    let _ = std::fs::remove_dir_all(&dl_dir);
    Ok(installed)
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
    let client = reqwest::Client::builder()
        .user_agent(concat!("hilum/", env!("CARGO_PKG_VERSION")))
        .build()
        .map_err(|e| fail(e.to_string()))?;
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
