//! Retention: purging delivered events deletes only old delivered ones.

use std::time::Duration;

use outbox_testkit::numbered;
use outbox_types::Store;

use crate::harness::*;

/// Retention deletes delivered events older than the cutoff, and never anything else.
pub async fn purge_deletes_only_old_delivered_events<H: Harness>(h: &H) {
    let store = h.fresh().await;
    let ids = h
        .enqueue(
            &store,
            &(0..6)
                .map(|i| numbered(&format!("p{i}"), 0))
                .collect::<Vec<_>>(),
        )
        .await;
    // 3 delivered, 1 dead, 1 in flight, 1 pending.
    let claim = store.claim(&claim_up_to(5)).await.unwrap();
    let seqs = seqs_of(&claim.events);
    store.ack(&claim.lease, &seqs[..3]).await.unwrap();
    store
        .bury(&claim.lease, &[buried(seqs[3], "x")])
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    let ms = Duration::from_millis(1);
    for (older_than, batch, deleted, why) in [
        (Duration::from_secs(3600), 100, 0, "too recent"),
        (ms, 2, 2, "batch limit holds"),
        (ms, 100, 1, "the rest"),
    ] {
        let purged = store.purge_delivered(older_than, batch).await.unwrap();
        assert_eq!(purged, deleted, "{why}");
    }
    let stats = store.stats().await.unwrap();
    assert_eq!(
        (stats.delivered, stats.dead, stats.in_flight, stats.pending),
        (0, 1, 1, 1),
        "{stats:?}"
    );
    assert!(store.get(ids[5].0).await.unwrap().is_some());
}
