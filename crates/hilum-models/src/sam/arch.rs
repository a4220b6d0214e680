//! SAM's entry in the architectures table ([`crate::Architectures`]), next to its model.

use std::path::Path;

use candle_nn::VarBuilder;

use super::{auto_backend, expected_params, Config, Sam};
use crate::architecture::{strip_module, Architecture, DeviceCheck, Graph, Params, Renames};
use crate::{Backend, Device, InstalledModel, Manifest, ModelError};

/// Segment Anything / MedSAM as an architecture: the image encoder runs on
/// candle, ONNX Runtime or a KServe server; it has no native kernels, so `native` (a fallback
/// written for the CNNs) runs it on candle.
pub struct SamArch;

impl Architecture for SamArch {
    fn name(&self) -> &'static str {
        "sam"
    }

    fn backends(&self) -> &'static [Backend] {
        &Backend::ALL
    }

    fn default_backend(&self, _: &InstalledModel, device: Device) -> Backend {
        auto_backend(device)
    }

    fn expected_params(
        &self,
        m: &Manifest,
        _: Option<&Path>,
    ) -> Result<Option<Params>, ModelError> {
        let cfg = Config::from_manifest(m)?;
        expected_params(&cfg).map(Some)
    }

    /// scripts/convert_medsam.py: `{"model"|"state_dict": ..}` unwrapped, `module.` stripped,
    /// the fixed pixel_mean/pixel_std buffers dropped.
    fn pytorch_renames(&self) -> Option<Renames> {
        Some(Renames {
            unwrap: &["model", "state_dict"],
            rename: |k| {
                let name = strip_module(k);
                (name != "pixel_mean" && name != "pixel_std").then(|| name.to_string())
            },
            record_source: false,
        })
    }

    fn graph(&self) -> Graph {
        Graph::Built
    }

    /// The image encoder only: the prompt encoder and mask decoder run in Hilum.
    fn onnx_graph(&self, m: &Manifest, vb: VarBuilder) -> Result<Vec<u8>, ModelError> {
        let cfg = Config::from_manifest(m)?;
        Ok(Sam::load(vb, &cfg)?.encoder_onnx()?)
    }

    fn device_checks(&self) -> Vec<DeviceCheck> {
        vec![DeviceCheck {
            name: "medsam",
            run: crate::devcheck::medsam,
        }]
    }
}
