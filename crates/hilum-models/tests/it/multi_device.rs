//! The pool across several devices: routing to holders, replicas, per-device permits and
//! failover. The devices are logical: `cuda:N` values handed to a test model that never opens
//! them, so the routing is tested on any machine, GPUs or not.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use futures::FutureExt;
use hilum_models::{
    Backend, Device, DeviceSet, InstallRecord, InstalledModel, Manifest, Model, ModelError,
    ModelPool, ModelRegistry, ModelSettings,
};

const UNET: &str = "lung-unet";
const PSPNET: &str = "chestx-det-pspnet";

/// A model that remembers its device and fails, at load or forward, while that device is named
/// in the test's `broken` file (one file per test directory, so tests run in parallel).
struct Probe {
    device: Device,
    broken: PathBuf,
}

impl Model for Probe {
    fn load(
        _: &Manifest,
        installed: &InstalledModel,
        device: Device,
        _: Backend,
        _: &ModelSettings,
    ) -> Result<Self, ModelError> {
        let root = installed
            .weights
            .parent()
            .and_then(Path::parent)
            .ok_or_else(|| ModelError::Compute("no models dir".into()))?;
        let probe = Probe {
            device,
            broken: root.join("broken"),
        };
        probe.check()?;
        Ok(probe)
    }
}

impl Probe {
    fn check(&self) -> Result<(), ModelError> {
        let text = std::fs::read_to_string(&self.broken).unwrap_or_default();
        if text
            .split_whitespace()
            .any(|d| d == self.device.to_string())
        {
            return Err(ModelError::Device {
                device: self.device.to_string(),
                reason: "marked broken by the test".into(),
            });
        }
        Ok(())
    }

    fn forward(&self) -> Result<Device, ModelError> {
        self.check()?;
        Ok(self.device)
    }
}

struct Setup {
    dir: tempfile::TempDir,
    pool: Arc<ModelPool>,
}

impl Setup {
    fn new(devices: &str, max_replicas: Option<usize>, cooldown: Duration) -> Setup {
        let dir = tempfile::tempdir().expect("tempdir");
        let reg = ModelRegistry::new(dir.path()).expect("registry");
        for id in [UNET, PSPNET] {
            fake_install(&reg, id);
        }
        let settings = ModelSettings {
            devices: devices.parse().expect("device list"),
            max_replicas,
            device_cooldown: cooldown,
            ..Default::default()
        };
        let pool = Arc::new(ModelPool::with_settings(Arc::new(reg), settings));
        Setup { dir, pool }
    }

    fn break_devices(&self, devices: &str) {
        std::fs::write(self.dir.path().join("broken"), devices).expect("write broken");
    }

    /// One call of `id`: the device that answered.
    async fn call(&self, id: &str) -> Result<Device, ModelError> {
        self.pool
            .run::<Probe, _, _>(id, Backend::Candle, |_, m| m.forward())
            .await
    }

    /// `n` calls of `id` at once, each waiting inside its forward pass until all `n` are in
    /// theirs: they can meet only if they run on `n` devices at once (one permit per GPU).
    /// Returns each call's device, or `None` when the calls never met.
    async fn calls_that_meet(&self, id: &str, n: usize) -> Option<Vec<Device>> {
        let meeting = Arc::new(Meeting::new(n));
        let calls: Vec<_> = (0..n)
            .map(|_| {
                let (pool, meeting, id) = (self.pool.clone(), meeting.clone(), id.to_string());
                tokio::spawn(async move {
                    pool.run::<Probe, _, _>(&id, Backend::Candle, move |_, m| {
                        let met = meeting.meet();
                        Ok((m.forward()?, met))
                    })
                    .await
                })
            })
            .collect();
        let mut devices = Vec::new();
        for call in calls {
            let (device, met) = call.await.expect("task").expect("call");
            if !met {
                return None;
            }
            devices.push(device);
        }
        devices.sort();
        Some(devices)
    }

    fn loads(&self, id: &str, device: Device) -> u64 {
        self.pool
            .load_counts()
            .get(&(id.to_string(), device.to_string()))
            .copied()
            .unwrap_or(0)
    }
}

