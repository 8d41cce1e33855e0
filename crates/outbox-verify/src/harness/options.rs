//! What a run is asked to do: the profiles and the options they fill in.
//!
//! Why its own module: the options are the harness's public surface (the command line fills
//! them, tests build them); the phases only read them.

use std::path::PathBuf;
use std::time::Duration;

use serde::Serialize;

/// The pre-set shapes of a run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Profile {
    /// About two minutes, a few faults of each kind. Runs in CI.
    Short,
    /// Thirty minutes, thousands of faults. For manual runs.
    Long,
    /// No faults; writers at full speed; backlog and relay memory sampled over time.
    Load,
}

impl Profile {
    /// The profile's name.
    pub fn name(self) -> &'static str {
        match self {
            Profile::Short => "short",
            Profile::Long => "long",
            Profile::Load => "load",
        }
    }
}

/// Everything a run needs.
#[derive(Clone, Debug, Serialize)]
pub struct Options {
    /// The profile the defaults came from.
    pub profile: Profile,
    /// Seed of the fault schedule and the writers' choices.
    pub seed: u64,
    /// The `outbox` binary.
    pub outbox_bin: PathBuf,
    /// Directory for the run's files (cluster, logs, sink file, report).
    pub work_dir: PathBuf,
    /// Use this database instead of a throwaway cluster (no database restarts then).
    pub database_url: Option<String>,
    /// The consumer's database (inbox and effects).
    pub consumer_url: String,
    /// Relay processes.
    pub relays: usize,
    /// Concurrent writers.
    pub writers: u32,
    /// Aggregates per destination the writers spread their events over. Few aggregates make
    /// long per-aggregate sequences (the order check has much to check) and keep every
    /// aggregate's head in flight at once.
    pub aggregates: u32,
    /// Transactions per second per writer (`None`: as fast as possible).
    pub rate: Option<f64>,
    /// How long writers run.
    pub duration: Duration,
    /// Destinations: `file`, `nats`, `webhook`.
    pub destinations: Vec<String>,
    /// Faults of each kind (0: none).
    pub faults_per_kind: u32,
    /// One outage of one destination this long (zero: none); see [`crate::faults::Fault::Outage`].
    pub outage: Duration,
    /// Only these fault kinds (empty: every applicable kind).
    pub only_faults: Vec<String>,
    /// Fraction of transactions rolled back on purpose.
    pub rollback: f64,
    /// Fraction of transactions whose writer kills its own connection.
    pub crash: f64,
    /// Probability that the consumer fails right after committing an effect (redelivery).
    pub consumer_crash: f64,
    /// Longest wait for the outbox to drain after healing.
    pub drain_timeout: Duration,
    /// Sampling interval of the timeline.
    pub sample_every: Duration,
    /// Relay mode: `poll` (claims and leases) or `wal` (logical replication; needs the
    /// harness's own cluster, which runs with `wal_level = logical`).
    pub mode: String,
    /// Relay lease.
    pub lease: Duration,
    /// Relay batch size.
    pub batch_size: u32,
    /// Filler bytes per payload.
    pub pad: usize,
    /// Where the JSON report goes.
    pub report_path: PathBuf,
    /// Environment variables set to each relay's id (e.g.
    /// `OUTBOX_DESTINATIONS__KAFKA__CLIENT_ID`).
    pub per_relay_env: Vec<String>,
}

impl Options {
    /// The defaults of `profile`.
    pub fn for_profile(
        profile: Profile,
        seed: u64,
        outbox_bin: PathBuf,
        work_dir: PathBuf,
    ) -> Self {
        let report_path = work_dir.join("report.json");
        let per_relay_env = std::env::var("OUTBOX_VERIFY_PER_RELAY_ENV")
            .map(|v| {
                v.split(',')
                    .filter(|s| !s.is_empty())
                    .map(str::to_owned)
                    .collect()
            })
            .unwrap_or_default();
        let base = Options {
            profile,
            seed,
            outbox_bin,
            work_dir,
            database_url: None,
            consumer_url: "postgres://postgres@127.0.0.1:5432/test".into(),
            relays: 2,
            writers: 16,
            aggregates: 48,
            rate: Some(12.0),
            duration: Duration::from_secs(75),
            destinations: default_destinations(),
            faults_per_kind: 2,
            outage: Duration::from_secs(30),
            only_faults: Vec::new(),
            rollback: 0.1,
            crash: 0.03,
            consumer_crash: 0.01,
            drain_timeout: Duration::from_secs(90),
            sample_every: Duration::from_secs(1),
            mode: "poll".into(),
            lease: Duration::from_secs(4),
            batch_size: 200,
            pad: 64,
            report_path,
            per_relay_env,
        };
        match profile {
            Profile::Short => base,
            Profile::Long => Options {
                relays: 3,
                duration: Duration::from_secs(30 * 60),
                faults_per_kind: 150,
                outage: Duration::from_secs(5 * 60),
                drain_timeout: Duration::from_secs(300),
                sample_every: Duration::from_secs(5),
                ..base
            },
            Profile::Load => Options {
                rate: None,
                duration: Duration::from_secs(10 * 60),
                faults_per_kind: 0,
                outage: Duration::ZERO,
                rollback: 0.05,
                crash: 0.0,
                consumer_crash: 0.0,
                // The consumers apply one inbox transaction per message (~1.1–1.6k/s on this
                // machine): after 10 minutes at full speed they are ~800k messages behind.
                drain_timeout: Duration::from_secs(30 * 60),
                sample_every: Duration::from_secs(5),
                batch_size: 500,
                // An order-like spread: many aggregates, a few events each per minute. With 48
                // per destination, flat-out writers keep every aggregate's head in flight and a
                // relay sends a batch in sequential waves per aggregate; `--aggregates 48`
                // measures that case (crates/outbox-verify/README.md).
                aggregates: 1024,
                // The harness's Kafka consumer settles one message at a time (~300/s), far below
                // what flat-out writers produce; it would measure the consumer, not the relay.
                destinations: vec!["file".into(), "nats".into(), "webhook".into()],
                ..base
            },
        }
    }
}

/// Every destination compiled in: file and webhook always, NATS JetStream and Kafka with their
/// features (both on by default).
fn default_destinations() -> Vec<String> {
    let mut d = vec!["file".to_owned()];
    if cfg!(feature = "nats") {
        d.push("nats".into());
    }
    d.push("webhook".into());
    if cfg!(feature = "kafka") {
        d.push("kafka".into());
    }
    d
}
