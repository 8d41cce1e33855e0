//! `outbox inbox migrate|status|purge|parked` with the real binary, on SQLite, PostgreSQL
//! (`OUTBOX_TEST_DATABASE_URL`, its own schema per test) and MySQL/MariaDB
//! (`OUTBOX_TEST_MYSQL_URL`, its own table per test). Rows are claimed with the same SQL a
//! consumer in another language runs, not through the Rust API.

mod common;

use common::{BIN, mysql_url, pg_url, text};
use outbox_testkit::unique;
use std::io::{BufRead, BufReader};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use outbox_inbox::ParkedMessage;
use outbox_inbox::mysql::MySqlInbox;
use outbox_inbox::postgres::PgInbox;
use outbox_inbox::sqlite::SqliteInbox;
use serde_json::Value;

fn outbox(args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .env("OUTBOX_LOG", "warn")
        .env_remove("OUTBOX_DATABASE__URL")
        .env_remove("OUTBOX_INBOX__DATABASE_URL")
        .output()
        .expect("runs")
}

fn json_of(o: &Output) -> Value {
    assert!(o.status.success(), "{}", text(o));
    serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{e}: {}", text(o)))
}

#[tokio::test]
async fn sqlite_inbox_is_migrated_shown_purged_and_its_parked_messages_listed() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("consumer.db").display());
    let db = ["--database-url", url.as_str(), "--table", "inbox"];

    // migrate creates the file and the tables, and says which claim to run.
    let out = outbox(&[&["inbox", "migrate"], &db[..]].concat());
    assert!(out.status.success(), "{}", text(&out));
    common::assert_contains(&text(&out), "applied migrations [1]");
    common::assert_contains(&text(&out), "INSERT INTO \"inbox\"");
    let again = json_of(&outbox(
        &[&["inbox", "migrate", "--json"], &db[..]].concat(),
    ));
    assert_eq!(again["applied"], serde_json::json!([]));

    // Three claims with the documented statement, one of them two days old; two parked.
    let pool = sqlx::SqlitePool::connect(&url).await.unwrap();
    let inbox = SqliteInbox::with_table("inbox").unwrap();
    for handler in ["billing", "billing", "delivery"] {
        let done = sqlx::query(sqlx::AssertSqlSafe(inbox.claim_statement().to_owned()))
            .bind(uuid::Uuid::now_v7().to_string())
            .bind(handler)
            .execute(&pool)
            .await
            .unwrap();
        assert_eq!(done.rows_affected(), 1);
    }
    sqlx::query("UPDATE inbox SET processed_at = processed_at - 172800000000 WHERE rowid = 1")
        .execute(&pool)
        .await
        .unwrap();
    for n in 0..2u8 {
        let p = ParkedMessage::new(
            None,
            "orders",
            vec![b'x', n],
            3,
            format!("boom\x1b[31m {n}"),
        );
        inbox.park(&pool, "billing", &p).await.unwrap();
    }

    let status = json_of(&outbox(
        &[
            &["inbox", "status", "--json", "--older-than", "1d"],
            &db[..],
        ]
        .concat(),
    ));
    assert_eq!(status["rows"], 3, "{status}");
    assert_eq!(status["past_retention"], 1, "{status}");
    assert_eq!(status["parked_total"], 2, "{status}");
    assert_eq!(status["handlers"][0]["handler"], "billing", "{status}");
    assert_eq!(status["handlers"][0]["rows"], 2, "{status}");
    let human = outbox(&[&["inbox", "status"], &db[..]].concat());
    common::assert_contains(&text(&human), "parked: 2");

    // The parked list escapes what a message could use to drive the terminal.
    let list = outbox(&[&["inbox", "parked"], &db[..]].concat());
    assert!(list.status.success(), "{}", text(&list));
    assert!(!text(&list).contains('\x1b'), "{}", text(&list));
    let listed = json_of(&outbox(
        &[
            &["inbox", "parked", "--json", "--handler", "billing"],
            &db[..],
        ]
        .concat(),
    ));
    assert_eq!(listed.as_array().unwrap().len(), 2);
    let id = listed[1]["id"].as_i64().unwrap().to_string();
    let shown = json_of(&outbox(
        &[&["inbox", "parked", "show", id.as_str(), "--json"], &db[..]].concat(),
    ));
    assert_eq!(shown["payload"], "x\u{1}");
    assert_eq!(shown["attempts"], 3);
    let missing = outbox(&[&["inbox", "parked", "show", "999"], &db[..]].concat());
    assert_eq!(missing.status.code(), Some(1), "{}", text(&missing));
    common::assert_contains(&text(&missing), "no parked message with id 999");

    // Purge: only the row past the window, in batches of one.
    let purged = json_of(&outbox(
        &[
            &[
                "inbox",
                "purge",
                "--older-than",
                "1d",
                "--batch-size",
                "1",
                "--json",
            ],
            &db[..],
        ]
        .concat(),
    ));
    assert_eq!(purged["deleted"], 1, "{purged}");
    let purged = json_of(&outbox(&[&["inbox", "purge", "--json"], &db[..]].concat()));
    assert_eq!(purged["deleted"], 0, "the 7-day default keeps today's rows");
    assert_eq!(purged["older_than"], "7d");
}

