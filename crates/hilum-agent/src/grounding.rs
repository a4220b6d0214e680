//! The grounding check: every number (with its unit) and every named tool in a final answer
//! must come from the tool results, the question or the image metadata, and a claim that the
//! left or right lung is larger must agree with the values it cites and the values the results
//! hold. In a medical tool an invented measurement is worse than no answer.
//!
//! Rules, so that a reader can predict the verdict:
//! - A number matches a source number when it is within one unit of its last written digit
//!   (`21.5` matches 21.46 and 21.53; `43,042` matches 43042; `43k` and `43,000` match 43042).
//! - Units convert: cm² ↔ mm² ↔ px (with a pixel spacing from the results or the metadata),
//!   cm ↔ mm ↔ px, and a percentage matches a ratio (`33%` ↔ 0.33). A source number of unknown
//!   unit matches any unit.
//! - Small counts without a unit or decimals (0 to 10: list markers, "2 lungs") are not
//!   checked; neither are digits inside identifiers (`img_3fa2c1`, `call_1`, `DenseNet-121`).
//! - An answer without numbers or claims ("no measurement is available") passes.

use std::collections::BTreeSet;

use serde_json::Value;

/// What an answer may draw on: the question, tool results, call arguments, image metadata.
#[derive(Clone, Debug, Default)]
pub struct Sources {
    question: String,
    texts: Vec<String>,
    values: Vec<Value>,
    /// Tools called in the run (whether or not they succeeded).
    called: BTreeSet<String>,
    /// Tools the toolbox has.
    known: BTreeSet<String>,
}

impl Sources {
    /// Evidence that starts with the question's text.
    pub fn new(question: impl Into<String>) -> Self {
        let question = question.into();
        Sources {
            texts: vec![question.clone()],
            question,
            ..Default::default()
        }
    }

    /// Text the answer may quote (the question, a tool's summary, an earlier message).
    pub fn add_text(&mut self, text: impl Into<String>) {
        self.texts.push(text.into());
    }

    /// Structured data (a tool's JSON, call arguments, image metadata).
    pub fn add_data(&mut self, value: Value) {
        self.values.push(value);
    }

    /// A tool that ran in the run (an answer may name it).
    pub fn add_called(&mut self, tool: impl Into<String>) {
        self.called.insert(tool.into());
    }

    /// A tool that exists (an answer naming it without a call is flagged).
    pub fn add_known(&mut self, tool: impl Into<String>) {
        self.known.insert(tool.into());
    }
}

/// Checks an answer; returns what it states that nothing supports (empty: grounded).
pub fn check(answer: &str, sources: &Sources) -> Vec<String> {
    let pool = SourcePool::new(sources);
    let mut unsupported = Vec::new();
    for n in scan_numbers(answer) {
        if n.small_count {
            continue;
        }
        if !pool.supports(&n) {
            let item = format!(
                "{} (no tool result, the question or the image metadata gives this number)",
                n.text
            );
            if !unsupported.contains(&item) {
                unsupported.push(item);
            }
        }
    }
    unsupported.extend(check_tools(answer, sources));
    unsupported.extend(check_laterality(answer, sources, &pool));
    unsupported
}

// ---------------------------------------------------------------------------------------------
// Numbers

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Unit {
    None,
    Percent,
    /// A fraction of one (probabilities, ratios): may be written as a percentage.
    Ratio,
    Px,
    Cm2,
    Mm2,
    Cm,
    Mm,
    /// A unit the check does not convert (ms, bits, ...): compared as written.
    Other,
}

impl Unit {
    fn is_area(self) -> bool {
        matches!(self, Unit::Px | Unit::Cm2 | Unit::Mm2)
    }
}

/// A number as written in a text.
#[derive(Clone, Debug)]
struct Num {
    value: f64,
    unit: Unit,
    /// One unit of the last written digit.
    precision: f64,
    /// As written, unit included.
    text: String,
    start: usize,
    small_count: bool,
}

/// Units after a number, longest first; each must end at a word boundary.
const UNITS: &[(&str, Unit)] = &[
    ("square centimetres", Unit::Cm2),
    ("square centimeters", Unit::Cm2),
    ("square millimetres", Unit::Mm2),
    ("square millimeters", Unit::Mm2),
    ("square pixels", Unit::Px),
    ("centimetres", Unit::Cm),
    ("centimeters", Unit::Cm),
    ("millimetres", Unit::Mm),
    ("millimeters", Unit::Mm),
    ("per cent", Unit::Percent),
    ("percent", Unit::Percent),
    ("pixels²", Unit::Px),
    ("pixels", Unit::Px),
    ("pixel", Unit::Px),
    ("sq cm", Unit::Cm2),
    ("sq mm", Unit::Mm2),
    ("cm^2", Unit::Cm2),
    ("mm^2", Unit::Mm2),
    ("px^2", Unit::Px),
    ("cm²", Unit::Cm2),
    ("mm²", Unit::Mm2),
    ("px²", Unit::Px),
    ("cm2", Unit::Cm2),
    ("mm2", Unit::Mm2),
    ("px", Unit::Px),
    ("cm", Unit::Cm),
    ("mm", Unit::Mm),
    ("ms", Unit::Other),
    ("%", Unit::Percent),
];

