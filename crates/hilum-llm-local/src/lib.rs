//! In-process local models: a quantized GGUF (Qwen2/Qwen2.5, Llama, Gemma 3) run on candle, with
//! the GGUF's own tokenizer and chat template, grammar-constrained tool calls, and a KV cache kept
//! across the rounds of a conversation.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use hilum_llm_local::{LocalConfig, LocalLlm};
//! let llm = LocalLlm::load(LocalConfig::new("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"))?;
//! # Ok(()) }
//! ```

#![warn(missing_docs)]

pub mod devcheck;
pub mod gemma3;
mod generate;
pub mod grammar;
pub mod model;
mod prefix;
mod qmatvec;
mod spm;
mod template;
pub mod tokenizer;
pub mod toolcall;
pub mod vlm;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use candle_core::quantized::gguf_file;
use candle_core::Device;
use thiserror::Error;

use hilum_llm::{Capabilities, ChatRequest, DeltaStream, Llm, LlmError};

pub use generate::GenStats;
pub use prefix::PrefixSource;
pub use qmatvec::SimdCap;
pub use template::ChatTemplate;
pub use tokenizer::GgufTokenizer;
pub use vlm::reasoner::VlmFiles;

/// File name of the default local model (Qwen2.5-Coder-0.5B-Instruct, Q4_K_M) under the models dir.
pub const DEFAULT_MODEL_FILE: &str = "llm/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf";

/// The installed default local model under `models_dir` (the folder the caller resolved, e.g.
/// `~/.local/share/hilum/models`), if `scripts/fetch_local_llm.sh` has put it in place.
pub fn default_model_path(models_dir: &Path) -> Option<PathBuf> {
    let p = models_dir.join(DEFAULT_MODEL_FILE);
    p.is_file().then_some(p)
}

/// Why a local model could not be loaded or could not answer.
#[derive(Debug, Error)]
pub enum LocalError {
    /// The model file (or a snapshot folder) cannot be opened or read.
    #[error("local model file {path}: {reason} (fetch the default model with scripts/fetch_local_llm.sh)")]
    Io {
        /// The file or folder.
        path: String,
        /// What went wrong.
        reason: String,
    },
    /// A multimodal model's files (`--llm local-vlm:`) as named.
    #[error("multimodal model {path}: {reason}")]
    VlmFiles {
        /// The file or folder at fault.
        path: String,
        /// What is missing or wrong.
        reason: String,
    },
    /// The file is not a GGUF candle can read.
    #[error("local model {path} is not a readable GGUF file: {reason}")]
    BadGguf {
        /// The file.
        path: String,
        /// What the GGUF reader reported.
        reason: String,
    },
    /// The model's architecture, quantization or device is not supported.
    #[error("local model not supported: {0}")]
    Unsupported(String),
    /// The GGUF's tokenizer cannot be built or cannot encode the prompt.
    #[error("local model tokenizer: {0}")]
    Tokenizer(String),
    /// The chat template is missing, does not compile or fails to render.
    #[error("local model chat template: {0}")]
    Template(String),
    /// The tool-call grammar cannot be built from the request's tools.
    #[error("tool-call grammar: {0}")]
    Grammar(String),
    /// A forward pass failed (candle's error).
    #[error("local model inference failed: {0}")]
    Inference(String),
    /// The conversation does not fit the context, even with old tool results shortened.
    #[error("the conversation needs {needed} tokens but the local model's context is {limit} even after shortening old tool results; start a new conversation or raise the context with --llm-context")]
    ContextFull {
        /// Tokens the conversation needs.
        needed: usize,
        /// The context in tokens.
        limit: usize,
    },
    /// The answer kept repeating itself and was stopped.
    #[error("the local model repeated the same {period} token(s) over its last {window} tokens and was stopped; try a higher temperature or a clearer question")]
    Repetition {
        /// Length of the repeated run in tokens.
        period: usize,
        /// Tokens over which it repeated (`repetition_window`).
        window: usize,
    },
    /// The answer reached `max_tokens` inside a tool call.
    #[error("the local model reached max_tokens ({max}) in the middle of a tool call ({partial}); raise max_tokens")]
    CallCutOff {
        /// The answer's token limit.
        max: u32,
        /// The start of the tool call as written (at most 200 characters).
        partial: String,
    },
}

