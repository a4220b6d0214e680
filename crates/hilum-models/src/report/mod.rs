//! Radiology report generation with the CheXpert-Plus baselines
//! (`IAMJB/chexpert-mimic-cxr-findings-baseline`, `...-impression-baseline`; Chambon et al.,
//! "CheXpert Plus", arXiv:2405.19538): a Hugging Face `VisionEncoderDecoderModel` with a SwinV2
//! image encoder ([`swinv2`]) and a 2-layer BERT decoder with cross-attention
//! ([`bert_decoder`]), decoded greedily or by beam search ([`generate`]) and detokenised with the
//! model's WordPiece tokenizer (`tokenizers`).
//!
//! An installed model is `model.safetensors` with the checkpoint's own parameter names
//! (`encoder.encoder.layers.0.blocks.0...`, `decoder.bert.encoder.layer.0.crossattention...`,
//! an optional `enc_to_dec_proj` when the widths differ), plus the checkpoint's `config.json` and
//! `tokenizer.json`, either embedded in the safetensors metadata by `scripts/convert_report.py`
//! or as files beside the weights.

pub mod bert_decoder;
pub mod generate;
pub mod swinv2;

use std::collections::BTreeMap;
use std::path::Path;

use candle_core::{Module, Tensor};
use candle_nn::{linear, Linear, VarBuilder};
use hilum_imaging::{Filter, Prepared, Preprocess};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::{weights, Device, InstalledModel, Manifest, ModelError};
pub use bert_decoder::{BertDecoder, BertDecoderConfig, CrossKv, KvCache};
pub use generate::{Generated, GenerationConfig};
pub use swinv2::{SwinV2, SwinV2Config};

/// A linear layer applied to (…, in) as one 2-D matmul whatever the batch (beams, windows),
/// instead of candle `Linear`'s weight broadcast over a 3-D batch (no speed difference was
/// measurable here; it keeps one code path).
#[derive(Clone, Debug)]
pub(crate) struct FlatLinear(pub(crate) Linear);

impl Module for FlatLinear {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let dims = x.dims().to_vec();
        if dims.len() <= 2 {
            return self.0.forward(x);
        }
        let y = self.0.forward(&x.flatten_to(dims.len() - 2)?)?;
        let mut shape = dims[..dims.len() - 1].to_vec();
        shape.push(y.dim(1)?);
        y.reshape(shape)
    }
}

/// Architecture name in `models/*.toml`.
pub const ARCHITECTURE: &str = "swinv2-bert";
/// Safetensors metadata keys written by `scripts/convert_report.py`.
pub const META_CONFIG: &str = "hilum.config";
/// Safetensors metadata key holding the tokenizer's JSON.
pub const META_TOKENIZER: &str = "hilum.tokenizer";

/// The parts of a VisionEncoderDecoder `config.json` that matter here.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Config {
    /// The SwinV2 encoder's configuration.
    pub encoder: SwinV2Config,
    /// The BERT decoder's configuration.
    pub decoder: BertDecoderConfig,
    /// Token the decoder starts from.
    #[serde(default)]
    pub decoder_start_token_id: Option<u32>,
    /// Token that ends a report.
    #[serde(default)]
    pub eos_token_id: Option<u32>,
    /// Padding token.
    #[serde(default)]
    pub pad_token_id: Option<u32>,
}

impl Config {
    /// Reads a `config.json` (extra keys are ignored).
    pub fn from_json(v: &Value) -> Result<Self, String> {
        serde_json::from_value(v.clone()).map_err(|e| e.to_string())
    }

    /// The CheXpert-Plus baselines as far as their model cards and file sizes tell:
    /// SwinV2-Tiny (patch 4, window 8, 256 px) and a 2-layer, 768-wide BERT decoder. The
    /// published `config.json`, when installed, takes precedence.
    pub fn chexpert_plus_baseline(vocab_size: usize) -> Self {
        Config {
            encoder: SwinV2Config::tiny_patch4_window8_256(),
            decoder: BertDecoderConfig {
                vocab_size,
                hidden_size: 768,
                num_hidden_layers: 2,
                num_attention_heads: 12,
                intermediate_size: 3072,
                max_position_embeddings: 512,
                type_vocab_size: 2,
                layer_norm_eps: 1e-12,
                hidden_act: "gelu".into(),
            },
            decoder_start_token_id: None,
            eos_token_id: None,
            pad_token_id: None,
        }
    }

