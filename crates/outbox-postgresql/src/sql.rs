//! The statements, rendered once per outbox from its table names (the table name is
//! configurable, so they cannot be `const`), and the builders of the statements that also depend
//! on a request (a claim with destinations on hold, destination stats, a replay page). Why each
//! statement is shaped the way it is stays next to it.

/// Statements rendered once per outbox (they embed the table name).
#[derive(Debug)]
pub(crate) struct Sql {
    /// Events through the batch enqueue function (`<table>_enqueue_batch`, which runs as its
    /// owner): every event with an idempotency key, and every event in the partitioned layout,
    /// so a writer needs EXECUTE on it and no right on the table's rows (a key's upsert needs
    /// SELECT and UPDATE there, enough to lock and rewrite other services' events).
    pub(crate) enqueue_batch: String,
    /// Plain layout only: events without an idempotency key, as a plain `INSERT`: nothing to
    /// conflict on, and what a writer needs is INSERT (also the cheapest path for a writer's
    /// transaction; see `outbox-bench write-overhead`).
    pub(crate) enqueue_unkeyed: Option<String>,
    pub(crate) enqueue_batch_unkeyed: Option<String>,
    pub(crate) claim: String,
    pub(crate) ack: String,
    pub(crate) ack_delete: String,
    pub(crate) retry: String,
    pub(crate) bury: String,
    pub(crate) release: String,
    pub(crate) get: String,
    pub(crate) list_dead: String,
    pub(crate) requeue_dead: String,
    pub(crate) discard_dead: String,
    pub(crate) purge: String,
    pub(crate) stats: String,
    pub(crate) oldest: String,
    pub(crate) leases: String,
    pub(crate) pause: String,
    pub(crate) resume: String,
    pub(crate) paused: String,
    pub(crate) purge_dead: String,
}

pub(crate) const RECORD_COLUMNS: &str = "seq, id, aggregate_type, aggregate_id, event_type, payload::text AS payload, \
     destination, headers::text AS headers, idempotency_key, occurred_at, enqueued_at, attempts, \
     status, next_attempt_at, last_error, lease_owner, lease_expires_at, delivered_at, dead_at";

impl Sql {
    /// `t` is the quoted outbox table, `p` the quoted paused-destinations table, `keys` the
    /// quoted keys table of the partitioned layout, `enqueue_batch` the quoted batch enqueue
    /// function.
    pub(crate) fn render(t: &str, p: &str, keys: Option<&str>, enqueue_batch: &str) -> Self {
        // Deletes report how many events they removed; in the partitioned layout they remove
        // the events' ids and keys from the keys table in the same statement.
        let counted_delete = |delete: String| match keys {
            None => format!("WITH d AS ({delete} RETURNING id) SELECT count(*) AS n FROM d"),
            Some(k) => format!(
                "WITH d AS ({delete} RETURNING id),
                      k AS (DELETE FROM {k} WHERE id IN (SELECT id FROM d))
                 SELECT count(*) AS n FROM d"
            ),
        };
        // The partitioned layout needs the keys table even without a key: it is what keeps ids
        // unique across partitions, and the function writes it.
        let (enqueue_unkeyed, enqueue_batch_unkeyed) = match keys {
            None => (
                Some(plain_enqueue_unkeyed(t)),
                Some(plain_enqueue_batch_unkeyed(t)),
            ),
            Some(_) => (None, None),
        };
        Sql {
            enqueue_batch: enqueue_batch_call(enqueue_batch),
            enqueue_unkeyed,
            enqueue_batch_unkeyed,
            claim: claim_sql(t, None),
            ack: format!(
                "UPDATE {t} SET status = 'delivered', delivered_at = now(),
                     lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL
                 WHERE seq = ANY($1) AND lease_token = $2 AND status = 'in_flight'"
            ),
            // The ack of a store that keeps nothing delivered: the row goes at once. A delete
            // writes one small WAL record per row where the update writes a whole new row
            // version and its index entries (measured by `outbox-bench drain --delete-on-ack`).
            ack_delete: counted_delete(format!(
                "DELETE FROM {t} WHERE seq = ANY($1) AND lease_token = $2 AND status = 'in_flight'"
            )),
            retry: format!(
                "UPDATE {t} AS o SET status = 'pending', attempts = o.attempts + r.cost,
                     next_attempt_at = now() + r.delay_ms * interval '1 millisecond', last_error = r.error,
                     lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL
                 FROM unnest($1::bigint[], $2::bigint[], $3::text[], $5::int[]) AS r(seq, delay_ms, error, cost)
                 WHERE o.seq = r.seq AND o.lease_token = $4 AND o.status = 'in_flight'"
            ),
            bury: format!(
                "UPDATE {t} AS o SET status = 'dead', attempts = o.attempts + 1, dead_at = now(), last_error = r.error,
                     lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL
                 FROM unnest($1::bigint[], $2::text[]) AS r(seq, error)
                 WHERE o.seq = r.seq AND o.lease_token = $3 AND o.status = 'in_flight'"
            ),
            release: format!(
                "UPDATE {t} SET status = 'pending', lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL
                 WHERE seq = ANY($1) AND lease_token = $2 AND status = 'in_flight'"
            ),
            get: format!("SELECT {RECORD_COLUMNS} FROM {t} WHERE id = $1"),
            list_dead: format!(
                "SELECT {RECORD_COLUMNS} FROM {t} WHERE status = 'dead' AND seq > $1 ORDER BY seq LIMIT $2"
            ),
            requeue_dead: format!(
                "UPDATE {t} SET status = 'pending', attempts = 0, next_attempt_at = LEAST(next_attempt_at, now()),
                        dead_at = NULL, last_error = NULL
                 WHERE status = 'dead' AND ($1::uuid[] IS NULL OR id = ANY($1))"
            ),
            discard_dead: counted_delete(format!(
                "DELETE FROM {t} WHERE status = 'dead' AND ($1::uuid[] IS NULL OR id = ANY($1))"
            )),
            purge: counted_delete(purge_sql(t, "delivered", "delivered_at")),
            // Through the `_dead` partial index.
            purge_dead: counted_delete(purge_sql(t, "dead", "dead_at")),
            // In-flight rows only (the `_open` partial index), on the database's clock.
            leases: format!(
                "SELECT COALESCE(lease_owner, '') AS owner, count(*) AS events,
                        min(claimed_at) AS claimed_since, max(lease_expires_at) AS expires_at,
                        count(*) FILTER (WHERE lease_expires_at <= now()) AS expired
                 FROM {t} WHERE status = 'in_flight'
                 GROUP BY 1 ORDER BY 1"
            ),
            pause: format!(
                "INSERT INTO {p} (destination, paused_by) VALUES ($1, $2)
                 ON CONFLICT (destination) DO NOTHING"
            ),
            resume: format!("DELETE FROM {p} WHERE destination = $1"),
            paused: format!(
                "SELECT destination, paused_at, paused_by FROM {p} ORDER BY destination"
            ),
            stats: format!(
                "SELECT count(*) FILTER (WHERE status = 'pending') AS pending,
                        count(*) FILTER (WHERE status = 'pending' AND (attempts > 0 OR last_error IS NOT NULL)) AS retrying,
                        count(*) FILTER (WHERE status = 'in_flight') AS in_flight,
                        count(*) FILTER (WHERE status = 'delivered') AS delivered,
                        count(*) FILTER (WHERE status = 'dead') AS dead,
                        now() AS observed_at
                 FROM {t}"
            ),
            oldest: format!(
                "SELECT enqueued_at FROM {t} WHERE status IN ('pending', 'in_flight') ORDER BY seq LIMIT 1"
            ),
        }
    }
}

