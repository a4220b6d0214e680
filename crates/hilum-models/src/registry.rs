//! The model registry: one TOML manifest per model (compiled in from the repository's
//! `models/`), and a models directory holding the installed weights:
//! `<dir>/<id>/model.safetensors` plus `<dir>/<id>/install.toml` (where they came from, their
//! sha256, whether they are a site's custom checkpoint). The registry checks weights against
//! the architectures (it imports them); the manifest types the architectures read live in
//! [`crate::manifest`], so no architecture imports the registry back.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::architecture::{Architecture, Architectures};
use crate::manifest::{InstallRecord, InstalledModel, Manifest};
use crate::{weights, ModelError};

/// The manifests shipped with Hilum, so the binary works from any directory.
const BUILTIN: &[(&str, &str)] = &[
    ("lung-unet", include_str!("../../../models/lung-unet.toml")),
    (
        "densenet121-res224-all",
        include_str!("../../../models/densenet121-res224-all.toml"),
    ),
    (
        "resnet50-res512-all",
        include_str!("../../../models/resnet50-res512-all.toml"),
    ),
    (
        "chestx-det-pspnet",
        include_str!("../../../models/chestx-det-pspnet.toml"),
    ),
    (
        "chexpert-report-findings",
        include_str!("../../../models/chexpert-report-findings.toml"),
    ),
    (
        "chexpert-report-impression",
        include_str!("../../../models/chexpert-report-impression.toml"),
    ),
    (
        "medsam-vit-b",
        include_str!("../../../models/medsam-vit-b.toml"),
    ),
    (
        "llava-med-v1.5",
        include_str!("../../../models/llava-med-v1.5.toml"),
    ),
];

pub const WEIGHTS_FILE: &str = "model.safetensors";
pub const RECORD_FILE: &str = "install.toml";
pub const ONNX_FILE: &str = "model.onnx";

/// One line of `hilum models list`.
#[derive(Clone, Debug)]
pub struct ModelStatus {
    /// The model's manifest.
    pub manifest: Manifest,
    /// Its installation, when installed.
    pub installed: Option<InstalledModel>,
}

/// Result of `hilum models verify` for one model.
#[derive(Clone, Debug)]
pub struct VerifyReport {
    /// Model id.
    pub id: String,
    /// Whether every check passed.
    pub ok: bool,
    /// What failed, one sentence each.
    pub problems: Vec<String>,
}

/// The known models (built-in manifests) and the directory their weights are installed in.
pub struct ModelRegistry {
    dir: PathBuf,
    manifests: BTreeMap<String, Manifest>,
    architectures: Architectures,
}

impl ModelRegistry {
    /// The built-in manifests over the models directory `dir`.
    pub fn new(dir: impl Into<PathBuf>) -> Result<Self, ModelError> {
        let mut manifests = BTreeMap::new();
        for (id, text) in BUILTIN {
            let m: Manifest = toml::from_str(text).map_err(|e| ModelError::Manifest {
                id: id.to_string(),
                reason: e.to_string(),
            })?;
            if m.id != *id {
                return Err(ModelError::Manifest {
                    id: id.to_string(),
                    reason: format!("its id field says `{}`", m.id),
                });
            }
            manifests.insert(m.id.clone(), m);
        }
        Ok(ModelRegistry {
            dir: dir.into(),
            manifests,
            architectures: Architectures::builtin(),
        })
    }

    /// A registry with no manifests.
    pub fn empty(dir: impl Into<PathBuf>) -> Self {
        ModelRegistry {
            dir: dir.into(),
            manifests: BTreeMap::new(),
            architectures: Architectures::builtin(),
        }
    }

    /// The registry with `arch` in its table of architectures (replacing one of its name): a
    /// network of a site's own, or a small one in tests.
    pub fn with_architecture(mut self, arch: impl Architecture + 'static) -> Self {
        self.architectures = self.architectures.with(arch);
        self
    }

    /// The architectures this registry's models are read, checked and exported with.
    pub fn architectures(&self) -> &Architectures {
        &self.architectures
    }

    /// The registry with `manifest` in place of the one with its id (or added): a site's own
    /// configuration of an architecture, or a small network in tests.
    pub fn with_manifest(mut self, manifest: Manifest) -> Self {
        self.manifests.insert(manifest.id.clone(), manifest);
        self
    }

    /// `<user data dir>/hilum/models` (the platform's convention, e.g. `$XDG_DATA_HOME` or
    /// `~/.local/share` on Linux), else `.hilum/models`: the default models dir of the
    /// settings, which the program overrides (`HILUM_MODELS_DIR` in Hilum's CLI).
    pub fn default_dir() -> PathBuf {
        dirs::data_dir()
            .map(|d| d.join("hilum").join("models"))
            .unwrap_or_else(|| PathBuf::from(".hilum/models"))
    }

    /// The models directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Every known model's manifest, by id.
    pub fn manifests(&self) -> impl Iterator<Item = &Manifest> {
        self.manifests.values()
    }

