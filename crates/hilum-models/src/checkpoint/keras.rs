//! Keras HDF5 checkpoints (`model.save(...)` and `save_weights(...)` of Keras 2) read in Rust
//! with the pure-Rust `hdf5-reader` (no HDF5 C library, no Python). Only the weights are read:
//! `model_config` and `training_config` hold code-like JSON that is never interpreted.
//!
//! Layout read (Keras 2's `saving.py`): the weights group is `model_weights` (whole models) or
//! the root (weights-only files); its `layer_names` attribute lists layer groups in order, each
//! with a `weight_names` attribute of paths relative to that group (`conv1/kernel:0`).
//!
//! [`keras_to_safetensors`] writes the same bytes as `scripts/convert_keras_h5.py`, which it
//! replaces: each weight `<layer>/.../<name>:0` becomes `<layer>.<name>`, values cast to f32
//! with their Keras shape (conv kernels stay HWIO), tensors sorted by name, the header as
//! Python's `json.dumps(..., separators=(",", ":"))` writes it.

use std::path::Path;

use hdf5_reader::group::Group;
use hdf5_reader::{Attribute, Dataset, Datatype, Hdf5File, OpenOptions};

use super::{CheckpointError, Tensor, MAX_TENSOR_ELEMS};

/// The weights of a Keras file, in the converter's order, and the header metadata.
#[derive(Debug)]
pub struct KerasWeights {
    /// `<layer>.<name>` → tensor, sorted by name.
    pub tensors: Vec<(String, Tensor)>,
    /// `converted_from`, then the file's `keras_version` and `backend` where present.
    pub metadata: Vec<(String, String)>,
}

fn malformed(what: impl std::fmt::Display, e: hdf5_reader::error::Error) -> CheckpointError {
    CheckpointError::Malformed(format!("{what}: {e}"))
}

/// Reads the weights of the Keras `.h5` file at `path`.
pub fn read_keras_h5(path: &Path) -> Result<KerasWeights, CheckpointError> {
    let io = |e: std::io::Error| CheckpointError::Io {
        path: path.display().to_string(),
        reason: e.to_string(),
    };
    // Read into memory rather than mapped: a file changed or truncated while mapped would
    // crash the process instead of giving an error.
    let bytes = std::fs::read(path).map_err(io)?;
    let file_len = bytes.len();
    let options = OpenOptions::default()
        .with_max_read_bytes(MAX_TENSOR_ELEMS * 4)
        .with_chunk_cache_bytes(0);
    let file = Hdf5File::from_vec_with_options(bytes, options)
        .map_err(|e| malformed("not a readable HDF5 file", e))?;
    let root = file.root_group().map_err(|e| malformed("root group", e))?;

    let weights_root = if has_member(&root, "model_weights")? {
        root.group("model_weights")
            .map_err(|e| malformed("model_weights", e))?
    } else {
        root.clone()
    };
    let mut tensors: Vec<(String, Tensor)> = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for layer in string_list(&weights_root, "layer_names")? {
        let group = weights_root
            .group(&layer)
            .map_err(|e| malformed(format_args!("layer `{layer}`"), e))?;
        for wname in string_list(&group, "weight_names")? {
            let short = wname.rsplit('/').next().unwrap_or(&wname);
            let short = short.split(':').next().unwrap_or(short);
            let key = format!("{layer}.{short}");
            if !seen.insert(key.clone()) {
                return Err(CheckpointError::Malformed(format!(
                    "duplicate weight name {key}"
                )));
            }
            let ds = dataset_at(&root, &group, &wname)?;
            let tensor = read_f32(&ds, file_len).map_err(|e| match e {
                CheckpointError::Malformed(m) => {
                    CheckpointError::Malformed(format!("weight `{layer}/{wname}`: {m}"))
                }
                other => other,
            })?;
            tensors.push((key, tensor));
        }
    }
    if tensors.is_empty() {
        return Err(CheckpointError::Malformed(
            "no weights found (is it a Keras model or weights file?)".into(),
        ));
    }
    tensors.sort_by(|a, b| a.0.cmp(&b.0));

    let mut metadata = vec![("converted_from".to_string(), "keras-h5".to_string())];
    for key in ["keras_version", "backend"] {
        // Non-string values (never written by Keras) are left out.
        if let Some(value) = find_attribute(&root, key)?.and_then(|a| a.read_string().ok()) {
            metadata.push((key.to_string(), value));
        }
    }
    Ok(KerasWeights { tensors, metadata })
}