    /// `VisionEncoderDecoderModel` adds `enc_to_dec_proj` when the widths differ.
    pub fn has_projection(&self) -> bool {
        self.encoder.hidden_size() != self.decoder.hidden_size
    }
}

/// Parameter names and shapes of the checkpoint, as `save_pretrained` writes them (the LM
/// head's weight is tied to the word embeddings and not stored).
pub fn expected_params(cfg: &Config) -> BTreeMap<String, Vec<usize>> {
    let mut m = BTreeMap::new();
    let mut put = |k: String, s: Vec<usize>| {
        m.insert(k, s);
    };
    let e = &cfg.encoder;
    let p = e.patch_size;
    put(
        "encoder.embeddings.patch_embeddings.projection.weight".into(),
        vec![e.embed_dim, e.num_channels, p, p],
    );
    put(
        "encoder.embeddings.patch_embeddings.projection.bias".into(),
        vec![e.embed_dim],
    );
    for n in ["weight", "bias"] {
        put(format!("encoder.embeddings.norm.{n}"), vec![e.embed_dim]);
        put(format!("encoder.layernorm.{n}"), vec![e.hidden_size()]);
    }
    let mlp_hidden = |d: usize| (d as f64 * e.mlp_ratio) as usize;
    for (si, (&depth, &heads)) in e.depths.iter().zip(&e.num_heads).enumerate() {
        let d = e.embed_dim << si;
        for bi in 0..depth {
            let b = format!("encoder.encoder.layers.{si}.blocks.{bi}");
            let a = format!("{b}.attention.self");
            put(format!("{a}.logit_scale"), vec![heads, 1, 1]);
            put(
                format!("{a}.continuous_position_bias_mlp.0.weight"),
                vec![512, 2],
            );
            put(
                format!("{a}.continuous_position_bias_mlp.0.bias"),
                vec![512],
            );
            put(
                format!("{a}.continuous_position_bias_mlp.2.weight"),
                vec![heads, 512],
            );
            for q in ["query", "key", "value"] {
                put(format!("{a}.{q}.weight"), vec![d, d]);
            }
            if e.qkv_bias {
                put(format!("{a}.query.bias"), vec![d]);
                put(format!("{a}.value.bias"), vec![d]);
            }
            put(format!("{b}.attention.output.dense.weight"), vec![d, d]);
            put(format!("{b}.attention.output.dense.bias"), vec![d]);
            for n in ["layernorm_before", "layernorm_after"] {
                put(format!("{b}.{n}.weight"), vec![d]);
                put(format!("{b}.{n}.bias"), vec![d]);
            }
            put(
                format!("{b}.intermediate.dense.weight"),
                vec![mlp_hidden(d), d],
            );
            put(format!("{b}.intermediate.dense.bias"), vec![mlp_hidden(d)]);
            put(format!("{b}.output.dense.weight"), vec![d, mlp_hidden(d)]);
            put(format!("{b}.output.dense.bias"), vec![d]);
        }
        if si + 1 < e.depths.len() {
            let ds = format!("encoder.encoder.layers.{si}.downsample");
            put(format!("{ds}.reduction.weight"), vec![2 * d, 4 * d]);
            put(format!("{ds}.norm.weight"), vec![2 * d]);
            put(format!("{ds}.norm.bias"), vec![2 * d]);
        }
    }
    let dc = &cfg.decoder;
    let h = dc.hidden_size;
    if cfg.has_projection() {
        put("enc_to_dec_proj.weight".into(), vec![h, e.hidden_size()]);
        put("enc_to_dec_proj.bias".into(), vec![h]);
    }
    let em = "decoder.bert.embeddings";
    put(
        format!("{em}.word_embeddings.weight"),
        vec![dc.vocab_size, h],
    );
    put(
        format!("{em}.position_embeddings.weight"),
        vec![dc.max_position_embeddings, h],
    );
    put(
        format!("{em}.token_type_embeddings.weight"),
        vec![dc.type_vocab_size, h],
    );
    put(format!("{em}.LayerNorm.weight"), vec![h]);
    put(format!("{em}.LayerNorm.bias"), vec![h]);
    for li in 0..dc.num_hidden_layers {
        let l = format!("decoder.bert.encoder.layer.{li}");
        for att in ["attention", "crossattention"] {
            for q in ["query", "key", "value"] {
                put(format!("{l}.{att}.self.{q}.weight"), vec![h, h]);
                put(format!("{l}.{att}.self.{q}.bias"), vec![h]);
            }
            put(format!("{l}.{att}.output.dense.weight"), vec![h, h]);
            put(format!("{l}.{att}.output.dense.bias"), vec![h]);
            put(format!("{l}.{att}.output.LayerNorm.weight"), vec![h]);
            put(format!("{l}.{att}.output.LayerNorm.bias"), vec![h]);
        }
        put(
            format!("{l}.intermediate.dense.weight"),
            vec![dc.intermediate_size, h],
        );
        put(
            format!("{l}.intermediate.dense.bias"),
            vec![dc.intermediate_size],
        );
        put(
            format!("{l}.output.dense.weight"),
            vec![h, dc.intermediate_size],
        );
        put(format!("{l}.output.dense.bias"), vec![h]);
        put(format!("{l}.output.LayerNorm.weight"), vec![h]);
        put(format!("{l}.output.LayerNorm.bias"), vec![h]);
    }
    let cp = "decoder.cls.predictions";
    put(format!("{cp}.bias"), vec![dc.vocab_size]);
    put(format!("{cp}.transform.dense.weight"), vec![h, h]);
    put(format!("{cp}.transform.dense.bias"), vec![h]);
    put(format!("{cp}.transform.LayerNorm.weight"), vec![h]);
    put(format!("{cp}.transform.LayerNorm.bias"), vec![h]);
    m
}

