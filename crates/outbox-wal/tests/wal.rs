//! WAL mode against a real PostgreSQL with `wal_level = logical` (the throwaway cluster of
//! `scripts/pg-logical.sh`, started on demand).

mod common;

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use common::*;
use outbox_engine::RelayConfig;
use outbox_testkit::{Faults, RecordingSink, check_first_delivery_order, numbered};
use outbox_types::{DeadFilter, Store};
use outbox_wal::{Source, WalConfig, WalError};

const BOTH: &[Source] = &[Source::Table, Source::Messages];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn committed_events_are_delivered_and_rolled_back_ones_never() {
    let fx = Fixture::new(BOTH).await;
    let (sink, relay) = fx.start_recording().await;

    let table_ok: Vec<_> = (0..3).map(|n| numbered("t", n)).collect();
    let msg_ok: Vec<_> = (0..3).map(|n| numbered("m", n)).collect();
    fx.enqueue_table(&table_ok).await;
    fx.enqueue_messages(&msg_ok).await;
    // Rolled back: table rows and messages written, then the transaction is abandoned.
    let table_rb: Vec<_> = (10..12).map(|n| numbered("t", n)).collect();
    let msg_rb: Vec<_> = (10..12).map(|n| numbered("m", n)).collect();
    {
        let mut tx = fx.pool.begin().await.unwrap();
        fx.outbox.enqueue_batch(&mut *tx, &table_rb).await.unwrap();
        for e in &msg_rb {
            outbox_wal::enqueue_message(&mut *tx, &fx.config.message_prefix, e)
                .await
                .unwrap();
        }
        tx.rollback().await.unwrap();
    }
    // Business change and event in one transaction, mixed sources.
    let mixed = [numbered("x", 0), numbered("x", 1)];
    {
        let mut tx = fx.pool.begin().await.unwrap();
        fx.outbox.enqueue(&mut *tx, &mixed[0]).await.unwrap();
        outbox_wal::enqueue_message(&mut *tx, &fx.config.message_prefix, &mixed[1])
            .await
            .unwrap();
        tx.commit().await.unwrap();
    }

    let mut expected = ids(&table_ok);
    expected.extend(ids(&msg_ok));
    expected.extend(ids(&mixed));
    wait_for("8 committed events", Duration::from_secs(20), || {
        sink.distinct_delivered().len() >= expected.len()
    })
    .await;
    // Give a rolled-back event every chance to show up.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(sink.distinct_delivered(), expected);
    let delivered = sink.delivered();
    assert!(check_first_delivery_order(&delivered).is_empty());
    // The payload bytes are the writer's.
    let m0 = delivered.iter().find(|e| e.id == msg_ok[0].id()).unwrap();
    assert_eq!(m0.payload, msg_ok[0].payload());
    assert_eq!(m0.aggregate_id, "m");

    // Table rows are marked delivered; message events left no row.
    let report = relay.stop().await;
    assert_eq!(report.delivered, 8, "{report:?}");
    assert_eq!(fx.status_counts().await, (0, 4, 0));
    assert!(!report.last_acked_lsn.is_zero());
    let status = outbox_wal::wal_status(&fx.config).await.unwrap();
    assert!(status.exists && !status.active, "{status:?}");
    assert!(
        status.confirmed_flush_lsn.unwrap() >= report.last_acked_lsn,
        "{status:?}"
    );
    fx.cleanup().await;
}

/// A sink that appends `id seq aggregate_id` per delivered event to a file before confirming:
/// what a killed process delivered survives it.
struct FileSink {
    file: std::sync::Mutex<std::fs::File>,
    delay: Duration,
}

#[async_trait::async_trait]
impl outbox_types::Sink for FileSink {
    fn name(&self) -> &str {
        "file"
    }
    async fn publish(&self, events: &[outbox_types::Event]) -> Vec<outbox_types::Outcome> {
        use std::io::Write;
        tokio::time::sleep(self.delay).await;
        let mut text = String::new();
        for e in events {
            text.push_str(&format!("{} {} {}\n", e.id, e.seq, e.aggregate_id));
        }
        let mut file = self.file.lock().unwrap();
        file.write_all(text.as_bytes()).unwrap();
        vec![outbox_types::Outcome::Delivered; events.len()]
    }
}

/// Not a test by itself: the relay process that `streamer_killed_mid_stream_*` SIGKILLs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "run as a child process by streamer_killed_mid_stream_restarts_without_loss"]
async fn child_relay_process() {
    let Ok(config) = std::env::var("OUTBOX_WAL_CHILD_CONFIG") else {
        return;
    };
    let out = std::env::var("OUTBOX_WAL_CHILD_OUT").unwrap();
    let config: outbox_wal::WalConfig = serde_json::from_str(&config).unwrap();
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(out)
        .unwrap();
    let sink = Arc::new(FileSink {
        file: std::sync::Mutex::new(file),
        delay: Duration::from_millis(5),
    });
    let _ = outbox_wal::WalRelay::new(config, sink)
        .run(std::future::pending::<()>())
        .await;
}

