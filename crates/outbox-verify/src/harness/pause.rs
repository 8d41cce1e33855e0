//! Phase 2, faults: the lease-clock fault.
//!
//! Why its own module: pausing a relay proves fencing only if it is frozen while it holds
//! claimed events, stays frozen past its lease until the other relays have re-claimed them, and
//! its log is watched after it resumes for its late writes being fenced. Each of those steps is
//! one function here; what cannot be settled before the fault ends is settled from the whole log
//! after the run ([`super::check`]).

use std::time::{Duration, Instant};

use sqlx::AssertSqlSafe;

use super::Ctx;
use crate::Error;
use crate::history::{LateWrites, LeaseFault};
use crate::relays::{self, RelaySlot, Relays};

/// Events a frozen relay holds: `(seq, lease_token)`.
type Held = Vec<(i64, uuid::Uuid)>;

/// The lease-clock fault: freeze a relay while it holds claimed events, keep it frozen past its
/// lease until the other relays have re-claimed them, resume it, and look in its log for its
/// late writes being fenced.
pub(super) async fn pause_relay(ctx: &Ctx, relay: usize) -> Result<String, Error> {
    let mut slot = ctx.relays.slots[relay].lock().await;
    if slot.child.is_none() {
        return Ok("relay not running".into());
    }
    let id = slot.relay_id.clone();
    let held = freeze_holding_claim(ctx, &mut slot).await?;
    tokio::time::sleep(ctx.lease + Duration::from_millis(500)).await;
    let reclaimed = wait_reclaimed(ctx, &held).await;
    let offset = relays::file_len(&slot.log);
    Relays::signal(&slot, "CONT").await?;
    slot.paused = false;
    let fenced = reclaimed > 0 && wait_fenced(ctx, &slot, offset).await;
    let record = LeaseFault {
        relay: id.clone(),
        held: held.len() as u64,
        reclaimed: u64::try_from(reclaimed).unwrap_or(0),
        late_writes: if fenced {
            LateWrites::Fenced
        } else {
            LateWrites::Pending
        },
        log: Some((slot.log.display().to_string(), offset)),
        leases: held
            .iter()
            .map(|h| h.1.to_string())
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .collect(),
    };
    let note = format!(
        "{id} paused holding {} events, {} re-claimed, fenced after resume: {fenced}{}",
        record.held,
        record.reclaimed,
        if fenced || reclaimed == 0 {
            ""
        } else {
            " (not yet: settled from its whole log after the run)"
        }
    );
    ctx.lease_faults.lock().await.push(record);
    Ok(note)
}

/// Freeze the relay at a moment when it holds a claim: stop it, look, and if it holds nothing
/// let it run a little and try again (claims can be milliseconds long), for up to 10 s. Returns
/// what it holds once the statements it sent before it froze have completed.
async fn freeze_holding_claim(ctx: &Ctx, slot: &mut RelaySlot) -> Result<Held, Error> {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut held: Held;
    loop {
        Relays::signal(slot, "STOP").await?;
        slot.paused = true;
        tokio::time::sleep(Duration::from_millis(20)).await;
        held = held_by(ctx, &slot.relay_id).await;
        if !held.is_empty() || Instant::now() > deadline {
            break;
        }
        Relays::signal(slot, "CONT").await?;
        slot.paused = false;
        tokio::time::sleep(Duration::from_millis(rand::random_range(0..40))).await;
    }
    // Statements it sent before it froze still complete in the server (an ack in flight):
    // what it holds is what is left after them.
    tokio::time::sleep(Duration::from_millis(300)).await;
    Ok(if held.is_empty() {
        held
    } else {
        held_by(ctx, &slot.relay_id).await
    })
}

/// The in-flight events whose lease `relay` owns.
async fn held_by(ctx: &Ctx, relay: &str) -> Held {
    sqlx::query_as(AssertSqlSafe(format!(
        "SELECT seq, lease_token FROM {} WHERE lease_owner = $1 AND status = 'in_flight'",
        ctx.table
    )))
    .bind(relay)
    .fetch_all(&ctx.admin)
    .await
    .unwrap_or_default()
}

/// Wait (up to three leases) until the other relays have re-claimed (or settled) everything the
/// frozen relay holds; how many they have.
async fn wait_reclaimed(ctx: &Ctx, held: &Held) -> i64 {
    let seqs: Vec<i64> = held.iter().map(|h| h.0).collect();
    let tokens: Vec<uuid::Uuid> = held.iter().map(|h| h.1).collect();
    let reclaim_deadline = Instant::now() + ctx.lease * 3;
    let mut reclaimed = 0i64;
    while !held.is_empty() {
        reclaimed = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT count(*) FROM {} t JOIN unnest($1::bigint[], $2::uuid[]) AS h(seq, token) ON t.seq = h.seq
             WHERE t.lease_token IS DISTINCT FROM h.token OR t.status <> 'in_flight'",
            ctx.table
        )))
        .bind(&seqs)
        .bind(&tokens)
        .fetch_one(&ctx.admin)
        .await
        .unwrap_or(reclaimed);
        if reclaimed as usize >= held.len() || Instant::now() > reclaim_deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    reclaimed
}

/// Whether the resumed relay's log shows a fenced write after `offset`.
///
/// A relay frozen after its claim committed but before it read the result believes, once
/// resumed, that its lease starts then: it publishes the whole stale batch (up to a lease long)
/// before its write-back is fenced. Wait for that too (the slot stays locked, so no kill fault
/// cuts it short).
async fn wait_fenced(ctx: &Ctx, slot: &RelaySlot, offset: u64) -> bool {
    let deadline = Instant::now() + (ctx.lease * 8).max(Duration::from_secs(15));
    while Instant::now() < deadline {
        if relays::log_contains_after(&slot.log, offset, &relays::FENCED_MARKERS) {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    false
}
