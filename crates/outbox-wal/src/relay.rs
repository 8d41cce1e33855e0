//! [`WalRelay`]: leadership, the catch-up scan, the streaming session, reconnects.

use std::collections::HashSet;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use std::panic::AssertUnwindSafe;

use futures::FutureExt;
use futures::future::BoxFuture;
use futures::stream::{FuturesUnordered, StreamExt};
use outbox_core::{Event, Outcome, Sink};
use pgwire_replication::{ReplicationClient, ReplicationEvent};
use sqlx::{PgConnection, PgPool};
use tokio::sync::watch;
use tokio::task::JoinSet;
use tracing::{debug, error, info, warn};

use crate::config::{Source, WalConfig};
use crate::conn::{Target, wire_error};
use crate::db;
use crate::engine::{
    Engine, Item, Meta, Origin, Settle, WalCounters, WalReport, WriteBackDone, add,
};
use crate::error::{WalError, map_wire};
use crate::lsn::Lsn;
use crate::message::{HEARTBEAT_SUFFIX, decode_envelope, malformed_message};
use crate::pgoutput::{self, BadRow, Decoded, OutboxLayout, pg_epoch_micros};
use crate::slot;

/// Delivers outbox events from the WAL to a [`Sink`]. See the crate docs.
pub struct WalRelay {
    config: Arc<WalConfig>,
    sink: Arc<dyn Sink>,
    counters: Arc<WalCounters>,
}

/// How a leading session ended without error.
enum End {
    Stopped,
    CaughtUp,
}

type WaveResult = (Vec<Item>, Vec<Settle>);

impl WalRelay {
    /// A relay for `config` delivering to `sink`.
    pub fn new(config: WalConfig, sink: Arc<dyn Sink>) -> Self {
        WalRelay {
            config: Arc::new(config),
            sink,
            counters: Arc::new(WalCounters::default()),
        }
    }

    /// Live counters, readable while [`WalRelay::run`] is going.
    pub fn counters(&self) -> Arc<WalCounters> {
        self.counters.clone()
    }

    /// Run until `shutdown` completes (or, with `stop_when_caught_up`, until everything
    /// committed before the start is delivered), then finish in-flight sink calls, write back
    /// and confirm what was delivered, and return what was done.
    ///
    /// The instance first becomes the slot's streamer (a standby waits here while another
    /// instance streams). Database and replication outages do not end the run: it reconnects
    /// with backoff and resumes from the confirmed position. It returns an error for what needs
    /// a person: bad configuration, a server not set up for logical replication, a lost or
    /// invalidated slot (see [`recover`](crate::recover)).
    pub async fn run<F>(self, shutdown: F) -> Result<WalReport, WalError>
    where
        F: Future<Output = ()> + Send,
    {
        self.config.validate()?;
        let _ = self.counters.started.set(Instant::now());
        let (stop_tx, stop_rx) = watch::channel(false);
        let work = self.run_inner(stop_rx);
        tokio::pin!(work);
        tokio::pin!(shutdown);
        tokio::select! {
            biased;
            result = &mut work => return result,
            _ = &mut shutdown => {}
        }
        let _ = stop_tx.send(true);
        work.await
    }

