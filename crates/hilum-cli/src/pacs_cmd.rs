//! `hilum pacs`: the DICOM node's jobs (list, retry) and pulling a study from a PACS by
//! DICOMweb (QIDO-RS + WADO-RS).

use std::io::Write;
use std::path::PathBuf;

use anyhow::Context;
use clap::{Args, Subcommand};
use hilum_server::Db;

#[derive(Args)]
#[command(after_help = "Examples:
  hilum pacs jobs                                  the node's jobs, newest first
  hilum pacs retry job_3fa2…                       queue a failed job again (it resends)
  hilum pacs pull --url http://pacs:8042/dicom-web --study 1.2.840… --out study/
  hilum analyze study/*.dcm --question \"Is the heart enlarged?\"")]
pub struct PacsArgs {
    /// The database `hilum serve` uses (its jobs live there).
    #[arg(long, global = true, env = "HILUM_DB", default_value = crate::serve_cmd::DEFAULT_DB)]
    pub db: String,
    #[command(subcommand)]
    pub cmd: PacsCmd,
}

#[derive(Subcommand)]
pub enum PacsCmd {
    /// List the DICOM node's jobs: study, state, protocol, attempts, what happened last.
    Jobs {
        /// One JSON object per line.
        #[arg(long)]
        json: bool,
        /// How many, newest first.
        #[arg(long, default_value_t = 50)]
        limit: i64,
    },
    /// Queue a job again: it runs its protocol (or resends its results) on the running server.
    Retry { id: String },
    /// Download a study from a PACS by DICOMweb into a folder, one file per instance.
    Pull {
        /// The PACS's DICOMweb root, e.g. http://pacs:8042/dicom-web.
        #[arg(long, env = "HILUM_PACS_URL")]
        url: String,
        /// StudyInstanceUID.
        #[arg(long)]
        study: String,
        /// Folder to write into (created).
        #[arg(long, default_value = "hilum-study")]
        out: PathBuf,
        /// Bearer token for the PACS (HILUM_PACS_TOKEN).
        #[arg(long, env = "HILUM_PACS_TOKEN", hide_env_values = true)]
        token: Option<String>,
    },
}

pub async fn run(args: PacsArgs) -> anyhow::Result<()> {
    match args.cmd {
        PacsCmd::Jobs { json, limit } => {
            let db = Db::open(&args.db).with_context(|| format!("cannot open {}", args.db))?;
            let jobs = db.pacs_jobs(limit).await?;
            let mut out = std::io::stdout().lock();
            if json {
                for j in &jobs {
                    writeln!(out, "{}", serde_json::to_string(j)?)?;
                }
            } else if jobs.is_empty() {
                eprintln!("no jobs yet: `hilum serve --dicom-port 11112` receives studies");
            } else {
                writeln!(
                    out,
                    "{:<30} {:<9} {:<14} {:>4} {:>3}  detail",
                    "id", "state", "protocol", "inst", "try"
                )?;
                for j in &jobs {
                    writeln!(
                        out,
                        "{:<30} {:<9} {:<14} {:>4} {:>3}  {}",
                        j.id,
                        j.state,
                        j.protocol.as_deref().unwrap_or("-"),
                        j.instances,
                        j.attempts,
                        j.detail.as_deref().unwrap_or("")
                    )?;
                }
            }
            Ok(())
        }
        PacsCmd::Retry { id } => {
            let db = Db::open(&args.db).with_context(|| format!("cannot open {}", args.db))?;
            if db.pacs_retry(id.clone()).await? {
                eprintln!("queued {id} again; the running server takes it within a second");
                Ok(())
            } else {
                anyhow::bail!("no job `{id}`: `hilum pacs jobs` lists them")
            }
        }
        PacsCmd::Pull {
            url,
            study,
            out,
            token,
        } => {
            let mut cfg = hilum_pacs::dicomweb::DicomWebConfig::new(url);
            if let Some(t) = token {
                cfg = cfg.bearer(t);
            }
            let client = hilum_pacs::dicomweb::DicomWebClient::new(cfg)?;
            let paths = hilum_pacs::dicomweb::pull_study(&client, &study, &out).await?;
            eprintln!("pulled {} instance(s) into {}", paths.len(), out.display());
            for p in paths {
                println!("{}", p.display());
            }
            Ok(())
        }
    }
}
