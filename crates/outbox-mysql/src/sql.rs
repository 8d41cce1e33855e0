//! Every statement the store runs, rendered once per outbox (they embed the table name).
//!
//! Conventions:
//!
//! - "now" is always `UTC_TIMESTAMP(6)`, the database's clock, evaluated once per statement;
//!   durations travel as microseconds and are added with `INTERVAL ? MICROSECOND`.
//! - A batch (seqs to ack, retries with their own delay and error, ids to requeue…) travels as
//!   one JSON array bound to one parameter and unpacked with `JSON_TABLE` (MySQL 8.0.4+, MariaDB
//!   10.6+). One prepared statement serves every batch size: no `IN (?, ?, …)` list whose text
//!   changes with the size (each size would be another server-side prepared statement and another
//!   entry in sqlx's per-connection statement cache) and no 65 535-placeholder ceiling.
//! - `JSON_TABLE(…) STRAIGHT_JOIN table FORCE INDEX (…)`: the JSON rows drive the join and each
//!   looks its row up by primary or unique key. Left to itself the optimizer scans the table when
//!   it is small (its `JSON_TABLE` estimate is a fixed guess), and a locking read or an `UPDATE`
//!   that scans locks every row it reads: an ack would then wait for a writer holding an
//!   unrelated row, and two relays' acks for each other.
//! - `JSON_TABLE` string columns get the default collation of their character set; compared with
//!   the table's binary (`_bin`) collated key columns, the `_bin` collation wins (MySQL's rule for
//!   mixing `_bin` with `_ci` collations of one character set), so lookups stay exact and use the
//!   index. The id columns are declared `ascii_bin` on both sides.

use std::time::Duration;

use chrono::{DateTime, Datelike, Utc};
use outbox_types::ReplayFilter;
use outbox_types::route::{RouteTable, SqlDialect};
use sqlx::mysql::MySqlArguments;
use sqlx::query::Query;
use sqlx::{AssertSqlSafe, MySql};

/// Everything `get` and `list_dead` report.
const RECORD_COLUMNS: &str = "e.seq, e.id, e.aggregate_type, e.aggregate_id, e.event_type, e.payload, \
     e.destination, e.headers, e.idempotency_key, e.occurred_at, e.enqueued_at, e.attempts, \
     e.status, e.next_attempt_at, e.last_error, e.lease_owner, e.lease_expires_at, e.delivered_at, e.dead_at";

/// Every column of the row `e` a claim reads but the payload, added up in bytes (see
/// `outbox_types::RowBytes`): what `relay.max_metadata_bytes` bounds. A NULL counts as 0.
const METADATA_BYTES: &str = "(LENGTH(e.id) + LENGTH(e.aggregate_type) + LENGTH(e.aggregate_id) \
     + LENGTH(e.event_type) + COALESCE(LENGTH(e.destination), 0) + LENGTH(e.headers) \
     + COALESCE(LENGTH(e.idempotency_key), 0))";

/// The aggregate key of the row `e`, in bytes.
const KEY_BYTES: &str = "(LENGTH(e.aggregate_type) + LENGTH(e.aggregate_id))";

/// Whether the row `e` is within both limits of the one-row table `lim`, so its columns are
/// sent.
const FITS: &str = "(LENGTH(e.payload) <= lim.payload AND (LENGTH(e.id) + LENGTH(e.aggregate_type) \
     + LENGTH(e.aggregate_id) + LENGTH(e.event_type) + COALESCE(LENGTH(e.destination), 0) \
     + LENGTH(e.headers) + COALESCE(LENGTH(e.idempotency_key), 0)) <= lim.metadata)";

/// A claim candidate of either branch: its seq, its aggregate key (for the server's own use:
/// the outer select sends it only when small enough), and its sizes in bytes.
const CANDIDATE_COLUMNS: &str = "e.seq, e.aggregate_type, e.aggregate_id, \
     LENGTH(e.payload) AS payload_bytes, \
     (LENGTH(e.id) + LENGTH(e.aggregate_type) + LENGTH(e.aggregate_id) + LENGTH(e.event_type) \
      + COALESCE(LENGTH(e.destination), 0) + LENGTH(e.headers) \
      + COALESCE(LENGTH(e.idempotency_key), 0)) AS metadata_bytes, \
     (LENGTH(e.aggregate_type) + LENGTH(e.aggregate_id)) AS key_bytes";

/// What the candidates read sends: seq, sizes, and the aggregate key when the key alone is
/// within `lim.metadata` (NULL otherwise: see `outbox_types::ClaimSort`).
const CANDIDATES_SELECT: &str = "d.seq, d.payload_bytes, d.metadata_bytes, \
     CASE WHEN d.key_bytes <= lim.metadata THEN d.aggregate_type END AS aggregate_type, \
     CASE WHEN d.key_bytes <= lim.metadata THEN d.aggregate_id END AS aggregate_id";

