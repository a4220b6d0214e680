//! `classify_chest_xray` and `segment_lungs` through the kserve backend against a real Triton
//! Inference Server on 127.0.0.1 (PyTriton's tritonserver from scripts/setup_triton.sh, serving
//! the repository `export_triton` wrote, each graph run by ONNX Runtime in its callable): the
//! outputs equal the native backend's; Triton killed mid-run gives the clear error, keeps the
//! results already returned, and with `fallback` the call runs in process instead.
//!
//! The models' settings route one model to the server: with `[models.backend] lung-unet =
//! "kserve"` `segment_lungs` and `measure_chest` both run the U-Net there, and with
//! `chestx-det-pspnet = "kserve"` `segment_anatomy` and `measure_chest` run the anatomy PSPNet
//! there — no tool is told a backend.
//!
//! Classifier: seeded DenseNet-121 weights imported as a site checkpoint. Anatomy PSPNet: the
//! small seeded configuration of tests/fixtures/anatomy. Lung U-Net: the real
//! one, copied from the installed models (HILUM_MODELS_DIR or ~/.local/share/hilum/models) or
//! imported from ../shared/data/models/lung_seg_unet. MedSAM: the small SAM configuration that
//! matches segment-anything (tests/fixtures/medsam), its image encoder served, its decoder here.

use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hilum_agent::{Tool, ToolContext, ToolOutput};
use hilum_imaging::ImageStore;
use hilum_models::sam::Sam;
use hilum_models::triton::{export_triton, ExportOptions, Exported};
use hilum_models::unet::{self, LungSegmenter};
use hilum_models::xrv::{self, XrvSpec};
use hilum_models::{
    Backend, BackendChoice, Device, KserveSettings, ModelPool, ModelRegistry, ModelSettings,
};
use hilum_tools::{
    ClassifyChestXray, ImageInfo, MeasureChest, SegmentAnatomy, SegmentLungs, SegmentRegion,
};
use serde_json::{json, Value};

const CLASSIFIER: &str = "densenet121-res224-all";
const LUNGS: &str = "lung-unet";
const MEDSAM: &str = "medsam-vit-b";
const ANATOMY: &str = "chestx-det-pspnet";
const TOLERANCE: f64 = 1e-5;

type Shared = Arc<dyn Tool>;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn shared() -> PathBuf {
    root().join("../shared/data")
}

/// The ONNX Runtime library the server's callables use (ORT_DYLIB_PATH when set).
fn ort_library(python: &Path) -> PathBuf {
    if let Some(p) = std::env::var_os("ORT_DYLIB_PATH").filter(|p| !p.is_empty()) {
        return p.into();
    }
    let venv = python
        .parent()
        .and_then(Path::parent)
        .expect("venv of bin/python");
    venv.join("lib/python3.12/site-packages/onnxruntime/capi/libonnxruntime.so.1.31.1")
}

/// A Triton server in its own process group, killed with the group when dropped.
struct Triton {
    child: Child,
    url: String,
}

