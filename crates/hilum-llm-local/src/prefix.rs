//! The KV state of a prompt's fixed start — the system prompt and the tool specifications — kept
//! across questions, so a question does not pay again for the ~900 tokens every question shares:
//! in memory for a process that answers many (`hilum serve`, `hilum eval`), and in a folder the
//! caller names for processes that answer one each (the CLI).
//!
//! A state is reused only for the same model file (its sha256) and exactly the same prefix
//! tokens. On disk each state is one file holding both, checked in full on load, with a sha256
//! of its data; anything that does not match is ignored (and logged), never half used.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::UNIX_EPOCH;

use sha2::{Digest, Sha256};

/// Shortest prefix worth keeping (below this the prefill is cheaper than the bookkeeping).
pub(crate) const MIN_PREFIX_TOKENS: usize = 64;
/// States kept in memory (a few tool sets or system prompts in one process), oldest dropped.
const MEMORY_ENTRIES: usize = 4;
const MAGIC: &[u8; 8] = b"HILUMKV1";

/// Keys and values of the first `tokens.len()` positions of every layer, position-major rows of
/// `kvd` floats, exactly as the decoder's cache holds them.
#[derive(Debug, PartialEq)]
pub struct KvSnapshot {
    pub tokens: Vec<u32>,
    pub kvd: usize,
    pub k: Vec<Vec<f32>>,
    pub v: Vec<Vec<f32>>,
}

impl KvSnapshot {
    fn well_formed(&self) -> bool {
        let n = self.tokens.len() * self.kvd;
        self.k.len() == self.v.len() && self.k.iter().chain(&self.v).all(|l| l.len() == n)
    }
}

/// Where a restored prefix came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PrefixSource {
    /// This process's memory, from an earlier request.
    Memory,
    /// The prefix cache folder, saved by an earlier process.
    Disk,
}

pub(crate) struct PrefixCache {
    model: PathBuf,
    dir: Option<PathBuf>,
    sha: OnceLock<Option<String>>,
    memory: Mutex<Vec<Arc<KvSnapshot>>>,
}

impl PrefixCache {
    pub(crate) fn new(model: PathBuf, dir: Option<PathBuf>) -> Self {
        PrefixCache {
            model,
            dir,
            sha: OnceLock::new(),
            memory: Mutex::new(Vec::new()),
        }
    }

    /// The model file's sha256 (hex), computed once; `None` when the file cannot be read.
    fn model_sha(&self) -> Option<&str> {
        self.sha
            .get_or_init(|| match model_sha256(&self.model, self.dir.as_deref()) {
                Ok(s) => Some(s),
                Err(e) => {
                    tracing::warn!(
                        "prefix cache off: cannot hash {}: {e}",
                        self.model.display()
                    );
                    None
                }
            })
            .as_deref()
    }

    /// Whether the state of exactly `tokens` is in memory.
    pub(crate) fn holds(&self, tokens: &[u32]) -> bool {
        self.memory
            .lock()
            .is_ok_and(|m| m.iter().any(|s| s.tokens == tokens))
    }

    /// The state of exactly `tokens` with `n_layer` layers of `kvd`-wide rows: from memory, else
    /// from the cache folder (then kept in memory too).
    pub(crate) fn get(
        &self,
        tokens: &[u32],
        n_layer: usize,
        kvd: usize,
    ) -> Option<(Arc<KvSnapshot>, PrefixSource)> {
        if let Ok(mem) = self.memory.lock() {
            if let Some(s) = mem.iter().find(|s| s.tokens == tokens) {
                return Some((s.clone(), PrefixSource::Memory));
            }
        }
        let dir = self.dir.as_deref()?;
        let sha = self.model_sha()?;
        let path = dir.join(file_name(sha, tokens));
        let snap = match read_snapshot(&path, sha, tokens) {
            Ok(Some(s)) if s.k.len() == n_layer && s.kvd == kvd => s,
            Ok(Some(_)) => {
                tracing::warn!(
                    "{}: other layer sizes than this model; ignored",
                    path.display()
                );
                return None;
            }
            Ok(None) => return None,
            Err(e) => {
                tracing::warn!(
                    "{}: unusable prefix cache file ({e}); ignored",
                    path.display()
                );
                return None;
            }
        };
        let snap = Arc::new(snap);
        self.remember(snap.clone());
        Some((snap, PrefixSource::Disk))
    }

