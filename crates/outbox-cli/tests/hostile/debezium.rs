//! Hostile rows in a Debezium outbox table (issue 41, item 4): payloads that are large, or
//! that `table.expand.json.payload` would blow up, written by anyone with INSERT on that table.
//! No payload is quoted or expanded before it is measured; expanding is bounded by
//! `relay.max_payload_bytes` (docs/from-debezium.md states the bound); the relay's peak RSS is
//! printed, and the stream moves past every such row to the next one. A routed-by value with a
//! line break (item 13) is dead-lettered; `import-debezium` prints no secret and no raw escape
//! of its input (item 14).

use super::common::{self, BIN};
use super::{DB_PASSWORD, Outputs};

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The relay's limit in this test: 32 MiB.
const MAX_PAYLOAD_BYTES: u64 = 32 * 1024 * 1024;

/// `outbox relay --drain` run to its end, its peak resident set size (VmHWM) polled from /proc
/// while it runs; its exit status and stderr.
fn drain_measuring_rss(config: &str) -> (std::process::ExitStatus, u64, String) {
    let log = tempfile::NamedTempFile::new().unwrap();
    let mut child = Command::new(BIN)
        .args(["relay", "--drain", "--config", config])
        .env("OUTBOX_LOG", "info")
        .stdout(Stdio::null())
        .stderr(log.reopen().unwrap())
        .spawn()
        .unwrap();
    let status_file = format!("/proc/{}/status", child.id());
    let mut peak_kib = 0u64;
    let deadline = Instant::now() + Duration::from_secs(300);
    let status = loop {
        if let Ok(text) = std::fs::read_to_string(&status_file)
            && let Some(kib) = text
                .lines()
                .find_map(|l| l.strip_prefix("VmHWM:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        {
            peak_kib = peak_kib.max(kib);
        }
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        assert!(
            Instant::now() < deadline,
            "the relay did not drain in 5 minutes"
        );
        std::thread::sleep(Duration::from_millis(10));
    };
    let stderr = std::fs::read_to_string(log.path()).unwrap_or_default();
    (status, peak_kib * 1024, stderr)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn debezium_payloads_are_measured_before_they_are_encoded_or_expanded() {
    let url = outbox_testkit::logical_cluster_url();
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    let tag = std::process::id();
    let schema = format!("outbox_t_hostile_dbz_{tag}");
    // `owt_<pid>_…`: the tests' clean-up of stale slots drops only those of dead processes.
    let slot = format!("owt_{tag}_hostile_dbz");
    common::drop_pg_schema_if_exists(&pool, &schema).await;
    common::pg_execute(&pool, format!("CREATE SCHEMA \"{schema}\"")).await;
    let table = outbox_wal::DebeziumTable {
        table: format!("{schema}.outbox"),
        ..Default::default()
    };
    common::pg_execute(&pool, outbox_wal::debezium_table_ddl(&table)).await;
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("records.jsonl");
    let config = common::write_config(
        dir.path(),
        &format!(
            r#"
mode = "wal"

[database]
url = "{url}"
schema = "{schema}"

[relay]
publish_timeout = "20s"
max_payload_bytes = {MAX_PAYLOAD_BYTES}
max_batch_bytes = {MAX_PAYLOAD_BYTES}

[wal]
slot = "{slot}"
publication = "{slot}"
status_interval = "100ms"
sources = ["debezium"]

[wal.debezium]
table = "{schema}.outbox"
"table.expand.json.payload" = true

[destinations.records]
type = "file"
path = "{out}"
format = "debezium"
"#,
            out = out.display()
        ),
    );
    let config = config.to_str().unwrap();
    let mut outputs = Outputs::default();
    outputs.succeeds("migrate", &["migrate", "--config", config]);
    outputs.succeeds("wal prepare", &["wal", "prepare", "--config", config]);

    let t = format!("\"{schema}\".\"outbox\"");
    let id = |n: u8| format!("00000000-0000-4000-8000-0000000000{n:02}");
    // 100 MB of jsonb: over the limit before anything is built from it.
    common::pg_execute(
        &pool,
        format!(
            "INSERT INTO {t} VALUES ('{}', 'Acct', 'big', 'Big', jsonb_build_object('a', repeat('x', 100000000)))",
            id(1)
        ),
    )
    .await;
    // 10 million values in 30 MB of jsonb text: under the limit, but more values than
    // expanding takes (max_payload_bytes / 32 = 1,048,576): sent as the string.
    common::pg_execute(
        &pool,
        format!(
            "INSERT INTO {t} VALUES ('{}', 'Acct', 'wide', 'Wide', ('{{\"a\": [' || repeat('1, ', 9999999) || '1]}}')::jsonb)",
            id(2)
        ),
    )
    .await;
    // 3,000 objects with a field each: 60 KB of text, but every object gets all 3,000 fields
    // of the array's schema (9 million, over 32 MiB): dead-lettered, never built.
    common::pg_execute(
        &pool,
        format!(
            "INSERT INTO {t} SELECT '{}', 'Acct', 'fields', 'Fields', jsonb_build_object('r', jsonb_agg(jsonb_build_object('f' || i, 1))) FROM generate_series(1, 3000) i",
            id(3)
        ),
    )
    .await;
    // A routed-by value with a line break and a terminal escape (issue 41, item 13): Java's `.`
    // stops at the line break, so Debezium's default regex would not match and the raw value
    // would be the topic, without its prefix. Dead-lettered, the column named, nothing raw
    // printed.
    common::pg_execute(
        &pool,
        format!(
            "INSERT INTO {t} VALUES ('{}', E'Acct\\n\\x1b[2Jadmin', 'nl', 'Nl', '{{}}')",
            id(5)
        ),
    )
    .await;
    // A plain row after them: delivered, expanded; the stream moved past the others.
    common::pg_execute(
        &pool,
        format!(
            "INSERT INTO {t} VALUES ('{}', 'Acct', 'after', 'After', '{{\"ok\": true}}')",
            id(4)
        ),
    )
    .await;

    let (status, peak, stderr) = drain_measuring_rss(config);
    outputs.0.push(("relay --drain".to_owned(), stderr.clone()));
    assert!(status.success(), "{stderr}");
    println!(
        "debezium hostile payloads: relay peak RSS {} MiB (max_payload_bytes = {} MiB; a 100 MB row, 10M values, 3,000 × 3,000 fields)",
        peak / (1024 * 1024),
        MAX_PAYLOAD_BYTES / (1024 * 1024)
    );

    // Dead-lettered under their WAL position (the rows stay in the Debezium table), in order.
    let dead: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT last_error FROM \"{schema}\".events WHERE status = 'dead' ORDER BY id"
    )))
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(dead.len(), 3, "{dead:?}");
    assert!(
        // Read past by the stream before it was buffered (outbox-wal's record limits), so its
        // exact size is known.
        dead[0].contains("the payload is 100000009 bytes")
            && dead[0].contains("max_payload_bytes = 33554432"),
        "{dead:?}"
    );
    assert!(dead[1].contains("more than 33554432"), "{dead:?}");
    assert!(
        dead[2].contains("route.by.field") && dead[2].contains("U+000A"),
        "{dead:?}"
    );
    let lines = std::fs::read_to_string(&out).unwrap();
    let records: Vec<serde_json::Value> = lines
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let keys: Vec<&str> = records.iter().map(|r| r["key"].as_str().unwrap()).collect();
    assert_eq!(keys, ["\"wide\"", "\"after\""]);
    // The wide payload went as the string holding its text, as Debezium sends what it does not
    // expand; the next row expanded as usual.
    let wide = records[0]["value"].as_str().unwrap();
    assert!(
        wide.starts_with("\"{\\\"a\\\": [1, 1, 1"),
        "{}",
        &wide[..40]
    );
    assert_eq!(records[1]["value"].as_str(), Some(r#"{"ok":true}"#));
    assert!(stderr.contains("JSON expansion failed"), "{stderr}");
    // The 100 MB row is never quoted (before: 1.35 GB peak for it), and no expansion tree of
    // the 10 million values is built (before: 593 MB for 15 million).
    assert!(
        peak < 900 * 1024 * 1024,
        "peak RSS {} MiB",
        peak / (1024 * 1024)
    );
    outputs.check();
    let _ = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT pg_drop_replication_slot('{slot}')"
    )))
    .execute(&pool)
    .await;
    common::drop_pg_schema_if_exists(&pool, &schema).await;
}

