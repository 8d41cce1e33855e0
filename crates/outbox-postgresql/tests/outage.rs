//! The database goes away while the relay runs: the relay logs, backs off, resumes when the
//! database is back, and loses nothing.

mod common;

use std::sync::Arc;
use std::time::Duration;

use outbox_engine::{Relay, RelayConfig};
use outbox_postgresql::PgStore;
use outbox_store_tests::{spawn_until_stopped, wait_for_stats};
use outbox_testkit::{Faults, RecordingSink, TcpProxy, numbered};
use outbox_types::{DeadLetterPolicy, Store};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn relay_survives_a_database_outage_without_losing_or_double_acking() {
    let direct = common::fresh_store().await;
    let events: Vec<_> = (0..3000u64)
        .map(|i| numbered(&format!("o{}", i % 100), i / 100))
        .collect();
    common::enqueue_committed(&direct, &events).await;

    // The relay reaches PostgreSQL only through a proxy we can cut.
    let proxy = TcpProxy::start("127.0.0.1:5432".parse().unwrap())
        .await
        .unwrap();
    let options: PgConnectOptions = common::database_url().parse().unwrap();
    let options = options.host("127.0.0.1").port(proxy.addr().port());
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(Duration::from_secs(1))
        .connect_with(options)
        .await
        .unwrap();
    let relayed = Arc::new(PgStore::new(pool, direct.outbox().clone()));

    let sink = Arc::new(RecordingSink::with_faults(Faults {
        delay: Duration::from_millis(2),
        ..Faults::default()
    }));
    let config = RelayConfig {
        relay_id: "outage".into(),
        batch_size: 50,
        poll_interval: Duration::from_millis(10),
        lease: Duration::from_secs(5),
        publish_timeout: Duration::from_secs(2),
        max_store_backoff: Duration::from_millis(300),
        dead_letter: DeadLetterPolicy::Block,
        ..RelayConfig::default()
    };
    let relay = Relay::new(relayed.clone(), sink.clone(), config);
    let counters = relay.counters();
    let (stop, run) = spawn_until_stopped(relay);

    while counters.report().delivered < 500 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    proxy.cut();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let during = counters.report();
    proxy.restore();

    wait_for_stats(
        &direct,
        Duration::from_millis(50),
        Duration::from_secs(60),
        "relay did not recover",
        |stats| stats.delivered == 3000,
    )
    .await;
    stop.send(()).unwrap();
    let report = run.await.unwrap();

    assert!(
        during.store_errors > 0,
        "the outage was noticed: {during:?}"
    );
    let stats = direct.stats().await.unwrap();
    assert_eq!(
        (stats.pending, stats.in_flight, stats.dead),
        (0, 0, 0),
        "{stats:?}"
    );
    assert_eq!(sink.distinct_delivered().len(), 3000, "nothing lost");
    // A delivery whose ack was lost in the outage is published again after its lease: allowed
    // (at least once), and it never makes a second row change.
    assert!(report.delivered <= 3000, "no event acked twice: {report:?}");
    sink.assert_in_order_without_overlaps();
}