    async fn run_inner(&self, mut stop: watch::Receiver<bool>) -> Result<WalReport, WalError> {
        let cfg = &self.config;
        let target = Target::parse(&cfg.database_url)?;
        let mut failures = 0u32;
        let pool = loop {
            match target.pool(&cfg.database_url, 4).await {
                Ok(pool) => break pool,
                // TLS or settings that cannot work: retrying would only repeat it.
                Err(e) if !e.is_transient() => {
                    error!(error = %e, "WAL relay cannot start.");
                    return Err(e);
                }
                Err(e) => {
                    failures += 1;
                    let pause = db::backoff(failures, cfg.max_reconnect_backoff);
                    warn!(error = %e, retry_in_ms = pause.as_millis() as u64, "Cannot reach PostgreSQL; retrying.");
                    if sleep_or_stop(pause, &mut stop).await {
                        return Ok(self.counters.report());
                    }
                }
            }
        };
        failures = 0;
        loop {
            let Some(mut lock) = self.wait_for_leadership(&target, &mut stop).await else {
                break;
            };
            add(&self.counters.sessions, 1);
            let result = self.lead(&pool, &mut lock, &target, &mut stop).await;
            drop(lock);
            match result {
                Ok(End::Stopped) | Ok(End::CaughtUp) => break,
                Err(error) if error.is_transient() => {
                    add(&self.counters.errors, 1);
                    failures += 1;
                    let pause = db::backoff(failures, cfg.max_reconnect_backoff);
                    warn!(%error, retry_in_ms = pause.as_millis() as u64, "Streaming session ended; reconnecting. Delivery resumes from the confirmed position.");
                    if sleep_or_stop(pause, &mut stop).await {
                        break;
                    }
                }
                Err(error) => {
                    error!(%error, "WAL relay stopped.");
                    return Err(error);
                }
            }
        }
        let report = self.counters.report();
        info!(
            delivered = report.delivered,
            dead = report.dead,
            duplicates = report.duplicates,
            last_acked_lsn = %report.last_acked_lsn,
            "WAL relay stopped."
        );
        Ok(report)
    }

