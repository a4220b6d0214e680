//! Latency of the issue-9 tools on a real radiograph (1024², NIH):
//! - `localize_finding`'s work: CAM of DenseNet-121 (real architecture, seeded weights; candle
//!   CPU) + upsampling + boxes, and the heatmap overlay PNG;
//! - `ground_phrase` and `answer_visual_question` round trips against an OpenAI-compatible
//!   server on 127.0.0.1 that answers at once: Hilum's own overhead (resize, PNG, base64, HTTP,
//!   parsing, box rendering), without model time.
//!
//! `cargo bench --bench vlm_localize`

use std::path::PathBuf;
use std::sync::Arc;

use axum::routing::post;
use axum::{Json, Router};
use candle_core::{DType, Device};
use candle_nn::VarBuilder;
use criterion::{criterion_group, criterion_main, Criterion};
use hilum_agent::{Tool, ToolContext};
use hilum_imaging::ImageStore;
use hilum_models::xrv::{self, Classifier, XrvSpec};
use hilum_models::Backend;
use hilum_tools::localize;
use hilum_tools::vlm::{Family, VlmSettings};
use hilum_tools::{AnswerVisualQuestion, GroundPhrase};
use serde_json::{json, Value};

fn image_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../shared/data/cxr/images/nih_00004387_000_effusion.png")
}

/// Answers like Qwen2.5-VL (boxes) or a VQA model, by model name.
async fn completions(Json(req): Json<Value>) -> Json<Value> {
    let content = if req["model"] == "qwen" {
        "```json\n[{\"bbox_2d\": [500, 520, 900, 900], \"label\": \"effusion\"}]\n```"
    } else {
        "Yes, a left pleural effusion."
    };
    Json(json!({
        "model": req["model"],
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content}}],
        "usage": {"completion_tokens": 20}
    }))
}

fn settings(url: &str, model: &str, family: &str) -> Arc<VlmSettings> {
    let mut s = VlmSettings::default();
    s.default.base_url = Some(url.into());
    s.default.model = Some(model.into());
    s.default.family = Some(Family::parse(family).expect("family"));
    Arc::new(s)
}

fn bench(c: &mut Criterion) {
    let store = Arc::new(ImageStore::default());
    let id = store
        .ingest_file(&image_path())
        .expect("real radiograph (../shared/data)");
    let img = store.get(&id).expect("image");

    let spec = XrvSpec::densenet121_res224_all();
    let vb = VarBuilder::from_tensors(
        xrv::synthetic_weights(&spec.arch, 7).expect("weights"),
        DType::F32,
        &Device::Cpu,
    );
    let net = Classifier::new(vb, spec, Backend::Candle, 1).expect("net");
    let mut g = c.benchmark_group("localize_finding");
    g.sample_size(10);
    g.bench_function(
        "cam+boxes densenet121 224px candle-cpu, 1024² image",
        |b| b.iter(|| localize::localize(&net, &img, 7, 0.5).expect("localize")),
    );
    let loc = localize::localize(&net, &img, 7, 0.5).expect("localize");
    g.bench_function("heatmap overlay png 1024²", |b| {
        b.iter(|| localize::overlay_png(&img, &loc).expect("png"))
    });
    g.finish();

    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let url = rt.block_on(async {
        let app = Router::new().route("/v1/chat/completions", post(completions));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        tokio::spawn(async move { axum::serve(listener, app).await });
        format!("http://{addr}/v1")
    });
    let ground = GroundPhrase::new(store.clone(), settings(&url, "qwen", "qwen2.5-vl"));
    let vqa = AnswerVisualQuestion::new(store.clone(), settings(&url, "vqa", "generic"));
    let mut g = c.benchmark_group("served_vlm_overhead");
    g.sample_size(20);
    g.bench_function("ground_phrase round trip (qwen2.5-vl), 1024² image", |b| {
        b.to_async(&rt).iter(|| async {
            ground
                .call(
                    &ToolContext::default(),
                    json!({"image": id, "phrase": "pleural effusion"}),
                )
                .await
                .expect("ground")
        })
    });
    g.bench_function("answer_visual_question round trip, 1024² image", |b| {
        b.to_async(&rt).iter(|| async {
            vqa.call(
                &ToolContext::default(),
                json!({"image": id, "question": "Is there an effusion?"}),
            )
            .await
            .expect("vqa")
        })
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