/// Statements rendered once per outbox.
#[derive(Debug)]
pub(crate) struct Sql {
    pub enqueue_batch: String,
    pub claim_lock: String,
    pub claim_unlock: String,
    pub migrate_lock: String,
    pub migrate_unlock: String,
    pub claim_candidates: String,
    pub claim_lock_rows: String,
    pub claim_update: String,
    pub ack: String,
    pub retry: String,
    pub bury: String,
    pub release: String,
    pub get: String,
    pub list_dead: String,
    pub requeue_dead_ids: String,
    pub requeue_dead_all: String,
    pub discard_dead_ids: String,
    pub discard_dead_all: String,
    pub purge: String,
    pub stats: String,
    pub leases: String,
    pub pause: String,
    pub resume: String,
    pub paused: String,
    pub replay_update: String,
    pub purge_dead: String,
    /// The table, for the statements built per call around a route table.
    t: String,
}

/// The name of a `GET_LOCK()` lock for `purpose` on this outbox. Named locks are server-wide, so
/// the name includes the current database; it is hashed to stay within MySQL's 64-character limit
/// for lock names whatever the database and table names.
fn lock_name(purpose: &str, table: &str) -> String {
    format!("CONCAT('outbox:{purpose}:', MD5(CONCAT(DATABASE(), '.', '{table}')))")
}