/// Converts a Keras `.h5` file to safetensors; returns the tensor count.
pub fn keras_to_safetensors(src: &Path, dst: &Path) -> Result<usize, CheckpointError> {
    let weights = read_keras_h5(src)?;
    let n = weights.tensors.len();
    let mut out = safetensors_header(&weights);
    for (_, t) in &weights.tensors {
        out.extend(t.data.iter().flat_map(|x| x.to_le_bytes()));
    }
    std::fs::write(dst, out).map_err(|e| CheckpointError::Io {
        path: dst.display().to_string(),
        reason: e.to_string(),
    })?;
    Ok(n)
}

fn has_member(group: &Group, name: &str) -> Result<bool, CheckpointError> {
    let (groups, datasets) = group
        .member_names()
        .map_err(|e| malformed("group members", e))?;
    Ok(groups.iter().chain(&datasets).any(|n| n == name))
}

fn find_attribute(group: &Group, name: &str) -> Result<Option<Attribute>, CheckpointError> {
    let attrs = group
        .attributes()
        .map_err(|e| malformed(format_args!("attributes of `{}`", group.name()), e))?;
    Ok(attrs.into_iter().find(|a| a.name == name))
}

/// A string-array attribute; absent or empty (Keras writes `[]` as an empty float array) is an
/// empty list, as `attrs.get(name, [])` is in the converter.
fn string_list(group: &Group, name: &str) -> Result<Vec<String>, CheckpointError> {
    let Some(attr) = find_attribute(group, name)? else {
        return Ok(Vec::new());
    };
    let what = || format!("attribute `{name}` of `{}`", group.name());
    if attr.num_elements().map_err(|e| malformed(what(), e))? == 0 {
        return Ok(Vec::new());
    }
    attr.read_strings().map_err(|e| malformed(what(), e))
}

/// The dataset at `path` relative to `group` (from the file's root when it starts with `/`).
fn dataset_at(root: &Group, group: &Group, path: &str) -> Result<Dataset, CheckpointError> {
    let mut parts: Vec<&str> = path.split('/').filter(|p| !p.is_empty()).collect();
    let Some(last) = parts.pop() else {
        return Err(CheckpointError::Malformed(format!(
            "empty weight name in `{}`",
            group.name()
        )));
    };
    let mut here = if path.starts_with('/') {
        root.clone()
    } else {
        group.clone()
    };
    for part in parts {
        here = here
            .group(part)
            .map_err(|e| malformed(format_args!("weight `{path}`"), e))?;
    }
    here.dataset(last)
        .map_err(|e| malformed(format_args!("weight `{path}`"), e))
}

