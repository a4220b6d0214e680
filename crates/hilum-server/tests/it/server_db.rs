//! The database under the service, on SQLite and on a real PostgreSQL server
//! (HILUM_TEST_POSTGRES_URL; scripts/setup_postgres.sh starts one): the append-only audit
//! table, migrations, token revocation through the authentication cache, and two server
//! replicas sharing one database.

use crate::common;

use std::time::{Duration, Instant};

use common::*;
use hilum_server::Db;
use serde_json::{json, Value};

const IMG: &str = "kermany_person1946_bacteria_4874.jpeg";

on_both_databases!(audit_rows_cannot_be_changed_or_deleted);
async fn audit_rows_cannot_be_changed_or_deleted(db: &TestDb) {
    let srv = start(config_url(&db.url, None)).await;
    let tok = token(&srv.state, "alice");
    let client = reqwest::Client::new();
    let (img, _) = upload_id(&client, &srv, &tok, IMG).await;
    let resp = call_tool(&client, &srv, &tok, "image_info", &json!({"image": img})).await;
    assert_eq!(resp.status(), 200);
    srv.stop().await;

    // A second handle, as an operator with SQL access would have.
    let raw = Db::open(&db.url).expect("open");
    let before = raw.audit_since(0, 100).expect("audit");
    assert_eq!(before.len(), 2, "upload + tool call");
    for sql in [
        "UPDATE audit SET outcome = 'tampered'",
        "DELETE FROM audit",
        "DELETE FROM audit WHERE kind = 'upload'",
    ] {
        let err = raw
            .execute_sql(sql)
            .expect_err(&format!("`{sql}` must be refused"))
            .to_string();
        assert!(err.contains("append-only"), "{sql}: {err}");
    }
    if db.is_postgres() {
        // Statement-level triggers: refused even when no row matches, and TRUNCATE too.
        for sql in [
            "UPDATE audit SET outcome = 'tampered' WHERE seq < 0",
            "TRUNCATE audit",
        ] {
            let err = raw
                .execute_sql(sql)
                .expect_err(&format!("`{sql}` must be refused"))
                .to_string();
            assert!(err.contains("append-only"), "{sql}: {err}");
        }
    }
    let after = raw.audit_since(0, 100).expect("audit");
    assert_eq!(
        serde_json::to_value(&before).expect("json"),
        serde_json::to_value(&after).expect("json")
    );
}

on_both_databases!(reopening_keeps_data_and_runs_each_migration_once);
async fn reopening_keeps_data_and_runs_each_migration_once(db: &TestDb) {
    let first = Db::open(&db.url).expect("open");
    let (id, _) = first.create_token("alice", false).expect("token");
    drop(first);
    // Two more opens, as replicas starting one after another.
    let _second = Db::open(&db.url).expect("reopen");
    let third = Db::open(&db.url).expect("reopen again");
    let tokens = third.list_tokens().expect("tokens");
    assert_eq!(tokens.len(), 1);
    assert_eq!(tokens[0].id, id);
    let applied = third
        .execute_sql("UPDATE schema_migrations SET applied_ms = applied_ms")
        .expect("count migrations");
    assert_eq!(applied, 3, "one row per schema version");
}

on_both_databases!(revoked_token_is_refused_at_once_despite_the_cache);
async fn revoked_token_is_refused_at_once_despite_the_cache(db: &TestDb) {
    let mut cfg = config_url(&db.url, None);
    // Long enough that only the immediate path can pass the first half of this test.
    cfg.revocation_poll = Duration::from_secs(3600);
    let srv = start(cfg).await;
    let (alice_id, alice) = srv.state.db().create_token("alice", false).expect("token");
    let bob = token(&srv.state, "bob");
    let client = reqwest::Client::new();
    let status = |tok: String| {
        let client = client.clone();
        let url = srv.url("/v1/sessions");
        async move {
            client
                .get(url)
                .bearer_auth(tok)
                .send()
                .await
                .expect("request")
                .status()
                .as_u16()
        }
    };
    // Cached as valid now.
    assert_eq!(status(alice.clone()).await, 200);
    assert_eq!(status(alice.clone()).await, 200);
    assert!(srv.state.revoke_token(&alice_id).expect("revoke"));
    assert_eq!(status(alice.clone()).await, 401, "revoked: refused at once");
    assert_eq!(
        status(bob.clone()).await,
        200,
        "other tokens are unaffected"
    );
    assert!(
        !srv.state.revoke_token(&alice_id).expect("revoke again"),
        "revoking twice reports that it was already revoked"
    );
    let unknown = srv.state.revoke_token("tok_nope").expect_err("unknown id");
    assert!(unknown.to_string().contains("token list"), "{unknown}");

    let listed = srv.state.db().list_tokens().expect("list");
    assert_eq!(listed.len(), 2);
    let alice_row = listed.iter().find(|t| t.id == alice_id).expect("alice");
    assert!(alice_row.revoked_ms.is_some());
    let dump = serde_json::to_string(&listed).expect("json");
    assert!(!dump.contains(&alice) && !dump.contains(&bob), "no secrets");
    assert!(!dump.contains("hash"), "no hashes either");
    srv.stop().await;
}

