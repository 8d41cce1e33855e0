//! The statements, rendered once per outbox from its table name (the name is configurable, so
//! they cannot be `const`), and the builders of the statements that also depend on a request (a
//! claim with destinations on hold, destination stats, a replay page).

/// Statements rendered once per outbox (they embed the table name).
#[derive(Debug)]
pub(crate) struct Sql {
    pub(crate) enqueue: String,
    pub(crate) enqueue_batch: String,
    pub(crate) claim: String,
    pub(crate) ack: String,
    pub(crate) retry: String,
    pub(crate) bury: String,
    pub(crate) release: String,
    pub(crate) get: String,
    pub(crate) list_dead: String,
    pub(crate) requeue_dead_ids: String,
    pub(crate) requeue_dead_all: String,
    pub(crate) discard_dead_ids: String,
    pub(crate) discard_dead_all: String,
    pub(crate) purge: String,
    pub(crate) stats: String,
    pub(crate) leases: String,
    pub(crate) pause: String,
    pub(crate) resume: String,
    pub(crate) paused: String,
    pub(crate) purge_dead: String,
}

/// A row's sizes in bytes, as SQL over the row `alias` (`"e."`, or `""` for the claimed table
/// in `RETURNING`, which takes no alias): its payload, and every other column the claim reads
/// added up (see `outbox_types::RowBytes`). `octet_length` takes a value's size from its record
/// header and reads none of its content.
fn row_bytes(alias: &str) -> (String, String) {
    let size = |column: &str| format!("coalesce(octet_length({alias}{column}), 0)");
    let metadata = [
        "id",
        "aggregate_type",
        "aggregate_id",
        "event_type",
        "destination",
        "headers",
        "idempotency_key",
    ]
    .map(size)
    .join(" + ");
    (size("payload"), format!("({metadata})"))
}

/// What a claim returns: its sizes, its aggregate key when the key alone is within `?9`, and
/// the event's other columns only when the row is within `?8` payload bytes and `?9` bytes of
/// other columns; an oversized row comes back as its sizes and NULLs, and is buried unread.
fn claimed_columns() -> String {
    let (payload, metadata) = row_bytes("");
    let key_fits =
        "coalesce(octet_length(aggregate_type), 0) + coalesce(octet_length(aggregate_id), 0) <= ?9";
    let fits = format!("{payload} <= ?8 AND {metadata} <= ?9");
    let mut columns = vec![
        "seq".to_owned(),
        format!("{payload} AS payload_bytes"),
        format!("{metadata} AS metadata_bytes"),
    ];
    for column in ["aggregate_type", "aggregate_id"] {
        columns.push(format!(
            "CASE WHEN {key_fits} THEN {column} END AS {column}"
        ));
    }
    for column in [
        "id",
        "event_type",
        "payload",
        "destination",
        "headers",
        "idempotency_key",
    ] {
        columns.push(format!("CASE WHEN {fits} THEN {column} END AS {column}"));
    }
    columns.extend(["occurred_at", "enqueued_at", "attempts"].map(str::to_owned));
    columns.join(",\n                   ")
}

pub(crate) const RECORD_COLUMNS: &str = "seq, id, aggregate_type, aggregate_id, event_type, payload, \
     destination, headers, idempotency_key, occurred_at, enqueued_at, attempts, \
     status, next_attempt_at, last_error, lease_owner, lease_expires_at, delivered_at, dead_at";

