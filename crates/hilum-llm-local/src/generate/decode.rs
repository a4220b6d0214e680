//! The decoding loop of one completion, after the prompt is in the cache: one [`Turn`] whose
//! steps read as the loop's own description: run what the grammar forces, sample one token,
//! handle it by the mode the turn is in (free text, a ReAct `Action:` block, a tool call),
//! then append it and run its pass (or keep the pass a prompt-lookup draft already ran).

use std::collections::VecDeque;
use std::time::Instant;

use candle_core::{Device, Tensor};
use candle_transformers::generation::{LogitsProcessor, Sampling};
use llguidance::Matcher;
use serde_json::Value;
use tokio::sync::mpsc;

use hilum_llm::{ChatDelta, FinishReason, LlmError, Usage};

use super::{
    action_line, answer_lead, call_key, call_trigger, greedy, lookup_draft, open_call, open_with,
    prefill_chunks, repetition, restate_question, rewind_to, run_start, send, GenStats, Line, Mode,
    Prepared, TextOut, Trigger, DRAFT_TOKENS, MAX_CALLS_PER_TURN,
};
use crate::grammar::Constraint;
use crate::prefix::MIN_PREFIX_TOKENS;
use crate::tokenizer::{GgufTokenizer, Utf8Stream};
use crate::toolcall::parse_call_body;
use crate::vlm::reasoner::is_virtual;
use crate::{next_call_id, Inner, LocalError};

type Sender = mpsc::Sender<Result<ChatDelta, LlmError>>;

/// What a step tells the loop to do next.
enum Flow {
    /// Go on with the sampled token: append it and run its pass.
    Next,
    /// Start the next step at once (this one already ran its pass).
    Again,
    /// The turn is over: flush the text and finish.
    Done,
    /// The receiver is gone: stop without finishing.
    Gone,
}

/// Runs the prompt's uncached part, then decodes the answer (or picks a closed answer's choice).
pub(super) fn decode(
    inner: &Inner,
    prep: &Prepared,
    st: &mut crate::State,
    tx: &Sender,
) -> Result<(), LocalError> {
    let Some((logits, stats)) = prefill(inner, prep, st, tx)? else {
        return Ok(());
    };
    if !prep.choices.is_empty() {
        return choose(inner, prep, st, tx, logits, stats);
    }
    let mut turn = Turn::new(inner, prep, st, tx, logits, stats)?;
    loop {
        match turn.step()? {
            Flow::Gone => return Ok(()),
            Flow::Done => break,
            Flow::Next | Flow::Again => {}
        }
    }
    turn.end()
}

/// Reuses the longest cached prefix (or the stored prefix of the system prompt and tools),
/// encodes the pictures and runs the rest of the prompt: the logits after it and the stats so
/// far, or `None` when the receiver left.
fn prefill(
    inner: &Inner,
    prep: &Prepared,
    st: &mut crate::State,
    tx: &Sender,
) -> Result<Option<(Tensor, GenStats)>, LocalError> {
    let tokens = &prep.tokens;
    let mut stats = GenStats {
        prompt_tokens: tokens.len(),
        shortened_tool_results: prep.shortened,
        prefix_tokens: prep.prefix_len,
        ..GenStats::default()
    };

    // Reuse the longest cached prefix; at least the last prompt token is run to get logits.
    let mut common = st
        .cached
        .iter()
        .zip(tokens)
        .take_while(|(a, b)| a == b)
        .count();
    common = run_start(
        tokens,
        common.min(tokens.len() - 1).min(st.model.cached_len()),
    );
    st.model.truncate_cache(common)?;
    st.cached.truncate(common);
    stats.images = prep.images.len();
    stats.image_tokens = tokens.iter().filter(|&&t| is_virtual(t)).count();
    let t_images = Instant::now();
    st.model.encode_images(&prep.images)?;
    stats.image_secs = t_images.elapsed().as_secs_f64();
    let t_prefill = Instant::now();
    // The system prompt and tools' state from an earlier question (this process or, with a cache
    // folder, an earlier one) when the cache holds less of it.
    let prefix = &tokens[..prep.prefix_len.min(tokens.len() - 1)];
    let keep_prefix = prefix.len() >= MIN_PREFIX_TOKENS;
    if keep_prefix && common < prefix.len() {
        let kv = st.model.kv();
        if let Some((snap, source)) = inner.prefixes.get(prefix, kv.n_layer(), kv.kvd()) {
            kv.restore(&snap)?;
            st.cached.clear();
            st.cached.extend_from_slice(prefix);
            common = prefix.len();
            stats.prefix_source = Some(source);
        }
    }
    stats.reused_tokens = common;
    let mut logits: Option<Tensor> = None;
    for chunk in prefill_chunks(&tokens[common..]) {
        logits = Some(st.model.forward(chunk)?);
        st.cached.extend_from_slice(chunk);
        if tx.is_closed() {
            return Ok(None);
        }
    }
    stats.prefill_tokens = tokens.len() - common;
    if keep_prefix && stats.prefix_source.is_none() && !inner.prefixes.holds(prefix) {
        if let Some(snap) = st.model.kv().snapshot(prefix) {
            inner.prefixes.put(snap);
        }
    }
    stats.prefill_secs = t_prefill.elapsed().as_secs_f64();
    let logits =
        logits.ok_or_else(|| LocalError::Inference("the prompt produced no tokens".into()))?;
    Ok(Some((logits, stats)))
}

