//! One completion on the local model: fit the prompt into the context, reuse the cached prefix,
//! prefill the rest in batches, then sample token by token (constrained inside tool calls),
//! streaming text and finished calls.

use std::sync::Arc;
use std::time::Instant;

use candle_core::Tensor;
use candle_transformers::generation::Sampling;
use llguidance::Matcher;
use serde_json::Value;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use hilum_llm::{
    is_overlay_id, ChatDelta, ChatRequest, DeltaStream, ImagePayload, LlmError, Message, ToolSpec,
};

use crate::grammar::Constraint;
use crate::prefix::PrefixSource;
use crate::vlm::reasoner::{is_virtual, PromptImage};
use crate::{Inner, LocalError};

mod decode;

/// Prompt tokens per forward pass: bounds the attention scratch (heads x chunk x context).
const PREFILL_CHUNK: usize = 512;
/// The answer space a prompt must leave, at least, before old tool results are shortened.
const MIN_ANSWER_TOKENS: usize = 256;
/// A turn ends after this many tool calls even if the model wants more.
const MAX_CALLS_PER_TURN: usize = 8;
/// Longest repeated period the repetition guard looks for.
const MAX_REPEAT_PERIOD: usize = 32;
/// Said to a model that repeats a call whose result it already has, after the user's question
/// is asked again (a small model copies a bare instruction instead of following it).
const RESULTS_ARE_IN: &str =
    "Answer this from the tool results above, without calling a tool again.";
/// Tool results are first cut to this many characters, then omitted, to fit the context.
const SHORT_RESULT_CHARS: usize = 400;

/// What the last request cost.
#[derive(Clone, Debug, Default)]
pub struct GenStats {
    /// Tokens in the rendered prompt.
    pub prompt_tokens: usize,
    /// Prompt tokens whose KV entries were already cached from an earlier round.
    pub reused_tokens: usize,
    /// Prompt tokens run through the model in this request.
    pub prefill_tokens: usize,
    /// Seconds spent running the prompt through the model.
    pub prefill_secs: f64,
    /// Answer tokens produced.
    pub decode_tokens: usize,
    /// Seconds spent producing the answer tokens.
    pub decode_secs: f64,
    /// Of `decode_tokens`, those the tool-call grammar forced and that ran as one batch.
    pub forced_tokens: usize,
    /// Seconds spent on the forced tokens.
    pub forced_secs: f64,
    /// The passes those forced tokens ran in.
    pub forced_batches: usize,
    /// Of `decode_tokens`, those thrown away when the answer restarted from the prompt.
    pub rewound_tokens: usize,
    /// Seconds from the request to the end of its first complete tool call.
    pub first_tool_call_secs: Option<f64>,
    /// Seconds from the request to the end of the answer.
    pub total_secs: f64,
    /// Tool results shortened to fit the context.
    pub shortened_tool_results: usize,
    /// Prompt tokens that depend only on the system prompt and the tools (the prefix cache's key).
    pub prefix_tokens: usize,
    /// Where the prefix's KV state came from, when it was restored rather than computed.
    pub prefix_source: Option<PrefixSource>,
    /// Pictures in the prompt (a multimodal model), and the prompt tokens that stand for them.
    pub images: usize,
    /// Prompt tokens standing for those pictures.
    pub image_tokens: usize,
    /// Seconds spent encoding pictures not already encoded (the vision tower).
    pub image_secs: f64,
    /// Answer tokens guessed from the prompt (prompt lookup) and checked in the pass of the
    /// token before them, and of those the ones greedy decoding then chose (no pass of their
    /// own).
    pub drafted_tokens: usize,
    /// Of `drafted_tokens`, those greedy decoding then chose.
    pub draft_kept: usize,
}

impl GenStats {
    /// Prompt tokens run per second of prefill.
    pub fn prefill_tokens_per_sec(&self) -> f64 {
        self.prefill_tokens as f64 / self.prefill_secs.max(1e-9)
    }
    /// Sampled tokens per second (one forward pass each; grammar-forced batches left out).
    pub fn decode_tokens_per_sec(&self) -> f64 {
        self.decode_tokens.saturating_sub(self.forced_tokens) as f64
            / (self.decode_secs - self.forced_secs).max(1e-9)
    }
}

