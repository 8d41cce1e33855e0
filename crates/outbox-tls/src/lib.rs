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

/// [`ensure_crypto_provider`], then build a client configuration (no roots, no client
/// certificate): it panics where rustls cannot pick a provider, the failure every handshake
/// would meet. A sink's unit test calls it, so each sink's own feature set is checked.
pub fn check_client_config_builds() {
    ensure_crypto_provider();
    let _ = rustls::ClientConfig::builder()
        .with_root_certificates(rustls::RootCertStore::empty())
        .with_no_client_auth();
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_client_configuration_builds_after_it() {
        super::check_client_config_builds();
    }
}