/// The state of one answer being decoded.
struct Turn<'a> {
    inner: &'a Inner,
    prep: &'a Prepared,
    st: &'a mut crate::State,
    tx: &'a Sender,
    stats: GenStats,
    /// The logits for the next token.
    logits: Tensor,
    /// Prose only: no tool call, and no answer that opens like JSON or a code fence. True when
    /// the request has no tools (a synthesis turn) or after the model repeated an earlier call.
    prose_only: bool,
    sampler: LogitsProcessor,
    /// The `<tool_call>` and `</tool_call>` tokens (none under the ReAct protocol).
    open: Option<u32>,
    close: Option<u32>,
    /// The `Action:` grammar, under the ReAct protocol.
    react: Option<&'a Constraint>,
    mode: Mode,
    utf8: Utf8Stream,
    text: TextOut,
    /// Where the answer starts in the cache (after a restated question, later than the prompt).
    prompt_len: usize,
    generated: Vec<u32>,
    /// Start of the last line found not to be an `Action:` block.
    free_line: Option<usize>,
    calls: usize,
    seen_calls: Vec<(String, Option<Value>)>,
    finish: FinishReason,
    /// Whether the answer's lead was decided (see `Prepared::lead_after_results`).
    led: bool,
    t_decode: Instant,
    /// Draft tokens already run after the last chosen one, with the logits that follow each.
    drafts: VecDeque<(u32, Tensor)>,
}

impl<'a> Turn<'a> {
    fn new(
        inner: &'a Inner,
        prep: &'a Prepared,
        st: &'a mut crate::State,
        tx: &'a Sender,
        logits: Tensor,
        stats: GenStats,
    ) -> Result<Self, LocalError> {
        let tok = &inner.tok;
        // Under the ReAct protocol calls are text: `<tool_call>` tokens mean nothing then.
        let (open, close) = if prep.react {
            (None, None)
        } else {
            (tok.special("<tool_call>"), tok.special("</tool_call>"))
        };
        let react = prep.constraint.as_ref().filter(|_| prep.react);
        let prompt_len = st.cached.len();
        let mut turn = Turn {
            inner,
            prep,
            st,
            tx,
            stats,
            logits,
            prose_only: !prep.has_tools,
            sampler: LogitsProcessor::from_sampling(inner.cfg.seed, prep.sampling.clone()),
            open,
            close,
            react,
            mode: Mode::Free,
            utf8: Utf8Stream::default(),
            text: TextOut {
                text: String::new(),
                sent: 0,
                stops: prep.stop.clone(),
                hold_all: prep.constraint.is_some() && !prep.react,
                hold_line: react.is_some(),
            },
            prompt_len,
            generated: Vec::new(),
            free_line: None,
            calls: 0,
            seen_calls: Vec::new(),
            finish: FinishReason::Stop,
            led: false,
            t_decode: Instant::now(),
            drafts: VecDeque::new(),
        };
        if prep.require_tool && !turn.prose_only {
            turn.start_in_call()?;
        }
        turn.t_decode = Instant::now();
        Ok(turn)
    }

