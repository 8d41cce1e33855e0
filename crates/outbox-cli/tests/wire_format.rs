//! What consumers receive, read the way a consumer team reads it: the relay publishes the same
//! events to every destination type in every body format, and `tests/wire/check.py` reads them
//! back with each broker's stock Python client (confluent-kafka, pika, nats-py, redis-py, an
//! `http.server` receiver), parses the CloudEvents ones with the official CloudEvents SDK and
//! verifies Standard Webhooks signatures with the `standardwebhooks` library. Every field is
//! checked against the tables of `docs/wire-format.md`, which the checker reads: a documented
//! row it does not check, or a checked field the document lacks, fails the test.

mod common;

use common::{fresh_pg_store, outbox, repo, text};

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Command, Stdio};

use outbox_types::{NewEvent, Store};
use serde_json::json;

fn python() -> PathBuf {
    let python = repo().join(".cache/inbox-py/bin/python");
    assert!(
        python.exists(),
        "the Python clients are not installed in {}: run scripts/inbox-deps.sh",
        python.display()
    );
    python
}

/// One destination of the run: its name, type and the TOML lines that set it up beyond the
/// connection (`{tag}` and `{port}` are filled in), and what the checker needs to know.
struct Variant {
    name: &'static str,
    kind: &'static str,
    toml: &'static str,
    facts: serde_json::Value,
}

fn variants() -> Vec<Variant> {
    let v = |name, kind, toml, facts| Variant {
        name,
        kind,
        toml,
        facts,
    };
    let ces = json!({"format": "cloudevents", "cloudevents_source": "/orders-service",
                     "cloudevents_type_prefix": "com.example.orders"});
    let ceb = json!({"format": "cloudevents", "cloudevents_source": "/orders-service",
                     "cloudevents_mode": "binary"});
    let raw = json!({"format": "raw"});
    let ces_toml = "format = \"cloudevents\"\ncloudevents_source = \"/orders-service\"\ncloudevents_type_prefix = \"com.example.orders\"";
    let ceb_toml = "format = \"cloudevents\"\ncloudevents_source = \"/orders-service\"\ncloudevents_mode = \"binary\"";
    vec![
        v("kafka_raw", "kafka", "", raw.clone()),
        v("kafka_ces", "kafka", ces_toml, ces.clone()),
        v("kafka_ceb", "kafka", ceb_toml, ceb.clone()),
        v("rabbit_raw", "rabbitmq", "", raw.clone()),
        v("rabbit_ces", "rabbitmq", ces_toml, ces.clone()),
        v("rabbit_ceb", "rabbitmq", ceb_toml, ceb.clone()),
        v("nats_raw", "nats", "", raw.clone()),
        v("nats_ces", "nats", ces_toml, ces.clone()),
        v("nats_ceb", "nats", ceb_toml, ceb.clone()),
        v("redis_raw", "redis", "", raw.clone()),
        v("redis_ces", "redis", ces_toml, ces.clone()),
        v(
            "hook_raw",
            "webhook",
            "secret = \"s3cret\"\nlegacy_headers = true",
            json!({"format": "raw", "legacy_headers": true}),
        ),
        v(
            "hook_ces",
            "webhook",
            "secret = \"s3cret\"\nformat = \"cloudevents\"\ncloudevents_source = \"/orders-service\"\ncloudevents_type_prefix = \"com.example.orders\"",
            ces,
        ),
        v(
            "hook_ceb",
            "webhook",
            "secret = \"whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw\"\nsignature_scheme = \"standard-webhooks\"\nformat = \"cloudevents\"\ncloudevents_source = \"/orders-service\"\ncloudevents_mode = \"binary\"",
            json!({"format": "cloudevents", "cloudevents_source": "/orders-service",
                   "cloudevents_mode": "binary", "signing": "standard-webhooks",
                   "secret": "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"}),
        ),
    ]
}

/// The connection lines and destination template of a variant.
fn destination(v: &Variant, tag: &str, port: u16, brokers: &str) -> String {
    let name = v.name;
    let connection = match v.kind {
        "kafka" => format!("brokers = [\"{brokers}\"]\ntopic = \"wire_{tag}_{name}\""),
        "rabbitmq" => format!(
            "url = \"amqp://guest:guest@127.0.0.1:5672/%2f\"\nexchange = \"wire_{tag}\"\nrouting_key = \"{name}.${{event_type}}\""
        ),
        "nats" => format!(
            "servers = [\"nats://127.0.0.1:4222\"]\nsubject = \"wire_{tag}.{name}.${{event_type}}\"\ncreate_stream = false"
        ),
        "redis" => format!("url = \"redis://127.0.0.1:6379\"\nstream = \"wire:{tag}:{name}\""),
        "webhook" => {
            format!("url = \"http://127.0.0.1:{port}/{name}/${{event_type}}\"")
        }
        other => panic!("no destination type {other}"),
    };
    format!(
        "\n[destinations.{name}]\ntype = \"{}\"\n{connection}\n{}\n",
        v.kind, v.toml
    )
}

