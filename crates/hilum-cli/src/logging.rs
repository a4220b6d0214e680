//! The logs of `hilum serve`, `hilum mcp` and `hilum analyze -v`: on stderr only (stdout is
//! the MCP channel and the analysis output), as text or one JSON object per line, filtered by
//! `RUST_LOG` (read in [`crate::config::log_filter`]) or the command's default level.
//!
//! What is never logged, whatever the filter: rmcp's debug and trace lines (they hold whole MCP
//! messages: tool arguments and results, base64 images), and `log` records of other crates
//! (no bridge is installed: tokio-postgres logs statement parameters at debug). Hilum's own
//! lines carry ids, names of tools, durations and outcomes, never questions, answers, file
//! names, tool arguments or results, or DICOM attributes.

use std::io::{IsTerminal, Write};
use std::sync::OnceLock;

use anyhow::Context;
use tracing::Level;
use tracing_subscriber::filter::{filter_fn, EnvFilter, FilterExt};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::Layer;

/// How log lines look.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// One readable line per event, with its spans (`request{request_id=…}:run{…}: …`).
    #[default]
    Text,
    /// One JSON object per line: `timestamp`, `level`, `fields`, `target`, `spans`.
    Json,
}

static FORMAT: OnceLock<LogFormat> = OnceLock::new();

/// Installs the process's subscriber: `RUST_LOG` when set, else `default` (a filter in the
/// same syntax, e.g. `info`). Called once per process, before anything logs.
pub fn install(format: LogFormat, default: &str) -> anyhow::Result<()> {
    let spec = crate::config::log_filter().unwrap_or_else(|| default.to_string());
    let filter = EnvFilter::try_new(&spec).with_context(|| {
        format!("RUST_LOG=`{spec}` is not a valid filter (e.g. `info`, `hilum_server=debug,warn`)")
    })?;
    let rmcp_cap = filter_fn(|m| !(m.target().starts_with("rmcp") && *m.level() > Level::INFO));
    let layer = match format {
        LogFormat::Text => tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .with_ansi(std::io::stderr().is_terminal())
            .boxed(),
        LogFormat::Json => tracing_subscriber::fmt::layer()
            .json()
            .with_writer(std::io::stderr)
            // Every enclosing span's fields, so a line inside a run names its request.
            .with_current_span(false)
            .with_span_list(true)
            .boxed(),
    };
    let subscriber = tracing_subscriber::registry().with(layer.with_filter(filter.and(rmcp_cap)));
    tracing::subscriber::set_global_default(subscriber)
        .context("a log subscriber is already installed")?;
    let _ = FORMAT.set(format);
    Ok(())
}

/// A line for the operator that no filter hides (listening, shutting down), in the log's
/// format: text as it is, JSON as a log object, so a JSON log stays JSON throughout.
pub fn notice(message: &str) {
    let line = match FORMAT.get() {
        Some(LogFormat::Json) => serde_json::json!({
            "timestamp": now_rfc3339(),
            "level": "INFO",
            "fields": {"message": message},
            "target": "hilum",
        })
        .to_string(),
        _ => message.to_string(),
    };
    let _ = writeln!(std::io::stderr().lock(), "{line}");
}

fn now_rfc3339() -> String {
    let micros = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_micros() as i64)
        .unwrap_or(0);
    chrono::DateTime::from_timestamp_micros(micros)
        .map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Micros, true))
        .unwrap_or_default()
}

/// The default filter of `hilum analyze -v`: `-v` info, `-vv` debug, `-vvv` trace.
pub fn verbosity(count: u8) -> &'static str {
    match count {
        0 | 1 => "info",
        2 => "debug",
        _ => "trace",
    }
}