impl From<LocalError> for LlmError {
    fn from(e: LocalError) -> Self {
        LlmError::Other(e.to_string())
    }
}

impl From<candle_core::Error> for LocalError {
    fn from(e: candle_core::Error) -> Self {
        LocalError::Inference(e.to_string())
    }
}

/// Where a local model runs: `cpu` (the default: Hilum's block kernels for one-token decode),
/// `cuda`/`cuda:N` or `metal:N` (a build with that feature: candle's GPU kernels, the KV cache
/// kept on the device).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LocalDevice {
    /// The CPU.
    #[default]
    Cpu,
    /// A CUDA GPU, by ordinal (a build with the `cuda` feature).
    Cuda(usize),
    /// A Metal GPU, by ordinal (a build with the `metal` feature).
    Metal(usize),
}

impl std::str::FromStr for LocalDevice {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.trim().to_ascii_lowercase();
        let index = |rest: &str| -> Result<usize, String> {
            match rest {
                "" => Ok(0),
                r => r
                    .strip_prefix(':')
                    .and_then(|n| n.parse().ok())
                    .ok_or_else(|| format!("local model device `{s}`: write cuda:N or metal:N")),
            }
        };
        match s.as_str() {
            "" | "cpu" => Ok(LocalDevice::Cpu),
            _ if s.starts_with("cuda") => Ok(LocalDevice::Cuda(index(&s[4..])?)),
            _ if s.starts_with("metal") => Ok(LocalDevice::Metal(index(&s[5..])?)),
            _ => Err(format!(
                "local model device `{s}` is not one of cpu, cuda, cuda:N, metal:N"
            )),
        }
    }
}

impl std::fmt::Display for LocalDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LocalDevice::Cpu => f.write_str("cpu"),
            LocalDevice::Cuda(n) => write!(f, "cuda:{n}"),
            LocalDevice::Metal(n) => write!(f, "metal:{n}"),
        }
    }
}

impl LocalDevice {
    /// Opens the device; a build without its feature or a missing driver is a clear error.
    pub fn open(self) -> Result<Device, LocalError> {
        let opened = match self {
            LocalDevice::Cpu => return Ok(Device::Cpu),
            LocalDevice::Cuda(n) => Device::new_cuda(n),
            LocalDevice::Metal(n) => Device::new_metal(n),
        };
        opened.map_err(|e| {
            LocalError::Unsupported(format!(
                "cannot open {self} for the local model ({e}); GPU builds: scripts/build_cuda.sh \
                 (CUDA) or --features metal, or run it on the cpu"
            ))
        })
    }
}

/// How a local model is loaded and sampled. Request fields (temperature, max_tokens, stop)
/// override the defaults here.
#[derive(Clone, Debug)]
pub struct LocalConfig {
    /// The GGUF file, or a multimodal model's files.
    pub path: PathBuf,
    /// Longest conversation in tokens (prompt + answer); capped by the model's own context.
    pub context: usize,
    /// Answer length when the request gives none.
    pub max_tokens: u32,
    /// 0 = greedy.
    pub temperature: f32,
    /// Nucleus sampling: keep the most likely tokens up to this total probability.
    pub top_p: Option<f64>,
    /// Seed of the sampler (with a temperature above 0).
    pub seed: u64,
    /// Decode tool calls under a grammar built from the request's tools.
    pub constrain_tool_calls: bool,
    /// Stop when the last `repetition_window` tokens repeat a period of at most 32 tokens.
    pub repetition_window: usize,
    /// Under greedy decoding, guess a prose answer's next tokens from the prompt where the
    /// answer is quoting it, and check the guess in one pass (default on; the text is the
    /// same greedy text up to the batched pass's rounding).
    pub prompt_lookup: bool,
    /// f32 gemm and/or quantized dot products (default hybrid).
    pub matmul: model::MatmulMode,
    /// The widest SIMD the block kernels may use (process-wide; default: what the CPU has).
    pub simd: SimdCap,
    /// Threads of candle's quantized-matmul pool (process-wide, fixed by the first load); `None`:
    /// all cores on an idle machine, one on a busy one.
    pub quantized_threads: Option<usize>,
    /// Folder where the KV state of prompt prefixes (system prompt + tool specifications) is
    /// saved for later processes; `None`: kept in this process's memory only.
    pub prefix_cache_dir: Option<PathBuf>,
    /// Where the decoder (and a multimodal model's vision tower) runs.
    pub device: LocalDevice,
    /// How a multimodal snapshot's decoder matrices are stored once loaded (default Q8_0: a 4B
    /// decoder takes ~4.6 GB instead of ~17 GB in f32). A GGUF keeps its own blocks.
    pub snapshot_precision: model::Precision,
}

