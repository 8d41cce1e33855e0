use bytes::{BufMut, Bytes, BytesMut};
use std::io;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::error::{PgWireError, Result};

/// Maximum backend message size (1GB) - prevents memory exhaustion from malformed length fields
/// This is more than enough.
///
/// The default for [`MessageReader`] and for
/// [`ReplicationConfig::max_message_size`](crate::config::ReplicationConfig::max_message_size).
pub const MAX_MESSAGE_SIZE: usize = 1024 * 1024 * 1024;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackendMessage {
    pub tag: u8,
    pub payload: Bytes, // payload excludes the 4-byte length field
}

impl BackendMessage {
    /// Returns true if this is an ErrorResponse ('E')
    #[inline]
    pub fn is_error(&self) -> bool {
        self.tag == b'E'
    }

    /// Returns true if this is a ReadyForQuery ('Z')
    #[inline]
    pub fn is_ready_for_query(&self) -> bool {
        self.tag == b'Z'
    }

    /// Returns true if this is CopyBothResponse ('W')
    #[inline]
    pub fn is_copy_both_response(&self) -> bool {
        self.tag == b'W'
    }

    /// Returns true if this is CopyData ('d')
    #[inline]
    pub fn is_copy_data(&self) -> bool {
        self.tag == b'd'
    }

    /// Returns true if this is AuthenticationRequest ('R')
    #[inline]
    pub fn is_auth_request(&self) -> bool {
        self.tag == b'R'
    }
}

/// A backend message as [`MessageReader::read_frame`] returns it: whole, or read past.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    /// A message within the reader's limit, whole.
    Whole(BackendMessage),
    /// A `CopyData` message over the reader's limit that was read past (see
    /// [`MessageReader::skip_oversized_copy_data`]): only its first bytes were kept.
    Truncated(TruncatedMessage),
}

/// The kept beginning of a `CopyData` message read past for its size.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TruncatedMessage {
    /// The message's tag (always `b'd'`, CopyData).
    pub tag: u8,
    /// The first bytes of its payload (at most the configured prefix).
    pub prefix: Bytes,
    /// The payload's full length, as the server announced it.
    pub len: usize,
}

pub async fn read_backend_message<R: AsyncRead + Unpin>(rd: &mut R) -> Result<BackendMessage> {
    let mut reader = MessageReader::new();
    reader.read(rd).await
}

/// Cancellation-safe backend message reader.
///
/// PostgreSQL backend messages span multiple `read` operations (5-byte header,
/// then a variable payload). A naive implementation using `read_exact` is
/// **not** cancellation-safe: if the future is dropped between reads (e.g. by
/// `tokio::select!` or `tokio::time::timeout`), bytes already pulled from the
/// underlying stream are lost and the next read mis-parses the wire stream.
///
/// `MessageReader` externalizes the partial-read state so it survives across
/// dropped futures. Each call to [`read`](Self::read) uses one-shot
/// `AsyncReadExt::read` (which **is** cancel-safe) and accumulates progress
/// on `self`. If the returned future is dropped, no bytes are lost; the next
/// invocation resumes from where the previous one left off.
pub struct MessageReader {
    hdr: [u8; 5],
    hdr_filled: usize,
    payload: BytesMut,
    payload_filled: usize,
    /// `Some` once the header has been fully read and parsed; reset to
    /// `None` after each completed message.
    payload_len: Option<usize>,
    tag: u8,
    /// Largest payload accepted; a longer message is refused before any of
    /// it is buffered.
    max_payload: usize,
    /// Set once a message has been refused for exceeding `max_payload`.
    /// The refused payload is still on the wire and is never consumed, so
    /// the reader cannot resynchronize: every later read fails the same way.
    refused: Option<(usize, usize)>,
    /// With [`skip_oversized_copy_data`](Self::skip_oversized_copy_data): how
    /// many leading bytes of an oversized CopyData message to keep.
    skip_keep: Option<usize>,
    /// Bytes of the current oversized message still to read and drop; `Some`
    /// while one is being read past.
    skip_remaining: Option<usize>,
    /// Where dropped bytes are read into (allocated on the first skip).
    scratch: Vec<u8>,
}

/// How many bytes one read of a skipped payload takes at most: a copy
/// through this buffer is all a skipped message costs.
const SKIP_CHUNK: usize = 64 * 1024;

impl MessageReader {
    pub fn new() -> Self {
        Self::with_capacity(4096)
    }

