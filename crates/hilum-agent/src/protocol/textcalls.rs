//! Tool calls a model wrote as text instead of through function calling: `<tool_call>` blocks
//! the stream reader could not read, `<tools>` / `<tool name=… arguments='…'>` markup,
//! `<function=NAME>` blocks, `{"name": …, "arguments": …}` objects anywhere in the text, fenced
//! JSON and doubled braces (`{{ … }}`, from prompt templates). A small model served without a
//! tool-call parser writes all of these; read as an answer, they would hand the user a call
//! (or a result the model imagined) instead of measurements.
//!
//! Text that imitates a tool *result* (`<output>…</output>`, `<tool_response>`, …) is dropped
//! together with everything after it: the model wrote it before any tool ran.

use hilum_llm::ToolCall;
use serde_json::Value;

use crate::repair::parse_lenient;

/// What [`read`] found in a turn's text.
#[derive(Debug, Default, PartialEq)]
pub struct TextCalls {
    /// The calls read, in order.
    pub calls: Vec<ToolCall>,
    /// The text without the calls, their markup and anything from an imitated result on.
    pub text: String,
    /// Call-like text that could not be read, as written (shortened).
    pub unreadable: Vec<String>,
    /// Imitated tool results, by their opening tag (`<output>…`).
    pub imitated: Vec<String>,
}

impl TextCalls {
    /// Whether the text held anything call-like at all.
    pub fn found(&self) -> bool {
        !self.calls.is_empty() || !self.unreadable.is_empty() || !self.imitated.is_empty()
    }
}

/// Tags that open a tool result the model made up.
const RESULT_TAGS: &[&str] = &[
    "<output>",
    "<tool_response>",
    "<tool_result>",
    "<tool_output>",
    "<function_results>",
    "<function_result>",
    "<result>",
    "<observation>",
];

/// Markup around calls, dropped from the text.
const CALL_MARKUP: &[&str] = &[
    "<tool_call>",
    "</tool_call>",
    "<tools>",
    "</tools>",
    "<tool>",
    "</tool>",
    "<function_call>",
    "</function_call>",
    "<functioncall>",
    "</function>",
];

fn short(s: &str) -> String {
    let s = s.trim();
    let cut: String = s.chars().take(80).collect();
    if cut.len() < s.len() {
        format!("{cut}…")
    } else {
        cut
    }
}

/// Reads calls from `text`; ids are `call_text_{n}`.
pub fn read(text: &str) -> TextCalls {
    let mut out = TextCalls::default();
    let lower = text.to_ascii_lowercase();
    // Everything from the first imitated result on was written without a tool having run.
    let cut = RESULT_TAGS
        .iter()
        .filter_map(|t| lower.find(t).map(|i| (i, t.to_string())))
        .chain(
            lower
                .match_indices("observation:")
                .filter(|(i, _)| *i == 0 || lower[..*i].ends_with('\n'))
                .map(|(i, _)| (i, "Observation:".to_string())),
        )
        .min();
    // Named by its opening only: echoing the invented values back would repeat them.
    if let Some((_, tag)) = &cut {
        out.imitated.push(format!("{tag}…"));
    }
    let cut = cut.map(|(i, _)| i);
    let head = &text[..cut.unwrap_or(text.len())];
    let mut kept = String::new();
    let mut pos = 0;
    let mut in_markup = false;
    while pos < head.len() {
        let rest = &head[pos..];
        let rest_lower = &lower[pos..pos + rest.len()];
        if let Some(m) = CALL_MARKUP.iter().find(|m| rest_lower.starts_with(**m)) {
            in_markup = !m.starts_with("</");
            pos += m.len();
            continue;
        }
        if rest_lower.starts_with("<tool ") || rest_lower.starts_with("<tool_call ") {
            let end = rest.find('>').map_or(rest.len(), |e| e + 1);
            let tag = &rest[..end];
            match attribute(tag, "name") {
                Some(name) => {
                    let args = attribute(tag, "arguments")
                        .or_else(|| attribute(tag, "args"))
                        .unwrap_or_else(|| "{}".into());
                    push_call(&mut out, name, args);
                }
                None => out.unreadable.push(short(tag)),
            }
            in_markup = !tag.ends_with("/>");
            pos += end;
            continue;
        }
        if let Some(after) = rest_lower.strip_prefix("<function=") {
            // Llama 3.1's form: <function=NAME>{...}</function>
            let name_end = after.find('>').unwrap_or(after.len());
            const OPEN: usize = "<function=".len();
            let name = rest[OPEN..OPEN + name_end].trim().to_string();
            let body_start = OPEN + (name_end + 1).min(after.len());
            let body = &rest[body_start..];
            let body_end = body
                .to_ascii_lowercase()
                .find("</function>")
                .unwrap_or(body.len());
            match read_arguments(&body[..body_end]) {
                Some(args) if !name.is_empty() => push_call(&mut out, name, args),
                _ => out.unreadable.push(short(&rest[..body_start + body_end])),
            }
            pos += body_start + body_end;
            continue;
        }
        if rest.starts_with("```") {
            // Fence markers: what is inside is read like any other text.
            let line_end = rest.find('\n').unwrap_or(rest.len());
            let lang = rest[3..line_end].trim();
            if lang.is_empty() || lang.chars().all(|c| c.is_ascii_alphanumeric()) {
                kept.push('\n');
                pos += if lang.is_empty() { 3 } else { line_end };
                continue;
            }
        }
        if rest.starts_with('{') {
            let span = balanced(rest);
            let body = &rest[..span];
            match call_values(body) {
                Some(found) => {
                    for (name, args) in found {
                        push_call(&mut out, name, args);
                    }
                    pos += span;
                    continue;
                }
                None if in_markup || looks_like_call(body) => {
                    out.unreadable.push(short(body));
                    pos += span;
                    continue;
                }
                None => {
                    kept.push_str(body);
                    pos += span;
                    continue;
                }
            }
        }
        let c = rest.chars().next().unwrap_or(' ');
        if in_markup && !c.is_whitespace() && !matches!(c, '}' | ']' | ',') {
            // Prose inside call markup, e.g. a `<tool>` body that is not JSON.
            let end = rest.find('<').unwrap_or(rest.len()).max(c.len_utf8());
            out.unreadable.push(short(&rest[..end]));
            pos += end;
            continue;
        }
        if !(in_markup || (c == '}' && !out.calls.is_empty())) {
            kept.push(c);
        }
        pos += c.len_utf8();
    }
    // Left-over punctuation of a removed call is not text.
    let kept = kept.trim();
    out.text = if kept.chars().all(|c| !c.is_alphanumeric()) {
        String::new()
    } else {
        kept.to_string()
    };
    out
}