impl Sql {
    /// `t` is the backquoted table name, `table` the bare one (a checked identifier).
    pub(crate) fn render(t: &str, table: &str) -> Self {
        let claim_lock = lock_name("claim", table);
        let migrate_lock = lock_name("migrate", table);
        // What holds back a later event `e` of its aggregate: an earlier event in flight under a
        // live lease, waiting for a retry, or dead (when dead events block: the `?` is that
        // flag). One probe per status, each an equality lookup on the `blockers` index prefix
        // (aggregate_type, aggregate_id, status) with `seq < e.seq` checked in the index: the
        // aggregate's delivered rows (the bulk of a table kept for retention) are never read.
        // Forced: with few in-flight or dead rows in its statistics, the optimizer would rather
        // scan every row of that status through `(status, seq)`, which is fine until there are
        // hundreds of them.
        let probe = |status: &str, extra: &str| {
            format!(
                "EXISTS (SELECT 1 FROM {t} AS b FORCE INDEX (blockers)
                         WHERE b.aggregate_type = e.aggregate_type AND b.aggregate_id = e.aggregate_id
                           AND b.status = '{status}' AND b.seq < e.seq{extra})"
            )
        };
        let unblocked = format!(
            "NOT {in_flight}
             AND NOT {retrying}
             AND NOT (? AND {dead})",
            in_flight = probe("in_flight", " AND b.lease_expires_at > UTC_TIMESTAMP(6)"),
            retrying = probe(
                "pending",
                " AND (b.attempts > 0 OR b.last_error IS NOT NULL) AND b.next_attempt_at > UTC_TIMESTAMP(6)"
            ),
            dead = probe("dead", ""),
        );
        Sql {
            // One JSON array of events (see `batch_row`), written in array order by the
            // procedure of migration 6, which runs as its definer: writers need EXECUTE on it,
            // nothing on the table. One row per event comes back (see `MySqlOutbox::enqueue_batch`).
            enqueue_batch: format!("CALL `{table}_enqueue_batch`(?)"),
            claim_lock: format!("SELECT GET_LOCK({claim_lock}, ?)"),
            claim_unlock: format!("DO RELEASE_LOCK({claim_lock})"),
            migrate_lock: format!("SELECT GET_LOCK({migrate_lock}, ?)"),
            migrate_unlock: format!("DO RELEASE_LOCK({migrate_lock})"),
            // Phase 1 of a claim (a plain read): the first `limit` due, unblocked events in seq
            // order. A row is due when pending and its time has come, or in flight under an
            // expired lease (its relay died). One branch per status, so each is an ordered scan
            // of the `(status, seq)` index that stops after `limit` rows, instead of a sort of
            // every open row. Each comes with its sizes (see `CANDIDATE_COLUMNS`) and its
            // aggregate key only when the key alone is within the metadata limit. ? = most
            // bytes of one event's other columns, dead blocks, limit, dead blocks, limit, limit.
            claim_candidates: format!(
                "SELECT {CANDIDATES_SELECT} FROM (SELECT CAST(? AS SIGNED) AS metadata) AS lim, (
                     (SELECT {CANDIDATE_COLUMNS} FROM {t} AS e
                      WHERE e.status = 'pending' AND e.next_attempt_at <= UTC_TIMESTAMP(6)
                        AND {unblocked}
                      ORDER BY e.seq LIMIT ?)
                     UNION ALL
                     (SELECT {CANDIDATE_COLUMNS} FROM {t} AS e
                      WHERE e.status = 'in_flight' AND e.lease_expires_at <= UTC_TIMESTAMP(6)
                        AND {unblocked}
                      ORDER BY e.seq LIMIT ?)
                 ) AS d
                 ORDER BY d.seq LIMIT ?"
            ),
            // Phase 2: lock the candidates that are still due, skipping rows someone else holds.
            // A locking read sees the latest committed version of each row, whatever the
            // transaction's snapshot. The sizes are measured again on that version; a row over
            // either limit comes back as its sizes and NULLs (its key only when the key alone is
            // within the metadata limit), and is buried by the store unread. ? = most payload
            // bytes of one event, most bytes of its other columns, JSON array of seqs.
            claim_lock_rows: format!(
                "SELECT e.seq, LENGTH(e.payload) AS payload_bytes, {METADATA_BYTES} AS metadata_bytes,
                        CASE WHEN {KEY_BYTES} <= lim.metadata THEN e.aggregate_type END AS aggregate_type,
                        CASE WHEN {KEY_BYTES} <= lim.metadata THEN e.aggregate_id END AS aggregate_id,
                        CASE WHEN {FITS} THEN e.id END AS id,
                        CASE WHEN {FITS} THEN e.event_type END AS event_type,
                        CASE WHEN {FITS} THEN e.payload END AS payload,
                        CASE WHEN {FITS} THEN e.destination END AS destination,
                        CASE WHEN {FITS} THEN e.headers END AS headers,
                        CASE WHEN {FITS} THEN e.idempotency_key END AS idempotency_key,
                        e.occurred_at, e.enqueued_at, e.attempts
                 FROM (SELECT CAST(? AS SIGNED) AS payload, CAST(? AS SIGNED) AS metadata) AS lim
                 STRAIGHT_JOIN JSON_TABLE(?, '$[*]' COLUMNS (seq BIGINT PATH '$')) AS c
                 STRAIGHT_JOIN {t} AS e FORCE INDEX (PRIMARY) ON e.seq = c.seq
                 WHERE (e.status = 'pending' AND e.next_attempt_at <= UTC_TIMESTAMP(6))
                    OR (e.status = 'in_flight' AND e.lease_expires_at <= UTC_TIMESTAMP(6))
                 ORDER BY e.seq
                 FOR UPDATE SKIP LOCKED"
            ),
            // Phase 3, on rows this transaction holds. ? = JSON seqs, owner, token, lease µs.
            claim_update: format!(
                "UPDATE JSON_TABLE(?, '$[*]' COLUMNS (seq BIGINT PATH '$')) AS c
                 STRAIGHT_JOIN {t} AS e FORCE INDEX (PRIMARY) ON e.seq = c.seq
                 SET e.status = 'in_flight', e.lease_owner = ?, e.lease_token = ?,
                     e.lease_expires_at = UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND,
                     e.claimed_at = UTC_TIMESTAMP(6)"
            ),
            // ? = JSON seqs, token.
            ack: format!(
                "UPDATE JSON_TABLE(?, '$[*]' COLUMNS (seq BIGINT PATH '$')) AS a
                 STRAIGHT_JOIN {t} AS e FORCE INDEX (PRIMARY) ON e.seq = a.seq
                 SET e.status = 'delivered', e.delivered_at = UTC_TIMESTAMP(6),
                     e.lease_owner = NULL, e.lease_token = NULL, e.lease_expires_at = NULL
                 WHERE e.lease_token = ? AND e.status = 'in_flight'"
            ),
            // ? = JSON [{seq, delay_us, error, cost}], token.
            retry: format!(
                "UPDATE JSON_TABLE(?, '$[*]' COLUMNS (
                         seq      BIGINT PATH '$.seq',
                         delay_us BIGINT PATH '$.delay_us',
                         error    TEXT CHARACTER SET utf8mb4 PATH '$.error',
                         cost     INT PATH '$.cost')) AS r
                 STRAIGHT_JOIN {t} AS e FORCE INDEX (PRIMARY) ON e.seq = r.seq
                 SET e.status = 'pending', e.attempts = e.attempts + r.cost,
                     e.next_attempt_at = UTC_TIMESTAMP(6) + INTERVAL r.delay_us MICROSECOND,
                     e.last_error = r.error,
                     e.lease_owner = NULL, e.lease_token = NULL, e.lease_expires_at = NULL
                 WHERE e.lease_token = ? AND e.status = 'in_flight'"
            ),
            // ? = JSON [{seq, error}], token.
            bury: format!(
                "UPDATE JSON_TABLE(?, '$[*]' COLUMNS (
                         seq   BIGINT PATH '$.seq',
                         error TEXT CHARACTER SET utf8mb4 PATH '$.error')) AS r
                 STRAIGHT_JOIN {t} AS e FORCE INDEX (PRIMARY) ON e.seq = r.seq
                 SET e.status = 'dead', e.attempts = e.attempts + 1, e.dead_at = UTC_TIMESTAMP(6),
                     e.last_error = r.error,
                     e.lease_owner = NULL, e.lease_token = NULL, e.lease_expires_at = NULL
                 WHERE e.lease_token = ? AND e.status = 'in_flight'"
            ),
            // ? = JSON seqs, token.
            release: format!(
                "UPDATE JSON_TABLE(?, '$[*]' COLUMNS (seq BIGINT PATH '$')) AS a
                 STRAIGHT_JOIN {t} AS e FORCE INDEX (PRIMARY) ON e.seq = a.seq
                 SET e.status = 'pending',
                     e.lease_owner = NULL, e.lease_token = NULL, e.lease_expires_at = NULL
                 WHERE e.lease_token = ? AND e.status = 'in_flight'"
            ),
            get: format!("SELECT {RECORD_COLUMNS} FROM {t} AS e WHERE e.id = ?"),
            list_dead: format!(
                "SELECT {RECORD_COLUMNS} FROM {t} AS e
                 WHERE e.status = 'dead' AND e.seq > ? ORDER BY e.seq LIMIT ?"
            ),
            requeue_dead_ids: format!(
                "UPDATE JSON_TABLE(?, '$[*]' COLUMNS (id CHAR(36) CHARACTER SET ascii COLLATE ascii_bin PATH '$')) AS d
                 STRAIGHT_JOIN {t} AS e FORCE INDEX (id_key) ON e.id = d.id
                 SET e.status = 'pending', e.attempts = 0, e.next_attempt_at = LEAST(e.next_attempt_at, UTC_TIMESTAMP(6)), e.dead_at = NULL, e.last_error = NULL
                 WHERE e.status = 'dead'"
            ),
            requeue_dead_all: format!(
                "UPDATE {t} SET status = 'pending', attempts = 0, next_attempt_at = LEAST(next_attempt_at, UTC_TIMESTAMP(6)), dead_at = NULL, last_error = NULL
                 WHERE status = 'dead'"
            ),
            discard_dead_ids: format!(
                "DELETE e FROM JSON_TABLE(?, '$[*]' COLUMNS (id CHAR(36) CHARACTER SET ascii COLLATE ascii_bin PATH '$')) AS d
                 STRAIGHT_JOIN {t} AS e FORCE INDEX (id_key) ON e.id = d.id
                 WHERE e.status = 'dead'"
            ),
            discard_dead_all: format!("DELETE FROM {t} WHERE status = 'dead'"),
            // ? = age µs, limit. Single-table DELETE takes ORDER BY and LIMIT directly.
            purge: format!(
                "DELETE FROM {t}
                 WHERE status = 'delivered' AND delivered_at < UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND
                 ORDER BY seq LIMIT ?"
            ),
            // ? = age µs, limit. A range of `open_seq` (status, seq).
            purge_dead: format!(
                "DELETE FROM {t}
                 WHERE status = 'dead' AND dead_at < UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND
                 ORDER BY seq LIMIT ?"
            ),
            // The in-flight range of `open_seq`, on the database's clock.
            leases: format!(
                "SELECT COALESCE(e.lease_owner, '') AS owner, COUNT(*) AS events,
                        MIN(e.claimed_at) AS claimed_since, MAX(e.lease_expires_at) AS expires_at,
                        COUNT(CASE WHEN e.lease_expires_at <= UTC_TIMESTAMP(6) THEN 1 END) AS expired
                 FROM {t} AS e FORCE INDEX (open_seq)
                 WHERE e.status = 'in_flight'
                 GROUP BY e.lease_owner ORDER BY e.lease_owner"
            ),
            // ? = destination, by. IGNORE only ever ignores the duplicate key here: both values
            // are checked for length before they are sent.
            pause: format!(
                "INSERT IGNORE INTO `{table}_paused` (destination, paused_at, paused_by)
                 VALUES (?, UTC_TIMESTAMP(6), ?)"
            ),
            resume: format!("DELETE FROM `{table}_paused` WHERE destination = ?"),
            paused: format!(
                "SELECT destination, paused_at, paused_by FROM `{table}_paused` ORDER BY destination"
            ),
            // The second half of a replay step: the page's rows (JSON seqs) that are still
            // delivered go back to pending, by primary key.
            replay_update: format!(
                "UPDATE JSON_TABLE(?, '$[*]' COLUMNS (seq BIGINT PATH '$')) AS c
                 STRAIGHT_JOIN {t} AS e FORCE INDEX (PRIMARY) ON e.seq = c.seq
                 SET e.status = 'pending', e.attempts = 0, e.next_attempt_at = LEAST(e.next_attempt_at, UTC_TIMESTAMP(6)),
                     e.delivered_at = NULL, e.dead_at = NULL, e.last_error = NULL,
                     e.lease_owner = NULL, e.lease_token = NULL, e.lease_expires_at = NULL
                 WHERE e.status = 'delivered'"
            ),
            t: t.to_owned(),
            // One statement, so one consistent snapshot. Each count is a range of the
            // `(status, seq)` index; the oldest undelivered event is the smaller of the first
            // pending and the first in-flight seq, two index dives.
            stats: format!(
                "SELECT
                     (SELECT COUNT(*) FROM {t} WHERE status = 'pending') AS pending,
                     (SELECT COUNT(*) FROM {t} WHERE status = 'pending' AND (attempts > 0 OR last_error IS NOT NULL)) AS retrying,
                     (SELECT COUNT(*) FROM {t} WHERE status = 'in_flight') AS in_flight,
                     (SELECT COUNT(*) FROM {t} WHERE status = 'delivered') AS delivered,
                     (SELECT COUNT(*) FROM {t} WHERE status = 'dead') AS dead,
                     (SELECT o.enqueued_at FROM {t} AS o
                      WHERE o.seq = LEAST(
                          COALESCE((SELECT MIN(p.seq) FROM {t} AS p WHERE p.status = 'pending'), 9223372036854775807),
                          COALESCE((SELECT MIN(f.seq) FROM {t} AS f WHERE f.status = 'in_flight'), 9223372036854775807))
                     ) AS oldest,
                     UTC_TIMESTAMP(6) AS observed_at"
            ),
        }
    }
}

