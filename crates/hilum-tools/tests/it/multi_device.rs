//! The tools across several devices, through the tool layer (toolbox → tool → `run_model` →
//! the pool's routing) with the real lung U-Net. The devices are logical: `cuda:N` entries
//! that stand on the CPU (`ModelSettings::stand_ins`), so calls are routed, counted and
//! permitted per listed device while each copy is made on the CPU; a device without a stand-in
//! that no build here can open is the failing device, and a device in
//! `ModelSettings::forward_faults` loads its copy but fails its forward passes.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use hilum_agent::{Environment, ToolCall, ToolContext, Toolbox};
use hilum_imaging::ImageStore;
use hilum_models::{Backend, Device, ImportOptions, ModelPool, ModelRegistry, ModelSettings};
use hilum_tools::{ToolDeps, ToolSettings};
use serde_json::{json, Value};

const UNET: &str = "lung-unet";
const PSPNET: &str = "chestx-det-pspnet";
const SAM: &str = "medsam-vit-b";

fn data() -> PathBuf {
    let d = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/data");
    assert!(
        d.join("models/lung_seg_unet").is_dir(),
        "real test data missing: expected {}",
        d.display()
    );
    d
}

/// One models dir with the real lung U-Net, imported once for every test here.
fn models_dir() -> &'static Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = tempfile::tempdir().expect("tempdir");
        let reg = ModelRegistry::new(dir.path()).expect("registry");
        let h5 = data().join("models/lung_seg_unet/lung_seg_valiou_088.h5");
        hilum_models::import(&reg, UNET, &h5, &ImportOptions::default()).expect("import");
        dir
    })
    .path()
}

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

/// `id`'s built-in manifest with the small network's configuration from `config` (JSON).
fn small_manifest(reg: &ModelRegistry, id: &str, config: &str) -> hilum_models::Manifest {
    let mut m = reg.manifest(id).expect("built-in manifest").clone();
    let text = std::fs::read_to_string(fixtures().join(config)).expect("small config");
    let json: Value = serde_json::from_str(&text).expect("config JSON");
    match toml::Value::try_from(json) {
        Ok(toml::Value::Table(t)) => m.config = t,
        other => panic!("{config} as a TOML table: {other:?}"),
    }
    m
}

/// The registry over the seeded small PSPNet and SAM from tests/fixtures (the real checkpoints
/// are not on this machine): their manifests give the small configurations, and both are
/// imported once, for every test here, as site checkpoints.
fn small_registry() -> ModelRegistry {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    let dir = DIR
        .get_or_init(|| tempfile::tempdir().expect("tempdir"))
        .path();
    let reg = ModelRegistry::new(dir).expect("registry");
    let psp = small_manifest(&reg, PSPNET, "anatomy/pspnet_small_config.json");
    let sam = small_manifest(&reg, SAM, "medsam/sam_small_config.json");
    let reg = reg.with_manifest(psp).with_manifest(sam);
    static IMPORTED: OnceLock<()> = OnceLock::new();
    IMPORTED.get_or_init(|| {
        let custom = ImportOptions {
            custom: true,
            ..ImportOptions::default()
        };
        for (id, file) in [
            (PSPNET, "anatomy/pspnet_small.safetensors"),
            (SAM, "medsam/sam_small.safetensors"),
        ] {
            hilum_models::import(&reg, id, &fixtures().join(file), &custom).expect("import");
        }
    });
    reg
}

/// A pool over `devices`, each `cuda:N` in `on_cpu` standing on the CPU.
fn pool(devices: &str, on_cpu: &[usize], broken: &[usize]) -> Arc<ModelPool> {
    let reg = ModelRegistry::new(models_dir()).expect("registry");
    pool_over(reg, devices, on_cpu, broken, &[])
}

/// [`pool`] over `reg`, the `cuda:N` in `faulty` failing every forward pass.
fn pool_over(
    reg: ModelRegistry,
    devices: &str,
    on_cpu: &[usize],
    broken: &[usize],
    faulty: &[usize],
) -> Arc<ModelPool> {
    let mut stand_ins: BTreeMap<Device, Device> = on_cpu
        .iter()
        .map(|&n| (Device::Cuda(n), Device::Cpu))
        .collect();
    // A GPU index no machine has: its load fails with a device error, with or without the
    // `cuda` feature.
    for &n in broken {
        stand_ins.insert(Device::Cuda(n), Device::Cuda(4096));
    }
    let settings = ModelSettings {
        devices: devices.parse().expect("device list"),
        stand_ins,
        forward_faults: faulty
            .iter()
            .map(|&n| Device::Cuda(n))
            .collect::<BTreeSet<_>>(),
        // Longer than any test here: a loaded machine must not let a failed device recover
        // before a test has checked that it is passed over.
        device_cooldown: std::time::Duration::from_secs(3600),
        ..ModelSettings::default()
    };
    Arc::new(ModelPool::with_settings(Arc::new(reg), settings))
}