/// `outbox config import-debezium` (issue 41, item 14): a connector configuration whose
/// `${VAR:default}` expressions carry secrets as defaults, and whose keys and values hold
/// terminal escapes, prints none of either — not on standard error, not in the file, not in its
/// error for a configuration it refuses.
#[test]
fn import_debezium_prints_no_secret_default_and_no_raw_escape() {
    let dir = tempfile::tempdir().unwrap();
    let properties = format!(
        "debezium.source.connector.class=io.debezium.connector.postgresql.PostgresConnector
debezium.source.database.hostname=db.internal
debezium.source.database.user=dbz
debezium.source.database.password=${{PG_PASSWORD:{DB_PASSWORD}}}
debezium.source.database.dbname=orders
debezium.source.topic.prefix=app
debezium.source.plugin.name=pgoutput
debezium.source.slot.name=orders_slot
debezium.source.evil\\u001b]0;pwned\\u0007=1
debezium.transforms=outbox
debezium.transforms.outbox.type=io.debezium.transforms.outbox.EventRouter
debezium.transforms.outbox.table.op.invalid.behavior=\\u001b[2Jwarn
debezium.sink.type=kafka
debezium.sink.kafka.producer.bootstrap.servers=127.0.0.1:19092
debezium.sink.kafka.producer.sasl.jaas.config=${{JAAS:password=\"{DB_PASSWORD}\"}}
"
    );
    let good = common::write_file(dir.path(), "application.properties", &properties);
    let refused = common::write_file(
        dir.path(),
        "refused.properties",
        &properties.replace(
            "io.debezium.connector.postgresql.PostgresConnector",
            "io.debezium.connector.mysql.MySqlConnector\\u001b[2J",
        ),
    );
    let mut outputs = Outputs::default();
    outputs.run(
        "import-debezium",
        &["config", "import-debezium", good.to_str().unwrap()],
    );
    let o = outputs.run(
        "import-debezium, refused",
        &["config", "import-debezium", refused.to_str().unwrap()],
    );
    assert!(!o.status.success());
    outputs.check();
}
