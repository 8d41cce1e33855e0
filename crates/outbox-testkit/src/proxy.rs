//! A loopback TCP proxy that can be cut and restored: the database or broker "goes away" for the
//! relay while the real server keeps running.
//!
//! Besides cutting, it can degrade a link the way a bad network does, since no toxiproxy is
//! available on the machines we test on: [`TcpProxy::set_latency`] delays every chunk it forwards
//! (in both directions), and [`TcpProxy::set_drop_rate`] resets connections at random while
//! they carry data (TCP does not lose bytes, so "packet loss" a client can observe is a stalled
//! or reset connection). [`TcpProxy::heal`] undoes everything at once.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// Link faults, shared by the accept loop and every connection. Read on every chunk, so a change
/// applies to connections already open.
#[derive(Debug, Default)]
struct Faults {
    /// Delay added before each forwarded chunk, in microseconds.
    latency_us: AtomicU64,
    /// Probability that a chunk resets its connection, in parts per million.
    drop_ppm: AtomicU64,
}

impl Faults {
    fn latency(&self) -> Duration {
        Duration::from_micros(self.latency_us.load(Ordering::Relaxed))
    }

    fn roll_drop(&self) -> bool {
        let ppm = self.drop_ppm.load(Ordering::Relaxed);
        ppm > 0 && rand::random_range(0..1_000_000u64) < ppm
    }
}

/// A proxy from a local port to `upstream`.
pub struct TcpProxy {
    addr: SocketAddr,
    cut: Arc<AtomicBool>,
    generation: watch::Sender<u64>,
    faults: Arc<Faults>,
    accept: JoinHandle<()>,
}

impl TcpProxy {
    /// Listen on `127.0.0.1:0` and forward every connection to `upstream`.
    pub async fn start(upstream: SocketAddr) -> std::io::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let cut = Arc::new(AtomicBool::new(false));
        let faults = Arc::new(Faults::default());
        let (generation, _) = watch::channel(0u64);
        let accept = {
            let cut = cut.clone();
            let generation = generation.clone();
            let faults = faults.clone();
            tokio::spawn(async move {
                loop {
                    let Ok((client, _)) = listener.accept().await else {
                        continue;
                    };
                    if cut.load(Ordering::SeqCst) {
                        drop(client);
                        continue;
                    }
                    let mut cut_signal = generation.subscribe();
                    let faults = faults.clone();
                    tokio::spawn(async move {
                        let Ok(server) = TcpStream::connect(upstream).await else {
                            return;
                        };
                        let _ = client.set_nodelay(true);
                        let _ = server.set_nodelay(true);
                        let (client_read, client_write) = client.into_split();
                        let (server_read, server_write) = server.into_split();
                        let both = async {
                            tokio::try_join!(
                                pipe(client_read, server_write, &faults),
                                pipe(server_read, client_write, &faults),
                            )
                        };
                        // Either side ending with an error (or a drop), or a cut, drops all four
                        // halves, which closes both sockets.
                        tokio::select! {
                            _ = both => {}
                            _ = cut_signal.changed() => {}
                        }
                    });
                }
            })
        };
        Ok(TcpProxy {
            addr,
            cut,
            generation,
            faults,
            accept,
        })
    }

    /// Where clients should connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Drop every open connection and refuse new ones until [`TcpProxy::restore`].
    pub fn cut(&self) {
        self.cut.store(true, Ordering::SeqCst);
        self.generation.send_modify(|g| *g += 1);
    }

    /// Accept connections again.
    pub fn restore(&self) {
        self.cut.store(false, Ordering::SeqCst);
    }

    /// Delay every chunk forwarded in either direction by `latency` (zero: no delay). Applies to
    /// open connections too.
    pub fn set_latency(&self, latency: Duration) {
        let us = u64::try_from(latency.as_micros()).unwrap_or(u64::MAX);
        self.faults.latency_us.store(us, Ordering::Relaxed);
    }

    /// Reset a connection with probability `rate` (0.0–1.0) each time it forwards a chunk.
    /// Applies to open connections too.
    pub fn set_drop_rate(&self, rate: f64) {
        let ppm = (rate.clamp(0.0, 1.0) * 1_000_000.0).round() as u64;
        self.faults.drop_ppm.store(ppm, Ordering::Relaxed);
    }

    /// Back to a clean link: accept connections, no latency, no drops.
    pub fn heal(&self) {
        self.set_latency(Duration::ZERO);
        self.set_drop_rate(0.0);
        self.restore();
    }
}

/// Forward one direction until EOF (then half-close the other side) or an error or drop.
async fn pipe(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    faults: &Faults,
) -> std::io::Result<()> {
    let mut buffer = vec![0u8; 16 * 1024];
    loop {
        let n = from.read(&mut buffer).await?;
        if n == 0 {
            let _ = to.shutdown().await;
            return Ok(());
        }
        if faults.roll_drop() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::ConnectionReset,
                "connection dropped by the proxy",
            ));
        }
        let latency = faults.latency();
        if !latency.is_zero() {
            tokio::time::sleep(latency).await;
        }
        to.write_all(&buffer[..n]).await?;
    }
}

impl Drop for TcpProxy {
    fn drop(&mut self) {
        self.cut();
        self.accept.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn echo_server() -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            loop {
                let (mut socket, _) = listener.accept().await.unwrap();
                tokio::spawn(async move {
                    let (mut r, mut w) = socket.split();
                    let _ = tokio::io::copy(&mut r, &mut w).await;
                });
            }
        });
        addr
    }

    async fn round_trip(addr: SocketAddr) -> std::io::Result<Vec<u8>> {
        let mut s = TcpStream::connect(addr).await?;
        s.write_all(b"ping").await?;
        let mut buf = [0u8; 4];
        s.read_exact(&mut buf).await?;
        Ok(buf.to_vec())
    }

    #[tokio::test]
    async fn forwards_adds_latency_cuts_and_heals() {
        let proxy = TcpProxy::start(echo_server().await).await.unwrap();
        assert_eq!(round_trip(proxy.addr()).await.unwrap(), b"ping");

        proxy.set_latency(Duration::from_millis(100));
        let started = std::time::Instant::now();
        assert_eq!(round_trip(proxy.addr()).await.unwrap(), b"ping");
        assert!(
            started.elapsed() >= Duration::from_millis(200),
            "both directions delayed"
        );

        proxy.set_drop_rate(1.0);
        assert!(round_trip(proxy.addr()).await.is_err(), "every chunk drops");

        proxy.heal();
        proxy.cut();
        assert!(round_trip(proxy.addr()).await.is_err());
        proxy.heal();
        assert_eq!(round_trip(proxy.addr()).await.unwrap(), b"ping");
    }
}
