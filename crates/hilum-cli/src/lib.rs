//! The `hilum` command as a library: argument parsing, the one typed configuration, rendering.
//! The logic lives in the library crates. [`main_with`] runs the command with a tool registry,
//! so a program can offer its own tools beside Hilum's (see `tests/extra_tool`).

#![warn(missing_docs)]

mod analyze;
mod bench_cmd;
mod config;
mod deid_cmd;
mod eval_cmd;
mod gpu_check_cmd;
mod logging;
mod models_cmd;
mod pacs_cmd;
mod remote;
mod render;
mod serve_cmd;
mod tools_cmd;

use std::sync::{Arc, OnceLock};

use clap::{Parser, Subcommand};
use hilum_tools::{Registry, ToolDeps};

#[derive(Parser)]
#[command(
    name = "hilum",
    version,
    about = "Chest X-ray analysis: CXR tools driven by a reasoning model",
    long_about = "Hilum analyses chest radiographs (PNG, JPEG, 16-bit, DICOM) with CXR tools \
(classification, segmentation, measurements, ...) driven by a reasoning model: GPT-4o or any \
OpenAI-compatible server, a local model, or a scripted replay for tests.\n\n\
Examples:\n  hilum analyze chest.png --question \"Is there cardiomegaly?\"\n  \
hilum analyze chest.dcm --llm openai:gpt-4o --json\n  \
hilum tools list\n  hilum tools call image_info --image chest.png"
)]
struct Cli {
    #[command(subcommand)]
    command: Commands,
}

#[derive(Subcommand)]
enum Commands {
    /// Answer a question about one or more radiographs with the agent.
    Analyze(analyze::AnalyzeArgs),
    /// List the tools, or call one directly without a model.
    Tools {
        #[command(subcommand)]
        cmd: tools_cmd::ToolsCmd,
    },
    /// List, fetch, import and verify model weights.
    Models {
        #[command(subcommand)]
        cmd: models_cmd::ModelsCmd,
    },
    /// Per-tool latency (p50/p95/p99, images/s, model load, peak RSS) and a parallel round
    /// against the same calls one after another.
    Bench(bench_cmd::BenchArgs),
    /// Run a ChestAgentBench-format benchmark through the agent and score it; compare two runs.
    Eval(eval_cmd::EvalArgs),
    /// Run the HTTP service (API, streaming, MCP at /mcp); manage its tokens and audit log.
    Serve(serve_cmd::ServeArgs),
    /// Serve every tool over the Model Context Protocol on stdin/stdout.
    Mcp(serve_cmd::McpArgs),
    /// Every model on a GPU against the CPU (same weights and inputs), timed on both.
    GpuCheck(gpu_check_cmd::GpuCheckArgs),
    /// De-identified copies of DICOM files (PS3.15 Annex E, with the profile options as flags).
    Deid(deid_cmd::DeidArgs),
    /// The DICOM node's jobs (list, retry), and pulling a study from a PACS by DICOMweb.
    Pacs(pacs_cmd::PacsArgs),
}

static REGISTRY: OnceLock<Registry> = OnceLock::new();

/// The tools this program offers ([`Registry::builtin`] unless [`main_with`] was given others).
pub(crate) fn registry() -> &'static Registry {
    REGISTRY.get_or_init(Registry::builtin)
}

static MODEL_SETTINGS: OnceLock<hilum_models::ModelSettings> = OnceLock::new();
static MODEL_POOL: OnceLock<Arc<hilum_models::ModelPool>> = OnceLock::new();

/// The models' settings, made once from the environment and the config file's `[models]`
/// table ([`config::model_settings`]) on the command's devices (set by [`main_with`]).
pub(crate) fn model_settings() -> &'static hilum_models::ModelSettings {
    // `run` checked the device list already; this default serves callers made before it.
    MODEL_SETTINGS
        .get_or_init(|| config::model_settings(config::device_set(None).unwrap_or_default()))
}

/// The process's one model pool over [`model_settings`] (with the config file's `[remote]`
/// server, see [`config::with_remote`]): every command and every toolbox of `hilum serve`
/// shares it, so a model loads once.
pub(crate) fn model_pool() -> Arc<hilum_models::ModelPool> {
    MODEL_POOL
        .get_or_init(|| {
            Arc::new(hilum_models::ModelPool::from_settings(config::with_remote(
                model_settings().clone(),
            )))
        })
        .clone()
}

/// The toolbox of this program's registry over `deps`.
pub(crate) fn toolbox(deps: &ToolDeps) -> anyhow::Result<hilum_agent::Toolbox> {
    registry().toolbox(deps).map_err(anyhow::Error::msg)
}

/// Runs the `hilum` command line with the tools of `registry`; exits the process on error.
pub fn main_with(registry: Registry) {
    let _ = REGISTRY.set(registry);
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            std::process::exit(1);
        }
    };
    runtime.block_on(run());
}

async fn run() {
    let cli = Cli::parse();
    // The config file first: its `[models]` table is part of the models' settings, which are
    // made once. Then, before any model loads, the process-wide parts (the CPU kernels' knobs,
    // ONNX Runtime's library).
    let explicit = match &cli.command {
        Commands::Analyze(a) => a.config.as_deref(),
        Commands::Eval(a) => a.config.as_deref(),
        Commands::Serve(a) => a.config.as_deref(),
        _ => None,
    };
    if let Err(e) = config::load_file(explicit) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
    // The devices the one pool routes across: the command's `--device`, else the environment
    // or the file. A list that does not parse stops here, before any model loads.
    let flag = match &cli.command {
        Commands::Analyze(a) => &a.devices,
        Commands::Tools {
            cmd: tools_cmd::ToolsCmd::Call { devices, .. },
        } => devices,
        Commands::Bench(a) => &a.devices,
        Commands::Eval(a) => &a.devices,
        Commands::Serve(a) => &a.devices,
        Commands::Mcp(a) => &a.devices,
        _ => &config::DeviceFlag::default(),
    };
    match config::device_set(flag.device.as_deref()) {
        Ok(devices) => {
            let _ = MODEL_SETTINGS.set(config::model_settings(devices));
        }
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::exit(1);
        }
    }
    model_settings().apply_process_wide();
    let result = match cli.command {
        Commands::Analyze(args) => analyze::run(args).await,
        Commands::Tools { cmd } => tools_cmd::run(cmd).await,
        Commands::Models { cmd } => models_cmd::run(cmd).await,
        Commands::Bench(args) => bench_cmd::run(args).await,
        Commands::GpuCheck(args) => gpu_check_cmd::run(args),
        Commands::Deid(args) => deid_cmd::run(args),
        Commands::Eval(args) => eval_cmd::run(args).await,
        Commands::Serve(args) => serve_cmd::run(args).await,
        Commands::Mcp(args) => serve_cmd::run_mcp(args).await,
        Commands::Pacs(args) => pacs_cmd::run(args).await,
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
