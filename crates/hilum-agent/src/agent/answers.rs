//! The answer checks of the loop (see [`crate::coverage`]): the relevance request, the
//! covering call Hilum makes when the model made none, and the answer as it reaches the user.

use super::*;

impl Agent {
    /// Whether an earlier turn of the session holds a result covering `topic`.
    fn in_history(&self, st: &RunState, topic: &'static coverage::Topic) -> bool {
        st.capabilities
            .iter()
            .any(|row| row.ready && st.history_tools.contains(&row.tool) && row.covers(topic))
    }

    /// Whether a tool's only required argument is the image (so Hilum can call it itself).
    fn takes_image_only(&self, name: &str) -> bool {
        let Some(tool) = self.toolbox.get(name) else {
            return false;
        };
        let params = &tool.spec().parameters;
        params["properties"].get("image").is_some()
            && params["required"]
                .as_array()
                .is_none_or(|r| r.iter().all(|k| k == "image"))
    }

    /// A covered part of the question that no result of the run (or the session) answers: Hilum
    /// runs, once, a tool that covers it on the question's first image, so the answer can state
    /// that part from the right tool instead of leaving it out.
    pub(super) async fn run_covering_tools(&self, st: &mut RunState) -> Result<(), String> {
        if st.covering_run {
            return Ok(());
        }
        st.covering_run = true;
        let Some(image) = st.images.first().cloned() else {
            return Ok(());
        };
        let mut calls: Vec<ToolCall> = Vec::new();
        for part in &st.coverage.parts {
            let coverage::PartStatus::Covered { tools } = &part.status else {
                continue;
            };
            if !self.results_about(st, part.topic).is_empty() || self.in_history(st, part.topic) {
                continue;
            }
            let Some(tool) = tools.iter().find(|t| self.takes_image_only(t)) else {
                continue;
            };
            if !calls.iter().any(|c| &c.name == tool) {
                let id = format!("hilum_{}", calls.len() + 1);
                calls.push(ToolCall::new(
                    id,
                    tool.clone(),
                    &serde_json::json!({"image": image}),
                ));
            }
        }
        if calls.is_empty() {
            return Ok(());
        }
        let turn = ParsedTurn {
            text: String::new(),
            tool_calls: calls,
            answer: None,
            problems: Vec::new(),
            notices: Vec::new(),
        };
        self.act(st, turn).await.map(|_| ())
    }

