//! Taking the answer out of a response, the way MedRAX scored ChestAgentBench: a lone letter;
//! else a letter opening the text followed by `)`, `.` or a space (`^([A-F])[).\s]`); else the
//! first standalone A–F; else the first A–F anywhere. `strict` accepts only the lone letter.

use crate::bench::{AnswerKind, Question};

fn is_option(c: char) -> bool {
    matches!(c, 'A'..='F')
}

fn is_word(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// The letter MedRAX's cascade would read from `response`, or `None`.
pub fn extract_letter(response: &str, strict: bool) -> Option<char> {
    let t = response.trim();
    match named_letter(t, strict) {
        Named::Letter(c) => Some(c),
        Named::Nothing => None,
        // 4. The first A–F anywhere.
        Named::Unnamed => t.chars().find(|&c| is_option(c)),
    }
}

/// What the cascade's first three rules read.
enum Named {
    Letter(char),
    /// The answer is one character and not an option: nothing else could be meant.
    Nothing,
    /// No rule up to 3 applies: only rule 4 (any capital A–F, e.g. the `A` of "According") would.
    Unnamed,
}

/// Whether the answer names its option by a rule other than rule 4 (a lone letter, a leading
/// `B)`, a standalone letter).
pub fn names_an_option(response: &str) -> bool {
    !matches!(named_letter(response.trim(), false), Named::Unnamed)
}

fn named_letter(t: &str, strict: bool) -> Named {
    let mut chars = t.chars();
    // 1. The whole answer is one letter (either case: nothing else could be meant).
    if let (Some(c), None) = (chars.next(), chars.next()) {
        let c = c.to_ascii_uppercase();
        return if is_option(c) {
            Named::Letter(c)
        } else {
            Named::Nothing
        };
    }
    if strict {
        return Named::Nothing;
    }
    // 2. `^([A-F])[).\s]`
    let mut chars = t.chars();
    if let (Some(c), Some(next)) = (chars.next(), chars.next()) {
        if is_option(c) && (next == ')' || next == '.' || next.is_whitespace()) {
            return Named::Letter(c);
        }
    }
    // 3. The first standalone A–F (`\b[A-F]\b`).
    let v: Vec<char> = t.chars().collect();
    for (i, &c) in v.iter().enumerate() {
        let before = i == 0 || !is_word(v[i - 1]);
        let after = i + 1 == v.len() || !is_word(v[i + 1]);
        if is_option(c) && before && after {
            return Named::Letter(c);
        }
    }
    Named::Unnamed
}

/// The first number in the text (`1,024` reads as 1024).
pub fn extract_number(response: &str) -> Option<f64> {
    let v: Vec<char> = response.chars().collect();
    let mut i = 0;
    while i < v.len() {
        let neg = v[i] == '-' && v.get(i + 1).is_some_and(|c| c.is_ascii_digit());
        if v[i].is_ascii_digit() || neg {
            let mut s = String::new();
            if neg {
                s.push('-');
                i += 1;
            }
            while i < v.len() {
                let c = v[i];
                let grouping = c == ',' && v.get(i + 1).is_some_and(|d| d.is_ascii_digit());
                if c.is_ascii_digit()
                    || (c == '.' && v.get(i + 1).is_some_and(|d| d.is_ascii_digit()))
                {
                    s.push(c);
                } else if !grouping {
                    break;
                }
                i += 1;
            }
            return s.parse().ok();
        }
        i += 1;
    }
    None
}

fn words(s: &str) -> Vec<String> {
    s.split(|c: char| !c.is_alphanumeric() && c != '.' && c != '-')
        .map(|w| w.trim_matches(['.', '-']).to_lowercase())
        .filter(|w| !w.is_empty())
        .collect()
}

/// What was read from the response and whether it is right.
pub fn score_response(q: &Question, response: &str, strict: bool) -> (Option<String>, bool) {
    match q.kind {
        AnswerKind::Choice => {
            let got = extract_letter(response, strict).map(|c| c.to_string());
            let right = got.as_deref() == Some(q.answer.as_str());
            (got, right)
        }
        AnswerKind::Number => {
            let got = extract_number(response);
            let expected: Option<f64> = q.answer.parse().ok();
            let right = match (got, expected) {
                (Some(g), Some(e)) => (g - e).abs() <= q.tolerance + 1e-9 * e.abs().max(1.0),
                _ => false,
            };
            (got.map(|g| g.to_string()), right)
        }
        AnswerKind::Text => {
            let want = words(&q.answer);
            let have = words(response);
            let right = !want.is_empty() && have.windows(want.len()).any(|w| w == want.as_slice());
            (right.then(|| q.answer.clone()), right)
        }
    }
}

/// The options of a question written inline as `A) … B) …` (up to F), in order; empty when the
/// question has no `A) `. Each option runs to the next letter's `X) ` after it.
pub fn option_texts(question: &str) -> Vec<(char, String)> {
    let mut starts = Vec::new();
    let mut from = 0;
    for letter in ['A', 'B', 'C', 'D', 'E', 'F'] {
        let mark = format!("{letter}) ");
        // A letter's mark opens the text or follows white space.
        let found = question[from..]
            .match_indices(&mark)
            .map(|(i, _)| from + i)
            .find(|&i| i == 0 || question[..i].ends_with(char::is_whitespace));
        match found {
            Some(i) => {
                starts.push((letter, i));
                from = i + mark.len();
            }
            None => break,
        }
    }
    starts
        .iter()
        .enumerate()
        .map(|(k, &(letter, i))| {
            let end = starts.get(k + 1).map_or(question.len(), |&(_, j)| j);
            (letter, question[i + 3..end].trim().to_string())
        })
        .collect()
}

/// The letter of the only option whose text the answer contains (whole words, case ignored,
/// a leading "The" and a final period left out): "the patient's left lung is larger: …" names
/// "The patient's left lung". `None` when no option or several do.
pub fn option_in_answer(answer: &str, options: &[(char, String)]) -> Option<char> {
    let hay = format!(" {} ", words(answer).join(" "));
    let mut hits = options.iter().filter(|(_, o)| {
        let mut w = words(o);
        if w.first().is_some_and(|f| f == "the") {
            w.remove(0);
        }
        !w.is_empty() && hay.contains(&format!(" {} ", w.join(" ")))
    });
    match (hits.next(), hits.next()) {
        (Some((l, _)), None) => Some(*l),
        _ => None,
    }
}

/// The percentages a text states as amounts: `44.5%` counts, a signed difference such as
/// `+10.9%` does not.
fn percentages(text: &str) -> Vec<f64> {
    let b = text.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        if b[i].is_ascii_digit() && (i == 0 || !(b[i - 1].is_ascii_digit() || b[i - 1] == b'.')) {
            let start = i;
            while i < b.len() && (b[i].is_ascii_digit() || b[i] == b'.' || b[i] == b',') {
                i += 1;
            }
            let signed = start > 0 && matches!(b[start - 1], b'+' | b'-');
            let digits = text[start..i].trim_end_matches(['.', ',']).replace(',', "");
            if !signed && text[i..].trim_start().starts_with('%') {
                if let Ok(v) = digits.parse::<f64>() {
                    out.push(v);
                }
            }
        } else {
            i += 1;
        }
    }
    out
}

