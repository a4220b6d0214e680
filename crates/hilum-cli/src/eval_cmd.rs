//! `hilum eval`: run a ChestAgentBench-format benchmark through the agent, score it the way
//! MedRAX published, and compare two runs. The work is done by `hilum-eval`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context;
use clap::{Args, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};

use hilum_agent::{Llm, Protocol};
use hilum_eval::runner::{LlmFor, OnProgress, ToolboxFor, CHOICE_INSTRUCTION};
use hilum_eval::{compare_runs, read_run, run_eval, write_reports, EvalConfig, Memory, Question};
use hilum_imaging::ImageStore;
use hilum_llm::script::ScriptTurn;
use hilum_llm::ScriptLlm;
use hilum_llm_local::LocalLlm;

use crate::config::{load_file, LlmChoice};

#[derive(Args)]
#[command(
    args_conflicts_with_subcommands = true,
    after_help = "Examples:\n  \
hilum eval metadata.jsonl --images-dir chestagentbench --llm openai:gpt-4o --out runs/gpt4o\n  \
hilum eval tests/fixtures/cxr_bench/metadata.jsonl --images-dir ../shared/data --out runs/local\n  \
hilum eval compare runs/gpt4o runs/local\n\n\
Question files: ChestAgentBench's metadata.jsonl (question_id, case_id, question with options \
A)..F), answer, images, categories, ...) or a plain JSONL (id, images, question, answer, \
options, categories, kind = choice|number|text, tolerance).\n\n\
Scoring: the letter is read by MedRAX's cascade (a lone letter; a leading `B)`/`B.`; the first \
standalone A-F; the first A-F anywhere); --strict accepts only a lone letter. Every question is \
in the denominator; unparsed answers, timeouts and errors count as wrong.\n\n\
--llm script:FILE also takes a JSON object {\"QUESTION_ID\": [turns...]} giving each question \
its own scripted turns."
)]
pub struct EvalArgs {
    #[command(flatten)]
    pub devices: crate::config::DeviceFlag,
    #[command(flatten)]
    pub mcp: crate::remote::McpFlag,
    #[command(subcommand)]
    pub cmd: Option<EvalCmd>,
    /// The question file (metadata.jsonl or plain JSONL).
    pub bench: Option<PathBuf>,
    /// Folder the questions' image paths are relative to (default: the question file's folder).
    #[arg(long)]
    pub images_dir: Option<PathBuf>,
    /// Reasoning model, as for `hilum analyze` (openai:MODEL, local:PATH.gguf, script:FILE).
    #[arg(long)]
    pub llm: Option<String>,
    /// Base URL of an OpenAI-compatible server (env OPENAI_BASE_URL).
    #[arg(long)]
    pub base_url: Option<String>,
    /// Run folder: run.jsonl, report.md, report.json, report.png.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Questions (or cases, with --memory case) run at once.
    #[arg(long, default_value_t = 1)]
    pub jobs: usize,
    /// case: one conversation per case, questions in file order (as MedRAX ran); question: each
    /// question alone.
    #[arg(long, default_value = "question")]
    pub memory: Memory,
    /// Accept only a lone letter as an answer.
    #[arg(long)]
    pub strict: bool,
    /// Continue the run in --out: finished questions are not asked again.
    #[arg(long)]
    pub resume: bool,
    /// Only the first N questions (after --categories).
    #[arg(long)]
    pub limit: Option<usize>,
    /// Only questions with any of these categories (comma-separated).
    #[arg(long, value_delimiter = ',')]
    pub categories: Vec<String>,
    /// Sampling temperature sent with every request (MedRAX used 0.2).
    #[arg(long)]
    pub temperature: Option<f32>,
    /// Sampler seed of the local model (recorded in the run).
    #[arg(long)]
    pub seed: Option<u64>,
    /// native or react.
    #[arg(long)]
    pub protocol: Option<Protocol>,
    /// Tool rounds per question.
    #[arg(long)]
    pub max_rounds: Option<usize>,
    /// Tool calls per question.
    #[arg(long)]
    pub max_tool_calls: Option<usize>,
    /// Wall-clock budget per question, seconds; past it the question is a timeout (wrong).
    #[arg(long, default_value_t = 300)]
    pub deadline: u64,
    /// Budget of one tool call, seconds.
    #[arg(long)]
    pub tool_timeout: Option<u64>,
    /// Text appended to a multiple-choice question.
    #[arg(long)]
    pub instruction: Option<String>,
    /// Score a choice answer that names no letter by MedRAX's cascade alone (no reading of the
    /// one option whose text it contains, no follow-up asking the model which option it meant)
    #[arg(long)]
    pub no_letter_step: bool,
    /// Send the questions' pixels to a model that reads images outside this process (as
    /// `hilum analyze --send-pixels`; a model in the process always gets them).
    #[arg(long)]
    pub send_pixels: bool,
    /// No progress bar.
    #[arg(long)]
    pub quiet: bool,
    /// Config file (TOML with [llm] and [agent] tables).
    #[arg(long)]
    pub config: Option<PathBuf>,
}