fn push_call(out: &mut TextCalls, name: String, arguments: String) {
    out.calls.push(ToolCall {
        id: format!("call_text_{}", out.calls.len()),
        name,
        arguments,
    });
}

/// `name="x"` or `name='x'` in a tag.
fn attribute(tag: &str, key: &str) -> Option<String> {
    let mut search = 0;
    while let Some(i) = tag[search..].find(key) {
        let at = search + i;
        search = at + key.len();
        let before_ok = tag[..at].ends_with(|c: char| c.is_whitespace());
        let rest = tag[at + key.len()..].trim_start();
        let Some(rest) = rest.strip_prefix('=').filter(|_| before_ok) else {
            continue;
        };
        let rest = rest.trim_start();
        let q = rest.chars().next()?;
        if q != '"' && q != '\'' {
            continue;
        }
        let end = rest[1..].find(q)?;
        return Some(rest[1..1 + end].to_string());
    }
    None
}

/// The length of the `{…}` value at the start of `s`, braces counted outside strings; the
/// whole text when it never closes.
fn balanced(s: &str) -> usize {
    let mut depth = 0i32;
    let mut in_str: Option<char> = None;
    let mut escaped = false;
    for (i, c) in s.char_indices() {
        if let Some(q) = in_str {
            if escaped {
                escaped = false;
            } else if c == '\\' {
                escaped = true;
            } else if c == q {
                in_str = None;
            }
            continue;
        }
        match c {
            '"' => in_str = Some(c),
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return i + 1;
                }
            }
            _ => {}
        }
    }
    s.len()
}

fn looks_like_call(body: &str) -> bool {
    let l = body.to_ascii_lowercase();
    l.contains("name") && (l.contains("arguments") || l.contains("parameters"))
}

/// Arguments text as JSON, repaired when almost valid.
fn read_arguments(body: &str) -> Option<String> {
    let body = body.trim();
    let undoubled = undouble(body);
    [body, undoubled.as_str()]
        .iter()
        .find_map(|b| parse_lenient(b).ok())
        .filter(|r| r.value.is_object())
        .map(|r| r.value.to_string())
}

/// `{{ … }}` as written by a template that escaped its braces.
fn undouble(s: &str) -> String {
    s.replace("{{", "{").replace("}}", "}")
}

