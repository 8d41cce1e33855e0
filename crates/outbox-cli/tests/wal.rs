//! `outbox relay` in WAL mode, as an operator runs it: `mode = "wal"` in the config file, the
//! same destinations as polling mode, table rows and table-less logical messages both delivered,
//! `outbox status` and `outbox wal status` showing the slot; a dropped slot is refused with the
//! recovery named, and `outbox wal recover` delivers what the table still holds.
//!
//! Runs against the throwaway `wal_level=logical` cluster of `scripts/pg-logical.sh`.

mod common;

use common::{Killed, jsonl, outbox, text};
use outbox_testkit::logical_cluster_url as cluster_url;

use std::process::Stdio;
use std::time::{Duration, Instant};

use outbox_postgresql::PgStore;
use outbox_types::{NewEvent, Store};

/// A WAL test's outbox: a migrated schema `outbox_t_<tag>_<pid>` on the logical cluster and
/// the slot (also the publication and message prefix) `owt_<slot>_<pid>` its relays use, and a
/// directory for the test's files.
struct WalOutbox {
    url: String,
    schema: String,
    slot: String,
    store: PgStore,
    dir: tempfile::TempDir,
}

impl WalOutbox {
    async fn new(schema_tag: &str, slot_tag: &str) -> WalOutbox {
        let url = cluster_url();
        let id = std::process::id();
        let schema = format!("outbox_t_{schema_tag}_{id}");
        let slot = format!("owt_{slot_tag}_{id}");
        let store = common::migrated_store(&url, &schema).await;
        WalOutbox {
            url,
            schema,
            slot,
            store,
            dir: tempfile::tempdir().unwrap(),
        }
    }

