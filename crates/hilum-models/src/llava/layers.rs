//! What the CLIP tower and the projector share: dense linear layers, activations and softmax
//! attention.

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
