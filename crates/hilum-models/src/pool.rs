//! The model pool: loads each (model, device, backend, type) once, on first use, keeps it warm,
//! and hands out per-device permits so concurrent tool calls never oversubscribe a device.

use std::any::{Any, TypeId};
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::{Backend, Device, InstalledModel, Manifest, ModelError, ModelRegistry, ModelSettings};

/// A network the pool can load from an installed model, on a device and a backend (a type
/// that supports only some backends says so with [`Backend::expect`]), with the pool's
/// settings (CPU threads, quantization).
pub trait Model: Send + Sync + Sized + 'static {
    fn load(
        manifest: &Manifest,
        installed: &InstalledModel,
        device: Device,
        backend: Backend,
        settings: &ModelSettings,
    ) -> Result<Self, ModelError>;
}

type Key = (String, Device, Backend, TypeId);
type Slot = Arc<Mutex<Option<(Arc<dyn Any + Send + Sync>, Duration)>>>;

pub struct ModelPool {
    registry: Arc<ModelRegistry>,
    settings: ModelSettings,
    slots: Mutex<HashMap<Key, Slot>>,
    permits: Mutex<HashMap<Device, Arc<Semaphore>>>,
    /// Loads done per (model id, device): the proof that one pool serves the process.
    loads: Mutex<BTreeMap<(String, String), u64>>,
}

impl ModelPool {
    /// A pool over `registry` with the default settings (all cores, one pass per GPU).
    pub fn new(registry: Arc<ModelRegistry>) -> Self {
        Self::with_settings(registry, ModelSettings::default())
    }

    /// A pool over `registry` whose models load with `settings` (its `models_dir` is not
    /// used: the registry has its own).
    pub fn with_settings(registry: Arc<ModelRegistry>, settings: ModelSettings) -> Self {
        ModelPool {
            registry,
            settings,
            slots: Mutex::new(HashMap::new()),
            permits: Mutex::new(HashMap::new()),
            loads: Mutex::new(BTreeMap::new()),
        }
    }

    /// A pool over the built-in manifests in `settings.models_dir`. Never fails: a broken
    /// built-in manifest (a bug caught by the registry's tests) leaves a pool that knows no
    /// models.
    pub fn from_settings(settings: ModelSettings) -> Self {
        let registry = ModelRegistry::new(&settings.models_dir)
            .unwrap_or_else(|_| ModelRegistry::empty(&settings.models_dir));
        Self::with_settings(Arc::new(registry), settings)
    }

    /// The settings models load with.
    pub fn settings(&self) -> &ModelSettings {
        &self.settings
    }

    pub fn registry(&self) -> &ModelRegistry {
        &self.registry
    }

    /// The warm model, loading it first if needed. Blocking (reads and maps weights): call it
    /// from `spawn_blocking`. Concurrent callers of the same model wait for one load.
    pub fn get_or_load<M: Model>(
        &self,
        id: &str,
        device: Device,
        backend: Backend,
    ) -> Result<Arc<M>, ModelError> {
        let slot = {
            let mut slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
            slots
                .entry((id.to_string(), device, backend, TypeId::of::<M>()))
                .or_default()
                .clone()
        };
        let mut guard = slot.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((any, _)) = guard.as_ref() {
            if let Ok(m) = any.clone().downcast::<M>() {
                return Ok(m);
            }
        }
        let manifest = self.registry.manifest(id)?;
        let installed = self.registry.installed(id)?;
        let t0 = Instant::now();
        let model = Arc::new(M::load(
            manifest,
            &installed,
            device,
            backend,
            &self.settings,
        )?);
        *guard = Some((model.clone(), t0.elapsed()));
        *self
            .loads
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry((id.to_string(), device.to_string()))
            .or_default() += 1;
        Ok(model)
    }

