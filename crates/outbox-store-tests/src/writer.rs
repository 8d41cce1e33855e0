//! The writer's side of the outbox, written once: an event exists exactly when the business
//! transaction that enqueued it committed, and the library refuses a reserved header before
//! anything reaches the database.
//!
//! These scenarios were near copies in each store's `tests/atomicity.rs` and
//! `tests/write_checks.rs`; a store's test now implements [`Writer`] (its transactions, its
//! business write and its counts, in its own SQL dialect) and calls the scenarios from plain
//! `#[tokio::test]` functions, so a fix to a scenario reaches every store.

use std::ops::DerefMut;
use std::time::Duration;

use outbox_testkit::order_created;
use outbox_types::sql_store::Enqueued;
use outbox_types::{
    ClaimRequest, DeadLetterPolicy, EncodeError, EventId, NewEvent, Store, StoreError,
};

/// Where an enqueue writes: inside a transaction the caller holds (its connection), or through
/// the store's pool (an autocommitted statement of its own).
pub enum Through<'a, C> {
    /// The caller's connection, inside its transaction.
    Conn(&'a mut C),
    /// The store's pool: the enqueue commits by itself.
    Pool,
}

/// How the writer scenarios get at a store: its transactions, a business write beside the
/// enqueue, and counts as another connection sees them. The parts that differ only by the
/// sqlx database type (transactions, enqueue, the business insert, counts) come from
/// [`sqlx_writer!`]; a store writes the rest.
///
/// Native `async fn`: the scenarios are generic and run on the test's own runtime, never
/// spawned, so no `Send` bound is needed; a concrete writer's futures are `Send` when its
/// database's are.
#[allow(async_fn_in_trait)]
pub trait Writer: Send + Sync + 'static {
    /// The store under test.
    type Store: Store + Send + Sync;
    /// A connection of the store's database: what an enqueue inside a transaction writes to.
    type Conn: Send;
    /// A transaction begun on the store's pool.
    type Tx: DerefMut<Target = Self::Conn> + Send;

    /// A new, migrated, empty outbox, isolated from every other test.
    async fn fresh(&self) -> Self::Store;
    /// The same outbox as another process sees it: another pool for a file database, the same
    /// pool (whose other connections are other sessions) for a server.
    async fn observer(&self, store: &Self::Store) -> Self::Store;
    /// Create the business table `orders (id, amount)` beside the outbox; returns its name as
    /// SQL writes it.
    async fn business_table(&self, store: &Self::Store) -> String;
    /// The outbox table's name as SQL writes it.
    fn outbox_table(&self, store: &Self::Store) -> String;

    /// Begin a transaction on the store's pool, as a writer does.
    async fn begin(&self, store: &Self::Store) -> Self::Tx;
    /// The business write: `INSERT INTO {orders} VALUES (id, amount)` on `conn`.
    async fn insert_order(&self, conn: &mut Self::Conn, orders: &str, id: i64, amount: i64);
    /// `SELECT count(*) FROM {table}` through `store`'s pool.
    async fn count_rows(&self, store: &Self::Store, table: &str) -> i64;
    async fn commit(&self, tx: Self::Tx);
    async fn rollback(&self, tx: Self::Tx);
    /// The store's `enqueue` of one event.
    async fn enqueue(
        &self,
        store: &Self::Store,
        through: Through<'_, Self::Conn>,
        event: &NewEvent,
    ) -> Result<Enqueued, StoreError>;
    /// The store's `enqueue_batch`.
    async fn enqueue_batch(
        &self,
        store: &Self::Store,
        through: Through<'_, Self::Conn>,
        events: &[NewEvent],
    ) -> Result<Vec<Enqueued>, StoreError>;
}