/// A value for a statement built per call.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Arg {
    Text(String),
    Int(i64),
    Bool(bool),
}

/// A statement built per call around a route table, with its values in placeholder order
/// (MySQL's `?` are positional, so text and values are appended together).
#[derive(Debug, Default)]
pub(crate) struct Built {
    pub sql: String,
    pub binds: Vec<Arg>,
}

impl Built {
    fn push(&mut self, sql: &str) {
        self.sql.push_str(sql);
    }

    fn bind(&mut self, placeholder_sql: &str, arg: Arg) {
        self.sql.push_str(placeholder_sql);
        self.binds.push(arg);
    }

    /// The route table's destination of the row `alias`, as bytes (`''` when unroutable): what
    /// is compared with paused or requested names and grouped on, byte for byte like every
    /// routed field, whatever the collations involved.
    fn route(&mut self, routes: &RouteTable, alias: &str) {
        let case = routes.sql_case(SqlDialect::MySql, Some(alias));
        self.sql
            .push_str(&format!("CAST(COALESCE({}, '') AS BINARY)", case.sql));
        self.binds.extend(case.binds.into_iter().map(Arg::Text));
    }

    /// ` AND <route of alias> NOT IN (names…)`; nothing when `names` is empty.
    fn not_held(&mut self, routes: &RouteTable, alias: &str, names: &[String]) {
        if names.is_empty() {
            return;
        }
        self.push(" AND ");
        self.route(routes, alias);
        self.push(" NOT IN (");
        self.names(names);
    }