    /// The manifest of `id`, or an error listing the known ids.
    pub fn manifest(&self, id: &str) -> Result<&Manifest, ModelError> {
        self.manifests
            .get(id)
            .ok_or_else(|| ModelError::UnknownModel {
                id: id.to_string(),
                known: self
                    .manifests
                    .keys()
                    .cloned()
                    .collect::<Vec<_>>()
                    .join(", "),
            })
    }

    /// The directory model `id` installs into.
    pub fn model_dir(&self, id: &str) -> PathBuf {
        self.dir.join(id)
    }

    /// The installed weights of `id`, or an error naming the command that installs them.
    pub fn installed(&self, id: &str) -> Result<InstalledModel, ModelError> {
        self.manifest(id)?;
        let dir = self.model_dir(id);
        let weights = dir.join(WEIGHTS_FILE);
        let record_path = dir.join(RECORD_FILE);
        let not_installed = || ModelError::NotInstalled {
            id: id.to_string(),
            dir: self.dir.display().to_string(),
        };
        let size = std::fs::metadata(&weights)
            .map_err(|_| not_installed())?
            .len();
        let text = std::fs::read_to_string(&record_path).map_err(|_| not_installed())?;
        let record: InstallRecord = toml::from_str(&text).map_err(|e| ModelError::Corrupt {
            id: id.to_string(),
            reason: format!("{}: {e}", record_path.display()),
        })?;
        let onnx = Some(dir.join(ONNX_FILE)).filter(|p| p.is_file());
        Ok(InstalledModel {
            weights,
            onnx,
            record,
            size,
        })
    }

    /// Every known model with its installation, by id.
    pub fn status(&self) -> Vec<ModelStatus> {
        self.manifests
            .values()
            .map(|m| ModelStatus {
                manifest: m.clone(),
                installed: self.installed(&m.id).ok(),
            })
            .collect()
    }

    /// Moves converted weights into place (by rename, so readers never see half a file) and
    /// writes the record.
    pub(crate) fn install(
        &self,
        id: &str,
        converted: &Path,
        record: &InstallRecord,
        copied: &mut dyn FnMut(u64),
    ) -> Result<InstalledModel, ModelError> {
        let dir = self.model_dir(id);
        let from = converted.parent().unwrap_or(Path::new("."));
        let companions = &self.manifest(id)?.source.companion_files;
        if let Some(missing) = companions.iter().find(|f| !from.join(f).is_file()) {
            return Err(ModelError::Convert {
                what: converted.display().to_string(),
                reason: format!(
                    "`{id}` needs {missing} beside the weights (see models/{id}.toml for the \
                     conversion command)"
                ),
            });
        }
        std::fs::create_dir_all(&dir).map_err(|e| ModelError::io(&dir, e))?;
        for f in companions {
            let dst = dir.join(f);
            std::fs::copy(from.join(f), &dst).map_err(|e| ModelError::io(&dst, e))?;
        }
        let tmp = dir.join(format!("{WEIGHTS_FILE}.partial"));
        copy_with(converted, &tmp, copied)?;
        let weights = dir.join(WEIGHTS_FILE);
        std::fs::rename(&tmp, &weights).map_err(|e| ModelError::io(&weights, e))?;
        // New weights make an older ONNX graph stale.
        let _ = std::fs::remove_file(dir.join(ONNX_FILE));
        self.write_record(id, record)
    }

    /// Adds an ONNX graph of the installed model (for the ONNX Runtime backend).
    pub(crate) fn install_onnx(
        &self,
        id: &str,
        graph: &Path,
        sha256: String,
    ) -> Result<InstalledModel, ModelError> {
        let inst = self.installed(id)?;
        let dir = self.model_dir(id);
        let tmp = dir.join(format!("{ONNX_FILE}.partial"));
        std::fs::copy(graph, &tmp).map_err(|e| ModelError::io(&tmp, e))?;
        let dst = dir.join(ONNX_FILE);
        std::fs::rename(&tmp, &dst).map_err(|e| ModelError::io(&dst, e))?;
        let mut record = inst.record;
        record.onnx_sha256 = Some(sha256);
        self.write_record(id, &record)
    }

    fn write_record(&self, id: &str, record: &InstallRecord) -> Result<InstalledModel, ModelError> {
        let dir = self.model_dir(id);
        let text = toml::to_string(record).map_err(|e| ModelError::Manifest {
            id: id.to_string(),
            reason: e.to_string(),
        })?;
        let rec = dir.join(RECORD_FILE);
        std::fs::write(&rec, text).map_err(|e| ModelError::io(&rec, e))?;
        self.installed(id)
    }

