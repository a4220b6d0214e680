//! Where a model runs: `cpu`, `cuda[:N]` or `metal[:N]`. The GPU variants parse everywhere but
//! open a device only when Hilum was built with the `cuda` / `metal` cargo feature.

use std::fmt;
use std::str::FromStr;

use crate::ModelError;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Device {
    Cpu,
    Cuda(usize),
    Metal(usize),
}

impl Device {
    /// The best device this build can use: the first CUDA GPU, then Metal, then the CPU.
    pub fn best_available() -> Device {
        #[cfg(feature = "cuda")]
        if candle_core::utils::cuda_is_available() {
            return Device::Cuda(0);
        }
        #[cfg(feature = "metal")]
        if candle_core::utils::metal_is_available() {
            return Device::Metal(0);
        }
        Device::Cpu
    }

    pub fn is_gpu(&self) -> bool {
        !matches!(self, Device::Cpu)
    }

    /// Opens the candle device. Fails with an actionable message when this build lacks the
    /// feature or the machine lacks the GPU.
    pub fn candle(&self) -> Result<candle_core::Device, ModelError> {
        match *self {
            Device::Cpu => Ok(candle_core::Device::Cpu),
            #[cfg(feature = "cuda")]
            Device::Cuda(n) => candle_core::Device::new_cuda(n).map_err(|e| ModelError::Device {
                device: self.to_string(),
                reason: format!("{e}; check the driver with `nvidia-smi` or use --device cpu"),
            }),
            #[cfg(feature = "metal")]
            Device::Metal(n) => candle_core::Device::new_metal(n).map_err(|e| ModelError::Device {
                device: self.to_string(),
                reason: format!("{e}; use --device cpu"),
            }),
            #[allow(unreachable_patterns)]
            other => Err(ModelError::Device {
                device: other.to_string(),
                reason: format!(
                    "this hilum was built without the `{}` feature; rebuild with \
                     `cargo build --release --features {}` or use --device cpu",
                    other.feature(),
                    other.feature()
                ),
            }),
        }
    }

    fn feature(&self) -> &'static str {
        match self {
            Device::Cpu => "cpu",
            Device::Cuda(_) => "cuda",
            Device::Metal(_) => "metal",
        }
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => write!(f, "cpu"),
            Device::Cuda(n) => write!(f, "cuda:{n}"),
            Device::Metal(n) => write!(f, "metal:{n}"),
        }
    }
}

impl FromStr for Device {
    type Err = ModelError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim().to_ascii_lowercase();
        let (kind, index) = match s.split_once(':') {
            Some((k, i)) => (k.to_string(), Some(i.to_string())),
            None => (s.clone(), None),
        };
        let index = match index {
            None => 0,
            Some(i) => i
                .parse::<usize>()
                .map_err(|_| ModelError::BadDevice(s.clone()))?,
        };
        match kind.as_str() {
            "cpu" if index == 0 => Ok(Device::Cpu),
            "cuda" | "gpu" => Ok(Device::Cuda(index)),
            "metal" | "mps" => Ok(Device::Metal(index)),
            _ => Err(ModelError::BadDevice(s)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_device_names() {
        assert_eq!("cpu".parse::<Device>().ok(), Some(Device::Cpu));
        assert_eq!("cuda".parse::<Device>().ok(), Some(Device::Cuda(0)));
        assert_eq!("CUDA:2".parse::<Device>().ok(), Some(Device::Cuda(2)));
        assert_eq!("metal".parse::<Device>().ok(), Some(Device::Metal(0)));
        assert!("tpu".parse::<Device>().is_err());
        assert!("cuda:x".parse::<Device>().is_err());
        assert_eq!(Device::Cuda(1).to_string(), "cuda:1");
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn cuda_without_feature_names_the_rebuild() {
        let err = Device::Cuda(0)
            .candle()
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(err.contains("--features cuda"), "{err}");
        assert!(Device::Cpu.candle().is_ok());
    }
}
