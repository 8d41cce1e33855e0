//! Throughput of the Kafka sink: publishes synthetic 400-byte events through
//! [`KafkaSink::publish`] in relay-sized batches — each batch holds one event per aggregate, as
//! the relay hands them — and prints events/s and the per-batch latency (p50, p99, max).
//!
//! ```text
//! scripts/kafka.sh   # the test broker on 127.0.0.1:19092
//! cargo run --release -p outbox-sink-kafka --example kafka_drain -- [EVENTS] [BATCH] [IN_FLIGHT] [COMPRESSION]
//! ```
//!
//! Defaults: 100000 events, batches of 500 over 10000 aggregates, 1 batch in flight (the
//! relay's default `max_batches_in_flight`), no compression. `KAFKA_BROKERS` overrides the
//! broker address. Each run writes to a topic of its own (3 partitions, auto-created).

use std::sync::Arc;
use std::time::{Duration, Instant};

use outbox_sink_kafka::{KafkaSink, KafkaSinkConfig};
use outbox_types::{Event, EventId, Outcome, Sink};

const AGGREGATES: usize = 10_000;
const PAYLOAD_BYTES: usize = 400;

fn arg<T: std::str::FromStr>(n: usize, default: T) -> T {
    std::env::args()
        .nth(n)
        .and_then(|a| a.parse().ok())
        .unwrap_or(default)
}

/// Event number `n`, with a JSON payload of exactly `PAYLOAD_BYTES` bytes.
fn synthetic(n: usize) -> Event {
    let head = format!(r#"{{"n":{n},"pad":""#);
    let pad = PAYLOAD_BYTES.saturating_sub(head.len() + 2);
    let payload = format!("{head}{}\"}}", "x".repeat(pad));
    Event {
        seq: n as i64,
        id: EventId::new(),
        aggregate_type: "order".into(),
        aggregate_id: format!("order-{}", n % AGGREGATES),
        event_type: "OrderPlaced".into(),
        payload,
        destination: None,
        headers: [(
            "traceparent".to_owned(),
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".to_owned(),
        )]
        .into(),
        idempotency_key: None,
        occurred_at: chrono::Utc::now(),
        enqueued_at: chrono::Utc::now(),
        attempts: 0,
    }
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let total: usize = arg(1, 100_000);
    let batch: usize = arg(2, 500).clamp(1, AGGREGATES);
    let in_flight: usize = arg(3, 1).max(1);
    let compression: String = arg(4, "none".to_owned());
    let brokers = std::env::var("KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:19092".into());
    let topic = format!("outbox-drain-{}", std::process::id());

    let config: KafkaSinkConfig = serde_json::from_value(serde_json::json!({
        "brokers": brokers,
        "topic": topic,
        "compression": compression,
    }))?;
    let sink = Arc::new(KafkaSink::new(&config)?);
    if let Err(e) = sink.check().await {
        anyhow::bail!("{e} (start the test broker with scripts/kafka.sh)");
    }
    // Warm up: topic creation and the idempotent producer's id, outside the measurement.
    let warm = sink.publish(&[synthetic(0)]).await;
    anyhow::ensure!(warm == [Outcome::Delivered], "warm-up failed: {warm:?}");

    let batches: Vec<Vec<Event>> = (0..total)
        .map(synthetic)
        .collect::<Vec<_>>()
        .chunks(batch)
        .map(<[Event]>::to_vec)
        .collect();
    let queue = Arc::new(std::sync::Mutex::new(batches.into_iter()));
    let started = Instant::now();
    let mut workers = tokio::task::JoinSet::new();
    for _ in 0..in_flight {
        let sink = sink.clone();
        let queue = queue.clone();
        workers.spawn(async move {
            let mut latencies = Vec::new();
            let mut failed = 0usize;
            loop {
                let next = queue.lock().map(|mut q| q.next()).unwrap_or(None);
                let Some(events) = next else { break };
                let t = Instant::now();
                let outcomes = sink.publish(&events).await;
                latencies.push(t.elapsed());
                failed += outcomes
                    .iter()
                    .filter(|o| **o != Outcome::Delivered)
                    .count();
            }
            (latencies, failed)
        });
    }
    let mut latencies = Vec::new();
    let mut failed = 0;
    while let Some(done) = workers.join_next().await {
        let (l, f) = done?;
        latencies.extend(l);
        failed += f;
    }
    let elapsed = started.elapsed();
    latencies.sort();
    println!(
        "kafka drain: {total} events of {PAYLOAD_BYTES} B, batches of {batch} ({} batches), {in_flight} in flight, compression {compression}, brokers {brokers}",
        latencies.len()
    );
    println!(
        "  {:.0} events/s in {:.2} s; per-batch latency p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms; {failed} not delivered",
        total as f64 / elapsed.as_secs_f64(),
        elapsed.as_secs_f64(),
        percentile(&latencies, 50.0).as_secs_f64() * 1e3,
        percentile(&latencies, 99.0).as_secs_f64() * 1e3,
        percentile(&latencies, 100.0).as_secs_f64() * 1e3,
    );
    anyhow::ensure!(failed == 0, "{failed} events were not delivered");
    Ok(())
}
