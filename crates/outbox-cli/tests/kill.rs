//! Real `outbox relay` processes: one is killed with SIGKILL while it holds claimed events; after
//! its lease runs out another relay delivers them. The survivor then stops on SIGTERM with exit
//! code 0 and nothing left claimed.

mod common;

use std::collections::HashSet;
use std::path::Path;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use outbox_postgresql::PgStore;
use outbox_types::Store;

use common::signal;

fn spawn_relay(schema: &str, out: &Path) -> Child {
    common::background(
        &[
            "relay",
            "--database-url",
            &common::pg_url(),
            "--schema",
            schema,
        ],
        "warn",
    )
    .args(["--sink", &format!("file:{}", out.display())])
    .args([
        "--batch-size",
        "100",
        "--lease",
        "3s",
        "--poll-interval",
        "20ms",
    ])
    .env("OUTBOX_RELAY__PUBLISH_TIMEOUT", "1s")
    .spawn()
    .expect("the outbox binary starts")
}

/// The ids of the events the file sink at `path` has written so far.
fn ids_in(path: &Path) -> Vec<String> {
    common::jsonl(path)
        .iter()
        .map(|v| v["id"].as_str().unwrap().to_owned())
        .collect()
}

/// A fresh outbox in a schema of its own (`prefix_…`) holding 20,000 committed events over 400
/// aggregates: the schema, the store, the events.
async fn backlog(prefix: &str) -> (String, PgStore, Vec<outbox_types::NewEvent>) {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    let schema = format!("{prefix}_{}_{}", std::process::id(), nanos % 100_000);
    let store = common::migrated_store(&common::pg_url(), &schema).await;
    let events: Vec<_> = (0..20_000u64)
        .map(|i| outbox_testkit::numbered(&format!("k{}", i % 400), i / 400))
        .collect();
    for chunk in events.chunks(5000) {
        enqueue_committed!(store, chunk);
    }
    (schema, store, events)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_relays_claims_are_delivered_by_another_after_the_lease() {
    let (schema, store, events) = backlog("outbox_kill").await;
    let total = events.len() as u64;

    let dir = tempfile::tempdir().unwrap();
    let first_out = dir.path().join("first.jsonl");
    let second_out = dir.path().join("second.jsonl");
    let mut first = spawn_relay(&schema, &first_out);

    // Freeze the first relay at a moment when it holds claimed events, then kill it.
    let deadline = Instant::now() + Duration::from_secs(60);
    let held = loop {
        assert!(
            Instant::now() < deadline,
            "the first relay never held a claim"
        );
        tokio::time::sleep(Duration::from_millis(30)).await;
        if ids_in(&first_out).is_empty() {
            continue;
        }
        signal(&first, "-STOP");
        // Statements it sent before it froze still complete in the server: let them.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let stats = store.stats().await.unwrap();
        if stats.in_flight > 0 && stats.pending > 0 {
            break stats.in_flight;
        }
        signal(&first, "-CONT");
    };
    signal(&first, "-KILL");
    first.wait().unwrap();
    let after_kill = store.stats().await.unwrap();
    assert_eq!(
        after_kill.in_flight, held,
        "the dead relay's claims are still held"
    );

    let mut second = spawn_relay(&schema, &second_out);
    common::stats_until(
        &store,
        Duration::from_secs(120),
        "everything delivered",
        |stats| stats.delivered == total,
    )
    .await;
    signal(&second, "-TERM");
    let status = second.wait().unwrap();
    assert!(status.success(), "graceful stop exits 0: {status:?}");

    let stats = store.stats().await.unwrap();
    assert_eq!(
        (stats.in_flight, stats.pending, stats.dead),
        (0, 0, 0),
        "{stats:?}"
    );
    let first_ids = ids_in(&first_out);
    let second_ids = ids_in(&second_out);
    let all: HashSet<&String> = first_ids.iter().chain(&second_ids).collect();
    assert_eq!(all.len() as u64, total, "every event reached a sink");
    let wanted: HashSet<String> = events.iter().map(|e| e.id().to_string()).collect();
    assert!(
        all.iter().all(|id| wanted.contains(*id)),
        "nothing invented"
    );
    assert!(!second_ids.is_empty(), "the second relay took over");
}

/// Twelve-factor: a relay configured by environment variables alone (no file, no flags, the
/// destination too) stops on SIGTERM in the middle of a backlog within the grace period, exit
/// code 0, with nothing left claimed and every event marked delivered in the sink's file; a
/// second run, configured the same way, delivers the rest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_configured_by_environment_alone_stops_on_sigterm_losing_nothing() {
    let (schema, store, events) = backlog("outbox_kill_env").await;
    let total = events.len() as u64;
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out.jsonl");
    let relay = |drain: bool| {
        common::background(&["relay"], "warn")
            .current_dir(dir.path())
            .env("OUTBOX_DATABASE__URL", common::pg_url())
            .env("OUTBOX_DATABASE__SCHEMA", &schema)
            .env("OUTBOX_DESTINATIONS__OUT__TYPE", "file")
            .env("OUTBOX_DESTINATIONS__OUT__PATH", &out)
            .env("OUTBOX_RELAY__BATCH_SIZE", "100")
            .env(
                "OUTBOX_RELAY__STOP_WHEN_IDLE",
                if drain { "true" } else { "false" },
            )
            .spawn()
            .expect("the outbox binary starts")
    };

    let mut first = relay(false);
    let deadline = Instant::now() + Duration::from_secs(60);
    while ids_in(&out).len() < 2_000 {
        assert!(Instant::now() < deadline, "the relay delivered nothing");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    signal(&first, "-TERM");
    let status = common::exit_within(
        &mut first,
        Duration::from_secs(10),
        "still running 10 s after SIGTERM (a Kubernetes grace period is 30 s)",
    )
    .await;
    assert!(status.success(), "a graceful stop exits 0: {status:?}");
    let stats = store.stats().await.unwrap();
    assert_eq!(stats.in_flight, 0, "nothing left claimed: {stats:?}");
    assert!(
        stats.pending > 0,
        "stopped in the middle of the backlog: {stats:?}"
    );
    assert_eq!(stats.delivered + stats.pending, total, "{stats:?}");
    // Marked delivered only once in the sink's file.
    let delivered: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT id::text FROM \"{schema}\".events WHERE status = 'delivered'"
    )))
    .fetch_all(store.pool())
    .await
    .unwrap();
    let written: HashSet<String> = ids_in(&out).into_iter().collect();
    assert!(
        delivered.iter().all(|id| written.contains(id)),
        "an event marked delivered is not in the file"
    );

    let mut second = relay(true);
    let status = second.wait().unwrap();
    assert!(status.success(), "the drain exits 0: {status:?}");
    let stats = store.stats().await.unwrap();
    assert_eq!(
        (stats.delivered, stats.in_flight, stats.dead),
        (total, 0, 0)
    );
    let written: HashSet<String> = ids_in(&out).into_iter().collect();
    let wanted: HashSet<String> = events.iter().map(|e| e.id().to_string()).collect();
    assert_eq!(
        written, wanted,
        "every event reached the sink, nothing else"
    );
}