    pub fn with_capacity(capacity: usize) -> Self {
        Self {
            hdr: [0u8; 5],
            hdr_filled: 0,
            payload: BytesMut::with_capacity(capacity),
            payload_filled: 0,
            payload_len: None,
            tag: 0,
            max_payload: MAX_MESSAGE_SIZE,
            refused: None,
            skip_keep: None,
            skip_remaining: None,
            scratch: Vec::new(),
        }
    }

    /// Refuse any message whose payload is larger than `max` bytes.
    ///
    /// `max` is compared against the message's length field minus 4, so it
    /// excludes the tag and the length field itself. The payload buffer is
    /// sized from the length the server announces, so this bounds the memory
    /// one message can take. It can only lower the limit: a value above
    /// [`MAX_MESSAGE_SIZE`], the default, is capped to it.
    ///
    /// A refused message is terminal. Its payload is left on the wire, so the
    /// reader cannot resynchronize and every later [`read`](Self::read)
    /// returns the same [`PgWireError::MessageTooLarge`]. Discard the reader
    /// and the connection.
    pub fn with_max_message_size(mut self, max: usize) -> Self {
        self.max_payload = max.min(MAX_MESSAGE_SIZE);
        self
    }

    /// Read past a `CopyData` message over the limit instead of refusing it:
    /// keep its first `keep` bytes (capped to the limit), read the rest off the
    /// wire and drop it, then go on with the next message.
    /// [`read_frame`](Self::read_frame) returns such a message as
    /// [`Frame::Truncated`]; [`read`](Self::read) still fails on it, with
    /// [`PgWireError::MessageTooLarge`] (but the reader stays usable).
    ///
    /// So one huge row or logical message costs at most `keep` bytes and a
    /// 64 KiB read buffer, however large it is, and the stream moves past it:
    /// the caller decides what the change it cannot hold means (it knows the
    /// WAL position from the kept XLogData header). Other messages over the
    /// limit (an `ErrorResponse`, say) are refused as without this setting.
    pub fn skip_oversized_copy_data(mut self, keep: usize) -> Self {
        self.skip_keep = Some(keep);
        self
    }

    /// Read the next complete backend message. With
    /// [`skip_oversized_copy_data`](Self::skip_oversized_copy_data), an
    /// oversized CopyData message read past is an error here; use
    /// [`read_frame`](Self::read_frame) to get its kept bytes.
    ///
    /// Cancellation-safe: dropping the returned future preserves all progress
    /// so far on `self`. Re-call to resume.
    pub async fn read<R: AsyncRead + Unpin>(&mut self, rd: &mut R) -> Result<BackendMessage> {
        match self.read_frame(rd).await? {
            Frame::Whole(message) => Ok(message),
            Frame::Truncated(truncated) => Err(PgWireError::MessageTooLarge {
                payload_bytes: truncated.len,
                limit_bytes: self.max_payload,
            }),
        }
    }

    /// Read the next backend message, whole or (an oversized CopyData message,
    /// with [`skip_oversized_copy_data`](Self::skip_oversized_copy_data)) read
    /// past with its first bytes kept.
    ///
    /// Cancellation-safe like [`read`](Self::read), also while a message is
    /// being read past.
    pub async fn read_frame<R: AsyncRead + Unpin>(&mut self, rd: &mut R) -> Result<Frame> {
        // Phase 0: a refused message is terminal. Its payload is still on the
        // wire and carries WAL data we must not skip past, so there is nothing
        // to resynchronize to — fail the same way until the caller discards
        // this reader and its connection.
        if let Some((payload_bytes, limit_bytes)) = self.refused {
            return Err(PgWireError::MessageTooLarge {
                payload_bytes,
                limit_bytes,
            });
        }

        // Phase 1: fill the 5-byte header
        while self.hdr_filled < 5 {
            let n = rd.read(&mut self.hdr[self.hdr_filled..]).await?;
            if n == 0 {
                return Err(PgWireError::Io(std::sync::Arc::new(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "EOF while reading backend message header",
                ))));
            }
            self.hdr_filled += n;
        }

