//! The stream task of a [`WalSource`](crate::WalSource): leadership, the slot, the replication
//! session and its reconnects, decoding, heartbeats, and confirming the position the state says
//! is settled. It only reads: what it decodes goes into the shared state, where the relay
//! engine claims it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::FutureExt;
use outbox_types::{DeadLetterPolicy, Event};
use pgwire_replication::{ReplicationClient, ReplicationEvent};
use sqlx::{PgConnection, PgPool};
use tokio::sync::watch;
use tracing::{debug, error, info, warn};

use crate::config::{FromRelay, Source, WalConfig};
use crate::conn::{Target, wire_error};
use crate::counters::{WalCounters, add};
use crate::db;
use crate::debezium::{DebeziumLayout, InvalidOp};
use crate::error::{WalError, map_wire};
use crate::limits::{Limits, Oversize, storable};
use crate::lsn::Lsn;
use crate::message::{HEARTBEAT_SUFFIX, decode_envelope, malformed_message};
use crate::pgoutput::{
    self, BadRow, Column, Decoded, Head, Identity, OutboxLayout, Relation, pg_epoch_micros,
    placeholder,
};
use crate::slot;
use crate::source::Shared;
use crate::state::{Origin, State};

/// A row's column values as pgoutput sends them: text form, `None` for SQL NULL.
type Columns<'a> = [Option<&'a [u8]>];

/// Run until `stop`: stand by or stream, reconnect after what may pass, and record what needs a
/// person (a lost slot, a server not set up) in `shared` before returning.
pub(crate) async fn run(
    cfg: Arc<WalConfig>,
    from_relay: FromRelay,
    shared: Arc<Shared>,
    pool: PgPool,
    dead_letter: DeadLetterPolicy,
    mut stop: watch::Receiver<bool>,
) {
    let task = Task {
        cfg,
        from_relay,
        shared,
        pool,
        dead_letter,
    };
    let result = run_inner(&task, &mut stop).await;
    task.shared.set_leading(false);
    if let Err(error) = result {
        error!(%error, "WAL stream stopped; the relay stops too.");
        task.shared.set_fatal(error);
    }
}

/// What every session of the stream task works with, from the task's start to its stop: one
/// value for [`run_inner`] to hand to each [`lead`].
struct Task {
    cfg: Arc<WalConfig>,
    from_relay: FromRelay,
    shared: Arc<Shared>,
    pool: PgPool,
    dead_letter: DeadLetterPolicy,
}

async fn run_inner(task: &Task, stop: &mut watch::Receiver<bool>) -> Result<(), WalError> {
    let Task {
        cfg,
        from_relay,
        shared,
        ..
    } = task;
    let target = Target::parse(&cfg.database_url)?;
    let mut failures = 0u32;
    loop {
        let Some(mut lock) = wait_for_leadership(cfg, from_relay, shared, &target, stop).await
        else {
            return Ok(());
        };
        add(&shared.counters.sessions, 1);
        let result = lead(task, &mut lock, &target, stop).await;
        shared.set_leading(false);
        drop(lock);
        match result {
            Ok(()) => return Ok(()),
            Err(error) if error.is_transient() => {
                add(&shared.counters.errors, 1);
                failures += 1;
                let pause = db::backoff(failures, cfg.max_reconnect_backoff);
                warn!(%error, retry_in_ms = pause.as_millis() as u64, "Streaming session ended; reconnecting. Delivery resumes from the confirmed position.");
                if sleep_or_stop(pause, stop).await {
                    return Ok(());
                }
            }
            Err(error) => return Err(error),
        }
    }
}

/// Become the streamer: hold the slot's advisory lock on a dedicated connection. A standby
/// polls every `standby_poll_interval`; PostgreSQL releases the lock the moment the holder's
/// connection ends, also when its process is killed. `None` when asked to stop.
async fn wait_for_leadership(
    cfg: &WalConfig,
    from_relay: &FromRelay,
    shared: &Shared,
    target: &Target,
    stop: &mut watch::Receiver<bool>,
) -> Option<PgConnection> {
    let mut conn: Option<PgConnection> = None;
    let mut said_standby = false;
    let mut failures = 0u32;
    loop {
        if *stop.borrow() {
            return None;
        }
        let pause = match conn.as_mut() {
            None => match target.connection(&cfg.database_url).await {
                Ok(c) => {
                    conn = Some(c);
                    continue;
                }
                Err(error) => {
                    failures += 1;
                    warn!(%error, "Cannot reach PostgreSQL for the leadership lock; retrying.");
                    db::backoff(failures, cfg.max_reconnect_backoff)
                }
            },
            Some(c) => match slot::try_lead(c, cfg).await {
                Ok(true) => {
                    info!(slot = %cfg.slot, relay_id = %from_relay.relay_id, "This instance streams the slot now.");
                    return conn;
                }
                Ok(false) => {
                    shared.set_standing_by();
                    if !said_standby {
                        info!(slot = %cfg.slot, "Another instance streams this slot; standing by.");
                        said_standby = true;
                    }
                    cfg.standby_poll_interval
                }
                Err(error) => {
                    warn!(%error, "Leadership check failed; reconnecting.");
                    conn = None;
                    failures += 1;
                    db::backoff(failures, cfg.max_reconnect_backoff)
                }
            },
        };
        if sleep_or_stop(pause, stop).await {
            return None;
        }
    }
}

