//! When the relay stops: SIGTERM or SIGINT.
//!
//! Why its own module: the signal handlers must be installed before anything else the relay
//! does. Until a process installs a handler, SIGTERM's default action kills it by the signal,
//! with nothing logged; a service manager (or the verify harness) that stops a relay while it
//! is still loading its config or connecting would see an unclean death. [`Shutdown::install`]
//! takes over both signals at once, and a signal that arrives before anyone waits is kept, so a
//! stop at any moment is a clean stop.

/// The relay's stop request: SIGTERM or SIGINT, listened for from [`Shutdown::install`] on.
pub(crate) struct Shutdown {
    #[cfg(unix)]
    terminate: Option<tokio::signal::unix::Signal>,
    #[cfg(unix)]
    interrupt: Option<tokio::signal::unix::Signal>,
}

impl Shutdown {
    /// Take over SIGTERM and SIGINT now (inside the runtime). A signal that arrives from here on
    /// is kept until [`Shutdown::signalled`] looks.
    pub(crate) fn install() -> Self {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{SignalKind, signal};
            Shutdown {
                terminate: signal(SignalKind::terminate()).ok(),
                interrupt: signal(SignalKind::interrupt()).ok(),
            }
        }
        #[cfg(not(unix))]
        {
            Shutdown {}
        }
    }

    /// Completes when SIGTERM or SIGINT arrived (at once if one came since [`Shutdown::install`]).
    /// Cancel-safe: a `select!` may drop it and call it again.
    pub(crate) async fn signalled(&mut self) {
        #[cfg(unix)]
        {
            let terminate = async {
                match self.terminate.as_mut() {
                    Some(s) => {
                        s.recv().await;
                    }
                    None => std::future::pending().await,
                }
            };
            let interrupt = async {
                match self.interrupt.as_mut() {
                    Some(s) => {
                        s.recv().await;
                    }
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                () = terminate => {}
                () = interrupt => {}
            }
        }
        #[cfg(not(unix))]
        {
            let _ = tokio::signal::ctrl_c().await;
        }
    }

    /// The future a running relay stops on: the signal, then the line that says it is stopping.
    pub(crate) async fn finish_batches(mut self) {
        self.signalled().await;
        #[cfg(unix)]
        tracing::info!("Shutdown requested: finishing in-flight batches.");
    }
}

/// Completes on SIGINT or SIGTERM (listening from the first poll on), for the long-running
/// commands other than the relay.
pub(crate) async fn shutdown_signal() {
    Shutdown::install().finish_batches().await;
}
