//! Gemma 3 multimodal as the local reasoner (`--llm local-vlm:`): the conversation's pictures
//! go into the prompt as soft tokens, in this process.
//!
//! A picture's soft tokens are written into the prompt as ids of their own, `VIRTUAL_BASE +
//! slot x N + i` (N soft tokens per picture, `slot` one per distinct picture by the digest of
//! its PNG): the prompt stays a list of ids, so the KV cache's prefix match, the prefix cache and
//! the rewinds of `generate` work unchanged, and two different pictures never share cached
//! positions. [`VlmDecoder::forward`] puts each picture's features in place of its ids.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use candle_core::Tensor;
use sha2::{Digest, Sha256};

use hilum_llm::{ImagePayload, Message, ToolSpec};

use super::{Gemma3Vlm, BOI_TEXT, EOI_TEXT, IMAGE_TOKEN_TEXT};
use crate::gemma3::Gemma3;
use crate::{ChatTemplate, GgufTokenizer, LocalError};

/// First id of the pictures' soft tokens (above any vocabulary).
pub(crate) const VIRTUAL_BASE: u32 = 0x4000_0000;

/// Whether `t` stands for a picture's soft token.
pub(crate) fn is_virtual(t: u32) -> bool {
    t >= VIRTUAL_BASE
}

/// Decoded pictures' features kept for later requests, at most this many.
const KEEP_FEATURES: usize = 16;

/// A multimodal model's files, as `--llm local-vlm:SPEC` names them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum VlmFiles {
    /// A Hugging Face snapshot folder: `config.json`, `model*.safetensors`, `tokenizer.json`
    /// (and the chat template in `chat_template.jinja`, `chat_template.json` or
    /// `tokenizer_config.json`).
    Snapshot(PathBuf),
    /// llama.cpp's text GGUF (with its tokenizer and chat template) and mmproj GGUF.
    Gguf {
        /// The text model's GGUF.
        text: PathBuf,
        /// The vision tower and projector's GGUF (mmproj).
        mmproj: PathBuf,
    },
}

impl VlmFiles {
    /// `DIR` (a snapshot), `TEXT.gguf,MMPROJ.gguf`, or `TEXT.gguf` alone when exactly one
    /// `mmproj*.gguf` lies beside it.
    pub fn parse(spec: &str) -> Result<Self, LocalError> {
        let io = |path: &Path, reason: &str| LocalError::VlmFiles {
            path: path.display().to_string(),
            reason: reason.to_string(),
        };
        let spec = spec.trim();
        if spec.is_empty() {
            return Err(LocalError::Unsupported(
                "local-vlm: needs a path: a snapshot folder, TEXT.gguf,MMPROJ.gguf, or TEXT.gguf with its mmproj*.gguf beside it".into(),
            ));
        }
        if let Some((text, mmproj)) = spec.split_once(',') {
            let (text, mmproj) = (PathBuf::from(text.trim()), PathBuf::from(mmproj.trim()));
            for p in [&text, &mmproj] {
                if !p.is_file() {
                    return Err(io(p, "no such file"));
                }
            }
            return Ok(VlmFiles::Gguf { text, mmproj });
        }
        let path = PathBuf::from(spec);
        if path.is_dir() {
            for need in ["config.json", "tokenizer.json"] {
                if !path.join(need).is_file() {
                    return Err(io(
                        &path.join(need),
                        "missing: a snapshot folder needs config.json, model*.safetensors and tokenizer.json",
                    ));
                }
            }
            let has_weights = std::fs::read_dir(&path)
                .map_err(|e| io(&path, &e.to_string()))?
                .filter_map(|e| e.ok())
                .any(|e| {
                    let n = e.file_name();
                    let n = n.to_string_lossy();
                    n.starts_with("model") && n.ends_with(".safetensors")
                });
            if !has_weights {
                return Err(io(&path, "no model*.safetensors in this snapshot folder"));
            }
            return Ok(VlmFiles::Snapshot(path));
        }
        if !path.is_file() {
            return Err(io(&path, "no such file or folder"));
        }
        let dir = path.parent().filter(|d| !d.as_os_str().is_empty());
        let dir = dir.unwrap_or(Path::new("."));
        let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(|e| io(dir, &e.to_string()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with("mmproj") && n.ends_with(".gguf"))
            })
            .filter(|p| *p != path)
            .collect();
        found.sort();
        match found.len() {
            1 => Ok(VlmFiles::Gguf {
                text: path,
                mmproj: found.remove(0),
            }),
            0 => Err(io(
                &path,
                "no mmproj*.gguf beside it: name the vision file as local-vlm:TEXT.gguf,MMPROJ.gguf",
            )),
            _ => Err(io(
                &path,
                &format!(
                    "{} mmproj*.gguf files beside it: name one as local-vlm:TEXT.gguf,MMPROJ.gguf",
                    found.len()
                ),
            )),
        }
    }

    /// The file or folder the model is known by (its name, the prefix cache's key).
    pub fn main_path(&self) -> &Path {
        match self {
            VlmFiles::Snapshot(d) => d,
            VlmFiles::Gguf { text, .. } => text,
        }
    }
}