impl LocalConfig {
    /// The defaults for the model at `path`.
    pub fn new(path: impl Into<PathBuf>) -> Self {
        LocalConfig {
            path: path.into(),
            context: 8192,
            max_tokens: 512,
            temperature: 0.0,
            top_p: None,
            seed: 299_792_458,
            constrain_tool_calls: true,
            repetition_window: 96,
            prompt_lookup: true,
            matmul: model::MatmulMode::Hybrid,
            simd: SimdCap::Auto,
            quantized_threads: None,
            prefix_cache_dir: None,
            device: LocalDevice::Cpu,
            snapshot_precision: model::Precision::Q8_0,
        }
    }
}

/// The decoder of a loaded GGUF, by architecture.
pub enum Decoder {
    /// `qwen2` and `llama`.
    Llama(model::Model),
    /// `gemma3` (text only).
    Gemma3(gemma3::Gemma3),
    /// Gemma 3 multimodal (`local-vlm:`): the Gemma 3 decoder with the vision tower.
    Vlm(Box<vlm::reasoner::VlmDecoder>),
}

impl Decoder {
    /// Loads the decoder `general.architecture` names.
    pub fn load(
        ct: &gguf_file::Content,
        r: &mut std::fs::File,
        max_positions: usize,
        mode: model::MatmulMode,
        dev: &Device,
    ) -> candle_core::Result<Self> {
        let arch = ct
            .metadata
            .get("general.architecture")
            .and_then(|v| v.to_string().ok())
            .map(String::as_str);
        Ok(match arch {
            Some("gemma3") => {
                Decoder::Gemma3(gemma3::Gemma3::load(ct, r, max_positions, mode, dev)?)
            }
            Some("qwen2" | "llama") => {
                Decoder::Llama(model::Model::load(ct, r, max_positions, mode, dev)?)
            }
            other => candle_core::bail!(
                "GGUF architecture `{}` is not supported by the local backend (qwen2, llama and gemma3 are)",
                other.unwrap_or("(none)")
            ),
        })
    }

    /// Runs `tokens` after the cached positions; returns the logits of the last one.
    pub fn forward(&mut self, tokens: &[u32]) -> candle_core::Result<candle_core::Tensor> {
        match self {
            Decoder::Llama(m) => m.forward(tokens),
            Decoder::Gemma3(m) => m.forward(tokens),
            Decoder::Vlm(m) => m.forward(tokens),
        }
    }

    /// Runs `tokens` after the cached positions and returns the logits of each (tokens,
    /// vocab); `None` for a decoder without that pass (nothing is run then).
    pub fn forward_all(
        &mut self,
        tokens: &[u32],
    ) -> Option<candle_core::Result<candle_core::Tensor>> {
        match self {
            Decoder::Llama(m) => Some(m.forward_all(tokens)),
            Decoder::Gemma3(_) | Decoder::Vlm(_) => None,
        }
    }

    /// Forgets every cached position from `len` on.
    pub fn truncate_cache(&mut self, len: usize) -> candle_core::Result<()> {
        match self {
            Decoder::Llama(m) => m.truncate_cache(len),
            Decoder::Gemma3(m) => m.truncate_cache(len),
            Decoder::Vlm(m) => m.decoder_mut().truncate_cache(len),
        }
    }

    /// Positions held in the KV cache.
    pub fn cached_len(&self) -> usize {
        match self {
            Decoder::Llama(m) => m.cached_len(),
            Decoder::Gemma3(m) => m.cached_len(),
            Decoder::Vlm(m) => m.decoder().cached_len(),
        }
    }

