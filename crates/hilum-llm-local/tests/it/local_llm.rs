//! The local GGUF backend on the real Qwen2.5-Coder-0.5B-Instruct model.
//!
//! The model (491 MB) is not in the repository: `scripts/fetch_local_llm.sh` puts it under
//! `$HILUM_MODELS_DIR` (default `~/.local/share/hilum/models`); `HILUM_LOCAL_LLM=path.gguf` points at
//! another file. Without it these tests print why and pass without checking anything.

use std::path::PathBuf;
use std::sync::OnceLock;

use candle_core::quantized::gguf_file;
use candle_core::Device;
use hilum_llm::{collect_turn, ChatRequest, FinishReason, Llm, Message, ToolSpec};
use hilum_llm_local::model::{MatmulMode, Model};
use hilum_llm_local::{GgufTokenizer, LocalLlm, PrefixSource};
use serde_json::{json, Value};

use crate::common;
use common::default_model_path;

fn model_path() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("HILUM_LOCAL_LLM") {
        let p = PathBuf::from(p);
        assert!(
            p.is_file(),
            "HILUM_LOCAL_LLM={} does not exist",
            p.display()
        );
        return Some(p);
    }
    let p = default_model_path();
    if p.is_none() {
        eprintln!(
            "SKIPPED: local model not installed; run scripts/fetch_local_llm.sh (or set HILUM_LOCAL_LLM)"
        );
    }
    p
}

/// One loaded model per test binary (loading dequantizes ~500 MB of weights).
fn llm() -> Option<&'static LocalLlm> {
    static LLM: OnceLock<Option<LocalLlm>> = OnceLock::new();
    LLM.get_or_init(|| {
        let path = model_path()?;
        let mut cfg = common::local_config(&path);
        cfg.context = 2048;
        Some(LocalLlm::load(cfg).expect("the installed GGUF loads"))
    })
    .as_ref()
}

/// Tests that look at `last_stats` or the cache must not interleave.
async fn serial() -> tokio::sync::MutexGuard<'static, ()> {
    static LOCK: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    LOCK.lock().await
}

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/local_llm")
        .join(name)
}