impl Triton {
    /// Starts the server and waits for its ready file: the script's `ready` line shares stdout
    /// with tritonserver's own log threads and can arrive spliced into one of their lines.
    fn start(python: &Path, repo: &Path, workspace: &Path) -> Triton {
        let port = || {
            std::net::TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .map(|a| a.port())
                .expect("a free port")
        };
        let (http, grpc, metrics) = (port(), port(), port());
        let ready = workspace.with_file_name("triton-ready");
        let mut child = Command::new(python)
            .arg(root().join("scripts/deploy/triton_serve.py"))
            .arg(repo)
            .args(["--http-port", &http.to_string()])
            .args(["--grpc-port", &grpc.to_string()])
            .args(["--metrics-port", &metrics.to_string()])
            .args(["--threads", "1"])
            .arg("--workspace")
            .arg(workspace)
            .arg("--ready-file")
            .arg(&ready)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()
            .expect("start scripts/deploy/triton_serve.py");
        let stdout = child.stdout.take().expect("piped stdout");
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                eprintln!("triton_serve: {line}");
            }
        });
        let mut server = Triton {
            child,
            url: format!("http://127.0.0.1:{http}"),
        };
        let deadline = Instant::now() + Duration::from_secs(240);
        loop {
            match std::fs::read_to_string(&ready) {
                Ok(url) => {
                    assert_eq!(url.trim(), server.url, "the ready file names the server");
                    return server;
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => panic!("read {}: {e}", ready.display()),
            }
            if let Ok(Some(status)) = server.child.try_wait() {
                panic!("scripts/deploy/triton_serve.py exited before it was ready: {status}");
            }
            assert!(
                Instant::now() < deadline,
                "Triton did not report ready within 240 s"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// SIGKILL to the whole group: tritonserver and its Python backend stubs go too.
    fn kill(&mut self) {
        let group = format!("-{}", self.child.id());
        let _ = Command::new("kill").args(["-KILL", "--", &group]).status();
        let _ = self.child.wait();
    }
}

impl Drop for Triton {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The lung U-Net with its ONNX graph, installed into `registry`.
fn install_lung_unet(registry: &ModelRegistry) {
    let home = std::env::var_os("HILUM_MODELS_DIR")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".local/share/hilum/models"))
        });
    if let Some(installed) = home
        .map(|d| d.join(LUNGS))
        .filter(|d| d.join("model.onnx").is_file())
    {
        let to = registry.model_dir(LUNGS);
        std::fs::create_dir_all(&to).expect("mkdir");
        for f in ["install.toml", "model.safetensors", "model.onnx"] {
            std::fs::copy(installed.join(f), to.join(f)).expect("copy the installed lung U-Net");
        }
        return;
    }
    let dir = shared().join("models/lung_seg_unet");
    let opts = hilum_models::ImportOptions::default();
    hilum_models::import(registry, LUNGS, &dir.join("lung_seg_valiou_088.h5"), &opts)
        .expect("import the lung U-Net (.h5)");
    hilum_models::import(
        registry,
        LUNGS,
        &dir.join("lung_seg_valiou_088.onnx"),
        &opts,
    )
    .expect("import the lung U-Net's ONNX graph");
}

/// A model's small test configuration (a JSON file of tests/fixtures) as its manifest's
/// `[config]`.
fn with_config(registry: ModelRegistry, id: &str, json: &Path) -> ModelRegistry {
    let config: toml::Value =
        serde_json::from_str(&std::fs::read_to_string(json).expect("config")).expect("parses");
    let mut manifest = registry.manifest(id).expect("manifest").clone();
    manifest.config = match config {
        toml::Value::Table(t) => t,
        other => panic!("not a table: {other}"),
    };
    registry.with_manifest(manifest)
}

/// The classifier, the lung U-Net, MedSAM and, with `anatomy`, the anatomy PSPNet installed.
fn registry(dir: &Path, anatomy: bool) -> ModelRegistry {
    std::fs::create_dir_all(dir).expect("mkdir");
    let registry = ModelRegistry::new(dir.join("models")).expect("registry");
    let w = xrv::synthetic_weights(&XrvSpec::densenet121_res224_all().arch, 3).expect("weights");
    let ckpt = dir.join("site_densenet.safetensors");
    candle_core::safetensors::save(&w, &ckpt).expect("save checkpoint");
    let opts = hilum_models::ImportOptions {
        custom: true,
        ..Default::default()
    };
    hilum_models::import(&registry, CLASSIFIER, &ckpt, &opts).expect("custom import");
    install_lung_unet(&registry);
    // MedSAM at the small configuration of its fixture (the published weights are not here).
    let sam = root().join("tests/fixtures/medsam");
    let registry = with_config(registry, MEDSAM, &sam.join("sam_small_config.json"));
    hilum_models::import(&registry, MEDSAM, &sam.join("sam_small.safetensors"), &opts)
        .expect("MedSAM import");
    // The anatomy PSPNet likewise.
    let psp = root().join("tests/fixtures/anatomy");
    let registry = with_config(registry, ANATOMY, &psp.join("pspnet_small_config.json"));
    if anatomy {
        hilum_models::import(
            &registry,
            ANATOMY,
            &psp.join("pspnet_small.safetensors"),
            &opts,
        )
        .expect("PSPNet import");
    }
    registry
}

