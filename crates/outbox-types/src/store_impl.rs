//! [`impl_store_by_concern!`](crate::impl_store_by_concern): the [`Store`](crate::Store)
//! implementation of a SQL store whose crate has one module per concern; and
//! [`forward_store!`](crate::forward_store), that of a wrapper around a store. Both list every
//! method of the trait once, in one macro.
//!
//! Why a macro: a trait impl cannot be split across files, so every store (`outbox-postgresql`,
//! `outbox-mysql`, `outbox-sqlite`) keeps its operations in modules named after their concern
//! (`claim`, `settle`, `admin`, `retention`) and its `store.rs` only delegates to them. Those
//! delegations were the same 100 lines in each store; written once here, a method added to the
//! trait is delegated in every store at once, and a store that lacks the function fails to
//! compile, naming the module it belongs in.

/// Implement [`Store`](crate::Store) for `$store` by delegating each operation to the function
/// of the same name in the caller's concern modules: `claim::claim`; `settle::{ack, retry, bury,
/// release}`; `admin::{stats, get, list_dead, requeue_dead, discard_dead, destination_stats,
/// leases, pause, resume, paused, replay, check}`; `retention::{purge_delivered, purge_dead}`.
/// Each takes the store first, then the trait method's arguments. `$kind` is
/// [`Store::kind`](crate::Store::kind). The caller depends on `async-trait`.
#[macro_export]
macro_rules! impl_store_by_concern {
    ($store:ty, $kind:literal) => {
        $crate::__impl_store!($store, (concern $kind));
    };
}

/// Implement [`Store`](crate::Store) for a wrapper type by forwarding every method, `kind`
/// included, to its field `$field`, a store. For test and bench wrappers that add something
/// around a store (a temporary directory it lives in): written out by hand, a method added to
/// the trait later and missed there would silently answer with the trait's default
/// ("unsupported") instead of the wrapped store's. The caller depends on `async-trait`.
///
/// ```ignore
/// /// A store on a file in a temporary directory removed with it (`outbox-sqlite`'s tests).
/// struct TempStore {
///     store: outbox_sqlite::SqliteStore,
///     _dir: tempfile::TempDir,
/// }
/// outbox_types::forward_store!(TempStore => store);
/// ```
#[macro_export]
macro_rules! forward_store {
    ($wrapper:ty => $field:ident) => {
        $crate::__impl_store!($wrapper, (field $field));
    };
}

/// The body of one method of [`__impl_store!`]: `(concern "kind")` calls the concern module's
/// function of the method's name with the store first; `(field name)` calls the same trait
/// method on that field.
#[doc(hidden)]
#[macro_export]
macro_rules! __store_call {
    ((concern $kind:literal), $s:ident, kind) => {
        $kind
    };
    ((field $f:ident), $s:ident, kind) => {
        $crate::Store::kind(&$s.$f)
    };
    ((concern $kind:literal), $s:ident, $module:ident, $method:ident, ($($arg:expr),*)) => {
        $module::$method($s, $($arg),*).await
    };
    ((field $f:ident), $s:ident, $module:ident, $method:ident, ($($arg:expr),*)) => {
        $crate::Store::$method(&$s.$f, $($arg),*).await
    };
}

/// [`impl_store_by_concern!`] and [`forward_store!`]: every method of the trait, each body one
/// [`__store_call!`] by `$via`. The methods are one table, a line each (the concern module,
/// the signature without `&self` and the `Ok` type of its `Result`), so that the signature is
/// all a method adds here.
#[doc(hidden)]
#[macro_export]
macro_rules! __impl_store {
    (
        @methods $store:ty, $via:tt;
        $($module:ident: fn $method:ident($($arg:ident: $type:ty),*) -> $ok:ty;)*
    ) => {
        #[async_trait::async_trait]
        impl $crate::Store for $store {
            fn kind(&self) -> &'static str {
                $crate::__store_call!($via, self, kind)
            }

            $(
                async fn $method(&self, $($arg: $type),*) -> Result<$ok, $crate::StoreError> {
                    $crate::__store_call!($via, self, $module, $method, ($($arg),*))
                }
            )*
        }
    };
    ($store:ty, $via:tt) => {
        $crate::__impl_store! {
            @methods $store, $via;
            claim: fn claim(request: &$crate::ClaimRequest) -> $crate::Claim;
            settle: fn ack(lease: &$crate::Lease, seqs: &[i64]) -> u64;
            settle: fn retry(lease: &$crate::Lease, events: &[$crate::RetryEvent]) -> u64;
            settle: fn bury(lease: &$crate::Lease, events: &[$crate::BuryEvent]) -> u64;
            settle: fn release(lease: &$crate::Lease, seqs: &[i64]) -> u64;
            admin: fn stats() -> $crate::OutboxStats;
            admin: fn get(id: $crate::EventId) -> Option<$crate::EventRecord>;
            admin: fn list_dead(after_seq: Option<i64>, limit: u32) -> Vec<$crate::EventRecord>;
            admin: fn requeue_dead(filter: &$crate::DeadFilter) -> u64;
            admin: fn discard_dead(filter: &$crate::DeadFilter) -> u64;
            retention: fn purge_delivered(older_than: ::std::time::Duration, limit: u32) -> u64;
            admin: fn destination_stats(
                routes: &$crate::route::RouteTable
            ) -> Vec<$crate::DestinationStats>;
            admin: fn leases() -> Vec<$crate::LeaseHolder>;
            admin: fn pause(destination: &str, by: &str) -> bool;
            admin: fn resume(destination: &str) -> bool;
            admin: fn paused() -> Vec<$crate::PausedDestination>;
            admin: fn replay(
                filter: &$crate::ReplayFilter,
                routes: &$crate::route::RouteTable,
                after_seq: Option<i64>,
                limit: u32
            ) -> $crate::ReplayStep;
            retention: fn purge_dead(older_than: ::std::time::Duration, limit: u32) -> u64;
            admin: fn check() -> ();
        }
    };
}

