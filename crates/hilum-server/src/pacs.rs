//! The DICOM node of `hilum serve`: studies arrive by C-STORE (hilum-pacs' Storage SCP), each
//! instance is on disk and in the database before its C-STORE is answered, and a study becomes
//! a job once no instance has arrived for the quiet period. The job's instances are matched
//! against the configured protocols; the matching plan runs as an ordinary durable run (the
//! protocol's tool calls, replayed by a script model, then its question for the agent if it has
//! one); its results are written as a TID 1500 SR, a SEG and a derived overlay image in the
//! source study, and sent to the PACS by STOW-RS with retries and backoff.
//!
//! Nothing identifying reaches a log: lines carry job ids, states, counts and UIDs of Hilum's own
//! results only.

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use hilum_llm::script::{ScriptCall, ScriptTurn};
use hilum_pacs::protocol::{self, Protocol};
use hilum_pacs::scp::{Scp, ScpConfig, StoredInstance};
use hilum_pacs::{
    dicomweb, Device, Finding, Measurement, ModelInfo, Overlay, ResultSet, Segment, Side,
    SourceImage,
};
use serde_json::{json, Value};

use crate::db::{Caller, JobUpdate, PacsInstance, PacsJob};
use crate::AppState;

/// Where results are sent: a PACS's DICOMweb root (`http://pacs:8042/dicom-web`).
#[derive(Clone, Debug)]
pub struct Destination {
    /// The DICOMweb root URL.
    pub url: String,
    /// A bearer token for it, if it needs one.
    pub bearer: Option<String>,
}

/// The node's settings (`hilum serve --dicom-port …`, `[pacs]` in the config file).
#[derive(Clone, Debug)]
pub struct PacsSettings {
    /// Where the node listens (`127.0.0.1:11112`).
    pub bind: SocketAddr,
    /// The node's own AE title.
    pub ae_title: String,
    /// Calling AE titles allowed to send; empty: any.
    pub allowed_callers: Vec<String>,
    /// Hosts allowed to send; empty: any.
    pub allowed_hosts: Vec<IpAddr>,
    /// Associations served at once.
    pub max_associations: usize,
    /// Largest instance accepted, bytes.
    pub max_object_bytes: u64,
    /// Received instances and written results live under it.
    pub storage_dir: PathBuf,
    /// A study is complete when no instance has arrived for this long.
    pub quiet: Duration,
    /// The protocols a complete study is matched against, in order.
    pub protocols: Vec<Protocol>,
    /// Where results go; `None`: they are written to disk only.
    pub destination: Option<Destination>,
    /// Send attempts before a job is `failed` (a retry starts again).
    pub max_send_attempts: i64,
    /// The first retry's wait; each next one doubles it.
    pub retry_base: Duration,
    /// How long a job being worked on is its worker's: a job a killed server left `running` or
    /// `sending` is taken up again this long after it was claimed.
    pub lease: Duration,
}

impl PacsSettings {
    /// A node on `bind` storing under `storage_dir`, with defaults: AE title `HILUM`, the chest
    /// X-ray protocol, no destination.
    pub fn new(bind: SocketAddr, storage_dir: PathBuf) -> Self {
        PacsSettings {
            bind,
            ae_title: "HILUM".into(),
            allowed_callers: Vec::new(),
            allowed_hosts: Vec::new(),
            max_associations: 8,
            max_object_bytes: 256 << 20,
            storage_dir,
            quiet: Duration::from_secs(5),
            protocols: vec![Protocol::default_cxr()],
            destination: None,
            max_send_attempts: 5,
            retry_base: Duration::from_secs(2),
            lease: Duration::from_secs(60),
        }
    }
}

/// The service identity PACS runs belong to (their sessions, images and runs).
pub const PACS_TOKEN_NAME: &str = "pacs-node";

