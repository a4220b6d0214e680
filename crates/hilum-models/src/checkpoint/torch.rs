//! The two layouts `torch.save` writes, read without Python:
//! - zip (torch >= 1.6): `<top>/data.pkl` holds the object pickle, `<top>/data/<key>` each
//!   storage's raw bytes, `<top>/byteorder` their byte order (`<top>` varies with the file name
//!   it was saved under);
//! - legacy (pre-1.6, or `_use_new_zipfile_serialization=False`): pickles of the magic number,
//!   the protocol version and the system info, then the object pickle, then a pickled list of
//!   storage keys, then each storage in that order as an 8-byte element count and raw bytes.
//!
//! See `torch/serialization.py` (`_save`, `_legacy_save`, `_load`, `_legacy_load`).

use std::collections::HashMap;
use std::fs::File;
use std::io::Read;
use std::path::Path;

use super::pickle::{self, DType, Pickle, Storage, Value};
use super::CheckpointError;

/// The object pickle of a checkpoint is metadata (names, shapes); tensors live beside it.
const MAX_PICKLE_BYTES: u64 = 256 << 20;
/// No single storage we would import is larger (LLaVA's largest tensors are < 1 GiB).
const MAX_STORAGE_BYTES: u64 = 16 << 30;
/// `torch.serialization.MAGIC_NUMBER` and `PROTOCOL_VERSION`.
/// (`0x1950a86a20f9469cfc6c`, pickled as little-endian bytes.)
const LEGACY_MAGIC: [u8; 10] = [0x6c, 0xfc, 0x9c, 0x46, 0xf9, 0x20, 0x6a, 0xa8, 0x50, 0x19];
const LEGACY_PROTOCOL: i64 = 1001;

/// An opened torch checkpoint: the parsed object pickle and where its storages' bytes are.
pub struct TorchFile {
    pub pickle: Pickle,
    source: Source,
    big_endian: bool,
}

enum Source {
    Zip {
        archive: zip::ZipArchive<File>,
        top: String,
        /// The last storage read: views of one storage are usually listed together.
        cache: Option<(String, Vec<u8>)>,
    },
    Legacy {
        map: memmap2::Mmap,
        /// key → byte range in `map`.
        ranges: HashMap<String, (usize, usize)>,
    },
}

