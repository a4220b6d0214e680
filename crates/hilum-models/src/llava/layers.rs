//! What the CLIP tower and the projector share: dense linear layers, activations and softmax
//! attention; and how the text decoder's matrices are stored ([`Precision`]).

use candle_core::quantized::GgmlDType;
use candle_core::{Module, Tensor};
use candle_nn::VarBuilder;

use super::config::bad_config;
use crate::ModelError;

// ---------------------------------------------------------------------------------------------
// Layers
// ---------------------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Act {
    QuickGelu,
    /// Exact (erf) GELU: transformers' "gelu".
    Gelu,
    /// tanh approximation: "gelu_new", "gelu_pytorch_tanh".
    GeluTanh,
}

pub(crate) fn activation(name: &str) -> Result<Act, ModelError> {
    match name {
        "quick_gelu" => Ok(Act::QuickGelu),
        "gelu" => Ok(Act::Gelu),
        "gelu_new" | "gelu_pytorch_tanh" | "gelu_fast" => Ok(Act::GeluTanh),
        other => Err(bad_config(format!("activation `{other}` is not supported"))),
    }
}

impl Act {
    pub(crate) fn apply(self, xs: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            Act::QuickGelu => xs * candle_nn::ops::sigmoid(&(xs * 1.702)?)?,
            Act::Gelu => xs.gelu_erf(),
            Act::GeluTanh => xs.gelu(),
        }
    }
}

/// How the text decoder's linear layers are stored.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Precision {
    /// As loaded (f32 on CPU).
    #[default]
    Dense,
    /// 8-bit blocks (GGML Q8_0) for the text decoder's linear layers, quantized at load.
    Q8_0,
    /// 4-bit k-quants (GGML Q4_K), quantized at load; needs dimensions divisible by 256.
    Q4K,
}

impl Precision {
    pub fn parse(s: &str) -> Result<Precision, ModelError> {
        match s.trim().to_ascii_lowercase().as_str() {
            "" | "f32" | "dense" | "none" => Ok(Precision::Dense),
            "q8_0" | "q8" => Ok(Precision::Q8_0),
            "q4k" | "q4_k" => Ok(Precision::Q4K),
            other => Err(ModelError::Manifest {
                id: "llava".into(),
                reason: format!("quantize = `{other}`: use none, q8_0 or q4k"),
            }),
        }
    }

    pub(crate) fn ggml(self) -> Option<GgmlDType> {
        match self {
            Precision::Dense => None,
            Precision::Q8_0 => Some(GgmlDType::Q8_0),
            Precision::Q4K => Some(GgmlDType::Q4K),
        }
    }
}

/// A dense linear layer (`x @ W^T + b`).
#[derive(Debug)]
pub(crate) struct Lin {
    pub(crate) w: Tensor,
    pub(crate) b: Option<Tensor>,
}

impl Lin {
    pub(crate) fn load(
        vb: VarBuilder,
        inp: usize,
        out: usize,
        bias: bool,
    ) -> candle_core::Result<Lin> {
        let w = vb.get((out, inp), "weight")?;
        let b = if bias {
            Some(vb.get(out, "bias")?)
        } else {
            None
        };
        Ok(Lin { w, b })
    }
}

impl Module for Lin {
    fn forward(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        // A broadcast matmul against W^T, as candle_nn::Linear does.
        let wt = match xs.dims() {
            [b, _, _] => self.w.broadcast_left(*b)?.t()?,
            _ => self.w.t()?,
        };
        let y = xs.matmul(&wt)?;
        match &self.b {
            Some(b) => y.broadcast_add(b),
            None => Ok(y),
        }
    }
}

/// Softmax attention of (b, h, tq, d) queries over (b, h, tk, d) keys/values.
pub(crate) fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    mask: Option<&Tensor>,
) -> candle_core::Result<Tensor> {
    let mut w = (q.matmul(&k.t()?)? * scale)?;
    if let Some(m) = mask {
        w = w.broadcast_add(m)?;
    }
    candle_nn::ops::softmax_last_dim(&w)?.matmul(v)
}