struct Tools {
    toolbox: Arc<Toolbox>,
    env: Environment,
    image: String,
    /// The central half of the image, segment_region's prompt.
    region: [f64; 4],
}

/// The registry's toolbox over `pool` (how every program builds it) with one radiograph. The
/// U-Net's backend is fixed (native) so that a listed GPU does not pick candle for its
/// stand-in, and every pool runs the same network.
fn tools(pool: Arc<ModelPool>) -> Tools {
    let store = Arc::new(ImageStore::default());
    let image = store
        .ingest_file(&data().join("cxr/images/covid_2c35005f.jpg"))
        .expect("ingest");
    let deps = ToolDeps::new(store, pool).with_settings(ToolSettings {
        backends: Ok(hilum_models::BackendChoice::parse("lung-unet=native").expect("choice")),
    });
    let toolbox = hilum_tools::default_toolbox(&deps).expect("toolbox");
    let (w, h) = {
        let img = deps.images.get(&image).expect("image");
        (img.width as f64, img.height as f64)
    };
    Tools {
        toolbox: Arc::new(toolbox),
        env: hilum_tools::environment(&deps, std::slice::from_ref(&image)),
        image,
        region: [w / 4.0, h / 4.0, 3.0 * w / 4.0, 3.0 * h / 4.0],
    }
}

impl Tools {
    /// `n` calls of `tool` at once: each one's output (data without timings, artifact bytes).
    async fn calls(&self, tool: &str, n: usize) -> Vec<(Value, Vec<Vec<u8>>)> {
        let calls: Vec<_> = (0..n)
            .map(|i| {
                let mut args = json!({ "image": self.image });
                if tool == "segment_region" {
                    args["box"] = json!(self.region);
                }
                let (tb, env) = (self.toolbox.clone(), self.env.clone());
                let call = ToolCall::new(format!("c{i}"), tool, &args);
                tokio::spawn(async move {
                    tb.execute(
                        &call,
                        &env,
                        ToolContext::default(),
                        Duration::from_secs(600),
                    )
                    .await
                })
            })
            .collect();
        let mut outs = Vec::new();
        for c in calls {
            let r = c.await.expect("task");
            let out = r.result.unwrap_or_else(|e| panic!("{tool}: {}", e.message));
            let bytes = out.artifacts.iter().map(|a| a.bytes.to_vec()).collect();
            outs.push((without_timings(out.data), bytes));
        }
        outs
    }
}

/// The output with its timings (`*_ms`) removed: they differ from call to call.
fn without_timings(mut v: Value) -> Value {
    match &mut v {
        Value::Object(m) => {
            m.retain(|k, _| !k.ends_with("_ms"));
            for x in m.values_mut() {
                *x = without_timings(x.take());
            }
        }
        Value::Array(a) => {
            for x in a.iter_mut() {
                *x = without_timings(x.take());
            }
        }
        _ => {}
    }
    v
}

/// Each tool's output on the plain CPU pool (one device, the default settings).
async fn reference(tool: &str) -> (Value, Vec<Vec<u8>>) {
    static CPU: OnceLock<Arc<ModelPool>> = OnceLock::new();
    let pool = CPU.get_or_init(|| pool("cpu", &[], &[])).clone();
    tools(pool).calls(tool, 1).await.remove(0)
}