fn is_word_char(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// Every number in `text` with its unit, skipping digits inside identifiers.
fn scan_numbers(text: &str) -> Vec<Num> {
    let chars: Vec<(usize, char)> = text.char_indices().collect();
    let at = |i: usize| chars.get(i).map(|&(_, c)| c);
    let mut out = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i].1;
        if !c.is_ascii_digit() {
            i += 1;
            continue;
        }
        // Digits glued to a word are part of an identifier, except the `x` of `512x512`.
        let prev = if i > 0 { at(i - 1) } else { None };
        let in_word = match prev {
            Some('x' | '×') => i >= 2 && !at(i - 2).is_some_and(|c| c.is_ascii_digit()),
            Some(p) => is_word_char(p) || p == '.',
            None => false,
        };
        let hyphen_word = prev == Some('-')
            && i >= 2
            && at(i - 2).is_some_and(is_word_char)
            && !at(i - 2).is_some_and(|c| c.is_ascii_digit());
        if in_word || hyphen_word {
            while at(i).is_some_and(is_word_char) {
                i += 1;
            }
            continue;
        }
        let negative =
            prev == Some('-') && !(i >= 2 && at(i - 2).is_some_and(|c| c.is_ascii_digit()));
        let start_idx = if negative { i - 1 } else { i };
        let mut digits = String::new();
        let mut j = i;
        while at(j).is_some_and(|c| c.is_ascii_digit()) {
            digits.push(chars[j].1);
            j += 1;
        }
        // Thousands groups: `,` (or a thin/no-break space) and exactly three digits.
        if digits.len() <= 3 {
            loop {
                let sep = at(j);
                let group = matches!(sep, Some(',' | '\u{202f}' | '\u{2009}' | '\u{a0}'))
                    && (1..=3).all(|k| at(j + k).is_some_and(|c| c.is_ascii_digit()))
                    && !at(j + 4).is_some_and(|c| c.is_ascii_digit());
                if !group {
                    break;
                }
                for k in 1..=3 {
                    digits.push(chars[j + k].1);
                }
                j += 4;
            }
        }
        let mut decimals = String::new();
        if at(j) == Some('.') && at(j + 1).is_some_and(|c| c.is_ascii_digit()) {
            j += 1;
            while at(j).is_some_and(|c| c.is_ascii_digit()) {
                decimals.push(chars[j].1);
                j += 1;
            }
        }
        let Ok(mut value) = format!(
            "{digits}.{}",
            if decimals.is_empty() {
                "0"
            } else {
                decimals.as_str()
            }
        )
        .parse::<f64>() else {
            i = j;
            continue;
        };
        let mut precision = 10f64.powi(-(decimals.len() as i32));
        if decimals.is_empty() {
            let zeros = digits.chars().rev().take_while(|&c| c == '0').count();
            if digits.len() >= 4 && zeros >= 3 {
                precision = 10f64.powi(zeros as i32);
            }
        }
        // A `k` / `M` suffix: 43k = 43,000 written to the thousand.
        let mut scaled = false;
        if let Some(s @ ('k' | 'K' | 'M')) = at(j) {
            if !at(j + 1).is_some_and(|c| c.is_alphanumeric()) {
                let f = if s == 'M' { 1e6 } else { 1e3 };
                value *= f;
                precision *= f;
                scaled = true;
                j += 1;
            }
        }
        // The unit: directly attached or after one space.
        let rest_at = |k: usize| chars.get(k).map(|&(b, _)| b).unwrap_or(text.len());
        let mut unit = Unit::None;
        let mut end = j;
        let mut glued_word = false;
        for skip in [0usize, 1] {
            if skip == 1 && at(j) != Some(' ') {
                break;
            }
            let from = rest_at(j + skip);
            let rest = &text[from..];
            let lower = rest.chars().take(20).collect::<String>().to_lowercase();
            if let Some((u, unit_kind)) = UNITS.iter().find(|(u, _)| {
                lower.starts_with(u)
                    && !lower[u.len()..]
                        .chars()
                        .next()
                        .is_some_and(|c| c.is_alphanumeric())
            }) {
                unit = *unit_kind;
                end = j + skip + u.chars().count();
                break;
            }
            if skip == 0 && at(j).is_some_and(|c| c.is_alphabetic()) {
                // `3rd`, `2D`, `10x`: not a measurement. `512x512` continues as two numbers.
                let dims = matches!(at(j), Some('x' | '×'))
                    && at(j + 1).is_some_and(|c| c.is_ascii_digit());
                glued_word = !dims;
                break;
            }
        }
        if glued_word {
            while at(j).is_some_and(is_word_char) {
                j += 1;
            }
            i = j;
            continue;
        }
        if negative {
            value = -value;
        }
        let small_count =
            unit == Unit::None && decimals.is_empty() && !scaled && value.abs() <= 10.0;
        let start = chars[start_idx].0;
        let stop = rest_at(end);
        out.push(Num {
            value,
            unit,
            precision,
            text: text[start..stop].trim().to_string(),
            start,
            small_count,
        });
        i = end.max(j);
    }
    out
}