/// A barrier whose wait gives up after a bound far above any real wait, so a router that
/// serialises the calls fails the test instead of hanging it.
struct Meeting {
    expected: usize,
    arrived: Mutex<usize>,
    all_here: Condvar,
}

impl Meeting {
    fn new(expected: usize) -> Self {
        Meeting {
            expected,
            arrived: Mutex::new(0),
            all_here: Condvar::new(),
        }
    }

    fn meet(&self) -> bool {
        let mut arrived = self.arrived.lock().expect("meeting");
        *arrived += 1;
        self.all_here.notify_all();
        let (arrived, _) = self
            .all_here
            .wait_timeout_while(arrived, Duration::from_secs(10), |a| *a < self.expected)
            .expect("meeting");
        *arrived >= self.expected
    }
}

fn fake_install(reg: &ModelRegistry, id: &str) {
    let dir = reg.model_dir(id);
    std::fs::create_dir_all(&dir).expect("mkdir");
    std::fs::write(dir.join("model.safetensors"), b"x").expect("write");
    let rec = InstallRecord {
        id: id.into(),
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

const LONG: Duration = Duration::from_secs(3600);
const GPU0: Device = Device::Cuda(0);
const GPU1: Device = Device::Cuda(1);
const GPU2: Device = Device::Cuda(2);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_spread_across_devices_under_concurrency() {
    let s = Setup::new("cuda:0,cuda:1,cuda:2", None, LONG);
    let devices = s.calls_that_meet(UNET, 3).await;
    assert_eq!(devices, Some(vec![GPU0, GPU1, GPU2]));
    assert_eq!(s.pool.replicas(UNET), vec![GPU0, GPU1, GPU2]);
    for d in [GPU0, GPU1, GPU2] {
        assert_eq!(s.loads(UNET, d), 1, "{d}");
    }
}

#[tokio::test]
async fn routing_prefers_a_device_already_holding_the_model() {
    let s = Setup::new("cuda:0,cuda:1,cuda:2", None, LONG);
    // cuda:0 busy with another model: the U-Net's first call loads it on cuda:1.
    let busy = s.pool.lease(PSPNET).await.expect("lease");
    assert_eq!(busy.device(), GPU0);
    assert_eq!(s.call(UNET).await.ok(), Some(GPU1));
    drop(busy);
    // Every device idle now, cuda:0 listed first: the calls still go where the model is.
    for _ in 0..4 {
        assert_eq!(s.call(UNET).await.ok(), Some(GPU1));
    }
    assert_eq!(s.pool.load_count(UNET), 1);
    assert_eq!(s.pool.replicas(UNET), vec![GPU1]);
}

#[tokio::test]
async fn a_busy_gpu_queues_its_model_while_another_device_takes_other_work() {
    // One copy of a model at most: its calls queue on the device that holds it.
    let s = Setup::new("cuda:0,cuda:1", Some(1), LONG);
    assert_eq!(s.call(UNET).await.ok(), Some(GPU0));
    let first = s.pool.lease(UNET).await.expect("lease");
    assert_eq!(first.device(), GPU0);
    let mut second = Box::pin(s.pool.lease(UNET));
    assert!(
        futures::poll!(second.as_mut()).is_pending(),
        "a second call on the busy GPU must wait for its permit"
    );
    // Meanwhile the other GPU takes other work at once.
    let other = s
        .pool
        .lease(PSPNET)
        .now_or_never()
        .expect("cuda:1 is free")
        .expect("lease");
    assert_eq!(other.device(), GPU1);
    assert!(futures::poll!(second.as_mut()).is_pending());
    drop(first);
    let second = second.await.expect("lease");
    assert_eq!(second.device(), GPU0);
    assert_eq!(s.pool.replicas(UNET), vec![GPU0]);
}

#[tokio::test]
async fn a_busy_holder_gets_a_replica_on_a_free_device_within_budget() {
    let s = Setup::new("cuda:0,cuda:1", None, LONG);
    assert_eq!(s.call(UNET).await.ok(), Some(GPU0));
    let busy = s.pool.lease(UNET).await.expect("lease");
    assert_eq!(busy.device(), GPU0);
    assert_eq!(s.call(UNET).await.ok(), Some(GPU1));
    assert_eq!(s.pool.replicas(UNET), vec![GPU0, GPU1]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_device_moves_calls_to_another_device_holding_the_model() {
    let s = Setup::new("cuda:0,cuda:1", None, LONG);
    assert_eq!(s.calls_that_meet(UNET, 2).await, Some(vec![GPU0, GPU1]));
    s.break_devices("cuda:0");
    let tried = Arc::new(Mutex::new(Vec::new()));
    for _ in 0..4 {
        let log = tried.clone();
        let answered = s
            .pool
            .run::<Probe, _, _>(UNET, Backend::Candle, move |d, m| {
                log.lock().expect("log").push(d);
                m.forward()
            })
            .await;
        assert_eq!(answered.ok(), Some(GPU1));
    }
    // The first call tried cuda:0, failed and moved; the others went to cuda:1 directly.
    assert_eq!(
        *tried.lock().expect("log"),
        vec![GPU0, GPU1, GPU1, GPU1, GPU1]
    );
    assert!(!s.pool.is_healthy(GPU0));
    assert!(s.pool.is_healthy(GPU1));
    assert_eq!(s.pool.replicas(UNET), vec![GPU1]);
    assert_eq!(s.loads(UNET, GPU1), 1, "cuda:1 held it: no reload");
}

#[tokio::test]
async fn a_device_failing_to_load_sends_the_call_to_one_able_to_load_it() {
    let s = Setup::new("cuda:0,cuda:1", None, LONG);
    s.break_devices("cuda:0");
    assert_eq!(s.call(UNET).await.ok(), Some(GPU1));
    assert_eq!(s.loads(UNET, GPU0), 0);
    assert_eq!(s.loads(UNET, GPU1), 1);
    assert_eq!(s.pool.replicas(UNET), vec![GPU1]);
    assert!(!s.pool.is_healthy(GPU0));
}

#[tokio::test]
async fn a_failed_device_takes_calls_again_after_its_cooldown() {
    let s = Setup::new("cuda:0,cuda:1", None, Duration::ZERO);
    s.break_devices("cuda:0");
    assert_eq!(s.call(UNET).await.ok(), Some(GPU1));
    s.break_devices("");
    assert!(s.pool.is_healthy(GPU0));
    // cuda:1 busy: the call reloads the model on the recovered cuda:0 rather than queueing.
    let busy = s.pool.lease(UNET).await.expect("lease");
    assert_eq!(busy.device(), GPU1);
    assert_eq!(s.call(UNET).await.ok(), Some(GPU0));
    assert_eq!(s.pool.replicas(UNET), vec![GPU0, GPU1]);
}

#[tokio::test]
async fn when_every_device_fails_the_call_fails_once_per_device() {
    let s = Setup::new("cuda:0,cuda:1", None, LONG);
    assert_eq!(s.call(UNET).await.ok(), Some(GPU0));
    s.break_devices("cuda:0 cuda:1");
    let tried = Arc::new(Mutex::new(Vec::new()));
    let log = tried.clone();
    let err = s
        .pool
        .run::<Probe, _, _>(UNET, Backend::Candle, move |d, m| {
            log.lock().expect("log").push(d);
            m.forward()
        })
        .await
        .err();
    assert!(matches!(err, Some(ModelError::Device { .. })), "{err:?}");
    // cuda:1 failed at load, so the work ran on cuda:0 only.
    assert_eq!(*tried.lock().expect("log"), vec![GPU0]);
    assert!(!s.pool.is_healthy(GPU0) && !s.pool.is_healthy(GPU1));
    // With no healthy device left the failed ones are tried again, not shut out.
    s.break_devices("");
    assert_eq!(s.call(UNET).await.ok(), Some(GPU0));
}

#[tokio::test]
async fn a_lone_cpu_keeps_taking_calls_after_a_failure() {
    let s = Setup::new("cpu", None, LONG);
    assert_eq!(s.pool.devices(), &DeviceSet::default());
    s.break_devices("cpu");
    assert!(s.call(UNET).await.is_err());
    s.break_devices("");
    assert_eq!(s.call(UNET).await.ok(), Some(Device::Cpu));
}

#[tokio::test]
async fn a_model_error_is_the_calls_own_and_moves_nothing() {
    let s = Setup::new("cuda:0,cuda:1", None, LONG);
    let err = s.call("medsam-vit-b").await.err();
    assert!(
        matches!(err, Some(ModelError::NotInstalled { .. })),
        "{err:?}"
    );
    assert!(s.pool.is_healthy(GPU0) && s.pool.is_healthy(GPU1));
    assert!(s.pool.replicas("medsam-vit-b").is_empty());
}

#[tokio::test]
async fn a_permit_taken_without_routing_still_counts_as_load() {
    let s = Setup::new("cuda:0,cuda:1", None, LONG);
    // A caller of the single-device API holds cuda:0's one permit.
    let held = s.pool.acquire(GPU0).await.expect("permit");
    assert_eq!(s.call(UNET).await.ok(), Some(GPU1));
    drop(held);
}

#[tokio::test]
async fn queued_calls_spread_over_the_devices_holding_the_model() {
    let s = Setup::new("cuda:0,cuda:1", None, LONG);
    let on0 = s.pool.lease(UNET).await.expect("lease");
    let on1 = s.pool.lease(UNET).await.expect("lease");
    assert_eq!((on0.device(), on1.device()), (GPU0, GPU1));
    // Both busy: the next two calls queue, one behind each device, not both behind cuda:0.
    let mut third = Box::pin(s.pool.lease(UNET));
    let mut fourth = Box::pin(s.pool.lease(UNET));
    assert!(futures::poll!(third.as_mut()).is_pending());
    assert!(futures::poll!(fourth.as_mut()).is_pending());
    drop(on1);
    match futures::poll!(fourth.as_mut()) {
        std::task::Poll::Ready(Ok(lease)) => assert_eq!(lease.device(), GPU1),
        other => panic!(
            "the call queued on cuda:1 must take it: {:?}",
            other.is_ready()
        ),
    }
    assert!(futures::poll!(third.as_mut()).is_pending());
    drop(on0);
    assert_eq!(third.await.expect("lease").device(), GPU0);
}

/// A model whose load opens its candle device and whose forward pass computes there.
#[cfg(feature = "cuda")]
struct OnDevice(candle_core::Device);

#[cfg(feature = "cuda")]
impl Model for OnDevice {
    fn load(
        _: &Manifest,
        _: &InstalledModel,
        device: Device,
        _: Backend,
        _: &ModelSettings,
    ) -> Result<Self, ModelError> {
        Ok(OnDevice(device.candle()?))
    }
}

/// On the GPUs themselves: `auto` is every GPU the driver reports, and calls held at once land
/// on as many of them, each computing on its own GPU. Needs a CUDA build and a GPU:
/// `cargo test -p hilum-models --features cuda --test it multi_device:: -- --ignored`.
#[cfg(feature = "cuda")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a CUDA GPU"]
async fn auto_spreads_real_work_over_every_gpu() {
    let set = DeviceSet::auto();
    eprintln!("auto = {set}");
    assert!(
        set.devices().iter().all(|d| matches!(d, Device::Cuda(_))),
        "{set}"
    );
    let dir = tempfile::tempdir().expect("tempdir");
    let reg = ModelRegistry::new(dir.path()).expect("registry");
    fake_install(&reg, UNET);
    let settings = ModelSettings {
        devices: set.clone(),
        ..Default::default()
    };
    let pool = Arc::new(ModelPool::with_settings(Arc::new(reg), settings));
    let leases: Vec<_> = futures::future::join_all((0..set.len()).map(|_| pool.lease(UNET)))
        .await
        .into_iter()
        .map(|l| l.expect("lease"))
        .collect();
    let mut held: Vec<Device> = leases.iter().map(|l| l.device()).collect();
    held.sort();
    assert_eq!(held, set.devices());
    drop(leases);
    for _ in 0..set.len() {
        let (device, sum) = pool
            .run::<OnDevice, _, _>(UNET, Backend::Candle, |d, m| {
                let t = candle_core::Tensor::arange(0f32, 1024f32, &m.0)?;
                assert!(t.device().is_cuda());
                Ok((d, t.sum_all()?.to_scalar::<f32>()?))
            })
            .await
            .expect("run on the GPU");
        eprintln!("{device}: sum {sum}");
        assert_eq!(sum, 523_776.0);
    }
}
