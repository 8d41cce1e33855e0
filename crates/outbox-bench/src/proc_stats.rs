//! CPU time and peak memory of processes, read from `/proc`.

use super::*;

/// CPU time of this process's threads so far: nanoseconds on the CPU per thread id, from
/// `/proc/self/task/*/schedstat`; empty where the kernel does not provide it.
pub(crate) fn cpu_snapshot() -> std::collections::HashMap<String, u64> {
    let mut threads = std::collections::HashMap::new();
    if let Ok(tasks) = std::fs::read_dir("/proc/self/task") {
        for task in tasks.flatten() {
            let Ok(text) = std::fs::read_to_string(task.path().join("schedstat")) else {
                continue;
            };
            if let Some(Ok(nanos)) = text.split_whitespace().next().map(str::parse::<u64>) {
                threads.insert(task.file_name().to_string_lossy().into_owned(), nanos);
            }
        }
    }
    threads
}

/// CPU seconds this process used since `before` (a [`cpu_snapshot`]) and `before_ticks` (a
/// [`cpu_ticks_seconds`]): per-thread nanoseconds where available (threads that exited in
/// between are lost, so call it while the relay and its sink are alive), else user + system
/// time in clock ticks of 1/100 s, too coarse for short runs.
pub(crate) fn cpu_seconds_since(
    before: &std::collections::HashMap<String, u64>,
    before_ticks: f64,
) -> anyhow::Result<f64> {
    let now = cpu_snapshot();
    if before.is_empty() || now.is_empty() {
        return Ok(cpu_ticks_seconds()? - before_ticks);
    }
    let nanos: u64 = now
        .iter()
        .map(|(tid, n)| n.saturating_sub(before.get(tid).copied().unwrap_or(0)))
        .sum();
    Ok(nanos as f64 / 1e9)
}

/// User + system CPU time of this process, from /proc (clock ticks of 1/100 s).
pub(crate) fn cpu_ticks_seconds() -> anyhow::Result<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat")?;
    let after_comm = stat.rsplit_once(')').map(|(_, rest)| rest).unwrap_or("");
    let fields: Vec<&str> = after_comm.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the full line: 12 and 13 after the comm.
    let utime: f64 = fields.get(11).context("utime")?.parse()?;
    let stime: f64 = fields.get(12).context("stime")?.parse()?;
    Ok((utime + stime) / 100.0)
}

pub(crate) fn peak_rss_kb() -> anyhow::Result<u64> {
    status_kb("self", "VmHWM").context("VmHWM in /proc/self/status")
}

/// A `kB` field (`VmRSS`, `VmHWM`, …) of `/proc/<pid>/status`.
pub(crate) fn status_kb(pid: &str, field: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}
