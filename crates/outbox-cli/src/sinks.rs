//! Building the configured destinations into one routing sink.

use std::sync::Arc;

use outbox_core::Sink;
use outbox_core::route::RouteTable;
use outbox_relay::router::Router;

use crate::config::{Config, ConfigError, SinkConfig};

/// Every destination's sink behind a [`Router`], and the route table the relay needs to skip
/// paused destinations. A broker that is down is not an error here: sinks connect lazily and
/// report unreachable brokers as retryable failures, so events wait in the outbox.
pub async fn build(config: &Config) -> Result<(Arc<dyn Sink>, Arc<RouteTable>), ConfigError> {
    let routes = config.route_table()?;
    let mut sinks = Vec::new();
    for (name, sink) in config.effective_destinations() {
        let built = build_one(&sink).await.map_err(|e| {
            ConfigError(format!(
                "invalid `destinations.{name}` ({}): {e}",
                sink.kind()
            ))
        })?;
        sinks.push((name, built));
    }
    let router = Router::new(routes, sinks).map_err(|e| ConfigError(e.to_string()))?;
    let routes = router.routes();
    Ok((Arc::new(router), routes))
}

async fn build_one(sink: &SinkConfig) -> Result<Arc<dyn Sink>, String> {
    Ok(match sink {
        SinkConfig::Stdout => Arc::new(outbox_sink_stdout::StdoutSink::stdout()),
        SinkConfig::File(file) => Arc::new(
            outbox_sink_stdout::StdoutSink::file(&file.path, file.sync)
                .await
                .map_err(|e| e.to_string())?,
        ),
        SinkConfig::Kafka(c) => {
            Arc::new(outbox_sink_kafka::KafkaSink::new(c).map_err(|e| e.to_string())?)
        }
        SinkConfig::Rabbitmq(c) => {
            Arc::new(outbox_sink_rabbitmq::RabbitMqSink::new(c).map_err(|e| e.to_string())?)
        }
        SinkConfig::Nats(c) => Arc::new(
            outbox_sink_nats::NatsSink::connect(c.clone())
                .await
                .map_err(|e| e.to_string())?,
        ),
        SinkConfig::Redis(c) => {
            Arc::new(outbox_sink_redis::RedisSink::connect(c.clone()).map_err(|e| e.to_string())?)
        }
        SinkConfig::Webhook(c) => Arc::new(
            outbox_sink_webhook::WebhookSink::connect(c.clone()).map_err(|e| e.to_string())?,
        ),
    })
}