/// Compares the GGUF tokenizer with a reference corpus fixture; returns how many cases were
/// compared. Cases whose text changes under NFC are left out when `skip_nfc_changes`.
fn check_corpus(tok: &GgufTokenizer, name: &str, skip_nfc_changes: bool) -> usize {
    let text = std::fs::read_to_string(fixture(name))
        .expect("fixture from scripts/fixtures/gen_llm_tokenizer_fixture.py");
    let v: Value = serde_json::from_str(&text).unwrap();
    let cases = v["cases"].as_array().unwrap();
    assert!(cases.len() >= 20);
    let mut mismatches = Vec::new();
    let mut compared = 0;
    for c in cases {
        if skip_nfc_changes && c["changes_under_nfc"].as_bool() == Some(true) {
            continue;
        }
        compared += 1;
        let s = c["text"].as_str().unwrap();
        let want: Vec<u32> = c["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect();
        let got = tok.encode(s).unwrap();
        if got != want {
            mismatches.push(format!("{s:?}\n  got  {got:?}\n  want {want:?}"));
        }
    }
    assert!(mismatches.is_empty(), "{name}: {}", mismatches.join("\n"));
    compared
}

#[test]
fn tokenization_matches_reference_corpus() {
    let Some(path) = model_path() else { return };
    let tok = GgufTokenizer::from_file(&path).unwrap();
    check_corpus(&tok, "tokenization.json", false);
    // Special tokens are single tokens, and decoding restores the text.
    let ids = tok.encode("<tool_call>\n{}</tool_call><|im_end|>").unwrap();
    assert_eq!(ids[0], tok.special("<tool_call>").unwrap());
    assert_eq!(*ids.last().unwrap(), tok.eos);
    assert_eq!(tok.decode(&ids), "<tool_call>\n{}</tool_call><|im_end|>");
}

/// llama.cpp's own tokenization (llama-cpp-python 0.3.36) of the same corpus. The one known
/// difference: llama.cpp does not NFC-normalise, Qwen's tokenizer (and Hilum) does, so texts
/// that change under NFC are compared with the Hugging Face reference above instead.
#[test]
fn tokenization_matches_llama_cpp() {
    let Some(path) = model_path() else { return };
    let tok = GgufTokenizer::from_file(&path).unwrap();
    let compared = check_corpus(&tok, "tokenization_llamacpp.json", true);
    assert!(compared >= 27, "only {compared} cases compared");
}

#[test]
fn chat_template_from_the_gguf_renders_tools_and_calls() {
    let Some(llm) = llm() else { return };
    let tools = vec![ToolSpec {
        name: "image_info".into(),
        description: "Size of an image.".into(),
        parameters: json!({"type": "object", "properties": {"image": {"type": "string"}}, "required": ["image"]}),
    }];
    let call = hilum_llm::ToolCall::new("c1", "image_info", &json!({"image": "img_aa"}));
    let msgs = vec![
        Message::system("SYS"),
        Message::user("Q", vec![]),
        Message::assistant("", vec![call]),
        Message::Tool {
            tool_call_id: "c1".into(),
            name: "image_info".into(),
            content: "{\"width\": 5}".into(),
            is_error: false,
        },
    ];
    let p = llm.template().render(&msgs, &tools, true).unwrap();
    assert!(p.starts_with("<|im_start|>system\nSYS\n\n# Tools\n"), "{p}");
    assert!(
        p.contains("\"type\": \"function\"") && p.contains("\"name\": \"image_info\""),
        "{p}"
    );
    assert!(p.contains("<|im_start|>assistant\n<tool_call>\n{\"name\": \"image_info\", \"arguments\": {\"image\": \"img_aa\"}}\n</tool_call><|im_end|>\n"), "{p}");
    assert!(
        p.contains(
            "<|im_start|>user\n<tool_response>\n{\"width\": 5}\n</tool_response><|im_end|>\n"
        ),
        "{p}"
    );
    assert!(p.ends_with("<|im_start|>assistant\n"), "{p}");
}

/// The model file here is our own forward pass; candle-transformers' `quantized_qwen2` is an
/// independent one over the same GGUF. They must agree on the next token and nearly on logits.
#[test]
fn forward_pass_agrees_with_candle_quantized_qwen2() {
    let Some(path) = model_path() else { return };
    let tok = GgufTokenizer::from_file(&path).unwrap();
    let prompt = "<|im_start|>user\nWhat is the largest organ in the chest?<|im_end|>\n<|im_start|>assistant\n";
    let ids = tok.encode(prompt).unwrap();
    let dev = Device::Cpu;
    let mut f = std::fs::File::open(&path).unwrap();
    let ct = gguf_file::Content::read(&mut f).unwrap();
    let mut ours = Model::load(&ct, &mut f, 256, MatmulMode::Dense, &dev).unwrap();
    let a: Vec<f32> = ours.forward(&ids).unwrap().to_vec1().unwrap();
    let mut f = std::fs::File::open(&path).unwrap();
    let ct = gguf_file::Content::read(&mut f).unwrap();
    let mut reference =
        candle_transformers::models::quantized_qwen2::ModelWeights::from_gguf(ct, &mut f, &dev)
            .unwrap();
    let input = candle_core::Tensor::new(ids.as_slice(), &dev)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    let b: Vec<f32> = reference
        .forward(&input, 0)
        .unwrap()
        .squeeze(0)
        .unwrap()
        .to_vec1()
        .unwrap();
    assert_eq!(a.len(), b.len());
    let argmax = |v: &[f32]| {
        v.iter()
            .enumerate()
            .max_by(|x, y| x.1.total_cmp(y.1))
            .map(|(i, _)| i)
            .unwrap()
    };
    assert_eq!(argmax(&a), argmax(&b), "next token differs");
    // candle quantizes activations to 8 bits inside its matmuls; we do not: small differences.
    let max_abs = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    let range =
        b.iter().fold(f32::MIN, |m, &x| m.max(x)) - b.iter().fold(f32::MAX, |m, &x| m.min(x));
    assert!(
        max_abs < 0.05 * range,
        "max |diff| {max_abs} vs logit range {range}"
    );
    // And a second token through the KV cache agrees too.
    let next = argmax(&a) as u32;
    let a2: Vec<f32> = ours.forward(&[next]).unwrap().to_vec1().unwrap();
    let input = candle_core::Tensor::new(&[next], &dev)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    let b2: Vec<f32> = reference
        .forward(&input, ids.len())
        .unwrap()
        .squeeze(0)
        .unwrap()
        .to_vec1()
        .unwrap();
    assert_eq!(argmax(&a2), argmax(&b2));
}

fn load_model(path: &std::path::Path, mode: MatmulMode) -> Model {
    let mut f = std::fs::File::open(path).unwrap();
    let ct = gguf_file::Content::read(&mut f).unwrap();
    Model::load(&ct, &mut f, 512, mode, &Device::Cpu).unwrap()
}

/// Largest |a - b| relative to the logit range of `b`.
fn rel_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let max_abs = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    let range =
        b.iter().fold(f32::MIN, |m, &x| m.max(x)) - b.iter().fold(f32::MAX, |m, &x| m.min(x));
    max_abs / range
}

