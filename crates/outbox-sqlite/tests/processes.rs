//! Several relays on one SQLite file: separate pools in one process (each with its own
//! connections, locks and in-process write queue, exactly what a second process has), and real
//! child processes. Every event is handed out once, and each aggregate comes out in order.

mod common;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use common::TempStore;
use outbox_sqlite::{SqliteOutbox, SqliteStore};
use outbox_testkit::concurrent::race;
use outbox_types::{NewEvent, Store};
use tokio::io::{AsyncBufReadExt, BufReader};

const CHILD_ENV: &str = "OUTBOX_SQLITE_CLAIMER_DB";

fn events(aggregates: usize, per_aggregate: u64) -> Vec<NewEvent> {
    let mut events = Vec::new();
    for n in 0..per_aggregate {
        for a in 0..aggregates {
            events.push(outbox_testkit::numbered(&format!("agg{a}"), n));
        }
    }
    events
}

fn n_of(e: &outbox_types::Event) -> u64 {
    let value: serde_json::Value = serde_json::from_str(&e.payload).unwrap();
    value["n"].as_u64().unwrap()
}

/// One claimed event: (id, aggregate, n, global ticket taken when the claim returned).
type Claimed = (String, String, u64, u64);

/// Claim and ack until nothing is pending or in flight; returns what this worker claimed.
async fn claim_until_done(
    store: SqliteStore,
    owner: String,
    tickets: Arc<AtomicU64>,
) -> Vec<Claimed> {
    let mut mine = Vec::new();
    outbox_store_tests::claim_and_ack_until_drained(
        &store,
        &owner,
        17,
        Duration::from_secs(120),
        Duration::from_millis(10),
        |events| {
            let ticket = tickets.fetch_add(1, Ordering::SeqCst);
            for e in events {
                mine.push((e.id.to_string(), e.aggregate_id.clone(), n_of(e), ticket));
            }
        },
    )
    .await;
    mine
}

