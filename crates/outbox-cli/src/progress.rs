//! Progress of long admin commands (replay, cleanup of millions of rows): a live bar on a
//! terminal, a plain line every few seconds otherwise (logs, CI), nothing with `--json`.

use std::io::IsTerminal;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};

/// Reports a running count of `what` (e.g. "events replayed").
pub struct Progress {
    what: &'static str,
    bar: Option<ProgressBar>,
    plain: bool,
    last_line: Instant,
    count: u64,
}

impl Progress {
    /// A reporter; `quiet` (JSON output) shows nothing.
    pub fn new(what: &'static str, quiet: bool) -> Self {
        let terminal = !quiet && std::io::stderr().is_terminal();
        let bar = terminal.then(|| {
            let bar = ProgressBar::new_spinner();
            bar.set_style(
                ProgressStyle::with_template("{spinner} {pos} {msg} ({per_sec}, {elapsed})")
                    .unwrap_or_else(|_| ProgressStyle::default_spinner()),
            );
            bar.set_message(what);
            bar.enable_steady_tick(Duration::from_millis(200));
            bar
        });
        Progress {
            what,
            bar,
            plain: !quiet && !terminal,
            last_line: Instant::now(),
            count: 0,
        }
    }

    /// `n` more done.
    pub fn add(&mut self, n: u64) {
        self.count += n;
        if let Some(bar) = &self.bar {
            bar.inc(n);
        } else if self.plain && self.last_line.elapsed() >= Duration::from_secs(5) {
            self.last_line = Instant::now();
            eprintln!("{} {} so far", self.count, self.what);
        }
    }

    /// Done: clear the bar.
    pub fn finish(self) -> u64 {
        if let Some(bar) = self.bar {
            bar.finish_and_clear();
        }
        self.count
    }
}
