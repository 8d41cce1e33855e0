//! When to try again, and when to give up.
//!
//! Backoff is exponential with *full jitter* (a uniformly random delay between zero and the
//! exponential ceiling): after an outage, thousands of events that failed together must not all
//! come due in the same millisecond and knock the destination over again. The randomness is an
//! argument, not read here, so the schedule is a pure function that property tests can pin down.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Exponential backoff with full jitter, a cap, and a maximum number of attempts.
///
/// ```
/// use std::time::Duration;
/// use outbox_types::RetryPolicy;
///
/// let policy = RetryPolicy::default(); // base 1 s, cap 60 s, 10 attempts
/// // After the 3rd failed attempt the delay is drawn from [0, 4 s].
/// assert_eq!(policy.ceiling(3), Duration::from_secs(4));
/// assert_eq!(policy.backoff(3, 0.5), Duration::from_secs(2));
/// // Far out, the cap holds.
/// assert_eq!(policy.ceiling(30), Duration::from_secs(60));
/// assert!(policy.is_exhausted(10));
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RetryPolicy {
    /// Ceiling of the delay after the first failure; doubles with each further failure.
    #[serde(with = "humantime_duration")]
    pub base: Duration,
    /// Largest delay between two attempts.
    #[serde(with = "humantime_duration")]
    pub cap: Duration,
    /// After this many failed attempts the event is dead. At least 1.
    pub max_attempts: u32,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            base: Duration::from_secs(1),
            cap: Duration::from_secs(60),
            max_attempts: 10,
        }
    }
}

impl RetryPolicy {
    /// The largest delay allowed after `failed_attempts` failures (1 for the first failure):
    /// `min(cap, base · 2^(failed_attempts − 1))`.
    pub fn ceiling(&self, failed_attempts: u32) -> Duration {
        let exponent = failed_attempts.saturating_sub(1).min(63);
        let factor = 1u64 << exponent;
        let base_ms = u64::try_from(self.base.as_millis()).unwrap_or(u64::MAX);
        let ceiling_ms = base_ms.saturating_mul(factor);
        Duration::from_millis(ceiling_ms).min(self.cap)
    }

    /// The delay before the next attempt after `failed_attempts` failures, given `unit`, a random
    /// number in `[0, 1)` (values outside are clamped).
    pub fn backoff(&self, failed_attempts: u32, unit: f64) -> Duration {
        let unit = if unit.is_nan() {
            0.0
        } else {
            unit.clamp(0.0, 1.0)
        };
        let ceiling = self.ceiling(failed_attempts);
        let ms = (ceiling.as_millis() as f64 * unit).floor() as u64;
        Duration::from_millis(ms).min(ceiling)
    }

    /// Whether an event that has now failed `failed_attempts` times is out of attempts.
    pub fn is_exhausted(&self, failed_attempts: u32) -> bool {
        failed_attempts >= self.max_attempts.max(1)
    }
}

/// What a dead event means for the later events of its aggregate.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DeadLetterPolicy {
    /// Later events of the aggregate wait until the dead one is requeued or discarded: strict
    /// order, at the price of a stuck aggregate (visible in `outbox status`). Other aggregates are
    /// never affected. The default, because silently reordering an aggregate is the worse surprise.
    #[default]
    Block,
    /// Later events of the aggregate go on as if the dead one had been delivered.
    Skip,
}

/// `serde` support for durations written the human way (`500ms`, `2s`, `1m 30s`).
pub mod humantime_duration {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    /// Write as e.g. `1m 30s`.
    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&format_duration(*d))
    }

    /// Read `500ms`, `2s`, `1m 30s`; a bare integer is rejected so a unit is always explicit.
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let text = String::deserialize(d)?;
        parse_duration(&text).map_err(serde::de::Error::custom)
    }

    /// Parse `500ms`, `2s`, `1m 30s`, `1h`, `7d`.
    pub fn parse_duration(text: &str) -> Result<Duration, String> {
        let trimmed = text.trim();
        if trimmed.is_empty() {
            return Err("empty duration (write e.g. `500ms`, `2s`, `1m`)".to_owned());
        }
        let mut total = Duration::ZERO;
        let mut rest = trimmed;
        while !rest.is_empty() {
            rest = rest.trim_start();
            let digits = rest
                .find(|c: char| !c.is_ascii_digit())
                .unwrap_or(rest.len());
            if digits == 0 {
                return Err(format!(
                    "invalid duration `{text}` (write e.g. `500ms`, `2s`, `1m`)"
                ));
            }
            let value: u64 = rest[..digits]
                .parse()
                .map_err(|_| format!("invalid duration `{text}`: number too large"))?;
            rest = rest[digits..].trim_start();
            let unit_len = rest
                .find(|c: char| c.is_ascii_digit() || c.is_whitespace())
                .unwrap_or(rest.len());
            let unit = &rest[..unit_len];
            rest = &rest[unit_len..];
            let piece = match unit {
                "ms" => Duration::from_millis(value),
                "s" | "sec" | "secs" => Duration::from_secs(value),
                "m" | "min" | "mins" => Duration::from_secs(value.saturating_mul(60)),
                "h" | "hr" | "hours" => Duration::from_secs(value.saturating_mul(3600)),
                "d" | "days" => Duration::from_secs(value.saturating_mul(86_400)),
                "" => {
                    return Err(format!(
                        "invalid duration `{text}`: missing unit (write e.g. `{value}ms` or `{value}s`)"
                    ));
                }
                other => {
                    return Err(format!(
                        "invalid duration `{text}`: unknown unit `{other}` (use ms, s, m, h or d)"
                    ));
                }
            };
            total = total.saturating_add(piece);
        }
        Ok(total)
    }

    /// Format a duration with the largest exact units (`90s` → `1m 30s`).
    pub fn format_duration(d: Duration) -> String {
        let mut ms = d.as_millis();
        if ms == 0 {
            return "0ms".to_owned();
        }
        let mut parts = Vec::new();
        for (unit, size) in [
            ("d", 86_400_000u128),
            ("h", 3_600_000),
            ("m", 60_000),
            ("s", 1000),
            ("ms", 1),
        ] {
            if ms >= size {
                parts.push(format!("{}{unit}", ms / size));
                ms %= size;
            }
        }
        parts.join(" ")
    }
}