/// A purge: up to `$2` rows in `status` whose `at` is more than `$1` milliseconds ago, oldest
/// first. The outer WHERE repeats the condition: a row changed between the subquery's snapshot
/// and the delete (a replay, say) is re-checked on its latest version.
fn purge_sql(t: &str, status: &str, at: &str) -> String {
    let old = format!("status = '{status}' AND {at} < now() - $1 * interval '1 millisecond'");
    format!(
        "DELETE FROM {t} WHERE seq IN (
                     SELECT seq FROM {t}
                     WHERE {old}
                     ORDER BY seq LIMIT $2)
                   AND {old}"
    )
}

/// A batch through the batch enqueue function `f`: `$1` ids … `$9` occurred_at, as arrays in
/// batch order; one row back per event with an idempotency key (the id of the event holding
/// that key, the key, and whether this call wrote it).
pub(crate) fn enqueue_batch_call(f: &str) -> String {
    format!(
        "SELECT b.id, b.idempotency_key, b.created
         FROM {f}($1::uuid[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[], $7::text[], $8::text[], $9::timestamptz[]) AS b"
    )
}

/// Enqueue an event without an idempotency key into the plain layout: a plain `INSERT` (a
/// duplicate id fails on the unique constraint). `$1` id … `$9` occurred_at, `$8` (the key)
/// being NULL.
pub(crate) fn plain_enqueue_unkeyed(t: &str) -> String {
    format!(
        "INSERT INTO {t} (id, aggregate_type, aggregate_id, event_type, payload, destination, headers, idempotency_key, occurred_at)
         VALUES ($1, $2, $3, $4, $5::json, $6, $7::jsonb, $8, $9)"
    )
}

/// A batch in which no event has an idempotency key into the plain layout: the columns as
/// arrays (the function's parameters), inserted in array order.
pub(crate) fn plain_enqueue_batch_unkeyed(t: &str) -> String {
    format!(
        "INSERT INTO {t} (id, aggregate_type, aggregate_id, event_type, payload, destination, headers, idempotency_key, occurred_at)
         SELECT u.id, u.aggregate_type, u.aggregate_id, u.event_type, u.payload::json, u.destination, u.headers::jsonb, u.idempotency_key, u.occurred_at
         FROM {BATCH_UNNEST}
         ORDER BY u.ord"
    )
}

/// The events of a batch as rows, in array order (`u.ord`).
const BATCH_UNNEST: &str = "unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[], $7::text[], $8::text[], $9::timestamptz[])
              WITH ORDINALITY AS u(id, aggregate_type, aggregate_id, event_type, payload, destination, headers, idempotency_key, occurred_at, ord)";

/// The route expressions a claim with destinations on hold compares against the paused names:
/// the table's `CASE` over the candidate (`e`) and over the blocker probe's row (`b`), both bound
/// to the same placeholders.
pub(crate) struct HoldSql {
    /// The route `CASE` over the candidate row `e`.
    pub(crate) route_e: String,
    /// The same over a blocker `b`.
    pub(crate) route_b: String,
    /// The same over an earlier open row `d`, when a destination is deferred.
    pub(crate) route_d: Option<String>,
}

/// Run in the claim's transaction just before the claim statement: the advisory lock that
/// serializes claims across relays (`$1` the outbox's lock key).
///
/// (Tried and dropped: `enable_sort = off` here, to keep the planner from sorting all open rows
/// under statistics taken while nothing was open. The sorts it must still do then carry the
/// disable cost, which swamps every other difference: the claim's `UPDATE` went to a
/// sequential scan of the whole table. The `_heads` predicate, below, does it instead.)
/// A claimed row's sizes, measured on the row `l` as the claim would send it (every column as
/// text): `payload_bytes`, `metadata_bytes` (every other column the claim reads, added up: see
/// `outbox_types::RowBytes`) and `key_bytes` (the aggregate key alone). `bigint` sums: seven
/// columns of up to 1 GB each overflow `integer`. A column a hand-altered table leaves NULL
/// counts as 0.
const ROW_BYTES: &str = "coalesce(octet_length(l.payload::text), 0)::bigint AS payload_bytes,
                        coalesce(octet_length(l.id::text), 0)::bigint
                          + coalesce(octet_length(l.aggregate_type), 0)
                          + coalesce(octet_length(l.aggregate_id), 0)
                          + coalesce(octet_length(l.event_type), 0)
                          + coalesce(octet_length(l.destination), 0)
                          + coalesce(octet_length(l.headers::text), 0)
                          + coalesce(octet_length(l.idempotency_key), 0) AS metadata_bytes,
                        coalesce(octet_length(l.aggregate_type), 0)::bigint
                          + coalesce(octet_length(l.aggregate_id), 0) AS key_bytes";

pub(crate) const CLAIM_SETUP: &str = "SELECT pg_advisory_xact_lock($1)";

/// The claim statement. `$1` limit, `$2` owner, `$3` token, `$4` dead blocks, `$5` lease ms, `$6`
/// most bytes in the batch (whole rows), `$7` most payload bytes of one event, `$8` the highest
/// seq to claim, `$9` most bytes of one event's other columns together; with a hold, `$10` the
/// paused destination names (`text[]`), `$11` the deferred ones and `$12…` the route table's
/// values.
///
/// A row is due when pending and its time has come, or in flight under an expired lease (its
/// relay died). It is held back by any earlier row of its aggregate that is in flight under a
/// live lease, waiting for a retry, or dead when dead blocks. The blocker probe's WHERE repeats
/// the predicate of the `_blockers` partial index, the scans' that of `_open` and `_heads`, so
/// the cost does not grow with the delivered rows kept for retention. `_heads` holds the same
/// rows as `_open` (the status check allows four values), but its predicate is written
/// `status NOT IN ('delivered', 'dead')`, which the planner cannot prove for `_open`: under
/// statistics taken while nothing was open every path over open rows looks free, and the
/// `_heads` walk found each next aggregate by sorting all open rows from `_open` (16k buffers
/// per claim at a 40k backlog, growing with it). Now only `_heads` can serve it.
///
/// Finding the due rows, in two parts so that a claim's work is bounded by its limit and not by
/// the backlog:
///
/// - `window`: the first `4 × limit` rows due by time, in seq order, each probed for a blocker;
///   the first `limit` unblocked ones are taken. With many aggregates this fills the claim, and
///   an aggregate's due rows go in one claim, in order.
/// - `heads`, only when the window was full and gave fewer than `limit`: most of the front of the
///   queue is held back (another relay holds the head of every aggregate, or a few aggregates
///   wait behind a retry or a dead event with long queues behind them). Walking on in seq order
///   would probe every held row — with 144 aggregates and a 600k backlog, a claim that finds
///   nothing took seconds, growing with the backlog, while holding the claim lock. Instead a
///   loose index scan over `_heads` visits up to `limit` aggregates that have open rows, from
///   the aggregate of a random open row onward (wrapping around), and takes each one's first
///   open row when it is due and unblocked (`heads`), and behind each such head up to 15 more
///   rows that are due and unblocked (`runs`, the same test the window applies). Every
///   aggregate is reached within a few claims whatever is held in front of it; a head never
///   passes an earlier row of its aggregate (the rows before it are delivered, dead, or on
///   hold). Heads alone would give each aggregate one event per claim while the front of the
///   queue stays held (e.g. a broker's aggregates waiting for retries).
///
/// Why the due rows are then locked in separate steps and not with one `SELECT … FOR UPDATE SKIP
/// LOCKED LIMIT n`: `SKIP LOCKED` silently passes over a due row that another transaction holds
/// at this instant — a writer whose duplicate-key enqueue hit it (`ON CONFLICT DO UPDATE` locks
/// the row until that transaction ends), a stalled relay's late retry or release of an expired
/// lease, an operator's `SELECT … FOR UPDATE`. Such a row is neither claimed nor a blocker (a
/// pending row with no attempt never is), so a one-step claim would hand out the *next* event of
/// its aggregate ahead of it. Instead:
///
/// 1. `due`: the rows found above, read without locking;
/// 2. `locked`: those rows locked with `SKIP LOCKED`, the due condition checked again on the
///    latest committed version (a row acked or retried since the statement's snapshot drops out).
///    Each row is looked up by its seq (a `LATERAL` lookup): as a join, statistics taken while
///    nothing was open (autovacuum analyzes an outbox table when it is drained) let the planner
///    hash every open row to lock 500 of them — claims of 10 s at a 120k backlog in the load
///    profile, growing with the backlog they let grow;
/// 3. `skipped`: per aggregate, the first `due` row that did not make it into `locked`. A locked
///    row is claimed only when no skipped row of its aggregate comes before it.
///
/// `SKIP LOCKED` still keeps the claim from ever waiting on a row lock; the price of a skipped
/// row is that this claim leaves its aggregate alone, and the next claim picks it up. The claim
/// stays serialized across relays by the advisory lock taken just before it.
pub(crate) fn claim_sql(t: &str, hold: Option<&HoldSql>) -> String {
    // `$10` the paused destinations, `$11` the deferred ones (for this claim only). Neither's
    // rows are candidates; a paused destination's rows hold nothing back (its events wait
    // apart), a deferred one's hold back their aggregate's later events as usual, and so does a
    // deferred row that is merely due (`deferred_probe`): skipping a destination for one turn
    // must not let another destination's event pass an earlier one of the same aggregate.
    let (hold_e, hold_b) = match hold {
        Some(h) => (
            format!(
                "AND NOT (COALESCE({}, '') = ANY($10::text[] || $11::text[]))",
                h.route_e
            ),
            format!("AND NOT (COALESCE({}, '') = ANY($10::text[]))", h.route_b),
        ),
        None => (String::new(), String::new()),
    };
    // Through the `_heads` index (open rows by aggregate and seq); only built when a
    // destination is deferred.
    let deferred_probe = match hold.and_then(|h| h.route_d.as_deref()) {
        Some(route_d) => format!(
            "AND NOT EXISTS (
                 SELECT 1 FROM {t} d
                 WHERE d.aggregate_type = e.aggregate_type
                   AND d.aggregate_id = e.aggregate_id
                   AND d.seq < e.seq
                   AND d.status NOT IN ('delivered', 'dead')
                   AND COALESCE({route_d}, '') = ANY($11::text[]))"
        ),
        None => String::new(),
    };
    // Due by time (pending and its time has come, or in flight under an expired lease), for
    // the row aliased `a`: read on the snapshot by the scans, re-checked on the latest version
    // by the lock step.
    let due_by_time_of = |a: &str| {
        format!(
            "CASE WHEN {a}.status = 'pending' THEN {a}.next_attempt_at <= statement_timestamp()
                  ELSE {a}.lease_expires_at <= statement_timestamp() END AND {a}.seq <= $8"
        )
    };
    let due_by_time = due_by_time_of("e");
    let due_on_latest = due_by_time_of("l");
    // OFFSET 0 keeps the probe a per-row lookup in the `_blockers` index: flattened into an
    // anti-join, statistics gathered while nothing was in flight let the planner join every
    // candidate against every blocker (seconds on a 100k backlog, measured by outbox-bench).
    // The probe walks the index downwards from the candidate: a blocker is usually just before
    // it (its aggregate's head, in flight), while below that lie the entries every delivered
    // event of the aggregate left behind until vacuum removes them (one per claim). Walking up
    // from the aggregate's first entry passed all of them: with 144 aggregates and 475k
    // delivered events, 1.2 ms per probe and claims of seconds that held back vacuum and grew
    // (the load profile); downwards, 0.03 ms.
    let unblocked = format!(
        "NOT EXISTS (
             SELECT 1 FROM {t} b
             WHERE b.aggregate_type = e.aggregate_type
               AND b.aggregate_id = e.aggregate_id
               AND b.seq < e.seq
               AND (b.status IN ('in_flight', 'dead') OR (b.status = 'pending' AND (b.attempts > 0 OR b.last_error IS NOT NULL)))
               AND CASE b.status
                       WHEN 'in_flight' THEN b.lease_expires_at > statement_timestamp()
                       WHEN 'dead' THEN $4
                       ELSE b.next_attempt_at > statement_timestamp() END
               {hold_b}
             ORDER BY b.seq DESC
             OFFSET 0)
         {deferred_probe}"
    );
    // Per aggregate of `from` (aliased `a`), its first `limit` open rows that also pass `after`,
    // in seq order (through `_heads`), kept when due and unblocked: each walked aggregate's head
    // (`heads`), and up to 15 rows behind each head kept (`runs`).
    let open_rows_of = |from: &str, after: &str, limit: u32| {
        format!(
            "SELECT e.seq, e.aggregate_type, e.aggregate_id FROM {from} a
             CROSS JOIN LATERAL (
                 SELECT e.seq, e.aggregate_type, e.aggregate_id, e.status, e.next_attempt_at, e.lease_expires_at
                 FROM {t} e
                 WHERE e.aggregate_type = a.aggregate_type AND e.aggregate_id = a.aggregate_id {after}
                   AND e.status NOT IN ('delivered', 'dead') {hold_e}
                 ORDER BY e.seq
                 LIMIT {limit}
             ) e
             WHERE {due_by_time} AND {unblocked}"
        )
    };
    let heads = open_rows_of("walk", "", 1);
    let runs = open_rows_of("heads", "AND e.seq > a.seq", 15);
    format!(
        "WITH RECURSIVE window_due AS MATERIALIZED (
             SELECT e.seq, e.aggregate_type, e.aggregate_id FROM (
                 SELECT e.seq, e.aggregate_type, e.aggregate_id FROM {t} e
                 WHERE e.status IN ('pending', 'in_flight') AND {due_by_time} {hold_e}
                 ORDER BY e.seq
                 LIMIT $1 * 4
             ) e
             WHERE {unblocked}
             ORDER BY e.seq
             LIMIT $1
         ),
         start AS MATERIALIZED (
             SELECT s.aggregate_type, s.aggregate_id FROM {t} s
             -- Only when the window gave too few: was it full (more due rows lie beyond)?
             -- This re-walks the window's cheap part; materializing the window instead would
             -- make every claim read all 4 x limit rows.
             WHERE (SELECT count(*) FROM window_due) < $1
               AND EXISTS (
                   SELECT 1 FROM {t} e
                   WHERE e.status IN ('pending', 'in_flight') AND {due_by_time} {hold_e}
                   ORDER BY e.seq
                   OFFSET $1 * 4 - 1 LIMIT 1)
               AND s.status IN ('pending', 'in_flight')
               AND s.seq >= (SELECT min(o.seq) + floor(random() * (max(o.seq) - min(o.seq) + 1))::bigint
                             FROM {t} o WHERE o.status IN ('pending', 'in_flight'))
             ORDER BY s.seq
             LIMIT 1
         ),
         walk (aggregate_type, aggregate_id, n) AS (
             SELECT aggregate_type, aggregate_id, 1 FROM start
             UNION ALL
             SELECT nx.aggregate_type, nx.aggregate_id, w.n + 1 FROM walk w
             CROSS JOIN LATERAL (
                 SELECT x.aggregate_type, x.aggregate_id FROM (
                     (SELECT h.aggregate_type, h.aggregate_id FROM {t} h
                      WHERE h.status NOT IN ('delivered', 'dead')
                        AND (h.aggregate_type, h.aggregate_id) > (w.aggregate_type, w.aggregate_id)
                      ORDER BY h.aggregate_type, h.aggregate_id
                      LIMIT 1)
                     UNION ALL
                     (SELECT h.aggregate_type, h.aggregate_id FROM {t} h
                      WHERE h.status NOT IN ('delivered', 'dead')
                      ORDER BY h.aggregate_type, h.aggregate_id
                      LIMIT 1)
                 ) x
                 LIMIT 1
             ) nx
             WHERE w.n < $1
               AND NOT EXISTS (
                   SELECT 1 FROM start s
                   WHERE s.aggregate_type = nx.aggregate_type AND s.aggregate_id = nx.aggregate_id)
         ),
         heads AS (
             {heads}
         ),
         runs AS (
             {runs}
         ),
         due AS MATERIALIZED (
             SELECT seq, aggregate_type, aggregate_id FROM window_due
             UNION
             SELECT seq, aggregate_type, aggregate_id FROM heads
             UNION
             SELECT seq, aggregate_type, aggregate_id FROM runs
             ORDER BY seq
             LIMIT $1
         ),
         locked AS MATERIALIZED (
             SELECT l.seq, l.payload_bytes, l.metadata_bytes, l.key_bytes FROM due d
             CROSS JOIN LATERAL (
                 SELECT l.seq, {ROW_BYTES} FROM {t} l
                 WHERE l.seq = d.seq
                   AND l.status IN ('pending', 'in_flight')
                   AND {due_on_latest}
                 FOR UPDATE OF l SKIP LOCKED
             ) l
         ),
         -- The byte budget: locked rows in seq order while the rows before them (payload and
         -- every other column) stay under $6 (the first always). What it leaves out comes after
         -- everything it keeps, so no aggregate's later event is claimed without its earlier
         -- one. A row whose payload is above $7, or whose other columns together are above $9,
         -- counts as nothing: it is returned without them (its aggregate key only when the key
         -- alone is within $9) and buried.
         budget AS (
             SELECT x.seq, x.payload_bytes, x.metadata_bytes, x.key_bytes, x.fits FROM (
                 SELECT k.*,
                        sum(CASE WHEN k.fits THEN k.payload_bytes + k.metadata_bytes ELSE 0 END)
                            OVER (ORDER BY k.seq ROWS UNBOUNDED PRECEDING) AS running
                 FROM (SELECT l.*, l.payload_bytes <= $7 AND l.metadata_bytes <= $9 AS fits
                       FROM locked l) k
             ) x
             WHERE x.running - CASE WHEN x.fits THEN x.payload_bytes + x.metadata_bytes ELSE 0 END < $6
         ),
         skipped AS (
             SELECT d.aggregate_type, d.aggregate_id, min(d.seq) AS seq FROM due d
             WHERE NOT EXISTS (SELECT 1 FROM locked k WHERE k.seq = d.seq)
             GROUP BY d.aggregate_type, d.aggregate_id
         )
         UPDATE {t} AS o
         SET status = 'in_flight', lease_owner = $2, lease_token = $3,
             lease_expires_at = statement_timestamp() + $5 * interval '1 millisecond',
             claimed_at = statement_timestamp()
         FROM budget k
         WHERE o.seq = k.seq
           AND NOT EXISTS (
               SELECT 1 FROM skipped s
               WHERE s.aggregate_type = o.aggregate_type AND s.aggregate_id = o.aggregate_id
                 AND s.seq < o.seq)
         RETURNING o.seq, k.payload_bytes, k.metadata_bytes,
                   CASE WHEN k.key_bytes <= $9 THEN o.aggregate_type END AS aggregate_type,
                   CASE WHEN k.key_bytes <= $9 THEN o.aggregate_id END AS aggregate_id,
                   CASE WHEN k.fits THEN o.id END AS id,
                   CASE WHEN k.fits THEN o.event_type END AS event_type,
                   CASE WHEN k.fits THEN o.payload::text END AS payload,
                   pg_typeof(o.payload) IN ('json'::regtype, 'jsonb'::regtype) AS payload_typed,
                   CASE WHEN k.fits THEN o.destination END AS destination,
                   CASE WHEN k.fits THEN o.headers::text END AS headers,
                   CASE WHEN k.fits THEN o.idempotency_key END AS idempotency_key,
                   o.occurred_at, o.enqueued_at, o.attempts"
    )
}

