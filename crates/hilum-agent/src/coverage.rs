//! Question coverage: what a question asks about, which tools can speak to each part, and
//! whether an answer addresses the parts that tool results covered.
//!
//! The vocabulary is data the program supplies ([`Topic`]s, with the words that name each one);
//! tools declare the topics they can answer ([`Capability`]). Before the first round the agent
//! matches the question against the vocabulary: a part that no installed tool covers is
//! answered by Hilum itself ("I cannot assess …", with the command that installs the model that
//! would), never by the model. After the model answers, each covered part must be addressed;
//! sentences that speak of a topic no tool result of the run covers are dropped. This module
//! knows no radiology: the words come from the tools crate.

use std::collections::BTreeMap;

use crate::tool::{Environment, Requirements, Tool, ToolOutput};

/// One thing a question can ask about (a finding, a measurement, a report).
#[derive(Debug, PartialEq, Eq)]
pub struct Topic {
    /// Stable id, e.g. `nodule`.
    pub id: &'static str,
    /// How Hilum names it in an answer: `nodules`, `the cardiothoracic ratio`.
    pub label: &'static str,
    /// Phrases that ask about it, lower case. `a+b` needs both words in one clause; a trailing
    /// `*` matches any ending (`enlarg*`); a plain word also matches its plural.
    pub terms: &'static [&'static str],
    /// An answer addresses the topic when it holds one term of each group (same syntax as
    /// `terms`, `+` aside); empty: one of `terms`.
    pub answer_terms: &'static [&'static [&'static str]],
}

/// A topic a tool can answer, and the models it needs for it.
#[derive(Clone, Copy, Debug)]
pub struct Capability {
    /// The topic.
    pub topic: &'static Topic,
    /// Any one of these must be installed; empty: what the tool's [`Requirements`] say.
    pub models: &'static [&'static str],
    /// The tool's own name for it (a classifier label such as `Nodule`), for its statement.
    pub key: &'static str,
}

impl Capability {
    /// `topic`, answered with any of `models`.
    pub const fn new(topic: &'static Topic, models: &'static [&'static str]) -> Self {
        Capability {
            topic,
            models,
            key: "",
        }
    }

    /// `topic`, answered with any of `models`, under the tool's own name `key`.
    pub const fn keyed(
        topic: &'static Topic,
        models: &'static [&'static str],
        key: &'static str,
    ) -> Self {
        Capability { topic, models, key }
    }
}

/// The topic a tool declares to cover every question (a VLM answering free questions).
pub static ANY_TOPIC: Topic = Topic {
    id: "*",
    label: "anything asked",
    terms: &[],
    answer_terms: &[],
};

/// One row of the capability table: a tool, a topic it answers, and whether it can now.
#[derive(Clone, Debug)]
pub struct CapabilityRow {
    /// The tool.
    pub tool: String,
    /// What it answers.
    pub capability: Capability,
    /// The models it needs are installed (and the tool is otherwise available).
    pub ready: bool,
    /// Commands that install a missing model, one per model.
    pub fixes: Vec<String>,
}

impl CapabilityRow {
    /// Whether the row answers `topic` (its own topic, or any for a free-question tool).
    pub fn covers(&self, topic: &Topic) -> bool {
        std::ptr::eq(self.capability.topic, topic) || self.capability.topic.id == ANY_TOPIC.id
    }
}

/// What every tool of a toolbox can answer in `env`, installed or not.
pub fn capability_table(
    tools: &[std::sync::Arc<dyn Tool>],
    env: &Environment,
) -> Vec<CapabilityRow> {
    let mut rows = Vec::new();
    for tool in tools {
        let req = tool.requirements();
        let available = tool.available(env);
        let other_unmet = Requirements {
            models: &[],
            presentation: false,
            ..req
        }
        .unmet(env);
        for capability in tool.capabilities() {
            let models = if capability.models.is_empty() {
                req.models
            } else {
                capability.models
            };
            let installed = !crate::tool::models_missing(models, env);
            let fixes = if installed {
                Vec::new()
            } else {
                models
                    .iter()
                    .filter_map(|m| env.get(&Requirements::install_fact(m)).map(str::to_string))
                    .collect()
            };
            rows.push(CapabilityRow {
                tool: tool.spec().name.clone(),
                capability,
                ready: installed && available && other_unmet.is_empty(),
                fixes,
            });
        }
    }
    rows
}

