//! The `outbox` binary as an operator meets it: exit codes and messages for bad input, migrate
//! and status against real databases, and the demo's end-to-end check.

mod common;

use common::{BIN, exits_2_saying, outbox, pg_url};
use std::process::{Command, Output};

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// `outbox --log-format json relay --drain FLAGS… --config CONFIG` logging at info, which must
/// succeed; what it logged (stderr): the relay's structured log, read line by line.
fn drained_json_log(config: &std::path::Path, flags: &[&str]) -> String {
    let o = Command::new(BIN)
        .args(["--log-format", "json", "relay", "--drain"])
        .args(flags)
        .arg("--config")
        .arg(config)
        .env("OUTBOX_LOG", "info")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    stderr(&o)
}

/// The first of the JSON log `lines` whose message contains `text`.
fn log_line<'a>(lines: &'a [serde_json::Value], text: &str) -> &'a serde_json::Value {
    lines
        .iter()
        .find(|l| l["message"].as_str().unwrap_or("").contains(text))
        .unwrap_or_else(|| panic!("no `{text}` line in {lines:?}"))
}

#[test]
fn unknown_config_key_exits_2_naming_the_key() {
    let o = common::relay_with_config(
        "[database]\nurl = \"sqlite://x.db\"\n[relay]\npoll_intervl = \"1s\"\n",
    );
    exits_2_saying(&o, "unknown key `relay.poll_intervl`");
    let err = stderr(&o);
    common::assert_contains(&err, "did you mean `poll_interval`?");
    assert_eq!(err.trim().lines().count(), 1, "one clear line: {err}");
}

#[test]
fn bad_duration_exits_2_naming_the_flag() {
    let o = outbox(&[
        "relay",
        "--database-url",
        "sqlite://x.db",
        "--poll-interval",
        "soon",
    ]);
    exits_2_saying(&o, "invalid --poll-interval");
}

#[test]
fn unreachable_database_exits_2_naming_the_url_without_its_password() {
    // `outbox status` on `url`, which exits 2: what it said.
    let refused = |url: &str| {
        let o = outbox(&["status", "--database-url", url]);
        assert_eq!(o.status.code(), Some(2));
        stderr(&o)
    };
    let err = refused("postgres://app:s3cret@127.0.0.1:1/app");
    common::assert_contains(&err, "postgres://app:***@127.0.0.1:1/app");
    assert!(!err.contains("s3cret"), "{err}");
    assert!(err.contains("refused") || err.contains("connect"), "{err}");
    // A password given as a query parameter is masked as well.
    let err = refused("postgres://app@127.0.0.1:1/app?password=qu3ry&sslmode=disable");
    assert!(!err.contains("qu3ry"), "{err}");
    common::assert_contains(&err, "password=***&sslmode=disable");
}

#[test]
fn unsupported_url_and_missing_url_exit_2() {
    let o = outbox(&["status", "--database-url", "mongodb://root@127.0.0.1/test"]);
    exits_2_saying(&o, "unsupported `database.url`");
    let o = Command::new(BIN)
        .args(["status"])
        .env_remove("OUTBOX_DATABASE__URL")
        .output()
        .unwrap();
    exits_2_saying(&o, "no database URL");
}

#[test]
fn relay_on_an_unmigrated_database_says_to_migrate() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("fresh.db").display());
    let o = outbox(&["relay", "--database-url", &url, "--drain"]);
    exits_2_saying(&o, "outbox migrate");
}

