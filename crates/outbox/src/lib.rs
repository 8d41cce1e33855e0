//! # outbox
//!
//! The transactional outbox for Rust. Write your business rows and the events that describe them
//! in **one** local transaction; a relay (this crate's [`relay`], or the `outbox` daemon) delivers
//! every committed event at least once, in order per aggregate, with retries, backoff and dead
//! letters — and never one that was rolled back. Consumers deduplicate on the event id.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use outbox::NewEvent;
//! use outbox::sqlite::{SqliteOutbox, SqliteStore};
//!
//! # let dir = tempfile::tempdir()?; let path = dir.path().join("app.db");
//! let store = SqliteStore::connect(path.to_str().unwrap(), SqliteOutbox::new()).await?;
//! store.outbox().migrate(store.pool()).await?;
//! sqlx::query("CREATE TABLE orders (id INTEGER PRIMARY KEY, amount INTEGER)").execute(store.pool()).await?;
//!
//! #[derive(serde::Serialize)]
//! struct OrderCreated { id: i64, amount: i64 }
//!
//! let mut tx = store.pool().begin().await?;
//! sqlx::query("INSERT INTO orders VALUES (1, 1999)").execute(&mut *tx).await?;
//! let event = NewEvent::new("order", "1", "OrderCreated", &OrderCreated { id: 1, amount: 1999 })?
//!     .with_idempotency_key("order-1-created");
//! store.outbox().enqueue(&mut *tx, &event).await?;
//! tx.commit().await?; // the order and its event exist together, or neither does
//!
//! // Committed: it waits in the outbox for a relay to deliver it.
//! use outbox::Store;
//! assert_eq!(store.stats().await?.pending, 1);
//! # Ok(()) }
//! ```
//!
//! Features: `postgres` and `sqlite` (both on by default), `mysql` select the stores; `wal`
//! adds WAL mode (logical replication, PostgreSQL); `inbox` the consumer-side inbox;
//! `opentelemetry` lets [`trace::current_traceparent`] read the W3C trace context of the current
//! `tracing` span, to store with an event ([`NewEvent::with_traceparent`]).

pub use outbox_types::*;

/// The relay engine: claim → publish → ack.
pub use outbox_engine as relay;

/// PostgreSQL: [`postgres::PgOutbox`] to migrate and enqueue, [`postgres::PgStore`] for relays.
#[cfg(feature = "postgres")]
pub use outbox_postgresql as postgres;

/// SQLite: [`sqlite::SqliteOutbox`] to migrate and enqueue, [`sqlite::SqliteStore`] for relays.
#[cfg(feature = "sqlite")]
pub use outbox_sqlite as sqlite;

/// MySQL / MariaDB: [`mysql::MySqlOutbox`] to migrate and enqueue, [`mysql::MySqlStore`] for
/// relays.
#[cfg(feature = "mysql")]
pub use outbox_mysql as mysql;

/// WAL mode: deliver from PostgreSQL's write-ahead log; [`wal::enqueue_message`] writes a
/// table-less event.
#[cfg(feature = "wal")]
pub use outbox_wal as wal;

/// The consumer side: record `(event_id, handler)` in the effect's own transaction.
#[cfg(feature = "inbox")]
pub use outbox_inbox as inbox;

/// W3C trace context for events, from the current `tracing` span when OpenTelemetry is in use.
#[cfg(feature = "opentelemetry")]
pub mod trace {
    use opentelemetry::trace::TraceContextExt;
    use tracing_opentelemetry::OpenTelemetrySpanExt;

    /// The `traceparent` of an OpenTelemetry context, if it carries a valid span.
    pub fn traceparent_of(cx: &opentelemetry::Context) -> Option<String> {
        let span = cx.span();
        let sc = span.span_context();
        sc.is_valid().then(|| {
            format!(
                "00-{}-{}-{:02x}",
                sc.trace_id(),
                sc.span_id(),
                sc.trace_flags().to_u8()
            )
        })
    }

    /// The `traceparent` of the current `tracing` span (through `tracing-opentelemetry`), if
    /// the span is recorded by an OpenTelemetry layer.
    ///
    /// ```no_run
    /// # fn f(event: outbox::NewEvent) -> Result<(), outbox::EncodeError> {
    /// let event = match outbox::trace::current_traceparent() {
    ///     Some(tp) => event.with_traceparent(&tp, None)?,
    ///     None => event,
    /// };
    /// # Ok(()) }
    /// ```
    pub fn current_traceparent() -> Option<String> {
        traceparent_of(&tracing::Span::current().context())
    }
}
