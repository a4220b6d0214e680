//! `hilum serve` (the HTTP service, its tokens and audit export) and `hilum mcp` (the
//! toolbox over MCP on stdio). The service itself lives in `hilum-server`.

use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, Subcommand};

use hilum_imaging::ImageStore;
use hilum_server::{AppState, Db, LlmFactory, RateLimit, ServerConfig};

use crate::config::{load_file, LlmChoice};
use crate::logging::{self, notice, LogFormat};

pub(crate) const DEFAULT_DB: &str = "sqlite://.hilum/hilum.db";

#[derive(Args)]
#[command(
    args_conflicts_with_subcommands = true,
    after_help = "Examples:\n  hilum serve token create --name radiology-ws-1\n  \
hilum serve token list\n  \
hilum serve token revoke tok_...\n  \
hilum serve --db postgres://hilum@10.0.0.5:5432/hilum --bind 0.0.0.0:8080\n  \
hilum serve --llm openai:gpt-4o --base-url http://127.0.0.1:8000/v1\n  \
hilum serve --llm script:tests/fixtures/scripts/info.json --bind 127.0.0.1:8080\n  \
hilum serve audit export > audit.jsonl"
)]
pub struct ServeArgs {
    #[command(flatten)]
    pub devices: crate::config::DeviceFlag,
    #[command(flatten)]
    pub mcp: crate::remote::McpFlag,
    #[command(subcommand)]
    pub cmd: Option<ServeCmd>,
    /// Address to listen on. Loopback by default; anything else should sit behind TLS.
    #[arg(long, env = "HILUM_BIND", default_value = "127.0.0.1:8080")]
    pub bind: SocketAddr,
    /// Database URL: sqlite://PATH, or postgres://USER@HOST:PORT/DB for several replicas
    /// sharing one database. PostgreSQL takes libpq's TLS options in the query:
    /// ?sslmode=disable|prefer|require|verify-ca|verify-full (default prefer) and
    /// sslrootcert=PATH; on a hospital network use sslmode=verify-full.
    #[arg(long, global = true, env = "HILUM_DB", default_value = DEFAULT_DB)]
    pub db: String,
    /// CA certificate (PEM) that signed the PostgreSQL server's certificate: the same as
    /// sslrootcert=PATH in --db (which wins), and sslmode=verify-full unless --db sets one.
    #[arg(long, global = true, env = "HILUM_DB_CA_FILE")]
    pub db_ca_file: Option<PathBuf>,
    /// Reasoning model for sessions: openai:MODEL, local:GGUF or script:FILE. Without the flag:
    /// HILUM_LLM, the config file's [llm], openai:gpt-4o when OPENAI_API_KEY is set, else the
    /// installed local model; only with none of these do questions answer 503 (uploads and
    /// direct tool calls still work).
    #[arg(long)]
    pub llm: Option<String>,
    /// Base URL of an OpenAI-compatible endpoint.
    #[arg(long)]
    pub base_url: Option<String>,
    /// Config file (TOML with [llm] and [agent] tables).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Allow sending image pixels and metadata to a model endpoint that is not on this machine.
    #[arg(long)]
    pub allow_remote_llm: bool,
    /// Attach image pixels to model requests when the model accepts images (a remote endpoint
    /// also needs --allow-remote-llm).
    #[arg(long)]
    pub send_pixels: bool,
    /// Largest upload, MiB.
    #[arg(long, default_value_t = 64)]
    pub max_upload_mb: usize,
    /// Memory each token's images may hold in the server, MiB (files, decoded pixels,
    /// preprocessed variants; 0: no bound). Least recently used images are dropped and read
    /// again from the database when named. Default 256, or `max_image_memory_mb` in the
    /// config file's [serve] table.
    #[arg(long)]
    pub max_image_memory_mb: Option<u64>,
    /// Requests per second per token (0 turns the limit off).
    #[arg(long, default_value_t = 20.0)]
    pub rate_limit: f64,
    /// Burst of requests a token may make at once.
    #[arg(long, default_value_t = 40.0)]
    pub rate_burst: f64,
    /// Allow browser requests from this origin (CORS is off unless given; repeatable).
    #[arg(long)]
    pub cors_origin: Vec<String>,
    /// Budget of one direct tool call, seconds.
    #[arg(long, default_value_t = 300)]
    pub tool_timeout: u64,
    /// On SIGTERM or SIGINT: seconds running runs may take to finish before they are stopped
    /// and marked `interrupted` (resumable). New connections and questions are refused at once.
    #[arg(long, default_value_t = 30.0)]
    pub drain_secs: f64,
    /// Seconds between heartbeats of the runs this server runs (the database records that
    /// the server running them is alive).
    #[arg(long, default_value_t = 5.0)]
    pub run_heartbeat_secs: f64,
    /// A running run whose heartbeat is older than this many seconds was left by a server that
    /// died: any server marks it `interrupted`. Several heartbeats long.
    #[arg(long, default_value_t = 30.0)]
    pub run_stale_secs: f64,
    /// Log lines on stderr: text, or one JSON object per line. RUST_LOG filters them
    /// (default `info`); each line of a request carries its `request_id`.
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    /// Run a DICOM node on this port (on --bind's address): C-ECHO and C-STORE in, each
    /// complete study matched against the [[pacs.protocol]] table and run, results sent back
    /// as SR, SEG and overlay images (see docs/pacs.md).
    #[arg(long, env = "HILUM_DICOM_PORT")]
    pub dicom_port: Option<u16>,
    /// The node's AE title (default HILUM, or `ae_title` in [pacs]).
    #[arg(long)]
    pub dicom_ae: Option<String>,
    /// A calling AE title allowed to send (repeatable; default: any, or [pacs] allowed_callers).
    #[arg(long)]
    pub dicom_allow_ae: Vec<String>,
    /// A host allowed to send (repeatable; default: any, or [pacs] allowed_hosts).
    #[arg(long)]
    pub dicom_allow_host: Vec<std::net::IpAddr>,
    /// Where received instances and results are kept.
    #[arg(long)]
    pub dicom_dir: Option<PathBuf>,
    /// Seconds without a new instance after which a study counts as complete (default 5).
    #[arg(long)]
    pub pacs_quiet_secs: Option<f64>,
    /// The PACS's DICOMweb root to send results to by STOW-RS
    /// (http://pacs:8042/dicom-web).
    #[arg(long, env = "HILUM_PACS_DEST")]
    pub pacs_dest: Option<String>,
    /// Seconds a job being worked on stays its server's: work a killed server left is taken
    /// up again after this (default 60; keep it longer than a protocol run).
    #[arg(long)]
    pub pacs_lease_secs: Option<f64>,
    /// Send attempts before a job is `failed` (default 5; waits 2 s, 4 s, 8 s, … between them).
    #[arg(long)]
    pub pacs_send_attempts: Option<i64>,
    /// Bearer token for --pacs-dest, if the PACS asks for one.
    #[arg(long, env = "HILUM_PACS_DEST_TOKEN", hide_env_values = true)]
    pub pacs_dest_token: Option<String>,
}

