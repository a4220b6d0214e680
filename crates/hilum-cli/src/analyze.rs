//! `hilum analyze`: one question about one or more images, answered by the agent.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use clap::Args;

use hilum_agent::{Agent, Mode, Protocol, RunInput};
use hilum_imaging::ImageStore;

use crate::config::{load_file, LlmChoice};
use crate::logging::LogFormat;
use crate::render;

#[derive(Args)]
#[command(
    after_help = "The model gets image ids and tool results, never file names. Pixels are sent \
to a remote model only with --send-pixels.\n\nScript files (--llm script:FILE) are JSON arrays of \
assistant turns, e.g. [{\"tool_calls\":[{\"name\":\"image_info\",\"arguments\":{\"image\":\"$IMAGE\"}}]},\
{\"content\":\"The image is 8-bit.\"}]; $IMAGE stands for the first image's id."
)]
pub struct AnalyzeArgs {
    #[command(flatten)]
    pub devices: crate::config::DeviceFlag,
    #[command(flatten)]
    pub mcp: crate::remote::McpFlag,
    /// Radiographs: PNG, JPEG (8/16-bit, gray or colour) or DICOM.
    #[arg(required = true)]
    pub images: Vec<PathBuf>,
    /// The question to answer.
    #[arg(
        short,
        long,
        default_value = "Describe the findings in this chest X-ray."
    )]
    pub question: String,
    /// Reasoning model: openai:MODEL (GPT-4o, Azure, vLLM, llama.cpp server, Ollama),
    /// local:PATH.gguf (in-process), local-vlm:PATH (Gemma 3 multimodal / MedGemma in-process,
    /// reading the images: a snapshot folder, TEXT.gguf,MMPROJ.gguf, or TEXT.gguf with its
    /// mmproj*.gguf beside it), or script:FILE. Default: $HILUM_LLM, the config file,
    /// openai:gpt-4o when OPENAI_API_KEY is set, else the installed local model.
    #[arg(long)]
    pub llm: Option<String>,
    /// Base URL of an OpenAI-compatible server, e.g. http://127.0.0.1:8080/v1 (env OPENAI_BASE_URL).
    #[arg(long)]
    pub base_url: Option<String>,
    /// react: reason and act until answered; reflexion: draft, self-critique, more tools, revise.
    #[arg(long)]
    pub mode: Option<Mode>,
    /// native: OpenAI function calling; react: text Thought/Action/Observation for models without it.
    #[arg(long)]
    pub protocol: Option<Protocol>,
    /// Print the events as NDJSON on stdout, one per line, ending with {"type":"complete",...}.
    #[arg(long)]
    pub json: bool,
    /// Allow image pixels to be sent to the model (off by default: the model sees ids only).
    #[arg(long)]
    pub send_pixels: bool,
    /// Show the model the overlays its tool calls drew, as pictures in the next turn (only a
    /// model in this process that reads images, e.g. local-vlm:; default true for it).
    #[arg(long, value_name = "BOOL")]
    pub show_overlays: Option<bool>,
    /// Tool rounds before the agent must answer.
    #[arg(long)]
    pub max_rounds: Option<usize>,
    /// Tool calls in the whole run.
    #[arg(long)]
    pub max_tool_calls: Option<usize>,
    /// Wall-clock budget of the run, in seconds.
    #[arg(long)]
    pub deadline: Option<u64>,
    /// Budget of one tool call, in seconds.
    #[arg(long)]
    pub tool_timeout: Option<u64>,
    /// Write tool artifacts (masks, overlays) into this folder.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Config file (TOML with [llm] and [agent] tables).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Model backend: BACKEND for every model that runs on it, or MODEL=BACKEND (native,
    /// candle, onnx, kserve); every tool using the model follows it; repeatable. Overrides
    /// HILUM_BACKEND and the config file's [models.backend] table.
    #[arg(long)]
    pub backend: Vec<String>,
    /// Log lines on stderr: -v info, -vv debug, -vvv trace (RUST_LOG, when set, filters
    /// instead). Without -v nothing is logged.
    #[arg(short, long, action = clap::ArgAction::Count)]
    pub verbose: u8,
    /// How -v's log lines look: text, or one JSON object per line.
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
}

