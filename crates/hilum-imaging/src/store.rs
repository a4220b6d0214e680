//! The content-addressed image store: sources by id, and a bounded cache of decoded images and
//! preprocessed variants, each computed once even when many tools ask at the same time.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::transform::prepare;
use crate::{
    decode_with, CxrImage, DecodeOptions, DeidOptions, ImagingError, Prepared, Preprocess, Voi,
};

#[derive(Clone, Debug)]
pub struct StoreLimits {
    /// Largest accepted file.
    pub max_file_bytes: u64,
    /// Largest accepted width x height, checked before pixels are allocated.
    pub max_pixels: u64,
    /// Budget for decoded images and variants kept in memory; least recently used go first
    /// (sources stay, so an evicted image is decoded again when asked for).
    pub cache_bytes: u64,
    /// Window applied to DICOM pixels at decode.
    pub voi: Voi,
}

impl Default for StoreLimits {
    fn default() -> Self {
        StoreLimits {
            max_file_bytes: 512 << 20,
            max_pixels: 100_000_000,
            cache_bytes: 1 << 30,
            voi: Voi::FromFile,
        }
    }
}

/// Something drawn over an image by `visualize`, put in the store by the tool that made it
/// (a segmentation mask, a class activation map). Values are row-major, `width * height`,
/// at any resolution (they are resampled onto the image).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Layer {
    /// Values in 0..=1; drawn where > 0.5.
    Mask {
        label: String,
        width: u32,
        height: u32,
        data: Vec<f32>,
    },
    /// Any values; normalised to the map's own min..max when drawn.
    Heatmap {
        label: String,
        width: u32,
        height: u32,
        data: Vec<f32>,
    },
}

impl Layer {
    pub fn label(&self) -> &str {
        match self {
            Layer::Mask { label, .. } | Layer::Heatmap { label, .. } => label,
        }
    }
}

/// Counters that show the cache doing its job.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct StoreStats {
    pub decodes: u64,
    pub variants_computed: u64,
    pub hits: u64,
    pub evictions: u64,
    pub cached_bytes: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum Key {
    Decoded(String),
    Variant(String, Preprocess),
}

#[derive(Clone)]
enum Cached {
    Image(Arc<CxrImage>),
    Prepared(Arc<Prepared>),
}

impl Cached {
    fn size(&self) -> u64 {
        match self {
            Cached::Image(i) => i.size_bytes() as u64,
            Cached::Prepared(p) => p.size_bytes() as u64,
        }
    }
}

type Slot = Arc<OnceLock<Result<Cached, ImagingError>>>;

struct CacheEntry {
    slot: Slot,
    last_used: u64,
    bytes: u64,
}

struct Source {
    bytes: Bytes,
    what: String,
}

#[derive(Default)]
struct Inner {
    sources: HashMap<String, Source>,
    layers: HashMap<String, (String, Arc<Layer>)>,
    cache: HashMap<Key, CacheEntry>,
    tick: u64,
    stats: StoreStats,
}