/// Decode through quantized dot products (Q5_0 re-quantized to Q8_0, Q4_K/Q6_K/Q8_0 as stored)
/// must give the same greedy continuation as f32 weights, with logits close at every step; the
/// all-quantized prompt pass must agree with the f32 one too.
#[test]
fn quantized_matmuls_agree_with_dense_weights() {
    let Some(path) = model_path() else { return };
    let tok = GgufTokenizer::from_file(&path).unwrap();
    let prompt = "<|im_start|>system\nYou analyse chest X-rays.<|im_end|>\n<|im_start|>user\nName three structures visible on a frontal chest radiograph.<|im_end|>\n<|im_start|>assistant\n";
    let ids = tok.encode(prompt).unwrap();
    let mut dense = load_model(&path, MatmulMode::Dense);
    let mut hybrid = load_model(&path, MatmulMode::Hybrid);
    let mut quant = load_model(&path, MatmulMode::Quantized);

    let d: Vec<f32> = dense.forward(&ids).unwrap().to_vec1().unwrap();
    let q: Vec<f32> = quant.forward(&ids).unwrap().to_vec1().unwrap();
    let r = rel_diff(&q, &d);
    assert!(
        r < 0.03,
        "quantized prompt logits differ by {r} of the range"
    );
    // The hybrid prompt pass is the dense one; from then on every token is a one-row product.
    let mut ld = d;
    let mut lh: Vec<f32> = hybrid.forward(&ids).unwrap().to_vec1().unwrap();
    let (mut seq_d, mut seq_h) = (Vec::new(), Vec::new());
    let mut worst = 0f32;
    for _ in 0..24 {
        worst = worst.max(rel_diff(&lh, &ld));
        let pick = |v: &[f32]| {
            v.iter()
                .enumerate()
                .max_by(|x, y| x.1.total_cmp(y.1))
                .map(|(i, _)| i as u32)
                .unwrap()
        };
        let (nd, nh) = (pick(&ld), pick(&lh));
        seq_d.push(nd);
        seq_h.push(nh);
        if nd != nh {
            break;
        }
        ld = dense.forward(&[nd]).unwrap().to_vec1().unwrap();
        lh = hybrid.forward(&[nh]).unwrap().to_vec1().unwrap();
    }
    eprintln!(
        "greedy continuation: {:?}; worst decode logit diff {worst} of the range",
        tok.decode(&seq_d)
    );
    assert_eq!(seq_h, seq_d, "quantized decode chose other tokens");
    assert!(worst < 0.03, "decode logits differ by {worst} of the range");
}