    pub(crate) fn kv(&mut self) -> &mut model::KvCache {
        match self {
            Decoder::Llama(m) => m.kv(),
            Decoder::Gemma3(m) => m.kv(),
            Decoder::Vlm(m) => m.decoder_mut().kv(),
        }
    }

    /// The longest conversation (in tokens) this instance accepts.
    pub fn max_positions(&self) -> usize {
        match self {
            Decoder::Llama(m) => m.max_positions(),
            Decoder::Gemma3(m) => m.max_positions(),
            Decoder::Vlm(m) => m.decoder().max_positions(),
        }
    }

    /// Encodes the prompt's pictures not encoded yet (a multimodal model; nothing otherwise).
    pub(crate) fn encode_images(
        &mut self,
        images: &[vlm::reasoner::PromptImage],
    ) -> Result<(), LocalError> {
        match self {
            Decoder::Vlm(m) => m.encode_images(images),
            _ => Ok(()),
        }
    }
}

pub(crate) struct State {
    pub model: Decoder,
    /// Tokens whose keys/values are in the model's KV cache, in order.
    pub cached: Vec<u32>,
}

pub(crate) struct Inner {
    pub cfg: LocalConfig,
    pub tok: Arc<GgufTokenizer>,
    pub template: ChatTemplate,
    pub state: Mutex<State>,
    pub stats: Mutex<GenStats>,
    pub call_counter: AtomicU64,
    pub prefixes: prefix::PrefixCache,
    /// The prompt side of a multimodal model (`None`: text only).
    pub vision: Option<vlm::reasoner::Vision>,
}

/// A GGUF model running in this process. Cloning shares the model and its KV cache.
#[derive(Clone)]
pub struct LocalLlm {
    inner: Arc<Inner>,
    name: String,
}

impl LocalLlm {
    /// Reads the GGUF, builds its tokenizer and template and dequantizes the weights (a few
    /// seconds for a 0.5B model).
    pub fn load(cfg: LocalConfig) -> Result<Self, LocalError> {
        let (ct, mut file) = model::open_gguf(&cfg.path)?;
        let tok = Arc::new(GgufTokenizer::from_gguf(&ct)?);
        let template = ChatTemplate::for_gguf(
            ct.metadata
                .get("tokenizer.chat_template")
                .and_then(|v| v.to_string().ok())
                .cloned(),
            &tok,
        )?;
        qmatvec::cap_simd(cfg.simd);
        let dev = cfg.device.open()?;
        if cfg.matmul != model::MatmulMode::Dense && dev.is_cpu() {
            size_quantized_matmul_pool(cfg.quantized_threads);
        }
        let model = Decoder::load(&ct, &mut file, cfg.context, cfg.matmul, &dev)?;
        Ok(Self::assemble("local", cfg, tok, template, model, None))
    }

