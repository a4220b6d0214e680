//! The VLM layer used by `answer_visual_question` and `ground_phrase`, one backend per tool:
//! - served: an OpenAI-compatible multimodal chat endpoint (vLLM, SGLang, llama.cpp server, …),
//!   reached through `hilum_llm`'s OpenAI-compatible client with the image as a PNG data URL;
//! - native (`backend = "native"`): a LLaVA-family model from the model registry
//!   (`model = "llava-med-v1.5"`) run in-process by `hilum_models::llava`; pixels never leave
//!   the process;
//! - native Gemma 3 multimodal (`backend = "native"`, `model = "local-vlm:PATH"`, MedGemma 4B's
//!   architecture) run in-process by `hilum_llm_local` (see [`crate::vlm_local`]). PATH is what
//!   `--llm local-vlm:PATH` takes: a snapshot folder, `TEXT.gguf,MMPROJ.gguf`, or `TEXT.gguf`
//!   with one `mmproj*.gguf` beside it. The `local-vlm:` prefix in `model` is the one new thing:
//!   registry ids never contain a colon, and the agent's reasoner already spells such a model
//!   so. It runs on the CPU unless `device` names a GPU (`cuda:0`, a CUDA build);
//!   `answer_visual_question` only.
//!
//! Configuration: the `[vlm]` table of the Hilum config file, with optional per-tool tables
//! (`[vlm.tools.ground_phrase]`) overriding it, and `HILUM_VLM_BACKEND`, `HILUM_VLM_BASE_URL`,
//! `HILUM_VLM_MODEL`, `HILUM_VLM_FAMILY`, `HILUM_VLM_API_KEY` overriding the file (so
//! `HILUM_VLM_BACKEND=native HILUM_VLM_MODEL=local-vlm:PATH` selects MedGemma). Pixels only go
//! to a loopback endpoint, or to one the site marked `allow_pixels = true` (an on-site GPU
//! server).

use std::collections::BTreeMap;
use std::time::Duration;

use hilum_agent::ToolError;
use hilum_imaging::CxrImage;
use serde::Deserialize;
use serde_json::Value;
use thiserror::Error;

/// Which model family sits behind the endpoint: decides the prompt and how boxes are read.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
pub enum Family {
    /// Microsoft MAIRA-2: grounded phrases as `<obj>…</obj><box><x..><y..><x..><y..></box>`.
    #[serde(rename = "maira2", alias = "maira-2")]
    Maira2,
    /// Qwen2.5-VL: JSON boxes `[{"bbox_2d": [x1, y1, x2, y2], "label": …}]` in input pixels.
    #[serde(rename = "qwen2.5-vl", alias = "qwen2.5vl", alias = "qwen2_5_vl")]
    Qwen25Vl,
    /// Anything else (CheXagent, MedGemma, LLaVA-Med): both box formats are tried.
    #[serde(rename = "generic")]
    Generic,
}

impl Family {
    /// The family named `s` (case and surrounding spaces ignored).
    pub fn parse(s: &str) -> Result<Family, VlmError> {
        serde_json::from_value(Value::String(s.trim().to_ascii_lowercase())).map_err(|_| {
            VlmError::Config(format!(
                "unknown VLM family `{s}`: use maira2, qwen2.5-vl or generic"
            ))
        })
    }

    /// Its name in settings.
    pub fn as_str(self) -> &'static str {
        match self {
            Family::Maira2 => "maira2",
            Family::Qwen25Vl => "qwen2.5-vl",
            Family::Generic => "generic",
        }
    }
}

