//! The content-addressed image store: sources by id, and a bounded cache of decoded images and
//! preprocessed variants, each computed once even when many tools ask at the same time.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::transform::prepare;
use crate::{
    decode_with, CxrImage, DecodeOptions, DeidOptions, ImagingError, Prepared, Preprocess, Voi,
};

/// What an [`ImageStore`] accepts and keeps.
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
        /// What it shows.
        label: String,
        /// Columns of `data`.
        width: u32,
        /// Rows of `data`.
        height: u32,
        /// `width * height` values, row-major.
        data: Vec<f32>,
    },
    /// Any values; normalised to the map's own min..max when drawn.
    Heatmap {
        /// What it shows.
        label: String,
        /// Columns of `data`.
        width: u32,
        /// Rows of `data`.
        height: u32,
        /// `width * height` values, row-major.
        data: Vec<f32>,
    },
}

impl Layer {
    /// The layer's label.
    pub fn label(&self) -> &str {
        match self {
            Layer::Mask { label, .. } | Layer::Heatmap { label, .. } => label,
        }
    }
}

/// Counters that show the cache doing its job.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct StoreStats {
    /// Files decoded.
    pub decodes: u64,
    /// Preprocessed variants computed.
    pub variants_computed: u64,
    /// Requests served from the cache.
    pub hits: u64,
    /// Entries dropped to stay within the budget.
    pub evictions: u64,
    /// Bytes held now.
    pub cached_bytes: u64,
    /// Images whose file is in memory (with a loader, evicted ones are not counted).
    pub resident_images: u64,
    /// Bytes of those files; with a loader they count against `cache_bytes` too.
    pub source_bytes: u64,
    /// Whole images dropped from memory (file and pixels), to be fetched again by the loader.
    pub images_evicted: u64,
    /// Evicted (or [`ImageStore::add_known`]) images brought back into memory.
    pub reloads: u64,
    /// Evicted pixels or variants asked for again while a caller still held them: handed out
    /// again (and counted against the budget again) instead of being computed a second time.
    pub reattached: u64,
}

/// Where a store gets back an image it evicted: the stored file of `id`, or `None` when
/// there is none (the caller does not own it). With one, whole images are evicted.
pub type ImageLoader = Arc<dyn Fn(&str) -> Result<Option<Bytes>, String> + Send + Sync>;

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

/// An evicted entry that callers may still hold.
enum Detached {
    Image(Weak<CxrImage>),
    Prepared(Weak<Prepared>),
}

impl Detached {
    fn of(c: &Cached) -> Self {
        match c {
            Cached::Image(i) => Detached::Image(Arc::downgrade(i)),
            Cached::Prepared(p) => Detached::Prepared(Arc::downgrade(p)),
        }
    }

    fn upgrade(&self) -> Option<Cached> {
        match self {
            Detached::Image(w) => w.upgrade().map(Cached::Image),
            Detached::Prepared(w) => w.upgrade().map(Cached::Prepared),
        }
    }

    fn alive(&self) -> bool {
        match self {
            Detached::Image(w) => w.strong_count() > 0,
            Detached::Prepared(w) => w.strong_count() > 0,
        }
    }
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
    last_used: u64,
}

#[derive(Default)]
struct Inner {
    sources: HashMap<String, Source>,
    layers: HashMap<String, (String, Arc<Layer>)>,
    cache: HashMap<Key, CacheEntry>,
    /// Ids evicted with a loader: still this store's, fetched again on use.
    evicted: std::collections::BTreeSet<String>,
    /// Entries evicted while callers (tools still running) held them. Asking for one again
    /// hands out the same pixels: many concurrent calls on an image the budget cannot keep
    /// then share one copy instead of decoding one each, so memory stays near the budget plus
    /// the images actually in use.
    detached: HashMap<Key, Detached>,
    tick: u64,
    stats: StoreStats,
}

/// Content-addressed images: `img_` + the first 12 hex digits of the file's sha256.
/// Tools resolve image ids only through the store, never as paths.
pub struct ImageStore {
    limits: StoreLimits,
    loader: Option<ImageLoader>,
    inner: Mutex<Inner>,
}

