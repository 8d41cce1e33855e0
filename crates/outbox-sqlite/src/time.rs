//! Times as SQLite stores them: microseconds since the Unix epoch in an `INTEGER`, saturated at
//! the end of year 9999 so an unbounded lease or delay never overflows.

use chrono::{DateTime, Utc};
use outbox_types::StoreError;
use outbox_types::sql_store::micros;
use std::time::Duration;

/// The latest instant any stored time may be (the end of year 9999): an unbounded lease or
/// delay saturates here instead of overflowing, and every stored time stays decodable.
pub(crate) const MAX_MICROS: i64 = 253_402_300_799_999_999;

/// Whether a write statement takes the current time (read under the write turn) as its last
/// parameter.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Stamp {
    /// It does.
    Now,
    /// It does not.
    None,
}

pub(crate) fn now_micros() -> i64 {
    clamp_micros(Utc::now().timestamp_micros())
}

pub(crate) fn clamp_micros(us: i64) -> i64 {
    us.min(MAX_MICROS)
}

/// `now + d`, saturated to [`MAX_MICROS`].
pub(crate) fn after(now: i64, d: Duration) -> i64 {
    clamp_micros(now.saturating_add(micros(d)))
}

pub(crate) fn to_time(seq: i64, column: &str, us: i64) -> Result<DateTime<Utc>, StoreError> {
    DateTime::from_timestamp_micros(us).ok_or_else(|| StoreError::Corrupt {
        seq,
        reason: format!("{column} {us} is not a time in microseconds since the epoch"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_saturate_instead_of_overflowing() {
        assert_eq!(after(0, Duration::MAX), MAX_MICROS);
        assert_eq!(after(10, Duration::from_micros(5)), 15);
        assert!(to_time(1, "x", MAX_MICROS).is_ok());
        assert!(matches!(
            to_time(1, "x", i64::MAX),
            Err(StoreError::Corrupt { seq: 1, .. })
        ));
    }
}
