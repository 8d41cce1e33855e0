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

/// The repository's root directory.
pub fn repo() -> std::path::PathBuf {
    std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// A store on an outbox table `events` in `schema`, dropped first if an earlier run left it,
/// migrated.
pub async fn fresh_pg_store(schema: &str) -> outbox_postgresql::PgStore {
    let store = connect_store(&pg_url(), schema).await;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP SCHEMA IF EXISTS \"{schema}\" CASCADE"
    )))
    .execute(store.pool())
    .await
    .expect("the old schema goes");
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

/// A child process killed (and reaped) when the guard goes: a test that fails mid-way leaves no
/// relay running.
pub struct Killed(pub Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `outbox relay --config CONFIG` logging at `log`, its stdout and stderr discarded: the
/// relay a test runs in the background and watches through the database, sinks and endpoints.
/// The caller adds what its scenario needs (an env var, a log file) before spawning.
pub fn relay_command(config: impl AsRef<std::ffi::OsStr>, log: &str) -> Command {
    let mut command = Command::new(BIN);
    command
        .args(["relay", "--config"])
        .arg(config)
        .env("OUTBOX_LOG", log)
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    command
}

/// [`relay_command`] started, killed when the guard goes.
pub fn spawn_relay(config: impl AsRef<std::ffi::OsStr>, log: &str) -> Killed {
    Killed(relay_command(config, log).spawn().unwrap())
}

/// Drop `schema` and everything in it: the clean-up at the end of a PostgreSQL test.
pub async fn drop_pg_schema(pool: &sqlx::PgPool, schema: &str) {
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP SCHEMA \"{schema}\" CASCADE"
    )))
    .execute(pool)
    .await
    .unwrap();
}

/// A request's headers as (name, value) pairs in order (collected into a list or a map), a value
/// that is not text as "".
pub fn header_pairs<C: FromIterator<(String, String)>>(headers: &axum::http::HeaderMap) -> C {
    headers
        .iter()
        .map(|(k, v)| (k.as_str().to_owned(), v.to_str().unwrap_or("").to_owned()))
        .collect()
}

/// Write `toml` to `outbox.toml` in `dir` and run `outbox relay --config` on it.
pub fn relay_with_config(dir: &std::path::Path, toml: &str) -> Output {
    let file = dir.join("outbox.toml");
    std::fs::write(&file, toml).unwrap();
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
