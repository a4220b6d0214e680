//! Rendering of the event stream: NDJSON for programs, a live view for people.

use std::collections::HashMap;
use std::io::Write;
use std::path::Path;
use std::time::Duration;

use anyhow::Context;
use indicatif::{MultiProgress, ProgressBar, ProgressStyle};
use tokio::sync::mpsc::UnboundedReceiver;

use hilum_agent::{Artifact, Event, RunEvent};
use hilum_imaging::ImageStore;
use hilum_llm::ImagePayload;

/// Writes each event as one JSON line. Returns whether the run completed without error.
pub async fn ndjson(
    mut rx: UnboundedReceiver<RunEvent>,
    out: Option<&Path>,
) -> anyhow::Result<bool> {
    let mut ok = false;
    let stdout = std::io::stdout();
    while let Some(ev) = rx.recv().await {
        if let (
            Some(dir),
            Event::ToolFinished {
                call_id, artifacts, ..
            },
        ) = (out, &ev.event)
        {
            write_artifacts(dir, call_id, artifacts)?;
        }
        if let Event::Complete { ok: done, .. } = &ev.event {
            ok = *done;
        }
        let mut lock = stdout.lock();
        serde_json::to_writer(&mut lock, &ev)?;
        lock.write_all(b"\n")?;
        lock.flush()?;
    }
    Ok(ok)
}

/// Spinners per running tool with elapsed time, then the answer.
pub async fn live(mut rx: UnboundedReceiver<RunEvent>, out: Option<&Path>) -> anyhow::Result<bool> {
    let multi = MultiProgress::new();
    let style = ProgressStyle::with_template("{spinner} {msg} {elapsed_precise}")
        .unwrap_or_else(|_| ProgressStyle::default_spinner());
    let mut bars: HashMap<String, ProgressBar> = HashMap::new();
    let mut ok = false;
    while let Some(ev) = rx.recv().await {
        match ev.event {
            Event::Decision {
                round,
                phase,
                tool_calls,
                llm_ms,
                ..
            } => {
                if !tool_calls.is_empty() {
                    let names: Vec<&str> = tool_calls.iter().map(|c| c.name.as_str()).collect();
                    say(&multi, format!(
                        "round {round} ({phase}, model {llm_ms:.0} ms): {} tool call(s) in parallel: {}",
                        names.len(),
                        names.join(", ")
                    ));
                }
            }
            Event::ToolStarted { call_id, name, .. } => {
                let bar = multi.add(ProgressBar::new_spinner());
                bar.set_style(style.clone());
                bar.set_message(name);
                bar.enable_steady_tick(Duration::from_millis(100));
                bars.insert(call_id, bar);
            }
            Event::ToolFinished {
                call_id,
                name,
                ms,
                summary,
                artifacts,
                ..
            } => {
                let mut line = format!("✓ {name} {ms:.0} ms: {summary}");
                if let Some(dir) = out {
                    for p in write_artifacts(dir, &call_id, &artifacts)? {
                        line.push_str(&format!("\n    wrote {p}"));
                    }
                }
                finish(&multi, bars.remove(&call_id), line);
            }
            Event::ToolFailed {
                call_id,
                name,
                ms,
                kind,
                error,
                ..
            } => finish(
                &multi,
                bars.remove(&call_id),
                format!("✗ {name} {ms:.0} ms ({kind}): {error}"),
            ),
            Event::Final {
                answer,
                reason,
                grounded,
                unsupported,
                unanswered,
                dropped,
                ..
            } => {
                let note = if reason == "answered" {
                    String::new()
                } else {
                    format!(" (stopped by {reason}; answered from the results so far)")
                };
                // The answer goes to stdout, so `hilum analyze … > answer.txt` keeps it.
                let _ = multi.clear();
                println!("\nAnswer{note}:\n{answer}");
                if grounded == Some(false) {
                    println!("\nWARNING: grounded: false: this answer states what no tool result supports:");
                    for u in unsupported {
                        println!("  - {u}");
                    }
                }
                if !unanswered.is_empty() {
                    println!(
                        "\nNOTE: answers_question: false: the model left out {}; Hilum stated it from the tool results.",
                        unanswered.join(", ")
                    );
                }
                if !dropped.is_empty() {
                    println!("\nNOTE: removed from the model's answer (no tool result covers it):");
                    for d in dropped {
                        println!("  - {d}");
                    }
                }
            }
            Event::Error { message } => {
                say(&multi, format!("error: {message}"));
            }
            Event::Complete {
                ok: done,
                rounds,
                tool_calls,
                total_ms,
                llm_ms,
                tool_ms,
                ..
            } => {
                ok = done;
                say(&multi, format!(
                    "\n{rounds} round(s), {tool_calls} tool call(s), {total_ms:.0} ms (model {llm_ms:.0} ms, tools {tool_ms:.0} ms)"
                ));
            }
            Event::Token { .. } => {}
        }
    }
    Ok(ok)
}

/// Prints a line above the spinners on a terminal; plain lines when stderr is redirected
/// (indicatif draws nothing there, and the answer must not be lost).
fn say(multi: &MultiProgress, line: String) {
    if multi.is_hidden() {
        eprintln!("{line}");
    } else {
        let _ = multi.println(line);
    }
}

fn finish(multi: &MultiProgress, bar: Option<ProgressBar>, line: String) {
    match bar {
        Some(bar) => {
            bar.finish_and_clear();
            multi.remove(&bar);
            say(multi, line);
        }
        None => {
            say(multi, line);
        }
    }
}

/// Writes artifacts as `DIR/<call id>_<name>` and returns their paths.
pub fn write_artifacts(
    dir: &Path,
    call_id: &str,
    artifacts: &[Artifact],
) -> anyhow::Result<Vec<String>> {
    if artifacts.is_empty() {
        return Ok(vec![]);
    }
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let mut paths = Vec::new();
    for a in artifacts {
        // Artifact names come from tools; keep only the file-name part.
        let name = Path::new(&a.name)
            .file_name()
            .map(|n| n.to_string_lossy().to_string())
            .unwrap_or_else(|| "artifact".into());
        let path = dir.join(format!("{call_id}_{name}"));
        std::fs::write(&path, &a.bytes)
            .with_context(|| format!("cannot write {}", path.display()))?;
        paths.push(path.display().to_string());
    }
    Ok(paths)
}

/// The image as the reasoning model sees it (`hilum_imaging::model_view_png`).
pub fn image_payload(store: &ImageStore, id: &str) -> anyhow::Result<ImagePayload> {
    let img = store.get(id)?;
    Ok(ImagePayload::png(id, &hilum_imaging::model_view_png(&img)?))
}