/// Starts the node: the Storage SCP on its own thread, the job worker on the runtime. Returns
/// the address it listens on.
pub fn start(state: AppState, settings: PacsSettings) -> Result<SocketAddr, String> {
    protocol::validate(&settings.protocols)?;
    let mut cfg = ScpConfig::new(
        settings.ae_title.clone(),
        settings.storage_dir.join("incoming"),
    );
    cfg.allowed_callers = settings.allowed_callers.clone();
    cfg.allowed_hosts = settings.allowed_hosts.clone();
    cfg.max_associations = settings.max_associations;
    cfg.max_object_bytes = settings.max_object_bytes;
    let runtime = tokio::runtime::Handle::current();
    let db = state.db.clone();
    let quiet_ms = settings.quiet.as_millis() as i64;
    let scp = Scp::bind(settings.bind, cfg)
        .map_err(|e| e.to_string())?
        .on_stored(move |s: &StoredInstance| {
            // On the association's thread, before the success status: the row is committed first.
            let row = PacsInstance {
                sop_instance_uid: s.sop_instance_uid.clone(),
                study_uid: s.study_uid.clone(),
                series_uid: s.series_uid.clone(),
                sop_class_uid: s.sop_class_uid.clone(),
                transfer_syntax: s.transfer_syntax.clone(),
                path: s.path.display().to_string(),
                origin: format!("c-store:{}", s.calling_ae.trim()),
            };
            runtime
                .block_on(db.pacs_record_instance(row, quiet_ms))
                .map(|_| ())
                .map_err(|e| format!("cannot record the instance: {e}"))
        });
    let addr = scp.local_addr();
    let stop = scp.shutdown_handle();
    std::thread::Builder::new()
        .name("dicom-node".into())
        .spawn(move || {
            if let Err(e) = scp.run() {
                tracing::error!("the DICOM node stopped: {e}");
            }
        })
        .map_err(|e| format!("cannot start the DICOM node's thread: {e}"))?;
    let settings = Arc::new(settings);
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_millis(500));
        loop {
            tick.tick().await;
            if state.runs.is_draining() {
                break;
            }
            match state.db.pacs_claim_due(lease_ms(&settings)).await {
                Ok(jobs) => {
                    for job in jobs {
                        work(&state, &settings, job).await;
                    }
                }
                Err(e) => tracing::warn!("DICOM node: cannot read the job queue: {e}"),
            }
        }
        stop.shutdown();
    });
    tracing::info!(%addr, "DICOM node listening");
    Ok(addr)
}

/// How long a claimed job is someone's before another worker may take it again.
fn lease_ms(settings: &PacsSettings) -> i64 {
    settings.lease.as_millis() as i64
}

/// Moves one job on from where it stands, and records where it ends.
async fn work(state: &AppState, settings: &PacsSettings, job: PacsJob) {
    let result = if job.state == "sending" {
        send(state, settings, &job).await
    } else {
        run_job(state, settings, &job).await
    };
    if let Err(e) = result {
        tracing::warn!(job = %job.id, "DICOM node: job failed: {e}");
        let _ = state
            .db
            .pacs_update_job(
                job.id.clone(),
                JobUpdate {
                    state: "failed",
                    detail: Some(e),
                    ..JobUpdate::default()
                },
            )
            .await;
    }
}

/// One matching instance of a study.
struct Matched {
    source: SourceImage,
    bytes: Vec<u8>,
}