    /// The backend around a loaded decoder; `kind` names it (`local:FILE`, `local-vlm:FILE`).
    fn assemble(
        kind: &str,
        cfg: LocalConfig,
        tok: Arc<GgufTokenizer>,
        template: ChatTemplate,
        model: Decoder,
        vision: Option<vlm::reasoner::Vision>,
    ) -> Self {
        let name = format!(
            "{kind}:{}",
            cfg.path
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|| cfg.path.display().to_string())
        );
        let prefixes = prefix::PrefixCache::new(cfg.path.clone(), cfg.prefix_cache_dir.clone());
        LocalLlm {
            inner: Arc::new(Inner {
                prefixes,
                cfg,
                tok,
                template,
                state: Mutex::new(State {
                    model,
                    cached: Vec::new(),
                }),
                stats: Mutex::new(GenStats::default()),
                call_counter: AtomicU64::new(0),
                vision,
            }),
            name,
        }
    }

    /// Loads Gemma 3 multimodal (MedGemma 4B's architecture) as a reasoner that reads the
    /// conversation's pictures: from llama.cpp's text GGUF (its tokenizer and chat template;
    /// matrices as `cfg.matmul` says) + mmproj GGUF, or from a safetensors snapshot (f32, its
    /// `tokenizer.json` and chat template). `cfg.path` is ignored: `files` names the model.
    pub fn load_vlm(mut cfg: LocalConfig, files: VlmFiles) -> Result<Self, LocalError> {
        cfg.path = files.main_path().to_path_buf();
        qmatvec::cap_simd(cfg.simd);
        let dev = cfg.device.open()?;
        let (vlm, tok, source) = match &files {
            VlmFiles::Gguf { text, mmproj } => {
                let (ct, _) = model::open_gguf(text)?;
                // Said before the loader trips over a missing `gemma3.*` key.
                let arch = ct
                    .metadata
                    .get("general.architecture")
                    .and_then(|v| v.to_string().ok())
                    .map_or("(none)", String::as_str);
                if arch != "gemma3" {
                    return Err(LocalError::Unsupported(format!(
                        "{}: GGUF architecture `{arch}` is not Gemma 3 (gemma3); local-vlm: takes \
                         Gemma 3 multimodal files such as MedGemma 4B's",
                        text.display()
                    )));
                }
                let tok = GgufTokenizer::from_gguf(&ct)?;
                let source = ct
                    .metadata
                    .get("tokenizer.chat_template")
                    .and_then(|v| v.to_string().ok())
                    .cloned();
                if cfg.matmul != model::MatmulMode::Dense && dev.is_cpu() {
                    size_quantized_matmul_pool(cfg.quantized_threads);
                }
                let vlm = vlm::Gemma3Vlm::load_gguf(text, mmproj, cfg.context, cfg.matmul, &dev)?;
                (vlm, tok, source)
            }
            VlmFiles::Snapshot(dir) => {
                let tok = GgufTokenizer::from_hf_dir(dir)?;
                let source = tokenizer::hf_chat_template(dir)?;
                let vlm = vlm::Gemma3Vlm::load(dir, cfg.context, cfg.snapshot_precision, &dev)?;
                (vlm, tok, source)
            }
        };
        if tok.special(vlm::IMAGE_TOKEN_TEXT) != Some(vlm.cfg.image_token) {
            return Err(LocalError::Unsupported(format!(
                "{}: the tokenizer's {} is not the model's image token {}",
                cfg.path.display(),
                vlm::IMAGE_TOKEN_TEXT,
                vlm.cfg.image_token
            )));
        }
        let tok = Arc::new(tok);
        let template = ChatTemplate::for_gguf(source, &tok)?;
        let vision = vlm::reasoner::Vision::new(vlm.cfg.mm_tokens_per_image, vlm.cfg.image_token);
        let model = Decoder::Vlm(Box::new(vlm::reasoner::VlmDecoder::new(vlm)));
        Ok(Self::assemble(
            "local-vlm",
            cfg,
            tok,
            template,
            model,
            Some(vision),
        ))
    }

    /// The model's file, as configured.
    pub fn path(&self) -> &Path {
        &self.inner.cfg.path
    }

    /// The sampling seed (with a temperature above 0).
    pub fn seed(&self) -> u64 {
        self.inner.cfg.seed
    }

    /// The model's tokenizer.
    pub fn tokenizer(&self) -> &Arc<GgufTokenizer> {
        &self.inner.tok
    }

    /// The model's chat template.
    pub fn template(&self) -> &ChatTemplate {
        &self.inner.template
    }

    /// Timings and token counts of the last completed request.
    pub fn last_stats(&self) -> GenStats {
        self.inner
            .stats
            .lock()
            .map(|s| s.clone())
            .unwrap_or_default()
    }

    /// Drops the KV cache and the prompt prefixes kept in memory (the next request processes
    /// its whole prompt, unless the prefix cache folder holds its prefix).
    pub fn reset_cache(&self) {
        if let Ok(mut st) = self.inner.state.lock() {
            let _ = st.model.truncate_cache(0);
            st.cached.clear();
        }
        self.inner.prefixes.forget_memory();
    }
}

#[async_trait]
impl Llm for LocalLlm {
    async fn chat(&self, req: ChatRequest) -> Result<DeltaStream, LlmError> {
        generate::start(self.inner.clone(), req)
    }