    /// Keeps `snap` in memory and, with a cache folder, on disk.
    pub(crate) fn put(&self, snap: KvSnapshot) {
        if !snap.well_formed() {
            return;
        }
        let snap = Arc::new(snap);
        self.remember(snap.clone());
        let (Some(dir), Some(sha)) = (self.dir.as_deref(), self.model_sha()) else {
            return;
        };
        let path = dir.join(file_name(sha, &snap.tokens));
        if path.is_file() {
            return;
        }
        if let Err(e) = write_snapshot(dir, &path, sha, &snap) {
            tracing::warn!("cannot save the prompt prefix to {}: {e}", path.display());
        }
    }

    pub(crate) fn forget_memory(&self) {
        if let Ok(mut mem) = self.memory.lock() {
            mem.clear();
        }
    }

    fn remember(&self, snap: Arc<KvSnapshot>) {
        if let Ok(mut mem) = self.memory.lock() {
            mem.retain(|s| s.tokens != snap.tokens);
            if mem.len() >= MEMORY_ENTRIES {
                mem.remove(0);
            }
            mem.push(snap);
        }
    }
}

/// `<16 hex of sha256(model sha, tokens)>.kv`: one file per model and prefix (the file itself
/// holds the full key).
fn file_name(model_sha: &str, tokens: &[u32]) -> String {
    let mut h = Sha256::new();
    h.update(model_sha.as_bytes());
    for t in tokens {
        h.update(t.to_le_bytes());
    }
    format!("{}.kv", &hex(&h.finalize())[..16])
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The sha256 of the model file. With a cache folder, the digest is remembered there beside the
/// file's length and modification time and recomputed when either changes (hashing 0.5 GB
/// costs about a second of a 2-core machine on every CLI run otherwise).
pub(crate) fn model_sha256(model: &Path, dir: Option<&Path>) -> std::io::Result<String> {
    let meta = std::fs::metadata(model)?;
    let mtime = meta
        .modified()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_nanos());
    let canonical = std::fs::canonicalize(model)?;
    let stamp_key = format!("{} {} {mtime}", canonical.display(), meta.len());
    let stamp = dir.map(|d| {
        let mut h = Sha256::new();
        h.update(stamp_key.as_bytes());
        d.join(format!("model-{}.sha256", &hex(&h.finalize())[..16]))
    });
    if let Some(text) = stamp.as_ref().and_then(|p| std::fs::read_to_string(p).ok()) {
        if let Some((key, sha)) = text.trim_end().rsplit_once('\n') {
            if key == stamp_key && sha.len() == 64 && sha.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Ok(sha.to_string());
            }
        }
    }
    let mut f = std::fs::File::open(model)?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    let sha = hex(&h.finalize());
    if let (Some(p), Some(d)) = (stamp, dir) {
        let text = format!("{stamp_key}\n{sha}\n");
        if let Err(e) =
            std::fs::create_dir_all(d).and_then(|_| atomic_write(d, &p, text.as_bytes()))
        {
            tracing::debug!("cannot remember the model digest in {}: {e}", p.display());
        }
    }
    Ok(sha)
}

/// Writes `bytes` to a temporary file in `dir` and renames it to `path`, so a reader sees the
/// whole file or none.
fn atomic_write(dir: &Path, path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let tmp = dir.join(format!(
        ".{}.{}.tmp",
        path.file_name()
            .map_or_else(String::new, |n| n.to_string_lossy().into_owned()),
        std::process::id()
    ));
    let mut f = std::fs::File::create(&tmp)?;
    // No fsync: a file cut short by a crash fails its checksum and is ignored.
    f.write_all(bytes)?;
    drop(f);
    std::fs::rename(&tmp, path).inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}

