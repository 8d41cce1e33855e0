//! One PostgreSQL URL, two kinds of connection: ordinary ones (sqlx) for SQL, and the
//! replication session (pgwire-replication), which needs the parts of the URL spelled out.
//!
//! # TLS
//!
//! The replication session carries every event's payload, so it gets the same TLS settings as
//! the pool, read the way libpq reads them: `sslmode`, `sslrootcert`, `sslcert` and `sslkey`
//! from the URL, else from `PGSSLMODE`, `PGSSLROOTCERT`, `PGSSLCERT` and `PGSSLKEY`, else
//! `sslmode=prefer` (TLS when the server offers it, plain when it refuses) and the root
//! certificate `~/.postgresql/root.crt` if that file exists. The resolved settings are applied
//! to the pool's options too, so both connections always agree.
//!
//! Where this differs from libpq, and why:
//! - `allow` (libpq: plain first, TLS only if the server insists) is treated as `prefer`: the
//!   replication client cannot retry a refused plain connection with TLS, and `prefer` never
//!   sends less protected than `allow` would.
//! - `verify-ca`/`verify-full` without any root certificate trust the Mozilla root set
//!   (webpki-roots), like the pool does; libpq refuses to connect instead. Give `sslrootcert`
//!   for a private CA.
//! - `verify-full` to an IP address checks the certificate's IP address entries, as libpq does
//!   (the replication client would refuse an IP outright).
//! - Over a Unix socket there is no TLS, as in libpq; `require` and stricter fail there.

use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

use outbox_types::redact::{redact_in_text, redact_url};
use pgwire_replication::{ReplicationClient, ReplicationConfig, TlsConfig};
use serde::Serialize;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions, PgSslMode};
use sqlx::{PgConnection, PgPool};

use crate::config::WalConfig;
use crate::error::{WalError, map_wire};

/// libpq's `sslmode` values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum SslMode {
    /// Never TLS.
    Disable,
    /// Read as `prefer` (see the module docs).
    Allow,
    /// TLS when the server offers it, else plain. The default.
    Prefer,
    /// TLS, certificate not checked.
    Require,
    /// TLS, certificate signed by a trusted root.
    VerifyCa,
    /// TLS, certificate signed by a trusted root and issued for the host connected to.
    VerifyFull,
}

impl SslMode {
    fn parse(text: &str) -> Option<SslMode> {
        Some(match text {
            "disable" => SslMode::Disable,
            "allow" => SslMode::Allow,
            "prefer" => SslMode::Prefer,
            "require" => SslMode::Require,
            "verify-ca" => SslMode::VerifyCa,
            "verify-full" => SslMode::VerifyFull,
            _ => return None,
        })
    }

    fn as_str(self) -> &'static str {
        match self {
            SslMode::Disable => "disable",
            SslMode::Allow => "allow",
            SslMode::Prefer => "prefer",
            SslMode::Require => "require",
            SslMode::VerifyCa => "verify-ca",
            SslMode::VerifyFull => "verify-full",
        }
    }
}

/// The TLS settings both connections use.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Tls {
    pub mode: SslMode,
    pub root_cert: Option<PathBuf>,
    pub client_cert: Option<PathBuf>,
    pub client_key: Option<PathBuf>,
}

/// The parts of a `postgres://` URL the replication session needs.
#[derive(Clone, Debug)]
pub(crate) struct Target {
    pub options: PgConnectOptions,
    host: String,
    port: u16,
    user: String,
    password: String,
    database: String,
    pub tls: Tls,
}

/// `postgres://user:secret@host/db` → `postgres://user:***@host/db`.
pub(crate) fn redact(url: &str) -> String {
    redact_url(url)
}

impl Target {
    /// Parse `url`, with the `PGSSL*` environment variables as defaults.
    pub fn parse(url_text: &str) -> Result<Self, WalError> {
        Self::parse_with(url_text, |name| std::env::var(name).ok(), home_root_cert())
    }

