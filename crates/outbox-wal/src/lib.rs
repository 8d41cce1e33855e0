//! # outbox-wal
//!
//! WAL mode: the relay reads committed events from PostgreSQL's write-ahead log through logical
//! replication (the way Debezium does, without the JVM) instead of polling the outbox table.
//! Delivery starts within a millisecond or two of the commit, the table is never scanned, and
//! events can even skip the table altogether.
//!
//! ```no_run
//! # async fn demo(sink: std::sync::Arc<dyn outbox_types::Sink>) -> Result<(), outbox_wal::WalError> {
//! use outbox_wal::{WalConfig, WalRelay};
//! let config = WalConfig::new("postgres://relay@db:5432/app"); // slot and publication `outbox_wal`
//! let report = WalRelay::new(config, sink) // the relay's settings: `.with_relay(RelayConfig)`
//!     .run(async { tokio::signal::ctrl_c().await.ok(); })
//!     .await?;
//! println!("delivered {} (duplicates {})", report.delivered, report.duplicates);
//! # Ok(()) }
//! ```
//!
//! ## One engine, two sources
//!
//! WAL mode has no delivery engine of its own. [`WalSource`] is a
//! [`Source`](outbox_types::Source) of the relay engine (`outbox_engine::Relay`), the same engine
//! polling mode runs over the table: batching, per-aggregate order, per-destination lanes and
//! cooldown, retries and backoff, dead letters under `block` or `skip`, `outbox pause`,
//! metrics and graceful shutdown are one implementation, configured by one `RelayConfig`
//! (`[relay]` in the CLI). What is WAL mode's own stays here: the slot, decoding, the
//! position to confirm, standby and heartbeats.
//!
//! Each claim takes its events from one of two places:
//! - **the stream**: events decoded from the WAL, handed to the engine without writing anything
//!   to claim them. A writer task marks delivered rows in batches (one `UPDATE`, or a `DELETE`
//!   with `delete_on_ack`), and the slot's position moves past them only once that committed.
//! - **the table**: claims like the polling relay's, under a lease, for what the table owns: a
//!   failed event (its retry is written to its row, or a message is inserted as a row) and
//!   every later event of its aggregate, a dead event under `block` and what follows it, events
//!   of a paused destination, rows requeued (`outbox dead requeue`) or replayed, and rows left
//!   undelivered when a session starts that the stream will not send again (`catch_up`; see
//!   "The catch-up"). Table claims never take a row the stream
//!   holds, and a row the table claimed is checked before the stream would publish it again.
//!
//! So a destination that is down costs neither memory nor WAL: its events go to the table and
//! the slot keeps moving for everything else; when it is back, table claims deliver them in
//! order. See the `state` module for the rules that keep per-aggregate order across the two.
//!
//! ## Library API (what the `outbox` CLI calls)
//!
//! - [`WalConfig`] — `serde`, `deny_unknown_fields`, durations like `500ms`: what only WAL mode
//!   needs. The CLI fills `database_url`, `schema` and `table` from its `[database]` section.
//! - [`WalSource::start`]`(config, store, &relay_config)` → a source for
//!   `outbox_engine::Relay::new(source, sink, relay_config)`; [`WalSource::shutdown`] after the
//!   relay returned → [`WalReport`] or the [`WalError`] that stopped the stream.
//! - [`WalRelay`]: the same in one call, for library users.
//! - [`wal_status`] / [`wal_status_sampled`] → [`WalStatus`]: slot lag bytes
//!   (`pg_current_wal_lsn() - confirmed_flush_lsn`), retained WAL, confirmed (last acked) LSN,
//!   decode rate.
//! - [`recover`] after a lost or invalidated slot; [`drop_slot`] when leaving WAL mode.
//! - [`message_source_access`]: who may write events as logical messages, and the statements
//!   that restrict it; [`check_replication_connection`]: whether the replication session
//!   connects and is encrypted. `outbox wal prepare` prints both.
//! - Writers: [`PgOutbox::enqueue`](outbox_postgresql::PgOutbox::enqueue) (table source) or
//!   [`enqueue_message`] (message source), both inside the caller's transaction.
//!
//! ## Capture sources
//!
//! - **table** ([`Source::Table`], the default): inserts into the outbox table, through a
//!   publication on that table with `publish = 'insert'`. The row is the durable record: it is
//!   marked `delivered` (one `UPDATE` per batch) or `dead`, so `outbox status` and
//!   `outbox dead …` keep working. Who may write events is who may `INSERT` into the table.
//! - **messages** ([`Source::Messages`], opt-in): [`enqueue_message`] writes the event with
//!   `pg_logical_emit_message(true, 'outbox', <json envelope>)`. It commits or rolls back with the
//!   transaction and never becomes a row, so there is nothing to update, delete or vacuum. A dead
//!   message event is inserted into the outbox table as a `dead` row, where
//!   `outbox dead list/retry` finds it. Event `seq` is the message's LSN.
//!
//! - **stream table** ([`Source::StreamTable`], opt-in): inserts into `<schema>.<table>_stream`
//!   ([`enqueue_streamed`], or a plain `INSERT`; [`stream_table_ddl`] is its definition, created
//!   when missing at start and by [`prepare`], and added to the publication). The table has the
//!   event columns and a primary key only, and nobody updates it: its events are handled like
//!   messages (`seq` is the insert's LSN; nothing is written back when one is delivered; one that
//!   fails, waits or dies is copied into the outbox table as a row). So an insert costs what a
//!   hand-written outbox table's does, and the relay's database work per event is decoding, not a
//!   row update: measured below. Unlike a message, the event also stays as a row (purged
//!   by age: [`purge_stream_table`], which `outbox relay` runs with `retention.delivered`), and any
//!   role with `INSERT` on that table may write events, like the outbox table. Its `headers`
//!   are checked at insert as the outbox table's are (a JSON object of strings, no name under
//!   the reserved prefix `outbox-` but `outbox-partition`: the trigger
//!   `<table>_stream_header_rules`). An event copied into the outbox table keeps its headers
//!   without reserved names (which no sink sends), since that table refuses them.
//! - **debezium** ([`Source::Debezium`], opt-in): inserts into a Debezium outbox table as
//!   services that ran Debezium's Outbox Event Router write it (default `public.outbox`:
//!   `id`, `aggregatetype`, `aggregateid`, `type`, `payload`), read with the router's own
//!   options in [`DebeziumTable`] (`[wal.debezium]`) and shaped as the router shapes them —
//!   topic, typed key, payload as a string or expanded (bounded by `relay.max_payload_bytes`,
//!   measured before it is built), `header`/`envelope`/`partition` placements, tombstones, the
//!   context headers and the timestamp, carried in the `__outbox.debezium` header
//!   (`outbox_types::routing::DebeziumRecord`). Handled like the stream table (nothing written
//!   back; failures copied into the outbox table, the record with them); deletes
//!   are ignored (insert + delete in one transaction works), updates follow
//!   `table.op.invalid.behavior`. Pair it with `format = "debezium"` on the destinations for
//!   consumers that read Debezium's messages; `docs/from-debezium.md` is the migration guide.
//!
//! All share the slot and are delivered in commit order. Three things to know about messages:
//! - **who may write them.** PostgreSQL lets every role (PUBLIC) execute
//!   `pg_logical_emit_message`, and a message needs no privilege on any table: with the message
//!   source on, any role that can log in — a reporting user, a read-only application role — could
//!   publish arbitrary events to every destination. The relay authenticates messages by the
//!   database's own privileges: at the start of every session (start, reconnect, takeover) it
//!   checks every overload of the function in `pg_proc` (PostgreSQL 17 added ones with a `flush`
//!   argument) and refuses to start ([`WalError::ServerSetup`], with the statements) while PUBLIC
//!   may execute any of them. Run once per database, as a superuser:
//!   ```sql
//!   REVOKE EXECUTE ON FUNCTION pg_logical_emit_message(boolean, text, bytea) FROM PUBLIC;
//!   REVOKE EXECUTE ON FUNCTION pg_logical_emit_message(boolean, text, text) FROM PUBLIC;
//!   -- PostgreSQL 17+: the same for the (…, boolean) overloads
//!   GRANT EXECUTE ON FUNCTION pg_logical_emit_message(boolean, text, bytea) TO app_writer, outbox_engine;
//!   ```
//!   `outbox wal prepare` prints these statements for the server at hand, and `outbox wal status`
//!   ([`WalStatus::message_source`], [`message_source_access`]) shows who may write. Grant the
//!   function as you would grant `INSERT` on the outbox table: a role that may call it may
//!   publish any event. The relay's own role needs it too, for its heartbeats (superusers always
//!   may); without it heartbeats are turned off with a warning, and a drain
//!   (`stop_when_caught_up`) refuses to start. A signed envelope was the alternative; it was
//!   not taken because its key would have to live in every writer's configuration, while the
//!   privilege check needs nothing new and treats both sources alike.
//! - **with the source off**, the relay does not ask the server for messages at all (the
//!   replication session starts without `pgoutput`'s `messages` option), so a message never
//!   reaches it, whoever wrote it and however large it is: the transaction that carries only a
//!   message is not even sent, and the confirmed position moves past it with the next
//!   keepalive. Turn the source on before writers switch to [`enqueue_message`]; what they write
//!   before is not delivered.
//! - they are database-wide: every slot in the database sees every message. Outboxes sharing a
//!   database need distinct `message_prefix`es (the relay ignores other prefixes). And a
//!   message is captured only if the slot already existed when it was written: create the slot
//!   ([`prepare`], or one start of the relay) before writers switch to [`enqueue_message`].
//!
//! ## Records too large
//!
//! Whoever may insert into a captured table (or, with the message source on, call
//! `pg_logical_emit_message`) decides how large a record of the WAL is; the relay's
//! `relay.max_payload_bytes` (16 MiB) and `relay.max_metadata_bytes` (64 KiB: every column but
//! the payload together) decide what it reads. Every record is checked against them before it
//! is buffered or decoded:
//!
//! - **On the wire.** A record larger than `max_payload_bytes + max_metadata_bytes` (twice that
//!   with the message source on: a message's payload travels as an escaped JSON string) plus
//!   64 KiB of framing is read past by the replication client: it keeps the first
//!   `max_metadata_bytes + 64 KiB` (the XLogData header, the `pgoutput` message kind, the
//!   relation, the leading columns and the payload's length) and drops the rest as it arrives,
//!   64 KiB at a time. So one record of any size costs that much memory, and the slot moves past
//!   it. (The client is `pgwire-replication` 0.5 with a small patch kept in
//!   `vendor/pgwire-replication`, see its `PATCHES.md`: 0.5 refuses such a record for good and
//!   leaves it on the wire, so every reconnect read the same record and the slot never moved.)
//! - **Per column.** A row within that whose payload column is over `max_payload_bytes`, or
//!   whose other columns (in text form) take more than `max_metadata_bytes` together, is
//!   dead-lettered without being decoded; so is a message whose decoded payload or other fields
//!   are. One check, on the `pgoutput` tuple, for the outbox table, the stream table and a
//!   Debezium table alike.
//!
//! What becomes of such a record: an outbox table row is marked `dead` by the `seq` its first
//! bytes hold, with a reason that names the limit and the size (`outbox dead requeue` after
//! raising the limit delivers it: the row keeps it). A row of the stream table or a Debezium
//! table, which no outbox row holds, is copied into the outbox table as a `dead` row in a form
//! that table can hold: its id and aggregate when they could be read, `null` as its payload,
//! long fields cut with a marker, and the original sizes in `last_error` (the row itself stays
//! in its table; requeueing the copy would deliver the cut fields, and its reason says so). A
//! message within the wire bound is dead the same way; a message too large to read at all is
//! counted ([`WalReport::messages_unreadable`], the metric
//! `outbox_wal_messages_unreadable_total`) and logged with its position and size, never its
//! content: nothing of it was kept. An outbox row whose `seq` is not among the bytes kept
//! (possible only with a table whose first columns are large) is logged and left pending: the
//! table claim of the next session's catch-up dead-letters it without loading it.
//!
//! A copy into the outbox table (a failed, waiting or dead event of a message, the stream table
//! or a Debezium table) is never retried forever for its data: when the table refuses a row
//! (SQLSTATE class 22, 23 or 54, such as a btree index row over its size limit, or a trigger's
//! refusal) it is written as a dead row in cut form (fields cut, then also without payload and
//! headers), the refusal and the original sizes in `last_error`, and the position moves past
//! it. Connection losses, serialization failures and lock timeouts are retried as before.
//!
//! ## Memory
//!
//! [`memory_bound`] gives an upper bound of a WAL-mode relay's memory from its settings, the
//! polling relay's being `outbox_engine::memory::bound`. Write `W` for the wire bound above
//! (`k × (max_payload_bytes + max_metadata_bytes) + 64 KiB`, `k` = 2 with the message source
//! on, else 1), `E = max_payload_bytes + max_metadata_bytes` for one event, and
//! `batch = max_batch_bytes + E` for one batch (events are added while the whole events before
//! them add up to less than `max_batch_bytes`):
//!
//! | part | bound | defaults (`sources = ["table"]`) |
//! |---|---|---|
//! | base: binary, runtime, pools, TLS (measured 10–58 MB) | 64 MiB | 64 MiB |
//! | replication: the record being read, the client's channel (a quarter of `max_buffered_bytes`, 1–8 MiB, or one record), the record being decoded and its event, buffers | `3 W + max(W, channel) + 1 MiB` | 65.5 MiB |
//! | stream: events decoded and not settled, and the copy a message or insert-only table's event keeps for the table | `2 × (max_buffered_bytes + E)` | 96.1 MiB |
//! | publishing: the batches alive (`max_batches_in_flight`, four times that with several destinations), each held about six times over by the sink | `6 × batch × batches` | 288.4 MiB |
//! | **total** | | **514.0 MiB** (578.3 MiB with messages) |
//!
//! The terms are worst cases that do not all happen at once (a batch's events are also the
//! stream's), so the bound is loose; `deploy/kubernetes/relay.yaml` sets its memory limit above
//! it. Measured on 2026-11-28 with the records of issue 41 (the `outbox` binary's `VmHWM`, as
//! the hostile suite's `wal_records` cases print it): a 4 MB logical message, 3 MB and
//! 1.2 MiB outbox and stream table rows and a 96 KB aggregate id, with 1 MiB limits: 37–41 MiB
//! (the relay before: 48–55 MiB, each record read whole); a 300 MB outbox row, and a 300 MB
//! logical message under the message source, with the defaults: 37 MiB each, the slot past them
//! within a second of the server sending them (before: 533 MB for a 250 MB message, and the
//! slot never moved: 628 MB of WAL retained two minutes after a 300 MB message and row). Under
//! `sources = ["table"]` the server does not send such a message at all.
//!
//! ## Malformed rows and messages
//!
//! A row that cannot be read as an event — headers that are not a JSON object of strings, a NULL
//! required column, an `id` that is not a UUID, a payload that is not JSON (possible in a
//! hand-altered table), anything the decoder refuses — is dead-lettered at once, whether it is
//! streamed or claimed from the table, with a `last_error` that names the column and the fix:
//! the text the polling relay writes for the same row (`outbox_types::bury_malformed`). It never
//! fails a claim or stops the relay; under `block` it holds its aggregate back like any dead
//! event (when its aggregate can be read); the position moves past it
//! once its `dead` mark is written, so a restart neither redelivers nor revives it. A message
//! with the prefix that is not a valid envelope becomes a `dead` row the same way: its content
//! is the row's payload, its id is derived from the slot and the LSN (one row however often the
//! message is re-sent), and what can be read of it (aggregate, event type) is kept.
//!
//! `seq` of a table event is its row's primary key; of a message event, its LSN. Both grow in
//! commit order within one aggregate *per source*; do not compare a table `seq` with a message
//! `seq`.
//!
//! ## Delivery guarantees and how they are kept
//!
//! - **Only committed events.** pgoutput (protocol 1) sends a transaction only after it
//!   committed; rolled-back ones never appear.
//! - **At least once, never lost.** The slot's confirmed position is moved only past a
//!   transaction once every event in it *and in every earlier transaction* is settled: acked by
//!   the sink and marked delivered, dead-lettered, or handed to the table durably (its retry
//!   written to its row, a message inserted as a row). After a crash PostgreSQL re-sends
//!   everything after that position: duplicates, never gaps. The position reaches the server
//!   in standby status updates every `status_interval`.
//! - **Per-aggregate order** is commit order. An aggregate has events out in at most one place:
//!   the stream hands out its next event only after the previous one settled, and once the
//!   table owns an aggregate every newer event of it goes to the table too, behind the older
//!   ones. An event requeued or replayed by an operator makes its aggregate the table's when a
//!   table claim takes it (within one poll interval); an event of that aggregate the stream
//!   delivers in that interval goes first.
//! - **Bounded memory.** Past `max_buffered_events` / `max_buffered_bytes` the stream stops
//!   reading; the replication client's buffer (bounded by events and by bytes) and TCP carry
//!   the backpressure to the walsender (which keeps getting status updates, so it does not time
//!   out). A destination that is down does not fill memory: its events go to the table. No
//!   record is held larger than the record limits allow (see "Records too large" below), and
//!   [`memory_bound`] gives the bound of the whole relay (see "Memory").
//! - **Dead letters.** A rejected event, or one out of attempts per
//!   [`RetryPolicy`](outbox_types::RetryPolicy), is dead in the table (a message is inserted as a
//!   `dead` row). Under `dead_letter = "block"` (the default, as in polling mode) the later
//!   events of its aggregate wait in the table behind it; under `skip` they go on. A requeued
//!   dead event (`outbox dead requeue`) is delivered by the next table claim, while the relay
//!   streams.
//! - **Heartbeats.** Every `heartbeat_interval` the relay writes an empty transactional logical
//!   message (prefix `outbox.heartbeat`); its commit gives an idle outbox a position to confirm,
//!   so a slot on a busy cluster does not retain WAL forever. Keepalives with nothing
//!   outstanding are confirmed too.
//! - **`delete_on_ack`** (`retention.delivered = "0s"`): delivered rows are deleted instead of
//!   marked. (`mark_delivered = false`, which left them pending, is gone: every start delivered
//!   them all again.)
//!
//! ## TLS
//!
//! The replication session carries every payload, so it is encrypted like the pool: `sslmode`
//! defaults to `prefer` (TLS when the server offers it), and `sslmode`, `sslrootcert`,
//! `sslcert`/`sslkey` in the URL, or `PGSSLMODE`, `PGSSLROOTCERT`, `PGSSLCERT`/`PGSSLKEY`,
//! apply to both connections, read as libpq reads them. `allow` is read as `prefer` (the client
//! cannot retry a refused plain session with TLS, and `prefer` protects at least as much);
//! `verify-ca`/`verify-full` without a root certificate trust the Mozilla root set where libpq
//! would refuse; `verify-full` to an IP address checks the certificate's IP entries. A
//! certificate that does not verify is [`WalError::Config`] naming `sslrootcert`, not a
//! reconnect loop. [`check_replication_connection`] (run by `outbox wal prepare`) reports
//! whether the server sees the session encrypted. Use `verify-full` where the network is not
//! trusted: `prefer` and `require` stop eavesdroppers, not an active man in the middle.
//!
//! ## One streamer per slot, standby and takeover
//!
//! An instance streams only while it holds a session-level advisory lock for the slot on a
//! dedicated connection. Others stand by, trying every `standby_poll_interval`. PostgreSQL drops
//! the lock when the holder's connection ends — also when its process is killed — and the
//! standby then starts streaming, retrying for up to `takeover_timeout` while PostgreSQL still
//! reports the slot active for the dead walsender. PostgreSQL's own rule (one active session
//! per slot) is the final fence.
//!
//! ## Slot lifecycle
//!
//! At start the relay checks `wal_level = logical`, `max_replication_slots`,
//! `max_wal_senders` and the role's `REPLICATION` attribute ([`WalError::ServerSetup`] says
//! what to change), creates the publication and then the slot if missing (`create_slot`), and
//! records the slot in `<schema>.<table>_wal_slots`. A slot that is missing although recorded
//! there is [`WalError::SlotLost`]; one PostgreSQL invalidated (`wal_status = 'lost'`) is
//! [`WalError::SlotInvalidated`]. Both need [`recover`]: it drops an invalidated slot, creates a
//! new one (from then on every commit is captured), and delivers the undelivered outbox rows
//! (the catch-up, as a drain), after which [`WalRelay::run`] resumes streaming. Table events survive a lost
//! slot; message events that were not yet delivered do not (they existed only in the WAL), nor do
//! undelivered events of the stream table (their rows carry no delivery state to rescan by).
//!
//! ## The catch-up
//!
//! With `catch_up` (default), when a session starts (start, reconnect, takeover) the rows still
//! undelivered in the table that the stream will not send again are the table's: table claims
//! deliver them, in `seq` order per aggregate, with every check a polling claim makes (paused
//! destinations, dead events under `block`, payload limits), and newer events of their
//! aggregates wait behind them. Every other undelivered row committed after the slot's
//! confirmed position, and the stream, which sends it again, delivers it: a backlog left by a
//! relay that stopped (a deploy, an outage, a crash) drains at stream speed, not at the speed
//! of table claims.
//!
//! Which is which the slot's **table watermark** says, kept beside the slot in
//! `<table>_wal_slots`: every table row committed before the confirmed position has a `seq` at
//! or below it. It is set when the slot is created (the highest `seq` then) and raised by the
//! streaming relay, over every table row it decoded, before it confirms a position past them
//! (one `UPDATE` per confirmation, at most every `status_interval / 4`). So an undelivered row
//! at or below it is one the stream passed (handed to the table: a retry, a paused destination,
//! behind a failure) or one from before the slot (a switch from polling, `outbox wal recover`),
//! and one above it committed after the confirmed position. A slot the relay did not create
//! has no watermark: every undelivered row at start is the table's, as before. Rows the stream
//! sends again that a table claim settled are skipped.
//!
//! While streaming, the table is claimed from every poll interval as long as it owns an
//! aggregate (a retry waiting for its backoff, a dead event under `block`, events behind them);
//! otherwise it is only asked, once a second and off the claim path, whether anything became due
//! (an operator's `outbox dead requeue` or `replay`, a lease that ran out), and claimed from when it
//! has.
//!
//! ## Switching modes on a live outbox
//!
//! Polling → WAL (tested in `tests/wal.rs`, `mode_switch_polling_wal_polling`):
//! 1. Create the slot while the polling relay still runs ([`prepare`]); from this moment every
//!    commit is in the slot.
//! 2. Stop the polling relay (it releases its claims).
//! 3. Start the relay in WAL mode: the catch-up delivers what the poller left, then it streams.
//!
//! WAL → polling:
//! 1. If writers use [`enqueue_message`], switch them to `PgOutbox::enqueue` first (a poller
//!    cannot see messages).
//! 2. Stop the WAL relay with a drain (`outbox relay --drain`, the relay's `stop_when_idle`):
//!    it returns when everything committed before its start is delivered and marked.
//! 3. Start the polling relay; it delivers every row still `pending`.
//! 4. [`drop_slot`], so the server stops retaining WAL for it.
//!
//! Nothing is lost either way; events delivered by one mode whose `delivered` mark the other
//! did not see are delivered again and counted ([`WalReport::duplicates`]).
//!
//! ## A race the relay has to absorb
//!
//! PostgreSQL writes a transaction's commit record — which is what lets logical decoding send it
//! — a moment before the transaction becomes visible to new snapshots. The relay can deliver an
//! event and try to mark its row `delivered` before the row is visible; that `UPDATE` matches
//! nothing. The write-back retries rows that were neither updated nor found done, briefly,
//! before confirming anything (see `db::update_visible`).
//!
//! ## Performance
//!
//! `examples/wal_bench.rs` runs the relay in a child process (its own CPU time and peak RSS) on
//! a current-thread tokio runtime, 400-byte payloads, 1000 aggregates, batches of 1000, 4 in
//! flight, on the 2-core development machine with PostgreSQL (the throwaway `wal_level=logical`
//! cluster, `synchronous_commit=on`). Since the WAL engine became a source of the relay engine,
//! measured on 2026-11-25 side by side with the last build of the separate WAL engine
//! (`998c601^`), alternating runs in the same hour, to the in-process channel sink:
//!
//! | scenario | one engine (this crate) | the former WAL engine |
//! |---|---|---|
//! | drain 100k, table rows (3 runs) | 48–56k events/s, 6.1–8.8 µs CPU/event, 27–32 MB | 53–59k events/s, 6.2–7.3 µs/event, 17–18 MB |
//! | drain 100k, logical messages (3 runs) | 80–111k events/s, 5.9–9.5 µs/event, 21–28 MB | 80–90k events/s, 6.6–7.8 µs/event, 14 MB |
//! | drain 100k, table rows, `delete_on_ack` (former: `mark_delivered = false`) | 58k events/s, 8.9 µs/event, 16 MB | 58k events/s, 6.4 µs/event, 16 MB |
//! | 500 events/s, table rows, 8 writers (2 runs) | commit→sink p50 0.19–0.26 ms, p99 0.87–1.19 ms; 58–80 µs CPU/event; 10 MB | p50 0.21–0.23 ms, p99 1.15–1.65 ms; 64–90 µs/event; 10 MB |
//!
//! The same drain on 2026-11-26 (two runs each, the same hour), with PostgreSQL's CPU from
//! `/proc` (the postmaster and its children, walsender included):
//!
//! | source | events/s | relay µs CPU/event | PostgreSQL µs CPU/event |
//! |---|---|---|---|
//! | outbox table, rows marked delivered | 34–73k | 4.2–4.8 | 15.1–19.3 |
//! | outbox table, `delete_on_ack` | 83–88k | 5.1–5.2 | 10.3–11.2 |
//! | stream table (nothing written back) | 99–106k | 5.1–5.5 | 6.8–7.1 |
//! | logical messages | 94–139k | 3.8–4.4 | 3.2–4.2 |
//!
//! Earlier figures of the former engine on this machine (2026-11-23: 133k events/s for table
//! rows, 242k for messages) are not reproduced by the same binary today (53–59k and 80–90k);
//! compare within one session only. Two things kept the one engine from this parity at first:
//! each claim rebuilt the whole list of waiting events (now one queue per aggregate and an
//! ordered set of the aggregates that may go, so a claim costs what it takes), and a claim query
//! on the idle table every poll interval in front of the stream's claims (p99 4 ms at 500/s; now
//! an idle table is only asked, off the claim path, once a second whether anything is due). The
//! rest of the CPU difference is the engine's per-batch work (futures, lanes, settlement) and
//! the copy of each logical message kept to hand it back as a row if it fails.
//!
//! At a trickle the CPU per event is the fixed cost of waking up per transaction (the socket
//! read, the replication worker's channel hand-off, the session task, the sink call: runtime
//! park/unpark and syscalls), not decoding; it falls to 5–6 µs as transactions batch up. A
//! multi-threaded runtime costs more per event at low rates (measured 62 µs vs 41 µs at
//! 1,000/s): every hand-off between tasks becomes a cross-thread wakeup. `wal_bench` runs its
//! relay child on one thread, and so does `outbox relay` unless `--worker-threads N`
//! (`OUTBOX_WORKER_THREADS`) asks for a pool of N workers.
//! Measured on 2026-11-27, table rows, alternating runs on this 2-core machine: at 2,000/s
//! 39.5–40.2 µs per event on one thread against 63.7–66.5 µs on two workers (p99 2.2–4.0 ms
//! against 4.1–11.7 ms); a 100k drain 60k events/s at 6.5 µs per event on one thread against
//! 52k/s at 8.5 µs on two. The shipped binary, measured the same day with
//! `scripts/bench-relay-runtime.sh steady wal 2000 20` (pgbench writers, Redis sink): 95–104 µs
//! per event on one thread, 122–138 µs on two workers. The gap to `wal_bench` is the sink's
//! round trip per batch: at a trickle every event is a batch of its own.
//!
//! What that fixed cost is made of, at 2,000 single-event transactions/s (`wal_bench latency
//! --rate 2000`, `perf` and `strace -c` on the relay child): about 40 % kernel time, most of it
//! the thread sleeping in and waking from `epoll_wait` once per transaction; one `recvfrom` per
//! transaction and the TLS record it carries; then decoding, the engine's claim and batch, and
//! the write-back. Three things were cut on 2026-11-26: each claim made a UUID v7, and empty
//! claims too, at up to two `getrandom` syscalls each (now `uuid`'s thread-local generator,
//! and no token for an empty claim); every ack woke the stream task to confirm a position its
//! timer confirms anyway; and marking delivered rows every 20 ms cost one `UPDATE … RETURNING`
//! of about 40 rows, 13 % of the relay's CPU (now every 100 ms when only delivered rows wait).
//! Measured in one quiet half-hour, alternating runs of the binaries before and after: table
//! rows 41.0–41.5 → 33.8–37.0 µs per event, stream table 39.8–42.8 → 38.2–41.2 µs per event.
//! TLS to the server costs about 5 µs per event of it (`sslmode=disable`: 35–36.5 µs, table
//! rows), and the walsender about 2.5 µs per event of PostgreSQL's CPU in a drain.
//!
//! ## Why pgwire-replication
//!
//! The workspace builds a patched copy of it (`vendor/pgwire-replication`, through
//! `[patch.crates-io]`; its `PATCHES.md` lists the changes, each opt-in and written to be
//! offered upstream): reading past a record over its size limit instead of ending the stream,
//! the `messages` option, an event channel bounded by bytes. No release has them yet (0.5.0
//! is the newest), and a client of our own would be far more code to own than a patch of four
//! small changes. Two Rust clients were considered. `pgwire-replication` (0.5) speaks the wire protocol
//! directly on tokio, with rustls (ring) and SCRAM, and was designed for exactly this: explicit
//! start and ack LSNs, a bounded event channel with real backpressure while still sending
//! standby status updates, `pg_logical_emit_message` support, `wait_started` to know when the
//! slot is held. `pg_walstream` offers more (physical replication, streaming of in-progress
//! transactions, protocol v2–4), but its default TLS backend builds aws-lc (a C/CMake build,
//! slow on 2-core CI) and older versions need libpq and libclang; it also owns more of the
//! LSN bookkeeping that this crate must control itself. The Relation/Insert parts of pgoutput
//! that pgwire-replication leaves raw are parsed here (`pgoutput` module).
//!
//! ## Test cluster
//!
//! The shared PostgreSQL of the development machines runs with `wal_level = replica`; the tests
//! use `scripts/pg-logical.sh start` (a throwaway cluster on port 54329 with
//! `wal_level = logical`, TLS with a generated CA, and `pg_logical_emit_message` revoked from
//! PUBLIC in database `outbox`), or `OUTBOX_WAL_TEST_URL` (the TLS tests are then skipped, and
//! that database needs the same `REVOKE` for the message-source tests).

