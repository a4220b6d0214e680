//! The DICOM node's durable queue: received instances and one job per study (schema version 3).
//! Every change is committed before the caller acts on it: an instance row exists before its
//! C-STORE is answered; a job's state moves forward only after the work of the previous state
//! is stored.

use serde::Serialize;

use super::backend::args;
use super::{new_id, now_ms, Db, DbError};

/// One received instance (no patient data: UIDs, classes and where the file is).
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct PacsInstance {
    /// The instance's SOP Instance UID.
    pub sop_instance_uid: String,
    /// Its study's UID.
    pub study_uid: String,
    /// Its series' UID.
    pub series_uid: String,
    /// Its SOP Class UID (what kind of object it is).
    pub sop_class_uid: String,
    /// The transfer syntax UID it was stored in.
    pub transfer_syntax: String,
    /// Where its file is.
    pub path: String,
    /// `c-store:CALLING_AE`, `stow-rs` or `pull`.
    pub origin: String,
}

/// A change of a job ([`Db::pacs_update_job`]): its new state, and each field to set.
#[derive(Clone, Debug, Default)]
pub struct JobUpdate {
    /// The new state (one of [`JOB_STATES`]).
    pub state: &'static str,
    /// What happened, in words.
    pub detail: Option<String>,
    /// The protocol that matched.
    pub protocol: Option<String>,
    /// The run started for the job.
    pub run_id: Option<String>,
    /// The result objects' UIDs (JSON).
    pub results: Option<serde_json::Value>,
    /// When the job is next due, ms since the epoch.
    pub next_ms: Option<i64>,
    /// A send was attempted.
    pub count_attempt: bool,
}

impl JobUpdate {
    /// `state`, saying why in `detail`.
    pub fn to(state: &'static str, detail: impl Into<String>) -> Self {
        JobUpdate {
            state,
            detail: Some(detail.into()),
            ..JobUpdate::default()
        }
    }
}

/// The states of a job, in order.
pub const JOB_STATES: &[&str] = &["received", "queued", "running", "sending", "done", "failed"];

/// One study's job.
#[derive(Clone, Debug, Serialize, PartialEq, utoipa::ToSchema)]
pub struct PacsJob {
    /// The job id.
    pub id: String,
    /// The study it is for.
    pub study_uid: String,
    /// received, queued, running, sending, done or failed.
    pub state: String,
    /// The protocol that matched; none when the study matched none.
    pub protocol: Option<String>,
    /// What happened last, in words (why nothing ran, the last send error, …).
    pub detail: Option<String>,
    /// The durable run of the plan, once started.
    pub run_id: Option<String>,
    /// Send attempts so far.
    pub attempts: i64,
    /// When the job is next due (quiet period, retry backoff), ms since the epoch.
    pub next_ms: i64,
    /// When it was created, ms since the epoch.
    pub created_ms: i64,
    /// When it last changed, ms since the epoch.
    pub updated_ms: i64,
    /// The result objects' UIDs (JSON), once written.
    pub results: Option<serde_json::Value>,
    /// How many instances of the study were received.
    pub instances: i64,
}

const JOB_COLUMNS: &str =
    "j.id, j.study_uid, j.state, j.protocol, j.detail, j.run_id, j.attempts, j.next_ms, \
     j.created_ms, j.updated_ms, j.results, \
     (SELECT COUNT(*) FROM pacs_instances i WHERE i.study_uid = j.study_uid)";

fn job_of(mut r: super::backend::Row) -> Result<PacsJob, DbError> {
    let results: Option<String> = r.get(10)?;
    Ok(PacsJob {
        id: r.get(0)?,
        study_uid: r.get(1)?,
        state: r.get(2)?,
        protocol: r.get(3)?,
        detail: r.get(4)?,
        run_id: r.get(5)?,
        attempts: r.get(6)?,
        next_ms: r.get(7)?,
        created_ms: r.get(8)?,
        updated_ms: r.get(9)?,
        results: results.and_then(|t| serde_json::from_str(&t).ok()),
        instances: r.get(11)?,
    })
}

