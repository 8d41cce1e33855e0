//! Phase 1, setup: the relays' configuration file.
//!
//! Why its own module: the harness writes the config the `outbox` binary under test reads, and
//! asks that binary (`outbox config check`) whether it accepts it: the `[destinations]` and
//! `[[routes]]` form, else (an older binary) the single `[sink]` form, which only works with the
//! file destination.

use std::path::Path;
use std::sync::Arc;

use super::Options;
use super::setup::{Database, Links, via};
use crate::Error;
use crate::dest::Destination;

/// Write the relays' config to `config_path`; whether it is the `[destinations]` form.
pub(super) async fn configure(
    options: &Options,
    db: &Database,
    links: &Links,
    dests: &[Arc<dyn Destination>],
    config_path: &Path,
) -> Result<bool, Error> {
    let relay_url = via(&db.url, &links.relay_db, "outbox_verify_relay")?;
    let schema = &db.names.outbox_schema;
    write_config(
        config_path,
        &relay_config(options, &relay_url, schema, dests, true),
    )?;
    let (destinations_style, why) = match config_accepted(&options.outbox_bin, config_path).await? {
        (true, _) => (true, String::new()),
        (false, why) => {
            write_config(
                config_path,
                &relay_config(options, &relay_url, schema, dests, false),
            )?;
            (false, why)
        }
    };
    if !destinations_style {
        if dests.len() > 1 || dests[0].name() != "file" {
            return Err(Error::Invalid(format!(
                "this outbox binary does not accept a [destinations] config ({why}); only `--destinations file` works with it"
            )));
        }
        let (ok, why) = config_accepted(&options.outbox_bin, config_path).await?;
        if !ok {
            return Err(Error::Invalid(format!(
                "the outbox binary refuses the generated config {}: {why}",
                config_path.display()
            )));
        }
    }
    Ok(destinations_style)
}

/// The relay's configuration file, as a JSON value rendered to TOML. With `destinations`,
/// the `[destinations]` and `[[routes]]` form (one route per destination by aggregate type);
/// else the legacy single `[sink]`.
fn relay_config(
    options: &Options,
    db_url: &str,
    schema: &str,
    dests: &[Arc<dyn Destination>],
    destinations_style: bool,
) -> serde_json::Value {
    let lease_ms = options.lease.as_millis() as u64;
    let mut config = serde_json::json!({
        "database": {"url": db_url, "schema": schema},
        "relay": {
            "batch_size": options.batch_size,
            "poll_interval": "50ms",
            "lease": format!("{lease_ms}ms"),
            "publish_timeout": format!("{}ms", (lease_ms * 5 / 8).max(500)),
            "max_store_backoff": "1s",
            // The default number of attempts: an outage (the `outage` fault, broker cuts and
            // restarts) must not spend them; only the poison events may end dead.
            "retry": {"base": "100ms", "cap": "2s", "max_attempts": 10},
        },
        "retention": {"enabled": false},
    });
    if options.mode == "wal" {
        config["mode"] = serde_json::json!("wal");
        config["wal"] = serde_json::json!({
            "slot": "outbox_t_verify",
            "publication": "outbox_t_verify",
            "status_interval": "500ms",
            "standby_poll_interval": "500ms",
            "takeover_timeout": "20s",
            "max_reconnect_backoff": "1s",
        });
    }
    if destinations_style {
        let mut tables = serde_json::Map::new();
        let mut routes = Vec::new();
        for d in dests {
            tables.insert(d.name().to_owned(), d.sink_table());
            routes.push(serde_json::json!({"when": {"aggregate_type": d.name()}, "to": d.name()}));
        }
        config["destinations"] = serde_json::Value::Object(tables);
        config["routes"] = serde_json::Value::Array(routes);
    } else if let Some(d) = dests.first() {
        config["sink"] = d.sink_table();
    }
    config
}

fn write_config(path: &Path, config: &serde_json::Value) -> Result<(), Error> {
    let text = toml::to_string_pretty(config)
        .map_err(|e| Error::Invalid(format!("rendering the relay config: {e}")))?;
    std::fs::write(path, text).map_err(Error::io(format!("writing {}", path.display())))
}

/// Whether `outbox config check` accepts the file.
async fn config_accepted(bin: &Path, path: &Path) -> Result<(bool, String), Error> {
    let out = tokio::process::Command::new(bin)
        .args(["config", "check", "--config"])
        .arg(path)
        .output()
        .await
        .map_err(Error::io(format!("running {}", bin.display())))?;
    Ok((
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).trim().to_owned(),
    ))
}