    /// `?, ?, …)` bound to `names`.
    fn names(&mut self, names: &[String]) {
        for (i, name) in names.iter().enumerate() {
            self.bind(if i == 0 { "?" } else { ", ?" }, Arg::Text(name.clone()));
        }
        self.push(")");
    }

    /// The statement, ready to run.
    pub(crate) fn query(&self) -> Query<'_, MySql, MySqlArguments> {
        let mut query = sqlx::query(AssertSqlSafe(self.sql.as_str()));
        for arg in &self.binds {
            query = match arg {
                Arg::Text(v) => query.bind(v.as_str()),
                Arg::Int(v) => query.bind(*v),
                Arg::Bool(v) => query.bind(*v),
            };
        }
        query
    }
}

impl Sql {
    /// Phase 1 of a claim with destinations on hold: `claim_candidates` where rows that `routes`
    /// sends to a `paused` destination are neither candidates nor blockers (a paused
    /// destination's events hold back nobody), and rows of a `deferred` one (skipped for this
    /// claim only) are no candidates but still hold back their aggregate's later events, even
    /// when merely due.
    pub(crate) fn held_claim_candidates(
        &self,
        routes: &RouteTable,
        paused: &[String],
        deferred: &[String],
        block: bool,
        limit: i64,
        max_metadata_bytes: i64,
    ) -> Built {
        let skipped: Vec<String> = paused
            .iter()
            .chain(deferred.iter().filter(|d| !paused.contains(d)))
            .cloned()
            .collect();
        let t = self.t.as_str();
        let mut b = Built::default();
        let probe = |b: &mut Built, status: &str, extra: &str| {
            b.push(&format!(
                "EXISTS (SELECT 1 FROM {t} AS b FORCE INDEX (blockers)
                         WHERE b.aggregate_type = e.aggregate_type AND b.aggregate_id = e.aggregate_id
                           AND b.status = '{status}' AND b.seq < e.seq{extra}"
            ));
            b.not_held(routes, "b", paused);
            b.push(")");
        };
        let branch = |b: &mut Built, due: &str| {
            b.push(&format!(
                "(SELECT {CANDIDATE_COLUMNS} FROM {t} AS e WHERE {due}"
            ));
            b.not_held(routes, "e", &skipped);
            if !deferred.is_empty() {
                // An earlier open row of a deferred destination, through the `blockers` index.
                b.push(&format!(
                    " AND NOT EXISTS (SELECT 1 FROM {t} AS d FORCE INDEX (blockers)
                         WHERE d.aggregate_type = e.aggregate_type AND d.aggregate_id = e.aggregate_id
                           AND d.status IN ('pending', 'in_flight') AND d.seq < e.seq AND "
                ));
                b.route(routes, "d");
                b.push(" IN (");
                b.names(deferred);
                b.push(")");
            }
            b.push(" AND NOT ");
            probe(b, "in_flight", " AND b.lease_expires_at > UTC_TIMESTAMP(6)");
            b.push(" AND NOT ");
            probe(
                b,
                "pending",
                " AND (b.attempts > 0 OR b.last_error IS NOT NULL) AND b.next_attempt_at > UTC_TIMESTAMP(6)",
            );
            b.bind(" AND NOT (? AND ", Arg::Bool(block));
            probe(b, "dead", "");
            b.bind(") ORDER BY e.seq LIMIT ?)", Arg::Int(limit));
        };
        b.bind(
            &format!(
                "SELECT {CANDIDATES_SELECT} FROM (SELECT CAST(? AS SIGNED) AS metadata) AS lim, ("
            ),
            Arg::Int(max_metadata_bytes),
        );
        branch(
            &mut b,
            "e.status = 'pending' AND e.next_attempt_at <= UTC_TIMESTAMP(6)",
        );
        b.push(" UNION ALL ");
        branch(
            &mut b,
            "e.status = 'in_flight' AND e.lease_expires_at <= UTC_TIMESTAMP(6)",
        );
        b.bind(") AS d ORDER BY d.seq LIMIT ?", Arg::Int(limit));
        b
    }

