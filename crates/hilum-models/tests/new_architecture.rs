//! A new architecture added as one model file (this one: the network, its `Model` impl and its
//! `Architecture` entry), its manifest (`new_architecture.toml`) and one table line
//! (`with_architecture` below), with no change anywhere else; then run through what every
//! architecture goes through: import (its tensors checked), the pool on candle, `export-triton`
//! (its ONNX graph, equal to candle on ONNX Runtime when the runtime is here) and the device
//! check of `hilum gpu-check`.

use std::path::Path;
use std::sync::Arc;

use candle_core::{Module, Tensor};
use candle_nn::{Conv2d, Conv2dConfig, Linear, VarBuilder};
use hilum_models::architecture::{Architecture, DeviceCheck, Graph, Params, Renames};
use hilum_models::devcheck::{self, CheckOptions, CheckRow};
use hilum_models::onnx_graph::{GraphBuilder, INPUT};
use hilum_models::triton::{export_triton, ExportOptions, Exported};
use hilum_models::{
    Backend, BackendChoice, Device, InstalledModel, Manifest, ModelError, ModelPool, ModelRegistry,
    ModelSettings,
};

// ---- The model file -------------------------------------------------------------------------

#[derive(Clone, Debug, serde::Deserialize)]
struct Config {
    channels: usize,
    classes: usize,
    size: usize,
}

impl Config {
    fn from_manifest(m: &Manifest) -> Result<Self, ModelError> {
        toml::Value::Table(m.config.clone())
            .try_into()
            .map_err(|e| ModelError::Manifest {
                id: m.id.clone(),
                reason: format!("[config]: {e}"),
            })
    }
}

/// conv 3x3 (1 → channels) → ReLU → global average pool → linear (channels → classes).
struct TinyNet {
    cfg: Config,
    conv: Conv2d,
    head: Linear,
}

impl TinyNet {
    fn load(vb: VarBuilder, cfg: &Config) -> candle_core::Result<Self> {
        let same = Conv2dConfig {
            padding: 1,
            ..Default::default()
        };
        Ok(TinyNet {
            cfg: cfg.clone(),
            conv: candle_nn::conv2d(1, cfg.channels, 3, same, vb.pp("conv"))?,
            head: candle_nn::linear(cfg.channels, cfg.classes, vb.pp("head"))?,
        })
    }

    fn to_onnx(&self) -> candle_core::Result<Vec<u8>> {
        let mut g = GraphBuilder::new("tiny_cnn");
        let y = g.conv2d("conv", &self.conv, INPUT)?;
        let y = g.relu(&y);
        let y = g.global_avg_pool(&y);
        let logits = g.linear("head", &self.head, &y)?;
        let (size, classes) = (self.cfg.size, self.cfg.classes);
        Ok(g.finish_classifier(&logits, 1, size, classes, "tiny test CNN"))
    }
}

impl Module for TinyNet {
    /// (b, 1, s, s) → (b, classes)
    fn forward(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        xs.apply(&self.conv)?
            .relu()?
            .mean((2, 3))?
            .apply(&self.head)
    }
}

impl hilum_models::Model for TinyNet {
    fn load(
        manifest: &Manifest,
        installed: &InstalledModel,
        device: Device,
        backend: Backend,
        _: &ModelSettings,
    ) -> Result<Self, ModelError> {
        backend.expect(&[Backend::Candle], &manifest.id)?;
        let vb = hilum_models::weights::var_builder(&installed.weights, device)?;
        Ok(TinyNet::load(vb, &Config::from_manifest(manifest)?)?)
    }
}

fn params(cfg: &Config) -> Params {
    let (c, k) = (cfg.channels, cfg.classes);
    [
        ("conv.weight", vec![c, 1, 3, 3]),
        ("conv.bias", vec![c]),
        ("head.weight", vec![k, c]),
        ("head.bias", vec![k]),
    ]
    .into_iter()
    .map(|(n, s)| (n.to_string(), s))
    .collect()
}

/// Its device check: the same seeded network on the reference and the target device.
fn device_check(o: &CheckOptions) -> Result<CheckRow, ModelError> {
    let cfg = Config {
        channels: 4,
        classes: 2,
        size: 32,
    };
    let weights = hilum_models::weights::seeded(&params(&cfg), 5);
    let x: Vec<f32> = (0..cfg.size * cfg.size)
        .map(|i| (i % 7) as f32 - 3.0)
        .collect();
    let run = |d: Device| -> Result<Vec<f32>, ModelError> {
        let net = TinyNet::load(devcheck::vb_on(&weights, d)?, &cfg)?;
        let t = Tensor::from_slice(&x, (1, 1, cfg.size, cfg.size), &d.candle()?)?;
        Ok(net.forward(&t)?.flatten_all()?.to_vec1::<f32>()?)
    };
    let (a, b) = (run(o.reference)?, run(o.target)?);
    Ok(devcheck::row(
        "tiny-cnn",
        "logits",
        devcheck::rel_diff(&a, &b),
        1e-4,
    ))
}

/// The architecture's entry.
struct TinyArch;