async fn run_job(state: &AppState, settings: &PacsSettings, job: &PacsJob) -> Result<(), String> {
    let instances = state
        .db
        .pacs_instances(job.study_uid.clone())
        .await
        .map_err(|e| e.to_string())?;
    let mut chosen: Option<&Protocol> = None;
    let mut matched = Vec::new();
    let mut why_not = Vec::new();
    for inst in &instances {
        let bytes = match std::fs::read(&inst.path) {
            Ok(b) => b,
            Err(e) => {
                why_not.push(format!("{} unreadable ({e})", inst.sop_instance_uid));
                continue;
            }
        };
        let (source, facts) = match protocol::read_facts(&bytes) {
            Ok(v) => v,
            Err(e) => {
                why_not.push(format!("{}: {e}", inst.sop_instance_uid));
                continue;
            }
        };
        match protocol::select(&settings.protocols, &facts) {
            Ok(p) if chosen.is_none() || chosen.map(|c| &c.name) == Some(&p.name) => {
                chosen = Some(p);
                matched.push(Matched { source, bytes });
            }
            Ok(_) => {}
            Err(no) => why_not.push(no.to_string()),
        }
    }
    let Some(protocol) = chosen else {
        why_not.dedup();
        let detail = format!("ran nothing: {}", why_not.join("; "));
        tracing::info!(job = %job.id, "DICOM node: study matches no protocol");
        return state
            .db
            .pacs_update_job(
                job.id.clone(),
                JobUpdate {
                    state: "done",
                    detail: Some(detail),
                    ..JobUpdate::default()
                },
            )
            .await
            .map_err(|e| e.to_string());
    };
    state
        .db
        .pacs_update_job(
            job.id.clone(),
            JobUpdate {
                state: "running",
                detail: Some(format!("{} image(s)", matched.len())),
                protocol: Some(protocol.name.clone()),
                ..JobUpdate::default()
            },
        )
        .await
        .map_err(|e| e.to_string())?;
    let caller = pacs_caller(state).await?;
    let session = state
        .db
        .create_session(caller.token_id.clone(), format!("PACS job {}", job.id))
        .await
        .map_err(|e| e.to_string())?;
    let out_dir = settings.storage_dir.join("results").join(&job.id);
    std::fs::create_dir_all(&out_dir).map_err(|e| format!("{}: {e}", out_dir.display()))?;
    let mut written = Vec::new();
    let mut run_ids = Vec::new();
    for m in matched {
        let (run_id, objects) = run_plan(state, &caller, &session.id, protocol, m).await?;
        run_ids.push(run_id);
        for (kind, uid, bytes) in objects {
            let path = out_dir.join(format!("{kind}_{uid}.dcm"));
            write_atomic(&path, &bytes)?;
            written.push(json!({"kind": kind, "sop_instance_uid": uid, "path": path}));
        }
    }
    let results = json!({"objects": written, "runs": run_ids});
    state
        .db
        .pacs_update_job(
            job.id.clone(),
            JobUpdate {
                state: "sending",
                detail: Some(format!("{} result object(s) written", written.len())),
                run_id: run_ids.first().cloned(),
                results: Some(results.clone()),
                next_ms: Some(0),
                ..JobUpdate::default()
            },
        )
        .await
        .map_err(|e| e.to_string())?;
    let mut job = job.clone();
    job.results = Some(results);
    send(state, settings, &job).await
}

/// Sends a job's written results; a failure is retried with backoff, then the job fails.
async fn send(state: &AppState, settings: &PacsSettings, job: &PacsJob) -> Result<(), String> {
    let objects: Vec<Vec<u8>> = job
        .results
        .as_ref()
        .and_then(|r| r["objects"].as_array())
        .map(|list| {
            list.iter()
                .filter_map(|o| o["path"].as_str())
                .filter_map(|p| std::fs::read(p).ok())
                .collect()
        })
        .unwrap_or_default();
    let Some(dest) = &settings.destination else {
        return state
            .db
            .pacs_update_job(
                job.id.clone(),
                JobUpdate {
                    state: "done",
                    detail: Some(format!(
                        "{} result object(s) written; no destination is configured",
                        objects.len()
                    )),
                    ..JobUpdate::default()
                },
            )
            .await
            .map_err(|e| e.to_string());
    };
    let mut cfg = dicomweb::DicomWebConfig::new(dest.url.clone());
    if let Some(token) = &dest.bearer {
        cfg = cfg.bearer(token.clone());
    }
    let outcome = match dicomweb::DicomWebClient::new(cfg) {
        Ok(client) => client
            .stow(Some(&job.study_uid), &objects)
            .await
            .map_err(|e| e.to_string())
            .and_then(|r| {
                if r.failed.is_empty() && r.stored.len() == objects.len() {
                    Ok(r.stored.len())
                } else {
                    Err(format!(
                        "the PACS stored {} of {} object(s) (status {})",
                        r.stored.len(),
                        objects.len(),
                        r.status
                    ))
                }
            }),
        Err(e) => Err(e.to_string()),
    };
    let db = &state.db;
    match outcome {
        Ok(n) => {
            tracing::info!(job = %job.id, objects = n, "DICOM node: results sent");
            db.pacs_update_job(
                job.id.clone(),
                JobUpdate {
                    state: "done",
                    detail: Some(format!("sent {n} result object(s) to the PACS")),
                    count_attempt: true,
                    ..JobUpdate::default()
                },
            )
            .await
            .map_err(|e| e.to_string())
        }
        Err(e) => {
            let attempts = job.attempts + 1;
            if attempts >= settings.max_send_attempts {
                db.pacs_update_job(job.id.clone(), JobUpdate { state: "failed", detail: Some(format!("sending failed after {attempts} attempt(s): {e}; `hilum pacs retry {}` sends again", job.id)), count_attempt: true, ..JobUpdate::default() })
                .await
                .map_err(|e| e.to_string())
            } else {
                let wait =
                    settings.retry_base.as_millis() as i64 * (1i64 << (attempts - 1).min(16));
                tracing::info!(job = %job.id, attempts, wait_ms = wait, "DICOM node: send failed; retrying");
                db.pacs_update_job(
                    job.id.clone(),
                    JobUpdate {
                        state: "sending",
                        detail: Some(format!("attempt {attempts} failed: {e}; retrying")),
                        next_ms: Some(crate::db::now_ms() + wait),
                        count_attempt: true,
                        ..JobUpdate::default()
                    },
                )
                .await
                .map_err(|e| e.to_string())
            }
        }
    }
}

fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), String> {
    use std::io::Write;
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::File::create(&tmp).map_err(|e| format!("{}: {e}", tmp.display()))?;
    f.write_all(bytes)
        .and_then(|_| f.sync_all())
        .map_err(|e| format!("{}: {e}", tmp.display()))?;
    std::fs::rename(&tmp, path).map_err(|e| format!("{}: {e}", path.display()))
}

/// The node's own caller, created once.
async fn pacs_caller(state: &AppState) -> Result<Caller, String> {
    let db = state.db.clone();
    tokio::task::spawn_blocking(move || {
        let tokens = db.list_tokens().map_err(|e| e.to_string())?;
        let id = match tokens
            .into_iter()
            .find(|t| t.name == PACS_TOKEN_NAME && t.revoked_ms.is_none())
        {
            Some(t) => t.id,
            // Its secret is never shown: the node is its only user.
            None => {
                db.create_token(PACS_TOKEN_NAME, false)
                    .map_err(|e| e.to_string())?
                    .0
            }
        };
        Ok(Caller {
            token_id: id,
            name: PACS_TOKEN_NAME.into(),
            admin: false,
        })
    })
    .await
    .map_err(|e| e.to_string())?
}

/// Runs a protocol's plan on one image and writes its results: (kind, SOP Instance UID, bytes).
async fn run_plan(
    state: &AppState,
    caller: &Caller,
    session_id: &str,
    protocol: &Protocol,
    m: Matched,
) -> Result<(String, Vec<(&'static str, String, Vec<u8>)>), String> {
    let space = state.space(caller).await.map_err(|e| e.to_string())?;
    let row = crate::api::ingest(
        state,
        caller,
        &space,
        bytes::Bytes::from(m.bytes),
        "application/dicom".into(),
    )
    .await
    .map_err(|e| e.to_string())?;
    let offered: Vec<String> = space
        .toolbox
        .specs(&state.cfg.env)
        .into_iter()
        .map(|s| s.name)
        .collect();
    let (tools, skipped): (Vec<&String>, Vec<&String>) =
        protocol.tools.iter().partition(|t| offered.contains(t));
    let calls: Vec<ScriptCall> = tools
        .iter()
        .enumerate()
        .map(|(i, t)| ScriptCall {
            id: Some(format!("plan_{}", i + 1)),
            name: t.to_string(),
            arguments: json!({"image": "$IMAGE"}),
        })
        .collect();
    let mut summary = format!("Protocol {} ran {}.", protocol.name, join(&tools));
    if !skipped.is_empty() {
        summary.push_str(&format!(
            " Not installed here, skipped: {}.",
            join(&skipped)
        ));
    }
    let script = hilum_llm::ScriptLlm::new(vec![
        ScriptTurn {
            content: String::new(),
            tool_calls: calls,
            error: None,
        },
        ScriptTurn {
            content: summary,
            tool_calls: Vec::new(),
            error: None,
        },
    ]);
    let question = format!("Protocol {}: {}", protocol.name, join(&tools));
    let (run_id, mut events) = crate::run::run_unattended(
        state,
        caller.clone(),
        Arc::new(script),
        session_id.to_string(),
        question,
        vec![row.id.clone()],
    )
    .await
    .map_err(|e| e.to_string())?;
    let mut answer = None;
    if let (Some(q), Some(factory)) = (&protocol.question, &state.cfg.llm) {
        let llm = (factory.build)().map_err(|e| format!("the reasoning model: {e}"))?;
        let (_, more) = crate::run::run_unattended(
            state,
            caller.clone(),
            llm,
            session_id.to_string(),
            q.clone(),
            vec![row.id.clone()],
        )
        .await
        .map_err(|e| e.to_string())?;
        answer = more
            .iter()
            .find(|e| e["type"] == "final")
            .and_then(|e| e["answer"].as_str())
            .map(str::to_string);
        events.extend(more);
    }
    let rs = results_of(state, caller, protocol, m.source, &events, answer).await?;
    let mut objects = Vec::new();
    for (kind, write) in [
        ("sr", hilum_pacs::sr::write as fn(&ResultSet) -> _),
        ("seg", hilum_pacs::seg::write),
        ("sc", hilum_pacs::sc::write),
    ] {
        if kind == "seg" && rs.segments.is_empty() || kind == "sc" && rs.overlay.is_none() {
            continue;
        }
        let obj = write(&rs).map_err(|e| format!("writing the {kind}: {e}"))?;
        let uid = obj
            .meta()
            .media_storage_sop_instance_uid()
            .trim_end_matches('\0')
            .to_string();
        let bytes = hilum_pacs::to_bytes(&obj).map_err(|e| format!("encoding the {kind}: {e}"))?;
        objects.push((kind, uid, bytes));
    }
    Ok((run_id, objects))
}

fn join(names: &[&String]) -> String {
    if names.is_empty() {
        "no tool".into()
    } else {
        names
            .iter()
            .map(|s| s.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// The run's tool results as a result set.
async fn results_of(
    state: &AppState,
    caller: &Caller,
    protocol: &Protocol,
    source: SourceImage,
    events: &[Value],
    answer: Option<String>,
) -> Result<ResultSet, String> {
    let finished: Vec<&Value> = events
        .iter()
        .filter(|e| e["type"] == "tool_finished")
        .collect();
    let mut model_ids: Vec<String> = Vec::new();
    let mut measurements = Vec::new();
    let mut findings = Vec::new();
    let mut segments = Vec::new();
    let mut overlay = None;
    let (rows, cols) = (source.rows as u32, source.columns as u32);
    for e in &finished {
        let data = &e["data"];
        match e["name"].as_str().unwrap_or("") {
            "classify_chest_xray" => {
                let model = data["model"].as_str().unwrap_or("classifier").to_string();
                for s in data["scores"].as_array().into_iter().flatten() {
                    if let (Some(label), Some(p)) = (s["label"].as_str(), s["probability"].as_f64())
                    {
                        findings.push(Finding::new(label, p, &model));
                    }
                }
                model_ids.push(model);
            }
            "segment_lungs" => {
                for (side, key) in [(Side::Right, "right_lung"), (Side::Left, "left_lung")] {
                    if let Some(px) = data[key]["area_px"].as_u64() {
                        measurements.push(Measurement::lung_area(side, px, "lung-unet"));
                    }
                }
                if let Some(mask) =
                    artifact_mask(state, caller, e, "lung_mask.png", rows, cols).await
                {
                    segments.push(Segment::lungs(mask, "lung-unet"));
                }
                if overlay.is_none() {
                    overlay = artifact_rgb(state, caller, e, "lung_overlay.png").await;
                }
                model_ids.push("lung-unet".into());
            }
            "measure_chest" => {
                if let Some(ctr) = data["cardiothoracic_ratio"].as_f64() {
                    measurements.push(Measurement::cardiothoracic_ratio(ctr, "chestx-det-pspnet"));
                    model_ids.push("chestx-det-pspnet".into());
                }
            }
            _ => {}
        }
    }
    model_ids.sort();
    model_ids.dedup();
    let models = model_ids
        .iter()
        .map(|id| ModelInfo {
            id: id.clone(),
            sha256: state
                .cfg
                .models
                .as_ref()
                .and_then(|p| p.registry().installed(id).ok())
                .map(|m| m.record.sha256)
                .unwrap_or_default(),
        })
        .collect();
    let device = Device::hilum(env!("CARGO_PKG_VERSION"), &state.replica);
    let mut rs = ResultSet::new(source, &protocol.name, device, models);
    rs.measurements = measurements;
    rs.findings = findings;
    rs.segments = segments;
    rs.overlay = overlay;
    rs.question = protocol.question.clone();
    rs.answer = answer;
    rs.research_only = true;
    Ok(rs)
}

async fn artifact_bytes(
    state: &AppState,
    caller: &Caller,
    event: &Value,
    name: &str,
) -> Option<Vec<u8>> {
    let id = event["artifacts"]
        .as_array()?
        .iter()
        .find(|a| a["name"] == name)?["id"]
        .as_str()?
        .to_string();
    state
        .db
        .artifact(caller.token_id.clone(), id)
        .await
        .ok()
        .flatten()
        .map(|(_, b)| b)
}

/// A mask artifact (PNG, non-zero = inside) at the source's size, one byte per pixel.
async fn artifact_mask(
    state: &AppState,
    caller: &Caller,
    event: &Value,
    name: &str,
    rows: u32,
    cols: u32,
) -> Option<Vec<u8>> {
    let png = artifact_bytes(state, caller, event, name).await?;
    let img = image::load_from_memory(&png).ok()?.to_luma8();
    (img.width() == cols && img.height() == rows).then(|| {
        img.into_raw()
            .into_iter()
            .map(|v| u8::from(v > 0))
            .collect()
    })
}

async fn artifact_rgb(
    state: &AppState,
    caller: &Caller,
    event: &Value,
    name: &str,
) -> Option<Overlay> {
    let png = artifact_bytes(state, caller, event, name).await?;
    let img = image::load_from_memory(&png).ok()?.to_rgb8();
    Some(Overlay {
        rows: u16::try_from(img.height()).ok()?,
        columns: u16::try_from(img.width()).ok()?,
        rgb: img.into_raw(),
        description: "Lung fields found by the lung U-Net, drawn over the radiograph".into(),
    })
}

// ---- HTTP: the jobs, and STOW-RS into the node ----

/// The DICOM node's jobs, newest first.
#[derive(serde::Serialize, utoipa::ToSchema)]
pub struct JobList {
    /// The jobs.
    pub jobs: Vec<PacsJob>,
}

// GET /v1/pacs/jobs: the node's jobs.
#[allow(missing_docs, reason = "a doc would become the OpenAPI summary")]
#[utoipa::path(get, path = "/v1/pacs/jobs", tag = "pacs",
    responses((status = 200, description = "The DICOM node's jobs, newest first (no patient data: UIDs, states, protocols)", body = JobList)),
    security(("bearer" = [])))]
pub async fn list_jobs(
    axum::extract::State(state): axum::extract::State<AppState>,
) -> Result<axum::Json<JobList>, crate::error::ApiError> {
    Ok(axum::Json(JobList {
        jobs: state.db.pacs_jobs(200).await?,
    }))
}

// POST /v1/pacs/jobs/{id}/retry: queues a job again.
#[allow(missing_docs, reason = "a doc would become the OpenAPI summary")]
#[utoipa::path(post, path = "/v1/pacs/jobs/{id}/retry", tag = "pacs",
    params(("id" = String, Path, description = "Job id")),
    responses((status = 202, description = "Queued again: the protocol runs (or the results are sent) again"),
               (status = 404, description = "No such job")),
    security(("bearer" = [])))]
