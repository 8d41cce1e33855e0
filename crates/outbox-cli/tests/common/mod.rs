//! What the `outbox` binary's integration tests share: running the binary the way an operator
//! does, and reading what it printed.

#![allow(dead_code)]

use std::process::{Command, Output};

/// The binary under test.
pub const BIN: &str = env!("CARGO_BIN_EXE_outbox");

/// Run `outbox ARGS…` to completion with warnings-only logging.
pub fn outbox(args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .env("OUTBOX_LOG", "warn")
        .output()
        .expect("the outbox binary runs")
}

/// Everything it printed: standard output, then standard error.
pub fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}