struct Prepared {
    tokens: Vec<u32>,
    /// The pictures whose soft tokens are in `tokens` (and in `repeat_prompt`).
    images: Vec<PromptImage>,
    /// How many of `tokens` come from the system prompt and the tools alone.
    prefix_len: usize,
    max_new: usize,
    sampling: Sampling,
    stop: Vec<String>,
    constraint: Option<Constraint>,
    /// A closed answer's texts and their tokens (`ChatRequest::choices`).
    choices: Vec<(String, Vec<u32>)>,
    has_tools: bool,
    /// Tools are offered through the ReAct text protocol: `constraint` holds `Action:` blocks.
    react: bool,
    /// The turn must be a tool call (`ChatRequest::require_tool`, where a constraint can force it).
    require_tool: bool,
    /// Calls made in earlier rounds of this conversation (name, parsed arguments).
    previous_calls: Vec<(String, Option<Value>)>,
    /// Tools whose results in this conversation succeeded, in order (for the answer's lead).
    answered_tools: Vec<(String, String)>,
    /// The user's last question (the answer lead points at the result most about it).
    question: String,
    /// The turn comes right after tool results: a prose answer opens with the lead that points
    /// at the result it must come from.
    lead_after_results: bool,
    /// The prompt plus a user note that the results are in, for a model that repeats a call.
    repeat_prompt: Option<Vec<u32>>,
    shortened: usize,
    started: Instant,
}

pub(crate) fn start(inner: Arc<Inner>, req: ChatRequest) -> Result<DeltaStream, LlmError> {
    let prep = prepare(&inner, &req)?;
    let (tx, rx) = mpsc::channel(256);
    tokio::task::spawn_blocking(move || {
        if let Err(e) = run(&inner, prep, &tx) {
            let _ = tx.blocking_send(Err(e.into()));
        }
    });
    Ok(Box::pin(ReceiverStream::new(rx)))
}

/// Index of the largest logit (the first one on ties; NaN never wins).
fn greedy(logits: &[f32]) -> u32 {
    let mut best = 0usize;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] || logits[best].is_nan() {
            best = i;
        }
    }
    best as u32
}

/// A call's identity: its name and its arguments as JSON (so spacing and key order do not count).
fn call_key(name: &str, arguments: &str) -> (String, Option<Value>) {
    (name.to_string(), serde_json::from_str(arguments).ok())
}

fn previous_calls(messages: &[Message]) -> Vec<(String, Option<Value>)> {
    messages
        .iter()
        .flat_map(|m| match m {
            Message::Assistant { tool_calls, .. } => tool_calls.as_slice(),
            _ => &[],
        })
        .map(|c| call_key(&c.name, &c.arguments))
        .collect()
}

/// Tools whose results succeeded, in order: (name, result text).
fn answered_tools(messages: &[Message]) -> Vec<(String, String)> {
    messages
        .iter()
        .filter_map(|m| match m {
            Message::Tool {
                name,
                content,
                is_error,
                ..
            } if !is_error => Some((name.clone(), content.clone())),
            _ => None,
        })
        .collect()
}

/// The user's last question: the last user turn that carries images (the agent's notices and
/// requests after tool results carry none, and one that names a tool would otherwise draw the
/// answer's lead to that tool), else the last user turn.
fn last_question(messages: &[Message]) -> String {
    let users = || {
        messages.iter().rev().filter_map(|m| match m {
            Message::User { content, images } => Some((content, images)),
            _ => None,
        })
    };
    users()
        .find(|(_, images)| images.iter().any(|i| !is_overlay_id(i)))
        .or_else(|| users().next())
        .map(|(content, _)| content.clone())
        .unwrap_or_default()
}

/// Lower-case word stems (a trailing plural `s` dropped) of `text`, without the words every
/// question about a radiograph shares.
fn content_stems(text: &str) -> Vec<String> {
    const COMMON: &[&str] = &[
        "the",
        "and",
        "are",
        "how",
        "what",
        "which",
        "this",
        "that",
        "these",
        "those",
        "with",
        "from",
        "image",
        "img",
        "there",
        "does",
        "have",
        "has",
        "any",
        "for",
        "you",
        "can",
        "please",
        "tell",
        "about",
        "show",
        "see",
        "chest",
        "ray",
        "xray",
        "radiograph",
        "result",
        "its",
    ];
    text.split(|c: char| !c.is_alphanumeric())
        .map(|w| w.to_lowercase())
        .map(|w| match w.strip_suffix('s') {
            Some(stem) if stem.len() >= 3 => stem.to_string(),
            _ => w,
        })
        .filter(|w| w.len() >= 3 && !COMMON.contains(&w.as_str()))
        .collect()
}

