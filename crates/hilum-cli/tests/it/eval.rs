//! `hilum eval` as a process: a run killed mid-way and resumed (against a real OpenAI-protocol
//! server on 127.0.0.1), malformed input, and `hilum eval compare`.

#[path = "../../../hilum-eval/tests/it/common/mod.rs"]
mod common;

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

fn hilum() -> tokio::process::Command {
    let mut c = tokio::process::Command::new(env!("CARGO_BIN_EXE_hilum"));
    // Tests must not pick up a developer's key or config.
    c.env_remove("OPENAI_API_KEY")
        .env_remove("OPENAI_BASE_URL")
        .env_remove("HILUM_LLM")
        .env_remove("HILUM_CONFIG")
        .env("HOME", "/nonexistent-hilum-home")
        .env("HILUM_MODELS_DIR", "/nonexistent-hilum-models");
    c
}

fn records(run: &Path) -> Vec<Value> {
    std::fs::read_to_string(run.join("run.jsonl"))
        .unwrap_or_default()
        .lines()
        .skip(1)
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

fn ids(records: &[Value]) -> Vec<String> {
    records
        .iter()
        .filter_map(|r| r["id"].as_str().map(str::to_string))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_run_resumes_without_asking_finished_questions_again() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (bench, keys) = common::plain_bench(dir.path(), 10);
    let replies = keys
        .iter()
        .map(|(id, key, right)| (id.clone(), key.clone(), format!("{right}")))
        .collect();
    // Slow enough (2 x 150 ms per question) to be killed in the middle.
    let (quiz, url) = common::quiz::start(replies, Duration::from_millis(150)).await;
    let run = dir.path().join("run");
    let args = |c: &mut tokio::process::Command| {
        c.arg("eval")
            .arg(&bench)
            .arg("--images-dir")
            .arg(common::data_dir())
            .args([
                "--llm",
                "openai:quiz-model",
                "--base-url",
                &url,
                "--quiet",
                "--out",
            ])
            .arg(&run);
    };
    let mut first = hilum();
    args(&mut first);
    let mut child = first
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start hilum eval");
    let t0 = Instant::now();
    while records(&run).len() < 3 {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "no progress in run.jsonl"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    child.kill().await.expect("kill hilum eval");
    let before = ids(&records(&run));
    assert!(
        before.len() >= 3 && before.len() < 10,
        "killed after {} questions",
        before.len()
    );
    let mark = quiz.log.lock().expect("lock").len();

    let mut second = hilum();
    args(&mut second);
    let out = second.arg("--resume").output().await.expect("resume");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let after = ids(&records(&run));
    let unique: BTreeSet<&String> = after.iter().collect();
    assert_eq!(
        (after.len(), unique.len()),
        (10, 10),
        "each question once: {after:?}"
    );
    let log = quiz.log.lock().expect("lock").clone();
    for (id, phase, _) in &log[mark..] {
        assert!(
            !before.contains(id),
            "{id} was finished before the kill and asked again ({phase})"
        );
    }
    let answered_after = log[mark..].iter().filter(|(_, p, _)| p == "answer").count();
    assert_eq!(answered_after, 10 - before.len());
    let report = std::fs::read_to_string(run.join("report.md")).expect("report.md");
    assert!(report.contains("**Accuracy 100.0% (10/10)"), "{report}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_input_names_file_and_line_and_keeps_the_run() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (bench, keys) = common::plain_bench(dir.path(), 4);
    let script: serde_json::Map<String, Value> = keys
        .iter()
        .map(|(id, _, right)| (id.clone(), json!([{"content": right.to_string()}])))
        .collect();
    let script_path = dir.path().join("script.json");
    std::fs::write(&script_path, Value::Object(script).to_string()).expect("script");
    let run = dir.path().join("run");
    let eval = |bench: &Path, extra: &[&str]| {
        let mut c = hilum();
        c.arg("eval")
            .arg(bench)
            .arg("--images-dir")
            .arg(common::data_dir())
            .arg("--llm")
            .arg(format!("script:{}", script_path.display()))
            .arg("--quiet")
            .arg("--out")
            .arg(&run)
            .args(extra);
        c
    };
    let out = eval(&bench, &[]).output().await.expect("run");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let kept = std::fs::read(run.join("run.jsonl")).expect("run.jsonl");

    // A broken third line in the question file.
    let bad = dir.path().join("bad.jsonl");
    let text = std::fs::read_to_string(&bench).expect("bench");
    let mut lines: Vec<&str> = text.lines().collect();
    lines[2] = "{\"id\": \"q2\", \"question\": \"cut off";
    std::fs::write(&bad, lines.join("\n")).expect("write");
    let out = eval(&bad, &["--resume"]).output().await.expect("run");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("bad.jsonl:3:") && err.contains("not valid JSON"),
        "{err}"
    );
    assert_eq!(
        std::fs::read(run.join("run.jsonl")).expect("run.jsonl"),
        kept
    );

    // A damaged record in the middle of run.jsonl: named, and the file is left as it was.
    let text = String::from_utf8(kept.clone()).expect("utf8");
    let mut lines: Vec<String> = text.lines().map(str::to_string).collect();
    lines[2] = "{\"record\": \"question\", \"id\": 5".into();
    let damaged = lines.join("\n") + "\n";
    std::fs::write(run.join("run.jsonl"), &damaged).expect("write");
    let out = eval(&bench, &["--resume"]).output().await.expect("run");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("run.jsonl:3:"), "{err}");
    assert_eq!(
        std::fs::read_to_string(run.join("run.jsonl")).expect("run.jsonl"),
        damaged
    );

    // A second run into the same folder without --resume is refused.
    std::fs::write(run.join("run.jsonl"), &kept).expect("restore");
    let out = eval(&bench, &[]).output().await.expect("run");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("--resume"), "{err}");
    assert_eq!(
        std::fs::read(run.join("run.jsonl")).expect("run.jsonl"),
        kept
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compare_reports_mcnemar_exact_p() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (bench, keys) = common::plain_bench(dir.path(), 10);
    // A is right on q0 and q7..q9; B on q1..q9. Discordant: 1 right only in A, 6 only in B.
    // Exact McNemar: P(X <= 1 | n = 7, p = 1/2) = (1 + 7) / 128; two-sided p = 16/128 = 0.125.
    let script = |right_on: &dyn Fn(usize) -> bool| {
        let m: serde_json::Map<String, Value> = keys
            .iter()
            .enumerate()
            .map(|(i, (id, _, right))| {
                let wrong = (b'A' + ((*right as u8 - b'A' + 1) % 6)) as char;
                let letter = if right_on(i) { *right } else { wrong };
                (id.clone(), json!([{"content": format!("{letter}")}]))
            })
            .collect();
        Value::Object(m).to_string()
    };
    let runs = [
        ("a", script(&|i| i == 0 || i >= 7)),
        ("b", script(&|i| i >= 1)),
    ];
    // The scripts answer with a letter and call no tool: the tool policy (which would send a
    // tool-less first answer back once) and the grounding check are turned off for them.
    let config = dir.path().join("config.toml");
    std::fs::write(
        &config,
        "[agent]\nrequire_tools = \"never\"\ngrounding = false\n",
    )
    .expect("config");
    for (name, s) in &runs {
        let path = dir.path().join(format!("{name}.json"));
        std::fs::write(&path, s).expect("script");
        let out = hilum()
            .env("HILUM_CONFIG", &config)
            .arg("eval")
            .arg(&bench)
            .arg("--images-dir")
            .arg(common::data_dir())
            .arg("--llm")
            .arg(format!("script:{}", path.display()))
            .arg("--quiet")
            .arg("--out")
            .arg(dir.path().join(name))
            .output()
            .await
            .expect("run");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let out = hilum()
        .args(["eval", "compare", "--json"])
        .arg(dir.path().join("a"))
        .arg(dir.path().join("b"))
        .output()
        .await
        .expect("compare");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let c: Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(
        (c["a_only"].as_u64(), c["b_only"].as_u64()),
        (Some(1), Some(6))
    );
    assert_eq!(
        (c["a"]["correct"].as_u64(), c["b"]["correct"].as_u64()),
        (Some(4), Some(9))
    );
    assert!(
        (c["p_value"].as_f64().unwrap_or(-1.0) - 0.125).abs() < 1e-12,
        "{c}"
    );
    assert!((c["difference"].as_f64().unwrap_or(0.0) - 0.5).abs() < 1e-12);
    let out = hilum()
        .args(["eval", "compare"])
        .arg(dir.path().join("a"))
        .arg(dir.path().join("b"))
        .output()
        .await
        .expect("compare");
    let md = String::from_utf8_lossy(&out.stdout);
    assert!(
        md.contains("p = 0.1250") && md.contains("| even | 5 |"),
        "{md}"
    );
}
