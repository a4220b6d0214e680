//! `hilum models import` installs every built-in model with no Python anywhere: the real
//! binary, PATH holding only an empty folder and HILUM_PYTHON unset. PyTorch checkpoints of
//! the full architectures are written here (the legacy `torch.save` layout, tensors stride-0
//! views of one value where the reader allows it, so most files stay a few KB); the lung
//! U-Net is the real Keras
//! .h5 from ../shared/data; the LLaVA and report models take the safetensors fixtures of
//! tests/fixtures with their config.json. `hilum models fetch` installs the published lung
//! U-Net from a mirror on 127.0.0.1 the same way.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use hilum_models::{Manifest, ModelRegistry};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Runs `hilum models import ARGS` with no Python reachable; returns its stdout.
fn import_without_python(models: &Path, empty_bin: &Path, args: &[&std::ffi::OsStr]) -> String {
    assert!(
        std::fs::read_dir(empty_bin)
            .expect("bin dir")
            .next()
            .is_none(),
        "PATH must hold nothing"
    );
    let out = Command::new(env!("CARGO_BIN_EXE_hilum"))
        .env_clear()
        .env("PATH", empty_bin)
        .env("HOME", "/nonexistent-hilum-home")
        .env("HILUM_MODELS_DIR", models)
        .env("HILUM_CONFIG", "/dev/null")
        .args(["models", "import"])
        .args(args)
        .output()
        .expect("run hilum");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "hilum models import {args:?} failed without Python:\n{stderr}{stdout}"
    );
    // The progress spinner draws only on a terminal.
    assert!(stderr.is_empty(), "stderr not a terminal, yet: {stderr:?}");
    stdout
}

/// Protocol-2 pickle writer for the few opcodes a legacy `torch.save` state dict needs.
struct Pickler(Vec<u8>);

impl Pickler {
    fn new() -> Self {
        Pickler(vec![0x80, 2])
    }
    fn op(&mut self, op: u8) -> &mut Self {
        self.0.push(op);
        self
    }
    fn global(&mut self, module: &str, name: &str) -> &mut Self {
        self.0.push(b'c');
        self.0.extend(format!("{module}\n{name}\n").bytes());
        self
    }
    fn str(&mut self, s: &str) -> &mut Self {
        self.0.push(b'X');
        self.0.extend((s.len() as u32).to_le_bytes());
        self.0.extend(s.bytes());
        self
    }
    fn int(&mut self, v: usize) -> &mut Self {
        self.0.push(b'J');
        self.0.extend((v as i32).to_le_bytes());
        self
    }
    fn ordered_dict(&mut self) -> &mut Self {
        self.global("collections", "OrderedDict").op(b')').op(b'R')
    }
    fn tuple(&mut self, xs: &[usize]) -> &mut Self {
        self.op(b'(');
        for &x in xs {
            self.int(x);
        }
        self.op(b't')
    }
    fn stop(&mut self) -> Vec<u8> {
        self.0.push(b'.');
        std::mem::take(&mut self.0)
    }
}

/// A legacy-format `torch.save(state_dict)` file: every tensor a stride-0 view of storage `0`,
/// which holds the single value 0.01, except those too large for the reader to expand from one
/// value (more than 2^24 elements): each of those has a zero-filled byte storage of its own.
fn write_legacy_state_dict(path: &Path, params: &BTreeMap<String, Vec<usize>>) {
    let mut out = Vec::new();
    // torch.serialization.MAGIC_NUMBER as LONG1, PROTOCOL_VERSION 1001, sys_info.
    let mut p = Pickler::new();
    p.op(0x8a).op(10);
    p.0.extend(0x1950a86a20f9469cfc6c_u128.to_le_bytes()[..10].iter());
    out.extend(p.stop());
    out.extend(Pickler::new().int(1001).stop());
    out.extend(
        Pickler::new()
            .op(b'}')
            .str("little_endian")
            .op(0x88)
            .op(b's')
            .stop(),
    );
    // (key, element count, raw bytes)
    let mut storages: Vec<(String, usize, Vec<u8>)> =
        vec![("0".into(), 1, 0.01f32.to_le_bytes().to_vec())];
    let mut p = Pickler::new();
    p.ordered_dict();
    for (name, shape) in params {
        let n: usize = shape.iter().product();
        let (key, class, strides) = if n > 1 << 24 {
            let key = storages.len().to_string();
            storages.push((key.clone(), n, vec![0; n]));
            let mut strides = vec![1; shape.len()];
            for i in (0..shape.len().saturating_sub(1)).rev() {
                strides[i] = strides[i + 1] * shape[i + 1];
            }
            (key, "ByteStorage", strides)
        } else {
            ("0".to_string(), "FloatStorage", vec![0; shape.len()])
        };
        p.str(name)
            .global("torch._utils", "_rebuild_tensor_v2")
            .op(b'(');
        p.op(b'(')
            .str("storage")
            .global("torch", class)
            .str(&key)
            .str("cpu")
            .int(storages.iter().find(|s| s.0 == key).map_or(0, |s| s.1))
            .op(b't')
            .op(b'Q');
        p.int(0).tuple(shape).tuple(&strides);
        p.op(0x89).ordered_dict().op(b't').op(b'R').op(b's');
    }
    out.extend(p.stop());
    let mut keys = Pickler::new();
    keys.op(b']').op(b'(');
    for (key, _, _) in &storages {
        keys.str(key);
    }
    out.extend(keys.op(b'e').stop());
    for (_, n, bytes) in &storages {
        out.extend((*n as u64).to_le_bytes());
        out.extend(bytes);
    }
    std::fs::write(path, out).expect("write checkpoint");
}

