//! One PostgreSQL URL, two kinds of connection: ordinary ones (sqlx) for SQL, and the
//! replication session (pgwire-replication), which needs the parts of the URL spelled out.

use std::time::Duration;

use pgwire_replication::{ReplicationConfig, SslMode, TlsConfig};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{PgConnection, PgPool};

use crate::config::WalConfig;
use crate::error::WalError;

/// The parts of a `postgres://` URL the replication session needs.
#[derive(Clone, Debug)]
pub(crate) struct Target {
    pub options: PgConnectOptions,
    host: String,
    port: u16,
    user: String,
    password: String,
    database: String,
    ssl: SslMode,
}

/// `postgres://user:secret@host/db` → `postgres://user:***@host/db`.
pub(crate) fn redact(url: &str) -> String {
    outbox_postgres::redact_url(url)
}

impl Target {
    pub fn parse(url_text: &str) -> Result<Self, WalError> {
        let invalid = |why: String| {
            WalError::Config(format!(
                "invalid PostgreSQL URL `{}`: {why}",
                redact(url_text)
            ))
        };
        let options: PgConnectOptions = url_text
            .parse()
            .map_err(|e: sqlx::Error| invalid(e.to_string()))?;
        let url = url::Url::parse(url_text).map_err(|e| invalid(e.to_string()))?;
        if !matches!(url.scheme(), "postgres" | "postgresql") {
            return Err(invalid("the scheme must be postgres://".into()));
        }
        let decode = |s: &str| {
            url::form_urlencoded::parse(format!("x={s}").as_bytes())
                .next()
                .map(|(_, v)| v.into_owned())
                .unwrap_or_default()
        };
        let mut host = url
            .host_str()
            .map(|h| decode(h).trim_matches(['[', ']']).to_owned())
            .unwrap_or_default();
        let mut ssl = SslMode::Disable;
        let mut user = decode(url.username());
        let mut password = url.password().map(decode).unwrap_or_default();
        for (key, value) in url.query_pairs() {
            match key.as_ref() {
                "host" => host = value.into_owned(),
                "user" => user = value.into_owned(),
                "password" => password = value.into_owned(),
                "sslmode" => {
                    ssl = match value.as_ref() {
                        "disable" | "allow" => SslMode::Disable,
                        "prefer" => SslMode::Prefer,
                        "require" => SslMode::Require,
                        "verify-ca" => SslMode::VerifyCa,
                        "verify-full" => SslMode::VerifyFull,
                        other => return Err(invalid(format!("unknown sslmode `{other}`"))),
                    }
                }
                _ => {}
            }
        }
        if host.is_empty() {
            host = "localhost".to_owned();
        }
        if user.is_empty() {
            user = std::env::var("USER").unwrap_or_else(|_| "postgres".to_owned());
        }
        let database = url
            .path()
            .trim_start_matches('/')
            .to_owned()
            .chars()
            .collect::<String>();
        let database = if database.is_empty() {
            user.clone()
        } else {
            decode(&database)
        };
        Ok(Target {
            options,
            port: url.port().unwrap_or(5432),
            host,
            user,
            password,
            database,
            ssl,
        })
    }

    /// The replication session's settings for `config`, starting at the slot's confirmed
    /// position and reporting `ack` until the relay confirms more.
    pub fn replication(&self, config: &WalConfig, ack: crate::Lsn) -> ReplicationConfig {
        let tls = match self.ssl {
            SslMode::Disable => TlsConfig::disabled(),
            SslMode::Prefer | SslMode::Require => TlsConfig::require(),
            SslMode::VerifyCa => TlsConfig::verify_ca(None),
            SslMode::VerifyFull => TlsConfig::verify_full(None),
        };
        let mut tls = tls;
        if self.ssl == SslMode::Prefer {
            tls.mode = SslMode::Prefer;
        }
        let buffer = config.max_batch.saturating_mul(4).clamp(256, 8192);
        ReplicationConfig::new(
            self.host.clone(),
            self.user.clone(),
            self.password.clone(),
            self.database.clone(),
            config.slot.clone(),
            config.publication.clone(),
        )
        .with_port(self.port)
        .with_tls(tls)
        // 0/0: the server starts at the slot's confirmed position.
        .with_start_lsn(pgwire_replication::Lsn::ZERO)
        .with_ack_lsn(ack.into())
        .with_status_interval(config.status_interval)
        .with_wakeup_interval(config.status_interval.max(Duration::from_secs(1)))
        .with_buffer_size(buffer)
        .with_max_message_size(256 * 1024 * 1024)
        .with_application_name(format!("outbox-wal {}", config.relay_id))
        .with_options("-c datestyle=ISO,YMD -c timezone=UTC -c extra_float_digits=3")
    }

    /// A small pool for the relay's own statements.
    pub async fn pool(&self, url: &str, max: u32) -> Result<PgPool, WalError> {
        PgPoolOptions::new()
            .max_connections(max)
            .acquire_timeout(Duration::from_secs(5))
            .connect_with(self.options.clone())
            .await
            .map_err(|e| WalError::Unavailable(format!("cannot connect to {}: {e}", redact(url))))
    }

    /// One dedicated connection (the leadership lock lives on it).
    pub async fn connection(&self, url: &str) -> Result<PgConnection, WalError> {
        <PgConnection as sqlx::Connection>::connect_with(&self.options)
            .await
            .map_err(|e| WalError::Unavailable(format!("cannot connect to {}: {e}", redact(url))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn url_parts_are_decoded() {
        let t =
            Target::parse("postgres://re%40lay:p%2Fw@db.example:6543/app?sslmode=require").unwrap();
        assert_eq!(t.user, "re@lay");
        assert_eq!(t.password, "p/w");
        assert_eq!(t.host, "db.example");
        assert_eq!(t.port, 6543);
        assert_eq!(t.database, "app");
        assert_eq!(t.ssl, SslMode::Require);
        let t = Target::parse("postgres://postgres@localhost/outbox?host=/tmp/pg").unwrap();
        assert_eq!(t.host, "/tmp/pg");
        assert!(Target::parse("mysql://x/y").is_err());
        let err = Target::parse("postgres://u:secret@h/db?sslmode=bogus")
            .unwrap_err()
            .to_string();
        assert!(err.contains("bogus") && !err.contains("secret"), "{err}");
    }
}