/// A number a source holds, with the unit its key or text gives.
#[derive(Clone, Debug)]
struct SrcNum {
    value: f64,
    unit: Unit,
}

/// Unit from a JSON key such as `area_px`, `area_cm2`, `height_cm`, `probability`.
fn key_unit(key: &str) -> Unit {
    let k = key.to_ascii_lowercase();
    if k.contains("spacing") || k.ends_with("_ms") || k == "ms" {
        Unit::Other
    } else if k.contains("cm2") {
        Unit::Cm2
    } else if k.contains("mm2") {
        Unit::Mm2
    } else if k.ends_with("_px") || k == "px" || k == "width" || k == "height" {
        Unit::Px
    } else if k.ends_with("_cm") {
        Unit::Cm
    } else if k.ends_with("_mm") {
        Unit::Mm
    } else if k.contains("percent") || k.contains("pct") {
        Unit::Percent
    } else if ["ratio", "fraction", "prob", "score", "confidence", "ctr"]
        .iter()
        .any(|w| k.contains(w))
    {
        Unit::Ratio
    } else {
        Unit::None
    }
}

/// Every number the sources hold, the pixel spacings they give, and left/right area pairs.
struct SourcePool {
    nums: Vec<SrcNum>,
    /// (row, column) mm per pixel.
    spacings: Vec<(f64, f64)>,
    /// (left, right) areas in one unit.
    area_pairs: Vec<(f64, f64, Unit)>,
}

impl SourcePool {
    fn new(s: &Sources) -> Self {
        let mut pool = SourcePool {
            nums: Vec::new(),
            spacings: Vec::new(),
            area_pairs: Vec::new(),
        };
        for t in &s.texts {
            pool.add_text(t);
        }
        for v in &s.values {
            pool.add_value(v, "", "");
            pool.add_json_pairs(v);
        }
        pool
    }

    fn add_text(&mut self, t: &str) {
        let nums = scan_numbers(t);
        for (k, n) in nums.iter().enumerate() {
            self.nums.push(SrcNum {
                value: n.value,
                unit: n.unit,
            });
            // `0.143x0.143 mm/px` or `0.2 mm/px`: a spacing given in words.
            let after = &t[n.start + n.text.len().min(t.len() - n.start)..];
            if n.unit == Unit::Mm && after.trim_start().starts_with("/px") {
                let row = nums
                    .get(k.wrapping_sub(1))
                    .filter(|p| p.unit == Unit::None && t[p.start..n.start].contains(['x', '×']))
                    .map_or(n.value, |p| p.value);
                self.spacings.push((row, n.value));
            }
        }
        if let Some((l, r)) = cited_pair(t, |u| u.is_area()) {
            if l.unit == r.unit {
                self.area_pairs.push((l.value, r.value, l.unit));
            }
        }
    }

    fn add_value(&mut self, v: &Value, key: &str, parent: &str) {
        match v {
            Value::Number(n) => {
                if let Some(x) = n.as_f64() {
                    let unit = match key_unit(key) {
                        Unit::None => key_unit(parent),
                        u => u,
                    };
                    self.nums.push(SrcNum { value: x, unit });
                }
            }
            Value::String(s) => self.add_text(s),
            Value::Array(items) => {
                if key.to_ascii_lowercase().contains("spacing") {
                    if let [Some(a), Some(b)] =
                        [items.first(), items.get(1)].map(|x| x.and_then(Value::as_f64))
                    {
                        self.spacings.push((a, b));
                    }
                }
                for item in items {
                    self.add_value(item, key, parent);
                }
            }
            Value::Object(map) => {
                if key.to_ascii_lowercase().contains("spacing") {
                    let get = |k: &str| map.get(k).and_then(Value::as_f64);
                    if let (Some(a), Some(b)) = (get("row"), get("column").or_else(|| get("col"))) {
                        self.spacings.push((a, b));
                    }
                }
                for (k, item) in map {
                    self.add_value(item, k, key);
                }
            }
            Value::Bool(_) | Value::Null => {}
        }
        if let (Some(x), true) = (v.as_f64(), key.to_ascii_lowercase().contains("spacing")) {
            self.spacings.push((x, x));
        }
    }

