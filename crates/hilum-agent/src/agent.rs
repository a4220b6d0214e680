//! The loop: reason → act (all calls of the turn at once) → observe → repeat or finish.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::stream::{FuturesUnordered, StreamExt};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::checkpoint::{order_tool_messages, Checkpointer, Progress, Resume};

mod answers;
use crate::coverage::{self, CapabilityRow, Coverage};
use crate::event::{CallInfo, Event, EventSender, RunEvent};
use crate::grounding::{self, Sources};
use crate::protocol::{ParsedTurn, Protocol};
use crate::tool::{Environment, ToolContext};
use crate::toolbox::{run_prepared, CallFailure, CallResult, FailureKind, PreparedCall, Toolbox};
use hilum_llm::{collect_turn, ChatRequest, ImagePayload, Llm, LlmError, Message, ToolCall, Usage};

/// How the loop reaches its answer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// Reason and act until the model answers.
    #[default]
    React,
    /// Draft → self-critique (missing / superfluous) → more tool calls → revised answer.
    Reflexion,
}

impl std::str::FromStr for Mode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "react" => Ok(Mode::React),
            "reflexion" => Ok(Mode::Reflexion),
            other => Err(format!("unknown mode `{other}`: use react or reflexion")),
        }
    }
}

/// When the loop insists on tools before it takes an answer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ToolPolicy {
    /// A question about an image answered in the first round without any tool call is sent
    /// back once ("use the tools first"), with `tool_choice: "required"` where supported.
    #[default]
    FirstRound,
    /// Any answer is taken as it comes.
    Never,
}

impl std::str::FromStr for ToolPolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "first_round" => Ok(ToolPolicy::FirstRound),
            "never" => Ok(ToolPolicy::Never),
            other => Err(format!(
                "unknown tool policy `{other}`: use first_round or never"
            )),
        }
    }
}

/// How the agent runs: protocol, mode, budgets and prompt.
#[derive(Clone, Debug)]
pub struct AgentConfig {
    /// How tools are offered to the model.
    pub protocol: Protocol,
    /// Plain reasoning and acting, or reflexion.
    pub mode: Mode,
    /// Tool rounds before the loop must answer.
    pub max_rounds: usize,
    /// Tool calls in the whole run.
    pub max_tool_calls: usize,
    /// Wall-clock budget of the whole run.
    pub deadline: Duration,
    /// Budget of one tool call.
    pub tool_timeout: Duration,
    /// Critique/revise cycles in reflexion mode.
    pub reflexion_rounds: usize,
    /// The system message.
    pub system_prompt: String,
    /// Sampling temperature sent with each request.
    pub temperature: Option<f32>,
    /// Most tokens per model turn.
    pub max_tokens: Option<u32>,
    /// Characters of a tool's JSON data shown to the model after its summary line; 0 shows
    /// the summary alone (the events keep all of the data).
    pub max_observation_chars: usize,
    /// Whether a first turn must call a tool.
    pub require_tools: ToolPolicy,
    /// Check every final answer against the tool results (see [`crate::grounding`]): one
    /// revision request, then the answer is marked `grounded: false`.
    pub grounding: bool,
    /// Show a model the overlays and masks its tool calls drew, as pictures in the next turn.
    /// Only ever to a model that reads images and runs in this process (pixels never leave
    /// it); `None`: on for such a model.
    pub show_overlays: Option<bool>,
}

/// The system message unless the configuration gives one.
pub const DEFAULT_SYSTEM_PROMPT: &str = "You are Hilum, an assistant that analyses chest X-rays with tools. \
Images are referred to by ids such as img_3fa2c1; pass these ids to tools. \
Base every finding on tool results and say which result supports it; never invent numbers. \
When several tools are needed and do not depend on each other, call them all in the same turn: they run in parallel. \
If a tool fails, read its error and either fix the call or answer without it. \
Say plainly what is uncertain. Your answers support a radiologist; they are not a diagnosis.";

impl Default for AgentConfig {
    fn default() -> Self {
        AgentConfig {
            protocol: Protocol::Native,
            mode: Mode::React,
            max_rounds: 6,
            max_tool_calls: 24,
            deadline: Duration::from_secs(600),
            tool_timeout: Duration::from_secs(300),
            reflexion_rounds: 1,
            system_prompt: DEFAULT_SYSTEM_PROMPT.to_string(),
            temperature: None,
            max_tokens: None,
            max_observation_chars: 4000,
            require_tools: ToolPolicy::FirstRound,
            grounding: true,
            show_overlays: None,
        }
    }
}

/// What a run starts from.
#[derive(Clone, Debug, Default)]
pub struct RunInput {
    /// The user's question.
    pub question: String,
    /// Ids of the images the question is about.
    pub images: Vec<String>,
    /// Pixels for a multimodal model; leave empty unless the user allowed pixels to leave.
    pub image_payloads: Vec<ImagePayload>,
    /// Earlier messages of the session (without a system message).
    pub history: Vec<Message>,
    /// The session (handed to tools with each call).
    pub session_id: String,
    /// What is known about the images (size, pixel spacing, view): numbers an answer may quote.
    pub image_metadata: Vec<Value>,
}

