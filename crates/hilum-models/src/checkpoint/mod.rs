//! PyTorch checkpoints (`.pt`, `.pth`, `.bin`) read in Rust, so installing a model needs no
//! Python and never runs a checkpoint's code: [`pickle`] is a restricted unpickler that builds
//! only tensors, storages, dicts and inert module records, [`torch`] reads `torch.save`'s zip
//! and legacy layouts. A whole pickled `nn.Module` (how torchxrayvision publishes its DenseNet)
//! is flattened into `state_dict()` names from its `_parameters`, `_buffers` and `_modules`.
//!
//! Keras `.h5` files are read by [`read_keras_h5`] (pure-Rust HDF5; only the weights).
//!
//! [`pytorch_to_safetensors`] applies the renaming rules of the Python converters it replaces
//! (`scripts/convert_xrv.py`, `convert_pspnet.py`, `convert_medsam.py`).

mod keras;
mod pickle;
mod torch;

pub use keras::{keras_to_safetensors, read_keras_h5, KerasWeights};

use std::collections::{HashMap, HashSet};
use std::path::Path;

use pickle::{DType, Obj, Pickle, TensorRef, Value};

use crate::architecture::Renames;

/// Submodule nesting deeper than any real network; guards against cyclic module records.
const MAX_MODULE_DEPTH: usize = 64;
/// State-dict entries; guards against module records shared exponentially often.
const MAX_ENTRIES: usize = 1 << 20;
/// Elements of one tensor once made dense (4 GiB of f32).
const MAX_TENSOR_ELEMS: usize = 1 << 30;
/// Elements of a broadcast view (stride 0) beyond its storage's size: an `expand()` saved as
/// such is small; a huge one is a file that asks for memory it does not hold.
const MAX_BROADCAST_ELEMS: usize = 1 << 24;

/// Why a checkpoint was not read; nothing of a refused or malformed file is used.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// The pickle names something outside the allowed list (it could run code).
    #[error(
        "refused {what} `{name}`: a checkpoint may name only tensors, storages, ordered dicts \
         and torch/torchxrayvision module classes, and Hilum never runs code from a checkpoint"
    )]
    Refused {
        /// What kind of thing it is (a global, an opcode, a module class, ...).
        what: &'static str,
        /// Its name.
        name: String,
    },
    /// A file that does not parse as a `torch.save` archive or pickle.
    #[error("malformed checkpoint: {0}")]
    Malformed(String),
    /// A file that asks for more tensors, elements or nesting than Hilum accepts.
    #[error("checkpoint over a limit: {0}")]
    Limit(String),
    /// A valid file in a form Hilum does not read (a dtype, a layout).
    #[error("unsupported checkpoint: {0}")]
    Unsupported(String),
    /// The file could not be read.
    #[error("{path}: {reason}")]
    Io {
        /// The checkpoint's path.
        path: String,
        /// The operating system's error.
        reason: String,
    },
}

/// A dense row-major f32 tensor.
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    /// Size of each dimension.
    pub shape: Vec<usize>,
    /// The elements, last dimension fastest.
    pub data: Vec<f32>,
}

impl safetensors::View for Tensor {
    fn dtype(&self) -> safetensors::Dtype {
        safetensors::Dtype::F32
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        self.data.iter().flat_map(|x| x.to_le_bytes()).collect()
    }
    fn data_len(&self) -> usize {
        self.data.len() * 4
    }
}

/// A module attribute that is neither a parameter, a buffer nor a submodule (`op_threshs` on
/// old torchxrayvision models, `pathologies`).
#[derive(Clone, Debug, PartialEq)]
pub enum Attribute {
    /// A tensor attribute.
    Tensor(Tensor),
    /// Plain data (numbers, strings, lists, dicts) as JSON.
    Data(serde_json::Value),
}

/// What a checkpoint holds at the top.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Content {
    /// A whole pickled module, with its class (`torchxrayvision.models.DenseNet`).
    Module(String),
    /// A dict (a `state_dict`, or one holding it under a key).
    Dict,
    /// Anything else, with its type name.
    Other(String),
}

/// A `torch.save` file, parsed; nothing in it has run.
pub struct Checkpoint {
    file: torch::TorchFile,
}

impl Checkpoint {
    /// Reads and parses the file, refusing any pickle that names something not allowed.
    pub fn open(path: &Path) -> Result<Checkpoint, CheckpointError> {
        Ok(Checkpoint {
            file: torch::TorchFile::open(path)?,
        })
    }

