//! The served VLM tools against a real OpenAI-compatible HTTP server on 127.0.0.1 that decodes
//! the image it receives and answers as MAIRA-2 and Qwen2.5-VL do.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use axum::extract::State;
use axum::routing::post;
use axum::{Json, Router};
use base64::Engine;
use hilum_agent::{Environment, Tool, ToolContext, ToolError};
use hilum_imaging::ImageStore;
use hilum_tools::vlm::{Family, VlmSettings};
use hilum_tools::{AnswerVisualQuestion, GroundPhrase};
use serde_json::{json, Value};

fn data_dir() -> PathBuf {
    let d = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/data/cxr/images");
    assert!(
        d.is_dir(),
        "real test images missing: expected {} (the shared data folder beside the repository)",
        d.display()
    );
    d
}

/// What the server saw in one request.
#[derive(Clone, Debug)]
struct Seen {
    model: String,
    width: u32,
    height: u32,
    gray: Vec<u8>,
    texts: Vec<String>,
    roles: Vec<String>,
}

type Log = Arc<Mutex<Vec<Seen>>>;

/// Decodes the request's image data URL back to pixels; answers by model name.
async fn completions(
    State(log): State<Log>,
    Json(req): Json<Value>,
) -> (axum::http::StatusCode, Json<Value>) {
    let bad = |m: &str| {
        (
            axum::http::StatusCode::BAD_REQUEST,
            Json(json!({"error": {"message": m}})),
        )
    };
    let model = req["model"].as_str().unwrap_or_default().to_string();
    let mut image = None;
    let mut texts = Vec::new();
    let mut roles = Vec::new();
    for m in req["messages"].as_array().into_iter().flatten() {
        roles.push(m["role"].as_str().unwrap_or_default().to_string());
        match &m["content"] {
            Value::String(s) => texts.push(s.clone()),
            Value::Array(parts) => {
                for p in parts {
                    match p["type"].as_str() {
                        Some("text") => texts.push(p["text"].as_str().unwrap_or("").into()),
                        Some("image_url") => {
                            let url = p["image_url"]["url"].as_str().unwrap_or("");
                            let Some(b64) = url.strip_prefix("data:image/png;base64,") else {
                                return bad("image is not a PNG data URL");
                            };
                            let Ok(bytes) = base64::engine::general_purpose::STANDARD.decode(b64)
                            else {
                                return bad("bad base64");
                            };
                            let Ok(img) = image::load_from_memory(&bytes) else {
                                return bad("not a decodable image");
                            };
                            image = Some(img.to_luma8());
                        }
                        _ => return bad("unknown content part"),
                    }
                }
            }
            _ => return bad("bad content"),
        }
    }
    let Some(img) = image else {
        return bad("no image in the request");
    };
    let (w, h) = img.dimensions();
    log.lock().expect("log").push(Seen {
        model: model.clone(),
        width: w,
        height: h,
        gray: img.into_raw(),
        texts,
        roles,
    });
    let content = match model.as_str() {
        // MAIRA-2 grounded phrase (box tokens, bins of its centre crop), then </s> as decoded.
        "microsoft/maira-2" => {
            "<obj>Left pleural effusion.</obj><box><x60><y55><x95><y90></box></s>".to_string()
        }
        // Qwen2.5-VL answers in the pixels of the image it received.
        "Qwen/Qwen2.5-VL-7B-Instruct" => format!(
            "```json\n[\n\t{{\"bbox_2d\": [{}, {}, {}, {}], \"label\": \"left pleural effusion\"}}\n]\n```",
            w / 2,
            h / 2,
            w * 9 / 10,
            h * 9 / 10
        ),
        "broken-grounder" => "<obj>effusion</obj><box><x60><y55><x95></box>".to_string(),
        "vqa-model" => "Yes. There is a moderate left pleural effusion.".to_string(),
        "fail" => {
            return (
                axum::http::StatusCode::INTERNAL_SERVER_ERROR,
                Json(json!({"error": {"message": "CUDA out of memory"}})),
            )
        }
        _ => return bad("unknown model"),
    };
    (
        axum::http::StatusCode::OK,
        Json(json!({
            "id": "chatcmpl-1", "object": "chat.completion", "model": model,
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": content}}],
            "usage": {"prompt_tokens": 1200, "completion_tokens": 24, "total_tokens": 1224}
        })),
    )
}

async fn server() -> (String, Log) {
    let log: Log = Arc::default();
    let app = Router::new()
        .route("/v1/chat/completions", post(completions))
        .with_state(log.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move { axum::serve(listener, app).await });
    (format!("http://{addr}/v1"), log)
}

