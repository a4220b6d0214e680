//! The DICOM node of a real `hilum serve` process killed with SIGKILL at three points — right
//! after a study was received, while a study's protocol runs, while results wait to be sent to a
//! PACS that is down — and started again each time on the same database and folder. In the
//! end each study has exactly one result set (SR, SEG, overlay) in a real Orthanc, and nothing
//! received was lost.
//!
//! Needs dcmtk and Orthanc (`scripts/setup_pacs_tools.sh`); without them the test fails naming
//! it, unless HILUM_SKIP_PACS_TOOLS=1.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hilum_pacs::dicomweb::{tag_str, DicomWebClient, DicomWebConfig};

#[path = "../../../hilum-server/tests/it/pacs_peers.rs"]
mod pacs_peers;
use hilum_server::db::PacsJob;
use pacs_peers::{forward, free_port, orthanc, repo, tools_missing};

fn data(rel: &str) -> PathBuf {
    repo().join("../shared/data").join(rel)
}

/// A `hilum serve` process with its DICOM node; SIGKILLed when dropped.
struct Node {
    child: Child,
    log: Arc<Mutex<String>>,
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Node {
    fn start(dir: &Path, dicom_port: u16, dest: &str) -> Node {
        let mut child = Command::new(env!("CARGO_BIN_EXE_hilum"))
            .env_remove("OPENAI_API_KEY")
            .env_remove("HILUM_LLM")
            .env_remove("HILUM_DB")
            .env("HILUM_CONFIG", "/dev/null")
            .env("HILUM_MODELS_DIR", dir.join("models"))
            .args(["serve", "--bind", "127.0.0.1:0", "--db"])
            .arg(format!("sqlite://{}", dir.join("h.db").display()))
            .args(["--dicom-port", &dicom_port.to_string(), "--dicom-dir"])
            .arg(dir.join("pacs"))
            .args([
                "--pacs-dest",
                dest,
                "--pacs-quiet-secs",
                "1",
                "--pacs-lease-secs",
                "3",
            ])
            .args(["--pacs-send-attempts", "30"])
            .stderr(Stdio::piped())
            .stdout(Stdio::null())
            .spawn()
            .expect("start hilum serve");
        let stderr = child.stderr.take().expect("stderr");
        let log = Arc::new(Mutex::new(String::new()));
        let sink = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                let mut l = sink.lock().unwrap_or_else(|p| p.into_inner());
                l.push_str(&line);
                l.push('\n');
            }
        });
        let node = Node { child, log };
        let until = Instant::now() + Duration::from_secs(60);
        while !node.log().contains("DICOM node listening") {
            assert!(
                Instant::now() < until,
                "the node did not start: {}",
                node.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        node
    }

    fn log(&self) -> String {
        self.log.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// SIGKILL, as a crash or the OOM killer would.
    fn kill9(mut self) {
        self.child.kill().expect("SIGKILL");
        self.child.wait().expect("reap");
    }
}

fn storescu(port: u16, file: &Path, syntax: &str) {
    let out = Command::new("storescu")
        .args(["-aet", "MODALITY", "-aec", "HILUM", syntax, "127.0.0.1"])
        .arg(port.to_string())
        .arg(file)
        .output()
        .expect("run storescu");
    assert!(
        out.status.success(),
        "storescu: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn study_of(file: &Path) -> (String, String) {
    let bytes = std::fs::read(file).expect("read");
    let (source, _) = hilum_pacs::protocol::read_facts(&bytes).expect("facts");
    (source.study.instance_uid, source.sop_instance_uid)
}

async fn job(db: &hilum_server::Db, study: &str) -> Option<PacsJob> {
    db.pacs_jobs(100)
        .await
        .expect("jobs")
        .into_iter()
        .find(|j| j.study_uid == study)
}

async fn wait_for(db: &hilum_server::Db, study: &str, states: &[&str], secs: u64) -> PacsJob {
    let until = Instant::now() + Duration::from_secs(secs);
    loop {
        if let Some(j) = job(db, study).await {
            if states.contains(&j.state.as_str()) {
                return j;
            }
        }
        assert!(
            Instant::now() < until,
            "the job of {study} never reached {states:?}: {:?}",
            job(db, study).await
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The study's result instances in Orthanc (the source is not sent there).
async fn result_count(client: &DicomWebClient, study: &str, source_sop: &str) -> usize {
    let mut n = 0;
    for s in client.qido_series(study, &[]).await.expect("QIDO series") {
        let series = tag_str(&s.json, "0020000E").unwrap_or_default();
        for i in client.qido_instances(study, &series).await.expect("QIDO") {
            if tag_str(&i.json, "00080018").as_deref() != Some(source_sop) {
                n += 1;
            }
        }
    }
    n
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_on_receive_run_and_send_leaves_one_result_set_per_study() {
    if let Some(tool) = tools_missing() {
        if std::env::var("HILUM_SKIP_PACS_TOOLS").as_deref() == Ok("1") {
            eprintln!("skipped: {tool} is missing and HILUM_SKIP_PACS_TOOLS=1");
            return;
        }
        panic!("{tool} is missing: run `bash scripts/setup_pacs_tools.sh`");
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let import = Command::new(env!("CARGO_BIN_EXE_hilum"))
        .env("HILUM_MODELS_DIR", dir.path().join("models"))
        .env("HILUM_CONFIG", "/dev/null")
        .args(["models", "import", "lung-unet"])
        .arg(data("models/lung_seg_unet/lung_seg_valiou_088.h5"))
        .output()
        .expect("import the lung U-Net");
    assert!(
        import.status.success(),
        "{}",
        String::from_utf8_lossy(&import.stderr)
    );
    let pacs = orthanc(None);
    // The PACS is down (nothing answers on its address) until the last restart.
    let pacs_port = free_port();
    let dest = format!("http://127.0.0.1:{pacs_port}/dicom-web");
    let dicom_port = free_port();
    let db_url = format!("sqlite://{}", dir.path().join("h.db").display());

    // 1. Killed right after a study was received (inside its quiet period).
    let a = data("cxr/dicom/siim_pneumothorax_neg_cr_pa_jpegbaseline.dcm");
    let (study_a, sop_a) = study_of(&a);
    let node = Node::start(dir.path(), dicom_port, &dest);
    storescu(dicom_port, &a, "-xy");
    node.kill9();
    let db = hilum_server::Db::open(&db_url).expect("the node's database");
    let received = job(&db, &study_a)
        .await
        .expect("the instance was recorded before success");
    assert_eq!(received.state, "received");
    assert_eq!(received.instances, 1);

    // 2. Killed while a study's protocol runs.
    let node = Node::start(dir.path(), dicom_port, &dest);
    let b = data("cxr/dicom/RG1_chest_cr_pa_jpeg2000_lossy.dcm");
    let (study_b, sop_b) = study_of(&b);
    storescu(dicom_port, &b, "-xw");
    wait_for(&db, &study_b, &["queued", "running"], 60).await;
    node.kill9();

    // 3. Killed while results wait for the PACS: both studies reach `sending` (retrying).
    let node = Node::start(dir.path(), dicom_port, &dest);
    let sending_a = wait_for(&db, &study_a, &["sending"], 120).await;
    wait_for(&db, &study_b, &["sending"], 120).await;
    node.kill9();
    assert!(
        sending_a.results.is_some(),
        "results are written before sending"
    );

    // The PACS comes back; the restarted node sends what it had.
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", pacs_port))
        .await
        .expect("the PACS's address");
    tokio::spawn(forward(
        listener,
        pacs.url.trim_start_matches("http://").to_string(),
    ));
    let node = Node::start(dir.path(), dicom_port, &dest);
    for study in [&study_a, &study_b] {
        let done = wait_for(&db, study, &["done", "failed"], 180).await;
        assert_eq!(done.state, "done", "{done:#?}\n{}", node.log());
    }
    let client = DicomWebClient::new(DicomWebConfig::new(format!("{}/dicom-web", pacs.url)))
        .expect("client");
    assert_eq!(
        result_count(&client, &study_a, &sop_a).await,
        3,
        "one result set for A"
    );
    assert_eq!(
        result_count(&client, &study_b, &sop_b).await,
        3,
        "one result set for B"
    );
    // The node's folder kept every received instance.
    for (study, sop) in [(&study_a, &sop_a), (&study_b, &sop_b)] {
        let f = dir
            .path()
            .join("pacs/incoming")
            .join(study)
            .join(format!("{sop}.dcm"));
        assert!(f.is_file(), "{} lost", f.display());
    }
    drop(node);
}