    /// The tools (with their capability rows) whose successful results of this run cover
    /// `topic`, each with its output.
    fn results_about<'a>(
        &'a self,
        st: &'a RunState,
        topic: &'static coverage::Topic,
    ) -> Vec<(&'a CapabilityRow, &'a crate::ToolOutput)> {
        let mut found = Vec::new();
        for r in &st.results {
            let Ok(out) = &r.result else { continue };
            for row in st
                .capabilities
                .iter()
                .filter(|row| row.ready && row.tool == r.call.name && row.covers(topic))
            {
                found.push((row, out));
            }
        }
        found
    }

    /// Whether a result of this run or of the session covers `topic`.
    fn supported(&self, st: &RunState, topic: &'static coverage::Topic) -> bool {
        !self.results_about(st, topic).is_empty() || self.in_history(st, topic)
    }

    /// Each covering result of the run with the tool that made it.
    fn covering_results<'a>(
        &'a self,
        st: &'a RunState,
        topic: &'static coverage::Topic,
    ) -> Vec<(
        Arc<dyn crate::Tool>,
        &'a CapabilityRow,
        &'a crate::ToolOutput,
    )> {
        let tools = self.toolbox.all_tools();
        self.results_about(st, topic)
            .into_iter()
            .filter_map(|(row, out)| {
                let tool = tools.iter().find(|t| t.spec().name == row.tool)?.clone();
                Some((tool, row, out))
            })
            .collect()
    }

    /// What the tools' results of the run state about `topic`, one sentence per result.
    fn statements(&self, st: &RunState, topic: &'static coverage::Topic) -> Vec<String> {
        self.covering_results(st, topic)
            .iter()
            .map(|(tool, row, out)| coverage::statement(tool.as_ref(), &row.capability, out))
            .collect()
    }

    /// The statements of the tools that state `topic` themselves ([`crate::Tool::state`]):
    /// the figures an answer about it must quote.
    fn key_statements(&self, st: &RunState, topic: &'static coverage::Topic) -> Vec<String> {
        self.covering_results(st, topic)
            .iter()
            .filter_map(|(tool, row, out)| tool.state(&row.capability, out))
            .collect()
    }

    /// The covered parts of the question that `answer` does not address: it must name the
    /// topic and, where a tool states it with numbers, quote the key one. A part only a
    /// free-question tool covers (a VLM: [`coverage::ANY_TOPIC`]) is the model's to word.
    fn unaddressed(&self, st: &RunState, answer: &str) -> Vec<&'static coverage::Topic> {
        st.coverage
            .parts
            .iter()
            .filter(|p| p.covered())
            .filter(|p| {
                st.capabilities
                    .iter()
                    .any(|r| r.ready && std::ptr::eq(r.capability.topic, p.topic))
            })
            .filter(|p| {
                !coverage::addresses(answer, p.topic)
                    || !coverage::quotes_any(answer, &self.key_statements(st, p.topic))
            })
            .map(|p| p.topic)
            .collect()
    }

    /// The relevance check: one request to address the covered parts the answer leaves out.
    pub(super) fn relevance_request(
        &self,
        st: &mut RunState,
        answer: &str,
        tools_left: bool,
    ) -> Option<String> {
        if st.relevance_requested {
            return None;
        }
        let missing = self.unaddressed(st, answer);
        if missing.is_empty() {
            return None;
        }
        st.relevance_requested = true;
        let mut lines = Vec::new();
        for topic in missing {
            // What the tool says about it, so that a model that copies the request copies
            // the right figures.
            let said = self.statements(st, topic);
            let line = if let Some(first) = said.first() {
                format!("- {}: {first}", capitalise_first(topic.label))
            } else if tools_left {
                let tools = st.coverage.covering_tools(topic).join(" or ");
                format!("- {}: call {tools} first", topic.label)
            } else {
                format!("- {}: say that it was not assessed", topic.label)
            };
            lines.push(line);
        }
        Some(format!(
            "Your answer does not address part of the question. What the tool results say about it:\n{}\nAnswer each part of the question directly with these results.",
            lines.join("\n")
        ))
    }

    /// The answer as it reaches the user: the model's sentences about findings no tool result
    /// covers are removed; a covered part the answer still leaves out is stated by Hilum from
    /// the tool results (and the answer marked `answers_question: false`); each part no
    /// installed tool covers gets Hilum's "I cannot assess …" line.
    pub(super) fn complete_answer(&self, st: &mut RunState, answer: String) -> String {
        let vocabulary = self.toolbox.vocabulary();
        if vocabulary.is_empty() || coverage::is_multiple_choice(&st.question) {
            return answer;
        }
        // Covered parts the answer still leaves out: its sentences about them quote no tool
        // figure (a model that calls the image's size the lungs' size), so they go, and Hilum
        // states the part from the tool results below.
        let unaddressed = self.unaddressed(st, &answer);
        let mut kept = Vec::new();
        for sentence in grounding::sentences(&answer) {
            let invented = vocabulary.iter().any(|t| {
                coverage::mentions(sentence, t)
                    && (!self.supported(st, t) || unaddressed.iter().any(|u| std::ptr::eq(*u, *t)))
            }) && !coverage::states_inability(sentence);
            if invented {
                st.dropped.push(sentence.to_string());
            } else {
                kept.push(sentence);
            }
        }
        let mut text = if st.dropped.is_empty() {
            answer.trim().to_string()
        } else {
            kept.join(" ")
        };
        let mut added = Vec::new();
        for topic in self.unaddressed(st, &text) {
            let said: Vec<String> = self.statements(st, topic).into_iter().take(1).collect();
            if said.is_empty() && self.in_history(st, topic) {
                // An earlier turn's result covers it: the model may have answered from it in words
                // the check does not know.
                continue;
            }
            let line = if said.is_empty() {
                let tools = st.coverage.covering_tools(topic).join(" or ");
                format!(
                    "{} was not assessed in this run: {tools}, which covers it, was not called.",
                    capitalise_first(topic.label)
                )
            } else {
                format!("{}: {}", capitalise_first(topic.label), said.join(" "))
            };
            st.unanswered.push(topic.label.to_string());
            added.push(line);
        }
        let cannot = st.coverage.cannot_assess();
        st.answers_question = (!st.coverage.is_empty()).then_some(st.unanswered.is_empty());
        for extra in added.into_iter().chain(cannot) {
            if !text.is_empty() {
                text.push_str("\n\n");
            }
            text.push_str(&extra);
        }
        if text.trim().is_empty() {
            text = "The tool results of this run do not answer the question.".to_string();
        }
        text
    }
}