fn pool(dir: &Path, url: &str, fallback: Option<Backend>) -> Arc<ModelPool> {
    routed_pool(dir, url, fallback, BackendChoice::default(), true)
}

/// A pool whose models' settings choose `backends`.
fn routed_pool(
    dir: &Path,
    url: &str,
    fallback: Option<Backend>,
    backends: BackendChoice,
    anatomy: bool,
) -> Arc<ModelPool> {
    let mut remote = KserveSettings::new(url);
    remote.fallback = fallback;
    remote.retries = 1;
    let settings = ModelSettings {
        remote: Some(remote),
        backends: Ok(backends),
        ..Default::default()
    };
    Arc::new(ModelPool::with_settings(
        Arc::new(registry(dir, anatomy)),
        settings,
    ))
}

async fn call(tool: &dyn Tool, args: Value) -> Result<ToolOutput, String> {
    tool.call(&ToolContext::default(), args)
        .await
        .map_err(|e| e.to_string())
}

/// The outputs of one tool on two backends agree: every number within `TOLERANCE`, every
/// other value equal; timings and the backend's name are left out.
fn assert_same(a: &Value, b: &Value, path: &str) {
    const RUN_FIELDS: [&str; 6] = [
        "backend",
        "latency_ms",
        "load_ms",
        "inference_ms",
        "onnx_graph",
        "fallback",
    ];
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            let keys = |o: &serde_json::Map<String, Value>| -> Vec<String> {
                o.keys()
                    .filter(|k| !RUN_FIELDS.contains(&k.as_str()))
                    .cloned()
                    .collect()
            };
            assert_eq!(keys(x), keys(y), "{path}: fields differ");
            for k in keys(x) {
                assert_same(&x[&k], &y[&k], &format!("{path}.{k}"));
            }
        }
        (Value::Array(x), Value::Array(y)) => {
            assert_eq!(x.len(), y.len(), "{path}: lengths differ");
            for (i, (p, q)) in x.iter().zip(y).enumerate() {
                assert_same(p, q, &format!("{path}[{i}]"));
            }
        }
        (Value::Number(p), Value::Number(q)) => {
            let (p, q) = (
                p.as_f64().unwrap_or(f64::NAN),
                q.as_f64().unwrap_or(f64::NAN),
            );
            assert!((p - q).abs() <= TOLERANCE, "{path}: {p} vs {q}");
        }
        _ => assert_eq!(a, b, "{path}"),
    }
}

