//! The project's benchmark (tests/fixtures/cxr_bench) run with scripted answers through the real
//! agent and the real image tools on ../shared/data: the accuracy, per category, is known
//! exactly from the script, under the MedRAX cascade and under --strict.

use crate::common;

use std::collections::BTreeMap;
use std::sync::Arc;

use hilum_agent::Llm;
use hilum_eval::runner::LlmFor;
use hilum_eval::{run_eval, summarize, write_reports, Question, Status};
use hilum_imaging::ImageStore;
use hilum_llm::script::ScriptTurn;
use hilum_llm::ScriptLlm;
use serde_json::json;

/// The question that gets a failing model.
const FAILING: usize = 5;

/// Question `i` (file order): the right letter in a sentence (i % 4 = 0), alone (1), a wrong
/// letter (2), or no letter at all (3); each after a real image_info call.
fn answer_text(i: usize, right: char) -> String {
    let wrong = (b'A' + ((right as u8 - b'A' + 1) % 6)) as char;
    match i % 4 {
        0 => format!("The answer is {right}, from the tool result."),
        1 => right.to_string(),
        2 => format!("{wrong}) per the tool result"),
        _ => "I cannot tell from these results.".into(),
    }
}

fn scripts() -> BTreeMap<String, Vec<ScriptTurn>> {
    common::bench_lines()
        .iter()
        .enumerate()
        .map(|(i, l)| {
            let right = l["answer"]
                .as_str()
                .and_then(|a| a.chars().next())
                .expect("letter");
            let turns = if i == FAILING {
                json!([{"error": "the scripted model failed"}])
            } else {
                json!([
                    {"tool_calls": [{"name": "image_info", "arguments": {"image": "$IMAGE"}}]},
                    {"content": answer_text(i, right)}
                ])
            };
            let id = l["question_id"].as_str().expect("id").to_string();
            (id, serde_json::from_value(turns).expect("turns"))
        })
        .collect()
}

fn llm_for(map: BTreeMap<String, Vec<ScriptTurn>>) -> LlmFor {
    let map = Arc::new(map);
    Arc::new(move |q: &Question| {
        let turns = map.get(&q.id).cloned().ok_or("no script")?;
        Ok(Arc::new(ScriptLlm::new(turns)) as Arc<dyn Llm>)
    })
}

/// (correct, n) per category, computed from the file and the script's rule alone.
fn oracle(strict: bool) -> BTreeMap<String, (usize, usize)> {
    let mut m: BTreeMap<String, (usize, usize)> = BTreeMap::new();
    for (i, l) in common::bench_lines().iter().enumerate() {
        let right = i != FAILING && (i % 4 == 1 || (!strict && i % 4 == 0));
        for c in l["categories"].as_str().expect("categories").split(',') {
            let e = m.entry(c.trim().to_string()).or_default();
            e.0 += right as usize;
            e.1 += 1;
        }
    }
    m
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn project_benchmark_scores_exactly_per_category() {
    let lines = common::bench_lines();
    assert_eq!(lines.len(), 60, "the project benchmark has 60 questions");
    for strict in [false, true] {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Arc::new(ImageStore::default());
        let mut cfg = common::config(
            common::cxr_bench(),
            common::data_dir(),
            dir.path().join("run"),
        );
        cfg.strict = strict;
        cfg.jobs = 3;
        let started = std::time::Instant::now();
        let run = run_eval(
            cfg,
            store.clone(),
            llm_for(scripts()),
            common::tools(&store),
            common::quiet(),
        )
        .await
        .expect("the run finishes");
        eprintln!(
            "60 questions (strict={strict}) in {:.2} s",
            started.elapsed().as_secs_f64()
        );
        let s = summarize(&run);
        // 15 questions each of i % 4 = 0, 1, 2, 3; one of the i % 4 = 1 fails.
        let (correct, unparsed) = if strict { (14, 45) } else { (29, 15) };
        assert_eq!(
            (s.overall.correct, s.overall.n),
            (correct, 60),
            "strict={strict}"
        );
        assert_eq!(
            (s.unparsed, s.errors, s.timeouts, s.not_run),
            (unparsed, 1, 0, 0)
        );
        let got: BTreeMap<String, (usize, usize)> = s
            .categories
            .iter()
            .map(|(c, a)| (c.clone(), (a.correct, a.n)))
            .collect();
        assert_eq!(got, oracle(strict), "per-category counts, strict={strict}");
        // Every answered question ran one real image_info call on its image.
        let failing_id = lines[FAILING]["question_id"].as_str().expect("id");
        for r in &run.records {
            if r.id == failing_id {
                assert_eq!(r.status, Status::Error);
                assert!(r
                    .error
                    .as_deref()
                    .unwrap_or("")
                    .contains("scripted model failed"));
                continue;
            }
            assert_eq!(r.tool_calls.len(), 1, "{}", r.id);
            assert!(r.tool_calls[0].ok, "{}: {:?}", r.id, r.tool_calls[0].error);
            assert_eq!(r.tool_calls[0].name, "image_info");
        }
        let (report, paths) = write_reports(&run).expect("reports");
        assert_eq!(report.summary.overall.correct, correct);
        let md = std::fs::read_to_string(&paths[0]).expect("report.md");
        assert!(md.contains(&format!("({correct}/60)")), "{md}");
        let json: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&paths[1]).expect("report.json")).expect("json");
        assert_eq!(json["summary"]["overall"]["correct"], correct);
        let png = image::open(&paths[2]).expect("report.png decodes");
        assert_eq!((png.width(), png.height()), (1200, 520));
    }
}

