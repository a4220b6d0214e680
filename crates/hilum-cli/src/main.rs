//! `hilum`: chest X-ray analysis with tools and a reasoning model.
//!
//! The binary is thin: argument parsing, configuration and rendering. The logic lives in the
//! library crates.

mod analyze;
mod bench_cmd;
mod config;
mod eval_cmd;
mod models_cmd;
mod render;
mod serve_cmd;
mod tools_cmd;

use clap::{Parser, Subcommand};

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
}

#[tokio::main]
async fn main() {
    let cli = Cli::parse();
    let result = match cli.command {
        Commands::Analyze(args) => analyze::run(args).await,
        Commands::Tools { cmd } => tools_cmd::run(cmd).await,
        Commands::Models { cmd } => models_cmd::run(cmd).await,
        Commands::Bench(args) => bench_cmd::run(args).await,
        Commands::Eval(args) => eval_cmd::run(args).await,
        Commands::Serve(args) => serve_cmd::run(args).await,
        Commands::Mcp(args) => serve_cmd::run_mcp(args).await,
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