/// Why the loop stopped.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    /// The model answered.
    Answered,
    /// The tool rounds ran out.
    MaxRounds,
    /// The tool calls ran out.
    MaxToolCalls,
    /// Every call of a round repeated one that had already succeeded; the model then answered
    /// without tools.
    RepeatedCalls,
    /// The time ran out.
    Deadline,
    /// The model failed.
    Error,
}

impl StopReason {
    /// The name in events and records (`answered`, `max_rounds`, …).
    pub fn as_str(&self) -> &'static str {
        match self {
            StopReason::Answered => "answered",
            StopReason::MaxRounds => "max_rounds",
            StopReason::MaxToolCalls => "max_tool_calls",
            StopReason::RepeatedCalls => "repeated_calls",
            StopReason::Deadline => "deadline",
            StopReason::Error => "error",
        }
    }
}

/// The result of a run. The events tell the same story step by step.
#[derive(Clone, Debug)]
pub struct RunOutcome {
    /// The final answer, when there is one.
    pub answer: Option<String>,
    /// Why the loop stopped.
    pub reason: StopReason,
    /// What failed, when something did.
    pub error: Option<String>,
    /// The whole conversation, system message first.
    pub messages: Vec<Message>,
    /// Tool rounds run.
    pub rounds: usize,
    /// Tool calls made.
    pub tool_calls: usize,
    /// Every call's result, in order.
    pub results: Vec<CallResult>,
    /// Whether the answer passed the grounding check; `None` when the check is off or there
    /// is no answer.
    pub grounded: Option<bool>,
    /// What the answer states that no tool result supports.
    pub unsupported: Vec<String>,
    /// Whether the answer addresses each part of the question a tool result covered; `None`
    /// when the question names no known topic.
    pub answers_question: Option<bool>,
    /// Parts Hilum stated from the tool results because the model's answer left them out.
    pub unanswered: Vec<String>,
    /// Parts no installed tool covers.
    pub cannot_assess: Vec<String>,
    /// Sentences removed from the model's answer (findings no tool result covers).
    pub dropped: Vec<String>,
}

/// The agent: a model, a toolbox and budgets.
pub struct Agent {
    llm: Arc<dyn Llm>,
    toolbox: Arc<Toolbox>,
    env: Environment,
    config: AgentConfig,
}

struct RunState {
    messages: Vec<Message>,
    payloads: Vec<ImagePayload>,
    session_id: String,
    started: Instant,
    rounds: usize,
    tool_calls: usize,
    critiques: usize,
    phase: &'static str,
    llm_ms: f64,
    tool_ms: f64,
    usage: Usage,
    results: Vec<CallResult>,
    /// The round of each entry of `results`.
    result_rounds: Vec<usize>,
    events: Option<EventSender>,
    question: String,
    has_images: bool,
    image_metadata: Vec<Value>,
    /// Earlier user messages and tool results of the session: an answer may quote them.
    history_texts: Vec<String>,
    /// The session already holds tool results (a follow-up may answer from them).
    history_results: bool,
    /// The "use the tools first" request was made.
    tools_requested: bool,
    /// The next turn must call a tool (where the backend can force it).
    require_tool_next: bool,
    /// The grounding revision request was made.
    revision_requested: bool,
    /// The grounding verdict on the answer: `None` unchecked, empty when grounded.
    unsupported: Option<Vec<String>>,
    /// Ids of the pictures given to the model as pixels so far.
    images_seen: Vec<String>,
    /// What the question asks about and which tools cover each part.
    coverage: Coverage,
    /// What every tool can answer here, installed or not.
    capabilities: Vec<CapabilityRow>,
    /// Tools whose results earlier turns of the session hold.
    history_tools: Vec<String>,
    /// The relevance revision request was made.
    relevance_requested: bool,
    /// Hilum ran the tools covering the parts no call of the model answered.
    covering_run: bool,
    /// Ids of the images the question is about.
    images: Vec<String>,
    /// The relevance verdict and what Hilum added or removed (see [`Agent::complete_answer`]).
    answers_question: Option<bool>,
    unanswered: Vec<String>,
    dropped: Vec<String>,
    /// Where a durable run stores its steps.
    checkpointer: Option<Arc<dyn Checkpointer>>,
    /// How many of `messages` are stored (system prompt and history count as stored).
    saved: usize,
}

impl RunState {
    /// The id and round of an earlier successful call with the same tool and arguments.
    fn earlier_success(&self, p: &PreparedCall) -> Option<(String, usize)> {
        self.results
            .iter()
            .zip(&self.result_rounds)
            .find(|(r, _)| {
                r.result.is_ok()
                    && r.call.name == p.call.name
                    && r.arguments.as_ref() == Some(&p.arguments)
            })
            .map(|(r, round)| (r.call.id.clone(), *round))
    }

    fn progress(&self) -> Progress {
        Progress {
            rounds: self.rounds,
            tool_calls: self.tool_calls,
            critiques: self.critiques,
            phase: self.phase.to_string(),
            tools_requested: self.tools_requested,
            revision_requested: self.revision_requested,
        }
    }

    fn emit(&self, event: Event) {
        if let Some(tx) = &self.events {
            let _ = tx.send(RunEvent {
                t_ms: self.started.elapsed().as_secs_f64() * 1e3,
                event,
            });
        }
    }
}

