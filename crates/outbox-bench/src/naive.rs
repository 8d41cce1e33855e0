//! The seeds' naive relay, the baseline every figure is compared against.
//!
//! It is the poller the articles start from, written as such pollers usually are: select every
//! pending row ordered by time, send them one at a time waiting for each acknowledgement, delete
//! each row after its ack, and sleep five seconds when nothing is pending. It publishes through
//! the same [`Sink`] as the real relay, so a ratio between the two measures the relay, not the
//! destination. It is deliberately not improved: no batching, no pipelining, no lease, no
//! per-aggregate holding back after a failure (a failed send stops the pass and it starts over
//! after the sleep).

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use outbox_postgresql::PgStore;
use outbox_types::{Event, EventId, Outcome, Sink};
use sqlx::Row;

/// What the naive relay did.
#[derive(Debug, Default)]
pub struct NaiveReport {
    pub delivered: u64,
    pub failed: u64,
    pub passes: u64,
}

/// Run the naive loop until `stop` resolves or, when `expect` is given, until that many events
/// were delivered (a drain). `idle_sleep` is the seeds' five seconds.
pub async fn run(
    store: &PgStore,
    sink: Arc<dyn Sink>,
    expect: Option<u64>,
    idle_sleep: Duration,
    stop: impl std::future::Future<Output = ()>,
) -> anyhow::Result<NaiveReport> {
    let t = store.outbox().qualified_table().to_owned();
    let select = format!(
        "SELECT seq, id, aggregate_type, aggregate_id, event_type, payload::text AS payload,
                destination, occurred_at, enqueued_at
         FROM {t} WHERE status = 'pending' ORDER BY occurred_at"
    );
    let delete = format!("DELETE FROM {t} WHERE seq = $1");
    let mut report = NaiveReport::default();
    tokio::pin!(stop);
    loop {
        if expect.is_some_and(|n| report.delivered >= n) {
            return Ok(report);
        }
        report.passes += 1;
        let rows = tokio::select! {
            rows = sqlx::query(sqlx::AssertSqlSafe(select.as_str())).fetch_all(store.pool()) => rows?,
            () = &mut stop => return Ok(report),
        };
        let mut failed = false;
        for row in &rows {
            let event = Event {
                seq: row.try_get("seq")?,
                id: EventId::from_uuid(row.try_get("id")?),
                aggregate_type: row.try_get("aggregate_type")?,
                aggregate_id: row.try_get("aggregate_id")?,
                event_type: row.try_get("event_type")?,
                payload: row.try_get("payload")?,
                destination: row.try_get("destination")?,
                headers: Default::default(),
                idempotency_key: None,
                occurred_at: row.try_get::<DateTime<Utc>, _>("occurred_at")?,
                enqueued_at: row.try_get::<DateTime<Utc>, _>("enqueued_at")?,
                attempts: 0,
            };
            let outcome = sink.publish(std::slice::from_ref(&event)).await;
            if outcome.first() != Some(&Outcome::Delivered) {
                report.failed += 1;
                failed = true;
                break;
            }
            sqlx::query(sqlx::AssertSqlSafe(delete.as_str()))
                .bind(event.seq)
                .execute(store.pool())
                .await?;
            report.delivered += 1;
        }
        if rows.is_empty() || failed {
            if expect.is_some_and(|n| report.delivered >= n) {
                return Ok(report);
            }
            tokio::select! {
                () = tokio::time::sleep(idle_sleep) => {}
                () = &mut stop => return Ok(report),
            }
        }
    }
}
