//! The one typed configuration: flags first, then environment (`OPENAI_API_KEY`,
//! `OPENAI_BASE_URL`, `HILUM_*`, and the Hugging Face Hub's `HF_*` for `hilum models fetch`),
//! then a TOML file (`--config`, `HILUM_CONFIG`, or `$XDG_CONFIG_HOME/hilum/config.toml`, by
//! default `~/.config/hilum/config.toml`).
//!
//! This module is the only place outside `main`s that reads the environment: library crates
//! take their settings as values (a test in `tests/it/env_reads.rs` keeps it so). The models'
//! settings ([`model_settings`]: models dir, CPU kernels, pool concurrency, ONNX Runtime, LLaVA
//! quantization) come from the variables `hilum_models::ModelSettings::from_vars` names.

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use anyhow::{bail, Context};
use serde::Deserialize;

use hilum_llm::{Llm, OpenAiConfig, OpenAiLlm, ScriptLlm};
use hilum_llm_local::{LocalConfig, LocalLlm, VlmFiles};

/// The `[llm]` and `[agent]` tables of the config file; every field optional.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    #[serde(default)]
    pub llm: LlmSection,
    #[serde(default)]
    pub agent: AgentSection,
    /// Served VLM endpoints for `ground_phrase` / `answer_visual_question` (validated here,
    /// applied by `hilum_tools::VlmSettings`).
    #[serde(default)]
    pub vlm: hilum_tools::VlmSettings,
    /// `[backends]`: the former name of `[models.backend]` (backend per model id, `"*"` for
    /// every model that runs on it); `[models.backend]` wins where both name a model.
    #[serde(default)]
    pub backends: std::collections::BTreeMap<String, String>,
    /// `[remote]`: the KServe v2 inference server (Triton) of `--backend kserve`.
    #[serde(default)]
    pub remote: RemoteSection,
    /// `[models]`: where weights live and how models run; each key has a variable that wins
    /// over it.
    #[serde(default)]
    pub models: ModelsSection,
    /// `[serve]`: settings of `hilum serve` that its flags override.
    #[serde(default)]
    pub serve: ServeSection,
    /// `[pacs]`: the DICOM node of `hilum serve --dicom-port` and its `[[pacs.protocol]]` table.
    #[serde(default)]
    pub pacs: PacsSection,
    /// `[mcp]`: other MCP servers whose tools join the toolbox (`[[mcp.servers]]`).
    #[serde(default)]
    pub mcp: hilum_tools::remote::McpSection,
}

/// The `[pacs]` table; the `--dicom-*` and `--pacs-*` flags win over it.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PacsSection {
    /// The node's AE title (default HILUM).
    pub ae_title: Option<String>,
    /// Calling AE titles allowed to send (empty: any).
    #[serde(default)]
    pub allowed_callers: Vec<String>,
    /// Hosts allowed to send (empty: any).
    #[serde(default)]
    pub allowed_hosts: Vec<std::net::IpAddr>,
    /// Where received instances and written results are kept (default: hilum-pacs beside the
    /// database file, or ./hilum-pacs).
    pub storage_dir: Option<PathBuf>,
    /// Seconds without a new instance after which a study counts as complete.
    pub quiet_secs: Option<f64>,
    /// The PACS's DICOMweb root results are sent to (STOW-RS).
    pub destination: Option<String>,
    /// Largest object accepted, MiB.
    pub max_object_mb: Option<u64>,
    /// Associations at once.
    pub max_associations: Option<usize>,
    /// `[[pacs.protocol]]`: which studies run what (default: CR and DX run the classifier,
    /// the lung segmentation and the chest measurements, where installed).
    #[serde(default)]
    pub protocol: Vec<hilum_pacs::protocol::Protocol>,
}

/// The `[serve]` table.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServeSection {
    /// `--max-image-memory-mb`: memory each token's images may hold, MiB (0: no bound).
    pub max_image_memory_mb: Option<u64>,
}

/// Default of `--max-image-memory-mb`: a few dozen decoded radiographs per token.
pub const DEFAULT_MAX_IMAGE_MEMORY_MB: u64 = 256;

impl ServeSection {
    /// The per-token image memory bound in bytes: the flag, else the file, else the default.
    pub fn max_image_memory_bytes(&self, flag: Option<u64>) -> anyhow::Result<u64> {
        let mb = flag
            .or(self.max_image_memory_mb)
            .unwrap_or(DEFAULT_MAX_IMAGE_MEMORY_MB);
        mb.checked_mul(1 << 20)
            .with_context(|| format!("--max-image-memory-mb {mb} is too large"))
    }
}

/// The `[models]` table. Each key stands for the variable named beside it, which wins over
/// it: the file is the site's default, the environment the run's.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelsSection {
    /// `HILUM_MODELS_DIR`
    pub dir: Option<PathBuf>,
    /// `HILUM_CPU_THREADS`
    pub cpu_threads: Option<usize>,
    /// `HILUM_CPU_CONCURRENCY`
    pub cpu_concurrency: Option<usize>,
    /// `HILUM_GPU_CONCURRENCY`
    pub gpu_concurrency: Option<usize>,
    /// `ORT_DYLIB_PATH`: the ONNX Runtime shared library.
    pub onnxruntime: Option<PathBuf>,
    /// `HILUM_LLAVA_QUANTIZE`: `none`, `q8_0` or `q4k`.
    pub llava_quantize: Option<String>,
    /// `HILUM_MAX_REPLICAS`
    pub max_replicas: Option<usize>,
    /// `HILUM_BATCH_MAX_SIZE`: concurrent calls of one model gathered into one forward pass at
    /// most (unset or 1: no dynamic batching).
    pub batch_max_size: Option<usize>,
    /// `HILUM_BATCH_DELAY_MS`: how long a batch waits for more calls (default 2).
    pub batch_delay_ms: Option<usize>,
    /// `HILUM_DEVICE`: `auto`, `cpu`, `cuda:N` or a list (`cuda:0,cuda:1`).
    pub device: Option<String>,
    /// `[models.backend]`, `HILUM_BACKEND`: the backend of each model id (`"*"`: every model
    /// that runs on it), e.g. `lung-unet = "kserve"`; every tool using a model uses it.
    #[serde(default)]
    pub backend: std::collections::BTreeMap<String, String>,
}