const SYNTHESIS_GRACE: Duration = Duration::from_secs(30);

const USE_TOOLS_PROMPT: &str = "Use the tools first: this question is about the image, and an answer must rest on what the tools measure or find. \
Call the tools that answer it now; answer only after their results are in.";

/// What the grounding check says about an answer.
enum Verdict {
    Pass,
    /// Ask once for a revision with this message.
    Revise(String),
    Fail,
}

const NO_TOOLS_PROMPT: &str = "Tools are not available any more. Write your answer to the question in plain sentences now, from the tool results above; no JSON, no tool calls.";

const CRITIQUE_PROMPT: &str = "Critique your draft answer before it is final. List (1) what is missing: claims not backed by a tool result, \
findings or measurements a tool could still check; (2) what is superfluous or speculative. Be brief. Do not call tools in this step.";

const REVISE_PROMPT: &str = "Now call the tools that would fill what is missing (call them all at once; they run in parallel), \
or none if nothing is missing. Then give the revised final answer, citing the tool results you rely on by their call ids in \
square brackets, e.g. [call_1].";

impl Agent {
    /// A model without native tool calls (e.g. a local Gemma GGUF: no `<tool_call>` tokens)
    /// gets the text protocol (ReAct `Action:` blocks) instead of failing on the first round.
    pub fn new(
        llm: Arc<dyn Llm>,
        toolbox: Arc<Toolbox>,
        env: Environment,
        mut config: AgentConfig,
    ) -> Self {
        if config.protocol == Protocol::Native && !llm.capabilities().native_tools {
            tracing::info!(
                "{} has no native tool calls: using the react protocol",
                llm.name()
            );
            config.protocol = Protocol::React;
        }
        Agent {
            llm,
            toolbox,
            env,
            config,
        }
    }

    /// Its configuration.
    pub fn config(&self) -> &AgentConfig {
        &self.config
    }

    /// Runs the loop to an answer (or a budget). Never panics on model or tool behaviour;
    /// failures end as `StopReason::Error` with an `error` and a `complete` event.
    pub async fn run(&self, input: RunInput, events: Option<EventSender>) -> RunOutcome {
        let mut st = self.start(input, events);
        let result = self.drive(&mut st).await;
        self.finish(st, result)
    }

    /// Runs the loop like [`Agent::run`], storing every step through `checkpointer` before
    /// acting on it. With `resume`, the run continues from what an earlier, stopped run of
    /// the same question stored: its finished tool calls are reused, its unfinished calls run.
    pub async fn run_durable(
        &self,
        input: RunInput,
        resume: Option<Resume>,
        checkpointer: Arc<dyn Checkpointer>,
        events: Option<EventSender>,
    ) -> RunOutcome {
        let mut st = self.start(input, events);
        st.checkpointer = Some(checkpointer);
        let ready = match resume {
            None => self.save(&mut st).await,
            Some(r) => self.restore(&mut st, r).await,
        };
        let result = match ready {
            Ok(()) => self.drive(&mut st).await,
            Err(e) => Err(e),
        };
        self.finish(st, result)
    }

    /// Stores the messages not yet stored, with the counters.
    async fn save(&self, st: &mut RunState) -> Result<(), String> {
        let Some(cp) = st.checkpointer.clone() else {
            return Ok(());
        };
        cp.messages(&st.messages[st.saved..], &st.progress())
            .await
            .map_err(|e| format!("the run's progress could not be stored: {e}"))?;
        st.saved = st.messages.len();
        Ok(())
    }

    /// Puts a stopped run's stored state in place of the fresh question, then runs the calls
    /// of its last decision that had not finished.
    async fn restore(&self, st: &mut RunState, r: Resume) -> Result<(), String> {
        if r.messages.is_empty() {
            // Stopped before even the question was stored: start afresh.
            return self.save(st).await;
        }
        // `start` appended the question; the stored messages begin with it.
        st.messages.pop();
        let first = st.messages.len();
        let mut stored = r.messages;
        order_tool_messages(&mut stored);
        st.messages.extend(stored);
        st.saved = st.messages.len();
        let p = r.progress;
        st.rounds = p.rounds;
        st.tool_calls = p.tool_calls;
        st.critiques = p.critiques;
        st.phase = match p.phase.as_str() {
            "critique" => "critique",
            "revise" => "revise",
            "synthesis" => "synthesis",
            _ => "act",
        };
        st.tools_requested = p.tools_requested;
        st.revision_requested = p.revision_requested;
        for (round, result) in r.results {
            st.result_rounds.push(round);
            st.results.push(result);
        }
        // The last decision's calls that have no tool message did not finish: run them now.
        let Some(at) = st.messages[first..]
            .iter()
            .rposition(
                |m| matches!(m, Message::Assistant { tool_calls, .. } if !tool_calls.is_empty()),
            )
            .map(|i| first + i)
        else {
            return Ok(());
        };
        let Message::Assistant { tool_calls, .. } = &st.messages[at] else {
            return Ok(());
        };
        let calls = tool_calls.clone();
        let done: Vec<String> = st.messages[at + 1..]
            .iter()
            .filter_map(|m| match m {
                Message::Tool { tool_call_id, .. } => Some(tool_call_id.clone()),
                _ => None,
            })
            .collect();
        let pending: Vec<(ToolCall, Result<PreparedCall, CallFailure>)> = calls
            .iter()
            .filter(|c| !done.contains(&c.id))
            .map(|c| (c.clone(), self.toolbox.prepare(c, &self.env)))
            .collect();
        if pending.is_empty() {
            return Ok(());
        }
        let round = st.rounds.max(1);
        for (call, prepared) in &pending {
            if let Ok(p) = prepared {
                st.emit(Event::ToolStarted {
                    round,
                    call_id: call.id.clone(),
                    name: call.name.clone(),
                    arguments: p.arguments.clone(),
                });
            }
        }
        let timeout = self.config.tool_timeout.min(self.remaining(st));
        let started = Instant::now();
        let results = self.run_calls(st, round, pending, timeout, true).await?;
        st.tool_ms += started.elapsed().as_secs_f64() * 1e3;
        for r in &results {
            st.messages.push(self.tool_message(r));
        }
        order_tool_messages(&mut st.messages[at..]);
        st.saved = st.messages.len();
        st.result_rounds
            .extend(std::iter::repeat_n(round, results.len()));
        st.results.extend(results);
        Ok(())
    }

