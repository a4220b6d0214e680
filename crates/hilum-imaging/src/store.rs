use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use sha2::{Digest, Sha256};

use crate::{decode, CxrImage, ImagingError};

#[derive(Clone, Debug)]
pub struct StoreLimits {
    /// Largest accepted file.
    pub max_file_bytes: u64,
    /// Largest accepted width x height, checked before pixels are allocated.
    pub max_pixels: u64,
}

impl Default for StoreLimits {
    fn default() -> Self {
        StoreLimits {
            max_file_bytes: 512 << 20,
            max_pixels: 100_000_000,
        }
    }
}

struct Entry {
    decoded: Arc<CxrImage>,
}

/// Content-addressed images: `img_` + the first 12 hex digits of the file's sha256.
/// Tools resolve image ids only through the store, never as paths.
pub struct ImageStore {
    limits: StoreLimits,
    entries: Mutex<HashMap<String, Entry>>,
}

impl Default for ImageStore {
    fn default() -> Self {
        Self::new(StoreLimits::default())
    }
}

impl ImageStore {
    pub fn new(limits: StoreLimits) -> Self {
        ImageStore {
            limits,
            entries: Mutex::new(HashMap::new()),
        }
    }

    pub fn id_for(bytes: &[u8]) -> String {
        let digest = Sha256::digest(bytes);
        let hex: String = digest.iter().take(6).map(|b| format!("{b:02x}")).collect();
        format!("img_{hex}")
    }

    /// Decodes and stores an image; the same bytes always get the same id.
    pub fn ingest_bytes(&self, bytes: Bytes, what: &str) -> Result<String, ImagingError> {
        if bytes.len() as u64 > self.limits.max_file_bytes {
            return Err(ImagingError::FileTooLarge {
                what: what.to_string(),
                bytes: bytes.len() as u64,
                limit: self.limits.max_file_bytes,
            });
        }
        let id = Self::id_for(&bytes);
        if self.lock().contains_key(&id) {
            return Ok(id);
        }
        let decoded = Arc::new(decode(&bytes, what, self.limits.max_pixels)?);
        self.lock().insert(id.clone(), Entry { decoded });
        Ok(id)
    }

    pub fn ingest_file(&self, path: &Path) -> Result<String, ImagingError> {
        let what = path
            .file_name()
            .map(|n| n.to_string_lossy().to_string())
            .unwrap_or_else(|| "image".into());
        let meta = std::fs::metadata(path).map_err(|e| ImagingError::Io {
            path: path.display().to_string(),
            reason: e.to_string(),
        })?;
        if meta.len() > self.limits.max_file_bytes {
            return Err(ImagingError::FileTooLarge {
                what,
                bytes: meta.len(),
                limit: self.limits.max_file_bytes,
            });
        }
        let bytes = std::fs::read(path).map_err(|e| ImagingError::Io {
            path: path.display().to_string(),
            reason: e.to_string(),
        })?;
        self.ingest_bytes(Bytes::from(bytes), &what)
    }

    /// The decoded image for an id.
    pub fn get(&self, id: &str) -> Result<Arc<CxrImage>, ImagingError> {
        self.lock()
            .get(id)
            .map(|e| e.decoded.clone())
            .ok_or_else(|| ImagingError::UnknownId(id.to_string()))
    }

    pub fn ids(&self) -> Vec<String> {
        let mut ids: Vec<String> = self.lock().keys().cloned().collect();
        ids.sort();
        ids
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Entry>> {
        self.entries.lock().unwrap_or_else(|p| p.into_inner())
    }
}
