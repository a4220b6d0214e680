//! The small layers every part of SAM shares: a last-dimension linear layer, PyTorch's
//! two-pass LayerNorm, the encoder's MLP and the mask decoder's head MLP.

use super::*;

/// A linear layer applied to the last dimension of any tensor as one matrix product.
#[derive(Clone, Debug)]
pub(super) struct Lin {
    pub(super) weight: Tensor,
    pub(super) bias: Option<Tensor>,
}

impl Lin {
    pub(super) fn load(
        vb: VarBuilder,
        cin: usize,
        cout: usize,
        bias: bool,
    ) -> candle_core::Result<Self> {
        let weight = vb.get((cout, cin), "weight")?;
        let bias = if bias {
            Some(vb.get(cout, "bias")?)
        } else {
            None
        };
        Ok(Lin { weight, bias })
    }
}

impl Module for Lin {
    fn forward(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        let mut dims = xs.dims().to_vec();
        let k = dims.pop().unwrap_or(1);
        let n = xs.elem_count() / k.max(1);
        let y = xs.reshape((n, k))?.matmul(&self.weight.t()?)?;
        let y = match &self.bias {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        };
        dims.push(self.weight.dim(0)?);
        y.reshape(dims)
    }
}

/// `nn.LayerNorm` over the last dimension, computed in two passes like PyTorch (mean, then
/// the mean of squared deviations). candle's fused layer norm takes `E[x²] - E[x]²` in one
/// pass, which loses precision when the mean is large against the spread (it was off by
/// 4e-4 on the two-channel LayerNorm2d of the mask downscaling).
#[derive(Clone, Debug)]
pub(super) struct LayerNorm {
    pub(super) weight: Tensor,
    pub(super) bias: Tensor,
    pub(super) eps: f64,
}

impl Module for LayerNorm {
    fn forward(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        let d = xs.broadcast_sub(&xs.mean_keepdim(D::Minus1)?)?;
        let var = d.sqr()?.mean_keepdim(D::Minus1)?;
        d.broadcast_div(&(var + self.eps)?.sqrt()?)?
            .broadcast_mul(&self.weight)?
            .broadcast_add(&self.bias)
    }
}

pub(super) fn layer_norm(vb: VarBuilder, dim: usize, eps: f64) -> candle_core::Result<LayerNorm> {
    Ok(LayerNorm {
        weight: vb.get(dim, "weight")?,
        bias: vb.get(dim, "bias")?,
        eps,
    })
}

/// SAM's `LayerNorm2d` (over channels of NCHW), eps 1e-6: the same numbers as a LayerNorm
/// over the last dimension of the NHWC tensor, which is how it is computed here.
pub(super) fn layer_norm_nchw(ln: &LayerNorm, xs: &Tensor) -> candle_core::Result<Tensor> {
    xs.permute((0, 2, 3, 1))?
        .contiguous()?
        .apply(ln)?
        .permute((0, 3, 1, 2))
}

/// SAM's `MLPBlock` (`lin1`, activation, `lin2`); GELU is the exact (erf) one.
#[derive(Clone, Debug)]
pub(super) struct Mlp {
    pub(super) lin1: Lin,
    pub(super) lin2: Lin,
    pub(super) gelu: bool,
}

impl Mlp {
    pub(super) fn load(
        vb: VarBuilder,
        dim: usize,
        hidden: usize,
        gelu: bool,
    ) -> candle_core::Result<Self> {
        Ok(Mlp {
            lin1: Lin::load(vb.pp("lin1"), dim, hidden, true)?,
            lin2: Lin::load(vb.pp("lin2"), hidden, dim, true)?,
            gelu,
        })
    }
}

impl Module for Mlp {
    fn forward(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        let h = xs.apply(&self.lin1)?;
        let h = if self.gelu { h.gelu_erf()? } else { h.relu()? };
        h.apply(&self.lin2)
    }
}

/// The mask decoder's `MLP`: `layers.{i}` with ReLU between them.
#[derive(Clone, Debug)]
pub(super) struct HeadMlp {
    pub(super) layers: Vec<Lin>,
}

impl HeadMlp {
    pub(super) fn load(
        vb: VarBuilder,
        cin: usize,
        hidden: usize,
        cout: usize,
        depth: usize,
    ) -> candle_core::Result<Self> {
        let vb = vb.pp("layers");
        let layers = (0..depth)
            .map(|i| {
                let a = if i == 0 { cin } else { hidden };
                let b = if i + 1 == depth { cout } else { hidden };
                Lin::load(vb.pp(i), a, b, true)
            })
            .collect::<candle_core::Result<_>>()?;
        Ok(HeadMlp { layers })
    }
}

impl Module for HeadMlp {
    fn forward(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        let mut x = xs.clone();
        for (i, l) in self.layers.iter().enumerate() {
            x = x.apply(l)?;
            if i + 1 < self.layers.len() {
                x = x.relu()?;
            }
        }
        Ok(x)
    }
}