    fn start(&self, input: RunInput, events: Option<EventSender>) -> RunState {
        let history_texts = input
            .history
            .iter()
            .filter_map(|m| match m {
                Message::User { content, .. } => Some(content.clone()),
                Message::Tool {
                    content, is_error, ..
                } if !is_error => Some(content.clone()),
                _ => None,
            })
            .collect();
        let history_tools = input
            .history
            .iter()
            .filter_map(|m| match m {
                Message::Tool {
                    name,
                    is_error: false,
                    ..
                } => Some(name.clone()),
                _ => None,
            })
            .collect();
        let capabilities = if self.toolbox.vocabulary().is_empty() {
            Vec::new()
        } else {
            coverage::capability_table(&self.toolbox.all_tools(), &self.env)
        };
        let coverage = Coverage::of(&input.question, self.toolbox.vocabulary(), &capabilities);
        let history_results = input.history.iter().any(|m| {
            matches!(
                m,
                Message::Tool {
                    is_error: false,
                    ..
                }
            )
        });
        let question = input.question.clone();
        let has_images = !input.images.is_empty();
        let images = input.images.clone();
        let mut messages = vec![Message::system(self.config.system_prompt.clone())];
        messages.extend(
            input
                .history
                .into_iter()
                .filter(|m| !matches!(m, Message::System { .. })),
        );
        let content = if input.images.is_empty() {
            input.question
        } else {
            format!("{}\n\nImages: {}", input.question, input.images.join(", "))
        };
        messages.push(Message::user(content, input.images));
        let saved = messages.len() - 1;
        RunState {
            messages,
            payloads: input.image_payloads,
            session_id: input.session_id,
            started: Instant::now(),
            rounds: 0,
            tool_calls: 0,
            critiques: 0,
            phase: "act",
            llm_ms: 0.0,
            tool_ms: 0.0,
            usage: Usage::default(),
            results: Vec::new(),
            result_rounds: Vec::new(),
            events,
            question,
            has_images,
            image_metadata: input.image_metadata,
            history_texts,
            history_results,
            tools_requested: false,
            require_tool_next: false,
            revision_requested: false,
            unsupported: None,
            images_seen: Vec::new(),
            coverage,
            capabilities,
            history_tools,
            relevance_requested: false,
            covering_run: false,
            images,
            answers_question: None,
            unanswered: Vec::new(),
            dropped: Vec::new(),
            checkpointer: None,
            saved,
        }
    }

    async fn drive(&self, st: &mut RunState) -> Result<(String, StopReason), String> {
        if st.coverage.nothing_covered() {
            // No installed tool answers any part: Hilum says so itself, and no model is asked
            // (a model would answer from whatever unrelated result it could get).
            let answer = self.complete_answer(st, String::new());
            return Ok((answer, StopReason::Answered));
        }
        loop {
            if let Some(reason) = self.exhausted_budget(st) {
                return self.synthesize(st, reason).await;
            }
            let turn = self.reason(st, true, self.remaining(st)).await?;
            if !turn.tool_calls.is_empty() || !turn.problems.is_empty() {
                if self.act(st, turn).await? {
                    // A model that only re-asks for results it has would loop until a budget
                    // ran out (a served model has no guard of its own): make it answer now.
                    return self.synthesize(st, StopReason::RepeatedCalls).await;
                }
                continue;
            }
            let answer = turn.answer.unwrap_or_default();
            if self.must_use_tools(st) {
                st.tools_requested = true;
                st.require_tool_next = true;
                st.messages.push(Message::assistant(answer, vec![]));
                st.messages.push(Message::user(USE_TOOLS_PROMPT, vec![]));
                continue;
            }
            if self.config.mode == Mode::Reflexion && st.critiques < self.config.reflexion_rounds {
                self.critique(st, answer).await?;
                continue;
            }
            let request = match self.ground(st, &answer, true) {
                Verdict::Revise(request) => Some(request),
                Verdict::Pass | Verdict::Fail => self.relevance_request(st, &answer, true),
            };
            match request {
                Some(request) => {
                    st.messages.push(Message::assistant(answer, vec![]));
                    st.messages.push(Message::user(request, vec![]));
                    st.phase = "revise";
                }
                None => {
                    self.run_covering_tools(st).await?;
                    let answer = self.complete_answer(st, answer);
                    return Ok((answer, StopReason::Answered));
                }
            }
        }
    }