/// The range of percentages an option states: "10% to 20% of the image", "Less than 10%",
/// "More than 50%" (ends included); `None` for any other option.
fn percent_range(option: &str) -> Option<(f64, f64)> {
    let lower = option.to_lowercase();
    match percentages(&lower).as_slice() {
        [a, b] if lower.contains(" to ") || lower.contains('-') => Some((a.min(*b), a.max(*b))),
        [x] if lower.starts_with("less than") || lower.starts_with("under") => {
            Some((f64::NEG_INFINITY, *x))
        }
        [x] if ["more than", "greater than", "over", "above"]
            .iter()
            .any(|p| lower.starts_with(p)) =>
        {
            Some((*x, f64::INFINITY))
        }
        _ => None,
    }
}

/// The letter of the only range option holding the percentages `said` states (the answer's
/// clause about the question, [`relevant_clause`]): "lungs cover 44.5% of the image" reads as
/// "40% to 50% of the image". `None` when it states no percentage, or its percentages fall in
/// no option, in several, or on a boundary two options share.
pub fn option_by_number(said: &str, options: &[(char, String)]) -> Option<char> {
    let ranges: Vec<(char, (f64, f64))> = options
        .iter()
        .filter_map(|(l, o)| percent_range(o).map(|r| (*l, r)))
        .collect();
    if ranges.is_empty() {
        return None;
    }
    let mut found = None;
    for v in percentages(said) {
        let mut holding = ranges.iter().filter(|(_, (lo, hi))| *lo <= v && v <= *hi);
        match (holding.next(), holding.next(), found) {
            (Some((l, _)), None, None) => found = Some(*l),
            (Some((l, _)), None, Some(f)) if f == *l => {}
            _ => return None,
        }
    }
    found
}

