//! In-process dynamic batching: concurrent calls of one model (several sessions of a server, an
//! eval with `--jobs`) are gathered into one forward pass, the way an inference server's dynamic
//! batcher does (Triton's `max_queue_delay_microseconds` and `max_batch_size`), but inside the
//! process and on every device, the CPU included.
//!
//! Calls gather per model, backend, device choice (a pinned device, or the pool's routed set)
//! and model type. A batch leaves when it holds [`BatchSettings::max_size`] calls or when its
//! oldest call has waited [`BatchSettings::max_delay`]; it is then routed like one call
//! ([`ModelPool::run_on`]: one device, its permit, failover) and takes its calls only once it
//! holds the device, so calls arriving while the device is busy join it (up to the size).
//! Each input is checked on its own first, and a batch whose forward pass fails for another
//! reason than its device runs its calls one by one, so a bad input fails only its own call.

use std::any::{Any, TypeId};
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::sync::{oneshot, Notify};

use crate::{is_device_failure, Backend, Device, Model, ModelError, ModelPool, Placed};

/// How concurrent calls of one model are gathered. `max_size` 1 (the default) turns batching
/// off: each call is its own forward pass, as without this module.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchSettings {
    /// Calls in one forward pass at most (`HILUM_BATCH_MAX_SIZE`).
    pub max_size: usize,
    /// How long the oldest call of a batch waits for others before it leaves
    /// (`HILUM_BATCH_DELAY_MS`).
    pub max_delay: Duration,
}

/// The delay used when batching is turned on with a size and no delay: a few milliseconds,
/// short against a CNN's forward pass on any device.
pub const DEFAULT_BATCH_DELAY: Duration = Duration::from_millis(2);

impl Default for BatchSettings {
    fn default() -> Self {
        BatchSettings {
            max_size: 1,
            max_delay: DEFAULT_BATCH_DELAY,
        }
    }
}

impl BatchSettings {
    /// Gathering up to `max_size` calls for at most `max_delay`.
    pub fn new(max_size: usize, max_delay: Duration) -> Self {
        BatchSettings {
            max_size: max_size.max(1),
            max_delay,
        }
    }

    /// Whether calls are gathered at all.
    pub fn enabled(&self) -> bool {
        self.max_size > 1
    }
}

/// A network that can run several calls' inputs in one forward pass.
pub trait Batched: Model {
    /// One call's input (the image models take a prepared image).
    type Input: Send + Sync + 'static;
    /// One call's output.
    type Output: Send + 'static;

    /// Refuses an input this network cannot take (another size, layout, ...), before it joins
    /// a batch, so it fails alone.
    fn check(&self, input: &Self::Input) -> Result<(), ModelError>;

    /// One forward pass over `inputs`: one output per input, in their order.
    fn run_batch(&self, inputs: &[&Self::Input]) -> Result<Vec<Self::Output>, ModelError>;
}

/// One call's result and where it came from.
pub struct BatchOutput<M: Batched> {
    /// The model's output for this call's input.
    pub output: M::Output,
    /// The warm copy that ran it.
    pub model: Arc<M>,
    /// The device the warm copy runs on.
    pub device: Device,
    /// Inputs in the forward pass that gave this output (1: it ran alone).
    pub size: usize,
    /// That forward pass, all of its inputs together.
    pub forward: Duration,
    /// Time spent getting the copy (its load, or waiting for another call's).
    pub load: Duration,
    /// From the call's arrival to the start of its forward pass: gathering, then waiting for
    /// the device.
    pub queued: Duration,
}

type Key = (String, Option<Device>, Backend, TypeId);

/// The pool's gathering queues, one per [`Key`], made on first use.
#[derive(Default)]
pub(crate) struct Queues(Mutex<HashMap<Key, Arc<dyn Any + Send + Sync>>>);

impl Queues {
    fn get<M: Batched>(&self, id: &str, pin: Option<Device>, backend: Backend) -> Arc<Queue<M>> {
        let mut map = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let key = (id.to_string(), pin, backend, TypeId::of::<M>());
        let any = map
            .entry(key)
            .or_insert_with(|| Queue::<M>::new(id, pin, backend))
            .clone();
        // The key holds the type, so the downcast holds; were it not to, the call gathers alone.
        any.downcast::<Queue<M>>()
            .unwrap_or_else(|_| Queue::<M>::new(id, pin, backend))
    }
}