    /// The turn must be a call: it starts inside the grammar.
    fn start_in_call(&mut self) -> Result<(), LocalError> {
        let prep = self.prep;
        if let Some(c) = self.react {
            self.mode = Mode::Action {
                matcher: Box::new(c.matcher()?),
            };
        } else if let (Some(c), Some(o)) = (&prep.constraint, self.open) {
            self.mode = open_call(Some(c), o)?;
            self.text.hold_all = false;
            self.generated.push(o);
            self.logits = self.st.model.forward(&[o])?;
            self.st.cached.push(o);
        }
        Ok(())
    }

    /// Prose with nothing left to rewind it: no ReAct block, no held call, no lead to come.
    fn greedy_prose(&self) -> bool {
        self.inner.cfg.prompt_lookup
            && matches!(self.prep.sampling, Sampling::ArgMax)
            && self.react.is_none()
            && !self.text.hold_all
            && (self.led || !self.prep.lead_after_results)
    }

    /// One token (or one batch the grammar forces).
    fn step(&mut self) -> Result<Flow, LocalError> {
        let greedy_prose = self.greedy_prose();
        if !(greedy_prose && matches!(self.mode, Mode::Free)) {
            drop_drafts(self.st, &mut self.drafts, 0)?;
        }
        if self.generated.len() >= self.prep.max_new {
            return self.out_of_tokens();
        }
        if let Some(flow) = self.forced_batch()? {
            return Ok(flow);
        }
        let next = self.sample()?;
        if self.inner.tok.stop_tokens.contains(&next) {
            if let Mode::Call { body: Some(_), .. } = self.mode {
                return Err(LocalError::Grammar(
                    "the model ended its turn inside a tool call".into(),
                ));
            }
            return Ok(Flow::Done);
        }
        let flow = match self.mode {
            Mode::Action { .. } => self.on_action(next)?,
            Mode::Free if Some(next) == self.open => {
                self.mode = open_call(self.prep.constraint.as_ref(), next)?;
                Flow::Next
            }
            Mode::Free => self.on_free(next)?,
            Mode::Call { .. } => self.on_call(next)?,
        };
        match flow {
            Flow::Next => self.advance(next, greedy_prose),
            other => Ok(other),
        }
    }

    /// `max_tokens` reached: the answer is cut (a call cut off is an error, unless calls before
    /// it finished).
    fn out_of_tokens(&mut self) -> Result<Flow, LocalError> {
        if let Mode::Call { body: Some(b), .. } = &self.mode {
            if self.calls > 0 {
                // Keep the finished calls; the cut-off extra one is dropped.
                tracing::warn!("local model: max_tokens reached in an extra tool call; dropped");
                return Ok(Flow::Done);
            }
            return Err(LocalError::CallCutOff {
                max: self.prep.max_new as u32,
                partial: String::from_utf8_lossy(b).chars().take(200).collect(),
            });
        }
        self.finish = FinishReason::Length;
        Ok(Flow::Done)
    }

