//! Readers of checkpoint weights into `hilum-kernels`' plain weight structs, so the CPU engines
//! are built from the weights themselves and never from the candle modules. Each model file has
//! its own reader (`densenet::native_weights`, ...) that walks the same `vb.pp(..)` tree as its
//! candle model and builds its layers with these; BatchNorms are handed over as parameters and
//! folded by the engine. This module knows no model, so the model files depend on it and never
//! the other way round.

use candle_core::{DType, Result};
use candle_nn::VarBuilder;
use hilum_kernels::{BatchNorm, Conv, Linear};

pub(crate) fn floats(vb: &VarBuilder, shape: &[usize], name: &str) -> Result<Vec<f32>> {
    vb.get(shape, name)?
        .to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1::<f32>()
}

/// A PyTorch conv (`weight` (c_out, c_in, k, k), optional `bias`).
pub(crate) fn conv(
    vb: &VarBuilder,
    c_in: usize,
    c_out: usize,
    k: usize,
    bias: bool,
) -> Result<Conv> {
    Ok(Conv {
        c_out,
        c_in,
        k,
        weight: floats(vb, &[c_out, c_in, k, k], "weight")?,
        bias: if bias {
            Some(floats(vb, &[c_out], "bias")?)
        } else {
            None
        },
    })
}

/// A PyTorch BatchNorm2d (`weight`, `bias`, `running_mean`, `running_var`).
pub(crate) fn batch_norm(vb: &VarBuilder, c: usize, eps: f64) -> Result<BatchNorm> {
    Ok(BatchNorm {
        gamma: floats(vb, &[c], "weight")?,
        beta: floats(vb, &[c], "bias")?,
        mean: floats(vb, &[c], "running_mean")?,
        var: floats(vb, &[c], "running_var")?,
        eps: eps as f32,
    })
}

pub(crate) fn linear(vb: &VarBuilder, in_features: usize, out_features: usize) -> Result<Linear> {
    Ok(Linear {
        in_features,
        out_features,
        weight: floats(vb, &[out_features, in_features], "weight")?,
        bias: Some(floats(vb, &[out_features], "bias")?),
    })
}

/// A Keras conv `{name}.kernel` (HWIO) + `{name}.bias`, as a PyTorch-layout [`Conv`].
pub(crate) fn keras_conv(
    vb: &VarBuilder,
    name: &str,
    k: usize,
    c_in: usize,
    c_out: usize,
) -> Result<Conv> {
    let v = vb.pp(name);
    let weight = v
        .get((k, k, c_in, c_out), "kernel")?
        .to_dtype(DType::F32)?
        .permute((3, 2, 0, 1))? // (o, i, kh, kw)
        .flatten_all()?
        .to_vec1::<f32>()?;
    Ok(Conv {
        c_out,
        c_in,
        k,
        weight,
        bias: Some(floats(&v, &[c_out], "bias")?),
    })
}

/// A Keras BatchNormalization (`gamma`, `beta`, `moving_mean`, `moving_variance`).
pub(crate) fn keras_bn(vb: &VarBuilder, name: &str, c: usize, eps: f64) -> Result<BatchNorm> {
    let v = vb.pp(name);
    Ok(BatchNorm {
        gamma: floats(&v, &[c], "gamma")?,
        beta: floats(&v, &[c], "beta")?,
        mean: floats(&v, &[c], "moving_mean")?,
        var: floats(&v, &[c], "moving_variance")?,
        eps: eps as f32,
    })
}
