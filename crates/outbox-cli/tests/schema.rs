//! `outbox schema print`: the script, applied by another tool to a database without the outbox,
//! gives the same catalog as `outbox migrate` (tables, columns, defaults, constraints, indexes,
//! triggers, functions), and `outbox migrate` then finds the schema current: a team that applies
//! schema changes with Flyway, Liquibase, Alembic or psql can run the relay on it.

mod common;

use common::{BIN, mysql_url, pg_url};
use std::process::Command;

use sqlx::{AssertSqlSafe, Row};

/// Run `outbox` with `args`; its stdout, or a panic with its stderr.
/// Apply `script` with psql as a DBA would: stop at the first error, which fails the test.
fn psql(script: &str) {
    let applied = Command::new("psql")
        .args([&pg_url(), "-v", "ON_ERROR_STOP=1", "-q", "-X"])
        .arg("-c")
        .arg(script)
        .output()
        .unwrap();
    common::assert_succeeded(&applied, "psql");
}

fn outbox(args: &[&str]) -> String {
    let out = Command::new(BIN)
        .args(args)
        .env("NO_COLOR", "1")
        .output()
        .unwrap();
    common::assert_succeeded(&out, &format!("outbox {args:?}"));
    String::from_utf8(out.stdout).unwrap()
}

/// Everything PostgreSQL's catalog says about the objects in `schema`, with the schema's name
/// replaced so two schemas compare.
async fn pg_catalog(pool: &sqlx::PgPool, schema: &str) -> Vec<String> {
    let rows = sqlx::query(
        "SELECT 'relation ' || c.relname || ' ' || c.relkind::text AS line
         FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = $1
         UNION ALL
         SELECT 'column ' || c.relname || '.' || a.attname || ' ' || format_type(a.atttypid, a.atttypmod)
                || CASE WHEN a.attnotnull THEN ' not null' ELSE '' END
                || COALESCE(' default ' || pg_get_expr(d.adbin, d.adrelid), '')
                || CASE WHEN a.attidentity <> '' THEN ' identity ' || a.attidentity::text ELSE '' END
         FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid
         JOIN pg_namespace n ON n.oid = c.relnamespace
         LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
         WHERE n.nspname = $1 AND a.attnum > 0 AND NOT a.attisdropped AND c.relkind IN ('r', 'p')
         UNION ALL
         SELECT 'constraint ' || c.relname || ' ' || k.conname || ' ' || pg_get_constraintdef(k.oid)
         FROM pg_constraint k JOIN pg_class c ON c.oid = k.conrelid
         JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = $1
         UNION ALL
         SELECT 'index ' || pg_get_indexdef(i.indexrelid)
         FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
         JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = $1
         UNION ALL
         SELECT 'trigger ' || c.relname || ' ' || pg_get_triggerdef(t.oid)
         FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid
         JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = $1 AND NOT t.tgisinternal
         UNION ALL
         SELECT 'function ' || pg_get_functiondef(p.oid)
         FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace WHERE n.nspname = $1
         UNION ALL
         SELECT 'storage ' || c.relname || ' ' || array_to_string(c.reloptions, ',')
         FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
         WHERE n.nspname = $1 AND c.reloptions IS NOT NULL",
    )
    .bind(schema)
    .fetch_all(pool)
    .await
    .unwrap();
    let mut lines: Vec<String> = rows
        .iter()
        .map(|r| r.get::<String, _>("line").replace(schema, "<schema>"))
        .collect();
    lines.sort();
    lines
}

async fn drop_pg_schemas(pool: &sqlx::PgPool, schemas: &[&str]) {
    for schema in schemas {
        common::drop_pg_schema_if_exists(pool, schema).await;
    }
}

#[tokio::test]
async fn the_postgres_script_gives_what_migrate_gives() {
    let pool = sqlx::PgPool::connect(&pg_url()).await.unwrap();
    let (scripted, migrated) = (
        format!("outbox_t_script_{}", std::process::id()),
        format!("outbox_t_migrated_{}", std::process::id()),
    );
    drop_pg_schemas(&pool, &[&scripted, &migrated]).await;
    let script = outbox(&[
        "schema",
        "print",
        "--dialect",
        "postgres",
        "--schema",
        &scripted,
    ]);
    // Applied by psql, as a DBA would: stop at the first error.
    psql(&script);
    let url = pg_url();
    let said = outbox(&["migrate", "--database-url", &url, "--schema", &scripted]);
    common::assert_contains(&said, "schema is current");
    outbox(&["migrate", "--database-url", &url, "--schema", &migrated]);
    let (a, b) = (
        pg_catalog(&pool, &scripted).await,
        pg_catalog(&pool, &migrated).await,
    );
    assert!(a.len() > 30, "the catalog query found the outbox: {a:?}");
    assert_eq!(a, b);
    drop_pg_schemas(&pool, &[&scripted, &migrated]).await;
}