/// The network: SwinV2 encoder, optional projection, BERT decoder.
pub struct ReportNet {
    /// The SwinV2 image encoder.
    pub encoder: SwinV2,
    proj: Option<Linear>,
    /// The BERT text decoder with cross-attention.
    pub decoder: BertDecoder,
    /// The configuration it was built from.
    pub config: Config,
}

impl ReportNet {
    /// `vb` at the checkpoint's root (`encoder.`, `decoder.`, `enc_to_dec_proj.`).
    pub fn new(cfg: &Config, vb: VarBuilder) -> candle_core::Result<Self> {
        let encoder = SwinV2::new(&cfg.encoder, vb.pp("encoder"))?;
        let proj = if cfg.has_projection() {
            Some(linear(
                cfg.encoder.hidden_size(),
                cfg.decoder.hidden_size,
                vb.pp("enc_to_dec_proj"),
            )?)
        } else {
            None
        };
        let decoder = BertDecoder::new(&cfg.decoder, vb.pp("decoder"))?;
        Ok(ReportNet {
            encoder,
            proj,
            decoder,
            config: cfg.clone(),
        })
    }

    /// The encoder's `last_hidden_state` (b, tokens, encoder hidden).
    pub fn encode(&self, pixel_values: &Tensor) -> candle_core::Result<Tensor> {
        self.encoder.forward(pixel_values)
    }

    /// Cross-attention keys and values of encoder states (projected when needed).
    pub fn cross_kv(&self, encoder_states: &Tensor) -> candle_core::Result<CrossKv> {
        match &self.proj {
            Some(p) => self.decoder.cross_kv(&p.forward(encoder_states)?),
            None => self.decoder.cross_kv(encoder_states),
        }
    }

    /// Decoder logits (b, t, vocab) for a whole prefix (teacher forcing).
    pub fn logits(&self, encoder_states: &Tensor, ids: &Tensor) -> candle_core::Result<Tensor> {
        let cross = self.cross_kv(encoder_states)?;
        self.decoder.forward(ids, &mut KvCache::default(), &cross)
    }

    /// Writes a report for pixel values as [`recipe`] makes them, by beam search.
    pub fn generate(
        &self,
        pixel_values: &Tensor,
        cfg: &GenerationConfig,
    ) -> candle_core::Result<Generated> {
        let states = self.encode(pixel_values)?;
        let cross = self.cross_kv(&states)?;
        generate::generate(&self.decoder, &cross, cfg)
    }
}

