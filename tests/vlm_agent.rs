//! The agent with Gemma 3 multimodal as its reasoner (`--llm local-vlm:`), in process: the tiny
//! seeded model of crates/hilum-llm-local/tests/fixtures/gemma3_vlm/tiny (proven against
//! transformers by that crate's `gemma3_vlm` test), the real lung U-Net (imported from
//! ../shared/data/models/lung_seg_unet) behind `segment_lungs`, and a real radiograph.
//!
//! How the run is made deterministic, honestly: the tiny model has random weights and no
//! vocabulary of its own, so the test writes the same weights into a text GGUF with a
//! SentencePiece vocabulary of its 300 ids (the fixture's special tokens at their ids, every
//! byte as a `<0xNN>` token, `▁` for a space): prompts then tokenize and the model's output reads as text. Left
//! to itself the model writes gibberish (greedy), which the agent takes for an answer given
//! before any tool ran; the agent's tool policy sends it back with `require_tool`, and the
//! local backend then starts the turn inside the ReAct call grammar: `Action: segment_lungs`,
//! the one image id and the rest of the arguments are held to the tool's schema, the model
//! choosing only where the schema leaves a choice. The agent parses that text like any ReAct
//! turn and runs the real tool. The model never sees a file name: pixels go in as soft tokens.
//!
//! Checked: (a) the first request carries the image's soft tokens, (b) the call parsed from the
//! model's text runs `segment_lungs` on the real radiograph, (c) with overlays shown the lung
//! overlay goes back as a second picture in the next turn (16 more soft tokens), without them
//! it does not, (d) no connection is made: the proxy and OpenAI variables point at a local
//! listener that counts connections, and it sees none. The events say which model saw which
//! pictures.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use async_trait::async_trait;
use candle_core::quantized::gguf_file;
use candle_core::Device;
use futures::StreamExt;
use hilum::agent::{Agent, AgentConfig, Environment, Event, RunInput, StopReason, Toolbox};
use hilum::llm::{Capabilities, ChatRequest, DeltaStream, ImagePayload, Llm, LlmError};
use hilum::llm_local::{GenStats, LocalConfig, LocalLlm, VlmFiles};
use hilum::tools::SegmentLungs;
use hilum_imaging::ImageStore;
use hilum_models::{ImportOptions, ModelPool, ModelRegistry};

/// Soft tokens per picture of the tiny model.
const PER_IMAGE: usize = 16;

fn shared_data() -> PathBuf {
    let d = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../shared/data");
    assert!(
        d.join("cxr/images").is_dir(),
        "{} is missing: the shared CXR data must be at ../shared/data (see its README)",
        d.display()
    );
    d
}

fn tiny_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("crates/hilum-llm-local/tests/fixtures/gemma3_vlm/tiny")
}

/// The tiny model's 300 ids as a SentencePiece vocabulary: (piece, GGUF token type).
fn vocabulary() -> Vec<(String, i32)> {
    const NORMAL: i32 = 1;
    const CONTROL: i32 = 3;
    const USER_DEFINED: i32 = 4;
    const UNUSED: i32 = 5;
    const BYTE: i32 = 6;
    let fixed: &[(usize, &str, i32)] = &[
        (0, "<pad>", CONTROL),
        (1, "<eos>", CONTROL),
        (2, "<bos>", CONTROL),
        (105, "<start_of_turn>", CONTROL),
        (106, "<end_of_turn>", CONTROL),
        (107, "\n", USER_DEFINED),
        (108, "\n\n", USER_DEFINED),
        (255, "<start_of_image>", CONTROL),
        (256, "<end_of_image>", CONTROL),
        (262, "<image_soft_token>", CONTROL),
    ];
    let mut v: Vec<Option<(String, i32)>> = vec![None; 300];
    for &(i, piece, ty) in fixed {
        v[i] = Some((piece.to_string(), ty));
    }
    let mut byte = 0usize;
    let mut unused = 0usize;
    for slot in v.iter_mut().filter(|s| s.is_none()) {
        *slot = Some(if byte < 256 {
            byte += 1;
            (format!("<0x{:02X}>", byte - 1), BYTE)
        } else if unused == 0 {
            // SentencePiece writes a space as "▁": it needs its piece (Gemma's vocabulary has it).
            unused += 1;
            ("\u{2581}".to_string(), NORMAL)
        } else {
            unused += 1;
            (format!("<unused{unused}>"), UNUSED)
        });
    }
    v.into_iter().flatten().collect()
}