/// One session as the streamer, `lock` held: the slot, the table's snapshot, the stream until
/// it ends; then confirm what is settled and wait for the server to let go of the slot.
async fn lead(
    task: &Task,
    lock: &mut PgConnection,
    target: &Target,
    stop: &mut watch::Receiver<bool>,
) -> Result<(), WalError> {
    let Task {
        cfg,
        from_relay,
        shared,
        pool,
        dead_letter,
    } = task;
    slot::check_server(pool).await?;
    let heartbeats = check_message_access(cfg, from_relay.stop_when_caught_up, pool).await?;
    slot::ensure_slot(pool, cfg).await?;
    let drain_target = if from_relay.stop_when_caught_up {
        // A commit at or past the target, so an idle outbox gets there too.
        db::heartbeat(pool, &cfg.message_prefix).await?;
        Some(db::current_lsn(pool).await?)
    } else {
        None
    };
    shared.set_drain_target(drain_target);
    // The slot first, the table's snapshot after. Until this instance holds the slot, a
    // predecessor that has not yet noticed it lost the lock may still stream and confirm: it
    // leaves the events of aggregates its table owns to that table (nothing is written for
    // them) and confirms past them. A snapshot taken before would not know those rows, and the
    // stream, starting past them, would deliver their aggregates' later events first (found by
    // outbox-verify: a takeover after `terminate_relay_connections`). Once the slot is ours its
    // position no longer moves: every row committed before it is in the snapshot.
    let (mut client, start) = start_client(cfg, from_relay, pool, target, stop).await?;
    shared.state().begin_session(start);
    let mut watermark = match own_open_rows(cfg, shared, pool, *dead_letter).await {
        Ok(watermark) => watermark.map(Watermark::new),
        Err(error) => {
            client.abort();
            return Err(error);
        }
    };
    shared.set_leading(true);
    let result = stream_loop(
        cfg,
        from_relay.limits,
        shared,
        pool,
        heartbeats,
        &mut client,
        lock,
        stop,
        &mut watermark,
    )
    .await;
    shared.set_leading(false);
    // Whatever ended the loop, confirm what is settled. On a stop, wait (briefly) for the
    // relay's last write-backs to settle first.
    if result.is_ok() {
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline && !shared.state().is_idle() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    let (ack, seen_max) = {
        let state = shared.state();
        (state.ack(), state.seen_max)
    };
    let ack = match &mut watermark {
        Some(mark) => mark.settle(ack, seen_max, pool, cfg).await,
        None => ack,
    };
    confirm(shared, &client, ack);
    if result.is_ok() {
        let deadline = Instant::now() + cfg.status_interval * 2 + Duration::from_secs(1);
        while Lsn::from(client.metrics().last_applied_lsn()) < ack && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let _ = tokio::time::timeout(Duration::from_secs(5), client.shutdown()).await;
    } else {
        client.abort();
    }
    // The server lets go of the slot a moment after the session ends: wait for it, so that a
    // standby (or `outbox wal drop-slot`) right after a stop finds it free.
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline {
        match slot::slot_info(pool, &cfg.slot).await {
            Ok(Some(info)) if info.active => {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            _ => break,
        }
    }
    result
}

/// Refuse to capture messages any role could write; find out whether the relay may write its
/// heartbeats. Runs at the start of every session (start, reconnect, takeover), so a grant to
/// PUBLIC made while the relay runs stops it at its next reconnect at the latest. Returns
/// whether heartbeats are on.
async fn check_message_access(
    cfg: &WalConfig,
    draining: bool,
    pool: &PgPool,
) -> Result<bool, WalError> {
    let access = slot::message_source_access(pool, cfg).await?;
    if cfg.captures(Source::Messages) && access.open_to_public() {
        let database: String = sqlx::query_scalar("SELECT current_database()::text")
            .fetch_one(pool)
            .await
            .map_err(crate::error::map_sqlx)?;
        return Err(WalError::ServerSetup(access.refusal(&database)));
    }
    if access.relay_can_emit {
        return Ok(!cfg.heartbeat_interval.is_zero());
    }
    let grant = format!(
        "GRANT EXECUTE ON FUNCTION {} TO {}",
        slot::EMIT_BYTEA,
        slot::quote_role(&access.relay_role)
    );
    if draining {
        return Err(WalError::ServerSetup(format!(
            "role `{}` may not call pg_logical_emit_message, which a drain (`stop_when_caught_up`) needs to mark the position to catch up to: run `{grant}` as a superuser",
            access.relay_role
        )));
    }
    if !cfg.heartbeat_interval.is_zero() {
        warn!(
            role = %access.relay_role,
            "Heartbeats are off: this role may not call pg_logical_emit_message. An idle outbox on a busy server then lets its slot retain WAL until the next event. Run `{grant}` as a superuser, or set `heartbeat_interval = \"0ms\"` to silence this."
        );
    }
    Ok(false)
}

/// Sleep `pause`; `true` when asked to stop meanwhile.
pub(crate) async fn sleep_or_stop(pause: Duration, stop: &mut watch::Receiver<bool>) -> bool {
    if *stop.borrow() {
        return true;
    }
    tokio::select! {
        _ = tokio::time::sleep(pause) => *stop.borrow(),
        _ = stop.changed() => true,
    }
}

/// What the table owns as the session starts: its aggregates' newer events must not overtake
/// it. With `catch_up`, every undelivered row the stream will not send again: those at or
/// below the slot's table watermark (rows left by the polling relay, requeued ones, rows
/// committed before the slot existed, rows a predecessor left to its table; see the `slot`
/// module), or every undelivered row when the slot has no watermark (created by hand); the rows
/// above it committed after the confirmed position, so the stream is about to deliver them, at
/// stream speed. Without `catch_up`, only rows that hold their aggregate back (retries, dead
/// under `block`, live claims).
///
/// Returns the watermark the stream must keep raising before it confirms past table rows it
/// decodes, when the outbox table is captured and the slot has a row to hold it.
async fn own_open_rows(
    cfg: &WalConfig,
    shared: &Shared,
    pool: &PgPool,
    dead_letter: DeadLetterPolicy,
) -> Result<Option<i64>, WalError> {
    let streams_table = cfg.captures(Source::Table);
    let high_water = db::max_seq(pool, cfg).await?;
    let mut watermark = if streams_table {
        slot::table_watermark(pool, cfg).await?
    } else {
        None
    };
    if streams_table
        && watermark.is_none()
        && slot::raise_table_watermark(pool, cfg, high_water).await?
    {
        // A slot from before the watermark: this session owns every undelivered row, as
        // before, and from now on the watermark covers them.
        info!(
            high_water,
            "The slot's table watermark starts at the highest seq."
        );
        watermark = Some(high_water);
    }
    let all_up_to = match (cfg.catch_up, watermark) {
        (false, _) => None,
        (true, Some(mark)) => Some(mark),
        (true, None) => Some(i64::MAX),
    };
    let owned = db::open_rows(pool, cfg, all_up_to, dead_letter).await?;
    let mut state = shared.state();
    for (seq, aggregate) in owned {
        state.own(aggregate, seq);
    }
    if cfg.catch_up {
        // The table may deliver any row up to here: the stream checks those it sees again.
        state.check_up_to = state
            .check_up_to
            .max(all_up_to.map_or(high_water, |up_to| up_to.min(high_water)));
    }
    info!(
        owned = state.owned_count(),
        high_water,
        table_watermark = watermark,
        "Session started; the table delivers what it owns, the stream the rest."
    );
    Ok(watermark.filter(|_| streams_table))
}

/// The slot's table watermark as the stream keeps it: what the bookkeeping table holds, and up
/// to which position that covers every table row decoded (see the `slot` module).
struct Watermark {
    /// The value stored.
    stored: i64,
    /// Positions up to this were decoded when `stored` was written: confirming them is safe.
    covers: Lsn,
    /// A write under way: the value and the position it will cover.
    writing: Option<tokio::task::JoinHandle<Result<(i64, Lsn), WalError>>>,
}

impl Watermark {
    fn new(stored: i64) -> Self {
        Watermark {
            stored,
            covers: Lsn::ZERO,
            writing: None,
        }
    }

    /// The newest position that may be confirmed when `ack` is settled: all of it once every
    /// table row decoded (`seen_max`) is at or below the stored watermark, else what the last
    /// write covered. When it lags, starts a write of `seen_max`, which covers `decoded` (the
    /// end of the last transaction decoded): at most one at a time, so at most one per
    /// confirmation.
    async fn confirmable(
        &mut self,
        ack: Lsn,
        seen_max: i64,
        decoded: Lsn,
        pool: &PgPool,
        cfg: &Arc<WalConfig>,
    ) -> Result<Lsn, WalError> {
        if self.writing.as_ref().is_some_and(|w| w.is_finished())
            && let Some(writing) = self.writing.take()
        {
            match writing.await {
                Ok(Ok((stored, covers))) => {
                    self.stored = self.stored.max(stored);
                    self.covers = self.covers.max(covers);
                }
                Ok(Err(error)) => {
                    warn!(%error, "Could not raise the slot's table watermark; the confirmed position waits for it.");
                }
                Err(error) => warn!(%error, "The table watermark's write failed."),
            }
        }
        if seen_max <= self.stored {
            return Ok(ack);
        }
        if self.writing.is_none() {
            let (pool, cfg) = (pool.clone(), cfg.clone());
            self.writing = Some(tokio::spawn(async move {
                slot::raise_table_watermark(&pool, &cfg, seen_max).await?;
                Ok((seen_max, decoded))
            }));
        }
        Ok(ack.min(self.covers))
    }

    /// Raise the stored watermark over every table row decoded, waiting for it: before the
    /// last confirmation of a session. Returns what may be confirmed.
    async fn settle(&mut self, ack: Lsn, seen_max: i64, pool: &PgPool, cfg: &WalConfig) -> Lsn {
        if let Some(writing) = self.writing.take()
            && let Ok(Ok((stored, covers))) = writing.await
        {
            self.stored = self.stored.max(stored);
            self.covers = self.covers.max(covers);
        }
        if seen_max <= self.stored {
            return ack;
        }
        match slot::raise_table_watermark(pool, cfg, seen_max).await {
            Ok(_) => {
                self.stored = seen_max;
                ack
            }
            Err(error) => {
                warn!(%error, "Could not raise the slot's table watermark; the position stays where it covers.");
                ack.min(self.covers)
            }
        }
    }
}

/// Start streaming from the slot, waiting for a predecessor to let go of it; returns the client
/// and the position it starts from.
async fn start_client(
    cfg: &WalConfig,
    from_relay: &FromRelay,
    pool: &PgPool,
    target: &Target,
    stop: &watch::Receiver<bool>,
) -> Result<(ReplicationClient, Lsn), WalError> {
    let deadline = Instant::now() + cfg.takeover_timeout;
    let started = Instant::now();
    loop {
        // Read the slot's position each time: a predecessor may still be confirming.
        let confirmed = match slot::slot_info(pool, &cfg.slot).await? {
            Some(info) => info.confirmed_flush.unwrap_or(Lsn::ZERO),
            None => {
                return Err(WalError::SlotLost {
                    slot: cfg.slot.clone(),
                    detail: "it disappeared before streaming started".into(),
                });
            }
        };
        let session = target.replication(cfg, confirmed, &from_relay.relay_id, &from_relay.limits);
        let mut client = ReplicationClient::connect(session)
            .await
            .map_err(|e| wire_error(e, &target.tls))?;
        match client.wait_started().await {
            Ok(()) => {
                info!(slot = %cfg.slot, %confirmed, "Streaming from the slot.");
                return Ok((client, confirmed));
            }
            Err(e) => match with_slot(wire_error(e, &target.tls), &cfg.slot) {
                WalError::SlotBusy { .. } if Instant::now() < deadline && !*stop.borrow() => {
                    debug!(
                        "Slot still active for the previous streamer; waiting for it to let go."
                    );
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                WalError::SlotBusy { slot, .. } => {
                    return Err(WalError::SlotBusy {
                        slot,
                        waited_ms: started.elapsed().as_millis() as u64,
                    });
                }
                other => return Err(other),
            },
        }
    }
}

fn confirm(shared: &Shared, client: &ReplicationClient, ack: Lsn) {
    let counters = &shared.counters;
    let previous = counters
        .last_acked_lsn
        .load(std::sync::atomic::Ordering::Relaxed);
    if ack.0 > previous && !ack.is_zero() {
        client.update_applied_lsn(ack.into());
        counters
            .last_acked_lsn
            .fetch_max(ack.0, std::sync::atomic::Ordering::Relaxed);
    }
}

#[allow(clippy::too_many_arguments)]
async fn stream_loop(
    cfg: &Arc<WalConfig>,
    limits: Limits,
    shared: &Arc<Shared>,
    pool: &PgPool,
    heartbeats: bool,
    client: &mut ReplicationClient,
    lock: &mut PgConnection,
    stop: &mut watch::Receiver<bool>,
    watermark: &mut Option<Watermark>,
) -> Result<(), WalError> {
    let mut decoder = Decoder::new(cfg.clone(), limits, shared.counters.clone());
    let mut heartbeat = tokio::time::interval(if heartbeats {
        cfg.heartbeat_interval
    } else {
        Duration::from_secs(3600)
    });
    heartbeat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    heartbeat.tick().await;
    let mut lock_check = tokio::time::interval(Duration::from_secs(2));
    lock_check.tick().await;
    let mut aux = tokio::task::JoinSet::new();
    // Raising the applied position wakes the replication worker; at a trickle of events that
    // is one wakeup per event for nothing (it reports at most every status_interval).
    let confirm_every = (cfg.status_interval / 4).max(Duration::from_millis(10));
    let mut last_confirm = Instant::now();
    loop {
        // Settlements from here on wake the loop, until it knows it need not be woken: the
        // position they move is then confirmed by the armed timer.
        shared.want_settlements(true);
        let (ack, room, seen_max, decoded) = {
            let state = shared.state();
            (
                state.ack(),
                state.buffered_events < cfg.max_buffered_events
                    && state.buffered_bytes < cfg.max_buffered_bytes,
                state.seen_max,
                state.decoded_end,
            )
        };
        let confirmed = Lsn(shared
            .counters
            .last_acked_lsn
            .load(std::sync::atomic::Ordering::Relaxed));
        let confirm_at = (ack > confirmed).then(|| last_confirm + confirm_every);
        if confirm_at.is_some_and(|at| Instant::now() >= at) {
            // Past table rows only once the slot's table watermark covers them (see the `slot`
            // module): the next session tells the stream's rows from the table's by it.
            let ack = match watermark {
                Some(mark) => mark.confirmable(ack, seen_max, decoded, pool, cfg).await?,
                None => ack,
            };
            confirm(shared, client, ack);
            last_confirm = Instant::now();
            continue;
        }
        shared.want_settlements(!room || confirm_at.is_none());
        tokio::select! {
            biased;
            _ = stop.changed() => return Ok(()),
            received = client.recv(), if room => {
                let mut next = Some(received);
                let mut budget = 1024;
                let mut state = shared.state();
                while let Some(received) = next.take() {
                    match received {
                        Ok(Some(event)) => decoder.handle(event, &mut state)?,
                        Ok(None) => return Err(WalError::Replication("the replication stream ended".into())),
                        Err(e) => return Err(with_slot(map_wire(e), &cfg.slot)),
                    }
                    budget -= 1;
                    let room = state.buffered_events < cfg.max_buffered_events
                        && state.buffered_bytes < cfg.max_buffered_bytes;
                    if budget > 0 && room {
                        next = client.recv().now_or_never();
                    }
                }
                let waiting = state.has_ready();
                drop(state);
                if waiting {
                    shared.work.notify_one();
                }
            }
            // Room freed, or the position may have moved.
            _ = shared.room.notified() => {}
            _ = sleep_until(confirm_at) , if confirm_at.is_some() => {}
            _ = heartbeat.tick(), if heartbeats => {
                let pool = pool.clone();
                let prefix = cfg.message_prefix.clone();
                while aux.try_join_next().is_some() {}
                aux.spawn(async move {
                    if let Err(error) = db::heartbeat(&pool, &prefix).await {
                        warn!(%error, "Heartbeat failed.");
                    }
                });
            }
            _ = lock_check.tick() => {
                if let Err(error) = sqlx::query("SELECT 1").execute(&mut *lock).await {
                    return Err(WalError::Unavailable(format!(
                        "lost the connection that holds the streamer lock ({error}); stepping down"
                    )));
                }
            }
        }
    }
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at.into()).await,
        None => std::future::pending().await,
    }
}

/// Put the slot name into errors mapped without it.
pub(crate) fn with_slot(error: WalError, slot_name: &str) -> WalError {
    match error {
        WalError::SlotBusy { waited_ms, .. } => WalError::SlotBusy {
            slot: slot_name.to_owned(),
            waited_ms,
        },
        WalError::SlotLost { detail, .. } => WalError::SlotLost {
            slot: slot_name.to_owned(),
            detail,
        },
        WalError::SlotInvalidated { .. } => WalError::SlotInvalidated {
            slot: slot_name.to_owned(),
        },
        other => other,
    }
}

/// Turns replication events into state changes.
struct Decoder {
    cfg: Arc<WalConfig>,
    limits: Limits,
    counters: Arc<WalCounters>,
    relid: Option<u32>,
    layout: Option<OutboxLayout>,
    /// The stream table (`<table>_stream`), when captured.
    stream_relid: Option<u32>,
    stream_layout: Option<OutboxLayout>,
    stream_table: String,
    /// The Debezium outbox table, when captured: `(schema, name)`, its relation and layout.
    debezium: Option<(String, String)>,
    debezium_relid: Option<u32>,
    debezium_layout: Option<DebeziumLayout>,
    heartbeat_prefix: String,
    tables: bool,
    streams: bool,
    messages: bool,
    /// Logical messages with the outbox prefix read past for their size.
    unreadable: metrics::Counter,
}

/// Which captured table a row belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Captured {
    /// The outbox table: the row keeps the event (dead-lettered in place).
    Outbox,
    /// The stream table: the row stays there; a dead event is copied into the outbox table.
    Stream,
    /// The Debezium outbox table: as the stream table.
    Debezium,
}