/// The encoder's input as the checkpoints' ViTImageProcessor makes it: the 8-bit picture as RGB,
/// PIL's bilinear resize to `size` x `size` (rounded to bytes each pass), x / 255, ImageNet
/// mean/std (the manifest's `[preprocessing]`).
pub fn recipe(size: usize) -> Preprocess {
    Preprocess::imagenet(u32::try_from(size).unwrap_or(u32::MAX)).filter(Filter::PilBilinearFixedU8)
}

/// What the tool needs: the network, its tokenizer, token ids and input size.
pub struct ReportModel {
    /// The network.
    pub net: ReportNet,
    /// The Hugging Face tokenizer of the decoder.
    pub tokenizer: tokenizers::Tokenizer,
    /// Token the decoder starts from.
    pub start_token: u32,
    /// Token that ends a report.
    pub eos_token: Option<u32>,
    /// Square input side (ViTImageProcessor `size`), from the manifest's preprocessing.
    pub input_size: usize,
    /// Whether the weights are a custom checkpoint (imported, not the manifest's own).
    pub custom: bool,
}

fn mismatch(what: &Path, details: String) -> ModelError {
    ModelError::WeightsMismatch {
        what: what.display().to_string(),
        architecture: ARCHITECTURE.into(),
        details,
    }
}

/// Safetensors `__metadata__` of a file (empty when there is none).
fn metadata(path: &Path) -> Result<std::collections::HashMap<String, String>, ModelError> {
    let file = std::fs::File::open(path).map_err(|e| ModelError::io(path, e))?;
    // SAFETY: read-only map; installed weights are only ever replaced by rename.
    let mmap = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| ModelError::io(path, e))?;
    let (_, meta) = safetensors::SafeTensors::read_metadata(&mmap).map_err(|e| ModelError::Io {
        path: path.display().to_string(),
        reason: format!("not a safetensors file: {e}"),
    })?;
    Ok(meta.metadata().clone().unwrap_or_default())
}

/// The configuration of installed weights: `config.json` from the file's metadata, else beside
/// it, else `fallback` (the manifest's); checked one to one against the checkpoint's names and
/// shapes (a vocabulary size of 0 is taken from the checkpoint).
fn resolve_config(
    weights_path: &Path,
    meta: &std::collections::HashMap<String, String>,
    fallback: Option<&Value>,
) -> Result<Config, ModelError> {
    let dir = weights_path.parent().unwrap_or(Path::new("."));
    let config_text = meta
        .get(META_CONFIG)
        .cloned()
        .or_else(|| std::fs::read_to_string(dir.join("config.json")).ok());
    let config_json: Value = match (&config_text, fallback) {
        (Some(t), _) => serde_json::from_str(t)
            .map_err(|e| mismatch(weights_path, format!("config.json: {e}")))?,
        (None, Some(v)) => v.clone(),
        (None, None) => {
            return Err(mismatch(
                weights_path,
                "no config.json in the weights' metadata or beside them".into(),
            ))
        }
    };
    let mut cfg = Config::from_json(&config_json)
        .map_err(|e| mismatch(weights_path, format!("config: {e}")))?;
    let shapes = weights::shapes(weights_path)?;
    if cfg.decoder.vocab_size == 0 {
        cfg.decoder.vocab_size = shapes
            .get("decoder.bert.embeddings.word_embeddings.weight")
            .and_then(|s| s.first().copied())
            .unwrap_or(0);
    }
    cfg.encoder
        .validate()
        .map_err(|e| mismatch(weights_path, e))?;
    cfg.decoder
        .validate()
        .map_err(|e| mismatch(weights_path, e))?;
    let mut expected = expected_params(&cfg);
    let tied = "decoder.cls.predictions.decoder.weight";
    if let Some(s) = shapes.get(tied) {
        expected.insert(tied.into(), s.clone());
    }
    weights::compare(&expected, &shapes).map_err(|d| mismatch(weights_path, d))?;
    Ok(cfg)
}

fn manifest_config(manifest: &Manifest) -> Result<Option<Value>, ModelError> {
    if manifest.config.is_empty() {
        return Ok(None);
    }
    serde_json::to_value(&manifest.config)
        .map(Some)
        .map_err(|e| ModelError::Manifest {
            id: manifest.id.clone(),
            reason: e.to_string(),
        })
}

