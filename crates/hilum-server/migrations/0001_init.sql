-- Hilum server schema, version 1. Times are milliseconds since the Unix epoch (UTC).
-- Nothing here holds a secret in clear: tokens are stored as SHA-256 hashes.

CREATE TABLE tokens (
    id          TEXT PRIMARY KEY,
    name        TEXT NOT NULL,
    hash        TEXT NOT NULL UNIQUE,
    admin       INTEGER NOT NULL DEFAULT 0,
    created_ms  INTEGER NOT NULL,
    revoked_ms  INTEGER
);

-- Uploaded files, per token. The same file uploaded by two tokens is two rows: ids are
-- content hashes, ownership is what isolates tenants. No file names (they can hold PHI).
CREATE TABLE images (
    token_id    TEXT NOT NULL REFERENCES tokens(id),
    image_id    TEXT NOT NULL,
    media_type  TEXT NOT NULL,
    size        INTEGER NOT NULL,
    width       INTEGER NOT NULL,
    height      INTEGER NOT NULL,
    bit_depth   INTEGER NOT NULL,
    format      TEXT NOT NULL,
    bytes       BLOB NOT NULL,
    created_ms  INTEGER NOT NULL,
    PRIMARY KEY (token_id, image_id)
);

CREATE TABLE sessions (
    id          TEXT PRIMARY KEY,
    token_id    TEXT NOT NULL REFERENCES tokens(id),
    title       TEXT NOT NULL DEFAULT '',
    created_ms  INTEGER NOT NULL,
    updated_ms  INTEGER NOT NULL
);
CREATE INDEX sessions_by_token ON sessions(token_id, created_ms);

-- One question and the agent's run that answered it.
CREATE TABLE runs (
    id          TEXT PRIMARY KEY,
    session_id  TEXT NOT NULL REFERENCES sessions(id),
    question    TEXT NOT NULL,
    images      TEXT NOT NULL,
    model       TEXT NOT NULL,
    status      TEXT NOT NULL,
    answer      TEXT,
    error       TEXT,
    started_ms  INTEGER NOT NULL,
    finished_ms INTEGER
);
CREATE INDEX runs_by_session ON runs(session_id, started_ms);

-- The conversation as the model sees it (hilum_llm::Message as JSON), in order.
CREATE TABLE messages (
    session_id  TEXT NOT NULL REFERENCES sessions(id),
    seq         INTEGER NOT NULL,
    run_id      TEXT NOT NULL,
    role        TEXT NOT NULL,
    body        TEXT NOT NULL,
    created_ms  INTEGER NOT NULL,
    PRIMARY KEY (session_id, seq)
);

-- Every event of every run, as streamed.
CREATE TABLE events (
    run_id      TEXT NOT NULL REFERENCES runs(id),
    seq         INTEGER NOT NULL,
    type        TEXT NOT NULL,
    body        TEXT NOT NULL,
    PRIMARY KEY (run_id, seq)
);

-- Tool calls from runs and direct calls (REST and MCP), with arguments, timing and result.
CREATE TABLE tool_calls (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    token_id    TEXT NOT NULL,
    session_id  TEXT,
    run_id      TEXT,
    call_id     TEXT NOT NULL,
    tool        TEXT NOT NULL,
    arguments   TEXT NOT NULL,
    ok          INTEGER NOT NULL,
    error_kind  TEXT,
    ms          REAL NOT NULL,
    result      TEXT NOT NULL,
    created_ms  INTEGER NOT NULL
);

CREATE TABLE artifacts (
    id          TEXT PRIMARY KEY,
    token_id    TEXT NOT NULL,
    session_id  TEXT,
    run_id      TEXT,
    call_id     TEXT NOT NULL,
    tool        TEXT NOT NULL,
    name        TEXT NOT NULL,
    media_type  TEXT NOT NULL,
    kind        TEXT NOT NULL,
    bytes       BLOB NOT NULL,
    created_ms  INTEGER NOT NULL
);
CREATE INDEX artifacts_by_session ON artifacts(session_id);

-- Append-only audit log: who did what, when, with which outcome. De-identified arguments only.
CREATE TABLE audit (
    seq         INTEGER PRIMARY KEY AUTOINCREMENT,
    ts_ms       INTEGER NOT NULL,
    actor       TEXT NOT NULL,
    session_id  TEXT,
    run_id      TEXT,
    kind        TEXT NOT NULL,
    name        TEXT NOT NULL,
    arguments   TEXT NOT NULL,
    outcome     TEXT NOT NULL,
    duration_ms REAL NOT NULL
);
CREATE TRIGGER audit_no_update BEFORE UPDATE ON audit
BEGIN SELECT RAISE(ABORT, 'the audit log is append-only'); END;
CREATE TRIGGER audit_no_delete BEFORE DELETE ON audit
BEGIN SELECT RAISE(ABORT, 'the audit log is append-only'); END;