/// How one part of a question stands.
#[derive(Clone, Debug, PartialEq)]
pub enum PartStatus {
    /// These tools can answer it now.
    Covered {
        /// The tools.
        tools: Vec<String>,
    },
    /// Tools could answer it with a model that is not installed: the commands install them.
    Missing {
        /// The tools.
        tools: Vec<String>,
        /// The commands that install the missing models.
        fixes: Vec<String>,
    },
    /// No tool answers it.
    NoTool,
}

/// One part of a question: a topic it asks about.
#[derive(Clone, Debug)]
pub struct Part {
    /// The topic asked about.
    pub topic: &'static Topic,
    /// Whether a tool covers it.
    pub status: PartStatus,
}

impl Part {
    /// An installed tool covers it.
    pub fn covered(&self) -> bool {
        matches!(self.status, PartStatus::Covered { .. })
    }

    /// Hilum's own sentence for a part no installed tool covers; `None` when one does.
    pub fn cannot_assess(&self) -> Option<String> {
        let label = self.topic.label;
        match &self.status {
            PartStatus::Covered { .. } => None,
            PartStatus::NoTool => Some(format!(
                "I cannot assess {label}: none of Hilum's tools answers it."
            )),
            PartStatus::Missing { tools, fixes } => {
                let installs: Vec<String> = tools
                    .iter()
                    .zip(fixes)
                    .map(|(tool, fix)| format!("`{fix}` installs the model {tool} needs for it"))
                    .collect();
                Some(format!(
                    "I cannot assess {label}: no installed model covers it. {}.",
                    capitalise(&installs.join("; "))
                ))
            }
        }
    }
}

fn capitalise(s: &str) -> String {
    let mut c = s.chars();
    match c.next() {
        Some(f) => f.to_uppercase().chain(c).collect(),
        None => String::new(),
    }
}

/// What a question asks about, part by part.
#[derive(Clone, Debug, Default)]
pub struct Coverage {
    /// The parts, in the order the question names them.
    pub parts: Vec<Part>,
}