pub async fn retry_job(
    axum::extract::State(state): axum::extract::State<AppState>,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> Result<axum::http::StatusCode, crate::error::ApiError> {
    if state.db.pacs_retry(id.clone()).await? {
        Ok(axum::http::StatusCode::ACCEPTED)
    } else {
        Err(crate::error::ApiError::not_found("job", &id))
    }
}

/// What to pull from the PACS.
#[derive(serde::Deserialize, utoipa::ToSchema)]
pub struct Pull {
    /// StudyInstanceUID.
    pub study: String,
}

/// What a pull received.
#[derive(serde::Serialize, utoipa::ToSchema)]
pub struct Pulled {
    /// The job the study was queued as.
    pub job: String,
    /// How many instances were received.
    pub instances: usize,
}

// POST /v1/pacs/pull: retrieves a study from the PACS and queues it.
#[allow(missing_docs, reason = "a doc would become the OpenAPI summary")]
#[utoipa::path(post, path = "/v1/pacs/pull", tag = "pacs",
    request_body = Pull,
    responses((status = 202, description = "The study was retrieved (QIDO-RS + WADO-RS from the node's destination) and queued as a job", body = Pulled),
               (status = 502, description = "The PACS could not be reached or refused"),
               (status = 503, description = "The DICOM node is off or has no destination")),
    security(("bearer" = [])))]