/// Every event exactly once, and per aggregate the claim order is the enqueue order.
fn check(all: &[Claimed], aggregates: usize, per_aggregate: u64) {
    let total = aggregates * per_aggregate as usize;
    let distinct: HashSet<&str> = all.iter().map(|(id, ..)| id.as_str()).collect();
    assert_eq!(distinct.len(), total, "every event was claimed");
    assert_eq!(all.len(), total, "no event was handed out twice");
    let mut per_agg: HashMap<&str, Vec<(u64, u64)>> = HashMap::new();
    for (_, agg, n, ticket) in all {
        per_agg.entry(agg).or_default().push((*ticket, *n));
    }
    assert_eq!(per_agg.len(), aggregates);
    for (agg, mut seen) in per_agg {
        seen.sort();
        let ns: Vec<u64> = seen.iter().map(|(_, n)| *n).collect();
        assert_eq!(
            ns,
            (0..per_aggregate).collect::<Vec<_>>(),
            "aggregate {agg} claimed in order"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_stores_on_one_file_never_hand_out_an_event_twice() {
    let (aggregates, per_aggregate) = (60, 50);
    let first = TempStore::new().await;
    let second = first.reopen().await;
    for chunk in events(aggregates, per_aggregate).chunks(1000) {
        common::enqueue_committed(&first, chunk).await;
    }
    let tickets = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for (s, store) in [first.store.clone(), second].into_iter().enumerate() {
        for w in 0..4 {
            tasks.push(tokio::spawn(claim_until_done(
                store.clone(),
                format!("store{s}-w{w}"),
                tickets.clone(),
            )));
        }
    }
    let mut all = Vec::new();
    let mut per_store = [0usize; 2];
    for (i, t) in tasks.into_iter().enumerate() {
        let mine = t.await.unwrap();
        per_store[i / 4] += mine.len();
        all.extend(mine);
    }
    check(&all, aggregates, per_aggregate);
    assert!(
        per_store.iter().all(|n| *n > 0),
        "both stores claimed: {per_store:?}"
    );
    assert_eq!(
        first.stats().await.unwrap().delivered,
        (aggregates as u64) * per_aggregate
    );
}

/// Not a test on its own: the body of each child process of
/// `relay_processes_on_one_file_never_hand_out_an_event_twice`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "run as a child process by relay_processes_on_one_file_never_hand_out_an_event_twice"]
async fn child_claimer() {
    let Ok(path) = std::env::var(CHILD_ENV) else {
        return;
    };
    let store = common::open(path.as_ref(), SqliteOutbox::new()).await;
    println!("CHILD-START");
    let tickets = Arc::new(AtomicU64::new(0));
    let pid = std::process::id();
    let workers: Vec<_> = (0..2)
        .map(|w| {
            tokio::spawn(claim_until_done(
                store.clone(),
                format!("child-{pid}-{w}"),
                tickets.clone(),
            ))
        })
        .collect();
    for w in workers {
        for (id, agg, n, _) in w.await.unwrap() {
            println!("CLAIMED {id} {agg} {n}");
        }
    }
    println!("CHILD-DONE");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn relay_processes_on_one_file_never_hand_out_an_event_twice() {
    let (aggregates, per_aggregate) = (40, 40);
    let parent = TempStore::new().await;
    for chunk in events(aggregates, per_aggregate).chunks(800) {
        common::enqueue_committed(&parent, chunk).await;
    }
    let mut children = Vec::new();
    let mut starts = Vec::new();
    for _ in 0..2 {
        let mut child = common::spawn_child("child_claimer", CHILD_ENV, &parent.path);
        let stdout = child.stdout.take().unwrap();
        let (started_tx, started_rx) = tokio::sync::oneshot::channel::<()>();
        starts.push(started_rx);
        children.push((
            child,
            tokio::spawn(async move {
                let mut started = Some(started_tx);
                let mut claimed = Vec::new();
                let mut done = false;
                let mut lines = BufReader::new(stdout).lines();
                while let Some(line) = lines.next_line().await.unwrap() {
                    // libtest's own "test child_claimer ... " may share a line with ours.
                    let ours = ["CLAIMED ", "CHILD-DONE", "CHILD-START"]
                        .iter()
                        .filter_map(|tag| line.find(tag))
                        .min()
                        .map_or("", |at| &line[at..]);
                    let mut parts = ours.split_whitespace();
                    match parts.next() {
                        Some("CLAIMED") => {
                            let id = parts.next().unwrap().to_owned();
                            let agg = parts.next().unwrap().to_owned();
                            let n: u64 = parts.next().unwrap().parse().unwrap();
                            claimed.push((id, agg, n));
                        }
                        Some("CHILD-DONE") => done = true,
                        Some("CHILD-START") => {
                            if let Some(tx) = started.take() {
                                let _ = tx.send(());
                            }
                        }
                        _ => {}
                    }
                }
                (claimed, done)
            }),
        ));
    }
    // The parent claims too, alongside the children, once they are running.
    for started in starts {
        tokio::time::timeout(Duration::from_secs(60), started)
            .await
            .unwrap()
            .unwrap();
    }
    let tickets = Arc::new(AtomicU64::new(0));
    let own = claim_until_done(parent.store.clone(), "parent".into(), tickets).await;

    let mut all: Vec<(String, String, u64)> = own
        .into_iter()
        .map(|(id, agg, n, _)| (id, agg, n))
        .collect();
    for (mut child, reader) in children {
        let status = tokio::time::timeout(Duration::from_secs(120), child.wait())
            .await
            .unwrap()
            .unwrap();
        assert!(status.success(), "child failed: {status}");
        let (claimed, done) = reader.await.unwrap();
        assert!(done, "the child finished its loop");
        assert!(!claimed.is_empty(), "each child process claimed events");
        all.extend(claimed);
    }
    let total = aggregates * per_aggregate as usize;
    let distinct: HashSet<&str> = all.iter().map(|(id, ..)| id.as_str()).collect();
    assert_eq!(distinct.len(), total, "every event was claimed");
    assert_eq!(all.len(), total, "no event was handed out twice");
    let stats = parent.stats().await.unwrap();
    assert_eq!(stats.delivered, total as u64, "{stats:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn relays_opening_a_fresh_file_together_all_get_in() {
    for _ in 0..5 {
        let (_dir, path) = TempStore::dir();
        let stats = race(6, |_| {
            let path = path.clone();
            async move {
                let store = SqliteStore::connect(path.to_str().unwrap(), SqliteOutbox::new())
                    .await
                    .unwrap();
                store.outbox().migrate(store.pool()).await.unwrap();
                store.stats().await.unwrap()
            }
        })
        .await;
        for s in stats {
            assert_eq!(s.pending, 0);
        }
    }
}
