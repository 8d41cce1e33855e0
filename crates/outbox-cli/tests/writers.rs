//! Writers in other languages (`examples/writers/`): a Python service (psycopg) and a Node one
//! (node-postgres) write business rows and events in their own transactions — through the enqueue
//! function the migrations install and through a plain INSERT, committed and rolled back — and
//! the relay delivers exactly the committed events, in order. The clients are installed by
//! `scripts/inbox-deps.sh` (which `scripts/test.sh` runs) under the repository's `.cache`.

mod common;

use common::{pg_url, repo};
use std::path::PathBuf;
use std::process::Command;

use outbox_postgresql::PgOutbox;

/// Where `scripts/inbox-deps.sh` installed the clients: the repository's `.cache`.
fn clients() -> PathBuf {
    let dir = repo().join(".cache");
    assert!(
        dir.join("inbox-py/bin/python").exists() && dir.join("inbox-node/node_modules/pg").exists(),
        "the Python and Node clients are not installed in {}: run scripts/inbox-deps.sh",
        dir.display()
    );
    dir
}

#[derive(serde::Deserialize)]
struct Written {
    committed: Vec<String>,
    rolled_back: Vec<String>,
}

async fn delivers_exactly_what_a_writer_committed(lang: &str, writer: Command) {
    let schema = format!("outbox_t_writers_{lang}_{}", std::process::id());
    let pool = sqlx::PgPool::connect(&pg_url()).await.unwrap();
    let outbox = PgOutbox::with_names(&schema, "events").unwrap();
    outbox.migrate(&pool).await.unwrap();
    common::pg_execute(&pool, format!(
        "CREATE TABLE \"{schema}\".orders (id UUID PRIMARY KEY, lang TEXT NOT NULL, n INT NOT NULL)"
    )).await;

    let mut writer = writer;
    let out = writer.arg(pg_url()).arg(&schema).output().unwrap();
    assert!(
        out.status.success(),
        "{lang} writer: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let written: Written = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(written.committed.len(), 6);
    assert_eq!(written.rolled_back.len(), 6);
    let orders: i64 =
        common::pg_value(&pool, format!("SELECT count(*) FROM \"{schema}\".orders")).await;
    assert_eq!(orders, 6, "the business rows committed with their events");

    let dir = tempfile::tempdir().unwrap();
    let (config, sink) = common::file_sink_config(
        dir.path(),
        &format!("url = \"{}\"\nschema = \"{schema}\"\n", pg_url()),
        "",
    );
    let o = common::outbox(&["relay", "--drain", "--config", config.to_str().unwrap()]);
    common::assert_succeeded(&o, "outbox relay --drain");
    let delivered = common::jsonl(&sink);
    let ids: Vec<&str> = delivered
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(
        ids, written.committed,
        "{lang}: exactly the committed events, in commit order"
    );
    for m in &delivered {
        assert!(
            !written
                .rolled_back
                .iter()
                .any(|r| r == m["id"].as_str().unwrap())
        );
        assert_eq!(m["event_type"], "OrderPlaced");
    }
    let through_function = delivered
        .iter()
        .filter(|m| m["headers"]["writer"] == lang)
        .count();
    assert_eq!(through_function, 3, "{lang}: headers kept: {delivered:?}");
    common::drop_pg_schema(&pool, &schema).await;
}

#[tokio::test]
async fn a_python_writer_is_delivered_exactly_as_committed() {
    let mut python = Command::new(clients().join("inbox-py/bin/python"));
    python.arg(repo().join("examples/writers/python/writer.py"));
    delivers_exactly_what_a_writer_committed("python", python).await;
}

#[tokio::test]
async fn a_node_writer_is_delivered_exactly_as_committed() {
    let mut node = Command::new("node");
    node.env("NODE_PATH", clients().join("inbox-node/node_modules"))
        .arg(repo().join("examples/writers/node/writer.js"));
    delivers_exactly_what_a_writer_committed("node", node).await;
}
