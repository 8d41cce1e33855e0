//! A loopback TCP proxy that can be cut and restored: the database or broker "goes away" for the
//! relay while the real server keeps running.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// A proxy from a local port to `upstream`.
pub struct TcpProxy {
    addr: SocketAddr,
    cut: Arc<AtomicBool>,
    generation: watch::Sender<u64>,
    accept: JoinHandle<()>,
}

impl TcpProxy {
    /// Listen on `127.0.0.1:0` and forward every connection to `upstream`.
    pub async fn start(upstream: SocketAddr) -> std::io::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let cut = Arc::new(AtomicBool::new(false));
        let (generation, _) = watch::channel(0u64);
        let accept = {
            let cut = cut.clone();
            let generation = generation.clone();
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
                    tokio::spawn(async move {
                        let Ok(mut server) = TcpStream::connect(upstream).await else {
                            return;
                        };
                        let mut client = client;
                        tokio::select! {
                            _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
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
}

impl Drop for TcpProxy {
    fn drop(&mut self) {
        self.cut();
        self.accept.abort();
    }
}