impl Decoder {
    fn new(cfg: Arc<WalConfig>, limits: Limits, counters: Arc<WalCounters>) -> Self {
        Decoder {
            limits,
            heartbeat_prefix: format!("{}{HEARTBEAT_SUFFIX}", cfg.message_prefix),
            tables: cfg.captures(Source::Table),
            streams: cfg.captures(Source::StreamTable),
            stream_table: cfg.stream_table(),
            debezium: cfg
                .captures(Source::Debezium)
                .then(|| cfg.debezium.schema_and_name()),
            debezium_relid: None,
            debezium_layout: None,
            messages: cfg.captures(Source::Messages),
            cfg,
            counters,
            relid: None,
            layout: None,
            stream_relid: None,
            stream_layout: None,
            unreadable: metrics::counter!("outbox_wal_messages_unreadable_total"),
        }
    }

    /// The captured table `relid` is, if any.
    fn captured(&self, relid: u32) -> Option<Captured> {
        if Some(relid) == self.debezium_relid {
            Some(Captured::Debezium)
        } else if self.streams && Some(relid) == self.stream_relid {
            Some(Captured::Stream)
        } else if self.tables && Some(relid) == self.relid {
            Some(Captured::Outbox)
        } else {
            None
        }
    }

    /// Where the payload column of `table` sits (once its relation is known).
    fn payload_index(&self, table: Captured) -> Option<usize> {
        match table {
            Captured::Outbox => self.layout.as_ref().map(OutboxLayout::payload_index),
            Captured::Stream => self.stream_layout.as_ref().map(OutboxLayout::payload_index),
            Captured::Debezium => self
                .debezium_layout
                .as_ref()
                .map(DebeziumLayout::payload_index),
        }
    }