impl ModelsSection {
    /// The value of the variable `name` as this table gives it.
    fn var(&self, name: &str) -> Option<String> {
        let path = |p: &Option<PathBuf>| p.as_ref().map(|p| p.display().to_string());
        let number = |n: &Option<usize>| n.map(|n| n.to_string());
        match name {
            "HILUM_MODELS_DIR" => path(&self.dir),
            "HILUM_CPU_THREADS" => number(&self.cpu_threads),
            "HILUM_CPU_CONCURRENCY" => number(&self.cpu_concurrency),
            "HILUM_GPU_CONCURRENCY" => number(&self.gpu_concurrency),
            "ORT_DYLIB_PATH" => path(&self.onnxruntime),
            "HILUM_LLAVA_QUANTIZE" => self.llava_quantize.clone(),
            "HILUM_MAX_REPLICAS" => number(&self.max_replicas),
            "HILUM_BATCH_MAX_SIZE" => number(&self.batch_max_size),
            "HILUM_BATCH_DELAY_MS" => number(&self.batch_delay_ms),
            "HILUM_DEVICE" => self.device.clone(),
            "HILUM_BACKEND" if !self.backend.is_empty() => Some(
                self.backend
                    .iter()
                    .map(|(m, b)| format!("{m}={b}"))
                    .collect::<Vec<_>>()
                    .join(","),
            ),
            _ => None,
        }
    }
}

/// The config file's `[models]` table, recorded by the first [`load_file`] (the program reads
/// its file before the models' settings are made).
static FILE_MODELS: OnceLock<ModelsSection> = OnceLock::new();

/// A models' variable: the environment's value (set and not empty), else the `[models]` table's.
fn models_var(
    name: &str,
    env: impl Fn(&str) -> Option<String>,
    file: Option<&ModelsSection>,
) -> Option<String> {
    env(name)
        .filter(|v| !v.is_empty())
        .or_else(|| file.and_then(|f| f.var(name)))
}

/// The `[remote]` table: where `--backend kserve` sends the CNNs' forward passes. When
/// `HILUM_KSERVE_URL` is set, it and the other `HILUM_KSERVE_*` variables replace this table.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RemoteSection {
    /// Base URL of the server's HTTP endpoint, e.g. `http://triton:8000`.
    pub url: Option<String>,
    /// Longest wait for one answer (default 30).
    pub timeout_secs: Option<u64>,
    /// Further tries after a connection error or a 5xx answer (default 2).
    pub retries: Option<u32>,
    /// An in-process backend (`native`, `candle`, `onnx`) that runs a call while the server
    /// does not answer; unset: such a call fails with an error that says what to do.
    pub fallback: Option<String>,
}

impl RemoteSection {
    /// The client settings this table gives, if it names a server.
    pub fn settings(&self) -> anyhow::Result<Option<hilum_models::KserveSettings>> {
        let Some(url) = self.url.as_ref().filter(|u| !u.trim().is_empty()) else {
            return Ok(None);
        };
        let mut s = hilum_models::KserveSettings::bounded(
            url.trim(),
            self.timeout_secs,
            self.retries.map(u64::from),
        );
        if let Some(b) = &self.fallback {
            let b: hilum_models::Backend = b
                .parse()
                .map_err(|e| anyhow::anyhow!("[remote] fallback: {e}"))?;
            if b == hilum_models::Backend::Kserve {
                bail!("[remote] fallback must be an in-process backend: native, candle or onnx");
            }
            s.fallback = Some(b);
        }
        Ok(Some(s))
    }
}

/// The config file's `[remote]` settings, recorded by [`load_file`] for the model pool.
static FILE_REMOTE: std::sync::OnceLock<Option<hilum_models::KserveSettings>> =
    std::sync::OnceLock::new();