/// Why the VLM layer failed, in words a user can act on.
#[derive(Debug, Error)]
pub enum VlmError {
    /// No endpoint or native model is set for the tool.
    #[error(
        "no VLM endpoint is configured for `{tool}`: set HILUM_VLM_BASE_URL and HILUM_VLM_MODEL \
         (and HILUM_VLM_FAMILY), or base_url/model/family in the [vlm] table of the config file \
         (or backend = \"native\" to run a model in-process: an installed LLaVA, or MedGemma \
         with model = \"local-vlm:PATH\")"
    )]
    NotConfigured {
        /// The tool's name.
        tool: String,
    },
    /// The configuration is wrong; the text says which setting and why.
    #[error("VLM configuration: {0}")]
    Config(String),
    /// Pixels would go to an endpoint off loopback without `allow_pixels`.
    #[error(
        "refusing to send pixels to {url}: it is not a loopback address; if it is an on-site \
         server allowed to see images, set allow_pixels = true in the [vlm] table"
    )]
    PixelsNotAllowed {
        /// The endpoint's URL.
        url: String,
    },
    /// The endpoint could not be reached.
    #[error("VLM endpoint {url} unreachable: {reason}; check that the server is running")]
    Unreachable {
        /// The endpoint's URL.
        url: String,
        /// What the connection reported.
        reason: String,
    },
    /// The endpoint answered with an HTTP error.
    #[error("VLM endpoint {url} answered HTTP {status}: {body}")]
    Status {
        /// The endpoint's URL.
        url: String,
        /// The HTTP status code.
        status: u16,
        /// The body of the answer.
        body: String,
    },
    /// The endpoint answered something that is not a chat completion.
    #[error("VLM endpoint {url} sent a response that is not a chat completion: {reason}")]
    BadResponse {
        /// The endpoint's URL.
        url: String,
        /// What was wrong with the answer.
        reason: String,
    },
    /// The image could not be resized or encoded for sending.
    #[error("could not prepare the image for the VLM: {0}")]
    Image(String),
}

impl From<VlmError> for ToolError {
    fn from(e: VlmError) -> ToolError {
        match e {
            VlmError::Image(m) => ToolError::Internal(m),
            other => ToolError::Unprocessable(other.to_string()),
        }
    }
}

/// One table of settings; every field optional so per-tool tables can override a few.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EndpointTable {
    /// `served` (default) or `native`.
    pub backend: Option<String>,
    /// Native backend: the one device the model runs on (`cpu`, `cuda:0`, …); default: routed
    /// across the pool's devices (`--device`; the CPU unless told otherwise).
    pub device: Option<String>,
    /// Base URL of the OpenAI-compatible server (e.g. `http://127.0.0.1:8000/v1`).
    pub base_url: Option<String>,
    /// Model name the server serves (native: registry id).
    pub model: Option<String>,
    /// Prompt and output format of the model.
    pub family: Option<Family>,
    /// API key sent as a bearer token.
    pub api_key: Option<String>,
    /// The endpoint may receive pixels although it is not on loopback.
    pub allow_pixels: Option<bool>,
    /// Seconds to wait for an answer (default 120).
    pub timeout_secs: Option<u64>,
    /// Largest number of tokens the model may write (default 512).
    pub max_tokens: Option<u32>,
    /// Longest side of the image sent (MAIRA-2 and generic families).
    pub max_side: Option<u32>,
    /// Pixel budget of the image sent to Qwen2.5-VL (its `max_pixels`).
    pub max_pixels: Option<u32>,
}

impl EndpointTable {
    fn or(&self, base: &EndpointTable) -> EndpointTable {
        EndpointTable {
            backend: self.backend.clone().or_else(|| base.backend.clone()),
            device: self.device.clone().or_else(|| base.device.clone()),
            base_url: self.base_url.clone().or_else(|| base.base_url.clone()),
            model: self.model.clone().or_else(|| base.model.clone()),
            family: self.family.or(base.family),
            api_key: self.api_key.clone().or_else(|| base.api_key.clone()),
            allow_pixels: self.allow_pixels.or(base.allow_pixels),
            timeout_secs: self.timeout_secs.or(base.timeout_secs),
            max_tokens: self.max_tokens.or(base.max_tokens),
            max_side: self.max_side.or(base.max_side),
            max_pixels: self.max_pixels.or(base.max_pixels),
        }
    }
}

/// The `[vlm]` table: defaults for every VLM tool, and per-tool overrides.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VlmSettings {
    /// Settings every VLM tool starts from (the top of the table).
    #[serde(flatten)]
    pub default: EndpointTable,
    /// Per-tool overrides, by tool name (`[vlm.tools.ground_phrase]`).
    #[serde(default)]
    pub tools: BTreeMap<String, EndpointTable>,
    /// A configuration that failed to load: every endpoint reports it instead of guessing.
    #[serde(skip)]
    pub broken: Option<String>,
    /// The in-process Gemma 3 models (`local-vlm:`) loaded so far: shared by every tool and
    /// tenant built from these settings, so each loads once.
    #[serde(skip)]
    pub local_models: crate::vlm_local::LocalVlms,
}