    fn capabilities(&self) -> Capabilities {
        // Tool calls are decoded between `<tool_call>` tokens; vocabularies without them (Gemma)
        // can only call tools through a text protocol (ReAct).
        let native = self.inner.tok.special("<tool_call>").is_some();
        Capabilities {
            native_tools: native,
            parallel_tool_calls: native,
            images: self.inner.vision.is_some(),
            local: true,
            in_process: true,
        }
    }

    fn name(&self) -> String {
        self.name.clone()
    }
}

/// candle runs quantized matmuls on a pool of spinning threads sized by `CANDLE_NUM_THREADS`
/// (default: all cores), created on first use. On an idle machine that pool is the fastest
/// decode (2 cores: 51 tokens/s vs 32 on one thread); on a busy one the spinning threads wait on
/// each other and decode drops to 3-7 tokens/s, while one thread keeps 25-33. Unless the caller
/// chose a value, the pool gets all cores when the other processes used at most all but half a
/// core over 100 ms, else none besides the calling thread. Done once, before candle reads the
/// variable (candle takes its size from there only).
fn size_quantized_matmul_pool(chosen: Option<usize>) {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        if let Some(n) = chosen {
            std::env::set_var("CANDLE_NUM_THREADS", n.max(1).to_string());
            return;
        }
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        // The pool's threads spin at their barriers, so they must not share cores with other
        // work. Measured, not read from the load average: a 2-core VM here reported 1.3-2.0
        // while `/proc/stat` showed both cores idle, which at 2.0 picks one thread.
        let busy = busy_cores(std::time::Duration::from_millis(100));
        let threads = match busy {
            Some(b) if b <= cores as f64 - 0.5 => cores,
            _ => 1,
        };
        tracing::debug!(?busy, threads, "quantized matmul threads");
        std::env::set_var("CANDLE_NUM_THREADS", threads.to_string());
    });
}

/// Cores' worth of CPU time all processes but this one used over `window` (from `/proc/stat`
/// and `/proc/self/stat`); `None` where they cannot be read.
fn busy_cores(window: std::time::Duration) -> Option<f64> {
    // (busy, all) ticks of every CPU, and this process's ticks.
    fn sample() -> Option<(u64, u64, u64)> {
        let stat = std::fs::read_to_string("/proc/stat").ok()?;
        let cpu: Vec<u64> = stat
            .lines()
            .next()?
            .split_whitespace()
            .skip(1)
            .map(|v| v.parse().ok())
            .collect::<Option<_>>()?;
        // user nice system idle iowait irq softirq steal ...: idle and iowait are free; steal
        // (time the hypervisor gave to other machines) is left out, as no process here ran.
        let all: u64 = cpu.iter().take(7).sum();
        let free = cpu.get(3)? + cpu.get(4).copied().unwrap_or(0);
        let own = std::fs::read_to_string("/proc/self/stat").ok()?;
        // Fields after the command's closing parenthesis; utime and stime are 14 and 15.
        let rest = own.rsplit_once(')')?.1;
        let f: Vec<&str> = rest.split_whitespace().collect();
        let mine = f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?;
        Some((all - free, all, mine))
    }
    let (b0, a0, m0) = sample()?;
    std::thread::sleep(window);
    let (b1, a1, m1) = sample()?;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
    let elapsed = a1.checked_sub(a0).filter(|&t| t > 0)? as f64;
    let others = (b1.saturating_sub(b0)).saturating_sub(m1.saturating_sub(m0)) as f64;
    Some(others / elapsed * cores)
}

pub(crate) fn next_call_id(inner: &Inner) -> String {
    format!(
        "call_{}",
        inner.call_counter.fetch_add(1, Ordering::Relaxed)
    )
}

#[cfg(test)]
mod tests {
    /// Another process spinning shows as busy cores; this process's own work does not.
    #[cfg(target_os = "linux")]
    #[test]
    fn busy_cores_counts_other_processes_only() {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
        let window = std::time::Duration::from_millis(300);
        let mut spinner = std::process::Command::new("sh")
            .args(["-c", "while :; do :; done"])
            .spawn()
            .expect("sh runs");
        let busy = super::busy_cores(window);
        let _ = spinner.kill();
        let _ = spinner.wait();
        let busy = busy.expect("/proc is readable");
        assert!(busy >= 0.5 && busy <= cores + 0.5, "{busy} of {cores}");
    }
}