    /// How many times each (model id, device) was loaded since the pool was made.
    pub fn load_counts(&self) -> BTreeMap<(String, String), u64> {
        self.loads.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// How many times `id` was actually loaded (any device, backend or type): a second caller
    /// of a warm model does not count, a load after [`ModelPool::evict`] does.
    pub fn load_count(&self, id: &str) -> usize {
        let loads = self.loads.lock().unwrap_or_else(|p| p.into_inner());
        loads
            .iter()
            .filter(|((m, _), _)| m == id)
            .map(|(_, n)| *n as usize)
            .sum()
    }

    /// How long the warm copy took to load, if it is loaded.
    pub fn load_time<M: Model>(
        &self,
        id: &str,
        device: Device,
        backend: Backend,
    ) -> Option<Duration> {
        let slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        let slot = slots
            .get(&(id.to_string(), device, backend, TypeId::of::<M>()))?
            .clone();
        drop(slots);
        let g = slot.lock().unwrap_or_else(|p| p.into_inner());
        g.as_ref().map(|(_, d)| *d)
    }

    /// Drops every warm copy of `id` (e.g. after a re-import).
    pub fn evict(&self, id: &str) {
        let mut slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        slots.retain(|(k, _, _, _), _| k != id);
    }

    /// A permit to run work on `device`; hold it for the duration of the forward pass.
    pub async fn acquire(&self, device: Device) -> Result<OwnedSemaphorePermit, ModelError> {
        self.semaphore(device)
            .acquire_owned()
            .await
            .map_err(|_| ModelError::Device {
                device: device.to_string(),
                reason: "the device queue was closed (Hilum is shutting down)".into(),
            })
    }

    /// How many forward passes may run at once on `device` (see
    /// [`ModelSettings::concurrency`]).
    pub fn concurrency(&self, device: Device) -> usize {
        self.settings.concurrency(device)
    }

    fn semaphore(&self, device: Device) -> Arc<Semaphore> {
        let mut p = self.permits.lock().unwrap_or_else(|p| p.into_inner());
        p.entry(device)
            .or_insert_with(|| Arc::new(Semaphore::new(self.concurrency(device))))
            .clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    struct Counting;
    impl Model for Counting {
        fn load(
            _: &Manifest,
            _: &InstalledModel,
            _: Device,
            _: Backend,
            _: &ModelSettings,
        ) -> Result<Self, ModelError> {
            std::thread::sleep(Duration::from_millis(20));
            Ok(Counting)
        }
    }

    fn fake_install(reg: &ModelRegistry) {
        let dir = reg.model_dir("lung-unet");
        std::fs::create_dir_all(&dir).expect("mkdir");
        std::fs::write(dir.join("model.safetensors"), b"x").expect("write");
        let rec = crate::InstallRecord {
            id: "lung-unet".into(),
            sha256: "0".repeat(64),
            source_sha256: "0".repeat(64),
            source: "test".into(),
            custom: false,
            installed_at: 0,
            hilum_version: "test".into(),
            onnx_sha256: None,
        };
        std::fs::write(
            dir.join("install.toml"),
            toml::to_string(&rec).expect("toml"),
        )
        .expect("write");
    }

    #[test]
    fn loads_once_and_keeps_warm_under_concurrency() {
        let dir = tempfile::tempdir().expect("tempdir");
        let reg = ModelRegistry::new(dir.path()).expect("registry");
        fake_install(&reg);
        let pool = Arc::new(ModelPool::new(Arc::new(reg)));
        let handles: Vec<_> = (0..4)
            .map(|_| {
                let pool = pool.clone();
                std::thread::spawn(move || {
                    pool.get_or_load::<Counting>("lung-unet", Device::Cpu, Backend::Native)
                })
            })
            .collect();
        let models: Vec<_> = handles
            .into_iter()
            .map(|h| h.join().expect("thread").expect("load"))
            .collect();
        assert_eq!(pool.load_count("lung-unet"), 1);
        assert_eq!(
            pool.load_counts()
                .get(&("lung-unet".to_string(), "cpu".to_string())),
            Some(&1)
        );
        assert!(Arc::ptr_eq(&models[0], &models[3]));
        assert!(pool
            .load_time::<Counting>("lung-unet", Device::Cpu, Backend::Native)
            .is_some());
        pool.evict("lung-unet");
        assert!(pool
            .load_time::<Counting>("lung-unet", Device::Cpu, Backend::Native)
            .is_none());
        pool.get_or_load::<Counting>("lung-unet", Device::Cpu, Backend::Native)
            .expect("reload");
        assert_eq!(pool.load_count("lung-unet"), 2);
    }

    #[test]
    fn each_backend_is_its_own_warm_copy() {
        let dir = tempfile::tempdir().expect("tempdir");
        let reg = ModelRegistry::new(dir.path()).expect("registry");
        fake_install(&reg);
        let pool = ModelPool::new(Arc::new(reg));
        let get = |b| pool.get_or_load::<Counting>("lung-unet", Device::Cpu, b);
        let native = get(Backend::Native).expect("native");
        let onnx = get(Backend::Onnx).expect("onnx");
        assert!(!Arc::ptr_eq(&native, &onnx));
        assert!(Arc::ptr_eq(&native, &get(Backend::Native).expect("again")));
        assert_eq!(pool.load_count("lung-unet"), 2);
        assert_eq!(pool.load_count("chestx-det-pspnet"), 0);
    }

    #[test]
    fn absent_model_is_an_error_not_a_load() {
        let dir = tempfile::tempdir().expect("tempdir");
        let pool = ModelPool::new(Arc::new(ModelRegistry::new(dir.path()).expect("registry")));
        let err = pool
            .get_or_load::<Counting>("lung-unet", Device::Cpu, Backend::Native)
            .err();
        assert!(
            matches!(err, Some(ModelError::NotInstalled { .. })),
            "{err:?}"
        );
        assert_eq!(pool.load_count("lung-unet"), 0);
    }

    #[tokio::test]
    async fn gpu_permits_serialise_work() {
        let dir = tempfile::tempdir().expect("tempdir");
        let pool = ModelPool::new(Arc::new(ModelRegistry::new(dir.path()).expect("registry")));
        let first = pool.acquire(Device::Cuda(0)).await.expect("permit");
        let second = tokio::time::timeout(Duration::from_millis(50), pool.acquire(Device::Cuda(0)));
        assert!(second.await.is_err(), "a second GPU permit must wait");
        drop(first);
        let third = tokio::time::timeout(Duration::from_millis(50), pool.acquire(Device::Cuda(0)));
        assert!(third.await.is_ok());
    }
}