/// The config file's `[inbox]` names the inbox; its `database_url` wins over `[database]`,
/// and `outbox config check` prints it with the password masked.
#[tokio::test]
async fn postgres_inbox_from_the_relay_config_with_its_own_database_url() {
    let schema = unique("outbox_t_inbox");
    let dir = tempfile::tempdir().unwrap();
    let config = common::write_config(
        dir.path(),
        &format!(
            "[database]\nurl = \"sqlite://{}\"\n\n[inbox]\ndatabase_url = \"{}\"\nschema = \"{schema}\"\ntable = \"inbox\"\nretention = \"1h\"\nbatch_size = 2\n",
            dir.path().join("outbox.db").display(),
            pg_url()
        ),
    );
    let config = config.to_str().unwrap();

    // Not migrated yet: exit 2 naming the fix.
    let before = outbox(&["inbox", "status", "--config", config]);
    common::exits_2_saying(&before, "outbox inbox migrate");

    let migrated = json_of(&outbox(&["inbox", "migrate", "--config", config, "--json"]));
    assert_eq!(migrated["applied"], serde_json::json!([1, 2, 3]));
    assert_eq!(
        migrated["claim"].as_str().unwrap().split("  --").next(),
        Some(format!("SELECT \"{schema}\".\"inbox_claim\"(event_id, handler)").as_str())
    );

    let pool = sqlx::PgPool::connect(&pg_url()).await.unwrap();
    let inbox = PgInbox::with_names(&schema, "inbox").unwrap();
    let claim = format!("SELECT {}($1, $2)", inbox.claim_function());
    for n in 0..5 {
        let fresh: bool = sqlx::query_scalar(sqlx::AssertSqlSafe(claim.clone()))
            .bind(uuid::Uuid::now_v7())
            .bind(if n < 4 { "billing" } else { "shipping" })
            .fetch_one(&pool)
            .await
            .unwrap();
        assert!(fresh);
    }
    common::pg_execute(
        &pool,
        format!(
            "UPDATE {} SET processed_at = now() - interval '2 hours' WHERE handler = 'billing'",
            inbox.qualified_table()
        ),
    )
    .await;
    let p = ParkedMessage::new(None, "orders", b"{}".to_vec(), 1, "no outbox-event-id");
    inbox.park(&pool, "shipping", &p).await.unwrap();

    let status = json_of(&outbox(&["inbox", "status", "--config", config, "--json"]));
    assert_eq!(status["schema_version"], 3, "{status}");
    assert_eq!(status["retention"], "1h", "{status}");
    assert_eq!(status["rows"], 5, "{status}");
    assert_eq!(status["past_retention"], 4, "{status}");
    assert_eq!(status["parked"][0]["handler"], "shipping", "{status}");

    let purged = json_of(&outbox(&["inbox", "purge", "--config", config, "--json"]));
    assert_eq!(purged["deleted"], 4, "{purged}");
    let parked = json_of(&outbox(&["inbox", "parked", "--config", config, "--json"]));
    assert_eq!(parked[0]["error"], "no outbox-event-id", "{parked}");

    // config check shows [inbox], with the URL's password masked.
    let secret = std::fs::read_to_string(config)
        .unwrap()
        .replace("postgres://postgres@", "postgres://postgres:inboxsecret@");
    std::fs::write(config, secret).unwrap();
    let check = outbox(&["config", "check", "--config", config]);
    assert!(check.status.success(), "{}", text(&check));
    common::assert_contains(&text(&check), "[inbox]");
    assert!(!text(&check).contains("inboxsecret"), "{}", text(&check));

    common::drop_pg_schema(&pool, &schema).await;
}

