//! Lenient JSON for tool arguments written by models: accepts what is *almost* JSON and says
//! what it changed, so the model can be told; refuses what cannot be read without guessing.
//!
//! Repairs: code fences, single-quoted strings, unquoted keys, trailing commas, Python
//! `True`/`False`/`None`, missing closing brackets/braces/quotes at the end of the text.

use serde_json::{Map, Number, Value};

/// Parsed arguments and whether a repair was needed.
#[derive(Debug, PartialEq)]
pub struct Repaired {
    /// The arguments.
    pub value: Value,
    /// They needed repair to be read.
    pub repaired: bool,
}

/// Parses `text` as JSON, repairing it when almost valid. The error says where reading failed.
pub fn parse_lenient(text: &str) -> Result<Repaired, String> {
    let trimmed = text.trim();
    if trimmed.is_empty() {
        return Ok(Repaired {
            value: Value::Object(Map::new()),
            repaired: false,
        });
    }
    if let Ok(value) = serde_json::from_str::<Value>(trimmed) {
        return Ok(Repaired {
            value,
            repaired: false,
        });
    }
    let unfenced = strip_fence(trimmed);
    let mut p = Parser {
        s: unfenced.as_bytes(),
        text: unfenced,
        i: 0,
    };
    p.ws();
    let value = p.value()?;
    p.ws();
    if p.i < p.s.len() {
        return Err(format!(
            "unexpected text after the JSON value at character {}: `{}`",
            p.i,
            snippet(&unfenced[p.i..])
        ));
    }
    Ok(Repaired {
        value,
        repaired: true,
    })
}

fn strip_fence(s: &str) -> &str {
    let s = s.trim();
    if let Some(rest) = s.strip_prefix("```") {
        let rest = rest.trim_start_matches(|c: char| c.is_ascii_alphabetic());
        let rest = rest.strip_suffix("```").unwrap_or(rest);
        return rest.trim();
    }
    s
}

fn snippet(s: &str) -> String {
    s.chars().take(30).collect()
}

struct Parser<'a> {
    s: &'a [u8],
    text: &'a str,
    i: usize,
}

