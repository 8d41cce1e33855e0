//! `outbox inbox migrate|status|purge|parked`: the consumer-side inbox for services in any
//! language, which have no `outbox-inbox` crate to call. The tables, the claim routine and
//! their contract are the library's (docs/inbox.md); this module only opens the database named
//! by `[inbox]` (or `[database]`) and prints.
//!
//! Why in the relay's binary: a deployment already has it and its config file, and the inbox's
//! operations (create the tables, purge old rows on a schedule, look at parked messages) are
//! the same chores the outbox has.

use std::time::Duration;

use chrono::{DateTime, Utc};
#[cfg(feature = "mysql")]
use outbox_inbox::mysql::MySqlInbox;
use outbox_inbox::postgres::PgInbox;
#[cfg(feature = "sqlite")]
use outbox_inbox::sqlite::SqliteInbox;
use outbox_inbox::{InboxStats, MigrationReport, ParkedQuery, ParkedRecord};
use outbox_types::humantime_duration::format_duration;
use outbox_types::redact::{escape_control, redact_in_text, redact_url};
use serde_json::json;
#[cfg(feature = "mysql")]
use sqlx::mysql::MySqlPoolOptions;
use sqlx::postgres::PgPoolOptions;
#[cfg(feature = "sqlite")]
use sqlx::sqlite::{SqliteConnectOptions, SqlitePoolOptions};

#[cfg(feature = "mysql")]
use crate::config::mysql_driver_url;
use crate::config::{Config, ConfigError, Database, database_of};

/// An inbox in whichever database the URL names.
pub enum AnyInbox {
    /// `postgres://…`
    Postgres(sqlx::PgPool, PgInbox),
    /// `mysql://…` or `mariadb://…`
    #[cfg(feature = "mysql")]
    MySql(sqlx::MySqlPool, MySqlInbox),
    /// `sqlite:…`
    #[cfg(feature = "sqlite")]
    Sqlite(sqlx::SqlitePool, SqliteInbox),
}

/// `$body` with `$pool` and `$inbox` bound to the pool and the inbox of whichever database
/// `$any` is on. A macro, not a generic function: each database's inbox is its own type whose
/// methods take that database's pool, and no trait covers them.
macro_rules! on_inbox {
    ($any:expr, |$pool:ident, $inbox:ident| $body:expr) => {
        match $any {
            AnyInbox::Postgres($pool, $inbox) => $body,
            #[cfg(feature = "mysql")]
            AnyInbox::MySql($pool, $inbox) => $body,
            #[cfg(feature = "sqlite")]
            AnyInbox::Sqlite($pool, $inbox) => $body,
        }
    };
}

/// Errors a person has to fix (names, a missing migration) exit 2 with the message; the rest 1.
fn inbox_error(error: outbox_inbox::Error) -> anyhow::Error {
    match error {
        outbox_inbox::Error::Invalid(_) | outbox_inbox::Error::NotMigrated(_) => {
            ConfigError(redact_in_text(&error.to_string())).into()
        }
        other => anyhow::anyhow!(redact_in_text(&other.to_string())),
    }
}

