//! What the `outbox` binary's integration tests share: running the binary the way an operator
//! does, and reading what it printed.

#![allow(dead_code)]

use std::process::{Child, Command, Output, Stdio};

/// The binary under test.
pub const BIN: &str = env!("CARGO_BIN_EXE_outbox");

/// Run `outbox ARGS…` to completion with warnings-only logging.
pub fn outbox(args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .env("OUTBOX_LOG", "warn")
        .output()
        .expect("the outbox binary runs")
}

/// Everything it printed: standard output, then standard error.
pub fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// The PostgreSQL the tests use: `OUTBOX_TEST_DATABASE_URL`, else the local `test` database.
pub fn pg_url() -> String {
    std::env::var("OUTBOX_TEST_DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
}

/// The MySQL/MariaDB the tests use: `OUTBOX_TEST_MYSQL_URL`, else the local `test` database.
pub fn mysql_url() -> String {
    std::env::var("OUTBOX_TEST_MYSQL_URL")
        .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".to_owned())
}

/// The `[database]` table of a config on the tests' PostgreSQL ([`pg_url`]), outbox in
/// `schema`: how a scenario's config file points the binary at the test database.
pub fn pg_database(schema: &str) -> String {
    format!(
        "[database]\nurl = \"{}\"\nschema = \"{schema}\"\n",
        pg_url()
    )
}

/// The repository's root directory.
pub fn repo() -> std::path::PathBuf {
    std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// A store on an outbox table `events` in `schema`, dropped first if an earlier run left it,
/// migrated.
pub async fn fresh_pg_store(schema: &str) -> outbox_postgresql::PgStore {
    let store = connect_store(&pg_url(), schema).await;
    drop_pg_schema_if_exists(store.pool(), schema).await;
    migrated(store).await
}

/// A store on the outbox table `events` in `schema` of the database at `url`, migrated.
pub async fn migrated_store(url: &str, schema: &str) -> outbox_postgresql::PgStore {
    migrated(connect_store(url, schema).await).await
}

async fn connect_store(url: &str, schema: &str) -> outbox_postgresql::PgStore {
    let outbox = outbox_postgresql::PgOutbox::with_names(schema, "events").expect("a valid name");
    outbox_postgresql::PgStore::connect(url, outbox)
        .await
        .expect("PostgreSQL is up")
}

async fn migrated(store: outbox_postgresql::PgStore) -> outbox_postgresql::PgStore {
    store
        .outbox()
        .migrate(store.pool())
        .await
        .expect("the outbox migrates");
    store
}

/// Wait up to `limit` for `child` to exit; its status. Past `limit` the test fails with `why`.
pub async fn exit_within(
    child: &mut Child,
    limit: std::time::Duration,
    why: &str,
) -> std::process::ExitStatus {
    let started = std::time::Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        assert!(started.elapsed() < limit, "{why}");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// Read `store`'s stats every 50 ms until `done` holds for them; those stats. Past `limit` the
/// test fails naming `what` and showing the last stats: how a test waits for a relay it runs
/// in the background to deliver (or bury, or release) what it expects.
pub async fn stats_until(
    store: &dyn outbox_types::Store,
    limit: std::time::Duration,
    what: &str,
    mut done: impl FnMut(&outbox_types::OutboxStats) -> bool,
) -> outbox_types::OutboxStats {
    let started = std::time::Instant::now();
    loop {
        let stats = store.stats().await.unwrap();
        if done(&stats) {
            return stats;
        }
        assert!(
            started.elapsed() < limit,
            "timed out waiting for {what}: {stats:?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

/// Send `child` the signal `sig` (`-TERM`, `-INT`, `-STOP`, …) with kill(1), as an operator or
/// an orchestrator does.
pub fn signal(child: &Child, sig: &str) {
    let status = Command::new("kill")
        .args([sig, &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success(), "kill {sig} {}", child.id());
}

/// A child process killed (and reaped) when the guard goes: a test that fails mid-way leaves no
/// relay running.
pub struct Killed(pub Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `outbox ARGS…` logging at `log`, its stdout and stderr discarded: a process a test runs in
/// the background and watches through the database, sinks and endpoints. The caller adds what
/// its scenario needs (flags, env vars, a log file for stderr) before spawning.
pub fn background(args: &[&str], log: &str) -> Command {
    let mut command = Command::new(BIN);
    command
        .args(args)
        .env("OUTBOX_LOG", log)
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    command
}

/// `outbox relay --config CONFIG` as a [`background`] process.
pub fn relay_command(config: impl AsRef<std::ffi::OsStr>, log: &str) -> Command {
    let mut command = background(&["relay", "--config"], log);
    command.arg(config);
    command
}

/// [`relay_command`] started, killed when the guard goes.
pub fn spawn_relay(config: impl AsRef<std::ffi::OsStr>, log: &str) -> Killed {
    Killed(relay_command(config, log).spawn().unwrap())
}

/// The one value the PostgreSQL query `sql` selects (a count, a maximum): what a test reads
/// back from the tables it wrote or the relay updated. A failing query fails the test, naming it.
pub async fn pg_value<T>(pool: &sqlx::PgPool, sql: String) -> T
where
    T: for<'r> sqlx::Decode<'r, sqlx::Postgres> + sqlx::Type<sqlx::Postgres> + Send + Unpin,
{
    sqlx::query_scalar(sqlx::AssertSqlSafe(sql.clone()))
        .fetch_one(pool)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
}

/// Run `sql` (one or more statements) on PostgreSQL: how a test sets up or alters what the
/// relay will find. A failing statement fails the test, naming it.
pub async fn pg_execute(pool: &sqlx::PgPool, sql: String) {
    sqlx::raw_sql(sqlx::AssertSqlSafe(sql.clone()))
        .execute(pool)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
}

/// Drop `schema` and everything in it: the clean-up at the end of a PostgreSQL test (which
/// fails if the schema is not there).
pub async fn drop_pg_schema(pool: &sqlx::PgPool, schema: &str) {
    pg_execute(pool, format!("DROP SCHEMA \"{schema}\" CASCADE")).await;
}

/// Drop `schema` and everything in it if an earlier run (or this one) left it: the clean slate
/// before a PostgreSQL test, and its clean-up where the schema may not have been made.
pub async fn drop_pg_schema_if_exists(pool: &sqlx::PgPool, schema: &str) {
    pg_execute(pool, format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE")).await;
}

/// A Kafka admin client on `brokers`, with `topics` (name, partitions; one replica each)
/// created: a Kafka scenario's topics, made before the relay publishes into them. The client is
/// the test's for its other calls (deleting the topics at its end).
pub async fn kafka_topics(
    brokers: &str,
    topics: &[(&str, i32)],
) -> rdkafka::admin::AdminClient<rdkafka::client::DefaultClientContext> {
    use rdkafka::admin::{AdminOptions, NewTopic, TopicReplication};
    let admin: rdkafka::admin::AdminClient<_> = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()
        .unwrap();
    let new: Vec<NewTopic> = topics
        .iter()
        .map(|&(name, partitions)| NewTopic::new(name, partitions, TopicReplication::Fixed(1)))
        .collect();
    let results = admin
        .create_topics(
            &new,
            &AdminOptions::new().operation_timeout(Some(std::time::Duration::from_secs(10))),
        )
        .await
        .unwrap();
    for r in results {
        r.unwrap_or_else(|(t, e)| panic!("create topic {t}: {e}"));
    }
    admin
}

/// A request's headers as (name, value) pairs in order (collected into a list or a map), a value
/// that is not text as "".
pub fn header_pairs<C: FromIterator<(String, String)>>(headers: &axum::http::HeaderMap) -> C {
    headers
        .iter()
        .map(|(k, v)| (k.as_str().to_owned(), v.to_str().unwrap_or("").to_owned()))
        .collect()
}

/// `toml` as `outbox.toml` in a fresh temporary directory, which lasts as long as the returned
/// guard: a scenario's config file when the scenario needs no other files.
pub fn temp_config(toml: &str) -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let file = write_config(dir.path(), toml);
    (dir, file)
}

/// Run `outbox relay --config` on `toml` (written to a temporary `outbox.toml`).
pub fn relay_with_config(toml: &str) -> Output {
    let (_dir, file) = temp_config(toml);
    outbox(&["relay", "--config", file.to_str().unwrap()])
}

/// Enqueue an `OrderUpdated` of order `o1` for each `n` in `ns`, in one committed transaction.
pub async fn enqueue_order_updates(store: &outbox_postgresql::PgStore, ns: std::ops::Range<u32>) {
    let mut tx = store.pool().begin().await.unwrap();
    for n in ns {
        let e = outbox_types::NewEvent::new(
            "order",
            "o1",
            "OrderUpdated",
            &serde_json::json!({ "n": n }),
        )
        .unwrap();
        store.outbox().enqueue(&mut *tx, &e).await.unwrap();
    }
    tx.commit().await.unwrap();
}

/// Enqueue `events` with `enqueue_batch` in one committed transaction of `store` (a `PgStore`
/// or a `SqliteStore`: a macro because the two stores' pools and outboxes are different types).
#[macro_export]
macro_rules! enqueue_committed {
    ($store:expr, $events:expr) => {{
        let store = &$store;
        let mut tx = store.pool().begin().await.unwrap();
        store
            .outbox()
            .enqueue_batch(&mut *tx, $events)
            .await
            .unwrap();
        tx.commit().await.unwrap();
    }};
}

/// Fail the test unless `haystack` contains `needle`, showing all of `haystack`: what each
/// scenario checks of a command's output or an error's text.
#[track_caller]
pub fn assert_contains(haystack: &str, needle: &str) {
    assert!(haystack.contains(needle), "{haystack}");
}

/// The command was refused as a usage error (exit 2) and its stderr says `says`.
#[track_caller]
pub fn exits_2_saying(o: &Output, says: &str) {
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{stderr}");
    assert_contains(&stderr, says);
}

/// Fail the test unless the command `what` exited 0, showing its stderr.
#[track_caller]
pub fn assert_succeeded(o: &Output, what: &str) {
    assert!(
        o.status.success(),
        "{what}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
}

/// Write `contents` to the file `name` in `dir`; its path. The config files (and other inputs)
/// the tests hand the binary.
pub fn write_file(dir: &std::path::Path, name: &str, contents: &str) -> std::path::PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, contents).unwrap();
    path
}

/// Write `toml` as the config file `outbox.toml` in `dir`; its path.
pub fn write_config(dir: &std::path::Path, toml: &str) -> std::path::PathBuf {
    write_file(dir, "outbox.toml", toml)
}

/// A config in `dir` with a file destination (`out.jsonl` in `dir`), `database` as the body of
/// its `[database]` table and `extra` appended; returns the config and output paths.
pub fn file_sink_config(
    dir: &std::path::Path,
    database: &str,
    extra: &str,
) -> (std::path::PathBuf, std::path::PathBuf) {
    let out = dir.join("out.jsonl");
    let config = write_config(
        dir,
        &format!(
            "[database]\n{database}[destinations.file]\ntype = \"file\"\npath = \"{}\"\n{extra}",
            out.display()
        ),
    );
    (config, out)
}

/// The complete lines of the JSON-lines file at `path` (a file destination's output), parsed;
/// none while the file does not exist. A last line still being written (no newline yet) is not
/// complete and not read, so a test may read while a relay writes.
pub fn jsonl(path: &std::path::Path) -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let complete = text.rfind('\n').map_or("", |end| &text[..end]);
    complete
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON: {l}: {e}")))
        .collect()
}

/// The entry of the destination `name` in the `destinations` list of `outbox status --json`
/// or of the relay's `/destinations` endpoint, if it is listed.
pub fn destination<'a>(json: &'a serde_json::Value, name: &str) -> Option<&'a serde_json::Value> {
    json["destinations"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["destination"] == name)
}

/// Serve `app` on a free local port, in the background; the port. The HTTP endpoints (webhook
/// receivers) the relay under test delivers to.
pub async fn serve(app: axum::Router) -> u16 {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    port
}

/// A WAL-mode relay's config: `schema` of the database at `url`, streamed through the slot and
/// publication `slot`, with `relay` and `wal` (the scenario's own lines, each ending in a newline)
/// in those tables. The caller appends its destinations (and any other table).
pub fn wal_config(url: &str, schema: &str, slot: &str, relay: &str, wal: &str) -> String {
    format!(
        r#"
mode = "wal"

[database]
url = "{url}"
schema = "{schema}"

[relay]
{relay}
[wal]
slot = "{slot}"
publication = "{slot}"
status_interval = "100ms"
{wal}
"#
    )
}
