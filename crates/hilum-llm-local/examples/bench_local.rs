//! Prompt and generation speed of the local backend on an agent-shaped request.
//!
//!     cargo run --release -p hilum-llm-local --example bench_local -- [MODEL.gguf] [THREADS]
//!
//! Round 1: a ~260-token prompt (system prompt, one tool, a question) from an empty cache, up to
//! the first tool call. Round 2: the same conversation plus the tool result, reusing the cache.
//! Round 3: generation speed on its own — a fresh conversation without tools whose answer runs
//! to `GEN_TOKENS` tokens (a list), timed per sampled token.
//! Prints one JSON object per round (scripts/bench/bench_llm.sh compares it with llama.cpp).

use std::time::Instant;

use hilum_llm_local::LocalLlm;

#[path = "../tests/it/common/mod.rs"]
mod common;
use hilum_llm::{collect_turn, ChatRequest, Llm, Message, ToolSpec};
use serde_json::json;

const SYSTEM: &str = "You are Hilum, an assistant that analyses chest X-rays with tools. \
Images are referred to by ids such as img_3fa2c1; pass these ids to tools. \
Base every finding on tool results and say which result supports it; never invent numbers. \
When several tools are needed and do not depend on each other, call them all in the same turn: they run in parallel. \
If a tool fails, read its error and either fix the call or answer without it. \
Say plainly what is uncertain. Your answers support a radiologist; they are not a diagnosis.";

/// Asks for a long list so that both backends generate the full `GEN_TOKENS`.
const GEN_QUESTION: &str = "List forty findings a chest X-ray report can mention, one per line, \
each with a one-sentence description.";
const GEN_TOKENS: u32 = 128;

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let path: std::path::PathBuf = match args.get(1) {
        Some(p) => p.into(),
        None => common::default_model_path().ok_or("no model: run scripts/fetch_local_llm.sh")?,
    };
    let t = Instant::now();
    let llm = LocalLlm::load(common::local_config(&path))?;
    eprintln!("loaded in {:.2} s", t.elapsed().as_secs_f64());
    let tool = ToolSpec {
        name: "image_info".into(),
        description: "Size, bit depth, format and intensity statistics (mean, standard deviation, \
            percentiles, a 16-bin histogram) of an image. Use it to check what an image is before \
            analysing it, e.g. whether it is 16-bit, very dark, or small."
            .into(),
        parameters: json!({"type": "object", "properties": {"image": {"type": "string",
            "pattern": "^img_[0-9a-f]{6,64}$", "description": "Id of an image in this session, e.g. img_3fa2c1b4d5e6"}},
            "required": ["image"], "additionalProperties": false}),
    };
    let mut messages = vec![
        Message::system(SYSTEM),
        Message::user(
            "What are the size and bit depth of this image?\n\nImages: img_5d41402abc4b",
            vec!["img_5d41402abc4b".into()],
        ),
    ];
    let req = |m: &Vec<Message>, tools: Vec<ToolSpec>| ChatRequest {
        messages: m.clone(),
        tools,
        max_tokens: Some(64),
        ..Default::default()
    };
    let t = Instant::now();
    let turn = collect_turn(llm.chat(req(&messages, vec![tool.clone()])).await?, |_| {}).await?;
    let wall = t.elapsed().as_secs_f64();
    let s = llm.last_stats();
    println!(
        "{}",
        json!({"round": 1, "prompt_tokens": s.prompt_tokens, "reused": s.reused_tokens,
            "prefill_tokens": s.prefill_tokens, "prefill_s": s.prefill_secs,
            "prefill_tok_s": s.prefill_tokens_per_sec(), "decode_tokens": s.decode_tokens,
            "decode_s": s.decode_secs, "decode_tok_s": s.decode_tokens_per_sec(),
            "forced_tokens": s.forced_tokens, "first_tool_call_s": s.first_tool_call_secs, "wall_s": wall,
            "tool_calls": turn.tool_calls.iter().map(|c| json!({"name": c.name, "arguments": c.arguments})).collect::<Vec<_>>()})
    );
    let Some(call) = turn.tool_calls.first().cloned() else {
        return Err(format!("no tool call in round 1: {:?}", turn.text).into());
    };
    messages.push(Message::assistant(
        turn.text.clone(),
        turn.tool_calls.clone(),
    ));
    messages.push(Message::Tool {
        tool_call_id: call.id,
        name: call.name,
        content: "image_info: 2048x2500 px, 8-bit grayscale PNG; mean 121.4, std 58.2".into(),
        is_error: false,
    });
    let t = Instant::now();
    let turn = collect_turn(llm.chat(req(&messages, vec![tool])).await?, |_| {}).await?;
    let wall = t.elapsed().as_secs_f64();
    let s = llm.last_stats();
    println!(
        "{}",
        json!({"round": 2, "prompt_tokens": s.prompt_tokens, "reused": s.reused_tokens,
            "prefill_tokens": s.prefill_tokens, "prefill_s": s.prefill_secs,
            "prefill_tok_s": s.prefill_tokens_per_sec(), "decode_tokens": s.decode_tokens,
            "decode_s": s.decode_secs, "decode_tok_s": s.decode_tokens_per_sec(), "wall_s": wall,
            "answer": turn.text})
    );
    llm.reset_cache();
    let gen = vec![Message::system(SYSTEM), Message::user(GEN_QUESTION, vec![])];
    let t = Instant::now();
    let req = ChatRequest {
        messages: gen,
        max_tokens: Some(GEN_TOKENS),
        ..Default::default()
    };
    collect_turn(llm.chat(req).await?, |_| {}).await?;
    let wall = t.elapsed().as_secs_f64();
    let s = llm.last_stats();
    println!(
        "{}",
        json!({"round": 3, "prompt_tokens": s.prompt_tokens, "prefill_tok_s": s.prefill_tokens_per_sec(),
            "decode_tokens": s.decode_tokens, "decode_s": s.decode_secs,
            "decode_tok_s": s.decode_tokens_per_sec(), "wall_s": wall})
    );
    Ok(())
}