/// The parameter names and shapes a manifest's PyTorch architecture expects.
fn pytorch_params(m: &Manifest) -> BTreeMap<String, Vec<usize>> {
    let params = match m.architecture.as_str() {
        "densenet121" | "resnet50" => hilum_models::xrv::XrvSpec::from_manifest(m)
            .and_then(|s| hilum_models::xrv::expected_params(&s.arch)),
        "pspnet" => {
            hilum_models::pspnet::expected_params(&hilum_models::pspnet::Config::chestx_det())
        }
        "sam" => hilum_models::sam::Config::from_manifest(m)
            .and_then(|c| hilum_models::sam::expected_params(&c)),
        other => panic!("no PyTorch parameters for {other}"),
    };
    params.unwrap_or_else(|e| panic!("{}: {e}", m.id))
}

#[test]
fn every_manifest_imports_with_no_python_on_path() {
    let dir = tempfile::tempdir().expect("tempdir");
    let empty_bin = dir.path().join("bin");
    std::fs::create_dir(&empty_bin).expect("mkdir");
    let models = dir.path().join("models");
    let shared = repo().join("../shared/data/models/lung_seg_unet");
    let registry = ModelRegistry::new(&models).expect("built-in manifests");
    let mut done = Vec::new();
    for m in registry.manifests() {
        let id = m.id.as_str();
        let (file, custom): (PathBuf, bool) = match m.architecture.as_str() {
            "densenet121" | "resnet50" | "pspnet" | "sam" => {
                let file = dir.path().join(format!("{id}.pt"));
                write_legacy_state_dict(&file, &pytorch_params(m));
                (file, true)
            }
            "lung-unet" => (shared.join("lung_seg_valiou_088.h5"), false),
            "llava" => (
                repo().join("tests/fixtures/llava/tiny_llama/model.safetensors"),
                true,
            ),
            // No published sha256 to compare (recorded at install); the layout is checked
            // against the config.json beside the file.
            "swinv2-bert" => (
                repo().join("tests/fixtures/report/tiny_proj/model.safetensors"),
                false,
            ),
            other => panic!("{id}: add a no-Python import case for architecture `{other}`"),
        };
        let mut args = vec![std::ffi::OsStr::new(id), file.as_os_str()];
        if custom {
            args.push(std::ffi::OsStr::new("--custom"));
        }
        let stdout = import_without_python(&models, &empty_bin, &args);
        assert!(stdout.contains(&format!("installed {id}")), "{stdout}");
        done.push(id.to_string());
    }
    // The lung U-Net's ONNX graph too (it is added to the installed weights).
    let onnx = shared.join("lung_seg_valiou_088.onnx");
    import_without_python(
        &models,
        &empty_bin,
        &[std::ffi::OsStr::new("lung-unet"), onnx.as_os_str()],
    );
    assert!(models.join("lung-unet/model.onnx").is_file());
    for id in [
        "densenet121-res224-all",
        "resnet50-res512-all",
        "chestx-det-pspnet",
        "medsam-vit-b",
        "lung-unet",
    ] {
        assert!(done.iter().any(|d| d == id), "{id} not among {done:?}");
    }
}

/// Serves `body` to every GET on 127.0.0.1 (a site mirror), from a thread; returns the base URL.
fn serve_file(body: Vec<u8>) -> String {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            let mut req = Vec::new();
            let mut buf = [0u8; 1024];
            while !req.windows(4).any(|w| w == b"\r\n\r\n") {
                match stream.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => req.extend_from_slice(&buf[..n]),
                }
            }
            let head = format!(
                "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                body.len()
            );
            let _ = stream.write_all(head.as_bytes());
            let _ = stream.write_all(&body);
        }
    });
    format!("http://{addr}")
}

#[test]
fn fetch_installs_the_published_checkpoint_with_no_python_on_path() {
    let dir = tempfile::tempdir().expect("tempdir");
    let empty_bin = dir.path().join("bin");
    std::fs::create_dir(&empty_bin).expect("mkdir");
    let models = dir.path().join("models");
    let h5 = repo().join("../shared/data/models/lung_seg_unet/lung_seg_valiou_088.h5");
    let base = serve_file(std::fs::read(&h5).expect("lung U-Net .h5"));
    let out = Command::new(env!("CARGO_BIN_EXE_hilum"))
        .env_clear()
        .env("PATH", &empty_bin)
        .env("HOME", "/nonexistent-hilum-home")
        .env("HILUM_MODELS_DIR", &models)
        .env("HILUM_CONFIG", "/dev/null")
        .args(["models", "fetch", "lung-unet", "--url"])
        .arg(format!("{base}/lung_seg_valiou_088.h5"))
        .output()
        .expect("run hilum");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "hilum models fetch failed without Python:\n{}{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("installed lung-unet"), "{stdout}");
    // The .h5 was converted in Rust and installed under the published checksum.
    let registry = ModelRegistry::new(&models).expect("registry");
    let inst = registry.installed("lung-unet").expect("installed");
    assert!(!inst.record.custom);
    assert!(registry.verify("lung-unet").expect("verify").ok);
}