impl Default for ImageStore {
    fn default() -> Self {
        Self::new(StoreLimits::default())
    }
}

impl ImageStore {
    /// An empty store with these limits.
    pub fn new(limits: StoreLimits) -> Self {
        ImageStore {
            limits,
            loader: None,
            inner: Mutex::new(Inner::default()),
        }
    }

    /// A store whose whole images (file, pixels, variants) share `limits.cache_bytes`:
    /// least recently used ones are dropped and fetched again through `loader` when named.
    /// Ids are content hashes, so a reloaded image has its old id and pixels.
    pub fn with_loader(limits: StoreLimits, loader: ImageLoader) -> Self {
        ImageStore {
            limits,
            loader: Some(loader),
            inner: Mutex::new(Inner::default()),
        }
    }

    /// Ids the loader can fetch, listed by [`Self::ids`] before their first use (a server's
    /// stored images after a restart). Without a loader this does nothing.
    pub fn add_known(&self, ids: impl IntoIterator<Item = String>) {
        if self.loader.is_none() {
            return;
        }
        let mut inner = self.lock();
        for id in ids {
            if !inner.sources.contains_key(&id) {
                inner.evicted.insert(id);
            }
        }
    }

    /// Whether the image's file is in memory now (not evicted, not unknown).
    pub fn is_resident(&self, id: &str) -> bool {
        self.lock().sources.contains_key(id)
    }

    /// Its limits.
    pub fn limits(&self) -> &StoreLimits {
        &self.limits
    }

