//! Byte limits on every column, not only the payload: rows whose `event_type` or `headers` are
//! 50 MB each (issue 41, item 3: twenty of them took a polling relay to 3.19 GB, and under a
//! 1 GiB limit it aborted on every start while later events stayed pending). With
//! `relay.max_metadata_bytes` (64 KiB by default) the claim measures every column in the
//! database and dead-letters such a row without loading it; the relay's peak RSS (`VmHWM`) is
//! printed and stays far below one such row's size.

use super::{Outputs, common};
use common::pg_url;
use sqlx::postgres::PgPoolOptions;
use sqlx::{AssertSqlSafe, PgPool, Row as _};
use std::time::{Duration, Instant};

/// 50 MiB: the size of each hostile column.
const HUGE: usize = 50 * 1024 * 1024;

/// The relay's peak resident set size in KiB (`VmHWM` of `/proc/PID/status`).
fn peak_rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or_else(|| panic!("no VmHWM for {pid}: {status}"))
}

/// `(status, last_error)` of every row, by aggregate id.
async fn states(pool: &PgPool, table: &str) -> Vec<(String, String, Option<String>)> {
    sqlx::query(AssertSqlSafe(format!(
        "SELECT aggregate_id, status, last_error FROM {table} ORDER BY seq"
    )))
    .fetch_all(pool)
    .await
    .unwrap()
    .iter()
    .map(|r| (r.get("aggregate_id"), r.get("status"), r.get("last_error")))
    .collect()
}

/// Good events of aggregate `aggregate`, numbered `ns`, written as a foreign writer would.
async fn insert_good(pool: &PgPool, table: &str, aggregate: &str, ns: std::ops::Range<u32>) {
    for n in ns {
        common::pg_execute(
            pool,
            format!(
                "INSERT INTO {table} (aggregate_type, aggregate_id, event_type, payload)
                 VALUES ('acct', '{aggregate}', 'Good', '{{\"n\":{n}}}')"
            ),
        )
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_megabyte_event_types_and_headers_are_dead_lettered_unread_in_polling_mode() {
    let pool = PgPoolOptions::new()
        .max_connections(2)
        .connect(&pg_url())
        .await
        .unwrap();
    let schema = format!("outbox_t_limits_{}", std::process::id());
    common::drop_pg_schema_if_exists(&pool, &schema).await;
    let table = format!("\"{schema}\".\"events\"");
    let dir = tempfile::tempdir().unwrap();
    // The default limits: relay.max_metadata_bytes = 64 KiB, max_payload_bytes = 16 MiB,
    // max_batch_bytes = 32 MiB.
    let (config, out) = common::file_sink_config(
        dir.path(),
        &format!("url = \"{}\"\nschema = \"{schema}\"\n", pg_url()),
        "[relay]\npoll_interval = \"50ms\"\n",
    );
    let config_arg = config.to_str().unwrap();
    let mut outputs = Outputs::default();
    outputs.succeeds("migrate", &["migrate", "--config", config_arg]);

    insert_good(&pool, &table, "before", 0..3).await;
    // Built by the database, so this test never holds them either: ten 50 MB event types and
    // ten 50 MB headers, each row an aggregate of its own, then the same for one aggregate
    // with good events behind it.
    common::pg_execute(
        &pool,
        format!(
            "INSERT INTO {table} (aggregate_type, aggregate_id, event_type, payload)
             SELECT 'acct', 'type-' || n, repeat('E', {HUGE}), '{{}}' FROM generate_series(1, 10) AS n"
        ),
    )
    .await;
    common::pg_execute(
        &pool,
        format!(
            "INSERT INTO {table} (aggregate_type, aggregate_id, event_type, payload, headers)
             SELECT 'acct', 'headers-' || n, 'Headers', '{{}}', jsonb_build_object('h', repeat('h', {HUGE}))
             FROM generate_series(1, 10) AS n"
        ),
    )
    .await;
    insert_good(&pool, &table, "after", 0..3).await;
    insert_good(&pool, &table, "before", 3..5).await;

    let log = dir.path().join("relay.log");
    let mut relay = common::Killed(
        common::relay_command(&config, "info")
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap(),
    );
    let pid = relay.0.id();
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        if let Some(status) = relay.0.try_wait().unwrap() {
            panic!(
                "the relay exited ({status}) with rows still open:\n{}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
        }
        let now = states(&pool, &table).await;
        if now.iter().all(|(_, s, _)| s == "delivered" || s == "dead") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "still open: {:?}\n{}",
            now.iter()
                .filter(|(_, s, _)| s != "delivered" && s != "dead")
                .map(|(a, s, _)| format!("{a}: {s}"))
                .collect::<Vec<_>>(),
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // A few more polls over the dead rows, then the peak.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        relay.0.try_wait().unwrap().is_none(),
        "the relay never aborts:\n{}",
        std::fs::read_to_string(&log).unwrap_or_default()
    );
    let peak = peak_rss_kib(pid);
    println!(
        "relay peak RSS (VmHWM) with 20 rows of 50 MiB event_type/headers: {} KiB ({:.1} MiB)",
        peak,
        peak as f64 / 1024.0
    );
    drop(relay);
    outputs.add_file("relay log", &log);

    let settled = states(&pool, &table).await;
    let dead: Vec<&(String, String, Option<String>)> =
        settled.iter().filter(|(_, s, _)| s == "dead").collect();
    assert_eq!(dead.len(), 20, "{settled:?}");
    for (aggregate, _, error) in &dead {
        let error = error.as_deref().unwrap_or("");
        let size: usize = error
            .split(" are ")
            .nth(1)
            .and_then(|e| e.split(' ').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or(0);
        assert!(
            error.contains("bytes together, above relay.max_metadata_bytes = 65536")
                && (HUGE..HUGE + 100).contains(&size),
            "{aggregate}: the reason names the limit and the size: {error}"
        );
    }
    // The good events, before and after the hostile rows, delivered in order.
    let delivered: Vec<(String, u64)> = common::jsonl(&out)
        .iter()
        .map(|e| {
            (
                e["aggregate_id"].as_str().unwrap_or("").to_owned(),
                e["payload"]["n"].as_u64().unwrap_or(u64::MAX),
            )
        })
        .collect();
    for aggregate in ["before", "after"] {
        let ns: Vec<u64> = delivered
            .iter()
            .filter(|(a, _)| a == aggregate)
            .map(|(_, n)| *n)
            .collect();
        let want: Vec<u64> = if aggregate == "before" {
            (0..5).collect()
        } else {
            (0..3).collect()
        };
        assert_eq!(ns, want, "{aggregate}: {delivered:?}");
    }
    // Not one of the hostile rows was loaded: a single 50 MiB column would have doubled this
    // (each is read into the driver's buffer and then into a String).
    assert!(
        peak < 100 * 1024,
        "peak RSS {peak} KiB: a hostile column was loaded"
    );
    outputs.succeeds("status", &["status", "--config", config_arg]);
    outputs.check();
    common::drop_pg_schema_if_exists(&pool, &schema).await;
}