/// The clause of an answer (split at `;` and line ends) that shares the most content words with
/// the question (its options left out), when it shares at least two; else the answer's first 300
/// characters. A small model quotes a whole tool summary; the letter step restates the part of
/// it the question is about ("lungs cover 38.6% of the image", not the lung comparison first).
pub fn relevant_clause(answer: &str, question: &str) -> String {
    const SMALL: [&str; 12] = [
        "the", "this", "that", "what", "which", "how", "are", "does", "and", "about", "with",
        "from",
    ];
    let stems = |t: &str| -> Vec<String> {
        let mut v: Vec<String> = words(t)
            .into_iter()
            .flat_map(|w| w.split('_').map(str::to_string).collect::<Vec<_>>())
            .map(|w| match w.strip_suffix('s') {
                Some(stem) if stem.len() >= 3 => stem.to_string(),
                _ => w,
            })
            .filter(|w| w.len() >= 3 && !SMALL.contains(&w.as_str()))
            .collect();
        v.sort();
        v.dedup();
        v
    };
    let asked = stems(question.find("A) ").map_or(question, |i| &question[..i]));
    let best = answer
        .split([';', '\n'])
        .map(str::trim)
        .filter(|c| !c.is_empty())
        .map(|c| (stems(c).iter().filter(|w| asked.contains(w)).count(), c))
        .fold(None::<(usize, &str)>, |best, (n, c)| match best {
            Some((b, _)) if b >= n => best,
            _ => Some((n, c)),
        });
    match best {
        Some((n, c)) if n >= 2 => c.to_string(),
        _ => answer.chars().take(300).collect(),
    }
}

