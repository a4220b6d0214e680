//! Where a model runs: `cpu`, `cuda[:N]` or `metal[:N]`, or a [`DeviceSet`] of several
//! (`auto`, `cuda:0,cuda:1`) that the pool spreads calls over. The GPU variants parse everywhere
//! but open a device only when Hilum was built with the `cuda` / `metal` cargo feature.

use std::fmt;
use std::str::FromStr;

use crate::ModelError;

/// Where a model runs: `cpu`, `cuda:N` or `metal:N` (`cuda` and `metal` mean GPU 0).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Device {
    /// The CPU.
    Cpu,
    /// CUDA GPU number N.
    Cuda(usize),
    /// Metal GPU number N.
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

    /// Whether this is a GPU (CUDA or Metal).
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

/// The devices a pool may place models on, in the order they were listed (ties in routing go
/// to the earlier one). Never empty, no device twice, all of one kind: a call's backend is
/// chosen once for the whole set.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct DeviceSet(Vec<Device>);

impl DeviceSet {
    /// The given devices; the same checks as parsing a list.
    pub fn new(devices: impl IntoIterator<Item = Device>) -> Result<Self, ModelError> {
        let devices: Vec<Device> = devices.into_iter().collect();
        let list = || {
            devices
                .iter()
                .map(Device::to_string)
                .collect::<Vec<_>>()
                .join(",")
        };
        let Some(first) = devices.first() else {
            return Err(ModelError::BadDeviceList {
                list: String::new(),
                reason: "no device is listed".into(),
            });
        };
        for (i, d) in devices.iter().enumerate() {
            if devices[..i].contains(d) {
                return Err(ModelError::BadDeviceList {
                    list: list(),
                    reason: format!("{d} is listed twice"),
                });
            }
            if d.feature() != first.feature() {
                return Err(ModelError::BadDeviceList {
                    list: list(),
                    reason: format!("{first} and {d} are of different kinds; list one kind"),
                });
            }
        }
        Ok(DeviceSet(devices))
    }

    /// One device.
    pub fn single(device: Device) -> Self {
        DeviceSet(vec![device])
    }

    /// Every CUDA GPU the driver reports (when built with `cuda`), else the first Metal GPU
    /// (when built with `metal`), else the CPU.
    pub fn auto() -> Self {
        #[cfg(feature = "cuda")]
        {
            // The driver's count opens no context; an absent driver counts as none.
            use candle_core::cuda::cudarc::driver::CudaContext;
            let n = CudaContext::device_count()
                .ok()
                .and_then(|n| usize::try_from(n).ok())
                .unwrap_or(0);
            if n > 0 {
                return DeviceSet((0..n).map(Device::Cuda).collect());
            }
        }
        #[cfg(feature = "metal")]
        if candle_core::utils::metal_is_available() {
            return DeviceSet::single(Device::Metal(0));
        }
        DeviceSet::default()
    }

    /// The devices, in the order given.
    pub fn devices(&self) -> &[Device] {
        &self.0
    }

    /// Number of devices.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Always false (a set has at least one device); here for clippy's `len_without_is_empty`.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The first device: where single-device code runs.
    pub fn first(&self) -> Device {
        self.0.first().copied().unwrap_or(Device::Cpu)
    }

    /// Whether `device` is one of the set.
    pub fn contains(&self, device: Device) -> bool {
        self.0.contains(&device)
    }
}

/// `cpu`: today's default, one device.
impl Default for DeviceSet {
    fn default() -> Self {
        DeviceSet::single(Device::Cpu)
    }
}

impl fmt::Display for DeviceSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, d) in self.0.iter().enumerate() {
            if i > 0 {
                write!(f, ",")?;
            }
            write!(f, "{d}")?;
        }
        Ok(())
    }
}

/// `auto`, one device (`cpu`, `cuda`, `cuda:1`, `metal`) or a comma-separated list of them.
impl FromStr for DeviceSet {
    type Err = ModelError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let text = s.trim();
        if text.eq_ignore_ascii_case("auto") {
            return Ok(DeviceSet::auto());
        }
        let bad = |reason: String| ModelError::BadDeviceList {
            list: text.to_string(),
            reason,
        };
        if text.is_empty() {
            return Err(bad("no device is listed".into()));
        }
        let mut devices = Vec::new();
        for part in text.split(',') {
            let part = part.trim();
            if part.is_empty() {
                return Err(bad("an entry between commas is empty".into()));
            }
            if part.eq_ignore_ascii_case("auto") {
                return Err(bad("`auto` stands alone, not in a list".into()));
            }
            let device = part
                .parse::<Device>()
                .map_err(|_| bad(format!("`{part}` is not a device")))?;
            devices.push(device);
        }
        DeviceSet::new(devices).map_err(|e| match e {
            ModelError::BadDeviceList { reason, .. } => bad(reason),
            other => other,
        })
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

    #[test]
    fn parses_device_lists() {
        let set = |s: &str| s.parse::<DeviceSet>();
        let two = set(" cuda:0 , CUDA:1").expect("list");
        assert_eq!(two.devices(), &[Device::Cuda(0), Device::Cuda(1)]);
        assert_eq!(two.to_string(), "cuda:0,cuda:1");
        assert_eq!(set("cpu").expect("cpu"), DeviceSet::default());
        assert_eq!(set("cuda").expect("cuda").devices(), &[Device::Cuda(0)]);
        assert_eq!(set("metal:0,metal:1").expect("metal").len(), 2);
    }

    #[test]
    fn bad_device_lists_say_what_is_wrong() {
        let reason = |s: &str| match s.parse::<DeviceSet>() {
            Err(ModelError::BadDeviceList { reason, .. }) => reason,
            other => panic!("{s}: {other:?}"),
        };
        assert!(reason("cuda:x").contains("`cuda:x` is not a device"));
        assert!(reason("cuda:0,cuda:1,cuda:0").contains("cuda:0 is listed twice"));
        // `cuda` is `cuda:0`: the same GPU twice.
        assert!(reason("cuda,cuda:0").contains("listed twice"));
        assert!(reason("").contains("no device"));
        assert!(reason("  ").contains("no device"));
        assert!(reason("cuda:0,,cuda:1").contains("empty"));
        assert!(reason("cuda:0,").contains("empty"));
        assert!(reason("cpu,cuda:0").contains("different kinds"));
        assert!(reason("auto,cuda:1").contains("stands alone"));
        assert!(DeviceSet::new([]).is_err());
        let msg = "cuda:0,cuda:0"
            .parse::<DeviceSet>()
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(msg.contains("--device"), "{msg}");
    }

    #[cfg(not(any(feature = "cuda", feature = "metal")))]
    #[test]
    fn auto_without_gpu_features_is_the_cpu() {
        assert_eq!("auto".parse::<DeviceSet>().ok(), Some(DeviceSet::default()));
        assert_eq!(DeviceSet::auto().first(), Device::Cpu);
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