#[cfg(test)]
mod tests {
    use super::humantime_duration::{format_duration, parse_duration};
    use super::*;
    use proptest::prelude::*;

    fn policy() -> impl Strategy<Value = RetryPolicy> {
        (1u64..10_000, 1u64..600_000, 1u32..50).prop_map(|(base, cap, max)| RetryPolicy {
            base: Duration::from_millis(base),
            cap: Duration::from_millis(cap),
            max_attempts: max,
        })
    }

    proptest! {
        #[test]
        fn delay_never_exceeds_cap_nor_exponential_ceiling(p in policy(), n in 1u32..200, u in 0.0f64..1.0) {
            let d = p.backoff(n, u);
            prop_assert!(d <= p.cap);
            prop_assert!(d <= p.ceiling(n));
            let exact = (p.base.as_millis() as f64) * 2f64.powi(n as i32 - 1);
            prop_assert!(d.as_millis() as f64 <= exact);
        }

        #[test]
        fn ceiling_doubles_until_capped(p in policy(), n in 1u32..60) {
            let now = p.ceiling(n);
            let next = p.ceiling(n + 1);
            prop_assert!(next >= now);
            if now < p.cap {
                let doubled = (now * 2).min(p.cap);
                prop_assert_eq!(next, doubled);
            } else {
                prop_assert_eq!(next, p.cap);
            }
        }

        #[test]
        fn jitter_spans_the_whole_window(p in policy(), n in 1u32..40) {
            prop_assert_eq!(p.backoff(n, 0.0), Duration::ZERO);
            let top = p.backoff(n, 0.999_999_9);
            let ceiling = p.ceiling(n);
            // Full jitter reaches (almost) the ceiling: within one millisecond of rounding.
            prop_assert!(ceiling.saturating_sub(top) <= Duration::from_millis(1) + ceiling / 1_000_000);
        }

        #[test]
        fn delay_is_monotonic_in_the_random_unit(p in policy(), n in 1u32..40, a in 0.0f64..1.0, b in 0.0f64..1.0) {
            let (lo, hi) = if a <= b { (a, b) } else { (b, a) };
            prop_assert!(p.backoff(n, lo) <= p.backoff(n, hi));
        }

        #[test]
        fn exhausted_exactly_at_max_attempts(p in policy(), n in 0u32..100) {
            prop_assert_eq!(p.is_exhausted(n), n >= p.max_attempts);
        }

        #[test]
        fn durations_round_trip_through_text(ms in 0u64..10_000_000_000) {
            let d = Duration::from_millis(ms);
            prop_assert_eq!(parse_duration(&format_duration(d)).unwrap(), d);
        }
    }

    #[test]
    fn default_schedule_matches_the_documented_one() {
        let p = RetryPolicy::default();
        let ceilings: Vec<u64> = (1..=8).map(|n| p.ceiling(n).as_secs()).collect();
        assert_eq!(ceilings, [1, 2, 4, 8, 16, 32, 60, 60]);
        assert!(!p.is_exhausted(9));
        assert!(p.is_exhausted(10));
    }

    #[test]
    fn bad_durations_say_what_is_wrong() {
        assert!(parse_duration("5").unwrap_err().contains("missing unit"));
        assert!(
            parse_duration("5 parsecs")
                .unwrap_err()
                .contains("unknown unit `parsecs`")
        );
        assert!(parse_duration("").unwrap_err().contains("empty"));
        assert_eq!(parse_duration("1m 30s").unwrap(), Duration::from_secs(90));
        assert_eq!(parse_duration("250ms").unwrap(), Duration::from_millis(250));
    }
}