/// The calls a JSON text holds: one call object, `{"tool_calls": [...]}`, an array of calls,
/// `{"function": {...}}`. `None` when it is not (or not readably) a call.
fn call_values(body: &str) -> Option<Vec<(String, String)>> {
    let undoubled = undouble(body);
    for text in [body, undoubled.as_str()] {
        let value = serde_json::Deserializer::from_str(text)
            .into_iter::<Value>()
            .next()
            .and_then(Result::ok)
            .or_else(|| parse_lenient(text).ok().map(|r| r.value));
        if let Some(calls) = value.as_ref().and_then(calls_of) {
            return Some(calls);
        }
    }
    None
}

fn calls_of(v: &Value) -> Option<Vec<(String, String)>> {
    if let Some(list) = v.get("tool_calls").and_then(Value::as_array) {
        let calls: Option<Vec<_>> = list.iter().map(call_of).collect();
        return calls.filter(|c| !c.is_empty());
    }
    call_of(v).map(|c| vec![c])
}

fn call_of(v: &Value) -> Option<(String, String)> {
    let v = v.get("function").filter(|f| f.is_object()).unwrap_or(v);
    let name = v.get("name")?.as_str()?.trim().to_string();
    if name.is_empty() {
        return None;
    }
    let args = ["arguments", "parameters", "args"]
        .iter()
        .find_map(|k| v.get(*k))?;
    let arguments = match args {
        Value::String(s) => s.clone(),
        Value::Object(_) => args.to_string(),
        _ => return None,
    };
    Some((name, arguments))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tools_markup_with_an_imagined_result_is_a_call_and_the_result_is_dropped() {
        let t = read(
            "<tools><tool name=\"segment_lungs\" arguments='{\"image\": \"img_1\"}'><output>{\"area_left\": 32456, \"area_right\": 24321}</output></tool></tools> The left lung is larger.",
        );
        assert_eq!(t.calls.len(), 1);
        assert_eq!(t.calls[0].name, "segment_lungs");
        assert_eq!(t.calls[0].arguments, "{\"image\": \"img_1\"}");
        assert_eq!(t.imitated, vec!["<output>…".to_string()]);
        assert_eq!(t.text, "");
    }

    #[test]
    fn doubled_braces_fences_and_calls_after_prose_are_read() {
        let t = read("<tools>{{\"name\": \"segment_lungs\", \"arguments\": {{\"image\": \"img_1\"}}}}}\n</tools>");
        assert_eq!(t.calls.len(), 1, "{t:?}");
        assert_eq!(t.calls[0].arguments, "{\"image\":\"img_1\"}");
        assert!(t.unreadable.is_empty() && t.text.is_empty(), "{t:?}");

        let t = read("I will measure the lungs first.\n```json\n{\"name\": \"segment_lungs\", \"arguments\": {\"image\": \"img_1\"}}\n```");
        assert_eq!(t.calls.len(), 1, "{t:?}");
        assert_eq!(t.text, "I will measure the lungs first.");

        let t = read("Let me check. {\"name\": \"image_info\", \"parameters\": {\"image\": \"img_1\"}} and {\"function\": {\"name\": \"segment_lungs\", \"arguments\": \"{\\\"image\\\": \\\"img_1\\\"}\"}}");
        let names: Vec<&str> = t.calls.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(names, ["image_info", "segment_lungs"]);
        assert_eq!(t.calls[1].id, "call_text_1");

        let t = read("<function=segment_lungs>{\"image\": \"img_1\"}</function>");
        assert_eq!(t.calls[0].name, "segment_lungs", "{t:?}");
    }

    #[test]
    fn unreadable_calls_are_reported_and_prose_json_is_kept() {
        let t =
            read("<tools>{{\"name\": \"segment_lungs\", \"arguments\": {{image: img_1}}}}</tools>");
        assert!(t.calls.is_empty());
        assert_eq!(t.unreadable.len(), 1, "{t:?}");
        assert!(t.unreadable[0].contains("segment_lungs"));

        let t = read("<tool_call>\nnot json\n</tool_call>");
        assert_eq!(t.unreadable, vec!["not json".to_string()], "{t:?}");

        let prose = "The result was {\"a\": 1} and nothing else.";
        let t = read(prose);
        assert!(!t.found());
        assert_eq!(t.text, prose);
    }

    #[test]
    fn an_imitated_result_without_a_call_is_found() {
        let t =
            read("Left: 21.5 cm²\n<tool_response>{\"area\": 5}</tool_response>\nSo the left lung.");
        assert!(t.calls.is_empty());
        assert_eq!(t.imitated.len(), 1);
        assert_eq!(t.text, "Left: 21.5 cm²");
    }
}
