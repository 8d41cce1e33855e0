//! What a writer's role can do with the grants docs/table-contract.md gives it ("Privileges"):
//! `USAGE` on the schema, `INSERT` on the outbox table (and the keys table of the partitioned
//! layout) and `EXECUTE` on the enqueue functions. It enqueues every way there is (the
//! function, a plain `INSERT`, the Rust library), with the idempotency key working as
//! documented, and it cannot read, lock or change another service's events. And no function the
//! migrations install can be made to run someone else's code: each pins its `search_path`.

mod common;

use outbox_postgresql::PgStore;
use outbox_store_tests::sqlstate;
use outbox_testkit::numbered;
use outbox_types::{EventState, NewEvent, Store};
use sqlx::{AssertSqlSafe, PgConnection, PgPool, Postgres, Transaction};

/// A role (cluster-wide, so with a unique name) dropped with everything it owns at the end.
struct Role {
    name: String,
    pool: PgPool,
}

impl Role {
    async fn create(pool: &PgPool, prefix: &str) -> Role {
        let name = outbox_testkit::unique(prefix);
        execute(pool, format!("CREATE ROLE {name} NOLOGIN")).await;
        Role {
            name,
            pool: pool.clone(),
        }
    }

    async fn remove(self) {
        execute(
            &self.pool,
            format!("DROP OWNED BY {0} CASCADE; DROP ROLE {0}", self.name),
        )
        .await;
    }
}

async fn execute(pool: &PgPool, sql: String) {
    sqlx::raw_sql(AssertSqlSafe(sql.clone()))
        .execute(pool)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
}

/// A transaction on `pool` running as `role` (`SET LOCAL ROLE`: the test's own login is a
/// superuser; the role's rights are all the transaction has).
async fn as_role(pool: &PgPool, role: &str) -> Transaction<'static, Postgres> {
    let mut tx = pool.begin().await.unwrap();
    sqlx::raw_sql(AssertSqlSafe(format!("SET LOCAL ROLE {role}")))
        .execute(&mut *tx)
        .await
        .unwrap();
    tx
}

/// `sql` run as `role` in a transaction of its own, committed when it succeeds.
async fn run_as(pool: &PgPool, role: &str, sql: &str) -> Result<(), sqlx::Error> {
    let mut tx = as_role(pool, role).await;
    sqlx::raw_sql(AssertSqlSafe(sql.to_owned()))
        .execute(&mut *tx)
        .await?;
    tx.commit().await
}

/// The signatures of the two enqueue functions, for GRANT and `has_function_privilege`.
fn functions(store: &PgStore) -> [String; 2] {
    let (s, t) = (store.outbox().schema(), store.outbox().table());
    [
        format!(
            "\"{s}\".\"{t}_enqueue\"(TEXT, TEXT, TEXT, JSON, JSONB, TEXT, TEXT, TIMESTAMPTZ, UUID)"
        ),
        format!(
            "\"{s}\".\"{t}_enqueue_batch\"(UUID[], TEXT[], TEXT[], TEXT[], TEXT[], TEXT[], TEXT[], TEXT[], TIMESTAMPTZ[])"
        ),
    ]
}

/// The writer's grants, exactly as docs/table-contract.md lists them (the partitioned layout's
/// plain INSERT also writes the keys table and draws `seq` from the layout's sequence).
async fn grant_writer(store: &PgStore, role: &str) {
    let outbox = store.outbox();
    let (s, t) = (outbox.schema(), outbox.table());
    let mut inserts = outbox.qualified_table().to_owned();
    let mut sequence = String::new();
    if outbox.partitioning().is_some() {
        inserts.push_str(&format!(", {}", outbox.keys_table()));
        sequence = format!("GRANT USAGE ON SEQUENCE \"{s}\".\"{t}_seq\" TO {role};");
    }
    let [enqueue, batch] = functions(store);
    execute(
        store.pool(),
        format!(
            "GRANT USAGE ON SCHEMA \"{s}\" TO {role};
             GRANT INSERT ON {inserts} TO {role};
             {sequence}
             GRANT EXECUTE ON FUNCTION {enqueue}, {batch} TO {role};"
        ),
    )
    .await;
}