    /// [`Target::parse`] with the environment and libpq's default root certificate (the path of
    /// `~/.postgresql/root.crt` when it exists) given, for tests.
    fn parse_with(
        url_text: &str,
        env: impl Fn(&str) -> Option<String>,
        default_root_cert: Option<PathBuf>,
    ) -> Result<Self, WalError> {
        let invalid = |why: String| {
            WalError::Config(format!(
                "invalid PostgreSQL URL `{}`: {why}",
                redact(url_text)
            ))
        };
        let options: PgConnectOptions = url_text
            .parse()
            .map_err(|e: sqlx::Error| invalid(redact_in_text(&e.to_string())))?;
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
        let non_empty = |v: Option<String>| v.filter(|v| !v.is_empty());
        let mut ssl_text = non_empty(env("PGSSLMODE")).map(|v| (v, "PGSSLMODE"));
        let mut root_cert = non_empty(env("PGSSLROOTCERT"));
        let mut client_cert = non_empty(env("PGSSLCERT"));
        let mut client_key = non_empty(env("PGSSLKEY"));
        let mut user = decode(url.username());
        let mut password = url.password().map(decode).unwrap_or_default();
        for (key, value) in url.query_pairs() {
            match key.as_ref() {
                "host" => host = value.into_owned(),
                "user" => user = value.into_owned(),
                "password" => password = value.into_owned(),
                "sslmode" | "ssl-mode" => ssl_text = Some((value.into_owned(), "sslmode")),
                "sslrootcert" | "ssl-root-cert" | "ssl-ca" => root_cert = Some(value.into_owned()),
                "sslcert" | "ssl-cert" => client_cert = Some(value.into_owned()),
                "sslkey" | "ssl-key" => client_key = Some(value.into_owned()),
                _ => {}
            }
        }
        let mode = match ssl_text {
            None => SslMode::Prefer,
            Some((text, source)) => SslMode::parse(&text).ok_or_else(|| {
                invalid(format!(
                    "unknown {source} `{text}`: use disable, allow, prefer, require, verify-ca or verify-full"
                ))
            })?,
        };
        if client_cert.is_some() != client_key.is_some() {
            return Err(invalid(
                "sslcert and sslkey (or PGSSLCERT and PGSSLKEY) must be given together for a client certificate"
                    .into(),
            ));
        }
        let tls = Tls {
            mode,
            root_cert: root_cert.map(PathBuf::from).or(default_root_cert),
            client_cert: client_cert.map(PathBuf::from),
            client_key: client_key.map(PathBuf::from),
        };
        if host.is_empty() {
            host = "localhost".to_owned();
        }
        if user.is_empty() {
            user = std::env::var("USER").unwrap_or_else(|_| "postgres".to_owned());
        }
        let database = url.path().trim_start_matches('/').to_owned();
        let database = if database.is_empty() {
            user.clone()
        } else {
            decode(&database)
        };
        Ok(Target {
            options: tls.apply(options),
            port: url.port().unwrap_or(5432),
            host,
            user,
            password,
            database,
            tls,
        })
    }

    /// The replication session's TLS settings.
    fn replication_tls(&self) -> TlsConfig {
        use pgwire_replication::SslMode as Wire;
        let mode = match self.tls.mode {
            SslMode::Disable => Wire::Disable,
            SslMode::Allow | SslMode::Prefer => Wire::Prefer,
            SslMode::Require => Wire::Require,
            SslMode::VerifyCa => Wire::VerifyCa,
            SslMode::VerifyFull => Wire::VerifyFull,
        };
        TlsConfig {
            mode,
            ca_pem_path: self.tls.root_cert.clone(),
            // An IP address as the server name makes rustls check the certificate's IP
            // entries (libpq's behaviour); without it the client refuses verify-full to an IP.
            sni_hostname: self
                .host
                .parse::<IpAddr>()
                .is_ok()
                .then(|| self.host.clone()),
            client_cert_pem_path: self.tls.client_cert.clone(),
            client_key_pem_path: self.tls.client_key.clone(),
        }
    }