    /// What the checkpoint holds at the top.
    pub fn content(&self) -> Content {
        let p = &self.file.pickle;
        match p.obj(&p.root) {
            Some(Obj::Module(m)) => Content::Module(m.class.to_string()),
            Some(Obj::Dict(_)) => Content::Dict,
            _ => Content::Other(p.type_name(&p.root)),
        }
    }

    /// The tensors `torch.load(path)` would give: after descending into each of `unwrap`'s keys
    /// in turn where it holds a dict (`{"state_dict": {...}}`), a module's `state_dict()` or a
    /// dict's tensor entries, in file order. `rename` maps each name to its output name, or
    /// `None` to leave it out (it is then never read).
    pub fn tensors(
        &mut self,
        unwrap: &[&str],
        mut rename: impl FnMut(&str) -> Option<String>,
    ) -> Result<Vec<(String, Tensor)>, CheckpointError> {
        let refs = state_dict(&self.file.pickle, unwrap)?;
        let mut out = Vec::with_capacity(refs.len());
        for (name, t) in refs {
            if let Some(new) = rename(&name) {
                out.push((new, self.dense(&t)?));
            }
        }
        Ok(out)
    }

    /// Attributes of a pickled module and its submodules other than parameters, buffers,
    /// submodules and torch's own `_`-prefixed bookkeeping, under dotted names. Empty for a
    /// state dict.
    pub fn attributes(&mut self) -> Result<Vec<(String, Attribute)>, CheckpointError> {
        let mut found = Vec::new();
        let p = &self.file.pickle;
        collect_attributes(p, &p.root, "", 0, &mut found)?;
        let mut out = Vec::with_capacity(found.len());
        for (name, v) in found {
            let attr = match self.file.pickle.tensor(&v).cloned() {
                Some(t) => Attribute::Tensor(self.dense(&t)?),
                None => Attribute::Data(to_json(&self.file.pickle, &v, 0)),
            };
            out.push((name, attr));
        }
        Ok(out)
    }

    fn dense(&mut self, t: &TensorRef) -> Result<Tensor, CheckpointError> {
        let big_endian = self.file.big_endian();
        let bytes = self.file.storage_bytes(&t.storage)?;
        dense(bytes, t, big_endian)
    }
}

/// Runs the restricted unpickler over a bare pickle; returns the type of what it holds.
/// Refuses what a checkpoint's `data.pkl` would be refused for.
pub fn parse_pickle(bytes: &[u8]) -> Result<String, CheckpointError> {
    let (p, _) = pickle::parse(bytes)?;
    Ok(p.type_name(&p.root))
}

/// Name → tensor record, as `state_dict()` or the dict itself would list them.
fn state_dict(p: &Pickle, unwrap: &[&str]) -> Result<Vec<(String, TensorRef)>, CheckpointError> {
    let mut root = &p.root;
    for key in unwrap {
        if let Some(inner) = p.dict(root).and_then(|d| d.get(key)) {
            if p.dict(inner).is_some() {
                root = inner;
            }
        }
    }
    let mut out = Vec::new();
    match p.obj(root) {
        Some(Obj::Module(_)) => module_state(p, root, "", 0, &mut out)?,
        Some(Obj::Dict(d)) => {
            for (k, v) in &d.entries {
                if let (Value::Str(k), Some(t)) = (k, p.tensor(v)) {
                    out.push((k.to_string(), t.clone()));
                }
            }
        }
        _ => {
            return Err(CheckpointError::Unsupported(format!(
                "the file holds a {}, neither a module nor a state dict",
                p.type_name(root)
            )))
        }
    }
    Ok(out)
}