    /// Backlog per destination: undelivered and dead rows only (three ranges of `open_seq`),
    /// grouped on the route table's destination. Delivered rows are never read.
    pub(crate) fn destination_stats(&self, routes: &RouteTable) -> Built {
        let t = self.t.as_str();
        let mut b = Built::default();
        b.push(
            "SELECT x.route,
                COUNT(CASE WHEN x.status = 'pending' THEN 1 END) AS pending,
                COUNT(CASE WHEN x.status = 'pending' AND (x.attempts > 0 OR x.last_error IS NOT NULL) THEN 1 END) AS retrying,
                COUNT(CASE WHEN x.status = 'in_flight' THEN 1 END) AS in_flight,
                COUNT(CASE WHEN x.status = 'dead' THEN 1 END) AS dead,
                MIN(CASE WHEN x.status IN ('pending', 'in_flight') THEN x.enqueued_at END) AS oldest,
                -- The newest waiting row's error: the greatest zero-padded seq, cut off again.
                SUBSTRING(MAX(CASE WHEN x.status IN ('pending', 'in_flight') AND x.last_error IS NOT NULL
                                   THEN CONCAT(LPAD(x.seq, 20, '0'), x.last_error) END), 21) AS last_error
         FROM (SELECT ",
        );
        b.route(routes, "e");
        b.push(&format!(
            " AS route, e.seq, e.status, e.attempts, e.enqueued_at, e.last_error
              FROM {t} AS e FORCE INDEX (open_seq)
              WHERE e.status IN ('pending', 'in_flight', 'dead')) AS x
         GROUP BY x.route"
        ));
        b
    }

    /// The first half of a replay step: the next page of matching delivered rows after a seq,
    /// a range of `open_seq` (status, seq) in order. A plain read: the update that follows
    /// re-checks each row by primary key, so no range of delivered rows is ever locked (a gap
    /// lock there would hold up the acks that add rows to it).
    pub(crate) fn replay_page(
        &self,
        filter: &ReplayFilter,
        routes: &RouteTable,
        after_seq: i64,
        limit: i64,
    ) -> Built {
        let t = self.t.as_str();
        let mut b = Built::default();
        b.push(&format!(
            "SELECT e.seq FROM {t} AS e FORCE INDEX (open_seq)
             WHERE e.status = 'delivered'"
        ));
        b.bind(" AND e.seq > ?", Arg::Int(after_seq));
        b.bind(
            " AND e.enqueued_at >= ?",
            Arg::Text(datetime_text(filter.from)),
        );
        b.bind(
            " AND e.enqueued_at < ?",
            Arg::Text(datetime_text(filter.to)),
        );
        if let Some(event_type) = &filter.event_type {
            b.bind(" AND e.event_type = ?", Arg::Text(event_type.clone()));
        }
        if let Some(destination) = &filter.destination {
            b.push(" AND ");
            b.route(routes, "e");
            b.bind(" = CAST(? AS BINARY)", Arg::Text(destination.clone()));
        }
        b.bind(" ORDER BY e.seq LIMIT ?", Arg::Int(limit));
        b
    }
}

