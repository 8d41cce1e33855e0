//! The bad-input sweep: malformed configuration, payloads at the size limits, header values
//! that cannot travel, huge batches, and an outbox table altered by hand. Each case must give a
//! clear error (naming the key, the limit or the column) and lose nothing: the events involved
//! end delivered, or dead with a reason, or were never written because the writer got the
//! error. The list of cases and what happened is in the crate's README.
//!
//! These run the real `outbox` binary (built next to the test executable: `cargo build -p
//! outbox-cli --bin outbox`, which `cargo test --workspace` does) against the machine's shared
//! PostgreSQL (schemas `outbox_t_bad_*`) and NATS (streams `OUTBOX_T_BAD_*`).

#![cfg(feature = "nats")]

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use outbox_postgresql::{PgOutbox, PgStore};
use outbox_sink_tests::{database_url, enqueue_committed};
use outbox_types::{EventId, EventState, NewEvent, Store};
use sqlx::AssertSqlSafe;

fn nats_url() -> String {
    std::env::var("OUTBOX_TEST_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".to_owned())
}

fn bin() -> PathBuf {
    outbox_verify::relays::locate_outbox_bin(None).expect("the outbox binary is built")
}

fn unique(prefix: &str) -> String {
    format!(
        "{prefix}_{}_{}",
        std::process::id(),
        rand::random::<u32>() % 1_000_000
    )
}

async fn store(schema: &str) -> PgStore {
    let store = PgStore::connect(
        &database_url(),
        PgOutbox::with_names(schema, "events").unwrap(),
    )
    .await
    .unwrap();
    store.outbox().migrate(store.pool()).await.unwrap();
    store
}

