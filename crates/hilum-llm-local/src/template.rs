//! Renders a conversation with the model's own `tokenizer.chat_template` (Jinja), the way
//! Hugging Face transformers and llama.cpp do, so any instruct GGUF works without extra files.

use minijinja::{Environment, Error, ErrorKind, Value as JValue};
use serde_json::{json, Value};

use hilum_llm::{Message, ToolSpec};

use crate::{GgufTokenizer, LocalError};

/// ChatML, for GGUFs that carry no template but have its turn tokens.
const CHATML: &str = "{%- for message in messages %}{{ '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}";

/// Gemma's turn format, for Gemma GGUFs without a template (the base models): a system message
/// opens the first user turn, the assistant is `model`, tool results are user turns.
const GEMMA_TURNS: &str = r#"{%- set ns = namespace(system='') -%}
{%- for message in messages -%}
{%- if message.role == 'system' -%}{%- set ns.system = ns.system + message.content + '\n\n' -%}
{%- else -%}
{%- set role = 'model' if message.role == 'assistant' else 'user' -%}
{{- '<start_of_turn>' + role + '\n' + ns.system -}}{%- set ns.system = '' -%}
{%- if message.role == 'tool' -%}{{- 'Result of ' + message.name + ':\n' + message.content -}}
{%- else -%}{{- message.content -}}
{%- for call in message.tool_calls or [] -%}{{- '\n<tool_call>\n{"name": ' + (call.function.name | tojson) + ', "arguments": ' + (call.function.arguments | tojson) + '}\n</tool_call>' -}}{%- endfor -%}
{%- endif -%}
{{- '<end_of_turn>\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<start_of_turn>model\n' -}}{%- endif -%}"#;

/// A chat template, compiled, that renders a conversation into the model's prompt text.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// The template's Jinja source.
    pub source: String,
    /// Text of the BOS token the prompt must start with (`bos_token` in templates), if any.
    bos: Option<String>,
}

impl ChatTemplate {
    /// The GGUF's own template; without one, the turn format its vocabulary has tokens for
    /// (ChatML or Gemma's), else an error. Prompts start with the BOS token when the GGUF asks
    /// for it (`tokenizer.ggml.add_bos_token`), whether or not the template writes `bos_token`.
    pub fn for_gguf(source: Option<String>, tok: &GgufTokenizer) -> Result<Self, LocalError> {
        let source = match source {
            Some(s) => s,
            None if tok.special("<start_of_turn>").is_some()
                && tok.special("<end_of_turn>").is_some() =>
            {
                GEMMA_TURNS.to_string()
            }
            None if tok.special("<|im_start|>").is_some() => CHATML.to_string(),
            None => {
                return Err(LocalError::Template(
                    "the GGUF has no chat template (tokenizer.chat_template) and its vocabulary has no known turn tokens (<|im_start|>, <start_of_turn>); use an instruct model's GGUF".into(),
                ))
            }
        };
        let mut t = Self::new(Some(source))?;
        t.bos = tok.bos_text();
        Ok(t)
    }

    /// `source`, or ChatML when `None`; no BOS token is added.
    pub fn new(source: Option<String>) -> Result<Self, LocalError> {
        let source = source.unwrap_or_else(|| CHATML.to_string());
        let mut env = Environment::new();
        minijinja_contrib::add_to_environment(&mut env);
        // Python string methods (`.startswith`, `.strip`) used by many templates.
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", tojson);
        env.add_function("raise_exception", |msg: String| -> Result<JValue, Error> {
            Err(Error::new(ErrorKind::InvalidOperation, msg))
        });
        env.add_template_owned("chat", source.clone())
            .map_err(|e| LocalError::Template(format!("the chat template does not parse: {e}")))?;
        Ok(ChatTemplate {
            env,
            source,
            bos: None,
        })
    }

    /// The prompt for `messages`, ending with the assistant header when `add_generation_prompt`.
    pub fn render(
        &self,
        messages: &[Message],
        tools: &[ToolSpec],
        add_generation_prompt: bool,
    ) -> Result<String, LocalError> {
        let msgs: Vec<Value> = messages.iter().map(message_json).collect();
        let tools: Vec<Value> = tools
            .iter()
            .map(|t| {
                json!({"type": "function", "function": {
                    "name": t.name, "description": t.description, "parameters": t.parameters}})
            })
            .collect();
        let tmpl = self
            .env
            .get_template("chat")
            .map_err(|e| LocalError::Template(e.to_string()))?;
        let ctx = minijinja::context! {
            messages => JValue::from_serialize(&msgs),
            tools => if tools.is_empty() { JValue::from(()) } else { JValue::from_serialize(&tools) },
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos.as_deref().unwrap_or(""),
            eos_token => "",
        };
        let text = tmpl.render(ctx).map_err(|e| {
            LocalError::Template(format!("rendering the chat template failed: {e:#}"))
        })?;
        Ok(match &self.bos {
            Some(b) if !text.starts_with(b.as_str()) => format!("{b}{text}"),
            _ => text,
        })
    }
}