fn read_deliveries(path: &std::path::Path) -> Vec<outbox_types::Event> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    text.lines()
        .filter_map(|line| {
            let mut parts = line.split(' ');
            let id = parts.next()?.parse().ok()?;
            let seq = parts.next()?.parse().ok()?;
            let agg = parts.next()?.to_owned();
            Some(outbox_types::Event {
                seq,
                id,
                aggregate_type: "agg".into(),
                aggregate_id: agg,
                event_type: "Numbered".into(),
                payload: "{}".into(),
                destination: None,
                headers: Default::default(),
                idempotency_key: None,
                occurred_at: chrono::Utc::now(),
                enqueued_at: chrono::Utc::now(),
                attempts: 0,
            })
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamer_killed_mid_stream_restarts_without_loss() {
    for source in [
        Source::Table,
        Source::Messages,
        Source::StreamTable,
        Source::Debezium,
    ] {
        let fx = Fixture::new(&[source]).await;
        let config = fx.config.clone();
        let relay_settings = RelayConfig {
            batch_size: 20,
            ..test_relay(&config)
        };
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("delivered.txt");
        let events: Vec<_> = (0..4000)
            .map(|n| numbered(&format!("a{}", n % 40), n / 40))
            .collect();
        for chunk in events.chunks(500) {
            match source {
                Source::Table => fx.enqueue_table(chunk).await,
                Source::Messages => fx.enqueue_messages(chunk).await,
                Source::StreamTable => fx.enqueue_streamed(chunk).await,
                Source::Debezium => fx.enqueue_debezium(chunk).await,
            }
        }
        let mut child = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--ignored", "--exact", "child_relay_process", "--nocapture"])
            .env(
                "OUTBOX_WAL_CHILD_CONFIG",
                serde_json::to_string(&config).unwrap(),
            )
            .env("OUTBOX_WAL_CHILD_OUT", &out)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        wait_for(
            "the child to deliver a quarter",
            Duration::from_secs(60),
            || read_deliveries(&out).len() >= 1000,
        )
        .await;
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();
        let before = read_deliveries(&out);
        assert!(before.len() < events.len(), "killed mid-stream");

        let sink = Arc::new(RecordingSink::new());
        let relay = start_relay(config.clone(), relay_settings.clone(), sink.clone())
            .ready()
            .await;
        let expected = ids(&events);
        wait_for(
            "every event after the restart",
            Duration::from_secs(60),
            || {
                let mut seen: HashSet<_> = before.iter().map(|e| e.id).collect();
                seen.extend(sink.distinct_delivered());
                expected.is_subset(&seen)
            },
        )
        .await;
        let report = relay.stop().await;
        let mut all = before.clone();
        all.extend(sink.delivered());
        let distinct: HashSet<_> = all.iter().map(|e| e.id).collect();
        assert_eq!(distinct, expected, "no loss, nothing invented");
        assert!(
            check_first_delivery_order(&all).is_empty(),
            "order across the kill"
        );
        eprintln!(
            "{source:?}: killed after {} deliveries; restart delivered {} ({} duplicates of the killed run; relay counted {} duplicate rows)",
            before.len(),
            sink.delivered().len(),
            duplicates(&all),
            report.duplicates
        );
        if source == Source::Table {
            assert_eq!(fx.status_counts().await, (0, 4000, 0));
        }
        fx.cleanup().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sink_outage_moves_waiting_events_to_the_table_and_the_stream_keeps_moving() {
    let fx = Fixture::new(BOTH).await;
    let mut config = fx.config.clone();
    config.max_buffered_events = 200;
    let relay_settings = RelayConfig {
        retry: outbox_types::RetryPolicy {
            base: Duration::from_millis(20),
            cap: Duration::from_millis(200),
            max_attempts: 10_000,
        },
        ..test_relay(&config)
    };
    let sink = Arc::new(SwitchSink::new(RecordingSink::new()));
    sink.down.store(true, Ordering::SeqCst);
    let outage = Instant::now();
    let relay = start_relay(config.clone(), relay_settings.clone(), sink.clone())
        .ready()
        .await;
    let before = outbox_wal::wal_status(&config).await.unwrap();
    // One huge transaction of messages plus table rows, written while the sink is down.
    let big: Vec<_> = (0..5000)
        .map(|n| numbered(&format!("m{}", n % 50), n / 50))
        .collect();
    let first_lsn = {
        let mut tx = fx.pool.begin().await.unwrap();
        let written = outbox_wal::enqueue_messages(&mut *tx, &config.message_prefix, &big)
            .await
            .unwrap();
        tx.commit().await.unwrap();
        written[0].lsn
    };
    let rows: Vec<_> = (0..500)
        .map(|n| numbered(&format!("t{}", n % 10), n / 10))
        .collect();
    fx.enqueue_table(&rows).await;

    sink.wait_calls_while_down("publish attempts while down", Duration::from_secs(10), 20)
        .await;
    // A ten-second outage: long enough for many retry rounds and status updates.
    tokio::time::sleep(Duration::from_secs(10).saturating_sub(outage.elapsed())).await;
    // Nothing is held in memory for a destination that is down: the first failure of each
    // aggregate sends it to the table (its later events follow it there: messages as rows),
    // and the slot's position moves on past them.
    let during = relay.counters.report();
    assert_eq!(during.delivered, 0);
    assert!(during.retried > 0 && during.handed_back > 0, "{during:?}");
    assert!(
        during.last_acked_lsn > first_lsn,
        "the slot is not held by an outage: {during:?}"
    );

    // The destination comes back after 10 s: the same stream resumes.
    assert!(outage.elapsed() >= Duration::from_secs(10));
    sink.down.store(false, Ordering::SeqCst);
    let mut expected = ids(&big);
    expected.extend(ids(&rows));
    wait_delivered_exactly(
        &sink.inner,
        &expected,
        "everything after the outage",
        Duration::from_secs(60),
    )
    .await;
    wait_for(
        "slot confirmed past the events",
        Duration::from_secs(10),
        || relay.counters.report().last_acked_lsn >= before.current_wal_lsn,
    )
    .await;

    // Down again, and the relay is stopped during the outage: whatever it confirmed, the
    // undelivered events must come again from the slot (message events exist nowhere else).
    sink.down.store(true, Ordering::SeqCst);
    let calls = sink.calls_while_down.load(Ordering::Relaxed);
    let more: Vec<_> = (0..300)
        .map(|n| numbered(&format!("m{}", n % 50), 100 + n / 50))
        .collect();
    fx.enqueue_messages(&more).await;
    sink.wait_calls_while_down(
        "attempts during the second outage",
        Duration::from_secs(10),
        calls + 10,
    )
    .await;
    let stopped = relay.stop().await;
    assert!(stopped.retried > 0);
    sink.down.store(false, Ordering::SeqCst);
    let relay = start(config.clone(), sink.clone()).ready().await;
    expected.extend(ids(&more));
    wait_delivered_exactly(
        &sink.inner,
        &expected,
        "the second outage's events after a restart",
        Duration::from_secs(30),
    )
    .await;
    let report = relay.stop().await;
    assert_eq!(report.dead + stopped.dead, 0);
    let (open, delivered, dead) = fx.status_counts().await;
    assert_eq!((open, dead), (0, 0));
    assert!(
        delivered >= 500,
        "table rows and the messages the table took: {delivered}"
    );
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn database_connections_cut_and_restored_lose_nothing() {
    let fx = Fixture::new(BOTH).await;
    let cluster = url::Url::parse(&cluster_url()).unwrap();
    let upstream: std::net::SocketAddr = format!(
        "{}:{}",
        cluster.host_str().unwrap(),
        cluster.port().unwrap_or(5432)
    )
    .parse()
    .unwrap();
    let proxy = outbox_testkit::TcpProxy::start(upstream).await.unwrap();
    let mut config = fx.config.clone();
    config.database_url = format!("postgres://postgres@{}/outbox", proxy.addr());
    if std::env::var("OUTBOX_WAL_TEST_URL").is_ok() {
        eprintln!("skipped: the proxy targets the script's cluster");
        return;
    }
    let sink = Arc::new(RecordingSink::with_faults(Faults {
        delay: Duration::from_millis(2),
        ..Faults::default()
    }));
    let relay = start(config, sink.clone()).ready().await;
    let mut all = Vec::new();
    for round in 0..4u64 {
        // Table seqs and message LSNs are different sequences: one source per aggregate.
        let prefix = if round % 2 == 0 { "t" } else { "m" };
        let batch: Vec<_> = (0..300)
            .map(|n| numbered(&format!("{prefix}{}", n % 30), round * 10 + n / 30))
            .collect();
        if round % 2 == 0 {
            fx.enqueue_table(&batch).await;
        } else {
            fx.enqueue_messages(&batch).await;
        }
        all.extend(batch);
        tokio::time::sleep(Duration::from_millis(150)).await;
        proxy.cut();
        tokio::time::sleep(Duration::from_millis(700)).await;
        proxy.restore();
    }
    let expected = ids(&all);
    wait_delivered_exactly(
        &sink,
        &expected,
        "everything across the cuts",
        Duration::from_secs(60),
    )
    .await;
    let report = relay.stop().await;
    assert!(report.errors >= 1, "the cuts ended sessions: {report:?}");
    eprintln!(
        "cuts: {} sessions, {} duplicates",
        report.sessions,
        duplicates(&sink.delivered())
    );
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_thousand_events_over_a_thousand_aggregates_keep_order() {
    let fx = Fixture::new(BOTH).await;
    let sink = Arc::new(SwitchSink::new(RecordingSink::new()));
    let relay = start(fx.config.clone(), sink.clone()).ready().await;
    let started = Instant::now();
    let mut expected = HashSet::new();
    // 25k table rows on aggregates t0..t499 and 25k messages on m0..m499, 500 per transaction.
    let writers = {
        let table: Vec<_> = (0..25_000u64)
            .map(|n| numbered(&format!("t{}", n % 500), n / 500))
            .collect();
        let msgs: Vec<_> = (0..25_000u64)
            .map(|n| numbered(&format!("m{}", n % 500), n / 500))
            .collect();
        expected.extend(ids(&table));
        expected.extend(ids(&msgs));
        (table, msgs)
    };
    for (t, m) in writers.0.chunks(500).zip(writers.1.chunks(500)) {
        fx.enqueue_table(t).await;
        fx.enqueue_messages(m).await;
    }
    wait_for("50k events", Duration::from_secs(120), || {
        sink.inner.distinct_delivered().len() >= expected.len()
    })
    .await;
    let elapsed = started.elapsed();
    assert_eq!(sink.inner.distinct_delivered(), expected);
    sink.inner.assert_in_order_without_overlaps();
    assert!(
        sink.max_batch_seen.load(Ordering::Relaxed) > 1,
        "aggregates went in parallel"
    );
    let report = relay.stop().await;
    eprintln!("50k events over 1000 aggregates in {elapsed:?} (debug build); {report:?}");
    assert_eq!(fx.status_counts().await, (0, 25_000, 0), "{report:?}");
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn permanently_failing_events_are_dead_lettered_and_the_stream_moves_on() {
    let fx = Fixture::new(BOTH).await;
    let sink = Arc::new(RecordingSink::with_faults(Faults {
        reject: Some(Arc::new(|e: &outbox_types::Event| {
            e.payload.contains("\"n\":1}") && e.aggregate_id.starts_with('r')
        })),
        ..Faults::default()
    }));
    // Events of aggregates `x*` are retried until out of attempts.
    struct Flaky(Arc<RecordingSink>);
    #[async_trait::async_trait]
    impl outbox_types::Sink for Flaky {
        fn name(&self) -> &str {
            "flaky"
        }
        async fn publish(&self, events: &[outbox_types::Event]) -> Vec<outbox_types::Outcome> {
            let mut out = self.0.publish(events).await;
            for (o, e) in out.iter_mut().zip(events) {
                if e.aggregate_id.starts_with('x') && e.payload.contains("\"n\":0}") {
                    *o = outbox_types::Outcome::retry("always failing (test)");
                }
            }
            out
        }
    }
    // `skip`: a dead event lets the later events of its aggregate go on (the `block` policy is
    // tested below).
    let relay = start_relay(
        fx.config.clone(),
        RelayConfig {
            dead_letter: outbox_types::DeadLetterPolicy::Skip,
            ..test_relay(&fx.config)
        },
        Arc::new(Flaky(sink.clone())),
    )
    .ready()
    .await;
    let store = outbox_postgresql::PgStore::new(fx.pool.clone(), fx.outbox.clone());
    let table: Vec<_> = (0..3)
        .flat_map(|n| [numbered("rt", n), numbered("xt", n)])
        .collect();
    let msgs: Vec<_> = (0..3)
        .flat_map(|n| [numbered("rm", n), numbered("xm", n)])
        .collect();
    fx.enqueue_table(&table).await;
    fx.enqueue_messages(&msgs).await;
    let dead_ids: HashSet<_> = [&table[2], &table[1], &msgs[2], &msgs[1]]
        .iter()
        .map(|e| e.id())
        .collect();
    let deadline = Instant::now() + Duration::from_secs(30);
    while store.stats().await.unwrap().dead < 4 || sink.distinct_delivered().len() < 8 {
        assert!(
            Instant::now() < deadline,
            "the other 8 delivered and 4 buried: {:?}, delivered {}",
            store.stats().await.unwrap(),
            sink.distinct_delivered().len()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let report = relay.stop().await;
    assert_eq!(report.dead, 4, "{report:?}");
    let dead = store.list_dead(None, 100).await.unwrap();
    let listed: HashSet<_> = dead.iter().map(|r| r.event.id).collect();
    assert_eq!(
        listed, dead_ids,
        "table rows marked dead, message events inserted dead"
    );
    let exhausted = dead.iter().find(|r| r.event.aggregate_id == "xm").unwrap();
    assert_eq!(
        exhausted.event.attempts,
        test_relay(&fx.config).retry.max_attempts
    );
    assert!(
        exhausted
            .last_error
            .as_deref()
            .unwrap()
            .contains("gave up after 5 attempts")
    );
    let rejected = dead.iter().find(|r| r.event.aggregate_id == "rm").unwrap();
    assert!(rejected.last_error.as_deref().unwrap().contains("rejected"));
    assert_eq!(rejected.event.payload, msgs[2].payload());
    // Each dead event was tried exactly as often as the policy says, and the dead rows inserted
    // for message events are not streamed back as new events.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let tries = |id| sink.delivered().iter().filter(|e| e.id == id).count();
    assert_eq!(
        tries(msgs[1].id()),
        5,
        "xm0: 5 attempts (recorded by the inner sink)"
    );
    assert_eq!(tries(table[1].id()), 5);
    assert_eq!(
        sink.rejected()
            .iter()
            .filter(|e| e.id == msgs[2].id())
            .count(),
        1
    );
    // `outbox dead requeue` works on them; the next start's catch-up delivers them.
    assert_eq!(store.requeue_dead(&DeadFilter::All).await.unwrap(), 4);
    let relay = start(fx.config.clone(), sink.clone()).ready().await;
    wait_for(
        "requeued rejected events retried by the catch-up",
        Duration::from_secs(20),
        || relay.counters.report().from_table >= 4,
    )
    .await;
    relay.stop().await;
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hot_standby_takes_over_when_the_streamer_dies() {
    let fx = Fixture::new(BOTH).await;
    let sink = Arc::new(RecordingSink::with_faults(Faults {
        delay: Duration::from_millis(3),
        ..Faults::default()
    }));
    let a_cfg = RelayConfig {
        relay_id: "relay-a".into(),
        ..test_relay(&fx.config)
    };
    let b_cfg = RelayConfig {
        relay_id: "relay-b".into(),
        ..test_relay(&fx.config)
    };
    let a = start_relay(fx.config.clone(), a_cfg, sink.clone())
        .ready()
        .await;
    wait_for("a leads", Duration::from_secs(10), || {
        a.counters.report().sessions == 1
    })
    .await;
    let b = start_relay(fx.config.clone(), b_cfg, sink.clone())
        .ready()
        .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        b.counters.report().sessions,
        0,
        "b stands by while a streams"
    );

    let first: Vec<_> = (0..2000)
        .map(|n| numbered(&format!("a{}", n % 20), n / 20))
        .collect();
    fx.enqueue_messages(&first).await;
    wait_for("a delivering", Duration::from_secs(20), || {
        sink.distinct_delivered().len() > 300
    })
    .await;
    // Kill a: its task, connections and walsender go away without a goodbye.
    a.handle.abort();
    let killed = Instant::now();
    // Table rows number their seq apart from messages (LSNs): other aggregates.
    let second: Vec<_> = (0..500)
        .map(|n| numbered(&format!("b{}", n % 20), n / 20))
        .collect();
    fx.enqueue_table(&second).await;
    wait_for("b takes over", Duration::from_secs(15), || {
        b.counters.report().sessions == 1
    })
    .await;
    let takeover = killed.elapsed();
    let mut expected = ids(&first);
    expected.extend(ids(&second));
    wait_delivered_exactly(
        &sink,
        &expected,
        "everything via b",
        Duration::from_secs(60),
    )
    .await;
    eprintln!(
        "takeover after {takeover:?}; {} duplicates",
        duplicates(&sink.delivered())
    );
    assert!(takeover < fx.config.takeover_timeout);
    b.stop().await;
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mode_switch_polling_wal_polling_loses_nothing() {
    let fx = Fixture::bare(&[Source::Table]).await;
    let store = Arc::new(outbox_postgresql::PgStore::new(
        fx.pool.clone(),
        fx.outbox.clone(),
    ));
    let sink = Arc::new(RecordingSink::new());
    let writing = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let written = Arc::new(std::sync::Mutex::new(Vec::new()));
    let writer = {
        let pool = fx.pool.clone();
        let outbox = fx.outbox.clone();
        let writing = writing.clone();
        let written = written.clone();
        tokio::spawn(async move {
            let mut n = 0u64;
            while writing.load(Ordering::SeqCst) {
                let batch: Vec<_> = (0..10).map(|a| numbered(&format!("a{a}"), n)).collect();
                let mut tx = pool.begin().await.unwrap();
                outbox.enqueue_batch(&mut *tx, &batch).await.unwrap();
                tx.commit().await.unwrap();
                written.lock().unwrap().extend(batch.iter().map(|e| e.id()));
                n += 1;
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
    };
    let polling = |sink: Arc<RecordingSink>, idle: bool| {
        let relay = outbox_engine::Relay::new(
            store.clone(),
            sink,
            outbox_engine::RelayConfig {
                poll_interval: Duration::from_millis(20),
                batch_size: 50,
                stop_when_idle: idle,
                ..Default::default()
            },
        );
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        (
            tx,
            tokio::spawn(relay.run(async move {
                let _ = rx.await;
            })),
        )
    };
    // Phase 1: polling.
    let (stop_poll, poll) = polling(sink.clone(), false);
    tokio::time::sleep(Duration::from_millis(700)).await;
    // Switch to WAL: slot first, then stop the poller, then start the WAL relay.
    outbox_wal::prepare(&fx.config).await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    stop_poll.send(()).unwrap();
    let polled = poll.await.unwrap();
    let wal = start(fx.config.clone(), sink.clone()).ready().await;
    tokio::time::sleep(Duration::from_millis(1200)).await;
    // Switch back: stop the WAL relay (it marks what it delivered), start polling.
    let wal_report = wal.stop().await;
    let (stop_poll, poll) = polling(sink.clone(), false);
    tokio::time::sleep(Duration::from_millis(700)).await;
    writing.store(false, Ordering::SeqCst);
    writer.await.unwrap();
    stop_poll.send(()).unwrap();
    let polled_again = poll.await.unwrap();
    // Drain the rest and leave WAL mode for good.
    let (_never, drain) = polling(sink.clone(), true);
    drain.await.unwrap();
    assert!(outbox_wal::drop_slot(&fx.config).await.unwrap());

    let expected: HashSet<_> = written.lock().unwrap().iter().copied().collect();
    assert_eq!(
        sink.distinct_delivered(),
        expected,
        "every committed event, nothing else"
    );
    assert!(check_first_delivery_order(&sink.delivered()).is_empty());
    assert!(wal_report.delivered > 0 && polled.delivered > 0 && polled_again.delivered > 0);
    assert_eq!(fx.status_counts().await.0, 0, "nothing left pending");
    eprintln!(
        "mode switch: {} events, polled {} + WAL {} (catch-up {}) + polled {}; {} duplicate deliveries, relay counted {}",
        expected.len(),
        polled.delivered,
        wal_report.delivered,
        wal_report.from_table,
        polled_again.delivered,
        duplicates(&sink.delivered()),
        wal_report.duplicates
    );
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_slot_is_reported_and_recover_rescans_the_table() {
    let fx = Fixture::new(BOTH).await;
    let (sink, relay) = fx.start_recording().await;
    let first: Vec<_> = (0..5).map(|n| numbered("a", n)).collect();
    fx.enqueue_table(&first).await;
    wait_for("first events", Duration::from_secs(10), || {
        sink.distinct_delivered().len() >= 5
    })
    .await;
    relay.stop().await;

    // Someone drops the slot; events keep coming meanwhile.
    sqlx::query("SELECT pg_drop_replication_slot($1)")
        .bind(&fx.config.slot)
        .execute(&fx.pool)
        .await
        .unwrap();
    let second: Vec<_> = (5..10).map(|n| numbered("a", n)).collect();
    fx.enqueue_table(&second).await;

    let err = outbox_wal::WalRelay::new(fx.config.clone(), sink.clone())
        .run(std::future::pending::<()>())
        .await
        .unwrap_err();
    assert!(matches!(err, WalError::SlotLost { .. }), "{err}");
    assert!(err.to_string().contains("recover"), "{err}");

    let report = outbox_wal::recover(&fx.config, sink.clone()).await.unwrap();
    assert!(report.created_slot_at.is_some());
    assert_eq!(report.redelivered, 5, "{report:?}");
    let mut expected = ids(&first);
    expected.extend(ids(&second));
    assert_eq!(sink.distinct_delivered(), expected);

    // Streaming resumes on the new slot.
    let relay = start(fx.config.clone(), sink.clone()).ready().await;
    let third: Vec<_> = (10..15).map(|n| numbered("a", n)).collect();
    fx.enqueue_messages(&third).await;
    expected.extend(ids(&third));
    wait_for("streaming again", Duration::from_secs(10), || {
        sink.distinct_delivered().len() >= 15
    })
    .await;
    relay.stop().await;
    assert_eq!(sink.distinct_delivered(), expected);
    assert!(check_first_delivery_order(&sink.delivered()).is_empty());
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_without_logical_wal_gets_a_clear_error() {
    // The machine's shared PostgreSQL runs with wal_level = replica.
    let url = std::env::var("OUTBOX_TEST_DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
    let config = outbox_wal::WalConfig::new(url);
    match outbox_wal::prepare(&config).await {
        Err(WalError::ServerSetup(msg)) => {
            assert!(
                msg.contains("wal_level") && msg.contains("logical"),
                "{msg}"
            );
        }
        Err(WalError::Unavailable(msg)) => {
            eprintln!("skipped: shared PostgreSQL not reachable: {msg}")
        }
        other => {
            let level: Option<String> = match sqlx::PgPool::connect(&config.database_url).await {
                Ok(pool) => sqlx::query_scalar("SHOW wal_level")
                    .fetch_one(&pool)
                    .await
                    .ok(),
                Err(_) => None,
            };
            assert_eq!(level.as_deref(), Some("logical"), "unexpected {other:?}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heartbeats_keep_an_idle_slot_confirmed() {
    let fx = Fixture::new(BOTH).await;
    let (_sink, relay) = fx.start_recording().await;
    // Other traffic in the cluster, none of it for this outbox.
    sqlx::query("CREATE TABLE IF NOT EXISTS public.owt_noise (x int)")
        .execute(&fx.pool)
        .await
        .unwrap();
    let before = outbox_wal::wal_status(&fx.config).await.unwrap();
    for _ in 0..20 {
        sqlx::query("INSERT INTO public.owt_noise SELECT generate_series(1, 1000)")
            .execute(&fx.pool)
            .await
            .unwrap();
    }
    let after_writes = outbox_wal::wal_status(&fx.config)
        .await
        .unwrap()
        .current_wal_lsn;
    wait_for("heartbeats", Duration::from_secs(10), || {
        relay.counters.report().heartbeats >= 2
    })
    .await;
    let mut status = outbox_wal::wal_status(&fx.config).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while status.confirmed_flush_lsn.unwrap() < after_writes && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
        status = outbox_wal::wal_status(&fx.config).await.unwrap();
    }
    assert!(
        status.confirmed_flush_lsn.unwrap() >= after_writes,
        "the slot follows the WAL although the outbox is idle: {status:?} (before {before:?})"
    );
    assert!(status.active && status.lag_bytes.is_some() && status.retained_wal_bytes.is_some());
    let sampled = outbox_wal::wal_status_sampled(&fx.config, Duration::from_millis(1200))
        .await
        .unwrap();
    assert!(sampled.decode_txns_per_sec.is_some(), "{sampled:?}");
    relay.stop().await;
    fx.cleanup().await;
}

/// aggregate_id, id (None: a fresh UUID), event_type, payload, headers, and the column a bad
/// row's `last_error` must name (None: a good row).
type MixRow = (
    &'static str,
    Option<&'static str>,
    Option<&'static str>,
    &'static str,
    &'static str,
    Option<&'static str>,
);

/// One transaction of good and malformed rows written with raw SQL, as a foreign writer or a
/// hand edit would: returns the ids of the good rows and, per bad row, its seq and the column
/// its `last_error` must name. The table is loosened first (`loosen`) so that a NULL
/// `event_type`, a non-UUID `id` and a non-JSON `payload` can be stored at all.
async fn insert_mix(fx: &Fixture) -> (Vec<outbox_types::EventId>, Vec<(i64, &'static str)>) {
    let table = fx.outbox.qualified_table();
    let sql = format!(
        "INSERT INTO {table} (id, aggregate_type, aggregate_id, event_type, payload, headers)
         VALUES ($1, 'agg', $2, $3, $4, $5::jsonb) RETURNING seq"
    );
    let mut tx = fx.pool.begin().await.unwrap();
    let mut good = Vec::new();
    let mut bad = Vec::new();
    let rows: [MixRow; 7] = [
        ("a", None, Some("T"), r#"{"n":1}"#, "{}", None),
        (
            "a",
            None,
            Some("T"),
            r#"{"n":2}"#,
            r#"{"retry": 3}"#,
            Some("column `headers`"),
        ),
        ("a", None, Some("T"), r#"{"n":3}"#, r#"{"k": "v"}"#, None),
        (
            "b",
            None,
            None,
            r#"{"n":1}"#,
            "{}",
            Some("column `event_type` is NULL"),
        ),
        (
            "c",
            Some("not-a-uuid"),
            Some("T"),
            r#"{"n":1}"#,
            "{}",
            Some("column `id` is not a UUID"),
        ),
        (
            "d",
            None,
            Some("T"),
            "{oops",
            "{}",
            Some("column `payload` is not JSON"),
        ),
        ("b", None, Some("T"), r#"{"n":2}"#, "{}", None),
    ];
    for (agg, id, event_type, payload, headers, problem) in rows {
        let uuid = uuid::Uuid::now_v7();
        let id_text = id
            .map(|id| format!("{id}-{}", uuid.simple()))
            .unwrap_or_else(|| uuid.to_string());
        let seq: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(sql.clone()))
            .bind(&id_text)
            .bind(agg)
            .bind(event_type)
            .bind(payload)
            .bind(headers)
            .fetch_one(&mut *tx)
            .await
            .unwrap();
        match problem {
            None => good.push(outbox_types::EventId::from_uuid(uuid)),
            Some(column) => bad.push((seq, column)),
        }
    }
    tx.commit().await.unwrap();
    (good, bad)
}

/// What a hand-altered outbox table allows (the stock one refuses these values outright).
async fn loosen(fx: &Fixture) {
    fx.exec(format!(
        "ALTER TABLE {t} ALTER COLUMN event_type DROP NOT NULL,
             ALTER COLUMN id TYPE text, ALTER COLUMN payload TYPE text;
         DROP TRIGGER events_header_rules ON {t}",
        t = fx.outbox.qualified_table()
    ))
    .await;
}

/// Issue 22, item 3: a row whose headers are not an object of strings (or any row the decoder
/// refuses) used to stay pending in the stream and fail the whole page of the next catch-up
/// scan, so the relay exited at every start. Now each is dead-lettered with the column named,
/// in the scan and in the stream, and the rows around it keep flowing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_rows_are_dead_lettered_in_the_catch_up_scan_and_in_the_stream() {
    let fx = Fixture::new(&[Source::Table]).await;
    loosen(&fx).await;
    // Written before the relay starts: the catch-up scan meets them first.
    let (mut good, mut bad) = insert_mix(&fx).await;
    let sink = Arc::new(RecordingSink::new());
    // `skip`: good rows behind a bad one of their aggregate go on (under `block` they wait
    // behind it, as in polling mode).
    let skip = RelayConfig {
        dead_letter: outbox_types::DeadLetterPolicy::Skip,
        ..test_relay(&fx.config)
    };
    let relay = start_relay(fx.config.clone(), skip.clone(), sink.clone())
        .ready()
        .await;
    let dead_count = |rows: &[(i64, String, Option<String>)]| {
        rows.iter()
            .filter(|(_, status, _)| status == "dead")
            .count()
    };
    let mut rows = Vec::new();
    for round in 0..2 {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            rows = statuses(&fx).await;
            let delivered = sink.distinct_delivered();
            if dead_count(&rows) == bad.len() && good.iter().all(|id| delivered.contains(id)) {
                break;
            }
            assert!(
                !relay.handle.is_finished(),
                "the relay stopped (round {round})"
            );
            assert!(
                Instant::now() < deadline,
                "round {round}: {rows:?}, delivered {delivered:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        if round == 0 {
            // Written while the relay streams.
            let (g, b) = insert_mix(&fx).await;
            good.extend(g);
            bad.extend(b);
        }
    }
    for (seq, column) in &bad {
        let (_, status, error) = rows.iter().find(|(s, _, _)| s == seq).unwrap();
        let error = error.as_deref().unwrap_or_default();
        assert_eq!(status, "dead", "row {seq}");
        assert!(
            error.contains(column) && error.contains("outbox dead requeue"),
            "row {seq}: {error}"
        );
    }
    assert_eq!(sink.distinct_delivered().len(), good.len(), "nothing else");
    assert!(check_first_delivery_order(&sink.delivered()).is_empty());
    let report = relay.stop().await;
    assert!(report.dead >= bad.len() as u64, "{report:?}");

    // A restart runs, delivers what is new, and neither redelivers nor revives anything.
    let sink = Arc::new(RecordingSink::new());
    let relay = start_relay(fx.config.clone(), skip, sink.clone())
        .ready()
        .await;
    let fresh = numbered("e", 0);
    fx.enqueue_table(std::slice::from_ref(&fresh)).await;
    wait_for("the new event", Duration::from_secs(20), || {
        sink.distinct_delivered().contains(&fresh.id())
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(sink.delivered().len(), 1, "{:?}", sink.delivered());
    relay.stop().await;
    assert_eq!(
        fx.status_counts().await,
        (0, good.len() as i64 + 1, bad.len() as i64)
    );
    fx.cleanup().await;
}

/// Malformed message envelopes are dead-lettered too: inserted as `dead` rows with the reason,
/// where `outbox dead list` finds them, and the messages around them are delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_messages_are_dead_lettered_and_the_stream_moves_on() {
    let fx = Fixture::new(BOTH).await;
    let (sink, relay) = fx.start_recording().await;
    let prefix = fx.config.message_prefix.clone();
    let good = [numbered("m", 0), numbered("m", 1)];
    let mut tx = fx.pool.begin().await.unwrap();
    outbox_wal::enqueue_message(&mut *tx, &prefix, &good[0])
        .await
        .unwrap();
    for content in [
        r#"{"v":1,"id":"00000000-0000-0000-0000-000000000001","aggregate_type":"order","aggregate_id":"7","event_type":"T","payload":"{}","headers":{"retry":3},"occurred_at":"2024-01-01T00:00:00Z"}"#,
        "not an envelope",
    ] {
        sqlx::query("SELECT pg_logical_emit_message(true, $1, $2::text)")
            .bind(&prefix)
            .bind(content)
            .execute(&mut *tx)
            .await
            .unwrap();
    }
    outbox_wal::enqueue_message(&mut *tx, &prefix, &good[1])
        .await
        .unwrap();
    tx.commit().await.unwrap();

    wait_for("2 delivered, 2 buried", Duration::from_secs(20), || {
        let r = relay.counters.report();
        r.dead == 2 && sink.distinct_delivered().len() == 2
    })
    .await;
    assert_eq!(sink.distinct_delivered(), ids(&good));
    let report = relay.stop().await;
    assert_eq!(report.undecodable, 2, "{report:?}");
    let store = outbox_postgresql::PgStore::new(fx.pool.clone(), fx.outbox.clone());
    let dead = store.list_dead(None, 10).await.unwrap();
    assert_eq!(dead.len(), 2, "{dead:?}");
    for record in &dead {
        let error = record.last_error.as_deref().unwrap_or_default();
        assert!(
            error.contains("cannot be read as an event") && error.contains("outbox dead"),
            "{error}"
        );
    }
    let order = dead.iter().find(|r| r.event.aggregate_id == "7").unwrap();
    assert_eq!(order.event.aggregate_type, "order");
    assert!(order.last_error.as_deref().unwrap().contains("headers"));

    // After a restart: nothing redelivered, nothing buried twice.
    let (sink, relay) = fx.start_recording().await;
    fx.enqueue_messages(&[numbered("m", 2)]).await;
    wait_for("the new message", Duration::from_secs(20), || {
        sink.distinct_delivered().len() == 1
    })
    .await;
    relay.stop().await;
    assert_eq!(sink.delivered().len(), 1);
    assert_eq!(store.list_dead(None, 10).await.unwrap().len(), 2);
    fx.cleanup().await;
}

/// Issue 22, item 2: the message source is opt-in. With the default `sources`, a message with
/// the outbox prefix is never delivered and does not hold the slot. Issue 41, item 1: nor does
/// it reach the relay at all: the session asks the server for no messages, so the transaction
/// that carries only the message (like every heartbeat's) is never sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_message_source_is_off_by_default_and_its_messages_never_reach_the_relay() {
    let fx = Fixture::new(&outbox_wal::WalConfig::default().sources).await;
    let (sink, relay) = fx.start_recording().await;
    let message = numbered("m", 0);
    let row = numbered("t", 0);
    let mut tx = fx.pool.begin().await.unwrap();
    let written = outbox_wal::enqueue_message(&mut *tx, &fx.config.message_prefix, &message)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    fx.enqueue_table(std::slice::from_ref(&row)).await;
    wait_for("the table event", Duration::from_secs(20), || {
        sink.distinct_delivered().contains(&row.id())
    })
    .await;
    wait_for("the slot past the message", Duration::from_secs(10), || {
        relay.counters.report().last_acked_lsn > written.lsn
    })
    .await;
    assert!(!sink.distinct_delivered().contains(&message.id()));
    let report = relay.stop().await;
    assert_eq!(
        (report.transactions, report.decoded, report.heartbeats),
        (1, 1, 0),
        "only the row's transaction reached the relay: {report:?}"
    );
    fx.cleanup().await;
}

/// Issue 22, item 2: with the message source on, the relay refuses to start while every role
/// may call pg_logical_emit_message, and says what to run; after that, only granted roles can
/// write events. Its own database: function privileges are per database, and the suite's
/// `outbox` database is locked down already.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_message_source_is_refused_while_every_role_may_write_messages() {
    let admin = pool(2).await;
    let n = std::process::id();
    let db = format!("owt_{n}_open"); // the slot's name too: `owt_<pid>_…` (see drop_stale_slots)
    let (nobody, writer) = (format!("owt_nobody_{n}"), format!("owt_writer_{n}"));
    exec_each(
        &admin,
        [
            format!("DROP DATABASE IF EXISTS {db} WITH (FORCE)"),
            format!("DROP ROLE IF EXISTS {nobody}"),
            format!("DROP ROLE IF EXISTS {writer}"),
            format!("CREATE DATABASE {db}"),
            format!("CREATE ROLE {nobody} LOGIN"),
            format!("CREATE ROLE {writer} LOGIN"),
        ],
    )
    .await;
    let url = cluster_url_with(None, Some(&db), None);
    let as_role = |role: &str| {
        let mut u = url::Url::parse(&url).unwrap();
        u.set_username(role).unwrap();
        u.to_string()
    };
    let db_pool = sqlx::PgPool::connect(&url).await.unwrap();
    let outbox = outbox_postgresql::PgOutbox::with_names("outbox", "events").unwrap();
    outbox.migrate(&db_pool).await.unwrap();
    let config = outbox_wal::WalConfig {
        sources: BOTH.to_vec(),
        slot: db.clone(),
        publication: db.clone(),
        message_prefix: db.clone(),
        status_interval: Duration::from_millis(100),
        heartbeat_interval: Duration::from_millis(500),
        ..outbox_wal::WalConfig::new(url.clone())
    };

    // The open default: a role without any privilege writes an event.
    let nobody_pool = sqlx::PgPool::connect(&as_role(&nobody)).await.unwrap();
    outbox_wal::enqueue_message(&nobody_pool, &config.message_prefix, &numbered("evil", 0))
        .await
        .expect("PUBLIC may call pg_logical_emit_message by default");
    let access = outbox_wal::message_source_access(&config).await.unwrap();
    assert!(access.enabled && access.open_to_public(), "{access:?}");
    for overload in ["(boolean,text,bytea)", "(boolean,text,text)"] {
        let revoke =
            format!("REVOKE EXECUTE ON FUNCTION pg_logical_emit_message{overload} FROM PUBLIC;");
        assert!(access.fix.contains(&revoke), "{access:?}");
    }
    assert!(
        access
            .fix
            .iter()
            .any(|s| s.starts_with("GRANT EXECUTE ON FUNCTION pg_logical_emit_message(boolean,text,bytea) TO <writer roles>")),
        "{access:?}"
    );

    // The relay refuses, with the statements.
    let sink = Arc::new(RecordingSink::new());
    let refused = tokio::time::timeout(
        Duration::from_secs(30),
        outbox_wal::WalRelay::new(config.clone(), sink.clone()).run(std::future::pending()),
    )
    .await
    .expect("the relay gives up at once");
    match refused {
        Err(WalError::ServerSetup(msg)) => assert!(
            msg.contains(
                "REVOKE EXECUTE ON FUNCTION pg_logical_emit_message(boolean,text,text) FROM PUBLIC;"
            ) && msg.contains(&format!("database `{db}`"))
                && msg.contains("any role"),
            "{msg}"
        ),
        other => panic!("expected a refusal, got {other:?}"),
    }

    // Locked down as told: only the writer (and superusers) may write messages.
    let revokes = access
        .fix
        .iter()
        .filter(|s| s.starts_with("REVOKE"))
        .cloned();
    let grant = format!(
        "GRANT EXECUTE ON FUNCTION pg_logical_emit_message(boolean, text, bytea) TO {writer}"
    );
    exec_each(&db_pool, revokes.chain([grant])).await;
    let err =
        outbox_wal::enqueue_message(&nobody_pool, &config.message_prefix, &numbered("evil", 1))
            .await
            .unwrap_err();
    assert!(err.to_string().contains("permission denied"), "{err}");
    let access = outbox_wal::message_source_access(&config).await.unwrap();
    assert!(
        !access.open_to_public() && access.fix.is_empty(),
        "{access:?}"
    );
    assert_eq!(access.granted_to, std::slice::from_ref(&writer));
    // A relay role that is no superuser is told to grant itself the heartbeat overload.
    let as_nobody = outbox_wal::WalConfig {
        database_url: as_role(&nobody),
        ..config.clone()
    };
    let access = outbox_wal::message_source_access(&as_nobody).await.unwrap();
    assert!(!access.relay_can_emit, "{access:?}");
    assert_eq!(
        access.fix,
        [format!(
            "GRANT EXECUTE ON FUNCTION pg_logical_emit_message(boolean,text,bytea) TO {nobody};"
        )]
    );

    // Now the relay starts and delivers what the writer writes.
    let relay = start(config.clone(), sink.clone()).ready().await;
    let deadline = Instant::now() + Duration::from_secs(20);
    while !outbox_wal::wal_status(&config).await.unwrap().active {
        assert!(Instant::now() < deadline, "the relay streams");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let writer_pool = sqlx::PgPool::connect(&as_role(&writer)).await.unwrap();
    let event = numbered("w", 0);
    outbox_wal::enqueue_message(&writer_pool, &config.message_prefix, &event)
        .await
        .unwrap();
    wait_for("the writer's event", Duration::from_secs(20), || {
        sink.distinct_delivered().contains(&event.id())
    })
    .await;
    relay.stop().await;
    assert_eq!(sink.delivered().len(), 1);

    writer_pool.close().await;
    nobody_pool.close().await;
    db_pool.close().await;
    let _ = outbox_wal::drop_slot_waiting(&config, Duration::from_secs(5)).await;
    exec_each(
        &admin,
        [
            format!("DROP DATABASE IF EXISTS {db} WITH (FORCE)"),
            format!("DROP ROLE IF EXISTS {nobody}"),
            format!("DROP ROLE IF EXISTS {writer}"),
        ],
    )
    .await;
}

/// The `ssl` of the replication session of the relay with `relay_id`, per the server.
async fn replication_ssl(pool: &sqlx::PgPool, relay_id: &str) -> Option<bool> {
    let app = format!("outbox-wal {relay_id}");
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let ssl: Option<bool> = sqlx::query_scalar(
            "SELECT ssl FROM pg_stat_ssl JOIN pg_stat_replication USING (pid) WHERE application_name = $1",
        )
        .bind(&app)
        .fetch_optional(pool)
        .await
        .unwrap();
        if ssl.is_some() || Instant::now() > deadline {
            return ssl;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Issue 22, item 6: with nothing configured, the replication session (which carries every
/// payload) uses TLS when the server offers it, like libpq's `prefer`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_replication_connection_uses_tls_by_default() {
    if cluster_cert("rootcert").is_none() {
        eprintln!("skipped: OUTBOX_WAL_TEST_URL is not the TLS-enabled throwaway cluster");
        return;
    }
    let fx = Fixture::new(&[Source::Table]).await;
    assert!(!fx.config.database_url.contains("ssl"));
    let (_, relay) = fx.start_recording().await;
    assert_eq!(replication_ssl(&fx.pool, &fx.config.slot).await, Some(true));
    relay.stop().await;
    let conn = outbox_wal::check_replication_connection(&fx.config)
        .await
        .unwrap();
    assert_eq!(conn.sslmode, outbox_wal::SslMode::Prefer);
    assert!(conn.tls && conn.tls_version.is_some(), "{conn:?}");
    fx.cleanup().await;
}

/// `verify-full` checks the server's certificate against `sslrootcert`, by IP address and by
/// name; a CA that did not sign it is a configuration error that names the setting, not an
/// endless reconnect loop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_full_checks_the_server_certificate_against_sslrootcert() {
    let (Some(ca), Some(wrong)) = (cluster_cert("rootcert"), cluster_cert("wrong-rootcert")) else {
        eprintln!("skipped: OUTBOX_WAL_TEST_URL is not the TLS-enabled throwaway cluster");
        return;
    };
    let fx = Fixture::new(&[Source::Table]).await;
    let with = |host: &str, root: &str| outbox_wal::WalConfig {
        database_url: cluster_url_with(
            Some(host),
            None,
            Some(&format!("sslmode=verify-full&sslrootcert={root}")),
        ),
        ..fx.config.clone()
    };
    for host in ["127.0.0.1", "localhost"] {
        let conn = outbox_wal::check_replication_connection(&with(host, &ca))
            .await
            .unwrap_or_else(|e| panic!("{host}: {e}"));
        assert_eq!(conn.sslmode, outbox_wal::SslMode::VerifyFull);
        assert!(conn.tls, "{host}: {conn:?}");
    }
    let sink = Arc::new(RecordingSink::new());
    let relay = start(with("127.0.0.1", &ca), sink.clone()).ready().await;
    let event = numbered("v", 0);
    fx.enqueue_table(std::slice::from_ref(&event)).await;
    wait_for(
        "delivery over verified TLS",
        Duration::from_secs(20),
        || sink.distinct_delivered().contains(&event.id()),
    )
    .await;
    assert_eq!(replication_ssl(&fx.pool, &fx.config.slot).await, Some(true));
    relay.stop().await;

    let bad = with("127.0.0.1", &wrong);
    match outbox_wal::check_replication_connection(&bad).await {
        Err(WalError::Config(msg)) => assert!(
            msg.contains("certificate") && msg.contains("sslrootcert") && msg.contains(&wrong),
            "{msg}"
        ),
        other => panic!("expected a TLS configuration error, got {other:?}"),
    }
    let refused = tokio::time::timeout(
        Duration::from_secs(30),
        outbox_wal::WalRelay::new(bad, sink.clone()).run(std::future::pending()),
    )
    .await
    .expect("the relay gives up instead of retrying");
    match refused {
        Err(WalError::Config(msg)) => assert!(msg.contains("sslrootcert"), "{msg}"),
        other => panic!("expected a TLS configuration error, got {other:?}"),
    }
    fx.cleanup().await;
}

/// A payload above `max_payload_bytes` is dead-lettered with the limit named, whether the
/// catch-up scan meets it (without loading it) or the stream does; the catch-up scan reads its
/// pages by bytes (`max_buffered_bytes`), so a backlog of large rows comes a few at a time, in
/// order, and nothing else is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_payloads_are_dead_lettered_and_the_catch_up_pages_by_bytes() {
    let mut fx = Fixture::new(&[Source::Table]).await;
    fx.config.max_buffered_bytes = 10_000;
    let relay_settings = RelayConfig {
        max_payload_bytes: 8_000,
        max_batch_bytes: 10_000,
        ..test_relay(&fx.config)
    };
    // Written before the relay starts: twelve 2 kB rows (about five per page) and one too large.
    let mut backlog: Vec<outbox_types::NewEvent> = (0..12)
        .map(|n| sized(&format!("a{}", n % 3), n, 2_000))
        .collect();
    backlog.insert(5, sized("big", 0, 20_000));
    fx.enqueue_table(&backlog).await;
    let sink = Arc::new(RecordingSink::new());
    let relay = start_relay(fx.config.clone(), relay_settings, sink.clone())
        .ready()
        .await;
    wait_for("the backlog", Duration::from_secs(20), || {
        sink.distinct_delivered().len() == 12
    })
    .await;
    // And one more of each while it streams.
    let streamed = [sized("b", 0, 2_000), sized("big", 1, 9_000)];
    fx.enqueue_table(&streamed).await;
    wait_for("the streamed one", Duration::from_secs(20), || {
        sink.distinct_delivered().contains(&streamed[0].id())
    })
    .await;
    fx.wait_status_counts((0, 13, 2), Duration::from_secs(20))
        .await;
    relay.stop().await;
    assert!(check_first_delivery_order(&sink.delivered()).is_empty());
    assert!(
        !sink.distinct_delivered().contains(&backlog[5].id())
            && !sink.distinct_delivered().contains(&streamed[1].id())
    );
    for (_, status, error) in statuses(&fx).await {
        if status == "dead" {
            let error = error.unwrap_or_default();
            assert!(
                error.contains("bytes, above relay.max_payload_bytes = 8000"),
                "{error}"
            );
        }
    }
    fx.cleanup().await;
}

/// `delete_on_ack` (`retention.delivered = "0s"`; what `mark_delivered = false` now means):
/// delivered rows are deleted, and a restart delivers nothing again — the old
/// `mark_delivered = false` left them pending, so every start delivered them all a second time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delete_on_ack_leaves_nothing_to_deliver_again_after_a_restart() {
    let mut fx = Fixture::new(&[Source::Table]).await;
    fx.config.delete_on_ack = true;
    let (sink, relay) = fx.start_recording().await;
    let events: Vec<_> = (0..1000)
        .map(|n| numbered(&format!("a{}", n % 20), n / 20))
        .collect();
    fx.enqueue_table(&events).await;
    wait_for("the events", Duration::from_secs(30), || {
        sink.distinct_delivered().len() == 1000
    })
    .await;
    fx.wait_status_counts((0, 0, 0), Duration::from_secs(10))
        .await;
    relay.stop().await;
    // Started again (with the catch-up): nothing is delivered a second time.
    let relay = start(
        WalConfig {
            catch_up: true,
            ..fx.config.clone()
        },
        sink.clone(),
    )
    .ready()
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    relay.stop().await;
    assert_eq!(sink.delivered().len(), 1000, "no duplicates");
    assert!(check_first_delivery_order(&sink.delivered()).is_empty());
    fx.cleanup().await;
}

/// The partitioned layout streams too: the publication publishes through the partitioned
/// table's root, so inserts into any partition arrive as the outbox's, and the write-back marks
/// them delivered there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_partitioned_layout_streams() {
    let pool = pool(4).await;
    drop_stale_slots(&pool).await;
    let name = format!("owt_{}_part", std::process::id());
    let outbox = outbox_postgresql::PgOutbox::partitioned(
        &name,
        "events",
        outbox_postgresql::Partitioning::default(),
    )
    .unwrap();
    outbox.migrate(&pool).await.unwrap();
    outbox
        .maintain_partitions(&pool, chrono::Utc::now())
        .await
        .unwrap();
    let config = WalConfig {
        schema: name.clone(),
        table: "events".into(),
        slot: name.clone(),
        publication: name.clone(),
        message_prefix: name.clone(),
        status_interval: Duration::from_millis(100),
        ..WalConfig::new(cluster_url())
    };
    outbox_wal::prepare(&config).await.unwrap();
    let store = outbox_postgresql::PgStore::new(pool.clone(), outbox.clone());
    let sink = Arc::new(RecordingSink::new());
    let relay_config = test_relay(&config);
    let source = Arc::new(
        outbox_wal::WalSource::start(config.clone(), store.clone(), &relay_config)
            .await
            .unwrap(),
    );
    let counters = source.counters();
    let relay = outbox_engine::Relay::new(source.clone(), sink.clone(), relay_config);
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(relay.run(async move {
        let _ = rx.await;
    }));
    wait_for("streaming", Duration::from_secs(30), || {
        counters.streaming()
    })
    .await;
    let events: Vec<_> = (0..200)
        .map(|n| numbered(&format!("p{}", n % 10), n / 10))
        .collect();
    let mut tx_db = pool.begin().await.unwrap();
    outbox.enqueue_batch(&mut *tx_db, &events).await.unwrap();
    tx_db.commit().await.unwrap();
    wait_for(
        "the partitioned outbox's events",
        Duration::from_secs(30),
        || sink.distinct_delivered().len() == 200,
    )
    .await;
    assert!(
        counters.report().claimed >= 200,
        "from the stream, not the table: {:?}",
        counters.report()
    );
    tx.send(()).unwrap();
    run.await.unwrap();
    source.shutdown().await.unwrap();
    assert_eq!(store.stats().await.unwrap().delivered, 200);
    assert!(check_first_delivery_order(&sink.delivered()).is_empty());
    let _ = outbox_wal::drop_slot(&config).await;
    let _ = sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP PUBLICATION IF EXISTS \"{name}\""
    )))
    .execute(&pool)
    .await;
    let _ = sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP SCHEMA IF EXISTS \"{name}\" CASCADE"
    )))
    .execute(&pool)
    .await;
}

/// A drain (`stop_when_idle`) over a catch-up backlog of two destinations, one of which fills
/// whole claims: the relay's fair turns skip it for a claim now and then, and a skipping table
/// claim that finds nothing else must not count as "the table is empty" (the drain would stop
/// with the skipped destination's rows pending).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_with_fair_turns_delivers_every_destinations_backlog() {
    let fx = Fixture::bare(&[Source::Table]).await;
    let hook_events: Vec<_> = (0..3000u64)
        .map(|n| {
            outbox_types::NewEvent::new(
                "hook",
                format!("h{}", n % 40),
                "Numbered",
                &serde_json::json!({ "aggregate": format!("h{}", n % 40), "n": n / 40 }),
            )
            .unwrap()
        })
        .collect();
    let main_events: Vec<_> = (0..40u64)
        .map(|n| numbered(&format!("m{}", n % 4), n / 4))
        .collect();
    // Committed before the slot exists: the catch-up's table claims deliver them.
    fx.enqueue_table(&hook_events).await;
    fx.enqueue_table(&main_events).await;
    outbox_wal::prepare(&fx.config).await.unwrap();
    let main = Arc::new(RecordingSink::new());
    let hooks = Arc::new(RecordingSink::new());
    let (router, routes) = outbox_store_tests::split_by_aggregate_type(
        "h*",
        ("hooks", hooks.clone()),
        ("main", main.clone()),
    );
    let relay = outbox_wal::WalRelay::new(fx.config.clone(), Arc::new(router))
        .with_relay(RelayConfig {
            batch_size: 20,
            stop_when_idle: true,
            ..test_relay(&fx.config)
        })
        .with_routes(Arc::new(routes));
    tokio::time::timeout(
        Duration::from_secs(60),
        relay.run(std::future::pending::<()>()),
    )
    .await
    .expect("the drain ends")
    .unwrap();
    assert_eq!(
        (
            hooks.distinct_delivered().len(),
            main.distinct_delivered().len()
        ),
        (3000, 40),
        "the drain delivered every destination's backlog"
    );
    assert!(check_first_delivery_order(&hooks.delivered()).is_empty());
    assert!(check_first_delivery_order(&main.delivered()).is_empty());
    fx.cleanup().await;
}