/// The words that start a prose answer after a repeated call: they point at a result that
/// exists and is about the question — the succeeded tool whose name (twice) and result share
/// the most words with the question; on a tie (or no overlap) the repeated tool's result when it
/// succeeded, else the last one that did.
fn answer_lead(repeated: &str, answered: &[(String, String)], question: &str) -> String {
    let asked = content_stems(question);
    let score = |name: &str, result: &str| {
        let (in_name, in_result) = (content_stems(name), content_stems(result));
        asked
            .iter()
            .map(|w| 2 * in_name.contains(w) as usize + in_result.contains(w) as usize)
            .sum::<usize>()
    };
    let repeated_score = answered
        .iter()
        .find(|(n, _)| n == repeated)
        .map(|(n, r)| score(n, r));
    let best = answered
        .iter()
        .map(|(n, r)| (score(n, r), n))
        .filter(|(s, _)| *s > 0 && Some(*s) > repeated_score)
        .max_by_key(|(s, _)| *s);
    if let Some((_, name)) = best {
        format!("According to the {name} result:")
    } else if repeated_score.is_some() {
        format!("According to the {repeated} result:")
    } else if let Some((last, _)) = answered.last() {
        format!("According to the {last} result:")
    } else {
        "According to the tool results:".to_string()
    }
}

fn image_ids(messages: &[Message]) -> Vec<String> {
    let mut ids = Vec::new();
    for m in messages {
        if let Message::User { images, .. } = m {
            // A tool's drawing is no image a tool can take.
            for id in images.iter().filter(|i| !is_overlay_id(i)) {
                if !ids.contains(id) {
                    ids.push(id.clone());
                }
            }
        }
    }
    ids
}

fn prepare(inner: &Inner, req: &ChatRequest) -> Result<Prepared, LocalError> {
    let started = Instant::now();
    let limit = {
        let st = inner
            .state
            .lock()
            .map_err(|_| LocalError::Inference("the model state was poisoned by a panic".into()))?;
        st.model.max_positions()
    };
    let want_new = req.max_tokens.unwrap_or(inner.cfg.max_tokens).max(1) as usize;
    let (tokens, mut images, shortened) = fit_context(inner, &req.messages, req, limit, want_new)?;
    let prefix_len = fixed_prefix_len(inner, req, &tokens);
    let previous_calls = previous_calls(&req.messages);
    let repeat_prompt = if previous_calls.is_empty() || req.tools.is_empty() {
        None
    } else {
        let mut msgs = req.messages.clone();
        let question = last_question(&req.messages);
        msgs.push(Message::user(
            format!("{question}\n\n{RESULTS_ARE_IN}"),
            vec![],
        ));
        let (t, more) = encode_prompt(inner, &msgs, &req.tools, true, &req.images)?;
        // Only if it fits; otherwise the plain prompt is restarted.
        let fits = t.len() + MIN_ANSWER_TOKENS.min(want_new) <= limit;
        if fits {
            for im in more {
                if !images.iter().any(|i| i.slot == im.slot) {
                    images.push(im);
                }
            }
        }
        fits.then_some(t)
    };
    let max_new = want_new.min(limit - tokens.len());
    let temperature = req.temperature.unwrap_or(inner.cfg.temperature) as f64;
    let sampling = if temperature <= 0.0 {
        Sampling::ArgMax
    } else {
        match inner.cfg.top_p {
            Some(p) if p < 1.0 => Sampling::TopP { p, temperature },
            _ => Sampling::All { temperature },
        }
    };
    let choices = req
        .choices
        .iter()
        .map(|c| Ok((c.clone(), inner.tok.encode(c)?)))
        .collect::<Result<Vec<_>, LocalError>>()?;
    // A text protocol's tools arrive in `text_tools` (the prompt describes them).
    let react = req.tools.is_empty() && !req.text_tools.is_empty();
    let constraint = if !inner.cfg.constrain_tool_calls || !choices.is_empty() {
        None
    } else if react {
        Some(Constraint::react(
            &inner.tok,
            &req.text_tools,
            &image_ids(&req.messages),
        )?)
    } else if !req.tools.is_empty() {
        Some(Constraint::new(
            &inner.tok,
            &req.tools,
            &image_ids(&req.messages),
        )?)
    } else {
        None
    };
    let answered_tools = answered_tools(&req.messages);
    let choices_empty = choices.is_empty();
    let lead_after_results = choices.is_empty()
        && matches!(req.messages.last(), Some(Message::Tool { .. }))
        && !answered_tools.is_empty();
    Ok(Prepared {
        tokens,
        images,
        prefix_len,
        max_new,
        sampling,
        stop: req.stop.iter().filter(|s| !s.is_empty()).cloned().collect(),
        constraint,
        choices,
        has_tools: !req.tools.is_empty() || react,
        react,
        require_tool: req.require_tool && choices_empty,
        previous_calls,
        answered_tools,
        question: last_question(&req.messages),
        lead_after_results,
        repeat_prompt,
        shortened,
        started,
    })
}

