//! Real `outbox relay` processes: started from the `outbox` binary with a config file, killed,
//! paused, resumed and restarted by faults, watched by a small supervisor.
//!
//! Why processes and not tasks: SIGKILL and SIGSTOP are the faults. A task cannot be frozen
//! mid-syscall with its sockets open, nor killed without running destructors; a process can.
//!
//! Each incarnation of relay `i` gets the relay id `verify-r<i>-<n>` (the lease owner column)
//! and its own JSON log file, so a fault can tell from the database what a given relay holds
//! and from its log what it did after it was resumed.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use serde::Serialize;
use tokio::process::{Child, Command};
use tokio::sync::Mutex;

use crate::Error;

/// What the log of a relay says when it gave up writing a batch back (the database did not
/// answer before the lease ran out); logged once per batch, with its lease, after the batch's
/// last write was tried.
pub const GIVEN_UP_MARKER: &str = "Could not record the batch before its lease ran out";

/// What the log of a relay says when a write was fenced (its lease had moved on) or given up.
pub const FENCED_MARKERS: [&str; 2] = ["Lease expired before the write", GIVEN_UP_MARKER];

/// What the log of a relay says when it stopped normally (it finished and wrote back every batch
/// it had started).
pub const STOPPED_MARKER: &str = "Relay stopped.";

/// What the log of a relay says once it has started: its store, sinks and signal handlers are
/// in place (`outbox relay` logs "Relaying." after taking over SIGTERM and SIGINT).
pub const RUNNING_MARKER: &str = "Relaying.";

/// What the log of a relay says when a claim did not get its answer from the database.
pub const CLAIM_FAILED_MARKER: &str = "Claim failed";

/// Where the `outbox` binary is: `--outbox-bin`, else `OUTBOX_BIN`, else next to the running
/// executable (same target directory), else one directory up (tests run from `deps/`).
pub fn locate_outbox_bin(explicit: Option<&Path>) -> Result<PathBuf, Error> {
    if let Some(path) = explicit {
        return if path.is_file() {
            Ok(path.to_path_buf())
        } else {
            Err(Error::Invalid(format!(
                "--outbox-bin {} is not a file",
                path.display()
            )))
        };
    }
    if let Some(path) = std::env::var_os("OUTBOX_BIN").map(PathBuf::from)
        && path.is_file()
    {
        return Ok(path);
    }
    let exe = std::env::current_exe().map_err(Error::io("locating the running executable"))?;
    let mut dir = exe.parent().map(Path::to_path_buf);
    for _ in 0..2 {
        if let Some(d) = &dir {
            let candidate = d.join("outbox");
            if candidate.is_file() {
                return Ok(candidate);
            }
            dir = d.parent().map(Path::to_path_buf);
        }
    }
    Err(Error::Invalid(
        "the `outbox` binary was not found next to outbox-verify: build it with `cargo build -p outbox-cli --bin outbox` (same target directory), or pass --outbox-bin PATH".into(),
    ))
}

/// One relay slot: the process running in it now, if any.
#[derive(Debug)]
pub struct RelaySlot {
    /// 0-based slot number.
    pub index: usize,
    /// How many times a process was started in this slot.
    pub incarnation: u32,
    /// The current process.
    pub child: Option<Child>,
    /// The current relay id.
    pub relay_id: String,
    /// The current log file.
    pub log: PathBuf,
    /// Whether the process is stopped (SIGSTOP).
    pub paused: bool,
    /// Whether a fault is deliberately keeping it down (the supervisor leaves it alone).
    pub held_down: bool,
}

/// An exit nobody asked for: a relay process that ended while it should have been running.
#[derive(Clone, Debug, Serialize)]
pub struct UnexpectedExit {
    /// The relay id.
    pub relay: String,
    /// Exit status.
    pub status: String,
    /// The last lines of its log.
    pub last_log_lines: Vec<String>,
    /// Seconds since the run started.
    pub at_s: f64,
}

/// The set of relays.
pub struct Relays {
    bin: PathBuf,
    config: PathBuf,
    log_dir: PathBuf,
    /// One lock per slot: a fault holds its slot's lock for as long as it acts on the relay, so
    /// two faults never act on one relay at once and the supervisor stays out of the way.
    pub slots: Vec<Mutex<RelaySlot>>,
    /// Exits the supervisor saw.
    pub exits: Mutex<Vec<UnexpectedExit>>,
    /// Environment variables set to the relay id in each process (per-relay settings, e.g. a
    /// Kafka `client_id`).
    pub per_relay_env: Vec<String>,
    started: Instant,
}

