//! Batch norms folded at load for the candle CNNs (DenseNet, ResNet, PSPNet, the lung U-Net):
//! a BN after a convolution goes into its weight and bias, a BN before an activation becomes
//! one per-channel scale and shift; and the dtypes their folded forward may run in.

use candle_core::{DType, Result, Tensor};
use candle_nn::{BatchNorm, Conv2d};

/// A batch norm in inference mode as one per-channel `x * scale + shift` (shapes
/// (1, c, 1, 1)), computed once at load.
#[derive(Clone, Debug)]
pub(crate) struct ChannelAffine {
    scale: Tensor,
    shift: Tensor,
}

impl ChannelAffine {
    /// From per-channel `scale` and `shift` of shape (c,).
    pub(crate) fn new(scale: &Tensor, shift: &Tensor) -> Result<Self> {
        let c = scale.dim(0)?;
        Ok(ChannelAffine {
            scale: scale.reshape((1, c, 1, 1))?,
            shift: shift.reshape((1, c, 1, 1))?,
        })
    }

    /// `bn` in inference mode.
    pub(crate) fn from_batch_norm(bn: &BatchNorm) -> Result<Self> {
        let (scale, shift) = bn_scale_shift(bn)?;
        Self::new(&scale, &shift)
    }

    pub(crate) fn to_dtype(&self, dtype: DType) -> Result<Self> {
        Ok(ChannelAffine {
            scale: self.scale.to_dtype(dtype)?,
            shift: self.shift.to_dtype(dtype)?,
        })
    }

    /// `x * scale + shift`.
    pub(crate) fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        xs.broadcast_mul(&self.scale)?.broadcast_add(&self.shift)
    }

    /// `relu(x * scale + shift)`: three ops where candle_nn's BatchNorm and a ReLU run seven.
    pub(crate) fn forward_relu(&self, xs: &Tensor) -> Result<Tensor> {
        self.forward(xs)?.relu()
    }
}

/// `bn`'s per-channel (scale, shift) = (g / sqrt(v + eps), beta - m * scale), shapes (c,),
/// computed in f64 and returned detached in the statistics' dtype.
pub(crate) fn bn_scale_shift(bn: &BatchNorm) -> Result<(Tensor, Tensor)> {
    let dtype = bn.running_var().dtype();
    let var = bn.running_var().to_dtype(DType::F64)?;
    let mean = bn.running_mean().to_dtype(DType::F64)?;
    let inv_std = (var + bn.eps())?.sqrt()?.recip()?;
    let (scale, shift) = match bn.weight_and_bias() {
        Some((w, b)) => {
            let scale = w.to_dtype(DType::F64)?.mul(&inv_std)?;
            let shift = b.to_dtype(DType::F64)?.sub(&mean.mul(&scale)?)?;
            (scale, shift)
        }
        None => {
            let shift = mean.mul(&inv_std)?.neg()?;
            (inv_std, shift)
        }
    };
    Ok((
        scale.to_dtype(dtype)?.detach(),
        shift.to_dtype(dtype)?.detach(),
    ))
}

/// `conv` followed by `bn` as one convolution: w' = w * s per output channel and
/// b' = (b - m) * s + beta, with s = g / sqrt(v + eps). The scale is rounded to the weights'
/// dtype before the product, so each folded weight is one correctly rounded multiplication.
pub(crate) fn fold_conv_bn(conv: &Conv2d, bn: &BatchNorm) -> Result<Conv2d> {
    let (scale, shift) = bn_scale_shift(bn)?;
    let c_out = scale.dim(0)?;
    let w = conv.weight();
    let scale_w = scale.to_dtype(w.dtype())?;
    let weight = w
        .broadcast_mul(&scale_w.reshape((c_out, 1, 1, 1))?)?
        .contiguous()?
        .detach();
    let bias = match conv.bias() {
        Some(b) => {
            let s = scale.to_dtype(DType::F64)?;
            let b = b.to_dtype(DType::F64)?.mul(&s)?;
            (b + shift.to_dtype(DType::F64)?)?.to_dtype(shift.dtype())?
        }
        None => shift,
    };
    Ok(Conv2d::new(weight, Some(bias.detach()), *conv.config()))
}

/// `conv` with its weight and bias in `dtype`.
pub(crate) fn conv_to_dtype(conv: &Conv2d, dtype: DType) -> Result<Conv2d> {
    let bias = conv.bias().map(|b| b.to_dtype(dtype)).transpose()?;
    Ok(Conv2d::new(
        conv.weight().to_dtype(dtype)?,
        bias,
        *conv.config(),
    ))
}

/// The dtypes the candle CNNs' folded forward runs in: f32, or f16 (opt-in, for GPUs). bf16
/// is not offered: candle's CPU backend has no bf16 matmul, so its convolutions and the
/// tolerance of a bf16 path cannot be run and tested off a GPU.
pub fn check_compute_dtype(dtype: DType) -> Result<()> {
    match dtype {
        DType::F32 | DType::F16 => Ok(()),
        other => candle_core::bail!(
            "the candle CNNs run in f32 or f16, not {other:?} (bf16 has no convolution on \
             candle's CPU backend to test it against)"
        ),
    }
}