    /// `table` quoted, for reasons and logs.
    fn table_name(&self, table: Captured) -> String {
        match table {
            Captured::Outbox => format!("\"{}\".\"{}\"", self.cfg.schema, self.cfg.table),
            Captured::Stream => format!("\"{}\".\"{}\"", self.cfg.schema, self.stream_table),
            Captured::Debezium => self.cfg.debezium.quoted(),
        }
    }

    /// A logical message with the outbox prefix too large to be read (the client read past
    /// it): nothing of it is kept, so it cannot even be dead-lettered. Counted and logged with
    /// its position and size, never its content.
    fn unreadable_message(&mut self, lsn: Lsn, bytes: usize) {
        add(&self.counters.messages_unreadable, 1);
        self.unreadable.increment(1);
        warn!(
            %lsn,
            bytes,
            limit = self.limits.wire(),
            "A logical message with the outbox prefix is larger than the relay reads of one record (relay.max_payload_bytes and relay.max_metadata_bytes, doubled for messages, plus framing): it was read past unread, is not delivered and cannot be dead-lettered. Roles that may call pg_logical_emit_message can write such messages: `outbox wal status` lists them."
        );
    }

    /// A decoded event, dead-lettered instead when its payload is above the limit (a last
    /// guard for events shaped after the column checks, as a Debezium table's are: a table
    /// row keeps its payload in the table; a copy is written without it).
    fn push(
        &self,
        state: &mut State,
        mut event: Event,
        origin: Origin,
        in_tx: bool,
        standalone_end: Option<Lsn>,
    ) {
        add(&self.counters.decoded, 1);
        let size = event.payload.len() as u64;
        let dead = (size > self.limits.max_payload_bytes).then(|| {
            add(&self.counters.undecodable, 1);
            let over = Oversize::Payload {
                bytes: size,
                limit: self.limits.max_payload_bytes,
            };
            if origin == Origin::Table {
                event.payload = String::new();
                over.for_row()
            } else {
                let (cut, note) = storable(std::mem::replace(&mut event, placeholder(0, 0)), true);
                event = cut;
                format!(
                    "{}{note}",
                    over.for_copy("Its source keeps it (a stream or Debezium table's row).")
                )
            }
        });
        state.push(event, origin, in_tx, standalone_end, dead);
    }