        // Phase 2: parse the header (idempotent — runs once per message)
        if self.payload_len.is_none() {
            let len = i32::from_be_bytes([self.hdr[1], self.hdr[2], self.hdr[3], self.hdr[4]]);

            if len < 4 {
                // Reset so the reader is reusable after a protocol error is
                // surfaced (callers typically tear down on this anyway).
                self.hdr_filled = 0;
                return Err(PgWireError::Protocol(format!(
                    "invalid backend message length: {len}"
                )));
            }

            let payload_len = (len - 4) as usize;

            let mut kept = payload_len;
            if payload_len > self.max_payload {
                match self.skip_keep {
                    // Read past it: keep its head, drop the rest as it arrives.
                    Some(keep) if self.hdr[0] == b'd' => {
                        kept = keep.min(self.max_payload);
                        self.skip_remaining = Some(payload_len - kept);
                    }
                    _ => {
                        self.hdr_filled = 0;
                        self.refused = Some((payload_len, self.max_payload));
                        return Err(PgWireError::MessageTooLarge {
                            payload_bytes: payload_len,
                            limit_bytes: self.max_payload,
                        });
                    }
                }
            }

            self.tag = self.hdr[0];
            self.payload.clear();
            self.payload.resize(kept, 0);
            self.payload_filled = 0;
            self.payload_len = Some(payload_len);
        }

        let payload_len = self.payload_len.unwrap();
        let kept = self.payload.len();

        // Phase 3: fill the payload (the kept head of one read past)
        while self.payload_filled < kept {
            let n = rd.read(&mut self.payload[self.payload_filled..]).await?;
            if n == 0 {
                return Err(PgWireError::Io(std::sync::Arc::new(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "EOF while reading backend message payload",
                ))));
            }
            self.payload_filled += n;
        }

        // Phase 3b: drop the rest of a message read past
        if let Some(mut remaining) = self.skip_remaining {
            if self.scratch.is_empty() {
                self.scratch = vec![0u8; SKIP_CHUNK];
            }
            while remaining > 0 {
                let want = remaining.min(SKIP_CHUNK);
                let n = rd.read(&mut self.scratch[..want]).await?;
                if n == 0 {
                    return Err(PgWireError::Io(std::sync::Arc::new(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "EOF while reading past an oversized backend message",
                    ))));
                }
                remaining -= n;
                self.skip_remaining = Some(remaining);
            }
        }

        // Phase 4: take payload, reset state for next message
        let payload = self.payload.split().freeze();
        let tag = self.tag;
        self.hdr_filled = 0;
        self.payload_len = None;
        self.payload_filled = 0;

        if self.skip_remaining.take().is_some() {
            return Ok(Frame::Truncated(TruncatedMessage {
                tag,
                prefix: payload,
                len: payload_len,
            }));
        }
        Ok(Frame::Whole(BackendMessage { tag, payload }))
    }
}

impl Default for MessageReader {
    fn default() -> Self {
        Self::new()
    }
}

/// Read a single backend message, reusing the provided buffer.
///
/// **Not** cancellation-safe — see [`MessageReader`] for a cancel-safe
/// alternative used in the streaming loop.
pub async fn read_backend_message_into<R: AsyncRead + Unpin>(
    rd: &mut R,
    buf: &mut BytesMut,
) -> Result<BackendMessage> {
    let mut hdr = [0u8; 5];
    rd.read_exact(&mut hdr).await?;
    let tag = hdr[0];
    let len = i32::from_be_bytes([hdr[1], hdr[2], hdr[3], hdr[4]]);

    if len < 4 {
        return Err(PgWireError::Protocol(format!(
            "invalid backend message length: {len}"
        )));
    }

    let payload_len = (len - 4) as usize;

    if payload_len > MAX_MESSAGE_SIZE {
        return Err(PgWireError::MessageTooLarge {
            payload_bytes: payload_len,
            limit_bytes: MAX_MESSAGE_SIZE,
        });
    }

    buf.clear();
    buf.resize(payload_len, 0);
    rd.read_exact(&mut buf[..]).await?;
    Ok(BackendMessage {
        tag,
        payload: buf.split().freeze(),
    })
}

pub async fn write_ssl_request<W: AsyncWrite + Unpin>(wr: &mut W) -> Result<()> {
    let mut buf = [0u8; 8];
    buf[0..4].copy_from_slice(&(8i32).to_be_bytes());
    buf[4..8].copy_from_slice(&(80877103i32).to_be_bytes());
    wr.write_all(&buf).await?;
    wr.flush().await?;
    Ok(())
}

pub async fn write_startup_message<W: AsyncWrite + Unpin>(
    wr: &mut W,
    protocol_version: i32,
    params: &[(&str, &str)],
) -> Result<()> {
    let mut buf = BytesMut::with_capacity(256);
    buf.put_i32(0); // length placeholder
    buf.put_i32(protocol_version);

    for (k, v) in params {
        buf.extend_from_slice(k.as_bytes());
        buf.put_u8(0);
        buf.extend_from_slice(v.as_bytes());
        buf.put_u8(0);
    }
    buf.put_u8(0); // terminator

    let len = buf.len() as i32;
    buf[0..4].copy_from_slice(&len.to_be_bytes());

    wr.write_all(&buf).await?;
    wr.flush().await?;
    Ok(())
}

