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
//! Features: `postgres` and `sqlite` (both on by default) select the stores.

pub use outbox_core::*;

/// The relay engine: claim → publish → ack.
pub use outbox_relay as relay;

/// PostgreSQL: [`postgres::PgOutbox`] to migrate and enqueue, [`postgres::PgStore`] for relays.
#[cfg(feature = "postgres")]
pub use outbox_postgres as postgres;

/// SQLite: [`sqlite::SqliteOutbox`] to migrate and enqueue, [`sqlite::SqliteStore`] for relays.
#[cfg(feature = "sqlite")]
pub use outbox_sqlite as sqlite;
