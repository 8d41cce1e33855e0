//! [`impl_sql_admin_reads!`](crate::impl_sql_admin_reads): the operator's operations that every
//! SQL store (`outbox-postgresql`, `outbox-mysql`, `outbox-sqlite`) runs the same way: one
//! rendered statement of the store's `Sql`, its parameters, its rows decoded by the builders of
//! [`sql_store`](crate::sql_store).
//!
//! Why a macro: the three stores ran these word for word (the same statement names, the same
//! binds in the same order, the same decoding), differing only in the driver's types and in how
//! an event id is bound, so a fix to one copy missed the others. This crate does no I/O and
//! does not depend on a driver, so the functions are written here once and expanded in each
//! store, where `sqlx` and the store's own types are. Each store keeps its SQL text.

/// Define, in a store's `admin` module, the functions [`impl_store_by_concern!`]
/// (crate::impl_store_by_concern) delegates to for `get`, `list_dead`, `leases`, `pause`,
/// `resume`, `paused`, `replay` and `check`.
///
/// - `store`: the store type; it has `pool` (a sqlx pool), `outbox` (with `schema_version`) and
///   `sql()`, whose fields `get`, `list_dead`, `leases`, `pause`, `resume` and `paused` are
///   the statements.
/// - `bind_id`: how an [`EventId`](crate::EventId) is bound (`EventId::as_uuid`,
///   `EventId::to_string`).
/// - `pauser`: checks a destination to pause and who pauses it (`(destination, by)`), and
///   returns the `by` to store.
///
/// The rest is found by name, the same in every store: the driver's errors go through
/// `crate::error::map_sqlx`; rows are read with `crate::decode::decode_record` (an operator's
/// event) and `crate::decode::Columns` (the [`StoredRow`](crate::sql_store::StoredRow) wrapper
/// of a row); in the calling module, `replay_step(store, filter, routes, after_seq, limit)`
/// replays one page (called for a `limit` above 0: a replay of nothing runs nothing) and
/// `schema_place(store)` says where the schema lives, as
/// [`check_current`](crate::migration::check_current) names it. Optional:
/// - `write_turn`: an async function whose guard a write holds while it runs
///   (SQLite's in-process write queue).
/// - `now`: the current time, for a store whose SQL has no clock of its own: bound
///   to the leases read, and to `pause` between the destination and the `by`.
///
/// The caller depends on `sqlx`.
// `crate::` on purpose: the calling store's own `error` and `decode` modules, found by name.
#[allow(clippy::crate_in_macro_def)]
#[macro_export]
macro_rules! impl_sql_admin_reads {
    (
        store: $store:ty,
        bind_id: $bind_id:path,
        pauser: $pauser:path,
        $(write_turn: $turn:path,)?
        $(now: $now:path,)?
    ) => {
        pub(crate) async fn get(
            store: &$store,
            id: $crate::EventId,
        ) -> Result<Option<$crate::EventRecord>, $crate::StoreError> {
            let row = ::sqlx::query(::sqlx::AssertSqlSafe(store.sql().get.as_str()))
                .bind($bind_id(&id))
                .fetch_optional(&store.pool)
                .await
                .map_err(crate::error::map_sqlx)?;
            row.as_ref().map(crate::decode::decode_record).transpose()
        }

        pub(crate) async fn list_dead(
            store: &$store,
            after_seq: Option<i64>,
            limit: u32,
        ) -> Result<Vec<$crate::EventRecord>, $crate::StoreError> {
            let rows = ::sqlx::query(::sqlx::AssertSqlSafe(store.sql().list_dead.as_str()))
                .bind(after_seq.unwrap_or(0))
                .bind(i64::from(limit))
                .fetch_all(&store.pool)
                .await
                .map_err(crate::error::map_sqlx)?;
            rows.iter().map(crate::decode::decode_record).collect()
        }

        pub(crate) async fn leases(
            store: &$store,
        ) -> Result<Vec<$crate::LeaseHolder>, $crate::StoreError> {
            let rows = ::sqlx::query(::sqlx::AssertSqlSafe(store.sql().leases.as_str()))
                $(.bind($now()))?
                .fetch_all(&store.pool)
                .await
                .map_err(crate::error::map_sqlx)?;
            rows.iter()
                .map(|row| $crate::sql_store::lease_holder(&crate::decode::Columns(row)))
                .collect()
        }

        pub(crate) async fn pause(
            store: &$store,
            destination: &str,
            by: &str,
        ) -> Result<bool, $crate::StoreError> {
            let by = $pauser(destination, by)?;
            $(let _turn = $turn(store).await;)?
            let done = ::sqlx::query(::sqlx::AssertSqlSafe(store.sql().pause.as_str()))
                .bind(destination)
                $(.bind($now()))?
                .bind(by)
                .execute(&store.pool)
                .await
                .map_err(crate::error::map_sqlx)?;
            Ok(done.rows_affected() == 1)
        }

        pub(crate) async fn resume(
            store: &$store,
            destination: &str,
        ) -> Result<bool, $crate::StoreError> {
            $(let _turn = $turn(store).await;)?
            let done = ::sqlx::query(::sqlx::AssertSqlSafe(store.sql().resume.as_str()))
                .bind(destination)
                .execute(&store.pool)
                .await
                .map_err(crate::error::map_sqlx)?;
            Ok(done.rows_affected() > 0)
        }

        pub(crate) async fn paused(
            store: &$store,
        ) -> Result<Vec<$crate::PausedDestination>, $crate::StoreError> {
            let rows = ::sqlx::query(::sqlx::AssertSqlSafe(store.sql().paused.as_str()))
                .fetch_all(&store.pool)
                .await
                .map_err(crate::error::map_sqlx)?;
            rows.iter()
                .map(|row| $crate::sql_store::paused_destination(&crate::decode::Columns(row)))
                .collect()
        }

        pub(crate) async fn replay(
            store: &$store,
            filter: &$crate::ReplayFilter,
            routes: &$crate::route::RouteTable,
            after_seq: Option<i64>,
            limit: u32,
        ) -> Result<$crate::ReplayStep, $crate::StoreError> {
            if limit == 0 {
                return Ok($crate::ReplayStep::default());
            }
            replay_step(store, filter, routes, after_seq, limit).await
        }

        pub(crate) async fn check(store: &$store) -> Result<(), $crate::StoreError> {
            let (current, latest) = store.outbox.schema_version(&store.pool).await?;
            $crate::migration::check_current(
                $crate::migration::Schema::OUTBOX,
                &schema_place(store),
                current,
                latest,
            )
        }
    };
}

