//! The in-process Gemma 3 multimodal backend (MedGemma 4B's architecture): `[vlm] backend =
//! "native"` with `model = "local-vlm:PATH"`, run by `hilum_llm_local` (on the CPU, or `device = "cuda:0"`), the engine
//! behind `--llm local-vlm:PATH`. The picture goes to the model as a PNG data URL inside this
//! process and is decoded there; nothing is sent anywhere.
//!
//! A model loads on its first call (a 4B model takes seconds to minutes) and is kept in the
//! settings' [`LocalVlms`], which every toolbox built from the same settings shares; a load that
//! failed is tried again on the next call (the files may have been fixed meanwhile).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hilum_agent::ToolError;
use hilum_llm::{ChatRequest, FinishReason, ImagePayload, Llm, Message};
use hilum_llm_local::model::Precision;
use hilum_llm_local::{GenStats, LocalConfig, LocalDevice, LocalLlm, VlmFiles};
use tokio::sync::OnceCell;

use crate::vlm::LOCAL_VLM_PREFIX;

/// A loaded model.
pub struct LoadedVlm {
    llm: LocalLlm,
    /// One question at a time: a question's statistics are read after it, from the model.
    turn: tokio::sync::Mutex<()>,
}

type Slot = Arc<OnceCell<Arc<LoadedVlm>>>;

/// The `local-vlm:` models of one configuration, by spec, each loaded once.
#[derive(Clone, Default)]
pub struct LocalVlms {
    models: Arc<Mutex<HashMap<String, Slot>>>,
    /// How a snapshot's decoder is stored once loaded (`HILUM_VLM_QUANTIZE`); `None`: the local
    /// engine's default (Q8_0).
    precision: Option<Precision>,
}

impl std::fmt::Debug for LocalVlms {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let loaded: Vec<String> = self
            .models
            .lock()
            .map(|m| {
                m.iter()
                    .filter(|(_, c)| c.initialized())
                    .map(|(k, _)| k.clone())
                    .collect()
            })
            .unwrap_or_default();
        f.debug_struct("LocalVlms")
            .field("loaded", &loaded)
            .field("precision", &self.precision)
            .finish()
    }
}

/// What the model answered, with its costs.
#[derive(Clone, Debug)]
pub struct LocalAnswer {
    /// The answer's text.
    pub text: String,
    /// The model's name (`local-vlm:FILE`).
    pub model: String,
    /// Why generation stopped.
    pub finish: FinishReason,
    /// Tokens written.
    pub completion_tokens: u32,
    /// Timings of the prompt and of generation.
    pub stats: GenStats,
}

impl LocalVlms {
    /// Snapshots load with their decoder stored as `precision` (models loaded later).
    pub fn set_precision(&mut self, precision: Precision) {
        self.precision = Some(precision);
    }

    /// The model of `spec`, loaded now if this is its first use; with the time spent loading.
    pub async fn get(
        &self,
        spec: &str,
        device: LocalDevice,
    ) -> Result<(Arc<LoadedVlm>, Duration), ToolError> {
        let slot = {
            let mut models = self
                .models
                .lock()
                .map_err(|_| ToolError::Internal("the local VLM table was poisoned".into()))?;
            models.entry(key(spec, device)).or_default().clone()
        };
        let mut load = Duration::ZERO;
        let model = slot
            .get_or_try_init(|| async {
                let t0 = Instant::now();
                let m = load_model(spec.to_string(), device, self.precision).await?;
                load = t0.elapsed();
                Ok::<_, ToolError>(Arc::new(m))
            })
            .await?
            .clone();
        Ok((model, load))
    }

    /// The model of `spec` on `device` if it is loaded.
    pub fn loaded(&self, spec: &str, device: LocalDevice) -> Option<LocalLlm> {
        let models = self.models.lock().ok()?;
        models.get(&key(spec, device))?.get().map(|m| m.llm.clone())
    }
}

/// One copy per (files, device).
fn key(spec: &str, device: LocalDevice) -> String {
    format!("{spec}@{device}")
}

/// Loads `spec`'s files on a blocking thread; any failure says which file and what to set.
async fn load_model(
    spec: String,
    device: LocalDevice,
    precision: Option<Precision>,
) -> Result<LoadedVlm, ToolError> {
    let what = format!("{LOCAL_VLM_PREFIX}{spec}");
    let loaded = tokio::task::spawn_blocking(move || {
        let files = VlmFiles::parse(&spec)?;
        let mut cfg = LocalConfig::new(files.main_path());
        cfg.device = device;
        if let Some(p) = precision {
            cfg.snapshot_precision = p;
        }
        LocalLlm::load_vlm(cfg, files)
    })
    .await
    .map_err(|e| ToolError::Internal(format!("loading {what}: {e}")))?;
    let llm = loaded.map_err(|e| {
        ToolError::Unprocessable(format!(
            "the in-process VLM `{what}` could not be loaded: {e}. Point model = \
             \"{LOCAL_VLM_PREFIX}PATH\" in the [vlm] table (or HILUM_VLM_MODEL) at a Gemma 3 \
             multimodal model such as MedGemma 4B: a snapshot folder (config.json, \
             model*.safetensors, tokenizer.json), TEXT.gguf,MMPROJ.gguf, or TEXT.gguf with one \
             mmproj*.gguf beside it"
        ))
    })?;
    if !llm.capabilities().images {
        return Err(ToolError::Unprocessable(format!(
            "`{what}` loaded without a vision tower; it cannot read the radiograph"
        )));
    }
    Ok(LoadedVlm {
        llm,
        turn: tokio::sync::Mutex::new(()),
    })
}

impl LoadedVlm {
    /// The model's name (`local-vlm:FILE`).
    pub fn name(&self) -> String {
        self.llm.name()
    }

    /// One question about one picture (`image_id`, a PNG data URL), answered greedily: the
    /// system text, then one user turn with the picture before the question, as the served
    /// path sends a generic-family model.
    pub async fn ask(
        &self,
        system: &str,
        image_id: &str,
        data_url: String,
        question: &str,
        max_tokens: u32,
    ) -> Result<LocalAnswer, ToolError> {
        let req = ChatRequest {
            messages: vec![
                Message::system(system),
                Message::user(question, vec![image_id.to_string()]),
            ],
            temperature: Some(0.0),
            max_tokens: Some(max_tokens),
            images: vec![ImagePayload {
                id: image_id.to_string(),
                data_url,
            }],
            ..ChatRequest::default()
        };
        let name = self.llm.name();
        let failed = |e: hilum_llm::LlmError| {
            ToolError::Unprocessable(format!("the in-process VLM `{name}` failed: {e}"))
        };
        let _turn = self.turn.lock().await;
        let stream = self.llm.chat(req).await.map_err(failed)?;
        // Read to the end: the model has stored this request's statistics by then.
        let turn = hilum_llm::collect_turn(stream, |_| {})
            .await
            .map_err(failed)?;
        Ok(LocalAnswer {
            text: turn.text.trim().to_string(),
            model: self.llm.name(),
            finish: turn.finish,
            completion_tokens: turn.usage.completion_tokens,
            stats: self.llm.last_stats(),
        })
    }
}