fn settings(base_url: &str, model: &str, family: &str) -> Arc<VlmSettings> {
    let mut s = VlmSettings::default();
    s.default.base_url = Some(base_url.into());
    s.default.model = Some(model.into());
    s.default.family = Some(Family::parse(family).expect("family"));
    Arc::new(s)
}

fn store_with(file: &str) -> (Arc<ImageStore>, String) {
    let store = Arc::new(ImageStore::default());
    let id = store.ingest_file(&data_dir().join(file)).expect("ingest");
    (store, id)
}

fn gray8(store: &ImageStore, id: &str) -> (u32, u32, Vec<u8>) {
    let img = store.get(id).expect("image");
    let s = 255.0 / img.max_value();
    let px = img
        .pixels
        .iter()
        .map(|v| (v * s).round().clamp(0.0, 255.0) as u8)
        .collect();
    (img.width, img.height, px)
}

fn close(a: f64, b: f64, tol: f64) -> bool {
    (a - b).abs() <= tol
}

#[tokio::test]
async fn maira2_grounding_carries_the_image_and_maps_bins_to_pixels() {
    let (url, log) = server().await;
    let (store, id) = store_with("nih_00004387_000_effusion.png");
    let tool = GroundPhrase::new(store.clone(), settings(&url, "microsoft/maira-2", "maira2"));
    assert!(tool.available(&Environment::default()));
    let out = tool
        .call(
            &ToolContext::default(),
            json!({"image": id, "phrase": "left pleural effusion"}),
        )
        .await
        .expect("grounding");

    // The server received exactly the radiograph (1024² fits the 1024 px budget unresized).
    let seen = log.lock().expect("log")[0].clone();
    let (w, h, px) = gray8(&store, &id);
    assert_eq!((seen.width, seen.height), (w, h));
    assert_eq!(seen.gray, px, "the PNG sent must be the decoded image");
    assert_eq!(seen.roles, ["system", "user"]);
    assert!(seen.texts[1].contains("grounded phrase") && seen.texts[1].contains("left pleural"));

    // Bin centres of a 1024² square: (60 + 0.5) / 100 * 1024 = 619.52 → 619.5.
    let b = &out.data["boxes"][0];
    assert_eq!(out.data["boxes"].as_array().map(Vec::len), Some(1));
    assert_eq!(b["label"], "Left pleural effusion.");
    assert!(close(b["x1"].as_f64().unwrap_or(0.0), 619.52, 0.05), "{b}");
    assert!(close(b["y1"].as_f64().unwrap_or(0.0), 568.32, 0.05), "{b}");
    assert!(close(b["x2"].as_f64().unwrap_or(0.0), 977.92, 0.05), "{b}");
    assert!(close(b["y2"].as_f64().unwrap_or(0.0), 926.72, 0.05), "{b}");
    assert!(out.summary.contains("1 box"), "{}", out.summary);

    // The artifact is the image with a red outline where the box is.
    let art = &out.artifacts[0];
    assert_eq!(
        (art.kind.as_str(), art.media_type.as_str()),
        ("boxes", "image/png")
    );
    let png = image::load_from_memory(&art.bytes).expect("png").to_rgb8();
    assert_eq!(png.dimensions(), (1024, 1024));
    assert_eq!(png.get_pixel(800, 570).0, [255, 64, 64]);
    assert_ne!(png.get_pixel(800, 700).0, [255, 64, 64]);
}

