//! An upper bound of a WAL-mode relay's memory, from its settings ([`memory_bound`]); the crate
//! docs ("Memory") derive it term by term.

use outbox_engine::RelayConfig;
use serde::Serialize;

use crate::config::{Source, WalConfig};
use crate::limits::Limits;

/// What a WAL-mode relay may hold at most, by part, in bytes. [`MemoryBound::total`] is the
/// bound.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct MemoryBound {
    /// The relay with nothing to deliver (`outbox_engine::memory::BASE_BYTES`).
    pub base: u64,
    /// Reading the WAL: the record being read (at most the wire bound `W`: both record limits,
    /// doubled with the message source on, plus 64 KiB of framing), the replication client's
    /// channel (at most its byte bound, 1–8 MiB, or one record of `W` when that is larger), and
    /// the record being decoded with the event it becomes (`2 W`), plus 1 MiB of socket, TLS
    /// and read-past buffers.
    pub replication: u64,
    /// Events decoded and not yet settled (waiting, out in a batch, waiting for their write):
    /// `max_buffered_bytes` and the one event read past it, twice (an event of a message or
    /// an insert-only table keeps a copy to hand to the outbox table if it fails).
    pub stream: u64,
    /// Batches being published, as in polling mode (`outbox_engine::memory::publishing_bytes`):
    /// table claims, and the sink's copies of the stream's events.
    pub publishing: u64,
}

impl MemoryBound {
    /// The bound: the sum of the parts.
    pub fn total(&self) -> u64 {
        self.base
            .saturating_add(self.replication)
            .saturating_add(self.stream)
            .saturating_add(self.publishing)
    }
}

/// An upper bound of the memory of a WAL-mode relay with the engine settings `relay`, the WAL
/// settings `wal` and `destinations` destinations. With every default and one destination:
/// 64 MiB base + 65.5 MiB replication + 96.1 MiB stream + 288.4 MiB publishing = 514.0 MiB
/// (578.3 MiB with the message source on).
///
/// ```
/// use outbox_wal::{WalConfig, memory_bound};
/// let bound = memory_bound(&outbox_engine::RelayConfig::default(), &WalConfig::default(), 1);
/// assert!(bound.total() < 640 * 1024 * 1024, "{bound:?}");
/// ```
pub fn memory_bound(relay: &RelayConfig, wal: &WalConfig, destinations: usize) -> MemoryBound {
    const MIB: u64 = 1024 * 1024;
    let limits = Limits {
        max_payload_bytes: relay.max_payload_bytes,
        max_metadata_bytes: relay.max_metadata_bytes,
        messages: wal.captures(Source::Messages),
    };
    let wire = limits.wire();
    let channel = crate::conn::channel_bytes(wal) as u64;
    let event = relay
        .max_payload_bytes
        .saturating_add(relay.max_metadata_bytes);
    MemoryBound {
        base: outbox_engine::memory::BASE_BYTES,
        replication: wire
            .saturating_mul(3)
            .saturating_add(wire.max(channel))
            .saturating_add(MIB),
        stream: (wal.max_buffered_bytes as u64)
            .saturating_add(event)
            .saturating_mul(2),
        publishing: outbox_engine::memory::publishing_bytes(relay, destinations),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_defaults_give_the_documented_figures() {
        let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
        let relay = RelayConfig::default();
        let table = memory_bound(&relay, &WalConfig::default(), 1);
        assert_eq!(mib(table.base), 64.0);
        assert!((mib(table.replication) - 65.5).abs() < 0.05, "{table:?}");
        assert!((mib(table.stream) - 96.125).abs() < 0.05, "{table:?}");
        assert!((mib(table.publishing) - 288.375).abs() < 0.05, "{table:?}");
        assert!((mib(table.total()) - 514.0).abs() < 0.1, "{table:?}");
        let messages = WalConfig {
            sources: vec![Source::Table, Source::Messages],
            ..WalConfig::default()
        };
        let with_messages = memory_bound(&relay, &messages, 1);
        assert!(
            (mib(with_messages.total()) - 578.3).abs() < 0.1,
            "{with_messages:?}"
        );
    }
}
