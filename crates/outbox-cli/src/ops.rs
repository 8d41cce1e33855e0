//! Operator commands over a running outbox: `status` (per state, per destination, who holds
//! claims, what is paused), `pause` / `resume` of a destination, and `replay` of delivered
//! events.

use std::time::Duration;

use anyhow::Context;
use chrono::{DateTime, NaiveDate, Utc};
use outbox_types::route::RouteTable;
use outbox_types::{
    DestinationStats, LeaseHolder, OutboxStats, PausedDestination, ReplayFilter, Store, StoreError,
    humantime_duration,
};
use serde_json::json;

use crate::config::ConfigError;
use crate::progress::Progress;

fn age(since: Option<DateTime<Utc>>, now: DateTime<Utc>) -> String {
    match since {
        Some(t) => humantime_duration::format_duration(Duration::from_millis(
            (now - t).num_milliseconds().max(0) as u64,
        )),
        None => "-".into(),
    }
}

/// Optional figures: an older store that lacks an operation shows a note instead of failing
/// the whole status.
fn optional<T>(result: Result<T, StoreError>) -> anyhow::Result<Option<T>> {
    match result {
        Ok(v) => Ok(Some(v)),
        Err(StoreError::Unsupported { .. }) => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// One destination as a running relay sees it: the part of its `/destinations` answer that
/// `outbox status` shows.
#[derive(Clone, Debug, serde::Deserialize)]
pub struct RelayDestination {
    destination: String,
    up: bool,
    #[serde(default)]
    failing: bool,
    #[serde(default)]
    down_since_unix: Option<f64>,
    #[serde(default)]
    reachable: Option<bool>,
}

impl RelayDestination {
    fn down_since(&self) -> Option<DateTime<Utc>> {
        let unix = self.down_since_unix?;
        DateTime::from_timestamp_millis((unix * 1000.0) as i64)
    }
}

/// What `outbox status` learned from a running relay (or why it learned nothing). Up/down and
/// since when live in the relay process, not in the database: the relay is asked, and the
/// status says plainly when it could not be.
#[derive(Clone, Debug)]
pub struct RelayView {
    url: String,
    answer: Result<Vec<RelayDestination>, String>,
}

/// The relay to ask: `--relay` (or `none`), else the config's `metrics.listen` (an unspecified
/// address such as `0.0.0.0` means this machine), else none.
pub fn relay_address(
    flag: Option<&str>,
    listen: Option<std::net::SocketAddr>,
) -> Result<Option<String>, ConfigError> {
    match flag {
        Some("none") => Ok(None),
        Some(url) if url.starts_with("http://") => Ok(Some(url.trim_end_matches('/').to_owned())),
        Some(other) => Err(ConfigError(format!(
            "--relay `{}` is not a relay's metrics address: give it as http://HOST:PORT (the relay's `metrics.listen`, plain HTTP), or `none`",
            outbox_types::redact::redact_url(other)
        ))),
        None => Ok(listen.map(|mut addr| {
            if addr.ip().is_unspecified() {
                addr.set_ip(match addr {
                    std::net::SocketAddr::V4(_) => std::net::Ipv4Addr::LOCALHOST.into(),
                    std::net::SocketAddr::V6(_) => std::net::Ipv6Addr::LOCALHOST.into(),
                });
            }
            format!("http://{addr}")
        })),
    }
}

/// Ask the relay at `url` for `/destinations`, waiting at most two seconds.
pub async fn ask_relay(url: String) -> RelayView {
    #[derive(serde::Deserialize)]
    struct Answer {
        destinations: Vec<RelayDestination>,
    }
    let endpoint = format!("{url}/destinations");
    let answer = async {
        let client = reqwest::Client::builder()
            .timeout(Duration::from_secs(2))
            .build()
            .map_err(|e| e.to_string())?;
        let response = client
            .get(&endpoint)
            .send()
            .await
            .map_err(|e| e.without_url().to_string())?;
        let code = response.status();
        if !code.is_success() {
            return Err(format!(
                "it answered {code} (a relay older than this CLI has no /destinations)"
            ));
        }
        let bytes = response
            .bytes()
            .await
            .map_err(|e| e.without_url().to_string())?;
        let body: Answer = serde_json::from_slice(&bytes)
            .map_err(|e| format!("its answer is not a relay's /destinations: {e}"))?;
        Ok(body.destinations)
    }
    .await;
    RelayView { url, answer }
}

/// The health column of one destination: paused, or what the relay says (down since when, left
/// alone for a cooldown, a check finding it unreachable), or nothing when no relay answered.
fn health(name: &str, is_paused: bool, relay: Option<&RelayView>, now: DateTime<Utc>) -> String {
    let mut words = Vec::new();
    if is_paused {
        words.push("paused".to_owned());
    }
    if let Some(Ok(list)) = relay.map(|r| &r.answer)
        && let Some(d) = list.iter().find(|d| d.destination == name)
    {
        if d.up {
            words.push("up".into());
        } else {
            words.push(format!("DOWN for {}", age(d.down_since(), now)));
        }
        if d.failing {
            words.push("cooling down".into());
        }
        if d.reachable == Some(false) {
            words.push("unreachable".into());
        }
    }
    words.join(", ")
}

/// What `outbox status` reads from the store, once.
struct StatusSnapshot {
    stats: OutboxStats,
    /// `None`: this store cannot report per destination (and so on below).
    per_destination: Option<Vec<DestinationStats>>,
    leases: Option<Vec<LeaseHolder>>,
    paused: Option<Vec<PausedDestination>>,
    /// The store's clock when it answered, else this host's.
    now: DateTime<Utc>,
}

impl StatusSnapshot {
    async fn read(store: &dyn Store, routes: &RouteTable) -> anyhow::Result<Self> {
        let stats = store.stats().await.context("reading the outbox failed")?;
        let per_destination = optional(store.destination_stats(routes).await)
            .context("reading the backlog per destination failed")?;
        let leases = optional(store.leases().await).context("reading the claims failed")?;
        let paused =
            optional(store.paused().await).context("reading paused destinations failed")?;
        let now = stats.observed_at.unwrap_or_else(Utc::now);
        Ok(StatusSnapshot {
            stats,
            per_destination,
            leases,
            paused,
            now,
        })
    }
}

/// `outbox status`.
pub async fn status(
    store: &dyn Store,
    describe: &str,
    routes: &RouteTable,
    wal: Option<&outbox_wal::WalStatus>,
    relay: Option<&RelayView>,
    as_json: bool,
) -> anyhow::Result<()> {
    let snapshot = StatusSnapshot::read(store, routes).await?;
    if as_json {
        let value = status_json(&snapshot, describe, wal, relay)?;
        println!("{}", serde_json::to_string_pretty(&value)?);
        return Ok(());
    }
    let StatusSnapshot {
        stats,
        per_destination,
        leases,
        paused,
        now,
    } = &snapshot;
    let now = *now;
    println!("outbox      {describe}");
    println!(
        "pending     {} ({} waiting for a retry)",
        stats.pending, stats.retrying
    );
    println!("in_flight   {}", stats.in_flight);
    println!("delivered   {}", stats.delivered);
    println!("dead        {}", stats.dead);
    println!(
        "oldest pending age  {}",
        age(stats.oldest_pending_enqueued_at, now)
    );
    print_destinations(per_destination.as_deref(), paused.as_deref(), relay, now);
    match relay.map(|r| (&r.url, &r.answer)) {
        Some((url, Ok(_))) => println!(
            "\nup/down as the relay at {} sees them",
            outbox_types::redact::redact_url(url)
        ),
        Some((url, Err(e))) => println!(
            "\nup/down unknown: no answer from the relay at {} ({e}); pass --relay http://HOST:PORT (its metrics.listen) or --relay none",
            outbox_types::redact::redact_url(url)
        ),
        None => {}
    }
    if let Some(paused) = paused
        && !paused.is_empty()
    {
        println!();
        for p in paused {
            println!(
                "paused: {} since {} by {}",
                p.destination,
                p.paused_at.to_rfc3339(),
                p.paused_by
            );
        }
    }
    if let Some(wal) = wal {
        println!();
        print_wal_lines(wal);
    }
    if let Some(leases) = leases {
        print_claims(leases, now);
    }
    Ok(())
}

/// `outbox status --json`.
fn status_json(
    snapshot: &StatusSnapshot,
    describe: &str,
    wal: Option<&outbox_wal::WalStatus>,
    relay: Option<&RelayView>,
) -> anyhow::Result<serde_json::Value> {
    let (stats, now) = (&snapshot.stats, snapshot.now);
    let (per_destination, leases, paused) = (
        &snapshot.per_destination,
        &snapshot.leases,
        &snapshot.paused,
    );
    let oldest = stats.oldest_pending_age();
    let mut value = json!({
        "outbox": describe,
        "pending": stats.pending,
        "retrying": stats.retrying,
        "in_flight": stats.in_flight,
        "delivered": stats.delivered,
        "dead": stats.dead,
        "oldest_pending_enqueued_at": stats.oldest_pending_enqueued_at,
        "oldest_pending_age_seconds": oldest.map(|a| a.as_secs_f64()),
        "observed_at": stats.observed_at,
    });
    if let Some(list) = &per_destination {
        value["destinations"] = json!(
            list.iter()
                .map(|d| json!({
                    "destination": d.destination,
                    "pending": d.pending,
                    "retrying": d.retrying,
                    "in_flight": d.in_flight,
                    "dead": d.dead,
                    "oldest_pending_enqueued_at": d.oldest_pending_enqueued_at,
                    "lag_seconds": d.oldest_pending_enqueued_at
                        .map(|t| ((now - t).num_milliseconds().max(0) as f64) / 1000.0),
                    "paused": paused.as_ref().is_some_and(|p| p.iter().any(|p| Some(&p.destination) == d.destination.as_ref())),
                    "last_error": d.last_error.as_deref().map(outbox_types::redact::redact_in_text),
                }))
                .collect::<Vec<_>>()
        );
        if let Some(Ok(seen)) = relay.map(|r| &r.answer)
            && let Some(rows) = value["destinations"].as_array_mut()
        {
            for row in rows {
                let name = row["destination"].as_str().unwrap_or_default().to_owned();
                if let Some(d) = seen.iter().find(|d| d.destination == name) {
                    row["up"] = json!(d.up);
                    row["failing"] = json!(d.failing);
                    row["down_since"] = json!(d.down_since());
                    row["reachable"] = json!(d.reachable);
                }
            }
        }
    }
    if let Some(relay) = relay {
        value["relay"] = match &relay.answer {
            Ok(seen) => {
                json!({ "url": relay.url, "answered": true, "destinations": seen.len() })
            }
            Err(e) => json!({ "url": relay.url, "answered": false, "error": e }),
        };
    }
    if let Some(leases) = &leases {
        value["claims"] = json!(leases);
    }
    if let Some(paused) = &paused {
        value["paused"] = json!(paused);
    }
    if let Some(wal) = wal {
        value["wal"] = serde_json::to_value(wal)?;
    }
    Ok(value)
}

/// The backlog table of `outbox status`, and each destination's last error.
fn print_destinations(
    per_destination: Option<&[DestinationStats]>,
    paused: Option<&[PausedDestination]>,
    relay: Option<&RelayView>,
    now: DateTime<Utc>,
) {
    match per_destination {
        Some(list) if !list.is_empty() => {
            println!();
            println!(
                "{:<24} {:>10} {:>9} {:>10} {:>8} {:>10}  state",
                "destination", "pending", "retrying", "in_flight", "dead", "lag"
            );
            for d in list {
                let name = d.destination.as_deref().unwrap_or("(no route)");
                let is_paused = paused
                    .as_ref()
                    .is_some_and(|p| p.iter().any(|p| p.destination == name));
                println!(
                    "{:<24} {:>10} {:>9} {:>10} {:>8} {:>10}  {}",
                    name,
                    d.pending,
                    d.retrying,
                    d.in_flight,
                    d.dead,
                    age(d.oldest_pending_enqueued_at, now),
                    health(name, is_paused, relay, now)
                );
            }
            let errors: Vec<_> = list
                .iter()
                .filter_map(|d| Some((d.destination.as_deref()?, d.last_error.as_deref()?)))
                .collect();
            if !errors.is_empty() {
                println!();
                for (name, error) in errors {
                    println!(
                        "last error  {name}: {}",
                        crate::admin::one_line(&outbox_types::redact::redact_in_text(error), 160)
                    );
                }
            }
        }
        Some(_) => {}
        None => println!("(this store cannot report the backlog per destination)"),
    }
}

/// Who holds claims, for how long, and whether their lease ran out.
fn print_claims(leases: &[LeaseHolder], now: DateTime<Utc>) {
    if leases.is_empty() {
        return;
    }
    println!();
    println!(
        "{:<36} {:>8} {:>12} {:>26}  expired",
        "claims held by", "events", "held for", "lease until"
    );
    for l in leases {
        println!(
            "{:<36} {:>8} {:>12} {:>26}  {}",
            l.owner,
            l.events,
            age(l.claimed_since, now),
            l.expires_at.map(|t| t.to_rfc3339()).unwrap_or_default(),
            l.expired
        );
    }
}

fn bytes(n: Option<u64>) -> String {
    match n {
        None => "-".into(),
        Some(n) if n >= 1 << 30 => format!("{:.1} GiB", n as f64 / f64::from(1u32 << 30)),
        Some(n) if n >= 1 << 20 => format!("{:.1} MiB", n as f64 / f64::from(1u32 << 20)),
        Some(n) if n >= 1 << 10 => format!("{:.1} KiB", n as f64 / 1024.0),
        Some(n) => format!("{n} B"),
    }
}

fn print_wal_lines(s: &outbox_wal::WalStatus) {
    println!(
        "wal slot        {} ({}{})",
        s.slot,
        if s.exists { "exists" } else { "MISSING" },
        if s.active {
            ", streaming"
        } else {
            ", no relay streaming"
        }
    );
    println!("wal lag         {}", bytes(s.lag_bytes));
    println!("retained wal    {}", bytes(s.retained_wal_bytes));
    println!(
        "confirmed lsn   {}",
        s.confirmed_flush_lsn
            .map(|l| l.to_string())
            .unwrap_or_else(|| "-".into())
    );
    println!("current lsn     {}", s.current_wal_lsn);
    if let Some(status) = &s.wal_status {
        println!("slot wal_status {status}");
    }
    println!("message source  {}", message_source_line(&s.message_source));
    if let Some(rate) = s.decode_bytes_per_sec {
        println!(
            "decode rate     {}/s, {:.0} txn/s",
            bytes(Some(rate as u64)),
            s.decode_txns_per_sec.unwrap_or(0.0)
        );
    }
}

/// The message source in one line of `outbox wal status`.
fn message_source_line(access: &outbox_wal::MessageSourceAccess) -> String {
    let who = if access.open_to_public() {
        "every role may write messages (EXECUTE on pg_logical_emit_message is granted to PUBLIC)"
            .to_owned()
    } else if access.granted_to.is_empty() {
        "only superusers may write messages".to_owned()
    } else {
        format!(
            "messages may be written by {} and superusers",
            access.granted_to.join(", ")
        )
    };
    match (access.enabled, access.open_to_public()) {
        (true, true) => format!("ON but REFUSED: {who}; `outbox wal prepare` prints the fix"),
        (true, false) => format!("on; {who}"),
        (false, _) => format!("off; {who}"),
    }
}

/// `outbox wal prepare`: whether the replication connection is encrypted.
pub fn print_replication_connection(connection: &outbox_wal::ReplicationConnection) {
    let mode = serde_json::to_value(connection.sslmode)
        .ok()
        .and_then(|v| v.as_str().map(str::to_owned))
        .unwrap_or_default();
    if connection.tls {
        println!(
            "replication connection: TLS ({}), sslmode {mode}",
            connection
                .tls_version
                .as_deref()
                .unwrap_or("version unknown")
        );
    } else {
        println!(
            "replication connection: NOT encrypted (sslmode {mode}): every event's payload crosses the network in clear text; turn on ssl in PostgreSQL and set sslmode=verify-full (or require) in the URL"
        );
    }
}

/// `outbox wal prepare`: what to run so that only chosen roles can write events as messages,
/// and so that the relay may write its heartbeats.
pub fn print_message_source_fix(access: &outbox_wal::MessageSourceAccess) {
    if access.enabled && access.open_to_public() {
        println!(
            "the relay will refuse to start with `messages` in [wal] sources: every role may call pg_logical_emit_message, so any role that can log in could publish events. Run as a superuser in this database (<writer roles>: the roles that call enqueue_message):"
        );
    } else if !access.relay_can_emit && !access.fix.is_empty() {
        println!(
            "heartbeats are off: role {} may not call pg_logical_emit_message. Run as a superuser in this database:",
            access.relay_role
        );
    } else {
        return;
    }
    for statement in &access.fix {
        println!("  {statement}");
    }
}

/// `outbox wal status`.
pub fn print_wal_status(status: &outbox_wal::WalStatus, as_json: bool) -> anyhow::Result<()> {
    if as_json {
        println!("{}", serde_json::to_string_pretty(status)?);
    } else {
        print_wal_lines(status);
    }
    Ok(())
}

/// Check a destination name given to `pause`/`resume`/`replay` against the configuration, when
/// the configuration names its destinations; suggest the nearest on a typo.
pub fn check_destination(
    name: &str,
    routes: &RouteTable,
    configured: bool,
) -> Result<(), ConfigError> {
    if !configured || routes.contains(name) {
        return Ok(());
    }
    let known: Vec<&str> = routes.destinations().iter().map(String::as_str).collect();
    let hint = crate::config::nearest_name(name, &known)
        .map(|s| format!("; did you mean `{s}`?"))
        .unwrap_or_default();
    Err(ConfigError(format!(
        "unknown destination `{name}`{hint} (configured: {})",
        known.join(", ")
    )))
}

/// Who is doing this, for `paused_by`.
pub fn operator() -> String {
    let user = std::env::var("USER")
        .or_else(|_| std::env::var("LOGNAME"))
        .unwrap_or_else(|_| "unknown".into());
    let host = std::fs::read_to_string("/etc/hostname")
        .map(|h| h.trim().to_owned())
        .unwrap_or_default();
    if host.is_empty() {
        user
    } else {
        format!("{user}@{host}")
    }
}

/// `outbox pause` / `outbox resume`.
pub async fn pause(
    store: &dyn Store,
    destination: &str,
    pause: bool,
    as_json: bool,
) -> anyhow::Result<()> {
    let changed = if pause {
        store.pause(destination, &operator()).await
    } else {
        store.resume(destination).await
    }
    .with_context(|| {
        format!(
            "{} `{destination}` failed",
            if pause { "pausing" } else { "resuming" }
        )
    })?;
    let state = if pause { "paused" } else { "resumed" };
    if as_json {
        println!(
            "{}",
            json!({ "destination": destination, "state": state, "changed": changed })
        );
    } else if changed {
        println!("{destination}: {state} (running relays notice within one poll interval)");
    } else {
        println!(
            "{destination}: already {}",
            if pause { "paused" } else { "running" }
        );
    }
    Ok(())
}

/// A point in time on the command line: RFC 3339 (`2026-11-23T08:00:00Z`), a date
/// (`2026-11-23`, midnight UTC), `now`, or a duration meaning that long ago (`2h`, `7d`).
pub fn parse_time(flag: &str, text: &str) -> Result<DateTime<Utc>, ConfigError> {
    let text = text.trim();
    if text == "now" {
        return Ok(Utc::now());
    }
    if let Ok(t) = DateTime::parse_from_rfc3339(text) {
        return Ok(t.with_timezone(&Utc));
    }
    if let Ok(d) = NaiveDate::parse_from_str(text, "%Y-%m-%d")
        && let Some(t) = d.and_hms_opt(0, 0, 0)
    {
        return Ok(t.and_utc());
    }
    let ago = text.strip_suffix(" ago").unwrap_or(text);
    if let Ok(d) = humantime_duration::parse_duration(ago)
        && let Ok(d) = chrono::Duration::from_std(d)
    {
        return Ok(Utc::now() - d);
    }
    Err(ConfigError(format!(
        "invalid --{flag} `{text}`: use an RFC 3339 time (2026-11-23T08:00:00Z), a date (2026-11-23), `now`, or a duration ago (2h, 7d)"
    )))
}

/// `outbox replay`.
pub async fn replay(
    store: &dyn Store,
    filter: ReplayFilter,
    routes: &RouteTable,
    batch: u32,
    as_json: bool,
) -> anyhow::Result<()> {
    if filter.from >= filter.to {
        return Err(ConfigError(format!(
            "--from ({}) must be earlier than --to ({})",
            filter.from.to_rfc3339(),
            filter.to.to_rfc3339()
        ))
        .into());
    }
    let mut progress = Progress::new("events replayed", as_json);
    let mut after = None;
    loop {
        let step = store
            .replay(&filter, routes, after, batch.max(1))
            .await
            .context("replay failed")?;
        progress.add(step.replayed);
        match step.next_after {
            Some(next) => after = Some(next),
            None => break,
        }
    }
    let total = progress.finish();
    if as_json {
        println!(
            "{}",
            json!({
                "replayed": total,
                "from": filter.from,
                "to": filter.to,
                "destination": filter.destination,
                "event_type": filter.event_type,
            })
        );
    } else {
        println!(
            "replayed {total} delivered event(s) written between {} and {}{}{}: they are pending again with their ids unchanged",
            filter.from.to_rfc3339(),
            filter.to.to_rfc3339(),
            filter
                .destination
                .as_deref()
                .map(|d| format!(", destination {d}"))
                .unwrap_or_default(),
            filter
                .event_type
                .as_deref()
                .map(|t| format!(", event type {t}"))
                .unwrap_or_default(),
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_parse_in_every_documented_form() {
        let t = parse_time("from", "2026-11-23T08:00:00Z").unwrap();
        assert_eq!(t.to_rfc3339(), "2026-11-23T08:00:00+00:00");
        let d = parse_time("from", "2026-11-23").unwrap();
        assert_eq!(d.to_rfc3339(), "2026-11-23T00:00:00+00:00");
        let ago = parse_time("from", "2h").unwrap();
        let diff = Utc::now() - ago;
        assert!((diff.num_seconds() - 7200).abs() < 5, "{diff}");
        assert!(parse_time("from", "2h ago").is_ok());
        let err = parse_time("to", "yesterday").unwrap_err().0;
        assert!(err.contains("invalid --to `yesterday`"), "{err}");
    }

    #[test]
    fn unknown_destination_is_named_with_a_suggestion() {
        let routes = RouteTable::new(["orders", "audit"], vec![]).unwrap();
        let err = check_destination("ordres", &routes, true).unwrap_err().0;
        assert!(err.contains("unknown destination `ordres`"), "{err}");
        assert!(err.contains("did you mean `orders`?"), "{err}");
        assert!(check_destination("orders", &routes, true).is_ok());
        assert!(check_destination("anything", &routes, false).is_ok());
    }
}