impl Sql {
    /// `t` is the quoted outbox table, `p` the quoted paused-destinations table.
    pub(crate) fn render(t: &str, p: &str) -> Self {
        // The upsert only touches the existing row when its id differs from ours: then the row
        // comes back and its id (not ours) says "not created". When the key belongs to a row with
        // our own id (the same event enqueued twice) no row comes back, which says the same.
        // SQLite has no `xmax` to tell an insert from an update inside RETURNING.
        const UPSERT: &str = "ON CONFLICT (idempotency_key) WHERE idempotency_key IS NOT NULL
                 DO UPDATE SET idempotency_key = excluded.idempotency_key WHERE id <> excluded.id";
        Sql {
            // ?1 id … ?9 occurred_at, ?10 now.
            enqueue: format!(
                "INSERT INTO {t} (id, aggregate_type, aggregate_id, event_type, payload, destination, headers,
                                  idempotency_key, occurred_at, enqueued_at, next_attempt_at)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?10)
                 {UPSERT}
                 RETURNING id"
            ),
            // ?1 JSON array of events (see batch_row), ?2 now. `WHERE true` is required by
            // SQLite's grammar for INSERT … SELECT with an upsert clause.
            enqueue_batch: format!(
                "INSERT INTO {t} (id, aggregate_type, aggregate_id, event_type, payload, destination, headers,
                                  idempotency_key, occurred_at, enqueued_at, next_attempt_at)
                 SELECT j.value ->> 'id', j.value ->> 'aggregate_type', j.value ->> 'aggregate_id',
                        j.value ->> 'event_type', j.value ->> 'payload', j.value ->> 'destination',
                        j.value ->> 'headers', j.value ->> 'idempotency_key', j.value ->> 'occurred_at',
                        ?2, ?2
                 FROM json_each(?1) AS j
                 WHERE true
                 ORDER BY j.key
                 {UPSERT}
                 RETURNING id, idempotency_key"
            ),
            claim: claim_sql(t, None),
            // ?1 JSON array of seqs, ?2 token, ?3 now.
            ack: format!(
                "UPDATE {t} SET status = 'delivered', delivered_at = ?3,
                     lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL
                 WHERE seq IN (SELECT value FROM json_each(?1)) AND lease_token = ?2 AND status = 'in_flight'"
            ),
            // ?1 JSON array of {seq, due, error, cost}, ?2 token.
            retry: format!(
                "UPDATE {t} AS o SET status = 'pending', attempts = o.attempts + (r.value ->> 'cost'),
                     next_attempt_at = r.value ->> 'due', last_error = r.value ->> 'error',
                     lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL
                 FROM json_each(?1) AS r
                 WHERE o.seq = r.value ->> 'seq' AND o.lease_token = ?2 AND o.status = 'in_flight'"
            ),
            // ?1 JSON array of {seq, error}, ?2 token, ?3 now.
            bury: format!(
                "UPDATE {t} AS o SET status = 'dead', attempts = o.attempts + 1, dead_at = ?3,
                     last_error = r.value ->> 'error',
                     lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL
                 FROM json_each(?1) AS r
                 WHERE o.seq = r.value ->> 'seq' AND o.lease_token = ?2 AND o.status = 'in_flight'"
            ),
            // ?1 JSON array of seqs, ?2 token.
            release: format!(
                "UPDATE {t} SET status = 'pending', lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL
                 WHERE seq IN (SELECT value FROM json_each(?1)) AND lease_token = ?2 AND status = 'in_flight'"
            ),
            get: format!("SELECT {RECORD_COLUMNS} FROM {t} WHERE id = ?1"),
            list_dead: format!(
                "SELECT {RECORD_COLUMNS} FROM {t} WHERE status = 'dead' AND seq > ?1 ORDER BY seq LIMIT ?2"
            ),
            // ?1 JSON array of ids, ?2 now.
            requeue_dead_ids: format!(
                "UPDATE {t} SET status = 'pending', attempts = 0, next_attempt_at = MIN(next_attempt_at, ?2), dead_at = NULL, last_error = NULL
                 WHERE status = 'dead' AND id IN (SELECT value FROM json_each(?1))"
            ),
            requeue_dead_all: format!(
                "UPDATE {t} SET status = 'pending', attempts = 0, next_attempt_at = MIN(next_attempt_at, ?1), dead_at = NULL, last_error = NULL
                 WHERE status = 'dead'"
            ),
            discard_dead_ids: format!(
                "DELETE FROM {t} WHERE status = 'dead' AND id IN (SELECT value FROM json_each(?1))"
            ),
            discard_dead_all: format!("DELETE FROM {t} WHERE status = 'dead'"),
            // ?1 cut-off, ?2 limit.
            purge: format!(
                "DELETE FROM {t} WHERE seq IN (
                     SELECT seq FROM {t}
                     WHERE status = 'delivered' AND delivered_at < ?1
                     ORDER BY seq LIMIT ?2)"
            ),
            // ?1 cut-off, ?2 limit. Through the `_dead` partial index.
            purge_dead: format!(
                "DELETE FROM {t} WHERE seq IN (
                     SELECT seq FROM {t}
                     WHERE status = 'dead' AND dead_at < ?1
                     ORDER BY seq LIMIT ?2)"
            ),
            // ?1 now. The first condition is the `_open` index's predicate, repeated so the
            // planner reads in-flight rows through it.
            leases: format!(
                "SELECT COALESCE(lease_owner, '') AS owner, count(*) AS events,
                        min(claimed_at) AS claimed_since, max(lease_expires_at) AS expires_at,
                        count(*) FILTER (WHERE lease_expires_at <= ?1) AS expired
                 FROM {t}
                 WHERE status IN ('pending', 'in_flight') AND status = 'in_flight'
                 GROUP BY 1 ORDER BY 1"
            ),
            // ?1 destination, ?2 now, ?3 by.
            pause: format!(
                "INSERT INTO {p} (destination, paused_at, paused_by) VALUES (?1, ?2, ?3)
                 ON CONFLICT (destination) DO NOTHING"
            ),
            resume: format!("DELETE FROM {p} WHERE destination = ?1"),
            paused: format!(
                "SELECT destination, paused_at, paused_by FROM {p} ORDER BY destination"
            ),
            stats: format!(
                "SELECT count(*) FILTER (WHERE status = 'pending') AS pending,
                        count(*) FILTER (WHERE status = 'pending' AND (attempts > 0 OR last_error IS NOT NULL)) AS retrying,
                        count(*) FILTER (WHERE status = 'in_flight') AS in_flight,
                        count(*) FILTER (WHERE status = 'delivered') AS delivered,
                        count(*) FILTER (WHERE status = 'dead') AS dead,
                        (SELECT o.enqueued_at FROM {t} AS o
                         WHERE o.status IN ('pending', 'in_flight') ORDER BY o.seq LIMIT 1) AS oldest
                 FROM {t}"
            ),
        }
    }
}

