//! Starting the relay: its configuration, the store (connected and checked), the sinks, the
//! metrics endpoint and the retention task, up to the line that says it is relaying.
//!
//! Why its own module: everything here may take a while (a database or broker that answers
//! slowly) and may be interrupted by a stop request; the caller races [`start`] against the
//! shutdown signal, so a relay stopped while starting exits cleanly.

use std::sync::Arc;

use outbox_engine::{Relay, RelayReport};
use outbox_types::route::RouteTable;
use outbox_types::{Sink, Source};
use tokio::task::JoinHandle;

use super::flags;
use super::retention::{Retention, retention_loop};
use super::shutdown::Shutdown;
use crate::RelayArgs;
use crate::config::{self, Config, ConfigError};
use crate::observe;
use crate::sinks;
use crate::store::AnyStore;

/// What the line "Relaying." in the log says: the relay has its store, its sinks and its side
/// tasks, and is about to run.
pub(super) struct Started {
    pub(super) config: Config,
    pub(super) store: AnyStore,
    pub(super) dyn_store: Arc<dyn outbox_types::Store>,
    pub(super) sink: Arc<dyn Sink>,
    pub(super) routes: Arc<RouteTable>,
    /// The outbox's counts when the relay started (see [`super::left_behind`]).
    pub(super) at_start: Option<outbox_types::OutboxStats>,
    pub(super) destinations: observe::DestinationsView,
    /// The retention task, aborted once the engine has stopped.
    pub(super) retention: Option<JoinHandle<()>>,
}

impl Started {
    /// Abort the side tasks that run beside the engine.
    pub(super) fn stop_retention(&mut self) {
        if let Some(task) = self.retention.take() {
            task.abort();
        }
    }

    /// Run the engine over `source` (the outbox table, or WAL mode's stream) to the relay's
    /// sinks and routes until `shutdown`, its destinations shown on the metrics endpoint, then
    /// stop the side tasks: what both modes do, written once.
    pub(super) async fn run_engine<S: Source + ?Sized>(
        &mut self,
        source: Arc<S>,
        shutdown: Shutdown,
    ) -> RelayReport {
        let relay = Relay::new(source, self.sink.clone(), self.config.relay.clone())
            .with_routes(self.routes.clone());
        let _ = self.destinations.set(relay.destinations());
        let report = relay.run(shutdown.finish_batches()).await;
        self.stop_retention();
        report
    }
}

/// Load, connect, check and build everything the relay runs with.
pub(super) async fn start(args: &RelayArgs) -> anyhow::Result<Started> {
    let config = flags::load(args)?;
    let store = AnyStore::open(&config).await?;
    let dyn_store = store.dyn_store();
    dyn_store
        .check()
        .await
        .map_err(|e| ConfigError(format!("{} is not ready: {e}", store.describe())))?;
    let (sink, routes) = sinks::build(&config).await?;
    let at_start = dyn_store.stats().await.ok();
    let destinations = observe::DestinationsView::default();
    if let Some(listen) = config.metrics.listen {
        observe::serve(
            listen,
            observe::HttpLimits::from(&config.metrics),
            config.metrics.refresh,
            dyn_store.clone(),
            sink.clone(),
            routes.clone(),
            destinations.clone(),
        )
        .await?;
    }
    tracing::info!(
        outbox = %store.describe(),
        destinations = %routes.destinations().join(", "),
        "Relaying."
    );
    let retention = spawn_retention(&config, &store, &dyn_store)?;
    Ok(Started {
        config,
        store,
        dyn_store,
        sink,
        routes,
        at_start,
        destinations,
        retention,
    })
}

/// Spawn the retention task when `[retention]` is enabled.
fn spawn_retention(
    config: &Config,
    store: &AnyStore,
    dyn_store: &Arc<dyn outbox_types::Store>,
) -> Result<Option<JoinHandle<()>>, ConfigError> {
    // WAL mode's stream table is purged by age like delivered rows (its rows are never read
    // back, so purging cannot lose an event).
    let stream_table = match (config.mode, store.postgres()) {
        (config::Mode::Wal, Some(pg)) => {
            let wal = config.wal_config()?;
            wal.captures(outbox_wal::Source::StreamTable)
                .then(|| (wal, pg.pool().clone()))
        }
        _ => None,
    };
    Ok(config.retention.enabled.then(|| {
        tokio::spawn(retention_loop(Retention {
            store: dyn_store.clone(),
            partitioned: store.partitioned(),
            stream_table,
            config: config.retention.clone(),
        }))
    }))
}