mod config;
mod conn;
mod counters;
mod db;
mod debezium;
mod error;
mod limits;
mod lsn;
mod memory;
mod message;
mod pgoutput;
mod slot;
mod source;
mod state;
mod stream;
mod stream_table;

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use outbox_engine::{Relay, RelayConfig};
use outbox_postgresql::{PgOutbox, PgStore};
use outbox_types::Sink;
use outbox_types::route::RouteTable;
use serde::Serialize;
use sqlx::PgPool;

pub use config::{Source, WalConfig};
pub use conn::{ReplicationConnection, SslMode};
pub use counters::{WalCounters, WalReport};
pub use debezium::{DebeziumTable, InvalidOp, debezium_table_ddl};
pub use error::WalError;
pub use lsn::Lsn;
pub use memory::{MemoryBound, memory_bound};
pub use message::{
    DEFAULT_PREFIX, EnqueuedMessage, encode_envelope, enqueue_message, enqueue_messages,
};
pub use slot::{MessageSourceAccess, WalStatus, stream_table_ddl};
pub use source::WalSource;
pub use stream_table::{enqueue_streamed, purge_stream_table};

use conn::Target;

/// WAL mode in one call: a [`WalSource`] under the relay engine (`outbox_engine::Relay`), for a
/// library user who wants `run` and a report. The `outbox` CLI does the same with its own
/// routes and metrics.
///
/// The relay's settings (batch size, retries, dead-letter policy, publish timeout, lanes and
/// cooldown, `--drain`) are one [`RelayConfig`], the same as in polling mode
/// ([`WalRelay::with_relay`]); [`WalConfig`] holds only what is WAL mode's own.
pub struct WalRelay {
    config: WalConfig,
    relay: RelayConfig,
    sink: Arc<dyn Sink>,
    routes: Option<Arc<RouteTable>>,
    counters: Arc<WalCounters>,
}