impl Relays {
    /// `count` relay slots running `bin relay --config config`, logs in `log_dir`. Nothing is
    /// started yet.
    pub fn new(bin: PathBuf, config: PathBuf, log_dir: PathBuf, count: usize) -> Self {
        let slots = (0..count)
            .map(|index| {
                Mutex::new(RelaySlot {
                    index,
                    incarnation: 0,
                    child: None,
                    relay_id: String::new(),
                    log: PathBuf::new(),
                    paused: false,
                    held_down: false,
                })
            })
            .collect();
        Relays {
            bin,
            config,
            log_dir,
            slots,
            exits: Mutex::new(Vec::new()),
            per_relay_env: Vec::new(),
            started: Instant::now(),
        }
    }

    /// Start a new process in `slot` (which must have none running).
    pub fn spawn(&self, slot: &mut RelaySlot) -> Result<(), Error> {
        slot.incarnation += 1;
        slot.relay_id = format!("verify-r{}-{}", slot.index, slot.incarnation);
        slot.log = self.log_dir.join(format!("{}.log", slot.relay_id));
        let log = std::fs::File::create(&slot.log)
            .map_err(Error::io(format!("creating {}", slot.log.display())))?;
        let mut command = Command::new(&self.bin);
        for name in &self.per_relay_env {
            command.env(name, &slot.relay_id);
        }
        let child = command
            .args(["--log-format", "json", "relay", "--config"])
            .arg(&self.config)
            .env("OUTBOX_RELAY__RELAY_ID", &slot.relay_id)
            // Each Kafka record's partition and offset (debug lines of the Kafka sink), to
            // match against `kafka-read-back.tsv` when a Kafka event goes missing.
            .env("OUTBOX_LOG", "info,outbox_sink_kafka=debug")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .map_err(Error::io(format!("starting {}", self.bin.display())))?;
        slot.child = Some(child);
        slot.paused = false;
        Ok(())
    }

    /// Start every slot.
    pub async fn start_all(&self) -> Result<(), Error> {
        for slot in &self.slots {
            let mut slot = slot.lock().await;
            self.spawn(&mut slot)?;
        }
        Ok(())
    }

    /// Send `signal` (`KILL`, `STOP`, `CONT`, `TERM`) to the slot's process.
    pub async fn signal(slot: &RelaySlot, signal: &str) -> Result<(), Error> {
        let Some(pid) = slot.child.as_ref().and_then(Child::id) else {
            return Ok(());
        };
        let status = Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(pid.to_string())
            .status()
            .await
            .map_err(Error::io("running kill"))?;
        if !status.success() {
            return Err(Error::Process(format!("kill -{signal} {pid} failed")));
        }
        Ok(())
    }

    /// SIGKILL and reap.
    pub async fn kill(slot: &mut RelaySlot) -> Result<(), Error> {
        if let Some(child) = slot.child.as_mut() {
            let _ = child.start_kill();
            let _ = child.wait().await;
        }
        slot.child = None;
        slot.paused = false;
        Ok(())
    }

    /// The slot's process id.
    pub fn pid(slot: &RelaySlot) -> Option<u32> {
        slot.child.as_ref().and_then(Child::id)
    }