/// `nn.Module.state_dict()`: each module's parameters, then its persistent buffers, then its
/// submodules in order; `None` entries are skipped, as torch does.
fn module_state(
    p: &Pickle,
    module: &Value,
    prefix: &str,
    depth: usize,
    out: &mut Vec<(String, TensorRef)>,
) -> Result<(), CheckpointError> {
    if depth > MAX_MODULE_DEPTH {
        return Err(CheckpointError::Limit(format!(
            "modules nested more than {MAX_MODULE_DEPTH} deep at `{prefix}`"
        )));
    }
    let Some(Obj::Module(m)) = p.obj(module) else {
        return Ok(());
    };
    let Some(state) = m.state.as_ref().and_then(|s| p.dict(s)) else {
        return Ok(());
    };
    // Old pickled modules lack the set: every buffer is persistent (torchxrayvision's patch).
    let transient: HashSet<&str> = match state.get("_non_persistent_buffers_set").map(|s| p.obj(s))
    {
        Some(Some(Obj::Set(items) | Obj::List(items) | Obj::Tuple(items))) => items
            .iter()
            .filter_map(|v| match v {
                Value::Str(s) => Some(&**s),
                _ => None,
            })
            .collect(),
        _ => HashSet::new(),
    };
    for (field, skip) in [("_parameters", &HashSet::new()), ("_buffers", &transient)] {
        let Some(d) = state.get(field).and_then(|v| p.dict(v)) else {
            continue;
        };
        for (k, v) in &d.entries {
            let (Value::Str(k), Some(t)) = (k, p.tensor(v)) else {
                continue;
            };
            if !skip.contains(&**k) {
                if out.len() >= MAX_ENTRIES {
                    return Err(CheckpointError::Limit(format!(
                        "more than {MAX_ENTRIES} state-dict entries"
                    )));
                }
                out.push((format!("{prefix}{k}"), t.clone()));
            }
        }
    }
    if let Some(children) = state.get("_modules").and_then(|v| p.dict(v)) {
        for (k, child) in &children.entries {
            if let Value::Str(k) = k {
                module_state(p, child, &format!("{prefix}{k}."), depth + 1, out)?;
            }
        }
    }
    Ok(())
}

fn collect_attributes(
    p: &Pickle,
    module: &Value,
    prefix: &str,
    depth: usize,
    out: &mut Vec<(String, Value)>,
) -> Result<(), CheckpointError> {
    if depth > MAX_MODULE_DEPTH || out.len() >= MAX_ENTRIES {
        return Err(CheckpointError::Limit(format!(
            "modules nested too deep or too many attributes at `{prefix}`"
        )));
    }
    let Some(Obj::Module(m)) = p.obj(module) else {
        return Ok(());
    };
    let Some(state) = m.state.as_ref().and_then(|s| p.dict(s)) else {
        return Ok(());
    };
    for (k, v) in &state.entries {
        if let Value::Str(k) = k {
            if !k.starts_with('_') && &**k != "training" {
                out.push((format!("{prefix}{k}"), v.clone()));
            }
        }
    }
    if let Some(children) = state.get("_modules").and_then(|v| p.dict(v)) {
        for (k, child) in &children.entries {
            if let Value::Str(k) = k {
                collect_attributes(p, child, &format!("{prefix}{k}."), depth + 1, out)?;
            }
        }
    }
    Ok(())
}

/// Plain data as JSON; anything deeper than a few levels or not data becomes its type name.
fn to_json(p: &Pickle, v: &Value, depth: usize) -> serde_json::Value {
    use serde_json::Value as J;
    if depth > 16 {
        return J::String(p.type_name(v));
    }
    match v {
        Value::None => J::Null,
        Value::Bool(b) => J::Bool(*b),
        Value::Int(i) => J::from(*i),
        Value::Float(f) => serde_json::Number::from_f64(*f).map_or(J::Null, J::Number),
        Value::Str(s) => J::String(s.to_string()),
        _ => match p.obj(v) {
            Some(Obj::Tuple(items) | Obj::List(items) | Obj::Set(items)) => J::Array(
                items
                    .iter()
                    .take(1 << 16)
                    .map(|x| to_json(p, x, depth + 1))
                    .collect(),
            ),
            Some(Obj::Dict(d)) => J::Object(
                d.entries
                    .iter()
                    .take(1 << 16)
                    .map(|(k, x)| {
                        let k = match k {
                            Value::Str(s) => s.to_string(),
                            other => to_json(p, other, depth + 1).to_string(),
                        };
                        (k, to_json(p, x, depth + 1))
                    })
                    .collect(),
            ),
            _ => J::String(p.type_name(v)),
        },
    }
}

