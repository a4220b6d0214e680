//! Dynamic batching on a real network: DenseNet-121 with seeded weights, installed as a site
//! checkpoint, classifying real radiographs through the pool. Concurrent calls gathered into
//! one forward pass answer what each call alone answers, and an input of the wrong size
//! fails alone.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use hilum_imaging::{ImageStore, Prepared, StoreLimits};
use hilum_models::runner::Runner;
use hilum_models::xrv::{self, Classifier, XrvSpec};
use hilum_models::{
    Backend, BatchOutput, BatchSettings, ImportOptions, ModelPool, ModelRegistry, ModelSettings,
};

const ID: &str = "densenet121-res224-all";

fn radiographs() -> Vec<PathBuf> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/data/cxr/images");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("real radiographs missing in {}: {e}", dir.display()))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "png" || x == "jpg"))
        .collect();
    files.sort();
    assert!(
        files.len() >= 3,
        "fewer than 3 radiographs in {}",
        dir.display()
    );
    files
}

/// A pool holding seeded DenseNet-121 weights imported as a site checkpoint.
fn pool(dir: &Path, batch: BatchSettings) -> Arc<ModelPool> {
    let w = xrv::synthetic_weights(&XrvSpec::densenet121_res224_all().arch, 7).expect("weights");
    let ckpt = dir.join("site.safetensors");
    candle_core::safetensors::save(&w, &ckpt).expect("save checkpoint");
    let registry = ModelRegistry::new(dir.join("models")).expect("registry");
    let opts = ImportOptions {
        custom: true,
        ..Default::default()
    };
    hilum_models::import(&registry, ID, &ckpt, &opts).expect("import");
    let settings = ModelSettings {
        batch,
        ..Default::default()
    };
    Arc::new(ModelPool::with_settings(Arc::new(registry), settings))
}

async fn classify_at_once(
    pool: &Arc<ModelPool>,
    inputs: &[Arc<Prepared>],
) -> Vec<Result<BatchOutput<Classifier>, hilum_models::ModelError>> {
    let calls: Vec<_> = inputs
        .iter()
        .map(|x| {
            let (pool, x) = (pool.clone(), x.clone());
            tokio::spawn(async move {
                pool.run_batched::<Classifier>(ID, None, Backend::Native, x)
                    .await
            })
        })
        .collect();
    let mut out = Vec::new();
    for c in calls {
        let r = tokio::time::timeout(Duration::from_secs(300), c)
            .await
            .expect("a call was never answered")
            .expect("task");
        out.push(r);
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gathered_calls_answer_what_each_call_alone_answers_and_a_bad_input_fails_alone() {
    let dir = tempfile::tempdir().expect("tempdir");
    // A delay far above the test: the batch leaves because it is full.
    let pool = pool(dir.path(), BatchSettings::new(4, Duration::from_secs(3600)));
    let store = ImageStore::new(StoreLimits::default());
    let recipe = XrvSpec::densenet121_res224_all().recipe();
    let mut inputs: Vec<Arc<Prepared>> = radiographs()[..3]
        .iter()
        .map(|p| {
            let id = store.ingest_file(p).expect("real radiograph decodes");
            store.prepared(&id, &recipe).expect("prepared")
        })
        .collect();
    // The classifier takes 224 px; this one is 128 px.
    let id = store.ingest_file(&radiographs()[0]).expect("decodes");
    let wrong = store
        .prepared(&id, &hilum_imaging::Preprocess::xrv(128))
        .expect("prepared");
    inputs.insert(1, wrong);

    let out = classify_at_once(&pool, &inputs).await;
    let err = out[1]
        .as_ref()
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(err.contains("model input is 128x128"), "{err}");
    for i in [0, 2, 3] {
        let r = out[i].as_ref().expect("a good input keeps its result");
        assert_eq!(r.size, 3, "the three good inputs ran as one pass");
        let alone = r.model.run(&inputs[i]).expect("the same input alone");
        assert_eq!(r.output.len(), 18);
        for (b, a) in r.output.iter().zip(&alone) {
            assert_eq!(b.label, a.label);
            // The native kernels compute each image of a batch on its own.
            assert_eq!(b.probability, a.probability, "{}", b.label);
            assert_eq!(b.score, a.score, "{}", b.label);
        }
    }
    // Different radiographs give different scores: the outputs were not mixed up.
    let p = |i: usize| out[i].as_ref().map(|r| r.output[0].probability).ok();
    assert_ne!(p(0), p(2));
}