/// Content-addressed images: `img_` + the first 12 hex digits of the file's sha256.
/// Tools resolve image ids only through the store, never as paths.
pub struct ImageStore {
    limits: StoreLimits,
    inner: Mutex<Inner>,
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
            inner: Mutex::new(Inner::default()),
        }
    }

    pub fn limits(&self) -> &StoreLimits {
        &self.limits
    }

    pub fn id_for(bytes: &[u8]) -> String {
        let digest = Sha256::digest(bytes);
        let hex: String = digest.iter().take(6).map(|b| format!("{b:02x}")).collect();
        format!("img_{hex}")
    }

    /// Decodes and stores an image; the same bytes always get the same id. A file that does
    /// not decode is refused here, with the reason.
    pub fn ingest_bytes(&self, bytes: Bytes, what: &str) -> Result<String, ImagingError> {
        if bytes.len() as u64 > self.limits.max_file_bytes {
            return Err(ImagingError::FileTooLarge {
                what: what.to_string(),
                bytes: bytes.len() as u64,
                limit: self.limits.max_file_bytes,
            });
        }
        let id = Self::id_for(&bytes);
        let known = self.lock().sources.contains_key(&id);
        if !known {
            let src = bytes.clone();
            let what_owned = what.to_string();
            self.cached(
                Key::Decoded(id.clone()),
                |stats| {
                    stats.decodes += 1;
                },
                || self.decode_source(&src, &what_owned).map(Cached::Image),
            )?;
            self.lock().sources.insert(
                id.clone(),
                Source {
                    bytes,
                    what: what.to_string(),
                },
            );
        }
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

    /// The decoded image for an id (decoded again if the cache evicted it).
    pub fn get(&self, id: &str) -> Result<Arc<CxrImage>, ImagingError> {
        let (bytes, what) = self.source(id)?;
        match self.cached(
            Key::Decoded(id.to_string()),
            |s| s.decodes += 1,
            || self.decode_source(&bytes, &what).map(Cached::Image),
        )? {
            Cached::Image(img) => Ok(img),
            Cached::Prepared(_) => Err(ImagingError::UnknownId(id.to_string())),
        }
    }

    /// The image preprocessed by `recipe`, computed once per (image, recipe) and shared.
    pub fn prepared(&self, id: &str, recipe: &Preprocess) -> Result<Arc<Prepared>, ImagingError> {
        // Resolve the id first so an unknown id is an UnknownId error, not a transform error.
        self.source(id)?;
        match self.cached(
            Key::Variant(id.to_string(), *recipe),
            |s| s.variants_computed += 1,
            || {
                let img = self.get(id)?;
                prepare(&img, recipe).map(|p| Cached::Prepared(Arc::new(p)))
            },
        )? {
            Cached::Prepared(p) => Ok(p),
            Cached::Image(_) => Err(ImagingError::UnknownId(id.to_string())),
        }
    }

    /// The original file's bytes and the name it came with (for DICOM metadata and export).
    pub fn source(&self, id: &str) -> Result<(Bytes, String), ImagingError> {
        self.lock()
            .sources
            .get(id)
            .map(|s| (s.bytes.clone(), s.what.clone()))
            .ok_or_else(|| ImagingError::UnknownId(id.to_string()))
    }

    /// A de-identified copy of a DICOM source, ready to leave the machine.
    pub fn export_deidentified(
        &self,
        id: &str,
        opts: &DeidOptions,
    ) -> Result<Vec<u8>, ImagingError> {
        let (bytes, what) = self.source(id)?;
        crate::export_deidentified(&bytes, &what, opts).map(|(out, _)| out)
    }

    pub fn ids(&self) -> Vec<String> {
        let mut ids: Vec<String> = self.lock().sources.keys().cloned().collect();
        ids.sort();
        ids
    }

    /// Keeps a mask or heatmap drawn over image `image_id`; returns its id (`lyr_…`).
    pub fn put_layer(&self, image_id: &str, layer: Layer) -> Result<String, ImagingError> {
        self.source(image_id)?;
        let (w, h, n) = match &layer {
            Layer::Mask {
                width,
                height,
                data,
                ..
            }
            | Layer::Heatmap {
                width,
                height,
                data,
                ..
            } => (*width, *height, data.len()),
        };
        if w == 0 || h == 0 || n != w as usize * h as usize {
            return Err(ImagingError::InvalidTransform(format!(
                "layer `{}` has {n} values for {w}x{h}",
                layer.label()
            )));
        }
        let mut hasher = Sha256::new();
        hasher.update(image_id.as_bytes());
        hasher.update(serde_json::to_vec(&layer).unwrap_or_default());
        let hex: String = hasher
            .finalize()
            .iter()
            .take(6)
            .map(|b| format!("{b:02x}"))
            .collect();
        let id = format!("lyr_{hex}");
        self.lock()
            .layers
            .insert(id.clone(), (image_id.to_string(), Arc::new(layer)));
        Ok(id)
    }

    /// A layer and the image it belongs to.
    pub fn layer(&self, id: &str) -> Result<(String, Arc<Layer>), ImagingError> {
        self.lock()
            .layers
            .get(id)
            .cloned()
            .ok_or_else(|| ImagingError::UnknownId(id.to_string()))
    }

    /// Layer ids drawn over one image.
    pub fn layers_of(&self, image_id: &str) -> Vec<String> {
        let mut ids: Vec<String> = self
            .lock()
            .layers
            .iter()
            .filter(|(_, (img, _))| img == image_id)
            .map(|(id, _)| id.clone())
            .collect();
        ids.sort();
        ids
    }

    pub fn stats(&self) -> StoreStats {
        self.lock().stats
    }

    fn decode_source(&self, bytes: &[u8], what: &str) -> Result<Arc<CxrImage>, ImagingError> {
        let opts = DecodeOptions {
            max_pixels: self.limits.max_pixels,
            voi: self.limits.voi,
        };
        decode_with(bytes, what, &opts).map(Arc::new)
    }

    /// Compute-once cache: concurrent callers of one key share one `OnceLock`, so only the
    /// first runs `compute`; the others wait for its result.
    fn cached(
        &self,
        key: Key,
        count: impl FnOnce(&mut StoreStats),
        compute: impl FnOnce() -> Result<Cached, ImagingError>,
    ) -> Result<Cached, ImagingError> {
        let slot = {
            let mut inner = self.lock();
            inner.tick += 1;
            let tick = inner.tick;
            let hit = inner.cache.contains_key(&key);
            if hit {
                inner.stats.hits += 1;
            }
            let entry = inner
                .cache
                .entry(key.clone())
                .or_insert_with(|| CacheEntry {
                    slot: Arc::new(OnceLock::new()),
                    last_used: tick,
                    bytes: 0,
                });
            entry.last_used = tick;
            entry.slot.clone()
        };
        let mut ran = false;
        let result = slot
            .get_or_init(|| {
                ran = true;
                compute()
            })
            .clone();
        if ran {
            let mut inner = self.lock();
            count(&mut inner.stats);
            let same_slot = inner
                .cache
                .get(&key)
                .is_some_and(|e| Arc::ptr_eq(&e.slot, &slot));
            match &result {
                Ok(v) if same_slot => {
                    let size = v.size();
                    if let Some(e) = inner.cache.get_mut(&key) {
                        e.bytes = size;
                    }
                    inner.stats.cached_bytes += size;
                    self.evict(&mut inner, &key);
                }
                // Errors are not kept: the next call may succeed (e.g. after a new ingest).
                Err(_) if same_slot => {
                    inner.cache.remove(&key);
                }
                _ => {}
            }
        }
        result
    }

    /// Drops least recently used entries until the cache fits its budget (never `keep`).
    fn evict(&self, inner: &mut Inner, keep: &Key) {
        while inner.stats.cached_bytes > self.limits.cache_bytes {
            let victim = inner
                .cache
                .iter()
                .filter(|(k, e)| *k != keep && e.bytes > 0)
                .min_by_key(|(_, e)| e.last_used)
                .map(|(k, _)| k.clone());
            let Some(victim) = victim else { break };
            if let Some(e) = inner.cache.remove(&victim) {
                inner.stats.cached_bytes -= e.bytes;
                inner.stats.evictions += 1;
            }
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}