pub async fn pull(
    axum::extract::State(state): axum::extract::State<AppState>,
    axum::Json(req): axum::Json<Pull>,
) -> Result<(axum::http::StatusCode, axum::Json<Pulled>), crate::error::ApiError> {
    use crate::error::ApiError;
    let Some(settings) = state.cfg.pacs.clone() else {
        return Err(ApiError::Unavailable(
            "the DICOM node is off: start hilum serve with --dicom-port".into(),
        ));
    };
    let Some(dest) = settings.destination.clone() else {
        return Err(ApiError::Unavailable(
            "the DICOM node has no PACS to pull from: start hilum serve with --pacs-dest".into(),
        ));
    };
    let mut cfg = dicomweb::DicomWebConfig::new(dest.url.clone());
    if let Some(token) = &dest.bearer {
        cfg = cfg.bearer(token.clone());
    }
    let client =
        dicomweb::DicomWebClient::new(cfg).map_err(|e| ApiError::Internal(e.to_string()))?;
    let dir = settings.storage_dir.join("incoming").join(&req.study);
    let paths = dicomweb::pull_study(&client, &req.study, &dir)
        .await
        .map_err(|e| ApiError::BadGateway(e.to_string()))?;
    let quiet_ms = settings.quiet.as_millis() as i64;
    let mut job = String::new();
    for path in &paths {
        let bytes = std::fs::read(path).map_err(|e| ApiError::Internal(e.to_string()))?;
        let mut row = describe(&bytes, "pull").map_err(ApiError::BadGateway)?;
        row.path = path.display().to_string();
        job = state.db.pacs_record_instance(row, quiet_ms).await?;
    }
    Ok((
        axum::http::StatusCode::ACCEPTED,
        axum::Json(Pulled {
            job,
            instances: paths.len(),
        }),
    ))
}

