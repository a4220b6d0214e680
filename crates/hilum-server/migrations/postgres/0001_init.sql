-- Hilum server schema, version 1, PostgreSQL dialect of ../0001_init.sql (same tables,
-- columns and meaning; integers are BIGINT, blobs BYTEA, reals DOUBLE PRECISION).
-- Times are milliseconds since the Unix epoch (UTC). Tokens are stored as SHA-256 hashes.

CREATE TABLE tokens (
    id          TEXT PRIMARY KEY,
    name        TEXT NOT NULL,
    hash        TEXT NOT NULL UNIQUE,
    admin       BIGINT NOT NULL DEFAULT 0,
    created_ms  BIGINT NOT NULL,
    revoked_ms  BIGINT
);

CREATE TABLE images (
    token_id    TEXT NOT NULL REFERENCES tokens(id),
    image_id    TEXT NOT NULL,
    media_type  TEXT NOT NULL,
    size        BIGINT NOT NULL,
    width       BIGINT NOT NULL,
    height      BIGINT NOT NULL,
    bit_depth   BIGINT NOT NULL,
    format      TEXT NOT NULL,
    bytes       BYTEA NOT NULL,
    created_ms  BIGINT NOT NULL,
    PRIMARY KEY (token_id, image_id)
);

CREATE TABLE sessions (
    id          TEXT PRIMARY KEY,
    token_id    TEXT NOT NULL REFERENCES tokens(id),
    title       TEXT NOT NULL DEFAULT '',
    created_ms  BIGINT NOT NULL,
    updated_ms  BIGINT NOT NULL
);
CREATE INDEX sessions_by_token ON sessions(token_id, created_ms);

CREATE TABLE runs (
    id          TEXT PRIMARY KEY,
    session_id  TEXT NOT NULL REFERENCES sessions(id),
    question    TEXT NOT NULL,
    images      TEXT NOT NULL,
    model       TEXT NOT NULL,
    status      TEXT NOT NULL,
    answer      TEXT,
    error       TEXT,
    started_ms  BIGINT NOT NULL,
    finished_ms BIGINT
);
CREATE INDEX runs_by_session ON runs(session_id, started_ms);

CREATE TABLE messages (
    session_id  TEXT NOT NULL REFERENCES sessions(id),
    seq         BIGINT NOT NULL,
    run_id      TEXT NOT NULL,
    role        TEXT NOT NULL,
    body        TEXT NOT NULL,
    created_ms  BIGINT NOT NULL,
    PRIMARY KEY (session_id, seq)
);

CREATE TABLE events (
    run_id      TEXT NOT NULL REFERENCES runs(id),
    seq         BIGINT NOT NULL,
    type        TEXT NOT NULL,
    body        TEXT NOT NULL,
    PRIMARY KEY (run_id, seq)
);

CREATE TABLE tool_calls (
    id          BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    token_id    TEXT NOT NULL,
    session_id  TEXT,
    run_id      TEXT,
    call_id     TEXT NOT NULL,
    tool        TEXT NOT NULL,
    arguments   TEXT NOT NULL,
    ok          BIGINT NOT NULL,
    error_kind  TEXT,
    ms          DOUBLE PRECISION NOT NULL,
    result      TEXT NOT NULL,
    created_ms  BIGINT NOT NULL
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
    bytes       BYTEA NOT NULL,
    created_ms  BIGINT NOT NULL
);
CREATE INDEX artifacts_by_session ON artifacts(session_id);

-- Append-only audit log. Statement-level triggers refuse every UPDATE, DELETE and TRUNCATE,
-- even one that matches no row.
CREATE TABLE audit (
    seq         BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    ts_ms       BIGINT NOT NULL,
    actor       TEXT NOT NULL,
    session_id  TEXT,
    run_id      TEXT,
    kind        TEXT NOT NULL,
    name        TEXT NOT NULL,
    arguments   TEXT NOT NULL,
    outcome     TEXT NOT NULL,
    duration_ms DOUBLE PRECISION NOT NULL
);
CREATE FUNCTION hilum_audit_is_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'the audit log is append-only';
END
$$;
CREATE TRIGGER audit_no_update BEFORE UPDATE ON audit
    FOR EACH STATEMENT EXECUTE FUNCTION hilum_audit_is_append_only();
CREATE TRIGGER audit_no_delete BEFORE DELETE ON audit
    FOR EACH STATEMENT EXECUTE FUNCTION hilum_audit_is_append_only();
CREATE TRIGGER audit_no_truncate BEFORE TRUNCATE ON audit
    FOR EACH STATEMENT EXECUTE FUNCTION hilum_audit_is_append_only();