    /// What the grammar leaves no choice about runs as one batch instead of one forward pass
    /// per token: in an `Action:` block "Action: ", a lone tool's name, the only image id
    /// (streamed as text); inside a call the tool name, the only image id, the punctuation. A
    /// forced control token is left to the sampler. `None` when fewer than two are forced.
    fn forced_batch(&mut self) -> Result<Option<Flow>, LocalError> {
        let inner = self.inner;
        let tok = &inner.tok;
        let room = self.prep.max_new - self.generated.len();
        match &mut self.mode {
            Mode::Action { matcher: m } => {
                let ff = forced_tokens(m, tok, room);
                if ff.len() < 2 {
                    return Ok(None);
                }
                m.consume_tokens(&ff)
                    .map_err(|e| LocalError::Grammar(e.to_string()))?;
                let mut bytes = Vec::new();
                for &t in &ff {
                    bytes.extend_from_slice(tok.token_bytes(t));
                }
                let piece = self.utf8.push(&bytes);
                let (out, hit) = self.text.push(&piece);
                self.generated.extend_from_slice(&ff);
                self.run_forced(&ff)?;
                if (!out.is_empty() && !send(self.tx, ChatDelta::Text(out))) || self.tx.is_closed()
                {
                    return Ok(Some(Flow::Gone));
                }
                // `Observation:`: the blocks are over.
                Ok(Some(if hit { Flow::Done } else { Flow::Again }))
            }
            Mode::Call {
                matcher: Some(m),
                body: Some(b),
            } => {
                let ff = forced_tokens(m, tok, room);
                if ff.len() < 2 {
                    return Ok(None);
                }
                m.consume_tokens(&ff)
                    .map_err(|e| LocalError::Grammar(e.to_string()))?;
                for &t in &ff {
                    b.extend_from_slice(tok.token_bytes(t));
                }
                self.generated.extend_from_slice(&ff);
                self.run_forced(&ff)?;
                Ok(Some(if self.tx.is_closed() {
                    Flow::Gone
                } else {
                    Flow::Again
                }))
            }
            _ => Ok(None),
        }
    }

    /// Runs a forced batch's pass.
    fn run_forced(&mut self, ff: &[u32]) -> Result<(), LocalError> {
        let t_ff = Instant::now();
        self.logits = self.st.model.forward(ff)?;
        self.stats.forced_secs += t_ff.elapsed().as_secs_f64();
        self.st.cached.extend_from_slice(ff);
        self.stats.forced_tokens += ff.len();
        self.stats.forced_batches += 1;
        Ok(())
    }

    /// The next token: the grammar's mask inside a block or call, the prose bans in prose only.
    fn sample(&mut self) -> Result<u32, LocalError> {
        let inner = self.inner;
        let tok = &inner.tok;
        let mut l: Vec<f32> = self.logits.to_vec1()?;
        match &mut self.mode {
            Mode::Call {
                matcher: Some(m), ..
            }
            | Mode::Action { matcher: m } => {
                let mask = m
                    .compute_mask()
                    .map_err(|e| LocalError::Grammar(e.to_string()))?;
                for (i, v) in l.iter_mut().enumerate() {
                    if !mask.is_allowed(i as u32) {
                        *v = f32::NEG_INFINITY;
                    }
                }
            }
            Mode::Free if self.prose_only => {
                let (anywhere, at_start) = tok.prose_bans();
                let mut banned: Vec<&[u32]> = vec![self.open.as_slice(), anywhere];
                if self.text.text.trim().is_empty() {
                    // Until the answer has begun: no odd opener, and no empty answer.
                    banned.push(at_start);
                    banned.push(&tok.stop_tokens);
                }
                for &t in banned.into_iter().flatten() {
                    if let Some(v) = l.get_mut(t as usize) {
                        *v = f32::NEG_INFINITY;
                    }
                }
            }
            _ => {}
        }
        Ok(match self.prep.sampling {
            // Greedy: the index of the largest logit, without another copy into a tensor.
            Sampling::ArgMax => greedy(&l),
            _ => self
                .sampler
                .sample(&Tensor::new(l.as_slice(), &Device::Cpu)?)?,
        })
    }

    /// A token inside ReAct `Action:` blocks: held to the grammar, streamed as text.
    fn on_action(&mut self, next: u32) -> Result<Flow, LocalError> {
        let Mode::Action { matcher } = &mut self.mode else {
            return Ok(Flow::Next);
        };
        matcher
            .consume_token(next)
            .map_err(|e| LocalError::Grammar(e.to_string()))?;
        let piece = self.utf8.push(self.inner.tok.token_bytes(next));
        let (out, hit) = self.text.push(&piece);
        if !out.is_empty() && !send(self.tx, ChatDelta::Text(out)) {
            return Ok(Flow::Gone);
        }
        if hit || matcher.is_stopped() {
            self.generated.push(next);
            return Ok(Flow::Done);
        }
        Ok(Flow::Next)
    }

