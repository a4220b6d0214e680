//! `answer_visual_question` on the native Gemma 3 multimodal backend (MedGemma 4B's
//! architecture, `model = "local-vlm:PATH"`), run in-process by `hilum_llm_local` on a real
//! radiograph.
//!
//! The model is the tiny seeded Gemma 3 VLM of
//! crates/hilum-llm-local/tests/fixtures/gemma3_vlm/tiny (proven against transformers by that
//! crate's `gemma3_vlm` test). It has no vocabulary of its own, so the test gives its 300 ids one:
//! the special tokens at their ids, every byte as `<0xNN>`, `▁` for a space. Written as a
//! snapshot folder (`tokenizer.json`) and as llama.cpp's pair (text GGUF + mmproj beside it).
//! Its random weights answer gibberish: what is checked is behaviour — the call succeeds in this
//! process, the prompt held the picture's 16 soft tokens, the output has the native shape and
//! names the model, greedy answers repeat, the model loads once, and no connection is made
//! (proxies and the VLM endpoint point at a listener that counts connections).

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use candle_core::quantized::gguf_file;
use hilum_agent::{Environment, Tool, ToolContext, ToolError};
use hilum_imaging::ImageStore;
use hilum_tools::vlm::{Backend, VlmSettings};
use hilum_tools::{AnswerVisualQuestion, GroundPhrase};
use serde_json::{json, Value};

/// Soft tokens per picture of the tiny model.
const PER_IMAGE: u64 = 16;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn tiny() -> PathBuf {
    root().join("crates/hilum-llm-local/tests/fixtures/gemma3_vlm/tiny")
}

fn radiograph() -> (Arc<ImageStore>, String) {
    let path = root().join("../shared/data/cxr/images/medrax_effusion1.png");
    assert!(
        path.is_file(),
        "real radiograph missing: {} (the shared data must be at ../shared/data)",
        path.display()
    );
    let store = Arc::new(ImageStore::default());
    let id = store.ingest_file(&path).expect("radiograph decodes");
    (store, id)
}

/// The 300 pieces: (text, GGUF token type). Types: 1 normal, 3 control, 4 user-defined,
/// 5 unused, 6 byte.
fn vocabulary() -> Vec<(String, i32)> {
    let special: [(usize, &str, i32); 10] = [
        (0, "<pad>", 3),
        (1, "<eos>", 3),
        (2, "<bos>", 3),
        (105, "<start_of_turn>", 3),
        (106, "<end_of_turn>", 3),
        (107, "\n", 4),
        (108, "\n\n", 4),
        (255, "<start_of_image>", 3),
        (256, "<end_of_image>", 3),
        (262, "<image_soft_token>", 3),
    ];
    let mut free = (0..256u32)
        .map(|b| (format!("<0x{b:02X}>"), 6))
        .chain(std::iter::once(("\u{2581}".to_string(), 1)))
        .chain((1..).map(|i| (format!("<unused{i}>"), 5)));
    (0..300)
        .map(|i| match special.iter().find(|s| s.0 == i) {
            Some(&(_, p, t)) => (p.to_string(), t),
            None => free.next().expect("endless"),
        })
        .collect()
}

/// The tiny model as a snapshot folder with a byte-fallback `tokenizer.json` and an 8192-token
/// context (the system prompt alone is ~200 byte tokens).
fn snapshot(dir: &Path) -> PathBuf {
    let snap = dir.join("tiny-medgemma");
    std::fs::create_dir_all(&snap).expect("mkdir");
    std::fs::copy(
        tiny().join("model.safetensors"),
        snap.join("model.safetensors"),
    )
    .expect("weights");
    let text = std::fs::read_to_string(tiny().join("config.json")).expect("config.json");
    let mut config: Value = serde_json::from_str(&text).expect("json");
    config["text_config"]["max_position_embeddings"] = 8192.into();
    std::fs::write(snap.join("config.json"), config.to_string()).expect("config");
    let vocab = vocabulary();
    let added: Vec<Value> = vocab
        .iter()
        .enumerate()
        .filter(|(_, (_, t))| *t == 3 || *t == 4)
        .map(|(i, (p, t))| {
            json!({"id": i, "content": p, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": *t == 3})
        })
        .collect();
    let pieces: serde_json::Map<String, Value> = vocab
        .iter()
        .enumerate()
        .map(|(i, (p, _))| (p.clone(), i.into()))
        .collect();
    let tokenizer = json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": added,
        "normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": "\u{2581}"},
        "pre_tokenizer": null, "post_processor": null, "decoder": null,
        "model": {"type": "BPE", "dropout": null, "unk_token": null,
            "continuing_subword_prefix": null, "end_of_word_suffix": null, "fuse_unk": false,
            "byte_fallback": true, "ignore_merges": false, "vocab": pieces, "merges": []}
    });
    std::fs::write(snap.join("tokenizer.json"), tokenizer.to_string()).expect("tokenizer");
    snap
}

