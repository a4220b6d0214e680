//! An architecture is a value, as a tool is: one [`Architecture`] per network family says
//! everything the rest of Hilum asks about it, and an [`Architectures`] table holds them.
//!
//! - its expected tensors ([`Architecture::expected_params`]) and how a PyTorch checkpoint's
//!   names map onto them ([`Architecture::pytorch_renames`]): `hilum models import` and
//!   `verify` read these;
//! - the backends that run it and the one used when none is chosen
//!   ([`Architecture::backends`], [`Architecture::default_backend`]): the pool resolves every
//!   model's backend from these and the models' settings (`[models.backend]`);
//! - its ONNX graph ([`Architecture::onnx_graph`]): `hilum models export-triton` writes it as
//!   a Triton model (the Triton config comes from the graph's own inputs and outputs);
//! - its device check ([`Architecture::device_check`]): `hilum gpu-check` runs it.
//!
//! The candle model, the native CPU plan and the runner stay in the architecture's model file
//! (`unet.rs`, `pspnet.rs`, `xrv.rs`, ...), where its entry is defined next to them. The
//! registry, import, export and the device check find an entry by the manifest's
//! `architecture` value through the table and never match names themselves. A new
//! architecture is one model file with its entry, a manifest, and one line in
//! [`Architectures::builtin`] (or, outside this crate, [`Architectures::with`] — see
//! `tests/it/new_architecture.rs`, which adds a small network that way).

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use candle_nn::VarBuilder;

use crate::devcheck::{CheckOptions, CheckRow};
use crate::{Backend, Device, InstalledModel, Manifest, ModelError};

/// Parameter names and shapes, in checkpoint naming.
pub type Params = BTreeMap<String, Vec<usize>>;

/// How a PyTorch checkpoint of an architecture becomes Hilum's safetensors file (what the
/// Python converter of `scripts/` did).
#[derive(Clone, Copy, Debug)]
pub struct Renames {
    /// Keys of a wrapping dict tried in turn (`{"state_dict": {...}}`).
    pub unwrap: &'static [&'static str],
    /// The safetensors name of a checkpoint tensor; `None` drops it.
    pub rename: fn(&str) -> Option<String>,
    /// Whether the source file's name is written into the safetensors metadata.
    pub record_source: bool,
}

/// `module.` (DataParallel's prefix) stripped.
pub fn strip_module(name: &str) -> &str {
    name.strip_prefix("module.").unwrap_or(name)
}

/// What ONNX graph Hilum has of an architecture.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Graph {
    /// Written from the installed weights ([`Architecture::onnx_graph`]).
    Built,
    /// Only an imported `model.onnx` (the published export).
    Imported,
    /// None: the architecture runs in process only.
    None,
}

/// One device check: a name for `hilum gpu-check --only` and the check itself.
#[derive(Clone, Copy)]
pub struct DeviceCheck {
    /// Name for `hilum gpu-check --only`.
    pub name: &'static str,
    /// Runs the check and gives its row of the report.
    pub run: fn(&CheckOptions) -> Result<CheckRow, ModelError>,
}

/// Everything Hilum needs to know about one network family. Defaults describe an architecture
/// that runs on candle only, has no checkable layout, no PyTorch reader, no graph and no check.
pub trait Architecture: Send + Sync {
    /// The manifests' `architecture` value this entry answers to.
    fn name(&self) -> &'static str;

    /// The backends that run it.
    fn backends(&self) -> &'static [Backend] {
        &[Backend::Candle]
    }

    /// Whether `backend` runs this installed model (a choice for every model skips the
    /// models it does not run).
    fn supports(&self, backend: Backend, _installed: &InstalledModel) -> bool {
        self.backends().contains(&backend)
    }

    /// The backend used when the settings choose none, from the installed model and the
    /// device the copy is made on.
    fn default_backend(&self, _installed: &InstalledModel, _device: Device) -> Backend {
        Backend::Candle
    }

    /// The parameters the weights must hold for `manifest`, `None` when Hilum cannot say
    /// (`weights`: the file being checked, for architectures configured by a file beside it).
    fn expected_params(
        &self,
        _manifest: &Manifest,
        _weights: Option<&Path>,
    ) -> Result<Option<Params>, ModelError> {
        Ok(None)
    }

    /// How a PyTorch checkpoint is read, when Hilum reads them for this architecture.
    fn pytorch_renames(&self) -> Option<Renames> {
        None
    }

    /// Which ONNX graph Hilum has.
    fn graph(&self) -> Graph {
        Graph::None
    }

    /// The ONNX graph with the weights in `vb` (for [`Graph::Built`]).
    fn onnx_graph(&self, manifest: &Manifest, _vb: VarBuilder) -> Result<Vec<u8>, ModelError> {
        Err(ModelError::Onnx(format!(
            "Hilum builds no ONNX graph for the `{}` architecture of `{}`",
            self.name(),
            manifest.id
        )))
    }

    /// The device parity check of `hilum gpu-check`.
    fn device_checks(&self) -> Vec<DeviceCheck> {
        Vec::new()
    }
}

/// The architectures a registry knows, in the order their device checks run.
#[derive(Clone, Default)]
pub struct Architectures {
    entries: Vec<Arc<dyn Architecture>>,
}

impl std::fmt::Debug for Architectures {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.entries.iter().map(|a| a.name()))
            .finish()
    }
}

impl Architectures {
    /// Hilum's architectures: one line each.
    pub fn builtin() -> Self {
        Architectures::default()
            .with(crate::xrv::XrvArch::DENSENET121)
            .with(crate::xrv::XrvArch::RESNET50)
            .with(crate::unet::LungUnetArch)
            .with(crate::pspnet::PspNetArch)
            .with(crate::sam::SamArch)
            .with(crate::report::ReportArch)
            .with(crate::llava::LlavaArch)
    }

    /// The table with `arch` added (replacing an entry of the same name).
    pub fn with(mut self, arch: impl Architecture + 'static) -> Self {
        self.entries.retain(|a| a.name() != arch.name());
        self.entries.push(Arc::new(arch));
        self
    }

    /// The entry named `name`.
    pub fn get(&self, name: &str) -> Option<&dyn Architecture> {
        self.entries
            .iter()
            .find(|a| a.name() == name)
            .map(|a| a.as_ref())
    }

    /// The entry of `manifest`, or an error naming the known architectures.
    pub fn of(&self, manifest: &Manifest) -> Result<&dyn Architecture, ModelError> {
        self.get(&manifest.architecture)
            .ok_or_else(|| ModelError::Manifest {
                id: manifest.id.clone(),
                reason: format!(
                    "Hilum knows no architecture `{}` (known: {})",
                    manifest.architecture,
                    self.names().join(", ")
                ),
            })
    }

    /// The known architectures' names, in registration order.
    pub fn names(&self) -> Vec<&'static str> {
        self.entries.iter().map(|a| a.name()).collect()
    }

    /// Every known architecture, in registration order.
    pub fn iter(&self) -> impl Iterator<Item = &dyn Architecture> {
        self.entries.iter().map(|a| a.as_ref())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_builtin_manifest_has_an_entry() {
        let table = Architectures::builtin();
        let reg = crate::ModelRegistry::new("/nonexistent").expect("manifests");
        for m in reg.manifests() {
            assert!(table.of(m).is_ok(), "{}: {}", m.id, m.architecture);
        }
        let names = table.names();
        let mut unique = names.clone();
        unique.dedup();
        assert_eq!(names, unique);
    }
}