/// The letter step: an answer in words is followed by one question about which option it
/// matches, in the same conversation, and that reply is scored; an answer that names its option
/// is scored as written, and with the step off a worded answer stays unparsed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worded_answer_gets_one_letter_question() {
    let lines = common::bench_lines();
    let id = |i: usize| lines[i]["question_id"].as_str().expect("id").to_string();
    let letter = |i: usize| lines[i]["answer"].as_str().expect("answer").to_string();
    let call = json!({"tool_calls": [{"name": "image_info", "arguments": {"image": "$IMAGE"}}]});
    let mut map = BTreeMap::new();
    // Worded answer that repeats no option, then the letter; the reply is the right letter.
    map.insert(
        id(0),
        serde_json::from_value(
            json!([call, {"content": "The left one is larger."}, {"content": letter(0)}]),
        )
        .expect("turns"),
    );
    // Worded answer that repeats the right option's text: read without a letter step.
    let question = lines[2]["question"].as_str().expect("question");
    let right_text = hilum_eval::option_texts(question)
        .into_iter()
        .find(|(l, _)| l.to_string() == letter(2))
        .map(|(_, t)| t)
        .expect("the answer is an option");
    map.insert(
        id(2),
        serde_json::from_value(
            json!([call, {"content": format!("It is {right_text}, by the tool's numbers.")}]),
        )
        .expect("turns"),
    );
    // Names its option: no step (a step would find the script empty and change nothing).
    map.insert(
        id(1),
        serde_json::from_value(
            json!([call, {"content": format!("{}) per the tool result", letter(1))}]),
        )
        .expect("turns"),
    );
    for step in [true, false] {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Arc::new(ImageStore::default());
        let mut cfg = common::config(
            common::cxr_bench(),
            common::data_dir(),
            dir.path().join("run"),
        );
        cfg.limit = Some(3);
        cfg.letter_step = step;
        // The scripted words cite no tool result: the grounding revision would take a turn.
        cfg.agent.grounding = false;
        let run = run_eval(
            cfg,
            store.clone(),
            llm_for(map.clone()),
            common::tools(&store),
            common::quiet(),
        )
        .await
        .expect("the run finishes");
        assert_eq!(run.header.letter_step, step);
        let first = &run.records[0];
        let second = &run.records[1];
        assert_eq!(second.extracted.as_deref(), Some(letter(1).as_str()));
        // Image intake is timed apart from the evaluation's own overhead.
        for r in [first, second] {
            assert!(r.ingest_ms > 0.0, "{}", r.id);
            assert!(
                r.ingest_ms + r.overhead_ms <= r.latency_ms + 1e-6,
                "{}",
                r.id
            );
        }
        assert!(second.correct && second.letter_reply.is_none());
        let third = &run.records[2];
        assert_eq!(third.letter_reply, None);
        if step {
            assert_eq!(third.extracted.as_deref(), Some(letter(2).as_str()));
            assert_eq!(third.option_in_answer.as_deref(), Some(right_text.as_str()));
            assert!(third.correct);
        } else {
            assert_eq!(third.option_in_answer, None);
        }
        if step {
            assert_eq!(first.letter_reply.as_deref(), Some(letter(0).as_str()));
            assert_eq!(first.extracted.as_deref(), Some(letter(0).as_str()));
            assert!(first.correct);
        } else {
            assert_eq!(first.letter_reply, None);
            assert_eq!(first.extracted, None);
            assert!(!first.correct);
        }
    }
}
