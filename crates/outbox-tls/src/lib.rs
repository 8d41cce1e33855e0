//! # outbox-tls
//!
//! One function, [`ensure_crypto_provider`], for the sinks whose clients speak TLS through
//! rustls (NATS, Redis). It lives in a crate of its own because both need it and neither should
//! depend on the other, while `outbox-types`, which every crate shares, stays free of any TLS
//! dependency.
//!
//! rustls picks its crypto provider from cargo features. These sinks ask for aws-lc-rs, but
//! another crate linked into the same binary may ask for ring (sqlx does, for PostgreSQL); with
//! both enabled rustls refuses to choose and every TLS handshake fails (a panic inside the
//! client's connection task). So a sink installs aws-lc-rs as the process default before it
//! builds a client — only when no default was installed yet, so an application's own choice
//! stands.
//!
//! ```
//! outbox_tls::ensure_crypto_provider();
//! assert!(outbox_tls::rustls::crypto::CryptoProvider::get_default().is_some());
//! ```

/// The rustls these sinks share, for a test that builds a client configuration with it.
pub use rustls;

/// Install aws-lc-rs as the process's default rustls crypto provider, unless one is installed
/// already (see the [crate docs](crate) for why).
pub fn ensure_crypto_provider() {
    if rustls::crypto::CryptoProvider::get_default().is_none() {
        // Losing a race with another installer is fine: a default exists either way.
        let _ = rustls::crypto::aws_lc_rs::default_provider().install_default();
    }
}

#[cfg(test)]
mod tests {
    /// After [`ensure_crypto_provider`](super::ensure_crypto_provider) a client configuration
    /// builds: rustls takes the installed default instead of choosing from its cargo features,
    /// so no feature set of a crate that links this one (aws-lc-rs, ring, or both) can make it
    /// panic, and this one test covers every sink that calls it.
    #[test]
    fn a_client_configuration_builds_after_it() {
        super::ensure_crypto_provider();
        let _ = rustls::ClientConfig::builder()
            .with_root_certificates(rustls::RootCertStore::empty())
            .with_no_client_auth();
    }
}