    /// A token of free text: the answer's lead, a ReAct block starting, a bare JSON call to
    /// rewrite under the grammar, else text to stream.
    fn on_free(&mut self, next: u32) -> Result<Flow, LocalError> {
        let inner = self.inner;
        let tok = &inner.tok;
        if tok.is_special(next) {
            // Any other control token (`<|im_start|>`, `</tool_call>` out of place) ends the turn.
            return Ok(Flow::Done);
        }
        if let Some(flow) = self.lead(next)? {
            return Ok(flow);
        }
        let piece = self.utf8.push(tok.token_bytes(next));
        let (mut out, hit) = self.text.push(&piece);
        if !hit {
            if let Some(flow) = self.action_block(next, &mut out)? {
                return Ok(flow);
            }
        }
        if self.text.hold_all && !hit {
            let prep = self.prep;
            match (call_trigger(&self.text.text), &prep.constraint, self.open) {
                (Trigger::Call, Some(c), Some(open)) => {
                    // Rewind the bare JSON and let the model write it as a proper,
                    // constrained call instead.
                    self.st.model.truncate_cache(self.prompt_len)?;
                    self.st.cached.truncate(self.prompt_len);
                    self.stats.rewound_tokens += self.generated.len() + 1;
                    self.clear_answer();
                    self.text.hold_all = false;
                    self.mode = open_call(Some(c), open)?;
                    self.generated.push(open);
                    self.logits = self.st.model.forward(&[open])?;
                    self.st.cached.push(open);
                    return Ok(Flow::Again);
                }
                (Trigger::Undecided, ..) => {}
                _ => {
                    self.text.hold_all = false;
                    out = self.text.flush_safe();
                }
            }
        }
        if !out.is_empty() && !send(self.tx, ChatDelta::Text(out)) {
            return Ok(Flow::Gone);
        }
        Ok(if hit { Flow::Done } else { Flow::Next })
    }

    /// The first token of a prose answer after tool results: unless it opens JSON, a list, a
    /// fence or a tag, the answer opens instead by pointing at the result it comes from: a 0.5B
    /// model otherwise often writes a bare option letter (the first option) and stops. The
    /// question is restated after the results first, as after a repeated call: the model then
    /// quotes the result the lead names, not the one it read last.
    fn lead(&mut self, next: u32) -> Result<Option<Flow>, LocalError> {
        let prep = self.prep;
        if !prep.lead_after_results || self.led || !self.text.text.trim().is_empty() {
            return Ok(None);
        }
        let bytes = self.inner.tok.token_bytes(next);
        let Some(b) = bytes.iter().find(|b| !b.is_ascii_whitespace()) else {
            return Ok(None);
        };
        self.led = true;
        if matches!(b, b'{' | b'[' | b'`' | b'<') {
            return Ok(None);
        }
        let lead = answer_lead("", &prep.answered_tools, &prep.question);
        self.stats.rewound_tokens += self.generated.len();
        self.clear_answer();
        self.answer_with(&lead).map(Some)
    }

    /// Under the ReAct protocol: once the line being written is an `Action:` block, rewrites it
    /// from its line's start under the grammar, when a token starts there (otherwise it stays
    /// free text; the agent reads it all the same).
    fn action_block(&mut self, next: u32, out: &mut String) -> Result<Option<Flow>, LocalError> {
        let Some(c) = self.react else {
            return Ok(None);
        };
        let start = match action_line(&self.text.text, self.free_line) {
            Line::Undecided => return Ok(None),
            Line::Free(start) => {
                self.free_line = Some(start);
                return Ok(None);
            }
            Line::Action(start) => start,
        };
        let inner = self.inner;
        let tok = &inner.tok;
        let mut at = 0usize;
        let mut k = None;
        for (i, &t) in self.generated.iter().chain([&next]).enumerate() {
            if at == start {
                k = Some(i);
                break;
            }
            at += tok.token_bytes(t).len();
        }
        match k {
            Some(k) if self.prompt_len + k <= self.st.cached.len() => {
                self.stats.rewound_tokens += self.generated.len() + 1 - k;
                self.generated.truncate(k);
                self.logits = rewind_to(self.st, self.prompt_len + k)?;
                self.text.text.truncate(start);
                self.text.sent = self.text.sent.min(start);
                self.utf8 = Utf8Stream::default();
                self.mode = Mode::Action {
                    matcher: Box::new(c.matcher()?),
                };
                if !out.is_empty() && !send(self.tx, ChatDelta::Text(std::mem::take(out))) {
                    return Ok(Some(Flow::Gone));
                }
                Ok(Some(Flow::Again))
            }
            _ => {
                self.free_line = Some(start);
                Ok(None)
            }
        }
    }