/// A picture of one prompt: its slot and its pixels.
#[derive(Clone, Debug)]
pub(crate) struct PromptImage {
    pub slot: u32,
    pub payload: ImagePayload,
}

/// The prompt side of a multimodal model: placeholders, soft-token ids, slots.
pub(crate) struct Vision {
    /// Soft tokens per picture.
    pub per_image: usize,
    pub image_token: u32,
    /// Digest of a picture's data URL -> its slot.
    slots: Mutex<HashMap<[u8; 32], u32>>,
}

/// `text` without the markers that stand for pictures (a user cannot write one).
fn strip_markers(text: &str) -> String {
    let mut t = text.to_string();
    for m in [BOI_TEXT, EOI_TEXT, IMAGE_TOKEN_TEXT] {
        t = t.replace(m, "");
    }
    t
}

impl Vision {
    pub(crate) fn new(per_image: usize, image_token: u32) -> Self {
        Vision {
            per_image,
            image_token,
            slots: Mutex::new(HashMap::new()),
        }
    }

    fn slot(&self, payload: &ImagePayload) -> Result<u32, LocalError> {
        let digest: [u8; 32] = Sha256::digest(payload.data_url.as_bytes()).into();
        let mut slots = self
            .slots
            .lock()
            .map_err(|_| LocalError::Inference("the picture slots were poisoned".into()))?;
        let next = slots.len() as u32;
        let max = (u32::MAX - VIRTUAL_BASE) / self.per_image.max(1) as u32;
        if next >= max {
            return Err(LocalError::Inference(
                "this process has seen too many distinct pictures; restart it".into(),
            ));
        }
        Ok(*slots.entry(digest).or_insert(next))
    }