/// How many leading tokens of the prompt depend only on the leading system messages and the
/// tools: those rendered alone, as far as they agree with the prompt token for token (0 when the
/// template cannot render them alone).
fn fixed_prefix_len(inner: &Inner, req: &ChatRequest, tokens: &[u32]) -> usize {
    let head: Vec<Message> = req
        .messages
        .iter()
        .take_while(|m| matches!(m, Message::System { .. }))
        .cloned()
        .collect();
    if head.is_empty() && req.tools.is_empty() {
        return 0;
    }
    let Ok((alone, _)) = encode_prompt(inner, &head, &req.tools, false, &[]) else {
        return 0;
    };
    alone.iter().zip(tokens).take_while(|(a, b)| a == b).count()
}

/// The prompt's tokens: the conversation rendered with the chat template and tokenized; for a
/// multimodal model each picture of `images` a user turn names becomes its soft tokens (ids of
/// [`crate::vlm::reasoner`], one run per picture, listed in the second value).
pub(crate) fn encode_prompt(
    inner: &Inner,
    messages: &[Message],
    tools: &[ToolSpec],
    add_generation_prompt: bool,
    images: &[ImagePayload],
) -> Result<(Vec<u32>, Vec<PromptImage>), LocalError> {
    match &inner.vision {
        Some(v) => v.encode(
            &inner.tok,
            &inner.template,
            messages,
            tools,
            add_generation_prompt,
            images,
        ),
        None => {
            let text = inner
                .template
                .render(messages, tools, add_generation_prompt)?;
            Ok((inner.tok.encode(&text)?, Vec::new()))
        }
    }
}

/// Renders and tokenizes the prompt; when it leaves too little room for an answer, old tool
/// results are shortened (oldest first), then omitted, before giving up.
fn fit_context(
    inner: &Inner,
    messages: &[Message],
    req: &ChatRequest,
    limit: usize,
    want_new: usize,
) -> Result<(Vec<u32>, Vec<PromptImage>, usize), LocalError> {
    let room = want_new.min(MIN_ANSWER_TOKENS);
    let encode = |msgs: &[Message]| encode_prompt(inner, msgs, &req.tools, true, &req.images);
    let mut msgs = messages.to_vec();
    let (mut tokens, mut images) = encode(&msgs)?;
    let mut shortened = 0;
    let tool_idx: Vec<usize> = msgs
        .iter()
        .enumerate()
        .filter(|(_, m)| matches!(m, Message::Tool { .. }))
        .map(|(i, _)| i)
        .collect();
    for pass in 0..2 {
        for &i in &tool_idx {
            if tokens.len() + room <= limit {
                return Ok((tokens, images, shortened));
            }
            if let Message::Tool { content, .. } = &mut msgs[i] {
                let n = content.chars().count();
                let new = if pass == 0 && n > SHORT_RESULT_CHARS {
                    let head: String = content.chars().take(SHORT_RESULT_CHARS).collect();
                    format!(
                        "{head} [... {} characters cut to fit the context]",
                        n - SHORT_RESULT_CHARS
                    )
                } else if pass == 1 {
                    "[result omitted to fit the context]".to_string()
                } else {
                    continue;
                };
                if new.len() < content.len() {
                    *content = new;
                    shortened += 1;
                    (tokens, images) = encode(&msgs)?;
                }
            }
        }
    }
    if tokens.len() + room <= limit {
        Ok((tokens, images, shortened))
    } else {
        Err(LocalError::ContextFull {
            needed: tokens.len() + room,
            limit,
        })
    }
}

/// Length of the shortest period p (<= 32) with which the last `window` tokens repeat.
pub(crate) fn repetition(generated: &[u32], window: usize) -> Option<usize> {
    if window == 0 || generated.len() < window {
        return None;
    }
    let tail = &generated[generated.len() - window..];
    (1..=MAX_REPEAT_PERIOD.min(window / 2)).find(|&p| (p..window).all(|i| tail[i] == tail[i - p]))
}

/// Free text not yet streamed, held back while it could be the start of a stop sequence.
struct TextOut {
    text: String,
    sent: usize,
    stops: Vec<String>,
    /// Hold everything back while the turn might still turn out to be a tool call.
    hold_all: bool,
    /// Hold back the line being written (it may turn out to be a ReAct `Action:` block, which
    /// is rewritten under the grammar).
    hold_line: bool,
}

/// What the line being written is, under the ReAct protocol.
#[derive(Debug, PartialEq)]
enum Line {
    /// Too short to tell.
    Undecided,
    /// Not an `Action:` line; starts at this byte.
    Free(usize),
    /// An `Action:` line (after optional spaces and Markdown `*`/`#`), starting at this byte.
    Action(usize),
}

