//! Throughput of the Redis sink: publishes synthetic 400-byte events through
//! [`RedisSink::publish`] in relay-sized batches (one event per aggregate per batch, as the relay
//! hands them) and prints events/s and the per-batch publish latency.
//!
//! ```text
//! cargo run --release -p outbox-sink-redis --example redis_drain -- [EVENTS] [BATCH] [IN_FLIGHT]
//! ```
//!
//! Defaults: 100000 events, batches of 500, 2 batches in flight (the relay's default is 1; this measures the sink
//! with two overlapping, as `max_batches_in_flight = 2` would). Needs Redis on `REDIS_URL` (default `redis://127.0.0.1:6379`); it
//! appends to a stream key of its own and deletes it at the end.

use std::sync::Arc;
use std::time::{Duration, Instant};

use outbox_sink_redis::{RedisSink, RedisSinkConfig};
use outbox_types::{Event, EventId, Outcome, Sink};

fn arg(n: usize, default: usize) -> usize {
    std::env::args()
        .nth(n)
        .and_then(|a| a.parse().ok())
        .unwrap_or(default)
}

/// Event `i` of `batch`, with a JSON payload of exactly `size` bytes.
fn synthetic(batch: usize, i: usize, size: usize) -> Event {
    let head = format!(r#"{{"batch":{batch},"i":{i},"pad":""#);
    let pad = size.saturating_sub(head.len() + 2);
    let payload = format!("{head}{}\"}}", "x".repeat(pad));
    Event {
        seq: (batch * 100_000 + i) as i64,
        id: EventId::new(),
        aggregate_type: "order".into(),
        aggregate_id: format!("order-{i}"),
        event_type: "OrderPlaced".into(),
        payload,
        destination: None,
        headers: [(
            "traceparent".to_owned(),
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".to_owned(),
        )]
        .into_iter()
        .collect(),
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
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let total = arg(1, 100_000);
    let batch_size = arg(2, 500).max(1);
    let in_flight = arg(3, 2).max(1);
    let url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned());
    let key = format!("drain:{}", std::process::id());

    let config: RedisSinkConfig = serde_json::from_value(serde_json::json!({
        "url": url,
        "stream": key,
        "maxlen": 1_000_000,
    }))?;
    let sink = Arc::new(RedisSink::connect(config)?);

    let batches: Vec<Vec<Event>> = (0..total.div_ceil(batch_size))
        .map(|b| {
            let n = batch_size.min(total - b * batch_size);
            (0..n).map(|i| synthetic(b, i, 400)).collect()
        })
        .collect();
    // Warm-up: connection.
    let warm = sink
        .publish(&[synthetic(usize::MAX / 200_000, 0, 400)])
        .await;
    if warm != vec![Outcome::Delivered] {
        return Err(format!("warm-up publish failed: {warm:?}").into());
    }

    let queue = Arc::new(tokio::sync::Mutex::new(batches.into_iter()));
    let started = Instant::now();
    let mut workers = tokio::task::JoinSet::new();
    for _ in 0..in_flight {
        let sink = sink.clone();
        let queue = queue.clone();
        workers.spawn(async move {
            let mut latencies = Vec::new();
            let mut failed = 0usize;
            let mut delivered = 0usize;
            loop {
                let Some(batch) = queue.lock().await.next() else {
                    break;
                };
                let t = Instant::now();
                let outcomes = sink.publish(&batch).await;
                latencies.push(t.elapsed());
                for o in outcomes {
                    match o {
                        Outcome::Delivered => delivered += 1,
                        other => {
                            if failed == 0 {
                                eprintln!("first failure: {other:?}");
                            }
                            failed += 1;
                        }
                    }
                }
            }
            (latencies, delivered, failed)
        });
    }
    let mut latencies = Vec::new();
    let (mut delivered, mut failed) = (0, 0);
    while let Some(done) = workers.join_next().await {
        let (l, d, f) = done?;
        latencies.extend(l);
        delivered += d;
        failed += f;
    }
    let elapsed = started.elapsed();
    latencies.sort();

    println!(
        "redis: {delivered} delivered, {failed} failed, {total} events of 400 B in batches of {batch_size}, {in_flight} in flight"
    );
    println!(
        "redis: {:.0} events/s over {:.2} s; per-batch publish latency p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms",
        delivered as f64 / elapsed.as_secs_f64(),
        elapsed.as_secs_f64(),
        percentile(&latencies, 50.0).as_secs_f64() * 1e3,
        percentile(&latencies, 99.0).as_secs_f64() * 1e3,
        latencies.last().copied().unwrap_or_default().as_secs_f64() * 1e3,
    );

    let mut con = redis::Client::open(url)?
        .get_multiplexed_async_connection()
        .await?;
    let _: () = redis::cmd("DEL").arg(&key).query_async(&mut con).await?;
    Ok(())
}
