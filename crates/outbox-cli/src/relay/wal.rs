//! The relay over PostgreSQL's replication stream (`mode = "wal"`).
//!
//! Why its own module: WAL mode starts a [`outbox_wal::WalSource`] (streaming, or standing by
//! while another relay streams the slot), runs the same engine over it, and shuts the source
//! down after the engine, reporting what the stream did.

use std::sync::Arc;

use super::left_behind::report_exit;
use super::shutdown::Shutdown;
use super::start::Started;
use crate::config::ConfigError;
use crate::observe;
use crate::wal_error;

/// One engine, two sources: the replication stream and the table, behind one Source.
pub(super) async fn run(mut started: Started, shutdown: Shutdown) -> anyhow::Result<()> {
    let config = &started.config;
    let wal = config.wal_config()?;
    let Some(pg) = started.store.postgres() else {
        return Err(ConfigError("`mode = \"wal\"` needs a PostgreSQL database".into()).into());
    };
    if config.metrics.listen.is_some() {
        tokio::spawn(observe::refresh_wal_gauges(
            wal.clone(),
            config.metrics.refresh,
        ));
    }
    tracing::info!(slot = %wal.slot, "WAL mode: streaming from the replication slot.");
    let source = Arc::new(
        outbox_wal::WalSource::start(wal, pg.clone(), &config.relay)
            .await
            .map_err(wal_error)?,
    );
    let report = started.run_engine(source.clone(), shutdown).await;
    let wal_report = source.shutdown().await.map_err(wal_error)?;
    report_exit!(
        started,
        report,
        from_table = wal_report.from_table,
        duplicates = wal_report.duplicates,
        last_acked_lsn = %wal_report.last_acked_lsn,
        "WAL relay exited."
    );
    Ok(())
}