/// The fixture's text GGUF with the vocabulary above and an 8192-token context (rotary
/// positions do not depend on it), and its mmproj GGUF beside it, in `dir`.
fn tokenized_model(dir: &Path) -> PathBuf {
    let src = tiny_dir().join("text.gguf");
    let mut f = std::fs::File::open(&src).expect("tiny text.gguf");
    let ct = gguf_file::Content::read(&mut f).expect("GGUF header");
    let mut names: Vec<&String> = ct.tensor_infos.keys().collect();
    names.sort();
    let tensors: Vec<(String, candle_core::quantized::QTensor)> = names
        .iter()
        .map(|n| {
            let t = ct.tensor(&mut f, n, &Device::Cpu).expect("tensor");
            (n.to_string(), t)
        })
        .collect();
    let vocab = vocabulary();
    use gguf_file::Value;
    let mut md: Vec<(String, Value)> = ct
        .metadata
        .iter()
        .filter(|(k, _)| !k.starts_with("tokenizer.") && k.as_str() != "gemma3.context_length")
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    md.push(("gemma3.context_length".into(), Value::U32(8192)));
    md.push(("tokenizer.ggml.model".into(), Value::String("llama".into())));
    md.push((
        "tokenizer.ggml.tokens".into(),
        Value::Array(
            vocab
                .iter()
                .map(|(p, _)| Value::String(p.clone()))
                .collect(),
        ),
    ));
    md.push((
        "tokenizer.ggml.scores".into(),
        Value::Array(vocab.iter().map(|_| Value::F32(0.0)).collect()),
    ));
    md.push((
        "tokenizer.ggml.token_type".into(),
        Value::Array(vocab.iter().map(|(_, t)| Value::I32(*t)).collect()),
    ));
    md.push(("tokenizer.ggml.bos_token_id".into(), Value::U32(2)));
    md.push(("tokenizer.ggml.eos_token_id".into(), Value::U32(1)));
    md.push(("tokenizer.ggml.add_bos_token".into(), Value::Bool(true)));
    md.push(("tokenizer.ggml.add_space_prefix".into(), Value::Bool(false)));
    let text = dir.join("tiny-text.gguf");
    let mut out = std::fs::File::create(&text).expect("create GGUF");
    let md_refs: Vec<(&str, &Value)> = md.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let t_refs: Vec<(&str, &candle_core::quantized::QTensor)> =
        tensors.iter().map(|(k, t)| (k.as_str(), t)).collect();
    gguf_file::write(&mut out, &md_refs, &t_refs).expect("write GGUF");
    std::fs::copy(tiny_dir().join("mmproj.gguf"), dir.join("mmproj-tiny.gguf")).expect("mmproj");
    text
}

/// The fixture's snapshot folder with a `tokenizer.json` of the same vocabulary (a BPE without
/// merges, byte fallback, spaces as `▁`: what the SentencePiece vocabulary above does) and an
/// 8192-token context, in `dir`.
fn snapshot_model(dir: &Path) -> PathBuf {
    let snap = dir.join("tiny-snapshot");
    std::fs::create_dir_all(&snap).expect("mkdir");
    std::fs::copy(
        tiny_dir().join("model.safetensors"),
        snap.join("model.safetensors"),
    )
    .expect("weights");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(tiny_dir().join("config.json")).unwrap())
            .expect("config.json");
    config["text_config"]["max_position_embeddings"] = 8192.into();
    std::fs::write(snap.join("config.json"), config.to_string()).expect("config");
    let vocab = vocabulary();
    let added: Vec<serde_json::Value> = vocab
        .iter()
        .enumerate()
        .filter(|(_, (_, ty))| matches!(ty, 3 | 4))
        .map(|(i, (p, ty))| {
            serde_json::json!({"id": i, "content": p, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": *ty == 3})
        })
        .collect();
    let pieces: serde_json::Map<String, serde_json::Value> = vocab
        .iter()
        .enumerate()
        .map(|(i, (p, _))| (p.clone(), i.into()))
        .collect();
    let tokenizer = serde_json::json!({
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

/// The tiny model as `--llm local-vlm:` loads it: the GGUF pair (`snapshot` false) or the
/// snapshot folder.
fn load_vlm(snapshot: bool) -> (tempfile::TempDir, Arc<LocalLlm>) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = if snapshot {
        snapshot_model(dir.path())
    } else {
        tokenized_model(dir.path())
    };
    // The mmproj is found beside the text GGUF, as `--llm local-vlm:TEXT.gguf` finds it.
    let files = VlmFiles::parse(path.to_str().expect("utf-8 path")).expect("spec");
    let mut cfg = LocalConfig::new(&path);
    cfg.context = 8192;
    cfg.max_tokens = 160;
    // Greedy decoding of random weights loops; the guard would stop the free turns early.
    cfg.repetition_window = 100_000;
    let llm = LocalLlm::load_vlm(cfg, files).expect("tiny VLM loads");
    (dir, Arc::new(llm))
}

/// The real model, recording what each request cost (its prompt's pictures and soft tokens).
struct Recording {
    llm: Arc<LocalLlm>,
    seen: Mutex<Vec<(usize, GenStats)>>,
}

#[async_trait]
impl Llm for Recording {
    async fn chat(&self, req: ChatRequest) -> Result<DeltaStream, LlmError> {
        let payloads = req.images.len();
        let items: Vec<_> = self.llm.chat(req).await?.collect().await;
        if let Ok(mut s) = self.seen.lock() {
            s.push((payloads, self.llm.last_stats()));
        }
        Ok(Box::pin(futures::stream::iter(items)))
    }
    fn capabilities(&self) -> Capabilities {
        self.llm.capabilities()
    }
    fn name(&self) -> String {
        self.llm.name()
    }
}

/// Points every proxy and OpenAI variable at a local listener; returns its connection count.
fn network_trap() -> Arc<AtomicUsize> {
    static TRAP: OnceLock<Arc<AtomicUsize>> = OnceLock::new();
    TRAP.get_or_init(|| {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        let count = Arc::new(AtomicUsize::new(0));
        let c = count.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                c.fetch_add(1, Ordering::SeqCst);
                drop(conn);
            }
        });
        let url = format!("http://{addr}");
        for k in [
            "HTTP_PROXY",
            "HTTPS_PROXY",
            "ALL_PROXY",
            "http_proxy",
            "https_proxy",
            "all_proxy",
        ] {
            std::env::set_var(k, &url);
        }
        std::env::set_var("NO_PROXY", "");
        std::env::set_var("OPENAI_BASE_URL", format!("{url}/v1"));
        std::env::set_var("OPENAI_API_KEY", "sk-must-not-be-used");
        count
    })
    .clone()
}