    /// The tool policy: a question about an image answered before any tool ran goes back once.
    fn must_use_tools(&self, st: &RunState) -> bool {
        self.config.require_tools == ToolPolicy::FirstRound
            && st.has_images
            && !st.history_results
            && !st.tools_requested
            && st.rounds == 0
            && st.results.is_empty()
            && !self.toolbox.specs(&self.env).is_empty()
    }

    /// What an answer may draw on: the question, the session so far, the image metadata, and
    /// every call of this run (its arguments, and its summary and data when it succeeded).
    fn sources(&self, st: &RunState) -> Sources {
        let mut s = Sources::new(st.question.clone());
        for t in &st.history_texts {
            s.add_text(t.clone());
        }
        for m in &st.image_metadata {
            s.add_data(m.clone());
        }
        for name in self.toolbox.names() {
            s.add_known(name);
        }
        for r in &st.results {
            s.add_called(r.call.name.clone());
            if let Some(args) = &r.arguments {
                s.add_data(args.clone());
            }
            if let Ok(out) = &r.result {
                s.add_text(out.summary.clone());
                s.add_data(out.data.clone());
            }
        }
        s
    }

    /// Checks an answer and records the verdict. The first failure asks for one revision;
    /// after that, failures stand and mark the answer `grounded: false`.
    fn ground(&self, st: &mut RunState, answer: &str, tools_left: bool) -> Verdict {
        if !self.config.grounding {
            return Verdict::Pass;
        }
        let unsupported = grounding::check(answer, &self.sources(st));
        if unsupported.is_empty() {
            st.unsupported = Some(Vec::new());
            return Verdict::Pass;
        }
        if st.revision_requested {
            st.unsupported = Some(unsupported);
            return Verdict::Fail;
        }
        st.revision_requested = true;
        let list: String = unsupported.iter().map(|u| format!("\n- {u}")).collect();
        let how = if tools_left {
            "Revise your answer: quote only numbers that the tool results above give (call a tool if a measurement is missing), name only tools that ran, and say plainly when a measurement is not available."
        } else {
            "Revise your answer without tools: quote only numbers that the tool results above give, name only tools that ran, and say plainly when a measurement is not available."
        };
        Verdict::Revise(format!(
            "Your answer states things that no tool result, the question or the image metadata supports:{list}\n{how}"
        ))
    }

    fn exhausted_budget(&self, st: &RunState) -> Option<StopReason> {
        if st.started.elapsed() >= self.config.deadline {
            Some(StopReason::Deadline)
        } else if st.rounds >= self.config.max_rounds {
            Some(StopReason::MaxRounds)
        } else if st.tool_calls >= self.config.max_tool_calls {
            Some(StopReason::MaxToolCalls)
        } else {
            None
        }
    }

    /// One model turn. `with_tools = false` withholds the tools (critique, synthesis).
    fn remaining(&self, st: &RunState) -> Duration {
        self.config.deadline.saturating_sub(st.started.elapsed())
    }

    async fn reason(
        &self,
        st: &mut RunState,
        with_tools: bool,
        budget: Duration,
    ) -> Result<ParsedTurn, String> {
        let tools = if with_tools {
            self.toolbox.specs(&self.env)
        } else {
            vec![]
        };
        let req = self.config.protocol.prepare(ChatRequest {
            messages: st.messages.clone(),
            tools,
            temperature: self.config.temperature,
            max_tokens: self.config.max_tokens,
            images: st.payloads.clone(),
            stop: vec![],
            require_tool: with_tools && std::mem::take(&mut st.require_tool_next),
            choices: vec![],
            text_tools: vec![],
        });
        // Which pictures the model reads as pixels in this turn (for the events).
        let images: Vec<String> = if self.llm.capabilities().images {
            req.images.iter().map(|p| p.id.clone()).collect()
        } else {
            Vec::new()
        };
        for id in &images {
            if !st.images_seen.contains(id) {
                st.images_seen.push(id.clone());
            }
        }
        let started = Instant::now();
        let events = st.events.clone();
        let t0 = st.started;
        let call = async {
            let stream = self.llm.chat(req).await?;
            collect_turn(stream, move |text| {
                if let Some(tx) = &events {
                    let _ = tx.send(RunEvent {
                        t_ms: t0.elapsed().as_secs_f64() * 1e3,
                        event: Event::Token {
                            text: text.to_string(),
                        },
                    });
                }
            })
            .await
        };
        let turn = match tokio::time::timeout(budget, call).await {
            Ok(Ok(turn)) => turn,
            Ok(Err(e)) => return Err(llm_failure(&*self.llm, &e)),
            Err(_) => {
                return Err(format!(
                    "the model did not answer within the run's time budget ({:.1} s left); raise --deadline",
                    budget.as_secs_f64()
                ))
            }
        };
        let llm_ms = started.elapsed().as_secs_f64() * 1e3;
        st.llm_ms += llm_ms;
        st.usage.prompt_tokens += turn.usage.prompt_tokens;
        st.usage.completion_tokens += turn.usage.completion_tokens;
        let usage = turn.usage;
        let parsed = self.config.protocol.parse(turn, st.rounds + 1, with_tools);
        st.emit(Event::Decision {
            round: st.rounds + 1,
            phase: st.phase.to_string(),
            text: parsed.text.clone(),
            tool_calls: parsed
                .tool_calls
                .iter()
                .map(|c| CallInfo {
                    id: c.id.clone(),
                    name: c.name.clone(),
                    arguments: c.arguments.clone(),
                })
                .collect(),
            llm_ms,
            usage,
            images,
        });
        Ok(parsed)
    }

