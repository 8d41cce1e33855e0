//! Admin commands over the `Store` contract: inspect, requeue and discard dead events; run
//! retention once.

use std::time::Duration;

use anyhow::Context;
use outbox_types::redact::{escape_control, redact_in_text, redact_url};
use outbox_types::{DeadFilter, EventId, EventRecord, Store, humantime_duration};
use serde_json::json;

use crate::config::ConfigError;
use crate::progress::Progress;

/// Parse event ids given on the command line; a malformed one is a usage error naming it.
pub fn parse_ids(ids: &[String]) -> Result<Vec<EventId>, ConfigError> {
    ids.iter()
        .map(|s| {
            s.parse::<EventId>()
                .map_err(|e| ConfigError(format!("`{s}` is not an event id (a UUID): {e}")))
        })
        .collect()
}

/// What every listing command prints before its table: with `--json`, `json()` pretty-printed;
/// else, when there is nothing to list, the line `nothing`. Whether that was all (no table).
pub(crate) fn listed_without_a_table<T: serde::Serialize>(
    as_json: bool,
    json: impl FnOnce() -> T,
    empty: bool,
    nothing: &str,
) -> anyhow::Result<bool> {
    if as_json {
        println!("{}", serde_json::to_string_pretty(&json())?);
        return Ok(true);
    }
    if empty {
        println!("{nothing}");
        return Ok(true);
    }
    Ok(false)
}

/// `record` as the admin commands print it: its `last_error` and its `destination` through
/// the redactor. The relay redacts a reason before it stores it; this also covers rows an
/// earlier release wrote, and a writer's own URL in the destination column.
fn redacted(mut record: EventRecord) -> EventRecord {
    record.last_error = record.last_error.as_deref().map(redact_in_text);
    record.event.destination = record.event.destination.as_deref().map(redact_url);
    record
}

pub(crate) fn one_line(text: &str, max: usize) -> String {
    let flat: String = text
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    let flat = escape_control(&flat).into_owned();
    if flat.chars().count() <= max {
        flat
    } else {
        let cut: String = flat.chars().take(max.saturating_sub(1)).collect();
        format!("{cut}…")
    }
}

/// `outbox dead list`.
pub async fn list(
    store: &dyn Store,
    limit: u32,
    after: Option<i64>,
    as_json: bool,
) -> anyhow::Result<()> {
    let dead: Vec<EventRecord> = store
        .list_dead(after, limit)
        .await
        .context("listing dead events failed")?
        .into_iter()
        .map(redacted)
        .collect();
    if listed_without_a_table(as_json, || &dead, dead.is_empty(), "no dead events")? {
        return Ok(());
    }
    println!(
        "{:<36}  {:>8}  {:<24}  {:<20}  {:>3}  last error",
        "id", "seq", "aggregate", "event type", "att"
    );
    for r in &dead {
        let e = &r.event;
        println!(
            "{:<36}  {:>8}  {:<24}  {:<20}  {:>3}  {}",
            e.id,
            e.seq,
            one_line(&format!("{}/{}", e.aggregate_type, e.aggregate_id), 24),
            one_line(&e.event_type, 20),
            e.attempts,
            one_line(r.last_error.as_deref().unwrap_or(""), 60)
        );
    }
    if dead.len() as u32 == limit
        && let Some(last) = dead.last()
    {
        println!("(more may follow: --after {})", last.event.seq);
    }
    Ok(())
}

/// `outbox dead show ID`.
pub async fn show(store: &dyn Store, id: EventId, as_json: bool) -> anyhow::Result<()> {
    let record = store
        .get(id)
        .await
        .context("reading the event failed")?
        .map(redacted)
        .ok_or_else(|| {
            anyhow::anyhow!("no event with id {id} in the outbox (it may have been purged)")
        })?;
    if as_json {
        println!("{}", serde_json::to_string_pretty(&record)?);
    } else {
        print_record(&record);
    }
    Ok(())
}

/// One `label value` line of `outbox dead show`, the value with control characters escaped: a
/// row's text must not drive the operator's terminal.
fn field(label: &str, value: &str) {
    println!("{label:<17}{}", escape_control(value));
}