/// A resolved endpoint for one tool.
#[derive(Clone, Debug, PartialEq)]
pub struct Endpoint {
    /// Base URL of the OpenAI-compatible server.
    pub base_url: String,
    /// Model name the server serves.
    pub model: String,
    /// Prompt and output format of the model.
    pub family: Family,
    /// API key sent as a bearer token.
    pub api_key: Option<String>,
    /// The endpoint may receive pixels although it is not on loopback.
    pub allow_pixels: bool,
    /// How long to wait for an answer.
    pub timeout: Duration,
    /// Largest number of tokens the model may write.
    pub max_tokens: u32,
    /// Longest side of the image sent (MAIRA-2 and generic families).
    pub max_side: u32,
    /// Pixel budget of the image sent (Qwen families).
    pub max_pixels: u32,
}

/// The native model of a tool: a registry id run in-process.
#[derive(Clone, Debug, PartialEq)]
pub struct NativeModel {
    /// Registry id, e.g. `llava-med-v1.5`.
    pub model: String,
    /// `None`: routed across the pool's devices.
    pub device: Option<hilum_models::Device>,
    /// Largest number of tokens the model may write.
    pub max_tokens: u32,
}

/// Default registry id of the native backend.
pub const NATIVE_DEFAULT_MODEL: &str = "llava-med-v1.5";

/// The native Gemma 3 multimodal model of a tool (`model = "local-vlm:PATH"`), run in-process
/// on the CPU by `hilum_llm_local`.
#[derive(Clone, Debug, PartialEq)]
pub struct LocalVlmModel {
    /// PATH as `--llm local-vlm:PATH` takes it (see `hilum_llm_local::VlmFiles::parse`).
    pub spec: String,
    /// Largest number of tokens the model may write.
    pub max_tokens: u32,
    /// Longest side of the picture handed to the model (its processor resizes it again).
    pub max_side: u32,
    /// Where it runs (`device` of the table; default the CPU; `cuda:N` on a CUDA build).
    pub device: hilum_llm_local::LocalDevice,
}

/// The prefix of `model` that selects the in-process Gemma 3 engine.
pub const LOCAL_VLM_PREFIX: &str = "local-vlm:";

/// How one tool reaches its VLM.
#[derive(Clone, Debug, PartialEq)]
pub enum Backend {
    /// An OpenAI-compatible server.
    Served(Endpoint),
    /// A registry model run in-process.
    Native(NativeModel),
    /// A Gemma 3 multimodal model run in-process.
    LocalVlm(LocalVlmModel),
}

/// Qwen2.5-VL's patch (14) times its spatial merge (2): input sides are multiples of 28.
pub const QWEN_FACTOR: u32 = 28;
/// Qwen2.5-VL's smallest accepted input (`min_pixels`).
pub const QWEN_MIN_PIXELS: u32 = 56 * 56;

impl VlmSettings {
    /// Parses the `[vlm]` table of a config file's text (other tables are ignored).
    pub fn from_config_text(text: &str) -> Result<VlmSettings, VlmError> {
        let doc: toml::Table = toml::from_str(text)
            .map_err(|e| VlmError::Config(format!("config file is not valid TOML: {e}")))?;
        match doc.get("vlm") {
            None => Ok(VlmSettings::default()),
            Some(v) => v
                .clone()
                .try_into()
                .map_err(|e| VlmError::Config(format!("[vlm] table: {e}"))),
        }
    }

    /// A configuration that could not be read, kept so that each VLM tool call reports it
    /// (the other tools keep working).
    pub fn broken(reason: impl Into<String>) -> VlmSettings {
        VlmSettings {
            broken: Some(reason.into()),
            ..VlmSettings::default()
        }
    }

    /// Environment variables (read through `get`) override the file's defaults.
    pub fn apply_env(&mut self, get: impl Fn(&str) -> Option<String>) -> Result<(), VlmError> {
        let get = |k: &str| get(k).filter(|v| !v.trim().is_empty());
        if let Some(v) = get("HILUM_VLM_BACKEND") {
            self.default.backend = Some(v);
        }
        if let Some(v) = get("HILUM_VLM_BASE_URL") {
            self.default.base_url = Some(v);
        }
        if let Some(v) = get("HILUM_VLM_MODEL") {
            self.default.model = Some(v);
        }
        if let Some(v) = get("HILUM_VLM_FAMILY") {
            self.default.family = Some(Family::parse(&v)?);
        }
        if let Some(v) = get("HILUM_VLM_API_KEY") {
            self.default.api_key = Some(v);
        }
        if let Some(v) = get("HILUM_VLM_QUANTIZE") {
            let p = v
                .parse()
                .map_err(|e| VlmError::Config(format!("HILUM_VLM_QUANTIZE: {e}")))?;
            self.local_models.set_precision(p);
        }
        Ok(())
    }

