//! What an operator asks of an inbox: how many rows per handler and how old, how many are due
//! for purge, what was parked. The `outbox inbox status|parked` commands print these.
//!
//! Why here and not in the CLI: the same questions come from a consumer's own health checks,
//! and each database answers them in its own SQL, next to the tables it created.

use chrono::{DateTime, Utc};
use serde::Serialize;

use crate::ParkedMessage;

/// The state of one inbox.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct InboxStats {
    /// The inbox schema version in the database (0: not migrated).
    pub schema_version: i64,
    /// Per handler, by name.
    pub handlers: Vec<HandlerStats>,
    /// Parked messages per handler, by name.
    pub parked: Vec<ParkedCount>,
}

impl InboxStats {
    /// Inbox rows of every handler.
    ///
    /// ```
    /// # let stats: outbox_inbox::InboxStats = Default::default();
    /// assert_eq!(stats.rows(), 0);
    /// ```
    pub fn rows(&self) -> u64 {
        self.handlers.iter().map(|h| h.rows).sum()
    }

    /// Parked messages of every handler.
    ///
    /// ```
    /// # let stats: outbox_inbox::InboxStats = Default::default();
    /// assert_eq!(stats.parked_total(), 0);
    /// ```
    pub fn parked_total(&self) -> u64 {
        self.parked.iter().map(|p| p.messages).sum()
    }

    /// The oldest inbox row of any handler.
    ///
    /// ```
    /// # let stats: outbox_inbox::InboxStats = Default::default();
    /// assert!(stats.oldest().is_none());
    /// ```
    pub fn oldest(&self) -> Option<DateTime<Utc>> {
        self.handlers.iter().filter_map(|h| h.oldest).min()
    }
}

/// One handler's inbox rows.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct HandlerStats {
    /// The handler name (second half of the inbox key).
    pub handler: String,
    /// Events it processed that are still remembered.
    pub rows: u64,
    /// Rows older than the retention window asked about: what the next purge deletes.
    pub past_retention: u64,
    /// When the oldest remembered event was processed.
    pub oldest: Option<DateTime<Utc>>,
    /// When the newest was processed.
    pub newest: Option<DateTime<Utc>>,
}

/// One handler's parked messages.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct ParkedCount {
    /// The handler name.
    pub handler: String,
    /// How many of its messages are parked.
    pub messages: u64,
    /// When the oldest was parked.
    pub oldest: Option<DateTime<Utc>>,
}

/// A parked message as stored: its row id, handler and time, and the message.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ParkedRecord {
    /// The row id (`outbox inbox parked show ID`).
    pub id: i64,
    /// The handler that gave up on it.
    pub handler: String,
    /// When.
    pub parked_at: DateTime<Utc>,
    /// The message, its last error and attempts.
    pub message: ParkedMessage,
}

/// Which parked messages to list.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ParkedQuery {
    /// Only this handler's.
    pub handler: Option<String>,
    /// Only rows with an id above this (paging: the last id of the previous page).
    pub after: Option<i64>,
    /// At most this many (0 = 50).
    pub limit: u32,
}

impl ParkedQuery {
    /// Every handler's, oldest first, 50 at a time.
    ///
    /// ```
    /// let q = outbox_inbox::ParkedQuery::new().handler("billing").after(10).limit(5);
    /// assert_eq!(q.limit, 5);
    /// ```
    pub fn new() -> Self {
        Self::default()
    }

    /// Only `handler`'s.
    pub fn handler(mut self, handler: impl Into<String>) -> Self {
        self.handler = Some(handler.into());
        self
    }

    /// Only ids above `id`.
    pub fn after(mut self, id: i64) -> Self {
        self.after = Some(id);
        self
    }

    /// At most `limit`.
    pub fn limit(mut self, limit: u32) -> Self {
        self.limit = limit;
        self
    }

    /// The `LIMIT` of one page: `limit`, or 50 when it is 0. (Read by the SQL inboxes only.)
    #[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
    pub(crate) fn page(&self) -> i64 {
        i64::from(if self.limit == 0 { 50 } else { self.limit })
    }
}
