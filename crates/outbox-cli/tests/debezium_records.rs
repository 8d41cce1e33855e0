//! The Kafka records Debezium's Outbox Event Router sends, pinned in
//! `tests/debezium/records.json` (derived from Debezium's source — `EventRouterDelegate`,
//! `JsonSchemaData`, `DebeziumHeaderProducer`, Kafka's `RegexRouter` and `JsonConverter` — and
//! its recorded output), checked through the real thing: each case's rows are written by plain
//! SQL into a Debezium-shaped table, `outbox relay --drain` sends them with the `debezium`
//! source and a `format = "debezium"` Kafka destination, and an rdkafka consumer reads every
//! record back: topic, partition, key, value or tombstone, headers in order with their bytes,
//! timestamp.

mod common;

use common::{outbox, text};

use std::time::{Duration, Instant};

use outbox_postgresql::PgOutbox;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Headers, Message, Timestamp};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use serde_json::Value;

/// A record as the consumer read it.
#[derive(Debug, PartialEq)]
struct Record {
    topic: String,
    partition: i32,
    key: Option<String>,
    value: Option<String>,
    headers: Vec<(String, Option<String>)>,
    timestamp: Option<i64>,
}

/// Every record of `topic` from the beginning, until `expected` came (one minute at most).
fn read(brokers: &str, topic: &str, partitions: i32, expected: usize) -> Vec<Record> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", format!("dbz-records-{}", std::process::id()))
        .set("enable.auto.commit", "false")
        .create()
        .unwrap();
    let mut assignment = TopicPartitionList::new();
    for p in 0..partitions {
        assignment
            .add_partition_offset(topic, p, Offset::Beginning)
            .unwrap();
    }
    consumer.assign(&assignment).unwrap();
    let mut out = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    let bytes = |b: Option<&[u8]>| b.map(|b| String::from_utf8(b.to_vec()).unwrap());
    while out.len() < expected && Instant::now() < deadline {
        let Some(Ok(m)) = consumer.poll(Duration::from_millis(200)) else {
            continue;
        };
        let headers = m
            .headers()
            .map(|h| {
                h.iter()
                    .map(|h| (h.key.to_owned(), bytes(h.value)))
                    .collect()
            })
            .unwrap_or_default();
        out.push(Record {
            topic: m.topic().to_owned(),
            partition: m.partition(),
            key: bytes(m.key()),
            value: bytes(m.payload()),
            headers,
            timestamp: match m.timestamp() {
                Timestamp::CreateTime(ms) | Timestamp::LogAppendTime(ms) => Some(ms),
                Timestamp::NotAvailable => None,
            },
        });
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn debeziums_records_byte_for_byte_through_kafka() {
    let Some(brokers) = outbox_testkit::kafka_brokers() else {
        return;
    };
    let file: Value = serde_json::from_str(include_str!("debezium/records.json")).unwrap();
    let url = outbox_testkit::logical_cluster_url();
    let run = format!(
        "r{}x{}",
        std::process::id(),
        chrono::Utc::now().timestamp() % 100_000
    );
    let schema = format!("dbzrec_{run}");
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    PgOutbox::with_names(&schema, "events")
        .unwrap()
        .migrate(&pool)
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let started = chrono::Utc::now().timestamp_millis();
    let fill = |s: &str| s.replace("{run}", &run);

    for (i, case) in file["cases"].as_array().unwrap().iter().enumerate() {
        let name = case["name"].as_str().unwrap();
        let table = format!("\"{schema}\".\"outbox_{i}\"");
        common::pg_execute(
            &pool,
            format!(
                "CREATE TABLE {table} (id uuid PRIMARY KEY, aggregatetype varchar(255) NOT NULL,
                 aggregateid varchar(255) NOT NULL, type varchar(255) NOT NULL, payload jsonb {})",
                case["columns"].as_str().unwrap()
            ),
        )
        .await;
        let records = case["records"].as_array().unwrap();
        let topic = fill(records[0]["topic"].as_str().unwrap());
        let partitions = case["partitions"].as_i64().unwrap() as i32;
        let _admin = common::kafka_topics(&brokers, &[(topic.as_str(), partitions)]).await;
        let mut options = String::new();
        for (key, value) in case["options"].as_object().unwrap() {
            let value = match value {
                Value::String(s) => Value::String(fill(s)),
                other => other.clone(),
            };
            options.push_str(&format!("{key:?} = {value}\n"));
        }
        let config = common::write_file(
            dir.path(),
            &format!("case{i}.toml"),
            &format!(
                "{}\n[wal.debezium]\ntable = \"{schema}.outbox_{i}\"\n{options}\n[destinations.kafka]\ntype = \"kafka\"\nbrokers = [\"{brokers}\"]\nformat = \"debezium\"\n",
                common::wal_config(
                    &url,
                    &schema,
                    &format!("{schema}_{i}"),
                    "publish_timeout = \"10s\"\n",
                    "sources = [\"debezium\"]\n"
                )
            ),
        );
        let config = config.to_str().unwrap();
        let o = outbox(&["wal", "prepare", "--config", config]);
        assert!(o.status.success(), "{name}: {}", text(&o));
        for row in case["rows"].as_array().unwrap() {
            let sql = fill(row.as_str().unwrap()).replace("{t}", &table);
            common::pg_execute(&pool, sql).await;
        }
        let o = outbox(&["relay", "--drain", "--config", config]);
        assert!(o.status.success(), "{name}: {}", text(&o));
        let brokers_owned = brokers.clone();
        let topic_owned = topic.clone();
        let expected = records.len();
        let got = tokio::task::spawn_blocking(move || {
            read(&brokers_owned, &topic_owned, partitions, expected)
        })
        .await
        .unwrap();
        assert_eq!(got.len(), records.len(), "{name}: {got:#?}");
        let now = chrono::Utc::now().timestamp_millis();
        for (n, (want, got)) in records.iter().zip(&got).enumerate() {
            let at = format!("{name}, record {n}");
            assert_eq!(got.topic, fill(want["topic"].as_str().unwrap()), "{at}");
            assert_eq!(
                got.partition,
                want["partition"].as_i64().unwrap() as i32,
                "{at}"
            );
            assert_eq!(got.key.as_deref(), want["key"].as_str(), "{at}");
            let tombstone = want["tombstone"].as_bool().unwrap();
            assert_eq!(got.value.is_none(), tombstone, "{at}: tombstone");
            assert_eq!(
                got.value.as_deref(),
                want["value"].as_str().map(fill).as_deref(),
                "{at}: value"
            );
            let headers: Vec<(String, Option<String>)> = want["headers"]
                .as_array()
                .unwrap()
                .iter()
                .map(|h| {
                    (
                        h[0].as_str().unwrap().to_owned(),
                        h[1].as_str().map(str::to_owned),
                    )
                })
                .collect();
            assert_eq!(
                got.headers.iter().map(|h| &h.0).collect::<Vec<_>>(),
                headers.iter().map(|h| &h.0).collect::<Vec<_>>(),
                "{at}: header names in order"
            );
            for ((name, want), (_, got)) in headers.iter().zip(&got.headers) {
                if want.as_deref() == Some("*uuid7*") {
                    let got = got.as_deref().unwrap_or_default();
                    let id = uuid::Uuid::parse_str(got.trim_matches('"'))
                        .unwrap_or_else(|e| panic!("{at}: {name} = {got}: {e}"));
                    assert!(got.starts_with('"') && got.ends_with('"'), "{at}: {got}");
                    assert_eq!(id.get_version_num(), 7, "{at}: {got}");
                } else {
                    assert_eq!(got, want, "{at}: header {name}");
                }
            }
            match want["timestamp"].as_i64() {
                Some(ms) => assert_eq!(got.timestamp, Some(ms), "{at}: timestamp"),
                None => {
                    let ts = got.timestamp.unwrap_or_default();
                    assert!(
                        (started - 1000..=now + 1000).contains(&ts),
                        "{at}: the producer's clock, got {ts}"
                    );
                }
            }
        }
    }
    let dead: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM \"{schema}\".events"
    )))
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(dead, 0, "nothing waits or is dead");
    for i in 0..file["cases"].as_array().unwrap().len() {
        let _ = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT pg_drop_replication_slot('{schema}_{i}')"
        )))
        .execute(&pool)
        .await;
    }
    common::pg_execute(&pool, format!("DROP SCHEMA \"{schema}\" CASCADE")).await;
}