impl TorchFile {
    pub fn open(path: &Path) -> Result<TorchFile, CheckpointError> {
        let io = |e: std::io::Error| CheckpointError::Io {
            path: path.display().to_string(),
            reason: e.to_string(),
        };
        let mut file = File::open(path).map_err(io)?;
        let mut magic = [0u8; 4];
        let n = file.read(&mut magic).map_err(io)?;
        match &magic[..n] {
            [b'P', b'K', 3, 4] => Self::open_zip(File::open(path).map_err(io)?),
            [0x80, ..] => {
                // SAFETY: read-only map of a file we do not modify while it is open.
                let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io)?;
                Self::open_legacy(map)
            }
            _ => Err(CheckpointError::Unsupported(
                "not a torch.save file (neither a zip archive nor a legacy pickle; files from \
                 torch < 0.4 are tar archives, which Hilum does not read)"
                    .into(),
            )),
        }
    }

    fn open_zip(file: File) -> Result<TorchFile, CheckpointError> {
        let zerr = |e: zip::result::ZipError| CheckpointError::Malformed(format!("zip: {e}"));
        let mut archive = zip::ZipArchive::new(file).map_err(zerr)?;
        let pkl_name = archive
            .file_names()
            .filter_map(Result::ok)
            .find(|n| n.ends_with("/data.pkl") && n.matches('/').count() == 1)
            .map(|n| n.to_string());
        let Some(pkl_name) = pkl_name else {
            let jit = archive
                .file_names()
                .filter_map(Result::ok)
                .any(|n| n.ends_with("/constants.pkl"));
            return Err(CheckpointError::Unsupported(if jit {
                "a TorchScript archive (torch.jit.save): save the model's state_dict() with \
                 torch.save instead"
                    .into()
            } else {
                "a zip file without <name>/data.pkl: not written by torch.save".into()
            }));
        };
        let top = pkl_name.trim_end_matches("/data.pkl").to_string();
        let data = read_entry(&mut archive, &pkl_name, MAX_PICKLE_BYTES)?;
        let (pickle, _) = pickle::parse(&data)?;
        let big_endian = match archive.index_for_name(&format!("{top}/byteorder")) {
            Some(_) => {
                let b = read_entry(&mut archive, &format!("{top}/byteorder"), 16)?;
                match b.as_slice() {
                    b"little" => false,
                    b"big" => true,
                    _ => return Err(CheckpointError::Malformed("bad byteorder record".into())),
                }
            }
            None => false,
        };
        Ok(TorchFile {
            pickle,
            source: Source::Zip {
                archive,
                top,
                cache: None,
            },
            big_endian,
        })
    }

    fn open_legacy(map: memmap2::Mmap) -> Result<TorchFile, CheckpointError> {
        let bad = |m: &str| CheckpointError::Malformed(format!("legacy torch file: {m}"));
        let mut pos = 0usize;
        let mut next = |what: &str| -> Result<Pickle, CheckpointError> {
            let rest = map.get(pos..).ok_or_else(|| bad(what))?;
            let window = &rest[..rest.len().min(MAX_PICKLE_BYTES as usize)];
            let (p, used) = pickle::parse(window).map_err(|e| match e {
                CheckpointError::Malformed(m) => bad(&format!("{what}: {m}")),
                other => other,
            })?;
            pos += used;
            Ok(p)
        };
        let magic = next("magic number")?;
        if !matches!(&magic.root, Value::Long(b) if **b == LEGACY_MAGIC) {
            return Err(CheckpointError::Unsupported(
                "a pickle that is not a torch.save checkpoint (no torch magic number)".into(),
            ));
        }
        let proto = next("protocol version")?;
        if proto.root != Value::Int(LEGACY_PROTOCOL) {
            return Err(CheckpointError::Unsupported(format!(
                "legacy torch protocol {:?}",
                proto.root
            )));
        }
        let info = next("system info")?;
        let big_endian = info
            .dict(&info.root)
            .and_then(|d| d.get("little_endian"))
            .is_some_and(|v| *v == Value::Bool(false));
        let object = next("object")?;
        let keys = next("storage keys")?;
        let key_list: Vec<String> = match keys.obj(&keys.root) {
            Some(pickle::Obj::List(l)) => l
                .iter()
                .map(|k| match k {
                    Value::Str(s) => Ok(s.to_string()),
                    _ => Err(bad("storage key is not a string")),
                })
                .collect::<Result<_, _>>()?,
            _ => return Err(bad("storage keys are not a list")),
        };
        // Each key's element size comes from the storages the object pickle names.
        let dtypes: HashMap<&str, DType> = object
            .objs
            .iter()
            .filter_map(|o| match o {
                pickle::Obj::Storage(s) => Some((s.key.as_str(), s.dtype)),
                _ => None,
            })
            .collect();
        let mut ranges = HashMap::new();
        for key in key_list {
            let dtype = *dtypes
                .get(key.as_str())
                .ok_or_else(|| bad(&format!("storage `{key}` is not used by any tensor")))?;
            let header = map
                .get(pos..pos + 8)
                .ok_or_else(|| bad(&format!("storage `{key}` truncated")))?;
            let mut n = [0u8; 8];
            n.copy_from_slice(header);
            let numel = if big_endian {
                u64::from_be_bytes(n)
            } else {
                u64::from_le_bytes(n)
            };
            let len = numel
                .checked_mul(dtype.size() as u64)
                .filter(|&l| l <= MAX_STORAGE_BYTES)
                .and_then(|l| usize::try_from(l).ok())
                .ok_or_else(|| bad(&format!("storage `{key}` is too large")))?;
            let start = pos + 8;
            let end = start
                .checked_add(len)
                .filter(|&e| e <= map.len())
                .ok_or_else(|| bad(&format!("storage `{key}` runs past the end of the file")))?;
            ranges.insert(key, (start, len));
            pos = end;
        }
        Ok(TorchFile {
            pickle: object,
            source: Source::Legacy { map, ranges },
            big_endian,
        })
    }

    /// The raw bytes of a storage.
    pub fn storage_bytes(&mut self, storage: &Storage) -> Result<&[u8], CheckpointError> {
        match &mut self.source {
            Source::Zip {
                archive,
                top,
                cache,
            } => {
                if cache.as_ref().map(|c| &c.0) != Some(&storage.key) {
                    *cache = None;
                    let name = format!("{top}/data/{}", storage.key);
                    let bytes = read_entry(archive, &name, MAX_STORAGE_BYTES)?;
                    *cache = Some((storage.key.clone(), bytes));
                }
                Ok(cache.as_ref().map_or(&[][..], |c| c.1.as_slice()))
            }
            Source::Legacy { map, ranges } => {
                let &(start, len) = ranges.get(&storage.key).ok_or_else(|| {
                    CheckpointError::Malformed(format!("storage `{}` is missing", storage.key))
                })?;
                map.get(start..start + len)
                    .ok_or_else(|| CheckpointError::Malformed("storage out of range".into()))
            }
        }
    }

    pub fn big_endian(&self) -> bool {
        self.big_endian
    }
}

fn read_entry(
    archive: &mut zip::ZipArchive<File>,
    name: &str,
    max: u64,
) -> Result<Vec<u8>, CheckpointError> {
    let mut entry = archive
        .by_name(name)
        .map_err(|e| CheckpointError::Malformed(format!("zip entry `{name}`: {e}")))?;
    let size = entry.size();
    if size > max {
        return Err(CheckpointError::Limit(format!(
            "zip entry `{name}` is {size} bytes, more than the {max} Hilum reads"
        )));
    }
    // The header's size is only a hint until the bytes are there.
    let mut buf = Vec::with_capacity(size.min(1 << 26) as usize);
    entry
        .by_ref()
        .take(max + 1)
        .read_to_end(&mut buf)
        .map_err(|e| CheckpointError::Malformed(format!("zip entry `{name}`: {e}")))?;
    if buf.len() as u64 > max {
        return Err(CheckpointError::Limit(format!(
            "zip entry `{name}` is larger than the {max} bytes Hilum reads"
        )));
    }
    Ok(buf)
}