/// With the stream table among WAL mode's sources, the script also creates it, and psql
/// applies the whole script.
#[tokio::test]
async fn the_postgres_script_includes_the_stream_table_when_wal_mode_reads_it() {
    let pool = sqlx::PgPool::connect(&pg_url()).await.unwrap();
    let schema = format!("outbox_t_script_stream_{}", std::process::id());
    drop_pg_schemas(&pool, &[&schema]).await;
    let (_dir, config) = common::temp_config(&format!(
        "mode = \"wal\"\n{}[wal]\nsources = [\"table\", \"stream_table\"]\n",
        common::pg_database(&schema)
    ));
    let script = outbox(&["schema", "print", "--config", config.to_str().unwrap()]);
    common::assert_contains(&script, "events_stream");
    psql(&script);
    let exists: Option<String> = sqlx::query_scalar("SELECT to_regclass($1)::text")
        .bind(format!("\"{schema}\".events_stream"))
        .fetch_one(&pool)
        .await
        .unwrap();
    assert!(exists.is_some());
    // Polling mode has no stream table.
    let polling = outbox(&[
        "schema",
        "print",
        "--dialect",
        "postgres",
        "--schema",
        &schema,
    ]);
    assert!(!polling.contains("events_stream"));
    drop_pg_schemas(&pool, &[&schema]).await;
}

#[tokio::test]
async fn the_partitioned_postgres_script_is_current_for_migrate() {
    let pool = sqlx::PgPool::connect(&pg_url()).await.unwrap();
    let schema = format!("outbox_t_script_part_{}", std::process::id());
    drop_pg_schemas(&pool, &[&schema]).await;
    let script = outbox(&[
        "schema",
        "print",
        "--dialect",
        "postgres",
        "--layout",
        "partitioned",
        "--schema",
        &schema,
    ]);
    assert!(
        script.contains("PARTITION BY RANGE (enqueued_at)"),
        "{script}"
    );
    common::pg_execute(&pool, script).await;
    let (_dir, config) = common::temp_config(&format!(
        "{}layout = \"partitioned\"\n",
        common::pg_database(&schema)
    ));
    let said = outbox(&["migrate", "--config", config.to_str().unwrap()]);
    common::assert_contains(&said, "schema is current");
    drop_pg_schemas(&pool, &[&schema]).await;
}

#[tokio::test]
async fn the_sqlite_script_gives_what_migrate_gives() {
    let dir = tempfile::tempdir().unwrap();
    let (scripted, migrated) = (
        dir.path().join("scripted.db"),
        dir.path().join("migrated.db"),
    );
    let script = outbox(&["schema", "print", "--dialect", "sqlite"]);
    let url = |path: &std::path::Path| format!("sqlite://{}?mode=rwc", path.display());
    let pool = sqlx::SqlitePool::connect(&url(&scripted)).await.unwrap();
    sqlx::raw_sql(AssertSqlSafe(script))
        .execute(&pool)
        .await
        .unwrap();
    let said: serde_json::Value = serde_json::from_str(&outbox(&[
        "migrate",
        "--json",
        "--database-url",
        &url(&scripted),
    ]))
    .unwrap();
    assert_eq!(said["already_current"], true, "{said}");
    assert_eq!(said["applied"], serde_json::json!([]), "{said}");
    let said: serde_json::Value = serde_json::from_str(&outbox(&[
        "migrate",
        "--json",
        "--database-url",
        &url(&migrated),
    ]))
    .unwrap();
    assert_eq!(said["already_current"], false, "{said}");
    let other = sqlx::SqlitePool::connect(&url(&migrated)).await.unwrap();
    let catalog = |pool: sqlx::SqlitePool| async move {
        let rows = sqlx::query(
            "SELECT type || ' ' || name || ' ' || COALESCE(sql, '') AS line FROM sqlite_master ORDER BY name",
        )
        .fetch_all(&pool)
        .await
        .unwrap();
        rows.iter()
            .map(|r| r.get::<String, _>("line"))
            .collect::<Vec<_>>()
    };
    let (a, b) = (catalog(pool).await, catalog(other).await);
    assert!(a.len() > 5, "{a:?}");
    assert_eq!(a, b);
}