    /// Left/right pairs in JSON: the same path with `left` and `right` swapped, under an
    /// `area` key (`left_lung.area_px` / `right_lung.area_px`, `area_left` / `area_right`).
    fn add_json_pairs(&mut self, v: &Value) {
        let mut flat = Vec::new();
        flatten(v, String::new(), &mut flat);
        for (path, x) in &flat {
            if !path.contains("left") || !path.contains("area") || path.contains("ratio") {
                continue;
            }
            let twin = path.replace("left", "right");
            if let Some((_, y)) = flat.iter().find(|(p, _)| *p == twin) {
                let last = path.rsplit('.').next().unwrap_or(path);
                self.area_pairs.push((*x, *y, key_unit(last)));
            }
        }
    }

    fn supports(&self, n: &Num) -> bool {
        self.nums.iter().any(|s| {
            self.candidates(s, n.unit)
                .into_iter()
                .any(|c| written_as(n.value, n.precision, c))
        })
    }

    /// What a source number reads as in the answer's unit.
    fn candidates(&self, s: &SrcNum, want: Unit) -> Vec<f64> {
        use Unit as U;
        let v = s.value;
        let mut out = Vec::new();
        let areas = || self.spacings.iter().map(|(a, b)| a * b);
        let lengths = || self.spacings.iter().flat_map(|&(a, b)| [a, b]);
        match (want, s.unit) {
            (w, u) if w == u => out.push(v),
            (_, U::None | U::Other) | (U::None | U::Other, _) => {
                out.push(v);
                if want == U::Percent && (v.abs() <= 1.0 || s.unit == U::Ratio) {
                    out.push(v * 100.0);
                }
                if want == U::None && s.unit == U::Percent {
                    out.push(v / 100.0);
                }
            }
            (U::Percent, U::Ratio) => out.extend([v * 100.0, v]),
            (U::Cm2, U::Mm2) => out.push(v / 100.0),
            (U::Mm2, U::Cm2) => out.push(v * 100.0),
            (U::Cm2, U::Px) => out.extend(areas().map(|a| v * a / 100.0)),
            (U::Mm2, U::Px) => out.extend(areas().map(|a| v * a)),
            (U::Px, U::Cm2) => out.extend(areas().map(|a| v * 100.0 / a)),
            (U::Px, U::Mm2) => out.extend(areas().map(|a| v / a)),
            (U::Cm, U::Mm) => out.push(v / 10.0),
            (U::Mm, U::Cm) => out.push(v * 10.0),
            (U::Cm, U::Px) => out.extend(lengths().map(|a| v * a / 10.0)),
            (U::Mm, U::Px) => out.extend(lengths().map(|a| v * a)),
            (U::Px, U::Cm) => out.extend(lengths().map(|a| v * 10.0 / a)),
            (U::Px, U::Mm) => out.extend(lengths().map(|a| v / a)),
            _ => {}
        }
        out.retain(|c| c.is_finite());
        out
    }
}

/// Whether `c`, rounded (or truncated) to `precision`, is written `a`.
fn written_as(a: f64, precision: f64, c: f64) -> bool {
    // A tiny tolerance for binary floating point, relative to the value.
    let eps = 1e-9 * c.abs().max(1.0);
    let rounded = (a - c).abs() <= precision / 2.0 + eps;
    let truncated =
        a.signum() == c.signum() && a.abs() <= c.abs() + eps && c.abs() - a.abs() < precision - eps;
    rounded || truncated
}

fn flatten(v: &Value, path: String, out: &mut Vec<(String, f64)>) {
    match v {
        Value::Number(n) => {
            if let Some(x) = n.as_f64() {
                out.push((path.to_ascii_lowercase(), x));
            }
        }
        Value::Object(map) => {
            for (k, item) in map {
                let p = if path.is_empty() {
                    k.clone()
                } else {
                    format!("{path}.{k}")
                };
                flatten(item, p, out);
            }
        }
        Value::Array(items) => {
            for (i, item) in items.iter().enumerate() {
                flatten(item, format!("{path}.{i}"), out);
            }
        }
        _ => {}
    }
}

// ---------------------------------------------------------------------------------------------
// Named tools