on_both_databases!(a_token_revoked_elsewhere_is_refused_within_the_poll);
async fn a_token_revoked_elsewhere_is_refused_within_the_poll(db: &TestDb) {
    let mut cfg = config_url(&db.url, None);
    cfg.revocation_poll = Duration::from_millis(100);
    let srv = start(cfg).await;
    let (id, tok) = srv.state.db().create_token("ws-1", false).expect("token");
    let client = reqwest::Client::new();
    let get = || client.get(srv.url("/v1/images")).bearer_auth(&tok).send();
    assert_eq!(get().await.expect("req").status(), 200, "now in the cache");
    // What `hilum serve token revoke` does: another process, its own database handle.
    let cli = Db::open(&db.url).expect("open");
    assert!(cli.revoke_token(&id).expect("revoke"));
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let status = get().await.expect("req").status().as_u16();
        if status == 401 {
            break;
        }
        assert_eq!(status, 200);
        assert!(
            Instant::now() < deadline,
            "the revoked token still works 10 s later"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    srv.stop().await;
}

on_both_databases!(two_replicas_share_sessions_images_and_the_audit_log);
async fn two_replicas_share_sessions_images_and_the_audit_log(db: &TestDb) {
    let script = write_script(
        db.dir.path(),
        json!([
            {"content": "Measuring.", "tool_calls": [{"name": "image_info", "arguments": {"image": "$IMAGE"}}]},
            {"content": "Measured."}
        ]),
    );
    let mut cfg = config_url(&db.url, Some(&script));
    cfg.revocation_poll = Duration::from_millis(100);
    let a = start(cfg.clone()).await;
    let b = start(cfg).await;
    let tok = token(&a.state, "alice");
    let client = reqwest::Client::new();

    // B has built alice's space (empty) before the upload through A.
    let empty: Value = get_json(&client, b.url("/v1/tools"), &tok).await;
    assert!(empty["tools"].as_array().is_some_and(|t| !t.is_empty()));
    let (img, row) = upload_id(&client, &a, &tok, IMG).await;
    let ses = new_session(&client, &a, &tok).await;

    let through_b = client
        .get(b.url(&format!("/v1/sessions/{ses}")))
        .bearer_auth(&tok)
        .send()
        .await
        .expect("session");
    assert_eq!(
        through_b.status(),
        200,
        "a session made on A is readable on B"
    );
    let listed: Value = get_json(&client, b.url("/v1/images"), &tok).await;
    assert_eq!(listed["images"][0]["id"], img.as_str());

    // B answers in A's session with A's upload, and A then sees B's answer.
    let events = ask_ndjson(&client, &b, &tok, &ses, "size?", &[&img]).await;
    let info = events
        .iter()
        .find(|e| e["type"] == "tool_finished" && e["name"] == "image_info")
        .expect("image_info ran on B");
    assert_eq!(info["data"]["width"], row["width"]);
    let msgs: Value = get_json(
        &client,
        a.url(&format!("/v1/sessions/{ses}/messages")),
        &tok,
    )
    .await;
    let last = msgs["messages"]
        .as_array()
        .and_then(|m| m.last())
        .expect("messages");
    assert_eq!(last["message"]["content"], "Measured.");

    // Direct calls on both replicas at once: every call has exactly one audit row.
    let n_each = 12;
    let args = json!({"image": img});
    let mut calls = Vec::new();
    for srv in [&a, &b] {
        for _ in 0..n_each {
            calls.push(call_tool(&client, srv, &tok, "image_info", &args));
        }
    }
    for resp in futures::future::join_all(calls).await {
        assert_eq!(resp.status(), 200);
    }
    let audit = a.state.db().audit_since(0, 10_000).expect("audit");
    let tool_calls = audit.iter().filter(|r| r.kind == "tool_call").count();
    assert_eq!(
        tool_calls,
        2 * n_each + 1,
        "one row per call, on either replica"
    );
    let seqs: Vec<i64> = audit.iter().map(|r| r.seq).collect();
    assert!(seqs.windows(2).all(|w| w[0] < w[1]), "{seqs:?}");
    assert_eq!(
        b.state.db().audit_since(0, 10_000).expect("audit").len(),
        audit.len(),
        "both replicas read the same log"
    );

    // A token revoked through B stops working on A too.
    let (id, other) = a.state.db().create_token("ws-2", false).expect("token");
    let on_a = || client.get(a.url("/v1/sessions")).bearer_auth(&other).send();
    assert_eq!(on_a().await.expect("req").status(), 200);
    assert!(b.state.revoke_token(&id).expect("revoke"));
    let deadline = Instant::now() + Duration::from_secs(10);
    while on_a().await.expect("req").status() != 401 {
        assert!(
            Instant::now() < deadline,
            "A still accepts a token revoked on B"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    a.stop().await;
    b.stop().await;
}

on_both_databases!(a_version_1_database_upgrades_and_its_running_runs_become_interrupted);
async fn a_version_1_database_upgrades_and_its_running_runs_become_interrupted(db: &TestDb) {
    // A database as schema version 1 left it, with a run its server was running when it died.
    let rows = "
        CREATE TABLE schema_migrations (version BIGINT PRIMARY KEY, applied_ms BIGINT NOT NULL);
        INSERT INTO schema_migrations (version, applied_ms) VALUES (1, 1);
        INSERT INTO tokens (id, name, hash, admin, created_ms) VALUES ('tok_old', 'old', 'h', 0, 1);
        INSERT INTO sessions (id, token_id, title, created_ms, updated_ms)
            VALUES ('ses_old', 'tok_old', '', 1, 1);
        INSERT INTO runs (id, session_id, question, images, model, status, started_ms)
            VALUES ('run_old', 'ses_old', 'q', '[]', 'm', 'running', 1);
        INSERT INTO runs (id, session_id, question, images, model, status, answer, started_ms, finished_ms)
            VALUES ('run_done', 'ses_old', 'q', '[]', 'm', 'completed', 'a', 1, 2);";
    if db.is_postgres() {
        db.pg_batch(&format!(
            "{}; {rows}",
            include_str!("../../migrations/postgres/0001_init.sql")
        ))
        .expect("version 1 schema");
    } else {
        let path = db.url.trim_start_matches("sqlite://");
        let c = rusqlite::Connection::open(path).expect("open");
        c.execute_batch(&format!(
            "{}; {rows}",
            include_str!("../../migrations/0001_init.sql")
        ))
        .expect("version 1 schema");
    }

    let upgraded = Db::open(&db.url).expect("upgrade to the current schema");
    let applied = upgraded
        .execute_sql("UPDATE schema_migrations SET applied_ms = applied_ms")
        .expect("count migrations");
    assert_eq!(applied, 3);
    // A run with no heartbeat at all (version 1 had none) was left by a server that is gone.
    let marked = upgraded
        .interrupt_stale_runs("srv_new".into(), hilum_server::db::now_ms() - 30_000)
        .await
        .expect("mark");
    assert_eq!(marked, 1);
    let runs = upgraded.runs("ses_old".into()).await.expect("runs");
    let status = |id: &str| {
        runs.iter()
            .find(|r| r.id == id)
            .map(|r| r.status.clone())
            .unwrap_or_default()
    };
    assert_eq!(status("run_old"), "interrupted");
    assert_eq!(status("run_done"), "completed");
}

on_both_databases!(a_live_servers_run_is_never_taken_as_stale);
async fn a_live_servers_run_is_never_taken_as_stale(db: &TestDb) {
    let d = Db::open(&db.url).expect("open");
    let (tok, _) = d.create_token("alice", false).expect("token");
    let ses = d.create_session(tok, String::new()).await.expect("session");
    for (run, owner) in [("run_a", "srv_a"), ("run_b", "srv_b")] {
        d.insert_run(
            ses.id.clone(),
            run.into(),
            "q".into(),
            vec![],
            "m".into(),
            owner.into(),
        )
        .await
        .expect("run");
    }
    // srv_a keeps its heartbeat fresh; srv_b's stopped 10 s ago.
    d.execute_sql(&format!(
        "UPDATE runs SET heartbeat_ms = {} WHERE id = 'run_b'",
        hilum_server::db::now_ms() - 10_000
    ))
    .expect("age");
    assert_eq!(d.heartbeat("srv_a".into()).await.expect("beat"), 1);
    let stale_before = hilum_server::db::now_ms() - 5_000;
    let marked = d
        .interrupt_stale_runs("srv_c".into(), stale_before)
        .await
        .expect("mark");
    assert_eq!(marked, 1, "only the run whose heartbeat is stale");
    let runs = d.runs(ses.id.clone()).await.expect("runs");
    let a = runs.iter().find(|r| r.id == "run_a").expect("run_a");
    let b = runs.iter().find(|r| r.id == "run_b").expect("run_b");
    assert_eq!(a.status, "running");
    assert_eq!(b.status, "interrupted");
}