impl AnyInbox {
    /// Connect to the inbox's database (`create`: a missing SQLite file is created, for
    /// `migrate`). An unreachable database is a [`ConfigError`] naming the URL.
    #[cfg_attr(not(feature = "sqlite"), allow(unused_variables))]
    pub async fn open(config: &Config, create: bool) -> Result<AnyInbox, ConfigError> {
        let url = config.inbox_url();
        let section = &config.inbox;
        let unreachable = |e: sqlx::Error| {
            ConfigError(format!(
                "cannot open the inbox database `{}`: {} — check `inbox.database_url` (or `database.url`) and that the server is running",
                redact_url(url),
                redact_in_text(&e.to_string())
            ))
        };
        let invalid = |e: outbox_inbox::Error| ConfigError(format!("invalid `[inbox]`: {e}"));
        // The key `inbox_url` took the URL from.
        let key = match &section.database_url {
            Some(own) if !own.trim().is_empty() => "inbox.database_url",
            _ => "database.url",
        };
        let database = database_of(key, url)?;
        #[allow(unreachable_patterns)] // reachable in a build without some database
        match database {
            Database::Postgres => {
                let inbox =
                    PgInbox::with_names(&section.schema, &section.table).map_err(invalid)?;
                let pool = PgPoolOptions::new()
                    .max_connections(2)
                    .connect(url)
                    .await
                    .map_err(unreachable)?;
                Ok(AnyInbox::Postgres(pool, inbox))
            }
            #[cfg(feature = "mysql")]
            Database::MySql => {
                let inbox = MySqlInbox::with_table(&section.table).map_err(invalid)?;
                let url = mysql_driver_url(url);
                let pool = MySqlPoolOptions::new()
                    .max_connections(2)
                    .connect(&url)
                    .await
                    .map_err(unreachable)?;
                Ok(AnyInbox::MySql(pool, inbox))
            }
            #[cfg(feature = "sqlite")]
            Database::Sqlite => {
                let inbox = SqliteInbox::with_table(&section.table).map_err(invalid)?;
                let options: SqliteConnectOptions = url.parse().map_err(unreachable)?;
                let options = options
                    .create_if_missing(create)
                    .busy_timeout(Duration::from_secs(10));
                let pool = SqlitePoolOptions::new()
                    .max_connections(2)
                    .connect_with(options)
                    .await
                    .map_err(unreachable)?;
                Ok(AnyInbox::Sqlite(pool, inbox))
            }
            // Not reached: `built()` above refused a database this build lacks.
            other => Err(ConfigError(format!("{other:?} is not in this build"))),
        }
    }

    /// Where the inbox is, for messages.
    pub fn describe(&self) -> String {
        match self {
            AnyInbox::Postgres(_, i) => format!("PostgreSQL inbox {}", i.qualified_table()),
            #[cfg(feature = "mysql")]
            AnyInbox::MySql(_, i) => format!("MySQL inbox {}", i.qualified_table()),
            #[cfg(feature = "sqlite")]
            AnyInbox::Sqlite(_, i) => format!("SQLite inbox {}", i.qualified_table()),
        }
    }

    /// The claim a consumer runs first in its transaction, as SQL with named arguments.
    pub fn claim_sql(&self) -> String {
        match self {
            AnyInbox::Postgres(_, i) => format!(
                "SELECT {}(event_id, handler)  -- true: apply the effect; false: skip",
                i.claim_function()
            ),
            #[cfg(feature = "mysql")]
            AnyInbox::MySql(_, i) => format!(
                "CALL {}(event_id, handler)  -- row `fresh`: 1 apply the effect; 0 skip",
                i.claim_procedure()
            ),
            #[cfg(feature = "sqlite")]
            AnyInbox::Sqlite(_, i) => format!(
                "{}  -- ?1 event_id, ?2 handler; 1 row changed: apply the effect; 0: skip",
                i.claim_statement()
            ),
        }
    }

    async fn migrate(&self) -> Result<MigrationReport, outbox_inbox::Error> {
        on_inbox!(self, |p, i| i.migrate(p).await)
    }

    fn latest_version(&self) -> i64 {
        match self {
            AnyInbox::Postgres(..) => PgInbox::SCHEMA_VERSION,
            #[cfg(feature = "mysql")]
            AnyInbox::MySql(..) => MySqlInbox::SCHEMA_VERSION,
            #[cfg(feature = "sqlite")]
            AnyInbox::Sqlite(..) => SqliteInbox::SCHEMA_VERSION,
        }
    }

    async fn stats(&self, retention: Duration) -> Result<InboxStats, outbox_inbox::Error> {
        on_inbox!(self, |p, i| i.stats(p, retention).await)
    }

    async fn purge(&self, older_than: Duration, batch: u32) -> Result<u64, outbox_inbox::Error> {
        on_inbox!(self, |p, i| i.purge(p, older_than, batch).await)
    }

    async fn list_parked(
        &self,
        query: &ParkedQuery,
    ) -> Result<Vec<ParkedRecord>, outbox_inbox::Error> {
        on_inbox!(self, |p, i| i.list_parked(p, query).await)
    }

    async fn parked_record(&self, id: i64) -> Result<Option<ParkedRecord>, outbox_inbox::Error> {
        on_inbox!(self, |p, i| i.parked_record(p, id).await)
    }
}