/// Tools the answer names as its source must exist and must have been called.
fn check_tools(answer: &str, sources: &Sources) -> Vec<String> {
    let mut out = Vec::new();
    for sentence in sentences(answer) {
        if hedged(sentence) {
            continue;
        }
        let words: Vec<&str> = sentence
            .split(|c: char| !(c.is_alphanumeric() || c == '_'))
            .filter(|w| !w.is_empty())
            .collect();
        for (i, w) in words.iter().enumerate() {
            let snake = w.contains('_')
                && w.chars().next().is_some_and(|c| c.is_ascii_lowercase())
                && w.chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
            if !snake || sources.called.contains(*w) {
                continue;
            }
            let near = |j: Option<usize>| {
                j.and_then(|j| words.get(j)).is_some_and(|n| {
                    matches!(
                        n.to_ascii_lowercase().as_str(),
                        "tool" | "tools" | "function"
                    )
                })
            };
            let named_as_tool = near(i.checked_sub(1)) || near(Some(i + 1));
            let item = if sources.known.contains(*w) {
                format!("tool `{w}` (not called in this run)")
            } else if named_as_tool {
                format!("tool `{w}` (no such tool)")
            } else {
                continue;
            };
            if !out.contains(&item) {
                out.push(item);
            }
        }
    }
    out
}

// ---------------------------------------------------------------------------------------------
// Laterality

/// Sentences, split at `.`/`!`/`?`/`;` followed by a space or the end, and at line breaks.
pub(crate) fn sentences(text: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut start = 0;
    let bytes = text.as_bytes();
    for (i, c) in text.char_indices() {
        let end = match c {
            '\n' => true,
            '.' | '!' | '?' | ';' => bytes.get(i + 1).is_none_or(|b| b.is_ascii_whitespace()),
            _ => false,
        };
        if end {
            let s = text[start..=i].trim();
            if !s.is_empty() {
                out.push(s);
            }
            start = i + 1;
        }
    }
    let s = text[start..].trim();
    if !s.is_empty() {
        out.push(s);
    }
    out
}

/// Whether a sentence states something only conditionally or denies it.
fn hedged(sentence: &str) -> bool {
    let l = sentence.to_lowercase();
    let words: Vec<&str> = l
        .split(|c: char| !c.is_alphanumeric() && c != '\'')
        .collect();
    l.contains('?')
        || words.iter().any(|w| {
            matches!(
                *w,
                "not"
                    | "cannot"
                    | "can't"
                    | "unable"
                    | "whether"
                    | "if"
                    | "unknown"
                    | "unclear"
                    | "uncertain"
                    | "could"
                    | "would"
                    | "might"
                    | "unavailable"
                    | "failed"
                    | "recommend"
                    | "suggest"
                    | "no"
            )
        })
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Side {
    Left,
    Right,
}

fn side_of(word: &str) -> Option<Side> {
    match word {
        "left" => Some(Side::Left),
        "right" => Some(Side::Right),
        _ => None,
    }
}

/// +1 for "larger", -1 for "smaller".
fn size_direction(word: &str) -> Option<i8> {
    match word {
        "larger" | "bigger" | "greater" | "largest" | "biggest" => Some(1),
        "smaller" | "lesser" | "smallest" => Some(-1),
        _ => None,
    }
}

fn lower_words(s: &str) -> Vec<String> {
    s.split(|c: char| !c.is_alphanumeric())
        .filter(|w| !w.is_empty())
        .map(str::to_lowercase)
        .collect()
}

/// The side a sentence says is larger, if it says so.
fn size_claim(sentence: &str) -> Option<Side> {
    let words = lower_words(sentence);
    let c = words.iter().position(|w| size_direction(w).is_some())?;
    let dir = size_direction(&words[c])?;
    let than = words[c..].iter().position(|w| w == "than").map(|k| k + c);
    let subject = match than.and_then(|t| words[t..].iter().find_map(|w| side_of(w))) {
        Some(other) => Some(if other == Side::Left {
            Side::Right
        } else {
            Side::Left
        }),
        None => words[..c]
            .iter()
            .rev()
            .find_map(|w| side_of(w))
            .or_else(|| words[c..].iter().find_map(|w| side_of(w))),
    }?;
    Some(match (subject, dir) {
        (s, 1) => s,
        (Side::Left, _) => Side::Right,
        (Side::Right, _) => Side::Left,
    })
}

/// The first number after `left` and after `right` in a text (each before the other side's
/// word), when both are there and `keep` accepts their unit.
fn cited_pair(text: &str, keep: impl Fn(Unit) -> bool) -> Option<(Num, Num)> {
    let lower = text.to_lowercase();
    // Byte positions line up: lowercasing `left`/`right` and ASCII digits keeps lengths.
    if lower.len() != text.len() {
        return None;
    }
    let nums: Vec<Num> = scan_numbers(text)
        .into_iter()
        .filter(|n| !n.small_count)
        .collect();
    let mut marks: Vec<(usize, Side)> = Vec::new();
    for (word, side) in [("left", Side::Left), ("right", Side::Right)] {
        for (p, _) in lower.match_indices(word) {
            let before = lower[..p].chars().next_back();
            let after = lower[p + word.len()..].chars().next();
            if !before.is_some_and(char::is_alphanumeric)
                && !after.is_some_and(char::is_alphanumeric)
            {
                marks.push((p, side));
            }
        }
    }
    marks.sort_by_key(|m| m.0);
    let mut found: [Option<Num>; 2] = [None, None];
    for (k, &(p, side)) in marks.iter().enumerate() {
        let limit = marks.get(k + 1).map_or(text.len(), |m| m.0).min(p + 60);
        let slot = &mut found[side as usize];
        if slot.is_none() {
            // The first number after the side word is that side's; a later one belongs to
            // something else (taking it paired "right 1,359,601 vs 865 px" as 865 and 865).
            *slot = nums
                .iter()
                .find(|n| n.start > p && n.start < limit)
                .and_then(|n| with_shared_unit(&lower, &nums, n))
                .filter(|n| keep(n.unit));
        }
    }
    let [Some(l), Some(r)] = found else {
        return None;
    };
    Some((l, r))
}

/// `1,359,601 vs 865 px`: a unit written once after two numbers is the first one's too.
fn with_shared_unit(lower: &str, nums: &[Num], n: &Num) -> Option<Num> {
    if n.unit != Unit::None {
        return Some(n.clone());
    }
    let Some(next) = nums.iter().find(|m| m.start > n.start) else {
        return Some(n.clone());
    };
    let between = lower
        .get(n.start + n.text.len()..next.start)
        .unwrap_or("")
        .trim();
    if matches!(between, "vs" | "vs." | "versus" | "and" | "against") {
        return Some(Num {
            unit: next.unit,
            ..n.clone()
        });
    }
    Some(n.clone())
}

fn side_name(s: Side) -> &'static str {
    match s {
        Side::Left => "left",
        Side::Right => "right",
    }
}

