//! Shared by the broker adapter tests: a fresh SQLite inbox, handlers that count effects and
//! the scenarios every broker passes (and the SQLite pool, by the SQLite inbox tests).

#![allow(dead_code)]

use std::future::Future;
use std::time::{Duration, Instant};

use outbox_inbox::sqlite::{SqliteHandler, SqliteInbox};
use outbox_inbox::{AdapterOptions, BoxFuture, EventId, InboxHandler};
use sqlx::SqlitePool;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};
use tokio::task::JoinHandle;

pub struct Fixture {
    pub pool: SqlitePool,
    pub inbox: SqliteInbox,
}

/// A pool on a new database file (WAL, 10 s busy timeout).
pub async fn sqlite_pool(max_connections: u32) -> SqlitePool {
    let dir = tempfile::tempdir().unwrap().keep();
    let options = SqliteConnectOptions::new()
        .filename(dir.join("inbox.db"))
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .busy_timeout(Duration::from_secs(10));
    SqlitePoolOptions::new()
        .max_connections(max_connections)
        .connect_with(options)
        .await
        .unwrap()
}

pub async fn fixture() -> Fixture {
    let pool = sqlite_pool(4).await;
    let inbox = SqliteInbox::with_table("inbox").unwrap();
    inbox.migrate(&pool).await.unwrap();
    sqlx::raw_sql("CREATE TABLE effects (event_id TEXT NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();
    Fixture { pool, inbox }
}

type Effect = for<'c> fn(
    &'c mut sqlx::Transaction<'static, sqlx::Sqlite>,
    &'c outbox_inbox::Delivery,
) -> BoxFuture<'c, Result<(), outbox_inbox::BoxError>>;

/// The effect every handler here applies: a row in `effects`.
async fn insert_effect(
    tx: &mut sqlx::Transaction<'static, sqlx::Sqlite>,
    d: &outbox_inbox::Delivery,
) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO effects (event_id) VALUES (?1)")
        .bind(d.event_id.to_string())
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// Insert the effect, then end as `outcome` says for the delivery: what the effects below
/// share.
fn insert_then<'c>(
    tx: &'c mut sqlx::Transaction<'static, sqlx::Sqlite>,
    d: &'c outbox_inbox::Delivery,
    outcome: fn(&outbox_inbox::Delivery) -> Result<(), outbox_inbox::BoxError>,
) -> BoxFuture<'c, Result<(), outbox_inbox::BoxError>> {
    Box::pin(async move {
        insert_effect(tx, d).await?;
        outcome(d)
    })
}

fn record<'c>(
    tx: &'c mut sqlx::Transaction<'static, sqlx::Sqlite>,
    d: &'c outbox_inbox::Delivery,
) -> BoxFuture<'c, Result<(), outbox_inbox::BoxError>> {
    insert_then(tx, d, |_| Ok(()))
}

fn record_then_fail<'c>(
    tx: &'c mut sqlx::Transaction<'static, sqlx::Sqlite>,
    d: &'c outbox_inbox::Delivery,
) -> BoxFuture<'c, Result<(), outbox_inbox::BoxError>> {
    insert_then(tx, d, |_| Err("downstream rejected the event".into()))
}

/// Fails on the first delivery, succeeds on later ones.
fn fail_first<'c>(
    tx: &'c mut sqlx::Transaction<'static, sqlx::Sqlite>,
    d: &'c outbox_inbox::Delivery,
) -> BoxFuture<'c, Result<(), outbox_inbox::BoxError>> {
    insert_then(tx, d, |d| {
        if d.attempt == 1 {
            return Err("first delivery fails".into());
        }
        Ok(())
    })
}

/// Needs a JSON payload: anything else is a non-transient `BadMessage`.
fn needs_json<'c>(
    tx: &'c mut sqlx::Transaction<'static, sqlx::Sqlite>,
    d: &'c outbox_inbox::Delivery,
) -> BoxFuture<'c, Result<(), outbox_inbox::BoxError>> {
    Box::pin(async move {
        let _: serde_json::Value = d.json()?;
        Ok(insert_effect(tx, d).await?)
    })
}

impl Fixture {
    /// The handler `billing` running `effect`.
    fn handler_with(&self, effect: Effect) -> SqliteHandler<Effect> {
        SqliteHandler::new(self.pool.clone(), self.inbox.clone(), "billing", effect).unwrap()
    }

    /// A handler whose effect fails on the first delivery only.
    pub fn flaky_handler(&self) -> SqliteHandler<Effect> {
        self.handler_with(fail_first)
    }

