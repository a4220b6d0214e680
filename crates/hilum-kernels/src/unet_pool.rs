//! Persistent worker threads for the U-Net's forward. The caller is thread 0 and starts at
//! once; workers join when they wake, and the work is handed out in chunks (see
//! [`super::Direct`]), so a worker that wakes late, or is descheduled on a busy machine,
//! costs at most the chunk it holds instead of stalling every layer at a barrier.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;

use crate::CpuError;

/// A job as the workers see it: the caller's closure with its lifetime erased. It is only
/// called between `run` publishing it and `run` seeing `active == 0` after withdrawing it.
#[derive(Clone, Copy)]
struct JobRef(*const (dyn Fn(usize) + Sync + 'static));

// SAFETY: the pointee is `Sync` and outlives every call (see `JobRef`).
unsafe impl Send for JobRef {}

struct State {
    job: Option<JobRef>,
    generation: u64,
    /// Workers inside the current job.
    active: usize,
    shutdown: bool,
}

struct Inner {
    state: Mutex<State>,
    /// Workers wait here for a new job.
    wake: Condvar,
    /// The caller waits here for `active == 0`.
    idle: Condvar,
    /// `State::generation`, readable without the lock while a worker spins.
    generation: AtomicU64,
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

pub(super) struct Pool {
    inner: Arc<Inner>,
    workers: Vec<JoinHandle<()>>,
}

/// Spins of a worker after a job before it sleeps: back-to-back forwards (a batch, a series)
/// then find it awake.
const SPINS: u32 = 1 << 14;

impl Pool {
    /// A pool of `threads - 1` workers (the caller is the last thread).
    pub(super) fn new(threads: usize) -> Result<Self, CpuError> {
        let inner = Arc::new(Inner {
            state: Mutex::new(State {
                job: None,
                generation: 0,
                active: 0,
                shutdown: false,
            }),
            wake: Condvar::new(),
            idle: Condvar::new(),
            generation: AtomicU64::new(0),
        });
        let mut workers = Vec::new();
        for t in 1..threads.max(1) {
            let inner = Arc::clone(&inner);
            let h = std::thread::Builder::new()
                .name(format!("hilum-unet-{t}"))
                .spawn(move || worker(&inner, t))
                .map_err(|e| CpuError::Threads(e.to_string()))?;
            workers.push(h);
        }
        Ok(Pool { inner, workers })
    }

    /// Runs `f(0)` here and `f(t)` on every worker that wakes before `f(0)` returns; returns
    /// once no worker is inside `f`. `f` must finish all the work whichever threads join.
    pub(super) fn run(&self, f: &(dyn Fn(usize) + Sync)) {
        if self.workers.is_empty() {
            return f(0);
        }
        // SAFETY: only the lifetime is erased; `Withdraw` (also on unwinding) removes the job
        // and waits until no worker is inside it before `f` can go out of scope.
        let job = JobRef(unsafe {
            std::mem::transmute::<*const (dyn Fn(usize) + Sync + '_), *const (dyn Fn(usize) + Sync)>(
                f,
            )
        });
        {
            let mut st = self.inner.lock();
            st.job = Some(job);
            st.generation += 1;
            self.inner
                .generation
                .store(st.generation, Ordering::Release);
        }
        self.inner.wake.notify_all();
        let _withdraw = Withdraw(&self.inner);
        f(0);
    }
}

/// Withdraws the published job and waits for the workers inside it.
struct Withdraw<'a>(&'a Inner);

impl Drop for Withdraw<'_> {
    fn drop(&mut self) {
        let mut st = self.0.lock();
        st.job = None;
        while st.active > 0 {
            st = self.0.idle.wait(st).unwrap_or_else(|e| e.into_inner());
        }
    }
}

fn worker(inner: &Inner, t: usize) {
    let mut seen = 0u64;
    loop {
        let mut spins = 0;
        while inner.generation.load(Ordering::Acquire) == seen && spins < SPINS {
            std::hint::spin_loop();
            spins += 1;
        }
        let mut st = inner.lock();
        while st.generation == seen && !st.shutdown {
            st = inner.wake.wait(st).unwrap_or_else(|e| e.into_inner());
        }
        if st.shutdown {
            return;
        }
        seen = st.generation;
        let Some(job) = st.job else {
            continue; // finished before this worker woke
        };
        st.active += 1;
        drop(st);
        // SAFETY: the job stays alive until `active` drops back (see `JobRef`).
        let f = unsafe { &*job.0 };
        // A panic is the job's to report (it must not leave `active` raised).
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(t)));
        let mut st = inner.lock();
        st.active -= 1;
        if st.active == 0 {
            inner.idle.notify_all();
        }
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.inner.lock().shutdown = true;
        self.inner.wake.notify_all();
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}