    /// Recomputes the sha256 of the installed weights and checks their names and shapes
    /// against the architecture.
    pub fn verify(&self, id: &str) -> Result<VerifyReport, ModelError> {
        let manifest = self.manifest(id)?;
        let inst = self.installed(id)?;
        let mut problems = Vec::new();
        let sha = crate::sha256_file(&inst.weights)?;
        if sha != inst.record.sha256 {
            problems.push(format!(
                "sha256 of {} is {sha}, install.toml recorded {} (the file changed after installation)",
                inst.weights.display(),
                inst.record.sha256
            ));
        }
        if let Err(e) = self.check_architecture(manifest, &inst.weights) {
            problems.push(e.to_string());
        }
        if let (Some(onnx), Some(expected)) = (&inst.onnx, &inst.record.onnx_sha256) {
            let sha = crate::sha256_file(onnx)?;
            if &sha != expected {
                problems.push(format!(
                    "sha256 of {} is {sha}, install.toml recorded {expected}",
                    onnx.display()
                ));
            }
        }
        Ok(VerifyReport {
            id: id.to_string(),
            ok: problems.is_empty(),
            problems,
        })
    }
}

impl ModelRegistry {
    /// Fails unless the safetensors file at `path` has exactly the parameters `manifest`'s
    /// architecture expects (those it can state: some read a config beside the weights).
    pub fn check_architecture(&self, manifest: &Manifest, path: &Path) -> Result<(), ModelError> {
        let arch = self.architectures.of(manifest)?;
        let actual = weights::shapes(path)?;
        if let Some(expected) = arch.expected_params(manifest, Some(path))? {
            weights::compare(&expected, &actual).map_err(|details| {
                ModelError::WeightsMismatch {
                    what: path.display().to_string(),
                    architecture: manifest.architecture.clone(),
                    details,
                }
            })?;
        }
        Ok(())
    }

    /// Whether Hilum can check a custom checkpoint of `manifest`: its architecture states its
    /// layout from the manifest alone.
    pub(crate) fn checks_layout(&self, manifest: &Manifest) -> bool {
        self.architectures
            .of(manifest)
            .and_then(|a| a.expected_params(manifest, None))
            .is_ok_and(|p| p.is_some())
    }
}

/// `std::fs::copy` in 8 MiB chunks, telling `copied` after each (weights can be 15 GB).
fn copy_with(from: &Path, to: &Path, copied: &mut dyn FnMut(u64)) -> Result<(), ModelError> {
    use std::io::{Read, Write};
    let mut src = std::fs::File::open(from).map_err(|e| ModelError::io(from, e))?;
    let mut dst = std::fs::File::create(to).map_err(|e| ModelError::io(to, e))?;
    let mut buf = vec![0u8; 8 << 20];
    loop {
        let n = src.read(&mut buf).map_err(|e| ModelError::io(from, e))?;
        if n == 0 {
            break;
        }
        dst.write_all(&buf[..n])
            .map_err(|e| ModelError::io(to, e))?;
        copied(n as u64);
    }
    dst.sync_all().map_err(|e| ModelError::io(to, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtin_manifests_parse_and_name_their_source() {
        let reg = ModelRegistry::new("/nonexistent").expect("manifests parse");
        let ids: Vec<_> = reg.manifests().map(|m| m.id.clone()).collect();
        assert!(ids.contains(&"lung-unet".to_string()), "{ids:?}");
        let unet = reg.manifest("lung-unet").expect("lung-unet");
        assert_eq!(unet.source.format, "keras-h5");
        assert_eq!(unet.source.sha256.as_deref().map(str::len), Some(64));
        let d = reg.manifest("densenet121-res224-all").expect("densenet");
        assert_eq!(d.labels.len(), 18);
        assert!(d.source.download_url().is_some());
    }

    #[test]
    fn fetch_files_are_plain_names_and_optional_ones_end_in_question_mark() {
        let reg = ModelRegistry::new("/nonexistent").expect("manifests parse");
        let report = reg.manifest("chexpert-report-findings").expect("report");
        let list = report.source.fetch_list();
        assert!(list.contains(&("config.json", true)), "{list:?}");
        assert!(list.contains(&("vocab.txt", true)), "{list:?}");
        assert!(list.contains(&("tokenizer_config.json", false)), "{list:?}");
        for m in reg.manifests() {
            for (name, _) in m.source.fetch_list() {
                assert!(
                    !name.is_empty() && !name.contains(['/', '\\', '?']) && name != "..",
                    "{}: {name}",
                    m.id
                );
            }
        }
    }

    #[test]
    fn missing_model_names_the_install_commands() {
        let dir = tempfile::tempdir().expect("tempdir");
        let reg = ModelRegistry::new(dir.path()).expect("registry");
        let err = reg.installed("lung-unet").err().map(|e| e.to_string());
        let err = err.unwrap_or_default();
        assert!(err.contains("hilum models fetch lung-unet"), "{err}");
        assert!(err.contains("hilum models import lung-unet PATH"), "{err}");
        let unknown = reg.installed("nope").err().map(|e| e.to_string());
        assert!(unknown.unwrap_or_default().contains("lung-unet"));
    }
}