/// Reads the last line of `text`, unless it starts at `decided` (already found free).
fn action_line(text: &str, decided: Option<usize>) -> Line {
    const KEY: &str = "Action:";
    let start = text.rfind('\n').map_or(0, |i| i + 1);
    if decided == Some(start) {
        return Line::Free(start);
    }
    let line = text[start..].trim_start_matches([' ', '*', '#']);
    if line.starts_with(KEY) {
        Line::Action(start)
    } else if KEY.starts_with(line) {
        Line::Undecided
    } else {
        Line::Free(start)
    }
}

#[derive(Debug, PartialEq)]
enum Trigger {
    Undecided,
    Call,
    Text,
}

/// Whether a turn that began with `s` is a tool call written without `<tool_call>` (small
/// models often answer with a bare JSON object or a fenced ```json block, which llama.cpp's
/// Hermes parser also accepts).
fn call_trigger(s: &str) -> Trigger {
    // Small models sometimes put a stray `>` or `:` before the object.
    let t = s.trim_start_matches(|c: char| c.is_whitespace() || c == '>' || c == ':');
    if t.is_empty() {
        return Trigger::Undecided;
    }
    if t.starts_with('{') {
        return Trigger::Call;
    }
    for fence in ["```json", "```"] {
        if fence.starts_with(t) {
            return Trigger::Undecided;
        }
        if let Some(rest) = t.strip_prefix(fence) {
            let rest = rest.trim_start();
            if rest.is_empty() {
                return Trigger::Undecided;
            }
            if rest.starts_with('{') {
                return Trigger::Call;
            }
        }
    }
    Trigger::Text
}

impl TextOut {
    /// Appends `s`; returns what may be streamed now and whether a stop sequence was hit.
    fn push(&mut self, s: &str) -> (String, bool) {
        self.text.push_str(s);
        let hit = self
            .stops
            .iter()
            .filter_map(|st| {
                self.text[self.sent..]
                    .find(st.as_str())
                    .map(|i| self.sent + i)
            })
            .min();
        if let Some(end) = hit {
            let out = self.text[self.sent..end].to_string();
            self.text.truncate(end);
            self.sent = end;
            return (out, true);
        }
        if self.hold_all {
            return (String::new(), false);
        }
        let hold = self.stops.iter().map(|s| s.len()).max().unwrap_or(1) - 1;
        let mut end = self.text.len().saturating_sub(hold);
        if self.hold_line {
            end = end.min(self.text.rfind('\n').map_or(0, |i| i + 1));
        }
        let mut end = end.max(self.sent);
        while !self.text.is_char_boundary(end) {
            end -= 1;
        }
        let out = self.text[self.sent..end].to_string();
        self.sent = end;
        (out, false)
    }

    /// What `push("")` would release now that holding is over.
    fn flush_safe(&mut self) -> String {
        self.push("").0
    }

    fn flush(&mut self) -> String {
        let out = self.text[self.sent..].to_string();
        self.sent = self.text.len();
        out
    }
}

enum Mode {
    Free,
    /// Inside ReAct `Action:` blocks: text held to the grammar, streamed as text.
    Action {
        matcher: Box<Matcher>,
    },
    /// Inside the tool-call section; `body` collects the bytes of the open call.
    Call {
        matcher: Option<Box<Matcher>>,
        body: Option<Vec<u8>>,
    },
}

/// Call mode right after the call's opening token `open`: the grammar (when there is one)
/// has consumed it, and the call's body starts empty.
fn open_call(constraint: Option<&Constraint>, open: u32) -> Result<Mode, LocalError> {
    let matcher = match constraint {
        Some(c) => {
            let mut m = c.matcher()?;
            m.consume_token(open)
                .map_err(|e| LocalError::Grammar(e.to_string()))?;
            Some(Box::new(m))
        }
        None => None,
    };
    Ok(Mode::Call {
        matcher,
        body: Some(Vec::new()),
    })
}

fn send(tx: &mpsc::Sender<Result<ChatDelta, LlmError>>, d: ChatDelta) -> bool {
    tx.blocking_send(Ok(d)).is_ok()
}