/// `outbox inbox migrate`.
pub async fn migrate(inbox: &AnyInbox, as_json: bool) -> anyhow::Result<()> {
    let report = inbox.migrate().await.map_err(inbox_error)?;
    if as_json {
        println!(
            "{}",
            json!({
                "inbox": inbox.describe(),
                "applied": report.applied,
                "schema_version": report.current,
                "claim": inbox.claim_sql(),
            })
        );
    } else {
        if report.applied.is_empty() {
            println!(
                "{}: schema is current (version {})",
                inbox.describe(),
                report.current
            );
        } else {
            println!(
                "{}: applied migrations {:?} (now version {})",
                inbox.describe(),
                report.applied,
                report.current
            );
        }
        println!("claim: {}", inbox.claim_sql());
    }
    Ok(())
}

fn time(t: Option<DateTime<Utc>>) -> String {
    t.map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true))
        .unwrap_or_else(|| "-".into())
}

/// `outbox inbox status`.
pub async fn status(inbox: &AnyInbox, retention: Duration, as_json: bool) -> anyhow::Result<()> {
    let stats = inbox.stats(retention).await.map_err(inbox_error)?;
    let latest = inbox.latest_version();
    if as_json {
        println!(
            "{}",
            serde_json::to_string_pretty(&json!({
                "inbox": inbox.describe(),
                "schema_version": stats.schema_version,
                "latest_schema_version": latest,
                "claim": inbox.claim_sql(),
                "retention": format_duration(retention),
                "rows": stats.rows(),
                "past_retention": stats.handlers.iter().map(|h| h.past_retention).sum::<u64>(),
                "oldest": stats.oldest(),
                "handlers": stats.handlers,
                "parked_total": stats.parked_total(),
                "parked": stats.parked,
            }))?
        );
        return Ok(());
    }
    println!(
        "{} (schema version {}{})",
        inbox.describe(),
        stats.schema_version,
        if stats.schema_version < latest {
            format!(" of {latest}: run `outbox inbox migrate`")
        } else {
            String::new()
        }
    );
    println!("claim: {}", inbox.claim_sql());
    println!();
    let past = format!("past {}", format_duration(retention));
    println!(
        "{:<24}  {:>10}  {:>10}  {:<20}  {:<20}",
        "handler", "rows", past, "oldest", "newest"
    );
    for h in &stats.handlers {
        println!(
            "{:<24}  {:>10}  {:>10}  {:<20}  {:<20}",
            escape_control(&h.handler),
            h.rows,
            h.past_retention,
            time(h.oldest),
            time(h.newest)
        );
    }
    println!(
        "{:<24}  {:>10}  {:>10}  {:<20}",
        "total",
        stats.rows(),
        stats.handlers.iter().map(|h| h.past_retention).sum::<u64>(),
        time(stats.oldest())
    );
    println!();
    if stats.parked.is_empty() {
        println!("parked: none");
    } else {
        let parts: Vec<String> = stats
            .parked
            .iter()
            .map(|p| {
                format!(
                    "{} {} (oldest {})",
                    escape_control(&p.handler),
                    p.messages,
                    time(p.oldest)
                )
            })
            .collect();
        println!(
            "parked: {} — {} (`outbox inbox parked`)",
            stats.parked_total(),
            parts.join(", ")
        );
    }
    Ok(())
}

/// One run of `outbox inbox purge`; prints what it deleted.
pub async fn purge_once(
    inbox: &AnyInbox,
    older_than: Duration,
    batch: u32,
    as_json: bool,
) -> anyhow::Result<u64> {
    let deleted = inbox.purge(older_than, batch).await.map_err(inbox_error)?;
    if as_json {
        println!(
            "{}",
            json!({
                "inbox": inbox.describe(),
                "deleted": deleted,
                "older_than": format_duration(older_than),
                "at": Utc::now(),
            })
        );
    } else {
        println!(
            "{}: deleted {deleted} row(s) processed more than {} ago",
            inbox.describe(),
            format_duration(older_than)
        );
    }
    Ok(deleted)
}