#[test]
fn migrate_relay_and_status_on_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("o.db").display());
    let o = outbox(&["migrate", "--database-url", &url]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains("applied migrations"));
    let again = outbox(&["migrate", "--database-url", &url]);
    assert!(String::from_utf8_lossy(&again.stdout).contains("schema is current"));
    let o = outbox(&["status", "--database-url", &url, "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let status: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(status["pending"], 0);
    let o = outbox(&["relay", "--database-url", &url, "--drain"]);
    assert!(o.status.success(), "{}", stderr(&o));
}

#[test]
fn migrate_and_status_on_postgres() {
    let schema = format!("outbox_t_cli_{}", std::process::id());
    let o = outbox(&["migrate", "--database-url", &pg_url(), "--schema", &schema]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = outbox(&["status", "--database-url", &pg_url(), "--schema", &schema]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = String::from_utf8_lossy(&o.stdout);
    common::assert_contains(&text, "pending     0");
}

#[test]
fn demo_delivers_exactly_the_committed_events() {
    demo_delivers_exactly_the_committed_events_with(&[]);
}

/// The same run with every task on the main thread said explicitly (`--worker-threads 1`, the
/// default: a current-thread runtime) and on a pool of three workers; 0 threads is refused as a
/// usage error.
#[test]
fn demo_delivers_exactly_the_committed_events_on_one_thread_or_three() {
    demo_delivers_exactly_the_committed_events_with(&["--worker-threads", "1"]);
    demo_delivers_exactly_the_committed_events_with(&["--worker-threads", "3"]);
    let o = Command::new(BIN)
        .args(["status", "--database-url", "sqlite::memory:"])
        .env("OUTBOX_WORKER_THREADS", "0")
        .output()
        .unwrap();
    exits_2_saying(&o, "worker-threads");
}

fn demo_delivers_exactly_the_committed_events_with(threads: &[&str]) {
    let dir = tempfile::tempdir().unwrap();
    let o = outbox(
        &[
            threads,
            &[
                "demo",
                "--quiet",
                "--orders",
                "300",
                "--rate",
                "0",
                "--dir",
                dir.path().to_str().unwrap(),
            ],
        ]
        .concat(),
    );
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{out}\n{}", stderr(&o));
    common::assert_contains(&out, "orders created            300");
    common::assert_contains(&out, "lost                      0");
    common::assert_contains(&out, "phantom (no such order)   0");
    common::assert_contains(&out, "per-order order broken    0");
    common::assert_contains(&out, "result                    OK");
    for db in ["orders.db", "delivery.db", "billing.db"] {
        assert!(dir.path().join(db).exists(), "{db} kept in --dir");
    }
}

#[test]
fn config_check_prints_the_effective_config_with_secrets_masked() {
    let (_dir, file) = common::temp_config(
        "[database]\nurl = \"postgres://app:hunter2@db:5432/app\"\n[relay]\nbatch_size = 42\n",
    );
    let o = Command::new(BIN)
        .args(["config", "check", "--config", file.to_str().unwrap()])
        .env("OUTBOX_RELAY__LEASE", "45s")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    common::assert_contains(&out, "batch_size = 42");
    assert!(
        out.contains("lease = \"45s\""),
        "environment layer applied: {out}"
    );
    common::assert_contains(&out, "app:***@db");
    assert!(!out.contains("hunter2"), "{out}");
    std::fs::write(
        &file,
        "[database]\nurl = \"x\"\n[destinations.log]\ntype = \"file\"\npth = \"/tmp/x\"\n",
    )
    .unwrap();
    let o = outbox(&["config", "check", "--config", file.to_str().unwrap()]);
    exits_2_saying(&o, "pth");
}

/// `config check` refuses exactly what `migrate` refuses about the outbox's names and layout,
/// with the same message, on every database: one validator for both. A valid name passes both.
#[test]
fn config_check_and_migrate_refuse_the_same_outbox_names() {
    let dir = tempfile::tempdir().unwrap();
    let sqlite = format!(
        "sqlite://{}?mode=rwc",
        dir.path().join("names.db").display()
    );
    let mysql = common::mysql_url();
    let pg = pg_url();
    let long = "t".repeat(70);
    let cases: Vec<(&str, String, &str)> = vec![
        (
            pg.as_str(),
            "table = \"Bad-Name\"".into(),
            "table `Bad-Name`",
        ),
        (pg.as_str(), format!("table = \"{long}\""), "at most 48"),
        (
            pg.as_str(),
            "schema = \"x; drop\"".into(),
            "schema `x; drop`",
        ),
        (
            sqlite.as_str(),
            "table = \"Bad-Name\"".into(),
            "table `Bad-Name`",
        ),
        (
            mysql.as_str(),
            "table = \"bad name\"".into(),
            "table `bad name`",
        ),
        (
            sqlite.as_str(),
            "layout = \"partitioned\"".into(),
            "PostgreSQL layout",
        ),
    ];
    for (url, line, says) in cases {
        let (_dir, file) = common::temp_config(&format!("[database]\nurl = \"{url}\"\n{line}\n"));
        let file = file.to_str().unwrap();
        let check = outbox(&["config", "check", "--config", file]);
        exits_2_saying(&check, says);
        let migrate = outbox(&["migrate", "--config", file]);
        exits_2_saying(&migrate, says);
        let first = |o: &Output| stderr(o).lines().last().unwrap_or_default().to_owned();
        assert_eq!(
            first(&check),
            first(&migrate),
            "{line}: one validator, one message"
        );
    }
    let (_dir, file) = common::temp_config(&format!(
        "[database]\nurl = \"{sqlite}\"\ntable = \"fine_name_2\"\n"
    ));
    let file = file.to_str().unwrap();
    common::assert_succeeded(&outbox(&["config", "check", "--config", file]), "check");
    common::assert_succeeded(&outbox(&["migrate", "--config", file]), "migrate");
}

#[test]
fn the_example_config_passes_config_check() {
    let example = concat!(env!("CARGO_MANIFEST_DIR"), "/../../outbox.example.toml");
    let o = outbox(&["config", "check", "--config", example]);
    assert!(o.status.success(), "{}", stderr(&o));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_relay_and_status_work_on_mysql() {
    let url = common::mysql_url();
    let table = format!("ob_t_cli_{}", std::process::id());
    let o = outbox(&["migrate", "--database-url", &url, "--table", &table]);
    assert!(o.status.success(), "{}", stderr(&o));
    let store = outbox_mysql::MySqlStore::connect(
        &url,
        outbox_mysql::MySqlOutbox::with_table(&table).unwrap(),
    )
    .await
    .unwrap();
    let mut tx = store.pool().begin().await.unwrap();
    for n in 0..20u32 {
        let e = outbox_types::NewEvent::new(
            "order",
            format!("o{}", n % 4),
            "OrderUpdated",
            &serde_json::json!({ "n": n }),
        )
        .unwrap();
        store.outbox().enqueue(&mut *tx, &e).await.unwrap();
    }
    tx.commit().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out.jsonl");
    let sink = format!("file:{}", out.display());
    let o = outbox(&[
        "relay",
        "--database-url",
        &url,
        "--table",
        &table,
        "--sink",
        &sink,
        "--drain",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let lines = std::fs::read_to_string(&out).unwrap();
    assert_eq!(lines.lines().count(), 20, "{lines}");
    let o = outbox(&[
        "status",
        "--database-url",
        &url,
        "--table",
        &table,
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let status: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(status["delivered"], 20, "{status}");
    assert!(
        status["outbox"].as_str().unwrap().starts_with("MySQL"),
        "{status}"
    );
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP TABLE IF EXISTS `{table}`, `{table}_migrations`"
    )))
    .execute(store.pool())
    .await
    .unwrap();
}

/// Every command that opens the database refuses an unreachable server or an unopenable file
/// the same way: one line naming the URL (password masked), exit code 2.
#[test]
fn unreachable_databases_give_one_line_and_exit_2_for_every_command() {
    let dir = tempfile::tempdir().unwrap();
    let missing_dir = format!("sqlite://{}/no/such/dir/outbox.db", dir.path().display());
    for url in [
        "postgres://app:s3cret@127.0.0.1:1/app",
        "mysql://app:s3cret@127.0.0.1:1/app",
        missing_dir.as_str(),
    ] {
        for command in [
            vec!["migrate", "--database-url", url],
            vec!["relay", "--database-url", url, "--drain"],
            vec!["status", "--database-url", url],
            vec!["dead", "list", "--database-url", url],
        ] {
            let o = outbox(&command);
            let err = stderr(&o);
            assert_eq!(o.status.code(), Some(2), "{command:?}: {err}");
            // One line of error (the warning about a password on the command line aside).
            assert_eq!(
                err.trim().lines().filter(|l| !l.contains(" WARN ")).count(),
                1,
                "{command:?}: one line: {err}"
            );
            assert!(err.contains("cannot open database"), "{command:?}: {err}");
            assert!(!err.contains("s3cret"), "{command:?}: {err}");
        }
    }
}

/// `--log-format json`: one JSON object per line, and a delivery-relevant line (here an event
/// that no route matches, dead-lettered) carries the event's identity and the destination.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_logs_carry_the_event_fields() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("outbox.db");
    let url = format!("sqlite://{}", db.display());
    let o = outbox(&["migrate", "--database-url", &url]);
    assert!(o.status.success(), "{}", stderr(&o));
    let store = outbox_sqlite::SqliteStore::connect(&url, outbox_sqlite::SqliteOutbox::new())
        .await
        .unwrap();
    let event = outbox_types::NewEvent::new("user", "u7", "UserRenamed", &serde_json::json!({}))
        .unwrap()
        .with_idempotency_key("rename-u7-1");
    let mut tx = store.pool().begin().await.unwrap();
    store.outbox().enqueue(&mut *tx, &event).await.unwrap();
    tx.commit().await.unwrap();
    store.pool().close().await;
    let config = common::write_config(
        dir.path(),
        &format!(
            "[database]\nurl = \"{url}\"\n[destinations.a]\ntype = \"stdout\"\n[destinations.b]\ntype = \"stdout\"\n"
        ),
    );
    let lines: Vec<serde_json::Value> = drained_json_log(&config, &[])
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON: {l}: {e}")))
        .collect();
    let dead = log_line(&lines, "is dead");
    assert_eq!(dead["event_id"], event.id().to_string(), "{dead}");
    assert_eq!(dead["event_type"], "UserRenamed", "{dead}");
    assert_eq!(dead["aggregate_type"], "user", "{dead}");
    assert_eq!(dead["aggregate_id"], "u7", "{dead}");
    assert_eq!(dead["idempotency_key"], "rename-u7-1", "{dead}");
    assert_eq!(dead["attempts"], 1, "{dead}");
    assert_eq!(dead["destination"], "(unroutable)", "{dead}");
    assert_eq!(dead["level"], "WARN", "{dead}");
}

/// `database.layout = "partitioned"`: migrate creates the partitioned table and its partitions,
/// the relay delivers from it, cleanup rotates partitions instead of deleting rows, and opening
/// it with the wrong layout is refused with a message that names the setting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_partitioned_layout_works_through_the_binary() {
    let schema = format!("outbox_t_cliparts_{}", std::process::id());
    let dir = tempfile::tempdir().unwrap();
    let (config, out) = common::file_sink_config(
        dir.path(),
        &format!(
            "url = \"{}\"\nschema = \"{schema}\"\nlayout = \"partitioned\"\n[database.partitions]\ninterval = \"hourly\"\nahead = 2\n",
            pg_url()
        ),
        "",
    );
    let config = config.to_str().unwrap();
    let o = outbox(&["migrate", "--config", config]);
    assert!(o.status.success(), "{}", stderr(&o));
    let outbox_pg = outbox_postgresql::PgOutbox::partitioned(
        &schema,
        "events",
        outbox_postgresql::Partitioning {
            interval: outbox_postgresql::PartitionInterval::Hourly,
            ahead: 2,
            ..Default::default()
        },
    )
    .unwrap();
    let store = outbox_postgresql::PgStore::connect(&pg_url(), outbox_pg)
        .await
        .unwrap();
    let partitions: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
         JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = $1",
    )
    .bind(&schema)
    .fetch_one(store.pool())
    .await
    .unwrap();
    assert!(
        partitions >= 3,
        "current + 2 ahead (+ default): {partitions}"
    );
    common::enqueue_order_updates(&store, 0..10).await;
    let o = outbox(&["relay", "--config", config, "--drain"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(std::fs::read_to_string(&out).unwrap().lines().count(), 10);
    let o = outbox(&["status", "--config", config]);
    assert!(String::from_utf8_lossy(&o.stdout).contains("partitioned table"));
    let o = outbox(&[
        "--log-format",
        "json",
        "cleanup",
        "--config",
        config,
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    common::assert_contains(
        &stderr(&o),
        "`outbox cleanup` is deprecated: use `outbox purge`",
    );
    let report: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(report["dropped"].as_array().unwrap().is_empty(), "{report}");
    let o = outbox(&["migrate", "--database-url", &pg_url(), "--schema", &schema]);
    assert_ne!(
        o.status.code(),
        Some(0),
        "plain layout over a partitioned table"
    );
    common::assert_contains(&stderr(&o), "database.layout = \"partitioned\"");
    common::drop_pg_schema(store.pool(), &schema).await;
}

/// `retention.delivered = "0s"` on PostgreSQL: the relay delivers every event and the acks
/// delete the rows, so nothing delivered is left; with the default retention the rows stay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zero_delivered_retention_deletes_each_event_at_its_ack() {
    for (tag, retention, left) in [
        ("zero", "[retention]\ndelivered = \"0s\"\n", 0),
        ("keep", "", 10),
    ] {
        let schema = format!("outbox_t_cliack_{tag}_{}", std::process::id());
        let dir = tempfile::tempdir().unwrap();
        let (config, out) = common::file_sink_config(
            dir.path(),
            &format!("url = \"{}\"\nschema = \"{schema}\"\n", pg_url()),
            retention,
        );
        let config = config.to_str().unwrap();
        let o = outbox(&["migrate", "--config", config]);
        assert!(o.status.success(), "{}", stderr(&o));
        let store = outbox_postgresql::PgStore::connect(
            &pg_url(),
            outbox_postgresql::PgOutbox::with_names(&schema, "events").unwrap(),
        )
        .await
        .unwrap();
        common::enqueue_order_updates(&store, 0..10).await;
        let o = outbox(&["relay", "--config", config, "--drain"]);
        assert!(o.status.success(), "{}", stderr(&o));
        assert_eq!(
            std::fs::read_to_string(&out).unwrap().lines().count(),
            10,
            "{tag}"
        );
        let rows: i64 = common::pg_value(
            store.pool(),
            format!("SELECT count(*) FROM \"{schema}\".\"events\""),
        )
        .await;
        assert_eq!(rows, left, "{tag}: rows left after the drain");
        common::drop_pg_schema(store.pool(), &schema).await;
    }
}

/// `outbox config check` prints no secret from any place a config can hold one (URLs' userinfo
/// and query, client properties holding credentials or inline PEM), and contacts no broker: a
/// listener standing in for NATS and Kafka sees no connection.
#[test]
fn config_check_masks_every_secret_and_contacts_no_broker() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let port = listener.local_addr().unwrap().port();
    let (_dir, file) = common::temp_config(&format!(
        r#"
[database]
url = "postgres://app@db:5432/app?sslmode=prefer&password=dbquerypw"

[destinations.nats]
type = "nats"
servers = ["nats://natsuser:natspw@127.0.0.1:{port}"]
subject = "events.${{event_type}}"

[destinations.rabbit]
type = "rabbitmq"
url = "amqp://rabbit:rabbitpw@127.0.0.1:{port}/%2f"
exchange = "events"

[destinations.redis]
type = "redis"
url = "redis://:redispw@127.0.0.1:{port}/0"

[destinations.kafka]
type = "kafka"
brokers = "127.0.0.1:{port}"
tls = true
user = "kafkauser"
password = "kafkapw"
[destinations.kafka.properties]
"ssl.key.pem" = "-----BEGIN PRIVATE KEY-----kafkapem"
"sasl.oauthbearer.config" = "clientSecret=oauthsecret"

[[routes]]
to = "nats"
"#
    ));
    for format in [None, Some("--json")] {
        let mut args = vec!["config", "check", "--config", file.to_str().unwrap()];
        args.extend(format);
        let o = outbox(&args);
        assert!(o.status.success(), "{}", stderr(&o));
        let out = format!("{}{}", String::from_utf8_lossy(&o.stdout), stderr(&o));
        for secret in [
            "dbquerypw",
            "natspw",
            "rabbitpw",
            "redispw",
            "kafkapem",
            "oauthsecret",
            "kafkapw",
        ] {
            assert!(!out.contains(secret), "{secret} printed: {out}");
        }
        assert!(
            out.contains("sslmode=prefer"),
            "the rest stays readable: {out}"
        );
        common::assert_contains(&out, "natsuser:***@");
    }
    // Give any background connection attempt a moment to arrive.
    std::thread::sleep(std::time::Duration::from_millis(500));
    assert!(
        listener.accept().is_err(),
        "config check connected to a broker"
    );
}

/// `--log-format text` is the human format; `OUTBOX_LOG_FORMAT` selects the format without a
/// flag (a container configured from its environment); logs to a pipe carry no ANSI escapes,
/// and neither does a terminal with `NO_COLOR` (not testable without a terminal: the pipe case
/// is what log collectors see).
#[test]
fn log_format_from_the_flag_or_the_environment_and_no_colour_in_a_pipe() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("o.db").display());
    let o = outbox(&[
        "--log-format",
        "text",
        "relay",
        "--database-url",
        &url,
        "--drain",
    ]);
    // Not migrated: exits 2 with an error line, human format, no escape sequences.
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(!stderr(&o).contains('\u{1b}'), "{:?}", stderr(&o));
    assert!(
        serde_json::from_str::<serde_json::Value>(stderr(&o).lines().next().unwrap_or("")).is_err()
    );
    let o = Command::new(BIN)
        .args(["migrate", "--database-url", &url])
        .env("OUTBOX_LOG_FORMAT", "json")
        .env("OUTBOX_LOG", "info")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let o = Command::new(BIN)
        .args(["relay", "--database-url", &url, "--drain"])
        .env("OUTBOX_LOG_FORMAT", "json")
        .env("OUTBOX_LOG", "info")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let lines: Vec<&str> = std::str::from_utf8(&o.stderr).unwrap().lines().collect();
    assert!(!lines.is_empty());
    for line in lines {
        let v: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}"));
        assert!(v["level"].is_string(), "{line}");
    }
    let o = Command::new(BIN)
        .args(["status", "--database-url", &url])
        .env("OUTBOX_LOG_FORMAT", "yaml")
        .output()
        .unwrap();
    exits_2_saying(&o, "yaml");
}

/// The exit summary of a drain counts every dead letter, also a row dead-lettered at claim time
/// because it cannot be read (a header that is not a string), and says that nothing is left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_counts_every_dead_letter_and_says_what_it_leaves() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("outbox.db").display());
    let o = outbox(&["migrate", "--database-url", &url]);
    assert!(o.status.success(), "{}", stderr(&o));
    let store = outbox_sqlite::SqliteStore::connect(&url, outbox_sqlite::SqliteOutbox::new())
        .await
        .unwrap();
    let good =
        outbox_types::NewEvent::new("user", "u1", "UserRenamed", &serde_json::json!({})).unwrap();
    let mut tx = store.pool().begin().await.unwrap();
    store.outbox().enqueue(&mut *tx, &good).await.unwrap();
    tx.commit().await.unwrap();
    // Written by hand, as another language's writer might: a header value that is a number.
    // The table refuses it now (its insert trigger); a row from before that trigger is what the
    // relay still has to settle, so the trigger goes for this test.
    sqlx::query("DROP TRIGGER outbox_events_check_insert")
        .execute(store.pool())
        .await
        .unwrap();
    sqlx::query(
        "INSERT INTO outbox_events (id, aggregate_type, aggregate_id, event_type, payload, headers,
                                    occurred_at, enqueued_at, next_attempt_at)
         VALUES ('0190a0a0-0000-7000-8000-000000000001', 'user', 'u2', 'UserRenamed', '{}', '{\"retry\": 3}',
                 0, 0, 0)",
    )
    .execute(store.pool())
    .await
    .unwrap();
    store.pool().close().await;
    let config = common::write_config(
        dir.path(),
        &format!("[database]\nurl = \"{url}\"\n[destinations.out]\ntype = \"stdout\"\n"),
    );
    let lines: Vec<serde_json::Value> = drained_json_log(&config, &["--drain-wait", "1s"])
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    let line = |text: &str| log_line(&lines, text);
    let exited = line("Relay exited.");
    assert_eq!(exited["delivered"], 1, "{exited}");
    assert_eq!(exited["dead"], 1, "the unreadable row counts: {exited}");
    let drained = line("Drained: nothing is pending.");
    assert_eq!(drained["dead"], 1, "{drained}");
}