impl ServeArgs {
    /// `--db`, with `--db-ca-file` put into a PostgreSQL URL's query.
    pub fn db_url(&self) -> String {
        let Some(ca) = &self.db_ca_file else {
            return self.db.clone();
        };
        let pg = self.db.starts_with("postgres://") || self.db.starts_with("postgresql://");
        let query = self.db.split_once('?').map_or("", |(_, q)| q);
        let has = |key: &str| query.split('&').any(|p| p.starts_with(key));
        if !pg || has("sslrootcert=") {
            return self.db.clone();
        }
        let mut url = self.db.clone();
        url.push(if url.contains('?') { '&' } else { '?' });
        if !has("sslmode=") {
            url.push_str("sslmode=verify-full&");
        }
        // The characters that would end the value early or start an escape.
        let path = ca
            .display()
            .to_string()
            .replace('%', "%25")
            .replace('&', "%26")
            .replace('#', "%23");
        url.push_str(&format!("sslrootcert={path}"));
        url
    }
}

#[derive(Subcommand)]
pub enum ServeCmd {
    /// Manage API tokens (stored hashed; the token is printed once).
    Token {
        #[command(subcommand)]
        cmd: TokenCmd,
    },
    /// The append-only audit log.
    Audit {
        #[command(subcommand)]
        cmd: AuditCmd,
    },
}