impl WalRelay {
    /// A relay for `config` delivering to `sink`, with the default relay settings.
    pub fn new(config: WalConfig, sink: Arc<dyn Sink>) -> Self {
        WalRelay {
            config,
            relay: RelayConfig::default(),
            sink,
            routes: None,
            counters: Arc::new(WalCounters::default()),
        }
    }

    /// The engine's settings, shared with polling mode.
    pub fn with_relay(mut self, relay: RelayConfig) -> Self {
        self.relay = relay;
        self
    }

    /// Several destinations: see `outbox_engine::Relay::with_routes`.
    pub fn with_routes(mut self, routes: Arc<RouteTable>) -> Self {
        self.routes = Some(routes);
        self
    }

    /// Live counters of the stream, readable while [`WalRelay::run`] is going.
    pub fn counters(&self) -> Arc<WalCounters> {
        self.counters.clone()
    }

    /// Run until `shutdown` completes (or, with the relay's `stop_when_idle`, until everything
    /// committed before the start is delivered), then finish in-flight batches, write back and
    /// confirm what was delivered, and return what was done.
    ///
    /// The instance first becomes the slot's streamer (a standby waits while another instance
    /// streams). Database and replication outages do not end the run: it reconnects with
    /// backoff and resumes from the confirmed position. It returns an error for what needs a
    /// person: bad configuration, a server not set up for logical replication, a lost or
    /// invalidated slot (see [`recover`]).
    pub async fn run<F>(self, shutdown: F) -> Result<WalReport, WalError>
    where
        F: Future<Output = ()> + Send,
    {
        let WalRelay {
            config,
            relay,
            sink,
            routes,
            counters,
        } = self;
        config.validate()?;
        let outbox = PgOutbox::with_names(&config.schema, &config.table)?;
        let target = Target::parse(&config.database_url)?;
        let pool = target.pool(&config.database_url, 4).await?;
        let store = PgStore::new(pool, outbox).with_delete_on_ack(config.delete_on_ack);
        let source = Arc::new(WalSource::start_with(config, store, &relay, counters).await?);
        let mut engine = Relay::new(source.clone(), sink, relay);
        if let Some(routes) = routes {
            engine = engine.with_routes(routes);
        }
        let report = engine.run(shutdown).await;
        let mut wal = source.shutdown().await?;
        wal.delivered = report.delivered;
        wal.retried = report.retried;
        wal.dead = report.dead;
        Ok(wal)
    }
}