/// Opens the answer with `lead` (run through the model and streamed): the logits for the token
/// after it, or `None` when the receiver is gone.
fn open_with(
    st: &mut crate::State,
    tok: &crate::tokenizer::GgufTokenizer,
    lead: &str,
    generated: &mut Vec<u32>,
    text: &mut TextOut,
    tx: &mpsc::Sender<Result<ChatDelta, LlmError>>,
) -> Result<Option<Tensor>, LocalError> {
    let lead_tokens = tok.encode(lead)?;
    if lead_tokens.is_empty() {
        return Err(LocalError::Inference(
            "the answer lead encodes to no token".into(),
        ));
    }
    let logits = st.model.forward(&lead_tokens)?;
    st.cached.extend_from_slice(&lead_tokens);
    generated.extend_from_slice(&lead_tokens);
    let (out, _) = text.push(lead);
    if !out.is_empty() && !send(tx, ChatDelta::Text(out)) {
        return Ok(None);
    }
    Ok(Some(logits))
}

/// Restarts the answer from the prompt: with the user's question restated after the tool
/// results and a note that they are in ([`Prepared::repeat_prompt`], when it fits; only the
/// tokens after the part shared with the cache are run), else from the prompt itself. Returns
/// the new prompt length; the caller runs the answer's lead next.
fn restate_question(
    st: &mut crate::State,
    prep: &Prepared,
    prompt_len: usize,
) -> Result<usize, LocalError> {
    match &prep.repeat_prompt {
        Some(p) if !p.is_empty() => {
            let keep = st.cached[..prompt_len]
                .iter()
                .zip(p)
                .take_while(|(a, b)| a == b)
                .count()
                .min(p.len() - 1);
            let keep = run_start(p, keep);
            st.model.truncate_cache(keep)?;
            st.cached.truncate(keep);
            for chunk in prefill_chunks(&p[keep..]) {
                st.model.forward(chunk)?;
                st.cached.extend_from_slice(chunk);
            }
            Ok(st.cached.len())
        }
        _ => {
            st.model.truncate_cache(prompt_len)?;
            st.cached.truncate(prompt_len);
            Ok(prompt_len)
        }
    }
}

/// `pos` moved back to the start of the run of picture tokens it falls inside, if any: a
/// picture's tokens attend to each other, so they are run in one pass.
fn run_start(tokens: &[u32], mut pos: usize) -> usize {
    while pos > 0 && pos < tokens.len() && is_virtual(tokens[pos]) && is_virtual(tokens[pos - 1]) {
        pos -= 1;
    }
    pos
}

/// `tokens` in passes of about [`PREFILL_CHUNK`], none cut inside a run of picture tokens.
fn prefill_chunks(tokens: &[u32]) -> Vec<&[u32]> {
    let mut out = Vec::new();
    let mut start = 0;
    while start < tokens.len() {
        let mut end = (start + PREFILL_CHUNK).min(tokens.len());
        while end < tokens.len() && is_virtual(tokens[end]) && is_virtual(tokens[end - 1]) {
            end += 1;
        }
        out.push(&tokens[start..end]);
        start = end;
    }
    out
}

/// Rewinds the cache to its first `keep` positions (at least one) and returns the logits for
/// the position after them, by running the last kept token again.
fn rewind_to(st: &mut crate::State, keep: usize) -> Result<Tensor, LocalError> {
    let keep = keep.clamp(1, st.cached.len().max(1));
    let last = *st
        .cached
        .get(keep - 1)
        .ok_or_else(|| LocalError::Inference("nothing cached to rewind to".into()))?;
    st.model.truncate_cache(keep - 1)?;
    st.cached.truncate(keep - 1);
    let logits = st.model.forward(&[last])?;
    st.cached.push(last);
    Ok(logits)
}

fn run(
    inner: &Inner,
    prep: Prepared,
    tx: &mpsc::Sender<Result<ChatDelta, LlmError>>,
) -> Result<(), LocalError> {
    let mut guard = inner
        .state
        .lock()
        .map_err(|_| LocalError::Inference("the model state was poisoned by a panic".into()))?;
    let st = &mut *guard;
    let result = decode::decode(inner, &prep, st, tx);
    if result.is_err() {
        // The cache may hold positions `cached` does not describe: start clean next time.
        let _ = st.model.truncate_cache(0);
        st.cached.clear();
    }
    result
}

/// Tokens of a draft checked in one pass (with the chosen token before them, eight rows: one
/// group of the block kernels' batch).
const DRAFT_TOKENS: usize = 7;
/// Tokens of the answer's end looked up in the prompt.
const DRAFT_NGRAM: usize = 3;