/// Layout (little-endian): magic, model sha (64 hex bytes), n_tokens u64, n_layer u64, kvd u64,
/// tokens (u32 each), then per layer its keys and its values (f32 each), then the sha256 of
/// everything before it.
fn encode(model_sha: &str, snap: &KvSnapshot) -> Vec<u8> {
    let floats = 2 * snap.k.len() * snap.tokens.len() * snap.kvd;
    let mut out = Vec::with_capacity(8 + 64 + 24 + 4 * snap.tokens.len() + 4 * floats + 32);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(model_sha.as_bytes());
    for n in [snap.tokens.len(), snap.k.len(), snap.kvd] {
        out.extend_from_slice(&(n as u64).to_le_bytes());
    }
    for t in &snap.tokens {
        out.extend_from_slice(&t.to_le_bytes());
    }
    for (k, v) in snap.k.iter().zip(&snap.v) {
        for x in k.iter().chain(v) {
            out.extend_from_slice(&x.to_le_bytes());
        }
    }
    let digest = Sha256::digest(&out);
    out.extend_from_slice(&digest);
    out
}

fn write_snapshot(
    dir: &Path,
    path: &Path,
    model_sha: &str,
    snap: &KvSnapshot,
) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    atomic_write(dir, path, &encode(model_sha, snap))
}

/// The snapshot in `path` if it is for `model_sha` and exactly `tokens`; `Ok(None)` when there
/// is no such file; an error when the file is there but damaged.
fn read_snapshot(
    path: &Path,
    model_sha: &str,
    tokens: &[u32],
) -> Result<Option<KvSnapshot>, String> {
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e.to_string()),
    };
    decode(&bytes, model_sha, tokens)
}