struct Queue<M: Batched> {
    id: String,
    pin: Option<Device>,
    backend: Backend,
    state: Mutex<State<M>>,
    /// Wakes the leader when the calls not yet covered by a dispatched batch fill one.
    wake: Notify,
}

struct State<M: Batched> {
    /// Calls waiting, oldest first.
    pending: VecDeque<Waiting<M>>,
    /// Whether a leader task is watching the queue.
    leading: bool,
    /// Batches sent to the pool that have not yet taken their calls: each will take up to
    /// `max_size` from the front when it holds its device.
    dispatched: usize,
}

struct Waiting<M: Batched> {
    input: M::Input,
    since: Instant,
    reply: oneshot::Sender<Result<BatchOutput<M>, ModelError>>,
}

impl<M: Batched> Queue<M> {
    fn new(id: &str, pin: Option<Device>, backend: Backend) -> Arc<Self> {
        Arc::new(Queue {
            id: id.to_string(),
            pin,
            backend,
            state: Mutex::new(State {
                pending: VecDeque::new(),
                leading: false,
                dispatched: 0,
            }),
            wake: Notify::new(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, State<M>> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The calls of one dispatched batch, taken from the front.
    fn claim(&self, max: usize) -> Vec<Waiting<M>> {
        let mut st = self.lock();
        st.dispatched = st.dispatched.saturating_sub(1);
        let n = st.pending.len().min(max);
        st.pending.drain(..n).collect()
    }
}

/// One input's result and the size of the pass that gave it.
type Answer<M> = (Result<<M as Batched>::Output, ModelError>, usize);

/// What one forward pass gave each of its inputs.
struct Ran<M: Batched> {
    outputs: Vec<Answer<M>>,
    model: Arc<M>,
    device: Device,
    load: Duration,
    forward: Duration,
    started: Instant,
}

impl ModelPool {
    /// One call of model `id` with `input`, gathered with concurrent calls of the same model,
    /// backend and device choice into one forward pass as the pool's
    /// [`BatchSettings`](crate::ModelSettings::batch) allow (batching off: a forward pass of
    /// its own, routed by [`ModelPool::run_on`]). `pin`: one device; `None`: routed across
    /// the pool's devices, each batch as one call. Errors are this call's own.
    pub async fn run_batched<M: Batched>(
        self: &Arc<Self>,
        id: &str,
        pin: Option<Device>,
        backend: Backend,
        input: M::Input,
    ) -> Result<BatchOutput<M>, ModelError> {
        let settings = self.settings().batch;
        let since = Instant::now();
        if !settings.enabled() {
            let ran = self
                .run_on::<M, _, _>(id, pin, backend, move |p| forward(p, &[&input]))
                .await?;
            return outputs(Ok(ran), &[since])
                .pop()
                .unwrap_or_else(|| Err(stopped()));
        }
        let queue = self.batches.get::<M>(id, pin, backend);
        let (reply, answer) = oneshot::channel();
        let lead = {
            let mut st = queue.lock();
            st.pending.push_back(Waiting {
                input,
                since,
                reply,
            });
            let covered = st.dispatched * settings.max_size;
            if st.pending.len().saturating_sub(covered) >= settings.max_size {
                queue.wake.notify_one();
            }
            !std::mem::replace(&mut st.leading, true)
        };
        if lead {
            tokio::spawn(lead_queue(self.clone(), queue));
        }
        answer.await.unwrap_or_else(|_| Err(stopped()))
    }
}

fn stopped() -> ModelError {
    ModelError::Compute("the batch this call was gathered into stopped before answering".into())
}

/// Watches a queue while calls wait in it that no dispatched batch will take: sends a batch
/// to the pool when they fill one or the oldest of them has waited the delay; ends when none
/// is left (the next call starts a new leader).
async fn lead_queue<M: Batched>(pool: Arc<ModelPool>, queue: Arc<Queue<M>>) {
    let settings = pool.settings().batch;
    loop {
        let deadline = {
            let mut st = queue.lock();
            let covered = st.dispatched * settings.max_size;
            let Some(oldest) = st.pending.get(covered) else {
                st.leading = false;
                return;
            };
            let deadline = oldest.since + settings.max_delay;
            let full = st.pending.len() - covered >= settings.max_size;
            if full || Instant::now() >= deadline {
                st.dispatched += 1;
                tokio::spawn(run_batch(pool.clone(), queue.clone()));
                None
            } else {
                Some(deadline)
            }
        };
        if let Some(deadline) = deadline {
            tokio::select! {
                _ = tokio::time::sleep_until(deadline.into()) => {}
                _ = queue.wake.notified() => {}
            }
        }
    }
}

/// One dispatched batch: routed by the pool; takes its calls once it holds the device (and
/// keeps them if the pool moves it to another device), then answers each call.
async fn run_batch<M: Batched>(pool: Arc<ModelPool>, queue: Arc<Queue<M>>) {
    let max = pool.settings().batch.max_size;
    let claimed: Arc<Mutex<Option<Vec<Waiting<M>>>>> = Arc::new(Mutex::new(None));
    let (q, slot) = (queue.clone(), claimed.clone());
    let ran = pool
        .run_on::<M, _, _>(&queue.id, queue.pin, queue.backend, move |p| {
            let mut slot = slot.lock().unwrap_or_else(|e| e.into_inner());
            let calls = slot.get_or_insert_with(|| q.claim(max));
            let inputs: Vec<&M::Input> = calls.iter().map(|w| &w.input).collect();
            forward(p, &inputs)
        })
        .await;
    let taken = claimed.lock().unwrap_or_else(|e| e.into_inner()).take();
    // The work never ran when the copy did not load: the batch takes its calls to fail them.
    let calls = taken.unwrap_or_else(|| queue.claim(max));
    let sinces: Vec<Instant> = calls.iter().map(|w| w.since).collect();
    let results = match ran {
        Ok(ran) => outputs(Ok(ran), &sinces),
        Err(e) => calls.iter().map(|_| Err(e.clone())).collect(),
    };
    for (call, result) in calls.into_iter().zip(results) {
        // A caller that stopped waiting has dropped its receiver: nothing to answer.
        let _ = call.reply.send(result);
    }
}

/// The forward pass of `inputs` on the placed copy: each input checked alone, the good ones
/// in one pass; if that pass fails other than by its device, each good input alone.
fn forward<M: Batched>(p: Placed<'_, M>, inputs: &[&M::Input]) -> Result<Ran<M>, ModelError> {
    let started = Instant::now();
    let mut outputs: Vec<Option<Answer<M>>> = inputs
        .iter()
        .map(|x| p.model.check(x).err().map(|e| (Err(e), 1)))
        .collect();
    let good: Vec<usize> = (0..inputs.len())
        .filter(|&i| outputs[i].is_none())
        .collect();
    if !good.is_empty() {
        let batch: Vec<&M::Input> = good.iter().map(|&i| inputs[i]).collect();
        match run_checked(&p, &batch) {
            Ok(outs) => {
                for (&i, out) in good.iter().zip(outs) {
                    outputs[i] = Some((Ok(out), good.len()));
                }
            }
            Err(e) if is_device_failure(p.device, &e) => return Err(e),
            Err(e) if good.len() == 1 => outputs[good[0]] = Some((Err(e), 1)),
            Err(_) => {
                for &i in &good {
                    let one = match run_checked(&p, &[inputs[i]]) {
                        Err(e) if is_device_failure(p.device, &e) => return Err(e),
                        r => r.and_then(|mut o| o.pop().ok_or_else(|| no_output(1, 0))),
                    };
                    outputs[i] = Some((one, 1));
                }
            }
        }
    }
    Ok(Ran {
        outputs: outputs
            .into_iter()
            .map(|o| o.unwrap_or_else(|| (Err(no_output(1, 0)), 1)))
            .collect(),
        model: p.model.clone(),
        device: p.device,
        load: p.load,
        forward: started.elapsed(),
        started,
    })
}

/// [`Batched::run_batch`], its outputs counted against its inputs.
fn run_checked<M: Batched>(
    p: &Placed<'_, M>,
    inputs: &[&M::Input],
) -> Result<Vec<M::Output>, ModelError> {
    let outs = p.model.run_batch(inputs)?;
    if outs.len() != inputs.len() {
        return Err(no_output(inputs.len(), outs.len()));
    }
    Ok(outs)
}

fn no_output(wanted: usize, got: usize) -> ModelError {
    ModelError::Compute(format!(
        "a batched forward pass gave {got} outputs for {wanted} inputs"
    ))
}

/// Each call's answer from its batch's pass (`sinces`: when each call arrived).
fn outputs<M: Batched>(
    ran: Result<Ran<M>, ModelError>,
    sinces: &[Instant],
) -> Vec<Result<BatchOutput<M>, ModelError>> {
    let ran = match ran {
        Ok(r) => r,
        Err(e) => return sinces.iter().map(|_| Err(e.clone())).collect(),
    };
    let Ran {
        outputs,
        model,
        device,
        load,
        forward,
        started,
    } = ran;
    outputs
        .into_iter()
        .zip(sinces)
        .map(|((out, size), since)| {
            out.map(|output| BatchOutput {
                output,
                model: model.clone(),
                device,
                size,
                forward,
                load,
                queued: started.saturating_duration_since(*since),
            })
        })
        .collect()
}

/// The torchxrayvision classifiers batch their preprocessed images.
impl Batched for crate::xrv::Classifier {
    type Input = Arc<hilum_imaging::Prepared>;
    type Output = Vec<crate::xrv::LabelScore>;

    fn check(&self, input: &Self::Input) -> Result<(), ModelError> {
        use crate::runner::Runner;
        crate::runner::check_input(&self.recipe(), input)
    }

    fn run_batch(&self, inputs: &[&Self::Input]) -> Result<Vec<Self::Output>, ModelError> {
        let data: Vec<f32> = inputs.iter().flat_map(|x| x.data.iter().copied()).collect();
        self.predict(&data, inputs.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{InstallRecord, InstalledModel, Manifest, ModelRegistry, ModelSettings};

    const ID: &str = "lung-unet";
    /// Refused by the batch's forward pass (not by `check`): it fails the whole pass.
    const POISON: f32 = 13.0;

    /// Doubles each input and says how many inputs its pass held; refuses negative inputs
    /// in `check` and fails a whole pass that holds [`POISON`].
    struct Doubler;

    impl Model for Doubler {
        fn load(
            _: &Manifest,
            _: &InstalledModel,
            _: Device,
            _: Backend,
            _: &ModelSettings,
        ) -> Result<Self, ModelError> {
            Ok(Doubler)
        }
    }

    impl Batched for Doubler {
        type Input = f32;
        type Output = (f32, usize);

        fn check(&self, x: &f32) -> Result<(), ModelError> {
            if *x < 0.0 {
                return Err(ModelError::Compute(format!("negative input {x}")));
            }
            Ok(())
        }

        fn run_batch(&self, xs: &[&f32]) -> Result<Vec<(f32, usize)>, ModelError> {
            if xs.iter().any(|x| **x == POISON) {
                return Err(ModelError::Compute("poisoned pass".into()));
            }
            Ok(xs.iter().map(|x| (**x * 2.0, xs.len())).collect())
        }
    }

    /// A stand-in install of [`ID`] (the test model reads no weights).
    fn install(dir: &std::path::Path) {
        let d = ModelRegistry::new(dir).expect("registry").model_dir(ID);
        std::fs::create_dir_all(&d).expect("mkdir");
        std::fs::write(d.join("model.safetensors"), b"x").expect("write");
        let rec = InstallRecord {
            id: ID.into(),
            sha256: "0".repeat(64),
            source_sha256: "0".repeat(64),
            source: "test".into(),
            custom: false,
            installed_at: 0,
            hilum_version: "test".into(),
            onnx_sha256: None,
        };
        let toml = toml::to_string(&rec).expect("toml");
        std::fs::write(d.join("install.toml"), toml).expect("write");
    }

    fn pool(dir: &std::path::Path, batch: BatchSettings) -> Arc<ModelPool> {
        let reg = ModelRegistry::new(dir).expect("registry");
        let settings = ModelSettings {
            batch,
            ..Default::default()
        };
        Arc::new(ModelPool::with_settings(Arc::new(reg), settings))
    }

    /// `inputs` as concurrent calls; each call's result in input order. A bound far above
    /// any real wait turns a batcher that never answers into a failure instead of a hang.
    async fn calls(
        pool: &Arc<ModelPool>,
        inputs: &[f32],
    ) -> Vec<Result<BatchOutput<Doubler>, ModelError>> {
        let handles: Vec<_> = inputs
            .iter()
            .map(|&x| {
                let pool = pool.clone();
                tokio::spawn(async move {
                    pool.run_batched::<Doubler>(ID, None, Backend::Native, x)
                        .await
                })
            })
            .collect();
        let mut out = Vec::new();
        for h in handles {
            let r = tokio::time::timeout(Duration::from_secs(30), h)
                .await
                .expect("a call was never answered")
                .expect("task");
            out.push(r);
        }
        out
    }

    const LONG: Duration = Duration::from_secs(600);

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_full_batch_leaves_without_waiting_for_the_delay() {
        let dir = tempfile::tempdir().expect("tempdir");
        install(dir.path());
        let pool = pool(dir.path(), BatchSettings::new(4, LONG));
        let out = calls(&pool, &[1.0, 2.0, 3.0, 4.0]).await;
        for (r, x) in out.iter().zip([1.0, 2.0, 3.0, 4.0]) {
            let r = r.as_ref().expect("call");
            assert_eq!(r.output, (x * 2.0, 4));
            assert_eq!(r.size, 4);
            assert_eq!(r.device, Device::Cpu);
        }
        // One pass for four calls: the device saw one lease.
        assert_eq!(pool.device_stats()[0].calls, 1);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_lone_call_waits_the_delay_and_no_longer() {
        let dir = tempfile::tempdir().expect("tempdir");
        let delay = Duration::from_millis(150);
        install(dir.path());
        let pool = pool(dir.path(), BatchSettings::new(8, delay));
        let r = calls(&pool, &[5.0])
            .await
            .pop()
            .expect("one")
            .expect("call");
        assert_eq!((r.output, r.size), ((10.0, 1), 1));
        assert!(r.queued >= delay, "left after {:?}", r.queued);
        // Far above the delay: the bound only catches a batcher that waits for a full batch.
        assert!(r.queued < delay + Duration::from_secs(10), "{:?}", r.queued);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn batches_never_exceed_the_size() {
        let dir = tempfile::tempdir().expect("tempdir");
        install(dir.path());
        let pool = pool(
            dir.path(),
            BatchSettings::new(3, Duration::from_millis(500)),
        );
        let inputs: Vec<f32> = (0..7).map(|i| i as f32).collect();
        let out = calls(&pool, &inputs).await;
        let sizes: Vec<usize> = out.iter().map(|r| r.as_ref().expect("call").size).collect();
        assert!(sizes.iter().all(|&s| s <= 3), "{sizes:?}");
        assert!(sizes.contains(&3), "{sizes:?}");
        for (r, x) in out.iter().zip(&inputs) {
            assert_eq!(r.as_ref().expect("call").output.0, x * 2.0);
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_bad_input_fails_only_its_own_call() {
        let dir = tempfile::tempdir().expect("tempdir");
        install(dir.path());
        let pool = pool(dir.path(), BatchSettings::new(4, LONG));
        let out = calls(&pool, &[1.0, -1.0, POISON, 4.0]).await;
        let err = |i: usize| {
            out[i]
                .as_ref()
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default()
        };
        assert!(err(1).contains("negative input"), "{}", err(1));
        assert!(err(2).contains("poisoned pass"), "{}", err(2));
        // The pass with the poison failed; the good calls ran again, each alone.
        for (i, want) in [(0, 2.0), (3, 8.0)] {
            let r = out[i].as_ref().expect("a good call keeps its result");
            assert_eq!(r.output, (want, 1));
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn without_batching_each_call_is_its_own_pass() {
        let dir = tempfile::tempdir().expect("tempdir");
        install(dir.path());
        let pool = pool(dir.path(), BatchSettings::default());
        let out = calls(&pool, &[1.0, 2.0, 3.0]).await;
        assert!(out.iter().all(|r| r.as_ref().expect("call").size == 1));
        assert_eq!(pool.device_stats()[0].calls, 3);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_model_that_does_not_load_fails_every_gathered_call_then_recovers() {
        let dir = tempfile::tempdir().expect("tempdir");
        let pool = pool(dir.path(), BatchSettings::new(2, Duration::from_millis(20)));
        for r in calls(&pool, &[1.0, 2.0, 3.0]).await {
            assert!(
                matches!(r, Err(ModelError::NotInstalled { .. })),
                "{:?}",
                r.err()
            );
        }
        // The queue holds nothing stale: after an install, calls run.
        install(dir.path());
        let out = calls(&pool, &[1.0, 2.0]).await;
        assert!(
            out.iter().all(|r| r.is_ok()),
            "{:?}",
            out.iter().map(|r| r.as_ref().err()).collect::<Vec<_>>()
        );
    }
}
