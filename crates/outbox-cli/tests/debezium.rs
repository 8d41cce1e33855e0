//! A Debezium user's outbox moved over to `outbox relay`, as they would run it: the table
//! created with Debezium's documented DDL and written by plain SQL (insert only, and insert +
//! delete in one transaction), WAL mode with `sources = ["debezium"]` and the Outbox Event
//! Router's options in `[wal.debezium]`, destinations with `format = "debezium"`. A Kafka
//! consumer, a RabbitMQ queue and an HTTP receiver check key, value and headers against what Debezium 3.6
//! recorded for the same rows (`../shared/debezium-output.md` of the project's workspace,
//! restated in `docs/from-debezium.md`).

mod common;

use common::{outbox, text};

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::routing::post;
use outbox_postgresql::PgOutbox;
use rdkafka::ClientConfig;
use rdkafka::Message;
use rdkafka::admin::AdminOptions;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::Headers;
use rdkafka::{Offset, TopicPartitionList};

/// The rows every destination gets: one order event alone, one inserted and deleted in the
/// same transaction, one with a NULL payload.
const ROWS: &str = "
    INSERT INTO {t} VALUES ('00000000-0000-4000-8000-000000000001', 'Order', 'order-1', 'OrderCreated',
        '{\"items\": [{\"sku\": \"A-1\", \"qty\": 2}], \"amount\": 42}');
    BEGIN;
    INSERT INTO {t} VALUES ('00000000-0000-4000-8000-000000000002', 'Order', 'order-1', 'OrderPaid', '{\"paid\": true}');
    DELETE FROM {t} WHERE id = '00000000-0000-4000-8000-000000000002';
    COMMIT;
    INSERT INTO {t} VALUES ('00000000-0000-4000-8000-000000000003', 'Customer', 'c-9', 'CustomerDeleted', NULL);";

/// The recorded value of the first row with default options: the jsonb text as a JSON string.
const STRING_VALUE: &str = r#""{\"items\": [{\"qty\": 2, \"sku\": \"A-1\"}], \"amount\": 42}""#;

/// One config file per destination: its own slot and publication over the same table.
fn write_config(
    dir: &std::path::Path,
    name: &str,
    url: &str,
    schema: &str,
    debezium: &str,
    destination: &str,
) -> String {
    let head = common::wal_config(
        url,
        schema,
        &format!("{schema}_{name}"),
        "publish_timeout = \"10s\"\n",
        "sources = [\"debezium\"]\n",
    );
    let path = common::write_file(
        dir,
        &format!("{name}.toml"),
        &format!(
            r#"{head}
[wal.debezium]
table = "{schema}.outbox"
{debezium}

{destination}
"#
        ),
    );
    path.to_str().unwrap().to_owned()
}

type Request = (HashMap<String, String>, String);

/// A consumed Kafka record: topic, key, value (`None` for a tombstone), headers in order.
type Record = (String, String, Option<String>, Vec<(String, String)>);

async fn receive(
    State(received): State<Arc<Mutex<Vec<Request>>>>,
    headers: HeaderMap,
    body: String,
) -> &'static str {
    let headers = common::header_pairs(&headers);
    received.lock().unwrap().push((headers, body));
    "ok"
}