/// The route expressions a claim with destinations on hold compares against the paused names:
/// the table's `CASE` over the candidate (`e`) and over the blocker probe's row (`b`), both
/// numbered from `?11` so they share their values.
pub(crate) struct HoldSql {
    pub(crate) route_e: String,
    pub(crate) route_b: String,
}

/// A route fragment's `?` placeholders as `?first`, `?first+1`, …: numbered, the fragment can
/// sit anywhere in a statement that also uses numbered parameters (a bare `?` takes the number
/// after the largest one used *before it in the text*, which would collide), and can appear
/// twice with the same values. Route values are always bound, so every `?` is a placeholder.
pub(crate) fn number_placeholders(sql: &str, first: usize) -> String {
    let mut out = String::with_capacity(sql.len() + 16);
    let mut n = first;
    for c in sql.chars() {
        if c == '?' {
            out.push_str(&format!("?{n}"));
            n += 1;
        } else {
            out.push(c);
        }
    }
    out
}

/// The claim statement. ?1 limit, ?2 owner, ?3 token, ?4 lease expiry, ?5 now, ?6 dead blocks
/// (0/1), ?7 most bytes in the batch (whole rows), ?8 most payload bytes of one event, ?9 most
/// bytes of one event's other columns together; with a hold, ?10 the paused names (a JSON
/// array) and ?11… the route table's values.
///
/// A row is due when pending and its time has come, or in flight under an expired lease (its
/// relay died). It is held back by any earlier row of its aggregate that is in flight under a
/// live lease, waiting for a retry, or dead when dead blocks — unless that row's destination is
/// on hold (a paused destination's events hold back nobody). The outer scan repeats the
/// predicate of the `_open` partial index and the blocker probe that of the `_blockers` one, so
/// SQLite's planner uses both (checked by a test with EXPLAIN QUERY PLAN). One statement:
/// SQLite runs it under its single write lock, so concurrent claims are serialized and never
/// overlap. SQLite has no row locks, so the PostgreSQL claim's hole (SKIP LOCKED passing over an
/// earlier event another transaction holds, handing out its aggregate's next one) cannot open
/// here: a writer holding any row holds the whole database, and the claim waits for its commit
/// (busy timeout) and then sees every row as it is.
pub(crate) fn claim_sql(t: &str, hold: Option<&HoldSql>) -> String {
    let (payload, metadata) = row_bytes("e.");
    let claimed = claimed_columns();
    let (hold_e, hold_b) = match hold {
        Some(h) => (
            format!(
                "AND COALESCE({}, '') NOT IN (SELECT value FROM json_each(?10))",
                h.route_e
            ),
            format!(
                "AND COALESCE({}, '') NOT IN (SELECT value FROM json_each(?10))",
                h.route_b
            ),
        ),
        None => (String::new(), String::new()),
    };
    format!(
        "UPDATE {t}
         SET status = 'in_flight', lease_owner = ?2, lease_token = ?3, lease_expires_at = ?4,
             claimed_at = ?5
         WHERE seq IN (
           -- The byte budget (?7 per batch, ?8 per payload, ?9 per event's other columns; see
           -- `ClaimRequest`): the due rows in seq order while the rows before them (payload and
           -- every other column) add up to less than ?7, the first always. What it leaves out
           -- comes after everything it keeps. A row over ?8 or ?9 counts as nothing: it comes
           -- back without its columns and is buried. Sizes come from the record headers
           -- (`octet_length`), not from reading the columns.
           SELECT c.seq FROM (
             SELECT c.seq, c.b, sum(c.b) OVER (ORDER BY c.seq ROWS UNBOUNDED PRECEDING) AS running
             FROM (
             SELECT e.seq,
                    CASE WHEN {payload} > ?8 OR {metadata} > ?9 THEN 0
                         ELSE {payload} + {metadata} END AS b
             FROM {t} AS e
             WHERE e.status IN ('pending', 'in_flight')
               AND CASE WHEN e.status = 'pending' THEN e.next_attempt_at <= ?5
                        ELSE e.lease_expires_at <= ?5 END
               {hold_e}
               AND NOT EXISTS (
                   SELECT 1 FROM {t} AS b
                   WHERE b.aggregate_type = e.aggregate_type
                     AND b.aggregate_id = e.aggregate_id
                     AND b.seq < e.seq
                     AND (b.status IN ('in_flight', 'dead') OR (b.status = 'pending' AND (b.attempts > 0 OR b.last_error IS NOT NULL)))
                     AND CASE b.status
                             WHEN 'in_flight' THEN b.lease_expires_at > ?5
                             WHEN 'dead' THEN ?6
                             ELSE b.next_attempt_at > ?5 END
                     {hold_b})
             ORDER BY e.seq
             LIMIT ?1) AS c
           ) AS c
           WHERE c.running - c.b < ?7)
         RETURNING {claimed}"
    )
}

