//! The throwaway servers the repository's scripts start for tests, found or started the same
//! way by every test binary: the `wal_level=logical` PostgreSQL cluster of
//! `scripts/pg-logical.sh`, and the Kafka-protocol broker of `scripts/kafka.sh`.

use std::path::PathBuf;
use std::process::Command;

fn script(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../scripts")
        .join(name)
}

/// The URL of a PostgreSQL with `wal_level = logical`: `OUTBOX_WAL_TEST_URL`, or the cluster
/// `scripts/pg-logical.sh start` starts (idempotently) on port 54329. Panics with the script's
/// output when it cannot start.
pub fn logical_cluster_url() -> String {
    if let Ok(url) = std::env::var("OUTBOX_WAL_TEST_URL") {
        return url;
    }
    let path = script("pg-logical.sh");
    let run = |arg: &str| {
        let out = Command::new("bash")
            .arg(&path)
            .arg(arg)
            .output()
            .unwrap_or_else(|e| panic!("cannot run {}: {e}", path.display()));
        assert!(
            out.status.success(),
            "{} {arg} failed: {}{}",
            path.display(),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    };
    run("start");
    run("url")
}

/// The bootstrap servers of a Kafka-protocol broker: `OUTBOX_TEST_KAFKA_BROKERS`, or the tansu
/// broker `scripts/kafka.sh` starts (idempotently) on 127.0.0.1:19092. `None`, after a loud
/// message, when it cannot start outside CI; under CI (`CI` set) that is a panic, so a suite
/// never passes by skipping.
pub fn kafka_brokers() -> Option<String> {
    if let Ok(brokers) = std::env::var("OUTBOX_TEST_KAFKA_BROKERS") {
        return Some(brokers);
    }
    let path = script("kafka.sh");
    let why = match Command::new("bash").arg(&path).output() {
        Ok(out) if out.status.success() => return Some("127.0.0.1:19092".to_owned()),
        Ok(out) => format!(
            "{} exited with {}: {}",
            path.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr)
        ),
        Err(e) => format!("cannot run {}: {e}", path.display()),
    };
    if std::env::var_os("CI").is_some() {
        panic!("the Kafka test broker could not be started: {why}");
    }
    eprintln!("\n!!! SKIPPING a Kafka test: the test broker could not be started.\n!!! {why}\n");
    None
}