/// The tiny model as llama.cpp's pair: `tiny-medgemma.gguf` (architecture `arch`, with the
/// vocabulary above) and `mmproj-tiny.gguf` beside it.
fn gguf_pair(dir: &Path, arch: &str) -> PathBuf {
    use gguf_file::Value as G;
    let mut f = std::fs::File::open(tiny().join("text.gguf")).expect("tiny text.gguf");
    let ct = gguf_file::Content::read(&mut f).expect("GGUF header");
    let mut tensors = Vec::new();
    for name in ct.tensor_infos.keys() {
        let t = ct
            .tensor(&mut f, name, &candle_core::Device::Cpu)
            .expect("tensor");
        tensors.push((name.clone(), t));
    }
    let vocab = vocabulary();
    let mut md: Vec<(String, G)> = ct
        .metadata
        .iter()
        .filter(|(k, _)| !k.starts_with("tokenizer.") && !k.starts_with("general.architecture"))
        .filter(|(k, _)| k.as_str() != "gemma3.context_length")
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    md.extend([
        ("general.architecture".to_string(), G::String(arch.into())),
        ("gemma3.context_length".into(), G::U32(8192)),
        ("tokenizer.ggml.model".into(), G::String("llama".into())),
        (
            "tokenizer.ggml.tokens".into(),
            G::Array(vocab.iter().map(|(p, _)| G::String(p.clone())).collect()),
        ),
        (
            "tokenizer.ggml.scores".into(),
            G::Array(vocab.iter().map(|_| G::F32(0.0)).collect()),
        ),
        (
            "tokenizer.ggml.token_type".into(),
            G::Array(vocab.iter().map(|(_, t)| G::I32(*t)).collect()),
        ),
        ("tokenizer.ggml.bos_token_id".into(), G::U32(2)),
        ("tokenizer.ggml.eos_token_id".into(), G::U32(1)),
        ("tokenizer.ggml.add_bos_token".into(), G::Bool(true)),
        ("tokenizer.ggml.add_space_prefix".into(), G::Bool(false)),
    ]);
    let text = dir.join("tiny-medgemma.gguf");
    let mut out = std::fs::File::create(&text).expect("create GGUF");
    let md_refs: Vec<(&str, &G)> = md.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let t_refs: Vec<_> = tensors.iter().map(|(k, t)| (k.as_str(), t)).collect();
    gguf_file::write(&mut out, &md_refs, &t_refs).expect("write GGUF");
    std::fs::copy(tiny().join("mmproj.gguf"), dir.join("mmproj-tiny.gguf")).expect("mmproj");
    text
}

/// Points every proxy variable at a local listener and returns its connection count; the
/// served VLM endpoint of the settings below points there too.
fn network_trap() -> (Arc<AtomicUsize>, String) {
    static TRAP: OnceLock<(Arc<AtomicUsize>, String)> = OnceLock::new();
    TRAP.get_or_init(|| {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let url = format!("http://{}", listener.local_addr().expect("addr"));
        let count = Arc::new(AtomicUsize::new(0));
        let c = count.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                c.fetch_add(1, Ordering::SeqCst);
                drop(conn);
            }
        });
        for k in ["HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"] {
            std::env::set_var(k, &url);
            std::env::set_var(k.to_ascii_lowercase(), &url);
        }
        std::env::set_var("NO_PROXY", "");
        (count, url)
    })
    .clone()
}

/// `[vlm]` serves every tool from the trap; `answer_visual_question` runs `spec` natively.
fn settings(spec: &str, trap_url: &str) -> Arc<VlmSettings> {
    let text = format!(
        r#"
        [vlm]
        base_url = "{trap_url}/v1"
        model = "served-model"
        [vlm.tools.answer_visual_question]
        backend = "native"
        model = "local-vlm:{spec}"
        max_tokens = 24
        "#
    );
    Arc::new(VlmSettings::from_config_text(&text).expect("config"))
}

async fn ask(tool: &dyn Tool, id: &str) -> Result<hilum_agent::ToolOutput, ToolError> {
    tool.call(
        &ToolContext::default(),
        json!({"image": id, "question": "Is there a pleural effusion?"}),
    )
    .await
}