/// A writer with `INSERT` and `EXECUTE` only enqueues through the function, a plain `INSERT`
/// and the Rust library, and a duplicate idempotency key resolves to the existing event as
/// documented; it cannot read, lock, change or delete any row. Before, the function needed
/// `SELECT (id, idempotency_key)` and `UPDATE (idempotency_key)`: a writer without them could not
/// call it with a key, and one with them could hold and rewrite other services' events.
async fn a_writer_needs_insert_and_execute_only(store: PgStore) {
    let pool = store.pool().clone();
    let outbox = store.outbox().clone();
    let t = outbox.qualified_table().to_owned();
    let [enqueue, _] = functions(&store);
    let enqueue = enqueue.split('(').next().unwrap_or_default().to_owned();
    let writer = Role::create(&pool, "outbox_t_writer").await;
    let w = writer.name.as_str();
    grant_writer(&store, w).await;
    // Another service's event, with a key.
    let other = numbered("other", 1).with_idempotency_key("other-1");
    common::enqueue_committed(&store, std::slice::from_ref(&other)).await;

    // The function, with and without a key; the key again gives the same id.
    let mut tx = as_role(&pool, w).await;
    let call = |args: &str| format!("SELECT {enqueue}({args})");
    let mine: uuid::Uuid = sqlx::query_scalar(AssertSqlSafe(call(
        "'order', '1', 'Placed', '{}', idempotency_key => 'mine-1'",
    )))
    .fetch_one(&mut *tx)
    .await
    .unwrap();
    let again: uuid::Uuid = sqlx::query_scalar(AssertSqlSafe(call(
        "'order', '1', 'Placed', '{}', idempotency_key => 'mine-1'",
    )))
    .fetch_one(&mut *tx)
    .await
    .unwrap();
    assert_eq!(mine, again, "a key already there: the first event's id");
    let _: uuid::Uuid = sqlx::query_scalar(AssertSqlSafe(call("'order', '2', 'Placed', '{}'")))
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    // Another service's key: its event's id comes back (as documented), nothing is written.
    let theirs: uuid::Uuid = sqlx::query_scalar(AssertSqlSafe(call(
        "'order', '3', 'Placed', '{}', idempotency_key => 'other-1'",
    )))
    .fetch_one(&mut *tx)
    .await
    .unwrap();
    assert_eq!(theirs, *other.id().as_uuid());
    // The Rust library, keyed and not, the keyed one twice.
    let keyed = numbered("order", 4).with_idempotency_key("mine-4");
    let done = outbox.enqueue(&mut *tx, &keyed).await.unwrap();
    assert_eq!((done.id, done.created), (keyed.id(), true));
    let done = outbox.enqueue(&mut *tx, &keyed).await.unwrap();
    assert_eq!((done.id, done.created), (keyed.id(), false));
    let done = outbox
        .enqueue_batch(
            &mut *tx,
            &[
                numbered("order", 5),
                numbered("order", 6).with_idempotency_key("other-1"),
            ],
        )
        .await
        .unwrap();
    assert!(done[0].created);
    assert_eq!((done[1].id, done[1].created), (other.id(), false));
    tx.commit().await.unwrap();

    // A plain INSERT, as the contract writes it; a taken key with ON CONFLICT DO NOTHING is a
    // no-op, without it an error.
    let plain = if outbox.partitioning().is_some() {
        let id = uuid::Uuid::now_v7();
        format!(
            "INSERT INTO {keys} (id) VALUES ('{id}');
             INSERT INTO {t} (id, aggregate_type, aggregate_id, event_type, payload)
             VALUES ('{id}', 'order', '7', 'Placed', '{{}}');",
            keys = outbox.keys_table()
        )
    } else {
        format!(
            "INSERT INTO {t} (aggregate_type, aggregate_id, event_type, payload)
             VALUES ('order', '7', 'Placed', '{{}}');
             INSERT INTO {t} (aggregate_type, aggregate_id, event_type, payload, idempotency_key)
             VALUES ('order', '8', 'Placed', '{{}}', 'other-1') ON CONFLICT DO NOTHING;"
        )
    };
    run_as(&pool, w, &plain).await.unwrap();
    let taken = if outbox.partitioning().is_some() {
        format!(
            "INSERT INTO {} (idempotency_key) VALUES ('other-1')",
            outbox.keys_table()
        )
    } else {
        format!(
            "INSERT INTO {t} (aggregate_type, aggregate_id, event_type, payload, idempotency_key)
             VALUES ('order', '9', 'Placed', '{{}}', 'other-1')"
        )
    };
    let err = run_as(&pool, w, &taken).await.unwrap_err();
    assert_eq!(sqlstate(&err), "23505", "{err}");

    // Nothing of anyone's can be read, locked, changed or deleted.
    let mut forbidden = vec![
        format!("SELECT id, idempotency_key FROM {t}"),
        format!("SELECT 1 FROM {t} WHERE idempotency_key = 'other-1' FOR UPDATE"),
        format!("SELECT 1 FROM {t} FOR SHARE"),
        format!("UPDATE {t} SET idempotency_key = 'stolen' WHERE idempotency_key = 'other-1'"),
        format!("UPDATE {t} SET payload = '{{}}', destination = 'evil'"),
        format!("DELETE FROM {t}"),
    ];
    if let Some(_partitioning) = outbox.partitioning() {
        let k = outbox.keys_table();
        forbidden.push(format!("SELECT id, idempotency_key FROM {k}"));
        forbidden.push(format!("SELECT 1 FROM {k} FOR UPDATE"));
        forbidden.push(format!("UPDATE {k} SET idempotency_key = 'stolen'"));
        forbidden.push(format!("DELETE FROM {k}"));
        forbidden.push(format!(
            "INSERT INTO {k} DEFAULT VALUES RETURNING id, enqueued_at"
        ));
        forbidden.push(format!(
            "INSERT INTO {k} (idempotency_key) VALUES ('other-1')
             ON CONFLICT (idempotency_key) WHERE idempotency_key IS NOT NULL DO UPDATE SET idempotency_key = 'x'"
        ));
    } else {
        forbidden.push(format!(
            "INSERT INTO {t} (aggregate_type, aggregate_id, event_type, payload) VALUES ('a', 'b', 'c', '{{}}') RETURNING id"
        ));
        forbidden.push(format!(
            "INSERT INTO {t} (aggregate_type, aggregate_id, event_type, payload, idempotency_key)
             VALUES ('a', 'b', 'c', '{{}}', 'other-1')
             ON CONFLICT (idempotency_key) WHERE idempotency_key IS NOT NULL DO UPDATE SET idempotency_key = 'x'"
        ));
    }
    for sql in forbidden {
        let err = run_as(&pool, w, &sql).await.unwrap_err();
        assert_eq!(sqlstate(&err), "42501", "{sql}: {err}");
    }

    // The other service's event is as it was, and everything written is there once.
    let record = store.get(other.id()).await.unwrap().unwrap();
    assert_eq!(record.state, EventState::Pending);
    assert_eq!(record.event.idempotency_key.as_deref(), Some("other-1"));
    assert_eq!(store.stats().await.unwrap().pending, 6);
    writer.remove().await;
}