    fn push_dead(
        &self,
        state: &mut State,
        event: Event,
        origin: Origin,
        in_tx: bool,
        standalone_end: Option<Lsn>,
        error: String,
    ) {
        add(&self.counters.decoded, 1);
        add(&self.counters.undecodable, 1);
        warn!(
            seq = event.seq,
            origin = ?origin,
            %error,
            "An outbox item cannot be read as an event; it is dead-lettered (`outbox dead list` shows it) and the stream moves on."
        );
        state.push(event, origin, in_tx, standalone_end, Some(error));
    }

    /// A dead event for the row of an insert-only table (the stream table, a Debezium outbox
    /// table) at `lsn`, to copy into the outbox table: its id derived from the slot and the
    /// position (one row however often the row is sent again), `null` as its payload, and what
    /// `identity` could read of the row (cut to fit the outbox table).
    fn copy_of_row(
        &self,
        state: &State,
        lsn: Lsn,
        event_type: &str,
        identity: Identity,
    ) -> (Event, String) {
        let (mut event, _) = malformed_message(
            &self.cfg.slot,
            lsn,
            b"null",
            "",
            state.commit_time.unwrap_or_else(chrono::Utc::now),
        );
        event.event_type = identity.event_type.unwrap_or_else(|| event_type.to_owned());
        if let Some(id) = identity.id {
            event.id = outbox_types::EventId::from_uuid(id);
        }
        if let (Some(aggregate_type), Some(aggregate_id)) =
            (identity.aggregate_type, identity.aggregate_id)
        {
            event.aggregate_type = aggregate_type;
            event.aggregate_id = aggregate_id;
        }
        storable(event, false)
    }

