//! De-identification of tool arguments for the audit log: numbers and booleans stay, strings
//! stay only when they are Hilum ids (`img_…`, `art_…`) or a value the tool's schema
//! enumerates. Anything else (paths, free text, names) is replaced by its length.

use std::collections::BTreeSet;

use serde_json::{Map, Value};

/// String values a schema enumerates (`enum`, `const`), anywhere in it.
pub fn enumerated_strings(schema: &Value) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    collect(schema, &mut out);
    out
}

fn collect(v: &Value, out: &mut BTreeSet<String>) {
    match v {
        Value::Object(o) => {
            for (k, child) in o {
                match (k.as_str(), child) {
                    ("enum", Value::Array(items)) => {
                        out.extend(items.iter().filter_map(Value::as_str).map(str::to_string))
                    }
                    ("const", Value::String(s)) => {
                        out.insert(s.clone());
                    }
                    _ => collect(child, out),
                }
            }
        }
        Value::Array(items) => items.iter().for_each(|i| collect(i, out)),
        _ => {}
    }
}

fn is_hilum_id(s: &str) -> bool {
    let Some((prefix, rest)) = s.split_once('_') else {
        return false;
    };
    matches!(prefix, "img" | "art" | "ses" | "run")
        && !rest.is_empty()
        && rest.len() <= 64
        && rest.bytes().all(|b| b.is_ascii_hexdigit())
}

/// The arguments with every string that could carry PHI replaced.
pub fn deidentify(args: &Value, allowed: &BTreeSet<String>) -> Value {
    match args {
        Value::String(s) if is_hilum_id(s) || allowed.contains(s) => Value::String(s.clone()),
        Value::String(s) => Value::String(format!("[redacted: {} chars]", s.chars().count())),
        Value::Array(items) => Value::Array(items.iter().map(|i| deidentify(i, allowed)).collect()),
        Value::Object(o) => Value::Object(
            o.iter()
                .map(|(k, v)| (k.clone(), deidentify(v, allowed)))
                .collect::<Map<_, _>>(),
        ),
        other => other.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn free_text_and_paths_are_redacted_ids_and_enums_kept() {
        let schema = json!({"properties": {"side": {"enum": ["left", "right"]}}});
        let allowed = enumerated_strings(&schema);
        let out = deidentify(
            &json!({
                "image": "img_3fa2c1b4d5e6",
                "side": "left",
                "note": "John Doe, born 1950",
                "path": "/home/u/Doe_John.dcm",
                "threshold": 0.5,
                "ids": ["img_00ff", "img_xyz"]
            }),
            &allowed,
        );
        assert_eq!(out["image"], "img_3fa2c1b4d5e6");
        assert_eq!(out["side"], "left");
        assert_eq!(out["threshold"], 0.5);
        assert_eq!(out["ids"][0], "img_00ff");
        assert!(!out.to_string().contains("Doe"), "{out}");
        assert_eq!(out["ids"][1], "[redacted: 7 chars]");
    }
}