    /// Runs every call of the turn at once and appends the observations. A call identical to
    /// one that already succeeded (same tool, same arguments) is not run again. Returns whether
    /// every call of the turn was such a repeat. A durable run stores the decision before any
    /// call starts and each result as its call ends.
    async fn act(&self, st: &mut RunState, mut turn: ParsedTurn) -> Result<bool, String> {
        st.rounds += 1;
        let round = st.rounds;
        // Ids must stay unique in the conversation: servers that write calls as text give the
        // same ids (call_text_0, ...) every round.
        for call in &mut turn.tool_calls {
            if st.results.iter().any(|r| r.call.id == call.id) {
                call.id = format!("{}_r{round}", call.id);
            }
        }
        let started = Instant::now();
        let allowed = self.config.max_tool_calls.saturating_sub(st.tool_calls);
        let timeout = self.config.tool_timeout.min(self.remaining(st));

        let mut pending = Vec::new();
        for (i, call) in turn.tool_calls.iter().enumerate() {
            let prepared = if i >= allowed {
                Err(CallFailure {
                    kind: FailureKind::Budget,
                    message: format!(
                        "not run: the run allows {} tool calls in all. Answer with the results you have.",
                        self.config.max_tool_calls
                    ),
                })
            } else {
                self.toolbox
                    .prepare(call, &self.env)
                    .and_then(|p| match st.earlier_success(&p) {
                        Some((id, earlier_round)) => Err(CallFailure {
                            kind: FailureKind::Repeated,
                            message: format!(
                                "not run again: the same call already succeeded as {id} (round {earlier_round}); its result is above. Use it, or call something else."
                            ),
                        }),
                        None => Ok(p),
                    })
            };
            pending.push((call.clone(), prepared));
        }
        st.tool_calls += turn.tool_calls.len().min(allowed);
        // Repeats are known before anything runs.
        let only_repeats = turn.problems.is_empty()
            && !pending.is_empty()
            && pending
                .iter()
                .all(|(_, p)| matches!(p, Err(f) if f.kind == FailureKind::Repeated));

        let before = st.messages.len();
        st.messages.push(Message::assistant(
            turn.text.clone(),
            turn.tool_calls.clone(),
        ));
        // A turn of repeats is dropped below: nothing of it is stored.
        if !only_repeats {
            self.save(st).await?;
        }
        for (call, prepared) in &pending {
            if let Ok(p) = prepared {
                st.emit(Event::ToolStarted {
                    round,
                    call_id: call.id.clone(),
                    name: call.name.clone(),
                    arguments: p.arguments.clone(),
                });
            }
        }
        let results = self
            .run_calls(st, round, pending, timeout, !only_repeats)
            .await?;
        st.tool_ms += started.elapsed().as_secs_f64() * 1e3;

        for r in &results {
            st.messages.push(self.tool_message(r));
        }
        if only_repeats {
            // The turn adds nothing the conversation lacks; kept, it would show a small model
            // its own repeat (and often what it imagined the result to be) right before it answers.
            st.messages.truncate(before);
        } else if st.checkpointer.is_some() {
            // Each result was stored as its call ended.
            st.saved = st.messages.len();
        }
        if !only_repeats && self.shows_overlays() {
            for r in &results {
                self.show_overlay(st, r);
            }
        }
        for problem in &turn.problems {
            st.messages.push(Message::user(
                format!("Observation: your last turn could not be read: {problem}."),
                vec![],
            ));
        }
        for notice in &turn.notices {
            st.messages.push(Message::user(notice.clone(), vec![]));
        }
        st.result_rounds
            .extend(std::iter::repeat_n(round, results.len()));
        st.results.extend(results);
        Ok(only_repeats)
    }

