//! Rows are checked when they are written, not only when the relay claims them: a writer that
//! inserts by hand may leave out `id` (a UUID v7 default), and headers that are not a JSON
//! object of strings, or that use the reserved `outbox-` prefix, fail the writer's own
//! transaction with a message naming the header. Both layouts, an upgrade of an outbox that
//! already holds bad rows, and the Rust enqueue refusing the same names before the database
//! does.

mod common;

use outbox_postgresql::{PgOutbox, PgStore};
use outbox_store_tests::{seqs_of, sqlstate, state_of, write_checks_claim};
use outbox_types::{DeadFilter, EventState, NewEvent, Store};
use sqlx::{AssertSqlSafe, PgPool};

/// Headers no writer may store, with the message that says why.
const BAD_HEADERS: [(&str, &str); 6] = [
    (
        r#"{"a": "1", "retry": 3}"#,
        r#"header "retry" is not a string"#,
    ),
    (r#"{"a": {"b": "c"}}"#, r#"header "a" is not a string"#),
    (r#"{"a": null}"#, r#"header "a" is not a string"#),
    (r#"["x"]"#, "headers must be a JSON object of strings"),
    (r#""x""#, "headers must be a JSON object of strings"),
    (
        r#"{"ok": "1", "outbox-x": "v"}"#,
        r#"header "outbox-x" uses the prefix outbox-"#,
    ),
];

/// A hand-written insert into `outbox`'s events table alone, `id` left out, returning the id the
/// row got: the plain layout's contract.
fn insert_plain(outbox: &PgOutbox) -> String {
    format!(
        "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload, headers)
         VALUES ('order', '42', 'OrderPlaced', '{{\"total\": 10}}', $1::jsonb) RETURNING id",
        outbox.qualified_table()
    )
}

/// A hand-written insert through the keys table, as the partitioned layout's contract says
/// (docs/table-contract.md): the keys row first, then the event with the id and `enqueued_at`
/// it got; returns the id.
fn insert_through_keys(outbox: &PgOutbox) -> String {
    format!(
        "WITH k AS (INSERT INTO {} DEFAULT VALUES RETURNING id, enqueued_at)
         INSERT INTO {} (id, aggregate_type, aggregate_id, event_type, payload, headers, enqueued_at)
         SELECT k.id, 'order', '42', 'OrderPlaced', '{{\"total\": 10}}', $1::jsonb, k.enqueued_at FROM k
         RETURNING id",
        outbox.keys_table(),
        outbox.qualified_table()
    )
}

/// Run `insert` (one of the two above) with `headers`, returning the id the row got.
async fn run_insert(
    executor: impl sqlx::PgExecutor<'_>,
    insert: String,
    headers: &str,
) -> Result<uuid::Uuid, sqlx::Error> {
    sqlx::query_scalar(AssertSqlSafe(insert))
        .bind(headers)
        .fetch_one(executor)
        .await
}

/// The hand-written insert of `outbox`'s layout.
async fn insert(
    executor: impl sqlx::PgExecutor<'_>,
    outbox: &PgOutbox,
    headers: &str,
) -> Result<uuid::Uuid, sqlx::Error> {
    let sql = if outbox.partitioning().is_some() {
        insert_through_keys(outbox)
    } else {
        insert_plain(outbox)
    };
    run_insert(executor, sql, headers).await
}

/// The tables of `outbox` that carry its header trigger (the partitions, for the partitioned
/// layout, each with the clone of the partitioned table's).
async fn tables_with_trigger(pool: &PgPool, outbox: &PgOutbox) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT c.relname::text FROM pg_trigger g JOIN pg_class c ON c.oid = g.tgrelid
         JOIN pg_namespace n ON n.oid = c.relnamespace
         WHERE n.nspname = $1 AND g.tgname = $2 ORDER BY 1",
    )
    .bind(outbox.schema())
    .bind(format!("{}_header_rules", outbox.table()))
    .fetch_all(pool)
    .await
    .unwrap()
}

async fn omitted_id_gets_a_v7_uuid(store: PgStore) {
    let id = insert(store.pool(), store.outbox(), "{}").await.unwrap();
    assert_eq!(id.get_version_num(), 7, "a time-ordered id: {id}");
    let ms = u64::from_be_bytes([
        0,
        0,
        id.as_bytes()[0],
        id.as_bytes()[1],
        id.as_bytes()[2],
        id.as_bytes()[3],
        id.as_bytes()[4],
        id.as_bytes()[5],
    ]);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    assert!(now.abs_diff(ms) < 60_000, "its time is now: {ms} vs {now}");
    assert_eq!(id.as_bytes()[8] >> 6, 0b10, "RFC 4122 variant: {id}");
    let other = insert(store.pool(), store.outbox(), "{}").await.unwrap();
    assert_ne!(id, other);
    // The relay reads the row like any other.
    let record = store
        .get(outbox_types::EventId::from_uuid(id))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(record.state, EventState::Pending);
    if store.outbox().partitioning().is_some() {
        // The event table has no default of its own: an event's id is its keys row's.
        let err = run_insert(store.pool(), insert_plain(store.outbox()), "{}")
            .await
            .unwrap_err();
        assert_eq!(sqlstate(&err), "23502", "NOT NULL: {err}");
        outbox_testkit::assert_mentions(&err, "\"id\"");
    }
}

common::both_layouts! {
    omitted_id_gets_a_v7_uuid:
        an_insert_without_id_gets_a_time_ordered_uuid,
        a_partitioned_insert_without_id_gets_a_time_ordered_uuid_from_the_keys_table;
}

/// Every bad header fails the writer's insert inside its transaction, naming the header, and
/// takes the business change down with it; `outbox-partition` is stored and read back.
async fn bad_headers_fail_the_writers_transaction(store: PgStore) {
    if store.outbox().partitioning().is_some() {
        // The trigger fires on the default partition and on the dated ones the relay creates.
        let tables = tables_with_trigger(store.pool(), store.outbox()).await;
        assert!(tables.len() >= 3, "{tables:?}");
        assert!(tables.contains(&"events_default".to_owned()), "{tables:?}");
    }
    let schema = store.outbox().schema().to_owned();
    sqlx::query(AssertSqlSafe(format!(
        "CREATE TABLE \"{schema}\".orders (id INT PRIMARY KEY)"
    )))
    .execute(store.pool())
    .await
    .unwrap();
    for (n, (headers, what)) in BAD_HEADERS.iter().enumerate() {
        let mut tx = store.pool().begin().await.unwrap();
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO \"{schema}\".orders (id) VALUES ($1)"
        )))
        .bind(n as i32)
        .execute(&mut *tx)
        .await
        .unwrap();
        let err = insert(&mut *tx, store.outbox(), headers)
            .await
            .expect_err(headers);
        assert_eq!(sqlstate(&err), "23514", "{headers}: {err}");
        assert!(err.to_string().contains(what), "{headers}: {err}");
        // The transaction is aborted: the writer cannot commit its business change without
        // the event.
        let next = sqlx::query("SELECT 1").execute(&mut *tx).await.unwrap_err();
        assert_eq!(sqlstate(&next), "25P02", "{next}");
        drop(tx);
    }
    let orders: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT count(*) FROM \"{schema}\".orders"
    )))
    .fetch_one(store.pool())
    .await
    .unwrap();
    assert_eq!(orders, 0, "every business change rolled back");
    assert_eq!(store.stats().await.unwrap().pending, 0);

    // The one reserved name the relay stores itself, beside a writer's own header.
    let id = insert(
        store.pool(),
        store.outbox(),
        r#"{"outbox-partition": "3", "tenant": "acme", "Outbox-Case": "upper is not reserved"}"#,
    )
    .await
    .unwrap();
    let claim = store.claim(&write_checks_claim()).await.unwrap();
    assert_eq!(claim.events.len(), 1, "{claim:?}");
    let event = &claim.events[0];
    assert_eq!(*event.id.as_uuid(), id);
    assert_eq!(event.headers["outbox-partition"], "3");
    assert_eq!(event.headers["tenant"], "acme");
    store.ack(&claim.lease, &[event.seq]).await.unwrap();
}