/// Two calls on the model of `spec`: both answer in-process with the picture in the prompt, in
/// the native output shape, the same words; the second reuses the loaded model.
async fn answers_in_process(spec: &str) {
    let (trap, url) = network_trap();
    let (store, id) = radiograph();
    let vlm = settings(spec, &url);
    let tool = AnswerVisualQuestion::new(store, vlm.clone());
    assert!(tool.available(&Environment::default()));
    let first = ask(&tool, &id).await.expect("first answer");
    eprintln!("{}\n{:#}", first.summary, first.data);
    let d = &first.data;
    // The shape of the LLaVA native path, plus the picture's soft tokens.
    let mut keys: Vec<&str> = d
        .as_object()
        .expect("object")
        .keys()
        .map(String::as_str)
        .collect();
    keys.sort_unstable();
    assert_eq!(
        keys,
        [
            "answer",
            "backend",
            "completion_tokens",
            "decode_ms",
            "device",
            "image",
            "image_tokens",
            "load_ms",
            "model",
            "prefill_ms",
            "prompt_tokens",
            "question",
            "stopped",
            "tokens_per_second"
        ]
    );
    let model = d["model"].as_str().expect("model").to_string();
    let file = Path::new(spec.split(',').next().unwrap_or(spec))
        .file_name()
        .and_then(|n| n.to_str())
        .expect("file name");
    assert_eq!(model, format!("local-vlm:{file}"));
    assert_eq!(
        (d["backend"].as_str(), d["device"].as_str()),
        (Some("native"), Some("cpu"))
    );
    assert_eq!(d["image"], id.as_str());
    assert_eq!(d["question"], "Is there a pleural effusion?");
    let answer = d["answer"].as_str().expect("answer");
    assert!(!answer.is_empty());
    assert_eq!(first.summary, format!("{id} ({model}, native): {answer}"));
    // The prompt held the radiograph as its 16 soft tokens, around the system text + question.
    assert_eq!(d["image_tokens"], PER_IMAGE);
    assert!(d["prompt_tokens"].as_u64().expect("prompt tokens") > PER_IMAGE + 28);
    let completion = d["completion_tokens"].as_u64().expect("completion tokens");
    assert!((1..=24).contains(&completion), "{completion}");
    match d["stopped"].as_str() {
        Some("max_tokens") => assert_eq!(completion, 24),
        Some("stop_token") => {}
        other => panic!("stopped: {other:?}"),
    }
    assert!(d["load_ms"].as_f64().expect("load_ms") > 0.0);
    // The model itself saw one picture in this request.
    let llm = vlm
        .local_models
        .loaded(spec, hilum_llm_local::LocalDevice::Cpu)
        .expect("the model stays loaded");
    let stats = llm.last_stats();
    assert_eq!((stats.images, stats.image_tokens as u64), (1, PER_IMAGE));

    // Greedy decoding: the same question gets the same answer, from the same loaded model.
    let second = ask(&tool, &id).await.expect("second answer");
    assert_eq!(second.data["answer"], d["answer"]);
    assert_eq!(second.data["image_tokens"], PER_IMAGE);
    assert_eq!(second.data["load_ms"].as_f64(), Some(0.0));
    assert_eq!(llm.last_stats().images, 1);
    // A toolbox built again from the same settings (a server's next tenant) shares the model.
    let (store2, id2) = radiograph();
    let again = AnswerVisualQuestion::new(store2, vlm.clone());
    let third = ask(&again, &id2).await.expect("third answer");
    assert_eq!(third.data["load_ms"].as_f64(), Some(0.0));
    assert_eq!(third.data["answer"], d["answer"]);
    // Pixels never left the process: not one connection reached the trap.
    assert_eq!(trap.load(Ordering::SeqCst), 0, "a connection was made");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_folder_answers_in_process_with_the_picture() {
    let dir = tempfile::tempdir().expect("tempdir");
    let snap = snapshot(dir.path());
    answers_in_process(snap.to_str().expect("utf-8")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gguf_with_its_mmproj_beside_it_answers_in_process() {
    let dir = tempfile::tempdir().expect("tempdir");
    let text = gguf_pair(dir.path(), "gemma3");
    answers_in_process(text.to_str().expect("utf-8")).await;
}

#[test]
fn local_vlm_is_chosen_by_model_prefix_in_the_file_or_the_environment() {
    let s = settings("/models/medgemma-4b-it", "http://127.0.0.1:9");
    match s.backend("answer_visual_question").expect("ok") {
        Some(Backend::LocalVlm(m)) => {
            assert_eq!(m.spec, "/models/medgemma-4b-it");
            assert_eq!((m.max_tokens, m.max_side), (24, 1024));
        }
        other => panic!("expected local-vlm, got {other:?}"),
    }
    // Other tools keep their served endpoint.
    assert!(matches!(
        s.backend("ground_phrase").expect("ok"),
        Some(Backend::Served(_))
    ));
    let mut env = VlmSettings::default();
    env.apply_env(|k| match k {
        "HILUM_VLM_BACKEND" => Some("native".into()),
        "HILUM_VLM_MODEL" => Some("local-vlm:/m/text.gguf,/m/mmproj.gguf".into()),
        _ => None,
    })
    .expect("env");
    match env.backend("answer_visual_question").expect("ok") {
        Some(Backend::LocalVlm(m)) => assert_eq!(m.spec, "/m/text.gguf,/m/mmproj.gguf"),
        other => panic!("expected local-vlm, got {other:?}"),
    }
    // A registry id is still a LLaVA.
    let llava = VlmSettings::from_config_text("[vlm]\nbackend = \"native\"\n").expect("config");
    assert!(matches!(
        llava.backend("answer_visual_question").expect("ok"),
        Some(Backend::Native(_))
    ));
    let gpu = VlmSettings::from_config_text(
        "[vlm]\nbackend = \"native\"\nmodel = \"local-vlm:/m\"\ndevice = \"cuda:1\"\n",
    )
    .expect("config");
    match gpu
        .backend("answer_visual_question")
        .expect("a GPU is a device")
    {
        Some(Backend::LocalVlm(m)) => assert_eq!(m.device.to_string(), "cuda:1"),
        other => panic!("expected local-vlm, got {other:?}"),
    }
    let bad = VlmSettings::from_config_text(
        "[vlm]\nbackend = \"native\"\nmodel = \"local-vlm:/m\"\ndevice = \"tpu\"\n",
    )
    .expect("config");
    let e = bad
        .backend("answer_visual_question")
        .expect_err("no such device");
    assert!(e.to_string().contains("`tpu`"), "{e}");
    let empty =
        VlmSettings::from_config_text("[vlm]\nbackend = \"native\"\nmodel = \"local-vlm: \"\n")
            .expect("config");
    let e = empty
        .backend("answer_visual_question")
        .expect_err("no path");
    assert!(e.to_string().contains("needs a path"), "{e}");
}

/// The error of a call on `spec`'s model, as text.
async fn load_error(spec: &str) -> String {
    let (store, id) = radiograph();
    let tool = AnswerVisualQuestion::new(store, settings(spec, "http://127.0.0.1:9"));
    let err = ask(&tool, &id).await.expect_err("must not load");
    assert!(matches!(err, ToolError::Unprocessable(_)), "{err:?}");
    let msg = err.to_string();
    // Every load failure says what to set.
    assert!(msg.contains("model = \"local-vlm:PATH\""), "{msg}");
    msg
}

#[tokio::test]
async fn missing_or_wrong_files_are_clear_errors_naming_the_path() {
    let dir = tempfile::tempdir().expect("tempdir");
    let missing = dir.path().join("no-such-medgemma");
    let msg = load_error(missing.to_str().expect("utf-8")).await;
    assert!(msg.contains(&*missing.to_string_lossy()), "{msg}");
    assert!(msg.contains("no such file or folder"), "{msg}");

    // A folder that is not a snapshot.
    let msg = load_error(dir.path().to_str().expect("utf-8")).await;
    assert!(
        msg.contains("config.json") && msg.contains("missing"),
        "{msg}"
    );

    // A text GGUF without its mmproj.
    let lone = tempfile::tempdir().expect("tempdir");
    let text = lone.path().join("medgemma.gguf");
    std::fs::copy(tiny().join("text.gguf"), &text).expect("copy");
    let msg = load_error(text.to_str().expect("utf-8")).await;
    assert!(msg.contains("no mmproj*.gguf beside it"), "{msg}");

    // A GGUF of another architecture.
    let other = tempfile::tempdir().expect("tempdir");
    let llama = gguf_pair(other.path(), "llama");
    let msg = load_error(llama.to_str().expect("utf-8")).await;
    assert!(
        msg.contains(&*llama.to_string_lossy()) && msg.contains("architecture `llama`"),
        "{msg}"
    );
}

#[tokio::test]
async fn ground_phrase_says_it_has_no_gemma_backend() {
    let s = VlmSettings::from_config_text(
        "[vlm]\nbackend = \"native\"\nmodel = \"local-vlm:/models/medgemma\"\n",
    )
    .expect("config");
    let (store, id) = radiograph();
    let tool = GroundPhrase::new(store, Arc::new(s));
    assert!(!tool.available(&Environment::default()));
    let err = tool
        .call(
            &ToolContext::default(),
            json!({"image": id, "phrase": "left pleural effusion"}),
        )
        .await
        .expect_err("no native grounding");
    let msg = err.to_string();
    assert!(
        msg.contains("Gemma 3 multimodal") && msg.contains("served grounding model"),
        "{msg}"
    );
}
