//! Safetensors weights: names and shapes (to check a checkpoint against an architecture before
//! trusting it) and memory-mapped loading.

use std::collections::BTreeMap;
use std::path::Path;

use candle_nn::VarBuilder;

use crate::{Device, ModelError};

/// Parameter name → shape that `load` asks for, recorded by building the model once on fresh
/// variables (for the name/shape check of a checkpoint against an architecture).
pub(crate) fn recorded_params<T, E: std::fmt::Display>(
    load: impl FnOnce(VarBuilder) -> Result<T, E>,
) -> Result<BTreeMap<String, Vec<usize>>, ModelError> {
    let map = candle_nn::VarMap::new();
    let vb = VarBuilder::from_varmap(&map, candle_core::DType::F32, &candle_core::Device::Cpu);
    load(vb).map_err(|e| ModelError::Compute(e.to_string()))?;
    let data = map
        .data()
        .lock()
        .map_err(|e| ModelError::Compute(e.to_string()))?;
    Ok(data
        .iter()
        .map(|(k, v)| (k.clone(), v.as_tensor().dims().to_vec()))
        .collect())
}

/// One xorshift64* draw, uniform in [0, 1): seeded weights for benchmarks and parity tests,
/// reproducible without an RNG dependency. `state` must not be zero.
pub(crate) fn xorshift_unit(state: &mut u64) -> f32 {
    *state ^= *state >> 12;
    *state ^= *state << 25;
    *state ^= *state >> 27;
    (state.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 40) as f32 / (1u64 << 24) as f32
}

/// Seeded weights for a name → shape list with activations of order one: He-uniform matrices
/// and convolutions, BatchNorm near identity, norm scales near one, small biases. For
/// benchmarks and device parity checks only: tools never run on made-up weights.
pub fn seeded(
    params: &BTreeMap<String, Vec<usize>>,
    seed: u64,
) -> std::collections::HashMap<String, candle_core::Tensor> {
    let mut state = seed.max(1);
    let mut out = std::collections::HashMap::new();
    for (name, shape) in params {
        let n: usize = shape.iter().product();
        let fan_in: usize = shape.iter().skip(1).product::<usize>().max(1);
        let v: Vec<f32> = (0..n)
            .map(|_| {
                // Uniform in [-0.5, 0.5).
                let u = xorshift_unit(&mut state) - 0.5;
                if name.ends_with("running_var") || name.ends_with("moving_variance") {
                    1.0 + u
                } else if name.ends_with("running_mean")
                    || name.ends_with("moving_mean")
                    || name.ends_with("bias")
                {
                    0.2 * u
                } else if shape.len() == 1 {
                    1.0 + 0.4 * u
                } else {
                    // Uniform with variance 2 / fan_in.
                    u * (24.0 / fan_in as f32).sqrt()
                }
            })
            .collect();
        if let Ok(t) = candle_core::Tensor::from_vec(v, shape.as_slice(), &candle_core::Device::Cpu)
        {
            out.insert(name.clone(), t);
        }
    }
    out
}

/// Parameter name → shape, as stored in a safetensors file (reads only the header).
pub fn shapes(path: &Path) -> Result<BTreeMap<String, Vec<usize>>, ModelError> {
    let file = std::fs::File::open(path).map_err(|e| ModelError::io(path, e))?;
    // SAFETY: read-only map of a file we do not modify; a concurrent writer would be a bug in
    // the installer, which replaces files by rename.
    let mmap = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| ModelError::io(path, e))?;
    let (_, meta) = safetensors::SafeTensors::read_metadata(&mmap).map_err(|e| ModelError::Io {
        path: path.display().to_string(),
        reason: format!("not a safetensors file: {e}"),
    })?;
    Ok(meta
        .tensors()
        .into_iter()
        .map(|(name, info)| (name, info.shape.clone()))
        .collect())
}

/// Compares a checkpoint's names and shapes with what an architecture expects, one to one.
/// Returns a readable list of the differences (missing, unexpected, wrong shape).
pub fn compare(
    expected: &BTreeMap<String, Vec<usize>>,
    actual: &BTreeMap<String, Vec<usize>>,
) -> Result<(), String> {
    let mut problems = Vec::new();
    for (name, shape) in expected {
        match actual.get(name) {
            None => problems.push(format!("missing `{name}` {shape:?}")),
            Some(s) if s != shape => {
                problems.push(format!("`{name}` has shape {s:?}, expected {shape:?}"))
            }
            Some(_) => {}
        }
    }
    for (name, shape) in actual {
        if !expected.contains_key(name) {
            problems.push(format!("unexpected `{name}` {shape:?}"));
        }
    }
    if problems.is_empty() {
        return Ok(());
    }
    let n = problems.len();
    problems.truncate(8);
    let more = if n > 8 {
        format!(" (and {} more)", n - 8)
    } else {
        String::new()
    };
    Err(format!("{}{more}", problems.join("; ")))
}

/// A memory-mapped `VarBuilder` over one safetensors file, in f32 on `device`.
pub fn var_builder(path: &Path, device: Device) -> Result<VarBuilder<'static>, ModelError> {
    let dev = device.candle()?;
    // SAFETY: as in `shapes`; installed weights are only ever replaced by rename.
    unsafe {
        VarBuilder::from_mmaped_safetensors(&[path], candle_core::DType::F32, &dev)
            .map_err(|e| ModelError::io(path, e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compare_lists_every_kind_of_difference() {
        let exp: BTreeMap<_, _> = [("a".to_string(), vec![3]), ("b".to_string(), vec![2, 2])]
            .into_iter()
            .collect();
        assert!(compare(&exp, &exp).is_ok());
        let act: BTreeMap<_, _> = [("a".to_string(), vec![4]), ("c".to_string(), vec![1])]
            .into_iter()
            .collect();
        let err = compare(&exp, &act).err().unwrap_or_default();
        assert!(err.contains("`a` has shape [4], expected [3]"), "{err}");
        assert!(err.contains("missing `b`"), "{err}");
        assert!(err.contains("unexpected `c`"), "{err}");
    }
}