    /// A handler whose effect parses the payload as JSON.
    pub fn json_handler(&self) -> SqliteHandler<Effect> {
        self.handler_with(needs_json)
    }

    /// A handler whose effect inserts into `effects`.
    pub fn handler(&self) -> SqliteHandler<Effect> {
        self.handler_with(record)
    }

    /// A handler whose effect writes and then always fails.
    pub fn failing_handler(&self) -> SqliteHandler<Effect> {
        self.handler_with(record_then_fail)
    }

    pub async fn effects(&self) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM effects")
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }

    pub async fn parked(&self) -> Vec<outbox_inbox::ParkedMessage> {
        self.inbox.parked(&self.pool, "billing", 100).await.unwrap()
    }

    /// Wait up to `timeout` for a parked message.
    pub async fn wait_parked(&self, timeout: Duration) -> bool {
        eventually(timeout, || async { !self.parked().await.is_empty() }).await
    }

    /// What the always-failing handler leaves behind after `attempts` deliveries of event `id`
    /// with body `payload`: one parked message saying why, and no effect (each was rolled back).
    pub async fn assert_parked_after_failures(&self, id: EventId, attempts: u32, payload: &[u8]) {
        let parked = self.parked().await;
        assert_eq!(parked.len(), 1);
        assert_eq!(parked[0].event_id, Some(id));
        assert_eq!(parked[0].attempts, attempts);
        assert!(parked[0].error.contains("downstream rejected"));
        assert_eq!(parked[0].payload, payload);
        assert_eq!(self.effects().await, 0, "failed effects were rolled back");
    }
}