/// Check `config`, open a pool of at most `connections` to its database, run `f` on it (and
/// `config`) and close the pool, whatever `f` returned: the one-shot calls below hold no
/// connection after.
async fn with_pool<T>(
    config: &WalConfig,
    connections: u32,
    f: impl AsyncFnOnce(&PgPool, &WalConfig) -> Result<T, WalError>,
) -> Result<T, WalError> {
    config.validate()?;
    let target = Target::parse(&config.database_url)?;
    let pool = target.pool(&config.database_url, connections).await?;
    let result = f(&pool, config).await;
    pool.close().await;
    result
}

/// The slot's figures now: lag bytes, retained WAL, confirmed position, whether a session
/// streams. One query; safe to call while a relay runs.
pub async fn wal_status(config: &WalConfig) -> Result<WalStatus, WalError> {
    with_pool(config, 1, slot::read_status).await
}

/// Like [`wal_status`], sampled twice `over` apart to add the decode rate (bytes and
/// transactions per second, from `pg_stat_replication_slots`, which PostgreSQL updates about
/// once a second).
pub async fn wal_status_sampled(config: &WalConfig, over: Duration) -> Result<WalStatus, WalError> {
    let (first, mut second, secs) = with_pool(config, 1, async |pool, config| {
        let first = slot::read_status(pool, config).await?;
        let started = Instant::now();
        tokio::time::sleep(over).await;
        let second = slot::read_status(pool, config).await?;
        Ok((first, second, started.elapsed().as_secs_f64()))
    })
    .await?;
    if secs > 0.0 {
        if let (Some(a), Some(b)) = (first.total_bytes, second.total_bytes) {
            second.decode_bytes_per_sec = Some((b - a).max(0) as f64 / secs);
        }
        if let (Some(a), Some(b)) = (first.total_txns, second.total_txns) {
            second.decode_txns_per_sec = Some((b - a).max(0) as f64 / secs);
        }
    }
    Ok(second)
}