/// Copies a (possibly strided, offset) view of a storage into a dense f32 tensor.
fn dense(bytes: &[u8], t: &TensorRef, big_endian: bool) -> Result<Tensor, CheckpointError> {
    let es = t.storage.dtype.size();
    if !bytes.len().is_multiple_of(es) {
        return Err(CheckpointError::Malformed(format!(
            "storage `{}` is {} bytes, not a whole number of {es}-byte elements",
            t.storage.key,
            bytes.len()
        )));
    }
    let numel = bytes.len() / es;
    // A size-1 dimension's stride is never stepped; zero keeps arithmetic on it in range.
    let stride: Vec<usize> = t
        .shape
        .iter()
        .zip(&t.stride)
        .map(|(&d, &s)| if d == 1 { 0 } else { s })
        .collect();
    let too_big = || {
        CheckpointError::Limit(format!(
            "a tensor of shape {:?} has more than {MAX_TENSOR_ELEMS} elements",
            t.shape
        ))
    };
    let n = t
        .shape
        .iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d))
        .filter(|&n| n <= MAX_TENSOR_ELEMS)
        .ok_or_else(too_big)?;
    if n > numel && n > MAX_BROADCAST_ELEMS {
        return Err(CheckpointError::Limit(format!(
            "a broadcast view of shape {:?} is larger than its storage `{}` ({numel} elements)",
            t.shape, t.storage.key
        )));
    }
    if n > 0 {
        let last = t
            .shape
            .iter()
            .zip(&stride)
            .try_fold(t.offset, |a, (&d, &s)| {
                (d - 1).checked_mul(s).and_then(|x| a.checked_add(x))
            });
        if last.is_none_or(|l| l >= numel) {
            return Err(CheckpointError::Malformed(format!(
                "tensor of shape {:?} (offset {}, strides {:?}) reads past its storage `{}` of \
                 {numel} elements",
                t.shape, t.offset, t.stride, t.storage.key
            )));
        }
    }
    let get = decoder(t.storage.dtype, big_endian);
    let at = |i: usize| get(&bytes[i * es..i * es + es]);
    let mut data = Vec::with_capacity(n);
    let ndim = t.shape.len();
    let contiguous = {
        let mut want = 1usize;
        let mut ok = true;
        for d in (0..ndim).rev() {
            if t.shape[d] != 1 && stride[d] != want {
                ok = false;
            }
            want = want.saturating_mul(t.shape[d]);
        }
        ok
    };
    if n == 0 {
    } else if contiguous {
        data.extend((t.offset..t.offset + n).map(at));
    } else {
        // Odometer over the index; `pos` is the storage element it points at.
        let mut idx = vec![0usize; ndim];
        let mut pos = t.offset;
        for _ in 0..n {
            data.push(at(pos));
            for d in (0..ndim).rev() {
                idx[d] += 1;
                pos += stride[d];
                if idx[d] < t.shape[d] {
                    break;
                }
                pos -= stride[d] * t.shape[d];
                idx[d] = 0;
            }
        }
    }
    Ok(Tensor {
        shape: t.shape.clone(),
        data,
    })
}

/// One element's bytes → f32, as `tensor.to(torch.float32)` converts it.
fn decoder(dtype: DType, big_endian: bool) -> fn(&[u8]) -> f32 {
    fn arr<const N: usize>(b: &[u8]) -> [u8; N] {
        let mut a = [0u8; N];
        a.copy_from_slice(b);
        a
    }
    match (dtype, big_endian) {
        (DType::F32, false) => |b| f32::from_le_bytes(arr(b)),
        (DType::F32, true) => |b| f32::from_be_bytes(arr(b)),
        (DType::F16, false) => |b| half::f16::from_le_bytes(arr(b)).to_f32(),
        (DType::F16, true) => |b| half::f16::from_be_bytes(arr(b)).to_f32(),
        (DType::BF16, false) => |b| half::bf16::from_le_bytes(arr(b)).to_f32(),
        (DType::BF16, true) => |b| half::bf16::from_be_bytes(arr(b)).to_f32(),
        (DType::F64, false) => |b| f64::from_le_bytes(arr(b)) as f32,
        (DType::F64, true) => |b| f64::from_be_bytes(arr(b)) as f32,
        (DType::I64, false) => |b| i64::from_le_bytes(arr(b)) as f32,
        (DType::I64, true) => |b| i64::from_be_bytes(arr(b)) as f32,
        (DType::I32, false) => |b| i32::from_le_bytes(arr(b)) as f32,
        (DType::I32, true) => |b| i32::from_be_bytes(arr(b)) as f32,
        (DType::I16, false) => |b| i16::from_le_bytes(arr(b)) as f32,
        (DType::I16, true) => |b| i16::from_be_bytes(arr(b)) as f32,
        (DType::I8, _) => |b| b[0] as i8 as f32,
        (DType::U8, _) => |b| b[0] as f32,
        (DType::Bool, _) => |b| if b[0] != 0 { 1.0 } else { 0.0 },
    }
}