fn message_json(m: &Message) -> Value {
    match m {
        Message::System { content } => json!({"role": "system", "content": content}),
        Message::User { content, .. } => json!({"role": "user", "content": content}),
        Message::Assistant {
            content,
            tool_calls,
        } => {
            let calls: Vec<Value> = tool_calls
                .iter()
                .map(|c| {
                    // Templates serialise arguments with `tojson`: pass an object, not text.
                    let args = serde_json::from_str::<Value>(&c.arguments)
                        .unwrap_or_else(|_| Value::String(c.arguments.clone()));
                    json!({"id": c.id, "type": "function",
                           "function": {"name": c.name, "arguments": args}})
                })
                .collect();
            if calls.is_empty() {
                json!({"role": "assistant", "content": content})
            } else {
                json!({"role": "assistant", "content": content, "tool_calls": calls})
            }
        }
        Message::Tool {
            tool_call_id,
            name,
            content,
            ..
        } => {
            json!({"role": "tool", "tool_call_id": tool_call_id, "name": name, "content": content})
        }
    }
}

/// `tojson` as Python's `json.dumps(x, ensure_ascii=False)`: `", "` and `": "` separators, no
/// HTML escaping (minijinja's own filter escapes `<`), so prompts match transformers/llama.cpp.
fn tojson(v: JValue) -> Result<JValue, Error> {
    let v: Value = serde_json::to_value(&v)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
    let mut out = String::new();
    python_json(&v, &mut out);
    Ok(JValue::from_safe_string(out))
}

pub fn python_json(v: &Value, out: &mut String) {
    match v {
        Value::Object(map) => {
            out.push('{');
            for (i, (k, v)) in map.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                out.push_str(&Value::String(k.clone()).to_string());
                out.push_str(": ");
                python_json(v, out);
            }
            out.push('}');
        }
        Value::Array(items) => {
            out.push('[');
            for (i, v) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                python_json(v, out);
            }
            out.push(']');
        }
        other => out.push_str(&other.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hilum_llm::ToolCall;

    #[test]
    fn python_json_uses_spaced_separators() {
        let mut s = String::new();
        python_json(&json!({"a": [1, "x<y"], "b": {"c": null}}), &mut s);
        assert_eq!(s, r#"{"a": [1, "x<y"], "b": {"c": null}}"#);
    }

    #[test]
    fn chatml_fallback_renders_roles_and_generation_prompt() {
        let t = ChatTemplate::new(None).unwrap();
        let p = t
            .render(
                &[Message::system("S"), Message::user("hi", vec![])],
                &[],
                true,
            )
            .unwrap();
        assert_eq!(
            p,
            "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn tool_calls_are_passed_as_objects() {
        let src = "{% for m in messages %}{% for c in m.tool_calls %}{{ c.function.arguments | tojson }}{% endfor %}{% endfor %}";
        let t = ChatTemplate::new(Some(src.into())).unwrap();
        let call = ToolCall::new("c1", "f", &json!({"image": "img_1"}));
        let p = t
            .render(&[Message::assistant("", vec![call])], &[], false)
            .unwrap();
        assert_eq!(p, r#"{"image": "img_1"}"#);
    }

    #[test]
    fn gemma_turns_fold_the_system_prompt_and_name_the_assistant_model() {
        let t = ChatTemplate::new(Some(GEMMA_TURNS.into())).unwrap();
        let call = ToolCall::new("c1", "image_info", &json!({"image": "img_1"}));
        let p = t
            .render(
                &[
                    Message::system("S"),
                    Message::user("hi", vec![]),
                    Message::assistant("", vec![call]),
                    Message::Tool {
                        tool_call_id: "c1".into(),
                        name: "image_info".into(),
                        content: "8-bit".into(),
                        is_error: false,
                    },
                ],
                &[],
                true,
            )
            .unwrap();
        assert_eq!(
            p,
            "<start_of_turn>user\nS\n\nhi<end_of_turn>\n\
             <start_of_turn>model\n\n<tool_call>\n{\"name\": \"image_info\", \"arguments\": {\"image\": \"img_1\"}}\n</tool_call><end_of_turn>\n\
             <start_of_turn>user\nResult of image_info:\n8-bit<end_of_turn>\n\
             <start_of_turn>model\n"
        );
    }
}