fn decode(bytes: &[u8], model_sha: &str, tokens: &[u32]) -> Result<Option<KvSnapshot>, String> {
    const HEAD: usize = 8 + 64 + 24;
    if bytes.len() < HEAD + 32 || &bytes[..8] != MAGIC {
        return Err("not a Hilum prefix cache file".into());
    }
    let (body, digest) = bytes.split_at(bytes.len() - 32);
    if Sha256::digest(body).as_slice() != digest {
        return Err("its checksum does not match (a damaged or partly written file)".into());
    }
    if &body[8..72] != model_sha.as_bytes() {
        return Ok(None);
    }
    let num = |at: usize| {
        let mut b = [0u8; 8];
        b.copy_from_slice(&body[at..at + 8]);
        usize::try_from(u64::from_le_bytes(b)).map_err(|e| e.to_string())
    };
    let (n_tok, n_layer, kvd) = (num(72)?, num(80)?, num(88)?);
    if n_tok != tokens.len() {
        return Ok(None);
    }
    let floats = n_tok
        .checked_mul(kvd)
        .and_then(|x| x.checked_mul(2 * n_layer))
        .ok_or("sizes overflow")?;
    if body.len() != HEAD + 4 * n_tok + 4 * floats {
        return Err("its length does not match its header".into());
    }
    let mut at = HEAD;
    let mut word = || {
        let w = [body[at], body[at + 1], body[at + 2], body[at + 3]];
        at += 4;
        w
    };
    if !tokens.iter().all(|&t| u32::from_le_bytes(word()) == t) {
        return Ok(None);
    }
    let row = n_tok * kvd;
    let mut k = Vec::with_capacity(n_layer);
    let mut v = Vec::with_capacity(n_layer);
    for _ in 0..n_layer {
        k.push((0..row).map(|_| f32::from_le_bytes(word())).collect());
        v.push((0..row).map(|_| f32::from_le_bytes(word())).collect());
    }
    Ok(Some(KvSnapshot {
        tokens: tokens.to_vec(),
        kvd,
        k,
        v,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snapshot(tokens: &[u32], seed: f32) -> KvSnapshot {
        let (n_layer, kvd) = (3, 4);
        let layer = |l: usize, s: f32| -> Vec<f32> {
            (0..tokens.len() * kvd)
                .map(|i| s + l as f32 * 0.5 + i as f32 * 0.25)
                .collect()
        };
        KvSnapshot {
            tokens: tokens.to_vec(),
            kvd,
            k: (0..n_layer).map(|l| layer(l, seed)).collect(),
            v: (0..n_layer).map(|l| layer(l, -seed)).collect(),
        }
    }

    fn model_file(dir: &Path, name: &str, content: &[u8]) -> PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, content).unwrap();
        p
    }

    #[test]
    fn a_saved_prefix_is_reused_only_for_the_same_model_and_tokens() {
        let tmp = tempfile::tempdir().unwrap();
        let cache = tmp.path().join("kv");
        let a = model_file(tmp.path(), "a.gguf", b"model a weights");
        let b = model_file(tmp.path(), "b.gguf", b"model b weights");
        let prefix: Vec<u32> = (0..100).collect();

        PrefixCache::new(a.clone(), Some(cache.clone())).put(snapshot(&prefix, 1.0));

        // A new process with the same model and prefix gets the very same floats.
        let (got, from) = PrefixCache::new(a.clone(), Some(cache.clone()))
            .get(&prefix, 3, 4)
            .expect("reused");
        assert_eq!(from, PrefixSource::Disk);
        assert_eq!(*got, snapshot(&prefix, 1.0));

        // Another model, another prefix (one token changed, one token more or less): no reuse.
        assert!(PrefixCache::new(b, Some(cache.clone()))
            .get(&prefix, 3, 4)
            .is_none());
        let fresh = PrefixCache::new(a.clone(), Some(cache.clone()));
        let mut changed = prefix.clone();
        changed[57] = 999;
        assert!(fresh.get(&changed, 3, 4).is_none());
        assert!(fresh.get(&prefix[..99], 3, 4).is_none());
        let longer: Vec<u32> = (0..101).collect();
        assert!(fresh.get(&longer, 3, 4).is_none());
        // A decoder with other layer sizes does not take it either.
        assert!(fresh.get(&prefix, 2, 4).is_none());
        assert!(fresh.get(&prefix, 3, 8).is_none());
    }

    #[test]
    fn a_model_file_changed_in_place_does_not_reuse_the_old_prefix() {
        let tmp = tempfile::tempdir().unwrap();
        let cache = tmp.path().join("kv");
        let a = model_file(tmp.path(), "a.gguf", b"model a weights");
        let prefix: Vec<u32> = (0..80).collect();
        PrefixCache::new(a.clone(), Some(cache.clone())).put(snapshot(&prefix, 2.0));
        // Same path, other content (and length): the digest is recomputed, the old state unused.
        std::fs::write(&a, b"model a weights, retrained").unwrap();
        assert!(PrefixCache::new(a, Some(cache))
            .get(&prefix, 3, 4)
            .is_none());
    }

    #[test]
    fn a_damaged_cache_file_is_ignored() {
        let tmp = tempfile::tempdir().unwrap();
        let cache = tmp.path().join("kv");
        let a = model_file(tmp.path(), "a.gguf", b"model a weights");
        let prefix: Vec<u32> = (0..70).collect();
        PrefixCache::new(a.clone(), Some(cache.clone())).put(snapshot(&prefix, 3.0));
        let file = std::fs::read_dir(&cache)
            .unwrap()
            .map(|e| e.unwrap().path())
            .find(|p| p.extension().is_some_and(|e| e == "kv"))
            .expect("a .kv file");
        let mut bytes = std::fs::read(&file).unwrap();
        let mid = bytes.len() / 2;
        bytes[mid] ^= 1;
        std::fs::write(&file, &bytes).unwrap();
        assert!(PrefixCache::new(a.clone(), Some(cache.clone()))
            .get(&prefix, 3, 4)
            .is_none());
        bytes.truncate(mid);
        std::fs::write(&file, &bytes).unwrap();
        assert!(PrefixCache::new(a, Some(cache))
            .get(&prefix, 3, 4)
            .is_none());
    }

    #[test]
    fn memory_keeps_the_latest_prefixes_without_a_folder() {
        let tmp = tempfile::tempdir().unwrap();
        let a = model_file(tmp.path(), "a.gguf", b"model a weights");
        let cache = PrefixCache::new(a, None);
        let prefixes: Vec<Vec<u32>> = (0..=MEMORY_ENTRIES as u32)
            .map(|i| (i..i + 70).collect())
            .collect();
        for (i, p) in prefixes.iter().enumerate() {
            cache.put(snapshot(p, i as f32));
        }
        // The oldest made room; the others come back from memory.
        assert!(cache.get(&prefixes[0], 3, 4).is_none());
        for (i, p) in prefixes.iter().enumerate().skip(1) {
            let (got, from) = cache.get(p, 3, 4).expect("in memory");
            assert_eq!(from, PrefixSource::Memory);
            assert_eq!(*got, snapshot(p, i as f32));
        }
    }
}