    /// Runs the calls concurrently (each on its own task) and returns their results in the
    /// order of the calls. When `store` and the run is durable, each result is stored and its
    /// event sent as the call ends; otherwise the events follow the order of the calls.
    async fn run_calls(
        &self,
        st: &RunState,
        round: usize,
        pending: Vec<(ToolCall, Result<PreparedCall, CallFailure>)>,
        timeout: Duration,
        store: bool,
    ) -> Result<Vec<CallResult>, String> {
        let checkpointer = if store { st.checkpointer.clone() } else { None };
        let n = pending.len();
        let mut running: FuturesUnordered<_> = pending
            .into_iter()
            .enumerate()
            .map(|(i, (call, prepared))| {
                let ctx = ToolContext {
                    session_id: st.session_id.clone(),
                    call_id: call.id.clone(),
                    round,
                };
                async move {
                    let result = match prepared {
                        Ok(p) => run_prepared(p, ctx, timeout).await,
                        Err(failure) => {
                            let r = CallResult {
                                call,
                                arguments: None,
                                repaired: false,
                                result: Err(failure),
                                ms: 0.0,
                            };
                            crate::toolbox::log_rejected(round, &r);
                            r
                        }
                    };
                    (i, result)
                }
            })
            .collect();
        let mut done: Vec<Option<CallResult>> = (0..n).map(|_| None).collect();
        while let Some((i, r)) = running.next().await {
            if let Some(cp) = &checkpointer {
                cp.tool_result(round, &r, &self.tool_message(&r))
                    .await
                    .map_err(|e| {
                        format!(
                            "the result of `{}` ({}) could not be stored: {e}",
                            r.call.name, r.call.id
                        )
                    })?;
                self.emit_result(st, round, &r);
            }
            if let Some(slot) = done.get_mut(i) {
                *slot = Some(r);
            }
        }
        let results: Vec<CallResult> = done.into_iter().flatten().collect();
        if checkpointer.is_none() {
            for r in &results {
                self.emit_result(st, round, r);
            }
        }
        Ok(results)
    }

    fn emit_result(&self, st: &RunState, round: usize, r: &CallResult) {
        match &r.result {
            Ok(out) => st.emit(Event::ToolFinished {
                round,
                call_id: r.call.id.clone(),
                name: r.call.name.clone(),
                ms: r.ms,
                summary: out.summary.clone(),
                data: out.data.clone(),
                artifacts: out.artifacts.clone(),
            }),
            Err(f) => st.emit(Event::ToolFailed {
                round,
                call_id: r.call.id.clone(),
                name: r.call.name.clone(),
                ms: r.ms,
                kind: f.kind.as_str().to_string(),
                error: f.message.clone(),
            }),
        }
    }

    /// Whether tools' drawings go back to the model as pictures (see
    /// [`AgentConfig::show_overlays`]).
    fn shows_overlays(&self) -> bool {
        let caps = self.llm.capabilities();
        caps.images && caps.in_process && self.config.show_overlays.unwrap_or(true)
    }

    /// Puts the overlay (else the mask) a successful call drew into the conversation: a user
    /// turn naming the call, with the PNG as its picture.
    fn show_overlay(&self, st: &mut RunState, r: &CallResult) {
        let Ok(out) = &r.result else { return };
        let png = |kind: &str| {
            out.artifacts
                .iter()
                .find(|a| a.kind == kind && a.media_type == "image/png" && !a.bytes.is_empty())
        };
        let Some(art) = png("overlay").or_else(|| png("mask")) else {
            return;
        };
        let id = format!("{}{}", hilum_llm::OVERLAY_ID_PREFIX, r.call.id);
        st.payloads.push(ImagePayload::png(id.clone(), &art.bytes));
        st.messages.push(Message::user(
            format!(
                "The {} that {} ({}) drew, to look at:",
                art.kind, r.call.name, r.call.id
            ),
            vec![id],
        ));
    }

    /// The observation the model reads for one call.
    fn tool_message(&self, r: &CallResult) -> Message {
        let (content, is_error) = match &r.result {
            Ok(out) => {
                let mut text = out.summary.clone();
                if !out.data.is_null() && self.config.max_observation_chars > 0 {
                    text.push('\n');
                    text.push_str(&truncate(&out.data, self.config.max_observation_chars));
                }
                if r.repaired {
                    text.push_str("\n(note: your arguments were not valid JSON and were repaired)");
                }
                (text, false)
            }
            Err(f) => (format!("ERROR ({}): {}", f.kind.as_str(), f.message), true),
        };
        Message::Tool {
            tool_call_id: r.call.id.clone(),
            name: r.call.name.clone(),
            content,
            is_error,
        }
    }

    /// Reflexion: critique the draft without tools, then ask for tools and a revised answer.
    async fn critique(&self, st: &mut RunState, draft: String) -> Result<(), String> {
        st.critiques += 1;
        st.messages.push(Message::assistant(draft, vec![]));
        st.messages.push(Message::user(CRITIQUE_PROMPT, vec![]));
        st.phase = "critique";
        let critique = self.reason(st, false, self.remaining(st)).await?;
        st.messages.push(Message::assistant(critique.text, vec![]));
        st.messages.push(Message::user(REVISE_PROMPT, vec![]));
        st.phase = "revise";
        Ok(())
    }