async fn drop_schema(store: &PgStore) {
    let _ = sqlx::raw_sql(AssertSqlSafe(format!(
        "DROP SCHEMA IF EXISTS \"{}\" CASCADE",
        store.outbox().schema()
    )))
    .execute(store.pool())
    .await;
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

/// Write `text` to `dir/name` and run `outbox relay --drain --config` on it with `env`, up to
/// `limit`; (exit code, stderr).
async fn drain(
    dir: &Path,
    name: &str,
    text: &str,
    env: &[(&str, &str)],
    limit: Duration,
) -> (Option<i32>, String) {
    let path = write(dir, name, text);
    outbox(
        &["relay", "--drain", "--config", path.to_str().unwrap()],
        env,
        limit,
    )
    .await
}

/// Drain `schema` (with `relay` prepended to its destination) to one NATS destination
/// publishing on `prefix.${event_type}`; the relay must exit 0.
async fn drain_to_nats(schema: &str, prefix: &str, relay: &str) {
    let dir = tempfile::tempdir().unwrap();
    let text = config(
        schema,
        &format!(
            "{relay}[destinations.n]\ntype = \"nats\"\nservers = [\"{}\"]\nsubject = \"{prefix}.${{event_type}}\"\n",
            nats_url()
        ),
    );
    let (code, stderr) = drain(dir.path(), "nats.toml", &text, &[], Duration::from_secs(60)).await;
    assert_eq!(code, Some(0), "{stderr}");
}

/// `[database]` for `schema` plus `rest`.
fn config(schema: &str, rest: &str) -> String {
    format!(
        "[database]\nurl = \"{}\"\nschema = \"{schema}\"\n\n{rest}\n",
        database_url()
    )
}

/// Run `outbox ARGS` with `env`, up to `limit`; (exit code, stderr). `None` code: timed out.
async fn outbox(args: &[&str], env: &[(&str, &str)], limit: Duration) -> (Option<i32>, String) {
    let mut cmd = tokio::process::Command::new(bin());
    cmd.args(args)
        .env("OUTBOX_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let child = cmd.spawn().unwrap();
    match tokio::time::timeout(limit, child.wait_with_output()).await {
        Ok(out) => {
            let out = out.unwrap();
            (
                out.status.code(),
                String::from_utf8_lossy(&out.stderr).into_owned(),
            )
        }
        Err(_) => (None, String::new()),
    }
}

async fn state(store: &PgStore, id: EventId) -> (EventState, Option<String>) {
    let record = store.get(id).await.unwrap().expect("the event exists");
    (record.state, record.last_error)
}

/// (what is wrong, config body, a word the error must contain)
type Case = (&'static str, &'static str, &'static str);

/// Cases the relay refuses at start with exit 2 and the key named.
const REFUSED: &[Case] = &[
    ("batch size zero", "[relay]\nbatch_size = 0", "batch_size"),
    (
        "batch size not a number",
        "[relay]\nbatch_size = \"ten\"",
        "relay.batch_size",
    ),
    (
        "batch size negative",
        "[relay]\nbatch_size = -5",
        "relay.batch_size",
    ),
    (
        "duration with an unknown unit",
        "[relay]\nlease = \"5 parsecs\"",
        "relay.lease",
    ),
    (
        "duration without a unit",
        "[relay]\npoll_interval = \"100\"",
        "relay.poll_interval",
    ),
    (
        "lease not longer than the publish timeout",
        "[relay]\nlease = \"1s\"\npublish_timeout = \"2s\"",
        "relay.lease",
    ),
    ("misspelt key", "[relay]\nbach_size = 10", "relay.bach_size"),
    (
        "unknown destination type",
        "[destinations.x]\ntype = \"kafak\"",
        "kafak",
    ),
    (
        "webhook without a URL",
        "[destinations.w]\ntype = \"webhook\"",
        "url",
    ),
    (
        "route to a destination that does not exist",
        "[destinations.a]\ntype = \"stdout\"\n\n[[routes]]\nto = \"nowhere\"",
        "nowhere",
    ),
    (
        "route pattern on an unknown field",
        "[destinations.a]\ntype = \"stdout\"\n\n[[routes]]\nwhen = { colour = \"red\" }\nto = \"a\"",
        "colour",
    ),
    (
        "Kafka max_message_bytes out of range",
        "[destinations.k]\ntype = \"kafka\"\nbrokers = \"127.0.0.1:19092\"\nmax_message_bytes = 10",
        "max_message_bytes",
    ),
    (
        "retention with a negative duration",
        "[retention]\ndelivered = \"-1d\"",
        "retention.delivered",
    ),
];

/// The failure line for `what` unless the run exited 2 with `needle` in its stderr.
fn unless_refused(code: Option<i32>, stderr: &str, needle: &str, what: &str) -> Option<String> {
    (code != Some(2) || !stderr.contains(needle))
        .then(|| format!("{what}: exit {code:?}; stderr: {}", stderr.trim()))
}

/// Drain with `config` written as `name` in `dir` (and `env` set) for up to 20 s; the failure line
/// for `what` unless it exited 2 naming `needle`.
async fn drain_unless_refused(
    dir: &Path,
    name: &str,
    config: &str,
    env: &[(&str, &str)],
    needle: &str,
    what: &str,
) -> Option<String> {
    let (code, stderr) = drain(dir, name, config, env, Duration::from_secs(20)).await;
    unless_refused(code, &stderr, needle, what)
}

/// Start `outbox relay --drain` with `body` against a migrated, empty outbox; describe what
/// went wrong if it did not exit 2 naming `needle`.
async fn refused_by_the_relay(
    schema: &str,
    body: &str,
    needle: &str,
    what: &str,
) -> Option<String> {
    let dir = tempfile::tempdir().unwrap();
    let (code, stderr) = drain(
        dir.path(),
        "bad.toml",
        &config(schema, body),
        &[],
        Duration::from_secs(30),
    )
    .await;
    (code != Some(2) || !stderr.contains(needle)).then(|| {
        format!(
            "{what}: exit {code:?}, expected 2 and an error naming `{needle}`; stderr: {}",
            stderr.trim()
        )
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_config_values_are_refused_with_the_key_named() {
    let schema = unique("outbox_t_bad_cfg");
    let store = store(&schema).await;
    let mut failures = Vec::new();
    for (what, body, needle) in REFUSED {
        failures.extend(refused_by_the_relay(&schema, body, needle, what).await);
    }
    // A bad value from the environment names the key too.
    let dir = tempfile::tempdir().unwrap();
    failures.extend(
        drain_unless_refused(
            dir.path(),
            "ok.toml",
            &config(&schema, ""),
            &[("OUTBOX_RELAY__BATCH_SIZE", "abc")],
            "relay.batch_size",
            "OUTBOX_RELAY__BATCH_SIZE=abc",
        )
        .await,
    );
    // An unsupported database URL.
    failures.extend(
        drain_unless_refused(
            dir.path(),
            "url.toml",
            "[database]\nurl = \"mysq://root@127.0.0.1/test\"\n",
            &[],
            "database.url",
            "unsupported URL scheme",
        )
        .await,
    );
    drop_schema(&store).await;
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn values_the_relay_accepts_but_should_refuse() {
    let schema = unique("outbox_t_bad_gap");
    let store = store(&schema).await;
    let cases: &[Case] = &[
        (
            "NATS subject template with a space (every event would be dead)",
            "[destinations.n]\ntype = \"nats\"\nsubject = \"a b.${event_type}\"",
            "subject",
        ),
        (
            "retry with zero attempts (documented as at least 1)",
            "[relay.retry]\nmax_attempts = 0",
            "max_attempts",
        ),
    ];
    let mut failures = Vec::new();
    for (what, body, needle) in cases {
        failures.extend(refused_by_the_relay(&schema, body, needle, what).await);
    }
    drop_schema(&store).await;
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn config_check_refuses_what_the_relay_refuses() {
    let dir = tempfile::tempdir().unwrap();
    let mut failures = Vec::new();
    let url_case: Case = ("unsupported URL scheme", "", "database.url");
    for (what, body, needle) in REFUSED.iter().chain(std::iter::once(&url_case)) {
        let text = if body.is_empty() {
            "[database]\nurl = \"mysq://root@127.0.0.1/test\"\n".to_owned()
        } else {
            config("outbox_t_bad_check", body)
        };
        let path = write(dir.path(), "bad.toml", &text);
        let (code, stderr) = outbox(
            &["config", "check", "--config", path.to_str().unwrap()],
            &[],
            Duration::from_secs(20),
        )
        .await;
        if code != Some(2) || !stderr.contains(needle) {
            failures.push(format!("{what}: `config check` exit {code:?}"));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_with_a_bad_config_claims_nothing() {
    let schema = unique("outbox_t_bad_relay");
    let store = store(&schema).await;
    let events: Vec<NewEvent> = (0..10)
        .map(|i| {
            NewEvent::new(
                "order",
                i.to_string(),
                "Created",
                &serde_json::json!({"i": i}),
            )
            .unwrap()
        })
        .collect();
    enqueue_committed(&store, &events).await;
    let dir = tempfile::tempdir().unwrap();
    let text = config(
        &schema,
        "[relay]\nbatch_size = 10\nlease = \"1s\"\npublish_timeout = \"5s\"\n[destinations.f]\ntype = \"stdout\"",
    );
    let (code, stderr) = drain(dir.path(), "bad.toml", &text, &[], Duration::from_secs(30)).await;
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("relay.lease"), "{stderr}");
    let stats = store.stats().await.unwrap();
    assert_eq!((stats.pending, stats.in_flight), (10, 0), "{stats:?}");
    drop_schema(&store).await;
}

/// A stream on the shared NATS server with its own subjects; returns (a JetStream context on
/// that server, the stream, the subject prefix).
async fn nats_stream() -> (async_nats::jetstream::Context, String, String) {
    let client = async_nats::connect(nats_url()).await.unwrap();
    let js = async_nats::jetstream::new(client);
    let stream = unique("OUTBOX_T_BAD").to_uppercase();
    let prefix = stream.to_lowercase();
    js.create_stream(async_nats::jetstream::stream::Config {
        name: stream.clone(),
        subjects: vec![format!("{prefix}.>")],
        storage: async_nats::jetstream::stream::StorageType::Memory,
        ..Default::default()
    })
    .await
    .unwrap();
    (js, stream, prefix)
}

async fn nats_messages(
    js: &async_nats::jetstream::Context,
    stream: &str,
    expected: usize,
) -> Vec<async_nats::jetstream::Message> {
    use futures::StreamExt;
    let consumer: async_nats::jetstream::consumer::PullConsumer = js
        .get_stream(stream)
        .await
        .unwrap()
        .create_consumer(async_nats::jetstream::consumer::pull::Config::default())
        .await
        .unwrap();
    let mut out = Vec::new();
    let mut batch = consumer
        .fetch()
        .max_messages(expected + 10)
        .expires(Duration::from_secs(3))
        .messages()
        .await
        .unwrap();
    while let Some(m) = batch.next().await {
        out.push(m.unwrap());
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn payloads_at_the_size_limits_are_delivered_or_dead_with_the_limit_named() {
    let (js, stream, prefix) = nats_stream().await;
    let schema = unique("outbox_t_bad_size");
    let store = store(&schema).await;
    let empty = NewEvent::from_json("blob", "empty", "Sized", "{}").unwrap();
    // Just under the server's default max_payload (1 MiB), headers included.
    let one_mb = NewEvent::new("blob", "mb", "Sized", &"x".repeat(1_000_000)).unwrap();
    let over = NewEvent::new("blob", "over", "Sized", &"y".repeat(2_000_000)).unwrap();
    let after = NewEvent::new("blob", "after", "Sized", &serde_json::json!({"ok": true})).unwrap();
    enqueue_committed(
        &store,
        &[empty.clone(), one_mb.clone(), over.clone(), after.clone()],
    )
    .await;
    drain_to_nats(&schema, &prefix, "[relay]\nbatch_size = 10\n").await;
    for e in [&empty, &one_mb, &after] {
        assert_eq!(state(&store, e.id()).await.0, EventState::Delivered);
    }
    let (over_state, error) = state(&store, over.id()).await;
    assert_eq!(over_state, EventState::Dead);
    let error = error.unwrap_or_default();
    assert!(
        error.contains("max_payload") || error.contains("too large") || error.contains("size"),
        "the reason names the limit: {error}"
    );
    let messages = nats_messages(&js, &stream, 3).await;
    let bodies: Vec<usize> = messages.iter().map(|m| m.payload.len()).collect();
    assert!(
        bodies.contains(&2),
        "`{{}}` arrived byte for byte: {bodies:?}"
    );
    assert!(
        bodies.contains(&(one_mb.payload().len())),
        "the 1 MB payload arrived whole: {bodies:?}"
    );
    assert_eq!(messages.len(), 3, "exactly the three that fit");
    let _ = js.delete_stream(&stream).await;
    drop_schema(&store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn header_values_that_cannot_travel_are_dead_with_a_reason_and_block_nothing_else() {
    let (js, stream, prefix) = nats_stream().await;
    let schema = unique("outbox_t_bad_hdr");
    let store = store(&schema).await;
    let newline = NewEvent::new("h", "newline", "Hdr", &1)
        .unwrap()
        .with_header("x-bad", "a\r\nb");
    let unicode = NewEvent::new("h", "unicode", "Hdr", &2)
        .unwrap()
        .with_header("x-name", "héllo ✓");
    let plain = NewEvent::new("h", "plain", "Hdr", &3)
        .unwrap()
        .with_header("x-name", "plain");
    enqueue_committed(&store, &[newline.clone(), unicode.clone(), plain.clone()]).await;

    // Bytes that are not UTF-8 never get into the outbox: the database refuses them, so the
    // writer's transaction fails and nothing is half-written.
    let refused = sqlx::query(AssertSqlSafe(format!(
        "UPDATE {} SET headers = jsonb_build_object('x', convert_from('\\xff'::bytea, 'UTF8')) WHERE id = $1",
        store.outbox().qualified_table()
    )))
    .bind(plain.id().as_uuid())
    .execute(store.pool())
    .await;
    let error = refused
        .expect_err("PostgreSQL refuses invalid UTF-8")
        .to_string();
    assert!(error.contains("UTF8"), "{error}");

    drain_to_nats(&schema, &prefix, "").await;
    let (s, error) = state(&store, newline.id()).await;
    assert_eq!(
        s,
        EventState::Dead,
        "a line break cannot travel in a header"
    );
    assert!(
        error.as_deref().unwrap_or("").contains("x-bad"),
        "the reason names the header: {error:?}"
    );
    assert_eq!(state(&store, plain.id()).await.0, EventState::Delivered);
    // Non-ASCII UTF-8 in a header: NATS headers carry bytes; either it arrives intact or the
    // event is dead with a reason — never silently mangled.
    let (s, error) = state(&store, unicode.id()).await;
    let messages = nats_messages(&js, &stream, 2).await;
    match s {
        EventState::Delivered => {
            let m = messages
                .iter()
                .find(|m| m.payload.as_ref() == b"2")
                .expect("the unicode event arrived");
            let value = m
                .headers
                .as_ref()
                .and_then(|h| h.get("x-name"))
                .map(|v| v.as_str().to_owned());
            assert_eq!(value.as_deref(), Some("héllo ✓"), "header arrived intact");
        }
        EventState::Dead => assert!(error.unwrap_or_default().contains("x-name")),
        other => panic!("unicode header event ended {other}"),
    }
    let _ = js.delete_stream(&stream).await;
    drop_schema(&store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_huge_batch_is_delivered_whole_and_in_order() {
    let schema = unique("outbox_t_bad_huge");
    let store = store(&schema).await;
    let total = 100_000u64;
    let events: Vec<NewEvent> = (0..total)
        .map(|i| {
            NewEvent::new(
                "huge",
                format!("a{}", i % 100),
                "Big",
                &serde_json::json!({"agg": format!("a{}", i % 100), "n": i / 100}),
            )
            .unwrap()
        })
        .collect();
    // One transaction, one statement.
    enqueue_committed(&store, &events).await;
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out.jsonl");
    let (code, stderr) = drain(
        dir.path(),
        "file.toml",
        &config(
            &schema,
            &format!(
                "[relay]\nbatch_size = 50000\n[destinations.f]\ntype = \"file\"\npath = \"{}\"\n",
                out.display()
            ),
        ),
        &[],
        Duration::from_secs(300),
    )
    .await;
    assert_eq!(code, Some(0), "{stderr}");
    let text = std::fs::read_to_string(&out).unwrap();
    let mut seen = std::collections::HashSet::new();
    let mut last: std::collections::HashMap<String, u64> = Default::default();
    for line in text.lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        seen.insert(v["id"].as_str().unwrap().to_owned());
        let agg = v["payload"]["agg"].as_str().unwrap().to_owned();
        let n = v["payload"]["n"].as_u64().unwrap();
        if let Some(prev) = last.insert(agg.clone(), n) {
            assert!(n > prev, "aggregate {agg}: {n} after {prev}");
        }
    }
    assert_eq!(seen.len() as u64, total);
    assert_eq!(store.stats().await.unwrap().delivered, total);
    drop_schema(&store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_column_dropped_by_hand_is_named_and_nothing_is_lost_once_restored() {
    let schema = unique("outbox_t_bad_alter");
    let store = store(&schema).await;
    let events: Vec<NewEvent> = (0..20)
        .map(|i| NewEvent::new("alt", (i % 4).to_string(), "Alt", &i).unwrap())
        .collect();
    enqueue_committed(&store, &events).await;
    let table = store.outbox().qualified_table().to_owned();
    sqlx::raw_sql(AssertSqlSafe(format!(
        "ALTER TABLE {table} DROP COLUMN lease_token"
    )))
    .execute(store.pool())
    .await
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out.jsonl");
    let log = dir.path().join("relay.log");
    let path = write(
        dir.path(),
        "file.toml",
        &config(
            &schema,
            &format!(
                "[relay]\nmax_store_backoff = \"500ms\"\n[destinations.f]\ntype = \"file\"\npath = \"{}\"\n",
                out.display()
            ),
        ),
    );
    let mut relay = tokio::process::Command::new(bin())
        .args(["relay", "--drain", "--config", path.to_str().unwrap()])
        .env("OUTBOX_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    tokio::time::sleep(Duration::from_secs(4)).await;
    let early = std::fs::read_to_string(&log).unwrap_or_default();
    let exited = relay.try_wait().unwrap();
    assert!(
        early.contains("lease_token"),
        "the error names the missing column (exited: {exited:?}): {early}"
    );
    let stats = store.stats().await.unwrap();
    assert_eq!(stats.delivered, 0, "{stats:?}");
    // Put it back the way the migration made it: the relay carries on and loses nothing.
    sqlx::raw_sql(AssertSqlSafe(format!(
        "ALTER TABLE {table} ADD COLUMN lease_token UUID"
    )))
    .execute(store.pool())
    .await
    .unwrap();
    let status = match exited {
        Some(status) => {
            // It gave up: start it again.
            let (code, stderr) = outbox(
                &["relay", "--drain", "--config", path.to_str().unwrap()],
                &[],
                Duration::from_secs(60),
            )
            .await;
            assert_eq!(code, Some(0), "first exit {status:?}, then: {stderr}");
            status
        }
        None => tokio::time::timeout(Duration::from_secs(60), relay.wait())
            .await
            .expect("the relay drains once the column is back")
            .unwrap(),
    };
    let _ = status;
    let stats = store.stats().await.unwrap();
    assert_eq!(stats.delivered, 20, "{stats:?}");
    drop_schema(&store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_with_headers_that_are_not_strings_blocks_only_itself() {
    let schema = unique("outbox_t_bad_row");
    let store = store(&schema).await;
    let bad = NewEvent::new("row", "bad", "Row", &0).unwrap();
    let good: Vec<NewEvent> = (1..=10)
        .map(|i| NewEvent::new("row", format!("g{i}"), "Row", &i).unwrap())
        .collect();
    enqueue_committed(&store, std::slice::from_ref(&bad)).await;
    enqueue_committed(&store, &good).await;
    // Altered by hand: a header value that is a number, not a string. The table's trigger
    // (`events_header_rules`) refuses that; a row from before the trigger is what this is about,
    // so the trigger goes first.
    sqlx::query(AssertSqlSafe(format!(
        "DROP TRIGGER events_header_rules ON {}",
        store.outbox().qualified_table()
    )))
    .execute(store.pool())
    .await
    .unwrap();
    sqlx::query(AssertSqlSafe(format!(
        "UPDATE {} SET headers = '{{\"x\": 1}}' WHERE id = $1",
        store.outbox().qualified_table()
    )))
    .bind(bad.id().as_uuid())
    .execute(store.pool())
    .await
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out.jsonl");
    let text = config(
        &schema,
        &format!(
            "[relay]\nlease = \"2s\"\npublish_timeout = \"1s\"\nmax_store_backoff = \"500ms\"\n[destinations.f]\ntype = \"file\"\npath = \"{}\"\n",
            out.display()
        ),
    );
    let (code, stderr) = drain(dir.path(), "file.toml", &text, &[], Duration::from_secs(20)).await;
    let stats = store.stats().await.unwrap();
    assert_eq!(
        stats.delivered,
        10,
        "the ten good events are delivered despite one corrupt row (relay exit {code:?}, stats {stats:?}): {}",
        stderr.lines().take(5).collect::<Vec<_>>().join("\n")
    );
    drop_schema(&store).await;
}