impl Db {
    /// Records a received instance (a resend of the same SOP Instance UID replaces its row) and
    /// opens or reopens its study's job: `received`, due after `quiet_ms` of no new instance.
    /// A study whose job had ended runs again (its result UIDs are the same, so a resend
    /// replaces the earlier results in the PACS). Returns the job id.
    pub async fn pacs_record_instance(
        &self,
        inst: PacsInstance,
        quiet_ms: i64,
    ) -> Result<String, DbError> {
        self.run(true, move |c| {
            Box::pin(async move {
                let now = now_ms();
                c.execute(
                    "INSERT INTO pacs_instances (sop_instance_uid, study_uid, series_uid, sop_class_uid, transfer_syntax, path, origin, received_ms)
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)
                     ON CONFLICT (sop_instance_uid) DO UPDATE SET study_uid = excluded.study_uid,
                       series_uid = excluded.series_uid, sop_class_uid = excluded.sop_class_uid,
                       transfer_syntax = excluded.transfer_syntax, path = excluded.path,
                       origin = excluded.origin, received_ms = excluded.received_ms",
                    &args![
                        inst.sop_instance_uid,
                        &inst.study_uid,
                        inst.series_uid,
                        inst.sop_class_uid,
                        inst.transfer_syntax,
                        inst.path,
                        inst.origin,
                        now
                    ],
                )
                .await?;
                let due = now + quiet_ms;
                let existing = c
                    .query_opt(
                        "SELECT id, state FROM pacs_jobs WHERE study_uid = ?1",
                        &args![&inst.study_uid],
                    )
                    .await?;
                match existing {
                    None => {
                        let id = new_id("job");
                        c.execute(
                            "INSERT INTO pacs_jobs (id, study_uid, state, attempts, next_ms, created_ms, updated_ms)
                             VALUES (?1, ?2, 'received', 0, ?3, ?4, ?4)",
                            &args![&id, &inst.study_uid, due, now],
                        )
                        .await?;
                        Ok(id)
                    }
                    Some(mut row) => {
                        let id: String = row.get(0)?;
                        let state: String = row.get(1)?;
                        // A job at work keeps its state: the new instance is in the table and
                        // the study's next reception reopens it.
                        if matches!(state.as_str(), "received" | "done" | "failed") {
                            c.execute(
                                "UPDATE pacs_jobs SET state = 'received', next_ms = ?2, attempts = 0,
                                   detail = NULL, updated_ms = ?3 WHERE id = ?1",
                                &args![&id, due, now],
                            )
                            .await?;
                        }
                        Ok(id)
                    }
                }
            })
        })
        .await
    }

    /// Claims the jobs that are due: `received` past their quiet period, `queued` ones (an
    /// explicit trigger, a retry, or work a stopped server left), and `sending` ones whose
    /// retry is due. Each claimed job is moved to `queued` with `next_ms` pushed by `lease_ms`,
    /// so that a second worker does not take it at once.
    pub async fn pacs_claim_due(&self, lease_ms: i64) -> Result<Vec<PacsJob>, DbError> {
        self.run(true, move |c| {
            Box::pin(async move {
                let now = now_ms();
                let rows = c
                    .query(
                        &format!(
                            "SELECT {JOB_COLUMNS} FROM pacs_jobs j
                             WHERE j.state IN ('received', 'queued', 'running', 'sending') AND j.next_ms <= ?1
                             ORDER BY j.next_ms LIMIT 16"
                        ),
                        &args![now],
                    )
                    .await?;
                let mut jobs = Vec::new();
                for r in rows {
                    let mut job = job_of(r)?;
                    let state = if job.state == "sending" {
                        "sending"
                    } else {
                        "queued"
                    };
                    c.execute(
                        "UPDATE pacs_jobs SET state = ?2, next_ms = ?3, updated_ms = ?4 WHERE id = ?1",
                        &args![&job.id, state, now + lease_ms, now],
                    )
                    .await?;
                    job.state = state.to_string();
                    jobs.push(job);
                }
                Ok(jobs)
            })
        })
        .await
    }

    /// Moves a job on: its new state and what else changed (`None` keeps a value).
    pub async fn pacs_update_job(&self, id: String, u: JobUpdate) -> Result<(), DbError> {
        self.run(false, move |c| {
            Box::pin(async move {
                let now = now_ms();
                c.execute(
                    "UPDATE pacs_jobs SET state = ?2, detail = COALESCE(?3, detail),
                       protocol = COALESCE(?4, protocol), run_id = COALESCE(?5, run_id),
                       results = COALESCE(?6, results), next_ms = COALESCE(?7, next_ms),
                       attempts = attempts + ?8, updated_ms = ?9 WHERE id = ?1",
                    &args![
                        id,
                        u.state,
                        u.detail,
                        u.protocol,
                        u.run_id,
                        u.results.map(|r| r.to_string()),
                        u.next_ms,
                        u.count_attempt as i64,
                        now
                    ],
                )
                .await?;
                Ok(())
            })
        })
        .await
    }

    /// Jobs, newest first.
    pub async fn pacs_jobs(&self, limit: i64) -> Result<Vec<PacsJob>, DbError> {
        self.run(false, move |c| {
            Box::pin(async move {
                c.query(
                    &format!(
                        "SELECT {JOB_COLUMNS} FROM pacs_jobs j ORDER BY j.created_ms DESC LIMIT ?1"
                    ),
                    &args![limit],
                )
                .await?
                .into_iter()
                .map(job_of)
                .collect()
            })
        })
        .await
    }

    /// One job by id; none if there is no such job.
    pub async fn pacs_job(&self, id: String) -> Result<Option<PacsJob>, DbError> {
        self.run(false, move |c| {
            Box::pin(async move {
                c.query_opt(
                    &format!("SELECT {JOB_COLUMNS} FROM pacs_jobs j WHERE j.id = ?1"),
                    &args![id],
                )
                .await?
                .map(job_of)
                .transpose()
            })
        })
        .await
    }

    /// Queues a job again (a failed send, or a study to rerun). Returns false for an unknown id.
    pub async fn pacs_retry(&self, id: String) -> Result<bool, DbError> {
        self.run(false, move |c| {
            Box::pin(async move {
                let now = now_ms();
                let n = c
                    .execute(
                        "UPDATE pacs_jobs SET state = 'queued', next_ms = ?2, attempts = 0,
                           detail = 'queued again by a retry', updated_ms = ?2 WHERE id = ?1",
                        &args![id, now],
                    )
                    .await?;
                Ok(n > 0)
            })
        })
        .await
    }

    /// The stored events of a job's runs (the plan's, then the question's), oldest first;
    /// `None` for an unknown job.
    pub async fn pacs_job_events(
        &self,
        id: String,
    ) -> Result<Option<Vec<serde_json::Value>>, DbError> {
        let Some(job) = self.pacs_job(id).await? else {
            return Ok(None);
        };
        let runs: Vec<String> = job
            .results
            .as_ref()
            .and_then(|r| r["runs"].as_array())
            .map(|a| {
                a.iter()
                    .filter_map(|v| v.as_str().map(str::to_string))
                    .collect()
            })
            .or_else(|| job.run_id.clone().map(|r| vec![r]))
            .unwrap_or_default();
        self.run(false, move |c| {
            Box::pin(async move {
                let mut events = Vec::new();
                for run in runs {
                    for mut r in c
                        .query(
                            "SELECT body FROM events WHERE run_id = ?1 ORDER BY seq",
                            &args![run],
                        )
                        .await?
                    {
                        let body: String = r.get(0)?;
                        events.push(
                            serde_json::from_str(&body)
                                .map_err(|e| DbError::Corrupt(e.to_string()))?,
                        );
                    }
                }
                Ok(Some(events))
            })
        })
        .await
    }

    /// The instances of a study, oldest first.
    pub async fn pacs_instances(&self, study_uid: String) -> Result<Vec<PacsInstance>, DbError> {
        self.run(false, move |c| {
            Box::pin(async move {
                c.query(
                    "SELECT sop_instance_uid, study_uid, series_uid, sop_class_uid, transfer_syntax, path, origin
                     FROM pacs_instances WHERE study_uid = ?1 ORDER BY received_ms, sop_instance_uid",
                    &args![study_uid],
                )
                .await?
                .into_iter()
                .map(|mut r| {
                    Ok(PacsInstance {
                        sop_instance_uid: r.get(0)?,
                        study_uid: r.get(1)?,
                        series_uid: r.get(2)?,
                        sop_class_uid: r.get(3)?,
                        transfer_syntax: r.get(4)?,
                        path: r.get(5)?,
                        origin: r.get(6)?,
                    })
                })
                .collect()
            })
        })
        .await
    }
}
