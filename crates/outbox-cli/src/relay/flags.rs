//! The relay's command-line flags, layered over its configuration file and environment.
//!
//! Why its own module: `outbox relay` has flags no other command has (`--sink`, `--mode`,
//! `--drain`, …); turning them into configuration keys, and refusing a bad one with a message
//! that names it, is one job.

use serde_json::json;

use crate::RelayArgs;
use crate::config::{self, Config, ConfigError, SinkConfig};
use crate::duration_flag;

/// The relay's configuration: the file and environment, with the flags on top.
pub(super) fn load(args: &RelayArgs) -> Result<Config, ConfigError> {
    let extra = vec![
        ("relay.batch_size", args.batch_size.map(|v| json!(v))),
        (
            "relay.poll_interval",
            duration_flag("relay.poll_interval", &args.poll_interval)?,
        ),
        ("relay.lease", duration_flag("relay.lease", &args.lease)?),
        ("relay.stop_when_idle", args.drain.then_some(json!(true))),
        (
            "relay.drain_wait",
            duration_flag("relay.drain_wait", &args.drain_wait)?,
        ),
        ("mode", mode_flag(&args.mode)?),
        (
            "metrics.listen",
            args.metrics_listen.clone().map(|v| json!(v)),
        ),
    ];
    let sink_override = sink_flag(&args.sink)?;
    let mut config = args.db.load(extra)?;
    if let Some((name, sink)) = sink_override {
        config.override_sink(&name, sink);
    }
    Ok(config)
}

fn mode_flag(value: &Option<String>) -> Result<Option<serde_json::Value>, ConfigError> {
    match value.as_deref() {
        None => Ok(None),
        Some(m @ ("poll" | "wal")) => Ok(Some(json!(m))),
        Some(other) => Err(ConfigError(format!(
            "unknown --mode `{other}`: use `poll` or `wal`"
        ))),
    }
}

fn sink_flag(value: &Option<String>) -> Result<Option<(String, SinkConfig)>, ConfigError> {
    match value.as_deref() {
        None => Ok(None),
        Some("stdout") => Ok(Some(("stdout".into(), SinkConfig::default()))),
        Some(other) => match other.strip_prefix("file:") {
            Some(path) if !path.is_empty() => Ok(Some((
                "file".into(),
                SinkConfig::File(config::FileSinkConfig::at(path)),
            ))),
            _ => Err(ConfigError(format!(
                "unknown --sink `{other}`: use `stdout` or `file:PATH` (brokers and webhooks are configured as [destinations.NAME] in the config file)"
            ))),
        },
    }
}