/// Create the publication and the slot now, without streaming (step 1 of switching from polling
/// to WAL mode: from the slot's creation on, every commit is captured). Idempotent. Returns the
/// slot's confirmed position.
pub async fn prepare(config: &WalConfig) -> Result<Lsn, WalError> {
    with_pool(config, 2, async |pool, config| {
        slot::check_server(pool).await?;
        slot::ensure_slot(pool, config).await
    })
    .await
}

/// Who may write events into the message source: which overloads of
/// `pg_logical_emit_message` every role (PUBLIC) may call, who else holds EXECUTE, whether the
/// relay's own role may (heartbeats), and the statements that allow only the writers and the
/// relay. [`WalRelay::run`] refuses to start with the message source on while PUBLIC may;
/// `outbox wal prepare` prints the statements; [`WalStatus::message_source`] carries the same.
///
/// ```no_run
/// # async fn demo() -> Result<(), outbox_wal::WalError> {
/// let config = outbox_wal::WalConfig::new("postgres://relay@db/app");
/// let access = outbox_wal::message_source_access(&config).await?;
/// for statement in &access.fix {
///     println!("{statement}");
/// }
/// # Ok(()) }
/// ```
pub async fn message_source_access(config: &WalConfig) -> Result<MessageSourceAccess, WalError> {
    with_pool(config, 1, slot::message_source_access).await
}