    /// Become the streamer: hold the slot's advisory lock on a dedicated connection. A standby
    /// polls every `standby_poll_interval`; PostgreSQL releases the lock the moment the holder's
    /// connection ends, also when its process is killed. `None` when asked to stop.
    async fn wait_for_leadership(
        &self,
        target: &Target,
        stop: &mut watch::Receiver<bool>,
    ) -> Option<PgConnection> {
        let cfg = &self.config;
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
                        let pause = db::backoff(failures, cfg.max_reconnect_backoff);
                        warn!(%error, "Cannot reach PostgreSQL for the leadership lock; retrying.");
                        pause
                    }
                },
                Some(c) => match slot::try_lead(c, cfg).await {
                    Ok(true) => {
                        info!(slot = %cfg.slot, relay_id = %cfg.relay_id, "This instance streams the slot now.");
                        return conn;
                    }
                    Ok(false) => {
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

    async fn lead(
        &self,
        pool: &PgPool,
        lock: &mut PgConnection,
        target: &Target,
        stop: &mut watch::Receiver<bool>,
    ) -> Result<End, WalError> {
        let cfg = self.config.clone();
        slot::check_server(pool).await?;
        let heartbeats = self.check_message_access(pool).await?;
        let confirmed = slot::ensure_slot(pool, &cfg).await?;
        let caught_up_target = if cfg.stop_when_caught_up {
            // A commit at or past the target, so an idle outbox gets there too.
            db::heartbeat(pool, &cfg.message_prefix).await?;
            Some(db::current_lsn(pool).await?)
        } else {
            None
        };
        let mut session = Session::new(
            cfg.clone(),
            self.sink.clone(),
            pool.clone(),
            self.counters.clone(),
        );
        session.engine = Engine::new(cfg.clone(), self.counters.clone(), confirmed);
        session.heartbeats = heartbeats;
        if cfg.catch_up && cfg.captures(Source::Table) {
            let high_water = session.catch_up(stop).await?;
            if *stop.borrow() {
                return Ok(End::Stopped);
            }
            session.engine.check_high_water = high_water;
        }
        session.stream(target, lock, stop, caught_up_target).await
    }
}

impl WalRelay {
    /// Refuse to capture messages any role could write; find out whether the relay may write
    /// its heartbeats. Runs at the start of every session (start, reconnect, takeover), so a
    /// grant to PUBLIC made while the relay runs stops it at its next reconnect at the latest.
    /// Returns whether heartbeats are on.
    async fn check_message_access(&self, pool: &PgPool) -> Result<bool, WalError> {
        let cfg = &self.config;
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
        if cfg.stop_when_caught_up {
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
}

/// Sleep `pause`; `true` when asked to stop meanwhile.
async fn sleep_or_stop(pause: Duration, stop: &mut watch::Receiver<bool>) -> bool {
    if *stop.borrow() {
        return true;
    }
    tokio::select! {
        _ = tokio::time::sleep(pause) => *stop.borrow(),
        _ = stop.changed() => true,
    }
}

pub(crate) struct Session {
    cfg: Arc<WalConfig>,
    sink: Arc<dyn Sink>,
    pool: PgPool,
    counters: Arc<WalCounters>,
    engine: Engine,
    /// Sink calls in flight, polled by the session task itself (no task hop per wave).
    waves: FuturesUnordered<BoxFuture<'static, Result<WaveResult, String>>>,
    writeback: JoinSet<(WriteBackDone, Vec<Meta>)>,
    aux: JoinSet<()>,
    /// Write heartbeat messages (off when `heartbeat_interval` is 0 or the role may not).
    heartbeats: bool,
}

impl Session {
    pub(crate) fn new(
        cfg: Arc<WalConfig>,
        sink: Arc<dyn Sink>,
        pool: PgPool,
        counters: Arc<WalCounters>,
    ) -> Self {
        Session {
            engine: Engine::new(cfg.clone(), counters.clone(), Lsn::ZERO),
            cfg,
            sink,
            pool,
            counters,
            waves: FuturesUnordered::new(),
            writeback: JoinSet::new(),
            aux: JoinSet::new(),
            heartbeats: false,
        }
    }

    /// Start sink calls and the write-back as far as the limits allow.
    fn pump(&mut self, publish: bool) {
        if publish {
            while self.waves.len() < self.cfg.max_batches_in_flight {
                match self.engine.next_wave() {
                    Some(wave) => self.spawn_wave(wave),
                    None => break,
                }
            }
        }
        if self.writeback.is_empty()
            && let Some(wb) = self.engine.take_writeback(!publish)
        {
            self.writeback
                .spawn(db::write_back(self.pool.clone(), self.cfg.clone(), wb));
        }
    }

    fn spawn_wave(&mut self, items: Vec<Item>) {
        let sink = self.sink.clone();
        let pool = self.pool.clone();
        let cfg = self.cfg.clone();
        let wave = async move {
            let done: HashSet<i64> = if items.iter().any(|i| i.meta.check) {
                let seqs: Vec<i64> = items
                    .iter()
                    .filter(|i| i.meta.check)
                    .map(|i| i.event.seq)
                    .collect();
                match db::already_done(&pool, &cfg, &seqs).await {
                    Ok(done) => done,
                    Err(error) => {
                        debug!(%error, "Duplicate check failed; publishing anyway.");
                        HashSet::new()
                    }
                }
            } else {
                HashSet::new()
            };
            let mut publish: Vec<Item> = Vec::with_capacity(items.len());
            let mut skipped: Vec<Item> = Vec::new();
            for item in items {
                if item.meta.check && done.contains(&item.event.seq) {
                    skipped.push(item);
                } else {
                    publish.push(item);
                }
            }
            let mut settles: Vec<Settle> = Vec::with_capacity(publish.len() + skipped.len());
            if !publish.is_empty() {
                let events: Vec<Event> = publish.iter().map(|i| i.event.clone()).collect();
                let outcomes = match tokio::time::timeout(
                    cfg.publish_timeout,
                    sink.publish(&events),
                )
                .await
                {
                    Ok(outcomes) if outcomes.len() == events.len() => outcomes,
                    Ok(outcomes) => vec![
                        Outcome::retry(format!(
                            "sink `{}` returned {} outcomes for {} events (a sink bug); retrying all",
                            sink.name(),
                            outcomes.len(),
                            events.len()
                        ));
                        events.len()
                    ],
                    Err(_) => vec![
                        Outcome::retry(format!(
                            "publish to `{}` timed out after {} ms",
                            sink.name(),
                            cfg.publish_timeout.as_millis()
                        ));
                        events.len()
                    ],
                };
                settles.extend(outcomes.into_iter().map(Settle::Sink));
            }
            settles.extend(skipped.iter().map(|_| Settle::Skipped));
            publish.extend(skipped);
            (publish, settles)
        };
        self.waves.push(
            AssertUnwindSafe(wave)
                .catch_unwind()
                .map(|r| r.map_err(|_| "the sink panicked".to_owned()))
                .boxed(),
        );
    }

    fn on_wave(&mut self, joined: Result<WaveResult, String>) -> Result<(), WalError> {
        match joined {
            Ok((items, settles)) => {
                self.engine.on_wave(items, settles);
                Ok(())
            }
            // The sink panicked: its events are unaccounted for, so start over from the
            // confirmed position (nothing was confirmed for them).
            Err(e) => Err(WalError::Replication(format!(
                "a sink call failed ({e}); restarting the session"
            ))),
        }
    }

    fn on_writeback(
        &mut self,
        joined: Result<(WriteBackDone, Vec<Meta>), tokio::task::JoinError>,
    ) -> Result<(), WalError> {
        match joined {
            Ok((done, metas)) => {
                self.engine.on_writeback(done, &metas);
                Ok(())
            }
            Err(e) => Err(WalError::Database(format!("write-back task failed: {e}"))),
        }
    }

    /// Let in-flight sink calls finish and write back their results (bounded), so a stop or a
    /// reconnect neither publishes an event twice at the same moment nor forgets a settled one.
    async fn finish(&mut self) {
        while let Some(joined) = self.waves.next().await {
            if let Ok((items, settles)) = joined {
                self.engine.on_wave(items, settles);
            }
        }
        let deadline = Instant::now() + Duration::from_secs(10) + self.cfg.publish_timeout;
        loop {
            self.pump(false);
            if self.writeback.is_empty() {
                break;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            match tokio::time::timeout(left, self.writeback.join_next()).await {
                Ok(Some(joined)) => {
                    if self.on_writeback(joined).is_err() {
                        break;
                    }
                }
                Ok(None) => break,
                Err(_) => {
                    warn!(
                        "Write-back did not finish before the stop deadline; those events will be delivered again."
                    );
                    self.writeback.abort_all();
                    break;
                }
            }
        }
        self.aux.abort_all();
    }

    /// Deliver rows still undelivered in the table, up to the highest seq there now: rows the
    /// polling relay left, requeued dead rows, rows committed before the slot existed. Returns
    /// that highest seq: streamed table rows up to it are checked against the table before they
    /// are published, so the catch-up does not cause duplicates.
    pub(crate) async fn catch_up(
        &mut self,
        stop: &mut watch::Receiver<bool>,
    ) -> Result<i64, WalError> {
        let high_water = db::max_seq(&self.pool, &self.cfg).await?;
        let page = (self.cfg.max_batch * 2).max(100) as i64;
        let mut after = 0i64;
        let mut exhausted = false;
        let started = Instant::now();
        loop {
            if !exhausted && self.engine.has_room() {
                let fetched =
                    db::undelivered(&self.pool, &self.cfg, after, high_water, page).await?;
                exhausted = !fetched.more;
                for row in fetched.rows {
                    match row {
                        Ok(event) => {
                            after = event.seq;
                            self.engine.push(event, Origin::Table, false, None);
                        }
                        // One bad row is dead-lettered; it never fails the page.
                        Err(bad) => {
                            after = bad.seq;
                            let error = bad.error(self.cfg.max_payload_bytes);
                            self.engine.push_dead(
                                pgoutput::placeholder(bad.seq, bad.attempts),
                                Origin::Table,
                                false,
                                None,
                                error,
                            );
                        }
                    }
                }
            }
            self.pump(!*stop.borrow());
            if *stop.borrow() || (exhausted && self.engine.is_idle() && self.waves.is_empty()) {
                self.finish().await;
                break;
            }
            let more = !exhausted && self.engine.has_room();
            let timer = self.engine.next_timer();
            let wb_due = self
                .engine
                .writeback_due()
                .filter(|_| self.writeback.is_empty());
            tokio::select! {
                biased;
                _ = stop.changed() => {}
                Some(joined) = self.waves.next(), if !self.waves.is_empty() => self.on_wave(joined)?,
                Some(joined) = self.writeback.join_next(), if !self.writeback.is_empty() => self.on_writeback(joined)?,
                _ = sleep_until(timer), if timer.is_some() => self.engine.fire_timers(Instant::now()),
                _ = sleep_until(wb_due), if wb_due.is_some() => {}
                _ = std::future::ready(()), if more => {}
            }
        }
        let caught = self
            .counters
            .caught_up
            .load(std::sync::atomic::Ordering::Relaxed);
        info!(
            high_water,
            delivered_so_far = caught,
            elapsed_ms = started.elapsed().as_millis() as u64,
            "Catch-up scan of the outbox table done."
        );
        Ok(high_water)
    }

    async fn start_client(
        &mut self,
        target: &Target,
        stop: &watch::Receiver<bool>,
    ) -> Result<ReplicationClient, WalError> {
        let cfg = &self.cfg;
        let deadline = Instant::now() + cfg.takeover_timeout;
        let started = Instant::now();
        loop {
            // Read the slot's position each time: a predecessor may still be confirming.
            let confirmed = match slot::slot_info(&self.pool, &cfg.slot).await? {
                Some(info) => info.confirmed_flush.unwrap_or(Lsn::ZERO),
                None => {
                    return Err(WalError::SlotLost {
                        slot: cfg.slot.clone(),
                        detail: "it disappeared before streaming started".into(),
                    });
                }
            };
            let mut client = ReplicationClient::connect(target.replication(cfg, confirmed))
                .await
                .map_err(|e| wire_error(e, &target.tls))?;
            match client.wait_started().await {
                Ok(()) => {
                    info!(slot = %cfg.slot, %confirmed, "Streaming from the slot.");
                    return Ok(client);
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

    async fn stream(
        &mut self,
        target: &Target,
        lock: &mut PgConnection,
        stop: &mut watch::Receiver<bool>,
        caught_up_target: Option<Lsn>,
    ) -> Result<End, WalError> {
        let mut client = self.start_client(target, stop).await?;
        let result = self
            .stream_loop(&mut client, lock, stop, caught_up_target)
            .await;
        // Whatever ended the loop: finish what is in flight, confirm what settled.
        self.finish().await;
        let ack = self.engine.ack();
        self.confirm(&client, ack);
        if result.is_ok() {
            // Make sure the final position reached the server before closing.
            let deadline = Instant::now() + self.cfg.status_interval * 2 + Duration::from_secs(1);
            while Lsn::from(client.metrics().last_applied_lsn()) < ack && Instant::now() < deadline
            {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            let _ = tokio::time::timeout(Duration::from_secs(5), client.shutdown()).await;
        } else {
            client.abort();
        }
        result
    }

    fn confirm(&self, client: &ReplicationClient, ack: Lsn) {
        let previous = self
            .counters
            .last_acked_lsn
            .load(std::sync::atomic::Ordering::Relaxed);
        if ack.0 > previous && !ack.is_zero() {
            client.update_applied_lsn(ack.into());
            self.counters
                .last_acked_lsn
                .fetch_max(ack.0, std::sync::atomic::Ordering::Relaxed);
        }
    }

    async fn stream_loop(
        &mut self,
        client: &mut ReplicationClient,
        lock: &mut PgConnection,
        stop: &mut watch::Receiver<bool>,
        caught_up_target: Option<Lsn>,
    ) -> Result<End, WalError> {
        let cfg = self.cfg.clone();
        let mut decoder = Decoder::new(cfg.clone(), self.counters.clone());
        let heartbeats = self.heartbeats;
        let mut heartbeat = tokio::time::interval(if heartbeats {
            cfg.heartbeat_interval
        } else {
            Duration::from_secs(3600)
        });
        heartbeat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        heartbeat.tick().await;
        let mut lock_check = tokio::time::interval(Duration::from_secs(2));
        lock_check.tick().await;
        // Raising the applied position wakes the replication worker; at a trickle of events
        // that is one wakeup per event for nothing (it reports at most every status_interval).
        let confirm_every = (cfg.status_interval / 4).max(Duration::from_millis(10));
        let mut last_confirm = Instant::now();
        loop {
            self.pump(true);
            let ack = self.engine.ack();
            let confirmed = Lsn(self
                .counters
                .last_acked_lsn
                .load(std::sync::atomic::Ordering::Relaxed));
            let confirm_at = (ack > confirmed).then(|| last_confirm + confirm_every);
            if confirm_at.is_some_and(|at| Instant::now() >= at) {
                self.confirm(client, ack);
                last_confirm = Instant::now();
            }
            if let Some(target) = caught_up_target
                && ack >= target
                && self.engine.is_idle()
                && self.waves.is_empty()
            {
                info!(%ack, "Caught up with the WAL position at start; stopping.");
                return Ok(End::CaughtUp);
            }
            let timer = self.engine.next_timer();
            let wb_due = self
                .engine
                .writeback_due()
                .filter(|_| self.writeback.is_empty());
            let room = self.engine.has_room();
            tokio::select! {
                biased;
                _ = stop.changed() => return Ok(End::Stopped),
                Some(joined) = self.waves.next(), if !self.waves.is_empty() => self.on_wave(joined)?,
                Some(joined) = self.writeback.join_next(), if !self.writeback.is_empty() => self.on_writeback(joined)?,
                _ = sleep_until(timer), if timer.is_some() => self.engine.fire_timers(Instant::now()),
                _ = sleep_until(wb_due), if wb_due.is_some() => {}
                _ = sleep_until(confirm_at), if confirm_at.is_some() => {}
                received = client.recv(), if room => {
                    let mut next = Some(received);
                    let mut budget = 1024;
                    while let Some(received) = next.take() {
                        match received {
                            Ok(Some(event)) => decoder.handle(event, &mut self.engine)?,
                            Ok(None) => return Err(WalError::Replication("the replication stream ended".into())),
                            Err(e) => return Err(with_slot(map_wire(e), &cfg.slot)),
                        }
                        budget -= 1;
                        if budget > 0 && self.engine.has_room() {
                            next = client.recv().now_or_never();
                        }
                    }
                }
                _ = heartbeat.tick(), if heartbeats => {
                    let pool = self.pool.clone();
                    let prefix = cfg.message_prefix.clone();
                    while self.aux.try_join_next().is_some() {}
                    self.aux.spawn(async move {
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

/// Turns replication events into engine calls.
struct Decoder {
    cfg: Arc<WalConfig>,
    counters: Arc<WalCounters>,
    relid: Option<u32>,
    layout: Option<OutboxLayout>,
    heartbeat_prefix: String,
    tables: bool,
    messages: bool,
    ignored: metrics::Counter,
    /// When the last warning about ignored messages was logged, and how many came since.
    ignored_warned: Option<Instant>,
    ignored_since_warning: u64,
}

/// At most one warning about ignored messages per this long.
const IGNORED_WARNING_EVERY: Duration = Duration::from_secs(60);

impl Decoder {
    fn new(cfg: Arc<WalConfig>, counters: Arc<WalCounters>) -> Self {
        Decoder {
            heartbeat_prefix: format!("{}{HEARTBEAT_SUFFIX}", cfg.message_prefix),
            tables: cfg.captures(Source::Table),
            messages: cfg.captures(Source::Messages),
            cfg,
            counters,
            relid: None,
            layout: None,
            ignored: metrics::counter!("outbox_wal_messages_ignored_total"),
            ignored_warned: None,
            ignored_since_warning: 0,
        }
    }

    /// A message with the outbox prefix while the message source is off: never delivered.
    /// Nothing of it is held, so the confirmed position moves past it like past any other
    /// transaction; holding it would let whoever can write such messages hold the slot and
    /// with it the server's WAL.
    fn ignore_message(&mut self, lsn: Lsn) {
        add(&self.counters.messages_ignored, 1);
        self.ignored.increment(1);
        self.ignored_since_warning += 1;
        let now = Instant::now();
        if self
            .ignored_warned
            .is_some_and(|at| now.duration_since(at) < IGNORED_WARNING_EVERY)
        {
            return;
        }
        warn!(
            %lsn,
            prefix = %self.cfg.message_prefix,
            ignored = self.ignored_since_warning,
            "Ignored a logical message with the outbox prefix: the message source is off (`[wal] sources` defaults to [\"table\"]). If your writers use enqueue_message, revoke EXECUTE on pg_logical_emit_message from PUBLIC, grant it to the writers and the relay (`outbox wal status` prints the statements), then add \"messages\" to `sources`. Messages written meanwhile are not delivered."
        );
        self.ignored_warned = Some(now);
        self.ignored_since_warning = 0;
    }

    fn handle(&mut self, event: ReplicationEvent, engine: &mut Engine) -> Result<(), WalError> {
        match event {
            ReplicationEvent::Begin {
                commit_time_micros, ..
            } => engine.begin(pg_epoch_micros(commit_time_micros)),
            ReplicationEvent::Commit { end_lsn, .. } => engine.commit(end_lsn.into()),
            ReplicationEvent::KeepAlive { wal_end, .. } => engine.keepalive(wal_end.into()),
            ReplicationEvent::XLogData {
                data, wal_start, ..
            } => match pgoutput::decode(&data).map_err(WalError::Decode)? {
                Decoded::Relation(relation) => {
                    if relation.namespace == self.cfg.schema && relation.name == self.cfg.table {
                        self.layout = Some(OutboxLayout::of(&relation).map_err(WalError::Decode)?);
                        self.relid = Some(relation.relid);
                    }
                }
                Decoded::Insert { relid, values } => {
                    if self.tables
                        && Some(relid) == self.relid
                        && let Some(layout) = &self.layout
                    {
                        match layout.event(&values) {
                            Ok(Some(event)) => engine.push(event, Origin::Table, true, None),
                            Ok(None) => {}
                            // Dead-lettered like the polling relay does, so one bad row
                            // neither stops the stream nor waits for the next catch-up scan.
                            Err(BadRow {
                                seq: Some(seq),
                                attempts,
                                reason,
                            }) => engine.push_dead(
                                pgoutput::placeholder(seq, attempts),
                                Origin::Table,
                                true,
                                None,
                                pgoutput::malformed_error(seq, &reason),
                            ),
                            Err(BadRow {
                                seq: None, reason, ..
                            }) => {
                                add(&self.counters.undecodable, 1);
                                error!(lsn = %Lsn::from(wal_start), %reason, "Outbox row cannot be decoded and has no readable seq; it stays in the table.");
                            }
                        }
                    }
                }
                Decoded::Other => {}
            },
            ReplicationEvent::Message {
                transactional,
                lsn,
                prefix,
                content,
            } => {
                if prefix == self.heartbeat_prefix {
                    add(&self.counters.heartbeats, 1);
                } else if prefix == self.cfg.message_prefix && !self.messages {
                    self.ignore_message(Lsn::from(lsn));
                } else if prefix == self.cfg.message_prefix {
                    let lsn = Lsn::from(lsn);
                    let standalone_end = (!transactional).then_some(Lsn(lsn.0 + 1));
                    match decode_envelope(&content) {
                        Ok(envelope) => {
                            let event = Event {
                                seq: i64::try_from(lsn.0).unwrap_or(i64::MAX),
                                id: outbox_core::EventId::from_uuid(envelope.id),
                                aggregate_type: envelope.aggregate_type,
                                aggregate_id: envelope.aggregate_id,
                                event_type: envelope.event_type,
                                payload: envelope.payload,
                                destination: envelope.destination,
                                headers: envelope.headers,
                                idempotency_key: envelope.idempotency_key,
                                occurred_at: envelope.occurred_at,
                                enqueued_at: engine.commit_time().unwrap_or_else(chrono::Utc::now),
                                attempts: 0,
                            };
                            engine.push(event, Origin::Message, transactional, standalone_end);
                        }
                        Err(reason) => {
                            let (event, error) = malformed_message(
                                &self.cfg.slot,
                                lsn,
                                &content,
                                &reason,
                                engine.commit_time().unwrap_or_else(chrono::Utc::now),
                            );
                            engine.push_dead(
                                event,
                                Origin::Message,
                                transactional,
                                standalone_end,
                                error,
                            );
                        }
                    }
                }
            }
            ReplicationEvent::StoppedAt { .. } => {}
        }
        Ok(())
    }
}