fn lung_models() -> Arc<ModelPool> {
    static POOL: OnceLock<(tempfile::TempDir, Arc<ModelPool>)> = OnceLock::new();
    POOL.get_or_init(|| {
        let dir = tempfile::tempdir().expect("tempdir");
        let reg = ModelRegistry::new(dir.path()).expect("registry");
        let h5 = shared_data().join("models/lung_seg_unet/lung_seg_valiou_088.h5");
        hilum_models::import(&reg, "lung-unet", &h5, &ImportOptions::default())
            .expect("import lung-unet");
        (dir, Arc::new(ModelPool::new(Arc::new(reg))))
    })
    .1
    .clone()
}

/// The radiograph as `hilum analyze` hands a local multimodal model its pixels: an 8-bit PNG.
fn payload(store: &ImageStore, id: &str) -> ImagePayload {
    let img = store.get(id).expect("image");
    let scale = 255.0 / img.max_value().max(1.0);
    let grey: Vec<u8> = img
        .pixels
        .iter()
        .map(|&v| (v * scale).round().clamp(0.0, 255.0) as u8)
        .collect();
    let png = hilum_imaging::encode_png(img.width, img.height, &grey, 1).expect("png");
    ImagePayload {
        id: id.to_string(),
        data_url: format!("data:image/png;base64,{}", hilum::llm::base64_encode(&png)),
    }
}

struct Run {
    outcome: hilum::agent::RunOutcome,
    seen: Vec<(usize, GenStats)>,
    events: Vec<Event>,
    id: String,
    name: String,
}

async fn run(show_overlays: bool, snapshot: bool) -> Run {
    let (_dir, llm) = load_vlm(snapshot);
    let name = llm.name();
    let store = Arc::new(ImageStore::default());
    let id = store
        .ingest_file(&shared_data().join("cxr/images/covid_pneumocystis-pneumonia-1.jpg"))
        .expect("real radiograph decodes");
    let mut toolbox = Toolbox::new();
    toolbox
        .register(Arc::new(SegmentLungs::new(store.clone(), lung_models())))
        .expect("register");
    let rec = Arc::new(Recording {
        llm,
        seen: Mutex::new(Vec::new()),
    });
    let config = AgentConfig {
        max_rounds: 2,
        max_observation_chars: 0,
        grounding: false,
        show_overlays: Some(show_overlays),
        ..AgentConfig::default()
    };
    let agent = Agent::new(
        rec.clone(),
        Arc::new(toolbox),
        Environment::default(),
        config,
    );
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let outcome = agent
        .run(
            RunInput {
                question: "How large are the lungs in this image?".into(),
                images: vec![id.clone()],
                image_payloads: vec![payload(&store, &id)],
                ..Default::default()
            },
            Some(tx),
        )
        .await;
    let mut events = Vec::new();
    while let Ok(ev) = rx.try_recv() {
        events.push(ev.event);
    }
    let seen = rec.seen.lock().map(|s| s.clone()).unwrap_or_default();
    Run {
        outcome,
        seen,
        events,
        id,
        name,
    }
}

