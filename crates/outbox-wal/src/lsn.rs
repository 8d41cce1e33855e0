//! [`Lsn`]: a position in PostgreSQL's write-ahead log.
//!
//! Our own small type rather than the replication client's, so the public API does not change
//! when the client does.

use std::fmt;

use serde::{Deserialize, Serialize};

/// A WAL position (`pg_lsn`), printed the PostgreSQL way (`16/B374D848`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Lsn(pub u64);

impl Lsn {
    /// The invalid position `0/0`.
    pub const ZERO: Lsn = Lsn(0);

    /// Parse `X/Y` (hex halves).
    ///
    /// ```
    /// use outbox_wal::Lsn;
    /// let lsn = Lsn::parse("16/B374D848").unwrap();
    /// assert_eq!(lsn.0, 0x16_B374_D848);
    /// assert_eq!(lsn.to_string(), "16/B374D848");
    /// assert!(Lsn::parse("nope").is_err());
    /// ```
    pub fn parse(text: &str) -> Result<Lsn, String> {
        let (hi, lo) = text
            .trim()
            .split_once('/')
            .ok_or_else(|| format!("invalid LSN `{text}` (expected X/Y)"))?;
        let hi = u32::from_str_radix(hi, 16).map_err(|e| format!("invalid LSN `{text}`: {e}"))?;
        let lo = u32::from_str_radix(lo, 16).map_err(|e| format!("invalid LSN `{text}`: {e}"))?;
        Ok(Lsn((u64::from(hi) << 32) | u64::from(lo)))
    }

    /// Whether this is `0/0`.
    pub fn is_zero(self) -> bool {
        self.0 == 0
    }
}

impl fmt::Display for Lsn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:X}/{:X}", self.0 >> 32, self.0 & 0xFFFF_FFFF)
    }
}

impl From<pgwire_replication::Lsn> for Lsn {
    fn from(value: pgwire_replication::Lsn) -> Self {
        Lsn(value.as_u64())
    }
}

impl From<Lsn> for pgwire_replication::Lsn {
    fn from(value: Lsn) -> Self {
        pgwire_replication::Lsn::from_u64(value.0)
    }
}

impl Serialize for Lsn {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Lsn {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        Lsn::parse(&text).map_err(serde::de::Error::custom)
    }
}
