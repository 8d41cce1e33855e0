//! A backlog present when a session starts: the stream delivers what it is about to send again
//! (rows committed after the slot's confirmed position), and only what it will not send goes
//! through table claims, first, in order (the slot's table watermark; `slot` module docs).

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use outbox_postgresql::PgStore;
use outbox_testkit::{RecordingSink, numbered};
use outbox_types::Store;
use outbox_types::route::RouteTable;
use outbox_wal::{Source, WalRelay};

/// `n` events over `aggregates` aggregates, numbered from `from` within each aggregate, in
/// transactions of 50.
async fn write_backlog(fx: &Fixture, aggregates: usize, n: u64, from: u64) {
    let events: Vec<_> = (0..n)
        .map(|i| numbered(&format!("b{}", i as usize % aggregates), from + i))
        .collect();
    for chunk in events.chunks(50) {
        fx.enqueue_table(chunk).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backlog_present_at_start_is_streamed_not_claimed() {
    let fx = Fixture::new(&[Source::Table]).await;
    // Rows written after the slot was created, before any relay ran: the slot's watermark was
    // set when it was created, so every one of them is the stream's.
    write_backlog(&fx, 20, 1_000, 0).await;
    let (sink, relay) = fx.start_recording().await;
    fx.wait_status_counts((0, 1_000, 0), Duration::from_secs(60))
        .await;
    let first = relay.stop().await;
    assert_eq!(
        (first.from_table, first.delivered),
        (0, 1_000),
        "the first start streams its backlog: {first:?}"
    );

    // A restart after an outage: the backlog committed while no relay ran is after the
    // confirmed position, so the stream sends it again and delivers it.
    write_backlog(&fx, 20, 1_000, 1_000).await;
    let relay = start(fx.config.clone(), sink.clone()).ready().await;
    fx.wait_status_counts((0, 2_000, 0), Duration::from_secs(60))
        .await;
    let second = relay.stop().await;
    assert_eq!(
        (second.from_table, second.delivered),
        (0, 1_000),
        "a restart streams the backlog: {second:?}"
    );
    assert_eq!(sink.distinct_delivered().len(), 2_000);
    sink.assert_in_order_without_overlaps();
    fx.cleanup().await;
}

/// A relay delivering to one destination, `main` (so `outbox pause main` holds it).
fn relay_to_main(config: outbox_wal::WalConfig, sink: Arc<RecordingSink>) -> Running {
    let relay = WalRelay::new(config.clone(), sink)
        .with_relay(test_relay(&config))
        .with_routes(Arc::new(RouteTable::single("main")));
    let counters = relay.counters();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let handle = tokio::spawn(relay.run(async move {
        let _ = rx.await;
    }));
    Running {
        stop: Some(tx),
        handle,
        counters,
    }
}

/// Not a test by itself: the relay process that
/// `rows_the_table_held_when_a_relay_died_go_before_newer_ones` SIGKILLs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "run as a child process by rows_the_table_held_when_a_relay_died_go_before_newer_ones"]
async fn child_relay_to_main() {
    let Ok(config) = std::env::var("OUTBOX_WAL_CHILD_CONFIG") else {
        return;
    };
    let config: outbox_wal::WalConfig = serde_json::from_str(&config).unwrap();
    let relay = relay_to_main(config, Arc::new(RecordingSink::new()));
    let _ = relay.handle.await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_the_table_held_when_a_relay_died_go_before_newer_ones() {
    let fx = Fixture::new(&[Source::Table]).await;
    let store = PgStore::new(fx.pool.clone(), fx.outbox.clone());
    // Session 1, in a process of its own: the destination is paused, so the stream hands every
    // event to the table (no row is written for that) and confirms past them; then the process
    // is killed, with no chance to write anything on its way out.
    assert!(store.pause("main", "test").await.unwrap());
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", "child_relay_to_main", "--nocapture"])
        .env(
            "OUTBOX_WAL_CHILD_CONFIG",
            serde_json::to_string(&fx.config).unwrap(),
        )
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    write_backlog(&fx, 10, 200, 0).await;
    let written: String = sqlx::query_scalar("SELECT pg_current_wal_lsn()::text")
        .fetch_one(&fx.pool)
        .await
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let past: Option<bool> = sqlx::query_scalar(
            "SELECT confirmed_flush_lsn >= $1::pg_lsn FROM pg_replication_slots WHERE slot_name = $2",
        )
        .bind(&written)
        .bind(&fx.config.slot)
        .fetch_optional(&fx.pool)
        .await
        .unwrap()
        .flatten();
        if past == Some(true) {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the slot is confirmed past the paused events"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();

    // The destination resumed, a new relay, and newer events of the same aggregates: the
    // stream has them at once, and must not deliver them before the older rows of their
    // aggregates, which the stream will never send again.
    assert!(store.resume("main").await.unwrap());
    let sink = Arc::new(RecordingSink::new());
    let relay = relay_to_main(fx.config.clone(), sink.clone()).ready().await;
    // Let the relay make its first claims, which find nothing the stream passed (it has
    // decoded nothing yet), so the table looks idle: without the watermark the older rows are
    // then nobody's until the table's once-a-second check, and the stream's newer events go
    // first. (With it, the outcome does not depend on this pause.)
    tokio::time::sleep(Duration::from_millis(300)).await;
    write_backlog(&fx, 10, 200, 200).await;
    fx.wait_status_counts((0, 400, 0), Duration::from_secs(60))
        .await;
    let second = relay.stop().await;
    // The 200 the table held (committed before the confirmed position, so never sent again)
    // went out by table claims, before the newer events of their aggregates.
    assert!(second.from_table >= 200, "{second:?}");
    assert_eq!(sink.distinct_delivered().len(), 400);
    sink.assert_in_order_without_overlaps();
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_from_before_the_slot_go_through_the_table_first() {
    let fx = Fixture::bare(&[Source::Table]).await;
    // Committed before the slot exists: the stream never sends them.
    write_backlog(&fx, 10, 300, 0).await;
    outbox_wal::prepare(&fx.config).await.unwrap();
    // Committed after: the stream's, except that their aggregates wait behind the older rows.
    write_backlog(&fx, 10, 300, 300).await;
    let (sink, relay) = fx.start_recording().await;
    fx.wait_status_counts((0, 600, 0), Duration::from_secs(60))
        .await;
    let report = relay.stop().await;
    // The 300 older rows by table claims; the newer ones from the stream, or handed to the
    // table when their aggregate still had older rows there.
    assert!(report.from_table >= 300, "{report:?}");
    assert_eq!(report.from_table + report.claimed, 600, "{report:?}");
    assert_eq!(sink.distinct_delivered().len(), 600);
    sink.assert_in_order_without_overlaps();

    // A slot from before the watermark (its bookkeeping row without one) behaves as before:
    // every undelivered row at start is the table's; from then on it has a watermark.
    fx.exec(format!(
        "UPDATE \"{}\".\"events_wal_slots\" SET table_seq = NULL",
        fx.config.schema
    ))
    .await;
    write_backlog(&fx, 10, 100, 600).await;
    let relay = start(fx.config.clone(), sink.clone()).ready().await;
    fx.wait_status_counts((0, 700, 0), Duration::from_secs(60))
        .await;
    let upgraded = relay.stop().await;
    assert_eq!(upgraded.from_table, 100, "{upgraded:?}");
    let mark: Option<i64> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT table_seq FROM \"{}\".\"events_wal_slots\"",
        fx.config.schema
    )))
    .fetch_one(&fx.pool)
    .await
    .unwrap();
    assert!(mark.is_some_and(|m| m >= 700), "{mark:?}");
    sink.assert_in_order_without_overlaps();
    fx.cleanup().await;
}
