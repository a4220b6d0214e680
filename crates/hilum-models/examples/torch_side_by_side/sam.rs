//! SAM's image encoder (`hilum_models::sam`, candle on every device): ViT-B at 1024 px, or a
//! tiny configuration with the same structure (windowed blocks with padding, a global block,
//! relative positions, the neck) for the dry run.

use std::collections::HashMap;

use candle_core::Tensor;
use hilum_models::sam::{self, Config, Sam};
use hilum_models::Device;

use crate::{Forward, Res};

pub fn config(arch: &str) -> Res<Config> {
    match arch {
        "sam-vit-b" => Ok(Config::vit_b()),
        // 64 px, 4 x 4 tokens: windows of 3 pad the grid to 6, block 1 attends globally.
        "sam-tiny" => Ok(Config {
            image_size: 64,
            patch_size: 16,
            encoder_embed_dim: 32,
            encoder_depth: 2,
            encoder_num_heads: 2,
            window_size: 3,
            global_attn_indexes: vec![1],
            prompt_embed_dim: 32,
            mask_in_chans: 4,
            decoder_depth: 1,
            decoder_num_heads: 2,
            decoder_mlp_dim: 64,
            num_multimask_outputs: 3,
            iou_head_depth: 2,
            iou_head_hidden_dim: 32,
        }),
        other => Err(format!("unknown SAM configuration `{other}`: sam-vit-b or sam-tiny").into()),
    }
}

/// Every parameter of the checkpoint seeded as `sam::random` seeds them (uniform with amplitude
/// 1 / sqrt(fan-in)); prints the config.
pub fn weights(arch: &str, out: &std::path::Path) -> Res<String> {
    let cfg = config(arch)?;
    let mut state = 19u64;
    let mut ts = HashMap::new();
    for (name, shape) in sam::expected_params(&cfg)? {
        let n: usize = shape.iter().product();
        let fan_in = shape.iter().skip(1).product::<usize>().max(1) as f32;
        let v = crate::uniform(&mut state, n, 1.0 / fan_in.sqrt());
        ts.insert(name, Tensor::from_vec(v, shape, &candle_core::Device::Cpu)?);
    }
    candle_core::safetensors::save(&ts, out)?;
    Ok(serde_json::to_string(&cfg)?)
}

pub struct Encoder(Sam);

pub fn load(arch: &str, size: usize, weights: &std::path::Path, device: Device) -> Res<Encoder> {
    let cfg = config(arch)?;
    if size != cfg.image_size {
        return Err(format!("{arch} takes {} px, not {size}", cfg.image_size).into());
    }
    Ok(Encoder(sam::load_file(weights, &cfg, device)?))
}

impl Forward for Encoder {
    /// One image (1, 3, S, S) as the MedSAM tool prepares it; the embedding back on the host.
    fn forward(&self, x: &[f32], batch: usize) -> Res<(Vec<f32>, Vec<usize>)> {
        if batch != 1 {
            return Err("the SAM image encoder runs one image at a time".into());
        }
        let e = self.0.embed_prepared(x)?;
        let shape = e.dims().to_vec();
        Ok((e.flatten_all()?.to_vec1()?, shape))
    }
}