    /// The id the store gives these bytes (`img_` and a hash prefix).
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
            let mut inner = self.lock();
            self.insert_source(&mut inner, &id, bytes, what);
            self.evict(&mut inner, &Key::Decoded(id.clone()));
        }
        Ok(id)
    }

    /// Reads, decodes and stores a file; errors name the file, never its path in logs.
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

    /// The original file's bytes and the name it came with (for DICOM metadata and export);
    /// an evicted image is fetched again through the loader.
    pub fn source(&self, id: &str) -> Result<(Bytes, String), ImagingError> {
        {
            let mut inner = self.lock();
            inner.tick += 1;
            let tick = inner.tick;
            if let Some(s) = inner.sources.get_mut(id) {
                s.last_used = tick;
                return Ok((s.bytes.clone(), s.what.clone()));
            }
        }
        self.reload(id)
    }

    /// Fetches an image that is not in memory from the loader (outside the lock: it may be
    /// slow). Bytes whose hash is not the id are refused, so a reload cannot change pixels.
    fn reload(&self, id: &str) -> Result<(Bytes, String), ImagingError> {
        let unknown = || ImagingError::UnknownId(id.to_string());
        let Some(loader) = &self.loader else {
            return Err(unknown());
        };
        if !id.starts_with("img_") {
            return Err(unknown());
        }
        let bytes = match loader(id) {
            Ok(Some(b)) => b,
            Ok(None) => return Err(unknown()),
            Err(reason) => {
                return Err(ImagingError::Io {
                    path: id.to_string(),
                    reason: format!("cannot fetch the stored image: {reason}"),
                })
            }
        };
        if Self::id_for(&bytes) != id {
            return Err(ImagingError::Io {
                path: id.to_string(),
                reason: "the stored image's bytes do not match its id".into(),
            });
        }
        let what = "stored image";
        let mut inner = self.lock();
        if !inner.sources.contains_key(id) {
            self.insert_source(&mut inner, id, bytes.clone(), what);
            // Keep what is being asked for; make room among the rest.
            self.evict(&mut inner, &Key::Decoded(id.to_string()));
        }
        Ok((bytes, what.to_string()))
    }

    fn insert_source(&self, inner: &mut Inner, id: &str, bytes: Bytes, what: &str) {
        inner.tick += 1;
        let last_used = inner.tick;
        inner.stats.source_bytes += bytes.len() as u64;
        inner.stats.resident_images += 1;
        if inner.evicted.remove(id) {
            inner.stats.reloads += 1;
        }
        let old = inner.sources.insert(
            id.to_string(),
            Source {
                bytes,
                what: what.to_string(),
                last_used,
            },
        );
        if let Some(old) = old {
            inner.stats.source_bytes -= old.bytes.len() as u64;
            inner.stats.resident_images -= 1;
        }
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

    /// The store's image ids, evicted ones included.
    pub fn ids(&self) -> Vec<String> {
        let inner = self.lock();
        let mut ids: Vec<String> = inner
            .sources
            .keys()
            .chain(inner.evicted.iter())
            .cloned()
            .collect();
        ids.sort();
        ids.dedup();
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

    /// The cache's counters.
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
            } else if let Some(held) = inner.detached.remove(&key).and_then(|d| d.upgrade()) {
                let size = held.size();
                let slot: Slot = Arc::new(OnceLock::new());
                let _ = slot.set(Ok(held.clone()));
                inner.cache.insert(
                    key.clone(),
                    CacheEntry {
                        slot,
                        last_used: tick,
                        bytes: size,
                    },
                );
                inner.stats.reattached += 1;
                inner.stats.cached_bytes += size;
                self.evict(&mut inner, &key);
                return Ok(held);
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

    /// Bytes held against `cache_bytes`: decoded pixels and variants, and with a loader the
    /// files too.
    fn held(&self, inner: &Inner) -> u64 {
        let files = if self.loader.is_some() {
            inner.stats.source_bytes
        } else {
            0
        };
        inner.stats.cached_bytes + files
    }

    /// Drops least recently used entries until the store fits its budget (never `keep`).
    /// With a loader the unit is the whole image (file, pixels, variants; never `keep`'s),
    /// last used when any part of it was. Callers holding an `Arc` of an evicted image keep
    /// it alive until they drop it.
    fn evict(&self, inner: &mut Inner, keep: &Key) {
        let keep_id = match keep {
            Key::Decoded(id) | Key::Variant(id, _) => id.clone(),
        };
        while self.held(inner) > self.limits.cache_bytes {
            if self.loader.is_some() {
                if let Some(id) = Self::lru_image(inner, &keep_id) {
                    self.evict_image(inner, &id);
                    continue;
                }
            }
            let victim = inner
                .cache
                .iter()
                .filter(|(k, e)| *k != keep && e.bytes > 0)
                .min_by_key(|(_, e)| e.last_used)
                .map(|(k, _)| k.clone());
            let Some(victim) = victim else { break };
            Self::remove_entry(inner, &victim);
        }
        inner.detached.retain(|_, d| d.alive());
    }

    /// Drops a cache entry, remembering it as detached for callers that still hold it.
    fn remove_entry(inner: &mut Inner, key: &Key) {
        if let Some(e) = inner.cache.remove(key) {
            inner.stats.cached_bytes -= e.bytes;
            inner.stats.evictions += 1;
            if let Some(Ok(v)) = e.slot.get() {
                inner.detached.insert(key.clone(), Detached::of(v));
            }
        }
    }

    /// The resident image, other than `keep`, whose last use is the oldest.
    fn lru_image(inner: &Inner, keep: &str) -> Option<String> {
        let mut last: HashMap<&str, u64> = inner
            .sources
            .iter()
            .filter(|(id, _)| id.as_str() != keep)
            .map(|(id, s)| (id.as_str(), s.last_used))
            .collect();
        for (k, e) in &inner.cache {
            let (Key::Decoded(id) | Key::Variant(id, _)) = k;
            if let Some(t) = last.get_mut(id.as_str()) {
                *t = (*t).max(e.last_used);
            }
        }
        last.into_iter()
            .min_by_key(|(_, t)| *t)
            .map(|(id, _)| id.to_string())
    }

    fn evict_image(&self, inner: &mut Inner, id: &str) {
        if let Some(s) = inner.sources.remove(id) {
            inner.stats.source_bytes -= s.bytes.len() as u64;
            inner.stats.resident_images -= 1;
            inner.stats.images_evicted += 1;
            inner.evicted.insert(id.to_string());
        }
        let keys: Vec<Key> = inner
            .cache
            .keys()
            .filter(|k| matches!(k, Key::Decoded(i) | Key::Variant(i, _) if i == id))
            .cloned()
            .collect();
        for k in keys {
            Self::remove_entry(inner, &k);
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}