pub async fn write_query<W: AsyncWrite + Unpin>(wr: &mut W, sql: &str) -> Result<()> {
    let mut buf = BytesMut::with_capacity(sql.len() + 64);
    buf.put_u8(b'Q');
    buf.put_i32(0);
    buf.extend_from_slice(sql.as_bytes());
    buf.put_u8(0);

    let len = (buf.len() - 1) as i32;
    buf[1..5].copy_from_slice(&len.to_be_bytes());

    wr.write_all(&buf).await?;
    wr.flush().await?;
    Ok(())
}

pub async fn write_password_message<W: AsyncWrite + Unpin>(
    wr: &mut W,
    payload: &[u8],
) -> Result<()> {
    let mut buf = BytesMut::with_capacity(payload.len() + 16);
    buf.put_u8(b'p');
    buf.put_i32(0);
    buf.extend_from_slice(payload);

    let len = (buf.len() - 1) as i32;
    buf[1..5].copy_from_slice(&len.to_be_bytes());

    wr.write_all(&buf).await?;
    wr.flush().await?;
    Ok(())
}

pub async fn write_copy_data<W: AsyncWrite + Unpin>(wr: &mut W, payload: &[u8]) -> Result<()> {
    let mut buf = BytesMut::with_capacity(payload.len() + 16);
    buf.put_u8(b'd');
    buf.put_i32(0);
    buf.extend_from_slice(payload);

    let len = (buf.len() - 1) as i32;
    buf[1..5].copy_from_slice(&len.to_be_bytes());

    wr.write_all(&buf).await?;
    wr.flush().await?;
    Ok(())
}