/// Converts a PyTorch checkpoint to a safetensors file of f32 tensors, with the names and
/// selection its architecture's [`Renames`] give (those of the Python converter it replaces).
/// Returns the tensor count.
pub fn pytorch_to_safetensors(
    renames: &Renames,
    src: &Path,
    dst: &Path,
) -> Result<usize, CheckpointError> {
    let mut ckpt = Checkpoint::open(src)?;
    let tensors = ckpt.tensors(renames.unwrap, renames.rename)?;
    let metadata = renames.record_source.then(|| {
        let source = src
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        HashMap::from([
            ("source".to_string(), source),
            ("format".to_string(), "pt".to_string()),
        ])
    });
    // Later duplicates win, as in the converters' dicts.
    let mut unique: Vec<(String, Tensor)> = Vec::with_capacity(tensors.len());
    let mut seen: HashMap<String, usize> = HashMap::new();
    for (name, t) in tensors {
        match seen.get(&name) {
            Some(&i) => unique[i].1 = t,
            None => {
                seen.insert(name.clone(), unique.len());
                unique.push((name, t));
            }
        }
    }
    let n = unique.len();
    safetensors::serialize_to_file(unique, metadata, dst).map_err(|e| CheckpointError::Io {
        path: dst.display().to_string(),
        reason: e.to_string(),
    })?;
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;
    use pickle::Storage;

    fn view(dtype: DType, shape: &[usize], stride: &[usize], offset: usize) -> TensorRef {
        TensorRef {
            storage: Storage {
                dtype,
                key: "0".into(),
                view_offset: 0,
            },
            offset,
            shape: shape.to_vec(),
            stride: stride.to_vec(),
        }
    }

    fn f32s(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    #[test]
    fn strided_views_read_the_elements_torch_would() {
        let b = f32s(&[0., 1., 2., 3., 4., 5.]);
        // A (2, 3) transpose of a (3, 2) matrix, and a column with offset.
        let t = dense(&b, &view(DType::F32, &[2, 3], &[1, 2], 0), false).expect("view");
        assert_eq!(t.data, vec![0., 2., 4., 1., 3., 5.]);
        let t = dense(&b, &view(DType::F32, &[3], &[2], 1), false).expect("view");
        assert_eq!(t.data, vec![1., 3., 5.]);
        // A size-1 dimension may carry any stride; it is never stepped.
        let t = dense(&b, &view(DType::F32, &[1, 2], &[usize::MAX, 2], 0), false).expect("view");
        assert_eq!(t.data, vec![0., 2.]);
    }

    #[test]
    fn views_past_their_storage_and_huge_broadcasts_are_refused() {
        let b = f32s(&[0., 1., 2., 3.]);
        let err = dense(&b, &view(DType::F32, &[3], &[2], 0), false).expect_err("past the end");
        assert!(matches!(err, CheckpointError::Malformed(_)), "{err}");
        let err = dense(&b, &view(DType::F32, &[1 << 25], &[0], 0), false).expect_err("too big");
        assert!(matches!(err, CheckpointError::Limit(_)), "{err}");
        let err = dense(&b[..3], &view(DType::F32, &[1], &[1], 0), false).expect_err("ragged");
        assert!(matches!(err, CheckpointError::Malformed(_)), "{err}");
    }

    #[test]
    fn half_precision_and_byte_order_decode_exactly() {
        // f16: 1.0, -2.0, the smallest subnormal 2^-24; bf16: 1.0, -0.5.
        let t = dense(
            &[0x00, 0x3c, 0x00, 0xc0, 0x01, 0x00],
            &view(DType::F16, &[3], &[1], 0),
            false,
        )
        .expect("f16");
        assert_eq!(t.data, vec![1.0, -2.0, 2f32.powi(-24)]);
        let t = dense(
            &[0x80, 0x3f, 0x00, 0xbf],
            &view(DType::BF16, &[2], &[1], 0),
            false,
        )
        .expect("bf16");
        assert_eq!(t.data, vec![1.0, -0.5]);
        let t = dense(
            &1.5f32.to_be_bytes(),
            &view(DType::F32, &[1], &[1], 0),
            true,
        )
        .expect("big-endian");
        assert_eq!(t.data, vec![1.5]);
    }
}