/// A claim that one lung is larger must agree with the values the answer cites and with the
/// left/right areas the results hold; with neither, nothing supports it.
fn check_laterality(answer: &str, sources: &Sources, pool: &SourcePool) -> Vec<String> {
    let mut claims: Vec<(String, Side)> = sentences(answer)
        .into_iter()
        .filter(|s| !hedged(s))
        .filter_map(|s| size_claim(s).map(|side| (s.to_string(), side)))
        .collect();
    if claims.is_empty() {
        // "Which lung is larger? ... Answer 'left' or 'right'": a bare side word first.
        let q = lower_words(&sources.question);
        let dir = (q.iter().any(|w| w == "left") && q.iter().any(|w| w == "right"))
            .then(|| q.iter().find_map(|w| size_direction(w)))
            .flatten();
        if let (Some(dir), Some(first)) = (dir, sentences(answer).first()) {
            let words = lower_words(first);
            if words.len() <= 6 && !hedged(first) {
                if let Some(side) = words.iter().find_map(|w| side_of(w)) {
                    let side = if dir > 0 {
                        side
                    } else if side == Side::Left {
                        Side::Right
                    } else {
                        Side::Left
                    };
                    claims.push((first.to_string(), side));
                }
            }
        }
    }
    let mut out = Vec::new();
    let cited = cited_pair(answer, |u| u != Unit::Percent);
    for (sentence, larger) in claims {
        let says = format!(
            "\"{sentence}\" (says the {} lung is larger",
            side_name(larger)
        );
        let agrees = |l: f64, r: f64| match larger {
            Side::Left => l >= r,
            Side::Right => r >= l,
        };
        if let Some((l, r)) = cited.as_ref().filter(|(l, r)| l.unit == r.unit) {
            if !agrees(l.value, r.value) {
                out.push(format!(
                    "{says}, but cites left {} and right {})",
                    l.text, r.text
                ));
                continue;
            }
        }
        if !pool.area_pairs.is_empty() {
            if !pool.area_pairs.iter().any(|&(l, r, _)| agrees(l, r)) {
                let (l, r, u) = pool.area_pairs[0];
                let unit = match u {
                    Unit::Cm2 => " cm²",
                    Unit::Mm2 => " mm²",
                    Unit::Px => " px",
                    _ => "",
                };
                out.push(format!(
                    "{says}, but the tool results give left {l}{unit} and right {r}{unit})"
                ));
            }
        } else if cited.is_none() {
            out.push(format!(
                "{says}, but no tool result compares the left and right lung areas)"
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// Sources as a lung segmentation with a known spacing gives them.
    fn lungs(spacing: Option<(f64, f64)>) -> Sources {
        let mut s = Sources::new("Which lung has the larger area, the patient's left or right? Answer 'left' or 'right' and give both areas.");
        s.add_known("segment_lungs");
        s.add_known("image_info");
        s.add_called("segment_lungs");
        let mut data = json!({
            "image": "img_3fa2c1",
            "width": 2048, "height": 2500,
            "lung_fraction": 0.3312,
            "right_lung": {"area_px": 32456, "height_px": 300, "width_px": 120},
            "left_lung": {"area_px": 43042, "height_px": 310, "width_px": 130},
            "left_right_area_ratio": 1.33,
            "pixel_spacing_mm": spacing,
        });
        if spacing.is_none() {
            data["note"] = json!("pixel spacing unknown: areas in pixels only");
        }
        s.add_data(data);
        s.add_text("img_3fa2c1: 2 lung field(s); right 32456 px, left 43042 px, left/right area ratio 1.33");
        s
    }

    #[test]
    fn numbers_are_found_with_rounding_and_separators() {
        let s = lungs(None);
        for answer in [
            "Left: 43,042 px; right: 32,456 px. The left lung is larger.",
            "The left lung is larger (about 43k px against 32k px).",
            "The left lung is larger: 43,000 versus 32,000 pixels.",
            "Left is larger; the left/right ratio is 1.3.",
            "The image is 2048x2500 px; the left lung is larger.",
        ] {
            assert_eq!(check(answer, &s), Vec::<String>::new(), "{answer}");
        }
        // One digit more than the source supports, or a value off by more than the last digit.
        let bad = check(
            "The left lung is larger: 43,142 px and 32,456 px; ratio 1.4.",
            &s,
        );
        assert_eq!(bad.len(), 2, "{bad:?}");
        assert!(bad[0].starts_with("43,142 px"), "{bad:?}");
        assert!(bad[1].starts_with("1.4"), "{bad:?}");
    }

    #[test]
    fn pixel_areas_convert_to_square_centimetres_with_the_spacing() {
        // 43042 px x 0.2 x 0.2 mm² = 1721.68 mm² = 17.2168 cm²; 32456 px -> 12.98 cm².
        let s = lungs(Some((0.2, 0.2)));
        let ok = "The left lung is larger: 17.2 cm² against 13.0 cm² (1721.7 mm² and 1298 mm²).";
        assert_eq!(check(ok, &s), Vec::<String>::new());
        assert_eq!(
            check("Left lung 17.22 square centimetres.", &s),
            Vec::<String>::new()
        );
        // The same numbers without a spacing cannot be cm²: nothing converts them.
        let s = lungs(None);
        let bad = check("Left lung: 17.2 cm², right lung: 13.0 cm².", &s);
        assert_eq!(bad.len(), 2, "{bad:?}");
        // A spacing given only in words (a summary) converts as well.
        let mut s = lungs(None);
        s.add_text("img_3fa2c1: 2048x2500 px, spacing 0.2x0.2 mm/px");
        assert_eq!(
            check("The left lung covers 17.2 cm².", &s),
            Vec::<String>::new()
        );
    }

    #[test]
    fn percentages_match_ratios_and_back() {
        let mut s = lungs(None);
        s.add_data(json!({"findings": [{"label": "Effusion", "probability": 0.127}]}));
        s.add_text("heart occupies 48% of the thorax width");
        for answer in [
            "The lungs cover 33% of the image.",
            "The lungs cover 33.1 % of the image; effusion probability 12.7%.",
            "Effusion probability 0.13; the heart is 0.48 of the thorax width.",
        ] {
            assert_eq!(check(answer, &s), Vec::<String>::new(), "{answer}");
        }
        assert_eq!(check("The lungs cover 45% of the image.", &s).len(), 1);
    }

    /// Seen live: the 0.5B model copied the tool's summary but wrote "left" for "right".
    #[test]
    fn a_summary_quoted_with_the_side_flipped_is_caught() {
        let mut s = Sources::new(
            "Which lung field has the larger area: the patient's left or the patient's right?",
        );
        s.add_known("segment_lungs");
        s.add_called("segment_lungs");
        s.add_data(json!({
            "right_lung": {"area_px": 1359601, "height_px": 1418, "width_px": 1689},
            "left_lung": {"area_px": 865, "height_px": 40, "width_px": 34},
            "left_right_area_ratio": 0.0,
            "lung_fraction": 0.3401,
        }));
        s.add_text("img_35b3: the patient's right lung is larger: 1,359,601 vs 865 px, +157079.3%; 2 lung field(s); patient's right 1,359,601 px, left 865 px, left/right area ratio 0; lungs cover 34.0% of the image");
        let flipped = check(
            "According to the segment_lungs result: the patient's left lung is larger: 1,359,601 vs 865 px, +157079.3%; 2 lung field(s); patient's right 1,359,601 px, left 865 px, left/right area ratio 0; lungs cover 34.0% of the image",
            &s,
        );
        assert!(
            flipped
                .iter()
                .any(|u| u.contains("says the left lung is larger")),
            "{flipped:?}"
        );
        let faithful = check(
            "According to the segment_lungs result: the patient's right lung is larger: 1,359,601 vs 865 px, +157079.3%; patient's right 1,359,601 px, left 865 px.",
            &s,
        );
        assert_eq!(faithful, Vec::<String>::new());
    }

    #[test]
    fn a_wrong_laterality_claim_is_caught() {
        let s = lungs(None);
        // The numbers are right, the sides are swapped: the results say left 43042 > right 32456.
        let swapped = check(
            "The right lung is larger: right 43,042 px, left 32,456 px.",
            &s,
        );
        assert_eq!(swapped.len(), 1, "{swapped:?}");
        assert!(swapped[0].contains("right lung is larger"), "{swapped:?}");
        assert!(swapped[0].contains("left 43042"), "{swapped:?}");
        // A claim contradicting its own cited values.
        let own = check(
            "Left lung: 32,456 px, right lung: 43,042 px, so the left lung is bigger.",
            &lungs(None),
        );
        assert!(
            own.iter().any(|u| u.contains("but cites left 32,456 px")),
            "{own:?}"
        );
        // "smaller" read the other way round, and a bare "Right." to a left-or-right question.
        assert_eq!(
            check("The left lung is smaller than the right.", &s).len(),
            1
        );
        assert_eq!(
            check("The right lung is smaller than the left.", &s),
            Vec::<String>::new()
        );
        assert_eq!(
            check("Right. Left 43,042 px, right 32,456 px.", &s).len(),
            1
        );
        assert_eq!(
            check("Left. Left 43,042 px, right 32,456 px.", &s),
            Vec::<String>::new()
        );
        // A claim with nothing behind it at all.
        let q = Sources::new("Which lung is larger, left or right?");
        let none = check("The left lung is larger.", &q);
        assert!(none[0].contains("no tool result compares"), "{none:?}");
    }

    #[test]
    fn invented_numbers_and_tools_without_results_are_listed() {
        let mut q = Sources::new("Which lung has the larger area on this radiograph, the patient's left or the patient's right? Answer 'left' or 'right' and give both areas.");
        q.add_known("segment_lungs");
        let answer = "Left lung: 21.5 cm², Right lung: 38.6 cm². The right lung is larger, as confirmed by the tool `lung_area`.";
        let bad = check(answer, &q);
        assert!(bad.iter().any(|u| u.starts_with("21.5 cm²")), "{bad:?}");
        assert!(bad.iter().any(|u| u.starts_with("38.6 cm²")), "{bad:?}");
        assert!(
            bad.iter().any(|u| u == "tool `lung_area` (no such tool)"),
            "{bad:?}"
        );
        // A known tool named as the source but never called.
        let bad = check("The segment_lungs tool found clear lungs.", &q);
        assert_eq!(
            bad,
            vec!["tool `segment_lungs` (not called in this run)".to_string()]
        );
    }

    #[test]
    fn an_honest_answer_without_measurements_passes() {
        let mut q = Sources::new("Which lung is larger, left or right? Give both areas.");
        q.add_known("segment_lungs");
        q.add_called("segment_lungs");
        for answer in [
            "No lung-area measurement is available: segment_lungs failed (model not installed), so I cannot say whether the left or the right lung is larger.",
            "I could not measure the lungs. Run `hilum models fetch lung-unet` and ask again.",
            "1. The image id is img_3fa2c1.\n2. See call_1 and DenseNet-121 for details.",
        ] {
            assert_eq!(check(answer, &q), Vec::<String>::new(), "{answer}");
        }
    }

    #[test]
    fn identifiers_ordinals_and_dimensions_are_read_right() {
        let nums = scan_numbers(
            "img_3fa2c1 at 2048x2500, the 3rd rib, -4.5 mm, 12,345,678 px, 0.5-0.75, T4",
        );
        let got: Vec<(f64, Unit)> = nums.iter().map(|n| (n.value, n.unit)).collect();
        assert_eq!(
            got,
            vec![
                (2048.0, Unit::None),
                (2500.0, Unit::None),
                (-4.5, Unit::Mm),
                (12_345_678.0, Unit::Px),
                (0.5, Unit::None),
                (0.75, Unit::None)
            ]
        );
    }
}