    fn table(&self, tool: &str) -> Result<EndpointTable, VlmError> {
        if let Some(why) = &self.broken {
            return Err(VlmError::Config(why.clone()));
        }
        Ok(match self.tools.get(tool) {
            Some(over) => over.or(&self.default),
            None => self.default.clone(),
        })
    }

    /// The backend of `tool`: its native model, its served endpoint, or `None` when neither
    /// is configured.
    pub fn backend(&self, tool: &str) -> Result<Option<Backend>, VlmError> {
        let t = self.table(tool)?;
        match t.backend.as_deref().map(str::trim) {
            None | Some("served") => Ok(self.endpoint(tool)?.map(Backend::Served)),
            Some("native") => {
                let max_tokens = t.max_tokens.unwrap_or(256).max(1);
                if let Some(spec) = t
                    .model
                    .as_deref()
                    .and_then(|m| m.trim().strip_prefix(LOCAL_VLM_PREFIX))
                {
                    let max_side = t.max_side.unwrap_or(1024).max(64);
                    return local_vlm(tool, spec, t.device.as_deref(), max_tokens, max_side)
                        .map(Some);
                }
                let device =
                    match t.device.as_deref() {
                        None => None,
                        Some(d) => Some(d.parse().map_err(|e: hilum_models::ModelError| {
                            VlmError::Config(e.to_string())
                        })?),
                    };
                Ok(Some(Backend::Native(NativeModel {
                    model: t.model.unwrap_or_else(|| NATIVE_DEFAULT_MODEL.to_string()),
                    device,
                    max_tokens,
                })))
            }
            Some(other) => Err(VlmError::Config(format!(
                "backend `{other}` of `{tool}`: use served or native"
            ))),
        }
    }

    /// The served endpoint of `tool`, or `None` when no base URL and model are set for it (or
    /// the tool runs natively).
    pub fn endpoint(&self, tool: &str) -> Result<Option<Endpoint>, VlmError> {
        let t = self.table(tool)?;
        if t.backend.as_deref().map(str::trim) == Some("native") {
            return Ok(None);
        }
        let (Some(base_url), Some(model)) = (t.base_url, t.model) else {
            return Ok(None);
        };
        if reqwest::Url::parse(&base_url).is_err() {
            return Err(VlmError::Config(format!(
                "base_url `{base_url}` of `{tool}` is not a URL (e.g. http://127.0.0.1:8000/v1)"
            )));
        }
        Ok(Some(Endpoint {
            base_url: base_url.trim_end_matches('/').to_string(),
            model,
            family: t.family.unwrap_or(Family::Generic),
            api_key: t.api_key,
            allow_pixels: t.allow_pixels.unwrap_or(false),
            timeout: Duration::from_secs(t.timeout_secs.unwrap_or(120)),
            max_tokens: t.max_tokens.unwrap_or(512),
            max_side: t.max_side.unwrap_or(1024).max(64),
            // Qwen's default is 12845056; a CXR needs far less, and tokens cost time.
            max_pixels: t.max_pixels.unwrap_or(28 * 28 * 1280).max(QWEN_MIN_PIXELS),
        }))
    }
}

/// The `local-vlm:` backend of `tool`; the files are looked at when the model loads (first call).
fn local_vlm(
    tool: &str,
    spec: &str,
    device: Option<&str>,
    max_tokens: u32,
    max_side: u32,
) -> Result<Backend, VlmError> {
    let spec = spec.trim();
    if spec.is_empty() {
        return Err(VlmError::Config(format!(
            "model `{LOCAL_VLM_PREFIX}` of `{tool}` needs a path: a snapshot folder, \
             TEXT.gguf,MMPROJ.gguf, or TEXT.gguf with its mmproj*.gguf beside it"
        )));
    }
    let device = match device {
        Some(d) => d
            .parse::<hilum_llm_local::LocalDevice>()
            .map_err(|e| VlmError::Config(format!("device of `{tool}`: {e}")))?,
        None => hilum_llm_local::LocalDevice::Cpu,
    };
    Ok(Backend::LocalVlm(LocalVlmModel {
        spec: spec.to_string(),
        max_tokens,
        max_side,
        device,
    }))
}