/// A dataset's values as f32, as numpy's `ascontiguousarray(x, dtype="<f4")` gives them
/// (a scalar becomes shape `[1]`).
fn read_f32(ds: &Dataset, file_len: usize) -> Result<Tensor, CheckpointError> {
    let mut shape = Vec::with_capacity(ds.shape().len());
    let mut n: usize = 1;
    for &d in ds.shape() {
        let d = usize::try_from(d).ok();
        n = match d.and_then(|d| n.checked_mul(d)) {
            Some(n) if n <= MAX_TENSOR_ELEMS => n,
            _ => {
                return Err(CheckpointError::Limit(format!(
                    "dataset `{}` of shape {:?} is larger than {MAX_TENSOR_ELEMS} values",
                    ds.name(),
                    ds.shape()
                )))
            }
        };
        shape.push(d.unwrap_or(0));
    }
    if shape.is_empty() {
        shape.push(1);
    }
    let (size, big_endian) = match ds.dtype() {
        Datatype::FloatingPoint { size, byte_order } => (
            *size,
            matches!(byte_order, hdf5_reader::ByteOrder::BigEndian),
        ),
        other => {
            return Err(CheckpointError::Unsupported(format!(
                "dataset `{}` holds {other:?}; Keras weights are floating point",
                ds.name()
            )))
        }
    };
    // Uncompressed data lies in the file: a shape larger than the file is a lie, refused
    // before anything is allocated for it.
    if ds.chunks().is_none() && n.saturating_mul(usize::from(size)) > file_len {
        return Err(CheckpointError::Malformed(format!(
            "dataset `{}` declares {n} values of {size} bytes in a file of {file_len} bytes",
            ds.name()
        )));
    }
    let err = |e| malformed(format_args!("dataset `{}`", ds.name()), e);
    let data = match size {
        4 => {
            let mut v = vec![0f32; n];
            ds.read_into(&mut v).map_err(err)?;
            v
        }
        // Rounds to nearest, ties to even, as numpy's cast does.
        8 => {
            let mut v = vec![0f64; n];
            ds.read_into(&mut v).map_err(err)?;
            v.into_iter().map(|x| x as f32).collect()
        }
        2 => {
            let raw = ds.read_raw_bytes().map_err(err)?;
            if raw.len() != n * 2 {
                return Err(CheckpointError::Malformed(format!(
                    "dataset `{}` holds {} bytes for {n} half-precision values",
                    ds.name(),
                    raw.len()
                )));
            }
            raw.chunks_exact(2)
                .map(|b| {
                    let bits = if big_endian {
                        u16::from_be_bytes([b[0], b[1]])
                    } else {
                        u16::from_le_bytes([b[0], b[1]])
                    };
                    half::f16::from_bits(bits).to_f32()
                })
                .collect()
        }
        other => {
            return Err(CheckpointError::Unsupported(format!(
                "dataset `{}` holds {other}-byte floats",
                ds.name()
            )))
        }
    };
    Ok(Tensor { shape, data })
}

/// The 8-byte length, then the JSON header padded with spaces to a multiple of 8, byte for
/// byte as the Python converter writes it.
fn safetensors_header(w: &KerasWeights) -> Vec<u8> {
    let mut json = String::from("{\"__metadata__\":{");
    for (i, (k, v)) in w.metadata.iter().enumerate() {
        if i > 0 {
            json.push(',');
        }
        push_json_string(&mut json, k);
        json.push(':');
        push_json_string(&mut json, v);
    }
    json.push('}');
    let mut offset = 0usize;
    for (name, t) in &w.tensors {
        let end = offset + t.data.len() * 4;
        json.push(',');
        push_json_string(&mut json, name);
        let shape: Vec<String> = t.shape.iter().map(|d| d.to_string()).collect();
        json.push_str(&format!(
            ":{{\"dtype\":\"F32\",\"shape\":[{}],\"data_offsets\":[{offset},{end}]}}",
            shape.join(",")
        ));
        offset = end;
    }
    json.push('}');
    while json.len() % 8 != 0 {
        json.push(' ');
    }
    let mut out = Vec::with_capacity(8 + json.len());
    out.extend((json.len() as u64).to_le_bytes());
    out.extend(json.as_bytes());
    out
}

/// A JSON string as Python's `json.dumps` writes it (`ensure_ascii`: everything outside ASCII
/// as `\uXXXX`, lowercase hex, surrogate pairs above U+FFFF).
fn push_json_string(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            ' '..='~' => out.push(c),
            _ => {
                let mut units = [0u16; 2];
                for u in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{u:04x}"));
                }
            }
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_strings_escape_as_python_does() {
        let mut s = String::new();
        push_json_string(&mut s, "a\"b\\c\n\u{1}é😀\u{7f}");
        // json.dumps('a"b\\c\n\x01é😀\x7f')
        assert_eq!(s, r#""a\"b\\c\n\u0001\u00e9\ud83d\ude00\u007f""#);
    }

    #[test]
    fn header_is_padded_to_eight_bytes_with_spaces() {
        let w = KerasWeights {
            tensors: vec![(
                "d.bias".into(),
                Tensor {
                    shape: vec![2],
                    data: vec![1.0, 2.0],
                },
            )],
            metadata: vec![("converted_from".into(), "keras-h5".into())],
        };
        let h = safetensors_header(&w);
        let len = u64::from_le_bytes(h[..8].try_into().expect("8 bytes")) as usize;
        assert_eq!(len % 8, 0);
        assert_eq!(h.len(), 8 + len);
        let json = std::str::from_utf8(&h[8..]).expect("utf-8");
        assert_eq!(
            json.trim_end(),
            r#"{"__metadata__":{"converted_from":"keras-h5"},"d.bias":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#
        );
    }
}