/// A few rows (a grammar-forced batch) run row by row on the GGUF blocks in hybrid mode; they
/// must give the logits the dense chunk gives.
#[test]
fn a_short_chunk_on_the_blocks_agrees_with_the_dense_chunk() {
    let Some(path) = model_path() else { return };
    let tok = GgufTokenizer::from_file(&path).unwrap();
    let ids = tok
        .encode("<|im_start|>user\nHi there<|im_end|>\n")
        .unwrap();
    assert!(ids.len() > 1 && ids.len() <= 12, "{} tokens", ids.len());
    let mut dense = load_model(&path, MatmulMode::Dense);
    let mut hybrid = load_model(&path, MatmulMode::Hybrid);
    let d: Vec<f32> = dense.forward(&ids).unwrap().to_vec1().unwrap();
    let h: Vec<f32> = hybrid.forward(&ids).unwrap().to_vec1().unwrap();
    let r = rel_diff(&h, &d);
    assert!(r < 0.03, "short-chunk logits differ by {r} of the range");
}

fn segment_tool() -> ToolSpec {
    ToolSpec {
        name: "segment_lungs".into(),
        description: "Segments the lung fields of a chest X-ray and returns their areas.".into(),
        parameters: json!({
            "type": "object",
            "properties": {
                "image": {"type": "string", "pattern": "^img_[0-9a-f]{6,64}$", "description": "Image id"},
                "view": {"type": "string", "enum": ["PA", "AP", "lateral"], "description": "Projection"},
                "threshold": {"type": "number", "minimum": 0, "maximum": 1, "description": "Probability threshold"}
            },
            "required": ["image", "view", "threshold"],
            "additionalProperties": false
        }),
    }
}