/// The parameters the weights at `path` must have (registry check at import): the layout of
/// the `config.json` that travels with them, else of the manifest.
pub fn expected_params_for(
    manifest: &Manifest,
    path: &Path,
) -> Result<BTreeMap<String, Vec<usize>>, ModelError> {
    let fallback = manifest_config(manifest)?;
    let cfg = resolve_config(path, &metadata(path)?, fallback.as_ref())?;
    let mut expected = expected_params(&cfg);
    let tied = "decoder.cls.predictions.decoder.weight";
    if let Some(s) = weights::shapes(path)?.get(tied) {
        expected.insert(tied.into(), s.clone());
    }
    Ok(expected)
}

/// The report generator (SwinV2 + BERT decoder) in the table of architectures: candle only,
/// its layout given by the `config.json` that travels with the weights.
pub struct ReportArch;

impl crate::Architecture for ReportArch {
    fn name(&self) -> &'static str {
        "swinv2-bert"
    }

    fn expected_params(
        &self,
        m: &Manifest,
        weights: Option<&Path>,
    ) -> Result<Option<crate::architecture::Params>, ModelError> {
        weights.map(|w| expected_params_for(m, w)).transpose()
    }

    fn device_checks(&self) -> Vec<crate::architecture::DeviceCheck> {
        vec![crate::architecture::DeviceCheck {
            name: "report",
            run: crate::devcheck::report_model,
        }]
    }
}

impl ReportModel {
    /// Loads `weights`, taking `config.json` and `tokenizer.json` from the file's metadata,
    /// else from beside it, else (config only) from `fallback`.
    pub fn load_files(
        weights_path: &Path,
        fallback: Option<&Value>,
        input_size: usize,
        device: Device,
    ) -> Result<Self, ModelError> {
        let meta = metadata(weights_path)?;
        let dir = weights_path.parent().unwrap_or(Path::new("."));
        let read = |name: &str| std::fs::read_to_string(dir.join(name)).ok();
        let cfg = resolve_config(weights_path, &meta, fallback)?;

        let tokenizer = match meta
            .get(META_TOKENIZER)
            .cloned()
            .or_else(|| read("tokenizer.json"))
        {
            Some(text) => tokenizers::Tokenizer::from_bytes(text.as_bytes())
                .map_err(|e| mismatch(weights_path, format!("tokenizer.json: {e}")))?,
            None if dir.join("vocab.txt").is_file() => {
                // The published repositories ship BertTokenizer's vocab.txt.
                let lower = read("tokenizer_config.json")
                    .and_then(|t| serde_json::from_str::<Value>(&t).ok())
                    .and_then(|v| v["do_lower_case"].as_bool())
                    .unwrap_or(true);
                bert_tokenizer(&dir.join("vocab.txt"), lower)
                    .map_err(|e| mismatch(weights_path, format!("vocab.txt: {e}")))?
            }
            None => {
                return Err(ModelError::Corrupt {
                    id: dir
                        .file_name()
                        .map(|n| n.to_string_lossy().into_owned())
                        .unwrap_or_default(),
                    reason: format!(
                        "{} has no tokenizer: convert the Hugging Face snapshot with \
                         `scripts/convert_report.py SNAPSHOT_DIR model.safetensors` (embeds \
                         config and tokenizer) and import that file, or copy the repository's \
                         config.json and vocab.txt (or tokenizer.json) beside the weights",
                        weights_path.display()
                    ),
                })
            }
        };
        let special = |t: &str| tokenizer.token_to_id(t);
        let start_token = cfg
            .decoder_start_token_id
            .or_else(|| special("[CLS]"))
            .ok_or_else(|| {
                mismatch(
                    weights_path,
                    "no decoder_start_token_id and no [CLS] token".into(),
                )
            })?;
        let eos_token = cfg.eos_token_id.or_else(|| special("[SEP]"));

        let vb = weights::var_builder(weights_path, device)?;
        let net = ReportNet::new(&cfg, vb)?;
        Ok(ReportModel {
            net,
            tokenizer,
            start_token,
            eos_token,
            input_size,
            custom: false,
        })
    }