/// A UTC time as text for a comparison with a `DATETIME(6)` column (the server converts the
/// constant to a datetime), clamped to DATETIME's years 1000–9999 so "from the beginning" or
/// "until the end" bounds stay valid.
fn datetime_text(at: DateTime<Utc>) -> String {
    let year = at.year();
    if year < 1000 {
        "1000-01-01 00:00:00.000000".to_owned()
    } else if year > 9999 {
        "9999-12-31 23:59:59.999999".to_owned()
    } else {
        at.format("%Y-%m-%d %H:%M:%S%.6f").to_string()
    }
}

/// The longest lease, retry delay or purge age the store passes to the database (100 years);
/// longer durations are cut to it.
pub const MAX_INTERVAL: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// A batch as JSON text for `JSON_TABLE`.
pub(crate) use outbox_types::sql_store::json_text;

/// A duration as whole microseconds, capped at [`MAX_INTERVAL`].
pub(crate) fn micros(d: Duration) -> i64 {
    outbox_types::sql_store::micros(d.min(MAX_INTERVAL))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MySqlOutbox;
    use crate::session::tests::{test_pool, unique_table};
    use sqlx::{MySqlPool, Row};
    use uuid::Uuid;

    #[test]
    fn replay_bounds_are_valid_datetimes() {
        let at = DateTime::from_timestamp_micros(1_700_000_000_123_456).unwrap();
        assert_eq!(datetime_text(at), "2023-11-14 22:13:20.123456");
        assert_eq!(
            datetime_text(DateTime::<Utc>::MIN_UTC),
            "1000-01-01 00:00:00.000000"
        );
        assert_eq!(
            datetime_text(DateTime::<Utc>::MAX_UTC),
            "9999-12-31 23:59:59.999999"
        );
    }

    #[test]
    fn durations_are_capped() {
        assert_eq!(micros(Duration::from_millis(1500)), 1_500_000);
        assert_eq!(micros(Duration::MAX), micros(MAX_INTERVAL));
    }

    /// The tabular `EXPLAIN` of `sql` with `binds`, as `(table, key)` pairs.
    async fn plan(
        pool: &MySqlPool,
        sql: &str,
        binds: &[serde_json::Value],
    ) -> Vec<(String, String)> {
        let explain = format!("EXPLAIN {sql}");
        let mut query = sqlx::query(AssertSqlSafe(explain.as_str()));
        for b in binds {
            query = match b {
                serde_json::Value::Bool(v) => query.bind(*v),
                serde_json::Value::Number(n) => query.bind(n.as_i64().unwrap()),
                other => query.bind(other.as_str().unwrap().to_owned()),
            };
        }
        query
            .fetch_all(pool)
            .await
            .unwrap()
            .iter()
            .map(|r| {
                let table: Option<String> = r.try_get("table").unwrap();
                let key: Option<String> = r.try_get("key").unwrap();
                (table.unwrap_or_default(), key.unwrap_or_default())
            })
            .collect()
    }

    #[tokio::test]
    async fn statements_use_the_intended_indexes_on_a_small_and_a_retention_heavy_table() {
        let pool = test_pool(2).await;
        let outbox = MySqlOutbox::with_table(&unique_table("plan")).unwrap();
        outbox.migrate(&pool).await.unwrap();
        let t = outbox.quoted_table();
        let sql = outbox.sql();
        let seqs = serde_json::json!("[1, 2, 3]");
        let ids = serde_json::json!(format!("[\"{}\"]", Uuid::nil()));
        let token = serde_json::json!(Uuid::nil().to_string());
        for round in 0..2 {
            if round == 1 {
                // Mostly delivered rows, as in a table kept for retention, and a small backlog:
                // seqs 1..=21000 from a portable digits cross join (MySQL has no seq_1_to_n).
                let digits = "(SELECT 0 AS n UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3 \
                     UNION ALL SELECT 4 UNION ALL SELECT 5 UNION ALL SELECT 6 UNION ALL SELECT 7 \
                     UNION ALL SELECT 8 UNION ALL SELECT 9)";
                sqlx::query(AssertSqlSafe(format!(
                    "INSERT INTO {t} (id, aggregate_type, aggregate_id, event_type, payload, headers,
                                      occurred_at, enqueued_at, next_attempt_at, status, delivered_at)
                     SELECT UUID(), 'agg', CONCAT('a', s.n % 300), 'E', '{{}}', '{{}}', UTC_TIMESTAMP(6),
                            UTC_TIMESTAMP(6), UTC_TIMESTAMP(6),
                            IF(s.n < 20000, 'delivered', 'pending'), UTC_TIMESTAMP(6)
                     FROM (SELECT d1.n + 10 * d2.n + 100 * d3.n + 1000 * d4.n + 10000 * d5.n AS n
                           FROM {digits} d1, {digits} d2, {digits} d3, {digits} d4, {digits} d5) AS s
                     WHERE s.n < 21000"
                )))
                .execute(&pool)
                .await
                .unwrap();
                sqlx::query(AssertSqlSafe(format!("ANALYZE TABLE {t}")))
                    .execute(&pool)
                    .await
                    .unwrap();
            }
            // The claim's candidates read `open_seq` and probe earlier rows through `blockers`:
            // the plain statement, and the statements built around a route table (a held
            // destination; a deferred one, whose earlier open rows are probed through
            // `blockers` too).
            let routes = outbox_testkit::hooks_and_kafka();
            let built = |b: crate::sql::Built| -> (String, Vec<serde_json::Value>) {
                let binds = b
                    .binds
                    .iter()
                    .map(|a| match a {
                        crate::sql::Arg::Text(v) => serde_json::json!(v),
                        crate::sql::Arg::Int(v) => serde_json::json!(v),
                        crate::sql::Arg::Bool(v) => serde_json::json!(v),
                    })
                    .collect();
                (b.sql, binds)
            };
            let plain = (
                sql.claim_candidates.clone(),
                vec![
                    i64::MAX.into(),
                    true.into(),
                    200.into(),
                    true.into(),
                    200.into(),
                    200.into(),
                ],
            );
            for (name, (statement, binds), probe_tables, probe_count) in [
                ("claim candidates", plain, &["b"][..], 6),
                (
                    "held claim candidates",
                    built(sql.held_claim_candidates(
                        &routes,
                        &["hooks".into()],
                        &[],
                        true,
                        200,
                        i64::MAX,
                    )),
                    &["b"][..],
                    6,
                ),
                (
                    "deferred claim candidates",
                    built(sql.held_claim_candidates(
                        &routes,
                        &[],
                        &["hooks".into()],
                        true,
                        200,
                        i64::MAX,
                    )),
                    &["b", "d"][..],
                    8,
                ),
            ] {
                let p = plan(&pool, &statement, &binds).await;
                assert!(
                    p.iter()
                        .filter(|(t, _)| t == "e")
                        .all(|(_, k)| k == "open_seq"),
                    "{name}, round {round}: {p:?}"
                );
                let probes: Vec<_> = p
                    .iter()
                    .filter(|(t, _)| probe_tables.contains(&t.as_str()))
                    .collect();
                assert_eq!(probes.len(), probe_count, "{name}, round {round}: {p:?}");
                assert!(
                    probes.iter().all(|(_, k)| k == "blockers"),
                    "{name}, round {round}: {p:?}"
                );
            }
            let filter = outbox_types::ReplayFilter {
                from: chrono::DateTime::<Utc>::MIN_UTC,
                to: Utc::now(),
                destination: Some("kafka".into()),
                event_type: Some("E".into()),
            };
            for (name, (statement, binds)) in [
                ("destination stats", built(sql.destination_stats(&routes))),
                (
                    "replay page",
                    built(sql.replay_page(&filter, &routes, 0, 100)),
                ),
            ] {
                let p = plan(&pool, &statement, &binds).await;
                let e: Vec<_> = p.iter().filter(|(t, _)| t == "e").collect();
                assert!(
                    !e.is_empty() && e.iter().all(|(_, k)| k == "open_seq"),
                    "{name}, round {round}: {p:?}"
                );
            }
            for (name, statement, binds) in [
                ("leases", &sql.leases, vec![]),
                ("purge dead", &sql.purge_dead, vec![1.into(), 10.into()]),
            ] {
                let p = plan(&pool, statement, &binds).await;
                assert!(
                    p.iter().any(|(_, k)| k == "open_seq"),
                    "{name}, round {round}: {p:?}"
                );
            }
            for (name, statement, binds) in [
                (
                    "lock rows",
                    &sql.claim_lock_rows,
                    vec![i64::MAX.into(), i64::MAX.into(), seqs.clone()],
                ),
                (
                    "claim update",
                    &sql.claim_update,
                    vec![seqs.clone(), "o".into(), token.clone(), 1.into()],
                ),
                ("ack", &sql.ack, vec![seqs.clone(), token.clone()]),
                ("release", &sql.release, vec![seqs.clone(), token.clone()]),
                ("replay update", &sql.replay_update, vec![seqs.clone()]),
                ("requeue", &sql.requeue_dead_ids, vec![ids.clone()]),
                ("discard", &sql.discard_dead_ids, vec![ids.clone()]),
            ] {
                let p = plan(&pool, statement, &binds).await;
                let e: Vec<_> = p.iter().filter(|(t, _)| t == "e").collect();
                assert_eq!(e.len(), 1, "{name}, round {round}: {p:?}");
                assert!(
                    ["PRIMARY", "id_key", "idempotency_key"].contains(&e[0].1.as_str()),
                    "{name}, round {round}: the table is looked up by key, not scanned: {p:?}"
                );
            }
        }
        sqlx::query(AssertSqlSafe(format!(
            "DROP TABLE {t}, {}, `{}_paused`",
            outbox.migrations_table(),
            outbox.table()
        )))
        .execute(&pool)
        .await
        .unwrap();
    }
}