fn max_diff(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs() as f64)
        .fold(0.0, f64::max)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn triton_serves_the_cnns_with_native_outputs_and_its_loss_is_a_clear_error() {
    let python = root().join("scripts/.venv-triton/bin/python");
    if !python.is_file() {
        eprintln!(
            "SKIPPED: no Triton venv at {}: run scripts/setup_triton.sh (scripts/test.sh does)",
            python.display()
        );
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let repo = dir.path().join("repo");
    let reg = registry(&dir.path().join("export"), true);
    let exported = export_triton(
        &reg,
        &repo,
        &[
            CLASSIFIER.to_string(),
            LUNGS.to_string(),
            MEDSAM.to_string(),
            ANATOMY.to_string(),
        ],
        &ExportOptions::default(),
    )
    .expect("export-triton");
    assert_eq!(exported.len(), 4, "{exported:?}");
    assert!(exported.iter().all(|e| matches!(
        e,
        Exported::Written {
            max_batch_size: 16,
            ..
        }
    )));
    let t0 = Instant::now();
    let mut triton = Triton::start(&python, &repo, &dir.path().join("workspace"));
    eprintln!(
        "Triton ready in {:.1} s at {}",
        t0.elapsed().as_secs_f64(),
        triton.url
    );

    let models = pool(&dir.path().join("a"), &triton.url, None);
    let store = Arc::new(ImageStore::default());
    let images: Vec<String> = ["nih_00000001_000_cardiomegaly.png", "covid_2c35005f.jpg"]
        .iter()
        .map(|f| {
            store
                .ingest_file(&shared().join("cxr/images").join(f))
                .expect("real radiograph")
        })
        .collect();
    let classify = |b| ClassifyChestXray::with_backend(store.clone(), models.clone(), b);
    let segment = |b| SegmentLungs::with_backend(store.clone(), models.clone(), b);
    let region = |b| SegmentRegion::on_device(store.clone(), models.clone(), None, Some(b));

    // The networks' raw outputs first. Against ONNX Runtime in process (the same graph and the
    // same library as the server's callable) the transport must be lossless; against the
    // native engine they differ by the engines' rounding only.
    hilum_models::onnx::use_runtime(ort_library(&python));
    let m = models.clone();
    let raw = tokio::task::spawn_blocking(move || {
        let size = 224;
        let x: Vec<f32> = (0..2 * size * size)
            .map(|i| ((i * 7919) % 2048) as f32 - 1024.0)
            .collect();
        let get = |b| xrv::pooled(&m, CLASSIFIER, Device::Cpu, Some(b)).expect("classifier");
        let [served, ort, native] = [Backend::Kserve, Backend::Onnx, Backend::Native]
            .map(|b| get(b).logits(&x, 2).expect("logits"));
        let s = unet::Config::lung_seg_valiou_088().input_size;
        let y: Vec<Vec<f32>> = (0..2)
            .map(|k| {
                (0..s * s * 3)
                    .map(|i| ((i * 31 + k * 17) % 256) as f32)
                    .collect()
            })
            .collect();
        let get = |b| {
            m.get_or_load::<LungSegmenter>(LUNGS, Device::Cpu, b)
                .expect("U-Net")
        };
        let [p_served, p_ort, p_native] = [Backend::Kserve, Backend::Onnx, Backend::Native]
            .map(|b| get(b).predict(&y).expect("U-Net").concat());
        let scale = native.iter().fold(0f32, |a, v| a.max(v.abs())) as f64;
        let get = |b| {
            m.get_or_load::<Sam>(MEDSAM, Device::Cpu, b)
                .expect("MedSAM")
        };
        let z: Vec<f32> = (0..3 * 128 * 128)
            .map(|i| ((i * 13) % 97) as f32 / 96.0)
            .collect();
        let [e_served, e_ort, e_candle] =
            [Backend::Kserve, Backend::Onnx, Backend::Candle].map(|b| {
                let sam = get(b);
                assert_eq!(sam.backend(), b);
                let e = sam.embed_prepared(&z).expect("image embedding");
                e.flatten_all()
                    .and_then(|t| t.to_vec1::<f32>())
                    .expect("f32")
            });
        [
            max_diff(&served, &ort),
            max_diff(&p_served, &p_ort),
            max_diff(&e_served, &e_ort),
            max_diff(&served, &native) / scale.max(1.0),
            max_diff(&p_served, &p_native),
            max_diff(&e_served, &e_candle),
        ]
    })
    .await
    .expect("forward passes");
    eprintln!(
        "batch of 2, max |kserve - onnx in process|: logits {:.1e}, U-Net {:.1e}, MedSAM \
         embedding {:.1e}; max |kserve - native|: logits {:.1e} (relative to the largest), \
         U-Net {:.1e}, MedSAM embedding vs candle {:.1e}",
        raw[0], raw[1], raw[2], raw[3], raw[4], raw[5]
    );
    assert!(raw[..3].iter().all(|d| *d <= TOLERANCE), "{raw:?}");
    assert!(raw[3..].iter().all(|d| *d <= 1e-4), "{raw:?}");

    // The tools: same outputs on both backends, served ones saying so.
    let mut results = Vec::new();
    for id in &images {
        let pairs: [(&str, Shared, Shared); 3] = [
            (
                "classify",
                Arc::new(classify(Backend::Kserve)),
                Arc::new(classify(Backend::Native)),
            ),
            (
                "segment",
                Arc::new(segment(Backend::Kserve)),
                Arc::new(segment(Backend::Native)),
            ),
            (
                "region",
                Arc::new(region(Backend::Kserve)),
                Arc::new(region(Backend::Candle)),
            ),
        ];
        for (name, served, native) in pairs {
            let mut args = json!({ "image": id });
            if name == "region" {
                args["box"] = json!([100, 150, 420, 700]);
            }
            let a = call(served.as_ref(), args.clone())
                .await
                .expect("served call");
            let b = call(native.as_ref(), args).await.expect("native call");
            assert_eq!(a.data["backend"], "kserve", "{name}: {}", a.data);
            assert_same(&a.data, &b.data, name);
            assert_eq!(a.summary, b.summary, "{name}");
            let masks = |o: &ToolOutput| {
                o.artifacts
                    .iter()
                    .map(|x| x.bytes.clone())
                    .collect::<Vec<_>>()
            };
            assert_eq!(masks(&a), masks(&b), "{name}: artifacts differ");
            results.push((b.data, a));
        }
    }

    // One setting routes a model for every tool that uses it: `lung-unet = "kserve"` sends
    // segment_lungs' and measure_chest's U-Net to the server (no anatomy model here, so
    // measure_chest measures on the lung U-Net), `chestx-det-pspnet = "kserve"` segment_anatomy's
    // and measure_chest's PSPNet; each equals its in-process run.
    let lungs_served = BackendChoice::parse("lung-unet=kserve").expect("choice");
    let by_lungs = routed_pool(
        &dir.path().join("l"),
        &triton.url,
        None,
        lungs_served,
        false,
    );
    let anatomy_served = BackendChoice::parse("chestx-det-pspnet=kserve").expect("choice");
    let by_anatomy = routed_pool(
        &dir.path().join("p"),
        &triton.url,
        None,
        anatomy_served,
        true,
    );
    // The same graph on ONNX Runtime in process: a probability at the threshold cannot flip.
    let psp_here = BackendChoice::parse("chestx-det-pspnet=onnx").expect("choice");
    let in_process = routed_pool(&dir.path().join("n"), &triton.url, None, psp_here, true);
    let lungs_only = routed_pool(
        &dir.path().join("m"),
        &triton.url,
        None,
        BackendChoice::default(),
        false,
    );
    let routed: [(&str, Shared, Shared); 4] = [
        (
            "segment_lungs",
            Arc::new(SegmentLungs::new(store.clone(), by_lungs.clone())),
            Arc::new(SegmentLungs::new(store.clone(), lungs_only.clone())),
        ),
        (
            "measure_chest (lung U-Net)",
            Arc::new(MeasureChest::new(store.clone(), by_lungs.clone())),
            Arc::new(MeasureChest::new(store.clone(), lungs_only.clone())),
        ),
        (
            "segment_anatomy",
            Arc::new(SegmentAnatomy::new(store.clone(), by_anatomy.clone())),
            Arc::new(SegmentAnatomy::new(store.clone(), in_process.clone())),
        ),
        (
            "measure_chest (anatomy)",
            Arc::new(MeasureChest::new(store.clone(), by_anatomy.clone())),
            Arc::new(MeasureChest::new(store.clone(), in_process.clone())),
        ),
    ];
    for (name, served, here) in routed {
        let args = json!({ "image": images[0] });
        let a = call(served.as_ref(), args.clone())
            .await
            .unwrap_or_else(|e| panic!("{name} routed to the server: {e}"));
        let b = call(here.as_ref(), args).await.expect("in process");
        assert_eq!(a.data["backend"], "kserve", "{name}: {}", a.data);
        assert_ne!(b.data["backend"], "kserve", "{name}: {}", b.data);
        assert_same(&a.data, &b.data, name);
        assert_eq!(a.summary, b.summary, "{name}");
    }
    let masks_source = |o: &ToolOutput| o.data["masks_source"].as_str().unwrap_or("").to_string();
    let m = call(
        &MeasureChest::new(store.clone(), by_lungs.clone()),
        json!({ "image": images[1] }),
    )
    .await
    .expect("measure on the served U-Net");
    assert!(masks_source(&m).contains(LUNGS), "{}", m.data);

    // With no backend chosen, MedSAM's encoder runs on ONNX Runtime on the CPU
    // (sam::auto_backend), to candle's output.
    let args = json!({ "image": images[0], "box": [100, 150, 420, 700] });
    let auto = SegmentRegion::new(store.clone(), models.clone());
    let auto = call(&auto, args.clone()).await.expect("default backend");
    assert_eq!(auto.data["backend"], "onnx", "{}", auto.data);
    let by_candle = call(&region(Backend::Candle), args).await.expect("candle");
    assert_same(&auto.data, &by_candle.data, "region on the default backend");

    // Triton dies mid-run: the next round's served calls fail with the error that says what
    // to do, the call without a model still answers, and the results already in are intact.
    let with_fallback = pool(&dir.path().join("b"), &triton.url, Some(Backend::Native));
    let warm =
        ClassifyChestXray::with_backend(store.clone(), with_fallback.clone(), Backend::Kserve);
    let before = call(&warm, json!({ "image": images[0] }))
        .await
        .expect("served");
    assert_eq!(before.data["backend"], "kserve");
    triton.kill();
    let (served_classify, served_segment) = (classify(Backend::Kserve), segment(Backend::Kserve));
    // A new tool: its embedding cache is empty, so it needs the served encoder.
    let served_region = region(Backend::Kserve);
    let info = ImageInfo::new(store.clone());
    let (c, s, r, i) = tokio::join!(
        call(&served_classify, json!({ "image": images[0] })),
        call(&served_segment, json!({ "image": images[1] })),
        call(
            &served_region,
            json!({ "image": images[1], "box": [100, 150, 420, 700] })
        ),
        call(&info, json!({ "image": images[0] })),
    );
    let err = r.err().unwrap_or_default();
    eprintln!("region after the kill: {err}");
    assert!(
        err.contains("is not answering") && err.contains(&triton.url),
        "region: {err}"
    );
    for (what, r) in [("classify", c), ("segment", s)] {
        let err = r.err().unwrap_or_default();
        eprintln!("{what} after the kill: {err}");
        assert!(
            err.contains("is not answering")
                && err.contains(&triton.url)
                && err.contains("HILUM_KSERVE_URL")
                && err.contains("--backend native"),
            "{what}: {err}"
        );
    }
    assert!(i.is_ok(), "a tool without a model keeps working: {i:?}");
    // measure_chest, told nothing, followed `lung-unet = "kserve"` to the server that is gone.
    let measured = call(
        &MeasureChest::new(store.clone(), by_lungs.clone()),
        json!({ "image": images[1] }),
    )
    .await;
    let err = measured.err().unwrap_or_default();
    assert!(
        err.contains("is not answering") && err.contains(&triton.url),
        "measure_chest: {err}"
    );
    assert_eq!(results.len(), 3 * images.len());
    for (native, served) in &results {
        assert_same(&served.data, native, "kept result");
    }

    // With `fallback = native` the same call runs in process and says why.
    let fell = call(&warm, json!({ "image": images[0] }))
        .await
        .expect("fallback");
    assert_eq!(fell.data["backend"], "native");
    let why = fell.data["fallback"].as_str().unwrap_or_default();
    assert!(
        why.contains("did not answer") && why.contains("native"),
        "{why}"
    );
    assert_same(&fell.data, &before.data, "fallback");
    // MedSAM has no native kernels: its fallback runs the encoder in candle.
    let region_fell =
        SegmentRegion::on_device(store.clone(), with_fallback, None, Some(Backend::Kserve));
    let args = json!({ "image": images[1], "box": [100, 150, 420, 700] });
    let fell = call(&region_fell, args.clone())
        .await
        .expect("region fallback");
    assert_eq!(fell.data["backend"], "candle", "{}", fell.data);
    assert!(fell.data["fallback"]
        .as_str()
        .is_some_and(|w| w.contains("did not answer")));
    let by_candle = call(&region(Backend::Candle), args)
        .await
        .expect("candle region");
    assert_same(&fell.data, &by_candle.data, "region fallback");
}