common::both_layouts! {
    bad_headers_fail_the_writers_transaction:
        bad_headers_fail_the_writers_insert_with_the_rule_in_the_message,
        bad_headers_fail_the_writers_insert_in_the_partitioned_layout;
}

/// The enqueue function names the reserved header itself (22023, like its other checks).
#[tokio::test]
async fn the_enqueue_function_names_a_reserved_header() {
    for store in [
        common::fresh_store().await,
        common::fresh_partitioned_store(outbox_postgresql::Partitioning::default()).await,
    ] {
        let function = format!(
            "{}_enqueue\"",
            store.outbox().qualified_table().trim_end_matches('"')
        );
        let err = sqlx::query_scalar::<_, uuid::Uuid>(AssertSqlSafe(format!(
            "SELECT {function}('a', '1', 'T', '{{}}', headers => '{{\"ok\": \"1\", \"outbox-event-id\": \"forged\"}}')"
        )))
        .fetch_one(store.pool())
        .await
        .unwrap_err();
        assert_eq!(sqlstate(&err), "22023", "{err}");
        outbox_testkit::assert_mentions(
            &err,
            r#"header "outbox-event-id" uses the prefix outbox-"#,
        );
        let id: uuid::Uuid = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT {function}('a', '1', 'T', '{{}}', headers => '{{\"outbox-partition\": \"2\"}}')"
        )))
        .fetch_one(store.pool())
        .await
        .unwrap();
        assert_eq!(id.get_version_num(), 7);
    }
}

