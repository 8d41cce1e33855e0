//! Coalescing claims while events stream in one at a time.
//!
//! At a steady 2,000 events/s with one event per transaction, a relay that claims the moment an
//! event is ready makes every event a batch of its own: one claim, one publish round trip, one
//! settle, and the wake-ups between them, per event. Those per-batch costs, not the events,
//! were most of the relay's CPU (about 100 µs per event for the shipped binary with a Redis sink,
//! against 5 µs per event when draining a backlog in full batches).
//!
//! So once events arrive faster than one per [`LINGER`], the relay lets each short claim be
//! followed by a pause that ends [`LINGER`] after that claim began: the events that commit in
//! the meantime go out together in the next batch. Below that rate nothing changes, so a
//! trickle keeps its sub-millisecond commit→publish time; above it an event waits at most
//! [`LINGER`] more. A claim that shows a backlog is never followed by a pause: one that came
//! back full, or whose oldest event was enqueued more than [`BEHIND`] before (the relay is
//! behind: claims come back short only because each aggregate's next event waits for the one
//! before it, and pausing would cap the catch-up at one claim per [`LINGER`]). Neither is the
//! first [`WINDOW`] of a burst after a quiet spell: the rate is measured over windows of claims,
//! so the relay engages only once the stream has proved steady.
//!
//! The backlog test compares the database's clock (`enqueued_at`) with the relay's. A relay
//! whose clock runs ahead of the database's by more than [`BEHIND`] sees every event as late and
//! never pauses (today's behaviour, at today's CPU cost); one whose clock runs behind may pause
//! while catching up on a few aggregates. Hosts kept in sync by NTP are well within it.
//!
//! There is no setting: the rate decides. The engine measures, the caller sleeps; this module
//! only does arithmetic on the instants it is given, so it is tested with made-up clocks.

use std::time::Duration;

use tokio::time::Instant;

/// How long after a short claim began the next one may start, while coalescing.
pub(crate) const LINGER: Duration = Duration::from_millis(2);

/// A claim whose oldest event waited longer than this shows that the relay is behind.
pub(crate) const BEHIND: Duration = Duration::from_millis(50);

/// The span over which the arrival rate is measured.
pub(crate) const WINDOW: Duration = Duration::from_millis(100);

/// Coalesce from this many events per second (one per millisecond: half of what one pause
/// gathers, so a batch holds two events or more on average once engaged).
const ENGAGE_PER_SECOND: f64 = 1_000.0;

/// Stop coalescing below this rate. Lower than [`ENGAGE_PER_SECOND`] so that a stream at the
/// threshold does not switch on and off from one window to the next.
const DISENGAGE_PER_SECOND: f64 = 800.0;

/// Measures the rate at which claims find events, and says when the next claim may start.
#[derive(Debug)]
pub(crate) struct Coalescer {
    window_start: Instant,
    window_events: u64,
    engaged: bool,
}

impl Coalescer {
    pub(crate) fn new(now: Instant) -> Self {
        Coalescer {
            window_start: now,
            window_events: 0,
            engaged: false,
        }
    }

    /// A claim that began at `started` found `events` (zero included); `backlog` says it came
    /// back full or found events older than [`BEHIND`]. Returns when the next claim may start:
    /// `Some` only while coalescing and when the claim found events but no backlog; `None`
    /// means at once, as before.
    pub(crate) fn claimed(
        &mut self,
        started: Instant,
        events: usize,
        backlog: bool,
    ) -> Option<Instant> {
        self.window_events = self.window_events.saturating_add(events as u64);
        let elapsed = started.saturating_duration_since(self.window_start);
        if elapsed >= WINDOW {
            let rate = self.window_events as f64 / elapsed.as_secs_f64();
            self.engaged = if self.engaged {
                rate >= DISENGAGE_PER_SECOND
            } else {
                rate >= ENGAGE_PER_SECOND
            };
            self.window_start = started;
            self.window_events = 0;
        }
        (self.engaged && events > 0 && !backlog).then(|| started + LINGER)
    }

    /// Whether claims are being coalesced now.
    #[cfg(test)]
    fn engaged(&self) -> bool {
        self.engaged
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Claims of `per_claim` events every `every`, for `span`, starting at `from`; the last
    /// answer.
    fn stream(
        c: &mut Coalescer,
        from: Instant,
        every: Duration,
        per_claim: usize,
        span: Duration,
    ) -> (Instant, Option<Instant>) {
        let mut at = from;
        let mut last = None;
        while at < from + span {
            last = c.claimed(at, per_claim, false);
            at += every;
        }
        (at, last)
    }

    #[test]
    fn a_trickle_is_never_held() {
        let t0 = Instant::now();
        let mut c = Coalescer::new(t0);
        // 500 events/s: one event every 2 ms, for a second.
        let (_, last) = stream(
            &mut c,
            t0,
            Duration::from_millis(2),
            1,
            Duration::from_secs(1),
        );
        assert!(!c.engaged());
        assert_eq!(last, None);
    }

    #[test]
    fn a_steady_stream_above_the_threshold_is_held_after_one_window() {
        let t0 = Instant::now();
        let mut c = Coalescer::new(t0);
        // 2,000 events/s: one every 0.5 ms. The first window is not held.
        let every = Duration::from_micros(500);
        let (at, last) = stream(&mut c, t0, every, 1, WINDOW);
        assert!(!c.engaged());
        assert_eq!(last, None);
        // The claim that closes the first window engages, and holds the next claim for LINGER.
        let (at, last) = stream(&mut c, at, every, 1, every);
        assert!(c.engaged());
        assert_eq!(last, Some(at - every + LINGER));
    }

    #[test]
    fn claims_that_show_a_backlog_and_empty_claims_are_never_held() {
        let t0 = Instant::now();
        let mut c = Coalescer::new(t0);
        let (at, _) = stream(&mut c, t0, Duration::from_millis(1), 5, WINDOW * 2);
        assert!(c.engaged());
        assert_eq!(c.claimed(at, 100, true), None, "a backlog");
        assert_eq!(c.claimed(at, 0, false), None, "nothing found");
        assert_eq!(c.claimed(at, 3, false), Some(at + LINGER));
    }

    #[test]
    fn it_lets_go_when_the_stream_slows_and_after_a_quiet_spell() {
        let t0 = Instant::now();
        let mut c = Coalescer::new(t0);
        let (at, _) = stream(&mut c, t0, Duration::from_millis(2), 4, WINDOW * 3);
        assert!(c.engaged(), "2,000/s in claims of four");
        // 900/s: between the two thresholds, so it stays engaged.
        let (at, _) = stream(&mut c, at, Duration::from_millis(10), 9, WINDOW * 3);
        assert!(c.engaged());
        // 500/s: lets go.
        let (at, last) = stream(&mut c, at, Duration::from_millis(2), 1, WINDOW * 3);
        assert!(!c.engaged());
        assert_eq!(last, None);
        // Engaged again, then a second with nothing: the first claim after it lets go.
        let (at, _) = stream(&mut c, at, Duration::from_millis(1), 3, WINDOW * 2);
        assert!(c.engaged());
        let later = at + Duration::from_secs(1);
        assert_eq!(c.claimed(later, 1, false), None);
        assert!(!c.engaged());
    }
}