/// The items of a [`Writer`] impl that are the same for every sqlx-backed store but for the
/// database type `$db`: the connection and transaction types, `begin` (`pool().begin()`, or
/// `pool().begin_with(statement)` given `begin = statement`), the business insert, counts,
/// commit, rollback, and enqueue through the caller's connection or the store's pool
/// (`store.outbox().enqueue(..)` / `.enqueue_batch(..)`, `store.pool()`). Used inside
/// `impl Writer for MyWriter { .. }` next to the store's own items; the caller's crate needs
/// `sqlx` with `$db`'s driver.
#[macro_export]
macro_rules! sqlx_writer {
    ($db:ty) => {
        async fn begin(&self, store: &Self::Store) -> Self::Tx {
            store.pool().begin().await.unwrap()
        }

        $crate::sqlx_writer!(@items $db);
    };
    ($db:ty, begin = $statement:literal) => {
        async fn begin(&self, store: &Self::Store) -> Self::Tx {
            store.pool().begin_with($statement).await.unwrap()
        }

        $crate::sqlx_writer!(@items $db);
    };
    (@items $db:ty) => {
        type Conn = <$db as sqlx::Database>::Connection;
        type Tx = sqlx::Transaction<'static, $db>;

        async fn insert_order(&self, conn: &mut Self::Conn, orders: &str, id: i64, amount: i64) {
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "INSERT INTO {orders} VALUES ({id}, {amount})"
            )))
            .execute(conn)
            .await
            .unwrap();
        }

        async fn count_rows(&self, store: &Self::Store, table: &str) -> i64 {
            sqlx::query_scalar(sqlx::AssertSqlSafe(format!("SELECT count(*) FROM {table}")))
                .fetch_one(store.pool())
                .await
                .unwrap()
        }

        async fn commit(&self, tx: Self::Tx) {
            tx.commit().await.unwrap();
        }

        async fn rollback(&self, tx: Self::Tx) {
            tx.rollback().await.unwrap();
        }

        async fn enqueue(
            &self,
            store: &Self::Store,
            through: $crate::Through<'_, Self::Conn>,
            event: &$crate::__private::NewEvent,
        ) -> Result<$crate::__private::Enqueued, $crate::__private::StoreError> {
            match through {
                $crate::Through::Conn(conn) => store.outbox().enqueue(conn, event).await,
                $crate::Through::Pool => store.outbox().enqueue(store.pool(), event).await,
            }
        }

        async fn enqueue_batch(
            &self,
            store: &Self::Store,
            through: $crate::Through<'_, Self::Conn>,
            events: &[$crate::__private::NewEvent],
        ) -> Result<Vec<$crate::__private::Enqueued>, $crate::__private::StoreError> {
            match through {
                $crate::Through::Conn(conn) => store.outbox().enqueue_batch(conn, events).await,
                $crate::Through::Pool => store.outbox().enqueue_batch(store.pool(), events).await,
            }
        }
    };
}

/// Paths [`sqlx_writer!`] expands to, so its callers need not name these crates.
#[doc(hidden)]
pub mod __private {
    pub use outbox_types::sql_store::Enqueued;
    pub use outbox_types::{NewEvent, StoreError};
}

/// A server database whose writer's session another connection can end mid-transaction.
#[allow(async_fn_in_trait)]
pub trait KillableWriter: Writer {
    /// The server's id of a session, what kills it.
    type Session: Send;
    /// A connection of its own, outside the store's pool, and its session id.
    async fn connect_writer(&self) -> (Self::Conn, Self::Session);
    /// Begin a transaction by hand, one sqlx does not know about.
    async fn begin_by_hand(&self, conn: &mut Self::Conn);
    /// `COMMIT` by hand; whether it succeeded.
    async fn commit_by_hand(&self, conn: &mut Self::Conn) -> bool;
    /// End the session `session` from the store's pool, as when the writer's process dies.
    async fn kill(&self, store: &Self::Store, session: Self::Session);
}

/// The claim the write-check tests settle hand-written rows with: up to 100 events under
/// `skip`, so a row whose headers cannot be read is dead-lettered without holding the rest.
pub fn write_checks_claim() -> ClaimRequest {
    ClaimRequest::new(
        "write-checks",
        100,
        Duration::from_secs(30),
        DeadLetterPolicy::Skip,
    )
}