#[derive(Subcommand)]
pub enum EvalCmd {
    /// Accuracy of two runs on the questions both finished, McNemar's exact test, per category.
    Compare {
        run_a: PathBuf,
        run_b: PathBuf,
        /// Print JSON instead of Markdown.
        #[arg(long)]
        json: bool,
    },
    /// Write report.md, report.json and report.png again from a run's run.jsonl.
    Report { run: PathBuf },
}

/// Per-question scripts: `{"id": [turns]}`; `None` when the file is a plain array of turns.
fn question_scripts(path: &Path) -> anyhow::Result<Option<BTreeMap<String, Vec<ScriptTurn>>>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    let v: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("{} is not JSON", path.display()))?;
    if !v.is_object() {
        return Ok(None);
    }
    let map = serde_json::from_value(v).with_context(|| {
        format!(
            "{}: a per-question script maps each question id to an array of turns",
            path.display()
        )
    })?;
    Ok(Some(map))
}

fn progress_bar(total: usize, quiet: bool) -> ProgressBar {
    if quiet {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(total as u64);
    if let Ok(style) =
        ProgressStyle::with_template("{bar:30} {pos}/{len} {msg} {elapsed_precise} eta {eta}")
    {
        bar.set_style(style);
    }
    bar
}

pub async fn run(args: EvalArgs) -> anyhow::Result<()> {
    match args.cmd {
        Some(EvalCmd::Compare { run_a, run_b, json }) => {
            let (a, _) = read_run(&run_a)?;
            let (b, _) = read_run(&run_b)?;
            let c = compare_runs(&a, &b);
            if json {
                println!("{}", serde_json::to_string_pretty(&c)?);
            } else {
                print!("{}", c.to_markdown());
            }
            Ok(())
        }
        Some(EvalCmd::Report { run }) => {
            let (log, _) = read_run(&run)?;
            let (report, paths) = write_reports(&log)?;
            print!("{}", report.to_markdown());
            for p in paths {
                eprintln!("hilum: wrote {}", p.display());
            }
            Ok(())
        }
        None => run_bench(args).await,
    }
}

async fn run_bench(args: EvalArgs) -> anyhow::Result<()> {
    let bench = args.bench.clone().context(
        "name the question file: hilum eval BENCH.jsonl --out RUN_DIR (or hilum eval compare A B)",
    )?;
    let out = args
        .out
        .clone()
        .context("--out RUN_DIR is required: the run's records and reports go there")?;
    let images_dir = match &args.images_dir {
        Some(d) => d.clone(),
        None => bench.parent().map(Path::to_path_buf).unwrap_or_default(),
    };
    let file = load_file(args.config.as_deref())?;
    let choice = LlmChoice::resolve(args.llm.clone(), args.base_url.clone(), &file.llm)?;
    let (kind, rest) = choice
        .spec
        .split_once(':')
        .unwrap_or((choice.spec.as_str(), ""));
    let mut seed = None;
    let llm_for: LlmFor = match (kind, question_scripts_if(kind, rest)?) {
        ("script", Some(map)) => {
            let map = Arc::new(map);
            Arc::new(move |q: &Question| {
                let turns = map
                    .get(&q.id)
                    .cloned()
                    .ok_or_else(|| format!("the script has no turns for question {}", q.id))?;
                Ok(Arc::new(ScriptLlm::new(turns)) as Arc<dyn Llm>)
            })
        }
        ("local", _) => {
            let path = if rest.is_empty() {
                hilum_llm_local::default_model_path(&crate::config::models_dir()).context(
                    "the default local model is not installed: run scripts/fetch_local_llm.sh",
                )?
            } else {
                PathBuf::from(rest)
            };
            let mut cfg = crate::config::local_config(path)?;
            if let Some(s) = args.seed {
                cfg.seed = s;
            }
            seed = Some(cfg.seed);
            let llm: Arc<dyn Llm> = Arc::new(LocalLlm::load(cfg)?);
            Arc::new(move |_: &Question| Ok(llm.clone()))
        }
        ("local-vlm", _) => {
            let vlm = crate::config::load_local_vlm(rest, args.seed)?;
            seed = Some(vlm.seed());
            let llm: Arc<dyn Llm> = Arc::new(vlm);
            Arc::new(move |_: &Question| Ok(llm.clone()))
        }
        _ => {
            let llm = choice.build()?;
            Arc::new(move |_: &Question| Ok(llm.clone()))
        }
    };
    let model = match kind {
        "script" => choice.spec.clone(),
        _ => {
            let probe = Question {
                id: String::new(),
                case_id: String::new(),
                question: String::new(),
                answer: String::new(),
                kind: Default::default(),
                tolerance: 0.0,
                images: vec![],
                categories: vec![],
                line: 0,
            };
            llm_for(&probe)
                .map(|l| l.name())
                .unwrap_or(choice.spec.clone())
        }
    };

    let store = Arc::new(ImageStore::default());
    let backends = crate::config::resolve_backends(&[], &file.backends)?;
    let deps = crate::config::tool_deps(store.clone(), file.vlm)?.with_backends(backends);
    let mut full = crate::toolbox(&deps)?;
    let remote = crate::remote::connect(&file.mcp, &args.mcp).await?;
    crate::remote::add(&mut full, remote.as_deref(), &store);
    let full = Arc::new(full);
    let tools = full.names();
    let toolbox_for: ToolboxFor = if choice.is_local() && kind != "script" {
        // As `hilum analyze` does for a model on this machine: only the tools whose declared
        // requirements hold for this question's images.
        let (deps, full) = (deps.clone(), full.clone());
        Arc::new(move |ids: &[String]| {
            Arc::new(full.runnable(&hilum_tools::environment(&deps, ids)))
        })
    } else {
        let full = full.clone();
        Arc::new(move |_: &[String]| full.clone())
    };

    // `--deadline` is per question and always set: it wins over the file's deadline.
    let flags = crate::config::AgentFlags {
        protocol: args.protocol,
        max_rounds: args.max_rounds,
        max_tool_calls: args.max_tool_calls,
        deadline_secs: Some(args.deadline),
        tool_timeout_secs: args.tool_timeout,
        ..Default::default()
    };
    let mut agent = file.agent.resolve(flags, choice.is_local())?;
    agent.temperature = args.temperature;
    let cfg = EvalConfig {
        bench,
        images_dir,
        out: out.clone(),
        jobs: args.jobs,
        memory: args.memory,
        strict: args.strict,
        resume: args.resume,
        limit: args.limit,
        categories: args
            .categories
            .iter()
            .map(|c| c.trim().to_lowercase())
            .collect(),
        agent,
        model: model.clone(),
        llm_spec: choice.spec.clone(),
        seed,
        tools,
        hilum_version: env!("CARGO_PKG_VERSION").to_string(),
        choice_instruction: args
            .instruction
            .clone()
            .unwrap_or_else(|| CHOICE_INSTRUCTION.to_string()),
        letter_step: !args.no_letter_step,
        send_pixels: args.send_pixels || file.llm.send_pixels.unwrap_or(false),
    };
    if !args.quiet {
        eprintln!(
            "hilum: eval {} · model {model} · memory per {} · {} job(s) → {}",
            cfg.bench.display(),
            cfg.memory.as_str(),
            cfg.jobs,
            out.display()
        );
    }
    let bar = Arc::new(std::sync::Mutex::new(None::<ProgressBar>));
    let quiet = args.quiet;
    let bar_in = bar.clone();
    let on_progress: OnProgress = Arc::new(move |p: &hilum_eval::Progress| {
        let mut slot = bar_in.lock().unwrap_or_else(|e| e.into_inner());
        let b = slot.get_or_insert_with(|| progress_bar(p.total, quiet));
        b.set_position(p.done as u64);
        b.set_message(format!(
            "accuracy {:.1}% ({}/{})",
            p.correct as f64 / p.done.max(1) as f64 * 100.0,
            p.correct,
            p.done
        ));
    });
    let log = run_eval(cfg, store, llm_for, toolbox_for, on_progress).await?;
    if let Some(b) = bar.lock().unwrap_or_else(|e| e.into_inner()).take() {
        b.finish();
    }
    let (report, paths) = write_reports(&log)?;
    if !args.quiet {
        print!("{}", report.to_markdown());
        for p in paths {
            eprintln!("hilum: wrote {}", p.display());
        }
    }
    Ok(())
}

fn question_scripts_if(
    kind: &str,
    rest: &str,
) -> anyhow::Result<Option<BTreeMap<String, Vec<ScriptTurn>>>> {
    if kind == "script" {
        question_scripts(Path::new(rest))
    } else {
        Ok(None)
    }
}