/// Open a replication connection the way the relay does (same URL, same TLS settings; see the
/// crate docs, "TLS"), without starting replication, and report whether the server sees it
/// encrypted. `outbox wal prepare` runs it, so a `pg_hba.conf` without a replication line, a
/// server certificate that does not verify, or a session that fell back to plain text shows
/// before the relay starts. Errors are the relay's: [`WalError::Config`] names the TLS setting
/// to change.
///
/// ```no_run
/// # async fn demo() -> Result<(), outbox_wal::WalError> {
/// let config = outbox_wal::WalConfig::new("postgres://relay@db/app?sslmode=verify-full");
/// let conn = outbox_wal::check_replication_connection(&config).await?;
/// assert!(conn.tls, "{conn:?}");
/// # Ok(()) }
/// ```
pub async fn check_replication_connection(
    config: &WalConfig,
) -> Result<ReplicationConnection, WalError> {
    config.validate()?;
    let target = Target::parse(&config.database_url)?;
    conn::check_replication(&target, config).await
}

/// Drop the slot and its record (leaving WAL mode). Fails while a session streams from it.
/// Returns whether a slot was dropped.
pub async fn drop_slot(config: &WalConfig) -> Result<bool, WalError> {
    with_pool(config, 2, slot::drop_slot_and_marker).await
}