impl Architecture for TinyArch {
    fn name(&self) -> &'static str {
        "tiny-cnn"
    }

    fn expected_params(
        &self,
        m: &Manifest,
        _: Option<&Path>,
    ) -> Result<Option<Params>, ModelError> {
        Ok(Some(params(&Config::from_manifest(m)?)))
    }

    fn pytorch_renames(&self) -> Option<Renames> {
        Some(Renames {
            unwrap: &["state_dict"],
            rename: |k| Some(hilum_models::architecture::strip_module(k).to_string()),
            record_source: false,
        })
    }

    fn graph(&self) -> Graph {
        Graph::Built
    }

    fn onnx_graph(&self, m: &Manifest, vb: VarBuilder) -> Result<Vec<u8>, ModelError> {
        Ok(TinyNet::load(vb, &Config::from_manifest(m)?)?.to_onnx()?)
    }

    fn device_checks(&self) -> Vec<DeviceCheck> {
        vec![DeviceCheck {
            name: "tiny-cnn",
            run: device_check,
        }]
    }
}

// ---- The test -------------------------------------------------------------------------------

const ID: &str = "tiny-cnn";

fn registry(dir: &Path) -> ModelRegistry {
    let manifest: Manifest =
        toml::from_str(include_str!("new_architecture.toml")).expect("the manifest parses");
    ModelRegistry::new(dir)
        .expect("registry")
        .with_architecture(TinyArch) // the one table line
        .with_manifest(manifest)
}

#[test]
fn a_new_architecture_goes_through_import_candle_export_and_the_device_check() {
    let dir = tempfile::tempdir().expect("tempdir");
    let registry = registry(&dir.path().join("models"));
    let manifest = registry.manifest(ID).expect("manifest").clone();
    let cfg = Config::from_manifest(&manifest).expect("config");

    // Import: a checkpoint missing a tensor is refused by the entry's layout; the right one
    // installs and verifies.
    let weights = hilum_models::weights::seeded(&params(&cfg), 9);
    let mut short = weights.clone();
    short.remove("head.bias");
    let bad = dir.path().join("short.safetensors");
    candle_core::safetensors::save(&short, &bad).expect("save");
    let opts = hilum_models::ImportOptions {
        custom: true,
        ..Default::default()
    };
    let err = hilum_models::import(&registry, ID, &bad, &opts).expect_err("a missing tensor");
    assert!(
        matches!(&err, ModelError::WeightsMismatch { details, .. } if details.contains("head.bias")),
        "{err}"
    );
    let good = dir.path().join("tiny.safetensors");
    candle_core::safetensors::save(&weights, &good).expect("save");
    hilum_models::import(&registry, ID, &good, &opts).expect("import");
    assert!(registry.verify(ID).expect("verify").ok);

    // Candle, through the pool: its backend resolved from the table (no setting names it).
    let pool = Arc::new(ModelPool::new(Arc::new(registry)));
    let installed = pool.registry().installed(ID).expect("installed");
    let choice = BackendChoice::every(Backend::Native);
    let backend = pool
        .backend_for(ID, &installed, Device::Cpu, &choice)
        .expect("backend");
    assert_eq!(
        backend,
        Backend::Candle,
        "`*` = native skips a candle-only model"
    );
    let net = pool
        .get_or_load::<TinyNet>(ID, Device::Cpu, backend)
        .expect("loads on candle");
    let s = cfg.size;
    let x: Vec<f32> = (0..2 * s * s)
        .map(|i| ((i * 37) % 19) as f32 / 9.0 - 1.0)
        .collect();
    let logits = net
        .forward(&Tensor::from_slice(&x, (2, 1, s, s), &candle_core::Device::Cpu).expect("x"))
        .and_then(|t| t.flatten_all()?.to_vec1::<f32>())
        .expect("forward");
    assert_eq!(logits.len(), 2 * cfg.classes);

    // export-triton: the entry's graph, its Triton config from the graph's tensors.
    let repo = dir.path().join("repo");
    let done = export_triton(
        pool.registry(),
        &repo,
        &[ID.to_string()],
        &ExportOptions::default(),
    )
    .expect("export");
    assert!(
        matches!(
            &done[..],
            [Exported::Written {
                max_batch_size: 16,
                ..
            }]
        ),
        "{done:?}"
    );
    let config = std::fs::read_to_string(repo.join(ID).join("config.pbtxt")).expect("config");
    assert!(
        config.contains("dims: [ 1, 32, 32 ]") && config.contains("dims: [ 2 ]"),
        "{config}"
    );
    let graph = std::fs::read(repo.join(ID).join("1/model.onnx")).expect("graph");
    match std::env::var_os("ORT_DYLIB_PATH").filter(|p| !p.is_empty()) {
        Some(lib) => {
            hilum_models::onnx::use_runtime(lib.into());
            let ort = hilum_models::onnx::OnnxModel::from_memory(&graph, ID, 1, Device::Cpu)
                .expect("ONNX Runtime loads the graph");
            let (shape, out) = ort.run(&[2, 1, s, s], &x).expect("run");
            assert_eq!(shape, vec![2, cfg.classes]);
            let diff = out
                .iter()
                .zip(&logits)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(diff < 1e-5, "ONNX Runtime vs candle: {diff}");
        }
        None => eprintln!("ONNX Runtime not here (ORT_DYLIB_PATH): the graph is not run"),
    }

    // The device check of `hilum gpu-check`, among the table's checks.
    let opts = CheckOptions {
        reference: Device::Cpu,
        target: Device::Cpu,
        quick: true,
        iterations: 1,
        image: None,
        unet_weights: None,
        only: vec![ID.to_string()],
    };
    let rows = devcheck::run_with(&opts, pool.registry().architectures(), |_| {});
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert!(rows[0].passed && rows[0].model == ID, "{:?}", rows[0]);
}