/// The image as the endpoint receives it, and the geometry needed to map boxes back.
#[derive(Clone, Debug)]
pub struct SentImage {
    /// The PNG bytes.
    pub png: Vec<u8>,
    /// Size of the PNG sent.
    pub width: u32,
    /// Height of the PNG sent.
    pub height: u32,
    /// Size of the image in the store.
    pub orig_width: u32,
    /// Height of the image in the store.
    pub orig_height: u32,
}

impl SentImage {
    /// The PNG as a `data:` URL for a chat message.
    pub fn data_url(&self) -> String {
        format!(
            "data:image/png;base64,{}",
            hilum_llm::base64_encode(&self.png)
        )
    }
}

/// Qwen2.5-VL's `smart_resize`: sides rounded to multiples of `factor`, area kept within
/// `[min_pixels, max_pixels]`, aspect ratio nearly kept. Returns (height, width).
pub fn smart_resize(
    height: u32,
    width: u32,
    factor: u32,
    min_pixels: u32,
    max_pixels: u32,
) -> (u32, u32) {
    let (h, w, f) = (height.max(1) as f64, width.max(1) as f64, factor as f64);
    let round = |v: f64| ((v / f).round() * f).max(f);
    let (mut hb, mut wb) = (round(h), round(w));
    if hb * wb > max_pixels as f64 {
        let beta = (h * w / max_pixels as f64).sqrt();
        hb = ((h / beta / f).floor() * f).max(f);
        wb = ((w / beta / f).floor() * f).max(f);
    } else if hb * wb < min_pixels as f64 {
        let beta = (min_pixels as f64 / (h * w)).sqrt();
        hb = (h * beta / f).ceil() * f;
        wb = (w * beta / f).ceil() * f;
    }
    (hb as u32, wb as u32)
}

/// The radiograph as 8-bit grey, full resolution.
pub(crate) fn to_gray8(img: &CxrImage) -> Result<image::GrayImage, VlmError> {
    let scale = 255.0 / img.max_value().max(1.0);
    let px = img
        .pixels
        .iter()
        .map(|&v| (v * scale).round().clamp(0.0, 255.0) as u8)
        .collect();
    image::GrayImage::from_raw(img.width, img.height, px)
        .ok_or_else(|| VlmError::Image("pixel buffer does not match the image size".into()))
}

/// [`prepare_image`] on a blocking thread (resizing and PNG encoding are CPU work).
pub async fn prepare_image_blocking(
    img: std::sync::Arc<CxrImage>,
    ep: Endpoint,
) -> Result<SentImage, ToolError> {
    crate::common::run_blocking(move || Ok(prepare_image(&img, &ep)?)).await
}

/// Resizes the radiograph for `ep` and encodes it as PNG. For Qwen2.5-VL the size sent is
/// already what its processor would resize to, so its box coordinates are in the pixels sent.
pub fn prepare_image(img: &CxrImage, ep: &Endpoint) -> Result<SentImage, VlmError> {
    match ep.family {
        Family::Qwen25Vl => {
            let (rh, rw) = smart_resize(
                img.height,
                img.width,
                QWEN_FACTOR,
                QWEN_MIN_PIXELS,
                ep.max_pixels,
            );
            encode_sent(img, rw, rh)
        }
        Family::Maira2 | Family::Generic => prepare_image_max_side(img, ep.max_side),
    }
}

/// The radiograph as PNG with its longer side at most `max_side` (the generic families' input,
/// also what the in-process Gemma 3 model reads).
pub fn prepare_image_max_side(img: &CxrImage, max_side: u32) -> Result<SentImage, VlmError> {
    let (w, h) = (img.width, img.height);
    let s = (max_side as f64 / w.max(h).max(1) as f64).min(1.0);
    encode_sent(
        img,
        ((w as f64 * s).round() as u32).max(1),
        ((h as f64 * s).round() as u32).max(1),
    )
}

