//! CPU time of a PostgreSQL server on this machine, for benchmarks that report what the outbox
//! costs the database.
//!
//! Every backend, the walsender and the background workers are children of the postmaster:
//! their time is read from `/proc` while they live, and the time of those that exited is in the
//! postmaster's `cutime`/`cstime` (it reaps them). So the difference of two readings is the
//! whole server's CPU between them, whichever connections came and went.
//!
//! ```no_run
//! # fn demo(data_directory: &str) -> std::io::Result<()> {
//! // data_directory: `SHOW data_directory` (a superuser may read it).
//! let server = outbox_testkit::PostgresCpu::from_data_directory(data_directory)?;
//! let before = server.seconds()?;
//! // … the workload …
//! println!("PostgreSQL CPU: {:.2} s", server.seconds()? - before);
//! # Ok(()) }
//! ```

use std::io;
use std::path::Path;

/// Linux reports process times in clock ticks of 1/100 s (`USER_HZ`).
const TICKS_PER_SECOND: f64 = 100.0;

/// One PostgreSQL server, found by its postmaster's pid.
#[derive(Clone, Copy, Debug)]
pub struct PostgresCpu {
    postmaster: u32,
}

impl PostgresCpu {
    /// The server whose data directory is `dir` (its `postmaster.pid` names the postmaster).
    pub fn from_data_directory(dir: &str) -> io::Result<Self> {
        let pidfile = Path::new(dir).join("postmaster.pid");
        let text = std::fs::read_to_string(&pidfile).map_err(|e| {
            io::Error::new(
                e.kind(),
                format!(
                    "reading {}: {e} (PostgreSQL's CPU is read from /proc: the server must run on this machine and its data directory be readable by this user)",
                    pidfile.display()
                ),
            )
        })?;
        let postmaster = text
            .lines()
            .next()
            .and_then(|l| l.trim().parse().ok())
            .ok_or_else(|| {
                io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("no pid on the first line of {}", pidfile.display()),
                )
            })?;
        Ok(PostgresCpu { postmaster })
    }

    /// CPU seconds the server used since its start, as far as `/proc` tells.
    pub fn seconds(&self) -> io::Result<f64> {
        let (own, reaped, _) = stat(self.postmaster).ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::NotFound,
                format!("/proc/{}/stat: the postmaster is gone", self.postmaster),
            )
        })?;
        let mut ticks = own + reaped;
        for entry in std::fs::read_dir("/proc")?.flatten() {
            let Some(pid) = entry
                .file_name()
                .to_str()
                .and_then(|n| n.parse::<u32>().ok())
            else {
                continue;
            };
            if let Some((own, _, parent)) = stat(pid)
                && parent == self.postmaster
            {
                ticks += own;
            }
        }
        Ok(ticks / TICKS_PER_SECOND)
    }
}

/// `(utime + stime, cutime + cstime, ppid)` of a process, in clock ticks.
fn stat(pid: u32) -> Option<(f64, f64, u32)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let fields: Vec<&str> = text.rsplit_once(')')?.1.split_whitespace().collect();
    let f = |i: usize| fields.get(i).and_then(|v| v.parse::<f64>().ok());
    // After the command name: state(0) ppid(1) … utime(11) stime(12) cutime(13) cstime(14).
    Some((
        f(11)? + f(12)?,
        f(13)? + f(14)?,
        fields.get(1)?.parse().ok()?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_reads_as_its_own_child_free_tree() {
        // This test process stands in for a postmaster: its own time is readable and grows.
        let me = PostgresCpu {
            postmaster: std::process::id(),
        };
        let before = me.seconds().unwrap();
        // Spin until the reading shows 0.1 s more, however busy the machine (a loaded machine
        // gives this thread less than a core); a reading that never grows fails at the deadline.
        let mut x: u64 = 0;
        let started = std::time::Instant::now();
        let mut used = 0.0;
        while used < 0.1 && started.elapsed() < std::time::Duration::from_secs(30) {
            for _ in 0..1_000_000 {
                x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
            }
            used = me.seconds().unwrap() - before;
        }
        std::hint::black_box(x);
        assert!(used >= 0.1, "30 s of spinning read as {used} s");
        assert!(PostgresCpu::from_data_directory("/nonexistent").is_err());
    }
}
