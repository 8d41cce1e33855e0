//! Throughput of the RabbitMQ sink: publishes synthetic 400-byte events through
//! [`RabbitMqSink::publish`] in relay-sized batches — each batch holds one event per aggregate,
//! as the relay hands them — with publisher confirms, `mandatory` and persistent messages into a
//! durable queue, and prints events/s and the per-batch latency (p50, p99, max).
//!
//! ```text
//! cargo run --release -p outbox-sink-rabbitmq --example rabbitmq_drain -- [EVENTS] [BATCH] [IN_FLIGHT] [persistent|transient]
//! ```
//!
//! Defaults: 100000 events, batches of 500 over 10000 aggregates, 1 batch in flight (the
//! relay's default `max_batches_in_flight`), persistent messages (`transient` shows what the
//! broker's disk writes cost). `AMQP_URL` overrides the broker (default
//! `amqp://guest:guest@127.0.0.1:5672/%2f`). The run declares an exchange and a queue of its own
//! and deletes both at the end.

use std::sync::Arc;
use std::time::{Duration, Instant};

use lapin::options::{
    ExchangeDeleteOptions, QueueBindOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::FieldTable;
use lapin::{Connection, ConnectionProperties};
use outbox_sink_rabbitmq::{RabbitMqSink, RabbitMqSinkConfig};
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
    let persistent = arg(4, "persistent".to_owned()) != "transient";
    let url = std::env::var("AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
    let exchange = format!("outbox-drain-{}", std::process::id());
    let queue = format!("outbox-drain-{}", std::process::id());

    let config: RabbitMqSinkConfig = serde_json::from_value(serde_json::json!({
        "url": url,
        "exchange": exchange,
        "declare": true,
        "persistent": persistent,
    }))?;
    let sink = Arc::new(RabbitMqSink::new(&config)?);
    // Warm up (connects and declares the exchange), then bind a durable queue.
    let _ = sink.publish(&[synthetic(0)]).await;
    let admin = Connection::connect(&url, ConnectionProperties::default()).await?;
    let channel = admin.create_channel().await?;
    channel
        .queue_declare(
            queue.as_str().into(),
            QueueDeclareOptions {
                durable: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await?;
    channel
        .queue_bind(
            queue.as_str().into(),
            exchange.as_str().into(),
            "#".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await?;

    let batches: Vec<Vec<Event>> = (0..total)
        .map(synthetic)
        .collect::<Vec<_>>()
        .chunks(batch)
        .map(<[Event]>::to_vec)
        .collect();
    let queue_of_batches = Arc::new(std::sync::Mutex::new(batches.into_iter()));
    let started = Instant::now();
    let mut workers = tokio::task::JoinSet::new();
    for _ in 0..in_flight {
        let sink = sink.clone();
        let work = queue_of_batches.clone();
        workers.spawn(async move {
            let mut latencies = Vec::new();
            let mut failed = Vec::new();
            loop {
                let next = work.lock().map(|mut q| q.next()).unwrap_or(None);
                let Some(events) = next else { break };
                let t = Instant::now();
                let outcomes = sink.publish(&events).await;
                latencies.push(t.elapsed());
                failed.extend(outcomes.into_iter().filter(|o| *o != Outcome::Delivered));
            }
            (latencies, failed)
        });
    }
    let mut latencies = Vec::new();
    let mut failed = Vec::new();
    while let Some(done) = workers.join_next().await {
        let (l, f) = done?;
        latencies.extend(l);
        failed.extend(f);
    }
    let elapsed = started.elapsed();
    latencies.sort();
    println!(
        "rabbitmq drain: {total} events of {PAYLOAD_BYTES} B, batches of {batch} ({} batches), {in_flight} in flight, confirms + mandatory, {} messages into a durable queue",
        latencies.len(),
        if persistent {
            "persistent"
        } else {
            "transient"
        }
    );
    println!(
        "  {:.0} events/s in {:.2} s; per-batch latency p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms; {} not delivered",
        total as f64 / elapsed.as_secs_f64(),
        elapsed.as_secs_f64(),
        percentile(&latencies, 50.0).as_secs_f64() * 1e3,
        percentile(&latencies, 99.0).as_secs_f64() * 1e3,
        percentile(&latencies, 100.0).as_secs_f64() * 1e3,
        failed.len()
    );
    channel
        .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
        .await?;
    channel
        .exchange_delete(exchange.as_str().into(), ExchangeDeleteOptions::default())
        .await?;
    if let Some(first) = failed.first() {
        anyhow::bail!("{} events were not delivered, e.g. {first:?}", failed.len());
    }
    Ok(())
}