/// Backlog per destination: the route `CASE` (`$1…`) grouped over the undelivered rows (the
/// `_open` partial index) and the dead ones (the `_dead` index). Delivered rows, the bulk of a
/// table kept for retention, are never read.
pub(crate) fn destination_stats_sql(t: &str, route: &str) -> String {
    format!(
        "SELECT x.route,
                count(*) FILTER (WHERE x.status = 'pending') AS pending,
                count(*) FILTER (WHERE x.status = 'pending' AND x.failed) AS retrying,
                count(*) FILTER (WHERE x.status = 'in_flight') AS in_flight,
                count(*) FILTER (WHERE x.status = 'dead') AS dead,
                min(x.enqueued_at) FILTER (WHERE x.status IN ('pending', 'in_flight')) AS oldest,
                -- The newest failed row's error: the greatest zero-padded seq, cut off again (a
                -- running max, no sort of every waiting row's error).
                substr(max(lpad(x.seq::text, 20, '0') || x.last_error)
                    FILTER (WHERE x.status IN ('pending', 'in_flight') AND x.failed), 21) AS last_error
         FROM (
             SELECT COALESCE({route}, '') AS route, e.seq, e.status, e.enqueued_at, e.last_error,
                    (e.attempts > 0 OR e.last_error IS NOT NULL) AS failed
             FROM {t} e WHERE e.status IN ('pending', 'in_flight')
             UNION ALL
             SELECT COALESCE({route}, '') AS route, e.seq, e.status, e.enqueued_at, NULL, false
             FROM {t} e WHERE e.status = 'dead'
         ) x
         GROUP BY x.route"
    )
}