#[tokio::test]
async fn the_mariadb_script_gives_what_migrate_gives() {
    let pool = sqlx::MySqlPool::connect(&mysql_url()).await.unwrap();
    let version: String = sqlx::query_scalar("SELECT VERSION()")
        .fetch_one(&pool)
        .await
        .unwrap();
    let dialect = if version.to_ascii_lowercase().contains("mariadb") {
        "mariadb"
    } else {
        "mysql"
    };
    let (scripted, migrated) = (
        format!("t_script_{}", std::process::id()),
        format!("t_migrated_{}", std::process::id()),
    );
    let tables = |name: &str| {
        [
            name.to_owned(),
            format!("{name}_paused"),
            format!("{name}_migrations"),
        ]
    };
    let drop = |name: String| {
        let pool = pool.clone();
        async move {
            for table in tables(&name) {
                sqlx::raw_sql(AssertSqlSafe(format!("DROP TABLE IF EXISTS `{table}`")))
                    .execute(&pool)
                    .await
                    .unwrap();
            }
            for procedure in ["_enqueue", "_enqueue_batch"] {
                sqlx::raw_sql(AssertSqlSafe(format!(
                    "DROP PROCEDURE IF EXISTS `{name}{procedure}`"
                )))
                .execute(&pool)
                .await
                .unwrap();
            }
        }
    };
    drop(scripted.clone()).await;
    drop(migrated.clone()).await;
    let script = outbox(&[
        "schema",
        "print",
        "--dialect",
        dialect,
        "--table",
        &scripted,
    ]);
    // One statement at a time, as the mysql client runs it (its DELIMITER lines included).
    for statement in outbox_types::sql_script::statements(&script) {
        sqlx::raw_sql(AssertSqlSafe(statement))
            .execute(&pool)
            .await
            .unwrap();
    }
    let url = mysql_url();
    let said = outbox(&["migrate", "--database-url", &url, "--table", &scripted]);
    common::assert_contains(&said, "schema is current");
    outbox(&["migrate", "--database-url", &url, "--table", &migrated]);
    for (a, b) in tables(&scripted).into_iter().zip(tables(&migrated)) {
        let show = |table: String, name: String| {
            let pool = pool.clone();
            async move {
                let row = sqlx::query(AssertSqlSafe(format!("SHOW CREATE TABLE `{table}`")))
                    .fetch_one(&pool)
                    .await
                    .unwrap();
                let ddl: String = row.get(1);
                // The AUTO_INCREMENT counter is data, not schema.
                ddl.replace(&table, "<table>")
                    .replace(&name, "<name>")
                    .split(' ')
                    .filter(|w| !w.starts_with("AUTO_INCREMENT="))
                    .collect::<Vec<_>>()
                    .join(" ")
            }
        };
        assert_eq!(
            show(a, scripted.clone()).await,
            show(b, migrated.clone()).await
        );
    }
    // `SHOW CREATE <kind> <name><suffix>` with the table's name masked, for both databases.
    let show_create = |kind: &'static str, suffix: &'static str, name: String| {
        let pool = pool.clone();
        async move {
            let row = sqlx::query(AssertSqlSafe(format!(
                "SHOW CREATE {kind} `{name}{suffix}`"
            )))
            .fetch_one(&pool)
            .await
            .unwrap();
            let ddl: String = row.get(2);
            ddl.replace(&name, "<name>")
        }
    };
    let (a, b) = (
        show_create("PROCEDURE", "_enqueue", scripted.clone()).await,
        show_create("PROCEDURE", "_enqueue", migrated.clone()).await,
    );
    common::assert_contains(&a, "CREATE DEFINER");
    assert_eq!(a, b);
    // The library's batch procedure (migration 6).
    let (a, b) = (
        show_create("PROCEDURE", "_enqueue_batch", scripted.clone()).await,
        show_create("PROCEDURE", "_enqueue_batch", migrated.clone()).await,
    );
    common::assert_contains(&a, "PROCEDURE `<name>_enqueue_batch`");
    assert_eq!(a, b);
    // The insert trigger that checks headers (migration 4).
    let (a, b) = (
        show_create("TRIGGER", "_headers_insert", scripted.clone()).await,
        show_create("TRIGGER", "_headers_insert", migrated.clone()).await,
    );
    common::assert_contains(&a, "BEFORE INSERT");
    assert_eq!(a, b);
    drop(scripted).await;
    drop(migrated).await;
}