/// A job's runs as stored events.
#[derive(serde::Serialize, utoipa::ToSchema)]
pub struct JobEvents {
    /// The events, oldest first.
    #[schema(value_type = Vec<Object>)]
    pub events: Vec<Value>,
}

// GET /v1/pacs/jobs/{id}/events: what the job's runs did.
#[allow(missing_docs, reason = "a doc would become the OpenAPI summary")]
#[utoipa::path(get, path = "/v1/pacs/jobs/{id}/events", tag = "pacs",
    params(("id" = String, Path, description = "Job id")),
    responses((status = 200, description = "The events of the job's runs (the protocol's plan, then its question), as stored: what each tool found and the answer", body = JobEvents),
               (status = 404, description = "No such job")),
    security(("bearer" = [])))]
pub async fn job_events(
    axum::extract::State(state): axum::extract::State<AppState>,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> Result<axum::Json<JobEvents>, crate::error::ApiError> {
    match state.db.pacs_job_events(id.clone()).await? {
        Some(events) => Ok(axum::Json(JobEvents { events })),
        None => Err(crate::error::ApiError::not_found("job", &id)),
    }
}

/// STOW-RS (PS3.18 10.5): `POST /dicomweb/studies` with `multipart/related;
/// type="application/dicom"`, as a router or a PACS pushes to an AI node. Each instance is
/// written and recorded before the answer, exactly as a C-STORE is; the answer lists what was
/// stored (ReferencedSOPSequence) and what failed, with why (FailedSOPSequence).
#[utoipa::path(post, path = "/dicomweb/studies", tag = "pacs",
    request_body(content_type = "multipart/related", description = "DICOM Part 10 instances, one per part"),
    responses((status = 200, description = "All stored (DICOM JSON)"),
               (status = 202, description = "Some stored, some failed (DICOM JSON)"),
               (status = 409, description = "None stored (DICOM JSON)"),
               (status = 503, description = "The DICOM node is off: start hilum serve with --dicom-port")),
    security(("bearer" = [])))]