    /// Write `<name>.toml` in the test's directory: WAL mode streaming table rows and messages
    /// into the file `out`, with `relay` and `wal` (the scenario's own lines) added to those
    /// tables; its path.
    fn file_config(&self, name: &str, out: &std::path::Path, relay: &str, wal: &str) -> String {
        let WalOutbox {
            url,
            schema,
            slot,
            dir,
            ..
        } = self;
        let head = common::wal_config(
            url,
            schema,
            slot,
            &format!("{relay}publish_timeout = \"5s\"\n"),
            &format!("sources = [\"table\", \"messages\"]\nmessage_prefix = \"{slot}\"\n{wal}"),
        );
        let path = common::write_file(
            dir.path(),
            &format!("{name}.toml"),
            &format!(
                r#"{head}
[destinations.file]
type = "file"
path = "{}"
sync = true
"#,
                out.display()
            ),
        );
        path.to_str().unwrap().to_owned()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_streams_table_rows_and_messages_and_recovers_a_lost_slot() {
    let wal = WalOutbox::new("cliwal", "cli").await;
    let (slot, store) = (wal.slot.as_str(), &wal.store);
    let out = wal.dir.path().join("events.jsonl");
    let config = wal.file_config("outbox", &out, "", "");

    // The suite's database allows only superusers to write messages (scripts/pg-logical.sh):
    // nothing to fix, and the replication connection is encrypted without being asked to.
    let o = outbox(&["wal", "prepare", "--config", &config]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(!text(&o).contains("REVOKE"), "{}", text(&o));
    if std::env::var("OUTBOX_WAL_TEST_URL").is_err() {
        common::assert_contains(&text(&o), "replication connection: TLS");
    }

    // This streaming relay runs on a pool of two workers (`--worker-threads 2`, as
    // `OUTBOX_WORKER_THREADS`); the takeover test below and `outbox-verify --mode wal` run the
    // default, every task on the main thread.
    let relay = Killed(
        common::relay_command(&config, "warn")
            .env("OUTBOX_WORKER_THREADS", "2")
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap(),
    );

    // Ten table rows and ten logical messages, one rolled-back transaction of each.
    common::enqueue_order_updates(store, 0..10).await;
    let mut tx = store.pool().begin().await.unwrap();
    for n in 0..10u32 {
        let e = NewEvent::new("cart", "c1", "CartUpdated", &serde_json::json!({ "n": n })).unwrap();
        outbox_wal::enqueue_message(&mut *tx, slot, &e)
            .await
            .unwrap();
    }
    tx.commit().await.unwrap();
    let mut tx = store.pool().begin().await.unwrap();
    let ghost = NewEvent::new("order", "o1", "Ghost", &serde_json::json!({})).unwrap();
    store.outbox().enqueue(&mut *tx, &ghost).await.unwrap();
    outbox_wal::enqueue_message(&mut *tx, slot, &ghost)
        .await
        .unwrap();
    tx.rollback().await.unwrap();

    let deadline = Instant::now() + Duration::from_secs(60);
    while jsonl(&out).len() < 20 {
        assert!(Instant::now() < deadline, "only {:?}", jsonl(&out).len());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let got = jsonl(&out);
    assert!(got.iter().all(|e| e["event_type"] != "Ghost"), "{got:?}");
    for (aggregate, kind) in [("o1", "OrderUpdated"), ("c1", "CartUpdated")] {
        let ns: Vec<u64> = got
            .iter()
            .filter(|e| e["aggregate_id"] == aggregate)
            .map(|e| e["payload"]["n"].as_u64().unwrap())
            .collect();
        assert_eq!(ns, (0..10).collect::<Vec<_>>(), "{kind} in commit order");
    }
    // Table rows are marked delivered before their position is confirmed.
    common::stats_until(
        store,
        Duration::from_secs(30),
        "the table rows marked delivered",
        |stats| stats.delivered >= 10,
    )
    .await;

    let o = outbox(&["status", "--config", &config, "--json"]);
    assert!(o.status.success(), "{}", text(&o));
    let status: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(status["wal"]["slot"], slot, "{status}");
    assert_eq!(status["wal"]["exists"], true, "{status}");
    assert_eq!(status["wal"]["active"], true, "a relay streams: {status}");
    let o = outbox(&["wal", "status", "--config", &config]);
    assert!(o.status.success(), "{}", text(&o));
    common::assert_contains(&text(&o), "wal lag");
    common::assert_contains(
        &text(&o),
        "message source  on; only superusers may write messages",
    );

    // Stop the relay, lose the slot, write more: a restart refuses and names the recovery.
    drop(relay);
    tokio::time::sleep(Duration::from_millis(300)).await;
    // The slot is lost behind our back (an operator, a failover to a replica without it).
    sqlx::query("SELECT pg_drop_replication_slot($1)")
        .bind(slot)
        .execute(store.pool())
        .await
        .unwrap();
    common::enqueue_order_updates(store, 10..15).await;
    let o = outbox(&["relay", "--config", &config, "--drain"]);
    common::exits_2_saying(&o, "outbox wal recover");

    let o = outbox(&["wal", "recover", "--config", &config, "--json"]);
    assert!(o.status.success(), "{}", text(&o));
    let report: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(report["redelivered"], 5, "{report}");
    let got = jsonl(&out);
    let ns: Vec<u64> = got
        .iter()
        .filter(|e| e["aggregate_id"] == "o1")
        .map(|e| e["payload"]["n"].as_u64().unwrap())
        .collect();
    assert_eq!(ns, (0..15).collect::<Vec<_>>());
    assert_eq!(store.stats().await.unwrap().delivered, 15);
    let o = outbox(&["wal", "drop-slot", "--config", &config]);
    assert!(o.status.success(), "{}", text(&o));
}

/// Issue 22, item 2, as an operator meets it: in a database where every role may call
/// pg_logical_emit_message, `outbox wal prepare` prints the statements that restrict it,
/// `outbox wal status` shows it, and `outbox relay` with the message source refuses to start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_message_source_is_reported_with_the_fix_and_refused() {
    let url = cluster_url();
    let id = std::process::id();
    let db = format!("owt_cli_open_{id}");
    let admin = sqlx::PgPool::connect(&url).await.unwrap();
    for sql in [
        format!("DROP DATABASE IF EXISTS {db} WITH (FORCE)"),
        format!("CREATE DATABASE {db}"),
    ] {
        common::pg_execute(&admin, sql).await;
    }
    let (base, _) = url.rsplit_once('/').unwrap();
    let db_url = format!("{base}/{db}");
    let store = common::migrated_store(&db_url, "outbox").await;
    store.pool().close().await;
    let (_dir, config) = common::temp_config(&format!(
        r#"
mode = "wal"

[database]
url = "{db_url}"

[wal]
slot = "{db}"
publication = "{db}"
sources = ["table", "messages"]
message_prefix = "{db}"

[destinations.out]
type = "stdout"
"#
    ));
    let config = config.to_str().unwrap().to_owned();

    let o = outbox(&["wal", "prepare", "--config", &config]);
    assert!(o.status.success(), "{}", text(&o));
    for statement in [
        "REVOKE EXECUTE ON FUNCTION pg_logical_emit_message(boolean,text,bytea) FROM PUBLIC;",
        "REVOKE EXECUTE ON FUNCTION pg_logical_emit_message(boolean,text,text) FROM PUBLIC;",
        "GRANT EXECUTE ON FUNCTION pg_logical_emit_message(boolean,text,bytea) TO <writer roles>;",
    ] {
        assert!(text(&o).contains(statement), "{statement}: {}", text(&o));
    }
    let o = outbox(&["wal", "prepare", "--config", &config, "--json"]);
    assert!(o.status.success(), "{}", text(&o));
    let prepared: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(
        prepared["message_source"]["public_overloads"]
            .as_array()
            .map(Vec::len),
        Some(2),
        "{prepared}"
    );
    assert!(
        prepared["replication_connection"]["tls"].is_boolean(),
        "{prepared}"
    );

    let o = outbox(&["wal", "status", "--config", &config, "--json"]);
    assert!(o.status.success(), "{}", text(&o));
    let status: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(status["message_source"]["enabled"], true, "{status}");
    assert!(
        status["message_source"]["fix"][0]
            .as_str()
            .is_some_and(|s| s.starts_with("REVOKE")),
        "{status}"
    );
    let o = outbox(&["wal", "status", "--config", &config]);
    common::assert_contains(&text(&o), "message source  ON but REFUSED");

    let o = outbox(&["relay", "--config", &config, "--drain"]);
    common::exits_2_saying(
        &o,
        "REVOKE EXECUTE ON FUNCTION pg_logical_emit_message(boolean,text,text) FROM PUBLIC;",
    );

    let o = outbox(&["wal", "drop-slot", "--config", &config]);
    assert!(o.status.success(), "{}", text(&o));
    common::pg_execute(&admin, format!("DROP DATABASE IF EXISTS {db} WITH (FORCE)")).await;
}

#[test]
fn wal_mode_needs_postgresql_and_valid_names() {
    let o = common::relay_with_config("mode = \"wal\"\n[database]\nurl = \"sqlite://x.db\"\n");
    common::exits_2_saying(&o, "needs a PostgreSQL");
    let (_dir, config) = common::temp_config(
        "mode = \"wal\"\n[database]\nurl = \"postgres://x@127.0.0.1:1/y\"\n[wal]\nslot = \"Bad-Name\"\n",
    );
    let o = outbox(&["config", "check", "--config", config.to_str().unwrap()]);
    common::exits_2_saying(&o, "slot");
}

/// Two `outbox relay` processes in WAL mode on one slot: one streams, the other stands by; the
/// streamer is SIGKILLed mid-stream and the standby takes over within the takeover timeout,
/// delivering everything (duplicates allowed, counted) in order per aggregate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_relay_process_takes_over_when_the_streamer_is_killed() {
    let wal = WalOutbox::new("cliwal2", "cli2").await;
    let (slot, store) = (wal.slot.as_str(), &wal.store);
    let out_a = wal.dir.path().join("a.jsonl");
    let out_b = wal.dir.path().join("b.jsonl");
    let write_config = |out: &std::path::Path, name: &str| {
        wal.file_config(
            name,
            out,
            &format!("relay_id = \"{name}\"\n"),
            "standby_poll_interval = \"200ms\"\ntakeover_timeout = \"20s\"\n",
        )
    };
    let config_a = write_config(&out_a, "relay-a");
    let config_b = write_config(&out_b, "relay-b");
    let o = outbox(&["wal", "prepare", "--config", &config_a]);
    assert!(o.status.success(), "{}", text(&o));
    let spawn = |config: &str| common::spawn_relay(config, "warn");
    let mut a = spawn(&config_a);
    // Wait until a streams, then start the standby.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let o = outbox(&["wal", "status", "--config", &config_a, "--json"]);
        let s: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap_or_default();
        if s["active"] == true {
            break;
        }
        assert!(Instant::now() < deadline, "relay a never streamed");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let _b = spawn(&config_b);

    let total = 3000u32;
    for chunk in 0..30u32 {
        let mut tx = store.pool().begin().await.unwrap();
        for i in 0..100u32 {
            let n = chunk * 100 + i;
            let e = NewEvent::new(
                "order",
                format!("o{}", n % 20),
                "OrderUpdated",
                &serde_json::json!({ "n": n / 20 }),
            )
            .unwrap();
            if n % 2 == 0 {
                store.outbox().enqueue(&mut *tx, &e).await.unwrap();
            } else {
                outbox_wal::enqueue_message(&mut *tx, slot, &e)
                    .await
                    .unwrap();
            }
        }
        tx.commit().await.unwrap();
        if chunk == 10 {
            // a is mid-stream: kill it without a goodbye.
            let deadline = Instant::now() + Duration::from_secs(20);
            while jsonl(&out_a).is_empty() {
                assert!(Instant::now() < deadline, "a delivered nothing");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            a.0.kill().unwrap();
            a.0.wait().unwrap();
        }
    }
    let killed = Instant::now();
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut first_from_b = None;
    loop {
        let mut all = jsonl(&out_a);
        let from_b = jsonl(&out_b);
        if first_from_b.is_none() && !from_b.is_empty() {
            first_from_b = Some(killed.elapsed());
        }
        all.extend(from_b);
        let distinct: std::collections::HashSet<String> = all
            .iter()
            .map(|e| e["id"].as_str().unwrap().to_owned())
            .collect();
        if distinct.len() == total as usize {
            // Order per aggregate among first deliveries, a's file then b's.
            let mut seen = std::collections::HashSet::new();
            let mut last: std::collections::HashMap<String, u64> = Default::default();
            for e in &all {
                if !seen.insert(e["id"].as_str().unwrap().to_owned()) {
                    continue;
                }
                let agg = e["aggregate_id"].as_str().unwrap().to_owned();
                let n = e["payload"]["n"].as_u64().unwrap();
                if let Some(prev) = last.insert(agg.clone(), n) {
                    assert!(n > prev, "order broken for {agg}: {n} after {prev}");
                }
            }
            eprintln!(
                "standby took over {:?} after the kill; {} duplicate deliveries",
                first_from_b,
                all.len() - distinct.len()
            );
            break;
        }
        assert!(
            Instant::now() < deadline,
            "only {} of {total} delivered",
            distinct.len()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(first_from_b.unwrap() < Duration::from_secs(20));
    drop(_b);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let _ = outbox(&["wal", "drop-slot", "--config", &config_a]);
}