    /// The replication session's settings for `config`, starting at the slot's confirmed
    /// position and reporting `ack` until the relay confirms more.
    ///
    /// What the server sends is what the sources use: logical messages only with the message
    /// source on (the publication names only the tables they read: `slot::ensure_publication`).
    /// A record over `limits.wire()` is read past keeping its first `limits.prefix()` bytes
    /// (the `limits` module), and the client's event channel holds at most
    /// [`channel_bytes`]`(config)` bytes of change data besides one such record.
    pub fn replication(
        &self,
        config: &WalConfig,
        ack: crate::Lsn,
        who: &str,
        limits: &crate::limits::Limits,
    ) -> ReplicationConfig {
        let buffer = config.max_buffered_events.clamp(256, 8192);
        let wire = usize::try_from(limits.wire()).unwrap_or(usize::MAX);
        let prefix = usize::try_from(limits.prefix()).unwrap_or(usize::MAX);
        ReplicationConfig::new(
            self.host.clone(),
            self.user.clone(),
            self.password.clone(),
            self.database.clone(),
            config.slot.clone(),
            config.publication.clone(),
        )
        .with_port(self.port)
        .with_tls(self.replication_tls())
        // 0/0: the server starts at the slot's confirmed position.
        .with_start_lsn(pgwire_replication::Lsn::ZERO)
        .with_ack_lsn(ack.into())
        .with_status_interval(config.status_interval)
        .with_wakeup_interval(config.status_interval.max(Duration::from_secs(1)))
        .with_buffer_size(buffer)
        .with_max_message_size(wire)
        .with_oversized_prefix(prefix)
        .with_messages(config.captures(crate::config::Source::Messages))
        .with_buffer_bytes(channel_bytes(config))
        .with_application_name(format!("outbox-wal {who}"))
        .with_options("-c datestyle=ISO,YMD -c timezone=UTC -c extra_float_digits=3")
    }

    /// A small pool for the relay's own statements.
    pub async fn pool(&self, url: &str, max: u32) -> Result<PgPool, WalError> {
        PgPoolOptions::new()
            .max_connections(max)
            .acquire_timeout(Duration::from_secs(5))
            .connect_with(self.options.clone())
            .await
            .map_err(|e| connect_error(e, url, &self.tls))
    }

    /// One dedicated connection (the leadership lock lives on it).
    pub async fn connection(&self, url: &str) -> Result<PgConnection, WalError> {
        <PgConnection as sqlx::Connection>::connect_with(&self.options)
            .await
            .map_err(|e| connect_error(e, url, &self.tls))
    }
}

/// Most bytes of change data the replication client's event channel holds for the stream
/// task: a quarter of `max_buffered_bytes`, between 1 MiB and 8 MiB. The stream task stops
/// taking events while its own buffer is full; without this bound the client would read on
/// into the channel (up to 8,192 records of any size).
pub(crate) fn channel_bytes(config: &WalConfig) -> usize {
    (config.max_buffered_bytes / 4).clamp(1024 * 1024, 8 * 1024 * 1024)
}

impl Tls {
    /// The same settings on the pool's options.
    fn apply(&self, options: PgConnectOptions) -> PgConnectOptions {
        let mut options = options.ssl_mode(match self.mode {
            SslMode::Disable => PgSslMode::Disable,
            // sqlx reads `allow` as `disable`; both connections read it as `prefer`.
            SslMode::Allow | SslMode::Prefer => PgSslMode::Prefer,
            SslMode::Require => PgSslMode::Require,
            SslMode::VerifyCa => PgSslMode::VerifyCa,
            SslMode::VerifyFull => PgSslMode::VerifyFull,
        });
        if let Some(path) = &self.root_cert {
            options = options.ssl_root_cert(path);
        }
        if let (Some(cert), Some(key)) = (&self.client_cert, &self.client_key) {
            options = options.ssl_client_cert(cert).ssl_client_key(key);
        }
        options
    }

    /// What to change when TLS fails: named settings, not guesses.
    pub(crate) fn hint(&self) -> String {
        let root = match &self.root_cert {
            Some(path) => format!("sslrootcert `{}`", path.display()),
            None => "no sslrootcert (the Mozilla root set is trusted)".to_owned(),
        };
        format!(
            "sslmode is `{}`, {root}: point sslrootcert (in the URL or PGSSLROOTCERT) at the CA that signed the server's certificate, connect to the host name the certificate was issued for, or lower sslmode to `require` (encrypted, not verified)",
            self.mode.as_str()
        )
    }
}