pub async fn write_copy_done<W: AsyncWrite + Unpin>(wr: &mut W) -> Result<()> {
    let mut buf = BytesMut::with_capacity(5);
    buf.put_u8(b'c'); // CopyDone
    buf.put_i32(4); // length includes itself; CopyDone has no payload
    wr.write_all(&buf).await?;
    wr.flush().await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Cursor;
    use tokio::io::AsyncWriteExt;

    #[tokio::test]
    async fn read_backend_message_parses_valid_message() {
        // Tag 'Z' (ReadyForQuery), length=5 (4 + 1 byte payload), payload='I' (idle)
        let data = [b'Z', 0, 0, 0, 5, b'I'];
        let mut cursor = Cursor::new(&data[..]);

        let msg = read_backend_message(&mut cursor).await.unwrap();
        assert_eq!(msg.tag, b'Z');
        assert_eq!(&msg.payload[..], b"I");
        assert!(msg.is_ready_for_query());
    }

    #[tokio::test]
    async fn read_backend_message_handles_empty_payload() {
        // Tag 'N' (NoticeResponse placeholder), length=4 (no payload)
        let data = [b'N', 0, 0, 0, 4];
        let mut cursor = Cursor::new(&data[..]);

        let msg = read_backend_message(&mut cursor).await.unwrap();
        assert_eq!(msg.tag, b'N');
        assert!(msg.payload.is_empty());
    }

    #[tokio::test]
    async fn read_backend_message_rejects_invalid_length() {
        // length < 4 is invalid
        let data = [b'Z', 0, 0, 0, 3];
        let mut cursor = Cursor::new(&data[..]);

        let err = read_backend_message(&mut cursor).await.unwrap_err();
        assert!(err.to_string().contains("invalid backend message length"));
    }

    #[tokio::test]
    async fn message_reader_reads_complete_message() {
        // Tag 'Z' (ReadyForQuery), length=5 (4 + 1 byte payload), payload='I'
        let data = [b'Z', 0, 0, 0, 5, b'I'];
        let mut cursor = Cursor::new(&data[..]);

        let mut reader = MessageReader::new();
        let msg = reader.read(&mut cursor).await.unwrap();
        assert_eq!(msg.tag, b'Z');
        assert_eq!(&msg.payload[..], b"I");
    }

    #[tokio::test]
    async fn message_reader_reads_back_to_back_messages() {
        // Two messages on one stream: ReadyForQuery + NoticeResponse w/ empty payload
        let data = [b'Z', 0, 0, 0, 5, b'I', b'N', 0, 0, 0, 4];
        let mut cursor = Cursor::new(&data[..]);

        let mut reader = MessageReader::new();

        let m1 = reader.read(&mut cursor).await.unwrap();
        assert_eq!(m1.tag, b'Z');
        assert_eq!(&m1.payload[..], b"I");

        let m2 = reader.read(&mut cursor).await.unwrap();
        assert_eq!(m2.tag, b'N');
        assert!(m2.payload.is_empty());
    }

    /// Regression test for issue #5: reading a backend message must be
    /// cancellation-safe so that `tokio::select!` / `tokio::time::timeout`
    /// dropping the read future mid-message does not corrupt the stream.
    ///
    /// With the old `read_backend_message_into`, dropping the future after
    /// 3 of 5 header bytes were consumed would lose those 3 bytes and
    /// re-parse the next bytes as a new header, producing a bogus length
    /// and a Protocol error (or worse, a silent desync).
    #[tokio::test]
    async fn message_reader_resumes_after_cancellation_mid_header() {
        let (mut writer, mut rd) = tokio::io::duplex(64);
        let mut reader = MessageReader::new();

        // Tag 'd' (CopyData), length = 8 (4 + 4-byte payload), payload b"abcd"
        let header = [b'd', 0, 0, 0, 8];
        let payload = b"abcd";

        // Deliver only the first 3 header bytes, then cancel.
        writer.write_all(&header[..3]).await.unwrap();

        let timed_out =
            tokio::time::timeout(std::time::Duration::from_millis(20), reader.read(&mut rd)).await;
        assert!(
            timed_out.is_err(),
            "read must time out while waiting for remaining header bytes"
        );

        // Deliver the remaining bytes. A correct cancel-safe reader resumes
        // and returns the original message intact.
        writer.write_all(&header[3..]).await.unwrap();
        writer.write_all(payload).await.unwrap();

        let msg = reader.read(&mut rd).await.unwrap();
        assert_eq!(msg.tag, b'd');
        assert_eq!(&msg.payload[..], payload);
    }

    /// Ensures partial-payload cancellation also resumes correctly.
    #[tokio::test]
    async fn message_reader_resumes_after_cancellation_mid_payload() {
        let (mut writer, mut rd) = tokio::io::duplex(64);
        let mut reader = MessageReader::new();

        // 16-byte payload to ensure we can split it.
        let payload: [u8; 16] = std::array::from_fn(|i| i as u8);
        let len = (4 + payload.len()) as i32;
        let header = [
            b'd',
            (len >> 24) as u8,
            (len >> 16) as u8,
            (len >> 8) as u8,
            len as u8,
        ];

        // Full header + first 5 bytes of payload, then cancel.
        writer.write_all(&header).await.unwrap();
        writer.write_all(&payload[..5]).await.unwrap();

        let timed_out =
            tokio::time::timeout(std::time::Duration::from_millis(20), reader.read(&mut rd)).await;
        assert!(
            timed_out.is_err(),
            "read must time out while waiting for remaining payload bytes"
        );

        // Deliver the rest.
        writer.write_all(&payload[5..]).await.unwrap();

        let msg = reader.read(&mut rd).await.unwrap();
        assert_eq!(msg.tag, b'd');
        assert_eq!(&msg.payload[..], &payload[..]);
    }

    #[tokio::test]
    async fn message_reader_rejects_invalid_length() {
        let data = [b'Z', 0, 0, 0, 3];
        let mut cursor = Cursor::new(&data[..]);

        let mut reader = MessageReader::new();
        let err = reader.read(&mut cursor).await.unwrap_err();
        assert!(err.to_string().contains("invalid backend message length"));
    }

    #[tokio::test]
    async fn message_reader_rejects_a_message_over_its_configured_limit() {
        // A 10-byte payload against a limit of 8.
        let data = [b'd', 0, 0, 0, 14];
        let mut cursor = Cursor::new(&data[..]);

        let mut reader = MessageReader::new().with_max_message_size(8);
        let err = reader.read(&mut cursor).await.unwrap_err();
        assert!(matches!(
            err,
            PgWireError::MessageTooLarge {
                payload_bytes: 10,
                limit_bytes: 8
            }
        ));
        assert!(!err.is_transient());
    }

    #[tokio::test]
    async fn message_reader_is_poisoned_after_refusing_an_oversized_message() {
        // A 10-byte payload over the limit of 8, then a valid message that
        // must never be handed out: the refused payload sits between them and
        // may carry WAL changes, so skipping to the next frame would lose data.
        let mut data = vec![b'd', 0, 0, 0, 14];
        data.extend_from_slice(b"0123456789");
        data.extend_from_slice(&[b'k', 0, 0, 0, 7]);
        data.extend_from_slice(b"abc");
        let mut cursor = Cursor::new(&data[..]);

        let mut reader = MessageReader::new().with_max_message_size(8);
        assert!(reader.read(&mut cursor).await.is_err());

        for _ in 0..3 {
            let err = reader.read(&mut cursor).await.unwrap_err();
            assert!(matches!(
                err,
                PgWireError::MessageTooLarge {
                    payload_bytes: 10,
                    limit_bytes: 8
                }
            ));
        }
    }

    #[tokio::test]
    async fn message_reader_does_not_consume_a_refused_payload() {
        // Nothing past the 5-byte header is read, so a bogus length cannot
        // make the reader pull an arbitrary number of bytes off the wire.
        let bogus = i32::MAX;
        let mut data = vec![b'd'];
        data.extend_from_slice(&bogus.to_be_bytes());
        data.extend_from_slice(b"payload bytes that must stay on the wire");
        let mut cursor = Cursor::new(&data[..]);

        let mut reader = MessageReader::new().with_max_message_size(8);
        assert!(reader.read(&mut cursor).await.is_err());
        assert_eq!(cursor.position(), 5);
    }

    #[tokio::test]
    async fn message_reader_reaches_the_oversized_verdict_across_a_cancelled_header() {
        use tokio::io::AsyncWriteExt;

        // 10_000-byte payload announced, against a limit of 8.
        let len = 4 + 10_000i32;
        let hdr = {
            let mut v = vec![b'd'];
            v.extend_from_slice(&len.to_be_bytes());
            v
        };

        let (mut client, mut server) = tokio::io::duplex(64);
        let mut reader = MessageReader::new().with_max_message_size(8);

        // Two of the five header bytes arrive, then the read is cancelled
        // while genuinely waiting for the rest.
        server.write_all(&hdr[..2]).await.unwrap();
        assert!(
            tokio::time::timeout(
                std::time::Duration::from_millis(50),
                reader.read(&mut client)
            )
            .await
            .is_err(),
            "expected the read to be waiting for the rest of the header"
        );

        // The rest arrives. If the first two bytes had been lost with the
        // dropped future, this read would mis-parse or block instead.
        server.write_all(&hdr[2..]).await.unwrap();
        let err = tokio::time::timeout(std::time::Duration::from_secs(5), reader.read(&mut client))
            .await
            .expect("reader lost the partial header and is still waiting")
            .unwrap_err();

        assert!(matches!(
            err,
            PgWireError::MessageTooLarge {
                payload_bytes: 10_000,
                limit_bytes: 8
            }
        ));

        // The verdict is terminal even though it was reached across a
        // cancellation: the payload arriving afterwards changes nothing.
        server.write_all(&[b'x'; 32]).await.unwrap();
        let err = reader.read(&mut client).await.unwrap_err();
        assert!(matches!(
            err,
            PgWireError::MessageTooLarge {
                payload_bytes: 10_000,
                limit_bytes: 8
            }
        ));
    }

    /// A CopyData frame of `len` payload bytes, each byte its offset mod 251.
    fn copy_data(len: usize) -> (Vec<u8>, Vec<u8>) {
        let payload: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
        let mut frame = vec![b'd'];
        frame.extend_from_slice(&((len + 4) as i32).to_be_bytes());
        frame.extend_from_slice(&payload);
        (frame, payload)
    }

    #[tokio::test]
    async fn an_oversized_copy_data_message_is_read_past_keeping_its_head() {
        let (mut data, payload) = copy_data(300_000);
        data.extend_from_slice(&[b'd', 0, 0, 0, 7]);
        data.extend_from_slice(b"abc");
        let mut cursor = Cursor::new(&data[..]);

        let mut reader = MessageReader::new()
            .with_max_message_size(1000)
            .skip_oversized_copy_data(16);
        match reader.read_frame(&mut cursor).await.unwrap() {
            Frame::Truncated(cut) => {
                assert_eq!(cut.tag, b'd');
                assert_eq!(cut.len, 300_000);
                assert_eq!(&cut.prefix[..], &payload[..16]);
            }
            other => panic!("expected a truncated frame, got {other:?}"),
        }
        // The stream goes on with the next message, whole.
        let next = reader.read(&mut cursor).await.unwrap();
        assert_eq!((next.tag, &next.payload[..]), (b'd', &b"abc"[..]));
    }

    #[tokio::test]
    async fn the_kept_head_is_capped_to_the_limit() {
        let (data, payload) = copy_data(500);
        let mut cursor = Cursor::new(&data[..]);
        let mut reader = MessageReader::new()
            .with_max_message_size(100)
            .skip_oversized_copy_data(10_000);
        match reader.read_frame(&mut cursor).await.unwrap() {
            Frame::Truncated(cut) => assert_eq!(&cut.prefix[..], &payload[..100]),
            other => panic!("{other:?}"),
        }
    }

    #[tokio::test]
    async fn read_refuses_a_message_read_past_but_stays_usable() {
        let (mut data, _) = copy_data(200);
        data.extend_from_slice(&[b'Z', 0, 0, 0, 5, b'I']);
        let mut cursor = Cursor::new(&data[..]);
        let mut reader = MessageReader::new()
            .with_max_message_size(100)
            .skip_oversized_copy_data(8);
        let err = reader.read(&mut cursor).await.unwrap_err();
        assert!(matches!(
            err,
            PgWireError::MessageTooLarge {
                payload_bytes: 200,
                limit_bytes: 100
            }
        ));
        let next = reader.read(&mut cursor).await.unwrap();
        assert!(next.is_ready_for_query());
    }

    #[tokio::test]
    async fn other_oversized_messages_are_still_refused_for_good() {
        // An ErrorResponse over the limit: not CopyData, so nothing to skip to.
        let mut data = vec![b'E', 0, 0, 0, 104];
        data.extend_from_slice(&[b'x'; 100]);
        let mut cursor = Cursor::new(&data[..]);
        let mut reader = MessageReader::new()
            .with_max_message_size(10)
            .skip_oversized_copy_data(8);
        for _ in 0..2 {
            assert!(matches!(
                reader.read_frame(&mut cursor).await,
                Err(PgWireError::MessageTooLarge {
                    payload_bytes: 100,
                    ..
                })
            ));
        }
        assert_eq!(cursor.position(), 5);
    }

    /// Reading past is cancellation-safe: the bytes arrive in pieces, and each
    /// read in between is cancelled while it waits.
    #[tokio::test]
    async fn reading_past_resumes_after_cancellation() {
        use tokio::io::AsyncWriteExt;

        let (frame, payload) = copy_data(200_000);
        let (mut writer, mut rd) = tokio::io::duplex(4096);
        let mut reader = MessageReader::new()
            .with_max_message_size(1000)
            .skip_oversized_copy_data(300);
        let feeder = tokio::spawn(async move {
            for piece in frame.chunks(7_777) {
                writer.write_all(piece).await.unwrap();
                tokio::time::sleep(std::time::Duration::from_millis(1)).await;
            }
            writer
                .write_all(&[b'd', 0, 0, 0, 6, b'o', b'k'])
                .await
                .unwrap();
            writer
        });
        let mut cancelled = 0;
        let cut = loop {
            match tokio::time::timeout(
                std::time::Duration::from_micros(300),
                reader.read_frame(&mut rd),
            )
            .await
            {
                Ok(frame) => break frame.unwrap(),
                Err(_) => cancelled += 1,
            }
        };
        assert!(cancelled > 0, "the read was never cancelled mid-message");
        match cut {
            Frame::Truncated(cut) => {
                assert_eq!(cut.len, 200_000);
                assert_eq!(&cut.prefix[..], &payload[..300]);
            }
            other => panic!("{other:?}"),
        }
        let next = reader.read(&mut rd).await.unwrap();
        assert_eq!(&next.payload[..], b"ok");
        drop(feeder.await.unwrap());
    }

    #[tokio::test]
    async fn message_reader_accepts_a_message_at_its_configured_limit() {
        let mut data = vec![b'd', 0, 0, 0, 12];
        data.extend_from_slice(b"12345678");
        let mut cursor = Cursor::new(&data[..]);

        let mut reader = MessageReader::new().with_max_message_size(8);
        let msg = reader.read(&mut cursor).await.unwrap();
        assert_eq!(&msg.payload[..], b"12345678");
    }

    #[test]
    fn message_reader_limit_cannot_be_raised_above_the_protocol_cap() {
        let reader = MessageReader::new().with_max_message_size(usize::MAX);
        assert_eq!(reader.max_payload, MAX_MESSAGE_SIZE);
    }

    #[tokio::test]
    async fn read_backend_message_rejects_oversized_message() {
        // length = MAX_MESSAGE_SIZE + 5 (over limit)
        let huge_len = (MAX_MESSAGE_SIZE as i32) + 5;
        let data = [
            b'Z',
            (huge_len >> 24) as u8,
            (huge_len >> 16) as u8,
            (huge_len >> 8) as u8,
            huge_len as u8,
        ];
        let mut cursor = Cursor::new(&data[..]);

        let err = read_backend_message(&mut cursor).await.unwrap_err();
        assert!(err.to_string().contains("too large"));
    }

    #[tokio::test]
    async fn write_ssl_request_produces_valid_bytes() {
        let mut buf = Vec::new();
        write_ssl_request(&mut buf).await.unwrap();

        assert_eq!(buf.len(), 8);
        // length = 8
        assert_eq!(&buf[0..4], &8i32.to_be_bytes());
        // SSL request code = 80877103
        assert_eq!(&buf[4..8], &80877103i32.to_be_bytes());
    }

    #[tokio::test]
    async fn write_startup_message_includes_params() {
        let mut buf = Vec::new();
        let params = [("user", "postgres"), ("database", "test")];
        write_startup_message(&mut buf, 196608, &params)
            .await
            .unwrap();

        // Should contain the parameter strings
        let s = String::from_utf8_lossy(&buf);
        assert!(s.contains("user"));
        assert!(s.contains("postgres"));
        assert!(s.contains("database"));
        assert!(s.contains("test"));

        // Length field should be at start
        let len = i32::from_be_bytes([buf[0], buf[1], buf[2], buf[3]]) as usize;
        assert_eq!(len, buf.len());
    }

    #[tokio::test]
    async fn write_query_produces_valid_message() {
        let mut buf = Vec::new();
        write_query(&mut buf, "SELECT 1").await.unwrap();

        // Should start with 'Q'
        assert_eq!(buf[0], b'Q');

        // Length should be correct (excludes tag byte)
        let len = i32::from_be_bytes([buf[1], buf[2], buf[3], buf[4]]) as usize;
        assert_eq!(len, buf.len() - 1);

        // Should contain the SQL
        assert!(buf[5..].starts_with(b"SELECT 1"));

        // Should be null-terminated
        assert_eq!(buf[buf.len() - 1], 0);
    }

    #[tokio::test]
    async fn write_password_message_produces_valid_message() {
        let mut buf = Vec::new();
        write_password_message(&mut buf, b"secret").await.unwrap();

        assert_eq!(buf[0], b'p');
        let len = i32::from_be_bytes([buf[1], buf[2], buf[3], buf[4]]) as usize;
        assert_eq!(len, buf.len() - 1);
        assert_eq!(&buf[5..], b"secret");
    }

    #[tokio::test]
    async fn write_copy_data_produces_valid_message() {
        let mut buf = Vec::new();
        write_copy_data(&mut buf, b"payload").await.unwrap();

        assert_eq!(buf[0], b'd');
        let len = i32::from_be_bytes([buf[1], buf[2], buf[3], buf[4]]) as usize;
        assert_eq!(len, buf.len() - 1);
        assert_eq!(&buf[5..], b"payload");
    }

    #[tokio::test]
    async fn write_copy_done_produces_valid_message() {
        let mut buf = Vec::new();
        write_copy_done(&mut buf).await.unwrap();

        assert_eq!(buf.len(), 5);
        assert_eq!(buf[0], b'c');
        // Length = 4 (just the length field itself, no payload)
        assert_eq!(&buf[1..5], &4i32.to_be_bytes());
    }

    #[test]
    fn backend_message_helper_methods() {
        let error = BackendMessage {
            tag: b'E',
            payload: Bytes::new(),
        };
        assert!(error.is_error());
        assert!(!error.is_ready_for_query());

        let ready = BackendMessage {
            tag: b'Z',
            payload: Bytes::from_static(b"I"),
        };
        assert!(ready.is_ready_for_query());
        assert!(!ready.is_error());

        let copy_both = BackendMessage {
            tag: b'W',
            payload: Bytes::new(),
        };
        assert!(copy_both.is_copy_both_response());

        let copy_data = BackendMessage {
            tag: b'd',
            payload: Bytes::new(),
        };
        assert!(copy_data.is_copy_data());

        let auth = BackendMessage {
            tag: b'R',
            payload: Bytes::new(),
        };
        assert!(auth.is_auth_request());
    }
}