pub async fn run(args: AnalyzeArgs) -> anyhow::Result<()> {
    if args.verbose > 0 {
        crate::logging::install(args.log_format, crate::logging::verbosity(args.verbose))?;
    }
    let file = load_file(args.config.as_deref())?;
    let choice = LlmChoice::resolve(args.llm.clone(), args.base_url.clone(), &file.llm)?;
    let llm = choice.build()?;

    let store = Arc::new(ImageStore::default());
    let mut ids = Vec::new();
    for path in &args.images {
        let id = store
            .ingest_file(path)
            .with_context(|| format!("cannot use {}", path.display()))?;
        ids.push(id);
    }
    // A model in this process that reads images gets them: the pixels stay in the process.
    let caps = llm.capabilities();
    let send_pixels = args.send_pixels
        || file.llm.send_pixels.unwrap_or(false)
        || (caps.images && caps.in_process);
    let payloads = if send_pixels {
        ids.iter()
            .map(|id| render::image_payload(&store, id))
            .collect::<anyhow::Result<Vec<_>>>()?
    } else {
        Vec::new()
    };

    let backends = crate::config::resolve_backends(&args.backend, &file.backends)?;
    let deps = crate::config::tool_deps(store.clone(), file.vlm)?.with_backends(backends);
    let mut toolbox = crate::toolbox(&deps)?;
    let remote = crate::remote::connect(&file.mcp, &args.mcp).await?;
    crate::remote::add(&mut toolbox, remote.as_deref(), &store);
    let env = hilum_tools::environment(&deps, &ids);
    if choice.is_local() {
        // A small local model picks worse among many tools and calls whatever it is offered:
        // it gets only the tools whose declared requirements hold here.
        toolbox = toolbox.runnable(&env);
    }
    let toolbox = Arc::new(toolbox);
    let flags = crate::config::AgentFlags {
        protocol: args.protocol,
        mode: args.mode,
        max_rounds: args.max_rounds,
        max_tool_calls: args.max_tool_calls,
        deadline_secs: args.deadline,
        tool_timeout_secs: args.tool_timeout,
        show_overlays: args.show_overlays,
    };
    let config = file.agent.resolve(flags, choice.is_local())?;
    let agent = Agent::new(llm.clone(), toolbox, env, config);
    if let Some(note) = &choice.note {
        eprintln!("hilum: {note}");
    }
    if !args.json {
        eprintln!(
            "hilum: {} image(s) {} · model {}{}",
            ids.len(),
            ids.join(", "),
            llm.name(),
            if choice.is_local() {
                " (on this machine)"
            } else {
                " (remote)"
            }
        );
    }

    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    // Size, spacing and view: numbers an answer may quote besides the tool results.
    let image_metadata = ids
        .iter()
        .filter_map(|id| store.get(id).ok())
        .map(|img| serde_json::json!({"width": img.width, "height": img.height, "meta": img.meta}))
        .collect();
    let input = RunInput {
        question: args.question.clone(),
        images: ids,
        image_payloads: payloads,
        history: vec![],
        session_id: String::new(),
        image_metadata,
    };
    let run = tokio::spawn(async move { agent.run(input, Some(tx)).await });
    let ok = if args.json {
        render::ndjson(rx, args.out.as_deref()).await?
    } else {
        render::live(rx, args.out.as_deref()).await?
    };
    let outcome = run.await.context("the agent task failed")?;
    if !ok {
        anyhow::bail!(outcome.error.unwrap_or_else(|| "the run failed".into()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use hilum_agent::{Environment, Requirements};

    /// The local model's offer follows what each tool declares: model tools only with their
    /// model installed, `dicom_info` only for DICOM input, `visualize` never.
    #[test]
    fn the_local_offer_follows_declared_requirements() {
        let models = Arc::new(hilum_models::ModelPool::from_settings(Default::default()));
        let deps = hilum_tools::ToolDeps::new(Arc::new(ImageStore::default()), models);
        let toolbox = hilum_tools::default_toolbox(&deps).expect("toolbox");
        let bare = toolbox.runnable(&Environment::default()).names();
        assert_eq!(bare, vec!["image_info".to_string()]);
        let env = Environment::default()
            .with(Requirements::model_fact("lung-unet"), "installed")
            .with(Requirements::DICOM_FACT, "yes");
        let offered = toolbox.runnable(&env).names();
        assert_eq!(
            offered,
            ["image_info", "dicom_info", "segment_lungs", "measure_chest"]
                .map(String::from)
                .to_vec()
        );
    }
}