/// Prompt lookup: an answer that quotes a tool result goes on as the result does. The tokens
/// after the latest earlier place in `prompt` where the last `DRAFT_NGRAM` tokens of `written`
/// occur, at most `max`.
fn lookup_draft(prompt: &[u32], written: &[u32], max: usize) -> Vec<u32> {
    if max == 0 || written.len() < DRAFT_NGRAM {
        return Vec::new();
    }
    let tail = &written[written.len() - DRAFT_NGRAM..];
    prompt
        .windows(DRAFT_NGRAM)
        .rposition(|w| w == tail)
        .map(|i| {
            let from = i + DRAFT_NGRAM;
            prompt[from..(from + max).min(prompt.len())].to_vec()
        })
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_answer_lead_names_a_tool_whose_result_succeeded() {
        let tool = |name: &str, is_error: bool| Message::Tool {
            tool_call_id: format!("c_{name}"),
            name: name.into(),
            content: String::new(),
            is_error,
        };
        let msgs = vec![
            tool("segment_lungs", false),
            tool("segment_region", true),
            tool("image_info", false),
        ];
        let answered = answered_tools(&msgs);
        let names: Vec<&str> = answered.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["segment_lungs", "image_info"]);
        assert_eq!(
            answer_lead("segment_lungs", &answered, ""),
            "According to the segment_lungs result:"
        );
        // A repeated call that had failed points at the last result that exists instead.
        assert_eq!(
            answer_lead("segment_region", &answered, ""),
            "According to the image_info result:"
        );
        assert_eq!(
            answer_lead("segment_region", &[], ""),
            "According to the tool results:"
        );
    }

    /// The main job's case: the model repeats `image_info`, but the question is about the lungs.
    #[test]
    fn the_answer_lead_points_at_the_result_about_the_question() {
        let result = |name: &str, content: &str| (name.to_string(), content.to_string());
        let answered = vec![
            result(
                "image_info",
                "img_c8cb: 512x512 px, 8-bit png, mean 128.14, std 67.36",
            ),
            result(
                "segment_lungs",
                "img_c8cb: 2 lung field(s); right 43042 px, left 43510 px; lungs cover 33%",
            ),
            result(
                "measure_chest",
                "CTR not measured; thorax 435 px; L/R lung area 1.01",
            ),
        ];
        let q = "How large are the lungs in this image?\n\nImages: img_c8cb";
        assert_eq!(
            answer_lead("image_info", &answered, q),
            "According to the segment_lungs result:"
        );
        // Nothing in common with the question: the repeated tool's own result.
        assert_eq!(
            answer_lead("image_info", &answered, "Anything else?"),
            "According to the image_info result:"
        );
        // A tie with the repeated tool keeps the repeated tool.
        assert_eq!(
            answer_lead(
                "measure_chest",
                &answered[..1]
                    .iter()
                    .chain(&answered[2..])
                    .cloned()
                    .collect::<Vec<_>>(),
                "lung area?"
            ),
            "According to the measure_chest result:"
        );
    }

    /// A DICOM question: the result that names the attribute asked about leads, whichever tool
    /// was repeated, and a notice after the results (no images) is not taken for the question.
    #[test]
    fn the_answer_lead_finds_the_attribute_asked_about_past_a_notice() {
        let answered: Vec<(String, String)> = [
            ("image_info", "img_13d3: 1024 x 1024 pixels (width x height), bit depth 8 (8-bit dicom), mean 160.41 (of max 255), std 53.86"),
            ("dicom_info", "img_13d3: DICOM, modality CR, body part CHEST, view position PA, 1024 x 1024 pixels (width x height), 8 bits stored (8 allocated), photometric interpretation MONOCHROME2, pixel spacing 0.168 x 0.168 mm/px (row x column)"),
            ("measure_chest", "img_13d3: CTR not measured; heart not measured, thorax 816 px; lung areas: the patient's right lung is larger: 175,966 vs 158,815 px, +10.8% (L/R ratio 0.90)"),
        ]
        .iter()
        .map(|(n, r)| (n.to_string(), r.to_string()))
        .collect();
        let q = "What imaging modality does this DICOM file record? A) DX B) CT C) MR D) US \
                 E) MG F) CR\n\nAnswer with the letter of the correct option (A-F) first.";
        let messages = vec![
            Message::system("S"),
            Message::user(q, vec!["img_13d3".into()]),
            Message::user("Observation: measure_chest was called twice.", vec![]),
        ];
        let asked = last_question(&messages);
        assert_eq!(asked, q);
        assert_eq!(
            answer_lead("measure_chest", &answered, &asked),
            "According to the dicom_info result:"
        );
        // With no images anywhere, the last user turn is the question.
        assert_eq!(
            last_question(&messages[2..]),
            "Observation: measure_chest was called twice."
        );
    }

    #[test]
    fn repetition_finds_short_loops_only_when_the_window_is_full() {
        let looped: Vec<u32> = (0..40).map(|i| [7, 8, 9][i % 3]).collect();
        assert_eq!(repetition(&looped, 30), Some(3));
        assert_eq!(repetition(&looped, 41), None);
        let varied: Vec<u32> = (0..100).collect();
        assert_eq!(repetition(&varied, 96), None);
        assert_eq!(repetition(&[5; 10], 10), Some(1));
    }

    #[test]
    fn stop_sequences_cut_text_even_across_tokens() {
        let mut t = TextOut {
            text: String::new(),
            sent: 0,
            stops: vec!["Observation:".into()],
            hold_all: false,
            hold_line: false,
        };
        let (a, hit) = t.push("Action: x\nObserv");
        assert!(!hit);
        assert!(!a.contains("Observ"), "{a}");
        let (b, hit) = t.push("ation: 42");
        assert!(hit);
        assert_eq!(format!("{a}{b}"), "Action: x\n");
        assert_eq!(t.flush(), "");
    }

    #[test]
    fn bare_json_and_fenced_json_start_a_call() {
        assert_eq!(call_trigger("  "), Trigger::Undecided);
        assert_eq!(call_trigger("``"), Trigger::Undecided);
        assert_eq!(call_trigger("```json\n"), Trigger::Undecided);
        assert_eq!(call_trigger("```json\n{"), Trigger::Call);
        assert_eq!(call_trigger("\n{\"name\""), Trigger::Call);
        assert_eq!(call_trigger(">"), Trigger::Undecided);
        assert_eq!(call_trigger(">{\"name\""), Trigger::Call);
        assert_eq!(call_trigger("The lungs"), Trigger::Text);
        assert_eq!(call_trigger("```python\n"), Trigger::Text);
    }

    #[test]
    fn action_lines_are_told_from_prose_as_they_are_written() {
        assert_eq!(action_line("Thought: look\nAct", None), Line::Undecided);
        assert_eq!(
            action_line("Thought: look\n**Action:", None),
            Line::Action(14)
        );
        assert_eq!(action_line("Thought: look", None), Line::Free(0));
        assert_eq!(action_line("Thought: look\nActual", None), Line::Free(14));
        // A line found free stays free.
        assert_eq!(action_line("x\nAction:", Some(2)), Line::Free(2));
    }

    #[test]
    fn held_lines_stream_when_they_end() {
        let mut t = TextOut {
            text: String::new(),
            sent: 0,
            stops: vec![],
            hold_all: false,
            hold_line: true,
        };
        assert_eq!(t.push("Thought: a").0, "");
        assert_eq!(t.push("b\nAct").0, "Thought: ab\n");
        assert_eq!(t.flush(), "Act");
    }

    #[test]
    fn prefill_passes_keep_each_picture_whole() {
        use crate::vlm::reasoner::VIRTUAL_BASE;
        let mut tokens: Vec<u32> = (0..500).collect();
        tokens.extend((0..256).map(|j| VIRTUAL_BASE + j));
        tokens.extend(0..300);
        let chunks = prefill_chunks(&tokens);
        let lens: Vec<usize> = chunks.iter().map(|c| c.len()).collect();
        assert_eq!(lens, [756, 300]);
        assert_eq!(run_start(&tokens, 600), 500);
        assert_eq!(run_start(&tokens, 500), 500);
        assert_eq!(run_start(&tokens, 400), 400);
    }

    #[test]
    fn a_draft_continues_the_latest_place_the_answer_quotes() {
        let prompt = [1, 2, 3, 4, 5, 6, 9, 2, 3, 4, 7, 8, 10, 11, 12, 13, 14, 15];
        // "2 3 4" occurs twice: the later one (followed by 7 8 ...) is the one quoted.
        assert_eq!(lookup_draft(&prompt, &[0, 2, 3, 4], 3), [7, 8, 10]);
        // The draft stops at the prompt's end and at `max`.
        assert_eq!(lookup_draft(&prompt, &[12, 13, 14], 7), [15]);
        assert!(lookup_draft(&prompt, &[13, 14, 15], 7).is_empty());
        assert!(lookup_draft(&prompt, &[2, 3, 4], 0).is_empty());
        // Too short an answer, or a tail the prompt does not hold: no draft.
        assert!(lookup_draft(&prompt, &[3, 4], 5).is_empty());
        assert!(lookup_draft(&prompt, &[4, 3, 2], 5).is_empty());
    }

    #[test]
    fn text_without_stops_streams_at_once() {
        let mut t = TextOut {
            text: String::new(),
            sent: 0,
            stops: vec![],
            hold_all: false,
            hold_line: false,
        };
        assert_eq!(t.push("héllo").0, "héllo");
    }
}