/// libpq's default root certificate, `~/.postgresql/root.crt`, if it exists.
fn home_root_cert() -> Option<PathBuf> {
    let home = std::env::var_os("HOME")?;
    let path = PathBuf::from(home).join(".postgresql").join("root.crt");
    path.is_file().then_some(path)
}

/// Whether an error text is about TLS settings or certificates (needs a person) rather than the
/// network (retry).
pub(crate) fn is_tls_setup_error(text: &str) -> bool {
    let text = text.to_ascii_lowercase();
    [
        "certificate",
        "tls config error",
        "does not support tls",
        "does not support ssl",
        "without tls support",
        "tls is not supported",
        "unknownissuer",
        "notvalidforname",
    ]
    .iter()
    .any(|needle| text.contains(needle))
}

/// A failed sqlx connect: TLS set up wrong is a configuration error with the fix; anything else
/// is the database being unreachable (retried).
fn connect_error(error: sqlx::Error, url: &str, tls: &Tls) -> WalError {
    let text = redact_in_text(&error.to_string());
    match &error {
        sqlx::Error::Configuration(_) => {
            WalError::Config(format!("cannot connect to {}: {text}", redact(url)))
        }
        // rustls reports a refused certificate as an I/O error.
        sqlx::Error::Tls(_) | sqlx::Error::Io(_) if is_tls_setup_error(&text) => {
            WalError::Config(format!(
                "cannot connect to {} over TLS: {text}; {}",
                redact(url),
                tls.hint()
            ))
        }
        _ => WalError::Unavailable(format!("cannot connect to {}: {text}", redact(url))),
    }
}

/// What [`check_replication_connection`](crate::check_replication_connection) found.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ReplicationConnection {
    /// The `sslmode` in effect (from the URL, `PGSSLMODE`, or the default `prefer`).
    pub sslmode: SslMode,
    /// Whether the session is encrypted, per the server (`pg_stat_ssl`).
    pub tls: bool,
    /// The TLS version, when encrypted.
    pub tls_version: Option<String>,
}

/// Open a replication session the way the relay does, without starting replication, and ask
/// the server whether it is encrypted.
pub(crate) async fn check_replication(
    target: &Target,
    config: &WalConfig,
) -> Result<ReplicationConnection, WalError> {
    let mut client = ReplicationClient::connect_gated(target.replication(
        config,
        crate::Lsn::ZERO,
        "check",
        &crate::limits::Limits::default(),
    ))
    .await
    .map_err(|e| wire_error(e, &target.tls))?;
    let rows = client
        .simple_query(
            "SELECT ssl::text, coalesce(version, '') FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
        )
        .await
        .map_err(|e| wire_error(e, &target.tls))?;
    client.abort();
    let text = |row: &pgwire_replication::QueryRow, i: usize| {
        row.get(i)
            .and_then(|v| v.as_deref())
            .map(|b| String::from_utf8_lossy(b).into_owned())
            .unwrap_or_default()
    };
    let (tls, version) = match rows.first() {
        Some(row) => (text(row, 0) == "true", text(row, 1)),
        None => (false, String::new()),
    };
    Ok(ReplicationConnection {
        sslmode: target.tls.mode,
        tls,
        tls_version: (tls && !version.is_empty()).then_some(version),
    })
}