common::both_layouts! {
    a_writer_needs_insert_and_execute_only:
        a_writer_with_insert_and_execute_enqueues_and_cannot_touch_other_rows,
        a_writer_with_insert_and_execute_enqueues_and_cannot_touch_other_rows_in_the_partitioned_layout;
}

/// The enqueue functions run as their owner, so calling them is a right of its own: not
/// PUBLIC's (a role with nothing but `USAGE` on the schema gets SQLSTATE 42501), given by the
/// upgrade to every role that could insert into the outbox table before it.
async fn execute_is_granted_to_writers_only(store: PgStore) {
    let pool = store.pool().clone();
    let outbox = store.outbox().clone();
    let [enqueue, batch] = functions(&store);
    let reader = Role::create(&pool, "outbox_t_reader").await;
    let old_writer = Role::create(&pool, "outbox_t_old_writer").await;
    let schema = outbox.schema();
    execute(
        &pool,
        format!(
            "GRANT USAGE ON SCHEMA \"{schema}\" TO {0}, {1};
             GRANT INSERT ON {2} TO {1};
             DELETE FROM \"{schema}\".\"{3}_migrations\"
             WHERE version = (SELECT max(version) FROM \"{schema}\".\"{3}_migrations\");",
            reader.name,
            old_writer.name,
            outbox.qualified_table(),
            outbox.table()
        ),
    )
    .await;
    // The upgrade runs again with a writer of the previous release present.
    let report = outbox.migrate(&pool).await.unwrap();
    assert_eq!(report.applied.len(), 1, "{report:?}");
    for (role, allowed) in [(&reader.name, false), (&old_writer.name, true)] {
        for f in [&enqueue, &batch] {
            let can: bool = sqlx::query_scalar("SELECT has_function_privilege($1, $2, 'EXECUTE')")
                .bind(role)
                .bind(f)
                .fetch_one(&pool)
                .await
                .unwrap();
            assert_eq!(can, allowed, "{role} on {f}");
        }
    }
    let name = enqueue.split('(').next().unwrap_or_default();
    let err = run_as(
        &pool,
        &reader.name,
        &format!("SELECT {name}('order', '1', 'Placed', '{{}}')"),
    )
    .await
    .unwrap_err();
    assert_eq!(sqlstate(&err), "42501", "{err}");
    run_as(
        &pool,
        &old_writer.name,
        &format!("SELECT {name}('order', '1', 'Placed', '{{}}', idempotency_key => 'k')"),
    )
    .await
    .unwrap();
    reader.remove().await;
    old_writer.remove().await;
}

common::both_layouts! {
    execute_is_granted_to_writers_only:
        the_enqueue_functions_are_not_public_and_old_writers_keep_them,
        the_enqueue_functions_are_not_public_and_old_writers_keep_them_in_the_partitioned_layout;
}

/// Every function the migrations install (the header trigger's, the enqueue functions, and any
/// added later), read from the catalog, pins `search_path`: none runs with the caller's.
async fn every_routine_pins_its_search_path(store: PgStore) {
    let routines: Vec<(String, Option<Vec<String>>)> = sqlx::query_as(
        "SELECT p.oid::regprocedure::text, p.proconfig FROM pg_proc p
         WHERE p.pronamespace = $1::regnamespace ORDER BY 1",
    )
    .bind(format!("\"{}\"", store.outbox().schema()))
    .fetch_all(store.pool())
    .await
    .unwrap();
    assert!(routines.len() >= 3, "{routines:?}");
    for (routine, config) in &routines {
        assert!(
            config
                .iter()
                .flatten()
                .any(|c| c == "search_path=pg_catalog, pg_temp"),
            "{routine} does not pin search_path: {config:?}"
        );
    }
}

common::both_layouts! {
    every_routine_pins_its_search_path:
        every_installed_routine_pins_search_path,
        every_installed_routine_pins_search_path_in_the_partitioned_layout;
}

/// A fresh database of its own (dropped by [`Database::remove`]): what a test that creates
/// objects in `public` needs, so that no other test's session sees them.
struct Database {
    name: String,
    admin: PgPool,
    pool: PgPool,
}

impl Database {
    async fn create() -> Database {
        let admin = common::pool(2).await;
        let name = outbox_testkit::unique("outbox_t_db");
        execute(&admin, format!("CREATE DATABASE {name}")).await;
        let url = common::database_url();
        let base = url.rsplit_once('/').map(|(b, _)| b).unwrap_or(&url);
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(4)
            .connect(&format!("{base}/{name}"))
            .await
            .unwrap();
        Database { name, admin, pool }
    }

    async fn remove(self) {
        self.pool.close().await;
        execute(
            &self.admin,
            format!("DROP DATABASE {} WITH (FORCE)", self.name),
        )
        .await;
    }
}

/// Issue 41, item 6: a writer with CREATE on `public` defines `public.jsonb_path_exists(jsonb,
/// text)`. The header trigger's unqualified call preferred it to the built-in (an unknown
/// literal matches `text` first) and ran it as whoever wrote a row, the relay included; and
/// the fake, answering "no violation", let any headers in. With the pinned search_path the
/// fake never runs and the headers are checked.
async fn a_function_planted_in_public_never_runs(layout: &str) {
    let db = Database::create().await;
    let pool = db.pool.clone();
    let schema = "outbox";
    let outbox = if layout == "partitioned" {
        outbox_postgresql::PgOutbox::partitioned(
            schema,
            "events",
            outbox_postgresql::Partitioning::default(),
        )
        .unwrap()
    } else {
        outbox_postgresql::PgOutbox::with_names(schema, "events").unwrap()
    };
    outbox.migrate(&pool).await.unwrap();
    let attacker = Role::create(&db.admin, "outbox_t_attacker").await;
    let a = attacker.name.as_str();
    execute(
        &pool,
        format!(
            "CREATE TABLE public.ran_as (who TEXT);
             GRANT INSERT ON public.ran_as TO PUBLIC;
             GRANT CREATE ON SCHEMA public TO {a};
             SET ROLE {a};
             CREATE FUNCTION public.jsonb_path_exists(jsonb, text) RETURNS boolean
             LANGUAGE sql AS $$ INSERT INTO public.ran_as VALUES (current_user); SELECT false $$;
             RESET ROLE;"
        ),
    )
    .await;
    // The relay's role (here the owner) writes a row, as WAL mode writes a rejected event back;
    // its search_path is the default one, which holds `public`.
    let event = NewEvent::new("order", "1", "Placed", &1).unwrap();
    let mut conn: sqlx::pool::PoolConnection<Postgres> = pool.acquire().await.unwrap();
    let c: &mut PgConnection = &mut conn;
    let key = NewEvent::new("order", "1", "Paid", &2)
        .unwrap()
        .with_idempotency_key("k");
    outbox.enqueue(&mut *c, &event).await.unwrap();
    outbox.enqueue(&mut *c, &key).await.unwrap();
    let keys = if layout == "partitioned" {
        "WITH k AS (INSERT INTO outbox.events_keys DEFAULT VALUES RETURNING id, enqueued_at)
         INSERT INTO outbox.events (id, aggregate_type, aggregate_id, event_type, payload, headers, enqueued_at)
         SELECT k.id, 'a', 'b', 'c', '{}', '{\"retry\": 3}', k.enqueued_at FROM k"
            .to_owned()
    } else {
        "INSERT INTO outbox.events (aggregate_type, aggregate_id, event_type, payload, headers)
         VALUES ('a', 'b', 'c', '{}', '{\"retry\": 3}')"
            .to_owned()
    };
    let err = sqlx::raw_sql(AssertSqlSafe(keys))
        .execute(&mut *c)
        .await
        .unwrap_err();
    assert_eq!(sqlstate(&err), "23514", "the headers are checked: {err}");
    let ran: Vec<String> = sqlx::query_scalar("SELECT who FROM public.ran_as")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert!(ran.is_empty(), "the planted function ran as {ran:?}");
    drop(conn);
    // The database first: the attacker's function and its right on `public` live there.
    db.remove().await;
    attacker.remove().await;
}

#[tokio::test]
async fn a_function_planted_in_public_never_runs_in_the_trigger() {
    a_function_planted_in_public_never_runs("plain").await;
}

#[tokio::test]
async fn a_function_planted_in_public_never_runs_in_the_trigger_in_the_partitioned_layout() {
    a_function_planted_in_public_never_runs("partitioned").await;
}

/// Issue 41, item 10: a writer's own search_path, naming a schema of its own with look-alikes
/// of the functions the header trigger calls, let it store a header the trigger must refuse
/// (a forged `outbox-event-id`). With the pinned search_path its look-alikes are never seen.
async fn the_writers_search_path_cannot_bypass_the_header_trigger(store: PgStore) {
    let pool = store.pool().clone();
    let outbox = store.outbox().clone();
    let writer = Role::create(&pool, "outbox_t_bypass").await;
    let w = writer.name.as_str();
    grant_writer(&store, w).await;
    let own = format!("{w}_own");
    execute(
        &pool,
        format!(
            "CREATE SCHEMA {own} AUTHORIZATION {w};
             SET ROLE {w};
             CREATE FUNCTION {own}.jsonb_typeof(jsonb) RETURNS text LANGUAGE sql AS $$ SELECT 'object' $$;
             CREATE FUNCTION {own}.jsonb_path_exists(jsonb, text) RETURNS boolean LANGUAGE sql AS $$ SELECT false $$;
             RESET ROLE;"
        ),
    )
    .await;
    let forged = r#"{"outbox-event-id": "forged"}"#;
    let insert = if outbox.partitioning().is_some() {
        let id = uuid::Uuid::now_v7();
        format!(
            "SET LOCAL search_path = {own}, pg_catalog;
             INSERT INTO {keys} (id) VALUES ('{id}');
             INSERT INTO {t} (id, aggregate_type, aggregate_id, event_type, payload, headers)
             VALUES ('{id}', 'order', '1', 'Placed', '{{}}', '{forged}');",
            keys = outbox.keys_table(),
            t = outbox.qualified_table()
        )
    } else {
        format!(
            "SET LOCAL search_path = {own}, pg_catalog;
             INSERT INTO {t} (aggregate_type, aggregate_id, event_type, payload, headers)
             VALUES ('order', '1', 'Placed', '{{}}', '{forged}');",
            t = outbox.qualified_table()
        )
    };
    let err = run_as(&pool, w, &insert).await.unwrap_err();
    assert_eq!(sqlstate(&err), "23514", "{err}");
    outbox_testkit::assert_mentions(&err, "outbox-event-id");
    assert_eq!(store.stats().await.unwrap().pending, 0);
    execute(&pool, format!("DROP SCHEMA {own} CASCADE")).await;
    writer.remove().await;
}

common::both_layouts! {
    the_writers_search_path_cannot_bypass_the_header_trigger:
        a_writers_search_path_cannot_bypass_the_header_trigger,
        a_writers_search_path_cannot_bypass_the_header_trigger_in_the_partitioned_layout;
}