fn stats(pool: &ModelPool, device: Device) -> hilum_models::DeviceStats {
    pool.device_stats()
        .into_iter()
        .find(|s| s.device == device)
        .expect("a device of the set")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_tool_calls_spread_over_the_devices_within_their_permits() {
    let pool = pool("cuda:0,cuda:1", &[0, 1], &[]);
    let tools = tools(pool.clone());
    for tool in ["segment_lungs", "measure_chest"] {
        let want = reference(tool).await;
        let outs = tools.calls(tool, 4).await;
        for out in &outs {
            assert_eq!(out, &want, "{tool}: a routed call differs from the CPU's");
        }
    }
    // Four calls at once on two one-permit devices: the second finds the first device busy
    // and loads a replica on the other; the rest queue on both.
    let (a, b) = (stats(&pool, Device::Cuda(0)), stats(&pool, Device::Cuda(1)));
    eprintln!("{a:?}\n{b:?}");
    assert_eq!(a.calls + b.calls, 8);
    assert!(
        a.calls >= 2 && b.calls >= 2,
        "calls did not spread: {a:?} {b:?}"
    );
    assert_eq!((a.peak, b.peak), (1, 1), "a GPU ran two passes at once");
    assert_eq!(pool.replicas(UNET), vec![Device::Cuda(0), Device::Cuda(1)]);
    let loads = pool.load_counts();
    for d in ["cuda:0", "cuda:1"] {
        assert_eq!(
            loads.get(&(UNET.to_string(), d.to_string())),
            Some(&1),
            "{d}"
        );
    }
    assert_eq!(a.models, vec![UNET.to_string()]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_that_fails_to_load_moves_tool_calls_to_another_device() {
    // cuda:1 is listed first, so a lone call goes there first; it cannot load the model.
    let pool = pool("cuda:1,cuda:0,cuda:2", &[0, 2], &[1]);
    let tools = tools(pool.clone());
    let want = reference("segment_lungs").await;
    let first = tools.calls("segment_lungs", 1).await;
    assert_eq!(first[0], want, "the moved call differs from the CPU's");
    assert_eq!(stats(&pool, Device::Cuda(1)).failures, 1);
    assert!(!pool.is_healthy(Device::Cuda(1)));
    assert_eq!(pool.replicas(UNET), vec![Device::Cuda(0)]);

    // While it cools down, concurrent calls use the two working devices only.
    let outs = tools.calls("segment_lungs", 4).await;
    for out in &outs {
        assert_eq!(out, &want);
    }
    let (bad, a, b) = (
        stats(&pool, Device::Cuda(1)),
        stats(&pool, Device::Cuda(0)),
        stats(&pool, Device::Cuda(2)),
    );
    eprintln!("{bad:?}\n{a:?}\n{b:?}");
    assert_eq!(bad.calls, 1, "a cooling device took another call");
    assert!(
        a.calls >= 1 && b.calls >= 1,
        "calls did not spread: {a:?} {b:?}"
    );
    assert_eq!(a.calls + b.calls, 5);
    assert!(a.peak <= 1 && b.peak <= 1);
    assert_eq!(pool.replicas(UNET), vec![Device::Cuda(0), Device::Cuda(2)]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tool_pinned_to_a_device_stays_there() {
    let pool = pool("cuda:0,cuda:1", &[0, 1], &[]);
    let store = Arc::new(ImageStore::default());
    let image = store
        .ingest_file(&data().join("cxr/images/covid_2c35005f.jpg"))
        .expect("ingest");
    let native = Some(Backend::Native);
    let tool =
        hilum_tools::SegmentLungs::on_device(store, pool.clone(), Some(Device::Cuda(1)), native);
    let out = hilum_agent::Tool::call(&tool, &ToolContext::default(), json!({ "image": image }))
        .await
        .expect("call");
    assert_eq!(
        without_timings(out.data),
        reference("segment_lungs").await.0
    );
    assert_eq!(stats(&pool, Device::Cuda(1)).calls, 1);
    assert_eq!(stats(&pool, Device::Cuda(0)).calls, 0);
}

/// A device whose forward passes fail (cuda:0: its copy loads, every pass on it fails as a GPU
/// out of memory would) moves `tool`'s call, on `model` from `registry`, to the other device.
/// The failure starts inside the network, so a tool that turned it into its own error would
/// fail the call instead.
async fn a_failing_forward_pass_moves_the_call(
    tool: &str,
    model: &str,
    registry: fn() -> ModelRegistry,
) {
    let want = tools(pool_over(registry(), "cpu", &[], &[], &[]))
        .calls(tool, 1)
        .await
        .remove(0);
    let pool = pool_over(registry(), "cuda:0,cuda:1", &[0, 1], &[], &[0]);
    let got = tools(pool.clone()).calls(tool, 1).await.remove(0);
    assert_eq!(got, want, "{tool}: the moved call differs from the CPU's");
    let (bad, good) = (stats(&pool, Device::Cuda(0)), stats(&pool, Device::Cuda(1)));
    eprintln!("{tool}\n{bad:?}\n{good:?}");
    assert_eq!((bad.calls, bad.failures), (1, 1), "{tool} on cuda:0");
    assert_eq!((good.calls, good.failures), (1, 0), "{tool} on cuda:1");
    assert!(!pool.is_healthy(Device::Cuda(0)));
    // The failed device's copy is dropped: only the device that answered holds the model.
    assert_eq!(pool.replicas(model), vec![Device::Cuda(1)]);
    assert_eq!(pool.load_count(model), 2, "one load per device");
}

fn lung_registry() -> ModelRegistry {
    ModelRegistry::new(models_dir()).expect("registry")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forward_pass_failing_in_segment_anatomy_moves_the_call() {
    a_failing_forward_pass_moves_the_call("segment_anatomy", PSPNET, small_registry).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forward_pass_failing_in_segment_region_moves_the_call() {
    a_failing_forward_pass_moves_the_call("segment_region", SAM, small_registry).await;
}

/// measure_chest measures on the anatomy model when it is installed, as here.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forward_pass_failing_in_anatomy_measure_chest_moves_the_call() {
    a_failing_forward_pass_moves_the_call("measure_chest", PSPNET, small_registry).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forward_pass_failing_in_segment_lungs_moves_the_call() {
    a_failing_forward_pass_moves_the_call("segment_lungs", UNET, lung_registry).await;
}
