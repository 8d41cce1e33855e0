//! The file "broker": every relay appends JSON lines to one shared file (`--sink file`), the
//! consumer tails it.
//!
//! Why it is a fair stand-in for a broker: appends from several processes to one file opened
//! with `O_APPEND` land whole and in a single total order, like a one-partition log; the relay
//! counts a batch delivered only after the write returned, like a broker's ack. It has no
//! network, so link and broker faults do not apply, and its sink rejects nothing a writer can
//! enqueue (any stored JSON renders), so it has no poison payload.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use outbox_inbox::Delivery;
use outbox_types::EventId;
use tokio::io::{AsyncReadExt, AsyncSeekExt};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::{Destination, DestinationHandler, Endpoint};
use crate::Error;

/// A JSON-lines file shared by all relays.
pub struct FileDestination {
    endpoint: Endpoint,
    path: PathBuf,
}

impl FileDestination {
    /// The file at `path` (created empty now, so the consumer can open it before any relay).
    pub fn new(name: &str, path: PathBuf) -> Result<Self, Error> {
        std::fs::write(&path, b"").map_err(Error::io(format!("creating {}", path.display())))?;
        Ok(FileDestination {
            endpoint: Endpoint::local(name, serde_json::json!({"type": "file", "path": path})),
            path,
        })
    }
}

#[async_trait]
impl Destination for FileDestination {
    fn endpoint(&self) -> &Endpoint {
        &self.endpoint
    }

    async fn start_consumer(
        &self,
        handler: Arc<DestinationHandler>,
        mut stop: watch::Receiver<bool>,
    ) -> Result<JoinHandle<()>, Error> {
        let path = self.path.clone();
        let mut file = tokio::fs::File::open(&path)
            .await
            .map_err(Error::io(format!("opening {}", path.display())))?;
        Ok(tokio::spawn(async move {
            let mut offset = 0u64;
            let mut pending: Vec<u8> = Vec::new();
            let mut chunk = vec![0u8; 256 * 1024];
            loop {
                let n = match file.read(&mut chunk).await {
                    Ok(n) => n,
                    Err(error) => {
                        tracing::warn!(%error, "Reading the sink file failed; retrying.");
                        0
                    }
                };
                if n == 0 {
                    if *stop.borrow() {
                        return;
                    }
                    tokio::select! {
                        _ = stop.changed() => {}
                        _ = tokio::time::sleep(Duration::from_millis(20)) => {}
                    }
                    // Re-read from where we are: the file only grows.
                    let _ = file.seek(std::io::SeekFrom::Start(offset)).await;
                    continue;
                }
                offset += n as u64;
                pending.extend_from_slice(&chunk[..n]);
                while let Some(end) = pending.iter().position(|b| *b == b'\n') {
                    let line: Vec<u8> = pending.drain(..=end).collect();
                    deliver(&handler, &line[..line.len() - 1]).await;
                }
            }
        }))
    }
}

/// Hand one line to the handler, retrying in place until it is applied (a failed effect must
/// not be skipped, and retrying in place keeps the file's order).
async fn deliver(handler: &DestinationHandler, line: &[u8]) {
    let value: Option<serde_json::Value> = serde_json::from_slice(line).ok();
    let id = value
        .as_ref()
        .and_then(|v| v.get("id"))
        .and_then(|v| v.as_str())
        .and_then(|s| s.parse::<EventId>().ok());
    let payload = value
        .as_ref()
        .and_then(|v| v.get("payload"))
        .map(|p| p.to_string().into_bytes())
        .unwrap_or_default();
    handler.record(id, &payload);
    let Some(id) = id else {
        return;
    };
    let delivery = Delivery::new(id, payload, handler.name().to_owned());
    let mut attempt = 0u32;
    while let Err(error) = handler.apply(&delivery).await {
        attempt += 1;
        // The injected "crash after commit" comes back as a redelivery, like a broker's: the
        // same line is handed over again and recorded again.
        if attempt > 1000 {
            tracing::warn!(%error, "Giving up on a line after 1000 attempts.");
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        handler.record(Some(id), &delivery.payload);
    }
}