/// `outbox inbox purge --every D`: purge now and then every `every` until `shutdown`
/// completes. A failed run is logged and tried again at the next interval (the database may
/// be back by then); a configuration problem (no inbox table) ends the loop.
pub async fn purge_loop(
    inbox: &AnyInbox,
    older_than: Duration,
    batch: u32,
    every: Duration,
    as_json: bool,
    shutdown: impl std::future::Future<Output = ()>,
) -> anyhow::Result<()> {
    tokio::pin!(shutdown);
    let mut ticker = tokio::time::interval(every.max(Duration::from_secs(1)));
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tracing::info!(
        inbox = %inbox.describe(),
        older_than = %format_duration(older_than),
        every = %format_duration(every),
        "Inbox retention loop started; stops on SIGINT or SIGTERM."
    );
    loop {
        tokio::select! {
            _ = &mut shutdown => return Ok(()),
            _ = ticker.tick() => {}
        }
        tokio::select! {
            _ = &mut shutdown => return Ok(()),
            result = purge_once(inbox, older_than, batch, as_json) => match result {
                Ok(_) => {}
                Err(error) if error.downcast_ref::<ConfigError>().is_some() => return Err(error),
                Err(error) => tracing::warn!(
                    error = %format!("{error:#}"),
                    "Inbox purge failed; will try again at the next interval."
                ),
            }
        }
    }
}

fn one_line(text: &str, max: usize) -> String {
    let flat: String = text
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    if flat.chars().count() <= max {
        flat
    } else {
        let cut: String = flat.chars().take(max.saturating_sub(1)).collect();
        format!("{cut}…")
    }
}

fn record_json(r: &ParkedRecord) -> serde_json::Value {
    let m = &r.message;
    let payload = match std::str::from_utf8(&m.payload) {
        Ok(text) => json!(text),
        Err(_) => {
            json!({ "hex": m.payload.iter().map(|b| format!("{b:02x}")).collect::<String>() })
        }
    };
    json!({
        "id": r.id,
        "handler": r.handler,
        "parked_at": r.parked_at,
        "event_id": m.event_id.map(|e| e.to_string()),
        "source": m.source,
        "attempts": m.attempts,
        "error": m.error,
        "headers": m.headers,
        "payload": payload,
    })
}

/// `outbox inbox parked`.
pub async fn list_parked(
    inbox: &AnyInbox,
    query: &ParkedQuery,
    as_json: bool,
) -> anyhow::Result<()> {
    let records = inbox.list_parked(query).await.map_err(inbox_error)?;
    let json = || records.iter().map(record_json).collect::<Vec<_>>();
    if crate::admin::listed_without_a_table(
        as_json,
        json,
        records.is_empty(),
        "no parked messages",
    )? {
        return Ok(());
    }
    println!(
        "{:>6}  {:<16}  {:<36}  {:>3}  {:<20}  {:<20}  error",
        "id", "handler", "event id", "att", "parked at", "source"
    );
    for r in &records {
        let m = &r.message;
        println!(
            "{:>6}  {:<16}  {:<36}  {:>3}  {:<20}  {:<20}  {}",
            r.id,
            escape_control(&one_line(&r.handler, 16)),
            m.event_id
                .map(|e| e.to_string())
                .unwrap_or_else(|| "(none)".into()),
            m.attempts,
            time(Some(r.parked_at)),
            escape_control(&one_line(&m.source, 20)),
            escape_control(&one_line(&m.error, 60))
        );
    }
    if records.len() as i64 == query.limit.max(1) as i64
        && let Some(last) = records.last()
    {
        println!("(more may follow: --after {})", last.id);
    }
    Ok(())
}

/// `outbox inbox parked show ID`.
pub async fn show_parked(inbox: &AnyInbox, id: i64, as_json: bool) -> anyhow::Result<()> {
    let record = inbox
        .parked_record(id)
        .await
        .map_err(inbox_error)?
        .ok_or_else(|| anyhow::anyhow!("no parked message with id {id} in {}", inbox.describe()))?;
    if as_json {
        println!("{}", serde_json::to_string_pretty(&record_json(&record))?);
        return Ok(());
    }
    let m = &record.message;
    let field = |label: &str, value: &str| println!("{label:<11}{}", escape_control(value));
    field("id", &record.id.to_string());
    field("handler", &record.handler);
    field(
        "event id",
        &m.event_id
            .map(|e| e.to_string())
            .unwrap_or_else(|| "(none: the message had no readable outbox-event-id)".into()),
    );
    field("parked at", &time(Some(record.parked_at)));
    field("source", &m.source);
    field("attempts", &m.attempts.to_string());
    field("error", &m.error);
    field(
        "headers",
        &serde_json::to_string(&m.headers).unwrap_or_default(),
    );
    field("payload", &String::from_utf8_lossy(&m.payload));
    Ok(())
}