    /// The conversation as the model reads it: each picture a user turn names and `images`
    /// holds goes in as `<start_of_image>` before the turn's text (as Gemma3Processor puts an
    /// image item), expanded to its soft tokens; consecutive user turns are one turn (Gemma's
    /// template wants the roles to alternate).
    pub(crate) fn encode(
        &self,
        tok: &GgufTokenizer,
        template: &ChatTemplate,
        messages: &[Message],
        tools: &[ToolSpec],
        add_generation_prompt: bool,
        images: &[ImagePayload],
    ) -> Result<(Vec<u32>, Vec<PromptImage>), LocalError> {
        let mut msgs: Vec<Message> = Vec::with_capacity(messages.len());
        let mut order: Vec<&ImagePayload> = Vec::new();
        for m in messages {
            let m = match m {
                Message::User {
                    content,
                    images: ids,
                } => {
                    let shown: Vec<&ImagePayload> = ids
                        .iter()
                        .filter_map(|id| images.iter().find(|p| &p.id == id))
                        .collect();
                    let content =
                        format!("{}{}", BOI_TEXT.repeat(shown.len()), strip_markers(content));
                    order.extend(shown);
                    if let Some(Message::User {
                        content: prev,
                        images: prev_ids,
                    }) = msgs.last_mut()
                    {
                        prev.push_str("\n\n");
                        prev.push_str(&content);
                        prev_ids.extend(ids.iter().cloned());
                        continue;
                    }
                    Message::User {
                        content,
                        images: ids.clone(),
                    }
                }
                Message::System { content } => Message::System {
                    content: strip_markers(content),
                },
                Message::Assistant {
                    content,
                    tool_calls,
                } => Message::Assistant {
                    content: strip_markers(content),
                    tool_calls: tool_calls.clone(),
                },
                Message::Tool {
                    tool_call_id,
                    name,
                    content,
                    is_error,
                } => Message::Tool {
                    tool_call_id: tool_call_id.clone(),
                    name: name.clone(),
                    content: strip_markers(content),
                    is_error: *is_error,
                },
            };
            msgs.push(m);
        }
        let text = template.render(&msgs, tools, add_generation_prompt)?;
        let span = format!(
            "\n\n{BOI_TEXT}{}{EOI_TEXT}\n\n",
            IMAGE_TOKEN_TEXT.repeat(self.per_image)
        );
        let mut ids = tok.encode(&text.replace(BOI_TEXT, &span))?;
        let mut out = Vec::with_capacity(order.len());
        let mut i = 0;
        while i < ids.len() {
            if ids[i] != self.image_token {
                i += 1;
                continue;
            }
            let run = ids[i..]
                .iter()
                .take_while(|&&t| t == self.image_token)
                .count();
            let Some(payload) = order.get(out.len()) else {
                return Err(LocalError::Template(
                    "the rendered prompt has more picture places than pictures".into(),
                ));
            };
            if run != self.per_image {
                return Err(LocalError::Template(format!(
                    "a picture's place in the prompt is {run} tokens, not {}",
                    self.per_image
                )));
            }
            let slot = self.slot(payload)?;
            let base = VIRTUAL_BASE + slot * self.per_image as u32;
            for (j, t) in ids[i..i + run].iter_mut().enumerate() {
                *t = base + j as u32;
            }
            out.push(PromptImage {
                slot,
                payload: (*payload).clone(),
            });
            i += run;
        }
        if out.len() != order.len() {
            return Err(LocalError::Template(format!(
                "the chat template kept {} of the {} pictures' places",
                out.len(),
                order.len()
            )));
        }
        Ok((ids, out))
    }
}

/// The decoder side: the model and the features of recent pictures, by slot.
pub struct VlmDecoder {
    /// The model.
    pub vlm: Gemma3Vlm,
    features: HashMap<u32, Tensor>,
}

impl VlmDecoder {
    pub(crate) fn new(vlm: Gemma3Vlm) -> Self {
        VlmDecoder {
            vlm,
            features: HashMap::new(),
        }
    }

    /// The text decoder.
    pub fn decoder(&self) -> &Gemma3 {
        self.vlm.decoder()
    }

    /// The text decoder, for steps that change its cache.
    pub fn decoder_mut(&mut self) -> &mut Gemma3 {
        self.vlm.decoder_mut()
    }

    /// Encodes the pictures whose features are not kept (PNG or JPEG data URLs, decoded here);
    /// keeps at most [`KEEP_FEATURES`], those of `images` first.
    pub(crate) fn encode_images(&mut self, images: &[PromptImage]) -> Result<(), LocalError> {
        for im in images {
            if self.features.contains_key(&im.slot) {
                continue;
            }
            let (bytes, w, h, c) = decode_data_url(&im.payload)?;
            let px = self.vlm.pixel_values(&bytes, w, h, c)?;
            let f = self.vlm.image_features(&px)?;
            self.features.insert(im.slot, f);
        }
        if self.features.len() > KEEP_FEATURES {
            self.features
                .retain(|slot, _| images.iter().any(|i| i.slot == *slot));
        }
        Ok(())
    }