/// The radiograph as 8-bit grey, resized to `tw` x `th` (unless already that size), as PNG.
fn encode_sent(img: &CxrImage, tw: u32, th: u32) -> Result<SentImage, VlmError> {
    let gray = to_gray8(img)?;
    let (w, h) = (img.width, img.height);
    let sent = if (tw, th) == (w, h) {
        gray
    } else {
        image::imageops::resize(&gray, tw, th, image::imageops::FilterType::Triangle)
    };
    let mut buf = std::io::Cursor::new(Vec::new());
    image::DynamicImage::ImageLuma8(sent)
        .write_to(&mut buf, image::ImageFormat::Png)
        .map_err(|e| VlmError::Image(format!("PNG encoding: {e}")))?;
    Ok(SentImage {
        png: buf.into_inner(),
        width: tw,
        height: th,
        orig_width: w,
        orig_height: h,
    })
}

/// A client for one endpoint, over Hilum's one OpenAI-compatible client. Construction
/// enforces the pixel policy.
pub struct VlmClient {
    /// Where the client sends its requests.
    pub endpoint: Endpoint,
    llm: hilum_llm::OpenAiLlm,
}

impl std::fmt::Debug for VlmClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VlmClient")
            .field("endpoint", &self.endpoint.base_url)
            .field("model", &self.endpoint.model)
            .finish()
    }
}

/// What the endpoint answered.
#[derive(Clone, Debug)]
pub struct VlmAnswer {
    /// The answer's text.
    pub text: String,
    /// The model that answered.
    pub model: String,
    /// Tokens written, when the server says.
    pub completion_tokens: Option<u64>,
    /// Time until the answer, in milliseconds.
    pub latency_ms: f64,
}

impl VlmClient {
    /// A client for `endpoint`; refuses one off loopback that may not receive pixels.
    pub fn new(endpoint: Endpoint) -> Result<VlmClient, VlmError> {
        if !endpoint.allow_pixels && !hilum_llm::is_loopback_url(&endpoint.base_url) {
            return Err(VlmError::PixelsNotAllowed {
                url: endpoint.base_url.clone(),
            });
        }
        let llm = hilum_llm::OpenAiLlm::new(hilum_llm::OpenAiConfig {
            base_url: endpoint.base_url.clone(),
            model: endpoint.model.clone(),
            api_key: endpoint.api_key.clone(),
            timeout: endpoint.timeout,
            // One request: a VLM that failed (out of memory, bad image) fails the same way again.
            max_retries: 0,
            backoff: Duration::ZERO,
            multimodal: true,
        })
        .map_err(|e| VlmError::Config(e.to_string()))?;
        Ok(VlmClient { endpoint, llm })
    }

    /// One non-streaming chat completion: the image, then the prompt, greedy decoding.
    pub async fn ask(
        &self,
        image: &SentImage,
        system: Option<&str>,
        prompt: &str,
    ) -> Result<VlmAnswer, VlmError> {
        let ep = &self.endpoint;
        let t0 = std::time::Instant::now();
        let answer = self
            .llm
            .ask_image(system, &image.data_url(), prompt, ep.max_tokens, 0.0)
            .await
            .map_err(|e| self.error(e))?;
        Ok(VlmAnswer {
            text: answer.text,
            model: answer.model,
            completion_tokens: answer.usage.map(|u| u64::from(u.completion_tokens)),
            latency_ms: t0.elapsed().as_secs_f64() * 1e3,
        })
    }

    /// The client's error in the VLM's terms (which settings to check).
    fn error(&self, e: hilum_llm::LlmError) -> VlmError {
        use hilum_llm::LlmError;
        let url = format!("{}/chat/completions", self.endpoint.base_url);
        let status = |status: u16, body: String| VlmError::Status {
            url: url.clone(),
            status,
            body: body.chars().take(400).collect(),
        };
        match e {
            LlmError::Unreachable { reason, .. } | LlmError::StreamCut(reason) => {
                VlmError::Unreachable { url, reason }
            }
            LlmError::Timeout { secs } => VlmError::Unreachable {
                reason: format!(
                    "no answer within {secs} s (timeout_secs in the [vlm] table raises it)"
                ),
                url,
            },
            LlmError::Http { status: code, body } => status(code, body),
            LlmError::RateLimited(body) => status(429, body),
            LlmError::Unauthorized => status(
                401,
                "the credentials were rejected: check api_key in the [vlm] table or \
                 HILUM_VLM_API_KEY"
                    .into(),
            ),
            LlmError::NotFound { model, .. } => status(
                404,
                format!("check base_url and the model name `{model}` in the [vlm] table"),
            ),
            LlmError::BadResponse(reason) => VlmError::BadResponse { url, reason },
            other => VlmError::BadResponse {
                url,
                reason: other.to_string(),
            },
        }
    }
}