/// The `retention` module of a store whose two purges are one statement each, run the same way:
/// `purge_delivered` (`sql().purge`) and `purge_dead` (`sql().purge_dead`), the functions
/// [`impl_store_by_concern!`](crate::impl_store_by_concern) delegates to, and `purge`, which
/// both call, with `$body` as its body over the parameters named by the caller (the store, the
/// statement, `older_than`, the batch limit). Only the body differs between stores (the bind
/// types, a write turn, how the count comes back), so only the body is written per store.
#[macro_export]
macro_rules! impl_purge_by_statement {
    // Each purge function: `purge` with its statement (a field of `sql()`).
    (@functions $store:ty, $($function:ident: $field:ident),*) => {
        $(
            pub(crate) async fn $function(
                store: &$store,
                older_than: ::std::time::Duration,
                limit: u32,
            ) -> Result<u64, $crate::StoreError> {
                purge(store, &store.sql().$field, older_than, limit).await
            }
        )*
    };
    ($store:ty, |$s:ident, $statement:ident, $older_than:ident, $limit:ident| $body:block) => {
        $crate::impl_purge_by_statement!(@functions $store, purge_delivered: purge, purge_dead: purge_dead);

        /// Run one of the purge statements: `older_than` and `limit` are its parameters.
        async fn purge(
            $s: &$store,
            $statement: &str,
            $older_than: ::std::time::Duration,
            $limit: u32,
        ) -> Result<u64, $crate::StoreError> $body
    };
}

/// The `settle` module of a store: `ack`, `retry`, `bury` and `release`, the functions
/// [`impl_store_by_concern!`](crate::impl_store_by_concern) delegates to, each with its
/// signature and the rule every store keeps (nothing to settle: no statement, `Ok(0)`) written
/// once; the caller writes each body over the parameter names it gives (the store, the lease,
/// the seqs or events), as an expression of the rows settled.
#[macro_export]
macro_rules! impl_settle_by_statement {
    (
        store: $store:ty,
        ack: |$a_store:ident, $a_lease:ident, $a_seqs:ident| $ack:expr,
        retry: |$r_store:ident, $r_lease:ident, $r_events:ident| $retry:expr,
        bury: |$b_store:ident, $b_lease:ident, $b_events:ident| $bury:expr,
        release: |$l_store:ident, $l_lease:ident, $l_seqs:ident| $release:expr $(,)?
    ) => {
        $crate::impl_settle_by_statement!(@op ack, $store, i64, $a_store, $a_lease, $a_seqs, $ack);
        $crate::impl_settle_by_statement!(
            @op retry, $store, $crate::RetryEvent, $r_store, $r_lease, $r_events, $retry
        );
        $crate::impl_settle_by_statement!(
            @op bury, $store, $crate::BuryEvent, $b_store, $b_lease, $b_events, $bury
        );
        $crate::impl_settle_by_statement!(
            @op release, $store, i64, $l_store, $l_lease, $l_seqs, $release
        );
    };
    (@op $name:ident, $store:ty, $item:ty, $s:ident, $lease:ident, $items:ident, $body:expr) => {
        pub(crate) async fn $name(
            $s: &$store,
            $lease: &$crate::Lease,
            $items: &[$item],
        ) -> Result<u64, $crate::StoreError> {
            if $items.is_empty() {
                return Ok(0);
            }
            $body
        }
    };
}