#[derive(Subcommand)]
pub enum TokenCmd {
    /// Create a token and print it.
    Create {
        /// Who or what uses it (a workstation, a service).
        #[arg(long)]
        name: String,
        /// May export the audit log.
        #[arg(long)]
        admin: bool,
    },
    /// List tokens: id, name, admin, created, revoked (never the secrets).
    List {
        /// One JSON object per line.
        #[arg(long)]
        json: bool,
    },
    /// Revoke a token for good. Running servers refuse it within a second (their
    /// revocation poll), including requests their authentication cache would have let in.
    Revoke {
        /// The token id (`tok_...`, from `token list`), not the secret.
        id: String,
    },
}

#[derive(Subcommand)]
pub enum AuditCmd {
    /// Print audit rows as JSON lines.
    Export {
        /// Only rows after this sequence number.
        #[arg(long, default_value_t = 0)]
        since: i64,
    },
}

#[derive(Args)]
pub struct McpArgs {
    #[command(flatten)]
    pub devices: crate::config::DeviceFlag,
    /// Budget of one tool call, seconds.
    #[arg(long, default_value_t = 300)]
    pub tool_timeout: u64,
    /// Log lines on stderr (stdout is the MCP channel): text, or one JSON object per line.
    /// RUST_LOG filters them (default `info`).
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
}

pub async fn run(args: ServeArgs) -> anyhow::Result<()> {
    let db_url = args.db_url();
    match args.cmd {
        Some(ServeCmd::Token {
            cmd: TokenCmd::Create { name, admin },
        }) => {
            let db = Db::open(&db_url)?;
            let (id, secret) = db.create_token(&name, admin)?;
            eprintln!(
                "created token {id} for `{name}`{}; it is shown only once:",
                if admin { " (admin)" } else { "" }
            );
            println!("{secret}");
            Ok(())
        }
        Some(ServeCmd::Token {
            cmd: TokenCmd::List { json },
        }) => {
            let db = Db::open(&db_url)?;
            let mut out = std::io::stdout().lock();
            let rows = db.list_tokens()?;
            if json {
                for r in &rows {
                    writeln!(out, "{}", serde_json::to_string(r)?)?;
                }
            } else {
                writeln!(
                    out,
                    "{:<30} {:<24} {:<6} {:<24} revoked",
                    "id", "name", "admin", "created"
                )?;
                for r in &rows {
                    writeln!(
                        out,
                        "{:<30} {:<24} {:<6} {:<24} {}",
                        r.id,
                        r.name,
                        if r.admin { "yes" } else { "no" },
                        utc(r.created_ms),
                        r.revoked_ms.map(utc).unwrap_or_else(|| "-".into())
                    )?;
                }
            }
            Ok(())
        }
        Some(ServeCmd::Token {
            cmd: TokenCmd::Revoke { id },
        }) => {
            let db = Db::open(&db_url)?;
            if db.revoke_token(&id)? {
                eprintln!("revoked token {id}; running servers refuse it within a second");
            } else {
                eprintln!("token {id} was already revoked");
            }
            Ok(())
        }
        Some(ServeCmd::Audit {
            cmd: AuditCmd::Export { since },
        }) => {
            let db = Db::open(&db_url)?;
            let mut out = std::io::stdout().lock();
            let mut since = since;
            loop {
                let rows = db.audit_since(since, 10_000)?;
                let Some(last) = rows.last() else { break };
                since = last.seq;
                for r in &rows {
                    writeln!(out, "{}", serde_json::to_string(r)?)?;
                }
            }
            Ok(())
        }
        None => serve(args).await,
    }
}