    /// A token inside the tool-call section: the call's body, its end, or text after the calls.
    fn on_call(&mut self, next: u32) -> Result<Flow, LocalError> {
        let inner = self.inner;
        let tok = &inner.tok;
        let Mode::Call { matcher, body } = &mut self.mode else {
            return Ok(Flow::Next);
        };
        if let Some(m) = matcher.as_mut() {
            m.consume_token(next)
                .map_err(|e| LocalError::Grammar(e.to_string()))?;
        }
        if Some(next) == self.open {
            *body = Some(Vec::new());
        } else if Some(next) == self.close {
            let raw = body.take().unwrap_or_default();
            return self.call_written(next, &raw);
        } else if let Some(b) = body.as_mut() {
            b.extend_from_slice(tok.token_bytes(next));
        } else if self.prep.constraint.is_none()
            && !tok.token_bytes(next).iter().all(u8::is_ascii_whitespace)
        {
            // Unconstrained text after the calls: the turn is over.
            return Ok(Flow::Done);
        }
        Ok(Flow::Next)
    }

    /// A call's closing token: the call is sent, unless it repeats one (then the turn ends, or,
    /// for a call of an earlier round as the first of this turn, restarts as prose).
    fn call_written(&mut self, next: u32, raw: &[u8]) -> Result<Flow, LocalError> {
        let prep = self.prep;
        let call = parse_call_body(&String::from_utf8_lossy(raw)).map_err(|e| {
            LocalError::Grammar(format!("the model wrote an invalid tool call: {e}"))
        })?;
        let key = call_key(&call.name, &call.arguments);
        let repeats_earlier_round = prep.previous_calls.contains(&key);
        if repeats_earlier_round && self.calls == 0 {
            // The result of this very call is already in the conversation: small models loop
            // on it. Restart the answer from the prompt, as prose.
            tracing::info!(
                "local model repeated the call {} it already has a result for; answering in prose instead",
                call.name
            );
            self.stats.rewound_tokens += self.generated.len() + 1;
            self.clear_answer();
            self.text.hold_all = false;
            self.mode = Mode::Free;
            self.prose_only = true;
            // The answer starts by pointing at the result it must come from; a 0.5B model then
            // quotes it instead of writing a vague sentence.
            let lead = answer_lead(&call.name, &prep.answered_tools, &prep.question);
            return self.answer_with(&lead);
        }
        if repeats_earlier_round || self.seen_calls.contains(&key) {
            // A repeat ends the turn; the calls made so far stand.
            self.generated.push(next);
            return Ok(Flow::Done);
        }
        self.seen_calls.push(key);
        if self.stats.first_tool_call_secs.is_none() {
            self.stats.first_tool_call_secs = Some(prep.started.elapsed().as_secs_f64());
        }
        let delta = ChatDelta::ToolCall {
            index: self.calls,
            id: Some(next_call_id(self.inner)),
            name: Some(call.name),
            arguments: call.arguments,
        };
        self.calls += 1;
        if !send(self.tx, delta) {
            return Ok(Flow::Gone);
        }
        if self.calls >= MAX_CALLS_PER_TURN {
            self.generated.push(next);
            return Ok(Flow::Done);
        }
        Ok(Flow::Next)
    }