/// The SQLSTATE of `error` (`""` when it is not a database error): what the write-check tests
/// assert a refused hand-written insert failed with.
pub fn sqlstate(error: &sqlx::Error) -> String {
    error
        .as_database_error()
        .and_then(|e| e.code())
        .map(|c| c.into_owned())
        .unwrap_or_default()
}

/// (orders, outbox events) as `store`'s pool sees them.
pub async fn counts<W: Writer>(w: &W, store: &W::Store, orders: &str) -> (i64, i64) {
    (
        w.count_rows(store, orders).await,
        outbox_rows(w, store).await,
    )
}

/// The rows of the outbox table, whatever their state, as `store`'s pool sees them.
pub async fn outbox_rows<W: Writer>(w: &W, store: &W::Store) -> i64 {
    w.count_rows(store, &w.outbox_table(store)).await
}

/// Enqueue `events` in one committed transaction, the way a writer would; `(id, created)` per
/// event, as [`crate::Harness::enqueue`] returns them.
pub async fn enqueue_committed<W: Writer>(
    w: &W,
    store: &W::Store,
    events: &[NewEvent],
) -> Vec<(EventId, bool)> {
    let mut tx = w.begin(store).await;
    let done = w
        .enqueue_batch(store, Through::Conn(&mut *tx), events)
        .await
        .unwrap();
    w.commit(tx).await;
    done.into_iter().map(|e| (e.id, e.created)).collect()
}

/// The order and its events, written in one transaction, appear together at the commit and
/// not before, to another connection.
pub async fn committed_transaction_keeps_order_and_event_together<W: Writer>(w: &W) {
    let store = w.fresh().await;
    let orders = w.business_table(&store).await;
    let other = w.observer(&store).await;
    let mut tx = w.begin(&store).await;
    w.insert_order(&mut tx, &orders, 1, 1999).await;
    let one = w
        .enqueue(&store, Through::Conn(&mut *tx), &order_created(1))
        .await
        .unwrap();
    let batch = w
        .enqueue_batch(
            &store,
            Through::Conn(&mut *tx),
            &[order_created(2), order_created(3)],
        )
        .await
        .unwrap();
    assert!(one.created && batch.iter().all(|e| e.created));
    assert_eq!(
        counts(w, &other, &orders).await,
        (0, 0),
        "enqueue never commits on its own, and is invisible to others before the commit"
    );
    assert!(other.get(one.id).await.unwrap().is_none());
    assert_eq!(other.stats().await.unwrap().pending, 0);
    w.commit(tx).await;
    assert_eq!(counts(w, &other, &orders).await, (1, 3));
    let record = other.get(one.id).await.unwrap().unwrap();
    assert_eq!(record.event.event_type, "OrderCreated");
    assert!(other.get(batch[1].id).await.unwrap().is_some());
}

/// A rolled-back transaction leaves neither the order nor its events, nor the idempotency key
/// of one of them.
pub async fn rolled_back_transaction_leaves_neither<W: Writer>(w: &W) {
    let store = w.fresh().await;
    let orders = w.business_table(&store).await;
    let mut tx = w.begin(&store).await;
    w.insert_order(&mut tx, &orders, 2, 5).await;
    w.enqueue(&store, Through::Conn(&mut *tx), &order_created(2))
        .await
        .unwrap();
    w.enqueue_batch(
        &store,
        Through::Conn(&mut *tx),
        &[
            order_created(3),
            order_created(4).with_idempotency_key("order-4"),
        ],
    )
    .await
    .unwrap();
    w.rollback(tx).await;
    assert_eq!(counts(w, &store, &orders).await, (0, 0));
    assert_eq!(counts(w, &w.observer(&store).await, &orders).await, (0, 0));
    assert_eq!(store.stats().await.unwrap().pending, 0);
    // The key went with the rollback: enqueueing it again creates the event.
    let again = w
        .enqueue(
            &store,
            Through::Pool,
            &order_created(4).with_idempotency_key("order-4"),
        )
        .await
        .unwrap();
    assert!(again.created);
}