/// [`drop_slot`], retried for up to `wait` while it fails: a relay that has just stopped (or been
/// killed) holds the slot until its walsender notices, a moment later. Returns the last error
/// when the slot is still held after `wait`.
pub async fn drop_slot_waiting(
    config: &WalConfig,
    wait: std::time::Duration,
) -> Result<bool, WalError> {
    config.validate()?;
    let deadline = std::time::Instant::now() + wait;
    loop {
        match drop_slot(config).await {
            Ok(dropped) => return Ok(dropped),
            Err(error) if std::time::Instant::now() >= deadline => return Err(error),
            Err(_) => tokio::time::sleep(std::time::Duration::from_millis(100)).await,
        }
    }
}

/// What [`recover`] did.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct RecoverReport {
    /// An invalidated slot was dropped.
    pub dropped_invalidated_slot: bool,
    /// A new slot was created at this position.
    pub created_slot_at: Option<Lsn>,
    /// Undelivered table rows delivered since.
    pub redelivered: u64,
    /// Of those, dead-lettered instead.
    pub dead: u64,
}

/// Recover from a lost or invalidated slot: drop the invalidated slot, create a new one (every
/// commit from now on is captured), then deliver every row still undelivered in the outbox
/// table to `sink` (a drain of the relay: table claims take them, in order). Afterwards
/// [`WalRelay::run`] resumes streaming from the new slot. Message events that were in the lost
/// slot's WAL and never delivered cannot be recovered.
///
/// Waits up to `takeover_timeout` for the streamer lock, so it never races a running relay.
pub async fn recover(config: &WalConfig, sink: Arc<dyn Sink>) -> Result<RecoverReport, WalError> {
    config.validate()?;
    let target = Target::parse(&config.database_url)?;
    let pool = target.pool(&config.database_url, 2).await?;
    let mut report = RecoverReport::default();
    {
        let mut lock = target.connection(&config.database_url).await?;
        let deadline = Instant::now() + config.takeover_timeout;
        while !slot::try_lead(&mut lock, config).await? {
            if Instant::now() >= deadline {
                return Err(WalError::SlotBusy {
                    slot: config.slot.clone(),
                    waited_ms: config.takeover_timeout.as_millis() as u64,
                });
            }
            tokio::time::sleep(config.standby_poll_interval).await;
        }
        slot::check_server(&pool).await?;
        match slot::slot_info(&pool, &config.slot).await? {
            Some(info) if info.wal_status.as_deref() == Some("lost") => {
                slot::drop_slot_and_marker(&pool, config).await?;
                report.dropped_invalidated_slot = true;
                report.created_slot_at = Some(slot::create_slot(&pool, config).await?);
            }
            Some(_) => {}
            None => report.created_slot_at = Some(slot::create_slot(&pool, config).await?),
        }
    }
    pool.close().await;
    let drain = WalConfig {
        catch_up: true,
        ..config.clone()
    };
    let relay = RelayConfig {
        stop_when_idle: true,
        ..RelayConfig::default()
    };
    let figures = WalRelay::new(drain, sink)
        .with_relay(relay)
        .run(std::future::pending())
        .await?;
    report.redelivered = figures.delivered;
    report.dead = figures.dead;
    tracing::info!(
        ?report,
        "Recovery done; start the WAL relay to resume streaming."
    );
    Ok(report)
}