fn info_tool() -> ToolSpec {
    ToolSpec {
        name: "image_info".into(),
        description: "Size, bit depth and intensity statistics of an image.".into(),
        parameters: json!({
            "type": "object",
            "properties": {"image": {"type": "string", "description": "Image id"}},
            "required": ["image"],
            "additionalProperties": false
        }),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn constrained_tool_call_is_valid_against_its_schema() {
    let Some(llm) = llm() else { return };
    let _g = serial().await;
    let tools = vec![info_tool(), segment_tool()];
    let req = ChatRequest {
        messages: vec![
            Message::system("You analyse chest X-rays with tools."),
            Message::user(
                "Segment the lungs of this PA radiograph with threshold 0.5.\n\nImages: img_3fa2c1b4",
                vec!["img_3fa2c1b4".into()],
            ),
        ],
        tools: tools.clone(),
        max_tokens: Some(48),
        ..Default::default()
    };
    let turn = collect_turn(llm.chat(req).await.unwrap(), |_| {})
        .await
        .unwrap();
    assert_eq!(turn.finish, FinishReason::ToolCalls, "{turn:?}");
    assert!(!turn.tool_calls.is_empty());
    for call in &turn.tool_calls {
        let spec = tools
            .iter()
            .find(|t| t.name == call.name)
            .unwrap_or_else(|| panic!("unknown tool {}", call.name));
        let args: Value = serde_json::from_str(&call.arguments)
            .unwrap_or_else(|e| panic!("arguments are not JSON ({e}): {}", call.arguments));
        let validator = jsonschema::validator_for(&spec.parameters).unwrap();
        let errors: Vec<String> = validator
            .iter_errors(&args)
            .map(|e| e.to_string())
            .collect();
        assert!(
            errors.is_empty(),
            "{} {}: {errors:?}",
            call.name,
            call.arguments
        );
        // Image arguments are restricted to the ids of the conversation.
        assert_eq!(args["image"], "img_3fa2c1b4");
    }
    let stats = llm.last_stats();
    assert!(stats.first_tool_call_secs.is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn next_round_reuses_the_cached_prefix_and_answers_the_same() {
    let Some(llm) = llm() else { return };
    let _g = serial().await;
    let mut messages = vec![
        Message::system("Answer in one short sentence."),
        Message::user("Name one bone of the chest wall.", vec![]),
    ];
    let req = |m: &Vec<Message>| ChatRequest {
        messages: m.clone(),
        max_tokens: Some(16),
        ..Default::default()
    };
    let first = collect_turn(llm.chat(req(&messages)).await.unwrap(), |_| {})
        .await
        .unwrap();
    assert!(!first.text.trim().is_empty());
    messages.push(Message::assistant(first.text.clone(), vec![]));
    messages.push(Message::user("Name another one.", vec![]));

    let mut streamed = String::new();
    let second = collect_turn(llm.chat(req(&messages)).await.unwrap(), |t| {
        streamed.push_str(t)
    })
    .await
    .unwrap();
    assert_eq!(streamed, second.text, "text arrives as token deltas");
    let warm = llm.last_stats();
    assert!(warm.reused_tokens > 20, "{warm:?}");
    assert!(warm.prefill_tokens < warm.prompt_tokens / 2, "{warm:?}");

    llm.reset_cache();
    let fresh = collect_turn(llm.chat(req(&messages)).await.unwrap(), |_| {})
        .await
        .unwrap();
    let cold = llm.last_stats();
    assert_eq!(cold.reused_tokens, 0);
    assert_eq!(cold.prefill_tokens, cold.prompt_tokens);
    assert_eq!(fresh.text, second.text, "KV reuse changed the answer");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_tokens_and_stop_sequences_end_generation() {
    let Some(llm) = llm() else { return };
    let _g = serial().await;
    let msgs = vec![Message::user(
        "Count from 1 to 50, separated by commas.",
        vec![],
    )];
    let turn = collect_turn(
        llm.chat(ChatRequest {
            messages: msgs.clone(),
            max_tokens: Some(6),
            ..Default::default()
        })
        .await
        .unwrap(),
        |_| {},
    )
    .await
    .unwrap();
    assert_eq!(turn.finish, FinishReason::Length);
    assert_eq!(turn.usage.completion_tokens, 6);

    let turn = collect_turn(
        llm.chat(ChatRequest {
            messages: msgs,
            max_tokens: Some(40),
            stop: vec!["5".into()],
            ..Default::default()
        })
        .await
        .unwrap(),
        |_| {},
    )
    .await
    .unwrap();
    assert_eq!(turn.finish, FinishReason::Stop);
    assert!(
        turn.text.contains('4') && !turn.text.contains('5'),
        "{:?}",
        turn.text
    );
}

/// `choices`: the reply is exactly one of them, the one the conversation supports; a single
/// choice is returned as is; tools in the request only shape the prompt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_answer_is_one_of_the_choices() {
    let Some(llm) = llm() else { return };
    let _g = serial().await;
    let ask = |text: &str, choices: &[&str]| ChatRequest {
        messages: vec![Message::user(text, vec![])],
        tools: vec![info_tool()],
        choices: choices.iter().map(|c| c.to_string()).collect(),
        ..Default::default()
    };
    let bits = ["8-bit", "12-bit", "16-bit"];
    for (said, want) in [("16-bit", "16-bit"), ("8-bit", "8-bit")] {
        let q = format!(
            "The image_info tool says: 2048x2500 px, {said} grayscale PNG. \
             What is the bit depth of the image? Reply with the option only."
        );
        let turn = collect_turn(llm.chat(ask(&q, &bits)).await.unwrap(), |_| {})
            .await
            .unwrap();
        assert_eq!(turn.text, want);
        assert!(turn.tool_calls.is_empty());
        assert_eq!(turn.finish, FinishReason::Stop);
    }
    let one = collect_turn(llm.chat(ask("Anything?", &["PA"])).await.unwrap(), |_| {})
        .await
        .unwrap();
    assert_eq!(one.text, "PA");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompt_longer_than_the_context_is_a_clear_error() {
    let Some(llm) = llm() else { return };
    let _g = serial().await;
    let huge = "lung ".repeat(3000);
    let err = match llm
        .chat(ChatRequest {
            messages: vec![Message::user(huge, vec![])],
            ..Default::default()
        })
        .await
    {
        Ok(_) => panic!("a prompt over the context must be refused"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("context"), "{err}");
}

/// A conversation where `image_info` already ran and its result is in.
fn after_one_call(id: &str) -> Vec<Message> {
    vec![
        Message::system("You analyse chest X-rays with tools."),
        Message::user(
            format!("What are the size and bit depth of this image?\n\nImages: {id}"),
            vec![id.into()],
        ),
        Message::assistant(
            "",
            vec![hilum_llm::ToolCall::new(
                "call_0",
                "image_info",
                &json!({ "image": id }),
            )],
        ),
        Message::Tool {
            tool_call_id: "call_0".into(),
            name: "image_info".into(),
            content: format!("{id}: 2048x2500 px, 8-bit grayscale PNG; mean 121.4"),
            is_error: false,
        },
    ]
}

fn assert_prose(text: &str) {
    let t = text.trim();
    assert!(!t.is_empty(), "empty answer");
    assert!(
        !t.contains('{') && !t.contains("tool_call") && !t.starts_with('`'),
        "not prose: {text:?}"
    );
}

/// Offered the same tool again, the model may not repeat the call whose result it has: the
/// turn ends as a prose answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_already_answered_is_not_repeated_and_the_turn_is_prose() {
    let Some(llm) = llm() else { return };
    let _g = serial().await;
    let id = "img_5d41402abc4b";
    let req = ChatRequest {
        messages: after_one_call(id),
        tools: vec![info_tool()],
        max_tokens: Some(80),
        ..Default::default()
    };
    let turn = collect_turn(llm.chat(req).await.unwrap(), |_| {})
        .await
        .unwrap();
    let repeated = turn.tool_calls.iter().any(|c| {
        c.name == "image_info"
            && serde_json::from_str::<Value>(&c.arguments).ok() == Some(json!({ "image": id }))
    });
    assert!(!repeated, "{turn:?}");
    if turn.tool_calls.is_empty() {
        assert_prose(&turn.text);
    }
}

/// Without tools (the agent's synthesis turn) the answer is prose, never a call written as JSON.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_without_tools_is_prose() {
    let Some(llm) = llm() else { return };
    let _g = serial().await;
    let mut messages = after_one_call("img_5d41402abc4b");
    messages.push(Message::user(
        "No more tools can be called. Give your final answer now from the tool results above.",
        vec![],
    ));
    let req = ChatRequest {
        messages,
        max_tokens: Some(80),
        ..Default::default()
    };
    let turn = collect_turn(llm.chat(req).await.unwrap(), |_| {})
        .await
        .unwrap();
    assert!(turn.tool_calls.is_empty());
    assert_prose(&turn.text);
}

/// A call cut by max_tokens is an error that says what to raise, not a half call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tool_call_cut_by_max_tokens_is_a_clear_error() {
    let Some(llm) = llm() else { return };
    let _g = serial().await;
    let req = ChatRequest {
        messages: vec![
            Message::system("You analyse chest X-rays with tools."),
            Message::user(
                "Segment the lungs of this PA radiograph with threshold 0.5.\n\nImages: img_3fa2c1b4",
                vec!["img_3fa2c1b4".into()],
            ),
        ],
        tools: vec![info_tool(), segment_tool()],
        max_tokens: Some(8),
        ..Default::default()
    };
    let err = collect_turn(llm.chat(req).await.unwrap(), |_| {})
        .await
        .expect_err("8 tokens cannot hold this tool call");
    assert!(err.to_string().contains("max_tokens"), "{err}");
}

/// Endless repetition stops with an error naming the problem (a model of its own: the window
/// is part of the load-time configuration).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endless_repetition_is_stopped_with_a_clear_error() {
    let Some(path) = model_path() else { return };
    let _g = serial().await;
    let mut cfg = common::local_config(&path);
    cfg.context = 512;
    cfg.repetition_window = 12;
    let llm = LocalLlm::load(cfg).unwrap();
    let req = ChatRequest {
        messages: vec![Message::user(
            format!(
                "Continue this text for as long as you can, without anything else: {}",
                "ha ".repeat(40)
            ),
            vec![],
        )],
        max_tokens: Some(300),
        ..Default::default()
    };
    let err = collect_turn(llm.chat(req).await.unwrap(), |_| {})
        .await
        .expect_err("a loop must be stopped");
    assert!(err.to_string().contains("repeated"), "{err}");
}

/// The agent's system prompt (shortened) and one tool: a prefix long enough for the prefix cache.
fn prefix_request(system: &str) -> ChatRequest {
    ChatRequest {
        messages: vec![
            Message::system(system),
            Message::user(
                "How large is this image?\n\nImages: img_aa",
                vec!["img_aa".into()],
            ),
        ],
        tools: vec![ToolSpec {
            name: "image_info".into(),
            description: "Size, bit depth and intensity statistics of an image.".into(),
            parameters: json!({"type": "object", "properties": {"image": {"type": "string", "description": "image id, e.g. img_3fa2c1"}}, "required": ["image"]}),
        }],
        max_tokens: Some(40),
        ..Default::default()
    }
}

const PREFIX_SYSTEM: &str = "You are Hilum, an assistant that analyses chest X-rays with tools. \
Images are referred to by ids such as img_3fa2c1; pass these ids to tools. \
Base every finding on tool results and say which result supports it; never invent numbers. \
When several tools are needed and do not depend on each other, call them all in the same turn.";

/// What a turn produced, for comparing two runs token for token (greedy).
fn turn_key(t: &hilum_llm::AssistantTurn) -> (String, Vec<(String, String)>) {
    (
        t.text.clone(),
        t.tool_calls
            .iter()
            .map(|c| (c.name.clone(), c.arguments.clone()))
            .collect(),
    )
}

/// In one process (`hilum serve`, `hilum eval`): a question after another system prompt gets
/// the first system prompt's KV state back from memory, answers the same and prefills less.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_system_prompt_state_is_reused_from_memory_across_questions() {
    let Some(llm) = llm() else { return };
    let _g = serial().await;
    llm.reset_cache();
    let first = collect_turn(
        llm.chat(prefix_request(PREFIX_SYSTEM)).await.unwrap(),
        |_| {},
    )
    .await
    .unwrap();
    let cold = llm.last_stats();
    assert!(cold.prefix_tokens >= 64, "{cold:?}");
    assert_eq!(cold.prefix_source, None);
    assert_eq!(cold.reused_tokens, 0);

    // Another system prompt: nothing of the first one's state is taken.
    let other = format!("{PREFIX_SYSTEM} Answer in French.");
    collect_turn(llm.chat(prefix_request(&other)).await.unwrap(), |_| {})
        .await
        .unwrap();
    let s = llm.last_stats();
    assert_eq!(s.prefix_source, None, "{s:?}");
    assert!(s.reused_tokens < cold.prefix_tokens, "{s:?}");

    let again = collect_turn(
        llm.chat(prefix_request(PREFIX_SYSTEM)).await.unwrap(),
        |_| {},
    )
    .await
    .unwrap();
    let warm = llm.last_stats();
    assert_eq!(warm.prefix_source, Some(PrefixSource::Memory), "{warm:?}");
    assert_eq!(warm.reused_tokens, cold.prefix_tokens);
    assert_eq!(warm.prefill_tokens, cold.prompt_tokens - cold.prefix_tokens);
    assert_eq!(
        turn_key(&again),
        turn_key(&first),
        "a restored prefix changed the answer"
    );
}

/// Across processes (the CLI): a new model instance with the same cache folder restores the
/// saved prefix — same greedy answer, a fraction of the prefill time; a different system
/// prompt finds nothing to reuse.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_saved_prompt_prefix_is_reused_by_a_new_process_only_when_it_matches() {
    let Some(path) = model_path() else { return };
    let _g = serial().await;
    let dir = tempfile::tempdir().unwrap();
    let load = || {
        let mut cfg = common::local_config(&path);
        cfg.context = 2048;
        cfg.prefix_cache_dir = Some(dir.path().join("kv"));
        LocalLlm::load(cfg).unwrap()
    };
    let ask = |llm: LocalLlm, system: &'static str| async move {
        let turn = collect_turn(llm.chat(prefix_request(system)).await.unwrap(), |_| {})
            .await
            .unwrap();
        (turn_key(&turn), llm.last_stats())
    };
    let (first, cold) = ask(load(), PREFIX_SYSTEM).await;
    assert_eq!(cold.prefix_source, None);
    assert!(cold.prefix_tokens >= 64, "{cold:?}");

    let (again, warm) = ask(load(), PREFIX_SYSTEM).await;
    assert_eq!(warm.prefix_source, Some(PrefixSource::Disk), "{warm:?}");
    assert_eq!(warm.reused_tokens, cold.prefix_tokens);
    assert_eq!(again, first, "a restored prefix changed the answer");
    assert!(
        warm.prefill_secs < cold.prefill_secs / 2.0,
        "restored prefill {:.3} s vs {:.3} s computed",
        warm.prefill_secs,
        cold.prefill_secs
    );
    eprintln!(
        "prefix of {} tokens: prefill {:.3} s computed, {:.3} s restored from disk",
        cold.prefix_tokens, cold.prefill_secs, warm.prefill_secs
    );

    const OTHER: &str = "You are a careful assistant for chest X-rays. Use the tools; never \
invent numbers, and name the tool result behind every statement you make. Be brief.";
    let (_, other) = ask(load(), OTHER).await;
    assert!(other.prefix_tokens >= 64, "{other:?}");
    assert_eq!(other.prefix_source, None, "{other:?}");
    assert_eq!(other.reused_tokens, 0);
}