impl Coverage {
    /// Matches `question` against `vocabulary` and the capability table. A multiple-choice
    /// question (options `A)`, `B)`, …) gets no parts: its options name findings it does not
    /// ask about, and its answer is a letter.
    pub fn of(question: &str, vocabulary: &[&'static Topic], table: &[CapabilityRow]) -> Coverage {
        if is_multiple_choice(question) {
            return Coverage::default();
        }
        let parts = asked(question, vocabulary)
            .into_iter()
            .map(|topic| Part {
                topic,
                status: status_of(topic, table),
            })
            .collect();
        Coverage { parts }
    }

    /// The question names no known topic.
    pub fn is_empty(&self) -> bool {
        self.parts.is_empty()
    }

    /// Every part is one no installed tool covers.
    pub fn nothing_covered(&self) -> bool {
        !self.parts.is_empty() && self.parts.iter().all(|p| !p.covered())
    }

    /// Hilum's sentences for the parts no installed tool covers.
    pub fn cannot_assess(&self) -> Vec<String> {
        self.parts.iter().filter_map(Part::cannot_assess).collect()
    }

    /// The installed tools that cover `topic` as a part of the question (empty when it is not
    /// a covered part).
    pub fn covering_tools(&self, topic: &Topic) -> &[String] {
        match self
            .parts
            .iter()
            .find(|p| std::ptr::eq(p.topic, topic))
            .map(|p| &p.status)
        {
            Some(PartStatus::Covered { tools }) => tools,
            _ => &[],
        }
    }

    /// Labels of the parts no installed tool covers.
    pub fn uncovered_labels(&self) -> Vec<String> {
        self.parts
            .iter()
            .filter(|p| !p.covered())
            .map(|p| p.topic.label.to_string())
            .collect()
    }
}

fn status_of(topic: &'static Topic, table: &[CapabilityRow]) -> PartStatus {
    let about = |r: &&CapabilityRow| r.covers(topic);
    let mut ready: Vec<String> = Vec::new();
    let mut missing: BTreeMap<String, String> = BTreeMap::new();
    for row in table.iter().filter(about) {
        if row.ready {
            if !ready.contains(&row.tool) {
                ready.push(row.tool.clone());
            }
        } else if let Some(fix) = row.fixes.first() {
            missing
                .entry(row.tool.clone())
                .or_insert_with(|| fix.clone());
        }
    }
    if !ready.is_empty() {
        PartStatus::Covered { tools: ready }
    } else if !missing.is_empty() {
        let (tools, fixes) = missing.into_iter().unzip();
        PartStatus::Missing { tools, fixes }
    } else {
        PartStatus::NoTool
    }
}

/// Whether `question` lists lettered options (`A) … B) …`).
pub fn is_multiple_choice(question: &str) -> bool {
    question.contains("A) ") && question.contains("B) ")
}

/// Words that put what follows them in the same clause out of the question.
const EXCLUDING: &[&[&str]] = &[
    &["ignore"],
    &["ignoring"],
    &["except"],
    &["excluding"],
    &["besides"],
    &["skip"],
    &["other", "than"],
    &["apart", "from"],
    &["aside", "from"],
    &["not", "about"],
    &["not", "asking"],
    &["no", "need"],
    &["don't", "care"],
    &["never", "mind"],
];

/// Lower-case clauses (split at punctuation and `but`), each as words.
fn clauses(text: &str) -> Vec<Vec<String>> {
    let lower = text.to_lowercase().replace(['’', '‘'], "'");
    let mut out = Vec::new();
    for clause in lower.split(['.', ',', ';', ':', '?', '!', '\n', '(', ')']) {
        let mut words: Vec<String> = Vec::new();
        for w in clause.split(|c: char| !(c.is_alphanumeric() || c == '\'' || c == '²')) {
            if w.is_empty() {
                continue;
            }
            if w == "but" {
                out.push(std::mem::take(&mut words));
                continue;
            }
            words.push(w.trim_matches('\'').to_string());
        }
        out.push(words);
    }
    out.retain(|c| !c.is_empty());
    out
}

/// One word of a term against one word of the text.
fn word_matches(pattern: &str, word: &str) -> bool {
    if let Some(stem) = pattern.strip_suffix('*') {
        return word.starts_with(stem);
    }
    word == pattern
        || word.strip_suffix('s') == Some(pattern)
        || word.strip_suffix("es") == Some(pattern)
}

/// Where `term` (a phrase, or `a+b` for words anywhere in the clause) starts in `words`.
fn find_term(term: &str, words: &[String]) -> Option<usize> {
    if term.contains('+') {
        let mut first = None;
        for part in term.split('+') {
            let at = find_term(part.trim(), words)?;
            first = Some(first.map_or(at, |f: usize| f.min(at)));
        }
        return first;
    }
    let pattern: Vec<String> = clauses(term).into_iter().flatten().collect();
    if pattern.is_empty() || pattern.len() > words.len() {
        return None;
    }
    let keep_star = term.trim_end().ends_with('*');
    (0..=words.len() - pattern.len()).find(|&i| {
        pattern.iter().enumerate().all(|(k, p)| {
            let last = k + 1 == pattern.len();
            let p = if last && keep_star {
                format!("{p}*")
            } else {
                p.clone()
            };
            word_matches(&p, &words[i + k])
        })
    })
}

/// Whether an excluding phrase comes before position `at` in the clause.
fn excluded(words: &[String], at: usize) -> bool {
    EXCLUDING.iter().any(|cue| {
        (0..at.saturating_sub(cue.len() - 1)).any(|i| {
            cue.iter()
                .enumerate()
                .all(|(k, c)| words.get(i + k).is_some_and(|w| w == c))
        })
    })
}

/// The topics `question` asks about, in vocabulary order. A topic named only after an
/// excluding phrase in its clause ("ignore the heart", "other than effusion") is left out; a
/// plain negation ("is there no effusion?") still asks about it.
pub fn asked(question: &str, vocabulary: &[&'static Topic]) -> Vec<&'static Topic> {
    let clauses = clauses(question);
    vocabulary
        .iter()
        .copied()
        .filter(|topic| {
            clauses.iter().any(|words| {
                topic
                    .terms
                    .iter()
                    .any(|t| find_term(t, words).is_some_and(|at| !excluded(words, at)))
            })
        })
        .collect()
}

/// Whether `text` speaks of `topic` (one of its asking terms).
pub fn mentions(text: &str, topic: &Topic) -> bool {
    let clauses = clauses(text);
    clauses
        .iter()
        .any(|words| topic.terms.iter().any(|t| find_term(t, words).is_some()))
}

/// Whether `answer` addresses `topic`: one term of each of its answer groups (or one of its
/// asking terms when it has no groups).
pub fn addresses(answer: &str, topic: &Topic) -> bool {
    if topic.answer_terms.is_empty() {
        return mentions(answer, topic);
    }
    let words: Vec<String> = clauses(answer).into_iter().flatten().collect();
    let lower = answer.to_lowercase();
    topic.answer_terms.iter().all(|group| {
        group.iter().any(|t| {
            // Units such as `cm²` or `%` are not words: look for them in the text as written.
            if t.chars()
                .any(|c| !c.is_alphanumeric() && c != '*' && c != ' ')
            {
                lower.contains(t)
            } else {
                find_term(t, &words).is_some()
            }
        })
    })
}

/// The numbers of `text` as written, thousands separators removed (`43,510` → `43510`);
/// single digits left out (list positions, "2 lungs").
fn numbers(text: &str) -> Vec<String> {
    let chars: Vec<char> = text.chars().collect();
    let mut out = Vec::new();
    let mut cur = String::new();
    for (i, &c) in chars.iter().enumerate() {
        let digit_around = |j: usize| chars.get(j).is_some_and(|c| c.is_ascii_digit());
        let in_word = cur.is_empty() && i > 0 && chars[i - 1].is_alphabetic();
        if c.is_ascii_digit() && !in_word {
            cur.push(c);
        } else if c == ',' && !cur.is_empty() && digit_around(i + 1) {
            continue;
        } else if c == '.' && !cur.is_empty() && !cur.contains('.') && digit_around(i + 1) {
            cur.push(c);
        } else if !cur.is_empty() {
            out.push(std::mem::take(&mut cur));
        }
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out.retain(|n| n.len() >= 2);
    out
}

/// Whether `answer` quotes the key figure of one of `statements`: its first number (a tool's
/// statement leads with it: the score, the ratio, the coverage). True when they hold none.
pub fn quotes_any(answer: &str, statements: &[String]) -> bool {
    let wanted: Vec<String> = statements
        .iter()
        .filter_map(|s| numbers(s).into_iter().next())
        .collect();
    if wanted.is_empty() {
        return true;
    }
    let said = numbers(answer);
    wanted.iter().any(|w| {
        said.iter().any(|s| {
            s == w
                || s.parse::<f64>()
                    .ok()
                    .zip(w.parse::<f64>().ok())
                    .is_some_and(|(a, b)| {
                        // 0.62 written 0.6, 34.0% written 34%.
                        let places = w.split('.').nth(1).map_or(0, str::len);
                        places > 0 && (a - b).abs() <= 0.5 * 10f64.powi(-(places as i32 - 1))
                    })
        })
    })
}

/// Whether a sentence says that something could not be assessed (rather than claiming it).
pub fn states_inability(sentence: &str) -> bool {
    let l = sentence.to_lowercase().replace('’', "'");
    [
        "cannot",
        "can't",
        "unable",
        "not assessed",
        "not measured",
        "not available",
        "not installed",
        "no installed",
        "no model",
        "no tool",
        "could not",
        "couldn't",
        "was not called",
        "not be assessed",
        "not determined",
    ]
    .iter()
    .any(|p| l.contains(p))
}

/// The statement a tool's result gives for a topic, or its summary.
pub fn statement(tool: &dyn Tool, capability: &Capability, out: &ToolOutput) -> String {
    let name = &tool.spec().name;
    match tool.state(capability, out) {
        Some(s) => format!("{s} ({name})."),
        None => format!("{name}: {}", out.summary.trim_end_matches('.')) + ".",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    static NODULE: Topic = Topic {
        id: "nodule",
        label: "nodules",
        terms: &["nodul*"],
        answer_terms: &[],
    };
    static HEART: Topic = Topic {
        id: "cardiomegaly",
        label: "heart size (cardiomegaly)",
        terms: &[
            "cardiomegaly",
            "heart+enlarg*",
            "heart+big",
            "enlarged heart",
            "cardiac silhouette",
        ],
        answer_terms: &[&["cardiomegaly", "ctr", "cardiothoracic", "heart"]],
    };
    static EFFUSION: Topic = Topic {
        id: "effusion",
        label: "pleural effusion",
        terms: &["effusion", "fluid"],
        answer_terms: &[],
    };
    static LUNGS: Topic = Topic {
        id: "lung_size",
        label: "the size of the lungs",
        terms: &["lung+larg*", "lung+size", "lung+area"],
        answer_terms: &[&["cover*"], &["area", "px", "cm²", "mm²", "pixel*"]],
    };

    fn vocab() -> Vec<&'static Topic> {
        vec![&NODULE, &HEART, &EFFUSION, &LUNGS]
    }

    fn ids(q: &str) -> Vec<&'static str> {
        asked(q, &vocab()).iter().map(|t| t.id).collect()
    }

    #[test]
    fn synonyms_and_plain_words_find_the_topic() {
        assert_eq!(ids("Is the heart enlarged?"), ["cardiomegaly"]);
        assert_eq!(ids("Is there cardiomegaly?"), ["cardiomegaly"]);
        assert_eq!(ids("Does the heart look big to you?"), ["cardiomegaly"]);
        assert_eq!(ids("Any fluid at the bases?"), ["effusion"]);
        assert_eq!(ids("Are there any nodules?"), ["nodule"]);
        assert_eq!(ids("How large are the lungs in this image?"), ["lung_size"]);
        assert!(ids("What is the patient's age?").is_empty());
        // A word that only starts like a term is no match.
        assert!(ids("Is the heartbeat regular?").is_empty());
    }

    #[test]
    fn a_negation_still_asks_but_an_exclusion_does_not() {
        assert_eq!(ids("Is there no effusion?"), ["effusion"]);
        assert_eq!(ids("No nodules, right?"), ["nodule"]);
        assert_eq!(ids("Ignore the heart; are there nodules?"), ["nodule"]);
        assert_eq!(
            ids("Other than effusion, is the heart enlarged?"),
            ["cardiomegaly"]
        );
        assert_eq!(
            ids("Apart from nodules and effusion, anything else?"),
            Vec::<&str>::new()
        );
    }

    #[test]
    fn a_two_part_question_has_two_parts() {
        assert_eq!(
            ids("How large are the lungs, and are there nodules?"),
            ["nodule", "lung_size"]
        );
        assert_eq!(
            ids("Is the heart enlarged but is there an effusion?"),
            ["cardiomegaly", "effusion"]
        );
    }

    #[test]
    fn multiple_choice_questions_get_no_parts() {
        let q = "Which finding is present? A) Nodule B) Effusion C) Cardiomegaly";
        assert!(Coverage::of(q, &vocab(), &[]).is_empty());
    }

    #[test]
    fn answers_address_a_topic_by_its_terms_or_groups() {
        assert!(addresses("The CTR is 0.55, above 0.50.", &HEART));
        assert!(!addresses(
            "The left lung is larger: 43,510 vs 43,042 px.",
            &HEART
        ));
        assert!(!addresses(
            "The left lung is larger: 43,510 vs 43,042 px.",
            &LUNGS
        ));
        assert!(addresses(
            "The lungs cover 33.9% of the image; right 43,042 px, left 43,510 px.",
            &LUNGS
        ));
        assert!(addresses("Nodule score 0.12, below 0.5.", &NODULE));
    }

    fn row(tool: &str, topic: &'static Topic, ready: bool, fix: &str) -> CapabilityRow {
        CapabilityRow {
            tool: tool.into(),
            capability: Capability::new(topic, &[]),
            ready,
            fixes: if ready { vec![] } else { vec![fix.into()] },
        }
    }

    #[test]
    fn uncovered_parts_name_the_command_that_installs_a_model() {
        let table = vec![
            row("classify", &NODULE, false, "hilum models fetch densenet"),
            row("measure", &LUNGS, true, ""),
        ];
        let c = Coverage::of(
            "How large are the lungs, and any nodules?",
            &vocab(),
            &table,
        );
        assert_eq!(c.parts.len(), 2);
        assert!(!c.nothing_covered());
        let lines = c.cannot_assess();
        assert_eq!(
            lines,
            ["I cannot assess nodules: no installed model covers it. `hilum models fetch densenet` installs the model classify needs for it."]
        );
        let none = Coverage::of("Is there an effusion?", &vocab(), &table);
        assert!(none.nothing_covered());
        assert_eq!(
            none.cannot_assess(),
            ["I cannot assess pleural effusion: none of Hilum's tools answers it."]
        );
    }

    #[test]
    fn an_answer_quotes_a_statement_by_its_numbers() {
        let said =
            vec!["the lungs cover 34.0% of the image; right 43,042 px, left 43,510 px".to_string()];
        assert!(quotes_any("They cover 34% of the image.", &said));
        assert!(!quotes_any("Right lung 43042 px.", &said));
        // A number inside a word (a model's name) is no figure.
        let score = vec!["Nodule scores 0.12 on densenet121-res224-all".to_string()];
        assert!(!quotes_any("densenet121 ran.", &score));
        assert!(quotes_any("Nodule 0.12.", &score));
        assert!(!quotes_any("The left lung is larger by 1.1%.", &said));
        assert!(quotes_any("anything", &[]));
    }

    #[test]
    fn inability_is_not_a_claim() {
        assert!(states_inability(
            "CTR not measured: the heart was not segmented."
        ));
        assert!(states_inability("I cannot assess nodules."));
        assert!(!states_inability("There are no nodules."));
    }
}