/// A writer whose session dies mid-transaction (its process killed) leaves nothing: enqueue
/// never begins or commits anything itself, even in a transaction begun by hand.
pub async fn a_writer_killed_before_commit_leaves_nothing<W: KillableWriter>(w: &W) {
    let store = w.fresh().await;
    let orders = w.business_table(&store).await;
    let (mut writer, session) = w.connect_writer().await;
    // A transaction sqlx does not know about: enqueue must not begin or commit anything itself.
    w.begin_by_hand(&mut writer).await;
    w.insert_order(&mut writer, &orders, 5, 5).await;
    w.enqueue(&store, Through::Conn(&mut writer), &order_created(5))
        .await
        .unwrap();
    w.enqueue_batch(
        &store,
        Through::Conn(&mut writer),
        &[
            order_created(6),
            order_created(7).with_idempotency_key("k7"),
        ],
    )
    .await
    .unwrap();
    assert_eq!(counts(w, &store, &orders).await, (0, 0));
    // The writer's process dies mid-transaction.
    w.kill(&store, session).await;
    assert!(
        !w.commit_by_hand(&mut writer).await,
        "the commit cannot happen any more"
    );
    assert_eq!(counts(w, &store, &orders).await, (0, 0));
    assert_eq!(store.stats().await.unwrap().pending, 0);
}

/// Enqueue through the pool is a statement of its own, committed at once.
pub async fn enqueue_through_the_pool_autocommits_like_any_statement<W: Writer>(w: &W) {
    let store = w.fresh().await;
    let done = w
        .enqueue(&store, Through::Pool, &order_created(6))
        .await
        .unwrap();
    assert!(done.created);
    assert!(
        w.observer(&store)
            .await
            .get(done.id)
            .await
            .unwrap()
            .is_some()
    );
    let batch = w
        .enqueue_batch(&store, Through::Pool, &[order_created(7), order_created(8)])
        .await
        .unwrap();
    assert_eq!(batch.len(), 2);
    assert_eq!(store.stats().await.unwrap().pending, 3);
}

/// The Rust enqueue refuses the reserved names before anything reaches the database: nothing
/// is sent, so the writer's transaction is still usable.
pub async fn the_library_refuses_a_reserved_header_before_the_database_does<W: Writer>(w: &W) {
    let store = w.fresh().await;
    let bad = NewEvent::new("order", "1", "OrderPlaced", &1)
        .unwrap()
        .with_header("outbox-event-id", "forged");
    let mut tx = w.begin(&store).await;
    let err = w
        .enqueue(&store, Through::Conn(&mut *tx), &bad)
        .await
        .unwrap_err();
    assert!(
        matches!(&err, StoreError::Encode(EncodeError::ReservedHeader(name)) if name == "outbox-event-id"),
        "{err}"
    );
    assert!(err.to_string().contains("`outbox-event-id`"), "{err}");
    let good = NewEvent::new("order", "1", "OrderPlaced", &1).unwrap();
    let err = w
        .enqueue_batch(
            &store,
            Through::Conn(&mut *tx),
            &[good.clone(), bad.clone()],
        )
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::Encode(_)), "{err}");
    assert_eq!(outbox_rows(w, &store).await, 0);
    // Nothing was sent: the transaction is still usable.
    let partition = good.with_header("outbox-partition", "1");
    w.enqueue(&store, Through::Conn(&mut *tx), &partition)
        .await
        .unwrap();
    w.commit(tx).await;
    assert_eq!(store.stats().await.unwrap().pending, 1);
    // Through the pool as well: refused before any statement, so nothing autocommits.
    let err = w.enqueue(&store, Through::Pool, &bad).await.unwrap_err();
    assert!(
        matches!(&err, StoreError::Encode(EncodeError::ReservedHeader(name)) if name == "outbox-event-id"),
        "{err}"
    );
    assert_eq!(store.stats().await.unwrap().pending, 1);
}