/// The letter of the option a reply repeats (case and a leading `X) ` ignored), if exactly one.
pub fn option_named_by_text(reply: &str, options: &[(char, String)]) -> Option<char> {
    let mut t = reply.trim();
    if options
        .iter()
        .any(|(l, _)| t.starts_with(&format!("{l}) ")))
    {
        t = t[3..].trim();
    }
    let t = t.trim_end_matches('.').to_lowercase();
    let mut hits = options.iter().filter(|(_, o)| o.to_lowercase() == t);
    match (hits.next(), hits.next()) {
        (Some((l, _)), None) => Some(*l),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cascade_order() {
        assert_eq!(extract_letter(" c ", false), Some('C'));
        assert_eq!(extract_letter("B) the left lung", false), Some('B'));
        assert_eq!(extract_letter("D. because", false), Some('D'));
        // Standalone letter wins over the capital that opens the sentence.
        assert_eq!(extract_letter("The answer is E.", false), Some('E'));
        assert_eq!(extract_letter("Answer: (A)", false), Some('A'));
        // Falls through to the first A-F anywhere: the "C" of "Chest" (as MedRAX scores it).
        assert_eq!(extract_letter("Chest looks normal", false), Some('C'));
        assert_eq!(extract_letter("no idea", false), None);
        assert_eq!(extract_letter("", false), None);
        assert_eq!(extract_letter("G", false), None);
    }

    #[test]
    fn an_option_is_named_by_the_first_three_rules_only() {
        assert!(names_an_option("F"));
        assert!(names_an_option("B) the left lung"));
        assert!(names_an_option("The answer is E."));
        // Rule 4 alone: the capital of "According" is not a named option.
        assert!(!names_an_option(
            "According to the tool: the left lung is larger"
        ));
        assert!(!names_an_option("the patient's left lung is larger"));
    }

    #[test]
    fn inline_options_are_split_and_a_repeated_text_names_its_letter() {
        let q = "Which lung is larger? A) The patient's right lung B) Both C) Neither \
                 D) The patient's left lung";
        let o = option_texts(q);
        assert_eq!(o.len(), 4);
        assert_eq!(o[0], ('A', "The patient's right lung".to_string()));
        assert_eq!(o[3], ('D', "The patient's left lung".to_string()));
        assert_eq!(
            option_named_by_text("the patient's left lung.", &o),
            Some('D')
        );
        assert_eq!(
            option_named_by_text("A) The patient's right lung", &o),
            Some('A')
        );
        assert_eq!(option_named_by_text("left", &o), None);
        let said = "According to the segment_lungs result: the patient's left lung is larger: \
                    935,960 vs 844,004 px; patient's right 844,004 px, left 935,960 px";
        assert_eq!(option_in_answer(said, &o), Some('D'));
        // Two options in one answer name neither.
        assert_eq!(
            option_in_answer("the patient's left lung or the patient's right lung", &o),
            None
        );
        assert_eq!(option_in_answer("the left one", &o), None);
        assert!(option_texts("no options here").is_empty());
        assert_eq!(option_texts("pick: A) 8 bits B) 12 bits")[1].1, "12 bits");
    }

    #[test]
    fn the_clause_about_the_question_is_restated() {
        let said = "According to the segment_lungs result: the patient's left lung is larger: \
                    935,960 vs 844,004 px, +10.9%; 2 lung field(s); patient's right 844,004 px; \
                    lungs cover 38.6% of the image";
        let q = "About how much of the image area do the two lung fields cover together? \
                 A) Less than 10% of the image B) 10% to 20% of the image";
        assert_eq!(relevant_clause(said, q), "lungs cover 38.6% of the image");
        // Nothing about the question: the answer's start.
        assert_eq!(
            relevant_clause("8-bit; PNG", "What is the modality?"),
            "8-bit; PNG"
        );
    }

    #[test]
    fn a_percentage_in_the_answer_names_the_range_holding_it() {
        let q = "About how much of the image area do the two lung fields cover together? \
                 A) Less than 10% of the image B) 10% to 20% of the image C) 40% to 50% of the \
                 image D) More than 50% of the image";
        let o = option_texts(q);
        let said = "According to the segment_lungs result: the patient's left lung is larger: \
                    935,960 vs 844,004 px, +10.9%; 2 lung field(s); lungs cover 44.5% of the image";
        // The signed difference (+10.9%) is not an amount; the clause about coverage is read.
        let read = |answer: &str| option_by_number(&relevant_clause(answer, q), &o);
        assert_eq!(read(said), Some('C'));
        assert_eq!(read("they cover 61% of it"), Some('D'));
        assert_eq!(read("about 7.5% of the image"), Some('A'));
        // On a shared boundary, or with no percentage, nothing is read.
        assert_eq!(read("lungs cover 10% of the image"), None);
        assert_eq!(read("the lungs are large"), None);
        // Two amounts in different ranges name neither.
        assert_eq!(read("lungs cover 15% or 45% of the image"), None);
        // Options that are not ranges are never read this way.
        let plain = option_texts("Which? A) 8 bits B) 12 bits");
        assert_eq!(option_by_number("8% of 12 bits", &plain), None);
        assert_eq!(percentages("1,024.5 % and -3% and 2%"), vec![1024.5, 2.0]);
    }

    #[test]
    fn strict_takes_only_a_lone_letter() {
        assert_eq!(extract_letter("b", true), Some('B'));
        assert_eq!(extract_letter("B) left", true), None);
        assert_eq!(extract_letter("The answer is B", true), None);
    }

    #[test]
    fn numbers_and_text() {
        assert_eq!(extract_number("width 1,024 px"), Some(1024.0));
        assert_eq!(extract_number("spacing is 0.168 mm."), Some(0.168));
        assert_eq!(extract_number("-3 dB"), Some(-3.0));
        assert_eq!(extract_number("none"), None);
        let q = |kind, answer: &str, tolerance| Question {
            id: "q".into(),
            case_id: "q".into(),
            question: String::new(),
            answer: answer.into(),
            kind,
            tolerance,
            images: vec![],
            categories: vec![],
            line: 1,
        };
        assert!(score_response(&q(AnswerKind::Number, "1024", 0.0), "It is 1,024 px", false).1);
        assert!(!score_response(&q(AnswerKind::Number, "1024", 1.0), "1026", false).1);
        assert!(score_response(&q(AnswerKind::Number, "1024", 2.0), "1026", false).1);
        let t = q(AnswerKind::Text, "left lung", 0.0);
        assert!(score_response(&t, "The Left lung is larger.", false).1);
        assert!(!score_response(&t, "the left lungs", false).1);
    }
}