/// The turn after the tool ran: the first request made after a result came in.
fn after_tool(r: &Run) -> &(usize, GenStats) {
    let tool_turn = r
        .events
        .iter()
        .filter(|e| matches!(e, Event::Decision { .. }))
        .position(|e| matches!(e, Event::Decision { tool_calls, .. } if !tool_calls.is_empty()))
        .expect("a decision with a tool call");
    r.seen
        .get(tool_turn + 1)
        .unwrap_or_else(|| panic!("no request after the tool turn: {:?}", r.seen))
}

fn check_common(r: &Run) {
    eprintln!(
        "{:?} after {} round(s), {} call(s); requests (pictures, soft tokens, prompt tokens): {:?}",
        r.outcome.reason,
        r.outcome.rounds,
        r.outcome.tool_calls,
        r.seen
            .iter()
            .map(|(p, s)| (*p, s.images, s.image_tokens, s.prompt_tokens))
            .collect::<Vec<_>>()
    );
    assert!(
        matches!(
            r.outcome.reason,
            StopReason::Answered | StopReason::MaxRounds
        ),
        "{:?} {:?}",
        r.outcome.reason,
        r.outcome.error
    );
    // (a) The first request carries the radiograph's soft tokens.
    let (payloads, first) = &r.seen[0];
    assert_eq!(*payloads, 1);
    assert_eq!((first.images, first.image_tokens), (1, PER_IMAGE));
    // (b) A call parsed from the model's text ran the real tool on the real image.
    let seg: Vec<_> = r
        .outcome
        .results
        .iter()
        .filter(|c| c.call.name == "segment_lungs" && c.call.id.starts_with("react_"))
        .collect();
    assert!(
        !seg.is_empty(),
        "no segment_lungs call: {:#?}",
        r.outcome.messages
    );
    eprintln!(
        "the model's call: {} {}",
        seg[0].call.name, seg[0].call.arguments
    );
    let out = seg[0].result.as_ref().expect("segment_lungs succeeded");
    assert_eq!(
        seg[0].arguments.as_ref().expect("arguments")["image"],
        r.id.as_str()
    );
    assert!(
        out.data["lungs_found"].as_u64().unwrap_or(0) >= 1,
        "{}",
        out.summary
    );
    assert!(out.artifacts.iter().any(|a| a.kind == "overlay"));
    // The events name the model and the pictures it read.
    let complete = r.events.iter().find_map(|e| match e {
        Event::Complete {
            model, images_seen, ..
        } => Some((model.clone(), images_seen.clone())),
        _ => None,
    });
    let (model, images_seen) = complete.expect("complete event");
    assert_eq!(model, r.name);
    assert!(model.starts_with("local-vlm:"), "{model}");
    assert_eq!(images_seen.first(), Some(&r.id));
    match r
        .events
        .iter()
        .find(|e| matches!(e, Event::Decision { .. }))
    {
        Some(Event::Decision { images, .. }) => assert_eq!(images, &vec![r.id.clone()]),
        _ => unreachable!(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vlm_reads_the_image_calls_a_tool_and_sees_its_overlay() {
    let trap = network_trap();
    let r = run(true, false).await;
    check_common(&r);
    // (c) The overlay went back as a second picture.
    let (payloads, next) = after_tool(&r);
    assert_eq!(*payloads, 2);
    assert_eq!((next.images, next.image_tokens), (2, 2 * PER_IMAGE));
    let overlay_id = format!("ovl_{}", r.outcome.results[0].call.id);
    let (_, seen) = match r
        .events
        .iter()
        .find(|e| matches!(e, Event::Complete { .. }))
    {
        Some(Event::Complete {
            model, images_seen, ..
        }) => (model, images_seen),
        _ => unreachable!(),
    };
    assert_eq!(seen, &vec![r.id.clone(), overlay_id]);
    // (d) Nothing left the process.
    assert_eq!(trap.load(Ordering::SeqCst), 0, "a connection was made");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_overlays_the_next_turn_has_the_question_image_only() {
    let trap = network_trap();
    let r = run(false, false).await;
    check_common(&r);
    let (payloads, next) = after_tool(&r);
    assert_eq!(*payloads, 1);
    assert_eq!((next.images, next.image_tokens), (1, PER_IMAGE));
    assert_eq!(trap.load(Ordering::SeqCst), 0, "a connection was made");
}

/// The same from the snapshot folder (safetensors, `tokenizer.json`): the same soft tokens, call
/// and overlay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_folder_reasons_the_same_way() {
    let trap = network_trap();
    let r = run(true, true).await;
    check_common(&r);
    let (payloads, next) = after_tool(&r);
    assert_eq!(*payloads, 2);
    assert_eq!((next.images, next.image_tokens), (2, 2 * PER_IMAGE));
    assert_eq!(trap.load(Ordering::SeqCst), 0, "a connection was made");
}
