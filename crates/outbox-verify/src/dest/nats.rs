//! NATS JetStream: a private `nats-server` the harness owns (its own port and store
//! directory), so it can be stopped and started mid-run without losing its stream, with a
//! [`TcpProxy`] between it and the relays.
//!
//! The consumer is the product's own: `outbox_inbox::nats::handle_message` on a durable pull
//! consumer, which acks only after the inbox transaction committed. Messages are read in stream
//! order by one task, so the arrival order the checker sees is the stream's order.
//!
//! Poison: the stream's `max_message_size` is 256 KiB and a poison payload is bigger; the sink
//! must reject it (JetStream refuses it) and the relay bury it.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream;
use async_trait::async_trait;
use futures::StreamExt;
use outbox_inbox::AdapterOptions;
use outbox_testkit::TcpProxy;
use tokio::process::{Child, Command};
use tokio::sync::{Mutex, watch};
use tokio::task::JoinHandle;

use super::{Destination, DestinationHandler, Endpoint};
use crate::Error;

/// The stream the relays publish into.
pub const STREAM: &str = "OUTBOX_T_VERIFY";
/// Its subjects.
pub const SUBJECT_PREFIX: &str = "outbox_t.verify";
/// Largest message the stream takes.
pub const MAX_MESSAGE: usize = 256 * 1024;

/// A private JetStream server.
pub struct NatsDestination {
    endpoint: Endpoint,
    bin: PathBuf,
    store: PathBuf,
    port: u16,
    server: Mutex<Option<Child>>,
}

impl NatsDestination {
    /// Start `nats-server -js` on a free port with its store in `dir`, create the stream, put a
    /// proxy in front.
    pub async fn start(name: &str, dir: PathBuf) -> Result<Self, Error> {
        let bin = std::env::var_os("OUTBOX_VERIFY_NATS_SERVER")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("/usr/sbin/nats-server"));
        if !bin.is_file() {
            return Err(Error::Process(format!(
                "{} not found: install nats-server or set OUTBOX_VERIFY_NATS_SERVER",
                bin.display()
            )));
        }
        std::fs::create_dir_all(&dir).map_err(Error::io("creating the NATS store"))?;
        let port = crate::cluster::free_port()?;
        let upstream: SocketAddr = ([127, 0, 0, 1], port).into();
        let proxy = TcpProxy::start(upstream)
            .await
            .map_err(Error::io("starting the NATS proxy"))?;
        let me = NatsDestination {
            endpoint: Endpoint::proxied(name, proxy, |addr| {
                serde_json::json!({
                    "type": "nats",
                    "servers": [format!("nats://{addr}")],
                    "subject": format!("{SUBJECT_PREFIX}.${{event_type}}"),
                    "connect_timeout": "1s",
                    "ack_timeout": "2s",
                    "max_reconnect_delay": "500ms",
                })
            }),
            bin,
            store: dir,
            port,
            server: Mutex::new(None),
        };
        me.start_broker().await?;
        let js = jetstream::new(me.connect().await?);
        js.get_or_create_stream(jetstream::stream::Config {
            name: STREAM.to_owned(),
            subjects: vec![format!("{SUBJECT_PREFIX}.>")],
            max_message_size: MAX_MESSAGE as i32,
            duplicate_window: Duration::from_secs(120),
            storage: jetstream::stream::StorageType::File,
            ..Default::default()
        })
        .await
        .map_err(|e| Error::Broker(format!("creating stream {STREAM}: {e}")))?;
        Ok(me)
    }

    fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    async fn connect(&self) -> Result<async_nats::Client, Error> {
        async_nats::ConnectOptions::new()
            .retry_on_initial_connect()
            .connect(self.url())
            .await
            .map_err(|e| Error::Broker(format!("connecting to {}: {e}", self.url())))
    }
}

#[async_trait]
impl Destination for NatsDestination {
    fn endpoint(&self) -> &Endpoint {
        &self.endpoint
    }

    fn can_restart(&self) -> bool {
        true
    }

    async fn stop_broker(&self) -> Result<(), Error> {
        if let Some(mut child) = self.server.lock().await.take() {
            // SIGTERM: nats-server flushes its file store and exits.
            if let Some(pid) = child.id() {
                let _ = Command::new("kill")
                    .args(["-TERM", &pid.to_string()])
                    .status()
                    .await;
            }
            if tokio::time::timeout(Duration::from_secs(10), child.wait())
                .await
                .is_err()
            {
                let _ = child.start_kill();
                let _ = child.wait().await;
            }
        }
        Ok(())
    }

    async fn start_broker(&self) -> Result<(), Error> {
        let mut server = self.server.lock().await;
        if server.is_some() {
            return Ok(());
        }
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.store.join("nats-server.log"))
            .map_err(Error::io("opening the NATS log"))?;
        let child = Command::new(&self.bin)
            .args([
                "-a",
                "127.0.0.1",
                "-p",
                &self.port.to_string(),
                "-js",
                "-sd",
            ])
            .arg(&self.store)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .map_err(Error::io("starting nats-server"))?;
        *server = Some(child);
        let deadline = Instant::now() + Duration::from_secs(30);
        while tokio::net::TcpStream::connect(("127.0.0.1", self.port))
            .await
            .is_err()
        {
            if Instant::now() > deadline {
                return Err(Error::Timeout(format!(
                    "nats-server did not listen on {} within 30 s",
                    self.port
                )));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(())
    }

    fn poison(&self, payload: serde_json::Value) -> Option<serde_json::Value> {
        super::oversized(payload, MAX_MESSAGE)
    }

    async fn start_consumer(
        &self,
        handler: Arc<DestinationHandler>,
        mut stop: watch::Receiver<bool>,
    ) -> Result<JoinHandle<()>, Error> {
        let client = self.connect().await?;
        let js = jetstream::new(client);
        let stream = js
            .get_stream(STREAM)
            .await
            .map_err(|e| Error::Broker(format!("stream {STREAM}: {e}")))?;
        let consumer: jetstream::consumer::PullConsumer = stream
            .get_or_create_consumer(
                "verify",
                jetstream::consumer::pull::Config {
                    durable_name: Some("verify".to_owned()),
                    ack_policy: jetstream::consumer::AckPolicy::Explicit,
                    ack_wait: Duration::from_secs(5),
                    max_ack_pending: 100_000,
                    ..Default::default()
                },
            )
            .await
            .map_err(|e| Error::Broker(format!("consumer on {STREAM}: {e}")))?;
        let options = AdapterOptions::default()
            .with_max_attempts(1000)
            .with_retry_delay(Duration::from_millis(200));
        Ok(tokio::spawn(async move {
            // Reopen the message stream whenever it ends (the server restarted).
            while !*stop.borrow() {
                let mut messages = match consumer.messages().await {
                    Ok(m) => m,
                    Err(error) => {
                        tracing::debug!(%error, "JetStream consumer not available yet.");
                        tokio::time::sleep(Duration::from_millis(200)).await;
                        continue;
                    }
                };
                loop {
                    let next = tokio::select! {
                        _ = stop.changed() => None,
                        next = messages.next() => next,
                    };
                    let Some(message) = next else { break };
                    match message {
                        Ok(message) => {
                            if let Err(error) =
                                outbox_inbox::nats::handle_message(&*handler, &message, &options)
                                    .await
                            {
                                tracing::debug!(%error, "JetStream message not settled.");
                            }
                        }
                        Err(error) => {
                            tracing::debug!(%error, "JetStream consumer stream error.");
                            break;
                        }
                    }
                }
            }
        }))
    }

    async fn shutdown(&self) {
        let _ = self.stop_broker().await;
    }
}