/// Backlog per destination: the route `CASE` (numbered from ?1) grouped over the undelivered
/// rows (the `_open` partial index) and the dead ones (the `_dead` index). Delivered rows, the
/// bulk of a table kept for retention, are never read.
pub(crate) fn destination_stats_sql(t: &str, route: &str) -> String {
    format!(
        "SELECT x.route AS route,
                count(*) FILTER (WHERE x.status = 'pending') AS pending,
                count(*) FILTER (WHERE x.status = 'pending' AND x.failed) AS retrying,
                count(*) FILTER (WHERE x.status = 'in_flight') AS in_flight,
                count(*) FILTER (WHERE x.status = 'dead') AS dead,
                min(x.enqueued_at) FILTER (WHERE x.status IN ('pending', 'in_flight')) AS oldest,
                -- The newest waiting row's error: the greatest zero-padded seq, cut off again.
                substr(max(CASE WHEN x.status IN ('pending', 'in_flight') AND x.last_error IS NOT NULL
                                THEN printf('%020d', x.seq) || x.last_error END), 21) AS last_error
         FROM (
             SELECT COALESCE({route}, '') AS route, e.seq, e.status, e.enqueued_at, e.last_error,
                    (e.attempts > 0 OR e.last_error IS NOT NULL) AS failed
             FROM {t} AS e WHERE e.status IN ('pending', 'in_flight')
             UNION ALL
             SELECT COALESCE({route}, '') AS route, e.seq, e.status, e.enqueued_at, NULL, 0
             FROM {t} AS e WHERE e.status = 'dead'
         ) AS x
         GROUP BY x.route"
    )
}

