//! What a model's manifest (`models/<id>.toml`) and its installation record (`install.toml`)
//! say: the plain data every architecture's `load` reads. Kept apart from the registry, which
//! imports the architectures to check weights, so that they need not import it back.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// What `models/<id>.toml` says about a model.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Manifest {
    /// Model id, as the command line names it (`lung-unet`, ...).
    pub id: String,
    /// Human-readable name.
    pub name: String,
    /// `classification`, `segmentation`, ...
    pub task: String,
    /// The Rust implementation that runs it, e.g. `lung-unet`, `densenet121`.
    pub architecture: String,
    /// Architecture configuration (free-form, read by the architecture's `Config`).
    #[serde(default)]
    pub config: toml::Table,
    /// License of the published weights.
    pub license: String,
    /// One-paragraph description for `hilum models list`.
    #[serde(default)]
    pub description: String,
    /// Output labels (classes), in the network's order.
    #[serde(default)]
    pub labels: Vec<String>,
    /// Where the published weights live.
    pub source: Source,
    /// How images are prepared for the network (free-form, read by the architecture).
    #[serde(default)]
    pub preprocessing: toml::Table,
    /// How the network's output is turned into results (free-form, read by the architecture).
    #[serde(default)]
    pub postprocessing: toml::Table,
}

/// Where the published weights live.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Source {
    /// Project page (for people; never downloaded).
    #[serde(default)]
    pub homepage: Option<String>,
    /// Direct HTTPS download of the published file.
    #[serde(default)]
    pub url: Option<String>,
    /// Hugging Face repository, file and revision: `hilum models fetch` downloads them through
    /// the Hub and its cache (see `fetch.rs`), unless `url` is given.
    #[serde(default)]
    pub hf_repo: Option<String>,
    /// File in `hf_repo`.
    #[serde(default)]
    pub hf_file: Option<String>,
    /// Git revision of `hf_repo` (default `main`).
    #[serde(default)]
    pub revision: Option<String>,
    /// File name of the published checkpoint.
    #[serde(default)]
    pub file: Option<String>,
    /// `safetensors`, `keras-h5` or `pytorch`.
    pub format: String,
    /// sha256 of the published file; `None` when the publisher gives none.
    #[serde(default)]
    pub sha256: Option<String>,
    /// Size of the published file in bytes, when known.
    #[serde(default)]
    pub size: Option<u64>,
    /// The same network as an ONNX graph (for the ONNX Runtime backend), when published.
    #[serde(default)]
    pub onnx_file: Option<String>,
    /// sha256 of `onnx_file`.
    #[serde(default)]
    pub onnx_sha256: Option<String>,
    /// Files the architecture needs beside its weights (e.g. `tokenizer.json`), copied at
    /// installation from the folder of the installed weights.
    #[serde(default)]
    pub companion_files: Vec<String>,
    /// Files `hilum models fetch` downloads from the folder of the weights' URL (the same
    /// Hugging Face repository and revision, or the `--url` mirror) into the model's
    /// directory, e.g. `config.json`; a trailing `?` marks one that may be absent upstream.
    #[serde(default)]
    pub fetch_files: Vec<String>,
}

impl Source {
    /// The URL `hilum models fetch` downloads, if any.
    pub fn download_url(&self) -> Option<String> {
        if let Some(u) = &self.url {
            return Some(u.clone());
        }
        match (&self.hf_repo, &self.hf_file) {
            (Some(repo), Some(file)) => Some(format!(
                "{}/{repo}/resolve/{}/{file}",
                crate::DEFAULT_HUB_ENDPOINT,
                self.revision.as_deref().unwrap_or("main")
            )),
            _ => None,
        }
    }

    /// `fetch_files` as (file name, required) pairs.
    pub fn fetch_list(&self) -> Vec<(&str, bool)> {
        self.fetch_files
            .iter()
            .map(|f| match f.strip_suffix('?') {
                Some(name) => (name, false),
                None => (f.as_str(), true),
            })
            .collect()
    }
}

/// What an installation wrote to `install.toml`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct InstallRecord {
    /// Model id.
    pub id: String,
    /// sha256 of `model.safetensors`.
    pub sha256: String,
    /// sha256 of the file that was fetched or imported (before conversion).
    pub source_sha256: String,
    /// URL or local path it came from.
    pub source: String,
    /// A site's own checkpoint of this architecture, not the published weights.
    pub custom: bool,
    /// Seconds since the Unix epoch.
    pub installed_at: u64,
    /// Version of Hilum that installed it.
    pub hilum_version: String,
    /// sha256 of `model.onnx`, when an ONNX graph was imported for the ONNX Runtime backend.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub onnx_sha256: Option<String>,
}

/// An installed model: where its weights are and what the record says.
#[derive(Clone, Debug)]
pub struct InstalledModel {
    /// Path of the installed `model.safetensors`.
    pub weights: PathBuf,
    /// `model.onnx`, when imported (ONNX Runtime backend).
    pub onnx: Option<PathBuf>,
    /// What `install.toml` says.
    pub record: InstallRecord,
    /// Size of the weights in bytes.
    pub size: u64,
}