    /// The longest sequence the decoder's position table allows.
    pub fn max_length_limit(&self) -> usize {
        self.net.config.decoder.max_position_embeddings
    }

    /// Decoding settings for this model; `max_length` is capped at [`Self::max_length_limit`]
    /// so generation ends there instead of failing past the position table.
    pub fn generation(&self, num_beams: usize, max_length: usize) -> GenerationConfig {
        GenerationConfig {
            num_beams,
            max_length: max_length.min(self.max_length_limit()),
            length_penalty: 1.0,
            early_stopping: false,
            decoder_start_token_id: self.start_token,
            eos_token_id: self.eos_token,
        }
    }

    /// Report text of `ids`, special tokens removed (as `batch_decode(skip_special_tokens=True)`).
    pub fn decode(&self, ids: &[u32]) -> Result<String, ModelError> {
        self.tokenizer
            .decode(ids, true)
            .map_err(|e| ModelError::Compute(format!("detokenising: {e}")))
    }

    /// The encoder's input, as the image store computes it ([`recipe`]).
    pub fn recipe(&self) -> Preprocess {
        recipe(self.input_size)
    }

    /// Generates from an image prepared by [`ReportModel::recipe`].
    pub fn generate_from(
        &self,
        input: &Prepared,
        cfg: &GenerationConfig,
    ) -> Result<Generated, ModelError> {
        crate::runner::check_input(&self.recipe(), input)?;
        let (s, pixels) = (self.input_size, &input.data);
        let dev = self
            .net
            .decoder
            .device()
            .map_err(|e| ModelError::Compute(e.to_string()))?;
        let x = Tensor::from_slice(pixels, (1, 3, s, s), &dev)?;
        Ok(self.net.generate(&x, cfg)?)
    }
}

/// A BERT WordPiece tokenizer from `vocab.txt`, as transformers' `BertTokenizer` builds it
/// (BERT normaliser and pre-tokeniser, `##` continuation, special tokens skipped on decode).
pub fn bert_tokenizer(vocab: &Path, lowercase: bool) -> Result<tokenizers::Tokenizer, String> {
    use tokenizers::decoders::wordpiece::WordPiece as WordPieceDecoder;
    use tokenizers::models::wordpiece::WordPiece;
    use tokenizers::normalizers::bert::BertNormalizer;
    use tokenizers::pre_tokenizers::bert::BertPreTokenizer;
    let path = vocab.to_str().ok_or("vocabulary path is not UTF-8")?;
    let model = WordPiece::from_file(path)
        .unk_token("[UNK]".into())
        .build()
        .map_err(|e| e.to_string())?;
    let mut tok = tokenizers::Tokenizer::new(model);
    tok.with_normalizer(Some(BertNormalizer::new(true, true, None, lowercase)))
        .map_err(|e| e.to_string())?;
    tok.with_pre_tokenizer(Some(BertPreTokenizer));
    tok.with_decoder(Some(WordPieceDecoder::default()));
    let specials: Vec<tokenizers::AddedToken> = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
        .into_iter()
        .filter(|t| tok.token_to_id(t).is_some())
        .map(|t| tokenizers::AddedToken::from(t, true))
        .collect();
    tok.add_special_tokens(specials)
        .map_err(|e| e.to_string())?;
    Ok(tok)
}

impl crate::Model for ReportModel {
    fn load(
        manifest: &Manifest,
        installed: &InstalledModel,
        device: Device,
        backend: crate::Backend,
        _: &crate::ModelSettings,
    ) -> Result<Self, ModelError> {
        backend.expect(&[crate::Backend::Candle], &manifest.id)?;
        let fallback = if manifest.config.is_empty() {
            None
        } else {
            Some(
                serde_json::to_value(&manifest.config).map_err(|e| ModelError::Manifest {
                    id: manifest.id.clone(),
                    reason: e.to_string(),
                })?,
            )
        };
        let size = manifest
            .preprocessing
            .get("size")
            .and_then(|v| v.as_integer())
            .unwrap_or(224)
            .clamp(16, 4096) as usize;
        let mut m = Self::load_files(&installed.weights, fallback.as_ref(), size, device)?;
        m.custom = installed.record.custom;
        Ok(m)
    }
}