#[tokio::test]
async fn qwen_boxes_on_a_resized_16bit_image_map_back_to_original_pixels() {
    let (url, log) = server().await;
    // 1841 x 1955, 16-bit: resized to Qwen's 28-pixel grid before sending.
    let (store, id) = store_with("derived_RG1_chest_pa_16bit.png");
    let tool = GroundPhrase::new(
        store.clone(),
        settings(&url, "Qwen/Qwen2.5-VL-7B-Instruct", "qwen2.5-vl"),
    );
    let out = tool
        .call(
            &ToolContext::default(),
            json!({"image": id, "phrase": "left pleural effusion"}),
        )
        .await
        .expect("grounding");
    let seen = log.lock().expect("log")[0].clone();
    assert_eq!((seen.width % 28, seen.height % 28), (0, 0));
    assert!(seen.width * seen.height <= 28 * 28 * 1280);
    assert_eq!(
        out.data["sent_size"],
        json!([seen.width, seen.height]),
        "the tool must know the size the server received"
    );
    // The sent image is the radiograph, downscaled: compare with a resize of our own.
    let (w, h, px) = gray8(&store, &id);
    let ours = image::imageops::resize(
        &image::GrayImage::from_raw(w, h, px).expect("gray"),
        seen.width,
        seen.height,
        image::imageops::FilterType::Triangle,
    );
    let diff = ours
        .as_raw()
        .iter()
        .zip(&seen.gray)
        .map(|(a, b)| (*a as f64 - *b as f64).abs())
        .sum::<f64>()
        / seen.gray.len() as f64;
    assert!(diff < 1.0, "mean abs difference {diff}");

    // The server answered [w/2, h/2, 0.9w, 0.9h] of the image it saw.
    let b = &out.data["boxes"][0];
    let sx = w as f64 / seen.width as f64;
    let sy = h as f64 / seen.height as f64;
    let tol = 0.11;
    assert!(
        close(
            b["x1"].as_f64().unwrap_or(0.0),
            (seen.width / 2) as f64 * sx,
            tol
        ),
        "{b}"
    );
    assert!(
        close(
            b["y1"].as_f64().unwrap_or(0.0),
            (seen.height / 2) as f64 * sy,
            tol
        ),
        "{b}"
    );
    assert!(
        close(
            b["x2"].as_f64().unwrap_or(0.0),
            (seen.width * 9 / 10) as f64 * sx,
            tol
        ),
        "{b}"
    );
    assert!(
        close(
            b["y2"].as_f64().unwrap_or(0.0),
            (seen.height * 9 / 10) as f64 * sy,
            tol
        ),
        "{b}"
    );
    // 920 x 977 is resized to the 28-pixel grid, so the mapping back is not the identity.
    assert_ne!((seen.width, seen.height), (w, h));
    assert_eq!(b["label"], "left pleural effusion");
}

#[tokio::test]
async fn malformed_grounding_output_is_a_clear_error() {
    let (url, _log) = server().await;
    let (store, id) = store_with("nih_00004387_000_effusion.png");
    let tool = GroundPhrase::new(store, settings(&url, "broken-grounder", "maira2"));
    let err = tool
        .call(
            &ToolContext::default(),
            json!({"image": id, "phrase": "effusion"}),
        )
        .await
        .expect_err("malformed box tokens");
    let ToolError::Unprocessable(msg) = err else {
        panic!("expected Unprocessable, got {err:?}");
    };
    assert!(
        msg.contains("maira2 grounding output could not be read"),
        "{msg}"
    );
    assert!(msg.contains("four coordinate tokens"), "{msg}");
}

#[tokio::test]
async fn vqa_answers_from_the_served_model() {
    let (url, log) = server().await;
    let (store, id) = store_with("nih_00004387_000_effusion.png");
    let tool = AnswerVisualQuestion::new(store, settings(&url, "vqa-model", "generic"));
    let out = tool
        .call(
            &ToolContext::default(),
            json!({"image": id, "question": "Is there a pleural effusion?"}),
        )
        .await
        .expect("answer");
    assert_eq!(
        out.data["answer"],
        "Yes. There is a moderate left pleural effusion."
    );
    assert_eq!(out.data["completion_tokens"], 24);
    let seen = log.lock().expect("log")[0].clone();
    assert_eq!(seen.model, "vqa-model");
    assert_eq!(
        seen.texts.last().map(String::as_str),
        Some("Is there a pleural effusion?")
    );
    assert_eq!((seen.width, seen.height), (1024, 1024));
}

#[tokio::test]
async fn server_errors_and_policy_refusals_are_explained() {
    let (url, log) = server().await;
    let (store, id) = store_with("nih_00004387_000_effusion.png");
    let args = json!({"image": id, "question": "Is there a pleural effusion?"});

    let failing = AnswerVisualQuestion::new(store.clone(), settings(&url, "fail", "generic"));
    let err = failing
        .call(&ToolContext::default(), args.clone())
        .await
        .expect_err("HTTP 500");
    assert!(err.to_string().contains("HTTP 500") && err.to_string().contains("out of memory"));

    // A non-loopback endpoint without allow_pixels never receives the image.
    let before = log.lock().expect("log").len();
    let remote = AnswerVisualQuestion::new(
        store.clone(),
        settings("http://10.20.30.40:8000/v1", "vqa-model", "generic"),
    );
    let err = remote
        .call(&ToolContext::default(), args.clone())
        .await
        .expect_err("refused");
    assert!(err.to_string().contains("refusing to send pixels"), "{err}");
    assert_eq!(log.lock().expect("log").len(), before);

    // Not configured: hidden from the model, and a call says how to configure it.
    let none = AnswerVisualQuestion::new(store, Arc::new(VlmSettings::default()));
    assert!(!none.available(&Environment::default()));
    let err = none
        .call(&ToolContext::default(), args)
        .await
        .expect_err("not configured");
    assert!(err.to_string().contains("HILUM_VLM_BASE_URL"), "{err}");
}