    /// Runs `tokens` after the cached positions; returns the logits of the last one. Picture
    /// ids take their picture's features; each picture's run attends to itself both ways (a
    /// run must lie whole in one call: `generate` cuts its passes so).
    pub fn forward(&mut self, tokens: &[u32]) -> candle_core::Result<Tensor> {
        if !tokens.iter().any(|&t| is_virtual(t)) {
            return self.vlm.decoder_mut().forward(tokens);
        }
        let n = self.vlm.cfg.mm_tokens_per_image;
        let d = self.vlm.cfg.text.hidden;
        let image_token = self.vlm.cfg.image_token;
        let pos = self.vlm.decoder().cached_len();
        let plain: Vec<u32> = tokens
            .iter()
            .map(|&t| if is_virtual(t) { image_token } else { t })
            .collect();
        let mut rows = self
            .vlm
            .decoder()
            .embed_tokens(&plain)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        let mut blocks: Vec<(usize, usize)> = Vec::new();
        let mut prev_slot = None;
        for (i, &t) in tokens.iter().enumerate() {
            if !is_virtual(t) {
                prev_slot = None;
                continue;
            }
            let v = (t - VIRTUAL_BASE) as usize;
            let (slot, j) = ((v / n) as u32, v % n);
            let f = self.features.get(&slot).ok_or_else(|| {
                candle_core::Error::Msg(format!("picture {slot} was not encoded"))
            })?;
            let row = f.get(j)?.to_vec1::<f32>()?;
            if row.len() != d {
                candle_core::bail!("picture features of width {}, expected {d}", row.len());
            }
            rows[i * d..(i + 1) * d].copy_from_slice(&row);
            match blocks.last_mut() {
                Some((_, e)) if prev_slot == Some(slot) && *e == pos + i => *e += 1,
                _ => blocks.push((pos + i, pos + i + 1)),
            }
            prev_slot = Some(slot);
        }
        let dev = self.vlm.decoder().device().clone();
        let x = Tensor::from_vec(rows, (tokens.len(), d), &dev)?;
        self.vlm.decoder_mut().forward_embeds(&x, &blocks, false)
    }
}

/// The pixels of a `data:image/png;base64,…` (or JPEG) URL: (bytes, width, height, channels).
fn decode_data_url(p: &ImagePayload) -> Result<(Vec<u8>, usize, usize, usize), LocalError> {
    use base64::Engine;
    let bad = |why: String| LocalError::Inference(format!("picture {}: {why}", p.id));
    let b64 = p
        .data_url
        .split_once(";base64,")
        .map(|(_, b)| b)
        .ok_or_else(|| bad("not a base64 data URL".into()))?;
    let raw = base64::engine::general_purpose::STANDARD
        .decode(b64.trim())
        .map_err(|e| bad(format!("bad base64: {e}")))?;
    let img = image::load_from_memory(&raw).map_err(|e| bad(format!("cannot decode: {e}")))?;
    let (w, h) = (img.width() as usize, img.height() as usize);
    if img.color().has_color() {
        Ok((img.to_rgb8().into_raw(), w, h, 3))
    } else {
        Ok((img.to_luma8().into_raw(), w, h, 1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_name_their_files_or_say_what_is_missing() {
        let dir = tempfile::tempdir().unwrap();
        let text = dir.path().join("medgemma.gguf");
        std::fs::write(&text, b"x").unwrap();
        let err = VlmFiles::parse(text.to_str().unwrap())
            .unwrap_err()
            .to_string();
        assert!(err.contains("no mmproj*.gguf beside it"), "{err}");
        let mm = dir.path().join("mmproj-medgemma.gguf");
        std::fs::write(&mm, b"x").unwrap();
        assert_eq!(
            VlmFiles::parse(text.to_str().unwrap()).unwrap(),
            VlmFiles::Gguf {
                text: text.clone(),
                mmproj: mm.clone()
            }
        );
        let pair = format!(
            "{},{}",
            text.display(),
            dir.path().join("nope.gguf").display()
        );
        let err = VlmFiles::parse(&pair).unwrap_err().to_string();
        assert!(
            err.contains("nope.gguf") && err.contains("no such file"),
            "{err}"
        );
        let err = VlmFiles::parse(dir.path().to_str().unwrap())
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("config.json") && err.contains("missing"),
            "{err}"
        );
        assert!(VlmFiles::parse("").is_err());
    }

    #[test]
    fn markers_in_text_are_removed() {
        assert_eq!(
            strip_markers("a<start_of_image>b<image_soft_token><end_of_image>c"),
            "abc"
        );
    }
}
