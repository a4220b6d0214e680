//! `hilum models`: list, fetch, import and verify model weights; export the CNNs for Triton.

use std::path::PathBuf;

use anyhow::{bail, Context};
use clap::Subcommand;
use hilum_models::triton::{ExportOptions, Exported};
use hilum_models::{FetchOptions, FetchProgress, ImportOptions, ModelRegistry};
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::json;

#[derive(Subcommand)]
pub enum ModelsCmd {
    /// Known models: installed or not, size, license, custom checkpoints. Weights live in
    /// HILUM_MODELS_DIR (default: the user's data directory, e.g. ~/.local/share/hilum/models).
    List {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Download a model's published weights (HTTPS, resumable, sha256-verified), convert them
    /// to safetensors where needed and install them, with the config and tokenizer files its
    /// manifest lists (`fetch_files`). Hugging Face models come through the Hub cache shared
    /// with Python tools (HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub; a file
    /// already there is not downloaded again); HF_TOKEN for gated models, HF_ENDPOINT for a
    /// mirror of the Hub.
    Fetch {
        /// Model id, e.g. lung-unet (see `hilum models list`).
        id: String,
        /// Download from this URL instead (a site mirror of the same file; the manifest's
        /// `fetch_files` are taken from the same folder).
        #[arg(long)]
        url: Option<String>,
    },
    /// Install weights from a local file: the published checkpoint on a machine without
    /// internet, or a site's own checkpoint of the same architecture with --custom.
    /// PyTorch .pt/.pth/.bin and Keras .h5 files are read in Rust: no Python, and nothing in
    /// them runs.
    Import {
        /// Model id, e.g. lung-unet.
        id: String,
        /// The checkpoint (.pt/.pth/.bin, .h5, .safetensors, or a model's .onnx).
        path: PathBuf,
        /// Accept a checkpoint other than the published one when its parameter names and
        /// shapes match the architecture; it is marked custom in listings and tool outputs.
        #[arg(long)]
        custom: bool,
    },
    /// Re-check installed weights: sha256 against the install record, names and shapes against
    /// the architecture. All installed models when no id is given.
    Verify { ids: Vec<String> },
    /// Write a Triton Inference Server model repository for the installed CNNs Hilum has ONNX
    /// graphs of (DenseNet-121, ResNet-50, the lung U-Net, the ChestX-Det PSPNet, MedSAM's image
    /// encoder): DIR/<model>/1/model.onnx and DIR/<model>/config.pbtxt. Serve it with `tritonserver
    /// --model-repository DIR`, then run the tools with `--backend kserve` and `[remote] url`
    /// (or HILUM_KSERVE_URL) set.
    ExportTriton {
        /// The repository to write (created if needed; models already in it are overwritten).
        dir: PathBuf,
        /// Model ids (default: every installed model with a graph).
        ids: Vec<String>,
        /// GPUs to serve on, one instance group each (KIND_GPU, gpus [i]); 0: on the CPU.
        #[arg(long, default_value_t = 0)]
        gpus: usize,
        /// Model instances per GPU (or on the CPU).
        #[arg(long, default_value_t = 1)]
        instances: usize,
        /// Largest batch Triton's dynamic batcher forms.
        #[arg(long, default_value_t = 16)]
        max_batch_size: usize,
        /// How long the batcher may hold a request to fill a batch (microseconds).
        #[arg(long, default_value_t = 1000)]
        max_queue_delay_us: u64,
    },
}

pub async fn run(cmd: ModelsCmd) -> anyhow::Result<()> {
    let registry = ModelRegistry::new(&crate::model_settings().models_dir)?;
    match cmd {
        ModelsCmd::List { json } => list(&registry, json),
        ModelsCmd::Fetch { id, url } => {
            let hub = crate::config::hub_settings();
            let opts = FetchOptions {
                url,
                endpoint: hub.endpoint,
                token: hub.token,
                hub_cache: hub.cache,
                import: ImportOptions::default(),
            };
            let mut bar = Bar(None);
            let inst = hilum_models::fetch(&registry, &id, &opts, &mut bar).await?;
            println!(
                "installed {id}: {} ({} bytes, sha256 {})",
                inst.weights.display(),
                inst.size,
                inst.record.sha256
            );
            Ok(())
        }
        ModelsCmd::Import { id, path, custom } => {
            let opts = ImportOptions {
                custom,
                origin: None,
            };
            let inst = tokio::task::spawn_blocking(move || {
                let mut bar = ImportBar::new(&id);
                let inst =
                    hilum_models::import_with_progress(&registry, &id, &path, &opts, &mut bar);
                bar.0.finish_and_clear();
                inst.map(|i| (id, i))
            })
            .await
            .context("import task")?;
            let inst = inst?;
            let (id, inst) = inst;
            println!(
                "installed {id}{}: {} ({} bytes)\n  sha256 {}\n  source sha256 {} ({})",
                if inst.record.custom { " (custom)" } else { "" },
                inst.weights.display(),
                inst.size,
                inst.record.sha256,
                inst.record.source_sha256,
                inst.record.source
            );
            Ok(())
        }
        ModelsCmd::Verify { ids } => verify(&registry, ids),
        ModelsCmd::ExportTriton {
            dir,
            ids,
            gpus,
            instances,
            max_batch_size,
            max_queue_delay_us,
        } => {
            let opts = ExportOptions {
                gpus,
                instances,
                max_batch_size,
                max_queue_delay_us,
            };
            let repo = dir.clone();
            let done = tokio::task::spawn_blocking(move || {
                hilum_models::triton::export_triton(&registry, &repo, &ids, &opts)
            })
            .await
            .context("export task")??;
            let mut written = 0;
            for e in &done {
                match e {
                    Exported::Written {
                        id,
                        dir,
                        graph,
                        input,
                        output,
                        max_batch_size,
                    } => {
                        written += 1;
                        println!(
                            "wrote {id}: {} ({graph}; {} {} -> {} {}; max_batch_size {max_batch_size})",
                            dir.display(),
                            input.name,
                            dims(&input.dims),
                            output.name,
                            dims(&output.dims)
                        );
                    }
                    Exported::Skipped { id, reason } => println!("skipped {id}: {reason}"),
                }
            }
            if written == 0 {
                bail!(
                    "no model exported: install one first (`hilum models list`; the lung U-Net \
                     needs its ONNX graph imported, `hilum models import lung-unet \
                     lung_seg_valiou_088.onnx`)"
                );
            }
            println!(
                "serve it: tritonserver --model-repository {} (a test server: \
                 scripts/deploy/triton_serve.py {}); then --backend kserve with HILUM_KSERVE_URL or \
                 [remote] url",
                dir.display(),
                dir.display()
            );
            Ok(())
        }
    }
}

/// `[batch, 1, 224, 224]` from graph dimensions (`batch` where symbolic).
fn dims(d: &[Option<usize>]) -> String {
    let parts: Vec<String> = d
        .iter()
        .map(|d| d.map_or("batch".to_string(), |n| n.to_string()))
        .collect();
    format!("[{}]", parts.join(", "))
}

fn list(registry: &ModelRegistry, as_json: bool) -> anyhow::Result<()> {
    let status = registry.status();
    if as_json {
        let rows: Vec<_> = status
            .iter()
            .map(|s| {
                let m = &s.manifest;
                json!({
                    "id": m.id,
                    "name": m.name,
                    "task": m.task,
                    "architecture": m.architecture,
                    "license": m.license,
                    "installed": s.installed.is_some(),
                    "custom": s.installed.as_ref().map(|i| i.record.custom),
                    "size_bytes": s.installed.as_ref().map(|i| i.size),
                    "sha256": s.installed.as_ref().map(|i| i.record.sha256.clone()),
                    "path": s.installed.as_ref().map(|i| i.weights.display().to_string()),
                    "source": m.source.download_url().or(m.source.homepage.clone()),
                })
            })
            .collect();
        let out = json!({"models_dir": registry.dir().display().to_string(), "models": rows});
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    println!("models directory: {}", registry.dir().display());
    println!(
        "{:<24} {:<15} {:<10} {:>9}  {:<11} SOURCE",
        "ID", "TASK", "INSTALLED", "SIZE", "LICENSE"
    );
    for s in &status {
        let m = &s.manifest;
        let (state, size) = match &s.installed {
            Some(i) if i.record.custom => ("custom", human(i.size)),
            Some(i) => ("yes", human(i.size)),
            None => ("no", "-".to_string()),
        };
        let source = m
            .source
            .download_url()
            .or(m.source.homepage.clone())
            .unwrap_or_default();
        println!(
            "{:<24} {:<15} {:<10} {:>9}  {:<11} {}",
            m.id, m.task, state, size, m.license, source
        );
    }
    Ok(())
}

fn verify(registry: &ModelRegistry, ids: Vec<String>) -> anyhow::Result<()> {
    let ids: Vec<String> = if ids.is_empty() {
        registry
            .status()
            .into_iter()
            .filter(|s| s.installed.is_some())
            .map(|s| s.manifest.id)
            .collect()
    } else {
        ids
    };
    if ids.is_empty() {
        println!("no models installed in {}", registry.dir().display());
        return Ok(());
    }
    let mut bad = 0;
    for id in &ids {
        let report = registry.verify(id)?;
        if report.ok {
            println!("{id}: ok");
        } else {
            bad += 1;
            println!("{id}: FAILED");
            for p in &report.problems {
                println!("  - {p}");
            }
        }
    }
    if bad > 0 {
        bail!("{bad} model(s) failed verification: reinstall them with `hilum models fetch ID` or `hilum models import ID PATH`");
    }
    Ok(())
}

fn human(bytes: u64) -> String {
    if bytes >= 1 << 20 {
        format!("{:.1} MB", bytes as f64 / (1u64 << 20) as f64)
    } else {
        format!("{:.0} kB", bytes as f64 / 1024.0)
    }
}

/// The steps of `models import` on stderr: a byte bar while it hashes and copies, a spinner
/// while it converts and checks. Drawn only when stderr is a terminal, so piped or captured
/// output stays clean.
struct ImportBar(ProgressBar, String);

impl ImportBar {
    fn new(id: &str) -> Self {
        use std::io::IsTerminal;
        let bar = if std::io::stderr().is_terminal() {
            ProgressBar::new_spinner()
        } else {
            ProgressBar::hidden()
        };
        ImportBar(bar, id.to_string())
    }
}

impl hilum_models::ImportProgress for ImportBar {
    fn step(&mut self, what: &str, total: Option<u64>) {
        let template = match total {
            Some(_) => "{msg} {bar:30} {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
            None => "{spinner} {msg} {elapsed}",
        };
        if let Ok(style) = ProgressStyle::with_template(template) {
            self.0.set_style(style);
        }
        self.0.set_message(format!("importing {}: {what}", self.1));
        self.0.set_position(0);
        match total {
            Some(t) => {
                self.0.disable_steady_tick();
                self.0.set_length(t);
            }
            None => self
                .0
                .enable_steady_tick(std::time::Duration::from_millis(120)),
        }
    }
    fn advance(&mut self, bytes: u64) {
        self.0.inc(bytes);
    }
}

/// A progress bar on stderr for downloads.
struct Bar(Option<ProgressBar>);

impl FetchProgress for Bar {
    fn start(&mut self, total: Option<u64>, done: u64) {
        let bar = match total {
            Some(t) => ProgressBar::new(t),
            None => ProgressBar::new_spinner(),
        };
        if let Ok(style) =
            ProgressStyle::with_template("{bar:40} {bytes}/{total_bytes} {bytes_per_sec} eta {eta}")
        {
            bar.set_style(style);
        }
        bar.set_position(done);
        self.0 = Some(bar);
    }
    fn advance(&mut self, bytes: u64) {
        if let Some(b) = &self.0 {
            b.inc(bytes);
        }
    }
    fn finish(&mut self) {
        if let Some(b) = self.0.take() {
            b.finish_and_clear();
        }
    }
}
