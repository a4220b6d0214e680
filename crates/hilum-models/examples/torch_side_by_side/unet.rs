//! The lung U-Net (`hilum_models::unet`): native kernels on the CPU, candle on a GPU. Its
//! parameters keep the Keras names and shapes (kernels HWIO); the PyTorch side maps them.

use std::collections::HashMap;

use candle_core::Tensor;
use hilum_models::unet::{self, Config, LungSegmenter};
use hilum_models::{Backend, Device};

use crate::{Forward, Res};

/// Seeded weights as the native-vs-candle test of `unet.rs` makes them: kernels uniform with
/// amplitude 1.5 * sqrt(3 / fan-in), moving variances in [0.5, 1), other vectors in [-1.5, 1.5),
/// so the probabilities spread over (0, 1) instead of sitting at 0.5. Prints the config.
pub fn weights(out: &std::path::Path) -> Res<String> {
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut ts = HashMap::new();
    for (name, shape) in unet::expected_params() {
        let n: usize = shape.iter().product();
        let (amp, var) = match shape.as_slice() {
            [k, k2, c_in, _] => (1.5 / ((k * k2 * c_in) as f32).sqrt(), false),
            _ => (1.5, name.ends_with("moving_variance")),
        };
        let mut v = crate::uniform(&mut state, n, amp);
        if var {
            v.iter_mut().for_each(|x| *x = 0.5 + x.abs() / 3.0);
        }
        ts.insert(name, Tensor::from_vec(v, shape, &candle_core::Device::Cpu)?);
    }
    candle_core::safetensors::save(&ts, out)?;
    Ok(serde_json::to_string(&Config::lung_seg_valiou_088())?)
}

pub struct Unet {
    net: LungSegmenter,
    size: usize,
}

pub fn load(size: usize, weights: &std::path::Path, device: Device, backend: Backend) -> Res<Unet> {
    let cfg = Config {
        input_size: size,
        ..Config::lung_seg_valiou_088()
    };
    let vb = hilum_models::weights::var_builder(weights, device)?;
    let threads = hilum_models::kernels::all_cores();
    Ok(Unet {
        net: LungSegmenter::new(vb, &cfg, backend, threads)?,
        size,
    })
}

impl Forward for Unet {
    /// `x`: `batch` NHWC images; the batch is split per image as `predict` takes it.
    fn forward(&self, x: &[f32], batch: usize) -> Res<(Vec<f32>, Vec<usize>)> {
        let s = self.size;
        let images: Vec<Vec<f32>> = x.chunks(s * s * 3).map(<[f32]>::to_vec).collect();
        let out = self.net.predict(&images)?.concat();
        Ok((out, vec![batch, s, s, 1]))
    }
}