/// The three events each destination gets: one with writer headers and an idempotency key,
/// one bare, one whose aggregate id has a space and whose payload has non-ASCII text.
fn events_for(variant: &str) -> Vec<NewEvent> {
    let at = chrono::DateTime::parse_from_rfc3339("2026-11-26T10:20:30.123456Z")
        .unwrap()
        .with_timezone(&chrono::Utc);
    vec![
        NewEvent::new(
            "order",
            "o-1",
            "OrderCreated",
            &json!({"total": 10, "note": "a b"}),
        )
        .unwrap()
        .with_header(
            "traceparent",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        )
        .with_header("Tenant-Id", "acme")
        .with_idempotency_key(format!("create-o-1-{variant}"))
        .with_occurred_at(at)
        .with_destination(variant),
        NewEvent::new("order", "o-1", "OrderPaid", &json!({"paid": true}))
            .unwrap()
            .with_occurred_at(at)
            .with_destination(variant),
        NewEvent::new(
            "customer",
            "c 7",
            "CustomerRenamed",
            &json!({"name": "Zoë 😀"}),
        )
        .unwrap()
        .with_header("x-note", "hello world")
        .with_occurred_at(at)
        .with_destination(variant),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_destination_sends_what_the_wire_format_document_says() {
    let Some(brokers) = outbox_testkit::kafka_brokers() else {
        return;
    };
    let tag = format!("w{}", std::process::id());
    let schema = format!("outbox_t_wire_{}", std::process::id());
    let store = fresh_pg_store(&schema).await;

    let variants = variants();
    let hint: Vec<_> = variants
        .iter()
        .map(|v| json!({"name": v.name, "type": v.kind}))
        .collect();
    let mut checker = Command::new(python())
        .arg(repo().join("crates/outbox-cli/tests/wire/check.py"))
        .arg(repo().join("docs/wire-format.md"))
        .arg(&tag)
        .arg(serde_json::to_string(&hint).unwrap())
        .env("WIRE_KAFKA", &brokers)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("python runs");
    let mut lines = BufReader::new(checker.stdout.take().unwrap()).lines();
    let ready = lines.next().expect("the checker says ready").unwrap();
    let port: u16 = ready
        .strip_prefix("ready ")
        .unwrap_or_else(|| panic!("the checker said {ready:?}"))
        .parse()
        .unwrap();

    let dir = tempfile::tempdir().unwrap();
    let mut config = format!(
        "{}\n[relay]\npoll_interval = \"20ms\"\npublish_timeout = \"10s\"\n",
        common::pg_database(&schema)
    );
    let mut spec = Vec::new();
    for v in &variants {
        config.push_str(&destination(v, &tag, port, &brokers));
        let events = events_for(v.name);
        let mut tx = store.pool().begin().await.unwrap();
        let mut expected = Vec::new();
        for e in &events {
            let id = store.outbox().enqueue(&mut *tx, e).await.unwrap();
            expected.push(json!({
                "id": id.id.to_string(),
                "aggregate_type": e.aggregate_type(),
                "aggregate_id": e.aggregate_id(),
                "event_type": e.event_type(),
                "payload": e.payload(),
                "headers": e.headers(),
                "idempotency_key": e.idempotency_key(),
                "occurred_at": "2026-11-26T10:20:30.123456+00:00",
            }));
        }
        tx.commit().await.unwrap();
        let mut facts = v.facts.clone();
        facts["name"] = json!(v.name);
        facts["type"] = json!(v.kind);
        facts["topic"] = json!(format!("wire_{tag}_{}", v.name));
        facts["events"] = json!(expected);
        spec.push(facts);
    }
    let config_path = common::write_config(dir.path(), &config);
    let relay = outbox(&[
        "relay",
        "--config",
        config_path.to_str().unwrap(),
        "--drain",
    ]);
    assert!(relay.status.success(), "relay: {}", text(&relay));
    let stats = store.stats().await.unwrap();
    assert_eq!(stats.dead, 0, "{stats:?}\n{}", text(&relay));

    let spec_path = dir.path().join("expected.json");
    std::fs::write(&spec_path, serde_json::to_vec_pretty(&spec).unwrap()).unwrap();
    let mut stdin = checker.stdin.take().unwrap();
    writeln!(stdin, "{}", spec_path.display()).unwrap();
    drop(stdin);
    let report: Vec<String> = lines.map(|l| l.unwrap()).collect();
    let status = checker.wait().unwrap();
    assert!(status.success(), "{}", report.join("\n"));
    assert!(
        report.iter().any(|l| l.starts_with("ok: 42 messages")),
        "{}",
        report.join("\n")
    );
    common::drop_pg_schema(store.pool(), &schema).await;
}