fn print_record(r: &EventRecord) {
    let e = &r.event;
    field("id", &e.id.to_string());
    field("seq", &e.seq.to_string());
    field("state", &r.state.to_string());
    field(
        "aggregate",
        &format!("{}/{}", e.aggregate_type, e.aggregate_id),
    );
    field("event type", &e.event_type);
    field(
        "destination",
        e.destination.as_deref().unwrap_or("(routing decides)"),
    );
    field(
        "idempotency key",
        e.idempotency_key.as_deref().unwrap_or("-"),
    );
    field("occurred at", &e.occurred_at.to_rfc3339());
    field("enqueued at", &e.enqueued_at.to_rfc3339());
    field("attempts", &e.attempts.to_string());
    field("next attempt at", &r.next_attempt_at.to_rfc3339());
    if let Some(at) = r.delivered_at {
        field("delivered at", &at.to_rfc3339());
    }
    if let Some(at) = r.dead_at {
        field("dead at", &at.to_rfc3339());
    }
    if let Some(owner) = &r.lease_owner {
        field(
            "lease",
            &format!(
                "{owner} until {}",
                r.lease_expires_at
                    .map(|t| t.to_rfc3339())
                    .unwrap_or_default()
            ),
        );
    }
    field(
        "headers",
        &serde_json::to_string(&e.headers).unwrap_or_default(),
    );
    field("last error", r.last_error.as_deref().unwrap_or("-"));
    field("payload", &e.payload);
}

/// `outbox dead requeue` / `outbox dead purge`.
pub async fn act(
    store: &dyn Store,
    filter: DeadFilter,
    requeue: bool,
    as_json: bool,
) -> anyhow::Result<()> {
    let asked = match &filter {
        DeadFilter::Ids(ids) => Some(ids.len()),
        DeadFilter::All => None,
    };
    let n = if requeue {
        store
            .requeue_dead(&filter)
            .await
            .context("requeue failed")?
    } else {
        store.discard_dead(&filter).await.context("purge failed")?
    };
    let verb = if requeue { "requeued" } else { "purged" };
    if as_json {
        let mut out = json!({ verb: n, "asked": asked });
        if !requeue {
            // The key of earlier releases, kept for scripts that read it (see CHANGELOG.md).
            out["discarded"] = json!(n);
        }
        println!("{out}");
    } else {
        println!("{verb} {n} dead event(s)");
        if let Some(asked) = asked
            && (n as usize) < asked
        {
            println!(
                "{} of the given ids were not dead events (already requeued, delivered, or unknown)",
                asked - n as usize
            );
        }
    }
    Ok(())
}

/// `outbox purge`: delete delivered events older than `older_than` (and dead events older than
/// `dead_older_than`, when dead retention is on), in batches by primary key.
pub async fn purge_expired(
    store: &dyn Store,
    older_than: Duration,
    dead_older_than: Option<Duration>,
    batch: u32,
    as_json: bool,
) -> anyhow::Result<()> {
    let total =
        purge_showing_progress(store, Purgeable::Delivered, older_than, batch, as_json).await?;
    let dead = match dead_older_than {
        Some(age) => {
            Some(purge_showing_progress(store, Purgeable::Dead, age, batch, as_json).await?)
        }
        None => None,
    };
    if as_json {
        println!(
            "{}",
            json!({
                "deleted": total,
                "older_than": humantime_duration::format_duration(older_than),
                "dead_deleted": dead,
                "dead_older_than": dead_older_than.map(humantime_duration::format_duration),
            })
        );
    } else {
        println!(
            "deleted {total} delivered event(s) older than {}",
            humantime_duration::format_duration(older_than)
        );
        if let (Some(n), Some(age)) = (dead, dead_older_than) {
            println!(
                "deleted {n} dead event(s) older than {}",
                humantime_duration::format_duration(age)
            );
        }
    }
    Ok(())
}

/// [`purge_in_batches`] for `outbox purge`, counting the deleted events on the terminal as it
/// goes (quiet when the answer is JSON).
async fn purge_showing_progress(
    store: &dyn Store,
    which: Purgeable,
    older_than: Duration,
    batch: u32,
    as_json: bool,
) -> anyhow::Result<u64> {
    let what = match which {
        Purgeable::Delivered => "delivered events deleted",
        Purgeable::Dead => "dead events deleted",
    };
    let mut progress = Progress::new(what, as_json);
    let deleted = purge_in_batches(store, which, older_than, batch, |n| progress.add(n)).await?;
    progress.finish();
    Ok(deleted)
}

/// Which events a purge deletes.
#[derive(Clone, Copy)]
pub(crate) enum Purgeable {
    Delivered,
    Dead,
}

/// The one batch loop behind `outbox purge` and the relay's retention: delete up to `batch`
/// events of the kind `which` (delivered ones older than `older_than`, or dead ones buried
/// longer ago) per round until a round comes back short; a failure names the kind.
pub(crate) async fn purge_in_batches(
    store: &dyn Store,
    which: Purgeable,
    older_than: Duration,
    batch: u32,
    progress: impl FnMut(u64),
) -> anyhow::Result<u64> {
    outbox_types::batch::in_batches(batch, progress, |batch| async move {
        let (deleted, what) = match which {
            Purgeable::Delivered => (store.purge_delivered(older_than, batch).await, "delivered"),
            Purgeable::Dead => (store.purge_dead(older_than, batch).await, "dead"),
        };
        deleted.with_context(|| format!("deleting {what} events failed"))
    })
    .await
}