/// Up to `expected` records of `topics` (every partition, from the beginning; one minute at
/// most), with the partition each came from.
async fn read_kafka(
    brokers: &str,
    topics: &[String],
    expected: usize,
) -> (Vec<Record>, Vec<(String, i32)>) {
    let brokers = brokers.to_owned();
    let topics = topics.to_vec();
    tokio::task::spawn_blocking(move || {
        let consumer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", &brokers)
            .set("group.id", format!("dbz-check-{}", std::process::id()))
            .set("enable.auto.commit", "false")
            .create()
            .unwrap();
        let mut assignment = TopicPartitionList::new();
        for topic in &topics {
            let metadata = consumer
                .fetch_metadata(Some(topic), Duration::from_secs(10))
                .unwrap();
            let count = metadata
                .topics()
                .iter()
                .find(|t| t.name() == topic)
                .map_or(1, |t| t.partitions().len() as i32);
            for p in 0..count {
                assignment
                    .add_partition_offset(topic, p, Offset::Beginning)
                    .unwrap();
            }
        }
        consumer.assign(&assignment).unwrap();
        let mut records = Vec::new();
        let mut partitions = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(60);
        while records.len() < expected && Instant::now() < deadline {
            let Some(Ok(m)) = consumer.poll(Duration::from_millis(200)) else {
                continue;
            };
            partitions.push((m.topic().to_owned(), m.partition()));
            let headers = m
                .headers()
                .map(|h| {
                    h.iter()
                        .map(|h| {
                            (
                                h.key.to_owned(),
                                String::from_utf8_lossy(h.value.unwrap_or_default()).into_owned(),
                            )
                        })
                        .collect()
                })
                .unwrap_or_default();
            records.push((
                m.topic().to_owned(),
                String::from_utf8_lossy(m.key().unwrap_or_default()).into_owned(),
                m.payload().map(|p| String::from_utf8_lossy(p).into_owned()),
                headers,
            ));
        }
        (records, partitions)
    })
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_debezium_outbox_reaches_kafka_rabbitmq_and_a_webhook_in_debeziums_shape() {
    let Some(brokers) = outbox_testkit::kafka_brokers() else {
        return;
    };
    let url = outbox_testkit::logical_cluster_url();
    let schema = format!("dbz_{}", std::process::id());
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    PgOutbox::with_names(&schema, "events")
        .unwrap()
        .migrate(&pool)
        .await
        .unwrap();
    let table = outbox_wal::DebeziumTable {
        table: format!("{schema}.outbox"),
        ..Default::default()
    };
    common::pg_execute(&pool, outbox_wal::debezium_table_ddl(&table)).await;
    // A column for a `partition` placement; the rows below leave it to its default.
    common::pg_execute(
        &pool,
        format!("ALTER TABLE \"{schema}\".\"outbox\" ADD COLUMN shard int NOT NULL DEFAULT 1"),
    )
    .await;

    // Kafka: string payloads, a header placement, tombstones, topics by aggregate type.
    let prefix = format!("dbz{}", std::process::id());
    let topics = [
        format!("{prefix}.Order"),
        format!("{prefix}.Customer"),
        format!("{prefix}x.Order"),
        format!("{prefix}x.Customer"),
    ];
    let new: Vec<(&str, i32)> = topics
        .iter()
        .enumerate()
        .map(|(i, t)| (t.as_str(), if i < 2 { 1 } else { 2 }))
        .collect();
    let admin = common::kafka_topics(&brokers, &new).await;
    let dir = tempfile::tempdir().unwrap();
    let kafka_destination = format!(
        r#"[destinations.kafka]
type = "kafka"
brokers = ["{brokers}"]
format = "debezium""#
    );
    let kafka = write_config(
        dir.path(),
        "kafka",
        &url,
        &schema,
        &format!(
            r#""table.fields.additional.placement" = "type:header:eventType"
"route.topic.replacement" = "{prefix}.${{routedByValue}}"
"route.tombstone.on.empty.payload" = true"#
        ),
        &kafka_destination,
    );
    // Kafka again: expanded payloads with an envelope placement, tombstones, and the partition
    // from a column (two partitions; the rows name partition 1).
    let kexp = write_config(
        dir.path(),
        "kexp",
        &url,
        &schema,
        &format!(
            r#""table.expand.json.payload" = true
"table.fields.additional.placement" = "aggregatetype:envelope:aggType,type:header:eventType,shard:partition"
"route.topic.replacement" = "{prefix}x.${{routedByValue}}"
"route.tombstone.on.empty.payload" = true"#
        ),
        &kafka_destination,
    );
    // The webhook: expanded payloads, an envelope placement.
    let received: Arc<Mutex<Vec<Request>>> = Arc::default();
    let app = Router::new()
        .route("/hook", post(receive))
        .with_state(received.clone());
    let port = common::serve(app).await;
    let hook = write_config(
        dir.path(),
        "hook",
        &url,
        &schema,
        r#""table.expand.json.payload" = true
"table.fields.additional.placement" = "aggregatetype:envelope:aggType""#,
        &format!(
            r#"[destinations.hook]
type = "webhook"
url = "http://127.0.0.1:{port}/hook"
format = "debezium""#
        ),
    );

    // RabbitMQ: the defaults (string payloads); the topic is the routing key.
    let rabbit = lapin::Connection::connect(
        "amqp://guest:guest@127.0.0.1:5672/%2f",
        lapin::ConnectionProperties::default(),
    )
    .await
    .expect("RabbitMQ on 127.0.0.1:5672 (scripts/services.sh starts it)");
    let channel = rabbit.create_channel().await.unwrap();
    let exchange = format!("dbz_{}", std::process::id());
    outbox_testkit::rabbitmq::declare_topic_exchange(&channel, &exchange)
        .await
        .unwrap();
    let queue = format!("dbz_q_{}", std::process::id());
    outbox_testkit::rabbitmq::declare_bound_queue(&channel, &queue, &exchange, "outbox.event.#")
        .await
        .unwrap();
    let amqp = write_config(
        dir.path(),
        "amqp",
        &url,
        &schema,
        "",
        &format!(
            r#"[destinations.rabbitmq]
type = "rabbitmq"
url = "amqp://guest:guest@127.0.0.1:5672/%2f"
exchange = "{exchange}"
format = "debezium""#
        ),
    );

    for config in [&kafka, &kexp, &hook, &amqp] {
        let o = outbox(&["config", "check", "--config", config]);
        assert!(o.status.success(), "{}", text(&o));
        let o = outbox(&["wal", "prepare", "--config", config]);
        assert!(o.status.success(), "{}", text(&o));
    }
    common::pg_execute(
        &pool,
        ROWS.replace("{t}", &format!("\"{schema}\".\"outbox\"")),
    )
    .await;
    for config in [&kafka, &kexp, &hook, &amqp] {
        let o = outbox(&["relay", "--drain", "--config", config]);
        assert!(o.status.success(), "{}", text(&o));
    }

    // What a Kafka consumer reads: every partition from the beginning, assigned directly
    // (joining a consumer group takes ~20 s on the test broker), off the async workers.
    let (records, partitions) = read_kafka(&brokers, &topics, 6).await;
    assert_eq!(records.len(), 6, "{records:?}");
    let h = |id: u8, event_type: &str| {
        vec![
            (
                "id".to_owned(),
                format!("\"00000000-0000-4000-8000-00000000000{id}\""),
            ),
            ("eventType".to_owned(), format!("\"{event_type}\"")),
        ]
    };
    let orders: Vec<_> = records
        .iter()
        .filter(|r| r.0 == topics[0])
        .cloned()
        .collect();
    assert_eq!(
        orders,
        vec![
            (
                topics[0].clone(),
                "\"order-1\"".to_owned(),
                Some(STRING_VALUE.to_owned()),
                h(1, "OrderCreated")
            ),
            (
                topics[0].clone(),
                "\"order-1\"".to_owned(),
                Some(r#""{\"paid\": true}""#.to_owned()),
                h(2, "OrderPaid")
            ),
        ]
    );
    let tombstone = records.iter().find(|r| r.0 == topics[1]).unwrap();
    assert_eq!(
        tombstone,
        &(
            topics[1].clone(),
            "\"c-9\"".to_owned(),
            None,
            h(3, "CustomerDeleted")
        ),
        "a NULL payload is a tombstone with key and headers"
    );

    for (topic, partition) in &partitions {
        let named = topic.starts_with(&format!("{prefix}x."));
        assert_eq!(
            *partition,
            if named { 1 } else { 0 },
            "{topic}: the partition placement's value, else the only partition"
        );
    }
    let expanded: Vec<_> = records
        .iter()
        .filter(|r| r.0 == topics[2])
        .map(|r| r.2.clone())
        .collect();
    assert_eq!(
        expanded,
        vec![
            Some(
                r#"{"payload":{"items":[{"qty":2,"sku":"A-1"}],"amount":42},"aggType":"Order"}"#
                    .to_owned()
            ),
            Some(r#"{"payload":{"paid":true},"aggType":"Order"}"#.to_owned()),
        ]
    );
    let expanded_tombstone = records.iter().find(|r| r.0 == topics[3]).unwrap();
    assert_eq!(
        (expanded_tombstone.2.clone(), expanded_tombstone.3.clone()),
        (None, h(3, "CustomerDeleted")),
        "tombstones win over the envelope when asked for"
    );

    // What the HTTP receiver got: one URL for every topic, the expanded envelope.
    let requests = received.lock().unwrap().clone();
    assert_eq!(requests.len(), 3, "{requests:?}");
    let bodies: Vec<&str> = requests.iter().map(|(_, b)| b.as_str()).collect();
    // Per aggregate in commit order; the two aggregates may interleave.
    let (orders, others): (Vec<&str>, Vec<&str>) = bodies
        .iter()
        .partition(|b| b.contains(r#""aggType":"Order""#));
    assert_eq!(
        orders,
        vec![
            r#"{"payload":{"items":[{"qty":2,"sku":"A-1"}],"amount":42},"aggType":"Order"}"#,
            r#"{"payload":{"paid":true},"aggType":"Order"}"#,
        ]
    );
    assert_eq!(others, vec![r#"{"payload":null,"aggType":"Customer"}"#]);
    let created = requests.iter().find(|(_, b)| b.contains("amount")).unwrap();
    assert_eq!(
        created.0.get("id").map(String::as_str),
        Some("\"00000000-0000-4000-8000-000000000001\"")
    );

    // What the RabbitMQ queue holds: routing key = topic, body = value, `id` header.
    let mut deliveries = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    while deliveries.len() < 3 && Instant::now() < deadline {
        match channel
            .basic_get(
                queue.as_str().into(),
                lapin::options::BasicGetOptions { no_ack: true },
            )
            .await
            .unwrap()
        {
            Some(m) => deliveries.push(m.delivery),
            None => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
    let amqp_header = |d: &lapin::message::Delivery, name: &str| {
        let headers = d.properties.headers().as_ref()?;
        match headers
            .inner()
            .get(&lapin::types::ShortString::from(name))?
        {
            lapin::types::AMQPValue::LongString(s) => {
                Some(String::from_utf8_lossy(s.as_bytes()).into_owned())
            }
            other => Some(format!("{other:?}")),
        }
    };
    let seen: Vec<(String, String, Option<String>)> = deliveries
        .iter()
        .map(|d| {
            (
                d.routing_key.to_string(),
                String::from_utf8_lossy(&d.data).into_owned(),
                amqp_header(d, "id"),
            )
        })
        .collect();
    let id = |n: u8| Some(format!("\"00000000-0000-4000-8000-00000000000{n}\""));
    let order_msgs: Vec<_> = seen
        .iter()
        .filter(|m| m.0 == "outbox.event.Order")
        .cloned()
        .collect();
    assert_eq!(
        order_msgs,
        vec![
            (
                "outbox.event.Order".to_owned(),
                STRING_VALUE.to_owned(),
                id(1)
            ),
            (
                "outbox.event.Order".to_owned(),
                r#""{\"paid\": true}""#.to_owned(),
                id(2)
            ),
        ],
        "{seen:?}"
    );
    assert!(
        seen.contains(&("outbox.event.Customer".to_owned(), "null".to_owned(), id(3))),
        "a NULL payload is the value null (no tombstone option): {seen:?}"
    );
    let _ = channel
        .queue_delete(queue.as_str().into(), Default::default())
        .await;
    let _ = channel
        .exchange_delete(exchange.as_str().into(), Default::default())
        .await;

    // Nothing of ours in the Debezium table, nothing left in the outbox table.
    let dead: i64 = common::pg_value(
        &pool,
        format!("SELECT count(*) FROM \"{schema}\".\"events\""),
    )
    .await;
    assert_eq!(dead, 0);
    for config in [&kafka, &kexp, &hook, &amqp] {
        let o = outbox(&["wal", "drop-slot", "--config", config]);
        assert!(o.status.success(), "{}", text(&o));
    }
    let publications: Vec<String> = ["kafka", "kexp", "hook", "amqp"]
        .iter()
        .map(|name| format!("\"{schema}_{name}\""))
        .collect();
    common::pg_execute(
        &pool,
        format!("DROP PUBLICATION IF EXISTS {}", publications.join(", ")),
    )
    .await;
    common::drop_pg_schema_if_exists(&pool, &schema).await;
    let _ = admin
        .delete_topics(
            &topics.iter().map(String::as_str).collect::<Vec<_>>(),
            &AdminOptions::new(),
        )
        .await;
}

/// `outbox config import-debezium` turns a Debezium Server configuration for each sink, and a
/// Kafka Connect one, into a file that `outbox config check` accepts as it is; what is not
/// carried over is named on standard error.
#[test]
fn imported_debezium_configurations_pass_the_config_check() {
    let dir = tempfile::tempdir().unwrap();
    let source =
        "debezium.source.connector.class=io.debezium.connector.postgresql.PostgresConnector
debezium.source.database.hostname=127.0.0.1
debezium.source.database.user=postgres
debezium.source.database.dbname=test
debezium.source.plugin.name=pgoutput
debezium.source.table.include.list=public.outbox
debezium.source.snapshot.mode=initial
debezium.transforms=outbox
debezium.transforms.outbox.type=io.debezium.transforms.outbox.EventRouter
debezium.transforms.outbox.table.expand.json.payload=true
debezium.transforms.outbox.table.fields.additional.placement=type:header:eventType
";
    let sinks = [
        "debezium.sink.type=kafka\ndebezium.sink.kafka.producer.bootstrap.servers=127.0.0.1:19092\n",
        "debezium.sink.type=rabbitmq\ndebezium.sink.rabbitmq.connection.host=127.0.0.1\ndebezium.sink.rabbitmq.connection.username=guest\ndebezium.sink.rabbitmq.connection.password=guest\ndebezium.sink.rabbitmq.exchange=events\n",
        "debezium.sink.type=nats-jetstream\ndebezium.sink.nats-jetstream.url=nats://127.0.0.1:4222\n",
        "debezium.sink.type=redis\ndebezium.sink.redis.address=127.0.0.1:6379\n",
        "debezium.sink.type=http\ndebezium.sink.http.url=https://hooks.example.com/outbox\n",
    ];
    let connect = r#"{"name": "outbox", "config": {
        "connector.class": "io.debezium.connector.postgresql.PostgresConnector",
        "database.hostname": "127.0.0.1", "database.user": "postgres", "database.dbname": "test",
        "plugin.name": "pgoutput", "slot.name": "debezium",
        "transforms": "outbox",
        "transforms.outbox.type": "io.debezium.transforms.outbox.EventRouter"}}"#;
    let mut inputs: Vec<(String, Vec<&str>)> = sinks
        .iter()
        .map(|s| (format!("{source}{s}"), vec![]))
        .collect();
    inputs.push((
        connect.to_owned(),
        vec!["--kafka-brokers", "127.0.0.1:19092", "--reuse-slot"],
    ));
    for (i, (input, flags)) in inputs.iter().enumerate() {
        let from = dir.path().join(format!("debezium-{i}"));
        std::fs::write(&from, input).unwrap();
        let mut args = vec!["config", "import-debezium", from.to_str().unwrap()];
        args.extend(flags);
        let o = outbox(&args);
        assert!(o.status.success(), "{}", text(&o));
        let toml = String::from_utf8(o.stdout.clone()).unwrap();
        common::assert_contains(&toml, "format = \"debezium\"");
        let stderr = String::from_utf8_lossy(&o.stderr);
        if i == 0 {
            common::assert_contains(&stderr, "snapshot.mode");
        }
        let to = dir.path().join(format!("outbox-{i}.toml"));
        std::fs::write(&to, &toml).unwrap();
        let o = outbox(&["config", "check", "--config", to.to_str().unwrap()]);
        assert!(o.status.success(), "{toml}\n{}", text(&o));
    }
    // Not a PostgreSQL connector: refused, naming why.
    let mysql = common::write_file(
        dir.path(),
        "mysql.json",
        r#"{"config": {"connector.class": "io.debezium.connector.mysql.MySqlConnector"}}"#,
    );
    let o = outbox(&["config", "import-debezium", mysql.to_str().unwrap()]);
    assert!(!o.status.success());
    common::assert_contains(&text(&o), "PostgreSQL connector");
}
