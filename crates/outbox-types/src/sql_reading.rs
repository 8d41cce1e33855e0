//! A stored row's `id` and `headers` as a [`Reading`] takes them: strictly for delivery (a
//! malformed value is [`StoreError::Corrupt`], and the claim buries the row), leniently for an
//! operator's display (the row is probably dead for exactly that reason and must still be
//! listed).
//!
//! Why here: the SQL stores decode these columns from their own drivers' rows, but what a
//! malformed value becomes is one rule; each store used to spell it out in its decoder.

use crate::sql_store::decode_headers;
use crate::{EventId, Headers, Reading, StoreError, headers_for_display};

/// A stored `headers` text of row `seq` as [`Headers`]: [`decode_headers`] for delivery,
/// [`headers_for_display`] (never an error) for display.
///
/// ```
/// use outbox_types::Reading;
/// use outbox_types::sql_reading::headers_as;
/// assert!(headers_as(7, "[1,2", Reading::Delivery).is_err());
/// let shown = headers_as(7, "[1,2", Reading::Display).unwrap();
/// assert_eq!(shown["outbox-unreadable-headers"], "[1,2");
/// ```
pub fn headers_as(seq: i64, text: &str, reading: Reading) -> Result<Headers, StoreError> {
    match reading {
        Reading::Delivery => decode_headers(seq, text),
        Reading::Display => Ok(headers_for_display(text)),
    }
}

/// A stored id as the store decoded it (`decoded`): as it is for delivery; for display, an id
/// that could not be read or is not a UUID shows as the nil UUID.
///
/// ```
/// use outbox_types::{EventId, Reading, StoreError};
/// use outbox_types::sql_reading::id_as;
/// let bad = || Err(StoreError::Corrupt { seq: 7, reason: "not a UUID".to_owned() });
/// assert!(id_as(bad(), Reading::Delivery).is_err());
/// assert_eq!(id_as(bad(), Reading::Display).unwrap(), EventId::from_uuid(uuid::Uuid::nil()));
/// ```
pub fn id_as(
    decoded: Result<EventId, StoreError>,
    reading: Reading,
) -> Result<EventId, StoreError> {
    match reading {
        Reading::Delivery => decoded,
        Reading::Display => Ok(decoded.unwrap_or_else(|_| EventId::from_uuid(uuid::Uuid::nil()))),
    }
}
