-- Version 3, PostgreSQL dialect of ../0003_pacs.sql (integers are BIGINT): the DICOM node's queue.
-- the C-STORE or STOW-RS that brought it is answered. Each study is one job that moves
-- received → queued → running → sending → done / failed; `next_ms` is when a job waiting for
-- its quiet period or for a send retry is due; `results` lists the result objects' UIDs (JSON).
CREATE TABLE pacs_instances (
    sop_instance_uid TEXT PRIMARY KEY,
    study_uid TEXT NOT NULL,
    series_uid TEXT NOT NULL,
    sop_class_uid TEXT NOT NULL,
    transfer_syntax TEXT NOT NULL,
    path TEXT NOT NULL,
    origin TEXT NOT NULL,
    received_ms BIGINT NOT NULL
);
CREATE INDEX pacs_instances_by_study ON pacs_instances(study_uid);
CREATE TABLE pacs_jobs (
    id TEXT PRIMARY KEY,
    study_uid TEXT NOT NULL UNIQUE,
    state TEXT NOT NULL,
    protocol TEXT,
    detail TEXT,
    run_id TEXT,
    attempts BIGINT NOT NULL DEFAULT 0,
    next_ms BIGINT NOT NULL,
    created_ms BIGINT NOT NULL,
    updated_ms BIGINT NOT NULL,
    results TEXT
);
CREATE INDEX pacs_jobs_by_state ON pacs_jobs(state, next_ms)
