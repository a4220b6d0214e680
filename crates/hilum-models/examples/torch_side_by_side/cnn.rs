//! torchxrayvision's DenseNet-121 and ResNet-50 (PyTorch side: torchvision's networks).

use hilum_models::xrv::{self, Classifier, XrvSpec};
use hilum_models::{Backend, Device};

use crate::{Forward, Res};

fn spec(arch: &str) -> Res<XrvSpec> {
    match arch {
        "densenet121" => Ok(XrvSpec::densenet121_res224_all()),
        "resnet50" => Ok(XrvSpec::resnet50_res512_all()),
        other => Err(format!(
            "unknown architecture `{other}`: densenet121, resnet50, lung-unet, sam-vit-b, \
             sam-tiny, qwen2-0.5b, qwen2-tiny, gemma3-4b-slice or gemma3-tiny"
        )
        .into()),
    }
}

/// The seeded weights of the tests and `hilum gpu-check` (seed 3); the config is the name.
pub fn weights(arch: &str, out: &std::path::Path) -> Res<String> {
    let weights = xrv::synthetic_weights(&spec(arch)?.arch, 3)?;
    candle_core::safetensors::save(&weights, out)?;
    Ok(format!("{{\"arch\": \"{arch}\"}}"))
}

/// Whether `arch` is one of the torchxrayvision CNNs.
pub fn is_cnn(arch: &str) -> bool {
    spec(arch).is_ok()
}

/// The classifier on `backend`; with `f16`, candle's forward in f16 (weights and activations;
/// logits in f32).
pub fn load(
    arch: &str,
    size: usize,
    weights: &std::path::Path,
    device: Device,
    backend: Backend,
    f16: bool,
) -> Res<Classifier> {
    let spec = XrvSpec {
        resolution: size,
        ..spec(arch)?
    };
    let vb = hilum_models::weights::var_builder(weights, device)?;
    if !f16 {
        let threads = hilum_models::kernels::all_cores();
        return Ok(Classifier::new(vb, spec, backend, threads)?);
    }
    if backend != Backend::Candle {
        return Err(format!("f16 runs on candle, not {backend}").into());
    }
    Ok(Classifier::candle_with_dtype(
        vb,
        spec,
        candle_core::DType::F16,
    )?)
}

impl Forward for Classifier {
    fn forward(&self, x: &[f32], batch: usize) -> Res<(Vec<f32>, Vec<usize>)> {
        let logits = self.logits(x, batch)?;
        let k = logits.len() / batch;
        Ok((logits, vec![batch, k]))
    }
}