async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    logging::install(args.log_format, "info")?;
    let file = load_file(args.config.as_deref())?;
    let llm = match LlmChoice::resolve(args.llm.clone(), args.base_url.clone(), &file.llm) {
        Ok(choice) => {
            // Fail at start, not at the first question.
            let first = choice.build()?;
            // A model in this process (`local:`, `local-vlm:`) is loaded once and shared by the
            // runs: reloading gigabytes of weights per question would dominate every answer.
            let shared = choice.spec.starts_with("local").then_some(first);
            let choice = Arc::new(choice);
            Some(LlmFactory {
                name: choice.spec.clone(),
                local: choice.is_local(),
                build: Arc::new(move || match &shared {
                    Some(llm) => Ok(llm.clone()),
                    None => choice.build().map_err(|e| format!("{e:#}")),
                }),
            })
        }
        Err(e) => {
            notice(&format!("hilum serve: {e:#}"));
            notice("hilum serve: continuing without a model: questions will answer 503");
            None
        }
    };
    let mut cfg = ServerConfig::new(args.db_url());
    cfg.bind = args.bind;
    cfg.max_upload_bytes = args.max_upload_mb << 20;
    cfg.max_image_memory_bytes = file
        .serve
        .max_image_memory_bytes(args.max_image_memory_mb)?;
    cfg.rate_limit = RateLimit {
        per_sec: args.rate_limit,
        burst: args.rate_burst,
    };
    cfg.allow_remote_llm = args.allow_remote_llm;
    cfg.send_pixels = args.send_pixels || file.llm.send_pixels.unwrap_or(false);
    cfg.cors_origins = args.cors_origin.clone();
    cfg.tool_timeout = Duration::from_secs(args.tool_timeout);
    cfg.drain = secs("--drain-secs", args.drain_secs)?;
    cfg.run_heartbeat = secs("--run-heartbeat-secs", args.run_heartbeat_secs)?;
    cfg.run_stale_after = secs("--run-stale-secs", args.run_stale_secs)?;
    if cfg.run_stale_after <= cfg.run_heartbeat {
        anyhow::bail!(
            "--run-stale-secs ({}) must be longer than --run-heartbeat-secs ({}): a live server's runs would be taken for a dead one's",
            args.run_stale_secs,
            args.run_heartbeat_secs
        );
    }
    file.agent.apply_grounding(&mut cfg.agent)?;
    if let Some(l) = &llm {
        if !l.local && !cfg.allow_remote_llm {
            notice(&format!(
                "hilum serve: `{}` is not on this machine; questions are refused unless --allow-remote-llm",
                l.name
            ));
        }
    }
    cfg.llm = llm;
    // One model pool for the whole process: every token's toolbox shares it.
    let shared = crate::config::tool_deps(Arc::new(ImageStore::default()), file.vlm.clone())?;
    cfg.models = Some(shared.models.clone());
    // Which models are installed (and what installs the others): the offer and the coverage
    // check read it, as `hilum analyze` does.
    cfg.env = hilum_tools::environment(&shared, &[]);
    let remote = crate::remote::connect(&file.mcp, &args.mcp).await?;
    cfg.toolbox = crate::remote::with_remote(
        hilum_server::toolbox_factory(crate::registry().clone(), shared),
        remote,
    );
    if let Some(port) = args.dicom_port {
        cfg.pacs = Some(pacs_settings(&args, &file.pacs, port)?);
    }
    let state = AppState::new(cfg)
        .with_context(|| format!("cannot open {}", hilum_server::db::shown_url(&args.db)))?;
    let (tx, rx) = tokio::sync::oneshot::channel();
    let server = tokio::spawn(hilum_server::serve(state, shutdown_signal(), Some(tx)));
    if let Ok(addr) = rx.await {
        notice(&format!(
            "hilum serve: listening on http://{addr} (API /v1, MCP /mcp, docs /openapi.json)"
        ));
    }
    server.await.context("the server task failed")??;
    notice("hilum serve: stopped");
    Ok(())
}

fn secs(flag: &str, v: f64) -> anyhow::Result<Duration> {
    Duration::try_from_secs_f64(v)
        .map_err(|_| anyhow::anyhow!("{flag} must be a number of seconds ≥ 0, not {v}"))
}

