//! Which implementation runs a network: one enum for every model, part of the pool's key.

use serde::{Deserialize, Serialize};

use crate::{Device, ModelError};

/// Which implementation runs a network (`--backend native|candle|onnx|kserve`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// Hilum's own CPU kernels (`hilum-kernels`): the default for the CNNs on the CPU, where
    /// they are as fast as ONNX Runtime and need no runtime library.
    Native,
    /// candle tensors: the default on CUDA and Metal, and the only backend of the
    /// transformer models; on the CPU the (slow) reference path for the CNNs.
    Candle,
    /// ONNX Runtime (`ort`, loaded at run time), on a graph built from the same safetensors
    /// ([`crate::onnx_graph`]) or an imported `model.onnx`; CPU, or TensorRT/CUDA with the
    /// `onnx-gpu` feature.
    Onnx,
    /// A KServe v2 inference server (NVIDIA Triton, KServe, MLServer) runs the forward pass of
    /// the graph `hilum models export-triton` wrote; pre- and postprocessing stay here, so the
    /// output is the one the in-process backends give (see [`crate::kserve`]).
    Kserve,
}

impl Backend {
    pub const ALL: [Backend; 4] = [
        Backend::Native,
        Backend::Candle,
        Backend::Onnx,
        Backend::Kserve,
    ];
    /// The backends that run the network in this process.
    pub const IN_PROCESS: [Backend; 3] = [Backend::Native, Backend::Candle, Backend::Onnx];

    /// Native on the CPU (measured as fast as ONNX Runtime there, with nothing to install),
    /// candle on GPUs; ONNX Runtime only when asked for.
    pub fn default_for(device: Device) -> Backend {
        if device.is_gpu() {
            Backend::Candle
        } else {
            Backend::Native
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Backend::Native => "native",
            Backend::Candle => "candle",
            Backend::Onnx => "onnx",
            Backend::Kserve => "kserve",
        }
    }

    /// An error unless this backend is one of `supported` (for `what`, a model's name).
    pub fn expect(self, supported: &[Backend], what: &str) -> Result<(), ModelError> {
        if supported.contains(&self) {
            return Ok(());
        }
        let names: Vec<&str> = supported.iter().map(|b| b.name()).collect();
        Err(ModelError::Backend {
            what: what.to_string(),
            backend: self,
            supported: names.join(", "),
        })
    }
}

impl std::fmt::Display for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Backend {
    type Err = ModelError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "native" => Ok(Backend::Native),
            "candle" => Ok(Backend::Candle),
            "onnx" | "ort" | "onnxruntime" => Ok(Backend::Onnx),
            "kserve" | "triton" | "remote" => Ok(Backend::Kserve),
            other => Err(ModelError::Compute(format!(
                "unknown backend `{other}`: use native, candle, onnx or kserve"
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_names_and_aliases_and_rejects_others() {
        for b in Backend::ALL {
            assert_eq!(b.name().parse::<Backend>().ok(), Some(b));
        }
        assert_eq!(" ORT ".parse::<Backend>().ok(), Some(Backend::Onnx));
        assert_eq!("Triton".parse::<Backend>().ok(), Some(Backend::Kserve));
        assert!("tensorflow".parse::<Backend>().is_err());
    }

    #[test]
    fn unsupported_backend_names_the_supported_ones() {
        let err = Backend::Onnx
            .expect(&[Backend::Native, Backend::Candle], "chestx-det-pspnet")
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(err.contains("native, candle"), "{err}");
        assert!(Backend::Candle.expect(&[Backend::Candle], "sam").is_ok());
    }
}
