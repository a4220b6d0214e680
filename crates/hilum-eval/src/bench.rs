//! Question sets: ChestAgentBench's `metadata.jsonl` (MedRAX, `wanglab/chestagentbench`) and a
//! plain JSONL for a site's own sets. Both are read into one [`Question`].

use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::EvalError;

/// How an answer is scored.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AnswerKind {
    /// One letter A–F, taken from the response by the MedRAX cascade.
    #[default]
    Choice,
    /// A number, right within `tolerance`.
    Number,
    /// A phrase that must appear in the response (case-insensitive, whole words).
    Text,
}

/// One benchmark question, whatever file it came from.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Question {
    /// The question's id (`question_id` in ChestAgentBench).
    pub id: String,
    /// Questions of one case share a conversation under `--memory case`.
    pub case_id: String,
    /// The text sent to the model, options included.
    pub question: String,
    /// The expected letter, number or phrase.
    pub answer: String,
    /// How the answer is scored.
    pub kind: AnswerKind,
    /// Absolute tolerance of a `number` answer.
    pub tolerance: f64,
    /// Paths relative to the images folder.
    pub images: Vec<String>,
    /// Lower-case category names.
    pub categories: Vec<String>,
    /// 1-based line in the file, for messages.
    pub line: usize,
}

/// ChestAgentBench's record; fields this runner does not use are accepted and ignored.
#[derive(Deserialize)]
struct CabRecord {
    question_id: Value,
    #[serde(default)]
    case_id: Option<Value>,
    question: String,
    answer: String,
    #[serde(default)]
    images: Option<Vec<String>>,
    #[serde(default)]
    categories: Option<String>,
}

/// The plain format: `id`, `images`, `question`, `answer`, optional `options`, `categories`,
/// `kind`, `tolerance`, `case_id`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PlainRecord {
    id: Value,
    #[serde(default)]
    case_id: Option<Value>,
    #[serde(default)]
    images: Vec<String>,
    question: String,
    answer: Value,
    #[serde(default)]
    options: Vec<String>,
    #[serde(default)]
    categories: Option<Value>,
    #[serde(default)]
    kind: AnswerKind,
    #[serde(default)]
    tolerance: Option<f64>,
}

const LETTERS: [char; 6] = ['A', 'B', 'C', 'D', 'E', 'F'];

fn id_text(v: &Value) -> Option<String> {
    match v {
        Value::String(s) if !s.trim().is_empty() => Some(s.trim().to_string()),
        Value::Number(n) => Some(n.to_string()),
        _ => None,
    }
}

fn split_categories(s: &str) -> Vec<String> {
    s.split(',')
        .map(|c| c.trim().to_lowercase())
        .filter(|c| !c.is_empty())
        .collect()
}

fn letter(answer: &str) -> Option<String> {
    let a = answer.trim().trim_end_matches([')', '.']);
    let mut chars = a.chars();
    match (chars.next(), chars.next()) {
        (Some(c), None) if LETTERS.contains(&c.to_ascii_uppercase()) => {
            Some(c.to_ascii_uppercase().to_string())
        }
        _ => None,
    }
}

fn from_cab(r: CabRecord, line: usize) -> Result<Question, String> {
    let id = id_text(&r.question_id).ok_or("`question_id` must be a non-empty string")?;
    let answer = letter(&r.answer)
        .ok_or_else(|| format!("`answer` must be one letter A-F, found {:?}", r.answer))?;
    Ok(Question {
        case_id: r.case_id.as_ref().and_then(id_text).unwrap_or(id.clone()),
        id,
        question: r.question,
        answer,
        kind: AnswerKind::Choice,
        tolerance: 0.0,
        images: r.images.unwrap_or_default(),
        categories: r
            .categories
            .as_deref()
            .map(split_categories)
            .unwrap_or_default(),
        line,
    })
}

fn from_plain(r: PlainRecord, line: usize) -> Result<Question, String> {
    let id = id_text(&r.id).ok_or("`id` must be a non-empty string or a number")?;
    if r.options.len() > LETTERS.len() {
        return Err(format!(
            "`options` has {} entries; at most 6 (A-F)",
            r.options.len()
        ));
    }
    let mut question = r.question;
    for (l, o) in LETTERS.iter().zip(&r.options) {
        question.push_str(&format!("\n{l}) {o}"));
    }
    let answer = match (&r.answer, r.kind) {
        (Value::String(s), AnswerKind::Choice) => letter(s)
            .ok_or_else(|| format!("a choice `answer` must be a letter A-F, found {s:?}"))?,
        (Value::Number(n), AnswerKind::Number) => n.to_string(),
        (Value::String(s), AnswerKind::Number) => {
            s.trim()
                .parse::<f64>()
                .map_err(|_| format!("a number `answer` must be a number, found {s:?}"))?;
            s.trim().to_string()
        }
        (Value::String(s), AnswerKind::Text) if !s.trim().is_empty() => s.trim().to_string(),
        (other, kind) => return Err(format!("`answer` {other} does not fit kind {kind:?}")),
    };
    if r.kind == AnswerKind::Choice {
        let n = r.options.len();
        if n > 0 && !LETTERS[..n].iter().any(|l| l.to_string() == answer) {
            return Err(format!("`answer` {answer} is not one of the {n} options"));
        }
    }
    let categories = match &r.categories {
        None => vec![],
        Some(Value::String(s)) => split_categories(s),
        Some(Value::Array(a)) => a
            .iter()
            .filter_map(Value::as_str)
            .map(|c| c.trim().to_lowercase())
            .filter(|c| !c.is_empty())
            .collect(),
        Some(other) => {
            return Err(format!(
                "`categories` must be a string or a list of strings, found {other}"
            ))
        }
    };
    let tolerance = r.tolerance.unwrap_or(0.0);
    if !tolerance.is_finite() || tolerance < 0.0 {
        return Err("`tolerance` must be a finite number >= 0".into());
    }
    Ok(Question {
        case_id: r.case_id.as_ref().and_then(id_text).unwrap_or(id.clone()),
        id,
        question,
        answer,
        kind: r.kind,
        tolerance,
        images: r.images,
        categories,
        line,
    })
}

