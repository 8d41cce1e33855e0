//! Building the configured destinations into one routing sink.

use std::sync::Arc;

use outbox_engine::router::Router;
use outbox_types::Sink;
use outbox_types::route::RouteTable;

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

/// Check every destination as [`build`] would, without contacting any broker (what
/// `outbox config check` runs): the sinks that would connect at once (NATS, Kafka) are only
/// checked; the others connect lazily, so building them contacts nothing.
pub async fn check(config: &Config) -> Result<(), ConfigError> {
    let routes = config.route_table()?;
    let mut sinks = Vec::new();
    for (name, sink) in config.effective_destinations() {
        let invalid = |e: String| {
            ConfigError(format!(
                "invalid `destinations.{name}` ({}): {e}",
                sink.kind()
            ))
        };
        sink.built().map_err(|e| invalid(e.to_string()))?;
        let built: Arc<dyn Sink> = match &sink {
            #[cfg(feature = "nats")]
            #[cfg(feature = "nats")]
            SinkConfig::Nats(c) => {
                outbox_sink_nats::NatsSink::check_config(c).map_err(|e| invalid(e.to_string()))?;
                Arc::new(outbox_sink_stdout::StdoutSink::stdout())
            }
            #[cfg(feature = "kafka")]
            #[cfg(feature = "kafka")]
            SinkConfig::Kafka(c) => {
                outbox_sink_kafka::KafkaSink::check_config(c)
                    .map_err(|e| invalid(e.to_string()))?;
                Arc::new(outbox_sink_stdout::StdoutSink::stdout())
            }
            other => build_one(other).await.map_err(invalid)?,
        };
        sinks.push((name, built));
    }
    Router::new(routes, sinks).map_err(|e| ConfigError(e.to_string()))?;
    Ok(())
}

async fn build_one(sink: &SinkConfig) -> Result<Arc<dyn Sink>, String> {
    sink.built().map_err(|e| e.to_string())?;
    #[allow(unreachable_patterns)] // every arm is reachable only in a build with every sink
    Ok(match sink {
        SinkConfig::Stdout(c) => connected(
            outbox_sink_stdout::StdoutSink::stdout().with_format(c.format, c.topic.clone()),
        )?,
        SinkConfig::File(file) => connected(
            match outbox_sink_stdout::StdoutSink::file(&file.path, file.sync).await {
                Ok(sink) => sink.with_format(file.format, file.topic.clone()),
                Err(e) => Err(e),
            },
        )?,
        #[cfg(feature = "kafka")]
        SinkConfig::Kafka(c) => connected(outbox_sink_kafka::KafkaSink::connect(c.clone()))?,
        #[cfg(feature = "rabbitmq")]
        SinkConfig::Rabbitmq(c) => {
            connected(outbox_sink_rabbitmq::RabbitMqSink::connect(c.clone()))?
        }
        #[cfg(feature = "nats")]
        SinkConfig::Nats(c) => connected(outbox_sink_nats::NatsSink::connect(c.clone()).await)?,
        #[cfg(feature = "redis")]
        SinkConfig::Redis(c) => connected(outbox_sink_redis::RedisSink::connect(c.clone()))?,
        #[cfg(feature = "webhook")]
        SinkConfig::Webhook(c) => connected(outbox_sink_webhook::WebhookSink::connect(c.clone()))?,
        // Not reached: `built()` above refused a sink this build lacks.
        other => return Err(format!("the `{}` sink is not in this build", other.kind())),
    })
}

/// A sink as the router holds it, or why it could not be built, in words: every sink's
/// constructor ends here.
fn connected<S: Sink + 'static>(
    built: Result<S, impl std::fmt::Display>,
) -> Result<Arc<dyn Sink>, String> {
    Ok(Arc::new(built.map_err(|e| e.to_string())?))
}