/// The Rust enqueue refuses the reserved names before anything reaches the database.
#[tokio::test]
async fn the_library_refuses_a_reserved_header_before_the_database_does() {
    for writer in common::PgWriter::both() {
        outbox_store_tests::the_library_refuses_a_reserved_header_before_the_database_does(&writer)
            .await;
    }
}

/// Back to the schema before the header check, as an outbox of the previous release has it.
async fn downgrade(pool: &PgPool, outbox: &PgOutbox, version: i64) {
    let (s, t) = (outbox.schema(), outbox.table());
    let id_default = if outbox.partitioning().is_some() {
        format!(
            "ALTER TABLE {} ALTER COLUMN id DROP DEFAULT;",
            outbox.keys_table()
        )
    } else {
        format!("ALTER TABLE \"{s}\".\"{t}\" ALTER COLUMN id DROP DEFAULT;")
    };
    sqlx::raw_sql(AssertSqlSafe(format!(
        "{id_default}
         DROP TRIGGER {t}_header_rules ON \"{s}\".\"{t}\";
         DROP FUNCTION \"{s}\".\"{t}_check_headers\"();
         DELETE FROM \"{s}\".\"{t}_migrations\" WHERE version >= {version};"
    )))
    .execute(pool)
    .await
    .unwrap();
}

