//! The relay's configuration: one TOML file, layered with `OUTBOX_…` environment variables and
//! command-line flags (flags win over the environment, which wins over the file).
//!
//! Environment mapping: a double underscore separates levels, so `OUTBOX_DATABASE__URL` sets
//! `database.url` and `OUTBOX_RELAY__BATCH_SIZE` sets `relay.batch_size`.
//!
//! Unknown keys are errors, not silently ignored: a misspelt `bach_size` would otherwise run
//! with the default and nobody would notice.

use std::path::{Path, PathBuf};

use figment::Figment;
use figment::providers::{Env, Format, Serialized, Toml};
use outbox_relay::RelayConfig;
use serde::{Deserialize, Serialize};

/// Top-level sections; environment variables outside them (`OUTBOX_TEST_…`, `OUTBOX_LOG`) are
/// not configuration.
const SECTIONS: [&str; 5] = ["database", "relay", "sink", "retention", "metrics"];

/// The whole file.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Where the outbox lives.
    #[serde(default)]
    pub database: DatabaseConfig,
    /// How the relay claims and retries.
    #[serde(default)]
    pub relay: RelayConfig,
    /// Where events go.
    #[serde(default)]
    pub sink: SinkConfig,
    /// How long delivered events are kept.
    #[serde(default)]
    pub retention: RetentionConfig,
    /// Prometheus and health endpoints.
    #[serde(default)]
    pub metrics: MetricsConfig,
}

/// `[metrics]`: where `/metrics`, `/healthz` and `/readyz` are served (off unless `listen` is
/// set).
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MetricsConfig {
    /// e.g. `0.0.0.0:9464`.
    pub listen: Option<std::net::SocketAddr>,
    /// How often the backlog gauges are read from the database.
    #[serde(with = "outbox_core::humantime_duration")]
    pub refresh: std::time::Duration,
}

impl Default for MetricsConfig {
    fn default() -> Self {
        MetricsConfig {
            listen: None,
            refresh: std::time::Duration::from_secs(10),
        }
    }
}

/// `[retention]`: the relay deletes delivered events after a while, in batches by primary key,
/// and never touches an event in any other state.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RetentionConfig {
    /// Run retention inside `outbox relay`.
    pub enabled: bool,
    /// Delivered events older than this are deleted.
    #[serde(with = "outbox_core::humantime_duration")]
    pub delivered: std::time::Duration,
    /// How often the relay runs retention.
    #[serde(with = "outbox_core::humantime_duration")]
    pub interval: std::time::Duration,
    /// Rows deleted per statement (short transactions, no long locks).
    pub batch_size: u32,
}

impl Default for RetentionConfig {
    fn default() -> Self {
        RetentionConfig {
            enabled: true,
            delivered: std::time::Duration::from_secs(7 * 86_400),
            interval: std::time::Duration::from_secs(3600),
            batch_size: 5000,
        }
    }
}

/// `[database]`.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DatabaseConfig {
    /// `postgres://user:pass@host:5432/db` or `sqlite://path/to/file.db`.
    pub url: String,
    /// PostgreSQL schema of the outbox table.
    pub schema: String,
    /// Outbox table name (default `events` on PostgreSQL, `outbox_events` on SQLite).
    pub table: Option<String>,
}

impl Default for DatabaseConfig {
    fn default() -> Self {
        DatabaseConfig {
            url: String::new(),
            schema: "outbox".into(),
            table: None,
        }
    }
}

/// `[sink]`: the destination.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, tag = "type", rename_all = "snake_case")]
pub enum SinkConfig {
    /// JSON lines on standard output.
    #[default]
    Stdout,
    /// JSON lines appended to a file.
    File {
        /// The file.
        path: PathBuf,
        /// Force each batch to disk before it counts as delivered.
        #[serde(default)]
        sync: bool,
    },
}

/// A configuration problem: the message names the key or value and how to fix it. Exit code 2.
#[derive(Debug)]
pub struct ConfigError(pub String);

impl std::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ConfigError {}

/// Read `file` (if any), then the environment, then `overrides` (flags), and check the result.
pub fn load(file: Option<&Path>, overrides: Figment) -> Result<Config, ConfigError> {
    let mut figment = Figment::new();
    if let Some(path) = file {
        if !path.exists() {
            return Err(ConfigError(format!(
                "config file `{}` does not exist",
                path.display()
            )));
        }
        figment = figment.merge(Toml::file(path));
    }
    figment = figment
        .merge(
            Env::prefixed("OUTBOX_")
                .filter(|key| {
                    let key = key.as_str().to_ascii_lowercase();
                    SECTIONS.iter().any(|s| key.starts_with(&format!("{s}__")))
                })
                .split("__"),
        )
        .merge(overrides);
    let config: Config = figment.extract().map_err(|e| ConfigError(describe(e)))?;
    if config.database.url.trim().is_empty() {
        return Err(ConfigError(
            "no database URL: set `database.url` in the config file, OUTBOX_DATABASE__URL, or --database-url".into(),
        ));
    }
    if config.relay.batch_size == 0 {
        return Err(ConfigError("`relay.batch_size` must be at least 1".into()));
    }
    if config.relay.lease <= config.relay.publish_timeout {
        return Err(ConfigError(format!(
            "`relay.lease` ({}) must be longer than `relay.publish_timeout` ({}): a publish must end before another relay may claim the same events",
            outbox_core::humantime_duration::format_duration(config.relay.lease),
            outbox_core::humantime_duration::format_duration(config.relay.publish_timeout),
        )));
    }
    Ok(config)
}