    /// Forgets the answer written so far (its tokens, text and pending bytes).
    fn clear_answer(&mut self) {
        self.generated.clear();
        self.text.text.clear();
        self.text.sent = 0;
        self.utf8 = Utf8Stream::default();
    }

    /// Restarts the answer after the restated question, opening with `lead`.
    fn answer_with(&mut self, lead: &str) -> Result<Flow, LocalError> {
        self.prompt_len = restate_question(self.st, self.prep, self.prompt_len)?;
        let opened = open_with(
            self.st,
            &self.inner.tok,
            lead,
            &mut self.generated,
            &mut self.text,
            self.tx,
        )?;
        Ok(match opened {
            Some(l) => {
                self.logits = l;
                Flow::Again
            }
            None => Flow::Gone,
        })
    }

    /// Appends the sampled token and gets the logits after it: from the draft whose pass
    /// already ran, else from its own pass (with a new draft checked in the same pass).
    fn advance(&mut self, next: u32, greedy_prose: bool) -> Result<Flow, LocalError> {
        self.generated.push(next);
        let window = self.inner.cfg.repetition_window;
        if let Some(period) = repetition(&self.generated, window) {
            return Err(LocalError::Repetition { period, window });
        }
        match self.drafts.pop_front() {
            // The token greedy decoding chose was the draft's: its pass already ran.
            Some((t, l)) if t == next => {
                self.stats.draft_kept += 1;
                self.logits = l;
            }
            rejected => {
                if rejected.is_some() {
                    drop_drafts(self.st, &mut self.drafts, 1)?;
                }
                self.run_with_draft(next, greedy_prose)?;
            }
        }
        Ok(if self.tx.is_closed() {
            Flow::Gone
        } else {
            Flow::Next
        })
    }

    /// Runs `next`'s pass. Drafts only while the answer is plain prose that nothing rewinds,
    /// and only under greedy decoding, which keeps a draft exactly when it would have written
    /// it: the text is greedy decoding's, up to the batched pass's rounding.
    fn run_with_draft(&mut self, next: u32, greedy_prose: bool) -> Result<(), LocalError> {
        let draft = if greedy_prose && matches!(self.mode, Mode::Free) {
            let room = self
                .prep
                .max_new
                .saturating_sub(self.generated.len() + 1)
                .min(
                    self.st
                        .model
                        .max_positions()
                        .saturating_sub(self.st.cached.len() + 2),
                );
            lookup_draft(&self.prep.tokens, &self.generated, DRAFT_TOKENS.min(room))
        } else {
            Vec::new()
        };
        let batch: Vec<u32> = std::iter::once(next).chain(draft.iter().copied()).collect();
        let all = if draft.is_empty() {
            None
        } else {
            self.st.model.forward_all(&batch).transpose()?
        };
        match all {
            Some(all) => {
                self.stats.drafted_tokens += draft.len();
                self.logits = all.get(0)?;
                for (i, &t) in draft.iter().enumerate() {
                    self.drafts.push_back((t, all.get(i + 1)?));
                }
                self.st.cached.extend_from_slice(&batch);
            }
            None => {
                self.logits = self.st.model.forward(&[next])?;
                self.st.cached.push(next);
            }
        }
        Ok(())
    }

    /// Streams what text is left, records the stats and sends the finish.
    fn end(mut self) -> Result<(), LocalError> {
        drop_drafts(self.st, &mut self.drafts, 0)?;
        let rest = self.text.flush();
        let rest = rest + &self.utf8.push(&[]);
        if !rest.is_empty() && !send(self.tx, ChatDelta::Text(rest)) {
            return Ok(());
        }
        let mut stats = std::mem::take(&mut self.stats);
        stats.decode_tokens = self.generated.len() + stats.rewound_tokens;
        stats.decode_secs = self.t_decode.elapsed().as_secs_f64();
        stats.total_secs = self.prep.started.elapsed().as_secs_f64();
        if self.calls > 0 {
            self.finish = FinishReason::ToolCalls;
        }
        let usage = Usage {
            prompt_tokens: stats.prompt_tokens as u32,
            completion_tokens: self.generated.len() as u32,
        };
        tracing::debug!(?stats, "local generation finished");
        if let Ok(mut s) = self.inner.stats.lock() {
            *s = stats;
        }
        send(
            self.tx,
            ChatDelta::Finish {
                reason: self.finish,
                usage: Some(usage),
            },
        );
        Ok(())
    }
}