/// Prompt lookup: an answer quoting a tool result is drafted from it and the drafts are kept
/// (fewer passes), and the text is the one decoding without drafts writes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quoted_answer_is_drafted_from_the_result_and_reads_as_without_drafts() {
    let Some(llm) = llm() else { return };
    let _g = serial().await;
    let id = "img_5d41402abc4b";
    let mut messages = after_one_call(id);
    messages.push(Message::user(
        "No more tools can be called. Quote the tool result above word for word.",
        vec![],
    ));
    let req = ChatRequest {
        messages,
        max_tokens: Some(60),
        ..Default::default()
    };
    let drafted = collect_turn(llm.chat(req.clone()).await.unwrap(), |_| {})
        .await
        .unwrap();
    let s = llm.last_stats();
    eprintln!(
        "{:?} drafted {} kept {}",
        drafted.text, s.drafted_tokens, s.draft_kept
    );
    assert!(
        s.draft_kept > 0 && s.drafted_tokens >= s.draft_kept,
        "{s:?}"
    );
    assert!(drafted.text.contains("2048"), "{:?}", drafted.text);

    let mut cfg = common::local_config(&model_path().expect("model"));
    cfg.context = 2048;
    cfg.prompt_lookup = false;
    let plain_llm = LocalLlm::load(cfg).expect("the installed GGUF loads");
    let plain = collect_turn(plain_llm.chat(req).await.unwrap(), |_| {})
        .await
        .unwrap();
    assert_eq!(plain_llm.last_stats().drafted_tokens, 0);
    assert_eq!(drafted.text, plain.text);
}