/// One line per problem, naming the key.
fn describe(error: figment::Error) -> String {
    error
        .into_iter()
        .map(|e| {
            let key = if e.path.is_empty() { None } else { Some(e.path.join(".")) };
            let source = e
                .metadata
                .as_ref()
                .and_then(|m| m.source.as_ref())
                .map(|s| format!(" (from {s})"))
                .unwrap_or_default();
            match (key, &e.kind) {
                (_, figment::error::Kind::UnknownField(field, expected)) => {
                    let suggestion = nearest(field, expected)
                        .map(|s| format!("; did you mean `{s}`?"))
                        .unwrap_or_default();
                    format!(
                        "invalid configuration: unknown key `{}`{source}{suggestion} (valid keys here: {})",
                        qualified(&e.path, field),
                        expected.join(", ")
                    )
                }
                (Some(key), kind) => format!("invalid configuration: `{key}`{source}: {kind}"),
                (None, kind) => format!("invalid configuration{source}: {kind}"),
            }
        })
        .collect::<Vec<_>>()
        .join("\n")
}

fn qualified(path: &[String], field: &str) -> String {
    let mut parts: Vec<&str> = path.iter().map(String::as_str).collect();
    if parts.last() != Some(&field) {
        parts.push(field);
    }
    parts.join(".")
}

/// The expected key closest to `field` by edit distance, if it is close enough to be a typo.
fn nearest<'a>(field: &str, expected: &'a [&'static str]) -> Option<&'a str> {
    expected
        .iter()
        .map(|candidate| (levenshtein(field, candidate), *candidate))
        .filter(|(d, c)| *d <= (c.len() / 3).max(2))
        .min_by_key(|(d, _)| *d)
        .map(|(_, c)| c)
}

fn levenshtein(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut prev = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let cur = row[j + 1];
            row[j + 1] = if ca == *cb {
                prev
            } else {
                1 + prev.min(row[j]).min(row[j + 1])
            };
            prev = cur;
        }
    }
    row[b.len()]
}

/// Flags given on the command line, as a figment layer.
pub fn flags(pairs: Vec<(&'static str, Option<serde_json::Value>)>) -> Figment {
    let mut figment = Figment::new();
    for (key, value) in pairs {
        if let Some(value) = value {
            figment = figment.merge(Serialized::global(key, value));
        }
    }
    figment
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(text: &str) -> tempfile::NamedTempFile {
        let f = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(f.path(), text).unwrap();
        f
    }

    #[test]
    fn unknown_key_is_named_with_a_suggestion() {
        let f = write("[database]\nurl = \"postgres://x/y\"\n[relay]\nbach_size = 10\n");
        let err = load(Some(f.path()), Figment::new()).unwrap_err().0;
        assert!(err.contains("unknown key `relay.bach_size`"), "{err}");
        assert!(err.contains("did you mean `batch_size`?"), "{err}");
    }

    #[test]
    fn bad_duration_names_the_key() {
        let f =
            write("[database]\nurl = \"postgres://x/y\"\n[relay]\npoll_interval = \"5 parsecs\"\n");
        let err = load(Some(f.path()), Figment::new()).unwrap_err().0;
        assert!(err.contains("relay.poll_interval"), "{err}");
        assert!(err.contains("unknown unit `parsecs`"), "{err}");
    }

    #[test]
    fn missing_url_says_where_to_set_it() {
        let f = write("[relay]\nbatch_size = 10\n");
        let err = load(Some(f.path()), Figment::new()).unwrap_err().0;
        assert!(err.contains("database.url"), "{err}");
    }

    #[test]
    fn flags_override_the_file() {
        let f = write("[database]\nurl = \"postgres://x/y\"\n[relay]\nbatch_size = 10\n");
        let over = flags(vec![("relay.batch_size", Some(serde_json::json!(77)))]);
        let config = load(Some(f.path()), over).unwrap();
        assert_eq!(config.relay.batch_size, 77);
    }

    #[test]
    fn unknown_sink_type_is_rejected() {
        let f = write("[database]\nurl = \"postgres://x/y\"\n[sink]\ntype = \"kafak\"\n");
        let err = load(Some(f.path()), Figment::new()).unwrap_err().0;
        assert!(err.contains("kafak"), "{err}");
    }
}

#[cfg(test)]
mod example {
    /// The commented example in the repository must stay a valid configuration.
    #[test]
    fn the_example_config_parses() {
        let path =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../outbox.example.toml");
        let config = super::load(Some(&path), figment::Figment::new()).unwrap();
        assert_eq!(config.relay.batch_size, 500);
        assert_eq!(config.relay.retry.max_attempts, 10);
    }
}