/// Poll `check` until it is true or `timeout` passes.
pub async fn eventually<F, Fut>(timeout: Duration, mut check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let start = Instant::now();
    while start.elapsed() < timeout {
        if check().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}

/// An adapter running in the background until aborted.
pub type Runner = JoinHandle<Result<(), outbox_inbox::Error>>;

/// A broker's channel of its own for one test — a stream with the consumer group `billing`
/// (NATS JetStream, Redis Streams), a queue (RabbitMQ), a topic with a consumer group of its own
/// (Kafka) — and the adapter over it: what the scenarios below need.
pub trait Channel: Sized {
    /// A new channel.
    fn open() -> impl Future<Output = Self>;

    /// Publish `body` with the event id `id` (`None`: without one).
    fn publish(&mut self, id: Option<EventId>, body: &'static str) -> impl Future<Output = ()>;

    /// Run the adapter over the channel in the background, until aborted.
    fn spawn_run(&self, handler: impl InboxHandler + 'static, options: AdapterOptions) -> Runner;

    /// Wait up to `timeout` for every message to be delivered and acked (Kafka: its offset
    /// committed). Called once, after what the scenario waits for, and the adapter is stopped
    /// next: a broker that can only tell by closing the adapter's channel (RabbitMQ) may.
    fn wait_settled(&self, timeout: Duration) -> impl Future<Output = bool>;

    /// Delete the channel.
    fn delete(self) -> impl Future<Output = ()>;
}

/// What a scenario waits for before the channel settles.
#[derive(Clone, Copy, Debug)]
enum Until {
    /// The effect applied once.
    Applied,
    /// A message parked.
    Parked,
}

/// Where every scenario starts: a fixture and a new channel holding `messages` (event id,
/// body); the adapter run over it with the handler `handler` makes of the fixture and `options`
/// until `until` holds (within 30 s: the adapter's start, which on Kafka includes joining a new
/// consumer group) and every message is acked (within 10 s more); then the adapter stopped and
/// the channel deleted. The fixture, for what the scenario checks.
async fn run_until<C: Channel, H: InboxHandler + 'static>(
    messages: &[(Option<EventId>, &'static str)],
    handler: fn(&Fixture) -> H,
    options: AdapterOptions,
    until: Until,
) -> Fixture {
    let f = fixture().await;
    let mut channel = C::open().await;
    for &(id, body) in messages {
        channel.publish(id, body).await;
    }
    let runner = channel.spawn_run(handler(&f), options);
    let first = Duration::from_secs(30);
    let reached = match until {
        Until::Applied => eventually(first, || async { f.effects().await == 1 }).await,
        Until::Parked => f.wait_parked(first).await,
    };
    assert!(reached, "{until:?} not reached");
    let settled = channel.wait_settled(Duration::from_secs(10)).await;
    assert!(settled, "every message acked");
    runner.abort();
    channel.delete().await;
    f
}

/// The same event delivered twice: applied once, both acked, nothing parked.
pub async fn same_event_twice_applies_once_and_acks<C: Channel>() {
    let event = (Some(EventId::new()), r#"{"n":1}"#);
    let options = AdapterOptions::default();
    let f = run_until::<C, _>(&[event, event], Fixture::handler, options, Until::Applied).await;
    assert_eq!(f.effects().await, 1);
    assert!(f.parked().await.is_empty());
}

/// A handler that always fails: parked after three attempts, then acked; its effects rolled
/// back.
pub async fn always_failing_handler_is_parked_after_max_attempts_and_acked<C: Channel>() {
    let id = EventId::new();
    let options = AdapterOptions::default()
        .with_max_attempts(3)
        .with_retry_delay(Duration::from_millis(100));
    let event = (Some(id), r#"{"n":2}"#);
    let f = run_until::<C, _>(&[event], Fixture::failing_handler, options, Until::Parked).await;
    f.assert_parked_after_failures(id, 3, br#"{"n":2}"#).await;
}

/// A first delivery that fails comes again (redelivered, reclaimed or retried in place) and is
/// applied once.
pub async fn failed_first_delivery_is_delivered_again_and_applied_once<C: Channel>() {
    let options = AdapterOptions::default().with_retry_delay(Duration::from_millis(100));
    let event = (Some(EventId::new()), r#"{"n":3}"#);
    let f = run_until::<C, _>(&[event], Fixture::flaky_handler, options, Until::Applied).await;
    assert_eq!(f.effects().await, 1);
    assert!(f.parked().await.is_empty());
}

/// A message without an event id cannot be deduplicated: parked at its first delivery, with no
/// event id, and acked.
pub async fn message_without_event_id_is_parked_at_once<C: Channel>() {
    let options = AdapterOptions::default();
    let message = (None, "not an event");
    let f = run_until::<C, _>(&[message], Fixture::handler, options, Until::Parked).await;
    let parked = f.parked().await;
    assert_eq!(parked.len(), 1);
    assert_eq!(parked[0].event_id, None);
    assert_eq!(parked[0].attempts, 1);
}

/// A payload the handler cannot read (not JSON) is a bad message: parked at its first delivery
/// although attempts are left, and acked.
pub async fn malformed_payload_is_parked_without_retries<C: Channel>() {
    let options = AdapterOptions::default().with_max_attempts(5);
    let event = (Some(EventId::new()), "not json");
    let f = run_until::<C, _>(&[event], Fixture::json_handler, options, Until::Parked).await;
    let parked = f.parked().await;
    assert_eq!(parked.len(), 1);
    assert_eq!(parked[0].attempts, 1);
    assert!(
        parked[0].error.contains("not the expected JSON"),
        "{}",
        parked[0].error
    );
}

/// The scenarios above as `#[tokio::test]`s over the channel `$channel`, each named as its
/// scenario but the failed-first-delivery one, named `$failed_first` in the broker's words
/// (redelivered, reclaimed, retried). `@as $channel; name = scenario, …` for tests named in the
/// broker's own words; `@on #[test attribute] $channel; name = scenario, …` for a runtime other
/// than `#[tokio::test]`'s.
#[allow(unused_macros)]
macro_rules! channel_tests {
    ($channel:ty; $failed_first:ident) => {
        $crate::common::channel_tests!(@as $channel;
            same_event_twice_applies_once_and_acks = same_event_twice_applies_once_and_acks,
            always_failing_handler_is_parked_after_max_attempts_and_acked =
                always_failing_handler_is_parked_after_max_attempts_and_acked,
            $failed_first = failed_first_delivery_is_delivered_again_and_applied_once,
            message_without_event_id_is_parked_at_once = message_without_event_id_is_parked_at_once,
            malformed_payload_is_parked_without_retries =
                malformed_payload_is_parked_without_retries,
        );
    };
    (@as $channel:ty; $($name:ident = $scenario:ident),* $(,)?) => {
        $crate::common::channel_tests!(@on #[tokio::test] $channel; $($name = $scenario),*);
    };
    (@on #[$test:meta] $channel:ty; $($name:ident = $scenario:ident),* $(,)?) => {
        $(
            #[$test]
            async fn $name() {
                $crate::common::$scenario::<$channel>().await;
            }
        )*
    };
}
#[allow(unused_imports)]
pub(crate) use channel_tests;