/// Parses one line of either format (ChestAgentBench when it has `question_id`).
pub fn parse_line(text: &str, line: usize) -> Result<Question, String> {
    let v: Value = serde_json::from_str(text).map_err(|e| format!("not valid JSON: {e}"))?;
    if !v.is_object() {
        return Err("each line must be a JSON object".into());
    }
    if v.get("question_id").is_some() {
        let r: CabRecord =
            serde_json::from_value(v).map_err(|e| format!("not a ChestAgentBench record: {e}"))?;
        from_cab(r, line)
    } else {
        let r: PlainRecord = serde_json::from_value(v).map_err(|e| {
            format!("not a ChestAgentBench record (no `question_id`) nor a plain one: {e}")
        })?;
        from_plain(r, line)
    }
}

/// Reads a whole question file. Blank lines are skipped; the first bad line is an error naming
/// the file and the line; ids must be unique.
pub fn load_bench(path: &Path) -> Result<Vec<Question>, EvalError> {
    let text = std::fs::read_to_string(path).map_err(|source| EvalError::Read {
        path: path.display().to_string(),
        source,
    })?;
    let mut out: Vec<Question> = Vec::new();
    let mut seen = std::collections::HashMap::new();
    for (i, l) in text.lines().enumerate() {
        if l.trim().is_empty() {
            continue;
        }
        let malformed = |message: String| EvalError::Malformed {
            path: path.display().to_string(),
            line: i + 1,
            message,
        };
        let q = parse_line(l, i + 1).map_err(malformed)?;
        if let Some(first) = seen.insert(q.id.clone(), i + 1) {
            return Err(malformed(format!(
                "question id {:?} was already used on line {first}",
                q.id
            )));
        }
        out.push(q);
    }
    if out.is_empty() {
        return Err(EvalError::Invalid(format!(
            "{} holds no questions",
            path.display()
        )));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chestagentbench_record_is_read() {
        let q = parse_line(
            r#"{"question_id":"11583_1","full_question_id":"x","case_id":"11583","question":"Where? A) left B) right C) both D) none E) apex F) base","answer":"B","images":["figures/11583/figure_1.jpg"],"categories":"localization, Diagnosis","type":"x","sections":[],"explanation":"","image_source_urls":[]}"#,
            3,
        )
        .expect("parses");
        assert_eq!(q.id, "11583_1");
        assert_eq!(q.case_id, "11583");
        assert_eq!(q.answer, "B");
        assert_eq!(q.categories, ["localization", "diagnosis"]);
        assert_eq!(q.images, ["figures/11583/figure_1.jpg"]);
    }

    #[test]
    fn record_without_images_is_a_question() {
        let q = parse_line(
            r#"{"question_id":"7","question":"A) x B) y","answer":"a","images":[]}"#,
            1,
        )
        .expect("parses");
        assert!(q.images.is_empty());
        assert_eq!(q.answer, "A");
        assert_eq!(q.case_id, "7");
    }

    #[test]
    fn plain_options_are_inlined_and_checked() {
        let q = parse_line(
            r#"{"id":1,"question":"Which?","options":["x","y"],"answer":"B","categories":["Size"]}"#,
            1,
        )
        .expect("parses");
        assert_eq!(q.question, "Which?\nA) x\nB) y");
        assert_eq!(q.categories, ["size"]);
        let err = parse_line(
            r#"{"id":1,"question":"Which?","options":["x","y"],"answer":"C"}"#,
            1,
        )
        .expect_err("C is not an option");
        assert!(err.contains("not one of the 2 options"), "{err}");
    }

    #[test]
    fn number_answers_keep_tolerance() {
        let q = parse_line(
            r#"{"id":"n","question":"Width?","answer":1024,"kind":"number","tolerance":2}"#,
            1,
        )
        .expect("parses");
        assert_eq!(
            (q.kind, q.answer.as_str(), q.tolerance),
            (AnswerKind::Number, "1024", 2.0)
        );
    }

    #[test]
    fn bad_line_names_file_and_line_and_duplicates_are_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path().join("b.jsonl");
        std::fs::write(
            &p,
            "{\"id\":\"a\",\"question\":\"q\",\"answer\":\"A\"}\n\n{\"id\":\"b\",\"question\":\"q\",\"answer\":\"G\"}\n",
        )
        .expect("write");
        let e = load_bench(&p).expect_err("G is not a letter").to_string();
        assert!(e.contains("b.jsonl:3:") && e.contains("letter A-F"), "{e}");
        std::fs::write(
            &p,
            "{\"id\":\"a\",\"question\":\"q\",\"answer\":\"A\"}\n{\"id\":\"a\",\"question\":\"q\",\"answer\":\"B\"}\n",
        )
        .expect("write");
        let e = load_bench(&p).expect_err("duplicate").to_string();
        assert!(e.contains(":2:") && e.contains("line 1"), "{e}");
    }
}