/// One replay step, one statement (so the page and the update are one atomic write). ?1 after
/// seq, ?2 from, ?3 to, ?4 event type or NULL, ?5 limit, ?6 now; with a destination, ?7 its name
/// and ?8… the route table's values. The page walks the primary key from ?1: delivered rows have
/// no index of their own, which keeps acks cheap.
pub(crate) fn replay_sql(t: &str, route: Option<&str>) -> String {
    let destination = route
        .map(|r| format!("AND COALESCE({r}, '') = ?7"))
        .unwrap_or_default();
    format!(
        "UPDATE {t}
         SET status = 'pending', attempts = 0, next_attempt_at = MIN(next_attempt_at, ?6), delivered_at = NULL,
             dead_at = NULL, last_error = NULL,
             lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL
         WHERE seq IN (
             SELECT e.seq FROM {t} AS e
             WHERE e.status = 'delivered' AND e.seq > ?1
               AND e.enqueued_at >= ?2 AND e.enqueued_at < ?3
               AND (?4 IS NULL OR e.event_type = ?4)
               {destination}
             ORDER BY e.seq
             LIMIT ?5)
         RETURNING seq"
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::SqliteOutbox;
    use crate::SqliteStore;
    use outbox_types::DeadLetterPolicy;
    use outbox_types::NewEvent;
    use outbox_types::route::SqlDialect;
    use outbox_types::{ClaimRequest, Store};
    use sqlx::AssertSqlSafe;
    use sqlx::Row;
    use sqlx::SqlitePool;
    use std::time::Duration;

    /// The query plan's detail lines for `sql`, with `params` NULL parameters bound.
    async fn plan(pool: &SqlitePool, sql: &str, params: usize) -> String {
        let explain = format!("EXPLAIN QUERY PLAN {sql}");
        let mut query = sqlx::query(AssertSqlSafe(explain.as_str()));
        for _ in 0..params {
            query = query.bind(None::<i64>);
        }
        let rows = query.fetch_all(pool).await.unwrap();
        rows.iter()
            .map(|r| r.try_get::<String, _>("detail").unwrap())
            .collect::<Vec<_>>()
            .join("\n")
    }

    #[tokio::test]
    async fn statements_use_the_intended_indexes_even_after_analyze() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("plan.db");
        let store = SqliteStore::connect(path.to_str().unwrap(), SqliteOutbox::new())
            .await
            .unwrap();
        store.outbox().migrate(store.pool()).await.unwrap();
        // Mostly delivered rows, as in a table kept for retention, then fresh statistics.
        let events: Vec<NewEvent> = (0..600)
            .map(|i| outbox_testkit::numbered(&format!("a{}", i % 50), i))
            .collect();
        store
            .outbox()
            .enqueue_batch(store.pool(), &events)
            .await
            .unwrap();
        let claim = store
            .claim(&ClaimRequest::new(
                "plan",
                550,
                Duration::from_secs(60),
                DeadLetterPolicy::Block,
            ))
            .await
            .unwrap();
        let seqs: Vec<i64> = claim.events.iter().map(|e| e.seq).collect();
        store.ack(&claim.lease, &seqs).await.unwrap();
        sqlx::query("ANALYZE").execute(store.pool()).await.unwrap();

        let sql = store.sql();
        let claim_plan = plan(store.pool(), &sql.claim, 9).await;
        assert!(
            claim_plan.contains("SCAN e USING INDEX outbox_events_open"),
            "{claim_plan}"
        );
        assert!(
            claim_plan.contains("SEARCH b USING INDEX outbox_events_blockers"),
            "{claim_plan}"
        );
        for (name, statement, params) in [
            ("ack", &sql.ack, 3),
            ("retry", &sql.retry, 2),
            ("bury", &sql.bury, 3),
            ("release", &sql.release, 2),
        ] {
            let p = plan(store.pool(), statement, params).await;
            assert!(p.contains("USING INTEGER PRIMARY KEY"), "{name}: {p}");
            assert!(
                !p.contains("SCAN o\n") && !p.contains("SCAN outbox_events"),
                "{name}: {p}"
            );
        }
        // The operator statements read undelivered and dead rows through the partial indexes,
        // never the delivered bulk; a claim with a destination on hold still does too.
        let routes = outbox_testkit::hooks_and_kafka();
        let route_e = routes.sql_case(SqlDialect::Sqlite, Some("e"));
        let route_b = routes.sql_case(SqlDialect::Sqlite, Some("b"));
        let held = claim_sql(
            store.outbox().quoted_table(),
            Some(&HoldSql {
                route_e: number_placeholders(&route_e.sql, 11),
                route_b: number_placeholders(&route_b.sql, 11),
            }),
        );
        let held_plan = plan(store.pool(), &held, 10 + route_e.binds.len()).await;
        assert!(
            held_plan.contains("SCAN e USING INDEX outbox_events_open"),
            "{held_plan}"
        );
        assert!(
            held_plan.contains("SEARCH b USING INDEX outbox_events_blockers"),
            "{held_plan}"
        );
        let stats = destination_stats_sql(
            store.outbox().quoted_table(),
            &number_placeholders(&route_e.sql, 1),
        );
        let stats_plan = plan(store.pool(), &stats, route_e.binds.len()).await;
        assert!(
            stats_plan.contains("USING INDEX outbox_events_open")
                && stats_plan.contains("USING INDEX outbox_events_dead"),
            "{stats_plan}"
        );
        let leases = plan(store.pool(), &sql.leases, 1).await;
        assert!(
            leases.contains("USING INDEX outbox_events_open"),
            "{leases}"
        );
        let purge_dead = plan(store.pool(), &sql.purge_dead, 2).await;
        assert!(
            purge_dead.contains("USING INDEX outbox_events_dead"),
            "{purge_dead}"
        );

        let get = plan(store.pool(), &sql.get, 1).await;
        assert!(get.contains("SEARCH outbox_events USING INDEX"), "{get}");
        let enqueue = plan(store.pool(), &sql.enqueue, 10).await;
        assert!(!enqueue.contains("SCAN"), "{enqueue}");
    }

    #[test]
    fn sql_embeds_the_quoted_table() {
        let outbox = SqliteOutbox::with_table("my_events").unwrap();
        assert!(outbox.inner.sql.claim.contains("UPDATE \"my_events\""));
        assert!(outbox.inner.sql.pause.contains("\"my_events_paused\""));
        assert_eq!(
            number_placeholders("a = ? AND b IN (?, ?)", 8),
            "a = ?8 AND b IN (?9, ?10)"
        );
        assert_eq!(outbox.migrations_table(), "\"my_events_migrations\"");
    }
}