#[tokio::test]
async fn mysql_inbox_is_migrated_and_its_claim_procedure_counted() {
    let table = unique("inbox_t");
    let url = mysql_url();
    let db = ["--database-url", url.as_str(), "--table", table.as_str()];
    let migrated = json_of(&outbox(
        &[&["inbox", "migrate", "--json"], &db[..]].concat(),
    ));
    assert_eq!(migrated["applied"], serde_json::json!([1, 2, 3]));
    let pool = sqlx::MySqlPool::connect(&url).await.unwrap();
    let inbox = MySqlInbox::with_table(&table).unwrap();
    let id = uuid::Uuid::now_v7().to_string();
    for expected in [1i64, 0] {
        let fresh: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "CALL {}(?, 'billing')",
            inbox.claim_procedure()
        )))
        .bind(&id)
        .fetch_one(&pool)
        .await
        .unwrap();
        assert_eq!(fresh, expected);
    }
    let status = json_of(&outbox(&[&["inbox", "status", "--json"], &db[..]].concat()));
    assert_eq!(status["rows"], 1, "{status}");
    assert_eq!(status["handlers"][0]["handler"], "billing", "{status}");
    let purged = json_of(&outbox(
        &[&["inbox", "purge", "--older-than", "0s", "--json"], &db[..]].concat(),
    ));
    assert_eq!(purged["deleted"], 1, "{purged}");
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "DROP PROCEDURE {p}; DROP TABLE `{table}`, `{table}_parked`, `{table}_migrations`",
        p = inbox.claim_procedure()
    )))
    .execute(&pool)
    .await
    .unwrap();
}

/// `purge --every` is the retention loop a deployment runs: a run at once and at every
/// interval, until SIGTERM, which it obeys with exit 0.
#[tokio::test]
async fn purge_every_runs_until_sigterm() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("loop.db").display());
    let out = outbox(&["inbox", "migrate", "--database-url", &url]);
    assert!(out.status.success(), "{}", text(&out));
    let mut child = Command::new(BIN)
        .args([
            "inbox",
            "purge",
            "--database-url",
            &url,
            "--older-than",
            "1h",
            "--every",
            "1s",
            "--json",
        ])
        .env("OUTBOX_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let started = Instant::now();
    for run in 0..2 {
        let line = lines.next().unwrap().unwrap();
        let v: Value = serde_json::from_str(&line).unwrap();
        assert_eq!(v["deleted"], 0, "run {run}: {line}");
    }
    assert!(started.elapsed() >= Duration::from_millis(800));
    common::signal(&child, "-TERM");
    let status = child.wait().unwrap();
    assert!(status.success(), "{status}");
}

#[test]
fn an_inbox_command_without_a_database_says_where_to_set_one() {
    let out = outbox(&["inbox", "status"]);
    common::exits_2_saying(&out, "inbox.database_url");
    let out = outbox(&[
        "inbox",
        "status",
        "--database-url",
        "sqlite://x.db",
        "--table",
        "Bad",
    ]);
    common::exits_2_saying(&out, "invalid `[inbox]`");
}
