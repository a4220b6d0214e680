//! `hilum models import ID PATH`: installs weights from a local file (air-gapped sites, or a
//! site's own checkpoint with `--custom`). PyTorch `.pt`/`.pth`/`.bin` and Keras `.h5`
//! checkpoints are read in Rust ([`crate::checkpoint`]): no Python, and nothing in the file runs.

use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

use crate::{sha256_file_with, InstallRecord, InstalledModel, ModelError, ModelRegistry};

/// How [`import`] treats a checkpoint copied from elsewhere.
#[derive(Clone, Debug, Default)]
pub struct ImportOptions {
    /// A site's own checkpoint of the architecture: any sha256 is accepted, names and shapes
    /// must still match, and the model is marked custom everywhere.
    pub custom: bool,
    /// Where the file came from, for the record (default: the path).
    pub origin: Option<String>,
}

/// Receives the steps of an import as they start and their byte progress (the CLI draws a
/// bar: hashing, converting and copying a 15 GB checkpoint takes minutes).
pub trait ImportProgress: Send {
    /// A step starts; `total` is its size in bytes when it advances by bytes.
    fn step(&mut self, _what: &str, _total: Option<u64>) {}
    /// `bytes` more of the current step are done.
    fn advance(&mut self, _bytes: u64) {}
}

impl ImportProgress for crate::NoProgress {}

/// Checks, converts and installs `path` as model `id`.
pub fn import(
    registry: &ModelRegistry,
    id: &str,
    path: &Path,
    opts: &ImportOptions,
) -> Result<InstalledModel, ModelError> {
    import_with_progress(registry, id, path, opts, &mut crate::NoProgress)
}

/// [`import`], telling `progress` what it is doing.
pub fn import_with_progress(
    registry: &ModelRegistry,
    id: &str,
    path: &Path,
    opts: &ImportOptions,
    progress: &mut dyn ImportProgress,
) -> Result<InstalledModel, ModelError> {
    let manifest = registry.manifest(id)?;
    if !path.is_file() {
        return Err(ModelError::io(path, "no such file"));
    }
    let size = |p: &Path| std::fs::metadata(p).ok().map(|m| m.len());
    progress.step("checking the file's sha256", size(path));
    let source_sha256 = sha256_file_with(path, &mut |n| progress.advance(n))?;
    if format_of(path, "") == "onnx" {
        return import_onnx(registry, id, path, source_sha256, opts);
    }
    if !opts.custom {
        if let Some(expected) = &manifest.source.sha256 {
            if !expected.eq_ignore_ascii_case(&source_sha256) {
                return Err(ModelError::Checksum {
                    what: path.display().to_string(),
                    expected: expected.clone(),
                    actual: source_sha256,
                    hint: format!(
                        "this is not the published {} of `{id}`; if it is your own checkpoint of \
                         the same architecture, import it with `hilum models import {id} PATH --custom`",
                        manifest.source.file.as_deref().unwrap_or("checkpoint")
                    ),
                });
            }
        }
    }
    if opts.custom && !registry.checks_layout(manifest) {
        return Err(ModelError::WeightsMismatch {
            what: path.display().to_string(),
            architecture: manifest.architecture.clone(),
            details: "Hilum cannot check custom checkpoints of this architecture yet".into(),
        });
    }

    let work = tempfile::tempdir().map_err(|e| ModelError::io(Path::new("temporary dir"), e))?;
    let format = format_of(path, &manifest.source.format);
    let renames = registry.architectures().of(manifest)?.pytorch_renames();
    if format != "safetensors" {
        progress.step("converting to safetensors", None);
    }
    let converted = match format.as_str() {
        "safetensors" => path.to_path_buf(),
        "keras-h5" => {
            let out = work.path().join("model.safetensors");
            crate::checkpoint::keras_to_safetensors(path, &out).map_err(|e| {
                ModelError::Convert {
                    what: path.display().to_string(),
                    reason: e.to_string(),
                }
            })?;
            out
        }
        "pytorch" if renames.is_some() => {
            let out = work.path().join("model.safetensors");
            let renames = renames.as_ref().ok_or_else(|| ModelError::Convert {
                what: path.display().to_string(),
                reason: "no PyTorch reader".into(),
            })?;
            crate::checkpoint::pytorch_to_safetensors(renames, path, &out).map_err(|e| {
                ModelError::Convert {
                    what: path.display().to_string(),
                    reason: e.to_string(),
                }
            })?;
            out
        }
        other => {
            return Err(ModelError::Convert {
                what: path.display().to_string(),
                reason: format!(
                    "{other} checkpoints are converted to safetensors by the scripts in scripts/ \
                     (see models/{id}.toml); import the resulting .safetensors file"
                ),
            })
        }
    };
    progress.step("checking tensor names and shapes", None);
    registry.check_architecture(manifest, &converted)?;

    // A safetensors file is installed as it is: its sha256 is the one already taken.
    let sha256 = if converted == path {
        source_sha256.clone()
    } else {
        progress.step("checking the converted weights' sha256", size(&converted));
        sha256_file_with(&converted, &mut |n| progress.advance(n))?
    };
    let record = InstallRecord {
        id: id.to_string(),
        sha256,
        source_sha256,
        source: opts.origin.clone().unwrap_or_else(|| {
            std::fs::canonicalize(path)
                .unwrap_or_else(|_| path.to_path_buf())
                .display()
                .to_string()
        }),
        custom: opts.custom,
        installed_at: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        hilum_version: env!("CARGO_PKG_VERSION").to_string(),
        onnx_sha256: None,
    };
    progress.step("installing", size(&converted));
    registry.install(id, &converted, &record, &mut |n| progress.advance(n))
}

/// Adds the ONNX graph of an installed model (the ONNX Runtime backend runs it).
fn import_onnx(
    registry: &ModelRegistry,
    id: &str,
    path: &Path,
    sha256: String,
    opts: &ImportOptions,
) -> Result<InstalledModel, ModelError> {
    let manifest = registry.manifest(id)?;
    let installed = registry.installed(id).map_err(|_| ModelError::Convert {
        what: path.display().to_string(),
        reason: format!(
            "an ONNX graph is added to installed weights: first run `hilum models import {id} \
             WEIGHTS` (or `hilum models fetch {id}`), then import the .onnx"
        ),
    })?;
    if !opts.custom && !installed.record.custom {
        match &manifest.source.onnx_sha256 {
            Some(expected) if !expected.eq_ignore_ascii_case(&sha256) => {
                return Err(ModelError::Checksum {
                    what: path.display().to_string(),
                    expected: expected.clone(),
                    actual: sha256,
                    hint: format!(
                        "this is not the published ONNX graph of `{id}`; a graph exported from \
                         your own checkpoint is imported with --custom"
                    ),
                })
            }
            Some(_) => {}
            None => {
                return Err(ModelError::Convert {
                    what: path.display().to_string(),
                    reason: format!(
                        "no published ONNX graph is known for `{id}`; import yours with --custom"
                    ),
                })
            }
        }
    }
    registry.install_onnx(id, path, sha256)
}

/// The checkpoint format, from the extension, else the manifest's source format.
fn format_of(path: &Path, manifest_format: &str) -> String {
    let ext = path
        .extension()
        .and_then(|e| e.to_str())
        .map(str::to_ascii_lowercase);
    match ext.as_deref() {
        Some("safetensors") => "safetensors".into(),
        Some("h5") | Some("hdf5") | Some("keras") => "keras-h5".into(),
        Some("pt") | Some("pth") | Some("bin") => "pytorch".into(),
        Some("onnx") => "onnx".into(),
        _ => manifest_format.to_string(),
    }
}
