//! An upper bound of the relay's memory, from its settings: what `deploy/kubernetes/relay.yaml`
//! sizes its limit by, and what WAL mode adds to (`outbox_wal::memory_bound`).
//!
//! What the relay holds beyond a fixed base is the events of the batches it publishes. A claim
//! (from the table or from the WAL stream) adds events while the whole events before them
//! (payload and every other column) add up to less than `max_batch_bytes`, and no event is
//! larger than `max_payload_bytes + max_metadata_bytes`, so one batch holds at most
//! [`batch_bytes`]. While a batch is published
//! the relay holds it about [`SINK_COPIES`] times over (the stored event, the message the sink
//! builds, the sink client's buffers; measured: one 50 MB event to the file sink peaked at
//! 292 MB RSS). At most `max_batches_in_flight` batches are alive, four times as many with
//! several destinations (a batch left waiting on a slow call gives its slot back early).

use crate::RelayConfig;

/// The relay with nothing to deliver: the binary, the runtime, the connection pools, TLS
/// sessions, the metrics registry. Measured 10–25 MB idle and 25–58 MB under load with small
/// events (`outbox relay`, release build, polling and WAL mode); rounded up.
pub const BASE_BYTES: u64 = 64 * 1024 * 1024;

/// How many times over a batch being published is held (see the module docs).
pub const SINK_COPIES: u64 = 6;

/// How many batches may be alive per slot of `max_batches_in_flight` with several
/// destinations (`MAX_ALIVE_PER_SLOT` of the engine).
const ALIVE_PER_SLOT: u64 = 4;

/// The most one batch holds: events up to `max_batch_bytes`, and the one that crosses it, of at
/// most `max_payload_bytes + max_metadata_bytes`.
pub fn batch_bytes(config: &RelayConfig) -> u64 {
    config
        .max_batch_bytes
        .saturating_add(config.max_payload_bytes)
        .saturating_add(config.max_metadata_bytes)
}

/// What the batches being published hold at most, with `destinations` destinations.
pub fn publishing_bytes(config: &RelayConfig, destinations: usize) -> u64 {
    let slots = config.max_batches_in_flight.max(1) as u64;
    let alive = if destinations > 1 {
        slots * ALIVE_PER_SLOT
    } else {
        slots
    };
    SINK_COPIES
        .saturating_mul(batch_bytes(config))
        .saturating_mul(alive)
}

/// An upper bound of a polling relay's memory, in bytes: [`BASE_BYTES`] and
/// [`publishing_bytes`]. With the defaults and one destination: 64 MiB + 6 × (32 MiB + 16 MiB
/// + 64 KiB) = 352.4 MiB.
///
/// ```
/// let bound = outbox_engine::memory::bound(&outbox_engine::RelayConfig::default(), 1);
/// assert_eq!(bound, (64 + 6 * (32 + 16)) * 1024 * 1024 + 6 * 64 * 1024);
/// ```
pub fn bound(config: &RelayConfig, destinations: usize) -> u64 {
    BASE_BYTES.saturating_add(publishing_bytes(config, destinations))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bound_grows_with_each_setting() {
        let base = RelayConfig::default();
        let one = bound(&base, 1);
        assert_eq!(bound(&base, 3), BASE_BYTES + 4 * (one - BASE_BYTES));
        let larger = RelayConfig {
            max_payload_bytes: 100 * 1024 * 1024,
            ..base.clone()
        };
        assert_eq!(
            bound(&larger, 1) - one,
            SINK_COPIES * (100 - 16) * 1024 * 1024
        );
        let pipelined = RelayConfig {
            max_batches_in_flight: 2,
            ..base
        };
        assert_eq!(bound(&pipelined, 1) - BASE_BYTES, 2 * (one - BASE_BYTES));
    }
}
