//! Renders a conversation with the model's own `tokenizer.chat_template` (Jinja), the way
//! Hugging Face transformers and llama.cpp do, so any instruct GGUF works without extra files.

use minijinja::{Environment, Error, ErrorKind, Value as JValue};
use serde_json::{json, Value};

use crate::{Message, ToolSpec};

use super::LocalError;

/// ChatML, for GGUFs that carry no template.
const CHATML: &str = "{%- for message in messages %}{{ '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}";

pub struct ChatTemplate {
    env: Environment<'static>,
    pub source: String,
}

impl ChatTemplate {
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
        Ok(ChatTemplate { env, source })
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
            bos_token => "",
            eos_token => "",
        };
        tmpl.render(ctx)
            .map_err(|e| LocalError::Template(format!("rendering the chat template failed: {e:#}")))
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
    use crate::ToolCall;

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
}