/// Milliseconds since the epoch as `YYYY-MM-DD HH:MM:SS UTC`.
fn utc(ms: i64) -> String {
    match chrono::DateTime::from_timestamp_millis(ms) {
        Some(t) => t.format("%Y-%m-%d %H:%M:%S UTC").to_string(),
        None => format!("{ms} ms since 1970"),
    }
}

/// SIGINT (Ctrl-C) or, on Unix, SIGTERM (what service managers and orchestrators send).
async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(e) => {
                notice(&format!(
                    "hilum serve: cannot listen for SIGTERM ({e}); Ctrl-C still stops the server"
                ));
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
    notice("hilum serve: shutting down: no new connections; running runs may finish");
}

/// The DICOM node's settings: the flags, else the config file's [pacs] table, else defaults.
fn pacs_settings(
    args: &ServeArgs,
    file: &crate::config::PacsSection,
    port: u16,
) -> anyhow::Result<hilum_server::pacs::PacsSettings> {
    let dir = args
        .dicom_dir
        .clone()
        .or_else(|| file.storage_dir.clone())
        .unwrap_or_else(|| match hilum_server::db::parse_url(&args.db) {
            Ok(hilum_server::db::DbUrl::Sqlite(p)) => p
                .parent()
                .map(|d| d.join("hilum-pacs"))
                .unwrap_or_else(|| PathBuf::from("hilum-pacs")),
            _ => PathBuf::from("hilum-pacs"),
        });
    let mut s = hilum_server::pacs::PacsSettings::new(SocketAddr::new(args.bind.ip(), port), dir);
    if let Some(ae) = args.dicom_ae.clone().or_else(|| file.ae_title.clone()) {
        s.ae_title = ae;
    }
    s.allowed_callers = if args.dicom_allow_ae.is_empty() {
        file.allowed_callers.clone()
    } else {
        args.dicom_allow_ae.clone()
    };
    s.allowed_hosts = if args.dicom_allow_host.is_empty() {
        file.allowed_hosts.clone()
    } else {
        args.dicom_allow_host.clone()
    };
    if let Some(q) = args.pacs_quiet_secs.or(file.quiet_secs) {
        s.quiet = secs("--pacs-quiet-secs", q)?;
    }
    if let Some(n) = args.pacs_send_attempts {
        anyhow::ensure!(n >= 1, "--pacs-send-attempts must be at least 1, not {n}");
        s.max_send_attempts = n;
    }
    if let Some(l) = args.pacs_lease_secs {
        s.lease = secs("--pacs-lease-secs", l)?;
    }
    if let Some(mb) = file.max_object_mb {
        s.max_object_bytes = mb << 20;
    }
    if let Some(n) = file.max_associations {
        s.max_associations = n;
    }
    // Without a [[pacs.protocol]] table the settings' default (`cxr`) stands.
    if !file.protocol.is_empty() {
        s.protocols = file.protocol.clone();
    }
    s.destination = args
        .pacs_dest
        .clone()
        .or_else(|| file.destination.clone())
        .map(|url| hilum_server::pacs::Destination {
            url,
            bearer: args.pacs_dest_token.clone(),
        });
    Ok(s)
}

pub async fn run_mcp(args: McpArgs) -> anyhow::Result<()> {
    // stdout carries the protocol: nothing else may be printed there (logs go to stderr).
    logging::install(args.log_format, "info")?;
    let file = crate::config::load_file(None)?;
    let shared = crate::config::tool_deps(Arc::new(ImageStore::default()), file.vlm)?;
    let env = hilum_tools::environment(&shared, &[]);
    hilum_server::mcp::serve_stdio(
        &hilum_server::toolbox_factory(crate::registry().clone(), shared),
        env,
        Duration::from_secs(args.tool_timeout),
    )
    .await
    .map_err(anyhow::Error::msg)
}

#[cfg(test)]
mod tests {
    use super::utc;

    #[test]
    fn token_times_print_as_utc() {
        assert_eq!(utc(0), "1970-01-01 00:00:00 UTC");
        assert_eq!(utc(1_700_000_000_123), "2023-11-14 22:13:20 UTC");
        assert_eq!(utc(951_782_400_000), "2000-02-29 00:00:00 UTC");
    }
}
