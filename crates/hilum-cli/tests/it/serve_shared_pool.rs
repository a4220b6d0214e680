//! One model pool per `hilum serve` process: two tokens (two tenants with separate image stores)
//! call `segment_lungs` and the lung U-Net is loaded once (`hilum_model_loads_total` in
//! `/metrics`), so every tenant shares one copy and one set of device permits.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use serde_json::{json, Value};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn data(rel: &str) -> PathBuf {
    repo().join("../shared/data").join(rel)
}

fn hilum(models: &Path) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_hilum"));
    c.env_remove("OPENAI_API_KEY")
        .env_remove("HILUM_LLM")
        .env("HILUM_CONFIG", "/dev/null")
        .env("HILUM_MODELS_DIR", models);
    c
}

/// Kills the server when the test ends, however it ends.
struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_tokens_share_one_model_pool() {
    let dir = tempfile::tempdir().expect("tempdir");
    let models = dir.path().join("models");
    let out = hilum(&models)
        .args(["models", "import", "lung-unet"])
        .arg(data("models/lung_seg_unet/lung_seg_valiou_088.h5"))
        .output()
        .expect("run hilum models import");
    assert!(
        out.status.success(),
        "importing the lung U-Net failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );

    let db = format!("sqlite://{}", dir.path().join("hilum.db").display());
    let mut tokens = Vec::new();
    for name in ["ws-1", "ws-2"] {
        let out = hilum(&models)
            .args(["serve", "token", "create", "--name", name, "--db", &db])
            .output()
            .expect("token create");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        tokens.push(String::from_utf8_lossy(&out.stdout).trim().to_string());
    }

    let mut child = hilum(&models)
        .args(["serve", "--db", &db, "--bind", "127.0.0.1:0"])
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .expect("start hilum serve");
    let stderr = child.stderr.take().expect("stderr");
    let server = Server(child);
    let mut lines = BufReader::new(stderr).lines();
    let base = loop {
        let line = lines
            .next()
            .expect("hilum serve exited before listening")
            .expect("read stderr");
        if let Some(rest) = line.split("listening on ").nth(1) {
            break rest
                .split_whitespace()
                .next()
                .unwrap_or_default()
                .to_string();
        }
    };
    // Keep draining stderr so the server never blocks on a full pipe.
    std::thread::spawn(move || for _ in lines {});

    let client = reqwest::Client::new();
    let png = std::fs::read(data("cxr/images/nih_00000001_000_cardiomegaly.png")).expect("image");
    for token in &tokens {
        let form = reqwest::multipart::Form::new().part(
            "file",
            reqwest::multipart::Part::bytes(png.clone())
                .file_name("chest.png")
                .mime_str("image/png")
                .expect("mime"),
        );
        let up = client
            .post(format!("{base}/v1/images"))
            .bearer_auth(token)
            .multipart(form)
            .send()
            .await
            .expect("upload");
        assert_eq!(up.status(), 201);
        let body: Value = up.json().await.expect("upload json");
        let id = body["images"][0]["id"]
            .as_str()
            .expect("image id")
            .to_string();
        let call = client
            .post(format!("{base}/v1/tools/segment_lungs:call"))
            .bearer_auth(token)
            .json(&json!({"image": id}))
            .send()
            .await
            .expect("tool call");
        let status = call.status();
        let result: Value = call.json().await.expect("call json");
        assert_eq!(status, 200, "{result}");
        assert!(result.to_string().contains("area"), "{result}");
    }

    let metrics = client
        .get(format!("{base}/metrics"))
        .bearer_auth(&tokens[0])
        .send()
        .await
        .expect("metrics")
        .text()
        .await
        .expect("metrics text");
    let loads: Vec<&str> = metrics
        .lines()
        .filter(|l| l.starts_with("hilum_model_loads_total{model=\"lung-unet\""))
        .collect();
    assert_eq!(loads.len(), 1, "one (model, device) entry: {loads:?}");
    assert!(
        loads[0].ends_with(" 1"),
        "two tenants, one load of the lung U-Net: {}",
        loads[0]
    );
    drop(server);
}
