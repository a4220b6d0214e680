//! The model pool: loads each (model, device, backend, type) once, on first use, keeps it warm,
//! and hands out per-device permits so concurrent tool calls never oversubscribe a device.
//!
//! With several devices (`ModelSettings::devices`, `--device cuda:0,cuda:1`) the pool also
//! routes: [`ModelPool::lease`] picks, for one call of a model, the least-loaded healthy device
//! already holding it, and places another copy (a replica) on a free device only when every
//! holder is busy and the replica budget allows. A device whose load or forward pass fails is
//! passed over for a cool-down while others can take its calls ([`ModelPool::run`] retries
//! the call there). [`ModelPool::device_stats`] says how the calls spread.

use std::any::{Any, TypeId};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::{
    Backend, Device, DeviceSet, InstalledModel, Manifest, ModelError, ModelRegistry, ModelSettings,
};

/// A network the pool can load from an installed model, on a device and a backend (a type
/// that supports only some backends says so with [`Backend::expect`]), with the pool's
/// settings (CPU threads, quantization).
pub trait Model: Send + Sync + Sized + 'static {
    /// Loads the installed weights onto `device` with `backend`, or says why it cannot.
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

/// The process's one holder of loaded models: loads each lazily, keeps it warm, and routes
/// calls over the configured devices (one permit per device, failed devices cooled off).
pub struct ModelPool {
    registry: Arc<ModelRegistry>,
    settings: ModelSettings,
    slots: Mutex<HashMap<Key, Slot>>,
    permits: Mutex<HashMap<Device, Arc<Semaphore>>>,
    /// Loads done per (model id, device): the proof that one pool serves the process.
    loads: Mutex<BTreeMap<(String, String), u64>>,
    routing: Arc<Mutex<Routing>>,
    /// Calls gathered for batched forward passes ([`ModelPool::run_batched`]).
    pub(crate) batches: crate::batch::Queues,
}

/// What routing decides from: calls per device, where each model is, which devices failed.
#[derive(Default)]
struct Routing {
    /// Calls holding or waiting for a device's permit.
    in_flight: HashMap<Device, usize>,
    /// Devices holding each model, or loading it for a call routed there.
    replicas: HashMap<String, BTreeSet<Device>>,
    /// Devices passed over until the given time.
    failed_until: HashMap<Device, Instant>,
    /// Leases granted and not yet dropped.
    running: HashMap<Device, usize>,
    /// What each device has done since the pool was made.
    stats: HashMap<Device, DeviceStats>,
}

/// What one device did since the pool was made: routed calls (leases), time they held it,
/// the most held at once, failures, and the models it holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceStats {
    /// The device.
    pub device: Device,
    /// Leases granted on it that have ended (the call finished, failed or was cancelled).
    pub calls: u64,
    /// Time those leases held it (model loads and forward passes).
    pub busy: Duration,
    /// The most leases held on it at once: never above its permits.
    pub peak: usize,
    /// Device failures reported on it ([`ModelPool::report_failure`]).
    pub failures: u64,
    /// Models it holds a copy of (or is loading).
    pub models: Vec<String>,
}

impl DeviceStats {
    fn new(device: Device) -> Self {
        DeviceStats {
            device,
            calls: 0,
            busy: Duration::ZERO,
            peak: 0,
            failures: 0,
            models: Vec::new(),
        }
    }
}

impl Routing {
    fn load(&self, d: Device) -> usize {
        self.in_flight.get(&d).copied().unwrap_or(0)
    }

    fn holds(&self, id: &str, d: Device) -> bool {
        self.replicas.get(id).is_some_and(|r| r.contains(&d))
    }

    fn cooling(&self, d: Device, now: Instant) -> bool {
        self.failed_until.get(&d).is_some_and(|t| *t > now)
    }
}

/// One call's place: a device chosen by [`ModelPool::lease`] with that device's work permit.
/// Hold it for the load and the forward pass; dropping it frees the device for the next call.
pub struct Lease {
    device: Device,
    since: Instant,
    _permit: OwnedSemaphorePermit,
    in_flight: InFlight,
}

impl Lease {
    /// The device chosen for this call.
    pub fn device(&self) -> Device {
        self.device
    }