    /// A row of an insert-only table (the stream table, a Debezium outbox table) that cannot
    /// be read as an event: dead-lettered under its LSN, the row left where it is.
    fn push_malformed_row(&self, state: &mut State, lsn: Lsn, table: &str, reason: &str) {
        let (event, _) = self.copy_of_row(state, lsn, "outbox.malformed_row", Identity::default());
        let error = format!(
            "the row of {table} at {lsn} cannot be read as an event: {reason}. The row stays in that table; fix the writer, then `outbox dead purge` this event"
        );
        self.push_dead(state, event, Origin::Message, true, None, error);
    }

    /// A row of `table` over the record limits (`over`), with what could be read of it
    /// (`columns`: all of them, or the leading ones of a record read past): dead-lettered
    /// without being decoded. An outbox table row is marked dead by its `seq`, its payload
    /// left in the row; a row of another table is copied in cut form ([`storable`]).
    fn oversized_row(
        &self,
        state: &mut State,
        table: Captured,
        columns: &[Column<'_>],
        lsn: Lsn,
        over: Oversize,
    ) {
        let name = self.table_name(table);
        match table {
            Captured::Outbox => {
                let Some(layout) = &self.layout else {
                    return;
                };
                let identity = layout.identity(columns);
                // The relay's own rows (dead copies) are not events.
                if identity.status.as_deref().is_some_and(|s| s != "pending") {
                    return;
                }
                match identity.seq {
                    Some(seq) => {
                        let mut event = placeholder(seq, 0);
                        if let (Some(aggregate_type), Some(aggregate_id)) =
                            (identity.aggregate_type, identity.aggregate_id)
                        {
                            event.aggregate_type = aggregate_type;
                            event.aggregate_id = aggregate_id;
                        }
                        self.push_dead(state, event, Origin::Table, true, None, over.for_row());
                    }
                    None => {
                        add(&self.counters.undecodable, 1);
                        error!(%lsn, table = %name, reason = %over.what(), "An outbox row too large to read has no readable seq; it stays pending in the table, where a table claim dead-letters it without loading it (at the next session's catch-up).");
                    }
                }
            }
            Captured::Stream | Captured::Debezium => {
                let identity = match (table, &self.stream_layout) {
                    (Captured::Stream, Some(layout)) => layout.identity(columns),
                    _ => Identity::default(),
                };
                let (event, note) = self.copy_of_row(state, lsn, "outbox.oversized_row", identity);
                let error = format!(
                    "the row of {name} at {lsn} is not delivered: {}{note}",
                    over.for_copy("The row stays in that table.")
                );
                self.push_dead(state, event, Origin::Message, true, None, error);
            }
        }
    }

    /// An update of a Debezium outbox table row: never an event; `table.op.invalid.behavior`
    /// says how loudly.
    fn invalid_op(&self, lsn: Lsn) -> Result<(), WalError> {
        let table = self.cfg.debezium.quoted();
        match self.cfg.debezium.op_invalid_behavior {
            InvalidOp::Warn => {
                warn!(%lsn, %table, "Ignored an update of the Debezium outbox table: only inserts are events (`table.op.invalid.behavior = \"warn\"`).");
                Ok(())
            }
            InvalidOp::Error => {
                error!(%lsn, %table, "Ignored an update of the Debezium outbox table: only inserts are events (`table.op.invalid.behavior = \"error\"`).");
                Ok(())
            }
            InvalidOp::Fatal => Err(WalError::Config(format!(
                "an update of the Debezium outbox table {table} at {lsn}: only inserts are events and `table.op.invalid.behavior = \"fatal\"` stops the relay. Stop the writer that updates outbox rows; to get past this update, set the option to `warn` (with `fatal` a restart stops here again)"
            ))),
        }
    }

    fn handle(&mut self, event: ReplicationEvent, state: &mut State) -> Result<(), WalError> {
        match event {
            ReplicationEvent::Begin {
                commit_time_micros, ..
            } => {
                add(&self.counters.transactions, 1);
                state.begin(pg_epoch_micros(commit_time_micros));
            }
            ReplicationEvent::Commit { end_lsn, .. } => state.commit(end_lsn.into()),
            ReplicationEvent::KeepAlive { wal_end, .. } => state.keepalive(wal_end.into()),
            ReplicationEvent::XLogData {
                data, wal_start, ..
            } => {
                let lsn = Lsn::from(wal_start);
                match pgoutput::decode(&data).map_err(WalError::Decode)? {
                    Decoded::Relation(relation) => self.on_relation(&relation)?,
                    Decoded::Insert { relid, values } => self.on_insert(state, relid, &values, lsn),
                    Decoded::Update { relid } if Some(relid) == self.debezium_relid => {
                        self.invalid_op(lsn)?;
                    }
                    // Deletes of a Debezium outbox table are how writers keep it empty.
                    Decoded::Update { .. } | Decoded::Delete | Decoded::Other => {}
                }
            }
            ReplicationEvent::Oversized {
                wal_start,
                size,
                prefix,
                ..
            } => self.on_oversized(state, Lsn::from(wal_start), size, &prefix)?,
            ReplicationEvent::Message {
                transactional,
                lsn,
                prefix,
                content,
            } => self.on_message(state, transactional, Lsn::from(lsn), &prefix, &content),
            ReplicationEvent::StoppedAt { .. } => {}
        }
        Ok(())
    }

    /// A new row: of a captured table, checked against the record limits (the payload column
    /// and the others together) before it is decoded, then read as its table's rows are.
    fn on_insert(&mut self, state: &mut State, relid: u32, values: &Columns, lsn: Lsn) {
        let Some(table) = self.captured(relid) else {
            return;
        };
        if table == Captured::Outbox
            && self
                .layout
                .as_ref()
                .is_some_and(|layout| !layout.is_pending(values))
        {
            // The relay's own rows (dead copies of failed events), not events.
            return;
        }
        if let Some(payload) = self.payload_index(table) {
            let columns = values.iter().map(|v| v.map_or(Column::Null, Column::Whole));
            let (payload_bytes, others) = pgoutput::column_sizes(columns, payload);
            if let Err(over) = self.limits.check_row(payload_bytes, others) {
                let columns = pgoutput::whole(values);
                self.oversized_row(state, table, &columns, lsn, over);
                return;
            }
        }
        match table {
            Captured::Debezium => self.on_debezium_insert(state, values, lsn),
            Captured::Stream => self.on_stream_insert(state, values, lsn),
            Captured::Outbox => self.on_table_insert(state, values, lsn),
        }
    }

    /// A record the replication client read past for its size (over `limits.wire()`): what
    /// its first bytes tell decides what becomes of it. A row of a captured table is
    /// dead-lettered ([`Decoder::oversized_row`]); a logical message with the outbox prefix
    /// is counted ([`Decoder::unreadable_message`]); anything else was nothing to the relay.
    /// Either way the stream moves on, and the position past it is confirmed like any other.
    fn on_oversized(
        &mut self,
        state: &mut State,
        lsn: Lsn,
        size: usize,
        head: &[u8],
    ) -> Result<(), WalError> {
        match pgoutput::decode_head(head) {
            Head::Insert { relid, columns } => {
                let Some(table) = self.captured(relid) else {
                    debug!(%lsn, bytes = size, "Read past a large row of a table no source reads.");
                    return Ok(());
                };
                let payload = self
                    .payload_index(table)
                    .and_then(|i| columns.get(i))
                    .map(|c| c.len() as u64);
                let over = match payload {
                    Some(bytes) if bytes > self.limits.max_payload_bytes => Oversize::Payload {
                        bytes,
                        limit: self.limits.max_payload_bytes,
                    },
                    _ => Oversize::Record {
                        bytes: size as u64,
                        limit: self.limits.wire(),
                    },
                };
                self.oversized_row(state, table, &columns, lsn, over);
            }
            Head::Message {
                lsn: at, prefix, ..
            } => {
                let prefix = prefix.as_deref();
                if prefix == Some(self.heartbeat_prefix.as_str()) {
                    add(&self.counters.heartbeats, 1);
                } else if self.messages && prefix.is_none_or(|p| p == self.cfg.message_prefix) {
                    self.unreadable_message(Lsn(at), size);
                } else {
                    debug!(lsn = %Lsn(at), bytes = size, "Read past a large logical message with another prefix.");
                }
            }
            Head::Update { relid } if Some(relid) == self.debezium_relid => self.invalid_op(lsn)?,
            Head::Relation {
                namespace, name, ..
            } => {
                let ours = |schema: &str, table: &str| {
                    namespace.as_deref() == Some(schema) && name.as_deref() == Some(table)
                };
                let captured = ours(&self.cfg.schema, &self.cfg.table)
                    || ours(&self.cfg.schema, &self.stream_table)
                    || self
                        .debezium
                        .as_ref()
                        .is_some_and(|(schema, table)| ours(schema, table));
                if captured {
                    return Err(WalError::Decode(format!(
                        "the description of a captured table ({} bytes) is larger than the relay reads of one record ({} bytes): raise relay.max_metadata_bytes",
                        size,
                        self.limits.wire()
                    )));
                }
            }
            _ => debug!(%lsn, bytes = size, "Read past a large change no source reads."),
        }
        Ok(())
    }

    /// A table's layout: the outbox table's, the stream table's or the Debezium table's,
    /// learned before the first row of it in this stream.
    fn on_relation(&mut self, relation: &Relation) -> Result<(), WalError> {
        if relation.namespace == self.cfg.schema && relation.name == self.cfg.table {
            self.layout = Some(OutboxLayout::of(relation).map_err(WalError::Decode)?);
            self.relid = Some(relation.relid);
        } else if relation.namespace == self.cfg.schema && relation.name == self.stream_table {
            self.stream_layout = Some(OutboxLayout::of_stream(relation).map_err(WalError::Decode)?);
            self.stream_relid = Some(relation.relid);
        } else if self
            .debezium
            .as_ref()
            .is_some_and(|(schema, name)| relation.namespace == *schema && relation.name == *name)
        {
            self.debezium_layout = Some(DebeziumLayout::of(
                relation,
                &self.cfg.debezium,
                self.limits.max_payload_bytes,
            )?);
            self.debezium_relid = Some(relation.relid);
        }
        Ok(())
    }

    /// A row of the Debezium outbox table: like a stream table's row, an event that lives in the
    /// WAL.
    fn on_debezium_insert(&mut self, state: &mut State, values: &Columns, lsn: Lsn) {
        let Some(layout) = &self.debezium_layout else {
            return;
        };
        let committed = state.commit_time.unwrap_or_else(chrono::Utc::now);
        match layout.event(values, i64::try_from(lsn.0).unwrap_or(i64::MAX), committed) {
            Ok(event) => self.push(state, event, Origin::Message, true, None),
            Err(reason) => {
                let table = self.cfg.debezium.quoted();
                self.push_malformed_row(state, lsn, &table, &reason);
            }
        }
    }

    /// A row of the stream table: an event like a logical message. It exists in the WAL (and as
    /// a row nobody updates); what fails is handed to the outbox table as a row of its own.
    fn on_stream_insert(&mut self, state: &mut State, values: &Columns, lsn: Lsn) {
        let Some(layout) = &self.stream_layout else {
            return;
        };
        match layout.event(values, i64::try_from(lsn.0).unwrap_or(i64::MAX)) {
            Ok(Some(event)) => self.push(state, event, Origin::Message, true, None),
            Ok(None) => {}
            Err(BadRow { reason, .. }) => {
                let table = self.table_name(Captured::Stream);
                self.push_malformed_row(state, lsn, &table, &reason);
            }
        }
    }

    /// A row of the outbox table (when the stream serves it): its event, or a dead placeholder
    /// for a row that does not decode.
    fn on_table_insert(&mut self, state: &mut State, values: &Columns, lsn: Lsn) {
        let Some(layout) = &self.layout else {
            return;
        };
        match layout.event(values, 0) {
            Ok(Some(event)) => self.push(state, event, Origin::Table, true, None),
            Ok(None) => {}
            // Dead-lettered like the polling relay does, so one bad row
            // neither stops the stream nor waits for a table claim.
            Err(BadRow {
                seq: Some(seq),
                attempts,
                reason,
            }) => self.push_dead(
                state,
                placeholder(seq, attempts),
                Origin::Table,
                true,
                None,
                pgoutput::malformed_error(seq, &reason),
            ),
            Err(BadRow {
                seq: None, reason, ..
            }) => {
                add(&self.counters.undecodable, 1);
                error!(%lsn, %reason, "Outbox row cannot be decoded and has no readable seq; it stays in the table.");
            }
        }
    }

    /// A logical message: a heartbeat, or (with the prefix) an event in an envelope, checked
    /// against the record limits before it becomes one.
    fn on_message(
        &mut self,
        state: &mut State,
        transactional: bool,
        lsn: Lsn,
        prefix: &str,
        content: &[u8],
    ) {
        if prefix == self.heartbeat_prefix {
            add(&self.counters.heartbeats, 1);
        } else if prefix == self.cfg.message_prefix && !self.messages {
            // Not asked for (the session starts without `messages`); a server that sends one
            // anyway gets it passed over.
            debug!(%lsn, "Passed over a logical message: the message source is off.");
        } else if prefix == self.cfg.message_prefix {
            let standalone_end = (!transactional).then_some(Lsn(lsn.0 + 1));
            let enqueued_at = state.commit_time.unwrap_or_else(chrono::Utc::now);
            match decode_envelope(content) {
                Ok(envelope) => {
                    let event = Event {
                        seq: i64::try_from(lsn.0).unwrap_or(i64::MAX),
                        id: outbox_types::EventId::from_uuid(envelope.id),
                        aggregate_type: envelope.aggregate_type,
                        aggregate_id: envelope.aggregate_id,
                        event_type: envelope.event_type,
                        payload: envelope.payload,
                        destination: envelope.destination,
                        headers: envelope.headers,
                        idempotency_key: envelope.idempotency_key,
                        occurred_at: envelope.occurred_at,
                        enqueued_at,
                        attempts: 0,
                    };
                    match self.limits.check_event(&event) {
                        Ok(()) => {
                            self.push(state, event, Origin::Message, transactional, standalone_end);
                        }
                        Err(over) => {
                            let drop_payload = matches!(over, Oversize::Payload { .. });
                            let (event, note) = storable(event, drop_payload);
                            let error = format!(
                                "the logical message at {lsn} is not delivered: {}{note}",
                                over.for_copy("It existed only in the WAL: nothing else keeps it.")
                            );
                            self.push_dead(
                                state,
                                event,
                                Origin::Message,
                                transactional,
                                standalone_end,
                                error,
                            );
                        }
                    }
                }
                Err(reason) => {
                    let (event, error) =
                        malformed_message(&self.cfg.slot, lsn, content, &reason, enqueued_at);
                    // Its content becomes the dead row's payload unless that is over the limit.
                    let too_large = content.len() as u64 > self.limits.max_payload_bytes;
                    let (event, note) = storable(event, too_large);
                    self.push_dead(
                        state,
                        event,
                        Origin::Message,
                        transactional,
                        standalone_end,
                        format!("{error}{note}"),
                    );
                }
            }
        }
    }
}