    /// A budget ran out: one last call without tools answers from what was gathered.
    async fn synthesize(
        &self,
        st: &mut RunState,
        reason: StopReason,
    ) -> Result<(String, StopReason), String> {
        let limit = |what: String| format!("You have reached {what}.");
        let why = match reason {
            StopReason::RepeatedCalls => {
                "You asked again for tool results you already have.".to_string()
            }
            StopReason::MaxRounds => limit(format!(
                "the limit of {} tool rounds",
                self.config.max_rounds
            )),
            StopReason::MaxToolCalls => limit(format!(
                "the limit of {} tool calls",
                self.config.max_tool_calls
            )),
            _ => limit("the time budget".to_string()),
        };
        st.messages.push(Message::user(
            format!(
                "{why} No more tools can be called. Give your final answer now from the tool results above, and say what could not be checked."
            ),
            vec![],
        ));
        st.phase = "synthesis";
        // After the deadline the synthesis call still gets a short grace period of its own.
        let budget = if reason == StopReason::Deadline {
            SYNTHESIS_GRACE
        } else {
            self.remaining(st)
        };
        let turn = self.reason(st, false, budget).await?;
        let mut answer = turn.answer.unwrap_or(turn.text);
        if answer.trim().is_empty() {
            // Typically a small model behind a server that renders tools into its template: it
            // writes one more call instead of an answer. One plainer request, then give up.
            st.messages.push(Message::user(NO_TOOLS_PROMPT, vec![]));
            let budget = if reason == StopReason::Deadline {
                SYNTHESIS_GRACE / 2
            } else {
                self.remaining(st)
            };
            let turn = self.reason(st, false, budget).await?;
            answer = turn.answer.unwrap_or(turn.text);
        }
        if answer.trim().is_empty() {
            return Err(format!(
                "model `{}` gave no answer in words after the tools ({}), even when asked again; the tool results are in the run's events",
                self.llm.name(),
                reason.as_str()
            ));
        }
        if let Verdict::Revise(request) = self.ground(st, &answer, false) {
            answer = self
                .revise_without_tools(st, answer, request, &reason)
                .await?;
            self.ground(st, &answer, false);
        }
        if let Some(request) = self.relevance_request(st, &answer, false) {
            answer = self
                .revise_without_tools(st, answer, request, &reason)
                .await?;
        }
        if reason != StopReason::Deadline {
            self.run_covering_tools(st).await?;
        }
        let answer = self.complete_answer(st, answer);
        Ok((answer, reason))
    }

    /// One revision of `answer` after the tools: `request` says what to change; an empty reply
    /// keeps the answer.
    async fn revise_without_tools(
        &self,
        st: &mut RunState,
        answer: String,
        request: String,
        reason: &StopReason,
    ) -> Result<String, String> {
        st.messages.push(Message::assistant(answer.clone(), vec![]));
        st.messages.push(Message::user(request, vec![]));
        let budget = if *reason == StopReason::Deadline {
            SYNTHESIS_GRACE / 2
        } else {
            self.remaining(st)
        };
        let turn = self.reason(st, false, budget).await?;
        let revised = turn.answer.unwrap_or(turn.text);
        Ok(if revised.trim().is_empty() {
            answer
        } else {
            revised
        })
    }

    fn finish(&self, st: RunState, result: Result<(String, StopReason), String>) -> RunOutcome {
        let (answer, reason, error) = match result {
            Ok((answer, reason)) => {
                st.emit(Event::Final {
                    answer: answer.clone(),
                    reason: reason.as_str().to_string(),
                    grounded: st.unsupported.as_ref().map(Vec::is_empty),
                    unsupported: st.unsupported.clone().unwrap_or_default(),
                    answers_question: st.answers_question,
                    unanswered: st.unanswered.clone(),
                    cannot_assess: st.coverage.uncovered_labels(),
                    dropped: st.dropped.clone(),
                });
                (Some(answer), reason, None)
            }
            Err(message) => {
                st.emit(Event::Error {
                    message: message.clone(),
                });
                (None, StopReason::Error, Some(message))
            }
        };
        st.emit(Event::Complete {
            ok: error.is_none(),
            rounds: st.rounds,
            tool_calls: st.tool_calls,
            total_ms: st.started.elapsed().as_secs_f64() * 1e3,
            llm_ms: st.llm_ms,
            tool_ms: st.tool_ms,
            usage: st.usage,
            model: self.llm.name(),
            images_seen: st.images_seen.clone(),
        });
        RunOutcome {
            answer,
            reason,
            error,
            messages: st.messages,
            rounds: st.rounds,
            tool_calls: st.tool_calls,
            results: st.results,
            grounded: st.unsupported.as_ref().map(Vec::is_empty),
            unsupported: st.unsupported.unwrap_or_default(),
            answers_question: st.answers_question,
            unanswered: st.unanswered,
            cannot_assess: st.coverage.uncovered_labels(),
            dropped: st.dropped,
        }
    }
}

fn capitalise_first(s: &str) -> String {
    let mut c = s.chars();
    match c.next() {
        Some(f) => f.to_uppercase().chain(c).collect(),
        None => String::new(),
    }
}

fn llm_failure(llm: &dyn Llm, e: &LlmError) -> String {
    format!("model `{}` failed: {e}", llm.name())
}

fn truncate(data: &Value, max: usize) -> String {
    let text = data.to_string();
    if text.len() <= max {
        return text;
    }
    let mut cut = max;
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    format!(
        "{}… ({} more characters omitted)",
        &text[..cut],
        text.len() - cut
    )
}

#[cfg(test)]
mod tests;