    /// When the device became this call's (after any wait for its permit).
    pub fn since(&self) -> Instant {
        self.since
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        let mut r = self
            .in_flight
            .routing
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if let Some(n) = r.running.get_mut(&self.device) {
            *n = n.saturating_sub(1);
        }
        let st = r
            .stats
            .entry(self.device)
            .or_insert_with(|| DeviceStats::new(self.device));
        st.calls += 1;
        st.busy += self.since.elapsed();
    }
}

/// What the work of a call run by [`ModelPool::run_on`] is given.
pub struct Placed<'a, M> {
    /// The device the call was routed to; its permit is held while the work runs.
    pub device: Device,
    /// The warm copy on that device.
    pub model: &'a Arc<M>,
    /// When the device became the call's (after any wait for its permit).
    pub since: Instant,
    /// How long this call spent getting the copy (its load, or waiting for another call's).
    pub load: Duration,
}

/// Counts a routed call against its device from the choice on, so callers choosing at the
/// same time see it, and uncounts it however the call ends (done, failed, cancelled).
struct InFlight {
    device: Device,
    routing: Arc<Mutex<Routing>>,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let mut r = self.routing.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = r.in_flight.get_mut(&self.device) {
            *n = n.saturating_sub(1);
        }
    }
}

/// Whether `error` from work on `device` says the device failed rather than the model or the
/// input: a device error, or a computation error on a GPU (out of memory, a lost context).
pub fn is_device_failure(device: Device, error: &ModelError) -> bool {
    match error {
        ModelError::Device { .. } => true,
        ModelError::Compute(_) => device.is_gpu(),
        _ => false,
    }
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
            routing: Arc::new(Mutex::new(Routing::default())),
            batches: Default::default(),
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

    /// The registry the pool loads from.
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
            self.settings.runs_on(device),
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
        self.routing()
            .replicas
            .entry(id.to_string())
            .or_default()
            .insert(device);
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
        self.routing().replicas.remove(id);
    }

    /// The devices calls are routed across.
    pub fn devices(&self) -> &DeviceSet {
        &self.settings.devices
    }

    /// The devices holding a warm copy of `id` (or loading one), in device order.
    pub fn replicas(&self, id: &str) -> Vec<Device> {
        let r = self.routing();
        r.replicas
            .get(id)
            .map(|s| s.iter().copied().collect())
            .unwrap_or_default()
    }

    /// Whether `device` is taking calls: false for [`ModelSettings::device_cooldown`] after a
    /// failure reported with [`ModelPool::report_failure`].
    pub fn is_healthy(&self, device: Device) -> bool {
        !self.routing().cooling(device, Instant::now())
    }

    /// A device for one call of model `id`, with its work permit (waiting for it if every
    /// candidate is busy). Among the set's healthy devices: the least-loaded one holding `id`
    /// with a free permit; else a free device without it, if `id` has fewer copies than the
    /// replica budget (the call loads it there); else the least-loaded holder, to queue on. A
    /// failed device is chosen only when no healthy one is left, so one device never fails
    /// every call.
    pub async fn lease(&self, id: &str) -> Result<Lease, ModelError> {
        self.lease_among(id, None, &[]).await
    }

    /// Tells the pool how a call on `device` failed. A device failure ([`is_device_failure`])
    /// passes the device over for the cool-down and drops its copy of `id` (a lost GPU context
    /// leaves it unusable), so the next call goes to, or loads on, another device. Returns
    /// whether it was a device failure.
    pub fn report_failure(&self, id: &str, device: Device, error: &ModelError) -> bool {
        if !is_device_failure(device, error) {
            return false;
        }
        let until = Instant::now() + self.settings.device_cooldown;
        {
            let mut r = self.routing();
            r.failed_until.insert(device, until);
            r.stats
                .entry(device)
                .or_insert_with(|| DeviceStats::new(device))
                .failures += 1;
            if let Some(set) = r.replicas.get_mut(id) {
                set.remove(&device);
            }
        }
        let mut slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        slots.retain(|(k, d, _, _), _| !(k == id && *d == device));
        true
    }

    /// Runs one call of model `id` where [`ModelPool::lease`] routes it: loads the model there
    /// if needed and runs `work` with it on a blocking thread, holding the device's permit. A
    /// device failure ([`ModelPool::report_failure`]) moves the call to another device, once
    /// per device of the set; any other error is the call's.
    pub async fn run<M, R, F>(
        self: &Arc<Self>,
        id: &str,
        backend: Backend,
        work: F,
    ) -> Result<R, ModelError>
    where
        M: Model,
        R: Send + 'static,
        F: Fn(Device, &M) -> Result<R, ModelError> + Send + Sync + 'static,
    {
        self.run_on(id, None, backend, move |p: Placed<'_, M>| {
            work(p.device, p.model)
        })
        .await
    }

    /// [`ModelPool::run`] with the call's place given to `work` ([`Placed`]), routed across
    /// the set, or, with `pin`, on that one device (in the set or not) with its permit.
    pub async fn run_on<M, R, F>(
        self: &Arc<Self>,
        id: &str,
        pin: Option<Device>,
        backend: Backend,
        work: F,
    ) -> Result<R, ModelError>
    where
        M: Model,
        R: Send + 'static,
        F: Fn(Placed<'_, M>) -> Result<R, ModelError> + Send + Sync + 'static,
    {
        let work = Arc::new(work);
        let candidates = if pin.is_some() {
            1
        } else {
            self.devices().len()
        };
        let mut tried: Vec<Device> = Vec::new();
        loop {
            let lease = self.lease_among(id, pin, &tried).await?;
            let (device, since) = (lease.device(), lease.since());
            let (pool, work, model_id) = (self.clone(), work.clone(), id.to_string());
            // The lease moves into the thread: a caller that stops waiting leaves the device
            // taken until the work it started has finished. A failure is reported before the
            // lease goes, so no call is routed to the failed device in between.
            let (result, device_failed) = tokio::task::spawn_blocking(move || {
                let _lease = lease;
                let faulty = pool.settings.forward_faults.contains(&device);
                let placed = pool.with_copy::<M, _>(&model_id, device, backend, since, |p| {
                    let _armed = crate::fault::arm(faulty.then_some(device));
                    work(p)
                });
                let result = placed.unwrap_or_else(|e| {
                    pool.forget_unloaded(&model_id, device);
                    Err(e)
                });
                let failed = result
                    .as_ref()
                    .is_err_and(|e| pool.report_failure(&model_id, device, e));
                (result, failed)
            })
            .await
            .map_err(|e| ModelError::Compute(format!("the work on {device} stopped: {e}")))?;
            if !device_failed {
                return result;
            }
            tried.push(device);
            if tried.len() >= candidates {
                return result;
            }
        }
    }

    /// `work` given the warm copy of `id` on `device` (loaded first if needed: blocking) and
    /// its place, the device being the call's since `since`. `Err`: the copy did not load.
    /// Takes no permit: [`ModelPool::run_on`] holds one, a served backend needs none.
    pub fn with_copy<M: Model, R>(
        &self,
        id: &str,
        device: Device,
        backend: Backend,
        since: Instant,
        work: impl FnOnce(Placed<'_, M>) -> R,
    ) -> Result<R, ModelError> {
        let t = Instant::now();
        let model = self.get_or_load::<M>(id, device, backend)?;
        Ok(work(Placed {
            device,
            model: &model,
            since,
            load: t.elapsed(),
        }))
    }

    /// What each device has done: the set's devices in order, then any other device a pinned
    /// call used.
    pub fn device_stats(&self) -> Vec<DeviceStats> {
        let r = self.routing();
        let set = self.devices().devices();
        let mut devices: Vec<Device> = set.to_vec();
        let mut others: Vec<Device> = r
            .stats
            .keys()
            .copied()
            .filter(|d| !set.contains(d))
            .collect();
        others.sort();
        devices.extend(others);
        devices
            .into_iter()
            .map(|d| {
                let mut st = r
                    .stats
                    .get(&d)
                    .cloned()
                    .unwrap_or_else(|| DeviceStats::new(d));
                st.models = r
                    .replicas
                    .iter()
                    .filter(|(_, held)| held.contains(&d))
                    .map(|(id, _)| id.clone())
                    .collect();
                st.models.sort();
                st
            })
            .collect()
    }

    async fn lease_among(
        &self,
        id: &str,
        pin: Option<Device>,
        avoid: &[Device],
    ) -> Result<Lease, ModelError> {
        let in_flight = self
            .choose(id, pin, avoid)
            .ok_or_else(|| ModelError::Device {
                device: pin.map_or_else(|| self.devices().to_string(), |d| d.to_string()),
                reason: format!("every device failed for `{id}`"),
            })?;
        let device = in_flight.device;
        let permit = self.acquire(device).await?;
        {
            let mut r = self.routing();
            let running = r.running.entry(device).or_default();
            *running += 1;
            let now = *running;
            let st = r
                .stats
                .entry(device)
                .or_insert_with(|| DeviceStats::new(device));
            st.peak = st.peak.max(now);
        }
        Ok(Lease {
            device,
            since: Instant::now(),
            _permit: permit,
            in_flight,
        })
    }

    /// The routing decision of [`ModelPool::lease`] (among the set, or `pin` alone), counted
    /// against the chosen device.
    fn choose(&self, id: &str, pin: Option<Device>, avoid: &[Device]) -> Option<InFlight> {
        let now = Instant::now();
        let held = self.permits_held();
        let mut r = self.routing();
        // A device's load: its routed calls, or the permits taken on it if more (callers of
        // `acquire` are not routed but still occupy the device).
        let load = |d: Device| r.load(d).max(held.get(&d).copied().unwrap_or(0));
        let free = |d: &Device| load(*d) < self.concurrency(*d);
        // `min_by_key` keeps the first of equals: ties go to the earlier-listed device.
        let least = |ds: &mut dyn Iterator<Item = Device>| ds.min_by_key(|d| load(*d));
        let pinned = pin.map(|d| [d]);
        let set: &[Device] = match &pinned {
            Some(one) => one,
            None => self.devices().devices(),
        };
        let open: Vec<Device> = set.iter().copied().filter(|d| !avoid.contains(d)).collect();
        let healthy: Vec<Device> = open
            .iter()
            .copied()
            .filter(|d| !r.cooling(*d, now))
            .collect();
        let candidates = if healthy.is_empty() { open } else { healthy };
        let copies = set.iter().filter(|d| r.holds(id, **d)).count();
        let (holders, others): (Vec<Device>, Vec<Device>) =
            candidates.iter().partition(|d| r.holds(id, **d));
        let device = least(&mut holders.iter().copied().filter(free))
            .or_else(|| {
                if copies < self.settings.replica_budget() {
                    least(&mut others.iter().copied().filter(free))
                } else {
                    None
                }
            })
            .or_else(|| least(&mut holders.iter().copied()))
            // No usable holder (none yet, or all failed): load where the queue is shortest.
            .or_else(|| least(&mut others.iter().copied()))?;
        r.replicas.entry(id.to_string()).or_default().insert(device);
        *r.in_flight.entry(device).or_default() += 1;
        Some(InFlight {
            device,
            routing: self.routing.clone(),
        })
    }

    /// Permits taken per device, by routed calls and [`ModelPool::acquire`] callers alike.
    fn permits_held(&self) -> HashMap<Device, usize> {
        let permits = self.permits.lock().unwrap_or_else(|p| p.into_inner());
        permits
            .iter()
            .map(|(d, s)| {
                (
                    *d,
                    self.concurrency(*d).saturating_sub(s.available_permits()),
                )
            })
            .collect()
    }

    /// Un-places `id` from `device` after a load there failed, unless a copy is warm anyway.
    fn forget_unloaded(&self, id: &str, device: Device) {
        let warm = {
            let slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
            slots
                .iter()
                .filter(|((k, d, _, _), _)| k == id && *d == device)
                // A slot locked by a load in progress counts as warm: that load places it.
                .any(|(_, slot)| slot.try_lock().map(|g| g.is_some()).unwrap_or(true))
        };
        if !warm {
            if let Some(set) = self.routing().replicas.get_mut(id) {
                set.remove(&device);
            }
        }
    }

    fn routing(&self) -> std::sync::MutexGuard<'_, Routing> {
        self.routing.lock().unwrap_or_else(|p| p.into_inner())
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