/// Resolves the client of `tool` from settings, for a tool call.
pub(crate) fn client_for(settings: &VlmSettings, tool: &str) -> Result<VlmClient, VlmError> {
    let ep = settings
        .endpoint(tool)?
        .ok_or_else(|| VlmError::NotConfigured { tool: tool.into() })?;
    VlmClient::new(ep)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smart_resize_gives_multiples_of_28_within_budget() {
        let (h, w) = smart_resize(2544, 3056, 28, QWEN_MIN_PIXELS, 28 * 28 * 1280);
        assert_eq!((h % 28, w % 28), (0, 0));
        assert!(h * w <= 28 * 28 * 1280, "{h}x{w}");
        // Aspect ratio kept within one patch.
        assert!((w as f64 / h as f64 - 3056.0 / 2544.0).abs() < 0.03);
        // Already-conforming sizes are left alone, so boxes are in the pixels sent.
        assert_eq!(
            smart_resize(h, w, 28, QWEN_MIN_PIXELS, 28 * 28 * 1280),
            (h, w)
        );
        assert_eq!(smart_resize(10, 10, 28, QWEN_MIN_PIXELS, 1 << 20), (56, 56));
    }

    #[test]
    fn per_tool_table_overrides_and_env_wins() {
        let mut s = VlmSettings::from_config_text(
            r#"
            [llm]
            spec = "openai:gpt-4o"
            [vlm]
            base_url = "http://127.0.0.1:8000/v1/"
            model = "microsoft/maira-2"
            family = "maira2"
            [vlm.tools.answer_visual_question]
            model = "Qwen/Qwen2.5-VL-7B-Instruct"
            family = "qwen2.5-vl"
            "#,
        )
        .expect("valid");
        let g = s
            .endpoint("ground_phrase")
            .expect("ok")
            .expect("configured");
        assert_eq!(g.family, Family::Maira2);
        assert_eq!(g.base_url, "http://127.0.0.1:8000/v1");
        let q = s
            .endpoint("answer_visual_question")
            .expect("ok")
            .expect("set");
        assert_eq!(
            (q.family, q.model.as_str()),
            (Family::Qwen25Vl, "Qwen/Qwen2.5-VL-7B-Instruct")
        );
        s.apply_env(|k| (k == "HILUM_VLM_MODEL").then(|| "other".to_string()))
            .expect("env");
        assert_eq!(
            s.endpoint("ground_phrase").expect("ok").expect("set").model,
            "other"
        );
        assert!(VlmSettings::default()
            .endpoint("ground_phrase")
            .expect("ok")
            .is_none());
        assert!(matches!(
            s.apply_env(|k| (k == "HILUM_VLM_FAMILY").then(|| "gpt".to_string())),
            Err(VlmError::Config(_))
        ));
        let q = |v: &'static str| move |k: &str| (k == "HILUM_VLM_QUANTIZE").then(|| v.to_string());
        s.apply_env(q("q4k")).expect("a precision");
        assert!(format!("{:?}", s.local_models).contains("Q4K"));
        let e = s.apply_env(q("q3")).expect_err("not a precision");
        assert!(e.to_string().contains("HILUM_VLM_QUANTIZE"), "{e}");
    }

    #[test]
    fn misspelt_keys_are_rejected() {
        let e = VlmSettings::from_config_text("[vlm]\nbase_ulr = \"http://127.0.0.1:8000/v1\"\n")
            .expect_err("typo");
        assert!(e.to_string().contains("base_ulr"), "{e}");
    }

    #[test]
    fn remote_endpoint_without_permission_is_refused() {
        let mut s = VlmSettings::default();
        s.default.base_url = Some("https://vlm.example.org/v1".into());
        s.default.model = Some("m".into());
        let err = client_for(&s, "ground_phrase").expect_err("must refuse");
        assert!(matches!(err, VlmError::PixelsNotAllowed { .. }));
        assert!(err.to_string().contains("allow_pixels"));
        s.default.allow_pixels = Some(true);
        assert!(client_for(&s, "ground_phrase").is_ok());
        s.default.base_url = Some("http://localhost:9/v1".into());
        s.default.allow_pixels = None;
        assert!(client_for(&s, "ground_phrase").is_ok());
    }
}