    /// Resident set size of the slot's process, in KiB.
    pub fn rss_kib(slot: &RelaySlot) -> Option<u64> {
        let pid = Self::pid(slot)?;
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|n| n.parse().ok())
    }

    /// Restart every slot whose process ended on its own (unless a fault holds it down), and
    /// record the exit. Run every few hundred milliseconds: this is the `Restart=always` of a
    /// service manager.
    pub async fn supervise(&self) {
        for slot in &self.slots {
            let Ok(mut slot) = slot.try_lock() else {
                continue;
            };
            if slot.held_down {
                continue;
            }
            let exited = match slot.child.as_mut() {
                Some(child) => match child.try_wait() {
                    Ok(Some(status)) => Some(status.to_string()),
                    _ => None,
                },
                None => Some("not running".to_owned()),
            };
            if let Some(status) = exited {
                let last = tail_lines(&slot.log, 5);
                self.exits.lock().await.push(UnexpectedExit {
                    relay: slot.relay_id.clone(),
                    status,
                    last_log_lines: last,
                    at_s: self.started.elapsed().as_secs_f64(),
                });
                slot.child = None;
                tokio::time::sleep(Duration::from_millis(300)).await;
                if let Err(error) = self.spawn(&mut slot) {
                    tracing::warn!(%error, "Could not restart a relay.");
                }
            }
        }
    }

    /// SIGCONT anything paused, start anything down.
    pub async fn heal(&self) -> Result<(), Error> {
        for slot in &self.slots {
            let mut slot = slot.lock().await;
            if slot.paused {
                Self::signal(&slot, "CONT").await?;
                slot.paused = false;
            }
            slot.held_down = false;
            let running = match slot.child.as_mut() {
                Some(child) => matches!(child.try_wait(), Ok(None)),
                None => false,
            };
            if !running {
                slot.child = None;
                self.spawn(&mut slot)?;
            }
        }
        Ok(())
    }

    /// SIGTERM every relay and wait (up to `grace`) for it to finish its batches; returns each
    /// relay's exit status (`None`: it had to be killed).
    ///
    /// A relay just (re)started is first given up to `grace` to say it is running: a process
    /// signalled before it has taken over SIGTERM dies by the signal, which says nothing about
    /// the relay's own stop.
    pub async fn stop_all(&self, grace: Duration) -> Vec<(String, Option<String>)> {
        let mut out = Vec::new();
        for slot in &self.slots {
            let mut slot = slot.lock().await;
            if slot.paused {
                let _ = Self::signal(&slot, "CONT").await;
            }
            Self::wait_running(&mut slot, grace).await;
            let _ = Self::signal(&slot, "TERM").await;
        }
        for slot in &self.slots {
            let mut slot = slot.lock().await;
            let id = slot.relay_id.clone();
            let Some(child) = slot.child.as_mut() else {
                continue;
            };
            let status = match tokio::time::timeout(grace, child.wait()).await {
                Ok(Ok(status)) => Some(status.to_string()),
                _ => {
                    let _ = child.start_kill();
                    let _ = child.wait().await;
                    None
                }
            };
            slot.child = None;
            out.push((id, status));
        }
        out
    }

    /// Wait (up to `patience`) until the slot's process has logged [`RUNNING_MARKER`] or ended.
    async fn wait_running(slot: &mut RelaySlot, patience: Duration) {
        let deadline = Instant::now() + patience;
        loop {
            let ended = match slot.child.as_mut() {
                Some(child) => !matches!(child.try_wait(), Ok(None)),
                None => true,
            };
            if ended
                || log_contains_after(&slot.log, 0, &[RUNNING_MARKER])
                || Instant::now() > deadline
            {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Every log file written so far.
    pub fn log_files(&self) -> Vec<PathBuf> {
        let mut files: Vec<PathBuf> = std::fs::read_dir(&self.log_dir)
            .map(|d| {
                d.filter_map(|e| e.ok())
                    .map(|e| e.path())
                    .filter(|p| p.extension().is_some_and(|x| x == "log"))
                    .collect()
            })
            .unwrap_or_default();
        files.sort();
        files
    }
}

/// The last `n` lines of a file.
pub fn tail_lines(path: &Path, n: usize) -> Vec<String> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..]
        .iter()
        .map(|l| l.chars().take(400).collect())
        .collect()
}

/// The file's text from byte `offset` on (empty when it cannot be read).
pub fn log_after(path: &Path, offset: u64) -> String {
    log_split(path, offset).1
}

/// The file's text before byte `offset`, and from it on (both empty when it cannot be read).
pub fn log_split(path: &Path, offset: u64) -> (String, String) {
    let Ok(bytes) = std::fs::read(path) else {
        return (String::new(), String::new());
    };
    let at = usize::try_from(offset)
        .unwrap_or(usize::MAX)
        .min(bytes.len());
    (
        String::from_utf8_lossy(&bytes[..at]).into_owned(),
        String::from_utf8_lossy(&bytes[at..]).into_owned(),
    )
}

/// Whether the file, from byte `offset` on, contains one of `markers`.
pub fn log_contains_after(path: &Path, offset: u64, markers: &[&str]) -> bool {
    let text = log_after(path, offset);
    markers.iter().any(|m| text.contains(m))
}

/// The current length of a file (0 when missing).
pub fn file_len(path: &Path) -> u64 {
    std::fs::metadata(path).map(|m| m.len()).unwrap_or(0)
}