impl Parser<'_> {
    fn peek(&self) -> Option<u8> {
        self.s.get(self.i).copied()
    }

    fn ws(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\n' | b'\r' | b'\t')) {
            self.i += 1;
        }
    }

    fn value(&mut self) -> Result<Value, String> {
        self.ws();
        match self.peek() {
            None => Err("the arguments end where a value was expected".into()),
            Some(b'{') => self.object(),
            Some(b'[') => self.array(),
            Some(q @ (b'"' | b'\'')) => self.string(q).map(Value::String),
            Some(c) if c == b'-' || c.is_ascii_digit() => self.number(),
            Some(_) => {
                let word = self.word();
                match word.as_str() {
                    "true" | "True" => Ok(Value::Bool(true)),
                    "false" | "False" => Ok(Value::Bool(false)),
                    "null" | "None" => Ok(Value::Null),
                    "" => Err(format!(
                        "unexpected `{}` at character {}",
                        snippet(&self.text[self.i..]),
                        self.i
                    )),
                    w => Err(format!(
                        "`{w}` is not a JSON value (strings need quotes) at character {}",
                        self.i
                    )),
                }
            }
        }
    }

    fn word(&mut self) -> String {
        let start = self.i;
        while matches!(self.peek(), Some(c) if c.is_ascii_alphanumeric() || c == b'_' || c == b'-')
        {
            self.i += 1;
        }
        self.text[start..self.i].to_string()
    }

    fn object(&mut self) -> Result<Value, String> {
        self.i += 1;
        let mut map = Map::new();
        loop {
            self.ws();
            match self.peek() {
                None => return Ok(Value::Object(map)),
                Some(b'}') => {
                    self.i += 1;
                    return Ok(Value::Object(map));
                }
                Some(b',') => {
                    self.i += 1;
                    continue;
                }
                Some(q @ (b'"' | b'\'')) => {
                    let key = self.string(q)?;
                    self.member(&mut map, key)?;
                }
                Some(c) if c.is_ascii_alphabetic() || c == b'_' => {
                    let key = self.word();
                    self.member(&mut map, key)?;
                }
                Some(_) => {
                    return Err(format!(
                        "expected a key at character {}: `{}`",
                        self.i,
                        snippet(&self.text[self.i..])
                    ))
                }
            }
        }
    }

    fn member(&mut self, map: &mut Map<String, Value>, key: String) -> Result<(), String> {
        self.ws();
        if self.peek() != Some(b':') {
            return Err(format!("expected `:` after key `{key}`"));
        }
        self.i += 1;
        let v = self.value()?;
        map.insert(key, v);
        Ok(())
    }

    fn array(&mut self) -> Result<Value, String> {
        self.i += 1;
        let mut items = Vec::new();
        loop {
            self.ws();
            match self.peek() {
                None => return Ok(Value::Array(items)),
                Some(b']') => {
                    self.i += 1;
                    return Ok(Value::Array(items));
                }
                Some(b',') => {
                    self.i += 1;
                }
                Some(_) => items.push(self.value()?),
            }
        }
    }

    fn string(&mut self, quote: u8) -> Result<String, String> {
        self.i += 1;
        let mut out = String::new();
        let mut chars = self.text[self.i..].char_indices();
        while let Some((off, c)) = chars.next() {
            if c as u32 == quote as u32 {
                self.i += off + 1;
                return Ok(out);
            }
            if c == '\\' {
                match chars.next() {
                    Some((_, 'n')) => out.push('\n'),
                    Some((_, 't')) => out.push('\t'),
                    Some((_, 'r')) => out.push('\r'),
                    Some((_, 'u')) => {
                        let hex: String =
                            (0..4).filter_map(|_| chars.next().map(|x| x.1)).collect();
                        let code = u32::from_str_radix(&hex, 16)
                            .map_err(|_| format!("bad \\u escape `{hex}`"))?;
                        out.push(char::from_u32(code).unwrap_or('\u{fffd}'));
                    }
                    Some((_, other)) => out.push(other),
                    None => break,
                }
            } else {
                out.push(c);
            }
        }
        // Unterminated string at the end of the text: close it.
        self.i = self.s.len();
        Ok(out)
    }

    fn number(&mut self) -> Result<Value, String> {
        let start = self.i;
        while matches!(self.peek(), Some(c) if c.is_ascii_digit() || matches!(c, b'-' | b'+' | b'.' | b'e' | b'E'))
        {
            self.i += 1;
        }
        let t = &self.text[start..self.i];
        if let Ok(i) = t.parse::<i64>() {
            return Ok(Value::Number(i.into()));
        }
        t.parse::<f64>()
            .ok()
            .and_then(Number::from_f64)
            .map(Value::Number)
            .ok_or_else(|| format!("`{t}` is not a number"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn fix(s: &str) -> Value {
        let r = parse_lenient(s).unwrap();
        assert!(r.repaired, "{s} should need repair");
        r.value
    }

    #[test]
    fn valid_json_is_untouched() {
        let r = parse_lenient(r#"{"a": [1, 2.5, "x"]}"#).unwrap();
        assert!(!r.repaired);
        assert_eq!(r.value, json!({"a": [1, 2.5, "x"]}));
    }

    #[test]
    fn almost_json_is_repaired() {
        assert_eq!(fix("{'image': 'img_1',}"), json!({"image": "img_1"}));
        assert_eq!(
            fix("{image: \"img_1\", top_k: 3"),
            json!({"image": "img_1", "top_k": 3})
        );
        assert_eq!(
            fix("```json\n{\"a\": True, \"b\": None}\n```"),
            json!({"a": true, "b": null})
        );
        assert_eq!(
            fix("{\"a\": [1, 2,], \"b\": \"x"),
            json!({"a": [1, 2], "b": "x"})
        );
    }

    #[test]
    fn hopeless_text_is_refused_with_a_reason() {
        let err = parse_lenient("{\"image\": img_1}").unwrap_err();
        assert!(err.contains("img_1"), "{err}");
        assert!(parse_lenient("look at the image").is_err());
    }
}