/// A closed answer: token by token, the model's most likely token among those that continue
/// some choice (a complete choice competes through the end-of-turn token); once one choice is
/// left it is written out without further forward passes. Greedy whatever the temperature, so
/// the same conversation always gets the same choice. (Scoring each whole choice by its mean
/// log-probability was tried: a small model then prefers the longest option it can copy from
/// the list, "The question cannot be answered from a chest radiograph", every time.)
fn choose(
    inner: &Inner,
    prep: &Prepared,
    st: &mut crate::State,
    tx: &Sender,
    mut logits: Tensor,
    mut stats: GenStats,
) -> Result<(), LocalError> {
    let choices = &prep.choices;
    let t_decode = Instant::now();
    let mut alive: Vec<usize> = (0..choices.len())
        .filter(|&i| !choices[i].1.is_empty())
        .collect();
    let mut step = 0usize;
    let picked = loop {
        if alive.len() <= 1 {
            break alive.first().copied();
        }
        let l: Vec<f32> = logits.to_vec1()?;
        let score = |t: u32| l.get(t as usize).copied().unwrap_or(f32::NEG_INFINITY);
        let end = inner
            .tok
            .stop_tokens
            .iter()
            .map(|&t| score(t))
            .fold(f32::NEG_INFINITY, f32::max);
        let mut best: Option<(f32, Option<u32>)> = None;
        for &i in &alive {
            let (s, t) = match choices[i].1.get(step) {
                Some(&t) => (score(t), Some(t)),
                None => (end, None),
            };
            if best.is_none_or(|(b, _)| s > b) {
                best = Some((s, t));
            }
        }
        match best {
            None => break None,
            Some((_, None)) => break alive.iter().copied().find(|&i| choices[i].1.len() == step),
            Some((_, Some(t))) => {
                alive.retain(|&i| choices[i].1.get(step) == Some(&t));
                step += 1;
                if alive.len() > 1 {
                    logits = st.model.forward(&[t])?;
                    st.cached.push(t);
                    stats.decode_tokens += 1;
                }
            }
        }
    };
    let Some(picked) = picked else {
        return Err(LocalError::Inference(
            "no choice could be tokenized: every choice is empty".into(),
        ));
    };
    stats.decode_secs = t_decode.elapsed().as_secs_f64();
    stats.total_secs = prep.started.elapsed().as_secs_f64();
    let usage = Usage {
        prompt_tokens: stats.prompt_tokens as u32,
        completion_tokens: choices[picked].1.len() as u32,
    };
    if let Ok(mut s) = inner.stats.lock() {
        *s = stats;
    }
    if !send(tx, ChatDelta::Text(choices[picked].0.clone())) {
        return Ok(());
    }
    send(
        tx,
        ChatDelta::Finish {
            reason: FinishReason::Stop,
            usage: Some(usage),
        },
    );
    Ok(())
}

/// Forgets the unchecked drafts and, in the cache, their positions and `extra` more before them.
fn drop_drafts(
    st: &mut crate::State,
    drafts: &mut VecDeque<(u32, Tensor)>,
    extra: usize,
) -> Result<(), LocalError> {
    let n = drafts.len() + extra;
    drafts.clear();
    if n > 0 {
        let keep = st.cached.len().saturating_sub(n);
        st.model.truncate_cache(keep)?;
        st.cached.truncate(keep);
    }
    Ok(())
}

/// The tokens the grammar leaves no choice about next, up to the first control token (left to
/// the sampler) and at most `room`.
fn forced_tokens(m: &mut Matcher, tok: &GgufTokenizer, room: usize) -> Vec<u32> {
    let mut ff = m.compute_ff_tokens();
    if let Some(cut) = ff.iter().position(|&t| tok.is_special(t)) {
        ff.truncate(cut);
    }
    ff.truncate(room);
    ff
}