/// An outbox of the previous release that holds rows the check refuses upgrades all the same:
/// new rows are checked at once, while the relay still claims, dead-letters and delivers the
/// old rows, an operator requeues them, and a writer's duplicate idempotency key still finds
/// an old row (the trigger looks at inserts and at updates that set headers, nothing else). An
/// operator's correction of an old row's headers is checked.
async fn upgrades_with_bad_rows(store: PgStore) {
    let (pool, outbox) = (store.pool().clone(), store.outbox().clone());
    // The header check's migration in each layout.
    let version = if outbox.partitioning().is_some() {
        5
    } else {
        6
    };
    let t = outbox.qualified_table().to_owned();
    downgrade(&pool, &outbox, version).await;
    assert!(tables_with_trigger(&pool, &outbox).await.is_empty());
    // A number where a string belongs, a reserved name with an idempotency key, and a dead row
    // dead-lettered long ago.
    let number = NewEvent::new("old", "1", "Old", &1).unwrap();
    let reserved = NewEvent::new("old", "2", "Old", &2)
        .unwrap()
        .with_idempotency_key("old-2");
    let dead = NewEvent::new("old", "3", "Old", &3).unwrap();
    for e in [&number, &reserved, &dead] {
        outbox.enqueue(&pool, e).await.unwrap();
    }
    for (e, headers, extra) in [
        (&number, r#"{"retry": 3}"#, ""),
        (&reserved, r#"{"outbox-tenant": "acme"}"#, ""),
        (
            &dead,
            r#"{"retry": 3}"#,
            ", status = 'dead', dead_at = now(), last_error = 'unreadable'",
        ),
    ] {
        sqlx::query(AssertSqlSafe(format!(
            "UPDATE {t} SET headers = $2::jsonb{extra} WHERE id = $1"
        )))
        .bind(e.id().as_uuid())
        .bind(headers)
        .execute(&pool)
        .await
        .unwrap();
    }

    let report = outbox.migrate(&pool).await.unwrap();
    // The header check's migration, and the one after it (least privilege).
    assert_eq!(report.applied, vec![version, version + 1]);
    assert!(!tables_with_trigger(&pool, &outbox).await.is_empty());
    // New rows are checked.
    let err = insert(store.pool(), store.outbox(), r#"{"retry": 3}"#)
        .await
        .unwrap_err();
    assert_eq!(sqlstate(&err), "23514", "{err}");
    let id_default = insert(store.pool(), store.outbox(), "{}").await.unwrap();
    assert_eq!(id_default.get_version_num(), 7);
    // A writer's retry of the old keyed event finds it, as before.
    let again = outbox
        .enqueue(&pool, &reserved_twin(&reserved))
        .await
        .unwrap();
    assert_eq!((again.id, again.created), (reserved.id(), false));

    // The relay goes on with the old rows: the unreadable one is dead-lettered at claim, the
    // reserved name is delivered (and never sent), the old dead row can be requeued.
    let claim = store.claim(&write_checks_claim()).await.unwrap();
    assert_eq!(claim.buried, 1, "{claim:?}");
    let seqs = seqs_of(&claim.events);
    assert_eq!(
        claim.events.len(),
        2,
        "the reserved one and the new one: {claim:?}"
    );
    store.ack(&claim.lease, &seqs).await.unwrap();
    assert_eq!(state_of(&store, number.id()).await, EventState::Dead);
    assert_eq!(state_of(&store, reserved.id()).await, EventState::Delivered);
    let requeued = store
        .requeue_dead(&DeadFilter::Ids(vec![dead.id(), number.id()]))
        .await
        .unwrap();
    assert_eq!(requeued, 2);
    // Correcting headers by hand is checked; a correct value is taken and delivered.
    let fix = |id: uuid::Uuid, headers: &'static str| {
        let (pool, t) = (pool.clone(), t.clone());
        async move {
            sqlx::query(AssertSqlSafe(format!(
                "UPDATE {t} SET headers = $2::jsonb WHERE id = $1"
            )))
            .bind(id)
            .bind(headers)
            .execute(&pool)
            .await
        }
    };
    let err = fix(*number.id().as_uuid(), r#"{"retry": 4}"#)
        .await
        .unwrap_err();
    outbox_testkit::assert_mentions(&err, r#"header "retry" is not a string"#);
    fix(*number.id().as_uuid(), r#"{"retry": "4"}"#)
        .await
        .unwrap();
    fix(*dead.id().as_uuid(), r#"{"retry": "3"}"#)
        .await
        .unwrap();
    let claim = store.claim(&write_checks_claim()).await.unwrap();
    assert_eq!((claim.events.len(), claim.buried), (2, 0), "{claim:?}");
}

/// The same event again (same id and key), as a writer's retry sends it.
fn reserved_twin(e: &NewEvent) -> NewEvent {
    NewEvent::new("old", "2", "Old", &2)
        .unwrap()
        .with_id(e.id())
        .with_idempotency_key("old-2")
}

common::both_layouts! {
    upgrades_with_bad_rows:
        an_outbox_with_bad_rows_upgrades_and_the_relay_still_settles_them,
        a_partitioned_outbox_with_bad_rows_upgrades_and_the_relay_still_settles_them;
}

/// The script for other migration tools gives the trigger too, and migrate finds it current.
#[tokio::test]
async fn the_schema_script_creates_the_trigger() {
    for outbox in [
        PgOutbox::with_names(&common::unique_schema(), "events").unwrap(),
        PgOutbox::partitioned(
            &common::unique_schema(),
            "events",
            outbox_postgresql::Partitioning::default(),
        )
        .unwrap(),
    ] {
        let pool = common::pool(2).await;
        sqlx::raw_sql(AssertSqlSafe(outbox.schema_script()))
            .execute(&pool)
            .await
            .unwrap();
        assert_eq!(
            tables_with_trigger(&pool, &outbox)
                .await
                .first()
                .map(String::as_str),
            Some("events")
        );
        let report = outbox.migrate(&pool).await.unwrap();
        assert!(report.applied.is_empty(), "{report:?}");
    }
}