/// [`map_wire`], with the TLS settings named when TLS is what failed.
pub(crate) fn wire_error(error: pgwire_replication::PgWireError, tls: &Tls) -> WalError {
    match map_wire(error) {
        WalError::Config(text) if is_tls_setup_error(&text) => {
            WalError::Config(format!("{text}; {}", tls.hint()))
        }
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(url: &str, env: &[(&str, &str)]) -> Result<Target, WalError> {
        let env: Vec<(String, String)> = env
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        Target::parse_with(
            url,
            move |name| env.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone()),
            None,
        )
    }

    #[test]
    fn url_parts_are_decoded() {
        let t = parse(
            "postgres://re%40lay:p%2Fw@db.example:6543/app?sslmode=require",
            &[],
        )
        .unwrap();
        assert_eq!(t.user, "re@lay");
        assert_eq!(t.password, "p/w");
        assert_eq!(t.host, "db.example");
        assert_eq!(t.port, 6543);
        assert_eq!(t.database, "app");
        assert_eq!(t.tls.mode, SslMode::Require);
        let t = parse("postgres://postgres@localhost/outbox?host=/tmp/pg", &[]).unwrap();
        assert_eq!(t.host, "/tmp/pg");
        assert!(parse("mysql://x/y", &[]).is_err());
        let err = parse("postgres://u:secret@h/db?sslmode=bogus", &[])
            .unwrap_err()
            .to_string();
        assert!(err.contains("bogus") && !err.contains("secret"), "{err}");
        let err = parse("postgres://u:pw@h/db?password=hunter2&sslmode=bogus", &[])
            .unwrap_err()
            .to_string();
        assert!(!err.contains("hunter2"), "{err}");
    }

    #[test]
    fn tls_is_preferred_by_default_and_read_like_libpq() {
        let wire = |t: &Target| t.replication_tls();
        use pgwire_replication::SslMode as Wire;

        // No sslmode anywhere: prefer, on both connections.
        let t = parse("postgres://u@db/app", &[]).unwrap();
        assert_eq!(t.tls.mode, SslMode::Prefer);
        assert_eq!(wire(&t).mode, Wire::Prefer);
        assert!(matches!(t.options.get_ssl_mode(), PgSslMode::Prefer));

        // `allow` never becomes `disable`.
        let t = parse("postgres://u@db/app?sslmode=allow", &[]).unwrap();
        assert_eq!(wire(&t).mode, Wire::Prefer);
        assert!(matches!(t.options.get_ssl_mode(), PgSslMode::Prefer));

        // The environment is the default; the URL wins over it.
        let env = [
            ("PGSSLMODE", "verify-full"),
            ("PGSSLROOTCERT", "/etc/ca/env.pem"),
        ];
        let t = parse("postgres://u@db/app", &env).unwrap();
        assert_eq!(wire(&t).mode, Wire::VerifyFull);
        assert_eq!(
            wire(&t).ca_pem_path.as_deref(),
            Some(std::path::Path::new("/etc/ca/env.pem"))
        );
        let t = parse(
            "postgres://u@db/app?sslmode=verify-ca&sslrootcert=/etc/ca/url.pem",
            &env,
        )
        .unwrap();
        assert_eq!(wire(&t).mode, Wire::VerifyCa);
        assert_eq!(
            wire(&t).ca_pem_path.as_deref(),
            Some(std::path::Path::new("/etc/ca/url.pem"))
        );
        assert!(matches!(t.options.get_ssl_mode(), PgSslMode::VerifyCa));
        let err = parse("postgres://u@db/app", &[("PGSSLMODE", "sometimes")])
            .unwrap_err()
            .to_string();
        assert!(err.contains("PGSSLMODE `sometimes`"), "{err}");

        // libpq's ~/.postgresql/root.crt when nothing else names a root.
        let t = Target::parse_with(
            "postgres://u@db/app?sslmode=verify-ca",
            |_| None,
            Some("/home/relay/.postgresql/root.crt".into()),
        )
        .unwrap();
        assert_eq!(
            wire(&t).ca_pem_path.as_deref(),
            Some(std::path::Path::new("/home/relay/.postgresql/root.crt"))
        );

        // verify-full to an IP checks the certificate's IP entries.
        let t = parse("postgres://u@127.0.0.1/app?sslmode=verify-full", &[]).unwrap();
        assert_eq!(wire(&t).sni_hostname.as_deref(), Some("127.0.0.1"));
        let t = parse("postgres://u@db.example/app?sslmode=verify-full", &[]).unwrap();
        assert_eq!(wire(&t).sni_hostname, None);

        // Client certificates come in pairs.
        let t = parse(
            "postgres://u@db/app?sslcert=/c/client.crt&sslkey=/c/client.key",
            &[],
        )
        .unwrap();
        assert!(wire(&t).client_cert_pem_path.is_some() && wire(&t).client_key_pem_path.is_some());
        assert!(parse("postgres://u@db/app?sslcert=/c/client.crt", &[]).is_err());

        let t = parse("postgres://u@db/app?sslmode=disable", &env).unwrap();
        assert_eq!(wire(&t).mode, Wire::Disable);
    }
}