/// The models' settings with the kserve server: `HILUM_KSERVE_*` when set, else the config
/// file's `[remote]` table (as read by the command's [`load_file`]).
pub fn with_remote(mut settings: hilum_models::ModelSettings) -> hilum_models::ModelSettings {
    if settings.remote.is_none() {
        settings.remote = FILE_REMOTE.get().cloned().flatten();
    }
    settings
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LlmSection {
    /// `openai:MODEL`, `local:PATH.gguf`, `local-vlm:PATH`, `script:FILE`
    pub spec: Option<String>,
    pub base_url: Option<String>,
    pub api_key: Option<String>,
    pub timeout_secs: Option<u64>,
    pub send_pixels: Option<bool>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AgentSection {
    pub protocol: Option<String>,
    pub mode: Option<String>,
    pub max_rounds: Option<usize>,
    pub max_tool_calls: Option<usize>,
    pub deadline_secs: Option<u64>,
    pub tool_timeout_secs: Option<u64>,
    /// `first_round` (default): a question about an image answered without any tool call is
    /// sent back once; `never`: answers are taken as they come.
    pub require_tools: Option<String>,
    /// `false` turns off the grounding check of final answers.
    pub grounding: Option<bool>,
    /// Show the model the overlays its tool calls drew (only a model in this process that
    /// reads images; default on for it).
    pub show_overlays: Option<bool>,
}

/// The agent settings given as flags; each wins over the config file's `[agent]` table.
#[derive(Default)]
pub struct AgentFlags {
    pub protocol: Option<hilum_agent::Protocol>,
    pub mode: Option<hilum_agent::Mode>,
    pub max_rounds: Option<usize>,
    pub max_tool_calls: Option<usize>,
    pub deadline_secs: Option<u64>,
    pub tool_timeout_secs: Option<u64>,
    pub show_overlays: Option<bool>,
}

impl AgentSection {
    /// The agent's configuration: flags, then this table, then the defaults; a local model gets
    /// short observations; the tool policy and the grounding check as configured.
    pub fn resolve(
        &self,
        flags: AgentFlags,
        local: bool,
    ) -> anyhow::Result<hilum_agent::AgentConfig> {
        let defaults = hilum_agent::AgentConfig::default();
        let secs = std::time::Duration::from_secs;
        let mut config = hilum_agent::AgentConfig {
            protocol: match flags.protocol {
                Some(p) => p,
                None => match &self.protocol {
                    Some(p) => p.parse().map_err(anyhow::Error::msg)?,
                    None => defaults.protocol,
                },
            },
            mode: match flags.mode {
                Some(m) => m,
                None => match &self.mode {
                    Some(m) => m.parse().map_err(anyhow::Error::msg)?,
                    None => defaults.mode,
                },
            },
            max_rounds: flags
                .max_rounds
                .or(self.max_rounds)
                .unwrap_or(defaults.max_rounds),
            max_tool_calls: flags
                .max_tool_calls
                .or(self.max_tool_calls)
                .unwrap_or(defaults.max_tool_calls),
            deadline: flags
                .deadline_secs
                .or(self.deadline_secs)
                .map(secs)
                .unwrap_or(defaults.deadline),
            tool_timeout: flags
                .tool_timeout_secs
                .or(self.tool_timeout_secs)
                .map(secs)
                .unwrap_or(defaults.tool_timeout),
            // A small local model reads the summary line only: it quotes a short observation and
            // gets lost in a long one, and every token of data costs prompt time on a CPU (the
            // three results of `scripts/run.sh`'s question were ~1,100 tokens with 600
            // characters of data each).
            max_observation_chars: if local {
                0
            } else {
                defaults.max_observation_chars
            },
            show_overlays: flags.show_overlays.or(self.show_overlays),
            ..defaults
        };
        self.apply_grounding(&mut config)?;
        Ok(config)
    }

    /// Applies the tool policy and grounding keys to an agent configuration.
    pub fn apply_grounding(&self, config: &mut hilum_agent::AgentConfig) -> anyhow::Result<()> {
        if let Some(p) = &self.require_tools {
            config.require_tools = p
                .parse()
                .map_err(|e: String| anyhow::anyhow!("[agent] require_tools: {e}"))?;
        }
        if let Some(g) = self.grounding {
            config.grounding = g;
        }
        if let Some(o) = self.show_overlays {
            config.show_overlays = Some(o);
        }
        Ok(())
    }
}

/// Reads the config file: the explicit one must exist; the default one may be absent.
pub fn load_file(explicit: Option<&Path>) -> anyhow::Result<FileConfig> {
    let (path, required) = match explicit {
        Some(p) => (p.to_path_buf(), true),
        None => match std::env::var_os("HILUM_CONFIG") {
            Some(p) => (PathBuf::from(p), true),
            None => match default_config_path() {
                Some(p) => (p, false),
                None => return Ok(FileConfig::default()),
            },
        },
    };
    // The program reads the file once, before any command runs; a command that asks again
    // gets that same text, so a file edited meanwhile cannot give the command other settings
    // than the ones the models were set up with.
    static READ: OnceLock<(PathBuf, Option<String>)> = OnceLock::new();
    let text = match READ.get() {
        Some((p, text)) if *p == path => text.clone(),
        _ => {
            let text = match std::fs::read_to_string(&path) {
                Ok(text) => Some(text),
                Err(e) if !required && e.kind() == std::io::ErrorKind::NotFound => None,
                Err(e) => {
                    return Err(e)
                        .with_context(|| format!("cannot read config file {}", path.display()))
                }
            };
            let _ = READ.set((path.clone(), text.clone()));
            text
        }
    };
    let file: FileConfig = match text {
        Some(text) => toml::from_str(&text)
            .with_context(|| format!("config file {} is not valid", path.display()))?,
        None => FileConfig::default(),
    };
    let remote = file
        .remote
        .settings()
        .with_context(|| format!("config file {}", path.display()))?;
    // The pool is made after the command read its file: the first file read is the one.
    let _ = FILE_REMOTE.set(remote);
    // The older `[backends]` table is `[models.backend]` under its former name.
    let mut models = file.models.clone();
    for (m, b) in &file.backends {
        models.backend.entry(m.clone()).or_insert_with(|| b.clone());
    }
    let _ = FILE_MODELS.set(models);
    Ok(file)
}

/// `$XDG_CONFIG_HOME/hilum/config.toml` (an absolute `XDG_CONFIG_HOME` only, as the XDG spec
/// says), else `~/.config/hilum/config.toml`.
fn default_config_path() -> Option<PathBuf> {
    let xdg = std::env::var_os("XDG_CONFIG_HOME")
        .map(PathBuf::from)
        .filter(|p| p.is_absolute());
    let base = match xdg {
        Some(p) => p,
        None => PathBuf::from(std::env::var_os("HOME")?).join(".config"),
    };
    Some(base.join("hilum/config.toml"))
}

/// Where the model runs and how it is reached, after merging flags, env and file.
pub struct LlmChoice {
    pub spec: String,
    pub base_url: Option<String>,
    pub api_key: Option<String>,
    pub timeout_secs: u64,
    /// Why this model was chosen when the user did not name one.
    pub note: Option<String>,
}

impl LlmChoice {
    pub fn resolve(
        flag_spec: Option<String>,
        flag_base_url: Option<String>,
        file: &LlmSection,
    ) -> anyhow::Result<LlmChoice> {
        let api_key = std::env::var("OPENAI_API_KEY")
            .ok()
            .filter(|k| !k.is_empty())
            .or_else(|| file.api_key.clone());
        let mut note = None;
        let spec = flag_spec
            .or_else(|| std::env::var("HILUM_LLM").ok().filter(|s| !s.is_empty()))
            .or_else(|| file.spec.clone())
            .or_else(|| api_key.as_ref().map(|_| "openai:gpt-4o".to_string()))
            .or_else(|| {
                let p = hilum_llm_local::default_model_path(&models_dir())?;
                note = Some(format!(
                    "no --llm and no OPENAI_API_KEY: using the installed local model {}",
                    p.display()
                ));
                Some(format!("local:{}", p.display()))
            });
        let Some(spec) = spec else {
            bail!(
                "no reasoning model configured: install the local model with scripts/fetch_local_llm.sh, \
                 or pass --llm openai:MODEL (with OPENAI_API_KEY, or --base-url for a local \
                 OpenAI-compatible server), --llm local:PATH.gguf, --llm local-vlm:PATH or --llm script:FILE"
            );
        };
        let base_url = flag_base_url
            .or_else(|| {
                std::env::var("OPENAI_BASE_URL")
                    .ok()
                    .filter(|s| !s.is_empty())
            })
            .or_else(|| file.base_url.clone());
        Ok(LlmChoice {
            spec,
            base_url,
            api_key,
            timeout_secs: file.timeout_secs.unwrap_or(120),
            note,
        })
    }

    /// Whether the endpoint is on this machine (pixels and metadata never leave it).
    pub fn is_local(&self) -> bool {
        if !self.spec.starts_with("openai:") {
            return true;
        }
        match &self.base_url {
            None => false,
            Some(url) => hilum_llm::is_loopback_url(url),
        }
    }

    pub fn build(&self) -> anyhow::Result<Arc<dyn Llm>> {
        let (kind, rest) = self.spec.split_once(':').with_context(|| {
            format!(
                "--llm `{}` must look like openai:MODEL or script:FILE",
                self.spec
            )
        })?;
        match kind {
            "script" => Ok(Arc::new(ScriptLlm::from_file(Path::new(rest))?)),
            "local" => {
                let path = if rest.is_empty() {
                    hilum_llm_local::default_model_path(&models_dir()).context(
                        "the default local model is not installed: run scripts/fetch_local_llm.sh",
                    )?
                } else {
                    PathBuf::from(rest)
                };
                Ok(Arc::new(LocalLlm::load(local_config(path)?)?))
            }
            // Gemma 3 multimodal (MedGemma): a snapshot folder, TEXT.gguf,MMPROJ.gguf, or
            // TEXT.gguf with one mmproj*.gguf beside it.
            "local-vlm" => Ok(Arc::new(load_local_vlm(rest, None)?)),
            "openai" => {
                let base_url = self
                    .base_url
                    .clone()
                    .unwrap_or_else(|| "https://api.openai.com/v1".to_string());
                if self.api_key.is_none() && !hilum_llm::is_loopback_url(&base_url) {
                    bail!(
                        "--llm openai:{rest} needs OPENAI_API_KEY (or api_key in the config file) for {base_url}"
                    );
                }
                Ok(Arc::new(OpenAiLlm::new(OpenAiConfig {
                    base_url,
                    model: rest.to_string(),
                    api_key: self.api_key.clone(),
                    timeout: std::time::Duration::from_secs(self.timeout_secs),
                    ..OpenAiConfig::default()
                })?))
            }
            other => bail!(
                "unknown model kind `{other}` in --llm: use openai:MODEL, local:PATH.gguf, local-vlm:PATH or script:FILE"
            ),
        }
    }
}

/// Where models live: `HILUM_MODELS_DIR`, else the `[models]` table's `dir`, else the models
/// library's default (`<user data dir>/hilum/models`: `XDG_DATA_HOME` or `~/.local/share` on
/// Linux; one default for every command).
pub fn models_dir() -> PathBuf {
    models_var(
        "HILUM_MODELS_DIR",
        |k| std::env::var(k).ok(),
        FILE_MODELS.get(),
    )
    .map_or_else(hilum_models::ModelRegistry::default_dir, PathBuf::from)
}

/// The local model's settings for `path`, with the tuning variables `HILUM_LOCAL_MATMUL`
/// (dense|quantized|hybrid), `HILUM_LOCAL_SIMD` (auto|avx2|scalar), `HILUM_LOCAL_DEVICE`
/// (cpu|cuda:N|metal:N), `HILUM_VLM_QUANTIZE` (none|q8_0|q4k: a multimodal snapshot's decoder),
/// `HILUM_LOCAL_LOOKUP` (on|off: prompt lookup drafting) and `CANDLE_NUM_THREADS`.
pub(crate) fn local_config(path: PathBuf) -> anyhow::Result<LocalConfig> {
    let mut cfg = local_config_from(path, |k| std::env::var(k).ok())?;
    // The system prompt and tools' KV state, saved for the next `hilum analyze`.
    cfg.prefix_cache_dir = cache_dir().map(|d| d.join("llm-prefix"));
    Ok(cfg)
}

/// [`local_config`] with the variables read from `env`.
fn local_config_from(
    path: PathBuf,
    env: impl Fn(&str) -> Option<String>,
) -> anyhow::Result<LocalConfig> {
    let var = |k: &str| env(k).filter(|v| !v.is_empty());
    let mut cfg = LocalConfig::new(path);
    if let Some(v) = var("HILUM_LOCAL_MATMUL") {
        cfg.matmul = v
            .parse()
            .map_err(|e| anyhow::anyhow!("HILUM_LOCAL_MATMUL: {e}"))?;
    }
    if let Some(v) = var("HILUM_LOCAL_SIMD") {
        cfg.simd = v
            .parse()
            .map_err(|e| anyhow::anyhow!("HILUM_LOCAL_SIMD: {e}"))?;
    }
    if let Some(v) = var("HILUM_LOCAL_DEVICE") {
        cfg.device = v
            .parse()
            .map_err(|e| anyhow::anyhow!("HILUM_LOCAL_DEVICE: {e}"))?;
    }
    if let Some(v) = var("HILUM_VLM_QUANTIZE") {
        cfg.snapshot_precision = v
            .parse()
            .map_err(|e| anyhow::anyhow!("HILUM_VLM_QUANTIZE: {e}"))?;
    }
    if let Some(v) = var("HILUM_LOCAL_LOOKUP") {
        cfg.prompt_lookup = match v.as_str() {
            "on" | "1" | "true" => true,
            "off" | "0" | "false" => false,
            _ => anyhow::bail!("HILUM_LOCAL_LOOKUP={v}: expected on or off"),
        };
    }
    if let Some(v) = var("CANDLE_NUM_THREADS") {
        cfg.quantized_threads = Some(
            v.parse()
                .with_context(|| format!("CANDLE_NUM_THREADS={v} is not a number of threads"))?,
        );
    }
    Ok(cfg)
}

/// The multimodal local model of `--llm local-vlm:SPEC` (see [`VlmFiles::parse`]) with the
/// local model's settings; `seed` replaces the default sampling seed.
pub(crate) fn load_local_vlm(spec: &str, seed: Option<u64>) -> anyhow::Result<LocalLlm> {
    let files = VlmFiles::parse(spec)?;
    let mut cfg = local_config(files.main_path().to_path_buf())?;
    if let Some(s) = seed {
        cfg.seed = s;
    }
    Ok(LocalLlm::load_vlm(cfg, files)?)
}

/// `XDG_CACHE_HOME/hilum`, else `~/.cache/hilum`.
fn cache_dir() -> Option<PathBuf> {
    let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty());
    var("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| var("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .map(|d| d.join("hilum"))
}

/// The classifier backends: `--backend` flags first (each `BACKEND` for every model or
/// `MODEL=BACKEND`), then `HILUM_BACKEND` (same syntax, comma-separated), then the file's
/// `[backends]` table. Unknown models or backends are errors here, before anything runs.
pub fn resolve_backends(
    flags: &[String],
    file: &std::collections::BTreeMap<String, String>,
) -> anyhow::Result<std::collections::BTreeMap<String, hilum_models::Backend>> {
    let parse = |spec: &str, from: &str| {
        hilum_tools::parse_backends(spec).map_err(|e| anyhow::anyhow!("{from}: {e}"))
    };
    if !flags.is_empty() {
        return parse(&flags.join(","), "--backend");
    }
    if let Some(env) = std::env::var("HILUM_BACKEND")
        .ok()
        .filter(|v| !v.is_empty())
    {
        return parse(&env, "HILUM_BACKEND");
    }
    let spec: Vec<String> = file.iter().map(|(m, b)| format!("{m}={b}")).collect();
    parse(&spec.join(","), "[backends] in the config file")
}

/// Fills each MCP server entry's `token` from the variable its `token_env` names (`--mcp`
/// entries name `HILUM_MCP_<NAME>_TOKEN`), unless the file gave the token itself.
pub(crate) fn mcp_tokens(entries: &mut [hilum_tools::remote::McpServerConfig]) {
    for e in entries {
        if e.token.as_deref().is_some_and(|t| !t.is_empty()) {
            continue;
        }
        if let Some(var) = e.token_env.as_deref() {
            e.token = std::env::var(var).ok().filter(|t| !t.is_empty());
        }
    }
}

/// `RUST_LOG`, when set: the log filter of `hilum serve`, `hilum mcp` and `hilum analyze -v`.
pub fn log_filter() -> Option<String> {
    std::env::var("RUST_LOG")
        .ok()
        .filter(|v| !v.trim().is_empty())
}

/// The models' settings from the environment: `HILUM_MODELS_DIR`, `HILUM_CPU_THREADS`,
/// `HILUM_CPU_TILE_FLOATS`, `HILUM_CPU_IMAGES_PER_PASS`, `HILUM_UNET_ENGINE`, `HILUM_UNET_ISA`,
/// `HILUM_CPU_PROFILE`, `HILUM_CPU_CONCURRENCY`, `HILUM_GPU_CONCURRENCY`, `ORT_DYLIB_PATH`,
/// `HILUM_LLAVA_QUANTIZE`, `HILUM_MAX_REPLICAS` (meanings in docs/models.md, Settings), on
/// `devices` (see [`device_set`]). Each one set in the environment wins over the config file's `[models]` table.
pub fn model_settings(devices: hilum_models::DeviceSet) -> hilum_models::ModelSettings {
    let file = FILE_MODELS.get();
    hilum_models::ModelSettings {
        devices,
        ..hilum_models::ModelSettings::from_vars(|k| models_var(k, |k| std::env::var(k).ok(), file))
    }
}

/// The Hugging Face Hub settings of `hilum models fetch`, read as `huggingface_hub` (Python)
/// reads them, so that both use one cache and one login.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct HubSettings {
    /// `HF_ENDPOINT`: a mirror of the Hub (default https://huggingface.co).
    pub endpoint: Option<String>,
    /// `HF_TOKEN`, else the file `huggingface-cli login` wrote (`HF_TOKEN_PATH`, else
    /// `$HF_HOME/token`). Never printed (its `Debug` hides it).
    pub token: Option<hilum_models::HfToken>,
    /// `HF_HUB_CACHE`, else `$HF_HOME/hub`; `HF_HOME` defaults to
    /// `$XDG_CACHE_HOME/huggingface`, else `~/.cache/huggingface`.
    pub cache: Option<PathBuf>,
}

/// [`HubSettings`] from this process's environment.
pub fn hub_settings() -> HubSettings {
    hub_settings_from(
        |k| std::env::var(k).ok(),
        |p| std::fs::read_to_string(p).ok(),
    )
}

fn hub_settings_from(
    var: impl Fn(&str) -> Option<String>,
    read: impl Fn(&Path) -> Option<String>,
) -> HubSettings {
    let var = |k: &str| var(k).filter(|v| !v.trim().is_empty());
    let home = var("HF_HOME").map(PathBuf::from).or_else(|| {
        var("XDG_CACHE_HOME")
            .map(PathBuf::from)
            .or_else(|| var("HOME").map(|h| PathBuf::from(h).join(".cache")))
            .map(|c| c.join("huggingface"))
    });
    let cache = var("HF_HUB_CACHE")
        .map(PathBuf::from)
        .or_else(|| home.as_ref().map(|h| h.join("hub")));
    let token = var("HF_TOKEN")
        .or_else(|| {
            let file = var("HF_TOKEN_PATH")
                .map(PathBuf::from)
                .or_else(|| home.as_ref().map(|h| h.join("token")))?;
            read(&file)
        })
        .map(|t| t.trim().to_string())
        .filter(|t| !t.is_empty())
        .map(hilum_models::HfToken::new);
    HubSettings {
        endpoint: var("HF_ENDPOINT").map(|e| e.trim().to_string()),
        token,
        cache,
    }
}

/// `--device` on the commands that run tools (one flag, flattened into each).
#[derive(clap::Args, Clone, Debug, Default)]
pub struct DeviceFlag {
    /// Devices the models run on: auto (every CUDA GPU, else the CPU), cpu, cuda:N, or a list
    /// (cuda:0,cuda:1) that each call is routed across. Overrides HILUM_DEVICE and the config
    /// file's [models] device; default cpu.
    #[arg(long, value_name = "DEVICES")]
    pub device: Option<String>,
}

/// The devices the process's model pool routes across: `--device`, else `HILUM_DEVICE`, else
/// the config file's `[models] device`, else the CPU. A list that does not parse stops the
/// program (a typo must not fall back to another device), naming where it came from.
pub fn device_set(flag: Option<&str>) -> anyhow::Result<hilum_models::DeviceSet> {
    device_set_from(flag, |k| std::env::var(k).ok(), FILE_MODELS.get())
}

fn device_set_from(
    flag: Option<&str>,
    env: impl Fn(&str) -> Option<String>,
    file: Option<&ModelsSection>,
) -> anyhow::Result<hilum_models::DeviceSet> {
    let env = env("HILUM_DEVICE").filter(|v| !v.is_empty());
    let (text, from) = match (flag, env, file.and_then(|f| f.device.clone())) {
        (Some(f), _, _) => (f.to_string(), "--device"),
        (None, Some(e), _) => (e, "HILUM_DEVICE"),
        (None, None, Some(d)) => (d, "[models] device in the config file"),
        (None, None, None) => return Ok(hilum_models::DeviceSet::default()),
    };
    text.parse().map_err(|e| anyhow::anyhow!("{from}: {e}"))
}

/// The tools' shared parts: the process's model pool, and the config file's `[vlm]` table
/// (environment overrides it).
pub fn tool_deps(
    store: Arc<hilum_imaging::ImageStore>,
    mut vlm: hilum_tools::VlmSettings,
) -> anyhow::Result<hilum_tools::ToolDeps> {
    // A bad [vlm] setting is reported by each VLM tool call; the other tools keep working.
    if let Err(e) = vlm.apply_env(|k| std::env::var(k).ok()) {
        vlm = hilum_tools::VlmSettings::broken(format!("the [vlm] settings are not valid: {e}"));
    }
    Ok(hilum_tools::ToolDeps::new(store, crate::model_pool())
        .with_vlm(Arc::new(vlm))
        .with_settings(tool_settings()))
}

/// The tools' own settings. The backends of the models come with the models' settings
/// ([`model_settings`]: `HILUM_BACKEND`, `HILUM_LUNG_UNET_BACKEND`, `HILUM_MEDSAM_BACKEND`,
/// `[models.backend]`); `--backend` is applied on top by the commands that take it.
pub fn tool_settings() -> hilum_tools::ToolSettings {
    hilum_tools::ToolSettings::default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use hilum_models::Backend;

    /// An environment holding exactly `pairs`, as the `*_from` readers take it.
    fn env(
        pairs: &'static [(&'static str, &'static str)],
    ) -> impl Fn(&str) -> Option<String> + Copy {
        move |k: &str| {
            pairs
                .iter()
                .find(|(name, _)| *name == k)
                .map(|(_, v)| v.to_string())
        }
    }

    #[test]
    fn local_model_variables_are_read_and_bad_values_name_the_variable() {
        let path = PathBuf::from("m.gguf");
        let cfg = local_config_from(path.clone(), env(&[])).expect("defaults");
        assert!(cfg.prompt_lookup);
        let cfg = local_config_from(
            path.clone(),
            env(&[("HILUM_LOCAL_LOOKUP", "off"), ("CANDLE_NUM_THREADS", "3")]),
        )
        .expect("valid");
        assert!(!cfg.prompt_lookup);
        assert_eq!(cfg.quantized_threads, Some(3));
        let bad: [&'static [(&'static str, &'static str)]; 3] = [
            &[("HILUM_LOCAL_LOOKUP", "maybe")],
            &[("HILUM_LOCAL_MATMUL", "sparse")],
            &[("CANDLE_NUM_THREADS", "many")],
        ];
        for pairs in bad {
            let k = pairs[0].0;
            let e = local_config_from(path.clone(), env(pairs)).expect_err(k);
            assert!(format!("{e:#}").contains(k), "{e:#}");
        }
    }

    #[test]
    fn serve_table_sets_the_image_bound_and_the_flag_wins() {
        let none = ServeSection::default();
        assert_eq!(
            none.max_image_memory_bytes(None).expect("default"),
            256 << 20
        );
        let file: FileConfig =
            toml::from_str("[serve]\nmax_image_memory_mb = 64\n").expect("valid config");
        assert_eq!(
            file.serve.max_image_memory_bytes(None).expect("file"),
            64 << 20
        );
        assert_eq!(file.serve.max_image_memory_bytes(Some(0)).expect("flag"), 0);
        assert!(file.serve.max_image_memory_bytes(Some(u64::MAX)).is_err());
        assert!(toml::from_str::<FileConfig>("[serve]\nmax_images = 3\n").is_err());
    }

    #[test]
    fn backends_table_parses_and_flags_win() {
        let file: FileConfig = toml::from_str(
            "[backends]\n\"densenet121-res224-all\" = \"onnx\"\n\"*\" = \"native\"\n",
        )
        .expect("valid config");
        // HILUM_BACKEND is read in between; tests run without it unless a developer set it.
        if std::env::var_os("HILUM_BACKEND").is_none() {
            let b = resolve_backends(&[], &file.backends).expect("file");
            assert_eq!(b.get("densenet121-res224-all"), Some(&Backend::Onnx));
            assert_eq!(b.get("*"), Some(&Backend::Native));
        }
        let b = resolve_backends(&["candle".into()], &file.backends).expect("flag");
        assert_eq!(b.len(), 1);
        assert_eq!(b.get("*"), Some(&Backend::Candle));
        let err = resolve_backends(&["resnet50-res512-all=gpu".into()], &file.backends)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            err.contains("--backend") && err.contains("native, candle, onnx or kserve"),
            "{err}"
        );
    }

    #[test]
    fn remote_table_gives_client_settings_and_rejects_a_remote_fallback() {
        let file: FileConfig = toml::from_str(
            "[remote]\nurl = \"http://triton:8000\"\nretries = 5\nfallback = \"native\"\n",
        )
        .expect("valid config");
        let s = file.remote.settings().expect("valid").expect("a server");
        assert_eq!(s.url, "http://triton:8000");
        assert_eq!(s.retries, 5);
        assert_eq!(s.fallback, Some(Backend::Native));
        let bad: FileConfig =
            toml::from_str("[remote]\nurl = \"http://t:8000\"\nfallback = \"kserve\"\n")
                .expect("parses");
        assert!(bad.remote.settings().is_err());
        assert!(FileConfig::default()
            .remote
            .settings()
            .expect("ok")
            .is_none());
    }

    #[test]
    fn models_table_gives_the_settings_and_the_environment_wins() {
        let file: FileConfig = toml::from_str(
            "[models]\ndir = \"/srv/hilum/models\"\ncpu_threads = 3\ngpu_concurrency = 2\n\
             onnxruntime = \"/opt/ort/libonnxruntime.so\"\nllava_quantize = \"q4k\"\n\
             batch_max_size = 16\nbatch_delay_ms = 4\n",
        )
        .expect("parse");
        let from = |e| {
            let e = env(e);
            hilum_models::ModelSettings::from_vars(|k| models_var(k, e, Some(&file.models)))
        };
        let s = from(&[]);
        assert_eq!(s.models_dir, PathBuf::from("/srv/hilum/models"));
        assert_eq!(s.cpu.threads, Some(3));
        assert_eq!(s.gpu_concurrency, Some(2));
        assert_eq!(
            s.ort_dylib.as_deref(),
            Some(Path::new("/opt/ort/libonnxruntime.so"))
        );
        assert_eq!(s.llava_quantize.as_deref(), Some("q4k"));
        assert_eq!(s.cpu_concurrency, None);
        let batch = hilum_models::BatchSettings::new(16, std::time::Duration::from_millis(4));
        assert_eq!(s.batch, batch);
        // A variable wins; an empty one counts as unset.
        let s = from(&[("HILUM_MODELS_DIR", "/tmp/m"), ("HILUM_CPU_THREADS", "")]);
        assert_eq!(s.models_dir, PathBuf::from("/tmp/m"));
        assert_eq!(s.cpu.threads, Some(3));
        assert!(!from(&[("HILUM_BATCH_MAX_SIZE", "1")]).batch.enabled());
        // Nothing anywhere: the models library's one default.
        let s = hilum_models::ModelSettings::from_vars(|k| models_var(k, env(&[]), None));
        assert_eq!(s.models_dir, hilum_models::ModelRegistry::default_dir());
        let err = toml::from_str::<FileConfig>("[models]\nthreads = 2\n")
            .expect_err("unknown key")
            .to_string();
        assert!(err.contains("threads"), "{err}");
    }

    #[test]
    fn device_list_comes_from_the_flag_then_the_environment_then_the_file() {
        use hilum_models::{Device, DeviceSet};
        let file: FileConfig =
            toml::from_str("[models]\ndevice = \"cuda:0,cuda:1\"\n").expect("parse");
        let none = |_: &str| None;
        let env = |k: &str| (k == "HILUM_DEVICE").then(|| "cuda:2".to_string());
        let two = device_set_from(None, none, Some(&file.models)).expect("file");
        assert_eq!(two.devices(), &[Device::Cuda(0), Device::Cuda(1)]);
        let one = device_set_from(None, env, Some(&file.models)).expect("env");
        assert_eq!(one.devices(), &[Device::Cuda(2)]);
        let flag = device_set_from(Some("cpu"), env, Some(&file.models)).expect("flag");
        assert_eq!(flag, DeviceSet::default());
        assert_eq!(
            device_set_from(None, none, None).expect("default"),
            DeviceSet::default()
        );
        let empty = |k: &str| (k == "HILUM_DEVICE").then(String::new);
        assert_eq!(
            device_set_from(None, empty, None).expect("empty = unset"),
            DeviceSet::default()
        );
        let err = |flag, env: &'static str, file: Option<&ModelsSection>| {
            let var = move |k: &str| (k == "HILUM_DEVICE").then(|| env.to_string());
            device_set_from(flag, var, file)
                .expect_err("bad list")
                .to_string()
        };
        assert!(err(Some("cuda:0,cuda:0"), "", None).starts_with("--device:"));
        assert!(err(None, "gpu0", None).starts_with("HILUM_DEVICE:"));
        let bad: FileConfig = toml::from_str("[models]\ndevice = \"cpu,cuda:1\"\n").expect("parse");
        let e = err(None, "", Some(&bad.models));
        assert!(
            e.starts_with("[models] device") && e.contains("different kinds"),
            "{e}"
        );
    }

    #[test]
    fn hub_settings_come_from_the_hugging_face_variables() {
        let no_file = |_: &Path| None;
        let s = hub_settings_from(
            env(&[
                ("HF_TOKEN", " hf_abc \n"),
                ("HF_ENDPOINT", "https://hf.hospital.example/"),
                ("HF_HOME", "/srv/hf"),
                ("HOME", "/home/u"),
            ]),
            no_file,
        );
        assert_eq!(s.token, Some(hilum_models::HfToken::new("hf_abc")));
        assert_eq!(s.endpoint.as_deref(), Some("https://hf.hospital.example/"));
        assert_eq!(s.cache, Some(PathBuf::from("/srv/hf/hub")));
        assert!(
            !format!("{s:?}").contains("hf_abc"),
            "the token stays out of logs"
        );
        // HF_HUB_CACHE wins over HF_HOME; XDG_CACHE_HOME and HOME are the fallbacks.
        let s = hub_settings_from(
            env(&[("HF_HUB_CACHE", "/data/hub"), ("HF_HOME", "/srv/hf")]),
            no_file,
        );
        assert_eq!(s.cache, Some(PathBuf::from("/data/hub")));
        let s = hub_settings_from(env(&[("XDG_CACHE_HOME", "/x"), ("HOME", "/h")]), no_file);
        assert_eq!(s.cache, Some(PathBuf::from("/x/huggingface/hub")));
        let s = hub_settings_from(env(&[("HOME", "/h")]), no_file);
        assert_eq!(s.cache, Some(PathBuf::from("/h/.cache/huggingface/hub")));
        assert_eq!(s.endpoint, None);
        assert_eq!(hub_settings_from(env(&[]), no_file), HubSettings::default());
        // Without HF_TOKEN: the token `huggingface-cli login` saved under HF_HOME.
        let login = |p: &Path| (p == Path::new("/srv/hf/token")).then(|| "hf_saved\n".to_string());
        let s = hub_settings_from(env(&[("HF_HOME", "/srv/hf")]), login);
        assert_eq!(s.token, Some(hilum_models::HfToken::new("hf_saved")));
        let s = hub_settings_from(
            env(&[("HF_HOME", "/srv/hf"), ("HF_TOKEN", "hf_env")]),
            login,
        );
        assert_eq!(s.token, Some(hilum_models::HfToken::new("hf_env")));
        let s = hub_settings_from(
            env(&[("HF_TOKEN_PATH", "/run/secrets/hf"), ("HF_HOME", "/srv/hf")]),
            |p: &Path| (p == Path::new("/run/secrets/hf")).then(|| "hf_secret".to_string()),
        );
        assert_eq!(s.token, Some(hilum_models::HfToken::new("hf_secret")));
    }

    #[test]
    fn models_backend_table_is_the_backend_variable() {
        let file: FileConfig =
            toml::from_str("[models.backend]\n\"lung-unet\" = \"kserve\"\n\"*\" = \"onnx\"\n")
                .expect("parses");
        let s =
            hilum_models::ModelSettings::from_vars(|k| models_var(k, |_| None, Some(&file.models)));
        let b = s.backends.expect("parses");
        assert_eq!(b.get("lung-unet"), Some(Backend::Kserve));
        assert_eq!(b.every_model(), Some(Backend::Onnx));
        // The variable wins over the table.
        let s = hilum_models::ModelSettings::from_vars(|k| {
            models_var(
                k,
                |k| (k == "HILUM_BACKEND").then(|| "lung-unet=native".to_string()),
                Some(&file.models),
            )
        });
        assert_eq!(s.backend_of("lung-unet"), Some(Backend::Native));
        assert_eq!(s.backend_of("*"), None);
    }
}