/// One replay step. `$1` after seq, `$2` from, `$3` to, `$4` event type or NULL, `$5` limit;
/// with a destination, `$6` its name and `$7…` the route table's values.
///
/// The page is the first `limit` matching delivered rows after `$1` in seq order (a walk of the
/// primary key: delivered rows have no index of their own, which is what keeps acks cheap). The
/// update re-checks `status` on each row's latest version, so a row purged or changed since the
/// page was read is left alone.
pub(crate) fn replay_sql(t: &str, route: Option<&str>) -> String {
    let destination = route
        .map(|r| format!("AND COALESCE({r}, '') = $6"))
        .unwrap_or_default();
    format!(
        "WITH page AS MATERIALIZED (
             SELECT e.seq FROM {t} e
             WHERE e.status = 'delivered' AND e.seq > $1
               AND e.enqueued_at >= $2 AND e.enqueued_at < $3
               AND ($4::text IS NULL OR e.event_type = $4)
               {destination}
             ORDER BY e.seq
             LIMIT $5
         ),
         done AS (
             UPDATE {t} AS o
             SET status = 'pending', attempts = 0, next_attempt_at = LEAST(o.next_attempt_at, now()), delivered_at = NULL,
                 dead_at = NULL, last_error = NULL,
                 lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL
             FROM page p
             WHERE o.seq = p.seq AND o.status = 'delivered'
             RETURNING o.seq
         )
         SELECT (SELECT count(*) FROM page) AS scanned,
                (SELECT max(seq) FROM page) AS last_seq,
                (SELECT count(*) FROM done) AS replayed"
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::PgOutbox;
    use crate::PgStore;
    use chrono::DateTime;
    use chrono::Utc;
    use outbox_types::ClaimRequest;
    use outbox_types::DeadLetterPolicy;
    use outbox_types::Store;
    use outbox_types::route::SqlDialect;
    use sqlx::AssertSqlSafe;
    use sqlx::PgPool;
    use sqlx::postgres::PgPoolOptions;
    use uuid::Uuid;

    /// The plan of `sql` (with `binds`), as JSON text.
    async fn plan(pool: &PgPool, sql: &str, binds: Vec<PlanArg>) -> String {
        let explain = format!("EXPLAIN (FORMAT JSON) {sql}");
        let mut query = sqlx::query_scalar::<_, serde_json::Value>(AssertSqlSafe(explain.as_str()));
        for b in binds {
            query = match b {
                PlanArg::Int(v) => query.bind(v),
                PlanArg::Bool(v) => query.bind(v),
                PlanArg::Text(v) => query.bind(v),
                PlanArg::Texts(v) => query.bind(v),
                PlanArg::Uuid(v) => query.bind(v),
                PlanArg::Time(v) => query.bind(v),
                PlanArg::NullText => query.bind(None::<String>),
            };
        }
        query.fetch_one(pool).await.unwrap().to_string()
    }

    /// A migrated outbox `events` table in a schema of its own (`outbox_t_<name>_<pid>`),
    /// dropped first if an earlier run left it.
    async fn fresh_outbox(name: &str) -> (PgPool, PgOutbox) {
        let url = std::env::var("OUTBOX_TEST_DATABASE_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
        let pool = PgPoolOptions::new()
            .max_connections(2)
            .connect(&url)
            .await
            .expect("PostgreSQL must be running on 127.0.0.1:5432");
        let schema = format!("outbox_t_{name}_{}", std::process::id());
        let outbox = PgOutbox::with_names(&schema, "events").unwrap();
        sqlx::raw_sql(AssertSqlSafe(format!(
            "DROP SCHEMA IF EXISTS {schema} CASCADE"
        )))
        .execute(&pool)
        .await
        .unwrap();
        outbox.migrate(&pool).await.unwrap();
        (pool, outbox)
    }

    async fn drop_outbox(pool: &PgPool, outbox: &PgOutbox) {
        sqlx::raw_sql(AssertSqlSafe(format!(
            "DROP SCHEMA {} CASCADE",
            outbox.schema()
        )))
        .execute(pool)
        .await
        .unwrap();
    }

    enum PlanArg {
        Int(i64),
        Bool(bool),
        Text(String),
        Texts(Vec<String>),
        Uuid(Uuid),
        Time(DateTime<Utc>),
        NullText,
    }

    /// On a table that is mostly delivered rows (as retention keeps it), with fresh statistics,
    /// the claim (with and without a hold) and the operator statements over undelivered and
    /// dead rows never scan the table: they read the partial indexes.
    #[tokio::test]
    async fn statements_over_open_rows_use_the_partial_indexes() {
        let (pool, outbox) = fresh_outbox("plan").await;
        let t = outbox.qualified_table();
        sqlx::raw_sql(AssertSqlSafe(format!(
            "INSERT INTO {t} (id, aggregate_type, aggregate_id, event_type, payload, status, delivered_at, dead_at, attempts)
             SELECT gen_random_uuid(), 'agg', 'a' || (n % 500), CASE WHEN n % 3 = 0 THEN 'HookSent' ELSE 'Created' END,
                    '{{}}', CASE WHEN n < 49000 THEN 'delivered' WHEN n % 50 = 0 THEN 'dead' ELSE 'pending' END,
                    CASE WHEN n < 49000 THEN now() END, CASE WHEN n >= 49000 AND n % 50 = 0 THEN now() END,
                    CASE WHEN n >= 49000 AND n % 50 = 0 THEN 1 ELSE 0 END
             FROM generate_series(1, 50000) AS n;
             ANALYZE {t};"
        )))
        .execute(&pool)
        .await
        .unwrap();
        let routes = outbox_testkit::hooks_and_kafka();
        let claim_args = || {
            vec![
                PlanArg::Int(200),
                PlanArg::Text("o".into()),
                PlanArg::Uuid(Uuid::nil()),
                PlanArg::Bool(true),
                PlanArg::Int(30_000),
                PlanArg::Int(i64::MAX),
                PlanArg::Int(i64::MAX),
                PlanArg::Int(i64::MAX),
                PlanArg::Int(i64::MAX),
            ]
        };
        let dialect = SqlDialect::Postgres { first_param: 12 };
        let (route_e, route_b, route_d) = (
            routes.sql_case(dialect, Some("e")),
            routes.sql_case(dialect, Some("b")),
            routes.sql_case(dialect, Some("d")),
        );
        let held = claim_sql(
            t,
            Some(&HoldSql {
                route_e: route_e.sql.clone(),
                route_b: route_b.sql.clone(),
                route_d: None,
            }),
        );
        let mut held_args = claim_args();
        held_args.push(PlanArg::Texts(vec!["hooks".into()]));
        held_args.push(PlanArg::Texts(vec![]));
        held_args.extend(route_e.binds.iter().cloned().map(PlanArg::Text));
        let deferred = claim_sql(
            t,
            Some(&HoldSql {
                route_e: route_e.sql.clone(),
                route_b: route_b.sql,
                route_d: Some(route_d.sql),
            }),
        );
        let mut deferred_args = claim_args();
        deferred_args.push(PlanArg::Texts(vec![]));
        deferred_args.push(PlanArg::Texts(vec!["hooks".into()]));
        deferred_args.extend(route_e.binds.iter().cloned().map(PlanArg::Text));
        let stats_route = routes.sql_case(SqlDialect::Postgres { first_param: 1 }, Some("e"));
        let sql = &outbox.inner.sql;
        let checks = vec![
            ("claim", sql.claim.clone(), claim_args()),
            ("claim with a hold", held, held_args),
            ("claim with a deferred destination", deferred, deferred_args),
            (
                "destination stats",
                destination_stats_sql(t, &stats_route.sql),
                stats_route
                    .binds
                    .iter()
                    .cloned()
                    .map(PlanArg::Text)
                    .collect(),
            ),
            ("leases", sql.leases.clone(), vec![]),
            (
                "purge dead",
                sql.purge_dead.clone(),
                vec![PlanArg::Int(1000), PlanArg::Int(100)],
            ),
            (
                "list dead",
                sql.list_dead.clone(),
                vec![PlanArg::Int(0), PlanArg::Int(100)],
            ),
            ("oldest", sql.oldest.clone(), vec![]),
        ];
        for (name, statement, binds) in checks {
            let p = plan(&pool, &statement, binds).await;
            assert!(!p.contains("Seq Scan"), "{name} scans the table: {p}");
            // Any of the partial indexes will do: which one the planner picks for a
            // status filter depends on its estimates (CI once chose `_blockers` for leases).
            assert!(
                [
                    "events_open",
                    "events_blockers",
                    "events_heads",
                    "events_dead"
                ]
                .iter()
                .any(|index| p.contains(index)),
                "{name} reads a partial index: {p}"
            );
        }
        // A replay page walks the primary key from its start seq (delivered rows have no index
        // of their own, by design).
        let replay = plan(
            &pool,
            &replay_sql(t, None),
            vec![
                PlanArg::Int(0),
                PlanArg::Time(Utc::now() - chrono::TimeDelta::hours(1)),
                PlanArg::Time(Utc::now()),
                PlanArg::NullText,
                PlanArg::Int(100),
            ],
        )
        .await;
        assert!(replay.contains("events_pkey"), "{replay}");
        drop_outbox(&pool, &outbox).await;
    }

    /// Buffers one claim touches, from `EXPLAIN (ANALYZE, BUFFERS)`, and how many rows it
    /// claimed; the claim runs in a transaction that is rolled back.
    async fn claim_cost(pool: &PgPool, sql: &str, owner: &str) -> (u64, u64) {
        let mut tx = pool.begin().await.unwrap();
        sqlx::query(CLAIM_SETUP)
            .bind(0_i64)
            .execute(&mut *tx)
            .await
            .unwrap();
        let explain = format!("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {sql}");
        let plan: serde_json::Value = sqlx::query_scalar(AssertSqlSafe(explain.as_str()))
            .bind(100_i64)
            .bind(owner)
            .bind(Uuid::now_v7())
            .bind(true)
            .bind(30_000_i64)
            .bind(i64::MAX)
            .bind(i64::MAX)
            .bind(i64::MAX)
            .bind(i64::MAX)
            .fetch_one(&mut *tx)
            .await
            .unwrap();
        tx.rollback().await.unwrap();
        let top = &plan[0]["Plan"];
        let buffers = top["Shared Hit Blocks"].as_u64().unwrap()
            + top["Shared Read Blocks"].as_u64().unwrap();
        (buffers, top["Actual Rows"].as_u64().unwrap())
    }

    /// Two ways a claim's cost used to grow with the backlog, each checked by comparing a
    /// claim's buffers at a 4k and an 80k backlog:
    ///
    /// - With few aggregates and one relay holding the head of each, another relay's claim finds
    ///   nothing due. Before the `_heads` walk it learnt that by probing every held row in seq
    ///   order (seconds at a 600k backlog in the load profile, holding the claim lock).
    /// - Statistics taken while nothing was open (as autovacuum leaves a drained outbox) made
    ///   the planner lock the due rows through a hash of every open row (claims of 10 s at a
    ///   120k backlog in the load profile). The statistics here are taken once, before any
    ///   open row exists.
    #[tokio::test]
    async fn claim_cost_does_not_grow_with_the_backlog() {
        let (pool, outbox) = fresh_outbox("heads").await;
        let t = outbox.qualified_table().to_owned();
        sqlx::raw_sql(AssertSqlSafe(format!(
            "INSERT INTO {t} (id, aggregate_type, aggregate_id, event_type, payload, status, delivered_at)
             SELECT gen_random_uuid(), 'order', 'o' || (n % 20), 'Created', '{{}}', 'delivered', now()
             FROM generate_series(1, 2000) AS n;
             ANALYZE {t};"
        )))
        .execute(&pool)
        .await
        .unwrap();
        let add = |from: i64, to: i64| {
            sqlx::raw_sql(AssertSqlSafe(format!(
                "INSERT INTO {t} (id, aggregate_type, aggregate_id, event_type, payload)
                 SELECT gen_random_uuid(), 'order', 'o' || (n % 20), 'Created', '{{}}'
                 FROM generate_series({from}, {to}) AS n"
            )))
        };
        let store = PgStore::new(pool.clone(), outbox.clone());
        let claim = outbox.inner.sql.claim.clone();
        // (buffers of relay-b's claim while relay-a holds every head, of one after relay-a's ack)
        let measure = || async {
            let holder = store
                .claim(&ClaimRequest::new(
                    "relay-a",
                    100,
                    std::time::Duration::from_secs(600),
                    DeadLetterPolicy::Block,
                ))
                .await
                .unwrap();
            let held: std::collections::HashSet<&str> = holder
                .events
                .iter()
                .map(|e| e.aggregate_id.as_str())
                .collect();
            assert_eq!(held.len(), 20, "relay-a holds the head of every aggregate");
            let (empty, claimed) = claim_cost(&pool, &claim, "relay-b").await;
            assert_eq!(claimed, 0, "every aggregate is held by relay-a");
            let seqs: Vec<i64> = holder.events.iter().map(|e| e.seq).collect();
            store.ack(&holder.lease, &seqs).await.unwrap();
            let (full, claimed) = claim_cost(&pool, &claim, "relay-b").await;
            assert_eq!(claimed, 100, "after the ack every aggregate goes on");
            (empty, full)
        };
        add(1, 4_000).execute(&pool).await.unwrap();
        let (empty_small, full_small) = measure().await;
        add(4_001, 80_000).execute(&pool).await.unwrap();
        let (empty_large, full_large) = measure().await;
        // Twenty times the rows. A bounded claim stays within about 2x (concurrent tests keep
        // some dead entries from being marked, so it is not exactly flat); each regression
        // above grew 6-20x.
        assert!(
            empty_large < empty_small * 3,
            "an empty claim read {empty_small} buffers at a 4k backlog and {empty_large} at 80k"
        );
        assert!(
            full_large < full_small * 3,
            "a claim of 100 read {full_small} buffers at a 4k backlog and {full_large} at 80k"
        );
        drop_outbox(&pool, &outbox).await;
    }
}