/// A relay stopped while it is still starting (here: connecting to a database that accepts the
/// connection and never answers) stops cleanly: SIGTERM at any moment is a clean stop, exit
/// code 0, because the relay takes over its stop signals before it loads its config or
/// connects. (Before, a SIGTERM in that window killed it by the signal, with nothing logged.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_stopped_while_it_starts_exits_cleanly() {
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = silent.local_addr().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut relay = common::background(
        &[
            "relay",
            "--database-url",
            &format!("postgres://postgres@{addr}/test"),
        ],
        "info",
    )
    .args([
        "--sink",
        &format!("file:{}", dir.path().join("out.jsonl").display()),
    ])
    .stderr(Stdio::piped())
    .spawn()
    .expect("the outbox binary starts");
    // It is connecting: past the point where it took over its signals.
    let (_connection, _) = silent.accept().expect("the relay connects");
    signal(&relay, "-TERM");
    let status = common::exit_within(
        &mut relay,
        Duration::from_secs(10),
        "still running 10 s after SIGTERM",
    )
    .await;
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut relay.stderr.take().unwrap(), &mut stderr).unwrap();
    assert!(
        status.success(),
        "a stop while starting exits 0: {status:?}\n{stderr}"
    );
    assert!(
        stderr.contains("Shutdown requested before the relay started"),
        "it says why it stopped: {stderr}"
    );
}