pub async fn stow(
    axum::extract::State(state): axum::extract::State<AppState>,
    headers: axum::http::HeaderMap,
    body: bytes::Bytes,
) -> Result<axum::response::Response, crate::error::ApiError> {
    use axum::response::IntoResponse;
    let Some(settings) = state.cfg.pacs.clone() else {
        return Err(crate::error::ApiError::Unavailable(
            "the DICOM node is off: start hilum serve with --dicom-port to receive studies".into(),
        ));
    };
    let content_type = headers
        .get(axum::http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let parts = hilum_pacs::multipart::parse_related(
        content_type,
        &body,
        settings.max_object_bytes as usize,
    )
    .map_err(|e| crate::error::ApiError::BadRequest(e.to_string()))?;
    let quiet_ms = settings.quiet.as_millis() as i64;
    let mut stored = Vec::new();
    let mut failed = Vec::new();
    for part in parts {
        match store_part(&state, &settings, &part.bytes, quiet_ms).await {
            Ok((class, sop)) => stored.push(json!({
                "00081150": {"vr": "UI", "Value": [class]},
                "00081155": {"vr": "UI", "Value": [sop]},
            })),
            Err(reason) => {
                tracing::info!("STOW-RS: an instance was refused: {reason}");
                // 0xC000: cannot understand (not DICOM, or UIDs missing).
                failed.push(json!({"00081197": {"vr": "US", "Value": [0xC000]}}));
            }
        }
    }
    let status = match (stored.is_empty(), failed.is_empty()) {
        (_, true) => axum::http::StatusCode::OK,
        (false, false) => axum::http::StatusCode::ACCEPTED,
        (true, false) => axum::http::StatusCode::CONFLICT,
    };
    let mut answer = serde_json::Map::new();
    if !stored.is_empty() {
        answer.insert("00081199".into(), json!({"vr": "SQ", "Value": stored}));
    }
    if !failed.is_empty() {
        answer.insert("00081198".into(), json!({"vr": "SQ", "Value": failed}));
    }
    Ok((
        status,
        [(axum::http::header::CONTENT_TYPE, "application/dicom+json")],
        Value::Object(answer).to_string(),
    )
        .into_response())
}

/// Checks, writes and records one STOW-RS instance; returns its SOP class and instance UIDs.
async fn store_part(
    state: &AppState,
    settings: &PacsSettings,
    bytes: &[u8],
    quiet_ms: i64,
) -> Result<(String, String), String> {
    let mut row = describe(bytes, "stow-rs")?;
    let dir = settings.storage_dir.join("incoming").join(&row.study_uid);
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let path = dir.join(format!("{}.dcm", row.sop_instance_uid));
    write_atomic(&path, bytes)?;
    row.path = path.display().to_string();
    let uids = (row.sop_class_uid.clone(), row.sop_instance_uid.clone());
    state
        .db
        .pacs_record_instance(row, quiet_ms)
        .await
        .map_err(|e| e.to_string())?;
    Ok(uids)
}

/// The queue's row for a DICOM object (a Part 10 file or a bare data set), without its path.
fn describe(bytes: &[u8], origin: &str) -> Result<PacsInstance, String> {
    let obj = hilum_pacs::read_dicom(bytes).map_err(|e| e.to_string())?;
    let source = SourceImage::from_object(&obj).map_err(|e| e.to_string())?;
    Ok(PacsInstance {
        sop_instance_uid: source.sop_instance_uid,
        study_uid: source.study.instance_uid,
        series_uid: source.series_instance_uid,
        sop_class_uid: source.sop_class_uid,
        transfer_syntax: obj
            .meta()
            .transfer_syntax()
            .trim_end_matches('\0')
            .to_string(),
        path: String::new(),
        origin: origin.into(),
    })
}