/// Define, in a store's `admin` module, the operator's writes whose statements differ per
/// store, with their signatures written once: `requeue_dead` and `discard_dead`, which
/// [`impl_store_by_concern!`](crate::impl_store_by_concern) delegates to, and `replay_step`,
/// one page of a replay (`limit` above 0), which the `replay` of [`impl_sql_admin_reads!`]
/// calls. The caller writes each body over the parameter names it gives.
#[macro_export]
macro_rules! impl_sql_admin_writes {
    (
        store: $store:ty,
        requeue_dead: |$q_store:ident, $q_filter:ident| $requeue:expr,
        discard_dead: |$d_store:ident, $d_filter:ident| $discard:expr,
        replay_step: |$r_store:ident, $filter:ident, $routes:ident, $after_seq:ident, $limit:ident|
            $replay:expr $(,)?
    ) => {
        pub(crate) async fn requeue_dead(
            $q_store: &$store,
            $q_filter: &$crate::DeadFilter,
        ) -> Result<u64, $crate::StoreError> {
            $requeue
        }

        pub(crate) async fn discard_dead(
            $d_store: &$store,
            $d_filter: &$crate::DeadFilter,
        ) -> Result<u64, $crate::StoreError> {
            $discard
        }

        /// One page of a replay, `limit` above 0.
        async fn replay_step(
            $r_store: &$store,
            $filter: &$crate::ReplayFilter,
            $routes: &$crate::route::RouteTable,
            $after_seq: Option<i64>,
            $limit: u32,
        ) -> Result<$crate::ReplayStep, $crate::StoreError> {
            $replay
        }
    };
}
